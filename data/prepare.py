"""Prepare GRAFT's prompt files: the MATH train split and the five evaluation benchmarks.

What it does
    Fetches each dataset (from the HuggingFace hub, or from a local folder with --from), maps its
    fields onto the prompt schema ({"id", "problem", "answer"} per line) and writes one JSONL file per dataset:

        {"id": str, "problem": str, "answer": str, "source": str, ...extra fields}

    one object per line, to ``<out>/<name>.jsonl``. Gold answers are normalised: surrounding
    whitespace and a matched pair of ``$`` delimiters are stripped, an integral JSON number becomes
    an integer string (``27.0`` -> ``"27"``), and for the contests whose answers are integers by rule
    (AIME, AMC) an integer-valued string is canonicalised (``"025"`` -> ``"25"``, ``"27.0"`` ->
    ``"27"``). MATH and Minerva answers are otherwise kept as LaTeX (``"001"``, ``"+2"`` and
    ``\\frac{5}{6}`` stay as they are; the verifier compares them). When normalisation changed the
    value, the source value is kept as ``answer_raw``.

    Where a source has no answer field, the answer is the content of the LAST ``\\boxed{...}`` (or
    ``\\fbox{...}``) of its solution, with brace matching. Rows with no answer (or no problem) are
    dropped with a warning naming their ids; MATH train has 2 such rows (multiple-choice problems
    whose solution's box is empty: math-train-5341 and -5343 in the local copy), so it writes 7,498.

    The row count read from each source (before dropping) is checked against the expected count:
    a mismatch is a warning with expected vs got, or an error with --strict. Outputs that already
    exist are neither fetched nor written again unless --force. Each output is written atomically
    (temporary file in the same folder + os.replace), so an interrupted run never leaves a partial
    file that a later run would skip. A summary table (name, rows, dropped, path) is printed at the end.

Outputs and hub sources (dataset repos; file = first repo file matching a pattern, in order;
several matching files of the same pattern are concatenated in sorted order)

    | name       | rows  | hub repo                    | file pattern(s)          | field mapping (first present)  |
    |------------|-------|-----------------------------|--------------------------|--------------------------------|
    | math_train | 7,500 | DigitalLearningGmbH/        | data/train-*.parquet [1] | problem; answer = last boxed   |
    |            |       |   MATH-lighteval (mirror of | (train-*.parquet)        | of solution; extras level,     |
    |            |       |   hendrycks MATH train)     |                          | type; id = math-train-<row>    |
    | math500    |   500 | HuggingFaceH4/MATH-500      | test.jsonl               | id = unique_id; problem;       |
    |            |       |                             |                          | answer; extras solution,       |
    |            |       |                             |                          | subject, level                 |
    | aime2024   |    30 | HuggingFaceH4/aime_2024     | *.jsonl, else            | id = aime2024-<id>; problem;   |
    |            |       |                             | data/train-*.parquet [1] | answer; extras solution, url   |
    | aime2025   |    30 | opencompass/AIME2025        | aime2025-I*.jsonl (I, II)| problem = question; answer;    |
    |            |       |   (parts I then II)         |                          | id = aime2025-<row>            |
    | amc23      |    40 | math-ai/amc23               | test*.jsonl, *.jsonl     | id = amc23-<id>; problem =     |
    |            |       |                             |                          | question|problem; answer (a    |
    |            |       |                             |                          | float in the source); extra    |
    |            |       |                             |                          | url                            |
    | minerva    |   272 | math-ai/minervamath         | test*.jsonl, *.jsonl     | problem = question|problem;    |
    |            |       |                             |                          | answer, else last boxed of     |
    |            |       |                             |                          | solution; id = minerva-<row>   |

    [1] parquet: needs pyarrow. amc23, minerva and aime2025 also fall back to *.parquet.
    "problem" also accepts "question"/"Problem" and "answer" also accepts "Answer" in every source, so a
    mirror with capitalised columns works too. If a source's schema differs (no file matches, or a
    required field is missing) the error names the repo, the file and the fields that were tried and
    found. These sources were chosen as well-known public copies but could not be checked from the
    machine this was written on; if one moved, fetch it yourself and use --from.

    Parquet sources need pyarrow (not a GRAFT dependency): ``pip install pyarrow``. JSON/JSONL sources
    need nothing beyond huggingface_hub, which is imported only when fetching, so --from works offline.

Local folder (--from DIR)
    Reads ``<DIR>/<file>.jsonl`` with the same field mapping; the file names of
    ../shared/benchmarks/ are accepted, as are our own output names:

        math_train <- train_math7500.jsonl | math_train.jsonl
        math500    <- math500.jsonl
        aime2024   <- aime2024.jsonl
        aime2025   <- aime2025.jsonl
        amc23      <- amc23.jsonl
        minerva    <- minerva_math.jsonl | minerva.jsonl

Usage
    python -m data.prepare                              # fetch everything from the hub into data/
    python -m data.prepare --from ../shared/benchmarks  # use local copies instead
    python -m data.prepare --only aime2024 amc23 --force
    python -m data.prepare --out /tmp/prompts --strict  # a count mismatch is an error

The files it writes are read (and validated) by data/prompts.py's load_prompts, which the trainer imports.
"""

