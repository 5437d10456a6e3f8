"""Tests for sampler.token_logprobs' structure: the logits kept for the backward (departure 15)
against recomputing them, and the host-side work of a pass, counted.

Tolerances: float32 against the float64 log_softmax gather: log-probs |err| < 1e-5, gradients max |err| / max |ref|
< 2e-5 (test_sampler.py's); kept vs recomputed logits: the same tiles in the same dtype, so within 1e-6 relative
(a matmul over all rows and one over a chunk of them may round differently); bf16 autocast: errors at most 1.25x
the naive path's, as in test_sampler.py. The op counts are exact (on a GPU the host's calls, not the arithmetic, set
a small tile's pace).
"""

import collections

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from sampler import token_logprobs

torch.set_num_threads(1)


# ------------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------------


def reference(hidden, weight, targets, upstream, temperature=1.0):
    """float64 log_softmax(h @ W.T / T).gather and its gradients under the upstream weights: (N,), (N, H), (V, H)."""
    h = hidden.detach().double().requires_grad_(True)
    w = weight.detach().double().requires_grad_(True)
    lp = torch.log_softmax(h @ w.T / temperature, dim=-1).gather(1, targets[:, None])[:, 0]  # (N,)
    (lp * upstream).sum().backward()
    return lp.detach(), h.grad, w.grad


def ours(hidden, weight, targets, upstream, **kw):
    """token_logprobs' values and gradients (float64 copies) under the upstream weights."""
    h = hidden.detach().clone().requires_grad_(True)
    w = weight.detach().clone().requires_grad_(True)
    lp = token_logprobs(h, w, targets, **kw)  # (N,)
    (lp.double() * upstream).sum().backward()
    return lp.detach().double(), h.grad.double(), w.grad.double()


def max_rel(got, want):
    return ((got - want).abs().max() / want.abs().max()).item()


def problem(n=45, h=24, v=211, seed=0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=gen) * 2  # logits of size ~10: a peaked softmax
    weight = torch.randn(v, h, generator=gen)
    targets = torch.randint(0, v, (n,), generator=gen)
    upstream = torch.randn(n, generator=gen, dtype=torch.float64)
    return hidden, weight, targets, upstream


class Ops(TorchDispatchMode):
    """aten calls by name, and the elements of `weight` (or of views of it) cast to another dtype."""

    def __init__(self, weight):
        super().__init__()
        self.weight, self.calls, self.w_cast = weight, collections.Counter(), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls[str(func)] += 1
        if str(func) == "aten._to_copy.default" and (args[0] is self.weight or args[0]._base is self.weight):
            self.w_cast += args[0].numel()
        return func(*args, **(kwargs or {}))


# ------------------------------------------------------------------------------------------------
# kept logits vs recomputed, against float64
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("save", [True, False])
@pytest.mark.parametrize("chunks", [dict(chunk_size=8, vocab_chunk_size=50),  # 45 % 8, 211 % 50: ragged tiles
                                    dict(chunk_size=45, vocab_chunk_size=211), dict(chunk_size=1000)])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_float32_matches_float64_log_softmax_both_ways(save, chunks, temperature):
    hidden, weight, targets, upstream = problem()
    got = ours(hidden, weight, targets, upstream, temperature=temperature, save_logits=save, **chunks)
    ref = reference(hidden, weight, targets, upstream, temperature)
    assert (got[0] - ref[0]).abs().max() < 1e-5
    assert max_rel(got[1], ref[1]) < 2e-5 and max_rel(got[2], ref[2]) < 2e-5


@pytest.mark.parametrize("head", [dict(), dict(softcap=5.0), dict(logit_scale=0.5, softcap=8.0, temperature=1.3)])
def test_kept_logits_give_the_recomputed_gradients(head):
    hidden, weight, targets, upstream = problem(seed=1)
    a = ours(hidden, weight, targets, upstream, chunk_size=16, vocab_chunk_size=64, save_logits=True, **head)
    b = ours(hidden, weight, targets, upstream, chunk_size=16, vocab_chunk_size=64, save_logits=False, **head)
    assert torch.equal(a[0], b[0]), "the forward is the same tiles either way"
    assert max_rel(a[1], b[1]) < 1e-6 and max_rel(a[2], b[2]) < 1e-6


def test_masked_positions_zero_gradient():
    # the trainer masks padding and ignored positions after the kernel: their upstream gradient is 0, and they
    # must contribute nothing, whatever their (valid) target id
    hidden, weight, targets, upstream = problem(seed=2)
    upstream[::3] = 0.0
    got = ours(hidden, weight, targets, upstream, chunk_size=8, vocab_chunk_size=40, save_logits=True)
    keep = upstream != 0
    ref = reference(hidden[keep], weight, targets[keep], upstream[keep])
    assert torch.equal(got[1][~keep], torch.zeros_like(got[1][~keep]))
    assert max_rel(got[1][keep], ref[1]) < 2e-5 and max_rel(got[2], ref[2]) < 2e-5


@pytest.mark.parametrize("save", [True, False])
def test_ignore_index_targets_with_zero_gradient_add_nothing(save):
    # -100 (and ids past V) at masked positions: no error, and with a zero upstream gradient there no contribution
    hidden, weight, targets, upstream = problem(seed=4)
    bad = torch.zeros_like(targets, dtype=torch.bool)
    bad[::4] = True
    targets = targets.clone()
    targets[::8] = -100
    targets[4::8] = weight.shape[0] + 7
    upstream[bad] = 0.0
    got = ours(hidden, weight, targets, upstream, chunk_size=8, vocab_chunk_size=50, save_logits=save)
    ref = reference(hidden[~bad], weight, targets[~bad], upstream[~bad])
    assert (got[0][~bad] - ref[0]).abs().max() < 1e-5
    assert torch.equal(got[1][bad], torch.zeros_like(got[1][bad]))
    assert max_rel(got[1][~bad], ref[1]) < 2e-5 and max_rel(got[2], ref[2]) < 2e-5


