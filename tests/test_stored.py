"""Tests of the tools beside the online pair: complement.py (complementarity against hand-computed tables and
subset enumeration on planted rollout files and eval results) and foreign.py (foreign trajectories on planted
JSONL files: matching, grouping, re-verification, core.masked_group_advantages against group_advantages, the
per-step view, lbar by a tiny model against a naive forward, and its cache).

Run: python -m pytest -q tests/test_stored.py
"""

import io
import itertools
import json
import math
from contextlib import redirect_stdout
from pathlib import Path

import pytest
import torch

from tools import complement
import foreign
from bench.foreign import bench_foreign
from exchange import StepRollouts, file_sha256, save_rollouts
from tools.complement import (align, complement_rows, complementarity, pair_complementarity, prob_all_fail,
                              prob_all_pass, read_eval_results, read_rollout_folder)
from foreign import load_foreign_log, match_records, normalise_problem, read_foreign_records
from config import Config
from core import compatibility_scores, graft_candidates, group_advantages, masked_group_advantages, success_counts

torch.set_num_threads(1)
ROOT = Path(__file__).resolve().parent.parent  # the repository root
TINY_A = ROOT / "data" / "tiny_models" / "A"

# ------------------------------------------------------------------------------------------------
# Complementarity: the core
# ------------------------------------------------------------------------------------------------


def test_probabilities_are_indicators_when_samples_equal_n():
    k = torch.tensor([0, 1, 7, 8])
    assert prob_all_fail(k, n=8).tolist() == [1.0, 0.0, 0.0, 0.0]
    assert prob_all_pass(k, 8, n=8).tolist() == [0.0, 0.0, 0.0, 1.0]


def test_probabilities_match_subset_enumeration():
    # N = 6 samples with k successes; the share of the C(6, n) subsets of size n that are all 0 / all 1
    for n in (2, 3, 4):
        for k in range(7):
            samples = [1] * k + [0] * (6 - k)
            subsets = list(itertools.combinations(samples, n))
            fail = sum(1 for s in subsets if sum(s) == 0) / len(subsets)
            pas = sum(1 for s in subsets if sum(s) == n) / len(subsets)
            assert abs(float(prob_all_fail(torch.tensor([k]), 6, n=n)[0]) - fail) < 1e-12
            assert abs(float(prob_all_pass(torch.tensor([k]), 6, n=n)[0]) - pas) < 1e-12


def test_fewer_samples_than_n_is_an_error():
    with pytest.raises(ValueError, match="fewer than n=8"):
        prob_all_fail(torch.tensor([0, 1]), torch.tensor([8, 4]), n=8)


# Ten prompts, n = 4. Receiver (R) fails all on prompts 0,1,2,3,4,8 (6 prompts). Source (S) there:
# 0 -> 0 (fails), 1 -> 1, 2 -> 3, 4 -> 2 (mixed: 3), 3 -> 4, 8 -> 4 (all pass): mixed 3/6, solves 5/6.
# Candidates S -> R: 3 of 10 prompts, 0.3 x 128 = 38.4 per step. Reverse: S fails all on 0, 5, 6; R there
# 0, 1, 2: mixed 2/3, solves 2/3, candidates 2/10 x 128 = 25.6. Balanced m = 25.6.
K_R = torch.tensor([0, 0, 0, 0, 0, 1, 2, 4, 0, 3])
K_S = torch.tensor([0, 1, 3, 4, 2, 0, 0, 4, 4, 1])


def test_complementarity_hand_computed():
    c = complementarity(k_recv=K_R, k_src=K_S, n=4, batch_size=128)
    assert c["prompts"] == 10 and c["recv_all_fail"] == 6
    assert c["mixed_share"] == pytest.approx(0.5) and c["solved_share"] == pytest.approx(5 / 6)
    assert c["candidate_frac"] == pytest.approx(0.3) and c["candidates_per_step"] == pytest.approx(38.4)
    # the same candidates as the trainer's own rule (Eq. 4)
    assert int(graft_candidates(k_recv=K_R, k_src=K_S, n=4).sum()) == 3
    pair = pair_complementarity(k_a=K_S, k_b=K_R, n=4, batch_size=128)  # a = S, b = R: a_to_b = S -> R
    assert pair["a_to_b"]["candidates_per_step"] == pytest.approx(38.4)
    ba = pair["b_to_a"]
    assert ba["mixed_share"] == pytest.approx(2 / 3) and ba["solved_share"] == pytest.approx(2 / 3)
    assert ba["candidates_per_step"] == pytest.approx(25.6) and pair["m"] == pytest.approx(25.6)


