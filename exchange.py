"""GRAFT exchange files: one model's rollouts of one step, as a safetensors file (README "Files").

The two processes of an online pair meet through these files (each writes its own, atomically, and
waits for the peer's); the stored-trajectory variant reads a finished run's files; and every run's
exchange folder is its trajectory log. An online peer and a stored one therefore share one format.

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
    <exchange>/RUN                 JSON {run_id, founder, sides, pair, created}: written once, by the
                                   first side; sides = the founder and the peers it names, pair = the
                                   settings both sides must share (pair_settings in runtime.py)
    <exchange>/.attempts/<run>.<k>         JSON {founder, created}: attempt k >= 1 of the run, founded
                                   by the first side relaunched with --resume (attempt 0 is the RUN)
    <exchange>/.attempts/<run>.<k>.<side>  side took part in attempt k (created once, exclusively)
    <exchange>/<side>/RUN_ID       the run this side joined (a side joins a run once)
    <exchange>/<side>/HEARTBEAT    JSON {run_id, attempt, pid, step, time, state}, rewritten every few seconds
    <exchange>/<side>/FAILED       JSON {run_id, attempt, error}: written by a side that dies of an
                                   exception or a signal, so its peer stops at once instead of timing out
A file or marker of another run is never taken for this run's: step files are checked against the
run id, markers and heartbeats of another run or of an earlier attempt are ignored (a pair relaunched
with --resume after any failure is a new attempt of the same run), and a side that finds a dead run
in its folder says so at start. Step files are the run's, whichever attempt wrote them: a step is a
pure function of the checkpoint it starts from.

Imports torch and safetensors only (nothing of GRAFT's), so another trainer can read and write the
same files.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch

from core import sampled_lbar  # Rollouts.lbar, shared with core.PlainRollouts

ROLLOUT_FORMAT = "graft-rollouts"
ROLLOUT_VERSION = "1"


@dataclass
class StepRollouts:
    """One side's rollouts of one step, for the whole batch: G prompts x n responses, row-major. The one peer-step
    type: an online peer's and a stored run's (a rollout file) and a foreign log's (foreign.ForeignLog.step).

    It is a core.Rollouts, the interface GRAFT's rule phases read (tests/test_port.py checks every member).
    Response r = g * n + i is rollout i of prompt g. The required fields are exactly what goes into a rollout
    file. A foreign log's step fills G x M slots instead, M its widest group: `slots` says which exist (padding:
    text "", eos False, reward 0, advantage 0), and the source's lbar comes given per response (`given_lbar`,
    `num_tokens`), not from token log-probs (tokens and logprobs are empty lists then).
    """

    prompt_ids: list[str]  # (G,) dataset ids
    tokens: list[list[int]]  # G*n response token ids (EOS included when it ended with EOS); [] for a foreign log
    logprobs: list[torch.Tensor]  # G*n (len,) float32 behaviour log-probs; [] for a foreign log
    texts: list[str]  # G*n decoded response text (no special tokens, EOS dropped)
    eos: torch.Tensor  # (G, n) bool
    rewards: torch.Tensor  # (G, n) float32
    advantages: torch.Tensor  # (G, n) float32, on the full group, before any filtering
    slots: torch.Tensor | None = None  # (G, M) bool, which slots hold a response (a foreign log); None = all
    given_lbar: torch.Tensor | None = None  # (G, M) float32, the source's lbar per source token (NaN: unknown)
    num_tokens: torch.Tensor | None = None  # (G, M) int64, source token counts (-1: unknown), with given_lbar
    lines: torch.Tensor | None = None  # (G, M) int64, a foreign response's line in its file (0 on padding)

    @property
    def n(self) -> int:
        return self.rewards.shape[1]

    @property
    def width(self) -> int:
        """Slots per prompt, the stride of r = g * width + i: n (a foreign log's step: its widest group M)."""
        return self.n

    @property
    def mask(self) -> torch.Tensor:
        """(G, width) bool: which slots hold a response (all of a rollout file's; a foreign log's groups may not)."""
        return self.slots if self.slots is not None else torch.ones_like(self.rewards, dtype=torch.bool)

    @property
    def sizes(self) -> torch.Tensor:
        """(G,) int64 responses per prompt: the n of graft_candidates (mixed: 1 <= k < size)."""
        return self.mask.sum(dim=1)

    def num_bytes(self) -> torch.Tensor:
        """(G, n) UTF-8 length of each response text (for --compat-norm byte; at least 1)."""
        return torch.tensor([max(1, len(t.encode("utf-8"))) for t in self.texts],
                            device=self.rewards.device).view_as(self.rewards)

    def lbar(self, norm: str) -> torch.Tensor:
        """(G, n) mean behaviour log-prob per token ('token', Eq. 6: over the ids as sampled, EOS included when it
        ended with EOS) or per byte ('byte', departure 2); 0 on padding.

        A foreign log's step must have what the norm needs on every existing slot (ForeignLog.require_lbar
        checks this up front)."""
        assert norm in ("token", "byte"), f"norm must be token or byte, got {norm!r}"
        if self.given_lbar is not None:
            lb = torch.where(self.mask, self.given_lbar, torch.zeros_like(self.given_lbar))  # (G, M)
            assert not bool(lb.isnan().any()), "a foreign response has no lbar: call ForeignLog.require_lbar first"
            if norm == "token":
                return lb
            assert not bool((self.mask & (self.num_tokens < 1)).any()), "byte norm needs num_tokens for every response"
            return lb * self.num_tokens.clamp(min=0).float() / self.num_bytes()
        return sampled_lbar(self.logprobs, self.tokens, self.texts, norm=norm, like=self.rewards)  # (G, n)


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
    """write(tmp_path), then rename onto path: readers never see a half-written file.

    A failed write (full disk, read-only folder) removes its temporary file and raises OSError
    naming path and the OS error; path keeps its previous content."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException as e:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(e, Exception):
            raise OSError(getattr(os_error(e), "errno", None) or errno.EIO,
                          f"{path}: cannot write ({describe_write_error(e, path.parent)})") from e
        raise


def os_error(e: BaseException) -> OSError | None:
    """The OSError behind an exception (a writer may wrap it in its own error), or None."""
    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, OSError):
            return e
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return None


def describe_write_error(e: BaseException, folder: Path) -> str:
    """The OS error of a failed write, with the free space left where it wrote: torch and safetensors
    report a full disk as their own error ("unexpected pos ..."), so the free space says it."""
    oe = os_error(e)
    text = f"{oe.strerror or oe} [{errno.errorcode.get(oe.errno, oe.errno)}]" if oe is not None else \
        f"{type(e).__name__}: {e}"
    try:
        free = shutil.disk_usage(folder).free
        text += f"; {free / 2**20:.1f} MiB free on that disk"
    except OSError:
        pass
    return text


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


def _read_tensors(path: Path, keys: list[str], *, only: bool = False) -> tuple[dict[str, torch.Tensor], dict]:
    """The tensors of a rollout file (only ``keys`` when ``only``; every one of ``keys`` must be there) and its
    metadata, after the format and version checks: the one place that opens the file (load_rollouts, read_rewards)."""
    from safetensors import safe_open
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            names = set(f.keys())
            t = {k: f.get_tensor(k) for k in (names & set(keys) if only else names)}
    except Exception as e:  # corrupt, truncated or not safetensors at all
        raise ValueError(f"{path}: not a readable rollout file ({type(e).__name__}: {e})") from e
    if meta.get("format") != ROLLOUT_FORMAT:
        raise ValueError(f"{path}: not a GRAFT rollout file (format={meta.get('format')!r})")
    if meta.get("version") != ROLLOUT_VERSION:
        raise ValueError(f"{path}: format version {meta.get('version')!r}, this code reads version {ROLLOUT_VERSION}")
    missing = [k for k in keys if k not in t]
    if missing:
        raise ValueError(f"{path}: missing tensors {missing}")
    return t, meta


def read_rewards(path: str | os.PathLike) -> tuple[list[str], torch.Tensor, dict]:
    """The prompt ids (G,), rewards (G, n) float32 and metadata of one rollout file, nothing else.

    load_rollouts decodes every token and text of the file, which for a paper-sized run (128 x 8 responses of up
    to 4096 tokens per step) costs far more than statistics over rewards need (`graft.py complement`); this reads
    the three tensors, with the same format checks. Errors name the file.
    """
    path = Path(path)
    t, meta = _read_tensors(path, ["rewards", "prompt_ids", "prompt_id_offsets"], only=True)
    rewards, offsets = t["rewards"], t["prompt_id_offsets"]
    G = rewards.shape[0] if rewards.dim() == 2 else -1
    o = offsets.tolist()
    if G < 0 or len(o) != G + 1 or o[0] != 0 or o[-1] > t["prompt_ids"].numel() \
            or any(b < a for a, b in zip(o, o[1:])):
        raise ValueError(f"{path}: inconsistent rewards / prompt-id shapes")
    try:
        ids = _unpack_strings(t["prompt_ids"], offsets)
    except (UnicodeDecodeError, IndexError) as e:
        raise ValueError(f"{path}: bad prompt-id bytes ({e})") from e
    return ids, rewards.float(), meta


def load_rollouts(path: Path, *, n: int | None = None, prompt_ids: list[str] | None = None,
                  run_id: str | None = None) -> tuple[StepRollouts, dict]:
    """Read and validate a rollout file; every error names the file and what is wrong.

    n, prompt_ids, run_id: what this run expects (None = not checked). Non-finite rewards,
    advantages or log-probs are refused: one NaN advantage would turn every weight into NaN.
    """
    path = Path(path)
    t, meta = _read_tensors(path, ["rewards", "advantages", "eos", "tokens", "token_offsets", "logprobs", "text",
                                   "text_offsets", "prompt_ids", "prompt_id_offsets"])
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


class OnlinePeers:
    """The online peers as a peer source (one of three: foreign.StoredRun and foreign.ForeignLog are the others, with
    the same `read`, `both_ways` and `describe`): each live side's rollout file of the step, waited for in the exchange
    directory. They receive from this side too, so the selection balances the two directions (both_ways)."""

    both_ways = True

    def __init__(self, exchange: Path, names: list[str], *, me: str, n: int, timeout: float, dead_after: float):
        self.exchange, self.names, self.me, self.n = Path(exchange), list(names), me, n
        self.timeout, self.dead_after = timeout, dead_after
        self.run_id: str | None = None  # the pair's run identity and attempt, set when this side joins the run
        self.attempt = 0
        self.join_by: float | None = None  # the peers' join deadline, set once this side's model has loaded

    def describe(self) -> str:
        """The peer source in a few words, for the trainer's start-up lines."""
        return f"online (exchange {self.exchange}, peers {', '.join(self.names)})"

    def read(self, step: int, own: StepRollouts) -> tuple[dict[str, StepRollouts], dict]:
        """Each peer's rollouts of this step, by side name, checked against this side's batch (own.prompt_ids)
        and run; no counts. Waits for each file (wait_for_file: a dead or departed peer stops the wait)."""
        out = {}
        for name in self.names:
            path = rollout_path(self.exchange, name, step)
            wait_for_file(path, timeout=self.timeout, run_id=self.run_id, attempt=self.attempt, join_by=self.join_by,
                          me=self.me, dead_after=self.dead_after)
            out[name], _ = load_rollouts(path, n=self.n, prompt_ids=own.prompt_ids, run_id=self.run_id)
        return out, {}


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
                  attempt: int | None = None, join_by: float | None = None, me: str = "",
                  dead_after: float = 60.0) -> float:
    """Block until path exists; returns seconds waited.

    Stops early, with an error naming the file, when the peer whose folder holds path is known to be
    gone: its FAILED marker of this run and attempt, its heartbeat saying it finished, or its
    heartbeat older than dead_after seconds (killed by a signal or out of memory: it wrote nothing).
    Markers of another run or of an earlier attempt are stale and ignored. A peer whose heartbeat is
    not of this attempt yet has not joined: past join_by (a time.time() value; None = no limit) that
    is an error naming the exchange folder and the side. A peer of a later attempt, or a newer process
    of this side (me), means this process was left behind by a relaunch: it stops.
    run_id=None: no run check; attempt=None: no attempt check (markers of any attempt count).
    """
    t0 = time.time()
    side = Path(path).parent
    exchange, peer = side.parent, side.name
    stale_noted, next_check = False, 0.0
    # A file of another run (left in the folder) counts as not written yet: the peer of this run
    # will replace it atomically.
    while not (Path(path).exists() and (run_id is None or file_run_id(path) == run_id)):
        if me and attempt is not None and time.time() > next_check:
            newer = newest_attempt_of(exchange, me, run_id)
            if newer > attempt:
                raise RuntimeError(f"side {me!r} was relaunched: a newer process took part in attempt {newer} of "
                                   f"run {run_id} in {exchange}; this process (attempt {attempt}) stops")
            next_check = time.time() + 2.0
        failed = read_json(side / "FAILED")
        beat = read_json(side / "HEARTBEAT")
        if failed is not None and (run_id is None or failed.get("run_id") == run_id):
            their = int(failed.get("attempt", 0))
            if attempt is None or their == attempt:
                raise RuntimeError(f"the peer failed before writing {path}: {str(failed.get('error'))[-2000:]}\n"
                                   f"(fix the cause, then relaunch both sides, every node of each, with --resume)")
            if their > attempt:
                raise RuntimeError(left_behind(exchange, peer, run_id, their, attempt))
        if not stale_noted and failed is not None:
            whose = (f"attempt {failed.get('attempt', 0)} of this run, not attempt {attempt}"
                     if failed.get("run_id") == run_id else f"run {failed.get('run_id')!r}, not this run {run_id!r}")
            print(f"[exchange] ignoring {side / 'FAILED'}: it belongs to {whose}", file=sys.stderr, flush=True)
            stale_noted = True
        elif not stale_noted and Path(path).exists():
            # Read the file's run id again: the peer may have written this run's file since the loop's
            # test (a race seen in practice); then the loop's next test takes it, and there is nothing
            # stale to report.
            other = file_run_id(path)
            if other != run_id:
                print(f"[exchange] ignoring {path}: it belongs to run {other!r}, not this run {run_id!r}",
                      file=sys.stderr, flush=True)
                stale_noted = True
        joined = (beat is not None and run_id is not None and beat.get("run_id") == run_id
                  and (attempt is None or int(beat.get("attempt", 0)) == attempt))
        if joined:
            age = time.time() - float(beat.get("time", 0))
            if beat.get("state") == "finished":
                raise RuntimeError(f"the peer finished (last step {beat.get('step')}) without writing {path}: "
                                   f"do both sides use the same --steps?")
            if age > dead_after:
                raise RuntimeError(f"the peer is dead: no heartbeat in {side / 'HEARTBEAT'} for {age:.0f}s "
                                   f"(pid {beat.get('pid')}, last at step {beat.get('step')}); it was killed or "
                                   f"ran out of memory before writing {path}: see its log, then relaunch both "
                                   f"sides, every node of each, with --resume")
        elif attempt is not None and beat is not None and beat.get("run_id") == run_id \
                and int(beat.get("attempt", 0)) > attempt:
            raise RuntimeError(left_behind(exchange, peer, run_id, int(beat["attempt"]), attempt))
        elif join_by is not None and time.time() > join_by:
            raise TimeoutError(f"side {peer!r} has not joined run {run_id} (attempt {attempt}) in {exchange} "
                               f"within --join-timeout: is it running, with --peer-exchange {exchange} (and "
                               f"--resume if this side resumed)? See its log")
        if time.time() - t0 > timeout:
            raise TimeoutError(f"waited {timeout:.0f}s for the peer's rollout file {path}; is the peer process "
                               f"running with the same --peer-exchange and --steps? (raise --exchange-timeout)")
        time.sleep(poll)
    return time.time() - t0


