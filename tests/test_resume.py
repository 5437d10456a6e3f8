"""A pair run survives failure: resume after any stop of either side, the settings check of --resume,
one run per exchange folder, broken checkpoints and failed writes, the join timeout, and run_pair.sh's
GPU split and stop-the-other-side. Tiny models on CPU (the fixtures of test_graft.py).

Run: python -m pytest -q test_resume.py
"""

import errno
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
import runtime
from test_graft import ROOT, common_flags, read_metrics, run_py, tiny  # noqa: F401  (tiny: fixture)
from test_runs import pair_procs, train
from config import Config
from exchange import (Heartbeat, atomic_write, join_run, leave_run, load_rollouts, rollout_path, wait_for_file,
                      write_failed)

FAST = ["--peer-dead-after", "3", "--heartbeat-interval", "1", "--save-every", "1"]


def untimed(metrics: list[dict]) -> list[dict]:
    return [{k: v for k, v in m.items() if not k.startswith("time/")} for m in metrics]


def wait_until(cond, procs, what, limit=180):
    deadline = time.time() + limit
    while not cond():
        dead = [p for p in procs if p.poll() is not None]
        assert time.time() < deadline and not dead, (what, [p.communicate()[0][-2000:] for p in dead])
        time.sleep(0.1)


# ------------------------------------------------------------------------------------------------
# 1. --resume of a pair after a stop of either side, by any signal, equals an uninterrupted pair
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def reference(tiny, tmp_path_factory):
    """An uninterrupted pair of 3 steps: the metrics every resumed pair must reproduce."""
    d = tmp_path_factory.mktemp("reference")
    procs = pair_procs(tiny, d, d / "ex", *FAST, steps=3)
    outs = [p.communicate(timeout=600)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[-2000:] for o in outs]
    return {s: untimed(read_metrics(d / s / "metrics.jsonl")) for s in "ab"}


@pytest.mark.parametrize("sig, victim", [(signal.SIGINT, "a"), (signal.SIGTERM, "b"), (signal.SIGKILL, "a"),
                                         (signal.SIGSTOP, "b")])
def test_pair_resumes_after_any_stop_of_either_side(tiny, tmp_path, reference, sig, victim):
    ex = tmp_path / "ex"
    procs = dict(zip("ab", pair_procs(tiny, tmp_path, ex, *FAST, steps=3)))
    # the victim has finished step 0 and checkpointed it: a mid-run stop
    wait_until(lambda: (tmp_path / victim / "checkpoints" / "step_000001" / "trainer_state.pt").is_file(),
               list(procs.values()), "the first checkpoint")
    procs[victim].send_signal(sig)
    survivor = procs["b" if victim == "a" else "a"]
    out = survivor.communicate(timeout=180)[0]
    if sig == signal.SIGSTOP:  # the survivor declared it dead; the scheduler then kills the stopped job
        procs[victim].kill()
    victim_out = procs[victim].communicate(timeout=60)[0]
    assert survivor.returncode != 0 and procs[victim].returncode != 0, (out[-2000:], victim_out[-2000:])
    assert "relaunch both" in out and "--resume" in out, out[-3000:]  # the advice this test now follows
    assert (ex / victim / "FAILED").is_file() or sig in (signal.SIGKILL, signal.SIGSTOP)
    assert (ex / survivor_name(victim) / "FAILED").is_file()  # the markers of the failed attempt are there
    procs = pair_procs(tiny, tmp_path, ex, *FAST, "--resume", steps=3)
    outs = [p.communicate(timeout=600)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[-3000:] for o in outs]
    for side in "ab":
        assert untimed(read_metrics(tmp_path / side / "metrics.jsonl")) == reference[side], side
    assert json.loads((tmp_path / "a" / "run.json").read_text())["attempt"] == 1


def survivor_name(victim: str) -> str:
    return "b" if victim == "a" else "a"


