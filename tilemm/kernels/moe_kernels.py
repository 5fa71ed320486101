"""Grouped weight-only matmul for mixture-of-experts layers: every token's top-k expert products,
``out[t * k + j] = (x[t] @ dequantize(W[ids[t, j]]).T) * alpha[e] + bias[e]`` (fp32 sums, one
rounding), on stacked prepacked MXFP4 / NVFP4 / MXFP8 weights (E, N, K), decoded with the weight-only
kernel's helpers (``weight_only_kernels``: the same words and exact decode; the scale bytes transposed,
(E, K / B, N), for NVFP4 too, whose single weights keep theirs row-major); sm_90 / sm_100 / sm_120.

Two designs (``benchmarks/bench_moe.py`` times both).

``plan`` chooses for a call: the design, its block or tile, and whether the down projection sums the
slots in its epilogue (``MoEPlan``).

* per pair (``_moe_gemv_kernel``, a few tokens: ``_pairs_pay``): no routing; block ((token, slot),
  16 weight rows) multiplies on the FMA pipes; one token's k experts are distinct, so each weight
  is read once per token. The down projection may sum the k slots in its epilogue (``_combine_pays``),
  a block then running its token's pairs two at a time, both pairs' loads together
  (``PairsConfig.slots``).
* sorted (``_moe_kernel``): ``route`` gives the (token, slot) rows sorted by expert (``order``),
  each expert's run (``offsets``, E + 2; ids outside [0, E) are the extra expert E) and the slots
  (``slot_expert``: every expert with rows, busiest first); x's rows are gathered once into that
  order (``sort_rows``) so the K loop loads row ranges, and gate_up writes its rows in that order for
  down to read. Work item (slot, chunk group, N tile) runs the K loop of the weight-only MMA kernel
  on TM-row chunks of its expert's tokens; a persistent grid (``grid_blocks``) loops over the items,
  so that empty slots (most of them under skewed routing) cost a few loads, not a block. An expert's
  weight tile is read once per chunk.

No host synchronisation and no allocation whose size depends on the routing: a call can be captured
in a CUDA graph. Rows of ids outside [0, E) come out NaN, no weight read for them (a combining block
of two pairs per step loads expert 0's tiles in their place and discards the product). ACT = 1 fuses
gpt-oss's clamped SwiGLU of interleaved (gate, up) rows into gate_up's epilogue, ACT = 2 the SiLU
gating ``silu(gate) * up`` of Qwen-MoE / Mixtral experts stored the same way (``tilemm.moe``
interleaves their gate / up halves once when it builds or loads them).
"""

from __future__ import annotations

import dataclasses
import functools

import cuda.tile as ct
import torch

import cuda.tile.compilation as cc

from ..numerics import ceil_div
from ._aot import AotVariant, array
from ._common import hinted, num_sms, sm90_hints, stream_handle
from .weight_only_kernels import LAYOUTS, Layout, _X_PARTS, _f32_halves, _k_tile, _multipliers, _scaled_plane

__all__ = ["MoEPlan", "plan", "MoEConfig", "PairsConfig", "route", "launch", "sort_rows", "launch_pairs",
           "PreparedPairs", "grid_blocks", "route_kernel_fits", "expert_bytes", "PAIRS_MAX_BYTES", "zero_bias",
           "aot_variants", "SWIGLU_ALPHA", "SWIGLU_LIMIT", "ACT_NONE", "ACT_GPT_OSS", "ACT_SILU"]

ConstInt = ct.Constant[int]

_ZERO = ct.PaddingMode.ZERO
_INT32 = cc.ScalarConstraint(ct.int32)


#: gpt-oss's clamped SwiGLU, fused into the gate_up projection's epilogue with ACT = 1.
SWIGLU_ALPHA = 1.702
SWIGLU_LIMIT = 7.0


#: The fused epilogues (the kernels' ACT): none, gpt-oss's clamped SwiGLU, SiLU gating.
ACT_NONE, ACT_GPT_OSS, ACT_SILU = 0, 1, 2


def _silu_glu(gate, up):
    """silu(gate) * up = gate / (exp(-gate) + 1) * up in fp32, each operation rounded to fp32 in this
    order (``tilemm.moe.silu_glu`` computes the same operations; exp is the one that the hardware
    rounds within a few ulp of the exact value)."""
    return gate / (ct.exp(gate * -1.0) + 1.0) * up


def _gpt_oss_glu(gate, up):
    """(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g), g = min(gate, limit), in fp32."""
    g = ct.minimum(gate, SWIGLU_LIMIT)
    u = ct.maximum(ct.minimum(up, SWIGLU_LIMIT), -SWIGLU_LIMIT)
    return (u + 1.0) * (g / (ct.exp(g * -SWIGLU_ALPHA) + 1.0))


@ct.kernel(num_worker_warps=ct.ByTarget(sm_90=4))
def _moe_kernel(X, W, S, Out, Consts, Mult, Bias, Order, Offsets, SlotExpert, Longest, Groups,
                ELEMENT: ConstInt, SCALE_MODE: ConstInt, BLOCK: ConstInt, PLANES: ConstInt,
                GROUP: ConstInt, TM: ConstInt, TN: ConstInt, X_PARTS: ConstInt, CAT: ConstInt,
                ACT: ConstInt, SORTED_OUT: ConstInt, UNROLL: ConstInt):
    """Work items (slot, g, bn): the Out rows of expert SlotExpert[slot]'s tokens, weight rows bn * TN ..

    X (T * k, K): the activation rows in the sorted order (expert e's tokens are rows Offsets[e] ..
    Offsets[e + 1], loaded as a row range); W (E, N, k_tiles * WORDS) int32 and S (E, K / BLOCK, N)
    uint8: the stacked prepacked weights, UNROLL K tiles per load; Out (T * k, N), or with ACT = 1 or 2
    (T * k, N / 2): rows in the sorted order (SORTED_OUT = 1) or the (token, slot) rows; Consts (E, 2)
    fp32 (column 0: each expert's epilogue factor alpha); Mult (1,) fp32: 2^(OFFSET - E), shared;
    Bias (E, N) fp32; Order (T * k,) int64: the (token, slot) rows t * k + j sorted by expert;
    Offsets (E + 2,) int64; SlotExpert (S,) int64; Longest (1,) int64: the longest run (see the
    module docstring); Groups (int32): the most chunk groups G the launcher allows.

    Items: G * S * cdiv(N, TN), N tiles fastest, then slots, then G chunk groups: item (g, slot, bn)
    takes chunks g, g + G, .. of its expert's tokens, G = min(Groups, the busiest expert's chunks)
    (a popular expert's chunks then spread over G items instead of running one after another in
    one; G = 1 when every expert has at most TM rows). The slots come busiest first, so in each
    chunk group the items with rows are a prefix. Block b runs items b, b + blocks, ..: a persistent
    grid (``grid_blocks``) spreads each prefix evenly over the blocks, and an item without rows costs
    a few scalar loads instead of a block.

    ACT = 1 and 2: the weight rows are interleaved gate (even) and up (odd) rows; each product is
    rounded to Out's dtype as without ACT, then the gating of the pair in fp32 (ACT = 1:
    ``_gpt_oss_glu``, ACT = 2: ``_silu_glu``), rounded once into column n / 2 of Out.
    """
    num_n = ct.cdiv(W.shape[1], TN)
    # G: at most Groups, and no more than the busiest expert's chunks (Longest: its rows), so that no
    # chunk group is past every expert's chunks (a uniform routing at large T needs G = 1 or 2).
    groups = ct.minimum(ct.cdiv(ct.load(Longest, (0,), ()), TM), Groups)
    band = SlotExpert.shape[0] * num_n  # the items of one chunk group
    for item in range(ct.bid(0), band * groups, ct.num_blocks(0)):
        rem = item % band
        _moe_item(X, W, S, Out, Consts, Mult, Bias, Order, Offsets, SlotExpert, rem % num_n, item // band,
                  rem // num_n, groups, ELEMENT, SCALE_MODE, BLOCK, PLANES, GROUP, TM, TN, X_PARTS, CAT, ACT,
                  SORTED_OUT, UNROLL)


