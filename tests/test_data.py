"""Tests for data/prepare.py and data/prompts.py: run it on ../shared/benchmarks and on small synthetic folders."""

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from data import prepare as prep
from data.prompts import load_prompts

ROOT = Path(__file__).resolve().parent.parent  # the repository root
SHARED = Path(__file__).resolve().parents[2] / "shared" / "benchmarks"
needs_shared = pytest.mark.skipif(not SHARED.is_dir(),
                                  reason=f"shared benchmark copies not found at {SHARED}")

EXPECTED = {"math_train": 7498, "math500": 500, "aime2024": 30, "aime2025": 30, "amc23": 40,
            "minerva": 272}




def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")


# ------------------------------------------------------------------------------------------------
# The shared folder
# ------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def shared_out(tmp_path_factory):
    if not SHARED.is_dir():
        pytest.skip(f"shared benchmark copies not found at {SHARED}")
    out = tmp_path_factory.mktemp("prompts")
    assert prep.main(["--from", str(SHARED), "--out", str(out)]) == 0
    return out


@needs_shared
def test_counts_and_schema(shared_out):
    for name, n in EXPECTED.items():
        rows = load_prompts(shared_out / f"{name}.jsonl")  # validates id/problem/answer
        assert len(rows) == n, name
        assert all(r["source"] == name for r in rows)
        assert len({r["id"] for r in rows}) == n


@needs_shared
def test_normalised_answers_in_shared(shared_out):
    for name in ("aime2024", "aime2025", "amc23"):
        for r in load_prompts(shared_out / f"{name}.jsonl"):
            assert str(int(r["answer"])) == r["answer"], r  # canonical integer, e.g. "-1", "25"
    train = {r["id"]: r for r in load_prompts(shared_out / "math_train.jsonl")}
    assert "math-train-5341" not in train and "math-train-5343" not in train
    assert all(r["answer"] == r["answer"].strip() for r in train.values())


