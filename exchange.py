"""GRAFT exchange files: one model's rollouts of one step, as a safetensors file (README "Files").

The two processes of an online pair meet through these files (each writes its own, atomically, and
waits for the peer's); the stored-trajectory variant reads a finished run's files; and every run's
exchange folder is its trajectory log. Online and offline therefore share one format.

File layout, <exchange>/<side name>/step_<t:06d>.safetensors, format version 1:
    rewards, advantages, mean_logprob, eos   (G, n)        float32 / bool
    tokens, logprobs                          (sum of lengths,) int64 / float32, cut by token_offsets (G*n+1,)
    text                                      UTF-8 bytes of the response texts, cut by text_offsets (G*n+1,)
    prompt_ids                                UTF-8 bytes of the dataset ids, cut by prompt_id_offsets (G+1,)
    metadata (strings): format, version, n, groups, model, tokenizer, step, temperature, name, data_seed,
                        run_id
Response r = g * n + i is rollout i of prompt g. Loading validates format, version, n, shapes,
offsets, finiteness, prompt ids and the run identity, and every error names the file.

Beside the step files, an online pair keeps (section "Run identity and liveness"):
    <exchange>/RUN                 JSON {run_id, founder, created}: written once, by the first side
    <exchange>/<side>/RUN_ID       the run this side joined (a side joins a run once)
    <exchange>/<side>/HEARTBEAT    JSON {run_id, pid, step, time, state}, rewritten every few seconds
    <exchange>/<side>/FAILED       JSON {run_id, error}: written by a side that dies of an exception
                                   or SIGTERM, so its peer stops at once instead of timing out
A file or marker of another run is never taken for this run's: step files are checked against the
run id, stale markers are ignored, and a side that finds a dead run in its folder says so at start.

Imports torch and safetensors only (nothing of GRAFT's), so another trainer can read and write the
same files.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch

ROLLOUT_FORMAT = "graft-rollouts"
ROLLOUT_VERSION = "1"


@dataclass
class StepRollouts:
    """One model's rollouts of one step, for the whole batch: G prompts x n responses, row-major.

    Response r = g * n + i is rollout i of prompt g. This is exactly what goes into a rollout file.
    """

    prompt_ids: list[str]  # (G,) dataset ids
    tokens: list[list[int]]  # G*n response token ids (EOS included when it ended with EOS)
    logprobs: list[torch.Tensor]  # G*n (len,) float32 behaviour log-probs
    texts: list[str]  # G*n decoded response text (no special tokens, EOS dropped)
    eos: torch.Tensor  # (G, n) bool
    rewards: torch.Tensor  # (G, n) float32
    advantages: torch.Tensor  # (G, n) float32, on the full group, before any filtering

    @property
    def n(self) -> int:
        return self.rewards.shape[1]

    @property
    def mask(self) -> torch.Tensor:
        """(G, n) bool, all True: every slot holds a response (a foreign log's groups may not)."""
        return torch.ones_like(self.rewards, dtype=torch.bool)

    @property
    def sizes(self) -> torch.Tensor:
        """(G,) responses per prompt: n for every prompt of a rollout file."""
        return torch.full((self.rewards.shape[0],), self.n, dtype=torch.long)

    def num_bytes(self) -> torch.Tensor:
        """(G, n) UTF-8 length of each response text (for --compat-norm byte; at least 1)."""
        return torch.tensor([max(1, len(t.encode("utf-8"))) for t in self.texts]).view_as(self.rewards)

    def lbar(self, norm: str) -> torch.Tensor:
        """(G, n) mean behaviour log-prob per token ('token', Eq. 6) or per byte ('byte', departure 2)."""
        sums = torch.stack([lp.sum() if lp.numel() else lp.new_zeros(()) for lp in self.logprobs]).view_as(self.rewards)
        if norm == "byte":
            return sums / self.num_bytes()
        return sums / torch.tensor([max(1, len(t)) for t in self.tokens]).view_as(self.rewards)


def _pack_strings(strings: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    data = [s.encode("utf-8", errors="replace") for s in strings]
    offsets = torch.tensor([0] + [len(d) for d in data], dtype=torch.int64).cumsum(0)
    packed = torch.frombuffer(bytearray(b"".join(data)) or bytearray(1), dtype=torch.uint8)[: int(offsets[-1])]
    return packed.clone(), offsets


def _unpack_strings(data: torch.Tensor, offsets: torch.Tensor) -> list[str]:
    raw = bytes(data.tolist())
    o = offsets.tolist()
    return [raw[o[i]: o[i + 1]].decode("utf-8") for i in range(len(o) - 1)]


def atomic_write(path: Path, write) -> None:
    """write(tmp_path), then rename onto path: readers never see a half-written file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    write(tmp)
    os.replace(tmp, path)


def save_rollouts(path: Path, r: StepRollouts, meta: dict) -> None:
    """Write a rollout file atomically: safetensors tensors + string metadata."""
    from safetensors.torch import save_file
    G, n = r.rewards.shape
    lens = [len(t) for t in r.tokens]
    tok_off = torch.tensor([0] + lens, dtype=torch.int64).cumsum(0)
    flat_tokens = torch.tensor([x for t in r.tokens for x in t], dtype=torch.int64)
    flat_lp = torch.cat([lp.float().cpu() for lp in r.logprobs]) if flat_tokens.numel() else torch.zeros(0)
    text_data, text_off = _pack_strings(r.texts)
    id_data, id_off = _pack_strings(r.prompt_ids)
    tensors = {
        "rewards": r.rewards.float().contiguous(), "advantages": r.advantages.float().contiguous(),
        "mean_logprob": r.lbar("token").float().contiguous(), "eos": r.eos.bool().contiguous(),
        "tokens": flat_tokens, "token_offsets": tok_off, "logprobs": flat_lp.contiguous(),
        "text": text_data, "text_offsets": text_off, "prompt_ids": id_data, "prompt_id_offsets": id_off,
    }
    metadata = {k: str(v) for k, v in meta.items()}
    metadata.update(format=ROLLOUT_FORMAT, version=ROLLOUT_VERSION, n=str(n), groups=str(G))
    atomic_write(path, lambda tmp: save_file(tensors, str(tmp), metadata=metadata))


def load_rollouts(path: Path, *, n: int | None = None, prompt_ids: list[str] | None = None,
                  run_id: str | None = None) -> tuple[StepRollouts, dict]:
    """Read and validate a rollout file; every error names the file and what is wrong.

    n, prompt_ids, run_id: what this run expects (None = not checked). Non-finite rewards,
    advantages or log-probs are refused: one NaN advantage would turn every weight into NaN.
    """
    from safetensors import safe_open
    path = Path(path)
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            t = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:  # corrupt, truncated or not safetensors at all
        raise ValueError(f"{path}: not a readable rollout file ({type(e).__name__}: {e})") from e
    if meta.get("format") != ROLLOUT_FORMAT:
        raise ValueError(f"{path}: not a GRAFT rollout file (format={meta.get('format')!r})")
    if meta.get("version") != ROLLOUT_VERSION:
        raise ValueError(f"{path}: format version {meta.get('version')!r}, this code reads version {ROLLOUT_VERSION}")
    need = ["rewards", "advantages", "eos", "tokens", "token_offsets", "logprobs", "text", "text_offsets",
            "prompt_ids", "prompt_id_offsets"]
    missing = [k for k in need if k not in t]
    if missing:
        raise ValueError(f"{path}: missing tensors {missing}")
    G, file_n = t["rewards"].shape
    if n is not None and file_n != n:
        raise ValueError(f"{path}: has n={file_n} rollouts per prompt, this run uses n={n}")
    ok = (t["advantages"].shape == (G, file_n) and t["eos"].shape == (G, file_n)
          and t["token_offsets"].shape == (G * file_n + 1,) and t["text_offsets"].shape == (G * file_n + 1,)
          and t["prompt_id_offsets"].shape == (G + 1,) and int(t["token_offsets"][-1]) == t["tokens"].numel()
          and t["logprobs"].numel() == t["tokens"].numel() and bool((t["token_offsets"].diff() >= 0).all()))
    if not ok:
        raise ValueError(f"{path}: inconsistent shapes or offsets (G={G}, n={file_n})")
    for key in ("rewards", "advantages", "logprobs", "mean_logprob"):
        if key in t and not bool(torch.isfinite(t[key]).all()):
            bad = int((~torch.isfinite(t[key])).sum())
            raise ValueError(f"{path}: field {key!r} holds {bad} non-finite values (NaN or inf); "
                             f"the file is corrupt or its writer diverged")
    if run_id is not None and meta.get("run_id") != run_id:
        raise ValueError(f"{path}: written by run {meta.get('run_id')!r}, this pair is run {run_id!r}: a file left "
                         f"by another run in the exchange folder (start a new pair in a fresh --peer-exchange)")
    try:
        texts = _unpack_strings(t["text"], t["text_offsets"])
        ids = _unpack_strings(t["prompt_ids"], t["prompt_id_offsets"])
    except (UnicodeDecodeError, IndexError) as e:
        raise ValueError(f"{path}: bad text or prompt-id bytes ({e})") from e
    if prompt_ids is not None and ids != list(prompt_ids):
        diff = next(i for i, (a, b) in enumerate(zip(ids + [None] * len(prompt_ids), prompt_ids)) if a != b)
        raise ValueError(f"{path}: prompt ids differ from this run's batch (first at position {diff}: file has "
                         f"{ids[diff] if diff < len(ids) else 'nothing'!r}, this run {prompt_ids[diff]!r}); "
                         f"both sides need the same --prompts, --data-seed and --prompts-per-step")
    o = t["token_offsets"].tolist()
    tokens = [t["tokens"][o[i]: o[i + 1]].tolist() for i in range(G * file_n)]
    logprobs = [t["logprobs"][o[i]: o[i + 1]].float() for i in range(G * file_n)]
    r = StepRollouts(prompt_ids=ids, tokens=tokens, logprobs=logprobs, texts=texts, eos=t["eos"].bool(),
                     rewards=t["rewards"].float(), advantages=t["advantages"].float())
    return r, meta


def file_run_id(path: Path) -> str | None:
    """The run id in a rollout file's metadata (a header read), or None if it has none or is unreadable."""
    from safetensors import safe_open
    try:
        with safe_open(str(path), framework="pt") as f:
            return (f.metadata() or {}).get("run_id")
    except Exception:  # half-replaced or foreign: not this run's file
        return None


def rollout_path(exchange: Path, name: str, step: int) -> Path:
    return Path(exchange) / name / f"step_{step:06d}.safetensors"


def wait_for_file(path: Path, *, timeout: float, poll: float = 0.2, run_id: str | None = None,
                  dead_after: float = 60.0) -> float:
    """Block until path exists; returns seconds waited.

    Stops early, with an error naming the file, when the peer whose folder holds path is known to be
    gone: its FAILED marker (of this run; a marker of another run is stale and ignored), its heartbeat
    saying it finished, or its heartbeat older than dead_after seconds (killed by a signal or out of
    memory: it wrote nothing). A peer that has not started yet has no heartbeat of this run: then
    only the timeout applies. run_id=None: no run check (markers of any run count).
    """
    t0 = time.time()
    side = Path(path).parent
    stale_noted = False
    # A file of another run (left in the folder) counts as not written yet: the peer of this run
    # will replace it atomically.
    while not (Path(path).exists() and (run_id is None or file_run_id(path) == run_id)):
        failed = read_json(side / "FAILED")
        if failed is not None and (run_id is None or failed.get("run_id") == run_id):
            raise RuntimeError(f"the peer failed before writing {path}: {str(failed.get('error'))[-2000:]}")
        if not stale_noted and (failed is not None or Path(path).exists()):
            what = side / "FAILED" if failed is not None else Path(path)
            other = failed.get("run_id") if failed is not None else file_run_id(path)
            print(f"[exchange] ignoring {what}: it belongs to run {other!r}, not this run {run_id!r}",
                  file=sys.stderr, flush=True)
            stale_noted = True
        beat = read_json(side / "HEARTBEAT")
        if beat is not None and run_id is not None and beat.get("run_id") == run_id:
            age = time.time() - float(beat.get("time", 0))
            if beat.get("state") == "finished":
                raise RuntimeError(f"the peer finished (last step {beat.get('step')}) without writing {path}: "
                                   f"do both sides use the same --steps?")
            if age > dead_after:
                raise RuntimeError(f"the peer is dead: no heartbeat in {side / 'HEARTBEAT'} for {age:.0f}s "
                                   f"(pid {beat.get('pid')}, last at step {beat.get('step')}); it was killed or "
                                   f"ran out of memory before writing {path}: see its log, then relaunch both "
                                   f"with --resume")
        if time.time() - t0 > timeout:
            raise TimeoutError(f"waited {timeout:.0f}s for the peer's rollout file {path}; is the peer process "
                               f"running with the same --peer-exchange and --steps? (raise --exchange-timeout)")
        time.sleep(poll)
    return time.time() - t0


# ------------------------------------------------------------------------------------------------
# Run identity and liveness: a pair never mistakes another run's files for its own
# ------------------------------------------------------------------------------------------------


def read_json(path: Path) -> dict | None:
    """A small JSON file written atomically by the other process, or None if absent or unreadable."""
    try:
        value = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def write_json(path: Path, value: dict) -> None:
    atomic_write(Path(path), lambda tmp: Path(tmp).write_text(json.dumps(value)))


def heartbeat_age(exchange: Path, side: str, run_id: str) -> float | None:
    """Seconds since side's last heartbeat in this run, or None if it has none of this run."""
    beat = read_json(Path(exchange) / side / "HEARTBEAT")
    if beat is None or beat.get("run_id") != run_id or beat.get("state") != "running":
        return None
    return time.time() - float(beat.get("time", 0))


def new_run_id() -> str:
    return uuid.uuid4().hex[:12]


def join_run(exchange: Path, name: str, *, previous: str = "", run_id: str = "", dead_after: float = 60.0) -> str:
    """Found or join the run that owns an exchange folder; returns its id. Raises RuntimeError
    naming the folder when this side may not take part.

    previous: the run this side's own run directory belongs to (--resume), "" for a fresh start.
    run_id: an id both sides were given (--run-id), "" to let the first side draw one.
    A fresh side founds the run when the folder has none, joins it when its founder is alive (a
    heartbeat of that run younger than dead_after), and refuses when it had already joined that run
    (an earlier run, not resumed) or the founder is not running (a dead run's leftovers).
    """
    exchange = Path(exchange)
    (exchange / name).mkdir(parents=True, exist_ok=True)
    run_file, mine = exchange / "RUN", exchange / name / "RUN_ID"
    for _ in range(100):  # retried only while two sides race to found the run
        record = read_json(run_file)
        if record is None:
            if run_file.exists():
                raise RuntimeError(f"{run_file}: not a readable run record; delete it or use a fresh --peer-exchange")
            rid = run_id or previous or new_run_id()
            # A first heartbeat before the record appears: a peer that reads the record must find
            # its founder alive, even before the founder's Heartbeat thread starts.
            write_json(exchange / name / "HEARTBEAT", {"run_id": rid, "pid": os.getpid(), "step": -1,
                                                       "time": time.time(), "state": "running"})
            tmp = run_file.with_name(f".RUN.tmp.{os.getpid()}")
            tmp.write_text(json.dumps({"run_id": rid, "founder": name, "created": time.time()}))
            try:
                os.link(tmp, run_file)  # atomic and exclusive: fails if the peer founded it first
            except FileExistsError:
                continue
            finally:
                tmp.unlink(missing_ok=True)
            mine.write_text(rid)
            return rid
        rid, founder = str(record.get("run_id")), str(record.get("founder"))
        joined = mine.read_text().strip() if mine.is_file() else ""
        if previous:
            if rid != previous:
                raise RuntimeError(f"{run_file}: the exchange folder belongs to run {rid}, but this side's --out "
                                   f"belongs to run {previous}: resume with the exchange folder of that run")
            mine.write_text(rid)
            return rid
        if run_id and rid != run_id:
            raise RuntimeError(f"{run_file}: the exchange folder belongs to run {rid}, not --run-id {run_id}")
        if joined == rid:
            raise RuntimeError(f"{run_file}: side {name!r} already took part in run {rid} of this exchange folder; "
                               f"to continue it pass --resume, to start a new pair use a fresh --peer-exchange "
                               f"(or --force on both sides)")
        age = heartbeat_age(exchange, founder, rid)
        if founder != name and (age is None or age > dead_after):
            raise RuntimeError(f"{run_file}: run {rid} was started by side {founder!r}, which is not running now "
                               f"(no live heartbeat): these are a dead run's files; use a fresh --peer-exchange, "
                               f"or --force on both sides to start over here")
        mine.write_text(rid)
        return rid
    raise RuntimeError(f"{run_file}: could not found or join the run (it keeps changing)")


def leave_run(exchange: Path, name: str) -> None:
    """--force: forget this side's part in the folder's run (its step files, markers, RUN_ID); the
    run record too when no other side of that run is alive, so the next start founds a new run."""
    import shutil
    exchange = Path(exchange)
    shutil.rmtree(exchange / name, ignore_errors=True)
    record = read_json(exchange / "RUN")
    if record is None:
        (exchange / "RUN").unlink(missing_ok=True)
        return
    rid = str(record.get("run_id"))
    others = [p.name for p in exchange.iterdir() if p.is_dir() and p.name != name]
    if not any((age := heartbeat_age(exchange, o, rid)) is not None and age < 60 for o in others):
        (exchange / "RUN").unlink(missing_ok=True)


class Heartbeat:
    """A daemon thread rewriting <exchange>/<side>/HEARTBEAT every `interval` seconds.

    The file is what a waiting peer reads to tell "slow" from "dead" (wait_for_file). step is
    updated by the trainer; stop(state) writes a last beat ("finished" or "failed")."""

    def __init__(self, exchange: Path, name: str, run_id: str, *, interval: float = 10.0):
        self.path = Path(exchange) / name / "HEARTBEAT"
        self.run_id, self.interval, self.step = run_id, interval, -1
        self._stop = threading.Event()
        self.beat()
        self._thread = threading.Thread(target=self._loop, name="graft-heartbeat", daemon=True)
        self._thread.start()

    def beat(self, state: str = "running") -> None:
        write_json(self.path, {"run_id": self.run_id, "pid": os.getpid(), "step": self.step, "time": time.time(),
                               "state": state})

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.beat()
            except OSError:  # a full or flaky disk must not kill training; the next beat retries
                pass

    def stop(self, state: str) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.beat(state)


def write_failed(exchange: Path, name: str, run_id: str, error: str) -> None:
    """The marker a dying side leaves so that its peer stops at once (read by wait_for_file)."""
    write_json(Path(exchange) / name / "FAILED", {"run_id": run_id, "error": error})


def batch_indices(num_prompts: int, step: int, prompts_per_step: int, data_seed: int) -> list[int]:
    """Dataset rows of a step: a stream of seeded per-epoch permutations, cut into consecutive batches.

    A pure function of (step, seed), so both sides of a pair and a resumed run see the same prompts.
    """
    start, out = step * prompts_per_step, []
    while len(out) < prompts_per_step:
        epoch, pos = divmod(start + len(out), num_prompts)
        perm = torch.randperm(num_prompts, generator=torch.Generator().manual_seed(data_seed * 100003 + epoch))
        out.extend(perm[pos: pos + prompts_per_step - len(out)].tolist())
    return out
