"""Tests of the copyable core as a porter uses it: core.py copied alone into a fresh module
drives one GRAFT step's selection, weights and loss, equal to the trainer's own; swapped directions are
a TypeError; the folded-weights identity that lets verl's vanilla loss run GRAFT (README "Porting").
CPU, tiny random models.

Run: python -m pytest -q test_port.py
"""

import ast
import builtins
import inspect
import math
import re
import types
from pathlib import Path

import pytest
import torch

import baselines
import core
import graft
from test_graft import ROOT, exchange_phases, planted, tiny  # noqa: F401  (tiny: fixture)
from core import (Mean, add_metrics, balance_directions, balanced_swap, compatibility_scores, compatibility_weights,
                  graft_candidates, is_success, metric_values, policy_loss, received_groups, rescue_candidates,
                  sequence_mean_logprob, success_counts)

torch.set_num_threads(1)

# The imports core.py has, and nothing else.
CORE_IMPORTS = ("from __future__ import annotations\nimport hashlib\nfrom dataclasses import dataclass\n"
                "from typing import Callable, NamedTuple, Protocol\nimport torch\n")


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
    defined = {"annotations", "hashlib", "dataclass", "Callable", "NamedTuple", "Protocol", "torch"}
    defined |= set(dir(builtins))
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


def rule_phases() -> list[str]:
    """graft.py's three rule phases, each as its source text (a porter's paste)."""
    source = (ROOT / "graft.py").read_text(encoding="utf-8")
    return [ast.get_source_segment(source, n) for n in ast.parse(source).body
            if isinstance(n, ast.FunctionDef) and n.name in RULE_PHASES]


# How a porter may paste the phases into rule.py: below `from core import *` with the future import the test first
# used; verbatim below `from core import *` alone (annotations evaluated: every name they use must be core's); or
# below a verbatim copy of core.py in one file.
PASTES = {"future": "from __future__ import annotations\nimport torch\nfrom core import *\n\n\n",
          "star": "from core import *\n\n\n", "one_file": None}


@pytest.mark.parametrize("paste", list(PASTES))
def test_the_rule_runs_copied_alone_on_plain_tensors(tmp_path, paste):
    """A porter's copy: core.py as it is, and graft.py's three phases pasted below `from core import *` (or below
    core.py itself), in a fresh folder, run by a Python that cannot see the repository. One planted step (side a,
    peer b, G = 3, n = 2): a fails q0 where b is mixed, b fails q1 where a is mixed, so the balanced swap gives a
    q0; b's two responses on q0 score s = exp(-0.5 - lbar_src) under the stub receiver (every token -0.5):
    exp(-0.1) passes delta = 0.8, exp(-0.3) does not. Hand-computed rows: a's own groups q1, q2, and b's accepted
    response on q0 with b's advantage."""
    import json
    import subprocess
    import sys
    phases = rule_phases()
    assert len(phases) == 3
    folder = tmp_path / "porter"
    folder.mkdir()
    core_text = (ROOT / "core.py").read_text(encoding="utf-8")
    (folder / "core.py").write_text(core_text, encoding="utf-8")
    head = PASTES[paste] if PASTES[paste] is not None else core_text + "\n\n"
    (folder / "rule.py").write_text(head + "\n\n\n".join(phases) + "\n", encoding="utf-8")
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


# ------------------------------------------------------------------------------------------------
# The interface the phases read (core.Rollouts), one retokenisation route, and a core that runs where its inputs are
# ------------------------------------------------------------------------------------------------


class CharTokenizer:
    """One id per ASCII character (its code), EOS 0; any other character encodes as <unk> (1), which decode skips:
    a text holding one does not decode back (decodes_back)."""

    eos_token_id = 0

    def encode(self, text, add_special_tokens=False):
        return [ord(c) if ord(c) < 128 else 1 for c in text]

    def decode(self, ids, skip_special_tokens=True, clean_up_tokenization_spaces=False):
        return "".join(chr(i) for i in ids if i > 1)


