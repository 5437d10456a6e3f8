"""Benchmarks for sampler.py (README, Benchmarks): every figure is a ratio measured side by side in one run.

    python -m bench.sampler            # full sizes (about 12-15 minutes on one CPU thread)
    python -m bench.sampler --quick    # smaller sizes and fewer repeats (about 4 minutes)
    python -m bench.sampler --only {logprobs,autocast,sampler,long-tail,tiny-eval,prefill,draw}
    python -m bench.sampler --only logprobs --baseline OTHER/sampler.py   # also time and size another copy's kernel
    python -m bench.sampler --only stop --baseline OTHER/sampler.py       # rollouts without stop strings, before/after

1. Log-prob path, float32 on CPU, N tokens x H hidden x V vocabulary (full: 2,048 x 512 x 151,936), random upstream
   gradient, temperature 1:
   * peak memory of forward + backward, ours (``token_logprobs``) vs the naive ``log_softmax(h @ W.T).gather``.
     Each path runs once in a fresh subprocess; the figure is the rise of its peak RSS (``ru_maxrss``) over the RSS
     once inputs exist, so it includes the (V, H) weight gradient both paths must return (N x V logits are the
     naive path's extra). torch's CPU allocator returns large blocks to the OS, so RSS tracks live tensors.
   * time of forward + backward, interleaved ours / naive, repeated; the ratio of medians, of wall-clock time and
     of the process's CPU time (the figure to read on a machine shared with other jobs).
   * max abs error of the log-probs and relative error (Frobenius norm of the difference over the norm) of both
     gradients against a float64 reference computed in token chunks.
   * the same memory and time for a soft-capped head (``softcap=30``, Gemma-2's), against ours on the plain head.
   * with ``--baseline FILE``: the ``token_logprobs`` of another copy of sampler.py (say the previous commit's,
     ``git show HEAD~1:sampler.py > /tmp/old/sampler.py``) on the plain head, in the same interleaved loop and fresh
     subprocesses: ours/baseline ratios of peak memory and median time, so a change to the kernel is measured side
     by side with what it replaces.
2. Sampler vs transformers' ``generate`` on a tiny Qwen3-style model (hidden 64, 2 layers, vocab 256), batch 64,
   cap 64 new tokens, one CPU thread. The model is first trained here for a few hundred steps on "filler prompt, then
   the count-down c_{L-1} ... c_1, EOS" after a prompt that ends with c_L, L uniform in 1..60, so that its greedy
   responses stop after 1 to 60 tokens as RL rollouts do. Tokens/s counts useful tokens (EOS included, padding
   after EOS excluded) for both. Cases: greedy with EOS (outputs must be identical), greedy with an EOS that is
   never produced (every row runs to the cap), and temperature-1 sampling with EOS.
1b. (``--only autocast``) The log-prob path in the GPU trainer's precision regime, emulated with CPU autocast:
   forward under bf16 autocast, backward outside it; errors of ours and of the naive path against float64.
3. Long-tailed lengths (``--only long-tail``): 512 prompts, at most 64 in flight, greedy, cap 224, on a tiny
   Qwen3-style model trained here on the same count-down task with L drawn 85% from 1..19 and 15% from 100..200.
   ``sample`` with ``max_batch_size=64`` (continuous batching) against today's use (one ``sample`` call per chunk
   of 64) and ``generate`` in chunks of 64: model forward calls counted by a hook on the model body (prefills
   included; on a GPU a decode step costs about the same whatever its rows, so this is the cost that matters there),
   tokens/s on this CPU, and greedy outputs identical row by row. ``static=True`` is run too, for parity and calls;
   its CPU speed is not what it is built for.
5. The tiny preset's evaluations (``--only tiny-eval``; not in the default run): the committed tiny models A
   and B (data/tiny_models), 1,000 generated train problems x 8 samples at T=1, 1024 rows in flight, one CPU
   thread: rows/s of the default path against ``static=True``, interleaved, and whether the two drew the same
   responses. With thousands of rows through a full set of slots a per-slot cache can beat the default path's
   growing, left-padded one; how much depends on the response lengths (A's character-level responses are
   long, B's short), which is why the tiny preset's choice of ``--static-decode`` for its evaluations is
   measured here, per model.
6. One prefill per prompt (``--only prefill``; not in the default run; ``--no-real``: tiny models only, ``--quick``:
   8 prompts): one GRPO rollout of G prompts x n=8 as ``Trainer.rollout`` hands it to ``sample`` (row g * n + i,
   T=1, cap 128, 32 rows in flight, float32, ``--threads`` torch threads, default 1), ``share_prefix=False`` and
   ``True`` interleaved (15 repeats on the tiny models after 3 untimed, 1 on the real ones): tokens per
   wall-clock second and per CPU second of the process (the robust one on a shared machine), the rise of peak RSS
   over the call (VmHWM reset through /proc/self/clear_refs), prefill tokens and forward calls, rows identical; then
   the behaviour log-probs of those rows as ``Trainer.behaviour_logprobs`` computes them (micro-batches of 16, in
   order), both ways: time, peak RSS rise, max |shared - unshared| and max |shared - sampler|, and on the real
   models how far each of the three is from the same log-probs computed with the model in float64 (on the 8 rows
   where shared and unshared differ most), the float32 round-off that any two batch shapes differ by. On the real
   models also the unshared rollout with section 7's flat draw in place of ``sampler._draw`` (the decode step's
   draw before its blocked inversion). Each rollout line gives the CPU seconds spent in the sampler's prefill
   forwards (its ``_prefill``, timed by a wrapper): what sharing can remove, the rest being decode steps, draws
   and cache copies. Models: the
   committed tiny models A and B on 32 generated train problems (the tiny preset's template), then SmolLM2-135M-
   Instruct and Gemma-3-270M (``gguf_models``, where installed; ``--real-only NAME``: one of them, ``--no-tiny``: no
   tiny part) on the first ``--real-prompts`` (32) MATH-500 problems of ../shared/benchmarks/math500.jsonl with
   the paper's instruction (graft.Config.prompt_template, raw text).
   Between them, the trainer's own ``time/*`` metrics of a 3-step tiny GRPO run (model A, 16 prompts x 8 per
   step, ``graft.py train --share-prefix`` vs ``--no-share-prefix``, two runs each, alternating).
7. One draw of the decode step (``--only draw``; in the default run): ``sampler._draw`` on (32, V) random logits
   of the spread of a real LM's, V = 49,152 (SmolLM2), 151,936 (Qwen3), 262,144 (Gemma-3), T = 1, top-p 1 and 0.95,
   against the reference it replaced, written out here: a log-softmax, a float64 cumulative sum over the whole
   vocabulary and, for top-p, a sort of every row. CPU ms per draw (one thread, interleaved, medians) and whether
   both drew the same tokens for the same uniforms; the head matmul ``h @ W.T`` of the same shape is timed beside
   them, the decode step's other vocabulary-sized cost.
8. Stop strings (``--only stop --baseline OLD/sampler.py``; not in the default run): rollouts WITHOUT stop strings
   through this sampler.py against OLD, a copy from before stop strings existed (``mkdir -p /tmp/before && git show
   dacae3a:sampler.py > /tmp/before/sampler.py``), side by side: the tiny preset's rollout on the committed tiny
   models A and B (32 generated train problems x n=8 = 256 rows, T=1, cap 128, 32 rows in flight, one thread), the
   default path and ``static=True``, interleaved with a second arm of OLD ("before again", the noise floor of a
   shared machine: the same code measured twice), 3 untimed rollouts first, then ``--repeats`` (default 15) of
   each, the order rotating: tokens per CPU second of the process (medians, and the best run of each, the least
   disturbed; wall-clock beside them) and rows identical; target after / before >= 0.97x.
   Then what a stop-string check costs when it never fires (``["Q:", "\n\n"]``, strings these models never
   write: the same rows, every step decoded) and when it does (the commonest two-character string of each model's
   responses), against no stop strings, through this sampler.py.
"""

import argparse
import copy
import importlib.util
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from unittest import mock

