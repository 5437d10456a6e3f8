"""`graft.py complement`: how complementary candidate models are, before a pair run is trained.

`python graft.py complement SRC1 SRC2 [SRC3 ...] [--n 8] [--batch-size 128]` (or `python -m tools.complement ...`).
A source is a folder of this project's rollout files (`<run>/exchange/<side>/step_*.safetensors`, e.g. from a
GRPO run) or a `graft.py eval` result JSON. Prompts are matched by id across sources. For every ordered pair
(source -> receiver) it prints the paper's statistics (the share of the receiver's all-fail prompts on which the
source is mixed, and on which the source solves at least once), the expected number of candidate prompts per
step in each direction at the given batch size (Eq. 4's |C|), and the balanced-swap m that implies (README
"Choosing a pair"). Run it on short GRPO runs or evaluations of the candidate models before spending GPU-days on
a pair. `--json FILE` writes the same report (complement_json), which is also the "complement" entry of
`graft.py preflight`'s report (preflight.py samples the counts itself). It imports torch, the standard library
and exchange.py (the rollout file: read_rewards reads only its prompt ids and rewards).

Our choices, where the paper is silent (numbered so that reviews can cite them):
  1. Sample counts other than n. A source may hold N != n samples of a prompt (an evaluation at 16
     samples, or a prompt met at several steps). With k of the N correct, the probabilities that n fresh
     rollouts all fail / all pass are estimated by C(N-k, n) / C(N, n) and C(k, n) / C(N, n): the
     unbiased estimators of (1-p)^n and p^n from N Bernoulli draws (choose n of the N samples at random
     without replacement). With N = n they are exactly the 0/1 indicators of the paper's counting, so the
     table is the paper's statistic whenever the sources have n samples. N < n is an error (the estimate
     would be an extrapolation).
  2. A prompt met at several steps of a rollout folder (a run longer than one epoch): by default the
     union of all its rollouts (N = 8 x occurrences, through choice 1), which uses every sample; with
     `--aggregate latest` only its last step's group counts (the policy at its most trained).
  3. Expected candidates per step = (expected share of prompts that are candidates) x batch size, since
     every prompt is equally likely to be in a batch. The balanced m printed is the smaller of the two
     directions' expected counts; the mean per-step min is at most that (min is concave), so it is an
     upper estimate of how many groups a balanced step exchanges.

Launch lines:
    python graft.py complement runs/grpo_a/exchange/a runs/grpo_b/exchange/b --n 8 --batch-size 128
    python graft.py complement runs/qwen/eval_results.json runs/smollm/eval_results.json --n 8
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from core import SUCCESS_THRESHOLD, success_counts
from exchange import read_rewards, write_json


# ------------------------------------------------------------------------------------------------
# Complementarity: the core (pure functions on tensors)
#
# Shape letters: Q prompts seen by both sources, n rollouts per prompt in the planned pair run.
# ------------------------------------------------------------------------------------------------


def _comb_ratio(a: torch.Tensor, total: torch.Tensor, n: int) -> torch.Tensor:
    """C(a, n) / C(total, n) elementwise, as the product over j < n of (a - j) / (total - j).

    a, total: (Q,) integer counts with 0 <= a <= total and total >= n. Returns (Q,) float64.
    A factor (a - j) reaches 0 when a < n, which is C(a, n) = 0; clamping keeps later factors at 0.
    """
    j = torch.arange(n, dtype=torch.float64)  # (n,)
    terms = (a.double()[:, None] - j).clamp(min=0) / (total.double()[:, None] - j)  # (Q, n)
    return terms.prod(dim=1)  # (Q,)


def _samples(k: torch.Tensor, samples, n: int, what: str) -> torch.Tensor:
    """Per-prompt sample counts N as a (Q,) int64 tensor (an int is broadcast), checked against k and n."""
    total = torch.as_tensor(n if samples is None else samples, dtype=torch.int64).expand(k.shape)  # (Q,)
    assert bool((k >= 0).all()) and bool((k <= total).all()), f"{what}: success counts must lie in [0, N]"
    if bool((total < n).any()):
        raise ValueError(f"{what}: some prompts have only {int(total.min())} samples, fewer than n={n}; "
                         f"statistics at n would be an extrapolation (lower --n or sample more)")
    return total


def prob_all_fail(k: torch.Tensor, samples: torch.Tensor | int | None = None, *, n: int) -> torch.Tensor:
    """Estimated P(n fresh rollouts all fail) per prompt: C(N - k, n) / C(N, n) (choice 1).

    k: (Q,) success counts out of samples N ((Q,) or an int; None means N = n). Returns (Q,) float64;
    with N = n it is exactly 1[k = 0].
    """
    total = _samples(k, samples, n, "prob_all_fail")
    return _comb_ratio(total - k, total, n)


def prob_all_pass(k: torch.Tensor, samples: torch.Tensor | int | None = None, *, n: int) -> torch.Tensor:
    """Estimated P(n fresh rollouts all pass) per prompt: C(k, n) / C(N, n). Shapes as prob_all_fail."""
    total = _samples(k, samples, n, "prob_all_pass")
    return _comb_ratio(k, total, n)


def complementarity(*, k_recv: torch.Tensor, k_src: torch.Tensor, n: int, batch_size: int,
                    samples_recv: torch.Tensor | int | None = None,
                    samples_src: torch.Tensor | int | None = None) -> dict[str, float]:
    """The paper's complementarity statistics for the direction source -> receiver, and its candidates.

    k_recv, k_src: (Q,) success counts of the two models on the same Q prompts, out of samples_recv /
    samples_src ((Q,) or int; None means n). Returns floats:
      prompts             Q
      recv_all_fail       expected number of prompts on which the receiver fails all n
      mixed_share         share of those on which the source is mixed (1 <= k < n): the candidates
      solved_share        share of those on which the source solves at least once (k >= 1)
      candidate_frac      expected share of all prompts that are candidates (Eq. 4)
      candidates_per_step candidate_frac x batch_size (choice 3)
    The shares are NaN when the receiver fails no prompt. The two models' samples are independent, so
    per prompt P(candidate) = P(receiver fails all) x P(source mixed).
    """
    assert k_recv.dim() == 1 and k_recv.shape == k_src.shape, "k_recv and k_src must be (Q,) and equal"
    assert n >= 2 and batch_size >= 1, f"need n >= 2 and batch_size >= 1, got n={n}, batch_size={batch_size}"
    fail_r = prob_all_fail(k_recv, samples_recv, n=n)  # (Q,)
    fail_s = prob_all_fail(k_src, samples_src, n=n)  # (Q,)
    mixed_s = 1.0 - fail_s - prob_all_pass(k_src, samples_src, n=n)  # (Q,)
    cand = fail_r * mixed_s  # (Q,) P(q is a candidate for src -> recv)
    q, f = k_recv.numel(), float(fail_r.sum())
    frac = float(cand.sum()) / q if q else float("nan")
    return {"prompts": float(q), "recv_all_fail": f,
            "mixed_share": float(cand.sum()) / f if f > 0 else float("nan"),
            "solved_share": float((fail_r * (1.0 - fail_s)).sum()) / f if f > 0 else float("nan"),
            "candidate_frac": frac, "candidates_per_step": frac * batch_size}


def pair_complementarity(*, k_a: torch.Tensor, k_b: torch.Tensor, n: int, batch_size: int,
                         samples_a: torch.Tensor | int | None = None,
                         samples_b: torch.Tensor | int | None = None) -> dict:
    """Both directions of a pair and the balanced-swap m: {"a_to_b": ..., "b_to_a": ..., "m": float}.

    k_a, k_b: (Q,) success counts on the same prompts. "a_to_b" is complementarity with B receiving A's
    groups; m = min of the two expected candidate counts per step (choice 3).
    """
    a_to_b = complementarity(k_recv=k_b, k_src=k_a, n=n, batch_size=batch_size, samples_recv=samples_b,
                             samples_src=samples_a)
    b_to_a = complementarity(k_recv=k_a, k_src=k_b, n=n, batch_size=batch_size, samples_recv=samples_a,
                             samples_src=samples_b)
    return {"a_to_b": a_to_b, "b_to_a": b_to_a,
            "m": min(a_to_b["candidates_per_step"], b_to_a["candidates_per_step"])}


# ------------------------------------------------------------------------------------------------
# Complementarity: reading sources (rollout folders and eval result files)
# ------------------------------------------------------------------------------------------------


@dataclass
class SourceCounts:
    """Per-prompt success counts of one source: counts[id] = (k correct, N samples)."""

    path: str
    kind: str  # "rollouts" | "eval"
    counts: dict[str, tuple[int, int]]
    note: str = ""  # one line for the legend: steps, samples, data seed, model


def read_rollout_folder(path: str | os.PathLike, *, aggregate: str = "union") -> SourceCounts:
    """Success counts from a folder of rollout files (exchange.py format), one entry per prompt id.

    aggregate: "union" pools every occurrence of a prompt (k and N summed over steps), "latest" keeps
    the group of its last step (choice 2). A success is core.is_success (reward >= 0.5), as in Eq. 4.
    """
    assert aggregate in ("union", "latest"), f"aggregate must be union or latest, got {aggregate!r}"
    folder = Path(path)
    files = sorted(folder.glob("step_*.safetensors"))
    if not files:
        sub = sorted({str(p.parent) for p in folder.rglob("step_*.safetensors")}) if folder.is_dir() else []
        hint = f"; folders below it that have some: {', '.join(sub[:6])}" if sub else ""
        raise ValueError(f"{folder}: no step_*.safetensors rollout files{hint}")
    counts: dict[str, tuple[int, int]] = {}
    metas = []
    for f in files:
        ids, rewards, meta = read_rewards(f)
        metas.append(meta)
        k, n = success_counts(rewards).tolist(), rewards.shape[1]  # (G,) successes per prompt of this step
        for pid, kk in zip(ids, k):
            if aggregate == "union" and pid in counts:
                k0, n0 = counts[pid]
                counts[pid] = (k0 + kk, n0 + n)
            else:  # files are in step order, so the last write is the latest occurrence
                counts[pid] = (kk, n)
    seeds = sorted({m.get("data_seed", "?") for m in metas})
    note = (f"{len(files)} steps, n={metas[-1].get('n')}, data seed {','.join(seeds)}, "
            f"model {metas[-1].get('model', '?')}, aggregate {aggregate}")
    return SourceCounts(str(folder), "rollouts", counts, note)


def read_eval_results(path: str | os.PathLike) -> SourceCounts:
    """Success counts from a `graft.py eval` result JSON: {"problems": {benchmark: [{"id", "correct": [0/1, ...]}]}}.

    Every benchmark of the file is read; an id found in two benchmarks is an error (ids must name one
    prompt). A score >= core.SUCCESS_THRESHOLD (0.5) counts as a success, as in Eq. 4.
    """
    path = Path(path)
    try:
        payload = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not a readable JSON file ({e})") from e
    problems = payload.get("problems") if isinstance(payload, dict) else None
    if not isinstance(problems, dict) or not problems:
        raise ValueError(f"{path}: no 'problems' object of per-problem results (is it a graft.py eval output?)")
    counts: dict[str, tuple[int, int]] = {}
    where: dict[str, str] = {}
    for bench, rows in problems.items():
        if not isinstance(rows, list):
            raise ValueError(f"{path}: problems[{bench!r}] must be a list of per-problem results")
        for i, row in enumerate(rows):
            ok = (isinstance(row, dict) and isinstance(row.get("id"), str) and isinstance(row.get("correct"), list)
                  and row["correct"]
                  and all(isinstance(c, (int, float)) and not isinstance(c, bool) for c in row["correct"]))
            if not ok:
                raise ValueError(f"{path}: problems[{bench!r}][{i}] needs a string 'id' and a non-empty list 'correct' "
                                 f"of numbers, got {str(row)[:200]}")
            if row["id"] in counts:
                raise ValueError(f"{path}: id {row['id']!r} appears in both {where[row['id']]!r} and {bench!r}")
            counts[row["id"]] = (sum(c >= SUCCESS_THRESHOLD for c in row["correct"]), len(row["correct"]))
            where[row["id"]] = bench
    samples = sorted({nn for _, nn in counts.values()})
    note = f"eval of {payload.get('model', '?')}: {', '.join(problems)}; samples {','.join(map(str, samples))}"
    return SourceCounts(str(path), "eval", counts, note)


def read_source(path: str | os.PathLike, *, aggregate: str = "union") -> SourceCounts:
    """A folder is read as rollout files, a file as an eval result JSON."""
    p = Path(path)
    if p.is_dir():
        return read_rollout_folder(p, aggregate=aggregate)
    if p.is_file():
        return read_eval_results(p)
    raise ValueError(f"{p}: no such folder of rollout files or eval result file")


def align(a: SourceCounts, b: SourceCounts) -> tuple[list[str], torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The prompts both sources saw (sorted ids) and their counts: ids, k_a, N_a, k_b, N_b, each (Q,) int64."""
    ids = sorted(set(a.counts) & set(b.counts))
    t = lambda src, j: torch.tensor([src.counts[i][j] for i in ids], dtype=torch.int64)  # noqa: E731  (Q,)
    return ids, t(a, 0), t(a, 1), t(b, 0), t(b, 1)


