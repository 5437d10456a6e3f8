"""Fast tests of the tiny preset's phase 1: problem generator, tokenizers, model build/save/load."""

import json
import os
import re
import subprocess
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "data"))
import tiny  # noqa: E402
import verify  # noqa: E402
import tiny_tasks  # noqa: E402

# ------------------------------------------------------------------------------------------------
# Generator
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def splits():
    return tiny_tasks.generate(seed=3, n_train=400, n_test=80)


def test_generator_is_deterministic_and_seeded(splits):
    assert tiny_tasks.generate(seed=3, n_train=400, n_test=80) == splits
    assert tiny_tasks.generate(seed=4, n_train=400, n_test=80) != splits


def test_test_split_does_not_depend_on_train_size(splits):
    assert tiny_tasks.generate(seed=3, n_train=40, n_test=80)[1] == splits[1]


def test_splits_are_disjoint_balanced_and_unique(splits):
    train, test = splits
    tr, te = [r["problem"] for r in train], [r["problem"] for r in test]
    assert len(set(tr)) == len(tr) and len(set(te)) == len(te)
    assert not set(tr) & set(te)
    for rows, total in ((train, 400), (test, 80)):
        counts = {f: sum(r["family"] == f for r in rows) for f in tiny_tasks.FAMILIES}
        assert counts == {f: total // len(tiny_tasks.FAMILIES) for f in tiny_tasks.FAMILIES}
        assert len({r["id"] for r in rows}) == len(rows)


def _solve(problem: str) -> int:
    """Independent answer from the problem text alone."""
    if m := re.fullmatch(r"What is (\d+)\+(\d+)\?", problem):
        return int(m[1]) + int(m[2])
    if m := re.fullmatch(r"What is (\d+)-(\d+)\?", problem):
        return int(m[1]) - int(m[2])
    if m := re.fullmatch(r"What is (\d+)\*(\d+)\?", problem):
        return int(m[1]) * int(m[2])
    if m := re.fullmatch(r"Solve (\d+)x\+(\d+)=(\d+)\.", problem):
        a, b, c = map(int, m.groups())
        assert (c - b) % a == 0
        return (c - b) // a
    raise AssertionError(f"unrecognised problem {problem!r}")


def _calc(expr: str) -> int:
    """Value of a +,-,*,/ integer expression (left to right, * and / first; / must be exact)."""
    total, sign = 0, 1
    for term_sign, term in re.findall(r"([+-]?)([^+-]+)", expr):
        sign = -1 if term_sign == "-" else 1
        nums, ops = re.split(r"[*/]", term), re.findall(r"[*/]", term)
        v = int(nums[0])
        for op, n in zip(ops, nums[1:]):
            assert op == "*" or v % int(n) == 0
            v = v * int(n) if op == "*" else v // int(n)
        total += sign * v
    return total


def test_answers_and_solutions_are_correct(splits):
    for row in splits[0] + splits[1]:
        assert set(row) == {"id", "problem", "answer", "family", "solution"}
        gold = _solve(row["problem"])
        assert gold >= 0 and row["answer"] == str(gold)
        assert row["solution"].endswith(f"\\boxed{{{gold}}}")
        assert verify.verify(row["solution"], row["answer"]) == 1.0  # the reward the trainer uses
        assert verify.verify(row["solution"], str(gold + 1)) == 0.0
        # every chain of equalities without the unknown in the worked solution holds
        for chain in re.findall(r"[\d+\-*/=]+", row["solution"]):
            parts = [p for p in chain.split("=") if p]
            if len(parts) > 1:
                assert len({_calc(p) for p in parts}) == 1, row


def test_cli_writes_identical_files(tmp_path):
    outs = []
    for d in ("a", "b"):
        out = tmp_path / d
        subprocess.run([sys.executable, os.path.join(HERE, "data", "tiny_tasks.py"), "--out", str(out),
                        "--seed", "1", "--train", "40", "--test", "8"], check=True, capture_output=True)
        outs.append([(out / f).read_bytes() for f in ("train.jsonl", "test.jsonl")])
    assert outs[0] == outs[1]
    rows = [json.loads(line) for line in outs[0][0].decode().splitlines()]
    assert len(rows) == 40


# ------------------------------------------------------------------------------------------------
# Tokenizers and models
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def texts(splits):
    train, test = splits
    return [tiny.PROMPT_TEMPLATE.replace("{problem}", r["problem"]) + r["solution"] for r in train + test]


@pytest.fixture(scope="module")
def toks(texts):
    return {"char": tiny.build_char_tokenizer(), "bpe": tiny.build_bpe_tokenizer(texts, 300)}


@pytest.mark.parametrize("name", ["char", "bpe"])
def test_tokenizer_round_trips_exactly(toks, texts, name):
    tok = toks[name]
    extra = ["  two  spaces\n\nand newlines \n", "x=70/7=10, \\boxed{10}", ""]
    for t in texts + extra:
        ids = tok.encode(t, add_special_tokens=False)
        assert tok.unk_token_id not in ids
        assert tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False) == t
        assert tok.decode(ids + [tok.eos_token_id], skip_special_tokens=True,
                          clean_up_tokenization_spaces=False) == t
    assert tok.eos_token_id is not None and tok.pad_token_id is not None
    assert tok.eos_token_id != tok.pad_token_id
    assert tok.encode("12", add_special_tokens=True) == tok.encode("12", add_special_tokens=False)  # no BOS


