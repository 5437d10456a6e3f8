"""Foreign trajectories as the stored peer: `--peer-log FILE.jsonl`, and the checks of any --peer-log at start.

`open_peer_log` is what the trainer calls at start for --peer-log: a finished run's rollout folder is checked
(every step's file present, readable) and read step by step by the trainer; a JSONL file of foreign
trajectories is read here, once. It holds any collection of solutions, one JSON object per line:
       {"problem_id" or "id": str|int, and/or "problem": str,    which prompt of --prompts
        "response": str,                                        the solution text (alias "completion")
        "lbar": float in [-20, 0],                              optional: the source model's mean token
                                                                log-probability of the response (Eq. 6;
                                                                alias "mean_logprob", as in rollout files)
        "num_tokens": int >= 1,                                 optional: its length in source tokens
                                                                (only --compat-norm byte needs it)
        "reward": number|bool,                                  optional: the source's own verdict
        "eos": bool}                                            optional, default true: ended with EOS
   Records are matched to the run's prompts, de-duplicated and length-checked (choice 4), grouped per
   prompt, re-verified and given GRPO advantages
   within their group; `ForeignLog.step(prompt_ids)` then hands the trainer the peer data of one batch
   as an exchange.StepRollouts (the one peer-step type) with its slots mask. Where "lbar" is missing,
   `fill_lbar` computes it with a given model (`--peer-model PATH`) and caches it beside the file.

It imports core.py (advantages within ragged groups), reward.py (the reward seam), runtime.py (prompt
encoding, the peer model's loading), data/prompts.py (the JSONL reader), exchange.py (atomic writes, the rollout
file, the file hash) and sampler.py (the log-prob kernel); never graft.py, which imports it.

Our choices, where the paper is silent (numbered so that reviews can cite them):
  1. Foreign groups: all records of one prompt form one group, in file order, whatever their count
     (>= 2). A prompt with a single record is dropped and counted: a group of one has advantage 0
     (group_advantages defines it so) and can never be mixed, so it could never be a candidate.
     Rewards are re-scored by the reward (reward.rewards: --reward, verify.py by default) against the
     prompt's gold answer (the record's own
     "reward" only feeds a disagreement count); advantages are the GRPO formula within each group.
  2. Matching: by id first ("problem_id", else "id"; an integer id is read as its decimal string). A
     record whose id is not a prompt id, or that has no id, is matched by problem text after
     normalisation: Unicode NFKC, every whitespace run collapsed to one space, ends stripped; case is
     kept (in mathematics x and X are different variables). A record with an id AND a problem text is
     matched by id only if the two agree; otherwise it falls back to its text and is counted as an id
     conflict. Text shared by two prompts of the run is ambiguous and left unmatched.
  3. lbar computed by a peer model (`fill_lbar`): the response is encoded by the peer's tokenizer
     without special tokens, plus its EOS when the record says it ended with one (as retokenisation
     does for the receiver), after the prompt as the caller encodes it for that model (the run's
     template), and scored at temperature 1. The cache is keyed on the file's SHA-256, the model path
     and the caller's prompt settings, so editing the file or changing the model recomputes it. Text
     that does not re-encode to the tokens the source sampled (a non-canonical BPE split) is scored in
     its canonical encoding: on the tiny preset's model B, 506 of 512 step-0 responses re-encode
     exactly and their computed lbar matches the stored one to 3e-7; the other 6 differ.
  4. Stored records that cannot be right are stopped or left out before anything is computed: an lbar
     must lie in [LBAR_MIN, 0] with LBAR_MIN = -88 (float32's largest value is e^88.72: the gate
     computes s = exp(lbar_recv - lbar) in float32, which a lower lbar can overflow to inf, accepting
     the response at w = 1; no model samples text at a mean probability of e^-88 per token), else
     FILE:LINE is an error, and so is one below core.LBAR_PLAUSIBLE = -20, implausible as a mean per token
     (a summed log-probability given by mistake would pass -88 and make w = 1). A record that repeats an
     earlier one (same matched prompt, same response text) is removed and counted: repeats would weight
     one response several times and change the group's advantages. A response longer than
     max_response_chars (the trainer passes response_char_bound(--max-response-tokens)) is removed and
     counted before verification or any --peer-model forward: the trainer would drop it for length
     anyway, and one 10 MB response would otherwise ask for a forward over millions of tokens.
  5. Stop strings (`--stop`, graft.py departure 11): a response that holds one is cut as the trainer
     cuts its own rollouts (core.decode_response): its text runs through the first stop string, its eos
     becomes false (a receiver retokenises it, stop string included, without EOS), and the verifier reads
     it cut before the string. A given lbar or num_tokens then described text that is gone, so it is
     dropped (NaN / -1) and --peer-model recomputes it; the cut records are counted ("stop_cut").


Its benchmark (10,000 records: read, match, verify) is bench/foreign.py.
"""

