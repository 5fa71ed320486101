"""Dense K-major GEMM on Hopper (sm_90) in cuTile: the engine under ``hopper_fp8`` and the large-M
path of ``hopper_block_scaled``.

What it computes, for each batch entry b:
``C[b] = (A[b % Ba] @ B[b % Bb].T) * row_scale[:, None] * col_scale[None, :] * alpha + bias``,
accumulated in fp32 and rounded once to C's dtype. A (Ba, M, K) and B (Bb, N, K) are both
K-contiguous (B is the (N, K) weight form, its (TN, TK) tiles transposed in registers) and hold FP8
(e4m3 / e5m2), bf16 or fp16; row / column scales are fp32 (only with ``SCALED``).

Kernel (``_gemm_kernel``): one (TM, TN) output tile at a time, a K loop of ``ct.mma`` into an fp32
accumulator, the epilogue of ``_common.epilogue``. Tiles are numbered batch-major and visited in
GROUP_SIZE_M-row groups (``tile_coords_at``) so that neighbouring blocks share A and B tiles in L2.
Either one block per tile, or (``PERSISTENT``) a grid of about one block per SM slot, each block
striding over tiles ``t = bid, bid + nblocks, ...``. ``num_worker_warps = 8`` (two MMA warpgroups)
is what lets 128x256 fp32 accumulators fit in registers on sm_90. Load latency hints (``latency=``
on ``ct.load``) set the depth of the TMA pipeline per operand.

Why these hints (cuobjdump): with two MMA warpgroups a 128x256 fp32 accumulator fits (REG 168,
STACK 0) beside 4 TMA stages of 128x256x128 FP8 or 256x256x64 bf16 tiles (~210 KB of shared memory).

FP8 accumulation: ``FAST_ACC`` maps to ``ct.mma(..., use_fast_acc=True)``, which skips the second
fp32 accumulator that cuTile keeps by default on Hopper (as ``torch._scaled_mm(use_fast_accum=...)``).
For 16-bit inputs it must be False (products and sums are then exact fp32 operations).
"""

from __future__ import annotations

import dataclasses

import cuda.tile as ct
import torch

from ._common import ceil_div, epilogue, hinted, num_sms, sm90_hints, stream_handle, tile_coords_at
from . import _large

__all__ = ["GemmConfig", "launch_gemm", "gemm_constants", "gemm_kernel", "gemm_grid", "num_sms"]

ConstInt = ct.Constant[int]
ConstBool = ct.Constant[bool]

_ZERO = ct.PaddingMode.ZERO


# --------------------------------------------------------------------------------------------------
# Tile code
# --------------------------------------------------------------------------------------------------

def load_k_tile(X, batch, row_tile, kt, ROWS, TK, LATENCY):
    """(ROWS, TK) tile of X (B, R, K) at (batch, row_tile, kt); zero past the edges."""
    if LATENCY > 0:
        t = ct.load(X, (batch, row_tile, kt), (1, ROWS, TK), padding_mode=_ZERO, latency=LATENCY)
    else:
        t = ct.load(X, (batch, row_tile, kt), (1, ROWS, TK), padding_mode=_ZERO)
    return t.reshape((ROWS, TK))


def _gemm_tile(A, A_scale, B, B_scale, C, Alpha, Bias, t, TM, TN, TK, GROUP_SIZE_M, LATENCY_A, LATENCY_B,
               FAST_ACC, SCALED, A_TENSOR, B_TENSOR):
    """Output tile number ``t``: K loop, then scales, alpha, bias, one cast, one store."""
    batch, bm, bn = tile_coords_at(t, C.shape[1], C.shape[2], TM, TN, GROUP_SIZE_M)
    ba = batch % A.shape[0]
    bb = batch % B.shape[0]
    acc = ct.zeros((TM, TN), ct.float32)
    for kt in range(ct.cdiv(A.shape[2], TK)):
        a = load_k_tile(A, ba, bm, kt, TM, TK, LATENCY_A)
        b = load_k_tile(B, bb, bn, kt, TN, TK, LATENCY_B)
        acc = ct.mma(a, b.transpose(), acc, use_fast_acc=FAST_ACC)
    if SCALED:
        if A_TENSOR:  # one value for every row: the same products as a vector of copies
            sa = ct.load(A_scale, (0,), (1,)).reshape((1, 1))
        else:
            sa = ct.load(A_scale, (ba, bm), (1, TM), padding_mode=_ZERO).reshape((TM, 1))
        if B_TENSOR:
            sb = ct.load(B_scale, (0,), (1,)).reshape((1, 1))
        else:
            sb = ct.load(B_scale, (bb, bn), (1, TN), padding_mode=_ZERO).reshape((1, TN))
        acc = acc * sa * sb
    epilogue(acc, C, Alpha, Bias, batch, bm, bn, TM, TN)


