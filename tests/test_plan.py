"""plan.py: the memory plan against real measurements, the trainer's refusal, the sampler's KV bytes per token.

Tiny configs only (a few seconds each): the plan's update figure against MemTracker on real tensors of the same
step; the trainer stopping before the weights load with a message that names the phase and the flag, and the
flag it names making the plan fit; the KV cache bytes per token read through sampler.sample against the formula
for the dtypes it stores; run_pair.sh passing --fsdp to the side whose data-parallel plan does not fit.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import re
import subprocess
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, MistralConfig, Qwen3Config

import evaluation
import graft
import plan
import runtime
from config import Config
from sampler import cast_weights_once, response_logprobs
from core import policy_loss
from runtime import adamw_kernel
from test_graft import planted, tiny  # noqa: F401  (tiny: fixture)

SHAPE = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, tie_word_embeddings=True)


def tiny_config(**over) -> Qwen3Config:
    return Qwen3Config(**(SHAPE | over))


# ------------------------------------------------------------------------------------------------
# The update figure: the plan on fake tensors against MemTracker on real tensors of the same step
# ------------------------------------------------------------------------------------------------


def real_update_peak(config, cfg: Config, *, prompt_len: int) -> int:
    """Peak bytes of one update micro-batch on real CPU tensors, as the trainer runs it: a model past its first
    step (AdamW moments and gradients held), the chunked log-prob forward, core.policy_loss, backward, the step."""
    from torch.distributed._tools.mem_tracker import MemTracker
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable()
        model.config.use_cache = False
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay,
                            **adamw_kernel(torch.device("cuda")))  # the trainer's kernel on a GPU (fused), as planned
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    rows, cap = cfg.micro_batch_size, cfg.max_response_tokens
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, config.vocab_size, (prompt_len,), generator=g).tolist() for _ in range(rows)]
    # the last row one token short: a real micro-batch is padded, so transformers builds its attention mask (with
    # rows all alike it would skip it, which it cannot know on fake tensors: the plan counts the mask)
    responses = [torch.randint(3, config.vocab_size, (cap - (i == rows - 1),), generator=g).tolist()
                 for i in range(rows)]
    mt = MemTracker()
    mt.track_external(model, opt)
    with mt:
        lp, mask = response_logprobs(model, prompts, responses, pad_token_id=0, chunk_size=cfg.logprob_chunk,
                                     share_prefix=cfg.share_prefix)  # (B, T)
        ones = torch.ones(rows)  # (B,)
        loss, _ = policy_loss(logp=lp, old_logp=lp.detach() - 0.01, advantages=ones, mask=mask, weights=ones,
                              eps_low=cfg.eps_low, eps_high=cfg.eps_high, loss_denominator=int(mask.sum()))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(list(model.parameters()), cfg.grad_clip)
        opt.step()
    (snap,) = mt.get_tracker_snapshot("peak").values()
    return int(snap["Total"])


@pytest.mark.parametrize("checkpointing", [False, True])
def test_plan_update_equals_a_real_measurement_of_the_same_step(checkpointing):
    cfg = Config(model="tiny", dtype="float32", micro_batch_size=4, max_response_tokens=96, max_prompt_tokens=32,
                 gen_batch_size=4, gradient_checkpointing=checkpointing, logprob_chunk=64)
    config = tiny_config()
    m = plan.measure(config, cfg, prompt_len=32, eval_prompt_len=1)
    by_name = {ph.name: ph for ph in plan.phases(m, cfg, ranks=1, prompt_len=32, eval_prompt_len=1)}
    planned = max(by_name["update"].total, by_name["optimizer step"].total)
    real = real_update_peak(config, cfg, prompt_len=32)
    assert abs(planned - real) <= 0.10 * real, f"plan {planned / 2**20:.2f} MiB vs real {real / 2**20:.2f} MiB"


# ------------------------------------------------------------------------------------------------
# The trainer's refusal: the phase and the flag, and the flag makes it fit
# ------------------------------------------------------------------------------------------------


class Loaded(Exception):
    """Raised in place of loading the weights: the plan let the trainer through."""


def test_trainer_refuses_before_loading_and_the_named_flag_fits(tmp_path, monkeypatch):
    config = tiny_config(num_hidden_layers=6)
    (tmp_path / "m").mkdir()
    config.save_pretrained(tmp_path / "m")  # a config and no weights: the check runs before any weight loads
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "problem": f"{i}+1", "answer": str(i + 1)}) + "\n"
                               for i in range(8)))
    base = Config(model=str(tmp_path / "m"), prompts=str(prompts), prompts_per_step=8, dtype="float32",
                  micro_batch_size=8, max_response_tokens=256, max_prompt_tokens=16, gen_batch_size=2,
                  logprob_chunk=64, memory_plan="always", threads=1)

    def load_policy(*a, **k):
        raise Loaded

    monkeypatch.setattr(graft, "load_policy", load_policy)
    measured, measure = {}, plan.measure  # each setting measured once: the trainer's plan repeats the test's own

    def once(config, cfg, **kw):
        key = (config.to_json_string(), cfg.gradient_checkpointing, tuple(sorted(kw.items())))
        measured[key] = measured.get(key) or measure(config, cfg, **kw)
        return measured[key]

    monkeypatch.setattr(plan, "measure", once)
    # the card between the update's need without and with checkpointing (as the plan measures them)
    needs = {}
    for ckpt in (False, True):
        cfg = dataclasses.replace(base, gradient_checkpointing=ckpt)
        phases, _ = plan.plan_side(cfg, ranks=1, eval_files=[])
        needs[ckpt] = {ph.name: ph.total for ph in phases}
    assert needs[True]["update"] < needs[False]["update"]
    card = (needs[True]["update"] + needs[False]["update"]) / 2 / plan.MARGIN
    assert max(v for k, v in needs[False].items() if k != "update") < plan.MARGIN * card, needs
    gib = card / plan.GIB
    with pytest.raises(SystemExit) as e:
        graft.Trainer(dataclasses.replace(base, gpu_memory=gib, out=str(tmp_path / "r1")))
    assert "phase 'update'" in str(e.value) and "Fix: --gradient-checkpointing" in str(e.value), str(e.value)
    with pytest.raises(Loaded):  # the named flag: the plan passes, the trainer goes on to load the weights
        graft.Trainer(dataclasses.replace(base, gpu_memory=gib, gradient_checkpointing=True, out=str(tmp_path / "r2")))


def test_plan_command_prints_each_side_and_fails_on_a_misfit(tmp_path, capsys):
    (tmp_path / "c.json").write_text(json.dumps(tiny_config(num_hidden_layers=2).to_dict()))
    flags = ["plan", "--model", f"{tmp_path / 'c.json'},{tmp_path / 'c.json'}", "--max-response-tokens", "32",
             "--max-prompt-tokens", "8", "--gen-batch-size", "2", "--micro-batch-size", "2", "--dtype", "float32"]
    with pytest.raises(SystemExit) as e:
        graft.main(flags + ["--gpu-memory", "8"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.count("| update |") == 2 and "| rollout |" in out, out
    with pytest.raises(SystemExit) as e:
        graft.main(flags + ["--gpu-memory", "0.0001"])
    assert e.value.code == plan.MISFIT
    assert "does not fit: phase 'rollout'" in capsys.readouterr().out


# ------------------------------------------------------------------------------------------------
# The KV cache bytes per token, read through the sampler
# ------------------------------------------------------------------------------------------------

def test_kv_bytes_per_token_through_the_sampler():
    config = tiny_config()
    layers, kv_heads, head_dim = 4, 2, 16
    fp32, dtypes = plan.kv_bytes_per_token(config, autocast=False)
    assert dtypes == "K float32, V float32"
    assert fp32 == 2 * layers * kv_heads * head_dim * 4
    amp, dtypes = plan.kv_bytes_per_token(config, autocast=True)
    # under bf16 autocast the sampler stores K and V in bf16 (sampler.py departure 13), though Qwen3's q/k norm and
    # the fp32 RoPE tables make K float32 in the model's own forward
    assert dtypes == "K bfloat16, V bfloat16"
    assert amp == 2 * layers * kv_heads * head_dim * 2
    deeper, _ = plan.kv_bytes_per_token(tiny_config(num_hidden_layers=8), autocast=True)
    assert deeper == 2 * amp  # read from every layer of the sampler's cache, not from the config


def test_plan_counts_the_samplers_bf16_copy_of_the_linear_weights():
    # sampler.py departure 17: under autocast sample() holds a bf16 copy of every nn.Linear weight for the call; the
    # plan's rollout and evaluation phases carry it as a term, by hand: 2 bytes x the Linear weights (the tied
    # lm_head is the embedding, counted once), and nothing for bf16 weights (no autocast, no copy)
    config = tiny_config(num_hidden_layers=2)
    h, i, q, kv = SHAPE["hidden_size"], SHAPE["intermediate_size"], 4 * 16, 2 * 16
    per_layer = h * q + 2 * h * kv + q * h + 3 * h * i  # q, k, v, o, gate, up, down
    expected = 2 * (2 * per_layer + SHAPE["vocab_size"] * h)
    base = dict(model="tiny", micro_batch_size=2, max_response_tokens=16, max_prompt_tokens=8, gen_batch_size=2,
                logprob_chunk=16, eval_every=1)
    m = plan.measure(config, Config(**base), prompt_len=8, eval_prompt_len=8)
    assert m.cast_copy == expected and m.eval_cast_copy == expected
    phases = {ph.name: ph for ph in plan.phases(m, Config(**base), ranks=1, prompt_len=8, eval_prompt_len=8)}
    assert phases["rollout"].terms["bf16 sampling copy"] == expected
    assert phases["evaluation"].terms["bf16 sampling copy"] == expected
    assert "bf16 sampling copy" not in phases["update"].terms
    bf16 = plan.measure(config, Config(**base, dtype="bfloat16"), prompt_len=8, eval_prompt_len=8)
    assert bf16.cast_copy == 0 and bf16.eval_cast_copy == 0


# ------------------------------------------------------------------------------------------------
# The KV pool: the trainer's budget, the rows in flight it holds, the launcher's slots; dense for the default path
# ------------------------------------------------------------------------------------------------

POOL_CFG = dict(model="tiny", micro_batch_size=2, max_response_tokens=16, max_prompt_tokens=8, gen_batch_size=16,
                logprob_chunk=16, eval_every=1, eval_max_tokens=24)


@pytest.mark.parametrize("attention", ["gather", "auto"])
def test_pool_rows_in_flight_against_a_direct_computation(attention):
    """The static path (a full-attention Qwen3 on CUDA): the rollout's and the evaluation's K/V is the budget
    runtime.kv_budget gives on this card, cut as sampler.py departures 13 and 18 state it, computed here by hand: S
    slots (at most --gen-batch-size; on the gathered path each pays one layer's gathered K/V with its repeat_kv copy;
    the kernel, which "auto" plans for Qwen3, gathers nothing; a small budget cuts S below the slots), blocks of 16
    tokens for the rest; the rows in flight are the pool's tokens // a row's."""
    cfg = Config(**POOL_CFG, decode_attention=attention)
    m = plan.measure(tiny_config(num_hidden_layers=2), cfg, prompt_len=8, eval_prompt_len=6)
    assert m.paged and m.kv_token == 2 * 2 * 2 * 16 * 2  # bf16 K and V: 2 layers x 2 heads x 16
    # gathered: the gather + repeat_kv's copy to 4 heads = 2 x the gathered K/V; the kernel: none
    copies = 3 if attention == "gather" else 0
    assert (m.layers, m.kv_copies, m.attention) == (2, copies, "kernel" if copies == 0 else "gather")
    held = m.params + m.grads + m.opt_state  # at the sample() call, data parallel
    for tokens_wanted, capped in ((3000, True), (450, False)):
        card = held + m.cast_copy + int(tokens_wanted * m.kv_token / runtime.KV_BUDGET_SHARE)
        by = {ph.name: ph for ph in plan.phases(m, cfg, ranks=1, prompt_len=8, eval_prompt_len=6, card=card,
                                                mean_prompt=5, mean_eval_prompt=3)}
        budget = int(runtime.KV_BUDGET_SHARE * (card - held - m.cast_copy))
        block = 16 * m.kv_token
        for name, longest, mean, cap in (("rollout", 8, 5, 16), ("evaluation", 6, 3, 24)):
            ph = by[name]
            length, expected_row, worst_row = longest + cap, mean + cap // 2 + 8, longest + cap + 8
            width, gather = -(-length // 16), copies * (length * m.kv_token // 2)  # a full row's blocks; a slot's
            by_pool = (budget - block) // (gather + -(-expected_row // 16) * block)  # rows at expected lengths
            fit = min((budget - (width + 1) * block) // gather, by_pool) if gather else by_pool  # kernel: the pool
            slots = min(16, fit)
            blocks = min((budget - slots * gather) // block - 1, slots * width)
            assert ph.terms["KV pool"] == (blocks + 1) * block and "KV cache" not in ph.terms
            assert ph.terms["K/V gathered by a decode step"] == slots * gather
            assert ph.terms["KV pool"] + ph.terms["K/V gathered by a decode step"] <= budget  # never past it
            assert (ph.rows.expected_tokens, ph.rows.worst_tokens, ph.rows.pool_tokens) == (expected_row, worst_row,
                                                                                            blocks * 16)
            assert (ph.rows.slots, ph.rows.pool_rows) == (slots, fit)
            assert ph.rows.expected == min(slots, blocks * 16 // expected_row)
            assert ph.rows.worst == min(slots, blocks * 16 // worst_row)
            assert (slots == 16) is capped, (name, slots)  # a big budget: the slots bind; a small one: the budget
        # the phase's total is its parts: the state, the copy, the prefill (measured at its prompts), the K/V
        roll = by["rollout"]
        assert roll.total == held + m.cast_copy + m.prefill_act + sum(
            roll.terms[k] for k in ("KV pool", "K/V gathered by a decode step"))
    assert m.prefill_prompts == plan.prefill_prompts(16, cfg.n) == 3  # 16 slots of n = 8 copies: 2 prompts + 1 split
    # under --fsdp the budget is what the shard and the gathered weights leave: a bigger pool
    fs = plan.phases(m, dataclasses.replace(cfg, fsdp=True), ranks=4, prompt_len=8, eval_prompt_len=6, card=card)
    assert fs[0].terms["KV pool"] > by["rollout"].terms["KV pool"]


def test_the_plans_cut_is_the_samplers():
    """What the plan prints is what sample() builds: the rollout's slots, pool blocks and bytes for a K/V budget,
    against the stats of a real sample() call on the static path's gathered attention with that budget (bf16 K/V
    under CPU autocast, as the trainer's under CUDA autocast), the prompts all of the planned length; the K/V the
    call held stays within the budget. The kernel's cut: test_the_plans_kernel_cut_is_the_samplers."""
    from sampler import sample
    cfg = Config(**POOL_CFG, decode_attention="gather")
    config = tiny_config(num_hidden_layers=2)
    m = plan.measure(config, cfg, prompt_len=8, eval_prompt_len=6)
    held = m.params + m.grads + m.opt_state
    card = held + m.cast_copy + int(700 * m.kv_token / runtime.KV_BUDGET_SHARE)  # a budget that cuts the slots
    roll = plan.phases(m, cfg, ranks=1, prompt_len=8, eval_prompt_len=6, card=card, mean_prompt=8)[0]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    prompts = [[3 + i % 50] + [5] * 7 for i in range(40)]  # 40 prompts of 8 tokens
    stats = {}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        sample(model, prompts, max_new_tokens=16, temperature=1.0, eos_token_id=[1], max_batch_size=16,
               static="on", attention="gather", max_cache_bytes=roll.rows.budget, stats=stats,
               generator=torch.Generator().manual_seed(0))
    assert stats["static"] and stats["kv_bytes_per_token"] == m.kv_token and stats["attention"] == "gather"
    assert 1 < roll.rows.slots < 16, roll.rows  # the budget, not the slot cap, decided
    assert (stats["slots"], stats["kv_blocks"] * stats["kv_block_size"]) == (roll.rows.slots, roll.rows.pool_tokens)
    assert stats["kv_pool_bytes"] == roll.terms["KV pool"]
    assert roll.terms["KV pool"] + roll.terms["K/V gathered by a decode step"] <= roll.rows.budget
    assert stats["kv_blocks_peak"] <= stats["kv_blocks"] and stats["rows_in_flight_peak"] <= roll.rows.slots
    assert stats["kv_gather_bytes"] == roll.terms["K/V gathered by a decode step"] > 0


@pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                    reason="Triton is not installed: the paged decode kernel runs only through Triton (on CPU its "
                           "interpreter, TRITON_INTERPRET=1)")
def test_the_plans_kernel_cut_is_the_samplers():
    """The kernel's cut (what "auto" plans for a family the kernel serves): the rollout's slots, pool blocks and
    bytes for a K/V budget against a real sample(attention="kernel") call with that budget, run through Triton's
    interpreter in a fresh Python (Triton reads TRITON_INTERPRET when sampler imports it). float32 weights and no
    autocast (--dtype float32: the interpreter's bf16 matmul is broken, sampler.py departure 18), so float32 K/V;
    no K/V gathered, and the budget cuts the slots below --gen-batch-size."""
    from test_paged_kernel import interpreted
    cfg = Config(**POOL_CFG, dtype="float32")
    m = plan.measure(tiny_config(num_hidden_layers=2), cfg, prompt_len=8, eval_prompt_len=6)
    assert (m.attention, m.kv_copies, m.cast_copy) == ("kernel", 0, 0)
    held = m.params + m.grads + m.opt_state
    card = held + int(400 * m.kv_token / runtime.KV_BUDGET_SHARE)  # 400 tokens: 12 rows of 2 blocks, not 16
    roll = plan.phases(m, cfg, ranks=1, prompt_len=8, eval_prompt_len=6, card=card, mean_prompt=8)[0]
    assert 1 < roll.rows.slots < 16 and roll.terms["K/V gathered by a decode step"] == 0, roll.rows
    stats = interpreted(f"""
        import json, torch
        from transformers import AutoModelForCausalLM
        from sampler import sample
        from test_plan import tiny_config
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(tiny_config(num_hidden_layers=2), dtype=torch.float32).eval()
        prompts = [[3 + i % 50] + [5] * 7 for i in range(24)]  # 24 prompts of 8 tokens
        stats = {{}}
        sample(model, prompts, max_new_tokens=16, temperature=1.0, eos_token_id=[1], max_batch_size=16, static="on",
               attention="kernel", max_cache_bytes={roll.rows.budget}, stats=stats,
               generator=torch.Generator().manual_seed(0))
        print(json.dumps({{k: v for k, v in stats.items() if isinstance(v, (int, float, str, bool))}}))
    """)
    assert stats["static"] and stats["attention"] == "kernel" and stats["kv_bytes_per_token"] == m.kv_token
    assert (stats["slots"], stats["kv_blocks"] * stats["kv_block_size"]) == (roll.rows.slots, roll.rows.pool_tokens)
    assert stats["kv_pool_bytes"] == roll.terms["KV pool"] <= roll.rows.budget and stats["kv_gather_bytes"] == 0
    assert stats["kv_blocks_peak"] <= stats["kv_blocks"] and stats["rows_in_flight_peak"] <= roll.rows.slots


