"""Past one node: a side as several torchrun nodes, one side per launch, and a node that dies. Every torchrun
line here is the one `DRY_RUN=1 bash run_pair.sh pair1` prints (SIDE, NNODES, NODE_RANK, MASTER_ADDR,
MASTER_PORT, NPROC_PER_NODE, Slurm's variables); the pair runs on the CPU (gloo, c10d rendezvous on
localhost) with the tiny random models and planted rewards of test_graft.py.

Run: python -m pytest -q test_nodes.py
"""

import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import runtime
from test_graft import ROOT, common_flags, read_metrics, tiny  # noqa: F401  (tiny: fixture)
from test_resume import launch, untimed

FAST = ["--peer-dead-after", "3", "--heartbeat-interval", "1", "--save-every", "1", "--delta", "0", "--eval-every", "0"]

# The trainer under torchrun: planted rewards (test_graft.PLANTED's rule), every rank's assignment of every step
# appended to <out>/assignment.rank<R>.jsonl, and STEP_SLEEP seconds before each step (time to kill a node).
NODE_SCRIPT = '''
import json, os, sys, time, zlib
sys.path.insert(0, {root!r})
import verify
verify.verify_batch = lambda responses, golds, *, workers=0: [
    1.0 if zlib.crc32(r.encode()) % 4 == 0 else 0.0 for r in responses]
import graft
select, step, where = graft.VARIANTS["graft"].select, graft.Trainer.step, {{}}
def recorded(ctx, t, own, peers):  # GRAFT's select phase, its assignment appended to this rank's file
    selected, m, counts = select(ctx, t, own, peers)
    with open(os.path.join(where["out"], f"assignment.rank{{where['rank']}}.jsonl"), "a") as f:
        f.write(json.dumps({{"step": t, "assignment": m.get("assignment")}}) + "\\n")
    return selected, m, counts
def slow(self, t):
    where.update(out=self.cfg.out, rank=self.dist.rank)
    time.sleep(float(os.environ.get("STEP_SLEEP", "0")))
    return step(self, t)
graft.VARIANTS["graft"] = graft.VARIANTS["graft"]._replace(select=recorded)
graft.Trainer.step = slow
graft.main(sys.argv[1:])
'''


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def dry_run(env: dict, *flags: str, preset: str = "pair1") -> subprocess.CompletedProcess:
    e = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    e.update({"NGPU": "0", "DATA": str(ROOT / "data"), "DRY_RUN": "1"} | env)
    return subprocess.run(["bash", str(ROOT / "run_pair.sh"), preset, *flags], env=e, capture_output=True, text=True,
                          timeout=60)


def printed(r: subprocess.CompletedProcess) -> list[list[str]]:
    """The commands a dry run printed, each as its argv."""
    assert r.returncode == 0, r.stderr
    assert all(line.startswith("+ ") for line in r.stdout.splitlines()), r.stdout
    return [shlex.split(line[2:]) for line in r.stdout.splitlines()]


def torchrun_lines(r: subprocess.CompletedProcess) -> dict[str, list[str]]:
    """The printed graft.py launches of a dry run, by side name: {name: argv}."""
    return {argv[argv.index("--name") + 1]: argv for argv in printed(r) if "torch.distributed.run" in argv}


def option(argv: list[str], flag: str) -> str | None:
    return argv[argv.index(flag) + 1] if flag in argv else None


# ------------------------------------------------------------------------------------------------
# 1. run_pair.sh: the rendezvous of each side and node, one side per launch, Slurm's variables
# ------------------------------------------------------------------------------------------------


