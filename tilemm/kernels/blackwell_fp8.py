"""FP8 matmuls (per-tensor, per-row, DeepSeek-style 1x128 / 128x128 blocks) on Blackwell (sm_100 /
sm_120), in cuTile.

Computes ``out = ((a * sa) @ (b * sb).T) * alpha + bias`` accumulated in fp32, rounded once to ``out``'s
dtype, for e4m3 / e5m2 ``a`` (Ba, M, K) and ``b`` (Bb, N, K), both K-contiguous (b's (TN, TK) tiles are
transposed in registers). One output tile per block, a 1-D GROUP_SIZE_M-ordered grid over B * tiles;
Ba or Bb of 1 broadcasts through ``batch % Ba``.

* ``_fp8_scaled_kernel`` (granularity TENSOR and ROW, ``tilemm.formats.Granularity``): FP8 ``ct.mma``
  over all of K into one fp32 accumulator; the epilogue multiplies row r / column c by
  ``sa[r] * sb[c]``. Loads past K are zero.
* ``_fp8_blockwise_kernel`` (BLOCK_1X128, e4m3, K a multiple of 128): sa (Ba, M, K/128), sb
  (Bb, cdiv(N, 128), K/128); TK = TN = 128, so each K step is one scale column and one N block:
  ``acc += mma(a_k, b_k, 0) * sa[:, k] * sb[n, k]``.

Blackwell's tensor cores accumulate FP8 products in full fp32, so ``use_fast_accum`` is accepted and
changes nothing here. Scales are applied in fp32 after the products are summed: the result differs
from "dequantize, then multiply" by fp32 rounding only. Configs (``_CONFIGS``: 128x128x128, and on
sm_100 256x256x128 on a 2-CTA cluster for large problems; sm_120 with 8 worker warps) were chosen
without a Blackwell GPU; the reasons are in benchmarks/results/matmul-hopper-design-nvidia-h100-80gb-hbm3.md.
"""

from __future__ import annotations

import dataclasses
import math

import cuda.tile as ct
import torch

from ..formats import FP8_BLOCK, Granularity
from . import _large
from ._aot import AotVariant
from .._arch import capability, table_for_capability
from ._common import (ceil_div, epilogue, fp8_kind, hinted, launch_all_on, num_sms, ones_scalar, stream_handle,
                      tile_coords, zeros_vector)
from .blackwell_block_scaled import DEFAULT_SM_COUNT, launch_array

__all__ = ["launch", "Prepared", "aot_variants", "FP8Config", "plan", "check_config"]

ConstInt = ct.Constant[int]

_ZERO = ct.PaddingMode.ZERO


# --------------------------------------------------------------------------------------------------
# Tile code
# --------------------------------------------------------------------------------------------------

def _load_operands(A, B, ba, bb, bm, bn, kt, TM, TN, TK):
    """(TM, TK) tile of A and the (TK, TN) transpose of a (TN, TK) tile of B; zero past the edges."""
    a = ct.load(A, (ba, bm, kt), (1, TM, TK), padding_mode=_ZERO).reshape((TM, TK))
    b = ct.load(B, (bb, bn, kt), (1, TN, TK), padding_mode=_ZERO).reshape((TN, TK))
    return a, b.transpose()


@ct.kernel
def _fp8_scaled_kernel(A, A_scale, B, B_scale, C, Alpha, Bias,
                       TM: ConstInt, TN: ConstInt, TK: ConstInt, GROUP_SIZE_M: ConstInt):
    """One (TM, TN) tile of C[batch] = (A[ba] @ B[bb].T) * A_scale[ba][:, None] * B_scale[bb][None, :]
    * alpha + bias. A (Ba, M, K), B (Bb, N, K) fp8; A_scale (Ba, M), B_scale (Bb, N) fp32."""
    M = C.shape[1]
    N = C.shape[2]
    batch, bm, bn = tile_coords(M, N, TM, TN, GROUP_SIZE_M)
    ba = batch % A.shape[0]
    bb = batch % B.shape[0]
    acc = ct.zeros((TM, TN), ct.float32)
    for kt in range(ct.cdiv(A.shape[2], TK)):
        a, b = _load_operands(A, B, ba, bb, bm, bn, kt, TM, TN, TK)
        acc = ct.mma(a, b, acc)
    sa = ct.load(A_scale, (ba, bm), (1, TM), padding_mode=_ZERO).reshape((TM, 1))
    sb = ct.load(B_scale, (bb, bn), (1, TN), padding_mode=_ZERO).reshape((1, TN))
    epilogue(acc * sa * sb, C, Alpha, Bias, batch, bm, bn, TM, TN)