def test_the_kernels_cut_holds_more_slots_and_gather_keeps_the_old_cut(tmp_path, capsys):
    """At one budget, a GQA model (4 query heads on 2 KV heads): --decode-attention gather cuts the budget as before
    the kernel (sampler.pool_plan with transient_copies = 3: the gather and repeat_kv's copy); the default (auto,
    the kernel planned) with no copies: every byte to the pool, more slots, a larger launcher count. The printed
    plan names the attention and says that the kernel gathers nothing."""
    from sampler import pool_plan, transient_copies
    config = tiny_config(num_hidden_layers=2)
    cut = {}
    for attention in ("gather", "auto"):
        cfg = Config(**(POOL_CFG | dict(gen_batch_size=64)), decode_attention=attention)
        m = plan.measure(config, cfg, prompt_len=8, eval_prompt_len=6)
        card = m.params + m.grads + m.opt_state + m.cast_copy + int(900 * m.kv_token / runtime.KV_BUDGET_SHARE)
        by = {ph.name: ph for ph in plan.phases(m, cfg, ranks=1, prompt_len=8, eval_prompt_len=6, card=card)}
        r = by["rollout"].rows
        copies = transient_copies(config) if attention == "gather" else 0
        want = pool_plan(slots=64, length=8 + 16, expected=r.expected_tokens, block_size=16, token_bytes=m.kv_token,
                         layers=2, budget=r.budget, copies=copies)
        assert (r.slots, r.pool_tokens, by["rollout"].terms["KV pool"]) == (want.slots, want.blocks * 16,
                                                                           (want.blocks + 1) * 16 * m.kv_token)
        assert by["rollout"].terms["K/V gathered by a decode step"] == want.slots * copies * (24 * m.kv_token // 2)
        cut[attention] = (r.slots, r.pool_rows, plan.launch_slots(list(by.values()), card, rows=64))
    assert transient_copies(config) == 3
    assert cut["auto"][0] > cut["gather"][0] and cut["auto"][1] > cut["gather"][1], cut
    assert cut["auto"][2] >= cut["gather"][2], cut
    (tmp_path / "c.json").write_text(json.dumps(config.to_dict()))
    flags = ["plan", "--model", str(tmp_path / "c.json"), "--max-response-tokens", "16", "--max-prompt-tokens", "8",
             "--gen-batch-size", "16", "--micro-batch-size", "2", "--gpu-memory", "1"]
    for attention, said, gathered in (("auto", "kernel", "none: the kernel reads blocks in place;"),
                                      ("gather", "gather", r"\d+\.\d GiB;")):
        with pytest.raises(SystemExit) as e:
            graft.main(flags + ["--decode-attention", attention])
        assert e.value.code == 0
        out = capsys.readouterr().out
        assert f"decode attention planned: {said} (" in out, out
        assert re.search(f"K/V gathered by a decode step: {gathered}", out), out


def test_a_family_the_kernel_does_not_serve_is_planned_gathered():
    """StableLM (full attention, so the static path; not among the kernel's checked families): "auto" plans the
    gathered cut and says why; --decode-attention kernel is refused as sample() would refuse it."""
    from transformers import StableLmConfig
    config = StableLmConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2)
    m = plan.measure(config, Config(**POOL_CFG), prompt_len=8, eval_prompt_len=6)
    assert m.paged and m.attention == "gather" and m.kv_copies == 3, m
    assert "'stablelm' is not among the families" in m.attention_why, m.attention_why
    with pytest.raises(SystemExit, match="--decode-attention kernel: the paged decode kernel cannot serve"):
        plan.measure(config, Config(**POOL_CFG, decode_attention="kernel"), prompt_len=8, eval_prompt_len=6)


