"""GRAFT's configuration: one dataclass whose defaults are the paper's (arXiv 2609.37868), and everything
that reads it as a whole.

Sections: 1. Config, the fields (a field with a fixed set of values is a Literal; CHOICES lists them);
2. validate_config, the checks that need more than one field or the file system, each raising
ValueError that names the flag; 3. the CLI built from the fields (build_parser for graft.py, add_config_flags
for preflight.py: flags = field names with dashes, help = the string under each field) and FLAGS.md
(flags_document). It imports only the standard library, so it copies alone (test_docs.py checks).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib.util
import inspect
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

# ------------------------------------------------------------------------------------------------
# 1. Config: every field's docstring is its --help line and its FLAGS.md row
# ------------------------------------------------------------------------------------------------


@dataclass
class Config:
    # --- model and data
    model: str = ""
    """Hub id or local folder of the transformers causal LM that this process trains (required)."""
    name: str = "a"
    """This side's name: its rollout files go to <exchange>/<name>/. Use 'a'/'b' or the model name."""
    prompts: str = "data/math_train.jsonl"
    """Training prompt JSONL: one {"id", "problem", "answer"} object per line (data/prepare.py writes it)."""
    strict: bool = False
    """Stop at start when a gold answer of --prompts cannot be read by verify.py (default: a warning listing them)."""
    reward: str = "verify:verify_batch"
    """The reward function, module:function or path/to/file.py:function (README "The reward"); default verify.py's."""
    out: str = "runs/default"
    """Run directory: metrics.jsonl, checkpoints/, and the exchange dir unless --peer-exchange is set."""
    prompt_template: str = "{problem} Let's think step by step and output the final answer within \\boxed{}."
    """Prompt text; '{problem}' is replaced by the problem (paper's instruction by default; tiny: a short one)."""
    chat_template: bool = False
    """Wrap the prompt text as one user message with the tokenizer's chat template (False = raw text)."""
    trust_remote_code: bool = False
    """Pass trust_remote_code to transformers (off: model repos are untrusted code)."""

    # --- peer (GRAFT); with neither flag this is single-model GRPO ("--peer none")
    peer_exchange: str = ""
    """Online pair: shared exchange dir; this process is side --name, the peer is --peer-name."""
    peer_name: str = "b"
    """The online peer's side name (files <peer-exchange>/<peer-name>/step_*), or several: b,c (our extension)."""
    peer_log: str = ""
    """Stored-trajectory variant: a finished run's rollout-file folder, or a JSONL of foreign trajectories."""
    peer_model: str = ""
    """A JSONL --peer-log without the source's lbar: the model that scores it once (cached beside the file)."""
    exchange_timeout: float = 3600.0
    """Seconds to wait for the peer's rollout file of a step before failing (typ. 600-7200)."""
    peer_dead_after: float = 60.0
    """A waiting side stops when the peer's heartbeat is this many seconds old (killed peer; typ. 60-300)."""
    heartbeat_interval: float = 10.0
    """Seconds between this side's heartbeats in the exchange dir (well under --peer-dead-after)."""
    join_timeout: float = 300.0
    """Seconds a side waits, once its own model is loaded, for each peer to join the run (or a resumed attempt)."""
    run_id: str = ""
    """The pair's run identity ('' = the first side draws one and the second adopts it)."""

    # --- GRPO / GRAFT hyperparameters (paper Table 3)
    steps: int = 174
    """Number of RL steps (paper: 3 epochs of MATH train at 128 prompts = 174)."""
    prompts_per_step: int = 128
    """Prompts (groups) per step, across all ranks (paper 128; tiny 16-64)."""
    n: int = 8
    """Rollouts per prompt (paper 8; baselines 16, 32). Also --rollouts (use that under torchrun)."""
    minibatches: int = 4
    """Optimizer steps per RL step (128 prompts / 32 per minibatch = 4), one epoch over the batch."""
    temperature: float = 1.0
    """Sampling temperature; every log-probability uses the same temperature-scaled logits (Eq. 6)."""
    top_p: float = 1.0
    """Nucleus sampling threshold for rollouts (paper 1.0)."""
    max_prompt_tokens: int = 2048
    """Longest prompt in tokens; a longer prompt is an error (departure 5)."""
    max_response_tokens: int = 4096
    """Response cap; retokenised peer responses longer than this are dropped and counted."""
    stop: list[str] = field(default_factory=list)
    """Stop string, repeatable (--stop $'\\n\\n' --stop 'Q:'): a response ends at the token that completes one."""
    eps_low: float = 0.2
    """Lower PPO clip: ratio floor 1 - eps_low (paper 0.2)."""
    eps_high: float = 0.28
    """Upper PPO clip: ratio ceiling 1 + eps_high (paper 0.28, DAPO clip-higher)."""
    dual_clip: float = 0.0
    """verl's dual-clip constant c for negative advantages (0 = off, the default; verl uses 3.0)."""
    delta: float = 0.8
    """Compatibility floor: peer responses with s <= delta are removed (Eq. 8; 0 = no floor)."""
    compat_norm: Literal["token", "byte"] = "token"
    """'token' = mean token log-prob (paper Eq. 6); 'byte' = summed log-prob / UTF-8 bytes (departure 2)."""
    std_normalize: bool = True
    """Divide group advantages by the group std (False = Dr.GRPO)."""
    lr: float = 1e-6
    """AdamW learning rate, constant, no warm-up (paper 1e-6; tiny ~1e-4)."""
    weight_decay: float = 0.01
    """AdamW weight decay."""
    grad_clip: float = 1.0
    """Global grad-norm clip per optimizer step."""

    # --- variants and ablations (README "Baselines and ablations")
    variant: Literal["graft", "hacpo", "sgt", "luffy"] = "graft"
    """graft | hacpo | sgt | luffy. Without a peer every variant is plain GRPO."""
    order: Literal["peer_last", "peer_first", "uniform"] = "peer_last"
    """Minibatch order of replaced groups: peer_last (paper) | peer_first | uniform."""
    balance: bool = True
    """Balanced swap; False = every candidate in both directions (ablation)."""
    compat_weight: bool = True
    """Use w = min(s, 1) on peer responses; False = w = 1 for every retained peer response (ablation)."""
    ratio_level: Literal["token", "sequence"] = "token"
    """token (paper) | sequence (ablation: one length-normalised ratio per response)."""
    selection: Literal["graft", "random", "sgt"] = "graft"
    """graft (Eq. 4 + swap) | random (same count, among prompts whose peer is mixed) | sgt (SGT's rescue rule)."""
    acceptance: Literal["gate", "random"] = "gate"
    """gate (compatibility) | random (same acceptance rate, responses drawn at random)."""
    peer_advantages: Literal["source", "pooled"] = "source"
    """source (peer's own group advantages, paper) | pooled (recomputed over own + peer, 2n)."""
    transfer: Literal["all", "success"] = "all"
    """all (whole peer group, paper) | success (only the peer's correct responses)."""
    sgt_coef: float = 0.1
    """SGT: weight of the NLL term on one correct peer response per rescue prompt."""
    luffy_gamma: float = 0.1
    """LUFFY: shaping constant in f(pi) = pi / (pi + gamma) for peer tokens."""

    # --- system
    seed: int = 0
    """Seed for sampling and minibatch shuffles; both sides of a pair must use the same --data-seed."""
    data_seed: int = 0
    """Seed of the prompt order; the two sides of a pair must agree (checked against the peer's file)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """auto (cuda if available, else cpu) | cpu | cuda."""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """auto (fp32 weights + bf16 autocast on GPU, fp32 on CPU) | float32 | bfloat16 (bf16 weights, less memory)."""
    gen_batch_size: int = 256
    """Rows in flight at most (the static path's slots; its KV pool fills by real lengths); run_pair.sh: the plan's."""
    static_decode: Literal["auto", "on", "off"] = "auto"
    """CUDA-graph decode (sampler.py departure 10): auto = on CUDA for full-attention models; bare flag = on."""
    decode_attention: Literal["auto", "kernel", "gather"] = "auto"
    """Attention of the CUDA-graph decode (sampler.py departure 18): kernel reads KV blocks in place; auto if it can."""
    share_prefix: bool = True
    """Run each prompt once for its n samples and their log-prob passes (sampler.py departure 11)."""
    micro_batch_size: int = 16
    """Sequences per forward/backward pass inside a minibatch (gradient accumulation)."""
    logprob_chunk: int = 1024
    """Tokens per chunk in the chunked logprob kernel (bounds the logits memory)."""
    fsdp: bool = False
    """Shard weights, gradients and AdamW state over the ranks with FSDP2 (torchrun; models DP cannot fit)."""
    gradient_checkpointing: bool = False
    """Recompute activations in backward (saves memory on long responses)."""
    memory_plan: Literal["cuda", "always", "off"] = "cuda"
    """Memory plan at start (plan.py, before loading): cuda = on GPU, refuses a misfit | always (CPU: print) | off."""
    gpu_memory: float = 0.0
    """Card memory in GiB for the memory plan (0 = the CUDA device's); given, the trainer enforces it on CPU too."""
    ranks: int = 0
    """`graft.py plan` only: the ranks per side it plans for (0 = 1; the trainer uses its torchrun world size)."""
    threads: int = 0
    """torch CPU threads (0 = leave torch's default). On a shared CPU, 1 per process is often fastest."""
    verify_workers: int = 0
    """Processes for the verifier (0 = in-process)."""
    reward_timeout: float = 60.0
    """Seconds one reward call may run: past it its worker is killed and its responses score 0 (0 = no limit)."""
    save_every: int = 20
    """Checkpoint every this many steps (and at the end); --resume continues from the latest."""
    keep_checkpoints: int = 2
    """How many step checkpoints to keep (the best-by-eval one is kept apart)."""
    report_to: Literal["none", "tensorboard", "wandb"] = "none"
    """Also log metrics live from rank 0: none | tensorboard (<out>/tensorboard) | wandb (optional packages)."""
    resume: bool = False
    """Continue from the newest loadable checkpoint (a pair: relaunch both); a changed run-defining flag is refused."""
    force: bool = False
    """Delete an earlier run in --out (and this side's files in the exchange dir) and start over."""

    # --- evaluation (paper: five benchmarks, T = 0.6, top-p 0.95, avg@8)
    eval_every: int = 0
    """Validate every this many steps (paper 5; 0 = off) and keep the best checkpoint."""
    benchmarks: str = "all"
    """Comma list of math500,aime2024,aime2025,amc23,minerva, 'all', or paths to prompt JSONL files."""
    data_dir: str = "data"
    """Folder with the benchmark JSONL files written by data/prepare.py."""
    eval_samples: int = 8
    """Samples per problem for evaluation (avg@k = pass@1; paper 8)."""
    eval_temperature: float = 0.6
    """Evaluation sampling temperature (paper 0.6)."""
    eval_top_p: float = 0.95
    """Evaluation top-p (paper 0.95)."""
    eval_max_problems: int = 0
    """Use only the first this many problems per benchmark (0 = all; for quick checks)."""
    eval_max_tokens: int = 0
    """Evaluation response cap (0 = max_response_tokens)."""
    save_responses: bool = False
    """Eval: also write every sampled response to the results JSON."""
    eval_out: str = ""
    """Eval: path of the results JSON (default <model>/eval_results.json or <out>/eval/...)."""


# The values of every Literal field, in the order written (validate_config checks them; the CLI lists them).
CHOICES: dict[str, tuple[str, ...]] = {name: typing.get_args(t) for name, t in typing.get_type_hints(Config).items()
                                       if typing.get_origin(t) is Literal}
# --report-to's optional packages (validate_config checks that the one asked for is installed).
REPORT_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb"}


# ------------------------------------------------------------------------------------------------
# 2. Validation: bad user input fails early, naming the flag
# ------------------------------------------------------------------------------------------------


def validate_config(cfg: Config) -> None:
    """Raise ValueError naming the flag for any bad value (bad user input fails early).

    --reward is checked where it is loaded (reward.load_reward, also at start): loading runs the user's code."""
    def bad(flag, msg):
        raise ValueError(f"--{flag.replace('_', '-')}: {msg}")
    for f, allowed in CHOICES.items():
        if getattr(cfg, f) not in allowed:
            bad(f, f"{getattr(cfg, f)!r} is not one of {', '.join(allowed)}")
    if not cfg.model:
        bad("model", "is required (a hub id or a local folder)")
    if cfg.n < 2:
        bad("n", f"GRPO needs at least 2 rollouts per prompt (got {cfg.n}: every advantage would be 0)")
    positive_ints = ("steps", "prompts_per_step", "max_prompt_tokens", "max_response_tokens", "gen_batch_size",
                     "micro_batch_size", "logprob_chunk", "save_every", "keep_checkpoints", "eval_samples")
    for f in positive_ints:
        if getattr(cfg, f) < 1:
            bad(f, f"must be >= 1, got {getattr(cfg, f)}")
    for f in ("threads", "verify_workers", "reward_timeout", "eval_every", "eval_max_problems", "eval_max_tokens",
              "sgt_coef", "gpu_memory", "ranks"):
        if getattr(cfg, f) < 0:
            bad(f, f"must be >= 0, got {getattr(cfg, f)}")
    for f in ("lr", "grad_clip", "exchange_timeout", "peer_dead_after", "heartbeat_interval", "join_timeout",
              "luffy_gamma"):
        if not getattr(cfg, f) > 0:
            bad(f, f"must be > 0, got {getattr(cfg, f)}")
    if not 0 <= cfg.delta <= 1:
        bad("delta", f"must be in [0, 1] (w = min(s, 1), so a floor above 1 rejects every peer response), "
                     f"got {cfg.delta}")
    if cfg.weight_decay < 0:
        bad("weight_decay", f"must be >= 0, got {cfg.weight_decay}")
    if "" in cfg.stop:
        bad("stop", "an empty stop string would end every response at its first token")
    if cfg.heartbeat_interval * 3 > cfg.peer_dead_after:
        bad("heartbeat_interval", f"must be at most a third of --peer-dead-after ({cfg.peer_dead_after}), "
                                  f"or a slow disk makes a live peer look dead")
    if cfg.resume and cfg.force:
        bad("force", "--force starts over and --resume continues: choose one")
    if cfg.minibatches < 1 or cfg.minibatches > cfg.prompts_per_step:
        bad("minibatches", f"must be in [1, prompts_per_step={cfg.prompts_per_step}]")
    if not (0 <= cfg.eps_low < 1 and cfg.eps_high >= 0):
        bad("eps_low", "needs 0 <= eps_low < 1 and eps_high >= 0")
    if cfg.dual_clip and cfg.dual_clip <= 1:
        bad("dual_clip", "verl's dual-clip constant must be > 1 (or 0 = off)")
    if cfg.temperature < 0 or not (0 < cfg.top_p <= 1):
        bad("temperature", "needs temperature >= 0 and 0 < top_p <= 1")
    if cfg.peer_exchange and cfg.peer_log:
        bad("peer_log", "choose one peer: --peer-exchange (online) or --peer-log (stored), not both")
    names = cfg.peer_name.split(",")
    if cfg.peer_exchange and cfg.name in names:
        bad("peer_name", f"the peers' names must differ from --name ({cfg.name!r})")
    if len(set(names)) != len(names):
        bad("peer_name", f"{cfg.peer_name!r} names a peer twice")
    for flag, v in [("name", cfg.name)] + [("peer_name", p) for p in names]:
        if not v or "/" in v or v.startswith(".") or v == "RUN":
            bad(flag, f"{v!r} must be a plain folder name (not RUN, which the exchange dir uses)")
    if len(names) > 1:
        if not cfg.peer_exchange:
            bad("peer_name", "several peers need an online exchange (--peer-exchange)")
        if cfg.variant in ("hacpo", "sgt") or cfg.selection != "graft":
            bad("peer_name", "with several peers only GRAFT's own selection runs (variant graft or luffy, "
                             "--selection graft)")
    if cfg.peer_model and not Path(cfg.peer_log).is_file():
        bad("peer_model", "scores a JSONL --peer-log of foreign trajectories; give that file as --peer-log")
    if cfg.variant == "hacpo" and Path(cfg.peer_log).is_file():
        bad("variant", "hacpo pools n own with n peer rollouts per prompt; a JSONL --peer-log has groups of any size")
    if "{problem}" not in cfg.prompt_template:
        bad("prompt_template", "must contain '{problem}'")
    if ":" not in cfg.reward.strip(":"):
        bad("reward", f"{cfg.reward!r} must name module:function or path/to/file.py:function")
    if cfg.report_to != "none":
        package = REPORT_PACKAGES[cfg.report_to]
        if importlib.util.find_spec(package) is None:
            bad("report_to", f"{cfg.report_to} needs the optional package {package!r}: pip install {package}")


# ------------------------------------------------------------------------------------------------
# 3. The CLI and FLAGS.md, built from the fields
# ------------------------------------------------------------------------------------------------


def field_docs(cls) -> dict[str, str]:
    """The one-line string under each dataclass field (attribute docstrings), read from the source.

    The docstrings are the documentation of the config and of the CLI at the same time.
    """
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
            docs[node.target.id] = str(nxt.value.value).strip()
    return docs


EVAL_ALIASES = {"samples": "eval_samples", "temperature": "eval_temperature", "top_p": "eval_top_p"}
# torchrun's own parser reads "--n" as an ambiguous abbreviation of its flags (Python argparse
# classifies every "--x" before the script's arguments), so --n has a long spelling too.
FLAG_ALIASES = {"n": "--rollouts"}


def add_config_flags(parser: argparse.ArgumentParser, names: list[str], *,
                     aliases: dict[str, str] | None = None) -> None:
    """One flag per named Config field: --field-name (plus FLAG_ALIASES and `aliases`, field -> extra name),
    its default, its docstring as help; a bool field is --x / --no-x."""
    docs, fields = field_docs(Config), {f.name: f for f in dataclasses.fields(Config)}
    for name in names:
        f = fields[name]
        flags = [f"--{name.replace('_', '-')}"]
        flags += [f"--{aliases[name].replace('_', '-')}"] if aliases and name in aliases else []
        flags += [FLAG_ALIASES[name]] if name in FLAG_ALIASES else []
        help_ = docs.get(name, "").replace("%", "%%")
        help_ += f" choices: {', '.join(CHOICES[name])}" if name in CHOICES else ""
        if isinstance(f.default, bool):
            parser.add_argument(*flags, dest=name, action=argparse.BooleanOptionalAction, default=f.default,
                                help=help_)
        elif {"on", "off"} <= set(CHOICES.get(name, ())):
            # an on/off/auto switch: --x alone means on (as a bool flag would), --x VALUE any choice, --no-x off
            parser.add_argument(*flags, dest=name, nargs="?", const="on", default=f.default, help=help_)
            parser.add_argument(f"--no-{name.replace('_', '-')}", dest=name, action="store_const", const="off",
                                help=argparse.SUPPRESS)
        elif f.default is dataclasses.MISSING:  # a list field (--stop): repeat the flag for each item
            parser.add_argument(*flags, dest=name, action="append", default=f.default_factory(), metavar="STR",
                                help=help_)
        else:
            parser.add_argument(*flags, dest=name, type=type(f.default), default=f.default, help=help_)


def build_parser() -> argparse.ArgumentParser:
    """graft.py's command line: train, eval and plan take every Config field as a flag; complement, preflight,
    panel and plot parse their own flags (their modules)."""
    parser = argparse.ArgumentParser(prog="graft.py", description="GRAFT: Gated Replacement of Answer-Failed "
                                     "groups with peer Trajectories.")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("complement", add_help=False,
                   help="how complementary candidate models are, before a pair run (graft.py complement -h)")
    sub.add_parser("preflight", add_help=False,
                   help="sample two models and report what a pair of them would exchange (graft.py preflight -h)")
    sub.add_parser("panel", add_help=False,
                   help="the mechanism panel: GRPO vs GRAFT on the prompts each model fails (graft.py panel -h)")
    sub.add_parser("plot", add_help=False, help="PNG curves from runs' metrics.jsonl (graft.py plot -h; matplotlib)")
    helps = {"train": "train one side (GRPO / GRAFT)", "eval": "evaluate a model on the benchmarks",
             "plan": "the memory plan of each phase on fake tensors against the card (--model a,b: one per side)"}
    for command, help_cmd in helps.items():  # plan takes the train flags
        p = sub.add_parser(command, help=help_cmd, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
        names = [f.name for f in dataclasses.fields(Config) if not (command == "eval" and f.name in EVAL_ALIASES)]
        # in eval, --temperature etc. mean the evaluation settings
        add_config_flags(p, names, aliases={v: k for k, v in EVAL_ALIASES.items()} if command == "eval" else None)
    return parser


def config_from_args(args: argparse.Namespace) -> Config:
    """The Config of parsed flags (fields a parser did not define keep their defaults)."""
    return Config(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Config) if hasattr(args, f.name)})


def flags_markdown() -> str:
    """The flag table of FLAGS.md, generated from Config."""
    docs = field_docs(Config)
    lines = ["| flag | default | meaning |", "|---|---|---|"]
    for f in dataclasses.fields(Config):
        default = repr(f.default_factory() if f.default is dataclasses.MISSING else f.default)
        default = default if len(default) <= 30 else default[:27] + "..."
        text = docs.get(f.name, "") + (f" Choices: {', '.join(CHOICES[f.name])}." if f.name in CHOICES else "")
        lines.append(f"| `--{f.name.replace('_', '-')}` | `{default}` | {text.replace('|', '/')} |")
    return "\n".join(lines) + "\n"


def flags_document() -> str:
    """FLAGS.md, whole (a test keeps the file equal to it):
    python -c "import config; print(config.flags_document(), end='')" > docs/FLAGS.md"""
    return ("# Flags of `python graft.py train`\n\n"
            "Generated from `config.Config`, the one config dataclass, whose field docstrings are the help lines\n"
            "(`python graft.py train --help` prints the same). Regenerate after changing a field:\n"
            "`python -c \"import config; print(config.flags_document(), end='')\" > docs/FLAGS.md`.\n\n"
            + flags_markdown())
