"""GRAFT inside TRL: a GRPOTrainer that grafts a stored peer's groups into every generation batch.

The stored-trajectory variant of GRAFT (README "Porting to verl or TRL") for users of TRL's GRPOTrainer
(tested with TRL 1.16; TRL is optional, like W&B: `pip install trl==1.16.0`). Per generation batch, after
TRL sampled and scored the receiver's own groups: for each prompt whose n own rollouts all fail and whose
logged peer group is mixed (Eq. 4, one way: nothing to balance), the group's rows become the peer's
responses, retokenised, scored by the same reward functions, with the peer's group advantages; one
no-grad forward gives the receiver's log-probs of them (lbar_recv, Eq. 6, and their old log-probs),
w = 1[s > delta] min(s, 1) (Eqs. 7-8) is folded into the advantage with the w = 0 rows masked out, the
replaced groups go last (peer-last), and each optimizer step's loss is divided by that step's retained
tokens, so TRL's own loss is Eq. 10 exactly (test_trl.py: value and gradient, in every layout below).

Layouts (S = steps_per_generation, A = gradient_accumulation_steps; S / A optimizer steps per batch):
loss_type="dapo" (TRL's default) is exact in every one, through num_items_in_batch set per optimizer
step; "bnpo" only with A = 1. The rest is refused at construction (Refusal, a ValueError) naming the setting.
Where this departs from stock TRL:
  1. Minibatches are not shuffled: own groups first, replaced groups last (core.peer_last_rows).
  2. Own advantages are recomputed with core.group_advantages (std + 1e-6, exactly 0 on equal rewards)
     so that own and peer groups share one formula; TRL adds 1e-4 to the std.
  3. The peer log is read and checked once at start, through the project's one peer-log parser
     (core.parse_peer_records; a folder of rollout files: a prompt met at several steps gives its latest group):
     ids matched to the dataset's id_column (none matching: refused, with the counts), lbar a mean per token
     (below -20, or growing with the response's length: refused as a likely sum, lbar_length_slope), a missing
     lbar computed by --peer_model (foreign.fill_lbar, cached).
     The peer's texts are scored once at start by this trainer's reward functions, through TRL's own
     _calculate_rewards, in the form TRL gives completions for the dataset (a string, or an assistant message
     for a conversational prompt); a reward function reading trainer_state sees the state at start.
  4. A logged group of m < n responses fills m of its prompt's n rows; the other n - m rows are empty
     (masked, w = 0), so TRL's batch keeps its shape.
  5. Success (Eq. 4) is the user's: the weighted sum of the success_reward functions (all by default, as TRL
     sums its reward) >= success_threshold (0.5); a rule under which no logged group is mixed warns at start.
     Advantages are TRL's summed reward's, for own and peer groups alike.
  6. mask_truncated_completions=True masks a peer row that did not end with EOS (w = 0), as TRL masks its own.
  7. Several processes (torchrun, accelerate launch): TRL's sampler puts n copies of a prompt in a row and each
     process takes per_device_train_batch_size x S consecutive rows, so a group may span processes (per-device
     batch 2 with 4 generations). Every process gathers the whole generation batch (TRL gathers the rewards
     already), then computes the same selection, the same receiver forward over every received response (W
     times the work of one process; a received group is a few rows of the batch) and the same rows; it orders
     them peer-last with the same generator and takes its W-th of each micro-batch: the optimizer steps hold the
     rows one process would, and num_items_in_batch counts an optimizer step's retained tokens over all
     processes (tests/test_trl.py: two CPU processes over gloo equal one process and a hand Eq. 10 per optimizer
     step, in loss, gradient and update, over two generation batches and prompts of different lengths).
  8. vLLM generation with TRL's importance-sampling correction: own rows keep the ratio TRL computes; peer rows
     get 1 (their old log-probs are the receiver's own forward, no sampler to correct for).
  9. Precision: lbar_recv and the peer rows' old log-probs come from TRL's own log-prob forward, at the
     precision of TRL's own old log-probs (bf16 by TRL's default on a GPU); with bf16 on, a warning (once)
     names the responses whose s sits within bf16's rounding of graft_delta. Nothing is recomputed in float32.

Refused at construction, naming the setting: delta (TRL's cap on the ratio; GRAFT's floor is graft_delta), beta
> 0, num_iterations > 1 (own minibatches replayed after peer ones), S not a multiple of A, a group straddling
optimizer steps (per_device_train_batch_size x A x processes not a multiple of n), bnpo over several processes,
sequence-level ratios, entropy masks and bonuses, scale_rewards="batch", a logged group larger than num_generations.
Traps handled: stock TRL shuffles the batch before cutting minibatches (peer rows land in both); its old log-probs
exist only when S > A, and only of its own samples; epsilon_high defaults to epsilon (here 0.28); its advantages
add 1e-4 to the std (own groups are recomputed by group_advantages); bf16=True is its default, and rounding moves
lbar (w near delta can flip). TRL has no public hook: three private methods are overridden, so a new TRL needs
tests/test_trl.py run again.

Watching the gate: after the first generation batch (if the receiver failed a prompt in it) and then once per
graft_warn_every (10), a window in which no peer row was accepted gets one warning naming the likely cause (nothing
all-fail; no mixed logged group for the failed prompts; or s below graft_delta: template, temperature, a summed
lbar) and the counts (s median, received, gated, too long, not decoding back, masked). The peer run's prompt
template and temperature (its run.json, found beside a rollout folder by name and run id) are compared with the
dataset's rendered prompts and --temperature at start (a warning). Retokenisation is the rule's own
(core.retokenize_group: a response too long or whose ids do not decode back to its text is dropped, w = 0).

Launch line (or `torchrun --nproc_per_node K -m tools.graft_trl ...`; the dataset is --prompts' JSONL, its fields
as columns, each prompt rendered as the peer sampled it: the template and chat flag of its run.json, or
--prompt_template / --chat_template; the reward is --reward's, verify.py's by default, under --reward_timeout as in
graft.py; without a bf16 GPU bf16 defaults to False, without a GPU use_cpu to True; a refusal is one line on
stderr, exit code 2, before the model loads where the input can be checked then (a reward's answer is checked on
one response first, then at every call, naming --reward and the value); under torchrun rank 0 says it, and torchrun
adds its own ChildFailedError report, which it has no flag to silence):
    python -m tools.graft_trl --model Qwen/Qwen3-1.7B-Base --prompts data/math_train.jsonl \\
        --peer_log runs/smollm/exchange/b --output_dir runs/trl_qwen --num_generations 8
From Python: GraftGRPOTrainer(model=..., reward_funcs=[...], args=GraftConfig(peer_log=...), train_dataset=...),
the dataset with a column naming each prompt's id in the log (GraftConfig.id_column).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import warnings
from dataclasses import dataclass, field, fields
from pathlib import Path

import torch
from trl import GRPOConfig, GRPOTrainer
from trl.data_utils import is_conversational
from trl.trainer.utils import get_callable_name, split_tensor_dict

from config import Config
from core import (PeerGroup, compatibility_weights, fold_weights, group_advantages, graft_candidates,
                  peer_last_rows, retokenize_group, seeded_generator, sequence_mean_logprob, success_counts)

LOG_FORMAT = """The stored peer (--peer_log): a folder of this project's rollout files (runs/NAME/exchange/NAME), or
a JSONL file, one response per line, read by the project's one peer-log parser (core.parse_peer_records):
  {"id" or "problem_id": str|int   the prompt's id in the dataset's --id_column (records of one id: its group)
   "response" or "completion": str  the peer's text (scored by this run's reward functions)
   "lbar" or "mean_logprob": float   the peer's mean log-prob per token of the response (Eq. 6), in [-20, 0];
                                     absent: --peer_model computes it
   "eos": bool}                      optional, default true: the response ended with EOS"""


class Refusal(ValueError):
    """A setting or input GRAFT-in-TRL cannot run exactly; the message names it and the fix (one line)."""


@dataclass
class GraftConfig(GRPOConfig):
    """TRL's GRPOConfig plus GRAFT's settings; epsilon_high defaults to the paper's 0.28 (TRL's: epsilon)."""

    peer_log: str = field(default="", metadata={"help": "The stored peer: a JSONL log or a folder of rollout files."})
    peer_model: str = field(default="", metadata={"help": "The model that wrote the log: computes lbar where the log "
                                                          "has none (cached beside the log)."})
    graft_delta: float = field(default=0.8, metadata={"help": "GRAFT's floor on s (Eq. 7); not TRL's `delta`."})
    id_column: str = field(default="id", metadata={"help": "Dataset column holding each prompt's id in the log."})
    success_reward: str = field(default="", metadata={"help": "Reward function(s) deciding success for Eq. 4, names "
                                                              "as TRL logs them (rewards/NAME/mean), comma-separated; "
                                                              "empty: all, weighted and summed as TRL's reward."})
    success_threshold: float = field(default=0.5, metadata={"help": "A response succeeds when its success reward "
                                                                    "(the sum over success_reward) is >= this "
                                                                    "(default 0.5)."})
    epsilon_high: float | None = field(default=0.28, metadata={"help": "Upper clip epsilon (paper: 0.28)."})
    graft_warn_every: int = field(default=10, metadata={"help": "Warn (one line, naming the likely cause and the "
                                                                "counts) when no peer row was accepted in the first "
                                                                "generation batch or in any window of this many; 0: "
                                                                "never."})


GRAFT_FIELDS = ("peer_log", "peer_model", "graft_delta", "id_column", "success_reward", "success_threshold",
                "epsilon_high", "graft_warn_every")


def check_args(args: GraftConfig) -> None:
    """Raise Refusal, naming the setting and the fix, for each layout or option in which TRL's loss is not Eq. 10."""
    S, A = args.steps_per_generation, args.gradient_accumulation_steps
    # The processes torchrun or accelerate launch started, from their environment: args.world_size would set up
    # the devices and the process group (and transformers' warnings on a CPU) before any refusal could be said.
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rules = [
        (args.loss_type in ("dapo", "bnpo"), f"loss_type={args.loss_type!r} is not one token-mean per optimizer "
                                             f"step (Eq. 10); use loss_type='dapo'"),
        (args.loss_type != "bnpo" or A == 1 and world == 1,
         f"loss_type='bnpo' with gradient_accumulation_steps={A} and {world} processes divides each "
         f"micro-batch by its own tokens; use loss_type='dapo'"),
        (S % A == 0, f"steps_per_generation={S} is not a multiple of gradient_accumulation_steps={A}: an "
                     f"optimizer step would mix two generation batches"),
        (args.per_device_train_batch_size * A * world % args.num_generations == 0,
         f"per_device_train_batch_size * gradient_accumulation_steps * processes = "
         f"{args.per_device_train_batch_size * A * world} is not a multiple of "
         f"num_generations={args.num_generations}: a group would straddle optimizer steps"),
        (args.num_iterations == 1, f"num_iterations={args.num_iterations} replays own minibatches after the peer "
                                   f"ones, so peer-last cannot hold; set num_iterations=1"),
        (args.delta is None, f"delta={args.delta} is TRL's cap on the ratio, not GRAFT's floor (graft_delta)"),
        (args.beta == 0.0, f"beta={args.beta}: a KL term is not part of Eq. 10; set beta=0"),
        (args.importance_sampling_level == "token", "importance_sampling_level must be 'token' (Eq. 9)"),
        (args.off_policy_mask_threshold is None and args.top_entropy_quantile == 1.0 and args.entropy_coef == 0.0
         and not args.use_adaptive_entropy, "off_policy_mask_threshold, top_entropy_quantile, entropy_coef and "
                                            "use_adaptive_entropy must stay off: they change Eq. 10"),
        (args.scale_rewards in ("group", "none") and args.multi_objective_aggregation == "sum_then_normalize",
         "scale_rewards must be 'group' or 'none' and multi_objective_aggregation 'sum_then_normalize'"),
        (args.max_completion_length is not None, "max_completion_length=None: it bounds the peer's retokenised "
                                                 "responses as it bounds the own ones; set it"),
        (bool(args.peer_log), "peer_log is empty: name the stored peer's JSONL log or rollout folder"),
    ]
    for ok, message in rules:
        if not ok:
            raise Refusal(f"GraftConfig: {message}")