@needs_shared
def test_cli_subprocess_skip_and_force(tmp_path):
    cmd = [sys.executable, "-m", "data.prepare", "--from", str(SHARED), "--out", str(tmp_path),
           "--only", "aime2024", "amc23"]
    first = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert first.returncode == 0, first.stderr
    assert "aime2024" in first.stdout and "rows" in first.stdout
    paths = [tmp_path / "aime2024.jsonl", tmp_path / "amc23.jsonl"]
    # Backdate the outputs so a rewrite would show as a newer mtime even on coarse clocks.
    for p in paths:
        os.utime(p, ns=(10**18, 10**18))
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert again.returncode == 0 and "skipped" in again.stdout
    assert [p.stat().st_mtime_ns for p in paths] == [10**18, 10**18]
    forced = subprocess.run(cmd + ["--force"], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert forced.returncode == 0, forced.stderr
    assert all(p.stat().st_mtime_ns != 10**18 for p in paths)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["aime2024.jsonl", "amc23.jsonl"]


# ------------------------------------------------------------------------------------------------
# Synthetic folders: normalisation, drops, counts
# ------------------------------------------------------------------------------------------------

def test_normalisation_and_drop_warning(tmp_path, capsys):
    src = tmp_path / "src"
    src.mkdir()
    _write_jsonl(src / "aime2024.jsonl", [
        {"id": "aime2024-60", "problem": "P0", "answer": "025"},
        {"id": 61, "problem": "P1", "answer": " $7$ "},
        {"id": 62, "problem": "P2", "answer": ""},
        {"id": 63, "problem": "P3", "answer": None},
    ])
    _write_jsonl(src / "amc23.jsonl", [
        {"id": 0, "problem": "Q0", "answer": 27.0},
        {"id": 1, "problem": "Q1", "answer": "27.0"},
        {"id": 2, "problem": "Q2", "answer": 2.5},
    ])
    # No answer column: the answer is the last \boxed{} of the solution, brace-matched.
    _write_jsonl(src / "minerva_math.jsonl", [
        {"problem": "R0", "solution": "first \\boxed{1} then \\boxed{\\frac{1}{s+a}}."},
        {"problem": "R1", "solution": "no box here"},
    ])
    out = tmp_path / "out"
    assert prep.main(["--from", str(src), "--out", str(out),
                      "--only", "aime2024", "amc23", "minerva"]) == 0
    err = capsys.readouterr().err
    assert "aime2024: dropped 2 row(s)" in err and "aime2024-62, aime2024-63" in err
    assert "minerva: dropped 1 row(s)" in err and "minerva-1" in err
    assert "aime2024: expected 30 rows, got 4" in err  # a count mismatch warns by default

    aime = load_prompts(out / "aime2024.jsonl")
    assert [(r["id"], r["answer"]) for r in aime] == [("aime2024-60", "25"), ("aime2024-61", "7")]
    assert aime[0]["answer_raw"] == "025"
    amc = load_prompts(out / "amc23.jsonl")
    assert [r["answer"] for r in amc] == ["27", "27", "2.5"]
    assert amc[0]["answer_raw"] == 27.0
    minerva = load_prompts(out / "minerva.jsonl")
    assert [(r["id"], r["answer"]) for r in minerva] == [("minerva-0", "\\frac{1}{s+a}")]


def test_strict_count_mismatch_is_error(tmp_path):
    _write_jsonl(tmp_path / "amc23.jsonl", [{"id": 0, "problem": "Q", "answer": "1"}])
    with pytest.raises(prep.CountError, match="expected 40 rows, got 1"):
        prep.main(["--from", str(tmp_path), "--out", str(tmp_path / "o"),
                   "--only", "amc23", "--strict"])
    assert not (tmp_path / "o" / "amc23.jsonl").exists()


def test_schema_error_names_file_and_fields(tmp_path):
    _write_jsonl(tmp_path / "amc23.jsonl", [{"id": 0, "text": "Q", "answer": "1"}])
    with pytest.raises(prep.SchemaError, match=r"amc23\.jsonl: no problem field.*found"):
        prep.main(["--from", str(tmp_path), "--out", str(tmp_path / "o"), "--only", "amc23"])


def test_last_boxed_and_normalise():
    assert prep.last_boxed("a \\boxed{x} b \\boxed{\\{1,2\\}}") == "\\{1,2\\}"
    assert prep.last_boxed("\\boxed{\\frac{a}{b}") is None  # unbalanced
    assert prep.last_boxed("so \\boxed 5$.") == "5"
    assert prep.last_boxed("\\fbox{3}") == "3"
    assert prep.last_boxed("none") is None
    assert prep.normalise_answer("001") == "001"  # MATH: leading zeros may matter
    assert prep.normalise_answer("001", integer=True) == "1"
    assert prep.normalise_answer(" \\$ 5") == "\\$ 5"
    assert prep.normalise_answer("$$x$$") == "x"


# ------------------------------------------------------------------------------------------------
# Hub path, with a stand-in huggingface_hub (no network here)
# ------------------------------------------------------------------------------------------------

def test_fetch_hub_with_fake_hub(tmp_path, monkeypatch):
    files = {"aime2025-I.jsonl": [{"question": f"I{i}", "answer": "070"} for i in range(2)],
             "aime2025-II.jsonl": [{"question": "II0", "answer": 5}],
             "README.md": None}
    for name, rows in files.items():
        if rows is not None:
            _write_jsonl(tmp_path / name, rows)
    fake = types.ModuleType("huggingface_hub")
    fake.list_repo_files = lambda repo, repo_type=None: list(files)
    fake.hf_hub_download = lambda repo, fname, repo_type=None: str(tmp_path / fname)
    monkeypatch.setitem(sys.modules, "huggingface_hub", fake)

    records, where = prep.fetch_hub(prep.SOURCES["aime2025"])
    assert "opencompass/AIME2025" in where
    rows, dropped = prep.map_rows(prep.SOURCES["aime2025"], records, where)
    assert [(r["id"], r["problem"], r["answer"]) for r in rows] == [
        ("aime2025-0", "I0", "70"), ("aime2025-1", "I1", "70"), ("aime2025-2", "II0", "5")]
    assert dropped == []

    fake.list_repo_files = lambda repo, repo_type=None: ["README.md"]
    with pytest.raises(prep.SchemaError, match="opencompass/AIME2025: no file matches"):
        prep.fetch_hub(prep.SOURCES["aime2025"])


# ------------------------------------------------------------------------------------------------
# load_prompts
# ------------------------------------------------------------------------------------------------

def test_load_prompts_malformed_line(tmp_path):
    p = tmp_path / "p.jsonl"
    p.write_text('{"id": "a", "problem": "x", "answer": "1"}\n{not json\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"p\.jsonl:2: invalid JSON"):
        load_prompts(p)
    p.write_text('{"id": "a", "problem": "x", "answer": ""}\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"p\.jsonl:1: field 'answer'"):
        load_prompts(p)


def test_load_prompts_duplicate_id(tmp_path):
    p = tmp_path / "p.jsonl"
    _write_jsonl(p, [{"id": "a", "problem": "x", "answer": "1"},
                     {"id": "b", "problem": "y", "answer": "2"},
                     {"id": "a", "problem": "z", "answer": "3"}])
    with pytest.raises(ValueError, match=r"p\.jsonl:3: duplicate id 'a' \(first on line 1\)"):
        load_prompts(p)


@pytest.mark.parametrize("field", ["id", "problem", "answer"])
def test_load_prompts_lone_surrogate_names_file_and_line(tmp_path, field):
    """A JSON escape can carry a lone surrogate, which no tokenizer or file can encode."""
    p = tmp_path / "p.jsonl"
    bad = {"id": "b", "problem": "y", "answer": "2"} | {field: "x\ud800"}
    _write_jsonl(p, [{"id": "a", "problem": "x", "answer": "1"}, bad])  # json.dumps writes the escape \ud800
    assert "\\ud800" in p.read_text(encoding="utf-8")
    with pytest.raises(ValueError, match=rf"p\.jsonl:2: field '{field}' is not valid Unicode text \(character 1"):
        load_prompts(p)


def test_import_has_no_side_effects(tmp_path):
    code = "import data.prepare as m, data.prompts as p; print(callable(m.main) and callable(p.load_prompts))"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       cwd=tmp_path, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert r.returncode == 0 and r.stdout == "True\n" and r.stderr == ""
    assert list(tmp_path.iterdir()) == []