def test_complementarity_with_more_samples_than_n():
    # R: 1 of 8 correct -> P(4 fail) = C(7,4)/C(8,4) = 35/70. S: 4 of 8 -> P(all fail) = P(all pass) = 1/70.
    c = complementarity(k_recv=torch.tensor([1]), k_src=torch.tensor([4]), n=4, batch_size=10, samples_recv=8,
                        samples_src=8)
    assert c["recv_all_fail"] == pytest.approx(0.5)
    assert c["mixed_share"] == pytest.approx(68 / 70) and c["solved_share"] == pytest.approx(69 / 70)
    assert c["candidates_per_step"] == pytest.approx(10 * 0.5 * 68 / 70)


def test_receiver_that_fails_nothing_gives_nan_shares():
    c = complementarity(k_recv=torch.tensor([1, 2]), k_src=torch.tensor([0, 1]), n=4, batch_size=8)
    assert math.isnan(c["mixed_share"]) and c["candidates_per_step"] == 0.0


# ------------------------------------------------------------------------------------------------
# Complementarity: planted rollout folders and eval files
# ------------------------------------------------------------------------------------------------


def write_steps(folder: Path, steps: list[tuple[list[str], list[list[int]]]], n: int, seed: int = 0):
    """Real rollout files: step t holds prompts ids with rewards rows (each a 0/1 list of length n)."""
    for t, (ids, rewards) in enumerate(steps):
        G = len(ids)
        r = torch.tensor(rewards, dtype=torch.float32)  # (G, n)
        rollouts = StepRollouts(prompt_ids=ids, tokens=[[5, 6]] * (G * n),
                                logprobs=[torch.tensor([-0.5, -1.0])] * (G * n), texts=["x"] * (G * n),
                                eos=torch.ones(G, n, dtype=torch.bool), rewards=r, advantages=group_advantages(r))
        save_rollouts(folder / f"step_{t:06d}.safetensors", rollouts, {"step": t, "data_seed": seed, "model": "m"})


def row_with(k: int, n: int) -> list[int]:
    return [1] * k + [0] * (n - k)


def planted_pair(tmp_path: Path, n: int = 4):
    """Two sources over two steps of 5 prompts; prompt p0 appears at both steps (p0..p4, then p0, p5..p8)."""
    ids = [[f"p{i}" for i in range(5)], ["p0", "p5", "p6", "p7", "p8"]]
    k_a = [[0, 2, 4, 1, 0], [2, 3, 0, 0, 1]]  # A: p0 0/4 then 2/4
    k_b = [[1, 0, 0, 4, 3], [1, 0, 2, 4, 0]]  # B: p0 1/4 then 1/4
    write_steps(tmp_path / "a", [(ids[t], [row_with(k, n) for k in k_a[t]]) for t in range(2)], n)
    write_steps(tmp_path / "b", [(ids[t], [row_with(k, n) for k in k_b[t]]) for t in range(2)], n)
    return tmp_path / "a", tmp_path / "b"


def test_read_rollout_folder_union_and_latest(tmp_path):
    a, _ = planted_pair(tmp_path)
    union = read_rollout_folder(a).counts
    assert union["p0"] == (2, 8) and union["p1"] == (2, 4) and union["p8"] == (1, 4) and len(union) == 9
    latest = read_rollout_folder(a, aggregate="latest").counts
    assert latest["p0"] == (2, 4) and latest["p1"] == (2, 4)


def test_read_rewards_agrees_with_load_rollouts_and_checks(tmp_path):
    from exchange import load_rollouts, read_rewards
    a, _ = planted_pair(tmp_path)
    f = a / "step_000001.safetensors"
    ids, rewards, meta = read_rewards(f)
    full, _ = load_rollouts(f)
    assert ids == full.prompt_ids == ["p0", "p5", "p6", "p7", "p8"] and torch.equal(rewards, full.rewards)
    assert meta["n"] == "4"
    bad = tmp_path / "bad" / "step_000000.safetensors"
    bad.parent.mkdir()
    bad.write_bytes(f.read_bytes()[:100])
    with pytest.raises(ValueError, match=r"step_000000.safetensors: not a readable rollout file"):
        read_rollout_folder(bad.parent)
    from safetensors.torch import save_file
    save_file({"rewards": torch.zeros(1, 2), "prompt_ids": torch.zeros(1, dtype=torch.uint8),
               "prompt_id_offsets": torch.tensor([0, 1])}, str(bad), metadata={"format": "other"})
    with pytest.raises(ValueError, match="not a GRAFT rollout file"):
        read_rewards(bad)
    save_file({"rewards": torch.zeros(1, 2)}, str(bad), metadata={"format": "graft-rollouts", "version": "1"})
    with pytest.raises(ValueError, match=r"missing tensors \['prompt_ids', 'prompt_id_offsets'\]"):
        read_rewards(bad)


