"""GRAFT: Gated Replacement of Answer-Failed groups with peer Trajectories.

A minimal pure-PyTorch reference implementation of Jang et al., "Learning Beyond What You Sample:
Off-Policy-Aware Cross-Model Trajectory Exchange for RLVR" (arXiv 2609.37868).

Two different base models A and B run GRPO side by side on the same prompt batches. When the
receiver fails all n rollouts of a prompt and the peer's group on that prompt is mixed (1 <= k < n),
the receiver's group is replaced by the peer's whole group, with the peer's advantages (Eq. 4).
A balanced swap keeps the two directions even. The peer's text is re-tokenised for the receiver; a
sequence-level compatibility weight w = 1[s > delta] * min(s, 1), s = exp(lbar_recv - lbar_src)
(Eqs. 6-8), carries the cross-model mismatch, and a token-level PPO ratio against the receiver's own
behaviour policy carries the rest (Eqs. 9-10). Minibatches holding peer groups are updated last, so
that their ratios differ from 1 and clipping acts. A stored-trajectory variant reads a finished
run's rollout files instead of a live peer.

The file reads top to bottom:
    config -> the copyable core (pure functions on tensors) -> sampler and logprob path
    (sampler.py) -> rollouts, reward and exchange files -> loss and update loop -> evaluation -> CLI

Departures from the paper or from vanilla GRPO (each is also said on the line that does it):
  1. Retokenisation encodes the peer's response text on its own and appends it to the receiver's
     prompt ids; a BPE merge across the prompt/response boundary is therefore never formed. Real
     tokenizers (Qwen3, SmolLM3, Llama-3.2) round-trip the benchmark text exactly, so nothing is lost.
  2. `--compat-norm byte` (not the default) replaces the per-token mean log-probability of Eq. 6 by
     the summed log-probability divided by the UTF-8 byte length of the same response text, for both
     models. The per-token mean is biased against the coarser tokenizer (DESIGN §8, lesson 4).
  3. The loss denominator (token-mean, Eq. 10) counts the tokens of retained responses of the whole
     minibatch across micro-batches and ranks, so gradient accumulation and data parallelism give the
     same gradient as one big batch.
  4. Responses with a compatibility weight of 0 are removed before the update (as the paper says), so
     a peer group may reach the update with fewer than n responses; its advantages stay those
     computed on the peer's full group.
  5. Prompts longer than `max_prompt_tokens` are an error, not silently filtered: filtering per
     tokenizer would give the two sides different batches.

Launch lines:
    # CPU, tiny preset: two tiny models, GRPO vs GRAFT, a table at the end (minutes)
    bash run_pair.sh tiny
    # 1 GPU, single-model GRPO (the n=8 baseline)
    python graft.py train --model Qwen/Qwen3-1.7B-Base --prompts data/math_train.jsonl --out runs/grpo_qwen
    # the pair on one node (two processes that meet in an exchange directory; GPUs split 4 + 4)
    bash run_pair.sh pair1
    # evaluation of a checkpoint on the five benchmarks
    python graft.py eval --model runs/graft_qwen/checkpoints/best --benchmarks all
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

# ------------------------------------------------------------------------------------------------
# Config
# ------------------------------------------------------------------------------------------------


@dataclass
class Config:
    # --- model and data
    model: str = ""
    """Hub id or local folder of the transformers causal LM that this process trains (required)."""
    name: str = "a"
    """This side's name: its rollout files go to <exchange>/<name>/. Use 'a'/'b' or the model name."""
    prompts: str = "data/math_train.jsonl"
    """Training prompt JSONL (DESIGN §5: id, problem, answer per line)."""
    out: str = "runs/default"
    """Run directory: metrics.jsonl, checkpoints/, and the exchange dir unless --peer-exchange is set."""
    prompt_template: str = "{problem} Let's think step by step and output the final answer within \\boxed{}."
    """Prompt text; '{problem}' is replaced by the problem (DESIGN §6). The tiny preset uses a short one."""
    chat_template: bool = False
    """Wrap the prompt text as one user message with the tokenizer's chat template (False = raw text)."""
    trust_remote_code: bool = False
    """Pass trust_remote_code to transformers (off: model repos are untrusted code)."""

    # --- peer (GRAFT); with neither flag this is single-model GRPO ("--peer none")
    peer_exchange: str = ""
    """Online pair: shared exchange dir; this process is side --name, the peer is --peer-name."""
    peer_name: str = "b"
    """The online peer's side name (its rollout files are <peer-exchange>/<peer-name>/step_*.safetensors)."""
    peer_log: str = ""
    """Stored-trajectory variant: a folder of a finished run's rollout files (one-way, no balancing)."""
    exchange_timeout: float = 3600.0
    """Seconds to wait for the peer's rollout file of a step before failing (typ. 600-7200)."""

    # --- GRPO / GRAFT hyperparameters (paper Table 3)
    steps: int = 174
    """Number of RL steps (paper: 3 epochs of MATH train at 128 prompts = 174)."""
    prompts_per_step: int = 128
    """Prompts (groups) per step, across all ranks (paper 128; tiny 16-64)."""
    n: int = 8
    """Rollouts per prompt (paper 8; baselines 16, 32)."""
    minibatches: int = 4
    """Optimizer steps per RL step (128 prompts / 32 per minibatch = 4), one epoch over the batch."""
    temperature: float = 1.0
    """Sampling temperature; every log-probability uses the same temperature-scaled logits (§3.7)."""
    top_p: float = 1.0
    """Nucleus sampling threshold for rollouts (paper 1.0)."""
    max_prompt_tokens: int = 2048
    """Longest prompt in tokens; a longer prompt is an error (departure 5)."""
    max_response_tokens: int = 4096
    """Response cap; retokenised peer responses longer than this are dropped and counted (§3.6)."""
    eps_low: float = 0.2
    """Lower PPO clip: ratio floor 1 - eps_low (paper 0.2)."""
    eps_high: float = 0.28
    """Upper PPO clip: ratio ceiling 1 + eps_high (paper 0.28, DAPO clip-higher)."""
    dual_clip: float = 0.0
    """verl's dual-clip constant c for negative advantages (0 = off, the default; verl uses 3.0)."""
    delta: float = 0.8
    """Compatibility floor: peer responses with s <= delta are removed (Eq. 8; 0 = no floor)."""
    compat_norm: str = "token"
    """'token' = mean token log-prob (paper Eq. 6); 'byte' = summed log-prob / UTF-8 bytes (departure 2)."""
    std_normalize: bool = True
    """Divide group advantages by the group std (False = Dr.GRPO)."""
    lr: float = 1e-6
    """AdamW learning rate, constant, no warm-up (paper 1e-6; tiny ~1e-4)."""
    weight_decay: float = 0.01
    """AdamW weight decay."""
    grad_clip: float = 1.0
    """Global grad-norm clip per optimizer step."""

    # --- variants and ablations (DESIGN §3.11)
    variant: str = "graft"
    """graft | hacpo | sgt | luffy. Without a peer every variant is plain GRPO."""
    order: str = "peer_last"
    """Minibatch order of replaced groups: peer_last (paper) | peer_first | uniform."""
    balance: bool = True
    """Balanced swap (§3.4); False = every candidate in both directions (ablation)."""
    compat_weight: bool = True
    """Use w = min(s, 1) on peer responses; False = w = 1 for every retained peer response (ablation)."""
    ratio_level: str = "token"
    """token (paper) | sequence (ablation: one length-normalised ratio per response)."""
    selection: str = "graft"
    """graft (Eq. 4 + swap) | random (same count, drawn among prompts whose peer group is mixed)."""
    acceptance: str = "gate"
    """gate (compatibility) | random (same acceptance rate, responses drawn at random)."""
    peer_advantages: str = "source"
    """source (peer's own group advantages, paper) | pooled (recomputed over own + peer, 2n)."""
    transfer: str = "all"
    """all (whole peer group, paper) | success (only the peer's correct responses)."""
    sgt_coef: float = 0.1
    """SGT: weight of the NLL term on one correct peer response per rescue prompt."""
    luffy_gamma: float = 0.1
    """LUFFY: shaping constant in f(pi) = pi / (pi + gamma) for peer tokens."""

    # --- system
    seed: int = 0
    """Seed for sampling and minibatch shuffles; both sides of a pair must use the same --data-seed."""
    data_seed: int = 0
    """Seed of the prompt order; the two sides of a pair must agree (checked against the peer's file)."""
    device: str = "auto"
    """auto (cuda if available, else cpu) | cpu | cuda."""
    dtype: str = "auto"
    """auto (bf16 on GPU, fp32 on CPU) | float32 | bfloat16."""
    gen_batch_size: int = 256
    """Sequences per sampler call (bounds the KV cache; typ. 64-512 on a GPU)."""
    micro_batch_size: int = 16
    """Sequences per forward/backward pass inside a minibatch (gradient accumulation)."""
    logprob_chunk: int = 1024
    """Tokens per chunk in the chunked logprob kernel (bounds the logits memory)."""
    gradient_checkpointing: bool = False
    """Recompute activations in backward (saves memory on long responses)."""
    threads: int = 0
    """torch CPU threads (0 = leave torch's default). On a shared CPU, 1 per process is often fastest."""
    verify_workers: int = 0
    """Processes for the verifier (0 = in-process)."""
    save_every: int = 20
    """Checkpoint every this many steps (and at the end); --resume continues from the latest."""
    keep_checkpoints: int = 2
    """How many step checkpoints to keep (the best-by-eval one is kept apart)."""
    resume: bool = False
    """Continue from the latest checkpoint in <out>/checkpoints."""

    # --- evaluation (DESIGN §7)
    eval_every: int = 0
    """Validate every this many steps (paper 5; 0 = off) and keep the best checkpoint."""
    benchmarks: str = "all"
    """Comma list of math500,aime2024,aime2025,amc23,minerva, 'all', or paths to prompt JSONL files."""
    data_dir: str = "data"
    """Folder with the benchmark JSONL files written by data/prepare.py."""
    eval_samples: int = 8
    """Samples per problem for evaluation (avg@k = pass@1; paper 8)."""
    eval_temperature: float = 0.6
    """Evaluation sampling temperature (paper 0.6)."""
    eval_top_p: float = 0.95
    """Evaluation top-p (paper 0.95)."""
    eval_max_problems: int = 0
    """Use only the first this many problems per benchmark (0 = all; for quick checks)."""
    eval_max_tokens: int = 0
    """Evaluation response cap (0 = max_response_tokens)."""
    save_responses: bool = False
    """Eval: also write every sampled response to the results JSON."""
    eval_out: str = ""
    """Eval: path of the results JSON (default <model>/eval_results.json or <out>/eval/...)."""