import torch

import sampler
from sampler import sample, token_logprobs

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository root

# ------------------------------------------------------------------------------------------------
# 1. log-prob path
# ------------------------------------------------------------------------------------------------


def logprob_inputs(n, h, v, seed=0):
    """Leaf inputs that look like a real lm_head: hidden (N, H) of norm ~4, weight (V, H) rows of norm ~1."""
    gen = torch.Generator().manual_seed(seed)
    # scaled in place: a temporary copy here would raise the peak-RSS baseline of the memory measurement
    hidden = torch.randn(n, h, generator=gen).mul_(4 / h**0.5).requires_grad_(True)  # (N, H)
    weight = torch.randn(v, h, generator=gen).mul_(1 / h**0.5).requires_grad_(True)  # (V, H)
    targets = torch.randint(0, v, (n,), generator=gen)  # (N,)
    upstream = torch.randn(n, generator=gen)  # (N,) random upstream gradient, as a policy loss gives
    return hidden, weight, targets, upstream


def naive_path(hidden, weight, targets):
    """The textbook path: full (N, V) float32 logits, log_softmax, gather."""
    return torch.log_softmax(hidden @ weight.T, dim=-1).gather(1, targets.unsqueeze(1)).squeeze(1)  # (N,)


def ours_path(hidden, weight, targets):
    return token_logprobs(hidden, weight, targets)  # defaults: chunk_size=1024, automatic vocabulary chunk


def ours_softcap_path(hidden, weight, targets):
    return token_logprobs(hidden, weight, targets, softcap=30.0)  # Gemma-2's final_logit_softcapping


BASELINE_FILE = None  # --baseline: another copy of sampler.py, whose token_logprobs is the "baseline" path
_baseline = {}


def load_baseline(path):
    """Import the --baseline copy of sampler.py under its own module name, beside this file's (before measuring)."""
    global BASELINE_FILE
    BASELINE_FILE = path
    spec = importlib.util.spec_from_file_location("baseline_sampler", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    _baseline["fn"] = module.token_logprobs
    _baseline["module"] = module


def baseline_path(hidden, weight, targets):
    return _baseline["fn"](hidden, weight, targets)


PATHS = {"naive": naive_path, "ours": ours_path, "ours-softcap": ours_softcap_path, "baseline": baseline_path}


def fwd_bwd(path, hidden, weight, targets, upstream):
    """One forward + backward; returns the log-probs. Gradients land in hidden.grad, weight.grad."""
    hidden.grad = weight.grad = None
    logp = PATHS[path](hidden, weight, targets)
    (logp * upstream).sum().backward()
    return logp.detach()


def memory_child(path, n, h, v):
    """Run in a fresh process: print the rise of peak RSS (bytes) caused by one forward + backward of `path`."""
    torch.set_num_threads(1)
    inputs = logprob_inputs(n, h, v)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux; the inputs are already allocated
    with open("/proc/self/statm") as f:  # current RSS in pages: equals `before` unless setup had a transient peak
        current = int(f.read().split()[1]) * resource.getpagesize() // 1024
    assert before - current < 16 * 1024, f"setup left a transient peak of {before - current} KiB: baseline is off"
    fwd_bwd(path, *inputs)
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"peak_rise_bytes": (after - before) * 1024}))


def peak_rise(path, n, h, v):
    extra = ["--baseline", os.path.abspath(BASELINE_FILE)] if BASELINE_FILE else []
    out = subprocess.run(
        [sys.executable, "-m", "bench.sampler", "--memory-child", path, str(n), str(h), str(v), *extra],
        check=True, capture_output=True, text=True, cwd=HERE,
    ).stdout
    return json.loads(out.strip().splitlines()[-1])["peak_rise_bytes"]


def float64_reference(hidden, weight, targets, upstream, chunk=128):
    """log-probs and both gradients in float64, through full logits but `chunk` tokens at a time to bound memory."""
    w64 = weight.detach().double().requires_grad_(True)  # (V, H); its .grad accumulates over the chunks
    logps, grads_h = [], []
    for n0 in range(0, hidden.shape[0], chunk):
        h64 = hidden[n0 : n0 + chunk].detach().double().requires_grad_(True)  # (n, H)
        lp = torch.log_softmax(h64 @ w64.T, dim=-1).gather(1, targets[n0 : n0 + chunk].unsqueeze(1)).squeeze(1)
        (lp * upstream[n0 : n0 + chunk].double()).sum().backward()
        logps.append(lp.detach())
        grads_h.append(h64.grad)
    return torch.cat(logps), torch.cat(grads_h), w64.grad  # (N,), (N, H), (V, H)


def bench_logprobs(n, h, v, repeats):
    torch.set_num_threads(1)
    print(f"== log-prob path: float32, CPU, 1 thread, N={n:,} tokens, H={h}, V={v:,}, random upstream gradient")
    paths = ["naive", "ours", "ours-softcap"] + (["baseline"] if BASELINE_FILE else [])
    if BASELINE_FILE:
        print(f"baseline: token_logprobs of {BASELINE_FILE}, plain head")
    mem = {p: peak_rise(p, n, h, v) for p in paths}
    print(f"peak memory rise, forward+backward (fresh subprocess each; includes the {v * h * 4 / 2**20:.0f} MiB "
          f"weight gradient both return):")
    print(f"  naive {mem['naive'] / 2**20:8.0f} MiB   ours {mem['ours'] / 2**20:8.0f} MiB   "
          f"ours/naive = {mem['ours'] / mem['naive']:.3f}  (target <= 0.125)")
    gw = v * h * 4
    net = {p: (m - gw) / 2**20 for p, m in mem.items()}
    print(f"  net of the weight gradient: naive {net['naive']:.0f} MiB, ours {net['ours']:.0f} MiB, "
          f"ratio {net['ours'] / net['naive']:.3f}; one (N, V) float32 array is {n * v * 4 / 2**20:.0f} MiB")
    for p in paths[2:]:
        a, b = (p, "ours") if p == "ours-softcap" else ("ours", p)
        print(f"  {p:12s} {mem[p] / 2**20:8.0f} MiB   {a}/{b} = {mem[a] / mem[b]:.3f}   "
              f"net of the weight gradient {net[p]:.0f} MiB")

    inputs = logprob_inputs(n, h, v)
    # wall-clock seconds, and this process's CPU seconds: with one thread the latter barely moves when other jobs
    # share the machine (the wall clock then also counts the time the scheduler gave to them)
    times = {clock: {p: [] for p in paths} for clock in ("wall", "cpu")}
    for rep in range(repeats):
        for p in (paths if rep % 2 == 0 else paths[::-1]):  # alternate who goes first
            t0, c0 = time.perf_counter(), time.process_time()
            fwd_bwd(p, *inputs)
            times["cpu"][p].append(time.process_time() - c0)
            times["wall"][p].append(time.perf_counter() - t0)
    for clock, label in (("wall", "wall-clock"), ("cpu", "CPU time of this process")):
        med = {p: statistics.median(t) for p, t in times[clock].items()}
        print(f"time forward+backward, interleaved, {label}, seconds per repeat:")
        for p in paths:
            print(f"  {p:12s} " + " ".join(f"{t:6.2f}" for t in times[clock][p]) + f"   median {med[p]:.2f}")
        per_rep = [o / nv for o, nv in zip(times[clock]["ours"], times[clock]["naive"])]
        print(f"  ours/naive = {med['ours'] / med['naive']:.2f} (median ratio; per repeat "
              + " ".join(f"{r:.2f}" for r in per_rep) + ")  (target <= 1.4)")
        for p in paths[2:]:
            a, b = (p, "ours") if p == "ours-softcap" else ("ours", p)  # the soft-cap's cost; the change's effect
            per_rep = [x / y for x, y in zip(times[clock][a], times[clock][b])]
            print(f"  {a}/{b} = {med[a] / med[b]:.2f} (median ratio; per repeat "
                  + " ".join(f"{r:.2f}" for r in per_rep) + ")")
    print(f"  why: ours does 4 (N, V, H) matmuls to naive's 3 (backward recomputes the logits): a 1.33x floor on\n"
          f"  arithmetic. But naive also streams several {n * v * 4 / 2**20:.0f} MiB (N, V) float32 arrays through"
          f" memory\n  (logits, log_softmax, their gradients), while ours reuses a few (chunk x vocab-chunk) tiles in"
          f" place\n  (float32 tiles of {sampler._TILE_ELEMENTS * 4 / 2**20:.0f} MiB at the defaults), so on a CPU the"
          f" memory traffic saved outweighs the extra matmul.")

    ref_lp, ref_gh, ref_gw = float64_reference(*inputs)
    print("error vs float64 reference (log-probs: max abs; gradients: ||err|| / ||grad||):")
    for p in ("naive", "ours"):
        hidden, weight = inputs[0], inputs[1]
        lp = fwd_bwd(p, *inputs)
        e_lp = (lp.double() - ref_lp).abs().max().item()
        e_gh = ((hidden.grad.double() - ref_gh).norm() / ref_gh.norm()).item()
        e_gw = ((weight.grad.double() - ref_gw).norm() / ref_gw.norm()).item()
        print(f"  {p:5s} logp {e_lp:.2e}   grad hidden {e_gh:.2e}   grad weight {e_gw:.2e}   (target < 1e-4)")


