"""Tests of the copyable core as a porter uses it: core.py copied alone into a fresh module
drives one GRAFT step's selection, weights and loss, equal to the trainer's own; swapped directions are
a TypeError; the folded-weights identity that lets verl's vanilla loss run GRAFT (README "Porting").
CPU, tiny random models.

Run: python -m pytest -q test_port.py
"""

import ast
import builtins
import math
import types
from pathlib import Path

import pytest
import torch

import baselines
import graft
from test_graft import ROOT, exchange_phases, planted, tiny  # noqa: F401  (tiny: fixture)
from core import (Mean, add_metrics, balance_directions, balanced_swap, compatibility_scores, compatibility_weights,
                  graft_candidates, is_success, metric_values, policy_loss, received_groups, rescue_candidates,
                  sequence_mean_logprob, success_counts)

torch.set_num_threads(1)

# The imports core.py has, and nothing else.
CORE_IMPORTS = ("from __future__ import annotations\nimport hashlib\nfrom dataclasses import dataclass\n"
                "from typing import Callable, NamedTuple\nimport torch\n")


def core_source() -> str:
    """core.py below its imports (from its first section rule), as a porter's copy runs it after CORE_IMPORTS."""
    text = (ROOT / "core.py").read_text(encoding="utf-8")
    imports = "".join(line + "\n" for line in text.splitlines() if line.startswith(("import ", "from ")))
    assert imports == CORE_IMPORTS, f"core.py's imports changed: {imports!r} (update CORE_IMPORTS and README)"
    return text[text.index("\n# ----") :]


def copied_core() -> types.ModuleType:
    """core.py executed alone with its five imports: a module the way another trainer would hold it."""
    import sys
    mod = types.ModuleType("copied_core")
    sys.modules["copied_core"] = mod  # as an import would: dataclass reads its module's namespace
    exec(compile(CORE_IMPORTS + core_source(), "copied_core.py", "exec"), mod.__dict__)
    return mod


# ------------------------------------------------------------------------------------------------
# core.py stands alone
# ------------------------------------------------------------------------------------------------


def test_section_two_uses_only_its_own_imports():
    """Every name the section reads is defined in it, imported by CORE_IMPORTS, or a builtin."""
    tree = ast.parse(CORE_IMPORTS + core_source())
    defined = {"annotations", "hashlib", "dataclass", "Callable", "NamedTuple", "torch"} | set(dir(builtins))
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            defined.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            defined.add(node.id)
        elif isinstance(node, ast.arg):
            defined.add(node.arg)
    read = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    assert not read - defined, f"core.py reads names it does not define or import: {sorted(read - defined)}"
    core = copied_core()
    for name in ("success_counts", "group_advantages", "balanced_swap", "compatibility_weights", "policy_loss",
                 "minibatch_order", "metric_values", "retokenize"):
        assert callable(getattr(core, name)), name


def test_no_core_docstring_leans_on_a_flag_or_a_departure_number():
    """Copied alone, text such as "--compat-norm byte" or "departure 3" means nothing: say it in place."""
    src = core_source()
    assert "departure" not in src.lower()
    flags = [line for line in src.splitlines() if " --" in line and "# ----" not in line]
    assert not flags, f"core.py names command-line flags: {flags}"


def test_each_core_docstring_names_the_core_functions_it_calls():
    """A porter who copies balanced_swap must know it needs graft_candidates and balance_directions."""
    tree = ast.parse(core_source())
    funcs = {n.name: n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    for name, node in funcs.items():
        called = {c.func.id for c in ast.walk(node) if isinstance(c, ast.Call) and isinstance(c.func, ast.Name)}
        used = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}  # Mean used as a constructor or a type
        needs = ((called | used) & set(funcs)) - {name}
        doc = ast.get_docstring(node) or ""
        missing = [f for f in sorted(needs) if f not in doc]
        assert not missing, f"{name}'s docstring does not name the core functions it uses: {missing}"


