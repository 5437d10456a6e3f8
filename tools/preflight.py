"""`graft.py preflight`: before a pair is trained, will its two models exchange anything, and what survives?

A pair run costs tens of GPU-hours, and whether it can beat GRPO is decided before its first step: by how
complementary the two models are (Eq. 4) and by how much of what is exchanged survives retokenisation
and the compatibility gate (Eqs. 6-8). This samples both models once on the same prompts with the
training settings (--prompt-template, --chat-template per side, --temperature, --top-p,
--max-response-tokens, --n), verifies them, and runs on the samples what a GRAFT step runs, with the
trainer's own functions: success counts, graft_candidates, received_groups (the balanced swap, and
without it for --no-balance), score_received (retokenise -> receiver log-probs -> s and w, the body of
graft.score_peer) and compatibility_weights at --delta and at other deltas. It prints a table and
writes the same figures, plus every response's cross-score, to a JSON file (atomically).

Per direction src -> recv (the receiver learns from the source's groups) it reports:
  * complementarity (the table `graft.py complement` prints, from the same code: complement.complement_rows):
    the receiver's all-fail prompts, the share of them that the source solves at least once, and the
    share on which the source's group is mixed (Eq. 4's candidates);
  * candidates on the sample and per step at --prompts-per-step, and what the balanced swap keeps (m);
  * for the responses that would be received (balanced, and with --no-balance): retokenised length over
    source length, the share dropped as longer than --max-response-tokens (and how many of those the
    source had cut at its own cap already), the quantiles of s, the share accepted at --delta and
    at --deltas, mean w over the accepted, and the groups and responses per step that reach the update;
  * the same figures over every sampled response of the source ("cross-scores"), so a one-sided or weak
    pair still shows how the gate treats its text, with s apart for responses that ended (EOS or a --stop
    string) and responses cut at the cap (a cut response's lbar is an average over an unfinished text), and
    apart for the source's successes and failures with how many of each the gate keeps (a receiver that
    fails all n tends to find the correct answers unlikely; a gate that keeps the failures and drops the
    successes turns a mixed group's zero-sum advantages into a push away from the peer's answer: a note
    when the share kept of the successes is below that of the failures);
  * per model: tokens/s of sampling, the behaviour log-prob pass, and an estimate of a step's time.

Our choices (numbered so that reviews can cite them):
  1. The problems are the first --problems of the trainer's prompt order (exchange.batch_indices at
     step 0 with --data-seed), after dropping those whose gold verify.py cannot read or whose prompt is
     longer than --max-prompt-tokens for either model (counted). With --problems = --prompts-per-step
     the sample is exactly the pair's first batch; sampling uses the trainer's step-0 generator.
  2. The sample is one batch: selection runs on its G prompts as a step of those prompts would. Per-step
     figures at --prompts-per-step P scale the sample's counts by P / G; for the swap's m that is an upper
     estimate (the mean of a per-step min is at most the min of the means; complement.py choice 3).
  3. The received figures are the cross-scores restricted to the received groups: score_received on all
     responses gives per response what graft.score_peer gives on those groups (test_preflight.py drives
     the trainer on the same samples and compares).
  4. Step time = max over the two sides (each waits for the other's file) of: sampling P x n responses
     of the sample's mean length at the measured tokens/s, plus the behaviour log-prob pass scaled to
     P x n responses, plus an update estimated as 3 such passes (forward and backward). Each side on its
     own device; the preflight samples G x n rows, so at P x n rows on a GPU throughput is higher.
  5. Every function of a step that the preflight runs is the trainer's own, imported from where it lives
     (core.py, reward.py, runtime.py); this file never imports graft.py, which imports it for its
     `preflight` command (test_docs.py keeps the import graph acyclic).
  6. The retokenisation round trip per direction (round_trip): responses whose receiver ids do not decode
     back to their text (dropped by score_received, as in training); the source's responses whose sampled
     ids are not its tokenizer's canonical encoding of their text, encoded alone (as a receiver would) and
     after the prompt (what is left is drift, not the missing context); and the source's lbar on the
     canonical ids beside its lbar on its own ids (one more log-prob pass over the non-canonical ones); and how
     many ids differ from the encoding of the stored text, which a stop string cuts inside the stopping token.

Launch line:
    python graft.py preflight --model-a HuggingFaceTB/SmolLM3-3B-Base --model-b Qwen/Qwen3-1.7B-Base \\
        --prompts data/math_train.jsonl --problems 128 --n 8 --out runs/preflight_pair1.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tools import complement
from config import Config, add_config_flags, validate_config
from core import (Received, batch_indices, compatibility_weights, decode_response, graft_candidates,
                  group_advantages, is_success, received_groups, score_received, seeded_generator, source_canonical,
                  success_counts, verifier_text)
from exchange import StepRollouts, atomic_write
from reward import load_reward, rewards, unreadable_golds
from runtime import (DistInfo, compute_context, encode_prompt, kv_budget, load_policy, load_prompt_file,
                     setup_distributed)
from sampler import response_logprobs, sample

# The training settings that a preflight shares with `graft.py train` (same flags, defaults and help).
TRAINING_FLAGS = ("reward", "prompt_template", "chat_template", "trust_remote_code", "n", "prompts_per_step",
                  "temperature", "top_p", "max_prompt_tokens", "max_response_tokens", "delta", "compat_norm",
                  "compat_weight", "balance", "std_normalize", "seed", "data_seed", "device", "dtype", "gen_batch_size",
                  "static_decode", "decode_attention", "micro_batch_size", "logprob_chunk", "threads", "verify_workers",
                  "reward_timeout", "stop")
QUANTILES = (0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0)
UPDATE_PASSES = 3.0  # choice 4: an update ~ one forward and one backward ~ three log-prob passes

# ------------------------------------------------------------------------------------------------
# One side: load, sample, verify, behaviour log-probs (what Trainer.rollout does, on one process)
# ------------------------------------------------------------------------------------------------


@dataclass
class Side:
    """One model of the pair and its samples."""

    name: str
    cfg: Config  # this side's
    model: object = None
    tok: object = None
    stop_ids: list = field(default_factory=list)
    prompt_ids: list = field(default_factory=list)  # (G,) encoded prompts of the sampled problems
    rollouts: StepRollouts | None = None
    finish: list = field(default_factory=list)  # (G x n,) how each response ended: "eos", "stop" or "length"
    sample_s: float = 0.0
    logprob_s: float = 0.0
    load_s: float = 0.0
    dist: DistInfo = field(default_factory=DistInfo)

    @property
    def eos_id(self) -> int:
        return self.stop_ids[0]

    def policy_logprobs(self, prompts: list[list[int]], responses: list[list[int]]) -> list[torch.Tensor]:
        """Behaviour log-probs (no grad) through the chunked kernel, micro-batched as Trainer.behaviour_logprobs."""
        cfg, out = self.cfg, []
        with torch.no_grad(), compute_context(cfg, self.dist):  # bf16 autocast on GPU, as the trainer
            for i in range(0, len(prompts), cfg.micro_batch_size):
                lp, mask = response_logprobs(self.model, prompts[i: i + cfg.micro_batch_size],
                                             responses[i: i + cfg.micro_batch_size], pad_token_id=self.tok.pad_token_id,
                                             temperature=cfg.temperature or 1.0, chunk_size=cfg.logprob_chunk)
                out.extend(lp[j, : int(mask[j].sum())].float().cpu() for j in range(lp.shape[0]))
        return out


def load_side(side: Side, dist: DistInfo) -> None:
    side.dist = dist
    t0 = time.time()
    side.model, side.tok, side.stop_ids = load_policy(side.cfg.model, side.cfg, dist)  # SystemExit names --model
    side.model.eval()
    side.load_s = time.time() - t0


def roll_out(side: Side, rows: list[dict], dist: DistInfo) -> None:
    """Sample n per problem, verify, recompute behaviour log-probs: side.rollouts, as a step's rollout file."""
    cfg, n, G = side.cfg, side.cfg.n, len(rows)
    prompts = [side.prompt_ids[g] for g in range(G) for _ in range(n)]  # response r = g * n + i
    gen = seeded_generator(cfg.seed, 0, "sample", rank=0, device=dist.device)
    t0 = time.time()
    with torch.no_grad(), compute_context(cfg, dist):
        outs = sample(side.model, prompts, max_new_tokens=cfg.max_response_tokens, temperature=cfg.temperature,
                      top_p=cfg.top_p, eos_token_id=side.stop_ids, pad_token_id=side.tok.pad_token_id, generator=gen,
                      max_batch_size=cfg.gen_batch_size, static=cfg.static_decode, attention=cfg.decode_attention,
                      stop_strings=cfg.stop,
                      max_cache_bytes=kv_budget(dist.device, side.model) if cfg.static_decode != "off" else None,
                      tokenizer=side.tok, progress=sys.stderr.isatty())  # the trainer's KV pool (Trainer.rollout)
    side.sample_s = time.time() - t0
    side.finish = [o.finish for o in outs]  # a stopped row has no EOS but is not cut at the cap either
    # as Trainer.rollout: stored text through a stop string, the verifier's cut before it (graft.py departure 11)
    texts = [decode_response(o.tokens, side.tok, eos_token_ids=side.stop_ids, stop=cfg.stop)[0] for o in outs]
    verdicts = rewards(cfg.reward, [verifier_text(t, cfg.stop) for t in texts],
                     [rows[r // n]["answer"] for r in range(G * n)], workers=cfg.verify_workers,
                     timeout=cfg.reward_timeout)
    t0 = time.time()
    old = side.policy_logprobs(prompts, [o.tokens for o in outs])
    side.logprob_s = time.time() - t0
    reward_values = torch.tensor(verdicts, dtype=torch.float32).view(G, n)  # (G, n)
    side.rollouts = StepRollouts(
        prompt_ids=[r["id"] for r in rows], tokens=[o.tokens for o in outs], logprobs=old, texts=texts,
        eos=torch.tensor([o.ended_with_eos for o in outs]).view(G, n), rewards=reward_values,
        advantages=group_advantages(reward_values, std_normalize=cfg.std_normalize))


def cross_scores(src: Side, recv: Side) -> Received:
    """score_received of every response of src under recv (choice 3): core.Received over the G x n responses."""
    ro, cfg = src.rollouts, recv.cfg
    G, n = ro.rewards.shape
    return score_received(ro.texts, ro.eos.view(-1).tolist(), ro.lbar(cfg.compat_norm).view(-1),
                               [recv.prompt_ids[r // n] for r in range(G * n)], tokenizer=recv.tok,
                               eos_token_id=recv.eos_id, logprob_fn=recv.policy_logprobs,
                               max_response_tokens=cfg.max_response_tokens, compat_norm=cfg.compat_norm,
                               delta=cfg.delta, compat_weight=cfg.compat_weight)


def round_trip(src: Side, cross: Received) -> dict:
    """The retokenisation round trip of src's G x n responses towards the other side (choice 6): how many the
    receiver's encoding loses text of (cross.lost: dropped), how many of src's own ids are not its tokenizer's
    canonical encoding of their text, encoded alone and after the prompt, and src's lbar (per token, EOS
    included as in its own) on the canonical ids beside its lbar on its own ids, over the non-canonical ones."""
    ro, n = src.rollouts, src.rollouts.n
    R = len(ro.tokens)
    eos = ro.eos.view(-1).tolist()
    own = ro.lbar("token").view(-1)  # (R,)
    bodies = [t[:-1] if e else t for t, e in zip(ro.tokens, eos)]  # the sampled ids, a final EOS left out
    # the stored text is cut after a stop string: its encoding misses what the stopping token held past it
    stored = sum(src.tok.encode(x, add_special_tokens=False) != b for x, b in zip(ro.texts, bodies))
    out = {"responses": R, "lost": len(cross.lost), "lost_index": list(cross.lost), "stored_text_differs": stored}
    for key, ctx in (("alone", False), ("in_prompt", True)):
        canon = [source_canonical(t, src.tok, eos_token_ids=src.stop_ids,
                                  prompt_ids=src.prompt_ids[r // n] if ctx else None) for r, t in enumerate(ro.tokens)]
        off = [r for r, (ok, ids) in enumerate(canon) if ok is False and ids]  # re-scorable: canonical ids exist
        lps = src.policy_logprobs([src.prompt_ids[r // n] for r in off],
                           [canon[r][1] + ([src.eos_id] if eos[r] else []) for r in off]) if off else []
        lbar_canon = torch.tensor([float(lp.mean()) for lp in lps])  # (K,)
        diff = lbar_canon - own[off] if off else torch.zeros(0)  # (K,)
        out[key] = {"noncanonical": sum(ok is not True for ok, _ in canon),
                    "boundary": sum(ok is None for ok, _ in canon), "rescored": len(off),
                    "lbar_own": float(own[off].mean()) if off else None,
                    "lbar_canonical": float(lbar_canon.mean()) if off else None,
                    "lbar_diff_mean": float(diff.mean()) if off else None,
                    "lbar_diff_abs_max": float(diff.abs().max()) if off else None}
    return out


# ------------------------------------------------------------------------------------------------
# The report: figures of one direction from the samples (pure given the scored responses)
# ------------------------------------------------------------------------------------------------


def response_stats(rs: list[int], *, cross, src_len: list[int], src_cut: list[bool], src_ok: list[bool],
                   delta: float, deltas: tuple[float, ...], compat_weight: bool, n: int, scale: float) -> dict:
    """Figures over a set of the source's responses (flat indices r = g * n + i) as the receiver would see them.

    cross: score_received over all G x n source responses; src_len, src_cut: (G x n,) source lengths in
    its own tokens (EOS included) and whether each was cut at the source's cap (neither EOS nor a stop
    string ended it); src_ok: (G x n,) whether the source's reward was positive; scale: P / G (choice 2).
    Shares are of len(rs); a figure over nothing is None.
    """
    pos = {r: j for j, r in enumerate(cross.kept)}  # response -> its position among the retokenised
    kept = [r for r in rs if r in pos]
    dropped = [r for r in rs if r not in pos]
    j = torch.tensor([pos[r] for r in kept], dtype=torch.long)  # (K,)
    s = cross.s[j] if kept else torch.zeros(0)  # (K,)
    lr, ls = cross.lbar_recv[j] if kept else torch.zeros(0), cross.lbar_src[j] if kept else torch.zeros(0)
    w = cross.w[j] if kept else torch.zeros(0)  # (K,) at --delta (1 each without the compat weight)
    ratio = [len(cross.ids[pos[r]]) / max(1, src_len[r]) for r in kept]
    share = lambda c: c / len(rs) if rs else None  # noqa: E731
    quant = {f"p{round(100 * q)}": float(torch.quantile(s, q)) for q in QUANTILES} if kept else None
    accepted = [r for r, wi in zip(kept, w.tolist()) if wi > 0]

    def accepted_at(d: float) -> int:
        if not compat_weight:  # every retained response passes: w = 1
            return len(kept)
        return int((compatibility_weights(lbar_recv=lr, lbar_src=ls, delta=d) > 0).sum()) if kept else 0

    s_of = list(zip(s.tolist(), kept))  # (s, response) of each retokenised response
    ended_kept, cut_kept = [x for x, r in s_of if not src_cut[r]], [x for x, r in s_of if src_cut[r]]
    ok_s, bad_s = [x for x, r in s_of if src_ok[r]], [x for x, r in s_of if not src_ok[r]]
    median = lambda xs: float(torch.tensor(xs).median()) if xs else None  # noqa: E731
    groups = sorted({r // n for r in accepted})
    return {
        "responses": len(rs), "retokenised": len(kept), "dropped_length": len(dropped),
        "dropped_cut": sum(1 for r in dropped if src_cut[r]), "dropped_share": share(len(dropped)),
        "length_ratio_mean": sum(ratio) / len(ratio) if ratio else None,
        "length_ratio_total": (sum(len(cross.ids[pos[r]]) for r in kept) / max(1, sum(src_len[r] for r in kept))
                               if kept else None),
        "s_quantiles": quant, "s_mean": float(s.mean()) if kept else None,
        "s_median_ended": median(ended_kept), "s_median_cut": median(cut_kept),
        "ended": sum(1 for r in rs if not src_cut[r]),
        "s_median_success": median(ok_s), "s_median_failure": median(bad_s),
        "successes": sum(1 for r in rs if src_ok[r]), "failures": sum(1 for r in rs if not src_ok[r]),
        "accepted_successes": sum(1 for r in accepted if src_ok[r]),
        "accepted_failures": sum(1 for r in accepted if not src_ok[r]),
        "accepted": len(accepted), "accepted_share": share(len(accepted)),
        "accepted_at": {f"{d:g}": share(accepted_at(d)) for d in sorted(set(deltas) | {delta})},
        "mean_w": float(w[w > 0].mean()) if accepted else None,
        "groups_to_update": len(groups), "groups_to_update_per_step": len(groups) * scale,
        "responses_to_update_per_step": len(accepted) * scale,
    }


def direction_report(src: Side, recv: Side, *, cross, received: torch.Tensor, unbalanced: torch.Tensor,
                     deltas: tuple[float, ...], m: int, trip: dict) -> dict:
    """Every figure of the direction src -> recv. received / unbalanced: (G,) bool, the groups recv gets with and
    without the balanced swap (received_groups); m: the swap's min(|C_a->b|, |C_b->a|) on the sample; trip:
    round_trip(src, cross)."""
    cfg, ro = recv.cfg, src.rollouts
    G, n = ro.rewards.shape
    P = cfg.prompts_per_step
    scale = P / G
    k_src, k_recv = success_counts(ro.rewards), success_counts(recv.rollouts.rewards)  # (G,) each
    cand = graft_candidates(k_recv=k_recv, k_src=k_src, n=n)  # (G,) Eq. 4
    assert torch.equal(cand, unbalanced), "--no-balance receives exactly the candidates"
    comp = complement.complementarity(k_recv=k_recv, k_src=k_src, n=n, batch_size=P)
    src_len = [len(t) for t in ro.tokens]
    src_cut = [f == "length" for f in src.finish]
    src_ok = is_success(ro.rewards).view(-1).tolist()  # (G x n,)
    kw = dict(cross=cross, src_len=src_len, src_cut=src_cut, src_ok=src_ok, delta=cfg.delta, deltas=deltas,
              compat_weight=cfg.compat_weight, n=n, scale=scale)
    flat = lambda mask: [g * n + i for g in torch.nonzero(mask).view(-1).tolist() for i in range(n)]  # noqa: E731
    return {
        "source": src.name, "receiver": recv.name,
        "recv_all_fail": int((k_recv == 0).sum()), "src_solves": int(((k_recv == 0) & (k_src >= 1)).sum()),
        "src_mixed": int(cand.sum()),  # Eq. 4: the receiver fails all n, the source is mixed
        "solved_share": comp["solved_share"] if comp["recv_all_fail"] else None,
        "mixed_share": comp["mixed_share"] if comp["recv_all_fail"] else None,
        "candidates": int(cand.sum()), "candidates_per_step": int(cand.sum()) * scale,
        "m": m, "kept": int(received.sum()), "kept_per_step": int(received.sum()) * scale,
        "received_groups": torch.nonzero(received).view(-1).tolist(),
        "received": response_stats(flat(received), **kw),
        "no_balance": response_stats(flat(unbalanced), **kw),
        "all": response_stats(list(range(G * n)), **kw),
        "round_trip": trip,
    }


def speed(side: Side, *, prompts_per_step: int) -> dict:
    """Sampling and log-prob throughput of one side, and its part of a step's time (choice 4)."""
    ro = side.rollouts
    tokens = sum(len(t) for t in ro.tokens)
    responses = len(ro.tokens)
    tok_s = tokens / side.sample_s if side.sample_s > 0 else float("inf")
    per_step = prompts_per_step * ro.n
    sample_s = per_step * (tokens / responses) / tok_s
    logprob_s = side.logprob_s * per_step / responses
    return {"tokens": tokens, "responses": responses, "mean_len": tokens / responses,
            "eos_share": float(ro.eos.float().mean()), "pass1": float(ro.rewards.mean()),
            "stop_share": sum(f == "stop" for f in side.finish) / responses,
            "sample_s": side.sample_s, "tokens_per_s": tok_s, "logprob_s": side.logprob_s, "load_s": side.load_s,
            "step_s_estimate": sample_s + logprob_s * (1 + UPDATE_PASSES)}


# ------------------------------------------------------------------------------------------------
# The table on screen
# ------------------------------------------------------------------------------------------------


def _fmt(x, kind: str = "n") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    if kind == "%":
        return f"{100 * x:.1f}%"
    if kind == "f":
        return f"{x:.2f}"
    return f"{x:g}" if isinstance(x, float) else str(x)


def format_report(report: dict) -> str:
    """The printed report: settings, the complement table, then one column per direction."""
    st, (ab, ba) = report["settings"], (report["directions"]["a_to_b"], report["directions"]["b_to_a"])
    a, b = report["models"]["a"], report["models"]["b"]
    P = st["prompts_per_step"]
    out = [f"preflight: {report['problems']} problems of {st['prompts']} x n={st['n']}, T={st['temperature']}, "
           f"cap {st['max_response_tokens']} tokens, delta {st['delta']}, lbar per {st['compat_norm']}, "
           f"P={P} prompts per step",
           f"  A = {a['path']} ({'chat template' if a['chat_template'] else 'raw text'}; vocab {a['vocab']:,})",
           f"  B = {b['path']} ({'chat template' if b['chat_template'] else 'raw text'}; vocab {b['vocab']:,})"]
    if report["skipped"]:
        out.append(f"  skipped problems: {report['skipped']}")
    out += ["", report["complement_table"], ""]
    rows: list[tuple[str, object, object, str]] = [
        ("receiver's all-fail prompts (sample)", ab["recv_all_fail"], ba["recv_all_fail"], "n"),
        ("  of them the source solves / is mixed", f"{_fmt(ab['solved_share'], '%')} / {_fmt(ab['mixed_share'], '%')}",
         f"{_fmt(ba['solved_share'], '%')} / {_fmt(ba['mixed_share'], '%')}", "s"),
        ("candidates (Eq. 4): sample / per step", f"{ab['candidates']} / {ab['candidates_per_step']:.1f}",
         f"{ba['candidates']} / {ba['candidates_per_step']:.1f}", "s"),
        (f"{'balanced swap' if st['balance'] else '--no-balance'} (m = {ab['m']}): kept / per step",
         f"{ab['kept']} / {ab['kept_per_step']:.1f}", f"{ba['kept']} / {ba['kept_per_step']:.1f}", "s"),
    ]
    swap = "balanced swap" if st["balance"] else "--no-balance"
    for key, title in (("received", f"received ({swap})"), ("no_balance", "received with --no-balance"),
                       ("all", "every sampled response (cross-scores)")):
        x, y = ab[key], ba[key]
        rows += [
            (f"{title}: responses", x["responses"], y["responses"], "n"),
            ("  retokenised / source length", _fmt(x["length_ratio_mean"], "f"), _fmt(y["length_ratio_mean"], "f"),
             "s"),
            ("  dropped too long (of them cut at cap)", f"{_fmt(x['dropped_share'], '%')} ({x['dropped_cut']})",
             f"{_fmt(y['dropped_share'], '%')} ({y['dropped_cut']})", "s"),
            ("  s p10 / p50 / p90", _quant(x), _quant(y), "s"),
            ("  s median: ended (EOS or stop) / cut at cap", *(f"{_fmt(z['s_median_ended'], 'f')} / "
                                                               f"{_fmt(z['s_median_cut'], 'f')}" for z in (x, y)), "s"),
            ("  s median: successes / failures", *(f"{_fmt(z['s_median_success'], 'f')} / "
                                                   f"{_fmt(z['s_median_failure'], 'f')}" for z in (x, y)), "s"),
            ("  accepted of the successes; failures", *(f"{z['accepted_successes']}/{z['successes']}; "
                                                        f"{z['accepted_failures']}/{z['failures']}" for z in (x, y)),
             "s"),
        ]
        for d in x["accepted_at"]:
            mark = " (--delta)" if float(d) == st["delta"] else ""
            rows.append((f"  accepted at delta {d}{mark}", x["accepted_at"][d], y["accepted_at"][d], "%"))
        rows += [("  mean w of the accepted", x["mean_w"], y["mean_w"], "f")]
        if key != "all":
            rows.append(("  to the update per step: groups / responses",
                         f"{x['groups_to_update_per_step']:.1f} / {x['responses_to_update_per_step']:.1f}",
                         f"{y['groups_to_update_per_step']:.1f} / {y['responses_to_update_per_step']:.1f}", "s"))
    rt = lambda d, k: d["round_trip"][k]  # noqa: E731
    rows += [
        ("round trip: receiver ids lose text (dropped)",
         *(f"{rt(d, 'lost')}/{rt(d, 'responses')}" for d in (ab, ba)), "s"),
        ("source ids not canonical: alone / after prompt",
         *(f"{rt(d, 'alone')['noncanonical']} / {rt(d, 'in_prompt')['noncanonical']}" for d in (ab, ba)), "s"),
        ("  of them a token across the prompt's end", *(str(rt(d, "in_prompt")["boundary"]) for d in (ab, ba)), "s"),
        ("  ids differ from the stored (cut) text's encoding", *(str(rt(d, "stored_text_differs")) for d in (ab, ba)),
         "s")]
    for key, title in (("alone", "alone"), ("in_prompt", "after prompt")):
        rows.append((f"  source lbar own -> canonical ({title})", *(
            f"{_fmt(rt(d, key)['lbar_own'], 'f')} -> {_fmt(rt(d, key)['lbar_canonical'], 'f')}" for d in (ab, ba)),
            "s"))
    width = max(len(r[0]) for r in rows) + 2
    out.append(f"{'':<{width}}{'A -> B':>16}{'B -> A':>16}")
    for label, x, y, kind in rows:
        x, y = (z if kind == "s" else _fmt(z, kind) for z in (x, y))
        out.append(f"{label:<{width}}{x:>16}{y:>16}")
    out.append("")
    for name in ("a", "b"):
        sp = report["models"][name]["speed"]
        out.append(f"{name.upper()}: pass@1 {100 * sp['pass1']:.1f}%, mean length {sp['mean_len']:.0f} tokens, "
                   f"EOS {100 * sp['eos_share']:.0f}%, stop string {100 * sp['stop_share']:.0f}%, sampling "
                   f"{sp['tokens_per_s']:.0f} tokens/s "
                   f"({sp['sample_s']:.0f} s), log-probs {sp['logprob_s']:.0f} s; step at P={P} ~ "
                   f"{sp['step_s_estimate']:.0f} s")
    out.append(f"estimated pair step: {report['step_s_estimate']:.0f} s (the slower side; preflight.py choice 4)")
    out += [f"NOTE: {x}" for x in report["notes"]]
    return "\n".join(out)


def _quant(x: dict) -> str:
    q = x["s_quantiles"]
    return "-" if q is None else f"{q['p10']:.2f}/{q['p50']:.2f}/{q['p90']:.2f}"


def notes(report: dict) -> list[str]:
    """Plain-language warnings where the figures say that a pair would exchange little."""
    out, st = [], report["settings"]
    ab, ba = report["directions"]["a_to_b"], report["directions"]["b_to_a"]
    if ab["kept"] + ba["kept"] == 0:
        one = [f"{d['source'].upper()} -> {d['receiver'].upper()}" for d in (ab, ba) if d["candidates"]]
        out.append("zero responses would be received " + ("with the balanced swap (m = 0): " if st["balance"] else ": ")
                   + (f"only {', '.join(one)} has candidates, so --no-balance would exchange them"
                      if one else "neither direction has a candidate (no prompt where one model fails all n "
                                  "and the other is mixed); easier prompts or more samples (--n) give some")
                   + "; the cross-scores show how the gate would treat each model's text")
    for d in (ab, ba):
        x = d["all"]
        if x["responses"] and x["dropped_share"] and x["dropped_share"] > 0.2:
            out.append(f"{d['source'].upper()} -> {d['receiver'].upper()}: {100 * x['dropped_share']:.0f}% of the "
                       f"source's responses exceed --max-response-tokens {st['max_response_tokens']} in the "
                       f"receiver's tokens ({x['dropped_cut']} of them were cut at the source's cap already): "
                       f"raise the cap")
        r = d["received"] if d["received"]["retokenised"] else d["no_balance"]
        if r.get("successes") and r.get("failures") and r["accepted_failures"] and (
                r["accepted_successes"] / r["successes"] < r["accepted_failures"] / r["failures"]):
            out.append(f"{d['source'].upper()} -> {d['receiver'].upper()}: of the groups it would receive, the gate "
                       f"keeps {r['accepted_successes']} of {r['successes']} successes and {r['accepted_failures']} "
                       f"of {r['failures']} failures (s median {_fmt(r['s_median_success'], 'f')} vs "
                       f"{_fmt(r['s_median_failure'], 'f')}): what reaches the update leans to the groups' "
                       f"negative advantages")
        at = x["accepted_at"].get(f"{st['delta']:g}")
        if x["retokenised"] and at is not None and at < 0.2:
            out.append(f"{d['source'].upper()} -> {d['receiver'].upper()}: the gate accepts {100 * at:.0f}% of the "
                       f"source's responses at --delta {st['delta']}; see s by ending and at the other deltas")
    return out


# ------------------------------------------------------------------------------------------------
# The command
# ------------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    """The training flags from config.Config (same names, defaults, help), plus the preflight's own."""
    p = argparse.ArgumentParser(prog="graft.py preflight", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                                description="Sample two models on the same prompts with the training settings and "
                                "report what a GRAFT pair of them would exchange (preflight.py).")
    p.add_argument("--model-a", required=True, help="side A: hub id or local transformers folder")
    p.add_argument("--model-b", required=True, help="side B: hub id or local transformers folder")
    p.add_argument("--prompts", required=True, help="prompt JSONL ({id, problem, answer} per line)")
    p.add_argument("--problems", type=int, default=64, help="problems to sample (choice 1)")
    p.add_argument("--chat-template-a", action=argparse.BooleanOptionalAction, default=None,
                   help="side A's --chat-template (default: --chat-template)")
    p.add_argument("--chat-template-b", action=argparse.BooleanOptionalAction, default=None,
                   help="side B's --chat-template (default: --chat-template)")
    p.add_argument("--deltas", default="0,0.5,0.6,0.7,0.9", help="other compatibility floors to report")
    p.add_argument("--out", default="runs/preflight.json", help="the report as JSON (written atomically)")
    add_config_flags(p, list(TRAINING_FLAGS))
    return p


def usable_rows(rows: list[dict], sides: list[Side], *, prompts: str, problems: int,
                data_seed: int) -> tuple[list[dict], list[str]]:
    """The first `problems` rows of the trainer's order (choice 1) that are usable, and why others were skipped."""
    bad_gold = set(unreadable_golds(rows, reward=sides[0].cfg.reward, workers=sides[0].cfg.verify_workers,
                                    timeout=sides[0].cfg.reward_timeout))
    order = batch_indices(len(rows), 0, len(rows), data_seed)  # the trainer's step-0 order of the whole file
    out, skipped = [], {"unreadable gold": 0, "prompt too long": 0}
    for i in order:
        if len(out) == problems:
            break
        r = rows[i]
        if r["id"] in bad_gold:
            skipped["unreadable gold"] += 1
            continue
        ids = [encode_prompt(r["problem"], s.tok, template=s.cfg.prompt_template, chat=s.cfg.chat_template)
               for s in sides]
        if any(len(x) > s.cfg.max_prompt_tokens for x, s in zip(ids, sides)):
            skipped["prompt too long"] += 1
            continue
        out.append(r)
        for s, x in zip(sides, ids):
            s.prompt_ids.append(x)
    if not out:
        raise SystemExit(f"graft.py preflight: --prompts {prompts}: no usable problem among {len(rows)} "
                         f"({skipped['unreadable gold']} gold answers verify.py cannot read, "
                         f"{skipped['prompt too long']} prompts over --max-prompt-tokens)")
    return out, [f"{v} {k}" for k, v in skipped.items() if v]


def preflight(args) -> tuple[dict, list[Side]]:
    """Load, sample, verify and score both sides: the report as a dict (JSON-ready), and the two sides."""
    train = {name: getattr(args, name) for name in TRAINING_FLAGS}
    sides = []
    for name, path, chat in (("a", args.model_a, args.chat_template_a), ("b", args.model_b, args.chat_template_b)):
        cfg = Config(model=path, name=name, prompts=args.prompts,
                     **(train | {"chat_template": train["chat_template"] if chat is None else chat}))
        try:
            validate_config(cfg)
            load_reward(cfg.reward)
        except ValueError as e:
            raise SystemExit(f"graft.py preflight: {e}")
        sides.append(Side(name, cfg))
    try:
        deltas = tuple(float(x) for x in args.deltas.split(",") if x.strip())
    except ValueError:
        raise SystemExit(f"graft.py preflight: --deltas {args.deltas!r}: a comma list of numbers, e.g. 0.5,0.9")
    if args.problems < 1:
        raise SystemExit(f"graft.py preflight: --problems must be >= 1, got {args.problems}")
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = load_prompt_file(args.prompts)  # SystemExit names the file and line
    dist = setup_distributed(sides[0].cfg)
    for s in sides:
        load_side(s, dist)
    sample_rows, skipped = usable_rows(rows, sides, prompts=args.prompts, problems=args.problems,
                                       data_seed=args.data_seed)
    for s in sides:
        print(f"[preflight] sampling {s.name.upper()} ({s.cfg.model}): {len(sample_rows)} problems x {s.cfg.n}",
              file=sys.stderr, flush=True)
        roll_out(s, sample_rows, dist)
    a, b = sides
    t0 = time.time()
    cross = {"a_to_b": cross_scores(a, b), "b_to_a": cross_scores(b, a)}
    cross_s = time.time() - t0
    n = args.n
    k_a, k_b = success_counts(a.rollouts.rewards), success_counts(b.rollouts.rewards)  # (G,) each
    # What each side receives, as Trainer.select calls it for a pair (own counts first; A's name sorts first)
    into = {}
    for own, peer, k_own, k_peer in ((a, b, k_a, k_b), (b, a, k_b, k_a)):
        into[own.name] = {bal: received_groups(k_own=k_own, k_peer=k_peer, n=n, own_is_a=own.name < peer.name,
                                                    balance=bal) for bal in (True, False)}
    m = min(int(graft_candidates(k_recv=k_b, k_src=k_a, n=n).sum()),
            int(graft_candidates(k_recv=k_a, k_src=k_b, n=n).sum()))
    directions = {f"{src.name}_to_{recv.name}": direction_report(
        src, recv, cross=cross[f"{src.name}_to_{recv.name}"], received=into[recv.name][args.balance],
        unbalanced=into[recv.name][False], deltas=deltas, m=m,
        trip=round_trip(src, cross[f"{src.name}_to_{recv.name}"])) for src, recv in ((a, b), (b, a))}
    sources = [complement.SourceCounts(s.cfg.model, "preflight", {pid: (int(k), n) for pid, k in
                                                                zip(s.rollouts.prompt_ids, ks.tolist())},
                                    note=f"sampled now, n={n}")
               for s, ks in ((a, k_a), (b, k_b))]
    comp_rows = complement.complement_rows(sources, n=n, batch_size=args.prompts_per_step)
    report = {
        "settings": {"prompts": args.prompts, **train, "deltas": list(deltas)},
        "problems": len(sample_rows), "problem_ids": [r["id"] for r in sample_rows], "skipped": ", ".join(skipped),
        "models": {s.name: {"path": s.cfg.model, "chat_template": s.cfg.chat_template, "vocab": len(s.tok),
                            "successes": ks.tolist(),
                            "speed": speed(s, prompts_per_step=args.prompts_per_step)}
                   for s, ks in ((a, k_a), (b, k_b))},
        "complement": complement.complement_json(sources, comp_rows, n=n, batch_size=args.prompts_per_step),
        "complement_table": complement.format_complement_table(sources, comp_rows, n=n,
                                                            batch_size=args.prompts_per_step),
        "directions": directions, "cross_score_s": cross_s,
        "responses": {key: per_response(src, cross[key]) for key, src in (("a_to_b", a), ("b_to_a", b))},
    }
    report["step_s_estimate"] = max(report["models"][x]["speed"]["step_s_estimate"] for x in ("a", "b"))
    report["notes"] = notes(report)
    return report, sides


def per_response(src: Side, cross) -> list[dict]:
    """Every sampled response of src with its cross-score under the other model (s and w None: too long)."""
    ro = src.rollouts
    pos = {r: j for j, r in enumerate(cross.kept)}
    n = ro.n
    out = []
    for r, toks in enumerate(ro.tokens):
        j = pos.get(r)
        out.append({"group": r // n, "text": ro.texts[r], "reward": float(ro.rewards.view(-1)[r]),
                    "eos": bool(ro.eos.view(-1)[r]), "finish": src.finish[r],
                    "src_len": len(toks), "recv_len": None if j is None else len(cross.ids[j]),
                    "lbar_src": float(ro.lbar("token").view(-1)[r]) if j is None else float(cross.lbar_src[j]),
                    "lbar_recv": None if j is None else float(cross.lbar_recv[j]),
                    "s": None if j is None else float(cross.s[j]), "w": None if j is None else float(cross.w[j])})
    return out


def main(argv: list[str] | None = None) -> int:
    """`graft.py preflight`: the report on screen and in --out."""
    args = build_parser().parse_args(argv)
    t0 = time.time()
    report, _ = preflight(args)
    report["wall_s"] = time.time() - t0
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(out, lambda tmp: Path(tmp).write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8"))
    print(format_report(report))
    print(f"[preflight] {report['wall_s']:.0f}s wall; report {out}")
    return 0
