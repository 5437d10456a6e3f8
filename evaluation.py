"""Evaluation: avg@k = pass@1 with the training prompt and verifier (paper: T = 0.6, top-p 0.95, k = 8).

`graft.py eval` (run_eval) and the trainer's --eval-every (Trainer.validate) both call evaluate_benchmarks: each
benchmark's problems sampled cfg.eval_samples times, rows split over ranks, each response verified by the reward
(reward.rewards, --reward) on the text cut before a stop string (graft.py departure 11). No departure from the paper
lives here beyond the settings (--eval-temperature, --eval-top-p, --eval-samples: the paper's T = 0.6, 0.95, 8).

Launch line:
    python graft.py eval --model runs/graft_qwen/checkpoints/best --benchmarks all
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from config import Config
from core import decode_response, seeded_generator, verifier_text
from exchange import atomic_write
from reward import reward_options, rewards
from runtime import (DistInfo, encode_prompt, gather_lists, kv_budget, load_policy, load_prompt_file,
                     setup_distributed, shard, unshard)
from sampler import sample

# ------------------------------------------------------------------------------------------------
# The benchmarks, one evaluation, its summary and the `graft.py eval` command
# ------------------------------------------------------------------------------------------------

BENCHMARKS = {"math500": "math500.jsonl", "aime2024": "aime2024.jsonl", "aime2025": "aime2025.jsonl",
              "amc23": "amc23.jsonl", "minerva": "minerva.jsonl"}


def benchmark_files(spec: str, data_dir: str) -> dict[str, Path]:
    """--benchmarks: 'all', a comma list of names, or paths to prompt JSONL files -> {name: path}."""
    names = list(BENCHMARKS) if spec == "all" else [s.strip() for s in spec.split(",") if s.strip()]
    out = {}
    for name in names:
        path = Path(data_dir) / BENCHMARKS[name] if name in BENCHMARKS else Path(name)
        if not path.is_file():
            hint = "python -m data.prepare writes it" if name in BENCHMARKS else f"known names: {', '.join(BENCHMARKS)}"
            raise SystemExit(f"--benchmarks: {path} not found ({hint})")
        out[name if name in BENCHMARKS else path.stem] = path
    return out


def evaluate(model, tokenizer, stop_ids, problems: list[dict], cfg: Config, dist_info: DistInfo, *,
             progress: bool = True, desc: str = "eval", rel_tol: float | None = None,
             max_batch_size: int | None = None) -> list[dict]:
    """Sample cfg.eval_samples responses per problem and verify them; rows split over ranks.

    rel_tol: the verifier's numeric tolerance for decimals (None = its MATH default; Minerva's
    three-significant-figure golds need verify.MINERVA_REL_TOL). max_batch_size: None = --gen-batch-size.
    Returns one dict per problem, in order: id, answer, correct (list of 0/1), and the responses
    when cfg.save_responses.
    """
    k = cfg.eval_samples
    jobs = [(p, j) for p in range(len(problems)) for j in range(k)]
    mine = shard(jobs, dist_info)
    prompts = [encode_prompt(problems[p]["problem"], tokenizer, template=cfg.prompt_template, chat=cfg.chat_template)
               for p, _ in mine]
    gen = seeded_generator(cfg.seed, 0, "eval", rank=dist_info.rank, device=dist_info.device)
    max_new = cfg.eval_max_tokens or cfg.max_response_tokens
    was_training = model.training
    if progress and dist_info.main:
        print(f"[eval] {desc}: {len(problems)} problems x {k} samples", file=sys.stderr, flush=True)
    outs = sample(model, prompts, max_new_tokens=max_new, temperature=cfg.eval_temperature, top_p=cfg.eval_top_p,
                  eos_token_id=stop_ids, pad_token_id=tokenizer.pad_token_id, generator=gen,
                  max_batch_size=max_batch_size or cfg.gen_batch_size, static=cfg.static_decode,
                  attention=cfg.decode_attention,
                  max_cache_bytes=kv_budget(dist_info.device, model) if cfg.static_decode != "off" else None,
                  stop_strings=cfg.stop, tokenizer=tokenizer, progress=progress and dist_info.main)
    texts = [verifier_text(decode_response(o.tokens, tokenizer, eos_token_ids=stop_ids, stop=cfg.stop)[0], cfg.stop)
             for o in outs]  # what the verifier reads: cut before a stop string (departure 11)
    model.train(was_training)
    tol = {} if rel_tol is None else {"rel_tol": rel_tol}
    verdicts = rewards(cfg.reward, texts, [problems[p]["answer"] for p, _ in mine], **reward_options(cfg), **tol)
    results = unshard(gather_lists(list(zip(verdicts, texts)), dist_info), len(jobs), dist_info)
    out = []
    for p, prob in enumerate(problems):
        chunk = results[p * k: (p + 1) * k]
        row = {"id": prob["id"], "answer": prob["answer"], "correct": [float(s) for s, _ in chunk]}
        if cfg.save_responses:
            row["responses"] = [t for _, t in chunk]
        out.append(row)
    return out


def summarize(per_problem: list[dict]) -> dict:
    """pass@1 = mean correctness over all samples (avg@k); pass@k = a problem solved by any sample."""
    if not per_problem:
        return {"pass@1": 0.0, "pass@k": 0.0, "problems": 0}
    p1 = sum(sum(r["correct"]) / len(r["correct"]) for r in per_problem) / len(per_problem)
    pk = sum(1.0 for r in per_problem if max(r["correct"]) > 0) / len(per_problem)
    return {"pass@1": p1, "pass@k": pk, "problems": len(per_problem)}


def evaluate_benchmarks(model, tokenizer, stop_ids, cfg: Config, dist_info: DistInfo, *, progress: bool = True,
                        max_batch_size: int | None = None) -> dict:
    """Every benchmark of --benchmarks; 'mean' is the unweighted mean of their pass@1 (the paper's score)."""
    files = benchmark_files(cfg.benchmarks, cfg.data_dir)
    res, per = {}, {}
    for name, path in files.items():
        problems = load_prompt_file(str(path))
        if cfg.eval_max_problems:
            problems = problems[: cfg.eval_max_problems]
        tol = None
        if name == "minerva":
            from verify import MINERVA_REL_TOL as tol  # Minerva golds carry ~3 significant figures
        per[name] = evaluate(model, tokenizer, stop_ids, problems, cfg, dist_info, progress=progress, desc=name,
                             rel_tol=tol, max_batch_size=max_batch_size)
        res[name] = summarize(per[name])
    mean = sum(r["pass@1"] for r in res.values()) / max(1, len(res))
    return {"benchmarks": res, "mean": mean, "problems": per}


def print_eval_table(res: dict, k: int) -> None:
    print(f"{'benchmark':<12} {'problems':>8} {'pass@1':>8} {f'pass@{k}':>8}")
    for name, r in res["benchmarks"].items():
        print(f"{name:<12} {r['problems']:>8} {100 * r['pass@1']:>8.2f} {100 * r['pass@k']:>8.2f}")
    print(f"{'mean':<12} {'':>8} {100 * res['mean']:>8.2f}")


def run_eval(cfg: Config) -> dict:
    dist_info = setup_distributed(cfg)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    if not cfg.model:
        raise SystemExit("--model is required")
    model, tok, stop = load_policy(cfg.model, cfg, dist_info, for_training=False)
    t0 = time.time()
    res = evaluate_benchmarks(model, tok, stop, cfg, dist_info)
    if dist_info.main:
        print_eval_table(res, cfg.eval_samples)
        print(f"[eval] {time.time() - t0:.0f}s; settings: {cfg.eval_samples} samples, T={cfg.eval_temperature}, "
              f"top-p={cfg.eval_top_p}")
        default = Path(cfg.model) if Path(cfg.model).is_dir() else Path(cfg.out)
        path = Path(cfg.eval_out) if cfg.eval_out else default / "eval_results.json"
        settings = {"samples": cfg.eval_samples, "temperature": cfg.eval_temperature, "top_p": cfg.eval_top_p,
                    "max_tokens": cfg.eval_max_tokens or cfg.max_response_tokens}
        payload = {"model": cfg.model, "settings": settings, **res}
        atomic_write(path, lambda tmp: Path(tmp).write_text(json.dumps(payload, indent=1)))
        print(f"[eval] per-problem results -> {path}")
    return res
