"""The GPU code paths, emulated on CPU: the trainer's update under bf16 autocast, FSDP2 over gloo
ranks (gradients, checkpoints, resume), and bench/gpu.py's --tiny run. No GPU needed.

Run: python -m pytest -q test_gpu_path.py
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import evaluation
import graft
from test_graft import ROOT, common_flags, planted, read_metrics, run_py, tiny  # noqa: F401  (tiny: fixture)

# ------------------------------------------------------------------------------------------------
# One whole update under bf16 autocast against fp32, on the same rows
# ------------------------------------------------------------------------------------------------


def update_grads(tr, rows, replaced) -> tuple[dict, dict]:
    """Run tr.update on the rows with the optimizer step replaced by a recorder: (grads by name, metrics)."""
    grads = {}

    def record():
        for name, p in tr.model.named_parameters():
            g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            grads[name] = grads.get(name, 0) + g.detach().float().clone()

    tr.opt.step = record
    return grads, tr.update(0, rows, replaced)


def cosine(a: dict, b: dict) -> float:
    x = torch.cat([a[k].flatten() for k in sorted(a)])
    y = torch.cat([b[k].flatten() for k in sorted(a)])
    return float(x @ y / (x.norm() * y.norm()))


def naive_token_logprobs(h, w, targets, *, temperature=1.0, chunk_size=1024):
    """The reference head: full logits, log_softmax, gather. (N, H), (V, H), (N,) -> (N,)."""
    return torch.log_softmax((h @ w.T).float() / temperature, dim=-1).gather(1, targets[:, None])[:, 0]


def test_update_under_bf16_autocast_matches_fp32(tiny, tmp_path, monkeypatch):
    """The trainer runs the forward under bf16 autocast and calls backward outside it (--dtype auto
    on GPU); CPU autocast emulates that. Same rows, same weights: the whole update's gradient under
    bf16 must be as close to the fp32 one as the naive full-logits head's is (within 1.25x), point
    the same way (cosine >= 0.99), and give the same loss to bf16 precision. The model is made
    confident (lm_head x 30, its own samples as rows): the old kernel's bias was worst on confident
    tokens, where it was 1.6x the naive error here."""
    import sampler
    tr, rows, own, peers = planted(tiny, tmp_path, monkeypatch, minibatches=1)
    with torch.no_grad():
        tr.model.lm_head.weight.mul_(30.0)
    own, _, _ = tr.rollout(0, rows)  # confident samples: mean log-prob about -1.3
    n = 4
    out = [graft.Row(g, tr.prompt_ids[rows[g]], own.tokens[g * n + i], own.logprobs[g * n + i],
                     1.0 if (g + i) % 2 else -1.0) for g in range(8) for i in range(n)]
    replaced = torch.zeros(8, dtype=torch.bool)
    state = {k: v.clone() for k, v in tr.model.state_dict().items()}
    g32, m32 = update_grads(tr, out, replaced)  # fp32, the chunked kernel
    tr.amp = lambda: torch.autocast("cpu", dtype=torch.bfloat16)
    tr.model.load_state_dict(state)
    g16, m16 = update_grads(tr, out, replaced)  # bf16 autocast, the chunked kernel
    monkeypatch.setattr(sampler, "token_logprobs", naive_token_logprobs)
    tr.model.load_state_dict(state)
    g16_naive, _ = update_grads(tr, out, replaced)  # bf16 autocast, the naive head

    def rel(a, b):
        diff = torch.cat([(a[k] - b[k]).flatten() for k in b])
        return float(diff.norm() / torch.cat([b[k].flatten() for k in b]).norm())

    assert rel(g16, g32) <= 1.25 * rel(g16_naive, g32), (rel(g16, g32), rel(g16_naive, g32))
    assert cosine(g32, g16) >= 0.99, cosine(g32, g16)
    assert m16["pg/loss"] == pytest.approx(m32["pg/loss"], rel=0.05, abs=2e-3)


# ------------------------------------------------------------------------------------------------
# The trainer's memory-saving settings: evaluation in the rollouts' precision and KV budget, the
# behaviour log-prob pass in micro-batches of similar lengths, the optimizer and the allocator's setting
# ------------------------------------------------------------------------------------------------


def test_validate_samples_under_autocast_with_its_own_row_budget(tiny, tmp_path, monkeypatch):
    import runtime
    # Trainer.validate samples in the rollouts' precision (self.amp(): here CPU bf16 autocast, as on a GPU), so
    # the sampler caches K and V in bf16 (read off the stored tensors: sampler stats), and with eval_rows: the
    # rollout's KV tokens (gen_batch_size x (prompt + response cap)) spent on rows of the longer eval cap
    tr, rows, own, peers = planted(tiny, tmp_path, monkeypatch, gen_batch_size=6, max_prompt_tokens=20,
                                   eval_max_tokens=40, benchmarks=str(tiny / "p.jsonl"), eval_samples=2,
                                   eval_max_problems=3)
    calls = []
    real_sample = evaluation.sample

    def recording(*args, **kw):
        stats = {}
        out = real_sample(*args, stats=stats, **kw)
        calls.append((torch.is_autocast_enabled("cpu"), kw["max_batch_size"], stats["kv_dtypes"]))
        return out

    monkeypatch.setattr(evaluation, "sample", recording)
    tr.amp = lambda: torch.autocast("cpu", dtype=torch.bfloat16)
    m = tr.validate(1)
    assert "eval/mean" in m
    want_rows = 6 * (20 + 16) // (20 + 40)  # = 3 rows: the rollout's 216 KV tokens over rows of 60
    assert calls == [(True, want_rows, (torch.bfloat16, torch.bfloat16))], calls
    assert runtime.eval_rows(tr.cfg) == want_rows
    tr.cfg.eval_max_tokens = 0  # the rollout's cap: the rollout's rows
    assert runtime.eval_rows(tr.cfg) == 6


def test_behaviour_logprobs_by_length_equal_rollout_order_per_row(tiny, tmp_path, monkeypatch):
    # the behaviour log-prob pass cuts micro-batches of similar lengths (sampler.batches_by_length); every row's
    # log-probs must be those of the old cut (rollout order, micro_batch_size rows each) up to float round-off
    tr, rows, own, peers = planted(tiny, tmp_path, monkeypatch, micro_batch_size=5)
    n = tr.cfg.n
    prompts = [tr.prompt_ids[rows[r // n]] for r in range(len(own.tokens))]
    responses = own.tokens
    assert len({len(r) for r in responses}) > 3, "the test needs responses of varied lengths"
    assert [i for b in graft.batches_by_length(prompts, responses, 5) for i in b] != list(range(len(prompts)))
    new = tr.behaviour_logprobs(prompts, responses)
    old = []
    with torch.no_grad():
        for i in range(0, len(prompts), 5):  # the old cut, in rollout order
            lp, mask = tr.policy_logprobs(prompts[i: i + 5], responses[i: i + 5])
            old += [lp[j, : int(mask[j].sum())] for j in range(lp.shape[0])]
    assert len(new) == len(old) == len(responses)
    for i, (a, b) in enumerate(zip(new, old)):
        assert a.shape == (len(responses[i]),)
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5, msg=f"row {i}")


def test_optimizer_is_foreach_on_cpu(tiny, tmp_path, monkeypatch):
    # fused AdamW where the device has the kernel the trainer relies on (CUDA), foreach elsewhere
    tr, *_ = planted(tiny, tmp_path, monkeypatch)
    assert tr.opt.defaults["foreach"] is True and not tr.opt.defaults["fused"]


def test_cuda_alloc_conf_set_unless_the_user_chose():
    import runtime
    env = {}
    assert runtime.cuda_alloc_conf(env) == "expandable_segments:True"
    assert env == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    env = {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128"}
    assert runtime.cuda_alloc_conf(env) == "max_split_size_mb:128" and len(env) == 1
    env = {"PYTORCH_ALLOC_CONF": "expandable_segments:False"}  # torch's newer name counts as the user's choice
    assert runtime.cuda_alloc_conf(env) == "expandable_segments:False" and "PYTORCH_CUDA_ALLOC_CONF" not in env


# ------------------------------------------------------------------------------------------------
# FSDP2 over two gloo ranks
# ------------------------------------------------------------------------------------------------

FSDP_GRADS = '''
import json, sys
sys.path[:0] = [{root!r}, {root!r} + "/tests"]  # the modules, and this test file (update_grads)
import torch, verify
verify.verify_batch = lambda rs, gs, workers=0, **kw: [float(len(r) % 3 == 0) for r in rs]
import graft
from config import Config
from core import batch_indices
from test_gpu_path import update_grads
cfg = Config(model={model!r}, prompts={prompts!r}, out=sys.argv[1], steps=1, prompts_per_step=8, n=4,
             minibatches=1, max_response_tokens=16, prompt_template="{{problem}}=", lr=1e-3, threads=1,
             micro_batch_size=3, fsdp=sys.argv[2] == "fsdp", device="cpu")
tr = graft.Trainer(cfg)
rows_idx = batch_indices(len(tr.data), 0, 8, 0)
g = torch.Generator().manual_seed(0)
rows = []
for j, q in enumerate(rows_idx):  # fixed responses, the same on every rank and in every run
    resp = torch.randint(3, 50, (3 + j % 5,), generator=g).tolist()
    rows.append(graft.Row(j, tr.prompt_ids[q], resp, None, float(j % 3) - 1.0 or 0.5))
old = tr.behaviour_logprobs([r.prompt for r in rows], [r.response for r in rows])
for r, lp in zip(rows, old):
    r.old_logp = lp - 0.1 * (r.group % 2)  # some ratios off 1 so clipping is exercised
grads, metrics = update_grads(tr, rows, torch.zeros(8, dtype=torch.bool))
if tr.dist.main:
    torch.save({{"grads": grads, "metrics": metrics}}, sys.argv[3])
import os
sys.stdout.flush()
os._exit(0)  # as graft.main does under --fsdp: gloo + FSDP2 can abort in a destructor at exit
'''


def run_fsdp_grads(tiny, tmp_path, mode: str, ranks: int) -> dict:
    script = tmp_path / "fsdp_grads.py"
    script.write_text(FSDP_GRADS.format(root=str(ROOT), model=str(tiny / "ma"), prompts=str(tiny / "p.jsonl")))
    out = tmp_path / f"{mode}{ranks}.pt"
    prefix = ["-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "--master_port", "29531"] if ranks else []
    r = run_py(prefix + [str(script), str(tmp_path / f"run_{mode}{ranks}"), mode, str(out)], tmp_path,
               {"PYTHONPATH": str(ROOT)}, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return torch.load(out, weights_only=True)


def test_fsdp_gradients_equal_one_process(tiny, tmp_path):
    one = run_fsdp_grads(tiny, tmp_path, "dp", 0)  # one process, no FSDP
    two = run_fsdp_grads(tiny, tmp_path, "fsdp", 2)  # two gloo ranks, weights sharded
    assert one["grads"].keys() == two["grads"].keys()
    for k, g in one["grads"].items():
        torch.testing.assert_close(two["grads"][k], g, rtol=1e-4, atol=1e-6, msg=k)
    for k in ("pg/loss", "pg/clipfrac_own", "grad_norm", "pg/tokens"):
        assert two["metrics"][k] == pytest.approx(one["metrics"][k], rel=1e-4, abs=1e-7), k


FSDP_CAST = '''
import sys
sys.path[:0] = [{root!r}]
import torch, graft
from config import Config
from runtime import gathered
from sampler import sample
cfg = Config(model={model!r}, prompts={prompts!r}, out=sys.argv[1], steps=1, prompts_per_step=4, n=2,
             minibatches=1, max_response_tokens=12, prompt_template="{{problem}}=", lr=1e-3, threads=1,
             fsdp=sys.argv[2] == "fsdp", device="cpu")
tr = graft.Trainer(cfg)
before = {{n: (type(p.data).__name__, p.data_ptr()) for n, p in tr.model.named_parameters()}}
out = {{}}
for once in (False, True):
    stats = {{}}
    # the trainer's rollout (Trainer.rollout): weights gathered, then the forward under bf16 autocast (CUDA there)
    with gathered(tr.fsdp_root), torch.autocast("cpu", dtype=torch.bfloat16):
        rs = sample(tr.model, tr.prompt_ids[:4] * 2, max_new_tokens=12, temperature=1.0, eos_token_id=tr.stop_ids,
                    pad_token_id=tr.tok.pad_token_id, generator=torch.Generator().manual_seed(5),
                    max_batch_size=4, cast_once=once, stats=stats)
    out[once] = {{"tokens": [r.tokens for r in rs], "logp": [r.logprobs for r in rs],
                 "cast_bytes": stats["cast_bytes"]}}
after = {{n: (type(p.data).__name__, p.data_ptr()) for n, p in tr.model.named_parameters()}}
out["params_back"] = before == after
out["kinds"] = sorted({{k for k, _ in before.values()}})
if tr.dist.main:
    torch.save(out, sys.argv[3])
sys.stdout.flush()
import os
os._exit(0)
'''


def test_cast_once_under_fsdp2_casts_the_gathered_weights_and_changes_no_number(tiny, tmp_path):
    # sampler.py departure 17 under FSDP2: inside runtime.gathered the layers hold their full float32 weights as
    # plain tensors (the shards, DTensors, come back when the block ends), so cast_weights_once casts them once for
    # the call; the tokens and log-probs equal autocast's own per-step casts, and equal one process without FSDP;
    # after the block every parameter is the same sharded DTensor as before (FSDP's own, not the cast copy)
    script = tmp_path / "fsdp_cast.py"
    script.write_text(FSDP_CAST.format(root=str(ROOT), model=str(tiny / "mb"), prompts=str(tiny / "p.jsonl")))
    res = {}
    for mode, ranks in (("dp", 0), ("fsdp", 2)):
        out = tmp_path / f"cast_{mode}.pt"
        prefix = ["-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "--master_port", "29537"] \
            if ranks else []
        r = run_py(prefix + [str(script), str(tmp_path / f"run_{mode}"), mode, str(out)], tmp_path,
                   {"PYTHONPATH": str(ROOT)}, timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        res[mode] = torch.load(out, weights_only=False)
    assert res["fsdp"]["kinds"] == ["DTensor"] and res["dp"]["kinds"] == ["Tensor"]  # the sharding was real
    for mode in ("dp", "fsdp"):
        once, per_step = res[mode][True], res[mode][False]
        assert per_step["cast_bytes"] == 0 and once["cast_bytes"] > 0, mode  # the gathered weights were cast
        assert once["tokens"] == per_step["tokens"], mode
        assert all(torch.equal(a, b) for a, b in zip(once["logp"], per_step["logp"])), mode
        assert res[mode]["params_back"], f"{mode}: the model's parameters were not given back"
    # the full weights' copy is the same size either way: FSDP gathered all of them
    assert res["fsdp"][True]["cast_bytes"] == res["dp"][True]["cast_bytes"]
    assert res["fsdp"][True]["tokens"] == res["dp"][True]["tokens"]
    for a, b in zip(res["fsdp"][True]["logp"], res["dp"][True]["logp"]):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


def test_fsdp_checkpoint_loads_and_resume_equals_uninterrupted(tiny, tmp_path):
    def torchrun(out, steps, *extra, port):
        args = ["-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port),
                str(tiny / "planted.py"), "train", "--model", str(tiny / "ma"), "--out", str(out), "--device", "cpu",
                "--fsdp", "--save-every", "1"] + common_flags(tiny, steps=steps) + list(extra)
        r = run_py(args, tmp_path, timeout=400)
        assert r.returncode == 0, r.stderr[-3000:]

    torchrun(tmp_path / "full", 2, port=29533)
    torchrun(tmp_path / "cut", 1, port=29534)
    torchrun(tmp_path / "cut", 2, "--resume", port=29535)
    full, cut = read_metrics(tmp_path / "full" / "metrics.jsonl"), read_metrics(tmp_path / "cut" / "metrics.jsonl")
    assert [m["step"] for m in cut] == [0, 1]
    for a, b in zip(full, cut):
        for k in a:
            if not k.startswith("time/"):
                assert a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-7), (a["step"], k)
    from transformers import AutoModelForCausalLM
    ckpt_full = AutoModelForCausalLM.from_pretrained(tmp_path / "full" / "checkpoints" / "step_000002")
    ckpt_cut = AutoModelForCausalLM.from_pretrained(tmp_path / "cut" / "checkpoints" / "step_000002")
    start = AutoModelForCausalLM.from_pretrained(tiny / "ma")
    moved = 0.0
    for (name, p), q, s in zip(ckpt_full.named_parameters(), ckpt_cut.parameters(), start.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)
        moved += float((p - s).detach().abs().sum())
    assert moved > 0  # the full gathered weights were written, not the initial ones


# ------------------------------------------------------------------------------------------------
# bench/gpu.py at toy sizes: the GPU check script runs on every CPU test run, so it never rots
# ------------------------------------------------------------------------------------------------


def test_bench_gpu_tiny_runs_and_its_checks_pass(tmp_path):
    # every part at toy size on the CPU, the smoke included (run_pair.sh pair1 on the CPU, FSDP2 over gloo, one
    # rank per side, a checkpoint, --resume, an evaluation): every row in the JSONL file, every check passed. Under
    # Triton's interpreter, so that the attention part runs the paged kernel too (the sampler's auto path still
    # gathers on a CPU: the interpreter serves only an explicit attention="kernel")
    from transformers.integrations import sdpa_attention as sdpa_module
    out = tmp_path / "rows.jsonl"
    r = run_py(["-m", "bench.gpu", "--tiny", "--jsonl", str(out)], tmp_path, env_extra={"TRITON_INTERPRET": "1"},
               timeout=400)
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
    assert "all checks passed" in r.stdout, r.stdout
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert [x["part"] for x in rows] == ["setup", "kernel", "attention", "attention", "rollout", "microbatch", "smoke",
                                         "sampler", "sampler", "sampler", "sampler", "prefill", "prefill", "launcher",
                                         "launcher", "launcher", "launcher", "launcher", "profile", "profile",
                                         "profile", "setup"], rows
    by = {}
    for x in rows:
        by.setdefault(x["part"], []).append(x)
    assert "multi-rank NCCL" in rows[0]["note"] and "not covered" in rows[0]["note"]
    assert by["kernel"][0]["worst_ratio"] <= 1.25  # the kernel's error under autocast is not worse than naive's
    # the attention part: both toy head layouts (4/2 and 4/1 heads), 6 slots of which round(0.3 x 6) at L; the
    # kernel (interpreted) and the gathered path against the float32 reference; GB/s are the real K/V bytes over ms
    assert [(x["kernel_ran"], x["at_full"]) for x in by["attention"]] == [(True, 2), (True, 2)]
    assert ["4/2/16" in by["attention"][0]["name"], "4/1/16" in by["attention"][1]["name"]] == [True, True]
    for x in by["attention"]:
        assert set(x["arms"]) == {"gather", "kernel", "dense"} and x["arms"]["gather"]["speedup_vs_gather"] == 1.0
        assert 0 < x["max_abs_d_kernel"] <= 3e-3 and 0 < x["max_abs_d_gather"] <= 3e-3, x  # float16 round-off
        assert x["real_kv_mb"] < x["gathered_kv_mb"] and "interpreter" in x["note"], x
        # what transformers' sdpa function did with the grouped heads under a mask: packed them for the one query
        # token where this version has pack_gqa (use_gqa_in_sdpa refuses a mask on CPU/CUDA), else repeat_kv
        assert x["gather_gqa"] == ("pack_gqa" if hasattr(sdpa_module, "pack_gqa") else "repeat_kv"), x
        for arm in x["arms"].values():
            assert arm["gb_per_s"] == pytest.approx(x["real_kv_mb"] / arm["ms"], rel=0.06, abs=0.06), x
    roll = by["rollout"][0]  # bf16 K and V through the sampler under autocast, 2 x 2 x 2 x 16 x 2 bytes
    assert roll["kv_dtypes"] == ["torch.bfloat16", "torch.bfloat16"] and roll["kv_bytes_per_token"] == 256
    smoke = by["smoke"][0]
    assert smoke["ok"] and all(s["steps"] == [0, 1] and s["evaluated"] for s in smoke["sides"].values()), smoke
    assert by["sampler"][0]["all_identical"], by["sampler"][0]  # float32: strict identity with generate
    # the bf16 check is the behaviour pass against the update pass (what the trainer consumes)
    assert by["sampler"][1]["behaviour_vs_update_mean"] <= 0.02 and "sampler_vs_forward_mean" in by["sampler"][1]
    # the path each sampler row took: the default path on a CPU (static auto is off), the static rows gathering
    assert [x["attention"] for x in by["sampler"]] == [None, None, "gather", "gather"], by["sampler"]
    assert all("the device is cpu" in x["attention_why"] and x["graphs"] == 0 for x in by["sampler"][2:])
    # the launcher part: the projection's arithmetic from its own per-side terms (174 steps x 8 GPUs, the slower side)
    proj = by["launcher"][4]
    step = max(v["step_s"] for v in proj["per_side"].values())
    assert proj["gpu_hours"] == pytest.approx(174 * step * 8 / 3600, abs=0.1)
    assert proj["gpu_hours_without_eval"] < proj["gpu_hours"]
    for side, gathered in (by["launcher"][0:2], by["launcher"][2:4]):
        assert side["host_reads_per_step"] < 0.2 and side["new_tokens"] > 0, side
        assert side["attention"] is None and side["columns_read"] > side["new_tokens"], side  # CPU: the default path
        # the gather arm: the same rollouts with attention="gather", its rate beside the auto run's
        assert "attention='gather'" in gathered["name"] and gathered["new_tokens"] > 0, gathered
        assert gathered["auto_over_gather"] == pytest.approx(
            side["tokens_per_s"] / gathered["tokens_per_s"], rel=0.05), (side, gathered)
    # without the kernel (a CPU), the projection's extra read is the cap's width: 4,096 - the toy cap 24
    assert [v["extra_columns_per_token"] for v in proj["per_side"].values()] == [4072, 4072]
    # the profiler row: the old settings cast every Linear weight every step (2 layers x 7 + the head) and read the
    # host every step; the default and static paths cast none and read every 8 steps
    before, eager, static = by["profile"]
    assert before["casts"] == 15 and before["reads"] == 1
    assert eager["casts"] == static["casts"] == 0 and eager["reads"] < 0.2 and static["reads"] < 0.2
    assert [x["attention"] for x in by["profile"]] == [None, None, "gather"]  # static="on" gathers on a CPU
    assert all(x.get("ok", True) for x in rows) and rows[-1]["failed"] == []


def test_bench_attention_pool_layout():
    # the attention part's rows and pool: round(0.3 R) rows at L, the rest in [lo, hi]; each row owns
    # ceil(length / block) blocks, no block owned twice, every block of the pool used, the rest of a row's entries
    # at the trash block (the last); the blocks shuffled (not handed out in order)
    from bench import gpu as bench_gpu
    lengths = bench_gpu.attention_lengths(20, full=64, lo=5, hi=40, at_full=0.3, seed=1)
    assert int((lengths == 64).sum()) == 6 and all(5 <= n <= 40 for n in lengths.tolist() if n != 64)
    table, blocks = bench_gpu.shuffled_table(lengths, width=64, block=4, seed=2)
    owned = [-(-n // 4) for n in lengths.tolist()]
    assert table.shape == (20, 16) and blocks == sum(owned) + 1
    mine = [table[r, :n].tolist() for r, n in enumerate(owned)]
    flat = [x for row in mine for x in row]
    assert sorted(flat) == list(range(blocks - 1)) and flat != sorted(flat)
    assert all((table[r, n:] == blocks - 1).all() for r, n in enumerate(owned))


def test_bench_sdpa_gqa_branch_says_what_ran():
    # sdpa_gqa_branch names the helper transformers' sdpa function ran on grouped heads, and puts the helpers back:
    # with a mask and one query token this version packs the heads (pack_gqa) where it has it; without a mask on a
    # CPU it hands sdpa enable_gqa (neither helper); a call of repeat_kv itself reads "repeat_kv"
    from transformers.integrations import sdpa_attention as sdpa_module

    from bench import gpu as bench_gpu
    module = bench_gpu._AttentionModule(2)
    q, k = torch.randn(3, 4, 1, 8), torch.randn(3, 2, 10, 8)
    mask = torch.ones(3, 1, 1, 10, dtype=torch.bool)
    helpers = (sdpa_module.repeat_kv, getattr(sdpa_module, "pack_gqa", None))
    run = lambda m: lambda: sdpa_module.sdpa_attention_forward(module, q, k, k, m, scaling=0.3)  # noqa: E731
    masked = "pack_gqa" if hasattr(sdpa_module, "pack_gqa") else "repeat_kv"
    assert bench_gpu.sdpa_gqa_branch(run(mask)) == masked
    assert bench_gpu.sdpa_gqa_branch(run(None)) == "neither"
    assert bench_gpu.sdpa_gqa_branch(lambda: sdpa_module.repeat_kv(k, 2)) == "repeat_kv"
    assert (sdpa_module.repeat_kv, getattr(sdpa_module, "pack_gqa", None)) == helpers


def test_bench_gpu_records_a_failing_part_and_runs_the_next(tmp_path, monkeypatch):
    # a part that raises becomes an error row (message, last frames, peak memory) and the next part still runs; a
    # row is in the file the moment it is measured (read back inside the part, before it raises); a spent
    # --budget skips the parts left; the exit status says a part failed
    from bench import gpu as bench_gpu
    path = tmp_path / "rows.jsonl"
    b = bench_gpu.Bench(path, budget=60.0, device=torch.device("cpu"))
    seen = []

    def breaks():
        b.row("one", "measured before the failure", value=1)
        seen.append([json.loads(x)["name"] for x in path.read_text().splitlines()])
        raise RuntimeError("planted failure")

    b.part("one", breaks)
    b.part("two", lambda: b.row("two", "after", value=2))
    assert seen == [["measured before the failure"]]
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    assert [(x["part"], x["name"]) for x in rows] == [("one", "measured before the failure"), ("one", "error"),
                                                        ("two", "after")]
    err = rows[1]
    assert err["ok"] is False and "RuntimeError: planted failure" in err["error"] and "planted failure" in err["trace"]
    assert "peak_gib" in err and b.failed == ["one: error"]
    b.budget = 0.0
    b.part("three", lambda: b.row("three", "never"))
    assert json.loads(path.read_text().splitlines()[-1])["name"] == "skipped"
    # through main: the kernel part raises, the rollout part after it still runs and writes its row; exit status 1
    monkeypatch.setattr(bench_gpu, "bench_kernel", lambda *a: 1 / 0)
    main_rows = tmp_path / "main.jsonl"
    assert bench_gpu.main(["--tiny", "--only", "kernel,rollout", "--jsonl", str(main_rows)]) == 1
    rows = [json.loads(x) for x in main_rows.read_text().splitlines()]
    assert [(x["part"], x["name"]) for x in rows][1] == ("kernel", "error")
    assert rows[2]["part"] == "rollout" and rows[2]["ok"] is True
    assert rows[-1]["failed"] == ["kernel: error"]
