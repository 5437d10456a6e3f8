"""The log-prob kernel against the naive path, by what sets its pace on a GPU, measured without one.

    python -m bench.logprob                                  # the H200 row's shape, plus CPU time at a small shape
    python -m bench.logprob --baseline OLD/sampler.py        # also another copy's token_logprobs, side by side
    python -m bench.logprob --shape 8192 2048 151936 --cpu-shape 1024 256 32768 --repeats 5

What it prints, for each path (``naive``: log_softmax((h @ W.T).float()).gather, what bench.gpu's kernel row times;
``ours``: ``sampler.token_logprobs`` as the trainer calls it, saved logits; ``ours-recompute``: ``save_logits=False``;
``baseline``: the --baseline copy), forward + backward of float32 masters under bf16 autocast (the trainer's regime),
a random upstream gradient:

1. At the real shape (default N 8,192, H 2,048, V 151,936, bench.gpu's kernel row), on fake tensors
   (``FakeTensorMode``: shapes only, nothing allocated, nothing computed; the kernel's GPU branch, ``sampler._sub_in``):
   * aten ops dispatched (views included: every one is a host-side call; on a GPU each non-view op is a launch);
   * W casts: calls that cast W or a slice of it, and the elements they cast in units of W (1.0 = one full cast);
   * peak memory above the inputs (torch's MemTracker on the fake tensors, the plan's method, plan.py), which
     includes the (V, H) float32 gradient every path returns;
   * a roofline projection of GPU time: each op costs max(its FLOPs / F, its bytes read and written / B), summed
     (GEMM FLOPs 2mnk; bytes = the nbytes of its tensor inputs and outputs; gathers and scatters: their indexed
     entries only), against a host floor of ops x c. F, B and c are flags; defaults for an H200: 700 TFLOP/s and
     4.0 TB/s (with which this model puts the naive path at 36.5 ms, the H200's measured 37.7) and 13 us per op
     (the per-tile kernel, `--baseline`: 117 ms measured on an H200 over the 8,846 ops counted here).
     A model, not a measurement: it shows direction and where the time goes.
2. At a small shape on this CPU (default N 1,024, H 256, V 32,768), the median wall time of forward + backward,
   the paths interleaved, and the error of values and gradients against float64: direction only (a CPU's bf16
   matmuls and memory system are not a GPU's).

The targets: ours <= 1.2x naive's time and <= 1/3 of its peak on a GPU. Only bench.gpu's kernel row,
on a GPU, measures the first.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
import warnings
from unittest import mock

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import sampler
from sampler import token_logprobs

# ------------------------------------------------------------------------------------------------
# The paths
# ------------------------------------------------------------------------------------------------


def naive(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """(N,) log-probs as bench.gpu's kernel row computes the naive path: full (N, V) logits, float32 log_softmax."""
    return torch.log_softmax((hidden @ weight.T).float(), dim=-1).gather(1, targets[:, None])[:, 0]  # (N,)


def paths(baseline_file: str | None) -> dict:
    """name -> fn(hidden, weight, targets) -> (N,) log-probs; token_logprobs with the trainer's chunk_size."""
    out = {"naive": naive,
           "ours": lambda h, w, t: token_logprobs(h, w, t, chunk_size=1024),
           "ours-recompute": lambda h, w, t: token_logprobs(h, w, t, chunk_size=1024, save_logits=False)}
    if baseline_file:
        spec = importlib.util.spec_from_file_location("baseline_sampler", baseline_file)
        module = importlib.util.module_from_spec(spec)
        sys.modules["baseline_sampler"] = module  # dataclasses look their module up while the file executes
        spec.loader.exec_module(module)
        out["baseline"] = lambda h, w, t: module.token_logprobs(h, w, t, chunk_size=1024)
    return out


def fwd_bwd(fn, hidden, weight, targets, upstream, autocast: bool = True):
    """Forward under bf16 autocast (float32 masters, as the trainer), backward outside it; returns the leaves."""
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        lp = fn(h, w, targets)  # (N,)
    (lp.to(upstream.dtype) * upstream).sum().backward()
    return lp.detach(), h, w


# ------------------------------------------------------------------------------------------------
# 1. Ops, W casts, peak and a roofline at the real shape, on fake tensors
# ------------------------------------------------------------------------------------------------


