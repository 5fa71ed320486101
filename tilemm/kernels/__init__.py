"""cuTile kernels, chosen by compute capability in one place (``tilemm._arch``).

| family     | GPUs            | block-scaled (MXFP8 / MXFP4 / NVFP4)            | FP8                       |
|------------|-----------------|--------------------------------------------------|---------------------------|
| HOPPER     | sm_90           | ``hopper_block_scaled``: exact in-kernel scaling | ``hopper_fp8``            |
| BLACKWELL  | sm_100, sm_120  | ``blackwell_block_scaled``: ``ct.mma_scaled``    | ``blackwell_fp8``         |

Each module exposes ``launch(problem)`` for the problems built in ``tilemm.matmul`` and
``aot_variants()`` listing every specialisation it can launch, for ahead-of-time compile tests.

Portable kernels, the same on every family: ``quantize_kernels`` (the quantizers) and
``weight_only_kernels`` (float activations times a prepacked quantized weight, ``tilemm.weight_only``).
"""

from __future__ import annotations

import importlib

from .._arch import Family, family

_BLOCK_SCALED = {Family.HOPPER: "hopper_block_scaled", Family.BLACKWELL: "blackwell_block_scaled"}
_FP8 = {Family.HOPPER: "hopper_fp8", Family.BLACKWELL: "blackwell_fp8"}


def _module(table, device):
    return importlib.import_module(f"{__name__}.{table[family(device)]}")


def block_scaled_matmul(problem) -> None:
    """Run a ``tilemm.matmul.BlockScaledProblem`` on its GPU, writing ``problem.out``."""
    _module(_BLOCK_SCALED, problem.out.device).launch(problem)


def fp8_matmul(problem) -> None:
    """Run a ``tilemm.matmul.FP8Problem`` on its GPU, writing ``problem.out``."""
    _module(_FP8, problem.out.device).launch(problem)