# ------------------------------------------------------------------------------------------------
# The peer log: read through the project's one parser, matched to the dataset's ids, lbar completed
# ------------------------------------------------------------------------------------------------


def read_peer_log(path: str) -> dict[str, list]:
    """{prompt id: its core.PeerRecord list, log order, repeats left out} from a JSONL log (the project's one
    parser, via foreign.read_foreign_records) or a folder of rollout files (a prompt met at several steps:
    its latest group; lbar from the stored behaviour log-probs). Raises Refusal naming the file and line."""
    from core import PeerRecord
    p = Path(path)
    groups: dict[str, list] = {}
    if p.is_dir():
        from exchange import load_rollouts
        for f in sorted(p.glob("step_*.safetensors")):  # the step index is zero-padded: file order is step order
            r, _ = load_rollouts(f)
            lbar = r.lbar("token")  # (G, n) Eq. 6 under the source, from its stored behaviour log-probs
            for g, pid in enumerate(r.prompt_ids):
                groups[pid] = [PeerRecord(0, pid, None, r.texts[g * r.n + i], float(lbar[g, i]), -1,
                                          bool(r.eos[g, i]), float("nan")) for i in range(r.n)]
    elif p.is_file():
        from foreign import read_foreign_records
        try:
            records = read_foreign_records(p)
        except ValueError as e:
            raise Refusal(str(e)) from None
        for rec in records:
            if rec.prompt_id is None:
                raise Refusal(f"{p}:{rec.line}: needs a prompt id ('id' or 'problem_id'): graft_trl matches "
                              f"records to the dataset's --id_column, not by problem text")
            group = groups.setdefault(rec.prompt_id, [])
            if all(r.response != rec.response for r in group):  # a repeat would count one response twice
                group.append(rec)
    else:
        raise Refusal(f"GraftConfig.peer_log {path!r}: no such JSONL file or folder of rollout files")
    if not groups:
        raise Refusal(f"GraftConfig.peer_log {path!r}: holds no peer responses")
    return groups


