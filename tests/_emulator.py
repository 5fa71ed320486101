"""A NumPy model of the cuTile operations tilemm's kernels use, so that their tile code runs on the CPU.

cuTile has no CPU interpreter. ``TileEmulator.launch`` calls a kernel's own Python function once per
block of a 1-D grid, with ``ct`` replaced by the emulator in its globals and in those of the
``tilemm.kernels`` helpers it calls. Tiles are NumPy arrays of float64 (int64 for integer dtypes)
that carry the cuTile dtype they stand for:

* fp32 / fp16 / bf16 elementwise results are rounded to that dtype after every operation, and a
  16-bit result that needed rounding fails an assertion (the Hopper decode must be exact);
* ``mma`` / ``mma_scaled`` compute in float64 and round once to the fp32 accumulator; ``mma`` asserts
  that 16-bit operands hold their values exactly, ``mma_scaled`` rejects a (data, scale, block)
  combination that its contract does not list;
* where cuTile is undefined the model is strict: a load whose padding is not ZERO fills out-of-range
  elements with NaN (a uint8 one raises), and a tile entirely outside its array raises.

It checks index arithmetic and numerics against the reference, not cuTile's compiler or the hardware.
"""

from __future__ import annotations

import math
import types

import numpy as np
import torch

import cuda.tile as ct

__all__ = ["Tile", "EmuArray", "TileEmulator", "LaunchProxy", "CT_DTYPE_OF_TORCH", "assert_matches"]

CT_DTYPE_OF_TORCH = {torch.float32: ct.float32, torch.bfloat16: ct.bfloat16, torch.float16: ct.float16,
                     torch.uint8: ct.uint8, torch.int32: ct.int32, torch.int64: ct.int64, torch.float8_e4m3fn: ct.float8_e4m3fn,
                     torch.float8_e5m2: ct.float8_e5m2}
_FLOAT_TORCH = {ct.float32: torch.float32, ct.bfloat16: torch.bfloat16, ct.float16: torch.float16}
_FP8_TORCH = {ct.float8_e4m3fn: torch.float8_e4m3fn, ct.float8_e5m2: torch.float8_e5m2}
_INT_DTYPES = (ct.uint8, ct.uint16, ct.int32, ct.uint32, ct.int64)
# Integer tiles hold int64 values; results wrap to the dtype's width, as the hardware's do.
_INT_BITS = {ct.uint8: 8, ct.uint16: 16, ct.int32: 32, ct.uint32: 32}
_SIXTEEN_BIT = (ct.bfloat16, ct.float16)
_E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
# mma_scaled's contract: (data dtype, scale dtype) -> allowed scaling block sizes.
_MMA_SCALED_BLOCKS = {(ct.float8_e4m3fn, ct.float8_e8m0fnu): (32,), (ct.float8_e5m2, ct.float8_e8m0fnu): (32,),
                      (ct.float4_e2m1fn, ct.float8_e8m0fnu): (16, 32), (ct.float4_e2m1fn, ct.float8_e4m3fn): (16,)}


class _DType:
    """A cuTile float dtype that, as inside a kernel, also builds scalars (``ct.float16(2.0 ** 14)``)."""

    def __init__(self, dtype):
        self.dtype = dtype

    def __call__(self, value):
        return float(_round(np.array(value, dtype=np.float64), self.dtype))

    def __eq__(self, other):
        return other is self.dtype or (isinstance(other, _DType) and other.dtype is self.dtype)

    def __hash__(self):
        return hash(self.dtype)

    def __repr__(self):
        return repr(self.dtype)


def _dt(dtype):
    """The cuTile dtype behind ``dtype`` (unwraps ``_DType``)."""
    return dtype.dtype if isinstance(dtype, _DType) else dtype


def _round(values: np.ndarray, dtype) -> np.ndarray:
    """float64 values rounded once to a cuTile float dtype (fp32 or 16-bit; others unchanged)."""
    torch_dtype = _FLOAT_TORCH.get(_dt(dtype))
    if torch_dtype is None:
        return values
    return torch.from_numpy(np.asarray(values, dtype=np.float64)).to(torch_dtype).to(torch.float64).numpy()