VARIANTS = ("graft", "hacpo", "sgt", "luffy")
CHOICES = {
    "variant": VARIANTS,
    "order": ("peer_last", "peer_first", "uniform"),
    "ratio_level": ("token", "sequence"),
    "compat_norm": ("token", "byte"),
    "selection": ("graft", "random"),
    "acceptance": ("gate", "random"),
    "peer_advantages": ("source", "pooled"),
    "transfer": ("all", "success"),
    "device": ("auto", "cpu", "cuda"),
    "dtype": ("auto", "float32", "bfloat16"),
}


def validate_config(cfg: Config) -> None:
    """Raise ValueError naming the flag for any bad value (bad user input fails early, §10)."""
    def bad(flag, msg):
        raise ValueError(f"--{flag.replace('_', '-')}: {msg}")
    for f, allowed in CHOICES.items():
        if getattr(cfg, f) not in allowed:
            bad(f, f"{getattr(cfg, f)!r} is not one of {', '.join(allowed)}")
    if cfg.n < 1:
        bad("n", "needs at least 1 rollout per prompt")
    if cfg.minibatches < 1 or cfg.minibatches > cfg.prompts_per_step:
        bad("minibatches", f"must be in [1, prompts_per_step={cfg.prompts_per_step}]")
    if not (0 <= cfg.eps_low < 1 and cfg.eps_high >= 0):
        bad("eps_low", "needs 0 <= eps_low < 1 and eps_high >= 0")
    if cfg.dual_clip and cfg.dual_clip <= 1:
        bad("dual_clip", "verl's dual-clip constant must be > 1 (or 0 = off)")
    if cfg.temperature < 0 or not (0 < cfg.top_p <= 1):
        bad("temperature", "needs temperature >= 0 and 0 < top_p <= 1")
    if cfg.peer_exchange and cfg.peer_log:
        bad("peer_log", "choose one peer: --peer-exchange (online) or --peer-log (stored), not both")
    if cfg.peer_exchange and cfg.peer_name == cfg.name:
        bad("peer_name", f"the peer's name must differ from --name ({cfg.name!r})")
    for flag in ("name", "peer_name"):
        v = getattr(cfg, flag)
        if not v or "/" in v or v.startswith("."):
            bad(flag, f"{v!r} must be a plain folder name")
    if "{problem}" not in cfg.prompt_template:
        bad("prompt_template", "must contain '{problem}'")