def peer_run_settings(path: str) -> tuple[dict, str]:
    """(settings, run.json path) of the graft.py run that wrote a rollout folder: the run.json beside it (a run's
    --out holds run.json and exchange/NAME; a pair's sides sit beside their exchange folder) whose name is the
    folder's and whose run id is its files'. ({}, "") for a JSONL log, or when no such run.json is found."""
    from exchange import file_run_id, read_json
    p = Path(path)
    files = sorted(p.glob("step_*.safetensors")) if p.is_dir() else []
    if not files:
        return {}, ""
    rid, root = file_run_id(files[-1]), p.parent.parent
    for candidate in [root / "run.json", *sorted(root.glob("*/run.json"))]:
        record = read_json(candidate) or {}
        if record.get("name") == p.name and record.get("run_id") == rid and isinstance(record.get("settings"), dict):
            return record["settings"], str(candidate)
    return {}, ""


def dataset_rows(data, id_column: str, where: str) -> dict[str, int]:
    """{prompt id: its first row index} of the train dataset's id_column; Refusal when there is no such column."""
    columns = getattr(data, "column_names", None)
    if columns is None:
        raise Refusal(f"train_dataset {type(data).__name__} has no column names: GRAFT needs a datasets.Dataset "
                      f"with an id column (--id_column)")
    if id_column not in columns:
        raise Refusal(f"GraftConfig.id_column {id_column!r} is not a column of the train dataset ({where}: "
                      f"{', '.join(columns)}); set --id_column to the column holding the log's prompt ids")
    out: dict[str, int] = {}
    for i, x in enumerate(data[id_column]):
        out.setdefault(str(x), i)
    return out


def match_peer_log(groups: dict[str, list], ids: dict[str, int], args: GraftConfig) -> dict[str, list]:
    """The log's groups whose prompt id is a dataset id; Refusal (with the counts) when none is, a warning when
    some are not. A group of one response is kept (it fills one row) but can never be mixed."""
    matched = {pid: g for pid, g in groups.items() if pid in ids}
    if not matched:
        raise Refusal(f"GraftConfig.peer_log {args.peer_log!r}: none of its {len(groups)} prompt ids (e.g. "
                      f"{next(iter(groups))!r}) is in the dataset's {args.id_column!r} column ({len(ids)} ids, e.g. "
                      f"{next(iter(ids), '')!r}); GRAFT would never fire: check --id_column and the log's ids")
    if len(matched) < len(groups):
        lost = [pid for pid in groups if pid not in ids]
        warnings.warn(f"graft_trl: {len(lost)} of the log's {len(groups)} prompt ids are not in the dataset's "
                      f"{args.id_column!r} column (e.g. {lost[0]!r}); their records are left out", stacklevel=2)
    widest = max(len(g) for g in matched.values())
    if widest > args.num_generations:
        raise Refusal(f"GraftConfig.peer_log {args.peer_log!r} holds a group of {widest} responses: set "
                      f"num_generations >= {widest} so that a replaced group fits in its rows")
    return matched


def lbar_length_slope(lbar: torch.Tensor, length: torch.Tensor) -> float | None:
    """The least-squares slope of log(-lbar) against log(length) over responses with lbar < 0; None when fewer than
    8 such responses, or their lengths spread too little to tell (std of log length < 0.3).

    A sum of per-token log-probs grows with the response (-lbar = length x a mean): slope about 1. A mean per token
    (Eq. 6) does not: slope about 0. So a log of sums is told apart from a log of means by the shape of the log,
    not by a floor on lbar: the sums of short responses (-2 to -6) sit where means do. lbar, length: (R,)."""
    keep = lbar < 0  # (R,)
    if int(keep.sum()) < 8:
        return None
    x, y = length[keep].double().log(), (-lbar[keep].double()).log()  # (R',), (R',)
    if float(x.std()) < 0.3:
        return None
    x = x - x.mean()
    return float((x * (y - y.mean())).sum() / (x * x).sum())


def check_lbar_is_a_mean(groups: dict[str, list], where: str) -> None:
    """Refuse a log whose given lbar grows with the response's length (lbar_length_slope > 0.5): a summed
    log-probability, whose s would gate on length. Length: the record's num_tokens, else its characters (+ 1 for
    EOS), which scale with the peer's tokens; the slope does not depend on the scale."""
    recs = [r for g in groups.values() for r in g if r.lbar == r.lbar]  # given lbar (not NaN)
    if not recs:
        return
    length = torch.tensor([r.num_tokens if r.num_tokens > 0 else len(r.response) + int(r.eos) + (not r.response)
                           for r in recs], dtype=torch.float64)  # (R,)
    slope = lbar_length_slope(torch.tensor([r.lbar for r in recs], dtype=torch.float64), length)
    if slope is not None and slope > 0.5:
        raise Refusal(f"GraftConfig.peer_log {where!r}: its lbar grows with the response's length (slope "
                      f"{slope:.2f} of log(-lbar) against log(length) over {len(recs)} records; a mean per token "
                      f"gives about 0, a sum about 1): a summed log-probability? give the sum divided by the "
                      f"response's token count")


def fill_missing_lbar(groups: dict[str, list], prompts: dict[str, object], args: GraftConfig) -> None:
    """Compute lbar with --peer_model where records have none (foreign.fill_lbar: the project's one lbar
    computation, cached beside the log); Refusal naming --peer_model when it is not set. prompts: prompt id ->
    the dataset's prompt (a string, or a conversation rendered with the peer's chat template and the run's
    chat_template_kwargs, as TRL renders it); log-probs at the run's temperature, as TRL's own (Eq. 6)."""
    missing = [r for g in groups.values() for r in g if r.lbar != r.lbar]  # NaN
    if not missing:
        return
    if not args.peer_model:
        raise Refusal(f"{args.peer_log}:{missing[0].line}: {len(missing)} matched records have no 'lbar': set "
                      f"--peer_model to the model that wrote them (or a proxy) to compute it, or give it per record")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from foreign import ForeignLog, fill_lbar
    log = ForeignLog(Path(args.peer_log), groups, {}, std_normalize=True)
    tok = AutoTokenizer.from_pretrained(args.peer_model)
    model = AutoModelForCausalLM.from_pretrained(args.peer_model, dtype=torch.float32)  # lbar in float32

    kwargs = args.chat_template_kwargs or {}
    kwargs = json.loads(kwargs) if isinstance(kwargs, str) else kwargs  # a flag's JSON, as TRL reads it

    def encode(pid: str) -> list[int]:  # the prompt as TRL's _tokenize_prompts renders it, with the peer's tokenizer
        prompt = prompts[pid]
        if is_conversational({"prompt": prompt}):
            return list(tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True, return_dict=True,
                                                **kwargs)["input_ids"])
        return tok(text=prompt)["input_ids"]
    # The cache holds one lbar per log line: its key is everything else lbar depends on (the model, the
    # temperature, and here the prompt ids each response follows, which the template and its kwargs make, and EOS)
    encoded = {pid: encode(pid) for pid in groups}
    key = hashlib.sha256(json.dumps([encoded, tok.eos_token_id], sort_keys=True).encode()).hexdigest()
    fill_lbar(log, model, tok, model_path=args.peer_model, encode_prompt=encoded.__getitem__,
              problems={p: p for p in groups}, cache_key=f"graft_trl/{key}", temperature=args.temperature)
    for p, pid in enumerate(log.prompt_ids):
        for i, rec in enumerate(groups[pid]):
            lb = float(log.mean_logprob[p, i])
            if lb < -20.0:
                warnings.warn(f"graft_trl: --peer_model gives line {rec.line} an lbar of {lb:.3g}, below -20: is it "
                              f"the model that wrote the log?", stacklevel=2)
            groups[pid][i] = rec._replace(lbar=lb, num_tokens=int(log.num_tokens[p, i]))
    del model


