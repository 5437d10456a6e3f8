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
step; "bnpo" only with A = 1. The rest is refused at construction with a ValueError naming the setting.
Where this departs from stock TRL:
  1. Minibatches are not shuffled: own groups first, replaced groups last (core.peer_last_rows).
  2. Own advantages are recomputed with core.group_advantages (std + 1e-6, exactly 0 on equal rewards)
     so that own and peer groups share one formula; TRL adds 1e-4 to the std.
  3. The peer log is read once at start: the project's JSONL format (core.read_peer_records) or a folder
     of this project's rollout files (a prompt met at several steps: its latest group). The peer's texts
     are scored by this trainer's reward functions (as graft.py re-verifies a stored log); lbar_src must
     be in the log (Eq. 6 per token).
  4. A logged group of m < n responses fills m of its prompt's n rows; the other n - m rows are empty
     (masked, w = 0), so TRL's batch keeps its shape.

Refused at construction, naming the setting: delta (TRL's cap on the ratio; GRAFT's floor is graft_delta), beta
> 0, num_iterations > 1 (own minibatches replayed after peer ones), S not a multiple of A, a group straddling
optimizer steps, more than one process (groups would straddle ranks; DDP untested), vLLM's importance-sampling
correction (a ratio of tokens no longer in the batch), sequence-level ratios, entropy masks and bonuses,
scale_rewards="batch", a logged group larger than num_generations. Traps handled: stock TRL shuffles the batch
before cutting minibatches (peer rows land in both); its old log-probs exist only when S > A, and only of its
own samples; epsilon_high defaults to epsilon (here 0.28); its advantages add 1e-4 to the std (own groups are
recomputed by group_advantages); bf16=True is its default, and rounding moves lbar (w near delta can flip). TRL
has no public hook: three private methods are overridden, so a new TRL needs test_trl.py run again.

