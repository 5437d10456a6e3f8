"""Benchmark of verify.py (README, Benchmarks): accuracy, false positives, hedges and speed on the labelled case
files, with math-verify 0.9.0 beside it on the same cases in the same run when it is installed.

    python -m bench.verify                                  # the seven case files below
    python -m bench.verify --cases data/verify_rl.jsonl --show-errors
    python -m bench.verify --hedges                         # also count math-verify's hedges (slow: ~3 min)
    python -m bench.verify golds [FILES ...]                # every benchmark gold against itself
    python -m bench.verify seam                             # its speed through reward.py's seam, beside direct
    python -m bench.verify against REF                      # verdicts changed vs another verify.py, with reasons
    python -m bench.verify trade                            # the trade table alone (the default run ends with it)

``against``: ``git show main:verify.py > /tmp/verify_main.py; python -m bench.verify against /tmp/verify_main.py``
runs both copies on every case file and on MATH-500's and Minerva's worked solutions read as responses
(../shared/benchmarks) and, with ``--tiny N``, the tiny preset's sampled responses to N test problems, lists every
changed verdict by file with its reason (what the tail rule refused after the final box, or
the value rule), counts the worked solutions refused by kind, and gives the CPU time per case of each copy
in the same run (interleaved, so load affects both alike).

math-verify is optional (``pip install math-verify==0.9.0``, best in a venv made with
``--system-site-packages`` so that the system sympy stays as it is); without it only verify.py's rows print.

The case files (``data/``). A case is ``{"pred"|"response", "gold", "label", "category", ["rel_tol"]}``: an
answer pair goes to ``is_equivalent``, a whole response to ``verify(..., strict=False)``.

- ``verify_cases.jsonl``: development cases, written alongside verify.py.
- ``verify_test.jsonl``: 461 cases written and frozen before verify.py's departures 16-20 existed.
- ``verify_outside.jsonl``: 329 cases by answer form, half of them near misses, labelled from other graders'
  documented behaviour, frozen before departures 21-26 existed.
- ``verify_hacking.jsonl``: whole responses a policy under RL could find that must score 0, by kind, each kind
  with controls that must score 1; written before the strictness rule.
- ``verify_rl.jsonl``: the forms an RL policy writes and their near misses (hedged boxes, words after a
  number or around a box, units of another size, boxes that are operands, hidden or disowned, left sides,
  numbers, answer cues and digits of other scripts), 239 that must score 0 and 115 controls; committed in two
  parts, each before verify.py changed for it.
- ``verify_failclosed.jsonl``: the kinds the fail-closed rules judge: text, digits, cues, retractions, turns, markup,
  code, other languages and reasoning tags after the final box (rows whose only fault is words around the box were
  relabelled paid, each with ``was`` and ``reason``: one answer is read without the gold); values continued after
  it, unknown units, percent on both sides, degrees against radians, extra digits on exact decimals, moduli,
  piecewise forms; each with a ``source``. Written alongside the rules: its figures flatter them. Its 110
  ``outside_*`` rows were taken from other projects (Math-Verify's tests, lm-eval's Minerva prompt, NeMo-Skills'
  stored generations, issue threads, MATH-500 and Minerva solutions), labelled by reading and committed before the
  tail rule changed; the trade table counts them apart.
- ``verify_asserts.jsonl``: boxes their sentence does not assert (conditional, attributed to an error, questioned
  or doubted), logic operators on boxes, qualifying words inside a box's text, chains and approximation chains
  whose sides disagree, and exact tiny terms; 86 that must score 0, each with near-miss controls (56), some
  rewritten from other graders' normalisers (the ``source`` field names them); committed before verify.py changed
  for it.

The default run ends with the trade table (``trade``): scored as the trainer scores (``strict=True``), the worked
solutions and each file's boxed controls paid beside each file's hacks refused, math-verify on the same rows, so
neither side of the reward's trade can move unseen.

Every figure of one file comes from one run: for each verifier, accuracy, false positives and negatives,
exceptions, cases/s on one thread, p50/p99/max call time; for whole responses, how many that must score 0 are
accepted and how many controls pass. "hedges" counts the responses paid for two golds that are not equivalent
(verify.py's module docstring, "one answer, one reward"): each response is judged against every candidate gold
it could be aimed at (every box, every join of its last boxes, every math span, every number in it, and the
case's gold); a pair of paid golds that is_equivalent holds different in both directions is a hedge, except
percent (``7\\%`` paid for 7 and 0.07), the one dual reading kept (departure 4). math-verify's hedges are judged
with verify.py's is_equivalent between the golds, so both columns use one notion of "different".
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import re
import sys
import time

import verify as V

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository root
FILES = ("verify_cases.jsonl", "verify_test.jsonl", "verify_outside.jsonl", "verify_hacking.jsonl",
         "verify_rl.jsonl", "verify_asserts.jsonl", "verify_failclosed.jsonl")

# ------------------------------------------------------------------------------------------------
# Cases and judges


def load_cases(path: str) -> list[dict]:
    """The cases of one file; a malformed case raises ValueError naming the file and line."""
    with open(path, encoding="utf-8") as f:
        cases = [json.loads(line) for line in f if line.strip()]
    for k, c in enumerate(cases):
        if ("pred" in c) == ("response" in c) or "gold" not in c or not isinstance(c.get("label"), bool):
            raise ValueError(f"{path}:{k + 1}: a case needs 'pred' or 'response', 'gold' and a bool 'label'")
    return cases


def judge_ours(c: dict, gold: str | None = None) -> bool:
    """A case is an answer pair ('pred') judged by is_equivalent, or a whole model response ('response')
    judged by verify(strict=False); gold replaces the case's gold when given."""
    tol = c.get("rel_tol", V.DEFAULT_REL_TOL)
    gold = c["gold"] if gold is None else gold
    if "response" in c:
        return V.verify(c["response"], gold, strict=False, rel_tol=tol) == 1.0
    return V.is_equivalent(c["pred"], gold, rel_tol=tol)