def test_complement_table_on_planted_folders(tmp_path, capsys):
    a, b = planted_pair(tmp_path)
    # latest: A k = p0 2, p1 2, p2 4, p3 1, p4 0, p5 3, p6 0, p7 0, p8 1
    #         B k = p0 1, p1 0, p2 0, p3 4, p4 3, p5 0, p6 2, p7 4, p8 0
    # A -> B (B receives): B all-fail on p1, p2, p5, p8 (4); A there 2, 4, 3, 1: mixed 3/4, solves 4/4;
    #   candidates 3 of 9 prompts, x 18 = 6 per step.
    # B -> A: A all-fail on p4, p6, p7 (3); B there 3, 2, 4: mixed 2/3, solves 3/3; 2 of 9 x 18 = 4. m = 4.
    complement.main([str(a), str(b), "--n", "4", "--batch-size", "18", "--aggregate", "latest"])
    out = capsys.readouterr().out
    line_ab = next(x for x in out.splitlines() if x.startswith("S1 -> S2"))
    line_ba = next(x for x in out.splitlines() if x.startswith("S2 -> S1"))
    assert line_ab.split() == ["S1", "->", "S2", "9", "4", "(44.4%)", "75.0%", "100.0%", "6.00", "4.00", "4.00"]
    assert line_ba.split() == ["S2", "->", "S1", "9", "3", "(33.3%)", "66.7%", "100.0%", "4.00", "6.00", "4.00"]


def test_union_aggregation_uses_all_rollouts(tmp_path):
    a, b = planted_pair(tmp_path)
    sa, sb = read_rollout_folder(a), read_rollout_folder(b)
    ids, k_a, n_a, k_b, n_b = align(sa, sb)
    assert ids[0] == "p0" and (k_a[0], n_a[0], k_b[0], n_b[0]) == (2, 8, 2, 8)
    rows = complement_rows([sa, sb], n=4, batch_size=18)
    # p0 under union: B fails all 4 with prob C(6,4)/C(8,4) = 15/70; A (2 of 8) mixed with prob 1 - 15/70 - 0.
    # The other B all-fail prompts are as in the latest table (p1, p2, p5, p8; A mixed on p1, p5, p8).
    ab = rows[0]
    assert ab["recv_all_fail"] == pytest.approx(4 + 15 / 70)
    assert ab["mixed_share"] == pytest.approx((3 + 15 / 70 * 55 / 70) / (4 + 15 / 70))
    assert ab["candidates_per_step"] == pytest.approx(18 * (3 + 15 / 70 * 55 / 70) / 9)


def eval_payload(per_bench: dict[str, list[tuple[str, list[float]]]]) -> dict:
    """The JSON that graft.run_eval writes (model, settings, benchmarks, mean, problems)."""
    problems = {b: [{"id": i, "answer": "1", "correct": c} for i, c in rows] for b, rows in per_bench.items()}
    return {"model": "m", "settings": {"samples": 4}, "benchmarks": {}, "mean": 0.0, "problems": problems}


def test_eval_files_and_mixed_sources(tmp_path):
    ea = tmp_path / "a.json"
    eb = tmp_path / "b.json"
    ea.write_text(json.dumps(eval_payload({"m500": [("q1", [0, 0, 0, 0]), ("q2", [1, 0, 1, 0])],
                                           "aime": [("q3", [0, 0, 0, 0])]})))
    eb.write_text(json.dumps(eval_payload({"m500": [("q1", [1, 1, 0, 0]), ("q2", [0, 0, 0, 0]), ("q9", [1, 1, 1, 1])],
                                           "aime": [("q3", [1, 1, 1, 1])]})))
    sa, sb = read_eval_results(ea), read_eval_results(eb)
    assert sa.counts == {"q1": (0, 4), "q2": (2, 4), "q3": (0, 4)}
    rows = complement_rows([sa, sb], n=4, batch_size=3)
    # B -> A: A fails q1, q3; B mixed on q1 only, solves both: 1/2, 2/2; 1 of 3 common prompts x 3 = 1.
    ba = rows[1]
    assert (ba["src"], ba["recv"], ba["prompts"]) == (1, 0, 3)
    assert ba["mixed_share"] == pytest.approx(0.5) and ba["solved_share"] == pytest.approx(1.0)
    assert ba["candidates_per_step"] == pytest.approx(1.0) and ba["reverse"] == pytest.approx(1.0) and ba["m"] == 1.0
    # with an eval of 4 samples, n = 8 is refused (the statistic would be extrapolated)
    with pytest.raises(ValueError, match="fewer than n=8"):
        complement_rows([sa, sb], n=8, batch_size=3)


def test_rollout_folder_against_eval_file_and_no_common_prompts(tmp_path, capsys):
    a, _ = planted_pair(tmp_path)
    ev = tmp_path / "e.json"
    ev.write_text(json.dumps(eval_payload({"train": [("zz", [1, 0, 0, 0])]})))
    complement.main([str(a), str(ev), "--n", "4"])
    out = capsys.readouterr().out
    assert "S1 -> S2                    0   no prompt in common" in out