class Tile(np.ndarray):
    """Values (float64, or int64 for integer tiles) plus the cuTile dtype they stand for.
    Float results are rounded to that dtype, as the hardware would."""

    def __new__(cls, values, dtype):
        t = np.asarray(values).view(cls)
        t.ct_dtype = dtype
        return t

    def __array_finalize__(self, obj):
        self.ct_dtype = getattr(obj, "ct_dtype", None)

    def __array_wrap__(self, out, context=None, return_scalar=False):
        out = super().__array_wrap__(out, context, return_scalar)
        if isinstance(out, Tile) and out.ct_dtype in _INT_BITS and out.dtype.kind == "i":
            bits = _INT_BITS[out.ct_dtype]
            wrapped = np.asarray(out) & ((1 << bits) - 1)
            if out.ct_dtype == ct.int32:
                wrapped = np.where(wrapped >= 1 << 31, wrapped - (1 << 32), wrapped)
            return Tile(wrapped, out.ct_dtype)
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
        if dtype not in _FLOAT_TORCH:
            raise NotImplementedError(f"astype to {dtype}")
        # Float tiles already hold values of their dtype, so this is the one rounding to the target.
        return Tile(_round(np.asarray(self, dtype=np.float64), dtype), dtype)


class EmuArray:
    """A kernel array argument: its shape and cuTile dtype, values decoded for loads, and the torch
    tensor that stores write to (a load after a store in the same launch sees the store)."""

    def __init__(self, tensor: torch.Tensor, parent: "EmuArray | None" = None):
        self.tensor = tensor
        self.dtype = CT_DTYPE_OF_TORCH[tensor.dtype]
        self.shape = tuple(tensor.shape)
        self.ndim = tensor.ndim
        self._values = None
        self._parent = parent

    def slice(self, axis, start, stop):
        """``Array.slice``: a view of rows start .. stop along ``axis`` (cuTile requires 0 <= start < N
        and start <= stop <= N); stores through it reach this array."""
        start, stop = int(start), int(stop)
        n = self.shape[axis]
        if not (0 <= start < n and start <= stop <= n):
            raise IndexError(f"slice({axis}, {start}, {stop}) of an array of shape {self.shape}")
        return EmuArray(self.tensor.narrow(axis, start, stop - start), parent=self)

    @property
    def values(self):
        if self._values is None:
            if self.tensor.dtype in (torch.uint8, torch.int32, torch.int64):
                self._values = self.tensor.to(torch.int64).numpy()
            else:
                self._values = self.tensor.to(torch.float64).numpy()
        return self._values

    def stored(self):
        self._values = None
        if self._parent is not None:
            self._parent.stored()


def _window(arr_shape, index, shape):
    """(array slices, tile slices) of tile ``index`` of ``shape``, clipped to the array."""
    starts = [i * s for i, s in zip(index, shape)]
    src = tuple(slice(st, min(st + s, n)) for st, s, n in zip(starts, shape, arr_shape))
    dst = tuple(slice(0, sl.stop - sl.start) for sl in src)
    if any(sl.stop <= sl.start for sl in src):
        raise IndexError(f"tile {shape} at index {index} lies entirely outside an array of shape {arr_shape} "
                         f"(undefined in cuTile)")
    return src, dst


def _e8m0_values(raw):
    return np.where(raw == 255, np.nan, np.exp2(raw.astype(np.float64) - 127))


def _e4m3_values(raw):
    return torch.from_numpy(raw.astype(np.uint8)).view(torch.float8_e4m3fn).to(torch.float64).numpy()


def _fp16_values(raw):
    return (raw & 0xFFFF).astype(np.uint16).view(np.float16).astype(np.float64)


def _bf16_values(raw):
    return ((raw & 0xFFFF).astype(np.uint32) << 16).view(np.float32).astype(np.float64)


# bitcast: (source dtype, target dtype) -> decoder of the source's bits (int64) to float64 values.
_BITCASTS = {(ct.uint8, ct.float8_e8m0fnu): _e8m0_values, (ct.uint8, ct.float8_e4m3fn): _e4m3_values,
             (ct.uint16, ct.float16): _fp16_values, (ct.uint16, ct.bfloat16): _bf16_values}


