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

One GRAFT step (Trainer.step, one call per phase; each side of the pair runs the same code):
    core.batch_indices     the step's G prompts, a pure function of (--data-seed, step)
    Trainer.rollout        sample n per prompt -> reward.rewards (--reward) -> rewards (G, n),
                           group_advantages, behaviour log-probs by one forward
    Trainer.publish        write this side's rollout file (exchange.save_rollouts)
    Trainer.wait_for_peers wait for and read each peer's file (exchange.load_rollouts), or the stored log
    graft_select           graft_candidates (Eq. 4) -> core.balanced_swap (three or more sides: multi_peer_sources)
    graft_score            core.score_peer -> core.score_received: retokenize -> receiver log-probs ->
                           compatibility_weights (Eqs. 6-8); `graft.py preflight` too
    graft_rows             own groups + the peer's retained responses with the peer's advantages and w: one Row each
    Trainer.update         minibatch_order (peer-last) -> per minibatch Trainer.accumulate -> Trainer.minibatch_loss
                           -> policy_loss (Eqs. 9-10) -> one AdamW step
then Trainer.fit logs the step (one line; a JSON metrics line, keys metrics.METRICS) and keeps atomic checkpoints.
The three rule phases take data and return data, (results, metrics, counts), and read one read-only core.Context
(the run's settings, the receiver's tokenizer and log-prob function): no phase takes the Trainer, so the three
functions of section 2 and core.py are GRAFT as another trainer needs it (tests/test_port.py runs them alone).

Sections: 1 records -> 2 GRAFT's rule (select, score, rows, as the paper states them; its tensor functions and
ablations are core.py's) -> 3 the registry of methods (VARIANTS: GRAFT's phases or a baseline's from baselines.py;
LOSS_KINDS) -> 4 the trainer, the loop that calls them -> 5 CLI. evaluation.py holds the evaluation. README "The
method, equation by equation" maps each equation to its function; README "Files" says what each module holds.

Departures from the paper or from vanilla GRPO (each is also said on the line that does it):
  1. Retokenisation encodes the peer's response text on its own after the receiver's prompt ids (no BPE merge
     across the boundary); a response whose receiver ids do not decode back to its text is dropped (counted).
  2. `--compat-norm byte` (not the default) replaces the per-token mean log-probability of Eq. 6 by
     the summed log-probability divided by the UTF-8 byte length of the same response text, for both
     models. The per-token mean is biased against the coarser tokenizer (README, "The tiny preset").
  3. The loss denominator (token-mean, Eq. 10) counts the tokens of retained responses of the whole
     minibatch across micro-batches and ranks, so gradient accumulation and data parallelism give the
     same gradient as one big batch.
  4. Responses with a compatibility weight of 0 are removed before the update (as the paper says), so
     a peer group may reach the update with fewer than n responses; its advantages stay those
     computed on the peer's full group.
  5. Prompts longer than `max_prompt_tokens` are an error, not silently filtered: filtering per
     tokenizer would give the two sides different batches.
  6. On GPU the weights and AdamW state stay fp32 and the forward runs under bf16 autocast (the paper
     says "bf16"): pure bf16 weights would round most lr = 1e-6 updates away. Rollouts and the in-training
     evaluation sample under the same autocast, with a bf16 KV cache (sampler.py departure 13).
  7. Behaviour log-probs of own rollouts are recomputed by one forward pass after sampling (as verl
     does) rather than taken from the sampler; in fp32 the two agree (tested), in bf16 they differ
     by rounding, and the recomputed ones are what the training forward reproduces at ratio 1.
  8. The prompt is raw text by default (the template with the problem, plus the tokenizer's BOS),
     where the paper wraps it as one user message. The paper's models are base models whose chat
     templates were not part of their pre-training, and raw text gives both sides the same prompt
     string; `--chat-template` gives the paper's single user message (use it for instruct models).
  9. The sequence-level ratio (ablation `--ratio-level sequence`, and HACPO) clamps the sequence's
     mean log-ratio at +-20, not each token's log-ratio before the mean, which would bias it.
 10. The n copies of a prompt share one prefill in the sampler and one prompt forward in the log-prob
     passes (`--share-prefix`, default on; sampler.py departure 11), as vLLM's prefix cache does. Draws are
     the unshared path's up to float round-off of other batch shapes (at T = 1 a draw next to a boundary
     can move: 243 of 256 rows identical on Gemma-3-270M in fp32); off under --fsdp with gradients on.
 11. Stop strings (`--stop`, repeatable; none by default, as in the paper; sampler.py departure 12). A
     response ends after the token whose text completes one (rollouts, eval, preflight): its tokens keep that
     token, so the update's log-probs cover exactly what was sampled and the policy learns to stop. The
     text that is stored and sent to a peer runs through the first stop string (the token's text past it
     is dropped; core.decode_response), the verifier reads it cut before the string (core.verifier_text),
     and its eos flag is False: a receiver retokenises the text, stop string included, without appending
     its EOS, so it learns to end where the peer ended, by writing the stop string. A foreign --peer-log
     response is cut the same way (foreign.py choice 5).