def checked_reward(func):
    """A plain reward function wrapped so that an answer TRL cannot read (not a list, or an item that is neither a
    number nor None) raises Refusal naming the function, the completion and the value, instead of failing inside
    TRL's tensor conversion; a model id, a module or an async function is returned as it is."""
    import asyncio
    import functools
    import numbers
    if isinstance(func, (str, torch.nn.Module)) or not callable(func) or asyncio.iscoroutinefunction(func):
        return func

    name = get_callable_name(func)  # TRL's name for it (rewards/NAME/mean, success_reward), kept below

    @functools.wraps(func)
    def reward(*a, **kw):
        out = func(*a, **kw)
        if not isinstance(out, (list, tuple)):
            raise Refusal(f"reward function {name!r} returned {type(out).__name__} {str(out)[:60]!r}; TRL needs a "
                          f"list with one float (or None) per completion")
        for i, v in enumerate(out):
            if v is not None and not isinstance(v, (numbers.Real, torch.Tensor)) or isinstance(v, torch.Tensor) \
                    and v.numel() != 1:
                raise Refusal(f"reward function {name!r} returned {v!r} ({type(v).__name__}) for completion {i}; "
                              f"TRL needs a float (or None: no verdict) per completion")
        return out
    reward.__name__ = name  # a partial or a callable object has no __name__ for wraps to copy
    return reward


