"""Tests of tools/graft_trl.py against TRL itself: TRL's own _compute_loss on the micro-batches our _prepare_inputs
cuts equals core.policy_loss (Eq. 10) in value and gradient in every layout it accepts, and every layout it
refuses is one where stock TRL is off; peer-last survives TRL's minibatching; two GRAFT steps run end to end
on a tiny receiver with the real Qwen3 tokenizer, reading a peer log that this project's trainer wrote with
SmolLM3's, and on a planted step its rows, weights and loss equal this project's graft_rows and Trainer.update.
The command line as a user meets it: each bad input one line on stderr, exit code 2, before the model loads (TRL's
__init__ patched to fail if reached), on one process and under torchrun (rank 0 alone); a reward's non-number
named; the reward under its wall-time limit; --help opening on GRAFT's flags and the log format; README's command
run as written on CPU with the tiny preset's models (B receiving A's rollouts) accepting peer rows, and the gate's
warning, with its cause and figures, when the template is not the peer's. The log completed and the user's
choices: --peer_model's lbar against a plain forward and under the run's chat template kwargs and temperature
(the receiver as its own peer: s = 1), the success rule (a format bonus that passes everything warns), a peer row
without EOS masked as TRL masks its own, and a conversational dataset whose reward reads TRL's message form. Also
the porting helpers of core.py and the one peer-log parser. CPU, tiny models, fp32 (TRL's bf16 default would round
lbar).

Run: python -m pytest -q tests/test_trl.py   (needs TRL: pip install trl==1.16.0, as .ci/run does)
"""

from __future__ import annotations

import json
import math
import os
import warnings
from pathlib import Path

import pytest
import torch

import core
from exchange import load_rollouts
from test_graft import SHARED, make_tiny_model, write_prompts

torch.set_num_threads(1)

# ------------------------------------------------------------------------------------------------
# core.py's porting helpers (no TRL needed)
# ------------------------------------------------------------------------------------------------


def test_fold_weights_is_policy_loss_through_a_plain_token_mean():
    g = torch.Generator().manual_seed(0)
    B, T = 6, 5
    mask = torch.arange(T)[None] < torch.tensor([5, 3, 4, 2, 5, 1])[:, None]  # (B, T)
    old = -torch.rand(B, T, generator=g) * 2
    new = (old + 0.4 * torch.randn(B, T, generator=g)).requires_grad_(True)
    adv, w = torch.randn(B, generator=g), torch.tensor([1.0, 0.0, 0.9, 1.0, 0.0, 0.85])
    loss, _ = core.policy_loss(logp=new, old_logp=old, advantages=adv, mask=mask, weights=w)
    a, m = core.fold_weights(advantages=adv, weights=w, mask=mask.long())
    assert m.dtype == torch.long and m[1].sum() == 0 and m[4].sum() == 0 and torch.equal(m[0], mask[0].long())
    ratio = torch.exp(new - old)
    per_tok = -torch.minimum(ratio * a[:, None], ratio.clamp(0.8, 1.28) * a[:, None])
    plain = (per_tok * m).sum() / m.sum()
    torch.testing.assert_close(plain, loss)
    torch.testing.assert_close(torch.autograd.grad(plain, new)[0], torch.autograd.grad(loss, new)[0])


def test_peer_last_rows_expands_minibatch_order():
    is_peer = torch.tensor([False, True, False, True, False, False])
    for gen in (None, torch.Generator().manual_seed(3)):
        state = None if gen is None else gen.get_state()
        rows = core.peer_last_rows(is_peer, 3, generator=gen)
        if gen is not None:
            gen.set_state(state)
        mbs = core.minibatch_order(is_peer, 2, generator=gen)
        assert rows.tolist() == [g * 3 + i for mb in mbs for g in mb.tolist() for i in range(3)]
        assert sorted(rows.tolist()) == list(range(18))
        assert all(not is_peer[r // 3] for r in rows[:12]) and all(is_peer[r // 3] for r in rows[12:])


def test_retokenize_group_pads_and_drops_long_rows(tmp_path):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(make_tiny_model(tmp_path / "m"))
    ids, mask, too_long, lost = core.retokenize_group(["1+2", "12345678", "", "9"], [True, False, False, False],
                                                      tok, max_response_tokens=5, pad_token_id=0)
    assert too_long == [1, 2] and lost == []  # counted as score_received counts them
    assert ids.shape == mask.shape == (4, 4)
    assert ids[0].tolist() == core.retokenize("1+2", True, tok, max_response_tokens=5) and mask[0].all()
    assert not mask[1].any() and not mask[2].any() and (ids[1] == 0).all()  # too long; empty
    assert mask[3].tolist() == [True, False, False, False]


def test_read_peer_records_groups_dedups_and_names_the_line():
    recs = [(1, {"problem_id": "a", "response": "x", "lbar": -1.0}), (2, {"id": 7, "completion": "y", "eos": False}),
            (4, {"problem_id": "a", "response": "z", "mean_logprob": -2.5}), (5, {"problem_id": "a", "response": "x"})]
    groups = core.read_peer_records(recs)
    assert list(groups) == ["a", "7"]
    assert groups["a"].texts == ["x", "z"] and groups["a"].lbar.tolist() == [-1.0, -2.5]  # line 5 repeats line 1
    assert groups["7"].eos.tolist() == [False] and math.isnan(groups["7"].lbar.item())
    for bad, msg in [({"response": "x"}, "needs a problem id"),
                     ({"problem": "q", "response": "x"}, "needs a prompt id"),
                     ({"id": "a", "response": 3}, "response or completion must be a string"),
                     ({"id": "a", "response": "x", "lbar": -100.0}, "lbar or mean_logprob must be a finite number"),
                     ({"id": "a", "response": "x", "lbar": -45.0, "num_tokens": 30}, "implausible as a mean .*-1.5"),
                     ({"id": "a", "response": "x", "lbar": -20.5}, "implausible as a mean"),
                     ({"id": "a", "response": "x", "eos": "yes"}, "'eos'"), ([1], "JSON object")]:
        with pytest.raises(ValueError, match=f"f.jsonl:9: .*{msg}"):
            core.read_peer_records([(9, bad)], where="f.jsonl")


# ------------------------------------------------------------------------------------------------
# TRL's own loss in every layout
# ------------------------------------------------------------------------------------------------

try:
    import trl

    from tools import graft_trl
except ImportError:  # TRL is optional, like W&B: only the tests below need it
    trl = graft_trl = None
try:
    import peft
except ImportError:  # only the LoRA test needs it
    peft = None
ROOT = Path(__file__).resolve().parent.parent  # the repository root
needs_trl = pytest.mark.skipif(trl is None,
                               reason="TRL is not installed (pip install trl==1.16.0; .ci/run installs it)")

N, G, PROMPT, T = 4, 4, 3, 6  # rollouts per prompt, prompts per generation batch, prompt and completion lengths
PEER_GROUPS = (1, 3)  # the replaced groups of the planted batch


@pytest.fixture(scope="module")
def recv(tmp_path_factory):
    d = tmp_path_factory.mktemp("trl")
    make_tiny_model(d / "m", "llama", 0, 1)
    write_prompts(d / "p.jsonl", 4)
    (d / "log.jsonl").write_text(json.dumps({"id": "p0", "response": "1", "lbar": -1.0}) + "\n")
    return d


def config(d: Path, **kw):
    base = dict(output_dir=str(d / "out"), peer_log=str(d / "log.jsonl"), num_generations=N, bf16=False, use_cpu=True,
                report_to="none", save_strategy="no", max_completion_length=T, per_device_train_batch_size=G * N)
    return graft_trl.GraftConfig(**(base | kw))


def zero(completions, **_):
    return [0.0] * len(completions)  # the planted batches carry their own advantages


def make_trainer(d: Path, reward_funcs=(zero,), data=None, peft_config=None, **kw):
    from datasets import Dataset
    if data is None:
        data = Dataset.from_list([{"id": f"p{i}", "prompt": f"{i}+{i + 1}=", "answer": str(2 * i + 1)}
                                  for i in range(4)])
    return graft_trl.GraftGRPOTrainer(model=str(d / "m"), reward_funcs=list(reward_funcs), args=config(d, **kw),
                                      train_dataset=data, peft_config=peft_config)


def planted_batch(tr) -> tuple[dict, dict]:
    """A generation batch as _generate_and_score_completions leaves it (w folded in), and the unfolded rows."""
    g = torch.Generator().manual_seed(1)
    B = G * N
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None] < lengths[:, None]).long()  # (B, T)
    ids = torch.randint(2, 40, (B, T), generator=g) * mask
    prompt = torch.randint(2, 40, (B, PROMPT), generator=g)
    is_peer = torch.tensor([r // N in PEER_GROUPS for r in range(B)])
    w = torch.where(is_peer, torch.tensor([0.9, 0.0, 1.0, 0.85] * G), torch.ones(B))  # (B,) two rows removed
    adv = torch.randn(B, generator=g)
    with torch.no_grad():
        lp = logprobs(tr.model, prompt, ids, mask)
    old = lp + 0.3 * torch.randn(B, T, generator=g)  # ratios on both sides of the clip
    a, m = core.fold_weights(advantages=adv, weights=w, mask=mask)
    batch = {"prompt_ids": prompt, "prompt_mask": torch.ones_like(prompt), "completion_ids": ids, "completion_mask": m,
             "advantages": a, "old_per_token_logps": old, "num_items_in_batch": mask.sum(), "graft_is_peer": is_peer,
             "graft_weight": w, "row": torch.arange(B)}
    return batch, {"mask": mask.bool(), "adv": adv, "w": w, "old": old, "ids": ids, "prompt": prompt}


def logprobs(model, prompt, ids, mask):
    """Plain per-token log-probs of the completions: one forward, no padding on the left."""
    attention = torch.cat([torch.ones_like(prompt), mask], 1)  # (B, P + T)
    logits = model(input_ids=torch.cat([prompt, ids], 1), attention_mask=attention).logits
    logits = logits[:, prompt.shape[1] - 1: -1].float()  # (B, T) positions that predict the completion
    return torch.log_softmax(logits, -1).gather(-1, ids[..., None]).squeeze(-1)


def trl_micro_batches(tr, batch, monkeypatch) -> list[dict]:
    """TRL's buffering path (_prepare_inputs over S training steps) with the planted generation batch."""
    monkeypatch.setattr(tr, "_generate_and_score_completions", lambda inputs: dict(batch))
    tr.model.train()
    tr._buffered_inputs = None
    out = []
    for step in range(tr.args.steps_per_generation):
        tr._step = step
        out.append(tr._prepare_inputs([{}]))
    return out


def grads(model) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])


