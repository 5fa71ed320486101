"""Every benchmark script parses: they run only on a GPU machine, so a syntax error would otherwise
first show there."""

from __future__ import annotations

import pathlib

import pytest

SCRIPTS = sorted((pathlib.Path(__file__).resolve().parents[1] / "benchmarks").glob("**/*.py"))


@pytest.mark.parametrize("path", SCRIPTS, ids=[str(p.relative_to(p.parents[1] if p.parent.name == "investigations" else p.parent)) for p in SCRIPTS])
def test_benchmark_script_compiles(path):
    compile(path.read_text(), str(path), "exec")
