"""The tiny CPU preset: the whole GRAFT method on two tiny models, on a laptop CPU, with its tables.

    bash run_pair.sh tiny                      # = python -m tools.tiny --out runs/tiny
    python -m tools.tiny --seeds 3                   # mean +- std over 3 RL seeds per cell
    python -m tools.tiny --seeds 3 --no-held-out     # the mechanism panel alone
    python -m tools.tiny report runs/tiny            # Markdown for RESULTS.md, recomputed from a finished run's files
    python -m tools.tiny figure runs/tiny --out docs/mechanism_panel.png   # README's figure: the panel's curves by step
    python -m tools.tiny --split val                 # the held-out table on the validation split (choosing settings)
    python -m tools.tiny --variants graft,byte,no_weight,sgt   # more methods in the held-out table
    python -m tools.tiny --variant sgt               # one variant next to GRPO
    python -m tools.tiny --models 3                  # a third model C: three pairs and the three-way run
    python -m tools.tiny --smoke                     # CI: 3 steps, a 50-problem subset, a panel of 2 x 4 problems
    python -m tools.tiny --eval-every 20 --plot      # accuracy curve per method (needs matplotlib)
    python -m tools.tiny prepare RUN_DIR [--models 3] [--retrain]  # only data, tokenizers and pre-trained models

What it measures. The paper's claim is about prompts on which the receiver fails all n rollouts:
GRPO has no gradient there, GRAFT gives one from the peer's mixed group. Two tables test it.

The mechanism panel (printed first; in-sample by design). A fixed set of 48 train problems: 24
that A fails 0/8 before RL while B solves 2-6 of 8 (a mixed group, Eq. 4's condition), and 24 the
other way round, the first of each kind in a seeded shuffle of the train split, found by one
evaluation of each model before RL (8 samples at T=1, 500 problems at a time until both halves
are full: 2000 for the committed models); the held-out and validation splits are never touched. The
set is symmetric because the paper's balanced swap moves m = min(candidates each way) groups: with
one side's failures only it would exchange nothing. GRPO for each model alone and the GRAFT pair
train on the whole set every step (30 steps x 48 prompts x n=8, the preset's other settings) from
the same checkpoints. Printed per model: the train reward on its own all-fail half and on the
other half over steps 1-10, 11-20 and 21-30 under both methods, the paired GRAFT - GRPO difference
(mean +- std over seeds), the groups received and peer responses accepted per step and the clip
fractions of peer and own tokens; every figure comes from the runs' rollout files and metrics.jsonl,
so the panel costs no evaluation. It asks whether a receiver learns prompts it had no signal on,
which is the paper's premise, not whether that generalises.

The held-out table (printed second) measures generalisation: for each model, the beyond-sample
subset (the evaluated problems it fails on all k = 8 samples before RL while its peer solves at
least one) with accuracy before RL, after GRPO and after GRAFT (mean +- std over seeds, and the
paired GRAFT - GRPO difference), next to the rest of the split and the overall accuracy. The subset
is picked by k samples of an evaluation of the models before RL and measured by k further samples
of the same evaluation (2k per problem), so the "before" column is an honest re-draw, not 0% by
construction. At this scale the table is not expected to move: RL on 0.7M-parameter models does
not generalise (GRPO's in-sample gain lowers A's validation accuracy), each train prompt is seen
about once in 100 x 48 steps, and a problem a model fails 0/8 in an evaluation still has a few
percent success per sample under GRPO, so GRPO is not signal-free there. Also printed: the
complementarity statistic (share of a model's all-fail problems its peer solves at least once; the
paper reports 47.9% and 18.7% for its Pair 1) before RL and between the two GRPO-trained models;
the train-side view (the train prompts a side received from its peer in the GRAFT run, recomputed
from the runs' rollout files with the trainer's balanced swap, and their pass@8 before RL, after
GRPO and after GRAFT); per-pair exchange diagnostics (candidates, selected, accepted, mean s, mean
w, clip fractions of own and peer tokens); and a profile (seconds per step by phase from every
run's metrics.jsonl, wall seconds per job). Measured figures: RESULTS.md, tiny preset, whose block
`python -m tools.tiny report RUN_DIR` regenerates from the run that printed them.

What it does, in RUN_DIR (default runs/tiny; every part is cached, and a killed run resumes):
  1. data/{train,val,test}.jsonl: generated problems of five families (data/tiny_tasks.py: add,
     sub, mul, linear, mul2; worked solutions ending in \\boxed{}), 4000 train / 500 validation
     (cut from the generated train problems) / 1000 held-out, disjoint, balanced over families.
  2. A/ = Llama-style model + character-level tokenizer; B/ = Qwen3-style model (grouped-query
     attention, q/k norm) + a 300-token BPE with digits grouped up to three; with --models 3 also
     C/ = GPT-NeoX-style model (LayerNorm, parallel attention and MLP, rotary on a quarter of each
     head, untied output embedding) + a 400-token byte-level BPE that merges digit runs by
     frequency (GPT-2 style). ~0.65-0.70M params each, pre-trained (SFT) on the train split only,
     with different family mixes (TinyConfig, MODELS). The committed copies in data/tiny_models are
     used when their digest (the shared fields and the model's own) matches (`--retrain` pre-trains
     here: ~4 minutes for A and B on an idle 2-core machine, ~8 under load; C ~1.5 minutes).
  3. panel/: the pick (pool_NN.jsonl, pick_A_NN.json, pick_B_NN.json: both models on chunk NN of the
     pool, n samples at T=1), the fixed set (set.jsonl, set.json), then for each seed the GRAFT pair
     and GRPO for A and for B on it (panel/seed<s>/{graft,grpo}/). These jobs come first (--no-panel
     skips them).
  4. For each seed: the GRAFT pair (and each --variants entry), then GRPO for A alone and for B
     alone, all through `graft.py train` with the same starting checkpoints, prompt batches, steps,
     n, lr and minibatches: a budget-equal comparison as in the paper. At most --slots graft.py
     processes run at once (one torch thread each), in that order, and the evaluations fill the
     slot the shorter GRPO run leaves idle. With --models 3: GRPO for each of A, B and C, every
     exchange method on the pairs A-B, A-C, B-C (columns graft_AB, ...) and on all three at once
     (column graft: three processes with `--peer-name` listing the other two, graft.py's
     multi-peer rule), all from the same checkpoints and batches; the three-way run starts when
     nothing else runs, and the profile prints its wall time against the A-B pair's. After every
     exchange run (the panel's too) the preset recomputes each step's assignment from the rollout
     files and checks that every process logged the same fingerprint (metrics key "assignment"); a
     disagreement stops it. --no-held-out skips this step and the next.
  5. Evaluations (graft.py eval, T=1): the models before RL at 2k samples per problem, every final
     model at k, on the split and on the received train prompts.
  6. The tables, printed and written: results.txt (what is printed), panel.csv (one row per seed,
     method, model, half and window), results.csv (one row per seed, method, model and subset: size
     and accuracy), run.json (the command, the settings, the machine, its load average at the start
     and the end, the wall time), which `tiny.py report` reads.

Prompt: PROMPT_TEMPLATE = "{problem}\\n", given to graft.py as --prompt-template.

Settings, each with its reason
  1. k = 8 samples per problem, and the held-out subset picked and measured by separate draws: with
     fewer samples and one draw, much of "fails all k" is bad luck on problems solved ~10% of the
     time, which regression to the mean lifts under both methods alike.
  2. A fifth family, mul2 (two-digit times two-digit), pre-trained by neither model: both fail it
     nearly always, as both paper models fail many MATH problems. Without such problems each
     model's all-fail problems are almost all in its weak families, which its peer solves, and the
     complementarity is far above the paper's 47.9% / 18.7%.
  3. Weak-family mixes (A: mul 0.04, linear 0.02; B: add 0.12, sub 0.12): A's success on mul and
     linear is near zero, so its beyond-sample problems are ones it truly does not solve, while B's
     add/sub are weak but alive. Chosen on the validation split, where they give 44.3% (B solves of
     A's all-fail) and 40.5% (A solves of B's); B at 0.2 add/sub (0.3 mul/linear) gave 39.5% /
     34.8% and a weaker B on its own families.
  4. A validation split (500 problems cut from train; neither pre-training nor RL sees it): the
     mixes above were chosen on it, and `--split val` runs the held-out table on it. The held-out
     split is only read for the final table.
  5. Jobs in slots (run_jobs): the GRPO runs of A and B take unequal time (the character model's
     sequences are longer), so the evaluations fill the idle slot.
  6. 100 steps x 48 prompts in the held-out runs, for time on a shared 2-core machine; progress per
     step was the same at 128 and 64 prompts, so prompts were cut before steps. Fewer prompts mean
     fewer exchanged groups (see the diagnostics).
  7. The panel's peer groups are mixed, not merely solved once: a peer group that solves all 8 has
     zero advantages and is no candidate (Eq. 4). Of the mixed ones it keeps 2-6 of 8 (--panel-peer):
     at 7 of 8, the most common kind on A's half, the group's seven correct responses carry advantage
     +0.35 each and its wrong one -2.47 (Eq. 2, unbiased std), so the group mostly says "not this
     one"; at 1 of 8 the other way round. Its 30 steps on 48 prompts show the mechanism within
     minutes, and windows of 10 steps average out the step-to-step noise of 48 prompts.
The other RL settings (n=8, AdamW 1e-4, 4 minibatches, eps 0.2/0.28, delta 0.8 per token) are
those a minimal GRPO loop found: lr 1.5e-4..3e-4 was flat or worse, 8 minibatches no better than 4,
and lr 3e-4 on validation collapses A under both methods. They were run on the validation split
(`--split val`) before the held-out table, not re-tuned.

Model C (with --models 3). Its mix (add 0.40, mul 0.40, sub 0.10, linear 0.10) makes each model
weak where another is strong: A on mul/linear, B on add/sub, C on sub/linear; on validation before
RL (8 samples, T=1) C scores add 72.5%, sub 9.1%, mul 45.9%, linear 20.1% (A: 94.0/71.0/0.9/10.1,
B: 23.8/19.2/50.6/45.4), and C solves 41.2% of A's all-fail problems and 30.1% of B's. The mix was
set once, before any RL run with C, and not tuned. The panel stays the pair A-B's.

Choices
  * SFT loss on the response tokens and EOS only: the prompt digits are uniform random, so
    modelling them would spend a tiny model's capacity on noise.
  * --seeds varies the RL seed (sampling, minibatch order, prompt order) over the same pre-trained
    pair; pre-training is one fixed seed (it is the shared starting point of both methods). The
    panel's fixed set is one pick (PANEL_SEED) for every RL seed.
  * The train-side view counts a prompt as received when the swap selected its group; the rollout
    files do not record which of its responses the compatibility gate then removed.
  * The panel's reward is the train reward of the runs' own rollouts (T=1, n=8 per prompt per step),
    read from the rollout files: with the whole set in every step it is an in-sample evaluation of
    the current policy at each step.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import os
import random
import shlex
import string
import subprocess
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from data import tiny_tasks  # the problem generator
from metrics import read_metrics
from tools import panel  # the mechanism panel: its job queue, file readers and table cells
from tools.panel import (Job, cell, check_assignments, load_eval, mean_key, run_jobs, step_sources, with_prefix,
                         write_lines)

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository root

PROMPT_TEMPLATE = "{problem}\n"
"""The tiny preset's prompt: the problem and a newline. Short, because every prompt token of the
character-level model is a position the CPU has to run."""

# ------------------------------------------------------------------------------------------------
# Config
# ------------------------------------------------------------------------------------------------


@dataclass
class TinyConfig:
    """Everything the tiny preset's phase 1 depends on; its hash names the cached artefacts."""

    seed: int = 0
    """Seed of the problem generator, model initialisation and pre-training batches."""
    n_train: int = 4500
    """Generated train problems (balanced over the families), before the validation split is cut out."""
    n_val: int = 500
    """Validation problems cut from the train problems (the last ones of each family): the settings of
    the preset were chosen on them. Neither pre-training nor RL sees them."""
    n_test: int = 1000
    """Generated held-out problems (200 per family), used only for the final table."""
    mix_a: dict = field(default_factory=lambda: {"add": 0.46, "sub": 0.48, "mul": 0.04, "linear": 0.02, "mul2": 0.0})
    """Pre-training family mix of model A (Llama, char): strong on add/sub, near zero on mul/linear."""
    mix_b: dict = field(default_factory=lambda: {"add": 0.12, "sub": 0.12, "mul": 0.38, "linear": 0.38, "mul2": 0.0})
    """Pre-training family mix of model B (Qwen3, BPE): strong on mul/linear, weak but not at zero on add/sub."""
    mix_c: dict = field(default_factory=lambda: {"add": 0.40, "sub": 0.10, "mul": 0.40, "linear": 0.10, "mul2": 0.0})
    """Pre-training family mix of model C (GPT-NeoX, byte-level BPE; --models 3 only): strong on add/mul, weak
    on sub/linear, so that each of the three models is weak where another is strong."""
    hidden: int = 128
    """Hidden size of every model."""
    layers: int = 3
    """Decoder layers of every model."""
    heads: int = 4
    """Attention heads of every model (head dim = hidden / heads)."""
    intermediate: int = 384
    """MLP width of the gated (SwiGLU) MLPs of A and B; C's plain GELU MLP is 4 x hidden, as in GPT-NeoX."""
    bpe_vocab: int = 300
    """Vocabulary size of model B's BPE tokenizer (specials included)."""
    bytelevel_vocab: int = 400
    """Vocabulary size of model C's byte-level BPE (256 byte symbols, 3 specials, the rest merges)."""
    sft_steps: int = 600
    """Pre-training optimiser steps per model."""
    sft_batch: int = 64
    """Pre-training sequences per step."""
    sft_lr: float = 3e-3
    """Peak AdamW learning rate of pre-training (linear warm-up, cosine decay to 10%)."""
    sft_warmup: int = 50
    """Warm-up steps of pre-training."""

    def digest(self, model: str) -> str:
        """Short hash of the fields that model ``model`` depends on: the shared ones and its own (MODELS).
        A changed field invalidates that model's cached copy, and no other's: a change to C's mix keeps A and B
        valid."""
        own = {f for m in MODELS.values() for f in m.own}
        blob = {k: v for k, v in dataclasses.asdict(self).items() if k not in own or k in MODELS[model].own}
        return hashlib.sha256(json.dumps(blob, sort_keys=True).encode()).hexdigest()[:12]


