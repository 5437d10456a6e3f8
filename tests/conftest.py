"""Test order for CI's two workers (`pytest -n 2 --dist loadfile`, .ci/run): the files that run whole pairs and
presets in subprocesses go first, so that no long file starts last and leaves one worker idle at the end.
The order within a file is unchanged (module fixtures are built once per file either way)."""

SLOW_FIRST = ("test_tiny.py", "test_resume.py", "test_panel.py", "test_real.py", "test_runs.py", "test_graft.py",
              "test_gpu_path.py", "test_nodes.py", "test_sampler.py", "test_peers.py", "test_trl.py", "test_metrics.py",
              "test_plan.py", "test_verify.py", "test_docs.py", "test_reward.py")
"""Files by falling wall time on the 2-core CI machine; every other file keeps its place after them."""


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(SLOW_FIRST)))  # sort is stable: file order kept


def pytest_configure(config):
    # xdist hands out files by falling number of tests unless told not to, which left the 418 s smoke file to start
    # late; with the order above the two workers' sums of file times are within a few seconds of each other.
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False