def bench_autocast():
    """The GPU trainer's precision regime on CPU: forward under bf16 autocast, backward outside it. Errors
    (||err|| / ||ref||) of token_logprobs and of the naive path (bf16 logits, float32 log_softmax as CUDA autocast
    runs it) against float64, on confident rows (logits / T of size ~8)."""
    torch.set_num_threads(1)
    print("\n== log-prob path under bf16 autocast (CPU autocast), backward outside autocast, vs float64")
    print(f"  {'N x H, V, T':22s} {'log-probs':>20s} {'grad hidden':>20s} {'grad weight':>20s}   (naive / ours)")
    for n, h, v, temp in [(256, 64, 4096, 1.0), (300, 32, 1000, 0.6), (97, 48, 3001, 1.7), (1024, 128, 32_000, 1.0)]:
        gen = torch.Generator().manual_seed(0)
        hidden = torch.randn(n, h, generator=gen) * 8 * temp  # (N, H)
        weight = torch.randn(v, h, generator=gen) / h**0.5  # (V, H)
        targets = torch.randint(0, v, (n,), generator=gen)  # (N,)
        upstream = torch.randn(n, generator=gen, dtype=torch.float64)  # (N,)
        results = {}
        for name in ("ref", "naive", "ours"):
            hh = (hidden.double() if name == "ref" else hidden).clone().requires_grad_(True)
            ww = (weight.double() if name == "ref" else weight).clone().requires_grad_(True)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=name != "ref"):
                if name == "ours":
                    lp = token_logprobs(hh, ww, targets, temperature=temp, chunk_size=128, vocab_chunk_size=3000)
                else:
                    lp = torch.log_softmax((hh @ ww.T).float() / temp, dim=-1).gather(1, targets[:, None]).squeeze(1)
            (lp.double() * upstream).sum().backward()
            results[name] = (lp.detach().double(), hh.grad.double(), ww.grad.double())
        errs = [[((x - r).norm() / r.norm()).item() for x, r in zip(results[k], results["ref"])] for k in ("naive",
                                                                                                          "ours")]
        cells = " ".join(f"{a:9.2e}/{b:9.2e}" + ("" if b <= 1.25 * a else "!") for a, b in zip(*errs))
        print(f"  {f'{n}x{h}, {v:,}, {temp}':22s} {cells}   ours/naive max {max(b / a for a, b in zip(*errs)):.2f} "
              f"(target <= 1.25)")


# ------------------------------------------------------------------------------------------------
# 2. sampler vs generate
# ------------------------------------------------------------------------------------------------

PAD, EOS, CAP = 0, 1, 64
COUNTER0 = 2  # token COUNTER0 + k is the counter c_k


@dataclass(frozen=True)
class CountTask:
    """A count-down task: the prompt is filler tokens then c_L; the response c_{L-1}, ..., c_1, EOS has L tokens.

    A tiny model learns it quickly (each token follows from the previous one and the prompt's c_L), and its greedy
    responses then stop after the number of tokens the prompt asks for, as RL rollouts stop at varied lengths."""

    vocab: int
    max_len: int  # longest L; counters c_0..c_max_len are tokens COUNTER0..COUNTER0 + max_len, fillers the rest
    long_tail: bool  # False: L uniform in 1..max_len; True: 85% uniform in 1..19, 15% uniform in 100..max_len

    @property
    def filler0(self) -> int:
        return COUNTER0 + self.max_len + 1

    def draw_length(self, gen) -> int:
        if self.long_tail and float(torch.rand((), generator=gen)) < 0.15:
            return int(torch.randint(100, self.max_len + 1, (1,), generator=gen))
        return int(torch.randint(1, (20 if self.long_tail else self.max_len + 1), (1,), generator=gen))


VARIED = CountTask(vocab=256, max_len=60, long_tail=False)  # lengths 1..60, cap 64: the batch-64 cases
LONG_TAIL = CountTask(vocab=320, max_len=200, long_tail=True)  # most under 20 tokens, 15% in 100..200


def counting_batch(batch, gen, task=VARIED):
    """Prompts (list of lists) and right-padded training sequences (B, L) with a loss mask on response tokens.

    prompt = 4..16 filler tokens, then c_L; response = c_{L-1}, ..., c_1, EOS (L tokens)."""
    prompts, seqs = [], []
    for _ in range(batch):
        n_fill = int(torch.randint(4, 17, (1,), generator=gen))
        length = task.draw_length(gen)
        prompt = torch.randint(task.filler0, task.vocab, (n_fill,), generator=gen).tolist() + [COUNTER0 + length]
        response = [COUNTER0 + k for k in range(length - 1, 0, -1)] + [EOS]
        prompts.append(prompt)
        seqs.append((prompt, response))
    width = max(len(p) + len(r) for p, r in seqs)
    ids = torch.full((batch, width), PAD, dtype=torch.long)  # (B, L)
    labels = torch.full((batch, width), -100, dtype=torch.long)  # (B, L): loss on response tokens only
    for i, (p, r) in enumerate(seqs):
        ids[i, : len(p) + len(r)] = torch.tensor(p + r)
        labels[i, len(p) : len(p) + len(r)] = torch.tensor(r)
    return prompts, ids, labels


def trained_tiny_qwen3(steps, seed=0, task=VARIED):
    """A tiny Qwen3-style model trained to stop after the count-down its prompt asks for."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    torch.manual_seed(seed)
    cfg = Qwen3Config(
        vocab_size=task.vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=512, pad_token_id=PAD, eos_token_id=EOS,
        bos_token_id=None, tie_word_embeddings=False,
    )
    model = AutoModelForCausalLM.from_config(cfg)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(seed)
    model.train()
    for _ in range(steps):
        _, ids, labels = counting_batch(64, gen, task)
        loss = model(input_ids=ids, attention_mask=(ids != PAD).long(), labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval(), loss.item()


def run_generate(model, prompts, *, eos, temperature, cap=CAP):
    """transformers' generate on the same left-padded batch; returns per-row useful tokens (cut after first EOS)."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[PAD] * (width - len(p)) + p for p in prompts])  # (B, P)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])  # (B, P)
    # top_k=0: generate's default config may carry top_k=50, which our full-distribution sampling does not apply
    kw = dict(do_sample=True, temperature=temperature, top_p=1.0, top_k=0) if temperature else dict(do_sample=False)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=cap, eos_token_id=eos, pad_token_id=PAD, **kw)
    rows = []
    for row in out[:, width:].tolist():
        stop = next((k for k, t in enumerate(row) if t == eos), None)
        rows.append(row if stop is None else row[: stop + 1])
    return rows


