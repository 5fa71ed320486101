"""Launches on tensors of 2^31 elements and more: the launch cut into pieces that 32-bit indexing covers.

Why pieces. cuTile hands a kernel each array's shape and strides in the array's index dtype, int32
unless the parameter is annotated ``ct.IndexedWithInt64``; ``ct.launch`` refuses a shape or stride
above 2^31 - 1 (``OverflowError: stride is too big``), and offsets inside an int32-indexed array are
computed in int32, so no array whose largest element offset reaches 2^31 may reach a kernel. An
int64-indexed twin of every kernel would double the specialisations and put 64-bit address arithmetic
into kernels whose common case never needs it. Instead a launcher whose arrays do not all ``fit`` (the
common path's only extra work: an element count and contiguity check per array) cuts its index space
into rectangular pieces where that is exact, and launches the unchanged kernel once per piece's views:

* along a batch or along rows, for kernels whose outputs per row depend only on that row;
* along K of the block quantizers, on whole tiles (every block and its scale stay in one piece);
* along N of a matmul (output columns);
* never along a matmul's K (that would change the fp32 summation), nor through a 128-row block of
  swizzled scales: cuts on 128-row (and, along K, 4-scale-column) boundaries of the 32x4x4 layout
  keep every piece's scales a contiguous slab, a view.

Whole-tensor reductions (the per-tensor amax of FP8 and NVFP4) are taken over all pieces first (an
exact maximum). So a piece computes bit for bit what the whole launch computes for its elements.

Use: describe the index space as ``Axis`` es (size, the unit cuts fall on) and each array as an
``Operand`` (which of its dimensions follow which axis, at what ratio); ``pieces`` / ``split`` return
the views to launch on; ``plan_extents`` is the pure decision (shapes and strides in, piece extents
out), testable without allocating anything.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Sequence

import torch

from ..numerics import ceil_div

__all__ = ["LIMIT", "Axis", "Operand", "Piece", "span", "fits", "fits_shape", "int32_view", "plan_extents",
           "pieces", "split", "TooLargeError",
           "matmul_axes", "rows_of", "out_dims", "BATCH", "M", "N", "MAX_MATMUL_K", "check_matmul_k"]

#: Exclusive bound on every shape, stride and element offset of an int32-indexed cuTile array.
LIMIT = 2 ** 31

#: Bytes of base-address alignment that the kernels' specialisations assume (``_aot.array``): piece
#: boundaries are placed so that each view keeps it where the whole tensor has it.
_ALIGN_BYTES = 16


class TooLargeError(ValueError):
    """An operand that no cut along the allowed axes brings below ``LIMIT``; a ValueError whose
    message names the operand, its shape and the limit."""


def span(shape: Sequence[int], strides: Sequence[int]) -> int:
    """Elements from the first to the last one an array addresses, both included: 1 + the largest
    element offset (0 for an empty array)."""
    if any(n == 0 for n in shape):
        return 0
    return 1 + sum((n - 1) * s for n, s in zip(shape, strides))


def fits_shape(shape: Sequence[int], strides: Sequence[int]) -> bool:
    """Whether an array of this shape and these strides can be passed to an int32-indexed kernel:
    every size and stride, and its largest element offset, below ``LIMIT``."""
    last, empty = 0, False
    for n, s in zip(shape, strides):
        if n >= LIMIT or not 0 <= s < LIMIT:
            return False
        last += (n - 1) * s
        empty = empty or n == 0
    return empty or last < LIMIT


def fits(*tensors: torch.Tensor) -> bool:
    """``fits_shape`` for each tensor: the launchers' common-path check, so a contiguous tensor of
    fewer than ``LIMIT`` elements (whose sizes, strides and span are at most its element count; torch
    gives size-1 dimensions of such views the contiguous stride) is settled without walking its
    shape."""
    for t in tensors:
        if t.numel() < LIMIT and t.is_contiguous():
            continue
        if not fits_shape(t.shape, t.stride()):
            return False
    return True


def int32_view(t: torch.Tensor) -> torch.Tensor:
    """t with the strides of its size-1 dimensions replaced by in-range ones (such a stride is never
    used to address anything, but a view of a big tensor keeps it, and ``ct.launch`` checks it): the
    stride that dimension would have if t were contiguous over the next one, or the next stride when
    that is out of range."""
    strides = list(t.stride())
    if all(s < LIMIT for s in strides):
        return t
    for i in range(t.ndim - 1, -1, -1):
        if t.shape[i] == 1:
            nxt = strides[i + 1] if i + 1 < t.ndim else 1
            natural = t.shape[i + 1] * nxt if i + 1 < t.ndim else 1
            strides[i] = natural if natural < LIMIT else nxt
    return t.as_strided(t.shape, strides)


@dataclasses.dataclass(frozen=True)
class Axis:
    """One dimension of a launch's index space (rows, K, batch entries, output columns...): its
    ``size``, and ``unit``: pieces start on multiples of it (a tile, a 128-row swizzle block). An
    axis that must not be cut has unit >= size."""

    name: str
    size: int
    unit: int = 1


@dataclasses.dataclass(frozen=True)
class Operand:
    """An array argument of the launch: ``dims`` lists (dimension, axis index, per) for each of its
    dimensions that follows an axis, ``per`` axis elements to one index of that dimension (2 for packed
    e2m1 data along K, 32 for MX scale columns, 128 for the row blocks of swizzled scales). A piece
    [start, stop) of the axis is the slice [start / per, ceil(stop / per)) of the dimension, or to the
    dimension's end for the last piece (padding that belongs to the last piece). Dimensions that
    follow no axis are taken whole (a shared weight, a 0-d scale)."""

    name: str
    tensor: torch.Tensor
    dims: tuple[tuple[int, int, int], ...] = ()


@dataclasses.dataclass
class Piece:
    """One launch: ``ranges`` the [start, stop) of each axis, ``tensors`` the operands' views (in the
    order given to ``pieces``), each passing ``fits``."""

    ranges: tuple[tuple[int, int], ...]
    tensors: tuple[torch.Tensor, ...]


# An operand for the planner: (shape, strides, itemsize, dims).
_Spec = tuple[tuple[int, ...], tuple[int, ...], int, tuple[tuple[int, int, int], ...]]


def _piece_shape(shape, dims, axis_ranges):
    """The shape of an operand's view of the piece with ``axis_ranges`` ((start, stop, last) per axis)."""
    out = list(shape)
    for dim, axis, per in dims:
        start, stop, last = axis_ranges[axis]
        end = shape[dim] if last else min(shape[dim], ceil_div(stop, per))
        out[dim] = max(0, end - start // per)
    return out


def _spec_fits(spec: _Spec, shape) -> bool:
    """Whether the operand's view of this shape fits once ``int32_view`` has fixed its size-1 strides."""
    strides = [0 if n == 1 else s for n, s in zip(shape, spec[1])]
    return fits_shape(shape, strides)


def _extents_fit(sizes, extents, specs) -> bool:
    """Whether the first and the last piece (the middle ones are like the first) of every operand fit."""
    first = [(0, min(e, n), e >= n) for n, e in zip(sizes, extents)]
    last = [((ceil_div(n, e) - 1) * e, n, True) for n, e in zip(sizes, extents)]
    return all(_spec_fits(spec, _piece_shape(spec[0], spec[3], rng)) for spec in specs for rng in (first, last))


def _aligned_units(sizes, units, specs) -> list[int]:
    """Units grown so that a cut keeps every view's base address as aligned as the tensor's (at most
    ``_ALIGN_BYTES``): a kernel specialisation then serves the pieces as it serves the whole."""
    units = list(units)
    for shape, strides, itemsize, dims in specs:
        for dim, axis, per in dims:
            step = strides[dim] * itemsize  # bytes per index of this dimension
            need = _ALIGN_BYTES // math.gcd(_ALIGN_BYTES, step) if step else 1
            units[axis] = math.lcm(units[axis], per * need)
    return [min(u, max(n, 1)) for u, n in zip(units, sizes)]


def _candidates(size: int, unit: int) -> list[int]:
    """Extents to try along an axis, largest first: the whole axis, then unit * 2^j below it."""
    out = [size]
    e = unit
    while e < size:
        out.append(e)
        e *= 2
    return sorted(set(out), reverse=True)


def plan_extents(sizes: tuple[int, ...], units: tuple[int, ...], specs: tuple[_Spec, ...]) -> tuple[int, ...] | None:
    """Piece extents, one per axis, for a launch whose index space has these axis ``sizes`` and cut
    ``units``, and whose operands are ``specs`` ((shape, strides, itemsize, dims) as ``Operand``):
    the fewest pieces in which every operand's view ``fits`` (ties: the larger extents on the earlier
    axes), every extent a multiple of its unit or the whole axis; None when even pieces of one unit
    along every axis do not fit. Units are first grown so that every view keeps its tensor's 16-byte
    base alignment (``_aligned_units``), and taken as given only where that leaves no plan. A pure
    function of shapes and strides (and ``LIMIT``), cached."""
    return _plan_extents(tuple(sizes), tuple(units), tuple(specs), LIMIT, True)


@functools.lru_cache(maxsize=256)
def _plan_extents(sizes, units, specs, limit, align) -> tuple[int, ...] | None:
    if not sizes:
        return None
    if align:
        # Aligned cuts where they exist; otherwise any (a piece may then need its own specialisation).
        aligned = _plan_extents(sizes, tuple(_aligned_units(sizes, units, specs)), specs, limit, False)
        return aligned if aligned is not None else _plan_extents(sizes, units, specs, limit, False)
    units = [min(u, max(n, 1)) for u, n in zip(units, sizes)]
    if _extents_fit(sizes, sizes, specs):
        return tuple(sizes)
    best, best_count = None, None

    def largest(i, chosen):
        """The largest extent along axis i that fits with ``chosen`` before it and whole axes after
        it (bisection over multiples of the unit; 0 when one unit does not fit)."""
        lo, hi = 0, ceil_div(sizes[i], units[i])
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if _extents_fit(sizes, (*chosen, min(mid * units[i], sizes[i]), *sizes[i + 1:]), specs):
                lo = mid
            else:
                hi = mid - 1
        return min(lo * units[i], sizes[i])

    def search(i, chosen):
        nonlocal best, best_count
        if i == len(sizes) - 1:
            e = largest(i, chosen)
            if e:
                ext = (*chosen, e)
                count = math.prod(ceil_div(n, x) for n, x in zip(sizes, ext))
                if best_count is None or count < best_count:
                    best, best_count = ext, count
            return
        for e in sorted({*_candidates(sizes[i], units[i]), largest(i, chosen)} - {0}, reverse=True):
            search(i + 1, (*chosen, e))

    search(0, ())
    return best


def _spec(op: Operand) -> _Spec:
    t = op.tensor
    return (tuple(t.shape), tuple(t.stride()), t.element_size(), tuple(op.dims))


def split(where: str, axes: Sequence, operands: Sequence) -> list[tuple[torch.Tensor, ...]]:
    """The operands per launch: the tensors themselves, once, when they all ``fit`` (the common case,
    which costs only that check), else each piece's views (``pieces``). ``axes`` and ``operands``
    may be given as the plain tuples (name, size, unit) and (name, tensor, dims), which become
    ``Axis`` / ``Operand`` only when there is something to cut."""
    tensors = tuple(op.tensor if isinstance(op, Operand) else op[1] for op in operands)
    if fits(*tensors):
        return [tensors]
    axes = [a if isinstance(a, Axis) else Axis(*a) for a in axes]
    operands = [op if isinstance(op, Operand) else Operand(*op) for op in operands]
    return [p.tensors for p in pieces(where, axes, operands)]


def pieces(where: str, axes: Sequence[Axis], operands: Sequence[Operand]) -> list[Piece]:
    """The pieces of a launch whose operands do not all ``fit``: views of every operand per piece, in
    launch order (axis 0 slowest). Raises ``TooLargeError`` naming the operand that cannot be brought
    below ``LIMIT`` by cuts along ``axes``; ``where`` names the caller."""
    sizes = tuple(a.size for a in axes)
    specs = tuple(_spec(op) for op in operands)
    extents = plan_extents(sizes, tuple(max(1, a.unit) for a in axes), specs)
    if extents is None:
        units = [min(max(1, a.unit), max(a.size, 1)) for a in axes]
        smallest = [(0, min(u, n), u >= n) for n, u in zip(sizes, units)]
        bad = next((op for op, spec in zip(operands, specs)
                    if not _spec_fits(spec, _piece_shape(spec[0], spec[3], smallest))), operands[0])
        cuts = ", ".join(f"{a.name} in steps of {u}" for a, u in zip(axes, units) if u < a.size) or "none"
        raise TooLargeError(
            f"{where}: {bad.name} of shape {tuple(bad.tensor.shape)} and strides {tuple(bad.tensor.stride())} "
            f"cannot be cut into pieces whose sizes, strides and element offsets stay below "
            f"2^{LIMIT.bit_length() - 1} = {LIMIT} "
            f"(the kernels index in 32 bits; possible cuts: {cuts})")
    out = []
    starts = [range(0, max(n, 1), e) for n, e in zip(sizes, extents)]

    def walk(i, ranges):
        if i == len(axes):
            rng = [(s, e, e >= n) for (s, e), n in zip(ranges, sizes)]
            views = []
            for op in operands:
                t = op.tensor
                for dim, axis, per in op.dims:
                    s, e, last = rng[axis]
                    begin = s // per
                    end = t.shape[dim] if last else min(t.shape[dim], ceil_div(e, per))
                    t = t.narrow(dim, begin, max(0, end - begin))
                views.append(int32_view(t))
            out.append(Piece(tuple(ranges), tuple(views)))
            return
        for s in starts[i]:
            walk(i + 1, (*ranges, (s, min(s + extents[i], sizes[i]))))

    walk(0, ())
    return out


# --------------------------------------------------------------------------------------------------
# Matmuls: out (B, M, N) cut along its batch, M (x's rows) and N (the weight's rows); never along K.
# --------------------------------------------------------------------------------------------------

BATCH, M, N = 0, 1, 2  # axis indices of ``matmul_axes``


def matmul_axes(batch: int, m: int, n: int, m_unit: int, n_unit: int) -> tuple[tuple[str, int, int], ...]:
    """The index space of a matmul's output, as ``split`` takes it: batch entries, then M cut on
    multiples of ``m_unit`` and N on multiples of ``n_unit`` (whole output tiles, and whole 128-row
    blocks of swizzled scales)."""
    return ("batch", batch, 1), ("M", m, m_unit), ("N", n, n_unit)


def rows_of(t: torch.Tensor, batch: int, axis: int, per: int = 1) -> tuple[tuple[int, int, int], ...]:
    """Dims of a (Bt, R, ...) operand whose dimension 1 follows ``axis`` (M or N) at ``per`` rows per
    index (128 for the row blocks of swizzled scales) and whose dimension 0 follows the batch when
    it has one entry per batch entry (Bt = 1: shared by the whole batch, taken whole)."""
    dims = ((1, axis, per),)
    return ((0, BATCH, 1), *dims) if t.shape[0] == batch != 1 else dims


def out_dims() -> tuple[tuple[int, int, int], ...]:
    """Dims of the (B, M, N) output."""
    return (0, BATCH, 1), (1, M, 1), (2, N, 1)


def matmul_operands(a, a_scale, b, b_scale, out, alpha, bias, batch: int, a_per: int = 1, b_per: int = 1,
                    scaled: bool = True, a_tensor: bool = False, b_tensor: bool = False) -> list:
    """The operands of a matmul launch as ``split`` takes them, in the kernels' order: x (B, M, K),
    its scales (``a_per`` rows of x per scale row), y (B, N, K), its scales, the (B, M, N) output,
    alpha (taken whole) and the (N,) bias. ``scaled=False``: the scale arguments are stand-ins, taken
    whole; ``a_tensor`` / ``b_tensor``: that scale is one per-tensor value, taken whole."""
    return [("x", a, rows_of(a, batch, M)),
            ("x_scale", a_scale, rows_of(a_scale, batch, M, a_per) if scaled and not a_tensor else ()),
            ("y", b, rows_of(b, batch, N)),
            ("y_scale", b_scale, rows_of(b_scale, batch, N, b_per) if scaled and not b_tensor else ()),
            ("out", out, out_dims()), ("alpha", alpha),
            ("bias", bias, ((0, N, 1),))]


#: The largest K (elements) of a matmul on the GPU. K is never cut (that would change the fp32
#: summation), so the smallest piece of an operand is one tile of rows by all of K: 256 rows (the
#: largest tile_m / tile_n of any matmul kernel, also of the 16-bit copies that Hopper's two-pass
#: design multiplies, whose K is padded up to 512) times K must stay below 2^31, i.e. K <= 2^23 - 512;
#: the bound is rounded down to a power of two.
MAX_MATMUL_K = 2 ** 22


def check_matmul_k(fn: str, name: str, shape: Sequence[int], k: int) -> None:
    """Raise ValueError unless a GPU matmul can take K = ``k`` (``MAX_MATMUL_K``); ``name`` and
    ``shape`` describe the operand it comes from, ``fn`` the public function."""
    if k > MAX_MATMUL_K:
        raise ValueError(f"{fn}: {name} of shape {tuple(shape)} has K = {k}; GPU matmuls take K up to "
                         f"2^22 = {MAX_MATMUL_K} (the kernels index in 32 bits and never split K)")
