"""Execute tutorial notebooks and write them back with their outputs, without Jupyter.

    python notebooks/execute.py notebooks/*.ipynb                 # in place
    python notebooks/execute.py notebooks/*.ipynb --out DIR       # to DIR/<name>.ipynb

The notebooks are committed executed (on an H100, so that the GPU parts show their results); this
runs them where no Jupyter stack is installed (it needs only the standard library and matplotlib,
which the notebooks use anyway). Each notebook runs top to bottom in one fresh namespace, with the
notebook's folder as the working directory and matplotlib's Agg backend, as a python3 kernel would
run it:

* what a cell prints goes to ``stream`` outputs (stdout and stderr apart, in the order written; a
  carriage return overwrites its line, as a notebook displays progress bars);
* every figure open at ``plt.show()`` or at the end of the cell becomes a ``display_data`` PNG
  (``--dpi``, 80 by default, reduced to 256 colours, which keeps a notebook under 300 KB), then is
  closed;
* a cell whose last statement is an expression with a value other than None gets an
  ``execute_result`` with its ``repr``, as in IPython;
* code cells are numbered 1, 2, ... in ``execution_count``.

Each notebook runs in a fresh interpreter (a subprocess per notebook when several are given). The
notebook's folder and the directory the command is started from are on ``sys.path``, so that a
clone run from its root imports its own tilemm.

The first exception stops the notebook: the cell gets an ``error`` output, the notebook is written
as far as it ran, and the command exits with status 1. The output is nbformat 4 JSON, written as
nbformat writes it (keys sorted, one-space indent), so ``nbformat.validate`` accepts it.
"""

from __future__ import annotations

import argparse
import ast
import base64
import contextlib
import io
import json
import os
import sys
import traceback
from pathlib import Path


def _lines(text: str) -> list[str]:
    """Text as nbformat stores it: a list of lines, each but the last ending in a newline."""
    return text.splitlines(keepends=True)


def _small_png(png: bytes) -> bytes:
    """The PNG with at most 256 colours (Pillow, which matplotlib depends on, if present): plots with
    dense scatter or image data shrink several times; the original if that is not smaller."""
    try:
        from PIL import Image
    except ImportError:
        return png
    out = io.BytesIO()
    Image.open(io.BytesIO(png)).convert("RGB").quantize(colors=256).save(out, format="png", optimize=True)
    return out.getvalue() if out.tell() < len(png) else png


class _Outputs:
    """A cell's outputs, in the order they are produced; ``stream(name)`` is a file to print to."""

    def __init__(self):
        self.items: list[dict] = []

    def write(self, name: str, text: str) -> None:
        if not text:
            return
        last = self.items[-1] if self.items else None
        if last is not None and last["output_type"] == "stream" and last["name"] == name:
            last["_text"] += text
        else:
            self.items.append({"output_type": "stream", "name": name, "_text": text})

    def stream(self, name: str):
        outputs = self

        class _Stream(io.TextIOBase):
            def write(self, text):
                outputs.write(name, text)
                return len(text)

            def isatty(self):
                return False

        return _Stream()

    def figures(self, dpi: int) -> None:
        """Every open matplotlib figure as a PNG display_data, then closed."""
        import matplotlib.pyplot as plt

        for num in plt.get_fignums():
            fig = plt.figure(num)
            buf = io.BytesIO()
            fig.savefig(buf, format="png", dpi=dpi, bbox_inches="tight")
            png = _small_png(buf.getvalue())
            w, h = (int(round(v * fig.dpi)) for v in fig.get_size_inches())
            self.items.append({"output_type": "display_data", "metadata": {},
                               "data": {"image/png": base64.b64encode(png).decode("ascii"),
                                        "text/plain": [f"<Figure size {w}x{h} with {len(fig.axes)} Axes>"]}})
        plt.close("all")

    def finished(self) -> list[dict]:
        out = []
        for item in self.items:
            if item["output_type"] == "stream":
                # A carriage return (progress bars) overwrites its line, as a notebook shows it.
                text = "\n".join(line.rsplit("\r", 1)[-1] for line in item["_text"].split("\n"))
                item = {"output_type": "stream", "name": item["name"], "text": _lines(text)}
            out.append(item)
        return out


