"""Tests for sampler.py: chunked log-probs against a float64 reference, response_logprobs against transformers' own
full-logits forward, and the hand-written sampler against transformers' generate.

Tolerances (stated once here, used below):
* float32 inputs vs the float64 naive reference: log-probs |err| < 2e-5, gradients |err| / |grad| < 2e-5 (max abs
  error over the gradient's max abs value); float32 round-off on logits of size ~10 is ~1e-6.
* bf16 inputs vs the float64 reference on the same (bf16-rounded) inputs: log-probs |err| < 3e-2, gradients
  |err| / |grad| < 3e-2: the logits matmul rounds its output to bf16 (8 mantissa bits, ~0.4% of a logit).
* sampler log-probs vs a fresh forward pass: |err| < 1e-5 (different batch shapes, same float32 arithmetic).
* sampling frequencies vs softmax(logits / T): total variation < 0.03 over 20,000 draws of a 16-token vocabulary
  (the expected TV from sampling noise alone is about 0.01).
"""

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

from sampler import Rollout, response_logprobs, sample, token_logprobs

torch.set_num_threads(1)  # the CI box is shared; one thread is also the fastest for these tiny shapes


# ---------------------------------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------------------------------


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


# ---------------------------------------------------------------------------------------------------------------------
# token_logprobs
# ---------------------------------------------------------------------------------------------------------------------


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


# ---------------------------------------------------------------------------------------------------------------------
# response_logprobs
# ---------------------------------------------------------------------------------------------------------------------


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


# ---------------------------------------------------------------------------------------------------------------------
# sample
# ---------------------------------------------------------------------------------------------------------------------


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


def test_finished_rows_leave_the_batch():
    model = tiny_model("qwen3", seed=9)
    free = sample(model, PROMPTS, max_new_tokens=16, temperature=0, eos_token_id=1000)
    eos = [free[0].tokens[2], free[3].tokens[5]]
    seen = []
    base = model.model
    hook = base.register_forward_pre_hook(lambda mod, args, kw: seen.append(kw["input_ids"].shape[0]), with_kwargs=True)
    try:
        ours = sample(model, PROMPTS, max_new_tokens=16, temperature=0, eos_token_id=eos)
    finally:
        hook.remove()
    alive = [sum(len(r.tokens) > s for r in ours) for s in range(16)]  # rows still running when token s is drawn
    assert seen == alive[: len(seen)] and len(seen) == max(len(r.tokens) for r in ours)
    assert seen[-1] < seen[0]


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
