"""What each line of a run's metrics.jsonl holds, and where it also goes live.

METRICS documents every key the trainer logs (README "Metrics" is metrics_markdown's table; test_metrics.py
checks that every key of a real step has its line); LiveReport sends each line to TensorBoard or Weights &
Biases (--report-to), report_values picking its numbers; read_metrics reads the file back (the one reader). It
imports nothing of ours but config.py (a type), so that graft.py, plot.py and the tests read the table from one
place.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path

from config import Config


# What each line of metrics.jsonl holds (README "Metrics"; metrics_markdown prints the table). <kind> is a
# row kind of LOSS_KINDS with the policy_loss keys (pg; HACPO's hacpo_own and hacpo_peer). "Through the
# loss" = the tokens or responses of retained rows (w > 0) with a != 0: rows with a = 0 give exactly zero
# gradient and skip the forward (their tokens stay in the loss denominator). Loss metrics are over the
# whole step: sums and counts added over micro-batches, minibatches and ranks, divided once (core.Mean);
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
    "reward_timeouts": "Responses whose reward call ran past --reward-timeout (worker killed): scored 0.",
    "reward_crashes": "Responses whose reward worker process died (a crash in the reward): scored 0.",
    "reward/box_refused": "Share of this side's G x n rollouts holding a \\boxed / \\fbox that verify.py's reader "
                          "refused by a reading rule (a value continued after it, a second final answer that "
                          "differs, an operand, an unclosed box), not by its value (verify.box_refused); logged only "
                          "with the default --reward verify:verify_batch.",
    "noncanonical": "Own responses whose sampled ids are not the tokenizer's encoding of their text, encoded alone.",
    "noncanonical_in_prompt": "Own responses whose sampled ids are not the tokenizer's encoding of their text "
                              "encoded after the prompt (a token across the prompt's end counts).",
    "assignment": "Fingerprint of the step's whole exchange (online, --selection graft): equal on every process.",
    "selected": "Peer groups this side received (after balancing).",
    "selected/<peer>": "Groups received from one peer (three or more sides).",
    "accepted/<peer>": "Responses accepted from one peer (three or more sides).",
    "peer_responses": "Responses in the received groups.",
    "dropped_length": "Received responses longer than --max-response-tokens after retokenisation (dropped).",
    "dropped_roundtrip": "Received responses whose receiver ids do not decode back to their text (dropped).",
    "accepted": "Received responses with w > 0 (they enter the update).",
    "rejected": "Received responses with w = 0 (s <= delta: removed).",
    "mean_s": "Mean s over every scored received response (accepted and rejected); NaN when none.",
    "s_each": "Every scored received response's s, peer by peer and group by group; [] when none.",
    "s_index": "Each s_each response's index r = g * n + i in its peer's rollout file.",
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
    same keys, step as the x axis; rank 0 only. Both packages are optional (config.validate_config checks)."""

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


# ------------------------------------------------------------------------------------------------
# Reading a run's metrics.jsonl (the one reader: plot, the panel, the tiny preset, --resume)
# ------------------------------------------------------------------------------------------------


def read_metrics(path: str | os.PathLike) -> list[dict]:
    """The lines of a metrics.jsonl, one dict per step, in file order. A half-written last line (a kill during
    the write) is skipped; any other line that is not a JSON object raises ValueError naming file and line."""
    lines = Path(path).read_text(encoding="utf-8", errors="replace").splitlines()
    out = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        if not isinstance(record, dict):
            if i == len(lines):
                continue
            raise ValueError(f"{path}:{i}: not a JSON line")
        out.append(record)
    return out