# ------------------------------------------------------------------------------------------------
# Directions cannot be swapped by position
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("call", [
    lambda k, x: graft_candidates(k, k, 4),
    lambda k, x: balanced_swap(k, k, 4),
    lambda k, x: balance_directions(k > 0, k > 0, k, k),
    lambda k, x: received_groups(k, k, 4, own_is_a=True),
    lambda k, x: rescue_candidates(k, k),
    lambda k, x: compatibility_scores(x, x),
    lambda k, x: compatibility_weights(x, x),
    lambda k, x: sequence_mean_logprob(x[None], torch.ones(1, 3)),
    lambda k, x: policy_loss(x[None], x[None], torch.ones(1), torch.ones(1, 3)),
    lambda k, x: baselines.hacpo_advantages(x[None], x[None], capability_ratio=1.0),
], ids=["graft_candidates", "balanced_swap", "balance_directions", "received_groups", "rescue_candidates",
        "compatibility_scores", "compatibility_weights", "sequence_mean_logprob", "policy_loss", "hacpo_advantages"])
def test_positional_direction_arguments_are_a_type_error(call):
    with pytest.raises(TypeError):
        call(torch.tensor([0, 1, 2]), torch.tensor([-1.0, -2.0, -3.0]))


def test_swap_names_its_directions():
    k_a, k_b = torch.tensor([2, 0, 0]), torch.tensor([0, 3, 0])
    swap = balanced_swap(k_a=k_a, k_b=k_b, n=4)
    assert swap.a_to_b.tolist() == [True, False, False]  # B fails q0, A is mixed: B receives A's group
    assert swap.b_to_a.tolist() == [False, True, False]
    a_to_b, b_to_a = swap  # still unpacks as a pair
    assert torch.equal(a_to_b, swap.a_to_b) and torch.equal(b_to_a, swap.b_to_a)


# ------------------------------------------------------------------------------------------------
# success_counts and metric_values
# ------------------------------------------------------------------------------------------------


def test_success_counts_binary_signed_bonus_and_padding():
    binary = torch.tensor([[1.0, 0.0, 1.0], [0.0, 0.0, 0.0]])
    assert success_counts(binary).tolist() == binary.sum(1).long().tolist() == [2, 0]
    signed = torch.tensor([[1.0, -1.0, -1.0]])  # a -1/+1 verifier
    assert success_counts(signed).tolist() == [1]
    bonus = torch.tensor([[0.1, 0.1, 1.1], [0.1, 0.1, 0.1]])  # 0.1 for a well-formed wrong answer
    assert success_counts(bonus).tolist() == [1, 0]  # a group of wrong answers is all-fail
    padded = torch.tensor([[1.0, 1.0, 1.0]])
    assert success_counts(padded, mask=torch.tensor([[True, True, False]])).tolist() == [2]
    assert success_counts(torch.tensor([[0.3, 0.7]]), threshold=0.25).tolist() == [2]
    assert success_counts(binary).dtype == torch.int64
    assert is_success(torch.tensor([0.5, 0.49, -1.0, 1.1])).tolist() == [True, False, False, True]  # the one rule


def test_metric_values_divides_once_and_nan_means_nothing():
    parts = [{"clipfrac": Mean(1.0, 4.0), "tokens": 4.0, "clipfrac_peer": Mean(0.0, 0.0)},
             {"clipfrac": Mean(3.0, 4.0), "tokens": 4.0, "clipfrac_peer": Mean(0.0, 0.0)}]
    sums: dict = {}
    for p in parts:
        add_metrics(sums, p)
    v = metric_values(sums)
    assert v["clipfrac"] == 0.5 and v["tokens"] == 8.0  # (1 + 3) / (4 + 4), not a mean of 0.25 and 0.75
    assert math.isnan(v["clipfrac_peer"])  # a mean over no peer tokens
    assert "clipfrac_peer" not in metric_values(sums, drop_empty=True)


# ------------------------------------------------------------------------------------------------
# The folded-weights identity: verl's vanilla token-mean loss runs GRAFT unchanged
# ------------------------------------------------------------------------------------------------


