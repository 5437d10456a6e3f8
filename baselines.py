"""The baselines GRAFT is compared with (README "Baselines and ablations"): their losses, and their select, score
and rows phases, each data in, data out, as GRAFT's own (graft.py section 2); graft.VARIANTS and graft.LOSS_KINDS
name them.

Choices the cited papers leave open are ours:
 * HACPO (arXiv 2603.02604): every prompt pools both models' n rollouts (no failure gating). The
   capability ratio c = (peer success rate) / (own success rate), each a mean over the last 5 steps,
   clamped to [0.1, 10] (10 when the own rate is 0). Baseline = capability-weighted pooled mean
   (sum r_own + c sum r_peer) / (n + c n); scale = unbiased std of the 2n pooled rewards. Own rows:
   sequence-level ratio exp(mean_t log rho_t), clip [1 - 3e-4, 1 + 4e-4]. Peer rows (retokenised):
   cross-tokenizer sequence ratio exp(mean log pi_theta^recv(o^recv) - lbar_src(o^src)), lower clip
   bound 0.8 + 0.025 k in minibatch k (capped at 0.999), upper bound 1 + eps_high, loss weight c,
   peer loss coefficient 1.0; one shared token-mean denominator.
 * SGT (arXiv 2605.07244): plain GRPO rows, plus, for every prompt where the receiver fails all n
   and the peer succeeds at least once (all-pass peers included), one correct peer response drawn
   uniformly (seeded per step), retokenised, with loss 0.1 x its token-mean NLL; the NLL term has its
   own token-mean denominator. Both directions, no weighting, no balancing.
 * LUFFY-style: GRAFT's selection and weights; peer tokens use -w f(pi) a with f(pi) = pi / (pi + 0.1),
   behaviour probability 1, no clip, in the same token-mean as the own tokens.

The ablations of GRAFT itself (random selection/acceptance, pooled advantages, success-only, SGT's selection
rule, orders, no balancing, no weight, sequence ratio) are flags on GRAFT's own path (graft.py, core.py).
--variant sgt is the SGT baseline (its NLL loss); --selection sgt only borrows its rescue rule for GRAFT.

Launch lines (both sides of a pair take the same --variant):
    python graft.py train --variant hacpo --name a --peer-name b --peer-exchange runs/ex ...   # and side b
    python graft.py train --variant sgt --peer-log runs/peer_b/exchange/b ...                  # a stored peer
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from core import (Context, Mean, PeerResponse, Row, StepRows, exchange_counts, is_success, policy_loss,
                  rescue_candidates, retokenize, score_peer, seeded_generator)


# ------------------------------------------------------------------------------------------------
# 1. The baselines' losses, and the slice of a micro-batch they take
# ------------------------------------------------------------------------------------------------


class RowBatch(NamedTuple):
    """One row kind's slice of a micro-batch, as the baselines' loss functions take it."""

    logp: torch.Tensor  # (B, T) current-policy log-probs, with grad
    old_logp: torch.Tensor  # (B, T) behaviour log-probs
    advantages: torch.Tensor  # (B,)
    mask: torch.Tensor  # (B, T) bool, response tokens
    weights: torch.Tensor  # (B,)
    is_peer: torch.Tensor  # (B,) bool


def nll_loss(logp: torch.Tensor, mask: torch.Tensor, *, coef: float, loss_denominator: float | None = None):
    """SGT's supervised term: coef * token-mean negative log-likelihood of the rows given.

    logp, mask: (B, T). Returns (loss, metrics): nll a Mean over tokens, nll_tokens a count.
    loss_denominator as in policy_loss (None = the tokens here).
    """
    m = mask.float()
    denom = float(loss_denominator) if loss_denominator is not None else m.sum().clamp(min=1)
    loss = -coef * (logp * m).sum() / denom
    return loss, {"nll": Mean(float(-(logp.detach() * m).sum()), float(m.sum())), "nll_tokens": float(m.sum())}


def luffy_peer_loss(logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, *, gamma: float = 0.1,
                    weights: torch.Tensor | None = None, loss_denominator: float | None = None):
    """LUFFY-style off-policy term for peer tokens: -sum_t w_j f(pi_t) a_j / D, f(pi) = pi / (pi + gamma).

    logp, mask: (B, T) current-policy log-probs of peer tokens; advantages, weights: (B,).
    The behaviour probability is taken as 1 (so the "ratio" is pi itself) and nothing is clipped;
    f' = gamma / (pi + gamma)^2 reweights low-probability tokens up (policy shaping). Returns (loss, metrics):
    peer_prob_mean a Mean of pi over the retained tokens, peer_tokens a count.
    """
    weights = torch.ones_like(advantages, dtype=torch.float32) if weights is None else weights.float()
    tok = mask.float() * (weights > 0).float()[:, None]  # (B, T)
    pi = logp.exp()  # (B, T)
    f = pi / (pi + gamma)  # (B, T)
    denom = float(loss_denominator) if loss_denominator is not None else tok.sum().clamp(min=1)
    loss = -(f * advantages.float()[:, None] * weights[:, None] * tok).sum() / denom
    return loss, {"peer_prob_mean": Mean(float((pi.detach() * tok).sum()), float(tok.sum())),
                  "peer_tokens": float(tok.sum())}


def hacpo_advantages(*, r_own: torch.Tensor, r_peer: torch.Tensor, capability_ratio: float, eps: float = 1e-6):
    """HACPO's pooled advantages for one receiver (arXiv 2603.02604 as the GRAFT paper ran it).

    r_own: (G, n) own rewards; r_peer: (G, M) the peer's rewards on the same prompts.
    capability_ratio c = peer success rate / own success rate (rolling, clamped by the caller).
    The baseline is the capability-weighted mean of the pooled group, (sum r_own + c sum r_peer) /
    (n + c M), and the scale is the unbiased std of the pooled 2n rewards. Returns (adv_own (G, n),
    adv_peer (G, M)); groups whose pooled rewards are constant get 0.
    """
    n, M = r_own.shape[1], r_peer.shape[1]
    r_own, r_peer = r_own.float(), r_peer.float()
    base = ((r_own.sum(1, keepdim=True) + capability_ratio * r_peer.sum(1, keepdim=True))
            / (n + capability_ratio * M))  # (G, 1)
    pooled = torch.cat([r_own, r_peer], dim=1)  # (G, n + M)
    std = pooled.std(dim=1, keepdim=True)  # (G, 1)
    constant = (pooled == pooled[:, :1]).all(dim=1, keepdim=True)  # (G, 1)
    adv = torch.where(constant, torch.zeros_like(pooled), (pooled - base) / (std + eps))  # (G, n + M)
    return adv[:, :n], adv[:, n:]


def luffy_rows_loss(b: RowBatch, *, cfg, loss_denominator: int, minibatch: int):
    """LUFFY's peer rows (row kind "luffy"): luffy_peer_loss at --luffy-gamma."""
    return luffy_peer_loss(b.logp, b.advantages, b.mask, gamma=cfg.luffy_gamma, weights=b.weights,
                           loss_denominator=loss_denominator)