from __future__ import annotations

import hashlib
import json
import os
import unicodedata
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from core import (LBAR_FLOOR, PeerRecord, first_stop, graft_candidates, group_advantages, is_success,  # Eq. 4
                  masked_group_advantages, parse_peer_records, success_counts,  # ragged groups (choice 1), one parser
                  verifier_text)
from data.prompts import jsonl_objects
from exchange import StepRollouts, atomic_write, file_sha256, load_rollouts
from reward import DEFAULT_REWARD, rewards  # the reward seam (--reward)
from runtime import compute_context, encode_prompt, load_policy
from sampler import response_logprobs


# ------------------------------------------------------------------------------------------------
# Foreign trajectories: reading and matching records
# ------------------------------------------------------------------------------------------------

LBAR_MIN = LBAR_FLOOR  # choice 4: exp(-LBAR_MIN) is finite in float32 (whose largest value is e^88.72)
MAX_TOKEN_CHARS = 128  # the longest token of the Qwen3, SmolLM3 and Llama-3.2 vocabularies: 128 spaces


def response_char_bound(max_response_tokens: int, *, max_token_chars: int = MAX_TOKEN_CHARS) -> int:
    """Characters above which a response cannot fit in max_response_tokens tokens of a tokenizer whose
    longest token has max_token_chars characters (choice 4: a bound checked before tokenising)."""
    return max_response_tokens * max_token_chars


def normalise_problem(text: str) -> str:
    """Problem text as matched (choice 2): NFKC, whitespace runs -> one space, ends stripped, case kept."""
    return " ".join(unicodedata.normalize("NFKC", text).split())


ForeignRecord = PeerRecord  # one validated line: the project's one peer-log parser is core's


def read_foreign_records(path: str | os.PathLike) -> list[ForeignRecord]:
    """Parse and validate every line of a foreign JSONL file (format in the module docstring).

    Blank lines are skipped. Any bad line raises ValueError("FILE:LINE: what is wrong").
    """
    path = Path(path)
    # One JSONL reader for the whole project (data/prompts.py's): errors name file:line, non-UTF-8 too; one
    # parser of the peer-log format (core.parse_peer_records), shared with graft_trl.py.
    return parse_peer_records(jsonl_objects(path), where=str(path))


@dataclass
class MatchCounts:
    by_id: int = 0
    by_text: int = 0
    unmatched: int = 0
    ambiguous: int = 0  # unmatched because the text belongs to two or more prompts
    id_conflicts: int = 0  # id named a prompt whose text differs from the record's: matched by text instead
    unmatched_lines: list[int] = field(default_factory=list)  # the first few, for the report