@pytest.mark.parametrize("how", ["sliding window", "static off"])
def test_default_path_keeps_the_dense_cache(how):
    """Models the static path cannot run (a sliding window: sampler.resolve_static) and --static-decode off: a dense
    cache of every slot at the longest prompt + cap, whatever the card; the rows in flight are the slots."""
    cfg = Config(**POOL_CFG)
    if how == "sliding window":
        config = MistralConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=4)
    else:
        config, cfg = tiny_config(num_hidden_layers=2), dataclasses.replace(cfg, static_decode="off")
    m = plan.measure(config, cfg, prompt_len=8, eval_prompt_len=6)
    assert not m.paged
    by = {ph.name: ph for ph in plan.phases(m, cfg, ranks=1, prompt_len=8, eval_prompt_len=6, card=4 * 2**20)}
    assert by["rollout"].terms["KV cache"] == 16 * (8 + 16) * m.kv_token and "KV pool" not in by["rollout"].terms
    slots = runtime.eval_rows(cfg)  # dense: the rollout's KV tokens on rows of the eval cap: 16 x 24 // 32 = 12
    assert slots == 12 and by["evaluation"].terms["KV cache"] == slots * (6 + 24) * m.eval_kv_token
    assert by["rollout"].rows.expected == by["rollout"].rows.worst == 16


