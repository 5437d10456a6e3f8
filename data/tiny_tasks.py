"""Generated arithmetic and algebra problems for the tiny CPU preset .

Contract
--------
``python data/tiny_tasks.py --out DIR --seed S --train N --test M`` writes ``DIR/train.jsonl`` and
``DIR/test.jsonl``: one JSON object per line with the keys

    {"id", "problem", "answer", "family", "solution"}

* ``answer`` is the canonical decimal string of a non-negative integer, so a plain integer comparison
  checks it (``verify.py`` extracts the last ``\\boxed{}`` of a response and compares it).
* ``solution`` is a short worked solution ending in ``\\boxed{answer}``; it is the SFT target of the
  tiny pre-training and is never shown to the RL trainer.
* The output is a pure function of ``seed``, ``N`` and ``M``: the same arguments give byte-identical
  files. The rows are balanced over the families (``N // F`` each, the remainder to the first ones)
  and the two splits are disjoint: no problem text occurs in both (nor twice in one split).

Families (all answers are small non-negative integers; every solution uses only ``0-9+-*/=x.,``,
letters, spaces and ``\\boxed{}``):

    add     What is 47+38?          47+38=40+30+7+8=70+15=85. \\boxed{85}
    sub     What is 83-27?          83-27=83-20-7=63-7=56. \\boxed{56}
    mul     What is 7*38?           7*38=7*30+7*8=210+56=266. \\boxed{266}   (also 38*7)
    linear  Solve 4x+7=39.          4x=39-7=32, x=32/4=8. \\boxed{8}
    mul2    What is 47*38?          47*38=47*30+47*8=1410+376=1786. \\boxed{1786}

The worked solutions of ``mul`` and ``linear`` reuse the skills of ``add`` and ``sub`` (and a
one-digit times table), so a model pre-trained mostly on one pair of families is weak, but not at
zero, on the other pair: the regime in which GRAFT's candidate rule and compatibility gate can both
fire. ``mul2`` (added for the beyond-sample measure) is the hard family: its partial products are
two-digit times one-digit, a step neither tiny model is taught, so both fail it nearly always, as
both paper models fail many MATH problems; it makes the share of a model's all-fail problems that
its peer solves resemble the paper's instead of 70-90%.

Departure from the brief's example families: ``sub`` replaces ``mod``. A ``mod`` answer is one digit
below the divisor, so a model that guesses scores ~20% by chance, which hides whether RL taught it
anything; every family here has a wide answer range.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from typing import Callable

# ------------------------------------------------------------------------------------------------
# Families: each draws one problem from an rng and returns (problem, answer, worked solution)
# ------------------------------------------------------------------------------------------------


def _add(rng: random.Random) -> tuple[str, int, str]:
    # Worked digit by digit: tens and units are added separately, then combined. A ~1M-parameter
    # model learns these short steps far faster than the carry of a one-shot "47+38=85".
    a, b = rng.randint(10, 99), rng.randint(10, 99)
    s = a + b
    (at, au), (bt, bu) = divmod(a, 10), divmod(b, 10)
    steps = f"{at * 10}+{bt * 10}+{au}+{bu}={(at + bt) * 10}+{au + bu}"
    return f"What is {a}+{b}?", s, f"{a}+{b}={steps}={s}. \\boxed{{{s}}}"


def _sub(rng: random.Random) -> tuple[str, int, str]:
    # Worked as a - tens - units, so each step subtracts a single non-zero digit.
    a = rng.randint(20, 99)
    b = rng.randint(10, a)
    d = a - b
    bt, bu = divmod(b, 10)
    steps = f"{a}-{bt * 10}-{bu}={a - bt * 10}-{bu}"
    return f"What is {a}-{b}?", d, f"{a}-{b}={steps}={d}. \\boxed{{{d}}}"


def _mul(rng: random.Random) -> tuple[str, int, str]:
    # One digit times two digits (either order), worked as a*(10t+u) = a*10t + a*u: the tens product
    # is a times-table entry with a zero appended, and the last step is an addition.
    a, b = rng.randint(2, 9), rng.randint(11, 99)
    tens, units = b // 10 * 10, b % 10
    p = a * b
    if rng.random() < 0.5:
        q, steps = f"{a}*{b}", f"{a}*{tens}+{a}*{units}"
    else:
        q, steps = f"{b}*{a}", f"{tens}*{a}+{units}*{a}"
    return f"What is {q}?", p, f"{q}={steps}={a * tens}+{a * units}={p}. \\boxed{{{p}}}"


def _linear(rng: random.Random) -> tuple[str, int, str]:
    a, x, b = rng.randint(2, 9), rng.randint(1, 12), rng.randint(1, 40)
    c = a * x + b
    sol = f"{a}x={c}-{b}={c - b}, x={c - b}/{a}={x}. \\boxed{{{x}}}"
    return f"Solve {a}x+{b}={c}.", x, sol


def _mul2(rng: random.Random) -> tuple[str, int, str]:
    # Two digits times two digits, worked as a*(10t+u) = a*10t + a*u like ``mul``; the two partial
    # products are each a two-digit-times-one-digit product, which neither tiny model is taught to
    # form in one step. It is the hard part of the set: the problems both models fail (see tiny.py).
    a, b = rng.randint(11, 99), rng.randint(11, 99)
    tens, units = b // 10 * 10, b % 10
    p = a * b
    return f"What is {a}*{b}?", p, f"{a}*{b}={a}*{tens}+{a}*{units}={a * tens}+{a * units}={p}. \\boxed{{{p}}}"


FAMILIES: dict[str, Callable[[random.Random], tuple[str, int, str]]] = {
    "add": _add,
    "sub": _sub,
    "mul": _mul,
    "linear": _linear,
    "mul2": _mul2,
}
"""Family name -> generator. The order is part of the contract (it fixes the seeded output)."""

# ------------------------------------------------------------------------------------------------
# Splits
# ------------------------------------------------------------------------------------------------


def _per_family(total: int) -> list[int]:
    """Split ``total`` rows over the families as evenly as possible, remainder to the first ones."""
    k, r = divmod(total, len(FAMILIES))
    return [k + (i < r) for i in range(len(FAMILIES))]


def generate(seed: int, n_train: int, n_test: int) -> tuple[list[dict], list[dict]]:
    """Return (train rows, test rows), deterministic in the arguments, disjoint by problem text.

    The test split is drawn first, so growing ``n_train`` never changes the test set. Each family
    has its own rng (seeded from ``seed`` and the family name), so adding a family leaves the
    others' problems unchanged.
    """
    train: list[dict] = []
    test: list[dict] = []
    for (name, gen), k_train, k_test in zip(FAMILIES.items(), _per_family(n_train), _per_family(n_test)):
        rng = random.Random(f"tiny_tasks/{seed}/{name}")
        seen: set[str] = set()
        for split, k, rows in (("test", k_test, test), ("train", k_train, train)):
            i, tries = 0, 0
            while i < k:
                tries += 1
                if tries > 200 * (k + 10):  # the family's problem space is exhausted
                    raise ValueError(f"family {name!r} cannot supply {k} distinct {split} problems")
                problem, answer, solution = gen(rng)
                if problem in seen:
                    continue
                seen.add(problem)
                rows.append({"id": f"{name}-{split}-{i:05d}", "problem": problem, "answer": str(answer),
                             "family": name, "solution": solution})
                i += 1
    return train, test


def write_jsonl(path: str, rows: list[dict]) -> None:
    """Write rows as JSONL atomically (temp file + rename), so a killed run leaves no half file."""
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    os.replace(tmp, path)


# ------------------------------------------------------------------------------------------------
# CLI
# ------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="output directory (created if missing)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--train", type=int, default=4000, help="train rows, balanced over the families")
    p.add_argument("--test", type=int, default=800, help="held-out rows, balanced over the families")
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    train, test = generate(args.seed, args.train, args.test)
    write_jsonl(os.path.join(args.out, "train.jsonl"), train)
    write_jsonl(os.path.join(args.out, "test.jsonl"), test)
    print(f"wrote {len(train)} train and {len(test)} test rows ({', '.join(FAMILIES)}) to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