def _moe_item(X, W, S, Out, Consts, Mult, Bias, Order, Offsets, SlotExpert, bn, group, slot, groups,
              ELEMENT, SCALE_MODE, BLOCK, PLANES, GROUP, TM, TN, X_PARTS, CAT, ACT, SORTED_OUT, UNROLL):
    """Work item (slot, group, bn) of ``_moe_kernel``: chunks group, group + groups, .. of expert
    SlotExpert[slot]'s tokens times weight rows bn * TN .. (nothing when the expert has no such chunk)."""
    ROWS = Out.shape[0]
    NUM_E = W.shape[0]
    WORDS = GROUP * BLOCK // 2
    TK = PLANES * GROUP * BLOCK
    SC = PLANES * GROUP
    TO = TN // 2 if ACT != 0 else TN  # output columns per block
    e = ct.load(SlotExpert, (slot,), ())
    if e >= 0:
        start = ct.load(Offsets, (e,), ())
        end = ct.load(Offsets, (e + 1,), ())
        cols = (bn * TO + ct.arange(TO, dtype=ct.int32)).reshape((1, TO))
        chunks = ct.cdiv(end - start, TM)
        if e < NUM_E:
            if group < chunks:
                k_tiles = ct.cdiv(X.shape[1], TK)
                alpha = ct.load(Consts, (e, 0), (1, 1))
                bias = ct.load(Bias, (e, bn), (1, TN), padding_mode=_ZERO)
                for c in range(group, chunks, groups):
                    first = start + c * TM
                    pos = first + ct.arange(TM, dtype=ct.int64)
                    # Rows past the expert's run get the index ROWS: out of bounds, so their stores are
                    # dropped; its x rows are the slice's rows first .. end (sorted), zero past end.
                    xs = X.slice(0, first, end)
                    acc = ct.zeros((TN, TM), ct.float32)
                    for kg in range(ct.cdiv(k_tiles, UNROLL)):  # UNROLL K tiles per load
                        ws = ct.bitcast(ct.load(W, (e, bn, kg), (1, TN, UNROLL * WORDS), padding_mode=_ZERO),
                                        ct.uint32).reshape((TN, UNROLL * WORDS))
                        ss = ct.load(S, (e, kg, bn), (1, UNROLL * SC, TN),
                                     padding_mode=_ZERO).reshape((UNROLL * SC, TN))
                        xk = ct.load(xs, (0, kg), (TM, UNROLL * TK), padding_mode=_ZERO)
                        for u in ct.static_iter(range(UNROLL)):
                            acc = _k_tile(ct.extract(ws, (0, u), (TN, WORDS)),
                                          ct.extract(ss, (u, 0), (SC, TN)).transpose(), Mult,
                                          ct.extract(xk, (0, u), (TM, TK)), acc, ELEMENT, SCALE_MODE, BLOCK, PLANES,
                                          GROUP, TN, TM, X_PARTS, CAT)
                    out = (acc.transpose() * alpha + bias).astype(Out.dtype)
                    if ACT != 0:
                        out = _glu_pairs(out, TM, TO, Out.dtype, ACT)
                    if SORTED_OUT == 1:
                        ct.store(Out.slice(0, first, end), (0, bn), out)
                    else:
                        rows = ct.gather(Order, pos, mask=pos < end, padding_value=ROWS)
                        ct.scatter(Out, (rows.reshape((TM, 1)), cols), out)
        else:
            # Ids outside [0, E): NaN rows, no weight read.
            nan = ct.full((TM, TO), float("nan"), Out.dtype)
            for c in range(group, chunks, groups):
                first = start + c * TM
                if SORTED_OUT == 1:
                    ct.store(Out.slice(0, first, end), (0, bn), nan)
                else:
                    pos = first + ct.arange(TM, dtype=ct.int64)
                    rows = ct.gather(Order, pos, mask=pos < end, padding_value=ROWS)
                    ct.scatter(Out, (rows.reshape((TM, 1)), cols), nan)


def _glu_pairs(out, TM, TO, dtype, ACT):
    """The gating of interleaved (gate, up) columns of a (TM, 2 * TO) tile (ACT = 1: gpt-oss's SwiGLU,
    ACT = 2: SiLU), in fp32 from the tile's values, rounded to ``dtype``."""
    pairs = out.astype(ct.float32).reshape((TM, TO, 2))
    gate = ct.extract(pairs, (0, 0, 0), (TM, TO, 1)).reshape((TM, TO))
    up = ct.extract(pairs, (0, 0, 1), (TM, TO, 1)).reshape((TM, TO))
    if ACT == 2:
        h = _silu_glu(gate, up)
    else:
        h = _gpt_oss_glu(gate, up)
    return h.astype(dtype)


