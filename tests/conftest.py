"""Test options shared by every test module."""

import pytest


def pytest_addoption(parser):
    parser.addoption("--aot-all", action="store_true", default=False,
                     help="the full ahead-of-time sweep (tests marked aot_full): every code path and every "
                          "tuning setting of every kernel on every target, not only one variant per kernel "
                          "function and target; see tests/test_aot.py")
    parser.addoption("--aot-every", action="store_true", default=False,
                     help="compile every listed kernel variant ahead of time (aot_every as well: about four "
                          "times the full sweep)")


def pytest_collection_modifyitems(config, items):
    """Leave out the full sweep's extra variants unless --aot-all (or -m naming aot_full) asks for them,
    and the variants beyond the sweep unless --aot-every (or -m naming aot_every) does."""
    markexpr = config.getoption("markexpr") or ""
    if config.getoption("--aot-every") or "aot_every" in markexpr:
        return
    drop = "aot_every" if config.getoption("--aot-all") or "aot_full" in markexpr else "aot_full"
    kept, left_out = [], []
    for item in items:
        (left_out if item.get_closest_marker(drop) else kept).append(item)
    if left_out:
        config.hook.pytest_deselected(items=left_out)
        items[:] = kept