LAYOUTS = [(1, 1), (2, 1), (2, 2), (4, 2)]  # (steps_per_generation, gradient_accumulation_steps)


@needs_trl
@pytest.mark.parametrize("loss_type", ["dapo", "bnpo"])
@pytest.mark.parametrize("S,A", LAYOUTS)
def test_trl_compute_loss_is_eq10_in_every_layout(recv, monkeypatch, S, A, loss_type):
    """Per optimizer step: the sum of TRL's _compute_loss over its A micro-batches (cut by our _prepare_inputs)
    equals core.policy_loss over the same rows with w unfolded, in value and gradient, fp32, clip active."""
    check_layout(recv, monkeypatch, S, A, loss_type)


@needs_trl
@pytest.mark.skipif(peft is None, reason="peft is not installed (pip install peft; .ci/run installs it)")
@pytest.mark.parametrize("S,A", [(2, 1), (4, 2)])
def test_a_lora_receiver_is_eq10_exactly(recv, monkeypatch, S, A):
    """The same with a LoRA receiver (peft, through GRPOTrainer's peft_config): its adapters' gradient, B
    initialised at random so that A's gradient is not zero."""
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    check_layout(recv, monkeypatch, S, A, "dapo", peft_config=lora)


def check_layout(recv, monkeypatch, S, A, loss_type, peft_config=None):
    kw = dict(steps_per_generation=S, gradient_accumulation_steps=A, per_device_train_batch_size=G * N // S,
              loss_type=loss_type)
    if loss_type == "bnpo" and A > 1:
        with pytest.raises(ValueError, match="loss_type='bnpo' with gradient_accumulation_steps=2"):
            graft_trl.check_args(config(recv, **kw))
        kw["loss_type"] = "dapo"  # built as dapo, then run as stock TRL's bnpo: off, which is why it is refused
    tr = make_trainer(recv, peft_config=peft_config, **kw)
    if peft_config is not None:
        trained = [name for name, p in tr.model.named_parameters() if p.requires_grad]
        assert isinstance(tr.model, peft.PeftModel) and trained and all("lora_" in x for x in trained)
    tr.loss_type = loss_type
    batch, ref = planted_batch(tr)
    micro = trl_micro_batches(tr, batch, monkeypatch)
    tr.current_gradient_accumulation_steps = A  # what transformers' loop sets for each accumulation window
    peer_steps, worst = [], 0.0
    for k in range(S // A):
        tr.model.zero_grad()
        loss = sum(tr._compute_loss(tr.model, mb) for mb in micro[k * A: (k + 1) * A])
        loss.backward()
        got_loss, got_grad = float(loss), grads(tr.model)
        with torch.no_grad():  # stock TRL's count: the whole batch's tokens, counted before the w = 0 rows left
            stock = float(sum(tr._compute_loss(tr.model, mb | {"num_items_in_batch": ref["mask"].sum()})
                              for mb in micro[k * A: (k + 1) * A]))
        rows = torch.cat([mb["row"] for mb in micro[k * A: (k + 1) * A]])  # (A * bs,) this optimizer step's rows
        tr.model.zero_grad()
        lp = logprobs(tr.model, ref["prompt"][rows], ref["ids"][rows], ref["mask"][rows].long())
        want, _ = core.policy_loss(logp=lp, old_logp=ref["old"][rows], advantages=ref["adv"][rows],
                                   mask=ref["mask"][rows], weights=ref["w"][rows], eps_low=0.2, eps_high=0.28)
        want.backward()
        want_grad = grads(tr.model)
        worst = max(worst, abs(got_loss - float(want)) / abs(float(want)),
                    float((got_grad - want_grad).norm() / want_grad.norm()))
        if tr.loss_type == "dapo":
            assert abs(stock - float(want)) > 1e-3 * abs(float(want)), "stock TRL's token count would do"
        peer_steps.append(bool(batch["graft_is_peer"][rows].any()))
        groups = set((rows // N).tolist())
        assert all(set(range(g * N, g * N + N)) <= set(rows.tolist()) for g in groups), "a group straddles steps"
    if loss_type == "bnpo" and A > 1:
        assert worst > 1e-3  # stock bnpo divides each micro-batch by its own tokens
        return
    assert worst < 1e-5, f"S={S} A={A} {loss_type}: relative difference {worst:.2e}"
    # Peer-last: every optimizer step holding a peer row comes after every own-only one.
    assert peer_steps == sorted(peer_steps) and peer_steps[-1]


@needs_trl
def test_stock_trl_shuffle_spreads_peer_rows_which_ours_keeps_last(recv, monkeypatch):
    tr = make_trainer(recv, steps_per_generation=2, per_device_train_batch_size=G * N // 2)
    batch, _ = planted_batch(tr)
    monkeypatch.setattr(tr, "_generate_and_score_completions", lambda inputs: dict(batch))
    tr.model.train()
    torch.manual_seed(0)
    spread = []
    for step in range(2):  # TRL's own _prepare_inputs: shuffle, then split
        tr._step, tr._buffered_inputs = step, None if step == 0 else tr._buffered_inputs
        spread.append(int(trl.GRPOTrainer._prepare_inputs(tr, [{}])["graft_is_peer"].sum()))
    assert all(s > 0 for s in spread)  # peer rows in both minibatches: peer-last lost
    ours = [int(mb["graft_is_peer"].sum()) for mb in trl_micro_batches(tr, batch, monkeypatch)]
    assert ours == [0, 2 * N]


@needs_trl
@pytest.mark.parametrize("setting,msg", [
    (dict(loss_type="grpo"), "loss_type='grpo'"), (dict(delta=2.0), "delta=2.0 is TRL's cap"),
    (dict(beta=0.04), "beta=0.04"), (dict(num_iterations=2), "num_iterations=2"),
    (dict(steps_per_generation=1, gradient_accumulation_steps=2, per_device_train_batch_size=8),
     "steps_per_generation=1 is not a multiple"),
    (dict(per_device_train_batch_size=2, steps_per_generation=8), "would straddle optimizer steps"),
    (dict(importance_sampling_level="sequence"), "importance_sampling_level"),
    (dict(top_entropy_quantile=0.5), "top_entropy_quantile"), (dict(scale_rewards="batch"), "scale_rewards"),
    (dict(peer_log=""), "peer_log is empty"), (dict(max_completion_length=None), "max_completion_length=None"),
])
def test_what_cannot_be_exact_is_refused_naming_the_setting(recv, setting, msg):
    with pytest.raises(ValueError, match=msg):
        graft_trl.check_args(config(recv, **setting))


@needs_trl
def test_layouts_over_processes_bnpo_refused_a_group_across_processes_accepted(recv, monkeypatch):
    args, dapo = config(recv, loss_type="bnpo"), config(recv)  # built before WORLD_SIZE is set: they set up devices
    small = config(recv, per_device_train_batch_size=2, steps_per_generation=2)
    graft_trl.check_args(args)  # one process, A = 1: exact
    with pytest.raises(ValueError, match="per_device_train_batch_size \\* gradient_accumulation_steps \\* processes = "
                                         "2 is not a multiple of num_generations=4"):
        graft_trl.check_args(small)  # one process: an optimizer step of 2 rows would cut a group
    monkeypatch.setenv("WORLD_SIZE", "2")  # as torchrun sets it for a 2-process launch
    with pytest.raises(ValueError, match="loss_type='bnpo' with gradient_accumulation_steps=1 and 2 processes"):
        graft_trl.check_args(args)
    graft_trl.check_args(dapo)  # dapo: two processes are exact (test_two_processes_equal_one_...)
    graft_trl.check_args(small)  # TRL's per-device batch 2 with 4 generations: one group over both processes


@needs_trl
def test_bf16_warns_once_when_a_gate_sits_within_its_rounding(recv):
    tr = make_trainer(recv)
    lbar_recv = torch.tensor([-4.0, -4.0, -4.0])  # s = 0.8 e^0.001 (within 2^-8 x 4 of delta), 0.8 e^0.5, 0.8 e^-0.5
    lbar_src = lbar_recv - math.log(0.8) - torch.tensor([0.001, 0.5, -0.5])
    w = core.compatibility_weights(lbar_recv=lbar_recv, lbar_src=lbar_src, delta=0.8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tr.check_precision(lbar_recv, lbar_src, w)  # fp32: nothing to say
    assert not [x for x in caught if "graft_trl" in str(x.message)]
    tr.args.bf16 = True
    with pytest.warns(UserWarning, match="bf16 is on and 1 peer responses have s within bf16's rounding of "
                                         "graft_delta=0.8 \\(1 of them accepted\\)"):
        tr.check_precision(lbar_recv, lbar_src, w)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tr.check_precision(lbar_recv, lbar_src, w)  # once
    assert not [x for x in caught if "graft_trl" in str(x.message)]


@needs_trl
def test_two_processes_equal_one_and_a_hand_eq10(recv, tmp_path):
    """Trainer.train() on two generation batches per layout, under torchrun with two CPU processes (gloo) and in one
    process on the same global batch (tests/trl_ranks.py, sampling planted, prompts of different lengths): per
    optimizer step the summed loss, the gradient the optimizer steps on and the update it makes are equal, and the
    one-process ones equal a hand Eq. 10 of the step's rows, in every layout of the one-process table and in TRL's
    per-device batch 2 with 4 generations (a group spanning the two processes)."""
    import subprocess
    import sys
    sys.path.insert(0, str(ROOT / "tests"))
    import trl_ranks
    env = os.environ | {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                          "tests/trl_ranks.py", str(recv / "m"), str(tmp_path / "two.pt")],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert two.returncode == 0, two.stderr[-3000:]
    two = torch.load(tmp_path / "two.pt")
    (tmp_path / "one").mkdir()
    for S, A, R in trl_ranks.LAYOUTS:
        one = trl_ranks.run_layout(recv / "m", tmp_path / "one" / "x", S, A, R)
        key, selected = f"{S},{A},{R}", [2.0, 2.0] if R * S == G * N else [1.0, 0.0]  # R = 4, S = 1: p0, then p1
        assert len(one["steps"]) == 2 * S // A and one["selected"] == two[key]["selected"] == selected
        for k, a in enumerate(one["steps"]):
            scale = max(abs(a["hand_loss"]), 1e-3)  # a step of own mixed groups at ratio 1 has a loss near 0
            assert abs(a["loss"] - a["hand_loss"]) / scale < 1e-4
            assert float((a["grad"] - a["hand_grad"]).norm() / a["hand_grad"].norm()) < 1e-4
            b = two[key]["steps"][k]
            assert abs(a["loss"] - b["loss"]) / scale < 1e-4, f"{key} step {k}"
            assert float((a["grad"] - b["grad"]).norm() / a["grad"].norm()) < 1e-4, f"{key} step {k}"
            assert float((a["update"] - b["update"]).norm() / a["update"].norm()) < 1e-4, f"{key} step {k}"


# ------------------------------------------------------------------------------------------------
# End to end: a tiny Qwen3-tokenizer receiver in TRL, a peer log this project's trainer wrote with SmolLM3's
# ------------------------------------------------------------------------------------------------

needs_shared = pytest.mark.skipif(not (SHARED / "tokenizers" / "smollm3").is_dir(),
                                  reason="needs ../shared/tokenizers (the real Qwen3 and SmolLM3 tokenizers)")


def tiny_with_real_tokenizer(path: Path, name: str, seed: int) -> Path:
    """A one-layer random causal LM over a real tokenizer's whole vocabulary, saved with the tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3Config
    tok = AutoTokenizer.from_pretrained(SHARED / "tokenizers" / name)
    cfg = Qwen3Config(vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=1, head_dim=8,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
                      tie_word_embeddings=True, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                      bos_token_id=None)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """This project's trainer as the peer (SmolLM3 tokenizer): one step, its rollout file is the peer log."""
    import graft
    d = tmp_path_factory.mktemp("pair")
    write_prompts(d / "p.jsonl", G)
    tiny_with_real_tokenizer(d / "peer", "smollm3", 1)
    tiny_with_real_tokenizer(d / "recv", "qwen3", 0)
    graft.Trainer(graft.Config(model=str(d / "peer"), name="b", prompts=str(d / "p.jsonl"), out=str(d / "peer_run"),
                               steps=1, prompts_per_step=G, n=N, minibatches=1, max_response_tokens=6,
                               prompt_template="{problem}=", lr=1e-3, threads=1)).fit()
    log = d / "peer_run" / "exchange" / "b"
    peer, _ = load_rollouts(log / "step_000000.safetensors")
    # The verdict: two of the peer's groups are mixed (Eq. 4), two fail; nothing the receiver samples passes.
    mixed = {peer.prompt_ids[0]: [0, 2], peer.prompt_ids[2]: [1]}
    passing = {peer.texts[g * N + i] for g, pid in enumerate(peer.prompt_ids) for i in mixed.get(pid, [])}
    return d, log, peer, passing, set(mixed)


def fake_verify(passing):
    return lambda responses, golds, workers=0, **kw: [1.0 if r in passing else 0.0 for r in responses]


def dataset(d: Path):
    from datasets import Dataset
    rows = [json.loads(s) for s in (d / "p.jsonl").read_text().splitlines()]
    return rows, Dataset.from_list([{"id": r["id"], "prompt": r["problem"] + "=", "answer": r["answer"]} for r in rows])


def recv_trainer(d: Path, log: Path, **kw):
    base = dict(output_dir=str(d / "trl"), peer_log=str(log), num_generations=N, bf16=False, use_cpu=True,
                report_to="none", save_strategy="no", per_device_train_batch_size=8, steps_per_generation=2,
                max_completion_length=16, learning_rate=1e-3, seed=0, logging_steps=1)
    args = graft_trl.GraftConfig(**(base | kw))
    reward = graft_trl.reward_function("verify:verify_batch")  # the planted verdicts replace verify_batch
    return graft_trl.GraftGRPOTrainer(model=str(d / "recv"), reward_funcs=[reward], args=args,
                                      train_dataset=dataset(d)[1])


@needs_trl
@needs_shared
def test_two_graft_steps_in_trl_end_to_end_peer_last(pair, monkeypatch):
    import verify
    d, log, peer, passing, mixed = pair
    monkeypatch.setattr(verify, "verify_batch", fake_verify(passing))
    tr = recv_trainer(d, log, max_steps=4)  # 2 generation batches x 2 optimizer steps
    seen = []
    compute = tr._compute_loss
    monkeypatch.setattr(tr, "_compute_loss", lambda model, mb: seen.append(mb["graft_is_peer"].view(-1, N)[:, 0]) or
                        compute(model, mb))
    before = [p.detach().clone() for p in tr.model.parameters()]
    tr.train()
    # Peer-last through TRL's loop: each generation batch's second minibatch holds exactly the two grafted groups.
    assert [mb.tolist() for mb in seen] == [[False, False], [True, True]] * 2
    logs = [x for x in tr.state.log_history if "graft/selected" in x]
    assert [x["graft/selected"] for x in logs] == [2.0] * 2 and all(x["graft/all_fail"] == 4.0 for x in logs)
    assert all(x["graft/accepted"] + x["graft/rejected"] == 2 * N for x in logs)
    assert all(math.isfinite(x["loss"]) for x in tr.state.log_history if "loss" in x)
    assert any(not torch.equal(a, b) for a, b in zip(before, tr.model.parameters()))  # the optimizer moved it


@needs_trl
@needs_shared
def test_planted_step_rows_weights_and_loss_equal_the_trainers(pair, monkeypatch, tmp_path):
    """One planted step (the project's own rollouts fed to TRL): received groups, peer rows, weights, folded
    advantages, the receiver's old log-probs of the peer tokens, and the step's token-mean loss equal
    graft.py's rule phases and Trainer.update (optimizer step disabled, so every minibatch sees one policy)."""
    import graft
    import verify
    d, log, peer, passing, mixed = pair
    monkeypatch.setattr(verify, "verify_batch", fake_verify(passing))
    from transformers import AutoTokenizer
    qwen = AutoTokenizer.from_pretrained(d / "recv")
    longest = max(len(qwen.encode(peer.texts[g * N + i], add_special_tokens=False)) + int(peer.eos[g, i])
                  for g, pid in enumerate(peer.prompt_ids) if pid in mixed for i in range(N))
    limit = longest - 1  # the longest received response no longer fits: dropped by both
    ours = graft.Trainer(graft.Config(model=str(d / "recv"), prompts=str(d / "p.jsonl"), out=str(tmp_path / "run"),
                                      peer_log=str(log), steps=1, prompts_per_step=G, n=N, minibatches=2,
                                      max_response_tokens=limit, prompt_template="{problem}=", lr=1e-3, threads=1))
    rows = graft.batch_indices(G, 0, G, 0)
    own, _, _ = ours.rollout(0, rows)
    peers, _ = ours.wait_for_peers(0, own)  # the trainer's phases of step 0, in its order
    prompts, v = [ours.prompt_ids[i] for i in rows], ours.variant
    selected, m, _ = v.select(ours.ctx, 0, own, peers)
    received, m_score, _ = v.score(ours.ctx, 0, prompts, peers, selected)
    built, m_rows, _ = v.rows(ours.ctx, prompts, own, peers, selected, received, {})
    train_rows, replaced = built.rows, built.replaced
    m |= m_score | m_rows
    assert m["dropped_length"] >= 1

    tr = recv_trainer(d, log, max_completion_length=limit)
    by_text = {r["problem"] + "=": g for g, r in ((g, dataset(d)[0][i]) for g, i in enumerate(rows))}

    def planted_generate(prompts):  # the project's own rollouts in place of TRL's sampling
        prompt_ids = tr._tokenize_prompts(prompts)[0]
        flat = [by_text[p] * N + i % N for i, p in enumerate(prompts)]
        return prompt_ids, [own.tokens[r] for r in flat], None, [own.texts[r] for r in flat], None, {}, None, None

    monkeypatch.setattr(tr, "_generate", planted_generate)
    tr.model.train()
    tr._step = 0
    inputs = [dataset(d)[0][i] | {"prompt": dataset(d)[0][i]["problem"] + "="} for i in rows for _ in range(N)]
    out = tr._generate_and_score_completions(inputs)
    assert [tr._tokenize_prompts([x["prompt"]])[0][0] for x in inputs[::N]] == [ours.prompt_ids[i] for i in rows]

    is_peer = out["graft_is_peer"].view(G, N)[:, 0]
    assert torch.equal(is_peer, replaced) and int(replaced.sum()) == 2
    lengths = out["completion_mask"].sum(1)
    trl_rows = {(b // N, tuple(out["completion_ids"][b, : lengths[b]].tolist())): b
                for b in range(G * N) if out["graft_is_peer"][b] and out["graft_weight"][b] > 0}
    proj_rows = {(r.group, tuple(r.response)): r for r in train_rows if r.is_peer}
    assert trl_rows.keys() == proj_rows.keys() and m["accepted"] == len(trl_rows) > 0
    for key, b in trl_rows.items():
        r = proj_rows[key]
        assert float(out["graft_weight"][b]) == pytest.approx(r.weight, rel=1e-5)
        assert float(out["advantages"][b]) == pytest.approx(r.adv * r.weight, rel=1e-5, abs=1e-7)
        torch.testing.assert_close(out["old_per_token_logps"][b, : lengths[b]], r.old_logp, rtol=1e-5, atol=1e-5)

    ours.opt.step = lambda *a, **k: None  # every minibatch sees the same policy, as below
    live: dict[int, set] = {}  # the trainer's minibatches: groups of the rows it runs forward (a != 0)
    minibatch_loss = ours.minibatch_loss
    monkeypatch.setattr(ours, "minibatch_loss", lambda rows_, d_, k: live.setdefault(k, set()).update(
        r.group for r in rows_) or minibatch_loss(rows_, d_, k))
    want = ours.update(0, train_rows, replaced)
    tr.current_gradient_accumulation_steps = 1
    micro = tr.peer_last_minibatches(out | {"row": torch.arange(G * N)})
    assert live == {k: set((mb["row"][mb["advantages"] != 0] // N).tolist()) for k, mb in enumerate(micro)
                    if bool((mb["advantages"] != 0).any())}
    with torch.no_grad():
        parts = [(float(tr._compute_loss(tr.model, mb)), float(mb["completion_mask"].sum())) for mb in micro]
    got = sum(loss * tokens for loss, tokens in parts) / sum(tokens for _, tokens in parts)
    assert got == pytest.approx(want["pg/loss"], rel=1e-5) and want["pg/loss"] != 0
    assert want["peer_minibatches"] == sum(bool(mb["graft_is_peer"].any()) for mb in micro) == 1


# ------------------------------------------------------------------------------------------------
# The command line: refusals are one line and exit code 2 before the model loads; --help; README's command
# ------------------------------------------------------------------------------------------------


def launch(recv: Path, tmp_path: Path, *extra: str, log: Path | None = None) -> list[str]:
    """A tiny run's flags, as a user types them (no --use_cpu, no --bf16: the launch line picks fp32 on CPU)."""
    return ["--model", str(recv / "m"), "--prompts", str(recv / "p.jsonl"),
            "--peer_log", str(log or recv / "log.jsonl"),
            "--prompt_template", "{problem}=", "--output_dir", str(tmp_path / "run"), "--num_generations", "4",
            "--per_device_train_batch_size", "8", "--max_completion_length", "4", "--max_steps", "1",
            "--report_to", "none", "--save_strategy", "no", *extra]


def refused(argv: list[str], capsys, monkeypatch) -> str:
    """graft_trl.main(argv) is refused: exit code 2, one line on stderr, no traceback, the model never loaded."""
    monkeypatch.setattr(trl.GRPOTrainer, "__init__", lambda *a, **k: pytest.fail("the model loaded first"))
    with pytest.raises(SystemExit) as e:
        graft_trl.main(argv)
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1 and err.startswith("graft_trl: error: "), err
    assert not Path(argv[argv.index("--output_dir") + 1]).exists()  # nothing written, not even the folder
    return err


LOG_LINES = {"none_match": [{"id": "zz", "response": "1", "lbar": -1.0}, {"id": "yy", "response": "2", "lbar": -1.0}],
             "summed": [{"id": "p0", "response": "1", "lbar": -1.0}, {"id": "p0", "response": "2", "lbar": -45.0,
                                                                      "num_tokens": 30}],
             "no_lbar": [{"id": "p1", "response": "1"}, {"id": "p1", "response": "2", "lbar": -1.0}],
             "wide": [{"id": "p0", "response": str(i), "lbar": -1.0} for i in range(N + 1)],
             "no_id": [{"problem": "0+1", "response": "1", "lbar": -1.0}],
             # sums of per-token log-probs (0.45 per token over characters + EOS), all above the -20 floor:
             "summed_short": [{"id": f"p{k % 4}", "response": "1" * k, "lbar": -0.45 * (k + 1)} for k in range(1, 13)],
             "summed_long": [{"id": f"p{k % 4}", "response": "7" * (20 * k), "lbar": -0.05 * (20 * k + 1)}
                             for k in range(1, 13)],
             "positive": [{"id": "p0", "response": "1", "lbar": 0.5}]}
BAD_REWARD = "def bad(responses, golds, *, workers=0):\n    return ['x' if r else 1.0 for r in responses]\n"


@needs_trl
@pytest.mark.parametrize("log,extra,msg", [
    (None, ["--peer_log", "/no/such/log.jsonl"], "peer_log '/no/such/log.jsonl': no such JSONL file"),
    (None, ["--id_column", "qq"], "id_column 'qq' is not a column of the train dataset .*set --id_column"),
    ("none_match", [], "none of its 2 prompt ids \\(e.g. 'zz'\\) is in the dataset's 'id' column \\(4 ids"),
    ("summed", [], "log.jsonl:2: field 'lbar' = -45 is implausible as a mean .*-1.5"),
    ("no_lbar", [], "log.jsonl:1: 1 matched records have no 'lbar': set --peer_model"),
    ("wide", [], f"set num_generations >= {N + 1}"),
    ("no_id", [], "log.jsonl:1: needs a prompt id"),
    ("bad_json", [], "log.jsonl:2: invalid JSON"),
    (None, ["--loss_type", "grpo"], "loss_type='grpo' is not one token-mean"),
    (None, ["--success_reward", "acc"], "success_reward names 'acc', which is no reward function .*\\(reward\\)"),
    (None, ["--num_generations", "3"], "divisible by num_generations"),
    (None, ["--graft_delta", "x"], "invalid float value: 'x'"),
    (None, ["--bogus", "1"], "not used by the HfArgumentParser"),
    ("summed_short", [], "log.jsonl': its lbar grows with the response's length \\(slope 1.00 .* over 12 records"),
    ("summed_long", [], "log.jsonl': its lbar grows with the response's length \\(slope 1.00 .* over 12 records"),
    ("positive", [], "log.jsonl:1: field lbar or mean_logprob must be a finite number in \\[-88, 0\\] .*got 0.5"),
    (None, ["--prompts", "EMPTY"], "--prompts: .*empty.jsonl: no prompts"),
    (None, ["--reward", "BAD_REWARD"], "--reward '.*bad.py:bad': the function must return a list of "
                                       "numbers \\(could not convert string to float: 'x'\\)"),
])
def test_command_line_refusals_are_one_line_exit_2_before_the_model(recv, tmp_path, capsys, monkeypatch, log, extra,
                                                                    msg):
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "bad.py").write_text(BAD_REWARD.replace("if r else 1.0", "if True else 1.0"))  # x for every answer
    extra = [{"EMPTY": str(tmp_path / "empty.jsonl"), "BAD_REWARD": f"{tmp_path / 'bad.py'}:bad"}.get(x, x)
             for x in extra]
    path = None
    if log is not None:
        path = tmp_path / "log.jsonl"
        path.write_text('{"id": "p0", "response": "1", "lbar": -1}\n{oops\n' if log == "bad_json" else
                        "".join(json.dumps(x) + "\n" for x in LOG_LINES[log]))
    import re
    assert re.search(msg, refused(launch(recv, tmp_path, *extra, log=path), capsys, monkeypatch))


def test_a_summed_lbar_is_told_by_its_slope_against_length_not_a_floor():
    g = torch.Generator().manual_seed(0)
    length = torch.randint(2, 300, (40,), generator=g).double()  # (40,)
    mean = -(0.2 + 1.5 * torch.rand(40, generator=g, dtype=torch.float64))  # (40,) per-token means
    assert abs(graft_trl.lbar_length_slope(mean, length)) < 0.2  # a log of means: no trend with length
    assert abs(graft_trl.lbar_length_slope(mean * length / 20, length) - 1) < 0.2  # sums, scaled to stay above -20
    assert graft_trl.lbar_length_slope(mean, torch.full((40,), 50.0)) is None  # one length: nothing to tell
    assert graft_trl.lbar_length_slope(mean[:7], length[:7]) is None  # too few records


@needs_trl
def test_a_reward_that_answers_no_number_mid_run_is_one_line_exit_2(recv, tmp_path, capsys):
    """A reward that passes the check before the model loads (it scores the empty response) and answers a string
    for a real completion (the peer log's, scored once the model is loaded): one line naming --reward and the
    value, exit code 2, no traceback, no checkpoint written."""
    (tmp_path / "bad.py").write_text(BAD_REWARD)
    argv = launch(recv, tmp_path, "--reward", f"{tmp_path / 'bad.py'}:bad")
    argv.remove("--save_strategy"), argv.remove("no")  # TRL's default: a checkpoint at the end of a run
    with pytest.raises(SystemExit) as e:
        graft_trl.main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and "Traceback" not in err, err
    err = [x for x in err.splitlines() if "graft_trl" in x]  # the model loaded: its progress bars came first
    assert len(err) == 1 and err[0] == (f"graft_trl: error: --reward '{tmp_path / 'bad.py'}:bad': the function must "
                                        f"return a list of numbers (could not convert string to float: 'x')")
    assert not list((tmp_path / "run").glob("checkpoint-*"))


@needs_trl
def test_the_launch_lines_reward_runs_under_its_wall_time_limit(tmp_path):
    """--reward_timeout as graft.py's --reward-timeout: a call that hangs is stopped at the limit, its share scores
    0 and the rest is scored (reward.rewards' worker pool); chat completions are scored by their message's text."""
    import time
    (tmp_path / "slow.py").write_text("import time\ndef slow(responses, golds, *, workers=0):\n"
                                      "    if 'hang' in responses:\n        time.sleep(60)\n"
                                      "    return [float(r == g) for r, g in zip(responses, golds)]\n")
    spec = f"{tmp_path / 'slow.py'}:slow"
    reward = graft_trl.reward_function(spec, timeout=1.0, workers=2)
    t0 = time.monotonic()
    assert reward(completions=["hang", "7"], answer=["7", "7"]) == [0.0, 1.0]  # two workers: one share each
    assert time.monotonic() - t0 < 10
    assert reward(completions=[[{"role": "assistant", "content": "7"}]], answer=["7"]) == [1.0]


@needs_trl
def test_a_python_reward_function_that_answers_no_number_is_named():
    def scored(completions, **_):
        return [0.5, "high"]
    checked = graft_trl.checked_reward(scored)
    assert checked.__name__ == "scored"  # TRL logs rewards/scored/mean, and success_reward names it so
    with pytest.raises(graft_trl.Refusal, match="reward function 'scored' returned 'high' \\(str\\) for completion 1"):
        checked(completions=["a", "b"])
    assert graft_trl.checked_reward(lambda completions, **_: [1, None, 0.5])(completions=[0, 1, 2]) == [1, None, 0.5]
    import functools

    class Judge:
        def __call__(self, completions, **_):
            return [1.0] * len(completions)
    assert [graft_trl.checked_reward(f).__name__ for f in (functools.partial(scored), Judge())] == ["scored", "Judge"]


@needs_trl
def test_under_torchrun_each_bad_input_is_one_line_from_rank_0_and_exit_2(recv, tmp_path):
    """Under `torchrun --nproc_per_node 2`, every bad input of the one-process test above that is checked before
    the model loads (tests/trl_ranks.py refuse: each through graft_trl.main in both processes, TRL's __init__
    replaced by a marker): exit code 2 on both ranks, one line from rank 0, nothing from rank 1. Then the last one
    as the command runs it: rank 0 exits 2 and its line is the only line of ours (rank 1 waits to let it speak and
    is stopped by torchrun); torchrun adds its own ChildFailedError report and exits 1, which no flag of torchrun
    turns off (torch/distributed/launcher/api.py raises ChildFailedError for any failed worker)."""
    import subprocess
    import sys
    cases = {}
    for name in ("none_match", "summed_short", "summed_long", "positive"):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in LOG_LINES[name]))
        cases[name] = launch(recv, tmp_path, log=tmp_path / f"{name}.jsonl")
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "bad.py").write_text(BAD_REWARD.replace("if r else 1.0", "if True else 1.0"))
    cases |= {"id_column": launch(recv, tmp_path, "--id_column", "qq"),
              "empty_prompts": launch(recv, tmp_path, "--prompts", str(tmp_path / "empty.jsonl")),
              "reward": launch(recv, tmp_path, "--reward", f"{tmp_path / 'bad.py'}:bad"),
              "missing_log": launch(recv, tmp_path, log=tmp_path / "no_such.jsonl")}
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    env = os.environ | {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                          "tests/trl_ranks.py", "refuse", str(tmp_path / "cases.json"), str(tmp_path / "seen")],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    ranks = [json.loads((tmp_path / f"seen.rank{r}.json").read_text()) for r in (0, 1)]
    for name in cases:
        (code0, err0), (code1, err1) = ranks[0][name], ranks[1][name]
        assert code0 == code1 == 2 and err1 == "" and "MODEL LOADED" not in err0, (name, ranks[0][name], err1)
        assert len(err0.strip().splitlines()) == 1 and err0.startswith("graft_trl: error: "), (name, err0)
    assert not (tmp_path / "run").exists()  # the cases' --output_dir: nothing written
    ours = [x for x in run.stderr.splitlines() if "graft_trl" in x or "tools/graft_trl.py" in x]
    assert ours == [ranks[0]["missing_log"][1].strip()], run.stderr[-3000:]
    assert "rank      : 0 (local_rank: 0)\n  exitcode  : 2" in run.stderr, run.stderr[-3000:]  # torchrun's report
    assert "Traceback" not in run.stderr.split("ChildFailedError")[0].rsplit("failed (exitcode", 1)[0]  # workers'


@needs_trl
def test_the_real_command_refuses_without_a_traceback(recv, tmp_path):
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-m", "tools.graft_trl", *launch(recv, tmp_path, "--id_column", "qq")],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines() == ["graft_trl: error: GraftConfig.id_column 'qq' is not a column of the "
                                               "train dataset (train_dataset: id, problem, answer, prompt); set "
                                               "--id_column to the column holding the log's prompt ids"]


@needs_trl
def test_help_opens_on_the_log_format_and_grafts_flags(capsys):
    with pytest.raises(SystemExit) as e:
        graft_trl.main(["--help"])
    lines = capsys.readouterr().out.splitlines()
    assert e.value.code == 0 and lines[0].startswith("usage: python -m tools.graft_trl --model M")
    at = {flag: next(i for i, x in enumerate(lines) if x.strip().startswith(flag))
          for flag in ("--model", "--peer_log", "--peer_model", "--success_reward", "--output_dir")}
    assert any("The stored peer (--peer_log)" in x for x in lines[: at["--model"]])
    assert any('"lbar" or "mean_logprob"' in x for x in lines[: at["--model"]])
    assert at["--model"] < at["--peer_log"] < at["--peer_model"] < at["--success_reward"] < at["--output_dir"] < 60


TINY = ROOT / "data" / "tiny_models"  # the tiny preset's committed models: A (characters), B (a 300-token BPE)
# Addition problems of the tiny preset's train split on which A's group was mixed and B's all-fail in a probe
# (8 samples each at T = 1): the prompts on which GRAFT has something to move from A into B.
TINY_PROMPTS = ("add-train-00031", "add-train-00025", "add-train-00009", "add-train-00003", "add-train-00013",
                "add-train-00024", "add-train-00023", "add-train-00014")


@pytest.fixture(scope="module")
def tiny_peer(tmp_path_factory):
    """The tiny preset's model A as the peer: one graft.py GRPO step on TINY_PROMPTS under the preset's template
    (tools/tiny.py's PROMPT_TEMPLATE), its rollout folder the peer log, its run.json beside it."""
    import graft
    from data.tiny_tasks import generate
    from tools.tiny import PROMPT_TEMPLATE
    d = tmp_path_factory.mktemp("tiny_peer")
    train, _ = generate(0, 400, 0)
    rows = [r for r in train if r["id"] in TINY_PROMPTS]
    (d / "p.jsonl").write_text("".join(json.dumps({k: r[k] for k in ("id", "problem", "answer")}) + "\n"
                                       for r in rows))
    graft.Trainer(graft.Config(model=str(TINY / "A"), name="a", prompts=str(d / "p.jsonl"), out=str(d / "runA"),
                               steps=1, prompts_per_step=len(rows), n=8, minibatches=1, max_response_tokens=64,
                               prompt_template=PROMPT_TEMPLATE, threads=1, save_every=100)).fit()
    return d, d / "runA" / "exchange" / "a"


def readme_command(**paths: str) -> list[str]:
    """README's TRL command as written, its paths replaced by paths' (flag name without -- -> value)."""
    import re
    import shlex
    readme = (ROOT / "README.md").read_text()
    words = shlex.split(re.search(r"`python -m tools\.graft_trl ([^`]*)`", readme).group(1))
    return [paths.get(words[i - 1][2:], w) if i and words[i - 1][2:] in paths else w for i, w in enumerate(words)]


SIZE = ["--per_device_train_batch_size", "64", "--max_completion_length", "64", "--report_to", "none",
        "--save_strategy", "no", "--logging_steps", "1"]  # a generation batch: the 8 prompts x 8 rollouts


@needs_trl
@pytest.mark.skipif(not (TINY / "B").is_dir(), reason="data/tiny_models (the committed tiny models) is absent")
def test_readmes_command_on_the_tiny_models_accepts_peer_rows(tiny_peer, tmp_path, capsys):
    """README's TRL command as written on CPU, B receiving from A's rollouts: the prompts are rendered as A sampled
    them (read from its run.json, said in one line), and the gate accepts peer rows, >= 1 per step on average."""
    d, log = tiny_peer
    argv = readme_command(model=str(TINY / "B"), prompts=str(d / "p.jsonl"), peer_log=str(log),
                          output_dir=str(tmp_path / "run"))
    assert "--use_cpu" not in argv and "--bf16" not in argv and "--prompt_template" not in argv
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tr = graft_trl.main(argv + SIZE + ["--max_steps", "2"])
    assert not [x for x in caught if "no peer row accepted" in str(x.message)]
    assert tr.state.global_step == 2 and tr.args.bf16 is False
    err = capsys.readouterr().err
    assert f"prompts rendered as the peer sampled them ({d / 'runA' / 'run.json'}): template '{{problem}}\\n'" in err
    accepted = [x["graft/accepted"] for x in tr.state.log_history if "graft/accepted" in x]
    assert len(accepted) == 2 and sum(accepted) / 2 >= 1, accepted


@needs_trl
@pytest.mark.skipif(not (TINY / "B").is_dir(), reason="data/tiny_models (the committed tiny models) is absent")
def test_the_peer_runs_settings_are_found_beside_its_rollout_folder_by_name_and_run_id(tiny_peer, tmp_path):
    """A single run (--out holds run.json and exchange/NAME) and a pair (exchange/NAME beside each side's --out):
    the run.json whose name is the folder's and whose run id is its files'; none for another run's or a JSONL."""
    import shutil
    d, log = tiny_peer
    record = json.loads((d / "runA" / "run.json").read_text())
    assert graft_trl.peer_run_settings(str(log)) == (record["settings"], str(d / "runA" / "run.json"))
    pair = tmp_path / "pair"
    shutil.copytree(log, pair / "exchange" / "a")
    for side, rid in (("A", "other"), ("B", record["run_id"]), ("C", record["run_id"])):  # C: the right run id
        (pair / side).mkdir(parents=True)
        name = "a" if side != "B" else "b"
        (pair / side / "run.json").write_text(json.dumps(record | {"run_id": rid, "name": name}))
    folder = str(pair / "exchange" / "a")
    assert graft_trl.peer_run_settings(folder) == (record["settings"], str(pair / "C" / "run.json"))
    (pair / "C" / "run.json").unlink()
    assert graft_trl.peer_run_settings(folder) == ({}, "")
    assert graft_trl.peer_run_settings(str(d / "p.jsonl")) == ({}, "")


@needs_trl
@pytest.mark.skipif(not (TINY / "B").is_dir(), reason="data/tiny_models (the committed tiny models) is absent")
def test_a_template_other_than_the_peers_warns_with_the_cause_and_the_numbers(tiny_peer, tmp_path):
    """The same command with another --prompt_template: a warning at start names both renderings, and after the
    first generation batch one line says no peer row was accepted, with s's median, the counts and the cause."""
    d, log = tiny_peer
    argv = readme_command(model=str(TINY / "B"), prompts=str(d / "p.jsonl"), peer_log=str(log),
                          output_dir=str(tmp_path / "run"))
    with pytest.warns(UserWarning) as caught:
        tr = graft_trl.main(argv + SIZE + ["--max_steps", "1", "--prompt_template", "Q: {problem} A:"])
    lines = [str(x.message) for x in caught if "graft_trl" in str(x.message)]
    assert any("the peer sampled prompt" in x and "this dataset gives 'Q: What is" in x for x in lines), lines
    gate = [x for x in lines if "no peer row accepted" in x]
    logged = tr.state.log_history[0]
    assert len(gate) == 1 and logged["graft/accepted"] == 0 and logged["graft/selected"] > 0
    rejected = int(logged["graft/rejected"])
    assert (f"no peer row accepted in generation batch 1: {int(logged['graft/selected'])} groups received, "
            f"{rejected} peer responses: s median 0.0" in gate[0]), gate[0]
    assert f"{rejected} gated (s <= delta)" in gate[0] and "Likely cause" in gate[0] and "template" in gate[0]


@needs_trl
def test_the_gate_watch_warns_after_the_first_batch_then_per_window_naming_the_cause(recv):
    """watch_gate on planted batches: a warning after generation batch 1 (if the receiver failed a prompt) and at
    the end of each graft_warn_every window whose batches accepted nothing (none when one did), its figures the
    window's sums and the median of its s values, its cause the first that holds: nothing all-fail, no mixed logged
    group, or the gate."""
    zero = {"all_fail": 0, "selected": 0, "accepted": 0, "groups": 4, "in_log": 0, "candidates": 0, "gated": 0,
            "too_long": 0, "no_eos": 0}
    unmixed = zero | {"all_fail": 2, "in_log": 1}
    gated = zero | {"all_fail": 2, "selected": 1, "in_log": 2, "candidates": 4, "gated": 3, "too_long": 1}

    def said(batches) -> list[list[str]]:  # a fresh trainer's warnings after each batch
        tr = make_trainer(recv, graft_warn_every=3)
        out = []
        for counts, s in batches:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                tr.watch_gate(counts, s)
            out.append([str(x.message) for x in caught if "graft_trl" in str(x.message)])
        return out
    head = "graft_trl: no peer row accepted in generation batch"
    run = said([(zero, [])] * 4 + [(gated | {"accepted": 1}, [0.9]), (gated, [0.1]), (gated, [0.3])])
    assert [len(x) for x in run] == [0, 0, 0, 1, 0, 0, 0]  # batch 1 solved everywhere: silent; 5-7 accepted one
    assert run[3] == [f"{head}es 2-4: the receiver failed all 4 rollouts of none of its 12 prompts, so there was "
                      f"nothing to receive (GRAFT acts on prompts it fails)"]
    run = said([(unmixed, [])])
    assert run[0][0].startswith(f"{head} 1: the receiver failed all rollouts of 2 prompts; the log holds 1 of "
                                f"them and none as a mixed group under success_reward='all', success_threshold=0.5")
    run = said([(gated | {"accepted": 1}, [0.9]), (gated, [0.1, 0.5, 0.05]), (unmixed, []), (gated, [0.2])])
    median = float(torch.tensor([0.1, 0.5, 0.05, 0.2]).median())  # torch's median of an even count: the lower one
    assert [len(x) for x in run] == [0, 0, 0, 1] and f"{median:.3g}" == "0.1"
    assert run[3][0].startswith(f"{head}es 2-4: 2 groups received, 8 peer responses: s median 0.1 against "
                                f"graft_delta=0.8; 6 gated (s <= delta), 2 too long for max_completion_length, 0 "
                                f"without EOS masked. Likely cause: the receiver's log-prob")


@needs_trl
def test_the_gate_watch_counts_responses_that_do_not_decode_back(recv):
    """Responses dropped because their receiver ids do not decode back to their text (retokenize_group's lost, the
    rule's own drop) are named in the gate's warning, after the other counts, and outweighing the gated ones they
    keep the warning from blaming the gate."""
    counts = {"all_fail": 2, "selected": 1, "accepted": 0, "groups": 4, "in_log": 2, "candidates": 4, "gated": 1,
              "too_long": 0, "lost": 3, "no_eos": 0}
    tr = make_trainer(recv, graft_warn_every=3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tr.watch_gate(counts, [0.1])
    said = [str(x.message) for x in caught if "graft_trl" in str(x.message)]
    assert len(said) == 1 and said[0].endswith(
        "1 gated (s <= delta), 0 too long for max_completion_length, 0 without EOS masked, 3 dropped as their ids do "
        "not decode back to their text"), said


# ------------------------------------------------------------------------------------------------
# The peer log completed (--peer_model), the user's success rule, masking, chat datasets
# ------------------------------------------------------------------------------------------------


@needs_trl
def test_id_column_names_any_column(recv, tmp_path):
    from datasets import Dataset
    log = tmp_path / "log.jsonl"
    log.write_text("".join(json.dumps({"id": "q-1", "response": r, "lbar": -1.0}) + "\n" for r in ("a", "b")))
    data = Dataset.from_list([{"qid": f"q-{i}", "prompt": f"{i}+{i + 1}=", "answer": ""} for i in range(4)])
    tr = make_trainer(recv, data=data, peer_log=str(log), id_column="qid")
    assert list(tr.peer) == ["q-1"] and tr.peer_rows["q-1"]["prompt"] == "1+2="


@needs_trl
def test_peer_model_computes_missing_lbar_as_a_plain_forward(recv, tmp_path):
    log = tmp_path / "log.jsonl"
    rows = [{"id": "p1", "response": "1+2"}, {"id": "p1", "response": "3", "eos": False},
            {"id": "p2", "response": "5", "lbar": -1.5}]
    log.write_text("".join(json.dumps(x) + "\n" for x in rows))
    tr = make_trainer(recv, peer_log=str(log), peer_model=str(recv / "m"))
    tok = tr.processing_class
    with torch.no_grad():
        prompt = torch.tensor([tok(text="1+2=")["input_ids"]])
        want = [float(logprobs(tr.model, prompt, torch.tensor([ids]), torch.ones(1, len(ids)).long()).mean())
                for ids in (tok.encode("1+2", add_special_tokens=False) + [tok.eos_token_id],
                            tok.encode("3", add_special_tokens=False))]
    torch.testing.assert_close(tr.peer["p1"].lbar, torch.tensor(want), rtol=1e-5, atol=1e-5)
    assert tr.peer["p2"].lbar.tolist() == [-1.5]  # given: kept
    assert list(tmp_path.glob(".log.jsonl.lbar-*.json"))  # cached beside the log


@needs_trl
def test_peer_model_lbar_follows_the_runs_chat_template_kwargs_and_temperature(recv, tmp_path, monkeypatch):
    """The receiver as its own peer (--peer_model = the receiver, no lbar in the log), a conversational dataset
    under a chat template whose kwargs change the prompt, TRL at T 0.7: s = 1 within 1e-4 for every received
    response (so w = 1), in two runs whose kwargs differ, each with its own cache (a changed prompt is computed
    again, not read from the other's)."""
    import shutil

    from datasets import Dataset
    from transformers import AutoTokenizer
    d = tmp_path
    shutil.copytree(recv / "m", d / "m")
    tok = AutoTokenizer.from_pretrained(d / "m")
    tok.chat_template = ("{% for m in messages %}{% if thinking %}think: {% endif %}{{ m['content'] }}{% endfor %}"
                         "{% if add_generation_prompt %}={% endif %}")
    tok.save_pretrained(d / "m")
    rows = [{"id": f"p{i}", "prompt": [{"role": "user", "content": f"{i}+{i + 1}"}], "answer": str(2 * i + 1)}
            for i in range(G)]
    log = d / "log.jsonl"
    log.write_text("".join(json.dumps({"id": "p1", "response": t}) + "\n" for t in ("1+2", "3", "2+1")))

    def passing(completions, **_):
        return [1.0 if c[0]["content"] in ("1+2", "2+1") else 0.0 for c in completions]
    for thinking in (True, False):
        tr = make_trainer(d, reward_funcs=(passing,), data=Dataset.from_list(rows), max_completion_length=4,
                          peer_log=str(log), peer_model=str(d / "m"), temperature=0.7,
                          chat_template_kwargs={"thinking": thinking})
        own = [[5, 6, 1]] * (G * N)  # every own completion fails
        monkeypatch.setattr(tr, "_generate", lambda prompts: (tr._tokenize_prompts(prompts)[0], own, None,
                                                              [[{"role": "assistant", "content": "xy"}]] * len(prompts),
                                                              None, {}, None, None))
        seen = []
        monkeypatch.setattr(tr, "watch_gate", lambda counts, s: seen.extend(s))
        tr.model.train()
        out = tr._generate_and_score_completions([row for row in rows for _ in range(N)])
        prompt = tr._tokenize_prompts([rows[1]["prompt"]])[0][0]
        assert (tok.decode(prompt) == "think: 1+2=") is thinking  # the kwargs reach TRL's rendering
        assert len(seen) == 3 and max(abs(x - 1) for x in seen) < 1e-4, seen
        torch.testing.assert_close(out["graft_weight"][4:7], torch.ones(3), atol=1e-4, rtol=0)
    assert len(list(d.glob(".log.jsonl.lbar-*.json"))) == 2  # one cache per rendering


def accuracy(completions, answer, **_):
    text = [c if isinstance(c, str) else c[0]["content"] for c in completions]
    return [1.0 if t == "ok" else 0.0 for t in text]


def form(completions, **_):
    return [0.5] * len(completions)  # a format bonus every response earns


@needs_trl
def test_success_rule_is_the_users_and_an_inert_one_warns(recv, tmp_path):
    log = tmp_path / "log.jsonl"
    log.write_text("".join(json.dumps({"id": "p1", "response": r, "lbar": -1.0}) + "\n" for r in ("ok", "no", "no2")))
    with pytest.warns(UserWarning, match="every one of the log's 3 responses succeeds under success_reward='all' "
                                         "\\(of accuracy, form\\), success_threshold=0.5"):
        tr = make_trainer(recv, reward_funcs=(accuracy, form), peer_log=str(log))
    own = torch.tensor([[0.0, 0.5]] * N)  # (n, F) an own group that fails on accuracy, earns the format bonus
    assert tr.counts(own, N).tolist() == [N]  # summed (TRL's reward): every rollout "succeeds", none all-fail
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tr = make_trainer(recv, reward_funcs=(accuracy, form), peer_log=str(log), success_reward="accuracy")
    assert not [x for x in caught if "graft_trl" in str(x.message)]
    assert tr.counts(own, N).tolist() == [0]
    inputs = [{"id": "p1", "prompt": "1+2=", "answer": "3"}] * N
    (g, grp, r), = tr.received(inputs, tr.counts(own, N))
    assert g == 0 and grp.texts == ["ok", "no", "no2"] and r.tolist() == [1.5, 0.5, 0.5]  # advantages: TRL's reward
    with pytest.warns(UserWarning, match="none of the log's 1 groups is mixed .*success_threshold=2 \\(0 of 3"):
        make_trainer(recv, reward_funcs=(accuracy, form), peer_log=str(log), success_reward="accuracy",
                     success_threshold=2.0)


@needs_trl
@pytest.mark.parametrize("chat,mask_truncated", [(False, False), (False, True), (True, False)])
def test_a_logged_group_fills_its_rows_masked_and_in_the_datasets_form(recv, tmp_path, monkeypatch, chat,
                                                                       mask_truncated):
    """A logged group of 3 < n responses: 3 peer rows with its advantages x w, one empty row (w = 0, masked), w from
    the receiver's own forward (checked against a plain one); a row without EOS masked when
    mask_truncated_completions is on; with a conversational dataset the reward functions (written in TRL's
    documented form) get the peer texts as assistant messages; other groups untouched."""
    import shutil

    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    d = tmp_path
    shutil.copytree(recv / "m", d / "m")
    tok = AutoTokenizer.from_pretrained(d / "m")
    if chat:
        tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
        tok.save_pretrained(d / "m")
    texts, eos = ["1+2", "3", "2+1"], [True, False, True]  # p1's logged group; the first and last pass: mixed
    ids = [core.retokenize(t, e, tok, max_response_tokens=4) for t, e in zip(texts, eos)]
    model = AutoModelForCausalLM.from_pretrained(d / "m")
    with torch.no_grad():
        prompt = torch.tensor([tok(text="1+2=")["input_ids"]])
        lbar = torch.tensor([float(logprobs(model, prompt, torch.tensor([x]), torch.ones(1, len(x)).long()).mean())
                             for x in ids])  # (3,) the receiver's Eq. 6
    lbar_src = lbar + torch.tensor([0.1, -0.2, 1.0])  # s = e^-0.1 (w = 0.905), e^0.2 (w = 1), e^-1 (removed)
    (d / "log.jsonl").write_text("".join(json.dumps({"id": "p1", "response": t, "lbar": float(lb), "eos": e}) + "\n"
                                         for t, lb, e in zip(texts, lbar_src, eos)))
    seen = []

    def passing(completions, **_):  # TRL's documented forms: strings, or lists of messages for chat datasets
        seen.extend(completions)
        return [1.0 if (c[0]["content"] if chat else c) in ("1+2", "2+1") else 0.0 for c in completions]
    rows = [{"id": f"p{i}", "prompt": [{"role": "user", "content": f"{i}+{i + 1}="}] if chat else f"{i}+{i + 1}=",
             "answer": str(2 * i + 1)} for i in range(G)]
    tr = make_trainer(d, reward_funcs=(passing,), data=Dataset.from_list(rows), max_completion_length=4,
                      mask_truncated_completions=mask_truncated)
    assert all(isinstance(c, list) and c[0]["role"] == "assistant" if chat else isinstance(c, str) for c in seen)
    own = [[5, 6, 1]] * (G * N)  # every own completion: two tokens and EOS, failing
    completion = [{"role": "assistant", "content": "xy"}] if chat else "xy"
    monkeypatch.setattr(tr, "_generate", lambda prompts: (tr._tokenize_prompts(prompts)[0], own, None,
                                                          [completion] * len(prompts), None, {}, None, None))
    inputs = [row for row in rows for _ in range(N)]
    tr.model.train()
    out = tr._generate_and_score_completions(inputs)
    assert torch.nonzero(out["graft_is_peer"]).squeeze(1).tolist() == [4, 5, 6, 7]  # group 1 only
    w = core.compatibility_weights(lbar_recv=lbar, lbar_src=lbar_src)  # (3,)
    assert 0.8 < w[0] < 1 and w[1] == 1 and w[2] == 0
    w = w * torch.tensor([1.0, 0.0 if mask_truncated else 1.0, 1.0])  # the row without EOS, as TRL masks its own
    a = core.group_advantages(torch.tensor([[1.0, 0.0, 1.0]]))[0]  # the logged group's own advantages
    torch.testing.assert_close(out["graft_weight"][4:8], torch.cat([w, torch.zeros(1)]), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out["advantages"][4:8], torch.cat([a * w, torch.zeros(1)]), rtol=1e-5, atol=1e-6)
    for j, x in enumerate(ids):
        assert out["completion_ids"][4 + j, : len(x)].tolist() == x
        assert int(out["completion_mask"][4 + j].sum()) == (len(x) if w[j] > 0 else 0)
    assert out["completion_mask"][7].sum() == 0 and out["num_items_in_batch"] == out["completion_mask"].sum()
    assert (out["completion_mask"][:4].sum(1) == 3).all() and (out["graft_weight"][:4] == 1).all()


@needs_trl
@pytest.mark.parametrize("mode", ["token_truncate", "sequence_mask"])
def test_vllm_correction_on_own_rows_as_trl_computes_it_and_none_on_peer_rows(recv, tmp_path, monkeypatch, mode):
    """use_vllm with TRL's importance-sampling correction, the sampler's log-probs planted where TRL reads them
    from vLLM (_generate's fifth output): own rows carry exactly the ratio stock TRL computes for the same batch,
    peer rows (old log-probs from the receiver's own forward) a ratio of 1; per optimizer step TRL's loss equals
    Eq. 10 with that ratio on each token, in value and gradient."""
    (tmp_path / "log.jsonl").write_text("".join(json.dumps({"id": "p1", "response": t, "lbar": -4.0}) + "\n"
                                                for t in ("1+2", "3", "2+1")))
    tr = make_trainer(recv, reward_funcs=(lambda completions, **_: [float(c in ("1+2", "2+1")) for c in completions],),
                      peer_log=str(tmp_path / "log.jsonl"), max_completion_length=4, steps_per_generation=2,
                      per_device_train_batch_size=G * N // 2, vllm_importance_sampling_mode=mode)
    tr.use_vllm = tr.vllm_importance_sampling_correction = True  # set after: vLLM is not installed here
    g = torch.Generator().manual_seed(0)
    own = [[5, 6, 1]] * (G * N)  # every own completion fails
    sampled = (-2.0 - 0.3 * torch.randn(G * N, 3, generator=g)).tolist()  # the sampler's log-probs (vLLM's)
    monkeypatch.setattr(tr, "_generate", lambda prompts: (tr._tokenize_prompts(prompts)[0], own, None,
                                                          ["xy"] * len(prompts), sampled, {}, None, None))
    inputs = [{"id": f"p{i}", "prompt": f"{i}+{i + 1}=", "answer": ""} for i in range(G) for _ in range(N)]
    tr.model.train()
    stock = trl.GRPOTrainer._generate_and_score_completions(tr, inputs)  # TRL's own path, no GRAFT
    out = tr._generate_and_score_completions(inputs)
    peer = out["graft_is_peer"]
    assert peer.tolist() == [4 <= r < 8 for r in range(G * N)]
    ratio = out["importance_sampling_ratio"]
    width = stock["importance_sampling_ratio"].shape[1]
    assert torch.equal(ratio[~peer, :width], stock["importance_sampling_ratio"][~peer])
    assert bool((ratio[peer] == 1).all())
    assert not bool((stock["importance_sampling_ratio"][~peer] == 1).all())  # the correction is not trivial
    micro = trl_micro_batches(tr, out | {"row": torch.arange(G * N)}, monkeypatch)
    tr.current_gradient_accumulation_steps = 1
    for mb in micro:
        tr.model.zero_grad()
        loss = tr._compute_loss(tr.model, mb)
        loss.backward()
        got = grads(tr.model)
        tr.model.zero_grad()
        mask = mb["completion_mask"].float()  # (b, T)
        lp = logprobs(tr.model, mb["prompt_ids"], mb["completion_ids"], mb["completion_mask"])
        r, a = torch.exp(lp - mb["old_per_token_logps"]), mb["advantages"][:, None]
        per_token = -torch.minimum(r * a, r.clamp(0.8, 1.28) * a) * mb["importance_sampling_ratio"]  # Eq. 10 x IS
        want = (per_token * mask).sum() / mask.sum()
        want.backward()
        assert float(loss) == pytest.approx(float(want), rel=1e-5, abs=1e-7)
        torch.testing.assert_close(got, grads(tr.model), rtol=1e-5, atol=1e-7)