def match_records(records: list[ForeignRecord], prompts: list[dict]) -> tuple[list[str | None], MatchCounts]:
    """The prompt id of each record (None when unmatched), by the rule of choice 2, and the counts.

    prompts: the run's prompt rows (dicts with "id" and "problem").
    """
    by_id = {p["id"]: p for p in prompts}
    by_text: dict[str, str | None] = {}
    for p in prompts:
        key = normalise_problem(p["problem"])
        by_text[key] = None if key in by_text else p["id"]  # None marks a text two prompts share
    c = MatchCounts()
    out: list[str | None] = []
    for rec in records:
        key = normalise_problem(rec.problem) if rec.problem is not None else None
        hit = None
        if rec.prompt_id is not None and rec.prompt_id in by_id:
            if key is None or normalise_problem(by_id[rec.prompt_id]["problem"]) == key:
                hit = rec.prompt_id
                c.by_id += 1
            else:
                c.id_conflicts += 1
        if hit is None and key is not None and key in by_text:
            hit = by_text[key]
            if hit is None:
                c.ambiguous += 1
            else:
                c.by_text += 1
        if hit is None:
            c.unmatched += 1
            if len(c.unmatched_lines) < 5:
                c.unmatched_lines.append(rec.line)
        out.append(hit)
    return out, c


# ------------------------------------------------------------------------------------------------
# Foreign trajectories: the loaded log and its per-step view for the trainer
# ------------------------------------------------------------------------------------------------


