"""GRAFT sampler and log-prob path: a hand-written batched sampler and a chunked log-prob for any causal LM.

What this file does
-------------------
Every log-probability in GRAFT (behaviour policy at sampling time, current policy in the loss, the compatibility
score of the paper's Eqs. 6-8) is ``log softmax(h @ W.T / temperature)[target]`` where ``h`` is the model's final
hidden state and ``W`` its lm_head matrix. This file computes that quantity in two places that must agree:

* ``sample`` draws responses token by token and records the log-prob of each drawn token (behaviour log-probs);
* ``response_logprobs`` recomputes the same log-probs with one forward pass over prompt + response (training and
  compatibility), through ``token_logprobs``, which never materialises the (N, V) logits.

It imports torch, transformers' ``DynamicCache`` and tqdm only; nothing of GRAFT's, so it can be copied alone.

API
---
``token_logprobs(hidden, weight, targets, *, temperature=1.0, chunk_size=1024, vocab_chunk_size=None) -> (N,) float32``
    hidden (N, H) any float dtype, weight (V, H), targets (N,) long. log p(target) at the given temperature, computed in
    chunks of ``chunk_size`` tokens x ``vocab_chunk_size`` vocabulary rows with an online log-sum-exp; backward
    recomputes each chunk. Differentiable w.r.t. hidden and weight. (float64 inputs give float64 log-probs.)
``response_logprobs(model, prompts, responses, *, pad_token_id, temperature=1.0, chunk_size=1024) -> (logp, mask)``
    logp (B, T) float32 and mask (B, T) bool, T = longest response; logp[i, t] = log p(responses[i][t] | prompts[i] +
    responses[i][:t]), 0 where mask is False. Differentiable w.r.t. the model's parameters when grad is enabled.
``Rollout(tokens, logprobs, ended_with_eos)``
    one sampled response: token ids (EOS included when it stopped at EOS), (len(tokens),) float32 CPU log-probs.
``sample(model, prompts, *, max_new_tokens, temperature=1.0, top_p=1.0, eos_token_id, pad_token_id=None,
         generator=None, progress=False) -> list[Rollout]``
    batched autoregressive sampling with a KV cache; rows that reach EOS leave the batch.

Departures and shortcuts (read these before copying)
----------------------------------------------------
1. The lm_head is assumed to be a plain bias-free linear map ``logits = h @ W.T``: models that scale, soft-cap or
   bias their logits (Gemma-2 soft-capping, Granite/Cohere logit scaling) are refused by ``_lm_head_weight`` rather
   than silently given different log-probs from ``generate``.
2. Log-probs of the sampled tokens are the temperature-scaled FULL-vocabulary log-probs, even when top-p truncates
   the distribution we sample from (that is what ``response_logprobs`` recomputes and the compatibility score
   uses). For temperature 0 (greedy) they are temperature-1 log-probs.
3. The logits matmul runs in the dtype ``hidden @ weight.T`` would run in at the call site, as the model's own
   lm_head would: the inputs' dtype, or autocast's (bf16) when ``token_logprobs`` is called under autocast with
   float32 tensors. That dtype is fixed when the forward runs and the backward recomputes its tiles in it with
   autocast switched off, so a ``loss.backward()`` outside the autocast block (as trainers write it) still sees
   probabilities that sum to 1. Everything after the matmul (temperature, log-sum-exp, softmax, gradient of the
   logits) is float32, and the weight gradient is accumulated over chunks in float32. On CPU, where bf16 matmuls
   are slow, pass float32 tensors. float64 inputs are computed and returned in float64 (the contract says float32;
   float64 is what ``gradcheck`` needs).
4. ``token_logprobs`` does not check that targets lie in [0, V) (that would need a host sync on every call);
   ``response_logprobs`` and ``sample`` check their Python inputs instead.
5. ``sample`` switches the model to eval mode for the duration of the call (dropout off while sampling) and restores
   its previous mode afterwards. Its decode loop runs under ``torch.inference_mode`` (cheaper per op than
   ``no_grad``); the returned log-prob tensors are ordinary tensors.
6. Finished rows are dropped from the KV cache (``DynamicCache.batch_select_indices``, one copy of the cache per
   step on which some row finishes). Left-padding columns that become all-padding after pruning are not trimmed.
7. Sampling uses ``torch.multinomial`` with the caller's generator. The random stream consumed depends on the batch
   composition, so a row's sample depends on its batch mates (as in ``generate``); the same prompts, settings and
   seed give the same samples.
8. For SDPA models without sliding-window layers, a decode step's attention mask is handed to the model as a
   ready (B_alive, 1, 1, cur) boolean view of the preallocated padding mask (transformers passes 4D masks through
   untouched): one query attending to every cached column but the padding is exactly what its causal-mask builder
   would produce, minus the per-step cost. Other attention implementations get the 2D mask.
9. ``pad_token_id`` defaults to 0 in ``sample``: padding is masked out, so any id in [0, V) gives the same result.

Benchmark
---------
``python bench_sampler.py [--quick]`` prints peak memory, time and error of ``token_logprobs`` against the naive
full-logits path, and the tokens/s of ``sample`` against transformers' ``generate`` (README, Benchmarks).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from tqdm import tqdm
from transformers import DynamicCache

__all__ = ["token_logprobs", "response_logprobs", "sample", "Rollout"]


# ---------------------------------------------------------------------------------------------------------------------
# Chunked log-prob of target tokens: log_softmax(h @ W.T / T)[target] without ever holding (N, V) logits
# ---------------------------------------------------------------------------------------------------------------------

# When the caller does not choose a vocabulary chunk, a (tokens x vocab) tile holds at most this many float32 logits
# (2**23 = 32 MiB). Large enough that each tile's matmul runs at full speed, small enough that the few tiles alive at
# once (logits, their exp, the gradient) stay far below the naive path's N x V.
_TILE_ELEMENTS = 2**23


def _vocab_chunk(vocab_size: int, chunk_size: int, vocab_chunk_size: int | None) -> int:
    """Vocabulary rows per tile: the caller's choice, else the whole vocabulary if the tile stays under budget."""
    if vocab_chunk_size is not None:
        assert vocab_chunk_size > 0, f"vocab_chunk_size must be positive, got {vocab_chunk_size}"
        return vocab_chunk_size
    return max(1, min(vocab_size, _TILE_ELEMENTS // max(chunk_size, 1)))


def _tile_logits(h: torch.Tensor, w: torch.Tensor, temperature: float) -> torch.Tensor:
    """Logits of one tile. h (n, H), w (v, H) in the compute dtype -> (n, v) in float32 (float64 for float64
    inputs), already divided by the temperature."""
    z = torch.mm(h, w.t())  # (n, v)
    z = z.to(torch.promote_types(z.dtype, torch.float32))  # free for float32 / float64 inputs
    if temperature != 1.0:
        z = z.div_(temperature)  # division, not multiplication by 1/T, so it rounds as `logits / T` does in the sampler
    return z


def _target_index(targets: torch.Tensor, v0: int, v: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Where each target falls inside the vocabulary slice [v0, v0 + v): (in_slice (n,) bool, column (n, 1) long)."""
    col = targets - v0
    inside = (col >= 0) & (col < v)
    return inside, col.clamp(0, v - 1).unsqueeze(1)  # (n, 1): a valid column even for targets outside the slice


class _TokenLogprobs(torch.autograd.Function):
    """Autograd function behind ``token_logprobs``; see there for shapes. Saves only the (N,) log-sum-exp."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, chunk_size, vocab_chunk, cdt):
        # cdt: the dtype both matmul operands are brought to, fixed by token_logprobs before autograd runs, so the
        # forward and the backward (which may run under another autocast state, or none) compute the same tiles
        with torch.autocast(hidden.device.type, enabled=False):
            return _TokenLogprobs._forward(ctx, hidden, weight, targets, temperature, chunk_size, vocab_chunk, cdt)

    @staticmethod
    def _forward(ctx, hidden, weight, targets, temperature, chunk_size, vocab_chunk, cdt):
        n_tok, vocab = hidden.shape[0], weight.shape[0]
        adt = torch.promote_types(cdt, torch.float32)  # softmax arithmetic: float32, float64 only for float64 inputs
        lse = torch.empty(n_tok, dtype=adt, device=hidden.device)  # (N,)
        logp = torch.empty(n_tok, dtype=adt, device=hidden.device)  # (N,)
        for n0 in range(0, n_tok, chunk_size):
            h = hidden[n0 : n0 + chunk_size].to(cdt)  # (n, H)
            t = targets[n0 : n0 + chunk_size]  # (n,)
            run_max = torch.full((h.shape[0],), float("-inf"), dtype=adt, device=h.device)  # (n,)
            run_sum = torch.zeros(h.shape[0], dtype=adt, device=h.device)  # (n,)
            tgt = torch.zeros(h.shape[0], dtype=adt, device=h.device)  # (n,)
            for v0 in range(0, vocab, vocab_chunk):
                z = _tile_logits(h, weight[v0 : v0 + vocab_chunk].to(cdt), temperature)  # (n, v)
                inside, col = _target_index(t, v0, z.shape[1])
                # the target logit is read from the same tile values the normaliser uses, so they round alike
                tgt = tgt + torch.where(inside, z.gather(1, col).squeeze(1), 0.0)
                # online log-sum-exp: rescale the running sum to the new running max, then add this tile
                new_max = torch.maximum(run_max, z.amax(dim=1))  # (n,)
                run_sum = run_sum * torch.exp(run_max - new_max) + z.sub_(new_max.unsqueeze(1)).exp_().sum(dim=1)
                run_max = new_max
            lse[n0 : n0 + chunk_size] = run_max + torch.log(run_sum)
            logp[n0 : n0 + chunk_size] = tgt - lse[n0 : n0 + chunk_size]
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.cfg = (temperature, chunk_size, vocab_chunk, cdt)
        return logp

    @staticmethod
    def backward(ctx, grad_logp):
        # The caller's backward usually runs outside the autocast block its forward ran in (loss.backward() after
        # `with autocast: loss = ...`): autocast is switched off here and the tiles are recomputed in the dtype the
        # forward used, so that exp(z - lse) sums to 1 over the vocabulary (departure 3).
        with torch.autocast(grad_logp.device.type, enabled=False):
            return _TokenLogprobs._backward(ctx, grad_logp)

    @staticmethod
    def _backward(ctx, grad_logp):
        # d logp_i / d z_ij = (1[j = t_i] - p_ij) / T with z = h @ W.T; chain rule with the upstream gradient g_i:
        # grad_z = (g / T)[:, None] * (onehot(t) - p). Each tile's p is recomputed from the saved log-sum-exp.
        hidden, weight, targets, lse = ctx.saved_tensors
        temperature, chunk_size, vocab_chunk, cdt = ctx.cfg
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        n_tok, vocab = hidden.shape[0], weight.shape[0]
        adt = lse.dtype  # float32 (float64 for float64 inputs)
        grad_h = torch.empty_like(hidden) if need_h else None  # (N, H) in hidden's dtype
        # float32 accumulator for the weight gradient: many token chunks add into every row of it
        grad_w = torch.zeros(weight.shape, dtype=adt, device=weight.device) if need_w else None  # (V, H)
        g_scaled = grad_logp.to(adt) / temperature  # (N,)
        for n0 in range(0, n_tok, chunk_size):
            h = hidden[n0 : n0 + chunk_size].to(cdt)  # (n, H)
            t = targets[n0 : n0 + chunk_size]  # (n,)
            g = g_scaled[n0 : n0 + chunk_size]  # (n,)
            acc_h = torch.zeros(h.shape, dtype=adt, device=h.device) if need_h else None  # (n, H)
            for v0 in range(0, vocab, vocab_chunk):
                w = weight[v0 : v0 + vocab_chunk].to(cdt)  # (v, H)
                z = _tile_logits(h, w, temperature)  # (n, v)
                p = z.sub_(lse[n0 : n0 + chunk_size].unsqueeze(1)).exp_()  # (n, v) softmax probabilities, in place
                gz = p.mul_(-g.unsqueeze(1))  # (n, v) = -(g/T) p
                inside, col = _target_index(t, v0, gz.shape[1])
                gz.scatter_add_(1, col, torch.where(inside, g, 0.0).unsqueeze(1))  # + (g/T) at the target column
                gz = gz.to(cdt)  # no-op for float32; bf16 matmuls for bf16 inputs (departure 3)
                if need_h:
                    _add_matmul(acc_h, gz, w)  # (n, H) += (n, v) @ (v, H)
                if need_w:
                    _add_matmul(grad_w[v0 : v0 + vocab_chunk], gz.t(), h)  # (v, H) += (v, n) @ (n, H)
            if need_h:
                grad_h[n0 : n0 + chunk_size] = acc_h
        if need_w:
            grad_w = grad_w.to(weight.dtype)  # no copy for float32 weights
        return grad_h, grad_w, None, None, None, None, None


def _add_matmul(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc += a @ b, acc float32 (or float64): fused in place when a, b share its dtype, else their product is added."""
    if a.dtype == acc.dtype:
        acc.addmm_(a, b)
    else:
        acc.add_(torch.mm(a, b))


def token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    vocab_chunk_size: int | None = None,
) -> torch.Tensor:
    """log_softmax(hidden @ weight.T / temperature)[i, targets[i]] for every token i, in float32.

    Args:
        hidden: (N, H) final hidden states, any float dtype (N flattened tokens, H hidden size).
        weight: (V, H) lm_head matrix (V vocabulary). May be the input embedding's Parameter (tied embeddings):
            autograd adds this function's gradient to the embedding's.
        targets: (N,) long token ids in [0, V) (not checked, departure 4).
        temperature: > 0; logits are divided by it before the softmax.
        chunk_size: tokens per chunk.
        vocab_chunk_size: vocabulary rows per chunk; None picks the whole vocabulary if a chunk_size x V tile holds
            at most 2**23 logits, else the largest slice that does.

    Returns:
        (N,) float32 log-probabilities (float64 for float64 inputs, so that gradcheck can run). Differentiable w.r.t.
        hidden and weight; gradients come back in their dtypes.

    Memory: the forward keeps one (chunk_size, vocab_chunk) float32 tile alive at a time and saves only the (N,)
    log-sum-exp; the backward recomputes each tile (one extra matmul per tile) instead of storing (N, V) logits.
    """
    assert hidden.dim() == 2 and weight.dim() == 2, f"hidden (N, H), weight (V, H); got {hidden.shape}, {weight.shape}"
    assert hidden.shape[1] == weight.shape[1], f"hidden size mismatch: hidden {hidden.shape}, weight {weight.shape}"
    assert targets.shape == hidden.shape[:1], f"targets must be (N,)={hidden.shape[:1]}, got {targets.shape}"
    assert hidden.is_floating_point() and weight.is_floating_point(), "hidden and weight must be floating point"
    assert temperature > 0, f"temperature must be > 0 for log-probs, got {temperature}"
    assert chunk_size > 0, f"chunk_size must be positive, got {chunk_size}"
    vocab_chunk = _vocab_chunk(weight.shape[0], chunk_size, vocab_chunk_size)
    cdt = _matmul_dtype(hidden, weight)
    return _TokenLogprobs.apply(hidden, weight, targets.long(), float(temperature), int(chunk_size), vocab_chunk, cdt)


def _matmul_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype of the logits matmuls: what ``hidden @ weight.T`` would run in at the call site (departure 3).

    Under autocast that is autocast's dtype (bf16 / fp16 for float32 inputs, as the model's own lm_head would run);
    float64 is never cast (autocast leaves it alone too). Outside autocast it is the promoted input dtype."""
    dtype = torch.promote_types(hidden.dtype, weight.dtype)
    device = hidden.device.type
    if dtype != torch.float64 and torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return dtype


# ---------------------------------------------------------------------------------------------------------------------
# Model plumbing shared by response_logprobs and sample
# ---------------------------------------------------------------------------------------------------------------------


def _lm_head_weight(model) -> torch.Tensor:
    """The (V, H) lm_head matrix, after checking the head really is logits = h @ W.T (departure 1)."""
    head = model.get_output_embeddings()
    assert head is not None and hasattr(head, "weight"), f"{type(model).__name__} has no lm_head weight"
    assert getattr(head, "bias", None) is None, "lm_head with a bias is not supported (departure 1)"
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    for attr in ("final_logit_softcapping", "logit_scale", "logits_scaling"):
        value = getattr(cfg, attr, None)
        assert value in (None, 1, 1.0), f"config.{attr}={value}: scaled or capped logits are not supported"
    return head.weight


def _base_model(model):
    """The transformer body that returns final hidden states (after the last norm), without the lm_head."""
    base = getattr(model, model.base_model_prefix, None)
    assert base is not None and base is not model, f"cannot find the base model of {type(model).__name__}"
    return base


def _cache_kwarg(base) -> str:
    """Name of the KV-cache argument: transformers 5.x renamed `past_key_values` to `cache`."""
    params = inspect.signature(base.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _full_attention_sdpa(config) -> bool:
    """True if every layer is plain causal SDPA attention: no sliding window, no other kernel (departure 8)."""
    if getattr(config, "_attn_implementation", None) != "sdpa":
        return False
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return all(t == "full_attention" for t in layer_types)
    return getattr(config, "sliding_window", None) is None  # e.g. Mistral: one window for all layers, no layer_types


def _as_id_list(seq) -> list[int]:
    """A token-id sequence (list or 1-D tensor) as a list of Python ints."""
    if isinstance(seq, torch.Tensor):
        assert seq.dim() == 1, f"token ids must be 1-D, got shape {tuple(seq.shape)}"
        return seq.tolist()
    return [int(x) for x in seq]


def _check_ids(rows: list[list[int]], vocab: int, what: str) -> None:
    """Token ids out of [0, V) would index garbage in token_logprobs (departure 4): refuse them here."""
    for i, row in enumerate(rows):
        if row and (min(row) < 0 or max(row) >= vocab):
            raise ValueError(f"{what}[{i}] has a token id outside [0, {vocab}): min {min(row)}, max {max(row)}")


# ---------------------------------------------------------------------------------------------------------------------
# Log-probs of given responses: one forward pass to hidden states, then token_logprobs
# ---------------------------------------------------------------------------------------------------------------------


def response_logprobs(
    model,
    prompts,
    responses,
    *,
    pad_token_id: int,
    temperature: float = 1.0,
    chunk_size: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-probs of each response given its prompt, from one right-padded forward pass.

    Args:
        model: a transformers causal LM (``*ForCausalLM``) with a plain lm_head (departure 1).
        prompts: B token-id lists (or 1-D LongTensors), each of length >= 1.
        responses: B token-id lists (or 1-D LongTensors), possibly empty.
        pad_token_id: id written into padding slots (they are masked out, any valid id works).
        temperature: logits are divided by it, as in ``sample``.
        chunk_size: tokens per chunk in ``token_logprobs``.

    Returns:
        logp: (B, T) float32, T = longest response; logp[i, t] = log p(responses[i][t] | prompts[i] +
            responses[i][:t]); 0 where mask is False. Differentiable w.r.t. the model when grad is enabled.
        mask: (B, T) bool, True on real response tokens.
    """
    prompts = [_as_id_list(p) for p in prompts]
    responses = [_as_id_list(r) for r in responses]
    assert len(prompts) == len(responses), f"{len(prompts)} prompts but {len(responses)} responses"
    assert all(len(p) > 0 for p in prompts), "every prompt needs a token: its last predicts the first response token"
    weight = _lm_head_weight(model)
    device = weight.device
    _check_ids(prompts, weight.shape[0], "prompts")
    _check_ids(responses, weight.shape[0], "responses")
    n_rows = len(prompts)
    resp_len = [len(r) for r in responses]
    t_max = max(resp_len, default=0)
    mask = torch.arange(t_max).unsqueeze(0) < torch.tensor(resp_len, dtype=torch.long).unsqueeze(1)  # (B, T)
    mask = mask.to(device)
    if t_max == 0:
        # nothing to score: skip the forward pass (an all-empty batch would otherwise cost a full prompt pass)
        return torch.zeros(n_rows, 0, dtype=torch.float32, device=device), mask

    # Right padding: position ids are then the default arange, matching the per-row positions sample() uses.
    # The last response token predicts nothing we score, so it is not fed (saves one position per row).
    seqs = [p + r[:-1] for p, r in zip(prompts, responses)]
    length = max(len(s) for s in seqs)
    input_ids = torch.full((n_rows, length), pad_token_id, dtype=torch.long)  # (B, L)
    attention_mask = torch.zeros(n_rows, length, dtype=torch.long)  # (B, L)
    rows, cols, targets = [], [], []
    for i, (s, p, r) in enumerate(zip(seqs, prompts, responses)):
        input_ids[i, : len(s)] = torch.tensor(s, dtype=torch.long)
        attention_mask[i, : len(s)] = 1
        rows += [i] * len(r)
        cols += range(len(p) - 1, len(p) - 1 + len(r))  # position len(p)-1+t predicts response token t
        targets += r
    base = _base_model(model)
    hidden = base(
        input_ids=input_ids.to(device), attention_mask=attention_mask.to(device), use_cache=False
    ).last_hidden_state  # (B, L, H)
    rows_t = torch.tensor(rows, dtype=torch.long, device=device)  # (N,)
    cols_t = torch.tensor(cols, dtype=torch.long, device=device)  # (N,)
    h = hidden[rows_t, cols_t]  # (N, H): only the positions that predict response tokens
    logp_flat = token_logprobs(
        h, weight, torch.tensor(targets, dtype=torch.long, device=device), temperature=temperature,
        chunk_size=chunk_size,
    )  # (N,)
    # mask is row-major in the same order as the flattened tokens, so masked_scatter puts each value in its slot
    logp = torch.zeros(n_rows, t_max, dtype=logp_flat.dtype, device=device).masked_scatter(mask, logp_flat)  # (B, T)
    return logp, mask


# ---------------------------------------------------------------------------------------------------------------------
# Sampler: left-padded prefill, then one token per step with a KV cache; finished rows leave the batch
# ---------------------------------------------------------------------------------------------------------------------


@dataclass
class Rollout:
    """One sampled response.

    tokens: response token ids, including the EOS token when the row stopped at EOS.
    logprobs: (len(tokens),) float32 on CPU, log-probs of the sampled tokens under softmax(logits / temperature) over
        the full vocabulary (top-p not applied; temperature-1 log-probs for greedy), as ``response_logprobs`` computes.
    ended_with_eos: True when the row stopped at EOS, False when it hit max_new_tokens.
    """

    tokens: list[int]
    logprobs: torch.Tensor
    ended_with_eos: bool


def _draw(logits: torch.Tensor, temperature: float, top_p: float, generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick one token per row and its log-prob. logits (B, V) float32 -> tokens (B,) long, logprobs (B,) float32."""
    if temperature == 0:
        tokens = logits.argmax(dim=-1)  # (B,) greedy; first index on ties, as generate
        # temperature-1 log-probs (departure 2): target logit minus log-sum-exp, as token_logprobs computes them
        return tokens, logits.gather(1, tokens.unsqueeze(1)).squeeze(1) - logits.logsumexp(dim=-1)
    logp = torch.log_softmax(logits / temperature, dim=-1)  # (B, V) full-vocabulary log-probs (departure 2)
    probs = logp.exp()  # (B, V)
    if top_p < 1.0:
        # nucleus: the smallest set of most likely tokens whose mass reaches top_p. A token stays if the mass of the
        # tokens strictly before it (in descending order) is still below top_p, so the most likely one always stays.
        sorted_p, order = probs.sort(dim=-1, descending=True)  # (B, V)
        sorted_p = sorted_p.masked_fill(sorted_p.cumsum(dim=-1) - sorted_p >= top_p, 0.0)
        pick = torch.multinomial(sorted_p, 1, generator=generator)  # (B, 1); multinomial renormalises
        tokens = order.gather(1, pick).squeeze(1)  # (B,)
    else:
        tokens = torch.multinomial(probs, 1, generator=generator).squeeze(1)  # (B,)
    return tokens, logp.gather(1, tokens.unsqueeze(1)).squeeze(1)


def sample(
    model,
    prompts,
    *,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    eos_token_id,
    pad_token_id: int | None = None,
    generator: torch.Generator | None = None,
    progress: bool = False,
) -> list[Rollout]:
    """Sample one response per prompt from a transformers causal LM.

    Args:
        model: a transformers causal LM with a plain lm_head (departure 1); its device and dtype are used as they are.
        prompts: B token-id lists (or 1-D LongTensors) of any lengths >= 1.
        max_new_tokens: cap on response length (EOS included).
        temperature: 0 for greedy, else logits are divided by it before sampling.
        top_p: nucleus mass in (0, 1]; 1 samples from the full distribution. Ignored for greedy.
        eos_token_id: an int or a list of ints; a row stops after producing any of them (ids outside [0, V) are
            never produced: every row then runs to max_new_tokens).
        pad_token_id: id written into left-padding slots (masked out, so any id in [0, V) will do; default 0).
        generator: torch.Generator on the model's device, for reproducible samples.
        progress: show a tqdm bar over decode steps.

    Returns:
        B Rollouts, in prompt order.

    How: prompts are left-padded to P = longest prompt, so every row's next token sits in the last column. One
    prefill fills a DynamicCache; then each step feeds the B_alive newest tokens (B_alive, 1) with per-row positions
    and a view of a preallocated (B, P + max_new_tokens) attention mask. When rows produce EOS they are dropped from
    the cache, the mask and the position state, so later steps only compute rows still running.
    """
    assert max_new_tokens >= 1, f"max_new_tokens must be >= 1, got {max_new_tokens}"
    assert temperature >= 0, f"temperature must be >= 0, got {temperature}"
    assert 0 < top_p <= 1, f"top_p must be in (0, 1], got {top_p}"
    eos_ids = [int(eos_token_id)] if isinstance(eos_token_id, int) else [int(e) for e in eos_token_id]
    assert eos_ids, "eos_token_id must name at least one token"
    pad_token_id = 0 if pad_token_id is None else int(pad_token_id)  # pads are masked out: any valid id does
    prompts = [_as_id_list(p) for p in prompts]
    assert all(len(p) > 0 for p in prompts), "every prompt needs at least one token"
    weight = _lm_head_weight(model)
    device = weight.device
    _check_ids(prompts, weight.shape[0], "prompts")
    base = _base_model(model)
    cache_arg = _cache_kwarg(base)
    n_rows = len(prompts)
    if n_rows == 0:
        return []

    # ---- left-padded prompt batch, its mask, and the per-row position of the next token
    prompt_len = torch.tensor([len(p) for p in prompts], dtype=torch.long)  # (B,)
    width = int(prompt_len.max())
    input_ids = torch.full((n_rows, width), pad_token_id, dtype=torch.long)  # (B, P)
    for i, p in enumerate(prompts):
        input_ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
    # Preallocated mask for the whole run. Response columns are True from the start: a row that finishes leaves the
    # batch, so every row still present has a real token in every response column written so far. Each step
    # therefore passes a prefix view of this buffer; nothing is concatenated or written per step.
    attn = torch.ones(n_rows, width + max_new_tokens, dtype=torch.bool)  # (B, P + max_new)
    attn[:, :width] = torch.arange(width).unsqueeze(0) >= (width - prompt_len).unsqueeze(1)
    # position of prompt column j in row i is j - (number of pads); pads get 0 (they are masked out anyway)
    positions = (torch.arange(width).unsqueeze(0) - (width - prompt_len).unsqueeze(1)).clamp(min=0)  # (B, P)
    input_ids, attn, positions = input_ids.to(device), attn.to(device), positions.to(device)
    next_pos = prompt_len.to(device).unsqueeze(1)  # (B, 1) position of each row's next token
    eos_t = torch.tensor(eos_ids, dtype=torch.long, device=device)
    # For SDPA models without sliding-window layers, a decode step's mask is just the padding mask, and transformers
    # passes a ready 4D mask through untouched: hand it a (B_alive, 1, 1, cur) view of the buffer and skip the per-step
    # mask construction (about a tenth of a tiny model's step). Other attention kernels get the 2D mask.
    ready_4d = _full_attention_sdpa(model.config)

    # ---- per step we only append (tokens, log-probs, original row ids) of the rows still running; one scatter at
    # the end assembles them, instead of indexed writes into output buffers on every step
    step_tokens, step_logp, step_rows = [], [], []
    alive = torch.arange(n_rows, device=device)  # (B_alive,) original row of each current batch row
    out_len = [max_new_tokens] * n_rows
    ended = [False] * n_rows

    was_training = model.training
    model.eval()  # departure 5: no dropout while sampling
    bar = tqdm(total=max_new_tokens, desc="sampling", unit="tok") if progress else None
    # inference_mode rather than no_grad: it also skips view and version-counter bookkeeping, a visible share of a
    # small model's decode step. Its tensors never escape: the rollouts' tensors are copied out after it (below).
    try:
        with torch.inference_mode():
            cache = DynamicCache(config=model.config)
            hidden = base(
                input_ids=input_ids, attention_mask=attn[:, :width], position_ids=positions, use_cache=True,
                **{cache_arg: cache},
            ).last_hidden_state[:, -1]  # (B, H): left padding puts every row's last prompt token in the last column
            for step in range(max_new_tokens):
                logits = torch.mm(hidden, weight.t()).float()  # (B_alive, V), the same expression token_logprobs uses
                tokens, logp = _draw(logits, temperature, top_p, generator)  # (B_alive,), (B_alive,)
                step_tokens.append(tokens)
                step_logp.append(logp)
                step_rows.append(alive)
                if bar is not None:
                    bar.update(1)
                done = tokens == eos_t[0] if len(eos_ids) == 1 else torch.isin(tokens, eos_t)  # (B_alive,)
                if done.any():  # one host sync per step: the batch shape of the next step depends on it
                    for r in alive[done].tolist():
                        out_len[r], ended[r] = step + 1, True
                    if bool(done.all()):
                        break
                    keep = (~done).nonzero().squeeze(1)  # (B_alive',)
                    # rows that finished leave the batch: cache rows, mask rows, position state, and the row map
                    cache.batch_select_indices(keep)
                    attn, next_pos, alive, tokens = attn[keep], next_pos[keep], alive[keep], tokens[keep]
                if step + 1 == max_new_tokens:
                    break  # the cap: no forward pass for a token that would never be sampled
                cur = width + step + 1  # columns in use after feeding this step's token: P prompt + (step + 1) response
                mask = attn[:, None, None, :cur] if ready_4d else attn[:, :cur]  # (B_alive, 1, 1, cur) / (B_alive, cur)
                hidden = base(
                    input_ids=tokens.unsqueeze(1), attention_mask=mask, position_ids=next_pos, use_cache=True,
                    **{cache_arg: cache},
                ).last_hidden_state[:, -1]  # (B_alive, H)
                next_pos = next_pos + 1
    finally:
        if bar is not None:
            bar.close()
        model.train(was_training)

    # ---- assemble: step s wrote tokens for the rows in step_rows[s]
    n_steps = len(step_tokens)
    cols = torch.cat([torch.full_like(r, s) for s, r in enumerate(step_rows)])  # (sum of B_alive,)
    rows = torch.cat(step_rows)  # (sum of B_alive,)
    out_tokens = torch.zeros(n_rows, n_steps, dtype=torch.long, device=device)  # (B, steps)
    out_logp = torch.zeros(n_rows, n_steps, dtype=torch.float32, device=device)  # (B, steps)
    out_tokens[rows, cols] = torch.cat(step_tokens)
    out_logp[rows, cols] = torch.cat(step_logp)
    tokens_cpu, logp_cpu = out_tokens.cpu(), out_logp.cpu()
    rollouts = []
    for i in range(n_rows):
        n = out_len[i]
        assert ended[i] or n == max_new_tokens, f"row {i} stopped after {n} tokens without EOS"
        rollouts.append(Rollout(tokens_cpu[i, :n].tolist(), logp_cpu[i, :n].clone(), ended[i]))
    return rollouts
