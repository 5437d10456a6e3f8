"""The memory plan: what one trainer process needs on its card in each phase of a step, measured before
anything is allocated (README "Running the pair on a GPU node", docs/RESULTS.md "The memory plan").

Each side's model is built from its config (transformers' AutoConfig of --model, a config.json, or a shape
below for the paper's models when there is no network) under torch's FakeTensorMode: tensors carry shapes,
dtypes and storage sizes but no data, so a 3B model's step runs through the real code (sampler.py's
response_logprobs, torch's AdamW) without a byte of it allocated, and
torch.distributed._tools.mem_tracker.MemTracker records the peak and what held it (parameters, gradients,
optimizer state, activations). The phases, at the worst case the flags allow (every row at the longest
prompt + the cap):

    rollout      the state (weights, gradients and AdamW moments kept from the last step) + the sampler's bf16
                 copy of the Linear weights under autocast (sampler.py departure 17) + the prefill of the prompts
                 that fill --gen-batch-size slots (its activations and its own K/V) + the KV term: on the static
                 decode path (sampler.resolve_static: full-attention models on CUDA, every paper model) the pool of
                 runtime.kv_budget bytes, KV_BUDGET_SHARE of what the card has left at the sample() call, which
                 rows fill by their real lengths, with the rows in flight it holds at expected lengths and at the
                 worst case (departure 8); on the default path a dense cache of every slot at full length. Bytes per
                 token as the sampler really stores them (kv_bytes_per_token: sampler.sample run on a narrow model
                 of the same family, its cache read back; nothing computed from the config)
    logprob      the behaviour log-prob pass: --micro-batch-size rows, no grad
    update       one micro-batch: forward + backward (--gradient-checkpointing as set), then the AdamW step
                 (the kernel the trainer picks on a GPU: runtime.adamw_kernel)
    evaluation   Trainer.validate's sampling: the rollout's terms at the benchmarks' shapes, its own slots
                 (runtime.eval_rows: the rollout's on the static path) and precision
    fsdp         --fsdp: the state divided by the ranks plus the largest gathered unit

`graft.py plan` prints a table per side against the card (the device's memory, or --gpu-memory) and the
ranks, the rows in flight of the rollout and the evaluation, and the slot count for the launcher (launch_slots: the
most slots that fit, at most the rows the pool holds at expected lengths; run_pair.sh passes it as
--gen-batch-size); the trainer runs the same plan at start (check_at_start): on CUDA it refuses, before any weight is
loaded, a setting that cannot fit, naming the phase and the flag that fixes it; on CPU it prints the plan.

Departures and shortcuts (what the figures are and are not):
  1. Fake tensors live on the CPU here (a CPU build of torch cannot make fake CUDA tensors), so the step runs
     CPU kernels' shape rules and CPU bf16 autocast, which casts the same matmuls to bf16 as CUDA's. SDPA's
     CPU path is the flash kernel (O(T) memory), as CUDA's memory-efficient one; the caching allocator's
     fragmentation is not modelled (MARGIN keeps 5% of the card for it).
  2. The KV cache bytes per token come from the real sampler on real tensors (a model with the real layer
     count, KV heads and head size, and a tiny hidden size, MLP and vocabulary), under bf16 autocast for the
     rollout and under the precision Trainer.validate samples in for the evaluation (EVAL_AUTOCAST).
  3. The FSDP2 figures are the data-parallel measurement with the state divided by the ranks and the
     gathered units added (the root: embeddings, final norm, head; two decoder layers, the running one and
     the prefetched one; one layer's unsharded gradients); no process group is started.
  4. The prefill runs every prompt that fills the slots at once, each at the longest prompt: with --share-prefix
     (sampler.py departure 11) ceil(slots / n) + 1 distinct prompts (n = --rollouts; --eval-samples for the
     evaluation), else one per slot; its peak holds its own K/V (copied into the pool or the batch after it) and
     the activations of one layer, under autocast with its cast cache off (sample() serves the Linear weights from
     the bf16 copy, counted apart). Refills later prefill fewer: an upper bound for them.
  5. The update's micro-batch holds distinct prompts (no shared prefix), its rows all at the longest prompt +
     the cap, with the gradients of an earlier micro-batch already held: the worst micro-batch of a step.
  6. The update's loss is a masked sum of the log-probs, not core.policy_loss (which reads metrics back to the
     host: fake tensors have no values); its (B, T) temporaries are kilobytes beside the forward's.
  7. A model deeper than 8 layers is measured at its real width at 4 and 8 layers and extrapolated linearly to
     its depth (exact for a stack of alike layers: the state, the cache and the checkpointed inputs grow by
     layer, the transient of one layer does not); docs/RESULTS.md checks it against a full-depth measurement.
  8. The KV pool and its rows in flight. The budget is runtime.kv_budget's formula on the card: KV_BUDGET_SHARE x
     (card - the state - under --fsdp the gathered weights - the bf16 copy); the CUDA context is left to MARGIN.
     It is cut as the sampler cuts it (sampler.pool_plan, the same function): the slots, the pool's blocks of BLOCK
     tokens, and on the gathered path the K/V a decode step gathers for one layer's attention with transformers'
     copies (per slot, transient; none with the kernel, departure 9). A row holds its prompt + the tokens drawn +
     ROOM, so rows in flight = the pool's tokens // a row's, at most the slots: at expected lengths, the mean prompt
     (measured like the longest) + EXPECTED_RESPONSE (half) of the cap, an assumption (the paper states no mean
     response length), and at the worst case, the longest prompt + the cap. Whole blocks hold a little fewer rows,
     and a long-tailed rollout's rows in flight are mid-way through their lengths with the long ones
     over-represented, so the expected figure is a guide, the worst case a floor; the sampler preempts rows when the
     pool runs dry rather than overrun it. Without a card (no --gpu-memory, no CUDA) the pool is planned at the
     slots' worst case, what sample() reserves without a budget.
  9. The decode attention is planned as sample() takes it on the GPU (sampler.py departure 18, planned_attention):
     the paged kernel, which gathers nothing (pool_plan's copies = 0: the budget is all pool), for a model whose
     family it serves (sampler.paged_kernel_blocker) unless --decode-attention gather; else the gathered path
     (copies = sampler.transient_copies: 3 for Qwen3-1.7B, 5 for SmolLM3-3B). An assumption (KERNEL_ASSUMED): the
     GPU node has Triton (torch's CUDA wheels bring it on Linux) and the kernel's on-device self-check passes. If it
     fails, sample()'s "auto" gathers and re-cuts its own pool from the same budget: the budget is still respected,
     only the slots in flight are fewer than the launcher was given. The printed plan names the attention it assumed.

Launch lines:
    python graft.py plan --model HuggingFaceTB/SmolLM3-3B-Base,Qwen/Qwen3-1.7B-Base --gpu-memory 79.19 --ranks 4 \\
        --gradient-checkpointing --micro-batch-size 4 --gen-batch-size 8 --eval-every 5   (as run_pair.sh asks it)
    python -m bench.plan_check --model Qwen/Qwen3-1.7B-Base --prompt 2048   (the update against a full-depth run)
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from config import Config  # the train flags; plan.py adds none of its own
from runtime import KV_BUDGET_SHARE, adamw_kernel, encode_prompt, eval_rows  # the trainer's choices, where they live
from sampler import (cast_weights_once, paged_kernel_blocker, pool_plan, resolve_static, response_logprobs,  # the
                     sample, transient_copies)  # code measured, and its rules

GIB = 1024 ** 3
MARGIN = 0.95
"""A phase fits when it needs at most this share of the card (the rest: allocator fragmentation, CUDA context)."""
PLANNED_DEVICE = torch.device("cuda")
"""The device whose choices the plan follows (runtime.adamw_kernel: fused AdamW), wherever it runs."""
MISFIT = 3
"""`graft.py plan`'s exit status when a phase does not fit (run_pair.sh switches FSDP2 on by it)."""
EVAL_AUTOCAST = True
"""Trainer.validate samples under the trainer's autocast, as the rollouts (graft.py departure 6)."""
EXPECTED_RESPONSE = 0.5
"""The expected response length as a share of the cap, for the rows in flight a KV pool holds (departure 8): an
assumption, half the cap. The paper states no mean response length (its Table 3 gives the 4,096 cap only);
docs/RESULTS.md's GPU-hours assume 1,509 of 4,096 (30% at the cap, the rest ~400), 0.37 of the cap."""
ROOM = inspect.signature(sample).parameters["sync_every"].default
"""Columns a row holds past its tokens: sampler.sample's sync_every (departure 16: a row runs on until the host's
next read), its default read off the signature."""
BLOCK = inspect.signature(sample).parameters["block_size"].default
"""Tokens per block of the static path's KV pool: sampler.sample's block_size default (departure 8)."""
LAUNCH_ALIGN = 8
"""The launcher's slot count is rounded down to a multiple of this (one prompt's n = 8 copies)."""

