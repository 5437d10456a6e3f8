"""GRAFT before and beside the online pair: how complementary models are, and foreign trajectories as a peer.

Two tools in one file that imports only torch and the standard library at the top (exchange.py,
verify.py, sampler.py, runtime.py for data/prepare.py's reader and the peer model's loading, and
safetensors inside the functions that need them; it never imports graft.py), so graft.py can import it
without a cycle. `open_peer_log` is what the trainer calls at start for --peer-log.

1. Complementarity: `python graft.py complement SRC1 SRC2 [SRC3 ...] [--n 8] [--batch-size 128]`
   (or `python offline.py complement ...`). A source is a folder of this project's rollout files
   (`<run>/exchange/<side>/step_*.safetensors`, e.g. from a GRPO run) or a `graft.py eval` result JSON.
   Prompts are matched by id across sources. For every ordered pair (source -> receiver) it prints the
   paper's statistics (the share of the receiver's all-fail prompts on which the source is mixed, and
   on which the source solves at least once), the expected number of candidate prompts per step in
   each direction at the given batch size (Eq. 4's |C|), and the balanced-swap m that implies
   (README "Choosing a pair"). Run it on short GRPO runs or evaluations of the candidate models before
   spending GPU-days on a pair. `--json FILE` writes the same report (complement_json), which is also
   the "complement" entry of `graft.py preflight`'s report (preflight.py samples the counts itself).
2. Foreign trajectories for the stored-trajectory variant: `--peer-log FILE.jsonl` reads any
   collection of solutions, one JSON object per line:
       {"problem_id" or "id": str|int, and/or "problem": str,    which prompt of --prompts
        "response": str,                                        the solution text (alias "completion")
        "lbar": float in [-88, 0],                              optional: the source model's mean token
                                                                log-probability of the response (Eq. 6;
                                                                alias "mean_logprob", as in rollout files)
        "num_tokens": int >= 1,                                 optional: its length in source tokens
                                                                (only --compat-norm byte needs it)
        "reward": number|bool,                                  optional: the source's own verdict
        "eos": bool}                                            optional, default true: ended with EOS
   Records are matched to the run's prompts, de-duplicated and length-checked (choice 7), grouped per
   prompt, re-verified and given GRPO advantages
   within their group; `ForeignLog.step(prompt_ids)` then hands the trainer the peer data of one batch
   in the shape of exchange.StepRollouts plus a mask. Where "lbar" is missing, `fill_lbar` computes it
   with a given model (`--peer-model PATH`) and caches it beside the file.

Our choices, where the paper is silent (numbered so that reviews can cite them):
  1. Sample counts other than n. A source may hold N != n samples of a prompt (an evaluation at 16
     samples, or a prompt met at several steps). With k of the N correct, the probabilities that n fresh
     rollouts all fail / all pass are estimated by C(N-k, n) / C(N, n) and C(k, n) / C(N, n): the
     unbiased estimators of (1-p)^n and p^n from N Bernoulli draws (choose n of the N samples at random
     without replacement). With N = n they are exactly the 0/1 indicators of the paper's counting, so the
     table is the paper's statistic whenever the sources have n samples. N < n is an error (the estimate
     would be an extrapolation).
  2. A prompt met at several steps of a rollout folder (a run longer than one epoch): by default the
     union of all its rollouts (N = 8 x occurrences, through choice 1), which uses every sample; with
     `--aggregate latest` only its last step's group counts (the policy at its most trained).
  3. Expected candidates per step = (expected share of prompts that are candidates) x batch size, since
     every prompt is equally likely to be in a batch. The balanced m printed is the smaller of the two
     directions' expected counts; the mean per-step min is at most that (min is concave), so it is an
     upper estimate of how many groups a balanced step exchanges.
  4. Foreign groups: all records of one prompt form one group, in file order, whatever their count
     (>= 2). A prompt with a single record is dropped and counted: a group of one has advantage 0
     (group_advantages defines it so) and can never be mixed, so it could never be a candidate.
     Rewards are re-verified with verify.py against the prompt's gold answer (the record's own
     "reward" only feeds a disagreement count); advantages are the GRPO formula within each group.
  5. Matching: by id first ("problem_id", else "id"; an integer id is read as its decimal string). A
     record whose id is not a prompt id, or that has no id, is matched by problem text after
     normalisation: Unicode NFKC, every whitespace run collapsed to one space, ends stripped; case is
     kept (in mathematics x and X are different variables). A record with an id AND a problem text is
     matched by id only if the two agree; otherwise it falls back to its text and is counted as an id
     conflict. Text shared by two prompts of the run is ambiguous and left unmatched.
  6. lbar computed by a peer model (`fill_lbar`): the response is encoded by the peer's tokenizer
     without special tokens, plus its EOS when the record says it ended with one (as retokenisation
     does for the receiver), after the prompt as the caller encodes it for that model (the run's
     template), and scored at temperature 1. The cache is keyed on the file's SHA-256, the model path
     and the caller's prompt settings, so editing the file or changing the model recomputes it. Text
     that does not re-encode to the tokens the source sampled (a non-canonical BPE split) is scored in
     its canonical encoding: on the tiny preset's model B, 506 of 512 step-0 responses re-encode
     exactly and their computed lbar matches the stored one to 3e-7; the other 6 differ.
  7. Stored records that cannot be right are stopped or left out before anything is computed: an lbar
     must lie in [LBAR_MIN, 0] with LBAR_MIN = -88 (float32's largest value is e^88.72: the gate
     computes s = exp(lbar_recv - lbar) in float32, which a lower lbar can overflow to inf, accepting
     the response at w = 1; no model samples text at a mean probability of e^-88 per token), else
     FILE:LINE is an error. A record that repeats an earlier one (same matched prompt, same response
     text) is removed and counted: repeats would weight one response several times and change the
     group's advantages. A response longer than max_response_chars (the trainer passes
     response_char_bound(--max-response-tokens)) is removed and counted before verification or any
     --peer-model forward: the trainer would drop it for length anyway, and one 10 MB response would
     otherwise ask for a forward over millions of tokens.
  8. Stop strings (`--stop`, graft.py departure 11): a response that holds one is cut as the trainer
     cuts its own rollouts (core.decode_response): its text runs through the first stop string, its eos
     becomes false (a receiver retokenises it, stop string included, without EOS), and the verifier reads
     it cut before the string. A given lbar or num_tokens then described text that is gone, so it is
     dropped (NaN / -1) and --peer-model recomputes it; the cut records are counted ("stop_cut").

Launch lines:
    python graft.py complement runs/grpo_a/exchange/a runs/grpo_b/exchange/b --n 8 --batch-size 128
    python graft.py complement runs/qwen/eval_results.json runs/smollm/eval_results.json --n 8
    python offline.py bench-foreign --prompts ../shared/benchmarks/train_math7500.jsonl --records 10000
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import os
import time
import unicodedata
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

# ------------------------------------------------------------------------------------------------
# Complementarity: the core (pure functions on tensors)
#
# Shape letters: Q prompts seen by both sources, n rollouts per prompt in the planned pair run.
# ------------------------------------------------------------------------------------------------


def _comb_ratio(a: torch.Tensor, total: torch.Tensor, n: int) -> torch.Tensor:
    """C(a, n) / C(total, n) elementwise, as the product over j < n of (a - j) / (total - j).

    a, total: (Q,) integer counts with 0 <= a <= total and total >= n. Returns (Q,) float64.
    A factor (a - j) reaches 0 when a < n, which is C(a, n) = 0; clamping keeps later factors at 0.
    """
    j = torch.arange(n, dtype=torch.float64)  # (n,)
    terms = (a.double()[:, None] - j).clamp(min=0) / (total.double()[:, None] - j)  # (Q, n)
    return terms.prod(dim=1)  # (Q,)


def _samples(k: torch.Tensor, samples, n: int, what: str) -> torch.Tensor:
    """Per-prompt sample counts N as a (Q,) int64 tensor (an int is broadcast), checked against k and n."""
    total = torch.as_tensor(n if samples is None else samples, dtype=torch.int64).expand(k.shape)  # (Q,)
    assert bool((k >= 0).all()) and bool((k <= total).all()), f"{what}: success counts must lie in [0, N]"
    if bool((total < n).any()):
        raise ValueError(f"{what}: some prompts have only {int(total.min())} samples, fewer than n={n}; "
                         f"statistics at n would be an extrapolation (lower --n or sample more)")
    return total


def prob_all_fail(k: torch.Tensor, samples: torch.Tensor | int | None = None, *, n: int) -> torch.Tensor:
    """Estimated P(n fresh rollouts all fail) per prompt: C(N - k, n) / C(N, n) (choice 1).

    k: (Q,) success counts out of samples N ((Q,) or an int; None means N = n). Returns (Q,) float64;
    with N = n it is exactly 1[k = 0].
    """
    total = _samples(k, samples, n, "prob_all_fail")
    return _comb_ratio(total - k, total, n)


def prob_all_pass(k: torch.Tensor, samples: torch.Tensor | int | None = None, *, n: int) -> torch.Tensor:
    """Estimated P(n fresh rollouts all pass) per prompt: C(k, n) / C(N, n). Shapes as prob_all_fail."""
    total = _samples(k, samples, n, "prob_all_pass")
    return _comb_ratio(k, total, n)


def complementarity(*, k_recv: torch.Tensor, k_src: torch.Tensor, n: int, batch_size: int,
                    samples_recv: torch.Tensor | int | None = None,
                    samples_src: torch.Tensor | int | None = None) -> dict[str, float]:
    """The paper's complementarity statistics for the direction source -> receiver, and its candidates.

    k_recv, k_src: (Q,) success counts of the two models on the same Q prompts, out of samples_recv /
    samples_src ((Q,) or int; None means n). Returns floats:
      prompts             Q
      recv_all_fail       expected number of prompts on which the receiver fails all n
      mixed_share         share of those on which the source is mixed (1 <= k < n): the candidates
      solved_share        share of those on which the source solves at least once (k >= 1)
      candidate_frac      expected share of all prompts that are candidates (Eq. 4)
      candidates_per_step candidate_frac x batch_size (choice 3)
    The shares are NaN when the receiver fails no prompt. The two models' samples are independent, so
    per prompt P(candidate) = P(receiver fails all) x P(source mixed).
    """
    assert k_recv.dim() == 1 and k_recv.shape == k_src.shape, "k_recv and k_src must be (Q,) and equal"
    assert n >= 2 and batch_size >= 1, f"need n >= 2 and batch_size >= 1, got n={n}, batch_size={batch_size}"
    fail_r = prob_all_fail(k_recv, samples_recv, n=n)  # (Q,)
    fail_s = prob_all_fail(k_src, samples_src, n=n)  # (Q,)
    mixed_s = 1.0 - fail_s - prob_all_pass(k_src, samples_src, n=n)  # (Q,)
    cand = fail_r * mixed_s  # (Q,) P(q is a candidate for src -> recv)
    q, f = k_recv.numel(), float(fail_r.sum())
    frac = float(cand.sum()) / q if q else float("nan")
    return {"prompts": float(q), "recv_all_fail": f,
            "mixed_share": float(cand.sum()) / f if f > 0 else float("nan"),
            "solved_share": float((fail_r * (1.0 - fail_s)).sum()) / f if f > 0 else float("nan"),
            "candidate_frac": frac, "candidates_per_step": frac * batch_size}


def pair_complementarity(*, k_a: torch.Tensor, k_b: torch.Tensor, n: int, batch_size: int,
                         samples_a: torch.Tensor | int | None = None,
                         samples_b: torch.Tensor | int | None = None) -> dict:
    """Both directions of a pair and the balanced-swap m: {"a_to_b": ..., "b_to_a": ..., "m": float}.

    k_a, k_b: (Q,) success counts on the same prompts. "a_to_b" is complementarity with B receiving A's
    groups; m = min of the two expected candidate counts per step (choice 3).
    """
    a_to_b = complementarity(k_recv=k_b, k_src=k_a, n=n, batch_size=batch_size, samples_recv=samples_b,
                             samples_src=samples_a)
    b_to_a = complementarity(k_recv=k_a, k_src=k_b, n=n, batch_size=batch_size, samples_recv=samples_a,
                             samples_src=samples_b)
    return {"a_to_b": a_to_b, "b_to_a": b_to_a,
            "m": min(a_to_b["candidates_per_step"], b_to_a["candidates_per_step"])}


# ------------------------------------------------------------------------------------------------
# Complementarity: reading sources (rollout folders and eval result files)
# ------------------------------------------------------------------------------------------------


@dataclass
class SourceCounts:
    """Per-prompt success counts of one source: counts[id] = (k correct, N samples)."""

    path: str
    kind: str  # "rollouts" | "eval"
    counts: dict[str, tuple[int, int]]
    note: str = ""  # one line for the legend: steps, samples, data seed, model


def read_step_rewards(path: str | os.PathLike) -> tuple[list[str], torch.Tensor, dict]:
    """The prompt ids (G,), rewards (G, n) float32 and metadata of one rollout file, nothing else.

    exchange.load_rollouts decodes every token and text of the file, which for a paper-sized run
    (128 x 8 responses of up to 4096 tokens per step) costs far more than the table; this reads the
    three tensors the statistics need, with the same format checks on them. Errors name the file.
    """
    from exchange import ROLLOUT_FORMAT, ROLLOUT_VERSION
    from safetensors import safe_open
    path = Path(path)
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            keys = set(f.keys())
            missing = [k for k in ("rewards", "prompt_ids", "prompt_id_offsets") if k not in keys]
            if missing:
                raise ValueError(f"missing tensors {missing}")
            rewards, data, offsets = (f.get_tensor(k) for k in ("rewards", "prompt_ids", "prompt_id_offsets"))
    except Exception as e:  # corrupt, truncated, not safetensors, or incomplete
        raise ValueError(f"{path}: not a readable rollout file ({type(e).__name__}: {e})") from e
    if meta.get("format") != ROLLOUT_FORMAT or meta.get("version") != ROLLOUT_VERSION:
        raise ValueError(f"{path}: not a GRAFT rollout file of version {ROLLOUT_VERSION} "
                         f"(format={meta.get('format')!r}, version={meta.get('version')!r})")
    G = rewards.shape[0] if rewards.dim() == 2 else -1
    o = offsets.tolist()
    if G < 0 or len(o) != G + 1 or o[0] != 0 or o[-1] > data.numel() or any(b < a for a, b in zip(o, o[1:])):
        raise ValueError(f"{path}: inconsistent rewards / prompt-id shapes")
    raw = data.numpy().tobytes()
    try:
        ids = [raw[o[i]: o[i + 1]].decode("utf-8") for i in range(G)]
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: bad prompt-id bytes ({e})") from e
    return ids, rewards.float(), meta


def read_rollout_folder(path: str | os.PathLike, *, aggregate: str = "union") -> SourceCounts:
    """Success counts from a folder of rollout files (exchange.py format), one entry per prompt id.

    aggregate: "union" pools every occurrence of a prompt (k and N summed over steps), "latest" keeps
    the group of its last step (choice 2). A reward > 0.5 counts as a success (rewards are 0/1).
    """
    assert aggregate in ("union", "latest"), f"aggregate must be union or latest, got {aggregate!r}"
    folder = Path(path)
    files = sorted(folder.glob("step_*.safetensors"))
    if not files:
        sub = sorted({str(p.parent) for p in folder.rglob("step_*.safetensors")}) if folder.is_dir() else []
        hint = f"; folders below it that have some: {', '.join(sub[:6])}" if sub else ""
        raise ValueError(f"{folder}: no step_*.safetensors rollout files{hint}")
    counts: dict[str, tuple[int, int]] = {}
    metas = []
    for f in files:
        ids, rewards, meta = read_step_rewards(f)
        metas.append(meta)
        k, n = (rewards > 0.5).sum(dim=1).tolist(), rewards.shape[1]  # (G,) successes per prompt of this step
        for pid, kk in zip(ids, k):
            if aggregate == "union" and pid in counts:
                k0, n0 = counts[pid]
                counts[pid] = (k0 + kk, n0 + n)
            else:  # files are in step order, so the last write is the latest occurrence
                counts[pid] = (kk, n)
    seeds = sorted({m.get("data_seed", "?") for m in metas})
    note = (f"{len(files)} steps, n={metas[-1].get('n')}, data seed {','.join(seeds)}, "
            f"model {metas[-1].get('model', '?')}, aggregate {aggregate}")
    return SourceCounts(str(folder), "rollouts", counts, note)


def read_eval_results(path: str | os.PathLike) -> SourceCounts:
    """Success counts from a `graft.py eval` result JSON: {"problems": {benchmark: [{"id", "correct": [0/1, ...]}]}}.

    Every benchmark of the file is read; an id found in two benchmarks is an error (ids must name one
    prompt). A score > 0.5 counts as a success.
    """
    path = Path(path)
    try:
        payload = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not a readable JSON file ({e})") from e
    problems = payload.get("problems") if isinstance(payload, dict) else None
    if not isinstance(problems, dict) or not problems:
        raise ValueError(f"{path}: no 'problems' object of per-problem results (is it a graft.py eval output?)")
    counts: dict[str, tuple[int, int]] = {}
    where: dict[str, str] = {}
    for bench, rows in problems.items():
        if not isinstance(rows, list):
            raise ValueError(f"{path}: problems[{bench!r}] must be a list of per-problem results")
        for i, row in enumerate(rows):
            ok = (isinstance(row, dict) and isinstance(row.get("id"), str) and isinstance(row.get("correct"), list)
                  and row["correct"]
                  and all(isinstance(c, (int, float)) and not isinstance(c, bool) for c in row["correct"]))
            if not ok:
                raise ValueError(f"{path}: problems[{bench!r}][{i}] needs a string 'id' and a non-empty list 'correct' "
                                 f"of numbers, got {str(row)[:200]}")
            if row["id"] in counts:
                raise ValueError(f"{path}: id {row['id']!r} appears in both {where[row['id']]!r} and {bench!r}")
            counts[row["id"]] = (sum(1 for c in row["correct"] if c > 0.5), len(row["correct"]))
            where[row["id"]] = bench
    samples = sorted({nn for _, nn in counts.values()})
    note = f"eval of {payload.get('model', '?')}: {', '.join(problems)}; samples {','.join(map(str, samples))}"
    return SourceCounts(str(path), "eval", counts, note)


def read_source(path: str | os.PathLike, *, aggregate: str = "union") -> SourceCounts:
    """A folder is read as rollout files, a file as an eval result JSON."""
    p = Path(path)
    if p.is_dir():
        return read_rollout_folder(p, aggregate=aggregate)
    if p.is_file():
        return read_eval_results(p)
    raise ValueError(f"{p}: no such folder of rollout files or eval result file")


def align(a: SourceCounts, b: SourceCounts) -> tuple[list[str], torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The prompts both sources saw (sorted ids) and their counts: ids, k_a, N_a, k_b, N_b, each (Q,) int64."""
    ids = sorted(set(a.counts) & set(b.counts))
    t = lambda src, j: torch.tensor([src.counts[i][j] for i in ids], dtype=torch.int64)  # noqa: E731  (Q,)
    return ids, t(a, 0), t(a, 1), t(b, 0), t(b, 1)


