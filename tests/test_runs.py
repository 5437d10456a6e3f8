"""Run safety: nothing written by an earlier run is lost or taken for this run's, a dead peer is
noticed, non-finite numbers stop the run, and bad input fails at start with a message naming the
file, field or flag. Tiny models on CPU (the fixtures of test_graft.py).

Run: python -m pytest -q test_runs.py
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import exchange
import graft
from test_graft import (ROOT, common_flags, exchange_phases, planted, read_metrics, run_py,  # noqa: F401
                        tiny)  # (tiny: fixture)
from core import assignment_digest, balanced_swap, success_counts
from exchange import (Heartbeat, StepRollouts, join_run, leave_run, load_rollouts, rollout_path, save_rollouts,
                      wait_for_file, write_failed, write_json)


def train(tiny, out, *extra, steps=1, script=None):
    args = [str(script or tiny / "planted.py"), "train", "--model", str(tiny / "ma"), "--out", str(out)]
    return run_py(args + common_flags(tiny, steps=steps) + list(extra), ROOT)


def pair_procs(tiny, tmp_path, ex, *extra, steps=2, names=("a", "b")):
    """Start the two sides of a pair as background processes; returns them (stdout+stderr piped)."""
    procs = []
    for name, peer, model in ((names[0], names[1], "ma"), (names[1], names[0], "mb")):
        args = [str(tiny / "planted.py"), "train", "--model", str(tiny / model), "--name", name, "--peer-name", peer,
                "--out", str(tmp_path / name), "--peer-exchange", str(ex)]
        args += common_flags(tiny, steps=steps) + list(extra)
        env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
        procs.append(subprocess.Popen([sys.executable] + args, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    return procs


# ------------------------------------------------------------------------------------------------
# 1. An existing run directory is never overwritten by accident
# ------------------------------------------------------------------------------------------------


def test_existing_out_needs_resume_or_force(tiny, tmp_path):
    out = tmp_path / "run"
    assert train(tiny, out).returncode == 0
    first = (out / "metrics.jsonl").read_text()
    ckpts = sorted(p.name for p in (out / "checkpoints").iterdir())
    r = train(tiny, out, steps=2)
    assert r.returncode != 0 and "already holds a run" in r.stderr and "--resume" in r.stderr and "--force" in r.stderr
    assert (out / "metrics.jsonl").read_text() == first  # nothing of the first run was touched
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ckpts
    r = train(tiny, out, "--force", steps=2)
    assert r.returncode == 0, r.stderr[-2000:]
    assert [m["step"] for m in read_metrics(out / "metrics.jsonl")] == [0, 1]  # a new run, from step 0
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_000002"]


# ------------------------------------------------------------------------------------------------
# 2. Run identity: files and markers of another run are refused or ignored
# ------------------------------------------------------------------------------------------------


def test_join_run_founds_joins_and_refuses(tmp_path):
    ex = tmp_path / "ex"
    rid = join_run(ex, "a")
    beat = Heartbeat(ex, "a", rid, interval=0.2)
    try:
        assert join_run(ex, "b") == rid  # the founder is alive: b adopts its identity
        with pytest.raises(RuntimeError, match="side 'a' already took part in run"):
            join_run(ex, "a")  # a fresh start of a in the same folder
        assert join_run(ex, "a", previous=rid) == rid  # --resume keeps the identity
        with pytest.raises(RuntimeError, match="belongs to run"):
            join_run(ex, "a", previous="another")
    finally:
        beat.stop("finished")
    with pytest.raises(RuntimeError, match="started by side 'a', which is not running"):
        join_run(ex, "c")  # a dead run's leftovers are not joined
    leave_run(ex, "a")  # --force on a: nobody of that run is alive, so the record goes too
    leave_run(ex, "b")
    assert join_run(ex, "b") != rid  # a new run


def test_force_keeps_a_run_the_peer_founded_after_it_looked(tmp_path, monkeypatch):
    """Both sides relaunched with --force at once: b's leave_run reads the folder while a's has just moved the old
    record away (no record), then a founds the new run before b acts on what it read. b must not delete a's new
    record: the two sides would then run under two ids, each ignoring the other's files until the timeout."""
    ex = tmp_path / "ex"
    rid = join_run(ex, "a", peer_names=["b"])  # a's new run, founded after b's read below
    real, reads = exchange.read_json, []

    def stale_first_read(path):  # the record as b saw it a moment earlier: absent
        reads.append(Path(path).name)
        return None if reads.count("RUN") == 1 and Path(path).name == "RUN" else real(path)

    monkeypatch.setattr(exchange, "read_json", stale_first_read)
    leave_run(ex, "b")
    monkeypatch.setattr(exchange, "read_json", real)
    assert (exchange.read_json(ex / "RUN") or {}).get("run_id") == rid, "b's --force deleted a's new run record"
    (ex / "RUN").write_text("{not json")  # an unreadable record is still removed by --force
    leave_run(ex, "b")
    assert not (ex / "RUN").exists()