def test_one_side_per_launch_and_each_nodes_rendezvous(tmp_path):
    layout = dict(SIDE="b", NNODES="2", MASTER_ADDR="nodeb0", MASTER_PORT="29700", DATA=str(tmp_path))
    node1 = printed(dry_run(layout | {"NODE_RANK": "1"}))
    node0 = printed(dry_run(layout | {"NODE_RANK": "0"}))
    prepare = ["python", "-m", "data.prepare", "--out", str(tmp_path)]
    assert node0[0] == prepare and len(node0) == 2 and len(node1) == 1  # the data: prepared by node 0 alone
    assert option(node0[1], "--rdzv_conf") == "is_host=1" and option(node1[0], "--rdzv_conf") == "is_host=0"
    lines = torchrun_lines(dry_run(layout | {"NODE_RANK": "1"}))
    assert set(lines) == {"b"}
    b = lines["b"]
    assert b[:3] == ["env", "CUDA_VISIBLE_DEVICES=", "python"] and b[3:5] == ["-m", "torch.distributed.run"]
    assert [option(b, f) for f in ("--nnodes", "--rdzv_backend", "--rdzv_endpoint", "--rdzv_id", "--rdzv_conf")] == \
        ["2", "c10d", "nodeb0:29700", "pair1-b", "is_host=0"]
    assert "--master_port" not in b and "--run-id" not in b  # the first side to start draws the run id
    assert option(b, "--peer-exchange") == "runs/pair1/exchange" and option(b, "--out") == "runs/pair1/b"
    # both sides from one launch over the same nodes: per-side values, B's port one above A's by default
    lines = torchrun_lines(dry_run(dict(NNODES="3", NODE_RANK="0", MASTER_ADDR="n0", B_MASTER_ADDR="m0",
                                        NPROC_PER_NODE="2", RUN_ID="exp1", FLAGS_A="--chat-template")))
    assert lines["a"][-1] == "--chat-template" and "--chat-template" not in lines["b"]  # FLAGS_A: side a only
    assert [option(lines[s], "--rdzv_endpoint") for s in "ab"] == ["n0:29500", "m0:29501"]
    assert [option(lines[s], "--rdzv_conf") for s in "ab"] == ["is_host=1", "is_host=1"]
    assert all(option(lines[s], "--nproc_per_node") == "2" and option(lines[s], "--run-id") == "exp1" for s in "ab")
    # one node: torchrun's local rendezvous, as before
    lines = torchrun_lines(dry_run(dict(SIDE="a", A_MASTER_PORT="29811"), "--resume"))
    assert option(lines["a"], "--master_port") == "29811" and "--nnodes" not in lines["a"]
    assert lines["a"][-1] == "--resume" and "--run-id" not in lines["a"]


@pytest.mark.parametrize("env, message", [
    (dict(SIDE="c"), "SIDE='c': give a, b or leave it unset (both)"),
    (dict(NNODES="2", NODE_RANK="2", MASTER_ADDR="h"), "side a: NNODES='2' NODE_RANK='2': NNODES >= 1 and 0 <="),
    (dict(SIDE="b", NNODES="2"), "side b on 2 nodes: set MASTER_ADDR (or B_MASTER_ADDR), the address of its node 0"),
])
def test_a_layout_that_cannot_work_is_refused(env, message):
    r = dry_run(env)
    assert r.returncode == 2 and message in r.stderr and not r.stdout, r.stderr


@pytest.mark.parametrize("nodelist, head", [("gpu-[003-006,010],cpu1", "gpu-003"), ("node7", "node7"),
                                            ("a1,b2", "a1"), ("rack[2-3]-n[08,09]", "rack2-n08")])
def test_slurm_variables_become_the_rendezvous(nodelist, head):
    """What srun gives each task of a job: the node count, this node's id and the job's node list."""
    slurm = dict(SLURM_JOB_NODELIST=nodelist, SLURM_NNODES="4", SLURM_NODEID="2", SLURM_JOB_ID="77")
    a = torchrun_lines(dry_run(dict(SIDE="a", **slurm)))["a"]
    assert [option(a, f) for f in ("--nnodes", "--rdzv_endpoint", "--rdzv_conf")] == ["4", f"{head}:29500", "is_host=0"]
    first = torchrun_lines(dry_run(dict(SIDE="a", **(slurm | {"SLURM_NODEID": "0"}))))["a"]
    assert option(first, "--rdzv_conf") == "is_host=1"  # node 0 of the job is the list's first host
    own = torchrun_lines(dry_run(dict(SIDE="a", NNODES="2", NODE_RANK="1", MASTER_ADDR="x", **slurm)))["a"]
    assert option(own, "--nnodes") == "2" and option(own, "--rdzv_endpoint") == "x:29500"  # set by hand: kept


def test_one_side_launch_runs_torchrun_and_names_the_nodes_log(tmp_path):
    """Not a dry run: run_pair.sh starts torchrun (a stand-in that logs its arguments) for side a only,
    writes node 1's log to a.node1.log and exits with the side's status."""
    r, sides = launch(tmp_path, NGPU="0", SIDE="a", NNODES="2", NODE_RANK="1", MASTER_ADDR="h", MASTER_PORT="29900")
    assert r.returncode == 0 and set(sides) == {"a"}, r.stderr[-2000:]
    line = sides["a"][1]
    assert "--rdzv_endpoint h:29900 --rdzv_id pair1-a --rdzv_conf is_host=0 --nproc_per_node 1 graft.py" in line, line
    assert (tmp_path / "runs" / "pair1" / "a.node1.log").is_file()
    assert "side a of pair pair1 finished (status 0) on node 1" in r.stderr


