"""Tests of panel.py, the mechanism panel for any pair (`graft.py panel`).

The pick and the report's helpers against hand-computed examples and references (torch.quantile); the
flags' parsing (a training flag is never read as a panel flag); and one panel on the two committed tiny
models through `graft.py panel`, with a held-out file and a second GRAFT arm, whose every printed figure
is recomputed here by plain loops from the rollout files, metrics.jsonl and the evaluations.

The real pair's panel (`bash run_pair.sh real`) is tests/test_real.py.
"""

import json
import os
import re
import subprocess
import sys

import pytest
import torch

from tools import panel

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository root
from data import tiny_tasks

ENV = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")

# ------------------------------------------------------------------------------------------------
# The pick, windows, quantiles, notes
# ------------------------------------------------------------------------------------------------


def test_pick_halves_and_windows_by_hand():
    # n = 4 samples; the pool's order decides which of a kind come first
    a = {"p0": [0, 0, 0, 0], "p1": [0, 0, 0, 0], "p2": [1, 1, 0, 1], "p3": [0, 0, 0, 0], "p4": [1, 1, 1, 1],
         "p5": [0, 1, 0, 0]}
    b = {"p0": [1, 1, 1, 1], "p1": [0, 1, 1, 0], "p2": [0, 0, 0, 0], "p3": [1, 0, 0, 0], "p4": [0, 0, 0, 0],
         "p5": [0, 0, 0, 0]}
    order = ["p5", "p4", "p3", "p2", "p1", "p0"]
    # A fails p0 (B solves 4/4: not mixed, excluded), p1 and p3 (B mixed); B fails p2 and p5 (A mixed), p4
    # (A solves 4/4: excluded)
    assert panel.pick_halves(a, b, order, 5, peer_solves=(1, 3)) == {"A": ["p3", "p1"], "B": ["p5", "p2"]}
    assert panel.pick_halves(a, b, order, 1, peer_solves=(1, 3)) == {"A": ["p3"], "B": ["p5"]}
    # the peer window: with 2-3 of 4, p3 (B solves 1) and p5 (A solves 1) drop out
    assert panel.pick_halves(a, b, order, 5, peer_solves=(2, 3)) == {"A": ["p1"], "B": ["p2"]}
    assert panel.parse_peer_window("2-6", 8) == (2, 6)
    for bad in ("0-6", "2-8", "6-2", "2", "a-b"):
        with pytest.raises(SystemExit, match="--peer"):
            panel.parse_peer_window(bad, 8)
    assert panel.windows(30) == [(0, 10), (10, 20), (20, 30)]
    assert panel.windows(31) == [(0, 10), (10, 20), (20, 31)] and panel.windows(2) == [(0, 1), (1, 2)]
    assert panel.windows(12, 4) == [(0, 3), (3, 6), (6, 9), (9, 12)]
    assert [panel.window_label(w) for w in panel.windows(3)] == ["1", "2", "3"]
    assert panel.window_label((0, 10)) == "1-10"


def test_quantiles_match_torch_and_skip_nan():
    g = torch.Generator().manual_seed(0)
    for size in (1, 2, 7, 30):
        xs = torch.rand(size, generator=g, dtype=torch.float64)
        ref = torch.quantile(xs, torch.tensor([0.1, 0.5, 0.9], dtype=torch.float64)).tolist()  # linear
        assert panel.quantiles(xs.tolist() + [float("nan")]) == pytest.approx(ref, abs=1e-12)
    assert all(v != v for v in panel.quantiles([float("nan")]))


def test_step_scores_are_each_response_and_fall_back_to_a_step_mean():
    lines = [{"step": 0, "s_each": [0.5, 0.9], "mean_s": 0.7}, {"step": 1, "s_each": [], "mean_s": float("nan")},
             {"step": 2, "mean_s": 0.3}, {"step": 3}]  # steps 2-3: a run written before s_each was logged
    got = panel.step_scores(lines)
    assert got[:3] == [0.5, 0.9, 0.3] and len(got) == 4 and got[3] != got[3]
    assert panel.quantiles(got) == pytest.approx([0.34, 0.5, 0.82])  # the NaN of a step without s is skipped


