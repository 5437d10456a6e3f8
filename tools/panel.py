"""The mechanism panel for any pair: does a receiver learn the prompts it had no signal on?

GRAFT's premise (paper, Sec. 3) is about the prompts on which the receiver fails all n rollouts: GRPO gets
no gradient there (every advantage is 0), GRAFT gets one from the peer's mixed group (Eq. 4). The panel
puts exactly those prompts in front of both methods and reads what they did from the runs' own files:

  1. The pick. Both models before RL sample n responses (the training temperature and top-p) on a pool of
     problems (a seeded shuffle of --prompts), --chunk problems at a time, until two disjoint halves of
     --half problems are full: A's half, the problems A fails 0/n while B solves lo..hi of n (--peer, a
     mixed group: Eq. 4's condition), and B's half, the other way round; the first of each kind in pool
     order. The halves make the fixed set (set.jsonl, A's half first).
  2. The runs. From the same checkpoints and with the same flags: GRPO for each model alone and the GRAFT
     pair, each training on the whole fixed set every step (--steps steps, 2 x --half prompts per step),
     one run per seed; with --deltas, one more GRAFT pair per extra compatibility floor (arm
     "graft_d<delta>", labelled in every table). Every process is `graft.py train` (and `graft.py eval`),
     so the reward, the swap, the gate and the update are the trainer's own: a reward flag among the
     training flags reaches every process.
  3. The held-out set (--held-out, problems of the same kinds, never trained on): each model before RL and
     each arm's final checkpoint of each model evaluated by `graft.py eval` with --eval-samples k at the
     training temperature: pass@1 (avg@k) before and after, overall and per kind ("family" of the rows).
  4. The report (panel.txt, panel.csv), every figure from the files: per model and window of steps, the
     train reward (mean of the rollouts' rewards in the rollout files) on its own all-fail half and on the
     other half, under GRPO and under each GRAFT arm, and GRAFT - GRPO paired by seed; per GRAFT arm the
     groups each model received per step (the balanced swap recomputed from the rollout files with the
     trainer's multi_peer_sources, and checked against the fingerprint each process logged), its
     candidates (Eq. 4) and the peer responses the gate accepted (metrics.jsonl), the quantiles of the
     scored responses' s and the clip fractions of peer against own tokens, and what the gate did with the
     received successes and failures (by the source's verdicts: how many it kept, their s medians); then the
     held-out table. When a direction's candidates are (nearly) empty the report says so: the balanced
     swap moves m = min(candidates each way) groups per step, so one empty direction stops both, and
     --no-balance (the paper's ablation) lets the other one through.

Our choices (numbered so that reviews can cite them):
  1. In-sample by design: the set is trained on every step, so its reward is an evaluation of the current
     policy at each step (n samples per prompt, the trainer's temperature), read from the rollout files
     at no extra cost. Whether that generalises is the held-out table's question, not the panel's.
  2. The pick uses the training sampling (n, temperature, top-p, template) so that "fails 0/n" is what the
     trainer's rule would see on a group; a prompt that A fails 0/8 in the pick still has some chance per
     sample, so GRPO is not strictly signal-free there: the GRPO column measures that chance.
  3. The peer window excludes a peer that solves all n (no candidate: zero advantages) and, by default,
     also 1 and n-1 (tiny.py's choice 7: the group then says mostly "not this one" or mostly "this one").
  4. s: the quantiles are over every scored response of the window's steps and seeds (metric s_each, the
     s of each response the receiver scored, accepted or not). Runs written before s_each was logged hold
     only each step's mean s (mean_s): their quantiles are over those means, and the report says so. The s
     of every response at the start is `graft.py preflight`'s (run it on the set: run_pair.sh real does).
  5. A short half (the pool ran out) stops the panel with what to do, unless --no-balance is given: without
     the balanced swap each direction is trained on its own, and a one-sided set still measures it.
  6. The gate line asks whether Eq. 8 keeps the signal of a group: the group's advantages sum to zero, and a
     gate that keeps the failures and drops the successes turns a mixed group into a push away from what
     the peer got right. It is recomputed from s_each and s_index (s > delta) and checked against the
     trainer's accepted count.

Launch lines:
    python graft.py panel --model-a A --model-b B --prompts pool.jsonl --held-out held.jsonl \\
        --out runs/panel --half 24 --steps 30 [training flags: --lr 1e-5 --n 8 --max-response-tokens 16 ...]
    python graft.py panel report runs/panel      # re-print from the files; a running panel: the steps done
    bash run_pair.sh real                                                    # the real pair (README)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import random
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from config import build_parser as graft_parser, field_docs
from core import assignment_digest, is_success, multi_peer_sources, success_counts
from exchange import load_rollouts, rollout_path
from metrics import read_metrics

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository root
MODELS = ("A", "B")
"""The two models' labels (folders under the panel's runs); their graft.py side names are the lower case."""

# ------------------------------------------------------------------------------------------------
# Settings
# ------------------------------------------------------------------------------------------------


@dataclass
class PanelConfig:
    """The panel's own settings; every other flag is a training flag, given to each graft.py process."""

    model_a: str = ""
    """Model A: a local transformers folder or hub id (side "a" of the pair)."""
    model_b: str = ""
    """Model B: a local transformers folder or hub id (side "b")."""
    prompts: str = ""
    """The pool: a prompt JSONL ({id, problem, answer[, family]} per line) whose problems the pick evaluates."""
    held_out: str = ""
    """A prompt JSONL of the same kinds that no run trains on: pass@1 before and after for each arm ('' = none)."""
    out: str = "runs/panel"
    """The panel's folder: the pick, the fixed set, every run, the evaluations and the report."""
    half: int = 24
    """Problems in each half of the fixed set; every step trains on the whole set (2 x half prompts)."""
    peer: str = "2-6"
    """lo-hi: how many of its n samples the peer solves on a problem of the other's half (1 <= lo <= hi <= n-1)."""
    pool: int = 3000
    """Most problems of --prompts the pick evaluates (a seeded shuffle, --chunk at a time)."""
    chunk: int = 500
    """Problems per pick evaluation (both models at once); the pick stops after the chunk that fills both halves."""
    pick_seed: int = 2
    """Seed of the pool's shuffle and of the pick's samples (chunk c samples with seed pick_seed + c)."""
    steps: int = 30
    """RL steps of every run."""
    seeds: int = 1
    """RL seeds (sampling, minibatch order); the fixed set is the same for all. Figures: mean +- std over seeds."""
    deltas: str = ""
    """Comma list of extra compatibility floors: one more GRAFT pair per value (arm graft_d<value>)."""
    windows: int = 3
    """Windows of steps in the tables (as equal as the steps allow)."""
    eval_samples: int = 8
    """k: samples per held-out problem at the training temperature (pass@1 = avg@k)."""
    slots: int = 2
    """graft.py processes at once (a GRAFT pair takes two)."""
    flags_a: str = ""
    """Training flags for model A only, shell-quoted, given with '=': --flags-a='--chat-template'."""
    flags_b: str = ""
    """Training flags for model B only, shell-quoted, given with '=': --flags-b='--max-response-tokens 24'."""
    eval_flags: str = ""
    """Flags for the evaluations only, given with '=': --eval-flags='--static-decode --gen-batch-size 1024'."""