def plain_step(texts, rewards, token_logp, device="cpu") -> core.PlainRollouts:
    """A side's step as a core.PlainRollouts: char ids plus EOS; token j of response r at token_logp[r] - 0.1 j
    (unequal, so a mean with EOS differs from one without)."""
    G, n = rewards.shape
    tokens = [[ord(c) if ord(c) < 128 else 1 for c in t] + [0] for t in texts]
    lps = [(v - 0.1 * torch.arange(len(t), dtype=torch.float32)).to(device) for t, v in zip(tokens, token_logp)]
    return core.PlainRollouts(prompt_ids=[f"q{g}" for g in range(G)], tokens=tokens, logprobs=lps, texts=texts,
                              eos=torch.ones(G, n, dtype=torch.bool, device=device), rewards=rewards.to(device),
                              advantages=core.group_advantages(rewards).to(device))


def planted_pair(device="cpu") -> tuple[core.PlainRollouts, core.PlainRollouts]:
    """Side a and its peer b, G = 3, n = 4. a fails q0 where b is mixed, b fails q1 where a is mixed (one each way:
    the swap gives a b's q0), b passes all of q2. b's q0 responses: one the gate accepts, one it rejects, one that
    does not decode back (lost), one too long for 8 ids."""
    own = plain_step(["0", "1", "2", "3", "4", "5", "6", "7", "8", "9", "10", "11"],
                     torch.tensor([[0.0, 0, 0, 0], [1, 0, 0, 0], [0, 0, 0, 0]]), [-1.0] * 12, device)
    peer = plain_step(["12", "x", "\u00e93", "123456789", "a", "b", "c", "d", "e", "f", "g", "h"],
                      torch.tensor([[1.0, 0, 1, 0], [0, 0, 0, 0], [1, 1, 1, 1]]),
                      [-0.35, -0.15, -1.0, -1.0] + [-1.0] * 8, device)
    return own, peer


def stub_logprob_fn(device):
    """The receiver's log-prob function: token j of every response at -0.5 - 0.1 j, on `device`."""
    return lambda prompts, responses: [(-0.5 - 0.1 * torch.arange(len(r), dtype=torch.float32)).to(device)
                                       for r in responses]


# Every setting of the Context that changes what a phase reads or draws (the ablations).
RULE_SETTINGS = [{}, {"selection": "random"}, {"selection": "sgt"}, {"acceptance": "random"},
                 {"peer_advantages": "pooled"}, {"transfer": "success"}, {"compat_norm": "byte"},
                 {"compat_weight": False}, {"balance": False}, {"both_ways": False}, {"delta": 0.0}]


def run_rule(own, peer, device="cpu", **settings):
    """graft.py's three phases on one planted step: (selected, received, built, metrics, counts)."""
    ctx = core.Context(side="a", n=4, seed=0, tokenizer=CharTokenizer(), eos_id=0, logprob_fn=stub_logprob_fn(device),
                       max_response_tokens=8, **settings)
    prompts = [[1, 2], [3], [4, 5]]
    selected, m_select, c_select = graft.graft_select(ctx, 0, own, {"b": peer})
    received, m_score, c_score = graft.graft_score(ctx, 0, prompts, {"b": peer}, selected)
    built, m_rows, c_rows = graft.graft_rows(ctx, prompts, own, {"b": peer}, selected, received, {})
    return selected, received, built, m_select | m_score | m_rows, c_select | c_score | c_rows


def protocol_members(proto) -> set[str]:
    """What a typing.Protocol declares: its annotated fields, its properties and its methods (no private names)."""
    return set(proto.__annotations__) | {k for k, v in vars(proto).items()
                                         if not k.startswith("_") and (isinstance(v, property) or callable(v))}


class Reads:
    """A Rollouts that records the name of every member read from it."""

    def __init__(self, inner, seen: set):
        self._inner, self._seen = inner, seen

    def __getattr__(self, name):  # called for every name but the two set above
        self._seen.add(name)
        return getattr(self._inner, name)


def test_the_phases_read_exactly_the_rollouts_interface():
    """Under every setting of the Context, the three phases read from the own step and the peer's only members that
    core.Rollouts declares, the ones its docstring names for each side, and together every member it declares: a
    porter who fills the interface meets no AttributeError, and the interface asks for nothing unused."""
    own_reads, peer_reads = set(), set()
    for settings in RULE_SETTINGS:
        own, peer = planted_pair()
        run_rule(Reads(own, own_reads), Reads(peer, peer_reads), **settings)
    assert own_reads == {"prompt_ids", "rewards", "advantages", "tokens", "logprobs"}
    assert peer_reads == {"rewards", "mask", "sizes", "width", "texts", "eos", "advantages", "lbar"}
    assert own_reads | peer_reads == protocol_members(core.Rollouts)
    for name, fn in (("graft_select", graft.graft_select), ("graft_score", graft.graft_score),
                     ("graft_rows", graft.graft_rows)):
        notes = {k: str(v) for k, v in fn.__annotations__.items() if k in ("own", "peers")}
        assert notes and all(v in ("Rollouts", "dict[str, Rollouts]") for v in notes.values()), (name, notes)