def test_gate_split_by_hand():
    from types import SimpleNamespace
    # a peer step of 3 groups x n = 2; the receiver got groups 2 and 0; response 5 was dropped as too long
    peer = SimpleNamespace(n=2, mask=torch.ones(3, 2, dtype=torch.bool), rewards=torch.tensor([[1., 0.], [1., 1.],
                                                                                              [0., 1.]]))
    line = {"s_each": [0.9, 0.3, 0.85], "s_index": [0, 1, 4], "dropped_length": 1, "accepted": 2}
    got = panel.gate_split(line, peer, [2, 0], delta=0.8, compat_weight=True)
    assert got == {"success": [(0.9, True), (None, False)], "failure": [(0.3, False), (0.85, True)]}
    assert panel.gate_line([got]) == "kept 1 of 2 successes (s median 0.90) and 1 of 2 failures (s median 0.57)"
    assert panel.gate_split(line, peer, [2, 0], delta=0.8, compat_weight=False)["failure"] == [(0.3, True),
                                                                                           (0.85, True)]
    # a line written before s_index: read in the trainer's order when nothing was dropped, else unmatched
    old = {"s_each": [0.9, 0.3, 0.2, 0.85], "dropped_length": 0}
    assert panel.gate_split(old, peer, [2, 0], delta=0.8, compat_weight=True)["success"] == [(0.9, True), (0.85, True)]
    assert panel.gate_split({"s_each": [0.9], "dropped_length": 1}, peer, [0], delta=0.8, compat_weight=True) is None


def test_cells_and_means_by_hand():
    assert panel.cell([0.25]) == "25.0" and panel.cell([0.2, 0.4]) == "30.0+-14.1"
    assert panel.cell([0.05], signed=True) == "+5.0" and panel.cell([float("nan")]) == "-"
    rows = [{"accepted": 3}, {"accepted": float("nan")}, {"other": 1}, {"accepted": 5}]
    assert panel.mean_key(rows, "accepted") == 4.0 and panel.mean_key(rows, "missing") != panel.mean_key(rows, "x")


def test_an_empty_direction_is_named_with_what_to_do():
    arm = panel.Arm("graft")
    notes = panel.empty_directions(arm, {"A": [0, 0, 1, 0, 0, 0, 0, 0], "B": [1, 1, 1, 0]}, True)
    assert len(notes) == 1 and "A received 0.12 groups per step" in notes[0] and "--no-balance" in notes[0]
    notes = panel.empty_directions(arm, {"A": [0, 0], "B": [0, 0]}, False)
    assert len(notes) == 2 and all("--no-balance" not in x for x in notes)
    assert panel.empty_directions(arm, {"A": [1, 0, 0, 0], "B": [2]}, True) == []  # 0.25 per step is enough


def test_training_flags_go_to_graft_and_own_flags_are_refused():
    """The rest of the command line is graft.py train's: --delta stays a training flag (not --deltas), --seed is
    refused (the panel sets each run's), a flag graft.py does not know stops with its name."""
    pc_args, rest = panel.build_parser().parse_known_args(
        ["--model-a", "a", "--model-b", "b", "--prompts", "p.jsonl", "--deltas", "0.5", "--delta", "0.6", "--n", "4",
         "--no-balance", "--lr", "3e-5"])
    assert pc_args.deltas == "0.5" and rest == ["--delta", "0.6", "--n", "4", "--no-balance", "--lr", "3e-5"]
    train = panel.training_settings(rest)
    assert (train["delta"], train["n"], train["balance"], train["lr"]) == (0.6, 4, False, 3e-5)
    assert [a.label for a in panel.arms_of("0.5, 0.7")] == ["grpo", "graft", "graft_d0.5", "graft_d0.7"]
    assert panel.arms_of("0.5")[2].flags == ("--delta", "0.5")
    with pytest.raises(SystemExit, match="--deltas"):
        panel.arms_of("x")
    with pytest.raises(SystemExit, match="--seed is set by the panel"):
        panel.training_settings(["--seed", "3"])
    with pytest.raises(SystemExit, match="not graft.py train's"):
        panel.training_settings(["--no-such-flag"])