# ------------------------------------------------------------------------------------------------
# Complementarity: the table for every ordered pair, and the command line
# ------------------------------------------------------------------------------------------------


def complement_rows(sources: list[SourceCounts], *, n: int, batch_size: int) -> list[dict]:
    """One row per ordered pair (source i -> receiver j, i != j), on the prompts both saw.

    Each row: src, recv (indices into sources), the complementarity dict of src -> recv, "reverse"
    (expected candidates per step recv -> src) and "m"; a pair with no common prompt has prompts = 0.
    """
    rows = []
    for i, s in enumerate(sources):
        for j, r in enumerate(sources):
            if i == j:
                continue
            ids, k_s, n_s, k_r, n_r = align(s, r)
            if not ids:
                rows.append({"src": i, "recv": j, "prompts": 0})
                continue
            try:
                pair = pair_complementarity(k_a=k_s, k_b=k_r, n=n, batch_size=batch_size, samples_a=n_s, samples_b=n_r)
            except ValueError as e:
                raise ValueError(f"{s.path} vs {r.path}: {e}") from e
            rows.append({"src": i, "recv": j, **pair["a_to_b"], "reverse": pair["b_to_a"]["candidates_per_step"],
                         "m": pair["m"]})
    return rows


def format_complement_table(sources: list[SourceCounts], rows: list[dict], *, n: int, batch_size: int) -> str:
    """The printed table: a legend of the sources, then one line per ordered pair."""
    pct = lambda x: "-" if math.isnan(x) else f"{100 * x:.1f}%"  # noqa: E731
    out = [f"complementarity at n={n} rollouts per prompt, {batch_size} prompts per step "
           f"(Eq. 4; README 'Choosing a pair')"]
    for i, s in enumerate(sources):
        out.append(f"  S{i + 1} = {s.path}  [{s.kind}: {len(s.counts)} prompts; {s.note}]")
    head = (f"{'source -> receiver':<20} {'prompts':>8} {'recv all-fail':>15} {'src mixed':>10} {'src solves':>11} "
            f"{'cand/step':>10} {'reverse':>8} {'m':>6}")
    out += [head, "-" * len(head)]
    for r in rows:
        name = f"S{r['src'] + 1} -> S{r['recv'] + 1}"
        if r["prompts"] == 0:
            out.append(f"{name:<20} {0:>8}   no prompt in common")
            continue
        fail = f"{r['recv_all_fail']:.0f} ({pct(r['recv_all_fail'] / r['prompts'])})"
        out.append(f"{name:<20} {r['prompts']:>8.0f} {fail:>15} {pct(r['mixed_share']):>10} "
                   f"{pct(r['solved_share']):>11} {r['candidates_per_step']:>10.2f} {r['reverse']:>8.2f} "
                   f"{r['m']:>6.2f}")
    out.append("recv all-fail: prompts the receiver fails on all n; src mixed / src solves: share of those on which\n"
               "the source has 1 <= k < n / k >= 1 successes; cand/step: expected candidates source -> receiver per\n"
               "step; reverse: receiver -> source; m: balanced swap, the smaller of the two")
    return "\n".join(out)