# The paper's models, for a machine without network (their config.json files' shape fields, transformers 5).
KNOWN_SHAPES = {
    "HuggingFaceTB/SmolLM3-3B-Base": dict(
        model_type="smollm3", vocab_size=128256, hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
        num_attention_heads=16, num_key_value_heads=4, tie_word_embeddings=True, max_position_embeddings=65536),
    "Qwen/Qwen3-1.7B-Base": dict(
        model_type="qwen3", vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True,
        max_position_embeddings=32768),
    "OctoThinker/OctoThinker-3B-Hybrid-Base": dict(  # Llama-3.2-3B's shape
        model_type="llama", vocab_size=128256, hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
        num_attention_heads=24, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True,
        max_position_embeddings=131072),
}


# ------------------------------------------------------------------------------------------------
# 1. Shapes: a side's config, and the ids the plan feeds
# ------------------------------------------------------------------------------------------------


def model_config(model: str, *, trust_remote_code: bool = False):
    """(transformers config, where it came from) for --model: a folder, a config.json, a hub id (AutoConfig,
    from the cache or the network), else the paper's shape in KNOWN_SHAPES; anything else is an error."""
    from transformers import AutoConfig
    path = Path(model)
    if path.is_file():
        d = json.loads(path.read_text())
        return AutoConfig.for_model(d.pop("model_type"), **d), str(path)
    try:
        return AutoConfig.from_pretrained(model, trust_remote_code=trust_remote_code), model
    except Exception as e:  # offline, a missing folder, an unknown architecture
        if model in KNOWN_SHAPES:
            shape = dict(KNOWN_SHAPES[model])
            return AutoConfig.for_model(shape.pop("model_type"), **shape), f"plan.py KNOWN_SHAPES[{model!r}]"
        raise SystemExit(f"--model {model!r}: no config for the memory plan ({type(e).__name__}: {e}); give a "
                         f"folder with config.json, a config.json, or one of {', '.join(KNOWN_SHAPES)}") from e


def attention_shape(config) -> tuple[int, int, int]:
    """(layers, KV heads, head size) of a decoder config."""
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return config.num_hidden_layers, getattr(config, "num_key_value_heads", None) or heads, head_dim


def prompt_lengths(cfg: Config, files: list[str]) -> tuple[int, int, str]:
    """(longest, mean, how they were found): the tokens of the prompts in the JSONL files under --model's tokenizer and
    --prompt-template, each at most --max-prompt-tokens (the trainer refuses longer ones); --max-prompt-tokens for
    both when the tokenizer or a file is not at hand."""
    present = [f for f in files if Path(f).is_file()]
    if not present:
        return cfg.max_prompt_tokens, cfg.max_prompt_tokens, "--max-prompt-tokens"
    try:
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(cfg.model, trust_remote_code=cfg.trust_remote_code)
    except Exception:  # offline or no tokenizer in the folder
        return cfg.max_prompt_tokens, cfg.max_prompt_tokens, "--max-prompt-tokens (no tokenizer)"
    lengths = []
    for f in present:
        for line in Path(f).read_text().splitlines():
            if line.strip():
                problem = json.loads(line)["problem"]
                lengths.append(min(cfg.max_prompt_tokens, len(encode_prompt(problem, tok, template=cfg.prompt_template,
                                                                            chat=cfg.chat_template))))
    if not lengths:
        return cfg.max_prompt_tokens, cfg.max_prompt_tokens, "--max-prompt-tokens (empty files)"
    return max(lengths), round(sum(lengths) / len(lengths)), f"measured in {len(present)} file(s)"