def run_ours(model, prompts, *, eos, temperature):
    gen = torch.Generator().manual_seed(0)
    rolls = sample(model, prompts, max_new_tokens=CAP, temperature=temperature, eos_token_id=eos, pad_token_id=PAD,
                   generator=gen)
    return [r.tokens for r in rolls]


def bench_sampler(train_steps, repeats):
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    model, loss = trained_tiny_qwen3(train_steps)
    print(f"\n== sampler vs generate: tiny Qwen3 (hidden 64, 2 layers, V={VARIED.vocab}), batch 64, cap {CAP}, "
          "CPU, 1 thread")
    print(f"trained {train_steps} steps in {time.perf_counter() - t0:.0f} s, final loss {loss:.3f}")
    prompts, _, _ = counting_batch(64, torch.Generator().manual_seed(123))
    never = VARIED.vocab  # an EOS id outside the vocabulary: never produced, every row runs to the cap
    cases = [("greedy, EOS (lengths vary)", EOS, 0.0), ("greedy, no EOS (all rows to cap)", never, 0.0),
             ("T=1 sampling, EOS", EOS, 1.0)]
    for name, eos, temperature in cases:
        run_ours(model, prompts, eos=eos, temperature=temperature)  # warm-up both (first-call overheads)
        run_generate(model, prompts, eos=eos, temperature=temperature)
        tps = {"ours": [], "generate": []}
        outputs = {}
        for rep in range(repeats):
            order = ("ours", "generate") if rep % 2 == 0 else ("generate", "ours")
            for who in order:
                fn = run_ours if who == "ours" else run_generate
                t0 = time.perf_counter()
                rows = fn(model, prompts, eos=eos, temperature=temperature)
                tps[who].append(sum(map(len, rows)) / (time.perf_counter() - t0))
                outputs[who] = rows
        lengths = [len(r) for r in outputs["ours"]]
        med = {k: statistics.median(v) for k, v in tps.items()}
        print(f"{name}: response lengths min {min(lengths)} / mean {sum(lengths) / len(lengths):.1f} / "
              f"max {max(lengths)}")
        if temperature == 0:
            same = outputs["ours"] == outputs["generate"]
            print(f"  greedy outputs identical to generate: {same}")
            assert same, "greedy outputs differ from generate"
        print(f"  tokens/s  ours " + " ".join(f"{x:7.0f}" for x in tps["ours"])
              + f"   generate " + " ".join(f"{x:7.0f}" for x in tps["generate"]))
        print(f"  ours/generate = {med['ours'] / med['generate']:.2f}x (median tokens/s)")


# ------------------------------------------------------------------------------------------------
# 3. long-tailed lengths: continuous batching vs chunks of 64
# ------------------------------------------------------------------------------------------------

LT_CAP, LT_PROMPTS, LT_SLOTS = 224, 512, 64


class CallCounter:
    """Counts calls of the model body (prefills and decode steps alike): on a GPU a decode step costs about the same
    whatever the number of rows in it, so the count, not the CPU time, is the cost that continuous batching cuts."""

    def __init__(self, model):
        self.calls = 0
        self.hook = model.model.register_forward_pre_hook(lambda *_: self.bump())

    def bump(self):
        self.calls += 1

    def close(self):
        self.hook.remove()


def lt_continuous(model, prompts, **kw):
    rolls = sample(model, prompts, max_new_tokens=LT_CAP, temperature=0, eos_token_id=EOS, pad_token_id=PAD,
                   max_batch_size=LT_SLOTS, **kw)
    return [r.tokens for r in rolls]


def lt_chunks(model, prompts):
    """Today's use: one sample() call per chunk of 64; each call prunes finished rows but ends with its longest."""
    out = []
    for i in range(0, len(prompts), LT_SLOTS):
        rolls = sample(model, prompts[i : i + LT_SLOTS], max_new_tokens=LT_CAP, temperature=0, eos_token_id=EOS,
                       pad_token_id=PAD)
        out += [r.tokens for r in rolls]
    return out


def lt_generate(model, prompts):
    out = []
    for i in range(0, len(prompts), LT_SLOTS):
        out += run_generate(model, prompts[i : i + LT_SLOTS], eos=EOS, temperature=0.0, cap=LT_CAP)
    return out


def bench_long_tail(train_steps, repeats):
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    model, loss = trained_tiny_qwen3(train_steps, task=LONG_TAIL)
    print(f"\n== long-tailed lengths: tiny Qwen3 (V={LONG_TAIL.vocab}), {LT_PROMPTS} prompts, <= {LT_SLOTS} in flight, "
          f"cap {LT_CAP}, greedy, CPU, 1 thread")
    print(f"trained {train_steps} steps in {time.perf_counter() - t0:.0f} s, final loss {loss:.4f}")
    prompts, _, _ = counting_batch(LT_PROMPTS, torch.Generator().manual_seed(321), LONG_TAIL)
    runs = {
        "continuous": lambda: lt_continuous(model, prompts),
        "chunks of 64 (today)": lambda: lt_chunks(model, prompts),
        "generate, chunks of 64": lambda: lt_generate(model, prompts),
        "continuous, static=True": lambda: lt_continuous(model, prompts, static=True),
    }
    calls, outputs = {}, {}
    for name, fn in runs.items():  # one counted run each (also the warm-up)
        counter = CallCounter(model)
        try:
            outputs[name] = fn()
        finally:
            counter.close()
        calls[name] = counter.calls
    lengths = sorted(len(r) for r in outputs["continuous"])
    n = len(lengths)
    print(f"response lengths: min {lengths[0]}, median {lengths[n // 2]}, mean {sum(lengths) / n:.1f}, max "
          f"{lengths[-1]}; under 20 tokens {sum(x < 20 for x in lengths) / n:.0%}, 100-200 tokens "
          f"{sum(100 <= x <= 200 for x in lengths) / n:.0%}")
    ref = outputs["generate, chunks of 64"]
    for name in runs:
        print(f"  {name:24s} greedy outputs identical to generate row by row: {outputs[name] == ref}")
        assert outputs[name] == ref, f"{name}: greedy outputs differ from generate"
    print("model forward calls (prefills + decode steps):")
    for name in runs:
        print(f"  {name:24s} {calls[name]:6d}   continuous / this = {calls['continuous'] / calls[name]:.2f}")
    print(f"  continuous vs today's chunks of 64: {calls['continuous'] / calls['chunks of 64 (today)']:.2f}x the calls "
          f"(target <= 0.5)")
    timed = [k for k in runs if k != "continuous, static=True"] + ["continuous, static=True"]
    tps = {k: [] for k in timed}
    total = sum(lengths)
    for rep in range(repeats):
        for name in (timed if rep % 2 == 0 else timed[::-1]):  # alternate the order
            t0 = time.perf_counter()
            runs[name]()
            tps[name].append(total / (time.perf_counter() - t0))
    med = {k: statistics.median(v) for k, v in tps.items()}
    print("tokens/s (useful tokens, interleaved repeats):")
    for name in timed:
        print(f"  {name:24s} " + " ".join(f"{x:7.0f}" for x in tps[name]) + f"   median {med[name]:7.0f}   "
              f"vs generate {med[name] / med['generate, chunks of 64']:.2f}x")
    print(f"  continuous / generate in chunks of 64 = {med['continuous'] / med['generate, chunks of 64']:.2f}x "
          f"(target >= 2)")
    print(f"  (static=True runs all {LT_SLOTS} slots over all {LT_CAP}+ cache columns every step, eagerly on a CPU; it "
          f"is built for a GPU's CUDA graph, where its speed is not measured yet)")


# ------------------------------------------------------------------------------------------------
# 4. real pretrained weights, from GGUF files that pip packages ship (--only real-weights; not in the default run)
# ------------------------------------------------------------------------------------------------

RW_PROMPTS = [
    "What is 17 + 25? Answer with a number.",
    "Name the capital of France.",
    "Write a haiku about the sea.",
    "If x + 3 = 10, what is x?",
    "List three prime numbers.",
    # long enough that prompt + response outgrows Gemma-3-270M's 512-token sliding window
    "Summarise this text in one sentence. " + "The river rose after three days of rain and the village moved its "
    "boats to higher ground, while the miller kept his wheel turning as long as the water allowed. " * 22,
]
RW_CAP = 24