class OpCounter(TorchDispatchMode):
    """Counts aten ops, casts of one weight tensor (or views of it) and a roofline estimate of their device time."""

    CASTS = ("aten._to_copy.default", "aten.copy_.default", "aten.to.dtype")

    def __init__(self, weight: torch.Tensor, flops_per_s: float, bytes_per_s: float):
        super().__init__()
        self.weight, self.flops_per_s, self.bytes_per_s = weight, flops_per_s, bytes_per_s
        self.ops = self.views = self.w_cast_calls = 0
        self.w_cast_elems = 0
        self.gemm_s = self.other_s = 0.0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = str(func)
        if not name.startswith("aten."):  # prim.device & co: fake tensors' metadata queries, not host-side ops
            return out
        self.ops += 1
        if func.is_view:
            self.views += 1
            return out
        tensors = [a for a in _flat(args) + _flat(kwargs) if isinstance(a, torch.Tensor)]
        if name in self.CASTS and tensors and any(t is self.weight or t._base is self.weight for t in tensors[:1]):
            self.w_cast_calls += 1
            self.w_cast_elems += tensors[0].numel()
        outs = [o for o in _flat(out) if isinstance(o, torch.Tensor)]
        if any(word in name for word in ("gather", "scatter", "index")):
            # these touch only the indexed entries of their first argument (and return it when in place)
            tensors, outs = tensors[1:], [o for o in outs if o is not tensors[0]]
            moved = 2 * sum(t.numel() * t.element_size() for t in tensors + outs)
        else:
            moved = sum(t.numel() * t.element_size() for t in tensors + outs)
        if name.startswith(("aten.mm", "aten.addmm", "aten.bmm")):
            a, b = (tensors[-2], tensors[-1])
            flops = 2 * a.shape[0] * a.shape[1] * b.shape[1]
            self.gemm_s += max(flops / self.flops_per_s, moved / self.bytes_per_s)
        else:
            self.other_s += moved / self.bytes_per_s
        return out


def _flat(x) -> list:
    if isinstance(x, (list, tuple)):
        return [y for item in x for y in _flat(item)]
    if isinstance(x, dict):
        return [y for item in x.values() for y in _flat(item)]
    return [x]


