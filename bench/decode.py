"""The host's share of one decode step: ms, aten ops, weight casts and host reads per step, on CPU.

What this measures
------------------
A GPU decode step of a small model is bound by what the host dispatches, not by the card: every aten op is a
kernel launch the GPU waits for, every weight cast a kernel and a pass over the weight, every device-to-host read
a stall of the whole queue. On a CPU with a model at real depth but toy width the compute is negligible, so the
time per step is the host's share and the op count is the launch count. The ways to run the same greedy decode:

* ``sampler, before``: ``sample(static="off", cast_once=False, sync_every=1)``, the sampler's old settings
  (before departures 16 and 17): autocast re-casts every float32 Linear weight on every step (under
  ``torch.inference_mode`` it caches nothing) and the host reads the finished rows every step;
* ``sampler, default path``: ``sample(static="off")``: weights cast once per call (sampler.py departure 17),
  ended rows read every 8 steps (departure 16);
* ``sampler, static path``: ``sample(static="on")``: the fixed-shape step that CUDA captures as a graph (departure
  10), run eagerly here (a CPU has no graph): its op count is what one graph replay stands for on a GPU. Its KV
  cache is the paged pool (each step writes through a block table and gathers every slot's first W columns);
* ``sampler, dense static (--baseline)``: with ``--baseline OLD/sampler.py``, the static path of that copy (e.g.
  the dense per-slot cache before the paged pool: ``git show 990c5a5:sampler.py``), side by side in the same run;
* ``generate``: transformers' greedy ``generate`` on the same model under the same autocast.

Per step = (run with N2 new tokens - run with N1) / (N2 - N1), so the prefill and the fixed costs cancel. For the
static path the ops are also counted with the step's captured body left out (``captured_paused``): what the host
still dispatches per step when CUDA replays that body as one graph. Ops and
casts are counted by a ``TorchDispatchMode`` (below autocast, so its casts are seen); a weight cast is a ``to`` /
``_to_copy`` whose input is a Linear weight's storage. Host reads: the sampler's own count (``stats["host_reads"]``,
each one device-to-host copy on a GPU) and, for ``generate``, the ops that read a scalar back
(``_local_scalar_dense``, ``is_nonzero``: each a sync on a GPU). Times are medians of interleaved repeats.

Departures: the model is a random Qwen3 at Qwen3-1.7B's depth (28 layers) and toy width (hidden 64, 4 heads, 2
KV heads, MLP 128, vocabulary 2,048), float32 weights under CPU bf16 autocast (the trainer's regime on a GPU); on
a GPU the width adds compute that overlaps with the host's dispatch. The greedy tokens of every arm are compared
with generate's, and ``parity`` compares the static and default paths in float32 and under autocast, and (the
bf16 tolerance row) on a bf16 copy of the model the sampler's log-probs against a plain forward and the behaviour
log-prob pass against the update pass.

Rows in flight at a byte budget (``--only budget``): the static path's K/V memory is ``max_cache_bytes``; a dense
static cache (``--baseline`` a copy with one) reserves L = prompt + cap columns per slot, so it runs budget // (L x
bytes per token) rows whatever their lengths; the paged pool holds rows by their real lengths. Both run the same
long-tailed rollout (T = 1, EOS ids chosen so that about 30% of rows reach the cap and the rest end early,
geometrically): the dense count is run as that many slots with full-length room each (the same schedule as the dense
cache), the paged one at the budget with max_batch_size = rows; printed: rows in flight (mean, peak), the slots a
step runs and the K/V columns its attention reads (dense: S x L every step; paged: R x W of its buckets, mean per
step; on a GPU the attention's bytes scale with these, times about 3 for the paged gather: sampler.py departure 10)
beside the running rows' real columns (what the paged kernel of departure 18 reads, once each),
decode steps, preemptions, and whether the tokens are identical (departure 7 makes them so).

Launch: ``OMP_NUM_THREADS=1 python -m bench.decode [--quick] [--rows 32] [--layers 28] [--only step|parity|budget]
[--baseline OLD/sampler.py]`` (docs/RESULTS.md, "Decoding on a GPU", has the figures and the machine).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import statistics
import sys
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM, Qwen3Config

import sampler
from sampler import sample

# ------------------------------------------------------------------------------------------------
# The model and the counters
# ------------------------------------------------------------------------------------------------


def toy_model(layers: int = 28, *, vocab: int = 2048, seed: int = 0, attn: str = "sdpa"):
    """A random Qwen3 at real depth and toy width (float32 weights), in eval mode."""
    cfg = Qwen3Config(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
                      tie_word_embeddings=False, pad_token_id=0, bos_token_id=None, eos_token_id=None)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation=attn).eval()


_READS = ("_local_scalar_dense", "is_nonzero", "item")


class OpCounter(TorchDispatchMode):
    """Counts aten ops, casts of the given weights (``to`` / ``_to_copy`` of their storage) and scalar reads."""

    def __init__(self, weights=()):
        super().__init__()
        self.ptrs = {w.data_ptr() for w in weights}
        self.ops = self.casts = self.reads = 0
        self.paused = False  # set while a CUDA graph's body runs (captured_ops): not dispatched by the host there

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.paused:
            return func(*args, **(kwargs or {}))
        self.ops += 1
        packet = func.overloadpacket
        if packet in (torch.ops.aten._to_copy, torch.ops.aten.to) and isinstance(args[0], torch.Tensor) \
                and args[0].data_ptr() in self.ptrs:
            self.casts += 1
        if packet.__name__ in _READS:
            self.reads += 1
        return func(*args, **(kwargs or {}))


def linear_weights(model) -> list[torch.Tensor]:
    return [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]


# ------------------------------------------------------------------------------------------------
# Log-prob references (bench/gpu.py's sampler rows use them too)
# ------------------------------------------------------------------------------------------------


def teacher_forced(model, prompts, rolls, device, chunk: int = 8) -> torch.Tensor:
    """|sampler log-prob - plain forward log-prob| of every sampled token: the model's own forward (full logits,
    log_softmax) on prompt + the sampler's tokens, right-padded in chunks of rows. -> (N,) float32."""
    diffs = []
    with torch.no_grad():
        for i in range(0, len(prompts), chunk):
            ps, rs = prompts[i: i + chunk], rolls[i: i + chunk]
            width = max(len(p) + len(r.tokens) for p, r in zip(ps, rs))
            ids = torch.zeros(len(ps), width, dtype=torch.long)
            att = torch.zeros_like(ids)
            for j, (p, r) in enumerate(zip(ps, rs)):
                seq = p + r.tokens
                ids[j, : len(seq)], att[j, : len(seq)] = torch.tensor(seq), 1
            logp = torch.log_softmax(model(input_ids=ids.to(device), attention_mask=att.to(device)).logits.float(),
                                     dim=-1)  # (b, W, V)
            for j, (p, r) in enumerate(zip(ps, rs)):
                pos = torch.arange(len(p) - 1, len(p) + len(r.tokens) - 1, device=device)  # predicting each token
                ref = logp[j, pos, torch.tensor(r.tokens, device=device)]  # (len(r),)
                diffs.append((ref.cpu() - r.logprobs).abs())
    return torch.cat(diffs)