# ------------------------------------------------------------------------------------------------
# 2. Every rank sees rank 0's files, or the run stops; a lost rank is named
# ------------------------------------------------------------------------------------------------


def test_a_rank_that_does_not_see_rank_0s_files_stops_every_rank(tmp_path, monkeypatch):
    """Rank 1 of 2 (its node mounts another --out and --peer-exchange) and rank 0's view, as all_gather_object
    would bring it: every rank raises the same message, naming the rank, its host, the files and the steps."""
    cfg = type("Cfg", (), {"name": "a", "out": str(tmp_path / "a"), "peer_exchange": str(tmp_path / "ex")})()  # online
    files = runtime.RunFiles(cfg, runtime.DistInfo(rank=1, world=2))
    assert files.online and files.exchange == tmp_path / "ex" and files.start_step == 0

    def gather(views, mine):  # rank 0 saw its files and resumes at step 2
        views[:] = [("node0", "", 2), mine]
    monkeypatch.setattr(torch.distributed, "all_gather_object", gather)
    t0 = time.time()
    with pytest.raises(SystemExit) as e:
        files.check_shared_files("r1", wait=0.5)
    assert 0.5 <= time.time() - t0 < 5  # it waited for the files (a network filesystem shows them late)
    host = socket.gethostname()
    assert str(e.value) == (
        f"side 'a': not every rank sees the files of rank 0 (node0): rank 1 on {host}: {tmp_path / 'a' / 'run.json'} "
        f"(--out) of run r1 is not there; {tmp_path / 'ex' / 'RUN'} (--peer-exchange) of run r1 is not there; rank 1 "
        f"on {host} resumes at step 0, rank 0 at step 2. --out and --peer-exchange must be on storage that every node "
        f"of the side sees (a shared filesystem)")
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "run.json").write_text(json.dumps({"run_id": "r1"}))
    (tmp_path / "ex").mkdir()
    (tmp_path / "ex" / "RUN").write_text(json.dumps({"run_id": "r1"}))
    files.start_step = 2
    files.check_shared_files("r1", wait=0.5)  # sees both, resumes where rank 0 does: no error


def test_lost_rank_message_names_a_failed_collective():
    gloo = RuntimeError("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
                        "[127.0.0.1]:17610. This is typically caused by a remote worker crashing.")
    assert runtime.lost_rank_message(gloo, "a", 2).startswith("side 'a' lost one of its 2 processes (a collective "
                                                               "failed: a node of this side died, a process")
    assert runtime.lost_rank_message(gloo, "a", 1) == ""  # one process: nothing to lose
    assert runtime.lost_rank_message(ValueError("bad --lr"), "a", 2) == ""


# ------------------------------------------------------------------------------------------------
# 3. Each side as 2 nodes x 1 process equals 1 node x 2 processes; a dead node stops the pair; --resume
# ------------------------------------------------------------------------------------------------


def start(argv: list[str], script: Path, log: Path, **env) -> subprocess.Popen:
    """One node's launch: torchrun (the agent) and its workers, the printed line with graft.py -> script."""
    argv = [str(script) if w == "graft.py" else w for w in argv]
    e = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", **env)
    return subprocess.Popen(argv, cwd=ROOT, env=e, stdout=log.open("w"), stderr=subprocess.STDOUT)


