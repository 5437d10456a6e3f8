"""Tests of preflight.py on the committed tiny models: every figure of the report recomputed from the
sampled groups by plain loops (and a few cross-scores by a plain transformers forward), the report equal
to what a GRAFT step of the same samples selects and accepts (graft_select and graft_rows
driven on them), and the messages for bad input.

Rewards are planted (a hash of the response text, as test_graft's planted verifier) so that both
directions have all-fail and mixed groups, and the cap is low enough that some responses are dropped
as too long after retokenisation and some are cut at the source's cap.

Run: python -m pytest -q test_preflight.py
"""

import json
import math
import zlib
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch

import graft
from tools import preflight
import verify
from runtime import DistInfo
from config import Config
from core import graft_candidates, score_peer, success_counts
from test_graft import exchange_phases

torch.set_num_threads(1)
ROOT = Path(__file__).resolve().parent.parent  # the repository root
TINY = ROOT / "data" / "tiny_models"
pytestmark = pytest.mark.skipif(not (TINY / "A" / "model.safetensors").is_file() or
                                not (TINY / "B" / "model.safetensors").is_file(),
                                reason="data/tiny_models/A and B (the committed tiny models) are absent")
G, N, CAP, P = 12, 4, 32, 32
DELTAS = (0.0, 0.5, 0.9)


def planted_reward(text: str) -> float:
    return 1.0 if zlib.crc32(text.encode()) % 3 == 0 else 0.0


def planted_batch(responses, golds, *, workers=0, **kw):
    """The planted verdicts; the gold check of a prompt file ("\\boxed{gold}" against the gold) passes."""
    return [1.0 if r == f"\\boxed{{{g}}}" else planted_reward(r) for r, g in zip(responses, golds)]


def nobody_solves(responses, golds, *, workers=0, **kw):
    return [1.0 if r == f"\\boxed{{{g}}}" else 0.0 for r, g in zip(responses, golds)]


def write_prompts(path: Path, count: int) -> Path:
    from data import tiny_tasks
    train, _ = tiny_tasks.generate(0, count, 5)
    tiny_tasks.write_jsonl(str(path), train[:count])
    return path