def test_prompt_lengths_longest_and_mean_by_loop(tmp_path):
    """The plan's prompt lengths: the longest and the mean of the prompts as the trainer encodes them, each capped at
    --max-prompt-tokens; --max-prompt-tokens for both without a file."""
    from runtime import encode_prompt
    from transformers import AutoTokenizer
    model = Path(__file__).resolve().parents[1] / "data" / "tiny_models" / "A"
    problems = ["1+1", "what is 12 times 13, and why?", "x" * 400]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps({"problem": p}) + "\n" for p in problems))
    cfg = Config(model=str(model), prompts=str(tmp_path / "p.jsonl"), max_prompt_tokens=100,
                 prompt_template="{problem}\n")
    tok = AutoTokenizer.from_pretrained(model)
    want = [min(100, len(encode_prompt(p, tok, template=cfg.prompt_template, chat=cfg.chat_template)))
            for p in problems]
    assert want[-1] == 100 and len(set(want)) == 3  # one capped, all different
    longest, mean, how = plan.prompt_lengths(cfg, [cfg.prompts])
    assert (longest, mean) == (100, round(sum(want) / 3)) and how == "measured in 1 file(s)"
    assert plan.prompt_lengths(cfg, [str(tmp_path / "none.jsonl")]) == (100, 100, "--max-prompt-tokens")


