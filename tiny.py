"""Tiny CPU preset, phase 1: data, tokenizers, two tiny models, their pre-training and evaluation.

Contract
--------
``python tiny.py prepare RUN_DIR`` builds, in RUN_DIR (cached: a second call skips finished parts)

    data/train.jsonl, data/test.jsonl   generated problems (data/tiny_tasks.py), disjoint splits
    A/                                  Llama-style model + character-level tokenizer
    B/                                  Qwen3-style model + BPE tokenizer (digits grouped, vocab 300)

Each model folder loads with ``AutoModelForCausalLM.from_pretrained(dir)`` and
``AutoTokenizer.from_pretrained(dir)``. The two models are pre-trained (SFT) on prompt + worked
solution + EOS over *different* mixes of the four families (``TinyConfig.mix_a`` / ``mix_b``), so
each is strong on its own two families and weak, but not at zero, on the other two (DESIGN.md §8,
lesson 3). The two pre-trainings run as two parallel processes with one torch thread each.

The RL trainer builds its prompts as ``PROMPT_TEMPLATE.replace("{problem}", problem)``; the response
follows immediately and ends with the tokenizer's EOS. Pass the same template to the trainer with
``--prompt-template``.

Other commands:

    python tiny.py eval RUN_DIR/A RUN_DIR/data/test.jsonl [--k 8]   per-family accuracy (T=1, greedy)
    python tiny.py grpo RUN_DIR/A RUN_DIR/data [--steps ...]        minimal plain GRPO (experiment)
    python tiny.py compat RUN_DIR                                   compatibility score s on A<->B

Findings of phase 1 (default config; 2 shared CPU cores, one torch thread per process)
------------------------------------------------------------------------------------
* Models: A = Llama 652,544 params, char vocab 99; B = Qwen3 629,312 params, BPE vocab 300 (hidden
  128, 3 layers, 4 heads, MLP 384, tied embeddings). Pre-training 600 steps x 64 sequences: ~150 s
  wall for both in parallel on a quiet machine (129 s measured), ~300 s when the cores are shared
  with other jobs; bit-identical weights on a rerun.
* Before RL, held-out accuracy (%), 200 problems per family, T=1 mean of 8 samples / greedy:
      A  add 88.5/99.0  sub 50.7/63.5  mul  6.9/12.5  linear 19.8/26.5
      B  add 13.4/32.5  sub 12.0/17.0  mul 56.7/77.5  linear 51.1/59.5
* Plain GRPO (``python tiny.py grpo``), 64 prompts x n=8 per step, 4 minibatches, AdamW 1e-4
  constant, clip 0.2/0.28; weak-family T=1 accuracy gain after 100 steps, seeds 0 / 1 / 2:
  A +7.1 / +3.8 / +3.1, B +5.1 / +4.8 / +3.9 (from ~14.8 and ~12.5); seed 2 after 150 steps:
  A +6.4, B +6.3. Strong families held or rose. ~2.5 s (A, char) and ~1.5 s (B, BPE) per step with
  the two runs side by side, so +5 on both needs ~150 steps: ~6 min for A, ~4 min for B. Progress
  is steady but lr-bound: 1.5e-4, 2e-4 (also with 2 minibatches), 3e-4 (also with a 10-step
  warm-up) were flat or worse; 128 prompts per step gave no more per step than 64; 8 minibatches
  no better.
* Compatibility on 1000 train prompts: with per-token means (the paper's s) 77-88% of the peer's
  responses on candidate prompts pass s > 0.8 (median s ~0.87) in both directions; per-byte
  normalisation gives 96% (A->B) and 72% (B->A). The gate is not the bottleneck with these tasks:
  the worked solutions are formulaic, so a receiver that got the digits wrong still finds most
  tokens of the peer's text likely.

Departures and choices
----------------------
* SFT loss is on the response tokens (and EOS) only: the trainer only ever scores responses given a
  prompt, and the prompt digits are uniform random, so modelling them would spend a tiny model's
  capacity on irreducible noise.
* ``grpo`` here is a deliberately minimal stand-alone loop used to find a learning rate, batch and
  step count at which plain GRPO makes real progress on these models (§8 lesson 1). It is an
  experiment, not the trainer: ``graft.py`` is the trainer.
* Sampling uses ``sampler.sample`` when that module exists and transformers' ``generate`` otherwise.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import os
import random
import string
import subprocess
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "data"))
import tiny_tasks  # noqa: E402  (data/tiny_tasks.py: the problem generator)

PROMPT_TEMPLATE = "{problem}\n"
"""The tiny preset's prompt: the problem and a newline. Short, because every prompt token of the
character-level model is a position the CPU has to run."""

# ----------------------------------------------------------------------------------------------------
# Config
# ----------------------------------------------------------------------------------------------------


@dataclass
class TinyConfig:
    """Everything the tiny preset's phase 1 depends on; its hash names the cached artefacts."""

    seed: int = 0
    """Seed of the problem generator, model initialisation and pre-training batches."""
    n_train: int = 4000
    """Generated train problems (balanced over the families); the RL prompts and the SFT pool."""
    n_test: int = 800
    """Generated held-out problems (200 per family: ~+-3 points of binomial noise per family)."""
    mix_a: dict = field(default_factory=lambda: {"add": 0.40, "sub": 0.45, "mul": 0.09, "linear": 0.06})
    """Pre-training family mix of model A (Llama, char): strong on add/sub, weak on mul/linear."""
    mix_b: dict = field(default_factory=lambda: {"add": 0.05, "sub": 0.05, "mul": 0.44, "linear": 0.46})
    """Pre-training family mix of model B (Qwen3, BPE): strong on mul/linear, weak on add/sub."""
    hidden: int = 128
    """Hidden size of both models."""
    layers: int = 3
    """Decoder layers of both models."""
    heads: int = 4
    """Attention heads of both models (head dim = hidden / heads)."""
    intermediate: int = 384
    """MLP width of both models."""
    bpe_vocab: int = 300
    """Vocabulary size of model B's BPE tokenizer (specials included)."""
    sft_steps: int = 600
    """Pre-training optimiser steps per model."""
    sft_batch: int = 64
    """Pre-training sequences per step."""
    sft_lr: float = 3e-3
    """Peak AdamW learning rate of pre-training (linear warm-up, cosine decay to 10%)."""
    sft_warmup: int = 50
    """Warm-up steps of pre-training."""

    def digest(self) -> str:
        """Short hash of the config: a changed config invalidates the cached artefacts."""
        blob = json.dumps(dataclasses.asdict(self), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:12]