def fake_profile(fn, n: int, h: int, v: int, *, flops_per_s: float, bytes_per_s: float) -> dict:
    """Ops, W casts, roofline seconds and MemTracker peak above the inputs of one forward + backward at (n, h, v)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker
    # the fake tensors live on CPU, but the figures are a GPU's: take the kernel's GPU branch (sampler._sub_in)
    with FakeTensorMode(), mock.patch.object(sampler, "_SLOW_MIXED_DTYPES", set()):
        hidden, weight = torch.randn(n, h), torch.randn(v, h)  # float32 masters
        targets, upstream = torch.randint(0, v, (n,)), torch.randn(n)
        hh, ww = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        counter = OpCounter(ww, flops_per_s, bytes_per_s)
        with counter:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                lp = fn(hh, ww, targets)
            (lp.float() * upstream).sum().backward()
        hh, ww = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        mt = MemTracker()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with mt:
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    lp = fn(hh, ww, targets)
                (lp.float() * upstream).sum().backward()
        peak = mt.get_tracker_snapshot("peak")
        total = sum(sum(v for k, v in d.items() if str(k) == "Total") for d in peak.values())
    inputs = 2 * (hidden.nbytes + weight.nbytes) + targets.nbytes + upstream.nbytes  # inputs and their clones
    return dict(ops=counter.ops, views=counter.views, w_cast_calls=counter.w_cast_calls,
                w_casts=counter.w_cast_elems / weight.numel(), gemm_ms=counter.gemm_s * 1e3,
                other_ms=counter.other_s * 1e3, peak_gib=max(0, total - inputs) / 2**30)


# ------------------------------------------------------------------------------------------------
# 2. CPU time and error at a small shape
# ------------------------------------------------------------------------------------------------


def cpu_run(fns: dict, n: int, h: int, v: int, repeats: int) -> dict:
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(n, h, generator=gen) * 4 / h**0.5  # (N, H): logits of size ~4, as bench.gpu's kernel row
    weight = torch.randn(v, h, generator=gen) / h**0.5  # (V, H)
    targets = torch.randint(0, v, (n,), generator=gen)  # (N,)
    upstream = torch.randn(n, generator=gen, dtype=torch.float64)  # (N,)
    lp, hr, wr = fwd_bwd(naive, hidden.double(), weight.double(), targets, upstream, autocast=False)  # float64
    ref = (lp, hr.grad, wr.grad)
    rel = lambda a, r: float((a.double() - r).norm() / r.norm())  # noqa: E731
    out = {name: dict(times=[]) for name in fns}
    for name, fn in fns.items():  # errors, and a warm-up
        lp, hh, ww = fwd_bwd(fn, hidden, weight, targets, upstream)
        out[name]["err"] = [rel(x, r) for x, r in zip((lp, hh.grad, ww.grad), ref)]
    for _ in range(repeats):  # interleaved, so that a shared machine's load falls on all paths alike
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fwd_bwd(fn, hidden, weight, targets, upstream)
            out[name]["times"].append(time.perf_counter() - t0)
    for name in fns:
        out[name]["ms"] = statistics.median(out[name]["times"]) * 1e3
    return out


# ------------------------------------------------------------------------------------------------
# Main
# ------------------------------------------------------------------------------------------------


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", type=int, nargs=3, default=[8192, 2048, 151936], metavar=("N", "H", "V"))
    p.add_argument("--cpu-shape", type=int, nargs=3, default=[1024, 256, 32768], metavar=("N", "H", "V"))
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--baseline", default=None, help="another copy of sampler.py whose token_logprobs to compare")
    p.add_argument("--tflops", type=float, default=700.0, help="roofline: GEMM FLOP/s in units of 1e12")
    p.add_argument("--tbps", type=float, default=4.0, help="roofline: memory bytes/s in units of 1e12")
    p.add_argument("--host-us", type=float, default=13.0, help="roofline: host microseconds per aten op")
    p.add_argument("--no-cpu", action="store_true", help="skip the CPU timing")
    args = p.parse_args(argv)
    fns = paths(args.baseline)
    n, h, v = args.shape
    print(f"1. fake tensors at N x H x V = {n} x {h} x {v}, float32 masters under bf16 autocast, fwd + bwd "
          f"(roofline F {args.tflops:g} TFLOP/s, B {args.tbps:g} TB/s, host {args.host_us:g} us/op)")
    print(f"{'path':<15}{'aten ops':>9}{'views':>7}{'W casts':>9}{'(calls)':>8}{'peak GiB':>10}"
          f"{'GEMM ms':>9}{'other ms':>9}{'host ms':>9}{'proj ms':>9}{'x naive':>8}{'peak x':>8}")
    rows = {}
    for name, fn in fns.items():
        r = fake_profile(fn, n, h, v, flops_per_s=args.tflops * 1e12, bytes_per_s=args.tbps * 1e12)
        r["host_ms"] = r["ops"] * args.host_us / 1e3
        r["proj_ms"] = max(r["gemm_ms"] + r["other_ms"], r["host_ms"])
        rows[name] = r
    for name, r in rows.items():
        print(f"{name:<15}{r['ops']:>9,}{r['views']:>7,}{r['w_casts']:>9.2f}{r['w_cast_calls']:>8}"
              f"{r['peak_gib']:>10.2f}{r['gemm_ms']:>9.1f}{r['other_ms']:>9.1f}{r['host_ms']:>9.1f}"
              f"{r['proj_ms']:>9.1f}{r['proj_ms'] / rows['naive']['proj_ms']:>8.2f}"
              f"{r['peak_gib'] / rows['naive']['peak_gib']:>8.2f}")
    if not args.no_cpu:
        n, h, v = args.cpu_shape
        threads = torch.get_num_threads()
        print(f"\n2. CPU ({threads} thread(s)), N x H x V = {n} x {h} x {v}, float32 masters under bf16 autocast, "
              f"fwd + bwd, median of {args.repeats} interleaved; errors ||x - ref|| / ||ref|| against float64")
        res = cpu_run(fns, n, h, v, args.repeats)
        print(f"{'path':<15}{'ms':>9}{'x naive':>9}   err(values, grad h, grad W)")
        for name, r in res.items():
            print(f"{name:<15}{r['ms']:>9.1f}{r['ms'] / res['naive']['ms']:>9.2f}   "
                  + ", ".join(f"{e:.2e}" for e in r["err"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
