"""cuTile kernels, chosen by compute capability in one place (``tilemm._arch``).

| family     | GPUs            | block-scaled (MXFP8 / MXFP4 / NVFP4)            | FP8                       |
|------------|-----------------|--------------------------------------------------|---------------------------|
| HOPPER     | sm_90           | ``hopper_block_scaled``: exact in-kernel scaling | ``hopper_fp8``            |
| BLACKWELL  | sm_100, sm_120  | ``blackwell_block_scaled``: ``ct.mma_scaled``    | ``blackwell_fp8``         |

Every kernel module speaks one vocabulary: its config record (``BlockScaledConfig``,
``FP8Config``, ``QuantizeConfig``, ``WeightOnlyConfig``, ``LargeConfig``, ``MoEPlan``), ``plan(...)``
choosing one from the problem's sizes, and ``aot_variants()`` listing every specialisation it can
launch, for ahead-of-time compile tests. The matmul modules add ``Prepared(problem, config=None)`` (a
signature planned once; ``.run(problem, stream)`` launches any problem of that signature) and
``launch(problem, config=None)`` (one prepared call). ``PLANS`` keeps, by signature, the planned calls
of ``tilemm.matmul`` and the prepared launches of repeated eager calls (matmuls, ``linear``,
quantizers), whose operands ``view_spec`` / ``as_view`` make as one view of the caller's tensors;
``prepare_block_scaled`` / ``prepare_fp8`` pick the module's ``Prepared`` by GPU generation
(``tilemm._arch``).

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


def remember(key, plan):
    """``PLANS[key] = plan`` (the table starts over once it holds ``MAX_PLANS``); returns plan."""
    if len(PLANS) >= MAX_PLANS:
        PLANS.clear()
    PLANS[key] = plan
    return plan


def view_spec(source, operand):
    """How a kernel operand made from ``source`` by views alone is made again, in one step, from any
    tensor of source's signature (shape, strides, dtype): None when it is the source itself, else
    (dtype to reinterpret as or None, shape, strides) for ``as_view``; False when ``operand`` is not
    such a view (a copy, or another start in memory)."""
    if operand is source or (operand.dtype == source.dtype and operand.shape == source.shape
                             and operand.stride() == source.stride() and operand.data_ptr() == source.data_ptr()):
        return None
    if operand.data_ptr() != source.data_ptr() or operand.element_size() != source.element_size():
        return False
    return (None if operand.dtype == source.dtype else operand.dtype, tuple(operand.shape), operand.stride())


def as_view(t, spec):
    """The operand that ``view_spec`` describes, made from ``t`` (a tensor of the source's signature);
    a callable ``spec`` makes it itself (an operand that is no view of t, e.g. a broadcast value)."""
    if spec is None:
        return t
    if callable(spec):
        return spec(t)
    dtype, shape, stride = spec
    return (t if dtype is None else t.view(dtype)).as_strided(shape, stride)


def prepare_fp8(problem):
    """The prepared launch of a ``tilemm.matmul.FP8Problem``'s signature on its GPU."""
    return FP8[family(problem.out.device)](problem)


def prepare_block_scaled(problem):
    """The prepared launch of a ``tilemm.matmul.BlockScaledProblem``'s signature on its GPU:
    ``.run(problem, stream)`` launches it for any problem of that signature."""
    return BLOCK_SCALED[family(problem.out.device)](problem)