class ForeignLog:
    """A foreign JSONL file matched to a run's prompts: one group per prompt, stored as a padded table.

    Built by load_foreign_log. P prompts have a group; row p holds its responses in file order in slots
    0..size_p-1 of width M = the largest group. Attributes (tensors are (P, M) unless said):
        path, prompt_ids (P,), row (prompt id -> p), texts (P lists of M strings), mask, eos, rewards,
        advantages, mean_logprob, num_tokens, lines, source_reward (NaN: none given), counts (a dict).
    """

    def __init__(self, path: Path, groups: dict[str, list[ForeignRecord]], counts: dict, *, std_normalize: bool):
        self.path = Path(path)
        self.prompt_ids = list(groups)
        self.row = {pid: p for p, pid in enumerate(self.prompt_ids)}
        P, M = len(groups), max((len(g) for g in groups.values()), default=1)
        self.width = M
        self.texts = [[rec.response for rec in g] + [""] * (M - len(g)) for g in groups.values()]
        self.mask = torch.zeros(P, M, dtype=torch.bool)
        self.eos = torch.zeros(P, M, dtype=torch.bool)
        self.mean_logprob = torch.zeros(P, M)
        self.num_tokens = torch.full((P, M), -1, dtype=torch.int64)
        self.lines = torch.zeros(P, M, dtype=torch.int64)
        self.source_reward = torch.full((P, M), float("nan"))
        for p, g in enumerate(groups.values()):
            s = len(g)
            self.mask[p, :s] = True
            self.eos[p, :s] = torch.tensor([rec.eos for rec in g])
            self.mean_logprob[p, :s] = torch.tensor([rec.lbar for rec in g])
            self.num_tokens[p, :s] = torch.tensor([rec.num_tokens for rec in g])
            self.lines[p, :s] = torch.tensor([rec.line for rec in g])
            self.source_reward[p, :s] = torch.tensor([rec.reward for rec in g])
        self.rewards = torch.zeros(P, M)
        self.advantages = torch.zeros(P, M)
        self.std_normalize = std_normalize
        self.counts = counts

    def set_rewards(self, rewards: torch.Tensor) -> None:
        """Install re-verified rewards ((P, M), 0 on padding) and recompute the advantages within groups."""
        assert rewards.shape == self.mask.shape, f"rewards must be {tuple(self.mask.shape)}"
        self.rewards = torch.where(self.mask, rewards.float(), torch.zeros_like(self.rewards))
        self.advantages = masked_group_advantages(self.rewards, self.mask, std_normalize=self.std_normalize)

    def missing_lbar(self, norm: str = "token") -> list[int]:
        """File lines of responses lacking what --compat-norm norm needs (lbar; for 'byte' also num_tokens)."""
        bad = self.mask & self.mean_logprob.isnan()
        if norm == "byte":
            bad |= self.mask & (self.num_tokens < 1)
        return sorted(self.lines[bad].tolist())

    def require_lbar(self, norm: str = "token") -> None:
        """Raise ValueError naming FILE:LINE of the first response without the lbar the gate needs."""
        lines = self.missing_lbar(norm)
        if lines:
            what = "lbar" if norm == "token" else "lbar and num_tokens (--compat-norm byte)"
            raise ValueError(f"{self.path}:{lines[0]}: no {what} on {len(lines)} used records; give it in the file "
                             f"or compute it with --peer-model PATH (the model that wrote them, or a proxy)")

    both_ways = False  # a peer source (exchange.OnlinePeers): nothing goes back to a log

    def describe(self) -> str:
        """The peer source in a few words, for the trainer's start-up lines."""
        return f"a foreign log ({self.path})"

    def read(self, step: int, own) -> tuple[dict[str, StepRollouts], dict]:
        """The peer source's answer for one step: {"log": the batch's groups} (re-verified at start), no counts."""
        return {"log": self.step(own.prompt_ids)}, {}

    def step(self, prompt_ids: list[str]) -> StepRollouts:
        """The foreign peer data for one batch, prompts in the batch's order (absent ones: size 0)."""
        G, M = len(prompt_ids), self.width
        idx = torch.tensor([self.row.get(pid, -1) for pid in prompt_ids], dtype=torch.int64)  # (G,)
        has = idx >= 0  # (G,)
        safe = idx.clamp(min=0)  # (G,) row 0 stands in for absent prompts, then masked off

        def take(t: torch.Tensor, fill) -> torch.Tensor:
            out = t[safe]  # (G, M)
            return torch.where(has[:, None], out, torch.full_like(out, fill))

        texts = [s for g in range(G) for s in (self.texts[int(idx[g])] if has[g] else [""] * M)]
        return StepRollouts(prompt_ids=list(prompt_ids), tokens=[], logprobs=[], texts=texts,
                            eos=take(self.eos, False), rewards=take(self.rewards, 0.0),
                            advantages=take(self.advantages, 0.0), slots=take(self.mask, False),
                            given_lbar=take(self.mean_logprob, 0.0), num_tokens=take(self.num_tokens, -1),
                            lines=take(self.lines, 0))

    def report(self) -> str:
        """Lines for the log: what was read, matched, dropped and verified."""
        c = self.counts
        sizes = self.mask.sum(dim=1)  # (P,)
        k = success_counts(self.rewards, mask=self.mask)  # (P,) the selection's own count, not a sum of rewards
        mixed = int(graft_candidates(k_recv=torch.zeros_like(k), k_src=k, n=sizes).sum())  # Eq. 4's "mixed"
        first = lambda key: f" (first on lines {c[key]})" if c.get(key) else ""  # noqa: E731
        lines = [f"[foreign] {self.path}: {c['records']} records; matched {c['by_id']} by id, {c['by_text']} by "
                 f"problem text; unmatched {c['unmatched']} (ambiguous text {c['ambiguous']}, id/text conflicts "
                 f"{c['id_conflicts']})" + (f", first on lines {c['unmatched_lines']}" if c["unmatched_lines"] else ""),
                 f"[foreign] dropped {c.get('too_long', 0)} longer than {c.get('max_response_chars')} characters"
                 f"{first('too_long_lines')} and {c.get('duplicates', 0)} repeats of an earlier record (same prompt "
                 f"and response){first('duplicate_lines')}"
                 + (f"; cut {c['stop_cut']} at a stop string (choice 5)" if c.get("stop_cut") else ""),
                 f"[foreign] {len(self.prompt_ids)} prompt groups (sizes {int(sizes.min())}-{self.width}, "
                 f"mean {float(sizes.float().mean()):.1f}); dropped "
                 f"{c['singletons']} single-record prompts; {mixed} groups mixed",
                 f"[foreign] re-verified rewards: mean {float(self.rewards[self.mask].mean()):.3f}; "
                 f"{c['reward_disagreements']} differ from the file's reward; lbar given for "
                 f"{int((self.mask & ~self.mean_logprob.isnan()).sum())}/{int(self.mask.sum())} used records"]
        return "\n".join(lines)


