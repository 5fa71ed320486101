"""MXFP8, MXFP4 and NVFP4 matmuls on Blackwell (sm_100 / sm_120) with ``ct.mma_scaled``, in cuTile.

Computes ``out = (dequantize(a) @ dequantize(b).T) * alpha + bias`` per batch entry, fp32
accumulation, one rounding to ``out``'s dtype (docs/numerics.md). a (Ba, M, Kd) and b, the
(Bb, N, Kd) weight, are K-contiguous (Kd = K/2 for packed e2m1); scales are e8m0 (MX, block 32) or
e4m3 (NVFP4, block 16; its decode scales arrive folded into alpha). ``ct.mma_scaled`` applies the
scales in hardware (tcgen05 on sm_100, warp-level ``QMMA.SF`` / ``OMMA.SF`` on sm_120): nothing is
dequantized in registers.

Per K step a block loads a (TM, TK) tile of a and a (TN, TK) tile of b (transposed in registers),
packed e2m1 through ``ct.unpack_from_bytes`` (element 2i in the low nibble of byte i), and the
scales as uint8 bytes bit-cast in registers, so zero padding is byte 0 (a finite scale). Logical
scales load as (1, TR, TK/B) tiles; swizzled 32x4x4 scales as whole (TR/128, TK/(4B)) blocks of
(32, 16) (one TMA box), unswizzled in registers by ``_unswizzle_32_4_4``.

Invariants: loads past M, N and K are zero-filled and stores masked, so K padding adds exactly 0
and scale rows past M / N reach only accumulators that are never stored; swizzled padding columns
are zero by contract (``swizzle.swizzle_32_4_4`` writes zeros); scale byte 255 / an e4m3 NaN makes
its row or column NaN. A shared weight (Bb == 1) folds the batch into M where the views exist.

Configs (``_CONFIGS``, a table per compute capability: ``_arch.table_for_capability``; ``plan`` picks one)
were chosen without a Blackwell GPU; ``Prepared`` plans a signature once, ``launch`` is one prepared call. Design notes:
benchmarks/results/matmul-hopper-design-nvidia-h100-80gb-hbm3.md ("blackwell_block_scaled").
"""

from __future__ import annotations

import dataclasses

import cuda.tile as ct
import torch

from ..formats import MXFP4, MXFP8_E4M3, MXFP8_E5M2, NVFP4, Format
from . import _large
from ._aot import AotVariant, array
from .._arch import capability, table_for_capability
from ._common import (SWIZZLE_COLS, SWIZZLE_ROWS, ceil_div, epilogue, folded_alpha, hinted, launch_all_on, num_sms,
                      ones_scalar, stream_handle, tile_coords, zeros_vector)

__all__ = ["launch", "Prepared", "aot_variants", "BlockScaledConfig", "plan", "scale_tile_blocks", "check_config",
           "FORMATS"]

ConstInt = ct.Constant[int]
ConstBool = ct.Constant[bool]

_ZERO = ct.PaddingMode.ZERO

#: The formats this module serves.
FORMATS = (MXFP8_E4M3, MXFP8_E5M2, MXFP4, NVFP4)


# --------------------------------------------------------------------------------------------------
# Tile code
# --------------------------------------------------------------------------------------------------

def _unswizzle_32_4_4(t, ROW_BLOCKS, COL_BLOCKS):
    """(1, RB, CB, 32, 16) swizzled scale bytes -> the logical (RB * 128, CB * 4) tile.

    Inner block index (m1, m2 * 4 + k1) holds logical (row, column) = (m2 * 32 + m1, k1) of its block.
    """
    t = t.reshape((ROW_BLOCKS, COL_BLOCKS, 32, 4, 4))  # (rb, cb, m1, m2, k1)
    t = t.permute((0, 3, 2, 1, 4))                     # (rb, m2, m1, cb, k1)
    return t.reshape((ROW_BLOCKS * SWIZZLE_ROWS, COL_BLOCKS * SWIZZLE_COLS))