def complement_json(sources: list[SourceCounts], rows: list[dict], *, n: int, batch_size: int) -> dict:
    """The same report as format_complement_table, as JSON: the settings, the sources and the rows (NaN -> None)."""
    clean = lambda v: None if isinstance(v, float) and math.isnan(v) else v  # noqa: E731  (JSON has no NaN)
    return {"n": n, "batch_size": batch_size,
            "sources": [{"path": s.path, "kind": s.kind, "prompts": len(s.counts), "note": s.note} for s in sources],
            "rows": [{k: clean(v) for k, v in r.items()} for r in rows]}


def build_complement_parser(prog: str = "graft.py complement") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="Complementarity of two or more models from GRPO rollout "
                                "folders or graft.py eval results on the same prompts: for every ordered pair, the "
                                "share of the receiver's all-fail prompts the source can help on, and the expected "
                                "exchange per step.")
    p.add_argument("sources", nargs="+", help="rollout folders (<run>/exchange/<side>) or eval result JSON files")
    p.add_argument("--n", "--rollouts", dest="n", type=int, default=8,
                   help="rollouts per prompt of the planned pair run")
    p.add_argument("--batch-size", type=int, default=128, help="prompts per step of the planned pair run")
    p.add_argument("--aggregate", choices=("union", "latest"), default="union",
                   help="a prompt met at several steps: pool all its rollouts, or keep its last step's group")
    p.add_argument("--json", default="", help="also write the table as JSON to this file (as graft.py preflight's "
                   "'complement' entry)")
    return p


