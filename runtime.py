"""Runtime plumbing under the GRAFT trainer: ranks and devices, precision, model and prompt loading.

None of this is the method; graft.py imports it so that the trainer reads as the GRAFT step. Each
function takes the trainer's config.Config (any object with the named attributes) and imports nothing
of ours but config.py (that type), exchange.py (the run files), metrics.py (the metrics file's reader) and
data/prompts.py (the prompt file): the project's imports run graft.py -> foreign.py -> runtime.py ->
exchange.py, never back.

    setup_distributed   torchrun's RANK / WORLD_SIZE -> process group (NCCL on GPU, gloo on CPU), on one
                        node or several (README "Past one node"); on a GPU it first sets the allocator's
                        expandable segments unless the user chose a setting (cuda_alloc_conf)
    gather_lists, shard, unshard   split a list over ranks and put the gathered parts back in order
    compute_context     bf16 autocast on GPU with --dtype auto (graft.py departure 6)
    kv_budget, eval_rows   the bytes of the static decode path's KV pool on a GPU; the evaluation's rows in flight
    cast_copy_bytes     the bytes of the sampler's bf16 copy of the Linear weights (kv_budget leaves them out)
    adamw_kernel        AdamW fused on CUDA, foreach elsewhere
    load_policy         a transformers causal LM + tokenizer + the ids that stop a rollout
    encode_prompt       the prompt's ids: raw text (graft.py departure 8) or the chat template
    load_prompt_file    a validated prompt JSONL
    timed               adds a block's wall time to a dict of timings
    stop_signals, raise_stopped   SIGINT and SIGTERM as exceptions, kept for the step loop to raise again
    shard_policy, gathered, full_state_dicts, load_full_optimizer_state,
    clip_sharded_grad_norm_   FSDP2 (--fsdp)
    RunFiles            the trainer's file keeping, an object graft.Trainer holds (its own paths, run identity
                        and resume step; what it saves comes as arguments): run directory, the settings check
                        of --resume, run identity, attempt and heartbeat (exchange.py), the check that every
                        rank sees rank 0's files, metrics trimming, atomic checkpoints and the fall-back over
                        broken ones; a lost rank named as such (lost_rank_message)
    check_weight_files  a model folder's safetensors files, checked before loading (names the file)
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import signal
import socket
import struct
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from config import Config  # the functions read its fields (tests may pass any object that has them)
from data.prompts import load_prompts
from exchange import (Heartbeat, atomic_write, describe_write_error, file_sha256, join_attempt, join_run,
                      leave_run, new_run_id, read_json, write_failed, write_json)
from metrics import read_metrics


@dataclass
class DistInfo:
    rank: int = 0
    world: int = 1
    device: torch.device = torch.device("cpu")

    @property
    def main(self) -> bool:
        return self.rank == 0


ALLOC_CONF = "expandable_segments:True"
"""The CUDA caching allocator's setting the trainer starts with: segments that grow in place instead of new
blocks of each size, so the rollout's changing KV-cache shapes and the update's activations do not strand
memory in freed blocks of the wrong sizes (PyTorch's "Optimizing memory usage" notes)."""


def cuda_alloc_conf(environ=os.environ) -> str:
    """PYTORCH_CUDA_ALLOC_CONF = ALLOC_CONF unless the user set it or PYTORCH_ALLOC_CONF (their choice wins).
    It must run before CUDA is first used: the allocator reads its setting once. Returns the setting in force."""
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        if environ.get(name):
            return environ[name]
    environ["PYTORCH_CUDA_ALLOC_CONF"] = ALLOC_CONF
    return ALLOC_CONF


def setup_distributed(cfg: Config) -> DistInfo:
    """torchrun sets RANK/WORLD_SIZE: one process per GPU (NCCL) or per CPU worker (gloo).

    Over several nodes (torchrun --nnodes N, one launch per node) RANK is global and LOCAL_RANK picks
    the GPU on this node. Nothing else changes: every rank computes the step's exchange itself, from
    the same rollout files in --peer-exchange, so those folders (and --out, which --resume reads on
    every rank) must be on storage every node sees; RunFiles.check_shared_files stops a run where not."""
    if cfg.device != "cpu":
        cuda_alloc_conf()  # before anything touches CUDA (is_available does not initialise the allocator)
    use_cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if getattr(cfg, "fsdp", False) and "RANK" not in os.environ:
        raise SystemExit("--fsdp: launch with torchrun (torchrun --nproc_per_node N graft.py train ... --fsdp)")
    if (world > 1 or getattr(cfg, "fsdp", False)) and not torch.distributed.is_initialized():
        torch.distributed.init_process_group(backend="nccl" if use_cuda else "gloo")
    if use_cuda:
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
    return DistInfo(rank=rank, world=world, device=device)


def gather_lists(items: list, dist_info: DistInfo) -> list:
    """All ranks get the concatenation of every rank's list, rank by rank (CPU objects: rollouts
    are small next to the model); unshard() puts a strided shard() back in order."""
    if dist_info.world == 1:
        return items
    parts = [None] * dist_info.world
    torch.distributed.all_gather_object(parts, items)
    return [x for p in parts for x in p]


def shard(seq: list, dist_info: DistInfo) -> list:
    """This rank's strided share of a list (rank r takes items r, r + world, ...)."""
    return seq[dist_info.rank::dist_info.world]


def unshard(parts_flat: list, total: int, dist_info: DistInfo) -> list:
    """Invert shard() after gather_lists(): rank-major concatenation -> original order."""
    out, pos = [None] * total, 0
    for r in range(dist_info.world):
        for i in range(r, total, dist_info.world):
            out[i] = parts_flat[pos]
            pos += 1
    return out


def compute_context(cfg: Config, dist_info: DistInfo):
    """bf16 autocast on GPU with --dtype auto: matmuls in bf16, fp32 master weights and optimizer.

    Pure bf16 weights would lose the paper's lr = 1e-6 updates: bf16 keeps ~3 significant digits, so
    w + 1e-6 * g == w for most weights. --dtype bfloat16 is there for memory, knowing that.
    """
    if cfg.dtype == "auto" and dist_info.device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


KV_BUDGET_SHARE = 0.75
"""The share of what the card has left at a sample() call that the static path's KV pool may take (kv_budget); the
rest holds the prefill (its activations and its own K/V before they are copied into the pool) and the logits. 0.75
by the memory plan of pair1's models (docs/RESULTS.md, "The memory plan"): a larger share leaves the worst-case
prefill of fewer slots than the pool holds rows (0.8: Qwen3-1.7B 120 slots on an H100, its pool 175 rows), a
smaller one a pool of fewer rows."""


def cast_copy_bytes(model, device: torch.device) -> int:
    """Bytes of the copy sampler.sample makes of the model's Linear weights when it runs under autocast (sampler.py
    departure 17, cast_weights_once's rule, counted without casting): every nn.Linear whose weight is float32 and
    not a sharded DTensor, in autocast's dtype, a tied weight once; 0 when autocast is off for the device."""
    if not torch.is_autocast_enabled(device.type):
        return 0
    size = torch.empty((), dtype=torch.get_autocast_dtype(device.type)).element_size()
    seen: dict[int, int] = {}
    for module in model.modules():
        weight = module._parameters.get("weight") if isinstance(module, torch.nn.Linear) else None
        if weight is not None and weight.dtype == torch.float32 and type(weight.data).__name__ != "DTensor":
            seen[id(weight)] = weight.numel() * size
    return sum(seen.values())


def kv_budget(device: torch.device, model=None) -> int | None:
    """Bytes of the static decode path's K/V (sampler.py's max_cache_bytes: the pool that rows fill by their real
    lengths, and on the gathered path a decode step's transient gather of one layer; the paged kernel gathers
    nothing, so with it the pool takes all of it: sampler.pool_plan): KV_BUDGET_SHARE of what the card has left at
    the call, the driver's free memory plus what the caching allocator holds unused (after the state and, under
    --fsdp, the gathered weights), less the bf16 copy that sample() makes of `model`'s Linear weights under autocast
    (cast_copy_bytes; no model: not subtracted). plan.py plans this budget (its rollout and evaluation phases). None
    off CUDA (no limit: the CPU has no card to overrun)."""
    if device.type != "cuda":
        return None
    free = torch.cuda.mem_get_info(device)[0] + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    copy = cast_copy_bytes(model, device) if model is not None else 0
    return max(0, int(KV_BUDGET_SHARE * (free - copy)))


def eval_rows(cfg: Config, *, paged: bool = False) -> int:
    """Rows in flight (sample's max_batch_size) for the in-training evaluation (Trainer.validate). paged: sample takes
    the static path (sampler.resolve_static: full-attention models on CUDA), whose KV pool of kv_budget bytes decides
    how many rows are in flight: the evaluation gets the rollout's --gen-batch-size slots. Otherwise (the CPU,
    sliding-window and hybrid models) the cache is dense and bounded by the rows only: the KV tokens a rollout may
    hold (--gen-batch-size rows of --max-prompt-tokens + --max-response-tokens) spent on rows of --max-prompt-tokens
    + the eval cap, at most --gen-batch-size, so the evaluation never needs more cache than the rollout it follows."""
    if paged:
        return cfg.gen_batch_size
    rollout = cfg.gen_batch_size * (cfg.max_prompt_tokens + cfg.max_response_tokens)
    row = cfg.max_prompt_tokens + (cfg.eval_max_tokens or cfg.max_response_tokens)
    return max(1, min(cfg.gen_batch_size, rollout // row))


def adamw_kernel(device: torch.device) -> dict:
    """torch.optim.AdamW's implementation flag: fused on CUDA (no foreach temporaries: a step peaks at 16 bytes per
    parameter instead of 20, `python -m bench.audit adamw`), foreach elsewhere."""
    return {"fused": True} if device.type == "cuda" else {"foreach": True}


def load_policy(path: str, cfg: Config, dist_info: DistInfo, *, for_training: bool = True):
    """A transformers causal LM + tokenizer. Weights: fp32 (bf16 with --dtype bfloat16, or for a
    GPU evaluation with --dtype auto, where no update needs the precision)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    if cfg.dtype == "auto":
        dtype = torch.bfloat16 if (dist_info.device.type == "cuda" and not for_training) else torch.float32
    else:
        dtype = getattr(torch, cfg.dtype)
    local = Path(path)
    if local.exists() and not (local / "config.json").is_file():
        raise SystemExit(f"--model {path!r}: {'a file' if local.is_file() else 'a folder without config.json'}, "
                         f"not a transformers model folder (save_pretrained writes one) nor a hub id")
    if local.is_dir():
        problem = check_weight_files(local)
        if problem:
            raise SystemExit(f"--model {path!r}: {problem}")
    try:
        tok = AutoTokenizer.from_pretrained(path, trust_remote_code=cfg.trust_remote_code)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, trust_remote_code=cfg.trust_remote_code)
    except Exception as e:  # missing files, unknown architecture, broken tokenizer or weights
        raise SystemExit(f"--model {path!r}: cannot load a transformers causal LM and tokenizer "
                         f"({type(e).__name__}: {e})") from e
    model.to(dist_info.device)
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable()
        model.config.use_cache = False
    # The ids that stop a rollout: the tokenizer's EOS and the generation config's (Qwen3-Base's
    # tokenizer says <|im_end|> while the base model ends documents with <|endoftext|>).
    gen_eos = getattr(model.generation_config, "eos_token_id", None)
    gen_eos = [gen_eos] if isinstance(gen_eos, int) else list(gen_eos or [])
    stop = list(dict.fromkeys(gen_eos + ([tok.eos_token_id] if tok.eos_token_id is not None else [])))
    if not stop:
        raise SystemExit(f"--model {path!r}: the tokenizer and generation config name no EOS token")
    if tok.pad_token_id is None:
        tok.pad_token = tok.convert_ids_to_tokens(stop[0])
    return model, tok, stop


def encode_prompt(problem: str, tokenizer, *, template: str, chat: bool) -> list[int]:
    """Prompt ids: the template with the problem, as raw text (with the tokenizer's BOS, if it adds
    one; departure 8) or as one user message of the chat template (--chat-template, the paper's)."""
    text = template.replace("{problem}", problem)
    if chat:
        if tokenizer.chat_template is None:
            raise SystemExit("--chat-template: this tokenizer has no chat template; drop the flag to use raw text")
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            tokenize=True)
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
    return tokenizer.encode(text, add_special_tokens=True)


def safetensors_problem(path: Path) -> str | None:
    """What is wrong with a safetensors file (unreadable, bad header, truncated), or None.

    Reads the header only: 8 bytes of header length, the JSON header, and the file size the
    header's last data offset implies (a cut file is shorter)."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                return f"{path}: truncated ({size} bytes, no safetensors header)"
            n = struct.unpack("<Q", head)[0]
            if n > size - 8:
                return f"{path}: truncated or not safetensors (header of {n} bytes in a file of {size})"
            header = json.loads(f.read(n))
        end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
    except (OSError, ValueError, KeyError, TypeError, IndexError) as e:
        return f"{path}: not a readable safetensors file ({type(e).__name__}: {e})"
    if size != 8 + n + end:
        return f"{path}: truncated ({size} bytes, its header describes {8 + n + end})"
    return None


def check_weight_files(folder: Path) -> str | None:
    """The first problem of a local model folder's weight files (missing shard, truncated or bad
    header), naming the file; None when they look whole."""
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError) as e:
            return f"{index}: not a readable weight index ({type(e).__name__}: {e})"
        missing = [n for n in names if not (folder / n).is_file()]
        if missing:
            return f"{folder / missing[0]}: missing (named in {index.name})"
        files = [folder / n for n in names]
    else:
        files = sorted(folder.glob("*.safetensors"))
        if not files and not any(folder.glob("*.bin")):
            return f"{folder}: no weight file (model.safetensors)"
    return next((p for p in map(safetensors_problem, files) if p), None)


def load_prompt_file(path: str) -> list[dict]:
    """Validated prompt JSONL (data/prompts.py's load_prompts); a bad file stops the run naming file and line."""
    if not Path(path).is_file():
        raise SystemExit(f"--prompts {path!r}: no such file (python -m data.prepare writes data/math_train.jsonl)")
    try:
        return load_prompts(path)
    except ValueError as e:  # names the file and line
        raise SystemExit(f"--prompts: {e}") from None


def timed(timings: dict, key: str):
    """Context manager adding the wall time of its block to timings[key] (seconds)."""
    @contextlib.contextmanager
    def block():
        t0 = time.time()
        try:
            yield
        finally:
            timings[key] = timings.get(key, 0.0) + time.time() - t0
    return block()


@contextlib.contextmanager
def stop_signals():
    """Inside the block SIGINT and SIGTERM raise in the main thread (Ctrl-C's KeyboardInterrupt, SystemExit), so a
    stopped trainer leaves its FAILED marker; each one received is also kept in the list the block gets, for the
    step loop to raise again at its boundaries (raise_stopped). Python raises a signal's exception wherever the
    main thread is, and one raised inside a finalizer (a progress bar's __del__ after a checkpoint) is printed and
    lost: the run would go on to its end. Off the main thread nothing is installed."""
    caught: list[int] = []

    def on_signal(signum, _frame):
        caught.append(signum)
        raise_stopped(caught)

    previous = {}
    if threading.current_thread() is threading.main_thread():
        previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield caught
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def raise_stopped(caught: list[int]) -> None:
    """The exception of the first stop signal in caught (stop_signals), if any: KeyboardInterrupt for SIGINT, else
    SystemExit naming the signal."""
    if caught and caught[0] == signal.SIGINT:
        raise KeyboardInterrupt
    if caught:
        raise SystemExit(f"terminated by signal {signal.Signals(caught[0]).name}")


# ------------------------------------------------------------------------------------------------
# FSDP2 (--fsdp): weights, gradients and optimizer state sharded over the ranks
# ------------------------------------------------------------------------------------------------


class PolicyForward(torch.nn.Module):
    """The FSDP2 root module: its forward is the trainer's chunked log-prob pass.

    The chunked kernel reads the lm_head weight directly instead of calling the lm_head module, so
    under FSDP2 it would see a sharded DTensor. Running the pass inside the root's forward makes FSDP
    unshard the root's own parameters (embeddings, final norm, lm_head: tied weights stay in one
    group) around it and reduce-scatter their gradients after backward; each decoder layer is its
    own FSDP unit, gathered layer by layer as the body runs.
    """

    def __init__(self, lm: torch.nn.Module, logprob_fn):
        super().__init__()
        self.lm = lm
        self.logprob_fn = logprob_fn  # sampler.response_logprobs (passed in: this file imports nothing of ours)

    def forward(self, prompts, responses, **kw):
        return self.logprob_fn(self.lm, prompts, responses, **kw)


def shard_policy(lm: torch.nn.Module, logprob_fn) -> PolicyForward:
    """fully_shard every decoder layer (the model's _no_split_modules classes) and the root.

    Gradients are summed over ranks, not averaged: the loss is already a global sum over the
    minibatch's tokens divided by their global count (graft.py departure 3). No mixed-precision
    policy: parameters are gathered in fp32 and the forward runs under the trainer's bf16 autocast,
    exactly as without --fsdp (a bf16 param policy would halve the all-gather traffic but change the
    numerics between the two paths).
    """
    from torch.distributed.fsdp import FSDPModule, fully_shard
    kinds = set(getattr(lm, "_no_split_modules", None) or [])
    layers = [m for m in lm.modules() if type(m).__name__ in kinds]
    assert layers, f"{type(lm).__name__}: no decoder layers found to shard (_no_split_modules = {sorted(kinds)})"
    for layer in layers:
        fully_shard(layer)
    root = PolicyForward(lm, logprob_fn)
    fully_shard(root)
    for m in root.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)  # plain SUM: gloo (CPU) has no pre-multiplied sum
    # FSDP initialises lazily at the first forward, taking whichever unit runs first as the root. The
    # sampler calls the body (not the root) first, so one token through the root sets it up right.
    with torch.no_grad():
        root([[0]], [[0]], pad_token_id=0)
    root.reshard()  # the root keeps its weights gathered after a forward; the optimizer must see the shards
    return root


@contextlib.contextmanager
def gathered(root: torch.nn.Module | None):
    """Every FSDP unit of root unsharded for the block (sampling and no-grad log-prob passes).

    The rollout phase makes thousands of forward calls per step; gathering once instead of per call
    keeps it as fast as data parallel, at the memory of one full copy of the weights. Ranks may then
    run different numbers of forwards (no collective inside). root=None: nothing to do.
    """
    if root is None:
        yield
        return
    from torch.distributed.fsdp import FSDPModule
    units = [m for m in root.modules() if isinstance(m, FSDPModule)]
    for m in units:
        m.set_reshard_after_forward(False)
        m.unshard()
    try:
        yield
    finally:
        for m in units:
            m.reshard()
            m.set_reshard_after_forward(m is not root)  # fully_shard's defaults: layers reshard, the root not


def full_state_dicts(root: torch.nn.Module, opt: torch.optim.Optimizer) -> tuple[dict, dict]:
    """(model, optimizer) full state dicts on CPU, on rank 0 (empty elsewhere); every rank must call it.

    Model keys are those of the wrapped transformers model (save_pretrained's); optimizer keys are
    parameter names, as torch.distributed.checkpoint writes them."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model = get_model_state_dict(root, options=options)
    model = {k.removeprefix("lm."): v for k, v in model.items()}
    return model, get_optimizer_state_dict(root, opt, options=options)


def load_full_optimizer_state(root: torch.nn.Module, opt: torch.optim.Optimizer, state: dict) -> None:
    """Shard a full optimizer state dict (as full_state_dicts wrote it) into this rank's optimizer."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict
    set_optimizer_state_dict(root, opt, optim_state_dict=state, options=StateDictOptions(full_state_dict=True))


def clip_sharded_grad_norm_(params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_ for FSDP2's sharded (DTensor) gradients; returns the total norm.

    Each rank holds disjoint shards, so the squared norm is the all-reduced sum of the local squared
    norms (torch's own function mixes DTensor and local tensors in this torch version and fails).
    Same clip rule as torch: scale by min(1, max_norm / (norm + 1e-6)).
    """
    local = [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for p in params if p.grad is not None]
    sq = torch.stack([g.float().pow(2).sum() for g in local]).sum() if local else torch.zeros(())
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(sq)
    norm = sq.sqrt()
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for g in local:
        g.mul_(coef.to(g.dtype))
    return norm


# ------------------------------------------------------------------------------------------------
# The trainer's file keeping: an object graft.Trainer holds (Trainer.files), with its own state
# ------------------------------------------------------------------------------------------------

# What --resume may change: run length, checkpoint and eval cadence, waits and timeouts, speed and
# memory knobs that leave the numbers as they are, paths that may move, live logging (--report-to),
# the gold check's --strict, and --lr / --grad-clip (a researcher lowering the lr of a diverging run
# is a deliberate choice; the new lr is written into the optimizer's param groups after its state is
# loaded, which would otherwise restore the old one).
# Every other Config field defines the run, and a change of one is refused.
RESUMABLE = frozenset({
    "steps", "save_every", "keep_checkpoints", "resume", "force", "out", "peer_exchange", "data_dir",
    "eval_every", "benchmarks", "eval_samples", "eval_temperature", "eval_top_p", "eval_max_problems",
    "eval_max_tokens", "save_responses", "eval_out", "exchange_timeout", "peer_dead_after", "heartbeat_interval",
    "join_timeout", "threads", "verify_workers", "reward_timeout", "gen_batch_size", "micro_batch_size",
    "logprob_chunk", "static_decode", "decode_attention", "gradient_checkpointing", "fsdp", "device",
    "trust_remote_code", "run_id", "lr", "grad_clip", "report_to", "strict", "memory_plan", "gpu_memory", "ranks",
})
# What the two sides of a pair must share for both to compute the same batches and the same swap
# (written into the run record by the founder, checked by every side that joins).
PAIR_SETTINGS = ("prompts_sha256", "n", "prompts_per_step", "data_seed", "balance", "selection", "variant")


def run_settings(cfg: Config) -> dict:
    """Every Config field, whether the peers are live and a digest of the prompts file's content (run.json).
    "online" is recorded apart because --peer-exchange, the folder, may move on --resume; a live peer may not come
    or go (--peer-log, the other kind of peer, is a field that defines the run)."""
    out = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
    out["online"] = bool(cfg.peer_exchange)
    out["prompts_sha256"] = file_sha256(cfg.prompts) if Path(cfg.prompts).is_file() else ""
    return out


def recorded_settings(record: dict) -> dict:
    """A run.json's settings as run_settings writes them now: an older record names the kind of peer by a "mode"
    string ("online", "stored" or "none"), read here as the "online" flag."""
    old = dict(record["settings"])
    if "mode" in old and "online" not in old:
        old["online"] = old.pop("mode") == "online"
    return old


# Words of the errors that gloo and NCCL raise when a peer process of the group is gone.
LOST_RANK_SIGNS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
                   "NCCL communicator was aborted", "NCCL error", "ProcessGroupNCCL", "ProcessGroupGloo")


def lost_rank_message(error: BaseException, name: str, world: int) -> str:
    """The line that says what an error of a collective means: another process of this side is gone (its
    node died or it was killed), so this one stops too; "" for any other error."""
    dist_error = getattr(torch.distributed, "DistError", ())
    if world == 1 or not (isinstance(error, dist_error) or any(s in str(error) for s in LOST_RANK_SIGNS)):
        return ""
    return (f"side {name!r} lost one of its {world} processes (a collective failed: a node of this side died, a "
            f"process of it was killed or the network between them broke; the other nodes' logs say which); every "
            f"process of the pair stops.")


class RunFiles:
    """Run directory, resume checks, the pair's run identity, metrics trimming, checkpoints.

    Its own state, set here and by its methods: out, ckpt_dir, exchange (the rollout files' folder), online (live
    peers meet in the exchange folder: a run record, attempts, a heartbeat), run_id, attempt, heartbeat and
    start_step (the step a --resume continues from). It reads its cfg (config.Config) and dist (DistInfo); what
    it saves (model, tokenizer, optimizer, the trainer's state) comes as arguments."""

    def __init__(self, cfg: Config, dist: DistInfo):
        self.cfg, self.dist = cfg, dist
        self.out = Path(cfg.out)
        self.ckpt_dir = self.out / "checkpoints"
        self.exchange = Path(cfg.peer_exchange) if cfg.peer_exchange else self.out / "exchange"
        self.online = bool(cfg.peer_exchange)
        self.run_id, self.attempt = "", 0  # set by join_pair
        self.heartbeat: Heartbeat | None = None  # online, on rank 0: started by join_pair
        self.start_step = 0  # set by resume_checkpoint

    def check_resume_settings(self) -> None:
        """--resume: refuse any change of what defines the run (against <out>/run.json), before the
        model loads; apply and print the changes that may be made (RESUMABLE)."""
        cfg, path = self.cfg, self.out / "run.json"
        record = read_json(path)
        if record is None or "settings" not in record:
            if self.dist.main and (self.out / "checkpoints").exists():
                print(f"--resume: {path} holds no settings: the run's settings cannot be checked")
            return
        old, new = recorded_settings(record), run_settings(cfg)
        labels = {"online": "a live peer (--peer-exchange, or none)",
                  "prompts_sha256": "the content of --prompts (sha256)"}
        flag = lambda k: labels.get(k, "--" + k.replace("_", "-"))
        refused = [f"{flag(k)}: {old[k]!r} in the run, {new[k]!r} now" for k in sorted(new)
                   if k not in RESUMABLE and k in old and old[k] != new[k]]
        if cfg.run_id and record.get("run_id") not in (None, cfg.run_id):
            refused.append(f"--run-id: {record.get('run_id')!r} in the run, {cfg.run_id!r} now")
        if refused:
            raise SystemExit(f"--resume: {path}: the run was started with other settings; resume with the run's "
                             f"own (or start a new run in a fresh --out):\n  " + "\n  ".join(refused))
        changed = [f"{flag(k)} {old[k]!r} -> {new[k]!r}" for k in sorted(RESUMABLE - {"resume", "force", "run_id"})
                   if k in old and k in new and old[k] != new[k]]
        if changed and self.dist.main:
            print("--resume: applying changed settings: " + ", ".join(changed)
                  + (" (the new --lr is set in the optimizer)" if old.get("lr") != cfg.lr else ""))

    def prepare_run_dir(self):
        """Refuse to overwrite an earlier run in --out (unless --resume or --force); check that the
        run and exchange folders are writable now rather than after the first rollout."""
        cfg = self.cfg
        parts = [p for p in ("metrics.jsonl", "checkpoints", "run.json", "exchange") if (self.out / p).exists()]
        if parts and not cfg.resume and not cfg.force:
            raise SystemExit(f"--out {self.out}: already holds a run ({', '.join(parts)}); pass --resume to "
                             f"continue it, --force to delete it and start over, or choose a new --out")
        if cfg.force and self.online:
            try:  # first: it refuses while the run it would delete is alive, before anything is deleted
                leave_run(self.exchange, cfg.name, dead_after=cfg.peer_dead_after)
            except RuntimeError as e:
                raise SystemExit(f"--peer-exchange: {e}") from None
        if parts and cfg.force:
            print(f"--force: deleting the earlier run in {self.out} ({', '.join(parts)})")
            for p in parts:
                target = self.out / p
                shutil.rmtree(target) if target.is_dir() else target.unlink()
        for folder, flag in ((self.out, "--out"), (self.exchange / cfg.name, "--peer-exchange" if cfg.peer_exchange
                                                   else "--out")):
            try:
                folder.mkdir(parents=True, exist_ok=True)
                probe = folder / f".write_test.{os.getpid()}"
                probe.write_text("")
                probe.unlink()
            except OSError as e:
                raise SystemExit(f"{flag}: cannot write to {folder} ({e.strerror or e})") from None
        self.clean_partial_checkpoints()
        self.trim_metrics()

    def join_pair(self) -> None:
        """This run's identity (self.run_id): written into every rollout file and checked on every peer file.

        Online, rank 0 founds or joins the run of the exchange folder (exchange.join_run), takes part
        in an attempt of it (0 for a fresh start, a new one for --resume: exchange.join_attempt) and
        starts the heartbeat; the id and the settings go to <out>/run.json so that --resume keeps the
        one and checks the other, and the id and attempt go to every rank.
        """
        cfg = self.cfg
        rid, self.attempt = "", 0
        if self.dist.main:
            record = read_json(self.out / "run.json") if cfg.resume else None
            previous = str(record["run_id"]) if record and "run_id" in record else ""
            settings = run_settings(cfg)
            if self.online:
                try:
                    rid = join_run(self.exchange, cfg.name, peer_names=cfg.peer_name.split(","),
                                   pair={k: settings[k] for k in PAIR_SETTINGS}, previous=previous,
                                   run_id=cfg.run_id, dead_after=cfg.peer_dead_after)
                    if previous:
                        self.attempt = join_attempt(self.exchange, cfg.name, rid, dead_after=cfg.peer_dead_after)
                except RuntimeError as e:
                    raise SystemExit(f"--peer-exchange: {e}") from None
                self.heartbeat = Heartbeat(self.exchange, cfg.name, rid, attempt=self.attempt,
                                           interval=cfg.heartbeat_interval)
            else:
                rid = previous or cfg.run_id or new_run_id()
            write_json(self.out / "run.json", {"run_id": rid, "name": cfg.name, "model": cfg.model,
                                               "attempt": self.attempt, "settings": settings})
        if self.dist.world > 1:
            box = [rid, self.attempt]
            torch.distributed.broadcast_object_list(box, src=0)
            rid, self.attempt = box
            self.check_shared_files(rid)
        self.run_id = rid

    def check_shared_files(self, rid: str, *, wait: float = 30.0) -> None:
        """Every rank sees the files rank 0 keeps, or the run stops here with one message on every rank.

        Rank 0 alone writes <out>/run.json, the checkpoints and, online, the exchange folder's RUN record
        and this side's step files; every rank reads the checkpoint on --resume and the peer's step files
        each step. A rank on a node that does not share those folders would train other weights or wait
        for files it never sees. Each rank waits up to ``wait`` s for run.json (and RUN) of run ``rid``
        (a network filesystem may show a new file late), then all compare that and their resume step."""
        need = [(self.out / "run.json", "--out")] + ([(self.exchange / "RUN", "--peer-exchange")]
                                                     if self.online else [])
        deadline = time.time() + wait
        while True:
            unseen = [(path, flag) for path, flag in need if (read_json(path) or {}).get("run_id") != rid]
            if not unseen or time.time() > deadline:
                break
            time.sleep(0.2)
        mine = "; ".join(f"{path} ({flag}) of run {rid} is not there" for path, flag in unseen)
        views = [None] * self.dist.world
        torch.distributed.all_gather_object(views, (socket.gethostname(), mine, self.start_step))
        problems = [f"rank {r} on {host}: {what}" for r, (host, what, _) in enumerate(views) if what]
        problems += [f"rank {r} on {host} resumes at step {step}, rank 0 at step {views[0][2]}"
                     for r, (host, _, step) in enumerate(views) if step != views[0][2]]
        if problems:
            raise SystemExit(f"side {self.cfg.name!r}: not every rank sees the files of rank 0 "
                             f"({views[0][0]}): " + "; ".join(problems) + ". --out and --peer-exchange must be "
                             f"on storage that every node of the side sees (a shared filesystem)")

    def leave_pair(self, error: BaseException) -> None:
        """On any failure: the FAILED marker for a waiting peer, and a last heartbeat saying so
        (not by a process that a relaunch of its side left behind: the marker is the new one's). A
        collective that failed because another process of this side is gone is said so, on every rank."""
        lost = lost_rank_message(error, self.cfg.name, self.dist.world)
        if lost:
            print(f"[graft] rank {self.dist.rank}: {lost}", file=sys.stderr, flush=True)
        if not (self.dist.main and self.online and self.heartbeat is not None):
            return
        import traceback
        try:  # on a full disk these writes fail too; the peer then sees the heartbeat go stale
            if not self.heartbeat.left_behind():
                # the lost-rank line last: the peer quotes the marker's tail
                write_failed(self.exchange, self.cfg.name, self.run_id,
                             f"{type(error).__name__}: {error}\n{traceback.format_exc()[-1500:]}{lost}",
                             attempt=self.attempt)
            self.heartbeat.stop("failed")
        except OSError as e:
            print(f"[graft] could not leave the FAILED marker for the peer: {e}")
        self.heartbeat = None

    def at_step(self, step: int) -> None:
        """The heartbeat's step (online, rank 0); stops a process that a relaunch of its side left behind."""
        if self.heartbeat is None:
            return
        self.heartbeat.step = step
        if self.heartbeat.left_behind():
            raise SystemExit(f"side {self.cfg.name!r} was relaunched (a newer process took part in a later attempt "
                             f"of run {self.run_id}); this process stops")

    def finish(self) -> None:
        """A clean finish: the heartbeat's last beat says so."""
        if self.heartbeat is not None:
            self.heartbeat.stop("finished")

    def resume_hint(self) -> str:
        latest = self.latest_checkpoint()
        where = f"the last good checkpoint is {latest}" if latest else "no checkpoint was written yet"
        return f"{where}; an advantage or log-prob out of range in a peer file, or too high a --lr?"

    def latest_checkpoint(self) -> Path | None:
        steps = sorted(self.ckpt_dir.glob("step_[0-9]*")) if self.ckpt_dir.is_dir() else []
        steps = [p for p in steps if (p / "trainer_state.pt").is_file()]
        return steps[-1] if steps else None

    def resume_checkpoint(self) -> tuple[Path | None, dict | None]:
        """--resume: the newest step checkpoint that loads, with its trainer state (its step becomes start_step);
        (None, None) when the run wrote none. A checkpoint that does not load (truncated or missing file, bad
        header) is reported by path and the previous one is taken; with none left that loads, it stops."""
        found = sorted(self.ckpt_dir.glob("step_[0-9]*")) if self.ckpt_dir.is_dir() else []
        broken = []
        for ckpt in reversed(found):
            problem = None if (ckpt / "config.json").is_file() else f"{ckpt / 'config.json'}: missing"
            problem = problem or check_weight_files(ckpt)
            state = None
            if problem is None:
                try:
                    state = torch.load(ckpt / "trainer_state.pt", map_location="cpu", weights_only=True)
                    state.setdefault("best_eval_mean", state.get("best_score"))  # older checkpoints' key resumes too
                    int(state["step"]), float(state["best_eval_mean"]), state["optimizer"]
                except Exception as e:  # missing, truncated or not a trainer state
                    problem = f"{ckpt / 'trainer_state.pt'}: does not load ({type(e).__name__}: {e})"
            if problem is None:
                self.start_step = int(state["step"])
                return ckpt, state
            broken.append(ckpt)
            if self.dist.main:
                print(f"--resume: {problem}; falling back to the previous checkpoint")
        if broken:
            tried = ", ".join(p.name for p in broken)
            raise SystemExit(f"--resume: no checkpoint in {self.ckpt_dir} loads (tried {tried}, each reported "
                             f"above); start over with --force, or restore one of them")
        return None, None

    def clean_partial_checkpoints(self) -> None:
        """Remove what a write cut short left in checkpoints/ (a .X.tmp folder can hold most of a model
        and keep a full disk full), and put back a .X.old that a kill left in place of X."""
        if not self.ckpt_dir.is_dir():
            return
        for p in self.ckpt_dir.glob(".*.old"):
            final = p.with_name(p.name[1:-len(".old")])
            if not final.exists():
                os.replace(p, final)
            else:
                shutil.rmtree(p, ignore_errors=True)
        for p in self.ckpt_dir.glob(".*.tmp"):
            print(f"removing the partial checkpoint {p}")
            shutil.rmtree(p, ignore_errors=True)

    def trim_metrics(self):
        """On resume, drop metric lines of steps that will be redone (the file stays one line per step)."""
        path = self.out / "metrics.jsonl"
        if not path.exists():
            return
        try:
            records = read_metrics(path)  # a line cut short by a kill is skipped: that step is redone anyway
        except ValueError as e:
            raise SystemExit(f"--resume: {e}; repair or delete the file") from None
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
        if len([x for x in lines if x.strip()]) > len(records):
            print(f"--resume: {path}:{len(lines)}: dropping a half-written last line")
        keep = [json.dumps(r) for r in records if r.get("step", 0) < self.start_step]  # as the trainer writes them
        atomic_write(path, lambda tmp: Path(tmp).write_text("".join(k + "\n" for k in keep)))

    def save_checkpoint(self, step: int, *, model, tok, opt: torch.optim.Optimizer, fsdp_root: torch.nn.Module | None,
                        state: dict, dest: Path | None = None):
        """save_pretrained (safetensors) + optimizer/step state, into a temp folder renamed into place.
        model, tok: the policy and its tokenizer; opt: its optimizer; fsdp_root: the FSDP2 root under --fsdp (every
        rank takes part in gathering the full state dicts; rank 0 writes them), else None; state: the trainer's
        own state to keep beside the step and the optimizer (best_eval_mean, baseline_state); dest: a folder other
        than checkpoints/step_<step> (the best evaluation's). A failed write (full disk, read-only folder) removes
        the temp folder and stops the run with the path and the OS error; the last complete checkpoint stays the
        one --resume takes."""
        model_state, opt_state = full_state_dicts(fsdp_root, opt) if fsdp_root is not None else (None, None)
        if not self.dist.main:
            return
        dest = dest or self.ckpt_dir / f"step_{step:06d}"
        tmp = dest.with_name(f".{dest.name}.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            model.save_pretrained(tmp, state_dict=model_state, safe_serialization=True)
            tok.save_pretrained(tmp)
            torch.save({"step": step, "optimizer": opt_state if opt_state is not None else opt.state_dict(), **state},
                       tmp / "trainer_state.pt")
        except Exception as e:
            shutil.rmtree(tmp, ignore_errors=True)
            latest = self.latest_checkpoint()
            raise SystemExit(f"checkpoint {dest}: writing {tmp} failed ({describe_write_error(e, self.ckpt_dir)}); "
                             f"the partial folder is removed and the last complete checkpoint is "
                             f"{latest or 'none yet'}: free space or fix the folder, then relaunch with "
                             f"--resume") from e
        old = dest.with_name(f".{dest.name}.old")
        if dest.exists():
            os.replace(dest, old)
        os.replace(tmp, dest)
        shutil.rmtree(old, ignore_errors=True)
        if dest.name.startswith("step_"):
            for stale in sorted(self.ckpt_dir.glob("step_[0-9]*"))[: -self.cfg.keep_checkpoints]:
                shutil.rmtree(stale, ignore_errors=True)
