"""Test options shared by every test module."""

import pytest


def pytest_addoption(parser):
    parser.addoption("--aot-all", action="store_true", default=False,
                     help="compile every kernel variant ahead of time (tests marked aot_full), not only one "
                          "per kernel function and target; see tests/test_aot.py")


def pytest_collection_modifyitems(config, items):
    """Without --aot-all, and unless -m names aot_full, leave out the full sweep's extra variants."""
    if config.getoption("--aot-all") or "aot_full" in (config.getoption("markexpr") or ""):
        return
    kept, left_out = [], []
    for item in items:
        (left_out if item.get_closest_marker("aot_full") else kept).append(item)
    if left_out:
        config.hook.pytest_deselected(items=left_out)
        items[:] = kept