def _one_group_file(exchange_dir, run_id):
    """Side b's step-0 rollout file (one group, n = 2) of run ``run_id``; returns its path."""
    n, G = 2, 1
    r = StepRollouts(prompt_ids=["x"], tokens=[[1], [2]], logprobs=[torch.zeros(1), torch.zeros(1)],
                     texts=["a", "b"], eos=torch.ones(G, n, dtype=torch.bool),
                     rewards=torch.tensor([[1.0, 0.0]]), advantages=torch.zeros(G, n))
    path = rollout_path(exchange_dir, "b", 0)
    save_rollouts(path, r, {"run_id": run_id})
    return path


def test_files_and_markers_of_another_run(tmp_path, capsys):
    path = _one_group_file(tmp_path, "old")
    with pytest.raises(ValueError, match="step_000000.safetensors: written by run 'old', this pair is run 'new'"):
        load_rollouts(path, n=2, run_id="new")
    t0 = time.time()
    with pytest.raises(TimeoutError):  # another run's step file is not this run's: keep waiting
        wait_for_file(path, timeout=0.5, run_id="new")
    assert time.time() - t0 >= 0.5
    assert wait_for_file(path, timeout=0.5, run_id="old") < 0.5  # the right run's file is taken at once
    write_failed(tmp_path, "b", "old", "RuntimeError: a crash of the earlier run")
    with pytest.raises(TimeoutError):  # the stale marker does not stop this run; only the timeout does
        wait_for_file(rollout_path(tmp_path, "b", 1), timeout=0.5, run_id="new")
    err = capsys.readouterr().err
    assert "ignoring" in err and "belongs to run 'old', not this run 'new'" in err, err  # said, once


def test_wait_takes_a_file_written_between_its_checks(tmp_path, monkeypatch, capsys):
    """The peer's step file can appear (or become readable) between the wait loop's test and its check for
    stale files: the wait then returns the file, without calling it stale or failing."""
    path = _one_group_file(tmp_path, "r")
    real, calls = exchange.file_run_id, []

    def late(p):  # the first read sees no run id (not yet there), every later one this run's
        calls.append(p)
        return None if len(calls) == 1 else real(p)
    monkeypatch.setattr(exchange, "file_run_id", late)
    assert exchange.wait_for_file(path, timeout=5, run_id="r") < 5
    assert len(calls) >= 2 and "ignoring" not in capsys.readouterr().err


def test_relaunch_in_an_old_exchange_folder_is_refused(tiny, tmp_path):
    ex = tmp_path / "ex"
    procs = pair_procs(tiny, tmp_path, ex, steps=1)
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    t0 = time.time()
    r = train(tiny, tmp_path / "again", "--name", "a", "--peer-name", "b", "--peer-exchange", str(ex), steps=2)
    assert r.returncode != 0 and "already took part in run" in r.stderr, r.stderr[-2000:]
    assert not (tmp_path / "again" / "metrics.jsonl").exists() and time.time() - t0 < 60  # refused at start
    # Both sides relaunched with --force in the same folder: a new run, whose files alone are read.
    old_run = json.loads((ex / "RUN").read_text())["run_id"]
    procs = pair_procs(tiny, tmp_path, ex, "--force", steps=2)
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[-2000:] for o in outs]
    new_run = json.loads((ex / "RUN").read_text())["run_id"]
    assert new_run != old_run
    for side in "ab":
        assert [m["step"] for m in read_metrics(tmp_path / side / "metrics.jsonl")] == [0, 1]
        for step in range(2):
            assert load_rollouts(rollout_path(ex, side, step), run_id=new_run)[1]["run_id"] == new_run
    for step in range(2):  # both sides log the same fingerprint of the step's swap, recomputed here from the files
        a, b = (load_rollouts(rollout_path(ex, s, step), run_id=new_run)[0] for s in "ab")
        a_to_b, b_to_a = balanced_swap(k_a=success_counts(a.rewards),
                                       k_b=success_counts(b.rewards), n=a.n)
        src = torch.stack([torch.where(b_to_a, 1, -1), torch.where(a_to_b, 0, -1)])  # (2, G)
        want = assignment_digest(src, a.prompt_ids)
        assert [read_metrics(tmp_path / s / "metrics.jsonl")[step]["assignment"] for s in "ab"] == [want, want]