def _pair_step(ws, ss, xs, Mult, acc_lo, acc_hi, ELEMENT, SCALE_MODE, BLOCK, PLANES, GROUP, TN, UNROLL):
    """One load of a pair's product (``_gemv_kernel``'s scheme): the decoded planes of ws (TN, UNROLL *
    WORDS) as fp32 halves times x's (xs (1, UNROLL * TK)), into the two fp32 accumulators."""
    WORDS = GROUP * BLOCK // 2
    TP = GROUP * BLOCK
    SC = PLANES * GROUP
    for u in ct.static_iter(range(UNROLL)):
        w = ct.extract(ws, (0, u), (TN, WORDS))
        mult = _multipliers(ct.extract(ss, (u, 0), (SC, TN)).transpose(), Mult, SCALE_MODE)
        mult = mult.reshape((TN, PLANES, GROUP, 1))
        for q in ct.static_iter(range(PLANES)):
            w_lo, w_hi = _f32_halves(_scaled_plane(w, mult, q, ELEMENT, BLOCK, GROUP, TN), TN, TP, True)
            x_lo, x_hi = _f32_halves(ct.extract(xs, (0, u * PLANES + q), (1, TP)), 1, TP, xs.dtype == ct.bfloat16)
            acc_lo = acc_lo + w_lo.reshape((1, TN, TP // 2)) * x_lo.reshape((1, 1, TP // 2))
            acc_hi = acc_hi + w_hi.reshape((1, TN, TP // 2)) * x_hi.reshape((1, 1, TP // 2))
    return acc_lo, acc_hi


def _pair_load(X, W, S, e, x_row, bn, g, TN, UNROLL, WORDS, SC, TK):
    """Load g of a pair: expert e's weight words (TN, UNROLL * WORDS) and scale bytes (UNROLL * SC,
    TN) for weight rows bn * TN .., and x row x_row (1, UNROLL * TK)."""
    ws = ct.bitcast(ct.load(W, (e, bn, g), (1, TN, UNROLL * WORDS), padding_mode=_ZERO), ct.uint32)
    ss = ct.load(S, (e, g, bn), (1, UNROLL * SC, TN), padding_mode=_ZERO).reshape((UNROLL * SC, TN))
    xs = ct.load(X, (x_row, g), (1, UNROLL * TK), padding_mode=_ZERO)
    return ws.reshape((TN, UNROLL * WORDS)), ss, xs


def _pair_out(acc_lo, acc_hi, Consts, Bias, e, bn, dtype, TN, ACT):
    """A pair's (1, TO) output: the accumulators reduced over K, times alpha, plus bias, rounded, and
    with ACT = 1 or 2 gated (``_glu_pairs``)."""
    TO = TN // 2 if ACT != 0 else TN
    alpha = ct.load(Consts, (e, 0), (1, 1))
    bias = ct.load(Bias, (e, bn), (1, TN), padding_mode=_ZERO)
    y = (ct.sum(acc_lo + acc_hi, axis=2) * alpha + bias).astype(dtype)
    return _glu_pairs(y, 1, TO, dtype, ACT) if ACT != 0 else y


def _pair_row(X, W, S, Consts, Mult, Bias, Ids, p, bn, dtype, ELEMENT, SCALE_MODE, BLOCK, PLANES, GROUP, TN,
              UNROLL, ACT):
    """(1, TO) in ``dtype``: (token, slot) pair p's product with weight rows bn * TN .. of its expert
    Ids[p], on the FMA pipes (``_gemv_kernel``'s scheme: decoded planes as fp32 halves times x's, two
    fp32 accumulators, one reduction over K at the end), then alpha, bias, rounding, and with ACT = 1
    or 2 the gating of interleaved (gate, up) rows (``_glu_pairs``); NaN for an id outside [0, E) (no
    weight read). Its x row: X row p // (pairs / X rows) (the token for the gate_up projection's (T, K)
    x, the pair itself for the down projection's (T * k, I) input)."""
    WORDS = GROUP * BLOCK // 2
    TP = GROUP * BLOCK
    TK = PLANES * TP
    SC = PLANES * GROUP
    TO = TN // 2 if ACT != 0 else TN
    out = ct.full((1, TO), float("nan"), dtype)
    e = ct.load(Ids, (p,), ())
    if e >= 0:
        if e < W.shape[0]:
            x_row = p // (Ids.shape[0] // X.shape[0])
            groups = ct.cdiv(ct.cdiv(X.shape[1], TK), UNROLL)
            acc_lo = ct.zeros((1, TN, TP // 2), ct.float32)
            acc_hi = ct.zeros((1, TN, TP // 2), ct.float32)
            for g in range(groups):
                ws, ss, xs = _pair_load(X, W, S, e, x_row, bn, g, TN, UNROLL, WORDS, SC, TK)
                acc_lo, acc_hi = _pair_step(ws, ss, xs, Mult, acc_lo, acc_hi, ELEMENT, SCALE_MODE, BLOCK, PLANES,
                                            GROUP, TN, UNROLL)
            out = _pair_out(acc_lo, acc_hi, Consts, Bias, e, bn, dtype, TN, ACT)
    return out


def _pair_rows2(X, W, S, Consts, Mult, Bias, Ids, p, bn, dtype, ELEMENT, SCALE_MODE, BLOCK, PLANES, GROUP, TN,
                UNROLL, ACT):
    """Pairs p and p + 1 as ``_pair_row`` computes each, with both pairs' loads issued together (one
    wait for two experts' weights instead of two in a row: the combining block's chain of loads is
    half as long). An id outside [0, E) loads expert 0's tiles (clamped, in bounds) and its row is
    NaN, as ``_pair_row``'s."""
    WORDS = GROUP * BLOCK // 2
    TP = GROUP * BLOCK
    TK = PLANES * TP
    SC = PLANES * GROUP
    TO = TN // 2 if ACT != 0 else TN
    num_e = W.shape[0]
    per_x = Ids.shape[0] // X.shape[0]
    ea = ct.load(Ids, (p,), ())
    eb = ct.load(Ids, (p + 1,), ())
    ok_a = ct.where(ea >= 0, ct.where(ea < num_e, 1, 0), 0)
    ok_b = ct.where(eb >= 0, ct.where(eb < num_e, 1, 0), 0)
    ca = ct.where(ok_a == 1, ea, 0)
    cb = ct.where(ok_b == 1, eb, 0)
    groups = ct.cdiv(ct.cdiv(X.shape[1], TK), UNROLL)
    a_lo = ct.zeros((1, TN, TP // 2), ct.float32)
    a_hi = ct.zeros((1, TN, TP // 2), ct.float32)
    b_lo = ct.zeros((1, TN, TP // 2), ct.float32)
    b_hi = ct.zeros((1, TN, TP // 2), ct.float32)
    for g in range(groups):
        wa, sa, xa = _pair_load(X, W, S, ca, p // per_x, bn, g, TN, UNROLL, WORDS, SC, TK)
        wb, sb, xb = _pair_load(X, W, S, cb, (p + 1) // per_x, bn, g, TN, UNROLL, WORDS, SC, TK)
        a_lo, a_hi = _pair_step(wa, sa, xa, Mult, a_lo, a_hi, ELEMENT, SCALE_MODE, BLOCK, PLANES, GROUP, TN, UNROLL)
        b_lo, b_hi = _pair_step(wb, sb, xb, Mult, b_lo, b_hi, ELEMENT, SCALE_MODE, BLOCK, PLANES, GROUP, TN, UNROLL)
    nan = ct.full((1, TO), float("nan"), dtype)
    ya = ct.where(ok_a == 1, _pair_out(a_lo, a_hi, Consts, Bias, ca, bn, dtype, TN, ACT), nan)
    yb = ct.where(ok_b == 1, _pair_out(b_lo, b_hi, Consts, Bias, cb, bn, dtype, TN, ACT), nan)
    return ya, yb


@ct.kernel(num_worker_warps=ct.ByTarget(sm_90=4))
def _moe_gemv_kernel(X, W, S, Out, Consts, Mult, Bias, Ids, Weights,
                     ELEMENT: ConstInt, SCALE_MODE: ConstInt, BLOCK: ConstInt, PLANES: ConstInt,
                     GROUP: ConstInt, TN: ConstInt, UNROLL: ConstInt, ACT: ConstInt, COMBINE: ConstInt):
    """One (token, slot) pair per block row, no routing: the design for a decode step of one token,
    whose k experts are distinct (each expert's weight tile then read once).

    Ids (T * k,) the flattened router choice (int32 / int64); X (T, K) (the gate_up projection) or
    (T * k, I) (the down projection, one row per pair); the weights as in ``_moe_kernel``. Grid:
    rows * cdiv(N, TN), N tiles fastest (rows fastest, so that pairs sharing an expert read its tile
    together, timed no faster: ``benchmarks/results/moe-pairs-tune-*``). COMBINE = 0: block (pair p,
    bn) writes Out (T * k, N) (N / 2 with ACT = 1 or 2) row p, pair order. COMBINE = 1 or 2 (the down
    projection with the router's weights applied): block (token t, bn) runs the k pairs of token t,
    COMBINE at a time (2: both pairs' loads issued together, ``_pair_rows2``), and writes Out (T, N)
    row t = sum_j Weights[t, j] * y_j, each y_j rounded to Out's dtype first, the products and sum in
    fp32 in slot order, rounded once (what ``tilemm.moe``'s weighted sum computes); no atomics."""
    N = W.shape[1]
    TO = TN // 2 if ACT != 0 else TN
    num_n = ct.cdiv(N, TN)
    pid = ct.bid(0)
    bn = pid % num_n
    row = pid // num_n
    if COMBINE == 1:
        top_k = Ids.shape[0] // Out.shape[0]
        total = ct.zeros((1, TO), ct.float32)
        for j in range(top_k):
            y = _pair_row(X, W, S, Consts, Mult, Bias, Ids, row * top_k + j, bn, Out.dtype, ELEMENT, SCALE_MODE,
                          BLOCK, PLANES, GROUP, TN, UNROLL, ACT)
            total = total + y.astype(ct.float32) * ct.load(Weights, (row, j), (1, 1)).astype(ct.float32)
        ct.store(Out, (row, bn), total.astype(Out.dtype))
    elif COMBINE == 2:
        top_k = Ids.shape[0] // Out.shape[0]
        total = ct.zeros((1, TO), ct.float32)
        for h in range(top_k // 2):  # two slots per step, their loads together (``_pair_rows2``)
            j = 2 * h
            ya, yb = _pair_rows2(X, W, S, Consts, Mult, Bias, Ids, row * top_k + j, bn, Out.dtype, ELEMENT,
                                 SCALE_MODE, BLOCK, PLANES, GROUP, TN, UNROLL, ACT)
            total = total + ya.astype(ct.float32) * ct.load(Weights, (row, j), (1, 1)).astype(ct.float32)
            total = total + yb.astype(ct.float32) * ct.load(Weights, (row, j + 1), (1, 1)).astype(ct.float32)
        if top_k % 2 == 1:
            y = _pair_row(X, W, S, Consts, Mult, Bias, Ids, row * top_k + top_k - 1, bn, Out.dtype, ELEMENT,
                          SCALE_MODE, BLOCK, PLANES, GROUP, TN, UNROLL, ACT)
            total = total + y.astype(ct.float32) * ct.load(Weights, (row, top_k - 1), (1, 1)).astype(ct.float32)
        ct.store(Out, (row, bn), total.astype(Out.dtype))
    else:
        ct.store(Out, (row, bn), _pair_row(X, W, S, Consts, Mult, Bias, Ids, row, bn, Out.dtype, ELEMENT,
                                           SCALE_MODE, BLOCK, PLANES, GROUP, TN, UNROLL, ACT))


@ct.kernel(num_worker_warps=ct.ByTarget(sm_90=4))
def _route_kernel(Ids, Order, Offsets, SlotExpert, Longest, PP: ConstInt, EE: ConstInt):
    """The routing of ``route`` in one block, for P = Ids.shape[0] <= PP (T * k (token, slot) rows)
    and E + 2 = Offsets.shape[0] <= EE: the keys (ids outside [0, E) -> E, rows past P -> E + 1),
    then with (PP, PP) and (EE, PP) comparison tiles, no sort:

    * Offsets[b] = #{rows with key < b}, b = 0 .. E + 1;
    * row i's place in the stable order: #{j: key_j < key_i} + #{j < i: key_j = key_i}, so
      Order[place_i] = i (places are distinct: one scatter, no two writes to one element);
    * SlotExpert (S,): the keys with rows, by decreasing number of rows (ties by key), then -1 (no
      expert: its blocks do nothing). The keys are ranked at the first row of each run, the same
      tie rule as ``route``'s stable argsort, and each slot's value is the max over rows of the key
      ranked there (one store per slot)."""
    rows = Ids.shape[0]
    num_e = Offsets.shape[0] - 2
    i = ct.arange(PP, dtype=ct.int32)
    raw = ct.load(Ids, (0,), (PP,), padding_mode=_ZERO).astype(ct.int64)
    key = ct.where(raw >= 0, ct.where(raw < num_e, raw, num_e), num_e).astype(ct.int32)
    key = ct.where(i < rows, key, num_e + 1)
    ki, kj = key.reshape((PP, 1)), key.reshape((1, PP))
    ii, jj = i.reshape((PP, 1)), i.reshape((1, PP))
    b = ct.arange(EE, dtype=ct.int32)
    below = ct.sum(ct.where(kj < b.reshape((EE, 1)), 1, 0), axis=1)  # (EE,)
    ct.scatter(Offsets, b, below.astype(ct.int64))  # (entries past E + 1: out of bounds, dropped)
    same = ct.where(kj == ki, 1, 0)  # (PP, PP)
    earlier = ct.sum(same * ct.where(jj < ii, 1, 0), axis=1)
    place = ct.sum(ct.where(kj < ki, 1, 0), axis=1) + earlier
    ct.scatter(Order, place, i.astype(ct.int64))  # (padding rows' places are >= P: dropped)
    count = ct.sum(same, axis=1)  # rows of row i's key
    longest = ct.max(ct.where(i < rows, count, 0), axis=0, keepdims=True)  # (1,)
    ct.store(Longest, (0,), longest.astype(ct.int64))
    lead = ct.where(earlier == 0, ct.where(i < rows, 1, 0), 0)  # row i starts its key's run
    ci, cj = count.reshape((PP, 1)), count.reshape((1, PP))
    ahead = ct.where(cj > ci, 1, ct.where(cj == ci, ct.where(kj < ki, 1, 0), 0))
    rank = ct.sum(ahead * lead.reshape((1, PP)), axis=1)  # (PP,): the slot of a leading row's key
    slot = ct.where(lead == 1, rank, PP)
    slot_key = ct.max(ct.where(slot.reshape((1, PP)) == ii, kj, -1), axis=1)  # (PP,): slot s's key or -1
    ct.scatter(SlotExpert, i, slot_key.astype(ct.int64))  # (slots past S dropped)


# --------------------------------------------------------------------------------------------------
# Routing, configs and launch
# --------------------------------------------------------------------------------------------------

_BOUNDS: dict = {}


#: ``route`` runs ``_route_kernel`` (one launch) on CUDA while its comparison tiles stay at most this
#: many elements (PP * max(PP, EE)): a decode batch of gpt-oss-120b up to T = 16, of gpt-oss-20b up to
#: T = 32; beyond, about ten PyTorch operations (a radix sort among them).
ROUTE_KERNEL_MAX_ELEMENTS = 16384


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def route_kernel_fits(pairs: int, num_experts: int) -> bool:
    """Whether ``_route_kernel`` takes T * k = ``pairs`` rows for E = ``num_experts``."""
    pp = _pow2(max(pairs, 1))
    return pp * max(pp, _pow2(num_experts + 2)) <= ROUTE_KERNEL_MAX_ELEMENTS


def route(topk_ids: torch.Tensor, num_experts: int, kernel: bool | None = None
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(order, offsets, slot_expert, longest) int64 for ``topk_ids`` (T, k) (see the module
    docstring; longest: the most rows of one expert, ids outside [0, E) counted as expert E); fixed
    sizes T * k, E + 2, min(T * k, E + 1) and 1; no host synchronisation. ``kernel`` (default: on CUDA
    where ``route_kernel_fits``): one launch of ``_route_kernel``, whose slot_expert ends with -1 (no
    expert) where the PyTorch path lists the experts without rows; else about ten small PyTorch
    kernels. Either way a layer computes it once for both of its projections."""
    flat = topk_ids.reshape(-1)
    rows = flat.numel()
    if kernel is None:
        kernel = flat.is_cuda and route_kernel_fits(rows, num_experts)
    if kernel:
        order = torch.empty(rows, dtype=torch.int64, device=flat.device)
        offsets = torch.empty(num_experts + 2, dtype=torch.int64, device=flat.device)
        slot_expert = torch.empty(min(rows, num_experts + 1), dtype=torch.int64, device=flat.device)
        longest = torch.empty(1, dtype=torch.int64, device=flat.device)
        pp, ee = _pow2(max(rows, 1)), _pow2(num_experts + 2)
        ct.launch(stream_handle(flat.device), (1, 1, 1), _route_kernel,
                  (flat.contiguous(), order, offsets, slot_expert, longest, pp, ee))
        return order, offsets, slot_expert, longest
    flat = flat.to(torch.int64)
    # ids outside [0, E) -> E: clamp to [-1, E], then -1 -> E (mod E + 1).
    key = torch.remainder(flat.clamp(-1, num_experts), num_experts + 1)
    sorted_key, order = torch.sort(key, stable=True)
    bounds = _BOUNDS.get((flat.device, num_experts))
    if bounds is None:  # made once per (device, E), so that a captured call allocates nothing for it
        bounds = _BOUNDS[(flat.device, num_experts)] = torch.arange(
            num_experts + 2, device=flat.device, dtype=torch.int64)
    offsets = torch.searchsorted(sorted_key, bounds)
    # The experts by decreasing number of rows (ties by id; stable), the empty ones last: the first
    # S entries hold every present expert, and the busiest expert's items come first.
    minus_runs = offsets[:-1] - offsets[1:]  # (E + 1,): minus each run's length
    slot_expert = torch.argsort(minus_runs, stable=True)
    return order, offsets, slot_expert[:min(rows, num_experts + 1)], torch.amax(-minus_runs, dim=0, keepdim=True)


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """tile_m (tokens per chunk), tile_n (weight rows per block), cat (one MMA per K tile) and the
    compiler hints."""

    tile_m: int
    tile_n: int = 64
    num_worker_warps: int = 4
    occupancy: int | None = None
    cat: int = 0
    unroll: int = 1

    @functools.cached_property
    def kernel(self):
        return hinted(_moe_kernel, **sm90_hints(self.num_worker_warps, self.occupancy))

    @property
    def name(self) -> str:
        s = f"moe_{self.tile_m}x{self.tile_n}_w{self.num_worker_warps}"
        s += f"_occ{self.occupancy}" if self.occupancy else ""
        return s + (f"_u{self.unroll}" if self.unroll > 1 else "") + ("_cat" if self.cat else "")


#: Per tile_m: the block shape of the weight-only kernel's unsplit configs (one warpgroup on 64 weight
#: rows; at tile_m 16 the planes concatenated into one MMA per K tile, occupancy 3 for 4-bit weights
#: (two K tiles per load), 2 for 8-bit; tile_m 128 two warpgroups on 128 rows).
_TILE_M = (16, 32, 64, 128)


@functools.lru_cache(maxsize=256)  # one config object per (tile_m, layout): its kernel is looked up once
def _config(tile_m: int, layout: Layout) -> MoEConfig:
    if tile_m == 16:  # 4-bit weights: two K tiles per load, as the weight-only kernel's unsplit tile_m 16
        four_bit = layout.planes == 4
        return MoEConfig(16, 64, 4, 3 if four_bit else 2, cat=1, unroll=2 if four_bit else 1)
    if tile_m == 32:
        return MoEConfig(32, 64, 4, 4)
    if tile_m == 64:
        return MoEConfig(64, 64, 4, 2)
    return MoEConfig(128, 128, 8, None)


def _sorted_config(tokens: int, top_k: int, num_experts: int, layout: Layout) -> MoEConfig:
    """The sorted design's tile for T = ``tokens``: tile_m the smallest of 16, 32, 64 that covers the
    mean number of tokens per active expert, T * k / min(T * k, E) (a balanced routing then takes one
    chunk per expert), and 128 only above a mean of 128: at a mean of 128 (gpt-oss-20b, T = 1024) two 64-row
    chunks per expert ran faster than one 128-row chunk, under uniform and skewed routing
    (``benchmarks/results/moe-pairs-tune-sorted-*``). Not taken, worth measuring: a K split for few active
    experts; vLLM-style padded TM-row tiles (``moe_align_block_size``)."""
    pairs = tokens * top_k
    mean = ceil_div(pairs, max(1, min(pairs, num_experts)))
    if mean > 128:
        return _config(128, layout)
    return _config(next((t for t in _TILE_M[:-1] if t >= mean), 64), layout)


#: At most this many blocks share one (expert, N tile)'s chunks of tokens.
MAX_CHUNK_GROUPS = 8


def _chunk_groups(tokens: int, tile_m: int) -> int:
    """The most chunk groups (work items per (expert, N tile)): enough that an expert chosen by
    every one of the T = ``tokens`` tokens runs at most ceil(T / (TM * G)) chunks in a row, at most
    ``MAX_CHUNK_GROUPS``; 1 while T <= TM. Fixed by the shapes; the kernel takes G = the smaller of
    this and the busiest expert's chunks, read on the device."""
    return max(1, min(MAX_CHUNK_GROUPS, ceil_div(tokens, tile_m)))


_ZERO_BIAS: dict = {}


def zero_bias(num_experts: int, n: int, device) -> torch.Tensor:
    """A cached (E, N) fp32 zero bias (one allocation per shape and device, none per call)."""
    key = (num_experts, n, torch.device(device))
    t = _ZERO_BIAS.get(key)
    if t is None:
        t = _ZERO_BIAS[key] = torch.zeros((num_experts, n), dtype=torch.float32, device=device)
    return t


def sort_rows(x: torch.Tensor, routed: tuple, top_k: int) -> torch.Tensor:
    """x's rows in the routed order, (T * top_k, K): row i is the token of (token, slot) row
    ``order[i]`` (one gather; what the kernel's K loop then loads as contiguous row ranges)."""
    order = routed[0]
    return x.index_select(0, order if top_k == 1 else order // top_k)


def launch(xs: torch.Tensor, words: torch.Tensor, scale_t: torch.Tensor, constants: torch.Tensor,
           bias: torch.Tensor | None, routed: tuple, tokens: int, out: torch.Tensor, layout: Layout,
           act: int = 0, moe_plan: MoEPlan | None = None, sorted_out: int | None = None,
           blocks: int | None = None) -> None:
    """out = the expert products of the rows ``xs`` (T * k, K), sorted as ``routed`` (``route``'s
    result for (T, k) ids, T = ``tokens``) sorts the (token, slot) rows (``sort_rows``, or a previous
    launch's sorted output): (T * k, N), or (T * k, N / 2) with ``act`` = 1 (gpt-oss's SwiGLU on
    interleaved gate / up rows). ``sorted_out`` (default ``act``): 1 writes out's rows in the sorted
    order too (what the next projection reads), 0 scatters them to the (token, slot) rows. ``bias``
    (E, N) fp32 or None; ``constants`` the stacked PackedWeight's (E, 2). ``moe_plan``: a sorted
    ``MoEPlan`` (default ``plan``'s for the sorted design). ``blocks``: the grid (default
    ``grid_blocks``). One ``ct.launch``."""
    order, offsets, slot_expert, longest = routed
    num_experts, n = words.shape[0], words.shape[1]
    top_k = xs.shape[0] // tokens
    if moe_plan is None:
        moe_plan = plan(tokens, top_k, num_experts, n, xs.shape[1], layout, design="sorted")
    elif moe_plan.design != "sorted":
        raise ValueError(f"launch: moe_plan must be a plan of the sorted design, got {moe_plan.design!r}")
    cfg, groups = moe_plan.config, moe_plan.groups
    if bias is None:
        bias = zero_bias(num_experts, n, xs.device)
    items = slot_expert.shape[0] * groups * ceil_div(n, cfg.tile_n)
    if blocks is None:
        blocks = grid_blocks(items, cfg, out.device)
    stream = stream_handle(out.device)
    ct.launch(stream, (max(1, min(blocks, items)), 1, 1), cfg.kernel,
              (xs, words, scale_t, out, constants, constants[0, 1:2], bias, order, offsets, slot_expert, longest,
               groups, *_constants(layout, cfg, _X_PARTS[xs.dtype], act, int(act != 0) if sorted_out is None else sorted_out)))


def grid_blocks(items: int, cfg: MoEConfig, device) -> int:
    """The grouped kernel's persistent grid: SMs x ``cfg.occupancy`` blocks (2 per SM without an
    occupancy hint), at most ``items``; one block per item on the CPU (the emulator). The slots come
    busiest first, so the items with rows are a prefix of each chunk group, spread evenly over the
    blocks, and the many items without rows (under skewed routing most slots; chunk groups past an
    expert's chunks) cost a few loads each where a block per item would launch thousands of blocks
    that do nothing."""
    if device.type != "cuda":
        return items
    return min(items, num_sms(device) * (cfg.occupancy or 2))


#: The most expert weight bytes the per-pair design may read in one call (its pairs times one
#: expert's bytes): the scale at which the sorted design's fixed cost (routing, gathers, tiles of
#: mostly empty rows) stops outweighing the pairs' re-reads (``benchmarks/results/moe-layers-*``).
PAIRS_MAX_BYTES = 256 * 2 ** 20


def _pairs_pay(tokens: int, top_k: int, num_experts: int, expert_bytes: int) -> bool:
    """Whether a call takes the per-pair design (no routing) rather than the sorted one. One token
    always does: its k experts are distinct, so every weight is read once either way. From two tokens,
    pairs that share an expert read it once each; the per-pair design keeps paying while the pairs
    are at most half the experts (few of them shared under uniform routing) and read at most
    ``PAIRS_MAX_BYTES``: many small experts keep the per-pair design for more tokens than a few large
    ones (``benchmarks/results/moe-layers-*`` compares the two designs by T)."""
    pairs = tokens * top_k
    return tokens <= 1 or (2 * pairs <= num_experts and pairs * expert_bytes <= PAIRS_MAX_BYTES)


def expert_bytes(*words_and_scales: torch.Tensor) -> int:
    """The bytes of one expert of stacked (E, ...) weight tensors (words and scales)."""
    return sum(t[0].numel() * t.element_size() for t in words_and_scales)


@dataclasses.dataclass(frozen=True)
class PairsConfig:
    """The per-pair kernel's block: tile_n weight rows (16: a decode's N gives thousands of blocks
    with no K split), 4 worker warps, 8 blocks per SM (these launches wait on each block's loads: 8
    ran faster than 4 on every gpt-oss and anchor layer timed at T = 1 and 4,
    ``benchmarks/results/moe-pairs-tune-*``), ``unroll`` K tiles per load (``_pairs_config``). A
    combining launch runs ``slots`` (1 or 2) pairs per step at ``combine_occupancy`` blocks per SM
    (2 at 6 ran faster than 1 at 8 on the same layers at T = 2 and 4)."""

    unroll: int
    tile_n: int = 16
    num_worker_warps: int = 4
    occupancy: int | None = 8
    #: A combining block (the down projection's weighted sum in its epilogue): pairs per step, and
    #: blocks per SM (two pairs' accumulators and tiles at once spill at 8 blocks per SM, not at 6).
    slots: int = 2
    combine_occupancy: int | None = 6

    def __post_init__(self):
        if self.slots not in (1, 2):
            raise ValueError(f"PairsConfig: slots must be 1 or 2 (pairs per step of a combining block), got {self.slots}")

    def kernel_for(self, combine: bool):
        occupancy = self.combine_occupancy if combine else self.occupancy
        return hinted(_moe_gemv_kernel, **sm90_hints(self.num_worker_warps, occupancy))

    @property
    def kernel(self):
        return self.kernel_for(False)

    def name_for(self, combine: bool) -> str:
        if combine:
            return f"moe_pairs_{self.tile_n}_u{self.unroll}_w{self.num_worker_warps}_occ{self.combine_occupancy}_s{self.slots}"
        return f"moe_pairs_{self.tile_n}_u{self.unroll}_w{self.num_worker_warps}_occ{self.occupancy}"

    @property
    def name(self) -> str:
        return self.name_for(False)


def _combine_pays(tokens: int, n: int, sms: int) -> bool:
    """Whether the down projection should apply the router's weights in its epilogue (one block per
    (token, N tile), each running the token's k experts, ``PairsConfig.slots`` at a time): only while those blocks
    alone give at least 1.5 per SM; with fewer, the per-pair blocks (k times as many) and a batched
    GEMM for the sum keep more weight loads in flight (``benchmarks/results/moe-layers-*``)."""
    return 2 * tokens * ceil_div(n, PairsConfig(1).tile_n) >= 3 * sms


@functools.lru_cache(maxsize=256)  # one config object per (K, layout): its kernel is looked up once
def _pairs_config(k: int, layout: Layout) -> PairsConfig:
    """The per-pair design's block for K = ``k``, by its K tiles per load: the most of 4, 2 whose last
    load wastes at most an eighth of the K tiles on zero padding (padded tiles cost decode
    instructions: gpt-oss's K = 2880, 12 K tiles, takes 4), else 2. Not 8: at 8 blocks per SM, the
    anchor's K = 2048 (8 K tiles) ran faster as two loads of 4 than as one of 8 (the loop's next load
    in flight while one is decoded; ``benchmarks/results/moe-pairs-tune-*``)."""
    k_tiles = ceil_div(k, layout.tile_k)
    for unroll in (4, 2):
        if unroll <= k_tiles and 8 * (ceil_div(k_tiles, unroll) * unroll - k_tiles) <= k_tiles:
            return PairsConfig(unroll)
    return PairsConfig(2)


@dataclasses.dataclass(frozen=True)
class MoEPlan:
    """``plan``'s choice for one projection of one call. ``design`` "pairs": no routing, ``config``
    the per-pair kernel's block (a ``PairsConfig``), ``combine`` whether the launch sums each token's
    k slots with the router's weights in its epilogue. "sorted": the routing, ``config`` the grouped
    kernel's tile (a ``MoEConfig``), ``groups`` the chunk groups (work items per (expert, N tile))."""

    design: str
    config: PairsConfig | MoEConfig
    combine: bool = False
    groups: int = 1


#: The designs ``plan`` chooses from (module docstring).
DESIGNS = ("pairs", "sorted")


def plan(tokens: int, top_k: int, num_experts: int, n: int, k: int, layout: Layout,
         expert_bytes: int | None = None, sms: int | None = None, *, design: str | None = None,
         combine: bool | None = False, config: PairsConfig | MoEConfig | None = None) -> MoEPlan:
    """The MoE kernels' choice for one (N, K) = (``n``, ``k``) projection of stacked ``layout`` weights
    at T = ``tokens`` tokens of ``top_k`` of ``num_experts`` experts:

    * the design, unless ``design`` names one: per pair while it pays (``_pairs_pay`` on
      ``expert_bytes``, the weight bytes of one expert that a pair reads: an experts block passes
      both projections' for both, so that they take one design), else sorted;
    * per pair: the block (``_pairs_config``) and ``combine``: False (one output row per (token,
      slot)), True, or None to choose it by the blocks it gives on ``sms`` SMs (``_combine_pays``: an
      experts block's down projection);
    * sorted: the tile (``_sorted_config``) and its chunk groups (``_chunk_groups``); never combined.

    ``config`` replaces the chosen block or tile (tests, tuning)."""
    if design is None:
        if expert_bytes is None:
            raise ValueError("plan: choosing the design (design=None) needs expert_bytes")
        design = "pairs" if _pairs_pay(tokens, top_k, num_experts, expert_bytes) else "sorted"
    if design == "pairs":
        if combine is None:
            if sms is None:
                raise ValueError("plan: choosing combine (combine=None) needs sms, the GPU's SM count")
            combine = _combine_pays(tokens, n, sms)
        return MoEPlan("pairs", config or _pairs_config(k, layout), bool(combine))
    if design != "sorted":
        raise ValueError(f"plan: design must be one of {DESIGNS} or None, got {design!r}")
    if combine:
        raise ValueError("plan: combine=True needs the per-pair design; the sorted design's slots are summed "
                         "after the launch")
    config = config or _sorted_config(tokens, top_k, num_experts, layout)
    return MoEPlan("sorted", config, groups=_chunk_groups(tokens, config.tile_m))


def launch_pairs(x: torch.Tensor, words: torch.Tensor, scale_t: torch.Tensor, constants: torch.Tensor,
                 bias: torch.Tensor | None, ids: torch.Tensor, out: torch.Tensor, layout: Layout, act: int = 0,
                 weights: torch.Tensor | None = None, moe_plan: MoEPlan | None = None) -> None:
    """The per-pair design, no routing: ``ids`` (T * k,) the flattened router choice. Without
    ``weights``: out (T * k, N) (N / 2 with ``act`` 1 or 2, the gating of ``launch``) = each pair's product with its expert, pair order,
    x (T, K) or one row per pair. With ``weights`` (T, k): out (T, N) = the weighted sum over each
    token's k slots (see ``_moe_gemv_kernel``). ``moe_plan``: a per-pair ``MoEPlan`` whose ``combine``
    says whether ``weights`` is given (default ``plan``'s for the per-pair design). One ``ct.launch``."""
    combine = weights is not None
    if moe_plan is None:
        # the block depends on K and the layout only: each pair counts as a token of one expert
        moe_plan = plan(ids.numel(), 1, words.shape[0], words.shape[1], x.shape[1], layout, design="pairs",
                        combine=combine)
    elif moe_plan.combine != combine:
        raise ValueError(f"launch_pairs: moe_plan.combine is {moe_plan.combine} but weights is "
                         f"{'given' if combine else 'None'}; a combining plan takes the router's weights")
    PreparedPairs(x.shape[1], words, scale_t, constants, bias, layout, out.shape[0], act, moe_plan).run(
        x, ids, out, weights)


class PreparedPairs:
    """One per-pair launch (``launch_pairs``) of a projection with ``rows`` output rows, with
    everything but x, the ids, the output and the router's weights worked out: the kernel, the grid,
    and the weight's arguments (the tensors held). ``moe_plan``: a per-pair ``MoEPlan`` (default
    ``plan``'s, without combine); with ``combine`` ``run`` takes the router's weights."""

    __slots__ = ("kernel", "grid", "words", "scale_t", "rest", "consts")

    def __init__(self, k: int, words: torch.Tensor, scale_t: torch.Tensor, constants: torch.Tensor,
                 bias: torch.Tensor | None, layout: Layout, rows: int, act: int = 0,
                 moe_plan: MoEPlan | None = None):
        num_experts, n = words.shape[0], words.shape[1]
        if moe_plan is None:
            moe_plan = plan(rows, 1, num_experts, n, k, layout, design="pairs")
        elif moe_plan.design != "pairs":
            raise ValueError(f"PreparedPairs: moe_plan must be a plan of the per-pair design, got {moe_plan.design!r}")
        cfg = moe_plan.config
        if bias is None:
            bias = zero_bias(num_experts, n, words.device)
        self.kernel = cfg.kernel_for(moe_plan.combine)
        self.grid = (rows * ceil_div(n, cfg.tile_n), 1, 1)
        self.words, self.scale_t = words, scale_t
        self.rest = (constants, constants[0, 1:2], bias)
        self.consts = _pairs_constants(layout, cfg, act, int(moe_plan.combine))

    def run(self, x: torch.Tensor, ids: torch.Tensor, out: torch.Tensor, weights: torch.Tensor | None = None) -> None:
        ct.launch(stream_handle(out.device), self.grid, self.kernel,
                  (x, self.words, self.scale_t, out, *self.rest, ids, out if weights is None else weights,
                   *self.consts))


def _pairs_constants(layout: Layout, cfg: PairsConfig, act: int, combine: int) -> tuple:
    return (layout.element, layout.scale_mode, layout.block, layout.planes, layout.group,
            cfg.tile_n, cfg.unroll, act, cfg.slots if combine else 0)


def _constants(layout: Layout, cfg: MoEConfig, x_parts: int, act: int, sorted_out: int) -> tuple:
    return (layout.element, layout.scale_mode, layout.block, layout.planes, layout.group,
            cfg.tile_m, cfg.tile_n, x_parts, cfg.cat, act, sorted_out, cfg.unroll)


# --------------------------------------------------------------------------------------------------
# Ahead-of-time specialisations
# --------------------------------------------------------------------------------------------------

_CT_DTYPES = {torch.bfloat16: ct.bfloat16, torch.float16: ct.float16}
_ACT_SUFFIX = {ACT_NONE: "", ACT_GPT_OSS: "_swiglu", ACT_SILU: "_silu"}


def aot_variants(full: bool = True) -> list[AotVariant]:
    """The grouped kernel per (layout, activation dtype, config, epilogue), for sm_90, sm_100 and
    sm_120 (bf16 ``ct.mma`` and integer operations only). ``full=False`` keeps tile_m 16 and 64 (one
    MMA per K tile, or one per plane). The fused SwiGLU epilogue (act 1) is listed for 4-bit weights
    and bf16 activations (gpt-oss), the fused SiLU gating (act 2) likewise with tile_m 16 only. ``Consts`` (E, 2) and ``Mult`` (a view at byte 4 of it) are passed
    as the launcher passes them: strides and base not 16-byte aligned."""
    variants = []
    for name, layout in LAYOUTS.items():
        configs = [_config(t, layout) for t in (_TILE_M if full else (16, 64))]
        for x_dtype, x_ct in _CT_DTYPES.items():
            acts = (0, 1, 2) if layout.planes == 4 and x_dtype == torch.bfloat16 else (0,)
            for act in acts:
                # SiLU gating (act 2): tile_m 16 only, the config of a SiLU layer's few tokens per
                # expert (the anchor's 256 experts); the other configs share its code path.
                for cfg in configs if act != 2 else configs[:1]:
                    params = [array(x_ct, 2), array(ct.int32, 3), array(ct.uint8, 3), array(x_ct, 2),
                              array(ct.float32, 2, aligned=False), array(ct.float32, 1, aligned=False),
                              array(ct.float32, 2), array(ct.int64, 1), array(ct.int64, 1), array(ct.int64, 1),
                              array(ct.int64, 1), _INT32, *_constants(layout, cfg, _X_PARTS[x_dtype], act, act)]
                    suffix = _ACT_SUFFIX[act]
                    variants.append(AotVariant(f"moe_{name}_{x_ct.name}_{cfg.name}{suffix}", cfg.kernel, params))
        # The per-pair kernel, bf16 activations (fp16 is the same code path): each projection of a
        # decode step (plain, SwiGLU or SiLU for 4-bit gate_up, the weighted sum for down) with 4 K tiles per
        # load (gpt-oss's K = 2880, the anchor's K = 2048); the anchor's down projection (K = 512)
        # with 2, with and without the weighted sum.
        cases = [(4, 0, 0), (4, 0, 1)] + ([(4, 1, 0), (4, 2, 0)] if layout.planes == 4 else [])
        cases += {"mxfp4": [(2, 0, 0), (2, 0, 1)], "nvfp4": [(2, 0, 0), (2, 0, 1)]}.get(name, [])
        for unroll, act, combine in cases:
            variants.append(pairs_aot_variant(name, PairsConfig(unroll), act, combine))
    return variants


def pairs_aot_variant(name: str, cfg: PairsConfig, act: int = 0, combine: int = 0) -> AotVariant:
    """The per-pair kernel of ``cfg`` for layout ``name``, bf16 activations, epilogue ``act`` and
    ``combine``, as its launch specialises it."""
    params = [array(ct.bfloat16, 2), array(ct.int32, 3), array(ct.uint8, 3), array(ct.bfloat16, 2),
              array(ct.float32, 2, aligned=False), array(ct.float32, 1, aligned=False),
              array(ct.float32, 2), array(ct.int64, 1), array(ct.bfloat16, 2),
              *_pairs_constants(LAYOUTS[name], cfg, act, combine)]
    suffix = _ACT_SUFFIX[act] + ("_combine" if combine else "")
    return AotVariant(f"moe_{name}_bfloat16_{cfg.name_for(bool(combine))}{suffix}", cfg.kernel_for(bool(combine)),
                      params)
