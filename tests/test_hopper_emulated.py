"""The Hopper kernels' tile code and launchers, run on the CPU through a NumPy model of cuTile.

cuTile has no CPU interpreter, and CI has no GPU. ``HopperEmulator`` runs the kernels' own Python
functions (``hopper_block_scaled``'s stream, split-K reduction and dequantize kernels, the
``hopper_gemm`` kernel under ``hopper_fp8``) with ``ct`` replaced by NumPy versions of the operations
they use, block by block over the launch grid that the real launcher computes. It checks the index
arithmetic (swapped operands, split-K ranges, the 32x4x4 scale slices for 16- / 64-row tiles, the
nibble order, K padding of the dequantized copies, persistent tile loops, batch broadcast) against
``tilemm.reference``, and the exactness argument of the module docstring: every 16-bit operand that
reaches ``ct.mma`` must be exactly representable in its dtype (the model asserts it), and every
elementwise product of the decode is rounded to its dtype, so an inexact step would show.

It does not check cuTile's compiler, register use or the hardware (tests/test_kernels_gpu.py does,
on an H100).
"""

from __future__ import annotations

import math
import types

import numpy as np
import pytest
import torch

import cuda.tile as ct
import swizzle
from tilemm.formats import MXFP4, MXFP8_E4M3, MXFP8_E5M2, NVFP4
from tilemm.kernels import hopper_block_scaled as hbs
from tilemm.kernels import hopper_fp8 as hfp8
from tilemm.kernels import hopper_gemm as hgemm
from tilemm.matmul import BlockScaledProblem, FP8Problem
from tilemm.reference import block_scaled_matmul_reference, fp8_matmul_reference

BLOCK_FORMATS = [MXFP8_E4M3, MXFP8_E5M2, MXFP4, NVFP4]
FMT_IDS = [f.name for f in BLOCK_FORMATS]

_FLOAT_TORCH = {ct.float32: torch.float32, ct.bfloat16: torch.bfloat16, ct.float16: torch.float16}
_INT_DTYPES = (ct.uint8, ct.uint16, ct.int32)
_SIXTEEN_BIT = (ct.bfloat16, ct.float16)
_CT_OF_TORCH = {torch.float32: ct.float32, torch.bfloat16: ct.bfloat16, torch.float16: ct.float16,
                torch.uint8: ct.uint8, torch.float8_e4m3fn: ct.float8_e4m3fn,
                torch.float8_e5m2: ct.float8_e5m2}


def _round(values: np.ndarray, dtype) -> np.ndarray:
    """float64 values rounded once to a cuTile float dtype (fp32 or 16-bit; others unchanged)."""
    torch_dtype = _FLOAT_TORCH.get(_dt(dtype))
    if torch_dtype is None:
        return values
    return torch.from_numpy(np.asarray(values, dtype=np.float64)).to(torch_dtype).to(torch.float64).numpy()


class Tile(np.ndarray):
    """Values (float64, or int64 for integer tiles) plus the cuTile dtype they stand for.
    Float products and sums are rounded to that dtype, as the hardware would."""

    def __new__(cls, values, dtype):
        t = np.asarray(values).view(cls)
        t.ct_dtype = dtype
        return t

    def __array_finalize__(self, obj):
        self.ct_dtype = getattr(obj, "ct_dtype", None)

    def __array_wrap__(self, out, context=None, return_scalar=False):
        out = super().__array_wrap__(out, context, return_scalar)
        if isinstance(out, Tile) and out.ct_dtype in _FLOAT_TORCH and out.dtype.kind == "f":
            rounded = _round(np.asarray(out), out.ct_dtype)
            if out.ct_dtype in _SIXTEEN_BIT:  # the decode's products must be exact
                assert np.array_equal(rounded, np.asarray(out), equal_nan=True), f"inexact {out.ct_dtype} op"
            out = Tile(rounded, out.ct_dtype)
        return out

    def permute(self, axes):
        return np.transpose(self, axes)

    def astype(self, dtype, *args, **kwargs):
        dtype = _dt(dtype)
        if dtype in _INT_DTYPES:
            if self.ct_dtype not in _INT_DTYPES:
                raise NotImplementedError(f"astype {self.ct_dtype} -> {dtype}")
            return Tile(np.asarray(self, dtype=np.int64), dtype)
        vals = np.asarray(self, dtype=np.float64)
        return Tile(_round(vals, dtype), dtype)


