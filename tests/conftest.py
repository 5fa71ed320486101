"""Test options shared by every test module."""

import re

import pytest


def pytest_addoption(parser):
    parser.addoption("--aot-all", action="store_true", default=False,
                     help="the full ahead-of-time sweep (tests marked aot_full): every code path and every "
                          "tuning setting of every kernel on every target, not only one variant per kernel "
                          "function and target; see tests/test_aot.py")
    parser.addoption("--aot-every", action="store_true", default=False,
                     help="compile every listed kernel variant ahead of time (aot_every as well: about 3.5 "
                          "times the full sweep)")


def _names(markexpr: str, marker: str) -> bool:
    """Whether a -m expression asks for ``marker``: names it other than right after a ``not``
    (parentheses between them included)."""
    tokens = [t for t in re.findall(r"\w+|[()]", markexpr) if t != "("]
    return any(t == marker and (i == 0 or tokens[i - 1] != "not") for i, t in enumerate(tokens))


def pytest_collection_modifyitems(config, items):
    """Leave out the full sweep's extra variants unless --aot-all (or -m naming aot_full) asks for them,
    and the variants beyond the sweep unless --aot-every (or -m naming aot_every) does."""
    markexpr = config.getoption("markexpr") or ""
    if config.getoption("--aot-every") or _names(markexpr, "aot_every"):
        return
    drop = "aot_every" if config.getoption("--aot-all") or _names(markexpr, "aot_full") else "aot_full"
    kept, left_out = [], []
    for item in items:
        (left_out if item.get_closest_marker(drop) else kept).append(item)
    if left_out:
        config.hook.pytest_deselected(items=left_out)
        items[:] = kept
