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

One GRAFT step, in call order (Trainer.step; each side of the pair runs the same code):
    1. batch_indices            the step's G prompts, a pure function of (--data-seed, step)   exchange.py
    2. Trainer.rollout          sample n per prompt, verify_batch -> rewards (G, n),
                                group_advantages, behaviour log-probs by one forward
    3. save_rollouts / load_rollouts   write this side's file, wait for and read the peer's     exchange.py
    4. Trainer.select           received_groups -> balanced_swap -> graft_candidates (Eq. 4)
    5. Trainer.score_peer       score_received: retokenize -> receiver log-probs ->
                                compatibility_weights (Eqs. 6-8); `graft.py preflight` runs it too
    6. Trainer.build_rows       own groups + the peer's retained responses with the peer's
                                advantages and w: one Row per response
    7. Trainer.update           minibatch_order (peer-last) -> per minibatch Trainer.minibatch_loss
                                -> policy_loss (Eqs. 9-10) -> one AdamW step
    8. Trainer.log / save_checkpoint   one log line, a JSON metrics line (keys: METRICS; --report-to
                                tensorboard|wandb also live), atomic checkpoints
The copyable core (section 2, core.py) is everything a port to another trainer needs; sections 3-4 are
this repository's trainer around it; the baselines (section 5) sit apart and never on GRAFT's path.

File order: 1 Config (config.py) -> 2 the copyable core (core.py) -> 3 records -> 4 the trainer -> 5
baselines -> 6 evaluation -> 7 CLI (`graft.py plot` is plot.py). The satellites are imported once at the
top and run one way: graft.py -> offline.py (the stored peer) -> runtime.py (ranks, precision, loading,
the run's files) -> exchange.py (the rollout file); config.py, core.py, sampler.py (the sampler and the
chunked log-prob kernel) and verify.py (the reward) import nothing of ours, so each can be copied alone
(test_docs.py checks it).
The Trainer keeps its file keeping as the mixin runtime.RunFiles rather than a self.files object:
those methods read a dozen of the trainer's fields (cfg, dist, model, opt, best_score, ...), and
handing them over on every call would add plumbing to the step without making it easier to read.
README "The method, equation by equation" maps each equation to its function.

Departures from the paper or from vanilla GRPO (each is also said on the line that does it):
  1. Retokenisation encodes the peer's response text on its own and appends it to the receiver's
     prompt ids; a BPE merge across the prompt/response boundary is therefore never formed. Real
     tokenizers (Qwen3, SmolLM3, Llama-3.2) round-trip the benchmark text exactly, so nothing is lost.
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
     says "bf16"): pure bf16 weights would round most lr = 1e-6 updates away.
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
     response is cut the same way (offline.py choice 8).

