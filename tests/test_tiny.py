"""Fast tests of the tiny preset's phase 1: problem generator, tokenizers, model build/save/load."""

import json
import os
import re
import subprocess
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository root
import graft  # noqa: E402
from tools import tiny  # noqa: E402
import verify  # noqa: E402
from data import tiny_tasks  # noqa: E402
from core import assignment_digest
from metrics import read_metrics

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
    return {"char": tiny.build_char_tokenizer(), "bpe": tiny.build_bpe_tokenizer(texts, 300),
            "bytelevel": tiny.build_bytelevel_tokenizer(texts, 400)}


@pytest.mark.parametrize("name", ["char", "bpe", "bytelevel"])
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
    # C's byte-level BPE merges digit runs by frequency: boundaries that differ from both A's and B's
    byte = toks["bytelevel"]
    assert len(byte) == 400 and byte.unk_token_id not in byte.encode("é 中 ~", add_special_tokens=False)
    pieces = lambda tok, t: tok.convert_ids_to_tokens(tok.encode(t, add_special_tokens=False))  # noqa: E731
    differ_b = sum(pieces(byte, t) != pieces(bpe, t) for t in texts[:100])
    assert differ_b >= 90 and all(len(pieces(byte, t)) < len(pieces(char, t)) for t in texts[:100])