def left_behind(exchange: Path, peer: str, run_id: str | None, theirs: int, mine: int) -> str:
    return (f"side {peer!r} runs attempt {theirs} of run {run_id} in {exchange}: it was relaunched while this "
            f"process ran attempt {mine}; relaunch this side with --resume to join it")


# ------------------------------------------------------------------------------------------------
# Run identity and liveness: a pair never mistakes another run's files for its own
# ------------------------------------------------------------------------------------------------


def file_sha256(path: str | os.PathLike) -> str:
    """SHA-256 of a file's bytes, read in 1 MiB blocks (the prompts file of a run: --resume refuses a changed
    one; a foreign log: its lbar cache is keyed on it)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def read_json(path: Path) -> dict | None:
    """A small JSON file written atomically by the other process, or None if absent or unreadable."""
    try:
        value = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def write_json(path: Path, value: dict) -> None:
    atomic_write(Path(path), lambda tmp: Path(tmp).write_text(json.dumps(value)))


def create_exclusive(path: Path, value: dict) -> bool:
    """Write a JSON file only if path does not exist yet (atomic and exclusive, by a hard link);
    False when another process created it first."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    tmp.write_text(json.dumps(value))
    try:
        os.link(tmp, path)
        return True
    except FileExistsError:
        return False
    finally:
        tmp.unlink(missing_ok=True)


