"""Three of the trainer's costs found by a memory audit, measured on the CPU: the behaviour log-prob pass's
padding, the AdamW step's peak bytes per parameter, and the rollout's KV cache bytes per token.

    python -m bench.audit logprob --model data/tiny_models/A --rollouts RUN/exchange/a/step_000000.safetensors \
        --prompts TRAIN.jsonl --prompt-template $'{problem}\n' --micro-batch-size 16 64
    python -m bench.audit adamw
    python -m bench.audit kv

logprob: a real rollout file's rows through the behaviour log-prob pass, micro-batches cut in rollout order
(before) against micro-batches of similar lengths (sampler.batches_by_length, what Trainer.behaviour_logprobs
runs now). For each micro-batch size, with and without the shared prefix (sampler.py departure 11), it prints the
token positions the model body ran (padding included: the sum of input_ids.numel() over the pass's forward calls,
read by a hook), the real tokens (prompt + response of every row but its last token, which predicts nothing),
the wall time, and the largest per-row difference of the log-probs between the two orders (float round-off of
other batch shapes only). CPU or GPU (bf16 autocast on a GPU, as the trainer). The prompts are re-encoded from
--prompts by the rollout file's prompt ids, as the trainer encodes them (runtime.encode_prompt).

adamw: the peak memory of one AdamW step after the first (moments allocated), over the parameters, gradients and
moments it holds, in bytes per parameter, for torch's foreach, fused and per-tensor implementations: MemTracker
(torch.distributed._tools.mem_tracker) on real CPU tensors of a 16 x (1024 x 1024) MLP. The trainer uses fused on
CUDA (graft.Trainer); the same kernels' temporaries are what a GPU step adds.

kv: the rollout's KV cache bytes per token under bf16 autocast for the paper's models' attention shapes, read off
the tensors sampler.sample stores (stats), before its bf16 cast (sampler.py departure 13) and with it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

import torch

from exchange import load_rollouts
from runtime import encode_prompt
from sampler import _base_model, batches_by_length, response_logprobs


def rows_of(args) -> tuple[list[list[int]], list[list[int]], object, object]:
    """(prompt ids, response ids) of every row of the rollout file, the model and its tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).to(args.device).eval()
    roll, _ = load_rollouts(Path(args.rollouts))
    problems = {}
    for line in Path(args.prompts).read_text().splitlines():
        if line.strip():
            r = json.loads(line)
            problems[r["id"]] = r["problem"]
    missing = [p for p in roll.prompt_ids if p not in problems]
    if missing:
        raise SystemExit(f"bench/audit.py --prompts {args.prompts}: no problem for ids {missing[:3]} of the "
                         f"rollout file")
    n = len(roll.tokens) // len(roll.prompt_ids)
    ids = [encode_prompt(problems[p], tok, template=args.prompt_template, chat=args.chat_template)
           for p in roll.prompt_ids]
    return [ids[r // n] for r in range(len(roll.tokens))], [list(t) for t in roll.tokens], model, tok


def run_pass(model, prompts, responses, batches, *, pad: int, share: bool, device) -> tuple[list, int, float]:
    """(per-row log-probs in row order, token positions the model body ran, seconds) of one behaviour pass."""
    fed = [0]
    hook = _base_model(model).register_forward_pre_hook(
        lambda m, a, kw: fed.__setitem__(0, fed[0] + kw["input_ids"].numel()), with_kwargs=True)
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext()
    out = [None] * len(prompts)
    t0 = time.perf_counter()
    with torch.no_grad(), amp:
        for idx in batches:
            lp, mask = response_logprobs(model, [prompts[i] for i in idx], [responses[i] for i in idx],
                                         pad_token_id=pad, share_prefix=share)
            for j, i in enumerate(idx):
                out[i] = lp[j, : int(mask[j].sum())].float().cpu()
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    hook.remove()
    return out, fed[0], seconds


def adamw_bytes_per_param() -> None:
    """The adamw measurement of the module docstring, one line per implementation."""
    from torch.distributed._tools.mem_tracker import MemTracker
    for kind, kw in (("foreach", dict(foreach=True)), ("fused", dict(fused=True)), ("per-tensor", dict(foreach=False))):
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(16)])
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, **kw)
        for q in model.parameters():
            q.grad = torch.randn_like(q)
        opt.step()  # the first step allocates the moments; the second is every later step
        tracker = MemTracker()
        tracker.track_external(model, opt)
        with tracker:
            opt.step()
        peak = max(v.get("Total", 0) for v in tracker.get_tracker_snapshot("peak").values())
        n = sum(q.numel() for q in model.parameters())
        print(f"AdamW {kind:<10}: peak {peak / n:.1f} bytes per parameter over {n} parameters (weights 4, gradients 4, "
              f"moments 8 = 16 held)", flush=True)


