"""GPU time of the small-batch activation decode (``quantize_kernels.FakeQuant``) per format, as the
block-scaled small-batch path runs it, against the quantizer it replaces (CUDA-graph replays, L2
flushed).

    python benchmarks/bench_fake_quant.py [--ks 4096,14336] [--ms 1,16]

NVFP4 is timed three times, by where its tensor amax comes from: as the path chooses inside a CUDA
graph (every block loads all of a small x; else ``tensor_amax`` first, two launches), through a
grid-wide barrier in the one launch (what eager calls take when x is not small), and with
``tensor_amax`` first. Writes what it prints to
``fake-quant-<gpu>.txt`` (``benchmarks/_results.py``). ``--cpu-smoke``: K = 64, M = 1 on the CPU, where
the FakeQuant column is the definition it implements, ``dequantize(quantize(x))`` in bf16 (the kernel
needs a GPU), and both columns are wall times.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from _results import Transcript, add_options, command, device_name, results_path  # noqa: E402
from _timing import Timer  # noqa: E402

import tilemm  # noqa: E402
from tilemm.formats import MXFP4, MXFP8_E4M3, NVFP4  # noqa: E402
from tilemm.kernels.quantize_kernels import FakeQuant  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="bench_fake_quant.py")
    ap.add_argument("--ks", default="4096,14336")
    ap.add_argument("--ms", default="1,16")
    add_options(ap)
    args = ap.parse_args(argv)
    if args.cpu_smoke:
        args.ks, args.ms = "64", "1"
    dev = torch.device("cpu" if args.cpu_smoke else "cuda")
    timer = Timer(3 if args.cpu_smoke else 50, dev)
    alpha = torch.ones(1, device=dev)
    say = Transcript(command("bench_fake_quant.py", argv), device_name(dev))
    if args.cpu_smoke:
        say("# --cpu-smoke: FakeQuant = dequantize(quantize(x)) by the CPU reference; wall times, not GPU figures")
    say(f"{'format':22s} {'M':>4s} {'K':>6s} {'FakeQuant us':>13s} {'quantizer us':>13s}")
    for k in map(int, args.ks.split(",")):
        for m in map(int, args.ms.split(",")):
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            for name, fmt, quantize in (("mxfp4", MXFP4, lambda: tilemm.quantize_mxfp4(x)),
                                        ("mxfp8", MXFP8_E4M3, lambda: tilemm.quantize_mxfp8(x)),
                                        ("nvfp4", NVFP4, lambda: tilemm.quantize_nvfp4(x)),
                                        ("nvfp4 (barrier)", NVFP4, "barrier"),
                                        ("nvfp4 (tensor_amax)", NVFP4, None)):
                if args.cpu_smoke:
                    if not callable(quantize):
                        continue  # the same definition as the row above
                    t, _ = timer(lambda: quantize().dequantize().to(torch.bfloat16))
                else:
                    fq = FakeQuant(fmt, "rceil", alpha)
                    if not callable(quantize):
                        fq.whole_elements = 0  # no x is small enough to be loaded whole
                        fq.barrier = "always" if quantize == "barrier" else "never"
                    t, _ = timer(lambda: fq.run(x, torch.cuda.current_stream()))
                tq = timer(quantize)[0] * 1e3 if callable(quantize) else float("nan")
                say(f"{name:22s} {m:4d} {k:6d} {t * 1e3:13.1f} {tq:13.1f}")
    say.write(results_path(args.out_dir, "fake-quant", device_name(dev), "txt"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