def heartbeat_age(exchange: Path, side: str, run_id: str, attempt: int | None = None) -> float | None:
    """Seconds since side's last heartbeat in this run (and attempt, unless None), or None if it has
    none of them or says it stopped."""
    beat = read_json(Path(exchange) / side / "HEARTBEAT")
    if beat is None or beat.get("run_id") != run_id or beat.get("state") != "running":
        return None
    if attempt is not None and int(beat.get("attempt", 0)) != attempt:
        return None
    return time.time() - float(beat.get("time", 0))


def alive(exchange: Path, side: str, run_id: str, attempt: int | None, dead_after: float) -> bool:
    age = heartbeat_age(exchange, side, run_id, attempt)
    return age is not None and age <= dead_after


def new_run_id() -> str:
    return uuid.uuid4().hex[:12]


def attempts_dir(exchange: Path) -> Path:
    return Path(exchange) / ".attempts"


def current_attempt(exchange: Path, run_id: str) -> tuple[int, dict]:
    """(k, record {founder, created}) of the run's newest attempt; attempt 0 is the run's founding
    (the RUN record)."""
    ks = [int(p.name.split(".")[1]) for p in attempts_dir(exchange).glob(f"{run_id}.[0-9]*")
          if p.name.count(".") == 1]
    if not ks:
        return 0, read_json(Path(exchange) / "RUN") or {}
    k = max(ks)
    return k, read_json(attempts_dir(exchange) / f"{run_id}.{k:06d}") or {}