# ------------------------------------------------------------------------------------------------
# 2. Measurements: the sampler's KV bytes per token (real tensors), the phases' peaks (fake tensors)
# ------------------------------------------------------------------------------------------------


def _cache_tensors(cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(K, V) per layer of a cache the sampler hands the model: transformers' DynamicCache (.layers) or any
    object holding .keys / .values lists (sampler.py's static slots)."""
    if hasattr(cache, "layers"):
        return [(lay.keys, lay.values) for lay in cache.layers
                if isinstance(getattr(lay, "keys", None), torch.Tensor) and lay.keys.numel()]
    keys, values = getattr(cache, "keys", None), getattr(cache, "values", None)
    if isinstance(keys, list) and isinstance(values, list):
        return [(k, v) for k, v in zip(keys, values) if isinstance(k, torch.Tensor)]
    return []


def kv_bytes_per_token(config, *, autocast: bool, static: bool | str = False,
                       dtype: torch.dtype = torch.float32) -> tuple[int, str]:
    """Bytes of KV cache per token that sampler.sample stores for this config, and their dtypes ("K float32,
    V bfloat16"): the sampler runs (2 prompts, 2 new tokens) on a random model with the config's layers, KV heads
    and head size but a hidden size of KV heads x head size, a 64-wide MLP and a 256-token vocabulary, under bf16
    autocast when `autocast`, weights in `dtype` as the trainer holds them (fp32; bf16 with --dtype bfloat16);
    every cache handed to the model is read."""
    from transformers import AutoModelForCausalLM
    layers, kv_heads, head_dim = attention_shape(config)
    narrow = config.to_dict()
    narrow.update(hidden_size=kv_heads * head_dim, num_attention_heads=kv_heads, intermediate_size=64,
                  vocab_size=256, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if "head_dim" in narrow:
        narrow["head_dim"] = head_dim
    mcfg = type(config).from_dict(narrow)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(mcfg, dtype=dtype)
    seen: dict = {"bytes": 0, "dtypes": set()}

    def hook(module, args, kwargs, out):
        kv = [t for layer in (_cache_tensors(c) for c in kwargs.values() if c is not None) for t in layer]
        if kv:
            seen["bytes"] = max(seen["bytes"], sum(k.element_size() * k.shape[1] * k.shape[-1]
                                                   + v.element_size() * v.shape[1] * v.shape[-1] for k, v in kv))
            seen["dtypes"] |= {("K", str(k.dtype).removeprefix("torch.")) for k, _ in kv}
            seen["dtypes"] |= {("V", str(v.dtype).removeprefix("torch.")) for _, v in kv}

    handle = model.get_decoder().register_forward_hook(hook, with_kwargs=True)
    amp = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    try:
        with amp:
            sample(model, [[3, 4, 5], [6, 7]], max_new_tokens=2, temperature=0.0, eos_token_id=2, static=static)
    finally:
        handle.remove()
    assert seen["bytes"], f"{type(model).__name__}: the sampler handed the model no cache that plan.py can read"
    dtypes = ", ".join(f"{kind} {'/'.join(sorted(d for k, d in seen['dtypes'] if k == kind))}" for kind in "KV")
    return seen["bytes"], dtypes


def _bucket(snapshot: dict) -> dict[str, int]:
    """MemTracker's snapshot of the one device -> {category: bytes} ('Parameter', 'Gradient', ..., 'Total')."""
    (dev_snap,) = snapshot.values() if snapshot else ({},)
    return {getattr(k, "value", k): int(v) for k, v in dev_snap.items()}


def _tracked(fn, *external) -> dict[str, int]:
    """Run fn under a MemTracker that knows `external` (modules, optimizers); the peak's breakdown."""
    from torch.distributed._tools.mem_tracker import MemTracker
    import warnings
    mt = MemTracker()
    mt.track_external(*external)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # its module-hierarchy warning on transformers' re-entered modules
        with mt:
            fn()
    return _bucket(mt.get_tracker_snapshot("peak"))


@dataclass
class Measured:
    """One side's measured terms (bytes, one rank, no sharding) at the plan's shapes."""
    params: int  # parameters as trained (fp32 master, or bf16 with --dtype bfloat16)
    layer_params: int  # the largest decoder layer's parameters
    root_params: int  # what is not in a decoder layer: embeddings, final norm, head
    grads: int
    opt_state: int  # AdamW's two moments
    logprob_act: int  # the behaviour pass's peak above the state
    update_act: int  # forward + backward's peak above the state (activations and temporaries)
    step_temp: int  # the AdamW step's temporaries above the state
    prefill_act: int  # the rollout's prefill (prefill_prompts prompts): peak above the state, its own K/V included
    eval_prefill_act: int  # the same at the evaluation's shapes and precision
    prefill_prompts: int  # prompts one prefill runs at most (departure 4)
    eval_prefill_prompts: int
    cast_copy: int  # the sampler's copy of the Linear weights cast once under autocast (rollout; 0 without autocast)
    eval_cast_copy: int  # the same in the evaluation's precision
    kv_token: int  # sampler's KV bytes per token under autocast (rollout)
    kv_dtypes: str
    eval_kv_token: int  # the same in the evaluation's precision
    eval_kv_dtypes: str
    paged: bool  # sample takes the static path, its KV a pool of kv_budget bytes (sampler.resolve_static on CUDA)
    layers: int  # decoder layers (a gathering static step gathers one layer's K/V at a time)
    kv_copies: int  # copies of one layer's gathered K/V a static step holds at once: 0 with the kernel (departure 9)
    attention: str  # the static path's decode attention planned: "kernel" or "gather" ("-" on the default path)
    attention_why: str  # why that one (planned_attention)
    seconds: float  # wall time of the measurement


def _ids(rows: int, length: int, vocab: int, first: int = 3) -> list[list[int]]:
    """rows distinct token-id lists of the given length (distinct first tokens: no prompt is shared)."""
    return [[(first + i) % vocab] + [5 % vocab] * (length - 1) for i in range(rows)]


def with_layers(config, layers: int):
    """config with only its first `layers` decoder layers (per-layer lists, e.g. layer_types, cut to match)."""
    d, old = config.to_dict(), config.num_hidden_layers
    for k, v in list(d.items()):
        if isinstance(v, list) and len(v) == old:
            d[k] = v[:layers]
    d["num_hidden_layers"] = layers
    return type(config).from_dict(d)


def prefill_prompts(rows: int, copies: int) -> int:
    """Prompts one prefill runs at most when `rows` slots are filled with prompts of `copies` copies each
    (--share-prefix: each distinct prompt prefilled once, sampler.py departure 11; the queue keeps a prompt's copies
    together, so a fill of the slots starts at most one prompt split over two refills): ceil(rows / copies) + 1,
    at most rows. copies 1: every row its own prefill."""
    return rows if copies <= 1 else min(rows, math.ceil(rows / copies) + 1)


KERNEL_ASSUMED = ("assumed on the GPU node: Triton present (torch's CUDA wheels bring it) and the kernel's on-device "
                  "self-check passing; else sample() gathers and re-cuts its pool from the same budget (fewer slots)")
"""Why the plan counts the paged decode kernel where the model's family can take it (departure 9)."""


def planned_attention(cfg: Config, config, *, paged: bool) -> tuple[str, str]:
    """(the static path's decode attention the plan counts, why): "kernel" (a decode step gathers no K/V) when
    --decode-attention is not gather and sampler.paged_kernel_blocker finds nothing against the model (KERNEL_ASSUMED:
    what sample()'s "auto" then does on the GPU), else "gather"; "-" on the default path (a dense cache, no pool).
    config: the model's (its attention implementation set). --decode-attention kernel for a model the kernel cannot
    serve raises, as sample() would at the first rollout."""
    if not paged:
        return "-", "the default decode path: a dense cache, the model's own attention"
    if cfg.decode_attention == "gather":
        return "gather", "--decode-attention gather"
    blocker = paged_kernel_blocker(config)
    if blocker is None:
        return "kernel", f"--decode-attention {cfg.decode_attention}, the model's family served; {KERNEL_ASSUMED}"
    if cfg.decode_attention == "kernel":
        raise SystemExit(f"--decode-attention kernel: the paged decode kernel cannot serve {cfg.model} ({blocker}); "
                         f"sample() would refuse it: use --decode-attention auto or gather")
    return "gather", f"the kernel cannot serve this model: {blocker}"


DEPTHS = (4, 8)
"""A deeper model is measured at these depths and extrapolated linearly in its layer count (departure 7)."""


def measure(config, cfg: Config, *, prompt_len: int, eval_prompt_len: int) -> Measured:
    """The phases of one side at the worst case of cfg's flags, on fake tensors (module docstring). A model of
    more than DEPTHS[-1] layers is measured at its width at both DEPTHS and extrapolated to its depth: every term
    is a + b x layers for a stack of alike layers (their pattern repeating within 4, as SmolLM3's RoPE-free
    layers do)."""
    t0 = time.time()
    layers = config.num_hidden_layers
    if layers <= DEPTHS[-1]:
        m = _measure_depth(config, cfg, prompt_len=prompt_len, eval_prompt_len=eval_prompt_len)
    else:
        lo, hi = (_measure_depth(with_layers(config, d), cfg, prompt_len=prompt_len, eval_prompt_len=eval_prompt_len)
                  for d in DEPTHS)
        scale = (layers - DEPTHS[0]) / (DEPTHS[1] - DEPTHS[0])
        m = dataclasses.replace(hi, **{f.name: round(getattr(lo, f.name) + scale * (getattr(hi, f.name)
                                                                                      - getattr(lo, f.name)))
                                       for f in dataclasses.fields(Measured) if f.type in ("int", int)})
    m.seconds = time.time() - t0
    return m


def _measure_depth(config, cfg: Config, *, prompt_len: int, eval_prompt_len: int) -> Measured:
    """measure() at the config's own depth."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from transformers import AutoModelForCausalLM, DynamicCache
    dtype = torch.bfloat16 if cfg.dtype == "bfloat16" else torch.float32
    kv_token, kv_dtypes = kv_bytes_per_token(config, autocast=cfg.dtype == "auto", static=cfg.static_decode,
                                             dtype=dtype)
    eval_kv, eval_dtypes = kv_bytes_per_token(config, autocast=cfg.dtype == "auto" and EVAL_AUTOCAST,
                                              static=cfg.static_decode, dtype=dtype) if cfg.eval_every else (0, "-")
    amp = (lambda on: torch.autocast("cpu", dtype=torch.bfloat16) if on else contextlib.nullcontext())
    vocab, cap = config.vocab_size, cfg.max_response_tokens
    with FakeTensorMode():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        if cfg.gradient_checkpointing:  # as runtime.load_policy sets it
            model.gradient_checkpointing_enable()
            model.config.use_cache = False
        kinds = set(getattr(model, "_no_split_modules", None) or [])
        layers = [m for m in model.modules() if type(m).__name__ in kinds]
        layer_params = max((sum(p.nbytes for p in m.parameters()) for m in layers), default=0)
        params = sum(p.nbytes for p in model.parameters())
        root_params = params - sum(sum(p.nbytes for p in m.parameters()) for m in layers)
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.999), weight_decay=cfg.weight_decay,
                                **adamw_kernel(PLANNED_DEVICE))  # the kernel the trainer picks on the GPU
        for p in model.parameters():  # the state of a run past its first step: moments and gradients exist
            p.grad = torch.zeros_like(p)
        opt.step()
        state = params + sum(p.grad.nbytes for p in model.parameters()) + sum(
            t.nbytes for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor) and t.dim())
        rows = cfg.micro_batch_size
        prompts, responses = _ids(rows, prompt_len, vocab), _ids(rows, cap, vocab, first=4)
        kw = dict(pad_token_id=0, temperature=cfg.temperature or 1.0, chunk_size=cfg.logprob_chunk,
                  share_prefix=cfg.share_prefix)

        def logprob_pass():
            model.eval()
            with torch.no_grad(), amp(cfg.dtype == "auto"):
                response_logprobs(model, prompts, responses, **kw)
            model.train()

        def forward_backward():
            with amp(cfg.dtype == "auto"):
                lp, mask = response_logprobs(model, prompts, responses, **kw)  # (B, T)
            # core.policy_loss reads its metrics back to the host, which fake tensors cannot; its (B, T) float
            # temporaries are kilobytes next to the forward, so a masked sum stands for it here (departure 6)
            (lp * mask).sum().backward()

        def optimizer_step():
            torch.nn.utils.clip_grad_norm_(list(model.parameters()), cfg.grad_clip)
            opt.step()

        def prefill(n_rows: int, length: int, autocast: bool):
            def run():  # its own cache is part of its peak: the rows' K/V before they join the batch or the pool
                model.eval()
                cache = DynamicCache(config=config)
                ids = torch.tensor(_ids(n_rows, length, vocab))  # (R, P)
                # autocast's cast cache off: sample() serves the Linear weights from their bf16 copy (counted apart, as
                # the bf16 sampling copy), where a cache that no_grad keeps would count a second copy; uncached, each
                # cast lives for its one matmul. no_grad: MemTracker's hooks cannot see inference tensors
                on = torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False) if autocast \
                    else contextlib.nullcontext()
                with torch.no_grad(), on:
                    model.get_decoder()(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=True,
                                        past_key_values=cache)
                model.train()
            return run

        # the decode path sample() takes on the GPU (the paged static path, or the dense default one)
        try:
            paged = bool(resolve_static(cfg.static_decode, model, PLANNED_DEVICE))
        except ValueError:  # --static-decode on for a model the static path cannot run: sample() refuses it
            paged = False
        attention, why = planned_attention(cfg, model.config, paged=paged)
        copies = 0 if attention == "kernel" else transient_copies(config)  # as sample() picks them
        slots, eval_slots = cfg.gen_batch_size, eval_rows(cfg, paged=paged)
        roll_prompts = prefill_prompts(slots, cfg.n if cfg.share_prefix else 1)
        eval_prompts = prefill_prompts(eval_slots, cfg.eval_samples if cfg.share_prefix else 1)

        # the bf16 copy sample() makes of the Linear weights under autocast (sampler.py departure 16), read from the
        # same context manager on the fake model (tied weights counted once)
        with amp(cfg.dtype == "auto"), cast_weights_once(model, torch.device("cpu")) as cast_copy:
            pass
        with amp(cfg.dtype == "auto" and EVAL_AUTOCAST), cast_weights_once(model, torch.device("cpu")) as eval_cast:
            pass
        model.train()
        logprob_peak = _tracked(logprob_pass, model, opt)["Total"]
        update_peak = _tracked(forward_backward, model, opt)["Total"]
        step_peak = _tracked(optimizer_step, model, opt)["Total"]
        roll = prefill(roll_prompts, prompt_len, cfg.dtype == "auto")
        roll_peak = _tracked(roll, model, opt)["Total"]
        ev = prefill(eval_prompts, eval_prompt_len, cfg.dtype == "auto" and EVAL_AUTOCAST)
        eval_peak = state
        if cfg.eval_every:  # Trainer.validate runs
            eval_peak = _tracked(ev, model, opt)["Total"]
    return Measured(params=params, layer_params=layer_params, root_params=root_params,
                    grads=params, opt_state=state - 2 * params, logprob_act=logprob_peak - state,
                    update_act=update_peak - state, step_temp=step_peak - state,
                    prefill_act=roll_peak - state, eval_prefill_act=eval_peak - state, prefill_prompts=roll_prompts,
                    eval_prefill_prompts=eval_prompts if cfg.eval_every else 0, paged=paged,
                    cast_copy=cast_copy, eval_cast_copy=eval_cast if cfg.eval_every else 0, kv_token=kv_token,
                    kv_dtypes=kv_dtypes, eval_kv_token=eval_kv, eval_kv_dtypes=eval_dtypes,
                    layers=config.num_hidden_layers, kv_copies=copies, attention=attention, attention_why=why,
                    seconds=0.0)


# ------------------------------------------------------------------------------------------------
# 3. The plan: phases per rank from the measured terms, the verdict, the table
# ------------------------------------------------------------------------------------------------


@dataclass
class Rows:
    """The rows in flight a phase's KV term holds (tokens of one row: prompt + response + ROOM)."""
    slots: int  # --gen-batch-size (sample's max_batch_size): rows in flight at most
    paged: bool  # a pool filled by real lengths (the static path), else a dense cache of slots x the longest row
    pool_tokens: int  # tokens the KV term holds
    expected_tokens: int  # a row at expected lengths: the mean prompt + EXPECTED_RESPONSE of the cap + ROOM
    worst_tokens: int  # a row at the worst case: the longest prompt + the cap + ROOM
    copies: int = 1  # rows per distinct prompt one prefill runs once (--rollouts or --eval-samples; 1 unshared)
    prefill_prompts: int = 1  # prompts the phase's prefill term was measured at (prefill_prompts(slots, copies))
    fit: int | None = None  # the slots the sampler would cut from the budget with no slot cap (sampler.pool_plan)
    budget: int | None = None  # the K/V budget (runtime.kv_budget) the pool and a step's gather were cut from
    attention: str = "gather"  # the static path's decode attention the cut assumed: "kernel" gathers nothing
    attention_why: str = ""  # why that one (planned_attention)

    @property
    def expected(self) -> int:
        """Rows in flight at expected lengths: the pool's tokens // a row's, at most the slots (dense: the slots)."""
        return min(self.slots, self.pool_tokens // self.expected_tokens) if self.paged else self.slots

    @property
    def worst(self) -> int:
        """Rows in flight when every row is at the longest prompt + the cap (dense: the slots, by construction)."""
        return min(self.slots, self.pool_tokens // self.worst_tokens) if self.paged else self.slots

    @property
    def pool_rows(self) -> int:
        """Rows at expected lengths the budget holds, whatever the slots (what the launcher's slot count aims at):
        the sampler's own cut (pool_plan with no slot cap, each slot paying its share of a step's gathered K/V) when
        planned from a budget, else the pool's tokens // a row's."""
        if not self.paged:
            return self.slots
        return self.fit if self.fit is not None else self.pool_tokens // self.expected_tokens


@dataclass
class Phase:
    name: str
    terms: dict[str, int]  # what holds memory in the phase, bytes per rank
    fix: str  # the flag that lowers the phase's dominant term
    rows: Rows | None = None  # rollout and evaluation: the rows in flight the KV term holds

    @property
    def total(self) -> int:
        return sum(self.terms.values())

    @property
    def dominant(self) -> str:
        return max(self.terms, key=self.terms.get)


def pool_bytes(card: int, held: int, cast_copy: int) -> int:
    """The KV pool the trainer gets (runtime.kv_budget): KV_BUDGET_SHARE of the card less what is held at the sample()
    call (the state, and under --fsdp the gathered weights) and the sampler's bf16 copy of the Linear weights."""
    return max(0, int(KV_BUDGET_SHARE * (card - held - cast_copy)))


def phases(m: Measured, cfg: Config, *, ranks: int, prompt_len: int, eval_prompt_len: int, card: int | None = None,
           mean_prompt: int | None = None, mean_eval_prompt: int | None = None) -> list[Phase]:
    """Each phase's terms per rank. With --fsdp the state is divided by the ranks, sampling and the behaviour
    pass hold a gathered full copy of the weights (runtime.gathered), the update the root and two layers.

    The rollout's and the evaluation's KV term: on the static path (m.paged) the pool of runtime.kv_budget bytes on
    this card (pool_bytes; without a card, the slots at the worst case, what sample() takes without a budget), its
    rows in flight at expected lengths (mean prompt + EXPECTED_RESPONSE of the cap) and at the worst case (longest
    prompt + cap), cut with a decode step's gathered K/V on the gathered path, none with the kernel (m.attention,
    departure 9); on the default path a dense cache of every slot at the worst case. prompt_len, eval_prompt_len:
    the longest prompts; mean_prompt, mean_eval_prompt: their means (default: the longest)."""
    r = ranks if cfg.fsdp else 1
    state = {"weights": m.params // r, "gradients": m.grads // r, "AdamW moments": m.opt_state // r}
    gathered = {"gathered weights": m.params} if cfg.fsdp else {}
    held = sum(state.values()) + sum(gathered.values())  # at the sample() call, before its copy and prefill
    cap, eval_cap = cfg.max_response_tokens, cfg.eval_max_tokens or cfg.max_response_tokens
    mean_prompt = prompt_len if mean_prompt is None else mean_prompt
    mean_eval_prompt = eval_prompt_len if mean_eval_prompt is None else mean_eval_prompt

    def kv(slots: int, longest: int, mean: int, cap: int, kv_token: int, copy: int, copies: int,
           prompts: int) -> tuple[dict, Rows]:
        worst_row, expected_row = longest + cap + ROOM, mean + math.ceil(EXPECTED_RESPONSE * cap) + ROOM
        budget = pool_bytes(card, held, copy) if card else None  # None: what sample() takes without a budget
        cut = (lambda s: pool_plan(slots=s, length=longest + cap, expected=expected_row, block_size=BLOCK,
                                   token_bytes=kv_token, layers=m.layers, budget=budget, copies=m.kv_copies))
        pp = cut(slots) if m.paged and kv_token else None
        if pp is None:  # the default path, or a budget without one full-length row (sample()'s "auto" falls back)
            pool = slots * (longest + cap) * kv_token
            return {"KV cache": pool}, Rows(slots=slots, paged=False, pool_tokens=pool // max(1, kv_token),
                                            expected_tokens=expected_row, worst_tokens=worst_row, copies=copies,
                                            prefill_prompts=prompts)
        # the sampler's own cut of the budget (sampler.pool_plan, departure 13): the pool of blocks and the K/V a
        # decode step gathers for one layer's attention with its copies, per slot, transient (0 with the kernel)
        gather = pp.slots * pp.copies * (pp.length * kv_token // m.layers)
        term = {"KV pool": (pp.blocks + 1) * BLOCK * kv_token, "K/V gathered by a decode step": gather}
        rows = Rows(slots=pp.slots, paged=True, pool_tokens=pp.blocks * BLOCK, expected_tokens=expected_row,
                    worst_tokens=worst_row, copies=copies, prefill_prompts=prompts,
                    fit=cut(1 << 40).slots if budget is not None else None, budget=budget, attention=m.attention,
                    attention_why=m.attention_why)
        return term, rows

    shared = cfg.share_prefix
    roll_kv, roll_rows = kv(cfg.gen_batch_size, prompt_len, mean_prompt, cap, m.kv_token, m.cast_copy,
                            cfg.n if shared else 1, m.prefill_prompts)
    eval_kv, eval_rows_ = kv(eval_rows(cfg, paged=m.paged), eval_prompt_len, mean_eval_prompt, eval_cap,
                             m.eval_kv_token, m.eval_cast_copy, cfg.eval_samples if shared else 1,
                             m.eval_prefill_prompts)  # Trainer.validate's slots
    units = {"gathered root + 2 layers + 1 layer's grads": m.root_params + 3 * m.layer_params} if cfg.fsdp else {}
    out = [
        Phase("rollout", state | gathered | {"bf16 sampling copy": m.cast_copy, "prefill": m.prefill_act} | roll_kv,
              "--gen-batch-size", roll_rows),
        Phase("logprob", state | gathered | {"activations": m.logprob_act}, "--micro-batch-size"),
        Phase("update", state | units | {"activations": m.update_act},
              "--micro-batch-size" if cfg.gradient_checkpointing else "--gradient-checkpointing"),
        Phase("optimizer step", state | {"AdamW temporaries": m.step_temp // r}, "--fsdp"),
        Phase("evaluation", state | gathered | {"bf16 sampling copy": m.eval_cast_copy, "prefill": m.eval_prefill_act}
              | eval_kv, "--gen-batch-size", eval_rows_),
    ]
    if cfg.fsdp:
        out.append(Phase("fsdp shard + gather", state | units, "--fsdp (more ranks)"))
    for ph in out:  # the state dominates, or the pool that takes a share of what the state leaves: sharding is the fix
        if ph.dominant in ("weights", "gradients", "AdamW moments", "AdamW temporaries", "KV pool") and not cfg.fsdp:
            ph.fix = "--fsdp"
    return out


def verdict(plan: list[Phase], card: int) -> Phase | None:
    """The first phase over MARGIN of the card, or None when every phase fits."""
    return next((ph for ph in plan if ph.total > MARGIN * card), None)


def refusal(side: str, plan: list[Phase], card: int) -> str | None:
    """The message that refuses a plan that cannot fit (None when it fits): the phase, its need, the flag."""
    ph = verdict(plan, card)
    if ph is None:
        return None
    return (f"the memory plan of {side} does not fit: phase '{ph.name}' needs {ph.total / GIB:.1f} GiB of "
            f"{card / GIB:.1f} GiB (over {MARGIN:.0%}; dominant: {ph.dominant} {ph.terms[ph.dominant] / GIB:.1f} "
            f"GiB). Fix: {ph.fix}" + (" (or a smaller --micro-batch-size)" if ph.fix == "--gradient-checkpointing"
                                      else "") + "; `python graft.py plan <the same flags>` prints every phase")


def rows_line(ph: Phase) -> str:
    """One line on the rows in flight of a rollout or evaluation phase (its Rows)."""
    r = ph.rows
    if not r.paged:
        return (f"{ph.name}: dense KV cache (the default decode path), {r.slots} rows in flight at "
                f"{r.worst_tokens - ROOM:,} tokens each")
    gathered = ("none: the kernel reads blocks in place" if r.attention == "kernel"
                else f"{ph.terms['K/V gathered by a decode step'] / GIB:.1f} GiB")
    return (f"{ph.name}: KV pool {ph.terms['KV pool'] / GIB:.1f} GiB = {r.pool_tokens:,} tokens; rows in flight at "
            f"expected lengths ({r.expected_tokens:,} tokens a row: mean prompt + {EXPECTED_RESPONSE:.0%} of the cap "
            f"+ {ROOM}) {r.expected} of {r.slots} slots (the budget holds {r.pool_rows} with no slot cap); K/V "
            f"gathered by a decode step: {gathered}; at the worst case ({r.worst_tokens:,}: longest prompt + cap + "
            f"{ROOM}) {r.worst}")


def table(side: str, plan: list[Phase], card: int | None, ranks: int, note: str,
          rows: tuple[int, int] | None = None) -> str:
    """The plan of one side as a Markdown table: phase, GiB, share of the card, dominant term, the fixing flag; the
    rows in flight of the rollout and the evaluation; rows = (--gen-batch-size, --micro-batch-size): also the
    largest micro-batch that fits and the slot count for the launcher (launch_slots)."""
    head = f"{side}: {note}; card {'unknown (give --gpu-memory)' if not card else f'{card / GIB:.1f} GiB'}, " \
           f"{ranks} rank(s)"
    lines = [head, "", "| phase | GiB | of card | dominant term | flag that lowers it |", "|---|---|---|---|---|"]
    for ph in plan:
        share = f"{ph.total / card:.0%}" + (" OVER" if ph.total > MARGIN * card else "") if card else "-"
        lines.append(f"| {ph.name} | {ph.total / GIB:.1f} | {share} | {ph.dominant} "
                     f"{ph.terms[ph.dominant] / GIB:.1f} | {ph.fix} |")
    paged = next((ph.rows for ph in plan if ph.rows is not None and ph.rows.paged), None)
    lines += [""] + ([f"decode attention planned: {paged.attention} ({paged.attention_why})"] if paged else [])
    lines += [rows_line(ph) for ph in plan if ph.rows is not None]
    if card and rows:
        mb = largest_fit(plan, card, rows=rows[1], phase_names=("update", "logprob"), per_row_terms=("activations",))
        lines += [f"largest --micro-batch-size that fits (activations taken as linear in the rows): {mb}",
                  f"{LAUNCH_LINE} {launch_slots(plan, card, rows=rows[0])}"]
    return "\n".join(lines)


LAUNCH_LINE = "slots for the launcher: --gen-batch-size"
"""The line of `graft.py plan` that run_pair.sh reads its --gen-batch-size from (the number after it)."""


def at_slots(ph: Phase, slots: int, planned: int) -> int:
    """A rollout or evaluation phase's bytes with the rollout's --gen-batch-size at `slots` instead of `planned`: the
    phase's own slots scaled alike, its prefill in proportion to the prompts one prefill runs (prefill_prompts), a
    dense KV cache in proportion to the slots; a pool cut from a budget at its whole budget (more slots take more
    of it, as blocks and gathers, never more than all of it: sampler.pool_plan)."""
    r = ph.rows
    own = max(1, r.slots * slots // planned)
    prefill = ph.terms.get("prefill", 0)
    total = ph.total - prefill + prefill * prefill_prompts(own, r.copies) / max(1, r.prefill_prompts)
    if not r.paged:
        total += ph.terms["KV cache"] * (own / r.slots - 1)
    elif r.budget is not None:
        total += r.budget - sum(ph.terms[k] for k in ("KV pool", "K/V gathered by a decode step"))
    return int(total)


def launch_slots(plan: list[Phase], card: int, *, rows: int) -> int:
    """The slot count (--gen-batch-size) for this card: the most slots at which the rollout and the evaluation fit
    MARGIN of the card (at_slots, from the phases planned at `rows` = --gen-batch-size), on the static path at most
    the rows at expected lengths the rollout's pool holds (Rows.pool_rows: more slots would only wait for blocks);
    rounded down to a multiple of LAUNCH_ALIGN when above it; 0 when not one row fits."""
    roll = next(ph for ph in plan if ph.name == "rollout")
    sampled = [ph for ph in plan if ph.rows is not None]
    most = roll.rows.pool_rows if roll.rows.paged else max(rows, 4096)
    slots = next((s for s in range(most, 0, -1) if all(at_slots(ph, s, rows) <= MARGIN * card for ph in sampled)), 0)
    return slots // LAUNCH_ALIGN * LAUNCH_ALIGN if slots >= LAUNCH_ALIGN else slots


def largest_fit(plan: list[Phase], card: int, *, rows: int, phase_names: tuple[str, ...],
                per_row_terms: tuple[str, ...]) -> int:
    """The most rows at which every named phase fits MARGIN of the card, the named terms taken as linear in the
    rows (the prefill and a dense KV cache in --gen-batch-size, activations in --micro-batch-size); 0 = none."""
    most = None
    for ph in plan:
        if ph.name not in phase_names:
            continue
        per_row = sum(v for k, v in ph.terms.items() if k in per_row_terms) / rows
        fixed = ph.total - per_row * rows
        fit = int((MARGIN * card - fixed) // per_row) if per_row > 0 else rows
        most = fit if most is None else min(most, fit)
    return max(0, most or 0)


def card_bytes(cfg: Config, device: torch.device | None = None) -> int | None:
    """The card's memory: --gpu-memory GiB when given, else the CUDA device's total, else None (unknown)."""
    if cfg.gpu_memory:
        return int(cfg.gpu_memory * GIB)
    if device is not None and device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return None


def plan_side(cfg: Config, *, ranks: int, eval_files: list[str], card: int | None = None) -> tuple[list[Phase], str]:
    """(phases, a one-line note on how the shapes were found) for cfg.model at cfg's flags on a card of `card` bytes
    (None: unknown; the KV pool is then planned at the slots' worst case). eval_files: the benchmark JSONL files
    Trainer.validate samples (the evaluation phase is planned when --eval-every is set)."""
    config, source = model_config(cfg.model, trust_remote_code=cfg.trust_remote_code)
    prompt_len, mean_prompt, how = prompt_lengths(cfg, [cfg.prompts])
    eval_len, mean_eval, eval_how = prompt_lengths(cfg, eval_files) if cfg.eval_every else (0, 0, "")
    m = measure(config, cfg, prompt_len=prompt_len, eval_prompt_len=max(eval_len, 1))
    plan = phases(m, cfg, ranks=ranks, prompt_len=prompt_len, eval_prompt_len=eval_len, card=card,
                  mean_prompt=mean_prompt, mean_eval_prompt=mean_eval)
    if not cfg.eval_every:
        plan = [ph for ph in plan if ph.name != "evaluation"]
    layers, kv_heads, head_dim = attention_shape(config)
    path = "static path, a KV pool" if m.paged else "default path, a dense KV cache"
    note = (f"config {source} ({m.params / GIB:.1f} GiB of {'bf16' if cfg.dtype == 'bfloat16' else 'fp32'} "
            f"weights, {layers} layers x {kv_heads} KV heads x {head_dim}); prompts: longest {prompt_len}, mean "
            f"{mean_prompt} tokens ({how}) + cap {cfg.max_response_tokens}; decode on the GPU: {path}; KV "
            f"{m.kv_token / 1024:.0f} KiB/token ({m.kv_dtypes}), {cfg.gen_batch_size} slots, prefill of "
            f"{m.prefill_prompts} prompt(s)" + (f"; evaluation: prompts longest {eval_len}, mean {mean_eval} "
                                                f"({eval_how}), KV {m.eval_kv_token / 1024:.0f} KiB/token "
                                                f"({m.eval_kv_dtypes}), {eval_rows(cfg, paged=m.paged)} slots"
                                                if cfg.eval_every else "")
            + f"; micro-batch {cfg.micro_batch_size} rows, checkpointing "
            f"{'on' if cfg.gradient_checkpointing else 'off'}, fsdp {'on' if cfg.fsdp else 'off'}; measured on fake "
            f"tensors in {m.seconds:.0f} s")
    return plan, note


def benchmark_paths(cfg: Config, benchmark_files) -> list[str]:
    """The benchmark files Trainer.validate samples (none without --eval-every; none when not prepared yet: the
    evaluation is then planned at --max-prompt-tokens). benchmark_files: graft.benchmark_files."""
    if not cfg.eval_every or benchmark_files is None:
        return []
    try:
        return [str(p) for p in benchmark_files(cfg.benchmarks, cfg.data_dir).values()]
    except SystemExit:  # a missing benchmark file: Trainer.validate names it when it runs
        return []


def check_at_start(cfg: Config, dist, benchmark_files=None) -> list[Phase]:
    """The trainer's start-of-run check (--memory-plan), before any weight is loaded: the plan of cfg.model at
    dist.world ranks (dist: runtime.DistInfo, or any object with world, device and main). cuda: planned on a CUDA
    device only; always: on the CPU too. A plan that cannot fit the card (the device's, or --gpu-memory when given:
    then also on the CPU) raises SystemExit naming the phase and the flag that fixes it; otherwise it is printed.
    Returns the phases ([] when not planned). benchmark_files: graft.benchmark_files (passed in: plan.py does not
    import graft.py, which imports it)."""
    if cfg.memory_plan == "off" or (cfg.memory_plan == "cuda" and dist.device.type != "cuda"):
        return []
    card = card_bytes(cfg, dist.device)
    plan, note = plan_side(cfg, ranks=dist.world, eval_files=benchmark_paths(cfg, benchmark_files), card=card)
    if dist.main:
        print(table(f"[plan] side {cfg.name!r} {cfg.model}", plan, card, dist.world, note,
                    rows=(cfg.gen_batch_size, cfg.micro_batch_size)), flush=True)
    message = refusal(cfg.model, plan, card) if card else None
    if message and (dist.device.type == "cuda" or cfg.gpu_memory):
        raise SystemExit(f"graft.py train: {message}")
    return plan


# ------------------------------------------------------------------------------------------------
# 4. CLI: python graft.py plan <train flags> (--model a,b for both sides of a pair)
# ------------------------------------------------------------------------------------------------


def run_plan(base: Config, *, benchmark_files=None) -> int:
    """`graft.py plan` (config.build_parser's train flags): one table per side of --model (comma-separated) at
    --ranks, ending, when the card is known, with LAUNCH_LINE and the side's slot count (run_pair.sh reads it);
    returns MISFIT (3) when a phase does not fit the card (--gpu-memory or the device's) at these flags, else 0.
    benchmark_files: graft.benchmark_files (passed in: plan.py does not import graft.py, which imports it)."""
    models = [m for m in base.model.split(",") if m]
    ranks = base.ranks or 1
    device = torch.device("cuda") if torch.cuda.is_available() else None
    files = benchmark_paths(base, benchmark_files)
    worst = 0
    for model in models:
        cfg = dataclasses.replace(base, model=model)
        card = card_bytes(cfg, device)
        plan, note = plan_side(cfg, ranks=ranks, eval_files=files, card=card)
        print(table(model, plan, card, ranks, note, rows=(cfg.gen_batch_size, cfg.micro_batch_size)) + "\n",
              flush=True)
        message = refusal(model, plan, card) if card else None
        if message:
            print(message + "\n", flush=True)
            worst = MISFIT
    return worst