def test_eval_file_errors_name_the_file(tmp_path):
    dup = tmp_path / "dup.json"
    dup.write_text(json.dumps(eval_payload({"x": [("q1", [1.0])], "y": [("q1", [0.0])]})))
    with pytest.raises(ValueError, match=r"dup.json: id 'q1' appears in both 'x' and 'y'"):
        read_eval_results(dup)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(eval_payload({"x": [("q1", [])]})))
    with pytest.raises(ValueError, match=r"bad.json: problems\['x'\]\[0\] needs"):
        read_eval_results(bad)
    (tmp_path / "run" / "exchange" / "a").mkdir(parents=True)
    write_steps(tmp_path / "run" / "exchange" / "a", [(["p"], [[1, 0]])], 2)
    with pytest.raises(ValueError, match=r"run: no step_\*.safetensors rollout files; folders below it that have "
                                         r"some: .*run/exchange/a$"):
        read_rollout_folder(tmp_path / "run")
    with pytest.raises(SystemExit, match="at least two sources"):
        complement.main([str(dup)])


# ------------------------------------------------------------------------------------------------
# Foreign trajectories: records, matching, groups, rewards, advantages
# ------------------------------------------------------------------------------------------------

PROMPTS = [
    {"id": "p1", "problem": "What is 1+1?", "answer": "2"},
    {"id": "p2", "problem": "Compute  3 x 3.", "answer": "9"},
    {"id": "p3", "problem": "Same text", "answer": "1"},
    {"id": "p4", "problem": "Same  text", "answer": "1"},  # normalises like p3: ambiguous
    {"id": "p5", "problem": "Solve x+1=3.", "answer": "2"},
]


def boxed(a: str) -> str:
    return f"The answer is $\\boxed{{{a}}}$."


def write_jsonl(path: Path, objs: list) -> Path:
    path.write_text("".join((o if isinstance(o, str) else json.dumps(o)) + "\n" for o in objs), encoding="utf-8")
    return path


@pytest.mark.parametrize("line,msg", [
    ("{not json", "invalid JSON"),
    ("[1, 2]", "expected a JSON object, got list"),
    (json.dumps({"response": "r"}), "needs a problem id"),
    (json.dumps({"id": "p1"}), "response or completion must be a string"),
    (json.dumps({"id": 3.5, "response": "r"}), "must be a non-empty string or an integer"),
    (json.dumps({"problem": "  ", "response": "r"}), "('problem', 'question') must be a non-empty string"),
    (json.dumps({"id": "p1", "response": "r", "lbar": 0.3}), "must be a finite number in [-88, 0]"),
    (json.dumps({"id": "p1", "response": "r", "lbar": "x"}), "must be a finite number in [-88, 0]"),
    # finite in float64 but -inf in float32 (s = inf, w = 1), and finite in float32 but overflowing s
    (json.dumps({"id": "p1", "response": "r", "lbar": -1e39}), "must be a finite number in [-88, 0]"),
    (json.dumps({"id": "p1", "response": "r", "lbar": -1e30}), "must be a finite number in [-88, 0]"),
    ('{"id": "p1", "response": "r", "lbar": NaN}', "must be a finite number in [-88, 0]"),
    (json.dumps({"id": "p1", "response": "r", "eos": 1}), "'eos' must be true or false"),
    (json.dumps({"id": "p1", "response": "r", "reward": "yes"}), "'reward' must be a number"),
    (json.dumps({"id": "p1", "response": "r", "num_tokens": 0}), "'num_tokens' must be an integer >= 1"),
])
def test_bad_records_name_file_and_line(tmp_path, line, msg):
    path = write_jsonl(tmp_path / "f.jsonl", [{"id": "p1", "response": "ok"}, "", line])
    with pytest.raises(ValueError) as e:
        read_foreign_records(path)
    assert str(e.value).startswith(f"{path}:3: ") and msg in str(e.value)


def test_normalisation_whitespace_nfkc_but_not_case():
    assert normalise_problem("  What\u00a0is\n\t1+1? ") == "What is 1+1?"
    assert normalise_problem("\uff11+\uff11") == "1+1"  # full-width digits (NFKC)
    assert normalise_problem("Solve X") != normalise_problem("solve x")