def test_held_out_sharing_a_problem_with_the_pool_is_refused(tmp_path):
    pool = [{"id": f"p{i}", "problem": f"{i} + 1", "answer": str(i + 1)} for i in range(10)]
    held = [{"id": "h0", "problem": "3 + 1", "answer": "4"}, {"id": "h1", "problem": "40 + 1", "answer": "41"}]
    panel.write_jsonl(str(tmp_path / "pool.jsonl"), pool)
    panel.write_jsonl(str(tmp_path / "held.jsonl"), held)
    pc = panel.PanelConfig(model_a="a", model_b="b", prompts=str(tmp_path / "pool.jsonl"), pool=10, half=2,
                           held_out=str(tmp_path / "held.jsonl"))
    train = panel.training_settings([])
    with pytest.raises(SystemExit, match=r"--held-out: 1 of its 2 problems are in --prompts too \(e.g. h0\)"):
        panel.validate(pc, train)
    pc.held_out = str(tmp_path / "missing.jsonl")
    with pytest.raises(SystemExit, match="--held-out: no file"):
        panel.validate(pc, train)


def _fake_evaluations(monkeypatch, solved):
    """Replace run_jobs by a fake evaluation: model -> (problem index -> solved samples of 8). Returns the names
    of the jobs it ran (cached ones skipped, as run_jobs does)."""
    ran = []

    def fake_run_jobs(jobs, slots, timing, timing_file=None, *, tag="panel"):
        for job in jobs:
            if all(os.path.exists(p) for p in job.outputs):
                continue
            ran.append(job.name)
            for args, _ in job.procs:
                model = os.path.basename(args[args.index("--model") + 1])
                prompts = args[args.index("--benchmarks") + 1]
                stem = os.path.splitext(os.path.basename(prompts))[0]
                k = [solved[model](int(r["id"][1:])) for r in panel.load_jsonl(prompts)]
                probs = [{"id": r["id"], "correct": [1.0] * s + [0.0] * (8 - s)}
                         for r, s in zip(panel.load_jsonl(prompts), k)]
                with open(args[args.index("--eval-out") + 1], "w") as f:
                    json.dump({"problems": {stem: probs}}, f)
        return []
    monkeypatch.setattr(panel, "run_jobs", fake_run_jobs)
    return ran