def load_foreign_log(path: str | os.PathLike, prompts: list[dict], *, std_normalize: bool = True,
                     reward: str = DEFAULT_REWARD, verify_workers: int = 0, rel_tol: float | None = None,
                     reward_timeout: float = 0.0, max_response_chars: int | None = None,
                     stop: tuple[str, ...] | list[str] = ()) -> ForeignLog:
    """Read, match, group, re-verify and score a foreign JSONL file against the run's prompts.

    prompts: the run's prompt rows (dicts with "id", "problem", "answer", as data/prompts.py load_prompts
    returns). Responses over max_response_chars characters (None = no bound), repeats of an earlier
    record (same prompt, same response text), unmatched records and single-record prompts are counted
    (ForeignLog.report) and left out, in that order (choice 4), before anything is verified or scored.
    Rewards of the kept records are the reward's (reward.rewards: --reward, verify.py's by default, which
    reads a boxed answer); verify_workers, reward_timeout and rel_tol are passed to it. Responses are first cut
    at a stop string of `stop` (choice 5). Raises ValueError (FILE:LINE) on a bad record, and when nothing usable is
    left.
    """
    path = Path(path)
    records = read_foreign_records(path)
    if not records:
        raise ValueError(f"{path}: no records")
    stop_cut = 0
    for i, rec in enumerate(records):  # choice 5: as core.decode_response cuts the trainer's own rollouts
        hit = first_stop(rec.response, tuple(stop)) if stop else None
        if hit is not None:
            records[i] = rec._replace(response=rec.response[: hit[0] + len(hit[1])], eos=False,
                                             lbar=float("nan"), num_tokens=-1)
            stop_cut += 1
    n_read, long_lines = len(records), []
    if max_response_chars is not None:  # before matching: nothing is computed for them (choice 4)
        long_lines = [r.line for r in records if len(r.response) > max_response_chars]
        records = [r for r in records if len(r.response) <= max_response_chars]
    hits, mc = match_records(records, prompts)
    groups: dict[str, list[ForeignRecord]] = {}
    seen: set[tuple[str, str]] = set()
    repeat_lines = []
    for rec, pid in zip(records, hits):
        if pid is None:
            continue
        if (pid, rec.response) in seen:
            repeat_lines.append(rec.line)
            continue
        seen.add((pid, rec.response))
        groups.setdefault(pid, []).append(rec)
    singletons = [pid for pid, g in groups.items() if len(g) < 2]
    for pid in singletons:
        del groups[pid]
    if not groups:
        raise ValueError(f"{path}: no prompt of the run has two or more matched records ({n_read} records, "
                         f"{mc.unmatched} unmatched, {len(repeat_lines)} repeats, {len(long_lines)} too long, "
                         f"{len(singletons)} single-record prompts); check ids/problem text against --prompts")
    counts = {"records": n_read, "stop_cut": stop_cut, "too_long": len(long_lines),
              "too_long_lines": long_lines[:5], "max_response_chars": max_response_chars,
              "duplicates": len(repeat_lines), "duplicate_lines": repeat_lines[:5], "by_id": mc.by_id,
              "by_text": mc.by_text, "unmatched": mc.unmatched, "ambiguous": mc.ambiguous,
              "id_conflicts": mc.id_conflicts, "unmatched_lines": mc.unmatched_lines, "singletons": len(singletons)}
    log = ForeignLog(path, groups, counts, std_normalize=std_normalize)
    gold = {p["id"]: p["answer"] for p in prompts}
    flat = [(p, i) for p, pid in enumerate(log.prompt_ids) for i in range(len(groups[pid]))]
    golds = [gold[log.prompt_ids[p]] for p, _ in flat]
    verdicts = peer_rewards([log.texts[p][i] for p, i in flat], golds, reward=reward, stop=stop,
                            workers=verify_workers, timeout=reward_timeout,
                            **({} if rel_tol is None else {"rel_tol": rel_tol}))
    table = torch.zeros(log.mask.shape)  # (P, M)
    if flat:
        rows, cols = zip(*flat)
        table[list(rows), list(cols)] = torch.tensor(verdicts, dtype=torch.float32)
    log.set_rewards(table)
    given = log.mask & ~log.source_reward.isnan()  # (P, M)
    log.counts["reward_disagreements"] = int((is_success(log.source_reward) != is_success(log.rewards))[given].sum())
    return log