def hacpo_own_loss(b: RowBatch, *, cfg, loss_denominator: int, minibatch: int):
    """HACPO's own rows: the sequence-level ratio, clip [1 - 3e-4, 1 + 4e-4]."""
    return policy_loss(logp=b.logp, old_logp=b.old_logp, advantages=b.advantages, mask=b.mask, eps_low=3e-4,
                       eps_high=4e-4, ratio_level="sequence", loss_denominator=loss_denominator)


def hacpo_peer_loss(b: RowBatch, *, cfg, loss_denominator: int, minibatch: int):
    """HACPO's peer rows: the cross-tokenizer sequence ratio, a lower bound that tightens minibatch by minibatch."""
    low = min(0.8 + 0.025 * minibatch, 0.999)  # the lower bound tightens towards 1 minibatch by minibatch
    return policy_loss(logp=b.logp, old_logp=b.old_logp, advantages=b.advantages, mask=b.mask, weights=b.weights,
                       eps_low=1 - low, eps_high=cfg.eps_high, ratio_level="sequence", is_peer=b.is_peer,
                       loss_denominator=loss_denominator)


def sgt_rows_loss(b: RowBatch, *, cfg, loss_denominator: int, minibatch: int):
    """SGT's NLL rows (row kind "nll"): nll_loss at --sgt-coef."""
    return nll_loss(b.logp, b.mask, coef=cfg.sgt_coef, loss_denominator=loss_denominator)


# ------------------------------------------------------------------------------------------------
# 2. HACPO's phases: every prompt, both models' rollouts pooled; its history of success rates as explicit state
# ------------------------------------------------------------------------------------------------


def hacpo_select(ctx: Context, step: int, own, peers: dict) -> tuple[dict[str, torch.Tensor], dict, dict]:
    """HACPO: every prompt, no failure gating. Returns ({peer: (G,) bool all True}, metrics, no counts)."""
    _, _, m = exchange_counts(own, peers, ctx.n)
    G = own.rewards.shape[0]
    return {name: torch.ones(G, dtype=torch.bool) for name in peers}, m | {"selected": G}, {}


def hacpo_score(ctx: Context, step: int, prompts: list[list[int]], peers: dict,
                selected: dict[str, torch.Tensor]) -> tuple[dict[str, list[PeerResponse]], dict, dict]:
    """HACPO: every peer response retokenised and scored under the receiver (hacpo_rows uses its
    retokenisation and the source's lbar, not w)."""
    (name, peer), = peers.items()
    got, dropped_len, counts = score_peer(ctx, step, peer, torch.nonzero(selected[name]).squeeze(1).tolist(),
                                          prompts)
    return {name: got}, {"accepted": len(got), "dropped_length": dropped_len}, counts