def trainer_passes(model, prompts, rolls, device, *, behaviour_rows: int = 16,
                   update_rows: int = 4) -> torch.Tensor:
    """|behaviour log-prob - update log-prob| of every sampled token: what the trainer consumes (graft.py's
    departure 7 recomputes the behaviour log-probs with a fresh forward; the sampler's own are never used in the
    loss). The behaviour pass runs as Trainer.rollout runs it (no grad, micro-batches of --micro-batch-size 16 cut
    by batches_by_length), the update pass as the loss does (grad enabled, micro-batches of the launcher's 4 in
    rollout order). -> (N,) float32."""
    from sampler import batches_by_length, response_logprobs
    responses = [r.tokens for r in rolls]
    pad = 0

    def pass_(cuts, grad: bool) -> list[torch.Tensor]:
        out: list = [None] * len(prompts)
        with torch.set_grad_enabled(grad):
            for idx in cuts:
                lp, mask = response_logprobs(model, [prompts[i] for i in idx], [responses[i] for i in idx],
                                             pad_token_id=pad)  # (b, T)
                for j, i in enumerate(idx):
                    out[i] = lp[j, : int(mask[j].sum())].detach().float().cpu()
        return out

    behaviour = pass_(batches_by_length(prompts, responses, behaviour_rows), grad=False)
    update = pass_([list(range(i, min(i + update_rows, len(prompts)))) for i in range(0, len(prompts), update_rows)],
                   grad=True)
    return torch.cat([(a - b).abs() for a, b in zip(behaviour, update)])


