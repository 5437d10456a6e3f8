"""The GPU code paths, emulated on CPU: the trainer's update under bf16 autocast, FSDP2 over gloo
ranks (gradients, checkpoints, resume), and bench_gpu.py's --tiny run. No GPU needed.

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


def test_update_under_bf16_autocast_matches_fp32(tiny, tmp_path, monkeypatch):
    """The trainer runs the forward under bf16 autocast and calls backward outside it (--dtype auto
    on GPU); CPU autocast emulates that. Same rows, same weights: the bf16 update's gradient must
    point where the fp32 one does, and the loss must agree to bf16 precision."""
    tr, rows, own, peers = planted(tiny, tmp_path, monkeypatch, delta=0.0, minibatches=1)
    out, replaced, _ = tr.build_rows(0, rows, own, peers)
    out = [graft.Row(r.group, r.prompt, r.response, r.old_logp, r.adv if r.adv else 0.5, r.weight, r.is_peer)
           for r in out]  # every row carries gradient
    state = {k: v.clone() for k, v in tr.model.state_dict().items()}
    g32, m32 = update_grads(tr, out, replaced)
    tr.model.load_state_dict(state)
    tr.amp = lambda: torch.autocast("cpu", dtype=torch.bfloat16)
    g16, m16 = update_grads(tr, out, replaced)
    assert cosine(g32, g16) >= 0.99, cosine(g32, g16)
    assert m16["pg/loss"] == pytest.approx(m32["pg/loss"], rel=0.05, abs=2e-3)
    for k in g32:  # and no tensor of the gradient is off on its own (e.g. the lm_head, which the kernel owns)
        assert torch.nn.functional.cosine_similarity(g32[k].flatten(), g16[k].flatten(), dim=0) > 0.95, k


# ------------------------------------------------------------------------------------------------
# FSDP2 over two gloo ranks
# ------------------------------------------------------------------------------------------------

FSDP_GRADS = '''
import json, sys
sys.path.insert(0, {root!r})
import torch, verify
verify.verify_batch = lambda rs, gs, workers=0, **kw: [float(len(r) % 3 == 0) for r in rs]
import graft
from test_gpu_path import update_grads
cfg = graft.Config(model={model!r}, prompts={prompts!r}, out=sys.argv[1], steps=1, prompts_per_step=8, n=4,
                   minibatches=1, max_response_tokens=16, prompt_template="{{problem}}=", lr=1e-3, threads=1,
                   micro_batch_size=3, fsdp=sys.argv[2] == "fsdp", device="cpu")
tr = graft.Trainer(cfg)
rows_idx = graft.batch_indices(len(tr.data), 0, 8, 0)
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
