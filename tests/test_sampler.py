"""Tests for sampler.py: chunked log-probs against a float64 reference, response_logprobs against transformers' own
full-logits forward, and the hand-written sampler against transformers' generate.

Tolerances (stated once here, used below):
* float32 inputs vs the float64 naive reference: log-probs |err| < 2e-5, gradients |err| / |grad| < 2e-5 (max abs
  error over the gradient's max abs value); float32 round-off on logits of size ~10 is ~1e-6.
* bf16 inputs vs the float64 reference on the same (bf16-rounded) inputs: log-probs |err| < 3e-2, gradients
  |err| / |grad| < 3e-2: the logits matmul rounds its output to bf16 (8 mantissa bits, ~0.4% of a logit).
* sampler log-probs vs a fresh forward pass: |err| < 1e-5 (different batch shapes, same float32 arithmetic).
* every architecture (tiny random configs of 23 families and variants, heads that scale or soft-cap their logits,
  sliding-window layers): greedy tokens identical to generate's, with and without refills; response_logprobs and the
  sampler's log-probs vs the log-softmax of the model's own float32 logits: |err| < 1e-5; gradients through a
  transformed head vs autograd of transformers' forward: |err| / |grad| < 1e-4, as for plain heads.
* stop strings (departure 12): greedy rows token-identical to generate(stop_strings=..., tokenizer=...) and to the
  naive reference (the first prefix whose decoded text holds a string) on every architecture, each with one of the
  real Qwen3 / SmolLM3 / Llama-3.2 tokenizers of ../shared (skipped where absent), whole batch, refills, shared
  prompts and the static path; one string inside a first token and one split across two tokens.
* sampling frequencies vs softmax(logits / T): total variation < 0.03 over 20,000 draws of a 16-token vocabulary
  (the expected TV from sampling noise alone is about 0.01).
* bf16 autocast (CPU autocast emulates the GPU trainer: forward under autocast, backward outside it): the errors of
  token_logprobs / response_logprobs against a float32/float64 reference (||err|| / ||ref||, values and gradients)
  are at most 1.25x the error of the naive full-logits path under the same autocast (measured: 0.98-1.01x; the
  code before the fix was 1.3-4.8x on these cases). The sampler's behaviour log-probs and the training forward's,
  both under bf16: mean |diff| < 0.02 nats and max |diff| < 0.25 nats (measured 0.007 and 0.17 on the confident
  tiny model used: two bf16 evaluations of one network through different kernels and batch shapes; the same model's
  bf16 log-probs are themselves up to 0.5 nats from float32).
"""

import functools
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

import sampler
from sampler import Rollout, response_logprobs, sample, token_logprobs

torch.set_num_threads(1)  # the CI box is shared; one thread is also the fastest for these tiny shapes


# ------------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------------


def naive_logprobs(hidden, weight, targets, temperature=1.0):
    """The float64 reference: (N, H), (V, H), (N,) -> (N,) float64, through full (N, V) logits."""
    logits = hidden.double() @ weight.double().T / temperature  # (N, V)
    return torch.log_softmax(logits, dim=-1).gather(1, targets.unsqueeze(1)).squeeze(1)  # (N,)


def ours_and_reference(hidden, weight, targets, temperature, **chunks):
    """Values and both gradients under a random upstream gradient, for token_logprobs and the float64 reference."""
    upstream = torch.randn(hidden.shape[0], dtype=torch.float64)  # (N,): not all-ones, so row weighting is tested
    h = hidden.detach().clone().requires_grad_(True)
    w = weight.detach().clone().requires_grad_(True)
    ours = token_logprobs(h, w, targets, temperature=temperature, **chunks)
    (ours.double() * upstream).sum().backward()
    h64 = hidden.detach().double().requires_grad_(True)
    w64 = weight.detach().double().requires_grad_(True)
    ref = naive_logprobs(h64, w64, targets, temperature)
    (ref * upstream).sum().backward()
    return (ours, h.grad, w.grad), (ref, h64.grad, w64.grad)


def rel_err(got, want):
    """Max abs error relative to the reference's max abs value."""
    return ((got.double() - want).abs().max() / want.abs().max()).item()


def tiny_model(kind, *, vocab=128, tie=False, seed=0, head_scale=1.0, attn="sdpa"):
    """A tiny randomly initialised causal LM (hidden 64, 2 layers). Weights are drawn wider than transformers'
    default (std 0.02) so that the logits are well separated: greedy comparisons then never hinge on ties."""
    common = dict(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=tie, pad_token_id=0,
        bos_token_id=None, eos_token_id=None,
    )
    cfg = LlamaConfig(**common) if kind == "llama" else Qwen3Config(head_dim=16, **common)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.2)
        if head_scale != 1.0:
            model.get_output_embeddings().weight.mul_(head_scale)
    return model.eval()


def left_pad(prompts, pad):
    """(B, P) left-padded ids and their attention mask, as generate expects them."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


def generate_responses(model, prompts, *, max_new_tokens, eos, pad=0):
    """transformers' greedy generate, cut per row after its first EOS (generate pads finished rows)."""
    ids, mask = left_pad(prompts, pad)
    out = model.generate(
        ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos,
        pad_token_id=pad,
    )[:, ids.shape[1] :].tolist()
    cut = []
    for row in out:
        stop = next((k for k, t in enumerate(row) if t in eos), None)
        cut.append(row if stop is None else row[: stop + 1])
    return cut


PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14, 15, 16], [3], [40, 41, 42, 43], [77, 2, 91, 100, 12]]


# ------------------------------------------------------------------------------------------------
# token_logprobs
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [1.0, 0.6, 1.7])
def test_token_logprobs_matches_float64_reference(temperature):
    torch.manual_seed(1)
    n, h, v = 53, 32, 301  # 53 tokens in chunks of 16, 301 vocab rows in chunks of 64: neither divides evenly
    hidden = torch.randn(n, h) * 2
    weight = torch.randn(v, h)  # logits of size ~10: a peaked softmax, not a flat one
    targets = torch.randint(0, v, (n,))
    (lp, gh, gw), (rlp, rgh, rgw) = ours_and_reference(
        hidden, weight, targets, temperature, chunk_size=16, vocab_chunk_size=64
    )
    assert lp.dtype == torch.float32 and gh.dtype == torch.float32 and gw.dtype == torch.float32
    assert (lp.double() - rlp).abs().max() < 2e-5
    assert rel_err(gh, rgh) < 2e-5 and rel_err(gw, rgw) < 2e-5


@pytest.mark.parametrize("chunks", [dict(), dict(chunk_size=1), dict(chunk_size=7, vocab_chunk_size=1000)])
def test_token_logprobs_chunking_choices(chunks):
    # default (one tile), one token per chunk, and a vocabulary chunk larger than V all give the same answer
    torch.manual_seed(2)
    hidden, weight, targets = torch.randn(20, 16), torch.randn(97, 16), torch.randint(0, 97, (20,))
    (lp, gh, gw), (rlp, rgh, rgw) = ours_and_reference(hidden, weight, targets, 1.0, **chunks)
    assert (lp.double() - rlp).abs().max() < 2e-5
    assert rel_err(gh, rgh) < 2e-5 and rel_err(gw, rgw) < 2e-5


def test_token_logprobs_all_negative_logits():
    # every logit is in about [-300, -100]: a log-sum-exp that started its running max at 0 would underflow to -inf
    torch.manual_seed(3)
    hidden = torch.rand(30, 8) + 1.0  # positive
    weight = -(torch.rand(50, 8) * 10 + 10)  # negative: every logit is negative and large
    targets = torch.randint(0, 50, (30,))
    (lp, gh, gw), (rlp, rgh, rgw) = ours_and_reference(
        hidden, weight, targets, 1.0, chunk_size=8, vocab_chunk_size=16
    )
    assert torch.isfinite(lp).all()
    assert (hidden @ weight.T).max() < -50
    assert (lp.double() - rlp).abs().max() < 2e-5 * max(1.0, rlp.abs().max().item())
    assert rel_err(gh, rgh) < 2e-5 and rel_err(gw, rgw) < 2e-5


def test_token_logprobs_bf16_inputs():
    torch.manual_seed(4)
    hidden = torch.randn(40, 32).bfloat16()
    weight = (torch.randn(130, 32) / 32**0.5).bfloat16()  # logits ~ N(0, 1), as for a real lm_head
    targets = torch.randint(0, 130, (40,))
    (lp, gh, gw), (rlp, rgh, rgw) = ours_and_reference(
        hidden, weight, targets, 0.6, chunk_size=16, vocab_chunk_size=48
    )
    assert lp.dtype == torch.float32, "log-probs are float32 whatever the input dtype"
    assert gh.dtype == torch.bfloat16 and gw.dtype == torch.bfloat16, "gradients come back in the input dtypes"
    assert (lp.double() - rlp).abs().max() < 3e-2
    assert rel_err(gh, rgh) < 3e-2 and rel_err(gw, rgw) < 3e-2


def test_token_logprobs_gradcheck():
    torch.manual_seed(5)
    hidden = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(7, 4, dtype=torch.float64, requires_grad=True)
    targets = torch.tensor([0, 6, 3, 3, 5])
    fn = lambda h, w: token_logprobs(h, w, targets, temperature=0.8, chunk_size=2, vocab_chunk_size=3)
    assert torch.autograd.gradcheck(fn, (hidden, weight))


def test_token_logprobs_empty_and_frozen_weight():
    weight = torch.randn(11, 4, requires_grad=True)
    hidden = torch.zeros(0, 4, requires_grad=True)
    out = token_logprobs(hidden, weight, torch.zeros(0, dtype=torch.long))
    out.sum().backward()
    assert out.shape == (0,) and torch.equal(weight.grad, torch.zeros_like(weight))
    # a frozen head: only the hidden gradient is computed, and it is still right
    hidden = torch.randn(6, 4, requires_grad=True)
    frozen = weight.detach()
    targets = torch.randint(0, 11, (6,))
    token_logprobs(hidden, frozen, targets, chunk_size=4).sum().backward()
    ref_h = hidden.detach().double().requires_grad_(True)
    naive_logprobs(ref_h, frozen, targets).sum().backward()
    assert rel_err(hidden.grad, ref_h.grad) < 2e-5


# ------------------------------------------------------------------------------------------------
# response_logprobs
# ------------------------------------------------------------------------------------------------


def naive_response_logprobs(model, prompts, responses, temperature):
    """Row by row through transformers' own forward (full logits, lm_head included): list of (len(r),) tensors."""
    out = []
    for p, r in zip(prompts, responses):
        ids = torch.tensor([p + r])
        logits = model(input_ids=ids).logits[0, len(p) - 1 : len(p) - 1 + len(r)].float() / temperature  # (len(r), V)
        out.append(torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(r).unsqueeze(1)).squeeze(1))
    return out


@pytest.mark.parametrize("kind,tie", [("llama", True), ("qwen3", False)])
def test_response_logprobs_matches_full_logits_forward_and_grads(kind, tie):
    # tied embeddings (llama case): the lm_head weight is the input embedding's Parameter, so its gradient is the sum
    # of the embedding-lookup gradient and token_logprobs' gradient; autograd must add them exactly as the naive path
    model = tiny_model(kind, tie=tie, seed=6)
    assert (model.get_output_embeddings().weight is model.get_input_embeddings().weight) == tie
    prompts = [[5, 6, 7], [8, 9], [3, 4, 5, 6, 7, 8], [11]]
    responses = [[20, 21, 22, 23], [], [30], [40, 41, 42, 43, 44, 45, 46]]  # an empty response, varied lengths
    temperature = 0.7
    torch.manual_seed(7)
    upstream = torch.randn(4, 7)  # (B, T) random weights per token, as a policy loss would give

    logp, mask = response_logprobs(model, prompts, responses, pad_token_id=0, temperature=temperature, chunk_size=5)
    assert logp.shape == (4, 7) and mask.shape == (4, 7) and logp.dtype == torch.float32 and mask.dtype == torch.bool
    assert mask.sum(1).tolist() == [4, 0, 1, 7] and (logp[~mask] == 0).all()
    (logp * upstream).sum().backward()
    ours = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()

    ref = naive_response_logprobs(model, prompts, responses, temperature)
    sum((r * upstream[i, : len(r)]).sum() for i, r in enumerate(ref)).backward()
    for i, r in enumerate(ref):
        assert torch.allclose(logp[i, : len(r)], r, atol=1e-5), f"row {i}"
    for n, p in model.named_parameters():
        assert rel_err(ours[n], p.grad.double()) < 1e-4, n


def test_response_logprobs_all_empty_and_bad_ids():
    model = tiny_model("qwen3", seed=8)
    logp, mask = response_logprobs(model, [[1, 2], [3]], [[], []], pad_token_id=0)
    assert logp.shape == (2, 0) and mask.shape == (2, 0)
    with pytest.raises(ValueError, match="outside"):
        response_logprobs(model, [[1, 2]], [[5, 128]], pad_token_id=0)


