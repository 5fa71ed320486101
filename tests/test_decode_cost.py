"""The weight-only kernels' decode cost, in SASS instructions per weight element, without a GPU.

``benchmarks/decode_cost.py`` compiles the kernels as ``plan`` picks them -- the MMA kernel at M = 16
(N = 2048, K = 14336: a K split, two K tiles per load) and with stacked K tiles at M = 4, the FMA
kernel at M = 1, the MMA kernel at M = 1 (``m1_kernel="mma"``: the same stacked configs), and the
large-M fused kernel's one-warpgroup split blocks that the runner takes at few rows -- for sm_90,
disassembles them (``nvdisasm``) and counts the main loop. At small M these kernels issue those
instructions for every weight element they read, so a change that adds decode work shows here
before any GPU run. The bounds sit a little above the counts of the committed
kernels (MMA: 3.50 MXFP4, 4.50 NVFP4, 4.18 MXFP8, with ``tileiras`` 13.4, well below the
block-scaled stream kernel's 12.4-16.2; FMA and stacked: below).
"""

from __future__ import annotations

import importlib.util
import pathlib

import pytest

from test_aot import COMPILER_MISSING

pytestmark = pytest.mark.aot

_SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "decode_cost.py"
_spec = importlib.util.spec_from_file_location("decode_cost", _SCRIPT)
decode_cost = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(decode_cost)

# "nvfp4_normal": NVFP4 weights whose scale bytes are all normal (``Layout.normal_scales``, what prepack
# gives a quantized trained weight), one integer multiply-add per scale byte: 4.07 here.
BOUNDS = {"mxfp4": 3.7, "nvfp4": 4.8, "nvfp4_normal": 4.3, "mxfp8_e4m3": 4.4, "mxfp8_e5m2": 4.4}
# The FMA kernel at M = 1 (N = 14336, K = 4096): 5.55 MXFP4, 5.79 NVFP4, 6.09 MXFP8 with tileiras 13.4
# (one FFMA per element and the conversions of weight and x to fp32 on top of the MMA kernel's decode;
# its K loop, not the span of a barrier wait's retry path back into it).
FMA_BOUNDS = {"mxfp4": 5.7, "nvfp4": 5.95, "nvfp4_normal": 5.7, "mxfp8_e4m3": 6.3, "mxfp8_e5m2": 6.3}  # normal: 5.52


# Stacked K tiles at M = 4 (N = 8192: 32-row blocks, N = 4096: 16-row blocks): 3.05 / 3.30 MXFP4,
# 3.51 / 3.66 NVFP4, 3.47 / 3.47 MXFP8 with tileiras 13.4 (the same decode, fewer rows per block).
# NVFP4 with normal scales: 3.48 / 3.62 (3.14 / 3.16 while NVFP4's scales were transposed: the row-major
# tile's bytes take permutes where the transposed one took byte loads, and times no slower,
# ``benchmarks/results/inference-scale-rows-small-m-nvidia-h200.txt``).
STACKED_BOUNDS = {"mxfp4": 3.5, "nvfp4": 3.8, "nvfp4_normal": 3.7, "mxfp8_e4m3": 3.7, "mxfp8_e5m2": 3.7}
#: The "few" stacked blocks (8 weight rows, 8 K tiles; N of at most 8 rows per SM, where the kernel waits
#: on latency, not on issue): 8-byte rows of scales cost NVFP4 byte permutes and 8-bit x tiles a pass
#: through shared memory (2.73 / 4.25 / 5.02 per element, ``benchmarks/results/decode-cost-sm90.txt``).
#: NVFP4 with normal scales: 4.25 (the same byte permutes).
FEW_STACKED_BOUNDS = {"mxfp4": 2.9, "nvfp4": 4.5, "nvfp4_normal": 4.5, "mxfp8_e4m3": 5.3, "mxfp8_e5m2": 5.3}


def _nvdisasm_missing():
    try:
        decode_cost.nvdisasm()
    except FileNotFoundError as err:
        return str(err)
    return None


@pytest.mark.skipif(COMPILER_MISSING is not None, reason=COMPILER_MISSING or "")
@pytest.mark.skipif(_nvdisasm_missing() is not None, reason=_nvdisasm_missing() or "")
@pytest.mark.parametrize("layout", list(BOUNDS))
def test_weight_only_main_loop_instructions_per_element(layout):
    from tilemm.kernels import weight_only_kernels as wo

    cfg = wo.plan(16, 2048, 14336, decode_cost._layout(layout))
    variant, elements, unroll = decode_cost.weight_only_variant(layout, cfg)
    row = decode_cost.report(variant, elements, unroll)  # main_loop raises unless the loop holds HGMMA
    assert row["per_element"] <= BOUNDS[layout], (
        f"{variant.name}: {row['per_element']:.2f} SASS instructions per weight element in the main loop "
        f"(bound {BOUNDS[layout]}): {row['top']}")


@pytest.mark.skipif(COMPILER_MISSING is not None, reason=COMPILER_MISSING or "")
@pytest.mark.skipif(_nvdisasm_missing() is not None, reason=_nvdisasm_missing() or "")
@pytest.mark.parametrize("layout", list(FMA_BOUNDS))
def test_fma_kernel_main_loop_instructions_per_element(layout):
    from tilemm.kernels import weight_only_kernels as wo

    cfg = wo.plan(1, 14336, 4096, decode_cost._layout(layout))
    assert cfg.gemv
    variant, elements, unroll = decode_cost.weight_only_variant(layout, cfg)
    row = decode_cost.report(variant, elements, unroll)  # main_loop raises unless the loop holds FFMA
    assert row["per_element"] <= FMA_BOUNDS[layout], (
        f"{variant.name}: {row['per_element']:.2f} SASS instructions per weight element in the main loop "
        f"(bound {FMA_BOUNDS[layout]}): {row['top']}")