# ------------------------------------------------------------------------------------------------
# The four ways to decode
# ------------------------------------------------------------------------------------------------


def load_baseline(path: str):
    """Another copy of sampler.py (e.g. before a change), imported under its own name."""
    spec = importlib.util.spec_from_file_location("sampler_baseline", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def arms(model, prompts: list[list[int]], baseline=None) -> dict:
    """name -> (fn(new_tokens) -> (token lists, host reads counted by the sampler or None), the sampler module
    whose static step it runs, or None)."""
    never = model.config.vocab_size  # an id outside the vocabulary: no row stops before the cap

    def ours(module=sampler, **kw):
        def run(new):
            stats = {}
            out = module.sample(model, prompts, max_new_tokens=new, temperature=0.0, eos_token_id=never,
                                stats=stats, **kw)
            return [o.tokens for o in out], stats["host_reads"]
        return run

    def generate(new):
        width = max(map(len, prompts))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])  # (B, P) left-padded
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])  # (B, P)
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                                 do_sample=False, pad_token_id=0, eos_token_id=None)
        return out[:, width:].tolist(), None

    out = {
        "sampler, before (cast per step, read every step)": (ours(static="off", cast_once=False, sync_every=1), None),
        "sampler, default path": (ours(static="off"), None),
        "sampler, static path, paged (eager on CPU)": (ours(static="on"), sampler),
    }
    if baseline is not None:
        out["sampler, dense static (--baseline, eager on CPU)"] = (ours(baseline, static="on"), baseline)
    out["generate"] = (generate, None)
    return out


@contextlib.contextmanager
def captured_paused(counter: OpCounter, module):
    """While the static step's captured body (module._StaticStep._captured: the draw and the forward) runs, the
    counter counts nothing: what it still counts is what the host dispatches per step around a graph replay."""
    real = module._StaticStep._captured

    def body(self):
        counter.paused = True
        try:
            return real(self)
        finally:
            counter.paused = False

    module._StaticStep._captured = body
    try:
        yield
    finally:
        module._StaticStep._captured = real


def per_step(model, prompts, *, short: int, long: int, repeats: int, baseline=None) -> dict[str, dict]:
    """Per decode step of each arm under bf16 autocast: ms (median of interleaved repeats), aten ops, weight
    casts, host reads; and each arm's tokens at `long`. Each call runs in its own autocast block, as the trainer
    enters one per rollout (autocast's cast cache, which generate's no_grad can use and the sampler's
    inference_mode cannot, lasts one block)."""
    weights = linear_weights(model)
    runs = arms(model, prompts, baseline)

    def call(name: str, new: int):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return runs[name][0](new)

    out = {}
    for name in runs:
        module = runs[name][1]
        if module is not None:  # also: the ops left on the host once the step is a graph replay (CUDA)
            with OpCounter(weights) as c, captured_paused(c, module):
                call(name, long)
                n_long = c.ops
            with OpCounter(weights) as c, captured_paused(c, module):
                call(name, short)
                host_only = (n_long - c.ops) / (long - short)
        counts = {}
        for new in (short, long):
            with OpCounter(weights) as c:
                tokens, reads = call(name, new)
            counts[new] = (c.ops, c.casts, reads if reads is not None else c.reads)
        d = long - short
        out[name] = dict(ops=(counts[long][0] - counts[short][0]) / d, casts=(counts[long][1] - counts[short][1]) / d,
                         reads=(counts[long][2] - counts[short][2]) / d, tokens=tokens, ms=[])
        if module is not None:
            out[name]["host_ops_with_graph"] = host_only
    for rep in range(repeats):
        for name in (list(runs) if rep % 2 == 0 else list(runs)[::-1]):  # interleaved, the order alternating
            t = {}
            for new in (short, long):
                t0 = time.perf_counter()
                call(name, new)
                t[new] = time.perf_counter() - t0
            out[name]["ms"].append(1000 * (t[long] - t[short]) / (long - short))
    return out