def test_matching_counts(tmp_path):
    path = write_jsonl(tmp_path / "f.jsonl", [
        {"problem_id": "p1", "response": "a"},                      # by id
        {"id": 7, "problem": " What is\n1+1? ", "response": "b"},   # unknown id -> by text (p1)
        {"problem": "Compute 3 x 3.", "response": "c"},             # by text (p2)
        {"problem": "Same text", "response": "d"},                  # ambiguous (p3 / p4)
        {"id": "p2", "problem": "What is 1+1?", "response": "e"},   # id/text conflict -> by text (p1)
        {"problem": "what is 1+1?", "response": "f"},               # case differs: unmatched
        {"id": "zzz", "response": "g"},                             # unmatched
    ])
    hits, c = match_records(read_foreign_records(path), PROMPTS)
    assert hits == ["p1", "p1", "p2", None, "p1", None, None]
    assert (c.by_id, c.by_text, c.unmatched, c.ambiguous, c.id_conflicts) == (1, 3, 3, 1, 1)
    assert c.unmatched_lines == [4, 6, 7]


def test_load_groups_verify_and_advantages(tmp_path):
    path = write_jsonl(tmp_path / "f.jsonl", [
        {"id": "p1", "response": boxed("2"), "lbar": -0.5, "reward": 0},  # verified 1: disagrees with file
        {"id": "p2", "response": boxed("9"), "lbar": -0.2},
        {"id": "p1", "response": boxed("3"), "lbar": -0.7, "reward": False},
        {"id": "p1", "response": "no box: 2", "lbar": -0.1, "eos": False},  # strict verifier: 0
        {"id": "p2", "response": boxed("8"), "lbar": -0.3},
        {"id": "p2", "response": "Twice: " + boxed("9"), "lbar": -0.4},
        {"id": "p2", "response": "So " + boxed("9"), "lbar": -0.6, "reward": 1},
        {"id": "p5", "response": boxed("2"), "lbar": -0.9},  # single record: dropped
        {"id": "nope", "response": boxed("2")},  # unmatched
    ])
    log = load_foreign_log(path, PROMPTS)
    assert log.prompt_ids == ["p1", "p2"] and log.width == 4
    assert log.mask.tolist() == [[True, True, True, False], [True] * 4]
    assert log.rewards.tolist() == [[1, 0, 0, 0], [1, 0, 1, 1]]
    assert log.lines.tolist() == [[1, 3, 4, 0], [2, 5, 6, 7]]
    assert log.counts["singletons"] == 1 and log.counts["unmatched"] == 1
    assert log.counts["reward_disagreements"] == 1
    # advantages: each group alone through graft.group_advantages
    torch.testing.assert_close(log.advantages[0, :3], group_advantages(torch.tensor([[1.0, 0, 0]]))[0])
    torch.testing.assert_close(log.advantages[1], group_advantages(torch.tensor([[1.0, 0, 1, 1]]))[0])
    assert log.advantages[0, 3] == 0
    report = log.report()
    assert "9 records; matched 8 by id, 0 by problem text; unmatched 1" in report
    assert "dropped 1 single-record prompts; 2 groups mixed" in report and "1 differ" in report


def test_the_report_counts_mixed_groups_as_the_selection_does(tmp_path):
    """"Mixed" in the load report is Eq. 4's (success_counts: reward >= 0.5), not a sum of rewards: with a reward
    that pays 0.4 to a boxed answer and 0.9 to a right one, a group of four 0.4s sums to 1.6 but has no success,
    and a group with one right answer is mixed."""
    (tmp_path / "partial.py").write_text(
        "def partial(responses, golds, *, workers=0):\n"
        "    return [0.9 if r.endswith('{' + g + '}$.') else 0.4 if 'boxed' in r else 0.0\n"
        "            for r, g in zip(responses, golds)]\n")
    path = write_jsonl(tmp_path / "f.jsonl", [{"id": "p1", "response": f"Try {i}: " + boxed("7")} for i in range(4)]
                       + [{"id": "p2", "response": f"Try {i}: " + boxed(a)} for i, a in enumerate("9888")])
    log = load_foreign_log(path, PROMPTS, reward=f"{tmp_path / 'partial.py'}:partial")
    torch.testing.assert_close(log.rewards, torch.tensor([[0.4] * 4, [0.9, 0.4, 0.4, 0.4]]))  # golds 2 and 9
    assert "2 prompt groups" in log.report() and "1 groups mixed" in log.report()


def test_nothing_usable_is_an_error(tmp_path):
    path = write_jsonl(tmp_path / "f.jsonl", [{"id": "p1", "response": "a"}, {"id": "x", "response": "b"}])
    with pytest.raises(ValueError, match="no prompt of the run has two or more matched records"):
        load_foreign_log(path, PROMPTS)