def vanilla_token_mean_loss(old_log_prob, log_prob, advantages, response_mask, *, clip_low=0.2, clip_high=0.28):
    """A plain PPO clipped loss with token-mean aggregation, in verl's argument order and conventions:
    advantages (B, T) per token, response_mask (B, T); returns (loss, pg_clipfrac)."""
    ratio = torch.exp(log_prob - old_log_prob)
    pg1 = -advantages * ratio
    pg2 = -advantages * torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    m = response_mask.float()
    loss = (torch.maximum(pg1, pg2) * m).sum() / m.sum()
    clipfrac = ((pg2 > pg1).float() * m).sum() / m.sum()
    return loss, clipfrac


def test_folded_weights_identity_against_a_plain_token_mean_loss():
    """advantage a * w per token and the w = 0 rows masked out: the plain loss equals Eq. 10, value and gradient."""
    g = torch.Generator().manual_seed(3)
    B, T = 7, 9
    lengths = torch.randint(2, T + 1, (B,), generator=g)
    mask = torch.arange(T)[None] < lengths[:, None]  # (B, T)
    old = -torch.rand(B, T, generator=g) * 3  # (B, T)
    new = (old + 0.4 * torch.randn(B, T, generator=g)).requires_grad_(True)  # ratios on both sides of the clip
    adv = torch.randn(B, generator=g)  # (B,)
    w = torch.tensor([1.0, 1.0, 0.9, 0.0, 0.85, 1.0, 0.0])  # (B,) own rows 1, peer rows gated; 0 = removed
    is_peer = torch.tensor([False, False, True, True, True, False, True])

    loss, metrics = policy_loss(logp=new, old_logp=old, advantages=adv, mask=mask, weights=w, is_peer=is_peer)
    grad = torch.autograd.grad(loss, new)[0]

    new2 = new.detach().clone().requires_grad_(True)
    folded = (adv * w)[:, None].expand(B, T)  # (B, T) the advantage a porter passes: a * w
    kept = mask & (w > 0)[:, None]  # (B, T) w = 0 rows leave the loss and its denominator
    ref, ref_clipfrac = vanilla_token_mean_loss(old, new2, folded, kept)
    ref_grad = torch.autograd.grad(ref, new2)[0]

    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-6, atol=1e-8)
    assert metric_values(metrics)["clipfrac"] == pytest.approx(float(ref_clipfrac), abs=1e-7)
    assert 0 < float(ref_clipfrac) < 1  # the clip is active on some tokens, so the check means something
    # Without the mask the identity fails: the removed rows' tokens would stay in the denominator.
    unmasked, _ = vanilla_token_mean_loss(old, new.detach(), folded, mask)
    assert not torch.isclose(unmasked, loss.detach())


# ------------------------------------------------------------------------------------------------
# One GRAFT step driven by the copied section alone equals the trainer's own
# ------------------------------------------------------------------------------------------------