def _run_cell(source: str, namespace: dict, filename: str, outputs: _Outputs, count: int):
    """Execute one cell; returns the execute_result output or None. Exceptions propagate."""
    tree = ast.parse(source, filename=filename)
    last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
    exec(compile(tree, filename, "exec"), namespace)
    if last is None:
        return None
    value = eval(compile(ast.Expression(last.value), filename, "eval"), namespace)
    if value is None:
        return None
    return {"output_type": "execute_result", "execution_count": count, "metadata": {},
            "data": {"text/plain": _lines(repr(value))}}


def execute(path: Path, dpi: int = 80, root: str | None = None) -> tuple[dict, bool]:
    """(the notebook executed, whether every cell ran); ``root``: a directory put on sys.path too."""
    nb = json.loads(path.read_text(encoding="utf-8"))
    os.environ["MPLBACKEND"] = "Agg"
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    namespace = {"__name__": "__main__", "__builtins__": __builtins__}
    cwd = os.getcwd()
    os.chdir(path.parent)
    added = [str(path.parent)] + ([root] if root else [])
    sys.path[:0] = added
    count, ok = 0, True
    real_show = plt.show
    try:
        for cell in nb["cells"]:
            if cell["cell_type"] != "code":
                continue
            if not ok:  # after a failure, the rest stays unexecuted
                cell["outputs"], cell["execution_count"] = [], None
                continue
            count += 1
            source = "".join(cell["source"])
            outputs = _Outputs()
            plt.show = lambda *args, **kwargs: outputs.figures(dpi)
            result = None
            with contextlib.redirect_stdout(outputs.stream("stdout")), \
                    contextlib.redirect_stderr(outputs.stream("stderr")):
                try:
                    result = _run_cell(source, namespace, f"<{path.name} cell {count}>", outputs, count)
                except BaseException as err:  # noqa: BLE001 -- reported in the notebook and the exit status
                    if isinstance(err, KeyboardInterrupt):
                        raise
                    ok = False
                    outputs.items.append({"output_type": "error", "ename": type(err).__name__,
                                          "evalue": str(err),
                                          "traceback": traceback.format_exception(err)})
            if result is not None:  # IPython shows the value, then the figures still open
                outputs.items.append(result)
            outputs.figures(dpi)
            cell["outputs"] = outputs.finished()
            cell["execution_count"] = count
    finally:
        plt.show = real_show
        os.chdir(cwd)
        for entry in added:
            sys.path.remove(entry)
    return nb, ok


def write(nb: dict, path: Path) -> None:
    path.write_text(json.dumps(nb, indent=1, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("notebooks", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, default=None, help="write here instead of in place")
    parser.add_argument("--dpi", type=int, default=80, help="resolution of the figures (default 80)")
    args = parser.parse_args(argv)
    if len(args.notebooks) > 1:  # one fresh interpreter per notebook, as one kernel per notebook
        import subprocess

        status = 0
        for path in args.notebooks:
            cmd = [sys.executable, __file__, str(path), "--dpi", str(args.dpi)]
            if args.out is not None:
                cmd += ["--out", str(args.out)]
            status |= subprocess.call(cmd)
        return status
    status = 0
    for path in args.notebooks:
        path = path.resolve()
        nb, ok = execute(path, args.dpi, root=os.getcwd())
        target = (args.out / path.name) if args.out is not None else path
        target.parent.mkdir(parents=True, exist_ok=True)
        write(nb, target)
        size = target.stat().st_size
        print(f"{path.name}: {'ok' if ok else 'FAILED'}, {size / 1024:.0f} KB -> {target}", file=sys.__stdout__)
        status |= 0 if ok else 1
    return status


if __name__ == "__main__":
    sys.exit(main())
