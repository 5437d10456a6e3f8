"""The reward seam's wall-time limit (reward.py, --reward-timeout): planted rewards that never return, that kill
their own process (os._exit, a segfault) or raise, scored through reward.rewards and through a trainer step.

    OMP_NUM_THREADS=1 python -m pytest -q tests/test_reward.py
"""

import json
import os
import time

import pytest

import graft
import reward
from config import Config
from core import batch_indices
from test_graft import tiny  # noqa: F401  (tiny: fixture)

# Planted rewards, loaded by path like any --reward file. "hang" appears in a response that never returns.
PLANTED = '''
import ctypes, os, time

def never_returns(responses, golds, *, workers=0):
    while True:
        time.sleep(60)

def hangs_on_marked(responses, golds, *, workers=0):
    if any("hang" in r for r in responses):
        time.sleep(3600)
    return [float(r == g) for r, g in zip(responses, golds)]

def exits(responses, golds, *, workers=0):
    os._exit(3)

def segfaults(responses, golds, *, workers=0):
    ctypes.string_at(0)  # reads address 0: SIGSEGV

def raises(responses, golds, *, workers=0):
    raise KeyError("planted")

def short(responses, golds, *, workers=0):
    return [1.0] * (len(responses) - 1)

def pid(responses, golds, *, workers=0):
    if "hang" in responses:
        time.sleep(3600)
    return [float(os.getpid())] * len(responses)

def exact(responses, golds, *, workers=0):
    return [float(r == g) for r, g in zip(responses, golds)]
'''


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    path = tmp_path_factory.mktemp("reward") / "planted.py"
    path.write_text(PLANTED)
    return lambda name: f"{path}:{name}"


# ------------------------------------------------------------------------------------------------
# reward.rewards under a limit


def test_a_reward_that_never_returns_is_killed_at_the_limit(planted, capsys):
    t = time.monotonic()
    out = reward.rewards(planted("never_returns"), ["a", "b", "c"], ["a", "b", "c"], timeout=0.5)
    took = time.monotonic() - t
    assert out == [0.0, 0.0, 0.0] and out.timed_out == [0, 1, 2] and out.crashed == []
    assert took < 0.5 + 1.0, f"a hanging call took {took:.2f}s for a 0.5s limit"
    err = capsys.readouterr().err
    assert "3 of 3 responses not scored within --reward-timeout 0.5s" in err and "responses 0-2" in err
    # the killed worker was replaced: the same pool answers the next call
    assert reward.rewards(planted("exact"), ["a", "x"], ["a", "b"], timeout=5) == [1.0, 0.0]


@pytest.mark.parametrize("name", ["exits", "segfaults"])
def test_a_reward_that_kills_its_process_scores_zero_and_the_pool_goes_on(planted, name, capsys):
    out = reward.rewards(planted(name), ["a", "b"], ["a", "b"], timeout=10)
    assert out == [0.0, 0.0] and out.crashed == [0, 1] and out.timed_out == []
    assert "2 whose worker died" in capsys.readouterr().err
    first = reward.rewards(planted("pid"), ["a"], ["a"], timeout=10)[0]
    assert first != os.getpid()  # scored in a worker, not here
    assert reward.rewards(planted("pid"), ["a"], ["a"], timeout=10)[0] == first  # kept across calls
    assert reward.rewards(planted("pid"), ["hang"], ["a"], timeout=0.2).timed_out == [0]
    assert reward.rewards(planted("pid"), ["a"], ["a"], timeout=10)[0] not in (first, 0.0)  # killed and replaced


def test_only_the_share_that_hangs_is_lost(planted):
    # two workers, each one contiguous half: the half holding "hang" is killed, the other half keeps its scores
    responses, golds = ["1", "2", "x", "4", "hang", "6"], ["1", "2", "3", "4", "5", "6"]
    out = reward.rewards(planted("hangs_on_marked"), responses, golds, workers=2, timeout=1)
    assert out == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0] and out.timed_out == [3, 4, 5]


def test_errors_keep_naming_the_flag_under_the_limit(planted):
    with pytest.raises(RuntimeError, match=r"(?s)--reward .*raises.*KeyError: 'planted'"):
        reward.rewards(planted("raises"), ["a"], ["a"], timeout=10)
    with pytest.raises(ValueError, match="returned 1 rewards for 2 responses"):
        reward.rewards(planted("short"), ["a", "b"], ["a", "b"], timeout=10)


