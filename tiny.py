"""The tiny CPU preset: the whole GRAFT method on two tiny models, on a laptop CPU, with a table.

    bash run_pair.sh tiny                      # = python tiny.py --out runs/tiny
    python tiny.py --seeds 3                   # mean +- std over 3 RL seeds per cell
    python tiny.py --variants graft,byte,no_weight,sgt   # more methods in the same table
    python tiny.py --variant sgt               # one variant next to GRPO
    python tiny.py --smoke                     # CI: 3 steps, a 40-problem held-out subset
    python tiny.py --eval-every 20 --plot      # held-out curve per method (needs matplotlib)
    python tiny.py prepare RUN_DIR [--retrain] # only data, tokenizers and pre-trained models

What it does, in RUN_DIR (default runs/tiny; every part is cached, and a killed run resumes):
  1. data/train.jsonl, data/test.jsonl: generated problems of four families (data/tiny_tasks.py:
     add, sub, mul, linear; worked solutions ending in \boxed{}), disjoint splits, 4000 / 800.
  2. A/ = Llama-style model + character-level tokenizer; B/ = Qwen3-style model (grouped-query
     attention, q/k norm) + a 300-token BPE with digits grouped up to three. Both ~0.65M params.
     A is pre-trained (SFT) mostly on add/sub, B mostly on mul/linear, so each is strong where the
     other is weak but not at zero (DESIGN §8, lesson 3). The committed copies in data/tiny_models
     are used when their config digest matches (`--retrain` pre-trains here, ~2-5 minutes).
  3. Held-out accuracy before RL (graft.py eval, T=1, --eval-samples per problem).
  4. For each seed: GRPO for A alone and for B alone, then the GRAFT pair (and each --variants
     entry), all through `graft.py train` with the same starting checkpoints, prompt batches,
     steps, n, lr and minibatches: a budget-equal comparison as in the paper.
  5. Held-out accuracy of every final model; the table per model, family and method (mean +- std
     over seeds), the per-step exchange counts of every pair, results.txt and results.csv, and
     every run's metrics.jsonl under seed*/<method>/<A|B>/.

Prompt: PROMPT_TEMPLATE = "{problem}\n", given to graft.py as --prompt-template.

Phase-1 findings (a throwaway minimal GRPO loop, since replaced by graft.py train):
  * Before RL, held-out accuracy (%), T=1 mean of 8 samples / greedy:
        A  add 88.5/99.0  sub 50.7/63.5  mul  6.9/12.5  linear 19.8/26.5
        B  add 13.4/32.5  sub 12.0/17.0  mul 56.7/77.5  linear 51.1/59.5
  * Plain GRPO, 64 prompts x n=8, 4 minibatches, AdamW 1e-4: weak-family gain after 100 steps
    +3..+7 (A) and +4..+5 (B) over three seeds, +6.4 / +6.3 after 150 steps. lr 1.5e-4..3e-4 was
    flat or worse, 128 prompts per step gained no more per step than 64, 32 prompts much less
    (+1.1 / +3.3 after 120 steps), 8 minibatches no better than 4. Hence the defaults below:
    64 prompts, lr 1e-4, 120 steps (what fits the 15-minute budget on 2 cores).
  * Compatibility on candidate prompts (receiver 0/8, peer mixed): 77-88% of the peer's
    responses pass s > 0.8 per token (median s ~0.87), 96% (A->B) / 72% (B->A) per byte: with
    formulaic worked solutions the gate is not the bottleneck that DESIGN §8 lesson 3 met.

Choices
  * SFT loss on the response tokens and EOS only: the prompt digits are uniform random, so
    modelling them would spend a tiny model's capacity on noise.
  * --seeds varies the RL seed (sampling, minibatch order, prompt order) over the same pre-trained
    pair; pre-training is one fixed seed (it is the shared starting point of both methods).
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


COMMITTED = os.path.join(HERE, "data", "tiny_models")
"""Pre-trained A and B as committed to the repository (built by `python tiny.py prepare data/tiny_models
--retrain` with the default TinyConfig); used when their digest matches, so the preset skips ~2-5
minutes of pre-training."""


def prepare(run_dir: str, cfg: TinyConfig, *, retrain: bool = False) -> None:
    """Data, tokenizers and both pre-trained models in RUN_DIR; finished parts are skipped.

    Models come from the committed copies in data/tiny_models when they were trained with this exact
    config (same digest), else they are pre-trained here; --retrain always pre-trains.
    """
    import shutil
    os.makedirs(run_dir, exist_ok=True)
    data_dir = make_data(run_dir, cfg)
    for n in ("A", "B"):
        src, dst = os.path.join(COMMITTED, n), os.path.join(run_dir, n)
        if (not retrain and not _is_done(dst, cfg) and _is_done(src, cfg)
                and os.path.abspath(src) != os.path.abspath(dst)):
            shutil.copytree(src, dst + ".tmp", dirs_exist_ok=True)
            shutil.rmtree(dst, ignore_errors=True)
            os.replace(dst + ".tmp", dst)
            print(f"[tiny] model {n}: the committed pre-trained copy ({COMMITTED}/{n}, config {cfg.digest()})")
    todo = [n for n in ("A", "B") if retrain or not _is_done(os.path.join(run_dir, n), cfg)]
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



def max_response_tokens(tok, rows: list[dict]) -> int:
    """A response limit with headroom: 1.5x the longest reference solution (+EOS) in tokens."""
    return int(1.5 * max(len(tok.encode(r["solution"], add_special_tokens=False)) for r in rows)) + 2


# ----------------------------------------------------------------------------------------------------
# The preset: GRPO for each model alone vs the GRAFT pair, from the same checkpoints, then a table
# ----------------------------------------------------------------------------------------------------

# Each variant is a set of graft.py flags given to both sides of the pair (DESIGN §3.11). The grpo*
# methods are single-model runs: each model alone, with no peer ("grpo" is n = 8).
SINGLE = ("grpo", "grpo_n16", "grpo_n32")
VARIANT_FLAGS = {
    "grpo_n16": ["--n", "16"],
    "grpo_n32": ["--n", "32"],
    "graft": [],
    "byte": ["--compat-norm", "byte"],
    "no_weight": ["--no-compat-weight"],
    "no_floor": ["--delta", "0"],
    "no_balance": ["--no-balance"],
    "seq_ratio": ["--ratio-level", "sequence"],
    "random_select": ["--selection", "random"],
    "random_accept": ["--acceptance", "random"],
    "peer_first": ["--order", "peer_first"],
    "uniform": ["--order", "uniform"],
    "pooled_adv": ["--peer-advantages", "pooled"],
    "success_only": ["--transfer", "success"],
    "sgt": ["--variant", "sgt"],
    "hacpo": ["--variant", "hacpo"],
    "luffy": ["--variant", "luffy"],
}


@dataclass
class PresetConfig:
    """The RL half of the preset: the same budget for every method (DESIGN §8, issue 8)."""

    out: str = "runs/tiny"
    """Run folder: data, pre-trained models, one sub-folder per seed and method, the tables."""
    seeds: int = 1
    """RL seeds (sampling and minibatch order); cells report mean and std over them."""
    steps: int = 120
    """RL steps per run (same for GRPO and GRAFT)."""
    prompts_per_step: int = 64
    """Prompts per step (both sides see the same batches)."""
    n: int = 8
    """Rollouts per prompt."""
    lr: float = 1e-4
    """AdamW learning rate for every run (found by the phase-1 GRPO experiment)."""
    minibatches: int = 4
    """Optimizer steps per RL step."""
    variants: str = "graft"
    """Comma list of GRAFT variants to run next to GRPO (see VARIANT_FLAGS); 'all' runs every one."""
    compat_norm: str = "token"
    """--compat-norm for the 'graft' run: token (paper) or byte (departure 2)."""
    eval_samples: int = 4
    """Held-out samples per problem at temperature 1 (accuracy = mean over problems and samples)."""
    eval_every: int = 0
    """Held-out evaluation every this many steps inside the runs (for --plot; 0 = final only)."""
    plot: bool = False
    """Write accuracy-vs-step PNGs (needs matplotlib and --eval-every)."""
    smoke: bool = False
    """CI smoke: 3 steps of 16 prompts and a 40-problem held-out subset, to check every phase runs."""
    test_file: str = ""
    """Held-out prompt file (set by run_preset: RUN/data/test.jsonl, or its subset with --smoke)."""


def _run_graft(args: list[str], log_path: str) -> subprocess.Popen:
    """Start `python graft.py ...` with one torch thread (two runs share the 2 cores), logging to a file."""
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    cmd = [sys.executable, os.path.join(HERE, "graft.py")] + args
    print("+ " + " ".join(cmd[1:]) + f"   > {log_path}", flush=True)
    return subprocess.Popen(cmd, stdout=open(log_path, "w"), stderr=subprocess.STDOUT, env=env)


def _wait(procs: list[tuple[subprocess.Popen, str]]) -> None:
    failed = [(p, log) for p, log in procs if p.wait() != 0]
    for p, log in failed:
        with open(log) as f:
            print(f.read()[-3000:])
    if failed:
        raise SystemExit(f"tiny.py: {len(failed)} run(s) failed; logs: {', '.join(log for _, log in failed)}")


def _final_ckpt(out: str, steps: int) -> str:
    return os.path.join(out, "checkpoints", f"step_{steps:06d}")


def run_methods(run_dir: str, pc: PresetConfig, seed: int, methods: list[str], max_new: int) -> None:
    """Train every method of one seed; runs already finished (final checkpoint present) are skipped,
    and a killed run resumes from its last checkpoint (--resume)."""
    data = os.path.join(run_dir, "data")
    common = ["--prompts", os.path.join(data, "train.jsonl"), "--steps", str(pc.steps), "--prompts-per-step",
              str(pc.prompts_per_step), "--n", str(pc.n), "--minibatches", str(pc.minibatches), "--lr", str(pc.lr),
              "--max-response-tokens", str(max_new), "--prompt-template", PROMPT_TEMPLATE, "--threads", "1",
              "--seed", str(seed), "--data-seed", str(seed), "--save-every", str(max(1, pc.steps // 4)),
              "--micro-batch-size", "64", "--gen-batch-size", "1024", "--resume", "--exchange-timeout", "1800"]
    if pc.eval_every:
        common += ["--eval-every", str(pc.eval_every), "--benchmarks", pc.test_file,
                   "--eval-samples", "1", "--eval-temperature", "1.0", "--eval-top-p", "1.0",
                   "--eval-max-tokens", str(max_new)]
    for method in methods:
        base = os.path.join(run_dir, f"seed{seed}", method)
        sides = (("A", "a", "b"), ("B", "b", "a"))
        if all(os.path.isdir(_final_ckpt(os.path.join(base, s), pc.steps)) for s, _, _ in sides):
            print(f"[tiny] seed {seed} {method}: cached")
            continue
        os.makedirs(base, exist_ok=True)
        t0, procs = time.time(), []
        for model, name, peer in sides:
            args = ["train", "--model", os.path.join(run_dir, model), "--name", name, "--out", os.path.join(base, model)]
            if method in SINGLE:
                flags = VARIANT_FLAGS.get(method, [])
            else:
                flags = VARIANT_FLAGS[method] + (["--compat-norm", pc.compat_norm] if method == "graft" else [])
                args += ["--peer-name", peer, "--peer-exchange", os.path.join(base, "exchange")]
            procs.append((_run_graft(args + common + flags, os.path.join(base, f"{model}.log")), os.path.join(base, f"{model}.log")))
        _wait(procs)
        print(f"[tiny] seed {seed} {method}: {time.time() - t0:.0f}s", flush=True)


def family_accuracy(results_json: str, test_rows: list[dict]) -> dict[str, float]:
    """graft.py eval's per-problem results -> accuracy per family and overall (mean over samples)."""
    with open(results_json) as f:
        res = json.load(f)
    fam = {r["id"]: r["family"] for r in test_rows}
    acc = defaultdict(list)
    for rows in res["problems"].values():
        for r in rows:
            score = sum(r["correct"]) / len(r["correct"])
            acc[fam[r["id"]]].append(score)
            acc["overall"].append(score)
    return {k: sum(v) / len(v) for k, v in acc.items()}


