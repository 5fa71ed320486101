"""The GPU quantizers (tilemm/kernels/quantize_kernels.py) against the CPU reference, bit for bit.

Every case builds one input on the CPU, quantizes it there (the pure-PyTorch reference) and on the GPU
(the public function dispatches CUDA tensors to the cuTile kernels), and compares data, scales and
NVFP4's decode scale as raw bytes (``torch.equal`` on uint8 / int32 views): NaN payloads, signed zeros
and the zero padding of the 32x4x4 layout included.

Inputs (``INPUTS``) cover random values over a wide exponent range, zeros, fp32 subnormals, the
+-Qmax * 2^k boundaries and the values just around them, e2m1 / fp8 rounding ties, NaN and +-Inf, on
shapes that need padding (rows 1, 17, 129, 300; K = 32, 96, 160 scale columns 1, 3, 5) and batches.

Each distinct (kernel, constants, alignment of shapes and strides) compiles once per process (and
lands in cuTile's disk cache), so the shapes are shared by all tests and kept few.
"""

from __future__ import annotations

import math
import zlib

import pytest
import torch

import tilemm
from tilemm.formats import FP8_E4M3, FP8_E5M2, MXFP4, MXFP8_E4M3, MXFP8_E5M2, NVFP4


from _gpu import GPU_SKIP_REASON as _SKIP, requires_gpu

pytestmark = requires_gpu

DEV = torch.device("cuda")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
DTYPE_IDS = ["fp32", "bf16", "fp16"]

# (shape, why). K is a multiple of 128 only where FP8 blocks need it.
SHAPES = [
    ((1, 32), "one row, one scale column: 127 padded rows and 3 padded columns when swizzled"),
    ((17, 96), "3 scale columns (MX): a partial 32x4x4 column group"),
    ((129, 160), "one row past a 128-row block, 5 MX / 10 NVFP4 scale columns"),
    ((300, 128), "rows not a multiple of 32 in the last 128-row block"),
    ((2, 130, 256), "a batch: each entry its own swizzled blocks"),
]
FP8_BLOCK_SHAPES = [((1, 128), "one 1x128 block"), ((129, 256), "a partial 128-row block"),
                    ((2, 130, 384), "a batch of partial 128x128 blocks")]


# --------------------------------------------------------------------------------------------------
# Inputs
# --------------------------------------------------------------------------------------------------

def _random(shape, g):
    """Normal values times 2^e, e uniform in [-20, 20]: every block scale differs."""
    return torch.randn(shape, generator=g) * torch.exp2(torch.randint(-20, 21, shape, generator=g).float())


def _boundaries(shape, g):
    """+-Qmax * 2^k of every format and the fp32 neighbours of each, so that block maxima sit exactly
    on, just under and just over a power-of-two scale step (RCEIL vs FLOOR, saturation)."""
    qmaxes = torch.tensor([448.0, 57344.0, 6.0, 2688.0])
    base = qmaxes[torch.randint(0, 4, shape, generator=g)] * torch.exp2(
        torch.randint(-30, 30, shape, generator=g).float())
    nudge = torch.randint(-1, 2, shape, generator=g).to(torch.int32)
    out = (base.view(torch.int32) + nudge).view(torch.float32)
    return out * torch.where(torch.rand(shape, generator=g) < 0.5, -1.0, 1.0)