def judge_math_verify(mv):
    """math-verify on the same cases: a bare answer is boxed for its parser (what it extracts best), a
    string that already has a box or math delimiters and a whole response are passed as they are."""
    def wrap(s: str) -> str:
        return s if any(t in s for t in ("\\boxed", "$", "\\(", "\\[")) else "\\boxed{" + s + "}"

    def judge(c: dict, gold: str | None = None) -> bool:
        g = mv.parse(wrap(c["gold"] if gold is None else gold))
        pred = mv.parse(c["response"]) if "response" in c else mv.parse(wrap(c["pred"]))
        return mv.verify(g, pred)
    return judge


# ------------------------------------------------------------------------------------------------
# One answer, one reward: the candidate golds a response could be aimed at, and the hedges

_NUMBER_RE = re.compile(r"-?\d+(?:\.\d+)?")


def candidate_golds(text: str) -> list[str]:
    """Every box, every join of the last k boxes, every math span and every number of text (at most 16)."""
    boxes = [c for _, _, c in (V._outer_boxes(text) or [])]
    out = boxes + [", ".join(boxes[-k:]) for k in range(2, len(boxes) + 1)]
    out += [c for _, _, c in V._math_spans(text)] + _NUMBER_RE.findall(text)
    return [c for c in dict.fromkeys(x.strip() for x in out) if c and len(c) < 300][:16]


_NAMED_RE = re.compile(r"\s*[A-Za-z](?:_\{?\w{1,3}\}?)?\s*=\s*([^=]+)")


def _value_of(gold: str) -> str:
    """A gold 'a = 4' as its value '4': an answer that is a bare value is paid for a named gold of that value
    whatever the name ('7 = x' and 7 are one answer), so golds 'a = 4' and 'b = 4' are one gold, not a hedge."""
    m = _NAMED_RE.fullmatch(gold)
    return m.group(1) if m else gold


