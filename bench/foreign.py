"""Benchmark of the foreign-log loader (foreign.py): a planted file of 10,000 records read, matched, re-verified
and grouped, with each phase's seconds printed (README "What we measured"; not a test).

    python -m bench.foreign --prompts ../shared/benchmarks/train_math7500.jsonl --records 10000
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

from foreign import load_foreign_log, match_records, read_foreign_records

# ------------------------------------------------------------------------------------------------
# A planted foreign log, and the timing of its load
# ------------------------------------------------------------------------------------------------



def write_planted_log(path: str | os.PathLike, prompts: list[dict], *, records: int, group: int = 5,
                      seed: int = 0) -> None:
    """A synthetic foreign file for the benchmark: `records` lines, `group` per prompt, half matched by id
    and half by (re-spaced) problem text, one response in three with a wrong boxed answer, every tenth
    prompt absent from the run (unmatched). Responses are the prompt's "solution" field when it has one,
    numbered so that no two are the same text (a repeat would be removed, choice 4)."""
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(prompts), generator=g).tolist()
    lines = []
    for r in range(records):
        p = prompts[order[(r // group) % len(prompts)]]
        body = p.get("solution") or f"We work it out step by step: {p['problem'][:200]}"
        wrong = r % 3 == 2
        rec = {"response": f"{body}\nSo the answer is $\\boxed{{{p['answer'] + ' + 1' if wrong else p['answer']}}}$ "
                           f"(sample {r}).",
               "lbar": -0.25 - 0.01 * (r % 7), "reward": float(not wrong)}
        if (r // group) % 10 == 9:
            rec["id"] = f"not-in-this-run-{r // group}"
        elif (r // group) % 2:
            rec["problem"] = "  " + p["problem"].replace(" ", "   ") + "\n"
        else:
            rec["problem_id"] = p["id"]
        lines.append(json.dumps(rec))
    Path(path).write_text("\n".join(lines) + "\n", encoding="utf-8")


def bench_foreign(prompts: list[dict], *, records: int = 10_000, group: int = 5, verify_workers: int = 0,
                  folder: str | os.PathLike | None = None) -> dict:
    """Time read + match + group + verify + advantages of a planted file of `records` lines. Returns seconds."""
    import tempfile
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        path = Path(tmp) / "foreign.jsonl"
        write_planted_log(path, prompts, records=records, group=group)
        t0 = time.perf_counter()
        recs = read_foreign_records(path)
        t1 = time.perf_counter()
        match_records(recs, prompts)
        t2 = time.perf_counter()
        log = load_foreign_log(path, prompts, verify_workers=verify_workers)  # everything again, with verification
        t3 = time.perf_counter()
        log.step([p["id"] for p in prompts[:128]])
        t4 = time.perf_counter()
    print(log.report())
    out = {"records": records, "read_s": t1 - t0, "match_s": t2 - t1, "load_total_s": t3 - t2, "step_s": t4 - t3}
    print(f"[bench-foreign] {records} records: read {out['read_s']:.2f}s, match {out['match_s']:.2f}s, "
          f"load_foreign_log total (read + match + verify + advantages) {out['load_total_s']:.2f}s, "
          f"one 128-prompt step {1000 * out['step_s']:.1f}ms")
    return out


def main(argv: list[str] | None = None) -> int:
    """`python -m bench.foreign --prompts FILE [--records N]`: bench_foreign's figures."""
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="python -m bench.foreign", description=bench_foreign.__doc__)
    p.add_argument("--prompts", required=True, help="a prompt JSONL (id, problem, answer[, solution])")
    p.add_argument("--records", type=int, default=10_000)
    p.add_argument("--verify-workers", type=int, default=0)
    a = p.parse_args(argv)
    with open(a.prompts, encoding="utf-8") as f:
        prompts = [json.loads(line) for line in f if line.strip()]
    bench_foreign(prompts, records=a.records, verify_workers=a.verify_workers)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
