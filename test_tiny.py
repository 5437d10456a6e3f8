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

# ----------------------------------------------------------------------------------------------------
# Generator
# ----------------------------------------------------------------------------------------------------


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


# ----------------------------------------------------------------------------------------------------
# Tokenizers and models
# ----------------------------------------------------------------------------------------------------


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
    rows = (out / "results.csv").read_text().splitlines()
    cells = {tuple(x.split(",")[1:3]) for x in rows[1:]}
    assert cells == {(m, s) for m in ("before", "grpo", "graft") for s in ("A", "B")}  # every phase ran
    for side in ("A", "B"):
        metrics = [json.loads(x) for x in (out / "seed0" / "graft" / side / "metrics.jsonl").read_text().splitlines()]
        assert len(metrics) == 3
        assert sum(m["selected"] for m in metrics) > 0, f"no peer group selected for {side}"
        assert sum(m["accepted"] for m in metrics) > 0, f"no peer response accepted by {side}"
        assert (out / "seed0" / "graft" / side / "checkpoints" / "step_000003" / "model.safetensors").is_file()
    assert "held-out accuracy" in r.stdout and "graft -> A" in r.stdout
