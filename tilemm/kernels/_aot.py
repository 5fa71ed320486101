"""Ahead-of-time compilation of tilemm's kernels, without a GPU.

Each kernel module lists its launchable specialisations with ``aot_variants()``: one ``AotVariant``
per (kernel, constants) combination that its launcher can choose. ``compile_variant`` runs cuTile's
compiler (``tileiras``) for a target such as ``"sm_100"``; CI does this for sm_90, sm_100 and sm_120 so
that a kernel that stops compiling fails the build.
"""

from __future__ import annotations

import dataclasses
import io
from typing import Any, Sequence

import cuda.tile as ct
from cuda.tile import compilation as cc

__all__ = ["AotVariant", "array", "compile_variant", "TARGETS"]

TARGETS = ("sm_90", "sm_100", "sm_120")


@dataclasses.dataclass(frozen=True)
class AotVariant:
    """One specialisation: ``params`` has one entry per kernel parameter (``array(...)`` for arrays,
    plain Python values for ``ct.Constant`` parameters, ``cc.ScalarConstraint`` for runtime scalars).
    ``targets`` lists the architectures the launcher can pick it on."""

    name: str
    kernel: Any
    params: Sequence[Any]
    targets: Sequence[str] = TARGETS


def array(dtype, ndim: int, *, contiguous_last: bool = True, aligned: bool = True,
          index_dtype=ct.int32) -> cc.ArrayConstraint:
    """An array parameter as the launcher passes it: non-aliasing, non-negative strides, (by default)
    unit stride in the last dimension and, with ``aligned``, the other strides and the base address
    divisible by 16 bytes. That alignment is what the JIT specialises on for ordinary torch tensors
    and what TMA needs; without it tileiras compiles byte-wise loads, a different kernel from the one
    that runs."""
    stride_constant = [None] * (ndim - 1) + [1] if contiguous_last else None
    facts = {}
    if aligned:
        facts["base_addr_divisible_by"] = 16
        if contiguous_last:
            per_16_bytes = max(1, 128 // dtype.bitwidth)
            facts["stride_divisible_by"] = [per_16_bytes] * (ndim - 1) + [1]
    return cc.ArrayConstraint(
        dtype, ndim, index_dtype=index_dtype, stride_lower_bound_incl=0, alias_groups=(),
        may_alias_internally=False, stride_constant=stride_constant, **facts,
    )


def compile_variant(variant: AotVariant, gpu_code: str) -> bytes:
    """Compile ``variant`` for ``gpu_code`` (e.g. ``"sm_100"``) and return the cubin."""
    sig = cc.KernelSignature(list(variant.params), cc.CallingConvention.cutile_python_v2())
    sig = sig.with_mangled_symbol(variant.name)
    buf = io.BytesIO()
    cc.export_kernel(variant.kernel, [sig], buf, gpu_code=gpu_code, output_format="cubin")
    return buf.getvalue()