def test_launch_slots_by_hand():
    """launch_slots on planted phases: the most slots whose prefill (in proportion to the prompts it runs) fits 95%
    of the card, at most the pool's rows at expected lengths, a multiple of 8; dense: the cache grows with them."""
    gib = plan.GIB
    card = round(80 * gib)  # 95%: 76 GiB
    rows = plan.Rows(slots=32, paged=True, pool_tokens=100 * 1000, expected_tokens=1000, worst_tokens=5000,
                     copies=8, prefill_prompts=5)  # the pool holds 100 rows at expected lengths
    roll = plan.Phase("rollout", {"weights": 40 * gib, "KV pool": 21 * gib, "prefill": 5 * gib}, "", rows)
    # fixed 61 GiB + 1 GiB a prompt <= 76: 15 prompts = ceil(s / 8) + 1, so s <= 112; the pool: 100 -> 96
    assert plan.launch_slots([roll], card, rows=32) == 96
    rows.pool_tokens = 200 * 1000
    assert plan.launch_slots([roll], card, rows=32) == 112
    dense = plan.Rows(slots=32, paged=False, pool_tokens=0, expected_tokens=1000, worst_tokens=5000, copies=1,
                      prefill_prompts=32)
    roll = plan.Phase("rollout", {"weights": 40 * gib, "KV cache": 32 * gib, "prefill": 0}, "", dense)
    assert plan.launch_slots([roll], card, rows=32) == 32  # 40 + s GiB <= 76: 36 -> 32
    assert plan.prefill_prompts(8, 8) == 2 and plan.prefill_prompts(3, 8) == 2 and plan.prefill_prompts(5, 1) == 5


def test_trainer_passes_the_pool_and_the_evaluation_gets_the_slots(tiny, tmp_path, monkeypatch):
    """Trainer.rollout and Trainer.validate hand sample() runtime.kv_budget(device, model) (a planted figure here: the
    CPU has none); the evaluation runs --gen-batch-size slots on the static path (its pool decides the rows) and
    the dense rule's rows on the default path, with an eval cap longer than the rollout's."""
    tr, batch, _, _ = planted(tiny, tmp_path, monkeypatch, gen_batch_size=6, max_prompt_tokens=20, eval_max_tokens=40,
                              benchmarks=str(tiny / "p.jsonl"), eval_samples=2, eval_max_problems=3)
    asked, given = [], []

    def budget(device, model):
        asked.append((device, model))
        return 987_654_321

    def recording(module):
        real = module.sample

        def spy(model, prompts, **kw):
            given.append((kw["max_cache_bytes"], kw["max_batch_size"]))
            return real(model, prompts, **kw)
        return spy

    for module in (graft, evaluation):
        monkeypatch.setattr(module, "kv_budget", budget)
        monkeypatch.setattr(module, "sample", recording(module))
    tr.rollout(1, batch)
    assert given == [(987_654_321, 6)] and asked == [(tr.dist.device, tr.model)]
    for paged, rows in ((True, 6), (False, 6 * (20 + 16) // (20 + 40))):
        given.clear()
        monkeypatch.setattr(graft, "resolve_static", lambda static, model, device, paged=paged: paged)
        tr.validate(1)
        assert given == [(987_654_321, rows)], (paged, given)


def test_kv_budget_is_the_plans_pool(monkeypatch):
    """runtime.kv_budget on a GPU: KV_BUDGET_SHARE of the driver's free memory plus the allocator's unused cache, less
    the bf16 copy sample() will make (cast_copy_bytes: cast_weights_once's bytes, counted without casting); the
    plan's pool_bytes is the same formula on the card."""
    model = AutoModelForCausalLM.from_config(tiny_config(num_hidden_layers=2), dtype=torch.float32)
    cpu = torch.device("cpu")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with cast_weights_once(model, cpu) as cast:
            pass
        assert runtime.cast_copy_bytes(model, cpu) == cast > 0
    assert runtime.cast_copy_bytes(model, cpu) == 0  # no autocast, no copy
    cuda = torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d: (7_000_000, 10_000_000))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d: 2_500_000)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda d: 2_000_000)
    monkeypatch.setattr(runtime, "cast_copy_bytes", lambda model, device: 300_000)
    want = int(runtime.KV_BUDGET_SHARE * (7_000_000 + 500_000 - 300_000))
    assert runtime.kv_budget(cuda, model) == want
    assert runtime.kv_budget(cuda) == int(runtime.KV_BUDGET_SHARE * 7_500_000)  # no model: no copy left out
    assert runtime.kv_budget(cpu, model) is None
    assert plan.pool_bytes(10_000_000, 2_500_000, 300_000) == int(runtime.KV_BUDGET_SHARE * 7_200_000)


# ------------------------------------------------------------------------------------------------
# run_pair.sh: FSDP=auto follows the plan's exit status; --gen-batch-size is the plan's slot count
# ------------------------------------------------------------------------------------------------

FAKE_PYTHON = '''#!/usr/bin/env bash
# stands for python: `graft.py plan` prints plan.LAUNCH_LINE with 96 slots data parallel, 160 with --fsdp (none when
# $NOLINE is set) and exits 3 (does not fit) for the model named in $MISFIT unless --fsdp; every call logs its arguments
if [ "$2" = plan ]; then
  echo "plan $*" >> "$LOG"
  case " $* " in *" --fsdp "*) slots=160 ;; *) slots=96 ;; esac
  [ -n "$NOLINE" ] || echo "$LAUNCH_LINE $slots"
  case " $* " in *" --fsdp "*) ;; *" --model $MISFIT "*) exit 3 ;; esac
  exit 0
fi
echo "$*" >> "$LOG"
'''


