"""Curves of GRAFT runs: `python graft.py plot RUN_DIR [RUN_DIR ...] [--out DIR] [--smooth K]`.

Reads each run's metrics.jsonl (one JSON line per step, keys in metrics.METRICS) and writes one PNG per
metric group of PLOT_GROUPS, one panel per key, one line per run, so the two sides of a pair or GRAFT
next to GRPO share the axes. draw_curves is the same drawing for curves computed elsewhere (the tiny
preset's mechanism panel, README's figure: `python -m tools.tiny figure`). matplotlib is an optional
dependency, imported only when plotting. Of ours it imports only exchange.py (atomic writes); graft.py
calls main() for its `plot` command.

Launch line:
    python graft.py plot runs/tiny/seed0/graft/A runs/tiny/seed0/graft/B runs/tiny/seed0/grpo/A --out runs/tiny/plots
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path

from exchange import atomic_write
from metrics import read_metrics


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
    try:
        return read_metrics(path)  # the last line may be cut by a kill (skipped); any other bad line is damage
    except ValueError as e:
        raise SystemExit(f"graft.py plot: {e}") from None


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


def pyplot(command: str):
    """matplotlib.pyplot on the file-only Agg backend, or a SystemExit naming the command and the install."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit(f"{command} needs matplotlib (an optional dependency): pip install matplotlib") from None
    return plt


def draw_curves(panels: dict[str, dict[str, list[list[float]]]], path: str | os.PathLike, *, xlabel: str,
                ylabel: str, title: str = "", command: str = "graft.py plot") -> Path:
    """One PNG: a panel per key of ``panels``, in it a curve per label. Each curve is given as one list of
    values per repeat (seed), all of one length, at x = 1, 2, ...: drawn is their mean, with a band of
    +- one sample std where there are several. Written atomically; returns the path."""
    plt = pyplot(command)
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.1), squeeze=False, sharey=True)
    for ax, (name, curves) in zip(axes.flat, panels.items()):
        for i, (label, repeats) in enumerate(curves.items()):
            assert repeats and len({len(r) for r in repeats}) == 1, f"{name} / {label}: ragged or empty repeats"
            xs = list(range(1, len(repeats[0]) + 1))
            cols = list(zip(*repeats))  # (steps,) tuples of one value per repeat
            mean = [sum(c) / len(c) for c in cols]
            ax.plot(xs, mean, color=f"C{i}", linewidth=1.6, label=label + (f" ({len(repeats)} seeds)"
                                                                           if len(repeats) > 1 else ""))
            if len(repeats) > 1:
                sd = [math.sqrt(sum((v - m) ** 2 for v in c) / (len(c) - 1)) for c, m in zip(cols, mean)]
                ax.fill_between(xs, [m - d for m, d in zip(mean, sd)], [m + d for m, d in zip(mean, sd)],
                                color=f"C{i}", alpha=0.2, linewidth=0)
        ax.set_title(name, fontsize=9.5)
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="upper left")
    axes.flat[0].set_ylabel(ylabel)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.subplots_adjust(left=0.08, right=0.98, bottom=0.16, top=0.8 if title else 0.9, wspace=0.08)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=100, format="png"))
    plt.close(fig)
    return path


def plot_runs(runs: list[str], out: str | os.PathLike, *, smooth: int = 1) -> list[Path]:
    """Write <out>/<group>.png for every group of PLOT_GROUPS that some run logged; returns the paths.

    smooth: trailing moving average over this many logged steps (1 = the raw values)."""
    plt = pyplot("graft.py plot")
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
