"""One GRAFT generation batch through TRL's Trainer.train() per layout, recorded per optimizer step; run by
tests/test_trl.py in one process and under `torchrun --nproc_per_node 2` (gloo, CPU) on the same global batch.

Sampling is planted (each prompt's n completions are fixed texts), so both runs see the same data: 4 prompts
of n = 4 and of different lengths, two whose own groups all fail and whose logged peer group is mixed; two
generation batches per layout. Per optimizer step it records the summed loss over the step's micro-batches and
processes (each process's TRL loss is W times its share), the gradient the optimizer steps on (after DDP's
average) and the update it made to the weights (SGD); the one-process run also records a hand Eq. 10 of the
step's rows (core.policy_loss on a plain forward, w unfolded) and its gradient.

Run: python tests/trl_ranks.py MODEL_DIR OUT_FILE ["S,A,R;S,A,R"]  (or under torchrun; the repository root on
     PYTHONPATH)
     python tests/trl_ranks.py compare ONE_FILE TWO_FILE   (the table in docs/RESULTS.md, "GRAFT in TRL")
     python tests/trl_ranks.py refuse CASES.json OUT   (under torchrun: each bad input's exit code and stderr per rank)
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import TrainerCallback

import core
from tools import graft_trl

N, PROMPTS = 4, 4  # rollouts per prompt; prompts in the dataset
# (steps_per_generation S, gradient_accumulation_steps A, rows per micro-batch over all processes R): with R = 16 / S
# a generation batch is the whole dataset; (1, 1, 4) is TRL's per-device batch 2 with 4 generations on two
# processes, a generation batch of one prompt whose group spans both processes
LAYOUTS = [(1, 1, 16), (2, 1, 8), (2, 2, 8), (4, 2, 4), (1, 1, 4)]
# Prompts of different lengths: under two processes the first holds the two short ones, the second the long ones
PROMPT_TEXTS = ["0+1=", "1+2=", "2+3+4+5=", "3+4+5+6+7+8="]
OWN = {0: ["9", "99", "999", "9999"], 1: ["3", "33", "4", "44"], 2: ["8", "88", "888", "6"], 3: ["7", "77", "8", "7+"]}
PASS = {"3", "4", "5", "7", "1+2", "2+1", "5+0"}  # p1's and p3's own groups are mixed; p0's and p2's all fail
# lbar near the tiny receiver's own (about -4 per token): some accepted at w < 1, some at w = 1, some removed
PEER = {"p0": [("1+2", True, -4.0), ("2+", True, -3.0), ("2+1", False, -4.4)],
        "p2": [("5", True, -3.9), ("55", True, -4.6), ("5+0", True, -2.5), ("6", True, -4.1)]}


def passing(completions, **_):
    return [1.0 if c in PASS else 0.0 for c in completions]


def run_layout(model: Path, out: Path, S: int, A: int, R: int) -> dict:
    """Two generation batches of the layout through Trainer.train(); per optimizer step the recorded figures."""
    from datasets import Dataset
    W = int(os.environ.get("WORLD_SIZE", 1))  # torchrun's; the process group starts only with GraftConfig
    log = out.parent / f"peer{os.environ.get('RANK', 0)}.jsonl"  # one file per process: no race to write it
    log.write_text("".join(json.dumps({"id": pid, "response": t, "eos": e, "lbar": lb}) + "\n"
                           for pid, g in PEER.items() for t, e, lb in g))
    data = Dataset.from_list([{"id": f"p{i}", "prompt": PROMPT_TEXTS[i], "answer": ""} for i in range(PROMPTS)])
    args = graft_trl.GraftConfig(output_dir=str(out.parent / f"run{S}{A}{R}"), peer_log=str(log), num_generations=N,
                                 bf16=False, use_cpu=True, report_to="none", save_strategy="no", seed=0,
                                 max_completion_length=4, steps_per_generation=S, gradient_accumulation_steps=A,
                                 per_device_train_batch_size=R // W, max_steps=2 * S // A,  # two generation batches
                                 learning_rate=1e-2, logging_steps=1, max_grad_norm=0.0,  # clipping: not Eq. 10
                                 optim="sgd",  # the update is -lr x the gradient: Adam's first step is lr x sign(g),
                                 shuffle_dataset=False,  # which float noise on a near-zero gradient would flip
                                 ddp_backend="gloo" if W > 1 else None)
    tr = graft_trl.GraftGRPOTrainer(model=str(model), reward_funcs=[passing], args=args, train_dataset=data)
    tok = tr.processing_class

    def planted(prompts):  # each prompt's group: OWN's texts, the even ones ended with EOS
        prompt_ids = tr._tokenize_prompts(prompts)[0]
        first = int(os.environ.get("RANK", 0)) * len(prompts)  # this process's rows: consecutive rows of the batch
        texts = [OWN[PROMPT_TEXTS.index(p)][(first + i) % N] for i, p in enumerate(prompts)]
        ids = [tok.encode(t, add_special_tokens=False) + ([tok.eos_token_id] if (first + i) % 2 == 0 else [])
               for i, t in enumerate(texts)]
        return prompt_ids, ids, None, texts, None, {}, None, None
    tr._generate = planted
    seen, steps = [], []
    compute = tr._compute_loss

    def recorded(model, mb):
        loss = compute(model, mb)
        seen.append((float(loss.detach()), mb))
        return loss
    tr._compute_loss = recorded
    params = [p for p in tr.model.parameters() if p.requires_grad]

    def flat() -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1) for p in params]).clone()

    class Record(TrainerCallback):
        def on_pre_optimizer_step(self, *a, **k):
            loss = torch.tensor(sum(x for x, _ in seen[-A:]))
            if W > 1:
                dist.all_reduce(loss)  # each process's dapo loss is W times its share of the step's token-mean
            step = {"loss": float(loss) / W, "grad": torch.cat([p.grad.reshape(-1) for p in params]).clone(),
                    "before": flat()}
            if W == 1:
                step |= hand_eq10(tr, [mb for _, mb in seen[-A:]], params)
            steps.append(step)

        def on_optimizer_step(self, *a, **k):
            steps[-1]["update"] = flat() - steps[-1].pop("before")  # what the optimizer did to the weights
    tr.add_callback(Record())
    tr.train()
    selected = [x["graft/selected"] for x in tr.state.log_history if "graft/selected" in x]
    return {"steps": steps, "selected": selected}


def hand_eq10(tr, micro: list[dict], params) -> dict:
    """core.policy_loss over the optimizer step's rows (a plain forward, w unfolded from the folded advantage)."""
    cat = {k: torch.cat([mb[k] for mb in micro]) for k in ("prompt_ids", "prompt_mask", "completion_ids",
                                                             "completion_mask", "advantages", "graft_weight")}
    ids = torch.cat([cat["prompt_ids"], cat["completion_ids"]], 1)  # (B, P + T)
    logits = tr.model(input_ids=ids, attention_mask=torch.cat([cat["prompt_mask"], cat["completion_mask"]], 1)).logits
    T = cat["completion_ids"].shape[1]
    lp = torch.log_softmax(logits[:, -T - 1: -1].float(), -1).gather(-1, cat["completion_ids"][..., None])[..., 0]
    old = torch.cat([mb["old_per_token_logps"] for mb in micro]) if "old_per_token_logps" in micro[0] else lp.detach()
    w = cat["graft_weight"]  # (B,)
    adv = torch.where(w > 0, cat["advantages"] / w.clamp(min=1e-12), torch.zeros_like(w))  # (B,) unfolded
    want, _ = core.policy_loss(logp=lp, old_logp=old, advantages=adv, mask=cat["completion_mask"].bool(), weights=w,
                               eps_low=0.2, eps_high=0.28)
    grad = torch.autograd.grad(want, params, allow_unused=True)
    return {"hand_loss": float(want), "hand_grad": torch.cat([(g if g is not None else torch.zeros_like(p)).reshape(-1)
                                                              for g, p in zip(grad, params)])}