def test_masked_group_advantages_against_naive_loop():
    g = torch.Generator().manual_seed(0)
    r = (torch.rand(40, 7, generator=g) < 0.4).float()
    full = torch.ones(40, 7, dtype=torch.bool)
    torch.testing.assert_close(masked_group_advantages(r, full), group_advantages(r))
    torch.testing.assert_close(masked_group_advantages(r, full, std_normalize=False),
                               group_advantages(r, std_normalize=False))
    sizes = torch.randint(1, 8, (40,), generator=g)
    mask = torch.arange(7)[None] < sizes[:, None]
    a = masked_group_advantages(r, mask)
    for p in range(40):
        s = int(sizes[p])
        xs = r[p, :s].tolist()
        mu = sum(xs) / s
        sd = math.sqrt(sum((x - mu) ** 2 for x in xs) / (s - 1)) if s > 1 else 0.0
        for i in range(7):
            want = 0.0 if i >= s or sd == 0 else (xs[i] - mu) / (sd + 1e-6)
            assert abs(float(a[p, i]) - want) < 1e-5


def test_step_view_layout_and_candidates(tmp_path):
    path = write_jsonl(tmp_path / "f.jsonl", [
        {"id": "p1", "response": boxed("2"), "lbar": -0.5, "num_tokens": 4},
        {"id": "p1", "response": boxed("5"), "lbar": -0.25, "num_tokens": 2},
        {"id": "p2", "response": boxed("9"), "lbar": -1.0, "num_tokens": 10},
        {"id": "p2", "response": boxed("9") + " ", "lbar": -2.0, "num_tokens": 3},
        {"id": "p2", "response": boxed("9") + "  ", "lbar": -3.0, "num_tokens": 1},
    ])
    log = load_foreign_log(path, PROMPTS)
    st = log.step(["p5", "p2", "p1"])  # p5 has no group
    assert st.width == 3 and st.sizes.tolist() == [0, 3, 2]
    assert st.texts[:3] == [""] * 3 and st.texts[3:6] == [boxed("9"), boxed("9") + " ", boxed("9") + "  "]
    assert st.texts[6:9] == [boxed("2"), boxed("5"), ""]
    assert st.rewards.tolist() == [[0, 0, 0], [1, 1, 1], [1, 0, 0]]
    assert st.mask.tolist() == [[False] * 3, [True] * 3, [True, True, False]]
    assert st.eos.tolist() == [[False] * 3, [True] * 3, [True, True, False]]
    torch.testing.assert_close(st.lbar("token"), torch.tensor([[0, 0, 0], [-1.0, -2.0, -3.0], [-0.5, -0.25, 0]]))
    nb = torch.tensor([len((boxed("9") + pad).encode()) for pad in ("", " ", "  ")])
    torch.testing.assert_close(st.lbar("byte")[1], torch.tensor([-10.0, -6.0, -3.0]) / nb)
    # the trainer's candidate rule with per-prompt sizes: receiver fails p5, p2 and p1; only p1 is mixed
    k_own = torch.tensor([0, 0, 0])
    k_log = success_counts(st.rewards, mask=st.mask)
    assert graft_candidates(k_recv=k_own, k_src=k_log, n=st.sizes).tolist() == [False, False, True]


def test_lbar_at_the_floor_gives_a_finite_score():
    s = compatibility_scores(lbar_recv=torch.tensor([0.0]),
                             lbar_src=torch.tensor([foreign.LBAR_MIN]))
    assert bool(torch.isfinite(s).all())


def test_repeated_records_are_removed_and_counted(tmp_path):
    """One group repeated six times (by id and by text) counts once: the same group, advantages and report."""
    group = [{"id": "p1", "response": boxed("2"), "lbar": -0.5}, {"id": "p1", "response": boxed("3"), "lbar": -0.4},
             {"id": "p2", "response": boxed("9"), "lbar": -0.2}, {"id": "p2", "response": "no box", "lbar": -0.3}]
    once = load_foreign_log(write_jsonl(tmp_path / "once.jsonl", group), PROMPTS)
    by_text = [{"problem": "What is 1+1?", "response": boxed("2"), "lbar": -0.9}]  # p1 again, by text
    path = write_jsonl(tmp_path / "six.jsonl", group * 6 + by_text)
    six = load_foreign_log(path, PROMPTS)
    assert six.counts["duplicates"] == 5 * len(group) + 1 and six.counts["duplicate_lines"] == [5, 6, 7, 8, 9]
    assert six.prompt_ids == once.prompt_ids and six.texts == once.texts
    torch.testing.assert_close(six.advantages, once.advantages)
    torch.testing.assert_close(six.mean_logprob, once.mean_logprob)  # the first record of each repeat is kept
    assert "21 repeats of an earlier record" in six.report() and "first on lines [5, 6, 7, 8, 9]" in six.report()