@pytest.mark.skipif(COMPILER_MISSING is not None, reason=COMPILER_MISSING or "")
@pytest.mark.skipif(_nvdisasm_missing() is not None, reason=_nvdisasm_missing() or "")
@pytest.mark.parametrize("layout", list(STACKED_BOUNDS))
@pytest.mark.parametrize("n", [8192, 4096, 1024])
def test_stacked_main_loop_instructions_per_element(layout, n):
    from tilemm.kernels import weight_only_kernels as wo

    cfg = wo.plan(4, n, 4096, decode_cost._layout(layout))
    assert cfg.stack > 1
    bound = (FEW_STACKED_BOUNDS if n == 1024 else STACKED_BOUNDS)[layout]
    variant, elements, unroll = decode_cost.weight_only_variant(layout, cfg)
    row = decode_cost.report(variant, elements, unroll)
    assert row["per_element"] <= bound, (
        f"{variant.name}: {row['per_element']:.2f} SASS instructions per weight element in the main loop "
        f"(bound {bound}): {row['top']}")


#: One row of x on the MMA kernel (``plan(..., m1_kernel="mma")``): the stacked configs above, at most
#: 4 instructions per weight element (the FMA kernel's 7.3-9.6 is what it replaces).
M1_MMA_BOUND = 4.0


@pytest.mark.skipif(COMPILER_MISSING is not None, reason=COMPILER_MISSING or "")
@pytest.mark.skipif(_nvdisasm_missing() is not None, reason=_nvdisasm_missing() or "")
@pytest.mark.parametrize("layout", list(STACKED_BOUNDS))
@pytest.mark.parametrize("n", [14336, 4096])
def test_one_row_mma_main_loop_instructions_per_element(layout, n):
    from tilemm.kernels import weight_only_kernels as wo

    cfg = wo.plan(1, n, 4096, decode_cost._layout(layout), m1_kernel="mma")
    assert cfg.stack > 1 and not cfg.gemv
    variant, elements, unroll = decode_cost.weight_only_variant(layout, cfg)
    row = decode_cost.report(variant, elements, unroll)
    assert row["per_element"] <= min(M1_MMA_BOUND, STACKED_BOUNDS[layout]), (
        f"{variant.name}: {row['per_element']:.2f} SASS instructions per weight element in the main loop "
        f"(bound {M1_MMA_BOUND}): {row['top']}")


#: The large-M fused kernel (``hopper_weight_only_large``, 128x128, one MMA per K tile), MXFP4: 3.22
#: with tileiras 13.4.
LARGE_BOUND = 3.5


@pytest.mark.skipif(COMPILER_MISSING is not None, reason=COMPILER_MISSING or "")
@pytest.mark.skipif(_nvdisasm_missing() is not None, reason=_nvdisasm_missing() or "")
def test_large_m_kernel_main_loop_instructions_per_element():
    from tilemm.kernels import hopper_weight_only_large as wol

    variant, elements, unroll = decode_cost.large_variant("mxfp4", wol.CANDIDATES[0])
    row = decode_cost.report(variant, elements, unroll)  # main_loop raises unless the loop holds HGMMA
    assert row["per_element"] <= LARGE_BOUND, (
        f"{variant.name}: {row['per_element']:.2f} SASS instructions per weight element in the main loop "
        f"(bound {LARGE_BOUND}): {row['top']}")


#: The fused kernel's one-warpgroup split blocks that the weight-only runner takes at few rows of x
#: (``decode_cost.few_rows_fused``: 64 weight rows by 16 / 32 rows of x for 4-bit weights, by 64 for
#: 8-bit ones): 2.98 / 3.02 MXFP4, 3.62 / 3.65 NVFP4, 4.86 MXFP8 with tileiras 13.4.
FEW_ROWS_BOUNDS = {"mxfp4": 3.2, "nvfp4": 3.9, "nvfp4_normal": 3.7, "mxfp8_e4m3": 5.1}  # normal: 3.59 / 3.62


@pytest.mark.skipif(COMPILER_MISSING is not None, reason=COMPILER_MISSING or "")
@pytest.mark.skipif(_nvdisasm_missing() is not None, reason=_nvdisasm_missing() or "")
@pytest.mark.parametrize("layout", list(FEW_ROWS_BOUNDS))
def test_few_rows_fused_main_loop_instructions_per_element(layout):
    cfgs = decode_cost.few_rows_fused(layout)
    assert cfgs and all(c.kind == "fused" and c.split_k == 2 for c in cfgs)
    for cfg in cfgs:
        variant, elements, unroll = decode_cost.large_variant(layout, cfg)
        row = decode_cost.report(variant, elements, unroll)  # main_loop raises unless the loop holds HGMMA
        assert row["per_element"] <= FEW_ROWS_BOUNDS[layout], (
            f"{variant.name}: {row['per_element']:.2f} SASS instructions per weight element in the main loop "
            f"(bound {FEW_ROWS_BOUNDS[layout]}): {row['top']}")
