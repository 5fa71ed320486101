"""FP8 matmuls (per-tensor, per-row, DeepSeek-style 1x128 / 128x128 blocks) on Hopper (sm_90), in cuTile.

Computes ``out = ((a * sa) @ (b * sb).T) * alpha + bias`` accumulated in fp32, rounded once to ``out``'s
dtype, for e4m3 / e5m2 ``a`` (Ba, M, K) and ``b`` (Bb, N, K), both K-contiguous (docs/numerics.md).

Kernels (1-D GROUP_SIZE_M-swizzled tile order, num_worker_warps = 8: two MMA warpgroups):

* granularity TENSOR and ROW (``tilemm.formats.Granularity``): ``hopper_gemm``'s kernel with
  ``SCALED``: FP8 ``ct.mma`` over all of K into one fp32 accumulator; the epilogue multiplies row r / column c by
  ``sa[r] * sb[c]``. A per-tensor scale (a broadcast view of one value) reaches the kernel as that
  one (1,) value (``A_TENSOR`` / ``B_TENSOR``), which multiplies every row / column: the same
  products, and no vector to copy, so a repeated call is one launch.
* BLOCK_1X128 (``_fp8_blockwise_kernel``, e4m3, K a multiple of 128): a (Ba, M, K/128) scale per 1x128
  block of a and a (Bb, cdiv(N, 128), K/128) scale per 128x128 block of b; TK = 128 and TN divides 128,
  so each K step is one scale column: ``acc += mma(a_k, b_k, 0) * sa[:, k] * sb[n, k]``.

Accumulation: ``use_fast_acc=False`` by default keeps a second fp32 accumulator next to the tensor
core's (as ``torch._scaled_mm``'s default); ``use_fast_accum=True`` skips it. Either way Hopper's FP8
tensor cores add each k-step's products with reduced precision before the fp32 accumulator, so this
path does not meet docs/numerics.md's fp32-output bound (the one documented exception there); the
measured errors are in benchmarks/results/matmul-hopper-design-nvidia-h100-80gb-hbm3.md.
"""

from __future__ import annotations

import math

import cuda.tile as ct
import torch

from ..formats import FP8_BLOCK, Granularity
from . import _large
from ._aot import AotVariant, array
from ._common import ceil_div, epilogue, fp8_kind, hinted, ones_scalar, stream_handle, tile_coords, zeros_vector
from .hopper_gemm import GemmConfig, gemm_constants, gemm_grid, gemm_kernel, launch_gemm, num_sms

__all__ = ["launch", "Prepared", "aot_variants", "FP8Config", "plan"]

ConstInt = ct.Constant[int]
ConstBool = ct.Constant[bool]

_ZERO = ct.PaddingMode.ZERO


# --------------------------------------------------------------------------------------------------
# Tile code
# --------------------------------------------------------------------------------------------------

def _load_operands(A, B, ba, bb, bm, bn, kt, TM, TN, TK, LATENCY):
    """(TM, TK) tile of A and the (TK, TN) transpose of a (TN, TK) tile of B; zero past the edges."""
    if LATENCY > 0:
        a = ct.load(A, (ba, bm, kt), (1, TM, TK), padding_mode=_ZERO, latency=LATENCY)
        b = ct.load(B, (bb, bn, kt), (1, TN, TK), padding_mode=_ZERO, latency=LATENCY)
    else:
        a = ct.load(A, (ba, bm, kt), (1, TM, TK), padding_mode=_ZERO)
        b = ct.load(B, (bb, bn, kt), (1, TN, TK), padding_mode=_ZERO)
    return a.reshape((TM, TK)), b.reshape((TN, TK)).transpose()