# ------------------------------------------------------------------------------------------------
# Foreign trajectories: lbar computed by a peer model, cached beside the file
# ------------------------------------------------------------------------------------------------

LBAR_CACHE_FORMAT = "graft-foreign-lbar"
LBAR_CACHE_VERSION = 1


def lbar_cache_path(path: str | os.PathLike, *, file_hash: str, model_path: str, cache_key: str = "",
                    temperature: float = 1.0) -> Path:
    """<folder>/.<file name>.lbar-<16 hex>.json: one cache per (file content, model, prompt settings, T)."""
    key = hashlib.sha256("\0".join([file_hash, model_path, cache_key, repr(float(temperature))]).encode()).hexdigest()
    p = Path(path)
    return p.with_name(f".{p.name}.lbar-{key[:16]}.json")


def fill_lbar(log: ForeignLog, model, tokenizer, *, model_path: str, encode_prompt: Callable[[str], list[int]],
              problems: dict[str, str], eos_token_id: int | None = None, cache_key: str = "",
              temperature: float = 1.0, batch_size: int = 16, chunk_size: int = 1024,
              progress: Callable[[int, int], None] | None = None) -> dict:
    """Compute the missing source lbar of every used record with a given model, through the cache (choice 3).

    model, tokenizer: the peer model (a transformers causal LM, on the device it should run on) and its
    tokenizer. model_path: what --peer-model named (part of the cache key). encode_prompt(problem text)
    -> the model's prompt token ids (the run's template, encoded by this tokenizer). problems: prompt id
    -> problem text. eos_token_id: appended to responses whose record says eos (default the
    tokenizer's). cache_key: anything else the numbers depend on (e.g. template and chat flag).
    Fills log.mean_logprob and log.num_tokens in place where they were NaN / -1; records that carry an
    lbar keep it. Returns {"computed": int, "cached": int, "cache": str path}.
    """
    file_hash = file_sha256(log.path)
    cache = lbar_cache_path(log.path, file_hash=file_hash, model_path=model_path, cache_key=cache_key,
                            temperature=temperature)
    stored: dict[str, list] = {}
    if cache.is_file():
        try:
            data = json.loads(cache.read_text(encoding="utf-8"))
            ours = (data.get("format"), data.get("file_sha256"), data.get("model"))
            stored = dict(data["lines"]) if ours == (LBAR_CACHE_FORMAT, file_hash, model_path) else {}
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError, KeyError, TypeError, ValueError):
            stored = {}  # an unreadable cache is only lost time: recompute and overwrite it
    need = (log.mask & log.mean_logprob.isnan()).nonzero().tolist()  # [(p, i)] responses without an lbar
    todo = [(p, i) for p, i in need if str(int(log.lines[p, i])) not in stored]
    eos = tokenizer.eos_token_id if eos_token_id is None else eos_token_id
    jobs = []
    for p, i in todo:
        ids = tokenizer.encode(log.texts[p][i], add_special_tokens=False)
        if bool(log.eos[p, i]):
            assert eos is not None, "the peer tokenizer has no eos_token_id: pass eos_token_id"
            ids = ids + [eos]
        if not ids:
            raise ValueError(f"{log.path}:{int(log.lines[p, i])}: the response is empty; no log-probability to compute")
        jobs.append((p, i, encode_prompt(problems[log.prompt_ids[p]]), ids))
    jobs.sort(key=lambda j: -(len(j[2]) + len(j[3])))  # similar lengths share a batch: less padding
    was_training = model.training
    model.eval()
    with torch.no_grad():
        for b in range(0, len(jobs), batch_size):
            chunk = jobs[b: b + batch_size]
            lp, mask = response_logprobs(model, [j[2] for j in chunk], [j[3] for j in chunk],
                                         pad_token_id=0 if tokenizer.pad_token_id is None else tokenizer.pad_token_id,
                                         temperature=temperature, chunk_size=chunk_size)  # (B, T)
            sums, lens = (lp.float() * mask).sum(dim=1).cpu(), mask.sum(dim=1).cpu()  # (B,)
            for (p, i, _, _), s, ln in zip(chunk, sums.tolist(), lens.tolist()):
                stored[str(int(log.lines[p, i]))] = [s / ln, int(ln)]
            if progress is not None:
                progress(min(b + batch_size, len(jobs)), len(jobs))
    model.train(was_training)
    if todo:
        payload = {"format": LBAR_CACHE_FORMAT, "version": LBAR_CACHE_VERSION, "file": log.path.name,
                   "file_sha256": file_hash, "model": model_path, "key": cache_key, "temperature": temperature,
                   "lines": stored}
        atomic_write(cache, lambda tmp: Path(tmp).write_text(json.dumps(payload), encoding="utf-8"))
    for p, i in need:
        value, count = stored[str(int(log.lines[p, i]))]
        log.mean_logprob[p, i] = value
        log.num_tokens[p, i] = count
    return {"computed": len(todo), "cached": len(need) - len(todo), "cache": str(cache)}