def field_docs(cls) -> dict[str, str]:
    """The one-line string under each dataclass field (attribute docstrings), read from the source.

    The docstrings are the documentation of the config and of the CLI at the same time.
    """
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
            docs[node.target.id] = str(nxt.value.value).strip()
    return docs


# ------------------------------------------------------------------------------------------------
# The copyable core: pure functions on tensors (no globals, no device assumptions, nothing of ours)
#
# Shape letters used throughout: G groups (prompts), n rollouts per prompt, B responses (rows) in a
# (mini)batch, T tokens (response positions), N flattened tokens, V vocabulary, H hidden size.
# ------------------------------------------------------------------------------------------------


def group_advantages(rewards: torch.Tensor, *, eps: float = 1e-6, std_normalize: bool = True) -> torch.Tensor:
    """GRPO advantages a_i = (r_i - mean(r)) / (std(r) + eps) within each group (DESIGN §3.2).

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


def graft_candidates(k_recv: torch.Tensor, k_src: torch.Tensor, n: int) -> torch.Tensor:
    """Candidate prompts for transfer src -> recv (Eq. 4): the receiver failed all n, the source is mixed.

    k_recv, k_src: (G,) int success counts out of n. Returns (G,) bool.
    C = { q : k_recv(q) = 0 and 1 <= k_src(q) < n }. An all-pass source group is excluded: its
    advantages are all 0 (§3.2), so it would teach nothing either.
    """
    assert k_recv.shape == k_src.shape and k_recv.dim() == 1, "k_recv and k_src must be (G,) and equal"
    return (k_recv == 0) & (k_src >= 1) & (k_src < n)


def balanced_swap(k_a: torch.Tensor, k_b: torch.Tensor, n: int, *, balance: bool = True):
    """GRAFT selection with the balanced swap (Eq. 4 and §3.4).

    k_a, k_b: (G,) int success counts of models A and B on the same G prompts.
    Returns (a_to_b, b_to_a), two (G,) bool masks: a_to_b[q] means B receives A's group for prompt q.

    m = min(|C_{A->B}|, |C_{B->A}|). In each direction the candidates are sorted by the source's
    success count, descending, with ties broken by prompt index; the first m are kept together with
    every candidate tied with the m-th, so a direction may keep more than m. m = 0 selects nothing.
    Because the sort is descending, "first m plus ties" is the same as "every candidate whose source
    count is >= the m-th largest", which is what we compute; the result does not depend on the order
    of equal counts, so both processes of a pair get the same masks from the same two files.
    balance=False returns every candidate in both directions (the "w/o balancing" ablation).
    """
    a_to_b = graft_candidates(k_b, k_a, n)  # (G,) B fails all, A mixed
    b_to_a = graft_candidates(k_a, k_b, n)  # (G,)
    if not balance:
        return a_to_b, b_to_a
    m = int(min(a_to_b.sum().item(), b_to_a.sum().item()))

    def keep_top(cand: torch.Tensor, k_src: torch.Tensor) -> torch.Tensor:
        if m == 0:
            return torch.zeros_like(cand)
        idx = cand.nonzero().squeeze(1)  # (C,) ascending prompt index = the tie-break order
        order = torch.sort(k_src[idx], descending=True, stable=True).indices  # (C,)
        kth = k_src[idx[order[m - 1]]]  # source count of the m-th kept candidate
        return cand & (k_src >= kth)

    return keep_top(a_to_b, k_a), keep_top(b_to_a, k_b)


def compatibility_scores(lbar_recv: torch.Tensor, lbar_src: torch.Tensor) -> torch.Tensor:
    """s(o|q) = exp(lbar_recv - lbar_src) (Eq. 6): any shape -> same shape, float.

    lbar_X is the mean log-probability per token of the response under model X's behaviour policy,
    each in its own tokenisation (or per byte with --compat-norm byte, departure 2).
    """
    return torch.exp(lbar_recv.float() - lbar_src.float())


def compatibility_weights(lbar_recv: torch.Tensor, lbar_src: torch.Tensor, *, delta: float = 0.8) -> torch.Tensor:
    """w = 1[s > delta] * min(s, 1) (Eqs. 6-8): any shape -> same shape, float.

    w = 0 means the response is removed before optimisation (it leaves the loss denominator too).
    delta = 0 is the "no floor" ablation (every response kept, weighted by min(s, 1)).
    """
    s = compatibility_scores(lbar_recv, lbar_src)
    return torch.where(s > delta, s.clamp(max=1.0), torch.zeros_like(s))


def sequence_mean_logprob(logp: torch.Tensor, mask: torch.Tensor, *, num_bytes: torch.Tensor | None = None) -> torch.Tensor:
    """Per-response mean log-probability lbar (Eq. 6), the input of the compatibility score.

    logp, mask: (B, T). num_bytes: (B,) or None. Returns (B,) float.
    With num_bytes=None: summed log-prob / number of tokens (the paper). With num_bytes: summed
    log-prob / UTF-8 bytes of the response text (departure 2), comparable across tokenizers.
    """
    mask = mask.to(logp.dtype)
    total = (logp * mask).sum(dim=1)  # (B,)
    denom = mask.sum(dim=1) if num_bytes is None else num_bytes.to(logp.dtype)
    return total / denom.clamp(min=1)


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
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

    logp:       (B, T) log pi_theta(o_t) of the current policy, with grad.
    old_logp:   (B, T) log pi_old(o_t) of the receiver's behaviour policy (own and peer rows alike).
    advantages: (B,)   one advantage per response (own group's, or the peer's held fixed).
    mask:       (B, T) bool/float, 1 on response tokens.
    weights:    (B,)   compatibility weights w (1 for own responses); w = 0 removes a response.
    is_peer:    (B,)   bool, only for the separate own/peer metrics.
    loss_denominator: total retained tokens of the whole minibatch when this call sees one
        micro-batch (or one rank) of it (departure 3); None = the retained tokens of this call.
    log_ratio_clamp: |log rho| is clamped before exp for numerical safety (as verl does); 20 never
        binds in practice.

    Loss = -(1 / sum_j |o_j|) sum_j w_j sum_t min(rho_t a_j, clip(rho_t, 1-eps_low, 1+eps_high) a_j),
    the sum over retained responses (w_j > 0); retained peer responses count fully in the
    denominator (Eq. 10). ratio_level="sequence" is the ablation with one ratio per response,
    exp(mean_t log rho_t). dual_clip=c bounds the loss of a negative-advantage token at -c * a (verl).
    Returns (loss, metrics) with metrics a dict of floats (detached).
    """
    assert logp.shape == old_logp.shape == mask.shape, "logp, old_logp and mask must all be (B, T)"
    B = logp.shape[0]
    assert advantages.shape == (B,), f"advantages must be (B,)=({B},), got {tuple(advantages.shape)}"
    assert ratio_level in ("token", "sequence"), f"ratio_level must be token|sequence, got {ratio_level!r}"
    weights = torch.ones(B, device=logp.device) if weights is None else weights.float()
    is_peer = torch.zeros(B, dtype=torch.bool, device=logp.device) if is_peer is None else is_peer.bool()
    retained = weights > 0  # (B,)
    tok = mask.float() * retained[:, None].float()  # (B, T) tokens that enter loss and denominator

    log_ratio = (logp - old_logp.detach()).clamp(-log_ratio_clamp, log_ratio_clamp)  # (B, T)
    if ratio_level == "sequence":
        seq = (log_ratio * mask).sum(1) / mask.float().sum(1).clamp(min=1)  # (B,)
        log_ratio = seq[:, None].expand_as(logp)  # (B, T): one ratio per response, on every token
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
        clipped = (surr_clipped < surr).float()  # the clip bound is the active one: zero gradient
        own_tok, peer_tok = tok * (~is_peer)[:, None], tok * is_peer[:, None]
        kl = (ratio - 1) - log_ratio  # k3 estimator of KL(pi_old || pi_theta), >= 0
        frac = lambda x, m: (x * m).sum() / m.sum().clamp(min=1)
        peer_rows = is_peer & retained
        stats = torch.stack([
            frac(clipped, own_tok),
            frac(clipped, peer_tok),
            frac(kl, tok),
            frac(ratio, tok),
            weights[retained].mean() if retained.any() else weights.new_zeros(()),
            weights[peer_rows].mean() if peer_rows.any() else weights.new_zeros(()),
            (advantages[retained] == 0).float().mean() if retained.any() else weights.new_zeros(()),
            n_tok,
            own_tok.sum(),
            peer_tok.sum(),
        ]).tolist()
    names = ["clipfrac_own", "clipfrac_peer", "approx_kl", "ratio_mean", "mean_weight", "peer_mean_weight",
             "zero_adv_frac", "tokens", "own_tokens", "peer_tokens"]
    metrics = dict(zip(names, stats))
    metrics["loss"] = float(loss.detach())
    return loss, metrics