def test_copied_core_drives_a_graft_step_equal_to_the_trainer(tiny, tmp_path, monkeypatch):
    """Selection (Eq. 4), retokenisation, compatibility weights (Eqs. 6-8), peer-last order and the loss
    (Eqs. 9-10) of one planted step, computed with the copied module and only the trainer's forward, equal to
    the Trainer's select, score and build_rows, and Trainer.update (optimizer step disabled, so every
    minibatch sees one policy)."""
    core = copied_core()
    tr, batch, own, peers = planted(tiny, tmp_path, monkeypatch, delta=0.8, minibatches=3)
    peer = peers["log"]
    cfg, n = tr.cfg, tr.cfg.n

    # Selection: the receiver's and the source's success counts, the candidates of Eq. 4.
    k_own = core.success_counts(own.rewards)  # (G,)
    k_src = core.success_counts(peer.rewards, mask=peer.mask)  # (G,)
    chosen = core.graft_candidates(k_recv=k_own, k_src=k_src, n=peer.sizes)  # (G,)

    # Retokenisation and scoring: peer text -> receiver ids -> receiver log-probs -> lbar -> w.
    cand = []
    for g in torch.nonzero(chosen).squeeze(1).tolist():
        for i in range(peer.width):
            r = g * peer.width + i
            ids = core.retokenize(peer.texts[r], bool(peer.eos[g, i]), tr.tok,
                                  max_response_tokens=cfg.max_response_tokens, eos_token_id=tr.eos_id)
            if ids:
                cand.append((g, r, ids))
    prompts = [tr.prompt_ids[batch[g]] for g, _, _ in cand]
    lp, mask = tr.policy_logprobs(prompts, [ids for _, _, ids in cand])  # (C, T) the trainer's forward, no grad needed
    lp, mask = lp.detach(), mask
    lbar_recv = core.sequence_mean_logprob(logp=lp, mask=mask)  # (C,)
    lbar_src = peer.lbar("token").view(-1)[torch.tensor([r for _, r, _ in cand])]  # (C,)
    w = core.compatibility_weights(lbar_recv=lbar_recv, lbar_src=lbar_src, delta=cfg.delta)  # (C,)
    assert (w > 0).any() and (w == 0).any(), "the planted step must both accept and reject (delta 0.8)"

    # The trainer's rows of the same step.
    train_rows, replaced, m = exchange_phases(tr, 0, batch, own, peers)
    assert torch.equal(replaced, chosen)
    mine = {(g, tuple(ids)): float(wi) for (g, _, ids), wi in zip(cand, w) if wi > 0}
    theirs = {(r.group, tuple(r.response)): r.weight for r in train_rows if r.is_peer}
    assert mine.keys() == theirs.keys()
    for key, wi in mine.items():
        assert theirs[key] == pytest.approx(wi, rel=1e-5)
    assert m["accepted"] == len(mine) and m["rejected"] == int((w == 0).sum())

    # The update: peer-last minibatches, one token-mean denominator per minibatch, metrics summed once.
    gen = core.seeded_generator(cfg.seed, 0, "minibatch")
    order = core.minibatch_order(replaced, cfg.minibatches, order="peer_last", generator=gen)
    sums: dict = {}
    for mb in order:
        mb_rows = [r for r in train_rows if r.group in set(mb.tolist()) and r.weight > 0]
        denom = sum(len(r.response) for r in mb_rows)
        live = [r for r in mb_rows if r.adv != 0]  # a = 0 rows give zero loss and gradient: no forward
        if not live:  # their tokens still count in the step's token-mean (Eq. 10)
            core.add_metrics(sums, {"loss": core.Mean(0.0, float(denom))})
            continue
        with torch.no_grad():
            lp_mb, mask_mb = tr.policy_logprobs([r.prompt for r in live], [r.response for r in live])  # (B, T)
        old = torch.zeros_like(lp_mb)
        for j, r in enumerate(live):
            old[j, : len(r.response)] = r.old_logp
        loss, mt = core.policy_loss(logp=lp_mb, old_logp=old, advantages=torch.tensor([r.adv for r in live]),
                                    mask=mask_mb, weights=torch.tensor([r.weight for r in live]),
                                    is_peer=torch.tensor([r.is_peer for r in live]), eps_low=cfg.eps_low,
                                    eps_high=cfg.eps_high, loss_denominator=denom)
        core.add_metrics(sums, {**mt, "loss": core.Mean(float(loss) * denom, float(denom))})
    ours = core.metric_values(sums, drop_empty=True)

    tr.opt.step = lambda *a, **k: None  # every minibatch sees the same policy, as the copied driver does
    trainer = tr.update(0, train_rows, replaced)
    assert ours["peer_tokens"] > 0
    for key, value in ours.items():
        assert trainer[f"pg/{key}"] == pytest.approx(value, rel=1e-5, abs=1e-7), key
    assert {k for k in trainer if k.startswith("pg/")} == {f"pg/{k}" for k in ours}


# ------------------------------------------------------------------------------------------------
# The porter's proof: core.py and the rule's three phases, copied into a fresh folder, run one GRAFT step's
# selection, scoring and rows on plain tensors and a stub log-prob function (no Trainer, no files, no ranks)
# ------------------------------------------------------------------------------------------------

RULE_PHASES = ("graft_select", "graft_score", "graft_rows")