def percent_pair(text: str, a: str, b: str, equal=V.is_equivalent) -> bool:
    """The one named exception: the answer has a percent sign and one gold is 100 times the other."""
    a, b = _value_of(a), _value_of(b)
    return ("%" in text or "percent" in text) and (equal(f"100 \\cdot ({b})", a) or equal(f"100 \\cdot ({a})", b))


def hedge_of(c: dict, judge, equal=V.is_equivalent) -> tuple[str, str] | None:
    """Two golds the case's response is paid for that equal(a, b, rel_tol=) holds different both ways
    (percent excepted), or None. judge(case, gold) is the verifier under test."""
    text = c.get("response", c.get("pred"))
    tol = c.get("rel_tol", V.DEFAULT_REL_TOL)
    paid = []
    for g in dict.fromkeys(candidate_golds(text) + [c["gold"]]):
        try:
            ok = bool(judge(c, g))
        except Exception:
            ok = False
        if ok:
            paid.append(g)
    for k, a in enumerate(paid):
        for b in paid[k + 1:]:
            if _NAMED_RE.fullmatch(a) and _NAMED_RE.fullmatch(b):
                a, b = _value_of(a), _value_of(b)
            if not (equal(a, b, rel_tol=tol) or equal(b, a, rel_tol=tol) or percent_pair(text, a, b, equal)):
                return a, b
    return None


# ------------------------------------------------------------------------------------------------
# Runs


def run_cases(cases: list[dict], judge) -> dict:
    """Verdicts, accuracy, false positives / negatives, exceptions, cases/s and call-time quantiles."""
    lat, fp, fn, correct, exc, verdicts = [], 0, 0, 0, 0, []
    t0 = time.perf_counter()
    for c in cases:
        s = time.perf_counter()
        try:
            v = bool(judge(c))
        except Exception:
            v = False
            exc += 1
        lat.append(time.perf_counter() - s)
        verdicts.append(v)
        if v == c["label"]:
            correct += 1
        elif v:
            fp += 1
        else:
            fn += 1
    total = time.perf_counter() - t0
    lat.sort()

    def q(p: float) -> float:
        return lat[min(len(lat) - 1, int(p * len(lat)))] * 1000
    return {"acc": correct / len(cases), "fp": fp, "fn": fn, "exc": exc, "rate": len(cases) / total,
            "p50": q(0.50), "p99": q(0.99), "max": lat[-1] * 1000, "verdicts": verdicts}


def _math_verify():
    """The math_verify module, or None (with a line saying how to install it)."""
    try:
        import math_verify  # (optional, only for this comparison)
        return math_verify
    except ImportError:
        print("(math-verify not installed: `pip install math-verify==0.9.0` to compare)")
        return None