def take_part(exchange: Path, run_id: str, attempt: int, name: str) -> bool:
    """Record that side name takes part in the attempt; False if it already did (once per side)."""
    return create_exclusive(attempts_dir(exchange) / f"{run_id}.{attempt:06d}.{name}",
                            {"pid": os.getpid(), "time": time.time()})


def newest_attempt_of(exchange: Path, name: str, run_id: str | None) -> int:
    """The newest attempt of the run that side name took part in (-1: none)."""
    ks = [int(p.name.split(".")[1]) for p in attempts_dir(exchange).glob(f"{run_id}.[0-9]*.{name}")]
    return max(ks, default=-1)


def founder_alive(exchange: Path, founder: str, run_id: str, attempt: int | None, record: dict,
                  dead_after: float) -> bool:
    """A run's or attempt's founder is alive: its heartbeat of that run and attempt says running and
    is younger than dead_after, or it has none yet and the record is younger than dead_after (its
    Heartbeat thread may not have started; a founder writes nothing into its side folder before its
    record exists, so that a process that loses the race to found never overwrites the winner's
    heartbeat)."""
    beat = read_json(Path(exchange) / founder / "HEARTBEAT") or {}
    if beat.get("run_id") == run_id and (attempt is None or int(beat.get("attempt", 0)) == attempt):
        return alive(exchange, founder, run_id, attempt, dead_after)
    return time.time() - float(record.get("created", 0)) <= dead_after


