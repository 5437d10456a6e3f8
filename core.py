"""GRAFT's copyable core: pure functions on tensors (no globals, no device assumptions, nothing of ours).

The method of Jang et al. (arXiv 2609.37868) as another trainer needs it: the prompt order both sides
of a pair share (batch_indices), GRPO advantages (also within groups of any size), the selection of
failed groups and the balanced swap (Eq. 4), the retokenisation of a peer's text (retokenize_responses, the
one route: too long or not decoding back = dropped and counted) and its scoring under the receiver
(score_received), the compatibility weight (Eqs. 6-8), the clipped token-level loss (Eqs. 9-10) and the
peer-last minibatch order; and GRAFT's rule as data: the interface its phases read (Rollouts, one side's step;
PlainRollouts builds one), the records they pass (Context, Row, PeerResponse, StepRows), the peer scoring they
share (score_peer) and the ablations' draws (random_selection, random_acceptance, pooled_advantages).
graft.py's three rule phases run on these, and its trainer around them; docs/PORTING.md is the porter's page
(the interface, the calls in order, an example that CI runs), README "The method, equation by equation" maps
each equation to its function.

Copy this file alone into another trainer: it imports only the standard library and torch
(test_port.py runs a copy of it in a fresh module, and drives a planted GRAFT step with it). Every function
computes where its tensor inputs are: nothing is built on the CPU against a device tensor, and a device
tensor goes to the host only through an explicit move (test_port.py runs the rule on a non-CPU device).
Which direction a tensor belongs to is never positional: every argument that could be swapped with a
same-shape one of the other side is keyword-only (k_recv= / k_src=, k_a= / k_b=, lbar_recv= /
lbar_src=, logp= / old_logp=), so a swapped call is a TypeError. "recv" is the side that receives a
peer group, "src" the side that gives it; a_to_b always means "B receives A's group".
Shape letters used throughout: G groups (prompts), n rollouts per prompt, B responses (rows) in a
(mini)batch, T tokens (response positions), N flattened tokens, V vocabulary, H hidden size.

Departures from the paper or vanilla GRPO that live here (numbered as in graft.py's full list, each also
said on its line):
  1. retokenize encodes the peer's response text on its own and appends it to the receiver's prompt
     ids: a BPE merge across the prompt/response boundary is never formed. score_received drops a response
     whose receiver ids do not decode back to its text (decodes_back; counted, never silently trained on).
  2. sequence_mean_logprob(num_bytes=...) divides the summed log-prob by UTF-8 bytes, not tokens
     (`--compat-norm byte`, not the default).
  3. policy_loss(loss_denominator=...) takes the token count of the whole minibatch across
     micro-batches and ranks, so accumulation and data parallelism give one big batch's gradient.
  9. policy_loss(ratio_level="sequence") clamps the sequence's mean log-ratio at +-20, not each
     token's log-ratio before the mean.
 11. Stop strings: decode_response(stop=...) keeps a response's text through its first stop string
     (the text that is stored and retokenised, ended_with_eos False), verifier_text cuts it before.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Callable, NamedTuple, Protocol

import torch

# ------------------------------------------------------------------------------------------------
# The functions, in the order of one GRAFT step (graft.py's map)
# ------------------------------------------------------------------------------------------------


def batch_indices(num_prompts: int, step: int, prompts_per_step: int, data_seed: int) -> list[int]:
    """The step's G = prompts_per_step dataset indices: a stream of seeded per-epoch permutations, cut into
    consecutive batches. Returns a list of G ints in [0, num_prompts).

    A pure function of (step, seed), so both sides of a pair and a resumed run see the same prompts, in the
    same order: the order that every per-prompt tensor of the step (rewards (G, n), ...) follows.
    """
    start, out = step * prompts_per_step, []
    while len(out) < prompts_per_step:
        epoch, pos = divmod(start + len(out), num_prompts)
        perm = torch.randperm(num_prompts, generator=torch.Generator().manual_seed(data_seed * 100003 + epoch))
        out.extend(perm[pos: pos + prompts_per_step - len(out)].tolist())
    return out


def group_advantages(rewards: torch.Tensor, *, eps: float = 1e-6, std_normalize: bool = True) -> torch.Tensor:
    """GRPO advantages a_i = (r_i - mean(r)) / (std(r) + eps) within each group.

    rewards: (G, n) float. Returns (G, n) float.
    std is the unbiased (N-1) estimate, as in verl. Groups whose rewards are all equal (including
    n = 1) get exactly 0, not 0 / eps noise. std_normalize=False gives Dr.GRPO's r - mean(r).
    """
    assert rewards.dim() == 2, f"rewards must be (G, n), got {tuple(rewards.shape)}"
    rewards = rewards.float()
    centered = rewards - rewards.mean(dim=1, keepdim=True)  # (G, n)
    if std_normalize:
        std = rewards.std(dim=1, keepdim=True) if rewards.shape[1] > 1 else torch.zeros_like(rewards[:, :1])
        adv = centered / (std + eps)  # (G, n)
    else:
        adv = centered
    constant = (rewards == rewards[:, :1]).all(dim=1, keepdim=True)  # (G, 1): zero variance
    return torch.where(constant, torch.zeros_like(adv), adv)


def masked_group_advantages(rewards: torch.Tensor, mask: torch.Tensor, *, eps: float = 1e-6,
                            std_normalize: bool = True) -> torch.Tensor:
    """GRPO advantages a_i = (r_i - mean(r)) / (std(r) + eps) within each group of any size (ragged groups).

    rewards: (P, M) float; mask: (P, M) bool, True on the first size_p slots of row p (left-aligned).
    Returns (P, M) float, 0 on masked-out slots. The same formula as group_advantages (unbiased
    std; a group of equal rewards, or of one, gets exactly 0), applied to each row's first size_p
    entries: on full rows it equals group_advantages.
    """
    assert rewards.shape == mask.shape and rewards.dim() == 2, "rewards and mask must be (P, M) and equal"
    m = mask.float()  # (P, M)
    size = m.sum(dim=1, keepdim=True)  # (P, 1)
    mean = (rewards.float() * m).sum(dim=1, keepdim=True) / size.clamp(min=1)  # (P, 1)
    centered = (rewards.float() - mean) * m  # (P, M)
    if std_normalize:
        std = ((centered ** 2).sum(dim=1, keepdim=True) / (size - 1).clamp(min=1)).sqrt()  # (P, 1) unbiased
        adv = centered / (std + eps)  # (P, M)
    else:
        adv = centered
    constant = ((rewards == rewards[:, :1]) | ~mask).all(dim=1, keepdim=True)  # (P, 1): zero variance
    return torch.where(constant | ~mask, torch.zeros_like(adv), adv)


SUCCESS_THRESHOLD = 0.5  # a rollout succeeds when its reward is >= this (is_success)


def is_success(rewards: torch.Tensor, *, threshold: float = SUCCESS_THRESHOLD) -> torch.Tensor:
    """Whether each rollout succeeded: reward >= threshold. rewards: any shape; returns bool of that shape.

    The one success rule of the project (Eq. 4's counts, a success-only transfer, SGT's correct response, the
    reports). The default 0.5 gives the verifier's verdict for 0/1 rewards and for -1/+1 rewards, and does
    not count a small format bonus (say 0.1 for a well-formed but wrong answer) as a success: "all n
    failed" must mean no correct answer, since a group of wrong answers teaches nothing whatever its
    format reward.
    """
    return rewards >= threshold


def success_counts(rewards: torch.Tensor, *, threshold: float = SUCCESS_THRESHOLD,
                   mask: torch.Tensor | None = None) -> torch.Tensor:
    """k(q), the number of successful rollouts per prompt (is_success), which Eq. 4 is written in.

    rewards: (G, n) float; mask: (G, n) bool or None, False on padding (groups of fewer than n
    responses, e.g. a foreign log's). Returns (G,) int64.
    """
    assert rewards.dim() == 2, f"rewards must be (G, n), got {tuple(rewards.shape)}"
    ok = is_success(rewards, threshold=threshold)  # (G, n)
    if mask is not None:
        assert mask.shape == rewards.shape, f"mask {tuple(mask.shape)} must match rewards {tuple(rewards.shape)}"
        ok = ok & mask.bool()
    return ok.sum(dim=1)  # (G,) int64


def graft_candidates(*, k_recv: torch.Tensor, k_src: torch.Tensor, n: int | torch.Tensor) -> torch.Tensor:
    """Candidate prompts for transfer src -> recv (Eq. 4): the receiver failed all n, the source is mixed.

    k_recv, k_src: (G,) int success counts (success_counts) of the receiver and the source.
    n: the group size, an int or a (G,) int tensor when groups differ in size (a stored log's).
    Returns (G,) bool. C = { q : k_recv(q) = 0 and 1 <= k_src(q) < n }. An all-pass source group is
    excluded: its advantages are all 0, so it would teach nothing either.
    """
    assert k_recv.shape == k_src.shape and k_recv.dim() == 1, "k_recv and k_src must be (G,) and equal"
    return (k_recv == 0) & (k_src >= 1) & (k_src < n)


class Swap(NamedTuple):
    """The two directions of one step's exchange, each a (G,) bool mask over the step's prompts."""

    a_to_b: torch.Tensor  # (G,) B receives A's group on prompt q
    b_to_a: torch.Tensor  # (G,) A receives B's group on prompt q


def balanced_swap(*, k_a: torch.Tensor, k_b: torch.Tensor, n: int, balance: bool = True) -> Swap:
    """GRAFT selection with the balanced swap (Eq. 4 and the paper's balanced swap).

    k_a, k_b: (G,) int success counts of models A and B on the same G prompts.
    Returns Swap(a_to_b, b_to_a), two (G,) bool masks: a_to_b[q] means B receives A's group for prompt q.
    Calls graft_candidates and balance_directions (copy all three).

    m = min(|C_{A->B}|, |C_{B->A}|). In each direction the candidates are sorted by the source's
    success count, descending, with ties broken by prompt index; the first m are kept together with
    every candidate tied with the m-th, so a direction may keep more than m. m = 0 selects nothing.
    Because the sort is descending, "first m plus ties" is the same as "every candidate whose source
    count is >= the m-th largest", which is what we compute; the result does not depend on the order
    of equal counts, so both processes of a pair get the same masks from the same two files.
    balance=False returns every candidate in both directions (the "w/o balancing" ablation).
    """
    a_to_b = graft_candidates(k_recv=k_b, k_src=k_a, n=n)  # (G,) B fails all, A mixed
    b_to_a = graft_candidates(k_recv=k_a, k_src=k_b, n=n)  # (G,)
    if not balance:
        return Swap(a_to_b, b_to_a)
    return balance_directions(a_to_b=a_to_b, b_to_a=b_to_a, k_a=k_a, k_b=k_b)


def balance_directions(*, a_to_b: torch.Tensor, b_to_a: torch.Tensor, k_a: torch.Tensor, k_b: torch.Tensor) -> Swap:
    """The balancing rule of balanced_swap on given candidate masks: (G,) bool each in, a Swap out.

    m = min(|a_to_b|, |b_to_a|); each direction keeps its first m candidates by the source's count
    (k_a for a_to_b, k_b for b_to_a), descending, plus every candidate tied with the m-th.
    """
    m = int(min(a_to_b.sum().item(), b_to_a.sum().item()))

    def keep_top(cand: torch.Tensor, k_src: torch.Tensor) -> torch.Tensor:
        if m == 0:
            return torch.zeros_like(cand)
        idx = cand.nonzero().squeeze(1)  # (C,) ascending prompt index = the tie-break order
        order = torch.sort(k_src[idx], descending=True, stable=True).indices  # (C,)
        kth = k_src[idx[order[m - 1]]]  # source count of the m-th kept candidate
        return cand & (k_src >= kth)

    return Swap(keep_top(a_to_b, k_a), keep_top(b_to_a, k_b))


def multi_peer_sources(k: torch.Tensor, n: int, *, balance: bool = True) -> torch.Tensor:
    """Our extension to S >= 2 sides (the paper has two): whose group each side receives, per prompt.

    k: (S, G) int success counts of S sides on the same G prompts, the sides in one order that every
    process uses (this trainer: sorted by side name). Returns (S, G) long: src[r, q] is the side whose
    whole group side r receives on prompt q, or -1. Calls balance_directions.

    1. Candidates, Eq. 4 per receiver: side r failed all n on q and at least one other side is mixed
       (1 <= k < n). Its source is the mixed side with the most successes (the group with the most
       correct traces to imitate), ties to the lower side index: a fixed rule, so every process
       computes the same assignment from the same files.
    2. Balancing per pair of sides, as balanced_swap: between sides x and y, m_xy = min(|C_{x->y}|,
       |C_{y->x}|) and each direction keeps its top m_xy by the source's count plus ties. A candidate
       dropped by balancing is not offered to the next-best source (one rule, one pass).
    With S = 2 this is exactly balanced_swap (tested). A receiver never is a source on the same prompt
    (it failed all n), so no prompt moves both ways.
    """
    assert k.dim() == 2, f"k must be (S, G), got {tuple(k.shape)}"
    S, G = k.shape
    mixed = (k >= 1) & (k < n)  # (S, G)
    k_givers = torch.where(mixed, k, torch.full_like(k, -1))  # (S, G): only mixed sides can give
    best = k_givers.argmax(dim=0)  # (G,) first maximum = lowest side index on ties
    any_mixed = k_givers.max(dim=0).values >= 1  # (G,)
    src = torch.where((k == 0) & any_mixed[None], best[None].expand(S, G), torch.full_like(k, -1))  # (S, G)
    if balance:
        for x in range(S):
            for y in range(x + 1, S):
                x_to_y, y_to_x = src[y] == x, src[x] == y  # (G,), (G,)
                keep_xy, keep_yx = balance_directions(a_to_b=x_to_y, b_to_a=y_to_x, k_a=k[x], k_b=k[y])
                src[y] = torch.where(x_to_y & ~keep_xy, -1, src[y])
                src[x] = torch.where(y_to_x & ~keep_yx, -1, src[x])
    return src


def assignment_digest(src: torch.Tensor, prompt_ids: list[str]) -> str:
    """A 12-hex-digit fingerprint of one step's whole exchange, to check that processes agree.

    src: (S, G) long, multi_peer_sources' answer (sides in sorted order); prompt_ids: the G prompt ids
    in the step's order. Every process of an online run logs it as the metrics key "assignment": equal
    fingerprints on a step mean that every process computed the same assignment from the same files.
    """
    assert src.dim() == 2 and src.shape[1] == len(prompt_ids), f"src {tuple(src.shape)} vs {len(prompt_ids)} ids"
    h = hashlib.blake2b(digest_size=6)
    h.update("\n".join(prompt_ids).encode())
    h.update(str(tuple(src.shape)).encode())
    h.update(src.detach().to("cpu", torch.int64).contiguous().numpy().tobytes())  # src may live on a device
    return h.hexdigest()


def received_groups(*, k_own: torch.Tensor, k_peer: torch.Tensor, n: int, own_is_a: bool,
                    balance: bool = True) -> torch.Tensor:
    """The prompts on which this side receives the peer's group: (G,) bool. Calls balanced_swap.

    k_own, k_peer: (G,) int success counts of this side and of its peer on the same G prompts.
    Each process of a pair calls this with its own counts as k_own. The balanced swap is symmetric but
    its tie rule reads (k_a, k_b) in a fixed order, so both processes must agree on which side is A:
    own_is_a is True on exactly one of them (this trainer: the side whose name sorts first). Then
    the two calls compute the same balanced_swap and each reads its own direction out of it, so what
    A receives is exactly what B sends and vice versa.
    """
    k_a, k_b = (k_own, k_peer) if own_is_a else (k_peer, k_own)
    swap = balanced_swap(k_a=k_a, k_b=k_b, n=n, balance=balance)
    return swap.b_to_a if own_is_a else swap.a_to_b


def rescue_candidates(*, k_recv: torch.Tensor, k_src: torch.Tensor) -> torch.Tensor:
    """SGT's rescue rule (arXiv 2605.07244): the receiver failed all n, the source solved at least one.

    k_recv, k_src: (G,) int. Returns (G,) bool. Unlike Eq. 4 an all-pass source group counts too, and
    nothing is balanced; this trainer's SGT baseline uses it with GRAFT's replacement, weights and update.
    """
    assert k_recv.shape == k_src.shape and k_recv.dim() == 1, "k_recv and k_src must be (G,) and equal"
    return (k_recv == 0) & (k_src >= 1)


def compatibility_scores(*, lbar_recv: torch.Tensor, lbar_src: torch.Tensor) -> torch.Tensor:
    """s(o|q) = exp(lbar_recv - lbar_src) (Eq. 6): any shape -> same shape, float.

    lbar_recv: the response's mean log-probability per token under the receiver's behaviour policy,
    in the receiver's tokenisation; lbar_src: the same under the source model that sampled it, in its
    own tokenisation (sequence_mean_logprob gives both; its per-byte variant is not the paper's).
    """
    return torch.exp(lbar_recv.float() - lbar_src.float())


def compatibility_weights(*, lbar_recv: torch.Tensor, lbar_src: torch.Tensor, delta: float = 0.8) -> torch.Tensor:
    """w = 1[s > delta] * min(s, 1) (Eqs. 6-8): any shape -> same shape, float. Calls compatibility_scores.

    w = 0 means the response is removed before optimisation (it leaves the loss denominator too).
    delta = 0 is the "no floor" ablation (every response kept, weighted by min(s, 1)).
    """
    s = compatibility_scores(lbar_recv=lbar_recv, lbar_src=lbar_src)
    return torch.where(s > delta, s.clamp(max=1.0), torch.zeros_like(s))


def sequence_mean_logprob(*, logp: torch.Tensor, mask: torch.Tensor,
                          num_bytes: torch.Tensor | None = None) -> torch.Tensor:
    """Per-response mean log-probability lbar (Eq. 6), the input of the compatibility score.

    logp, mask: (B, T). num_bytes: (B,) or None. Returns (B,) float (at least float32), on logp's device.
    With num_bytes=None: summed log-prob / number of tokens (the paper). Count the tokens the same way on both
    sides: the response's ids as sampled or retokenised, its EOS included when it ended with EOS (score_received
    and the Rollouts.lbar of a step do). With num_bytes: summed log-prob / UTF-8 bytes of the response text, our
    variant (not the paper's): a per-token mean favours the tokenizer with more, shorter tokens, while bytes are
    the same for both models. A row without a token in mask (a dropped response: retokenize_group's all-False
    row) has no mean: NaN, so that compatibility_weights gives it w = 0 (NaN > delta is false), never the
    w = 1 that a mean of 0 would give (s = exp(0 - lbar_src) > 1).
    """
    logp = logp.to(torch.promote_types(logp.dtype, torch.float32))  # a bf16 sum would round the token count
    mask = mask.to(logp.dtype)  # (B, T)
    total = (logp * mask).sum(dim=1)  # (B,)
    count = mask.sum(dim=1)  # (B,)
    denom = count if num_bytes is None else num_bytes.to(device=logp.device, dtype=logp.dtype)  # (B,)
    lbar = total / denom.clamp(min=1)  # (B,)
    return torch.where(count > 0, lbar, torch.full_like(lbar, float("nan")))


class Retokenized(NamedTuple):
    """retokenize_responses' answer for R peer responses: the receiver's ids of those it can train on, and the
    positions of the others by why they were dropped. Every position in [0, R) is in exactly one of the lists."""

    kept: list[int]  # (R',) positions in the input of the responses kept, ascending
    ids: list[list[int]]  # (R',) the receiver's ids of each kept response (its EOS appended if the peer's ended)
    too_long: list[int]  # positions dropped by length: longer than max_response_tokens, or empty (no token)
    lost: list[int]  # positions dropped because their ids do not decode back to the text (decodes_back)


def retokenize_responses(texts: list[str], eos: list[bool], tokenizer, *, max_response_tokens: int,
                         eos_token_id: int | None = None) -> Retokenized:
    """The one retokenisation route: R peer response texts -> the receiver's ids of those it can train on.

    texts, eos: the peer's decoded responses (decode_response's) and whether each ended with EOS. A response is
    dropped when its receiver ids are longer than max_response_tokens or empty (nothing to score), or when they
    do not decode back to its text (the receiver would learn another text than the one rewarded). score_received
    and retokenize_group both call this, so the phases and a flat-batch port drop and count the same responses.
    Returns a Retokenized; calls retokenize and decodes_back.
    """
    if len(texts) != len(eos):
        raise ValueError(f"one EOS flag per text: {len(texts)} texts, {len(eos)} flags")
    kept, ids, too_long, lost = [], [], [], []
    for j, (text, ended) in enumerate(zip(texts, eos)):
        r = retokenize(text, bool(ended), tokenizer, max_response_tokens=max_response_tokens,
                       eos_token_id=eos_token_id)
        if not r:  # None: too long; []: nothing to score
            too_long.append(j)
        elif not decodes_back(r[:-1] if ended else r, text, tokenizer):
            lost.append(j)
        else:
            kept.append(j)
            ids.append(r)
    return Retokenized(kept, ids, too_long, lost)


class Received(NamedTuple):
    """score_received's answer for R peer responses, of which R' survived retokenisation (retokenize_responses).
    Tensors are on the device of the log-prob function's output."""

    kept: list[int]  # (R',) positions in the input of the responses kept, ascending
    ids: list[list[int]]  # (R',) the receiver's token ids of each kept response (EOS appended if it ended)
    logprobs: list[torch.Tensor]  # (R',) the receiver's behaviour log-probs, one (len(ids),) tensor each
    lbar_recv: torch.Tensor  # (R',) Eq. 6 under the receiver, in compat_norm
    lbar_src: torch.Tensor  # (R',) the source's lbar of the same responses
    s: torch.Tensor  # (R',) compatibility scores (Eq. 6)
    w: torch.Tensor  # (R',) weights (Eqs. 7-8; 1 each with compat_weight=False)
    too_long: list[int]  # positions in the input dropped by length (longer than max_response_tokens, or empty)
    lost: list[int]  # positions in the input dropped because their round trip lost text (decodes_back)


def score_received(texts: list[str], eos: list[bool], lbar_src: torch.Tensor, prompts: list[list[int]], *,
                   tokenizer, eos_token_id: int, logprob_fn: Callable, max_response_tokens: int,
                   compat_norm: str = "token", delta: float = 0.8, compat_weight: bool = True) -> Received:
    """Retokenise R peer responses for the receiver and score them under it (Eqs. 6-8).

    texts, eos: the peer's decoded responses and whether each ended with EOS; lbar_src: (R,) the
    source's lbar of each in compat_norm (Rollouts.lbar: EOS counted when it ended with EOS); prompts: the
    receiver's prompt ids of each. logprob_fn(prompts, responses) returns the receiver's behaviour log-probs,
    one (len,) tensor per response (the trainer's sharded_logprobs), on any device: the answer's tensors are
    computed there. The responses retokenize_responses drops (too long or empty; not decoding back to their
    text) are not in the answer's kept, and are listed in its too_long and lost. The receiver's lbar counts
    its EOS, as the source's does. score_peer (below) runs it on the received groups, `graft.py preflight` on
    every sampled response, so the two cannot drift. Returns a Received; calls retokenize_responses,
    compatibility_scores and compatibility_weights.
    """
    assert len(texts) == len(eos) == len(prompts) == lbar_src.numel(), "one text, EOS flag, lbar and prompt each"
    if compat_norm not in ("token", "byte"):
        raise ValueError(f"compat_norm must be 'token' or 'byte', got {compat_norm!r}")
    rt = retokenize_responses(texts, eos, tokenizer, max_response_tokens=max_response_tokens,
                              eos_token_id=eos_token_id)
    if not rt.kept:
        empty = lbar_src.new_zeros(0, dtype=torch.float32)  # (0,)
        return Received([], [], [], empty, empty, empty, empty, rt.too_long, rt.lost)
    lps = logprob_fn([prompts[j] for j in rt.kept], rt.ids)
    lp_sum = torch.stack([lp.sum() for lp in lps])  # (R',) where the log-prob function computes
    if compat_norm == "byte":  # not the paper's: the summed log-prob per UTF-8 byte
        denom = [max(1, len(texts[j].encode("utf-8"))) for j in rt.kept]
    else:  # Eq. 6: mean log-prob per receiver token, its EOS included
        denom = [len(x) for x in rt.ids]
    lbar_recv = lp_sum / torch.tensor(denom, dtype=torch.float32, device=lp_sum.device)  # (R',)
    src = lbar_src.float()[torch.tensor(rt.kept, device=lbar_src.device)].to(lp_sum.device)  # (R',)
    s = compatibility_scores(lbar_recv=lbar_recv, lbar_src=src)  # (R',) Eq. 6
    w = (compatibility_weights(lbar_recv=lbar_recv, lbar_src=src, delta=delta) if compat_weight
         else torch.ones_like(s))  # (R',) Eqs. 7-8
    return Received(rt.kept, rt.ids, lps, lbar_recv, src, s, w, rt.too_long, rt.lost)


class Mean(NamedTuple):
    """A metric that is a mean, as its sum and its count (detached floats), e.g. clipped peer tokens
    over peer tokens. Kept apart so that the trainer adds up sums and counts over micro-batches,
    minibatches and ranks and divides once: a mean of part-means would weight each part wrongly."""

    total: float
    count: float

    @property
    def value(self) -> float:
        """total / count; NaN when the count is 0 (a mean over nothing)."""
        return self.total / self.count if self.count else float("nan")


def add_metrics(into: dict, metrics: dict, *, prefix: str = "") -> None:
    """Add one part's metrics into running sums, in place: a Mean's sum and count each add up, a float
    (a loss part, a count) adds as it is. into[prefix + key] holds the running value. Uses Mean."""
    for key, v in metrics.items():
        k = prefix + key
        if isinstance(v, Mean):
            total, count = into.get(k, (0.0, 0.0))
            into[k] = Mean(total + v.total, count + v.count)
        else:
            into[k] = into.get(k, 0.0) + v


def metric_values(metrics: dict, *, drop_empty: bool = False) -> dict[str, float]:
    """Plain floats for logging: each Mean becomes total / count, other values pass as they are.

    A Mean over nothing (count 0: e.g. clipfrac_peer of a batch without peer tokens) is NaN, meaning
    "no such tokens", not zero; drop_empty=True leaves those keys out instead. Sum first, convert once:
    metric_values of add_metrics' running sums, never an average of per-part values. Uses Mean.
    """
    return {k: v.value if isinstance(v, Mean) else v for k, v in metrics.items()
            if not (drop_empty and isinstance(v, Mean) and v.count == 0)}


def policy_loss(
    *,
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    weights: torch.Tensor | None = None,
    eps_low: float = 0.2,
    eps_high: float = 0.28,
    dual_clip: float | None = None,
    ratio_level: str = "token",
    is_peer: torch.Tensor | None = None,
    loss_denominator: float | None = None,
    log_ratio_clamp: float = 20.0,
):
    """GRAFT's weighted clipped surrogate (Eqs. 9-10), token-mean over the retained tokens.

    Every argument is keyword-only (verl's compute_policy_loss takes old_log_prob before log_prob;
    a positional port would swap them silently).
    logp:       (B, T) log pi_theta(o_t) of the current policy, with grad.
    old_logp:   (B, T) log pi_old(o_t) of the receiver's behaviour policy (own and peer rows alike).
    advantages: (B,)   one advantage per response (own group's, or the peer's held fixed).
    mask:       (B, T) bool/float, 1 on response tokens.
    weights:    (B,)   compatibility weights w (1 for own responses); w = 0 removes a response.
    is_peer:    (B,)   bool, only for the separate own/peer metrics.
    loss_denominator: total retained tokens of the whole minibatch when this call sees one
        micro-batch (or one rank) of it, so that gradient accumulation and data parallelism give the
        gradient of one big batch; None = the retained tokens of this call.
    log_ratio_clamp: |log rho| is clamped before exp for numerical safety (as verl does); 20 never
        binds in practice. With ratio_level="sequence" the sequence's mean log-ratio is clamped.

    Loss = -(1 / sum_j |o_j|) sum_j w_j sum_t min(rho_t a_j, clip(rho_t, 1-eps_low, 1+eps_high) a_j),
    the sum over retained responses (w_j > 0); retained peer responses count fully in the
    denominator (Eq. 10). ratio_level="sequence" is the ablation with one ratio per response,
    exp(mean_t log rho_t). dual_clip=c bounds the loss of a negative-advantage token at -c * a (verl).
    Returns (loss, metrics), metrics detached: "loss" and the token counts ("tokens", "own_tokens",
    "peer_tokens") are floats that add up over parts of a minibatch; every mean is a Mean(sum, count),
    so that parts (micro-batches, ranks) add up exactly with add_metrics: clipfrac over all tokens
    (verl's pg_clipfrac), clipfrac_own / clipfrac_peer over own / peer tokens, approx_kl (the k3
    estimator, >= 0), approx_kl_k1 (mean of old_logp - logp, verl's ppo_kl) and ratio_mean over
    tokens, mean_weight / peer_mean_weight over responses / peer responses. Only retained responses
    count. metric_values(metrics) gives plain floats (NaN for a mean over nothing). Uses Mean.
    """
    assert logp.shape == old_logp.shape == mask.shape, "logp, old_logp and mask must all be (B, T)"
    B = logp.shape[0]
    assert advantages.shape == (B,), f"advantages must be (B,)=({B},), got {tuple(advantages.shape)}"
    assert ratio_level in ("token", "sequence"), f"ratio_level must be token|sequence, got {ratio_level!r}"
    weights = torch.ones(B, device=logp.device) if weights is None else weights.float()
    is_peer = torch.zeros(B, dtype=torch.bool, device=logp.device) if is_peer is None else is_peer.bool()
    retained = weights > 0  # (B,)
    tok = mask.float() * retained[:, None].float()  # (B, T) tokens that enter loss and denominator

    log_ratio = logp - old_logp.detach()  # (B, T)
    if ratio_level == "sequence":
        # Clamp the sequence's mean, not each token before the mean: a rare token's clamped log-ratio
        # would bias the sequence value.
        seq = (log_ratio * mask).sum(1) / mask.float().sum(1).clamp(min=1)  # (B,)
        log_ratio = seq[:, None].expand_as(logp)  # (B, T): one ratio per response, on every token
    log_ratio = log_ratio.clamp(-log_ratio_clamp, log_ratio_clamp)  # (B, T)
    ratio = torch.exp(log_ratio)  # (B, T)
    adv = advantages.float()[:, None]  # (B, 1)
    surr = ratio * adv  # (B, T)
    surr_clipped = ratio.clamp(1 - eps_low, 1 + eps_high) * adv  # (B, T)
    obj = torch.minimum(surr, surr_clipped)  # (B, T) Eq. 9, pessimistic bound
    if dual_clip:
        obj = torch.where(adv < 0, torch.maximum(obj, dual_clip * adv), obj)  # verl dual-clip
    per_token = -obj * weights[:, None]  # (B, T) Eq. 10, w_j on each token of response j

    n_tok = tok.sum()
    denom = float(loss_denominator) if loss_denominator is not None else n_tok.clamp(min=1)
    loss = (per_token * tok).sum() / denom

    with torch.no_grad():
        clipped = (surr_clipped < surr).float()  # (B, T) the clip bound is the active one: zero gradient
        own_tok, peer_tok = tok * (~is_peer)[:, None], tok * is_peer[:, None]  # (B, T), (B, T)
        kl = (ratio - 1) - log_ratio  # (B, T) k3 estimator of KL(pi_old || pi_theta), >= 0
        peer_rows = (is_peer & retained).float()  # (B,)
        w_kept = weights * retained.float()  # (B,)
        sums = torch.stack([(clipped * own_tok).sum(), own_tok.sum(), (clipped * peer_tok).sum(), peer_tok.sum(),
                            (kl * tok).sum(), (-log_ratio * tok).sum(), (ratio * tok).sum(), n_tok, w_kept.sum(),
                            retained.float().sum(), (w_kept * peer_rows).sum(), peer_rows.sum()]).tolist()
    c_own, own, c_peer, peer, kl_sum, k1_sum, ratio_sum, tokens, w_sum, rows, w_peer, peer_n = sums
    metrics = {"clipfrac": Mean(c_own + c_peer, tokens), "clipfrac_own": Mean(c_own, own),
               "clipfrac_peer": Mean(c_peer, peer), "approx_kl": Mean(kl_sum, tokens),
               "approx_kl_k1": Mean(k1_sum, tokens), "ratio_mean": Mean(ratio_sum, tokens),
               "mean_weight": Mean(w_sum, rows), "peer_mean_weight": Mean(w_peer, peer_n),
               "tokens": tokens, "own_tokens": own, "peer_tokens": peer}
    metrics["loss"] = float(loss.detach())
    return loss, metrics


def minibatch_order(is_peer_group: torch.Tensor, num_minibatches: int, *, order: str = "peer_last",
                    generator: torch.Generator | None = None) -> list[torch.Tensor]:
    """Split a step's groups into minibatches and order them (the paper's peer-last rule).

    is_peer_group: (G,) bool, True where the group was replaced by a peer group.
    Returns a list of at most num_minibatches 1-D LongTensors of group indices, in update order.

    peer_last (paper): own groups first, replaced groups after them, then cut into consecutive
    minibatches; every minibatch holding a peer group is updated after all own-only minibatches, so by
    then the policy has moved and the peer tokens' ratios differ from 1, which is what lets clipping
    act on them. peer_first is the reverse; uniform shuffles all groups (needs no flag). Within each
    class groups keep prompt order, or are shuffled when a generator is given. Empty minibatches
    (G < num_minibatches) are dropped.
    """
    assert is_peer_group.dim() == 1, "is_peer_group must be (G,)"
    assert order in ("peer_last", "peer_first", "uniform"), f"unknown order {order!r}"
    G = is_peer_group.shape[0]
    dev = is_peer_group.device

    def perm(idx: torch.Tensor) -> torch.Tensor:
        if generator is None:
            return idx
        return idx[torch.randperm(idx.numel(), generator=generator, device=generator.device).to(dev)]

    own = perm(torch.nonzero(~is_peer_group).squeeze(1))
    peer = perm(torch.nonzero(is_peer_group).squeeze(1))
    if order == "peer_last":
        seq = torch.cat([own, peer])
    elif order == "peer_first":
        seq = torch.cat([peer, own])
    else:
        seq = perm(torch.arange(G, device=dev))
    return [chunk for chunk in torch.tensor_split(seq, num_minibatches) if chunk.numel() > 0]


def seeded_generator(seed: int, step: int, stream: str, *, rank: int = 0,
                     device: torch.device | str = "cpu") -> torch.Generator:
    """A torch.Generator for one purpose (stream) of one step: reproducible and independent.

    The seed is a stable hash (BLAKE2b, not Python's per-process salted hash()) of (seed, step,
    stream, rank), so every process of a pair that asks for the same stream gets the same draws,
    different streams never share a sequence, and a resumed run redraws exactly what it would have.
    Streams used by the trainer: "sample" (per rank), "select", "accept", "minibatch", "sgt", "eval".
    """
    key = f"{seed}/{step}/{stream}/{rank}".encode()
    value = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") & ((1 << 63) - 1)
    return torch.Generator(device=device).manual_seed(value)


def first_stop(text: str, stop) -> tuple[int, str] | None:
    """Where the first stop string of `stop` (a sequence of strings) starts in text, and which one:
    (index, string) for the occurrence that starts first (the earlier-listed string on a tie), or None."""
    hits = [(text.find(s), j) for j, s in enumerate(stop) if s in text]
    return None if not hits else (min(hits)[0], stop[min(hits)[1]])


def decode_response(tokens: list[int], tokenizer, *, eos_token_ids, stop=()) -> tuple[str, bool]:
    """The source side of retokenisation: response ids -> (text, ended_with_eos).

    A trailing EOS is dropped, and the rest is decoded without special tokens and without the
    tokenizer's clean-up of spaces (which would not round-trip, e.g. Llama-3's " ," rewrite).
    With stop strings, the text ends with its first stop string (first_stop): a sampler that stopped
    on one kept the token that completed it, whose text past the string is dropped here. That text is
    what is stored and what a receiver retokenises (without EOS: ended_with_eos is False whenever the
    text holds a stop string), so the receiver learns to write the stop string too; verifier_text cuts
    it off for the verifier.
    """
    eos = {eos_token_ids} if isinstance(eos_token_ids, int) else set(eos_token_ids)
    ended = len(tokens) > 0 and tokens[-1] in eos
    body = tokens[:-1] if ended else tokens
    text = tokenizer.decode(body, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    hit = first_stop(text, stop) if stop else None
    return (text, ended) if hit is None else (text[: hit[0] + len(hit[1])], False)  # a stop string ends it


def verifier_text(text: str, stop) -> str:
    """The text a verifier reads: cut before the first stop string of `stop` (first_stop); unchanged without one."""
    hit = first_stop(text, stop) if stop else None
    return text if hit is None else text[: hit[0]]


def retokenize(text: str, ended_with_eos: bool, tokenizer, *, max_response_tokens: int,
               eos_token_id: int | None = None) -> list[int] | None:
    """The receiver side of retokenisation: peer text -> receiver response ids, or None.

    The text is encoded on its own with the receiver's tokenizer, without special tokens (no BOS: it
    follows the receiver's own prompt ids, so a BPE merge across the prompt/response boundary is never
    formed; real tokenizers round-trip benchmark text exactly); the receiver's EOS (eos_token_id, default the
    tokenizer's) is appended only if the peer's response ended with EOS. Returns None when the result
    is longer than max_response_tokens (the caller drops the response and counts it).
    """
    ids = tokenizer.encode(text, add_special_tokens=False)
    if ended_with_eos:
        eos = tokenizer.eos_token_id if eos_token_id is None else eos_token_id
        assert eos is not None, "the receiver's tokenizer has no eos_token_id"
        ids = ids + [eos]
    return ids if len(ids) <= max_response_tokens else None


def decodes_back(ids: list[int], text: str, tokenizer) -> bool:
    """The retokenisation round trip: do the receiver's response ids (retokenize's, without a final EOS) decode
    to the text they encode, decoded as decode_response decodes? False when the encoding lost or changed text
    (a character the vocabulary cannot write, a normalisation, a special token's text in the response)."""
    return tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False) == text


def canonical_ids(text: str, tokenizer, *, prompt_ids: list[int] | None = None) -> list[int] | None:
    """The tokenizer's own encoding of a response text: encoded alone (prompt_ids None), or after its prompt
    (the prompt's text, decoded from prompt_ids with its special tokens, encoded together with the response
    and split after the prompt's own encoding). None when a token of that joint encoding spans the boundary."""
    if prompt_ids is None:
        return tokenizer.encode(text, add_special_tokens=False)
    context = tokenizer.decode(prompt_ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    head = tokenizer.encode(context, add_special_tokens=False)
    both = tokenizer.encode(context + text, add_special_tokens=False)
    return both[len(head):] if both[: len(head)] == head else None


def source_canonical(tokens: list[int], tokenizer, *, eos_token_ids,
                     prompt_ids: list[int] | None = None) -> tuple[bool | None, list[int] | None]:
    """Is a sampled response's stored id sequence (a final EOS left out) its tokenizer's canonical encoding
    (canonical_ids) of the text those ids decode to? (True/False, or None when the joint encoding has a token
    across the prompt's end; the canonical ids, None then). A sampler may draw a non-canonical split ("1" "2"
    where the tokenizer writes "12"): the source's lbar is then over ids its tokenizer would not produce."""
    eos = {eos_token_ids} if isinstance(eos_token_ids, int) else set(eos_token_ids)
    body = list(tokens[:-1]) if len(tokens) and tokens[-1] in eos else list(tokens)
    text = tokenizer.decode(body, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    canon = canonical_ids(text, tokenizer, prompt_ids=prompt_ids)
    return (None if canon is None else canon == body), canon


def canonical_counts(responses: list[list[int]], prompts: list[list[int]], tokenizer, *, eos_token_ids) -> dict:
    """How many of a side's sampled responses (ids, each after its prompt's ids) are not its tokenizer's canonical
    encoding of their text (source_canonical): encoded alone ("noncanonical", what a receiver's retokenisation
    does) and encoded after the prompt ("noncanonical_in_prompt": drift that the prompt context does not explain)."""
    alone = [source_canonical(t, tokenizer, eos_token_ids=eos_token_ids)[0] for t in responses]
    joint = [source_canonical(t, tokenizer, eos_token_ids=eos_token_ids, prompt_ids=p)[0]
             for t, p in zip(responses, prompts)]
    return {"noncanonical": sum(x is False for x in alone), "noncanonical_in_prompt": sum(x is not True for x in joint)}


def add_counts(parts: list[dict]) -> dict:
    """Counts of several parts (ranks, phases of a step) added key by key."""
    out: dict = {}
    for part in parts:
        for k, v in part.items():
            out[k] = out.get(k, 0) + v
    return out


# ------------------------------------------------------------------------------------------------
# GRAFT's rule as data: what its phases (graft.py section 2, baselines.py) read and pass, the peer scoring
# they share, and the ablations' draws beside the paper's functions above
# ------------------------------------------------------------------------------------------------


class Rollouts(Protocol):
    """One side's rollouts of one step as GRAFT's phases read them: the interface a trainer hands the rule, for its
    own step and for each peer's (graft.py's graft_select, graft_score and graft_rows, and score_peer and
    exchange_counts here, read these members and no other). PlainRollouts builds one from a GRPO step's lists and
    tensors; the project's exchange.StepRollouts (a rollout file's, a stored run's, a foreign log's) is one too.

    G prompts in the step's order (batch_indices: the same order on every side), `width` response slots per
    prompt; the flat lists are row-major, response r = g * width + i is slot i of prompt g. The steps' tensors may
    live on any one device, and the receiver's log-prob function may return its tensors on another (the model's):
    score_received computes there. Read from this side's own step: prompt_ids, rewards, advantages, tokens,
    logprobs; from a peer's: rewards, mask, sizes, width, texts, eos, advantages and lbar.
    """

    prompt_ids: list[str]  # (G,) the prompts' dataset ids (assignment_digest fingerprints the swap with them)
    tokens: list[list[int]]  # (G*width,) response ids as sampled, EOS included when it ended with EOS
    logprobs: list[torch.Tensor]  # (G*width,) each (len(tokens[r]),): behaviour log-probs of those ids, float
    texts: list[str]  # (G*width,) each response decoded as decode_response does: no special tokens, no EOS
    eos: torch.Tensor  # (G, width) bool: the response ended with EOS (the receiver then appends its own EOS)
    rewards: torch.Tensor  # (G, width) float; a reward >= 0.5 is a success (is_success: Eq. 4's counts)
    advantages: torch.Tensor  # (G, width) float: GRPO's, within each whole group, before anything is dropped

    @property
    def width(self) -> int:
        """Response slots per prompt, the stride of r = g * width + i: n (a foreign log's step: its widest group)."""

    @property
    def mask(self) -> torch.Tensor:
        """(G, width) bool: which slots hold a response (every slot of a GRPO step)."""

    @property
    def sizes(self) -> torch.Tensor:
        """(G,) int64: responses per prompt, mask.sum(1), the n of Eq. 4 for each group."""

    def lbar(self, norm: str) -> torch.Tensor:
        """(G, width) float, Eq. 6's lbar_src: each response's summed behaviour log-prob under the model that
        sampled it, over the ids as sampled, EOS included when it ended with EOS, divided by that token count
        (norm "token", the paper's) or by its text's UTF-8 bytes (norm "byte"). The receiver counts the same
        way (score_received: its retokenised ids, its EOS included): leave EOS out on one side only and every
        s moves."""


def sampled_lbar(logprobs: list[torch.Tensor], tokens: list[list[int]], texts: list[str], *, norm: str,
                 like: torch.Tensor) -> torch.Tensor:
    """Rollouts.lbar of sampled responses, r = g * width + i: each one's summed behaviour log-prob (logprobs[r],
    (len(tokens[r]),)) over its ids as sampled, EOS included when it ended with EOS, divided by that token count
    (norm "token") or by texts[r]'s UTF-8 bytes ("byte"); an empty slot gives 0. like: (G, width), the shape and
    device of the answer (the step's rewards). Returns (G, width), at least float32."""
    if norm not in ("token", "byte"):
        raise ValueError(f"norm must be 'token' or 'byte', got {norm!r}")
    sums = torch.stack([lp.sum() if lp.numel() else lp.new_zeros(()) for lp in logprobs])  # (G*width,)
    sums = sums.to(like.device, torch.promote_types(sums.dtype, torch.float32)).view_as(like)  # (G, width)
    count = ([max(1, len(t.encode("utf-8"))) for t in texts] if norm == "byte"
             else [max(1, len(t)) for t in tokens])  # EOS included: the ids as sampled
    return sums / torch.tensor(count, dtype=sums.dtype, device=sums.device).view_as(sums)  # (G, width)


@dataclass(frozen=True)
class PlainRollouts:
    """A Rollouts from what a GRPO step holds: G prompts x n responses, every slot filled (width n), lbar computed
    from tokens and logprobs (Rollouts.lbar: EOS included when it ended with EOS; calls sampled_lbar). The tensors may
    be on any one device. A field of the wrong length or shape raises ValueError naming it."""

    prompt_ids: list[str]  # (G,) dataset ids
    tokens: list[list[int]]  # (G*n,) response ids as sampled, EOS included when it ended with EOS
    logprobs: list[torch.Tensor]  # (G*n,) each (len(tokens[r]),) behaviour log-probs
    texts: list[str]  # (G*n,) decode_response's text of each response
    eos: torch.Tensor  # (G, n) bool
    rewards: torch.Tensor  # (G, n) float
    advantages: torch.Tensor  # (G, n) float (group_advantages)

    def __post_init__(self):
        if self.rewards.dim() != 2:
            raise ValueError(f"rewards must be (G, n), got {tuple(self.rewards.shape)}")
        G, n = self.rewards.shape
        for name in ("eos", "advantages"):
            if tuple(getattr(self, name).shape) != (G, n):
                raise ValueError(f"{name} must be (G, n) = ({G}, {n}) like rewards, got "
                                 f"{tuple(getattr(self, name).shape)}")
        if len(self.prompt_ids) != G:
            raise ValueError(f"prompt_ids must hold G = {G} ids, got {len(self.prompt_ids)}")
        for name in ("tokens", "logprobs", "texts"):
            if len(getattr(self, name)) != G * n:
                raise ValueError(f"{name} must hold G * n = {G * n} responses (r = g * n + i), "
                                 f"got {len(getattr(self, name))}")
        bad = [r for r, (t, lp) in enumerate(zip(self.tokens, self.logprobs)) if tuple(lp.shape) != (len(t),)]
        if bad:
            raise ValueError(f"logprobs[r] must be (len(tokens[r]),), one per sampled id (EOS included): not at "
                             f"r = {bad[:5]}")

    @property
    def width(self) -> int:
        return self.rewards.shape[1]

    @property
    def mask(self) -> torch.Tensor:
        return torch.ones_like(self.rewards, dtype=torch.bool)  # (G, n)

    @property
    def sizes(self) -> torch.Tensor:
        return self.mask.sum(dim=1)  # (G,)

    def lbar(self, norm: str) -> torch.Tensor:
        """(G, n) float: Rollouts.lbar, the mean over each response's sampled ids (EOS included), or per byte."""
        return sampled_lbar(self.logprobs, self.tokens, self.texts, norm=norm, like=self.rewards)


class Context(NamedTuple):
    """What the rule's phases read besides the step's data: the run's settings, the receiver's tokenizer and its
    log-prob function. Read-only, one per run (graft.rule_context builds it from the config)."""

    side: str  # this side's name: the balanced swap orders the sides by name
    n: int  # rollouts per prompt
    seed: int  # the ablations' and SGT's draws: seeded_generator(seed, step, stream)
    tokenizer: object  # the receiver's (retokenize)
    eos_id: int  # the receiver's EOS, appended to a peer response that ended with EOS
    logprob_fn: Callable  # (prompts, responses) -> one (len(response),) receiver behaviour log-prob tensor each
    max_response_tokens: int  # a longer retokenised peer response is dropped and counted
    both_ways: bool = True  # True: the peers are live sides that receive too (the swap); False: a stored peer
    selection: str = "graft"  # graft (Eq. 4 + swap) | random | sgt (ablations)
    balance: bool = True  # False: every candidate both ways (ablation)
    acceptance: str = "gate"  # gate (Eqs. 6-8) | random (ablation)
    transfer: str = "all"  # all (the whole group) | success (the peer's correct responses only; ablation)
    peer_advantages: str = "source"  # source (the peer's group, held fixed) | pooled (ablation)
    std_normalize: bool = True  # GRPO's std division (False = Dr.GRPO)
    compat_norm: str = "token"  # token (Eq. 6) | byte (summed log-prob per UTF-8 byte; not the paper's)
    compat_weight: bool = True  # False: w = 1 for every retained peer response (ablation)
    delta: float = 0.8  # the compatibility floor (Eq. 8)
    peer_kind: str = "pg"  # the Row.kind of received responses (LUFFY's baseline: "luffy")


@dataclass
class Row:
    """One response that enters the update: the receiver's tokenisation, fixed behaviour log-probs (a mutable record:
    a trainer may fill or adjust a field before its update)."""

    group: int  # prompt position in the step's batch (minibatches are cut by group)
    prompt: list[int]  # the receiver's prompt ids
    response: list[int]  # the receiver's response ids
    old_logp: torch.Tensor  # (len(response),) the receiver's behaviour log-probs (HACPO's peer rows: see there)
    adv: float
    weight: float = 1.0  # w (Eqs. 7-8); 1 for own rows
    is_peer: bool = False
    kind: str = "pg"  # pg = Eqs. 9-10 (GRPO, GRAFT and its ablations); the baselines' kinds: graft.LOSS_KINDS


class PeerResponse(NamedTuple):
    """One peer response retokenised for the receiver and scored by it (Eqs. 6-8)."""

    group: int  # prompt position g in the step's batch
    slot: int  # its slot r = g * width + i in the peer's step (Rollouts: width n, or a foreign log's widest group)
    ids: list[int]  # receiver token ids of the peer's text
    old_logp: torch.Tensor  # (len(ids),) receiver behaviour log-probs
    weight: float  # w = 1[s > delta] min(s, 1); 0 = removed
    s: float  # s = exp(lbar_recv - lbar_src) (Eq. 6); NaN where not computed (SGT)


class StepRows(NamedTuple):
    """The rows phase's answer: what the update takes (a list of Row), and what the variant keeps for the next step."""

    rows: list[Row]  # the step's update rows
    replaced: torch.Tensor  # (G,) bool, the groups that reached the update from a peer (updated last)
    state: dict  # the variant's state across steps, passed in and returned (HACPO's history); {} for the others


def exchange_counts(own: Rollouts, peers: dict[str, Rollouts],
                    n: int) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict]:
    """Success counts of this side (G,) and of each peer (G,) on the step's prompts, and the metrics every
    variant logs: the candidates of Eq. 4 both ways (before balancing) and the peers' mean reward.

    own: the step's own rollouts (a Rollouts: .rewards (G, n)); peers: {name: peer step} (Rollouts: .rewards,
    .mask (G, width), .sizes (G,)). Calls success_counts and graft_candidates."""
    k_own = success_counts(own.rewards)  # (G,)
    k = {name: success_counts(p.rewards, mask=p.mask) for name, p in peers.items()}  # (G,) each
    cand_in, cand_out = torch.zeros_like(k_own, dtype=torch.bool), torch.zeros_like(k_own, dtype=torch.bool)
    for name, p in peers.items():
        cand_in |= graft_candidates(k_recv=k_own, k_src=k[name], n=p.sizes)  # (G,) Eq. 4, this side receiving
        cand_out |= graft_candidates(k_recv=k[name], k_src=k_own, n=n) & (p.sizes > 0)  # (G,) this side giving
    m = {"candidates_in": int(cand_in.sum()), "candidates_out": int(cand_out.sum()),
         "peer_reward": float(torch.cat([p.rewards[p.mask] for p in peers.values()]).mean())}
    return k_own, k, m


def score_peer(ctx: Context, step: int, peer: Rollouts, groups: list[int], prompts: list[list[int]], *,
               only_correct: bool = False) -> tuple[list[PeerResponse], int, dict]:
    """Retokenise the peer's responses of the given groups and score them under the receiver (Eqs. 6-8).

    peer: one peer step (a Rollouts: .texts, .eos (G, width), .rewards, .mask, .width, .lbar(norm) (G, width));
    groups: the prompt positions received; prompts: the step's G receiver prompt ids. only_correct: the peer's
    correct responses only (the success-only transfer ablation). Returns a PeerResponse for every response that
    survived retokenisation (retokenize_responses: the length limit and the round trip), the number dropped by
    length, and the counts ({"dropped_roundtrip": lost text}). Reads a Context; calls is_success, score_received
    and, under ctx.acceptance "random", random_acceptance with seeded_generator."""
    width = peer.width  # slots per prompt, the stride of r = g * width + i
    ok = is_success(peer.rewards) if only_correct else peer.mask  # (G, width) the responses it may take
    picked = [(g, i) for g in groups for i in range(width) if peer.mask[g, i] and ok[g, i]]
    lbar_src = peer.lbar(ctx.compat_norm) if picked else None  # (G, width); a foreign log may lack it unused
    sc = score_received([peer.texts[g * width + i] for g, i in picked], [bool(peer.eos[g, i]) for g, i in picked],
                        torch.stack([lbar_src[g, i] for g, i in picked]) if picked else peer.rewards.new_zeros(0),
                        [prompts[g] for g, _ in picked], tokenizer=ctx.tokenizer, eos_token_id=ctx.eos_id,
                        logprob_fn=ctx.logprob_fn, max_response_tokens=ctx.max_response_tokens,
                        compat_norm=ctx.compat_norm, delta=ctx.delta, compat_weight=ctx.compat_weight)
    w = sc.w  # (R',)
    if ctx.acceptance == "random" and sc.kept:  # ablation
        w = random_acceptance(sc.s, w, compat_weight=ctx.compat_weight,
                              generator=seeded_generator(ctx.seed, step, "accept"))
    out = []
    for j, ids, lp, wi, si in zip(sc.kept, sc.ids, sc.logprobs, w.tolist(), sc.s.tolist()):
        g, i = picked[j]
        out.append(PeerResponse(g, g * width + i, ids, lp, wi, si))
    return out, len(sc.too_long), {"dropped_roundtrip": len(sc.lost)}


def random_selection(selected: torch.Tensor, *, k_src: torch.Tensor, sizes: torch.Tensor,
                     generator: torch.Generator) -> torch.Tensor:
    """Ablation, random selection: as many prompts as the rule selected ((G,) bool), drawn uniformly among
    those where the source is mixed (k_src, sizes: (G,)). Returns (G,) bool."""
    pool = torch.nonzero((k_src >= 1) & (k_src < sizes)).squeeze(1)  # (P,)
    draw = torch.randperm(pool.numel(), generator=generator, device=generator.device)  # (P,)
    pick = pool[draw.to(pool.device)[: int(selected.sum())]]
    out = torch.zeros_like(selected)  # (G,)
    out[pick] = True
    return out


def random_acceptance(s: torch.Tensor, w: torch.Tensor, *, compat_weight: bool,
                      generator: torch.Generator) -> torch.Tensor:
    """Ablation, random acceptance: the gate's acceptance count, the accepted responses drawn at random.
    s, w: (R,) scores and the gate's weights. They keep min(s, 1) as weight (1 without the compatibility
    weight), so only which responses pass changes. Returns (R,) weights."""
    pick = torch.randperm(s.numel(), generator=generator, device=generator.device)[: int((w > 0).sum())]
    pick = pick.to(s.device)  # drawn on the generator's device, used on the scores'
    out = torch.zeros_like(s)  # (R,)
    out[pick] = s[pick].clamp(max=1.0) if compat_weight else 1.0
    return out


def pooled_advantages(own_rewards: torch.Tensor, peer_rewards: torch.Tensor, peer_mask: torch.Tensor, *,
                      std_normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Ablation, pooled advantages: the receiver's group (n,) and the peer's (M,), masked, merged into
    one group; GRPO advantages over both (group_advantages). Returns (n,) own and (M,) peer advantages (0 on
    padding)."""
    n = own_rewards.numel()
    pooled = group_advantages(torch.cat([own_rewards, peer_rewards[peer_mask]])[None],
                              std_normalize=std_normalize)[0]  # (n + size,)
    return pooled[:n], pooled.new_zeros(peer_mask.numel()).masked_scatter(peer_mask, pooled[n:])


# ------------------------------------------------------------------------------------------------
# Porting helpers: what a trainer built around a flat batch of rows (TRL, verl) needs around the above
# (graft_trl.py uses them inside TRL's GRPOTrainer; README "Porting to verl or TRL")
# ------------------------------------------------------------------------------------------------


def fold_weights(*, advantages: torch.Tensor, weights: torch.Tensor,
                 mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Eq. 10 through a vanilla clipped loss: a * w as the advantage, and the w = 0 rows masked out.

    advantages: (B,) float; weights: (B,) float, w (1 for own rows); mask: (B, T) bool or int, 1 on
    response tokens. Returns (advantages * weights (B,) float, mask with the w = 0 rows zeroed (B, T),
    mask's dtype). A token-mean loss over the returned mask with the returned advantage equals
    policy_loss(weights=w) in value and gradient, provided its denominator is that mask's token count
    over the whole optimizer step (the removed rows are not in it, Eq. 10).
    """
    assert advantages.shape == weights.shape == mask.shape[:1], "advantages and weights must be (B,), mask (B, T)"
    kept = (weights > 0)[:, None]  # (B, 1)
    return advantages.float() * weights.float(), mask * kept.to(mask.dtype)  # (B,), (B, T)


def peer_last_rows(is_peer_group: torch.Tensor, group_size: int, *,
                   generator: torch.Generator | None = None) -> torch.Tensor:
    """The peer-last order for a batch of G groups of group_size consecutive rows (row r = g * n + i).

    is_peer_group: (G,) bool, True where the group was replaced by a peer group. Returns a (G * n,)
    long permutation of the rows: own groups first, replaced groups after them, each group's rows
    together and in order. Cut the permuted batch into consecutive equal minibatches (no shuffling
    after this): with G divisible by their number they hold the groups of
    minibatch_order(is_peer_group, num_minibatches, generator=generator), which draws the same
    permutation within each class. Calls minibatch_order.
    """
    (seq,) = minibatch_order(is_peer_group, 1, order="peer_last", generator=generator)  # (G,) group order
    return (seq[:, None] * group_size + torch.arange(group_size, device=seq.device)).reshape(-1)  # (G * n,)


class PaddedResponses(NamedTuple):
    """retokenize_group's answer for R peer responses, padded on the right for a flat batch of rows."""

    ids: torch.Tensor  # (R, T) long, the receiver's ids; a dropped row is all padding
    mask: torch.Tensor  # (R, T) bool, True on a kept response's tokens; all False on a dropped row
    too_long: list[int]  # positions dropped by length (longer than max_response_tokens, or empty)
    lost: list[int]  # positions dropped because their ids do not decode back to the text (decodes_back)


def retokenize_group(texts: list[str], eos: list[bool], tokenizer, *, max_response_tokens: int,
                     pad_token_id: int, eos_token_id: int | None = None) -> PaddedResponses:
    """retokenize_responses for R responses at once, padded on the right: a PaddedResponses (ids (R, T) long,
    mask (R, T) bool, and the dropped positions by cause).

    texts, eos: R peer response texts (decode_response's) and whether each ended with EOS. The drops are
    score_received's (too long or empty; not decoding back to the text), counted the same way (len(too_long),
    len(lost)); a dropped row is all padding with an all-False mask row, so sequence_mean_logprob gives it NaN
    and compatibility_weights w = 0: it never counts as accepted. T is the longest kept row (at least 1). Calls
    retokenize_responses.
    """
    rt = retokenize_responses(texts, eos, tokenizer, max_response_tokens=max_response_tokens,
                              eos_token_id=eos_token_id)
    T = max([len(r) for r in rt.ids] + [1])
    ids = torch.full((len(texts), T), pad_token_id, dtype=torch.long)  # (R, T)
    mask = torch.zeros(len(texts), T, dtype=torch.bool)  # (R, T)
    for j, r in zip(rt.kept, rt.ids):
        ids[j, : len(r)] = torch.tensor(r, dtype=torch.long)
        mask[j, : len(r)] = True
    return PaddedResponses(ids, mask, rt.too_long, rt.lost)


class PeerGroup(NamedTuple):
    """One prompt's stored peer responses, in log order (m responses)."""

    texts: list[str]  # (m,) response texts
    eos: torch.Tensor  # (m,) bool, ended with EOS
    lbar: torch.Tensor  # (m,) float32, the source's mean log-prob per token (Eq. 6); NaN where not given


LBAR_FLOOR = -88.0  # exp(-88) is finite in float32: a lower lbar_src could overflow s = exp(lbar_recv - lbar_src)
# A mean log-prob per token below this is not a mean: uniform sampling over a 262k-token vocabulary (the largest
# we know) gives -12.5, and sampled text scores far above uniform. A summed log-probability (e.g. -45) lands here.
LBAR_PLAUSIBLE = -20.0
PEER_ID_FIELDS, PEER_PROBLEM_FIELDS = ("problem_id", "id"), ("problem", "question")
PEER_RESPONSE_FIELDS, PEER_LBAR_FIELDS = ("response", "completion"), ("lbar", "mean_logprob")


class PeerRecord(NamedTuple):
    """One validated line of a peer log (the stored-peer JSONL format, read by parse_peer_records)."""

    line: int  # 1-based line number in the file
    prompt_id: str | None  # "problem_id" or "id", an integer read as its decimal string; None when absent
    problem: str | None  # "problem" or "question": the prompt's text, for matching by text; None when absent
    response: str  # "response" or "completion"
    lbar: float  # "lbar" or "mean_logprob", the source's mean log-prob per token (Eq. 6); NaN when absent
    num_tokens: int  # the response's length in source tokens; -1 when absent
    eos: bool  # ended with EOS (default true)
    reward: float  # the source's own verdict; NaN when absent


def _first(obj: dict, names: tuple[str, ...]):
    return next((obj[k] for k in names if k in obj and obj[k] is not None), None)


def parse_peer_records(records, *, where: str = "log") -> list[PeerRecord]:
    """The project's one parser of the peer-log JSONL format (the trainer's stored peer, preflight, TRL's).

    records: an iterable of (line number, object) pairs, each object one parsed JSON line:
        {"problem_id" or "id": str or int, and/or "problem" or "question": str,   which prompt
         "response" or "completion": str,
         "lbar" or "mean_logprob": float in [LBAR_PLAUSIBLE, 0] (optional; a mean per token, Eq. 6),
         "num_tokens": int >= 1 (optional), "reward": number or bool (optional), "eos": bool (optional, true)}
    e.g. data/prompts.py's jsonl_objects(path). Returns one PeerRecord per object, in order. A bad record
    raises ValueError("where:LINE: ..."). The lbar bounds: below LBAR_FLOOR, float32's s = exp(lbar_recv -
    lbar) can overflow (w = 1 for anything); below LBAR_PLAUSIBLE it is not a mean per token (a sum?). Uses _first.
    """
    out = []
    for line, obj in records:
        at = f"{where}:{line}"
        if not isinstance(obj, dict):
            raise ValueError(f"{at}: expected a JSON object, got {type(obj).__name__}")
        pid = _first(obj, PEER_ID_FIELDS)
        if isinstance(pid, int) and not isinstance(pid, bool):
            pid = str(pid)
        if pid is not None and (not isinstance(pid, str) or not pid):
            raise ValueError(f"{at}: field {PEER_ID_FIELDS} must be a non-empty string or an integer, got {pid!r}")
        problem = _first(obj, PEER_PROBLEM_FIELDS)
        if problem is not None and (not isinstance(problem, str) or not problem.strip()):
            raise ValueError(f"{at}: field {PEER_PROBLEM_FIELDS} must be a non-empty string, got {problem!r}")
        if pid is None and problem is None:
            raise ValueError(f"{at}: needs a problem id ({' or '.join(PEER_ID_FIELDS)}) or the problem text "
                             f"({' or '.join(PEER_PROBLEM_FIELDS)})")
        text = _first(obj, PEER_RESPONSE_FIELDS)
        if not isinstance(text, str):
            raise ValueError(f"{at}: field {' or '.join(PEER_RESPONSE_FIELDS)} must be a string, got {text!r}")
        lbar = _first(obj, PEER_LBAR_FIELDS)
        if lbar is not None and (isinstance(lbar, bool) or not isinstance(lbar, (int, float))
                                 or not LBAR_FLOOR <= lbar <= 0):  # NaN fails the comparison too
            raise ValueError(f"{at}: field {' or '.join(PEER_LBAR_FIELDS)} must be a finite number in "
                             f"[{LBAR_FLOOR:g}, 0] (a mean log-probability per token; lower overflows the "
                             f"float32 score s = exp(lbar_recv - lbar)), got {lbar!r}")
        num_tokens = obj.get("num_tokens")
        if num_tokens is not None and (isinstance(num_tokens, bool) or not isinstance(num_tokens, int)
                                       or num_tokens < 1):
            raise ValueError(f"{at}: field 'num_tokens' must be an integer >= 1, got {num_tokens!r}")
        if lbar is not None and lbar < LBAR_PLAUSIBLE:
            total = "" if num_tokens is None else f" (over its {num_tokens} tokens: {lbar / num_tokens:.3g})"
            raise ValueError(f"{at}: field 'lbar' = {lbar:g} is implausible as a mean log-probability per token "
                             f"(below {LBAR_PLAUSIBLE:g}; uniform over a 262k vocabulary is -12.5): a summed "
                             f"log-probability? give the sum divided by the response's token count{total}")
        reward = obj.get("reward")
        if reward is not None and not isinstance(reward, (int, float)):
            raise ValueError(f"{at}: field 'reward' must be a number or a boolean, got {reward!r}")
        eos = obj.get("eos", True)
        if not isinstance(eos, bool):
            raise ValueError(f"{at}: field 'eos' must be true or false, got {eos!r}")
        out.append(PeerRecord(line, pid, problem, text, float("nan") if lbar is None else float(lbar),
                              -1 if num_tokens is None else num_tokens, eos,
                              float("nan") if reward is None else float(reward)))
    return out


def read_peer_records(records, *, where: str = "log") -> dict[str, PeerGroup]:
    """parse_peer_records, grouped by prompt id for a trainer that matches prompts by id (TRL, verl).

    records: as parse_peer_records. Returns {prompt id: PeerGroup}, groups and their responses in log order.
    A record without a prompt id raises ValueError("where:LINE: ..."); one that repeats an earlier one (same
    id, same response) is left out: it would count one response twice in its group's advantages. Rewards
    are not read: the receiver scores the texts with its own reward. Uses PeerRecord and PeerGroup.
    """
    groups: dict[str, list[PeerRecord]] = {}
    for rec in parse_peer_records(records, where=where):
        if rec.prompt_id is None:
            raise ValueError(f"{where}:{rec.line}: needs a prompt id ({' or '.join(PEER_ID_FIELDS)}): this reader "
                             f"matches records to prompts by id, not by problem text")
        group = groups.setdefault(rec.prompt_id, [])
        if all(r.response != rec.response for r in group):
            group.append(rec)
    return {pid: PeerGroup([r.response for r in g], torch.tensor([r.eos for r in g], dtype=torch.bool),
                           torch.tensor([r.lbar for r in g], dtype=torch.float32)) for pid, g in groups.items()}