# ------------------------------------------------------------------------------------------------
# sample
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind,attn", [("llama", "sdpa"), ("qwen3", "sdpa"), ("qwen3", "eager")])
def test_greedy_matches_generate_with_early_eos(kind, attn):
    # sdpa models get sample()'s ready 4D mask, eager ones the 2D mask through transformers' mask builder
    model = tiny_model(kind, seed=9, attn=attn)
    assert model.config._attn_implementation == attn
    # pick EOS ids from the greedy path itself so that some rows stop early and others run to the cap
    free = sample(model, PROMPTS, max_new_tokens=16, temperature=0, eos_token_id=1000)
    eos = [free[0].tokens[2], free[3].tokens[5]]
    ours = sample(model, PROMPTS, max_new_tokens=16, temperature=0, eos_token_id=eos, pad_token_id=0)
    ended = [r.ended_with_eos for r in ours]
    assert any(ended) and not all(ended), f"the test needs a mix of finished and capped rows, got {ended}"
    assert min(len(r.tokens) for r in ours) <= 6
    theirs = generate_responses(model, PROMPTS, max_new_tokens=16, eos=eos)
    assert [r.tokens for r in ours] == theirs
    for r in ours:
        assert r.ended_with_eos == (r.tokens[-1] in eos) and (r.ended_with_eos or len(r.tokens) == 16)
        assert r.logprobs.shape == (len(r.tokens),) and r.logprobs.dtype == torch.float32
        assert not r.logprobs.is_inference(), "rollout tensors must be usable in autograd later"
    # greedy log-probs are the temperature-1 ones, and they agree with a fresh forward pass
    logp, mask = response_logprobs(model, PROMPTS, [r.tokens for r in ours], pad_token_id=0, temperature=1.0)
    assert torch.allclose(logp[mask], torch.cat([r.logprobs for r in ours]), atol=1e-5)


@pytest.mark.parametrize("sync_every", [1, 4, 8])
def test_finished_rows_leave_the_batch(sync_every):
    # departure 16: the host reads which rows ended every sync_every steps, so a row that ends at its n-th token
    # leaves the batch at the first read at or after step n (reads at multiples of sync_every, and once every row
    # has drawn the cap); sync_every=1 is the old schedule, each row fed to exactly len - 1 decode steps
    model = tiny_model("qwen3", seed=9)
    free = sample(model, PROMPTS, max_new_tokens=16, temperature=0, eos_token_id=1000)
    eos = [free[0].tokens[2], free[3].tokens[5]]
    seen = []
    base = model.model
    hook = base.register_forward_pre_hook(lambda mod, args, kw: seen.append(kw["input_ids"].shape[0]), with_kwargs=True)
    try:
        stats = {}
        ours = sample(model, PROMPTS, max_new_tokens=16, temperature=0, eos_token_id=eos, sync_every=sync_every,
                      stats=stats)
    finally:
        hook.remove()
    assert [r.tokens for r in ours] == [r.tokens[: len(o.tokens)] for r, o in zip(free, ours)]
    assert sorted({len(r.tokens) for r in ours}) == [3, 6, 16], "two rows end at EOS, the rest at the cap"
    left = [min(-(-len(r.tokens) // sync_every) * sync_every, 16) for r in ours]  # the step each row leaves at
    expected = [len(PROMPTS)] + [sum(x > s for x in left) for s in range(1, 16)]  # the prefill, then decode steps
    assert seen == [n for n in expected if n > 0]
    assert seen[-1] < seen[0]
    assert stats["decode_steps"] == len(seen) - 1
    # reads: at every multiple of sync_every that has rows left, and at step 16 (every row at the cap)
    assert stats["host_reads"] == len({s for s in range(sync_every, 16, sync_every) if s <= max(left)} | {16})


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.9)])
def test_sampled_logprobs_match_fresh_forward(temperature, top_p):
    model = tiny_model("llama", seed=10)
    gen = torch.Generator().manual_seed(0)
    ours = sample(model, PROMPTS * 3, max_new_tokens=12, temperature=temperature, top_p=top_p, eos_token_id=[1, 2],
                  generator=gen)
    assert all(isinstance(r, Rollout) for r in ours) and len(ours) == 15
    logp, mask = response_logprobs(model, PROMPTS * 3, [r.tokens for r in ours], pad_token_id=0,
                                   temperature=temperature)
    assert torch.allclose(logp[mask], torch.cat([r.logprobs for r in ours]), atol=1e-5)


def first_token_probs(model, prompt, temperature):
    """softmax(logits / T) of the first response token, from transformers' own forward: (V,) float64."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt])).logits[0, -1].double()  # (V,)
    return torch.softmax(logits / temperature, dim=-1)


def test_sampling_distribution_matches_softmax():
    model = tiny_model("qwen3", vocab=16, seed=11, head_scale=0.5)
    prompt, temperature, n = [3, 4, 5], 0.8, 20_000
    want = first_token_probs(model, prompt, temperature)
    assert want.max() < 0.6 and (want > 0.01).sum() >= 6, "want a spread-out distribution for a meaningful check"
    rolls = sample(model, [prompt] * n, max_new_tokens=1, temperature=temperature, eos_token_id=0,
                   generator=torch.Generator().manual_seed(1))
    counts = torch.bincount(torch.tensor([r.tokens[0] for r in rolls]), minlength=16).double()
    tv = 0.5 * (counts / n - want).abs().sum().item()
    assert tv < 0.03, f"total variation {tv:.4f}"


def test_top_p_stays_inside_the_nucleus():
    model = tiny_model("qwen3", vocab=16, seed=11, head_scale=0.5)
    prompt, temperature, top_p, n = [3, 4, 5], 0.8, 0.7, 5_000
    probs = first_token_probs(model, prompt, temperature)
    order = probs.argsort(descending=True)
    k = int((probs[order].cumsum(0) < top_p).sum()) + 1  # smallest prefix of most likely tokens with mass >= top_p
    nucleus = set(order[:k].tolist())
    assert 1 < k < 16
    rolls = sample(model, [prompt] * n, max_new_tokens=3, temperature=temperature, top_p=top_p, eos_token_id=0,
                   generator=torch.Generator().manual_seed(2))
    firsts = torch.tensor([r.tokens[0] for r in rolls])
    assert set(firsts.tolist()) <= nucleus
    # frequencies inside the nucleus follow the renormalised distribution
    want = torch.zeros(16, dtype=torch.float64)
    want[order[:k]] = probs[order[:k]] / probs[order[:k]].sum()
    tv = 0.5 * (torch.bincount(firsts, minlength=16).double() / n - want).abs().sum().item()
    assert tv < 0.05, f"total variation {tv:.4f}"
    # later tokens too: check each one against the nucleus of its own context, from a fresh forward pass
    for r in rolls[:50]:
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt + r.tokens])).logits[0, len(prompt) - 1 :].double()
        p = torch.softmax(logits / temperature, dim=-1)  # (len(tokens) + 1, V)
        for s, tok in enumerate(r.tokens):
            srt = p[s].sort(descending=True)
            mass_before = srt.values.cumsum(0) - srt.values
            allowed = set(srt.indices[mass_before < top_p].tolist())
            assert tok in allowed, f"token {tok} at step {s} is outside the nucleus {allowed}"


def test_same_seed_same_samples():
    model = tiny_model("llama", seed=12)
    run = lambda seed: sample(model, PROMPTS, max_new_tokens=10, temperature=1.0, top_p=0.95, eos_token_id=[1, 2],
                              generator=torch.Generator().manual_seed(seed))
    a, b, c = run(3), run(3), run(4)
    assert [r.tokens for r in a] == [r.tokens for r in b]
    assert all(torch.equal(x.logprobs, y.logprobs) for x, y in zip(a, b))
    assert [r.tokens for r in a] != [r.tokens for r in c]


def test_sample_restores_training_mode_and_eos_on_last_step():
    model = tiny_model("llama", seed=9).train()
    free = sample(model, PROMPTS, max_new_tokens=6, temperature=0, eos_token_id=1000)
    assert model.training, "sample() must put the model back in the mode it found it in"
    last = free[1].tokens[-1]
    rolls = sample(model, PROMPTS, max_new_tokens=6, temperature=0, eos_token_id=last)
    assert rolls[1].ended_with_eos and len(rolls[1].tokens) <= 6 and rolls[1].tokens[-1] == last


# ------------------------------------------------------------------------------------------------
# mixed precision: the GPU trainer's bf16 autocast, emulated with CPU autocast
# ------------------------------------------------------------------------------------------------


def rel_norm_err(got, want):
    """||got - want|| / ||want|| in float64: the size of a bf16 error relative to the quantity."""
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


def bf16_naive_logprobs(hidden, weight, targets, temperature):
    """The naive path as the GPU runs it under bf16 autocast: bf16 logits matmul, log_softmax in float32 (CUDA
    autocast upcasts log_softmax; CPU autocast would keep it bf16, so the upcast is written out here)."""
    logits = (hidden @ weight.T).float() / temperature  # (N, V)
    return torch.log_softmax(logits, dim=-1).gather(1, targets.unsqueeze(1)).squeeze(1)  # (N,)


def values_and_grads(fn, hidden, weight, upstream, *, autocast):
    """fn(h, w) forward under bf16 autocast (or in float64 without it), backward OUTSIDE autocast as the trainer's
    loss.backward() runs: (values, grad hidden, grad weight), all float64."""
    h = (hidden if autocast else hidden.double()).detach().clone().requires_grad_(True)
    w = (weight if autocast else weight.double()).detach().clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = fn(h, w)
    (out.double() * upstream).sum().backward()
    return out.detach().double(), h.grad.double(), w.grad.double()


@pytest.mark.parametrize("n,h,v,temperature,chunk,vchunk", [
    (256, 64, 4096, 1.0, 64, 1000),  # the issue's shape; 4096 % 1000 != 0
    (300, 32, 1000, 0.6, 128, 384),  # 300 % 128 != 0, 1000 % 384 != 0
    (97, 48, 3001, 1.7, 32, 512),
])
def test_token_logprobs_under_bf16_autocast_no_worse_than_naive(n, h, v, temperature, chunk, vchunk):
    # Confident rows (logits / T of size ~8, as a trained model's): the case where a backward that recomputed the
    # tiles in float32 against a bf16 log-sum-exp was worst, since exp(z - lse) then misses 1 by ~|z| * 2**-8.
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(n, h, generator=gen) * 8 * temperature  # (N, H) float32 master copies, as in the trainer
    weight = torch.randn(v, h, generator=gen) / h**0.5  # (V, H)
    targets = torch.randint(0, v, (n,), generator=gen)  # (N,)
    upstream = torch.randn(n, generator=gen, dtype=torch.float64)  # (N,)
    ours = lambda a, b: token_logprobs(a, b, targets, temperature=temperature, chunk_size=chunk,
                                       vocab_chunk_size=vchunk)
    naive = lambda a, b: bf16_naive_logprobs(a, b, targets, temperature)
    ref = values_and_grads(naive, hidden, weight, upstream, autocast=False)  # float64 throughout
    got = values_and_grads(ours, hidden, weight, upstream, autocast=True)
    base = values_and_grads(naive, hidden, weight, upstream, autocast=True)
    for name, g, b, r in zip(("log-probs", "grad hidden", "grad weight"), got, base, ref):
        e_ours, e_naive = rel_norm_err(g, r), rel_norm_err(b, r)
        assert e_naive > 1e-4, f"{name}: autocast had no effect ({e_naive:.1e}), the test would prove nothing"
        assert e_ours <= 1.25 * e_naive, f"{name}: error {e_ours:.2e} vs naive {e_naive:.2e} under bf16 autocast"


def test_token_logprobs_backward_ignores_the_callers_autocast_state():
    # the same forward, its backward run outside autocast and inside it: identical gradients (the kernel fixes its
    # matmul dtype at forward time instead of inheriting whatever autocast state the backward runs under)
    gen = torch.Generator().manual_seed(1)
    hidden, weight = torch.randn(40, 16, generator=gen) * 6, torch.randn(90, 16, generator=gen) / 4
    targets = torch.randint(0, 90, (40,), generator=gen)
    grads = []
    for backward_in_autocast in (False, True):
        h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = token_logprobs(h, w, targets, chunk_size=16, vocab_chunk_size=32)
            if backward_in_autocast:
                out.sum().backward()
        if not backward_in_autocast:
            out.sum().backward()
        grads.append((h.grad, w.grad))
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])


def full_logits_response_logprobs(model, prompts, responses, temperature):
    """transformers' own forward (lm_head included) on the same right-padded batch response_logprobs builds, then
    log_softmax of the float32 logits: the naive path of the trainer. Returns the response tokens' log-probs (N,)."""
    seqs = [p + r[:-1] for p, r in zip(prompts, responses)]
    width = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)  # (B, L)
    mask = torch.zeros(len(seqs), width, dtype=torch.long)  # (B, L)
    for i, s in enumerate(seqs):
        ids[i, : len(s)], mask[i, : len(s)] = torch.tensor(s), 1
    logits = model(input_ids=ids, attention_mask=mask).logits  # (B, L, V), bf16 under autocast
    out = []
    for i, (p, r) in enumerate(zip(prompts, responses)):
        z = logits[i, len(p) - 1 : len(p) - 1 + len(r)].float() / temperature  # (len(r), V)
        out.append(torch.log_softmax(z, dim=-1).gather(1, torch.tensor(r).unsqueeze(1)).squeeze(1))
    return torch.cat(out)


