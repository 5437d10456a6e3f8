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
  * workers: --verify-workers, the processes the function may use (it may ignore it); under --reward-timeout
    the seam's pool is those processes and the function is called with workers=0.
  * options: rel_tol=verify.MINERVA_REL_TOL when the eval scores Minerva, whose golds carry three significant
    figures; passed only to a function that takes it (a rel_tol parameter or **options).
  * Returns one finite number per response. The selection counts a reward >= 0.5 as a success
    (core.success_counts), so a format bonus below 0.5 never turns an all-fail group into a mixed one.
load_reward checks at start that the function imports, is callable and takes (responses, golds, workers=0);
rewards checks every answer (one finite number per response). Both raise ValueError naming --reward.
The function is looked up on its module at every call, so a module attribute replaced after start (a test's
planted reward) is the one called. This file imports nothing of ours but the module --reward names.

The wall-time limit (--reward-timeout, README "The reward"): with a limit (the trainer's default 60 s) the
function runs in a pool of max(1, workers) forked worker processes kept across calls (RewardPool), each given
one contiguous share of the batch and called with workers=0 (the pool is the parallelism). A share not
answered within the limit is stopped by killing its worker (a thread could not be stopped inside sympy or C
code); a worker that dies (a segfault, os._exit) loses its share the same way. Those responses score 0, the
answer (Scores) names them (timed_out, crashed), rewards prints a WARNING naming them, the trainer counts them
(metrics reward_timeouts, reward_crashes), the killed worker is replaced and the step goes on. Departures of
the seam from calling the function directly:
  1. A reward that hangs or crashes scores 0 instead of hanging or ending the run; an exception the function
     raises is still raised (RuntimeError naming --reward, with the worker's traceback): it is a bug to see.
  2. Under a limit the function runs in another process: its side effects (a counter it keeps, a list it
     fills) stay there, and a function that needs CUDA must run with --reward-timeout 0 (in this process, no
     limit, as before): a forked child cannot use the parent's CUDA context.
  3. Workers are forked (POSIX only): a planted or replaced function is seen because the pool is forked
     again whenever the function named by --reward is another object than the one its workers hold.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.util
import inspect
import math
import multiprocessing
import multiprocessing.connection
import signal
import sys
import threading
import time
import traceback
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


class Scores(list):
    """rewards' answer: one float per response (a plain list to every caller), plus the responses that the
    wall-time limit stopped: timed_out (past --reward-timeout, worker killed) and crashed (the worker died),
    indices into the batch; each of them scored 0."""

    def __init__(self, values, *, timed_out: list[int] = (), crashed: list[int] = ()):
        super().__init__(values)
        self.timed_out, self.crashed = list(timed_out), list(crashed)

    @property
    def faults(self) -> dict[str, int]:
        """The stopped responses as the trainer's metrics count them (metrics.py reward_timeouts, reward_crashes)."""
        return {"reward_timeouts": len(self.timed_out), "reward_crashes": len(self.crashed)}


def rewards(spec: str, responses: list[str], golds: list[str], *, workers: int = 0, timeout: float = 0.0,
            **options) -> Scores:
    """The one call of the reward: one float per response, each scored against its gold.

    spec: --reward; workers: --verify-workers; timeout: --reward-timeout, seconds the call may run (0 = no
    limit: the function runs here); options: passed where the function takes them (module docstring).
    Raises ValueError naming --reward when the answer is not one finite number per response, RuntimeError
    naming it when the function raised in a worker. Responses stopped by the limit score 0, are named in the
    answer (Scores) and in a WARNING on stderr."""
    assert len(responses) == len(golds), f"{len(responses)} responses but {len(golds)} golds"
    fn = load_reward(spec)
    try:
        params = inspect.signature(fn).parameters
        takes_all = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
        kw = {k: v for k, v in options.items() if takes_all or k in params}
    except ValueError:
        kw = options
    responses, golds = list(responses), list(golds)
    if timeout <= 0 or not responses:
        return Scores(_checked(spec, _call(fn, responses, golds, workers, kw), len(responses)))
    pool = reward_pool(spec, fn, max(1, workers))
    values: list[float] = [0.0] * len(responses)
    timed_out, crashed = [], []
    for (lo, hi), (kind, answer) in pool.run(responses, golds, kw, timeout=timeout):
        if kind == "ok":
            values[lo:hi] = _checked(spec, answer, hi - lo)
        elif kind == "error":
            raise RuntimeError(f"--reward {spec!r}: the function raised in its worker process:\n{answer}")
        else:  # "timeout" | "crash": the share scores 0 (its initial values)
            (timed_out if kind == "timeout" else crashed).extend(range(lo, hi))
    out = Scores(values, timed_out=timed_out, crashed=crashed)
    if timed_out or crashed:
        first = (timed_out or crashed)[0]
        print(f"WARNING: --reward {spec!r}: {len(timed_out)} of {len(responses)} responses not scored within "
              f"--reward-timeout {timeout:g}s (worker killed) and {len(crashed)} whose worker died; they score 0: "
              f"responses {_ranges(timed_out + crashed)} (first: {responses[first][:60]!r})",
              file=sys.stderr, flush=True)
    return out


def _call(fn, responses: list[str], golds: list[str], workers: int, kw: dict):
    """The one call of the loaded function (here without a limit, or in a worker of the pool)."""
    return fn(responses, golds, workers=workers, **kw)


def _checked(spec: str, out, n: int) -> list[float]:
    """The function's answer for n responses as floats; ValueError naming --reward when it is not n finite numbers."""
    try:
        values = [float(x) for x in out]
    except (TypeError, ValueError) as e:
        raise ValueError(f"--reward {spec!r}: the function must return a list of numbers ({e})") from None
    if len(values) != n:
        raise ValueError(f"--reward {spec!r}: returned {len(values)} rewards for {n} responses")
    bad = next((v for v in values if not math.isfinite(v)), None)
    if bad is not None:
        raise ValueError(f"--reward {spec!r}: returned {bad}; every reward must be a finite number")
    return values


def _ranges(ix: list[int]) -> str:
    """Sorted indices as runs: [0, 1, 2, 5] -> '0-2, 5'."""
    runs: list[list[int]] = []
    for i in sorted(ix):
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


# ------------------------------------------------------------------------------------------------
# The worker pool behind the wall-time limit (module docstring)


def _serve(conn, other_end, fn) -> None:
    """A worker's loop: receive (responses, golds, options), answer ("ok", list) or ("error", traceback). It ends
    when the trainer's end of the pipe closes (the trainer exited or was killed: EOF), so no worker outlives it."""
    other_end.close()  # the fork copied the trainer's end: closed here, or EOF would never come
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle; it kills the pool
    if "torch" in sys.modules:  # a forked child must not use the parent's OpenMP pool (as DataLoader workers)
        sys.modules["torch"].set_num_threads(1)
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        responses, golds, kw = msg
        try:
            answer = ("ok", list(_call(fn, responses, golds, 0, kw)))
        except BaseException:  # noqa: BLE001 - the parent raises it, naming --reward
            answer = ("error", traceback.format_exc())
        try:
            conn.send(answer)
        except Exception:  # noqa: BLE001 - an answer that does not pickle
            conn.send(("error", traceback.format_exc()))


class RewardPool:
    """size forked worker processes running fn, kept across calls; run() gives each one share of a batch,
    waits up to a deadline, kills the workers still busy (or found dead) and forks their replacements."""

    def __init__(self, fn, size: int):
        self.fn, self.size = fn, size
        self.ctx = multiprocessing.get_context("fork")
        self.lock = threading.Lock()
        self.workers = [self._start() for _ in range(size)]

    def _start(self):
        parent, child = self.ctx.Pipe()
        proc = self.ctx.Process(target=_serve, args=(child, parent, self.fn), daemon=True, name="graft-reward")
        proc.start()
        child.close()  # the worker's end lives in the worker only, so its death is EOF here
        return proc, parent

    def _replace(self, k: int) -> None:
        proc, conn = self.workers[k]
        if proc.is_alive():
            proc.kill()
        proc.join(timeout=5)
        conn.close()
        self.workers[k] = self._start()

    def run(self, responses: list[str], golds: list[str], kw: dict, *, timeout: float):
        """[((lo, hi), (kind, answer))] per share of the batch: kind "ok" (answer: the function's list),
        "error" (answer: the worker's traceback), "timeout" or "crash" (answer None)."""
        n = len(responses)
        bounds = [(k * n // self.size, (k + 1) * n // self.size) for k in range(self.size)]
        bounds = [(lo, hi) for lo, hi in bounds if hi > lo]
        with self.lock:
            busy: dict = {}  # conn -> (worker index, share)
            out = []
            for k, (lo, hi) in enumerate(bounds):
                proc, conn = self.workers[k]
                try:
                    conn.send((responses[lo:hi], golds[lo:hi], kw))
                    busy[conn] = (k, (lo, hi))
                except (BrokenPipeError, OSError):  # died since its last call: replaced, then counted lost
                    self._replace(k)
                    out.append(((lo, hi), ("crash", None)))
            deadline = time.monotonic() + timeout
            while busy:
                left = deadline - time.monotonic()
                ready = multiprocessing.connection.wait(list(busy), timeout=max(0.0, left)) if left > 0 else []
                if not ready:
                    break
                for conn in ready:
                    k, share = busy.pop(conn)
                    try:
                        out.append((share, conn.recv()))
                    except (EOFError, OSError):  # the worker died mid-call
                        self._replace(k)
                        out.append((share, ("crash", None)))
            for conn, (k, share) in busy.items():  # past the deadline: kill, replace
                self._replace(k)
                out.append((share, ("timeout", None)))
            return sorted(out, key=lambda x: x[0])

    def close(self) -> None:
        for proc, conn in self.workers:
            proc.kill()
            proc.join(timeout=5)
            conn.close()
        self.workers = []


_POOLS: dict[tuple[str, int], RewardPool] = {}  # (spec, size) -> its pool: the only module-level state


def reward_pool(spec: str, fn, size: int) -> RewardPool:
    """The pool running fn for --reward spec with size workers; forked again when fn is another object."""
    pool = _POOLS.get((spec, size))
    if pool is None or pool.fn is not fn:
        if pool is not None:
            pool.close()
        pool = _POOLS[(spec, size)] = RewardPool(fn, size)
    return pool


def reward_options(cfg) -> dict:
    """rewards' keyword arguments from a config.Config: workers=--verify-workers, timeout=--reward-timeout."""
    return {"workers": cfg.verify_workers, "timeout": cfg.reward_timeout}


def unreadable_golds(rows: list[dict], *, reward: str = DEFAULT_REWARD, workers: int = 0,
                     timeout: float = 0.0) -> list[str]:
    """Ids of the prompts whose gold answer the reward cannot read: the response "\\boxed{<gold>}" scores 0
    against the gold itself (for verify.py: an unbalanced brace, say), so every response to them fails."""
    scores = rewards(reward, [f"\\boxed{{{r['answer']}}}" for r in rows], [r["answer"] for r in rows],
                     workers=workers, timeout=timeout)
    return [r["id"] for r, score in zip(rows, scores) if score <= 0]


def check_golds(rows: list[dict], cfg, *, main: bool = True) -> None:
    """Warn about the prompts of --prompts that always score 0 (unreadable_golds), or stop with --strict.

    cfg: config.Config (prompts, strict, reward, verify_workers, reward_timeout)."""
    bad = unreadable_golds(rows, reward=cfg.reward, workers=cfg.verify_workers, timeout=cfg.reward_timeout)
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