class TileEmulator:
    """``ct`` for the kernels, on NumPy. ``launch(stream, grid, kernel, args)`` calls the kernel's
    Python function once per block of a 1-D grid, as ``ct.launch`` would run it on a GPU."""

    PaddingMode = ct.PaddingMode
    Constant = ct.Constant

    def __init__(self):
        self._bid = 0
        self._grid = 1
        for name in ("uint8", "uint16", "int32", "uint32", "int64", "float8_e4m3fn", "float8_e5m2", "float8_e8m0fnu",
                     "float4_e2m1fn"):
            setattr(self, name, getattr(ct, name))
        for name in ("float32", "float16", "bfloat16"):
            setattr(self, name, _DType(getattr(ct, name)))

    # --- grid and scalars
    def bid(self, axis):
        return self._bid if axis == 0 else 0

    def num_blocks(self, axis):
        return self._grid if axis == 0 else 1

    @staticmethod
    def cdiv(a, b):
        return -(-a // b)

    # --- building tiles
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
        # The dtype of a Tile operand; two Python numbers make an int32 (ints) or fp32 tile.
        dtype = next((t.ct_dtype for t in (x, y) if isinstance(t, Tile)), None)
        if dtype is None:
            dtype = ct.int32 if isinstance(x, int) and isinstance(y, int) else ct.float32
        return Tile(np.where(np.asarray(cond, dtype=bool), x, y), dtype)

    # --- elementwise and reductions (the quantizers'): NaN handling as cuTile documents it
    @staticmethod
    def _dtype_of(*operands):
        return next(t.ct_dtype for t in operands if isinstance(t, Tile))

    @staticmethod
    def abs(t):
        return Tile(np.abs(np.asarray(t)), t.ct_dtype)

    @staticmethod
    def isnan(t):
        return np.isnan(np.asarray(t, dtype=np.float64))

    def minimum(self, a, b, propagate_nan=False):
        """Elementwise minimum; a NaN operand gives the other one unless ``propagate_nan`` (cuTile's
        default is False). Rounded to the tile's dtype (a Python number operand may not be in it)."""
        op = np.minimum if propagate_nan else np.fmin
        dtype = self._dtype_of(a, b)
        return Tile(_round(op(np.asarray(a), np.asarray(b)), dtype), dtype)

    def maximum(self, a, b, propagate_nan=False):
        """Elementwise maximum, NaN as in :meth:`minimum`."""
        op = np.maximum if propagate_nan else np.fmax
        dtype = self._dtype_of(a, b)
        return Tile(_round(op(np.asarray(a), np.asarray(b)), dtype), dtype)

    @staticmethod
    def max(t, axis=None, keepdims=False, propagate_nan=False):
        op = np.max if propagate_nan or t.ct_dtype in _INT_DTYPES else np.nanmax
        return Tile(np.asarray(op(np.asarray(t), axis=axis, keepdims=keepdims)), t.ct_dtype)

    @staticmethod
    def min(t, axis=None, keepdims=False, propagate_nan=False):
        op = np.min if propagate_nan or t.ct_dtype in _INT_DTYPES else np.nanmin
        return Tile(np.asarray(op(np.asarray(t), axis=axis, keepdims=keepdims)), t.ct_dtype)

    def truediv(self, a, b, rounding_mode=None):
        """IEEE fp32 division: the float64 quotient of two fp32 values rounded once to fp32 is the
        correctly rounded fp32 quotient (53 >= 2 * 24 + 2)."""
        assert rounding_mode == ct.RoundingMode.RN
        with np.errstate(divide="ignore", invalid="ignore"):
            q = np.asarray(a, dtype=np.float64) / np.asarray(b, dtype=np.float64)
        return Tile(_round(q, ct.float32), self._dtype_of(a, b))

    @staticmethod
    def astype(t, dtype):
        """``ct.astype``; to float8 it is cvt.rn.satfinite: RNE, +-Inf and finite values past Qmax
        become +-Qmax, NaN stays NaN."""
        dtype = _dt(dtype)
        if dtype in _FP8_TORCH:
            qmax = float(torch.finfo(_FP8_TORCH[dtype]).max)
            v = np.clip(np.asarray(t, dtype=np.float64), -qmax, qmax)  # NaN passes through np.clip
            q = torch.from_numpy(v).to(torch.float32).to(_FP8_TORCH[dtype]).to(torch.float64).numpy()
            return Tile(q, dtype)
        return t.astype(dtype)

    @staticmethod
    def atomic_max(array, index, value, **kwargs):
        old = int(array.tensor[index])
        array.tensor[index] = max(old, int(np.asarray(value)))
        array.stored()
        return old

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
        dtype = _dt(dtype)
        if tile.ct_dtype == ct.int32 and dtype == ct.uint32:
            return Tile(np.asarray(tile, dtype=np.int64) & 0xFFFFFFFF, dtype)
        if tile.ct_dtype == ct.float32 and dtype == ct.int32:
            bits = np.asarray(tile, dtype=np.float64).astype(np.float32).view(np.int32)
            return Tile(bits.astype(np.int64), dtype)
        if tile.ct_dtype in _FP8_TORCH and dtype == ct.uint8:
            values = torch.from_numpy(np.asarray(tile, dtype=np.float64).copy()).to(_FP8_TORCH[tile.ct_dtype])
            return Tile(values.view(torch.uint8).to(torch.int64).numpy(), dtype)
        if tile.ct_dtype in (ct.int32, ct.uint32) and dtype == ct.float32:  # bits past 32 are dropped
            bits = (np.asarray(tile, dtype=np.int64) & 0xFFFFFFFF).astype(np.uint32)
            return Tile(bits.view(np.float32).astype(np.float64), dtype)
        if tile.ct_dtype == ct.float8_e4m3fn and dtype == ct.uint8:  # values of e4m3 bytes -> the bytes
            v = torch.from_numpy(np.asarray(tile, dtype=np.float64).copy()).to(torch.float8_e4m3fn)
            return Tile(v.view(torch.uint8).to(torch.int64).numpy(), dtype)
        decode = _BITCASTS.get((tile.ct_dtype, dtype))
        if decode is None:
            raise NotImplementedError(f"bitcast {tile.ct_dtype} -> {dtype}")
        return Tile(decode(np.asarray(tile, dtype=np.int64)), dtype)

    @staticmethod
    def pack_to_bytes(tile):
        """The tile's bytes, little-endian, flattened (uint32, uint16 and bf16 tiles)."""
        if tile.ct_dtype == ct.bfloat16:
            values = torch.from_numpy(np.asarray(tile, dtype=np.float64).reshape(-1).copy())
            raw = (values.to(torch.bfloat16).view(torch.int16).to(torch.int64) & 0xFFFF).numpy()
            width = 2
        else:
            width = {ct.uint32: 4, ct.uint16: 2, ct.uint8: 1}[tile.ct_dtype]
            raw = np.asarray(tile, dtype=np.int64).reshape(-1)
        out = np.stack([(raw >> (8 * i)) & 0xFF for i in range(width)], axis=-1).reshape(-1)
        return Tile(out, ct.uint8)

    @staticmethod
    def extract(tile, index, shape):
        sl = tuple(slice(i * s, (i + 1) * s) for i, s in zip(index, shape))
        return Tile(np.asarray(tile)[sl].copy(), tile.ct_dtype)

    @staticmethod
    def atomic_add(array, index, value, **kwargs):
        old = int(array.tensor[index])
        array.tensor[index] = old + value
        array.stored()
        return old

    @staticmethod
    def atomic_xchg(array, index, value, **kwargs):
        old = int(array.tensor[index])
        array.tensor[index] = value
        array.stored()
        return old

    @staticmethod
    def permute(tile, axes):
        return Tile(np.transpose(np.asarray(tile), axes), tile.ct_dtype)

    @staticmethod
    def exp(tile):
        """exp, rounded once to the tile's dtype (the hardware's is within a few ulp of that)."""
        return Tile(_round(np.exp(np.asarray(tile, dtype=np.float64)), tile.ct_dtype), tile.ct_dtype)

    @staticmethod
    def sum(tile, axis):
        """Sum along ``axis``, rounded once to the tile's dtype (the order of a reduction is not
        specified, so the model takes the exact sum)."""
        return Tile(_round(np.sum(np.asarray(tile, dtype=np.float64), axis=axis), tile.ct_dtype), tile.ct_dtype)

    @staticmethod
    def static_iter(iterable):
        return iterable

    @staticmethod
    def unpack_from_bytes(tile, dtype):
        if tile.ndim == 1 and tile.ct_dtype == ct.uint8 and _dt(dtype) == ct.uint32:
            raw = np.asarray(tile, dtype=np.int64)
            return Tile(raw[0::4] | (raw[1::4] << 8) | (raw[2::4] << 16) | (raw[3::4] << 24), ct.uint32)
        if tile.ndim == 1 and tile.ct_dtype == ct.uint8 and _dt(dtype) == ct.bfloat16:
            raw = np.asarray(tile, dtype=np.int64)
            return Tile(_bf16_values(raw[0::2] | (raw[1::2] << 8)), ct.bfloat16)
        if tile.ndim != 1 or tile.ct_dtype != ct.uint8 or _dt(dtype) != ct.float4_e2m1fn:
            raise TypeError("unpack_from_bytes: 1-D uint8 -> float4_e2m1fn or bfloat16 only")
        raw = np.asarray(tile, dtype=np.int64)
        vals = np.stack([_E2M1[raw & 0xF], _E2M1[raw >> 4]], axis=-1).reshape(-1)  # low nibble first
        return Tile(vals, ct.float4_e2m1fn)

    # --- memory
    @staticmethod
    def load(array, index, shape, *, padding_mode=ct.PaddingMode.UNDETERMINED, **hints):
        if hints.get("order") is not None:
            raise NotImplementedError("load with order= (a transposed read) is not modelled")
        if shape == ():  # one element, as a 0-d tile (cuTile's scalar load)
            index = tuple(int(i) for i in index)
            if not all(0 <= i < n for i, n in zip(index, array.shape)):
                raise IndexError(f"scalar load at {index} outside {tuple(array.shape)}")
            return Tile(np.asarray(array.values[index]), array.dtype)
        src, dst = _window(array.shape, index, shape)
        fill = 0 if padding_mode == ct.PaddingMode.ZERO else math.nan  # undefined in cuTile: poison it
        out = np.full(shape, fill, dtype=np.float64)
        out[dst] = array.values[src]
        if array.dtype in (ct.uint8, ct.int32, ct.int64):
            if math.isnan(fill) and out.size != out[dst].size:
                raise ValueError("integer load past the edge without ZERO padding")
            out = out.astype(np.int64)
        return Tile(out, array.dtype)

    @staticmethod
    def gather(array, indices, *, mask=None, padding_value=0, check_bounds=True, **hints):
        """array[indices] with broadcast index tiles; out-of-bounds (or masked-off) elements take
        ``padding_value``."""
        if not isinstance(indices, tuple):
            indices = (indices,)
        idx = np.broadcast_arrays(*[np.asarray(i, dtype=np.int64) for i in indices])
        ok = np.ones(idx[0].shape, dtype=bool)
        for i, n in zip(idx, array.shape):
            ok &= (i >= 0) & (i < n)
        if mask is not None:
            ok &= np.broadcast_to(np.asarray(mask, dtype=bool), ok.shape)
        safe = tuple(np.where(ok, i, 0) for i in idx)
        out = np.where(ok, array.values[safe], padding_value).astype(np.float64)
        if array.dtype in _INT_DTYPES:
            out = out.astype(np.int64)
        return Tile(out, array.dtype)

    @staticmethod
    def scatter(array, indices, value, *, mask=None, check_bounds=True, **hints):
        """array[indices] = value for the in-bounds (and unmasked) elements."""
        if not isinstance(indices, tuple):
            indices = (indices,)
        if getattr(value, "ct_dtype", array.dtype) != array.dtype:
            raise TypeError(f"scattering a {value.ct_dtype} tile into a {array.dtype} array")
        idx = np.broadcast_arrays(*[np.asarray(i, dtype=np.int64) for i in indices],
                                  np.asarray(value, dtype=np.float64))
        vals, idx = idx[-1], idx[:-1]
        ok = np.ones(vals.shape, dtype=bool)
        for i, n in zip(idx, array.shape):
            ok &= (i >= 0) & (i < n)
        if mask is not None:
            ok &= np.broadcast_to(np.asarray(mask, dtype=bool), ok.shape)
        where = tuple(torch.from_numpy(np.ascontiguousarray(i[ok])) for i in idx)
        array.tensor[where] = torch.from_numpy(np.ascontiguousarray(vals[ok])).to(array.tensor.dtype)
        array.stored()

    @staticmethod
    def store(array, index, tile, *, order=None, allow_tma=True):
        """``allow_tma`` is a hint (how, not what, is stored); ``order``: tile dimension i (and index
        entry i) runs along array dimension order[i], e.g. (0, 2, 1) stores a tile transposed."""
        if order is not None:
            inverse = tuple(int(i) for i in np.argsort(order))
            tile = Tile(np.transpose(np.asarray(tile), inverse), tile.ct_dtype)
            index = tuple(index[i] for i in inverse)
        src, dst = _window(array.shape, index, tile.shape)
        if tile.ct_dtype != array.dtype:
            raise TypeError(f"storing a {tile.ct_dtype} tile into a {array.dtype} array")
        values = np.ascontiguousarray(tile[dst], dtype=np.float64)
        array.tensor[src] = torch.from_numpy(values).to(array.tensor.dtype)
        array.stored()

    # --- matrix multiply-accumulate
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

    @staticmethod
    def mma_scaled(x, x_scale, y, y_scale, acc):
        m, k = x.shape
        k2, n = y.shape
        ks = x_scale.shape[1]
        assert k == k2 and x_scale.shape == (m, ks) and y_scale.shape == (ks, n) and acc.shape == (m, n)
        assert x.ct_dtype == y.ct_dtype and x_scale.ct_dtype == y_scale.ct_dtype and acc.ct_dtype == ct.float32
        block = k // ks
        allowed = _MMA_SCALED_BLOCKS.get((x.ct_dtype, x_scale.ct_dtype), ())
        if k % ks or block not in allowed:
            raise TypeError(f"mma_scaled: {x.ct_dtype} x {x_scale.ct_dtype} with block {block} is not in "
                            f"the contract (allowed {allowed})")
        xs = np.repeat(np.asarray(x_scale), block, axis=1)
        ys = np.repeat(np.asarray(y_scale), block, axis=0)
        with np.errstate(invalid="ignore"):
            r = (np.asarray(x) * xs) @ (np.asarray(y) * ys) + np.asarray(acc)
        return Tile(r.astype(np.float32).astype(np.float64), ct.float32)

    # --- running a kernel
    def _rebind(self, fn, memo):
        """``fn`` with ``ct`` replaced by this emulator in its globals and in those of the tilemm.kernels
        functions it calls (the helpers are inlined into the kernel by cuTile)."""
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


class LaunchProxy:
    """cuda.tile with ``launch`` routed to an emulator (a launcher module's other ``ct`` uses unchanged)."""

    def __init__(self, emu: TileEmulator):
        self._emu = emu

    def launch(self, stream, grid, kernel, args):
        self._emu.launch(stream, grid, kernel, args)

    def __getattr__(self, name):
        return getattr(ct, name)


def assert_matches(out, ref, out_dtype):
    """docs/numerics.md's matmul tolerance: relative Frobenius error 1e-5, plus the output rounding."""
    tol = {torch.float32: 1e-5, torch.bfloat16: 4e-3 + 1e-5, torch.float16: 1e-3 + 1e-5}[out_dtype]
    out64, ref64 = out.to(torch.float64), ref.to(torch.float64)
    assert torch.isfinite(out64).all(), "non-finite outputs (an unwritten tile or poison that leaked)"
    err = ((out64 - ref64).norm() / ref64.norm().clamp_min(1e-300)).item()
    assert err < tol, f"relative error {err:.3g} >= {tol}"