PORTER_DRIVER = '''
import json, math, os, sys
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # -I leaves the folder off the path: the copy only
import torch
from core import Context, balanced_swap, multi_peer_sources, assignment_digest
from rule import graft_select, graft_score, graft_rows
try:
    import graft  # noqa: F401
    sys.exit("the repository is on the path: this run would not prove the copy stands alone")
except ModuleNotFoundError:
    pass


class CharTokenizer:
    """One id per character (ord), EOS 0: enough for retokenize and decodes_back."""
    eos_token_id = 0

    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]

    def decode(self, ids, skip_special_tokens=True, clean_up_tokenization_spaces=False):
        return "".join(chr(i) for i in ids if i != 0)


class Step:
    """A step's rollouts of one side as the phases read them: G prompts x n, row-major."""
    def __init__(self, texts, rewards, token_logp):
        G, n = rewards.shape
        self.prompt_ids = [f"q{g}" for g in range(G)]
        self.texts, self.rewards, self.width, self.sizes = texts, rewards, n, torch.full((G,), n)
        self.tokens = [[ord(c) for c in t] + [0] for t in texts]
        self.logprobs = [torch.full((len(t),), lp) for t, lp in zip(self.tokens, token_logp)]
        self.eos = torch.ones(G, n, dtype=torch.bool)
        self.mask = torch.ones(G, n, dtype=torch.bool)
        mean = rewards.mean(1, keepdim=True)
        std = rewards.std(1, keepdim=True)
        self.advantages = torch.where(std > 0, (rewards - mean) / (std + 1e-6), torch.zeros_like(rewards))

    def lbar(self, norm):
        return torch.stack([lp.mean() for lp in self.logprobs]).view_as(self.rewards)


calls = []
def stub_logprob_fn(prompts, responses):  # every receiver token at log-prob -0.5
    calls.append(len(responses))
    return [torch.full((len(r),), -0.5) for r in responses]


ctx = Context(side="a", n=2, seed=0, tokenizer=CharTokenizer(), eos_id=0, logprob_fn=stub_logprob_fn,
              max_response_tokens=8, delta=0.8)
own = Step(["0", "1", "2", "3", "4", "5"], torch.tensor([[0.0, 0.0], [1.0, 0.0], [0.0, 0.0]]), [-1.0] * 6)
peer = Step(["12", "x", "7", "8", "9", "99"], torch.tensor([[1.0, 0.0], [0.0, 0.0], [1.0, 1.0]]),
            [-0.4, -0.2, -1.0, -1.0, -1.0, -1.0])
prompts = [[1, 2], [3], [4, 5]]
selected, m_select, _ = graft_select(ctx, 0, own, {"b": peer})
received, m_score, counts = graft_score(ctx, 0, prompts, {"b": peer}, selected)
built, _, _ = graft_rows(ctx, prompts, own, {"b": peer}, selected, received, {})
k = torch.stack([(own.rewards >= 0.5).sum(1), (peer.rewards >= 0.5).sum(1)])  # (2, G) sides a, b
print(json.dumps({
    "selected": selected["b"].tolist(), "assignment": m_select["assignment"],
    "n_sided": assignment_digest(multi_peer_sources(k, 2), own.prompt_ids),
    "s": [x.s for x in received["b"]], "w": [x.weight for x in received["b"]], "counts": counts, "calls": calls,
    "rows": [[r.group, r.prompt, r.response, r.adv, r.weight, r.is_peer] for r in built.rows],
    "replaced": built.replaced.tolist()}))
'''


