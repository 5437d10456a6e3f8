"""GRAFT exchange files: one model's rollouts of one step, as a safetensors file (README "Files").

The two processes of an online pair meet through these files (each writes its own, atomically, and
waits for the peer's); the stored-trajectory variant reads a finished run's files; and every run's
exchange folder is its trajectory log. Online and offline therefore share one format.

File layout, <exchange>/<side name>/step_<t:06d>.safetensors, format version 1:
    rewards, advantages, mean_logprob, eos   (G, n)        float32 / bool
    tokens, logprobs                          (sum of lengths,) int64 / float32, cut by token_offsets (G*n+1,)
    text                                      UTF-8 bytes of the response texts, cut by text_offsets (G*n+1,)
    prompt_ids                                UTF-8 bytes of the dataset ids, cut by prompt_id_offsets (G+1,)
    metadata (strings): format, version, n, groups, model, tokenizer, step, temperature, name, data_seed
Response r = g * n + i is rollout i of prompt g. Loading validates format, version, n, shapes,
offsets and prompt ids, and every error names the file.

Imports torch and safetensors only (nothing of GRAFT's), so another trainer can read and write the
same files.
"""

from __future__ import annotations

import os
import time
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
    return torch.frombuffer(bytearray(b"".join(data)) or bytearray(1), dtype=torch.uint8)[: int(offsets[-1])].clone(), offsets


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


def load_rollouts(path: Path, *, n: int | None = None, prompt_ids: list[str] | None = None) -> tuple[StepRollouts, dict]:
    """Read and validate a rollout file; every error names the file and what is wrong."""
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


def rollout_path(exchange: Path, name: str, step: int) -> Path:
    return Path(exchange) / name / f"step_{step:06d}.safetensors"


def wait_for_file(path: Path, *, timeout: float, poll: float = 0.2) -> float:
    """Block until path exists; returns seconds waited. A FAILED marker next to it (written by a dying
    peer) or the timeout raises an error naming the file."""
    t0 = time.time()
    failed = Path(path).parent / "FAILED"
    while not Path(path).exists():
        if failed.exists():
            raise RuntimeError(f"the peer failed before writing {path}: {failed.read_text()[-2000:]}")
        if time.time() - t0 > timeout:
            raise TimeoutError(f"waited {timeout:.0f}s for the peer's rollout file {path}; is the peer process "
                               f"running with the same --peer-exchange and --steps? (raise --exchange-timeout)")
        time.sleep(poll)
    return time.time() - t0


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