def test_step_rollouts_and_plain_rollouts_are_rollouts():
    """The project's exchange.StepRollouts (a rollout file's step and a foreign log's, with a padded slot) and
    core.PlainRollouts have every member of core.Rollouts with its shape; on the same responses their lbar agree,
    and it is the mean over the ids as sampled, EOS included (hand-computed)."""
    from exchange import StepRollouts
    plain = plain_step(["12", "x", "\u00e93", "7"], torch.tensor([[1.0, 0], [0, 1]]), [-0.5, -1.0, -2.0, -0.25])
    step = StepRollouts(prompt_ids=plain.prompt_ids, tokens=plain.tokens, logprobs=plain.logprobs, texts=plain.texts,
                        eos=plain.eos, rewards=plain.rewards, advantages=plain.advantages)
    slots = torch.tensor([[True, True, False], [True, True, True]])
    foreign = StepRollouts(prompt_ids=["p", "q"], tokens=[], logprobs=[], texts=["a", "b", "", "c", "d", "e"],
                           eos=slots, rewards=torch.tensor([[1.0, 0, 0], [0, 1, 1]]), advantages=torch.zeros(2, 3),
                           slots=slots, given_lbar=torch.full((2, 3), -0.5), num_tokens=torch.full((2, 3), 2))
    members = protocol_members(core.Rollouts)
    for x in (plain, step, foreign):
        assert not [m for m in members if not hasattr(x, m)], type(x).__name__
        G, W = x.rewards.shape
        assert x.width == W and x.mask.shape == (G, W) and x.mask.dtype == torch.bool
        assert x.sizes.tolist() == x.mask.sum(1).tolist() and x.eos.shape == x.advantages.shape == (G, W)
        assert len(x.prompt_ids) == G and len(x.texts) == G * W and x.lbar("token").shape == (G, W)
    assert foreign.sizes.tolist() == [2, 3]
    for norm in ("token", "byte"):
        torch.testing.assert_close(plain.lbar(norm), step.lbar(norm))
    assert float(plain.lbar("token")[0, 0]) == pytest.approx((-0.5 - 0.6 - 0.7) / 3)  # "1", "2", EOS: 3 tokens
    assert float(plain.lbar("byte")[1, 0]) == pytest.approx((-2.0 - 2.1 - 2.2) / 3)  # "\u00e93" is 3 UTF-8 bytes


def test_plain_rollouts_names_a_field_of_the_wrong_shape():
    good = dict(prompt_ids=["p"], tokens=[[5, 0], [6]], logprobs=[torch.zeros(2), torch.zeros(1)], texts=["a", "b"],
                eos=torch.tensor([[True, False]]), rewards=torch.zeros(1, 2), advantages=torch.zeros(1, 2))
    core.PlainRollouts(**good)
    for field, bad, msg in [("rewards", torch.zeros(2), "rewards must be"), ("eos", torch.ones(2, 1), "eos must be"),
                            ("prompt_ids", ["p", "q"], "prompt_ids must"), ("texts", ["a"], "texts must hold"),
                            ("logprobs", [torch.zeros(1), torch.zeros(1)], r"logprobs\[r\] must be .* r = \[0\]")]:
        with pytest.raises(ValueError, match=msg):
            core.PlainRollouts(**(good | {field: bad}))
    with pytest.raises(ValueError, match="norm must be"):
        core.PlainRollouts(**good).lbar("tokens")


