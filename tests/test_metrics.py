"""Tests of what the trainer logs: every loss metric of a planted step against its direct computation
from the rows (one process and two gloo ranks), the table of metric keys, `graft.py plot`, README's
figure (`tiny.py figure`) and `--report-to` (TensorBoard's events and an offline W&B run read back).
CPU, tiny random models.

Run: python -m pytest -q test_metrics.py
"""

import importlib.util
import json
import math
import struct
from pathlib import Path

import pytest
import torch

import graft
from tools import plot
from test_graft import ROOT, common_flags, read_metrics, run_py, tiny  # noqa: F401  (tiny: fixture)
from config import Config, validate_config
from metrics import metric_doc, metrics_markdown, report_values
from core import batch_indices
from exchange import StepRollouts, rollout_path, save_rollouts

torch.set_num_threads(1)
needs_matplotlib = pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None,
                                      reason="matplotlib (optional, for graft.py plot) is not installed")
needs_tensorboard = pytest.mark.skipif(importlib.util.find_spec("tensorboard") is None,
                                       reason="tensorboard (optional, for --report-to tensorboard) is not installed")
needs_wandb = pytest.mark.skipif(importlib.util.find_spec("wandb") is None,
                                 reason="wandb (optional, for --report-to wandb) is not installed")

# ------------------------------------------------------------------------------------------------
# A planted step: own and peer rows, several micro-batches and minibatches, some without peer rows
# ------------------------------------------------------------------------------------------------

PEER_GROUPS = (5, 6, 7)  # replaced groups: under peer-last they fill the last minibatches


def planted_config(tiny, out, **kw) -> Config:
    base = dict(model=str(tiny / "ma"), prompts=str(tiny / "p.jsonl"), out=str(out), steps=1, prompts_per_step=8, n=4,
                minibatches=3, micro_batch_size=3, max_response_tokens=16, prompt_template="{problem}=", lr=1e-3,
                threads=1, device="cpu")
    return Config(**(base | kw))


def planted_rows(tr: graft.Trainer, *, peer_groups=PEER_GROUPS) -> tuple[list[graft.Row], torch.Tensor]:
    """8 groups x 4 responses of lengths 2-10. Groups in peer_groups are peer rows with w in [0.5, 1]
    and one w = 0 response (removed); groups 0 and 3 have advantage 0 (they skip the forward but stay
    in the denominator). Behaviour log-probs are the current policy's plus noise (std 0.3), so that
    ratios fall on both sides of the clip range. Returns (rows, (G,) replaced mask)."""
    g = torch.Generator().manual_seed(0)
    idx = batch_indices(len(tr.data), 0, 8, 0)
    rows = []
    for q in range(8):
        for i in range(4):
            resp = torch.randint(3, 50, (2 + (q * 4 + i) % 9,), generator=g).tolist()
            peer = q in peer_groups
            adv = 0.0 if q in (0, 3) else float(torch.randn((), generator=g))
            w = float(0.5 + 0.5 * torch.rand((), generator=g)) if peer else 1.0
            if peer and q == 6 and i == 3:
                w = 0.0
            rows.append(graft.Row(q, tr.prompt_ids[idx[q]], resp, None, adv, weight=w, is_peer=peer))
    current = tr.behaviour_logprobs([r.prompt for r in rows], [r.response for r in rows])
    for r, lp in zip(rows, current):
        r.old_logp = lp + 0.3 * torch.randn(len(lp), generator=g)
    return rows, torch.tensor([q in peer_groups for q in range(8)])