def test_tokenizers_split_digits_differently(toks, texts):
    char, bpe = toks["char"], toks["bpe"]
    assert len(char.encode("4738", add_special_tokens=False)) == 4
    assert len(bpe.encode("4738", add_special_tokens=False)) < 4
    assert 250 <= len(bpe) <= 300
    n_char = sum(len(char.encode(t, add_special_tokens=False)) for t in texts[:100])
    n_bpe = sum(len(bpe.encode(t, add_special_tokens=False)) for t in texts[:100])
    assert n_bpe < 0.8 * n_char


def test_models_build_save_and_load(toks, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg = tiny.TinyConfig(hidden=32, layers=1, heads=2, intermediate=64)
    text = "What is 12+3?\n"
    for kind, name in (("llama", "char"), ("qwen3", "bpe")):
        tok = toks[name]
        model = tiny.build_model(kind, tok, cfg).eval()
        out = tmp_path / kind
        model.save_pretrained(out)
        tok.save_pretrained(out)
        assert (out / "model.safetensors").exists()
        m2, t2 = AutoModelForCausalLM.from_pretrained(out).eval(), AutoTokenizer.from_pretrained(out)
        assert m2.config.model_type == kind
        ids = t2.encode(text, add_special_tokens=False)
        assert ids == tok.encode(text, add_special_tokens=False)
        assert t2.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False) == text
        assert (t2.eos_token_id, t2.pad_token_id) == (tok.eos_token_id, tok.pad_token_id)
        x = torch.tensor([ids])
        with torch.no_grad():
            assert torch.allclose(model(x).logits, m2(x).logits, atol=1e-5)