def test_second_backward_with_retain_graph_recomputes():
    # the first backward writes the gradient over the kept logits; a second one (retain_graph) must not read them
    hidden, weight, targets, upstream = problem(seed=3)
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    lp = token_logprobs(h, w, targets, chunk_size=8, vocab_chunk_size=50, save_logits=True)
    loss = (lp.double() * upstream).sum()
    loss.backward(retain_graph=True)
    first = (h.grad.clone(), w.grad.clone())
    h.grad = w.grad = None
    loss.backward()
    assert max_rel(h.grad.double(), first[0].double()) < 1e-6 and max_rel(w.grad.double(), first[1].double()) < 1e-6
    ref = reference(hidden, weight, targets, upstream)
    assert max_rel(h.grad.double(), ref[1]) < 2e-5


def test_gradcheck_recomputing():
    gen = torch.Generator().manual_seed(5)
    hidden = torch.randn(6, 4, dtype=torch.float64, generator=gen, requires_grad=True)
    weight = torch.randn(9, 4, dtype=torch.float64, generator=gen, requires_grad=True)
    targets = torch.tensor([0, 8, 3, 3, 5, 7])
    fn = lambda a, b: token_logprobs(a, b, targets, softcap=3.0, chunk_size=4, vocab_chunk_size=4,  # noqa: E731
                                     save_logits=False)
    assert torch.autograd.gradcheck(fn, (hidden, weight))


@pytest.mark.parametrize("save", [True, False])
def test_bf16_autocast_no_worse_than_naive(save):
    gen = torch.Generator().manual_seed(0)
    n, h, v = 200, 48, 3000
    hidden = torch.randn(n, h, generator=gen) * 8  # confident rows, as a trained model's
    weight = torch.randn(v, h, generator=gen) / h**0.5
    targets = torch.randint(0, v, (n,), generator=gen)
    upstream = torch.randn(n, generator=gen, dtype=torch.float64)
    ref = reference(hidden, weight, targets, upstream)

    def run(fn):
        a, b = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            lp = fn(a, b)
        (lp.double() * upstream).sum().backward()
        return lp.detach().double(), a.grad.double(), b.grad.double()

    got = run(lambda a, b: token_logprobs(a, b, targets, chunk_size=64, vocab_chunk_size=700, save_logits=save))
    base = run(lambda a, b: torch.log_softmax((a @ b.T).float(), -1).gather(1, targets[:, None])[:, 0])
    for name, g, b, r in zip(("values", "grad hidden", "grad weight"), got, base, ref):
        e_ours, e_naive = ((g - r).norm() / r.norm()).item(), ((b - r).norm() / r.norm()).item()
        assert e_naive > 1e-4, f"{name}: autocast had no effect"
        assert e_ours <= 1.25 * e_naive, f"{name}: {e_ours:.2e} vs naive {e_naive:.2e}"


# ------------------------------------------------------------------------------------------------
# What a pass keeps, and the host-side work it does
# ------------------------------------------------------------------------------------------------


def test_logits_kept_only_when_a_gradient_will_be_needed():
    hidden, weight, targets, _ = problem(n=30, v=97)
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    kept = token_logprobs(h, w, targets, chunk_size=8, vocab_chunk_size=40, save_logits=True).grad_fn.blocks
    assert sum(b.numel() for b in kept) == 30 * 97 and all(b.dtype == torch.float32 for b in kept)
    assert token_logprobs(h, w, targets).grad_fn.blocks is None, "float32 (4 bytes a logit): recompute by default"
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the GPU trainer's regime: kept, 2 bytes a logit
        kept = token_logprobs(h, w, targets).grad_fn.blocks
        assert sum(b.numel() for b in kept) == 30 * 97 and all(b.dtype == torch.bfloat16 for b in kept)
        assert token_logprobs(h, w, targets, save_logits=False).grad_fn.blocks is None
    with torch.no_grad():  # the behaviour pass keeps nothing
        assert token_logprobs(h, w, targets).grad_fn is None
    assert token_logprobs(hidden, weight, targets).grad_fn is None


@pytest.mark.parametrize("save,matmuls_per_slice", [(True, 3), (False, 4)])
def test_host_work_per_pass(save, matmuls_per_slice):
    # W is cast once per pass (a slice at a time, never once per tile), and the matmuls are three per vocabulary
    # slice with kept logits (forward, grad W, grad h: the naive path's three, sliced), four when recomputing.
    # A kernel with per-tile casts and launches measured 3.1x the naive path's time on an H200.
    n, h, v, chunk, vchunk = 64, 16, 500, 16, 128  # 4 row chunks, 4 vocabulary slices (the last 116 wide)
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(n, h, generator=gen).requires_grad_(True)
    weight = torch.randn(v, h, generator=gen).requires_grad_(True)
    targets = torch.randint(0, v, (n,), generator=gen)
    ops = Ops(weight)
    with ops:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            lp = token_logprobs(hidden, weight, targets, chunk_size=chunk, vocab_chunk_size=vchunk, save_logits=save)
        lp.sum().backward()
    assert ops.w_cast == 2 * v * h, f"W cast {ops.w_cast / (v * h)} times, want once per pass"
    slices, groups = 4, (1 if save else 4)
    assert ops.calls["aten.mm.default"] + ops.calls["aten.addmm_.default"] == matmuls_per_slice * slices * groups
    assert ops.calls["aten.exp_.default"] == 2 * slices * (n // chunk), "one exp per tile and pass"