def naive_step_metrics(tr: graft.Trainer, rows: list[graft.Row]) -> dict:
    """Every loss metric of the step computed from the rows, one token at a time, with the policy fixed.

    Each row's log-probs come from a forward of that row alone. pg/loss is the step's token-mean:
    the surrogate summed over every token over the retained tokens of the whole step."""
    cfg = tr.cfg
    kept = [r for r in rows if r.weight > 0]
    live = [r for r in kept if r.adv != 0]  # rows with a = 0 contribute 0 and need no forward
    s = dict.fromkeys(["surrogate", "clip_own", "own", "clip_peer", "peer", "kl", "k1", "ratio", "w", "w_peer"], 0.0)
    with torch.no_grad():
        for r in live:
            lp, _ = tr.policy_logprobs([r.prompt], [r.response])  # (1, T)
            for t in range(len(r.response)):
                log_rho = float(lp[0, t]) - float(r.old_logp[t])
                rho = math.exp(log_rho)
                plain, clipped = rho * r.adv, min(max(rho, 1 - cfg.eps_low), 1 + cfg.eps_high) * r.adv
                s["surrogate"] += -r.weight * min(plain, clipped)
                side = "peer" if r.is_peer else "own"
                s[side] += 1
                s["clip_" + side] += clipped < plain
                s["kl"] += (rho - 1) - log_rho
                s["k1"] += -log_rho
                s["ratio"] += rho
            s["w"] += r.weight
            s["w_peer"] += r.weight if r.is_peer else 0.0
    tokens = s["own"] + s["peer"]
    peer_rows = sum(r.is_peer for r in live)
    out = {"pg/loss": s["surrogate"] / sum(len(r.response) for r in kept),
           "pg/clipfrac": (s["clip_own"] + s["clip_peer"]) / tokens,
           "pg/clipfrac_own": s["clip_own"] / s["own"], "pg/approx_kl": s["kl"] / tokens,
           "pg/approx_kl_k1": s["k1"] / tokens,
           "pg/ratio_mean": s["ratio"] / tokens, "pg/mean_weight": s["w"] / len(live),
           "pg/tokens": tokens, "pg/own_tokens": s["own"], "pg/peer_tokens": s["peer"],
           "zero_adv_frac": sum(r.adv == 0 for r in rows) / len(rows)}
    if peer_rows:
        out |= {"pg/clipfrac_peer": s["clip_peer"] / s["peer"], "pg/peer_mean_weight": s["w_peer"] / peer_rows}
    return out


def fixed_policy_update(tr: graft.Trainer, rows, replaced) -> dict:
    """tr.update with the optimizer step a no-op, so every minibatch sees the same policy."""
    tr.opt.step = lambda *a, **k: None
    return tr.update(0, rows, replaced)


def assert_metrics_equal(m: dict, ref: dict):
    for k, v in ref.items():
        # The KL estimators are means of differences of float32 log-probs of size ~1-5, so their round-off is
        # absolute (float32's eps x |log p| ~ 1e-7 per token), not relative to a mean near 0.
        tol = 1e-6 if "approx_kl" in k else 1e-9
        assert m.get(k) == pytest.approx(v, rel=1e-6, abs=tol), (k, m.get(k), v)
    loss_keys = {k for k in m if k.startswith("pg/")}
    assert loss_keys == {k for k in ref if k.startswith("pg/")}, "every logged loss metric has a reference"


def test_every_loss_metric_of_a_planted_step_equals_its_direct_computation(tiny, tmp_path):
    tr = graft.Trainer(planted_config(tiny, tmp_path / "run"))
    rows, replaced = planted_rows(tr)
    ref = naive_step_metrics(tr, rows)
    m = fixed_policy_update(tr, rows, replaced)
    assert m["minibatches"] == 3 and m["peer_minibatches"] == 2  # one minibatch with no peer row at all
    assert ref["pg/clipfrac_peer"] > 0 and ref["pg/clipfrac_own"] > 0  # the clip acts on both sides
    assert_metrics_equal(m, ref)


def test_a_step_without_peer_rows_logs_no_peer_means(tiny, tmp_path):
    tr = graft.Trainer(planted_config(tiny, tmp_path / "run", minibatches=2))
    rows, replaced = planted_rows(tr, peer_groups=())
    ref = naive_step_metrics(tr, rows)
    m = fixed_policy_update(tr, rows, replaced)
    assert "pg/clipfrac_peer" not in m and "pg/peer_mean_weight" not in m and m["pg/peer_tokens"] == 0
    assert_metrics_equal(m, ref)


PLANTED_RANKS = '''
import json, sys
sys.path[:0] = [{root!r}, {root!r} + "/tests"]  # the modules, and this test file (its planted step)
from pathlib import Path
import torch
import graft
from tools import plot
from test_metrics import fixed_policy_update, naive_step_metrics, planted_config, planted_rows
tr = graft.Trainer(planted_config(Path({tiny!r}), sys.argv[1], fsdp=sys.argv[2] == "fsdp"))
rows, replaced = planted_rows(tr)
ref = naive_step_metrics(tr, rows) if sys.argv[2] != "fsdp" else None
m = fixed_policy_update(tr, rows, replaced)
if tr.dist.main:
    Path(sys.argv[3]).write_text(json.dumps({{"metrics": m, "ref": ref}}))
import os
sys.stdout.flush()
os._exit(0)  # as graft.main does under --fsdp: gloo + FSDP2 can abort in a destructor at exit
'''