def test_a_short_pick_says_raise_the_pool_and_raising_it_continues(tmp_path, monkeypatch):
    """A pick that runs out of pool stops with "raise --pool" and names --no-balance; doing what it says on the
    same --out passes the settings check and evaluates only the chunks not yet evaluated. The evaluations are
    faked (a fixed table of outcomes by problem) so that the pick's own logic is what runs."""
    rows = [{"id": f"q{i:02d}", "problem": f"p{i}", "answer": "1", "family": "add"} for i in range(24)]
    panel.write_jsonl(str(tmp_path / "pool.jsonl"), rows)
    ran = _fake_evaluations(monkeypatch, {"A": lambda i: 0 if i % 6 == 0 else 3 if i % 6 == 1 else 8,
                                          "B": lambda i: 3 if i % 6 == 0 else 0 if i % 6 == 1 else 8})
    pc = panel.PanelConfig(model_a="m/A", model_b="m/B", prompts=str(tmp_path / "pool.jsonl"),
                           out=str(tmp_path / "out"), half=2, chunk=4, pool=4)
    train = panel.training_settings([])
    with pytest.raises(SystemExit, match=r"raise --pool \(the chunks evaluated so far are kept\).*--no-balance"):
        panel.prepare(pc, train, {}, str(tmp_path / "timing.json"))
    assert ran == ["pick 1"] and not (tmp_path / "out" / "set.json").exists()
    pc.pool = 24  # what the message says
    jobs = panel.prepare(pc, train, {}, str(tmp_path / "timing.json"))
    meta = json.loads((tmp_path / "out" / "set.json").read_text())
    assert ran[0] == "pick 1" and "pick 1" not in ran[1:] and len(ran) == meta["chunks"]
    assert all(int(q[1:]) % 6 == 0 for q in meta["halves"]["A"]) and len(meta["halves"]["A"]) == 2
    assert all(int(q[1:]) % 6 == 1 for q in meta["halves"]["B"]) and len(meta["halves"]["B"]) == 2
    # the jobs: the pair first, then GRPO for each model, with the panel's own flags and the training flags
    assert [j.name for j in jobs] == ["panel/s0/graft", "panel/s0/grpo/A", "panel/s0/grpo/B"]
    args = jobs[0].procs[0][0]
    assert args[args.index("--prompts-per-step") + 1] == "4" and args[args.index("--peer-name") + 1] == "b"
    pc.half = 3  # another setting on the same folder is refused
    with pytest.raises(SystemExit, match="holds a panel made with other settings"):
        panel.prepare(pc, train, {}, str(tmp_path / "timing.json"))


FAKE_GRAFT = """import os, sys, time
# A stand-in for graft.py in the scheduler tests: sleep, fail (exit 3) if a file it needs is missing, then write
# its output file. argv: seconds, output path, needed path or "-".
seconds, out, need = float(sys.argv[1]), sys.argv[2], sys.argv[3]
time.sleep(seconds)
if need != "-" and not os.path.exists(need):
    sys.exit(3)
open(out, "w").write("done")
"""


def _fake_job(tmp_path, name, seconds, out, *, need="-", deps=()):
    out = str(tmp_path / out)
    return panel.Job(name, [([str(seconds), out, need], out + ".log")], [out], deps=deps)


def test_two_lists_with_the_same_run_names_queue_apart(tmp_path, monkeypatch):
    """Issue 50's race, planted: two job lists that both name a run `s0/grpo/A`, queued together. The second
    list's run (the one its evaluation waits for) is the slow one, so an evaluation that started when the first
    list's run of the same name finished would find no checkpoint (exit 3, run_jobs stops). With each list
    under its own prefix the evaluation waits for its own run whatever finishes first; unprefixed, the queue is
    refused at once."""
    (tmp_path / "graft.py").write_text(FAKE_GRAFT)
    monkeypatch.setattr(panel, "HERE", str(tmp_path))  # run_jobs starts <HERE>/graft.py
    quick = [_fake_job(tmp_path, "s0/grpo/A", 0, "panel_run")]
    slow = [_fake_job(tmp_path, "s0/grpo/A", 1.5, "held_run"),
            _fake_job(tmp_path, "eval s0/grpo/A", 0, "held_eval", need=str(tmp_path / "held_run"),
                      deps=("s0/grpo/A",))]
    with pytest.raises(ValueError, match=r"repeated: \['s0/grpo/A'\]"):
        panel.run_jobs(quick + slow, 2, {})
    timing = {}
    jobs = panel.with_prefix("panel", quick) + panel.with_prefix("held-out", slow)
    assert [j.name for j in jobs] == ["panel/s0/grpo/A", "held-out/s0/grpo/A", "held-out/eval s0/grpo/A"]
    assert jobs[2].deps == ("held-out/s0/grpo/A",)
    panel.run_jobs(jobs, 2, timing)  # would stop with "job held-out/eval s0/grpo/A failed" if it started early
    assert all(os.path.exists(p) for j in jobs for p in j.outputs)
    assert set(timing) == {j.name for j in jobs}