# The flags the panel sets for each process itself; given among the training flags, they are refused.
OWN_FLAGS = ("--model", "--name", "--out", "--prompts", "--steps", "--prompts-per-step", "--seed", "--data-seed",
             "--peer-name", "--peer-exchange", "--peer-log", "--resume", "--force", "--benchmarks", "--eval-out",
             "--samples", "--eval-samples", "--run-id")


@dataclass(frozen=True)
class Arm:
    """One trained column: GRPO (each model alone) or a GRAFT pair with extra flags."""

    label: str
    """Folder and column name: grpo, graft, graft_d0.5."""
    flags: tuple[str, ...] = ()
    """graft.py flags of this arm on top of the training flags."""

    @property
    def single(self) -> bool:
        return self.label == "grpo"


def arms_of(deltas: str) -> list[Arm]:
    """GRPO, the GRAFT pair at the training flags' delta, and one GRAFT pair per extra --deltas value."""
    arms = [Arm("grpo"), Arm("graft")]
    for x in (v.strip() for v in deltas.split(",") if v.strip()):
        try:
            d = float(x)
        except ValueError:
            raise SystemExit(f"panel --deltas: {x!r} is not a number (e.g. --deltas 0.5,0.6)") from None
        arms.append(Arm(f"graft_d{d:g}", ("--delta", f"{d:g}")))
    return arms


# ------------------------------------------------------------------------------------------------
# Files
# ------------------------------------------------------------------------------------------------


def write_lines(path: str, lines: list[str]) -> None:
    """Write ``lines`` (and a final newline) to ``path`` atomically."""
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    os.replace(tmp, path)


def load_jsonl(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def write_jsonl(path: str, rows: list[dict]) -> None:
    write_lines(path, [json.dumps(r) for r in rows])


def load_eval(path: str) -> dict[str, dict[str, list[float]]]:
    """graft.py eval's per-problem results -> {file stem: {problem id: [0/1 per sample]}}."""
    with open(path) as f:
        res = json.load(f)
    return {stem: {r["id"]: r["correct"] for r in rows} for stem, rows in res["problems"].items()}


def stats(xs: list[float]) -> tuple[float, float]:
    """(mean, sample std; 0 for one value) of the non-NaN values."""
    xs = [x for x in xs if x == x]
    if not xs:
        return float("nan"), float("nan")
    mu = sum(xs) / len(xs)
    return mu, (math.sqrt(sum((x - mu) ** 2 for x in xs) / (len(xs) - 1)) if len(xs) > 1 else 0.0)


def cell(xs: list[float], signed: bool = False) -> str:
    """A table cell in percent: the mean, and +-std when there are several values; '-' for none."""
    mu, sd = stats(xs)
    if mu != mu:
        return "-"
    s = f"{100 * mu:+.1f}" if signed else f"{100 * mu:.1f}"
    return s if len([x for x in xs if x == x]) == 1 else f"{s}+-{100 * sd:.1f}"


def mean_key(rows: list[dict], key: str) -> float:
    """Mean of a metric over the rows that logged a finite number for it; NaN when none did."""
    vals = [r[key] for r in rows if isinstance(r.get(key), (int, float)) and r[key] == r[key]]
    return sum(vals) / len(vals) if vals else float("nan")


def final_ckpt(out: str, steps: int) -> str:
    return os.path.join(out, "checkpoints", f"step_{steps:06d}")


# ------------------------------------------------------------------------------------------------
# Jobs: graft.py processes run in a fixed number of slots
# ------------------------------------------------------------------------------------------------


@dataclass
class Job:
    """One unit of work: graft.py processes started together (a GRAFT pair is two, which meet in
    their exchange folder, so they must run at the same time), after the jobs named in ``deps``."""

    name: str
    procs: list[tuple[list[str], str]]
    """(graft.py arguments, log path) per process."""
    outputs: list[str]
    """Paths that exist when the job is complete: a finished job is not run again (cache)."""
    deps: tuple[str, ...] = ()
    after: object = None
    """Called (no arguments) once the job is complete, cached or just run."""


def with_prefix(prefix: str, jobs: list[Job]) -> list[Job]:
    """``jobs`` with ``prefix/`` before every name and every dependency: lists built apart (the panel's, the
    held-out table's) may reuse run names such as ``s0/grpo/A``, and run_jobs resolves ``deps`` by name, so two
    lists queued together must not share one (a dependant of one list's run would start when the other list's
    run of that name finished)."""
    return [dataclasses.replace(j, name=f"{prefix}/{j.name}", deps=tuple(f"{prefix}/{d}" for d in j.deps))
            for j in jobs]


NICE_WIDE = 5
"""CPU priority (nice) of the processes of a job wider than --slots, all but its first (see run_jobs)."""


def run_jobs(jobs: list[Job], slots: int, timing: dict, timing_file: str | None = None, *,
             tag: str = "panel") -> list[str]:
    """Run ``jobs`` with at most ``slots`` processes at once, in list order: a job whose deps are done
    but that does not fit the free slots holds back the jobs after it, so the list is the priority.
    A job wider than ``slots`` (a three-way run: three processes that must meet) starts when nothing
    else runs, and runs alone, its processes after the first at nice NICE_WIDE.
    ``timing`` gets each run job's wall seconds (and ``timing_file``, rewritten after each job). The
    first failure stops everything and prints the failed log. Returns the names of the jobs found cached.
    Names are the keys of ``deps``: a list with two jobs of one name is refused (ValueError; see with_prefix)."""
    names = [j.name for j in jobs]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"{tag}: job names must be unique, as deps name them; repeated: {twice} "
                         f"(queue lists built apart through with_prefix)")
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    done, cached = set(), []
    pending = []
    for j in jobs:
        if all(os.path.exists(p) for p in j.outputs):
            print(f"[{tag}] {j.name}: cached", flush=True)
            done.add(j.name)
            cached.append(j.name)
            if j.after:
                j.after()
        else:
            pending.append(j)
    running: list[tuple[Job, list[subprocess.Popen], float]] = []
    while pending or running:
        free = slots - sum(len(j.procs) for j, _, _ in running)
        for j in list(pending):
            if not set(j.deps) <= done:
                continue
            if len(j.procs) > free and not (len(j.procs) > slots and free == slots):
                break
            procs = []
            for i, (args, log) in enumerate(j.procs):
                os.makedirs(os.path.dirname(log), exist_ok=True)
                cmd = [sys.executable, os.path.join(HERE, "graft.py")] + args
                print("+ " + shlex.join(cmd[1:]).replace("\n", "\\n") + f"   > {log}", flush=True)
                # A job wider than the slots has more processes than cores: its first process (the
                # slowest model's) keeps a core, the others run at a lower CPU priority.
                nice = NICE_WIDE if len(j.procs) > slots and i > 0 and hasattr(os, "nice") else 0
                procs.append(subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env,
                                              preexec_fn=(lambda v=nice: os.nice(v)) if nice else None))
            running.append((j, procs, time.time()))
            pending.remove(j)
            free -= len(j.procs)
        if not running:
            raise SystemExit(f"{tag}: jobs {[j.name for j in pending]} wait for jobs that never ran")
        time.sleep(0.2)
        for item in list(running):
            j, procs, t0 = item
            codes = [p.poll() for p in procs]
            if any(c not in (None, 0) for c in codes):
                for _, ps, _ in running:
                    for p in ps:
                        if p.poll() is None:
                            p.kill()
                for (args, log), c in zip(j.procs, codes):
                    if c not in (None, 0):
                        with open(log) as f:
                            print(f.read()[-3000:])
                raise SystemExit(f"{tag}: job {j.name} failed; logs: {', '.join(log for _, log in j.procs)}")
            if all(c == 0 for c in codes):
                running.remove(item)
                timing[j.name] = time.time() - t0
                print(f"[{tag}] {j.name}: {timing[j.name]:.0f}s", flush=True)
                if timing_file:
                    write_lines(timing_file, [json.dumps(timing)])
                done.add(j.name)
                if j.after:
                    j.after()
    return cached