def gguf_models():
    """(name, directory, GGUF file name) of each model whose package is installed, and the reasons for the others
    (data/real_models.py finds the files; its folder names get the quantisation's label here)."""
    from data.real_models import gguf_sources
    labels = {"smollm2-135m-instruct": "SmolLM2-135M-Instruct Q4_1", "gemma3-270m": "Gemma-3-270M Q4_K_M"}
    found, missing = gguf_sources()
    return [(labels.get(name, name), directory, file) for name, directory, file in found], missing


def bench_real_weights():
    """Greedy sample vs generate (all at once and 2 rows in flight, so refills run) and response_logprobs vs the
    model's own log-softmax, on real weights dequantised to float32 by transformers' GGUF loader."""
    torch.set_num_threads(1)
    print(f"\n== real weights (GGUF, dequantised to float32), {len(RW_PROMPTS)} prompts, greedy, cap {RW_CAP}, CPU")
    found, missing = gguf_models()
    for reason in missing:
        print(f"  skipped: {reason} (needs also: pip install gguf accelerate)")
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from sampler import response_logprobs
    for name, directory, file in found:
        t0 = time.perf_counter()
        tok = AutoTokenizer.from_pretrained(directory, gguf_file=file)
        model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=file, dtype=torch.float32).eval()
        cfg = model.config
        print(f"{name}: {type(model).__name__}, vocab {len(tok):,}, layer types "
              f"{sorted(set(getattr(cfg, 'layer_types', None) or ['full_attention']))}, sliding window "
              f"{getattr(cfg, 'sliding_window', None)}, softcap {getattr(cfg, 'final_logit_softcapping', None)}; "
              f"loaded in {time.perf_counter() - t0:.0f} s")
        prompts = [tok(p)["input_ids"] for p in RW_PROMPTS]
        eos = tok.eos_token_id
        pad = tok.pad_token_id if tok.pad_token_id is not None else eos
        theirs = []
        with torch.no_grad():
            for p in prompts:  # one at a time: no padding in generate's run
                out = model.generate(torch.tensor([p]), max_new_tokens=RW_CAP, do_sample=False, eos_token_id=eos,
                                     pad_token_id=pad)[0, len(p):].tolist()
                theirs.append(out[: out.index(eos) + 1] if eos in out else out)
        for mbs in (None, 2):
            ours = sample(model, prompts, max_new_tokens=RW_CAP, temperature=0, eos_token_id=eos, pad_token_id=pad,
                          max_batch_size=mbs, min_refill=1)
            same = sum(r.tokens == t for r, t in zip(ours, theirs))
            print(f"  greedy, max_batch_size={mbs}: {same}/{len(prompts)} rows identical to generate; longest "
                  f"prompt + response {max(len(p) + len(t) for p, t in zip(prompts, theirs))} tokens")
        with torch.no_grad():
            logp, mask = response_logprobs(model, prompts, theirs, pad_token_id=pad, temperature=0.7)
            diff = 0.0
            for i, (p, r) in enumerate(zip(prompts, theirs)):
                z = model(input_ids=torch.tensor([p + r])).logits[0, len(p) - 1 : len(p) - 1 + len(r)].float() / 0.7
                own = torch.log_softmax(z, dim=-1).gather(1, torch.tensor(r).unsqueeze(1)).squeeze(1)
                diff = max(diff, (logp[i, : len(r)] - own).abs().max().item())
        print(f"  response_logprobs vs the model's own log-softmax (T=0.7): max |diff| {diff:.1e}")


# ------------------------------------------------------------------------------------------------
# 5. the tiny preset's evaluations: the default path vs static=True (--only tiny-eval)
# ------------------------------------------------------------------------------------------------


def bench_tiny_eval(problems: int = 1000, samples: int = 8, slots: int = 1024, repeats: int = 2):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from data import tiny_tasks

    torch.set_num_threads(1)
    rows, _ = tiny_tasks.generate(0, problems, 0)
    print(f"\n== tiny preset evaluations: {problems} generated train problems x {samples} samples, T=1, "
          f"{slots} rows in flight, CPU, 1 thread")
    for name in ("A", "B"):
        path = os.path.join(HERE, "data", "tiny_models", name)
        tok, model = AutoTokenizer.from_pretrained(path), AutoModelForCausalLM.from_pretrained(path)
        prompts = [tok(r["problem"] + "\n")["input_ids"] for r in rows for _ in range(samples)]

        def run(static):
            return sample(model, prompts, max_new_tokens=68, temperature=1.0, eos_token_id=tok.eos_token_id,
                          pad_token_id=tok.pad_token_id, generator=torch.Generator().manual_seed(0),
                          max_batch_size=slots, static=static)
        rate = {False: [], True: []}
        outs = {}
        for rep in range(repeats):
            for static in ((False, True) if rep % 2 == 0 else (True, False)):  # alternate the order
                t0 = time.perf_counter()
                outs[static] = run(static)
                rate[static].append(len(prompts) / (time.perf_counter() - t0))
        same = sum(a.tokens == b.tokens for a, b in zip(outs[False], outs[True]))
        med = {k: statistics.median(v) for k, v in rate.items()}
        print(f"  {name}: default path {' '.join(f'{x:.0f}' for x in rate[False])} rows/s, static=True "
              f"{' '.join(f'{x:.0f}' for x in rate[True])} rows/s; static / default = {med[True] / med[False]:.2f}x; "
              f"{same}/{len(prompts)} responses identical" + ("" if same == len(prompts) else
                                                              " (the rest differ by float round-off in the sampling)"))


# ------------------------------------------------------------------------------------------------
# 6. one prefill per prompt: a GRPO rollout (G prompts x n) with and without share_prefix (--only prefill)
# ------------------------------------------------------------------------------------------------

PF_N, PF_CAP, PF_SLOTS, PF_MICRO = 8, 128, 32, 16  # copies per prompt, cap, rows in flight, log-prob micro-batch


def rss_reset() -> int:
    """Reset this process's peak RSS (VmHWM, via /proc/self/clear_refs) to its current RSS; return that in bytes.
    Memory freed by earlier runs is first handed back to the OS (glibc's malloc_trim): glibc keeps freed blocks of
    up to 32 MiB in its heap, so a run after another would otherwise reuse them without raising the RSS."""
    import ctypes
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status_kib("VmRSS") * 1024


def rss_peak() -> int:
    """Peak RSS (VmHWM) in bytes since the last rss_reset."""
    return _status_kib("VmHWM") * 1024


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def pf_rollout(model, rows, *, eos, pad, share: bool, seed: int = 0):
    """One rollout as Trainer.rollout calls it: T=1, cap PF_CAP, PF_SLOTS rows in flight. -> (rollouts, (wall-clock
    seconds, CPU seconds of this process), peak RSS rise in bytes, sample()'s stats plus "prefill_cpu_s", the CPU
    seconds spent in the sampler's prefill forwards)."""
    stats = {"prefill_cpu_s": 0.0}
    prefill = sampler._prefill

    def timed_prefill(*args, **kwargs):  # the prefill forwards alone (both paths run them through _prefill)
        c = time.process_time()
        out = prefill(*args, **kwargs)
        stats["prefill_cpu_s"] += time.process_time() - c
        return out

    base = rss_reset()
    t0, c0 = time.perf_counter(), time.process_time()
    with mock.patch.object(sampler, "_prefill", timed_prefill):
        rolls = sample(model, rows, max_new_tokens=PF_CAP, temperature=1.0, eos_token_id=eos, pad_token_id=pad,
                       generator=torch.Generator().manual_seed(seed), max_batch_size=PF_SLOTS, share_prefix=share,
                       stats=stats)
    return rolls, (time.perf_counter() - t0, time.process_time() - c0), rss_peak() - base, stats


