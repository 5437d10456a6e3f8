"""Benchmarks, each run from the repository root as `python -m bench.<name>`; they print figures and ratios
measured side by side in one run (docs/RESULTS.md), never pass/fail thresholds: the GPU check (gpu), the sampler
and log-prob kernel (sampler), the verifier against math-verify (verify), a trainer step (step), the foreign-log
loader (foreign)."""