# ----------------------------------------------------------------------------------------------------
# Data
# ----------------------------------------------------------------------------------------------------


def load_jsonl(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def make_data(run_dir: str, cfg: TinyConfig) -> str:
    """Generate the train/test splits into RUN_DIR/data (skipped if present for the same generator
    arguments); return that folder."""
    out = os.path.join(run_dir, "data")
    meta = {"seed": cfg.seed, "n_train": cfg.n_train, "n_test": cfg.n_test}
    try:
        with open(os.path.join(out, "meta.json")) as f:
            if json.load(f) == meta:
                return out
    except (OSError, ValueError):
        pass
    os.makedirs(out, exist_ok=True)
    train, test = tiny_tasks.generate(cfg.seed, cfg.n_train, cfg.n_test)
    tiny_tasks.write_jsonl(os.path.join(out, "train.jsonl"), train)
    tiny_tasks.write_jsonl(os.path.join(out, "test.jsonl"), test)
    with open(os.path.join(out, "meta.json"), "w") as f:  # written last: marks the splits complete
        json.dump(meta, f)
    return out


def boxed_answer(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (no nesting needed here), or None. Phase-1 stand-in for
    ``verify.verify``: the tiny answers are plain integers, so exact string match is the check."""
    i = text.rfind("\\boxed{")
    if i < 0:
        return None
    j = text.find("}", i)
    return None if j < 0 else text[i + 7:j].strip()


def reward(text: str, gold: str) -> float:
    return float(boxed_answer(text) == gold)


# ----------------------------------------------------------------------------------------------------
# Tokenizers
# ----------------------------------------------------------------------------------------------------

SPECIALS = ["<pad>", "<eos>", "<unk>"]
# Every character a generated problem can contain, and then some: printable ASCII and newline.
ALPHABET = [c for c in string.printable if c not in "\t\r\x0b\x0c"]


def _wrap(tok):
    from transformers import PreTrainedTokenizerFast

    # No post-processor, so encode adds no BOS (and no EOS): the trainer appends EOS itself.
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>",
                                   unk_token="<unk>", model_max_length=512)


def build_char_tokenizer():
    """Character-level tokenizer: one token per character, digits one by one.

    A BPE model with no merges and no pre-tokenizer splits any string into its characters, spaces
    and newlines included; the ``Fuse`` decoder concatenates them back, so decode(encode(t)) == t.
    """
    from tokenizers import Tokenizer, decoders, models

    vocab = {t: i for i, t in enumerate(SPECIALS + ALPHABET)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.decoder = decoders.Fuse()
    return _wrap(tok)


def build_bpe_tokenizer(texts: list[str], vocab_size: int):
    """Small BPE trained on the generated text, digits grouped (up to three per pre-token).

    The pre-tokenizer isolates digit runs of at most 3 (Llama-3 style), words with their leading
    space, single whitespace characters and punctuation runs; BPE then merges frequent pieces, so
    "266" may be one token or "26"+"6" where the character model sees "2","6","6". No byte-level
    mapping: the alphabet is the printable ASCII set, which keeps the vocabulary at ~300 and lets
    the ``Fuse`` decoder restore the text exactly.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"\d{1,3}| ?[A-Za-z]+|\s|[^\sA-Za-z\d]+"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, initial_alphabet=ALPHABET,
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return _wrap(tok)


# ----------------------------------------------------------------------------------------------------
# Models
# ----------------------------------------------------------------------------------------------------


def build_model(kind: str, tok, cfg: TinyConfig):
    """A tiny Llama ("llama") or Qwen3 ("qwen3") decoder for ``tok``, weights tied, fp32."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

    common = dict(vocab_size=len(tok), hidden_size=cfg.hidden, intermediate_size=cfg.intermediate,
                  num_hidden_layers=cfg.layers, num_attention_heads=cfg.heads, max_position_embeddings=256,
                  tie_word_embeddings=True, bos_token_id=None, eos_token_id=tok.eos_token_id,
                  pad_token_id=tok.pad_token_id)
    if kind == "llama":
        mcfg = LlamaConfig(num_key_value_heads=cfg.heads, **common)
    elif kind == "qwen3":
        # Differs from the Llama beyond the tokenizer: grouped-query attention and q/k RMSNorm.
        mcfg = Qwen3Config(num_key_value_heads=max(1, cfg.heads // 2), head_dim=cfg.hidden // cfg.heads, **common)
    else:
        raise ValueError(f"unknown model kind {kind!r}")
    torch.manual_seed(cfg.seed)
    return AutoModelForCausalLM.from_config(mcfg)


def n_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


# ----------------------------------------------------------------------------------------------------
# Pre-training (SFT)
# ----------------------------------------------------------------------------------------------------


def sft_example(tok, row: dict) -> tuple[list[int], int]:
    """(prompt + solution + EOS token ids, prompt length) for one generated row."""
    p = tok.encode(PROMPT_TEMPLATE.replace("{problem}", row["problem"]), add_special_tokens=False)
    r = tok.encode(row["solution"], add_special_tokens=False)
    return p + r + [tok.eos_token_id], len(p)


def pretrain(model, tok, rows: list[dict], mix: dict, cfg: TinyConfig, log=print) -> float:
    """SFT ``model`` on ``rows`` drawn by family weights ``mix``; loss on response tokens only.

    Returns the wall time in seconds. Batches are drawn with replacement from the family pools,
    seeded, so the run is reproducible.
    """
    by_family = defaultdict(list)
    for row in rows:
        by_family[row["family"]].append(sft_example(tok, row))
    fams = [f for f in mix if mix[f] > 0]
    weights = [mix[f] for f in fams]
    rng = random.Random(f"sft/{cfg.seed}")
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.sft_lr, betas=(0.9, 0.98), weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / cfg.sft_warmup) * (
        0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, s / cfg.sft_steps)))))
    model.train()
    t0, ema = time.time(), None
    for step in range(cfg.sft_steps):
        batch = [rng.choice(by_family[f]) for f in rng.choices(fams, weights, k=cfg.sft_batch)]
        T = max(len(ids) for ids, _ in batch)
        x = torch.full((len(batch), T), tok.pad_token_id)
        y = torch.full((len(batch), T), -100)
        for i, (ids, n_p) in enumerate(batch):
            x[i, :len(ids)] = torch.tensor(ids)
            y[i, n_p:len(ids)] = torch.tensor(ids[n_p:])  # labels: response + EOS only
        logits = model(input_ids=x, attention_mask=(x != tok.pad_token_id).long()).logits[:, :-1]
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y[:, 1:].reshape(-1), ignore_index=-100)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        ema = loss.item() if ema is None else 0.95 * ema + 0.05 * loss.item()
        if step % 200 == 0 or step == cfg.sft_steps - 1:
            log(f"  sft step {step:5d}  loss {ema:.4f}  {time.time() - t0:6.1f}s")
    model.eval()
    return time.time() - t0


def _pretrain_one(run_dir: str, name: str, cfg: TinyConfig) -> None:
    """Build, pre-train and save model ``name`` ("A" or "B") into RUN_DIR/name (one process)."""
    torch.set_num_threads(1)
    from transformers import AutoTokenizer

    out = os.path.join(run_dir, name)
    tok = AutoTokenizer.from_pretrained(os.path.join(run_dir, f"tok_{name}"))
    model = build_model("llama" if name == "A" else "qwen3", tok, cfg)
    rows = load_jsonl(os.path.join(run_dir, "data", "train.jsonl"))
    log = lambda msg: print(f"[{name}] {msg}", flush=True)  # noqa: E731
    log(f"{type(model).__name__}: {n_params(model):,} params, vocab {len(tok)}")
    wall = pretrain(model, tok, rows, cfg.mix_a if name == "A" else cfg.mix_b, cfg, log)
    tmp = f"{out}.tmp.{os.getpid()}"
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    with open(os.path.join(tmp, "tiny_done.json"), "w") as f:
        json.dump({"config": dataclasses.asdict(cfg), "digest": cfg.digest(), "sft_wall_s": wall}, f)
    if os.path.isdir(out):
        import shutil
        shutil.rmtree(out)
    os.replace(tmp, out)  # atomic: a folder with tiny_done.json is always complete
    log(f"saved {out} ({wall:.0f}s)")


def _is_done(folder: str, cfg: TinyConfig) -> bool:
    try:
        with open(os.path.join(folder, "tiny_done.json")) as f:
            return json.load(f)["digest"] == cfg.digest()
    except (OSError, ValueError, KeyError):
        return False


def prepare(run_dir: str, cfg: TinyConfig) -> None:
    """Data, tokenizers and both pre-trained models in RUN_DIR; finished parts are skipped."""
    os.makedirs(run_dir, exist_ok=True)
    data_dir = make_data(run_dir, cfg)
    todo = [n for n in ("A", "B") if not _is_done(os.path.join(run_dir, n), cfg)]
    if not todo:
        print(f"pre-trained models in {run_dir} are cached (config {cfg.digest()})")
        return
    train = load_jsonl(os.path.join(data_dir, "train.jsonl"))
    texts = [PROMPT_TEMPLATE.replace("{problem}", r["problem"]) + r["solution"] for r in train]
    build_char_tokenizer().save_pretrained(os.path.join(run_dir, "tok_A"))
    build_bpe_tokenizer(texts, cfg.bpe_vocab).save_pretrained(os.path.join(run_dir, "tok_B"))
    cfg_path = os.path.join(run_dir, "tiny_config.json")
    with open(cfg_path, "w") as f:
        json.dump(dataclasses.asdict(cfg), f)
    t0 = time.time()
    # One process per model, one thread each: on a shared 2-core machine two single-threaded
    # processes beat one process with two threads (§8 lesson 6).
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "_pretrain_one", run_dir, n, cfg_path])
             for n in todo]
    codes = [p.wait() for p in procs]
    if any(codes):
        raise RuntimeError(f"pre-training failed (exit codes {codes}); see the output above")
    print(f"pre-training of {', '.join(todo)} took {time.time() - t0:.0f}s wall")


# ----------------------------------------------------------------------------------------------------
# Sampling and evaluation
# ----------------------------------------------------------------------------------------------------


def encode_prompts(tok, problems: list[str]) -> list[list[int]]:
    return [tok.encode(PROMPT_TEMPLATE.replace("{problem}", p), add_special_tokens=False) for p in problems]


@torch.no_grad()
def sample_responses(model, tok, prompts: list[list[int]], *, max_new_tokens: int, temperature: float,
                     greedy: bool = False, batch_size: int = 512, seed: int = 0) -> list[list[int]]:
    """Response token ids (EOS kept if produced, padding removed) for each prompt, batched.

    Uses ``sampler.sample`` when it exists (and not greedy), else transformers' ``generate`` with
    left padding; top-k and top-p are off, so T=1 samples the model's distribution.
    """
    try:
        import sampler  # the project's KV-cache sampler (sampler.py); optional, so this file stands alone
    except ImportError:
        sampler = None
    out: list[list[int]] = []
    gen = torch.Generator().manual_seed(seed)
    for s in range(0, len(prompts), batch_size):
        chunk = prompts[s:s + batch_size]
        if sampler is not None and not greedy:
            rolls = sampler.sample(model, chunk, max_new_tokens=max_new_tokens, temperature=temperature, top_p=1.0,
                                   eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, generator=gen)
            out.extend(list(r.tokens) for r in rolls)
            continue
        L = max(map(len, chunk))
        ids = torch.full((len(chunk), L), tok.pad_token_id)
        for i, p in enumerate(chunk):
            ids[i, L - len(p):] = torch.tensor(p)
        torch.manual_seed(seed + s)
        kw = dict(do_sample=False) if greedy else dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
        seqs = model.generate(input_ids=ids, attention_mask=(ids != tok.pad_token_id).long(),
                              max_new_tokens=max_new_tokens, eos_token_id=tok.eos_token_id,
                              pad_token_id=tok.pad_token_id, **kw)
        for row in seqs[:, L:].tolist():
            if tok.eos_token_id in row:
                row = row[:row.index(tok.eos_token_id) + 1]
            else:
                row = [t for t in row if t != tok.pad_token_id]
            out.append(row)
    return out


def max_response_tokens(tok, rows: list[dict]) -> int:
    """A response limit with headroom: 1.5x the longest reference solution (+EOS) in tokens."""
    return int(1.5 * max(len(tok.encode(r["solution"], add_special_tokens=False)) for r in rows)) + 2


def evaluate(model, tok, rows: list[dict], *, k: int = 8, greedy: bool = True, seed: int = 0) -> dict:
    """Per-family accuracy: mean over problems and K samples at T=1 ("t1"), and greedy ("greedy")."""
    max_new = max_response_tokens(tok, rows)
    prompts = encode_prompts(tok, [r["problem"] for r in rows])
    res: dict = {}
    modes = [("t1", k, False)] + ([("greedy", 1, True)] if greedy else [])
    for mode, reps, g in modes:
        resp = sample_responses(model, tok, [p for p in prompts for _ in range(reps)], max_new_tokens=max_new,
                                temperature=1.0, greedy=g, seed=seed)
        acc = defaultdict(list)
        for i, r in enumerate(resp):
            row = rows[i // reps]
            acc[row["family"]].append(reward(tok.decode(r, skip_special_tokens=True), row["answer"]))
        res[mode] = {f: sum(v) / len(v) for f, v in acc.items()}
    return res


def format_table(results: dict[str, dict]) -> str:
    """results: {model name: evaluate() output} -> a plain-text per-family table."""
    fams = list(tiny_tasks.FAMILIES)
    lines = [f"{'model':<10}{'mode':<8}" + "".join(f"{f:>8}" for f in fams)]
    for name, res in results.items():
        for mode, acc in res.items():
            lines.append(f"{name:<10}{mode:<8}" + "".join(f"{100 * acc.get(f, float('nan')):8.1f}" for f in fams))
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------
# Token log-probabilities (shared by the GRPO experiment and the compatibility measurement)
# ----------------------------------------------------------------------------------------------------


def response_logprobs(model, tok, prompts: list[list[int]], responses: list[list[int]], *,
                      batch_size: int = 256, grad: bool = False) -> list[torch.Tensor]:
    """Per-token log pi(o_t | q, o_<t) at temperature 1 for each (prompt, response) pair.

    Right-padded batches; returns one 1-D tensor per response (len(response) entries).
    """
    out: list[torch.Tensor] = []
    for s in range(0, len(prompts), batch_size):
        ps, rs = prompts[s:s + batch_size], responses[s:s + batch_size]
        T = max(len(p) + len(r) for p, r in zip(ps, rs))
        x = torch.full((len(ps), T), tok.pad_token_id)
        for i, (p, r) in enumerate(zip(ps, rs)):
            x[i, :len(p) + len(r)] = torch.tensor(p + r)
        mask = torch.zeros_like(x)
        for i, (p, r) in enumerate(zip(ps, rs)):
            mask[i, :len(p) + len(r)] = 1
        with torch.set_grad_enabled(grad):
            logits = model(input_ids=x, attention_mask=mask).logits[:, :-1].float()
            lp = torch.log_softmax(logits, -1).gather(-1, x[:, 1:, None]).squeeze(-1)
        for i, (p, r) in enumerate(zip(ps, rs)):
            out.append(lp[i, len(p) - 1:len(p) - 1 + len(r)])
    return out


# ----------------------------------------------------------------------------------------------------
# Experiment: minimal plain GRPO (finds the lr / batch / steps at which GRPO makes progress)
# ----------------------------------------------------------------------------------------------------


@dataclass
class GRPOExperiment:
    """A minimal GRPO loop's settings; not the trainer (graft.py), a probe of what these models need."""

    steps: int = 40
    """Optimiser steps (each: sample, score, then one epoch of minibatch updates)."""
    prompts: int = 64
    """Prompts per step (all families, drawn without replacement per epoch of the train split)."""
    n: int = 8
    """Rollouts per prompt."""
    minibatches: int = 4
    """Minibatches per step (one Adam step each)."""
    lr: float = 1e-4
    """AdamW learning rate, constant after the warm-up."""
    warmup: int = 0
    """Steps of linear learning-rate warm-up (0 = constant from the start, as the trainer does)."""
    eps_low: float = 0.2
    """PPO clip, lower."""
    eps_high: float = 0.28
    """PPO clip, upper."""
    eval_every: int = 10
    """Evaluate the held-out weak families every this many steps (and at the start and end)."""
    eval_k: int = 4
    """Samples per held-out problem at each evaluation."""
    seed: int = 0
    """Seed of prompt order and sampling."""


def grpo_advantages(r: torch.Tensor) -> torch.Tensor:
    """r: [G, n] rewards -> (r - mean) / (std_unbiased + 1e-6); zero-variance groups get exactly 0."""
    std = r.std(dim=1, keepdim=True)
    a = (r - r.mean(dim=1, keepdim=True)) / (std + 1e-6)
    return torch.where(std > 0, a, torch.zeros_like(a))


def run_grpo(model, tok, train: list[dict], test: list[dict], weak: list[str], ex: GRPOExperiment,
             log=print) -> list[dict]:
    """Plain GRPO on ``train``; logs held-out T=1 accuracy on the families in ``weak`` as it goes.

    Loss per minibatch: -(1/sum |o|) sum_j sum_t min(rho a, clip(rho) a), the token mean over *all*
    of the minibatch's responses. Zero-advantage responses contribute zero to the sum but count in
    the denominator (as in verl), so they are skipped in the forward pass without changing the loss.
    """
    rng = random.Random(f"grpo/{ex.seed}")
    opt = torch.optim.AdamW(model.parameters(), lr=ex.lr, weight_decay=0.01)  # the trainer's optimiser
    max_new = max_response_tokens(tok, train)
    test_weak = [r for r in test if r["family"] in weak]
    history: list[dict] = []
    order: list[int] = []
    t_start = time.time()

    def evaluate_now(step: int) -> None:
        model.eval()
        acc = evaluate(model, tok, test_weak, k=ex.eval_k, greedy=False, seed=10_000 + step)["t1"]
        rec = {"step": step, "weak_acc": sum(acc.values()) / len(acc), **{f"acc_{f}": v for f, v in acc.items()},
               "time_s": time.time() - t_start}
        history.append(rec)
        log(f"  eval step {step:4d}  weak-family T=1 acc {100 * rec['weak_acc']:.1f}  "
            + " ".join(f"{f} {100 * v:.1f}" for f, v in acc.items()) + f"  ({rec['time_s']:.0f}s)")

    evaluate_now(0)
    for step in range(1, ex.steps + 1):
        if len(order) < ex.prompts:
            perm = list(range(len(train)))
            rng.shuffle(perm)
            order.extend(perm)
        rows = [train[i] for i in order[:ex.prompts]]
        del order[:ex.prompts]
        model.eval()
        prompts = encode_prompts(tok, [r["problem"] for r in rows])
        flat_p = [p for p in prompts for _ in range(ex.n)]
        resp = sample_responses(model, tok, flat_p, max_new_tokens=max_new, temperature=1.0,
                                seed=ex.seed * 1_000_003 + step)
        r = torch.tensor([reward(tok.decode(o, skip_special_tokens=True), rows[i // ex.n]["answer"])
                          for i, o in enumerate(resp)]).view(len(rows), ex.n)
        adv = grpo_advantages(r).view(-1)
        old = response_logprobs(model, tok, flat_p, resp)
        model.train()
        for g_ in opt.param_groups:
            g_["lr"] = ex.lr * min(1.0, step / ex.warmup) if ex.warmup else ex.lr
        # Minibatches by prompt groups, so each holds whole groups (as in verl).
        groups = list(range(len(rows)))
        rng.shuffle(groups)
        clip_frac, n_tok_all = [], 0
        for mb in range(ex.minibatches):
            g = groups[mb::ex.minibatches]
            idx = [gi * ex.n + j for gi in g for j in range(ex.n)]
            denom = sum(len(resp[i]) for i in idx)
            live = [i for i in idx if adv[i] != 0]
            if not live:
                continue
            new = response_logprobs(model, tok, [flat_p[i] for i in live], [resp[i] for i in live], grad=True)
            loss = 0.0
            for i, lp in zip(live, new):
                rho = torch.exp(lp - old[i])
                a = adv[i]
                loss = loss - torch.minimum(rho * a, rho.clamp(1 - ex.eps_low, 1 + ex.eps_high) * a).sum()
                clip_frac.append(((rho < 1 - ex.eps_low) | (rho > 1 + ex.eps_high)).float().mean().item())
            loss = loss / denom
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            n_tok_all += denom
        fam_r = defaultdict(list)
        for i, row in enumerate(rows):
            fam_r[row["family"]].append(r[i].mean().item())
        log(f"step {step:4d}  reward {r.mean().item():.3f}  "
            + " ".join(f"{f} {sum(v) / len(v):.2f}" for f, v in sorted(fam_r.items()))
            + f"  all-fail {(r.sum(1) == 0).float().mean().item():.2f}"
            + f"  clip {sum(clip_frac) / max(1, len(clip_frac)):.3f}  {time.time() - t_start:.0f}s")
        if step % ex.eval_every == 0 or step == ex.steps:
            evaluate_now(step)
    return history


# ----------------------------------------------------------------------------------------------------
# Measurement: compatibility score s on the pre-trained pair (DESIGN.md §3.7, §8 lessons 3-4)
# ----------------------------------------------------------------------------------------------------


def measure_compat(run_dir: str, *, n: int = 8, limit: int | None = None, seed: int = 0, log=print) -> dict:
    """Sample n per train prompt from A and B; on prompts where the receiver fails all n and the
    source is mixed, score each of the source's responses retokenised into the receiver.

    s_token = exp(mean token logprob under receiver - mean token logprob under source) (paper), and
    s_byte  = exp((sum logprob under receiver - sum logprob under source) / UTF-8 bytes of the text),
    the per-byte normalisation of lesson 4 (both sums include the EOS token when the source ended
    with EOS). Reports the fraction with s > 0.8, for correct responses and for all of them.
    """
    train = load_jsonl(os.path.join(run_dir, "data", "train.jsonl"))
    if limit:
        random.Random(seed).shuffle(train)
        train = train[:limit]
    models = {name: _load(os.path.join(run_dir, name)) for name in ("A", "B")}
    roll = {}
    for name, (model, tok) in models.items():
        prompts = encode_prompts(tok, [r["problem"] for r in train])
        flat_p = [p for p in prompts for _ in range(n)]
        resp = sample_responses(model, tok, flat_p, max_new_tokens=max_response_tokens(tok, train),
                                temperature=1.0, seed=seed)
        lps = response_logprobs(model, tok, flat_p, resp)
        texts = [tok.decode(o, skip_special_tokens=True) for o in resp]
        r = [reward(t, train[i // n]["answer"]) for i, t in enumerate(texts)]
        roll[name] = dict(resp=resp, lps=lps, texts=texts, r=r)
    report = {}
    for src, rcv in (("A", "B"), ("B", "A")):
        S, R = roll[src], roll[rcv]
        rmodel, rtok = models[rcv]
        stok = models[src][1]
        items = []
        for q, row in enumerate(train):
            k_s = sum(S["r"][q * n:(q + 1) * n])
            k_r = sum(R["r"][q * n:(q + 1) * n])
            if k_r == 0 and 1 <= k_s < n:
                items.extend((q, q * n + j) for j in range(n))
        if not items:
            report[f"{src}->{rcv}"] = {"candidates": 0}
            continue
        rp, rr = [], []
        for q, i in items:
            ended = len(S["resp"][i]) > 0 and S["resp"][i][-1] == stok.eos_token_id
            rp.append(encode_prompts(rtok, [train[q]["problem"]])[0])
            rr.append(rtok.encode(S["texts"][i], add_special_tokens=False) + ([rtok.eos_token_id] if ended else []))
        rlps = response_logprobs(rmodel, rtok, rp, rr)
        rows = []
        for (q, i), lr_ in zip(items, rlps):
            ls = S["lps"][i]
            nbytes = max(1, len(S["texts"][i].encode("utf-8")))
            rows.append(dict(fam=train[q]["family"], correct=S["r"][i] == 1.0,
                             s_tok=math.exp(lr_.mean().item() - ls.mean().item()),
                             s_byte=math.exp((lr_.sum().item() - ls.sum().item()) / nbytes)))
        rep = {"candidates": len({q for q, _ in items})}
        for subset, sel in (("correct", [x for x in rows if x["correct"]]), ("all", rows)):
            for key in ("s_tok", "s_byte"):
                v = sorted(x[key] for x in sel)
                rep[f"{subset}_{key}_median"] = v[len(v) // 2] if v else float("nan")
                rep[f"{subset}_{key}_pass"] = sum(x > 0.8 for x in v) / max(1, len(v))
            rep[f"{subset}_count"] = len(sel)
        fams = defaultdict(int)
        for q in {q for q, _ in items}:
            fams[train[q]["family"]] += 1
        rep["candidate_families"] = dict(fams)
        report[f"{src}->{rcv}"] = rep
        log(f"{src}->{rcv}: " + json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in rep.items()}))
    return report


# ----------------------------------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------------------------------


def _load(folder: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(folder).eval(), AutoTokenizer.from_pretrained(folder)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="GRAFT tiny preset, phase 1")
    sub = p.add_subparsers(dest="cmd", required=True)
    sp = sub.add_parser("prepare", help="data, tokenizers and pre-trained models (cached)")
    sp.add_argument("run_dir")
    sp.add_argument("--eval", action="store_true", help="print the before-RL table afterwards")
    sp = sub.add_parser("eval", help="per-family accuracy of a model folder")
    sp.add_argument("model_dir")
    sp.add_argument("test_jsonl")
    sp.add_argument("--k", type=int, default=8)
    sp = sub.add_parser("grpo", help="minimal plain GRPO experiment on one pre-trained model")
    sp.add_argument("model_dir")
    sp.add_argument("data_dir")
    sp.add_argument("--weak", required=True, help="comma-separated weak families to evaluate")
    for f in dataclasses.fields(GRPOExperiment):
        sp.add_argument(f"--{f.name.replace('_', '-')}", type=type(f.default), default=f.default)
    sp = sub.add_parser("compat", help="compatibility score s on the pre-trained pair")
    sp.add_argument("run_dir")
    sp.add_argument("--limit", type=int, default=None, help="use this many train prompts")
    sp = sub.add_parser("_pretrain_one")
    sp.add_argument("run_dir")
    sp.add_argument("name")
    sp.add_argument("cfg_path")
    args = p.parse_args(argv)
    torch.set_num_threads(1)

    if args.cmd == "_pretrain_one":
        with open(args.cfg_path) as f:
            _pretrain_one(args.run_dir, args.name, TinyConfig(**json.load(f)))
    elif args.cmd == "prepare":
        prepare(args.run_dir, TinyConfig())
        if args.eval:
            rows = load_jsonl(os.path.join(args.run_dir, "data", "test.jsonl"))
            print(format_table({n: evaluate(*_load(os.path.join(args.run_dir, n)), rows) for n in ("A", "B")}))
    elif args.cmd == "eval":
        t0 = time.time()
        res = evaluate(*_load(args.model_dir), load_jsonl(args.test_jsonl), k=args.k)
        print(format_table({os.path.basename(os.path.normpath(args.model_dir)): res}))
        print(f"({time.time() - t0:.0f}s)")
    elif args.cmd == "grpo":
        ex = GRPOExperiment(**{f.name: getattr(args, f.name) for f in dataclasses.fields(GRPOExperiment)})
        model, tok = _load(args.model_dir)
        hist = run_grpo(model, tok, load_jsonl(os.path.join(args.data_dir, "train.jsonl")),
                        load_jsonl(os.path.join(args.data_dir, "test.jsonl")), args.weak.split(","), ex)
        print(json.dumps({"experiment": dataclasses.asdict(ex), "history": hist}))
    elif args.cmd == "compat":
        measure_compat(args.run_dir, limit=args.limit)
    return 0


if __name__ == "__main__":
    sys.exit(main())
