"""Runtime plumbing under the GRAFT trainer: ranks and devices, precision, model and prompt loading.

None of this is the method; graft.py imports it so that the trainer reads as the GRAFT step. Each
function takes the trainer's Config (any object with the named attributes) and imports nothing of
ours but data/prepare.py's prompt reader.

    setup_distributed   torchrun's RANK / WORLD_SIZE -> process group (NCCL on GPU, gloo on CPU)
    gather_lists, shard, unshard   split a list over ranks and put the gathered parts back in order
    compute_context     bf16 autocast on GPU with --dtype auto (graft.py departure 6)
    load_policy         a transformers causal LM + tokenizer + the ids that stop a rollout
    encode_prompt       the prompt's ids: raw text (graft.py departure 8) or the chat template
    load_prompt_file    a validated prompt JSONL
    timed               adds a block's wall time to a dict of timings
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass
class DistInfo:
    rank: int = 0
    world: int = 1
    device: torch.device = torch.device("cpu")

    @property
    def main(self) -> bool:
        return self.rank == 0


def setup_distributed(cfg: Config) -> DistInfo:
    """torchrun sets RANK/WORLD_SIZE: one process per GPU (NCCL) or per CPU worker (gloo)."""
    use_cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if world > 1 and not torch.distributed.is_initialized():
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
    try:
        tok = AutoTokenizer.from_pretrained(path, trust_remote_code=cfg.trust_remote_code)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, trust_remote_code=cfg.trust_remote_code)
    except (OSError, ValueError, KeyError) as e:  # missing files, unknown architecture, broken tokenizer
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


def load_prompt_file(path: str) -> list[dict]:
    """Validated prompt JSONL via data/prepare.py's load_prompts (loaded by path: data/ is no package)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("graft_data_prepare", Path(__file__).parent / "data" / "prepare.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    if not Path(path).is_file():
        raise SystemExit(f"--prompts {path!r}: no such file (python data/prepare.py writes data/math_train.jsonl)")
    try:
        return mod.load_prompts(path)
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
