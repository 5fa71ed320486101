"""GPU time of the small-batch activation decode (``quantize_kernels.FakeQuant``) per format, as the
block-scaled small-batch path runs it, against the quantizer it replaces (CUDA-graph replays, L2
flushed).

    python benchmarks/bench_fake_quant.py [--ks 4096,14336] [--ms 1,16]

NVFP4 is timed twice: with its tensor amax inside the launch (a grid-wide barrier, what the path
runs) and with ``tensor_amax`` first (two launches).
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from _timing import Timer  # noqa: E402

import tilemm  # noqa: E402
from tilemm.formats import MXFP4, MXFP8_E4M3, NVFP4  # noqa: E402
from tilemm.kernels.quantize_kernels import FakeQuant  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="bench_fake_quant.py")
    ap.add_argument("--ks", default="4096,14336")
    ap.add_argument("--ms", default="1,16")
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    timer = Timer(50, dev)
    alpha = torch.ones(1, device=dev)
    print(f"{'format':22s} {'M':>4s} {'K':>6s} {'FakeQuant us':>13s} {'quantizer us':>13s}")
    for k in map(int, args.ks.split(",")):
        for m in map(int, args.ms.split(",")):
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            for name, fmt, quantize in (("mxfp4", MXFP4, lambda: tilemm.quantize_mxfp4(x)),
                                        ("mxfp8", MXFP8_E4M3, lambda: tilemm.quantize_mxfp8(x)),
                                        ("nvfp4", NVFP4, lambda: tilemm.quantize_nvfp4(x)),
                                        ("nvfp4 (tensor_amax)", NVFP4, None)):
                fq = FakeQuant(fmt, "rceil", alpha)
                if quantize is None:
                    fq._sms = 0  # more tiles than "SMs": tensor_amax first
                t, _ = timer(lambda: fq.run(x, torch.cuda.current_stream()))
                tq = timer(quantize)[0] * 1e3 if quantize is not None else float("nan")
                print(f"{name:22s} {m:4d} {k:6d} {t * 1e3:13.1f} {tq:13.1f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