# ------------------------------------------------------------------------------------------------
# The pick: both models before RL on the pool; the two halves
# ------------------------------------------------------------------------------------------------


def pool_rows(rows: list[dict], size: int, seed: int) -> list[dict]:
    """The first ``size`` rows in a seeded shuffle: the problems the pick evaluates, in the pick's order."""
    rows = list(rows)
    random.Random(seed).shuffle(rows)
    return rows[:size]


def parse_peer_window(spec: str, n: int, flag: str = "--peer") -> tuple[int, int]:
    """"lo-hi" -> (lo, hi), checked against n: the peer's group must be mixed (1 <= lo <= hi <= n-1)."""
    try:
        lo, hi = (int(x) for x in spec.split("-"))
    except ValueError:
        raise SystemExit(f"panel {flag}: {spec!r} is not lo-hi (e.g. 2-6)") from None
    if not 1 <= lo <= hi <= n - 1:
        raise SystemExit(f"panel {flag}: {spec!r} must lie within 1-{n - 1} (a mixed group of n={n})")
    return lo, hi


def pick_halves(k_a: dict[str, list[float]], k_b: dict[str, list[float]], order: list[str],
                size: int, *, peer_solves: tuple[int, int]) -> dict[str, list[str]]:
    """The panel's two halves from one evaluation of each model before RL (n samples per problem).

    k_a, k_b: {problem id: [0/1 per sample]} of A and B; order: the evaluated ids, in the order in which
    problems are taken; peer_solves: (lo, hi), the peer's solved samples that qualify, 1 <= lo <= hi <= n-1.
    Returns {"A": ids A fails on every sample while B solves lo..hi of them, "B": the other way round}, the
    first ``size`` of each kind in ``order`` (fewer if there are fewer). The peer's group must be mixed, as
    the paper's candidate rule (Eq. 4) asks: a peer group that solves all n has zero advantages and nothing
    to give.
    """
    lo, hi = peer_solves
    assert lo >= 1 and hi <= min(len(c) for c in k_a.values()) - 1, f"peer window {peer_solves} is not mixed"

    def kind(own, peer):
        return [q for q in order if max(own[q]) == 0 and lo <= sum(peer[q]) <= hi][:size]
    return {"A": kind(k_a, k_b), "B": kind(k_b, k_a)}


def pick_files(out: str, chunk: int, model: str) -> tuple[str, str]:
    """(prompt file, per-problem results) of one pick chunk for one model."""
    return os.path.join(out, f"pool_{chunk:02d}.jsonl"), os.path.join(out, f"pick_{model}_{chunk:02d}.json")


def eval_args(model: str, files: list[str], out: str, pc: PanelConfig, train: dict, side_flags: list[str], *,
              samples: int, seed: int) -> list[str]:
    """graft.py eval: ``samples`` per problem of every file at the training temperature and top-p, with the
    training flags (template, caps, reward) and the side's own, per-problem results to ``out``."""
    return (["eval", "--model", model, "--benchmarks", ",".join(files)] + train["flags"] + side_flags
            + shlex.split(pc.eval_flags)
            + ["--samples", str(samples), "--temperature", str(train["temperature"]), "--top-p", str(train["top_p"]),
               "--seed", str(seed), "--eval-out", out])