import argparse
import fnmatch
import json
import os
import re
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

# verify.py lives in the repository root; this file runs as a script from data/ and is loaded by path.
from data.prompts import SchemaError, jsonl_objects
from verify import last_boxed

# ------------------------------------------------------------------------------------------------
# Sources
# ------------------------------------------------------------------------------------------------

# Field names tried, in order, for the two required fields. Shared by all sources so that a
# mirror using "question" or capitalised columns still maps without code changes.
PROBLEM_FIELDS = ("problem", "question", "Problem", "Question")
ANSWER_FIELDS = ("answer", "Answer")


# No `from __future__ import annotations`: dataclasses would then need this module in
# sys.modules, which loading it by path with importlib (as the trainer does) does not provide.
@dataclass(frozen=True)
class Source:
    name: str                      # output name: <out>/<name>.jsonl
    expected: int                  # rows in the source, before dropping rows without an answer
    repo: str                      # HF dataset repo
    patterns: tuple[str, ...]      # repo file patterns, tried in order; all files of the first match
    local: tuple[str, ...]         # file names accepted in a --from folder, tried in order
    id_fields: tuple[str, ...] = ()          # source id field(s); else a row index is used
    id_prefix: str = ""                      # prepended to the source id / row index
    boxed_fields: tuple[str, ...] = ("solution",)  # answer fallback: last \boxed{} of this text
    extras: tuple[str, ...] = ()             # copied through when present
    integer_answers: bool = False            # contest answers are integers: canonicalise them


SOURCES: dict[str, Source] = {s.name: s for s in [
    Source("math_train", 7500, "DigitalLearningGmbH/MATH-lighteval",
           ("data/train-*.parquet", "train-*.parquet", "train*.jsonl"),
           ("train_math7500.jsonl", "math_train.jsonl"),
           # MATH has no answer column: the gold answer is the last boxed of the solution
           # (local copies, which have one, use it).
           id_prefix="math-train-", extras=("level", "type")),
    Source("math500", 500, "HuggingFaceH4/MATH-500", ("test.jsonl",), ("math500.jsonl",),
           id_fields=("unique_id", "id"), extras=("solution", "subject", "level")),
    Source("aime2024", 30, "HuggingFaceH4/aime_2024",
           ("*.jsonl", "data/train-*.parquet", "*.parquet"), ("aime2024.jsonl",),
           id_fields=("id", "ID"), id_prefix="aime2024-",
           extras=("solution", "url", "part", "number"), integer_answers=True),
    Source("aime2025", 30, "opencompass/AIME2025",
           ("aime2025-I*.jsonl", "*.jsonl", "*.parquet"), ("aime2025.jsonl",),
           id_prefix="aime2025-", extras=("solution", "url", "part", "number"),
           integer_answers=True),
    Source("amc23", 40, "math-ai/amc23", ("test*.jsonl", "*.jsonl", "*.parquet"),
           ("amc23.jsonl",), id_fields=("id",), id_prefix="amc23-", extras=("url",),
           integer_answers=True),
    Source("minerva", 272, "math-ai/minervamath", ("test*.jsonl", "*.jsonl", "*.parquet"),
           ("minerva_math.jsonl", "minerva.jsonl"), id_prefix="minerva-",
           extras=("solution", "type")),
]}


class CountError(ValueError):
    """A source has a different row count than expected (only raised with --strict)."""