def main_complement(argv: list[str] | None = None, *, prog: str = "graft.py complement") -> int:
    """`graft.py complement` / `offline.py complement`: read the sources, print the table. Returns 0."""
    args = build_complement_parser(prog).parse_args(argv)
    if len(args.sources) < 2:
        raise SystemExit(f"{prog}: needs at least two sources, got {len(args.sources)}")
    if args.n < 2 or args.batch_size < 1:
        raise SystemExit(f"{prog}: --n must be >= 2 and --batch-size >= 1 (got {args.n}, {args.batch_size})")
    t0 = time.time()
    try:
        sources = [read_source(s, aggregate=args.aggregate) for s in args.sources]
        rows = complement_rows(sources, n=args.n, batch_size=args.batch_size)
    except ValueError as e:
        raise SystemExit(f"{prog}: {e}")
    print(format_complement_table(sources, rows, n=args.n, batch_size=args.batch_size))
    if args.json:
        from exchange import write_json
        write_json(Path(args.json), complement_json(sources, rows, n=args.n, batch_size=args.batch_size))
    print(f"[complement] {time.time() - t0:.1f}s")
    return 0


# ------------------------------------------------------------------------------------------------
# Foreign trajectories: reading and matching records
# ------------------------------------------------------------------------------------------------

ID_FIELDS = ("problem_id", "id")
PROBLEM_FIELDS = ("problem", "question")
RESPONSE_FIELDS = ("response", "completion")
LBAR_FIELDS = ("lbar", "mean_logprob")
LBAR_MIN = -88.0  # choice 7: exp(-LBAR_MIN) is finite in float32 (whose largest value is e^88.72)
MAX_TOKEN_CHARS = 128  # the longest token of the Qwen3, SmolLM3 and Llama-3.2 vocabularies: 128 spaces


def response_char_bound(max_response_tokens: int, *, max_token_chars: int = MAX_TOKEN_CHARS) -> int:
    """Characters above which a response cannot fit in max_response_tokens tokens of a tokenizer whose
    longest token has max_token_chars characters (choice 7: a bound checked before tokenising)."""
    return max_response_tokens * max_token_chars


def normalise_problem(text: str) -> str:
    """Problem text as matched (choice 5): NFKC, whitespace runs -> one space, ends stripped, case kept."""
    return " ".join(unicodedata.normalize("NFKC", text).split())


@dataclass
class ForeignRecord:
    """One validated line of a foreign JSONL file."""

    line: int  # 1-based line number in the file
    prompt_id: str | None
    problem: str | None
    response: str
    lbar: float  # NaN when the record has none
    num_tokens: int  # -1 when the record has none
    eos: bool
    reward: float  # NaN when the record has none


def _first_field(obj: dict, names: tuple[str, ...]):
    return next((obj[k] for k in names if k in obj and obj[k] is not None), None)


def _jsonl_objects(path: Path):
    """data/prepare.py's jsonl_objects: (line number, object) for each non-blank line."""
    from runtime import prepare_module
    return prepare_module().jsonl_objects(path)


def read_foreign_records(path: str | os.PathLike) -> list[ForeignRecord]:
    """Parse and validate every line of a foreign JSONL file (format in the module docstring).

    Blank lines are skipped. Any bad line raises ValueError("FILE:LINE: what is wrong").
    """
    path = Path(path)
    out: list[ForeignRecord] = []
    # One JSONL reader for the whole project (data/prepare.py's): errors name file:line, non-UTF-8 too.
    for lineno, obj in _jsonl_objects(path):
        where = f"{path}:{lineno}"
        pid = _first_field(obj, ID_FIELDS)
        if isinstance(pid, int) and not isinstance(pid, bool):
            pid = str(pid)
        if pid is not None and (not isinstance(pid, str) or not pid):
            raise ValueError(f"{where}: field {ID_FIELDS} must be a non-empty string or an integer, got {pid!r}")
        problem = _first_field(obj, PROBLEM_FIELDS)
        if problem is not None and (not isinstance(problem, str) or not problem.strip()):
            raise ValueError(f"{where}: field {PROBLEM_FIELDS} must be a non-empty string, got {problem!r}")
        if pid is None and problem is None:
            raise ValueError(f"{where}: needs a problem id ({' or '.join(ID_FIELDS)}) or the problem text "
                             f"({' or '.join(PROBLEM_FIELDS)})")
        response = _first_field(obj, RESPONSE_FIELDS)
        if not isinstance(response, str):
            raise ValueError(f"{where}: field {' or '.join(RESPONSE_FIELDS)} must be a string, got {response!r}")
        lbar = _first_field(obj, LBAR_FIELDS)
        if lbar is not None and (isinstance(lbar, bool) or not isinstance(lbar, (int, float))
                                 or not LBAR_MIN <= lbar <= 0):  # NaN fails the comparison too
            raise ValueError(f"{where}: field {' or '.join(LBAR_FIELDS)} must be a finite number in "
                             f"[{LBAR_MIN:g}, 0] (a mean log-probability per token; lower overflows the "
                             f"float32 score s = exp(lbar_recv - lbar)), got {lbar!r}")
        num_tokens = obj.get("num_tokens")
        if num_tokens is not None and (isinstance(num_tokens, bool) or not isinstance(num_tokens, int)
                                       or num_tokens < 1):
            raise ValueError(f"{where}: field 'num_tokens' must be an integer >= 1, got {num_tokens!r}")
        reward = obj.get("reward")
        if reward is not None and not isinstance(reward, (int, float)):
            raise ValueError(f"{where}: field 'reward' must be a number or a boolean, got {reward!r}")
        eos = obj.get("eos", True)
        if not isinstance(eos, bool):
            raise ValueError(f"{where}: field 'eos' must be true or false, got {eos!r}")
        out.append(ForeignRecord(lineno, pid, problem, response, float("nan") if lbar is None else float(lbar),
                                 -1 if num_tokens is None else num_tokens, eos,
                                 float("nan") if reward is None else float(reward)))
    return out


