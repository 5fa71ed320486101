"""cuTile kernels, chosen by compute capability in one place (``tilemm._arch``).

| family     | GPUs            | block-scaled (MXFP8 / MXFP4 / NVFP4)            | FP8                       |
|------------|-----------------|--------------------------------------------------|---------------------------|
| HOPPER     | sm_90           | ``hopper_block_scaled``: exact in-kernel scaling | ``hopper_fp8``            |
| BLACKWELL  | sm_100, sm_120  | ``blackwell_block_scaled``: ``ct.mma_scaled``    | ``blackwell_fp8``         |

Every kernel module speaks one vocabulary: its config record (``BlockScaledConfig``,
``FP8Config``, ``QuantizeConfig``, ``WeightOnlyConfig``, ``LargeConfig``, ``MoEConfig``), ``plan(...)``
choosing one from the problem's sizes, and ``aot_variants()`` listing every specialisation it can
launch, for ahead-of-time compile tests. The matmul modules add ``Prepared(problem, config=None)`` (a
signature planned once; ``.run(problem, stream)`` launches any problem of that signature) and
``launch(problem, config=None)`` (one prepared call). ``PLANS`` keeps the planned calls of
``tilemm.matmul`` by signature; ``prepare_block_scaled`` / ``prepare_fp8`` pick the module's
``Prepared`` by GPU generation (``tilemm._arch``).

Portable kernels, the same on every family: ``quantize_kernels`` (the quantizers) and
``weight_only_kernels`` (float activations times a prepacked quantized weight, ``tilemm.weight_only``).
"""

from __future__ import annotations

from .._arch import Family, family
from . import blackwell_block_scaled, blackwell_fp8, hopper_block_scaled, hopper_fp8

#: The matmul modules' prepared launches (``Prepared``) by kernel family (``tilemm._arch.family``).
BLOCK_SCALED = {Family.HOPPER: hopper_block_scaled.Prepared, Family.BLACKWELL: blackwell_block_scaled.Prepared}
FP8 = {Family.HOPPER: hopper_fp8.Prepared, Family.BLACKWELL: blackwell_fp8.Prepared}

#: Planned calls by signature (shapes, strides, dtypes, devices, options), shared by the public
#: functions, the custom operators and ``tilemm.nn.Linear``: a repeated call is a lookup and a launch.
PLANS: dict = {}
#: Signatures kept before the table starts over (a program that sees ever new shapes).
MAX_PLANS = 4096


def prepare_fp8(problem):
    """The prepared launch of a ``tilemm.matmul.FP8Problem``'s signature on its GPU."""
    return FP8[family(problem.out.device)](problem)


def prepare_block_scaled(problem):
    """The prepared launch of a ``tilemm.matmul.BlockScaledProblem``'s signature on its GPU:
    ``.run(problem, stream)`` launches it for any problem of that signature."""
    return BLOCK_SCALED[family(problem.out.device)](problem)