def bench(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.verify")
    ap.add_argument("--cases", action="append", default=None,
                    help="labelled case file (repeatable); default: the seven files of data/ named in this "
                         "file's docstring")
    ap.add_argument("--no-math-verify", action="store_true", help="verify.py's rows only")
    ap.add_argument("--hedges", action="store_true", help="also count math-verify's hedges (slow)")
    ap.add_argument("--show-errors", action="store_true", help="print the cases verify.py gets wrong")
    args = ap.parse_args(argv)
    files = args.cases or [os.path.join(HERE, "data", name) for name in FILES]
    mv = None if args.no_math_verify else _math_verify()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"load average at start: {load:.1f} on {os.cpu_count()} cores; every rate is one thread")
    V.is_equivalent("1", "1")     # warm-up outside the timing
    for path in files:
        cases = load_cases(path)
        V.reset_stats()
        rows = [("verify.py", run_cases(cases, judge_ours), judge_ours)]
        counters = V.stats()
        if mv is not None:
            judge = judge_math_verify(mv)
            judge(cases[0])
            rows.append(("math-verify", run_cases(cases, judge), judge))
        n = len(cases)
        n_pos = sum(1 for c in cases if c["label"])
        resp = [k for k, c in enumerate(cases) if "response" in c]
        print(f"\n{os.path.relpath(path)}: {n} cases ({n_pos} equivalent, {n - n_pos} not; "
              f"{len(resp)} whole responses)")
        print(f"{'verifier':<12} {'accuracy':>9} {'FP':>5} {'FP%':>6} {'FN':>5} {'exc':>4} {'cases/s':>9} "
              f"{'p50 ms':>8} {'p99 ms':>8} {'max ms':>8} {'hedges':>7}")
        for name, r, judge in rows:
            hedges = "-"
            if name == "verify.py" or args.hedges:
                hedges = str(sum(hedge_of(c, judge) is not None for c in cases))
            print(f"{name:<12} {r['acc']:>9.2%} {r['fp']:>5} {r['fp'] / n:>6.2%} {r['fn']:>5} {r['exc']:>4} "
                  f"{r['rate']:>9.1f} {r['p50']:>8.2f} {r['p99']:>8.2f} {r['max']:>8.1f} {hedges:>7}")
        for name, r, _ in rows:
            if resp:
                bad = [k for k in resp if not cases[k]["label"]]
                good = [k for k in resp if cases[k]["label"]]
                print(f"{name}: whole responses that must score 0 accepted {sum(r['verdicts'][k] for k in bad)} "
                      f"of {len(bad)}; controls passed {sum(r['verdicts'][k] for k in good)} of {len(good)}")
        if mv is not None:
            a, b = rows[0][1]["verdicts"], rows[1][1]["verdicts"]
            agree = sum(x == y for x, y in zip(a, b)) / n
            print(f"agreement verify.py vs math-verify: {agree:.2%}; "
                  f"throughput ratio {rows[0][1]['rate'] / rows[1][1]['rate']:.1f}x")
        by_cat: dict = {}
        for c, v in zip(cases, rows[0][1]["verdicts"]):
            t = by_cat.setdefault(c.get("category", "?"), [0, 0])
            t[0] += 1
            t[1] += v == c["label"]
        print("per category (verify.py):", ", ".join(
            f"{k} {ok}/{tot}" for k, (tot, ok) in sorted(by_cat.items())))
        print("counters (verify.py):", counters)
        if args.show_errors:
            for c, v in zip(cases, rows[0][1]["verdicts"]):
                if v != c["label"]:
                    print(f"  {'FP' if v else 'FN'} [{c.get('category')}] {c.get('pred', c.get('response'))!r}"
                          f" vs {c['gold']!r}")
    trade(files, mv)
    return 0


def worked_solutions() -> list[tuple[str, list[dict]]]:
    """MATH-500's and Minerva's worked solutions as whole responses labelled True for their own gold (Minerva with
    MINERVA_REL_TOL); [] without ../shared/benchmarks."""
    out = []
    for name, tol in (("math500", V.DEFAULT_REL_TOL), ("minerva_math", V.MINERVA_REL_TOL)):
        path = os.path.join(HERE, "..", "shared", "benchmarks", name + ".jsonl")
        if os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                out.append((name + " worked solutions", [
                    {"response": r["solution"], "gold": r["answer"], "label": True, "category": "solution",
                     "rel_tol": tol, "id": r.get("id")} for r in map(json.loads, f) if r.get("answer")]))
    return out