def join_run(exchange: Path, name: str, *, peer_names: list[str] | None = None, pair: dict | None = None,
             previous: str = "", run_id: str = "", dead_after: float = 60.0) -> str:
    """Found or join the run that owns an exchange folder; returns its id. Raises RuntimeError
    naming the folder when this side may not take part.

    peer_names: the sides this side pairs with (None = not checked); pair: the settings both sides must
    share (None = not checked). previous: the run this side's own run directory belongs to
    (--resume; then join_attempt picks the attempt), "" for a fresh start. run_id: an id both sides
    were given (--run-id), "" to let the first side draw one.
    A fresh side founds the run when the folder has none. It joins the run when the founder is one of
    its peers and names this side among its own, the pair settings agree, the founder is alive (a
    heartbeat younger than dead_after) and no process took this side's part yet. It refuses an
    earlier run it took part in (not resumed) and a dead run's leftovers.
    """
    exchange = Path(exchange)
    (exchange / name).mkdir(parents=True, exist_ok=True)
    run_file, mine = exchange / "RUN", exchange / name / "RUN_ID"
    sides = sorted({name, *peer_names}) if peer_names is not None else None
    for _ in range(100):  # retried only while two sides race to found the run
        record = read_json(run_file)
        if record is None:
            if run_file.exists():
                raise RuntimeError(f"{run_file}: not a readable run record; delete it or use a fresh --peer-exchange")
            rid = run_id or previous or new_run_id()
            if not create_exclusive(run_file, {"run_id": rid, "founder": name, "sides": sides, "pair": pair,
                                               "created": time.time()}):
                continue  # the peer founded it first
            if not previous:
                take_part(exchange, rid, 0, name)
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
        if joined == rid or newest_attempt_of(exchange, name, rid) >= 0:
            raise RuntimeError(f"{run_file}: side {name!r} already took part in run {rid} of this exchange folder; "
                               f"to continue it pass --resume, to start a new pair use a fresh --peer-exchange "
                               f"(or --force on both sides)")
        if run_id and rid != run_id:
            raise RuntimeError(f"{run_file}: the exchange folder belongs to run {rid}, not --run-id {run_id} "
                               f"(another pair uses this folder: give each pair its own --peer-exchange)")
        if founder == name:
            raise RuntimeError(f"{run_file}: run {rid} was founded by another process as side {name!r}; one "
                               f"process per side name (is a second pair starting in this folder?)")
        named = record.get("sides")
        if peer_names is not None and named is not None and (founder not in peer_names or name not in named):
            raise RuntimeError(f"{run_file}: run {rid} was founded by side {founder!r} for sides {named}; this side "
                               f"{name!r} pairs with {sorted(peer_names)}: another pair's run (use its own "
                               f"--peer-exchange)")
        theirs = record.get("pair")
        if pair is not None and theirs is not None and theirs != pair:
            diff = ", ".join(f"--{k.replace('_', '-')} {theirs.get(k)!r} there, {pair.get(k)!r} here"
                             for k in sorted(set(theirs) | set(pair)) if theirs.get(k) != pair.get(k))
            raise RuntimeError(f"{run_file}: run {rid} of side {founder!r} differs in what both sides must share: "
                               f"{diff} (another pair's run, or fix the flags)")
        k, _ = current_attempt(exchange, rid)
        if k > 0:
            raise RuntimeError(f"{run_file}: run {rid} is being resumed (attempt {k}); this side joins it only with "
                               f"--resume and its own --out of that run")
        if not founder_alive(exchange, founder, rid, None, record, dead_after):
            raise RuntimeError(f"{run_file}: run {rid} was started by side {founder!r}, which is not running now "
                               f"(no live heartbeat): these are a dead run's files; use a fresh --peer-exchange, "
                               f"or --force on both sides to start over here")
        if not take_part(exchange, rid, 0, name):
            raise RuntimeError(f"{run_file}: another process joined run {rid} as side {name!r} first; one process "
                               f"per side name (is a second pair starting in this folder?)")
        mine.write_text(rid)
        return rid
    raise RuntimeError(f"{run_file}: could not found or join the run (it keeps changing)")