def kill_node(p: subprocess.Popen) -> None:
    """SIGKILL to a launch's whole process tree, as if its node went down: torchrun starts each worker in a
    session of its own, so the worker is found by its parent (Linux /proc), not by a process group."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:  # /proc/<pid>/stat: "pid (comm) state ppid ..."; comm may hold spaces and parentheses
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(d.name))
    tree, todo = [], [p.pid]
    while todo:
        tree.append(todo.pop())
        todo += children.get(tree[-1], [])
    for pid in tree:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def finish(procs: dict[str, subprocess.Popen], logs: Path, timeout: float = 300) -> dict[str, int]:
    codes = {}
    for key, p in procs.items():
        try:
            codes[key] = p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs.values():
                kill_node(q)
            raise AssertionError(f"{key} did not stop: " + (logs / f"{key}.log").read_text()[-3000:])
    return codes


def test_two_nodes_per_side_equal_one_node_and_resume_after_a_node_dies(tiny, tmp_path):
    script = tmp_path / "node.py"
    script.write_text(NODE_SCRIPT.format(root=str(ROOT)))
    data = tmp_path / "data"
    data.mkdir()
    (data / "math_train.jsonl").write_bytes((tiny / "p.jsonl").read_bytes())
    flags = common_flags(tiny, steps=3) + FAST
    base = dict(PYTHON=sys.executable, SMOL=str(tiny / "ma"), QWEN=str(tiny / "mb"), STEPS="3")

    # the reference: both sides on one node, 2 processes each (one launch, as run_pair.sh starts a pair)
    one = tmp_path / "one"
    lines = torchrun_lines(dry_run(dict(base, DATA=str(data), RUNS=str(one), NPROC_PER_NODE="2"), *flags))
    one.mkdir()
    codes = finish({s: start(lines[s], script, one / f"{s}.log") for s in "ab"}, one)
    assert codes == {"a": 0, "b": 0}, [(one / f"{s}.log").read_text()[-3000:] for s in "ab"]

    # each side on 2 "nodes" x 1 process: one launch per side and node, the side's rendezvous on localhost
    two = tmp_path / "two"
    two.mkdir()

    def nodes(*extra, **env):
        ports = {s: str(free_port()) for s in "ab"}
        procs = {}
        for s in "ab":
            for k in (0, 1):
                r = dry_run(dict(base, DATA=str(data), RUNS=str(two), SIDE=s, NNODES="2", NODE_RANK=str(k),
                                 MASTER_ADDR="localhost", MASTER_PORT=ports[s]), *flags, *extra)
                procs[f"{s}{k}"] = start(torchrun_lines(r)[s], script, two / f"{s}{k}.log", **env)
        return procs

    procs = nodes(STEP_SLEEP="2")
    ckpt = two / "pair1" / "a" / "checkpoints" / "step_000001" / "trainer_state.pt"
    deadline = time.time() + 240
    while not ckpt.is_file():  # side a has finished step 0 and checkpointed it: kill its node 1 mid-run
        assert time.time() < deadline and all(p.poll() is None for p in procs.values()), \
            [(two / f"{k}.log").read_text()[-2000:] for k in procs]
        time.sleep(0.1)
    kill_node(procs["a1"])
    t0 = time.time()
    codes = finish(procs, two, timeout=120)
    logs = {k: (two / f"{k}.log").read_text() for k in procs}
    assert all(c != 0 for c in codes.values()), codes  # the whole pair stopped ...
    assert time.time() - t0 < 60, codes  # ... within seconds, not at a timeout
    assert "side 'a' lost one of its 2 processes" in logs["a0"], logs["a0"][-3000:]
    rank0_survived = (two / "pair1" / "exchange" / "a" / "FAILED").is_file()  # it left the marker: B quotes it
    for k in ("b0", "b1"):  # the peer's message: why, and what to do next
        assert "then relaunch both sides, every node of each, with --resume" in logs[k], logs[k][-3000:]
        assert ("side 'a' lost one of its 2 processes" if rank0_survived else "the peer is dead") in logs[k], logs[k]

    # exactly what the message says: every node of both sides again, with --resume
    codes = finish(nodes("--resume"), two)
    assert codes == {"a0": 0, "a1": 0, "b0": 0, "b1": 0}, [(two / f"{k}.log").read_text()[-3000:] for k in codes]
    for s in "ab":
        ref = untimed(read_metrics(one / "pair1" / s / "metrics.jsonl"))
        assert untimed(read_metrics(two / "pair1" / s / "metrics.jsonl")) == ref, s  # every digit
        assert json.loads((two / "pair1" / s / "run.json").read_text())["attempt"] == 1
    # every rank of both sides, in both layouts and both attempts, computed each step's assignment alike
    digests = {}
    for f in [*(one / "pair1").glob("*/assignment.rank*.jsonl"), *(two / "pair1").glob("*/assignment.rank*.jsonl")]:
        for m in read_metrics(f):
            digests.setdefault(m["step"], set()).add(m["assignment"])
    assert sorted(digests) == [0, 1, 2] and all(len(d) == 1 for d in digests.values()), digests
    assert [digests[t] for t in range(3)] == [{m["assignment"]} for m in ref]