def test_sampler_and_training_forward_under_bf16_autocast():
    # The trainer's GPU path on CPU: sample under bf16 autocast (behaviour log-probs), recompute the same tokens'
    # log-probs with response_logprobs under autocast, PPO-style surrogate sum(adv * exp(lp - behaviour)), and
    # loss.backward() outside autocast. head_scale 10 makes most tokens confident, as in a trained model.
    temperature = 0.8
    model = tiny_model("qwen3", seed=13, head_scale=10.0).train()
    prompts = PROMPTS * 2
    with torch.autocast("cpu", dtype=torch.bfloat16):
        rolls = sample(model, prompts, max_new_tokens=10, temperature=temperature, eos_token_id=[1, 2],
                       generator=torch.Generator().manual_seed(0))
    responses = [r.tokens for r in rolls]
    behaviour = torch.cat([r.logprobs for r in rolls])  # (N,)
    adv = torch.randn(behaviour.shape[0], generator=torch.Generator().manual_seed(1))  # (N,)

    def ours():
        logp, mask = response_logprobs(model, prompts, responses, pad_token_id=0, temperature=temperature)
        return logp[mask]  # (N,)

    def surrogate_grads(fn, autocast):
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            lp = fn()
        (adv * torch.exp(lp - behaviour)).sum().backward()  # outside autocast, as in the trainer
        return lp.detach(), torch.cat([p.grad.flatten() for p in model.parameters()])

    ref_lp, ref_g = surrogate_grads(ours, autocast=False)  # float32 throughout
    lp, g = surrogate_grads(ours, autocast=True)
    naive_lp, naive_g = surrogate_grads(lambda: full_logits_response_logprobs(model, prompts, responses, temperature),
                                        autocast=True)
    # behaviour (sampler) vs training forward, both bf16: the tolerance of the module docstring
    diff = (lp - behaviour).abs()
    assert diff.mean() < 0.02 and diff.max() < 0.25, f"mean {diff.mean():.4f}, max {diff.max():.4f} nats"
    assert (ref_lp - lp).abs().max() > 0.05, "autocast changed nothing: the comparison below would prove nothing"
    # the training forward's values and gradient are no further from float32 than transformers' own forward's
    assert rel_norm_err(lp, ref_lp) <= 1.25 * rel_norm_err(naive_lp, ref_lp)
    e_ours, e_naive = rel_norm_err(g, ref_g), rel_norm_err(naive_g, ref_g)
    assert e_ours <= 1.25 * e_naive, f"surrogate gradient error {e_ours:.3f} vs transformers' forward {e_naive:.3f}"


# ------------------------------------------------------------------------------------------------
# continuous batching (max_batch_size) and the static-shape decode path (static=True)
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind,attn", [("qwen3", "sdpa"), ("llama", "sdpa"), ("qwen3", "eager")])
@pytest.mark.parametrize("static", [False, True])
def test_continuous_batching_greedy_matches_generate(kind, attn, static):
    # 15 prompts through 1, 2 or 4 slots: rows finish at different steps, so refills join a batch in mid-flight,
    # against caches of a different width; every row must still be token-identical to generate on the whole batch
    model = tiny_model(kind, seed=9, attn=attn)
    prompts = PROMPTS * 3
    free = sample(model, prompts, max_new_tokens=16, temperature=0, eos_token_id=1000)
    eos = [free[0].tokens[2], free[3].tokens[5]]
    theirs = generate_responses(model, prompts, max_new_tokens=16, eos=eos)
    whole = sample(model, prompts, max_new_tokens=16, temperature=0, eos_token_id=eos)
    assert [r.tokens for r in whole] == theirs
    lengths = {len(t) for t in theirs}
    assert len(lengths) >= 3, f"the test needs rows of varied lengths, got {lengths}"
    for mbs in (1, 2, 4):
        ours = sample(model, prompts, max_new_tokens=16, temperature=0, eos_token_id=eos, max_batch_size=mbs,
                      min_refill=1, static=static)
        assert [r.tokens for r in ours] == theirs, f"max_batch_size={mbs}"
        assert [r.ended_with_eos for r in ours] == [r.ended_with_eos for r in whole]
        for a, b in zip(ours, whole):
            assert torch.allclose(a.logprobs, b.logprobs, atol=1e-5), f"max_batch_size={mbs}"


@pytest.mark.parametrize("static", [False, True])
def test_each_row_samples_as_if_alone(static):
    # Departure 7: row i's draws depend only on its seed (the i-th drawn from the generator) and its own token
    # count, so any max_batch_size, including one row at a time, gives the same tokens; log-probs agree to
    # round-off and match a fresh forward pass.
    model = tiny_model("llama", seed=10)
    prompts = PROMPTS * 3
    run = lambda **kw: sample(model, prompts, max_new_tokens=12, temperature=0.8, top_p=0.9, eos_token_id=[1, 2],
                              generator=torch.Generator().manual_seed(0), **kw)
    whole = run()
    lengths = [len(r.tokens) for r in whole]
    assert min(lengths) < 12 and max(lengths) == 12, f"want rows that stop early and rows at the cap, got {lengths}"
    for mbs in (1, 3, 8):
        ours = run(max_batch_size=mbs, static=static)
        assert [r.tokens for r in ours] == [r.tokens for r in whole], f"max_batch_size={mbs}"
        assert all(torch.allclose(a.logprobs, b.logprobs, atol=1e-5) for a, b in zip(ours, whole))
    logp, mask = response_logprobs(model, prompts, [r.tokens for r in ours], pad_token_id=0, temperature=0.8)
    assert torch.allclose(logp[mask], torch.cat([r.logprobs for r in ours]), atol=1e-5)
    # a different generator seed gives different samples (the seeds really come from the generator)
    other = sample(model, prompts, max_new_tokens=12, temperature=0.8, top_p=0.9, eos_token_id=[1, 2],
                   generator=torch.Generator().manual_seed(1), max_batch_size=3, static=static)
    assert [r.tokens for r in other] != [r.tokens for r in whole]


@pytest.mark.parametrize("share", [False, True])
def test_refills_fill_freed_slots_and_save_forward_calls(share):
    model = tiny_model("qwen3", seed=9)
    prompts = PROMPTS * 4  # 20 prompts, 4 slots
    free = sample(model, prompts, max_new_tokens=16, temperature=0, eos_token_id=1000)
    eos = [free[0].tokens[2], free[3].tokens[5]]
    calls = []  # (rows, prefill?) per call of the model body
    hook = model.model.register_forward_pre_hook(
        lambda mod, args, kw: calls.append((kw["input_ids"].shape[0], kw["cache"].get_seq_length() == 0)),
        with_kwargs=True,
    )
    try:
        stats = {}
        # sync_every=1: the host learns of a finished row at once (departure 16), so none is carried along
        ours = sample(model, prompts, max_new_tokens=16, temperature=0, eos_token_id=eos, max_batch_size=4,
                      min_refill=1, share_prefix=share, stats=stats, sync_every=1)
    finally:
        hook.remove()
    lengths = [len(r.tokens) for r in ours]
    assert stats["forward_calls"] == len(calls)
    assert max(n for n, _ in calls) <= 4, "never more rows in flight than max_batch_size"
    # every prompt is prefilled exactly once; with share_prefix each of the 5 distinct ones (departure 11)
    assert sum(n for n, pre in calls if pre) == (len(PROMPTS) if share else len(prompts))
    assert stats["prefill_tokens"] == (sum(map(len, PROMPTS)) if share else sum(map(len, prompts)))
    # every token but a row's last is fed to exactly one decode step: no finished row is carried along
    assert sum(n for n, pre in calls if not pre) == sum(n - 1 for n in lengths)
    # fixed chunks of 4 would pay one prefill + (longest row - 1) decode steps per chunk
    chunked = sum(1 + max(lengths[i : i + 4]) - 1 for i in range(0, len(prompts), 4))
    decode_calls = sum(1 for _, pre in calls if not pre)
    assert decode_calls < sum(max(lengths[i : i + 4]) - 1 for i in range(0, len(prompts), 4))
    assert len(calls) < chunked, f"{len(calls)} calls vs {chunked} for chunks of 4"


def test_uniforms_are_uniform_and_independent_of_order():
    from sampler import _uniforms

    seeds = torch.randint(0, 2**62, (1000,), generator=torch.Generator().manual_seed(0))
    counters = torch.arange(100).repeat_interleave(1000)  # (100000,)
    u = _uniforms(seeds.repeat(100), counters)  # (100000,)
    assert u.min() >= 0 and u.max() < 1
    hist = torch.histc(u.float(), bins=20, min=0, max=1) / u.numel()  # 5% expected per bin, sd ~0.07%
    assert (hist - 0.05).abs().max() < 0.004, hist
    # neighbouring counters of one seed are uncorrelated
    assert abs(torch.corrcoef(torch.stack([u[:-1000], u[1000:]]))[0, 1]) < 0.02
    # a row's uniform depends on (seed, counter) only, not on which other rows are computed with it
    assert torch.equal(_uniforms(seeds[5:6], torch.tensor([7])), _uniforms(seeds, torch.full((1000,), 7))[5:6])


def flat_inverse_cdf(weights, u):
    """Reference inversion: the whole float64 CDF of each row. weights (B, V) >= 0, u (B,) -> (B,) long."""
    cdf = weights.double().cumsum(dim=-1)  # (B, V)
    idx = torch.searchsorted(cdf, u.unsqueeze(1) * cdf[:, -1:], right=True)  # (B, 1)
    return torch.minimum(idx, (cdf < cdf[:, -1:]).sum(dim=-1, keepdim=True)).squeeze(1)


def draw_cases(v=5000, seed=0):
    """Rows of unnormalised weights that exercise the inversion's blocks: peaked, flat, zero blocks, zero tails, a
    single positive token in the last (short) block, V not a multiple of the block. -> (B, V) float32."""
    gen = torch.Generator().manual_seed(seed)
    w = [torch.exp(torch.randn(v, generator=gen) * s) for s in (0.1, 1.0, 3.0, 6.0)]
    zero_blocks = torch.exp(torch.randn(v, generator=gen))
    zero_blocks[:3000] = 0.0
    zero_tail = torch.exp(torch.randn(v, generator=gen))
    zero_tail[1500:] = 0.0
    single = torch.zeros(v)
    single[v - 3] = 0.25
    return torch.stack(w + [zero_blocks, zero_tail, single])  # (7, V)


def test_blocked_inverse_cdf_equals_the_flat_float64_inversion():
    from sampler import _CDF_BLOCK, _inverse_cdf

    w = draw_cases()
    assert w.shape[1] % _CDF_BLOCK != 0 and w.shape[1] > 2 * _CDF_BLOCK, "want several blocks and a short last one"
    gen = torch.Generator().manual_seed(1)
    u = torch.cat([torch.rand(2000, generator=gen, dtype=torch.float64), torch.tensor([0.0, 1 - 2.0**-53, 0.5])])
    rows = w.repeat_interleave(len(u), dim=0)  # (7 * U, V): every row against every u
    uu = u.repeat(len(w))  # (7 * U,)
    got, total = _inverse_cdf(rows, uu)
    ref = flat_inverse_cdf(rows, uu)
    # the block sums are float32 (round-off ~1e-7 of the row's weight): a point that close to an edge between two
    # tokens may fall on the other side of it, nothing else differs
    bad = (got != ref).nonzero().squeeze(1)
    assert len(bad) <= 3, f"{len(bad)} of {len(got)} draws differ from the flat inversion"
    cdf = rows[bad].double().cumsum(dim=-1)  # (D, V)
    edge = cdf.gather(1, torch.minimum(got, ref)[bad].unsqueeze(1)).squeeze(1)  # (D,) the edge between them
    assert ((uu[bad] * cdf[:, -1] - edge).abs() <= 1e-6 * cdf[:, -1]).all()
    assert (rows.gather(1, got.unsqueeze(1)) > 0).all(), "a zero-weight token was drawn"
    assert torch.allclose(total, rows.double().sum(dim=-1), rtol=1e-6, atol=0)  # float32 block sums
    assert set(got[-len(u):].tolist()) == {w.shape[1] - 3}