def evaluate_models(run_dir: str, pc: PresetConfig, jobs: list[tuple[str, str]], max_new: int) -> None:
    """Held-out evaluation of (model folder, result path) pairs, two processes at a time; cached."""
    test = pc.test_file
    todo = [(m, out) for m, out in jobs if not os.path.exists(out)]
    for i in range(0, len(todo), 2):
        procs = []
        for model, out in todo[i: i + 2]:
            args = ["eval", "--model", model, "--benchmarks", test, "--samples", str(pc.eval_samples),
                    "--temperature", "1.0", "--top-p", "1.0", "--eval-max-tokens", str(max_new),
                    "--max-response-tokens", str(max_new), "--prompt-template", PROMPT_TEMPLATE, "--threads", "1",
                    "--gen-batch-size", "1024", "--eval-out", out]
            procs.append((_run_graft(args, out + ".log"), out + ".log"))
        _wait(procs)


def _mean_std(xs: list[float]) -> str:
    if len(xs) == 1:
        return f"{100 * xs[0]:5.1f}"
    mu = sum(xs) / len(xs)
    sd = math.sqrt(sum((x - mu) ** 2 for x in xs) / (len(xs) - 1))
    return f"{100 * mu:5.1f}+-{100 * sd:3.1f}"


def exchange_counts(run_dir: str, seeds: int, method: str) -> dict[str, dict[str, float]]:
    """Mean per-step exchange counts of each side of a pair (from its metrics.jsonl)."""
    keys = ("candidates_in", "selected", "accepted", "rejected", "dropped_length", "mean_w", "mean_s")
    out = {}
    for model in ("A", "B"):
        rows = []
        for seed in range(seeds):
            path = os.path.join(run_dir, f"seed{seed}", method, model, "metrics.jsonl")
            if os.path.exists(path):
                rows += [json.loads(x) for x in open(path) if x.strip()]
        vals = {k: [r[k] for r in rows if isinstance(r.get(k), (int, float)) and r[k] == r[k]] for k in keys}  # NaN-free
        out[model] = {k: sum(v) / len(v) if v else float("nan") for k, v in vals.items()}
    return out


