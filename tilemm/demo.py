"""``python -m tilemm`` (or ``python -m tilemm.demo``): quantize, multiply and check, for every format.

For each format it quantizes an activation x (M, K) and an nn.Linear weight w (N, K), multiplies with
tilemm, and reports two errors against fp32:

* quantization error: the tilemm result against ``x @ w.T`` in fp32 (what the format costs);
* kernel error: the tilemm result against the exact reference on the same quantized inputs (should
  be at the output dtype's rounding).

On a CUDA GPU of compute capability 9.x / 10.x / 12.x the cuTile kernels run; otherwise the demo says
so and runs the pure-PyTorch reference path.
"""

from __future__ import annotations

import argparse
import sys

import torch

import tilemm
from tilemm._arch import capability, gpu_code, has_kernels


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def _device_label() -> tuple[torch.device, str]:
    if not torch.cuda.is_available():
        return torch.device("cpu"), "no CUDA GPU found: running the exact reference path on the CPU"
    cuda = torch.device("cuda")
    name, arch = torch.cuda.get_device_name(), gpu_code(capability(cuda))
    if not has_kernels(cuda):
        return torch.device("cpu"), (f"{name} is {arch}; tilemm's kernels need sm_90 or newer: "
                                     "running the reference path on the CPU")
    return cuda, f"{name} ({arch}): running tilemm's cuTile kernels"


# MXFP8 and MXFP4 scale blocks of 32 elements along K (NVFP4's are 16).
K_MULTIPLE = 32

FORMATS = {
    "mxfp8": lambda t, s: tilemm.quantize_mxfp8(t, swizzle=s),
    "mxfp4": lambda t, s: tilemm.quantize_mxfp4(t, swizzle=s),
    "nvfp4": lambda t, s: tilemm.quantize_nvfp4(t, swizzle=s),
    "fp8-row": lambda t, s: tilemm.quantize_fp8(t, granularity="row"),
}


def _size(text: str) -> int:
    """argparse type: a positive int."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def parser(prog: str = "python -m tilemm.demo") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description="Quantize an activation x (M, K) and a weight w (N, K) in every format, compute "
                    "x @ w.T with tilemm, and compare it with fp32 and with the exact reference. "
                    "Runs tilemm's cuTile kernels on a GPU of compute capability 9.0 or newer, "
                    "the pure-PyTorch reference elsewhere.")
    p.add_argument("--m", type=_size, default=256, metavar="M", help="rows of x, tokens (default: %(default)s)")
    p.add_argument("--n", type=_size, default=512, metavar="N",
                   help="rows of w, output features (default: %(default)s)")
    p.add_argument("--k", type=_size, default=1024, metavar="K",
                   help=f"the shared dimension, input features; a multiple of {K_MULTIPLE}, the largest "
                        f"block of the formats shown (default: %(default)s)")
    return p


def main(argv=None, prog: str = "python -m tilemm.demo") -> int:
    cli = parser(prog)
    args = cli.parse_args(argv)
    if args.k % K_MULTIPLE:
        cli.error(f"argument --k: must be a multiple of {K_MULTIPLE}, got {args.k}")

    device, label = _device_label()
    print(f"tilemm {tilemm.__version__}: {label}")
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(args.m, args.k, generator=gen).to(device)
    w = torch.randn(args.n, args.k, generator=gen).to(device) / args.k ** 0.5
    exact = x @ w.t()

    print(f"x ({args.m}, {args.k}) @ w ({args.n}, {args.k}).T, bf16 output, swizzled scales\n")
    print(f"{'format':<9} {'vs fp32 (quantization)':>24} {'vs reference (kernel)':>23}")
    failures = 0
    for name, quantize in FORMATS.items():
        xq, wq = quantize(x, True), quantize(w, True)
        out = tilemm.linear(xq, wq, out_dtype=torch.bfloat16)
        ref = tilemm.linear(xq.cpu(), wq.cpu(), out_dtype=torch.float32)
        quant_err, kernel_err = _rel(out.cpu(), exact.cpu()), _rel(out.cpu(), ref)
        ok = kernel_err < 4e-3
        failures += not ok
        print(f"{name:<9} {quant_err:>24.2e} {kernel_err:>23.2e}  {'ok' if ok else 'MISMATCH'}")
    print("\nall formats agree with the reference" if not failures else f"\n{failures} format(s) disagree")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
