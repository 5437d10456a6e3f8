"""Tests of graft.py: the copyable core against hand-computed examples and naive loops, then the
trainer end to end on tiny models (CPU, seconds each).

Run: python -m pytest -q test_graft.py
"""

import json
import math
import os
from pathlib import Path

import pytest
import torch

import baselines
import evaluation
import graft
from config import Config, build_parser, flags_document, validate_config
from core import (Mean, balanced_swap, batch_indices, compatibility_weights, decode_response, graft_candidates,
                  group_advantages, minibatch_order, policy_loss, received_groups, rescue_candidates, retokenize,
                  seeded_generator, sequence_mean_logprob, success_counts, verifier_text)
from exchange import (ROLLOUT_FORMAT, StepRollouts, load_rollouts, rollout_path, save_rollouts, wait_for_file,
                      write_failed)
from reward import unreadable_golds
from runtime import DistInfo
from sampler import response_logprobs

torch.set_num_threads(1)
SHARED = Path(__file__).resolve().parent.parent / "shared"
needs_shared = pytest.mark.skipif(not (SHARED / "tokenizers").is_dir(),
                                  reason="../shared (real tokenizers and benchmarks) is not present")


# ------------------------------------------------------------------------------------------------
# group_advantages
# ------------------------------------------------------------------------------------------------


def test_group_advantages_hand_computed():
    # r = [1, 0, 0, 0]: mean 0.25; unbiased var = (0.75^2 + 3 * 0.25^2) / 3 = 0.75 / 3 = 0.25, std 0.5
    # a = (r - 0.25) / (0.5 + 1e-6) = [1.5, -0.5, -0.5, -0.5] (up to the eps)
    r = torch.tensor([[1.0, 0.0, 0.0, 0.0]])
    a = group_advantages(r)
    expected = torch.tensor([[0.75, -0.25, -0.25, -0.25]]) / (0.5 + 1e-6)
    torch.testing.assert_close(a, expected)
    # Dr.GRPO: no std division
    torch.testing.assert_close(group_advantages(r, std_normalize=False), torch.tensor([[0.75, -0.25, -0.25, -0.25]]))


def test_group_advantages_zero_variance_and_n1_are_exactly_zero():
    r = torch.tensor([[0.0, 0.0, 0.0], [1.0, 1.0, 1.0], [1.0, 0.0, 1.0]])
    a = group_advantages(r)
    assert torch.equal(a[:2], torch.zeros(2, 3))
    assert a[2].sum().abs() < 1e-5 and (a[2] != 0).all()
    a1 = group_advantages(torch.tensor([[1.0], [0.0]]))  # n = 1: undefined std -> exactly 0, no nan
    assert torch.equal(a1, torch.zeros(2, 1))


def test_group_advantages_matches_naive_loop():
    g = torch.Generator().manual_seed(0)
    r = (torch.rand(50, 8, generator=g) < 0.3).float()
    a = group_advantages(r)
    for i in range(50):
        xs = r[i].tolist()
        mu = sum(xs) / 8
        sd = math.sqrt(sum((x - mu) ** 2 for x in xs) / 7)
        for j in range(8):
            want = 0.0 if sd == 0 else (xs[j] - mu) / (sd + 1e-6)
            assert abs(a[i, j].item() - want) < 1e-5


# ------------------------------------------------------------------------------------------------
# candidates and balanced swap
# ------------------------------------------------------------------------------------------------


def test_graft_candidates_eq4():
    n = 4
    k_recv = torch.tensor([0, 0, 0, 0, 1, 2])
    k_src = torch.tensor([0, 1, 3, 4, 2, 0])
    # q0: source all fail; q1, q2: yes; q3: source all pass (a = 0) -> no; q4, q5: receiver not all-fail
    assert graft_candidates(k_recv=k_recv, k_src=k_src, n=n).tolist() == [False, True, True, False, False, False]


def test_balanced_swap_hand_example_with_ties_across_boundary():
    n = 8
    # A->B candidates (k_b = 0, 1 <= k_a < 8): q0 (k_a=5), q1 (k_a=3), q2 (k_a=3), q3 (k_a=1)   -> 4
    # B->A candidates (k_a = 0, 1 <= k_b < 8): q4 (k_b=2), q5 (k_b=7)                         -> 2
    # m = 2. A->B sorted by k_a desc: q0(5), q1(3), q2(3), q3(1): keep first 2 = q0, q1, plus q2
    # (tied with the 2nd at 3) -> {q0, q1, q2}, more than m. B->A keeps both.
    k_a = torch.tensor([5, 3, 3, 1, 0, 0, 8, 4])
    k_b = torch.tensor([0, 0, 0, 0, 2, 7, 0, 4])
    a_to_b, b_to_a = balanced_swap(k_a=k_a, k_b=k_b, n=n)
    assert a_to_b.tolist() == [True, True, True, False, False, False, False, False]
    assert b_to_a.tolist() == [False, False, False, False, True, True, False, False]
    # without balancing: every candidate
    a_all, b_all = balanced_swap(k_a=k_a, k_b=k_b, n=n, balance=False)
    assert a_all.tolist() == [True, True, True, True, False, False, False, False]
    assert b_all.tolist() == b_to_a.tolist()


def test_balanced_swap_m_zero_and_empty():
    n = 4
    k_a = torch.tensor([2, 3, 1])
    k_b = torch.tensor([0, 0, 0])  # only A->B candidates exist: m = 0 selects nothing at all
    a_to_b, b_to_a = balanced_swap(k_a=k_a, k_b=k_b, n=n)
    assert not a_to_b.any() and not b_to_a.any()
    for k in (torch.zeros(3, dtype=torch.long), torch.full((3,), n)):  # all-fail / all-pass both
        x, y = balanced_swap(k_a=k, k_b=k, n=n)
        assert not x.any() and not y.any()
    e = torch.zeros(0, dtype=torch.long)
    x, y = balanced_swap(k_a=e, k_b=e, n=n)
    assert x.shape == (0,) and y.shape == (0,)


def test_balanced_swap_invariants_random():
    g = torch.Generator().manual_seed(1)
    for trial in range(300):
        n = int(torch.randint(1, 9, (1,), generator=g))
        G = int(torch.randint(1, 30, (1,), generator=g))
        k_a = torch.randint(0, n + 1, (G,), generator=g)
        k_b = torch.randint(0, n + 1, (G,), generator=g)
        a_to_b, b_to_a = balanced_swap(k_a=k_a, k_b=k_b, n=n)
        c_ab, c_ba = graft_candidates(k_recv=k_b, k_src=k_a, n=n), graft_candidates(k_recv=k_a, k_src=k_b, n=n)
        m = min(int(c_ab.sum()), int(c_ba.sum()))
        assert not (a_to_b & ~c_ab).any() and not (b_to_a & ~c_ba).any()  # selected => candidate
        assert int(a_to_b.sum()) >= m and int(b_to_a.sum()) >= m  # kept count >= m
        if m == 0:
            assert not a_to_b.any() and not b_to_a.any()
        # naive reference: sort (-k_src, index), keep first m and ties of the m-th
        for sel, cand, k_src in ((a_to_b, c_ab, k_a), (b_to_a, c_ba, k_b)):
            idx = sorted(torch.nonzero(cand).flatten().tolist(), key=lambda q: (-int(k_src[q]), q))
            want = set(idx[:m]) | ({q for q in idx if int(k_src[q]) == int(k_src[idx[m - 1]])} if m else set())
            assert set(torch.nonzero(sel).flatten().tolist()) == want
        # swapping A and B swaps the outputs
        y, x = balanced_swap(k_a=k_b, k_b=k_a, n=n)
        assert torch.equal(x, a_to_b) and torch.equal(y, b_to_a)