def parity(model, prompts, *, new: int) -> dict:
    """The static and default paths' greedy tokens, float32 (must be identical) and under bf16 autocast (round-off
    of the static step's attention over W masked columns may flip a near tie); and, on a bf16 copy of the model (the
    bf16 tolerance row): the sampler's log-probs against a plain forward (what bench.gpu used to check) and the
    behaviour pass against the update pass (what the trainer's ratio compares), mean |d logp| in nats."""
    never = model.config.vocab_size
    out = {}
    for amp in (False, True):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
            toks = {st: [o.tokens for o in sample(model, prompts, max_new_tokens=new, temperature=0.0,
                                                  eos_token_id=never, static=st)] for st in ("off", "on")}
        same = sum(a == b for a, b in zip(toks["on"], toks["off"]))
        out["bf16 autocast" if amp else "float32"] = f"{same}/{len(prompts)} rows identical"
    m16 = toy_model(model.config.num_hidden_layers, vocab=model.config.vocab_size).to(torch.bfloat16)
    m16.load_state_dict({k: v.to(torch.bfloat16) for k, v in model.state_dict().items()})
    rolls = sample(m16, prompts, max_new_tokens=new, temperature=1.0, eos_token_id=never,
                   generator=torch.Generator().manual_seed(0))
    out["bf16 weights: sampler vs plain forward, mean |d logp|"] = round(float(
        teacher_forced(m16, prompts, rolls, torch.device("cpu")).mean()), 4)
    out["bf16 weights: behaviour vs update pass, mean |d logp|"] = float(
        f"{float(trainer_passes(m16, prompts, rolls, torch.device('cpu')).mean()):.2e}")
    return out


# ------------------------------------------------------------------------------------------------
# Rows in flight at a byte budget: the dense static cache's count against the paged pool's
# ------------------------------------------------------------------------------------------------


def long_tailed(model, *, n_rows: int, cap: int, at_cap: float = 0.3, seed: int = 0):
    """Prompts (16-64 tokens) and EOS ids for a long-tailed T = 1 rollout: the model's next-token distribution is
    near uniform at toy width, so k EOS ids end a row at each step with chance ~k / V; k is set so that a row
    survives `cap` steps with chance `at_cap` (the rest end early, geometrically). -> (prompts, eos ids)."""
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, vocab, (int(n),), generator=g).tolist()
               for n in torch.randint(16, 65, (n_rows,), generator=g)]
    k = max(1, round((1 - at_cap ** (1 / cap)) * vocab))
    return prompts, list(range(vocab - k, vocab))


def budget_rows(model, *, n_rows: int, cap: int, dense_slots: int, block_size: int = 16) -> list[dict]:
    """The same long-tailed rollout (float32, T = 1) under the budget that the dense static cache needed for
    `dense_slots` slots (dense_slots x L x bytes per token): run with that many full-length slots (the dense cache's
    schedule), and on the paged pool at that budget with max_batch_size = n_rows. One dict per run."""
    prompts, eos = long_tailed(model, n_rows=n_rows, cap=cap)
    length = max(map(len, prompts)) + cap
    budget = dense_slots * length * sampler._kv_token_bytes(model, None)
    out = []
    for name, kw in ((f"dense static: {dense_slots} slots x L = {length} columns", dict(max_batch_size=dense_slots)),
                     ("paged static pool", dict(max_batch_size=n_rows, max_cache_bytes=budget))):
        stats = {}
        t0 = time.perf_counter()
        rolls = sample(model, prompts, max_new_tokens=cap, temperature=1.0, eos_token_id=eos, static="on",
                       block_size=block_size, generator=torch.Generator().manual_seed(1), stats=stats, **kw)
        out.append(dict(name=name, seconds=time.perf_counter() - t0, stats=stats, tokens=[r.tokens for r in rolls],
                        budget=budget, lengths=[len(r.tokens) for r in rolls], prompts=prompts))
    return out