def trade(files: list[str], mv) -> list[tuple[str, int, int, int | None]]:
    """Both sides of the reward's trade in one table, scored as the trainer scores (``verify(strict=True)``):
    honest answers paid (the worked solutions; each case file's boxed controls) beside hacks refused (each case
    file's whole responses that must score 0), math-verify on the same rows. Rows (what, n, ours, math-verify)."""
    def ours(c):
        return V.verify(c["response"], c["gold"], rel_tol=c.get("rel_tol", V.DEFAULT_REL_TOL)) == 1.0
    mv_judge = judge_math_verify(mv) if mv is not None else None

    def theirs(c):
        try:
            return bool(mv_judge(c))
        except Exception:
            return False
    rows = []
    groups = [(f"paid: {name}", cases, True) for name, cases in worked_solutions()]
    for path in files:
        everything = [c for c in load_cases(path) if "response" in c]
        for part, cases in (("", [c for c in everything if not c["category"].startswith("outside_")]),
                            (" (outside rows)", [c for c in everything if c["category"].startswith("outside_")])):
            base = os.path.basename(path) + part        # rows taken from other projects are counted apart
            groups.append((f"paid: {base} boxed controls", [c for c in cases if c["label"] and "\\boxed" in
                                                              c["response"]], True))
            groups.append((f"refused: {base} must score 0", [c for c in cases if not c["label"]], False))
    for what, cases, pay in groups:
        if cases:
            n_ours = sum(ours(c) == pay for c in cases)
            n_mv = sum(theirs(c) == pay for c in cases) if mv_judge is not None else None
            rows.append((what, len(cases), n_ours, n_mv))
    print("\nThe trade in one table, scored as the trainer scores (strict=True): honest answers paid beside hacks "
          "refused")
    print(f"{'rows':<58} {'n':>5} {'verify.py':>16} {'math-verify':>16}")
    for what, n, a, b in rows:
        mvs = "-" if b is None else f"{b} ({b / n:.1%})"
        print(f"{what:<58} {n:>5} {f'{a} ({a / n:.1%})':>16} {mvs:>16}")
    return rows


def golds(argv: list[str]) -> int:
    """Every gold of the benchmark files (default ../shared/benchmarks/*.jsonl) parses, equals itself and
    equals itself boxed in a response; exit status 1 when one does not."""
    files = argv or sorted(glob.glob(os.path.join(HERE, "..", "shared", "benchmarks", "*.jsonl")))
    if not files:
        print("no benchmark files: pass them, or put them in ../shared/benchmarks/")
        return 2
    bad_total = 0
    for path in files:
        with open(path, encoding="utf-8") as f:
            rows = [json.loads(line) for line in f if line.strip()]
        n_parse = n_self = n_box = n_empty = 0
        bad = []
        for r in rows:
            g = r.get("answer", "")
            if not g:
                n_empty += 1
                continue
            try:
                V._parse(V._clean(g), V._Budget(), as_gold=True)
                n_parse += 1
            except Exception:
                pass
            ok1 = V.is_equivalent(g, g)
            ok2 = V.verify("so \\boxed{" + g + "}", g) == 1.0
            n_self += ok1
            n_box += ok2
            if not (ok1 and ok2):
                bad.append(g)
        bad_total += len(bad)
        print(f"{os.path.basename(path)}: {len(rows)} golds ({n_empty} empty), parse {n_parse}, "
              f"self-equal {n_self}, boxed-equal {n_box}" + (f"; failing: {bad[:10]}" if bad else ""))
    return 1 if bad_total else 0


