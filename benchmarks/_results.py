"""Where the benchmarks write their results, under which names, and the options every benchmark shares.

A results file is named ``<benchmark>[-<variant>]-<gpu>[-x<N>].<ext>``:

* ``<benchmark>``: the name ``python -m benchmarks`` knows it by (``bench_layer_stream.py`` ->
  ``layer-stream``); for a script it does not list (``investigations/*.py``, ``tp_suite.sh``), the
  script's file name without its extension, underscores as hyphens (``investigations/moe_pairs_tune.py``
  -> ``moe-pairs-tune``); notes that gather one script's runs take that script's name too
  (``matmul-hopper-design``); ``<variant>``: what a run chose that changes what it measured
  (``decode-b1``, ``moe-quick``, ``moe-pairs-tune-sorted``), if anything;
* ``<gpu>``: ``torch.cuda.get_device_name()`` in lower case with hyphens for spaces
  (``nvidia-h100-80gb-hbm3``), ``cpu`` for a ``--cpu-smoke`` run, the compile target (``sm90``) for
  counts made without a GPU (``decode-cost``); ``-x<N>`` for a run on N GPUs;
* ``<ext>``: ``json`` (every record), ``md`` (tables), ``txt`` (what the benchmark printed), ``png``,
  ``log`` (a run of several steps: ``tp_suite.sh``).

The directory is ``--out-dir`` when given, else ``$OUT`` when set (a run on a GPU machine), else
``benchmarks/results``. ``--cpu-smoke`` runs a benchmark's code paths on the CPU at tiny sizes in
seconds (its figures are wall times of tilemm's CPU reference path, not GPU figures): what CI runs.
"""

from __future__ import annotations

import argparse
import datetime
import os
import pathlib
import shlex
import sys

import torch

RESULTS = pathlib.Path(__file__).resolve().parent / "results"

__all__ = ["RESULTS", "Transcript", "add_options", "command", "device_name", "out_dir", "results_path", "slug"]


def add_options(ap: argparse.ArgumentParser, *, out_dir_aliases: tuple[str, ...] = ()) -> None:
    """``--cpu-smoke`` and ``--out-dir`` (see the module docstring)."""
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="tiny sizes on the CPU in seconds: the code paths and the results files, no GPU figures")
    ap.add_argument("--out-dir", *out_dir_aliases, dest="out_dir", type=pathlib.Path, default=None,
                    help="directory for the results files (default: $OUT if set, else benchmarks/results)")


def out_dir(path: str | os.PathLike | None = None) -> pathlib.Path:
    """``path``, else ``$OUT`` when set, else ``benchmarks/results``; created if missing."""
    out = pathlib.Path(path) if path else pathlib.Path(os.environ["OUT"]) if os.environ.get("OUT") else RESULTS
    out.mkdir(parents=True, exist_ok=True)
    return out


def slug(name: str) -> str:
    """``"NVIDIA H100 80GB HBM3"`` -> ``"nvidia-h100-80gb-hbm3"``."""
    return "-".join(name.lower().split())


def device_name(device: torch.device | str) -> str:
    """``torch.cuda.get_device_name`` of a CUDA device, ``"cpu"`` for the CPU."""
    device = torch.device(device)
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def results_path(directory: str | os.PathLike | None, benchmark: str, gpu: str, ext: str, *,
                 variant: str | None = None, gpus: int = 1) -> pathlib.Path:
    """``<directory>/<benchmark>[-<variant>]-<slug(gpu)>[-x<gpus>].<ext>`` (``directory`` as ``out_dir``)."""
    if ext not in ("json", "md", "txt", "png", "log"):
        raise ValueError(f"results_path: ext must be json, md, txt, png or log, got {ext!r}")
    name = "-".join(p for p in (benchmark, variant, slug(gpu)) if p) + (f"-x{gpus}" if gpus > 1 else "")
    return out_dir(directory) / f"{name}.{ext}"


def command(script: str, argv=None) -> str:
    """The command line that ran ``script`` (``benchmarks/<script>``) with ``argv`` (default ``sys.argv[1:]``)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    return " ".join(["python", f"benchmarks/{script}", *([shlex.join(argv)] if argv else [])])


class Transcript:
    """``print`` that keeps the lines, for a benchmark whose results are what it prints: ``write``
    stores them, after a ``# <command>  (<device>, <date>)`` line, as its ``.txt`` results file."""

    def __init__(self, command: str, device: str):
        self.head = f"# {command}  ({device}, {datetime.date.today().isoformat()})"
        self.lines: list[str] = []

    def __call__(self, line: str = "") -> None:
        print(line, flush=True)
        self.lines.append(line)

    def write(self, path: pathlib.Path) -> pathlib.Path:
        path.write_text("\n".join([self.head, *self.lines]) + "\n")
        print(f"wrote {path}", flush=True)
        return path