Our extensions beyond the paper (the paper's behaviour is unchanged when they are not used):
  * Three or more sides (`--peer-name b,c`): for each prompt a side fails on all n, the eligible
    sources are the other sides with a mixed group, and it receives the whole group of the one with
    the most successes (the most correct traces to imitate; ties to the name that sorts first, a
    fixed rule so that every process computes the same assignment from the same files); balancing
    then applies per pair of sides exactly as the paper's swap does for two (multi_peer_sources).
    With two sides it is the paper's rule. Every online process logs a fingerprint of the step's
    whole assignment (metrics key "assignment", assignment_digest), so that agreement can be checked.
  * Foreign trajectories: `--peer-log FILE.jsonl` takes any collection of (problem, response)
    records as the stored peer, matched by id or problem text, re-verified, with advantages within
    each prompt's group of any size (offline.py); `--peer-model` supplies a missing lbar.
  * `graft.py complement`: the paper's complementarity statistics for candidate models before a
    pair run (offline.py); `graft.py preflight` samples two models and runs a step's selection and
    gate on the samples (preflight.py).

Launch lines:
    # CPU, tiny preset: two tiny models, GRPO vs GRAFT, a table at the end (minutes)
    bash run_pair.sh tiny
    # 1 GPU, single-model GRPO (the n=8 baseline)
    python graft.py train --model Qwen/Qwen3-1.7B-Base --prompts data/math_train.jsonl --out runs/grpo_qwen
    # the pair on one node (two processes that meet in an exchange directory; GPUs split 4 + 4)
    bash run_pair.sh pair1
    # evaluation of a checkpoint on the five benchmarks
    python graft.py eval --model runs/graft_qwen/checkpoints/best --benchmarks all
    # curves of runs on the same axes (needs matplotlib): reward, exchange, gate, clip fractions, KL, time
    python graft.py plot runs/tiny/seed0/graft/A runs/tiny/seed0/grpo/A --out runs/tiny/plots
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import json
import math
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, NamedTuple

import torch

# The satellites, imported here once; the copyable core (core.py) uses none of them. Imports run one way:
# graft.py -> offline.py -> runtime.py -> exchange.py; config.py, core.py, sampler.py and verify.py stand alone.
import offline  # the stored peer at start (--peer-log) and `graft.py complement`
from exchange import (ROLLOUT_FORMAT, ROLLOUT_VERSION, Heartbeat, StepRollouts, atomic_write,  # noqa: F401
                      batch_indices, join_run, leave_run, load_rollouts, new_run_id, read_json, rollout_path,
                      save_rollouts, wait_for_file, write_failed, write_json)  # the rollout file, run identity
from runtime import (DistInfo, RunFiles, clip_sharded_grad_norm_, compute_context, encode_prompt,  # noqa: F401
                     full_state_dicts, gather_lists, gathered, load_full_optimizer_state, load_policy,
                     load_prompt_file, setup_distributed, shard, shard_policy, timed,
                     unshard)  # ranks, precision, loading, FSDP2, the run's files: plumbing, not the method
from config import Config  # noqa: F401  (the one dataclass; its field docstrings are the CLI's help)
from core import (Mean, Swap, add_metrics, assignment_digest, balance_directions, balanced_swap,  # noqa: F401
                  compatibility_scores, compatibility_weights, decode_response, graft_candidates, group_advantages,
                  metric_values, minibatch_order, multi_peer_sources, policy_loss, received_groups, rescue_candidates,
                  retokenize, seeded_generator, sequence_mean_logprob, success_counts, verifier_text)  # the core
from sampler import Rollout, response_logprobs, sample, token_logprobs  # noqa: F401  (the sampler and kernel)

# Sections 1 and 2 are files of their own, imported above: 1. Config is config.py (every field's docstring is also
# its --help line, section 7), 2. the copyable core is core.py (pure functions on tensors).


# ------------------------------------------------------------------------------------------------
# 3. Records: what flows between the trainer's phases (plumbing: runtime.py)
# ------------------------------------------------------------------------------------------------


@dataclass
class Row:
    """One response that enters the update: the receiver's tokenisation, fixed behaviour log-probs."""

    group: int  # prompt position in the step's batch (minibatches are cut by group)
    prompt: list[int]
    response: list[int]
    old_logp: torch.Tensor  # (len(response),) the receiver's behaviour log-probs (HACPO peers: see there)
    adv: float
    weight: float = 1.0
    is_peer: bool = False
    kind: str = "pg"  # pg = Eqs. 9-10 (GRPO, GRAFT and its ablations); other kinds: section 5


class SampledResponse(NamedTuple):
    """One own rollout after sampling and scoring, as it travels between ranks."""

    tokens: list[int]  # response ids, EOS included when it ended with EOS
    logprobs: torch.Tensor  # (len(tokens),) behaviour log-probs, recomputed by one forward
    text: str  # decoded without special tokens, EOS dropped
    ended_with_eos: bool
    reward: float


class PeerResponse(NamedTuple):
    """One peer response retokenised for the receiver and scored by it (Eqs. 6-8)."""

    group: int  # prompt position g in the step's batch
    index: int  # r = g * n + i in the peer's file
    ids: list[int]  # receiver token ids of the peer's text
    old_logp: torch.Tensor  # (len(ids),) receiver behaviour log-probs
    weight: float  # w = 1[s > delta] min(s, 1); 0 = removed
    score: float  # s = exp(lbar_recv - lbar_src)


@dataclass(frozen=True)
class LossKind:
    """How the update treats the rows of one Row.kind (the table is LOSS_KINDS)."""

    fn: Callable | None = None  # None = policy_loss (Eqs. 9-10); else fn(batch, cfg=, denominator=, minibatch=)
    denominator: str = "policy"  # rows whose kinds name the same denominator share one token-mean
    uses_advantage: bool = True  # True: rows with a = 0 give exactly zero gradient and skip the forward


LOSS_KINDS: dict[str, LossKind] = {"pg": LossKind()}  # the baselines add theirs in section 5


# ------------------------------------------------------------------------------------------------
# 4. The trainer: one side of GRAFT (or plain GRPO), its step in the order of the map above
# ------------------------------------------------------------------------------------------------


def unreadable_golds(rows: list[dict], *, workers: int = 0) -> list[str]:
    """Ids of the prompts whose gold answer verify.py cannot read: the response "\\boxed{<gold>}"
    does not match the gold itself (an unbalanced brace, say), so every response to them scores 0."""
    from verify import verify_batch
    scores = verify_batch([f"\\boxed{{{r['answer']}}}" for r in rows], [r["answer"] for r in rows], workers=workers)
    return [r["id"] for r, score in zip(rows, scores) if score <= 0]


def check_golds(rows: list[dict], cfg: Config, *, main: bool = True) -> None:
    """Warn about the prompts of --prompts that always score 0 (unreadable_golds), or stop with --strict."""
    bad = unreadable_golds(rows, workers=cfg.verify_workers)
    if not bad:
        return
    msg = (f"--prompts {cfg.prompts}: {len(bad)} of {len(rows)} gold answers cannot be read by verify.py "
           f"(\\boxed{{gold}} does not match the gold), so those prompts always score 0; first ids: "
           f"{', '.join(bad[:5])}")
    if cfg.strict:
        raise SystemExit(f"{msg} (--strict)")
    if main:
        print(f"WARNING: {msg} (fix or drop them; --strict makes this an error)", file=sys.stderr, flush=True)


class Received(NamedTuple):
    """score_received's answer for R peer responses, of which R' survived the length limit."""

    index: list[int]  # (R',) positions in the input of the responses kept (the others were too long)
    ids: list[list[int]]  # (R',) the receiver's token ids of each kept response (EOS appended if it ended)
    logprobs: list[torch.Tensor]  # (R',) the receiver's behaviour log-probs, one (len(ids),) tensor each
    lbar_recv: torch.Tensor  # (R',) Eq. 6 under the receiver, in --compat-norm
    lbar_src: torch.Tensor  # (R',) the source's lbar of the same responses
    s: torch.Tensor  # (R',) compatibility scores (Eq. 6)
    w: torch.Tensor  # (R',) weights (Eqs. 7-8; 1 each with compat_weight=False)


def score_received(texts: list[str], eos: list[bool], lbar_src: torch.Tensor, prompts: list[list[int]], *,
                   tokenizer, eos_token_id: int, logprobs: Callable, max_response_tokens: int,
                   compat_norm: str = "token", delta: float = 0.8, compat_weight: bool = True) -> Received:
    """Retokenise R peer responses for the receiver and score them under it (Eqs. 6-8).

    texts, eos: the peer's decoded responses and whether each ended with EOS; lbar_src: (R,) the
    source's lbar of each in compat_norm; prompts: the receiver's prompt ids of each. logprobs(prompts,
    responses) returns the receiver's behaviour log-probs, one (len,) tensor per response (the trainer's
    sharded_logprobs). A response longer than max_response_tokens after retokenisation (or empty) is
    dropped: it is not in the answer's index. Trainer.score_peer runs it on the received groups,
    `graft.py preflight` on every sampled response, so the two cannot drift.
    """
    assert len(texts) == len(eos) == len(prompts) == lbar_src.numel(), "one text, EOS flag, lbar and prompt each"
    index, ids = [], []
    for j, (text, ended) in enumerate(zip(texts, eos)):
        r = retokenize(text, ended, tokenizer, max_response_tokens=max_response_tokens, eos_token_id=eos_token_id)
        if r:  # None: too long; []: nothing left to score
            index.append(j)
            ids.append(r)
    if not index:
        empty = torch.zeros(0)
        return Received([], [], [], empty, empty, empty, empty)
    lps = logprobs([prompts[j] for j in index], ids)
    lp_sum = torch.stack([lp.sum() for lp in lps])  # (R',)
    if compat_norm == "byte":  # departure 2
        denom = [max(1, len(texts[j].encode("utf-8"))) for j in index]
    else:  # Eq. 6: mean log-prob per receiver token
        denom = [len(x) for x in ids]
    lbar_recv = lp_sum / torch.tensor(denom, dtype=torch.float32)  # (R',)
    src = lbar_src.float()[torch.tensor(index)]  # (R',)
    s = compatibility_scores(lbar_recv=lbar_recv, lbar_src=src)  # (R',) Eq. 6
    w = (compatibility_weights(lbar_recv=lbar_recv, lbar_src=src, delta=delta) if compat_weight
         else torch.ones_like(s))  # (R',) Eqs. 7-8
    return Received(index, ids, lps, lbar_recv, src, s, w)


# What each line of metrics.jsonl holds (README "Metrics"; metrics_markdown prints the table). <kind> is a
# row kind of LOSS_KINDS with the policy_loss keys (pg; HACPO's hacpo_own and hacpo_peer). "Through the
# loss" = the tokens or responses of retained rows (w > 0) with a != 0: rows with a = 0 give exactly zero
# gradient and skip the forward (their tokens stay in the loss denominator). Loss metrics are over the
# whole step: sums and counts added over micro-batches, minibatches and ranks, divided once (graft.Mean);
# a mean over nothing is left out of that step's line.
METRICS: dict[str, str] = {
    "step": "RL step, from 0.",
    "reward": "Mean reward of this side's G x n rollouts.",
    "response_len": "Mean length in tokens of this side's G x n rollouts.",
    "eos_frac": "Share of this side's G x n rollouts that ended with EOS.",
    "all_fail": "Share of the G prompts on which all n own rollouts fail.",
    "all_pass": "Share of the G prompts on which all n own rollouts pass.",
    "candidates_in": "Prompts where this side fails all n and a peer is mixed (Eq. 4, before balancing).",
    "candidates_out": "Prompts where a peer fails all n and this side is mixed.",
    "peer_reward": "Mean reward of every peer response of the step (re-verified for a stored peer).",
    "assignment": "Fingerprint of the step's whole exchange (online, --selection graft): equal on every process.",
    "selected": "Peer groups this side received (after balancing).",
    "selected/<peer>": "Groups received from one peer (three or more sides).",
    "accepted/<peer>": "Responses accepted from one peer (three or more sides).",
    "peer_responses": "Responses in the received groups.",
    "dropped_length": "Received responses longer than --max-response-tokens after retokenisation (dropped).",
    "accepted": "Received responses with w > 0 (they enter the update).",
    "rejected": "Received responses with w = 0 (s <= delta: removed).",
    "mean_s": "Mean s over every scored received response (accepted and rejected); NaN when none.",
    "mean_w": "Mean w over the accepted responses; NaN when none.",
    "capability_ratio": "HACPO: the capability ratio c of this step.",
    "grad_norm": "Gradient norm before clipping, mean over the step's optimizer steps.",
    "zero_adv_frac": "Share of the step's rows with advantage 0 (all-fail and all-pass groups).",
    "minibatches": "Minibatches (optimizer steps) of the step.",
    "peer_minibatches": "Minibatches holding a peer row.",
    "<kind>/loss": "The step's token-mean of the surrogate (Eq. 10): summed over every minibatch, over the "
                   "retained tokens of every minibatch.",
    "<kind>/clipfrac": "Clipped tokens over all tokens through the loss (verl's pg_clipfrac).",
    "<kind>/clipfrac_own": "Clipped own tokens over own tokens through the loss.",
    "<kind>/clipfrac_peer": "Clipped peer tokens over peer tokens through the loss; absent when the step has none.",
    "<kind>/approx_kl": "k3 estimate of KL(pi_old || pi_theta), mean over the tokens through the loss.",
    "<kind>/approx_kl_k1": "k1 estimate, mean of log pi_old - log pi_theta over the tokens through the loss "
                           "(verl's ppo_kl).",
    "<kind>/ratio_mean": "Mean ratio pi_theta / pi_old over the tokens through the loss.",
    "<kind>/mean_weight": "Mean w over the responses through the loss (own responses w = 1).",
    "<kind>/peer_mean_weight": "Mean w over the peer responses through the loss; absent when none.",
    "<kind>/tokens": "Tokens through the loss.",
    "<kind>/own_tokens": "Own tokens through the loss.",
    "<kind>/peer_tokens": "Peer tokens through the loss.",
    "luffy/loss": "LUFFY's peer-token term: its share of the step's token-mean.",
    "luffy/peer_prob_mean": "LUFFY: mean pi_theta over its peer tokens.",
    "luffy/peer_tokens": "LUFFY: peer tokens through its term.",
    "nll/loss": "SGT's NLL term, coefficient included: the step's token-mean over its own tokens.",
    "nll/nll": "SGT: mean negative log-likelihood per token of the rescue responses.",
    "nll/nll_tokens": "SGT: tokens of the rescue responses.",
    "time/<phase>": "Seconds of the step in sample, verify, logprob, write, wait, exchange, update; "
                    "time/step: the whole step.",
    "eval/<benchmark>": "--eval-every: pass@1 (avg@k) on one benchmark.",
    "eval/mean": "--eval-every: unweighted mean of the benchmarks' pass@1.",
}


def metric_doc(key: str) -> str | None:
    """METRICS' line for a logged key, matching <...> placeholders as one path part; None if unknown."""
    if key in METRICS:
        return METRICS[key]
    parts = key.split("/")
    for pattern, doc in METRICS.items():
        pp = pattern.split("/")
        if len(pp) == len(parts) and all(a == b or a.startswith("<") for a, b in zip(pp, parts)):
            return doc
    return None


def metrics_markdown() -> str:
    """README's metrics table, generated from METRICS."""
    escaped = {k: v.replace("|", "\\|") for k, v in METRICS.items()}  # a | inside a cell ends it
    return "| key | what it is, and what it is a mean over |\n|---|---|\n" + "".join(
        f"| `{k}` | {v} |\n" for k, v in escaped.items())


def report_values(m: dict) -> dict[str, float]:
    """The numeric, finite entries of one metrics line, for a live dashboard (step is the x axis)."""
    return {k: float(v) for k, v in m.items() if k != "step" and isinstance(v, (int, float))
            and not isinstance(v, bool) and math.isfinite(v)}


class LiveReport:
    """--report-to: each metrics line also goes to TensorBoard (<out>/tensorboard) or Weights & Biases,
    same keys, step as the x axis; rank 0 only. Both packages are optional (validate_config checks)."""

    def __init__(self, kind: str, out: Path, cfg: Config):
        self.kind = kind
        if kind == "tensorboard":
            from torch.utils.tensorboard import SummaryWriter
            self.writer = SummaryWriter(log_dir=str(out / "tensorboard"))
        else:  # wandb: WANDB_PROJECT / WANDB_MODE etc. from the environment, as wandb reads them
            import wandb
            self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "graft"), name=f"{out.name}-{cfg.name}",
                                  dir=str(out), config=dataclasses.asdict(cfg))

    def log(self, m: dict) -> None:
        values = report_values(m)
        if self.kind == "tensorboard":
            for k, v in values.items():
                self.writer.add_scalar(k, v, global_step=int(m["step"]))
            self.writer.flush()  # a killed run keeps every logged step
        else:
            self.run.log(values, step=int(m["step"]))