def test_the_rule_runs_copied_alone_on_plain_tensors(tmp_path):
    """A porter's copy: core.py as it is, and graft.py's three phases pasted below `from core import *`, in a fresh
    folder, run by a Python that cannot see the repository. One planted step (side a, peer b, G = 3, n = 2): a fails
    q0 where b is mixed, b fails q1 where a is mixed, so the balanced swap gives a q0; b's two responses on q0 score
    s = exp(-0.5 - lbar_src) under the stub receiver (every token -0.5): exp(-0.1) passes delta = 0.8, exp(-0.3)
    does not. Hand-computed rows: a's own groups q1, q2, and b's accepted response on q0 with b's advantage."""
    import json
    import subprocess
    import sys
    source = (ROOT / "graft.py").read_text(encoding="utf-8")
    tree = ast.parse(source)
    phases = [ast.get_source_segment(source, n) for n in tree.body
              if isinstance(n, ast.FunctionDef) and n.name in RULE_PHASES]
    assert len(phases) == 3
    folder = tmp_path / "porter"
    folder.mkdir()
    (folder / "core.py").write_text((ROOT / "core.py").read_text(encoding="utf-8"), encoding="utf-8")
    (folder / "rule.py").write_text("from __future__ import annotations\nimport torch\nfrom core import *\n\n\n"
                                    + "\n\n\n".join(phases) + "\n", encoding="utf-8")
    (folder / "run.py").write_text(PORTER_DRIVER, encoding="utf-8")
    r = subprocess.run([sys.executable, "-I", str(folder / "run.py")], cwd=folder, capture_output=True, text=True,
                       timeout=120, env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout)
    assert got["selected"] == [True, False, False]  # Eq. 4 both ways, m = 1: a receives b's group on q0
    assert got["assignment"] == got["n_sided"]  # the paper's swap and the N-sided extension agree on two sides
    assert got["s"] == pytest.approx([math.exp(-0.1), math.exp(-0.3)], rel=1e-6)
    assert got["w"] == pytest.approx([math.exp(-0.1), 0.0], rel=1e-6)  # Eqs. 7-8: min(s, 1) above delta, else 0
    assert got["counts"] == {"dropped_roundtrip": 0} and got["calls"] == [2]  # one scoring call, both responses
    adv = 0.5 / (2 ** -0.5 + 1e-6)  # b's group on q0: rewards (1, 0), mean 0.5, unbiased std 1/sqrt(2)
    want = [[1, [3], [ord("2"), 0], 0.5 / (2 ** -0.5 + 1e-6), 1.0, False],
            [1, [3], [ord("3"), 0], -0.5 / (2 ** -0.5 + 1e-6), 1.0, False],
            [2, [4, 5], [ord("4"), 0], 0.0, 1.0, False], [2, [4, 5], [ord("5"), 0], 0.0, 1.0, False],
            [0, [1, 2], [ord("1"), ord("2"), 0], adv, math.exp(-0.1), True]]
    assert len(got["rows"]) == len(want)
    for row, w in zip(got["rows"], want):
        assert row[:3] == w[:3] and row[5] == w[5] and row[3] == pytest.approx(w[3], rel=1e-5)
        assert row[4] == pytest.approx(w[4], rel=1e-6)
    assert got["replaced"] == [True, False, False]


def test_two_sided_selection_is_the_paper_swap_and_the_n_sided_rule():
    """graft_select on two live sides runs balanced_swap; on the same counts multi_peer_sources (the extension to
    three or more sides) selects the same groups, with and without balancing, on 300 random steps."""
    from core import Context, multi_peer_sources

    class Counts:
        def __init__(self, rewards):
            self.rewards, self.prompt_ids = rewards, [str(i) for i in range(rewards.shape[0])]
            self.mask, self.sizes = torch.ones_like(rewards, dtype=torch.bool), torch.full((rewards.shape[0],), 4)

    g = torch.Generator().manual_seed(0)
    for trial in range(300):
        G = int(torch.randint(1, 20, (1,), generator=g))
        ra, rb = (torch.rand(G, 4, generator=g) < torch.rand(G, 1, generator=g)).float(), \
            (torch.rand(G, 4, generator=g) < torch.rand(G, 1, generator=g)).float()
        balance = trial % 2 == 0
        for me, other, r_me, r_other in (("a", "b", ra, rb), ("b", "a", rb, ra)):
            ctx = Context(side=me, n=4, seed=0, tokenizer=None, eos_id=0, logprob_fn=None, max_response_tokens=8,
                          balance=balance)
            sel, m, _ = graft.graft_select(ctx, 0, Counts(r_me), {other: Counts(r_other)})
            src = multi_peer_sources(torch.stack([success_counts(ra), success_counts(rb)]), 4, balance=balance)
            mine, theirs = (0, 1) if me == "a" else (1, 0)
            assert torch.equal(sel[other], src[mine] == theirs), (trial, me)