def report(run_dir: str, pc: PresetConfig, methods: list[str]) -> str:
    """The table: per model, per family and overall held-out accuracy before RL and after each method."""
    test_rows = load_jsonl(pc.test_file)
    fams = list(tiny_tasks.FAMILIES) + ["overall"]
    csv_rows = ["seed,method,model," + ",".join(fams)]
    lines = [f"held-out accuracy (%), {len(test_rows)} problems x {pc.eval_samples} samples at T=1, "
             f"{pc.seeds} seed(s); {pc.steps} steps x {pc.prompts_per_step} prompts x n={pc.n}, lr {pc.lr}",
             f"{'model':<6}{'method':<15}" + "".join(f"{f:>12}" for f in fams)]
    for model in ("A", "B"):
        for method in ["before"] + methods:
            cells = defaultdict(list)
            for seed in range(pc.seeds if method != "before" else 1):
                path = (os.path.join(run_dir, "eval", f"before_{model}.json") if method == "before" else
                        os.path.join(run_dir, f"seed{seed}", method, model, "eval.json"))
                acc = family_accuracy(path, test_rows)
                csv_rows.append(f"{seed},{method},{model}," + ",".join(f"{acc.get(f, float('nan')):.4f}" for f in fams))
                for f in fams:
                    cells[f].append(acc.get(f, float("nan")))
            lines.append(f"{model:<6}{method:<15}" + "".join(f"{_mean_std(cells[f]):>12}" for f in fams))
    for method in methods:
        if method in SINGLE:
            continue
        c = exchange_counts(run_dir, pc.seeds, method)
        for model in ("A", "B"):
            x = c[model]
            lines.append(f"{method} -> {model}: per step {x['candidates_in']:.1f} candidates, {x['selected']:.1f} selected, "
                         f"{x['accepted']:.1f} accepted, {x['rejected']:.1f} rejected, {x['dropped_length']:.1f} too long; "
                         f"mean s {x['mean_s']:.2f}, mean w {x['mean_w']:.2f}")
    table = "\n".join(lines)
    with open(os.path.join(run_dir, "results.csv"), "w") as f:
        f.write("\n".join(csv_rows) + "\n")
    with open(os.path.join(run_dir, "results.txt"), "w") as f:
        f.write(table + "\n")
    return table


