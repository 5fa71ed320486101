"""The tutorials in notebooks/ run top to bottom on a CPU, and are committed executed, with outputs.

Each notebook is executed in a fresh python3 kernel with nbclient; any exception, including a
failed ``assert`` in a notebook's checks, fails the test. Each notebook is also run once with one
thing it checks deliberately broken, to show that its checks catch it. Figures use the Agg backend,
so nothing is displayed. 03_matmul's benchmark cell is also run against synthetic results, so that
its plotting code is exercised on results of more than one shape. These runs never write the
notebooks back: the committed outputs come from ``notebooks/execute.py`` (on an H100, so that the GPU
parts show their results), which is tested here on a small notebook.

Without nbformat / nbclient (the ``dev`` extra; a GPU machine may lack them) the module is skipped.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import subprocess

import pytest

nbformat = pytest.importorskip("nbformat", reason="the notebook tests need nbformat and nbclient "
                               "(the 'dev' extra: pip install -e '.[dev]')")
pytest.importorskip("nbclient", reason="the notebook tests need nbformat and nbclient (the 'dev' extra: "
                    "pip install -e '.[dev]')")
from nbclient import NotebookClient  # noqa: E402
from nbclient.exceptions import CellExecutionError  # noqa: E402

from _gpu import GPU_SKIP_REASON

NOTEBOOK_DIR = Path(__file__).resolve().parent.parent / "notebooks"
NOTEBOOKS = ["01_formats.ipynb", "02_swizzle.ipynb", "03_matmul.ipynb", "04_checkpoints.ipynb"]
CELL_TIMEOUT_S = 120


def _execute(name: str, monkeypatch, keep=None, after_imports=None, **env: str) -> nbformat.NotebookNode:
    """Run notebook ``name`` (only the cells for which ``keep(index, cell)`` is true, if given; with a
    code cell ``after_imports`` inserted after the first code cell, if given)."""
    # The kernel inherits this environment: a non-interactive matplotlib backend, and the
    # interpreter that runs the tests first on PATH, so the kernel's "python" imports the same tilemm.
    monkeypatch.setenv("MPLBACKEND", "Agg")
    monkeypatch.setenv("PATH", os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    nb = nbformat.read(NOTEBOOK_DIR / name, as_version=4)
    if keep is not None:
        nb.cells = [cell for i, cell in enumerate(nb.cells) if keep(i, cell)]
    if after_imports is not None:
        first = next(i for i, cell in enumerate(nb.cells) if cell.cell_type == "code")
        nb.cells.insert(first + 1, nbformat.v4.new_code_cell(after_imports))
    client = NotebookClient(nb, timeout=CELL_TIMEOUT_S, startup_timeout=CELL_TIMEOUT_S,
                            kernel_name="python3", resources={"metadata": {"path": str(NOTEBOOK_DIR)}})
    client.execute()  # raises CellExecutionError on the first failing cell
    return nb


def _stdout(nb: nbformat.NotebookNode) -> str:
    return "".join(out.get("text", "") for cell in nb.cells if cell.cell_type == "code"
                   for out in cell.outputs if out.output_type == "stream")


def test_all_notebooks_are_listed():
    assert sorted(p.name for p in NOTEBOOK_DIR.glob("*.ipynb")) == NOTEBOOKS


MAX_NOTEBOOK_BYTES = 300 * 1024


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_is_committed_executed(name):
    # A reader sees the outputs and plots without running anything: every code cell executed in order,
    # no errors, a figure under every plt.show(), and small enough to keep in the repository.
    path = NOTEBOOK_DIR / name
    assert path.stat().st_size < MAX_NOTEBOOK_BYTES, f"{name}: {path.stat().st_size} bytes"
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    code = [cell for cell in nb.cells if cell.cell_type == "code"]
    assert [cell.execution_count for cell in code] == list(range(1, len(code) + 1)), \
        f"{name}: execute it with notebooks/execute.py before committing"
    for i, cell in enumerate(code):
        assert not any(out.output_type == "error" for out in cell.outputs), f"{name} code cell {i} failed"
        if "plt.show()" in cell.source and "plot_results" not in cell.source:
            assert any("image/png" in out.get("data", {}) for out in cell.outputs), f"{name} code cell {i}"
    assert "widgets" not in nb.metadata


# The last line each notebook prints once all its checks have passed.
LAST_LINE = {
    "01_formats.ipynb": "e4m3 ties to even, zero blocks, NaN and Inf blocks: ok",
    "02_swizzle.ipynb": "quantize_nvfp4: logical scale (129, 10) -> swizzled (2, 3, 32, 16)",
    "03_matmul.ipynb": "matmul-nvidia-h100-80gb-hbm3.json: NVIDIA H100 80GB HBM3, ",
    "04_checkpoints.ipynb": "max |logit difference|",
}

# One wrong implementation per notebook, put in place right after its imports; its checks must fail.
BREAK = {
    # e2m1 ties rounded away from even instead of to even.
    "01_formats.ipynb": "tilemm.quantize._E2M1_MIDPOINTS = tuple((m, not up) for m, up in "
                        "tilemm.quantize._E2M1_MIDPOINTS)",
    # A swizzle that puts the 32 rows of each block in reverse order.
    "02_swizzle.ipynb": "_right_swizzle = swizzle_32_4_4\n"
                        "swizzle_32_4_4 = lambda s: _right_swizzle(s)[..., ::-1, :].copy()",
    # A matmul 0.1 % off (on any device).
    "03_matmul.ipynb": "_right_linear = tilemm.linear\n"
                       "tilemm.linear = lambda *args, **kw: _right_linear(*args, **kw) * 1.001",
    # A loaded layer that reads its weight back 1 % off (more than a bf16 step).
    "04_checkpoints.ipynb": "_right_deq = tilemm.nn.Linear.dequantize_weight\n"
                            "tilemm.nn.Linear.dequantize_weight = lambda self: _right_deq(self) * 1.01",
}


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_has_background_picture_and_checks(name):
    nb = nbformat.read(NOTEBOOK_DIR / name, as_version=4)
    markdown = "\n".join(c.source for c in nb.cells if c.cell_type == "markdown")
    code = "\n".join(c.source for c in nb.cells if c.cell_type == "code")
    assert "## Background" in markdown
    assert "plt.show()" in code
    assert code.count("assert ") >= 5


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_runs(name, monkeypatch):
    out = _stdout(_execute(name, monkeypatch))
    # The last line printed (progress bars of other libraries may share it, or follow as blank lines).
    last = [line for line in out.splitlines() if line.strip()][-1]
    assert LAST_LINE[name] in last, out[-500:]
    if name == "03_matmul.ipynb":
        # The capability guard says which path ran: the kernels exactly where a suitable GPU is.
        expected = "GPU part skipped: " if GPU_SKIP_REASON else "Running tilemm's cuTile kernels on "
        assert out.startswith(expected), out[:200]


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_checks_catch_a_wrong_implementation(name, monkeypatch):
    with pytest.raises(CellExecutionError) as failure:
        _execute(name, monkeypatch, after_imports=BREAK[name])
    assert failure.value.ename == "AssertionError", str(failure.value)[-2000:]


def test_matmul_notebook_plots_benchmark_results(tmp_path, monkeypatch):
    # One file in bench_matmul.py's schema (meta + records), one in a looser variant (a bare list,
    # other key names, shapes as strings / lists, records to skip), and one that is not JSON.
    records = [dict(format=fmt, impl=impl, m=m, n=14336, k=4096, ms=1.0, tflops=m / 20, rel_err=None)
               for fmt in ("mxfp8", "nvfp4") for impl in ("tilemm", "cublas_bf16")
               for m in (16, 128, 1024, 8192)]
    records.append(dict(format="mxfp8", impl="tilemm", m=4096, n=4096, k=4096, ms=1.0, tflops=None))
    (tmp_path / "matmul-nvidia-h100-80gb-hbm3.json").write_text(
        json.dumps(dict(meta=dict(gpu="NVIDIA H100 80GB HBM3"), summary=[], records=records)))
    loose = [dict(fmt="mxfp4", peer=peer, shape=f"{m}x8192x8192", TFLOPS=m / 10.0)
             for peer in ("tilemm", "cublas") for m in (64, 256)]
    loose += [dict(format="mxfp4", impl="tilemm", shape=[2048, 8192, 8192], tflops=300.0), "junk", {}]
    (tmp_path / "matmul-other-gpu.json").write_text(json.dumps(loose))
    (tmp_path / "matmul-broken.json").write_text("{not json")
    (tmp_path / "quantize-other-gpu.json").write_text("[]")  # another benchmark's results: not read

    # Only the setup cell (imports, capability guard) and the benchmark cell: the matmul cells in
    # between ran in test_notebook_runs, and the benchmark cell needs nothing they define.
    def setup_or_benchmark(i, cell):
        return cell.cell_type == "code" and ("def pick_device" in cell.source
                                             or "def load_records" in cell.source)

    out = _stdout(_execute("03_matmul.ipynb", monkeypatch, keep=setup_or_benchmark,
                           TILEMM_BENCH_RESULTS=str(tmp_path)))
    assert "matmul-nvidia-h100-80gb-hbm3.json: NVIDIA H100 80GB HBM3, 16 records, 1 skipped" in out
    assert "matmul-other-gpu.json: other gpu, 5 records, 2 skipped" in out
    assert "matmul-broken.json: could not be read" in out
    assert "quantize-" not in out


RUNNER_CELLS = [
    "import sys\nimport matplotlib.pyplot as plt\nprint('to stdout')\nprint('to stderr', file=sys.stderr)",
    "plt.plot([1, 2, 3])\nplt.show()\nprint('after the figure')\nplt.figure()\nplt.plot([3, 1])\n'last'",
    "value = 6 * 7\nvalue",
    "None",
    "raise ValueError('stop here')",
    "print('never runs')",
]


def test_execute_script_writes_outputs_nbformat_accepts(tmp_path):
    # notebooks/execute.py, which needs no Jupyter: streams in order, a PNG per figure (at plt.show()
    # and at the end of a cell), the last expression's value, execution counts, and a failing cell
    # that stops the notebook (exit status 1) with an error output.
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell("# A test")] + [nbformat.v4.new_code_cell(c) for c in RUNNER_CELLS]
    nbformat.write(nb, tmp_path / "t.ipynb")
    out = tmp_path / "out"
    result = subprocess.run([sys.executable, str(NOTEBOOK_DIR / "execute.py"), str(tmp_path / "t.ipynb"),
                             "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 1, result.stderr
    done = nbformat.read(out / "t.ipynb", as_version=4)
    nbformat.validate(done)
    cells = [c for c in done.cells if c.cell_type == "code"]
    assert [c.execution_count for c in cells] == [1, 2, 3, 4, 5, None]
    assert [(o.output_type, o.get("name"), o.get("text")) for o in cells[0].outputs] == [
        ("stream", "stdout", "to stdout\n"), ("stream", "stderr", "to stderr\n")]
    kinds = [(o.output_type, o.get("name")) for o in cells[1].outputs]
    assert kinds == [("display_data", None), ("stream", "stdout"), ("execute_result", None), ("display_data", None)]
    assert all(o.data["image/png"] for o in cells[1].outputs if o.output_type == "display_data")
    assert cells[2].outputs == [nbformat.v4.new_output("execute_result", {"text/plain": "42"}, execution_count=3)]
    assert cells[3].outputs == []
    assert cells[4].outputs[0].output_type == "error" and cells[4].outputs[0].ename == "ValueError"
    assert cells[5].outputs == []
