"""The paged decode kernel (sampler.py departure 18) on CPU, through Triton's interpreter.

The kernel is Triton; this machine has no GPU, so it runs under TRITON_INTERPRET=1, which Triton reads when it
decorates the kernel, at sampler's import: each check that launches it runs in a subprocess with that variable set.
What is checked: the plain-PyTorch reference against a per-slot sdpa loop; the kernel against the reference (float32
and float16: the interpreter's bf16 matmul is broken, so bf16 is left to the on-device check ``_kernel_checks_out``);
the static path with the kernel against the gathered path on every model family it serves (greedy tokens identical,
log-probs within float32 round-off), and at temperature 1 with preemptions against the default path; which path
``resolve_attention`` takes and why; the pool's cut without a gather.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import sampler
from sampler import paged_attention_reference, pool_plan, resolve_attention

ROOT = Path(__file__).resolve().parents[1]
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                  reason="Triton is not installed (pip install -r requirements-test.txt): the "
                                         "kernel's CPU checks run it through Triton's interpreter")


def interpreted(code: str) -> dict:
    """Run `code` in a fresh Python with TRITON_INTERPRET=1 (the repository and tests/ importable); it prints one
    JSON object as its last line, returned here."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'tests'}"}
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def random_pool(*, rows, heads, kv_heads, dim, block_size, blocks, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(rows, heads, dim, generator=g, dtype=torch.float64).to(dtype)
    k = torch.randn(blocks * block_size, kv_heads, dim, generator=g, dtype=torch.float64).to(dtype)
    v = torch.randn(blocks * block_size, kv_heads, dim, generator=g, dtype=torch.float64).to(dtype)
    per_row = blocks // rows
    table = torch.randperm(blocks, generator=g)[: rows * per_row].view(rows, per_row)  # each row its own blocks
    return q, k, v, table


# ------------------------------------------------------------------------------------------------
# the reference, against an independent computation: per slot, its columns gathered by a Python loop, repeat_kv, sdpa
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("heads,kv_heads,dim,block_size", [(4, 2, 8, 4), (6, 2, 24, 16), (8, 8, 16, 16), (8, 1, 8, 2)])
def test_reference_is_sdpa_over_each_slots_own_columns(heads, kv_heads, dim, block_size):
    q, k, v, table = random_pool(rows=4, heads=heads, kv_heads=kv_heads, dim=dim, block_size=block_size, blocks=24,
                                 dtype=torch.float64)
    width = table.shape[1] * block_size
    lengths = torch.tensor([1, block_size, width, width // 2 + 1])
    got = paged_attention_reference(q, k, v, table, lengths, scale=0.3, block_size=block_size)
    for r in range(4):
        rows = [int(table[r, c // block_size]) * block_size + c % block_size for c in range(int(lengths[r]))]
        keys = k[rows].transpose(0, 1).repeat_interleave(heads // kv_heads, dim=0)  # (H, n, d): head i reads i // g
        values = v[rows].transpose(0, 1).repeat_interleave(heads // kv_heads, dim=0)
        want = F.scaled_dot_product_attention(q[r][:, None], keys, values, scale=0.3)[:, 0]  # (H, d)
        torch.testing.assert_close(got[r], want, rtol=1e-12, atol=1e-12)


# ------------------------------------------------------------------------------------------------
# the kernel against the reference (interpreted)
# ------------------------------------------------------------------------------------------------


@needs_triton
def test_kernel_matches_the_reference():
    out = interpreted("""
        import json, torch
        from sampler import paged_attention, paged_attention_reference
        from test_paged_kernel import random_pool
        res = []
        for dtype in (torch.float32, torch.float16):
            for heads, kv, dim, bs in ((4, 2, 8, 16), (16, 8, 128, 16), (6, 2, 24, 4), (8, 8, 64, 16), (32, 4, 16, 8)):
                q, k, v, table = random_pool(rows=5, heads=heads, kv_heads=kv, dim=dim, block_size=bs, blocks=40,
                                             dtype=dtype)
                width = table.shape[1] * bs
                # one column; a block and a part; a tile (64) and a part; every column; past two tiles
                lengths = torch.tensor([1, bs + 3, min(width, 67), width, min(width, 130)])
                got = paged_attention(q, k, v, table, lengths, scale=dim ** -0.5, block_size=bs)
                want = paged_attention_reference(q.float(), k.float(), v.float(), table, lengths, scale=dim ** -0.5,
                                                 block_size=bs)
                res.append([str(dtype), heads, kv, dim, bs, str(got.dtype), (got.float() - want).abs().max().item()])
        print(json.dumps(res))
    """)
    assert len(out) == 10
    for dtype, heads, kv, dim, bs, got_dtype, err in out:
        assert got_dtype == dtype, (dtype, got_dtype)  # returned in the query's dtype
        tol = 2e-6 if dtype == "torch.float32" else 3e-3  # float16: the probabilities rounded before the product
        assert err < tol, (dtype, heads, kv, dim, bs, err)


# ------------------------------------------------------------------------------------------------
# the static path with the kernel against the gathered path, on every family the kernel serves (interpreted)
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sweep():
    """One interpreted process: for each family in sampler._KERNEL_MODEL_TYPES (tiny models of the architecture
    sweep), greedy tokens and log-probs of the static path with the kernel and with the gather, 3 slots."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("Triton is not installed (pip install -r requirements-test.txt): the kernel's CPU checks run it "
                    "through Triton's interpreter")
    return interpreted("""
        import json, torch, sampler
        from test_sampler import arch_model, ARCH_PROMPTS, ARCHS
        res = {}
        for arch in ARCHS:
            model = arch_model(arch)
            windows = sampler._layer_windows(model.config)
            if model.config.model_type not in sampler._KERNEL_MODEL_TYPES or any(w is not None for w in windows):
                continue  # a family the kernel does not serve, or sliding windows: no static path
            res[arch] = {}
            for att in ("gather", "kernel"):
                st = {}
                out = sampler.sample(model, ARCH_PROMPTS, max_new_tokens=12, temperature=0, eos_token_id=1000,
                                     static="on", attention=att, max_batch_size=3, stats=st)
                logp = torch.cat([r.logprobs for r in out]).tolist()
                res[arch][att] = dict(tokens=[r.tokens for r in out], logp=logp,
                                      attention=st["attention"], gather_bytes=st["kv_gather_bytes"],
                                      widths=sorted(st["width_steps"]))
        print(json.dumps(res))
    """)


def test_every_served_family_is_in_the_sweep(sweep):
    from test_sampler import ARCHS, arch_model
    swept = {arch_model(a).config.model_type for a in ARCHS}
    assert sampler._KERNEL_MODEL_TYPES <= swept, sampler._KERNEL_MODEL_TYPES - swept  # none served unchecked
    assert len(sweep) >= len(sampler._KERNEL_MODEL_TYPES)


def test_the_kernels_static_path_is_the_gathered_one(sweep):
    for arch, runs in sweep.items():
        kernel, gather = runs["kernel"], runs["gather"]
        assert (kernel["attention"], gather["attention"]) == ("kernel", "gather"), arch
        assert kernel["tokens"] == gather["tokens"], arch
        assert max(abs(a - b) for a, b in zip(kernel["logp"], gather["logp"])) < 2e-5, arch
        assert kernel["gather_bytes"] == 0 and gather["gather_bytes"] > 0, arch  # nothing gathered, nothing paid
        assert len(kernel["widths"]) == 1, arch  # one width: the kernel reads each row's own columns


@needs_triton
def test_the_kernel_at_temperature_one_with_preemptions_draws_the_default_paths_tokens():
    out = interpreted("""
        import json, torch, sampler
        from test_sampler import arch_model
        model = arch_model("qwen3")
        prompts = [[5 + i, 6, 7 + i % 3][: 1 + i % 3] for i in range(10)]
        kw = dict(max_new_tokens=64, temperature=1.0, eos_token_id=1000)
        free = sampler.sample(model, prompts, static="off", generator=torch.Generator().manual_seed(3), **kw)
        token_bytes = sampler._kv_token_bytes(model, None)
        # 45 blocks of 4 tokens: slots for 4 rows at expected lengths (2 + 32 + 8 columns, 11 blocks), not at the
        # cap (66 columns, 17 blocks): rows are preempted as they grow, and come back
        st = {}
        ours = sampler.sample(model, prompts, static="on", attention="kernel", max_batch_size=6, stats=st,
                              generator=torch.Generator().manual_seed(3), block_size=4,
                              max_cache_bytes=45 * 4 * token_bytes, **kw)
        print(json.dumps(dict(same=[a.tokens == b.tokens for a, b in zip(free, ours)], preemptions=st["preemptions"],
                              slots=st["slots"], held=st["kv_blocks_held_at_end"], attention=st["attention"],
                              dlogp=max((a.logprobs - b.logprobs).abs().max().item() for a, b in zip(free, ours)))))
    """)
    assert out["attention"] == "kernel"
    assert out["preemptions"] > 0 and out["held"] == 0, out
    assert all(out["same"]), out
    assert out["dlogp"] < 2e-5, out


# ------------------------------------------------------------------------------------------------
# which path, and why; the pool without a gather
# ------------------------------------------------------------------------------------------------


def test_resolve_attention_says_which_and_why():
    from test_sampler import arch_model
    qwen = arch_model("qwen3")
    cpu = torch.device("cpu")
    assert resolve_attention("gather", qwen, cpu) == ("gather", "asked")
    path, why = resolve_attention("auto", qwen, cpu)
    if os.environ.get("TRITON_INTERPRET") != "1":
        assert path == "gather" and ("cpu" in why or "Triton" in why), why  # auto never takes the kernel on CPU
        with pytest.raises(ValueError, match="attention='kernel' cannot run"):
            resolve_attention("kernel", qwen, cpu)
    with pytest.raises(ValueError, match="must be 'auto', 'kernel' or 'gather'"):
        resolve_attention("flash", qwen, cpu)
    for arch, field in (("stablelm", "model_type 'stablelm'"), ("gpt2", "model_type 'gpt2'")):
        assert field in sampler.paged_kernel_blocker(arch_model(arch).config), arch  # fail closed
        assert resolve_attention("auto", arch_model(arch), cpu)[0] == "gather"
    assert sampler.paged_kernel_blocker(qwen.config) is None
    eager = arch_model("llama")
    eager.config._attn_implementation = "flash_attention_2"
    assert "flash_attention_2" in sampler.paged_kernel_blocker(eager.config)


def test_the_pool_without_a_gather_holds_more_slots_in_the_same_bytes():
    kw = dict(slots=512, length=6144, expected=2300, block_size=16, token_bytes=73_728, layers=36,
              budget=40 * 2**30)
    gathered, in_place = pool_plan(copies=5, **kw), pool_plan(copies=0, **kw)
    assert in_place.slots > gathered.slots
    for plan, copies in ((gathered, 5), (in_place, 0)):
        block_bytes = 16 * 73_728
        spent = (plan.blocks + 1) * block_bytes + copies * plan.slots * (6144 * 73_728 // 36)
        assert spent <= kw["budget"], (plan, spent)  # the pool and the transient within the budget
        assert plan.blocks >= -(-6144 // 16)  # one row at full length fits
    # the slots are what the pool holds at expected lengths: one more would not fit
    typical = -(-2300 // 16) * 16 * 73_728
    assert (in_place.slots + 1) * typical + 16 * 73_728 > kw["budget"] >= in_place.slots * typical
    assert pool_plan(copies=0, **{**kw, "budget": 100 * 16 * 73_728}) is None  # below one full row


def test_the_real_columns_counted_are_each_rows_cached_tokens_summed_over_its_steps():
    """stats["kv_columns_real"] (what the kernel reads) against a direct count: with no EOS a row draws exactly the
    cap (16, a multiple of sync_every: rows enter at host reads, so each leaves at the read after its 16th token),
    and at its t-th step attends over its prompt, its t earlier tokens and this one."""
    from test_sampler import arch_model
    model = arch_model("qwen3")
    prompts = [[5, 6, 7], [8] * 9, [3], [40, 41, 42, 43], [77, 2], [9, 9, 9, 9, 9, 9, 9]]
    stats = {}
    sampler.sample(model, prompts, max_new_tokens=16, temperature=0, eos_token_id=1000, static="on",
                   max_batch_size=3, stats=stats)
    want = sum(len(p) + t + 1 for p in prompts for t in range(16))
    assert stats["kv_columns_real"] == want
    gathered = sum(r * w * n for (r, w), n in stats["bucket_steps"].items())
    assert gathered > want  # the gather reads every slot's first W columns, padding and free slots included