def test_overlong_responses_are_dropped_before_verification_and_scoring(tmp_path, monkeypatch):
    """A response over the character bound never reaches the verifier nor a --peer-model forward."""
    import verify
    seen = []
    real = verify.verify_batch
    monkeypatch.setattr(verify, "verify_batch", lambda rs, gs, **kw: seen.extend(rs) or real(rs, gs, **kw))
    huge = "x" * 10_000 + boxed("2")
    path = write_jsonl(tmp_path / "f.jsonl", [
        {"id": "p1", "response": boxed("2")}, {"id": "p1", "response": huge}, {"id": "p1", "response": boxed("5")},
        {"id": "p2", "response": boxed("9")}, {"id": "p2", "response": "no box"}])
    log = load_foreign_log(path, PROMPTS, max_response_chars=foreign.response_char_bound(64, max_token_chars=4))
    assert foreign.response_char_bound(64, max_token_chars=4) == 256
    assert log.counts["too_long"] == 1 and log.counts["too_long_lines"] == [2]
    assert huge not in seen and len(seen) == 4
    assert log.missing_lbar("token") == [1, 3, 4, 5]  # what --peer-model would score: not line 2
    assert "dropped 1 longer than 256 characters (first on lines [2])" in log.report()
    assert load_foreign_log(path, PROMPTS).counts["too_long"] == 0  # no bound given: kept


def test_the_trainer_applies_its_response_bound_when_it_opens_a_foreign_log(tmp_path, capsys):
    """open_peer_log (what the trainer calls at start) passes response_char_bound(--max-response-tokens):
    with --max-response-tokens 2 the bound is 256 characters, so the 300-character response is dropped."""
    from runtime import DistInfo
    path = write_jsonl(tmp_path / "f.jsonl", [
        {"id": "p1", "response": boxed("2"), "lbar": -0.5}, {"id": "p1", "response": "y" * 300, "lbar": -0.5},
        {"id": "p1", "response": boxed("5"), "lbar": -0.5}])
    cfg = Config(model="unused", peer_log=str(path), max_response_tokens=2)
    log = foreign.open_peer_log(cfg, PROMPTS, DistInfo(), start_step=0)  # the peer source: a ForeignLog
    assert isinstance(log, foreign.ForeignLog) and not log.both_ways
    assert log.counts["too_long"] == 1 and log.counts["too_long_lines"] == [2]
    assert "dropped 1 longer than 256 characters" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="--peer-log 'nowhere': no such folder of rollout files or JSONL file"):
        foreign.open_peer_log(Config(model="unused", peer_log="nowhere"), PROMPTS, DistInfo(), start_step=0)


def test_require_lbar_names_the_line(tmp_path):
    path = write_jsonl(tmp_path / "f.jsonl", [
        {"id": "p1", "response": "a", "lbar": -0.5}, {"id": "p1", "response": "b"},
        {"id": "p2", "response": "c", "lbar": -0.5}, {"id": "p2", "response": "d", "lbar": -0.5},
    ])
    log = load_foreign_log(path, PROMPTS)
    with pytest.raises(ValueError, match=r"f\.jsonl:2: no lbar on 1 used records"):
        log.require_lbar("token")
    assert log.missing_lbar("byte") == [1, 2, 3, 4]  # nobody gave num_tokens
    with pytest.raises(AssertionError, match="no lbar"):
        log.step(["p1"]).lbar("token")


# ------------------------------------------------------------------------------------------------
# Foreign trajectories: lbar by a tiny model, and its cache
# ------------------------------------------------------------------------------------------------


@pytest.mark.skipif(not (TINY_A / "model.safetensors").is_file(),
                    reason="data/tiny_models/A (the committed tiny model) is absent")
