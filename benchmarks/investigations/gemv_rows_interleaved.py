"""Investigation (no GPU): the M = 1 FMA weight-only kernel on a row-interleaved weight layout, in SASS.

    python benchmarks/investigations/gemv_rows_interleaved.py            # counts, MXFP4 and NVFP4
    python benchmarks/investigations/gemv_rows_interleaved.py --check    # and the tile code on the
                                                                         # CPU emulator vs the reference

Question: ``weight_only_kernels._gemv_kernel`` spends about one SASS instruction per weight element
turning x's bf16 pairs into fp32, because each thread holds one weight row and a few K positions, so
each x conversion feeds one FMA (compiled for fp32 x, the same kernel counts about 0.9 fewer
instructions per element). Here the prepacked words are interleaved by R = 4 rows (word k of rows
4i .. 4i + 3 side by side in memory), so a thread's 16-byte vector holds four rows at one K position
and one x conversion feeds four FMAs. Decode, scaling and exactness are those of ``_gemv_kernel``.
The prototype has no K split and no stacking; it is counted with ``decode_cost.main_loop`` beside the
production kernel of the same tile (16 rows, 8 K tiles per load, 4 warps), at M = 1, 14336 x 4096.
Result (``results/gemv-rows-interleaved-sm90.txt``): tileiras moves the interleaved tiles through
shared memory and spills, so the prototype costs about 2.4x the production kernel's instructions.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import cuda.tile as ct
import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import decode_cost as dc  # noqa: E402
from tilemm.kernels import weight_only_kernels as wo  # noqa: E402
from tilemm.kernels._aot import AotVariant, array, compile_variant  # noqa: E402
# Imported as names so that the CPU emulator, which rebinds a kernel's global helpers, reaches them.
from tilemm.kernels.weight_only_kernels import (_decode_plane, _epilogue, _f32_halves,  # noqa: E402
                                                _multipliers, _scale_tile)

ConstInt = ct.Constant[int]
_ZERO = ct.PaddingMode.ZERO
R = 4  # rows interleaved per word position


@ct.kernel(num_worker_warps=ct.ByTarget(sm_90=4))
def gemv_interleaved_kernel(X, W, S, C, Alpha, Mult, Bias,
                            ELEMENT: ConstInt, SCALE_E8M0: ConstInt, BLOCK: ConstInt, PLANES: ConstInt,
                            GROUP: ConstInt, TM: ConstInt, TN: ConstInt, UNROLL: ConstInt):
    """``_gemv_kernel`` (no K split) on W (N / R, K words, R): element [i, k, r] is word k of weight
    row i * R + r. acc (TM, TN / R, WORDS, R): each thread's vector is R rows of one word."""
    M = X.shape[0]
    WORDS = GROUP * BLOCK // 2
    TP = GROUP * BLOCK
    TK = PLANES * TP
    SC = PLANES * GROUP
    TR = TN // R
    num_m = ct.cdiv(M, TM)
    pid = ct.bid(0)
    bm = pid % num_m
    bn = pid // num_m
    groups = ct.cdiv(ct.cdiv(X.shape[1], TK), UNROLL)
    acc = ct.zeros((TM, TR, WORDS, R), ct.float32)
    for g in range(groups):
        ws = ct.bitcast(ct.load(W, (bn, g, 0), (TR, UNROLL * WORDS, R), padding_mode=_ZERO), ct.uint32)
        ss = _scale_tile(S, g, bn, UNROLL * SC, TN, BLOCK)  # (TN, UNROLL * SC)
        xs = ct.load(X, (bm, g), (TM, UNROLL * TK), padding_mode=_ZERO)
        for u in ct.static_iter(range(UNROLL)):
            w = ct.extract(ws, (0, u, 0), (TR, WORDS, R))
            mult = _multipliers(ct.extract(ss, (0, u), (TN, SC)), Mult, SCALE_E8M0)
            mult = mult.reshape((TR, R, PLANES, GROUP)).permute((0, 2, 3, 1))  # (TR, PLANES, GROUP, R)
            for p in ct.static_iter(range(PLANES)):
                # Decoded pairs as fp32 halves first, then the block scale in fp32 (one multiply per
                # element instead of one per pair, but no bf16 re-layout of the vector).
                bits = _decode_plane(w, p, ELEMENT)
                m_p = ct.extract(mult, (0, p, 0, 0), (TR, 1, GROUP, R)).reshape((TR, GROUP, 1, R))
                m_p = m_p.astype(ct.float32)
                w_lo = ct.bitcast(bits << 16, ct.float32).reshape((TR, GROUP, WORDS // GROUP, R)) * m_p
                w_hi = ct.bitcast(bits & 0xFFFF0000, ct.float32).reshape((TR, GROUP, WORDS // GROUP, R)) * m_p
                x_lo, x_hi = _f32_halves(ct.extract(xs, (0, u * PLANES + p), (TM, TP)), TM, TP,
                                            X.dtype == ct.bfloat16)
                acc = acc + w_lo.reshape((1, TR, WORDS, R)) * x_lo.reshape((TM, 1, WORDS, 1))
                acc = acc + w_hi.reshape((1, TR, WORDS, R)) * x_hi.reshape((TM, 1, WORDS, 1))
    _epilogue(ct.sum(acc, axis=2).reshape((TM, TN)), C, Alpha, Bias, bm, bn, TM, TN)


def interleave(words: torch.Tensor) -> torch.Tensor:
    """Prepacked words (N, KW) -> (N / R, KW, R), word k of rows iR .. iR + R - 1 side by side."""
    n, kw = words.shape
    return words.reshape(n // R, R, kw).transpose(1, 2).contiguous()


def variant(name: str, cfg: wo.WeightOnlyConfig) -> AotVariant:
    layout = wo.LAYOUTS[name]
    params = [array(ct.bfloat16, 2), array(ct.int32, 3), array(ct.uint8, 2), array(ct.bfloat16, 2),
              array(ct.float32, 1), array(ct.float32, 1), array(ct.float32, 1),
              layout.element, layout.scale_e8m0, layout.block, layout.planes, layout.group,
              cfg.tile_m, cfg.tile_n, cfg.unroll]
    return AotVariant(f"gemv_interleaved_{name}", gemv_interleaved_kernel, params, targets=("sm_90",))


def check(name: str, cfg: wo.WeightOnlyConfig) -> float:
    """Run the prototype's tile code on the CPU emulator (tests/_emulator.py) against the fp32
    reference; returns the relative error (the output is bf16, so its rounding, about 1e-3)."""
    sys.path.insert(0, str(ROOT / "tests"))
    from _emulator import TileEmulator
    import tilemm

    gen = torch.Generator().manual_seed(0)
    n, k = 64, 1024
    w = torch.randn(n, k, generator=gen)
    packed = tilemm.prepack(getattr(tilemm, f"quantize_{name}")(w))
    x = torch.randn(1, k, generator=gen).to(torch.bfloat16)
    ref = tilemm.linear(x.float(), packed).double()
    out = torch.empty(1, n, dtype=torch.bfloat16)
    bias = torch.zeros(n)
    mult = packed.constants[1:2]
    TileEmulator().launch(None, (n // cfg.tile_n, 1, 1), gemv_interleaved_kernel,
                          (x, interleave(packed.words.view(torch.int32)), packed.scale_t, out,
                           packed.constants[0:1], mult, bias, *variant(name, cfg).params[7:]))
    return ((out.double() - ref).norm() / ref.norm()).item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="also run the tile code on the CPU emulator")
    args = parser.parse_args()
    for name in ("mxfp4", "nvfp4"):
        cfg = wo.plan(1, 14336, 4096, wo.LAYOUTS[name], 132)
        prod, elements, _ = dc.weight_only_variant(name, cfg)
        ops_prod = dc.main_loop(compile_variant(prod, "sm_90"), marker="FFMA")
        ops_new = dc.main_loop(compile_variant(variant(name, cfg), "sm_90"), marker="FFMA")
        print(f"{name} {cfg.name}: production {sum(ops_prod.values()) / elements:.2f} instr/element "
              f"{dict(ops_prod.most_common(6))}")
        print(f"{name} rows interleaved by {R}: {sum(ops_new.values()) / elements:.2f} instr/element "
              f"{dict(ops_new.most_common(6))}")
        if args.check:
            print(f"{name} emulated vs reference: relative error {check(name, cfg):.2e}")


if __name__ == "__main__":
    main()