# The paper's models' attention shapes (their config.json files): layers, KV heads, head size.
KV_SHAPES = {"Qwen3-1.7B": ("qwen3", 28, 8, 128), "SmolLM3-3B": ("smollm3", 36, 4, 128)}


def kv_bytes_per_token() -> None:
    """The kv measurement of the module docstring: sampler.sample under CPU bf16 autocast on a model with the real
    layers, KV heads and head size (a narrow hidden size, MLP and vocabulary), float32 weights as the trainer holds
    them; the bytes per token read off the cache it stores, with the cast of departure 13 and without it."""
    import sampler
    from transformers import AutoConfig, AutoModelForCausalLM
    for name, (arch, layers, kv_heads, head_dim) in KV_SHAPES.items():
        cfg = AutoConfig.for_model(arch, vocab_size=256, hidden_size=256, intermediate_size=64,
                                   num_hidden_layers=layers, num_attention_heads=16, num_key_value_heads=kv_heads,
                                   head_dim=head_dim, max_position_embeddings=256, pad_token_id=0, bos_token_id=1,
                                   eos_token_id=2)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        got = {}
        for cast in (False, True):
            stats = {}
            keep = sampler._kv_dtype
            if not cast:  # the sampler before departure 13: K and V cached as the model computes them
                sampler._kv_dtype = lambda device: None
            try:
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    sampler.sample(model, [[5, 6, 7]] * 2, max_new_tokens=2, temperature=0, eos_token_id=-1,
                                   stats=stats)
            finally:
                sampler._kv_dtype = keep
            got[cast] = stats
        print(f"KV cache {name} ({layers} layers x {kv_heads} KV heads x {head_dim}) under bf16 autocast: "
              + " -> ".join(f"{got[c]['kv_bytes_per_token'] / 1024:.0f} KiB/token (K {got[c]['kv_dtypes'][0]}, V "
                            f"{got[c]['kv_dtypes'][1]})" for c in (False, True))
              + f"; 2 x layers x kv_heads x head_dim x 2 bytes = {2 * layers * kv_heads * head_dim * 2 / 1024:.0f} KiB",
              flush=True)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["adamw"]:
        adamw_bytes_per_param()
        return 0
    if argv[:1] == ["kv"]:
        kv_bytes_per_token()
        return 0
    if argv[:1] == ["logprob"]:
        argv = argv[1:]
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--rollouts", required=True, help="a rollout file (exchange/<side>/step_XXXXXX.safetensors)")
    p.add_argument("--prompts", required=True, help="the prompt JSONL the run was trained on")
    p.add_argument("--prompt-template", default="{problem}")
    p.add_argument("--chat-template", action="store_true")
    p.add_argument("--micro-batch-size", type=int, nargs="+", default=[16])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args(argv)
    args.device = torch.device(args.device)
    torch.set_num_threads(1)
    prompts, responses, model, tok = rows_of(args)
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    real = sum(len(x) + max(len(y) - 1, 0) for x, y in zip(prompts, responses))  # a row feeds all but its last
    lens = sorted(len(r) for r in responses)
    print(f"[bench_audit] {args.rollouts}: {len(responses)} rows, responses {lens[0]}-{lens[-1]} tokens (median "
          f"{lens[len(lens) // 2]}), {real} real tokens (prompt + response - 1 per row, unshared); model {args.model} "
          f"on {args.device}")
    for size in args.micro_batch_size:
        for share in (True, False):
            before = [list(range(i, min(i + size, len(prompts)))) for i in range(0, len(prompts), size)]
            after = batches_by_length(prompts, responses, size, share_prefix=share)
            lp_b, fed_b, t_b = run_pass(model, prompts, responses, before, pad=pad, share=share, device=args.device)
            lp_a, fed_a, t_a = run_pass(model, prompts, responses, after, pad=pad, share=share, device=args.device)
            diff = max(float((x - y).abs().max()) if x.numel() else 0.0 for x, y in zip(lp_a, lp_b))
            print(f"micro-batch {size:>3}, share_prefix {str(share):<5}: tokens through the pass {fed_b} -> {fed_a} "
                  f"({fed_b / real:.2f}x -> {fed_a / real:.2f}x the real tokens), {t_b:.2f} s -> {t_a:.2f} s, "
                  f"max per-row |d logp| {diff:.1e}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