def test_models_build_save_and_load(toks, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg = tiny.TinyConfig(hidden=32, layers=1, heads=2, intermediate=64)
    text = "What is 12+3?\n"
    for kind, name in (("llama", "char"), ("qwen3", "bpe"), ("gpt_neox", "bytelevel")):
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


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """One `python -m tools.tiny --smoke --models 3` run, shared by the tests below: the panel (A and B), then the
    held-out table with GRPO for A, B and C, the three pairs and the three-way run, 3 RL steps each. One run serves
    both presets: with two models the jobs are the same code with one pair, labelled graft instead of graft_AB
    (test_preset_runs_and_per_model_digests); a second run cost CI several minutes of process starts.
    Returns (run folder, the completed process)."""
    out = tmp_path_factory.mktemp("smoke") / "tiny"
    # the timeout only catches a hang: on a loaded 2-core machine the run takes several minutes
    r = subprocess.run([sys.executable, "-m", "tools.tiny", "--out", str(out), "--smoke", "--models", "3"], cwd=HERE,
                       capture_output=True, text=True, timeout=2400, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return out, r


def test_preset_smoke_every_phase_runs_and_peers_are_exchanged(smoke):
    """CI version of `bash run_pair.sh tiny`: committed pre-trained models, 3 RL steps per run; the pair A-B."""
    out, r = smoke
    rows = [x.split(",") for x in (out / "results.csv").read_text().splitlines()[1:]]
    cells = {(meth, model) for _, meth, model, subset, _, _ in rows if subset == "overall"}
    assert {(m, s) for m in ("before", "grpo", "graft_AB") for s in ("A", "B")} <= cells  # every phase ran
    for side, peer in (("A", "B"), ("B", "A")):
        metrics = read_metrics(out / "seed0" / "graft_AB" / side / "metrics.jsonl")
        assert len(metrics) == 3
        assert sum(m["selected"] for m in metrics) > 0, f"no peer group selected for {side}"
        assert sum(m["accepted"] for m in metrics) > 0, f"no peer response accepted by {side}"
        assert (out / "seed0" / "graft_AB" / side / "checkpoints" / "step_000003" / "model.safetensors").is_file()
        # the beyond-sample subset against this peer was computed, and agrees with the pick evaluation it came from
        pick = {s: tiny.load_eval(str(out / "eval" / f"before_{s}.json"))["test_smoke"] for s in (side, peer)}
        assert {len(c) for s in pick for c in pick[s].values()} == {16}  # 8 samples pick, 8 measure
        beyond = [q for q, c in pick[side].items() if max(c[:8]) == 0 and max(pick[peer][q][:8]) > 0]
        sizes = {int(n) for _, meth, model, subset, n, _ in rows if model == side and subset == f"beyond_{peer}"}
        assert sizes == {len(beyond)} and len(beyond) > 0, (sizes, len(beyond))
        # the train-side view: the received prompts are exactly the groups the trainer selected
        received = (out / "received" / f"s0_graft_AB_{side}.jsonl").read_text().splitlines()
        assert 0 < len(received) <= sum(m["selected"] for m in metrics)
    assert "beyond-sample subset" in r.stdout and "graft_AB -> A" in r.stdout and "train-side view" in r.stdout


def test_preset_smoke_with_three_models(smoke):
    """The same run's three models: GRPO for A, B and C, the three pairs and the three-way run."""
    out, r = smoke
    rows = [x.split(",") for x in (out / "results.csv").read_text().splitlines()[1:]]
    cells = {(meth, model) for _, meth, model, subset, _, _ in rows if subset == "overall"}
    runs = {"grpo": "ABC", "graft_AB": "AB", "graft_AC": "AC", "graft_BC": "BC", "graft": "ABC"}
    assert cells == {("before", m) for m in "ABC"} | {(k, m) for k, ms in runs.items() for m in ms}
    assert {subset for _, _, model, subset, _, _ in rows if model == "C"} >= {"beyond", "beyond_A", "beyond_B"}
    # the three-way run: what each process took from each peer adds up, and all three agreed on every step
    metrics = {m: read_metrics(out / "seed0" / "graft" / m / "metrics.jsonl") for m in "ABC"}
    for m, ms in metrics.items():
        assert len(ms) == 3 and all(x["selected"] == sum(x[f"selected/{p.lower()}"] for p in "ABC" if p != m)
                                    for x in ms)
    for step in range(3):
        assert len({metrics[m][step]["assignment"] for m in "ABC"}) == 1
    assert sum(x["selected"] for ms in metrics.values() for x in ms) > 0, "nothing moved in the three-way run"
    record = json.loads((out / "received" / "s0_graft.json").read_text())
    assert record["agreed_steps"] == 3
    assert sum(v for got in record["received_from"].values() for v in got.values()) == sum(
        len([q for q in (out / "received" / f"s0_graft_{m}.jsonl").read_text().splitlines() if '"id": "none"' not in q])
        for m in "ABC")
    assert "graft (A, B, C): 3/3 steps" in r.stdout and re.search(r"graft \(3 processes\) \d+ s vs graft_AB", r.stdout)


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


def write_steps(folder, succ: dict, ids: list, n: int) -> None:
    """Rollout files by hand: succ[side][step][g] successes of side on prompt ids[step][g], n rollouts each."""
    from exchange import StepRollouts, rollout_path, save_rollouts
    from pathlib import Path

    for side, ks in succ.items():
        for step, (pids, kk) in enumerate(zip(ids, ks)):
            G = len(pids)
            rew = torch.tensor([[1.0] * k + [0.0] * (n - k) for k in kk])  # (G, n)
            r = StepRollouts(prompt_ids=pids, tokens=[[1]] * (G * n), logprobs=[torch.zeros(1)] * (G * n),
                             texts=["x"] * (G * n), eos=torch.ones(G, n, dtype=torch.bool), rewards=rew,
                             advantages=torch.zeros(G, n))
            save_rollouts(rollout_path(Path(folder), side, step), r, {"model": side, "step": step})


def test_received_prompts_match_the_trainers_selection(tmp_path):
    """Rollout files written by hand: the received set is the balanced swap's selection, per side."""
    n = 4
    succ = {"a": [[0, 3], [0, 0], [4, 1]], "b": [[2, 0], [1, 3], [0, 0]]}  # per step, per prompt: successes
    ids = [["p0", "p1"], ["p2", "p3"], ["p4", "p5"]]
    write_steps(tmp_path, succ, ids, n)
    # step 0: a fails p0 where b is mixed, b fails p1 where a is mixed: m = 1, one group each way.
    # step 1: a fails p2 and p3, b mixed on both, but b fails nothing: m = 0, nothing moves.
    # step 2: b fails p5 where a is mixed (p4: a solves 4/4, not mixed), a fails nothing: m = 0.
    assert tiny.received_prompts(str(tmp_path), "a", ["b"], 3) == ["p0"]
    assert tiny.received_prompts(str(tmp_path), "b", ["a"], 3) == ["p1"]
    # without balancing every candidate moves
    assert tiny.received_prompts(str(tmp_path), "a", ["b"], 3, balance=False) == ["p0", "p2", "p3"]
    assert tiny.received_prompts(str(tmp_path), "b", ["a"], 3, balance=False) == ["p1", "p5"]


def test_three_sides_received_sources_and_fingerprints(tmp_path):
    """Three sides, one step of 4 prompts, n = 4, worked by hand with the rule of multi_peer_sources."""
    # p0: a fails, b 1/4, c 3/4 -> a takes c's group (most successes)
    # p1: b fails, a 2/4, c 2/4 -> b takes a's (tie: the name that sorts first)
    # p2: c fails, b 1/4, a 4/4 (not mixed) -> c takes b's
    # p3: a and b fail, c 2/4 -> a and b both take c's
    # balancing per pair: c->a {p0, p3} vs a->c {}: m = 0, a gets nothing from c; a->b {p1} vs b->a {}: m = 0;
    # b->c {p2} vs c->b {p3}: m = 1, both kept.
    ids = [["p0", "p1", "p2", "p3"]]
    write_steps(tmp_path, {"a": [[0, 2, 4, 0]], "b": [[1, 0, 1, 0]], "c": [[3, 2, 0, 2]]}, ids, 4)
    got, prints = tiny.exchange_view(str(tmp_path), ["c", "a", "b"], 1)
    assert got == {"a": {}, "b": {"p3": "c"}, "c": {"p2": "b"}}
    got, _ = tiny.exchange_view(str(tmp_path), ["a", "b", "c"], 1, balance=False)
    assert got == {"a": {"p0": "c", "p3": "c"}, "b": {"p1": "a", "p3": "c"}, "c": {"p2": "b"}}
    src = torch.tensor([[-1, -1, -1, -1], [-1, -1, -1, 2], [-1, -1, 1, -1]])  # (S, G), sides a, b, c
    assert prints == [assignment_digest(src, ["p0", "p1", "p2", "p3"])]
    # every process logged that fingerprint: 1 step agreed; one process with another: the preset stops
    for side, fp in (("a", prints[0]), ("b", prints[0]), ("c", prints[0])):
        (tmp_path / f"{side}.jsonl").write_text(json.dumps({"step": 0, "assignment": fp}) + "\n")
    paths = {s: str(tmp_path / f"{s}.jsonl") for s in "abc"}
    assert tiny.check_assignments("ex", paths, 1, prints) == 1
    (tmp_path / "c.jsonl").write_text(json.dumps({"step": 0, "assignment": "0" * 12}) + "\n")
    with pytest.raises(SystemExit, match="disagree on step 0"):
        tiny.check_assignments("ex", paths, 1, prints)


def test_preset_runs_and_per_model_digests():
    labels = lambda runs: [(r.label, r.group) for r in runs]  # noqa: E731
    assert labels(tiny.preset_runs(["grpo", "graft"], ["A", "B"])) == [("grpo", ("A", "B")), ("graft", ("A", "B"))]
    assert labels(tiny.preset_runs(["grpo", "graft"], ["A", "B", "C"]))[1:] == [
        ("graft_AB", ("A", "B")), ("graft_AC", ("A", "C")), ("graft_BC", ("B", "C")), ("graft", ("A", "B", "C"))]
    # a model's cache key covers the shared fields and its own, nothing of another model
    base, cfg = tiny.TinyConfig(), tiny.TinyConfig(mix_c={"add": 1.0})
    assert [base.digest(m) == cfg.digest(m) for m in "ABC"] == [True, True, False]
    assert [base.digest(m) == tiny.TinyConfig(layers=2).digest(m) for m in "ABC"] == [False] * 3
    # the committed copies are those of the default config: the preset never pre-trains in CI
    for m in "ABC":
        assert tiny._is_done(os.path.join(tiny.COMMITTED, m), m, base), f"data/tiny_models/{m} is stale"


def test_a_run_json_of_the_old_field_name_still_loads(tmp_path):
    """A run.json whose preset gives the model count as peers is read as models (report, figure), as is one
    that gives models."""
    import dataclasses
    for key in ("peers", "models"):
        preset = {k: v for k, v in dataclasses.asdict(tiny.PresetConfig()).items() if k != "models"} | {key: 3}
        (tmp_path / "run.json").write_text(json.dumps({"preset": preset}))
        _, pc = tiny.saved_preset(str(tmp_path), "report")
        assert pc.models == 3 and pc.out == str(tmp_path), key


def test_an_evaluation_missing_a_file_is_evaluated_again(tmp_path):
    """A rerun with more seeds adds received-prompt files: the cached evaluation without them is dropped."""
    out = tmp_path / "before_A.json"
    out.write_text(json.dumps({"problems": {"test": [], "s0_graft_A": []}}))
    tiny.drop_stale_eval(str(out), ["/x/test.jsonl", "/y/s0_graft_A.jsonl"])
    assert out.exists()  # every file was evaluated: the cache stands
    tiny.drop_stale_eval(str(out), ["/x/test.jsonl", "/y/s0_graft_A.jsonl", "/y/s1_graft_A.jsonl"])
    assert not out.exists()


# ------------------------------------------------------------------------------------------------
# The mechanism panel and the report
# ------------------------------------------------------------------------------------------------


def _rollouts(folder, name, step):
    from exchange import load_rollouts, rollout_path
    from pathlib import Path
    return load_rollouts(rollout_path(Path(folder), name, step))[0]


def test_panel_halves_are_all_fail_and_every_printed_number_comes_from_the_files(smoke):
    """The smoke run's panel: its halves are disjoint train problems (never held-out), each model's half is
    all-fail before RL by the pick's own samples while the peer is mixed, and every number the panel
    prints is recomputed here, by plain loops, from the pick evaluation, the rollout files and metrics.jsonl."""
    out, r = smoke
    pdir = out / "panel"
    meta = json.loads((pdir / "set.json").read_text())
    halves, n = meta["halves"], meta["samples"]
    train = {row["id"]: row for row in map(json.loads, (out / "data" / "train.jsonl").read_text().splitlines())}
    test_ids = {json.loads(x)["id"] for split in ("test", "val")
                for x in (out / "data" / f"{split}.jsonl").read_text().splitlines()}  # held-out and validation
    assert len(halves["A"]) == len(halves["B"]) == 4 and not set(halves["A"]) & set(halves["B"])
    assert set(halves["A"]) | set(halves["B"]) <= set(train) and not (set(halves["A"]) | set(halves["B"])) & test_ids
    lo, hi = meta["peer_solves"]
    assert (lo, hi) == (2, 6) and meta["pool"] == 300 * meta["chunks"]  # the default window; smoke chunks of 300
    # the pick's own samples, chunk by chunk (each chunk a separate evaluation with its own seed)
    pick, pool_ids = {"A": {}, "B": {}}, []
    for c in range(meta["chunks"]):
        pool_ids += [json.loads(x)["id"] for x in (pdir / f"pool_{c:02d}.jsonl").read_text().splitlines()]
        for m in "AB":
            pick[m].update(tiny.load_eval(str(pdir / f"pick_{m}_{c:02d}.json"))[f"pool_{c:02d}"])
    assert not (pdir / f"pick_A_{meta['chunks']:02d}.json").exists()  # the pick stopped once both halves were full
    assert {len(c) for m in "AB" for c in pick[m].values()} == {n} and len(pool_ids) == meta["pool"]
    for own, peer in (("A", "B"), ("B", "A")):
        kind = [q for q in pool_ids if sum(pick[own][q]) == 0 and lo <= sum(pick[peer][q]) <= hi]
        assert halves[own] == kind[:4], own  # the first of the kind in pool order
        for q in halves[own]:
            assert sum(pick[own][q]) == 0 and lo <= sum(pick[peer][q]) <= hi, (own, q, pick[own][q], pick[peer][q])
    set_rows = [json.loads(x) for x in (pdir / "set.jsonl").read_text().splitlines()]
    assert [x["id"] for x in set_rows] == halves["A"] + halves["B"]
    text = r.stdout
    assert "mechanism panel (in-sample)" in text
    # the family mix and how many of each kind the pool held
    kinds = sorted({train[q]["family"] for q in halves["A"] + halves["B"]})
    for m, peer in (("A", "B"), ("B", "A")):
        mix = ", ".join(f"{f} {sum(train[q]['family'] == f for q in halves[m])}" for f in kinds)
        in_pool = sum(sum(pick[m][q]) == 0 and lo <= sum(pick[peer][q]) <= hi for q in pick[m])
        assert f"  {m} fails: {mix} ({in_pool} such problems among the {meta['pool']})" in text
    # rewards on each half, per window, for both methods, and the paired difference (one seed)
    steps = 3
    folders = {("grpo", m): (pdir / "seed0" / "grpo" / m / "exchange", m.lower()) for m in "AB"}
    folders |= {("graft", m): (pdir / "seed0" / "graft" / "exchange", m.lower()) for m in "AB"}
    rows = re.findall(r"^(A|B)\s+(own|other) \((A|B) fails\)\s+(\S+)\s+(\S+)\s+(\S+)\s+(\S+)$", text, re.M)
    assert len(rows) == 2 * 2 * 3
    for m, half, who, label, grpo_cell, graft_cell, diff_cell in rows:
        assert who == (m if half == "own" else "BA"["AB".index(m)])
        step = int(label) - 1  # 3 steps: one window per step
        got = {}
        for method in ("grpo", "graft"):
            ro = _rollouts(*folders[(method, m)], step)
            vals = [float(ro.rewards[g, i]) for g, q in enumerate(ro.prompt_ids) if q in halves[who]
                    for i in range(ro.rewards.shape[1])]
            assert len(vals) == len(halves[who]) * ro.rewards.shape[1]  # the whole half, every step
            got[method] = 100 * sum(vals) / len(vals)
        assert float(grpo_cell) == pytest.approx(got["grpo"], abs=0.051)
        assert float(graft_cell) == pytest.approx(got["graft"], abs=0.051)
        assert float(diff_cell) == pytest.approx(got["graft"] - got["grpo"], abs=0.051)
    # groups received (the balanced swap: m = min of the candidates either way, each direction keeping its
    # m with the most source successes and every candidate tied with the m-th), accepted, clip fractions
    ex = re.findall(r"graft -> (A|B)  steps\s+(\S+):\s+(\S+) groups received of\s+\S+ candidates,\s+(\S+) "
                    r"responses accepted; s \S+; clip fraction peer (\S+), own (\S+)$", text, re.M)
    assert len(ex) == 2 * 3
    for m, label, recv, acc, clip_peer, clip_own in ex:
        step = int(label) - 1
        ro = {s: _rollouts(pdir / "seed0" / "graft" / "exchange", s.lower(), step) for s in "AB"}
        assert ro["A"].prompt_ids == ro["B"].prompt_ids
        k = {s: ro[s].rewards.sum(1).tolist() for s in "AB"}
        cand = {s: sorted((k[o][g] for g in range(len(k[s])) if k[s][g] == 0 and 0 < k[o][g] < n), reverse=True)
                for s, o in ("AB", "BA")}  # the source's successes on each candidate of receiver s
        top = min(len(c) for c in cand.values())
        kept = sum(x >= cand[m][top - 1] for x in cand[m]) if top else 0
        assert float(recv) == kept
        metrics = [json.loads(x) for x in (pdir / "seed0" / "graft" / m / "metrics.jsonl").read_text().splitlines()]
        row = next(x for x in metrics if x["step"] == step)
        assert row["selected"] == kept
        assert float(acc) == pytest.approx(row["accepted"], abs=0.051)
        for cell, key in ((clip_peer, "pg/clipfrac_peer"), (clip_own, "pg/clipfrac_own")):
            v = row.get(key) if key == "pg/clipfrac_own" or row["accepted"] > 0 else None  # no peer tokens: "-"
            assert cell == "-" if v is None or v != v else float(cell) == pytest.approx(v, abs=5.1e-5)


def test_report_prints_the_tables_the_run_printed(smoke):
    """`python -m tools.tiny report RUN_DIR` recomputes the tables from the run's files: its Markdown blocks are
    exactly what the run printed (panel first, then the held-out table), under the run's command."""
    out, r = smoke
    rep = subprocess.run([sys.executable, "-m", "tools.tiny", "report", str(out)], cwd=HERE, capture_output=True,
                         text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert rep.returncode == 0, rep.stderr[-3000:]
    blocks = re.findall(r"^```text\n(.*?)\n```$", rep.stdout, re.S | re.M)
    assert len(blocks) == 2 and blocks[0].startswith("mechanism panel") and "beyond-sample subset" in blocks[1]
    printed = "\n\n".join(blocks)
    assert printed + "\n" in r.stdout and (out / "results.txt").read_text() == printed + "\n"
    assert re.search(r"^#### Mechanism panel .*^#### Held-out table", rep.stdout, re.S | re.M)
    assert f"Command: `python -m tools.tiny --out {out} --smoke --models 3`; " in rep.stdout