def test_a_stop_signal_lost_in_a_finalizer_is_raised_at_the_next_step_boundary():
    """A signal whose exception is raised inside a finalizer (a progress bar's __del__ right after the checkpoint the
    pair above waits for) is printed and dropped by Python: stop_signals keeps it, the step loop raises it again."""
    class Finalized:
        def __del__(self):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.2)  # the handler runs here, inside __del__: its SystemExit is printed and dropped

    with runtime.stop_signals() as caught:
        x = Finalized()
        del x  # no exception reaches this frame ...
        assert caught == [signal.SIGTERM]  # ... but the signal was kept
        with pytest.raises(SystemExit, match="terminated by signal SIGTERM"):
            runtime.raise_stopped(caught)  # what Trainer.fit does at the next step boundary
        with pytest.raises(SystemExit, match="terminated by signal SIGTERM"):
            os.kill(os.getpid(), signal.SIGTERM)  # outside a finalizer it raises at once, as before
            time.sleep(1)
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL and caught == [signal.SIGTERM] * 2  # handlers restored
    with pytest.raises(KeyboardInterrupt):
        runtime.raise_stopped([signal.SIGINT])  # Ctrl-C stays a KeyboardInterrupt
    runtime.raise_stopped([])  # nothing received: nothing raised


def test_attempts_ignore_earlier_markers_and_honour_current_ones(tmp_path, capsys):
    ex = tmp_path / "ex"
    rid = join_run(ex, "a", peer_names=["b"])
    beat_a = Heartbeat(ex, "a", rid, interval=0.2)
    assert join_run(ex, "b", peer_names=["a"]) == rid
    write_failed(ex, "b", rid, "KeyboardInterrupt", attempt=0)  # attempt 0 ends: b failed ...
    beat_a.stop("failed")  # ... and a stopped on it
    write_failed(ex, "a", rid, "RuntimeError: the peer failed", attempt=0)
    # Both relaunched with --resume: the first (a) founds attempt 1 ...
    assert join_run(ex, "a", peer_names=["b"], previous=rid) == rid
    assert exchange.join_attempt(ex, "a", rid, dead_after=5) == 1
    beats = [Heartbeat(ex, "a", rid, attempt=1, interval=0.2)]
    step1 = rollout_path(ex, "b", 1)
    with pytest.raises(TimeoutError):  # b's attempt-0 marker does not stop a's attempt 1
        wait_for_file(step1, timeout=0.6, run_id=rid, attempt=1)
    assert "belongs to attempt 0 of this run, not attempt 1" in capsys.readouterr().err
    # ... the second (b) joins it and clears its own marker of the earlier attempt
    assert exchange.join_attempt(ex, "b", rid, dead_after=5) == 1
    assert not (ex / "b" / "FAILED").exists()
    beats.append(Heartbeat(ex, "b", rid, attempt=1, interval=0.2))
    write_failed(ex, "b", rid, "RuntimeError: out of memory", attempt=1)  # a marker of the current attempt
    t0 = time.time()
    with pytest.raises(RuntimeError, match="the peer failed .* out of memory"):
        wait_for_file(step1, timeout=30, run_id=rid, attempt=1)
    assert time.time() - t0 < 5
    # b relaunched again while a still runs attempt 1: a is left behind and says what to do
    beats[1].stop("failed")
    assert exchange.join_attempt(ex, "b", rid, dead_after=5) == 2
    beats.append(Heartbeat(ex, "b", rid, attempt=2, interval=0.2))
    with pytest.raises(RuntimeError, match="side 'b' runs attempt 2 .* relaunch this side with --resume"):
        wait_for_file(step1, timeout=30, run_id=rid, attempt=1)
    # a newer process of this very side: the old one stops
    assert exchange.join_attempt(ex, "a", rid, dead_after=5) == 2
    with pytest.raises(RuntimeError, match="side 'a' was relaunched"):
        wait_for_file(rollout_path(ex, "b", 2), timeout=30, run_id=rid, attempt=1, me="a")
    assert beats[0].left_behind()
    for beat in beats:
        beat.stop("finished")


# ------------------------------------------------------------------------------------------------
# 2. --resume checks the run's settings before loading the model; changeable ones are applied
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def finished_template(tiny, tmp_path_factory):
    """A two-step single-model run checkpointed after each step (step_000001, step_000002)."""
    d = tmp_path_factory.mktemp("finished")
    prompts = d / "p.jsonl"
    prompts.write_bytes((tiny / "p.jsonl").read_bytes())
    r = train(tiny, d / "run", "--save-every", "1", "--prompts", str(prompts), steps=2)
    assert r.returncode == 0, r.stderr[-2000:]
    return d


@pytest.fixture
def finished_run(finished_template, tmp_path):
    """A copy of the template run for one test to change: (run directory, its prompts file)."""
    import shutil
    shutil.copy(finished_template / "p.jsonl", tmp_path / "p.jsonl")
    shutil.copytree(finished_template / "run", tmp_path / "run")
    run_json = tmp_path / "run" / "run.json"  # the run's prompts path is the copy's
    record = json.loads(run_json.read_text())
    if "settings" in record:
        record["settings"]["prompts"] = str(tmp_path / "p.jsonl")
    run_json.write_text(json.dumps(record))
    return tmp_path / "run", tmp_path / "p.jsonl"