@dataclass
class MatchCounts:
    by_id: int = 0
    by_text: int = 0
    unmatched: int = 0
    ambiguous: int = 0  # unmatched because the text belongs to two or more prompts
    id_conflicts: int = 0  # id named a prompt whose text differs from the record's: matched by text instead
    unmatched_lines: list[int] = field(default_factory=list)  # the first few, for the report


def match_records(records: list[ForeignRecord], prompts: list[dict]) -> tuple[list[str | None], MatchCounts]:
    """The prompt id of each record (None when unmatched), by the rule of choice 5, and the counts.

    prompts: the run's prompt rows (dicts with "id" and "problem").
    """
    by_id = {p["id"]: p for p in prompts}
    by_text: dict[str, str | None] = {}
    for p in prompts:
        key = normalise_problem(p["problem"])
        by_text[key] = None if key in by_text else p["id"]  # None marks a text two prompts share
    c = MatchCounts()
    out: list[str | None] = []
    for rec in records:
        key = normalise_problem(rec.problem) if rec.problem is not None else None
        hit = None
        if rec.prompt_id is not None and rec.prompt_id in by_id:
            if key is None or normalise_problem(by_id[rec.prompt_id]["problem"]) == key:
                hit = rec.prompt_id
                c.by_id += 1
            else:
                c.id_conflicts += 1
        if hit is None and key is not None and key in by_text:
            hit = by_text[key]
            if hit is None:
                c.ambiguous += 1
            else:
                c.by_text += 1
        if hit is None:
            c.unmatched += 1
            if len(c.unmatched_lines) < 5:
                c.unmatched_lines.append(rec.line)
        out.append(hit)
    return out, c


# ------------------------------------------------------------------------------------------------
# Foreign trajectories: advantages within groups of any size
# ------------------------------------------------------------------------------------------------


def masked_group_advantages(rewards: torch.Tensor, mask: torch.Tensor, *, eps: float = 1e-6,
                            std_normalize: bool = True) -> torch.Tensor:
    """GRPO advantages a_i = (r_i - mean(r)) / (std(r) + eps) within each group of any size (choice 4).

    rewards: (P, M) float; mask: (P, M) bool, True on the first size_p slots of row p (left-aligned).
    Returns (P, M) float, 0 on masked-out slots. The same formula as graft.group_advantages (unbiased
    std; a group of equal rewards, or of one, gets exactly 0), applied to each row's first size_p
    entries: on full rows it equals group_advantages.
    """
    assert rewards.shape == mask.shape and rewards.dim() == 2, "rewards and mask must be (P, M) and equal"
    m = mask.float()  # (P, M)
    size = m.sum(dim=1, keepdim=True)  # (P, 1)
    mean = (rewards.float() * m).sum(dim=1, keepdim=True) / size.clamp(min=1)  # (P, 1)
    centered = (rewards.float() - mean) * m  # (P, M)
    if std_normalize:
        std = ((centered ** 2).sum(dim=1, keepdim=True) / (size - 1).clamp(min=1)).sqrt()  # (P, 1) unbiased
        adv = centered / (std + eps)  # (P, M)
    else:
        adv = centered
    constant = ((rewards == rewards[:, :1]) | ~mask).all(dim=1, keepdim=True)  # (P, 1): zero variance
    return torch.where(constant | ~mask, torch.zeros_like(adv), adv)


# ------------------------------------------------------------------------------------------------
# Foreign trajectories: the loaded log and its per-step view for the trainer
# ------------------------------------------------------------------------------------------------


@dataclass
class ForeignStep:
    """The foreign peer data of one batch: G prompts x M slots, row-major, like exchange.StepRollouts.

    Slot r = g * M + i is response i of prompt g; mask[g, i] says whether it exists (a prompt has
    sizes[g] = mask[g].sum() responses, 0 if the log has none for it). Padding slots hold text "",
    eos False, reward 0, advantage 0. M = ForeignLog.width, the largest group of the whole log, so it
    is the same at every step.
    """

    prompt_ids: list[str]  # (G,)
    texts: list[str]  # G*M
    eos: torch.Tensor  # (G, M) bool
    rewards: torch.Tensor  # (G, M) float32, re-verified
    advantages: torch.Tensor  # (G, M) float32, within each group
    mask: torch.Tensor  # (G, M) bool
    mean_logprob: torch.Tensor  # (G, M) float32, source lbar per source token (NaN: unknown)
    num_tokens: torch.Tensor  # (G, M) int64, source token count (-1: unknown)
    lines: torch.Tensor  # (G, M) int64, line in the file (0 on padding), for messages

    @property
    def n(self) -> int:
        """Slots per prompt (M), the stride of the flat index r = g * n + i."""
        return self.rewards.shape[1]

    @property
    def sizes(self) -> torch.Tensor:
        """(G,) int64 responses per prompt: use it as the n of graft_candidates (mixed: 1 <= k < size)."""
        return self.mask.sum(dim=1)

    def num_bytes(self) -> torch.Tensor:
        """(G, M) UTF-8 length of each response text (at least 1)."""
        return torch.tensor([max(1, len(t.encode("utf-8"))) for t in self.texts]).view_as(self.rewards)

    def lbar(self, norm: str) -> torch.Tensor:
        """(G, M) the source's mean log-prob per token ('token', Eq. 6) or per byte ('byte'); 0 on padding.

        Every existing slot must have what the norm needs (ForeignLog.require_lbar checks this up front).
        """
        assert norm in ("token", "byte"), f"norm must be token or byte, got {norm!r}"
        lb = torch.where(self.mask, self.mean_logprob, torch.zeros_like(self.mean_logprob))  # (G, M)
        assert not bool(lb.isnan().any()), "a foreign response has no lbar: call ForeignLog.require_lbar first"
        if norm == "token":
            return lb
        assert not bool((self.mask & (self.num_tokens < 1)).any()), "byte norm needs num_tokens for every response"
        return lb * self.num_tokens.clamp(min=0).float() / self.num_bytes()