def join_attempt(exchange: Path, name: str, run_id: str, *, dead_after: float = 60.0) -> int:
    """--resume: the attempt of the run this side takes part in now; returns its number.

    It joins the newest attempt when that attempt's founder is another side, still alive, and this
    side has not taken part in it yet (the peer was relaunched first); otherwise it founds the next
    attempt (this side's earlier process took part in the newest one, or its founder is gone).
    Markers and heartbeats of earlier attempts then never stop this one. Removes this side's own
    FAILED marker of an earlier attempt."""
    exchange = Path(exchange)
    for _ in range(100):  # retried only while two sides race to found the next attempt
        k, record = current_attempt(exchange, run_id)
        founder = str(record.get("founder", ""))
        if (founder != name and newest_attempt_of(exchange, name, run_id) < k
                and founder_alive(exchange, founder, run_id, k, record, dead_after)):
            if not take_part(exchange, run_id, k, name):
                raise RuntimeError(f"{exchange}: another process joined attempt {k} of run {run_id} as side "
                                   f"{name!r} first; one process per side name")
        else:
            if not create_exclusive(attempts_dir(exchange) / f"{run_id}.{k + 1:06d}",
                                    {"founder": name, "created": time.time()}):
                continue  # the peer founded it first: join it
            take_part(exchange, run_id, k + 1, name)
            k += 1
        failed = read_json(exchange / name / "FAILED")
        if failed is not None and int(failed.get("attempt", 0)) < k:
            (exchange / name / "FAILED").unlink(missing_ok=True)
        return k
    raise RuntimeError(f"{exchange}: could not found or join an attempt of run {run_id} (it keeps changing)")