def args_for(tmp: Path, prompts: Path, *extra: str) -> list[str]:
    return ["--model-a", str(TINY / "A"), "--model-b", str(TINY / "B"), "--prompts", str(prompts),
            "--problems", str(G), "--n", str(N), "--max-response-tokens", str(CAP), "--prompts-per-step", str(P),
            "--prompt-template", "{problem}\n", "--deltas", ",".join(map(str, DELTAS)), "--out",
            str(tmp / "report.json"), *extra]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One preflight of the tiny A <-> B on planted rewards: (report as written to JSON, the two sides, args)."""
    tmp = tmp_path_factory.mktemp("preflight")
    prompts = write_prompts(tmp / "p.jsonl", 40)
    mp = pytest.MonkeyPatch()
    mp.setattr(verify, "verify_batch", planted_batch)
    try:
        args = preflight.build_parser().parse_args(args_for(tmp, prompts))
        report, sides = preflight.preflight(args)
    finally:
        mp.undo()
    written = json.loads(json.dumps(report))  # what the JSON file holds
    return written, sides, args


def naive_quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    pos = q * (len(xs) - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def loop_swap(k_a: list[int], k_b: list[int], n: int) -> tuple[set, set]:
    """The paper's balanced swap by hand: candidates sorted by the source's count (desc, then index), the
    first m kept plus every candidate tied with the m-th."""
    c_ab = [g for g in range(len(k_a)) if k_b[g] == 0 and 1 <= k_a[g] < n]
    c_ba = [g for g in range(len(k_a)) if k_a[g] == 0 and 1 <= k_b[g] < n]
    m = min(len(c_ab), len(c_ba))

    def keep(c, k):
        if m == 0:
            return set()
        order = sorted(c, key=lambda g: (-k[g], g))
        kth = k[order[m - 1]]
        return {g for g in c if k[g] >= kth}
    return keep(c_ab, k_a), keep(c_ba, k_b)


def test_every_figure_recomputed_by_loops(run):
    report, sides, args = run
    a, b = sides
    assert report["problems"] == G
    k = {s.name: [int(sum(s.rollouts.rewards[g].tolist())) for g in range(G)] for s in sides}
    for s in sides:  # rewards are the planted verdicts of the decoded texts
        assert s.rollouts.rewards.view(-1).tolist() == [planted_reward(t) for t in s.rollouts.texts]
        assert report["models"][s.name]["successes"] == k[s.name]
    keep_ab, keep_ba = loop_swap(k["a"], k["b"], N)
    assert keep_ab or keep_ba, "the planted rewards should give the swap something to keep"
    scale = P / G
    for key, src, recv, keep in (("a_to_b", a, b, keep_ab), ("b_to_a", b, a, keep_ba)):
        d, recs = report["directions"][key], report["responses"][key]
        ks, kr = k[src.name], k[recv.name]
        fail = [g for g in range(G) if kr[g] == 0]
        cand = [g for g in fail if 1 <= ks[g] < N]
        assert d["recv_all_fail"] == len(fail) and d["candidates"] == len(cand)
        assert d["src_solves"] == sum(1 for g in fail if ks[g] >= 1) and d["src_mixed"] == len(cand)
        if fail:
            assert d["solved_share"] == pytest.approx(d["src_solves"] / len(fail))
            assert d["mixed_share"] == pytest.approx(len(cand) / len(fail))
        assert d["candidates_per_step"] == pytest.approx(len(cand) * scale)
        assert d["m"] == min(sum(1 for g in range(G) if k["b"][g] == 0 and 1 <= k["a"][g] < N),
                             sum(1 for g in range(G) if k["a"][g] == 0 and 1 <= k["b"][g] < N))
        assert set(d["received_groups"]) == keep and d["kept_per_step"] == pytest.approx(len(keep) * scale)
        # per response: the source's own record, and the receiver's retokenisation by hand
        assert len(recs) == G * N
        for r, x in enumerate(recs):
            assert x["group"] == r // N and x["text"] == src.rollouts.texts[r]
            assert x["src_len"] == len(src.rollouts.tokens[r]) and x["eos"] == bool(src.rollouts.eos.view(-1)[r])
            ids = recv.tok.encode(x["text"], add_special_tokens=False) + ([recv.eos_id] if x["eos"] else [])
            assert x["recv_len"] == (len(ids) if 0 < len(ids) <= CAP else None)
            if x["s"] is not None:
                assert x["s"] == pytest.approx(math.exp(x["lbar_recv"] - x["lbar_src"]), rel=1e-5)
                assert x["w"] == pytest.approx(min(x["s"], 1.0) if x["s"] > args.delta else 0.0, rel=1e-6)
        for part, rs in (("received", [r for r in range(G * N) if r // N in keep]),
                         ("no_balance", [r for r in range(G * N) if r // N in cand]), ("all", list(range(G * N)))):
            st, xs = d[part], [recs[r] for r in rs]
            kept = [x for x in xs if x["recv_len"] is not None]
            dropped = [x for x in xs if x["recv_len"] is None]
            acc = [(r, x) for r, x in zip(rs, xs) if x["recv_len"] is not None and x["s"] > args.delta]
            assert (st["responses"], st["retokenised"], st["dropped_length"]) == (len(xs), len(kept), len(dropped))
            assert st["dropped_cut"] == sum(1 for x in dropped if x["finish"] == "length")
            assert st["ended"] == sum(1 for x in xs if x["finish"] != "length")
            assert st["accepted"] == len(acc)
            # the gate by the source's verdict: successes and failures received, kept, and their s medians
            for ok, many, one in ((True, "successes", "success"), (False, "failures", "failure")):
                assert st[many] == sum(1 for x in xs if (x["reward"] > 0) == ok)
                assert st[f"accepted_{many}"] == sum(1 for _, x in acc if (x["reward"] > 0) == ok)
                part = sorted(x["s"] for x in kept if (x["reward"] > 0) == ok)
                want = None if not part else part[(len(part) - 1) // 2]  # torch's median: the lower middle
                assert st[f"s_median_{one}"] == (None if want is None else pytest.approx(want, rel=1e-6))
            assert st["groups_to_update_per_step"] == pytest.approx(len({r // N for r, _ in acc}) * scale)
            assert st["responses_to_update_per_step"] == pytest.approx(len(acc) * scale)
            if not xs:
                assert st["dropped_share"] is None and st["accepted_share"] is None
                continue
            assert st["dropped_share"] == pytest.approx(len(dropped) / len(xs))
            for dl in (*DELTAS, args.delta):
                assert st["accepted_at"][f"{dl:g}"] == pytest.approx(sum(1 for x in kept if x["s"] > dl) / len(xs))
            if not kept:
                assert st["s_quantiles"] is None and st["length_ratio_mean"] is None
                continue
            s = [x["s"] for x in kept]
            for q in preflight.QUANTILES:
                assert st["s_quantiles"][f"p{round(100 * q)}"] == pytest.approx(naive_quantile(s, q), rel=1e-5)
            assert st["s_mean"] == pytest.approx(sum(s) / len(s), rel=1e-5)
            assert st["length_ratio_mean"] == pytest.approx(sum(x["recv_len"] / x["src_len"] for x in kept) / len(kept))
            assert st["length_ratio_total"] == pytest.approx(sum(x["recv_len"] for x in kept) /
                                                             sum(x["src_len"] for x in kept))
            if acc:
                assert st["mean_w"] == pytest.approx(sum(min(x["s"], 1) for _, x in acc) / len(acc), rel=1e-5)
    # the run covers what it should: drops for length, cut responses, and accepted ones
    every = report["directions"]["b_to_a"]["all"]
    assert every["dropped_length"] > 0 and every["retokenised"] > 0
    assert any(not x["eos"] for x in report["responses"]["a_to_b"])
    assert report["directions"]["a_to_b"]["all"]["accepted"]
    # speed: the figures it says it computes
    for s in sides:
        sp = report["models"][s.name]["speed"]
        tokens = sum(len(t) for t in s.rollouts.tokens)
        assert sp["tokens"] == tokens and sp["tokens_per_s"] == pytest.approx(tokens / s.sample_s)
        est = P * N * (tokens / (G * N)) / (tokens / s.sample_s) + s.logprob_s * P / G * (1 + preflight.UPDATE_PASSES)
        assert sp["step_s_estimate"] == pytest.approx(est)
    # the complementarity part is graft.py complement's report, from the same counts
    rows = {(r["src"], r["recv"]): r for r in report["complement"]["rows"]}
    assert rows[(0, 1)]["recv_all_fail"] == report["directions"]["a_to_b"]["recv_all_fail"]
    assert rows[(1, 0)]["candidates_per_step"] == pytest.approx(report["directions"]["b_to_a"]["candidates_per_step"])


def test_cross_scores_match_a_plain_forward(run):
    """lbar of a few responses under each model by one full forward and log-softmax at T = 1 (Eq. 6)."""
    report, sides, _ = run
    for key, src, recv in (("a_to_b", sides[0], sides[1]), ("b_to_a", sides[1], sides[0])):
        recs = report["responses"][key]
        picked = [r for r, x in enumerate(recs) if x["s"] is not None][:4]
        assert picked
        for r in picked:
            x = recs[r]
            ids = recv.tok.encode(x["text"], add_special_tokens=False) + ([recv.eos_id] if x["eos"] else [])
            prompt = recv.prompt_ids[r // N]
            with torch.no_grad():
                logits = recv.model(torch.tensor([prompt + ids])).logits[0].float()
            lp = torch.log_softmax(logits, -1)[len(prompt) - 1: -1].gather(1, torch.tensor(ids)[:, None]).squeeze(1)
            assert x["lbar_recv"] == pytest.approx(float(lp.mean()), abs=1e-4)
            own = src.rollouts.tokens[r]
            with torch.no_grad():
                logits = src.model(torch.tensor([src.prompt_ids[r // N] + own])).logits[0].float()
            p0 = len(src.prompt_ids[r // N])
            lp_src = torch.log_softmax(logits, -1)[p0 - 1: -1].gather(1, torch.tensor(own)[:, None]).squeeze(1)
            assert x["lbar_src"] == pytest.approx(float(lp_src.mean()), abs=1e-4)


def receiver_trainer(side, peer_name: str, **cfg_changes):
    """A Trainer of one side with its model, tokenizer and prompts, for its exchange phases (no run directory):
    what exchange_phases reads (its variant, its rule Context, its prompts, its baseline state)."""
    tr = graft.Trainer.__new__(graft.Trainer)
    tr.cfg = Config(**{**side.cfg.__dict__, "peer_exchange": "unused", "peer_name": peer_name, **cfg_changes})
    tr.dist, tr.fsdp_root, tr.baseline_state = DistInfo(), None, {}
    tr.model, tr.tok, tr.stop_ids, tr.eos_id = side.model, side.tok, side.stop_ids, side.eos_id
    tr.prompt_ids, tr.amp, tr.variant = side.prompt_ids, nullcontext, graft.VARIANTS["graft"]
    tr.ctx = graft.rule_context(tr.cfg, tokenizer=side.tok, eos_id=side.eos_id, logprob_fn=tr.sharded_logprobs,
                                both_ways=True)
    return tr


@pytest.mark.parametrize("balance", [True, False])
def test_report_equals_what_a_graft_step_selects_and_accepts(run, balance):
    report, sides, _ = run
    a, b = sides
    batch = list(range(G))
    for recv, src, key in ((b, a, "a_to_b"), (a, b, "b_to_a")):
        tr = receiver_trainer(recv, src.name, balance=balance)
        d = report["directions"][key]
        part = d["received"] if balance else d["no_balance"]
        into = graft.graft_select(tr.ctx, 0, recv.rollouts, {src.name: src.rollouts})[0][src.name]
        groups = d["received_groups"] if balance else [g for g in range(G) if g in set(
            torch.nonzero(graft_candidates(k_recv=success_counts(recv.rollouts.rewards),
                                           k_src=success_counts(src.rollouts.rewards), n=N)).view(-1)
            .tolist())]
        assert torch.nonzero(into).view(-1).tolist() == groups
        out, replaced, m = exchange_phases(tr, 0, batch, recv.rollouts, {src.name: src.rollouts})
        assert m["selected"] == len(groups) and m["peer_responses"] == part["responses"]
        assert m["dropped_length"] == part["dropped_length"] and m["accepted"] == part["accepted"]
        assert m["rejected"] == part["retokenised"] - part["accepted"]
        assert torch.nonzero(replaced).view(-1).tolist() == sorted({r.group for r in out if r.is_peer})
        assert len({r.group for r in out if r.is_peer}) == part["groups_to_update_per_step"] * G / P
        assert len(m["s_each"]) == part["retokenised"]
        if part["retokenised"]:
            assert m["mean_s"] == pytest.approx(part["s_mean"], rel=1e-5)
        if part["accepted"]:
            assert m["mean_w"] == pytest.approx(part["mean_w"], rel=1e-5)
        # and per response: the step's s of every scored response is the preflight's cross-score
        got, dropped, _ = score_peer(tr.ctx, 0, src.rollouts, groups, [tr.prompt_ids[i] for i in batch])
        recs = report["responses"][key]
        assert dropped == part["dropped_length"]
        for x in got:
            assert x.s == pytest.approx(recs[x.slot]["s"], rel=1e-5) and len(x.ids) == recs[x.slot]["recv_len"]
        assert m["s_each"] == pytest.approx([recs[x.slot]["s"] for x in got], rel=1e-5)  # the logged lists, in order
        assert m["s_index"] == [x.slot for x in got]


def test_the_note_when_the_gate_keeps_failures_over_successes():
    st = {"delta": 0.8, "balance": True, "max_response_tokens": 20}
    quiet = {"responses": 0, "retokenised": 0, "dropped_share": None, "accepted_at": {}}

    def direction(src, recv, ok, bad, kept_ok, kept_bad):
        rec = {"retokenised": 40, "s_median_success": ok, "s_median_failure": bad, "successes": 15,
               "failures": 25, "accepted_successes": kept_ok, "accepted_failures": kept_bad}
        return {"source": src, "receiver": recv, "kept": 2, "candidates": 2, "received": rec, "no_balance": rec,
                "all": quiet}
    report = {"settings": st, "directions": {"a_to_b": direction("a", "b", 0.22, 0.45, 1, 9),
                                             "b_to_a": direction("b", "a", 0.83, 0.80, 4, 6)}}
    notes = preflight.notes(report)
    assert notes == ["A -> B: of the groups it would receive, the gate keeps 1 of 15 successes and 9 of 25 failures "
                     "(s median 0.22 vs 0.45): what reaches the update leans to the groups' negative advantages"]
    report["directions"]["a_to_b"]["received"]["accepted_successes"] = 8  # 8/15 kept > 9/25: no lean
    assert preflight.notes(report) == []
    report["directions"]["a_to_b"]["received"] |= {"accepted_successes": 0, "accepted_failures": 0}  # nothing kept
    assert preflight.notes(report) == []


def test_a_stopped_response_counts_as_ended_not_cut(tmp_path, monkeypatch):
    """With --stop, a row that a stop string ended has no EOS and is not cut at the cap: the report's split of
    s (ended / cut), its dropped-at-cap count and each model's shares say so, from each response's finish."""
    monkeypatch.setattr(verify, "verify_batch", planted_batch)
    prompts = write_prompts(tmp_path / "p.jsonl", 12)
    argv = args_for(tmp_path, prompts, "--stop", "}")
    argv[argv.index("--problems") + 1] = "6"
    report, sides = preflight.preflight(preflight.build_parser().parse_args(argv))
    for side in sides:
        recs = report["responses"]["a_to_b" if side.name == "a" else "b_to_a"]
        finish = [x["finish"] for x in recs]
        assert "stop" in finish, "the stop string should end some of the tiny models' responses"
        for x, toks in zip(recs, side.rollouts.tokens):
            assert (x["finish"] == "eos") == x["eos"]
            assert x["finish"] != "stop" or (x["text"].endswith("}") and not x["eos"])  # cut through the string
            assert x["finish"] != "length" or len(toks) == CAP
        sp = report["models"][side.name]["speed"]
        assert sp["stop_share"] == pytest.approx(finish.count("stop") / len(finish))
        st = report["directions"]["a_to_b" if side.name == "a" else "b_to_a"]["all"]
        assert st["ended"] == sum(f != "length" for f in finish)
        ended = [x["s"] for x in recs if x["s"] is not None and x["finish"] != "length"]
        cut = [x["s"] for x in recs if x["s"] is not None and x["finish"] == "length"]
        for key, xs in (("s_median_ended", ended), ("s_median_cut", cut)):
            assert st[key] == (pytest.approx(float(torch.tensor(xs).median())) if xs else None)


def test_screen_table_and_json_file(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(verify, "verify_batch", nobody_solves)
    prompts = write_prompts(tmp_path / "p.jsonl", 6)
    argv = args_for(tmp_path, prompts)
    argv[argv.index("--problems") + 1] = "3"
    assert graft.main(["preflight", *argv]) == 0
    text = capsys.readouterr().out
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["problems"] == 3 and report["directions"]["a_to_b"]["kept"] == 0
    assert report["directions"]["a_to_b"]["received"]["accepted_share"] is None
    assert "zero responses would be received" in text and "neither direction has a candidate" in text
    assert "every sampled response (cross-scores)" in text and "S1 -> S2" in text  # complement's table
    assert not list(tmp_path.glob("*.tmp*"))  # written atomically


def test_bad_input_messages(tmp_path):
    prompts = write_prompts(tmp_path / "p.jsonl", 4)
    (tmp_path / "empty_model").mkdir()
    with pytest.raises(SystemExit, match=r"--model '.*empty_model': a folder without config.json"):
        graft.main(["preflight", *args_for(tmp_path, prompts)[:2], "--model-b", str(tmp_path / "empty_model"),
              *args_for(tmp_path, prompts)[4:]])
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"id": "x", "problem": "1+1", "answer": "\\frac{1"}) + "\n")
    with pytest.raises(SystemExit, match=r"bad\.jsonl: no usable problem among 1 \(1 gold answers verify\.py cannot"):
        graft.main(["preflight", *args_for(tmp_path, bad)])
    with pytest.raises(SystemExit, match="--delta: must be in"):
        graft.main(["preflight", *args_for(tmp_path, prompts), "--delta", "2"])
    with pytest.raises(SystemExit, match="--deltas '0.5,x'"):
        graft.main(["preflight", *args_for(tmp_path, prompts), "--deltas", "0.5,x"])


def test_complement_json_is_the_printed_table(tmp_path, capsys):
    """`graft.py complement --json` writes the rows of the table it prints (the report preflight embeds)."""
    from tools import complement
    corrects = {"a": [[0] * 8, [1, 0, 0, 0, 0, 0, 0, 0], [1] * 8], "b": [[1, 1, 0, 0, 0, 0, 0, 0], [0] * 8, [0] * 8]}
    paths = []
    for name, rows in corrects.items():
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps({"model": name, "problems": {"t": [{"id": f"q{i}", "correct": c}
                                                                      for i, c in enumerate(rows)]}}))
        paths.append(str(path))
    assert graft.main(["complement", *paths, "--batch-size", "30", "--json", str(tmp_path / "c.json")]) == 0
    out = json.loads((tmp_path / "c.json").read_text())
    rows = {(r["src"], r["recv"]): r for r in out["rows"]}
    # by hand: a fails q0 (b mixed there), b fails q1 (a mixed) and q2 (a all-pass)
    assert rows[(1, 0)]["recv_all_fail"] == 1 and rows[(1, 0)]["mixed_share"] == 1.0
    assert rows[(0, 1)]["recv_all_fail"] == 2 and rows[(0, 1)]["mixed_share"] == 0.5
    assert rows[(0, 1)]["candidates_per_step"] == pytest.approx(10.0) and rows[(0, 1)]["m"] == pytest.approx(10.0)
    assert out["n"] == 8 and out["batch_size"] == 30 and [s["path"] for s in out["sources"]] == paths
    assert f"{10.0:>10.2f}" in capsys.readouterr().out
    assert complement.complement_json([], [{"x": float("nan")}], n=8, batch_size=1)["rows"] == [{"x": None}]


# ------------------------------------------------------------------------------------------------
# The retokenisation round trip (preflight.py choice 6; core.decodes_back, source_canonical)
# ------------------------------------------------------------------------------------------------


def test_round_trip_figures_recomputed_by_loops(run):
    """Each direction's round-trip figures by plain encode/decode loops, and one canonical lbar by a forward."""
    report, sides, _ = run
    for key, src, recv in (("a_to_b", sides[0], sides[1]), ("b_to_a", sides[1], sides[0])):
        rt, ro = report["directions"][key]["round_trip"], src.rollouts
        lost, alone, joint, stored, canon_lbar, own_lbar = [], 0, 0, 0, [], []
        for r, (text, toks) in enumerate(zip(ro.texts, ro.tokens)):
            ids = recv.tok.encode(text, add_special_tokens=False)
            ended = bool(ro.eos.view(-1)[r])
            if 0 < len(ids) + ended <= CAP and recv.tok.decode(ids, skip_special_tokens=True,
                                                                clean_up_tokenization_spaces=False) != text:
                lost.append(r)
            body = toks[:-1] if ended else toks
            own_text = src.tok.decode(body, skip_special_tokens=True, clean_up_tokenization_spaces=False)
            canon = src.tok.encode(own_text, add_special_tokens=False)
            alone += canon != body
            stored += src.tok.encode(text, add_special_tokens=False) != body
            prompt_text = src.tok.decode(src.prompt_ids[r // N], skip_special_tokens=False,
                                         clean_up_tokenization_spaces=False)
            head = src.tok.encode(prompt_text, add_special_tokens=False)
            joint += src.tok.encode(prompt_text + own_text, add_special_tokens=False) != head + body
            if canon != body and canon:  # the source's lbar of its canonical ids, by one forward at T = 1
                ids = canon + ([src.eos_id] if ended else [])
                prompt = src.prompt_ids[r // N]
                with torch.no_grad():
                    logits = src.model(torch.tensor([prompt + ids])).logits[0].float()
                lp = torch.log_softmax(logits, -1)[len(prompt) - 1: -1].gather(1, torch.tensor(ids)[:, None])
                canon_lbar.append(float(lp.mean()))
                own_lbar.append(float(ro.lbar("token").view(-1)[r]))
        assert (rt["lost"], rt["lost_index"], rt["alone"]["noncanonical"], rt["in_prompt"]["noncanonical"]) == (
            len(lost), lost, alone, joint)
        assert rt["responses"] == G * N and rt["alone"]["rescored"] == len(canon_lbar)
        assert rt["stored_text_differs"] == stored
        if canon_lbar:
            assert rt["alone"]["lbar_canonical"] == pytest.approx(sum(canon_lbar) / len(canon_lbar), abs=1e-4)
            assert rt["alone"]["lbar_own"] == pytest.approx(sum(own_lbar) / len(own_lbar), abs=1e-5)


def test_a_response_whose_round_trip_loses_text_is_dropped_and_counted(run):
    """README "Retokenisation": a response the receiver's tokenizer cannot write back (here a character outside
    the tiny vocabulary, encoded as <unk> and skipped on decode) is dropped, listed in Received.lost, and the
    trainer's step counts it in dropped_roundtrip."""
    from core import decodes_back, score_received
    _, sides, _ = run
    recv = sides[1]
    texts = ["12 + 3 = 15", "\u00e9 12", "7"]
    ids = recv.tok.encode(texts[1], add_special_tokens=False)
    assert not decodes_back(ids, texts[1], recv.tok) and decodes_back(recv.tok.encode(texts[0]), texts[0], recv.tok)
    got = score_received(texts, [True, True, False], torch.zeros(3), [recv.prompt_ids[0]] * 3, tokenizer=recv.tok,
                         eos_token_id=recv.eos_id, logprob_fn=recv.policy_logprobs, max_response_tokens=CAP)
    assert got.kept == [0, 2] and got.lost == [1]
    tr = receiver_trainer(recv, "a")
    peer = sides[0].rollouts
    saved = list(peer.texts)
    peer.texts[0], peer.texts[1] = texts[1], texts[1] + " 3"  # two planted losses in group 0
    try:
        out, dropped, counts = score_peer(tr.ctx, 0, peer, [0], tr.prompt_ids[:G])
    finally:
        peer.texts[:] = saved
    assert counts["dropped_roundtrip"] >= 2 and {x.slot for x in out}.isdisjoint({0, 1})


@pytest.mark.parametrize("static, budgeted", [("auto", True), ("on", True), ("off", False)])
def test_roll_out_passes_the_trainers_kv_budget(tmp_path, monkeypatch, static, budgeted):
    """sample() gets what Trainer.rollout passes it: runtime.kv_budget(device, model) unless --static-decode is off
    (the budget a planted figure here, so that the test sees where it went; the sampler on the CPU ignores it)."""
    monkeypatch.setattr(verify, "verify_batch", nobody_solves)
    asked, given = [], []
    monkeypatch.setattr(preflight, "kv_budget", lambda device, model: asked.append((device, model)) or 123_456_789)
    real = preflight.sample

    def spy(model, prompts, **kw):
        given.append((model, kw["max_cache_bytes"]))
        return real(model, prompts, **kw | {"static": "off"})  # the CPU: the default path (static on is GPU-bound)

    monkeypatch.setattr(preflight, "sample", spy)
    argv = args_for(tmp_path, write_prompts(tmp_path / "p.jsonl", 8), "--static-decode", static)
    argv[argv.index("--problems") + 1] = "4"
    _, sides = preflight.preflight(preflight.build_parser().parse_args(argv))
    models = [s.model for s in sides]
    assert [m for m, _ in given] == models  # one rollout per side
    if budgeted:
        assert [b for _, b in given] == [123_456_789] * 2
        assert [(d.type, m) for d, m in asked] == [("cpu", m) for m in models]  # each side's own device and model
    else:
        assert [b for _, b in given] == [None, None] and asked == []