def test_one_retokenisation_route_drops_and_counts_the_same():
    """retokenize_responses is the one route: score_received (the phases') and retokenize_group (a flat batch's)
    drop the same responses, too long or empty, and not decoding back, and count them the same way. A dropped row
    of the flat batch has NaN lbar and so w = 0 even when the receiver's log-probs are all 0 (a mean of 0 would
    give s = exp(0 - lbar_src) > 1, w = 1); through the phases it is counted, never accepted."""
    tok = CharTokenizer()
    texts, eos = ["12", "123456789", "", "\u00e93", "7"], [True, False, False, True, False]
    rt = core.retokenize_responses(texts, eos, tok, max_response_tokens=8)
    assert rt.kept == [0, 4] and rt.ids == [[49, 50, 0], [55]] and rt.too_long == [1, 2] and rt.lost == [3]
    flat = core.retokenize_group(texts, eos, tok, max_response_tokens=8, pad_token_id=9)
    assert (flat.too_long, flat.lost) == (rt.too_long, rt.lost)
    assert flat.mask.any(1).tolist() == [True, False, False, False, True]
    assert flat.ids[0].tolist() == [49, 50, 0] and flat.ids[4].tolist() == [55, 9, 9] and (flat.ids[3] == 9).all()
    sc = core.score_received(texts, eos, torch.full((5,), -3.0), [[1]] * 5, tokenizer=tok, eos_token_id=0,
                             logprob_fn=stub_logprob_fn("cpu"), max_response_tokens=8)
    assert (sc.kept, sc.ids, sc.too_long, sc.lost) == tuple(rt)
    lbar = core.sequence_mean_logprob(logp=torch.zeros(5, 3), mask=flat.mask)  # (5,) the worst case: log-probs 0
    assert lbar[[0, 4]].tolist() == [0.0, 0.0] and lbar[[1, 2, 3]].isnan().all()
    w = core.compatibility_weights(lbar_recv=lbar, lbar_src=torch.full((5,), -3.0))
    assert w.tolist() == [1.0, 0.0, 0.0, 0.0, 1.0]
    own, peer = planted_pair()  # b's q0: accepted, rejected, lost, too long
    _, received, built, m, counts = run_rule(own, peer, delta=0.0)  # no floor: every scored response passes
    assert [x.slot for x in received["b"]] == [0, 1] and m["accepted"] == 2 and m["rejected"] == 0
    assert m["dropped_length"] == 1 and counts == {"dropped_roundtrip": 1}
    assert sorted(r.response for r in built.rows if r.is_peer) == [[49, 50, 0], [120, 0]]


def test_received_slots_and_kept_positions_say_what_they_index():
    """PeerResponse.slot is the response's slot r = g * width + i in the peer's step; Received.kept lists positions
    in score_received's input."""
    own, peer = planted_pair()
    _, received, _, _, _ = run_rule(own, peer, transfer="success")  # b's correct q0 responses: slots 0 and 2
    assert [(x.group, x.slot) for x in received["b"]] == [(0, 0)]  # slot 2 ("\u00e93") does not decode back
    assert [peer.texts[x.slot] for x in received["b"]] == ["12"]
    sc = core.score_received(["\u00e93", "x", "12"], [True] * 3, torch.zeros(3), [[1]] * 3, tokenizer=CharTokenizer(),
                             eos_token_id=0, logprob_fn=stub_logprob_fn("cpu"), max_response_tokens=8)
    assert sc.kept == [1, 2] and sc.lost == [0]


def lazy_device() -> torch.device:
    """A device other than the CPU that every machine has: PyTorch's lazy-tensor backend (TorchScript, on the CPU).
    Like CUDA, it refuses an operation that mixes its tensors with CPU tensors and a .numpy() without a move, and
    computes real values, so a result can be compared with the CPU's."""
    try:
        import torch._lazy.ts_backend
        torch._lazy.ts_backend.init()
    except (ImportError, RuntimeError) as e:  # a torch built without it: the meta-device test still runs
        pytest.skip(f"torch's lazy-tensor backend is not available: {e}")
    return torch.device("lazy")


DEVICES = ["lazy"] + (["cuda"] if torch.cuda.is_available() else [])