REPORT_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb"}


def _raise_on_signal(signum, frame):
    raise SystemExit(f"terminated by signal {signal.Signals(signum).name}")


class Trainer(RunFiles):
    """One side of GRAFT (or plain GRPO): owns the model, the optimizer and the step loop.

    What it inherits from runtime.RunFiles is file keeping, not the method: the run directory
    (refuse to overwrite, --force, writability), the stored peer log's checks, the pair's run
    identity and heartbeat, metrics trimming and atomic checkpoints."""

    live: LiveReport | None = None  # --report-to, opened by the first log()

    def __init__(self, cfg: Config):
        validate_config(cfg)
        self.cfg = cfg
        self.dist = setup_distributed(cfg)
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        torch.manual_seed(cfg.seed)
        self.out = Path(cfg.out)
        self.ckpt_dir = self.out / "checkpoints"
        self.mode = "online" if cfg.peer_exchange else "offline" if cfg.peer_log else "none"
        self.exchange = Path(cfg.peer_exchange) if cfg.peer_exchange else self.out / "exchange"
        self.peers = cfg.peer_name.split(",") if self.mode == "online" else ["log"] if self.mode == "offline" else []
        self.foreign = None  # a JSONL --peer-log: offline.ForeignLog
        self.start_step, self.best_score = 0, -1.0
        self.baseline_state: dict = {}  # what a baseline keeps across steps (HACPO's success history)
        self.heartbeat: Heartbeat | None = None
        # Everything that can fail on bad input fails here, before the first rollout: the run
        # directory, the prompts, the stored peer log, the pair's run identity, then the model.
        self.attempt, self.join_by = 0, None  # the pair's attempt (runtime.join_pair); the peers' join deadline
        if cfg.resume:
            self.check_resume_settings()  # refuses a change of what defines the run, before anything loads
        latest, state = self.resume_checkpoint() if cfg.resume else (None, None)
        if latest is not None:
            self.start_step, self.best_score = int(state["step"]), float(state["best_score"])
            self.baseline_state = state.get("baseline_state", {})
        elif cfg.resume and self.dist.main:
            print(f"--resume: no checkpoint in {self.ckpt_dir}, starting from --model")
        if self.dist.main:
            self.prepare_run_dir()
        self.data = load_prompt_file(cfg.prompts)
        self.data_by_id = {r["id"]: r for r in self.data}
        if len(self.data) < cfg.prompts_per_step:
            raise SystemExit(f"--prompts {cfg.prompts}: {len(self.data)} prompts < --prompts-per-step "
                             f"{cfg.prompts_per_step}")
        check_golds(self.data, cfg, main=self.dist.main)
        if self.mode == "offline":  # a rollout folder's run id, or a JSONL of foreign trajectories loaded once
            self.peer_log_run, self.foreign = offline.open_peer_log(cfg, self.data, self.dist,
                                                                    start_step=self.start_step)
        else:
            self.peer_log_run = None
        self.run_id = self.join_pair()
        try:
            self.model, self.tok, self.stop_ids = load_policy(str(latest or cfg.model), cfg, self.dist)
            self.eos_id = self.stop_ids[0]
            self.amp = lambda: compute_context(cfg, self.dist)
            # --fsdp: the FSDP2 root whose forward is the log-prob pass (runtime.shard_policy); None = DP
            self.policy = shard_policy(self.model, response_logprobs) if cfg.fsdp else None
            self.opt = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr, betas=(0.9, 0.999),
                                         weight_decay=cfg.weight_decay)
            if latest is not None and self.policy is not None:
                load_full_optimizer_state(self.policy, self.opt, state["optimizer"])
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
        except BaseException as e:
            self.leave_pair(e)  # the peer may already wait on us: tell it now
            raise
        if self.dist.main:
            self.print_derived()

    # -- the step, in the map's order -------------------------------------------------------------

    def step(self, step: int) -> dict:
        """One RL step: rollouts -> exchange -> selection and scoring -> rows -> peer-last update."""
        cfg = self.cfg
        t_start = time.time()
        rows = batch_indices(len(self.data), step, cfg.prompts_per_step, cfg.data_seed)  # (G,) dataset rows
        own, timings = self.rollout(step, rows)
        if self.dist.main:
            with timed(timings, "write"):
                save_rollouts(rollout_path(self.exchange, cfg.name, step), own,
                              {"model": cfg.model, "tokenizer": getattr(self.tok, "name_or_path", ""), "step": step,
                               "temperature": cfg.temperature, "name": cfg.name, "data_seed": cfg.data_seed,
                               "run_id": self.run_id})
        with timed(timings, "wait"):
            peers = self.peer_rollouts(step, own)
        with timed(timings, "exchange"):  # selection, retokenisation, compatibility scoring
            train_rows, replaced, m = self.build_rows(step, rows, own, peers)
        with timed(timings, "update"):
            m |= self.update(step, train_rows, replaced)
        m |= {"step": step, "reward": float(own.rewards.mean()),
              "response_len": sum(len(t) for t in own.tokens) / len(own.tokens),
              "eos_frac": float(own.eos.float().mean())}
        m |= {f"time/{k}": v for k, v in timings.items()}
        m["time/step"] = time.time() - t_start
        return m

    def rollout(self, step: int, rows: list[int]) -> tuple[StepRollouts, dict]:
        """Sample n responses per prompt (this rank's share), verify, score: the whole batch on every
        rank. Returns the step's rollouts (G prompts x n) and the phase timings in seconds."""
        from verify import verify_batch
        cfg, n, G = self.cfg, self.cfg.n, len(rows)
        timings: dict[str, float] = {}
        flat = [g * n + i for g in range(G) for i in range(n)]  # response r = g * n + i
        mine = shard(flat, self.dist)
        prompts = [self.prompt_ids[rows[r // n]] for r in mine]
        gen = seeded_generator(cfg.seed, step, "sample", rank=self.dist.rank, device=self.dist.device)
        with gathered(self.policy), timed(timings, "sample"), self.amp():
            # One call for the whole share: at most --gen-batch-size rows in flight, a finished row's slot
            # refilled from the queue (continuous batching), so long-tailed lengths keep the batch full.
            outs: list[Rollout] = sample(
                self.model, prompts, max_new_tokens=cfg.max_response_tokens, temperature=cfg.temperature,
                top_p=cfg.top_p, eos_token_id=self.stop_ids, pad_token_id=self.tok.pad_token_id, generator=gen,
                max_batch_size=cfg.gen_batch_size, static=cfg.static_decode, share_prefix=cfg.share_prefix,
                stop_strings=cfg.stop, tokenizer=self.tok,
                progress=self.dist.main and len(prompts) > 64 and sys.stderr.isatty())
        with timed(timings, "verify"):
            # stored text: through the first stop string; the verifier reads it cut before (departure 11)
            texts = [decode_response(o.tokens, self.tok, eos_token_ids=self.stop_ids, stop=cfg.stop)[0] for o in outs]
            rewards = verify_batch([verifier_text(t, cfg.stop) for t in texts],
                                   [self.data[rows[r // n]]["answer"] for r in mine], workers=cfg.verify_workers)
        with gathered(self.policy), timed(timings, "logprob"):
            # Behaviour log-probs recomputed by a fresh forward through the same chunked path as the loss
            # (departure 7): in bf16 the sampler's incremental KV-cache numbers differ slightly from it.
            old = self.behaviour_logprobs(prompts, [o.tokens for o in outs])
        scored = [SampledResponse(o.tokens, lp, txt, o.ended_with_eos, rw)
                  for o, lp, txt, rw in zip(outs, old, texts, rewards)]
        every = unshard(gather_lists(scored, self.dist), G * n, self.dist)  # G * n, response r = g * n + i
        rewards_t = torch.tensor([x.reward for x in every], dtype=torch.float32).view(G, n)  # (G, n)
        return StepRollouts(
            prompt_ids=[self.data[i]["id"] for i in rows], tokens=[x.tokens for x in every],
            logprobs=[x.logprobs for x in every], texts=[x.text for x in every],
            eos=torch.tensor([x.ended_with_eos for x in every]).view(G, n), rewards=rewards_t,
            advantages=group_advantages(rewards_t, std_normalize=cfg.std_normalize)), timings

    def behaviour_logprobs(self, prompts: list[list[int]], responses: list[list[int]]) -> list[torch.Tensor]:
        """Receiver log-probs (no grad) of the given responses, through the chunked path, micro-batched.
        Returns one (len(response),) float32 CPU tensor per response."""
        out = []
        was_training = self.model.training
        self.model.eval()
        with torch.no_grad(), self.amp():
            for i in range(0, len(prompts), self.cfg.micro_batch_size):
                lp, mask = self.logprobs(prompts[i: i + self.cfg.micro_batch_size],
                                         responses[i: i + self.cfg.micro_batch_size])
                out.extend(lp[j, : int(mask[j].sum())].float().cpu() for j in range(lp.shape[0]))
        self.model.train(was_training)
        return out

    def sharded_logprobs(self, prompts, responses) -> list[torch.Tensor]:
        """behaviour_logprobs with the rows split over ranks and gathered back in order."""
        with gathered(self.policy):
            mine = self.behaviour_logprobs(shard(prompts, self.dist), shard(responses, self.dist))
        return unshard(gather_lists(mine, self.dist), len(prompts), self.dist)

    def logprobs(self, prompts: list[list[int]], responses: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """The policy's per-token log-probs of the responses: (B, T) float and the (B, T) bool mask,
        through the chunked kernel; under --fsdp inside the FSDP root's forward (runtime.PolicyForward)."""
        # --fsdp with grad gathers the weights in every forward, so all ranks must make the same number of calls:
        # a shared prefix (a data-dependent second call) runs only where the weights are gathered (no grad)
        share = self.cfg.share_prefix and (self.policy is None or not torch.is_grad_enabled())
        kw = dict(pad_token_id=self.tok.pad_token_id, temperature=self.cfg.temperature or 1.0,
                  chunk_size=self.cfg.logprob_chunk, share_prefix=share)
        if self.policy is not None:
            return self.policy(prompts, responses, **kw)
        return response_logprobs(self.model, prompts, responses, **kw)

    def peer_rollouts(self, step: int, own: StepRollouts) -> dict[str, StepRollouts]:
        """The peers' rollouts of this step, by side name: each live peer's file (online), a stored
        run's file or a foreign log's groups (offline, under the name "log"), or none (GRPO)."""
        cfg = self.cfg
        if self.mode == "none":
            return {}
        if self.foreign is not None:  # matched, re-verified and given advantages once, at start
            return {"log": self.foreign.step(own.prompt_ids)}
        if self.mode == "online":
            out = {}
            for name in self.peers:
                path = rollout_path(self.exchange, name, step)
                wait_for_file(path, timeout=cfg.exchange_timeout, run_id=self.run_id, attempt=self.attempt,
                              join_by=self.join_by, me=cfg.name, dead_after=cfg.peer_dead_after)
                out[name], _ = load_rollouts(path, n=cfg.n, prompt_ids=own.prompt_ids, run_id=self.run_id)
            return out
        path = Path(cfg.peer_log) / f"step_{step:06d}.safetensors"
        peer, _ = load_rollouts(path, n=cfg.n, prompt_ids=own.prompt_ids, run_id=self.peer_log_run)
        # Stored logs are re-verified with our verifier and their advantages recomputed from that
        # (the paper's stored-trajectory variant): another run's verifier may have disagreed.
        from verify import verify_batch
        golds = [self.data_by_id[i]["answer"] for i in peer.prompt_ids for _ in range(cfg.n)]
        peer.rewards = torch.tensor(verify_batch([verifier_text(t, cfg.stop) for t in peer.texts], golds,
                                                 workers=cfg.verify_workers),
                                    dtype=torch.float32).view_as(peer.rewards)  # (G, n)
        peer.advantages = group_advantages(peer.rewards, std_normalize=cfg.std_normalize)  # (G, n)
        return {"log": peer}

    def select(self, step: int, own: StepRollouts, peers: dict[str, StepRollouts]) -> dict[str, torch.Tensor]:
        """For each peer, a (G,) bool mask of the prompts whose group this side receives from it."""
        cfg, n = self.cfg, self.cfg.n
        k_own = success_counts(own.rewards)  # (G,)
        k = {name: success_counts(p.rewards, mask=p.mask) for name, p in peers.items()}  # (G,) each
        self.assignment = None
        if self.mode == "online" and cfg.selection == "graft":
            # The whole step's assignment, every side's row, as each process computes it: its fingerprint
            # goes to the metrics, so that agreement between the processes can be checked afterwards.
            sides = sorted([cfg.name, *peers])
            src = multi_peer_sources(torch.stack([k_own if s_ == cfg.name else k[s_] for s_ in sides]), n,
                                     balance=cfg.balance)  # (S, G)
            self.assignment = assignment_digest(src, own.prompt_ids)
            me = sides.index(cfg.name)
            if len(peers) > 1:  # three or more sides: multi_peer_sources, our extension
                return {name: src[me] == sides.index(name) for name in peers}
        (name, peer), = peers.items()
        if cfg.selection == "sgt":
            return {name: rescue_candidates(k_recv=k_own, k_src=k[name])}  # ablation: SGT's rule, no balancing
        if self.mode == "offline":  # one-way transfer: nothing to balance against
            into_me = graft_candidates(k_recv=k_own, k_src=k[name], n=peer.sizes)
        else:
            into_me = received_groups(k_own=k_own, k_peer=k[name], n=n, own_is_a=cfg.name < name, balance=cfg.balance)
            if self.assignment is not None:  # the pair's rule, read through multi_peer_sources (tested equal)
                assert torch.equal(into_me, src[me] == sides.index(name)), f"step {step}: swap and assignment differ"
        if cfg.selection == "random":
            # Ablation: as many prompts as GRAFT would take, drawn among those where the peer is mixed.
            pool = torch.nonzero((k[name] >= 1) & (k[name] < peer.sizes)).squeeze(1)
            g = seeded_generator(cfg.seed, step, "select")
            pick = pool[torch.randperm(pool.numel(), generator=g)[: int(into_me.sum())]]
            into_me = torch.zeros_like(into_me)
            into_me[pick] = True
        return {name: into_me}

    def score_peer(self, step: int, peer: StepRollouts, groups: list[int], rows: list[int], *,
                   only_correct: bool = False) -> tuple[list[PeerResponse], int]:
        """Retokenise the peer's responses of the given groups and score them under the receiver.

        Returns a PeerResponse (receiver ids, receiver behaviour log-probs, w, s) for every response
        that survived the length limit, and the number dropped by it (score_received does both).
        """
        cfg, n = self.cfg, peer.n  # the stride of r = g * n + i (a foreign log's widest group)
        picked = [(g, i) for g in groups for i in range(n)
                  if peer.mask[g, i] and not (only_correct and peer.rewards[g, i] <= 0)]
        lbar_src = peer.lbar(cfg.compat_norm) if picked else None  # (G, n); a foreign log may lack it unused
        sc = score_received([peer.texts[g * n + i] for g, i in picked], [bool(peer.eos[g, i]) for g, i in picked],
                            torch.stack([lbar_src[g, i] for g, i in picked]) if picked else torch.zeros(0),
                            [self.prompt_ids[rows[g]] for g, _ in picked], tokenizer=self.tok,
                            eos_token_id=self.eos_id, logprobs=self.sharded_logprobs,
                            max_response_tokens=cfg.max_response_tokens, compat_norm=cfg.compat_norm,
                            delta=cfg.delta, compat_weight=cfg.compat_weight)
        s, w = sc.s, sc.w
        if cfg.acceptance == "random" and sc.index:
            # Ablation: keep the gate's acceptance rate but draw the accepted responses at random;
            # they keep min(s, 1) as weight, so only *which* responses pass changes.
            k = int((w > 0).sum())
            g_ = seeded_generator(cfg.seed, step, "accept")
            pick = torch.randperm(len(sc.index), generator=g_)[:k]
            w = torch.zeros_like(s)
            w[pick] = s[pick].clamp(max=1.0) if cfg.compat_weight else 1.0
        out = []
        for j, ids, lp, wi, si in zip(sc.index, sc.ids, sc.logprobs, w.tolist(), s.tolist()):
            g, i = picked[j]
            out.append(PeerResponse(g, g * n + i, ids, lp, wi, si))
        return out, len(picked) - len(sc.index)

    def build_rows(self, step: int, rows: list[int], own: StepRollouts,
                   peers: dict[str, StepRollouts]) -> tuple[list[Row], torch.Tensor, dict]:
        """The step's update rows, the (G,) bool mask of groups that came from a peer, and metrics.

        GRAFT: the receiver's own groups, except those it receives, whose rows are the peer's retained
        responses with the peer's advantages (computed on the peer's full group) and weights w.
        peers: {side name: rollouts}, empty for plain GRPO.
        """
        cfg, n, G = self.cfg, self.cfg.n, len(rows)
        k_own = success_counts(own.rewards)  # (G,)
        m = {"all_fail": float((k_own == 0).float().mean()), "all_pass": float((k_own == n).float().mean())}
        replaced = torch.zeros(G, dtype=torch.bool)  # (G,)
        own_adv = own.advantages.clone()  # (G, n)

        def own_rows(g: int) -> list[Row]:
            return [Row(g, self.prompt_ids[rows[g]], own.tokens[g * n + i], own.logprobs[g * n + i],
                        float(own_adv[g, i])) for i in range(n)]

        if not peers:  # plain GRPO
            return [r for g in range(G) for r in own_rows(g)], replaced, m
        cand_in, cand_out = torch.zeros(G, dtype=torch.bool), torch.zeros(G, dtype=torch.bool)
        for p in peers.values():
            k_p = success_counts(p.rewards, mask=p.mask)  # (G,)
            cand_in |= graft_candidates(k_recv=k_own, k_src=k_p, n=p.sizes)  # (G,) Eq. 4, this side receiving
            cand_out |= graft_candidates(k_recv=k_p, k_src=k_own, n=n) & (p.sizes > 0)  # (G,) this side giving
        m |= {"candidates_in": int(cand_in.sum()), "candidates_out": int(cand_out.sum()),
              "peer_reward": float(torch.cat([p.rewards[p.mask] for p in peers.values()]).mean())}
        if cfg.variant in BASELINE_ROWS:  # HACPO and SGT build their rows their own way (section 5)
            (peer,) = peers.values()
            out, replaced, mb = BASELINE_ROWS[cfg.variant](self, step, rows, own, peer)
            return out, replaced, m | mb

        received = self.select(step, own, peers)  # {peer: (G,) bool}
        if self.assignment is not None:
            m["assignment"] = self.assignment
        scored, kept, peer_adv = [], [], {}
        dropped_len = offered = 0
        for name, peer in peers.items():
            groups = torch.nonzero(received[name]).squeeze(1).tolist()
            got, dropped = self.score_peer(step, peer, groups, rows, only_correct=cfg.transfer == "success")
            mine = [x for x in got if x.weight > 0]  # w = 0: removed before optimisation (departure 4)
            scored += got
            kept += [(name, x) for x in mine]
            dropped_len += dropped
            offered += int(peer.sizes[groups].sum()) if groups else 0
            for g in groups:
                peer_adv[g] = peer.advantages[g]  # the peer's, held fixed
                if cfg.peer_advantages == "pooled":
                    # Ablation: merge the receiver's (all-failed) group with the peer's; advantages over both.
                    pooled = group_advantages(torch.cat([own.rewards[g], peer.rewards[g][peer.mask[g]]])[None],
                                              std_normalize=cfg.std_normalize)[0]  # (n + size,)
                    own_adv[g] = pooled[:n]
                    peer_adv[g] = torch.zeros(peer.n).masked_scatter(peer.mask[g], pooled[n:])  # (peer.n,)
            if len(peers) > 1:
                m |= {f"selected/{name}": len(groups), f"accepted/{name}": len(mine)}
        m |= {"selected": len(peer_adv), "peer_responses": offered, "dropped_length": dropped_len,
              "accepted": len(kept), "rejected": len(scored) - len(kept),
              "mean_s": float(torch.tensor([x.score for x in scored]).mean()) if scored else float("nan"),
              "mean_w": float(torch.tensor([x.weight for _, x in kept]).mean()) if kept else float("nan")}
        out = []
        for g in range(G):
            if g not in peer_adv or cfg.peer_advantages == "pooled":
                out += own_rows(g)  # a received group replaces the receiver's own (all-failed) group
        kind = "luffy" if cfg.variant == "luffy" else "pg"  # LUFFY: GRAFT's rows, its own peer-token loss
        for name, x in kept:
            adv = float(peer_adv[x.group][x.index % peers[name].n])
            out.append(Row(x.group, self.prompt_ids[rows[x.group]], x.ids, x.old_logp, adv, weight=x.weight,
                           is_peer=True, kind=kind))
            replaced[x.group] = True
        return out, replaced, m

    def update(self, step: int, rows: list[Row], replaced: torch.Tensor) -> dict:
        """Peer-last PPO updates: one optimizer step per minibatch, micro-batched, data-parallel.

        rows: the step's Rows; replaced: (G,) bool, groups that came from the peer. Returns metrics:
        the loss functions' metrics per row kind ("<kind>/<key>") over the whole step, the grad norm
        (mean over optimizer steps), zero_adv_frac, minibatches and peer_minibatches.

        A Mean's sums and counts are added over micro-batches, ranks and minibatches and divided once,
        so each mean is over exactly the tokens or responses it names (a step without peer tokens has
        no pg/clipfrac_peer); counts add up; a kind's loss is its token-mean over the whole step
        (each minibatch's loss weighted by that minibatch's denominator).
        """
        cfg = self.cfg
        gen = seeded_generator(cfg.seed, step, "minibatch")
        mbs = minibatch_order(replaced, cfg.minibatches, order=cfg.order, generator=gen)
        by_group: dict[int, list[Row]] = {}
        for r in rows:
            by_group.setdefault(r.group, []).append(r)
        step_sums: dict[str, float | Mean] = {}
        norms, peer_mb = [], []
        self.model.train()
        # The optimizer's own parameters: under FSDP, module.parameters() can be the gathered copies.
        params = [p for group in self.opt.param_groups for p in group["params"]]
        for k, mb in enumerate(mbs):
            mb_rows = [r for g in mb.tolist() for r in by_group.get(g, [])]
            peer_mb.append(any(r.is_peer for r in mb_rows))
            # One token-mean denominator per pool, over the whole minibatch (departure 3); removed
            # responses (w = 0) are not in it (Eq. 10).
            denoms: dict[str, int] = {}
            for r in mb_rows:
                if r.weight > 0:
                    pool = LOSS_KINDS[r.kind].denominator
                    denoms[pool] = denoms.get(pool, 0) + len(r.response)
            if not any(denoms.values()):
                continue
            # Rows whose loss scales with a zero advantage (all-fail and all-pass groups) give exactly
            # zero gradient, so they skip the forward; their tokens stay in the denominator above.
            # Long rows first so micro-batches pad little; this rank's strided share.
            live = [r for r in mb_rows if r.weight > 0 and (r.adv != 0 or not LOSS_KINDS[r.kind].uses_advantage)]
            mine = shard(sorted(live, key=lambda r: -len(r.response)), self.dist)
            chunks: list[list[Row] | None] = [mine[i: i + cfg.micro_batch_size]
                                              for i in range(0, len(mine), cfg.micro_batch_size)]
            if self.policy is not None and live:
                # FSDP gathers weights inside every forward and reduces gradients after every backward:
                # all ranks must make the same number of calls. A rank with a smaller share runs idle
                # turns (None): one real row whose loss is multiplied by 0.
                most = -(-len(live) // self.dist.world)  # the largest rank's share (shard is strided)
                chunks += [None] * (-(-most // cfg.micro_batch_size) - len(chunks))
            self.opt.zero_grad(set_to_none=True)
            mb_sums: dict[str, float | Mean] = {}  # this rank's sums over the minibatch's micro-batches
            for chunk in chunks:
                with self.amp():
                    loss, per_kind = self.minibatch_loss(chunk or live[:1], denoms, k)
                if chunk is None:
                    loss, per_kind = loss * 0.0, {}
                value = float(loss.detach())
                if not math.isfinite(value):
                    raise FloatingPointError(f"step {step}, minibatch {k}: the loss is {value}; stopped before "
                                             f"the optimizer step ({self.resume_hint()})")
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
                d = max(denoms.get(LOSS_KINDS[kind].denominator, 1), 1)
                mb_sums[f"{kind}/loss"] = Mean(float(mb_sums.get(f"{kind}/loss", 0.0)) * d, float(d))
            add_metrics(step_sums, mb_sums)
            for p in params:  # a step with zero gradient still decays weights and moves Adam's moments
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            if self.dist.world > 1 and self.policy is None:  # data parallel: sum the per-rank partial gradients
                for p in params:  # (the loss is a global sum; FSDP already reduce-scattered them, summed)
                    torch.distributed.all_reduce(p.grad)
            norm = float(torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip) if self.policy is None
                         else clip_sharded_grad_norm_(params, cfg.grad_clip))
            if not math.isfinite(norm):
                raise FloatingPointError(f"step {step}, minibatch {k}: the gradient norm is {norm}; stopped before "
                                         f"the optimizer step ({self.resume_hint()})")
            norms.append(norm)
            self.opt.step()
        m: dict = metric_values(step_sums, drop_empty=True)  # a mean over nothing is not logged
        m["grad_norm"] = sum(norms) / max(1, len(norms))
        zero = sum(1 for r in rows if r.adv == 0 and LOSS_KINDS[r.kind].uses_advantage)
        m["zero_adv_frac"] = zero / max(1, len(rows))
        m["minibatches"] = len(mbs)
        m["peer_minibatches"] = sum(peer_mb)
        return m

    def minibatch_loss(self, rows: list[Row], denominators: dict[str, int], mb_index: int) -> tuple[torch.Tensor, dict]:
        """Forward + loss of one micro-batch of rows; the denominators are the whole minibatch's.

        Returns the summed loss and {row kind: that kind's loss metrics, with its "loss" part}.
        """
        cfg = self.cfg
        lp, mask = self.logprobs([r.prompt for r in rows], [r.response for r in rows])  # (B, T)
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
            denom = max(denominators.get(spec.denominator, 1), 1)
            if spec.fn is None:  # Eqs. 9-10: GRPO, GRAFT and its ablations
                part, mt = policy_loss(logp=lp[sel], old_logp=old[sel], advantages=adv[sel], mask=mask[sel],
                                       weights=w[sel], eps_low=cfg.eps_low, eps_high=cfg.eps_high,
                                       dual_clip=cfg.dual_clip or None, ratio_level=cfg.ratio_level,
                                       is_peer=is_peer[sel], loss_denominator=denom)
            else:  # a baseline's surrogate (section 5)
                part, mt = spec.fn(RowBatch(lp[sel], old[sel], adv[sel], mask[sel], w[sel], is_peer[sel]), cfg=cfg,
                                   denominator=denom, minibatch=mb_index)
            loss = loss + part
            metrics[kind] = {**mt, "loss": float(part.detach())}
        return loss, metrics

    # -- bookkeeping: logs, checkpoints, the loop -------------------------------------------------

    def print_derived(self):
        cfg, G = self.cfg, self.cfg.prompts_per_step
        n_params = sum(p.numel() for p in self.model.parameters())
        print(f"[graft] side {cfg.name!r} model {cfg.model} ({n_params / 1e6:.1f}M params, "
              f"{next(self.model.parameters()).dtype}) on {self.dist.device} x{self.dist.world}")
        print(f"[graft] peer mode: {self.mode}"
              + (f" (exchange {self.exchange}, peers {', '.join(self.peers)})" if self.mode == "online" else "")
              + (f" (log {cfg.peer_log})" if self.mode == "offline" else "") + f", variant {cfg.variant}")
        print(f"[graft] {len(self.data)} prompts; per step {G} prompts x n={cfg.n} = {G * cfg.n} rollouts, "
              f"{cfg.minibatches} minibatches of ~{G // cfg.minibatches} groups; {cfg.steps} steps "
              f"= {cfg.steps * G / len(self.data):.2f} epochs; starting at step {self.start_step}")
        print(f"[graft] stop ids {self.stop_ids}; rollout files -> {self.exchange / cfg.name}; "
              f"metrics -> {self.out / 'metrics.jsonl'}")

    def log(self, m: dict):
        """One step's metrics (keys: METRICS): a line of metrics.jsonl, --report-to, a console line."""
        if not self.dist.main:
            return
        with open(self.out / "metrics.jsonl", "a") as f:
            f.write(json.dumps(m) + "\n")
        if self.cfg.report_to != "none":
            self.live = self.live or LiveReport(self.cfg.report_to, self.out, self.cfg)
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

    def fit(self):
        cfg = self.cfg
        previous = signal.getsignal(signal.SIGTERM)
        if threading.current_thread() is threading.main_thread():
            # SIGTERM (a scheduler's kill, Ctrl-C of a launcher) becomes an exception, so the FAILED
            # marker below is written; kill -9 writes nothing and is caught by the heartbeat instead.
            signal.signal(signal.SIGTERM, _raise_on_signal)
        if self.mode == "online":  # the clock starts once this side's own model has loaded
            self.join_by = time.time() + cfg.join_timeout
            if self.dist.main:
                print(f"[graft] run {self.run_id} attempt {self.attempt} in {self.exchange}: waiting up to "
                      f"--join-timeout {cfg.join_timeout:.0f}s for {', '.join(self.peers)} to join")
        try:
            for step in range(self.start_step, cfg.steps):
                if self.heartbeat is not None:
                    self.heartbeat.step = step
                    if self.heartbeat.left_behind():
                        raise SystemExit(f"side {cfg.name!r} was relaunched (a newer process took part in a later "
                                         f"attempt of run {self.run_id}); this process stops")
                m = self.step(step)
                if cfg.eval_every and (step + 1) % cfg.eval_every == 0:
                    m.update(self.validate(step + 1))
                self.log(m)
                if (step + 1) % cfg.save_every == 0 or step + 1 == cfg.steps:
                    self.save_checkpoint(step + 1)
        except BaseException as e:
            self.leave_pair(e)  # tell a waiting peer at once instead of letting it time out
            raise
        finally:
            if threading.current_thread() is threading.main_thread():
                signal.signal(signal.SIGTERM, previous)
        if self.heartbeat is not None:
            self.heartbeat.stop("finished")

    def validate(self, step: int) -> dict:
        cfg = self.cfg
        with gathered(self.policy):
            res = evaluate_benchmarks(self.model, self.tok, self.stop_ids, cfg, self.dist, progress=False)
        score = res["mean"]
        if self.dist.main:
            print(f"[eval] step {step}: " + ", ".join(f"{k} {v['pass@1']:.3f}" for k, v in res["benchmarks"].items())
                  + f" | mean {score:.4f} (best {max(score, self.best_score):.4f})")
        if score > self.best_score:
            self.best_score = score
            self.save_checkpoint(step, dest=self.ckpt_dir / "best")
        return {f"eval/{k}": v["pass@1"] for k, v in res["benchmarks"].items()} | {"eval/mean": score}

class RowBatch(NamedTuple):
    """One row kind's slice of a micro-batch, as the baselines' loss functions take it."""

    logp: torch.Tensor  # (B, T) current-policy log-probs, with grad
    old_logp: torch.Tensor  # (B, T) behaviour log-probs
    advantages: torch.Tensor  # (B,)
    mask: torch.Tensor  # (B, T) bool, response tokens
    weights: torch.Tensor  # (B,)
    is_peer: torch.Tensor  # (B,) bool


# ------------------------------------------------------------------------------------------------
# 5. Baselines (README "Baselines and ablations"), apart from GRAFT's path: their losses, their row
#    builders (BASELINE_ROWS, called by Trainer.build_rows) and their row kinds (LOSS_KINDS)
#
# Choices the cited papers leave open are ours:
#  * HACPO (arXiv 2603.02604): every prompt pools both models' n rollouts (no failure gating). The
#    capability ratio c = (peer success rate) / (own success rate), each a mean over the last 5 steps,
#    clamped to [0.1, 10] (10 when the own rate is 0). Baseline = capability-weighted pooled mean
#    (sum r_own + c sum r_peer) / (n + c n); scale = unbiased std of the 2n pooled rewards. Own rows:
#    sequence-level ratio exp(mean_t log rho_t), clip [1 - 3e-4, 1 + 4e-4]. Peer rows (retokenised):
#    cross-tokenizer sequence ratio exp(mean log pi_theta^recv(o^recv) - lbar_src(o^src)), lower clip
#    bound 0.8 + 0.025 k in minibatch k (capped at 0.999), upper bound 1 + eps_high, loss weight c,
#    peer loss coefficient 1.0; one shared token-mean denominator.
#  * SGT (arXiv 2605.07244): plain GRPO rows, plus, for every prompt where the receiver fails all n
#    and the peer succeeds at least once (all-pass peers included), one correct peer response drawn
#    uniformly (seeded per step), retokenised, with loss 0.1 x its token-mean NLL; the NLL term has its
#    own token-mean denominator. Both directions, no weighting, no balancing.
#  * LUFFY-style: GRAFT's selection and weights; peer tokens use -w f(pi) a with f(pi) = pi / (pi + 0.1),
#    behaviour probability 1, no clip, in the same token-mean as the own tokens.
# The ablations of GRAFT itself (random selection/acceptance, pooled advantages, success-only, SGT's
# selection rule, orders, no balancing, no weight, sequence ratio) are flags on GRAFT's own path.
# ------------------------------------------------------------------------------------------------


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

    r_own: (G, n) own rewards; r_peer: (G, m) the peer's rewards on the same prompts.
    capability_ratio c = peer success rate / own success rate (rolling, clamped by the caller).
    The baseline is the capability-weighted mean of the pooled group, (sum r_own + c sum r_peer) /
    (n + c m), and the scale is the unbiased std of the pooled 2n rewards. Returns (adv_own (G, n),
    adv_peer (G, m)); groups whose pooled rewards are constant get 0.
    """
    n, m = r_own.shape[1], r_peer.shape[1]
    r_own, r_peer = r_own.float(), r_peer.float()
    base = ((r_own.sum(1, keepdim=True) + capability_ratio * r_peer.sum(1, keepdim=True))
            / (n + capability_ratio * m))  # (G, 1)
    pooled = torch.cat([r_own, r_peer], dim=1)  # (G, n + m)
    std = pooled.std(dim=1, keepdim=True)  # (G, 1)
    constant = (pooled == pooled[:, :1]).all(dim=1, keepdim=True)  # (G, 1)
    adv = torch.where(constant, torch.zeros_like(pooled), (pooled - base) / (std + eps))  # (G, n + m)
    return adv[:, :n], adv[:, n:]


def sgt_rows(tr: Trainer, step: int, rows: list[int], own: StepRollouts,
             peer: StepRollouts) -> tuple[list[Row], torch.Tensor, dict]:
    """SGT: plain GRPO rows plus, on each rescue prompt (receiver 0/n, peer >= 1), one correct peer
    response drawn uniformly, trained with an NLL term (no weighting, no balancing)."""
    cfg, n, G = tr.cfg, tr.cfg.n, len(rows)
    out = [Row(g, tr.prompt_ids[rows[g]], own.tokens[g * n + i], own.logprobs[g * n + i], float(own.advantages[g, i]))
           for g in range(G) for i in range(n)]
    rescue = rescue_candidates(k_recv=success_counts(own.rewards), k_src=success_counts(peer.rewards, mask=peer.mask))
    rescue = torch.nonzero(rescue).squeeze(1).tolist()
    gen = seeded_generator(cfg.seed, step, "sgt")
    picked = 0
    for g in rescue:
        correct = torch.nonzero(peer.rewards[g] > 0).squeeze(1)
        i = int(correct[torch.randint(correct.numel(), (1,), generator=gen)])
        ids = retokenize(peer.texts[g * peer.n + i], bool(peer.eos[g, i]), tr.tok,
                         max_response_tokens=cfg.max_response_tokens, eos_token_id=tr.eos_id)
        if ids:
            out.append(Row(g, tr.prompt_ids[rows[g]], ids, torch.zeros(len(ids)), 0.0, is_peer=True, kind="nll"))
            picked += 1
    return out, torch.zeros(G, dtype=torch.bool), {"selected": len(rescue), "accepted": picked}


def hacpo_rows(tr: Trainer, step: int, rows: list[int], own: StepRollouts,
               peer: StepRollouts) -> tuple[list[Row], torch.Tensor, dict]:
    """HACPO: every prompt pools both models' rollouts (no failure gating); capability-weighted
    baseline, pooled std; own rows with a tight sequence-level clip, peer rows with the
    cross-tokenizer sequence ratio and the capability coefficient (see hacpo_advantages)."""
    cfg, n, G = tr.cfg, tr.cfg.n, len(rows)
    history = tr.baseline_state.setdefault("hacpo_history", [])  # (own, peer) success rate per step
    history.append((float(own.rewards.mean()), float(peer.rewards.mean())))
    recent = history[-5:]  # rolling success rates, window 5 steps
    own_rate = sum(h[0] for h in recent) / len(recent)
    peer_rate = sum(h[1] for h in recent) / len(recent)
    c = min(10.0, max(0.1, peer_rate / own_rate)) if own_rate > 0 else 10.0
    adv_own, adv_peer = hacpo_advantages(r_own=own.rewards, r_peer=peer.rewards, capability_ratio=c)  # (G, n), (G, n)
    out = [Row(g, tr.prompt_ids[rows[g]], own.tokens[g * n + i], own.logprobs[g * n + i], float(adv_own[g, i]),
               kind="hacpo_own") for g in range(G) for i in range(n)]
    scored, dropped_len = tr.score_peer(step, peer, list(range(G)), rows)
    lbar_src = peer.lbar(cfg.compat_norm).view(-1)  # (G * n,)
    for p in scored:
        # The peer's "old" log-prob per token is its own per-token mean: the sequence ratio is then
        # exp(mean log pi_theta^recv(o^recv) - lbar_src(o^src)), the cross-tokenizer ratio.
        old = torch.full((len(p.ids),), float(lbar_src[p.index]))  # (T,)
        out.append(Row(p.group, tr.prompt_ids[rows[p.group]], p.ids, old,
                       float(adv_peer[p.group, p.index % n]), weight=c, is_peer=True, kind="hacpo_peer"))
    m = {"selected": G, "accepted": len(scored), "dropped_length": dropped_len, "capability_ratio": c}
    return out, torch.zeros(G, dtype=torch.bool), m


def _luffy(b: RowBatch, *, cfg: Config, denominator: int, minibatch: int):
    return luffy_peer_loss(b.logp, b.advantages, b.mask, gamma=cfg.luffy_gamma, weights=b.weights,
                           loss_denominator=denominator)


def _hacpo_own(b: RowBatch, *, cfg: Config, denominator: int, minibatch: int):
    return policy_loss(logp=b.logp, old_logp=b.old_logp, advantages=b.advantages, mask=b.mask, eps_low=3e-4,
                       eps_high=4e-4, ratio_level="sequence", loss_denominator=denominator)


def _hacpo_peer(b: RowBatch, *, cfg: Config, denominator: int, minibatch: int):
    low = min(0.8 + 0.025 * minibatch, 0.999)  # the lower bound tightens towards 1 minibatch by minibatch
    return policy_loss(logp=b.logp, old_logp=b.old_logp, advantages=b.advantages, mask=b.mask, weights=b.weights,
                       eps_low=1 - low, eps_high=cfg.eps_high, ratio_level="sequence", is_peer=b.is_peer,
                       loss_denominator=denominator)


def _sgt_nll(b: RowBatch, *, cfg: Config, denominator: int, minibatch: int):
    return nll_loss(b.logp, b.mask, coef=cfg.sgt_coef, loss_denominator=denominator)


BASELINE_ROWS: dict[str, Callable] = {"hacpo": hacpo_rows, "sgt": sgt_rows}
LOSS_KINDS.update({
    "luffy": LossKind(fn=_luffy),
    "hacpo_own": LossKind(fn=_hacpo_own),
    "hacpo_peer": LossKind(fn=_hacpo_peer),
    "nll": LossKind(fn=_sgt_nll, denominator="nll", uses_advantage=False),  # SGT's NLL: its own token-mean
})


# ------------------------------------------------------------------------------------------------
# 6. Evaluation: avg@k = pass@1 with the training prompt and verifier (paper: T = 0.6, top-p 0.95, k = 8)
# ------------------------------------------------------------------------------------------------

BENCHMARKS = {"math500": "math500.jsonl", "aime2024": "aime2024.jsonl", "aime2025": "aime2025.jsonl",
              "amc23": "amc23.jsonl", "minerva": "minerva.jsonl"}


def benchmark_files(spec: str, data_dir: str) -> dict[str, Path]:
    """--benchmarks: 'all', a comma list of names, or paths to prompt JSONL files -> {name: path}."""
    names = list(BENCHMARKS) if spec == "all" else [s.strip() for s in spec.split(",") if s.strip()]
    out = {}
    for name in names:
        path = Path(data_dir) / BENCHMARKS[name] if name in BENCHMARKS else Path(name)
        if not path.is_file():
            hint = "python data/prepare.py writes it" if name in BENCHMARKS else f"known names: {', '.join(BENCHMARKS)}"
            raise SystemExit(f"--benchmarks: {path} not found ({hint})")
        out[name if name in BENCHMARKS else path.stem] = path
    return out


def evaluate(model, tokenizer, stop_ids, problems: list[dict], cfg: Config, dist_info: DistInfo, *,
             progress: bool = True, desc: str = "eval", rel_tol: float | None = None) -> list[dict]:
    """Sample cfg.eval_samples responses per problem and verify them; rows split over ranks.

    rel_tol: the verifier's numeric tolerance for decimals (None = its MATH default; Minerva's
    three-significant-figure golds need verify.MINERVA_REL_TOL).
    Returns one dict per problem, in order: id, answer, correct (list of 0/1), and the responses
    when cfg.save_responses.
    """
    from verify import verify_batch
    k = cfg.eval_samples
    jobs = [(p, j) for p in range(len(problems)) for j in range(k)]
    mine = shard(jobs, dist_info)
    prompts = [encode_prompt(problems[p]["problem"], tokenizer, template=cfg.prompt_template, chat=cfg.chat_template)
               for p, _ in mine]
    gen = seeded_generator(cfg.seed, 0, "eval", rank=dist_info.rank, device=dist_info.device)
    max_new = cfg.eval_max_tokens or cfg.max_response_tokens
    was_training = model.training
    if progress and dist_info.main:
        print(f"[eval] {desc}: {len(problems)} problems x {k} samples", file=sys.stderr, flush=True)
    outs = sample(model, prompts, max_new_tokens=max_new, temperature=cfg.eval_temperature, top_p=cfg.eval_top_p,
                  eos_token_id=stop_ids, pad_token_id=tokenizer.pad_token_id, generator=gen,
                  max_batch_size=cfg.gen_batch_size, static=cfg.static_decode, stop_strings=cfg.stop,
                  tokenizer=tokenizer, progress=progress and dist_info.main)
    texts = [verifier_text(decode_response(o.tokens, tokenizer, eos_token_ids=stop_ids, stop=cfg.stop)[0], cfg.stop)
             for o in outs]  # what the verifier reads: cut before a stop string (departure 11)
    model.train(was_training)
    tol = {} if rel_tol is None else {"rel_tol": rel_tol}
    scores = verify_batch(texts, [problems[p]["answer"] for p, _ in mine], workers=cfg.verify_workers, **tol)
    results = unshard(gather_lists(list(zip(scores, texts)), dist_info), len(jobs), dist_info)
    out = []
    for p, prob in enumerate(problems):
        chunk = results[p * k: (p + 1) * k]
        row = {"id": prob["id"], "answer": prob["answer"], "correct": [float(s) for s, _ in chunk]}
        if cfg.save_responses:
            row["responses"] = [t for _, t in chunk]
        out.append(row)
    return out


def summarize(per_problem: list[dict]) -> dict:
    """pass@1 = mean correctness over all samples (avg@k); pass@k = a problem solved by any sample."""
    if not per_problem:
        return {"pass@1": 0.0, "pass@k": 0.0, "problems": 0}
    p1 = sum(sum(r["correct"]) / len(r["correct"]) for r in per_problem) / len(per_problem)
    pk = sum(1.0 for r in per_problem if max(r["correct"]) > 0) / len(per_problem)
    return {"pass@1": p1, "pass@k": pk, "problems": len(per_problem)}


def evaluate_benchmarks(model, tokenizer, stop_ids, cfg: Config, dist_info: DistInfo, *, progress: bool = True) -> dict:
    """Every benchmark of --benchmarks; 'mean' is the unweighted mean of their pass@1 (the paper's score)."""
    files = benchmark_files(cfg.benchmarks, cfg.data_dir)
    res, per = {}, {}
    for name, path in files.items():
        problems = load_prompt_file(str(path))
        if cfg.eval_max_problems:
            problems = problems[: cfg.eval_max_problems]
        tol = None
        if name == "minerva":
            from verify import MINERVA_REL_TOL as tol  # Minerva golds carry ~3 significant figures
        per[name] = evaluate(model, tokenizer, stop_ids, problems, cfg, dist_info, progress=progress, desc=name,
                             rel_tol=tol)
        res[name] = summarize(per[name])
    mean = sum(r["pass@1"] for r in res.values()) / max(1, len(res))
    return {"benchmarks": res, "mean": mean, "problems": per}


def print_eval_table(res: dict, k: int) -> None:
    print(f"{'benchmark':<12} {'problems':>8} {'pass@1':>8} {f'pass@{k}':>8}")
    for name, r in res["benchmarks"].items():
        print(f"{name:<12} {r['problems']:>8} {100 * r['pass@1']:>8.2f} {100 * r['pass@k']:>8.2f}")
    print(f"{'mean':<12} {'':>8} {100 * res['mean']:>8.2f}")


def run_eval(cfg: Config) -> dict:
    dist_info = setup_distributed(cfg)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    if not cfg.model:
        raise SystemExit("--model is required")
    model, tok, stop = load_policy(cfg.model, cfg, dist_info, for_training=False)
    t0 = time.time()
    res = evaluate_benchmarks(model, tok, stop, cfg, dist_info)
    if dist_info.main:
        print_eval_table(res, cfg.eval_samples)
        print(f"[eval] {time.time() - t0:.0f}s; settings: {cfg.eval_samples} samples, T={cfg.eval_temperature}, "
              f"top-p={cfg.eval_top_p}")
        default = Path(cfg.model) if Path(cfg.model).is_dir() else Path(cfg.out)
        path = Path(cfg.eval_out) if cfg.eval_out else default / "eval_results.json"
        settings = {"samples": cfg.eval_samples, "temperature": cfg.eval_temperature, "top_p": cfg.eval_top_p,
                    "max_tokens": cfg.eval_max_tokens or cfg.max_response_tokens}
        payload = {"model": cfg.model, "settings": settings, **res}
        atomic_write(path, lambda tmp: Path(tmp).write_text(json.dumps(payload, indent=1)))
        print(f"[eval] per-problem results -> {path}")
    return res



# ------------------------------------------------------------------------------------------------
# 7. CLI: built from the Config dataclass (flags = field names with dashes, help = field docstrings)
# ------------------------------------------------------------------------------------------------

VARIANTS = ("graft", "hacpo", "sgt", "luffy")
CHOICES = {
    "variant": VARIANTS,
    "order": ("peer_last", "peer_first", "uniform"),
    "ratio_level": ("token", "sequence"),
    "compat_norm": ("token", "byte"),
    "selection": ("graft", "random", "sgt"),
    "acceptance": ("gate", "random"),
    "peer_advantages": ("source", "pooled"),
    "transfer": ("all", "success"),
    "device": ("auto", "cpu", "cuda"),
    "dtype": ("auto", "float32", "bfloat16"),
    "report_to": ("none", "tensorboard", "wandb"),
}


def validate_config(cfg: Config) -> None:
    """Raise ValueError naming the flag for any bad value (bad user input fails early)."""
    def bad(flag, msg):
        raise ValueError(f"--{flag.replace('_', '-')}: {msg}")
    for f, allowed in CHOICES.items():
        if getattr(cfg, f) not in allowed:
            bad(f, f"{getattr(cfg, f)!r} is not one of {', '.join(allowed)}")
    if not cfg.model:
        bad("model", "is required (a hub id or a local folder)")
    if cfg.n < 2:
        bad("n", f"GRPO needs at least 2 rollouts per prompt (got {cfg.n}: every advantage would be 0)")
    positive_ints = ("steps", "prompts_per_step", "max_prompt_tokens", "max_response_tokens", "gen_batch_size",
                     "micro_batch_size", "logprob_chunk", "save_every", "keep_checkpoints", "eval_samples")
    for f in positive_ints:
        if getattr(cfg, f) < 1:
            bad(f, f"must be >= 1, got {getattr(cfg, f)}")
    for f in ("threads", "verify_workers", "eval_every", "eval_max_problems", "eval_max_tokens", "sgt_coef"):
        if getattr(cfg, f) < 0:
            bad(f, f"must be >= 0, got {getattr(cfg, f)}")
    for f in ("lr", "grad_clip", "exchange_timeout", "peer_dead_after", "heartbeat_interval", "join_timeout",
              "luffy_gamma"):
        if not getattr(cfg, f) > 0:
            bad(f, f"must be > 0, got {getattr(cfg, f)}")
    if not 0 <= cfg.delta <= 1:
        bad("delta", f"must be in [0, 1] (w = min(s, 1), so a floor above 1 rejects every peer response), "
                     f"got {cfg.delta}")
    if cfg.weight_decay < 0:
        bad("weight_decay", f"must be >= 0, got {cfg.weight_decay}")
    if "" in cfg.stop:
        bad("stop", "an empty stop string would end every response at its first token")
    if cfg.heartbeat_interval * 3 > cfg.peer_dead_after:
        bad("heartbeat_interval", f"must be at most a third of --peer-dead-after ({cfg.peer_dead_after}), "
                                  f"or a slow disk makes a live peer look dead")
    if cfg.resume and cfg.force:
        bad("force", "--force starts over and --resume continues: choose one")
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
    peers = cfg.peer_name.split(",")
    if cfg.peer_exchange and cfg.name in peers:
        bad("peer_name", f"the peers' names must differ from --name ({cfg.name!r})")
    if len(set(peers)) != len(peers):
        bad("peer_name", f"{cfg.peer_name!r} names a peer twice")
    for flag, v in [("name", cfg.name)] + [("peer_name", p) for p in peers]:
        if not v or "/" in v or v.startswith(".") or v == "RUN":
            bad(flag, f"{v!r} must be a plain folder name (not RUN, which the exchange dir uses)")
    if len(peers) > 1:
        if not cfg.peer_exchange:
            bad("peer_name", "several peers need an online exchange (--peer-exchange)")
        if cfg.variant in ("hacpo", "sgt") or cfg.selection != "graft":
            bad("peer_name", "with several peers only GRAFT's own selection runs (variant graft or luffy, "
                             "--selection graft)")
    if cfg.peer_model and not Path(cfg.peer_log).is_file():
        bad("peer_model", "scores a JSONL --peer-log of foreign trajectories; give that file as --peer-log")
    if cfg.variant == "hacpo" and Path(cfg.peer_log).is_file():
        bad("variant", "hacpo pools n own with n peer rollouts per prompt; a JSONL --peer-log has groups of any size")
    if "{problem}" not in cfg.prompt_template:
        bad("prompt_template", "must contain '{problem}'")
    if cfg.report_to != "none":
        import importlib.util
        package = REPORT_PACKAGES[cfg.report_to]
        if importlib.util.find_spec(package) is None:
            bad("report_to", f"{cfg.report_to} needs the optional package {package!r}: pip install {package}")


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



EVAL_ALIASES = {"samples": "eval_samples", "temperature": "eval_temperature", "top_p": "eval_top_p"}
# torchrun's own parser reads "--n" as an ambiguous abbreviation of its flags (Python argparse
# classifies every "--x" before the script's arguments), so --n has a long spelling too.
FLAG_ALIASES = {"n": "--rollouts"}


def build_parser():
    import argparse
    docs = field_docs(Config)
    parser = argparse.ArgumentParser(prog="graft.py", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("complement", add_help=False,
                   help="how complementary candidate models are, before a pair run (graft.py complement -h)")
    sub.add_parser("preflight", add_help=False,
                   help="sample two models and report what a pair of them would exchange (graft.py preflight -h)")
    sub.add_parser("panel", add_help=False,
                   help="the mechanism panel: GRPO vs GRAFT on the prompts each model fails (graft.py panel -h)")
    sub.add_parser("plot", add_help=False, help="PNG curves from runs' metrics.jsonl (graft.py plot -h; matplotlib)")
    for command in ("train", "eval"):
        help_cmd = "train one side (GRPO / GRAFT)" if command == "train" else "evaluate a model on the benchmarks"
        p = sub.add_parser(command, help=help_cmd, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
        aliases = {v: k for k, v in EVAL_ALIASES.items()} if command == "eval" else {}
        for f in dataclasses.fields(Config):
            if command == "eval" and f.name in EVAL_ALIASES:
                continue  # in eval, --temperature etc. mean the evaluation settings
            flags = [f"--{f.name.replace('_', '-')}"]
            flags += [f"--{aliases[f.name].replace('_', '-')}"] if f.name in aliases else []
            flags += [FLAG_ALIASES[f.name]] if f.name in FLAG_ALIASES else []
            help_ = docs.get(f.name, "").replace("%", "%%")
            help_ += f" choices: {', '.join(CHOICES[f.name])}" if f.name in CHOICES else ""
            if isinstance(f.default, bool):
                p.add_argument(*flags, dest=f.name, action=argparse.BooleanOptionalAction, default=f.default,
                               help=help_)
            elif f.default is dataclasses.MISSING:  # a list field (--stop): repeat the flag for each item
                p.add_argument(*flags, dest=f.name, action="append", default=f.default_factory(), metavar="STR",
                               help=help_)
            else:
                p.add_argument(*flags, dest=f.name, type=type(f.default), default=f.default, help=help_)
    return parser


def flags_markdown() -> str:
    """The flag table of FLAGS.md, generated from Config."""
    docs = field_docs(Config)
    lines = ["| flag | default | meaning |", "|---|---|---|"]
    for f in dataclasses.fields(Config):
        default = repr(f.default_factory() if f.default is dataclasses.MISSING else f.default)
        default = default if len(default) <= 30 else default[:27] + "..."
        text = docs.get(f.name, "") + (f" Choices: {', '.join(CHOICES[f.name])}." if f.name in CHOICES else "")
        lines.append(f"| `--{f.name.replace('_', '-')}` | `{default}` | {text.replace('|', '/')} |")
    return "\n".join(lines) + "\n"


def flags_document() -> str:
    """FLAGS.md, whole (a test keeps the file equal to it):
    python -c "import graft; print(graft.flags_document(), end='')" > FLAGS.md"""
    return ("# Flags of `python graft.py train`\n\n"
            "Generated from `graft.Config`, the one config dataclass, whose field docstrings are the help lines\n"
            "(`python graft.py train --help` prints the same). Regenerate after changing a field:\n"
            "`python -c \"import graft; print(graft.flags_document(), end='')\" > FLAGS.md`.\n\n" + flags_markdown())


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["complement"]:  # its own flags (offline.py): sources, --n, --batch-size
        return offline.main_complement(argv[1:])
    if argv[:1] == ["preflight"]:  # its own flags (preflight.py): two models, prompts, the training settings
        import preflight  # it never imports graft.py: it is handed this module, the trainer's functions
        return preflight.main(argv[1:], core=sys.modules[__name__])
    if argv[:1] == ["panel"]:  # its own flags (panel.py: two models, a pool, --half, --steps) + the training flags
        import panel  # like preflight, it is handed this module and never imports graft.py
        return panel.main(argv[1:], core=sys.modules[__name__])
    if argv[:1] == ["plot"]:  # its own flags: run folders, --out, --smooth
        import plot  # matplotlib only there
        return plot.main(argv[1:])
    args = build_parser().parse_args(argv)
    cfg = Config(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Config) if hasattr(args, f.name)})
    try:
        validate_config(cfg)
    except ValueError as e:
        raise SystemExit(f"graft.py {args.command}: {e}")
    if args.command == "train":
        Trainer(cfg).fit()
    else:
        run_eval(cfg)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    if cfg.fsdp:
        # Every file is written and flushed. FSDP2 over gloo (CPU) can abort in a C++ destructor at
        # interpreter exit in this torch version ("terminate called without an active exception"),
        # turning a finished run into a failed one; ending the process here skips those destructors.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