def launch_pair(tmp_path, **env) -> tuple[list[str], dict[str, str], subprocess.CompletedProcess]:
    """`bash run_pair.sh pair1` on 8 GPUs (NGPU) with FAKE_PYTHON: (the plan calls, {side: its train line}, result)."""
    tmp_path.mkdir(exist_ok=True)
    fake = tmp_path / "python"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    (tmp_path / "data").mkdir(exist_ok=True)
    (tmp_path / "data" / "math_train.jsonl").write_text("")
    log = tmp_path / "log"
    e = dict(os.environ, PYTHON=str(fake), DATA=str(tmp_path / "data"), RUNS=str(tmp_path / "runs"), LOG=str(log),
             STEPS="1", NGPU="8", MISFIT="none", LAUNCH_LINE=plan.LAUNCH_LINE)
    e.pop("GEN_BATCH", None)
    root = Path(__file__).resolve().parents[1]
    r = subprocess.run(["bash", str(root / "run_pair.sh"), "pair1"], env=e | env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = log.read_text().splitlines() if log.is_file() else []
    if env.get("DRY_RUN") == "1":  # the commands are printed, not run
        lines = [x.removeprefix("+ ") for x in r.stdout.splitlines()]
    trains = {x.split("--name ")[1].split()[0]: x for x in lines if " train " in x}
    assert set(trains) == {"a", "b"}, lines
    return [x for x in lines if x.startswith("plan ")], trains, r


def gen_batch(train_line: str) -> int:
    """The --gen-batch-size a train line passes (the last one: argparse keeps the last)."""
    return int(train_line.split("--gen-batch-size ")[-1].split()[0])


@pytest.mark.parametrize("misfit, least, sharded", [("Qwen/Qwen3-1.7B-Base", "64", "b"), ("none", "64", ""),
                                                    ("none", "128", "ab")])
def test_run_pair_switches_fsdp_and_takes_the_slots_from_the_plan(tmp_path, misfit, least, sharded):
    plans, trains, _ = launch_pair(tmp_path, MISFIT=misfit, FSDP_MIN_SLOTS=least)
    # every plan: the side's ranks and flags, probed at PLAN_SLOTS (8) slots; a side planned again sharded when data
    # parallel does not fit (misfit) or gives fewer slots (96) than FSDP_MIN_SLOTS where sharded gives more (160)
    assert all("--ranks 4 " in x and "--gradient-checkpointing" in x and "--gen-batch-size 8" in x for x in plans)
    assert len(plans) == 2 + len(sharded), plans
    assert len([x for x in plans if x.endswith("--fsdp")]) == len(sharded)
    assert {s for s, x in trains.items() if " --fsdp" in x} == set(sharded), trains
    # each side launched with the slots its own plan printed: 160 sharded, 96 data parallel
    assert {s: gen_batch(x) for s, x in trains.items()} == {s: 160 if s in sharded else 96 for s in "ab"}


def test_run_pair_gen_batch_set_wins_and_the_fallback(tmp_path):
    plans, trains, _ = launch_pair(tmp_path, MISFIT="Qwen/Qwen3-1.7B-Base", GEN_BATCH="48")
    # GEN_BATCH: the plan runs for FSDP=auto only (once a side, at those slots), and the user's count is launched
    assert len(plans) == 2 and all("--gen-batch-size 48" in x for x in plans), plans
    assert {s: gen_batch(x) for s, x in trains.items()} == {"a": 48, "b": 48} and "--fsdp" in trains["b"]
    # a plan that prints no slot count: GEN_BATCH_FALLBACK, said on stderr
    plans, trains, r = launch_pair(tmp_path / "noline", NOLINE="1", GEN_BATCH_FALLBACK="24", FSDP_MIN_SLOTS="64")
    assert len(plans) == 2 and {s: gen_batch(x) for s, x in trains.items()} == {"a": 24, "b": 24}
    assert "the memory plan gave no slot count" in (tmp_path / "noline" / "runs" / "pair1" / "a.log").read_text()
    # a dry run plans nothing (no GPU needed): the fallback, or GEN_BATCH
    plans, trains, r = launch_pair(tmp_path / "dry", DRY_RUN="1")
    assert plans == [] and {s: gen_batch(x) for s, x in trains.items()} == {"a": 32, "b": 32}
    assert "DRY_RUN: the memory plan is not run" in r.stderr
    plans, trains, _ = launch_pair(tmp_path / "dry64", DRY_RUN="1", GEN_BATCH="64")
    assert plans == [] and {s: gen_batch(x) for s, x in trains.items()} == {"a": 64, "b": 64}


# ------------------------------------------------------------------------------------------------
# bench/gpu.py's launcher part: the layout run_pair.sh picks, and the GPU-hours arithmetic
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dp, sharded, fits, want", [(96, 160, True, True), (200, 260, True, False),
                                                    (96, 80, True, False), (0, 40, False, True)])
def test_bench_launched_slots_follows_run_pair_rule(monkeypatch, dp, sharded, fits, want):
    """Data parallel unless it does not fit, or gives fewer than FSDP_MIN_SLOTS (128) slots where sharded gives more."""
    from bench import gpu as bench_gpu
    rows = plan.Rows(slots=8, paged=True, pool_tokens=0, expected_tokens=1, worst_tokens=1)
    monkeypatch.setattr(plan, "measure", lambda config, cfg, **kw: cfg.fsdp)
    monkeypatch.setattr(plan, "phases", lambda fsdp, cfg, **kw: [plan.Phase("rollout", {"KV pool": 1}, "", rows), fsdp])
    monkeypatch.setattr(plan, "launch_slots", lambda phases, card, rows: sharded if phases[1] else dp)
    monkeypatch.setattr(plan, "verdict", lambda phases, card: None if fits or phases[1] else phases[0])
    got = bench_gpu.launched_slots(None, "qwen3", 2**30, tiny=False)
    assert got["fsdp"] is want and got["slots"] == (sharded if want else dp)