def resume_cfg(tiny, out, prompts, **kw):
    base = dict(model=str(tiny / "ma"), prompts=str(prompts), out=str(out), steps=2, prompts_per_step=8, n=4,
                minibatches=2, max_response_tokens=16, prompt_template="{problem}=", lr=1e-3, threads=1,
                exchange_timeout=120, micro_batch_size=8, save_every=1, resume=True)
    base.update(kw)
    return Config(**base)


def test_resume_refuses_changed_settings_before_loading(tiny, finished_run, monkeypatch):
    out, prompts = finished_run
    loaded = []

    def no_loading(*a, **k):
        loaded.append(a)
        raise AssertionError("the model was loaded before the settings were checked")
    monkeypatch.setattr(graft, "load_policy", no_loading)
    for change, expect in ((dict(n=2), "--n: 4 in the run, 2 now"),
                           (dict(prompts_per_step=4, minibatches=1), "--prompts-per-step: 8 in the run, 4 now"),
                           (dict(seed=7), "--seed: 0 in the run, 7 now"),
                           (dict(data_seed=3), "--data-seed: 0 in the run, 3 now"),
                           (dict(model=str(tiny / "mb")), "--model: "),
                           (dict(max_response_tokens=8), "--max-response-tokens: 16 in the run, 8 now"),
                           (dict(prompt_template="Q: {problem}"), "--prompt-template: '{problem}=' in the run"),
                           (dict(delta=0.5), "--delta: 0.8 in the run, 0.5 now")):
        with pytest.raises(SystemExit, match=expect):
            graft.Trainer(resume_cfg(tiny, out, prompts, **change))
    prompts.write_text(prompts.read_text().replace('"answer": "', '"answer": "1', 1))  # same path, new content
    with pytest.raises(SystemExit, match=r"the content of --prompts \(sha256\)"):
        graft.Trainer(resume_cfg(tiny, out, prompts))
    assert not loaded  # every refusal came before the model loaded
    assert [m["step"] for m in read_metrics(out / "metrics.jsonl")] == [0, 1]  # nothing of the run touched


def test_resume_applies_and_prints_changeable_settings(tiny, finished_run, capsys):
    out, prompts = finished_run
    tr = graft.Trainer(resume_cfg(tiny, out, prompts, steps=3, lr=1e-2, eval_every=0, keep_checkpoints=3))
    said = capsys.readouterr().out
    assert "--resume: applying changed settings:" in said and "--lr 0.001 -> 0.01" in said and "--steps 2 -> 3" in said
    assert tr.files.start_step == 2 and [g["lr"] for g in tr.opt.param_groups] == [1e-2] * len(tr.opt.param_groups)
    assert tr.opt.state  # the optimizer's moments were restored; only the lr is the new one


def test_resume_reads_an_older_run_record_that_names_the_peer_kind_by_a_mode_string(tiny, finished_run, monkeypatch):
    """run.json of an older run names the kind of peer by "mode" ("none", "stored", "online") where the trainer now
    records "online": such a run resumes, and one that had a live peer is refused without one, before loading."""
    out, prompts = finished_run
    run_json = out / "run.json"
    record = json.loads(run_json.read_text())
    assert record["settings"].pop("online") is False  # what the trainer writes now
    run_json.write_text(json.dumps(record | {"settings": record["settings"] | {"mode": "none"}}))
    assert graft.Trainer(resume_cfg(tiny, out, prompts, steps=3)).files.start_step == 2
    assert json.loads(run_json.read_text())["settings"]["online"] is False  # rewritten as the trainer writes it now
    run_json.write_text(json.dumps(record | {"settings": record["settings"] | {"mode": "online"}}))
    monkeypatch.setattr(graft, "load_policy", lambda *a, **k: pytest.fail("the model loaded before the check"))
    with pytest.raises(SystemExit, match=r"a live peer \(--peer-exchange, or none\): True in the run, False now"):
        graft.Trainer(resume_cfg(tiny, out, prompts, steps=3))