def hacpo_rows(ctx: Context, prompts: list[list[int]], own, peers: dict, selected: dict[str, torch.Tensor],
               received: dict[str, list[PeerResponse]], state: dict) -> tuple[StepRows, dict, dict]:
    """HACPO: both models' rollouts pooled on every prompt; capability-weighted baseline, pooled std;
    own rows with a tight sequence-level clip, peer rows with the cross-tokenizer sequence ratio and the
    capability coefficient (see hacpo_advantages). state["hacpo_history"]: the (own, peer) success rate of
    every earlier step; the answer's state has this step's appended."""
    n, G = ctx.n, len(prompts)
    (name, peer), = peers.items()
    history = [*state.get("hacpo_history", []), (float(own.rewards.mean()), float(peer.rewards.mean()))]
    recent = history[-5:]  # rolling success rates, window 5 steps
    own_rate = sum(h[0] for h in recent) / len(recent)
    peer_rate = sum(h[1] for h in recent) / len(recent)
    c = min(10.0, max(0.1, peer_rate / own_rate)) if own_rate > 0 else 10.0
    adv_own, adv_peer = hacpo_advantages(r_own=own.rewards, r_peer=peer.rewards, capability_ratio=c)  # (G, n), (G, n)
    out = [Row(g, prompts[g], own.tokens[g * n + i], own.logprobs[g * n + i], float(adv_own[g, i]),
               kind="hacpo_own") for g in range(G) for i in range(n)]
    lbar_src = peer.lbar(ctx.compat_norm).view(-1)  # (G * n,)
    for p in received[name]:
        # The peer's "old" log-prob per token is its own per-token mean: the sequence ratio is then
        # exp(mean log pi_theta^recv(o^recv) - lbar_src(o^src)), the cross-tokenizer ratio.
        old = torch.full((len(p.ids),), float(lbar_src[p.slot]))  # (T,)
        out.append(Row(p.group, prompts[p.group], p.ids, old, float(adv_peer[p.group, p.slot % n]), weight=c,
                       is_peer=True, kind="hacpo_peer"))
    return StepRows(out, torch.zeros(G, dtype=torch.bool), {**state, "hacpo_history": history}), \
        {"capability_ratio": c}, {}


# ------------------------------------------------------------------------------------------------
# 3. SGT's phases: its rescue rule, one correct peer response per rescued prompt, an NLL row each
# ------------------------------------------------------------------------------------------------


def sgt_select(ctx: Context, step: int, own, peers: dict) -> tuple[dict[str, torch.Tensor], dict, dict]:
    """SGT's rescue rule: the receiver failed all n and the peer solved at least once (all-pass included)."""
    k_own, k, m = exchange_counts(own, peers, ctx.n)
    selected = {name: rescue_candidates(k_recv=k_own, k_src=k[name]) for name in peers}
    return selected, m | {"selected": sum(int(r.sum()) for r in selected.values())}, {}


def sgt_score(ctx: Context, step: int, prompts: list[list[int]], peers: dict,
              selected: dict[str, torch.Tensor]) -> tuple[dict[str, list[PeerResponse]], dict, dict]:
    """SGT: on each rescue prompt one correct peer response drawn uniformly (seeded per step) and
    retokenised; nothing is scored under the receiver (the NLL term needs no behaviour log-probs)."""
    (name, peer), = peers.items()
    gen = seeded_generator(ctx.seed, step, "sgt")
    picked = []
    for g in torch.nonzero(selected[name]).squeeze(1).tolist():
        correct = torch.nonzero(is_success(peer.rewards[g])).squeeze(1)  # (k,)
        i = int(correct[torch.randint(correct.numel(), (1,), generator=gen)])
        ids = retokenize(peer.texts[g * peer.width + i], bool(peer.eos[g, i]), ctx.tokenizer,
                         max_response_tokens=ctx.max_response_tokens, eos_token_id=ctx.eos_id)
        if ids:  # s is not computed: NaN
            picked.append(PeerResponse(g, g * peer.width + i, ids, torch.zeros(len(ids)), 1.0, float("nan")))
    return {name: picked}, {"accepted": len(picked)}, {}


def sgt_rows(ctx: Context, prompts: list[list[int]], own, peers: dict, selected: dict[str, torch.Tensor],
             received: dict[str, list[PeerResponse]], state: dict) -> tuple[StepRows, dict, dict]:
    """SGT: plain GRPO rows plus one NLL row per picked rescue response (no weighting, no replacement)."""
    n, G = ctx.n, len(prompts)
    out = [Row(g, prompts[g], own.tokens[g * n + i], own.logprobs[g * n + i], float(own.advantages[g, i]))
           for g in range(G) for i in range(n)]
    out += [Row(x.group, prompts[x.group], x.ids, x.old_logp, 0.0, is_peer=True, kind="nll")
            for got in received.values() for x in got]
    return StepRows(out, torch.zeros(G, dtype=torch.bool), state), {}, {}