# ------------------------------------------------------------------------------------------------
# CLI
# ------------------------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=32, help="rows in flight (the launcher's --gen-batch-size)")
    ap.add_argument("--layers", type=int, default=28, help="decoder layers (Qwen3-1.7B: 28)")
    ap.add_argument("--quick", action="store_true", help="fewer steps and repeats (a smoke run)")
    ap.add_argument("--only", choices=("step", "parity", "budget"), default=None, help="one part only")
    ap.add_argument("--baseline", default=None, help="another sampler.py whose static path runs beside ours")
    args = ap.parse_args()
    torch.set_num_threads(1)
    short, long, repeats = (8, 24, 1) if args.quick else (8, 40, 3)
    model = toy_model(args.layers)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, model.config.vocab_size, (16,), generator=g).tolist() for _ in range(args.rows)]
    if args.only in (None, "step"):
        print(f"# one decode step, {args.rows} rows, {args.layers} layers at toy width, fp32 weights under CPU bf16 "
              f"autocast; torch {torch.__version__}, {torch.get_num_threads()} thread; steps {short}->{long}, "
              f"{repeats} repeat(s)")
        res = per_step(model, prompts, short=short, long=long, repeats=repeats,
                       baseline=load_baseline(args.baseline) if args.baseline else None)
        ref = res["generate"]["tokens"]
        print("| path | ms per step | aten ops per step | weight casts per step | host reads per step | greedy "
              "tokens = generate's |")
        print("|---|---|---|---|---|---|")
        for name, r in res.items():
            ms = statistics.median(r["ms"])
            ops = f"{r['ops']:,.0f}" + (f" ({r['host_ops_with_graph']:.1f} outside the captured step)"
                                        if "host_ops_with_graph" in r else "")
            print(f"| {name} | {ms:.1f} ({' '.join(f'{x:.1f}' for x in r['ms'])}) | {ops} | {r['casts']:.1f} | "
                  f"{r['reads']:.3f} | {r['tokens'] == ref} |", flush=True)
    if args.only in (None, "parity"):
        print(f"# parity, {args.rows} rows x {long} greedy tokens (static vs default path; the bf16 tolerance row on "
              f"a bf16 copy, T=1):")
        for k, v in parity(model, prompts, new=long).items():
            print(f"  {k}: {v}", flush=True)
    if args.only in (None, "budget"):
        n_rows, cap, dense = (64, 64, 8) if args.quick else (128, 192, 16)
        runs = budget_rows(model, n_rows=n_rows, cap=cap, dense_slots=dense)
        lengths = runs[0]["lengths"]
        real = sum(len(p) + n for p, n in zip(runs[0]["prompts"], lengths)) / n_rows
        print("# the dense row runs the dense cache's schedule (S full-length slots) on the paged code: its blocks "
              "are not its memory; its K/V bytes are S x L x bytes per token")
        print(f"# rows in flight at one byte budget ({runs[0]['budget']:,} bytes: {dense} dense slots), {n_rows} "
              f"rows, T=1, float32, {args.layers} layers at toy width; responses: {sum(n == cap for n in lengths)}"
              f"/{n_rows} at the cap {cap}, mean {sum(lengths) / n_rows:.1f} tokens; prompt + response mean "
              f"{real:.1f} columns of L = {max(map(len, runs[0]['prompts'])) + cap}")
        print("| cache | slots | rows in flight, mean (peak) | slots run per step, mean | K/V columns attended per "
              "step, mean | real columns per step, mean (the kernel's read) | decode steps | preemptions | blocks "
              "used, peak / pool | K/V bytes | CPU s | tokens = dense's |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|")
        for r in runs:
            st = r["stats"]
            kv = r["budget"] if r is runs[0] else st["kv_pool_bytes"] + st["kv_gather_bytes"]  # dense: S x L columns
            steps = st["decode_steps"]
            if r is runs[0]:  # the dense cache ran every slot over every column, every step
                run_slots, columns = st["slots"], st["slots"] * (max(map(len, r["prompts"])) + cap)
            else:  # the paged one, R slots over W columns (its buckets)
                run_slots = sum(rr * n for (rr, w), n in st["bucket_steps"].items()) / steps
                columns = sum(rr * w * n for (rr, w), n in st["bucket_steps"].items()) / steps
            print(f"| {r['name']} | {st['slots']} | {st['rows_in_flight_mean']:.1f} ({st['rows_in_flight_peak']}) | "
                  f"{run_slots:.1f} | {columns:,.0f} | {st['kv_columns_real'] / steps:,.0f} | "
                  f"{st['decode_steps']} | {st['preemptions']} | {st['kv_blocks_peak']} / {st['kv_blocks']} | "
                  f"{kv:,} | {r['seconds']:.1f} | "
                  f"{r['tokens'] == runs[0]['tokens']} |", flush=True)

if __name__ == "__main__":
    main()