# ------------------------------------------------------------------------------------------------
# 4-5. Broken checkpoints are named and skipped; a failed write names the path and cleans up
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("damage", ["truncate", "header", "missing"])
def test_resume_falls_back_over_a_broken_latest_checkpoint(tiny, finished_run, capsys, damage):
    out, prompts = finished_run
    weights = out / "checkpoints" / "step_000002" / "model.safetensors"
    if damage == "truncate":
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    elif damage == "header":
        weights.write_bytes(b"\xff" * 64 + weights.read_bytes()[64:])
    else:
        weights.unlink()
    tr = graft.Trainer(resume_cfg(tiny, out, prompts))
    said = capsys.readouterr().out
    assert str(weights) in said or str(weights.parent) in said, said
    assert "falling back to the previous checkpoint" in said and tr.files.start_step == 1
    (out / "checkpoints" / "step_000001" / "trainer_state.pt").write_bytes(b"cut")
    with pytest.raises(SystemExit, match="no checkpoint in .* loads"):
        graft.Trainer(resume_cfg(tiny, out, prompts))


def test_truncated_model_file_is_named_by_eval(tiny, tmp_path):
    import shutil
    model = tmp_path / "m"
    shutil.copytree(tiny / "ma", model)
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    with pytest.raises(SystemExit, match=f"{weights}: truncated"):
        graft.run_eval(Config(model=str(model), benchmarks=str(tiny / "p.jsonl")))


def test_full_disk_while_checkpointing(tiny, finished_run, monkeypatch):
    out, prompts = finished_run
    tr = graft.Trainer(resume_cfg(tiny, out, prompts, steps=3, keep_checkpoints=3))
    real_save = torch.save

    def full_disk(obj, f, *a, **k):  # half the file reaches the disk, then the disk is full
        real_save(obj, f, *a, **k)
        Path(f).write_bytes(Path(f).read_bytes()[:100])
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(runtime.torch, "save", full_disk)
    with pytest.raises(SystemExit) as e:
        tr.checkpoint(3)
    msg = str(e.value)
    assert ".step_000003.tmp" in msg and "No space left on device [ENOSPC]" in msg and "MiB free" in msg, msg
    assert "step_000002" in msg  # the checkpoint --resume takes
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_000001", "step_000002"]  # tmp removed
    monkeypatch.setattr(runtime.torch, "save", real_save)
    assert graft.Trainer(resume_cfg(tiny, out, prompts, steps=3)).files.start_step == 2
    # a small atomic file (a rollout file, the metrics) on a full disk: named, no temp file left
    target = out.parent / "small" / "x.json"

    def cut(tmp):
        Path(tmp).write_text("{")
        raise OSError(errno.ENOSPC, "No space left on device")
    with pytest.raises(OSError, match=f"{target}: cannot write \\(No space left on device"):
        atomic_write(target, cut)
    assert list(target.parent.iterdir()) == []


def test_partial_checkpoint_of_a_kill_is_removed_at_start(tiny, finished_run):
    out, prompts = finished_run
    partial = out / "checkpoints" / ".step_000003.tmp"
    partial.mkdir()
    (partial / "model.safetensors").write_bytes(b"\0" * 1000)
    graft.Trainer(resume_cfg(tiny, out, prompts, steps=3))
    assert not partial.exists()


# ------------------------------------------------------------------------------------------------
# 3. One run per exchange folder
# ------------------------------------------------------------------------------------------------


def test_force_refuses_while_the_run_is_live(tiny, tmp_path):
    ex = tmp_path / "ex"
    first = pair_procs(tiny, tmp_path, ex, *FAST, steps=200)
    try:
        wait_until(lambda: rollout_path(ex, "b", 0).exists(), first, "the first pair's step 0")
        second = pair_procs(tiny, tmp_path / "second", ex, *FAST, "--force", steps=3)
        for p in second:
            out = p.communicate(timeout=120)[0]
            assert p.returncode != 0 and "--force would delete the files of run" in out and "is running" in out, \
                out[-2000:]
        # the live pair goes on undisturbed: two more steps, the same assignment on both sides
        lines = lambda s: len((tmp_path / s / "metrics.jsonl").read_text().splitlines()) \
            if (tmp_path / s / "metrics.jsonl").exists() else 0
        done = max(lines("a"), lines("b"))
        wait_until(lambda: min(lines("a"), lines("b")) >= done + 2, first, "two more steps of the live pair")
    finally:
        for p in first:
            p.kill()
            p.communicate()
    ma, mb = (read_metrics(tmp_path / s / "metrics.jsonl") for s in "ab")
    common = min(len(ma), len(mb))
    assert [m["assignment"] for m in ma[:common]] == [m["assignment"] for m in mb[:common]]
    assert not (tmp_path / "second" / "a" / "metrics.jsonl").exists()