class ForeignLog:
    """A foreign JSONL file matched to a run's prompts: one group per prompt, stored as a padded table.

    Built by load_foreign_log. P prompts have a group; row p holds its responses in file order in slots
    0..size_p-1 of width M = the largest group. Attributes (tensors are (P, M) unless said):
        path, prompt_ids (P,), row (prompt id -> p), texts (P lists of M strings), mask, eos, rewards,
        advantages, mean_logprob, num_tokens, lines, source_reward (NaN: none given), counts (a dict).
    """

    def __init__(self, path: Path, groups: dict[str, list[ForeignRecord]], counts: dict, *, std_normalize: bool):
        self.path = Path(path)
        self.prompt_ids = list(groups)
        self.row = {pid: p for p, pid in enumerate(self.prompt_ids)}
        P, M = len(groups), max((len(g) for g in groups.values()), default=1)
        self.width = M
        self.texts = [[rec.response for rec in g] + [""] * (M - len(g)) for g in groups.values()]
        self.mask = torch.zeros(P, M, dtype=torch.bool)
        self.eos = torch.zeros(P, M, dtype=torch.bool)
        self.mean_logprob = torch.zeros(P, M)
        self.num_tokens = torch.full((P, M), -1, dtype=torch.int64)
        self.lines = torch.zeros(P, M, dtype=torch.int64)
        self.source_reward = torch.full((P, M), float("nan"))
        for p, g in enumerate(groups.values()):
            s = len(g)
            self.mask[p, :s] = True
            self.eos[p, :s] = torch.tensor([rec.eos for rec in g])
            self.mean_logprob[p, :s] = torch.tensor([rec.lbar for rec in g])
            self.num_tokens[p, :s] = torch.tensor([rec.num_tokens for rec in g])
            self.lines[p, :s] = torch.tensor([rec.line for rec in g])
            self.source_reward[p, :s] = torch.tensor([rec.reward for rec in g])
        self.rewards = torch.zeros(P, M)
        self.advantages = torch.zeros(P, M)
        self.std_normalize = std_normalize
        self.counts = counts

    def set_rewards(self, rewards: torch.Tensor) -> None:
        """Install re-verified rewards ((P, M), 0 on padding) and recompute the advantages within groups."""
        assert rewards.shape == self.mask.shape, f"rewards must be {tuple(self.mask.shape)}"
        self.rewards = torch.where(self.mask, rewards.float(), torch.zeros_like(self.rewards))
        self.advantages = masked_group_advantages(self.rewards, self.mask, std_normalize=self.std_normalize)

    def missing_lbar(self, norm: str = "token") -> list[int]:
        """File lines of responses lacking what --compat-norm norm needs (lbar; for 'byte' also num_tokens)."""
        bad = self.mask & self.mean_logprob.isnan()
        if norm == "byte":
            bad |= self.mask & (self.num_tokens < 1)
        return sorted(self.lines[bad].tolist())

    def require_lbar(self, norm: str = "token") -> None:
        """Raise ValueError naming FILE:LINE of the first response without the lbar the gate needs."""
        lines = self.missing_lbar(norm)
        if lines:
            what = "lbar" if norm == "token" else "lbar and num_tokens (--compat-norm byte)"
            raise ValueError(f"{self.path}:{lines[0]}: no {what} on {len(lines)} used records; give it in the file "
                             f"or compute it with --peer-model PATH (the model that wrote them, or a proxy)")

    def step(self, prompt_ids: list[str]) -> ForeignStep:
        """The foreign peer data for one batch, prompts in the batch's order (absent ones: size 0)."""
        G, M = len(prompt_ids), self.width
        idx = torch.tensor([self.row.get(pid, -1) for pid in prompt_ids], dtype=torch.int64)  # (G,)
        has = idx >= 0  # (G,)
        safe = idx.clamp(min=0)  # (G,) row 0 stands in for absent prompts, then masked off

        def take(t: torch.Tensor, fill) -> torch.Tensor:
            out = t[safe]  # (G, M)
            return torch.where(has[:, None], out, torch.full_like(out, fill))

        texts = [s for g in range(G) for s in (self.texts[int(idx[g])] if has[g] else [""] * M)]
        return ForeignStep(prompt_ids=list(prompt_ids), texts=texts, eos=take(self.eos, False),
                           rewards=take(self.rewards, 0.0), advantages=take(self.advantages, 0.0),
                           mask=take(self.mask, False), mean_logprob=take(self.mean_logprob, 0.0),
                           num_tokens=take(self.num_tokens, -1), lines=take(self.lines, 0))

    def report(self) -> str:
        """Lines for the log: what was read, matched, dropped and verified."""
        c = self.counts
        sizes = self.mask.sum(dim=1)  # (P,)
        k = self.rewards.sum(dim=1)  # (P,)
        mixed = int(((k >= 1) & (k < sizes)).sum())
        first = lambda key: f" (first on lines {c[key]})" if c.get(key) else ""  # noqa: E731
        lines = [f"[foreign] {self.path}: {c['records']} records; matched {c['by_id']} by id, {c['by_text']} by "
                 f"problem text; unmatched {c['unmatched']} (ambiguous text {c['ambiguous']}, id/text conflicts "
                 f"{c['id_conflicts']})" + (f", first on lines {c['unmatched_lines']}" if c["unmatched_lines"] else ""),
                 f"[foreign] dropped {c.get('too_long', 0)} longer than {c.get('max_response_chars')} characters"
                 f"{first('too_long_lines')} and {c.get('duplicates', 0)} repeats of an earlier record (same prompt "
                 f"and response){first('duplicate_lines')}"
                 + (f"; cut {c['stop_cut']} at a stop string (choice 8)" if c.get("stop_cut") else ""),
                 f"[foreign] {len(self.prompt_ids)} prompt groups (sizes {int(sizes.min())}-{self.width}, "
                 f"mean {float(sizes.float().mean()):.1f}); dropped "
                 f"{c['singletons']} single-record prompts; {mixed} groups mixed",
                 f"[foreign] re-verified rewards: mean {float(self.rewards[self.mask].mean()):.3f}; "
                 f"{c['reward_disagreements']} differ from the file's reward; lbar given for "
                 f"{int((self.mask & ~self.mean_logprob.isnan()).sum())}/{int(self.mask.sum())} used records"]
        return "\n".join(lines)