def test_without_a_limit_the_function_runs_here_and_a_replaced_function_is_seen(planted, monkeypatch):
    import verify
    assert reward.rewards(planted("pid"), ["a"], ["a"], timeout=0) == [float(os.getpid())]
    seen = []
    monkeypatch.setattr(verify, "verify_batch", lambda rs, gs, workers=0, **kw: seen.extend(rs) or [0.5] * len(rs))
    assert reward.rewards("verify:verify_batch", ["a"], ["1"], timeout=0) == [0.5] and seen == ["a"]
    assert reward.rewards("verify:verify_batch", ["b"], ["1"], timeout=10) == [0.5]  # planted before the fork
    assert seen == ["a"]  # ... and run in a worker: its side effects stay there (module docstring, departure 2)
    monkeypatch.setattr(verify, "verify_batch", lambda rs, gs, workers=0, **kw: [0.25] * len(rs))
    assert reward.rewards("verify:verify_batch", ["b"], ["1"], timeout=10) == [0.25]  # replaced: pool forked again


# ------------------------------------------------------------------------------------------------
# A trainer step with a reward that never returns


def test_a_step_whose_reward_never_returns_goes_on_within_the_limit_plus_a_second(tiny, tmp_path, planted, capsys):
    cfg = Config(model=str(tiny / "ma"), prompts=str(tiny / "p.jsonl"), out=str(tmp_path / "run"), steps=1,
                 prompts_per_step=8, n=4, minibatches=2, max_response_tokens=8, prompt_template="{problem}=",
                 threads=1, reward=planted("exact"), reward_timeout=1.0)
    tr = graft.Trainer(cfg)
    tr.cfg.reward = planted("never_returns")
    m = tr.step(0)
    assert m["time/verify"] < cfg.reward_timeout + 1.0, m["time/verify"]
    assert m["reward_timeouts"] == 8 * 4 and m["reward_crashes"] == 0 and m["reward"] == 0.0
    tr.log(m)
    assert "32 of 32 responses not scored within --reward-timeout 1s" in capsys.readouterr().err  # the run's log
    logged = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    assert logged["reward_timeouts"] == 32
    tr.cfg.reward = planted("exits")  # the next step: a reward that crashes its worker, counted apart
    m = tr.step(1)
    assert m["reward_crashes"] == 32 and m["reward_timeouts"] == 0


def test_the_step_counts_only_the_stopped_responses(tiny, tmp_path, planted, monkeypatch):
    # the planted reward hangs on a share holding "hang": the count is that share's size, computed here directly
    cfg = Config(model=str(tiny / "ma"), prompts=str(tiny / "p.jsonl"), out=str(tmp_path / "run"), steps=1,
                 prompts_per_step=8, n=4, max_response_tokens=8, prompt_template="{problem}=", threads=1,
                 reward=planted("hangs_on_marked"), reward_timeout=1.0, verify_workers=4)
    tr = graft.Trainer(cfg)
    batch = batch_indices(len(tr.data), 0, 8, 0)
    texts = {}
    real_decode = graft.decode_response

    def decode(tokens, tok, **kw):  # the 3rd and 20th responses hang: shares of 8 are 0-7 and 16-23
        text, eos = real_decode(tokens, tok, **kw)
        k = len(texts)
        texts[k] = "hang" if k in (2, 19) else text
        return texts[k], eos
    monkeypatch.setattr(graft, "decode_response", decode)
    own, counts, _ = tr.rollout(0, batch)
    assert counts["reward_timeouts"] == 16 and counts["reward_crashes"] == 0
    assert own.rewards.view(-1)[0:8].tolist() == [0.0] * 8 and own.rewards.view(-1)[16:24].tolist() == [0.0] * 8


def test_no_worker_outlives_a_killed_trainer(tmp_path):
    """kill -9 of the process that holds the pool: its workers see the pipe close and exit (no orphans)."""
    import subprocess
    import sys
    script = tmp_path / "holder.py"
    script.write_text("import os, reward\n"
                      "reward.rewards('verify:verify_batch', ['\\\\boxed{1}'] * 4, ['1'] * 4, workers=2, timeout=10)\n"
                      "print(' '.join(str(p.pid) for p, _ in reward._POOLS[('verify:verify_batch', 2)].workers), "
                      "flush=True)\n"
                      "os.kill(os.getpid(), 9)\n")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, PYTHONPATH=root))
    pids = [int(x) for x in r.stdout.split()]
    assert r.returncode == -9 and len(pids) == 2
    def running(pid: int) -> bool:  # alive and not a zombie waiting for its reaper
        try:
            return open(f"/proc/{pid}/stat").read().split(") ")[1][0] != "Z"
        except OSError:
            return False
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(running(p) for p in pids):
        time.sleep(0.1)
    assert not [p for p in pids if running(p)], f"reward workers {pids} outlived their trainer"