# ------------------------------------------------------------------------------------------------
# The stored peer at the trainer's start: every check before the first rollout
# ------------------------------------------------------------------------------------------------


def peer_rewards(texts: list[str], golds: list[str], *, reward: str, stop, workers: int, timeout: float, **tol):
    """The one place a stored peer's responses get their rewards (a finished run's files, each step; a foreign
    log's records, once): our reward (reward.rewards, --reward) on each text cut before a stop string, against our
    gold answers; another run's verdicts are never trusted. Returns rewards' list (with .faults)."""
    return rewards(reward, [verifier_text(t, tuple(stop)) for t in texts], golds, workers=workers, timeout=timeout,
                   **tol)


class StoredRun:
    """A finished run's rollout folder as the stored peer (the paper's stored-trajectory variant), a peer source
    like exchange.OnlinePeers: its file of each step, re-scored with our reward (peer_rewards) and given GRPO
    advantages from that; one-way (both_ways False: nothing goes back to a finished run)."""

    both_ways = False

    def __init__(self, folder: Path, *, run_id: str | None, n: int, golds: dict[str, str], reward: str, stop,
                 workers: int, timeout: float, std_normalize: bool):
        self.folder, self.run_id, self.n, self.golds = Path(folder), run_id, n, golds
        self.reward, self.stop, self.workers, self.timeout = reward, list(stop), workers, timeout
        self.std_normalize = std_normalize

    def describe(self) -> str:
        """The peer source in a few words, for the trainer's start-up lines."""
        return f"a stored run's rollout files ({self.folder})"

    def read(self, step: int, own) -> tuple[dict, dict]:
        """{"log": the step's rollouts, re-scored}, and the reward's fault counts."""
        peer, _ = load_rollouts(self.folder / f"step_{step:06d}.safetensors", n=self.n, prompt_ids=own.prompt_ids,
                                run_id=self.run_id)
        golds = [self.golds[i] for i in peer.prompt_ids for _ in range(self.n)]
        verdicts = peer_rewards(peer.texts, golds, reward=self.reward, stop=self.stop, workers=self.workers,
                                timeout=self.timeout)
        peer.rewards = torch.tensor(verdicts).view_as(peer.rewards)  # (G, n)
        peer.advantages = group_advantages(peer.rewards, std_normalize=self.std_normalize)  # (G, n)
        return {"log": peer}, dict(verdicts.faults)