def test_received_groups_mirror_between_the_two_processes():
    """Each process calls received_groups with its own counts first; exactly one says own_is_a. What A
    receives must be what B's process computes as sent to A, and vice versa, for every pattern."""
    g = torch.Generator().manual_seed(2)
    for trial in range(300):
        n = int(torch.randint(2, 9, (1,), generator=g))
        G = int(torch.randint(1, 30, (1,), generator=g))
        k_a = torch.randint(0, n + 1, (G,), generator=g)
        k_b = torch.randint(0, n + 1, (G,), generator=g)
        for balance in (True, False):
            into_a = received_groups(k_own=k_a, k_peer=k_b, n=n, own_is_a=True, balance=balance)  # process A
            into_b = received_groups(k_own=k_b, k_peer=k_a, n=n, own_is_a=False, balance=balance)  # process B
            a_to_b, b_to_a = balanced_swap(k_a=k_a, k_b=k_b, n=n, balance=balance)
            assert torch.equal(into_a, b_to_a) and torch.equal(into_b, a_to_b)
            assert not (into_a & into_b).any()  # a prompt never moves both ways (receiver fails all n)
    # By hand, n = 4: C_{A->B} = {0 (k_a 2), 3 (1), 5 (3)}, C_{B->A} = {1 (k_b 3), 2 (1)}, so m = 2.
    # B keeps A's top two by k_a (5, 0; group 3 is dropped); A keeps both of B's (1, 2).
    k_a, k_b = torch.tensor([2, 0, 0, 1, 0, 3]), torch.tensor([0, 3, 1, 0, 0, 0])
    into_a = received_groups(k_own=k_a, k_peer=k_b, n=4, own_is_a=True)
    into_b = received_groups(k_own=k_b, k_peer=k_a, n=4, own_is_a=False)
    assert into_a.tolist() == [False, True, True, False, False, False]
    assert into_b.tolist() == [True, False, False, False, False, True]


def test_rescue_candidates_is_sgts_rule():
    k_recv, k_src = torch.tensor([0, 0, 0, 1, 0]), torch.tensor([0, 2, 4, 2, 1])
    rescue = rescue_candidates(k_recv=k_recv, k_src=k_src)
    assert rescue.tolist() == [False, True, True, False, True]  # an all-pass source counts
    assert graft_candidates(k_recv=k_recv, k_src=k_src, n=4).tolist() == [False, True, False, False, True]  # Eq. 4: not


def test_seeded_generator_streams_are_stable_and_distinct():
    draw = lambda *a, **k: torch.randint(1 << 30, (4,), generator=seeded_generator(*a, **k)).tolist()  # noqa: E731
    assert draw(0, 3, "select") == draw(0, 3, "select")
    others = [draw(1, 3, "select"), draw(0, 4, "select"), draw(0, 3, "accept"), draw(0, 3, "select", rank=1)]
    assert all(o != draw(0, 3, "select") for o in others)
    # independent of Python's salted hash(): another interpreter with another PYTHONHASHSEED agrees
    code = ("import sys, torch; sys.path.insert(0, %r); import graft; "
            "print(torch.randint(1 << 30, (4,), generator=graft.seeded_generator(0, 3, 'select')).tolist())")
    out = run_py(["-c", code % str(Path(__file__).parent)], Path(__file__).parent, {"PYTHONHASHSEED": "123"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip()) == draw(0, 3, "select")


# ------------------------------------------------------------------------------------------------
# compatibility
# ------------------------------------------------------------------------------------------------


def test_compatibility_weights_hand_computed():
    # s = exp(recv - src): exp(0) = 1 -> w 1; exp(0.5) = 1.65 -> capped 1; exp(-0.1) = 0.905 -> 0.905;
    # exp(-0.3) = 0.741 <= 0.8 -> 0; exp(ln 0.8) = 0.8 exactly -> not > delta -> 0
    recv = torch.tensor([-1.0, -0.5, -1.1, -1.3, -1.0 + math.log(0.8)])
    src = torch.tensor([-1.0, -1.0, -1.0, -1.0, -1.0])
    w = compatibility_weights(lbar_recv=recv, lbar_src=src, delta=0.8)
    torch.testing.assert_close(w, torch.tensor([1.0, 1.0, math.exp(-0.1), 0.0, 0.0]), atol=1e-6, rtol=0)
    w0 = compatibility_weights(lbar_recv=recv, lbar_src=src, delta=0.0)  # no floor: every response kept
    torch.testing.assert_close(w0[3], torch.tensor(math.exp(-0.3)), atol=1e-6, rtol=0)
    assert compatibility_weights(lbar_recv=recv.view(5, 1).expand(5, 3),
                                 lbar_src=src.view(5, 1).expand(5, 3)).shape == (5, 3)


def test_sequence_mean_logprob_token_and_byte():
    logp = torch.tensor([[-1.0, -2.0, -3.0], [-4.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]], dtype=torch.bool)
    torch.testing.assert_close(sequence_mean_logprob(logp=logp, mask=mask), torch.tensor([-2.0, -4.0]))
    torch.testing.assert_close(sequence_mean_logprob(logp=logp, mask=mask, num_bytes=torch.tensor([12, 2])),
                               torch.tensor([-0.5, -2.0]))


# ------------------------------------------------------------------------------------------------
# policy_loss against a naive per-token loop
# ------------------------------------------------------------------------------------------------


def naive_loss(logp, old, adv, mask, w, eps_low, eps_high, dual_clip=None):
    num, den = 0.0, 0.0
    for j in range(logp.shape[0]):
        if w[j] <= 0:
            continue
        for t in range(logp.shape[1]):
            if not mask[j, t]:
                continue
            rho = torch.exp(logp[j, t] - old[j, t])
            obj = torch.minimum(rho * adv[j], torch.clamp(rho, 1 - eps_low, 1 + eps_high) * adv[j])
            if dual_clip and adv[j] < 0:
                obj = torch.maximum(obj, dual_clip * adv[j])
            num = num + w[j] * obj
            den += 1
    return -num / den


@pytest.mark.parametrize("dual_clip", [None, 3.0])
def test_policy_loss_matches_naive_loop_values_and_grads(dual_clip):
    g = torch.Generator().manual_seed(0)
    B, T = 6, 7
    old = -torch.rand(B, T, generator=g) * 3
    base = (old + torch.randn(B, T, generator=g) * 0.4).double()
    adv = torch.randn(B, generator=g)
    mask = torch.rand(B, T, generator=g) < 0.8
    w = torch.tensor([1.0, 1.0, 0.0, 0.9, 0.85, 1.0])
    is_peer = torch.tensor([False, False, True, True, True, False])
    lp1 = base.clone().requires_grad_(True)
    loss, metrics = policy_loss(logp=lp1, old_logp=old.double(), advantages=adv, mask=mask, weights=w,
                                dual_clip=dual_clip, is_peer=is_peer)
    loss.backward()
    lp2 = base.clone().requires_grad_(True)
    ref = naive_loss(lp2, old.double(), adv.double(), mask, w.double(), 0.2, 0.28, dual_clip)
    ref.backward()
    torch.testing.assert_close(loss.double(), ref, rtol=1e-6, atol=1e-8)
    torch.testing.assert_close(lp1.grad, lp2.grad, rtol=1e-6, atol=1e-8)
    assert lp1.grad[2].abs().sum() == 0  # w = 0: no gradient
    assert metrics["tokens"] == float((mask[[0, 1, 3, 4, 5]]).sum())  # w = 0 row left the denominator
    assert isinstance(metrics["loss"], float)
    for k in ("clipfrac_own", "clipfrac_peer", "approx_kl", "ratio_mean", "mean_weight", "peer_mean_weight"):
        assert isinstance(metrics[k], Mean) and isinstance(metrics[k].total, float), k
    # each mean over its own subset: peer tokens of retained rows (3, 4), own tokens, peer rows
    assert metrics["clipfrac_peer"].count == metrics["peer_tokens"] == float(mask[[3, 4]].sum())
    assert metrics["clipfrac_own"].count == metrics["own_tokens"] == float(mask[[0, 1, 5]].sum())
    assert metrics["peer_mean_weight"] == (pytest.approx(0.9 + 0.85), 2.0)


def test_policy_loss_weight_zero_removes_from_denominator():
    # Two responses of 2 tokens each, on-policy (ratio 1), advantages 1 and 5. With w = (1, 0) the
    # loss is -(1 + 1) / 2 = -1: the second row is absent from the numerator AND the denominator.
    z = torch.zeros(2, 2)
    mask = torch.ones(2, 2, dtype=torch.bool)
    loss, m = policy_loss(logp=z, old_logp=z, advantages=torch.tensor([1.0, 5.0]), mask=mask,
                          weights=torch.tensor([1.0, 0.0]))
    assert loss.item() == pytest.approx(-1.0)
    # with w = (1, 0.5): -(1*1*2 + 0.5*5*2) / 4 = -7/4; the peer row counts fully in the denominator
    loss, m = policy_loss(logp=z, old_logp=z, advantages=torch.tensor([1.0, 5.0]), mask=mask,
                          weights=torch.tensor([1.0, 0.5]))
    assert loss.item() == pytest.approx(-7 / 4)
    assert m["mean_weight"].value == pytest.approx(0.75)


def test_policy_loss_clipping_zero_gradient_outside_trust_region():
    old = torch.zeros(1, 4)
    # ratios e^0.5 = 1.65 (> 1.28), 1.1 (inside), e^-0.5 = 0.61 (< 0.8), 0.9 (inside)
    lp = torch.tensor([[0.5, math.log(1.1), -0.5, math.log(0.9)]], requires_grad=True)
    mask = torch.ones(1, 4, dtype=torch.bool)
    loss, m = policy_loss(logp=lp, old_logp=old, advantages=torch.tensor([1.0]), mask=mask)  # positive advantage
    loss.backward()
    # a > 0: the too-high ratio is clipped (zero grad); the too-low one is not (the min keeps rho*a)
    assert lp.grad[0, 0] == 0 and lp.grad[0, 1] != 0 and lp.grad[0, 2] != 0 and lp.grad[0, 3] != 0
    assert m["clipfrac_own"].value == pytest.approx(0.25)
    lp.grad = None
    loss, m = policy_loss(logp=lp, old_logp=old, advantages=torch.tensor([-1.0]), mask=mask)  # negative advantage
    loss.backward()
    assert lp.grad[0, 2] == 0 and lp.grad[0, 0] != 0 and lp.grad[0, 1] != 0
    assert m["clipfrac_own"].value == pytest.approx(0.25)


def test_policy_loss_dual_clip_bounds_negative_advantage():
    old = torch.zeros(1, 1)
    lp = torch.tensor([[math.log(5.0)]], requires_grad=True)  # ratio 5 > c = 3, a = -1
    mask = torch.ones(1, 1, dtype=torch.bool)
    loss, _ = policy_loss(logp=lp, old_logp=old, advantages=torch.tensor([-1.0]), mask=mask, dual_clip=3.0)
    assert loss.item() == pytest.approx(3.0)  # -max(min(-5, -1.28), -3) = 3
    loss.backward()
    assert lp.grad.item() == 0
    lp.grad = None
    loss, _ = policy_loss(logp=lp, old_logp=old, advantages=torch.tensor([-1.0]), mask=mask)
    assert loss.item() == pytest.approx(5.0)


def test_policy_loss_sequence_ratio_and_denominator_override():
    old = torch.zeros(1, 3)
    lp = torch.tensor([[0.3, -0.3, 0.6]], requires_grad=True)  # mean log ratio 0.2 -> rho = e^0.2
    mask = torch.ones(1, 3, dtype=torch.bool)
    loss, m = policy_loss(logp=lp, old_logp=old, advantages=torch.tensor([1.0]), mask=mask, ratio_level="sequence")
    assert loss.item() == pytest.approx(-math.exp(0.2))  # min(1.2214, 1.28) * 1, same on each token
    loss2, _ = policy_loss(logp=lp, old_logp=old, advantages=torch.tensor([1.0]), mask=mask, ratio_level="sequence",
                           loss_denominator=6)
    assert loss2.item() == pytest.approx(-math.exp(0.2) / 2)  # 3 tokens / 6 = half


def test_sequence_ratio_clamps_the_mean_not_each_token():
    # token log-ratios (50, 0): the sequence mean is 25 -> clamped to 20. Clamping each token first
    # would give mean(20, 0) = 10, a biased sequence ratio.
    lp = torch.tensor([[50.0, 0.0]])
    _, m = policy_loss(logp=lp, old_logp=torch.zeros(1, 2), advantages=torch.tensor([-1.0]),
                       mask=torch.ones(1, 2, dtype=torch.bool), ratio_level="sequence")
    assert m["ratio_mean"].value == pytest.approx(math.exp(20.0), rel=1e-5)
    _, m = policy_loss(logp=torch.tensor([[50.0, -10.0]]), old_logp=torch.zeros(1, 2), advantages=torch.tensor([-1.0]),
                       mask=torch.ones(1, 2, dtype=torch.bool), ratio_level="sequence")
    assert m["ratio_mean"].value == pytest.approx(math.exp(20.0), rel=1e-5)  # mean 20: at the bound, not exp(5)


# ------------------------------------------------------------------------------------------------
# minibatch order
# ------------------------------------------------------------------------------------------------


def test_minibatch_order_peer_last_first_uniform():
    is_peer = torch.tensor([False, True, False, False, True, False, False, False])
    mbs = minibatch_order(is_peer, 4, order="peer_last")
    assert [m.tolist() for m in mbs] == [[0, 2], [3, 5], [6, 7], [1, 4]]
    mbs = minibatch_order(is_peer, 4, order="peer_first")
    assert [m.tolist() for m in mbs] == [[1, 4], [0, 2], [3, 5], [6, 7]]
    g = torch.Generator().manual_seed(0)
    mbs = minibatch_order(is_peer, 4, order="uniform", generator=g)
    assert sorted(torch.cat(mbs).tolist()) == list(range(8))
    # peer-last with shuffling: still every own group before every peer group
    seq = torch.cat(minibatch_order(is_peer, 3, order="peer_last", generator=torch.Generator().manual_seed(3)))
    assert set(seq[-2:].tolist()) == {1, 4} and sorted(seq.tolist()) == list(range(8))
    # more minibatches than groups: no empty minibatch
    assert len(minibatch_order(torch.tensor([True, False]), 4)) == 2


# ------------------------------------------------------------------------------------------------
# retokenisation between the real tokenizers
# ------------------------------------------------------------------------------------------------


def _load_tok(name):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(SHARED / "tokenizers" / name))


