"""The prompt file: reading and validating a prompt JSONL, the one format every prompt file of the project has
(data/prepare.py writes them, the trainer, the tools and the foreign-log reader read them here).

    {"id": str, "problem": str, "answer": str, ...extra fields}      one JSON object per line

load_prompts(path) -> list[dict] checks non-empty string id, problem and answer on every line, valid Unicode and
unique ids; jsonl_objects(path) is the project's one JSONL reader. Errors are ValueError naming the file and line.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

# ------------------------------------------------------------------------------------------------
# The JSONL reader and the prompt file
# ------------------------------------------------------------------------------------------------


class SchemaError(ValueError):
    """A file is not of the form expected (names the file, and the line or fields)."""


def jsonl_objects(path: Path):
    """(line number, object) for each non-blank line of a JSONL file; a line that is not a JSON
    object raises SchemaError (a ValueError) naming the file and line."""
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise SchemaError(f"{path}:{lineno}: not UTF-8 text (byte {e.start}: {raw[e.start:e.start + 1]!r}); "
                                  f"re-encode the file as UTF-8") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise SchemaError(f"{path}:{lineno}: invalid JSON: {e.msg}") from None
            if not isinstance(row, dict):
                raise SchemaError(f"{path}:{lineno}: expected a JSON object, got {type(row).__name__}")
            yield lineno, row


def load_prompts(path: str | os.PathLike) -> list[dict]:
    """Read a prompt JSONL ({"id", "problem", "answer"} per line) and validate it.

    Each non-blank line must be a JSON object with non-empty string "id", "problem" and "answer"
    that are valid Unicode (a JSON escape can carry a lone surrogate such as "\\ud800", which no
    tokenizer or file can encode); ids must be unique; the file must hold at least one prompt.
    Errors are ValueError naming the file and line number.
    """
    path = Path(path)
    rows: list[dict] = []
    seen: dict[str, int] = {}
    for lineno, row in jsonl_objects(path):
        for key in ("id", "problem", "answer"):
            v = row.get(key)
            if not isinstance(v, str) or not v.strip():
                raise ValueError(f"{path}:{lineno}: field {key!r} must be a non-empty "
                                 f"string, got {v!r}")
            try:
                v.encode("utf-8")
            except UnicodeEncodeError as e:
                raise ValueError(f"{path}:{lineno}: field {key!r} is not valid Unicode text (character "
                                 f"{e.start}: {v[e.start]!r}, a lone surrogate); fix the JSON escape") from None
        if row["id"] in seen:
            raise ValueError(f"{path}:{lineno}: duplicate id {row['id']!r} "
                             f"(first on line {seen[row['id']]})")
        seen[row["id"]] = lineno
        rows.append(row)
    if not rows:
        raise ValueError(f"{path}: no prompts")
    return rows