def load_foreign_log(path: str | os.PathLike, prompts: list[dict], *, std_normalize: bool = True,
                     verify_workers: int = 0, rel_tol: float | None = None,
                     max_response_chars: int | None = None, stop: tuple[str, ...] | list[str] = ()) -> ForeignLog:
    """Read, match, group, re-verify and score a foreign JSONL file against the run's prompts.

    prompts: the run's prompt rows (dicts with "id", "problem", "answer", as data/prepare.py load_prompts
    returns). Responses over max_response_chars characters (None = no bound), repeats of an earlier
    record (same prompt, same response text), unmatched records and single-record prompts are counted
    (ForeignLog.report) and left out, in that order (choice 7), before anything is verified or scored.
    Rewards of the kept records are verify.verify_batch(response, gold) (strict: a boxed answer);
    verify_workers and rel_tol are passed to it. Responses are first cut at a stop string of `stop`
    (choice 8). Raises ValueError (FILE:LINE) on a bad record, and when nothing usable is left.
    """
    from core import first_stop, verifier_text
    from verify import verify_batch
    path = Path(path)
    records = read_foreign_records(path)
    if not records:
        raise ValueError(f"{path}: no records")
    stop_cut = 0
    for i, rec in enumerate(records):  # choice 8: as core.decode_response cuts the trainer's own rollouts
        hit = first_stop(rec.response, tuple(stop)) if stop else None
        if hit is not None:
            records[i] = dataclasses.replace(rec, response=rec.response[: hit[0] + len(hit[1])], eos=False,
                                             lbar=float("nan"), num_tokens=-1)
            stop_cut += 1
    n_read, long_lines = len(records), []
    if max_response_chars is not None:  # before matching: nothing is computed for them (choice 7)
        long_lines = [r.line for r in records if len(r.response) > max_response_chars]
        records = [r for r in records if len(r.response) <= max_response_chars]
    hits, mc = match_records(records, prompts)
    groups: dict[str, list[ForeignRecord]] = {}
    seen: set[tuple[str, str]] = set()
    repeat_lines = []
    for rec, pid in zip(records, hits):
        if pid is None:
            continue
        if (pid, rec.response) in seen:
            repeat_lines.append(rec.line)
            continue
        seen.add((pid, rec.response))
        groups.setdefault(pid, []).append(rec)
    singletons = [pid for pid, g in groups.items() if len(g) < 2]
    for pid in singletons:
        del groups[pid]
    if not groups:
        raise ValueError(f"{path}: no prompt of the run has two or more matched records ({n_read} records, "
                         f"{mc.unmatched} unmatched, {len(repeat_lines)} repeats, {len(long_lines)} too long, "
                         f"{len(singletons)} single-record prompts); check ids/problem text against --prompts")
    counts = {"records": n_read, "stop_cut": stop_cut, "too_long": len(long_lines),
              "too_long_lines": long_lines[:5], "max_response_chars": max_response_chars,
              "duplicates": len(repeat_lines), "duplicate_lines": repeat_lines[:5], "by_id": mc.by_id,
              "by_text": mc.by_text, "unmatched": mc.unmatched, "ambiguous": mc.ambiguous,
              "id_conflicts": mc.id_conflicts, "unmatched_lines": mc.unmatched_lines, "singletons": len(singletons)}
    log = ForeignLog(path, groups, counts, std_normalize=std_normalize)
    gold = {p["id"]: p["answer"] for p in prompts}
    flat = [(p, i) for p, pid in enumerate(log.prompt_ids) for i in range(len(groups[pid]))]
    texts = [verifier_text(log.texts[p][i], tuple(stop)) for p, i in flat]  # cut before a stop string
    golds = [gold[log.prompt_ids[p]] for p, _ in flat]
    scores = verify_batch(texts, golds, workers=verify_workers, **({} if rel_tol is None else {"rel_tol": rel_tol}))
    rewards = torch.zeros(log.mask.shape)  # (P, M)
    if flat:
        rows, cols = zip(*flat)
        rewards[list(rows), list(cols)] = torch.tensor(scores, dtype=torch.float32)
    log.set_rewards(rewards)
    given = log.mask & ~log.source_reward.isnan()  # (P, M)
    log.counts["reward_disagreements"] = int(((log.source_reward > 0.5) != (log.rewards > 0.5))[given].sum())
    return log


# ------------------------------------------------------------------------------------------------
# Foreign trajectories: lbar computed by a peer model, cached beside the file
# ------------------------------------------------------------------------------------------------

LBAR_CACHE_FORMAT = "graft-foreign-lbar"
LBAR_CACHE_VERSION = 1


def file_sha256(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def lbar_cache_path(path: str | os.PathLike, *, file_hash: str, model_path: str, cache_key: str = "",
                    temperature: float = 1.0) -> Path:
    """<folder>/.<file name>.lbar-<16 hex>.json: one cache per (file content, model, prompt settings, T)."""
    key = hashlib.sha256("\0".join([file_hash, model_path, cache_key, repr(float(temperature))]).encode()).hexdigest()
    p = Path(path)
    return p.with_name(f".{p.name}.lbar-{key[:16]}.json")


def fill_lbar(log: ForeignLog, model, tokenizer, *, model_path: str, encode_prompt: Callable[[str], list[int]],
              problems: dict[str, str], eos_token_id: int | None = None, cache_key: str = "",
              temperature: float = 1.0, batch_size: int = 16, chunk_size: int = 1024,
              progress: Callable[[int, int], None] | None = None) -> dict:
    """Compute the missing source lbar of every used record with a given model, through the cache (choice 6).

    model, tokenizer: the peer model (a transformers causal LM, on the device it should run on) and its
    tokenizer. model_path: what --peer-model named (part of the cache key). encode_prompt(problem text)
    -> the model's prompt token ids (the run's template, encoded by this tokenizer). problems: prompt id
    -> problem text. eos_token_id: appended to responses whose record says eos (default the
    tokenizer's). cache_key: anything else the numbers depend on (e.g. template and chat flag).
    Fills log.mean_logprob and log.num_tokens in place where they were NaN / -1; records that carry an
    lbar keep it. Returns {"computed": int, "cached": int, "cache": str path}.
    """
    from exchange import atomic_write
    from sampler import response_logprobs
    file_hash = file_sha256(log.path)
    cache = lbar_cache_path(log.path, file_hash=file_hash, model_path=model_path, cache_key=cache_key,
                            temperature=temperature)
    stored: dict[str, list] = {}
    if cache.is_file():
        try:
            data = json.loads(cache.read_text(encoding="utf-8"))
            ours = (data.get("format"), data.get("file_sha256"), data.get("model"))
            stored = dict(data["lines"]) if ours == (LBAR_CACHE_FORMAT, file_hash, model_path) else {}
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError, KeyError, TypeError, ValueError):
            stored = {}  # an unreadable cache is only lost time: recompute and overwrite it
    need = (log.mask & log.mean_logprob.isnan()).nonzero().tolist()  # [(p, i)] responses without an lbar
    todo = [(p, i) for p, i in need if str(int(log.lines[p, i])) not in stored]
    eos = tokenizer.eos_token_id if eos_token_id is None else eos_token_id
    jobs = []
    for p, i in todo:
        ids = tokenizer.encode(log.texts[p][i], add_special_tokens=False)
        if bool(log.eos[p, i]):
            assert eos is not None, "the peer tokenizer has no eos_token_id: pass eos_token_id"
            ids = ids + [eos]
        if not ids:
            raise ValueError(f"{log.path}:{int(log.lines[p, i])}: the response is empty; no log-probability to compute")
        jobs.append((p, i, encode_prompt(problems[log.prompt_ids[p]]), ids))
    jobs.sort(key=lambda j: -(len(j[2]) + len(j[3])))  # similar lengths share a batch: less padding
    was_training = model.training
    model.eval()
    with torch.no_grad():
        for b in range(0, len(jobs), batch_size):
            chunk = jobs[b: b + batch_size]
            lp, mask = response_logprobs(model, [j[2] for j in chunk], [j[3] for j in chunk],
                                         pad_token_id=0 if tokenizer.pad_token_id is None else tokenizer.pad_token_id,
                                         temperature=temperature, chunk_size=chunk_size)  # (B, T)
            sums, lens = (lp.float() * mask).sum(dim=1).cpu(), mask.sum(dim=1).cpu()  # (B,)
            for (p, i, _, _), s, ln in zip(chunk, sums.tolist(), lens.tolist()):
                stored[str(int(log.lines[p, i]))] = [s / ln, int(ln)]
            if progress is not None:
                progress(min(b + batch_size, len(jobs)), len(jobs))
    model.train(was_training)
    if todo:
        payload = {"format": LBAR_CACHE_FORMAT, "version": LBAR_CACHE_VERSION, "file": log.path.name,
                   "file_sha256": file_hash, "model": model_path, "key": cache_key, "temperature": temperature,
                   "lines": stored}
        atomic_write(cache, lambda tmp: Path(tmp).write_text(json.dumps(payload), encoding="utf-8"))
    for p, i in need:
        value, count = stored[str(int(log.lines[p, i]))]
        log.mean_logprob[p, i] = value
        log.num_tokens[p, i] = count
    return {"computed": len(todo), "cached": len(need) - len(todo), "cache": str(cache)}