def side_proc(tiny, out, ex, name, peer, model, *extra, steps=1):
    args = [str(tiny / "planted.py"), "train", "--model", str(tiny / model), "--name", name, "--peer-name", peer,
            "--out", str(out), "--peer-exchange", str(ex)] + common_flags(tiny, steps=steps) + list(extra)
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    return subprocess.Popen([sys.executable] + args, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


def test_two_pairs_started_at_once_never_cross(tiny, tmp_path):
    # Pair 1 (data seed 0) and pair 2 (data seed 1), same side names, one exchange folder, no --run-id:
    # a of pair 1 and b of pair 2 start together (the pair that would cross), their partners just after.
    ex = tmp_path / "ex"
    seeds = {"p1": "0", "p2": "1"}
    procs = {("p1", "a"): side_proc(tiny, tmp_path / "p1" / "a", ex, "a", "b", "ma", "--data-seed", "0", *FAST),
             ("p2", "b"): side_proc(tiny, tmp_path / "p2" / "b", ex, "b", "a", "mb", "--data-seed", "1", *FAST)}
    wait_until(lambda: (ex / "RUN").is_file(), list(procs.values()), "a founder")
    procs[("p1", "b")] = side_proc(tiny, tmp_path / "p1" / "b", ex, "b", "a", "mb", "--data-seed", "0", *FAST)
    procs[("p2", "a")] = side_proc(tiny, tmp_path / "p2" / "a", ex, "a", "b", "ma", "--data-seed", "1", *FAST)
    outs = {k: p.communicate(timeout=600)[0] for k, p in procs.items()}
    ok = sorted(k for k, p in procs.items() if p.returncode == 0)
    assert ok in ([("p1", "a"), ("p1", "b")], [("p2", "a"), ("p2", "b")]), {k: o[-1500:] for k, o in outs.items()}
    tag = ok[0][0]
    for k, out in outs.items():
        if k[0] != tag:
            assert "--peer-exchange:" in out and not (tmp_path / k[0] / k[1] / "metrics.jsonl").exists(), out[-1500:]
    said = "".join(o for k, o in outs.items() if k[0] != tag)
    assert "--data-seed 0 there, 1 here" in said or "--data-seed 1 there, 0 here" in said, said[-3000:]
    m = {s: read_metrics(tmp_path / tag / s / "metrics.jsonl") for s in "ab"}
    assert m["a"][0]["assignment"] == m["b"][0]["assignment"]
    assert load_rollouts(rollout_path(ex, "a", 0))[1]["data_seed"] == seeds[tag]


def test_join_run_checks_the_founders_peers_and_pair_settings(tmp_path):
    ex = tmp_path / "ex"
    pair = {"n": 4, "data_seed": 0}
    rid = join_run(ex, "a", peer_names=["b"], pair=pair)
    beat = Heartbeat(ex, "a", rid, interval=0.2)
    try:
        with pytest.raises(RuntimeError, match="side 'a' already took part"):
            join_run(ex, "a", peer_names=["b"], pair=pair)  # a second process named a
        (ex / "a" / "RUN_ID").unlink()  # ... even in the instant before the founder records its part
        (ex / ".attempts" / f"{rid}.000000.a").unlink()
        with pytest.raises(RuntimeError, match="founded by another process as side 'a'"):
            join_run(ex, "a", peer_names=["b"], pair=pair)
        with pytest.raises(RuntimeError, match=r"founded by side 'a' for sides \['a', 'b'\]"):
            join_run(ex, "c", peer_names=["a"], pair=pair)  # a is not c's peer's founder for c
        with pytest.raises(RuntimeError, match="--data-seed 0 there, 1 here"):
            join_run(ex, "b", peer_names=["a"], pair={"n": 4, "data_seed": 1})  # another pair's settings
        assert join_run(ex, "b", peer_names=["a"], pair=pair) == rid
        with pytest.raises(RuntimeError, match="--force would delete .* side 'a' of it is running"):
            leave_run(ex, "b")  # --force of a second pair in this folder
        leave_run(ex, "c")  # --force of a side that never joined: its own folder only, never the live run
        assert json.loads((ex / "RUN").read_text())["run_id"] == rid
        (ex / "b" / "RUN_ID").unlink()  # a second process as b, even before the first wrote its RUN_ID
        with pytest.raises(RuntimeError, match="side 'b' already took part in run"):
            join_run(ex, "b", peer_names=["a"], pair=pair)
    finally:
        beat.stop("finished")


# ------------------------------------------------------------------------------------------------
# 6. A peer that never joins; 7. run_pair.sh
# ------------------------------------------------------------------------------------------------


def test_a_peer_that_never_joins_stops_the_waiting_side(tiny, tmp_path):
    t0 = time.time()
    r = train(tiny, tmp_path / "a", "--name", "a", "--peer-name", "b", "--peer-exchange", str(tmp_path / "ex"),
              "--join-timeout", "2", steps=2)
    assert r.returncode != 0, r.stdout[-2000:]
    assert "--join-timeout 2s" in r.stdout  # said at start
    assert f"side 'b' has not joined run" in r.stderr and str(tmp_path / "ex") in r.stderr, r.stderr[-2000:]
    assert time.time() - t0 < 120


FAKE_TORCHRUN = r'''#!/usr/bin/env bash
# stands in for "python -m torch.distributed.run": logs the launch, then behaves as FAIL_SIDE says
name=$(echo "$*" | sed -E 's/.* --name ([^ ]+) .*/\1/')
echo "side=$name gpus=[${CUDA_VISIBLE_DEVICES-unset}] $*" >> "$LOG"
if [ "$name" = "${FAIL_SIDE:-}" ]; then  # fails once both sides are up
  for _ in $(seq 100); do [ "$(wc -l < "$LOG")" -ge 2 ] && break; sleep 0.1; done
  exit 3
fi
if [ -n "${FAIL_SIDE:-}" ]; then sleep 60; fi
'''


def launch(tmp_path, **env):
    fake = tmp_path / "fake_python"
    fake.write_text(FAKE_TORCHRUN)
    fake.chmod(0o755)
    data = tmp_path / "data"
    data.mkdir(exist_ok=True)
    (data / "math_train.jsonl").write_text("")
    log = tmp_path / "launches.log"
    log.unlink(missing_ok=True)
    # GEN_BATCH set: run_pair.sh asks no memory plan for the slots (tests/test_plan.py tests that), only torchrun runs
    e = dict(os.environ, PYTHON=str(fake), DATA=str(data), RUNS=str(tmp_path / "runs"), LOG=str(log), STEPS="1",
             GEN_BATCH="32", **env)
    r = subprocess.run(["bash", str(ROOT / "run_pair.sh"), "pair1"], env=e, capture_output=True, text=True, timeout=120)
    sides = {}
    for line in (log.read_text().splitlines() if log.exists() else []):
        words = line.split()
        sides[words[0][5:]] = (words[1][6:-1], line)
    return r, sides


@pytest.mark.parametrize("ngpu, a, b", [("0", "", ""), ("1", "0", "0"), ("3", "0", "1,2"), ("8", "0,1,2,3", "4,5,6,7")])
def test_run_pair_splits_any_number_of_gpus(tmp_path, ngpu, a, b):
    r, sides = launch(tmp_path, NGPU=ngpu)
    assert r.returncode == 0, r.stderr[-2000:]
    assert sides["a"][0] == a and sides["b"][0] == b, sides
    for name, gpus in (("a", a), ("b", b)):
        line = sides[name][1]
        assert f"--nproc_per_node {max(1, len(gpus.split(',')) if gpus else 1)} " in line, line
        assert f"--device {'cuda' if gpus else 'cpu'}" in line and "--run-id pair1-" in line, line
    assert f"A=HuggingFaceTB/SmolLM3-3B-Base on GPUs {a or 'none (CPU)'}" in r.stderr, r.stderr


def test_run_pair_refuses_a_side_without_gpus(tmp_path):
    r, sides = launch(tmp_path, NGPU="2", GPUS_A="0,1", GPUS_B="")
    assert r.returncode != 0 and not sides
    assert "give each side GPUs, e.g. GPUS_A=0,1 GPUS_B=2,3" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_run_pair_stops_the_other_side_when_one_fails(tmp_path):
    t0 = time.time()
    r, sides = launch(tmp_path, NGPU="2", FAIL_SIDE="b")
    assert r.returncode == 3 and set(sides) == {"a", "b"}, r.stderr[-2000:]
    assert "side b exited with status 3; stopping the other side" in r.stderr
    assert time.time() - t0 < 30  # not the 60 s side a would have waited