def open_peer_log(cfg, data: list[dict], dist, *, start_step: int) -> StoredRun | ForeignLog:
    """--peer-log, checked once at start: the stored peer as a peer source. Returns a StoredRun for a finished
    run's rollout files, or the loaded ForeignLog for a JSONL of foreign trajectories.

    cfg: the trainer's Config; data: the run's prompts (--prompts); dist: runtime.DistInfo. A rollout
    folder must hold a file of this n for every step the run will take, from start_step on. Bad input
    raises SystemExit naming the flag and the file (and line, for JSONL records)."""
    log = Path(cfg.peer_log)
    if log.is_file():
        return load_foreign(cfg, data, dist)
    if not log.is_dir():
        raise SystemExit(f"--peer-log {cfg.peer_log!r}: no such folder of rollout files or JSONL file")
    missing = [t for t in range(start_step, cfg.steps) if not (log / f"step_{t:06d}.safetensors").is_file()]
    if missing:
        have = len(list(log.glob("step_*.safetensors")))
        raise SystemExit(f"--peer-log {log}: this run needs steps {start_step}..{cfg.steps - 1} (--steps "
                         f"{cfg.steps}) but {len(missing)} are missing, the first step_{missing[0]:06d}"
                         f".safetensors (the folder holds {have} step files)")
    try:
        _, meta = load_rollouts(log / f"step_{start_step:06d}.safetensors", n=cfg.n)
    except ValueError as e:
        raise SystemExit(f"--peer-log: {e}") from None
    return StoredRun(log, run_id=meta.get("run_id"), n=cfg.n, golds={r["id"]: r["answer"] for r in data},
                     reward=cfg.reward, stop=cfg.stop, workers=cfg.verify_workers, timeout=cfg.reward_timeout,
                     std_normalize=cfg.std_normalize)


def load_foreign(cfg, data: list[dict], dist) -> ForeignLog:
    """A JSONL --peer-log: matched to --prompts by id or problem text, de-duplicated, length-checked,
    grouped per prompt, re-verified; lbar computed once by --peer-model where the records lack it."""
    try:
        log = load_foreign_log(cfg.peer_log, data, std_normalize=cfg.std_normalize, reward=cfg.reward,
                               verify_workers=cfg.verify_workers, reward_timeout=cfg.reward_timeout,
                               max_response_chars=response_char_bound(cfg.max_response_tokens), stop=cfg.stop)
    except ValueError as e:  # names the file and line
        raise SystemExit(f"--peer-log: {e}") from None
    if dist.main:
        print(log.report())
    if cfg.peer_model and log.missing_lbar(cfg.compat_norm):
        model, tok, stop = load_policy(cfg.peer_model, cfg, dist, for_training=False)
        with compute_context(cfg, dist):
            info = fill_lbar(
                log, model, tok, model_path=cfg.peer_model, eos_token_id=stop[0],
                encode_prompt=lambda q: encode_prompt(q, tok, template=cfg.prompt_template, chat=cfg.chat_template),
                problems={r["id"]: r["problem"] for r in data},
                cache_key=f"{cfg.prompt_template}\0{cfg.chat_template}" + (f"\0{cfg.stop!r}" if cfg.stop else ""),
                batch_size=cfg.micro_batch_size,
                chunk_size=cfg.logprob_chunk)
        if dist.main:
            print(f"[graft] lbar by --peer-model {cfg.peer_model}: {info['computed']} computed, "
                  f"{info['cached']} from {info['cache']}")
        del model
    if cfg.compat_weight or cfg.acceptance == "random":
        try:
            log.require_lbar(cfg.compat_norm)
        except ValueError as e:
            raise SystemExit(f"--peer-log: {e} (give --peer-model PATH to compute it)") from None
    return log