# ------------------------------------------------------------------------------------------------
# The stored peer at the trainer's start: every check before the first rollout
# ------------------------------------------------------------------------------------------------


def open_peer_log(cfg, data: list[dict], dist, *, start_step: int) -> tuple[str | None, ForeignLog | None]:
    """--peer-log, checked once at start. Returns (the rollout folder's run id, None) for a finished
    run's rollout files, or (None, the loaded ForeignLog) for a JSONL of foreign trajectories.

    cfg: the trainer's Config; data: the run's prompts (--prompts); dist: runtime.DistInfo. A rollout
    folder must hold a file of this n for every step the run will take, from start_step on. Bad input
    raises SystemExit naming the flag and the file (and line, for JSONL records)."""
    log = Path(cfg.peer_log)
    if log.is_file():
        return None, load_foreign(cfg, data, dist)
    if not log.is_dir():
        raise SystemExit(f"--peer-log {cfg.peer_log!r}: no such folder of rollout files or JSONL file")
    from exchange import load_rollouts
    missing = [t for t in range(start_step, cfg.steps) if not (log / f"step_{t:06d}.safetensors").is_file()]
    if missing:
        have = len(list(log.glob("step_*.safetensors")))
        raise SystemExit(f"--peer-log {log}: this run needs steps {start_step}..{cfg.steps - 1} (--steps "
                         f"{cfg.steps}) but {len(missing)} are missing, the first step_{missing[0]:06d}"
                         f".safetensors (the folder holds {have} step files)")
    try:
        _, meta = load_rollouts(log / f"step_{start_step:06d}.safetensors", n=cfg.n)
    except ValueError as e:
        raise SystemExit(f"--peer-log: {e}") from None
    return meta.get("run_id"), None


def load_foreign(cfg, data: list[dict], dist) -> ForeignLog:
    """A JSONL --peer-log: matched to --prompts by id or problem text, de-duplicated, length-checked,
    grouped per prompt, re-verified; lbar computed once by --peer-model where the records lack it."""
    from runtime import compute_context, encode_prompt, load_policy
    try:
        log = load_foreign_log(cfg.peer_log, data, std_normalize=cfg.std_normalize,
                               verify_workers=cfg.verify_workers,
                               max_response_chars=response_char_bound(cfg.max_response_tokens), stop=cfg.stop)
    except ValueError as e:  # names the file and line
        raise SystemExit(f"--peer-log: {e}") from None
    if dist.main:
        print(log.report())
    if cfg.peer_model and log.missing_lbar(cfg.compat_norm):
        model, tok, stop = load_policy(cfg.peer_model, cfg, dist, for_training=False)
        with compute_context(cfg, dist):
            info = fill_lbar(
                log, model, tok, model_path=cfg.peer_model, eos_token_id=stop[0],
                encode_prompt=lambda q: encode_prompt(q, tok, template=cfg.prompt_template, chat=cfg.chat_template),
                problems={r["id"]: r["problem"] for r in data},
                cache_key=f"{cfg.prompt_template}\0{cfg.chat_template}" + (f"\0{cfg.stop!r}" if cfg.stop else ""),
                batch_size=cfg.micro_batch_size,
                chunk_size=cfg.logprob_chunk)
        if dist.main:
            print(f"[graft] lbar by --peer-model {cfg.peer_model}: {info['computed']} computed, "
                  f"{info['cached']} from {info['cache']}")
        del model
    if cfg.compat_weight or cfg.acceptance == "random":
        try:
            log.require_lbar(cfg.compat_norm)
        except ValueError as e:
            raise SystemExit(f"--peer-log: {e} (give --peer-model PATH to compute it)") from None
    return log


# ------------------------------------------------------------------------------------------------
# Benchmark: 10,000 foreign records, load + match + verify (not a test; prints its figures)
# ------------------------------------------------------------------------------------------------


def write_planted_log(path: str | os.PathLike, prompts: list[dict], *, records: int, group: int = 5,
                      seed: int = 0) -> None:
    """A synthetic foreign file for the benchmark: `records` lines, `group` per prompt, half matched by id
    and half by (re-spaced) problem text, one response in three with a wrong boxed answer, every tenth
    prompt absent from the run (unmatched). Responses are the prompt's "solution" field when it has one,
    numbered so that no two are the same text (a repeat would be removed, choice 7)."""
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(prompts), generator=g).tolist()
    lines = []
    for r in range(records):
        p = prompts[order[(r // group) % len(prompts)]]
        body = p.get("solution") or f"We work it out step by step: {p['problem'][:200]}"
        wrong = r % 3 == 2
        rec = {"response": f"{body}\nSo the answer is $\\boxed{{{p['answer'] + ' + 1' if wrong else p['answer']}}}$ "
                           f"(sample {r}).",
               "lbar": -0.25 - 0.01 * (r % 7), "reward": float(not wrong)}
        if (r // group) % 10 == 9:
            rec["id"] = f"not-in-this-run-{r // group}"
        elif (r // group) % 2:
            rec["problem"] = "  " + p["problem"].replace(" ", "   ") + "\n"
        else:
            rec["problem_id"] = p["id"]
        lines.append(json.dumps(rec))
    Path(path).write_text("\n".join(lines) + "\n", encoding="utf-8")


def bench_foreign(prompts: list[dict], *, records: int = 10_000, group: int = 5, verify_workers: int = 0,
                  folder: str | os.PathLike | None = None) -> dict:
    """Time read + match + group + verify + advantages of a planted file of `records` lines. Returns seconds."""
    import tempfile
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        path = Path(tmp) / "foreign.jsonl"
        write_planted_log(path, prompts, records=records, group=group)
        t0 = time.perf_counter()
        recs = read_foreign_records(path)
        t1 = time.perf_counter()
        match_records(recs, prompts)
        t2 = time.perf_counter()
        log = load_foreign_log(path, prompts, verify_workers=verify_workers)  # everything again, with verification
        t3 = time.perf_counter()
        log.step([p["id"] for p in prompts[:128]])
        t4 = time.perf_counter()
    print(log.report())
    out = {"records": records, "read_s": t1 - t0, "match_s": t2 - t1, "load_total_s": t3 - t2, "step_s": t4 - t3}
    print(f"[bench-foreign] {records} records: read {out['read_s']:.2f}s, match {out['match_s']:.2f}s, "
          f"load_foreign_log total (read + match + verify + advantages) {out['load_total_s']:.2f}s, "
          f"one 128-prompt step {1000 * out['step_s']:.1f}ms")
    return out


def main(argv: list[str] | None = None) -> int:
    import sys
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["complement"]:
        return main_complement(argv[1:], prog="offline.py complement")
    if argv[:1] == ["bench-foreign"]:
        p = argparse.ArgumentParser(prog="offline.py bench-foreign", description=bench_foreign.__doc__)
        p.add_argument("--prompts", required=True, help="a prompt JSONL (id, problem, answer[, solution])")
        p.add_argument("--records", type=int, default=10_000)
        p.add_argument("--verify-workers", type=int, default=0)
        a = p.parse_args(argv[1:])
        with open(a.prompts, encoding="utf-8") as f:
            prompts = [json.loads(line) for line in f if line.strip()]
        bench_foreign(prompts, records=a.records, verify_workers=a.verify_workers)
        return 0
    raise SystemExit("usage: python offline.py complement SRC1 SRC2 [...] | bench-foreign --prompts FILE")


if __name__ == "__main__":
    raise SystemExit(main())