def _ties(shape, g):
    """e2m1 midpoints (0.25, 0.75, ..., 5) and fp8 grid points / midpoints, scaled by a power of two
    shared by each 16-element group, so that they stay ties after the block scale."""
    vals = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 0.5, 1.0, 3.0, 4.0, 5.5, 7.0,
                         1.0625, 1.1875, 448.0, 464.0, 240.0, 232.0, 0.0])
    x = vals[torch.randint(0, len(vals), shape, generator=g)]
    x = x * torch.where(torch.rand(shape, generator=g) < 0.5, -1.0, 1.0)
    e = torch.randint(-6, 7, (*shape[:-1], -(-shape[-1] // 16)), generator=g).float()
    return x * torch.exp2(e).repeat_interleave(16, dim=-1)[..., :shape[-1]]


def _subnormal(shape, g):
    """fp32 subnormals (and a few normal tiny values): scale byte 0 and flushed-to-zero traps."""
    x = torch.randn(shape, generator=g) * 1e-40
    return torch.where(torch.rand(shape, generator=g) < 0.1, torch.randn(shape, generator=g) * 1e-37, x)


def _specials(shape, g):
    """Random values with NaN, +-Inf, +-0, FLT_MAX and huge / tiny values sprinkled in."""
    x = _random(shape, g)
    flat = x.view(-1)
    specials = [float("nan"), float("inf"), float("-inf"), 0.0, -0.0, 3.4028234663852886e38,
                -3.4028234663852886e38, 1e-45, 1e30, -1e-30, 448.0, -57344.0, 6.0]
    n = flat.numel()
    picks = torch.randint(0, n, (max(1, n // 64),), generator=g).tolist()
    for i, p in enumerate(picks):
        flat[p] = specials[i % len(specials)]
    return x


def _zeros(shape, g):
    """All zeros with some negative zeros: zero scales and +0 data (NaN-free NVFP4 amax 0)."""
    return torch.where(torch.rand(shape, generator=g) < 0.5, torch.tensor(-0.0), torch.tensor(0.0))


INPUTS = {"random": _random, "boundaries": _boundaries, "ties": _ties, "subnormal": _subnormal,
          "specials": _specials, "zeros": _zeros}


def make_input(shape, kind, dtype, seed=0):
    g = torch.Generator().manual_seed(zlib.crc32(repr((shape, kind, seed)).encode()))
    return INPUTS[kind](shape, g).to(dtype)


# --------------------------------------------------------------------------------------------------
# Comparison
# --------------------------------------------------------------------------------------------------

def _raw(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().cpu().contiguous()
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def assert_same_bits(got, ref, what: str) -> None:
    """got (GPU) and ref (CPU) have the same shape, dtype and bytes."""
    assert got.dtype == ref.dtype, f"{what}: dtype {got.dtype} != reference {ref.dtype}"
    assert tuple(got.shape) == tuple(ref.shape), f"{what}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
    a, b = _raw(got), _raw(ref)
    if not torch.equal(a, b):
        bad = (a != b).nonzero()
        first = [tuple(i) for i in bad[:5].tolist()]
        pairs = [(a[i].item(), b[i].item()) for i in first]
        raise AssertionError(f"{what}: {len(bad)} of {a.numel()} differ; first at {first}: "
                             f"(gpu, reference) = {pairs}")


def poison_allocator_cache() -> None:
    """Leave 0xFF bytes in the blocks PyTorch's caching allocator hands out next: outputs of up to 1 MiB
    come from its small pool (2 MiB segments), larger ones from the large pool."""
    small = [torch.full((1 << 20,), 0xFF, dtype=torch.uint8, device=DEV) for _ in range(32)]
    large = torch.full((64 << 20,), 0xFF, dtype=torch.uint8, device=DEV)
    del small, large


def check(quantize, x_cpu: torch.Tensor, what: str, **kwargs) -> None:
    try:
        ref = quantize(x_cpu, **kwargs)
    except ValueError as refused:  # e.g. an NVFP4 global scale that zeroes or saturates every block
        with pytest.raises(ValueError) as on_gpu:
            quantize(x_cpu.to(DEV), **kwargs)
        assert str(on_gpu.value) == str(refused), f"{what}: the GPU path refuses differently"
        return
    got = quantize(x_cpu.to(DEV), **kwargs)
    assert all(t.is_cuda for t in got), f"{what}: the GPU path returned CPU tensors"
    for name, g, r in zip(type(ref)._fields, got, ref):
        assert_same_bits(g, r, f"{what} {name}")


def _cases(shapes):
    return [(shape, kind) for shape, _ in shapes for kind in INPUTS]


# --------------------------------------------------------------------------------------------------
# Block formats: every format, dtype, scale rounding and scale layout
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("swizzle", [False, True], ids=["logical", "swizzled"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("fmt", [MXFP8_E4M3, MXFP8_E5M2], ids=lambda f: f.name)
def test_mxfp8(fmt, dtype, swizzle):
    for shape, kind in _cases(SHAPES):
        x = make_input(shape, kind, dtype)
        for rounding in ("rceil", "floor"):
            check(tilemm.quantize_mxfp8, x, f"{fmt.name} {rounding} {shape} {kind}",
                  elem_dtype=fmt.data_dtype, rounding=rounding, swizzle=swizzle)


@pytest.mark.parametrize("swizzle", [False, True], ids=["logical", "swizzled"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_mxfp4(dtype, swizzle):
    for shape, kind in _cases(SHAPES):
        x = make_input(shape, kind, dtype)
        for rounding in ("rceil", "floor"):
            check(tilemm.quantize_mxfp4, x, f"mxfp4 {rounding} {shape} {kind}", rounding=rounding,
                  swizzle=swizzle)


@pytest.mark.parametrize("swizzle", [False, True], ids=["logical", "swizzled"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_nvfp4(dtype, swizzle):
    for shape, kind in _cases(SHAPES):
        x = make_input(shape, kind, dtype)
        # None: the amax pass. Given decode scales: typical, tiny (saturating codes, s_b rounding to 0)
        # and huge (S_enc underflows towards 0); a Python float and a bf16 tensor must agree.
        for gs in (None, 0.37, 1e-30, 1e30, torch.tensor(0.02, dtype=torch.bfloat16)):
            check(tilemm.quantize_nvfp4, x, f"nvfp4 gs={gs!r} {shape} {kind}", global_scale=gs,
                  swizzle=swizzle)


# --------------------------------------------------------------------------------------------------
# FP8: per tensor, per row, 1x128, 128x128
# --------------------------------------------------------------------------------------------------

FP8_ODD_SHAPES = [((1, 7), "K not a multiple of anything"), ((17, 96), "a few rows"),
                  ((3, 130, 200), "a batch, K past a 128-column tile"), ((5,), "1-D x")]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("granularity", ["tensor", "row"])
@pytest.mark.parametrize("fmt", [FP8_E4M3, FP8_E5M2], ids=lambda f: f.name)
def test_fp8_tensor_and_row(fmt, granularity, dtype):
    for shape, kind in _cases(FP8_ODD_SHAPES + SHAPES[1:2]):
        x = make_input(shape, kind, dtype)
        check(tilemm.quantize_fp8, x, f"{fmt.name} {granularity} {shape} {kind}",
              granularity=granularity, elem_dtype=fmt.data_dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("granularity", [(1, 128), (128, 128)], ids=["1x128", "128x128"])
def test_fp8_blocks(granularity, dtype):
    for shape, kind in _cases(FP8_BLOCK_SHAPES):
        x = make_input(shape, kind, dtype)
        for pow2 in (False, True):
            check(tilemm.quantize_fp8, x, f"fp8 {granularity} pow2={pow2} {shape} {kind}",
                  granularity=granularity, pow2_scale=pow2)


def _fp8_grid_and_midpoints(fmt):
    """Every non-negative finite value of fmt's fp8 type and every midpoint between neighbours
    (subnormal ones included), as fp64."""
    values = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(fmt.data_dtype).double()
    values = values[torch.isfinite(values) & (values >= 0)].unique().sort().values
    return torch.cat([values, (values[:-1] + values[1:]) / 2])


def _near_fp8_boundaries(fmt, amax: float, k: int, rows: int, near: bool, g) -> torch.Tensor:
    """fp32 x (rows, k) with x / s within a few fp32 ulps of fp8 values and midpoints, s = fp32(amax /
    Qmax) (the scale every group gets: each row and each 128-block holds +-amax at its start).

    near=False: offsets of 6..40 ulps, where the kernel's two bracketing casts agree and it skips the
    division; near=True: offsets of -3..3 ulps, which put a rounding boundary inside the bracket
    (the tile falls back to the IEEE division) or hit a tie exactly."""
    s = torch.tensor(amax, dtype=torch.float32) / fmt.qmax
    points = _fp8_grid_and_midpoints(fmt)
    points = points[points <= fmt.qmax]  # keep |x| <= amax, so that the scale stays s
    picks = points[torch.randint(0, len(points), (rows, k), generator=g)]
    x = (picks * s.double()).float()
    mag = torch.randint(6, 41, (rows, k), generator=g)
    offsets = torch.randint(-3, 4, (rows, k), generator=g) if near else mag * torch.where(
        torch.rand(rows, k, generator=g) < 0.5, -1, 1)
    x = (x.view(torch.int32) + offsets.to(torch.int32)).clamp(min=0).view(torch.float32)  # x >= 0 here
    x = torch.minimum(x.abs(), torch.tensor(amax, dtype=torch.float32)) * torch.where(
        torch.rand(rows, k, generator=g) < 0.5, -1.0, 1.0)
    x[:, ::128] = torch.where(torch.rand(rows, k // 128 if k >= 128 else 1, generator=g) < 0.5, -amax, amax)
    return x


# amax values: s = amax / Qmax not a power of two (the bracketing multiplies), a power of two (exact
# reciprocal, never a fallback), tiny (s an fp32 subnormal: the IEEE division throughout for per
# tensor / row) and huge.
FP8_BOUNDARY_AMAX = [448.0 * 0.0123, 448.0 * 2.0 ** -7, 1e-39, 3.0e38]


@pytest.mark.parametrize("granularity", ["tensor", "row", (1, 128), (128, 128)],
                         ids=["tensor", "row", "1x128", "128x128"])
@pytest.mark.parametrize("fmt", [FP8_E4M3, FP8_E5M2], ids=lambda f: f.name)
def test_fp8_near_rounding_boundaries(fmt, granularity):
    """x / s a few ulps from every fp8 rounding boundary, normal and subnormal fp8 results: the
    kernel's division-free path (two bracketing multiplies) and its per-tile fallback both match the
    IEEE division of the reference. The first 128 columns hold far offsets, the next 128 near ones."""
    if fmt is FP8_E5M2 and granularity not in ("tensor", "row"):
        pytest.skip("FP8 blocks are e4m3 only")
    g = torch.Generator().manual_seed(zlib.crc32(repr((fmt.name, granularity)).encode()))
    for amax in FP8_BOUNDARY_AMAX:
        x = torch.cat([_near_fp8_boundaries(fmt, amax, 128, 130, False, g),
                       _near_fp8_boundaries(fmt, amax, 128, 130, True, g)], dim=1)
        for pow2 in ((False, True) if granularity in ((1, 128), (128, 128)) else (False,)):
            check(tilemm.quantize_fp8, x, f"{fmt.name} {granularity} amax={amax} pow2={pow2}",
                  granularity=granularity, elem_dtype=fmt.data_dtype, pow2_scale=pow2)
            check(tilemm.quantize_fp8, x.to(torch.bfloat16), f"{fmt.name} {granularity} amax={amax} bf16",
                  granularity=granularity, elem_dtype=fmt.data_dtype, pow2_scale=pow2)


# --------------------------------------------------------------------------------------------------
# Layouts: axis=-2 (a transposed read), non-contiguous inputs, empty tensors, poisoned memory
# --------------------------------------------------------------------------------------------------

QUANTIZERS = {
    "mxfp8_e4m3": lambda x, **kw: tilemm.quantize_mxfp8(x, **kw),
    "mxfp8_e5m2": lambda x, **kw: tilemm.quantize_mxfp8(x, elem_dtype=torch.float8_e5m2, **kw),
    "mxfp4": lambda x, **kw: tilemm.quantize_mxfp4(x, rounding="floor", **kw),
    "nvfp4": lambda x, **kw: tilemm.quantize_nvfp4(x, **kw),
}
# The named-tuple type for check(): the lambdas hide it.
_RESULT = {"mxfp8_e4m3": tilemm.MXFP8Tensor, "mxfp8_e5m2": tilemm.MXFP8Tensor, "mxfp4": tilemm.MXFP4Tensor,
           "nvfp4": tilemm.NVFP4Tensor}


@pytest.mark.parametrize("k", [1500, 3000, 8192, 9000], ids=lambda k: f"K{k}")
def test_fp8_row_tiles(k):
    """Per row, each row tile (2048, 4096, 8192 columns) and rows longer than 8192 (two passes)."""
    from tilemm.kernels import quantize_kernels as qk

    assert qk.plan("fp8_row", k=k).tile_k == min(8192, 1 << (k - 1).bit_length())
    for kind in ("random", "specials"):
        x = make_input((5, k), kind, torch.bfloat16)
        poison_allocator_cache()
        check(tilemm.quantize_fp8, x, f"fp8 row K={k} {kind}", granularity="row")


def _check_named(name, x_cpu, what, **kwargs):
    ref = QUANTIZERS[name](x_cpu, **kwargs)
    got = QUANTIZERS[name](x_cpu.to(DEV), **kwargs)
    for field, g, r in zip(_RESULT[name]._fields, got, ref):
        assert_same_bits(g, r, f"{what} {field}")


@pytest.mark.parametrize("swizzle", [False, True], ids=["logical", "swizzled"])
@pytest.mark.parametrize("name", list(QUANTIZERS))
def test_axis_minus_2_reads_the_transpose(name, swizzle):
    """axis=-2 on x (..., K, M) is quantize(x.mT); the kernel reads x's storage transposed."""
    for shape, kind in _cases(SHAPES[1:]):
        x = make_input(shape[:-2] + (shape[-1], shape[-2]), kind, torch.bfloat16)  # (..., K, M)
        _check_named(name, x, f"{name} axis=-2 {shape} {kind}", swizzle=swizzle, axis=-2)
        # A transposed view passed directly takes the same path.
        ref = QUANTIZERS[name](x.mT.contiguous(), swizzle=swizzle)
        got = QUANTIZERS[name](x.to(DEV).mT, swizzle=swizzle)
        for field, g, r in zip(_RESULT[name]._fields, got, ref):
            assert_same_bits(g, r, f"{name} x.mT view {shape} {kind} {field}")


@pytest.mark.parametrize("granularity", ["tensor", "row", (1, 128), (128, 128)],
                         ids=["tensor", "row", "1x128", "128x128"])
def test_fp8_axis_minus_2(granularity):
    # (K, M). Per row, the transposed amax pass reduces up to 16 tiles of 128 down K per block: K =
    # 2560 takes two blocks per column tile (every other tile each), K = 640 one, the quantize pass's
    # 256-row tiles end partial at K = 640 and K = 7 (per tensor and row only: blocks need K % 128 == 0);
    # M = 130 and 200 end in partial column tiles; and a batch of two.
    shapes = [(256, 130), (640, 130), (2560, 130), (2, 768, 200)]
    for shape in shapes + ([(7, 130)] if granularity in ("tensor", "row") else []):
        x = make_input(shape, "specials", torch.bfloat16)
        check(tilemm.quantize_fp8, x, f"fp8 {granularity} axis=-2 {shape}", granularity=granularity, axis=-2)


def test_fp8_row_axis_minus_2_visits_every_k_tile():
    """Per row along axis=-2, each column's maximum sits in a different one of the 21 K tiles, which
    the amax pass's two blocks per column tile take in turns (last to first): every scale must come
    from its spike."""
    k, m = 21 * 128, 130
    x = make_input((k, m), "random", torch.bfloat16).clamp(-1, 1)
    cols = torch.arange(m)
    x[(cols * 131 + 17) % k, cols] = (100 + cols).to(torch.bfloat16) * torch.where(cols % 2 == 0, 1, -1)
    check(tilemm.quantize_fp8, x, "fp8 row axis=-2 spikes", granularity="row", axis=-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("name", list(QUANTIZERS))
def test_axis_minus_2_other_input_dtypes(name, dtype):
    """The transposed kernels with fp32 and fp16 input (the test above runs bf16), over a poisoned
    allocator cache."""
    shape = SHAPES[2][0]
    for swizzle in (False, True):
        for kind in ("random", "specials"):
            x = make_input((shape[1], shape[0]), kind, dtype)  # (K, M)
            poison_allocator_cache()
            _check_named(name, x, f"{name} axis=-2 {dtype} {kind} swizzle={swizzle}", swizzle=swizzle, axis=-2)


def test_non_contiguous_rows():
    """A row-sliced view (stride(-2) != K) is read through its strides or copied, never misread."""
    x = make_input((64, 256), "random", torch.bfloat16)[::3, 64:224]
    for name in QUANTIZERS:
        _check_named(name, x, f"{name} sliced", swizzle=True)


def test_empty_batch():
    """No elements: the reference path answers on the GPU (nothing to launch)."""
    x = torch.empty(0, 17, 64, dtype=torch.bfloat16)
    for name in QUANTIZERS:
        _check_named(name, x, f"{name} empty", swizzle=True)


def test_padding_written_over_poisoned_memory():
    """Outputs come from torch.empty; fill the allocator's cache with 0xFF first so that a padding byte
    the kernel forgot to write shows up as 0xFF instead of a lucky zero."""
    for _ in range(3):
        poison_allocator_cache()
        for name in QUANTIZERS:
            _check_named(name, make_input((17, 96), "random", torch.bfloat16), f"{name} poisoned",
                         swizzle=True)


def test_large_matches_reference_on_device():
    """A matmul-sized operand, against the reference run on the same GPU (the CPU would be slow)."""
    from tilemm import quantize as q

    x = make_input((2048, 4096), "random", torch.bfloat16).to(DEV)
    got = tilemm.quantize_mxfp8(x, swizzle=True)
    ref = q._quantize_mxfp8_reference(x, MXFP8_E4M3, "rceil", True)
    assert_same_bits(got.data, ref.data, "mxfp8 large data")
    assert_same_bits(got.scale, ref.scale, "mxfp8 large scale")
    got = tilemm.quantize_nvfp4(x, swizzle=True)
    ref = q._quantize_nvfp4_reference(x, None, True)
    for field, g, r in zip(tilemm.NVFP4Tensor._fields, got, ref):
        assert_same_bits(g, r, f"nvfp4 large {field}")
    assert math.isfinite(float(got.global_scale))


@pytest.mark.parametrize("transposed", [False, True], ids=["rows", "columns"])
def test_tensor_amax_visits_every_tile(transposed):
    """The amax pass walks its tiles last to first, row by row or (a transposed input) column by
    column, some blocks taking more than one tile. A single largest value placed in the first, the
    last, an edge (partial) and an interior tile, in each batch entry, must be found every time; NaN
    counts only when propagated."""
    from tilemm.kernels import quantize_kernels as qk

    shape = (2, 2100, 1030)  # storage (B, rows, cols): 2 x 33 x 9 tiles of 64x128, more than one wave
    g = torch.Generator().manual_seed(7)
    base = (torch.rand(shape, generator=g) - 0.5).to(torch.bfloat16).to(DEV)
    spots = [(0, 0, 0), (1, 2099, 1029), (0, 2099, 5), (1, 7, 1029), (1, 1000, 600), (0, 64 * 20, 128 * 4)]
    for b, r, c in spots:
        x = base.clone()
        x[b, r, c] = -3.5
        view = x.mT if transposed else x  # the kernel reads x's storage either way
        for propagate in (False, True):
            got = qk.amax_value(qk.tensor_amax(view, propagate_nan=propagate))
            assert got.item() == 3.5, f"spot {(b, r, c)} propagate={propagate}: {got.item()}"
        x[1 - b, r // 2, c // 2] = float("nan")
        view = x.mT if transposed else x
        assert qk.amax_value(qk.tensor_amax(view, propagate_nan=False)).item() == 3.5
        assert math.isnan(qk.amax_value(qk.tensor_amax(view, propagate_nan=True)).item())
        # Without propagation (NVFP4's tensor amax) an Inf counts as 0 too: the maximum is over the
        # finite elements.
        x[b, (r + 1) % 2100, c // 3] = float("-inf")
        view = x.mT if transposed else x
        assert qk.amax_value(qk.tensor_amax(view, propagate_nan=False)).item() == 3.5


@pytest.mark.parametrize("swizzle", [False, True], ids=["logical", "swizzled"])
@pytest.mark.parametrize("m", [1, 16])
def test_nvfp4_of_an_activation_is_one_kernel(m, swizzle):
    from _gpu import kernels_per_call

    x = torch.randn(m, 4096, device=DEV, dtype=torch.bfloat16)
    kernels = kernels_per_call(lambda: tilemm.quantize_nvfp4(x, swizzle=swizzle))
    assert len(kernels) == 1, kernels


@pytest.mark.parametrize("transposed", [False, True], ids=["rows", "axis-2"])
@pytest.mark.parametrize("swizzle", [False, True], ids=["logical", "swizzled"])
@pytest.mark.parametrize("shape", [(1, 4096), (16, 4096), (3, 40, 512)], ids=["1x4096", "16x4096", "3x40x512"])
def test_nvfp4_amax_in_the_launch_matches_the_amax_pass(shape, swizzle, transposed):
    """The tensor amax taken inside the quantize launch (its grid within one block per SM) gives the
    bits of ``tensor_amax`` followed by the quantize launch, with a NaN and an Inf in the input."""
    from tilemm.kernels import quantize_kernels as qk

    g = torch.Generator().manual_seed(31)
    x = (torch.randn(shape, generator=g) * 5).to(torch.bfloat16)
    x.view(-1)[7] = float("nan")
    x.view(-1)[-3] = float("inf")
    x = x.to(DEV)
    if transposed:
        x = x.mT.contiguous().mT
    op = qk._operand(x)
    cfg = qk.plan("nvfp4", swizzled=swizzle, transposed=op.transposed)
    grid = qk._view_grid(op.view if swizzle else qk._rows_flattened(op).view, op.transposed, cfg, swizzle)
    assert grid[0] <= qk.num_sms(x.device)  # the one-launch path
    one = qk.quantize_nvfp4(x, None, swizzle)
    amax = qk.amax_value(qk.tensor_amax(x, propagate_nan=False)).view(torch.int32)
    two = qk.quantize_nvfp4(x, None, swizzle, amax=amax)
    for a, b in zip(one, two):
        assert torch.equal(a.view(torch.uint8) if a.dtype != torch.float32 else a.view(torch.int32),
                           b.view(torch.uint8) if b.dtype != torch.float32 else b.view(torch.int32))