def _benchmark_texts(limit=120):
    texts = []
    for f in ("math500.jsonl", "minerva_math.jsonl", "aime2024.jsonl"):
        p = SHARED / "benchmarks" / f
        if p.exists():
            for line in p.read_text().splitlines()[: limit // 3]:
                row = json.loads(line)
                texts.append(row.get("solution") or row["problem"])
    return texts


@needs_shared
def test_retokenize_round_trips_between_real_tokenizers():
    toks = {n: _load_tok(n) for n in ("qwen3", "smollm3", "llama3_2")}
    texts = _benchmark_texts()
    assert len(texts) >= 60
    for src_name, src in toks.items():
        for dst_name, dst in toks.items():
            if src_name == dst_name:
                continue
            for i, text in enumerate(texts):
                ended = i % 2 == 0
                src_ids = src.encode(text, add_special_tokens=False) + ([src.eos_token_id] if ended else [])
                back, eos = decode_response(src_ids, src, eos_token_ids=src.eos_token_id)
                assert back == text and eos == ended
                dst_ids = retokenize(back, eos, dst, max_response_tokens=10**6)
                # no BOS, the receiver's own EOS exactly when the source ended with EOS
                assert dst_ids[0] != dst.bos_token_id or dst.bos_token_id is None
                assert (dst_ids[-1] == dst.eos_token_id) == ended
                body = dst_ids[:-1] if ended else dst_ids
                assert dst.decode(body, skip_special_tokens=True, clean_up_tokenization_spaces=False) == text


@needs_shared
def test_retokenize_length_drop_and_digit_split():
    qwen, smol = _load_tok("qwen3"), _load_tok("smollm3")
    text = "So the answer is 12345, i.e. \\boxed{12345}."
    q = retokenize(text, True, qwen, max_response_tokens=100)
    s = retokenize(text, True, smol, max_response_tokens=100)
    assert len(q) > len(s)  # Qwen splits every digit, the Llama vocabulary takes groups of 3
    assert retokenize(text, True, qwen, max_response_tokens=len(q)) == q  # exactly at the limit: kept
    assert retokenize(text, True, qwen, max_response_tokens=len(q) - 1) is None  # one over: dropped
    assert retokenize(text, False, qwen, max_response_tokens=len(q) - 1) == q[:-1]  # no EOS appended


# ------------------------------------------------------------------------------------------------
# The trainer end to end on tiny random models
# ------------------------------------------------------------------------------------------------

CHARS = list("0123456789+-*/=()., abcdefghijklmnopqrstuvwxyz?:\\{}\n")


def make_tiny_model(path: Path, arch: str = "llama", seed: int = 0, granularity: int = 1):
    """A tiny random causal LM + a local tokenizer (characters, or pairs of digits with granularity=2)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders
    from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast, Qwen3Config
    vocab = {"<pad>": 0, "</s>": 1}
    for c in CHARS:
        vocab.setdefault(c, len(vocab))
    merges = []
    if granularity == 2:  # a second tokenisation of digits: pairs "12" as one token
        for a in "0123456789":
            for b in "0123456789":
                vocab[a + b] = len(vocab)
                merges.append((a, b))
    tk = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tk.pre_tokenizer = pre_tokenizers.Split(pattern=" ", behavior="isolated") if granularity == 1 else \
        pre_tokenizers.Split(pattern=" ", behavior="isolated")
    tk.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="</s>", pad_token="<pad>")
    torch.manual_seed(seed)
    kw = dict(vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, eos_token_id=1, pad_token_id=0, bos_token_id=None)
    cfg = LlamaConfig(**kw) if arch == "llama" else Qwen3Config(head_dim=8, **kw)
    model = AutoModelForCausalLM.from_config(cfg)
    model.generation_config.eos_token_id = 1
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def write_prompts(path: Path, n: int = 16):
    rows = [{"id": f"p{i}", "problem": f"{i}+{i + 1}", "answer": str(2 * i + 1)} for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


import subprocess  # noqa: E402  (the end-to-end tests' helpers)
import sys  # noqa: E402

ROOT = Path(__file__).resolve().parent
PLANTED = '''
import sys, zlib
sys.path.insert(0, {root!r})
import verify
def planted(responses, golds, *, workers=0):
    # deterministic pseudo-rewards from the text: about one response in {mod} "succeeds"
    return [1.0 if zlib.crc32(r.encode()) % {mod} == 0 else 0.0 for r in responses]
verify.verify_batch = planted
import graft
graft.main(sys.argv[1:])
'''


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    make_tiny_model(d / "ma", "llama", 0, 1)
    make_tiny_model(d / "mb", "qwen3", 1, 2)
    write_prompts(d / "p.jsonl")
    (d / "planted.py").write_text(PLANTED.format(root=str(ROOT), mod=4))
    return d


def common_flags(d, steps=2):
    return ["--prompts", str(d / "p.jsonl"), "--steps", str(steps), "--prompts-per-step", "8", "--rollouts", "4",
            "--minibatches", "2", "--max-response-tokens", "16", "--prompt-template", "{problem}=", "--lr", "1e-3",
            "--threads", "1", "--exchange-timeout", "120", "--micro-batch-size", "8"]


def run_py(args, cwd, env_extra=None, timeout=300):
    """`python ARGS` in `cwd`, with the repository on the path (so `-m tools.tiny` and `-m bench.gpu` run anywhere)."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", PYTHONPATH=path) | (env_extra or {})
    return subprocess.run([sys.executable] + args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def read_metrics(path):
    return [json.loads(x) for x in Path(path).read_text().splitlines() if x.strip()]


def test_pair_two_processes_mirror_selection(tiny, tmp_path):
    ex = tmp_path / "ex"
    procs = []
    for name, peer, model in (("a", "b", "ma"), ("b", "a", "mb")):
        args = [str(tiny / "planted.py"), "train", "--model", str(tiny / model), "--name", name, "--peer-name", peer,
                "--out", str(tmp_path / name), "--peer-exchange", str(ex), "--no-balance", "--delta", "0"]
        args += common_flags(tiny)
        env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
        procs.append(subprocess.Popen([sys.executable] + args, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    ma, mb = read_metrics(tmp_path / "a" / "metrics.jsonl"), read_metrics(tmp_path / "b" / "metrics.jsonl")
    assert len(ma) == len(mb) == 2
    moved = 0
    for step in range(2):
        ra, _ = load_rollouts(rollout_path(ex, "a", step), n=4)
        rb, _ = load_rollouts(rollout_path(ex, "b", step), n=4)
        assert ra.prompt_ids == rb.prompt_ids  # same prompt batches on both sides
        a_to_b, b_to_a = balanced_swap(k_a=success_counts(ra.rewards), k_b=success_counts(rb.rewards), n=4,
                                       balance=False)
        # each side's own count of what it received mirrors the other's candidates
        assert ma[step]["selected"] == int(b_to_a.sum()) and mb[step]["selected"] == int(a_to_b.sum())
        assert ma[step]["candidates_out"] == mb[step]["candidates_in"]
        assert mb[step]["candidates_out"] == ma[step]["candidates_in"]
        moved += int(a_to_b.sum() + b_to_a.sum())
        for m in (ma[step], mb[step]):
            assert m["accepted"] + m["rejected"] + m["dropped_length"] == 4 * m["selected"]
    assert moved > 0, "the planted rewards should make some groups move"


USER_REWARD = """
import zlib
def crc_third(responses, golds, *, workers=0):
    # a reward that is not verify.py's: about one response in three scores 1, decided by the response and gold
    return [1.0 if zlib.crc32((r + "|" + g).encode()) % 3 == 0 else 0.0 for r, g in zip(responses, golds)]
"""


def test_pair_trains_with_a_user_reward_from_a_file(tiny, tmp_path):
    """--reward path.py:function: both sides of a pair score with the user's function (README "The reward")."""
    (tmp_path / "my_reward.py").write_text(USER_REWARD)
    spec = f"{tmp_path / 'my_reward.py'}:crc_third"
    ex, procs = tmp_path / "ex", []
    for name, peer, model in (("a", "b", "ma"), ("b", "a", "mb")):
        args = [str(ROOT / "graft.py"), "train", "--model", str(tiny / model), "--name", name, "--peer-name", peer,
                "--out", str(tmp_path / name), "--peer-exchange", str(ex), "--delta", "0", "--reward", spec]
        env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
        procs.append(subprocess.Popen([sys.executable] + args + common_flags(tiny), env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    gold = {r["id"]: r["answer"] for r in map(json.loads, (tiny / "p.jsonl").read_text().splitlines())}
    scorer = {}
    exec(USER_REWARD, scorer)
    moved = 0
    for name in "ab":
        metrics = read_metrics(tmp_path / name / "metrics.jsonl")
        for step, m in enumerate(metrics):
            ro, _ = load_rollouts(rollout_path(ex, name, step), n=4)
            want = scorer["crc_third"](ro.texts, [gold[p] for p in ro.prompt_ids for _ in range(4)])
            assert ro.rewards.view(-1).tolist() == want  # every reward of the step is the user's function's
            assert m["reward"] == pytest.approx(sum(want) / len(want))
            moved += m["selected"]
    assert moved > 0, "the user's rewards should make some groups move between the sides"


def test_reward_flag_errors_name_the_flag(tmp_path, capsys):
    """A bad --reward stops at start with a message naming the flag; options reach only functions that take them."""
    from reward import load_reward, rewards
    (tmp_path / "r.py").write_text(
        "def one_arg(responses):\n    return [0.0] * len(responses)\n"
        "def short(responses, golds, *, workers=0):\n    return [1.0]\n"
        "def nan(responses, golds, *, workers=0):\n    return [float('nan')] * len(responses)\n"
        "def text(responses, golds, *, workers=0):\n    return ['yes'] * len(responses)\n"
        "def tol(responses, golds, *, workers=0, rel_tol=None):\n    return [float(rel_tol or 0)] * len(responses)\n"
        "def plain(responses, golds, *, workers=0):\n    return [float(workers)] * len(responses)\n")
    (tmp_path / "broken.py").write_text("raise RuntimeError('boom')\n")
    for spec, msg in ((f"{tmp_path / 'none.py'}:f", "no such file"), (f"{tmp_path / 'r.py'}:missing", "no function"),
                      (f"{tmp_path / 'r.py'}:one_arg", "cannot be called as reward"),
                      (f"{tmp_path / 'broken.py'}:f", "importing .* failed .*boom"),
                      ("no_such_module_anywhere:f", "importing no_such_module_anywhere failed"),
                      ("nocolon", "module:function")):
        with pytest.raises(ValueError, match=f"--reward .*{msg}"):
            load_reward(spec)
    for name, msg in (("short", "returned 1 rewards for 2 responses"), ("nan", "finite"), ("text", "list of numbers")):
        with pytest.raises(ValueError, match=f"--reward .*{msg}"):
            rewards(f"{tmp_path / 'r.py'}:{name}", ["x", "y"], ["1", "2"])
    assert rewards(f"{tmp_path / 'r.py'}:tol", ["x"], ["1"], rel_tol=0.25) == [0.25]  # taken: passed
    assert rewards(f"{tmp_path / 'r.py'}:plain", ["x"], ["1"], workers=3, rel_tol=0.25) == [3.0]  # not taken: left out
    with pytest.raises(SystemExit, match=r"graft.py train: --reward .*one_arg.* cannot be called as reward"):
        graft.main(["train", "--model", "m", "--reward", f"{tmp_path / 'r.py'}:one_arg"])

def test_resume_equals_uninterrupted(tiny, tmp_path):
    base = [str(tiny / "planted.py"), "train", "--model", str(tiny / "ma")] + common_flags(tiny, steps=4)
    r = run_py(base + ["--out", str(tmp_path / "full"), "--save-every", "2"], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    r = run_py(base[:-0 or None] + ["--out", str(tmp_path / "cut"), "--save-every", "2", "--steps", "2"], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    r = run_py(base + ["--out", str(tmp_path / "cut"), "--save-every", "2", "--resume"], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "starting at step 2" in r.stdout
    full, cut = read_metrics(tmp_path / "full" / "metrics.jsonl"), read_metrics(tmp_path / "cut" / "metrics.jsonl")
    assert [m["step"] for m in cut] == [0, 1, 2, 3]
    for a, b in zip(full, cut):
        for k in a:
            if not k.startswith("time/"):
                assert a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-7), (a["step"], k)


def test_torchrun_two_gloo_ranks_runs_a_step(tiny, tmp_path):
    args = ["-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29517", str(tiny / "planted.py"),
            "train", "--model", str(tiny / "ma"), "--out", str(tmp_path / "ddp"), "--device", "cpu"]
    args += common_flags(tiny, steps=1)
    r = run_py(args, tmp_path, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert r.stdout.count("step    1/1") == 1  # one log line, from rank 0
    ro, _ = load_rollouts(rollout_path(tmp_path / "ddp" / "exchange", "a", 0), n=4)
    assert len(ro.prompt_ids) == 8 and len(ro.tokens) == 32  # the file holds the whole batch of both ranks


def test_exchange_errors_name_the_problem(tiny, tmp_path):
    n, G = 2, 2
    r = StepRollouts(prompt_ids=["x", "y"], tokens=[[1], [2, 1], [], [3]],
                     logprobs=[torch.zeros(1), torch.zeros(2), torch.zeros(0), torch.zeros(1)],
                     texts=["a", "bb", "", "c"], eos=torch.tensor([[True, True], [False, False]]),
                     rewards=torch.tensor([[1.0, 0.0], [0.0, 0.0]]), advantages=torch.zeros(G, n))
    p = tmp_path / "ok.safetensors"
    save_rollouts(p, r, {"model": "m"})
    back, meta = load_rollouts(p, n=2, prompt_ids=["x", "y"])
    assert back.texts == r.texts and back.tokens == r.tokens and torch.equal(back.eos, r.eos)
    with pytest.raises(ValueError, match="n=2 rollouts per prompt, this run uses n=4"):
        load_rollouts(p, n=4)
    with pytest.raises(ValueError, match="prompt ids differ"):
        load_rollouts(p, n=2, prompt_ids=["x", "z"])
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(p.read_bytes()[:50])
    with pytest.raises(ValueError, match="bad.safetensors: not a readable rollout file"):
        load_rollouts(bad)
    from safetensors.torch import save_file
    v2 = tmp_path / "v2.safetensors"
    save_file({"rewards": torch.zeros(1, 1)}, str(v2), metadata={"format": ROLLOUT_FORMAT, "version": "99"})
    with pytest.raises(ValueError, match="format version '99'"):
        load_rollouts(v2)
    with pytest.raises(TimeoutError, match="step_000003.safetensors"):
        wait_for_file(rollout_path(tmp_path, "b", 3), timeout=0.3)
    write_failed(tmp_path, "b", "run1", "RuntimeError: out of memory")
    with pytest.raises(RuntimeError, match="peer failed.*out of memory"):
        wait_for_file(rollout_path(tmp_path, "b", 3), timeout=5, run_id="run1")


def test_cli_bad_input_names_the_flag(tiny, tmp_path):
    r = run_py([str(ROOT / "graft.py"), "train", "--model", str(tiny / "ma"), "--order", "sideways"], tmp_path)
    assert r.returncode != 0 and "--order: 'sideways' is not one of" in r.stderr, r.stderr[-2000:]
    r = run_py([str(ROOT / "graft.py"), "train", "--model", str(tiny / "ma"), "--prompts", "nope.jsonl"], tmp_path)
    assert r.returncode != 0 and "--prompts 'nope.jsonl': no such file" in r.stderr, r.stderr[-2000:]


def test_unreadable_golds_are_listed_at_start_or_stop_with_strict(tiny, tmp_path, capsys):
    """Golds the verifier cannot read (an unbalanced brace) would make their prompts always score 0."""
    rows = [{"id": f"p{i}", "problem": f"{i}+{i + 1}", "answer": str(2 * i + 1)} for i in range(16)]
    rows[3]["answer"], rows[9]["answer"] = "\\boxed{", "\\frac{1}{2"
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert unreadable_golds(rows) == ["p3", "p9"]
    kw = dict(model=str(tiny / "ma"), prompts=str(prompts), steps=1, prompts_per_step=8, n=4, minibatches=2,
              max_response_tokens=16, prompt_template="{problem}=", lr=1e-3)
    with pytest.raises(SystemExit, match=r"p\.jsonl: 2 of 16 gold answers cannot be read by verify\.py.*"
                                         r"first ids: p3, p9 \(--strict\)"):
        graft.Trainer(Config(out=str(tmp_path / "strict"), strict=True, **kw))
    graft.Trainer(Config(out=str(tmp_path / "warn"), **kw))
    err = capsys.readouterr().err
    assert "WARNING: --prompts" in err and "2 of 16 gold answers" in err and "first ids: p3, p9" in err


# ------------------------------------------------------------------------------------------------
# Baselines and ablations (README "Baselines and ablations"): each variant's specific behaviour
# ------------------------------------------------------------------------------------------------

PATTERN = [[1, 0, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0], [1, 1, 0, 0],
           [0, 0, 0, 1], [0, 0, 0, 0], [1, 1, 1, 0], [0, 0, 0, 0]]
MIXED = {0, 3, 4, 6}  # groups where the planted peer is mixed (1 <= k < n)


def planted(tiny, tmp_path, monkeypatch, **overrides):
    """A trainer with a stored peer against a hand-made peer log; the receiver fails everything.
    Returns (trainer, the batch's dataset indices, own rollouts, {"log": peer rollouts})."""
    import verify
    from transformers import AutoTokenizer
    monkeypatch.setattr(verify, "verify_batch", lambda rs, gs, workers=0, **kw: [1.0 if "y" in r else 0.0 for r in rs])
    n, G = 4, 8
    batch = batch_indices(16, 0, G, 0)
    texts = [("y=" if PATTERN[g][i] else "n=") + str(g) + str(i) for g in range(G) for i in range(n)]
    tok_b = AutoTokenizer.from_pretrained(tiny / "mb")
    tokens = [tok_b.encode(t, add_special_tokens=False) + [1] for t in texts]
    gen = torch.Generator().manual_seed(0)
    peer = StepRollouts(prompt_ids=[f"p{i}" for i in batch], tokens=tokens,
                        logprobs=[-3.0 - torch.rand(len(t), generator=gen) * 1.5 for t in tokens], texts=texts,
                        eos=torch.ones(G, n, dtype=torch.bool),
                        rewards=torch.tensor(PATTERN, dtype=torch.float32), advantages=torch.zeros(G, n))
    log = tmp_path / "log"
    save_rollouts(rollout_path(log, "b", 0), peer, {"model": "mb"})
    kw = dict(model=str(tiny / "ma"), prompts=str(tiny / "p.jsonl"), out=str(tmp_path / "run"), peer_log=str(log / "b"),
              steps=1, prompts_per_step=G, n=n, minibatches=2, max_response_tokens=16, prompt_template="{problem}=",
              lr=1e-3, delta=0.0)
    kw.update(overrides)
    tr = graft.Trainer(Config(**kw))
    own, _, _ = tr.rollout(0, batch)
    own.rewards.zero_()
    own.advantages.zero_()
    return tr, batch, own, tr.wait_for_peers(0, own)[0]


def exchange_phases(tr, step, batch, own, peers):
    """Trainer.step's exchange phases, the variant's select -> score -> rows on the trainer's Context: the rows, the
    (G,) replaced mask and the three phases' metrics and counts merged."""
    v, prompts = tr.variant, [tr.prompt_ids[i] for i in batch]
    selected, m_select, c_select = v.select(tr.ctx, step, own, peers)
    received, m_score, c_score = v.score(tr.ctx, step, prompts, peers, selected)
    built, m_rows, c_rows = v.rows(tr.ctx, prompts, own, peers, selected, received, tr.baseline_state)
    return built.rows, built.replaced, m_select | m_score | m_rows | c_select | c_score | c_rows


def test_sgt_nll_only_on_rescue_prompts_one_response_each(tiny, tmp_path, monkeypatch):
    tr, batch, own, peer = planted(tiny, tmp_path, monkeypatch, variant="sgt")
    out, replaced, m = exchange_phases(tr, 0, batch, own, peer)
    nll = [r for r in out if r.kind == "nll"]
    # rescue prompts: receiver 0/n and peer >= 1 success: groups 0, 1 (all-pass counts too), 3, 4, 6
    assert sorted(r.group for r in nll) == [0, 1, 3, 4, 6]  # exactly one response per rescue prompt
    from transformers import AutoTokenizer
    tok_a = AutoTokenizer.from_pretrained(tiny / "ma")
    for r in nll:  # always a correct peer response
        assert tok_a.decode(r.response[:-1]).startswith("y=")
    assert sum(1 for r in out if r.kind == "pg") == 32 and not replaced.any()  # plain GRPO rows untouched
    # the NLL term: coef * token-mean NLL, and nothing else from those rows
    lp = torch.tensor([[-1.0, -2.0], [-3.0, 0.0]], requires_grad=True)
    loss, _ = baselines.nll_loss(lp, torch.tensor([[1, 1], [1, 0]], dtype=torch.bool), coef=0.1)
    assert loss.item() == pytest.approx(0.1 * 6 / 3)
    m = tr.update(0, out, replaced)
    assert m["nll/nll_tokens"] == sum(len(r.response) for r in nll)


def test_luffy_gradient_is_the_analytic_derivative_of_f():
    # d/dlogp [ -f(pi) a / D ] with f = pi / (pi + g): df/dpi = g / (pi + g)^2, dpi/dlogp = pi
    g, a = 0.1, torch.tensor([0.7, -1.3])
    lp = torch.tensor([[-0.5, -2.0], [-0.1, -4.0]], requires_grad=True)
    mask = torch.ones(2, 2, dtype=torch.bool)
    loss, _ = baselines.luffy_peer_loss(lp, a, mask, gamma=g)
    loss.backward()
    pi = lp.detach().exp()
    expected = -(g / (pi + g) ** 2) * pi * a[:, None] / 4
    torch.testing.assert_close(lp.grad, expected)
    # no clipping anywhere: a ratio far above 1 + eps still has a gradient
    lp2 = torch.tensor([[0.0]], requires_grad=True)
    baselines.luffy_peer_loss(lp2, torch.tensor([1.0]), torch.ones(1, 1, dtype=torch.bool), gamma=g)[0].backward()
    assert lp2.grad.item() == pytest.approx(-g / (1 + g) ** 2)


def test_luffy_variant_routes_peer_rows(tiny, tmp_path, monkeypatch):
    tr, batch, own, peer = planted(tiny, tmp_path, monkeypatch, variant="luffy")
    out, replaced, _ = exchange_phases(tr, 0, batch, own, peer)
    assert {r.kind for r in out if r.is_peer} == {"luffy"} and {r.kind for r in out if not r.is_peer} == {"pg"}


def test_pooled_advantages_are_over_2n(tiny, tmp_path, monkeypatch):
    tr, batch, own, peer = planted(tiny, tmp_path, monkeypatch, peer_advantages="pooled")
    out, _, _ = exchange_phases(tr, 0, batch, own, peer)
    # group 0: own 0,0,0,0 + peer 1,0,0,0 -> 8 rewards, mean 1/8, unbiased std sqrt((49/64 + 7/64) / 7)
    mu, sd = 1 / 8, math.sqrt((49 / 64 + 7 * 1 / 64) / 7)
    own0 = [r.adv for r in out if r.group == 0 and not r.is_peer]
    assert len(own0) == 4 and all(a == pytest.approx(-mu / (sd + 1e-6), rel=1e-5) for a in own0)
    peer0 = sorted(r.adv for r in out if r.group == 0 and r.is_peer)
    assert peer0[-1] == pytest.approx((1 - mu) / (sd + 1e-6), rel=1e-5)


def test_success_only_transfer_and_no_weight(tiny, tmp_path, monkeypatch):
    tr, batch, own, peer = planted(tiny, tmp_path, monkeypatch, transfer="success", compat_weight=False, delta=0.8)
    out, _, _ = exchange_phases(tr, 0, batch, own, peer)
    peer_rows = [r for r in out if r.is_peer]
    assert len(peer_rows) == sum(sum(PATTERN[g]) for g in MIXED)  # only the correct ones
    assert all(r.adv > 0 and r.weight == 1.0 for r in peer_rows)  # w = 1, no gate


@pytest.mark.parametrize("variant", ["success", "sgt"])
def test_a_format_bonus_is_no_success_when_picking_correct_responses(tiny, tmp_path, monkeypatch, variant):
    """Every peer response earns a 0.1 format bonus: "correct" is still reward >= 0.5 (core.is_success), the rule
    Eq. 4 counts with, in --transfer success and in SGT's one correct response (reward > 0 took every one)."""
    kw = dict(transfer="success", compat_weight=False) if variant == "success" else dict(variant="sgt")
    tr, batch, own, peer = planted(tiny, tmp_path, monkeypatch, **kw)
    peer["log"].rewards += 0.1  # (G, n) wrong answers 0.1, right ones 1.1
    from transformers import AutoTokenizer
    tok_a = AutoTokenizer.from_pretrained(tiny / "ma")
    for _ in range(3 if variant == "sgt" else 1):  # SGT draws its response: a few draws
        tr.cfg.seed += 1
        out, _, _ = exchange_phases(tr, 0, batch, own, peer)
        got = [r for r in out if r.is_peer or r.kind == "nll"]
        assert got and all(tok_a.decode(r.response[:-1]).startswith("y=") for r in got)
    if variant == "success":
        assert len(got) == sum(sum(PATTERN[g]) for g in MIXED)


def test_random_acceptance_keeps_the_rate(tiny, tmp_path, monkeypatch):
    tr, batch, own, peer = planted(tiny, tmp_path, monkeypatch, delta=0.8)
    _, _, m_gate = exchange_phases(tr, 0, batch, own, peer)
    tr.ctx = tr.ctx._replace(acceptance="random")  # the rule reads its Context, built from the config at start
    _, _, m_rand = exchange_phases(tr, 0, batch, own, peer)
    assert m_rand["accepted"] == m_gate["accepted"] and m_rand["selected"] == m_gate["selected"] == 4


def test_sgt_selection_rule_with_grafts_update(tiny, tmp_path, monkeypatch):
    tr, batch, own, peer = planted(tiny, tmp_path, monkeypatch, selection="sgt")
    out, replaced, m = exchange_phases(tr, 0, batch, own, peer)
    # SGT's rescue rule: every group where the peer solved at least once, the all-pass group 1 included
    assert m["selected"] == 5 and m["peer_responses"] == 20
    peer_groups = {r.group for r in out if r.is_peer}
    assert peer_groups <= {0, 1, 3, 4, 6} and all(r.kind == "pg" for r in out)  # GRAFT's rows, not NLL
    assert all(r.adv == 0.0 for r in out if r.is_peer and r.group == 1)  # all-pass: the peer's zero advantages
    assert {r.group for r in out if not r.is_peer} == {2, 5, 7}  # every selected group was replaced
    assert all(0 < r.weight <= 1 for r in out if r.is_peer)  # the compatibility weight still applies


def test_random_selection_same_count_among_mixed(tiny, tmp_path, monkeypatch):
    tr, batch, own, peer = planted(tiny, tmp_path, monkeypatch)
    base = graft.graft_select(tr.ctx, 0, own, peer)[0]["log"]
    own.rewards[3] = 1.0  # make group 3 not a candidate; random selection may still draw it (peer is mixed)
    own.rewards[3, 0] = 0.0
    tr.ctx = tr.ctx._replace(selection="random")  # the rule reads its Context, built from the config at start
    counts = set()
    for step in range(20):
        sel = graft.graft_select(tr.ctx, step, own, peer)[0]["log"]
        k_peer = success_counts(peer["log"].rewards)
        k_own = success_counts(own.rewards)
        assert int(sel.sum()) == int(graft_candidates(k_recv=k_own, k_src=k_peer, n=4).sum())
        assert set(torch.nonzero(sel).flatten().tolist()) <= MIXED
        counts.add(tuple(sel.tolist()))
    assert int(base.sum()) == 4 and len(counts) > 1  # really random across steps


def test_hacpo_advantages_hand_computed_and_rows(tiny, tmp_path, monkeypatch):
    # own (1, 0), peer (1, 1), c = 2: baseline (1 + 2 * 2) / (2 + 2 * 2) = 5/6; pooled std of (1,0,1,1) = 0.5
    a_own, a_peer = baselines.hacpo_advantages(r_own=torch.tensor([[1.0, 0.0]]), r_peer=torch.tensor([[1.0, 1.0]]),
                                               capability_ratio=2.0)
    torch.testing.assert_close(a_own, torch.tensor([[1 / 6, -5 / 6]]) / (0.5 + 1e-6))
    torch.testing.assert_close(a_peer, torch.tensor([[1 / 6, 1 / 6]]) / (0.5 + 1e-6))
    tr, batch, own, peer = planted(tiny, tmp_path, monkeypatch, variant="hacpo")
    out, _, m = exchange_phases(tr, 0, batch, own, peer)
    assert m["capability_ratio"] == 10.0  # own success rate 0 -> the clamp's ceiling
    assert {r.group for r in out if r.is_peer} == set(range(8))  # no failure gating: every prompt pools
    assert all(r.kind == "hacpo_peer" and r.weight == 10.0 for r in out if r.is_peer)
    m = tr.update(0, out, torch.zeros(8, dtype=torch.bool))
    assert "hacpo_peer/loss" in m and "hacpo_own/loss" in m


def test_planted_stored_peer_groups_enter_the_loss(tiny, tmp_path, monkeypatch):
    """A hand-made peer log with a known reward pattern: the receiver (planted to fail everything)
    must receive exactly the mixed peer groups, with the peer's advantages and w from Eqs. 6-8."""
    from transformers import AutoTokenizer
    tr, batch, own, peers = planted(tiny, tmp_path, monkeypatch, delta=0.8)
    peer = peers["log"]
    rewards = torch.tensor(PATTERN, dtype=torch.float32)
    torch.testing.assert_close(peer.rewards, rewards)  # re-verified with the (planted) verifier
    expected_adv = group_advantages(rewards)
    train_rows, replaced, m = exchange_phases(tr, 0, batch, own, peers)
    assert m["selected"] == 4 and m["candidates_in"] == 4
    assert 0 < m["accepted"] < 16, "the planted log-probs should put some s on each side of delta"
    assert m["accepted"] + m["rejected"] + m["dropped_length"] == 16
    n, tok_a = 4, AutoTokenizer.from_pretrained(tiny / "ma")
    peer_rows = [r for r in train_rows if r.is_peer]
    assert len(peer_rows) == m["accepted"] and {r.group for r in peer_rows} <= MIXED
    for r in peer_rows:  # w by hand: receiver's mean log-prob of the retokenised text vs the file's
        g = r.group
        i = next(i for i in range(n)
                 if retokenize(peer.texts[g * n + i], True, tok_a, max_response_tokens=16) == r.response)
        assert r.adv == pytest.approx(expected_adv[g, i].item())  # the peer's advantage, held fixed
        lp, mask = response_logprobs(tr.model, [tr.prompt_ids[batch[g]]], [r.response], pad_token_id=0)
        s = math.exp(lp.sum().item() / len(r.response) - peer.logprobs[g * n + i].mean().item())
        assert s > 0.8 and r.weight == pytest.approx(min(s, 1.0), rel=1e-4)
    # replaced groups lost their own rows
    assert {r.group for r in train_rows if not r.is_peer} == set(range(8)) - MIXED
    assert replaced.tolist() == [g in {r.group for r in peer_rows} for g in range(8)]
    m |= tr.update(0, train_rows, replaced)
    assert m["pg/peer_tokens"] == sum(len(r.response) for r in peer_rows)
    assert m["peer_minibatches"] >= (1 if peer_rows else 0)


# ------------------------------------------------------------------------------------------------
# Evaluation with a planted sampler: the reported accuracy is known exactly
# ------------------------------------------------------------------------------------------------

PLANTED_EVAL = '''
import json, sys
from pathlib import Path
sys.path.insert(0, {root!r})
import torch
import evaluation
import graft
from sampler import Rollout
from transformers import AutoTokenizer
tok = AutoTokenizer.from_pretrained({model!r})
golds = {{}}
for f in Path({data!r}).glob("*.jsonl"):
    for i, line in enumerate(f.read_text().splitlines()):
        row = json.loads(line)
        golds[row["problem"]] = (i, row["answer"])
def planted_sample(model, prompts, *, eos_token_id, **kw):
    out = []
    for p in prompts:
        problem = tok.decode(p).split(" Let's think step by step")[0]
        i, gold = golds[problem]
        text = "\\\\boxed{{" + (gold if i % 2 == 0 else "-12345") + "}}"  # even rows right, odd rows wrong
        ids = tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]
        out.append(Rollout(tokens=ids, logprobs=torch.zeros(len(ids)), ended_with_eos=True))
    return out
evaluation.sample = planted_sample
graft.main(sys.argv[1:])
'''


@needs_shared
def test_eval_planted_accuracy_single_and_two_ranks(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3Config
    data = tmp_path / "data"
    r = run_py([str(ROOT / "data" / "prepare.py"), "--from", str(SHARED / "benchmarks"), "--out", str(data),
                "--only", "math500", "aime2024", "aime2025", "amc23", "minerva"], tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    tok = AutoTokenizer.from_pretrained(SHARED / "tokenizers" / "qwen3")
    cfg = Qwen3Config(vocab_size=151936, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=8, eos_token_id=tok.eos_token_id)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    (tmp_path / "planted_eval.py").write_text(PLANTED_EVAL.format(root=str(ROOT), model=str(tmp_path / "m"),
                                                                  data=str(data)))
    flags = ["eval", "--model", str(tmp_path / "m"), "--data-dir", str(data), "--benchmarks", "all", "--samples", "2",
             "--eval-max-problems", "3", "--device", "cpu"]
    single = run_py([str(tmp_path / "planted_eval.py")] + flags + ["--eval-out", str(tmp_path / "one.json")], tmp_path)
    assert single.returncode == 0, single.stderr[-3000:]
    res = json.loads((tmp_path / "one.json").read_text())
    for name in ("math500", "aime2024", "aime2025", "amc23", "minerva"):
        b = res["benchmarks"][name]
        assert b["problems"] == 3 and b["pass@1"] == pytest.approx(2 / 3) and b["pass@k"] == pytest.approx(2 / 3), name
        assert [p["correct"] for p in res["problems"][name]] == [[1.0, 1.0], [0.0, 0.0], [1.0, 1.0]]
    assert res["mean"] == pytest.approx(2 / 3)
    assert "mean" in single.stdout and "66.67" in single.stdout
    two = run_py(["-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29523",
                  str(tmp_path / "planted_eval.py")] + flags + ["--eval-out", str(tmp_path / "two.json")], tmp_path)
    assert two.returncode == 0, two.stderr[-3000:]
    res2 = json.loads((tmp_path / "two.json").read_text())
    assert res2["benchmarks"] == res["benchmarks"] and res2["problems"] == res["problems"]


def test_zero_advantage_rows_have_exactly_zero_gradient():
    """The update skips a = 0 rows in the forward (graft.Trainer.update); that is exact only if every
    surrogate gives them exactly zero gradient, even off-policy, clipped or dual-clipped."""
    g = torch.Generator().manual_seed(5)
    lp = (torch.randn(3, 5, generator=g) - 2).requires_grad_(True)
    old = torch.randn(3, 5, generator=g) - 2
    adv = torch.tensor([0.0, 1.0, 0.0])
    mask = torch.ones(3, 5, dtype=torch.bool)
    for kw in ({}, {"dual_clip": 3.0}, {"ratio_level": "sequence"}):
        lp.grad = None
        policy_loss(logp=lp, old_logp=old, advantages=adv, mask=mask, **kw)[0].backward()
        assert torch.equal(lp.grad[0], torch.zeros(5)) and torch.equal(lp.grad[2], torch.zeros(5))
        assert lp.grad[1].abs().sum() > 0
    lp.grad = None
    baselines.luffy_peer_loss(lp, adv, mask)[0].backward()
    assert torch.equal(lp.grad[0], torch.zeros(5)) and lp.grad[1].abs().sum() > 0


def test_periodic_validation_keeps_the_best_checkpoint(tiny, tmp_path):
    args = [str(tiny / "planted.py"), "train", "--model", str(tiny / "ma"), "--out", str(tmp_path / "v"),
            "--eval-every", "1", "--benchmarks", str(tiny / "p.jsonl"), "--eval-samples", "2",
            "--eval-max-tokens", "8", "--eval-max-problems", "4"] + common_flags(tiny, steps=2)
    r = run_py(args, tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    ms = read_metrics(tmp_path / "v" / "metrics.jsonl")
    assert all("eval/p" in m and "eval/mean" in m for m in ms) and r.stdout.count("[eval] step") == 2
    best = tmp_path / "v" / "checkpoints" / "best"
    assert (best / "model.safetensors").is_file() and (best / "trainer_state.pt").is_file()
    state = torch.load(best / "trainer_state.pt", weights_only=True)
    assert state["best_eval_mean"] == pytest.approx(max(m["eval/mean"] for m in ms))


def test_flag_document_is_the_config():
    """FLAGS.md is generated from Config (config.flags_document); a changed flag must show there."""
    assert (ROOT / "docs" / "FLAGS.md").read_text(encoding="utf-8") == flags_document(), (
        "FLAGS.md is stale: python -c \"import config; print(config.flags_document(), end='')\" > docs/FLAGS.md")
    assert "[FLAGS.md](docs/FLAGS.md)" in (ROOT / "README.md").read_text(encoding="utf-8")


# ------------------------------------------------------------------------------------------------
# Stop strings (departure 11): the trainer's rollout and evaluation, the stored text, retokenisation, the flag
# ------------------------------------------------------------------------------------------------


def test_stop_strings_in_rollout_eval_and_retokenisation(tiny, tmp_path, monkeypatch):
    # The same step sampled without and with a stop string (the draws are a function of the seed, so the stopped
    # rows are the free ones cut): a row that holds the string keeps its tokens through the token that completes
    # it, its stored text ends with the string, its eos is False and the verifier reads the text cut before it; a
    # receiver retokenises that text, stop string included, with no EOS. Evaluation passes the strings too.
    import verify
    from transformers import AutoTokenizer
    read = []
    monkeypatch.setattr(verify, "verify_batch", lambda rs, gs, workers=0, **kw: read.extend(rs) or [0.0] * len(rs))
    cfg = Config(model=str(tiny / "ma"), prompts=str(tiny / "p.jsonl"), out=str(tmp_path / "run"), steps=1,
             prompts_per_step=8, n=4, max_response_tokens=16, prompt_template="{problem}=",
             save_responses=True, eval_max_tokens=16, reward_timeout=0)  # 0: the planted reward runs here, read fills
    tr = graft.Trainer(cfg)
    rows = batch_indices(16, 0, 8, 0)
    free, _, _ = tr.rollout(0, rows)
    stop = commonest_pair(free.texts)  # one token a character here: the string spans two tokens
    tr.cfg.stop = [stop]
    read.clear()
    own, _, _ = tr.rollout(0, rows)
    stopped = 0
    for r, (ft, t) in enumerate(zip(free.texts, own.texts)):
        k = ft.find(stop)
        if k < 0:
            assert (t, own.tokens[r], bool(own.eos.view(-1)[r])) == (ft, free.tokens[r], bool(free.eos.view(-1)[r]))
            assert read[r] == ft
            continue
        stopped += 1
        assert t == ft[: k + len(stop)] and own.tokens[r] == free.tokens[r][: k + len(stop)]  # one token a character
        assert not own.eos.view(-1)[r] and read[r] == ft[:k]
        assert torch.allclose(own.logprobs[r], free.logprobs[r][: len(own.tokens[r])], atol=1e-5)
        ids = retokenize(t, False, AutoTokenizer.from_pretrained(tiny / "mb"), max_response_tokens=16)
        assert ids[-1] != 1 and AutoTokenizer.from_pretrained(tiny / "mb").decode(ids) == t  # no EOS appended
    assert 0 < stopped < len(own.texts), f"want rows that stop on {stop!r} and rows that do not, got {stopped}"
    problems = tr.data[:4]
    tr.cfg.stop = []
    plain = evaluation.evaluate(tr.model, tr.tok, tr.stop_ids, problems, tr.cfg, DistInfo(), progress=False)
    plain = [x for p in plain for x in p["responses"]]
    tr.cfg.stop = [commonest_pair(plain)]
    cut = evaluation.evaluate(tr.model, tr.tok, tr.stop_ids, problems, tr.cfg, DistInfo(), progress=False)
    got = [x for p in cut for x in p["responses"]]
    assert got == [verifier_text(x, tr.cfg.stop) for x in plain] and got != plain


def commonest_pair(texts):
    """The commonest two-character string of the texts (ties: the first in sorted order)."""
    pairs = {}
    for t in texts:
        for j in range(len(t) - 1):
            pairs[t[j : j + 2]] = pairs.get(t[j : j + 2], 0) + 1
    return max(sorted(pairs), key=pairs.get)


def test_stop_flag_is_repeatable_and_checked():
    args = build_parser().parse_args(["train", "--model", "m", "--stop", "\n\n", "--stop", "Q:"])
    assert args.stop == ["\n\n", "Q:"] and build_parser().parse_args(["train", "--model", "m"]).stop == []
    with pytest.raises(ValueError, match="--stop"):
        validate_config(Config(model="m", stop=["Q:", ""]))
    from tools import preflight
    pre = preflight.build_parser().parse_args(["--model-a", "a", "--model-b", "b", "--prompts", "p", "--stop", "Q:"])
    assert pre.stop == ["Q:"]
    # the text of a stopped row: through the first stop string (the token's overhang dropped), eos False; the
    # verifier's text is cut before it; an EOS row without a stop string is untouched
    class Chars:
        def decode(self, ids, **kw):
            return "".join(chr(i) for i in ids)
    text, eos = decode_response([ord(c) for c in " 12\n\nQ"], Chars(), eos_token_ids=0, stop=["Q:", "\n\n"])
    assert (text, eos, verifier_text(text, ["Q:", "\n\n"])) == (" 12\n\n", False, " 12")
    assert decode_response([ord("7"), 0], Chars(), eos_token_ids=0, stop=["Q:"]) == ("7", True)
