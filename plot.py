"""Curves of GRAFT runs: `python graft.py plot RUN_DIR [RUN_DIR ...] [--out DIR] [--smooth K]`.

Reads each run's metrics.jsonl (one JSON line per step, keys in graft.METRICS) and writes one PNG per
metric group of PLOT_GROUPS, one panel per key, one line per run, so the two sides of a pair or GRAFT
next to GRPO share the axes. matplotlib is an optional dependency, imported only when plotting. Of ours it
imports only exchange.py (atomic writes); graft.py calls main() for its `plot` command.

Launch line:
    python graft.py plot runs/tiny/seed0/graft/A runs/tiny/seed0/graft/B runs/tiny/seed0/grpo/A --out runs/tiny/plots
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

from exchange import atomic_write


# One PNG per group, one panel per key, one line per run. "gate" is derived: accepted / (accepted + rejected).
PLOT_GROUPS: dict[str, tuple[str, ...]] = {
    "reward": ("reward", "peer_reward", "eval/mean"),
    "all_fail": ("all_fail", "all_pass"),
    "exchange": ("candidates_in", "selected", "accepted", "rejected"),
    "compatibility": ("mean_s", "mean_w"),
    "gate": ("gate",),
    "clip": ("pg/clipfrac_own", "pg/clipfrac_peer"),
    "kl": ("pg/approx_kl",),
    "grad_norm": ("grad_norm",),
    "response_len": ("response_len",),
    "time": ("time/sample", "time/verify", "time/logprob", "time/wait", "time/exchange", "time/update", "time/step"),
}


def read_metrics_file(run: str | os.PathLike) -> list[dict]:
    """The lines of <run>/metrics.jsonl (or of the file given). A half-written last line is skipped."""
    path = Path(run)
    path = path / "metrics.jsonl" if path.is_dir() else path
    if not path.is_file():
        raise SystemExit(f"graft.py plot: {run}: no metrics.jsonl (give a run's --out folder)")
    lines = path.read_text(errors="replace").splitlines()
    out = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except ValueError:
            if i < len(lines):  # the last line may be cut by a kill; any other is damage
                raise SystemExit(f"graft.py plot: {path}:{i}: not a JSON line") from None
    return out


def metric_series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of one key over a run's lines; steps without a finite number are left out."""
    steps, values = [], []
    for r in records:
        if key == "gate":
            n = r.get("accepted", 0) + r.get("rejected", 0) if isinstance(r.get("accepted"), (int, float)) else 0
            v = r["accepted"] / n if n else None
        else:
            v = r.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            steps.append(int(r["step"]))
            values.append(float(v))
    return steps, values


def run_labels(runs: list[str]) -> list[str]:
    """Short names for the runs: their paths without the leading folders they all share."""
    parts = [Path(r).resolve().parts for r in runs]
    common = 0
    while all(len(p) > common + 1 for p in parts) and len({p[common] for p in parts}) == 1:
        common += 1
    labels = ["/".join(p[common:]) for p in parts]
    return labels if len(set(labels)) == len(labels) else [str(r) for r in runs]


def plot_runs(runs: list[str], out: str | os.PathLike, *, smooth: int = 1) -> list[Path]:
    """Write <out>/<group>.png for every group of PLOT_GROUPS that some run logged; returns the paths.

    smooth: trailing moving average over this many logged steps (1 = the raw values)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("graft.py plot needs matplotlib (an optional dependency): pip install matplotlib") from None
    data = {label: read_metrics_file(r) for label, r in zip(run_labels(runs), runs)}
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for group, keys in PLOT_GROUPS.items():
        series = {k: {label: metric_series(recs, k) for label, recs in data.items()} for k in keys}
        keys = [k for k in keys if any(v for _, v in series[k].values())]
        if not keys:
            continue
        cols = min(len(keys), 4)
        rows = -(-len(keys) // cols)
        fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.2 * rows), squeeze=False)
        for ax, key in zip(axes.flat, keys):
            for i, (label, (steps, values)) in enumerate(series[key].items()):
                if values:
                    windows = [values[max(0, j - smooth + 1): j + 1] for j in range(len(values))]
                    ax.plot(steps, [sum(w) / len(w) for w in windows], label=label, color=f"C{i}", linewidth=1.2)
            ax.set_title("gate = accepted / (accepted + rejected)" if key == "gate" else key, fontsize=10)
            ax.set_xlabel("step")
            ax.grid(alpha=0.3)
        for ax in list(axes.flat)[len(keys):]:
            ax.axis("off")
        axes.flat[0].legend(fontsize=8)
        # Fixed margins, not tight_layout: that draws every figure once more, about half the time here.
        fig.subplots_adjust(left=0.06 if cols > 2 else 0.12, right=0.98, bottom=0.16 / rows, top=1 - 0.1 / rows,
                            wspace=0.28, hspace=0.5)
        path = out / f"{group}.png"
        atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=90, format="png"))
        plt.close(fig)
        written.append(path)
    return written


def main(argv: list[str]) -> int:
    import argparse
    p = argparse.ArgumentParser(prog="graft.py plot", description="PNG curves from runs' metrics.jsonl: one PNG "
                                "per metric group, the runs on the same axes (e.g. both sides of a pair and GRPO).")
    p.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run folders (--out of graft.py train) or metrics files")
    p.add_argument("--out", default="", help="folder for the PNGs (default: <the runs' common folder>/plots)")
    p.add_argument("--smooth", type=int, default=1, help="moving average over this many steps (1 = raw)")
    a = p.parse_args(argv)
    if a.smooth < 1:
        raise SystemExit("graft.py plot: --smooth must be >= 1")
    out = a.out or Path(os.path.commonpath([str(Path(r).resolve()) for r in a.runs])) / "plots"
    t0 = time.time()
    written = plot_runs(a.runs, out, smooth=a.smooth)
    print(f"[plot] {len(written)} PNGs in {time.time() - t0:.1f}s -> {out}: {', '.join(w.name for w in written)}")
    return 0