def pf_logprobs(model, rows, responses, *, pad, share: bool):
    """Behaviour log-probs as Trainer.behaviour_logprobs computes them: rows in order, micro-batches of PF_MICRO,
    no grad, T=1. -> (list of (len,) tensors, (wall-clock, CPU) seconds, peak RSS rise in bytes)."""
    from sampler import response_logprobs
    out = []
    base = rss_reset()
    t0, c0 = time.perf_counter(), time.process_time()
    with torch.no_grad():
        for i in range(0, len(rows), PF_MICRO):
            lp, mask = response_logprobs(model, rows[i : i + PF_MICRO], responses[i : i + PF_MICRO],
                                         pad_token_id=pad, share_prefix=share)
            out += [lp[j, : int(mask[j].sum())] for j in range(lp.shape[0])]
    return out, (time.perf_counter() - t0, time.process_time() - c0), rss_peak() - base


def pf_model(name: str, model, prompts: list[list[int]], *, eos, pad, repeats: int, float64_rows: int = 0,
             flat: bool = False, warmup: int = 0) -> None:
    """Rollout and behaviour log-probs of len(prompts) x PF_N rows, unshared and shared, interleaved; then, for the
    float64_rows rows where the two differ most, how far each float32 path is from the model in float64.
    flat: also the unshared rollout with section 7's flat_draw in place of sampler._draw (the decode step's draw
    before the blocked inversion). warmup: untimed full rollouts of each path first."""
    rows = [p for p in prompts for _ in range(PF_N)]  # row r = g * n + i, as Trainer.rollout builds them
    lens = [len(p) for p in prompts]
    print(f"{name}: {len(prompts)} prompts ({min(lens)}-{max(lens)} tokens, mean {sum(lens) / len(lens):.0f}) x "
          f"n={PF_N} = {len(rows)} rows, T=1, cap {PF_CAP}, {PF_SLOTS} rows in flight")
    pf_rollout(model, rows[: 2 * PF_N], eos=eos, pad=pad, share=True)  # warm-up (first-call overheads)
    for _ in range(warmup):  # and the allocator's: the first full rollouts of a tiny model run up to 1.4x slower
        pf_rollout(model, rows, eos=eos, pad=pad, share=False), pf_rollout(model, rows, eos=eos, pad=pad, share=True)
    runs = {False: [], True: []}
    for rep in range(repeats):
        for share in ((False, True) if rep % 2 == 0 else (True, False)):  # alternate who goes first
            runs[share].append(pf_rollout(model, rows, eos=eos, pad=pad, share=share))
    if flat:
        with mock.patch.object(sampler, "_draw", flat_draw):
            runs["flat"] = [pf_rollout(model, rows, eos=eos, pad=pad, share=False)]
    label = {False: "unshared", True: "shared", "flat": "unshared, flat draw"}
    # tokens per wall-clock second and per CPU second of this process (with one thread, the latter barely moves
    # when other jobs share the machine)
    tps = {(k, c): [sum(len(r.tokens) for r in v[0]) / v[1][c] for v in rs] for k, rs in runs.items() for c in (0, 1)}
    med = {key: statistics.median(v) for key, v in tps.items()}
    for k, rs in runs.items():
        rolls, _, peak, stats = rs[-1]
        print(f"  rollout {label[k]:8s} tokens/s wall " + " ".join(f"{x:6.1f}" for x in tps[k, 0]) + ", CPU "
              + " ".join(f"{x:6.1f}" for x in tps[k, 1]) + f"; peak RSS rise {peak / 2**20:7.1f} MiB, prefill "
              f"tokens {stats['prefill_tokens']:,}, forward calls {stats['forward_calls']:,}; CPU s "
              f"{rs[-1][1][1]:.1f}, of which prefill forwards {stats['prefill_cpu_s']:.1f}")
    lengths = [len(r.tokens) for r in runs[True][-1][0]]
    same = sum(a.tokens == b.tokens for a, b in zip(runs[False][-1][0], runs[True][-1][0]))
    print(f"  response lengths {min(lengths)}-{max(lengths)} (mean {sum(lengths) / len(lengths):.1f}); sampled tokens "
          f"identical shared vs unshared: {same}/{len(rows)} rows")
    print(f"  shared / unshared tokens/s = {med[True, 1] / med[False, 1]:.2f}x per CPU second, "
          f"{med[True, 0] / med[False, 0]:.2f}x wall-clock (medians of {repeats}); peak RSS rise, "
          f"largest of each: shared {max(r[2] for r in runs[True]) / 2**20:.1f} MiB, unshared "
          f"{max(r[2] for r in runs[False]) / 2**20:.1f} MiB")
    if flat:
        same = sum(a.tokens == b.tokens for a, b in zip(runs[False][-1][0], runs["flat"][-1][0]))
        print(f"  against the unshared rollout with the flat draw: shared {med[True, 1] / med['flat', 1]:.2f}x, "
              f"unshared {med[False, 1] / med['flat', 1]:.2f}x tokens per CPU second; sampled tokens identical "
              f"unshared vs unshared with the flat draw: {same}/{len(rows)} rows")
    rolls = runs[True][-1][0]
    responses = [r.tokens for r in rolls]
    lp, lp_times = {}, {False: [], True: []}
    for rep in range(repeats):
        for share in ((False, True) if rep % 2 == 0 else (True, False)):
            lp[share] = pf_logprobs(model, rows, responses, pad=pad, share=share)
            lp_times[share].append(lp[share][1])
    diff = max((a - b).abs().max().item() for a, b in zip(lp[False][0], lp[True][0]))
    vs_sampler = max((a - r.logprobs).abs().max().item() for a, r in zip(lp[True][0], rolls))
    (w0, c0), (w1, c1) = ((statistics.median(t[0] for t in lp_times[s]), statistics.median(t[1] for t in lp_times[s]))
                          for s in (False, True))
    print(f"  behaviour log-probs (micro-batches of {PF_MICRO}, medians of {repeats}): unshared {c0:.2f} CPU s "
          f"({w0:.2f} wall), peak RSS rise {lp[False][2] / 2**20:.1f} MiB; shared {c1:.2f} CPU s ({w1:.2f} wall), "
          f"{lp[True][2] / 2**20:.1f} MiB; time {c1 / c0:.2f}x CPU, {w1 / w0:.2f}x wall; max |shared - unshared| "
          f"{diff:.1e}, max |shared - sampler| {vs_sampler:.1e}")
    if float64_rows:
        from sampler import response_logprobs
        # the yardstick for those differences: float32 round-off of the model itself, measured against float64 on
        # the rows where shared and unshared differ most
        row_diff = [(a - b).abs().max().item() for a, b in zip(lp[False][0], lp[True][0])]
        worst = sorted(range(len(rows)), key=lambda r: -row_diff[r])[:float64_rows]
        m64 = copy.deepcopy(model).double()
        with torch.no_grad():
            lp64, mask = response_logprobs(m64, [rows[r] for r in worst], [responses[r] for r in worst],
                                           pad_token_id=pad, share_prefix=False)
        del m64
        ref = [lp64[j, : int(mask[j].sum())] for j in range(len(worst))]
        err = {k: max((v[r].double() - b).abs().max().item() for r, b in zip(worst, ref)) for k, v in
               (("unshared", lp[False][0]), ("shared", lp[True][0]), ("sampler", [r.logprobs for r in rolls]))}
        print(f"  against the float64 model on the {len(worst)} rows where shared and unshared differ most "
              f"({sum(len(r) for r in ref)} tokens, |shared - unshared| {row_diff[worst[-1]]:.1e} to "
              f"{row_diff[worst[0]]:.1e}): "
              + ", ".join(f"max |{k} - float64| {e:.1e}" for k, e in err.items()))