Our extensions beyond the paper (the paper's behaviour is unchanged when they are not used):
  * Three or more sides (`--peer-name b,c`): a side that fails all n receives the whole group of the mixed
    side with the most successes (ties: the name sorting first, so every process computes the same
    assignment); balancing per pair of sides as the paper's swap does for two (multi_peer_sources). Every
    online process logs a fingerprint of the step's assignment (metrics key "assignment").
  * Foreign trajectories: `--peer-log FILE.jsonl`, any (problem, response) records as the stored peer,
    matched by id or text, re-verified, advantages within groups of any size (foreign.py).
  * `graft.py complement`, `graft.py preflight` and `graft.py plan`: complementarity of candidate models, a
    step's selection and gate on two models' samples, and the memory of every phase (tools/, plan.py).
  * `--memory-plan`: the plan checked at start on CUDA, refusing a setting that cannot fit (plan.py).

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

import json
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, NamedTuple

import torch

from baselines import (RowBatch, hacpo_own_loss, hacpo_peer_loss, hacpo_rows, hacpo_score, hacpo_select,
                       luffy_rows_loss, sgt_rows, sgt_rows_loss, sgt_score, sgt_select)  # the compared methods
from config import CHOICES, Config, build_parser, config_from_args, validate_config  # the config, its checks, CLI
from core import (Context, Mean, PeerResponse, Rollouts, Row, StepRows, add_counts, add_metrics, assignment_digest,
                  balanced_swap, batch_indices, canonical_counts, decode_response, exchange_counts, graft_candidates,
                  group_advantages, metric_values, minibatch_order, multi_peer_sources, policy_loss,
                  pooled_advantages, random_selection, rescue_candidates, score_peer, seeded_generator,
                  success_counts, verifier_text)  # the copyable core
from evaluation import benchmark_files, evaluate_benchmarks, run_eval  # --eval-every and `graft.py eval`
from foreign import ForeignLog, StoredRun, open_peer_log  # --peer-log: the stored peer, checked at start
from exchange import OnlinePeers, StepRollouts, rollout_path, save_rollouts  # the rollout file, live peers
from metrics import LiveReport  # --report-to
from plan import check_at_start, run_plan  # the memory plan on fake tensors: at start, and `graft.py plan`
from reward import DEFAULT_REWARD, check_golds, load_reward, reward_options, rewards  # the reward seam, called once
from verify import box_refused  # the default reward's reader alone: metric reward/box_refused
from runtime import (RunFiles, adamw_kernel, clip_sharded_grad_norm_, compute_context, encode_prompt,
                     eval_rows, gather_lists, gathered, kv_budget, load_full_optimizer_state, load_policy,
                     load_prompt_file, raise_stopped, setup_distributed, shard, shard_policy, stop_signals,
                     timed, unshard)  # ranks, files: plumbing
from sampler import Rollout, batches_by_length, resolve_static, response_logprobs, sample  # sampler, chunked log-prob


# ------------------------------------------------------------------------------------------------
# 1. Records and metrics: what flows between the trainer's phases, and what each step logs
#    (Row, PeerResponse, StepRows and the rule's Context are core.py's: a porter copies them with the rule)
# ------------------------------------------------------------------------------------------------


class SampledResponse(NamedTuple):
    """One own rollout after sampling and scoring, as it travels between ranks."""

    tokens: list[int]  # response ids, EOS included when it ended with EOS
    logprobs: torch.Tensor  # (len(tokens),) behaviour log-probs, recomputed by one forward
    text: str  # decoded without special tokens, EOS dropped
    ended_with_eos: bool
    reward: float


def rollout_metrics(own: StepRollouts) -> dict[str, float]:
    """The metrics of this side's own G x n rollouts of a step (metrics.METRICS: reward ... all_pass)."""
    n = own.rewards.shape[1]
    k_own = success_counts(own.rewards)  # (G,)
    return {"reward": float(own.rewards.mean()), "response_len": sum(len(t) for t in own.tokens) / len(own.tokens),
            "eos_frac": float(own.eos.float().mean()), "all_fail": float((k_own == 0).float().mean()),
            "all_pass": float((k_own == n).float().mean())}


# ------------------------------------------------------------------------------------------------
# 2. GRAFT's rule: the select, score and rows phases of its step, as the paper states them, each data in and
#    data out: (ctx: core.Context, the step's own rollouts, the peers' steps, each a core.Rollouts) -> (results,
#    metrics, counts). Their tensor functions, the ablations' included, and every name their annotations use are
#    core.py's: pasted under `from core import *` into another trainer, these three run (docs/PORTING.md).
# ------------------------------------------------------------------------------------------------


def rule_context(cfg: Config, *, tokenizer, eos_id: int, logprob_fn: Callable, both_ways: bool,
                 peer_kind: str = "pg") -> Context:
    """The rule's read-only Context from the run's config, the receiver's tokenizer and log-prob function.
    both_ways: the peers are live sides that receive too (online); False for a stored peer (one-way)."""
    return Context(side=cfg.name, n=cfg.n, seed=cfg.seed, tokenizer=tokenizer, eos_id=eos_id, logprob_fn=logprob_fn,
                   max_response_tokens=cfg.max_response_tokens, both_ways=both_ways, selection=cfg.selection,
                   balance=cfg.balance, acceptance=cfg.acceptance, transfer=cfg.transfer,
                   peer_advantages=cfg.peer_advantages, std_normalize=cfg.std_normalize, compat_norm=cfg.compat_norm,
                   compat_weight=cfg.compat_weight, delta=cfg.delta, peer_kind=peer_kind)


def graft_select(ctx: Context, step: int, own: Rollouts,
                 peers: dict[str, Rollouts]) -> tuple[dict[str, torch.Tensor], dict, dict]:
    """Eq. 4 and the balanced swap: for each peer, the (G,) bool mask of the prompts whose group this side
    receives, the metrics, no counts. Two live sides run the paper's balanced_swap; three or more its extension
    multi_peer_sources (equal on two sides: test_peers.py); every process computes the same swap from the same
    files and logs its fingerprint. From a stored peer the transfer is one-way, with nothing to balance against."""
    if not peers:  # plain GRPO
        return {}, {}, {}
    k_own, k, m = exchange_counts(own, peers, ctx.n)
    if ctx.selection == "sgt":  # ablation: SGT's rescue rule, no balancing
        return {name: rescue_candidates(k_recv=k_own, k_src=k[name]) for name in peers}, m, {}
    if not ctx.both_ways:
        selected = {name: graft_candidates(k_recv=k_own, k_src=k[name], n=p.sizes) for name, p in peers.items()}
    else:
        sides = sorted([ctx.side, *peers])  # one order on every process of the run
        counts = torch.stack([k_own if s == ctx.side else k[s] for s in sides])  # (S, G)
        if len(sides) == 2:  # the paper's pair: its balanced swap, as src (2, G) (side 1 receives a_to_b)
            swap = balanced_swap(k_a=counts[0], k_b=counts[1], n=ctx.n, balance=ctx.balance)
            src = torch.stack([torch.where(swap.b_to_a, 1, -1), torch.where(swap.a_to_b, 0, -1)])  # (2, G)
        else:  # our extension to three or more sides
            src = multi_peer_sources(counts, ctx.n, balance=ctx.balance)  # (S, G) whose group each side receives
        selected = {name: src[sides.index(ctx.side)] == sides.index(name) for name in peers}
        if ctx.selection == "graft":  # the fingerprint of the whole step's exchange: equal on every process
            m["assignment"] = assignment_digest(src, own.prompt_ids)
    if ctx.selection == "random":  # ablation (one peer: config.validate_config)
        selected = {name: random_selection(selected[name], k_src=k[name], sizes=p.sizes,
                                            generator=seeded_generator(ctx.seed, step, "select"))
                    for name, p in peers.items()}
    return selected, m, {}


def graft_score(ctx: Context, step: int, prompts: list[list[int]], peers: dict[str, Rollouts],
                selected: dict[str, torch.Tensor]) -> tuple[dict[str, list[PeerResponse]], dict, dict]:
    """Every response of the received groups retokenised and scored under the receiver (Eqs. 6-8), each with
    its s and w (w = 0: rejected; it leaves before the update). --transfer success keeps only the peer's
    correct responses (ablation). prompts: the step's G receiver prompt ids. Returns ({peer: [PeerResponse]},
    metrics, counts)."""
    if not peers:  # plain GRPO
        return {}, {}, {}
    received: dict[str, list[PeerResponse]] = {}
    m: dict = {}
    counts: dict = {}
    n_selected = offered = dropped_len = 0
    for name, peer in peers.items():
        groups = torch.nonzero(selected[name]).squeeze(1).tolist()
        received[name], dropped, c = score_peer(ctx, step, peer, groups, prompts,
                                                only_correct=ctx.transfer == "success")
        counts = add_counts([counts, c])
        n_selected, dropped_len = n_selected + len(groups), dropped_len + dropped
        offered += int(peer.sizes[groups].sum()) if groups else 0
        if len(peers) > 1:
            m |= {f"selected/{name}": len(groups), f"accepted/{name}": sum(x.weight > 0 for x in received[name])}
    every = [x for got in received.values() for x in got]
    kept = [x for x in every if x.weight > 0]
    return received, m | {
        "selected": n_selected, "peer_responses": offered, "dropped_length": dropped_len, "accepted": len(kept),
        "rejected": len(every) - len(kept),
        "mean_s": float(torch.tensor([x.s for x in every]).mean()) if every else float("nan"),
        "s_each": [float(x.s) for x in every], "s_index": [x.slot for x in every],  # panel.py reads both
        "mean_w": float(torch.tensor([x.weight for x in kept]).mean()) if kept else float("nan")}, counts


def graft_rows(ctx: Context, prompts: list[list[int]], own: Rollouts, peers: dict[str, Rollouts],
               selected: dict[str, torch.Tensor], received: dict[str, list[PeerResponse]],
               state: dict) -> tuple[StepRows, dict, dict]:
    """GRAFT's replacement: the receiver's own groups, except each group it receives, whose rows are the
    peer's retained responses (w > 0, departure 4) with the peer's advantages, computed on the peer's full
    group and held fixed, and weight w. Returns StepRows (the rows, the (G,) bool mask of groups that reached
    the update from a peer, state unchanged), no metrics, no counts."""
    n, G = ctx.n, len(prompts)
    own_adv = own.advantages.clone()  # (G, n)
    peer_adv: dict[int, torch.Tensor] = {}  # group -> (width,) advantages of the peer's group
    for name, peer in peers.items():
        for g in torch.nonzero(selected[name]).squeeze(1).tolist():
            peer_adv[g] = peer.advantages[g]
            if ctx.peer_advantages == "pooled":  # ablation: the two groups merged, the own rows kept
                own_adv[g], peer_adv[g] = pooled_advantages(own.rewards[g], peer.rewards[g], peer.mask[g],
                                                            std_normalize=ctx.std_normalize)
    rows = [Row(g, prompts[g], own.tokens[g * n + i], own.logprobs[g * n + i], float(own_adv[g, i]))
            for g in range(G) if g not in peer_adv or ctx.peer_advantages == "pooled" for i in range(n)]
    replaced = torch.zeros(G, dtype=torch.bool, device=own.rewards.device)  # (G,) where the rollouts are
    for name, got in received.items():
        for x in got:
            if x.weight > 0:  # w = 0: removed before optimisation
                rows.append(Row(x.group, prompts[x.group], x.ids, x.old_logp,
                                float(peer_adv[x.group][x.slot % peers[name].width]), weight=x.weight, is_peer=True,
                                kind=ctx.peer_kind))
                replaced[x.group] = True
    return StepRows(rows, replaced, state), {}, {}


# ------------------------------------------------------------------------------------------------
# 3. The registry of methods: GRAFT's three phases or a baseline's (baselines.py), and how the update treats
#    each row kind. Adding a variant is one entry of VARIANTS and one value of config.Config.variant.
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LossKind:
    """How the update treats the rows of one Row.kind (the table is LOSS_KINDS)."""

    fn: Callable | None = None  # None = policy_loss (Eqs. 9-10); else fn(batch, cfg=, loss_denominator=, minibatch=)
    pool: str = "policy"  # the token-mean pool: rows whose kinds name the same pool share one loss denominator
    uses_advantage: bool = True  # True: rows with a = 0 give exactly zero gradient and skip the forward


LOSS_KINDS: dict[str, LossKind] = {  # every Row.kind and how the update treats it: declared once
    "pg": LossKind(),  # Eqs. 9-10: GRPO, GRAFT and its ablations
    "luffy": LossKind(fn=luffy_rows_loss),
    "hacpo_own": LossKind(fn=hacpo_own_loss),
    "hacpo_peer": LossKind(fn=hacpo_peer_loss),
    "nll": LossKind(fn=sgt_rows_loss, pool="nll", uses_advantage=False),  # SGT's NLL: its own token-mean
}


class Variant(NamedTuple):
    """One method as the three phases of Trainer.step that differ between methods: which groups a side
    receives (select), which of their responses it keeps, retokenised and scored (score), and the update
    rows they become (rows). Each phase returns (results, metrics, counts)."""

    select: Callable  # (ctx, step, own, peers) -> ({peer: (G,) bool}, metrics, counts)
    score: Callable  # (ctx, step, prompts, peers, selected) -> ({peer: [PeerResponse]}, metrics, counts)
    rows: Callable  # (ctx, prompts, own, peers, selected, received, state) -> (StepRows, metrics, counts)
    peer_kind: str = "pg"  # the Row.kind of received responses in graft_rows (LUFFY: its peer-token loss)


VARIANTS: dict[str, Variant] = {
    "graft": Variant(graft_select, graft_score, graft_rows),  # section 2
    "luffy": Variant(graft_select, graft_score, graft_rows, peer_kind="luffy"),  # GRAFT's rows, LUFFY's loss
    "hacpo": Variant(hacpo_select, hacpo_score, hacpo_rows),
    "sgt": Variant(sgt_select, sgt_score, sgt_rows),
}
assert set(VARIANTS) == set(CHOICES["variant"]), "config.Config.variant must list exactly the entries of VARIANTS"


# ------------------------------------------------------------------------------------------------
# 4. The trainer: one side of GRAFT (or plain GRPO), the loop that calls the rule's phases
# ------------------------------------------------------------------------------------------------


class Trainer:
    """One side of GRAFT (or plain GRPO): owns the model, the optimizer and the step loop.

    Its file keeping, not the method, is an object it holds, self.files (runtime.RunFiles), which keeps its own
    paths, the pair's run identity and heartbeat: the run directory (refuse to overwrite, --force, writability),
    the --resume checks, metrics trimming and atomic checkpoints of the model, optimizer and state handed to it."""

    live: LiveReport | None = None  # --report-to, opened by the first log()
    # A high share of refused boxes in a launch's first steps is a format verify.py's reader does not take, not a
    # model still learning: log() says so once, while the run is cheap to stop (metric reward/box_refused)
    BOX_WARN_STEPS, BOX_WARN_SHARE = 5, 0.2
    box_warned = False

    def __init__(self, cfg: Config):
        validate_config(cfg)
        load_reward(cfg.reward)  # ValueError naming --reward, before anything loads
        self.cfg = cfg
        self.dist = setup_distributed(cfg)
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        torch.manual_seed(cfg.seed)
        self.files = RunFiles(cfg, self.dist)  # out, checkpoints, the exchange folder, the run's identity
        # The method's select, score and rows phases (section 3's registry); without a peer each is plain GRPO's.
        self.variant = VARIANTS[cfg.variant] if cfg.peer_exchange or cfg.peer_log else VARIANTS["graft"]
        # The peer source, one interface (read, both_ways, describe) over three kinds of peer: exchange.OnlinePeers
        # (live sides), foreign.StoredRun (a finished run's files), foreign.ForeignLog (a JSONL log); None = GRPO.
        self.peers: OnlinePeers | StoredRun | ForeignLog | None = None
        self.best_eval_mean = -1.0
        self.baseline_state: dict = {}  # what a baseline keeps across steps (HACPO's success history)
        # Everything that can fail on bad input fails here, before the first rollout: the run
        # directory, the prompts, the stored peer log, the pair's run identity, then the model.
        files = self.files
        if cfg.resume:
            files.check_resume_settings()  # refuses a change of what defines the run, before anything loads
        latest, state = files.resume_checkpoint() if cfg.resume else (None, None)  # sets files.start_step
        if latest is not None:
            self.best_eval_mean, self.baseline_state = float(state["best_eval_mean"]), state.get("baseline_state", {})
        elif cfg.resume and self.dist.main:
            print(f"--resume: no checkpoint in {files.ckpt_dir}, starting from --model")
        if self.dist.main:
            files.prepare_run_dir()
        self.data = load_prompt_file(cfg.prompts)
        self.data_by_id = {r["id"]: r for r in self.data}
        if len(self.data) < cfg.prompts_per_step:
            raise SystemExit(f"--prompts {cfg.prompts}: {len(self.data)} prompts < --prompts-per-step "
                             f"{cfg.prompts_per_step}")
        check_golds(self.data, cfg, main=self.dist.main)
        if cfg.peer_log:  # a rollout folder's files, or a JSONL of foreign trajectories loaded once, checked here
            self.peers = open_peer_log(cfg, self.data, self.dist, start_step=files.start_step)
        files.join_pair()  # files.run_id, files.attempt; online, the heartbeat
        if cfg.peer_exchange:
            self.peers = OnlinePeers(files.exchange, cfg.peer_name.split(","), me=cfg.name, n=cfg.n,
                                     timeout=cfg.exchange_timeout, dead_after=cfg.peer_dead_after)
            self.peers.run_id, self.peers.attempt = files.run_id, files.attempt
        try:
            check_at_start(cfg, self.dist, benchmark_files)  # the memory plan: a misfit stops before any weight loads
            self.model, self.tok, self.stop_ids = load_policy(str(latest or cfg.model), cfg, self.dist)
            self.eos_id = self.stop_ids[0]
            self.amp = lambda: compute_context(cfg, self.dist)
            # --fsdp: the FSDP2 root whose forward is the log-prob pass (runtime.shard_policy); None = DP
            self.fsdp_root = shard_policy(self.model, response_logprobs) if cfg.fsdp else None
            self.opt = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr, betas=(0.9, 0.999),
                                         weight_decay=cfg.weight_decay, **adamw_kernel(self.dist.device))
            if latest is not None and self.fsdp_root is not None:
                load_full_optimizer_state(self.fsdp_root, self.opt, state["optimizer"])
            elif latest is not None:
                self.opt.load_state_dict(state["optimizer"])
            for group in self.opt.param_groups:  # the optimizer state restores the run's lr; --lr is the one used
                group["lr"] = cfg.lr
            self.prompt_ids = [encode_prompt(r["problem"], self.tok, template=cfg.prompt_template,
                                             chat=cfg.chat_template) for r in self.data]
            too_long = [(r["id"], len(p)) for r, p in zip(self.data, self.prompt_ids) if len(p) > cfg.max_prompt_tokens]
            if too_long:
                raise SystemExit(f"--prompts {cfg.prompts}: {len(too_long)} prompts exceed --max-prompt-tokens "
                                 f"{cfg.max_prompt_tokens} (first: {too_long[0]}); raise the limit or filter the file")
            # what the rule's phases read (section 2): settings, the receiver's tokenizer and log-prob function
            self.ctx = rule_context(cfg, tokenizer=self.tok, eos_id=self.eos_id, logprob_fn=self.sharded_logprobs,
                                    both_ways=self.peers is not None and self.peers.both_ways,
                                    peer_kind=self.variant.peer_kind)
        except BaseException as e:
            files.leave_pair(e)  # the peer may already wait on us: tell it now
            raise
        if self.dist.main:
            self.print_derived()

    # -- the step: one call per phase of the map -------------------------------------------------

    def step(self, step: int) -> dict:
        """One RL step, the map's phases in order (module docstring); each returns what the next takes, and its
        metrics and counts. The rule's three phases are the variant's functions on data (sections 2-3)."""
        t_start = time.time()
        batch = batch_indices(len(self.data), step, self.cfg.prompts_per_step, self.cfg.data_seed)  # (G,) indices
        prompts = [self.prompt_ids[i] for i in batch]  # (G,) the receiver's prompt ids of the step
        own, c_own, timings = self.rollout(step, batch)
        with timed(timings, "write"):
            self.publish(step, own)
        with timed(timings, "wait"):
            peers, c_peers = self.wait_for_peers(step, own)
        with timed(timings, "exchange"):  # selection, retokenisation, compatibility scoring
            v, ctx = self.variant, self.ctx
            selected, m_select, c_select = v.select(ctx, step, own, peers)
            received, m_score, c_score = v.score(ctx, step, prompts, peers, selected)
            built, m_rows, c_rows = v.rows(ctx, prompts, own, peers, selected, received, self.baseline_state)
            self.baseline_state = built.state  # what the variant keeps across steps, saved in checkpoints
        with timed(timings, "update"):
            m_update = self.update(step, built.rows, built.replaced)
        timings["step"] = time.time() - t_start
        counts = add_counts([c_own, c_peers, c_select, c_score, c_rows])
        return ({"step": step} | rollout_metrics(own) | m_select | m_score | m_rows | m_update | counts
                | {f"time/{k}": v for k, v in timings.items()})

    def rollout(self, step: int, batch: list[int]) -> tuple[StepRollouts, dict, dict]:
        """Sample n responses per prompt (this rank's share), score them with the reward, recompute their
        behaviour log-probs: the whole batch on every rank. batch: the step's G dataset indices.
        Returns the step's rollouts (G prompts x n), their counts over all ranks (the reward's faults, non-canonical
        token sequences; with verify.py as the reward, the share of boxes its reader refused) and the phase timings
        in seconds."""
        cfg, n, G = self.cfg, self.cfg.n, len(batch)
        timings: dict[str, float] = {}
        flat = [g * n + i for g in range(G) for i in range(n)]  # response r = g * n + i
        mine = shard(flat, self.dist)
        prompts = [self.prompt_ids[batch[r // n]] for r in mine]
        gen = seeded_generator(cfg.seed, step, "sample", rank=self.dist.rank, device=self.dist.device)
        with gathered(self.fsdp_root), timed(timings, "sample"), self.amp():
            # One call for the whole share: at most --gen-batch-size rows in flight, a finished row's slot
            # refilled from the queue (continuous batching), so long-tailed lengths keep the batch full.
            outs: list[Rollout] = sample(
                self.model, prompts, max_new_tokens=cfg.max_response_tokens, temperature=cfg.temperature,
                top_p=cfg.top_p, eos_token_id=self.stop_ids, pad_token_id=self.tok.pad_token_id, generator=gen,
                max_batch_size=cfg.gen_batch_size, static=cfg.static_decode, share_prefix=cfg.share_prefix,
                attention=cfg.decode_attention,
                max_cache_bytes=kv_budget(self.dist.device, self.model) if cfg.static_decode != "off" else None,
                stop_strings=cfg.stop, tokenizer=self.tok,
                progress=self.dist.main and len(prompts) > 64 and sys.stderr.isatty())
        with timed(timings, "verify"):
            # stored text: through the first stop string; the verifier reads it cut before (departure 11)
            texts = [decode_response(o.tokens, self.tok, eos_token_ids=self.stop_ids, stop=cfg.stop)[0] for o in outs]
            read = [verifier_text(t, cfg.stop) for t in texts]  # what the reward reads
            verdicts = rewards(cfg.reward, read, [self.data[batch[r // n]]["answer"] for r in mine],
                               **reward_options(cfg))
            # Boxes verify.py's reader refused by a reading rule, not by their value: counted here, on the texts the
            # reward read, and only on the unpaid ones (a paid response had its answer read); another --reward reads
            # answers its own way: not counted
            refused = ({"reward/box_refused": sum(box_refused(t) for t, v in zip(read, verdicts) if v < 0.5)}
                       if cfg.reward == DEFAULT_REWARD else {})
            counts = add_counts(gather_lists([verdicts.faults | refused | canonical_counts(  # the step's, all ranks
                [o.tokens for o in outs], prompts, self.tok, eos_token_ids=self.stop_ids)], self.dist))
            if refused:  # logged as a share of the step's G x n responses (each rank counted its own)
                counts["reward/box_refused"] /= G * n
        with gathered(self.fsdp_root), timed(timings, "logprob"):
            # Behaviour log-probs recomputed by a fresh forward through the same chunked path as the loss
            # (departure 7): in bf16 the sampler's incremental KV-cache numbers differ slightly from it.
            old = self.behaviour_logprobs(prompts, [o.tokens for o in outs])
        sampled = [SampledResponse(o.tokens, lp, txt, o.ended_with_eos, rw)
                   for o, lp, txt, rw in zip(outs, old, texts, verdicts)]
        every = unshard(gather_lists(sampled, self.dist), G * n, self.dist)  # G * n, response r = g * n + i
        reward_values = torch.tensor([x.reward for x in every], dtype=torch.float32).view(G, n)  # (G, n)
        return StepRollouts(
            prompt_ids=[self.data[i]["id"] for i in batch], tokens=[x.tokens for x in every],
            logprobs=[x.logprobs for x in every], texts=[x.text for x in every],
            eos=torch.tensor([x.ended_with_eos for x in every]).view(G, n), rewards=reward_values,
            advantages=group_advantages(reward_values, std_normalize=cfg.std_normalize)), counts, timings

    def publish(self, step: int, own: StepRollouts) -> None:
        """Write this side's rollout file of the step (rank 0; atomic): what the peers read, and the stored log."""
        cfg = self.cfg
        if self.dist.main:
            save_rollouts(rollout_path(self.files.exchange, cfg.name, step), own,
                          {"model": cfg.model, "tokenizer": getattr(self.tok, "name_or_path", ""), "step": step,
                           "temperature": cfg.temperature, "name": cfg.name, "data_seed": cfg.data_seed,
                           "run_id": self.files.run_id})

    def wait_for_peers(self, step: int, own: StepRollouts) -> tuple[dict[str, StepRollouts], dict]:
        """The peers' rollouts of this step, by side name, and counts, from the run's peer source: each live peer's
        file, waited for (exchange.OnlinePeers); a stored run's file, re-scored (foreign.StoredRun); a foreign log's
        groups (foreign.ForeignLog); none without a peer (GRPO)."""
        return self.peers.read(step, own) if self.peers is not None else ({}, {})

    # -- what the phases call ----------------------------------------------------------------------

    def behaviour_logprobs(self, prompts: list[list[int]], responses: list[list[int]]) -> list[torch.Tensor]:
        """Receiver log-probs (no grad) of the given responses, through the chunked path, in micro-batches of similar
        lengths (sampler.batches_by_length). One (len(response),) float32 CPU tensor per response, in order."""
        out: list[torch.Tensor | None] = [None] * len(prompts)
        was_training = self.model.training
        self.model.eval()
        with torch.no_grad(), self.amp():
            share = self.cfg.share_prefix  # as self.policy_logprobs decides it without grad
            for idx in batches_by_length(prompts, responses, self.cfg.micro_batch_size, share_prefix=share):
                lp, mask = self.policy_logprobs([prompts[i] for i in idx], [responses[i] for i in idx])
                for j, i in enumerate(idx):
                    out[i] = lp[j, : int(mask[j].sum())].float().cpu()
        self.model.train(was_training)
        return out

    def sharded_logprobs(self, prompts, responses) -> list[torch.Tensor]:
        """behaviour_logprobs with the rows split over ranks and gathered back in order."""
        with gathered(self.fsdp_root):
            mine = self.behaviour_logprobs(shard(prompts, self.dist), shard(responses, self.dist))
        return unshard(gather_lists(mine, self.dist), len(prompts), self.dist)

    def policy_logprobs(self, prompts: list[list[int]],
                        responses: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """The policy's per-token log-probs of the responses: (B, T) float and the (B, T) bool mask,
        through the chunked kernel; under --fsdp inside the FSDP root's forward (runtime.PolicyForward)."""
        # --fsdp with grad gathers the weights in every forward, so all ranks must make the same number of calls:
        # a shared prefix (a data-dependent second call) runs only where the weights are gathered (no grad)
        share = self.cfg.share_prefix and (self.fsdp_root is None or not torch.is_grad_enabled())
        kw = dict(pad_token_id=self.tok.pad_token_id, temperature=self.cfg.temperature or 1.0,
                  chunk_size=self.cfg.logprob_chunk, share_prefix=share)
        if self.fsdp_root is not None:
            return self.fsdp_root(prompts, responses, **kw)
        return response_logprobs(self.model, prompts, responses, **kw)

    def update(self, step: int, rows: list[Row], replaced: torch.Tensor) -> dict:
        """Peer-last PPO updates: per minibatch, its gradients (accumulate) and one optimizer step (optimizer_step).

        rows: the step's Rows; replaced: (G,) bool, groups that came from the peer. Returns the loss metrics per row
        kind ("<kind>/<key>"), grad_norm (mean over optimizer steps), zero_adv_frac, minibatches, peer_minibatches.
        A Mean's sums and counts are added over micro-batches, ranks and minibatches and divided once, so each mean
        is over exactly what it names; a kind's loss is its token-mean over the whole step."""
        cfg = self.cfg
        gen = seeded_generator(cfg.seed, step, "minibatch")
        mbs = minibatch_order(replaced, cfg.minibatches, order=cfg.order, generator=gen)
        by_group: dict[int, list[Row]] = {}
        for r in rows:
            by_group.setdefault(r.group, []).append(r)
        step_sums: dict[str, float | Mean] = {}
        norms, peer_mb = [], []
        self.model.train()
        for mb_index, mb in enumerate(mbs):
            mb_rows = [r for g in mb.tolist() for r in by_group.get(g, [])]
            peer_mb.append(any(r.is_peer for r in mb_rows))
            mb_sums = self.accumulate(step, mb_index, mb_rows)
            if mb_sums is None:  # no token to learn from in this minibatch: no optimizer step
                continue
            add_metrics(step_sums, mb_sums)
            norms.append(self.optimizer_step(step, mb_index))
        m: dict = metric_values(step_sums, drop_empty=True)  # a mean over nothing is not logged
        m["grad_norm"] = sum(norms) / max(1, len(norms))
        zero = sum(1 for r in rows if r.adv == 0 and LOSS_KINDS[r.kind].uses_advantage)
        m["zero_adv_frac"] = zero / max(1, len(rows))
        m["minibatches"] = len(mbs)
        m["peer_minibatches"] = sum(peer_mb)
        return m

    def accumulate(self, step: int, mb_index: int, mb_rows: list[Row]) -> dict | None:
        """One minibatch's gradients, over this rank's share of its rows in micro-batches, and its metric sums
        over every rank (None when no retained row has a token)."""
        cfg = self.cfg
        # One token-mean denominator per pool, over the whole minibatch (departure 3); removed
        # responses (w = 0) are not in it (Eq. 10).
        pool_tokens: dict[str, int] = {}
        for r in mb_rows:
            if r.weight > 0:
                pool = LOSS_KINDS[r.kind].pool
                pool_tokens[pool] = pool_tokens.get(pool, 0) + len(r.response)
        if not any(pool_tokens.values()):
            return None
        # Rows whose loss scales with a zero advantage (all-fail and all-pass groups) give exactly
        # zero gradient, so they skip the forward; their tokens stay in the denominator above.
        # Long rows first so micro-batches pad little; this rank's strided share.
        live = [r for r in mb_rows if r.weight > 0 and (r.adv != 0 or not LOSS_KINDS[r.kind].uses_advantage)]
        mine = shard(sorted(live, key=lambda r: -len(r.response)), self.dist)
        chunks: list[list[Row] | None] = [mine[i: i + cfg.micro_batch_size]
                                          for i in range(0, len(mine), cfg.micro_batch_size)]
        if self.fsdp_root is not None and live:
            # FSDP gathers weights inside every forward and reduces gradients after every backward:
            # all ranks must make the same number of calls. A rank with a smaller share runs idle
            # turns (None): one real row whose loss is multiplied by 0.
            most = -(-len(live) // self.dist.world)  # the largest rank's share (shard is strided)
            chunks += [None] * (-(-most // cfg.micro_batch_size) - len(chunks))
        self.opt.zero_grad(set_to_none=True)
        mb_sums: dict[str, float | Mean] = {}  # this rank's sums over the minibatch's micro-batches
        for chunk in chunks:
            with self.amp():
                loss, per_kind = self.minibatch_loss(chunk or live[:1], pool_tokens, mb_index)
            if chunk is None:
                loss, per_kind = loss * 0.0, {}
            value = float(loss.detach())
            if not math.isfinite(value):
                raise FloatingPointError(f"step {step}, minibatch {mb_index}: the loss is {value}; stopped before "
                                         f"the optimizer step ({self.files.resume_hint()})")
            loss.backward()
            for kind, mt in per_kind.items():
                add_metrics(mb_sums, mt, prefix=f"{kind}/")
        if self.dist.world > 1:  # every rank's sums, its own included: numerators and counts apart
            merged: dict[str, float | Mean] = {}
            for part in gather_lists([mb_sums], self.dist):
                add_metrics(merged, part)
            mb_sums = merged
        # A kind's minibatch loss (the sum of its parts, each already divided by the minibatch's
        # denominator D) enters the step's token-mean as (loss * D, D); a minibatch whose rows all
        # skipped the forward has loss 0 over its D tokens.
        for kind in dict.fromkeys(r.kind for r in mb_rows if r.weight > 0):
            d = max(pool_tokens.get(LOSS_KINDS[kind].pool, 1), 1)
            mb_sums[f"{kind}/loss"] = Mean(float(mb_sums.get(f"{kind}/loss", 0.0)) * d, float(d))
        return mb_sums

    def optimizer_step(self, step: int, mb_index: int) -> float:
        """Reduce the minibatch's gradients over ranks, clip them (grad_clip) and take one AdamW step. Returns the
        gradient norm before clipping."""
        # The optimizer's own parameters: under FSDP, module.parameters() can be the gathered copies.
        params = [p for group in self.opt.param_groups for p in group["params"]]
        for p in params:  # a step with zero gradient still decays weights and moves Adam's moments
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if self.dist.world > 1 and self.fsdp_root is None:  # data parallel: sum the per-rank partial gradients
            for p in params:  # (the loss is a global sum; FSDP already reduce-scattered them, summed)
                torch.distributed.all_reduce(p.grad)
        norm = float(torch.nn.utils.clip_grad_norm_(params, self.cfg.grad_clip) if self.fsdp_root is None
                     else clip_sharded_grad_norm_(params, self.cfg.grad_clip))
        if not math.isfinite(norm):
            raise FloatingPointError(f"step {step}, minibatch {mb_index}: the gradient norm is {norm}; stopped "
                                     f"before the optimizer step ({self.files.resume_hint()})")
        self.opt.step()
        return norm

    def minibatch_loss(self, rows: list[Row], pool_tokens: dict[str, int], mb_index: int) -> tuple[torch.Tensor, dict]:
        """Forward + loss of one micro-batch of rows; pool_tokens: each pool's retained tokens in the whole minibatch.

        Returns the summed loss and {row kind: that kind's loss metrics, with its "loss" part}.
        """
        cfg = self.cfg
        lp, mask = self.policy_logprobs([r.prompt for r in rows], [r.response for r in rows])  # (B, T)
        old = torch.zeros_like(lp)  # (B, T)
        for j, r in enumerate(rows):
            old[j, : len(r.response)] = r.old_logp.to(lp.device)
        adv = torch.tensor([r.adv for r in rows], device=lp.device)  # (B,)
        w = torch.tensor([r.weight for r in rows], device=lp.device)  # (B,)
        is_peer = torch.tensor([r.is_peer for r in rows], device=lp.device)  # (B,)
        kinds = [r.kind for r in rows]
        loss, metrics = lp.new_zeros(()), {}
        for kind in dict.fromkeys(kinds):
            sel = torch.tensor([k == kind for k in kinds], device=lp.device)  # (B,)
            spec = LOSS_KINDS[kind]
            denom = max(pool_tokens.get(spec.pool, 1), 1)
            if spec.fn is None:  # Eqs. 9-10: GRPO, GRAFT and its ablations
                part, mt = policy_loss(logp=lp[sel], old_logp=old[sel], advantages=adv[sel], mask=mask[sel],
                                       weights=w[sel], eps_low=cfg.eps_low, eps_high=cfg.eps_high,
                                       dual_clip=cfg.dual_clip or None, ratio_level=cfg.ratio_level,
                                       is_peer=is_peer[sel], loss_denominator=denom)
            else:  # a baseline's surrogate (baselines.py)
                part, mt = spec.fn(RowBatch(lp[sel], old[sel], adv[sel], mask[sel], w[sel], is_peer[sel]), cfg=cfg,
                                   loss_denominator=denom, minibatch=mb_index)
            loss = loss + part
            metrics[kind] = {**mt, "loss": float(part.detach())}
        return loss, metrics

    # -- bookkeeping: logs, checkpoints, the loop -------------------------------------------------

    def print_derived(self):
        cfg, G = self.cfg, self.cfg.prompts_per_step
        n_params = sum(p.numel() for p in self.model.parameters())
        print(f"[graft] side {cfg.name!r} model {cfg.model} ({n_params / 1e6:.1f}M params, "
              f"{next(self.model.parameters()).dtype}) on {self.dist.device} x{self.dist.world}")
        print(f"[graft] peer: {self.peers.describe() if self.peers is not None else 'none'}, variant {cfg.variant}")
        print(f"[graft] {len(self.data)} prompts; per step {G} prompts x n={cfg.n} = {G * cfg.n} rollouts, "
              f"{cfg.minibatches} minibatches of ~{G // cfg.minibatches} groups; {cfg.steps} steps "
              f"= {cfg.steps * G / len(self.data):.2f} epochs; starting at step {self.files.start_step}")
        print(f"[graft] stop ids {self.stop_ids}; rollout files -> {self.files.exchange / cfg.name}; "
              f"metrics -> {self.files.out / 'metrics.jsonl'}")

    def log(self, m: dict):
        """One step's metrics (keys: METRICS): a line of metrics.jsonl, --report-to, a console line."""
        if not self.dist.main:
            return
        with open(self.files.out / "metrics.jsonl", "a") as f:
            f.write(json.dumps(m) + "\n")
        if self.cfg.report_to != "none":
            self.live = self.live or LiveReport(self.cfg.report_to, self.files.out, self.cfg)
            self.live.log(m)

        def g(k, fmt="{:.3f}"):
            v = m.get(k)
            ok = isinstance(v, (int, float)) and not (isinstance(v, float) and math.isnan(v))
            return fmt.format(v) if ok else "-"

        t = lambda k: f"{m.get('time/' + k, 0.0):.1f}"  # noqa: E731
        print(f"step {m['step'] + 1:>4}/{self.cfg.steps} | reward {g('reward')} | all-fail {g('all_fail', '{:.2f}')} | "
              f"cand {g('candidates_in', '{}')} sel {g('selected', '{}')} acc {g('accepted', '{}')}/"
              f"{g('peer_responses', '{}')} w {g('mean_w', '{:.2f}')} | clip own {g('pg/clipfrac_own')} peer "
              f"{g('pg/clipfrac_peer')} | loss {g('pg/loss', '{:+.4f}')} gnorm {g('grad_norm', '{:.2f}')} | "
              f"len {g('response_len', '{:.0f}')} | s: sample {t('sample')} verify {t('verify')} "
              f"logp {t('logprob')} wait {t('wait')} exch {t('exchange')} update {t('update')}", flush=True)
        refused = m.get("reward/box_refused")
        if (refused is not None and refused >= self.BOX_WARN_SHARE and not self.box_warned
                and m["step"] < self.files.start_step + self.BOX_WARN_STEPS):
            self.box_warned = True
            print(f"WARNING: step {m['step'] + 1}: {refused:.0%} of the responses hold a box that verify.py's reader "
                  "refused by a reading rule, not by its value (reward/box_refused): the model likely writes something "
                  "after its final box that changes the value or states another answer; see verify.py's module "
                  "docstring, \"What counts as an answer\"", file=sys.stderr, flush=True)

    def fit(self):
        cfg, files = self.cfg, self.files
        if isinstance(self.peers, OnlinePeers):  # the clock starts once this side's own model has loaded
            self.peers.join_by = time.time() + cfg.join_timeout
            if self.dist.main:
                print(f"[graft] run {files.run_id} attempt {files.attempt} in {files.exchange}: waiting up to "
                      f"--join-timeout {cfg.join_timeout:.0f}s for {', '.join(self.peers.names)} to join")
        # SIGTERM (a scheduler's kill, Ctrl-C of a launcher) and SIGINT become exceptions, so the FAILED marker
        # below is written (kill -9 writes nothing: the heartbeat tells); raised again at every step boundary,
        # as Python can lose one (runtime.stop_signals).
        with stop_signals() as caught:
            try:
                for step in range(files.start_step, cfg.steps):
                    raise_stopped(caught)
                    files.at_step(step)  # the heartbeat's step; a process a relaunch left behind stops here
                    m = self.step(step)
                    if cfg.eval_every and (step + 1) % cfg.eval_every == 0:
                        m.update(self.validate(step + 1))
                    self.log(m)
                    if (step + 1) % cfg.save_every == 0 or step + 1 == cfg.steps:
                        self.checkpoint(step + 1)
                raise_stopped(caught)  # one during the last checkpoint: saved, but not a clean finish
            except BaseException as e:
                files.leave_pair(e)  # tell a waiting peer at once instead of letting it time out
                raise
        files.finish()

    def checkpoint(self, step: int, dest: Path | None = None) -> None:
        """The model, tokenizer, optimizer and trainer state after `step` steps, atomically (runtime.RunFiles)."""
        self.files.save_checkpoint(step, model=self.model, tok=self.tok, opt=self.opt, fsdp_root=self.fsdp_root,
                                   state={"best_eval_mean": self.best_eval_mean, "baseline_state": self.baseline_state},
                                   dest=dest)

    def validate(self, step: int) -> dict:
        """--eval-every: sampled in the rollouts' precision (self.amp) and KV budget (runtime.eval_rows)."""
        cfg = self.cfg
        with gathered(self.fsdp_root), self.amp():
            res = evaluate_benchmarks(self.model, self.tok, self.stop_ids, cfg, self.dist, progress=False,
                                      max_batch_size=eval_rows(cfg, paged=bool(resolve_static(
                                          cfg.static_decode, self.model, self.dist.device))))
        eval_mean = res["mean"]
        if self.dist.main:
            print(f"[eval] step {step}: " + ", ".join(f"{k} {v['pass@1']:.3f}" for k, v in res["benchmarks"].items())
                  + f" | mean {eval_mean:.4f} (best {max(eval_mean, self.best_eval_mean):.4f})")
        if eval_mean > self.best_eval_mean:
            self.best_eval_mean = eval_mean
            self.checkpoint(step, dest=self.files.ckpt_dir / "best")
        return {f"eval/{k}": v["pass@1"] for k, v in res["benchmarks"].items()} | {"eval/mean": eval_mean}

# ------------------------------------------------------------------------------------------------
# 5. CLI: config.build_parser's flags (field names with dashes, help = field docstrings), dispatched
# ------------------------------------------------------------------------------------------------


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    # The tools are graft.py's commands, so this dispatch imports tools/ (inside main only); none imports graft.py.
    if argv[:1] == ["complement"]:  # its own flags (complement.py): sources, --n, --batch-size
        from tools import complement
        return complement.main(argv[1:])
    if argv[:1] == ["preflight"]:  # its own flags (preflight.py): two models, prompts, the training settings
        from tools import preflight  # it imports what it runs from where it lives (core.py, reward.py, ...)
        return preflight.main(argv[1:])
    if argv[:1] == ["panel"]:  # its own flags (panel.py: two models, a pool, --half, --steps) + the training flags
        from tools import panel  # it runs graft.py's processes and reads their files, never imports graft.py
        return panel.main(argv[1:])
    if argv[:1] == ["plot"]:  # its own flags: run folders, --out, --smooth
        from tools import plot  # matplotlib only there
        return plot.main(argv[1:])
    args = build_parser().parse_args(argv)
    cfg = config_from_args(args)
    try:
        validate_config(cfg)
        load_reward(cfg.reward)  # the user's reward imports and has the signature, before anything loads
    except ValueError as e:
        raise SystemExit(f"graft.py {args.command}: {e}")
    commands = {"train": lambda: Trainer(cfg).fit(), "eval": lambda: run_eval(cfg),  # plan: exit status 3 = misfit
                "plan": lambda: sys.exit(run_plan(cfg, benchmark_files=benchmark_files))}
    commands[args.command]()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    if cfg.fsdp:
        # Every file is written. FSDP2 over gloo (CPU) can abort in a C++ destructor at interpreter exit in this torch
        # version ("terminate called without an active exception"), failing a finished run: end here, skipping them.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