@pytest.mark.parametrize("top_p", [0.5, 0.95])
def test_top_p_candidates_give_the_nucleus_of_a_full_sort(top_p):
    import sampler

    w = draw_cases()[:4]  # peaked to flat: with 256 candidates the flat rows need the whole sort
    total = w.double().sum(dim=-1)  # (B,)
    gen = torch.Generator().manual_seed(2)
    u = torch.rand(500, generator=gen, dtype=torch.float64)  # (U,)
    kept, ids = sampler._nucleus(w, total, top_p)
    p_all, id_all = w.sort(dim=-1, descending=True)  # the reference: every row sorted whole
    p_all = p_all / total.float().unsqueeze(1)
    ref = p_all.masked_fill(p_all.cumsum(dim=-1) - p_all >= top_p, 0.0)  # (B, V)
    sizes = (ref > 0).sum(dim=-1)  # (B,) nucleus sizes
    assert sizes.min() < sampler._TOP_P_CANDIDATES < sizes.max(), f"want both kinds of rows, got sizes {sizes}"
    assert torch.equal((kept > 0).sum(dim=-1), sizes)
    for r in range(len(w)):
        n = int(sizes[r])
        assert torch.equal(ids[r, :n], id_all[r, :n]) and torch.equal(kept[r, :n], ref[r, :n])
        rows_k, rows_ref = kept[r].expand(len(u), -1), ref[r].expand(len(u), -1)
        assert torch.equal(ids[r][sampler._inverse_cdf(rows_k, u)[0]], id_all[r][flat_inverse_cdf(rows_ref, u)])


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 1.0), (1.0, 0.9)])
def test_draw_logprobs_are_the_full_vocabulary_log_softmax(temperature, top_p):
    from sampler import _draw

    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 5000, generator=gen) * torch.tensor([0.5, 1, 2, 4, 8, 16]).unsqueeze(1)  # (6, V)
    u = torch.rand(6, generator=gen, dtype=torch.float64)
    tokens, logp = _draw(logits, temperature, top_p, u)
    want = torch.log_softmax(logits.double() / temperature, dim=-1).gather(1, tokens.unsqueeze(1)).squeeze(1)
    assert logp.dtype == torch.float32 and torch.allclose(logp.double(), want, atol=2e-6, rtol=0)
    if top_p == 1.0:  # plain inversion of softmax(z / T), as the flat reference computes it
        probs = torch.softmax(logits.double() / temperature, dim=-1)
        assert torch.equal(tokens, flat_inverse_cdf(probs, u))


def test_continuous_batching_bad_input():
    model = tiny_model("qwen3", seed=9)
    with pytest.raises(ValueError, match="max_batch_size"):
        sample(model, PROMPTS, max_new_tokens=4, eos_token_id=1, max_batch_size=0)
    # the static path refuses sliding-window layers (departure 10), with a ValueError that names the config fields;
    # the default path runs them with refills (tested against generate with the other architectures below)
    sliding = arch_model("qwen3-window")
    with pytest.raises(ValueError, match="static=True needs full attention.*sliding_window=4"):
        sample(sliding, ARCH_PROMPTS, max_new_tokens=4, eos_token_id=1, max_batch_size=2, static=True)
    assert len(sample(sliding, ARCH_PROMPTS, max_new_tokens=4, eos_token_id=1, max_batch_size=2)) == len(ARCH_PROMPTS)


def test_static_auto_resolves_per_device_and_architecture():
    # departure 10: "auto" is the default path on CPU (nothing to capture), the static path on CUDA for full
    # attention with sdpa or eager; sliding-window models stay on the default path under "auto" and are refused
    # under "on" with a ValueError naming the config field
    from sampler import resolve_static

    full, eager, sliding = tiny_model("qwen3", seed=9), tiny_model("llama", seed=9, attn="eager"), arch_model(
        "qwen3-window")
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_static("auto", full, cpu) is False and resolve_static("auto", sliding, cpu) is False
    assert resolve_static("auto", full, cuda) == "auto" and resolve_static("auto", eager, cuda) == "auto"
    assert resolve_static("auto", sliding, cuda) is False
    assert resolve_static("on", full, cpu) is True and resolve_static(True, full, cpu) is True
    assert resolve_static("off", full, cuda) is False and resolve_static(False, full, cuda) is False
    with pytest.raises(ValueError, match="sliding_window=4"):
        resolve_static("on", sliding, cuda)
    with pytest.raises(ValueError, match="'auto', 'on', 'off'"):
        resolve_static("yes", full, cpu)
    stats = {}
    sample(full, PROMPTS, max_new_tokens=4, temperature=0, eos_token_id=1, stats=stats)  # the default: "auto"
    assert stats["static"] is False and "slots" not in stats
    sample(full, PROMPTS, max_new_tokens=4, temperature=0, eos_token_id=1, static="on", stats=stats)
    assert stats["static"] is True and stats["slots"] == len(PROMPTS)


def test_static_auto_sizes_its_cache_to_the_free_memory(monkeypatch):
    # "auto" with no max_cache_bytes takes 80% of the device's free memory as the budget (a caller that gives none,
    # as tools/preflight.py, must not preallocate past the card): the pool and the gather fit it, and a budget below
    # one row at full length falls back to the default path instead of raising as "on" does. CUDA faked on CPU.
    model = tiny_model("qwen3", seed=9)
    monkeypatch.setattr(sampler, "resolve_static", lambda static, *a, **k: "auto" if static == "auto" else static)
    per_slot = (max(map(len, PROMPTS)) + 4) * sampler._kv_token_bytes(model, None)
    kw = dict(max_new_tokens=4, temperature=0, eos_token_id=1000, max_batch_size=5, block_size=4)
    ref = [r.tokens for r in sample(model, PROMPTS, static="off", **kw)]
    for free, static in ((per_slot * 6 / 0.8 + 1, True), (per_slot * 0.5, False)):
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None, free=free: (int(free), 10 * int(free)))
        stats = {}
        assert [r.tokens for r in sample(model, PROMPTS, stats=stats, **kw)] == ref
        assert stats["static"] is static, stats
        if static:
            assert 1 <= stats["slots"] <= 5 and stats["kv_pool_bytes"] + stats["kv_gather_bytes"] <= 0.8 * free


