"""Benchmark: the memory plan's update micro-batch against an independent fake-tensor measurement of the same step.

plan.py measures a deep model at 4 and 8 layers and extrapolates to its depth, then adds the state it
holds (docs/RESULTS.md "The memory plan"). This script measures the same update micro-batch once, at the model's
full depth, apart from plan.py's phase arithmetic: the whole model under FakeTensorMode, AdamW (fused, the
trainer's kernel on a GPU) past its first step (moments and gradients held), the trainer's chunked log-prob
forward (sampler.response_logprobs) of `--rows` rows of `--prompt` + `--cap` tokens under bf16 autocast, a
backward with gradient checkpointing as asked, the grad clip and the AdamW step, all inside one MemTracker. It
prints that peak beside the plan's update figure (the larger of its update and optimizer-step phases, data
parallel) and their ratio.

    python -m bench.plan_check --model Qwen/Qwen3-1.7B-Base --prompt 2048 --cap 4096 --rows 4 [--no-checkpointing]

Target: the plan within 15% of this measurement. A few minutes per 3B model on one CPU core.
"""

from __future__ import annotations

import argparse
import time

import torch

import plan
from config import Config
from runtime import adamw_kernel
from sampler import response_logprobs


def full_depth_peak(config, *, rows: int, prompt: int, cap: int, checkpointing: bool) -> int:
    """Peak bytes of one update micro-batch at the model's full depth on fake tensors (module docstring)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker
    from transformers import AutoModelForCausalLM
    with FakeTensorMode():
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        if checkpointing:
            model.gradient_checkpointing_enable()
            model.config.use_cache = False
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.01, **adamw_kernel(torch.device("cuda")))
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        opt.step()
        prompts = [[3 + i] + [7] * (prompt - 1) for i in range(rows)]
        responses = [[9] * (cap - (i == rows - 1)) for i in range(rows)]  # one row short: a padded batch
        mt = MemTracker()
        mt.track_external(model, opt)
        with mt:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                lp, mask = response_logprobs(model, prompts, responses, pad_token_id=0)  # (B, T)
            (lp * mask).sum().backward()
            torch.nn.utils.clip_grad_norm_(list(model.parameters()), 1.0)
            opt.step()
        (snap,) = mt.get_tracker_snapshot("peak").values()
    return int(snap["Total"])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="hub id, folder or config.json (plan.model_config)")
    ap.add_argument("--prompt", type=int, required=True, help="prompt tokens per row")
    ap.add_argument("--cap", type=int, default=4096, help="response tokens per row")
    ap.add_argument("--rows", type=int, default=4, help="rows in the micro-batch (--micro-batch-size)")
    ap.add_argument("--no-checkpointing", action="store_true", help="without --gradient-checkpointing")
    args = ap.parse_args(argv)
    config, source = plan.model_config(args.model)
    ckpt = not args.no_checkpointing
    cfg = Config(model=args.model, micro_batch_size=args.rows, max_response_tokens=args.cap, gen_batch_size=1,
                 max_prompt_tokens=args.prompt, gradient_checkpointing=ckpt)
    t0 = time.time()
    m = plan.measure(config, cfg, prompt_len=args.prompt, eval_prompt_len=1)
    by = {ph.name: ph.total for ph in plan.phases(m, cfg, ranks=1, prompt_len=args.prompt, eval_prompt_len=1)}
    planned, t_plan = max(by["update"], by["optimizer step"]), time.time() - t0
    t0 = time.time()
    real = full_depth_peak(config, rows=args.rows, prompt=args.prompt, cap=args.cap, checkpointing=ckpt)
    t_full = time.time() - t0
    print(f"{args.model} ({source}): {args.rows} rows x ({args.prompt} + {args.cap}) tokens, checkpointing "
          f"{'on' if ckpt else 'off'}, data parallel")
    print(f"plan (depths {plan.DEPTHS}, extrapolated): {planned / plan.GIB:.2f} GiB in {t_plan:.0f} s")
    print(f"full depth, one MemTracker:      {real / plan.GIB:.2f} GiB in {t_full:.0f} s")
    print(f"plan / full depth: {planned / real:.3f}")


if __name__ == "__main__":
    main()