@ct.kernel(num_worker_warps=ct.ByTarget(sm_90=8))
def _gemm_kernel(A, A_scale, B, B_scale, C, Alpha, Bias,
                 TM: ConstInt, TN: ConstInt, TK: ConstInt, GROUP_SIZE_M: ConstInt,
                 LATENCY_A: ConstInt, LATENCY_B: ConstInt, FAST_ACC: ConstBool, SCALED: ConstBool,
                 A_TENSOR: ConstBool, B_TENSOR: ConstBool, PERSISTENT: ConstBool):
    """C[b] = (A[ba] @ B[bb].T) (* A_scale[ba][:, None] * B_scale[bb][None, :]) * alpha + bias.

    A (Ba, M, K), B (Bb, N, K); A_scale (Ba, M), B_scale (Bb, N) fp32 when SCALED (otherwise any
    arrays, never read), or with A_TENSOR / B_TENSOR a (1,) fp32 per-tensor scale that multiplies
    every row / column; C (B, M, N); Alpha (1,) fp32; Bias (N,) fp32.
    """
    if PERSISTENT:
        tiles = C.shape[0] * ct.cdiv(C.shape[1], TM) * ct.cdiv(C.shape[2], TN)
        for t in range(ct.bid(0), tiles, ct.num_blocks(0)):
            _gemm_tile(A, A_scale, B, B_scale, C, Alpha, Bias, t, TM, TN, TK, GROUP_SIZE_M, LATENCY_A,
                       LATENCY_B, FAST_ACC, SCALED, A_TENSOR, B_TENSOR)
    else:
        _gemm_tile(A, A_scale, B, B_scale, C, Alpha, Bias, ct.bid(0), TM, TN, TK, GROUP_SIZE_M, LATENCY_A,
                   LATENCY_B, FAST_ACC, SCALED, A_TENSOR, B_TENSOR)


def gemm_kernel():
    """The undecorated-hints kernel (for ahead-of-time variants)."""
    return _gemm_kernel


# --------------------------------------------------------------------------------------------------
# Configs and launch
# --------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class GemmConfig:
    """Tile sizes, GROUP_SIZE_M, per-operand load latency hints (0: the compiler's choice), the
    compiler hints (worker warps, CTAs per SM, CTAs per cluster) and persistent scheduling."""

    tile_m: int
    tile_n: int
    tile_k: int
    group_size_m: int = 8
    latency_a: int = 0
    latency_b: int = 0
    num_worker_warps: int = 8
    occupancy: int | None = None
    num_ctas: int | None = None
    persistent: bool = False

    def hints(self) -> dict:
        return sm90_hints(self.num_worker_warps, self.occupancy, self.num_ctas)

    @property
    def name(self) -> str:
        s = f"{self.tile_m}x{self.tile_n}x{self.tile_k}"
        if self.latency_a or self.latency_b:
            s += f"_la{self.latency_a}lb{self.latency_b}"
        if self.occupancy:
            s += f"_occ{self.occupancy}"
        if self.num_ctas:
            s += f"_cta{self.num_ctas}"
        if self.group_size_m != 8:
            s += f"_g{self.group_size_m}"
        return s + ("_pers" if self.persistent else "")




def gemm_grid(cfg: GemmConfig, batch: int, m: int, n: int, sms: int) -> int:
    """Blocks to launch: one per output tile, or for persistent configs at most one per SM slot."""
    tiles = batch * ceil_div(m, cfg.tile_m) * ceil_div(n, cfg.tile_n)
    if not cfg.persistent:
        return tiles
    ctas = cfg.num_ctas or 1
    slots = sms * (cfg.occupancy or 1) // ctas
    blocks = max(1, min(tiles, slots))
    return ceil_div(blocks, ctas) * ctas  # whole clusters; surplus blocks find no tile and exit


def gemm_constants(cfg: GemmConfig, fast_acc: bool, scaled: bool, a_tensor: bool = False,
                   b_tensor: bool = False) -> tuple:
    """The kernel's constants; ``a_tensor`` / ``b_tensor``: that operand's scale is one (1,) value."""
    return (cfg.tile_m, cfg.tile_n, cfg.tile_k, cfg.group_size_m, cfg.latency_a, cfg.latency_b, fast_acc,
            scaled, a_tensor, b_tensor, cfg.persistent)


def launch_gemm(a, a_scale, b, b_scale, out, alpha, bias, cfg: GemmConfig, *, fast_acc: bool,
                scaled: bool, a_tensor: bool = False, b_tensor: bool = False) -> None:
    """``out = (a @ b.T) (* a_scale * b_scale) * alpha + bias`` on the current stream.

    a (Ba, M, K), b (Bb, N, K), out (B, M, N); scales (Ba, M) / (Bb, N) fp32 when ``scaled``, or (1,)
    per tensor with ``a_tensor`` / ``b_tensor`` (pass any tensors when not ``scaled``, e.g.
    ``alpha``); alpha (1,) and bias (N,) fp32."""
    batch, m, n = out.shape
    sms = num_sms(out.device)
    kernel = hinted(_gemm_kernel, **cfg.hints())
    # Operands of 2^31 elements and more: one launch per piece of the output (``_large``), each
    # output tile computed exactly as in one launch (K is never cut).
    lg = _large
    operands = lg.matmul_operands(a, a_scale, b, b_scale, out, alpha, bias, batch, scaled=scaled,
                                  a_tensor=a_tensor, b_tensor=b_tensor)
    for views in lg.split("matmul", lg.matmul_axes(batch, m, n, cfg.tile_m, cfg.tile_n), operands):
        grid = (gemm_grid(cfg, *views[4].shape, sms), 1, 1)
        ct.launch(stream_handle(out.device), grid, kernel,
                  (*views, *gemm_constants(cfg, fast_acc, scaled, a_tensor, b_tensor)))