@pytest.mark.parametrize("sync_every", [1, 3, 8])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_static_and_default_paths_draw_the_same_tokens_in_float32(sync_every, temperature):
    # the issue's CPU check: static and eager outputs identical in float32, with refills (3 slots, 10 rows of
    # different lengths), greedy and sampled (the same seeds), whatever the host's read cadence (departure 16)
    model = tiny_model("qwen3", seed=11)
    prompts = PROMPTS * 2
    free = sample(model, prompts, max_new_tokens=12, temperature=0, eos_token_id=1000)
    eos = [free[0].tokens[3], free[1].tokens[6], free[4].tokens[1]]
    out = {}
    for static in ("off", "on"):
        stats = {}
        out[static] = sample(model, prompts, max_new_tokens=12, temperature=temperature, eos_token_id=eos,
                             max_batch_size=3, min_refill=1, static=static, sync_every=sync_every, stats=stats,
                             generator=torch.Generator().manual_seed(5))
        assert stats["host_reads"] <= -(-stats["decode_steps"] // sync_every) + len(prompts), stats
    assert len({len(r.tokens) for r in out["off"]}) > 2, "want rows of several lengths, so that refills happen"
    assert [r.tokens for r in out["on"]] == [r.tokens for r in out["off"]]
    assert [r.finish for r in out["on"]] == [r.finish for r in out["off"]]
    for a, b in zip(out["on"], out["off"]):
        assert torch.allclose(a.logprobs, b.logprobs, atol=1e-5)


def test_static_warm_up_leaves_the_state_as_it_found_it(monkeypatch):
    # a CUDA capture is preceded by two warm-up runs of the step (departure 10); on CPU the same warm-up is forced
    # before every step: each run draws, moves the counters and writes K/V, and the restore must undo all of it
    # but the writes the real step repeats, so the outputs are those of the plain static path
    model = tiny_model("llama", seed=12)
    kw = dict(max_new_tokens=10, temperature=1.0, eos_token_id=[1, 2], max_batch_size=3, min_refill=1, static="on",
              sync_every=2)
    plain = sample(model, PROMPTS * 2, generator=torch.Generator().manual_seed(3), **kw)
    calls = []
    real_call = sampler._StaticStep.__call__

    def warm_then_call(self, rows, width):
        calls.append(1)
        self.cache.rows, self.cache.width = rows, width  # the warm-up runs at the call's buckets, as before a capture
        self.warm_up()
        return real_call(self, rows, width)

    monkeypatch.setattr(sampler._StaticStep, "__call__", warm_then_call)
    warmed = sample(model, PROMPTS * 2, generator=torch.Generator().manual_seed(3), **kw)
    assert calls, "the static step ran"
    assert [r.tokens for r in warmed] == [r.tokens for r in plain]
    assert all(torch.equal(a.logprobs, b.logprobs) for a, b in zip(warmed, plain))


class _HostReads(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the ops dispatched while ``inside`` is set that a CUDA graph cannot hold: reads of a value by the
    host and ops whose output shape depends on the data."""

    BAD = {"_local_scalar_dense", "is_nonzero", "item", "nonzero", "masked_select", "unique", "_unique2"}

    def __init__(self):
        super().__init__()
        self.inside, self.ops, self.bad = False, 0, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.inside:
            self.ops += 1
            if func.overloadpacket.__name__ in self.BAD:
                self.bad.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("temperature,top_p,attn", [(0.0, 1.0, "sdpa"), (1.0, 1.0, "sdpa"), (0.7, 1.0, "eager")])
def test_the_captured_step_reads_nothing_on_the_host(monkeypatch, temperature, top_p, attn):
    # departures 10 and 15: what CUDA captures (_StaticStep._captured: the draw, the forward, the bookkeeping) must
    # not read a value back to the host or make a data-dependent shape, or the capture fails; checked on CPU by
    # watching every op dispatched inside it, with refills and rows ending at EOS and at the cap
    model = tiny_model("qwen3" if attn == "sdpa" else "llama", seed=14, attn=attn)
    mode = _HostReads()
    real = sampler._StaticStep._captured

    def watched(self):
        mode.inside = True
        try:
            return real(self)
        finally:
            mode.inside = False

    monkeypatch.setattr(sampler._StaticStep, "_captured", watched)
    with mode:
        rolls = sample(model, PROMPTS * 2, max_new_tokens=9, temperature=temperature, top_p=top_p,
                       eos_token_id=[1, 2, 3], max_batch_size=3, min_refill=1, static="on",
                       generator=torch.Generator().manual_seed(0))
    assert mode.ops > 0 and mode.bad == [], mode.bad[:5]
    assert len({len(r.tokens) for r in rolls}) > 1 or temperature == 0


class _WeightCasts(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts aten ops, and the casts (``to`` / ``_to_copy``) whose input is one of the given weights' storage."""

    def __init__(self, weights):
        super().__init__()
        self.ptrs = {w.data_ptr() for w in weights}
        self.ops, self.casts = 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        if func.overloadpacket in (torch.ops.aten._to_copy, torch.ops.aten.to) and args[0].data_ptr() in self.ptrs:
            self.casts += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("static", ["off", "on"])
def test_cast_once_gives_autocast_numbers_without_per_step_casts(static):
    # departure 17: under bf16 autocast with float32 weights, the Linear weights cast once per call give the same
    # tokens and log-probs as autocast's own per-step casts (the same rounding), and no weight is cast inside the
    # decode loop; without cast_once every step casts every Linear weight (inference_mode: no autocast cache)
    model = tiny_model("qwen3", seed=13, head_scale=10.0, tie=True)
    linear = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]
    runs, casts, steps = {}, {}, {}
    for once in (False, True):
        stats = {}
        with torch.autocast("cpu", dtype=torch.bfloat16), _WeightCasts(linear) as mode:
            runs[once] = sample(model, PROMPTS * 2, max_new_tokens=8, temperature=0.8, eos_token_id=[1, 2],
                                max_batch_size=4, min_refill=1, static=static, cast_once=once, stats=stats,
                                generator=torch.Generator().manual_seed(0))
        casts[once], steps[once] = mode.casts, stats["decode_steps"]
        assert (stats["cast_bytes"] > 0) == once
    assert [r.tokens for r in runs[True]] == [r.tokens for r in runs[False]]
    assert all(torch.equal(a.logprobs, b.logprobs) for a, b in zip(runs[True], runs[False]))
    # 2 layers x 7 projections per forward (prefills and decode steps) + the lm_head in each draw, tied to the
    # embedding: each distinct weight once per call with cast_once (the tied one counted once)
    assert casts[True] == len({w.data_ptr() for w in linear})
    assert casts[False] >= steps[False] * 2 * 7, (casts, steps)
    # the model's own weights are back, float32 Parameters, the tie intact
    assert model.lm_head.weight is model.model.embed_tokens.weight and model.lm_head.weight.dtype == torch.float32
    assert all(isinstance(m.weight, torch.nn.Parameter) for m in model.modules() if isinstance(m, torch.nn.Linear))


@pytest.mark.parametrize("static", ["off", "on"])
def test_stop_strings_read_the_host_every_sync_every_steps(static):
    # departures 12 and 16: the stop check reads the last sync_every steps' tokens at the regular read, not every
    # step: 6 draws with sync_every 8 are one read (when every row has drawn the cap), 20 draws with sync_every 3
    # are 7 reads (the default path's last draw needs no decode step after it, the static step draws inside)
    model = tiny_model("qwen3", seed=9)

    class Tok:  # decodes ids as letters: a stop string that never occurs
        def batch_decode(self, ids, **kw):
            return ["".join(chr(97 + i % 26) for i in row) for row in ids]

    for cap, sync, reads in ((6, 8, 1), (20, 3, 7)):
        stats = {}
        sample(model, PROMPTS, max_new_tokens=cap, temperature=0, eos_token_id=1000, stop_strings=["#"],
               tokenizer=Tok(), sync_every=sync, stats=stats, static=static)
        assert stats["host_reads"] == reads and stats["decode_steps"] == cap - (static == "off"), stats


@pytest.mark.parametrize("static", [False, True])
def test_continuous_batching_under_bf16_autocast(static):
    # the trainer's call: all prompts at once under bf16 autocast with a few rows in flight; the behaviour log-probs
    # must still agree with the training forward within the bf16 tolerance of the module docstring
    model = tiny_model("qwen3", seed=13, head_scale=10.0)
    prompts = PROMPTS * 2
    with torch.autocast("cpu", dtype=torch.bfloat16):
        rolls = sample(model, prompts, max_new_tokens=10, temperature=0.8, eos_token_id=[1, 2], max_batch_size=3,
                       min_refill=1, static=static, generator=torch.Generator().manual_seed(0))
        logp, mask = response_logprobs(model, prompts, [r.tokens for r in rolls], pad_token_id=0, temperature=0.8)
    assert len({len(r.tokens) for r in rolls}) > 1, "want rows of different lengths, so that refills happen"
    diff = (logp[mask] - torch.cat([r.logprobs for r in rolls])).abs()
    assert diff.mean() < 0.02 and diff.max() < 0.25, f"mean {diff.mean():.4f}, max {diff.max():.4f} nats"


def test_pass_tokens_counts_what_response_logprobs_feeds():
    # departure 14's cost model against the token positions response_logprobs really feeds the model body (a hook
    # on input_ids), shared and not, with repeated prompts, distinct ones and an empty response
    model = tiny_model("qwen3", seed=2)
    fed = []
    hook = sampler._base_model(model).register_forward_pre_hook(
        lambda m, a, kw: fed.append(kw["input_ids"].numel()), with_kwargs=True)
    g = torch.Generator().manual_seed(0)
    cases = [(PROMPTS, [[5] * n for n in (3, 0, 7, 1, 2)]),
             ([PROMPTS[0]] * 3 + [PROMPTS[1]] * 2, [[6] * n for n in (9, 2, 4, 1, 5)]),
             ([PROMPTS[3]] * 4, [[7] * n for n in (1, 1, 1, 1)])]
    cases.append(([PROMPTS[int(i)] for i in torch.randint(0, 5, (12,), generator=g)],
                  [[8] * int(n) for n in torch.randint(0, 15, (12,), generator=g)]))
    with torch.no_grad():
        for prompts, responses in cases:
            for share in (True, False):
                fed.clear()
                response_logprobs(model, prompts, responses, pad_token_id=0, share_prefix=share)
                assert sum(fed) == sampler._pass_tokens(prompts, responses, share), (prompts, responses, share)
    hook.remove()


def test_batches_by_length_picks_the_cheapest_cut():
    # every row once, in micro-batches of at most `size` rows, never costlier than rollout order; long-tailed
    # responses (one long row per prompt's copies, as RL gives) cost far less sorted than in rollout order
    g = torch.Generator().manual_seed(1)
    prompts = [PROMPTS[i // 8 % 5] + [i // 8] for i in range(64)]  # 8 prompts x 8 copies, rollout order
    responses = [[9] * (int(torch.randint(80, 100, (1,), generator=g)) if i % 8 == 0 else
                        int(torch.randint(3, 12, (1,), generator=g))) for i in range(64)]
    for share in (True, False):
        for size in (1, 5, 16):
            cut = sampler.batches_by_length(prompts, responses, size, share_prefix=share)
            assert sorted(i for b in cut for i in b) == list(range(64)) and all(0 < len(b) <= size for b in cut)
            cost = lambda batches: sum(sampler._pass_tokens([prompts[i] for i in b], [responses[i] for i in b],
                                                            share) for b in batches)
            rollout = [list(range(i, min(i + size, 64))) for i in range(0, 64, size)]
            assert cost(cut) <= cost(rollout)
            if size == 16:
                assert cost(cut) < 0.5 * cost(rollout), (share, cost(cut), cost(rollout))
    # by hand: rollout order feeds 2 x 9 + 2 x 9 = 36 positions, longest first 2 x 9 + 2 x 1 = 20
    p, r = [[1], [2], [3], [4]], [[9], [9] * 9, [9], [9] * 9]
    assert sampler.batches_by_length(p, r, 2, share_prefix=False) == [[1, 3], [0, 2]]
    assert sampler.batches_by_length([], [], 3) == []


def caches_seen(model):
    """Register a hook that keeps every KV cache object the model body is handed (prefills and decode steps)."""
    seen = []
    base = sampler._base_model(model)

    def hook(module, args, kwargs):
        for key in ("cache", "past_key_values"):
            if kwargs.get(key) is not None:
                seen.append(kwargs[key])

    return seen, base.register_forward_pre_hook(hook, with_kwargs=True)


def stored_kv(cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(K, V) per layer of a DynamicCache, (B, h, W, d), or of the static path's paged pool, (N, h, d) seen as
    (1, h, N, d)."""
    if hasattr(cache, "layers"):
        return [(layer.keys, layer.values) for layer in cache.layers]
    return [(k.unsqueeze(0).transpose(1, 2), v.unsqueeze(0).transpose(1, 2)) for k, v in zip(cache.keys, cache.values)]


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("static", [False, True])
def test_kv_cache_is_stored_in_bf16_under_autocast(static, attn):
    # departure 13. Measured through the sampler: the cache tensors the model body is really handed. Under bf16
    # autocast with float32 weights, Qwen3's float32 q/k norm and RoPE would make K float32 (V bf16); stored in bf16,
    # one token costs 2 x layers x kv_heads x head_dim x 2 bytes.
    model = tiny_model("qwen3", seed=13, head_scale=10.0, attn=attn)
    cfg = model.config
    want = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 2
    seen, handle = caches_seen(model)
    stats = {}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        sample(model, PROMPTS * 2, max_new_tokens=6, temperature=0.8, eos_token_id=[1, 2], max_batch_size=3,
               min_refill=1, static=static, generator=torch.Generator().manual_seed(0), stats=stats)
    handle.remove()
    assert seen
    for cache in seen:
        for k, v in stored_kv(cache):
            assert k.dtype == v.dtype == torch.bfloat16, (k.dtype, v.dtype)
    measured = sum(k.element_size() * k.shape[1] * k.shape[3] + v.element_size() * v.shape[1] * v.shape[3]
                   for k, v in stored_kv(seen[-1]))
    assert measured == want == stats["kv_bytes_per_token"], (measured, want, stats)
    assert stats["kv_dtypes"] == (torch.bfloat16, torch.bfloat16)
    assert sampler._kv_token_bytes(model, torch.bfloat16) == want  # the static path's sizing agrees
    # without autocast (float32 weights) nothing is cast: 4 bytes per element
    stats32 = {}
    sample(model, PROMPTS, max_new_tokens=3, temperature=0, eos_token_id=1, static=static, stats=stats32)
    assert stats32["kv_bytes_per_token"] == 2 * want and stats32["kv_dtypes"] == (torch.float32, torch.float32)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("static", [False, True])
def test_bf16_kv_cache_samples_what_the_mixed_dtype_cache_did(static, attn, monkeypatch):
    # autocast's attention casts K and V to bf16 anyway, so storing them in bf16 changes no token and no log-prob:
    # the same call with the cast switched off (K cached in float32, as before departure 13) is the reference
    model = tiny_model("qwen3", seed=13, head_scale=10.0, attn=attn)

    def run():
        stats = {}
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = sample(model, PROMPTS * 3, max_new_tokens=10, temperature=0.8, eos_token_id=list(range(1, 13)),
                         max_batch_size=4, min_refill=1, static=static, generator=torch.Generator().manual_seed(3),
                         stats=stats)
        return out, stats

    ours, stats = run()
    monkeypatch.setattr(sampler, "_kv_dtype", lambda device: None)
    old, old_stats = run()
    assert old_stats["kv_dtypes"] == (torch.float32, torch.bfloat16), "the reference should cache mixed dtypes"
    assert stats["kv_bytes_per_token"] * 3 == old_stats["kv_bytes_per_token"] * 2  # K 4 -> 2 bytes, V 2 bytes
    assert len({len(r.tokens) for r in ours}) > 1
    for a, b in zip(ours, old):
        assert a.tokens == b.tokens
        assert torch.equal(a.logprobs, b.logprobs)


def test_paged_pool_sizing_follows_the_byte_budget_exactly():
    # departure 13: max_cache_bytes pays for the pool ((blocks + 1) x block_size tokens, the trash block included)
    # and one layer's gathered K/V with transformers' copy of it to every query head (3 x S x L tokens / layers: 4
    # heads over 2 KV heads); slots are cut so that the pool holds S rows at expected lengths (mean prompt + half the
    # cap + sync_every) and one at full length. Hand-computed for the tiny Qwen3 (512 bytes a token in float32: 2
    # layers x 2 KV heads x 16 x 4 bytes x K and V)
    model = tiny_model("qwen3", seed=9)
    tb = sampler._kv_token_bytes(model, None)
    assert tb == 2 * 2 * 2 * 16 * 4
    prompts = PROMPTS * 2  # longest 9, shortest 1
    length, bs, sync = 9 + 8, 4, 2  # L = 17 columns: 5 blocks of 4 at full length
    assert sampler.transient_copies(model.config) == 3  # the gather + repeat_kv's copy to 2 x the heads
    gather = 3 * (length * tb // 2)  # one slot, one layer, K and V, the gather and its copy
    block = bs * tb
    budget = 3 * gather + 10 * block  # 3 slots' transient, 9 blocks + the trash block
    stats = {}
    sample(model, prompts, max_new_tokens=8, temperature=0, eos_token_id=[1, 2], max_batch_size=8, static=True,
           block_size=bs, sync_every=sync, max_cache_bytes=budget, stats=stats)
    # a row at expected lengths: ceil(mean prompt 4.4) + 8 / 2 + sync 2 = 11 columns, 3 blocks; a full row 5 blocks
    # S = min(8, (budget - 6 blocks) // gather, (budget - 1 block) // (gather + 3 blocks))
    want_slots = min(8, (budget - 6 * block) // gather, (budget - block) // (gather + 3 * block))
    assert stats["slots"] == want_slots == 3
    assert stats["kv_blocks"] == (budget - 3 * gather) // block - 1 == 9
    assert stats["kv_pool_bytes"] == 10 * block and stats["kv_gather_bytes"] == 3 * gather
    assert stats["kv_pool_bytes"] + stats["kv_gather_bytes"] <= budget
    assert stats["kv_block_size"] == bs and stats["kv_blocks_held_at_end"] == 0
    # without a budget: every slot at full length (CPU's "on"), nothing changes
    sample(model, prompts, max_new_tokens=8, temperature=0, eos_token_id=[1, 2], max_batch_size=4, static=True,
           block_size=bs, sync_every=sync, stats=stats)
    assert stats["slots"] == 4 and stats["kv_blocks"] == 4 * 5 and stats["preemptions"] == 0


def test_static_budget_below_one_row_is_refused():
    # a pool that cannot hold one row at prompt + cap (plus the trash block and one slot's gather) raises a
    # ValueError naming max_cache_bytes under "on"; one byte more runs, one row at a time
    model = tiny_model("qwen3", seed=9)
    tb = sampler._kv_token_bytes(model, None)
    prompts = PROMPTS * 2
    length, bs = 9 + 8, 4
    enough = (5 + 1) * bs * tb + 3 * (length * tb // 2)  # a full row + trash, one slot's gather and its copy
    kw = dict(max_new_tokens=8, temperature=0, eos_token_id=[1, 2], min_refill=1, static=True, block_size=bs)
    with pytest.raises(ValueError, match="max_cache_bytes=.*holds no slot"):
        sample(model, prompts, max_batch_size=8, max_cache_bytes=enough - 1, **kw)
    stats = {}
    ours = sample(model, prompts, max_batch_size=8, max_cache_bytes=enough, stats=stats, **kw)
    assert stats["slots"] == 1 and stats["kv_blocks"] == 5
    assert [r.tokens for r in ours] == [r.tokens for r in sample(model, prompts, max_batch_size=1, **kw)]


def paged_runs(model, prompts, budgets, **kw):
    """sample() on the static path once per budget (None: unbounded), with its stats: {budget: (rollouts, stats)}."""
    out = {}
    for b in budgets:
        stats = {}
        out[b] = (sample(model, prompts, static=True, max_cache_bytes=b, stats=stats, **kw), stats)
    return out


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_paged_pool_waits_and_preempts_without_changing_a_token(temperature):
    # departures 7 and 10: a pool so small that rows wait for blocks and running rows are preempted (sent back with
    # the tokens they drew, prefilled again with prompt + those tokens, drawing on at counter t) gives the same
    # tokens as an unbounded run and the default path, log-probs to round-off; the pool never holds more blocks
    # than it has, every block is returned, and more budget puts more rows in flight
    model = tiny_model("qwen3", seed=11)
    prompts = PROMPTS * 3
    tb = sampler._kv_token_bytes(model, None)
    bs, cap, sync = 2, 16, 3
    length = max(map(len, prompts)) + cap
    gather = 3 * (length * tb // model.config.num_hidden_layers)  # the gather and its copy to every query head
    kw = dict(max_new_tokens=cap, temperature=temperature, eos_token_id=[1, 2], max_batch_size=6, min_refill=1,
              block_size=bs, sync_every=sync, generator=None)
    ref = sample(model, prompts, static="off", **{**kw, "generator": torch.Generator().manual_seed(4)})
    full = -(-length // bs)  # 13 blocks: one row at full length
    # a row at expected lengths: ceil(4.4) + 16 / 2 + 3 = 16 columns, 8 blocks. tight: 3 slots (3 such rows), 25
    # blocks (under 2 rows at the cap); roomy: 4 slots, 52 blocks (4 rows at full length)
    block = bs * tb
    tight, roomy = 3 * gather + 26 * block, 4 * gather + 53 * block
    runs = {}
    for b in (None, tight, roomy):
        stats = {}
        runs[b] = (sample(model, prompts, static=True, max_cache_bytes=b, stats=stats,
                          **{**kw, "generator": torch.Generator().manual_seed(4)}), stats)
    lengths = [len(r.tokens) for r in ref]
    assert len(set(lengths)) > 2 and max(lengths) == cap, lengths
    for b, (rolls, stats) in runs.items():
        assert [r.tokens for r in rolls] == [r.tokens for r in ref], b
        assert [r.finish for r in rolls] == [r.finish for r in ref], b
        assert all(torch.allclose(a.logprobs, c.logprobs, atol=1e-5) for a, c in zip(rolls, ref)), b
        assert stats["kv_blocks_peak"] <= stats["kv_blocks"] and stats["kv_blocks_held_at_end"] == 0, stats
        assert stats["rows_in_flight_peak"] <= stats["slots"] <= 6
    tight_stats, roomy_stats, free_stats = runs[tight][1], runs[roomy][1], runs[None][1]
    assert (tight_stats["slots"], tight_stats["kv_blocks"]) == (3, 25), tight_stats
    assert (roomy_stats["slots"], roomy_stats["kv_blocks"]) == (4, 4 * full), roomy_stats
    assert tight_stats["preemptions"] > 0 and free_stats["preemptions"] == 0, (tight_stats, free_stats)
    assert tight_stats["kv_blocks_peak"] == tight_stats["kv_blocks"], "the tight pool ran full"
    assert (tight_stats["rows_in_flight_mean"] < roomy_stats["rows_in_flight_mean"]
            < free_stats["rows_in_flight_mean"]), (tight_stats, roomy_stats, free_stats)
    assert free_stats["rows_in_flight_peak"] == 6


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_width_and_slot_buckets_run_less_with_the_same_tokens(temperature, monkeypatch):
    # departure 10: the static step attends over the smallest of L/8, L/4, L/2, L (in whole blocks) that holds every
    # running row until the next host read, and runs the fewest slots (a multiple of S / 8) holding the occupied ones
    # (rows compacted into the first slots as others leave); the tokens are those of running all S slots over all
    # L columns every step, and of the default path, log-probs to round-off. Several buckets of each are used
    model = tiny_model("qwen3", seed=11)
    prompts = PROMPTS * 2
    kw = dict(max_new_tokens=40, temperature=temperature, max_batch_size=4, min_refill=1, block_size=2,
              sync_every=3)
    free = sample(model, prompts, eos_token_id=1000, **{**kw, "temperature": 0})
    eos = [free[0].tokens[3], free[1].tokens[20]]
    run = lambda **extra: sample(model, prompts, eos_token_id=eos, generator=torch.Generator().manual_seed(2),
                                 **kw, **extra)
    stats = {}
    ours, ref = run(static=True, stats=stats), run(static=False)
    monkeypatch.setattr(sampler, "_WIDTH_FRACTIONS", (1,))
    wide_stats = {}
    wide = run(static=True, stats=wide_stats)
    length = 9 + 40
    assert set(stats["width_steps"]) <= {8, 14, 26, length} and len(stats["width_steps"]) >= 2, stats["width_steps"]
    assert sum(stats["width_steps"].values()) == stats["decode_steps"]
    assert wide_stats["width_steps"] == {length: wide_stats["decode_steps"]}
    assert set(stats["rows_steps"]) <= {1, 2, 3, 4} and len(stats["rows_steps"]) >= 2, stats["rows_steps"]
    assert sum(stats["rows_steps"].values()) == stats["decode_steps"]
    assert wide_stats["rows_steps"] == {4: wide_stats["decode_steps"]}
    for other in (wide, ref):
        assert [r.tokens for r in ours] == [r.tokens for r in other]
        assert all(torch.allclose(a.logprobs, b.logprobs, atol=1e-5) for a, b in zip(ours, other))
    assert len({len(r.tokens) for r in ours}) > 2


def test_paged_preemption_resumes_at_the_drawn_count(monkeypatch):
    # a preempted row comes back with prompt + its drawn tokens as its prefill, and its n_out at the count drawn
    # (so its next uniform is splitmix(seed, t + 1) as if never preempted): watch the comeback prefills
    model = tiny_model("llama", seed=10)
    prompts = PROMPTS * 2
    tb = sampler._kv_token_bytes(model, None)
    bs, cap = 2, 12
    length = max(map(len, prompts)) + cap
    # 3 slots (rows at expected lengths: 5 + 6 + 2 columns, 7 blocks), 21 blocks: under 2 rows of 11 at the cap
    budget = 3 * 3 * (length * tb // 2) + 22 * bs * tb
    seen = []
    real = sampler._prefill_right

    def spy(model_, base, run, seqs, pad):
        seen.append([list(s) for s in seqs])
        return real(model_, base, run, seqs, pad)

    monkeypatch.setattr(sampler, "_prefill_right", spy)
    # every step, every occupied slot owns the block of the column it writes (the host gave it ahead of the step)
    # and no more than the columns it writes until the next read need (prompt + drawn + sync_every)
    checked = []
    real_forward = sampler._StaticStep._forward

    def forward(self):
        cache, pos = self.cache, self.cache.write_pos.tolist()
        for slot, row in enumerate(self.slot_row.tolist()):
            if row != self.run.trash:
                owned = len(cache.owned[slot])
                assert cache.blocks_for(pos[slot] + 1) <= owned <= cache.blocks_for(pos[slot] + 2), (slot, pos, owned)
                checked.append(slot)
        return real_forward(self)

    monkeypatch.setattr(sampler._StaticStep, "_forward", forward)
    stats = {}
    kw = dict(max_new_tokens=cap, temperature=1.0, eos_token_id=[1], max_batch_size=4, min_refill=1, block_size=bs,
              sync_every=2)
    ours = sample(model, prompts, static=True, max_cache_bytes=budget, stats=stats,
                  generator=torch.Generator().manual_seed(1), **kw)
    assert stats["preemptions"] > 0
    longer = [s for call in seen for s in call if s not in prompts]  # comeback prefills: prompt + drawn tokens
    assert longer, "a preempted row was prefilled again with its drawn tokens"
    for s in longer:
        i = next(i for i, p in enumerate(prompts) if s[: len(p)] == p and ours[i].tokens[: len(s) - len(p)]
                 == s[len(p):])
        assert len(s) > len(prompts[i])
    assert checked
    free = sample(model, prompts, static=True, generator=torch.Generator().manual_seed(1), **kw)
    assert [r.tokens for r in ours] == [r.tokens for r in free]


# ------------------------------------------------------------------------------------------------
# every architecture: tiny random configs of the families a GRAFT pair may use, including heads that scale or
# soft-cap their logits and layers with sliding windows, against transformers' own generate and forward
# ------------------------------------------------------------------------------------------------

ARCH_VOCAB = 96


def arch_config(arch, vocab=ARCH_VOCAB):
    """A tiny config (hidden 32, 2-3 layers) of the named architecture. Windows of 4 tokens are shorter than every
    prompt + response below; the head transforms are set away from 1 so that ignoring them would show. Untied heads:
    a tiny Gemma with its (sqrt(hidden)-scaled) embedding as its head only ever repeats its input token."""
    import transformers as tf

    common = dict(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, pad_token_id=0,
                  bos_token_id=None, eos_token_id=None, tie_word_embeddings=False)
    mixed = dict(num_hidden_layers=3, sliding_window=4,
                 layer_types=["sliding_attention", "full_attention", "sliding_attention"])
    make = {
        "llama": lambda: tf.LlamaConfig(**common),
        "qwen2": lambda: tf.Qwen2Config(**common),
        "qwen3": lambda: tf.Qwen3Config(head_dim=8, **common),
        "qwen3-window": lambda: tf.Qwen3Config(head_dim=8, use_sliding_window=True, sliding_window=4,
                                               max_window_layers=1, **common),  # layer 0 full, layer 1 sliding
        "smollm3": lambda: tf.SmolLM3Config(**common),
        "mistral": lambda: tf.MistralConfig(**{**common, "sliding_window": None}),
        "mistral-window": lambda: tf.MistralConfig(**{**common, "sliding_window": 4}),
        "phi3": lambda: tf.Phi3Config(**common),
        "olmo": lambda: tf.OlmoConfig(**common),
        "olmo2": lambda: tf.Olmo2Config(**common),
        "gemma": lambda: tf.GemmaConfig(head_dim=8, **common),
        "gemma2": lambda: tf.Gemma2Config(head_dim=8, sliding_window=4, final_logit_softcapping=5.0, **common),
        "gemma3": lambda: tf.Gemma3TextConfig(head_dim=8, **{**common, **mixed}),
        "gemma3-softcap": lambda: tf.Gemma3TextConfig(head_dim=8, final_logit_softcapping=5.0, **{**common, **mixed}),
        "vaultgemma": lambda: tf.VaultGemmaConfig(head_dim=8, sliding_window=4, final_logit_softcapping=5.0,
                                                  **common),
        "nanochat": lambda: tf.NanoChatConfig(final_logit_softcapping=5.0, **common),
        "granite": lambda: tf.GraniteConfig(logits_scaling=4.0, **common),
        "cohere": lambda: tf.CohereConfig(logit_scale=0.25, **common),
        "cohere2": lambda: tf.Cohere2Config(logit_scale=0.25, **{**common, **mixed}),
        "stablelm": lambda: tf.StableLmConfig(**common),
        "gpt_neox": lambda: tf.GPTNeoXConfig(**{k: v for k, v in common.items() if k != "num_key_value_heads"}),
        "gpt2": lambda: tf.GPT2Config(vocab_size=vocab, n_embd=32, n_layer=2, n_head=4, n_positions=128,
                                      pad_token_id=0, bos_token_id=None, eos_token_id=None),
        "qwen3_moe": lambda: tf.Qwen3MoeConfig(head_dim=8, num_experts=4, num_experts_per_tok=2,
                                               moe_intermediate_size=32, **common),
    }
    return make[arch]()


ARCHS = ["llama", "qwen2", "qwen3", "qwen3-window", "smollm3", "mistral", "mistral-window", "phi3", "olmo", "olmo2",
         "gemma", "gemma2", "gemma3", "gemma3-softcap", "vaultgemma", "nanochat", "granite", "cohere", "cohere2",
         "stablelm", "gpt_neox", "gpt2", "qwen3_moe"]
ARCH_PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14, 15, 16], [3], [40, 41, 42, 43], [77, 2, 91, 50, 12], [9, 9],
                [1, 2, 3, 4, 5, 6, 7], [60]]


def arch_model(arch, seed=0, vocab=ARCH_VOCAB):
    """A tiny random model of the architecture, its matrices drawn wide (std 0.2) as in tiny_model."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(arch_config(arch, vocab))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.2)
    return model.eval()


def varied_eos(free, cap):
    """Two EOS ids, chosen from EOS-free greedy rollouts, that stop the rows at the most different lengths (some
    rows early, some at the cap), so that rows leave the batch and refills join it at different steps."""
    def lengths(eos):
        return [next((k + 1 for k, t in enumerate(r.tokens) if t in eos), cap) for r in free]
    tokens = sorted({t for r in free for t in r.tokens})
    pairs = [(a, b) for a in tokens for b in tokens if a < b]
    return list(max(pairs, key=lambda e: (len(set(lengths(e))), cap in lengths(e))))


def own_logprobs(model, prompts, responses, temperature):
    """log_softmax(model(prompt + response).logits / T) at the response tokens, row by row: (N,) float32."""
    with torch.no_grad():
        return torch.cat(naive_response_logprobs(model, prompts, responses, temperature))


@pytest.mark.parametrize("arch", ARCHS)
def test_every_architecture_greedy_matches_generate_with_refill(arch):
    # Whole batch, one row at a time and 3 rows in flight (refills join mid-flight against caches of another width;
    # finished rows trim the cache's leading columns): each row token-identical to generate on the whole batch.
    model = arch_model(arch)
    free = sample(model, ARCH_PROMPTS, max_new_tokens=12, temperature=0, eos_token_id=1000)
    eos = varied_eos(free, 12)
    theirs = generate_responses(model, ARCH_PROMPTS, max_new_tokens=12, eos=eos)
    lengths = [len(t) for t in theirs]
    assert len(set(lengths)) >= 3 and max(lengths) == 12, f"want rows of varied lengths, got {lengths}"
    whole = sample(model, ARCH_PROMPTS, max_new_tokens=12, temperature=0, eos_token_id=eos)
    assert [r.tokens for r in whole] == theirs
    for mbs in (1, 3):
        ours = sample(model, ARCH_PROMPTS, max_new_tokens=12, temperature=0, eos_token_id=eos, max_batch_size=mbs,
                      min_refill=1)
        assert [r.tokens for r in ours] == theirs, f"max_batch_size={mbs}"
        assert all(torch.allclose(a.logprobs, b.logprobs, atol=1e-5) for a, b in zip(ours, whole))
    # the greedy rollouts' log-probs are the temperature-1 log-softmax of the model's own logits
    want = own_logprobs(model, ARCH_PROMPTS, theirs, 1.0)
    assert (torch.cat([r.logprobs for r in whole]) - want).abs().max() < 1e-5


@pytest.mark.parametrize("arch", ARCHS)
def test_every_architecture_logprobs_and_samples(arch):
    # response_logprobs equals the log-softmax of the model's own logits (head transform included) / T, and sampled
    # rows are the same whatever their batch mates (all at once or two in flight with refills)
    model = arch_model(arch, seed=1)
    temperature = 0.7
    run = lambda eos, **kw: sample(model, ARCH_PROMPTS, max_new_tokens=10, temperature=temperature, top_p=0.95,
                                   eos_token_id=eos, generator=torch.Generator().manual_seed(0), **kw)
    eos = varied_eos(run(1000), 10)  # a row's draws depend on its seed and step only: EOS just cuts them short
    whole, two = run(eos), run(eos, max_batch_size=2, min_refill=1)
    assert len({len(r.tokens) for r in whole}) >= 3, "want rows of varied lengths, so that refills happen"
    assert [r.tokens for r in two] == [r.tokens for r in whole]
    responses = [r.tokens for r in whole]
    logp, mask = response_logprobs(model, ARCH_PROMPTS, responses, pad_token_id=0, temperature=temperature)
    want = own_logprobs(model, ARCH_PROMPTS, responses, temperature)
    assert (logp[mask] - want).abs().max() < 1e-5
    for rolls in (whole, two):
        assert (torch.cat([r.logprobs for r in rolls]) - want).abs().max() < 1e-5


@pytest.mark.parametrize("arch", ["gemma2", "gemma3-softcap", "cohere", "granite"])
def test_transformed_head_response_logprobs_gradients_match_autograd(arch):
    # the kernel's hand-written backward through the scale and the soft-cap, against autograd of transformers' own
    # forward (its lm_head, scale and tanh included), for every parameter of the model
    model = arch_model(arch, seed=2)
    prompts, responses = [[5, 6, 7], [8, 9], [3, 4, 5, 6, 7, 8]], [[20, 21, 22, 23], [30], [40, 41, 42, 43, 44, 45]]
    temperature = 0.8
    upstream = torch.randn(3, 6, generator=torch.Generator().manual_seed(3))  # (B, T)
    logp, mask = response_logprobs(model, prompts, responses, pad_token_id=0, temperature=temperature, chunk_size=4)
    (logp * upstream).sum().backward()
    ours = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    ref = naive_response_logprobs(model, prompts, responses, temperature)
    sum((r * upstream[i, : len(r)]).sum() for i, r in enumerate(ref)).backward()
    assert (logp[mask] - torch.cat(ref).detach()).abs().max() < 1e-5
    assert ours.keys() == {n for n, p in model.named_parameters() if p.grad is not None}
    for n, p in model.named_parameters():
        if p.grad is not None and p.grad.abs().max() > 0:
            assert rel_err(ours[n], p.grad.double()) < 1e-4, n


def naive_head_logprobs(hidden, weight, targets, temperature, logit_scale, softcap):
    """The float64 reference of a transformed head, through full logits and autograd: (N,) float64."""
    z = (hidden.double() @ weight.double().T) * logit_scale  # (N, V)
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    return torch.log_softmax(z / temperature, dim=-1).gather(1, targets.unsqueeze(1)).squeeze(1)  # (N,)


@pytest.mark.parametrize("logit_scale,softcap,temperature", [(0.25, None, 1.0), (1.0, 3.0, 0.7), (2.5, 5.0, 1.3),
                                                              (0.125, 30.0, 1.0)])
def test_token_logprobs_with_head_transform_matches_float64_autograd(logit_scale, softcap, temperature):
    # chunks that divide neither N nor V; logits of size ~10, so a cap of 3 saturates many of them (tanh' near 0)
    torch.manual_seed(14)
    n, h, v = 45, 16, 203
    hidden, weight, targets = torch.randn(n, h) * 2, torch.randn(v, h), torch.randint(0, v, (n,))
    upstream = torch.randn(n, dtype=torch.float64)  # (N,)
    hh, ww = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    ours = token_logprobs(hh, ww, targets, temperature=temperature, logit_scale=logit_scale, softcap=softcap,
                          chunk_size=16, vocab_chunk_size=64)
    (ours.double() * upstream).sum().backward()
    h64, w64 = hidden.double().requires_grad_(True), weight.double().requires_grad_(True)
    ref = naive_head_logprobs(h64, w64, targets, temperature, logit_scale, softcap)
    (ref * upstream).sum().backward()
    assert (ours.double() - ref).abs().max() < 2e-5
    assert rel_err(hh.grad, h64.grad) < 2e-5 and rel_err(ww.grad, w64.grad) < 2e-5
    # the transform matters: a plain head gives other log-probs
    assert (token_logprobs(hidden, weight, targets, temperature=temperature).double() - ref).abs().max() > 1e-2


def test_token_logprobs_head_transform_gradcheck():
    torch.manual_seed(15)
    hidden = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(7, 4, dtype=torch.float64, requires_grad=True)
    targets = torch.tensor([0, 6, 3, 3, 5])
    fn = lambda h, w: token_logprobs(h, w, targets, temperature=0.8, logit_scale=1.5, softcap=2.0, chunk_size=2,
                                     vocab_chunk_size=3)
    assert torch.autograd.gradcheck(fn, (hidden, weight))


def test_unsupported_heads_are_refused_with_a_value_error():
    # a field that changes the logits in a family whose forward sampler.py has not been checked against, and a head
    # with a bias: ValueError naming the class and the field (never an assert, which `python -O` would drop)
    model = arch_model("llama")
    model.config.logit_scale = 2.0  # LlamaForCausalLM's forward ignores it, but a family that has it may not
    for call in (lambda: sample(model, [[1, 2]], max_new_tokens=2, eos_token_id=0),
                 lambda: response_logprobs(model, [[1, 2]], [[3]], pad_token_id=0)):
        with pytest.raises(ValueError, match=r"LlamaForCausalLM sets config\.logit_scale=2\.0"):
            call()
    model.config.logit_scale = 1.0  # the value of a plain head is fine
    assert len(sample(model, [[1, 2]], max_new_tokens=2, eos_token_id=0)) == 1
    biased = arch_model("llama")
    biased.lm_head.bias = torch.nn.Parameter(torch.zeros(ARCH_VOCAB))
    with pytest.raises(ValueError, match="LlamaForCausalLM's lm_head has a bias"):
        response_logprobs(biased, [[1, 2]], [[3]], pad_token_id=0)


# ------------------------------------------------------------------------------------------------
# one prefill per prompt (departure 11): n copies of each prompt, shared against unshared
# ------------------------------------------------------------------------------------------------


def copies(prompts, n):
    """n copies of every prompt, interleaved (prompt i's copies are not adjacent, as on one rank of several)."""
    return [p for _ in range(n) for p in prompts]


@pytest.mark.parametrize("arch", ARCHS)
def test_every_architecture_shared_prefix_equals_unshared(arch):
    # Greedy and sampled rows with 3 copies of every prompt, 2-3 rows in flight (refills take some
    # copies of a prompt now and the rest later, from the stash): token-identical to share_prefix=False, log-probs
    # within 1e-5; each distinct prompt is prefilled exactly once; response_logprobs with shared prompts equals the
    # model's own log-softmax
    model = arch_model(arch, seed=3)
    prompts = copies(ARCH_PROMPTS, 3)
    distinct = sum(len(p) for p in ARCH_PROMPTS)
    for temperature, mbs in ((0, 3), (0.7, 2)):
        run = lambda share, stats=None: sample(model, prompts, max_new_tokens=8, temperature=temperature, top_p=0.95,
                                               eos_token_id=[1, 2], generator=torch.Generator().manual_seed(0),
                                               max_batch_size=mbs, min_refill=1, share_prefix=share, stats=stats)
        stats = {}
        ours, theirs = run(True, stats), run(False)
        assert [r.tokens for r in ours] == [r.tokens for r in theirs], f"T={temperature}, max_batch_size={mbs}"
        assert all(torch.allclose(a.logprobs, b.logprobs, atol=1e-5) for a, b in zip(ours, theirs))
        assert stats["prefill_tokens"] == distinct, f"T={temperature}, max_batch_size={mbs}"
    responses = [r.tokens for r in ours]
    logp, mask = response_logprobs(model, prompts, responses, pad_token_id=0, temperature=0.7)
    assert (logp[mask] - own_logprobs(model, prompts, responses, 0.7)).abs().max() < 1e-5


@pytest.mark.parametrize("static", [False, True])
def test_shared_prefix_static_and_default_paths_with_refills(static):
    # 4 copies of each prompt through 2 and 7 slots, greedy and sampled: identical to the unshared path
    model = tiny_model("llama", seed=10)
    prompts = copies(PROMPTS, 4)
    for temperature in (0, 0.8):
        run = lambda share, mbs: sample(model, prompts, max_new_tokens=10, temperature=temperature, top_p=0.9,
                                        eos_token_id=[1, 2], generator=torch.Generator().manual_seed(0),
                                        max_batch_size=mbs, min_refill=1, static=static, share_prefix=share)
        for mbs in (2, 7):
            ours, theirs = run(True, mbs), run(False, mbs)
            assert [r.tokens for r in ours] == [r.tokens for r in theirs], f"T={temperature}, max_batch_size={mbs}"
            assert all(torch.allclose(a.logprobs, b.logprobs, atol=1e-5) for a, b in zip(ours, theirs))
    assert len({len(r.tokens) for r in ours}) > 1, "want rows of different lengths, so that refills happen"


@pytest.mark.parametrize("arch", ["llama", "gemma3-softcap", "qwen3-window", "gpt2"])
def test_shared_prefix_gradients_match_unshared_autograd(arch):
    # the training forward with shared prompts (full, sliding and absolute-position models) against autograd of
    # the per-row forward: values within 1e-5, every parameter's gradient |err| / |grad| < 1e-4
    model = arch_model(arch, seed=4)
    prompts = [[5, 6, 7], [8, 9], [5, 6, 7], [3, 4, 5, 6, 7, 8], [8, 9], [5, 6, 7]]
    responses = [[20, 21, 22, 23], [30], [40, 41, 42], [50, 51, 52, 53, 54, 55], [], [60, 61, 62, 63, 64]]
    upstream = torch.randn(6, 6, generator=torch.Generator().manual_seed(3))  # (B, T)
    grads, values = [], []
    for share in (True, False):
        model.zero_grad()
        logp, mask = response_logprobs(model, prompts, responses, pad_token_id=0, temperature=0.8, chunk_size=4,
                                       share_prefix=share)
        (logp * upstream).sum().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        values.append(logp[mask].detach())
    assert (values[0] - values[1]).abs().max() < 1e-5
    assert grads[0].keys() == grads[1].keys() and grads[0]
    for n, g in grads[1].items():
        assert rel_err(grads[0][n], g.double()) < 1e-4, n


def test_shared_prefix_falls_back_under_gradient_checkpointing():
    # transformers' checkpointed layers drop the KV cache while grad is on: the shared pass would score responses
    # without their prompts, so response_logprobs runs the per-row forward there (the same values as unshared)
    model = tiny_model("qwen3", seed=5)
    (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()
    model.train()
    prompts, responses = copies([[5, 6, 7], [8, 9, 10, 11]], 2), [[20, 21, 22], [30, 31], [40], [50, 51, 52, 53]]
    shared, mask = response_logprobs(model, prompts, responses, pad_token_id=0)
    model.eval()
    with torch.no_grad():
        want, _ = response_logprobs(model, prompts, responses, pad_token_id=0, share_prefix=False)
    assert (shared[mask].detach() - want[mask]).abs().max() < 1e-5


# ------------------------------------------------------------------------------------------------
# stop strings (departure 12): the architecture sweep against generate(stop_strings=..., tokenizer=...) with the
# real tokenizers of ../shared/tokenizers
# ------------------------------------------------------------------------------------------------

SHARED_TOKENIZERS = Path(__file__).resolve().parents[2] / "shared" / "tokenizers"
REAL_TOKENIZERS = ["qwen3", "smollm3", "llama3_2"]
# A tiny model over the first 512 ids of a real byte-level vocabulary: its 256 single bytes (printable characters,
# "\n", " ", and UTF-8 fragments that decode to U+FFFD alone) and the first merges ("in", " t", "\n\n", " the", ...),
# so that tokens carry one or several characters
STOP_VOCAB = 512
NEVER = 10**6  # an EOS id no model here produces: rows end on a stop string or at the cap


@functools.lru_cache(maxsize=None)
def real_tokenizer(name):
    if not (SHARED_TOKENIZERS / name).is_dir():
        pytest.skip(f"the real tokenizers are not at {SHARED_TOKENIZERS} (../shared from the checkout)")
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(SHARED_TOKENIZERS / name))


def text_of(tok, ids):
    """A response's text as the trainer decodes it."""
    return tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def first_stop(tok, ids, stops):
    """The naive reference: the first j whose response text tokens[:j + 1] contains a stop string, or None."""
    return next((j for j in range(len(ids)) if any(s in text_of(tok, ids[: j + 1]) for s in stops)), None)


def pick_stops(tok, prompts, free, pad):
    """Two stop strings read off the EOS-free greedy rows `free`: one inside some row's first token, one across a
    token boundary of another row, chosen (the first pair in a fixed order) so that together they stop some row at
    its first token, some row on a string split across tokens, and leave some row to the cap, and so that no
    string is first completed across the prompt (where generate matches and we do not; tested on its own below)."""
    def pieces(ids):
        return [text_of(tok, [t]) for t in ids]

    def clean(s):
        return s and "\ufffd" not in s and s.isprintable() or s in ("\n", "\n\n", " \n")
    firsts, splits = [], []
    for r in free:
        p = pieces(r.tokens)
        if clean(p[0]):
            firsts.append(p[0][:2])  # the token's text, or its first two characters (the token runs past it)
        splits += [p[j - 1][-1:] + p[j][:1] for j in range(1, len(p)) if clean(p[j - 1][-1:] + p[j][:1])]
    for a in dict.fromkeys(firsts):
        for b in dict.fromkeys(splits):
            stops = [a, b]
            ends = [first_stop(tok, r.tokens, stops) for r in free]
            with_prompt = [first_stop(tok, [pad] * (max(map(len, prompts)) - len(p)) + p + r.tokens, stops)
                           for p, r in zip(prompts, free)]
            if any(w is not None and (e is None or w < e + max(map(len, prompts)))
                   for w, e in zip(with_prompt, ends)):
                continue  # generate would stop some row on a string that starts in the prompt
            split = any(e is not None and e > 0 and not any(s in pieces(r.tokens)[e] for s in stops)
                        for e, r in zip(ends, free))
            if 0 in ends and None in ends and split:
                return stops, ends
    pytest.fail("no pair of stop strings covers a first-token stop, a split stop and an unstopped row")


@pytest.mark.parametrize("arch", ARCHS)
def test_every_architecture_stop_strings_match_generate(arch):
    # Greedy rows with two stop strings (one inside a first token, one split across two tokens) against
    # transformers' generate(stop_strings=..., tokenizer=...) and the naive reference (the first prefix whose text
    # holds a string), each architecture with one of the three real tokenizers: the whole batch, 3 rows in flight
    # with refills, two copies of every prompt (one prefill per prompt), and the static decode where the model
    # allows it. The stopping token is kept; finish says "stop" / "length" and names the string.
    tok = real_tokenizer(REAL_TOKENIZERS[ARCHS.index(arch) % len(REAL_TOKENIZERS)])
    model = arch_model(arch, vocab=STOP_VOCAB)
    cap = 12
    free = sample(model, ARCH_PROMPTS, max_new_tokens=cap, temperature=0, eos_token_id=NEVER)
    pad = next(t for t in range(STOP_VOCAB) if all(t not in r.tokens for r in free))  # never a real token here
    stops, ends = pick_stops(tok, ARCH_PROMPTS, free, pad)
    want = [r.tokens if e is None else r.tokens[: e + 1] for r, e in zip(free, ends)]
    ids, mask = left_pad(ARCH_PROMPTS, pad)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=cap, do_sample=False, eos_token_id=NEVER,
                         pad_token_id=pad, stop_strings=stops, tokenizer=tok)[:, ids.shape[1]:].tolist()
    theirs = [[t for t in row if t != pad] for row in out]  # a stopped row is padded after its last token
    assert theirs == want, f"generate against the naive reference, stops {stops!r}"
    windows = sampler._layer_windows(model.config)
    runs = {"whole": dict(), "3 in flight": dict(max_batch_size=3, min_refill=1)}
    if all(w is None for w in windows):
        runs["static"] = dict(static=True, max_batch_size=3, min_refill=1)
    for name, kw in runs.items():
        ours = sample(model, ARCH_PROMPTS, max_new_tokens=cap, temperature=0, eos_token_id=NEVER,
                      stop_strings=stops, tokenizer=tok, **kw)
        assert [r.tokens for r in ours] == theirs, f"{name}, stops {stops!r}"
        for r, e in zip(ours, ends):
            assert (r.finish, r.ended_with_eos) == (("length", False) if e is None else ("stop", False)), name
            assert r.stop is None or r.stop in text_of(tok, r.tokens) and r.stop in stops
        assert all(torch.allclose(a.logprobs, b.logprobs[: len(a.tokens)], atol=1e-5) for a, b in zip(ours, free))
    shared = sample(model, copies(ARCH_PROMPTS, 2), max_new_tokens=cap, temperature=0, eos_token_id=NEVER,
                    stop_strings=stops, tokenizer=tok, max_batch_size=5, min_refill=1)
    assert [r.tokens for r in shared] == copies(theirs, 2), "one prefill per prompt"


def common_pairs(rollouts, tok, k: int) -> list[str]:
    """The k commonest two-character strings in the rollouts' text (from their second token on), as stop strings
    that land inside responses."""
    counts = {}
    for r in rollouts:
        for j in range(1, len(r.tokens) - 1):
            s = text_of(tok, r.tokens[j : j + 2])
            if "\ufffd" not in s and len(s) >= 2:
                counts[s[:2]] = counts.get(s[:2], 0) + 1
    return sorted(counts, key=lambda s: (-counts[s], s))[:k]


def test_stop_strings_end_rows_like_eos_when_sampling():
    # T = 1 with refills: every row equals the same row sampled without stop strings, cut at its first token whose
    # text holds a string (the random stream is per row and step, departure 7), EOS winning over a string that the
    # EOS token cannot complete anyway; the log-probs are the uncut row's (up to round-off of other batch shapes)
    tok = real_tokenizer("qwen3")
    model = arch_model("llama", seed=2, vocab=STOP_VOCAB)
    prompts = copies(ARCH_PROMPTS, 2)
    run = lambda eos, **kw: sample(model, prompts, max_new_tokens=16, temperature=1.0, eos_token_id=eos,
                                   generator=torch.Generator().manual_seed(0), max_batch_size=4, min_refill=1, **kw)
    eos = varied_eos(run(NEVER), 16)  # EOS ids that end some rows early (a row's draws do not depend on them)
    free = run(eos)
    stops = common_pairs(free, tok, 3)  # the commonest two-character strings
    ours = run(eos, stop_strings=stops, tokenizer=tok)
    finishes = []
    for a, b in zip(ours, free):
        e = first_stop(tok, b.tokens[:-1] if b.ended_with_eos else b.tokens, stops)
        want = b.tokens if e is None else b.tokens[: e + 1]
        assert a.tokens == want and torch.allclose(a.logprobs, b.logprobs[: len(want)], atol=1e-5)
        finishes.append(a.finish)
        assert a.finish == ("stop" if e is not None else b.finish)
    assert {"stop", "eos"} <= set(finishes), f"want rows that end both ways, got {finishes}"


@pytest.mark.parametrize("static", [False, True])
def test_stop_strings_mid_window_end_where_a_read_every_step_ends_them(static):
    # departure 12 without a read every step: with sync_every 8 the host scans each row's last 8 tokens at the
    # regular read, and a row whose string completed inside the window ends at that token (later draws discarded):
    # the same tokens, finishes, strings and log-probs as reading every step, with stops landing mid-window
    tok = real_tokenizer("qwen3")
    model = arch_model("llama", seed=2, vocab=STOP_VOCAB)
    prompts = copies(ARCH_PROMPTS, 2)
    run = lambda sync, **kw: sample(model, prompts, max_new_tokens=24, temperature=1.0, eos_token_id=NEVER,
                                    generator=torch.Generator().manual_seed(0), max_batch_size=5, min_refill=1,
                                    static=static, sync_every=sync, **kw)
    free = run(8)
    stops = common_pairs(free, tok, 2)
    stats = {}
    every, windowed = run(1, stop_strings=stops, tokenizer=tok), run(8, stop_strings=stops, tokenizer=tok,
                                                                    stats=stats)
    assert [r.tokens for r in windowed] == [r.tokens for r in every]
    assert [(r.finish, r.stop) for r in windowed] == [(r.finish, r.stop) for r in every]
    assert all(torch.equal(a.logprobs, b.logprobs) or torch.allclose(a.logprobs, b.logprobs, atol=1e-5)
               for a, b in zip(windowed, every))
    for a, b in zip(windowed, free):  # the naive reference: the uncut row cut at its first string
        e = first_stop(tok, b.tokens, stops)
        assert a.tokens == (b.tokens if e is None else b.tokens[: e + 1])
    stopped = [len(r.tokens) for r in windowed if r.finish == "stop"]
    assert any(n % 8 != 0 for n in stopped), f"want stops inside a read's window, got lengths {stopped}"
    assert stats["host_reads"] < stats["decode_steps"] / 4, stats


def test_stop_strings_are_matched_in_the_response_only():
    # A string that starts in the prompt's last token and ends in the response's first: generate stops there (its
    # StopStringCriteria looks at the sequence's last tokens, prompt included); the sampler matches the response's
    # own text, as vLLM does, and stops only where the string lies wholly in the response (departure 12)
    tok = real_tokenizer("llama3_2")
    model = arch_model("qwen3", vocab=STOP_VOCAB)
    prompt = [12, 34, 56]
    free = sample(model, [prompt], max_new_tokens=10, temperature=0, eos_token_id=NEVER)[0].tokens
    stop = text_of(tok, [prompt[-1]])[-1] + text_of(tok, free[:1])[:1]  # prompt's last character + response's first
    theirs = model.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False, eos_token_id=NEVER,
                            pad_token_id=0, stop_strings=[stop], tokenizer=tok)[0, len(prompt):].tolist()
    assert theirs == free[:1], "generate stops at the first token, on the string that straddles the prompt"
    ours = sample(model, [prompt], max_new_tokens=10, temperature=0, eos_token_id=NEVER, stop_strings=[stop],
                  tokenizer=tok)[0]
    e = first_stop(tok, free, [stop])
    assert ours.tokens == (free if e is None else free[: e + 1]) and len(ours.tokens) > 1


def test_stop_string_window_is_incremental_and_skips_special_tokens():
    # The detector alone, row by row against the naive reference: strings spanning 1-4 tokens, multi-byte
    # characters split over byte tokens, a special token inside the string's span (skipped by the decode, so it
    # takes no place in the window), two strings completing at the same token (the one starting first wins)
    tok = real_tokenizer("qwen3")
    texts = ["abc 12\n\nQ: 7", "é ü 😀 x😀y", "Answer: 42. Q: next", "no stop here at all"]
    stops = ("\n\n", "😀y", "Q:", ". Q")
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    rows = [tok.encode(t, add_special_tokens=False) for t in texts]
    rows[3] = rows[3][:2] + [im_end] + rows[3][2:]
    rows.append(tok.encode("x\n", add_special_tokens=False) + [im_end] + tok.encode("\nQ", add_special_tokens=False))
    det = sampler._StopStrings(stops, tok)
    hit_at = {}
    for step in range(max(map(len, rows))):
        live = [i for i, r in enumerate(rows) if step < len(r) and i not in hit_at]
        hits = det.scan(live, [rows[i][step] for i in live], [False] * len(live))
        for i, h in zip(live, hits):
            if h is not None:
                hit_at[i] = (step, h)
                det.forget(i)
    want = {i: first_stop(tok, r, stops) for i, r in enumerate(rows)}
    assert {i: s for i, (s, _) in hit_at.items()} == {i: j for i, j in want.items() if j is not None}
    assert hit_at[0][1] == "\n\n" and hit_at[1][1] == "😀y" and hit_at[2][1] == ". Q" and 3 not in hit_at
    assert hit_at[4][1] == "\n\n" and rows[4][hit_at[4][0] - 1] == im_end


def test_stop_strings_bad_input():
    model = arch_model("llama", vocab=STOP_VOCAB)
    with pytest.raises(ValueError, match="tokenizer"):
        sample(model, [[5]], max_new_tokens=2, eos_token_id=NEVER, stop_strings=["x"])
    with pytest.raises(ValueError, match="non-empty strings"):
        sample(model, [[5]], max_new_tokens=2, eos_token_id=NEVER, stop_strings=["x", ""], tokenizer=object())
    # no stop strings, or an empty list: the EOS-and-cap path, whatever the tokenizer
    a = sample(model, [[5]], max_new_tokens=4, temperature=0, eos_token_id=NEVER, stop_strings=[])
    assert a[0].finish == "length" and a[0].stop is None and len(a[0].tokens) == 4