# ------------------------------------------------------------------------------------------------
# 3. Liveness: a killed peer is noticed by its heartbeat, a terminated one by its marker
# ------------------------------------------------------------------------------------------------


def test_stale_heartbeat_means_a_dead_peer(tmp_path):
    write_json(tmp_path / "b" / "HEARTBEAT", {"run_id": "r", "pid": 1, "step": 4, "time": time.time() - 100,
                                              "state": "running"})
    t0 = time.time()
    with pytest.raises(RuntimeError, match="the peer is dead: no heartbeat .* for 10[0-9]s"):
        wait_for_file(rollout_path(tmp_path, "b", 5), timeout=30, run_id="r", dead_after=60)
    assert time.time() - t0 < 5
    write_json(tmp_path / "b" / "HEARTBEAT", {"run_id": "r", "step": 4, "time": time.time(), "state": "finished"})
    with pytest.raises(RuntimeError, match="the peer finished"):
        wait_for_file(rollout_path(tmp_path, "b", 5), timeout=30, run_id="r")


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_killed_peer_is_reported_by_the_survivor(tiny, tmp_path, sig):
    ex = tmp_path / "ex"
    a, b = pair_procs(tiny, tmp_path, ex, "--peer-dead-after", "3", "--heartbeat-interval", "1", steps=200)
    deadline = time.time() + 120
    while not rollout_path(ex, "b", 1).exists():  # b is past its start-up and training
        assert time.time() < deadline and b.poll() is None, b.communicate()[0][-2000:]
        time.sleep(0.1)
    b.send_signal(sig)
    b.wait(timeout=60)
    killed = time.time()
    out = a.communicate(timeout=120)[0]
    assert a.returncode != 0
    if sig == signal.SIGKILL:
        assert "the peer is dead" in out, out[-3000:]
    else:
        assert "the peer failed" in out and "SIGTERM" in out, out[-3000:]
        assert json.loads((ex / "b" / "FAILED").read_text())["run_id"] == json.loads((ex / "RUN").read_text())["run_id"]
    assert time.time() - killed < 60
    assert (ex / "a" / "FAILED").is_file()  # the survivor leaves its own marker too


# ------------------------------------------------------------------------------------------------
# 4. Finite checks
# ------------------------------------------------------------------------------------------------


def test_non_finite_rollout_fields_are_refused(tmp_path):
    n, G = 2, 1
    for field, value in (("advantages", float("nan")), ("rewards", float("inf")), ("logprobs", float("nan"))):
        r = StepRollouts(prompt_ids=["x"], tokens=[[1], [2]], logprobs=[torch.zeros(1), torch.zeros(1)],
                         texts=["a", "b"], eos=torch.ones(G, n, dtype=torch.bool),
                         rewards=torch.tensor([[1.0, 0.0]]), advantages=torch.zeros(G, n))
        if field == "logprobs":
            r.logprobs[0][0] = value
        else:
            getattr(r, field)[0, 0] = value
        path = tmp_path / f"{field}.safetensors"
        save_rollouts(path, r, {})
        with pytest.raises(ValueError, match=f"{field}.safetensors: field '{field}' holds 1 non-finite"):
            load_rollouts(path, n=2)


