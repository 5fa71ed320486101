"""Tile helpers shared by tilemm's cuTile kernels (any architecture), and small host-side utilities.

Tile-code helpers (called from inside ``@ct.kernel`` functions, inlined by cuTile):

* ``tile_coords`` / ``tile_coords_at``: the batch index and the (M-tile, N-tile) of a block of a 1-D
  grid (or of tile number t of a persistent block), visiting tiles in GROUP_SIZE_M-row groups so that
  neighbouring blocks share operand tiles in L2.
* The one e8m0 and e2m1 decode every kernel uses. ``e8m0_to_bf16`` / ``e8m0_to_fp32`` (the bits:
  ``e8m0_bits_bf16``): e8m0 scale bytes -> their exact values (2^(s-127); 0 -> 2^-127; 255 -> NaN).
  ``e2m1_lo_bits_*`` / ``e2m1_hi_bits_*``: the low / high nibble of packed e2m1 bytes as 16-bit float
  bit patterns (fp16 or bf16), with a known power-of-two offset; ``e2m1_to_fp32``: codes -> fp32 values.
* ``unswizzle_scale_tile``: a tile of the 32x4x4 ("swizzled") scale layout back to (rows, columns).
* ``epilogue``: ``acc * alpha + bias``, cast once to the output dtype, stored (partial tiles masked).

Host helpers: ``folded_alpha`` (a problem's alpha with NVFP4's decode scales), ``ones_scalar`` /
``zeros_vector`` (cached device constants that stand in for an absent ``alpha`` / ``bias``, so that
one kernel specialisation serves calls with and without them), ``swizzled_scale_view`` (the 6-D
view of a swizzled scale tensor that the kernels load from), and ``hinted`` (cached ``replace_hints``).
"""

from __future__ import annotations

import cuda.tile as ct
import torch

import swizzle as _swizzle

from ..formats import Granularity
from ..numerics import ceil_div

__all__ = ["launch_all_on", "tile_coords", "tile_coords_at", "e8m0_bits_bf16", "e8m0_to_bf16", "e8m0_to_fp32",
           "e2m1_lo_bits_fp16", "e2m1_hi_bits_fp16", "e2m1_lo_bits_bf16", "e2m1_hi_bits_bf16", "e2m1_to_fp32", "unswizzle_scale_tile",
           "epilogue", "ones_scalar", "zeros_vector", "swizzled_scale_view", "hinted", "num_sms", "stream_handle",
           "ceil_div", "folded_alpha", "SWIZZLE_ROWS", "SWIZZLE_COLS"]

#: Rows and scale columns covered by one 32x16 block of the 32x4x4 layout.
SWIZZLE_ROWS = _swizzle.ROW_TILE
SWIZZLE_COLS = _swizzle.COL_TILE

# --------------------------------------------------------------------------------------------------
# Tile code
# --------------------------------------------------------------------------------------------------


def tile_coords(M, N, TM, TN, GROUP_SIZE_M):
    """(batch, m_tile, n_tile) of this block in a 1-D grid of B * cdiv(M, TM) * cdiv(N, TN) blocks.

    Within one batch entry, blocks walk GROUP_SIZE_M tile rows column by column, so consecutive blocks
    reuse the same B tiles (and a group's A tiles) from L2.
    """
    return tile_coords_at(ct.bid(0), M, N, TM, TN, GROUP_SIZE_M)