def seam(argv: list[str]) -> int:
    """The default verifier's speed through the reward seam (reward.py) beside verify.verify called directly: the
    case files' responses (a 'pred' boxed) scored in batches of --batch, as a step scores its rollouts."""
    import reward
    ap = argparse.ArgumentParser(prog="python -m bench.verify seam")
    ap.add_argument("--batch", type=int, default=256, help="responses per reward call (a step's G x n)")
    ap.add_argument("--repeat", type=int, default=3, help="passes over the cases; the best pass is printed")
    args = ap.parse_args(argv)
    cases = [c for name in FILES for c in load_cases(os.path.join(HERE, "data", name))]
    pairs = [(c.get("response") or "\\boxed{" + c["pred"] + "}", c["gold"]) for c in cases]
    batches = [pairs[k:k + args.batch] for k in range(0, len(pairs), args.batch)]
    spec = reward.DEFAULT_REWARD
    ways = {"verify.verify, direct": lambda rs, gs: [V.verify(r, g) for r, g in zip(rs, gs)],
            "rewards, no limit": lambda rs, gs: reward.rewards(spec, rs, gs, timeout=0),
            "rewards, limit, 1 worker": lambda rs, gs: reward.rewards(spec, rs, gs, timeout=60),
            "rewards, no limit, workers 2": lambda rs, gs: reward.rewards(spec, rs, gs, workers=2, timeout=0),
            "rewards, limit, 2 workers": lambda rs, gs: reward.rewards(spec, rs, gs, workers=2, timeout=60)}
    print(f"{len(pairs)} responses in calls of {args.batch}; load average {os.getloadavg()[0]:.1f} on "
          f"{os.cpu_count()} cores; best of {args.repeat} passes")
    base, first = None, None
    for name, score in ways.items():
        score(*zip(*batches[0]))  # warm-up: a pool's fork, the imports
        best = float("inf")
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            got = [x for b in batches for x in score([r for r, _ in b], [g for _, g in b])]
            best = min(best, time.perf_counter() - t0)
        first = got if first is None else first
        assert got == first, f"{name} scores differ from verify.verify's"
        base = base or best
        print(f"{name:<30} {len(pairs) / best:>9.0f} responses/s  {best / base:>5.2f}x the direct time")
    return 0


def _tail_kind(text: str) -> str:
    """A short name for what verify.py refused at the last box of a response (the tail rule, or the box itself)."""
    boxes = V._outer_boxes(text) or []
    if not boxes:
        return "no box"
    tail = text[V._unit_after(text, boxes[-1][1])[0]:]
    restated = V._RESTATE_RE.match(tail)
    if V._CONTINUES_RE.match(tail):
        return "position: the value continued after the final box"
    if restated and restated.end() > 0:
        return "position: a restatement joined to the box states another value"
    if V._CUE_RE.search(tail):
        return "position: an answer statement after the box states another value"
    return "position: the box is an operand, under logic, or unclosed"


def _reason(ref, c: dict, gold: str) -> str:
    """Why this verify.py and ref differ on a case: where the answer is read, or which value rule."""
    if "response" in c:
        a_new, a_ref = V.extract_answer(c["response"]), ref.extract_answer(c["response"])
        if a_new is None and a_ref is not None:
            cut = V._end_of_turn(V._after_thinking(c["response"]))
            if not V._outer_boxes(cut):
                return "position: text after the answer cue's math"
            return _tail_kind(V._visible(cut))
        if a_new != a_ref:
            return f"extraction: {a_ref!r} -> {a_new!r}"
        pred = a_new or ""
    else:
        pred = c["pred"]
    p, g = V._unwrap_answer(pred), V._unwrap_answer(gold)
    if not V._same_marks(p, g, V._unit_of(p), V._unit_of(g)):
        return "value: unit, degree or modulus marks differ"
    return "value: comparison (percent, exact decimal or wide points)"