def test_non_finite_loss_or_gradient_stops_before_the_optimizer_step(tiny, tmp_path, monkeypatch):
    tr, batch, own, peer = planted(tiny, tmp_path, monkeypatch, delta=0.0)
    out, replaced, _ = exchange_phases(tr, 0, batch, own, peer)
    before = [p.detach().clone() for p in tr.model.parameters()]
    huge = [graft.Row(r.group, r.prompt, r.response, r.old_logp, 1e30 if r.is_peer else r.adv, r.weight, r.is_peer)
            for r in out]
    tr.cfg.minibatches = 1  # one minibatch: nothing may have stepped before the check
    with pytest.raises(FloatingPointError, match="step 0, minibatch 0: the (gradient norm|loss) is (inf|nan)"):
        tr.update(0, huge, replaced)
    assert all(torch.equal(a, b) for a, b in zip(before, tr.model.parameters()))  # no optimizer step
    nan_old = [graft.Row(r.group, r.prompt, r.response, torch.full_like(r.old_logp, float("nan")), r.adv, r.weight,
                   r.is_peer) for r in out]
    with pytest.raises(FloatingPointError, match="the loss is nan"):
        tr.update(0, nan_old, replaced)


# ------------------------------------------------------------------------------------------------
# 5-6. Fail fast, with messages that name the file, line or flag
# ------------------------------------------------------------------------------------------------


def test_flag_ranges_are_checked(tiny, tmp_path):
    for flag, value, expect in (("--steps", "-2", "--steps: must be >= 1"),
                                ("--rollouts", "1", "--n: GRPO needs at least 2 rollouts"),
                                ("--delta", "1.5", "--delta: must be in [0, 1]"),
                                ("--lr", "0", "--lr: must be > 0")):
        r = train(tiny, tmp_path / "x", flag, value)
        assert r.returncode != 0 and expect in r.stderr, (flag, r.stderr[-1500:])


def test_unwritable_out_fails_before_the_first_rollout(tiny, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    r = train(tiny, blocker / "run")
    assert r.returncode != 0 and "--out: cannot write to" in r.stderr and "step" not in r.stdout, r.stderr[-1500:]


def test_short_peer_log_fails_at_start(tiny, tmp_path, monkeypatch):
    tr, rows, own, peer = planted(tiny, tmp_path, monkeypatch)  # writes a one-step log in tmp_path/log/b
    t0 = time.time()
    r = train(tiny, tmp_path / "off", "--peer-log", str(tmp_path / "log" / "b"), steps=3)
    assert r.returncode != 0, r.stdout[-1500:]
    assert "needs steps 0..2" in r.stderr and "step_000001.safetensors" in r.stderr, r.stderr[-1500:]
    assert not (tmp_path / "off" / "metrics.jsonl").exists() and "| reward" not in r.stdout
    assert time.time() - t0 < 60


def test_bad_prompt_file_and_model_folder_are_named(tiny, tmp_path):
    bad = tmp_path / "latin1.jsonl"
    bad.write_bytes(b'{"id": "1", "problem": "1+1", "answer": "2"}\n{"id": "2", "problem": "caf\xe9", "answer": "1"}\n')
    r = train(tiny, tmp_path / "x", "--prompts", str(bad))
    assert r.returncode != 0 and "latin1.jsonl:2: not UTF-8" in r.stderr, r.stderr[-1500:]
    empty = tmp_path / "not_a_model"
    empty.mkdir()
    args = [str(ROOT / "graft.py"), "train", "--model", str(empty), "--out", str(tmp_path / "y")] + common_flags(tiny)
    r = run_py(args, tmp_path)
    assert r.returncode != 0 and "a folder without config.json, not a transformers model folder" in r.stderr, \
        r.stderr[-1500:]


def test_resume_survives_a_half_written_metrics_line(tiny, tmp_path):
    out = tmp_path / "run"
    assert train(tiny, out, "--save-every", "1", steps=1).returncode == 0
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"step": 1, "reward": 0.')  # the process died while appending step 1's line
    r = train(tiny, out, "--save-every", "1", "--resume", steps=2)
    assert r.returncode == 0 and "dropping a half-written last line" in r.stdout, r.stderr[-1500:]
    assert [m["step"] for m in read_metrics(out / "metrics.jsonl")] == [0, 1]
    (out / "metrics.jsonl").write_text('{"step": 0}\nnot json\n{"step": 1}\n')
    r = train(tiny, out, "--resume", steps=2)
    assert r.returncode != 0 and "metrics.jsonl:2: not a JSON line" in r.stderr, r.stderr[-1500:]
