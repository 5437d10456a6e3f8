"""Beyond the paper, through the trainer: exchange among three or more sides (multi_peer_sources),
foreign trajectory logs as the stored peer, and `graft.py complement`. Tiny models on CPU.

Run: python -m pytest -q test_peers.py
"""

import json
import os
import signal
import subprocess
import sys
import time
import zlib

import pytest
import torch

import graft
from test_graft import ROOT, common_flags, exchange_phases, read_metrics, run_py, tiny  # noqa: F401  (tiny: fixture)
from config import Config
from core import assignment_digest, balanced_swap, batch_indices, group_advantages, multi_peer_sources, success_counts
from exchange import StepRollouts, load_rollouts, rollout_path, save_rollouts

# ------------------------------------------------------------------------------------------------
# multi_peer_sources: the assignment rule
# ------------------------------------------------------------------------------------------------


def test_two_sides_is_exactly_the_balanced_swap():
    g = torch.Generator().manual_seed(3)
    for trial in range(300):
        n = int(torch.randint(2, 9, (1,), generator=g))
        G = int(torch.randint(1, 30, (1,), generator=g))
        k = torch.randint(0, n + 1, (2, G), generator=g)
        for balance in (True, False):
            src = multi_peer_sources(k, n, balance=balance)
            a_to_b, b_to_a = balanced_swap(k_a=k[0], k_b=k[1], n=n, balance=balance)
            assert torch.equal(src[1] == 0, a_to_b) and torch.equal(src[0] == 1, b_to_a)
            assert torch.equal(src[0] != -1, b_to_a) and torch.equal(src[1] != -1, a_to_b)


def test_three_sides_hand_example():
    # n = 4; sides a, b, c (indices 0, 1, 2); prompts q0..q5
    k = torch.tensor([[0, 0, 2, 4, 0, 0],   # a
                      [2, 1, 0, 0, 0, 3],   # b
                      [3, 1, 0, 0, 0, 0]])  # c
    # Unbalanced: a takes q0 from c (3 > 2), q1 from b (tie 1 = 1 -> lower index), q5 from b; b and c
    # both take q2 from a; q3 (a all-pass) and q4 (nobody solves) move nowhere; c takes q5 from b.
    assert multi_peer_sources(k, 4, balance=False).tolist() == [[2, 1, -1, -1, -1, 1],
                                                                [-1, -1, 0, -1, -1, -1],
                                                                [-1, -1, 0, -1, -1, 1]]
    # Balanced per pair: (a, b): b->a {q1, q5}, a->b {q2}, m = 1 -> a keeps q5 (k_b 3 > 1), drops q1;
    # (a, c): c->a {q0}, a->c {q2}, m = 1 -> both kept; (b, c): b->c {q5}, c->b {} -> m = 0, dropped.
    assert multi_peer_sources(k, 4).tolist() == [[2, -1, -1, -1, -1, 1],
                                                 [-1, -1, 0, -1, -1, -1],
                                                 [-1, -1, 0, -1, -1, -1]]


# ------------------------------------------------------------------------------------------------
# Three processes on tiny models
# ------------------------------------------------------------------------------------------------