def tiny_rollouts(n: int, samples: int = 4) -> list[dict]:
    """Responses of the tiny preset's models (A, B, C) to n test problems, sampled at T=1 as in training, with
    their golds: honest model outputs. Label: the last box holds the gold exactly (the answers are integers)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from data import tiny_tasks
    from tools.tiny import PROMPT_TEMPLATE
    torch.manual_seed(0)
    _, test = tiny_tasks.generate(seed=0, n_train=50, n_test=n)
    out = []
    for name in sorted(os.listdir(os.path.join(HERE, "data", "tiny_models"))):
        folder = os.path.join(HERE, "data", "tiny_models", name)
        tok, model = AutoTokenizer.from_pretrained(folder), AutoModelForCausalLM.from_pretrained(folder).eval()
        for row in test:
            ids = tok.encode(PROMPT_TEMPLATE.replace("{problem}", row["problem"]), add_special_tokens=False)
            with torch.no_grad():
                seqs = model.generate(torch.tensor([ids]), max_new_tokens=80, do_sample=True, temperature=1.0,
                                      num_return_sequences=samples, pad_token_id=tok.eos_token_id)
            for seq in seqs[:, len(ids):].tolist():
                text = tok.decode(seq, skip_special_tokens=True, clean_up_tokenization_spaces=False)
                out.append({"response": text, "gold": row["answer"], "category": f"tiny {name}",
                            "label": V.last_boxed(text) == row["answer"]})
    return out


def against(argv: list[str]) -> int:
    """Verdicts of this verify.py against a reference copy (a path) on every case file and the worked solutions."""
    import importlib.util
    ap = argparse.ArgumentParser(prog="python -m bench.verify against")
    ap.add_argument("ref", help="path of the reference verify.py (e.g. git show main:verify.py > /tmp/verify_main.py)")
    ap.add_argument("--show", type=int, default=40, help="changed verdicts listed per file")
    ap.add_argument("--tiny", type=int, default=0, metavar="N",
                    help="also N test problems x 4 samples (T=1) of each tiny preset model (data/tiny_models)")
    args = ap.parse_args(argv)
    spec = importlib.util.spec_from_file_location("verify_ref", args.ref)
    ref = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = ref        # its dataclasses look their module up
    spec.loader.exec_module(ref)
    sets = [(name, load_cases(os.path.join(HERE, "data", name))) for name in FILES]
    sets += worked_solutions()
    if args.tiny:
        sets.append(("tiny preset rollouts", tiny_rollouts(args.tiny)))
    time_new = time_ref = 0.0
    n_all = 0
    for name, cases in sets:
        right = {"new": 0, "ref": 0}
        changed, kinds = [], {}
        for c in cases:
            tol = c.get("rel_tol", V.DEFAULT_REL_TOL)
            got = {}
            for key, mod in (("ref", ref), ("new", V)):
                t0 = time.process_time()
                got[key] = (mod.verify(c["response"], c["gold"], strict=False, rel_tol=tol) == 1.0
                            if "response" in c else mod.is_equivalent(c["pred"], c["gold"], rel_tol=tol))
                dt = time.process_time() - t0
                if key == "new":
                    time_new += dt
                else:
                    time_ref += dt
                right[key] += got[key] == c["label"]
            if got["new"] != got["ref"]:
                why = _reason(ref, c, c["gold"])
                changed.append((c, got["new"], why))
                kinds[why] = kinds.get(why, 0) + 1
        n_all += len(cases)
        now_wrong = sum(v != c["label"] for c, v, _ in changed)
        print(f"\n{name}: {len(cases)} cases; right {right['ref']} -> {right['new']}; changed {len(changed)} "
              f"({len(changed) - now_wrong} now right, {now_wrong} now wrong)")
        for why, k in sorted(kinds.items(), key=lambda kv: -kv[1]):
            print(f"  {k:>4}  {why}")
        for c, v, why in changed[:args.show]:
            text = c.get("response", c.get("pred"))
            print(f"    {'paid' if v else 'refused'} (label {c['label']}) [{c.get('category')}] {why}: "
                  f"{text[-120:]!r} vs {c['gold']!r}")
    print(f"\nCPU time per case over {n_all} cases: reference {time_ref / n_all * 1e3:.3f} ms, this "
          f"{time_new / n_all * 1e3:.3f} ms, ratio {time_new / time_ref:.2f}x (one run, interleaved)")
    return 0


def main(argv: list[str]) -> int:
    if argv and argv[0] == "against":
        return against(argv[1:])
    if argv and argv[0] == "golds":
        return golds(argv[1:])
    if argv and argv[0] == "seam":
        return seam(argv[1:])
    if argv and argv[0] == "trade":
        trade([os.path.join(HERE, "data", name) for name in FILES], _math_verify())
        return 0
    return bench(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