def leave_run(exchange: Path, name: str, *, dead_after: float = 60.0) -> None:
    """--force: forget this side's part in the folder's run (its step files, markers, RUN_ID), and
    the run record too when it is that run, so the next start founds a new run.

    Refuses (RuntimeError) while any side of the run it would delete has a live heartbeat, or while
    another process runs as this side: --force never deletes a live pair's files."""
    exchange = Path(exchange)
    record = read_json(exchange / "RUN")
    mine = exchange / name / "RUN_ID"
    target = mine.read_text().strip() if mine.is_file() else ""
    sides = [p.name for p in exchange.iterdir() if p.is_dir() and not p.name.startswith(".")] \
        if exchange.is_dir() else []
    checked = [s for s in sides if target or s == name]  # a side that never joined deletes only its own folder
    for s in checked:
        age = heartbeat_age(exchange, s, target or str((record or {}).get("run_id")))
        if age is None and s == name:  # another process running as this side, of any run
            beat = read_json(exchange / s / "HEARTBEAT") or {}
            age = time.time() - float(beat.get("time", 0)) if beat.get("state") == "running" else None
        if age is not None and age <= dead_after:
            raise RuntimeError(f"--force would delete the files of run {target or (record or {}).get('run_id')} in "
                               f"{exchange}, but side {s!r} "
                               f"of it is running (heartbeat {age:.0f}s old, pid "
                               f"{(read_json(exchange / s / 'HEARTBEAT') or {}).get('pid')}): stop that pair first, "
                               f"or use a fresh --peer-exchange")
    shutil.rmtree(exchange / name, ignore_errors=True)
    if record is None:  # no record, or an unreadable one: remove the latter, never a run founded since the read
        _retire_record(exchange, None)
        return
    rid = str(record.get("run_id"))
    if target and rid != target:
        return  # the folder already holds a new run (the peer's --force founded it): keep it
    if not target and any(alive(exchange, s, rid, None, dead_after) for s in sides if s != name):
        return  # this side never joined that run, which is alive: not this side's to delete
    if _retire_record(exchange, rid):
        for p in attempts_dir(exchange).glob(f"{rid}.*"):
            p.unlink(missing_ok=True)


