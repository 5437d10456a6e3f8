"""The GPU check: one script for a lent GPU that cannot lose its rows. At most about 8 minutes on one H200.

    python -m bench.gpu --tokenizers ../shared/tokenizers             # a GPU machine (qwen3/ and smollm3/ inside)
    python -m bench.gpu --tiny                                         # toy sizes on CPU (the test suite runs this)
    python -m bench.gpu --tokenizers DIR --budget 300 --only kernel,rollout --jsonl runs/bench_gpu.jsonl
    python -m bench.gpu --tokenizers DIR --only sampler,launcher,profile     # the decode rows only
    python -m bench.gpu --tokenizers DIR --only attention                    # the paged kernel alone (~20 s)
    TRITON_INTERPRET=1 python -m bench.gpu --tiny --only attention          # CPU: the kernel interpreted, a smoke

Every row is printed and appended to the JSONL file (--jsonl, default runs/bench_gpu.jsonl) the moment it is
measured. Each part runs in its own try/except: an exception becomes a row (the error, its last frames, the peak
memory so far) and the next part runs. --budget seconds: a part that would start after the budget is spent is
recorded as skipped. The first row names the machine, torch, transformers and CUDA. Nothing is downloaded: models
are random-init from real configs (transformers' from_config at Qwen3-1.7B's and SmolLM3-3B's shapes), tokenizers
are read from --tokenizers. Exit status 1 when a check failed or a part raised, else 0.

One GPU covers one process per side. Multi-rank NCCL (FSDP2 over several GPUs, all-gathers and reduce-scatters
between ranks, the pair on 4 + 4 GPUs) is NOT covered by this script; it needs a multi-GPU node.

Parts, in this order (the cheap and decisive ones first):

1. kernel: the chunked log-prob kernel (sampler.token_logprobs, kept logits and save_logits=False) against the
   naive log_softmax(h @ W.T).gather, forward under bf16 autocast and backward outside it (the trainer's regime),
   N=8192, H=2048, V=151,936, interleaved: time, peak memory (absolute, and above the inputs), and the relative
   error of values and both gradients against an fp32 reference (check: not worse than the naive path's, within
   1.25x); time_x, peak_x and targets_met against the targets (<= 1.2x the naive time, <= 1/3 its peak).
2. attention: one decode step's attention of one layer over the paged K/V pool (sampler.py departure 18), bf16,
   at Qwen3-1.7B's heads (16 query, 8 KV, head_dim 128) and SmolLM3-3B's (16 / 4 / 128), each at 152 and 184 slots
   (the plan's H100 slot counts), block 16, L = 6,144 columns (2,048 prompt + 4,096 cap); the slots' lengths
   long-tailed (30% at L, the rest uniform in [256, 4,096], a fixed seed), their blocks drawn from a shuffled pool.
   Arms: kernel (sampler.paged_attention), gather (the static step's gathered path: the pool indexed by the (R, L)
   read index, transposed to (R, h, L, d), then transformers' sdpa_attention_forward with the (R, 1, 1, L) bool
   mask, whatever that version does with the grouped heads: repeat_kv or, for one query token, packing them) and
   dense (for scale: F.scaled_dot_product_attention over a dense (R, h, L, d) cache, every row at full width, no
   mask, enable_gqa where the torch has it). Per arm: ms (CUDA events, median of 20 after 3 warm-up calls), GB/s of
   the real K/V bytes (sum of lengths x 2 x kv_heads x head_dim x 2 bytes, whatever the arm reads) and
   speedup_vs_gather (gather's ms / the arm's); the kernel's and the gathered path's max |d| against
   sampler.paged_attention_reference in float32 on the same bf16 inputs (check: <= 0.03, the sampler's own on-device
   tolerance for 2-byte pools); gather_gqa, what the installed transformers' sdpa function did with the grouped
   heads (``sdpa_gqa_branch``: 5.25 packs them for one query token, no repeat_kv, where sampler.transient_copies
   budgets a repeat_kv copy), and on CUDA gather_above_inputs_mib, the gathered arm's transient. About 20 s on one
   GPU (an estimate: the reference's float32 gathers in chunks of 8 slots, two Triton compiles, 3 x 23 timed calls
   per case; peak ~12 GiB). On CPU (--tiny): toy shapes in float16 (Triton's interpreter has no bf16 matmul), the
   kernel only under TRITON_INTERPRET=1; the times are meaningless there and the row says so.
3. rollout (the trainer's regime): Qwen3-1.7B shape, float32 master weights under bf16 autocast, 256 rows x 1,024
   new tokens, as Trainer.rollout calls the sampler: the cached K/V dtypes and bytes per token (read off the stored
   tensors, sampler stats; check: bf16, 2 x layers x kv_heads x head_dim x 2 bytes), peak GiB, ms per decode step,
   and GB/s against the bytes read per step (the bf16 weights autocast caches + the mean KV cache).
4. microbatch: one update micro-batch of SmolLM3-3B shape at a given setting (--mb-rows rows of --mb-tokens
   tokens, gradient checkpointing on unless --no-mb-checkpointing): float32 weights, bf16 autocast forward,
   backward, fused AdamW step; peak GiB, beside the memory plan's update figure when plan.py exists (imported
   lazily; the column says why it is missing otherwise).
5. smoke: `run_pair.sh pair1` on one GPU, both sides on GPU 0, with small full-width models (the real
   architectures and widths, --smoke-layers layers, saved with from_config) and the real tokenizers, FSDP2 (one rank
   per side), one step, a checkpoint, then `--resume` to step 2 with one evaluation. Checks: each side's metrics hold
   steps 0 and 1 once, an evaluation, both checkpoints. Wall time.
6. sampler (long rows): the sampler (its default path: static on CUDA) against transformers' generate, greedy,
   batch 64. In float32 the rows must be identical (strict); in bf16 by tolerance: share of identical rows, the
   first divergence, the behaviour pass against the update pass (checked) and the sampler's log-probs against a
   plain forward (reported). Then static="on" against static="off" at 64 and 256 rows in flight, bf16: tokens/s
   and share of identical rows. The sampler, launcher and profile rows record the path sample() took
   (``path_fields``: attention "kernel" or "gather" and attention_why, the CUDA graphs captured and their warm-up +
   capture seconds; attention None where the default, dynamic path ran).
7. prefill: one prefill per prompt (share_prefix) on a GRPO rollout (32 prompts x 8, 256 rows in flight), bf16:
   tokens/s, peak, identical rows; the behaviour log-probs with and without sharing: time, peak, max difference.

8. launcher: the run at pair1's launcher settings, each side (Qwen3-1.7B and SmolLM3-3B shapes):
   float32 masters under bf16 autocast, the rows in flight run_pair.sh launches 4 GPUs of this card with (the
   memory plan's slots, data parallel or FSDP2 by the launcher's rule: launched_slots) and the KV pool that layout's
   trainer gets (max_cache_bytes), --launch-rows rollouts (default twice the slots, at most 512) at T=1, cap
   --launch-cap, a long-tailed length distribution (stop ids drawn so that ~30% of rows reach the cap:
   ``tail_eos``; the measured share is printed), then over the first 64 rollouts the behaviour log-prob pass
   (micro-batches of 16 by length) and one update (micro-batches of 4, checkpointing, AdamW). From the measured
   seconds per token, pair1's GPU-hours for 174 steps with and without the in-training evaluation (project_pair1),
   at RESULTS' shapes (PAIR1: 256 rollouts per rank of ~150 + 1,509 tokens, 1,744 evaluation samples every 5 steps,
   4 + 4 GPUs), the pair at its slower side. pair1's longer rows read more K/V than the measured ones: that extra
   read at the card's bandwidth is a named term (kv_width_s). With the paged kernel (the side's attention was
   "kernel") each row reads its own columns, sum_t (p + t + 1) over its r steps (``columns_read``): the term is
   pair1's columns per sampled token (``pair1_columns_per_token``: 30% at the cap, the rest geometric, as RESULTS'
   bytes-per-step estimate) minus the measured run's (its row's columns_read, beside the sampler's kv_columns_real);
   with the gathered path every row reads the full width, and the term is the cap's extra width per token.
   Then, after the update, the same rollouts once more with attention="gather" (a row of its own: tokens/s, ms per
   step, auto_over_gather), when the budget left holds GATHER_ARM_X = 6 times the first rollout's seconds (an
   estimate: at cap 1,024 the gathered step moves ~5x the kernel's bytes, RESULTS' arithmetic); else its row says
   skipped and why (also when auto already gathered). It adds up to ~6x a rollout per side.
   The plan runs on fake tensors (CPU, ~10-30 s a layout); the bench's one GPU holds the side's weights, not the
   layout's gradients and AdamW moments, so the pool is given as the plan's bytes.
9. profile: per decode step at 32 rows, fp32 + bf16 autocast: aten ops, weight casts, host reads (all devices)
   and, on CUDA, kernels launched from the host, CUDA graph launches, device-to-host copies and stream syncs
   (torch.profiler), for the sampler's old settings (casts per step, a read per step), the default path with
   static="off", and the static path; with each its attention path and graphs (path_fields).

bf16 tolerance (rows 6-7): mean |d logp| <= 0.02 and max <= 0.25 nats, as tests/test_sampler.py's bf16 checks. Row
6's check is the behaviour log-prob pass against the update pass, the two the trainer's ratio compares (it
used to check the sampler's own log-probs against a plain forward, which the trainer never consumes,
and reported 0.022 on the H200; that figure is still printed, as sampler_vs_forward). The share of identical rows
is reported, not checked (two bf16 paths with other batch shapes round differently, and a greedy argmax can flip on
a near tie, after which a random model's rows part ways).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

from bench.decode import OpCounter, linear_weights, teacher_forced, trainer_passes

ROOT = Path(__file__).resolve().parent.parent  # the repository root
BF16_MEAN, BF16_MAX = 0.02, 0.25  # nats: the bf16 tolerance of the module docstring
GIB = 1024 ** 3
PARTS = ("kernel", "attention", "rollout", "microbatch", "smoke", "sampler", "prefill", "launcher", "profile")


# ------------------------------------------------------------------------------------------------
# Rows: printed and appended to the JSONL file as measured; parts isolated from each other
# ------------------------------------------------------------------------------------------------


class Bench:
    """The run's rows. ``row`` prints one and appends it to the JSONL file at once (flushed and synced, so a crash
    or a kill loses nothing already measured); ``part`` runs one part in a try/except under the time budget."""

    def __init__(self, path: Path, budget: float, device: torch.device):
        self.path, self.budget, self.device = Path(path), budget, device
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.t0 = time.time()
        self.failed: list[str] = []  # checks that failed and parts that raised

    def row(self, part: str, name: str, **fields) -> dict:
        rec = {"part": part, "name": name, **fields, "elapsed_s": round(time.time() - self.t0, 1),
               "at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
        if fields.get("ok") is False:
            self.failed.append(f"{part}: {name}")
        shown = ", ".join(f"{k} {v}" for k, v in fields.items())
        print(f"[{part}] {name}: {shown}", flush=True)
        with open(self.path, "a") as f:
            f.write(json.dumps(rec, default=str) + "\n")
            f.flush()
            os.fsync(f.fileno())
        return rec

    def peak_gib(self) -> float | None:
        return round(torch.cuda.max_memory_allocated() / GIB, 2) if self.device.type == "cuda" else None

    def reset_peak(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()

    def part(self, name: str, fn, *args) -> None:
        """Run fn(*args) as part `name`: skipped when the budget is spent, an exception recorded as a row."""
        spent = time.time() - self.t0
        if spent > self.budget:
            self.row(name, "skipped", reason=f"--budget {self.budget:.0f} s spent ({spent:.0f} s)")
            return
        self.reset_peak()
        t = time.time()
        try:
            fn(*args)
        except Exception as e:  # noqa: BLE001: any failure of one part is recorded and the next part runs
            frames = traceback.format_exception(type(e), e, e.__traceback__)
            self.row(name, "error", ok=False, error=f"{type(e).__name__}: {e}"[:2000],
                     trace="".join(frames[-3:])[-2000:], peak_gib=self.peak_gib(),
                     part_s=round(time.time() - t, 1))
        finally:
            if self.device.type == "cuda":
                torch.cuda.empty_cache()


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(device: torch.device, fn, *args):
    """(fn(*args), wall seconds), the device synchronised on both sides."""
    synchronize(device)
    t0 = time.perf_counter()
    out = fn(*args)
    synchronize(device)
    return out, time.perf_counter() - t0


# ------------------------------------------------------------------------------------------------
# Sizes and models
# ------------------------------------------------------------------------------------------------


def sizes(tiny: bool) -> dict:
    if tiny:
        return dict(kernel=(256, 64, 4096), repeats=2, rollout=(8, 16, 24), batch=8, batches=(4, 8), new_tokens=24,
                    f32_batch=4, f32_tokens=16, share=(4, (8, 64), 8), n=4, smoke_response=16)
    return dict(kernel=(8192, 2048, 151_936), repeats=5, rollout=(256, 128, 1024), batch=64, batches=(64, 256),
                new_tokens=256, f32_batch=16, f32_tokens=64, share=(32, (64, 1024), 256), n=8, smoke_response=64)
    # rollout: rows, prompt tokens, new tokens; share: prompts, their length range, rows in flight


def model_config(kind: str, tok, tiny: bool, layers: int | None = None):
    """Qwen3-1.7B's or SmolLM3-3B's shape (or a toy of the same architecture), vocab from the tokenizer; layers:
    fewer decoder layers at full width (the smoke's models)."""
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
    if layers:
        shape["num_hidden_layers"] = layers
    arch = "qwen3" if kind == "qwen3" else "smollm3"
    ids = dict(vocab_size=len(tok), max_position_embeddings=8192, eos_token_id=tok.eos_token_id,
               pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id)
    try:
        return AutoConfig.for_model(arch, **ids, **shape)
    except (KeyError, ValueError):  # a transformers without SmolLM3: the Llama family it derives from
        return AutoConfig.for_model("llama", **ids, **shape)


def random_model(kind: str, tok, *, tiny: bool, dtype: torch.dtype, device: torch.device, seed: int):
    """A random-init model built directly on the device (no host copy of a 3B model)."""
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(model_config(kind, tok, tiny), dtype=dtype)
    model.generation_config.eos_token_id = tok.eos_token_id
    return model.eval()


def random_prompts(n: int, lo: int, hi: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(5, vocab - 1, (int(torch.randint(lo, hi + 1, (1,), generator=gen)),), generator=gen).tolist()
            for _ in range(n)]


# ------------------------------------------------------------------------------------------------
# 1. The log-prob kernel in the trainer's precision regime
# ------------------------------------------------------------------------------------------------


def bench_kernel(b: Bench, sz: dict) -> None:
    """token_logprobs (kept logits, the default; and recomputing, save_logits=False) against the naive path, fwd + bwd,
    interleaved; time and peak ratios against the targets (<= 1.2x the naive time, <= 1/3 of its peak)."""
    from sampler import token_logprobs
    device = b.device
    n, h, v = sz["kernel"]
    gen = torch.Generator().manual_seed(0)
    hidden = (torch.randn(n, h, generator=gen) * 4 / h**0.5).to(device)
    weight = (torch.randn(v, h, generator=gen) / h**0.5).to(device)
    targets = torch.randint(0, v, (n,), generator=gen).to(device)
    upstream = torch.randn(n, generator=gen).to(device)

    def run(path, autocast: bool):
        hh, ww = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            if path == "naive":
                lp = torch.log_softmax((hh @ ww.T).float(), dim=-1).gather(1, targets[:, None])[:, 0]  # (N,)
            else:  # the trainer's chunk_size (config.logprob_chunk)
                lp = token_logprobs(hh, ww, targets, chunk_size=1024, save_logits=path == "ours")  # (N,)
        (lp.float() * upstream).sum().backward()
        return lp.detach().float(), hh.grad.float(), ww.grad.float()

    ref = run("naive", autocast=False)  # fp32 reference
    rel = lambda a, r: float((a - r).norm() / r.norm().clamp(min=1e-30))  # noqa: E731
    paths = ("ours", "recompute", "naive")
    out = {p: dict(times=[], peaks=[]) for p in paths}
    for path in paths:  # untimed: first-call costs (kernel selection, allocator growth) fall outside the figures
        run(path, True)
    for _ in range(sz["repeats"]):  # interleaved: clocks and the allocator's state fall on every path alike
        for path in paths:
            b.reset_peak()
            base = torch.cuda.memory_allocated() if device.type == "cuda" else 0  # the inputs
            vals, t = timed(device, run, path, True)
            out[path]["times"].append(t)
            out[path]["peaks"].append(b.peak_gib())
            out[path]["above_gib"] = None if device.type != "cuda" else round(
                (torch.cuda.max_memory_allocated() - base) / GIB, 2)
            out[path]["err"] = [float(f"{rel(x, r):.2e}") for x, r in zip(vals, ref)]
    for path in paths:
        out[path]["ms"] = round(statistics.median(out[path]["times"]) * 1e3, 1)
        out[path]["peak_gib"] = max(out[path]["peaks"]) if out[path]["peaks"][0] is not None else None
    worst = max(a / max(r, 1e-12) for a, r in zip(out["ours"]["err"], out["naive"]["err"]))
    time_x = round(out["ours"]["ms"] / out["naive"]["ms"], 2)
    peak_x = None if out["ours"]["peak_gib"] is None else round(out["ours"]["peak_gib"] / out["naive"]["peak_gib"], 2)
    b.row("kernel", "token_logprobs bf16 fwd+bwd vs naive, N x H x V = " + "x".join(map(str, sz["kernel"])),
          ms=out["ours"]["ms"], naive_ms=out["naive"]["ms"], time_x=time_x,
          recompute_ms=out["recompute"]["ms"], recompute_time_x=round(out["recompute"]["ms"] / out["naive"]["ms"], 2),
          peak_gib=out["ours"]["peak_gib"], naive_peak_gib=out["naive"]["peak_gib"], peak_x=peak_x,
          recompute_peak_gib=out["recompute"]["peak_gib"], above_inputs_gib=out["ours"]["above_gib"],
          naive_above_inputs_gib=out["naive"]["above_gib"],
          err_values_gradh_gradw=out["ours"]["err"], naive_err=out["naive"]["err"], worst_ratio=round(worst, 3),
          targets_met=None if peak_x is None else (time_x <= 1.2 and peak_x <= 1 / 3),
          ok=worst <= 1.25)


# ------------------------------------------------------------------------------------------------
# 2. One decode step's attention over the paged pool: the kernel against the gathered path it replaces
# ------------------------------------------------------------------------------------------------

# The attention part's shapes: (query heads, KV heads, head_dim) of each model; slot counts (the plan's H100 slots:
# Qwen3 152, SmolLM3 184; both run at both); block size; prompt + cap columns; the rows' lengths (a share at L, the
# rest uniform in [lo, hi]: 30%, as the launcher's AT_CAP).
ATTENTION = dict(heads={"qwen3": (16, 8, 128), "smollm3": (16, 4, 128)}, slots=(152, 184), block=16,
                 length=2048 + 4096, lo=256, hi=4096, at_full=0.3, warm=3, repeats=20, dtype=torch.bfloat16)
ATTENTION_TINY = dict(heads={"qwen3": (4, 2, 16), "smollm3": (4, 1, 16)}, slots=(6,), block=4, length=64, lo=8, hi=40,
                      at_full=0.3, warm=1, repeats=2, dtype=torch.float16)  # Triton's interpreter: no bf16 matmul
ATTENTION_TOL = 3e-2  # max |d| against the float32 reference: sampler._kernel_checks_out's for 2-byte pools


def device_ms(device: torch.device, fn, *, warm: int, repeats: int) -> float:
    """Median milliseconds of fn() over `repeats` calls after `warm` untimed ones: CUDA events on CUDA (no host
    sync inside the timed span), the host clock on CPU."""
    for _ in range(warm):
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def attention_lengths(rows: int, *, full: int, lo: int, hi: int, at_full: float, seed: int) -> torch.Tensor:
    """(rows,) long: round(at_full x rows) rows at `full` columns (chosen at random), the rest uniform in [lo, hi]."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(lo, hi + 1, (rows,), generator=gen)  # (R,)
    lengths[torch.randperm(rows, generator=gen)[: round(at_full * rows)]] = full
    return lengths


def shuffled_table(lengths: torch.Tensor, *, width: int, block: int, seed: int) -> tuple[torch.Tensor, int]:
    """A block table as the pool's allocator leaves it after many refills: each row owns ceil(length / block) blocks
    drawn from a shuffled pool, the rest of its (width / block) entries point at the trash block (the last one, as
    sampler._PagedCache's). Returns (table (R, width / block) long, blocks in the pool, the trash one included)."""
    owned = [-(-int(n) // block) for n in lengths]
    used = sum(owned)
    order = torch.randperm(used, generator=torch.Generator().manual_seed(seed)).tolist()
    table = torch.full((len(owned), width // block), used, dtype=torch.long)  # (R, nb) all trash
    at = 0
    for r, n in enumerate(owned):
        table[r, :n] = torch.tensor(order[at: at + n])
        at += n
    return table, used + 1


class _AttentionModule(torch.nn.Module):
    """What transformers' sdpa_attention_forward reads off the attention module it is handed."""

    def __init__(self, groups: int):
        super().__init__()
        self.num_key_value_groups, self.is_causal = groups, True


def sdpa_gqa_branch(call) -> str:
    """What transformers' sdpa_attention_forward did with grouped heads during call(): "repeat_kv" (K/V copied to
    every query head, a transient of n_rep x the gathered K/V), "pack_gqa" (one query token: the query heads folded
    onto the KV heads, nothing copied; transformers 5.x) or "neither" (enable_gqa, or no grouping). Counted by
    wrapping those helpers of its module for this one call, so it says what the installed version runs."""
    from transformers.integrations import sdpa_attention as sdpa_module
    seen: set[str] = set()
    saved = {n: getattr(sdpa_module, n) for n in ("repeat_kv", "pack_gqa") if hasattr(sdpa_module, n)}

    def counting(name, fn):
        def wrapped(x, *args, **kwargs):
            if x is not None:  # pack_gqa is also handed the mask and a missing position bias
                seen.add(name)
            return fn(x, *args, **kwargs)
        return wrapped

    try:
        for name, fn in saved.items():
            setattr(sdpa_module, name, counting(name, fn))
        call()
    finally:
        for name, fn in saved.items():
            setattr(sdpa_module, name, fn)
    return "repeat_kv" if "repeat_kv" in seen else "pack_gqa" if "pack_gqa" in seen else "neither"


def attention_case(device: torch.device, *, heads: int, kv_heads: int, head_dim: int, rows: int, spec: dict,
                   run_kernel: bool, seed: int) -> dict:
    """One decode step's attention of one layer at (heads, kv_heads, head_dim) over `rows` slots of a shuffled
    paged pool, bf16: each arm's median ms, GB/s of the real K/V bytes and speed-up over the gathered arm; the
    kernel's and the gathered arm's max |d| against the float32 reference (paged_attention_reference on the same
    bf16 inputs, in chunks of rows to bound its memory)."""
    import torch.nn.functional as F
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from sampler import paged_attention, paged_attention_reference
    bs, width, dt = spec["block"], spec["length"], spec["dtype"]
    lengths = attention_lengths(rows, full=width, lo=spec["lo"], hi=spec["hi"], at_full=spec["at_full"], seed=seed)
    table, blocks = shuffled_table(lengths, width=width, block=bs, seed=seed + 1)
    lengths, table = lengths.to(device), table.to(device)  # (R,), (R, nb)
    gen = torch.Generator(device=device).manual_seed(seed + 2)
    k_pool, v_pool = (torch.randn(blocks * bs, kv_heads, head_dim, generator=gen, device=device).to(dt)
                      for _ in range(2))  # (N, h, d) each
    query = torch.randn(rows, heads, head_dim, generator=gen, device=device).to(dt)  # (R, H, d)
    scale = head_dim ** -0.5
    # the gathered path as the static step runs it (sampler._PagedCache.update at W = L, then sdpa's function)
    cols = torch.arange(width, device=device)  # (W,)
    read = table.index_select(1, cols // bs) * bs + cols % bs  # (R, W) the read index, kept between steps
    mask = (cols[None, :] < lengths[:, None])[:, None, None, :]  # (R, 1, 1, W) bool
    module = _AttentionModule(heads // kv_heads)

    def gather():
        keys, values = k_pool[read].transpose(1, 2), v_pool[read].transpose(1, 2)  # (R, h, W, d) each
        out, _ = sdpa_attention_forward(module, query[:, :, None, :], keys, values, mask, scaling=scale,
                                        dropout=0.0)  # (R, 1, H, d)
        return out[:, 0]  # (R, H, d)

    def kernel():
        return paged_attention(query, k_pool, v_pool, table, lengths, scale=scale, block_size=bs)  # (R, H, d)

    ref = torch.cat([paged_attention_reference(query[i: i + 8].float(), k_pool, v_pool, table[i: i + 8],
                                               lengths[i: i + 8], scale=scale, block_size=bs)
                     for i in range(0, rows, 8)])  # (R, H, d) float32
    err = lambda out: float((out.float() - ref).abs().max())  # noqa: E731
    real_bytes = int(lengths.sum()) * 2 * kv_heads * head_dim * dt.itemsize  # K and V of every real column
    arms = {"gather": dict(ms=device_ms(device, gather, warm=spec["warm"], repeats=spec["repeats"]))}
    out = dict(max_abs_d_gather=float(f"{err(gather()):.2e}"), gather_gqa=sdpa_gqa_branch(gather))
    if device.type == "cuda":  # the gathered arm's transient (sampler.py departure 13 budgets it as transient_copies)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        gather()
        torch.cuda.synchronize()
        out["gather_above_inputs_mib"] = round((torch.cuda.max_memory_allocated() - base) / 2**20, 1)
    if run_kernel:
        arms["kernel"] = dict(ms=device_ms(device, kernel, warm=spec["warm"], repeats=spec["repeats"]))
        out["max_abs_d_kernel"] = float(f"{err(kernel()):.2e}")
    # for scale: a dense (R, h, L, d) cache (every row at full width, no mask), flash-style sdpa, GQA in the kernel
    dense_k, dense_v = (p[read].transpose(1, 2).contiguous() for p in (k_pool, v_pool))  # (R, h, W, d) each
    q4 = query[:, :, None, :]  # (R, H, 1, d)
    try:
        F.scaled_dot_product_attention(q4[:1], dense_k[:1], dense_v[:1], scale=scale, enable_gqa=True)
        dense = lambda: F.scaled_dot_product_attention(q4, dense_k, dense_v, scale=scale, enable_gqa=True)  # noqa
        gqa = "enable_gqa"
    except (TypeError, RuntimeError):  # an older torch: the K/V heads repeated to the query heads, once, untimed
        dense_k, dense_v = (x.repeat_interleave(heads // kv_heads, dim=1) for x in (dense_k, dense_v))  # (R,H,W,d)
        dense = lambda: F.scaled_dot_product_attention(q4, dense_k, dense_v, scale=scale)  # noqa: E731
        gqa = "repeated K/V heads"
    arms["dense"] = dict(ms=device_ms(device, dense, warm=spec["warm"], repeats=spec["repeats"]))
    del dense_k, dense_v
    for arm in arms.values():
        arm["gb_per_s"] = round(real_bytes / (arm["ms"] / 1e3) / 1e9, 1)
        arm["speedup_vs_gather"] = round(arms["gather"]["ms"] / arm["ms"], 2)
        arm["ms"] = round(arm["ms"], 3)
    return dict(arms=arms, **out, real_kv_mb=round(real_bytes / 1e6, 3),
                gathered_kv_mb=round(rows * width * 2 * kv_heads * head_dim * dt.itemsize / 1e6, 3),
                mean_length=round(float(lengths.float().mean()), 1), at_full=int((lengths == width).sum()),
                pool_blocks=blocks, dense_gqa=gqa)


def bench_attention(b: Bench, tiny: bool) -> None:
    """One decode step's attention of one layer (module docstring, part 2): the paged kernel, the gathered path
    and a dense sdpa, per model shape and slot count. On CPU (--tiny) toy shapes, the kernel only under
    TRITON_INTERPRET=1 (interpreted: its time is meaningless)."""
    import sampler
    spec = ATTENTION_TINY if tiny else ATTENTION
    cuda = b.device.type == "cuda"
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    run_kernel = sampler.triton is not None and (cuda or interpreted)
    for kind, (heads, kv_heads, head_dim) in spec["heads"].items():
        for rows in spec["slots"]:
            b.reset_peak()
            got = attention_case(b.device, heads=heads, kv_heads=kv_heads, head_dim=head_dim, rows=rows,
                                 spec=spec, run_kernel=run_kernel, seed=51)
            errs = [got["max_abs_d_gather"]] + ([got["max_abs_d_kernel"]] if run_kernel else [])
            note = ("CUDA events, median of {repeats} after {warm} warm-up calls".format(**spec) if cuda else
                    "CPU, toy shapes: a smoke, the times meaningless; the kernel "
                    + ("ran under Triton's interpreter" if run_kernel else "needs CUDA or TRITON_INTERPRET=1: not run"))
            b.row("attention", f"one decode step's attention of one layer, {kind} heads {heads}/{kv_heads}/{head_dim}, "
                  f"{rows} slots, block {spec['block']}, L {spec['length']}, {str(spec['dtype'])[6:]}, shuffled pool",
                  **got, peak_gib=b.peak_gib(), kernel_ran=run_kernel, note=note,
                  ok=max(errs) <= ATTENTION_TOL)


# ------------------------------------------------------------------------------------------------
# 3-4. The trainer's regime: a real-width rollout, one update micro-batch
# ------------------------------------------------------------------------------------------------


def bench_rollout(b: Bench, sz: dict, tok, tiny: bool) -> None:
    """256 rows x 1,024 new tokens at Qwen3-1.7B's shape, float32 weights under bf16 autocast (Trainer.rollout)."""
    from sampler import sample
    device = b.device
    rows, prompt_len, new = sz["rollout"]
    model = random_model("qwen3", tok, tiny=tiny, dtype=torch.float32, device=device, seed=11)
    cfg = model.config
    prompts = random_prompts(rows, prompt_len, prompt_len, len(tok), seed=12)
    stats: dict = {}
    b.reset_peak()

    def run():
        with torch.autocast(device.type, dtype=torch.bfloat16):
            return sample(model, prompts, max_new_tokens=new, temperature=1.0, eos_token_id=-1, pad_token_id=0,
                          generator=torch.Generator().manual_seed(0), max_batch_size=rows, stats=stats)

    outs, seconds = timed(device, run)
    kv_token = stats["kv_bytes_per_token"]
    want = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 2
    steps = stats["forward_calls"]
    weights_bf16 = sum(p.numel() for p in model.parameters()) * 2  # the bf16 copies cast once, read per step
    mean_kv = rows * (prompt_len + new / 2) * kv_token  # the cache read by the average decode step
    ms = seconds / steps * 1e3
    b.row("rollout", f"Qwen3-1.7B shape, fp32 weights + bf16 autocast, {rows} rows x {prompt_len}+{new} tokens",
          kv_dtypes=[str(d) for d in stats["kv_dtypes"]], kv_bytes_per_token=kv_token, kv_expected=want,
          peak_gib=b.peak_gib(), kv_gib_at_end=round(rows * (prompt_len + new) * kv_token / GIB, 2),
          ms_per_step=round(ms, 2), steps=steps, tokens=sum(len(o.tokens) for o in outs), static=stats["static"],
          host_reads_per_step=round(stats["host_reads"] / max(1, stats["decode_steps"]), 3),
          gb_per_s=round((weights_bf16 + mean_kv) / (ms / 1e3) / 1e9, 1),
          ok=kv_token == want and all(d == torch.bfloat16 for d in stats["kv_dtypes"]))


def plan_figures(cfg_kw: dict, config) -> dict | str:
    """The memory plan's figures (GiB) for the same setting, when plan.py exists: its update (forward + backward)
    and optimizer-step phases, whose larger one is the peak measured here. Else why there are none."""
    try:
        import plan  # imported lazily: plan.py may not exist in this checkout
    except ImportError:
        return "plan.py not found"
    from config import Config
    with tempfile.TemporaryDirectory() as tmp:
        config.save_pretrained(tmp)  # the plan reads a config.json, no weights; no prompt file: --max-prompt-tokens
        phases, _ = plan.plan_side(Config(model=tmp, **cfg_kw), ranks=1, eval_files=[])
    return {ph.name: round(ph.total / GIB, 2) for ph in phases if ph.name in ("update", "optimizer step")}


def bench_microbatch(b: Bench, sz: dict, tok, tiny: bool, args) -> None:
    """One update micro-batch at SmolLM3-3B's shape: forward under bf16 autocast, backward, fused AdamW step."""
    from runtime import adamw_kernel
    from sampler import response_logprobs
    device = b.device
    rows, total = (2, 64) if tiny else (args.mb_rows, args.mb_tokens)
    prompt_len = max(1, total // 16)
    model = random_model("smollm3", tok, tiny=tiny, dtype=torch.float32, device=device, seed=13).train()
    if args.mb_checkpointing:
        model.gradient_checkpointing_enable()
        model.config.use_cache = False
    fast = adamw_kernel(device)  # as graft.Trainer builds it
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, **fast)
    prompts = random_prompts(rows, prompt_len, prompt_len, len(tok), seed=14)
    responses = random_prompts(rows, total - prompt_len, total - prompt_len, len(tok), seed=15)
    b.reset_peak()

    def step():
        with torch.autocast(device.type, dtype=torch.bfloat16):
            lp, mask = response_logprobs(model, prompts, responses, pad_token_id=0, share_prefix=False)
        (lp * mask).sum().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    _, first = timed(device, step)  # the first step allocates the AdamW moments: the steady state's peak
    b.reset_peak()
    _, seconds = timed(device, step)
    peak = b.peak_gib()
    plan_kw = dict(micro_batch_size=rows, max_prompt_tokens=prompt_len, max_response_tokens=total - prompt_len,
                   gradient_checkpointing=args.mb_checkpointing, share_prefix=False)
    try:
        planned = plan_figures(plan_kw, model.config)
    except BaseException as e:  # noqa: BLE001: the plan's column reports its own failure (SystemExit included)
        planned = f"plan failed: {type(e).__name__}: {e}"[:300]
    b.row("microbatch", f"SmolLM3-3B shape, {rows} rows x {total} tokens, checkpointing "
          f"{'on' if args.mb_checkpointing else 'off'}, fp32 + bf16 autocast + "
          f"{'fused' if fast.get('fused') else 'foreach'} AdamW", peak_gib=peak, plan_gib=planned,
          step_s=round(seconds, 2), first_step_s=round(first, 2), params=sum(p.numel() for p in model.parameters()))


# ------------------------------------------------------------------------------------------------
# 5. The smoke: run_pair.sh pair1 on one GPU, two processes, FSDP2, a checkpoint, --resume, an evaluation
# ------------------------------------------------------------------------------------------------


def smoke_models(tmp: Path, toks: dict, tiny: bool, layers: int) -> dict:
    """Small full-width models of both sides (real architectures, widths and tokenizers; `layers` layers),
    saved as model folders run_pair.sh can be pointed at (SMOL, QWEN)."""
    from transformers import AutoModelForCausalLM
    out = {}
    for side, kind in (("a", "smollm3"), ("b", "qwen3")):
        cfg = model_config(kind, toks[side], tiny, layers=None if tiny else layers)
        torch.manual_seed(21)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)  # saved small; the trainer loads fp32
        model.generation_config.eos_token_id = toks[side].eos_token_id
        folder = tmp / f"model_{side}"
        model.save_pretrained(folder)
        toks[side].save_pretrained(folder)
        out[side] = folder
        del model
    return out


def smoke_data(data: Path, n: int) -> Path:
    """The data folder run_pair.sh reads: math_train.jsonl (present, so it prepares nothing) and a benchmark."""
    data.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(22)
    rows = []
    for i in range(n):
        a, c = torch.randint(10, 99, (2,), generator=gen).tolist()
        rows.append(json.dumps({"id": f"q{i}", "problem": f"What is {a} + {c}?", "answer": str(a + c)}))
    (data / "math_train.jsonl").write_text("\n".join(rows) + "\n")
    bench = data / "smoke_bench.jsonl"
    bench.write_text("\n".join(rows[:4]) + "\n")
    return bench


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.is_file() else []


def bench_smoke(b: Bench, sz: dict, toks: dict, tiny: bool, args) -> None:
    """Two launches of `run_pair.sh pair1`: one step and a checkpoint, then --resume to step 2 with an evaluation."""
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        t0 = time.time()
        models = smoke_models(tmp, toks, tiny, args.smoke_layers)
        bench = smoke_data(tmp / "data", 16)
        made = time.time() - t0
        gpu = b.device.type == "cuda"
        env = dict(os.environ, SMOL=str(models["a"]), QWEN=str(models["b"]), RUNS=str(tmp / "runs"),
                   DATA=str(tmp / "data"), NGPU="1" if gpu else "0", FSDP="1", PYTHON=sys.executable,
                   PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
        flags = ["--prompts-per-step", "4", "--rollouts", "4", "--minibatches", "1", "--micro-batch-size", "4",
                 "--gen-batch-size", "16", "--max-response-tokens", str(sz["smoke_response"]), "--eval-every", "2",
                 "--benchmarks", str(bench), "--eval-max-problems", "4", "--eval-samples", "2", "--save-every", "1",
                 "--exchange-timeout", "300"] + (["--threads", "1"] if not gpu else [])
        launches = []
        for steps, extra in ((1, []), (2, ["--resume"])):
            env["STEPS"] = str(steps)
            t = time.time()
            r = subprocess.run(["bash", str(ROOT / "run_pair.sh"), "pair1"] + flags + extra, cwd=ROOT, env=env,
                               capture_output=True, text=True, timeout=args.smoke_timeout)
            launches.append(round(time.time() - t, 1))
            if r.returncode != 0:
                logs = {s: (tmp / "runs" / "pair1" / f"{s}.log") for s in "ab"}
                tails = {s: p.read_text()[-1500:] if p.is_file() else "" for s, p in logs.items()}
                raise RuntimeError(f"run_pair.sh pair1 (STEPS={steps} {' '.join(extra)}) exited {r.returncode}: "
                                   f"{r.stderr[-1000:]} | a.log: {tails['a']} | b.log: {tails['b']}")
        checks = {}
        for s in "ab":
            side = tmp / "runs" / "pair1" / s
            metrics = read_jsonl(side / "metrics.jsonl")
            ckpts = side / "checkpoints"
            checks[s] = dict(steps=[m.get("step") for m in metrics],
                             evaluated=any("eval/mean" in m for m in metrics),
                             checkpoints=sorted(p.name for p in ckpts.glob("step_*")) if ckpts.is_dir() else [])
        ok = all(c["steps"] == [0, 1] and c["evaluated"] and {"step_000001", "step_000002"} <= set(c["checkpoints"])
                 for c in checks.values())
        b.row("smoke", f"run_pair.sh pair1 on {'GPU 0 (both sides)' if gpu else 'the CPU'}, FSDP2 (1 rank per side), "
              f"{'toy' if tiny else f'full-width {args.smoke_layers}-layer'} models, 1 step + --resume to 2, one eval",
              models_s=round(made, 1), launch_s=launches, sides=checks, ok=ok,
              note="one process per side: multi-rank NCCL is not covered by one GPU")


# ------------------------------------------------------------------------------------------------
# 6-7. Long sampler rows: against generate, static vs eager, shared prefix
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


def generate_rows(model, prompts, *, new: int, eos: int, pad: int, device) -> list[list[int]]:
    """transformers' greedy generate on left-padded prompts, each row cut after its first EOS."""
    ids = torch.full((len(prompts), max(map(len, prompts))), pad, dtype=torch.long)
    att = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, ids.shape[1] - len(p):], att[i, ids.shape[1] - len(p):] = torch.tensor(p), 1
    out = model.generate(input_ids=ids.to(device), attention_mask=att.to(device), max_new_tokens=new,
                         do_sample=False, eos_token_id=eos, pad_token_id=pad)
    rows = []
    for row in out[:, ids.shape[1]:].tolist():
        rows.append(row[: row.index(eos) + 1] if eos in row else row)
    return rows


def compare(ours, theirs) -> dict:
    """Share of identical rows and the first position where any row differs (None: all identical)."""
    same = [a == b for a, b in zip(ours, theirs)]
    firsts = [next((t for t, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
              for a, b, s in zip(ours, theirs, same) if not s]
    return dict(identical=f"{sum(same)}/{len(same)}", first_divergence=min(firsts) if firsts else None,
                all_identical=all(same))


def path_fields(stats: dict) -> dict:
    """The decode path a sample() call took, off its stats: the static path's attention ("kernel" or "gather",
    sampler.py departure 18) and why, its CUDA graphs and their warm-up + capture seconds; None where the default
    (dynamic) path ran (static off: no paged pool, no graph)."""
    if "attention" not in stats:
        return dict(attention=None, attention_why="the default (dynamic) path ran", graphs=0, capture_seconds=0.0)
    return dict(attention=stats["attention"], attention_why=stats["attention_why"], graphs=stats["graphs"],
                capture_seconds=round(stats["capture_seconds"], 2))


def bench_sampler(b: Bench, sz: dict, tok, tiny: bool) -> None:
    from sampler import sample
    device = b.device
    pad, new = tok.pad_token_id or 0, sz["new_tokens"]
    prompts = random_prompts(max(sz["batches"]), 8, 64, len(tok), seed=2)
    # float32: strict identity with generate
    m32 = random_model("qwen3", tok, tiny=tiny, dtype=torch.float32, device=device, seed=1)
    small = prompts[: sz["f32_batch"]]
    eos32 = planted_eos(m32, small, sz["f32_tokens"], pad)
    stats: dict = {}
    ours = sample(m32, small, max_new_tokens=sz["f32_tokens"], temperature=0.0, eos_token_id=eos32, pad_token_id=pad,
                  stats=stats)
    ref = generate_rows(m32, small, new=sz["f32_tokens"], eos=eos32, pad=pad, device=device)
    cmp = compare([o.tokens for o in ours], ref)
    b.row("sampler", f"sampler vs generate, float32, batch {len(small)}, greedy (strict)", **cmp,
          static=stats["static"], **path_fields(stats), ok=cmp["all_identical"])
    del m32
    # bf16: by tolerance. The check used to be the sampler's log-probs against a plain forward
    # (mean 0.022 on the H200: FAILED), but the trainer never consumes the sampler's log-probs: it recomputes the
    # behaviour log-probs (graft.py departure 7), and its ratio compares them with the update pass's. The check is
    # now behaviour pass vs update pass; the sampler vs a plain forward is reported beside it, not checked.
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = random_model("qwen3", tok, tiny=tiny, dtype=dtype, device=device, seed=1)
    batch = prompts[: sz["batch"]]
    eos = planted_eos(model, batch, new, pad)
    stats: dict = {}
    ours, t_ours = timed(device, lambda: sample(model, batch, max_new_tokens=new, temperature=0.0, eos_token_id=eos,
                                                pad_token_id=pad, max_batch_size=len(batch), stats=stats))
    ref, t_ref = timed(device, lambda: generate_rows(model, batch, new=new, eos=eos, pad=pad, device=device))
    d = teacher_forced(model, batch, ours, device)
    t = trainer_passes(model, batch, ours, device)
    useful = sum(len(o.tokens) for o in ours)
    cmp = compare([o.tokens for o in ours], ref)
    b.row("sampler", f"sampler (default: static={stats['static']}) vs generate, {dtype}, batch {len(batch)}, greedy "
          f"(tolerance: behaviour vs update pass)", **cmp,
          behaviour_vs_update_mean=float(f"{float(t.mean()):.2e}"),
          behaviour_vs_update_max=float(f"{float(t.max()):.2e}"),
          sampler_vs_forward_mean=round(float(d.mean()), 4), sampler_vs_forward_max=round(float(d.max()), 4),
          tokens_per_s=round(useful / t_ours), generate_tokens_per_s=round(useful / t_ref),
          vs_generate=round(t_ref / t_ours, 2), static=stats["static"], **path_fields(stats),
          ok=float(t.mean()) <= BF16_MEAN and float(t.max()) <= BF16_MAX)
    for rows in sz["batches"]:
        many = prompts[:rows]
        on: dict = {}  # the static call's stats
        run = lambda static: sample(model, many, max_new_tokens=new, temperature=0.0, eos_token_id=eos,  # noqa: E731
                                    pad_token_id=pad, max_batch_size=rows, static=static,
                                    stats=on if static == "on" else None)
        eager, t_e = timed(device, run, "off")
        static, t_s = timed(device, run, "on")
        toks = sum(len(o.tokens) for o in eager)
        d = teacher_forced(model, many, static, device)
        cmp = compare([o.tokens for o in static], [o.tokens for o in eager])
        b.row("sampler", f"static decode vs eager, {dtype}, {rows} rows in flight (tolerance)", **cmp,
              static_tokens_per_s=round(toks / t_s), eager_tokens_per_s=round(toks / t_e),
              sampler_vs_forward_mean=round(float(d.mean()), 4), sampler_vs_forward_max=round(float(d.max()), 4),
              **path_fields(on),
              note="the static call includes its CUDA graph capture; both paths cast weights once and read the "
                   "host every 8 steps (sampler.py departures 16-17); identical rows reported, not checked")


def bench_prefill(b: Bench, sz: dict, tok, tiny: bool) -> None:
    """A GRPO rollout and its behaviour log-probs, share_prefix False vs True (sampler.py departure 11)."""
    from sampler import response_logprobs, sample
    device = b.device
    model = random_model("qwen3", tok, tiny=tiny, dtype=torch.bfloat16 if device.type == "cuda" else torch.float32,
                         device=device, seed=6)
    n_prompts, (lo, hi), slots = sz["share"]
    batch = [p for p in random_prompts(n_prompts, lo, hi, len(tok), seed=7) for _ in range(sz["n"])]
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

    def measured(fn, *a):
        b.reset_peak()
        out, t = timed(device, fn, *a)
        return out, t, b.peak_gib()

    rollout(True)  # warm-up
    res = {}
    for share in (False, True, True, False):  # interleaved; the second run of each is kept
        res[share] = measured(rollout, share)
    toks = {s: sum(len(o.tokens) for o in r[0]) for s, r in res.items()}
    cmp = compare([o.tokens for o in res[True][0]], [o.tokens for o in res[False][0]])
    b.row("prefill", f"shared prefix, rollout {n_prompts} prompts ({lo}-{hi} tokens) x n={sz['n']}, T=1, "
          f"{slots} in flight", tokens_per_s=round(toks[True] / res[True][1]),
          unshared_tokens_per_s=round(toks[False] / res[False][1]), peak_gib=res[True][2],
          unshared_peak_gib=res[False][2], identical=cmp["identical"])
    responses = [o.tokens for o in res[True][0]]
    lp = {share: measured(logprobs, share, responses) for share in (False, True)}
    diff = max(float((x - y).abs().max()) for x, y in zip(lp[False][0], lp[True][0]))
    b.row("prefill", "shared prefix, behaviour log-probs, micro-batches of 16", s=round(lp[True][1], 2),
          unshared_s=round(lp[False][1], 2), peak_gib=lp[True][2], unshared_peak_gib=lp[False][2],
          max_abs_diff=float(f"{diff:.2e}"), ok=diff <= BF16_MAX)


# ------------------------------------------------------------------------------------------------
# 8-9. The run at the launcher's settings and its projected GPU-hours; the profile of one decode step
# ------------------------------------------------------------------------------------------------

# pair1 as RESULTS' GPU-hours assume it (docs/RESULTS.md, "The memory plan"): per rank and step 256 rollouts of
# ~150-token prompts, a mean response of 1,509 tokens (30% at the 4,096 cap), micro-batches of 4 (MICRO_BATCH); the
# evaluation every 5 steps, 1,744 samples per rank; 174 steps on 4 + 4 GPUs. The rows in flight are the launcher's,
# from the memory plan (launched_slots). Only these shapes are assumed; every time per token below is measured.
PAIR1 = dict(rollouts=256, prompt=150, mean_response=1509, cap=4096, at_cap=0.30, micro=4, eval_every=5,
             eval_samples=1744, steps=174, gpus=8, ranks=4)
# The prompt lengths the launcher's plan measures for pair1 (`graft.py plan`, docs/RESULTS.md "The memory plan":
# MATH train and the five benchmarks under each model's tokenizer): (longest, mean) of the training prompts, then of
# the evaluation's. The bench has no data files; the plan's own measurement is what run_pair.sh passes on a node.
PAIR1_PROMPTS = {"qwen3": (1669, 90, 845, 110), "smollm3": (1569, 88, 814, 107)}
AT_CAP = 0.30  # share of rollouts at the cap in the launcher row's length distribution
TRAIN_ROWS = 64  # rollouts the launcher row's behaviour pass and update run over (their seconds per token)
FSDP_MIN_SLOTS = 128  # run_pair.sh's: data parallel with fewer slots shards when sharded gives more
HBM_BYTES_PER_S = {"H100": 3.35e12, "H200": 4.8e12}  # the extra KV width's read, by the card's name (else H200's)
GATHER_ARM_X = 6  # the launcher's gather arm runs when the budget left holds this many kernel rollouts (an estimate)


def columns_read(prompt_lens: list[int], response_lens: list[int]) -> int:
    """K/V columns the paged kernel reads to sample these rows: a row of prompt p and response r attends over
    p + t + 1 columns at its t-th step (its cached tokens and the current one), sum_t (p + t + 1) = r p + r (r + 1) / 2.
    The same count for the measured run and for pair1's rows (pair1_columns_per_token), so their difference is the
    extra read; the sampler's own count over its decode steps, stats["kv_columns_real"], is printed beside it."""
    return sum(r * p + r * (r + 1) // 2 for p, r in zip(prompt_lens, response_lens))


def pair1_columns_per_token(P: dict = PAIR1) -> float:
    """columns_read per sampled token at pair1's length distribution (arithmetic): prompts of P["prompt"] tokens,
    P["at_cap"] of the rollouts at P["cap"], the rest geometric (as RESULTS' bytes-per-step estimate takes them) with
    the mean that makes the whole mean P["mean_response"]. E[r p + r (r + 1) / 2] / E[r], a geometric of mean m
    having E[r^2] = 2 m^2 - m."""
    mean, a, cap = P["mean_response"], P["at_cap"], P["cap"]
    short = (mean - a * cap) / (1 - a)  # the mean of the rows below the cap
    assert short >= 1, f"PAIR1: a mean response of {mean} cannot hold {a:.0%} of the rows at the cap {cap}"
    square = a * cap ** 2 + (1 - a) * (2 * short ** 2 - short)  # E[r^2]
    return (mean * P["prompt"] + (square + mean) / 2) / mean


def tail_eos(vocab: int, cap: int, at_cap: float, seed: int) -> list[int]:
    """Stop ids for a random-init model, whose next token is close to uniform over the vocabulary: k ids stop a
    row with chance ~k / V per step, lengths are then geometric, and (1 - k / V) ** cap = at_cap puts that share of
    the rows at the cap: a long-tailed length distribution (measured and reported, not assumed)."""
    k = max(1, round(vocab * (1 - at_cap ** (1 / cap))))
    return torch.randperm(vocab - 10, generator=torch.Generator().manual_seed(seed))[:k].add(5).tolist()


def launched_slots(config, kind: str, card: int, *, tiny: bool) -> dict:
    """The rows in flight run_pair.sh launches this side of pair1 with on 4 GPUs of `card` bytes: the memory plan
    (plan.py, fake tensors) at the launcher's flags, data parallel, then sharded when data parallel does not fit
    or gives fewer than FSDP_MIN_SLOTS slots and sharded gives more (run_pair.sh's rule). Returns the slots, the K/V
    budget (the trainer's runtime.kv_budget on that layout: sample's max_cache_bytes), the layout and the rows in
    flight the sampler's cut of it holds at those slots (pool_rows: expected lengths; worst_rows: every row full)."""
    import plan
    from config import Config
    longest, mean, eval_longest, eval_mean = (12, 8, 12, 8) if tiny else PAIR1_PROMPTS[kind]
    cfg = Config(model=kind, gradient_checkpointing=True, micro_batch_size=PAIR1["micro"],
                 gen_batch_size=plan.LAUNCH_ALIGN, eval_every=PAIR1["eval_every"],
                 max_response_tokens=24 if tiny else PAIR1["cap"])
    t0 = time.time()

    def layout(fsdp: bool) -> dict:
        c = dataclasses.replace(cfg, fsdp=fsdp)
        m = plan.measure(config, c, prompt_len=longest, eval_prompt_len=eval_longest)
        phases = plan.phases(m, c, ranks=PAIR1["ranks"], prompt_len=longest, eval_prompt_len=eval_longest, card=card,
                             mean_prompt=mean, mean_eval_prompt=eval_mean)
        slots = plan.launch_slots(phases, card, rows=c.gen_batch_size)
        # the pool as the sampler cuts it at the launched slots (the same measurement, the rows' arithmetic only)
        at = plan.phases(m, dataclasses.replace(c, gen_batch_size=max(1, slots)), ranks=PAIR1["ranks"],
                         prompt_len=longest, eval_prompt_len=eval_longest, card=card, mean_prompt=mean,
                         mean_eval_prompt=eval_mean)[0].rows
        return dict(slots=slots, fsdp=fsdp, fits=plan.verdict(phases, card) is None, pool=at.budget,
                    pool_rows=at.expected, worst_rows=at.worst)

    chosen = dp = layout(False)
    if not dp["fits"] or dp["slots"] < FSDP_MIN_SLOTS:  # as run_pair.sh: sharded only then, and only if it gains
        sharded = layout(True)
        if not dp["fits"] or sharded["slots"] > dp["slots"]:
            chosen = sharded
    return chosen | dict(plan_s=round(time.time() - t0, 1))


def launcher_side(b: Bench, kind: str, tok, tiny: bool, args) -> dict:
    """One side's rollout, behaviour pass and update at the launcher's settings; measured seconds per token."""
    from runtime import adamw_kernel
    from sampler import batches_by_length, response_logprobs, sample
    device = b.device
    config = model_config(kind, tok, tiny)
    card = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else 2**26  # toy: 64 MiB
    launch = launched_slots(config, kind, card, tiny=tiny)
    in_flight = min(launch["slots"], 4) if tiny else launch["slots"]  # toy sizes: a few rows
    rows = 2 * in_flight if tiny else (args.launch_rows or min(2 * in_flight, 512))  # twice: refills happen
    cap, micro = (24, 2) if tiny else (args.launch_cap, PAIR1["micro"])
    budget = launch["pool"] if device.type == "cuda" else None  # the K/V budget the launched layout's trainer gets
    model = random_model(kind, tok, tiny=tiny, dtype=torch.float32, device=device, seed=31)
    prompts = random_prompts(rows, PAIR1["prompt"] // 2 if not tiny else 4, PAIR1["prompt"] if not tiny else 12,
                             len(tok), seed=32)
    eos = tail_eos(len(tok), cap, AT_CAP, seed=33)
    stats: dict = {}
    b.reset_peak()

    def rollout(rows_prompts, stats, attention):
        with torch.autocast(device.type, dtype=torch.bfloat16):  # the trainer's regime: fp32 masters + autocast
            return sample(model, rows_prompts, max_new_tokens=cap, temperature=1.0, eos_token_id=eos, pad_token_id=0,
                          generator=torch.Generator().manual_seed(0), max_batch_size=in_flight, stats=stats,
                          max_cache_bytes=budget, attention=attention)

    outs, t_roll = timed(device, rollout, prompts, stats, "auto")
    responses = [o.tokens for o in outs]
    new_tokens = sum(map(len, responses))
    columns = columns_read(list(map(len, prompts)), list(map(len, responses)))  # what the kernel read, by arithmetic
    all_prompts = prompts
    # the behaviour pass and the update over the first TRAIN_ROWS rollouts: their per-token times are the terms
    trained = min(rows, TRAIN_ROWS)
    prompts, responses = prompts[:trained], responses[:trained]
    fed = sum(len(p) + len(r) for p, r in zip(prompts, responses))

    def behaviour():
        with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16):
            for idx in batches_by_length(prompts, responses, 16):
                response_logprobs(model, [prompts[i] for i in idx], [responses[i] for i in idx], pad_token_id=0)

    model.train()
    model.gradient_checkpointing_enable()  # the launcher's --gradient-checkpointing
    model.config.use_cache = False
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, **adamw_kernel(device))

    def update():
        for i in range(0, trained, micro):
            with torch.autocast(device.type, dtype=torch.bfloat16):
                lp, mask = response_logprobs(model, prompts[i: i + micro], responses[i: i + micro], pad_token_id=0)
            (lp * mask).sum().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    model.eval()
    _, t_lp = timed(device, behaviour)
    model.train()
    _, t_up = timed(device, update)
    del opt  # its moments: the gather arm below runs with the weights alone, as the main rollout did
    lengths = sorted(len(o.tokens) for o in outs)
    side = dict(sample_s_per_token=t_roll / new_tokens, logprob_s_per_token=t_lp / fed, update_s_per_token=t_up / fed,
                kv_token=stats["kv_bytes_per_token"], rows=in_flight, cap=cap, attention=stats.get("attention"),
                columns_per_token=columns / new_tokens)
    b.row("launcher", f"{kind} shape, pair1's launcher settings: fp32 + bf16 autocast, {in_flight} rows in flight "
          f"(the plan's slots as run_pair.sh launches 4 GPUs of this card: {'FSDP2' if launch['fsdp'] else 'DP'}), "
          f"{rows} rollouts, cap {cap}, T=1, ~{AT_CAP:.0%} of rows at the cap; behaviour pass and update over "
          f"{trained} of them (micro-batches of {micro}, checkpointing, AdamW)", static=stats["static"], launch=launch,
          rollout_s=round(t_roll, 2), new_tokens=new_tokens, tokens_per_s=round(new_tokens / t_roll),
          decode_steps=stats["decode_steps"], ms_per_step=round(t_roll / max(1, stats["decode_steps"]) * 1e3, 2),
          host_reads_per_step=round(stats["host_reads"] / max(1, stats["decode_steps"]), 3),
          at_cap=f"{sum(n == cap for n in lengths)}/{rows}", median_len=lengths[rows // 2],
          logprob_s=round(t_lp, 2), update_s=round(t_up, 2), peak_gib=b.peak_gib(), **path_fields(stats),
          columns_read=columns, kv_columns_real=stats.get("kv_columns_real"),
          **{k: stats[k] for k in ("slots", "preemptions", "rows_in_flight_mean", "rows_in_flight_peak",
                                   "kv_pool_bytes", "kv_blocks_peak") if k in stats})  # the paged sampler's stats
    # the same rollout with the gathered attention (sampler.py departure 18's "gather"), when the budget holds it
    left = b.budget - (time.time() - b.t0)
    name = f"{kind} shape, the same {rows} rollouts with attention='gather' (after one update: the weights moved)"
    if stats.get("attention") == "gather" and not tiny:
        b.row("launcher", name, skipped=f"auto already gathered: {stats.get('attention_why')}")
    elif left < GATHER_ARM_X * t_roll and not tiny:
        b.row("launcher", name, skipped=f"--budget: {left:.0f} s left, under {GATHER_ARM_X} x the rollout's "
                                        f"{t_roll:.0f} s (the gather arm's time, an estimate)")
    else:
        model.eval()
        gathered: dict = {}
        b.reset_peak()
        outs, t_gather = timed(device, rollout, all_prompts, gathered, "gather")
        got = sum(len(o.tokens) for o in outs)
        b.row("launcher", name, rollout_s=round(t_gather, 2), new_tokens=got, tokens_per_s=round(got / t_gather),
              decode_steps=gathered["decode_steps"],
              ms_per_step=round(t_gather / max(1, gathered["decode_steps"]) * 1e3, 2),
              auto_tokens_per_s=round(new_tokens / t_roll),
              auto_over_gather=round((new_tokens / t_roll) / (got / t_gather), 2), peak_gib=b.peak_gib(),
              **path_fields(gathered), **{k: gathered[k] for k in ("slots", "preemptions", "rows_in_flight_mean",
                                                                   "kv_pool_bytes", "kv_gather_bytes")
                                          if k in gathered})
    del model
    return side


def project_pair1(sides: dict, *, bandwidth: float, P: dict = PAIR1) -> dict:
    """pair1's GPU-hours for P["steps"] steps on P["gpus"] GPUs from each side's measured seconds per token (pure
    arithmetic; sides: {kind: launcher_side's dict}). Per rank and step: sampling P["rollouts"] x P["mean_response"]
    tokens at the measured s/token, plus the extra K/V read at `bandwidth` B/s of pair1's longer rows over the
    measured ones: where the side's attention was the paged kernel (m["attention"] == "kernel") a row reads only its
    own columns, so the extra per sampled token is pair1_columns_per_token(P) minus the measured run's
    (m["columns_per_token"], columns_read over its tokens), x KV bytes per token; else (the gathered path, every row
    reading the full width) the cap's extra width P["cap"] - m["cap"] per token. Then the behaviour pass and the
    update over prompt + response tokens; the evaluation's P["eval_samples"] samples every P["eval_every"] steps at
    the sampling rate. The pair moves at its slower side."""
    per = {}
    for kind, m in sides.items():
        rollout_tokens = P["rollouts"] * P["mean_response"]
        fed = P["rollouts"] * (P["prompt"] + P["mean_response"])
        if m.get("attention") == "kernel":  # each row reads its real columns: sum_t (p + t + 1) over its steps
            extra_cols = max(0.0, pair1_columns_per_token(P) - m["columns_per_token"])
        else:  # every row reads the full width: the cap's extra columns at every sampled token
            extra_cols = max(0, P["cap"] - m["cap"])
        kv_s = extra_cols * m["kv_token"] / bandwidth * rollout_tokens
        sampling = rollout_tokens * m["sample_s_per_token"] + kv_s
        train = fed * (m["logprob_s_per_token"] + m["update_s_per_token"])
        evaluation = (P["eval_samples"] * P["mean_response"] * m["sample_s_per_token"]
                      + kv_s * P["eval_samples"] / P["rollouts"]) / P["eval_every"]
        per[kind] = dict(rows=m["rows"], attention=m.get("attention"), extra_columns_per_token=round(extra_cols, 1),
                         sampling_s=round(sampling, 1), kv_width_s=round(kv_s, 1),
                         logprob_update_s=round(train, 1), eval_s=round(evaluation, 1),
                         step_s=round(sampling + train + evaluation, 1), step_no_eval_s=round(sampling + train, 1))
    step = max(v["step_s"] for v in per.values())
    step_no_eval = max(v["step_no_eval_s"] for v in per.values())
    hours = lambda s: round(P["steps"] * s * P["gpus"] / 3600, 1)  # noqa: E731
    return dict(per_side=per, gpu_hours=hours(step), gpu_hours_without_eval=hours(step_no_eval))


def bench_launcher(b: Bench, sz: dict, toks: dict, tiny: bool, args) -> None:
    """Both sides at the launcher's settings, then pair1's GPU-hours for 174 steps projected from the measured
    seconds per token (module docstring, part 7; project_pair1): the pair moves at its slower side."""
    sides = {kind: launcher_side(b, kind, toks[s], tiny, args) for s, kind in (("b", "qwen3"), ("a", "smollm3"))}
    name = torch.cuda.get_device_name() if b.device.type == "cuda" else ""
    bandwidth = next((v for k, v in HBM_BYTES_PER_S.items() if k in name), HBM_BYTES_PER_S["H200"])
    b.row("launcher", "pair1 projected GPU-hours, 174 steps on 4 + 4 GPUs of this kind, from the measured seconds per "
          "token (shapes as RESULTS' terms: 256 rollouts per rank, mean response 1,509; rows in flight as launched)",
          **project_pair1(sides, bandwidth=bandwidth), bandwidth=bandwidth, paper_gpu_hours=43.3,
          note="toy sizes on CPU: the arithmetic only" if tiny else "random-init models at the real shapes")


def bench_profile(b: Bench, sz: dict, tok, tiny: bool) -> None:
    """Per decode step, eager (the default path) and static: aten ops, weight casts (a dispatch counter, as
    bench/decode.py), host reads (the sampler's count); on CUDA also kernels launched from the host, CUDA graph
    launches, device-to-host copies and stream syncs (torch.profiler), between two run lengths so the prefill
    cancels. fp32 weights under bf16 autocast, 32 rows in flight, the old settings beside them."""
    from sampler import sample
    device = b.device
    rows, short, long = (4, 8, 24) if tiny else (32, 16, 80)
    model = random_model("qwen3", tok, tiny=tiny, dtype=torch.float32, device=device, seed=41)
    prompts = random_prompts(rows, 16, 64, len(tok), seed=42)
    weights = linear_weights(model)
    arms = {"before (cast per step, read every step)": dict(static="off", cast_once=False, sync_every=1),
            "default path, eager (static=off)": dict(static="off"), "static (CUDA graph on CUDA)": dict(static="on")}

    def run(kw, new):
        stats = {}
        with torch.autocast(device.type, dtype=torch.bfloat16):
            sample(model, prompts, max_new_tokens=new, temperature=1.0, eos_token_id=-1, pad_token_id=0,
                   generator=torch.Generator().manual_seed(0), max_batch_size=rows, stats=stats, **kw)
        return stats

    for name, kw in arms.items():
        counts = {}
        for new in (short, long):
            run(kw, new)  # warm (a capture, lazy inits)
            with OpCounter(weights) as c:
                stats = run(kw, new)
            prof = {}
            if device.type == "cuda":
                from torch.profiler import ProfilerActivity, profile
                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
                    run(kw, new)
                    torch.cuda.synchronize()
                names = [e.name for e in p.events()]
                prof = dict(kernels=sum(n.startswith("cudaLaunchKernel") for n in names),
                            graphs=sum(n == "cudaGraphLaunch" for n in names),
                            dtoh=sum("DtoH" in n for n in names),
                            syncs=sum(n in ("cudaStreamSynchronize", "cudaDeviceSynchronize") for n in names))
            counts[new] = dict(ops=c.ops, casts=c.casts, reads=stats["host_reads"], **prof)
        d = long - short
        b.row("profile", f"per decode step, {name}, qwen3 shape, fp32 + bf16 autocast, {rows} rows",
              **{k: round((counts[long][k] - counts[short][k]) / d, 2) for k in counts[long]}, **path_fields(stats),
              note="kernels: launches from the host (a graph replay is one cudaGraphLaunch)" if device.type == "cuda"
              else "CPU: aten ops only (no profiler counts)")
    del model


# ------------------------------------------------------------------------------------------------
# Main
# ------------------------------------------------------------------------------------------------


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="toy sizes on CPU (the test suite's run)")
    p.add_argument("--tokenizers", default="", help="folder with qwen3/ and smollm3/ tokenizer folders")
    p.add_argument("--only", default="", help=f"comma list of parts to run, of {', '.join(PARTS)} (default all)")
    p.add_argument("--skip", default="", help="comma list of parts not to run")
    p.add_argument("--budget", type=float, default=480.0, help="seconds; parts that would start later are skipped")
    p.add_argument("--jsonl", default=str(ROOT / "runs" / "bench_gpu.jsonl"), help="rows are appended here")
    p.add_argument("--mb-rows", type=int, default=4, help="microbatch part: rows of the micro-batch")
    p.add_argument("--mb-tokens", type=int, default=4096, help="microbatch part: tokens per row (prompt + response)")
    p.add_argument("--no-mb-checkpointing", dest="mb_checkpointing", action="store_false",
                   help="microbatch part: without gradient checkpointing")
    p.add_argument("--smoke-layers", type=int, default=2, help="smoke part: decoder layers of the full-width models")
    p.add_argument("--smoke-timeout", type=float, default=300.0, help="smoke part: seconds per launch")
    p.add_argument("--launch-rows", type=int, default=0,
                   help="launcher part: rollouts per side (0 = twice the plan's slots, at most 512)")
    p.add_argument("--launch-cap", type=int, default=1024, help="launcher part: the cap of the measured rollouts")
    args = p.parse_args(argv)
    chosen = [x for x in (args.only.split(",") if args.only else PARTS) if x]
    bad = [x for x in chosen + args.skip.split(",") if x and x not in PARTS]
    if bad:
        raise SystemExit(f"bench/gpu.py --only/--skip: unknown part(s) {bad}; parts: {', '.join(PARTS)}")
    chosen = [x for x in PARTS if x in chosen and x not in args.skip.split(",")]
    from transformers import AutoTokenizer
    import transformers
    device = torch.device("cpu") if args.tiny or not torch.cuda.is_available() else torch.device("cuda")
    if args.tiny:
        torch.set_num_threads(1)
        dirs = {"a": ROOT / "data" / "tiny_models" / "A", "b": ROOT / "data" / "tiny_models" / "B"}
    else:
        if not args.tokenizers:
            raise SystemExit("bench/gpu.py: --tokenizers DIR is required without --tiny (a folder holding qwen3/ and "
                             "smollm3/)")
        dirs = {"a": Path(args.tokenizers) / "smollm3", "b": Path(args.tokenizers) / "qwen3"}
    for d in dirs.values():
        if not d.is_dir():
            raise SystemExit(f"bench/gpu.py --tokenizers: {d} is not a folder")
    toks = {k: AutoTokenizer.from_pretrained(d) for k, d in dirs.items()}
    for t in toks.values():
        if t.pad_token_id is None:
            t.pad_token = t.eos_token
    b = Bench(Path(args.jsonl), args.budget, device)
    sz = sizes(args.tiny)
    b.row("setup", "machine", device=str(device), gpu=torch.cuda.get_device_name() if device.type == "cuda" else None,
          torch=torch.__version__, transformers=transformers.__version__, cuda=torch.version.cuda,
          alloc_conf=os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or os.environ.get("PYTORCH_ALLOC_CONF"),
          sizes="toy" if args.tiny else "real", parts=chosen, budget_s=args.budget, jsonl=str(b.path),
          note="one GPU: multi-rank NCCL (FSDP2 over several GPUs) is not covered")
    calls = {"kernel": (bench_kernel, b, sz), "attention": (bench_attention, b, args.tiny),
             "rollout": (bench_rollout, b, sz, toks["b"], args.tiny),
             "microbatch": (bench_microbatch, b, sz, toks["a"], args.tiny, args),
             "smoke": (bench_smoke, b, sz, toks, args.tiny, args),
             "sampler": (bench_sampler, b, sz, toks["b"], args.tiny),
             "prefill": (bench_prefill, b, sz, toks["b"], args.tiny),
             "launcher": (bench_launcher, b, sz, toks, args.tiny, args),
             "profile": (bench_profile, b, sz, toks["b"], args.tiny)}
    for name in chosen:
        fn, *rest = calls[name]
        b.part(name, fn, *rest)
    b.row("setup", "done", failed=b.failed, total_s=round(time.time() - b.t0, 1))
    print(f"[bench_gpu] {time.time() - b.t0:.0f} s; rows in {b.path}; "
          + ("all checks passed" if not b.failed else f"FAILED: {'; '.join(b.failed)}"), flush=True)
    return 1 if b.failed else 0


if __name__ == "__main__":
    sys.exit(main())
