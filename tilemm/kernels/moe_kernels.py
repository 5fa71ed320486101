"""Grouped weight-only matmul for mixture-of-experts layers: every token's top-k expert products in
one cuTile launch, each expert's prepacked MXFP4 / NVFP4 / MXFP8 weight decoded with the weight-only
kernel's helpers (``weight_only_kernels._k_tile``: same layout, same exact decode, same bf16 MMA with
the weight on the left), on Hopper (sm_90) and Blackwell (sm_100 / sm_120).

What it computes: ``out[t * k + j] = (x[t] @ dequantize(W[ids[t, j]]).T) * alpha[e] + bias[e]``,
accumulated in fp32 and rounded once to out's dtype, for x (T, K), stacked weights W (E, N, K) and
``ids`` (T, k).

Routing (``route``) runs on the GPU as a few PyTorch operations of fixed size, without a host
synchronisation and without any allocation whose size depends on the routing (so a call can be
captured in a CUDA graph):

* the T * k (token, slot) pairs are sorted by expert id (stable ``argsort``): ``order``;
* ``offsets`` (E + 2): where each expert's run starts in ``order`` (``searchsorted``), the last
  entry T * k; ids outside [0, E) are sorted as the extra "expert" E;
* ``slot_expert`` (S = min(T * k, E + 1)): the distinct experts in ascending order, -1 past the
  last. S bounds the number of distinct experts whatever the routing.

The kernel's grid is S * cdiv(N, TN) blocks, fixed by T, k, E and N: block (slot, bn) takes expert
``slot_expert[slot]``'s tokens in chunks of TM, gathers their x rows (``ct.gather``), runs the K loop
of the weight-only kernel on its TN weight rows, and scatters the TM output rows to their (token,
slot) rows (``ct.scatter``). A block whose slot holds no expert does nothing, so an expert's weight
tile is read once per chunk of TM of its tokens: once per call while an expert has at most TM
tokens (decode), and re-read from L2 for every further chunk. The rows of ids outside [0, E) (the
extra expert) are written as NaN: no weight is read for them, never another expert's.

Alternatives not taken, worth measuring: one block per (expert, N tile) for every expert (grid E *
cdiv(N, TN); the empty ones exit at once; simpler routing, more blocks at small T); a K split for
few active experts (one partial buffer of fixed size T * k * N); the FMA kernel (``_gemv_kernel``'s
scheme) for one token per expert; a sorted-token grouped GEMM over padded TM-row tiles (vLLM's
``moe_align_block_size`` scheme), better balanced under skewed routing at large T.
"""

from __future__ import annotations

import dataclasses

import cuda.tile as ct
import torch

from ._aot import AotVariant, array
from ._common import hinted, sm90_hints
from .weight_only_kernels import LAYOUTS, Layout, _X_PARTS, _k_tile

__all__ = ["MoEConfig", "plan", "route", "launch", "aot_variants"]

ConstInt = ct.Constant[int]

_ZERO = ct.PaddingMode.ZERO