def run_pick(pc: PanelConfig, train: dict, timing: dict, timing_file: str, *, tag: str = "panel") -> dict:
    """The pick: both models evaluated before RL (n samples, in parallel) on the pool, --chunk problems at a
    time, until both halves are full; then set.jsonl (the 2 x half rows, A's half first) and set.json (the
    halves, the peer window, how many of each kind the evaluated problems held). Returns set.json's content.
    A pool too small for a half stops the panel naming the flags, unless --no-balance (choice 5)."""
    out = pc.out
    set_json = os.path.join(out, "set.json")
    if os.path.exists(set_json):
        print(f"[{tag}] pick: cached", flush=True)
        with open(set_json) as f:
            return json.load(f)
    n = train["n"]
    window = parse_peer_window(pc.peer, n)
    pool = pool_rows(load_jsonl(pc.prompts), pc.pool, pc.pick_seed)
    k: dict[str, dict[str, list[float]]] = {m: {} for m in MODELS}  # the pick's samples so far
    models = {"A": pc.model_a, "B": pc.model_b}
    side = {"A": shlex.split(pc.flags_a), "B": shlex.split(pc.flags_b)}
    every = {m: [] for m in MODELS}
    chunks = -(-len(pool) // pc.chunk)
    for c in range(chunks):
        prompts = pick_files(out, c, "A")[0]  # one prompt file per chunk, the same for both models
        if not os.path.exists(prompts):
            write_jsonl(prompts, pool[c * pc.chunk:(c + 1) * pc.chunk])
        procs = []
        for m in MODELS:
            res = pick_files(out, c, m)[1]
            procs.append((eval_args(models[m], [prompts], res, pc, train, side[m], samples=n, seed=pc.pick_seed + c),
                          res + ".log"))
        run_jobs([Job(f"pick {c + 1}", procs, [pick_files(out, c, m)[1] for m in MODELS])], pc.slots, timing,
                 timing_file, tag=tag)
        for m in MODELS:
            k[m].update(load_eval(pick_files(out, c, m)[1])[f"pool_{c:02d}"])
        order = [r["id"] for r in pool[:(c + 1) * pc.chunk]]
        every = pick_halves(k["A"], k["B"], order, len(order), peer_solves=window)
        print(f"[{tag}] pick: {len(order)} problems, " + ", ".join(
            f"{m} fails {len(ids)}" for m, ids in every.items()) + f" (need {pc.half} each)", flush=True)
        if min(len(ids) for ids in every.values()) >= pc.half:
            break
    else:
        short = {m: len(ids) for m, ids in every.items() if len(ids) < pc.half}
        if train["balance"]:
            raise SystemExit(
                f"panel: the pool ({len(pool)} problems of {pc.prompts}) holds only {short} problems of a half (need "
                f"{pc.half} each, the peer solving {pc.peer} of {n}); raise --pool (the chunks evaluated so far are "
                f"kept), or lower --half with another --out. A (nearly) empty direction: the balanced swap moves "
                f"m = min(candidates each way) groups, so it would exchange (almost) nothing; --no-balance (the "
                f"paper's ablation) trains each direction on its own, and the panel then runs with the short half")
        print(f"[{tag}] pick: short halves {short} (need {pc.half}); running them under --no-balance", flush=True)
    halves = {m: ids[:pc.half] for m, ids in every.items()}
    by_id = {r["id"]: r for r in pool}
    write_jsonl(os.path.join(out, "set.jsonl"), [by_id[q] for m in MODELS for q in halves[m]])
    meta = {"halves": halves, "in_pool": {m: len(ids) for m, ids in every.items()}, "pool": len(order),
            "chunks": c + 1, "peer_solves": list(window), "samples": n, "seed": pc.pick_seed}
    write_lines(set_json, [json.dumps(meta)])  # written last: marks the pick complete
    return meta


# ------------------------------------------------------------------------------------------------
# The runs: GRPO for each model and the GRAFT pair(s) on the fixed set; the held-out evaluations
# ------------------------------------------------------------------------------------------------


def run_folder(pc: PanelConfig, seed: int, arm: Arm, model: str | None = None) -> str:
    """seed<s>/<arm>/ (its exchange folder for a pair), or that arm's folder of one model."""
    base = os.path.join(pc.out, f"seed{seed}", arm.label)
    return os.path.join(base, model) if model else base


def exchange_folder(pc: PanelConfig, seed: int, arm: Arm, model: str) -> str:
    """Where a run's rollout files are: the pair's shared folder, or a single run's own."""
    return os.path.join(run_folder(pc, seed, arm, model), "exchange") if arm.single else \
        os.path.join(run_folder(pc, seed, arm), "exchange")


def panel_jobs(pc: PanelConfig, train: dict, meta: dict) -> list[Job]:
    """Per seed: every GRAFT arm (two processes each), then GRPO for each model alone, from the same
    checkpoints and flags, the whole fixed set every step; then the held-out evaluations (before RL once,
    each arm's final checkpoints per seed), which fill the slots the shorter runs leave idle."""
    set_file = os.path.join(pc.out, "set.jsonl")
    size = sum(len(v) for v in meta["halves"].values())
    models = {"A": pc.model_a, "B": pc.model_b}
    side = {"A": shlex.split(pc.flags_a), "B": shlex.split(pc.flags_b)}
    done = lambda seed, arm, m: os.path.join(  # noqa: E731
        final_ckpt(run_folder(pc, seed, arm, m), pc.steps), "model.safetensors")
    jobs, evals = [], []
    held = [pc.held_out] if pc.held_out else []
    for seed in range(pc.seeds):
        common = ["--prompts", set_file, "--steps", str(pc.steps), "--prompts-per-step", str(size),
                  "--seed", str(seed), "--data-seed", str(seed), "--resume"] + train["flags"]
        singles = []
        for arm in arms_of(pc.deltas):
            procs = {}
            for m in MODELS:
                args = ["train", "--model", models[m], "--name", m.lower(), "--out", run_folder(pc, seed, arm, m)]
                if not arm.single:
                    peer = next(p for p in MODELS if p != m).lower()
                    args += ["--peer-name", peer, "--peer-exchange", exchange_folder(pc, seed, arm, m)]
                procs[m] = (args + common + side[m] + list(arm.flags), os.path.join(run_folder(pc, seed, arm),
                                                                                   f"{m}.log"))
            name = f"s{seed}/{arm.label}"
            if arm.single:
                singles += [Job(f"{name}/{m}", [procs[m]], [done(seed, arm, m)]) for m in MODELS]
            else:
                jobs.append(Job(name, list(procs.values()), [done(seed, arm, m) for m in MODELS]))
            for m in MODELS if held else ():
                res = os.path.join(run_folder(pc, seed, arm, m), "held_out.json")
                evals.append(Job(f"eval {name}/{m}", [(eval_args(final_ckpt(run_folder(pc, seed, arm, m), pc.steps),
                                                                  held, res, pc, train, side[m],
                                                                  samples=pc.eval_samples, seed=1), res + ".log")],
                                 [res], deps=(f"{name}/{m}" if arm.single else name,)))
        jobs += singles
    for m in MODELS if held else ():
        res = os.path.join(pc.out, "eval", f"before_{m}.json")
        evals.insert(0, Job(f"eval before/{m}", [(eval_args(models[m], held, res, pc, train, side[m],
                                                              samples=pc.eval_samples, seed=1), res + ".log")], [res]))
    return jobs + evals


# ------------------------------------------------------------------------------------------------
# Reading the runs' files
# ------------------------------------------------------------------------------------------------


def step_rewards(folder: str, name: str, steps: int) -> list[dict[str, float]]:
    """Per step, {prompt id: mean reward of its n rollouts}, read from a run's rollout files (``folder``:
    the exchange folder, ``name``: the side's folder in it)."""
    out = []
    for step in range(steps):
        r, _ = load_rollouts(rollout_path(Path(folder), name, step))
        out.append(dict(zip(r.prompt_ids, r.rewards.mean(1).tolist())))  # (G,) per prompt
    return out


def step_sources(exchange: str, sides: list[str], steps: int, *, balance: bool = True):
    """Yield (prompt ids, src, files) for every step of a finished exchange run, recomputed from its rollout
    files with core.multi_peer_sources: src (S, G) long, the side (index into ``sides``, which must be sorted
    as the trainer sorts them) whose group each side received on each prompt, or -1; files: the step's
    StepRollouts of each side, in that order."""
    assert list(sides) == sorted(sides), f"sides {sides} must be in the trainer's (sorted) order"
    for step in range(steps):
        first, _ = load_rollouts(rollout_path(Path(exchange), sides[0], step))
        files = [first] + [load_rollouts(rollout_path(Path(exchange), s, step), prompt_ids=first.prompt_ids)[0]
                           for s in sides[1:]]
        k = torch.stack([success_counts(f.rewards) for f in files])  # (S, G)
        yield first.prompt_ids, multi_peer_sources(k, first.n, balance=balance), files  # src: (S, G) side or -1


def check_assignments(exchange: str, metrics: dict[str, str], steps: int, prints: list[str]) -> int:
    """Check that every process of an exchange run logged, on every step, the assignment fingerprint
    recomputed from the files (``prints``). ``metrics``: side -> its metrics.jsonl. Returns the number of
    steps checked (0 if the run's variant logs no fingerprint); a disagreement stops with the step, the sides
    and their fingerprints."""
    logged = {side: {m["step"]: m.get("assignment") for m in read_metrics(path)} for side, path in metrics.items()}
    checked = 0
    for step in range(steps):
        got = {side: logged[side].get(step) for side in logged}
        if all(v is None for v in got.values()):
            continue
        if set(got.values()) != {prints[step]}:
            raise SystemExit(f"panel: the processes of {exchange} disagree on step {step}'s assignment: logged "
                             f"{got}, the rollout files give {prints[step]}")
        checked += 1
    return checked


def windows(steps: int, parts: int = 3) -> list[tuple[int, int]]:
    """[lo, hi) step ranges, ``parts`` of them as equal as the steps allow (30 -> 0-10, 10-20, 20-30), fewer when
    there are fewer steps."""
    parts = max(1, min(parts, steps))
    return [(steps * i // parts, steps * (i + 1) // parts) for i in range(parts)]


def window_label(w: tuple[int, int]) -> str:
    """1-based, inclusive: (0, 10) -> "1-10", (2, 3) -> "3"."""
    return f"{w[0] + 1}-{w[1]}" if w[1] - w[0] > 1 else f"{w[1]}"


def quantiles(xs: list[float], qs: tuple[float, ...] = (0.1, 0.5, 0.9)) -> list[float]:
    """Linear-interpolated quantiles of the finite values (numpy's default); NaNs for none."""
    xs = sorted(x for x in xs if x == x)
    if not xs:
        return [float("nan")] * len(qs)
    out = []
    for q in qs:
        pos = q * (len(xs) - 1)
        lo = int(math.floor(pos))
        hi = min(lo + 1, len(xs) - 1)
        out.append(xs[lo] + (xs[hi] - xs[lo]) * (pos - lo))
    return out


# ------------------------------------------------------------------------------------------------
# The report
# ------------------------------------------------------------------------------------------------


def describe_set(pc: PanelConfig, meta: dict) -> list[str]:
    """The header: what the fixed set is, and its kinds per half."""
    halves, n = meta["halves"], meta["samples"]
    lo, hi = meta["peer_solves"]
    family = {r["id"]: r.get("family", "-") for r in load_jsonl(os.path.join(pc.out, "set.jsonl"))}
    kinds = sorted(set(family.values()))
    out = [f"mechanism panel (in-sample): a fixed set of {len(halves['A']) + len(halves['B'])} problems of "
           f"{os.path.basename(pc.prompts)}, {len(halves['A'])} that A fails 0/{n} before RL while B solves "
           f"{lo}-{hi} of {n}, and {len(halves['B'])} the other way round; the first of each kind among "
           f"{meta['pool']} problems (a seeded shuffle, seed {meta['seed']}) evaluated once per model before RL "
           f"({n} samples at the training temperature)"]
    for m in MODELS:
        mix = ", ".join(f"{f} {sum(family[q] == f for q in halves[m])}" for f in kinds)
        out.append(f"  {m} fails: {mix} ({meta['in_pool'][m]} such problems among the {meta['pool']})")
    rates = pick_rates(pc, meta)
    for m in MODELS:
        out.append(f"  {m} before RL, pass@1 (%) on the pick's problems by kind: "
                   + ", ".join(f"{f} {100 * v:.1f}" for f, v in rates[m].items()))
    return out


def pick_rates(pc: PanelConfig, meta: dict) -> dict[str, dict[str, float]]:
    """{model: {kind: mean correctness of the pick's samples on the evaluated problems of that kind, and "all"}}."""
    family = {r["id"]: r.get("family", "-") for r in pool_rows(load_jsonl(pc.prompts), meta["pool"], meta["seed"])}
    out = {}
    for m in MODELS:
        k = {}
        for c in range(meta["chunks"]):
            k.update(load_eval(pick_files(pc.out, c, m)[1])[f"pool_{c:02d}"])
        out[m] = {}
        for f in sorted(set(family[q] for q in k)) + ["all"]:
            ids = [q for q in k if f == "all" or family[q] == f]
            out[m][f] = sum(sum(k[q]) / len(k[q]) for q in ids) / len(ids)
    return out


def step_scores(lines: list[dict]) -> list[float]:
    """The s of every scored response in these metrics lines (s_each); a line without s_each (written before
    the trainer logged it) gives its step's mean s instead (choice 4)."""
    return [v for x in lines for v in (x["s_each"] if "s_each" in x else [x.get("mean_s", float("nan"))])]


def gate_split(line: dict, peer, groups: list[int], *, delta: float, compat_weight: bool) -> dict | None:
    """What the gate did with the successes and the failures of the groups a receiver got on one step.

    line: the receiver's metrics line of the step; peer: the source's StepRollouts of that step; groups: the
    prompts (positions in the batch) whose peer group the receiver got. Each received response r = g * n + i
    has its s from s_each at s_index (none: dropped as too long) and is kept when s > delta (Eq. 8; every
    scored one without the compatibility weight). A line written before s_index was logged is read in the
    trainer's order (group by group) when nothing was dropped, else None (its responses cannot be matched).
    Returns {"success": [(s or None, kept)] per received success, "failure": the same for failures}."""
    n = peer.n
    received = [g * n + i for g in sorted(groups) for i in range(n) if peer.mask[g, i]]
    if "s_index" in line:
        s_of = dict(zip(line["s_index"], line["s_each"]))
    elif line.get("dropped_length", 0) == 0 and len(line.get("s_each", [])) == len(received):
        s_of = dict(zip(received, line["s_each"]))
    else:
        return None
    out: dict = {"success": [], "failure": []}
    for r in received:
        s = s_of.get(r)
        out["success" if is_success(peer.rewards.view(-1)[r]) else "failure"].append(
            (s, s is not None and (s > delta or not compat_weight)))
    return out


def gate_splits(pc: PanelConfig, *, arm: Arm, model: str, window: tuple[int, int], groups_of: dict,
                peer_steps: dict, delta: float, train: dict) -> tuple[list[dict], int]:
    """gate_split of every step of a window on which ``model`` received groups, over the seeds, and the number
    of such steps that could not be matched. groups_of, peer_steps: per (seed, model), each step's received
    groups and the peer's StepRollouts (step_sources). Stops if the gate recomputed from the files keeps another
    number of responses than the trainer logged as accepted (--acceptance gate)."""
    splits, unmatched = [], 0
    for s in range(pc.seeds):
        path = os.path.join(run_folder(pc, s, arm, model), "metrics.jsonl")
        lines = {x["step"]: x for x in read_metrics(path)}
        for t in range(*window):
            if not groups_of[(s, model)][t]:
                continue
            sp = gate_split(lines[t], peer_steps[(s, model)][t], groups_of[(s, model)][t], delta=delta,
                            compat_weight=train["compat_weight"])
            if sp is None:
                unmatched += 1
                continue
            kept = sum(k for key in ("success", "failure") for _, k in sp[key])
            if train["acceptance"] == "gate" and kept != lines[t].get("accepted"):
                raise SystemExit(f"panel: {path} step {t}: the gate recomputed from s_each keeps {kept} responses, "
                                 f"the trainer logged accepted = {lines[t].get('accepted')}")
            splits.append(sp)
    return splits, unmatched


def gate_line(splits: list[dict]) -> str:
    """The report's line of gate_split over a window: of the received successes and failures, how many the
    gate kept, and the median s of each (a dropped response counts as received, not kept)."""
    parts = []
    for key, word in (("success", "successes"), ("failure", "failures")):
        xs = [x for d in splits for x in d[key]]
        med = quantiles([s for s, _ in xs if s is not None], (0.5,))[0]
        parts.append(f"{sum(k for _, k in xs)} of {len(xs)} {word} (s median {'-' if med != med else f'{med:.2f}'})")
    return "kept " + " and ".join(parts)


def every_metrics(pc: PanelConfig, arms: list[Arm]) -> list[dict]:
    """Every metrics line of these arms' runs, both models and every seed (the files that exist)."""
    paths = [os.path.join(run_folder(pc, s, a, m), "metrics.jsonl") for s in range(pc.seeds) for a in arms
             for m in MODELS]
    return [x for p in paths if os.path.exists(p) for x in read_metrics(p)]


def steps_done(pc: PanelConfig) -> int:
    """Steps that every run of the panel has finished (lines of its metrics.jsonl, written at a step's end):
    a running panel is reported over these."""
    done = []
    for s in range(pc.seeds):
        for arm in arms_of(pc.deltas):
            for m in MODELS:
                path = os.path.join(run_folder(pc, s, arm, m), "metrics.jsonl")
                done.append(len(read_metrics(path)) if os.path.exists(path) else 0)
    return min(done)


def panel_report(pc: PanelConfig, train: dict, *, steps: int | None = None) -> tuple[str, list[str]]:
    """The panel's print-ready text and its CSV rows (seed, arm, model, half, steps, value), all from the
    panel's files: rewards and received groups from the rollout files, candidates, accepted responses, s and
    clip fractions from metrics.jsonl, pass@1 from the evaluations. Also checks that both processes of every
    GRAFT run logged the assignment recomputed from the files. ``steps``: report the first steps only (a
    running panel: steps_done); the held-out table then waits for the runs' end."""
    with open(os.path.join(pc.out, "set.json")) as f:
        meta = json.load(f)
    partial = steps is not None and steps < pc.steps
    halves, steps, balance = meta["halves"], pc.steps if steps is None else steps, train["balance"]
    arms = arms_of(pc.deltas)
    pairs = [a for a in arms if not a.single]
    wins = windows(steps, pc.windows)
    csv = ["seed,arm,model,half,steps,value"]
    peer_of = {"A": "B", "B": "A"}
    out = describe_set(pc, meta)
    delta = {a.label: (float(a.flags[1]) if a.flags else train["delta"]) for a in pairs}
    out.append(f"GRPO for each model alone and the GRAFT pair ({'balanced swap' if balance else '--no-balance'}, "
               + ", ".join(f"{a.label}: delta {delta[a.label]:g}" for a in pairs)
               + f") from the same checkpoints, {steps} steps x {len(halves['A']) + len(halves['B'])} prompts (the "
               f"whole set) x n={train['n']}, lr {train['lr']:g}; {pc.seeds} seed(s)"
               + "".join(f"; {m}'s own flags: {f}" for m, f in (("A", pc.flags_a), ("B", pc.flags_b)) if f))
    if partial:
        out.append(f"PARTIAL: the runs are still going; the first {steps} of {pc.steps} steps, finished by every run")
    out.append("train reward (%) from the rollout files: mean over the half's prompts, their rollouts and the "
               "window's steps; mean+-std over seeds; GRAFT-GRPO paired by seed")
    head = f"{'model':<7}{'half':<17}{'steps':>7}{'GRPO':>12}"
    for a in pairs:
        head += f"{a.label.upper():>12}{a.label.upper() + '-GRPO':>16}"
    out.append(head)
    rewards = {}
    for s in range(pc.seeds):
        for arm in arms:
            for m in MODELS:
                rewards[(s, arm.label, m)] = step_rewards(exchange_folder(pc, s, arm, m), m.lower(), steps)
    for m in MODELS:
        for half, who in (("own", m), ("other", peer_of[m])):
            ids = halves[who]
            if not ids:
                out.append(f"{m:<7}{f'{half} ({who} fails)':<17}{'':>7}  (empty half)")
                continue
            for w in wins:
                per = {}
                for arm in arms:
                    per[arm.label] = []
                    for s in range(pc.seeds):
                        vals = [rewards[(s, arm.label, m)][t][q] for t in range(*w) for q in ids]
                        per[arm.label].append(sum(vals) / len(vals))
                        csv.append(f"{s},{arm.label},{m},{half},{window_label(w)},{per[arm.label][-1]:.6f}")
                line = f"{m:<7}{f'{half} ({who} fails)':<17}{window_label(w):>7}{cell(per['grpo']):>12}"
                for a in pairs:
                    diff = [x - y for x, y in zip(per[a.label], per["grpo"])]
                    line += f"{cell(per[a.label]):>12}{cell(diff, signed=True):>16}"
                out.append(line)
    out.append("exchange per step (mean over the window's steps and seeds): groups received (the swap recomputed "
               "from the rollout files), candidates in (Eq. 4), peer responses accepted by the gate, s of the "
               "scored responses (p10/p50/p90 over the window's responses" + ("" if all(
                   "s_each" in x for x in every_metrics(pc, pairs)) else "; runs without s_each: over each "
               "step's mean s") + "), clip fractions of peer tokens (over the steps that accepted some) and own "
               "tokens (metrics.jsonl)")
    sides = sorted(m.lower() for m in MODELS)
    for arm in pairs:
        # per seed and model, each step: the groups it received and the peer's rollouts of that step (kept only
        # where it received some: the gate line reads their verdicts)
        groups_of: dict = {(s, m): [] for s in range(pc.seeds) for m in MODELS}
        peer_steps: dict = {(s, m): [] for s in range(pc.seeds) for m in MODELS}
        for s in range(pc.seeds):
            ex = os.path.join(run_folder(pc, s, arm), "exchange")
            prints = []
            for ids, src, files in step_sources(ex, sides, steps, balance=balance):
                prints.append(assignment_digest(src, ids))
                for m in MODELS:
                    r = sides.index(m.lower())
                    groups_of[(s, m)].append(torch.nonzero(src[r] >= 0).view(-1).tolist())
                    peer_steps[(s, m)].append(files[1 - r] if groups_of[(s, m)][-1] else None)  # the other side
            check_assignments(ex, {m.lower(): os.path.join(run_folder(pc, s, arm, m), "metrics.jsonl")
                                   for m in MODELS}, steps, prints)
        received = {key: [len(g) for g in groups] for key, groups in groups_of.items()}
        for m in MODELS:
            rm = [x for s in range(pc.seeds) for x in read_metrics(os.path.join(run_folder(pc, s, arm, m),
                                                                                "metrics.jsonl"))]
            for w in wins:
                rec = [sum(received[(s, m)][w[0]:w[1]]) / (w[1] - w[0]) for s in range(pc.seeds)]
                part = [x for x in rm if w[0] <= x["step"] < w[1]]
                cand, acc = mean_key(part, "candidates_in"), mean_key(part, "accepted")
                s_q = quantiles(step_scores(part))
                # the peer clip fraction over the steps that trained on peer tokens: a step without any has
                # no such fraction (absent or NaN), and averaging it in would hide the others
                clip_peer = mean_key([x for x in part if x.get("accepted", 0) > 0], "pg/clipfrac_peer")
                clip_own = mean_key(part, "pg/clipfrac_own")
                csv += [f"{s},{arm.label},{m},received,{window_label(w)},{x:.6f}" for s, x in enumerate(rec)]
                csv += [f"-1,{arm.label},{m},{key},{window_label(w)},{v:.6f}" for key, v in
                        (("candidates_in", cand), ("accepted", acc), ("s_p10", s_q[0]), ("s_p50", s_q[1]),
                         ("s_p90", s_q[2]), ("clipfrac_peer", clip_peer), ("clipfrac_own", clip_own))]
                num = lambda v, f: "-" if v != v else format(v, f)  # noqa: E731
                out.append(f"  {arm.label} -> {m}  steps {window_label(w):>5}: {sum(rec) / len(rec):5.2f} groups "
                           f"received of {num(cand, '5.2f')} candidates, {num(acc, '5.1f')} responses accepted; s "
                           f"{'/'.join(num(v, '.2f') for v in s_q)}; clip fraction peer {num(clip_peer, '.4f')}, "
                           f"own {num(clip_own, '.4f')}")
                splits, unmatched = gate_splits(pc, arm=arm, model=m, window=w, groups_of=groups_of,
                                                peer_steps=peer_steps, delta=delta[arm.label], train=train)
                if splits or unmatched:
                    out.append(f"    gate: {gate_line(splits) if splits else '-'}" + (
                        f"; {unmatched} step(s) left out (written before s_index, with responses dropped)"
                        if unmatched else ""))
        out += empty_directions(arm, {m: [x for s in range(pc.seeds) for x in received[(s, m)]] for m in MODELS},
                                balance)
    evals = [os.path.join(pc.out, "eval", f"before_{m}.json") for m in MODELS] + [
        os.path.join(run_folder(pc, s, a, m), "held_out.json") for s in range(pc.seeds) for a in arms for m in MODELS]
    if pc.held_out and (partial or not all(os.path.exists(p) for p in evals)):
        out.append("held-out: evaluated after the runs' last step" + ("" if partial else " (not all done yet)"))
    elif pc.held_out:
        text, rows = held_out_report(pc, arms)
        out += text
        csv += rows
    return "\n".join(out), csv


def empty_directions(arm: Arm, received: dict[str, list[int]], balance: bool, *, nearly: float = 0.25) -> list[str]:
    """A note per model that received (nearly) nothing in ``arm``: fewer than ``nearly`` groups per step."""
    notes = []
    for m, per_step in received.items():
        rate = sum(per_step) / max(1, len(per_step))
        if rate < nearly:
            why = ("the balanced swap moves m = min(candidates each way) groups, so the thinner direction bounds "
                   "both; --no-balance (the paper's ablation) lets each direction through on its own"
                   if balance else "its peer was rarely mixed where it failed (no candidates)")
            notes.append(f"  note: {arm.label}: {m} received {rate:.2f} groups per step, (nearly) nothing: {why}")
    return notes


def held_out_report(pc: PanelConfig, arms: list[Arm]) -> tuple[list[str], list[str]]:
    """pass@1 (avg@k) on the held-out file before RL and after each arm, overall and per kind, mean+-std over
    seeds; each GRAFT arm's difference to GRPO paired by seed."""
    stem = os.path.splitext(os.path.basename(pc.held_out))[0]
    family = {r["id"]: r.get("family", "-") for r in load_jsonl(pc.held_out)}
    kinds = ["all"] + sorted(set(family.values()))
    pairs = [a for a in arms if not a.single]

    def acc(correct: dict[str, list[float]], kind: str) -> float:
        ids = [q for q in correct if kind == "all" or family[q] == kind]
        return sum(sum(correct[q]) / len(correct[q]) for q in ids) / len(ids) if ids else float("nan")
    before = {m: load_eval(os.path.join(pc.out, "eval", f"before_{m}.json"))[stem] for m in MODELS}
    after = {(s, a.label, m): load_eval(os.path.join(run_folder(pc, s, a, m), "held_out.json"))[stem]
             for s in range(pc.seeds) for a in arms for m in MODELS}
    k = len(next(iter(before["A"].values())))
    out = [f"held-out: {len(family)} problems of {os.path.basename(pc.held_out)} (never trained on), pass@1 (%) = "
           f"mean correctness of {k} samples per problem at the training temperature; before RL and after each "
           f"arm's {pc.steps} steps; mean+-std over seeds"]
    head = f"{'model':<7}{'kind':<10}{'before':>9}{'GRPO':>12}"
    for a in pairs:
        head += f"{a.label.upper():>12}{a.label.upper() + '-GRPO':>16}"
    out.append(head)
    csv = []
    for m in MODELS:
        for kind in kinds:
            b = acc(before[m], kind)
            csv.append(f"-1,before,{m},held_out_{kind},{pc.steps},{b:.6f}")
            per = {}
            for a in arms:
                per[a.label] = [acc(after[(s, a.label, m)], kind) for s in range(pc.seeds)]
                csv += [f"{s},{a.label},{m},held_out_{kind},{pc.steps},{v:.6f}" for s, v in enumerate(per[a.label])]
            line = f"{m:<7}{kind:<10}{cell([b]):>9}{cell(per['grpo']):>12}"
            for a in pairs:
                line += f"{cell(per[a.label]):>12}{cell([x - y for x, y in zip(per[a.label], per['grpo'])], True):>16}"
            out.append(line)
    return out, csv


def own_half_curves(pc: PanelConfig) -> dict[str, dict[str, list[list[float]]]]:
    """The "own" rows step by step: {model: {arm label in upper case: per seed, per step, the train reward (%)
    on the model's own all-fail half (mean over the half's prompts and their n rollouts)}}, from the rollout
    files, as panel_report reads them (README's figure)."""
    with open(os.path.join(pc.out, "set.json")) as f:
        halves = json.load(f)["halves"]
    return {m: {arm.label.upper(): [[100 * sum(r[q] for q in halves[m]) / len(halves[m])
                                     for r in step_rewards(exchange_folder(pc, s, arm, m), m.lower(), pc.steps)]
                                    for s in range(pc.seeds)] for arm in arms_of(pc.deltas)}
            for m in MODELS if halves[m]}


# ------------------------------------------------------------------------------------------------
# Running it
# ------------------------------------------------------------------------------------------------


def training_settings(flags: list[str]) -> dict:
    """The training flags, checked by graft.py's own parser: {"flags": the flags as given, and the settings the
    panel reads: n, temperature, top_p, delta, balance, lr}. A flag the panel sets itself is refused."""
    own = [f for f in flags if f.split("=")[0] in OWN_FLAGS]
    if own:
        raise SystemExit(f"panel: {', '.join(own)} is set by the panel for each process (see `panel -h`)")
    try:
        args = graft_parser().parse_args(["train", "--model", "-", "--prompts", "-"] + flags)
    except SystemExit:
        raise SystemExit(f"panel: the training flags {shlex.join(flags)!r} are not graft.py train's (above)") from None
    return {"flags": list(flags), **{k: getattr(args, k) for k in ("n", "temperature", "top_p", "delta", "balance",
                                                                     "lr", "compat_weight", "acceptance")}}


def settings_record(pc: PanelConfig, train: dict) -> dict:
    """What the panel's cached files depend on; a folder made with other values is refused. --pool is left out
    (it bounds how far the pick goes: raising it continues from the chunks evaluated), and so are --seeds,
    --deltas, --held-out and the report's --windows (adding seeds, arms or evaluations keeps what is done)."""
    keep = ("model_a", "model_b", "prompts", "half", "peer", "chunk", "pick_seed", "steps", "flags_a", "flags_b",
            "eval_flags")
    return {k: getattr(pc, k) for k in keep} | {"train_flags": train["flags"]}


def check_settings(pc: PanelConfig, train: dict) -> None:
    path = os.path.join(pc.out, "settings.json")
    now = settings_record(pc, train)
    if os.path.exists(path):
        with open(path) as f:
            old = json.load(f)
        if old != now:
            diff = {k: (old.get(k), now.get(k)) for k in sorted(set(old) | set(now)) if old.get(k) != now.get(k)}
            raise SystemExit(f"panel: {pc.out} holds a panel made with other settings ({diff}: then, now); "
                             f"delete it or choose another --out")
    else:
        write_lines(path, [json.dumps(now)])


def validate(pc: PanelConfig, train: dict) -> None:
    """Bad input stops with the flag's name, before anything runs."""
    for flag, path in (("--model-a", pc.model_a), ("--model-b", pc.model_b), ("--prompts", pc.prompts)):
        if not path:
            raise SystemExit(f"panel: {flag} is required")
    for flag, path in (("--prompts", pc.prompts), ("--held-out", pc.held_out)):
        if path and not os.path.isfile(path):
            raise SystemExit(f"panel {flag}: no file {path}")
    if not (1 <= pc.half and 1 <= pc.chunk and 2 * pc.half <= pc.pool):
        raise SystemExit(f"panel: --half {pc.half}, --chunk {pc.chunk} and --pool {pc.pool} must be >= 1 with the "
                         f"pool at least twice the half")
    for flag, v in (("--steps", pc.steps), ("--seeds", pc.seeds), ("--windows", pc.windows),
                    ("--eval-samples", pc.eval_samples), ("--slots", pc.slots)):
        if v < 1:
            raise SystemExit(f"panel {flag}: must be >= 1, got {v}")
    if pc.slots < 2:
        raise SystemExit("panel --slots: a GRAFT pair is two processes that meet; at least 2")
    parse_peer_window(pc.peer, train["n"])
    arms_of(pc.deltas)
    if pc.held_out:
        ids = {r["id"] for r in load_jsonl(pc.held_out)}
        trained = {r["problem"] for r in load_jsonl(pc.prompts)}
        both = [r["id"] for r in load_jsonl(pc.held_out) if r["problem"] in trained]
        if both:
            raise SystemExit(f"panel --held-out: {len(both)} of its {len(ids)} problems are in --prompts too "
                             f"(e.g. {both[0]}); the held-out set must never be trained on")


def prepare(pc: PanelConfig, train: dict, timing: dict, timing_file: str, *, tag: str = "panel") -> list[Job]:
    """Check the settings (against the folder's, when it holds a panel), run the pick, and return the panel's
    training and evaluation jobs (tiny.py runs them in one queue with its own)."""
    validate(pc, train)
    os.makedirs(pc.out, exist_ok=True)
    check_settings(pc, train)
    return with_prefix("panel", panel_jobs(pc, train, run_pick(pc, train, timing, timing_file, tag=tag)))


def run_panel(pc: PanelConfig, train: dict, *, tag: str = "panel", command: str = "") -> str:
    """The pick, every run and evaluation (cached: a killed panel resumes), then the report: printed and written
    to panel.txt, panel.csv and run.json (the command, the settings, the machine's load and the wall time)."""
    t0, load_start = time.time(), os.getloadavg()
    os.makedirs(pc.out, exist_ok=True)
    timing_file = os.path.join(pc.out, "timing.json")  # wall seconds per job, kept across resumed invocations
    timing: dict[str, float] = json.load(open(timing_file)) if os.path.exists(timing_file) else {}
    info = {"command": command, "panel": dataclasses.asdict(pc), "train_flags": train["flags"], "finished": None}
    jobs = prepare(pc, train, timing, timing_file, tag=tag)
    write_lines(os.path.join(pc.out, "run.json"), [json.dumps(info, indent=1)])  # `panel report` reads it meanwhile
    cached = run_jobs(jobs, pc.slots, timing, timing_file, tag=tag)
    text, csv = panel_report(pc, train)
    write_lines(os.path.join(pc.out, "panel.csv"), csv)
    write_lines(os.path.join(pc.out, "panel.txt"), [text])
    info |= {"wall_s": time.time() - t0, "cached_jobs": len(cached), "timing": timing, "cpus": os.cpu_count(),
             "load_start": list(load_start), "load_end": list(os.getloadavg()), "torch": torch.__version__,
             "finished": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    write_lines(os.path.join(pc.out, "run.json"), [json.dumps(info, indent=1)])
    return text


def build_parser() -> argparse.ArgumentParser:
    """PanelConfig's fields as flags (their docstrings are the help); the rest of the command line is the
    training flags (graft.py train's), given to every process."""
    docs = field_docs(PanelConfig)
    # allow_abbrev=False: a training flag must never be read as an abbreviation of a panel flag (--delta is
    # a prefix of --deltas, --seed of --seeds)
    p = argparse.ArgumentParser(prog="graft.py panel", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                                allow_abbrev=False,
                                description="The mechanism panel for any pair (panel.py); other flags are "
                                "graft.py train's and go to every run.")
    for f in dataclasses.fields(PanelConfig):
        flag = f"--{f.name.replace('_', '-')}"
        p.add_argument(flag, type=type(f.default), default=f.default, help=docs.get(f.name, "").replace("%", "%%"))
    return p


def main(argv: list[str]) -> int:
    """`graft.py panel [panel flags] [training flags]`, or `graft.py panel report OUT` to print a panel again
    (a running one: the steps done). graft.py imports this file for its `panel` command, so this file never
    imports graft.py: it runs graft.py's processes and reads their files."""
    if argv[:1] == ["report"]:
        if len(argv) != 2:
            raise SystemExit("usage: graft.py panel report OUT (the --out of a panel, finished or running)")
        path = os.path.join(argv[1], "run.json")
        if not os.path.exists(path):
            raise SystemExit(f"panel report: {path} not found; is {argv[1]} the --out of a panel past its pick?")
        with open(path) as f:
            info = json.load(f)
        pc = PanelConfig(**info["panel"])
        pc.out = argv[1]
        done = pc.steps if info["finished"] else steps_done(pc)
        if done == 0:
            raise SystemExit(f"panel report: {argv[1]}: no run has finished a step yet")
        print(panel_report(pc, training_settings(info["train_flags"]), steps=done)[0])
        return 0
    args, rest = build_parser().parse_known_args(argv)
    pc = PanelConfig(**vars(args))
    train = training_settings(rest)
    print(run_panel(pc, train, command="python graft.py panel " + shlex.join(argv)))
    return 0