def warn(msg: str) -> None:
    print(f"WARNING: {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------------
# Answer extraction and normalisation
# ------------------------------------------------------------------------------------------------

# The gold reader is verify.py's last_boxed (one box reader for golds and rewards: the content of the
# last outermost \boxed{...} / \fbox{...}, brace-matched, escaped braces literal, '\boxed 5' giving the
# next token, an unclosed box giving None). Imported at the top of this file.


_INTEGRAL = re.compile(r"^-?\d+(?:\.0*)?$")


def normalise_answer(value: Any, integer: bool = False) -> str:
    """Canonical gold-answer string ('' when there is none); see the module docstring."""
    if value is None or isinstance(value, bool):
        return ""
    if isinstance(value, float):
        # JSON floats such as AMC's 27.0: an integral value is written as an integer.
        return str(int(value)) if value.is_integer() else repr(value)
    s = str(value).strip()
    # A matched pair of math delimiters ($...$ or $$...$$), but not an escaped \$ at the end.
    while len(s) >= 2 and s[0] == "$" and s[-1] == "$" and s[-2] != "\\":
        s = s[1:-1].strip()
    if integer and _INTEGRAL.match(s):
        s = str(int(float(s))) if "." in s else str(int(s))
    return s


# ------------------------------------------------------------------------------------------------
# Reading source files
# ------------------------------------------------------------------------------------------------

def read_records(path: Path) -> list[dict]:
    """Rows of a .jsonl, .json (a list of objects) or .parquet file, as dicts."""
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise SystemExit(f"{path}: reading parquet needs pyarrow, which GRAFT does not "
                             f"install: pip install pyarrow (or use --from with JSONL copies)")
        return pq.read_table(path).to_pylist()
    if suffix == ".json":
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        if not isinstance(data, list) or not all(isinstance(r, dict) for r in data):
            raise SchemaError(f"{path}: expected a JSON list of objects")
        return data
    rows = [row for _, row in jsonl_objects(path)]
    return rows


def _first(row: dict, names: Iterable[str]) -> str | None:
    """Name of the first of names present in row, else None."""
    return next((n for n in names if n in row), None)


def map_rows(src: Source, records: list[dict], where: str) -> tuple[list[dict], list[str]]:
    """Map source records to prompt rows. Returns (rows, ids dropped for lacking a problem/answer).

    where names the origin (repo and file, or a local path) for error messages. The field choice
    is made on the first record and required of all, so a schema change fails loudly instead of
    silently producing empty answers.
    """
    if not records:
        raise SchemaError(f"{where}: no rows")
    first = records[0]
    keys = sorted(first)
    p_field = _first(first, PROBLEM_FIELDS)
    if p_field is None:
        raise SchemaError(f"{where}: no problem field (tried {list(PROBLEM_FIELDS)}; "
                          f"found {keys})")
    # An answer column wins; a solution's last \boxed{} is the fallback (MATH has no answer column).
    a_field = _first(first, ANSWER_FIELDS)
    b_field = None if a_field else _first(first, src.boxed_fields)
    if a_field is None and b_field is None:
        raise SchemaError(f"{where}: no answer field (tried {list(ANSWER_FIELDS)} and a "
                          f"\\boxed answer in {list(src.boxed_fields)}; found {keys})")
    id_field = _first(first, src.id_fields or ("id",))

    rows, dropped, seen = [], [], {}
    for i, rec in enumerate(records):
        for f_name in (p_field, a_field or b_field):
            if f_name not in rec:
                raise SchemaError(f"{where}: row {i} has no field {f_name!r} (found {sorted(rec)})")
        if id_field is not None and rec.get(id_field) not in (None, ""):
            rid = str(rec[id_field])
            # Keep ids that already carry the prefix (our own or shared copies) unchanged.
            if src.id_prefix and not rid.startswith(src.id_prefix):
                rid = src.id_prefix + rid
        else:
            rid = f"{src.id_prefix or src.name + '-'}{i}"
        if rid in seen:
            raise SchemaError(f"{where}: duplicate id {rid!r} (rows {seen[rid]} and {i})")
        seen[rid] = i

        raw = rec[a_field] if a_field else last_boxed(str(rec[b_field] or ""))
        answer = normalise_answer(raw, src.integer_answers)
        problem = rec[p_field] if isinstance(rec[p_field], str) else ""
        if not answer or not problem.strip():
            dropped.append(rid)
            continue
        row = {"id": rid, "problem": problem, "answer": answer, "source": src.name}
        for extra in src.extras:
            if extra in rec and rec[extra] is not None and extra not in row:
                row[extra] = rec[extra]
        # Keep the source value when normalisation changed it (or a pre-existing answer_raw,
        # which the shared copies carry), so the change can be audited.
        if "answer_raw" in rec:
            row["answer_raw"] = rec["answer_raw"]
        elif a_field and (not isinstance(raw, str) or raw != answer):
            row["answer_raw"] = raw
        rows.append(row)
    return rows, dropped


def fetch_hub(src: Source) -> tuple[list[dict], str]:
    """Download a source's file(s) from the hub; returns (records, description for messages)."""
    try:
        from huggingface_hub import hf_hub_download, list_repo_files
    except ImportError:
        raise SystemExit("fetching from the hub needs huggingface_hub: pip install huggingface_hub "
                         "(or use --from with local copies)")
    try:
        files = list_repo_files(src.repo, repo_type="dataset")
    except Exception as e:  # network, auth or a moved repo: say which source and the way out
        raise RuntimeError(f"{src.name}: cannot list hub dataset {src.repo}: {e}\n"
                           f"(fetch it by hand and use --from DIR; see the module docstring)") from e
    chosen: list[str] = []
    for pattern in src.patterns:
        chosen = sorted(f for f in files if fnmatch.fnmatch(f, pattern))
        if chosen:
            break
    if not chosen:
        raise SchemaError(f"hub dataset {src.repo}: no file matches {list(src.patterns)}; "
                          f"the repo has {sorted(files)}")
    records: list[dict] = []
    for fname in chosen:
        local = hf_hub_download(src.repo, fname, repo_type="dataset")
        records.extend(read_records(Path(local)))
    return records, f"hub dataset {src.repo} file(s) {chosen}"


def read_local(src: Source, folder: Path) -> tuple[list[dict], str]:
    for fname in src.local:
        path = folder / fname
        if path.is_file():
            return read_records(path), str(path)
    raise FileNotFoundError(f"{folder}: no file for {src.name} (looked for {list(src.local)})")


# ------------------------------------------------------------------------------------------------
# Writing
# ------------------------------------------------------------------------------------------------

def write_jsonl_atomic(path: Path, rows: list[dict]) -> None:
    """Write rows to path via a temp file in the same folder + os.replace (never a partial file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


# ------------------------------------------------------------------------------------------------
# Command line
# ------------------------------------------------------------------------------------------------

@dataclass
class Result:
    name: str
    rows: int
    dropped: int | None   # None: skipped (file existed)
    path: Path
    note: str = ""


def prepare_one(src: Source, out: Path, from_dir: Path | None, force: bool,
                strict: bool) -> Result:
    path = out / f"{src.name}.jsonl"
    if path.exists() and not force:
        with open(path, encoding="utf-8") as f:
            n = sum(1 for line in f if line.strip())
        return Result(src.name, n, None, path, "exists, skipped (--force to rewrite)")
    records, where = read_local(src, from_dir) if from_dir else fetch_hub(src)
    if len(records) != src.expected:
        msg = f"{src.name}: expected {src.expected} rows, got {len(records)} ({where})"
        if strict:
            raise CountError(msg)
        warn(msg)
    rows, dropped = map_rows(src, records, where)
    if dropped:
        warn(f"{src.name}: dropped {len(dropped)} row(s) without a problem or answer: "
             f"{', '.join(dropped)}")
    write_jsonl_atomic(path, rows)
    return Result(src.name, len(rows), len(dropped), path, "written")


def print_summary(results: list[Result]) -> None:
    header = ("name", "rows", "dropped", "path")
    table = [header] + [(r.name, str(r.rows), "-" if r.dropped is None else str(r.dropped),
                         f"{r.path}  ({r.note})") for r in results]
    widths = [max(len(row[i]) for row in table) for i in range(3)]
    for row in table:
        print(f"{row[0]:<{widths[0]}}  {row[1]:>{widths[1]}}  {row[2]:>{widths[2]}}  {row[3]}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Fetch MATH train and the five benchmarks as prompt "
                                "JSONL files (see the module docstring for sources).")
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent,
                   help="output folder (default: the data/ folder of this script)")
    p.add_argument("--from", dest="from_dir", type=Path, default=None, metavar="DIR",
                   help="read local JSONL copies from DIR instead of the hub")
    p.add_argument("--only", nargs="+", choices=list(SOURCES), metavar="NAME",
                   help=f"prepare only these ({', '.join(SOURCES)})")
    p.add_argument("--force", action="store_true", help="rewrite outputs that already exist")
    p.add_argument("--strict", action="store_true", help="a row-count mismatch is an error")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.from_dir is not None and not args.from_dir.is_dir():
        raise SystemExit(f"--from {args.from_dir}: not a folder")
    names = args.only or list(SOURCES)
    results = [prepare_one(SOURCES[n], args.out, args.from_dir, args.force, args.strict)
               for n in names]
    print_summary(results)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except (ValueError, RuntimeError, OSError) as e:  # expected failures: one clear line, no trace
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