@ct.kernel
def _fp8_blockwise_kernel(A, A_scale, B, B_scale, C, Alpha, Bias,
                          TM: ConstInt, GROUP_SIZE_M: ConstInt):
    """One (TM, 128) tile with DeepSeek-style block scales: A_scale (Ba, M, K/128) per 1x128 block,
    B_scale (Bb, cdiv(N, 128), K/128) per 128x128 block; K is a multiple of 128."""
    TN = FP8_BLOCK
    TK = FP8_BLOCK
    M = C.shape[1]
    N = C.shape[2]
    batch, bm, bn = tile_coords(M, N, TM, TN, GROUP_SIZE_M)
    ba = batch % A.shape[0]
    bb = batch % B.shape[0]
    acc = ct.zeros((TM, TN), ct.float32)
    for kt in range(A.shape[2] // TK):
        a, b = _load_operands(A, B, ba, bb, bm, bn, kt, TM, TN, TK)
        part = ct.mma(a, b, ct.zeros((TM, TN), ct.float32))
        sa = ct.load(A_scale, (ba, bm, kt), (1, TM, 1), padding_mode=_ZERO).reshape((TM, 1))
        sb = ct.load(B_scale, (bb, bn, kt), (1, 1, 1), padding_mode=_ZERO).reshape((1, 1))
        acc = acc + part * (sa * sb)
    epilogue(acc, C, Alpha, Bias, batch, bm, bn, TM, TN)


# --------------------------------------------------------------------------------------------------
# Configs
# --------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class FP8Config:
    """Output tile, K step, CTAs per cluster and GROUP_SIZE_M; ``targets`` lists the architectures
    the table offers it on. Blockwise configs have tile_n = tile_k = 128."""

    tile_m: int
    tile_n: int
    tile_k: int = 128
    num_ctas: int = 1
    group_size_m: int = 8
    targets: tuple[str, ...] = ("sm_100", "sm_120")

    @property
    def name(self) -> str:
        return (f"{self.tile_m}x{self.tile_n}x{self.tile_k}"
                + (f"_{self.num_ctas}cta" if self.num_ctas > 1 else ""))

    def hints(self) -> dict:
        # See blackwell_block_scaled.BlockScaledConfig.hints: sm_12x keeps the accumulator in registers.
        return {"num_ctas": self.num_ctas, "num_worker_warps": ct.ByTarget(sm_120=8, sm_121=8)}


_CONFIGS: dict[str, dict[str, dict[str, FP8Config]]] = {
    "sm_100": {
        "scaled": {"small": FP8Config(128, 128), "large": FP8Config(256, 256, num_ctas=2, targets=("sm_100",))},
        "blockwise": {"small": FP8Config(128, 128)},
    },
    "sm_120": {
        "scaled": {"small": FP8Config(128, 128)},
        "blockwise": {"small": FP8Config(128, 128)},
    },
}


def _kind(granularity: Granularity) -> str:
    return fp8_kind(granularity, "blackwell_fp8")


def plan(table: str, granularity: Granularity, batch: int, m: int, n: int,
         sms: int = DEFAULT_SM_COUNT) -> FP8Config:
    """The config of config table ``table`` (``table_for_capability``) for ``batch`` x (m, n) outputs:
    the large tile once every SM (pair) still gets a tile, else the small one."""
    configs = _CONFIGS[table][_kind(granularity)]
    large = configs.get("large")
    if large is not None and batch * ceil_div(m, large.tile_m) * ceil_div(n, large.tile_n) * large.num_ctas >= sms:
        return large
    return configs["small"]


def check_config(granularity: Granularity, cfg: FP8Config) -> None:
    """Raise ValueError unless ``cfg`` suits the kernel of ``granularity``."""
    for what, v in (("tile_m", cfg.tile_m), ("tile_n", cfg.tile_n), ("tile_k", cfg.tile_k)):
        if v < 16 or v & (v - 1):
            raise ValueError(f"blackwell_fp8: {what} must be a power of two >= 16, got {v} in {cfg}")
    if _kind(granularity) == "blockwise" and (cfg.tile_n, cfg.tile_k) != (FP8_BLOCK, FP8_BLOCK):
        raise ValueError(f"blackwell_fp8: blockwise configs need tile_n = tile_k = {FP8_BLOCK} (one scale "
                         f"block per tile and K step), got {cfg.tile_n}x{cfg.tile_k}")
    if cfg.num_ctas not in (1, 2) or (cfg.num_ctas == 2 and cfg.tile_m != 256):
        raise ValueError(f"blackwell_fp8: num_ctas must be 1, or 2 with tile_m = 256, got "
                         f"num_ctas={cfg.num_ctas}, tile_m={cfg.tile_m}")


# --------------------------------------------------------------------------------------------------
# Launch
# --------------------------------------------------------------------------------------------------

_KERNELS = {"scaled": _fp8_scaled_kernel, "blockwise": _fp8_blockwise_kernel}


def _constants(kind: str, cfg: FP8Config) -> tuple:
    if kind == "blockwise":
        return (cfg.tile_m, cfg.group_size_m)
    return (cfg.tile_m, cfg.tile_n, cfg.tile_k, cfg.group_size_m)


class Prepared:
    """One FP8 matmul signature on a Blackwell GPU, planned once: ``run`` launches it for any problem
    of that signature.

    ``config`` (``plan``'s choice when None), the hinted ``kernel``, and the launches of the problem it
    was made from: ``launches`` holds (grid, args) per launch, one unless an operand has 2^31 elements
    or more (``_large``: one per piece of the output), ``grid`` and ``args`` being the first.
    ``table`` and ``sms`` default to the problem's GPU; given, no GPU is needed (CPU tensors give
    the same launches). Operands of 2^31 elements and more are prepared again on every call (their
    pieces are views of the call's tensors)."""

    __slots__ = ("config", "kernel", "grid", "args", "launches", "table", "sms", "consts", "direct", "n")

    def __init__(self, problem, config: FP8Config | None = None, *, table: str | None = None,
                 sms: int | None = None):
        kind = _kind(problem.granularity)
        out = problem.out
        device = out.device
        self.table = table_for_capability(capability(device)) if table is None else table
        self.sms = (num_sms(device) if table is None else DEFAULT_SM_COUNT) if sms is None else sms
        batch, m, n = out.shape
        a, b = problem.a, problem.b
        if a.shape[0] not in (1, batch) or b.shape[0] not in (1, batch):
            raise ValueError(f"blackwell_fp8: a and b batch sizes must be 1 or {batch}, got {a.shape[0]} and "
                             f"{b.shape[0]}")
        if kind == "blockwise" and a.shape[2] % FP8_BLOCK:
            raise ValueError(f"blackwell_fp8: blockwise scaling needs K to be a multiple of {FP8_BLOCK}, got "
                             f"K={a.shape[2]}")
        cfg = self.config = config or plan(self.table, problem.granularity, batch, m, n, self.sms)
        check_config(problem.granularity, cfg)
        # Scales are tiny (M + N floats, or (M + N/128) * K/128): materialise the broadcast per-tensor
        # views and any transposed block-scale views.
        a_scale = problem.a_scale.contiguous()
        b_scale = problem.b_scale.contiguous()
        alpha = ones_scalar(device) if problem.alpha is None else problem.alpha.reshape(1)
        bias = zeros_vector(device, n) if problem.bias is None else problem.bias
        self.kernel = hinted(_KERNELS[kind], **cfg.hints())
        self.consts = _constants(kind, cfg)
        # Operands of 2^31 elements and more: one launch per piece of the output along M and N
        # (``_large``), each tile computed as in one launch; N cuts fall on 128-row scale blocks.
        lg = _large
        per = FP8_BLOCK if kind == "blockwise" else 1
        operands = lg.matmul_operands(a, a_scale, b, b_scale, out, alpha, bias, batch, b_per=per)
        launches = []
        for views in lg.split("fp8_matmul", lg.matmul_axes(batch, m, n, cfg.tile_m, math.lcm(cfg.tile_n, per)),
                              operands):
            pb, pm, pn = views[4].shape
            launches.append(((pb * ceil_div(pm, cfg.tile_m) * ceil_div(pn, cfg.tile_n), 1, 1),
                             (*views, *self.consts)))
        self.launches = tuple(launches)
        self.grid, self.args = launches[0]
        self.direct = len(launches) == 1
        self.n = n

    def operands(self, problem):
        """(a, a_scale, b, b_scale) as the kernel reads them: the scales contiguous (a broadcast
        per-tensor scale or a transposed block-scale view is copied, which keeps such a signature's
        repeated calls on the planned path: ``tilemm.matmul`` keeps only launches of views)."""
        return problem.a, problem.a_scale.contiguous(), problem.b, problem.b_scale.contiguous()

    def launch(self, stream, a, a_scale, b, b_scale, out, alpha, bias) -> None:
        """The launch of a ``direct`` signature for its kernel operands (``operands``; out (B, M, N),
        alpha (1,) fp32, bias (N,) fp32) on raw stream ``stream``."""
        launch_all_on(out.device, ct.launch, stream, self.kernel,
                      ((self.grid, (a, a_scale, b, b_scale, out, alpha, bias, *self.consts)),))

    def run(self, problem, stream) -> None:
        """Launch for ``problem`` (an ``FP8Problem`` of this signature) on raw stream ``stream``."""
        device = problem.out.device
        if not self.direct:
            launches = Prepared(problem, self.config, table=self.table, sms=self.sms).launches
        else:
            # Scales are tiny (M + N floats, or (M + N/128) * K/128): materialise broadcast views.
            alpha = ones_scalar(device) if problem.alpha is None else problem.alpha.reshape(1)
            bias = zeros_vector(device, self.n) if problem.bias is None else problem.bias
            launches = ((self.grid, (problem.a, problem.a_scale.contiguous(), problem.b,
                                     problem.b_scale.contiguous(), problem.out, alpha, bias, *self.consts)),)
        launch_all_on(device, ct.launch, stream, self.kernel, launches)


def launch(problem, config: FP8Config | None = None) -> None:
    """Run a ``tilemm.matmul.FP8Problem`` on a Blackwell GPU, writing ``problem.out``.

    ``config`` overrides ``plan``'s choice (for tuning and benchmarks). ``problem.use_fast_accum`` has
    no effect here (see the module docstring)."""
    Prepared(problem, config).run(problem, stream_handle(problem.out.device))


# --------------------------------------------------------------------------------------------------
# Ahead-of-time specialisations
# --------------------------------------------------------------------------------------------------

_OUT_DTYPES = {"bf16": ct.bfloat16, "fp16": ct.float16, "fp32": ct.float32}
_DATA_DTYPES = {"e4m3": ct.float8_e4m3fn, "e5m2": ct.float8_e5m2}


def aot_variants() -> list[AotVariant]:
    """Every (kernel, element dtype, output dtype, config) ``launch`` can pick, with its targets."""
    variants = []
    for kind, kernel in _KERNELS.items():
        sdim = 3 if kind == "blockwise" else 2
        elements = ("e4m3",) if kind == "blockwise" else ("e4m3", "e5m2")
        # One entry per distinct config, with the union of the targets that offer it.
        configs: dict[FP8Config, set[str]] = {}
        for table in _CONFIGS.values():
            for cfg in table[kind].values():
                configs.setdefault(cfg, set()).update(cfg.targets)
        for elem in elements:
            data = _DATA_DTYPES[elem]
            for out_name, out_dtype in _OUT_DTYPES.items():
                for cfg in sorted(configs, key=lambda c: c.name):
                    params = [launch_array(data, 3), launch_array(ct.float32, sdim), launch_array(data, 3),
                              launch_array(ct.float32, sdim), launch_array(out_dtype, 3),
                              launch_array(ct.float32, 1), launch_array(ct.float32, 1),
                              *_constants(kind, cfg)]
                    name = f"blackwell_fp8_{kind}_{elem}_{out_name}_{cfg.name}"
                    variants.append(AotVariant(name, hinted(kernel, **cfg.hints()), params,
                                               targets=tuple(sorted(configs[cfg]))))
    return variants