def _load_elements(X, b, i, kt, ROWS, TK, PACKED):
    """(ROWS, TK) elements of X[b] at row tile i, K tile kt; zero past the edges.

    PACKED: X holds uint8 bytes of two e2m1 elements each (low nibble first), TK / 2 bytes per row."""
    if PACKED:
        raw = ct.load(X, (b, i, kt), (1, ROWS, TK // 2), padding_mode=_ZERO)
        return ct.unpack_from_bytes(raw.reshape((-1,)), ct.float4_e2m1fn).reshape((ROWS, TK))
    return ct.load(X, (b, i, kt), (1, ROWS, TK), padding_mode=_ZERO).reshape((ROWS, TK))


def _load_scale_bytes(S, b, i, kt, ROWS, TKS):
    """(ROWS, TKS) scale bytes of S[b] for row tile i, K tile kt, in logical (row, column) order.

    S holds the scale bytes (uint8), logical (B, R, Ks) or swizzled (B, R/128, Ks/4, 32, 16); padding
    is byte 0 in both."""
    if S.ndim == 5:
        raw = ct.load(S, (b, i, kt, 0, 0), (1, ROWS // SWIZZLE_ROWS, TKS // SWIZZLE_COLS, 32, 16),
                      padding_mode=_ZERO)
        return _unswizzle_32_4_4(raw, ROWS // SWIZZLE_ROWS, TKS // SWIZZLE_COLS)
    return ct.load(S, (b, i, kt), (1, ROWS, TKS), padding_mode=_ZERO).reshape((ROWS, TKS))


def _load_scales(S, b, i, kt, ROWS, TKS, E4M3_SCALES):
    """``_load_scale_bytes`` as float8_e8m0fnu or float8_e4m3fn (byte 0, the padding, is a finite
    scale in both)."""
    raw = _load_scale_bytes(S, b, i, kt, ROWS, TKS)
    if E4M3_SCALES:
        return ct.bitcast(raw, ct.float8_e4m3fn)
    return ct.bitcast(raw, ct.float8_e8m0fnu)


@ct.kernel
def _block_scaled_kernel(A, A_scale, B, B_scale, C, Alpha, Bias,
                         TM: ConstInt, TN: ConstInt, TK: ConstInt, SCALE_BLOCK: ConstInt,
                         PACKED: ConstBool, E4M3_SCALES: ConstBool, GROUP_SIZE_M: ConstInt):
    """One (TM, TN) tile of C[batch] = mma_scaled(A[ba], A_scale[ba], B[bb].T, B_scale[bb].T) * alpha
    + bias. A (Ba, M, Kd), B (Bb, N, Kd); scale bytes logical or swizzled; C (B, M, N)."""
    M = C.shape[1]
    N = C.shape[2]
    batch, bm, bn = tile_coords(M, N, TM, TN, GROUP_SIZE_M)
    ba = batch % A.shape[0]
    bb = batch % B.shape[0]
    TKS = TK // SCALE_BLOCK
    k_tiles = ct.cdiv(A.shape[2] * (2 if PACKED else 1), TK)
    acc = ct.zeros((TM, TN), ct.float32)
    for kt in range(k_tiles):
        a = _load_elements(A, ba, bm, kt, TM, TK, PACKED)                     # (TM, TK)
        b = _load_elements(B, bb, bn, kt, TN, TK, PACKED).transpose()         # (TK, TN)
        sa = _load_scales(A_scale, ba, bm, kt, TM, TKS, E4M3_SCALES)          # (TM, TKS)
        sb = _load_scales(B_scale, bb, bn, kt, TN, TKS, E4M3_SCALES).transpose()  # (TKS, TN)
        acc = ct.mma_scaled(a, sa, b, sb, acc)
    epilogue(acc, C, Alpha, Bias, batch, bm, bn, TM, TN)


# --------------------------------------------------------------------------------------------------
# Configs
# --------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class BlockScaledConfig:
    """Output tile (tile_m x tile_n), K step in bytes of each operand row (tile_k = k_bytes elements
    for FP8, 2 * k_bytes for packed e2m1), CTAs per cluster, the GROUP_SIZE_M order, and whether sm_12x
    gets num_worker_warps=8. ``targets`` lists the architectures the table offers it on."""

    tile_m: int
    tile_n: int
    k_bytes: int = 128
    num_ctas: int = 1
    group_size_m: int = 8
    targets: tuple[str, ...] = ("sm_100", "sm_120")

    def tile_k(self, fmt: Format) -> int:
        return self.k_bytes * fmt.elements_per_byte

    @property
    def name(self) -> str:
        return f"{self.tile_m}x{self.tile_n}x{self.k_bytes}B" + (f"_{self.num_ctas}cta" if self.num_ctas > 1 else "")

    def hints(self) -> dict:
        # sm_120's warp-level MMA keeps the fp32 accumulator in registers: 4 warps spill a 128x128
        # tile, 8 do not. sm_100 accumulates in tensor memory and needs no extra warps.
        return {"num_ctas": self.num_ctas,
                "num_worker_warps": ct.ByTarget(sm_120=8, sm_121=8)}


_SMALL = BlockScaledConfig(128, 128)
_LARGE_2CTA = BlockScaledConfig(256, 256, num_ctas=2, targets=("sm_100",))

#: Configs per table: "sm_100" for compute capability 10.x, "sm_120" for 11.x / 12.x.
_CONFIGS: dict[str, dict[str, BlockScaledConfig]] = {
    "sm_100": {"small": _SMALL, "large": _LARGE_2CTA},
    "sm_120": {"small": _SMALL},
}

#: SM count assumed when the device cannot be asked (B200).
DEFAULT_SM_COUNT = 148


def plan(table: str, batch: int, m: int, n: int, sms: int = DEFAULT_SM_COUNT) -> BlockScaledConfig:
    """The config of config table ``table`` for ``batch`` x (m, n) outputs: the large tile once it
    still gives every SM (pair) a tile, the small one otherwise."""
    configs = _CONFIGS[table]
    large = configs.get("large")
    if large is not None:
        tiles = batch * ceil_div(m, large.tile_m) * ceil_div(n, large.tile_n)
        if tiles * large.num_ctas >= sms:
            return large
    return configs["small"]


def scale_tile_blocks(fmt: Format, cfg: BlockScaledConfig) -> tuple[int, int]:
    """(row blocks, column blocks) of one operand's swizzled scale load for ``cfg``: (TM / 128,
    TK / (B * 4)), e.g. (1, 1) for MXFP8 at 128x128 (TK = 128), (1, 4) for NVFP4 (TK = 256, B = 16)."""
    check_config(fmt, cfg)
    return cfg.tile_m // SWIZZLE_ROWS, cfg.tile_k(fmt) // (fmt.block * SWIZZLE_COLS)


def check_config(fmt: Format, cfg: BlockScaledConfig) -> None:
    """Raise ValueError unless ``cfg`` can run ``fmt``: power-of-two tiles, whole 128-row swizzle blocks,
    K steps of whole 4-column scale blocks, and 2-CTA clusters only for 256-row tiles."""
    if fmt not in FORMATS:
        raise ValueError(f"blackwell_block_scaled: format must be one of "
                         f"{', '.join(f.name for f in FORMATS)}, got {fmt!r}")
    tk = cfg.tile_k(fmt)
    for what, v in (("tile_m", cfg.tile_m), ("tile_n", cfg.tile_n), ("tile_k", tk)):
        if v <= 0 or v & (v - 1):
            raise ValueError(f"blackwell_block_scaled: {what} must be a power of two, got {v} in {cfg}")
    if cfg.tile_m % SWIZZLE_ROWS or cfg.tile_n % SWIZZLE_ROWS:
        raise ValueError(f"blackwell_block_scaled: tile_m and tile_n must be multiples of {SWIZZLE_ROWS} "
                         f"(whole 32x4x4 scale blocks), got {cfg.tile_m}x{cfg.tile_n}")
    if tk % (fmt.block * SWIZZLE_COLS):
        raise ValueError(f"blackwell_block_scaled: tile_k must be a multiple of 4 scale blocks "
                         f"({fmt.block * SWIZZLE_COLS} for {fmt.name}), got {tk}")
    if cfg.num_ctas not in (1, 2) or (cfg.num_ctas == 2 and cfg.tile_m != 256):
        raise ValueError(f"blackwell_block_scaled: num_ctas must be 1, or 2 with tile_m = 256 (one "
                         f"128-row half per CTA), got num_ctas={cfg.num_ctas}, tile_m={cfg.tile_m}")


# --------------------------------------------------------------------------------------------------
# Launch
# --------------------------------------------------------------------------------------------------

def _fold_batch(a, a_scale, out, swizzled):
    """(Ba, M, ...) views with the batch folded into M, or None where a view is impossible or the
    swizzled scale has per-batch row padding (M % 128 != 0)."""
    batch, m = out.shape[0], out.shape[1]
    if batch == 1 or a.shape[0] != batch or (swizzled and m % SWIZZLE_ROWS):
        return None
    try:
        a2 = a.view(1, batch * m, a.shape[2])
        if swizzled:
            s2 = a_scale.view(1, a_scale.shape[0] * a_scale.shape[1], *a_scale.shape[2:])
        else:
            s2 = a_scale.view(1, batch * m, a_scale.shape[2])
        o2 = out.view(1, batch * m, out.shape[2])
    except RuntimeError:
        return None
    return a2, s2, o2


def _constants(fmt: Format, cfg: BlockScaledConfig) -> tuple:
    return (cfg.tile_m, cfg.tile_n, cfg.tile_k(fmt), fmt.block, fmt.is_packed,
            fmt.scale_dtype == torch.float8_e4m3fn, cfg.group_size_m)


def _scale_bytes(scale: torch.Tensor) -> torch.Tensor:
    return scale if scale.dtype == torch.uint8 else scale.view(torch.uint8)


class Prepared:
    """One block-scaled matmul signature on a Blackwell GPU, planned once: ``run`` launches it for any
    problem of that signature.

    ``config`` (the table's choice, ``plan``, when None), the hinted ``kernel``, and the launches of
    the problem it was made from: ``launches`` holds (grid, args) per launch, one unless an operand has
    2^31 elements or more (``_large``: one per piece of the output), ``grid`` and ``args`` being the
    first; ``folded`` tells whether the batch is folded into M. ``table`` (a config table of
    ``_CONFIGS``) and ``sms`` default to the problem's GPU; given, no GPU is needed (CPU tensors
    give the same launches). Operands of 2^31 elements and more are prepared again on every call
    (their pieces are views of the call's tensors)."""

    __slots__ = ("config", "kernel", "grid", "args", "folded", "launches", "table", "sms", "consts",
                 "direct", "swizzled", "n", "decode_scales", "alpha_given")

    def __init__(self, problem, config: BlockScaledConfig | None = None, *, table: str | None = None,
                 sms: int | None = None):
        fmt = problem.fmt
        out = problem.out
        device = out.device
        self.table = table_for_capability(capability(device)) if table is None else table
        self.sms = (num_sms(device) if table is None else DEFAULT_SM_COUNT) if sms is None else sms
        batch, m, n = out.shape
        a, b = problem.a, problem.b
        if a.shape[0] not in (1, batch) or b.shape[0] not in (1, batch):
            raise ValueError(f"blackwell_block_scaled: a and b batch sizes must be 1 or {batch}, got "
                             f"{a.shape[0]} and {b.shape[0]}")
        want_ndim = 5 if problem.swizzled else 3
        if problem.a_scale.ndim != want_ndim or problem.b_scale.ndim != want_ndim:
            raise ValueError(f"blackwell_block_scaled: swizzled={problem.swizzled} needs {want_ndim}-D scales, "
                             f"got a_scale {tuple(problem.a_scale.shape)}, b_scale {tuple(problem.b_scale.shape)}")
        a_scale = _scale_bytes(problem.a_scale)
        b_scale = _scale_bytes(problem.b_scale)

        self.folded = False
        if b.shape[0] == 1:
            views = _fold_batch(a, a_scale, out, problem.swizzled)
            if views is not None:
                a, a_scale, out = views
                self.folded = True
        grid_batch, grid_m = out.shape[0], out.shape[1]

        cfg = self.config = config or plan(self.table, grid_batch, grid_m, n, self.sms)
        check_config(fmt, cfg)
        alpha = folded_alpha(problem)
        alpha = ones_scalar(device) if alpha is None else alpha.reshape(1)
        bias = zeros_vector(device, n) if problem.bias is None else problem.bias
        self.kernel = hinted(_block_scaled_kernel, **cfg.hints())
        self.consts = _constants(fmt, cfg)
        # Operands of 2^31 elements and more: one launch per piece of the output along M and N
        # (``_large``; tiles are whole 128-row scale blocks), each tile computed as in one launch.
        lg = _large
        per = SWIZZLE_ROWS if problem.swizzled else 1
        operands = lg.matmul_operands(a, a_scale, b, b_scale, out, alpha, bias, grid_batch, per, per)
        launches = []
        for views in lg.split("block-scaled matmul", lg.matmul_axes(grid_batch, grid_m, n, cfg.tile_m, cfg.tile_n),
                              operands):
            pb, pm, pn = views[4].shape
            launches.append(((pb * ceil_div(pm, cfg.tile_m) * ceil_div(pn, cfg.tile_n), 1, 1),
                             (*views, *self.consts)))
        self.launches = tuple(launches)
        self.grid, self.args = launches[0]
        self.direct = len(launches) == 1
        self.swizzled, self.n = problem.swizzled, n
        # Fixed by the signature (``tilemm.matmul``'s keys hold them): how ``launch`` folds alpha.
        self.decode_scales = problem.global_scales is not None
        self.alpha_given = problem.alpha is not None

    def operands(self, problem):
        """(a, a_scale, b, b_scale) as the kernel reads them: scales as uint8 bytes, a and a_scale
        with the batch folded into M where ``folded``. Views of the problem's tensors."""
        a, a_scale = problem.a, _scale_bytes(problem.a_scale)
        if self.folded:
            a, a_scale, _ = _fold_batch(a, a_scale, problem.out, self.swizzled)
        return a, a_scale, problem.b, _scale_bytes(problem.b_scale)

    def launch(self, stream, a, a_scale, b, b_scale, out, alpha, global_scale_x, global_scale_y, bias) -> None:
        """The launch of a ``direct`` signature for its kernel operands (``operands``) on raw stream
        ``stream``: out (B, M, N) (folded here as ``run`` folds it), alpha (1,) fp32 (ones for none),
        NVFP4's decode scales (1,) fp32 (ignored for MX), bias (N,) fp32. The kernel's one alpha is
        ``folded_alpha``'s: fp32(global_scale_x * global_scale_y), then times the given alpha."""
        if self.folded:
            out = out.view(1, out.shape[0] * out.shape[1], out.shape[2])
        if self.decode_scales:
            scales = global_scale_x * global_scale_y
            alpha = scales * alpha if self.alpha_given else scales
        launch_all_on(out.device, ct.launch, stream, self.kernel,
                      ((self.grid, (a, a_scale, b, b_scale, out, alpha, bias, *self.consts)),))

    def run(self, problem, stream) -> None:
        """Launch for ``problem`` (a ``BlockScaledProblem`` of this signature) on raw stream ``stream``."""
        device = problem.out.device
        if not self.direct:
            launches = Prepared(problem, self.config, table=self.table, sms=self.sms).launches
        else:
            a, a_scale, out = problem.a, _scale_bytes(problem.a_scale), problem.out
            if self.folded:
                a, a_scale, out = _fold_batch(a, a_scale, out, self.swizzled)
            alpha = folded_alpha(problem)
            alpha = ones_scalar(device) if alpha is None else alpha.reshape(1)
            bias = zeros_vector(device, self.n) if problem.bias is None else problem.bias
            launches = ((self.grid, (a, a_scale, problem.b, _scale_bytes(problem.b_scale), out, alpha, bias,
                                     *self.consts)),)
        launch_all_on(device, ct.launch, stream, self.kernel, launches)


def launch(problem, config: BlockScaledConfig | None = None) -> None:
    """Run a ``tilemm.matmul.BlockScaledProblem`` on a Blackwell GPU, writing ``problem.out``.

    ``config`` overrides ``plan``'s choice (for tuning and benchmarks)."""
    Prepared(problem, config).run(problem, stream_handle(problem.out.device))


# --------------------------------------------------------------------------------------------------
# Ahead-of-time specialisations
# --------------------------------------------------------------------------------------------------

_OUT_DTYPES = {"bf16": ct.bfloat16, "fp16": ct.float16, "fp32": ct.float32}
_DATA_DTYPES = {MXFP8_E4M3: ct.float8_e4m3fn, MXFP8_E5M2: ct.float8_e5m2, MXFP4: ct.uint8, NVFP4: ct.uint8}


def launch_array(dtype, ndim: int):
    """An array parameter as ``launch`` passes it for well-aligned tensors (``_aot.array``)."""
    return array(dtype, ndim)


def aot_variants() -> list[AotVariant]:
    """Every (format, scale layout, output dtype, config) ``launch`` can pick, with its targets."""
    variants = []
    configs = sorted({c for table in _CONFIGS.values() for c in table.values()}, key=lambda c: c.name)
    for fmt in FORMATS:
        data = _DATA_DTYPES[fmt]
        for layout, sdim in (("logical", 3), ("swizzled", 5)):
            for out_name, out_dtype in _OUT_DTYPES.items():
                for cfg in configs:
                    params = [launch_array(data, 3), launch_array(ct.uint8, sdim), launch_array(data, 3),
                              launch_array(ct.uint8, sdim), launch_array(out_dtype, 3),
                              launch_array(ct.float32, 1), launch_array(ct.float32, 1),
                              *_constants(fmt, cfg)]
                    name = f"blackwell_block_scaled_{fmt.name}_{layout}_{out_name}_{cfg.name}"
                    variants.append(AotVariant(name, hinted(_block_scaled_kernel, **cfg.hints()), params,
                                               targets=cfg.targets))
    return variants