def test_preset_smoke_every_phase_runs_and_peers_are_exchanged(tmp_path):
    """CI version of `bash run_pair.sh tiny`: committed pre-trained models, 3 RL steps per run."""
    out = tmp_path / "tiny"
    r = subprocess.run([sys.executable, os.path.join(HERE, "tiny.py"), "--out", str(out), "--smoke"],
                       capture_output=True, text=True, timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = [x.split(",") for x in (out / "results.csv").read_text().splitlines()[1:]]
    cells = {(meth, model) for _, meth, model, subset, _, _ in rows if subset == "overall"}
    assert cells == {(m, s) for m in ("before", "grpo", "graft") for s in ("A", "B")}  # every phase ran
    for side, peer in (("A", "B"), ("B", "A")):
        metrics = [json.loads(x) for x in (out / "seed0" / "graft" / side / "metrics.jsonl").read_text().splitlines()]
        assert len(metrics) == 3
        assert sum(m["selected"] for m in metrics) > 0, f"no peer group selected for {side}"
        assert sum(m["accepted"] for m in metrics) > 0, f"no peer response accepted by {side}"
        assert (out / "seed0" / "graft" / side / "checkpoints" / "step_000003" / "model.safetensors").is_file()
        # the beyond-sample subset was computed, and agrees with the pick evaluation it came from
        pick = {s: tiny.load_eval(str(out / "eval" / f"before_{s}.json"))["test_smoke"] for s in (side, peer)}
        assert {len(c) for s in pick for c in pick[s].values()} == {16}  # 8 samples pick, 8 measure
        beyond = [q for q, c in pick[side].items() if max(c[:8]) == 0 and max(pick[peer][q][:8]) > 0]
        sizes = {int(n) for _, meth, model, subset, n, _ in rows if model == side and subset == "beyond"}
        assert sizes == {len(beyond)} and len(beyond) > 0, (sizes, len(beyond))
        # the train-side view: the received prompts are exactly the groups the trainer selected
        received = (out / "received" / f"s0_graft_{side}.jsonl").read_text().splitlines()
        assert 0 < len(received) <= sum(m["selected"] for m in metrics)
    assert "beyond-sample subset" in r.stdout and "graft -> A" in r.stdout and "train-side view" in r.stdout


def test_beyond_sample_and_metrics_by_hand():
    a = {"q1": [0, 0, 0], "q2": [0, 0, 0], "q3": [1, 0, 0], "q4": [0, 0, 0]}
    b = {"q1": [0, 1, 0], "q2": [0, 0, 0], "q3": [1, 1, 1], "q4": [1, 1, 1]}
    fail, beyond = tiny.beyond_sample(a, b)
    assert fail == ["q1", "q2", "q4"] and beyond == ["q1", "q4"]
    assert tiny.beyond_sample(b, a) == (["q2"], [])
    assert tiny.accuracy(b, ["q1", "q4"]) == pytest.approx((1 / 3 + 1) / 2)
    assert tiny.pass_at_k(a, ["q1", "q3"]) == 0.5
    assert tiny.accuracy(a, []) != tiny.accuracy(a, [])  # NaN for an empty subset


def test_validation_split_is_carved_per_family(splits):
    train, _ = splits
    rest, val = tiny.split_validation(train, 40)
    assert len(val) == 40 and len(rest) == len(train) - 40
    assert {r["family"] for r in val} == set(tiny_tasks.FAMILIES)
    assert all(sum(r["family"] == f for r in val) == 40 // len(tiny_tasks.FAMILIES) for f in tiny_tasks.FAMILIES)
    assert not {r["id"] for r in rest} & {r["id"] for r in val}


def test_received_prompts_match_the_trainers_selection(tmp_path):
    """Rollout files written by hand: the received set is the balanced swap's selection, per side."""
    from exchange import StepRollouts, rollout_path, save_rollouts
    from pathlib import Path

    n = 4
    succ = {"a": [[0, 3], [0, 0], [4, 1]], "b": [[2, 0], [1, 3], [0, 0]]}  # per step, per prompt: successes
    ids = [["p0", "p1"], ["p2", "p3"], ["p4", "p5"]]
    for side, ks in succ.items():
        for step, (pids, kk) in enumerate(zip(ids, ks)):
            rew = torch.tensor([[1.0] * k + [0.0] * (n - k) for k in kk])  # (G, n)
            r = StepRollouts(prompt_ids=pids, tokens=[[1]] * (2 * n), logprobs=[torch.zeros(1)] * (2 * n),
                             texts=["x"] * (2 * n), eos=torch.ones(2, n, dtype=torch.bool), rewards=rew,
                             advantages=torch.zeros(2, n))
            save_rollouts(rollout_path(Path(tmp_path), side, step), r, {"model": side, "step": step})
    # step 0: a fails p0 where b is mixed, b fails p1 where a is mixed: m = 1, one group each way.
    # step 1: a fails p2 and p3, b mixed on both, but b fails nothing: m = 0, nothing moves.
    # step 2: b fails p5 where a is mixed (p4: a solves 4/4, not mixed), a fails nothing: m = 0.
    assert tiny.received_prompts(str(tmp_path), "a", "b", 3) == ["p0"]
    assert tiny.received_prompts(str(tmp_path), "b", "a", 3) == ["p1"]
    # without balancing every candidate moves
    assert tiny.received_prompts(str(tmp_path), "a", "b", 3, balance=False) == ["p0", "p2", "p3"]
    assert tiny.received_prompts(str(tmp_path), "b", "a", 3, balance=False) == ["p1", "p5"]