def test_a_one_sided_pool_runs_under_no_balance(tmp_path, monkeypatch):
    """B never fails: B's half stays empty. With the balanced swap the pick stops (the run would exchange
    nothing); with --no-balance it runs with A's half alone and says so."""
    rows = [{"id": f"q{i:02d}", "problem": f"p{i}", "answer": "1"} for i in range(12)]
    panel.write_jsonl(str(tmp_path / "pool.jsonl"), rows)
    _fake_evaluations(monkeypatch, {"A": lambda i: 0 if i % 2 else 8, "B": lambda i: 4})
    pc = panel.PanelConfig(model_a="m/A", model_b="m/B", prompts=str(tmp_path / "pool.jsonl"),
                           out=str(tmp_path / "out"), half=3, chunk=12, pool=12)
    with pytest.raises(SystemExit, match=r"only \{'B': 0\} problems of a half"):
        panel.prepare(pc, panel.training_settings([]), {}, str(tmp_path / "t.json"))
    pc.out = str(tmp_path / "out2")
    panel.prepare(pc, panel.training_settings(["--no-balance"]), {}, str(tmp_path / "t.json"))
    meta = json.loads((tmp_path / "out2" / "set.json").read_text())
    order = [json.loads(x)["id"] for x in (tmp_path / "out2" / "pool_00.jsonl").read_text().splitlines()]
    assert sorted(order) == [r["id"] for r in rows] and order != sorted(order)  # the seeded shuffle
    assert meta["halves"] == {"A": [q for q in order if int(q[1:]) % 2][:3], "B": []}


# ------------------------------------------------------------------------------------------------
# One panel on the tiny models, every printed figure recomputed from the files
# ------------------------------------------------------------------------------------------------

STEPS = 2


@pytest.fixture(scope="module")
def tiny_panel(tmp_path_factory):
    """`graft.py panel` on the committed tiny models: 2 x 2 problems, 2 steps, a second GRAFT arm at delta 0,
    a 12-problem held-out file at k = 2. Returns (folder, completed process, held-out rows)."""
    root = tmp_path_factory.mktemp("panel")
    train, test = tiny_tasks.generate(0, 1500, 12)
    tiny_tasks.write_jsonl(str(root / "pool.jsonl"), train)
    tiny_tasks.write_jsonl(str(root / "held.jsonl"), test)
    models = os.path.join(HERE, "data", "tiny_models")
    out = root / "out"
    cmd = [sys.executable, os.path.join(HERE, "graft.py"), "panel", "--model-a", os.path.join(models, "A"),
           "--model-b", os.path.join(models, "B"), "--prompts", str(root / "pool.jsonl"), "--held-out",
           str(root / "held.jsonl"), "--out", str(out), "--half", "2", "--pool", "1500", "--chunk", "150",
           "--steps", str(STEPS), "--windows", "2", "--deltas", "0", "--eval-samples", "2",
           "--eval-flags=--static-decode",
           # the training flags
           "--n", "8", "--lr", "1e-4", "--minibatches", "2", "--max-response-tokens", "68", "--prompt-template",
           "{problem}\n", "--threads", "1", "--save-every", str(STEPS), "--gen-batch-size", "1024"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=2400, env=ENV)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return out, r, test


def _rollouts(folder, name, step):
    from exchange import load_rollouts, rollout_path
    from pathlib import Path
    return load_rollouts(rollout_path(Path(folder), name, step))[0]