@ct.kernel(num_worker_warps=ct.ByTarget(sm_90=8))
def _fp8_blockwise_kernel(A, A_scale, B, B_scale, C, Alpha, Bias,
                          TM: ConstInt, TN: ConstInt, GROUP_SIZE_M: ConstInt,
                          LATENCY: ConstInt, FAST_ACC: ConstBool):
    """One (TM, TN) tile with DeepSeek-style block scales: A_scale (Ba, M, K/128) per 1x128 block,
    B_scale (Bb, cdiv(N, 128), K/128) per 128x128 block. TN divides 128; K steps are 128 wide."""
    TK = FP8_BLOCK
    M = C.shape[1]
    N = C.shape[2]
    batch, bm, bn = tile_coords(M, N, TM, TN, GROUP_SIZE_M)
    ba = batch % A.shape[0]
    bb = batch % B.shape[0]
    nb = bn * TN // FP8_BLOCK  # this tile's 128-row block of B
    acc = ct.zeros((TM, TN), ct.float32)
    for kt in range(A.shape[2] // TK):
        a, b = _load_operands(A, B, ba, bb, bm, bn, kt, TM, TN, TK, LATENCY)
        part = ct.mma(a, b, ct.zeros((TM, TN), ct.float32), use_fast_acc=FAST_ACC)
        sa = ct.load(A_scale, (ba, bm, kt), (1, TM, 1), padding_mode=_ZERO).reshape((TM, 1))
        sb = ct.load(B_scale, (bb, nb, kt), (1, 1, 1), padding_mode=_ZERO).reshape((1, 1))
        acc = acc + part * (sa * sb)
    epilogue(acc, C, Alpha, Bias, batch, bm, bn, TM, TN)


# --------------------------------------------------------------------------------------------------
# Configs
# --------------------------------------------------------------------------------------------------

#: The family's config is ``hopper_gemm.GemmConfig`` (the blockwise kernel reads tile_m, tile_n,
#: group_size_m and latency_a as its one load latency hint).
FP8Config = GemmConfig

_LARGE_TILES = 132  # at least one wave of the large tile on the H100's 132 SMs

# Keyed by (kernel, accumulation). Precise accumulation keeps a second fp32 accumulator, so a 128x256
# tile spills registers (cuobjdump: 184 bytes of stack) and the precise tile stays 128x128. Persistent
# scheduling (one block per SM walking the tiles) was faster than one block per tile; with fewer tiles
# than SMs it launches one block per tile anyway.
_CONFIGS: dict[tuple[str, bool], dict[str, FP8Config]] = {
    ("scaled", False): {"small": FP8Config(128, 128, 128, persistent=True),
                        "large": FP8Config(128, 128, 128, persistent=True)},
    ("scaled", True): {"small": FP8Config(128, 128, 128, persistent=True),
                       "large": FP8Config(128, 256, 128, persistent=True)},
    ("blockwise", False): {"small": FP8Config(128, 128, FP8_BLOCK),
                           "large": FP8Config(128, 128, FP8_BLOCK)},
    ("blockwise", True): {"small": FP8Config(128, 128, FP8_BLOCK),
                          "large": FP8Config(128, 128, FP8_BLOCK)},
}


def _kind(granularity: Granularity) -> str:
    return fp8_kind(granularity, "hopper_fp8")


#: Below this share of SMs busy over all waves, the large tile gives way to the small one (if that
#: fills the waves better): with few tiles, the large tile's partial last wave leaves SMs idle. Of the
#: benchmark shapes only 1024 x 14336 x 4096 falls below it, and there the 128x128 tile beat the
#: 128x256 one (``benchmarks/results/matmul-hopper-design-nvidia-h100-80gb-hbm3.md``, "hopper_fp8:
#: wave fill").
_MIN_WAVE_FILL = 0.9


def _wave_fill(tiles: int, sms: int) -> float:
    """The share of SM time that ``tiles`` equal tiles keep busy on ``sms`` SMs (1.0: whole waves)."""
    return tiles / (ceil_div(tiles, sms) * sms)


def plan(granularity: Granularity, batch: int, m: int, n: int, fast_accum: bool = False,
         sms: int = 132) -> FP8Config:
    """The config for ``batch`` x (m, n) outputs: the large tile when there are at least
    ``_LARGE_TILES`` of it and its last wave is not mostly empty, else the small one."""
    table = _CONFIGS[_kind(granularity), fast_accum]
    large, small = table["large"], table["small"]
    tiles = batch * ceil_div(m, large.tile_m) * ceil_div(n, large.tile_n)
    if tiles < _LARGE_TILES:
        return small
    small_tiles = batch * ceil_div(m, small.tile_m) * ceil_div(n, small.tile_n)
    if _wave_fill(tiles, sms) < _MIN_WAVE_FILL and _wave_fill(small_tiles, sms) > _wave_fill(tiles, sms):
        return small
    return large


# --------------------------------------------------------------------------------------------------
# Launch
# --------------------------------------------------------------------------------------------------

def _blockwise_constants(cfg: FP8Config, fast_acc: bool) -> tuple:
    return (cfg.tile_m, cfg.tile_n, cfg.group_size_m, cfg.latency_a, fast_acc)


class Prepared:
    """One FP8 matmul signature on sm_90, planned once (config, hinted kernel, grid, constants): ``run``
    launches it for any problem of that signature. Operands of 2^31 elements and more are planned
    again on every call (``_launch``)."""

    __slots__ = ("cfg", "scaled", "fast_acc", "kernel", "grid", "consts", "n", "direct", "a_tensor", "b_tensor")

    def __init__(self, problem, config: FP8Config | None = None):
        out = problem.out
        batch, m, n = out.shape
        self.n = n
        self.scaled = _kind(problem.granularity) == "scaled"
        self.fast_acc = bool(getattr(problem, "use_fast_accum", False))
        cfg = self.cfg = config or plan(problem.granularity, batch, m, n, self.fast_acc, num_sms(out.device))
        if not self.scaled and (cfg.tile_k != FP8_BLOCK or FP8_BLOCK % cfg.tile_n or cfg.persistent):
            raise ValueError(f"hopper_fp8: blockwise configs need tile_k == 128, tile_n dividing 128 and no "
                             f"persistent scheduling, got {cfg}")
        self.direct = _large.fits(problem.a, problem.b, out, problem.a_scale, problem.b_scale)
        self.a_tensor = self.scaled and _one_value(problem.a_scale)
        self.b_tensor = self.scaled and _one_value(problem.b_scale)
        if self.scaled:
            self.kernel = hinted(gemm_kernel(), **cfg.hints())
            self.grid = (gemm_grid(cfg, batch, m, n, num_sms(out.device)), 1, 1)
            self.consts = gemm_constants(cfg, self.fast_acc, True, self.a_tensor, self.b_tensor)
        else:
            self.kernel = hinted(_fp8_blockwise_kernel, **cfg.hints())
            self.grid = (batch * ceil_div(m, cfg.tile_m) * ceil_div(n, cfg.tile_n), 1, 1)
            self.consts = _blockwise_constants(cfg, self.fast_acc)

    def operands(self, problem):
        """(a, a_scale, b, b_scale) as the kernel reads them: a per-tensor scale as a (1,) view of its
        value; other scales contiguous (a transposed 128x128 block-scale view is copied: it is tiny)."""
        a_scale = _value(problem.a_scale) if self.a_tensor else problem.a_scale.contiguous()
        b_scale = _value(problem.b_scale) if self.b_tensor else problem.b_scale.contiguous()
        return problem.a, a_scale, problem.b, b_scale

    def run(self, problem, stream) -> None:
        """Launch for ``problem`` (an ``FP8Problem`` of this signature) on raw stream ``stream``."""
        device = problem.out.device
        a, a_scale, b, b_scale = self.operands(problem)
        alpha = ones_scalar(device) if problem.alpha is None else problem.alpha.reshape(1)
        bias = zeros_vector(device, self.n) if problem.bias is None else problem.bias
        if not self.direct:
            _launch(problem, self, a_scale, b_scale, alpha, bias, stream)
            return
        self.launch(stream, a, a_scale, b, b_scale, problem.out, alpha, bias)

    def launch(self, stream, a, a_scale, b, b_scale, out, alpha, bias) -> None:
        """The launch of a ``direct`` signature for its kernel operands (``operands``; out (B, M, N),
        alpha (1,) fp32, bias (N,) fp32), on raw stream ``stream``."""
        ct.launch(stream, self.grid, self.kernel, (a, a_scale, b, b_scale, out, alpha, bias, *self.consts))


def _one_value(scale: torch.Tensor) -> bool:
    """Whether a (B, rows) scale is one value broadcast (every stride 0): a per-tensor scale."""
    return scale.numel() > 0 and not any(scale.stride())


def _value(scale: torch.Tensor) -> torch.Tensor:
    """The one value of a broadcast scale as a (1,) view of it (no copy)."""
    return scale.as_strided((1,), (1,))


def _launch(problem, prepared: Prepared, a_scale, b_scale, alpha, bias, stream) -> None:
    """``Prepared.run`` for operands of 2^31 elements and more: one launch per piece of the output
    (``_large``; each tile as in one launch, K never cut); N cuts fall on the weight's 128-row scale
    blocks."""
    cfg, out = prepared.cfg, problem.out
    batch, m, n = out.shape
    if prepared.scaled:
        launch_gemm(problem.a, a_scale, problem.b, b_scale, out, alpha, bias, cfg, fast_acc=prepared.fast_acc,
                    scaled=True, a_tensor=prepared.a_tensor, b_tensor=prepared.b_tensor)
        return
    lg = _large
    axes = lg.matmul_axes(batch, m, n, cfg.tile_m, math.lcm(cfg.tile_n, FP8_BLOCK))
    operands = lg.matmul_operands(problem.a, a_scale, problem.b, b_scale, out, alpha, bias, batch,
                                  b_per=FP8_BLOCK)
    for views in lg.split("fp8_matmul", axes, operands):
        pb, pm, pn = views[4].shape
        grid = (pb * ceil_div(pm, cfg.tile_m) * ceil_div(pn, cfg.tile_n), 1, 1)
        ct.launch(stream, grid, prepared.kernel, (*views, *prepared.consts))


def launch(problem, config: FP8Config | None = None) -> None:
    """Run a ``tilemm.matmul.FP8Problem`` on an sm_90 GPU, writing ``problem.out``.

    ``config`` overrides ``plan``'s choice (for tuning and benchmarks)."""
    Prepared(problem, config).run(problem, stream_handle(problem.out.device))


# --------------------------------------------------------------------------------------------------
# Ahead-of-time specialisations
# --------------------------------------------------------------------------------------------------

_OUT_DTYPES = {"bf16": ct.bfloat16, "fp16": ct.float16, "fp32": ct.float32}
_DATA_DTYPES = {"e4m3": ct.float8_e4m3fn, "e5m2": ct.float8_e5m2}


def aot_variants() -> list[AotVariant]:
    """Every (kernel, element dtype, output dtype, config, accumulation mode, per-tensor scales)
    ``launch`` can pick. The per-tensor scale modes (x's, y's or both) take the scaled kernel's other
    paths; they are listed with bf16 outputs only (the output dtype is a precision, not a path)."""
    variants = []
    for kind in dict.fromkeys(kind for kind, _ in _CONFIGS):  # "scaled", "blockwise"
        sdim = 3 if kind == "blockwise" else 2
        elements = ("e4m3",) if kind == "blockwise" else ("e4m3", "e5m2")
        modes = ((False, False), (True, True), (False, True), (True, False)) if kind == "scaled" else ((False, False),)
        for elem in elements:
            data = _DATA_DTYPES[elem]
            for out_name, out_dtype in _OUT_DTYPES.items():
                for fast_acc in (False, True):
                    for cfg in sorted(set(_CONFIGS[kind, fast_acc].values()), key=repr):
                        for a_tensor, b_tensor in modes if out_name == "bf16" else modes[:1]:
                            arrays = [array(data, 3), array(ct.float32, 1 if a_tensor else sdim), array(data, 3),
                                      array(ct.float32, 1 if b_tensor else sdim), array(out_dtype, 3),
                                      array(ct.float32, 1), array(ct.float32, 1)]
                            if kind == "scaled":
                                kernel, consts = gemm_kernel(), gemm_constants(cfg, fast_acc, True, a_tensor, b_tensor)
                            else:
                                kernel, consts = _fp8_blockwise_kernel, _blockwise_constants(cfg, fast_acc)
                            scales = {(True, True): "_tensor", (False, True): "_ytensor",
                                      (True, False): "_xtensor"}.get((a_tensor, b_tensor), "")
                            name = (f"hopper_fp8_{kind}_{elem}_{out_name}_{cfg.name}{'_fastacc' if fast_acc else ''}"
                                    f"{scales}")
                            variants.append(AotVariant(name, hinted(kernel, **cfg.hints()), [*arrays, *consts],
                                                       targets=("sm_90",)))
    return variants