def refuse(cases: str, out: str) -> None:
    """Each case of the JSON file {name: argv} through graft_trl.main, in this process, its stderr kept per case,
    with TRL's __init__ replaced by a failure (each refusal must come before the model loads); the exit codes and
    stderr go to OUT.rank<R>.json. The last case runs again as the command would: its exit ends the process."""
    import contextlib
    import io
    import time

    import trl
    cases = json.loads(Path(cases).read_text())
    real_init, real_sleep = trl.GRPOTrainer.__init__, time.sleep
    trl.GRPOTrainer.__init__ = lambda *a, **k: print("MODEL LOADED", file=sys.stderr)  # a refusal came too late
    time.sleep = lambda s: None  # rank 1's wait for rank 0's line: only the last case needs it
    seen = {}
    for name, argv in cases.items():
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            try:
                graft_trl.main(argv)
                code = 0
            except SystemExit as e:
                code = e.code
        seen[name] = [code, err.getvalue()]
    Path(f"{out}.rank{os.environ.get('RANK', 0)}.json").write_text(json.dumps(seen))
    trl.GRPOTrainer.__init__, time.sleep = real_init, real_sleep
    deadline = time.time() + 60
    while os.environ.get("RANK", "0") == "0" and not Path(f"{out}.rank1.json").exists() and time.time() < deadline:
        time.sleep(0.1)  # rank 0's exit makes torchrun stop rank 1: let it write its file first
    graft_trl.main(list(cases.values())[-1])


def main(model: str, out: str, layouts: str = "") -> None:
    torch.set_num_threads(1)
    chosen = [tuple(int(x) for x in sa.split(",")) for sa in layouts.split(";") if sa] or LAYOUTS
    result = {f"{S},{A},{R}": run_layout(Path(model), Path(out), S, A, R) for S, A, R in chosen}
    if not dist.is_initialized() or dist.get_rank() == 0:
        torch.save(result, out)


def compare(one: str, two: str) -> None:
    """Print, per layout and optimizer step, the relative differences two processes vs one and one vs hand Eq. 10
    (loss relative to max(|hand loss|, 1e-3): a step of own mixed groups at ratio 1 has a loss near 0)."""
    one, two = torch.load(one), torch.load(two)
    print("S,A,R step | loss (1 proc) | loss 2 vs 1 | grad 2 vs 1 | update 2 vs 1 | loss 1 vs hand | grad 1 vs hand")
    for key, run in one.items():
        for k, (a, b) in enumerate(zip(run["steps"], two[key]["steps"])):
            scale = max(abs(a["hand_loss"]), 1e-3)
            rel = lambda x, y: float((x - y).norm() / y.norm())  # noqa: E731
            print(f"{key} {k} | {a['loss']:.5f} | {abs(a['loss'] - b['loss']) / scale:.1e} | "
                  f"{rel(b['grad'], a['grad']):.1e} | {rel(b['update'], a['update']):.1e} | "
                  f"{abs(a['loss'] - a['hand_loss']) / scale:.1e} | {rel(a['grad'], a['hand_grad']):.1e}")


if __name__ == "__main__":
    {"compare": compare, "refuse": refuse}.get(sys.argv[1], lambda *a: main(sys.argv[1], *a))(*sys.argv[2:])