def tile_coords_at(t, M, N, TM, TN, GROUP_SIZE_M):
    """``tile_coords`` for output tile number ``t`` (a persistent block's loop variable)."""
    num_m = ct.cdiv(M, TM)
    num_n = ct.cdiv(N, TN)
    per_batch = num_m * num_n
    batch = t // per_batch
    t = t % per_batch
    per_group = GROUP_SIZE_M * num_n
    first_m = (t // per_group) * GROUP_SIZE_M
    group_m = min(num_m - first_m, GROUP_SIZE_M)
    bm = first_m + (t % per_group) % group_m
    bn = (t % per_group) // group_m
    return batch, bm, bn


def e8m0_bits_bf16(s, dtype):
    """e8m0 scale bytes s (0..255 in an integer tile) -> the bf16 bit patterns of exactly 2^(s-127),
    as a tile of integer ``dtype`` (``ct.uint16`` to bit-cast to bf16, ``ct.int32`` for fp32's upper half).

    bf16 has fp32's 8-bit exponent, so byte s goes straight into the exponent field (s << 7) for
    s = 1..254. s = 0 is 2^-127, the bf16 subnormal 0x0040; s = 255 becomes 0x7FC0, a quiet NaN (s << 7
    alone would be +inf, and inf would survive as inf instead of NaN). Both specials set bit 6.
    """
    s = s.astype(dtype)
    special = ((s + 1) & 0xFF) < 2  # s == 255 or s == 0
    return (s << 7) | ct.where(special, ct.full(s.shape, 0x40, dtype), ct.full(s.shape, 0, dtype))


def e8m0_to_bf16(s):
    """e8m0 scale bytes (an integer tile, e.g. uint8) -> bf16 tile of exactly 2^(s-127) (``e8m0_bits_bf16``)."""
    return ct.bitcast(e8m0_bits_bf16(s, ct.uint16), ct.bfloat16)


def e8m0_to_fp32(s):
    """e8m0 scale bytes (an integer tile) -> fp32 tile of exactly 2^(s-127): ``e8m0_bits_bf16``'s
    pattern in the upper half of the word (fp32 is bf16 with 16 more mantissa bits), so byte 0 is the
    subnormal 2^-127 (0x00400000) and byte 255 the quiet NaN 0x7FC00000."""
    return ct.bitcast(e8m0_bits_bf16(s, ct.int32) << 16, ct.float32)


# e2m1 nibble n (bit 3 sign, bits 2-0 = 2 exponent bits + 1 mantissa bit) placed so that its exponent
# bits land in the lowest exponent bits of a 16-bit float: the result is a (sub)normal float equal to
# e2m1(n) * 2^-14 (fp16, exponent bias 15) or e2m1(n) * 2^-126 (bf16, bias 127). Code 1 (0.5) lands on
# the subnormal encoding, which is what makes the mapping exact for every code.

def e2m1_lo_bits_fp16(p):
    """Low nibbles of a uint16 tile of packed bytes as fp16 bit patterns of e2m1 * 2^-14."""
    return ((p & 0x8) << 12) | ((p & 0x7) << 9)


def e2m1_hi_bits_fp16(p):
    """High nibbles of a uint16 tile of packed bytes as fp16 bit patterns of e2m1 * 2^-14."""
    return ((p & 0x80) << 8) | ((p & 0x70) << 5)


def e2m1_lo_bits_bf16(p):
    """Low nibbles of a uint16 tile of packed bytes as bf16 bit patterns of e2m1 * 2^-126."""
    return ((p & 0x8) << 12) | ((p & 0x7) << 6)


def e2m1_hi_bits_bf16(p):
    """High nibbles of a uint16 tile of packed bytes as bf16 bit patterns of e2m1 * 2^-126."""
    return ((p & 0x80) << 8) | ((p & 0x70) << 2)


def e2m1_to_fp32(codes):
    """e2m1 codes (an int32 tile of 0..15, sign in bit 3) -> their fp32 values, exactly:
    ``e2m1_lo_bits_bf16``'s e2m1 * 2^-126 in the upper half of the word, times 2^126."""
    return ct.bitcast(e2m1_lo_bits_bf16(codes) << 16, ct.float32) * (2.0 ** 126)


def unswizzle_scale_tile(t, ROWS, COLS):
    """A tile (ROWS/128, KG, 128, C) loaded from ``swizzled_scale_view`` -> (ROWS, COLS = KG * C).

    The 128 axis is (r % 32) * 4 + (r % 128) // 32 for row r of a 128-row tile (docs/numerics.md,
    the 32x4x4 layout), so splitting it into (32, 4) and moving the 4 in front of the 32 restores row order.
    """
    m0 = ROWS // SWIZZLE_ROWS
    kg = t.shape[1]
    c = t.shape[3]
    t = t.reshape((m0, kg, 32, 4, c))
    t = t.permute((0, 3, 2, 1, 4))  # (m0, 4, 32, kg, c): row = m0 * 128 + m2 * 32 + m1
    return t.reshape((ROWS, COLS))


def epilogue(acc, C, Alpha, Bias, batch, bm, bn, TM, TN):
    """Store ``acc * alpha + bias`` cast once to C's dtype; rows/columns beyond C's edges are dropped."""
    alpha = ct.load(Alpha, (0,), (1,)).reshape((1, 1))
    bias = ct.load(Bias, (bn,), (TN,), padding_mode=ct.PaddingMode.ZERO).reshape((1, TN))
    out = acc * alpha + bias
    ct.store(C, (batch, bm, bn), out.astype(C.dtype).reshape((1, TM, TN)))


# --------------------------------------------------------------------------------------------------
# Host side
# --------------------------------------------------------------------------------------------------

_ONES: dict[torch.device, torch.Tensor] = {}
_ZEROS: dict[torch.device, torch.Tensor] = {}


def ones_scalar(device: torch.device) -> torch.Tensor:
    """A cached (1,) fp32 tensor holding 1.0 on ``device``: ``alpha`` when none is given."""
    t = _ONES.get(device)
    if t is None:
        t = _ONES[device] = torch.ones(1, dtype=torch.float32, device=device)
    return t


def zeros_vector(device: torch.device, n: int) -> torch.Tensor:
    """A cached fp32 zero vector of length ``n`` on ``device``: ``bias`` when none is given.

    Adding +0.0 changes nothing but the sign of a -0.0 result."""
    t = _ZEROS.get(device)
    if t is None or t.numel() < n:
        t = _ZEROS[device] = torch.zeros(max(n, 1024), dtype=torch.float32, device=device)
    return t[:n]


def fp8_kind(granularity: Granularity, where: str) -> str:
    """The FP8 kernel for a ``tilemm.matmul.FP8Problem`` granularity (``Granularity.matmul_kernel``):
    "scaled" (per tensor or per row: one kernel, scales in the epilogue) or "blockwise" (128-element
    blocks); ``where`` names the caller in errors."""
    if not isinstance(granularity, Granularity):
        raise TypeError(f"{where}: granularity must be a tilemm.formats.Granularity, got {granularity!r}")
    return granularity.matmul_kernel


def swizzled_scale_view(scale: torch.Tensor, cols_per_tile: int) -> torch.Tensor:
    """View a swizzled scale (B, Rt, Kt, 32, 16) as (B, Rt, Kt, 128, G, C) with C = min(cols_per_tile,
    4) and G = 4 / C, so that a K tile covering ``cols_per_tile`` scale columns is one rectangular
    load: (1, TR/128, max(cols_per_tile/4, 1), 128, 1, C) at (b, rt, kt // G, 0, kt % G, 0).

    The trailing 16 of a 32x16 block is (m2 = 4 row sub-tiles) x (k1 = 4 columns); k1 splits as (G, C).
    """
    c = min(cols_per_tile, SWIZZLE_COLS)
    b, rt, kt = scale.shape[:3]
    return scale.reshape(b, rt, kt, SWIZZLE_ROWS, SWIZZLE_COLS // c, c)


#: The current stream's raw handle for a device index (``torch.cuda.current_stream()`` builds a Stream
#: object per call; ``ct.launch`` takes the raw integer).
_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def stream_handle(device: torch.device):
    """The current CUDA stream of ``device`` as the raw handle ``ct.launch`` takes (a PyTorch built
    without CUDA, where only the tests' CPU emulation launches, gets ``torch.cuda.current_stream``)."""
    if _RAW_STREAM is None:
        return torch.cuda.current_stream(device)
    return _RAW_STREAM(device.index if device.index is not None else torch.cuda.current_device())


_SMS: dict[int, int] = {}


def num_sms(device: torch.device | int) -> int:
    """Streaming multiprocessors of a CUDA device (cached per device index)."""
    index = device if isinstance(device, int) else (
        device.index if device.index is not None else torch.cuda.current_device())
    count = _SMS.get(index)
    if count is None:
        count = _SMS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return count


_HINTED: dict = {}


def sm90_hints(num_worker_warps: int, occupancy: int | None = None, num_ctas: int | None = None) -> dict:
    """The compiler hints of a Hopper config: worker warps on sm_90 (other targets keep their
    defaults), and occupancy / CTAs per cluster where the config sets them."""
    h = {"num_worker_warps": ct.ByTarget(sm_90=num_worker_warps)}
    if occupancy is not None:
        h["occupancy"] = occupancy
    if num_ctas is not None:
        h["num_ctas"] = num_ctas
    return h


def hinted(kernel, **hints):
    """``kernel.replace_hints(**hints)``, once per distinct set of hints (each result has its own JIT
    cache, so calling replace_hints per launch would recompile). Hint values may be ``ct.ByTarget``."""
    if not hints:
        return kernel
    key = (id(kernel), tuple(sorted((k, repr(v)) for k, v in hints.items())))
    cached = _HINTED.get(key)
    if cached is None:
        cached = _HINTED[key] = (kernel, kernel.replace_hints(**hints))
    return cached[1]


def launch_all_on(device: torch.device, launch, stream, kernel, launches) -> None:
    """``launch(stream, grid, kernel, args)`` for each (grid, args) of ``launches``, with ``device``
    the current CUDA device meanwhile (``ct.launch`` launches on the current one). ``launch`` is the
    caller's ``ct.launch``."""
    if device.index is not None and device.index != torch.cuda.current_device():
        with torch.cuda.device(device):
            for grid, args in launches:
                launch(stream, grid, kernel, args)
        return
    for grid, args in launches:
        launch(stream, grid, kernel, args)


def folded_alpha(problem):
    """A ``BlockScaledProblem``'s alpha with NVFP4's decode scales multiplied in, as one fp32 tensor:
    ``fp32(global_scale_x * global_scale_y)``, then ``* alpha`` when one is given (the order
    ``nvfp4_matmul`` documents), or
    ``problem.alpha`` (None for none) when the problem carries no decode scales. For the launchers
    that apply one alpha; Hopper's stream kernel multiplies the scales in its epilogue instead."""
    if problem.global_scales is None:
        return problem.alpha
    global_scale_x, global_scale_y = problem.global_scales
    scales = global_scale_x * global_scale_y
    return scales if problem.alpha is None else scales * problem.alpha


class Described:
    """A tensor's memory as cuTile reads it (``__cuda_array_interface__``), worked out once.

    ``ct.launch`` describes every torch tensor argument anew on each call (about a microsecond each);
    a launch prepared for many calls passes its fixed tensors through this instead. It holds the
    tensor, so the memory it describes lives as long as it does."""

    __slots__ = ("__cuda_array_interface__", "_tensor")

    def __init__(self, t: torch.Tensor):
        self.__cuda_array_interface__ = t.__cuda_array_interface__
        self._tensor = t