def test_tiny_panel_every_printed_figure_comes_from_the_files(tiny_panel):
    out, r, held = tiny_panel
    text = r.stdout
    meta = json.loads((out / "set.json").read_text())
    halves, n = meta["halves"], meta["samples"]
    lo, hi = meta["peer_solves"]
    assert len(halves["A"]) == len(halves["B"]) == 2 and not set(halves["A"]) & set(halves["B"])
    # the halves: the first of each kind in pool order, by the pick's own samples
    pick, pool_ids = {"A": {}, "B": {}}, []
    for c in range(meta["chunks"]):
        pool_ids += [json.loads(x)["id"] for x in (out / f"pool_{c:02d}.jsonl").read_text().splitlines()]
        for m in "AB":
            pick[m].update(panel.load_eval(str(out / f"pick_{m}_{c:02d}.json"))[f"pool_{c:02d}"])
    for own, peer in (("A", "B"), ("B", "A")):
        kind = [q for q in pool_ids if sum(pick[own][q]) == 0 and lo <= sum(pick[peer][q]) <= hi]
        assert halves[own] == kind[:2]
        assert f"  {own} fails: " in text and f"({len(kind)} such problems among the {meta['pool']})" in text
    # each model's pass@1 by kind before RL, from the pick's samples
    fam = {x["id"]: x["family"] for x in map(json.loads, (out.parent / "pool.jsonl").read_text().splitlines())}
    for m in "AB":
        line = re.search(rf"^  {m} before RL, pass@1 \(%\) on the pick's problems by kind: (.*)$", text, re.M).group(1)
        for kind, value in (x.rsplit(" ", 1) for x in line.split(", ")):
            ids = [q for q in pick[m] if kind == "all" or fam[q] == kind]
            assert float(value) == pytest.approx(100 * sum(sum(pick[m][q]) / n for q in ids) / len(ids), abs=0.051)
        assert line.endswith(f"all {100 * sum(map(sum, pick[m].values())) / (n * len(pick[m])):.1f}")
    # train reward per half and window, per arm, and the differences to GRPO
    arms = {"grpo": None, "graft": out / "seed0" / "graft" / "exchange",
            "graft_d0": out / "seed0" / "graft_d0" / "exchange"}
    rows = re.findall(r"^(A|B)\s+(own|other) \((A|B) fails\)\s+(\d+)\s+(\S+)\s+(\S+)\s+(\S+)\s+(\S+)\s+(\S+)$",
                      text, re.M)
    assert len(rows) == 2 * 2 * STEPS
    for m, half, who, label, grpo, graft_, diff, graft0, diff0 in rows:
        step = int(label) - 1  # two windows of one step each
        got = {}
        for arm, folder in arms.items():
            folder = folder or out / "seed0" / "grpo" / m / "exchange"
            ro = _rollouts(folder, m.lower(), step)
            vals = [float(ro.rewards[g, i]) for g, q in enumerate(ro.prompt_ids) if q in halves[who]
                    for i in range(ro.rewards.shape[1])]
            assert len(vals) == 2 * n
            got[arm] = 100 * sum(vals) / len(vals)
        assert float(grpo) == pytest.approx(got["grpo"], abs=0.051)
        assert float(graft_) == pytest.approx(got["graft"], abs=0.051)
        assert float(graft0) == pytest.approx(got["graft_d0"], abs=0.051)
        assert float(diff) == pytest.approx(got["graft"] - got["grpo"], abs=0.051)
        assert float(diff0) == pytest.approx(got["graft_d0"] - got["grpo"], abs=0.051)
    # the exchange lines: the balanced swap by hand from the rollout files, the rest from metrics.jsonl
    ex = re.findall(r"^  (graft|graft_d0) -> (A|B)  steps\s+(\S+):\s+(\S+) groups received of\s+(\S+) candidates,"
                    r"\s+(\S+) responses accepted; s (\S+)/(\S+)/(\S+); clip fraction peer (\S+), own (\S+)"
                    r"(?:\n    gate: kept (\d+) of (\d+) successes \(s median (\S+)\) and (\d+) of (\d+) failures "
                    r"\(s median (\S+)\))?$", text, re.M)
    assert len(ex) == 2 * 2 * STEPS
    moved = gated = 0
    for arm, m, label, recv, cand, acc, s10, s50, s90, clip_peer, clip_own, *gate in ex:
        step = int(label) - 1
        ro = {s: _rollouts(arms[arm], s.lower(), step) for s in "AB"}
        k = {s: ro[s].rewards.sum(1).tolist() for s in "AB"}
        cands = {s: sorted((k[o][g] for g in range(len(k[s])) if k[s][g] == 0 and 0 < k[o][g] < n), reverse=True)
                 for s, o in ("AB", "BA")}  # the source's successes on each candidate of receiver s
        top = min(len(c) for c in cands.values())
        kept = sum(x >= cands[m][top - 1] for x in cands[m]) if top else 0
        assert float(recv) == kept and float(cand) == len(cands[m])
        o = "B" if m == "A" else "A"
        got_groups = [g for g in range(len(k[m])) if k[m][g] == 0 and 0 < k[o][g] < n and top
                      and k[o][g] >= cands[m][top - 1]]
        moved += kept
        row = next(x for x in map(json.loads, (out / "seed0" / arm / m / "metrics.jsonl").read_text().splitlines())
                   if x["step"] == step)
        assert row["selected"] == kept and row["candidates_in"] == len(cands[m])
        assert float(acc) == pytest.approx(row["accepted"], abs=0.051)
        # one step per window: the quantiles are over that step's scored responses, each one's s
        assert len(row["s_each"]) == row["accepted"] + row["rejected"]
        if row["s_each"]:
            assert sum(row["s_each"]) / len(row["s_each"]) == pytest.approx(row["mean_s"], abs=1e-4)
            want = torch.quantile(torch.tensor(row["s_each"], dtype=torch.float64), torch.tensor([0.1, 0.5, 0.9],
                                                                                           dtype=torch.float64))
            assert [float(q) for q in (s10, s50, s90)] == pytest.approx(want.tolist(), abs=0.0051)
        else:
            assert (s10, s50, s90) == ("-", "-", "-")
        # the gate by the source's verdicts: each received response's s at its index, kept when s > delta
        s_of = dict(zip(row["s_index"], row["s_each"]))
        delta = 0.0 if arm == "graft_d0" else json.loads((out / "seed0" / arm / m / "run.json").read_text())[
            "settings"]["delta"]
        want = []
        for ok in (True, False):
            got_s = [s_of.get(g * n + i) for g in got_groups for i in range(n) if (ro[o].rewards[g, i] > 0) == ok]
            scored = [x for x in got_s if x is not None]
            med = "-" if not scored else f"{float(torch.tensor(scored, dtype=torch.float64).quantile(0.5)):.2f}"
            want += [str(sum(1 for x in scored if x > delta)), str(len(got_s)), med]
        assert gate == (want if got_groups else [""] * 6), (arm, m, label)
        if got_groups:
            assert int(want[0]) + int(want[3]) == row["accepted"]
            gated += 1
        for cell_, key in ((clip_peer, "pg/clipfrac_peer"), (clip_own, "pg/clipfrac_own")):
            v = row.get(key) if key == "pg/clipfrac_own" or row["accepted"] > 0 else None  # no peer tokens: "-"
            assert cell_ == "-" if v is None or v != v else float(cell_) == pytest.approx(v, abs=5.1e-5)
    assert moved > 0 and gated > 0, "nothing was exchanged: the test checks nothing of the swap or the gate"
    # the delta-0 arm accepts every scored response; the flag reached its processes
    assert json.loads((out / "seed0" / "graft_d0" / "A" / "run.json").read_text())["settings"]["delta"] == 0.0
    # held-out: pass@1 before and after each arm, overall and per kind, from the evaluations
    fam = {x["id"]: x["family"] for x in held}
    hrows = re.findall(r"^(A|B)\s+(\w+)\s+(\S+)\s+(\S+)\s+(\S+)\s+(\S+)\s+(\S+)\s+(\S+)$",
                       text.split("held-out:")[1], re.M)
    assert len(hrows) == 2 * (1 + len(set(fam.values())))

    def acc(path, kind):
        res = panel.load_eval(str(path))["held"]
        ids = [q for q in res if kind == "all" or fam[q] == kind]
        assert {len(res[q]) for q in ids} == {2}
        return 100 * sum(sum(res[q]) / 2 for q in ids) / len(ids)
    for m, kind, before, grpo, graft_, diff, graft0, diff0 in hrows:
        after = {a: acc(out / "seed0" / a / m / "held_out.json", kind) for a in ("grpo", "graft", "graft_d0")}
        assert float(before) == pytest.approx(acc(out / "eval" / f"before_{m}.json", kind), abs=0.051)
        assert float(grpo) == pytest.approx(after["grpo"], abs=0.051)
        assert float(graft_) == pytest.approx(after["graft"], abs=0.051)
        assert float(graft0) == pytest.approx(after["graft_d0"], abs=0.051)
        assert float(diff) == pytest.approx(after["graft"] - after["grpo"], abs=0.051)
        assert float(diff0) == pytest.approx(after["graft_d0"] - after["grpo"], abs=0.051)