# ------------------------------------------------------------------------------------------------
# Complementarity: the table for every ordered pair, and the command line
# ------------------------------------------------------------------------------------------------


def complement_rows(sources: list[SourceCounts], *, n: int, batch_size: int) -> list[dict]:
    """One row per ordered pair (source i -> receiver j, i != j), on the prompts both saw.

    Each row: src, recv (indices into sources), the complementarity dict of src -> recv, "reverse"
    (expected candidates per step recv -> src) and "m"; a pair with no common prompt has prompts = 0.
    """
    rows = []
    for i, s in enumerate(sources):
        for j, r in enumerate(sources):
            if i == j:
                continue
            ids, k_s, n_s, k_r, n_r = align(s, r)
            if not ids:
                rows.append({"src": i, "recv": j, "prompts": 0})
                continue
            try:
                pair = pair_complementarity(k_a=k_s, k_b=k_r, n=n, batch_size=batch_size, samples_a=n_s, samples_b=n_r)
            except ValueError as e:
                raise ValueError(f"{s.path} vs {r.path}: {e}") from e
            rows.append({"src": i, "recv": j, **pair["a_to_b"], "reverse": pair["b_to_a"]["candidates_per_step"],
                         "m": pair["m"]})
    return rows


def format_complement_table(sources: list[SourceCounts], rows: list[dict], *, n: int, batch_size: int) -> str:
    """The printed table: a legend of the sources, then one line per ordered pair."""
    pct = lambda x: "-" if math.isnan(x) else f"{100 * x:.1f}%"  # noqa: E731
    out = [f"complementarity at n={n} rollouts per prompt, {batch_size} prompts per step "
           f"(Eq. 4; README 'Choosing a pair')"]
    for i, s in enumerate(sources):
        out.append(f"  S{i + 1} = {s.path}  [{s.kind}: {len(s.counts)} prompts; {s.note}]")
    head = (f"{'source -> receiver':<20} {'prompts':>8} {'recv all-fail':>15} {'src mixed':>10} {'src solves':>11} "
            f"{'cand/step':>10} {'reverse':>8} {'m':>6}")
    out += [head, "-" * len(head)]
    for r in rows:
        name = f"S{r['src'] + 1} -> S{r['recv'] + 1}"
        if r["prompts"] == 0:
            out.append(f"{name:<20} {0:>8}   no prompt in common")
            continue
        fail = f"{r['recv_all_fail']:.0f} ({pct(r['recv_all_fail'] / r['prompts'])})"
        out.append(f"{name:<20} {r['prompts']:>8.0f} {fail:>15} {pct(r['mixed_share']):>10} "
                   f"{pct(r['solved_share']):>11} {r['candidates_per_step']:>10.2f} {r['reverse']:>8.2f} "
                   f"{r['m']:>6.2f}")
    out.append("recv all-fail: prompts the receiver fails on all n; src mixed / src solves: share of those on which\n"
               "the source has 1 <= k < n / k >= 1 successes; cand/step: expected candidates source -> receiver per\n"
               "step; reverse: receiver -> source; m: balanced swap, the smaller of the two")
    return "\n".join(out)