def plot(run_dir: str, pc: PresetConfig, methods: list[str]) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("[tiny] --plot: matplotlib is not installed; skipping the PNG")
        return
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for ax, model in zip(axes, ("A", "B")):
        for method in methods:
            for seed in range(pc.seeds):
                path = os.path.join(run_dir, f"seed{seed}", method, model, "metrics.jsonl")
                pts = [(m["step"] + 1, m["eval/mean"]) for m in map(json.loads, open(path)) if "eval/mean" in m] \
                    if os.path.exists(path) else []
                if pts:
                    ax.plot(*zip(*pts), label=f"{method} s{seed}", color=f"C{methods.index(method)}", alpha=0.8)
        ax.set_title(f"model {model}")
        ax.set_xlabel("RL step")
    axes[0].set_ylabel("held-out accuracy (T=1, 1 sample)")
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(run_dir, "accuracy.png"), dpi=120)
    print(f"[tiny] plot -> {os.path.join(run_dir, 'accuracy.png')}")


def run_preset(pc: PresetConfig, tc: TinyConfig, *, retrain: bool = False) -> str:
    """Prepare, evaluate before RL, train every method for every seed, evaluate, print the table."""
    t0 = time.time()
    run_dir = pc.out
    if pc.smoke:  # CI: every phase, a few steps, a 40-problem held-out subset
        pc.steps, pc.prompts_per_step, pc.eval_samples, pc.seeds = min(pc.steps, 3), 16, 1, 1
    prepare(run_dir, tc, retrain=retrain)
    test_path = os.path.join(run_dir, "data", "test.jsonl")
    if pc.smoke:
        rows = load_jsonl(test_path)[::20]
        test_path = os.path.join(run_dir, "data", "test_smoke.jsonl")
        tiny_tasks.write_jsonl(test_path, rows)
    pc.test_file = test_path
    test_rows = load_jsonl(test_path)
    from transformers import AutoTokenizer
    tok_a = AutoTokenizer.from_pretrained(os.path.join(run_dir, "A"))
    max_new = max_response_tokens(tok_a, test_rows)  # the character model needs the most tokens
    variants = list(VARIANT_FLAGS) if pc.variants == "all" else [v.strip() for v in pc.variants.split(",") if v.strip()]
    unknown = [v for v in variants if v not in VARIANT_FLAGS]
    if unknown:
        raise SystemExit(f"--variants: unknown {unknown}; known: {', '.join(VARIANT_FLAGS)}")
    methods = ["grpo"] + [v for v in variants if v != "grpo"]
    os.makedirs(os.path.join(run_dir, "eval"), exist_ok=True)
    evaluate_models(run_dir, pc, [(os.path.join(run_dir, m), os.path.join(run_dir, "eval", f"before_{m}.json"))
                                  for m in ("A", "B")], max_new)
    for seed in range(pc.seeds):
        run_methods(run_dir, pc, seed, methods, max_new)
        evaluate_models(run_dir, pc, [(_final_ckpt(os.path.join(run_dir, f"seed{seed}", m, s), pc.steps),
                                       os.path.join(run_dir, f"seed{seed}", m, s, "eval.json"))
                                      for m in methods for s in ("A", "B")], max_new)
    table = report(run_dir, pc, methods)
    if pc.plot:
        plot(run_dir, pc, methods)
    print(table)
    print(f"[tiny] total {time.time() - t0:.0f}s; table -> {run_dir}/results.txt, {run_dir}/results.csv")
    return table