def pf_train(threads: int, steps: int = 3) -> None:
    """The trainer's own phase times (time/sample, time/logprob, time/update) of a short GRPO run on the tiny
    model A, --share-prefix against --no-share-prefix, alternating, two runs each; medians over steps 1.."""
    import tempfile
    from data import tiny_tasks
    rows, _ = tiny_tasks.generate(0, 64, 0)
    with tempfile.TemporaryDirectory() as tmp:
        data = os.path.join(tmp, "train.jsonl")
        with open(data, "w") as f:
            f.writelines(json.dumps({k: r[k] for k in ("id", "problem", "answer")}) + "\n" for r in rows)
        times = {True: [], False: []}
        for k, share in enumerate((True, False, False, True)):
            out = os.path.join(tmp, f"run{k}")
            cmd = [sys.executable, os.path.join(HERE, "graft.py"), "train", "--model",
                   os.path.join(HERE, "data", "tiny_models", "A"), "--prompts", data, "--out", out, "--steps",
                   str(steps), "--prompts-per-step", "16", "--n", str(PF_N), "--minibatches", "2",
                   "--max-response-tokens", "68", "--prompt-template", "{problem}\n", "--threads", str(threads),
                   "--micro-batch-size", str(PF_MICRO), "--gen-batch-size", str(PF_SLOTS), "--save-every", "1000",
                   "--share-prefix" if share else "--no-share-prefix"]
            subprocess.run(cmd, check=True, capture_output=True, text=True)
            with open(os.path.join(out, "metrics.jsonl")) as f:
                times[share] += [json.loads(line) for line in f][1:]  # step 0 pays the first-call overheads
    print(f"trainer phase times, tiny model A, GRPO, 16 prompts x n={PF_N} per step, {steps} steps x 2 runs each "
          f"(step 0 left out), medians in seconds:")
    for key in ("time/sample", "time/logprob", "time/update", "time/step"):
        med = {s: statistics.median(m[key] for m in times[s]) for s in (False, True)}
        print(f"  {key:13s} unshared {med[False]:6.2f}   shared {med[True]:6.2f}   shared / unshared "
              f"{med[True] / med[False]:.2f}x")


def bench_prefill(threads: int, real: bool, prompts: int, real_prompts: int, repeats: int, tiny: bool = True,
                  real_only: str = "") -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    torch.set_num_threads(threads)
    load = os.getloadavg()[0]
    print(f"\n== one prefill per prompt: a GRPO rollout, share_prefix=False vs True, interleaved, float32 CPU, "
          f"{threads} threads (load average {load:.1f} at the start)")
    from data import tiny_tasks
    problems, _ = tiny_tasks.generate(0, prompts, 0)
    for name in ("A", "B") if tiny else ():
        path = os.path.join(HERE, "data", "tiny_models", name)
        tok, model = AutoTokenizer.from_pretrained(path), AutoModelForCausalLM.from_pretrained(path).eval()
        ids = [tok(r["problem"] + "\n")["input_ids"] for r in problems]  # the tiny preset's prompt template
        pf_model(f"tiny {name}", model, ids, eos=tok.eos_token_id, pad=tok.pad_token_id, repeats=repeats, warmup=3)
    if tiny:
        pf_train(threads)
    if not real:
        return
    from graft import Config
    from runtime import encode_prompt
    bench = os.path.join(HERE, "..", "shared", "benchmarks", "math500.jsonl")
    with open(bench) as f:
        math = [json.loads(line)["problem"] for line, _ in zip(f, range(real_prompts))]
    found, missing = gguf_models()
    for reason in missing:
        print(f"  skipped: {reason}")
    for name, directory, file in found:
        if real_only.lower() not in name.lower():
            continue
        tok = AutoTokenizer.from_pretrained(directory, gguf_file=file)
        model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=file, dtype=torch.float32).eval()
        ids = [encode_prompt(p, tok, template=Config.prompt_template, chat=False) for p in math]  # the paper's
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        pf_model(f"{name} ({len(math)} MATH-500 problems, the paper's instruction)", model, ids,
                 eos=tok.eos_token_id, pad=pad, repeats=1, float64_rows=PF_N, flat=True)
        del model


# ------------------------------------------------------------------------------------------------
# 7. one draw of the decode step: blocked inversion and top-p candidates vs a flat CDF and a full sort (--only draw)
# ------------------------------------------------------------------------------------------------


def flat_draw(logits, temperature, top_p, u):
    """The reference: log-softmax over the vocabulary, a float64 CDF over all of it, a full sort for top-p.
    logits (B, V), u (B,) -> tokens (B,), logprobs (B,)."""
    logp = torch.log_softmax(logits / temperature, dim=-1)  # (B, V)
    probs = logp.exp()
    order = None
    if top_p < 1.0:
        probs, order = probs.sort(dim=-1, descending=True)  # (B, V)
        probs = probs.masked_fill(probs.cumsum(dim=-1) - probs >= top_p, 0.0)
    cdf = probs.double().cumsum(dim=-1)  # (B, V)
    idx = torch.searchsorted(cdf, u.unsqueeze(1) * cdf[:, -1:], right=True)
    idx = torch.minimum(idx, (cdf < cdf[:, -1:]).sum(dim=-1, keepdim=True))  # (B, 1)
    tokens = (idx if order is None else order.gather(1, idx)).squeeze(1)
    return tokens, logp.gather(1, tokens.unsqueeze(1)).squeeze(1)


def bench_draw(repeats: int = 5, rows: int = 32) -> None:
    from sampler import _draw
    torch.set_num_threads(1)
    print(f"\n== one draw of the decode step: ({rows}, V) logits, T = 1, CPU ms per draw (1 thread, medians of "
          f"{repeats}, interleaved)")
    gen = torch.Generator().manual_seed(0)
    for v, hid in ((49_152, 576), (151_936, 1024), (262_144, 640)):
        # Zipf-shaped rows, p ~ rank^-s with s from 1.2 to 2.4 over the batch, token ids shuffled: from a flat
        # row whose 0.95-nucleus holds ~20k tokens (sorted whole) to peaked ones of a few tokens, as an LM's are
        s = torch.linspace(1.2, 2.4, rows, dtype=torch.float64).unsqueeze(1)  # (B, 1)
        ranks = torch.rand(rows, v, generator=gen).argsort(dim=-1).double() + 1  # (B, V) a rank per token
        logits = (-s * ranks.log()).float()  # (B, V)
        probs = torch.softmax(logits.double(), dim=-1).sort(dim=-1, descending=True).values
        sizes = ((probs.cumsum(dim=-1) - probs) < 0.95).sum(dim=-1)  # (B,) nucleus sizes at top-p 0.95
        u = torch.rand(rows, generator=gen, dtype=torch.float64)
        h, w = torch.randn(rows, hid, generator=gen), torch.randn(v, hid, generator=gen) / hid**0.5
        for top_p in (1.0, 0.95):
            times = {"ours": [], "flat": [], "matmul": []}
            for _ in range(repeats):
                for name, fn in (("ours", lambda: _draw(logits, 1.0, top_p, u)),
                                 ("flat", lambda: flat_draw(logits, 1.0, top_p, u)),
                                 ("matmul", lambda: torch.mm(h, w.t()))):
                    c0 = time.process_time()
                    out = fn()
                    times[name].append(1e3 * (time.process_time() - c0))
                    if name != "matmul":
                        times.setdefault(name + "_out", out)
            med = {k: statistics.median(times[k]) for k in ("ours", "flat", "matmul")}
            (t0, l0), (t1, l1) = times["ours_out"], times["flat_out"]
            if top_p < 1.0:
                print(f"  V={v:7,d}: nucleus sizes at top-p 0.95 {int(sizes.min())}-{int(sizes.max()):,} (median "
                      f"{int(sizes.median())}), {int((sizes > 256).sum())} of {rows} rows above 256 candidates")
            print(f"  V={v:7,d} top-p {top_p:4.2f}: ours {med['ours']:7.1f} ms, reference {med['flat']:7.1f} ms "
                  f"({med['flat'] / med['ours']:5.1f}x); head matmul ({rows} x {hid} x {v:,}) {med['matmul']:6.1f} ms;"
                  f" same tokens {int((t0 == t1).sum())}/{rows}, max |logp diff| {(l0 - l1).abs().max():.1e}")


# ------------------------------------------------------------------------------------------------
# 8. stop strings: rollouts without them, this sampler.py against a copy from before them (--only stop)
# ------------------------------------------------------------------------------------------------