def on_cpu(x):
    """A result as plain values: tensors moved to the CPU and listed, records and containers walked."""
    if isinstance(x, torch.Tensor):
        return x.detach().cpu().tolist()
    if isinstance(x, dict):
        return {k: on_cpu(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [on_cpu(v) for v in x]
    if hasattr(x, "__dataclass_fields__"):
        return on_cpu(vars(x))
    return x


def assert_same(have, want, where, path=""):
    """Equal plain values (on_cpu's), floats within 1e-6 relative (NaN equal to NaN), naming the first difference."""
    if isinstance(want, dict):
        assert isinstance(have, dict) and have.keys() == want.keys(), (where, path)
        for key in want:
            assert_same(have[key], want[key], where, f"{path}.{key}")
    elif isinstance(want, list):
        assert isinstance(have, list) and len(have) == len(want), (where, path)
        for j, (h, w) in enumerate(zip(have, want)):
            assert_same(h, w, where, f"{path}[{j}]")
    elif isinstance(want, float) and not isinstance(want, bool):
        assert have == pytest.approx(want, rel=1e-6, nan_ok=True), (where, path)
    else:
        assert have == want, (where, path)


@pytest.mark.parametrize("device", DEVICES)
def test_the_rule_runs_where_its_inputs_are(device):
    """Both sides' rollouts and the receiver's log-probs on a device other than the CPU (or the rollouts on the CPU
    and the log-probs on the device): under every setting of the Context the three phases run, leave their tensors
    on that device, and give the CPU's selection, weights, rows and metrics; so do core's functions that the phases
    do not call (assignment_digest, the loss, the porting helpers), and the project's StepRollouts.lbar."""
    dev = lazy_device() if device == "lazy" else torch.device(device)
    for settings in RULE_SETTINGS:
        cpu = run_rule(*planted_pair(), **settings)
        got = run_rule(*planted_pair(dev), device=dev, **settings)
        selected, received, built = got[:3]
        assert selected["b"].device.type == dev.type and built.replaced.device.type == dev.type, settings
        assert all(x.old_logp.device.type == dev.type for x in received["b"]), settings
        assert all(r.old_logp.device.type == dev.type for r in built.rows), settings
        assert_same(on_cpu(got), on_cpu(cpu), settings)
        # the steps on the CPU (read from files), the receiver's log-probs on the device
        mixed = run_rule(*planted_pair(), device=dev, **settings)
        assert all(x.old_logp.device.type == dev.type for x in mixed[1]["b"]), settings
        assert_same(on_cpu(mixed), on_cpu(cpu), settings)

    # core's functions beyond the phases, each against the CPU's answer
    g = torch.Generator().manual_seed(1)
    k = torch.randint(0, 5, (3, 7), generator=g)  # (S, G)
    logp, old = -torch.rand(4, 5, generator=g), -torch.rand(4, 5, generator=g)  # (B, T)
    mask = torch.arange(5)[None] < torch.tensor([5, 3, 0, 2])[:, None]  # (B, T): row 2 has no token
    adv, w = torch.tensor([1.0, -0.5, 0.3, 0.7]), torch.tensor([1.0, 0.9, 0.0, 1.0])  # (B,)
    rewards = (torch.rand(6, 4, generator=g) > 0.5).float()  # (G, n)
    calls = {
        "digest": lambda d: core.assignment_digest(core.multi_peer_sources(k.to(d), 4), list("abcdefg")),
        "swap": lambda d: core.balanced_swap(k_a=k[0].to(d), k_b=k[1].to(d), n=4),
        "received_groups": lambda d: core.received_groups(k_own=k[0].to(d), k_peer=k[1].to(d), n=4, own_is_a=False),
        "advantages": lambda d: (core.group_advantages(rewards.to(d)),
                                 core.masked_group_advantages(rewards.to(d), (rewards > -1).to(d))),
        "lbar": lambda d: core.sequence_mean_logprob(logp=logp.to(d), mask=mask.to(d), num_bytes=torch.tensor(
            [7, 3, 1, 2])),  # the byte counts on the CPU, as a porter may keep them
        "loss": lambda d: core.policy_loss(logp=logp.to(d), old_logp=old.to(d), advantages=adv.to(d),
                                           mask=mask.to(d), weights=w.to(d), loss_denominator=9),
        "fold": lambda d: core.fold_weights(advantages=adv.to(d), weights=w.to(d), mask=mask.to(d)),
        "order": lambda d: core.peer_last_rows(torch.tensor([True, False, True]).to(d), 2,
                                               generator=torch.Generator().manual_seed(3)),
        "random_selection": lambda d: core.random_selection(torch.tensor([True, False, False]).to(d),
                                                            k_src=k[0, :3].to(d), sizes=torch.full((3,), 4).to(d),
                                                            generator=torch.Generator().manual_seed(3)),
        "random_acceptance": lambda d: core.random_acceptance(torch.tensor([0.9, 0.5, 1.2]).to(d),
                                                              torch.tensor([0.9, 0.0, 1.0]).to(d), compat_weight=True,
                                                              generator=torch.Generator().manual_seed(3)),
        "step_rollouts_lbar": lambda d: [step_rollouts(planted_pair(d)[1]).lbar(norm) for norm in ("token", "byte")],
    }
    for name, call in calls.items():
        assert_same(on_cpu(call(dev)), on_cpu(call(torch.device("cpu"))), name)


def step_rollouts(plain: core.PlainRollouts):
    """The same step as the project's exchange.StepRollouts."""
    from exchange import StepRollouts
    return StepRollouts(prompt_ids=plain.prompt_ids, tokens=plain.tokens, logprobs=plain.logprobs, texts=plain.texts,
                        eos=plain.eos, rewards=plain.rewards, advantages=plain.advantages)


def test_score_received_builds_nothing_on_the_cpu_meta_device():
    """The meta device (shapes, no values; mixing it with a CPU tensor is an error): score_received on a log-prob
    function and a source lbar that give meta tensors returns meta tensors of the kept responses' shapes, and the
    scores' functions (sequence_mean_logprob, compatibility_weights) stay on meta."""
    meta = torch.device("meta")
    texts = ["12", "x", "\u00e93", "123456789"]
    sc = core.score_received(texts, [True] * 4, torch.zeros(4, device=meta), [[1]] * 4, tokenizer=CharTokenizer(),
                             eos_token_id=0, logprob_fn=stub_logprob_fn(meta), max_response_tokens=8)
    assert sc.kept == [0, 1] and sc.lost == [2] and sc.too_long == [3]
    for t in (sc.lbar_recv, sc.lbar_src, sc.s, sc.w):
        assert t.device == meta and t.shape == (2,)
    sc = core.score_received(texts, [True] * 4, torch.zeros(4, device=meta), [[1]] * 4, tokenizer=CharTokenizer(),
                             eos_token_id=0, logprob_fn=stub_logprob_fn(meta), max_response_tokens=8,
                             compat_norm="byte")
    assert sc.w.device == meta
    lbar = core.sequence_mean_logprob(logp=torch.zeros(3, 4, device=meta), mask=torch.ones(3, 4, device=meta),
                                      num_bytes=torch.tensor([3, 4, 5]))
    w = core.compatibility_weights(lbar_recv=lbar, lbar_src=torch.zeros(3, device=meta))
    assert lbar.device == w.device == meta and w.shape == (3,)
    with pytest.raises(ValueError, match="compat_norm"):
        core.score_received(texts, [True] * 4, torch.zeros(4), [[1]] * 4, tokenizer=CharTokenizer(), eos_token_id=0,
                            logprob_fn=stub_logprob_fn("cpu"), max_response_tokens=8, compat_norm="tokens")


# ------------------------------------------------------------------------------------------------
# docs/PORTING.md's example, run as the page shows it, every phase's answer checked against a hand computation
# ------------------------------------------------------------------------------------------------

PORTING = ROOT / "docs" / "PORTING.md"
WIRING_MAX_LINES = 15  # a porter wires GRAFT into a GRPO loop in at most this many lines


def porting_example() -> str:
    """The page's example: the ```python block under its heading "The example"."""
    m = re.search(r"^#+ The example\n.*?^```python\n(.*?)^```\n", PORTING.read_text(encoding="utf-8"), re.M | re.S)
    assert m, "docs/PORTING.md has no ```python block under a 'The example' heading"
    return m.group(1)


def wiring_lines(code: str) -> int:
    """The lines of the example's graft_update below its docstring: the wiring between rollouts and update."""
    fn = next(n for n in ast.parse(code).body if isinstance(n, ast.FunctionDef) and n.name == "graft_update")
    body = fn.body[1:] if ast.get_docstring(fn) else fn.body
    return body[-1].end_lineno - body[0].lineno + 1


def naive_successes(rewards: torch.Tensor) -> list[int]:
    return [sum(1 for x in row if x >= 0.5) for row in rewards.tolist()]


def naive_advantages(rewards: torch.Tensor) -> list[list[float]]:
    """GRPO's (r - mean) / (unbiased std + 1e-6) per group, 0 for a group of equal rewards, by loops."""
    out = []
    for row in rewards.tolist():
        mean = sum(row) / len(row)
        std = math.sqrt(sum((x - mean) ** 2 for x in row) / (len(row) - 1))
        out.append([0.0 if all(x == row[0] for x in row) else (x - mean) / (std + 1e-6) for x in row])
    return out


def paper_swap(k_a: list[int], k_b: list[int], n: int) -> tuple[set[int], set[int]]:
    """Eq. 4 and the balanced swap as the paper states them: (prompts where B receives A's group, where A receives
    B's). Candidates: the receiver fails all n, the source is mixed; m = the smaller count; each direction keeps its
    first m by the source's successes, descending, ties by prompt index, and every candidate tied with the m-th."""
    c_ab = [q for q in range(len(k_a)) if k_b[q] == 0 and 1 <= k_a[q] < n]
    c_ba = [q for q in range(len(k_a)) if k_a[q] == 0 and 1 <= k_b[q] < n]
    m = min(len(c_ab), len(c_ba))

    def keep(cands, k_src):
        if m == 0:
            return set()
        kth = k_src[sorted(cands, key=lambda q: (-k_src[q], q))[m - 1]]
        return {q for q in cands if k_src[q] >= kth}

    return keep(c_ab, k_a), keep(c_ba, k_b)


def float64_logprobs(model, prompt: list[int], ids: list[int]) -> torch.Tensor:
    """(len(ids),) float64 log-probs of ids after prompt under a float64 copy of a model."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1: -1]  # (len(ids), V)
    return logits.double().log_softmax(-1).gather(1, torch.tensor(ids)[:, None])[:, 0]


@pytest.mark.skipif(not (ROOT / "data" / "tiny_models" / "B").is_dir(), reason="data/tiny_models is absent")
def test_the_porting_pages_example_runs_and_every_phase_is_the_papers_rule(monkeypatch):
    """docs/PORTING.md's example, extracted from the page and run as it stands from the repository root: two tiny
    models with different tokenizers, a GRPO step each, GRAFT wired in within WIRING_MAX_LINES lines (the number the
    page states). Every call of a phase is checked against a hand computation: the selection against Eq. 4 and the
    balanced swap from both sides' rewards; every received response's receiver ids (its text encoded, the
    receiver's EOS iff the peer's ended with EOS; too long or not decoding back: absent), s against fresh float64
    forwards of both models as they sampled (means over the ids, EOS included), w = 1[s > 0.8] min(s, 1) and the
    old log-probs; the rows (own groups not received, each with its GRPO advantage; the accepted peer responses
    with the peer group's advantage and w); every minibatch order peer-last. The run must exchange both ways and
    both accept and reject, so the checks check something."""
    import copy
    code = porting_example()
    page = PORTING.read_text(encoding="utf-8")
    lines = wiring_lines(code)
    assert lines <= WIRING_MAX_LINES, f"the example's wiring takes {lines} lines (at most {WIRING_MAX_LINES})"
    assert f"`graft_update`'s {lines} lines" in page, f"the page must say the wiring's {lines} lines"
    for name in RULE_PHASES:  # the page's call lines name each phase's parameters in order
        params = ", ".join(inspect.signature(getattr(graft, name)).parameters)
        assert re.search(rf"= {name}\({re.escape(params)}\)", page), f"the page's call of {name} is not ({params})"
    members = protocol_members(core.Rollouts)
    assert all(f"`{m}" in page for m in members), "the page's table must name every member of core.Rollouts"

    ns: dict = {"__name__": "porting_example"}
    models: dict[int, dict] = {}  # step -> {side: a float64 copy of its model as it sampled}
    seen = {"calls": 0, "selected": set(), "accepted": 0, "rejected": 0, "scored": 0, "orders": 0}
    real_select, real_score, real_rows, real_order = (graft.graft_select, graft.graft_score, graft.graft_rows,
                                                     core.minibatch_order)

    def select(ctx, step, own, peers):
        if step not in models:  # a step's first phase runs after every side sampled, before any side's update
            models[step] = {s: copy.deepcopy(side.model).double() for s, side in ns["sides"].items()}
        out = real_select(ctx, step, own, peers)
        ((peer_name, peer),) = peers.items()
        k = {ctx.side: naive_successes(own.rewards), peer_name: naive_successes(peer.rewards)}
        a, b = sorted(k)
        a_to_b, b_to_a = paper_swap(k[a], k[b], ctx.n)
        want = b_to_a if ctx.side == a else a_to_b
        assert set(torch.nonzero(out[0][peer_name]).squeeze(1).tolist()) == want, (step, ctx.side)
        seen["selected"] |= {(ctx.side, q) for q in want}
        return out

    def score(ctx, step, prompts, peers, selected):
        out = real_score(ctx, step, prompts, peers, selected)
        ((peer_name, peer),) = peers.items()
        got = {x.slot: x for x in out[0][peer_name]}
        recv, src = models[step][ctx.side], models[step][peer_name]
        src_prompts, n, tok = ns["sides"][peer_name].prompts, ctx.n, ctx.tokenizer
        expected = set()
        for g in torch.nonzero(selected[peer_name]).squeeze(1).tolist():
            for i in range(n):
                r, text, ended = g * n + i, peer.texts[g * n + i], bool(peer.eos[g, i])
                body = tok.encode(text, add_special_tokens=False)
                ids = body + ([ctx.eos_id] if ended else [])
                back = tok.decode(body, skip_special_tokens=True, clean_up_tokenization_spaces=False)
                if not ids or len(ids) > ctx.max_response_tokens or back != text:
                    continue  # dropped: too long, or its ids do not write its text back
                expected.add(r)
                x = got[r]
                assert x.group == g and x.ids == ids, (step, ctx.side, r)
                lp_recv = float64_logprobs(recv, prompts[g], ids)  # (len(ids),) EOS included
                lbar_src = float(float64_logprobs(src, src_prompts[g], peer.tokens[r]).mean())  # as sampled
                s = math.exp(float(lp_recv.mean()) - lbar_src)
                assert x.s == pytest.approx(s, rel=1e-4), (step, ctx.side, r)
                torch.testing.assert_close(x.old_logp.double(), lp_recv, atol=1e-4, rtol=0)
                if abs(s - 0.8) > 1e-3:  # away from the floor, where float32 and float64 could disagree
                    assert x.weight == pytest.approx(min(s, 1.0) if s > 0.8 else 0.0, rel=1e-4), (step, ctx.side, r)
                seen["accepted" if x.weight > 0 else "rejected"] += 1
        assert set(got) == expected, (step, ctx.side)
        seen["scored"] += len(expected)
        return out

    def rows(ctx, prompts, own, peers, selected, received, state):
        out = real_rows(ctx, prompts, own, peers, selected, received, state)
        built, ((peer_name, peer),) = out[0], peers.items()
        n, taken = ctx.n, set(torch.nonzero(selected[peer_name]).squeeze(1).tolist())
        kept = [x for x in received[peer_name] if x.weight > 0]
        own_adv, peer_adv = naive_advantages(own.rewards), naive_advantages(peer.rewards)
        want = [(g, prompts[g], own.tokens[g * n + i], own_adv[g][i], 1.0, False)
                for g in range(len(prompts)) if g not in taken for i in range(n)]
        want += [(x.group, prompts[x.group], x.ids, peer_adv[x.group][x.slot % n], x.weight, True) for x in kept]
        have = [(r.group, r.prompt, r.response, r.adv, r.weight, r.is_peer) for r in built.rows]
        assert len(have) == len(want), (ctx.side, len(have), len(want))
        for h, w in zip(have, want):
            assert h[:3] == w[:3] and h[4:] == w[4:] and h[3] == pytest.approx(w[3], rel=1e-5, abs=1e-6), (h, w)
        assert set(torch.nonzero(built.replaced).squeeze(1).tolist()) == {x.group for x in kept}
        seen["calls"] += 1
        return out

    def order(is_peer_group, num_minibatches, **kw):
        mbs = real_order(is_peer_group, num_minibatches, **kw)
        flags = [bool(is_peer_group[g]) for mb in mbs for g in mb.tolist()]
        assert flags == sorted(flags), "an own group after a received one"  # peer-last
        seen["orders"] += 1
        return mbs

    monkeypatch.setattr(graft, "graft_select", select)
    monkeypatch.setattr(graft, "graft_score", score)
    monkeypatch.setattr(graft, "graft_rows", rows)
    monkeypatch.setattr(core, "minibatch_order", order)
    monkeypatch.chdir(ROOT)
    with torch.random.fork_rng():
        exec(compile(code, str(PORTING), "exec"), ns)
    assert seen["calls"] == seen["orders"] == 4  # two sides, two steps
    assert {side for side, _ in seen["selected"]} == {"A", "B"}, seen  # both ways
    assert seen["accepted"] >= 1 and seen["rejected"] >= 1, seen