def test_tiny_panel_report_reprints_and_a_rerun_is_cached(tiny_panel):
    """`graft.py panel report OUT` prints what the run printed (from the files); the same command again runs
    nothing (every job cached) and prints the same panel."""
    out, r, _ = tiny_panel
    rep = subprocess.run([sys.executable, os.path.join(HERE, "graft.py"), "panel", "report", str(out)],
                         capture_output=True, text=True, timeout=600, env=ENV)
    assert rep.returncode == 0, rep.stderr[-3000:]
    assert rep.stdout == (out / "panel.txt").read_text() and rep.stdout in r.stdout
    csv = (out / "panel.csv").read_text().splitlines()
    assert csv[0] == "seed,arm,model,half,steps,value" and any(",graft_d0,A,received," in x for x in csv)


def test_a_running_panel_is_reported_over_the_steps_every_run_finished(tiny_panel, tmp_path):
    """`panel report` on a panel whose runs are still going: the steps every run finished (one run's metrics cut
    to its first line here), labelled PARTIAL, the first window's rows as the whole run printed them, no
    held-out table yet; before any step it says so."""
    import shutil
    out, r, _ = tiny_panel
    run = tmp_path / "out"
    shutil.copytree(out, run)
    info = json.loads((run / "run.json").read_text())
    (run / "run.json").write_text(json.dumps(info | {"finished": None}))
    metrics = run / "seed0" / "grpo" / "B" / "metrics.jsonl"
    metrics.write_text(metrics.read_text().splitlines()[0] + "\n")
    rep = subprocess.run([sys.executable, os.path.join(HERE, "graft.py"), "panel", "report", str(run)],
                         capture_output=True, text=True, timeout=600, env=ENV)
    assert rep.returncode == 0, rep.stderr[-3000:]
    assert f"PARTIAL: the runs are still going; the first 1 of {STEPS} steps" in rep.stdout
    assert "held-out: evaluated after the runs' last step" in rep.stdout and "before RL" in rep.stdout
    first = [x for x in r.stdout.splitlines() if re.match(r"^(A|B)\s+(own|other) .*\s1\s", x)]
    got = [x for x in rep.stdout.splitlines() if re.match(r"^(A|B)\s+(own|other) ", x)]
    assert len(first) == 4 and got == first  # one window: step 1, as the finished run printed it
    metrics.write_text("")
    rep = subprocess.run([sys.executable, os.path.join(HERE, "graft.py"), "panel", "report", str(run)],
                         capture_output=True, text=True, timeout=600, env=ENV)
    assert rep.returncode != 0 and "no run has finished a step yet" in rep.stderr
