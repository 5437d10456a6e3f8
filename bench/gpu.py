"""The GPU check: one script, one table, at most about 8 minutes on one GPU, nothing downloaded.

    python -m bench.gpu --tokenizers ../shared/tokenizers          # on a GPU machine (a folder with qwen3/, smollm3/)
    python -m bench.gpu --tiny                                      # toy sizes on CPU (the test suite runs this)

Models are random-init from real configs (transformers' from_config: Qwen3-1.7B's and SmolLM3-3B's shapes); the
tokenizers are read from --tokenizers. Every row is measured side by side in this one run:

1. The chunked log-prob kernel (sampler.token_logprobs) against the naive log_softmax(h @ W.T).gather, forward
   under bf16 autocast and backward outside it (the trainer's regime), N=8192, H=2048, V=151,936: time of forward +
   backward (median of repeats), peak memory, and the relative error of values and both gradients against an fp32
   reference (ours / naive: the kernel must not be worse than the naive path, target <= 1.25x).
2. The sampler against transformers' generate on the Qwen3-1.7B-shaped model, batch 64, greedy, bf16 weights. A
   random model never says EOS, so the EOS is planted: the token that the greedy continuations produce first at
   the most varied positions, which makes rows stop at varied lengths as RL rollouts do. Greedy outputs must be
   identical row by row. Then the static-shape decode (sampler static=True: preallocated KV cache, CUDA graph)
   against the eager one at 64 and 256 rows in flight: tokens/s and identity.
3. One GRAFT step of a real-shape pair on one GPU: B (Qwen3-1.7B shape) samples its rollouts and writes its
   rollout file; A (SmolLM3-3B shape, fp32 master weights + AdamW, bf16 autocast) runs a full step against it as
   a stored peer (graft.py's offline mode: the same selection, retokenisation, compatibility and peer-last update).
   Rewards come from a planted verifier (a hash of the text), since random models solve nothing: it gives mixed
   groups, so selection, scoring and the update all do work. Time by phase and peak memory.
4. (run before 3.) One prefill per prompt (sampler share_prefix): a GRPO rollout of 32 random prompts (64-1,024
   tokens) x n=8 at T=1 on the Qwen3-1.7B-shaped model, bf16, 256 rows in flight, with and without sharing,
   interleaved: tokens/s, peak memory, sampled rows identical (bf16: other batch shapes round differently, so a
   few may differ), and the behaviour log-probs (micro-batches of 16) with and without: time, peak memory, max
   difference.

Exit status 0 with the table printed; a failed identity check exits 1. --tiny uses toy sizes and the tiny
preset's committed tokenizers (data/tiny_models/A, B), so the script is exercised on every CPU test run.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import statistics
import sys
import tempfile
import time
import zlib
from pathlib import Path

import torch
from config import Config
from core import batch_indices
from exchange import rollout_path, save_rollouts

ROOT = Path(__file__).resolve().parent.parent  # the repository root


# ------------------------------------------------------------------------------------------------
# Sizes and models
# ------------------------------------------------------------------------------------------------


def sizes(tiny: bool) -> dict:
    if tiny:
        return dict(kernel=(256, 64, 4096), repeats=2, batch=8, batches=(4, 8), new_tokens=24, prompts=8, n=4,
                    response=24, share=(4, (8, 64), 8))
    return dict(kernel=(8192, 2048, 151_936), repeats=5, batch=64, batches=(64, 256), new_tokens=256, prompts=64,
                n=8, response=512, share=(32, (64, 1024), 256))  # share: prompts, their length range, rows in flight


def model_config(kind: str, tok, tiny: bool):
    """Qwen3-1.7B's or SmolLM3-3B's shape (or a toy of the same architecture), vocab from the tokenizer."""
    from transformers import AutoConfig
    if kind == "qwen3":
        shape = dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                     num_key_value_heads=8, head_dim=128, tie_word_embeddings=True, rope_theta=1_000_000.0)
    else:
        shape = dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
                     num_key_value_heads=4, tie_word_embeddings=True, rope_theta=5_000_000.0)
    if tiny:
        shape.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16)
    arch = "qwen3" if kind == "qwen3" else "smollm3"
    ids = dict(vocab_size=len(tok), max_position_embeddings=8192, eos_token_id=tok.eos_token_id,
               pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id)
    try:
        return AutoConfig.for_model(arch, **ids, **shape)
    except (KeyError, ValueError):  # a transformers without SmolLM3: the Llama family it derives from
        return AutoConfig.for_model("llama", **ids, **shape)


def random_model(kind: str, tok, *, tiny: bool, dtype: torch.dtype, device: torch.device, seed: int):
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    cfg = model_config(kind, tok, tiny)
    model = AutoModelForCausalLM.from_config(cfg, dtype=dtype).to(device)
    model.generation_config.eos_token_id = tok.eos_token_id
    return model.eval()


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def peak_gib(device: torch.device) -> str:
    return f"{torch.cuda.max_memory_allocated() / 2**30:.1f} GiB" if device.type == "cuda" else "n/a (CPU)"


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


# ------------------------------------------------------------------------------------------------
# 1. The log-prob kernel in the trainer's precision regime
# ------------------------------------------------------------------------------------------------


def bench_kernel(sz: dict, device: torch.device, rows: list) -> None:
    from sampler import token_logprobs
    n, h, v = sz["kernel"]
    gen = torch.Generator().manual_seed(0)
    hidden = (torch.randn(n, h, generator=gen) * 4 / h**0.5).to(device)
    weight = (torch.randn(v, h, generator=gen) / h**0.5).to(device)
    targets = torch.randint(0, v, (n,), generator=gen).to(device)
    upstream = torch.randn(n, generator=gen).to(device)
    amp = torch.autocast(device.type, dtype=torch.bfloat16)

    def run(path, autocast: bool):
        hh, ww = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        with amp if autocast else contextlib.nullcontext():
            if path == "ours":
                lp = token_logprobs(hh, ww, targets, chunk_size=1024)  # (N,)
            else:
                lp = torch.log_softmax((hh @ ww.T).float(), dim=-1).gather(1, targets[:, None])[:, 0]  # (N,)
        (lp.float() * upstream).sum().backward()
        return lp.detach().float(), hh.grad.float(), ww.grad.float()

    ref = run("naive", autocast=False)  # fp32 reference
    rel = lambda a, b: float((a - b).norm() / b.norm().clamp(min=1e-30))  # noqa: E731
    out = {}
    for path in ("ours", "naive"):
        times = []
        for _ in range(sz["repeats"]):
            reset_peak(device)
            synchronize(device)
            t0 = time.perf_counter()
            vals = run(path, autocast=True)
            synchronize(device)
            times.append(time.perf_counter() - t0)
        out[path] = dict(time=statistics.median(times), peak=peak_gib(device),
                         err=[rel(x, r) for x, r in zip(vals, ref)])
    o, nv = out["ours"], out["naive"]
    worst = max(a / max(b, 1e-12) for a, b in zip(o["err"], nv["err"]))
    rows.append(("kernel bf16 fwd+bwd, N x H x V = " + "x".join(map(str, sz["kernel"])),
                 f"time {o['time'] * 1e3:.0f} vs {nv['time'] * 1e3:.0f} ms ({o['time'] / nv['time']:.2f}x); "
                 f"peak {o['peak']} vs {nv['peak']}; rel. error values/grad h/grad W "
                 + "/".join(f"{e:.1e}" for e in o["err"]) + " vs " + "/".join(f"{e:.1e}" for e in nv["err"])
                 + f" (worst ratio {worst:.2f}x, target <= 1.25x)"))


# ------------------------------------------------------------------------------------------------
# 2. The sampler against generate, and the static decode path
# ------------------------------------------------------------------------------------------------


def planted_eos(model, prompts, max_new: int, pad: int) -> int:
    """A token id whose first occurrence in the greedy continuations is spread over the most positions."""
    from sampler import sample
    outs = sample(model, prompts, max_new_tokens=max_new, temperature=0.0, eos_token_id=-1, pad_token_id=pad)
    first: dict[int, set] = {}
    for o in outs:
        seen = set()
        for t, tok in enumerate(o.tokens):
            if tok not in seen:
                seen.add(tok)
                first.setdefault(tok, set()).add(t // max(1, max_new // 16))  # coarse position buckets
    return max(first, key=lambda tok: (len(first[tok]), -tok))


def bench_sampler(sz: dict, tok, device: torch.device, tiny: bool, rows: list) -> bool:
    from sampler import sample
    model = random_model("qwen3", tok, tiny=tiny, dtype=torch.bfloat16 if device.type == "cuda" else torch.float32,
                         device=device, seed=1)
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(5, len(tok) - 1, (int(torch.randint(8, 64, (1,), generator=gen)),), generator=gen).tolist()
               for _ in range(max(sz["batches"]))]
    pad, new = tok.pad_token_id or 0, sz["new_tokens"]
    eos = planted_eos(model, prompts[: sz["batch"]], new, pad)
    ok = True

    def timed(fn):
        synchronize(device)
        t0 = time.perf_counter()
        result = fn()
        synchronize(device)
        return result, time.perf_counter() - t0

    batch = prompts[: sz["batch"]]
    ours, t_ours = timed(lambda: sample(model, batch, max_new_tokens=new, temperature=0.0, eos_token_id=eos,
                                        pad_token_id=pad, max_batch_size=len(batch)))
    ids = torch.full((len(batch), max(map(len, batch))), pad, dtype=torch.long)
    att = torch.zeros_like(ids)
    for i, p in enumerate(batch):  # left padding, as generate expects
        ids[i, ids.shape[1] - len(p):], att[i, ids.shape[1] - len(p):] = torch.tensor(p), 1
    ref, t_ref = timed(lambda: model.generate(input_ids=ids.to(device), attention_mask=att.to(device),
                                              max_new_tokens=new, do_sample=False, eos_token_id=eos,
                                              pad_token_id=pad))
    ref_rows = []
    for row in ref[:, ids.shape[1]:].tolist():
        cut = row.index(eos) + 1 if eos in row else len(row)
        ref_rows.append(row[:cut])
    same = all(o.tokens == r for o, r in zip(ours, ref_rows))
    ok &= same
    useful = sum(len(o.tokens) for o in ours)
    lengths = sorted(len(o.tokens) for o in ours)
    rows.append((f"sampler vs generate, Qwen3-1.7B shape, batch {len(batch)}, greedy",
                 f"{useful / t_ours:.0f} vs {useful / t_ref:.0f} tokens/s ({t_ref / t_ours:.2f}x); lengths "
                 f"{lengths[0]}-{lengths[-1]} (median {lengths[len(lengths) // 2]}); identical rows: {same}"))
    for b in sz["batches"]:
        many = prompts[:b]
        eager, t_e = timed(lambda: sample(model, many, max_new_tokens=new, temperature=0.0, eos_token_id=eos,
                                          pad_token_id=pad, max_batch_size=b))
        static, t_s = timed(lambda: sample(model, many, max_new_tokens=new, temperature=0.0, eos_token_id=eos,
                                           pad_token_id=pad, max_batch_size=b, static=True))
        same = all(a.tokens == s.tokens for a, s in zip(eager, static))
        ok &= same
        toks = sum(len(o.tokens) for o in eager)
        rows.append((f"static decode vs eager, {b} rows in flight",
                     f"{toks / t_s:.0f} vs {toks / t_e:.0f} tokens/s ({t_e / t_s:.2f}x, first call includes graph "
                     f"capture); identical rows: {same}"))
    return ok


def bench_prefill(sz: dict, tok, device: torch.device, tiny: bool, rows: list) -> None:
    """Row 4 of the module docstring: a GRPO rollout and its behaviour log-probs, share_prefix False vs True."""
    from sampler import response_logprobs, sample
    model = random_model("qwen3", tok, tiny=tiny, dtype=torch.bfloat16 if device.type == "cuda" else torch.float32,
                         device=device, seed=6)
    n_prompts, (lo, hi), slots = sz["share"]
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(5, len(tok) - 1, (int(torch.randint(lo, hi + 1, (1,), generator=gen)),),
                             generator=gen).tolist() for _ in range(n_prompts)]
    batch = [p for p in prompts for _ in range(sz["n"])]  # row r = g * n + i, as Trainer.rollout builds them
    pad, new = tok.pad_token_id or 0, sz["new_tokens"]

    def rollout(share: bool):
        return sample(model, batch, max_new_tokens=new, temperature=1.0, eos_token_id=tok.eos_token_id,
                      pad_token_id=pad, generator=torch.Generator().manual_seed(0), max_batch_size=slots,
                      share_prefix=share)

    def logprobs(share: bool, responses):
        out = []
        with torch.no_grad():
            for i in range(0, len(batch), 16):
                lp, mask = response_logprobs(model, batch[i: i + 16], responses[i: i + 16], pad_token_id=pad,
                                             share_prefix=share)
                out += [lp[j, : int(mask[j].sum())].float() for j in range(lp.shape[0])]
        return out

    def timed(fn, *args):
        reset_peak(device)
        synchronize(device)
        t0 = time.perf_counter()
        result = fn(*args)
        synchronize(device)
        return result, time.perf_counter() - t0, peak_gib(device)

    rollout(True)  # warm-up
    res = {}
    for share in (False, True, True, False):  # interleaved; the second run of each is kept
        res[share] = timed(rollout, share)
    toks = {s: sum(len(o.tokens) for o in r[0]) for s, r in res.items()}
    same = sum(a.tokens == b.tokens for a, b in zip(res[False][0], res[True][0]))
    rows.append((f"shared prefix, rollout {n_prompts} prompts ({lo}-{hi} tokens) x n={sz['n']}, T=1, {slots} in flight",
                 f"{toks[True] / res[True][1]:.0f} vs {toks[False] / res[False][1]:.0f} tokens/s "
                 f"({toks[True] / res[True][1] / (toks[False] / res[False][1]):.2f}x); peak {res[True][2]} vs "
                 f"{res[False][2]}; identical rows {same}/{len(batch)}"))
    responses = [o.tokens for o in res[True][0]]
    lp = {share: timed(logprobs, share, responses) for share in (False, True)}
    diff = max(float((a - b).abs().max()) for a, b in zip(lp[False][0], lp[True][0]))
    rows.append(("shared prefix, behaviour log-probs, micro-batches of 16",
                 f"{lp[True][1]:.2f} vs {lp[False][1]:.2f} s ({lp[False][1] / lp[True][1]:.2f}x faster); peak "
                 f"{lp[True][2]} vs {lp[False][2]}; max |diff| {diff:.1e}"))


# ------------------------------------------------------------------------------------------------
# 3. One GRAFT step of a real-shape pair on one GPU
# ------------------------------------------------------------------------------------------------


def planted_reward(texts, golds, **kw):
    return [1.0 if zlib.crc32(t.encode("utf-8", "replace")) % 3 == 0 else 0.0 for t in texts]


def bench_pair_step(sz: dict, toks: dict, device: torch.device, tiny: bool, rows: list) -> None:
    import graft
    import runtime
    import verify
    verify.verify_batch = planted_reward  # random models solve nothing; see the module docstring
    models = {"a": random_model("smollm3", toks["a"], tiny=tiny, dtype=torch.float32, device=device, seed=3),
              "b": random_model("qwen3", toks["b"], tiny=tiny, dtype=torch.float32, device=device, seed=4)}
    graft.load_policy = lambda path, cfg, dist_info, **kw: (models[Path(path).name], toks[Path(path).name],
                                                      [toks[Path(path).name].eos_token_id])
    runtime.load_policy = graft.load_policy
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        prompts = tmp / "prompts.jsonl"
        gen = torch.Generator().manual_seed(5)
        with open(prompts, "w") as f:
            for i in range(sz["prompts"]):
                a, b = torch.randint(10, 99, (2,), generator=gen).tolist()
                f.write(json.dumps({"id": f"q{i}", "problem": f"What is {a} + {b}?", "answer": str(a + b)}) + "\n")
        common = dict(prompts=str(prompts), steps=1, prompts_per_step=sz["prompts"], n=sz["n"], minibatches=4,
                      max_response_tokens=sz["response"], gen_batch_size=256, micro_batch_size=8, lr=1e-6,
                      device=device.type, save_every=10**6)
        reset_peak(device)
        with contextlib.redirect_stdout(io.StringIO()):
            side_b = graft.Trainer(Config(model=str(tmp / "b"), name="b", out=str(tmp / "run_b"), **common))
            t0 = time.perf_counter()
            rows_b = batch_indices(len(side_b.data), 0, sz["prompts"], 0)
            own_b, t_b = side_b.rollout(0, rows_b)
            save_rollouts(rollout_path(tmp / "run_b" / "exchange", "b", 0), own_b,
                          {"run_id": side_b.run_id, "step": 0})
            t_b["total"] = time.perf_counter() - t0
            side_b.model.to("cpu")  # the peer's weights leave the GPU; A trains next
            if tiny:  # the toy A tokenizer is character-level: B's text re-encodes ~4x longer
                common["max_response_tokens"] *= 4
            side_a = graft.Trainer(Config(model=str(tmp / "a"), name="a", out=str(tmp / "run_a"),
                                    peer_log=str(tmp / "run_b" / "exchange" / "b"), delta=0.0, **common))
            m = side_a.step(0)
    rows.append(("GRAFT step, B = Qwen3-1.7B shape: its rollouts",
                 ", ".join(f"{k} {v:.1f} s" for k, v in t_b.items()) + f" ({sz['prompts']} prompts x n={sz['n']}, "
                 f"cap {sz['response']} tokens)"))
    phases = ("sample", "verify", "logprob", "wait", "exchange", "update", "step")
    rows.append(("GRAFT step, A = SmolLM3-3B shape, fp32 + AdamW (+ bf16 autocast on GPU)",
                 ", ".join(f"{k} {m.get('time/' + k, 0.0):.1f} s" for k in phases)
                 + f"; selected {m.get('selected', 0)}, accepted {m.get('accepted', 0)}; peak {peak_gib(device)}"))


# ------------------------------------------------------------------------------------------------
# Main
# ------------------------------------------------------------------------------------------------


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="toy sizes on CPU (the test suite's run)")
    p.add_argument("--tokenizers", default="", help="folder with qwen3/ and smollm3/ tokenizer folders")
    p.add_argument("--only", choices=("kernel", "sampler", "prefill", "pair"), help="one part only")
    args = p.parse_args(argv)
    from transformers import AutoTokenizer
    device = torch.device("cpu") if args.tiny or not torch.cuda.is_available() else torch.device("cuda")
    if args.tiny:
        torch.set_num_threads(1)
        dirs = {"a": ROOT / "data" / "tiny_models" / "A", "b": ROOT / "data" / "tiny_models" / "B"}
    else:
        if not args.tokenizers:
            raise SystemExit("--tokenizers DIR is required without --tiny (a folder holding qwen3/ and smollm3/)")
        dirs = {"a": Path(args.tokenizers) / "smollm3", "b": Path(args.tokenizers) / "qwen3"}
    for d in dirs.values():
        if not d.is_dir():
            raise SystemExit(f"--tokenizers: {d} is not a folder")
    toks = {k: AutoTokenizer.from_pretrained(d) for k, d in dirs.items()}
    for t in toks.values():
        if t.pad_token_id is None:
            t.pad_token = t.eos_token
    sz, rows, ok, t0 = sizes(args.tiny), [], True, time.time()
    print(f"[bench_gpu] device {device}{' (' + torch.cuda.get_device_name() + ')' if device.type == 'cuda' else ''}, "
          f"{'toy sizes' if args.tiny else 'real sizes'}", flush=True)
    if args.only in (None, "kernel"):
        bench_kernel(sz, device, rows)
    if args.only in (None, "sampler"):
        ok &= bench_sampler(sz, toks["b"], device, args.tiny, rows)
    if args.only in (None, "prefill"):
        bench_prefill(sz, toks["b"], device, args.tiny, rows)
    if args.only in (None, "pair"):
        bench_pair_step(sz, toks, device, args.tiny, rows)
    width = max(len(r[0]) for r in rows)
    print(f"\n{'check':<{width}} | measured (ours vs reference)")
    for name, value in rows:
        print(f"{name:<{width}} | {value}")
    print(f"[bench_gpu] {time.time() - t0:.0f} s; identity checks {'passed' if ok else 'FAILED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