class GraftGRPOTrainer(GRPOTrainer):
    """GRPOTrainer with GRAFT's stored-trajectory step. Every argument is GRPOTrainer's; args is a GraftConfig.

    Overrides three of TRL's private methods (TRL has no public hook for this): _calculate_rewards keeps the
    own rewards (TRL keeps only advantages), _generate_and_score_completions grafts the peer groups, and
    _prepare_inputs cuts the batch peer-last with one token count per optimizer step. Batch keys added:
    graft_is_peer (B,) bool, graft_weight (B,) float (w; 1 for own rows, 0 for removed and empty ones).
    """

    def __init__(self, *a, args: GraftConfig, **kw):
        check_args(args)  # everything below, up to super().__init__, runs before the model loads
        data = kw.get("train_dataset")
        if data is None:
            raise Refusal("GraftGRPOTrainer needs train_dataset=, a datasets.Dataset with an id column (--id_column)")
        ids = dataset_rows(data, args.id_column, "train_dataset")
        funcs = kw.get("reward_funcs", a[1] if len(a) > 1 else None)
        funcs = [checked_reward(f) for f in (funcs if isinstance(funcs, list) else [funcs])]
        if "reward_funcs" in kw:
            kw["reward_funcs"] = funcs
        elif len(a) > 1:
            a = (a[0], funcs, *a[2:])
        names = [f.split("/")[-1] if isinstance(f, str) else get_callable_name(f) for f in funcs]  # as TRL names them
        chosen = [x.strip() for x in args.success_reward.split(",") if x.strip()]
        unknown = [x for x in chosen if x not in names]
        if unknown:
            raise Refusal(f"GraftConfig.success_reward names {unknown[0]!r}, which is no reward function of this "
                          f"trainer ({', '.join(names)}); name one of them, or leave it empty for all")
        self.success_columns = [names.index(x) for x in chosen] or list(range(len(names)))
        groups = match_peer_log(read_peer_log(args.peer_log), ids, args)
        if Path(args.peer_log).is_file():  # a rollout folder's lbar is a mean of its stored log-probs
            check_lbar_is_a_mean(groups, args.peer_log)
        self.peer_rows = {pid: data[ids[pid]] for pid in groups}  # each logged prompt's dataset row
        fill_missing_lbar(groups, {pid: row["prompt"] for pid, row in self.peer_rows.items()}, args)
        self.peer = {pid: PeerGroup([r.response for r in g], torch.tensor([r.eos for r in g], dtype=torch.bool),
                                    torch.tensor([r.lbar for r in g], dtype=torch.float32))
                     for pid, g in groups.items()}
        super().__init__(*a, args=args, **kw)
        self.peer_rewards = self.score_peer_log()
        self.warn_if_success_rule_is_inert()
        self.peer_settings, self.peer_settings_file = peer_run_settings(args.peer_log)
        self.warn_if_prompts_differ_from_the_peers()
        self.warned_bf16 = False
        self.gate_window: dict = {"batches": 0, "s": []}  # counts since the last check (watch_gate)
        self.generation_batches = 0

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        self.own_rewards = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        return self.own_rewards  # (B, F): TRL keeps only the advantages, Eq. 4 needs the rewards

    def rewards(self, per_func: torch.Tensor) -> torch.Tensor:
        """(R, F) rewards per reward function -> (R,) weighted sums, as TRL forms them; a row that no function
        scored (all NaN) is an error: Eq. 4 needs a verdict for every response."""
        if bool(per_func.isnan().all(dim=1).any()):
            raise ValueError("a completion got no reward from any reward function: GRAFT needs a verdict for each")
        return (per_func * self.reward_weights.to(per_func.device)).nansum(dim=1).cpu()

    def success(self, per_func: torch.Tensor) -> torch.Tensor:
        """(R, F) rewards per reward function -> (R,) the success reward: the weighted sum over success_reward's
        functions (all by default), which success_counts compares with success_threshold (Eq. 4)."""
        cols = self.success_columns
        return (per_func[:, cols] * self.reward_weights.to(per_func.device)[cols]).nansum(dim=1).cpu()

    def counts(self, per_func: torch.Tensor, n: int) -> torch.Tensor:
        """(G * n, F) rewards of G groups -> (G,) k, the successes per group under the user's rule (Eq. 4)."""
        return success_counts(self.success(per_func).view(-1, n), threshold=self.args.success_threshold)

    def completion_form(self, prompt, text: str):
        """A peer text as TRL hands completions to reward functions for this prompt: a string, or for a
        conversational prompt [{"role": "assistant", "content": text}] (TRL's _generate decodes so)."""
        return [{"role": "assistant", "content": text}] if is_conversational({"prompt": prompt}) else text

    def score_peer_log(self, chunk: int = 256) -> dict[str, torch.Tensor]:
        """{prompt id: (m, F) rewards per reward function} of every logged response, scored once at start by
        this trainer's reward functions through TRL's own _calculate_rewards (the dataset row's columns as
        kwargs, the completion in TRL's form for the prompt)."""
        rows = [(pid, text) for pid, grp in self.peer.items() for text in grp.texts]
        out = []
        for k in range(0, len(rows), chunk):
            part = rows[k: k + chunk]
            inputs = [self.peer_rows[pid] for pid, _ in part]
            prompts = [x["prompt"] for x in inputs]
            completions = [self.completion_form(x["prompt"], text) for x, (_, text) in zip(inputs, part)]
            ids = [self._tokenizer.encode(text, add_special_tokens=False) for _, text in part]
            r = GRPOTrainer._calculate_rewards(self, inputs, prompts, completions, ids)  # (W * R, F) gathered
            out.append(r[: len(part)].cpu())  # every process scored the same rows: keep one copy
        per_func = torch.cat(out)  # (R_total, F)
        if bool(per_func.isnan().all(dim=1).any()):
            raise ValueError("a logged response got no reward from any reward function: GRAFT needs a verdict")
        scores, start = {}, 0
        for pid, grp in self.peer.items():
            scores[pid] = per_func[start: start + len(grp.texts)]
            start += len(grp.texts)
        return scores

    def warn_if_success_rule_is_inert(self) -> None:
        """Warn, naming success_reward and success_threshold, when under the configured rule no logged group is
        mixed (Eq. 4 can select none), or every logged response succeeds (the rule cannot fail a response)."""
        k = {pid: int(success_counts(self.success(r)[None], threshold=self.args.success_threshold))
             for pid, r in self.peer_rewards.items()}
        total = sum(len(g.texts) for g in self.peer.values())
        passed, mixed = sum(k.values()), sum(1 <= k[pid] < len(g.texts) for pid, g in self.peer.items())
        rule = (f"success_reward={self.args.success_reward or 'all'!r} (of {', '.join(self.reward_func_names)}), "
                f"success_threshold={self.args.success_threshold:g}")
        if passed == total:
            warnings.warn(f"graft_trl: every one of the log's {total} responses succeeds under {rule}: the rule "
                          f"cannot make a group all-fail or mixed, so GRAFT never fires; name the accuracy reward "
                          f"in --success_reward or raise --success_threshold", stacklevel=3)
        elif mixed == 0:
            warnings.warn(f"graft_trl: none of the log's {len(self.peer)} groups is mixed under {rule} ({passed} "
                          f"of {total} responses succeed): GRAFT never fires; check --success_reward and "
                          f"--success_threshold", stacklevel=3)

    def warn_if_prompts_differ_from_the_peers(self) -> None:
        """Warn when the peer's run (its run.json, beside a rollout folder) rendered a matched prompt otherwise than
        this dataset does (a row with a "problem" column), or sampled at another temperature: s compares the
        receiver's log-prob of the peer's text after this run's prompt with the peer's after its own (Eq. 6), so
        either difference lowers s for reasons that are not the text (README's command on the tiny models: s median
        0.0035 under graft.py's default template, where the peer sampled under "{problem}\\n")."""
        settings, where = self.peer_settings, self.peer_settings_file
        if not settings or not self.accelerator.is_main_process:
            return
        template, chat = settings.get("prompt_template"), bool(settings.get("chat_template"))
        for row in self.peer_rows.values():
            if not isinstance(template, str) or "problem" not in row:
                break
            want = template.replace("{problem}", str(row["problem"]))
            got = row["prompt"]
            ours = got[-1].get("content") if is_conversational({"prompt": got}) else got
            if ours != want or is_conversational({"prompt": got}) != chat:
                warnings.warn(f"graft_trl: the peer sampled prompt {row[self.args.id_column]!r} as {want!r}"
                              f"{' (a chat user message)' if chat else ''} ({where}); this dataset gives "
                              f"{got!r}: s compares log-probs after two different prompts and falls; use the "
                              f"peer's template (the launch line's default reads it from {where})", stacklevel=3)
                break
        temperature = settings.get("temperature")
        if isinstance(temperature, (int, float)) and abs(float(temperature) - self.args.temperature) > 1e-9:
            warnings.warn(f"graft_trl: the peer's lbar is at temperature {temperature:g} ({where}), this run's "
                          f"log-probs at {self.args.temperature:g} (--temperature): s compares the two", stacklevel=3)

    def watch_gate(self, counts: dict, s: list[float]) -> None:
        """Warn from the main process, after the first generation batch and then once per graft_warn_every, when
        the window's batches accepted no peer row: the gate rejected every one, or no group could be received (after
        the first batch, only if the receiver failed some prompt: one batch without an all-fail prompt is common).
        counts: this generation batch's figures (the whole batch, every process's rows); s: (R,) of its received
        responses that fit max_completion_length, s = exp(lbar_recv - lbar_src) (Eq. 7)."""
        every, w = self.args.graft_warn_every, self.gate_window
        if every <= 0:
            return
        self.generation_batches += 1
        for k, v in counts.items():
            w[k] = w.get(k, 0) + v
        w["s"] += s
        w["batches"] += 1
        if (self.generation_batches - 1) % every:  # checked at batches 1, 1 + every, 1 + 2 x every, ...
            return
        self.gate_window = {"batches": 0, "s": []}
        if w["accepted"] > 0 or not self.accelerator.is_main_process or self.generation_batches == 1 and \
                w["all_fail"] == 0:  # one batch the receiver solved everywhere says nothing yet; a window does
            return
        first = self.generation_batches - w["batches"] + 1
        span = (f"generation batch {first}" if w["batches"] == 1 else
                f"generation batches {first}-{self.generation_batches}")
        head = f"graft_trl: no peer row accepted in {span}:"
        if w["all_fail"] == 0:
            why = (f"the receiver failed all {self.num_generations} rollouts of none of its {w['groups']:.0f} "
                   f"prompts, so there was nothing to receive (GRAFT acts on prompts it fails)")
        elif w["selected"] == 0:
            why = (f"the receiver failed all rollouts of {w['all_fail']:.0f} prompts; the log holds "
                   f"{w['in_log']:.0f} of them and none as a mixed group under success_reward="
                   f"{self.args.success_reward or 'all'!r}, success_threshold={self.args.success_threshold:g}")
        else:
            median = float(torch.tensor(w["s"]).median()) if w["s"] else float("nan")
            T = self.peer_settings.get("temperature")
            why = (f"{w['selected']:.0f} groups received, {w['candidates']:.0f} peer responses: s median "
                   f"{median:.3g} against graft_delta={self.args.graft_delta:g}; {w['gated']:.0f} gated (s <= "
                   f"delta), {w['too_long']:.0f} too long for max_completion_length, {w['no_eos']:.0f} without EOS "
                   f"masked" + (f", {w['lost']:.0f} dropped as their ids do not decode back to their text"
                                if w.get("lost") else ""))
            if w["gated"] >= max(w["too_long"], w["no_eos"], w.get("lost", 0)):
                why += (f". Likely cause: the receiver's log-prob of the peer's text is far below the peer's: the "
                        f"prompt or chat template differs from the one the peer sampled under, the temperature "
                        f"differs (this run {self.args.temperature:g}, the peer's "
                        f"{'unknown' if T is None else format(T, 'g')}), or the log's lbar is a sum over tokens")
        warnings.warn(f"{head} {why}", stacklevel=3)

    def check_precision(self, lbar_recv: torch.Tensor, lbar_src: torch.Tensor, w: torch.Tensor) -> None:
        """Warn once when bf16 is on and a peer response's gate sits within bf16's rounding of graft_delta: lbar_recv
        (R,) comes from the same forward and precision as TRL's own log-probs, and bf16 keeps 8 bits, so each
        token's log-prob can move by about 2^-8 of itself and w (R,) could flip (Eqs. 7-8). --bf16 False avoids it."""
        if self.warned_bf16 or not (self.args.bf16 or self.args.fp16):
            return
        margin = (lbar_recv - lbar_src - torch.log(torch.tensor(self.args.graft_delta))).abs()  # (R,) |ln s - ln delta|
        near = margin < 2.0 ** -8 * lbar_recv.abs()  # (R,)
        if bool(near.any()):
            self.warned_bf16 = True
            warnings.warn(f"graft_trl: bf16 is on and {int(near.sum())} peer responses have s within bf16's rounding "
                          f"of graft_delta={self.args.graft_delta:g} ({int((w[near] > 0).sum())} of them accepted): "
                          f"their w can flip with rounding; run with --bf16 False for an exact gate", stacklevel=2)

    def received(self, inputs: list[dict], k_own: torch.Tensor) -> list[tuple[int, PeerGroup, torch.Tensor]]:
        """Eq. 4, one way: (g, the logged group, its (m,) rewards) for each group g of the batch whose n own
        rollouts all fail and whose logged group is mixed, both under the user's success rule."""
        out = []
        for g, x in enumerate(inputs[:: self.num_generations]):
            pid = str(x[self.args.id_column])
            if k_own[g] != 0 or pid not in self.peer:
                continue
            per_func = self.peer_rewards[pid]  # (m, F)
            k_src = success_counts(self.success(per_func)[None], threshold=self.args.success_threshold)  # (1,)
            if graft_candidates(k_recv=k_own[g: g + 1], k_src=k_src, n=len(per_func)).item():
                out.append((g, self.peer[pid], self.rewards(per_func)))
        return out

    def _generate_and_score_completions(self, inputs):
        """TRL's sampling and scoring of this process's rows, then GRAFT's step on the whole generation batch: under
        W processes every process gathers the batch (a group may span processes, as TRL allows) and computes the
        same selection, weights and rows (departure 7)."""
        out = super()._generate_and_score_completions(inputs)
        if not self.model.training:
            return out  # evaluation: the receiver alone
        if "tool_mask" in out:
            raise ValueError("tools mask completion tokens per turn; GRAFT's rows have no turns (use no tools)")
        out.pop("sampling_per_token_logps", None)  # read only by the refused off-policy mask
        if self.accelerator.num_processes > 1:
            from accelerate.utils import gather_object
            out, inputs = self.gather_batch(out), gather_object(list(inputs))  # (W * B, ...) in process order
        n, dev, tok = self.num_generations, out["advantages"].device, self._tokenizer
        std = self.scale_rewards != "none"
        own = self.own_rewards  # (W * B, F) TRL gathered every process's rewards
        rewards = self.rewards(own).view(-1, n)  # (G, n)
        adv = group_advantages(rewards, std_normalize=std).view(-1).to(dev)  # (B,) departure 2
        weight, is_peer = torch.ones_like(adv), torch.zeros_like(adv, dtype=torch.bool)  # (B,), (B,)
        k_own = self.counts(own, n)  # (G,) Eq. 4 under the user's rule
        received = self.received(inputs, k_own)
        for g, _, r in received:  # a received group's rows: its m responses with their advantages, then empty ones
            adv[g * n: g * n + n], weight[g * n: g * n + n], is_peer[g * n: g * n + n] = 0.0, 0.0, True
            adv[g * n: g * n + len(r)] = group_advantages(r[None], std_normalize=std)[0].to(dev)
        c_ids, old = out["completion_ids"], out.get("old_per_token_logps")
        c_mask = out["completion_mask"] * ~is_peer[:, None]  # (B, T) a received group's rows are all replaced
        gate = {"gated": 0, "too_long": 0, "lost": 0, "no_eos": 0}  # why received responses were not accepted
        s_values: list[float] = []
        if received:
            slots = torch.tensor([g * n + i for g, grp, _ in received for i in range(len(grp.texts))], device=dev)
            rt = retokenize_group([t for _, grp, _ in received for t in grp.texts],
                                  [bool(e) for _, grp, _ in received for e in grp.eos], tok,
                                  max_response_tokens=self.max_completion_length, pad_token_id=tok.pad_token_id,
                                  eos_token_id=self.eos_token_ids[0])  # the rule's drops: too long, not decoding back
            ids, mask = rt.ids.to(dev), rt.mask.to(dev)  # (R, T_r), a dropped row all False
            with torch.no_grad():  # the receiver's behaviour log-probs of the peer tokens (TRL's are of its samples)
                lp = self._get_per_token_logps_and_entropies(
                    self.model, torch.cat([out["prompt_ids"][slots], ids], 1),
                    torch.cat([out["prompt_mask"][slots], mask.long()], 1), ids.shape[1],
                    batch_size=self.args.per_device_train_batch_size)[0].float()  # (R, T_r)
            lbar_src = torch.cat([grp.lbar for _, grp, _ in received]).to(dev)  # (R,)
            w = compatibility_weights(lbar_recv=sequence_mean_logprob(logp=lp, mask=mask), lbar_src=lbar_src,
                                      delta=self.args.graft_delta)  # (R,) Eqs. 6-8; 0 on a dropped row (lbar NaN)
            weight[slots] = w
            eos = torch.cat([grp.eos for _, grp, _ in received]).to(dev)  # (R,)
            if self.mask_truncated_completions:  # as TRL masks an own completion that did not end with EOS
                weight[slots] *= eos.float()
            fits = mask.any(dim=1)  # (R,)
            s = torch.exp(sequence_mean_logprob(logp=lp, mask=mask) - lbar_src)  # (R,) Eq. 7's s, for watch_gate
            s_values = s[fits].tolist()
            gate = {"gated": int((fits & (w == 0)).sum()), "too_long": len(rt.too_long), "lost": len(rt.lost),
                    "no_eos": int((fits & (w > 0) & ~eos).sum()) if self.mask_truncated_completions else 0}
            c_ids, c_mask = splice(c_ids, slots, ids, tok.pad_token_id), splice(c_mask, slots, mask.long(), 0)
            old = None if old is None else splice(old, slots, lp, 0.0)
            self.check_precision(sequence_mean_logprob(logp=lp, mask=mask), lbar_src, weight[slots])
        ratio = out.get("importance_sampling_ratio")  # vLLM's correction, (B, T) or (B, 1): TRL's, of its own rows
        if ratio is not None:  # a peer row's old log-probs are the receiver's own forward: nothing to correct
            ratio = torch.nn.functional.pad(ratio, (0, c_ids.shape[1] - ratio.shape[1]), value=1.0) \
                if ratio.shape[1] > 1 else ratio  # (B, T') token modes follow the spliced width
            out["importance_sampling_ratio"] = torch.where(is_peer[:, None], torch.ones_like(ratio), ratio)
        adv, c_mask = fold_weights(advantages=adv, weights=weight, mask=c_mask)  # Eq. 10 through TRL's own loss
        out |= {"completion_ids": c_ids, "completion_mask": c_mask, "advantages": adv,
                "num_items_in_batch": c_mask.sum(), "graft_is_peer": is_peer, "graft_weight": weight}
        if old is not None:
            out["old_per_token_logps"] = old
        accepted = int((is_peer & (weight > 0)).sum())
        candidates = sum(len(grp.texts) for _, grp, _ in received)
        metrics = {"all_fail": int((k_own == 0).sum()), "selected": len(received),
                   "accepted": accepted, "rejected": candidates - accepted}
        in_log = sum(int(k_own[g] == 0) and str(x[self.args.id_column]) in self.peer
                     for g, x in enumerate(inputs[::n]))
        totals = metrics | {"groups": len(k_own), "in_log": in_log, "candidates": candidates} | gate  # whole batch
        for key in metrics:
            self._metrics["train"][f"graft/{key}"].append(float(totals[key]))
        self.watch_gate(totals, s_values)
        return out

    def _prepare_inputs(self, generation_batch):
        if not self.model.training:
            return super()._prepare_inputs(generation_batch)
        S = self.args.steps_per_generation  # micro-batches per generation batch (num_iterations is 1)
        if self._step % S == 0 or self._buffered_inputs is None:
            self._buffered_inputs = self.peer_last_minibatches(self._generate_and_score_completions(generation_batch))
        return self._buffered_inputs[self._step % S]

    def peer_last_minibatches(self, batch: dict) -> list[dict]:
        """One generation batch -> its S micro-batches: own groups first, replaced groups last, no shuffle,
        and num_items_in_batch = that optimizer step's retained tokens x S / A, which TRL's dapo divides
        back by S / A: each optimizer step is one token-mean over its own retained tokens (Eq. 10). Under W
        processes: the batch is the gathered one, cut so, and this process keeps its W-th of each micro-batch
        (departure 7)."""
        S, A, n = self.args.steps_per_generation, self.args.gradient_accumulation_steps, self.num_generations
        W, rank = self.accelerator.num_processes, self.accelerator.process_index
        gen = seeded_generator(self.args.seed, self._step // S, "minibatch")  # as this project's trainer draws it
        order = peer_last_rows(batch["graft_is_peer"].view(-1, n)[:, 0].cpu(), n, generator=gen)  # (B,)
        batch = {k: v[order.to(v.device)] if isinstance(v, torch.Tensor) and v.dim() else
                 [v[i] for i in order.tolist()] if isinstance(v, list) else v for k, v in batch.items()}
        micro = split_tensor_dict(batch, S)
        for k in range(0, S, A):
            tokens = sum(mb["completion_mask"].sum() for mb in micro[k: k + A])
            for mb in micro[k: k + A]:
                mb["num_items_in_batch"] = tokens * (S // A)
        return micro if W == 1 else [split_tensor_dict(mb, W)[rank] for mb in micro]  # this process's share

    def gather_batch(self, batch: dict) -> dict:
        """This process's generation batch (B rows) -> every process's, in process order (W * B rows): the batch
        one process would hold for the same global batch. Prompts stay left-padded, completions right-padded.

        TRL's forward passes no position ids, so padding a prompt further on the left shifts its positions; under
        rotary embeddings (relative positions: Llama, Qwen, Gemma, ...) its log-probs stay the same (test_trl.py:
        prompts of different lengths on two processes equal one process), while a model with absolute position
        embeddings would see TRL's old log-probs taken at this process's width, as TRL's own batches are."""
        from accelerate.utils import gather, pad_across_processes
        B, out = len(batch["completion_ids"]), {}
        for k, v in batch.items():
            if k == "num_items_in_batch":
                out[k] = v  # recounted per optimizer step by the caller
            elif isinstance(v, torch.Tensor) and v.dim() >= 1 and v.shape[0] == B:
                if v.dim() == 2:  # (B, T): pad to the widest process, on the side TRL pads
                    pad = self._tokenizer.pad_token_id if k.endswith("_ids") else 0
                    v = pad_across_processes(v, dim=1, pad_index=pad, pad_first=k.startswith("prompt"))
                out[k] = gather(v)  # (W * B, ...)
            else:
                raise ValueError(f"graft_trl: batch key {k!r} ({type(v).__name__}) is not one row per completion; "
                                 f"GRAFT across processes handles text-only batches")
        return out


def splice(t: torch.Tensor, rows: torch.Tensor, values: torch.Tensor, pad_value) -> torch.Tensor:
    """t (B, T) with rows replaced by values (R, T'), both padded on the right to max(T, T'): (B, max(T, T'))."""
    width = max(t.shape[1], values.shape[1])
    t = torch.nn.functional.pad(t, (0, width - t.shape[1]), value=pad_value)  # (B, width)
    t[rows] = torch.nn.functional.pad(values.to(t.dtype), (0, width - values.shape[1]), value=pad_value)
    return t


# ------------------------------------------------------------------------------------------------
# The launch line: --prompts' JSONL as the dataset, --reward's function (verify.py's) as the reward
# ------------------------------------------------------------------------------------------------


@dataclass
class Script:
    """The launch line's own flags (the rest are GraftConfig's, i.e. TRL's GRPOConfig's plus GRAFT's)."""

    model: str = field(metadata={"help": "The receiver: a causal LM path or hub name."})
    prompts: str = field(metadata={"help": "Prompt JSONL (id, problem, answer), as graft.py --prompts."})
    prompt_template: str = field(default="", metadata={"help": "Prompt text around {problem}; default: the one "
                                                                "the peer sampled under (its run.json beside a "
                                                                "rollout folder), else graft.py's default."})
    chat_template: bool = field(default=False, metadata={"help": "Give each prompt as one user message of the "
                                                                 "receiver's chat template (as graft.py "
                                                                 "--chat-template); default: the peer run's choice."})
    reward: str = field(default=Config.reward, metadata={"help": "The reward, as graft.py --reward."})
    reward_timeout: float = field(default=Config.reward_timeout, metadata={"help": "Seconds each reward call may run "
                                                                                   "(as graft.py --reward-timeout; 0: "
                                                                                   "in-process, unbounded)."})
    verify_workers: int = field(default=Config.verify_workers, metadata={"help": "Reward worker processes (as "
                                                                                 "graft.py --verify-workers)."})


def reward_function(spec: str, *, timeout: float = 0.0, workers: int = 0):
    """A TRL reward function: each completion scored against its prompt's gold (the "answer" column) by the
    function --reward names, through reward.rewards (this project's one call of the reward) under its wall-time
    limit (--reward_timeout: a call past it is stopped and scores 0, as in graft.py). An answer that is not one
    finite number per completion raises Refusal naming --reward and the value."""
    from reward import load_reward, rewards
    load_reward(spec)  # a bad spec fails here, naming --reward

    def reward(completions: list, answer: list[str], **_) -> list[float]:
        texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]  # chat: the assistant message
        try:
            return list(rewards(spec, texts, answer, workers=workers, timeout=timeout))
        except ValueError as e:  # reward._checked: not a list of finite numbers
            raise Refusal(str(e)) from None
    return reward


def build_parser():
    """HfArgumentParser over Script and GraftConfig, its --help opening on the log format and GRAFT's own flags
    (TRL's GRPOConfig flags follow), and its errors one line, exit code 2 (no usage dump of 300 flags)."""
    from transformers import HfArgumentParser
    parser = HfArgumentParser((Script, GraftConfig), prog="python -m tools.graft_trl",
                              usage="python -m tools.graft_trl --model M --prompts FILE --peer_log LOG "
                                    "--output_dir DIR [GRAFT's flags] [any GRPOConfig flag]",
                              description="GRAFT inside TRL's GRPOTrainer (the stored peer; tools/graft_trl.py's "
                                          "docstring has the rest). On a machine without a bf16 GPU, bf16 defaults "
                                          "to False.\n\n"
                                          + LOG_FORMAT)
    import argparse
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    ours = {f.name for f in fields(Script)} | set(GRAFT_FIELDS)
    group = parser.add_argument_group("GRAFT's flags (the launch line's, then GraftConfig's)")
    moved = [x for x in parser._optionals._group_actions if x.dest in ours]
    moved.sort(key=lambda x: ([f.name for f in fields(Script)] + list(GRAFT_FIELDS)).index(x.dest))
    group._group_actions.extend(moved)
    parser._optionals._group_actions[:] = [x for x in parser._optionals._group_actions if x.dest not in ours]
    parser._optionals.title = "TRL's GRPOConfig flags"
    parser._action_groups.remove(group)
    parser._action_groups.insert(1, group)  # after the (empty) positionals: first on the page

    def error(message: str):
        raise Refusal(f"{message} (python -m tools.graft_trl --help lists the flags)")
    parser.error = error
    return parser


def flags_given(argv: list[str]) -> set[str]:
    """The flags on a command line, spelt with underscores (HfArgumentParser takes --use-cpu for --use_cpu)."""
    return {"--" + x[2:].split("=")[0].replace("-", "_") for x in argv if x.startswith("--")}


def main(argv: list[str] | None = None) -> GraftGRPOTrainer:
    """The launch line: parse Script's and GraftConfig's flags, build the dataset, train; returns the trainer.
    Every refusal (a flag, the log, the dataset) is one line on stderr and exit code 2, before the model loads."""
    argv = list(sys.argv[1:] if argv is None else argv)
    given = flags_given(argv)
    if not given & {"--bf16", "--no_bf16", "--fp16"} and not (
            torch.cuda.is_available() and torch.cuda.is_bf16_supported()):
        argv += ["--bf16", "False"]  # TRL's default bf16=True stops on such a machine ("doesn't support bf16/gpu")
    if not torch.cuda.is_available() and "--use_cpu" not in given:
        argv += ["--use_cpu", "True"]  # else under torchrun on CPUs accelerate sees no distributed run: no DDP
    try:
        return run(argv)
    except Refusal as e:
        rank = int(os.environ.get("RANK", "0"))  # torchrun's: every process meets the same input, rank 0 says it
        if rank == 0 or getattr(e, "every_rank", False):
            print(f"graft_trl: error: {'' if rank == 0 else f'rank {rank}: '}{' '.join(str(e).split())}",
                  file=sys.stderr, flush=True)
        else:  # torchrun stops the other workers when one exits: let rank 0 say it first
            import time
            time.sleep(2.0)
        raise SystemExit(2) from None


def run(argv: list[str]) -> GraftGRPOTrainer:
    """main without the refusal handling: parse, read the prompts, render them as the peer sampled them, check
    the reward on one, build the trainer (its checks first), train."""
    from datasets import Dataset

    from runtime import load_prompt_file
    try:
        with warnings.catch_warnings():  # transformers' deprecation notes on TRL's defaults: nothing the user set
            warnings.simplefilter("ignore", FutureWarning)
            script, args = build_parser().parse_args_into_dataclasses(argv)
    except Refusal:
        raise
    except ValueError as e:  # GRPOConfig's and transformers' own checks of the flags, and unknown flags
        raise Refusal(str(e)) from None
    try:
        rows = load_prompt_file(script.prompts)
        reward = reward_function(script.reward, timeout=script.reward_timeout, workers=script.verify_workers)
    except (OSError, ValueError) as e:
        raise Refusal(f"--prompts / --reward: {e}") from None
    except SystemExit as e:  # load_prompt_file's own message (no such file, a bad line)
        raise Refusal(str(e.code)) from None
    if not rows:
        raise Refusal(f"--prompts {script.prompts!r}: holds no prompts")
    given = flags_given(argv)
    settings, where = peer_run_settings(args.peer_log)
    template = script.prompt_template or settings.get("prompt_template") or Config.prompt_template
    chat = script.chat_template or ("--chat_template" not in given and bool(settings.get("chat_template")))
    if "{problem}" not in template:
        raise Refusal(f"--prompt_template {template!r}: must contain '{{problem}}'")
    if where and not script.prompt_template and int(os.environ.get("RANK", "0")) == 0:
        print(f"graft_trl: prompts rendered as the peer sampled them ({where}): template {template!r}"
              f"{', as a chat user message' if chat else ''} (--prompt_template overrides)", file=sys.stderr)
    render = ((lambda text: [{"role": "user", "content": text}]) if chat else (lambda text: text))
    data = Dataset.from_list([{k: v for k, v in r.items() if k not in ("prompt", "completion")}
                              | {"prompt": render(template.replace("{problem}", r["problem"]))} for r in rows])
    reward(completions=[""], answer=[rows[0]["answer"]])  # a reward that answers no number stops here, not later
    trainer = GraftGRPOTrainer(model=script.model, reward_funcs=[reward], args=args, train_dataset=data)
    try:
        trainer.train()
    except Refusal as e:  # met by one process during training (a reward's answer): each says its own
        e.every_rank = True
        raise
    return trainer


if __name__ == "__main__":
    main()