def minibatch_order(is_peer_group: torch.Tensor, num_minibatches: int, *, order: str = "peer_last",
                    generator: torch.Generator | None = None) -> list[torch.Tensor]:
    """Split a step's groups into minibatches and order them (§3.9).

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
        all_idx = torch.arange(G, device=dev)
        seq = all_idx[torch.randperm(G, generator=generator, device=generator.device).to(dev)] if generator is not None else all_idx
    return [chunk for chunk in torch.tensor_split(seq, num_minibatches) if chunk.numel() > 0]


def decode_response(tokens: list[int], tokenizer, *, eos_token_ids) -> tuple[str, bool]:
    """The source side of retokenisation (§3.6): response ids -> (text, ended_with_eos).

    A trailing EOS is dropped, and the rest is decoded without special tokens and without the
    tokenizer's clean-up of spaces (which would not round-trip, e.g. Llama-3's " ," rewrite).
    """
    eos = {eos_token_ids} if isinstance(eos_token_ids, int) else set(eos_token_ids)
    ended = len(tokens) > 0 and tokens[-1] in eos
    body = tokens[:-1] if ended else tokens
    text = tokenizer.decode(body, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    return text, ended


def retokenize(text: str, ended_with_eos: bool, tokenizer, *, max_response_tokens: int) -> list[int] | None:
    """The receiver side of retokenisation (§3.6): peer text -> receiver response ids, or None.

    The text is encoded with the receiver's tokenizer without special tokens (no BOS: it follows the
    receiver's own prompt ids, departure 1); the receiver's EOS is appended only if the peer's
    response ended with EOS. Returns None when the result is longer than max_response_tokens (the
    caller drops the response and counts it).
    """
    ids = tokenizer.encode(text, add_special_tokens=False)
    if ended_with_eos:
        eos = tokenizer.eos_token_id
        assert eos is not None, "the receiver's tokenizer has no eos_token_id"
        ids = ids + [eos]
    return ids if len(ids) <= max_response_tokens else None
