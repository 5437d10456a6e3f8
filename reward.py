"""The reward seam: `--reward` names the function that scores responses, and `rewards` is the one place that calls it.

Training (Trainer.rollout and the stored peer's re-verification), evaluation, `graft.py preflight`, the
foreign-log loader (foreign.py) and the gold check at start all score through `rewards`, so that swapping
the reward (another verifier, math-verify, a code runner, a format bonus) is one flag:
    --reward module:function               a module on the import path (the default: verify:verify_batch)
    --reward path/to/my_reward.py:function a file, loaded by path
The function's contract (README "The reward"):
    def reward(responses: list[str], golds: list[str], *, workers: int = 0, **options) -> list[float]
  * responses: the decoded responses (special tokens skipped, a final EOS dropped, cut before a --stop
    string: core.verifier_text); golds: the "answer" field of each response's prompt, one per response.
  * workers: --verify-workers, the processes the function may use (it may ignore it).
  * options: rel_tol=verify.MINERVA_REL_TOL when the eval scores Minerva, whose golds carry three significant
    figures; passed only to a function that takes it (a rel_tol parameter or **options).
  * Returns one finite number per response. The selection counts a reward >= 0.5 as a success
    (core.success_counts), so a format bonus below 0.5 never turns an all-fail group into a mixed one.
load_reward checks at start that the function imports, is callable and takes (responses, golds, workers=0);
rewards checks every answer (one finite number per response). Both raise ValueError naming --reward.
The function is looked up on its module at every call, so a module attribute replaced after start (a test's
planted reward) is the one called. This file imports nothing of ours but the module --reward names.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.util
import inspect
import math
import sys
from pathlib import Path
from types import ModuleType
from typing import Callable

DEFAULT_REWARD = "verify:verify_batch"  # config.Config.reward's default: verify.py, the paper's verifier


@functools.lru_cache(maxsize=None)
def reward_module(spec: str) -> tuple[ModuleType, str]:
    """The module and the function name of a --reward spec, the module imported (or loaded by path) once."""
    where, _, name = spec.strip().rpartition(":")
    if not where or not name:
        raise ValueError(f"--reward {spec!r}: must name module:function or path/to/file.py:function")
    try:
        if where.endswith(".py"):
            path = Path(where).expanduser().resolve()
            if not path.is_file():
                raise ValueError(f"--reward {spec!r}: no such file {path}")
            # A name of its own per file, so that two reward files of the same stem do not collide.
            mod_name = f"graft_reward_{path.stem}_{hashlib.sha256(str(path).encode()).hexdigest()[:8]}"
            file_spec = importlib.util.spec_from_file_location(mod_name, path)
            module = importlib.util.module_from_spec(file_spec)
            sys.modules[mod_name] = module  # pickling the function (verifier worker processes) finds it
            file_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(where)
    except ValueError:
        raise
    except Exception as e:  # the user's module failed to import: say which flag loaded it
        raise ValueError(f"--reward {spec!r}: importing {where} failed ({type(e).__name__}: {e})") from e
    return module, name


def load_reward(spec: str) -> Callable:
    """The reward function a --reward spec names, checked against the contract (module docstring).

    Raises ValueError naming --reward: the module does not import, has no such callable, or the callable
    cannot be called as reward(responses, golds, workers=0)."""
    module, name = reward_module(spec)
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ValueError(f"--reward {spec!r}: {module.__name__} has no function {name!r}")
    try:
        inspect.signature(fn).bind(["response"], ["gold"], workers=0)
    except TypeError as e:
        raise ValueError(f"--reward {spec!r}: {name} cannot be called as reward(responses, golds, *, workers=0, "
                         f"**options) -> list[float] ({e}); README 'The reward' gives the signature") from None
    except ValueError:  # a builtin without a signature: trust it, rewards() checks its answers
        pass
    return fn


def rewards(spec: str, responses: list[str], golds: list[str], *, workers: int = 0, **options) -> list[float]:
    """The one call of the reward: one float per response, each scored against its gold.

    spec: --reward; workers: --verify-workers; options: passed where the function takes them (module
    docstring). Raises ValueError naming --reward when the answer is not one finite number per response."""
    assert len(responses) == len(golds), f"{len(responses)} responses but {len(golds)} golds"
    fn = load_reward(spec)
    try:
        params = inspect.signature(fn).parameters
        takes_all = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
        kw = {k: v for k, v in options.items() if takes_all or k in params}
    except ValueError:
        kw = options
    out = fn(list(responses), list(golds), workers=workers, **kw)
    try:
        values = [float(x) for x in out]
    except (TypeError, ValueError) as e:
        raise ValueError(f"--reward {spec!r}: the function must return a list of numbers ({e})") from None
    if len(values) != len(responses):
        raise ValueError(f"--reward {spec!r}: returned {len(values)} rewards for {len(responses)} responses")
    bad = next((v for v in values if not math.isfinite(v)), None)
    if bad is not None:
        raise ValueError(f"--reward {spec!r}: returned {bad}; every reward must be a finite number")
    return values


def unreadable_golds(rows: list[dict], *, reward: str = DEFAULT_REWARD, workers: int = 0) -> list[str]:
    """Ids of the prompts whose gold answer the reward cannot read: the response "\\boxed{<gold>}" scores 0
    against the gold itself (for verify.py: an unbalanced brace, say), so every response to them fails."""
    scores = rewards(reward, [f"\\boxed{{{r['answer']}}}" for r in rows], [r["answer"] for r in rows],
                     workers=workers)
    return [r["id"] for r, score in zip(rows, scores) if score <= 0]


def check_golds(rows: list[dict], cfg, *, main: bool = True) -> None:
    """Warn about the prompts of --prompts that always score 0 (unreadable_golds), or stop with --strict.

    cfg: config.Config (prompts, strict, reward, verify_workers)."""
    bad = unreadable_golds(rows, reward=cfg.reward, workers=cfg.verify_workers)
    if not bad:
        return
    reader = "verify.py" if cfg.reward == DEFAULT_REWARD else f"--reward {cfg.reward}"
    msg = (f"--prompts {cfg.prompts}: {len(bad)} of {len(rows)} gold answers cannot be read by {reader} "
           f"(\\boxed{{gold}} does not match the gold), so those prompts always score 0; first ids: "
           f"{', '.join(bad[:5])}")
    if cfg.strict:
        raise SystemExit(f"{msg} (--strict)")
    if main:
        print(f"WARNING: {msg} (fix or drop them; --strict makes this an error)", file=sys.stderr, flush=True)
