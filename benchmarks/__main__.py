"""The benchmarks' one entry point: ``python -m benchmarks <name> [args...]`` runs ``benchmarks/<script>``
with the arguments (each script still runs on its own too); ``python -m benchmarks --list`` lists them.

    python -m benchmarks --list
    python -m benchmarks inference --ms 1,16          # = python benchmarks/bench_inference.py --ms 1,16
    python -m benchmarks matmul --cpu-smoke --out-dir /tmp/smoke
    python -m benchmarks tp --nproc-per-node 2        # = torchrun --nproc-per-node 2 benchmarks/bench_tp.py

Every benchmark takes ``--cpu-smoke`` and ``--out-dir`` (``benchmarks/_results.py``); the
tensor-parallel ones run under torchrun, which this entry point starts for them (``--nproc-per-node``:
the number of GPUs, or of gloo processes with ``--cpu-smoke``; default 1 with ``--cpu-smoke``, else
every visible GPU). One-off investigations live in ``benchmarks/investigations/`` and run as scripts.
"""

from __future__ import annotations

import os
import pathlib
import runpy
import subprocess
import sys

HERE = pathlib.Path(__file__).resolve().parent

#: name -> (script, runs under torchrun, what it measures)
BENCHMARKS = {
    "matmul": ("bench_matmul.py", False, "tilemm's matmuls against their peers over a shape sweep"),
    "quantize": ("bench_quantize.py", False, "the quantizers against a device-to-device copy of the same input"),
    "inference": ("bench_inference.py", False, "small-M linears, weight-only and both sides, against cuBLAS bf16"),
    "layer-stream": ("bench_layer_stream.py", False, "per-layer time inside a CUDA graph of layers, against bf16"),
    "host": ("bench_host.py", False, "host time per eager call of every public entry, beside F.linear"),
    "fake-quant": ("bench_fake_quant.py", False, "the small-batch activation decode against the quantizer it replaces"),
    "decode": ("bench_decode.py", False, "end-to-end Llama-shaped decode, tokens/s against bf16"),
    "moe": ("bench_moe.py", False, "gpt-oss's MXFP4 experts: layers and end-to-end decodes"),
    "model-accuracy": ("model_accuracy.py", False, "all-MiniLM-L6-v2 sentence embeddings per format against the float model"),
    "decode-cost": ("decode_cost.py", False, "SASS instructions per weight element of the kernels as planned (no GPU)"),
    "tp": ("bench_tp.py", True, "a tensor-parallel MLP, 1 GPU against N, and the all-reduce variants"),
    "tp-decode": ("bench_tp_decode.py", True, "a Llama-shaped decode sharded over 1, 2 (, 4) GPUs"),
}


def listing() -> str:
    width = max(map(len, BENCHMARKS))
    lines = [f"  {name:{width}s}  {desc} ({script}{', under torchrun' if tr else ''})"
             for name, (script, tr, desc) in BENCHMARKS.items()]
    return "benchmarks (python -m benchmarks <name> [args...]; <name> --help for its options):\n" + "\n".join(lines)


def _torchrun(script: pathlib.Path, args: list[str]) -> int:
    """Run ``script`` under torchrun; ``--nproc-per-node N`` / ``--nproc-per-node=N`` in ``args`` is torchrun's."""
    nproc, rest, i = None, [], 0
    while i < len(args):
        if args[i] == "--nproc-per-node" and i + 1 < len(args):
            nproc, i = args[i + 1], i + 2
            continue
        if args[i].startswith("--nproc-per-node="):
            nproc = args[i].split("=", 1)[1]
        else:
            rest.append(args[i])
        i += 1
    if nproc is None:
        if "--cpu-smoke" in rest:
            nproc = "1"
        else:
            import torch

            nproc = str(max(torch.cuda.device_count(), 1))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(HERE.parent), *filter(None, [env.get("PYTHONPATH")])])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", nproc, str(script), *rest]
    return subprocess.call(cmd, env=env)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help", "--list"):
        print((__doc__ + "\n" if argv[:1] != ["--list"] else "") + listing())
        return 0
    name, args = argv[0], argv[1:]
    if name not in BENCHMARKS:
        print(f"python -m benchmarks: unknown benchmark {name!r}\n" + listing(), file=sys.stderr)
        return 2
    script, under_torchrun, _ = BENCHMARKS[name]
    path = HERE / script
    if under_torchrun and "RANK" not in os.environ and not ({"-h", "--help"} & set(args)):
        return _torchrun(path, args)
    # As `python benchmarks/<script>` would: the script's folder first on sys.path, its own argv.
    sys.path.insert(0, str(HERE))
    sys.argv = [str(path), *args]
    try:
        runpy.run_path(str(path), run_name="__main__")
    except SystemExit as stop:
        code = stop.code
        if isinstance(code, str):
            print(code, file=sys.stderr)
        return code if isinstance(code, int) else (0 if code is None else 1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
