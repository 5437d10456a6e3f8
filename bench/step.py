"""Benchmark: the wall time of a GRAFT step over a GRPO step with the same n, side by side.

What GRAFT adds to a GRPO step is: writing this step's rollout file, reading the peer's, the balanced
swap, retokenising the selected peer responses, one no-grad forward of the receiver over them (the
compatibility score), and training on peer rows instead of the receiver's own failed rows. This
script measures all of it in one process: two trainers start from the same tiny pre-trained model,
one plain GRPO, one GRAFT reading the peer's rollout files (the stored-trajectory path, so no time is
spent waiting for a live peer), and their steps run interleaved (GRPO step t, GRAFT step t, ...), so
machine noise hits both alike. The peer's files come from a GRPO run of the other tiny model, made
first and not timed.

    python -m bench.step [--run-dir runs/tiny] [--steps 6] [--prompts-per-step 16] [--n 8]

It prints the median step time of each, their ratio, and GRAFT's overhead phases (write, read +
re-verify, exchange = selection + retokenisation + compatibility forward) as a fraction of the GRPO
step. Needs the tiny preset's pre-trained models (`python -m tools.tiny prepare RUN_DIR`, run here if absent).
The stored-peer path also re-verifies the peer's rewards (the stored-trajectory variant), a cost the online pair does
not pay: it is reported on its own line.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import statistics
import tempfile
from pathlib import Path

import torch

import graft
from config import Config


def trainer(run_dir: Path, side: str, out: Path, args, **kw) -> graft.Trainer:
    cfg = Config(model=str(run_dir / side), name=side.lower(), prompts=str(run_dir / "data" / "train.jsonl"),
                 out=str(out), steps=args.steps, prompts_per_step=args.prompts_per_step, n=args.n,
                 minibatches=4, max_response_tokens=args.max_response_tokens, prompt_template="{problem}\n",
                 lr=args.lr, threads=1, micro_batch_size=64, gen_batch_size=512, seed=args.seed, **kw)
    with contextlib.redirect_stdout(io.StringIO()):
        return graft.Trainer(cfg)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run-dir", default="runs/tiny", help="tiny preset folder with A/, B/ and data/")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--prompts-per-step", type=int, default=32)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--max-response-tokens", type=int, default=96)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    run_dir = Path(args.run_dir)
    if not (run_dir / "A").is_dir() or not (run_dir / "B").is_dir():
        from tools import tiny
        tiny.prepare(str(run_dir), tiny.TinyConfig())
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        peer = trainer(run_dir, "B", tmp / "peer", args)
        for t in range(args.steps):
            peer.step(t)  # the peer's rollout files (not timed)
        grpo = trainer(run_dir, "A", tmp / "grpo", args)
        graft_ = trainer(run_dir, "A", tmp / "graft", args, peer_log=str(tmp / "peer" / "exchange" / "b"))
        rows = []
        for t in range(args.steps):
            m_grpo, m_graft = grpo.step(t), graft_.step(t)
            rows.append((m_grpo, m_graft))
            print(f"step {t}: GRPO {m_grpo['time/step']:.2f}s  GRAFT {m_graft['time/step']:.2f}s "
                  f"(selected {m_graft.get('selected', 0)}, accepted {m_graft.get('accepted', 0)})", flush=True)
    med = lambda k, i: statistics.median(r[i].get(k, 0.0) for r in rows)
    step_grpo, step_graft = med("time/step", 0), med("time/step", 1)
    write, read, exch = med("time/write", 1), med("time/wait", 1), med("time/exchange", 1)
    print(f"\nGRAFT vs GRPO, tiny models, {args.prompts_per_step} prompts x n={args.n}, median of {args.steps} "
          f"interleaved steps")
    print(f"{'phase':<34}{'GRPO s':>9}{'GRAFT s':>9}")
    for k in ("sample", "verify", "logprob", "write", "wait", "exchange", "update", "step"):
        print(f"{k:<34}{med('time/' + k, 0):>9.3f}{med('time/' + k, 1):>9.3f}")
    print(f"GRAFT / GRPO step time:            {step_graft / step_grpo:.3f}x")
    print(f"online overhead (write + exchange): {100 * (write + exch) / step_grpo:.1f}% of a GRPO step")
    print(f"stored peer only (read + re-verify): {100 * read / step_grpo:.1f}% of a GRPO step")
    print(f"mean selected / accepted per step:  {statistics.mean(r[1].get('selected', 0) for r in rows):.1f} / "
          f"{statistics.mean(r[1].get('accepted', 0) for r in rows):.1f}")


if __name__ == "__main__":
    main()