def test_fill_lbar_matches_naive_forward_and_caches(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained(TINY_A).float()
    tok = AutoTokenizer.from_pretrained(TINY_A)
    prompts = [{"id": "a", "problem": "12+30", "answer": "42"}, {"id": "b", "problem": "7*6", "answer": "42"}]
    recs = [{"id": "a", "response": "12+30=42 \\boxed{42}"}, {"id": "a", "response": "\\boxed{41}", "eos": False},
            {"id": "b", "response": "7*6=42 \\boxed{42}", "lbar": -0.123}, {"id": "b", "response": "\\boxed{13}"}]
    path = write_jsonl(tmp_path / "f.jsonl", recs)
    encode = lambda problem: tok.encode(problem + "\n", add_special_tokens=True)  # noqa: E731
    problems = {p["id"]: p["problem"] for p in prompts}

    log = load_foreign_log(path, prompts)
    info = foreign.fill_lbar(log, model, tok, model_path=str(TINY_A), encode_prompt=encode, problems=problems,
                             cache_key="tmpl", batch_size=2)
    assert info["computed"] == 3 and info["cached"] == 0 and Path(info["cache"]).parent == tmp_path
    # naive: one full forward per record, log-softmax at T = 1, mean over the response tokens (+ EOS if eos)
    slots = [(0, 0), (0, 1), (1, 1)]
    for (p, i), (prob, rec) in zip(slots, [("12+30", recs[0]), ("12+30", recs[1]), ("7*6", recs[3])]):
        prompt = encode(prob)
        eos = [tok.eos_token_id] if rec.get("eos", True) else []
        resp = tok.encode(rec["response"], add_special_tokens=False) + eos
        with torch.no_grad():
            logits = model(torch.tensor([prompt + resp])).logits[0].float()
        lp = torch.log_softmax(logits, -1)[len(prompt) - 1: -1].gather(1, torch.tensor(resp)[:, None]).squeeze(1)
        assert abs(float(log.mean_logprob[p, i]) - float(lp.mean())) < 1e-4
        assert int(log.num_tokens[p, i]) == len(resp)
    assert float(log.mean_logprob[1, 0]) == pytest.approx(-0.123)  # given in the file: kept
    log.require_lbar("token")

    # a second load reads the cache (no model call: a model that raises proves it)
    class Boom(torch.nn.Module):
        def forward(self, *a, **k):
            raise AssertionError("the cache should have answered")
    log2 = load_foreign_log(path, prompts)
    info2 = foreign.fill_lbar(log2, Boom(), tok, model_path=str(TINY_A), encode_prompt=encode, problems=problems,
                              cache_key="tmpl")
    assert info2 == {"computed": 0, "cached": 3, "cache": info["cache"]}
    torch.testing.assert_close(log2.mean_logprob, log.mean_logprob)
    # a damaged cache is recomputed, not trusted
    Path(info["cache"]).write_text("{not json")
    log4 = load_foreign_log(path, prompts)
    info4 = foreign.fill_lbar(log4, model, tok, model_path=str(TINY_A), encode_prompt=encode, problems=problems,
                              cache_key="tmpl")
    assert info4["computed"] == 3
    torch.testing.assert_close(log4.mean_logprob, log.mean_logprob)
    # another model path or an edited file is another cache
    other = foreign.lbar_cache_path(path, file_hash=file_sha256(path), model_path="other", cache_key="tmpl")
    assert other != Path(info["cache"])
    write_jsonl(path, recs + [{"id": "b", "response": "\\boxed{42}"}])
    log3 = load_foreign_log(path, prompts)
    info3 = foreign.fill_lbar(log3, model, tok, model_path=str(TINY_A), encode_prompt=encode, problems=problems,
                              cache_key="tmpl")
    assert info3["computed"] == 4 and info3["cache"] != info["cache"]


def test_bench_foreign_planted_file_counts(tmp_path):
    prompts = [{"id": f"q{i}", "problem": f"Problem number {i}: add {i} and {i}.", "answer": str(2 * i)}
               for i in range(50)]
    out = io.StringIO()
    with redirect_stdout(out):
        bench_foreign(prompts, records=100, group=5, folder=tmp_path)
    text = out.getvalue()
    # 20 groups of 5: groups 9 and 19 are not in the run; odd groups by text, even by id; 1 in 3 wrong
    assert "100 records; matched 50 by id, 40 by problem text; unmatched 10" in text
    assert "18 prompt groups (sizes 5-5" in text and "0 differ from the file's reward" in text


def test_foreign_responses_are_cut_at_stop_strings(tmp_path):
    # --stop (foreign.py choice 5): a response that holds a stop string keeps its text through the first one
    # (eos false, its given lbar dropped: it described text that is gone), the verifier reads it cut before the
    # string; responses without one are untouched. Without stop strings the same file reads as before.
    path = write_jsonl(tmp_path / "f.jsonl", [
        {"id": "p1", "response": boxed("2") + "\n\nQ: " + boxed("5"), "lbar": -0.5},  # cut: verified on "\boxed{2}"
        {"id": "p1", "response": boxed("5") + " Q: no", "lbar": -0.2},                # cut at "Q:", earlier than \n\n
        {"id": "p1", "response": boxed("2"), "lbar": -0.7},                            # no stop string: kept whole
    ])
    log = load_foreign_log(path, PROMPTS, stop=["\n\n", "Q:"])
    assert log.texts[0][:3] == [boxed("2") + "\n\n", boxed("5") + " Q:", boxed("2")]
    assert log.eos[0, :3].tolist() == [False, False, True]
    assert log.rewards[0, :3].tolist() == [1, 0, 1]
    assert math.isnan(log.mean_logprob[0, 0]) and math.isnan(log.mean_logprob[0, 1])
    assert log.mean_logprob[0, 2].item() == pytest.approx(-0.7)
    assert log.counts["stop_cut"] == 2 and "cut 2 at a stop string" in log.report()
    plain = load_foreign_log(path, PROMPTS)     # the verifier ends the first at its made-up next turn ('Q:') too
    assert plain.rewards[0, :3].tolist() == [1, 0, 1] and plain.eos[0, :3].tolist() == [True] * 3