def test_bench_projection_by_hand():
    """project_pair1 on planted per-token times: each term recomputed by hand, the pair at its slower side."""
    from bench import gpu as bench_gpu
    P = dict(rollouts=10, prompt=5, mean_response=20, cap=100, eval_every=2, eval_samples=30, steps=3, gpus=8)
    slow = dict(sample_s_per_token=0.5, logprob_s_per_token=0.1, update_s_per_token=0.2, kv_token=1000, rows=4, cap=60)
    fast = dict(slow, sample_s_per_token=0.25)
    got = bench_gpu.project_pair1({"a": slow, "b": fast}, bandwidth=1e6, P=P)
    kv = 4 * (100 - 60) * 1000 / 1e6 * (10 * 20) / 4  # rows x extra columns x bytes / bandwidth x decode steps = 8 s
    sampling = 10 * 20 * 0.5 + kv  # 108
    train = 10 * (5 + 20) * (0.1 + 0.2)  # 75
    evaluation = (30 * 20 * 0.5 + kv * 30 / 10) / 2  # 162
    a = got["per_side"]["a"]
    assert (a["kv_width_s"], a["sampling_s"], a["logprob_update_s"], a["eval_s"]) == pytest.approx(
        (kv, sampling, train, evaluation)) == (8, 108, 75, 162)
    assert a["step_s"] == pytest.approx(sampling + train + evaluation) and a["step_no_eval_s"] == 183
    assert got["per_side"]["b"]["step_s"] < a["step_s"]
    assert got["gpu_hours"] == round(3 * (sampling + train + evaluation) * 8 / 3600, 1)
    assert got["gpu_hours_without_eval"] == round(3 * (sampling + train) * 8 / 3600, 1)


def test_bench_columns_read_by_hand():
    """columns_read: a row of prompt p and response r reads p + t + 1 columns at its t-th step, t = 0 .. r - 1."""
    from bench import gpu as bench_gpu
    assert bench_gpu.columns_read([3, 5], [2, 4]) == (4 + 5) + (6 + 7 + 8 + 9) == 39
    assert bench_gpu.columns_read([7], [0]) == 0


def test_bench_pair1_columns_per_token_by_hand_and_by_sum():
    """pair1_columns_per_token on a small planted P: by hand (the closed form), then against an explicit sum of
    columns_read over the distribution it names (20% at the cap, the rest geometric with the mean left over)."""
    from bench import gpu as bench_gpu
    P = dict(prompt=10, mean_response=20, cap=50, at_cap=0.2)
    # the rows below the cap: mean (20 - 0.2 x 50) / 0.8 = 12.5, so E[r^2] = 0.2 x 2,500 + 0.8 x (2 x 12.5^2 - 12.5)
    # = 740, and per sampled token (20 x 10 + (740 + 20) / 2) / 20 = 29
    assert bench_gpu.pair1_columns_per_token(P) == pytest.approx(29.0)
    q = 1 / 12.5  # a geometric on 1, 2, ... with mean 12.5
    short = sum((1 - q) ** (r - 1) * q * bench_gpu.columns_read([10], [r]) for r in range(1, 2000))
    want = (0.2 * bench_gpu.columns_read([10], [50]) + 0.8 * short) / 20
    assert bench_gpu.pair1_columns_per_token(P) == pytest.approx(want, rel=1e-9)
    with pytest.raises(AssertionError, match="cannot hold"):
        bench_gpu.pair1_columns_per_token(dict(P, mean_response=5))  # 20% at 50 alone is a mean of 10


def test_bench_projection_with_the_kernel_by_hand():
    """A side whose attention was the paged kernel: the extra K/V read is pair1's real columns per token minus the
    measured run's, not the cap's full width; a run that read more per token than pair1 adds nothing."""
    from bench import gpu as bench_gpu
    P = dict(rollouts=10, prompt=10, mean_response=20, cap=50, at_cap=0.2, eval_every=2, eval_samples=30, steps=3,
             gpus=8)
    side = dict(sample_s_per_token=0.5, logprob_s_per_token=0.1, update_s_per_token=0.2, kv_token=1000, rows=4,
                cap=30, attention="kernel", columns_per_token=12.0)
    gathered = dict(side, attention="gather")
    longer = dict(side, columns_per_token=40.0)
    got = bench_gpu.project_pair1({"k": side, "g": gathered, "l": longer}, bandwidth=1e6, P=P)["per_side"]
    kv = (29 - 12) * 1000 / 1e6 * (10 * 20)  # extra columns per token x bytes / bandwidth x tokens = 3.4 s
    assert (got["k"]["extra_columns_per_token"], got["k"]["kv_width_s"]) == pytest.approx((17, kv)) == (17, 3.4)
    assert got["k"]["sampling_s"] == pytest.approx(10 * 20 * 0.5 + kv)
    assert got["k"]["eval_s"] == pytest.approx((30 * 20 * 0.5 + kv * 30 / 10) / 2)
    assert (got["g"]["extra_columns_per_token"], got["g"]["kv_width_s"]) == (50 - 30, 20 * 1000 / 1e6 * 200) == (20, 4)
    assert (got["l"]["extra_columns_per_token"], got["l"]["kv_width_s"]) == (0, 0)