# ----------------------------------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0].startswith("-"):
        argv = ["run"] + argv  # `python tiny.py [flags]` runs the preset
    p = argparse.ArgumentParser(prog="tiny.py", description="GRAFT tiny CPU preset")
    sub = p.add_subparsers(dest="cmd", required=True)
    sp = sub.add_parser("run", help="the preset: GRPO vs GRAFT (and variants) from the same checkpoints, a table",
                        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    from graft import field_docs
    docs = field_docs(PresetConfig)
    for f in dataclasses.fields(PresetConfig):
        if f.name == "test_file":
            continue
        flag = f"--{f.name.replace('_', '-')}"
        if isinstance(f.default, bool):
            sp.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, help=docs.get(f.name))
        else:
            sp.add_argument(flag, type=type(f.default), default=f.default, help=docs.get(f.name))
    sp.add_argument("--variant", dest="variant_one", default=None, help="one variant (same as --variants NAME)")
    sp.add_argument("--retrain", action="store_true", help="pre-train A and B here instead of using the committed copies")
    sp = sub.add_parser("prepare", help="data, tokenizers and pre-trained models (cached)")
    sp.add_argument("run_dir")
    sp.add_argument("--retrain", action="store_true", help="pre-train even if a committed copy matches")
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
        prepare(args.run_dir, TinyConfig(), retrain=args.retrain)
    else:
        pc = PresetConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(PresetConfig) if hasattr(args, f.name)})
        if args.variant_one:
            pc.variants = args.variant_one
        run_preset(pc, TinyConfig(), retrain=args.retrain)
    return 0


if __name__ == "__main__":
    sys.exit(main())