@ct.kernel(num_worker_warps=ct.ByTarget(sm_90=4))
def _moe_kernel(X, W, S, Out, Consts, Mult, Bias, Order, Offsets, SlotExpert,
                ELEMENT: ConstInt, SCALE_E8M0: ConstInt, BLOCK: ConstInt, PLANES: ConstInt,
                GROUP: ConstInt, TM: ConstInt, TN: ConstInt, X_PARTS: ConstInt, CAT: ConstInt):
    """Block (slot, bn): Out rows of expert SlotExpert[slot]'s tokens, columns bn * TN ..

    X (T, K) activations; W (E, N, k_tiles * WORDS) int32 and S (E, K / BLOCK, N) uint8: the stacked
    prepacked weights; Out (T * k, N) (k = Out rows / X rows, the slots per token); Consts (E, 2) fp32 (column 0: each expert's epilogue
    factor alpha); Mult (1,) fp32: 2^(OFFSET - E), shared; Bias (E, N) fp32; Order (T * k,)
    int32: (token, slot) rows t * k + j sorted by expert; Offsets (E + 2,) int32; SlotExpert
    (S,) int32 (see the module docstring). Grid: S * cdiv(N, TN), N tiles fastest.
    """
    N = Out.shape[1]
    ROWS = Out.shape[0]
    top_k = ROWS // X.shape[0]
    NUM_E = W.shape[0]
    WORDS = GROUP * BLOCK // 2
    TK = PLANES * GROUP * BLOCK
    SC = PLANES * GROUP
    num_n = ct.cdiv(N, TN)
    pid = ct.bid(0)
    bn = pid % num_n
    slot = pid // num_n
    e = ct.load(SlotExpert, (slot,), ())
    if e >= 0:
        start = ct.load(Offsets, (e,), ())
        end = ct.load(Offsets, (e + 1,), ())
        cols = (bn * TN + ct.arange(TN, dtype=ct.int32)).reshape((1, TN))
        chunks = ct.cdiv(end - start, TM)
        if e < NUM_E:
            k_tiles = ct.cdiv(X.shape[1], TK)
            alpha = ct.load(Consts, (e, 0), (1, 1))
            bias = ct.load(Bias, (e, bn), (1, TN), padding_mode=_ZERO)
            for c in range(chunks):
                pos = start + c * TM + ct.arange(TM, dtype=ct.int32)
                # Rows past the expert's run get the index ROWS: out of bounds, so their x rows load
                # as zeros and their stores are dropped.
                rows = ct.gather(Order, pos, mask=pos < end, padding_value=ROWS)
                tokens = (rows // top_k).reshape((TM, 1))
                acc = ct.zeros((TN, TM), ct.float32)
                for kt in range(k_tiles):
                    w = ct.bitcast(ct.load(W, (e, bn, kt), (1, TN, WORDS), padding_mode=_ZERO), ct.uint32)
                    s_raw = ct.load(S, (e, kt, bn), (1, SC, TN), padding_mode=_ZERO).reshape((SC, TN))
                    kcols = (kt * TK + ct.arange(TK, dtype=ct.int32)).reshape((1, TK))
                    x = ct.gather(X, (tokens, kcols))
                    acc = _k_tile(w.reshape((TN, WORDS)), s_raw.transpose(), Mult, x, acc, ELEMENT,
                                  SCALE_E8M0, BLOCK, PLANES, GROUP, TN, TM, X_PARTS, CAT)
                out = acc.transpose() * alpha + bias
                ct.scatter(Out, (rows.reshape((TM, 1)), cols), out.astype(Out.dtype))
        else:
            # Ids outside [0, E): NaN rows, no weight read.
            nan = ct.full((TM, TN), float("nan"), Out.dtype)
            for c in range(chunks):
                pos = start + c * TM + ct.arange(TM, dtype=ct.int32)
                rows = ct.gather(Order, pos, mask=pos < end, padding_value=ROWS)
                ct.scatter(Out, (rows.reshape((TM, 1)), cols), nan)


# --------------------------------------------------------------------------------------------------
# Routing, configs and launch
# --------------------------------------------------------------------------------------------------

def route(topk_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(order, offsets, slot_expert) int32 for ``topk_ids`` (T, k) (see the module docstring); fixed
    sizes T * k, E + 2 and min(T * k, E + 1); no host synchronisation."""
    flat = topk_ids.reshape(-1).to(torch.int64)
    rows = flat.numel()
    key = torch.where((flat < 0) | (flat >= num_experts), torch.full_like(flat, num_experts), flat)
    order = torch.argsort(key, stable=True)
    sorted_key = key[order]
    bounds = torch.arange(num_experts + 2, device=flat.device, dtype=torch.int64)
    offsets = torch.searchsorted(sorted_key, bounds)
    # Distinct experts in ascending order: the slot of sorted position i is the number of run starts
    # up to i, less one; every position of a run writes the same expert into its slot.
    starts = torch.ones_like(sorted_key)
    starts[1:] = (sorted_key[1:] != sorted_key[:-1]).to(torch.int64)
    slot_of = torch.cumsum(starts, 0) - 1
    slot_expert = torch.full((min(rows, num_experts + 1),), -1, dtype=torch.int64, device=flat.device)
    slot_expert.scatter_(0, slot_of, sorted_key)
    return order.to(torch.int32), offsets.to(torch.int32), slot_expert.to(torch.int32)


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """tile_m (tokens per chunk), tile_n (weight rows per block), cat (one MMA per K tile) and the
    compiler hints."""

    tile_m: int
    tile_n: int = 64
    num_worker_warps: int = 4
    occupancy: int | None = None
    cat: int = 0

    @property
    def kernel(self):
        return hinted(_moe_kernel, **sm90_hints(self.num_worker_warps, self.occupancy))

    @property
    def name(self) -> str:
        s = f"moe_{self.tile_m}x{self.tile_n}_w{self.num_worker_warps}"
        return s + (f"_occ{self.occupancy}" if self.occupancy else "") + ("_cat" if self.cat else "")


#: Per tile_m: the block shape of the weight-only kernel's unsplit configs (one warpgroup on 64 weight
#: rows; at tile_m 16 the planes concatenated into one MMA per K tile, occupancy 3 for 4-bit weights,
#: 2 for 8-bit; tile_m 128 two warpgroups on 128 rows).
_TILE_M = (16, 32, 64, 128)


def _config(tile_m: int, layout: Layout) -> MoEConfig:
    if tile_m == 16:
        return MoEConfig(16, 64, 4, 3 if layout.planes == 4 else 2, cat=1)
    if tile_m == 32:
        return MoEConfig(32, 64, 4, 4)
    if tile_m == 64:
        return MoEConfig(64, 64, 4, 2)
    return MoEConfig(128, 128, 8, None)


def plan(tokens: int, top_k: int, num_experts: int, layout: Layout) -> MoEConfig:
    """The config for T = ``tokens``: tile_m the smallest of 16, 32, 64, 128 that covers the mean
    number of tokens per active expert, T * k / min(T * k, E) (a balanced routing then takes one
    chunk per expert)."""
    pairs = tokens * top_k
    mean = -(-pairs // max(1, min(pairs, num_experts)))
    tile_m = next((t for t in _TILE_M if t >= mean), _TILE_M[-1])
    return _config(tile_m, layout)


def launch(x: torch.Tensor, words: torch.Tensor, scale_t: torch.Tensor, constants: torch.Tensor,
           bias: torch.Tensor, topk_ids: torch.Tensor, out: torch.Tensor, layout: Layout,
           cfg: MoEConfig | None = None) -> None:
    """out (T * k, N) = the expert products of x (T, K) for ``topk_ids`` (T, k); ``bias`` (E, N) fp32
    (zeros for none); ``constants`` the stacked PackedWeight's (E, 2)."""
    tokens, top_k = topk_ids.shape
    num_experts, n = words.shape[0], words.shape[1]
    cfg = cfg or plan(tokens, top_k, num_experts, layout)
    order, offsets, slot_expert = route(topk_ids, num_experts)
    grid = (slot_expert.shape[0] * -(-n // cfg.tile_n), 1, 1)
    stream = torch.cuda.current_stream(out.device)
    ct.launch(stream, grid, cfg.kernel,
              (x, words, scale_t, out, constants, constants[0, 1:2], bias, order, offsets, slot_expert,
               *_constants(layout, cfg, _X_PARTS[x.dtype])))


def _constants(layout: Layout, cfg: MoEConfig, x_parts: int) -> tuple:
    return (layout.element, int(layout.scale == "e8m0"), layout.block, layout.planes, layout.group,
            cfg.tile_m, cfg.tile_n, x_parts, cfg.cat)


# --------------------------------------------------------------------------------------------------
# Ahead-of-time specialisations
# --------------------------------------------------------------------------------------------------

_CT_DTYPES = {torch.bfloat16: ct.bfloat16, torch.float16: ct.float16}


def aot_variants(full: bool = True) -> list[AotVariant]:
    """The grouped kernel per (layout, activation dtype, config), for sm_90, sm_100 and sm_120 (bf16
    ``ct.mma`` and integer operations only). ``full=False`` keeps tile_m 16 and 64 (one per code
    path: one MMA per K tile or one per plane). ``Consts`` (E, 2) and ``Mult`` (a view at byte 4 of
    it) are passed as the launcher passes them: strides and base not 16-byte aligned."""
    variants = []
    for name, layout in LAYOUTS.items():
        configs = [_config(t, layout) for t in (_TILE_M if full else (16, 64))]
        for x_dtype, x_ct in _CT_DTYPES.items():
            for cfg in configs:
                params = [array(x_ct, 2), array(ct.int32, 3), array(ct.uint8, 3), array(x_ct, 2),
                          array(ct.float32, 2, aligned=False), array(ct.float32, 1, aligned=False),
                          array(ct.float32, 2), array(ct.int32, 1), array(ct.int32, 1), array(ct.int32, 1),
                          *_constants(layout, cfg, _X_PARTS[x_dtype])]
                variants.append(AotVariant(f"moe_{name}_{x_ct.name}_{cfg.name}", cfg.kernel, params))
    return variants