@pytest.mark.parametrize("mode", ["dp", "fsdp"])
def test_planted_step_metrics_on_two_gloo_ranks(tiny, tmp_path, mode):
    """The same planted step on two ranks (data parallel, and FSDP2 with its idle turns): sums and counts
    are reduced apart, so every metric equals the direct computation on one process."""
    script = tmp_path / "ranks.py"
    script.write_text(PLANTED_RANKS.format(root=str(ROOT), tiny=str(tiny)))
    out = tmp_path / "metrics.json"
    port = "29547" if mode == "dp" else "29549"
    args = ["-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", port,
            str(script), str(tmp_path / "run"), mode, str(out)]
    r = run_py(args, tmp_path, {"PYTHONPATH": str(ROOT)}, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    got = json.loads(out.read_text())
    if mode == "fsdp":  # the one-process reference, computed here with the same rows
        tr = graft.Trainer(planted_config(tiny, tmp_path / "one"))
        rows, _ = planted_rows(tr)
        got["ref"] = naive_step_metrics(tr, rows)
    assert_metrics_equal(got["metrics"], got["ref"])


# ------------------------------------------------------------------------------------------------
# The keys of a real step: each has its line in METRICS; --report-to; graft.py plot
# ------------------------------------------------------------------------------------------------


@pytest.fixture
def two_runs(tiny, tmp_path, monkeypatch):
    """A GRAFT step against a planted stored peer and two GRPO steps: (graft run, grpo run, trainer)."""
    from test_graft import planted
    tr, _, _, _ = planted(tiny, tmp_path, monkeypatch, delta=0.0)
    m = tr.step(0)
    assert m["accepted"] > 0 and "pg/clipfrac_peer" in m
    tr.log(m)
    grpo = graft.Trainer(planted_config(tiny, tmp_path / "grpo", steps=2, minibatches=2, save_every=5))
    grpo.fit()
    return tr.files.out, grpo.files.out, tr


def test_every_logged_key_is_in_the_metrics_table(two_runs):
    for run in two_runs[:2]:
        for line in read_metrics(run / "metrics.jsonl"):
            undocumented = [k for k in line if metric_doc(k) is None]
            assert not undocumented, f"add these keys to metrics.METRICS: {undocumented}"
    table = metrics_markdown()
    assert "| `<kind>/clipfrac_peer` | Clipped peer tokens over peer tokens through the loss" in table


@needs_tensorboard
def test_report_to_tensorboard_logs_the_same_keys(two_runs):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    run, _, tr = two_runs
    m = read_metrics(run / "metrics.jsonl")[0]
    tr.cfg.report_to = "tensorboard"
    tr.log(m | {"step": 1})
    acc = EventAccumulator(str(run / "tensorboard"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert tags == set(report_values(m)), tags ^ set(report_values(m))
    for k, v in report_values(m).items():
        (event,) = acc.Scalars(k)
        assert event.step == 1 and event.value == pytest.approx(v, rel=1e-6), k


def wandb_records(path: Path) -> list:
    """The protobuf records of an offline W&B run file (<run>.wandb): a 7-byte header (":W&B", magic, version),
    then LevelDB-log blocks of 32 KiB whose records each have a 7-byte header (crc32, length, type: 1 = whole,
    2 / 3 / 4 = first / middle / last part); a block's last < 7 bytes are padding."""
    from wandb.proto import wandb_internal_pb2
    data, block = path.read_bytes(), 32768
    assert data[:4] == b":W&B", path
    pos, part, out = 7, b"", []
    while len(data) - pos >= 7:
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        part += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            out.append(wandb_internal_pb2.Record.FromString(part))
            part = b""
    return out


@needs_wandb
def test_report_to_wandb_offline_logs_the_same_keys(two_runs, monkeypatch, tmp_path):
    for k, v in dict(WANDB_MODE="offline", WANDB_SILENT="true", WANDB_CONSOLE="off", WANDB_PROJECT="graft-test",
                     WANDB_CONFIG_DIR=str(tmp_path / "cfg"), WANDB_CACHE_DIR=str(tmp_path / "cache"),
                     WANDB_DATA_DIR=str(tmp_path / "data")).items():
        monkeypatch.setenv(k, v)
    run, _, tr = two_runs
    m = read_metrics(run / "metrics.jsonl")[0]
    tr.cfg.report_to = "wandb"
    tr.log(m | {"step": 1})
    import wandb
    tr.live.run.finish()  # what the process's exit does, ...
    wandb.teardown()  # ... and the end of its W&B service, which writes the run's file
    (path,) = (run / "wandb").glob("offline-run-*/run-*.wandb")
    records = {}
    for r in wandb_records(path):
        records.setdefault(r.WhichOneof("record_type"), []).append(r)
    assert {"run", "history"} <= set(records), (path.stat().st_size, sorted(records))
    (info,) = [r.run for r in records["run"]]
    assert info.project == "graft-test" and info.display_name == f"{run.name}-{tr.cfg.name}"
    config = {c.key: json.loads(c.value_json) for c in info.config.update}
    assert config["model"] == tr.cfg.model and config["report_to"] == "wandb"  # the Config, as run.json keeps it
    (history,) = [{i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
                  for r in records["history"]]  # a key with "/" (pg/clipfrac_own) is kept as its parts
    logged, want = {k: v for k, v in history.items() if not k.startswith("_")}, report_values(m)
    assert history["_step"] == 1 and set(logged) == set(want), set(logged) ^ set(want)
    for k, v in want.items():
        assert logged[k] == pytest.approx(v, rel=1e-12), k


def test_report_values_and_the_missing_package_error(tiny, tmp_path, monkeypatch):
    m = {"step": 3, "reward": 0.5, "accepted": 4, "mean_s": float("nan"), "assignment": "ab12", "flag": True}
    assert report_values(m) == {"reward": 0.5, "accepted": 4.0}  # numbers only, NaN and step left out
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in ("wandb", "tensorboard")
                        else real(name, *a))
    for kind in ("wandb", "tensorboard"):
        with pytest.raises(ValueError, match=rf"--report-to: {kind} needs the optional package '{kind}': "
                                             rf"pip install {kind}"):
            validate_config(planted_config(tiny, tmp_path, report_to=kind))


def test_metric_series_gate_and_run_labels():
    recs = [{"step": 0, "accepted": 3, "rejected": 1, "mean_s": float("nan")},
            {"step": 1, "accepted": 0, "rejected": 0}, {"step": 2, "accepted": 1, "rejected": 4, "mean_s": 0.5}]
    assert plot.metric_series(recs, "gate") == ([0, 2], [0.75, 0.2])  # a step that received nothing: no point
    assert plot.metric_series(recs, "mean_s") == ([2], [0.5])
    labels = plot.run_labels(["/r/tiny/seed0/graft/A", "/r/tiny/seed0/graft/B", "/r/tiny/seed0/grpo/A"])
    assert labels == ["graft/A", "graft/B", "grpo/A"]


@needs_matplotlib
def test_plot_writes_one_png_per_metric_group(two_runs, tmp_path):
    from matplotlib.image import imread
    graft_run, grpo_run, _ = two_runs
    assert graft.main([
        "plot", str(graft_run), str(grpo_run), "--out", str(tmp_path / "plots")]) == 0
    pngs = sorted(p.stem for p in (tmp_path / "plots").glob("*.png"))
    assert set(pngs) == set(plot.PLOT_GROUPS), set(pngs) ^ set(plot.PLOT_GROUPS)  # the GRAFT run has every group
    for name in pngs:
        img = imread(tmp_path / "plots" / f"{name}.png")
        assert img.ndim == 3 and img.shape[0] > 100 and img.std() > 0, name  # a picture, not a blank


def test_plot_errors_name_the_problem(tmp_path, monkeypatch):
    (tmp_path / "run").mkdir()
    with pytest.raises(SystemExit, match="run: no metrics.jsonl"):
        plot.read_metrics_file(tmp_path / "run")
    (tmp_path / "run" / "metrics.jsonl").write_text('{"step": 0}\nnot json\n{"step": 1}\n{"ste')
    with pytest.raises(SystemExit, match=r"metrics.jsonl:2: not a JSON line"):
        plot.read_metrics_file(tmp_path / "run")
    (tmp_path / "run" / "metrics.jsonl").write_text('{"step": 0}\n{"step": 1}\n{"ste')  # cut last line: skipped
    assert plot.read_metrics_file(tmp_path / "run") == [{"step": 0}, {"step": 1}]
    import sys
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if it were not installed
    with pytest.raises(SystemExit, match="graft.py plot needs matplotlib .*: pip install matplotlib"):
        plot.plot_runs([str(tmp_path / "run")], tmp_path / "plots")


# ------------------------------------------------------------------------------------------------
# reward/box_refused: a planted step's responses, boxes refused by a reading rule counted by hand
# ------------------------------------------------------------------------------------------------

# One block of 8 responses to a gold g, repeated over the step's 32: (text, refused by a reading rule, paid).
# A wrong value and a missing box score 0 too, but not because of how the box was written: not counted.
BOX_BLOCK = [
    (lambda g: f"The sum is \\boxed{{{g}}}.5", True, 0.0),  # the value continued after the box
    (lambda g: f"So \\boxed{{{g}}}\n\nAnswer: {int(g) + 2}", True, 0.0),  # a second final answer that differs
    (lambda g: f"So \\boxed{{{int(g) + 1}}}.", False, 0.0),  # a wrong value: refused by the comparison
    (lambda g: f"The answer is {g}.", False, 0.0),  # no box at all (strict: no answer, nothing refused)
    (lambda g: f"\\boxed{{{g}}}", False, 1.0),
    (lambda g: f"so there are $\\boxed{{{g}}}$ ways to do it.", False, 1.0),  # prose after the box
    (lambda g: f"\\boxed{{{g}}}\n\nFinal Answer: The final answer is {g}. I hope it is correct.", False, 1.0),
    (lambda g: f"$\\boxed{{{g}}}$ is our answer.", False, 1.0),
]


def test_reward_box_refused_is_the_share_refused_by_a_reading_rule(tiny, tmp_path, monkeypatch, capsys):
    """A step whose 32 responses are planted (the decoded texts replaced): 8 hold a box refused by a reading rule,
    so the logged share is 8 / 32 = 0.25, in the step's metrics and in metrics.jsonl; the wrong value and the
    missing box, which score 0 as well, are not in it. High in a first step: one WARNING naming the cause."""
    tr = graft.Trainer(planted_config(tiny, tmp_path / "run", reward_timeout=0))
    batch = batch_indices(len(tr.data), 0, 8, 0)
    golds = [tr.data[batch[r // 4]]["answer"] for r in range(32)]
    plan = [BOX_BLOCK[r % len(BOX_BLOCK)] for r in range(32)]
    planted = [make(g) for (make, _, _), g in zip(plan, golds)]
    decoded = iter(planted)  # one process: responses are decoded in the order r = g * n + i
    monkeypatch.setattr(graft, "decode_response", lambda tokens, tok, **kw: (next(decoded), False))
    own, counts, _ = tr.rollout(0, batch)
    assert own.texts == planted
    assert own.rewards.view(-1).tolist() == [paid for _, _, paid in plan]  # each text scored as its row says
    by_hand = sum(refused for _, refused, _ in plan) / 32
    assert by_hand == 0.25 and counts["reward/box_refused"] == by_hand
    m = {"step": 0} | graft.rollout_metrics(own) | counts
    tr.log(m)
    assert read_metrics(tr.files.out / "metrics.jsonl")[-1]["reward/box_refused"] == 0.25
    err = capsys.readouterr().err
    assert err.count("WARNING") == 1 and "25% of the responses hold a box" in err and "What counts as an answer" in err
    tr.log(m | {"step": 1})  # once per launch
    tr.box_warned = False
    tr.log(m | {"step": 2, "reward/box_refused": 0.19})  # under the threshold
    tr.log(m | {"step": tr.BOX_WARN_STEPS})  # past the first steps: a model that learned a format, not a reader's
    assert "WARNING" not in capsys.readouterr().err


def test_reward_box_refused_is_not_logged_with_another_reward(tiny, tmp_path, monkeypatch):
    """Another --reward reads answers its own way: verify.py's refusals say nothing about it."""
    (tmp_path / "mine.py").write_text("def pays_all(responses, golds, *, workers=0):\n"
                                      "    return [1.0] * len(responses)\n")
    tr = graft.Trainer(planted_config(tiny, tmp_path / "run", reward=f"{tmp_path / 'mine.py'}:pays_all",
                                      reward_timeout=0))
    monkeypatch.setattr(graft, "decode_response", lambda tokens, tok, **kw: ("\\boxed{3}.5", False))
    own, counts, _ = tr.rollout(0, batch_indices(len(tr.data), 0, 8, 0))
    assert own.rewards.sum() == 32 and "reward/box_refused" not in counts


# ------------------------------------------------------------------------------------------------
# README's figure: `python -m tools.tiny figure RUN_DIR --out PNG` from a planted panel run's files
# ------------------------------------------------------------------------------------------------


def planted_reward(seed: int, method: str, model: str, step: int, prompt: int, i: int) -> float:
    return float((seed + 2 * step + prompt + i + (method == "graft") + 2 * (model == "B")) % 3 == 0)


def planted_panel(run_dir: Path, *, seeds=2, steps=3, n=2) -> dict:
    """A finished panel's files as tiny.py lays them out: run.json, panel/set.json (halves: A fails p0 p1, B fails
    p2 p3) and each run's rollout files of the 4 prompts, with planted_reward's rewards."""
    import dataclasses
    from tools import tiny
    pc = tiny.PresetConfig(out=str(run_dir), seeds=seeds, n=n, panel_half=2, panel_steps=steps, held_out=False)
    (run_dir / "panel").mkdir(parents=True)
    (run_dir / "run.json").write_text(json.dumps({"preset": dataclasses.asdict(pc)}))
    halves = {"A": ["p0", "p1"], "B": ["p2", "p3"]}
    (run_dir / "panel" / "set.json").write_text(json.dumps({"halves": halves}))
    for s in range(seeds):
        for method in ("grpo", "graft"):
            for m in "AB":
                ex = run_dir / "panel" / f"seed{s}" / method / (m if method == "grpo" else "") / "exchange"
                for t in range(steps):
                    r = torch.tensor([[planted_reward(s, method, m, t, g, i) for i in range(n)] for g in range(4)])
                    ro = StepRollouts(prompt_ids=[f"p{g}" for g in range(4)], tokens=[[1]] * 4 * n,
                                      logprobs=[torch.zeros(1)] * 4 * n, texts=["x"] * 4 * n,
                                      eos=torch.ones(4, n, dtype=torch.bool), rewards=r,
                                      advantages=torch.zeros(4, n))
                    save_rollouts(rollout_path(ex, m.lower(), t), ro, {"run_id": "planted"})
    return halves


@needs_matplotlib
def test_tiny_figure_draws_the_panels_curves(tmp_path):
    from tools import tiny
    from matplotlib.image import imread
    from test_graft import run_py
    halves = planted_panel(tmp_path / "run")
    _, pc = tiny.saved_preset(str(tmp_path / "run"), "figure")
    curves = tiny.panel_curves(str(tmp_path / "run"), pc)
    for m in "AB":  # the naive loop: per seed and step, the mean over the own half's prompts and rollouts
        for method in ("grpo", "graft"):
            want = [[100 * sum(planted_reward(s, method, m, t, int(q[1:]), i) for q in halves[m] for i in range(2)) / 4
                     for t in range(3)] for s in range(2)]
            assert curves[m][method.upper()] == want, (m, method)  # multiples of 1/4: exact
    r = run_py(["-m", "tools.tiny", "figure", str(tmp_path / "run"), "--out", str(tmp_path / "fig.png")], tmp_path)
    assert r.returncode == 0 and "2 seed(s)" in r.stdout, r.stderr[-2000:]
    img = imread(tmp_path / "fig.png")[..., :3]  # (H, W, 3) in [0, 1]
    assert img.shape[:2] == (310, 840), img.shape  # two panels, 4.2 x 3.1 inches each at 100 dpi
    for colour in ((0.122, 0.467, 0.706), (1.0, 0.498, 0.055)):  # C0 (GRPO) and C1 (GRAFT): both curves drawn
        assert (abs(img - torch.tensor(colour).numpy()).max(-1) < 0.02).sum() > 200, colour
    planted = json.loads((tmp_path / "run" / "run.json").read_text())
    planted["preset"]["panel"] = False
    (tmp_path / "run" / "run.json").write_text(json.dumps(planted))
    with pytest.raises(SystemExit, match="ran without the mechanism panel"):
        tiny.figure(str(tmp_path / "run"), str(tmp_path / "no.png"))
    with pytest.raises(SystemExit, match=r"tiny.py figure: .*run.json not found; is .* the --out folder"):
        tiny.figure(str(tmp_path), str(tmp_path / "no.png"))