def three_procs(tiny, tmp_path, ex, *extra, steps=2):
    procs, sides = [], {"a": "ma", "b": "mb", "c": "ma"}
    for name, model in sides.items():
        peers = ",".join(s for s in sides if s != name)
        args = [str(tiny / "planted.py"), "train", "--model", str(tiny / model), "--name", name, "--peer-name", peers,
                "--out", str(tmp_path / name), "--peer-exchange", str(ex), "--seed", str(ord(name))]
        env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
        procs.append(subprocess.Popen([sys.executable] + args + common_flags(tiny, steps=steps) + list(extra), env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    return procs


def test_three_processes_agree_on_every_assignment(tiny, tmp_path):
    ex = tmp_path / "ex"
    procs = three_procs(tiny, tmp_path, ex, "--delta", "0")
    outs = [p.communicate(timeout=600)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[-2000:] for o in outs]
    metrics = {s: read_metrics(tmp_path / s / "metrics.jsonl") for s in "abc"}
    moved = 0
    for step in range(2):
        files = {s: load_rollouts(rollout_path(ex, s, step), n=4)[0] for s in "abc"}
        assert files["a"].prompt_ids == files["b"].prompt_ids == files["c"].prompt_ids
        src = multi_peer_sources(torch.stack([success_counts(files[s].rewards) for s in "abc"]), 4)  # (3, G)
        for r, recv in enumerate("abc"):
            m = metrics[recv][step]
            for j, giver in enumerate("abc"):
                if giver != recv:  # what each process says it took from each peer, recomputed from the files
                    assert m[f"selected/{giver}"] == int((src[r] == j).sum()), (step, recv, giver)
            assert m["selected"] == int((src[r] >= 0).sum())
            moved += m["selected"]
        # the fingerprint of the whole assignment: the same in every process and recomputed from the files
        assert {metrics[s][step]["assignment"] for s in "abc"} == {assignment_digest(src, files["a"].prompt_ids)}
    assert moved > 0, "the planted rewards should make some groups move"


def test_a_dead_peer_among_three_stops_the_others(tiny, tmp_path):
    ex = tmp_path / "ex"
    a, b, c = three_procs(tiny, tmp_path, ex, "--peer-dead-after", "3", "--heartbeat-interval", "1", steps=200)
    deadline = time.time() + 120
    while not rollout_path(ex, "c", 1).exists():
        assert time.time() < deadline and c.poll() is None, c.communicate()[0][-2000:]
        time.sleep(0.1)
    c.send_signal(signal.SIGKILL)
    c.wait(timeout=60)
    for p in (a, b):
        out = p.communicate(timeout=120)[0]
        assert p.returncode != 0 and "the peer is dead" in out and "/c/HEARTBEAT" in out, out[-3000:]


# ------------------------------------------------------------------------------------------------
# Foreign trajectories through the trainer
# ------------------------------------------------------------------------------------------------


def planted_reward(text: str) -> float:
    return 1.0 if zlib.crc32(text.encode()) % 4 == 0 else 0.0  # the same rule as test_graft's planted verifier


def texts_with(reward: float, count: int, tag: str) -> list[str]:
    out, i = [], 0
    while len(out) < count:
        t = f"{tag} try {i}"
        if planted_reward(t) == reward:
            out.append(t)
        i += 1
    return out


def foreign_trainer(tiny, tmp_path, monkeypatch, records, **overrides):
    import verify
    monkeypatch.setattr(verify, "verify_batch", lambda rs, gs, workers=0, **kw: [planted_reward(r) for r in rs])
    path = tmp_path / "foreign.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    kw = dict(model=str(tiny / "ma"), prompts=str(tiny / "p.jsonl"), out=str(tmp_path / "run"), peer_log=str(path),
              steps=1, prompts_per_step=8, n=4, minibatches=2, max_response_tokens=16, prompt_template="{problem}=",
              lr=1e-3, delta=0.0)
    kw.update(overrides)
    return graft.Trainer(Config(**kw))


def test_foreign_log_groups_of_any_size_enter_the_update(tiny, tmp_path, monkeypatch):
    prompts = [json.loads(x) for x in (tiny / "p.jsonl").read_text().splitlines()]
    records, groups = [], {}
    for j, p in enumerate(prompts):
        size = 2 + j % 3  # groups of 2, 3 and 4 responses
        texts = texts_with(1.0, 1, p["id"]) + texts_with(0.0, size - 1, p["id"])  # mixed: one right
        groups[p["id"]] = texts
        # half by id, half by problem text only; every record with the source's lbar
        records += [{"id": p["id"], "response": t, "lbar": -0.5} if j % 2 else
                    {"problem": p["problem"], "response": t, "lbar": -0.5} for t in texts]
    tr = foreign_trainer(tiny, tmp_path, monkeypatch, records)
    batch = batch_indices(len(tr.data), 0, 8, 0)
    own, _, _ = tr.rollout(0, batch)
    own.rewards.zero_()  # the receiver failed every prompt: every mixed foreign group is a candidate
    own.advantages.zero_()
    peers, _ = tr.wait_for_peers(0, own)
    out, replaced, m = exchange_phases(tr, 0, batch, own, peers)
    assert m["selected"] == 8 and replaced.all() and not any(not r.is_peer for r in out)
    assert m["peer_responses"] == sum(len(groups[own.prompt_ids[g]]) for g in range(8))  # padding never offered
    for g in range(8):
        texts = groups[own.prompt_ids[g]]
        expected = group_advantages(torch.tensor([[planted_reward(t) for t in texts]]))[0]  # (size,)
        got = sorted(r.adv for r in out if r.group == g)
        assert got == pytest.approx(sorted(expected.tolist()), rel=1e-5), g  # advantages within the group as given
    tr.update(0, out, replaced)  # the rows train


def test_foreign_log_without_lbar_needs_a_peer_model(tiny, tmp_path, monkeypatch):
    prompts = [json.loads(x) for x in (tiny / "p.jsonl").read_text().splitlines()]
    records = [{"id": p["id"], "response": t} for p in prompts
               for t in texts_with(1.0, 1, p["id"]) + texts_with(0.0, 2, p["id"])]
    with pytest.raises(SystemExit, match="foreign.jsonl:1: .*lbar.*--peer-model"):
        foreign_trainer(tiny, tmp_path, monkeypatch, records)
    tr = foreign_trainer(tiny, tmp_path, monkeypatch, records, peer_model=str(tiny / "mb"), out=str(tmp_path / "r2"))
    assert list(tmp_path.glob(".foreign.jsonl.lbar-*.json")), "the computed lbar is cached beside the file"
    batch = batch_indices(len(tr.data), 0, 8, 0)
    own, _, _ = tr.rollout(0, batch)
    lbar = tr.wait_for_peers(0, own)[0]["log"].lbar("token")  # (G, M)
    assert torch.isfinite(lbar).all() and (lbar < 0).any()


# ------------------------------------------------------------------------------------------------
# graft.py complement
# ------------------------------------------------------------------------------------------------


def test_complement_through_graft_cli(tmp_path):
    n, ids = 4, [f"q{i}" for i in range(6)]
    k_a, k_b = [0, 0, 0, 2, 4, 1], [1, 3, 0, 0, 0, 2]

    def write(side, ks):
        rewards = torch.tensor([[1.0] * k + [0.0] * (n - k) for k in ks])
        r = StepRollouts(prompt_ids=ids, tokens=[[1]] * 24, logprobs=[torch.zeros(1)] * 24, texts=["x"] * 24,
                         eos=torch.ones(6, n, dtype=torch.bool), rewards=rewards,
                         advantages=group_advantages(rewards))
        save_rollouts(rollout_path(tmp_path, side, 0), r, {"run_id": side})

    write("a", k_a)
    write("b", k_b)
    r = run_py([str(ROOT / "graft.py"), "complement", str(tmp_path / "a"), str(tmp_path / "b"), "--n", "4",
                "--batch-size", "6"], tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    # By hand. a fails all on q0, q1, q2 (3 of 6); b is mixed on q0, q1 and solves them: 66.7% / 66.7%,
    # 2/6 of a batch of 6 = 2.00 candidates b -> a per step. b fails all on q2, q3, q4; a is mixed on q3
    # only (33.3%) and solves q3, q4 (66.7%, q4 all-pass): 1.00 per step. m = min(1, 2) = 1.
    rows = {line.split()[0] + line.split()[2]: line.split()[3:] for line in r.stdout.splitlines() if " -> " in line}
    assert rows["S1S2"] == ["6", "3", "(50.0%)", "33.3%", "66.7%", "1.00", "2.00", "1.00"], r.stdout
    assert rows["S2S1"] == ["6", "3", "(50.0%)", "66.7%", "66.7%", "2.00", "1.00", "1.00"], r.stdout