@dataclass(frozen=True)
class TinyModel:
    """One model of the preset: architecture, tokenizer, and the TinyConfig fields only it depends on."""

    arch: str
    """build_model's kind: llama, qwen3 or gpt_neox."""
    tokenizer: str
    """char, bpe or bytelevel (see Tokenizers)."""
    mix: str
    """The TinyConfig field of its pre-training family mix."""
    extra: tuple[str, ...] = ()
    """Its other TinyConfig fields (its tokenizer's vocabulary size)."""

    @property
    def own(self) -> tuple[str, ...]:
        """Every TinyConfig field only this model depends on: part of its digest, of no other model's."""
        return (self.mix, *self.extra)


MODELS = {
    "A": TinyModel("llama", "char", "mix_a"),
    "B": TinyModel("qwen3", "bpe", "mix_b", ("bpe_vocab",)),
    "C": TinyModel("gpt_neox", "bytelevel", "mix_c", ("bytelevel_vocab",)),
}
"""The preset's models by name. A and B are the pair; C joins with --models 3. The three differ in
architecture and tokenizer, as the paper's pairs do, and each is weak on families another is strong on."""


# ------------------------------------------------------------------------------------------------
# Data
# ------------------------------------------------------------------------------------------------


def load_jsonl(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def split_validation(rows: list[dict], n_val: int) -> tuple[list[dict], list[dict]]:
    """(train, validation): the last ``n_val // F`` rows of each of the F families go to validation."""
    k = n_val // len(tiny_tasks.FAMILIES)
    by_family = defaultdict(list)
    for row in rows:
        by_family[row["family"]].append(row)
    train, val = [], []
    for fam_rows in by_family.values():
        assert len(fam_rows) > k, f"n_val={n_val} leaves no train rows for family {fam_rows[0]['family']}"
        train += fam_rows[: len(fam_rows) - k]
        val += fam_rows[len(fam_rows) - k:]
    return train, val


def make_data(run_dir: str, cfg: TinyConfig) -> str:
    """Generate the train/val/test splits into RUN_DIR/data (skipped if present for the same
    generator arguments); return that folder."""
    out = os.path.join(run_dir, "data")
    meta = {"seed": cfg.seed, "n_train": cfg.n_train, "n_val": cfg.n_val, "n_test": cfg.n_test,
            "families": list(tiny_tasks.FAMILIES)}
    try:
        with open(os.path.join(out, "meta.json")) as f:
            if json.load(f) == meta:
                return out
    except (OSError, ValueError):
        pass
    os.makedirs(out, exist_ok=True)
    train, test = tiny_tasks.generate(cfg.seed, cfg.n_train, cfg.n_test)
    train, val = split_validation(train, cfg.n_val)
    tiny_tasks.write_jsonl(os.path.join(out, "train.jsonl"), train)
    tiny_tasks.write_jsonl(os.path.join(out, "val.jsonl"), val)
    tiny_tasks.write_jsonl(os.path.join(out, "test.jsonl"), test)
    with open(os.path.join(out, "meta.json"), "w") as f:  # written last: marks the splits complete
        json.dump(meta, f)
    return out


# ------------------------------------------------------------------------------------------------
# Tokenizers
# ------------------------------------------------------------------------------------------------

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


def build_bytelevel_tokenizer(texts: list[str], vocab_size: int):
    """GPT-2/GPT-NeoX-style byte-level BPE trained on the generated text, digits not grouped.

    Text is mapped to bytes first (256 base symbols, so nothing is ever unknown), split by GPT-2's
    regex, and merged by frequency with no rule for digits: " 78" becomes " 7" + "8" and "292" may
    become "29" + "2", boundaries that agree with neither A's single digits nor B's groups of three.
    The byte-level decoder maps the bytes back, so decode(encode(t)) == t.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    return _wrap(tok)


def build_tokenizer(kind: str, texts: list[str], cfg: "TinyConfig"):
    """The tokenizer of a TinyModel: char, bpe or bytelevel (the latter two trained on ``texts``)."""
    if kind == "char":
        return build_char_tokenizer()
    if kind == "bpe":
        return build_bpe_tokenizer(texts, cfg.bpe_vocab)
    if kind == "bytelevel":
        return build_bytelevel_tokenizer(texts, cfg.bytelevel_vocab)
    raise ValueError(f"unknown tokenizer kind {kind!r}")


# ------------------------------------------------------------------------------------------------
# Models
# ------------------------------------------------------------------------------------------------


def build_model(kind: str, tok, cfg: TinyConfig):
    """A tiny Llama ("llama"), Qwen3 ("qwen3") or GPT-NeoX ("gpt_neox") decoder for ``tok``, fp32."""
    from transformers import AutoModelForCausalLM, GPTNeoXConfig, LlamaConfig, Qwen3Config

    common = dict(vocab_size=len(tok), hidden_size=cfg.hidden, intermediate_size=cfg.intermediate,
                  num_hidden_layers=cfg.layers, num_attention_heads=cfg.heads, max_position_embeddings=256,
                  tie_word_embeddings=True, bos_token_id=None, eos_token_id=tok.eos_token_id,
                  pad_token_id=tok.pad_token_id)
    if kind == "llama":
        mcfg = LlamaConfig(num_key_value_heads=cfg.heads, **common)
    elif kind == "qwen3":
        # Differs from the Llama beyond the tokenizer: grouped-query attention and q/k RMSNorm.
        mcfg = Qwen3Config(num_key_value_heads=max(1, cfg.heads // 2), head_dim=cfg.hidden // cfg.heads, **common)
    elif kind == "gpt_neox":
        # Differs from both: LayerNorm with biases, attention and a plain GELU MLP (4 x hidden) in parallel off
        # one residual, rotary embedding on a quarter of each head, and an output embedding of its own.
        common |= dict(intermediate_size=4 * cfg.hidden, tie_word_embeddings=False)
        mcfg = GPTNeoXConfig(use_parallel_residual=True, **common)
    else:
        raise ValueError(f"unknown model kind {kind!r}")
    torch.manual_seed(cfg.seed)
    return AutoModelForCausalLM.from_config(mcfg)


def n_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


# ------------------------------------------------------------------------------------------------
# Pre-training (SFT)
# ------------------------------------------------------------------------------------------------


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
    """Build, pre-train and save model ``name`` (a key of MODELS) into RUN_DIR/name (one process)."""
    torch.set_num_threads(1)
    from transformers import AutoTokenizer

    out, spec = os.path.join(run_dir, name), MODELS[name]
    tok = AutoTokenizer.from_pretrained(os.path.join(run_dir, f"tok_{name}"))
    model = build_model(spec.arch, tok, cfg)
    rows = load_jsonl(os.path.join(run_dir, "data", "train.jsonl"))
    log = lambda msg: print(f"[{name}] {msg}", flush=True)  # noqa: E731
    log(f"{type(model).__name__}: {n_params(model):,} params, vocab {len(tok)}")
    wall = pretrain(model, tok, rows, getattr(cfg, spec.mix), cfg, log)
    tmp = f"{out}.tmp.{os.getpid()}"
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    with open(os.path.join(tmp, "tiny_done.json"), "w") as f:
        json.dump({"config": dataclasses.asdict(cfg), "digest": cfg.digest(name), "sft_wall_s": wall}, f)
    if os.path.isdir(out):
        import shutil
        shutil.rmtree(out)
    os.replace(tmp, out)  # atomic: a folder with tiny_done.json is always complete
    log(f"saved {out} ({wall:.0f}s)")


def _is_done(folder: str, name: str, cfg: TinyConfig) -> bool:
    try:
        with open(os.path.join(folder, "tiny_done.json")) as f:
            return json.load(f)["digest"] == cfg.digest(name)
    except (OSError, ValueError, KeyError):
        return False


COMMITTED = os.path.join(HERE, "data", "tiny_models")
"""Pre-trained A, B and C as committed to the repository (built by `python -m tools.tiny prepare data/tiny_models
--models 3 --retrain` with the default TinyConfig); each is used when its digest matches, so the preset
skips ~4-8 minutes of pre-training."""


def prepare(run_dir: str, cfg: TinyConfig, *, models: tuple[str, ...] = ("A", "B"), retrain: bool = False) -> None:
    """Data, tokenizers and the pre-trained ``models`` in RUN_DIR; finished parts are skipped.

    Models come from the committed copies in data/tiny_models when they were trained with the same
    fields (same digest), else they are pre-trained here; --retrain always pre-trains.
    """
    import shutil
    os.makedirs(run_dir, exist_ok=True)
    data_dir = make_data(run_dir, cfg)
    for n in models:
        src, dst = os.path.join(COMMITTED, n), os.path.join(run_dir, n)
        if (not retrain and not _is_done(dst, n, cfg) and _is_done(src, n, cfg)
                and os.path.abspath(src) != os.path.abspath(dst)):
            shutil.copytree(src, dst + ".tmp", dirs_exist_ok=True)
            shutil.rmtree(dst, ignore_errors=True)
            os.replace(dst + ".tmp", dst)
            print(f"[tiny] model {n}: the committed pre-trained copy ({COMMITTED}/{n}, config {cfg.digest(n)})")
    todo = [n for n in models if retrain or not _is_done(os.path.join(run_dir, n), n, cfg)]
    if not todo:
        print(f"pre-trained models {', '.join(models)} in {run_dir} are cached")
        return
    train = load_jsonl(os.path.join(data_dir, "train.jsonl"))
    texts = [PROMPT_TEMPLATE.replace("{problem}", r["problem"]) + r["solution"] for r in train]
    for n in todo:
        build_tokenizer(MODELS[n].tokenizer, texts, cfg).save_pretrained(os.path.join(run_dir, f"tok_{n}"))
    cfg_path = os.path.join(run_dir, "tiny_config.json")
    with open(cfg_path, "w") as f:
        json.dump(dataclasses.asdict(cfg), f)
    t0 = time.time()
    # One process per model, one thread each: on a shared 2-core machine two single-threaded
    # processes beat one process with two threads.
    procs = [subprocess.Popen([sys.executable, "-m", "tools.tiny", "_pretrain_one", os.path.abspath(run_dir), n,
                               os.path.abspath(cfg_path)], cwd=HERE) for n in todo]
    codes = [p.wait() for p in procs]
    if any(codes):
        raise RuntimeError(f"pre-training failed (exit codes {codes}); see the output above")
    print(f"pre-training of {', '.join(todo)} took {time.time() - t0:.0f}s wall")



def max_response_tokens(tok, rows: list[dict]) -> int:
    """A response limit with headroom: 1.5x the longest reference solution (+EOS) in tokens."""
    return int(1.5 * max(len(tok.encode(r["solution"], add_special_tokens=False)) for r in rows)) + 2


# ------------------------------------------------------------------------------------------------
# The preset: GRPO for each model alone vs the GRAFT pair, from the same checkpoints, then a table
# ------------------------------------------------------------------------------------------------

# Each variant is a set of graft.py flags given to both sides of the pair (README: baselines). The grpo*
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
    """The RL half of the preset: the same budget for every method (a budget-equal comparison)."""

    out: str = "runs/tiny"
    """Run folder: data, pre-trained models, one sub-folder per seed and method, the tables."""
    seeds: int = 1
    """RL seeds (sampling and minibatch order); cells report mean and std over them."""
    steps: int = 100
    """RL steps per run (same for GRPO and GRAFT)."""
    prompts_per_step: int = 48
    """Prompts per step (both sides see the same batches)."""
    n: int = 8
    """Rollouts per prompt."""
    lr: float = 1e-4
    """AdamW learning rate for every run."""
    minibatches: int = 4
    """Optimizer steps per RL step."""
    variants: str = "graft"
    """Comma list of GRAFT variants to run next to GRPO (see VARIANT_FLAGS); 'all' runs every one."""
    compat_norm: str = "token"
    """--compat-norm for the 'graft' run: token (paper) or byte (departure 2)."""
    eval_samples: int = 8
    """k: samples per problem at temperature 1 in every evaluation. The beyond-sample subset is the
    problems a model fails on all k before RL while its peer solves at least one."""
    split: str = "test"
    """Evaluation split: 'test' (the held-out table) or 'val' (the validation split cut from train,
    on which the preset's settings were chosen)."""
    slots: int = 2
    """graft.py processes run at once (one torch thread each; a GRAFT pair takes two; the three-way run,
    wider than 2, runs alone)."""
    models: int = 2
    """Models in the preset: 2 (A and B: GRPO for each and the GRAFT pair) or 3 (also C: GRPO for each of
    the three, the three pairwise GRAFT runs and the three-way run, from the same checkpoints and batches)."""
    eval_every: int = 0
    """Evaluation every this many steps inside the runs (for --plot; 0 = final only)."""
    plot: bool = False
    """Write accuracy-vs-step PNGs (needs matplotlib and --eval-every)."""
    panel: bool = True
    """Run the mechanism panel first (in-sample: GRPO vs GRAFT on a fixed set of train problems that one
    model fails 0/n before RL while the other's group is mixed; see the module docstring)."""
    held_out: bool = True
    """Run the held-out table (GRPO vs GRAFT on the whole train split, evaluated on --split)."""
    panel_half: int = 24
    """Problems in each half of the panel's fixed set: A fails them 0/n while B solves --panel-peer of n, and
    the other way round. Every panel step trains on the whole set (2 x panel_half prompts)."""
    panel_peer: str = "2-6"
    """lo-hi: how many of its n samples the peer solves on a problem of the other's half (within 1..n-1, a
    mixed group as Eq. 4 asks; 2-6 keeps groups that give both correct and wrong responses weight)."""
    panel_pool: int = 3000
    """Most train problems the pick evaluates (n samples each, T=1, before RL), --panel-chunk at a time
    until both halves are full: the rarer kind (B fails, A solves 2-6) is about 1 in 75 train problems.
    Raised after a pick that ran short, the pick continues from the chunks it has."""
    panel_chunk: int = 500
    """Train problems per pick evaluation (both models in parallel); the pick stops after the chunk that
    fills both halves."""
    panel_steps: int = 30
    """RL steps of the panel's runs."""
    smoke: bool = False
    """CI smoke: 3 steps of 16 prompts and a 50-problem subset of the split, to check every phase runs; the
    panel with 4 problems per half, picked 300 at a time from up to 1200, for 3 steps."""
    eval_file: str = ""
    """The evaluated prompt file (set by run_preset from --split, or its subset with --smoke)."""


# The models before RL are evaluated once with 2k samples per problem: the first k pick the subsets,
# the other k measure every "before RL" accuracy. Measuring with the draws that picked the subset
# would report 0% on it by construction, and problems picked for failing k unlucky draws drift
# upwards on any re-draw (regression to the mean); the two halves are independent draws.
EVAL_SEED = 1


def _final_ckpt(out: str, steps: int) -> str:
    return os.path.join(out, "checkpoints", f"step_{steps:06d}")


def train_args(run_dir: str, pc: PresetConfig, seed: int, max_new: int) -> list[str]:
    """graft.py train flags shared by every run of one seed of the held-out table (the train split, --steps x
    --prompts-per-step)."""
    args = ["--prompts", os.path.join(run_dir, "data", "train.jsonl"), "--steps", str(pc.steps),
            "--prompts-per-step", str(pc.prompts_per_step), "--n", str(pc.n), "--minibatches", str(pc.minibatches),
            "--lr", str(pc.lr), "--max-response-tokens", str(max_new), "--prompt-template", PROMPT_TEMPLATE,
            "--threads", "1", "--seed", str(seed), "--data-seed", str(seed), "--save-every", str(max(1, pc.steps // 4)),
            "--micro-batch-size", "64", "--gen-batch-size", "1024", "--resume", "--exchange-timeout", "1800"]
    if pc.eval_every:
        args += ["--eval-every", str(pc.eval_every), "--benchmarks", pc.eval_file, "--eval-samples", "1",
                 "--eval-temperature", "1.0", "--eval-top-p", "1.0", "--eval-max-tokens", str(max_new)]
    return args


def eval_args(model: str, files: list[str], out: str, pc: PresetConfig, max_new: int, seed: int) -> list[str]:
    """graft.py eval flags: k samples per problem at T=1 on every file, per-problem results to ``out``.
    Evaluations sample thousands of rows through 1024 slots, where the static decode's per-slot cache beats
    the default path's growing, left-padded one on A's long character-level responses (1.62x the rows/s)
    and loses on B's short ones (0.81x; `python -m bench.sampler --only tiny-eval`). A's evaluations are the
    preset's longest: its evaluation jobs (the pick included) took 315 s with it against 394 s without, with
    identical tables (the two paths drew the same responses). The training runs (384 rows per step) keep the
    default path."""
    return ["eval", "--model", model, "--benchmarks", ",".join(files), "--samples", str(pc.eval_samples),
            "--temperature", "1.0", "--top-p", "1.0", "--eval-max-tokens", str(max_new), "--max-response-tokens",
            str(max_new), "--prompt-template", PROMPT_TEMPLATE, "--threads", "1", "--gen-batch-size", "1024",
            EVAL_FLAGS, "--seed", str(seed), "--eval-out", out]


EVAL_FLAGS = "--static-decode"
"""The evaluations' decode path (eval_args' docstring says why), the panel's pick included."""


# ------------------------------------------------------------------------------------------------
# Runs: which graft.py trainings the table needs, and what their exchange folders say
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Run:
    """One trained column of the table: a single-model method on every model, or an exchange method on
    a group of models that train together (a pair, or with --models 3 also the three-way run)."""

    label: str
    """Column and folder name: "grpo", "graft" (every model of the preset in one run), "graft_AB" (a pair
    inside a three-model preset)."""
    method: str
    """A key of VARIANT_FLAGS, or one of SINGLE."""
    group: tuple[str, ...]
    """The models: trained each alone (single) or together, exchanging groups."""

    @property
    def single(self) -> bool:
        return self.method in SINGLE


def preset_runs(methods: list[str], models: list[str]) -> list[Run]:
    """Every run of the preset, in priority order: each exchange method on every pair of ``models`` and,
    with three, on all three at once (that run is labelled by the method alone, as the pair is when
    there are two models); each single method once for all models."""
    import itertools
    groups = [tuple(g) for size in range(2, len(models) + 1) for g in itertools.combinations(models, size)]
    runs = []
    for method in methods:
        if method in SINGLE:
            runs.append(Run(method, method, tuple(models)))
        else:
            runs += [Run(method if len(g) == len(models) else f"{method}_{''.join(g)}", method, g) for g in groups]
    return runs


def exchange_view(exchange: str, sides: list[str], steps: int, *,
                  balance: bool = True) -> tuple[dict[str, dict[str, str]], list[str]]:
    """Recompute a finished exchange run's assignment from its rollout files, as the trainer computes it
    (graft.multi_peer_sources over the sides sorted by name; with two sides it is exactly the paper's
    balanced swap).

    Returns ({side: {prompt id: source side}} for the groups each side received, in order of first
    receipt, and the fingerprint of every step's assignment (graft.assignment_digest), which each
    process of the run logged as the metrics key "assignment". A received group may still have lost
    responses to the compatibility gate: the files do not say which, so this is the set of selected groups.
    """
    from core import assignment_digest

    sides = sorted(sides)
    received: dict[str, dict[str, str]] = {s: {} for s in sides}
    prints = []
    for prompt_ids, src, _ in step_sources(exchange, sides, steps, balance=balance):
        prints.append(assignment_digest(src, prompt_ids))
        for r, side in enumerate(sides):
            for g in torch.nonzero(src[r] >= 0).squeeze(1).tolist():
                received[side].setdefault(prompt_ids[g], sides[int(src[r, g])])
    return received, prints


def received_prompts(exchange: str, side: str, peer_names: list[str], steps: int, *, balance: bool = True) -> list[str]:
    """Ids of the prompts whose group ``side`` received from one of ``peer_names`` in a finished run, in order
    of first receipt (see exchange_view)."""
    return list(exchange_view(exchange, [side, *peer_names], steps, balance=balance)[0][side])


def record_exchange(run_dir: str, pc: PresetConfig, seed: int, run: Run) -> None:
    """After an exchange run: check that its processes agreed on every step's assignment, and write
    RUN/received/s<seed>_<label>_<model>.jsonl (the train rows each model received) and
    RUN/received/s<seed>_<label>.json (the check, and how many groups each model took from each peer)."""
    base = os.path.join(run_dir, f"seed{seed}", run.label)
    record = os.path.join(run_dir, "received", f"s{seed}_{run.label}.json")
    if os.path.exists(record):
        return
    sides = {m.lower(): m for m in run.group}
    received, prints = exchange_view(os.path.join(base, "exchange"), list(sides), pc.steps,
                                     balance="--no-balance" not in VARIANT_FLAGS[run.method])
    checked = check_assignments(os.path.join(base, "exchange"),
                                {s: os.path.join(base, m, "metrics.jsonl") for s, m in sides.items()}, pc.steps, prints)
    by_id = {r["id"]: r for r in load_jsonl(os.path.join(run_dir, "data", "train.jsonl"))}
    os.makedirs(os.path.dirname(record), exist_ok=True)
    if run.method in TRAIN_SIDE:
        for side, model in sides.items():
            # An empty file would be rejected by graft.py eval; a run that received nothing is
            # represented by one row (the first train prompt) and flagged in the report.
            rows = [by_id[i] for i in received[side]] or [dict(next(iter(by_id.values())), id="none")]
            tiny_tasks.write_jsonl(_received_file(run_dir, seed, run.label, model), rows)
    sources = {sides[s]: {sides[p]: sum(v == p for v in got.values()) for p in sides if p != s}
               for s, got in received.items()}
    tmp = f"{record}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:  # written last, atomically: its presence marks the run recorded
        json.dump({"steps": pc.steps, "agreed_steps": checked, "received_from": sources}, f)
    os.replace(tmp, record)


def _received_file(run_dir: str, seed: int, label: str, model: str) -> str:
    return os.path.join(run_dir, "received", f"s{seed}_{label}_{model}.jsonl")


# Variants whose selection is the trainer's balanced swap (or its unbalanced ablation), so that the
# received prompts can be recomputed from the rollout files.
TRAIN_SIDE = ("graft", "byte", "no_weight", "no_floor", "no_balance", "seq_ratio", "random_accept",
              "peer_first", "uniform", "pooled_adv", "success_only", "luffy")


def drop_stale_eval(out: str, files: list[str]) -> None:
    """Delete the evaluation ``out`` if it lacks one of ``files`` (by file stem): a finished evaluation is
    cached by its output's existence, and a rerun with more seeds or variants adds received-prompt files
    to an evaluation that was already done without them."""
    try:
        with open(out) as f:
            have = set(json.load(f)["problems"])
    except (OSError, ValueError, KeyError):
        return
    if not {os.path.splitext(os.path.basename(p))[0] for p in files} <= have:
        print(f"[tiny] {out}: evaluated without some of {len(files)} files; evaluating again", flush=True)
        os.remove(out)


HELD_OUT_JOBS = "held-out"
"""Prefix of the held-out table's job names (the panel's are ``panel/...``): both lists name runs ``s0/grpo/A``."""


def build_jobs(run_dir: str, pc: PresetConfig, runs: list[Run], max_new: int) -> list[Job]:
    """Every graft.py process of the preset as jobs in priority order, seed by seed: the exchange runs
    (two or three processes each), the single-model runs, then that seed's evaluations, which fill the
    slot that the shorter single run leaves idle; the evaluations of the models before RL come after
    seed 0."""
    views = [r for r in runs if not r.single and r.method in TRAIN_SIDE]
    models = sorted({m for r in runs for m in r.group})
    jobs = []
    for seed in range(pc.seeds):
        common = train_args(run_dir, pc, seed, max_new)
        train, singles, evals = [], [], []
        for run in runs:
            base = os.path.join(run_dir, f"seed{seed}", run.label)
            procs, done = {}, {}
            for model in run.group:
                args = ["train", "--model", os.path.join(run_dir, model), "--name", model.lower(),
                        "--out", os.path.join(base, model)]
                if run.single:
                    args += common + VARIANT_FLAGS.get(run.method, [])
                else:
                    peer_names = ",".join(m.lower() for m in run.group if m != model)
                    args += ["--peer-name", peer_names, "--peer-exchange", os.path.join(base, "exchange")] + common
                    args += VARIANT_FLAGS[run.method]
                    args += ["--compat-norm", pc.compat_norm] if run.method == "graft" else []
                procs[model] = (args, os.path.join(base, f"{model}.log"))
                done[model] = os.path.join(_final_ckpt(os.path.join(base, model), pc.steps), "model.safetensors")
            if run.single:  # each model alone: independent one-slot jobs (A, the slowest, first)
                singles += [Job(f"s{seed}/{run.label}/{m}", [procs[m]], [done[m]]) for m in run.group]
            else:
                record = os.path.join(run_dir, "received", f"s{seed}_{run.label}.json")
                train.append(Job(f"s{seed}/{run.label}", list(procs.values()), list(done.values()) + [record],
                                 after=lambda s=seed, r=run: record_exchange(run_dir, pc, s, r)))
            for model in run.group:
                out = os.path.join(base, model, "eval.json")
                mine = [v for v in views if model in v.group]
                recv = [_received_file(run_dir, seed, v.label, model) for v in mine]
                train_job = f"s{seed}/{run.label}" + (f"/{model}" if run.single else "")
                drop_stale_eval(out, [pc.eval_file] + recv)
                evals.append(Job(f"eval s{seed}/{run.label}/{model}",
                                 [(eval_args(_final_ckpt(os.path.join(base, model), pc.steps), [pc.eval_file] + recv,
                                             out, pc, max_new, EVAL_SEED), out + ".log")],
                                 [out], deps=(train_job,) + tuple(f"s{seed}/{v.label}" for v in mine)))
        jobs += train + singles + evals
    for model in models:
        before = os.path.join(run_dir, "eval", f"before_{model}.json")
        mine = [v for v in views if model in v.group]
        recv = [_received_file(run_dir, s, v.label, model) for s in range(pc.seeds) for v in mine]
        drop_stale_eval(before, [pc.eval_file] + recv)
        args = eval_args(os.path.join(run_dir, model), [pc.eval_file] + recv, before, pc, max_new, EVAL_SEED)
        args[args.index("--samples") + 1] = str(2 * pc.eval_samples)  # k to pick the subsets, k to measure
        # after seed 0's jobs: it waits for every seed's received prompts, so it cannot start earlier
        jobs.insert(len(jobs) // pc.seeds, Job(f"eval before/{model}", [(args, before + ".log")], [before],
                                               deps=tuple(f"s{s}/{v.label}" for s in range(pc.seeds) for v in mine)))
    return with_prefix(HELD_OUT_JOBS, jobs)  # the panel's jobs, queued with these, reuse the run names


# ------------------------------------------------------------------------------------------------
# The tables: beyond-sample subset, complementarity, train-side view, diagnostics, profile
# ------------------------------------------------------------------------------------------------


def beyond_sample(k_self: dict[str, list[float]], k_peer: dict[str, list[float]]) -> tuple[list[str], list[str]]:
    """(all-fail, beyond-sample): the problems a model fails on every sample, and those of them its peer
    solves on at least one (the paper's Eq. 4 candidate rule applied to an evaluation)."""
    fail = [q for q, c in k_self.items() if max(c) == 0]
    return fail, [q for q in fail if max(k_peer[q]) > 0]


def accuracy(correct: dict[str, list[float]], ids) -> float:
    """Mean correctness over the problems ``ids`` and their samples (avg@k); NaN for no problems."""
    ids = list(ids)
    return sum(sum(correct[q]) / len(correct[q]) for q in ids) / len(ids) if ids else float("nan")


def pass_at_k(correct: dict[str, list[float]], ids) -> float:
    """Share of the problems ``ids`` solved by at least one sample; NaN for no problems."""
    ids = list(ids)
    return sum(max(correct[q]) > 0 for q in ids) / len(ids) if ids else float("nan")


def run_metrics(run_dir: str, seeds: int, method: str, model: str) -> list[dict]:
    rows = []
    for seed in range(seeds):
        path = os.path.join(run_dir, f"seed{seed}", method, model, "metrics.jsonl")
        if os.path.exists(path):
            rows += read_metrics(path)
    return rows


def report(run_dir: str, pc: PresetConfig, runs: list[Run], timing: dict) -> tuple[str, list[str]]:
    """The held-out tables, print-ready, and their CSV rows (one per seed, method, model, subset: its size
    and accuracy), from the run's evaluations, metrics and records. A method's column is its run label
    (``graft``, ``graft_AB``, ...)."""
    split = os.path.splitext(os.path.basename(pc.eval_file))[0]
    rows = load_jsonl(pc.eval_file)
    family = {r["id"]: r["family"] for r in rows}
    ev = os.path.join(run_dir, "eval")
    k = pc.eval_samples
    models = sorted({m for r in runs for m in r.group})
    both = {m: load_eval(os.path.join(ev, f"before_{m}.json")) for m in models}  # 2k samples per problem
    pick = {m: {q: c[:k] for q, c in both[m][split].items()} for m in models}
    before = {m: {stem: {q: c[k:] for q, c in res.items()} for stem, res in both[m].items()} for m in models}
    after = {(s, r.label, m): load_eval(os.path.join(run_dir, f"seed{s}", r.label, m, "eval.json"))
             for s in range(pc.seeds) for r in runs for m in r.group}
    exch = [r for r in runs if not r.single]
    views = [r for r in exch if r.method in TRAIN_SIDE]
    records = {(s, r.label): json.load(open(os.path.join(run_dir, "received", f"s{s}_{r.label}.json")))
               for s in range(pc.seeds) for r in exch}
    csv = ["seed,method,model,subset,problems,accuracy"]
    out = [f"{split} split: {len(rows)} problems x {k} samples at T=1; {pc.seeds} seed(s); {pc.steps} steps x "
           f"{pc.prompts_per_step} prompts x n={pc.n}, lr {pc.lr}; models {', '.join(models)}; accuracy = mean "
           "over samples (%), mean+-std over seeds"]

    def any_of(peer_names: list[str], res: dict) -> dict[str, list[float]]:
        """Per problem, [1] if any of ``peer_names`` solved it at least once in ``res[peer]``, else [0]."""
        return {q: [float(any(max(res[p][q]) > 0 for p in peer_names))] for q in res[peer_names[0]]}

    # -- complementarity (the paper: SmolLM3 solves 47.9% of the prompts on which Qwen3 fails all 8)
    out.append(f"\ncomplementarity: share of a model's all-fail problems (0/{k}) that another model solves at "
               "least once (paper, Pair 1: 47.9% and 18.7%)")
    for m in models:
        others = [p for p in models if p != m]
        for peer_names in [[p] for p in others] + ([others] if len(others) > 1 else []):
            fail, bey = beyond_sample(pick[m], any_of(peer_names, pick))
            ends = []
            for s in range(pc.seeds):
                grpo = {p: after[(s, "grpo", p)][split] for p in models}
                f2, b2 = beyond_sample(grpo[m], any_of(peer_names, grpo))
                ends.append(len(b2) / max(1, len(f2)))
            who = " or ".join(peer_names)
            out.append(f"  {who} solves {100 * len(bey) / max(1, len(fail)):5.1f}% of {m}'s {len(fail)} all-fail "
                       f"problems before RL; after GRPO (every model) {cell(ends)}%")

    # -- beyond-sample subset and the rest, per model: its own columns (the runs it took part in)
    out.append(f"\nbeyond-sample subset: {split} problems a model fails on all {k} samples before RL while another "
               f"model solves >= 1 (picked by {k} samples, measured by {k} other samples); beyond_X: X solves >= 1")
    fams = list(tiny_tasks.FAMILIES)
    for m in models:
        others = [p for p in models if p != m]
        cols = [r for r in runs if m in r.group]
        mine = [r for r in cols if not r.single]
        out.append(f"{'model':<6}{'subset':<10}{'problems':>9}{'before':>9}" + "".join(f"{r.label:>13}" for r in cols)
                   + "".join(f"{r.label + '-grpo':>16}" for r in mine))
        bey = beyond_sample(pick[m], any_of(others, pick))[1]
        subsets = {"beyond": bey}
        if len(others) > 1:
            subsets |= {f"beyond_{p}": beyond_sample(pick[m], pick[p])[1] for p in others}
        subsets |= {"rest": [q for q in pick[m] if q not in set(bey)], "overall": list(pick[m])}
        subsets |= {f: [q for q in pick[m] if family[q] == f] for f in fams}
        for name, ids in subsets.items():
            b = accuracy(before[m][split], ids)
            csv.append(f"-1,before,{m},{name},{len(ids)},{b:.4f}")
            cells, per = [], {}
            for r in cols:
                per[r.label] = [accuracy(after[(s, r.label, m)][split], ids) for s in range(pc.seeds)]
                csv += [f"{s},{r.label},{m},{name},{len(ids)},{a:.4f}" for s, a in enumerate(per[r.label])]
                cells.append(f"{cell(per[r.label]):>13}")
            diffs = [f"{cell([x - y for x, y in zip(per[r.label], per['grpo'])], signed=True):>16}" for r in mine]
            out.append(f"{m:<6}{name:<10}{len(ids):>9}{100 * b:>9.1f}" + "".join(cells) + "".join(diffs))
    out.append("  (X-grpo: mean+-std over seeds of the paired difference)")

    # -- the train-side view
    if views:
        out.append(f"\ntrain-side view: train prompts a model received from its peers in an exchange run (selected "
                   f"groups), share solved at the end (pass@{k})")
        for r in views:
            for m in r.group:
                sizes, b_, g_, x_ = [], [], [], []
                for s in range(pc.seeds):
                    stem = f"s{s}_{r.label}_{m}"
                    ids = [q for q in after[(s, r.label, m)][stem] if q != "none"]
                    sizes.append(len(ids))
                    b_.append(pass_at_k(before[m][stem], ids))
                    g_.append(pass_at_k(after[(s, "grpo", m)][stem], ids))
                    x_.append(pass_at_k(after[(s, r.label, m)][stem], ids))
                    csv += [f"{s},before,{m},received_{r.label},{len(ids)},{b_[-1]:.4f}",
                            f"{s},grpo,{m},received_{r.label},{len(ids)},{g_[-1]:.4f}",
                            f"{s},{r.label},{m},received_{r.label},{len(ids)},{x_[-1]:.4f}"]
                src = ""
                if len(r.group) > 2:  # which peer the groups came from (first receipt), mean over seeds
                    src = " (" + ", ".join(
                        f"{sum(records[(s, r.label)]['received_from'][m][p] for s in range(pc.seeds)) / pc.seeds:.0f}"
                        f" from {p}" for p in r.group if p != m) + ")"
                out.append(f"  {r.label} -> {m}: {sum(sizes) / len(sizes):.0f} prompts{src}; before RL {cell(b_)}, "
                           f"after GRPO {cell(g_)}, after {r.label} {cell(x_)}")

    # -- diagnostics of every exchange run
    out.append("\nexchange diagnostics (per step, mean over steps and seeds); gate = share of the selected peer "
               "responses accepted, in the first and the last quarter of the steps")
    quarter = max(1, pc.steps // 4)
    for r in exch:
        for m in r.group:
            rm = run_metrics(run_dir, pc.seeds, r.label, m)
            g = lambda key: mean_key(rm, key)  # noqa: E731
            gate = []
            for part in ([x for x in rm if x["step"] < quarter], [x for x in rm if x["step"] >= pc.steps - quarter]):
                acc, rej = sum(x.get("accepted", 0) for x in part), sum(x.get("rejected", 0) for x in part)
                gate.append(f"{100 * acc / (acc + rej):.0f}%" if acc + rej else "-")
            per_peer = ""
            if len(r.group) > 2:
                per_peer = " (" + ", ".join(f"{g('selected/' + p.lower()):.1f} from {p}"
                                            for p in r.group if p != m) + ")"
            out.append(f"  {r.label} -> {m}: {g('candidates_in'):.1f} candidates, {g('selected'):.1f} selected"
                       f"{per_peer}, {g('accepted'):.1f} accepted, {g('rejected'):.1f} rejected, "
                       f"{g('dropped_length'):.1f} too long; gate {gate[0]} -> {gate[1]}; mean s {g('mean_s'):.2f}, "
                       f"mean w {g('mean_w'):.2f}; clip fraction peer tokens {g('pg/clipfrac_peer'):.4f}, own "
                       f"{g('pg/clipfrac_own'):.4f}")
    out.append("\nassignment agreement: steps on which every process of a run logged the assignment fingerprint "
               "recomputed from the rollout files (a disagreement stops the preset)")
    for r in exch:
        agreed = [records[(s, r.label)]["agreed_steps"] for s in range(pc.seeds)]
        out.append(f"  {r.label} ({', '.join(r.group)}): {sum(agreed)}/{pc.steps * pc.seeds} steps"
                   + ("" if sum(agreed) else " (this variant logs no fingerprint)"))
    out.append(f"\ntrain reward (mean over the prompts of a step) in the first and the last {quarter} steps")
    for r in runs:
        cells = []
        for m in r.group:
            rm = run_metrics(run_dir, pc.seeds, r.label, m)
            first = mean_key([x for x in rm if x["step"] < quarter], "reward")
            last = mean_key([x for x in rm if x["step"] >= pc.steps - quarter], "reward")
            cells.append(f"{m} {100 * first:.1f} -> {100 * last:.1f}")
        out.append(f"  {r.label:<11}" + ", ".join(cells))

    # -- where the time goes
    out.append("\nprofile: seconds per step by phase (mean over steps and seeds), and wall seconds per job")
    phases = ("sample", "verify", "logprob", "wait", "exchange", "update", "step")
    for r in runs:
        for m in r.group:
            rm = run_metrics(run_dir, pc.seeds, r.label, m)
            out.append(f"  {r.label:<9}{m}: " + "  ".join(f"{p} {mean_key(rm, 'time/' + p):.2f}" for p in phases))
    if timing:
        out.append("  " + ", ".join(f"{j} {t:.0f}" for j, t in timing.items()))
    if len(models) > 2:  # the three-way run's wall time against the pair A-B (the two-model preset)
        for r in [r for r in exch if len(r.group) == len(models)]:
            pair = f"{r.method}_{''.join(models[:2])}"
            for s in range(pc.seeds):
                t3, t2 = (timing.get(f"{HELD_OUT_JOBS}/s{s}/{label}") for label in (r.label, pair))
                if t3 and t2:
                    out.append(f"  seed {s}: {r.label} ({len(models)} processes) {t3:.0f} s vs {pair} {t2:.0f} s: "
                               f"{t3 / t2:.2f}x")
    return "\n".join(out), csv


# ------------------------------------------------------------------------------------------------
# The mechanism panel: panel.py on the tiny pair (the same code as `graft.py panel` on any pair)
# ------------------------------------------------------------------------------------------------

PANEL_SEED = 2
"""Seed of the panel's pool (a shuffle of the train split) and of the pick evaluation's samples: the fixed set
is the same for every RL seed and every run of the preset."""


def panel_config(run_dir: str, pc: PresetConfig) -> panel.PanelConfig:
    """The tiny preset's panel as panel.py runs it: A and B on the train split, in RUN_DIR/panel, no held-out
    set there (the preset's held-out table is that measurement)."""
    return panel.PanelConfig(model_a=os.path.join(run_dir, "A"), model_b=os.path.join(run_dir, "B"),
                             prompts=os.path.join(run_dir, "data", "train.jsonl"), out=os.path.join(run_dir, "panel"),
                             half=pc.panel_half, peer=pc.panel_peer, pool=pc.panel_pool, chunk=pc.panel_chunk,
                             pick_seed=PANEL_SEED, steps=pc.panel_steps, seeds=pc.seeds, slots=pc.slots,
                             eval_samples=pc.eval_samples, eval_flags=EVAL_FLAGS)


def panel_training(pc: PresetConfig, max_new: int) -> dict:
    """The panel runs' training flags (the preset's; panel.py adds the set, the steps and the seeds) as
    panel.training_settings reads them."""
    flags = ["--n", str(pc.n), "--minibatches", str(pc.minibatches), "--lr", str(pc.lr), "--max-response-tokens",
             str(max_new), "--prompt-template", PROMPT_TEMPLATE, "--threads", "1", "--save-every",
             str(max(1, pc.panel_steps // 4)), "--micro-batch-size", "64", "--gen-batch-size", "1024",
             "--exchange-timeout", "1800", "--compat-norm", pc.compat_norm]
    return panel.training_settings(flags)


def panel_curves(run_dir: str, pc: PresetConfig) -> dict[str, dict[str, list[list[float]]]]:
    """The panel's "own" rows step by step (panel.own_half_curves): {model: {"GRPO" | "GRAFT": per seed, per step,
    the train reward (%) on the model's own all-fail half}}, from the rollout files."""
    return panel.own_half_curves(panel_config(run_dir, pc))


def figure(run_dir: str, out: str) -> str:
    """README's figure from a finished run's files: per model, the reward on its own all-fail half by step under
    GRPO and GRAFT (the mechanism panel's curves; mean and +- std band over seeds). Returns the PNG's path."""
    from tools import plot
    info, pc = saved_preset(run_dir, "figure")
    if not pc.panel:
        raise SystemExit(f"tiny.py figure: {run_dir} ran without the mechanism panel (--no-panel)")
    curves = panel_curves(run_dir, pc)
    panels = {f"model {m}: the {pc.panel_half} problems it fails 0/{pc.n} before RL": c for m, c in curves.items()}
    path = plot.draw_curves(panels, out, xlabel="RL step", ylabel="train reward on them (%)", command="tiny.py figure",
                            title=f"tiny preset, mechanism panel: each model's own all-fail half, GRPO vs GRAFT "
                                  f"({2 * pc.panel_half} prompts x n={pc.n} per step)")
    print(f"[tiny] figure -> {path} (from {run_dir}, {pc.seeds} seed(s))")
    return str(path)


def plot(run_dir: str, pc: PresetConfig, runs: list[Run]) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("[tiny] --plot: matplotlib is not installed; skipping the PNG")
        return
    models = sorted({m for r in runs for m in r.group})
    fig, axes = plt.subplots(1, len(models), figsize=(5 * len(models), 4), sharey=True)
    for ax, model in zip(axes, models):
        for i, r in enumerate(runs):
            if model not in r.group:
                continue
            for seed in range(pc.seeds):
                path = os.path.join(run_dir, f"seed{seed}", r.label, model, "metrics.jsonl")
                pts = [(m["step"] + 1, m["eval/mean"]) for m in read_metrics(path) if "eval/mean" in m] \
                    if os.path.exists(path) else []
                if pts:
                    ax.plot(*zip(*pts), label=f"{r.label} s{seed}", color=f"C{i}", alpha=0.8)
        ax.set_title(f"model {model}")
        ax.set_xlabel("RL step")
        ax.legend(fontsize=7)
    axes[0].set_ylabel("accuracy (T=1, 1 sample)")
    fig.tight_layout()
    fig.savefig(os.path.join(run_dir, "accuracy.png"), dpi=120)
    print(f"[tiny] plot -> {os.path.join(run_dir, 'accuracy.png')}")


def preset_tables(run_dir: str, pc: PresetConfig, runs: list[Run],
                  timing: dict) -> list[tuple[str, str, str, list[str]]]:
    """The preset's printed tables as (title, text, CSV file name, CSV rows): the panel, then the held-out
    tables (whichever ran), recomputed from the run's files. Both a finished run and `tiny.py report` print
    them from here."""
    out = []
    if pc.panel:
        from transformers import AutoTokenizer
        max_new = max_response_tokens(AutoTokenizer.from_pretrained(os.path.join(run_dir, "A")),
                                      load_jsonl(pc.eval_file))
        text, csv = panel.panel_report(panel_config(run_dir, pc), panel_training(pc, max_new))
        out.append(("Mechanism panel (in-sample)", text, "panel.csv", csv))
    if pc.held_out:
        split = os.path.splitext(os.path.basename(pc.eval_file))[0]
        text, csv = report(run_dir, pc, runs, timing)
        out.append((f"Held-out table ({split} split)", text, "results.csv", csv))
    return out


def run_preset(pc: PresetConfig, tc: TinyConfig, *, retrain: bool = False, command: str = "") -> str:
    """Prepare, then run every job (the panel's runs, the GRPO and GRAFT runs, evaluations before and after RL),
    print the tables; write results.txt (what is printed), results.csv (held-out), panel.csv and run.json
    (the command, the preset's settings, the machine, its load and the wall time: `tiny.py report` reads it)."""
    t0, load_start = time.time(), os.getloadavg()
    run_dir = pc.out
    if pc.split not in ("test", "val"):
        raise SystemExit(f"tiny.py --split: {pc.split!r} is neither 'test' nor 'val'")
    if pc.smoke:  # CI: every phase, a few steps, a 50-problem subset; the panel on 2 x 4 problems
        pc.steps, pc.prompts_per_step, pc.seeds = min(pc.steps, 3), 16, 1
        pc.panel_steps, pc.panel_half, pc.panel_pool, pc.panel_chunk = min(pc.panel_steps, 3), 4, 1200, 300
    if pc.models not in (2, 3):
        raise SystemExit(f"tiny.py --models: {pc.models} models is not offered; 2 (A, B) or 3 (A, B, C)")
    if not (pc.panel or pc.held_out):
        raise SystemExit("tiny.py: --no-panel and --no-held-out leave nothing to run")
    models = list(MODELS)[:pc.models]
    prepare(run_dir, tc, models=tuple(models), retrain=retrain)
    path = os.path.join(run_dir, "data", f"{pc.split}.jsonl")
    if pc.smoke:
        rows = load_jsonl(path)[::20]
        path = os.path.join(run_dir, "data", f"{pc.split}_smoke.jsonl")
        tiny_tasks.write_jsonl(path, rows)
    pc.eval_file = path
    from transformers import AutoTokenizer
    tok_a = AutoTokenizer.from_pretrained(os.path.join(run_dir, "A"))
    max_new = max_response_tokens(tok_a, load_jsonl(path))  # the character model needs the most tokens
    variants = list(VARIANT_FLAGS) if pc.variants == "all" else [v.strip() for v in pc.variants.split(",") if v.strip()]
    unknown = [v for v in variants if v not in VARIANT_FLAGS]
    if unknown:
        raise SystemExit(f"tiny.py --variants: unknown {unknown}; known: {', '.join(VARIANT_FLAGS)}")
    runs = preset_runs(["grpo"] + [v for v in variants if v != "grpo"], models)
    timing_file = os.path.join(run_dir, "timing.json")  # wall seconds per job, kept across resumed invocations
    timing: dict[str, float] = json.load(open(timing_file)) if os.path.exists(timing_file) else {}
    jobs = panel.prepare(panel_config(run_dir, pc), panel_training(pc, max_new), timing, timing_file, tag="tiny") \
        if pc.panel else []  # the panel's pick runs here; its runs come first in the queue
    jobs += build_jobs(run_dir, pc, runs, max_new) if pc.held_out else []
    cached = run_jobs(jobs, pc.slots, timing, timing_file, tag="tiny")
    tables = preset_tables(run_dir, pc, runs, timing)
    for _, _, name, csv in tables:
        write_lines(os.path.join(run_dir, name), csv)
    text = "\n\n".join(t for _, t, _, _ in tables)
    write_lines(os.path.join(run_dir, "results.txt"), [text])
    wall = time.time() - t0
    info = {"command": command or f"python -m tools.tiny --out {run_dir}", "preset": dataclasses.asdict(pc),
            "wall_s": wall, "cached_jobs": len(cached), "jobs": len(jobs), "cpus": os.cpu_count(),
            "load_start": list(load_start), "load_end": list(os.getloadavg()), "torch": torch.__version__,
            "finished": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    write_lines(os.path.join(run_dir, "run.json"), [json.dumps(info, indent=1)])
    if pc.plot:
        plot(run_dir, pc, runs)
    print(text)
    print(f"[tiny] total {wall:.0f}s; tables -> {run_dir}/results.txt, {run_dir}/results.csv; "
          f"Markdown for RESULTS.md: python -m tools.tiny report {run_dir}")
    return text


def saved_preset(run_dir: str, command: str) -> tuple[dict, PresetConfig]:
    """A finished run's run.json and its settings, with the paths pointed at ``run_dir`` (it may have moved)."""
    path = os.path.join(run_dir, "run.json")
    if not os.path.exists(path):
        raise SystemExit(f"tiny.py {command}: {path} not found; is {run_dir} the --out folder of a finished run?")
    with open(path) as f:
        info = json.load(f)
    preset = info["preset"]
    if "peers" in preset:  # the model count under its other key
        preset = {k: v for k, v in preset.items() if k != "peers"} | {"models": preset["peers"]}
    pc = PresetConfig(**preset)
    pc.out, pc.eval_file = run_dir, os.path.join(run_dir, "data", os.path.basename(pc.eval_file))
    return info, pc


def markdown_report(run_dir: str) -> str:
    """The Markdown block for RESULTS.md of a finished run: its command, machine, load and wall time, then
    each table as the run printed it, recomputed from the run's files (run.json, the evaluations, metrics
    and rollout files), so that the document's figures and the run's printout are the same figures."""
    info, pc = saved_preset(run_dir, "report")
    variants = list(VARIANT_FLAGS) if pc.variants == "all" else [v.strip() for v in pc.variants.split(",") if v.strip()]
    runs = preset_runs(["grpo"] + [v for v in variants if v != "grpo"], list(MODELS)[:pc.models])
    timing_file = os.path.join(run_dir, "timing.json")
    timing = json.load(open(timing_file)) if os.path.exists(timing_file) else {}
    load = lambda xs: " / ".join(f"{x:.1f}" for x in xs)  # noqa: E731
    cached = f" ({info['cached_jobs']} of {info['jobs']} jobs cached from an earlier invocation)" \
        if info["cached_jobs"] else ""
    out = [f"<!-- generated by `python -m tools.tiny report {run_dir}` from the run's files; regenerate, not edit -->",
           "", f"Command: `{info['command']}`; {info['cpus']} CPU cores, load average (1 / 5 / 15 min) "
           f"{load(info['load_start'])} at the start and {load(info['load_end'])} at the end; wall time "
           f"{info['wall_s']:.0f} s{cached}; torch {info['torch']}; finished {info['finished']}."]
    for title, text, _, _ in preset_tables(run_dir, pc, runs, timing):
        out += ["", f"#### {title}", "", "```text", text, "```"]
    return "\n".join(out)


# ------------------------------------------------------------------------------------------------
# CLI
# ------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = "python -m tools.tiny " + shlex.join(argv)
    if not argv or argv[0].startswith("-"):
        argv = ["run"] + argv  # `python -m tools.tiny [flags]` runs the preset
    p = argparse.ArgumentParser(prog="python -m tools.tiny", description="GRAFT tiny CPU preset")
    sub = p.add_subparsers(dest="cmd", required=True)
    sp = sub.add_parser("run", help="the preset: GRPO vs GRAFT (and variants) from the same checkpoints, a table",
                        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    from config import field_docs
    docs = field_docs(PresetConfig)
    for f in dataclasses.fields(PresetConfig):
        if f.name == "eval_file":
            continue
        flag = f"--{f.name.replace('_', '-')}"
        if isinstance(f.default, bool):
            sp.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, help=docs.get(f.name))
        else:
            sp.add_argument(flag, type=type(f.default), default=f.default, help=docs.get(f.name))
    sp.add_argument("--variant", dest="variant_one", default=None, help="one variant (same as --variants NAME)")
    sp.add_argument("--retrain", action="store_true",
                    help="pre-train the models here instead of using the committed copies")
    sp = sub.add_parser("prepare", help="data, tokenizers and pre-trained models (cached)")
    sp.add_argument("run_dir")
    sp.add_argument("--models", type=int, default=2, choices=(2, 3), help="2: models A and B; 3: also C")
    sp.add_argument("--retrain", action="store_true", help="pre-train even if a committed copy matches")
    sp = sub.add_parser("report", help="the Markdown block for RESULTS.md of a finished run, from its files")
    sp.add_argument("run_dir")
    sp = sub.add_parser("figure", help="README's figure (the mechanism panel's curves) from a finished run's files")
    sp.add_argument("run_dir")
    sp.add_argument("--out", default="", help="the PNG (default: RUN_DIR/mechanism_panel.png)")
    sp = sub.add_parser("_pretrain_one")
    sp.add_argument("run_dir")
    sp.add_argument("name")
    sp.add_argument("cfg_path")
    args = p.parse_args(argv)
    torch.set_num_threads(1)

    if args.cmd == "_pretrain_one":
        with open(args.cfg_path) as f:
            _pretrain_one(args.run_dir, args.name, TinyConfig(**json.load(f)))
    elif args.cmd == "report":
        print(markdown_report(args.run_dir))
    elif args.cmd == "figure":
        figure(args.run_dir, args.out or os.path.join(args.run_dir, "mechanism_panel.png"))
    elif args.cmd == "prepare":
        prepare(args.run_dir, TinyConfig(), models=tuple(MODELS)[:args.models], retrain=args.retrain)
    else:
        pc = PresetConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(PresetConfig)
                             if hasattr(args, f.name)})
        if args.variant_one:
            pc.variants = args.variant_one
        run_preset(pc, TinyConfig(), retrain=args.retrain, command=command)
    return 0


if __name__ == "__main__":
    sys.exit(main())