def _retire_record(exchange: Path, rid: str | None) -> bool:
    """Remove the run record if it is still run `rid` (None: a record that cannot be read); True if it was.
    The peer's --force may have founded a new run since this side read the record: the record is moved aside
    first, and put back when it turns out to be another run's."""
    grave = exchange / f".RUN.removed.{os.getpid()}"
    try:
        os.replace(exchange / "RUN", grave)
    except FileNotFoundError:
        return False
    found = read_json(grave)
    ours = found is None if rid is None else (found or {}).get("run_id") == rid
    if not ours:
        try:
            os.link(grave, exchange / "RUN")  # a new run's record: put it back
        except FileExistsError:
            pass
    grave.unlink(missing_ok=True)
    return ours


class Heartbeat:
    """A daemon thread rewriting <exchange>/<side>/HEARTBEAT every `interval` seconds.

    The file is what a waiting peer reads to tell "slow" from "dead" (wait_for_file). step is
    updated by the trainer; stop(state) writes a last beat ("finished" or "failed"). A process left
    behind by a relaunch of its side (a newer process took part in a later attempt) stops beating,
    so that it never overwrites the newer process's heartbeat."""

    def __init__(self, exchange: Path, name: str, run_id: str, *, attempt: int = 0, interval: float = 10.0):
        self.exchange, self.name = Path(exchange), name
        self.path = self.exchange / name / "HEARTBEAT"
        self.run_id, self.attempt, self.interval, self.step = run_id, attempt, interval, -1
        self._stop = threading.Event()
        self.beat()
        self._thread = threading.Thread(target=self._loop, name="graft-heartbeat", daemon=True)
        self._thread.start()

    def beat(self, state: str = "running") -> None:
        write_json(self.path, {"run_id": self.run_id, "attempt": self.attempt, "pid": os.getpid(), "step": self.step,
                               "time": time.time(), "state": state})

    def left_behind(self) -> bool:
        return newest_attempt_of(self.exchange, self.name, self.run_id) > self.attempt

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                if self.left_behind():
                    return
                self.beat()
            except OSError:  # a full or flaky disk must not kill training; the next beat retries
                pass

    def stop(self, state: str) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        if not self.left_behind():
            self.beat(state)


def write_failed(exchange: Path, name: str, run_id: str, error: str, *, attempt: int = 0) -> None:
    """The marker a dying side leaves so that its peer stops at once (read by wait_for_file)."""
    write_json(Path(exchange) / name / "FAILED", {"run_id": run_id, "attempt": attempt, "error": error})