class _DType:
    """A cuTile dtype that, like inside a kernel, also builds scalars (``ct.float16(2.0 ** 14)``)."""

    def __init__(self, dtype):
        self.dtype = dtype

    def __call__(self, value):
        return float(_round(np.array(value, dtype=np.float64), self.dtype))


class EmuArray:
    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor
        self.dtype = _CT_OF_TORCH[tensor.dtype]
        self.shape = tuple(tensor.shape)
        self.ndim = tensor.ndim
        if tensor.dtype == torch.uint8:
            self.values = tensor.to(torch.int64).numpy()
        else:
            self.values = tensor.to(torch.float64).numpy()


def _window(arr_shape, index, shape):
    starts = [i * s for i, s in zip(index, shape)]
    src = tuple(slice(st, min(st + s, n)) for st, s, n in zip(starts, shape, arr_shape))
    dst = tuple(slice(0, sl.stop - sl.start) for sl in src)
    if any(sl.stop <= sl.start for sl in src):
        raise IndexError(f"tile {shape} at index {index} lies entirely outside an array of shape {arr_shape}")
    return src, dst


def _bits_to_float(bits: np.ndarray, dtype) -> np.ndarray:
    b = np.asarray(bits, dtype=np.int64) & 0xFFFF
    if dtype == ct.float16:
        return b.astype(np.uint16).view(np.float16).astype(np.float64)
    if dtype == ct.bfloat16:
        return (b.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    raise NotImplementedError(f"bitcast to {dtype}")


class HopperEmulator:
    """``ct`` for the Hopper kernels, on NumPy; ``run`` calls a kernel's function once per block."""

    PaddingMode = ct.PaddingMode
    Constant = ct.Constant

    def __init__(self):
        self._bid = 0
        self._grid = 1
        for name in ("float32", "float16", "bfloat16", "uint8", "uint16", "int32", "float8_e4m3fn",
                     "float8_e5m2"):
            setattr(self, name, getattr(ct, name))
        self.float16 = _Callable(ct.float16)
        self.bfloat16 = _Callable(ct.bfloat16)

    def bid(self, axis):
        return self._bid if axis == 0 else 0

    def num_blocks(self, axis):
        return self._grid if axis == 0 else 1

    @staticmethod
    def cdiv(a, b):
        return -(-a // b)

    @staticmethod
    def zeros(shape, dtype):
        if isinstance(dtype, np.dtype):  # ``t.dtype`` of a Tile: only used where ct.where takes x's dtype
            return Tile(np.zeros(shape, dtype=dtype), None)
        return Tile(np.zeros(shape, dtype=np.int64 if _dt(dtype) in _INT_DTYPES else np.float64), _dt(dtype))

    @staticmethod
    def full(shape, value, dtype):
        return Tile(np.full(shape, value, dtype=np.int64 if _dt(dtype) in _INT_DTYPES else np.float64), _dt(dtype))

    @staticmethod
    def arange(n, dtype):
        return Tile(np.arange(n, dtype=np.int64), _dt(dtype))

    @staticmethod
    def where(cond, x, y):
        return Tile(np.where(np.asarray(cond, dtype=bool), x, y), x.ct_dtype)

    @staticmethod
    def broadcast_to(t, shape):
        return Tile(np.broadcast_to(np.asarray(t), shape).copy(), t.ct_dtype)

    @staticmethod
    def cat(tiles, axis):
        a, b = tiles
        assert a.shape == b.shape and a.ct_dtype == b.ct_dtype
        return Tile(np.concatenate([np.asarray(a), np.asarray(b)], axis=axis), a.ct_dtype)

    @staticmethod
    def bitcast(tile, dtype):
        if tile.ct_dtype != ct.uint16:
            raise NotImplementedError(f"bitcast from {tile.ct_dtype}")
        return Tile(_bits_to_float(tile, _dt(dtype)), _dt(dtype))

    @staticmethod
    def load(array, index, shape, *, padding_mode=ct.PaddingMode.UNDETERMINED, **hints):
        src, dst = _window(array.shape, index, shape)
        fill = 0 if padding_mode == ct.PaddingMode.ZERO else math.nan  # undefined in cuTile: poison it
        out = np.full(shape, fill, dtype=np.float64)
        out[dst] = array.values[src]
        if array.dtype == ct.uint8:
            if math.isnan(fill) and out.size != out[dst].size:
                raise ValueError("uint8 load past the edge without ZERO padding")
            out = out.astype(np.int64)
        return Tile(out, array.dtype)

    @staticmethod
    def store(array, index, tile):
        src, dst = _window(array.shape, index, tile.shape)
        if tile.ct_dtype != array.dtype:
            raise TypeError(f"storing a {tile.ct_dtype} tile into a {array.dtype} array")
        values = np.ascontiguousarray(tile[dst], dtype=np.float64)
        array.tensor[src] = torch.from_numpy(values).to(array.tensor.dtype)

    @staticmethod
    def mma(x, y, acc, use_fast_acc=False):
        assert x.ndim == y.ndim == acc.ndim == 2 and x.shape[1] == y.shape[0]
        assert acc.shape == (x.shape[0], y.shape[1]) and acc.ct_dtype == ct.float32
        assert x.ct_dtype == y.ct_dtype
        for t in (x, y):  # 16-bit operands must hold their values exactly (the exactness argument)
            v = np.asarray(t)
            exact = _round(v, t.ct_dtype)
            assert np.array_equal(exact, v, equal_nan=True), f"{t.ct_dtype} operand not exact"
        with np.errstate(invalid="ignore"):
            r = np.asarray(x) @ np.asarray(y) + np.asarray(acc)
        return Tile(r.astype(np.float32).astype(np.float64), ct.float32)

    def _rebind(self, fn, memo):
        if fn in memo:
            return memo[fn]
        g = dict(fn.__globals__)
        new = types.FunctionType(fn.__code__, g, fn.__name__, fn.__defaults__, fn.__closure__)
        memo[fn] = new
        g["ct"] = self
        for name, value in list(g.items()):
            if isinstance(value, types.FunctionType) and value.__module__.startswith("tilemm.kernels"):
                g[name] = self._rebind(value, memo)
        return new

    def launch(self, stream, grid, kernel, args):
        fn = self._rebind(kernel._pyfunc, {})
        emu_args = [EmuArray(a) if isinstance(a, torch.Tensor) else a for a in args]
        assert grid[1:] == (1, 1)
        self._grid = grid[0]
        for bid in range(grid[0]):
            self._bid = bid
            fn(*emu_args)


class _Callable(_DType):
    def __eq__(self, other):
        return other is self.dtype or (isinstance(other, _DType) and other.dtype is self.dtype)

    def __hash__(self):
        return hash(self.dtype)


def _dt(dtype):
    return dtype.dtype if isinstance(dtype, _DType) else dtype


@pytest.fixture
def emulated(monkeypatch):
    """Route the Hopper launchers' ``ct.launch`` to the emulator, on CPU tensors."""
    emu = HopperEmulator()
    for module in (hbs, hgemm, hfp8):
        monkeypatch.setattr(module, "ct", _LaunchProxy(emu))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a, **k: None)
    # 4 "SMs": persistent grids are smaller than the tile count, so blocks loop over several tiles.
    monkeypatch.setattr(hgemm, "num_sms", lambda device: 4)
    monkeypatch.setattr(hbs, "num_sms", lambda device: 4)
    return emu


class _LaunchProxy:
    """cuda.tile with ``launch`` replaced (module-level code of the launchers uses ct otherwise)."""

    def __init__(self, emu):
        self._emu = emu

    def launch(self, stream, grid, kernel, args):
        self._emu.launch(stream, grid, kernel, args)

    def __getattr__(self, name):
        return getattr(ct, name)


# --------------------------------------------------------------------------------------------------
# Operands
# --------------------------------------------------------------------------------------------------

def _elements(fmt, rows, k, gen):
    if fmt.is_packed:
        return torch.randint(0, 256, (rows, k // 2), dtype=torch.uint8, generator=gen)
    b = torch.randint(0, 256, (rows, k), dtype=torch.uint8, generator=gen)
    bad = ((0x7F, 0xFF) if fmt.data_dtype == torch.float8_e4m3fn
           else tuple(range(0x7C, 0x80)) + tuple(range(0xFC, 0x100)))  # NaN / Inf codes -> 0
    for code in bad:
        b[b == code] = 0
    return b.view(fmt.data_dtype)


def _scales(fmt, rows, ks, gen):
    if fmt.is_mx:  # 2^-12 .. 2^12, and the extremes 0 (2^-127 with MXFP4 only) exercised elsewhere
        return torch.randint(115, 140, (rows, ks), dtype=torch.uint8, generator=gen).view(torch.float8_e8m0fnu)
    b = torch.randint(0, 0x7F, (rows, ks), dtype=torch.uint8, generator=gen)  # every positive e4m3
    return b.view(torch.float8_e4m3fn)


def block_scaled_case(fmt, m, n, k, *, ba=1, bb=1, swizzled=False, out_dtype=torch.float32, alpha=None,
                      bias=False, seed=0):
    gen = torch.Generator().manual_seed(seed)
    ks = k // fmt.block
    batch = max(ba, bb)
    a = torch.stack([_elements(fmt, m, k, gen) for _ in range(ba)])
    b = torch.stack([_elements(fmt, n, k, gen) for _ in range(bb)])
    sa = torch.stack([_scales(fmt, m, ks, gen) for _ in range(ba)])
    sb = torch.stack([_scales(fmt, n, ks, gen) for _ in range(bb)])
    alpha_t = None if alpha is None else torch.tensor(alpha, dtype=torch.float32)
    bias_t = torch.randn(n, generator=gen) if bias else None
    ref = block_scaled_matmul_reference(fmt, a, sa, b.transpose(-1, -2), sb.transpose(-1, -2),
                                        out_dtype=torch.float64 if out_dtype == torch.float32 else out_dtype,
                                        alpha=alpha_t, bias=bias_t).expand(batch, m, n)
    if swizzled:
        sa, sb = swizzle.swizzle_32_4_4(sa), swizzle.swizzle_32_4_4(sb)
    problem = BlockScaledProblem(fmt=fmt, a=a, a_scale=sa, b=b, b_scale=sb, swizzled=swizzled,
                                 out=torch.full((batch, m, n), float("nan"), dtype=out_dtype),
                                 bias=bias_t, alpha=alpha_t)
    return problem, ref


def assert_matches(out, ref, out_dtype):
    tol = {torch.float32: 1e-5, torch.bfloat16: 4e-3 + 1e-5, torch.float16: 1e-3 + 1e-5}[out_dtype]
    out64, ref64 = out.to(torch.float64), ref.to(torch.float64)
    assert torch.isfinite(out64).all(), "non-finite outputs (an unwritten tile or poison that leaked)"
    err = ((out64 - ref64).norm() / ref64.norm().clamp_min(1e-300)).item()
    assert err < tol, f"relative error {err:.3g} >= {tol}"


# --------------------------------------------------------------------------------------------------
# Block-scaled: stream (small M, split K) and two-pass (large M)
# --------------------------------------------------------------------------------------------------

SMALL = [hbs.StreamConfig(16, 128, 128, 1), hbs.StreamConfig(16, 128, 128, 2),
         hbs.StreamConfig(16, 64, 128, 2, num_worker_warps=4, occupancy=4),
         hbs.StreamConfig(64, 128, 128, 4), hbs.StreamConfig(128, 128, 128, 1)]


@pytest.mark.parametrize("swizzled", [False, True], ids=["logical", "swizzled"])
@pytest.mark.parametrize("cfg", SMALL, ids=lambda c: c.name)
@pytest.mark.parametrize("fmt", BLOCK_FORMATS, ids=FMT_IDS)
def test_stream_kernel_emulated(emulated, fmt, cfg, swizzled):
    # M = 70: tiles of 16 / 64 rows cut it at 16 / 64 and sit in the 2nd and 3rd 32-row slices of
    # the 32x4x4 layout; N = 130 a partial weight tile; K = 320: 2.5 K tiles of 128 (split 2 and 4
    # leave one split empty or short).
    problem, ref = block_scaled_case(fmt, 70, 130, 320, swizzled=swizzled, bias=True, alpha=0.75, seed=1)
    hbs.launch(problem, cfg)
    assert_matches(problem.out, ref, torch.float32)


@pytest.mark.parametrize("swizzled", [False, True], ids=["logical", "swizzled"])
@pytest.mark.parametrize("fmt", BLOCK_FORMATS, ids=FMT_IDS)
def test_two_pass_emulated(emulated, fmt, swizzled):
    # K = 160: the dequantized copies are padded to 256 (a nibble-order half tile is partly empty).
    cfg = hbs.TwoPassConfig(hgemm.GemmConfig(128, 128, 64), 64, 256)
    problem, ref = block_scaled_case(fmt, 130, 70, 160, swizzled=swizzled, bias=True, seed=2)
    hbs.launch(problem, cfg)
    assert_matches(problem.out, ref, torch.float32)


@pytest.mark.parametrize("fmt", [MXFP4, NVFP4], ids=["mxfp4", "nvfp4"])
def test_batches_emulated(emulated, fmt):
    # x batched (3), y shared (1): the weight broadcasts in both designs.
    for cfg in (hbs.StreamConfig(16, 128, 128, 2),
                hbs.TwoPassConfig(hgemm.GemmConfig(128, 128, 64, persistent=True), 64, 128)):
        problem, ref = block_scaled_case(fmt, 20, 40, 256, ba=3, bb=1, swizzled=True, out_dtype=torch.bfloat16,
                                         seed=3)
        hbs.launch(problem, cfg)
        assert_matches(problem.out, ref, torch.bfloat16)


def test_plan_picks_stream_below_two_pass_min_m():
    assert isinstance(hbs.plan(MXFP4, 1, hbs.TWO_PASS_MIN_M - 1, 4096, 4096), hbs.StreamConfig)
    assert isinstance(hbs.plan(MXFP4, 1, hbs.TWO_PASS_MIN_M, 4096, 4096), hbs.TwoPassConfig)
    # few output tiles and a long K: split K; many tiles: no split
    assert hbs.plan(NVFP4, 1, 16, 4096, 4096, sms=132).split_k > 1
    assert hbs.plan(NVFP4, 1, 16, 65536, 4096, sms=132).split_k == 1


def test_plan_configs_are_aot_variants():
    names = {v.name for v in hbs.aot_variants()}
    for fmt in BLOCK_FORMATS:
        for m in (1, 16, 17, 64, 65, 128, 200, 511):
            for n, k in ((4096, 4096), (14336, 4096), (4096, 14336), (28672, 8192), (256, 96)):
                cfg = hbs.plan(fmt, 1, m, n, k, sms=132)
                assert f"hopper_{fmt.name}_swz_bf16_{cfg.name}" in names


# --------------------------------------------------------------------------------------------------
# FP8 through hopper_gemm
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("cfg", [hgemm.GemmConfig(128, 128, 128),
                                 hgemm.GemmConfig(128, 256, 64, persistent=True)], ids=lambda c: c.name)
def test_fp8_rowwise_emulated(emulated, cfg):
    gen = torch.Generator().manual_seed(4)
    m, n, k = 130, 300, 200
    a = (torch.randn(2, m, k, generator=gen) * 4).to(torch.float8_e4m3fn)
    b = (torch.randn(1, n, k, generator=gen) * 4).to(torch.float8_e4m3fn)
    sa = torch.rand(2, m, generator=gen) + 0.5
    sb = torch.rand(1, n, generator=gen) + 0.5
    bias = torch.randn(n, generator=gen)
    ref = fp8_matmul_reference(a, sa[..., None], b.transpose(-1, -2), sb[:, None, :], out_dtype=torch.float64,
                               alpha=None, bias=bias)
    problem = FP8Problem(fmt=None, a=a, a_scale=sa, b=b, b_scale=sb, granularity="rowwise",
                         out=torch.full((2, m, n), float("nan")), bias=bias, alpha=None)
    hfp8.launch(problem, cfg)
    assert_matches(problem.out, ref, torch.float32)