def complement_json(sources: list[SourceCounts], rows: list[dict], *, n: int, batch_size: int) -> dict:
    """The same report as format_complement_table, as JSON: the settings, the sources and the rows (NaN -> None)."""
    clean = lambda v: None if isinstance(v, float) and math.isnan(v) else v  # noqa: E731  (JSON has no NaN)
    return {"n": n, "batch_size": batch_size,
            "sources": [{"path": s.path, "kind": s.kind, "prompts": len(s.counts), "note": s.note} for s in sources],
            "rows": [{k: clean(v) for k, v in r.items()} for r in rows]}


def build_complement_parser(prog: str = "graft.py complement") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="Complementarity of two or more models from GRPO rollout "
                                "folders or graft.py eval results on the same prompts: for every ordered pair, the "
                                "share of the receiver's all-fail prompts the source can help on, and the expected "
                                "exchange per step.")
    p.add_argument("sources", nargs="+", help="rollout folders (<run>/exchange/<side>) or eval result JSON files")
    p.add_argument("--n", "--rollouts", dest="n", type=int, default=8,
                   help="rollouts per prompt of the planned pair run")
    p.add_argument("--batch-size", type=int, default=128, help="prompts per step of the planned pair run")
    p.add_argument("--aggregate", choices=("union", "latest"), default="union",
                   help="a prompt met at several steps: pool all its rollouts, or keep its last step's group")
    p.add_argument("--json", default="", help="also write the table as JSON to this file (as graft.py preflight's "
                   "'complement' entry)")
    return p


def main(argv: list[str] | None = None, *, prog: str = "graft.py complement") -> int:
    """`graft.py complement` / `python -m tools.complement`: read the sources, print the table. Returns 0."""
    args = build_complement_parser(prog).parse_args(argv)
    if len(args.sources) < 2:
        raise SystemExit(f"{prog}: needs at least two sources, got {len(args.sources)}")
    if args.n < 2 or args.batch_size < 1:
        raise SystemExit(f"{prog}: --n must be >= 2 and --batch-size >= 1 (got {args.n}, {args.batch_size})")
    t0 = time.time()
    try:
        sources = [read_source(s, aggregate=args.aggregate) for s in args.sources]
        rows = complement_rows(sources, n=args.n, batch_size=args.batch_size)
    except ValueError as e:
        raise SystemExit(f"{prog}: {e}")
    print(format_complement_table(sources, rows, n=args.n, batch_size=args.batch_size))
    if args.json:
        write_json(Path(args.json), complement_json(sources, rows, n=args.n, batch_size=args.batch_size))
    print(f"[complement] {time.time() - t0:.1f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:], prog="python -m tools.complement"))