Launch line (one process; the dataset is --prompts' JSONL; the reward is --reward's, verify.py's by default):
    python -m tools.graft_trl --model Qwen/Qwen3-1.7B-Base --prompts data/math_train.jsonl \\
        --peer_log runs/smollm/exchange/b --output_dir runs/trl_qwen --num_generations 8
From Python: GraftGRPOTrainer(model=..., reward_funcs=[...], args=GraftConfig(peer_log=...), train_dataset=...),
the dataset with a column naming each prompt's id in the log (GraftConfig.id_column).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from trl import GRPOConfig, GRPOTrainer
from trl.trainer.utils import split_tensor_dict

from config import Config
from core import (PeerGroup, compatibility_weights, fold_weights, group_advantages, graft_candidates,
                  peer_last_rows, read_peer_records, retokenize_group, seeded_generator, sequence_mean_logprob,
                  success_counts)


@dataclass
class GraftConfig(GRPOConfig):
    """TRL's GRPOConfig plus GRAFT's settings; epsilon_high defaults to the paper's 0.28 (TRL's: epsilon)."""

    peer_log: str = field(default="", metadata={"help": "The stored peer: a JSONL log or a folder of rollout files."})
    graft_delta: float = field(default=0.8, metadata={"help": "GRAFT's floor on s (Eq. 7); not TRL's `delta`."})
    id_column: str = field(default="id", metadata={"help": "Dataset column holding each prompt's id in the log."})
    epsilon_high: float | None = field(default=0.28, metadata={"help": "Upper clip epsilon (paper: 0.28)."})


def check_args(args: GraftConfig) -> None:
    """Raise ValueError, naming the setting, for each layout or option in which TRL's loss is not Eq. 10."""
    S, A = args.steps_per_generation, args.gradient_accumulation_steps
    rules = [
        (args.loss_type in ("dapo", "bnpo"), f"loss_type={args.loss_type!r} is not one token-mean per optimizer "
                                             f"step (Eq. 10); use loss_type='dapo'"),
        (args.loss_type != "bnpo" or A == 1, f"loss_type='bnpo' with gradient_accumulation_steps={A} divides each "
                                             f"micro-batch by its own tokens; use loss_type='dapo'"),
        (args.world_size == 1, f"{args.world_size} processes: groups would straddle ranks and peer-last would hold "
                               f"per rank only; run one process"),
        (S % A == 0, f"steps_per_generation={S} is not a multiple of gradient_accumulation_steps={A}: an "
                     f"optimizer step would mix two generation batches"),
        (args.per_device_train_batch_size * A % args.num_generations == 0,
         f"per_device_train_batch_size * gradient_accumulation_steps = {args.per_device_train_batch_size * A} is "
         f"not a multiple of num_generations={args.num_generations}: a group would straddle optimizer steps"),
        (args.num_iterations == 1, f"num_iterations={args.num_iterations} replays own minibatches after the peer "
                                   f"ones, so peer-last cannot hold; set num_iterations=1"),
        (args.delta is None, f"delta={args.delta} is TRL's cap on the ratio, not GRAFT's floor (graft_delta)"),
        (args.beta == 0.0, f"beta={args.beta}: a KL term is not part of Eq. 10"),
        (args.importance_sampling_level == "token", "importance_sampling_level must be 'token' (Eq. 9)"),
        (not (args.use_vllm and args.vllm_importance_sampling_correction),
         "vllm_importance_sampling_correction=True would weight peer rows by a ratio of tokens no longer in the "
         "batch; set it to False"),
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
            raise ValueError(f"GraftConfig: {message}")


def load_peer_log(path: str) -> dict[str, PeerGroup]:
    """{prompt id: PeerGroup} from a JSONL log (core.read_peer_records) or a folder of rollout files."""
    p = Path(path)
    if p.is_dir():
        from exchange import load_rollouts
        groups = {}
        for f in sorted(p.glob("step_*.safetensors")):  # the step index is zero-padded: file order is step order
            r, _ = load_rollouts(f)
            lbar = r.lbar("token")  # (G, n) Eq. 6 under the source, from its stored behaviour log-probs
            for g, pid in enumerate(r.prompt_ids):
                groups[pid] = PeerGroup(r.texts[g * r.n: (g + 1) * r.n], r.eos[g], lbar[g])
    elif p.is_file():
        records = []
        for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
            try:
                records += [(i, json.loads(line))] if line.strip() else []
            except json.JSONDecodeError as e:
                raise ValueError(f"{p}:{i}: not JSON ({e.msg})") from None
        groups = read_peer_records(records, where=str(p))
    else:
        raise ValueError(f"GraftConfig.peer_log {path!r}: no such JSONL file or folder of rollout files")
    if not groups:
        raise ValueError(f"GraftConfig.peer_log {path!r}: holds no peer responses")
    no_lbar = [pid for pid, g in groups.items() if bool(g.lbar.isnan().any())]
    if no_lbar:
        raise ValueError(f"GraftConfig.peer_log {path!r}: {len(no_lbar)} prompts have records without 'lbar' (first "
                         f"{no_lbar[0]!r}); compute it with the model that wrote them (offline.fill_lbar)")
    return groups


class GraftGRPOTrainer(GRPOTrainer):
    """GRPOTrainer with GRAFT's stored-trajectory step. Every argument is GRPOTrainer's; args is a GraftConfig.

    Overrides three of TRL's private methods (TRL has no public hook for this): _calculate_rewards keeps the
    own rewards (TRL keeps only advantages), _generate_and_score_completions grafts the peer groups, and
    _prepare_inputs cuts the batch peer-last with one token count per optimizer step. Batch keys added:
    graft_is_peer (B,) bool, graft_weight (B,) float (w; 1 for own rows, 0 for removed and empty ones).
    """

    def __init__(self, *a, args: GraftConfig, **kw):
        check_args(args)  # before the model loads
        self.peer = load_peer_log(args.peer_log)
        widest = max(len(g.texts) for g in self.peer.values())
        if widest > args.num_generations:
            raise ValueError(f"GraftConfig.peer_log {args.peer_log!r} holds a group of {widest} responses: set "
                             f"num_generations >= {widest} so that a replaced group fits in its rows")
        super().__init__(*a, args=args, **kw)

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        self.own_rewards = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        return self.own_rewards  # (B, F): TRL keeps only the advantages, Eq. 4 needs the rewards

    def rewards(self, per_func: torch.Tensor) -> torch.Tensor:
        """(R, F) rewards per reward function -> (R,) weighted sums, as TRL forms them; a row that no function
        scored (all NaN) is an error: Eq. 4 needs a verdict for every response."""
        if bool(per_func.isnan().all(dim=1).any()):
            raise ValueError("a completion got no reward from any reward function: GRAFT needs a verdict for each")
        return (per_func * self.reward_weights.to(per_func.device)).nansum(dim=1).cpu()

    def received(self, inputs: list[dict], k_own: torch.Tensor) -> list[tuple[int, PeerGroup, torch.Tensor]]:
        """Eq. 4, one way: (g, the logged group, its (m,) rewards) for each group g of the batch whose n own
        rollouts all fail and whose logged group is mixed under this trainer's own reward functions."""
        n, pid = self.num_generations, [str(x[self.args.id_column]) for x in inputs[:: self.num_generations]]
        logged = [(g, self.peer[p]) for g, p in enumerate(pid)
                  if k_own[g] == 0 and p in self.peer and len(self.peer[p].texts) > 1]  # a group of one is never mixed
        rows = [(inputs[g * n], text) for g, grp in logged for text in grp.texts]
        if not rows:
            return []
        ids = [self._tokenizer.encode(text, add_special_tokens=False) for _, text in rows]
        scores = self.rewards(GRPOTrainer._calculate_rewards(self, [x for x, _ in rows], [x["prompt"] for x, _ in rows],
                                                             [text for _, text in rows], ids))  # (R,)
        out, start = [], 0
        for g, grp in logged:
            r = scores[start: start + len(grp.texts)]  # (m,)
            start += len(grp.texts)
            if graft_candidates(k_recv=k_own[g: g + 1], k_src=success_counts(r[None]), n=len(r)).item():
                out.append((g, grp, r))
        return out

    def _generate_and_score_completions(self, inputs):
        """TRL's sampling and scoring of the own groups, then GRAFT's step on the generation batch."""
        out = super()._generate_and_score_completions(inputs)
        if not self.model.training:
            return out  # evaluation: the receiver alone
        if "tool_mask" in out:
            raise ValueError("tools mask completion tokens per turn; GRAFT's rows have no turns (use no tools)")
        out.pop("sampling_per_token_logps", None)  # read only by the refused vLLM correction
        n, dev, tok = self.num_generations, out["advantages"].device, self._tokenizer
        std = self.scale_rewards != "none"
        rewards = self.rewards(self.own_rewards).view(-1, n)  # (G, n)
        adv = group_advantages(rewards, std_normalize=std).view(-1).to(dev)  # (B,) departure 2
        weight, is_peer = torch.ones_like(adv), torch.zeros_like(adv, dtype=torch.bool)  # (B,), (B,)
        received = self.received(inputs, success_counts(rewards))
        for g, _, r in received:  # a received group's rows: its m responses with their advantages, then empty ones
            adv[g * n: g * n + n], weight[g * n: g * n + n], is_peer[g * n: g * n + n] = 0.0, 0.0, True
            adv[g * n: g * n + len(r)] = group_advantages(r[None], std_normalize=std)[0].to(dev)
        c_ids, old = out["completion_ids"], out.get("old_per_token_logps")
        c_mask = out["completion_mask"] * ~is_peer[:, None]  # (B, T) a received group's rows are all replaced
        if received:
            slots = torch.tensor([g * n + i for g, grp, _ in received for i in range(len(grp.texts))], device=dev)
            ids, mask = retokenize_group([t for _, grp, _ in received for t in grp.texts],
                                         [bool(e) for _, grp, _ in received for e in grp.eos], tok,
                                         max_response_tokens=self.max_completion_length, pad_token_id=tok.pad_token_id,
                                         eos_token_id=self.eos_token_ids[0])  # (R, T_r)
            ids, mask = ids.to(dev), mask.to(dev)
            with torch.no_grad():  # the receiver's behaviour log-probs of the peer tokens (TRL's are of its samples)
                lp = self._get_per_token_logps_and_entropies(
                    self.model, torch.cat([out["prompt_ids"][slots], ids], 1),
                    torch.cat([out["prompt_mask"][slots], mask.long()], 1), ids.shape[1],
                    batch_size=self.args.per_device_train_batch_size)[0].float()  # (R, T_r)
            lbar_src = torch.cat([grp.lbar for _, grp, _ in received]).to(dev)  # (R,)
            w = compatibility_weights(lbar_recv=sequence_mean_logprob(logp=lp, mask=mask), lbar_src=lbar_src,
                                      delta=self.args.graft_delta)  # (R,) Eqs. 6-8
            weight[slots] = w * mask.any(dim=1)  # a response too long after retokenisation is dropped
            c_ids, c_mask = splice(c_ids, slots, ids, tok.pad_token_id), splice(c_mask, slots, mask.long(), 0)
            old = None if old is None else splice(old, slots, lp, 0.0)
        adv, c_mask = fold_weights(advantages=adv, weights=weight, mask=c_mask)  # Eq. 10 through TRL's own loss
        out |= {"completion_ids": c_ids, "completion_mask": c_mask, "advantages": adv,
                "num_items_in_batch": c_mask.sum(), "graft_is_peer": is_peer, "graft_weight": weight}
        if old is not None:
            out["old_per_token_logps"] = old
        accepted = int((is_peer & (weight > 0)).sum())
        metrics = {"all_fail": int((success_counts(rewards) == 0).sum()), "selected": len(received),
                   "accepted": accepted, "rejected": sum(len(grp.texts) for _, grp, _ in received) - accepted}
        for key, v in metrics.items():
            self._metrics["train"][f"graft/{key}"].append(float(v))
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
        back by S / A: each optimizer step is one token-mean over its own retained tokens (Eq. 10)."""
        S, A, n = self.args.steps_per_generation, self.args.gradient_accumulation_steps, self.num_generations
        gen = seeded_generator(self.args.seed, self._step // S, "minibatch")  # as this project's trainer draws it
        order = peer_last_rows(batch["graft_is_peer"].view(-1, n)[:, 0].cpu(), n, generator=gen)  # (B,)
        batch = {k: v[order.to(v.device)] if isinstance(v, torch.Tensor) and v.dim() else
                 [v[i] for i in order.tolist()] if isinstance(v, list) else v for k, v in batch.items()}
        micro = split_tensor_dict(batch, S)
        for k in range(0, S, A):
            tokens = sum(mb["completion_mask"].sum() for mb in micro[k: k + A])
            for mb in micro[k: k + A]:
                mb["num_items_in_batch"] = tokens * (S // A)
        return micro


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
    prompt_template: str = field(default=Config.prompt_template, metadata={"help": "Prompt text around {problem}."})
    reward: str = field(default=Config.reward, metadata={"help": "The reward, as graft.py --reward."})


def reward_function(spec: str):
    """A TRL reward function: each completion scored against its prompt's gold (the "answer" column) by the
    function --reward names, through reward.rewards (this project's one call of the reward)."""
    from reward import load_reward, rewards
    load_reward(spec)  # a bad spec fails here, naming --reward

    def reward(completions: list[str], answer: list[str], **_) -> list[float]:
        return rewards(spec, completions, answer)
    return reward


def main(argv: list[str] | None = None) -> GraftGRPOTrainer:
    """The launch line: parse Script's and GraftConfig's flags, build the dataset, train; returns the trainer."""
    from datasets import Dataset
    from transformers import HfArgumentParser

    from runtime import load_prompt_file
    script, args = HfArgumentParser((Script, GraftConfig)).parse_args_into_dataclasses(argv)
    rows = load_prompt_file(script.prompts)
    data = Dataset.from_list([{"id": r["id"], "prompt": script.prompt_template.replace("{problem}", r["problem"]),
                               "answer": r["answer"]} for r in rows])
    trainer = GraftGRPOTrainer(model=script.model, reward_funcs=[reward_function(script.reward)], args=args,
                               train_dataset=data)
    trainer.train()
    return trainer


if __name__ == "__main__":
    main()