def stop_rollout(fn, model, rows, *, eos, pad, static: bool, **kw):
    """One rollout as Trainer.rollout calls it (T=1, cap PF_CAP, PF_SLOTS rows in flight) through `fn` (a copy's
    ``sample``) -> (rollouts, (wall-clock seconds, CPU seconds of this process))."""
    t0, c0 = time.perf_counter(), time.process_time()
    rolls = fn(model, rows, max_new_tokens=PF_CAP, temperature=1.0, eos_token_id=eos, pad_token_id=pad,
               generator=torch.Generator().manual_seed(0), max_batch_size=PF_SLOTS, static=static, **kw)
    return rolls, (time.perf_counter() - t0, time.process_time() - c0)


def stop_compare(label: str, runs: dict, repeats: int) -> dict:
    """Interleave the named zero-argument rollouts `runs` (the order rotates each repeat); print tokens per CPU and
    per wall-clock second, medians, and each one's ratio to the first; return {name: median tokens per CPU s}."""
    names = list(runs)
    out = {k: [] for k in names}
    for rep in range(repeats):
        for k in names[rep % len(names):] + names[: rep % len(names)]:
            out[k].append(runs[k]())
    tokens = {k: sum(len(r.tokens) for r in v[-1][0]) for k, v in out.items()}
    cpu = {k: statistics.median(tokens[k] / t[1][1] for t in v) for k, v in out.items()}
    wall = {k: statistics.median(tokens[k] / t[1][0] for t in v) for k, v in out.items()}
    best = {k: max(tokens[k] / t[1][1] for t in v) for k, v in out.items()}  # the least disturbed run of each
    ref = names[0]
    same = {k: sum(a.tokens == b.tokens for a, b in zip(out[ref][-1][0], v[-1][0])) for k, v in out.items()}
    print(f"  {label}:")
    for k in names:
        ratio = "" if k == ref else (f"; {k} / {ref} = {cpu[k] / cpu[ref]:.3f}x per CPU second (best runs "
                                     f"{best[k] / best[ref]:.3f}x), {wall[k] / wall[ref]:.3f}x wall-clock")
        print(f"    {k}: tokens/s CPU {cpu[k]:.0f} (best {best[k]:.0f}), wall {wall[k]:.0f} (medians of {repeats}); "
              f"{tokens[k]:,} tokens, rows identical to {ref}: {same[k]}/{len(out[ref][-1][0])}{ratio}")
    return cpu


def bench_stop(repeats: int, prompts: int = 32) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    if "module" not in _baseline:
        raise SystemExit("bench_sampler.py --only stop needs --baseline OLD/sampler.py, a copy from before stop "
                         "strings (mkdir -p /tmp/before && git show dacae3a:sampler.py > /tmp/before/sampler.py)")
    old = _baseline["module"].sample
    torch.set_num_threads(1)
    from data import tiny_tasks
    problems, _ = tiny_tasks.generate(0, prompts, 0)
    print(f"\n== stop strings: rollouts without them, this sampler.py ('after') against {BASELINE_FILE} ('before'), "
          f"interleaved, float32 CPU, 1 thread (load average {os.getloadavg()[0]:.1f} at the start)")
    for name in ("A", "B"):
        path = os.path.join(HERE, "data", "tiny_models", name)
        tok, model = AutoTokenizer.from_pretrained(path), AutoModelForCausalLM.from_pretrained(path).eval()
        rows = [tok(r["problem"] + "\n")["input_ids"] for r in problems for _ in range(PF_N)]
        kw = dict(eos=tok.eos_token_id, pad=tok.pad_token_id)
        print(f"tiny {name}: {prompts} prompts x n={PF_N} = {len(rows)} rows, T=1, cap {PF_CAP}, {PF_SLOTS} in flight")
        for static in (False, True):
            # "before again" is the same code as "before": its ratio is the noise floor of the measurement
            runs = {"before": lambda: stop_rollout(old, model, rows, static=static, **kw),
                    "after": lambda: stop_rollout(sample, model, rows, static=static, **kw),
                    "before again": lambda: stop_rollout(old, model, rows, static=static, **kw)}
            for _ in range(3):  # untimed: first-call overheads and the allocator's warm-up
                runs["before"](), runs["after"]()
            stop_compare(f"no stop strings, {'static=True' if static else 'default path'}", runs, repeats)
        free = stop_rollout(sample, model, rows, static=False, **kw)[0]
        pairs = {}
        for r in free:
            text = tok.decode(r.tokens, skip_special_tokens=True, clean_up_tokenization_spaces=False)
            for j in range(len(text) - 1):
                pairs[text[j : j + 2]] = pairs.get(text[j : j + 2], 0) + 1
        common = max(sorted(pairs), key=pairs.get)
        never = [s for s in ("Q:", "\n\n") if s not in pairs]
        runs = {"no stop strings": lambda: stop_rollout(sample, model, rows, static=False, **kw),
                f"stop {never!r} (never fires)": lambda: stop_rollout(sample, model, rows, static=False,
                                                                       stop_strings=never, tokenizer=tok, **kw),
                f"stop {[common]!r} (fires)": lambda: stop_rollout(sample, model, rows, static=False,
                                                                   stop_strings=[common], tokenizer=tok, **kw)}
        stop_compare("the cost of a stop-string check, this sampler.py, default path", runs, max(3, repeats // 3))


# ------------------------------------------------------------------------------------------------
# CLI
# ------------------------------------------------------------------------------------------------


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="smaller sizes, fewer repeats (about a minute)")
    ap.add_argument("--only", choices=["logprobs", "autocast", "sampler", "long-tail", "real-weights", "tiny-eval",
                                       "prefill", "draw", "stop"],
                    help="run one benchmark (real-weights, tiny-eval, prefill, stop: only when asked for)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of --only prefill (the others use 1)")
    ap.add_argument("--real-prompts", type=int, default=32, help="--only prefill: MATH-500 prompts (x 8 rows)")
    ap.add_argument("--no-real", action="store_true", help="--only prefill: the tiny models only")
    ap.add_argument("--no-tiny", action="store_true", help="--only prefill: the real models only")
    ap.add_argument("--repeats", type=int, default=0,
                    help="--only prefill, stop: timed repeats on the tiny models (default 15)")
    ap.add_argument("--real-only", default="", metavar="NAME",
                    help="--only prefill: only the real model whose name contains NAME")
    ap.add_argument("--baseline", metavar="FILE",
                    help="another copy of sampler.py to run beside ours (logprobs, stop)")
    ap.add_argument("--memory-child", nargs=4, metavar=("PATH", "N", "H", "V"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.baseline:
        load_baseline(args.baseline)
    if args.memory_child:
        path, n, h, v = args.memory_child
        memory_child(path, int(n), int(h), int(v))
        return
    if args.only in (None, "logprobs"):
        if args.quick:
            bench_logprobs(512, 256, 32_768, repeats=2)
        else:
            bench_logprobs(2048, 512, 151_936, repeats=3)
    if args.only in (None, "autocast"):
        bench_autocast()
    if args.only in (None, "sampler"):
        bench_sampler(train_steps=150 if args.quick else 400, repeats=2 if args.quick else 3)
    if args.only in (None, "long-tail"):
        bench_long_tail(train_steps=200 if args.quick else 300, repeats=1 if args.quick else 2)
    if args.only in (None, "draw"):
        bench_draw(repeats=3 if args.quick else 5)
    if args.only == "real-weights":
        bench_real_weights()
    if args.only == "tiny-eval":
        bench_tiny_eval()
    if args.only == "stop":
        bench_stop(repeats=args.repeats or (3 if args.quick else 15), prompts=8 if args.quick else 32)
    if args.only == "prefill":
        bench_prefill(args.threads, real=not args.no_real, prompts=8 if args.quick else 32,
                      real_prompts=args.real_prompts, repeats=args.repeats or (2 if args.quick else 15),
                      tiny=not args.no_tiny,
                      real_only=args.real_only)


if __name__ == "__main__":
    main()
