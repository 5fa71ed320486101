"""Bit-exact tests of tilemm.quantize against an independent oracle written here.

The oracle shares no code with the library: it works one block at a time on Python floats, does
every fp32 operation exactly on integer ratios and rounds once to fp32 (nearest even),
and rounds to e4m3 / e5m2 / e2m1 by searching a table of all representable values built from the
format definitions (ties go to the even code). Scale bytes come from the definitions ("smallest
power of two >= d", "floor(log2(amax))") via ``math.frexp``, not from fp32 bit tricks.
"""

from __future__ import annotations

import bisect
import math
import random
import struct
from fractions import Fraction

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import swizzle
import tilemm.nn
from tilemm.formats import FP8_E4M3, FP8_E5M2, MXFP4, MXFP8_E4M3, MXFP8_E5M2, NVFP4
from tilemm.numerics import as_uint8
from tilemm.quantize import (
    FP8Tensor,
    MXFP4Tensor,
    MXFP8Tensor,
    NVFP4Tensor,
    dequantize,
    dequantize_fp8,
    dequantize_mxfp4,
    dequantize_mxfp8,
    dequantize_nvfp4,
    quantize_fp8,
    quantize_mxfp4,
    quantize_mxfp8,
    quantize_nvfp4,
)

INF = math.inf
NAN = math.nan
FLT_MAX = float(np.finfo(np.float32).max)
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
DTYPE_IDS = ["fp32", "bf16", "fp16"]

# ==============================================================================================
# The oracle
# ==============================================================================================


def _round_ratio_to_f32(num: int, den: int) -> float:
    """Nearest-even fp32 to num/den >= 0 (integers, exact); inf past the largest finite value."""
    if num == 0:
        return 0.0
    e = num.bit_length() - den.bit_length()
    if (num << max(-e, 0)) < (den << max(e, 0)):
        e -= 1  # now 2^e <= num/den < 2^(e+1)
    shift = 23 - max(e, -126)  # the fp32 step there is 2^-shift (subnormals share 2^-149)
    if shift >= 0:
        n, rem = divmod(num << shift, den)
        step_den = den
    else:
        step_den = den << -shift
        n, rem = divmod(num, step_den)
    if 2 * rem > step_den or (2 * rem == step_den and n % 2 == 1):
        n += 1
    r = math.ldexp(n, -shift)
    return INF if r > FLT_MAX else r


def _round_to_f32(q: Fraction) -> float:
    return _round_ratio_to_f32(q.numerator, q.denominator)


def f32(v) -> float:
    """fp32(v) for a Python float or Fraction."""
    if isinstance(v, float) and not math.isfinite(v):
        return v
    q = Fraction(v)
    return math.copysign(_round_to_f32(abs(q)), -1.0 if q < 0 else 1.0)


def f32_mul(a: float, b: float) -> float:
    if not (math.isfinite(a) and math.isfinite(b)):
        return a * b  # IEEE: inf * 0 = nan, inf * x = inf, nan propagates
    sign = math.copysign(1.0, a) * math.copysign(1.0, b)
    na, da = abs(a).as_integer_ratio()
    nb, db = abs(b).as_integer_ratio()
    return math.copysign(_round_ratio_to_f32(na * nb, da * db), sign)


def f32_div(a: float, b: float) -> float:
    if math.isnan(a) or math.isnan(b):
        return NAN
    sign = math.copysign(1.0, a) * math.copysign(1.0, b)
    if math.isinf(a):
        return NAN if math.isinf(b) else math.copysign(INF, sign)
    if math.isinf(b):
        return math.copysign(0.0, sign)
    if b == 0:
        return NAN if a == 0 else math.copysign(INF, sign)
    na, da = abs(a).as_integer_ratio()
    nb, db = abs(b).as_integer_ratio()
    return math.copysign(_round_ratio_to_f32(na * db, da * nb), sign)


def _table(exp_bits: int, man_bits: int, bias: int, finite_codes: int) -> list[float]:
    """Magnitudes of codes 0..finite_codes-1 (code = exponent << man_bits | mantissa)."""
    values = []
    for code in range(finite_codes):
        e, m = code >> man_bits, code & ((1 << man_bits) - 1)
        if e == 0:
            values.append(math.ldexp(m, 1 - bias - man_bits))
        else:
            values.append(math.ldexp((1 << man_bits) + m, e - bias - man_bits))
    assert values == sorted(values)
    return values


E4M3_VALUES = _table(4, 3, 7, 127)  # code 127 (0x7F) is NaN
E5M2_VALUES = _table(5, 2, 15, 124)  # 124 is inf, 125..127 NaN
E2M1_VALUES = _table(2, 1, 1, 8)
ELEMENTS = {"e4m3": (E4M3_VALUES, 0x80), "e5m2": (E5M2_VALUES, 0x80), "e2m1": (E2M1_VALUES, 0x8)}
QMAX = {"e4m3": 448.0, "e5m2": 57344.0, "e2m1": 6.0}
EMAX = {"e4m3": 8, "e5m2": 15, "e2m1": 2}
assert E4M3_VALUES[-1] == 448.0 and E5M2_VALUES[-1] == 57344.0
assert E2M1_VALUES == [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def nearest_code(a: float, values: list[float]) -> int:
    """Code of the nearest table value to a >= 0, ties to the even code, saturating at the top."""
    if a >= values[-1]:
        return len(values) - 1
    i = bisect.bisect_right(values, a) - 1  # values[i] <= a < values[i + 1]
    mid = (values[i] + values[i + 1]) / 2  # exact in double
    if a != mid:
        return i if a < mid else i + 1
    return i if i % 2 == 0 else i + 1


def fp8_byte(y: float, element: str) -> int:
    """cast_RNE_satfinite to an fp8 byte; NaN -> 0x7F; the sign of -0.0 is kept (as torch)."""
    if math.isnan(y):
        return 0x7F
    values, sign_bit = ELEMENTS[element]
    code = nearest_code(abs(y), values)
    return code | (sign_bit if math.copysign(1.0, y) < 0 else 0)


def e2m1_code(y: float) -> int:
    """e2m1 RNE code; sign bit iff y < 0 (so -0.0 and NaN give 0)."""
    if math.isnan(y):
        return 0
    return nearest_code(abs(y), E2M1_VALUES) | (0x8 if y < 0 else 0)


def fp8_value(byte: int, element: str) -> float:
    if element == "e4m3" and byte & 0x7F == 0x7F:
        return NAN
    values, sign_bit = ELEMENTS[element]
    v = values[byte & 0x7F]
    return -v if byte & sign_bit else v


def smallest_pow2_at_least(d: float) -> int:
    """k with 2^k the smallest power of two >= d > 0 (from frexp: d = m * 2^e, 0.5 <= m < 1)."""
    m, e = math.frexp(d)
    return e - 1 if m == 0.5 else e


def oracle_mx_scale(block: list[float], element: str, rounding: str) -> int:
    if any(not math.isfinite(v) for v in block):
        return 255
    amax = max(abs(v) for v in block)
    if rounding == "rceil":
        d = f32_mul(amax, f32(Fraction(1) / Fraction(QMAX[element])))
        return 0 if d == 0 else min(max(smallest_pow2_at_least(d) + 127, 0), 254)
    if amax == 0:
        return 0
    _, e = math.frexp(amax)  # floor(log2(amax)) = e - 1
    return min(max(e - 1 - EMAX[element] + 127, 0), 254)


def oracle_mx_block(block: list[float], element: str, rounding: str) -> tuple[int, list[int]]:
    """(scale byte, element codes) for one MX block."""
    s = oracle_mx_scale(block, element, rounding)
    if s == 0:
        return s, [0] * len(block)
    if s == 255:
        return s, [0x7F if element != "e2m1" else 0] * len(block)
    mult = 2.0 ** (127 - s)
    ys = [f32_mul(v, mult) for v in block]
    if element == "e2m1":
        return s, [e2m1_code(y) for y in ys]
    return s, [fp8_byte(y, element) for y in ys]


def pack_codes(codes: list[int]) -> list[int]:
    return [codes[i] | (codes[i + 1] << 4) for i in range(0, len(codes), 2)]


def oracle_mx(rows: list[list[float]], element: str, rounding: str):
    """Expected data bytes and scale bytes for rows of K values (blocks of 32)."""
    data, scales = [], []
    for row in rows:
        row_data, row_scales = [], []
        for j in range(0, len(row), 32):
            s, codes = oracle_mx_block(row[j:j + 32], element, rounding)
            row_scales.append(s)
            row_data.extend(codes)
        data.append(pack_codes(row_data) if element == "e2m1" else row_data)
        scales.append(row_scales)
    return data, scales


def oracle_nvfp4_global(values: list[float]) -> tuple[float, float]:
    """(S_enc, S_dec) from the tensor amax over the finite values (NaN and Inf ignored)."""
    amax_g = max((abs(v) for v in values if math.isfinite(v)), default=0.0)
    s_enc = min(f32_div(2688.0, amax_g), FLT_MAX)
    if amax_g == 0 or s_enc == 0:
        s_enc = 1.0
    return s_enc, f32_div(1.0, s_enc)


def oracle_nvfp4(rows: list[list[float]], global_scale: float | None = None):
    """Expected (data bytes, scale bytes, decode scale) for rows of K values (blocks of 16)."""
    if global_scale is None:
        s_enc, s_dec = oracle_nvfp4_global([v for row in rows for v in row])
    else:
        s_dec = global_scale
        s_enc = min(f32_div(1.0, s_dec), FLT_MAX)
    t = f32_mul(s_enc, f32(Fraction(1, 6)))
    data, scales = [], []
    for row in rows:
        row_codes, row_scales = [], []
        for j in range(0, len(row), 16):
            block = row[j:j + 16]
            # A block holding a NaN or an Inf gets the NaN scale.
            amax_b = NAN if any(not math.isfinite(v) for v in block) else max(abs(v) for v in block)
            v = f32_mul(amax_b, t)
            v = v if math.isnan(v) else min(v, 448.0)
            sb_byte = fp8_byte(v, "e4m3")
            sb = fp8_value(sb_byte, "e4m3")
            enc = f32_div(1.0, f32_mul(sb, s_dec))
            enc = enc if math.isnan(enc) else min(enc, FLT_MAX)
            for x in block:
                y = f32_mul(x, enc)
                y = y if math.isnan(y) else min(max(y, -6.0), 6.0)
                row_codes.append(e2m1_code(y))
            row_scales.append(sb_byte)
        data.append(pack_codes(row_codes))
        scales.append(row_scales)
    return data, scales, s_dec


F32_1EM4 = f32(Fraction(1, 10000))


def oracle_fp8(mats: list[list[list[float]]], granularity, element: str, pow2: bool):
    """Expected (data bytes, scales) for a list of (M, K) matrices.

    Scales come back as nested lists shaped like the library's: per matrix a float (tensor
    granularity: one float for all), (M, 1), (M, K/128) or (ceil(M/128), K/128).
    """
    qmax = QMAX[element]

    def group_scale(vals: list[float], block_form: bool) -> float:
        if any(not math.isfinite(v) for v in vals):
            return NAN
        amax = max((abs(v) for v in vals), default=0.0)
        if not block_form:
            s = f32_div(amax, qmax)
            return 1.0 if s == 0 else s
        s = f32_div(max(amax, F32_1EM4), 448.0)
        return math.ldexp(1.0, smallest_pow2_at_least(s)) if pow2 else s

    def quant(v: float, s: float) -> int:
        return fp8_byte(f32_div(v, s), element)

    if granularity == "tensor":
        s = group_scale([v for m in mats for r in m for v in r], False)
        return [[[quant(v, s) for v in r] for r in m] for m in mats], s
    data, scales = [], []
    for m in mats:
        rows, k = len(m), len(m[0])
        if granularity == "row":
            sc = [[group_scale(r, False)] for r in m]
            scale_of = lambda i, j: sc[i][0]  # noqa: E731
        elif granularity == (1, 128):
            sc = [[group_scale(r[j:j + 128], True) for j in range(0, k, 128)] for r in m]
            scale_of = lambda i, j: sc[i][j // 128]  # noqa: E731
        else:
            sc = [[group_scale([v for r in m[i:i + 128] for v in r[j:j + 128]], True)
                   for j in range(0, k, 128)] for i in range(0, rows, 128)]
            scale_of = lambda i, j: sc[i // 128][j // 128]  # noqa: E731
        data.append([[quant(m[i][j], scale_of(i, j)) for j in range(k)] for i in range(rows)])
        scales.append(sc)
    return data, scales


# ==============================================================================================
# Comparison helpers
# ==============================================================================================


def assert_bytes(actual: torch.Tensor, expected, x: torch.Tensor | None = None, what="data"):
    a = np.asarray(as_uint8(actual).cpu().numpy(), dtype=np.int64)
    e = np.asarray(expected, dtype=np.int64).reshape(a.shape)
    bad = np.argwhere(a != e)
    if len(bad):
        lines = [f"{len(bad)} of {a.size} {what} bytes differ; first ones:"]
        for idx in bad[:8]:
            idx = tuple(int(i) for i in idx)
            lines.append(f"  at {idx}: got 0x{a[idx]:02x}, expected 0x{e[idx]:02x}")
        if x is not None and what == "data":
            lines.append(f"  input rows: {[x.float().reshape(-1, x.shape[-1])[i[0]].tolist()[:8] for i in bad[:2]]}")
        pytest.fail("\n".join(lines))


def assert_f32_equal(actual: torch.Tensor, expected):
    exp = torch.tensor(expected, dtype=torch.float32).reshape(actual.shape)
    torch.testing.assert_close(actual.cpu(), exp, rtol=0, atol=0, equal_nan=True)


def nextafter32(v: float, direction: float) -> float:
    return float(np.nextafter(np.float32(v), np.float32(direction)))


def to_rows(x: torch.Tensor) -> list[list[float]]:
    return x.float().reshape(-1, x.shape[-1]).tolist()


# ==============================================================================================
# Awkward inputs
# ==============================================================================================

# Binade ranges each input dtype can hold without overflow or flush to zero (fp16 is narrow).
EXP_RANGE = {torch.float32: 100, torch.bfloat16: 100, torch.float16: 12}


def _signed(rng: random.Random, v: float) -> float:
    return v if rng.random() < 0.5 else -v


def _fill(rng: random.Random, first: list[float], size: int, scale: float) -> list[float]:
    """A block that starts with ``first`` and continues with random values below ``scale``."""
    rest = [rng.uniform(-1.0, 1.0) * scale for _ in range(size - len(first))]
    return list(first) + rest


def awkward_blocks(element: str, block: int, dtype: torch.dtype, seed: int = 0) -> list[list[float]]:
    """Blocks of ``block`` values chosen to hit every branch of the MX/FP8 numerics."""
    rng = random.Random(seed)
    qmax = QMAX[element]
    values = ELEMENTS[element][0]
    erange = EXP_RANGE[dtype]
    out: list[list[float]] = []
    # Random blocks over the exponent range: the scale byte sweeps its range.
    for e in sorted({0, -erange, -erange // 2, -erange // 4, -3, 3, erange // 4, erange // 2, erange}):
        out.append([rng.gauss(0.0, 1.0) * 2.0 ** e for _ in range(block)])
    # All-zero blocks and signed zeros: scale byte 0 / s_b = 0, zero data.
    out.append([0.0] * block)
    out.append([-0.0 if i % 2 else 0.0 for i in range(block)])
    # Blocks whose maximum sits exactly on Qmax * 2^k and one fp32 ulp either side: the scale
    # rounds up right at these points, and a FLOOR scale clips just above them.
    for k in (0, -5, 7):
        if abs(k) + 1 > erange:
            continue
        for amax in (qmax * 2.0 ** k, nextafter32(qmax * 2.0 ** k, INF), nextafter32(qmax * 2.0 ** k, 0)):
            out.append(_fill(rng, [_signed(rng, amax)], block, amax))
    # Results in the element format's subnormal range: one large value sets the scale, the
    # others are 2^-12 .. 2^-5 of it (e4m3 subnormals are 2^-9 .. 7 * 2^-9 of the 2^0 binade).
    out.append([qmax] + [_signed(rng, qmax * 2.0 ** rng.uniform(-13, -5)) for _ in range(block - 1)])
    # Ties: amax = Qmax (scale byte 127 for both rounding modes since Qmax * fp32(1/Qmax) == 1),
    # then every midpoint between neighbouring element values, and the fp32 values just above and
    # below it, which must round away from the tie.
    mids = [(values[i] + values[i + 1]) / 2 for i in range(len(values) - 1)]
    near = []
    for mid in mids:
        near += [mid, nextafter32(mid, INF), nextafter32(mid, 0)]
    near = [_signed(rng, v) for v in near]
    for j in range(0, len(near), block - 1):
        chunk = near[j:j + block - 1]
        out.append([qmax] + chunk + [0.0] * (block - 1 - len(chunk)))
    if dtype != torch.float16:
        # fp32 subnormal inputs (bf16 has them too): amax/Qmax <= 2^-127 gives scale byte 0.
        out.append([rng.uniform(-1, 1) * 2.0 ** -130 for _ in range(block)])
        out.append([2.0 ** -149] + [0.0] * (block - 1))
        # d = amax * fp32(1/Qmax) lands in fp32 subnormals around 2^-127: byte 0 vs byte 1.
        for amax in (qmax * 2.0 ** -127, qmax * 2.0 ** -126, qmax * 1.5 * 2.0 ** -127,
                     nextafter32(qmax * 2.0 ** -127, INF), nextafter32(qmax * 2.0 ** -127, 0)):
            out.append(_fill(rng, [amax], block, amax))
        # Very large blocks: the scale byte near its top; the dtype's largest finite value.
        top = float(torch.finfo(dtype).max)
        out.append(_fill(rng, [top], block, top))
        out.append(_fill(rng, [-2.0 ** 127], block, 2.0 ** 120))
    else:
        out.append(_fill(rng, [65504.0], block, 65504.0))  # fp16 maximum
        out.append([2.0 ** -24] + [0.0] * (block - 1))  # fp16 smallest subnormal
    # One huge value and tiny companions: most of the block rounds to (signed) zero.
    big = 2.0 ** min(erange, 40)
    out.append([big] + [_signed(rng, big * 2.0 ** -rng.uniform(10, 30)) for _ in range(block - 1)])
    return out


def make_input(blocks: list[list[float]], block: int, k_blocks: int, dtype: torch.dtype) -> torch.Tensor:
    """Concatenate blocks into rows of k_blocks blocks (padding with zero blocks), cast to dtype."""
    while len(blocks) % k_blocks:
        blocks = blocks + [[0.0] * block]
    flat = [v for b in blocks for v in b]
    x = torch.tensor(flat, dtype=torch.float32).reshape(-1, k_blocks * block)
    return x.to(dtype)


# ==============================================================================================
# Hand-written expectations
# ==============================================================================================

# The e2m1 tie table from docs/numerics.md, and the codes: midpoints go to the even code.
TIE_INPUTS = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
TIE_CODES = [0, 2, 2, 4, 4, 6, 6]  # 0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0


def test_nvfp4_tie_table_hand_written():
    # global_scale = 1 and a block maximum of 6 give s_b = e4m3(6 * fp32(1/6)) = 1.0 and enc = 1,
    # so x * enc is exactly the tie values. Negative ties carry the sign bit (8); a negative value
    # that rounds to zero keeps it too (-0.25 -> 8, as TE's reference), -0.0 gives code 0.
    x = torch.tensor([6.0] + TIE_INPUTS + [-v for v in TIE_INPUTS] + [-0.0])
    q = quantize_nvfp4(x, global_scale=1.0)
    codes = [7] + TIE_CODES + [c | 8 for c in TIE_CODES] + [0]
    assert as_uint8(q.scale).tolist() == [0x38]  # e4m3 1.0
    assert q.data.tolist() == pack_codes(codes)
    assert q.global_scale.item() == 1.0


@pytest.mark.parametrize("rounding", ["rceil", "floor"])
def test_mxfp4_tie_table_hand_written(rounding):
    # amax = 6: RCEIL d = 6 * fp32(1/6) rounds to exactly 1.0 -> byte 127; FLOOR 2 - 2 + 127 = 127.
    x = torch.tensor([6.0] + TIE_INPUTS + [-v for v in TIE_INPUTS] + [-0.0, -0.1] + [0.0] * 15)
    q = quantize_mxfp4(x, rounding=rounding)
    assert as_uint8(q.scale).tolist() == [127]
    codes = [7] + TIE_CODES + [c | 8 for c in TIE_CODES] + [0, 8] + [0] * 15
    assert q.data.tolist() == pack_codes(codes)
    # Packing: element 0 (6.0 -> 7) is the low nibble of byte 0, element 1 (0.25 -> 0) the high.
    assert q.data[0].item() == 0x07


def test_mxfp8_e4m3_ties_hand_written():
    # amax 448 -> byte 127 (multiply by 1): the values go straight to e4m3.
    x = torch.tensor([448.0,
                      1.0625,  # between 1.0 (0x38) and 1.125 (0x39): tie -> even 0x38
                      1.1875,  # between 1.125 (0x39) and 1.25 (0x3A): tie -> even 0x3A
                      2.0 ** -10,  # half the smallest subnormal: tie -> 0
                      3 * 2.0 ** -10,  # between 2^-9 (0x01) and 2^-8 (0x02): tie -> 0x02
                      432.0,  # between 416 (0x7D) and 448 (0x7E): tie -> even 0x7E
                      -1.0625,  # sign kept: 0xB8
                      -2.0 ** -11,  # rounds to zero, keeps the sign: 0x80
                      ] + [0.0] * 24)
    q = quantize_mxfp8(x)
    assert as_uint8(q.scale).tolist() == [127]
    assert as_uint8(q.data)[:8].tolist() == [0x7E, 0x38, 0x3A, 0x00, 0x02, 0x7E, 0xB8, 0x80]


def test_nvfp4_block_scale_operation_order_hand_written():
    # docs/numerics.md fixes s_b = e4m3(amax_b * (S_enc * fp32(1/6))). For this pair the product is exactly
    # 1.1875, an e4m3 tie that rounds to even 1.25 (0x3A); the other association,
    # (amax_b * S_enc) * fp32(1/6), gives 1.1874999 -> 1.125 (0x39).
    amax_g, amax_b = float.fromhex("0x1.6065d0p+9"), float.fromhex("0x1.de4104p+0")
    x = torch.tensor([[amax_g] + [0.0] * 15, [amax_b] + [0.0] * 15])
    q = quantize_nvfp4(x)
    assert as_uint8(q.scale).tolist() == [[0x7E], [0x3A]]
    assert oracle_nvfp4(x.tolist())[1] == [[0x7E], [0x3A]]


# (element, rounding, amax, expected byte, why)
SCALE_BYTES = [
    ("e4m3", "rceil", 448.0, 127, "448 * fp32(1/448) rounds to exactly 1.0"),
    ("e4m3", "rceil", 449.0, 128, "just above Qmax: next power of two"),
    ("e4m3", "rceil", 1.0, 119, "fp32(1/448) is in (2^-9, 2^-8): 2^-8"),
    ("e4m3", "floor", 1.0, 119, "floor(log2 1) - 8 + 127"),
    ("e4m3", "floor", 511.0, 127, "floor(log2 511) = 8: 127, block max clips to 448"),
    ("e4m3", "rceil", 511.0, 128, "511/448 > 1"),
    ("e4m3", "rceil", FLT_MAX, 247, "FLT_MAX/448 ~ 2^119.2 -> 2^120"),
    ("e4m3", "floor", FLT_MAX, 246, "127 - 8 + 127"),
    ("e4m3", "rceil", 2.0 ** -126, 0, "d ~ 2^-134.8 is an fp32 subnormal <= 2^-127"),
    ("e5m2", "rceil", 57344.0, 127, "57344 * fp32(1/57344) == 1.0"),
    ("e5m2", "floor", 57344.0, 127, "15 - 15 + 127"),
    ("e5m2", "rceil", FLT_MAX, 240, "FLT_MAX/57344 ~ 2^112.2 -> 2^113"),
    ("e2m1", "rceil", 6.0, 127, "6 * fp32(1/6) == 1.0"),
    ("e2m1", "rceil", 6.5, 128, "6.5/6 > 1"),
    ("e2m1", "floor", 7.9, 127, "floor(log2 7.9) = 2: clips 7.9 to 6"),
    ("e2m1", "rceil", FLT_MAX, 253, "FLT_MAX/6 ~ 2^125.4 -> 2^126"),
    ("e2m1", "rceil", 6.0 * 2.0 ** -127, 0, "d = 2^-127 * (1 + 3e-8) rounds to the subnormal 2^-127"),
    ("e2m1", "rceil", 9.0 * 2.0 ** -127, 1, "d ~ 1.5 * 2^-127: mantissa 0x600000 > 0x400000"),
    ("e2m1", "floor", 9.0 * 2.0 ** -127, 1, "9 * 2^-127 ~ 2^-123.8: -124 - 2 + 127"),
    ("e4m3", "floor", 2.0 ** -120, 0, "-120 - 8 + 127 = -1 clamps to 0 (zero data)"),
    ("e4m3", "rceil", 0.0, 0, "zero block"),
    ("e4m3", "floor", 0.0, 0, "zero block"),
    ("e4m3", "rceil", NAN, 255, "NaN block"),
    ("e2m1", "floor", INF, 255, "Inf block (TE would write 254)"),
]


@pytest.mark.parametrize("element,rounding,amax,expected,why", SCALE_BYTES,
                         ids=[f"{e}-{r}-{a!r}" for e, r, a, _, _ in SCALE_BYTES])
def test_mx_scale_bytes_hand_written(element, rounding, amax, expected, why):
    x = torch.tensor([amax] + [0.0] * 31)
    if element == "e2m1":
        q = quantize_mxfp4(x, rounding=rounding)
    else:
        dt = torch.float8_e4m3fn if element == "e4m3" else torch.float8_e5m2
        q = quantize_mxfp8(x, elem_dtype=dt, rounding=rounding)
    assert as_uint8(q.scale).tolist() == [expected], why
    assert oracle_mx_scale([amax] + [0.0] * 31, element, rounding) == expected, why


# ==============================================================================================
# Bit-exact against the oracle on awkward inputs
# ==============================================================================================

ELEM_DTYPE = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
MX_ELEMENTS = pytest.mark.parametrize("element", ["e4m3", "e5m2", "e2m1"],
                                      ids=["mxfp8_e4m3", "mxfp8_e5m2", "mxfp4"])
ROUNDINGS = pytest.mark.parametrize("rounding", ["rceil", "floor"])
INPUT_DTYPES = pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)


def quantize_mx(x, element, rounding="rceil", swizzle=False):
    if element == "e2m1":
        return quantize_mxfp4(x, rounding=rounding, swizzle=swizzle)
    return quantize_mxfp8(x, elem_dtype=ELEM_DTYPE[element], rounding=rounding, swizzle=swizzle)


def check_mx_against_oracle(x, element, rounding):
    q = quantize_mx(x, element, rounding)
    exp_data, exp_scale = oracle_mx(to_rows(x), element, rounding)
    assert q.scale.dtype == torch.float8_e8m0fnu
    assert_bytes(q.scale, exp_scale, what="scale")
    assert_bytes(q.data, exp_data, x)
    return q


@INPUT_DTYPES
@ROUNDINGS
@MX_ELEMENTS
def test_mx_matches_oracle(element, rounding, dtype):
    blocks = awkward_blocks(element, 32, dtype, seed=1)
    x = make_input(blocks, 32, 4, dtype)
    q = check_mx_against_oracle(x, element, rounding)
    expected_dtype = torch.uint8 if element == "e2m1" else ELEM_DTYPE[element]
    assert q.data.dtype == expected_dtype


@ROUNDINGS
@MX_ELEMENTS
def test_mx_nonfinite_blocks(element, rounding):
    # A NaN or +-Inf anywhere in a block: scale byte 255 and NaN data (0x7F; code 0 for e2m1),
    # while the neighbouring finite block is quantized normally.
    rows = [[1.0] * 31 + [NAN], [2.0] * 32, [INF] + [1.0] * 31, [-INF] * 32]
    x = torch.tensor(rows).reshape(2, 64)
    q = check_mx_against_oracle(x, element, rounding)
    # The all-2.0 block: floor(log2 2) = 1 and 2/Qmax's power of two agree for both modes.
    finite_byte = {"e4m3": 1 - 8 + 127, "e5m2": 1 - 15 + 127, "e2m1": 1 - 2 + 127}[element]
    assert as_uint8(q.scale).tolist() == [[255, finite_byte], [255, 255]]
    deq = dequantize(q)
    assert deq[0, :32].isnan().all() and deq[1].isnan().all()
    assert torch.equal(deq[0, 32:], torch.full((32,), 2.0))


@pytest.mark.parametrize("bad", [INF, -INF, NAN], ids=["inf", "neg_inf", "nan"])
def test_nvfp4_nonfinite_poisons_only_its_block(bad):
    # As in MX: a block holding a NaN or an Inf gets the NaN scale (e4m3 0x7F) and decodes to NaN;
    # the tensor amax is taken over the finite values, so every other block is quantized as if it
    # were absent (docs/numerics.md, "NVFP4"). Before, an Inf made S_enc = 1 and flushed every small
    # block of the tensor to zero.
    x = torch.full((2, 32), 1e-3)
    x[0, 3] = bad
    q = quantize_nvfp4(x)
    clean = quantize_nvfp4(torch.full((2, 32), 1e-3))
    assert torch.equal(q.global_scale, clean.global_scale)
    assert as_uint8(q.scale)[0, 0].item() == 0x7F
    assert torch.equal(as_uint8(q.scale)[0, 1:], as_uint8(clean.scale)[0, 1:])
    assert torch.equal(as_uint8(q.scale)[1], as_uint8(clean.scale)[1])
    deq = dequantize(q)
    assert deq[0, :16].isnan().all()
    assert torch.equal(deq[0, 16:], dequantize(clean)[0, 16:]) and torch.equal(deq[1], dequantize(clean)[1])
    assert (deq[0, 16:] != 0).all()


def test_nvfp4_nonfinite_with_a_given_global_scale():
    # A given decode scale is used as given; the non-finite block still gets the NaN scale.
    x = torch.ones(1, 32)
    x[0, 20] = INF
    q = quantize_nvfp4(x, global_scale=1.0)
    assert q.global_scale.item() == 1.0
    assert as_uint8(q.scale).tolist() == [[as_uint8(quantize_nvfp4(torch.ones(1, 16), global_scale=1.0).scale)
                                           .item(), 0x7F]]


def test_nvfp4_linear_with_one_inf_keeps_other_rows():
    # One Inf in an activation row makes only that row's outputs NaN (the case: before, the
    # other rows became the bias alone).
    torch.manual_seed(0)
    layer = tilemm.nn.Linear.from_float(torch.nn.Linear(256, 64), "nvfp4")
    x = torch.randn(4, 256) * 1e-3
    ref = layer(x)
    x[0, 0] = INF
    y = layer(x)
    assert y[0].isnan().any()
    torch.testing.assert_close(y[1:], ref[1:], rtol=0, atol=0)
    assert not torch.equal(y[1:], layer.bias.expand(3, -1).to(y.dtype))


@pytest.mark.parametrize("granularity", ["tensor", "row", (1, 128)])
def test_fp8_inf_gives_the_nan_scale(granularity):
    # FP8 treats Inf as MX does: its scale group gets a NaN scale and NaN data (0x7F).
    x = torch.ones(2, 128)
    x[0, 5] = INF
    q = quantize_fp8(x, granularity=granularity)
    assert q.scale.flatten()[0].isnan()
    assert (as_uint8(q.data)[0] == 0x7F).all()


@settings(max_examples=80, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(block=st.lists(st.floats(width=32, allow_nan=False), min_size=32, max_size=32),
       element=st.sampled_from(["e4m3", "e5m2", "e2m1"]),
       rounding=st.sampled_from(["rceil", "floor"]))
def test_mx_random_fp32_blocks_match_oracle(block, element, rounding):
    # Arbitrary fp32 values, subnormals, extremes and infinities included.
    check_mx_against_oracle(torch.tensor(block, dtype=torch.float32), element, rounding)


def _nvfp4_case(name: str, dtype: torch.dtype) -> torch.Tensor:
    rng = random.Random(hash(name) % 1000)
    if name == "random":
        return torch.randn(8, 64, generator=torch.Generator().manual_seed(3)).to(dtype)
    if name == "wide_range":
        # Block maxima from 2^0 down to 2^-34 of the tensor's: s_b covers e4m3 normals,
        # subnormals (below 2^-6) and 0, where the formula stores saturated codes.
        lo = -34 if dtype != torch.float16 else -20
        blocks = [_fill(rng, [2.0 ** e], 16, 2.0 ** e) for e in range(0, lo - 1, -1)]
        blocks.append([2.0 ** -40] + [0.0] * 15 if dtype != torch.float16 else [0.0] * 16)
        return make_input(blocks, 16, 4, dtype)
    if name == "awkward":
        return make_input(awkward_blocks("e2m1", 16, dtype, seed=2), 16, 4, dtype)
    if name == "zeros":  # amax_g = 0: S_enc = 1, global scale 1, zero scales and data
        return torch.zeros(4, 32, dtype=dtype)
    if name == "signed_zeros":
        return torch.tensor([[0.0, -0.0] * 16] * 2, dtype=dtype)
    if name == "zero_blocks":  # zero blocks inside a random tensor: s_b = 0, enc = FLT_MAX
        x = torch.randn(4, 64, generator=torch.Generator().manual_seed(4))
        x[:, 16:32] = 0
        return x.to(dtype)
    if name == "subnormal_tensor":  # 2688 / amax_g overflows: S_enc is capped at FLT_MAX
        return (torch.rand(2, 32, generator=torch.Generator().manual_seed(5)) * 2.0 ** -135).to(dtype)
    if name == "largest_input":  # amax_g at the dtype's maximum
        big = FLT_MAX if dtype == torch.float32 else float(torch.finfo(dtype).max)
        x = torch.randn(2, 32, generator=torch.Generator().manual_seed(6)).to(dtype)
        x[0, 3] = big
        return x
    if name == "nan_block":  # NaN poisons only its block; the tensor amax ignores it
        x = torch.randn(2, 48, generator=torch.Generator().manual_seed(7))
        x[1, 20] = NAN
        return x.to(dtype)
    if name in ("inf_block", "neg_inf_block"):  # the Inf block gets the NaN scale; amax_g ignores it
        x = torch.randn(2, 48, generator=torch.Generator().manual_seed(8))
        x[0, 5] = INF if name == "inf_block" else -INF
        return x.to(dtype)
    raise KeyError(name)


NVFP4_CASES = ["random", "wide_range", "awkward", "zeros", "signed_zeros", "zero_blocks",
               "subnormal_tensor", "largest_input", "nan_block", "inf_block", "neg_inf_block"]
# fp16 cannot hold fp32 subnormals: that case would only repeat "zeros".
NVFP4_PARAMS = [(c, d) for c in NVFP4_CASES for d in DTYPES
                if not (c == "subnormal_tensor" and d == torch.float16)]


@pytest.mark.parametrize("case,dtype", NVFP4_PARAMS,
                         ids=[f"{c}-{i}" for c, d in NVFP4_PARAMS for i in [DTYPE_IDS[DTYPES.index(d)]]])
def test_nvfp4_matches_oracle(case, dtype):
    x = _nvfp4_case(case, dtype)
    q = quantize_nvfp4(x)
    exp_data, exp_scale, exp_gs = oracle_nvfp4(to_rows(x))
    assert q.scale.dtype == torch.float8_e4m3fn and q.data.dtype == torch.uint8
    assert q.global_scale.dtype == torch.float32 and q.global_scale.ndim == 0
    assert_f32_equal(q.global_scale, exp_gs)
    assert_bytes(q.scale, exp_scale, what="scale")
    assert_bytes(q.data, exp_data, x)


def _given_scale_is_refused(rows, gs: float) -> bool:
    """Whether every non-zero finite block's s_b (before rounding) would round to e4m3 zero (at or
    below 2^-10) or clamp at 448 (above 464, the midpoint to 480): such a given scale is refused."""
    t = f32_mul(min(f32_div(1.0, gs), FLT_MAX), f32(Fraction(1, 6)))
    ts = [f32_mul(max(abs(v) for v in row[j:j + 16]), t) for row in rows for j in range(0, len(row), 16)
          if all(math.isfinite(v) for v in row[j:j + 16]) and any(v != 0 for v in row[j:j + 16])]
    return bool(ts) and (all(v <= 2.0 ** -10 for v in ts) or all(v > 464.0 for v in ts))


def test_nvfp4_encode_scale_given_as_global_scale_is_refused():
    # compressed-tensors stores the encode scale 2688 / amax; passed as tilemm's decode scale it made
    # every block round to zero, silently. The message names the convention and the conversion.
    # (With amax below 4, 1 / encode puts every s_b = amax_b * amax / 16128 under e4m3's half-subnormal.)
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(0)) * 0.5
    encode = 448 * 6 / x.abs().max().item()
    with pytest.raises(ValueError, match=r"decode scale, amax / 2688.*1 / encode_scale"):
        quantize_nvfp4(x, global_scale=encode)
    with pytest.raises(ValueError, match="saturate"):  # a scale so small that every block clamps
        quantize_nvfp4(x, global_scale=1e-6)
    ok = quantize_nvfp4(x, global_scale=1 / encode)  # the right convention
    assert torch.equal(ok.scale, quantize_nvfp4(x).scale)
    # One block only, the largest exactly at 448 under its own decode scale: not refused.
    one = quantize_nvfp4(x[:1, :16])
    quantize_nvfp4(x[:1, :16], global_scale=one.global_scale)
    # Some blocks saturating, or zero and NaN blocks besides, are allowed: only "every block" is refused.
    mixed = torch.cat([x[:1, :16] * 1e6, x[:1, :16]], dim=1)
    quantize_nvfp4(mixed, global_scale=quantize_nvfp4(x[:1, :16]).global_scale)
    quantize_nvfp4(torch.zeros(2, 32), global_scale=1e6)


# Given decode scales: a power of two, a value whose reciprocal is inexact, one so small that
# 1 / global_scale is huge (s_b saturates at 448), an fp32 subnormal whose reciprocal overflows
# (S_enc is capped at FLT_MAX, so zero blocks still get s_b = 0, not 0 * inf = NaN), and one so
# large that s_b underflows.
GIVEN_GLOBAL_SCALES = [1.0, 2.0 ** -3, 0.37, 1e-30, 1e-40, 3e4]


@pytest.mark.parametrize("gs", GIVEN_GLOBAL_SCALES, ids=[repr(g) for g in GIVEN_GLOBAL_SCALES])
@pytest.mark.parametrize("case", ["random", "awkward"])
def test_nvfp4_given_global_scale_matches_oracle(case, gs):
    x = _nvfp4_case(case, torch.float32)
    if _given_scale_is_refused(to_rows(x), f32(gs)):
        with pytest.raises(ValueError, match="decode scale"):
            quantize_nvfp4(x, global_scale=gs)
        return
    q = quantize_nvfp4(x, global_scale=gs)
    exp_data, exp_scale, exp_gs = oracle_nvfp4(to_rows(x), global_scale=f32(gs))
    assert_f32_equal(q.global_scale, exp_gs)
    assert_bytes(q.scale, exp_scale, what="scale")
    assert_bytes(q.data, exp_data, x)


def _fp8_input(case: str, element: str, k: int, dtype: torch.dtype, m: int) -> torch.Tensor:
    if case == "awkward":
        x = make_input(awkward_blocks(element, 128, dtype, seed=3), 128, k // 128, dtype)
        # Pad with random rows, to 130 for 128x128 so that there is a partial last row block.
        extra = torch.randn(max(m - x.shape[0], 0), k, generator=torch.Generator().manual_seed(9))
        return torch.cat([x, extra.to(dtype)])
    if case == "scaled_rows":  # each row its own binade, so per-row scales differ
        g = torch.Generator().manual_seed(10)
        erange = min(EXP_RANGE[dtype], 30)
        scale = 2.0 ** torch.randint(-erange, erange + 1, (m, 1), generator=g).float()
        return (torch.randn(m, k, generator=g) * scale).to(dtype)
    if case == "ties":
        # Tensor and row maxima equal Qmax, so s = 1 (and 1x128 / 128x128 blocks: 448 / 448 = 1
        # for e4m3): x / s is exactly each midpoint of the element grid.
        values = ELEMENTS[element][0]
        mids = [(values[i] + values[i + 1]) / 2 for i in range(len(values) - 1)]
        rows = []
        for j in range(0, len(mids), k - 1):
            chunk = mids[j:j + k - 1]
            rows.append([QMAX[element]] + chunk + [-m for m in chunk][: k - 1 - len(chunk)]
                        + [0.0] * max(0, k - 1 - 2 * len(chunk)))
        return torch.tensor(rows).to(dtype)
    if case == "zeros_and_subnormals":  # amax = 0 (s = 1 / 1e-4 floor) and tiny amax rows
        x = torch.zeros(5, k)
        if dtype != torch.float16:
            x[1, :5] = torch.tensor([2.0 ** -149, -2.0 ** -140, 2.0 ** -127, 1e-39, -1e-38])
            x[2, 7] = 2.0 ** -126
            # amax / Qmax underflows to 0 in fp32: per row, the scale must be 1 (not 0 -> inf data).
            x[4, :2] = torch.tensor([2.0 ** -149, -2.0 ** -145])
        x[3, :3] = torch.tensor([1e-5, -3e-5, 6e-5])  # below the 1e-4 block amax floor
        return x.to(dtype)
    raise KeyError(case)


FP8_GRANULARITIES = [("tensor", "e4m3", False), ("tensor", "e5m2", False), ("row", "e4m3", False),
                     ("row", "e5m2", False), ((1, 128), "e4m3", False), ((1, 128), "e4m3", True),
                     ((128, 128), "e4m3", False), ((128, 128), "e4m3", True)]
FP8_IDS = [f"{g if isinstance(g, str) else 'x'.join(map(str, g))}-{e}{'-pow2' if p else ''}"
           for g, e, p in FP8_GRANULARITIES]


@INPUT_DTYPES
@pytest.mark.parametrize("case", ["awkward", "scaled_rows", "ties", "zeros_and_subnormals"])
@pytest.mark.parametrize("granularity,element,pow2", FP8_GRANULARITIES, ids=FP8_IDS)
def test_fp8_matches_oracle(granularity, element, pow2, case, dtype):
    # 130 rows give 128x128 a partial last row block; the other granularities need fewer.
    x = _fp8_input(case, element, 256, dtype, m=130 if granularity == (128, 128) else 24)
    q = quantize_fp8(x, granularity=granularity, elem_dtype=ELEM_DTYPE[element], pow2_scale=pow2)
    exp_data, exp_scale = oracle_fp8([x.float().tolist()], granularity, element, pow2)
    assert q.scale.dtype == torch.float32 and q.data.dtype == ELEM_DTYPE[element]
    if granularity == "tensor":
        assert q.scale.ndim == 0
        assert_f32_equal(q.scale, exp_scale)
    else:
        assert_f32_equal(q.scale, exp_scale[0])
    assert_bytes(q.data, exp_data[0], x)


@pytest.mark.parametrize("granularity", ["tensor", "row", (1, 128), (128, 128)],
                         ids=["tensor", "row", "1x128", "128x128"])
def test_fp8_nonfinite_poisons_its_group(granularity):
    x = torch.randn(130, 256, generator=torch.Generator().manual_seed(11))
    x[3, 5] = -NAN  # a negative NaN must still store 0x7F, whatever the device does with payloads
    x[129, 200] = -INF
    q = quantize_fp8(x, granularity=granularity)
    exp_data, exp_scale = oracle_fp8([x.tolist()], granularity, "e4m3", False)
    assert_bytes(q.data, exp_data if granularity == "tensor" else exp_data[0], x)
    assert_f32_equal(q.scale, exp_scale if granularity == "tensor" else exp_scale[0])
    deq = dequantize(q)
    poisoned = {"tensor": deq, "row": deq[3], (1, 128): deq[3, :128], (128, 128): deq[:128, :128]}
    assert poisoned[granularity].isnan().all()
    if granularity != "tensor":
        assert not deq[4:128, 128:].isnan().any()


def test_fp8_scale_underflow_hand_written():
    # amax = 2^-145: amax / 448 ~ 2^-153.8 rounds to 0 in fp32, so the scale is 1.0 and x / 1
    # rounds to signed zeros; the data must not be x / 0 = +-inf saturated to +-448.
    x = torch.tensor([2.0 ** -149, -2.0 ** -145, 0.0, -0.0])
    q = quantize_fp8(x)
    assert q.scale.item() == 1.0
    assert as_uint8(q.data).tolist() == [0x00, 0x80, 0x00, 0x80]


def test_fp8_pow2_scales_are_powers_of_two_at_least_the_plain_scale():
    x = torch.randn(130, 384, generator=torch.Generator().manual_seed(12)) * 37.0
    for gran in [(1, 128), (128, 128)]:
        plain = quantize_fp8(x, granularity=gran).scale
        pow2 = quantize_fp8(x, granularity=gran, pow2_scale=True).scale
        mant, _ = np.frexp(pow2.numpy())
        assert (mant == 0.5).all()
        assert (pow2 >= plain).all() and (pow2 < 2 * plain).all()


# ==============================================================================================
# Round trips
# ==============================================================================================

# Half the element grid spacing, as (relative to |y|, absolute floor) in element units: e4m3 has 3
# mantissa bits and subnormal spacing 2^-9, e5m2 2 bits and 2^-16, e2m1 spacing <= |y|/2 and 0.5.
HALF_SPACING = {"e4m3": (2.0 ** -4, 2.0 ** -10), "e5m2": (2.0 ** -3, 2.0 ** -17), "e2m1": (0.25, 0.25)}


def _scaled_randn(shape, seed, spread=8):
    g = torch.Generator().manual_seed(seed)
    rows = 2.0 ** torch.randint(-spread, spread + 1, (*shape[:-1], 1), generator=g).float()
    return torch.randn(*shape, generator=g) * rows


@INPUT_DTYPES
@MX_ELEMENTS
def test_mx_round_trip_error_bound(element, dtype):
    # RCEIL never clips, so every element is within half a grid step (times the block scale).
    x = _scaled_randn((64, 256), seed=20).to(dtype).float()
    q = quantize_mx(x, element)
    deq = dequantize(q)
    scale = q.scale.float().repeat_interleave(32, dim=-1)
    rel, floor = HALF_SPACING[element]
    bound = scale * torch.maximum(rel * (x / scale).abs(), torch.tensor(floor))
    assert ((deq - x).abs() <= bound).all()
    rel_fro = ((deq - x).norm() / x.norm()).item()
    assert rel_fro < {"e4m3": 0.04, "e5m2": 0.08, "e2m1": 0.2}[element]


@INPUT_DTYPES
def test_nvfp4_round_trip_error_bound(dtype):
    x = _scaled_randn((64, 256), seed=21, spread=3).to(dtype).float()
    q = quantize_nvfp4(x)
    deq = dequantize(q)
    step = (q.scale.float() * q.global_scale).repeat_interleave(16, dim=-1)  # one e2m1 unit
    # Half a grid step in e2m1 units; the e4m3 rounding of s_b can push |y| to 6 / (1 - 2^-4),
    # whose clipping error 6 * 2^-4 / (1 - 2^-4) is also within 0.25 |y|. 1e-5 covers fp32 steps.
    bound = step * torch.clamp(0.25 * (x / step).abs(), min=0.25) * (1 + 1e-5)
    assert ((deq - x).abs() <= bound).all()
    assert ((deq - x).norm() / x.norm()).item() < 0.15


@INPUT_DTYPES
@pytest.mark.parametrize("granularity", ["tensor", "row", (1, 128), (128, 128)],
                         ids=["tensor", "row", "1x128", "128x128"])
def test_fp8_round_trip_error_bound(granularity, dtype):
    x = _scaled_randn((130, 256), seed=22, spread=4).to(dtype).float()
    q = quantize_fp8(x, granularity=granularity)
    deq = dequantize(q)
    s = q.scale
    if granularity == (1, 128):
        s = s.repeat_interleave(128, dim=-1)
    elif granularity == (128, 128):
        s = s.repeat_interleave(128, dim=-1).repeat_interleave(128, dim=-2)[:130]
    rel, floor = HALF_SPACING["e4m3"]
    bound = s * torch.clamp(rel * (x / s).abs(), min=floor) * (1 + 1e-6)
    assert ((deq - x).abs() <= bound).all()
    assert ((deq - x).norm() / x.norm()).item() < 0.04


# ==============================================================================================
# Swizzled scales, batches, layouts
# ==============================================================================================

SWIZZLE_SHAPES = [(1, 64), (7, 64), (100, 160), (129, 96), (2, 3, 130, 64)]
SWIZZLE_IDS = ["M1", "M7", "M100-C5", "M129", "batched"]  # partial row tiles, partial column tiles


def _quantize(fmt: str, x: torch.Tensor, **kw):
    return {"mxfp8": quantize_mxfp8, "mxfp4": quantize_mxfp4, "nvfp4": quantize_nvfp4}[fmt](x, **kw)


@pytest.mark.parametrize("shape", SWIZZLE_SHAPES, ids=SWIZZLE_IDS)
@pytest.mark.parametrize("fmt", ["mxfp8", "mxfp4", "nvfp4"])
def test_swizzle_true_equals_swizzled_logical_scale(fmt, shape):
    x = _scaled_randn(shape, seed=30)
    q = _quantize(fmt, x)
    qs = _quantize(fmt, x, swizzle=True)
    assert not q.swizzled and qs.swizzled
    assert qs.scale.dtype == q.scale.dtype
    assert torch.equal(as_uint8(qs.data), as_uint8(q.data))
    assert torch.equal(as_uint8(qs.scale), as_uint8(swizzle.swizzle_32_4_4(q.scale)))
    m, cols = shape[-2], q.scale.shape[-1]
    assert qs.scale.shape == (*shape[:-2], math.ceil(m / 128), math.ceil(cols / 4), 32, 16)
    # Spot-check the flat index formula of docs/numerics.md without the swizzle package, and zero padding.
    flat = as_uint8(qs.scale).reshape(*shape[:-2], -1)
    logical = as_uint8(q.scale)
    c_pad = math.ceil(cols / 4) * 4
    for r, c in [(0, 0), (m - 1, cols - 1), (m // 2, cols // 2), (min(m - 1, 33), min(cols - 1, 2))]:
        idx = (r // 128) * (c_pad // 4) * 512 + (c // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4
        assert torch.equal(flat[..., idx], logical[..., r, c])
    assert int((flat != 0).sum()) <= logical.numel()
    torch.testing.assert_close(dequantize(qs), dequantize(q), rtol=0, atol=0)


@pytest.mark.parametrize("fmt", ["mxfp8", "mxfp4", "nvfp4"])
def test_dequantize_accepts_uint8_scale_bytes(fmt):
    x = _scaled_randn((5, 64), seed=31)
    q = _quantize(fmt, x)
    qb = q._replace(scale=as_uint8(q.scale))
    torch.testing.assert_close(dequantize(qb), dequantize(q), rtol=0, atol=0)


@pytest.mark.parametrize("fmt", ["mxfp8_e4m3", "mxfp8_e5m2", "mxfp4"])
def test_mx_batched_equals_per_slice(fmt):
    # Blocks never cross rows, so a batch is just more rows: each slice quantizes alone.
    x = _scaled_randn((2, 3, 37, 64), seed=32, spread=20)
    kw = {"mxfp8_e4m3": {}, "mxfp8_e5m2": {"elem_dtype": torch.float8_e5m2}, "mxfp4": {}}[fmt]
    quant = quantize_mxfp4 if fmt == "mxfp4" else quantize_mxfp8
    q = quant(x, **kw)
    qs = quant(x, swizzle=True, **kw)
    for i in range(2):
        for j in range(3):
            qij = quant(x[i, j], **kw)
            assert torch.equal(as_uint8(q.data[i, j]), as_uint8(qij.data))
            assert torch.equal(as_uint8(q.scale[i, j]), as_uint8(qij.scale))
            qsij = quant(x[i, j], swizzle=True, **kw)
            assert torch.equal(as_uint8(qs.scale[i, j]), as_uint8(qsij.scale))


def test_nvfp4_batched_equals_per_slice():
    x = _scaled_randn((2, 3, 37, 64), seed=33, spread=6)
    # With a shared decode scale every slice is independent...
    q = quantize_nvfp4(x, global_scale=0.01)
    for i in range(2):
        for j in range(3):
            qij = quantize_nvfp4(x[i, j], global_scale=0.01)
            assert torch.equal(q.data[i, j], qij.data)
            assert torch.equal(as_uint8(q.scale[i, j]), as_uint8(qij.scale))
    # ...and the computed decode scale depends on the whole tensor, not on its shape.
    qa, qf = quantize_nvfp4(x), quantize_nvfp4(x.reshape(-1, 64))
    assert torch.equal(qa.data.reshape(-1, 32), qf.data)
    assert torch.equal(as_uint8(qa.scale).reshape(-1, 4), as_uint8(qf.scale))
    assert torch.equal(qa.global_scale, qf.global_scale)


@pytest.mark.parametrize("granularity", ["tensor", "row", (1, 128), (128, 128)],
                         ids=["tensor", "row", "1x128", "128x128"])
def test_fp8_batched_equals_per_slice(granularity):
    x = _scaled_randn((2, 3, 130, 256), seed=34, spread=6)
    q = quantize_fp8(x, granularity=granularity)
    if granularity == "tensor":  # one scale for everything: the same as the flattened tensor
        qf = quantize_fp8(x.reshape(-1, 256), granularity="tensor")
        assert torch.equal(as_uint8(q.data).reshape(-1, 256), as_uint8(qf.data))
        assert torch.equal(q.scale, qf.scale)
        return
    for i in range(2):
        for j in range(3):
            qij = quantize_fp8(x[i, j], granularity=granularity)
            assert torch.equal(as_uint8(q.data[i, j]), as_uint8(qij.data))
            assert torch.equal(q.scale[i, j], qij.scale)


@pytest.mark.parametrize("fmt", ["mxfp8", "mxfp4", "nvfp4", "fp8_128x128"])
def test_non_contiguous_input_equals_contiguous(fmt):
    # A transposed view (the K-major weight case) must give the bits of its contiguous copy.
    x = _scaled_randn((256, 130), seed=35).t()
    if fmt == "fp8_128x128":
        a, b = quantize_fp8(x, granularity=(128, 128)), quantize_fp8(x.contiguous(), granularity=(128, 128))
    else:
        a, b = _quantize(fmt, x), _quantize(fmt, x.contiguous())
    assert torch.equal(as_uint8(a.data), as_uint8(b.data))
    assert torch.equal(as_uint8(a.scale) if a.scale.element_size() == 1 else a.scale,
                       as_uint8(b.scale) if b.scale.element_size() == 1 else b.scale)


def test_fp8_weight_128x128_shapes():
    # An (N, K) weight gives (ceil(N/128), K/128) scales; the partial last block uses its rows.
    w = _scaled_randn((300, 384), seed=36)
    q = quantize_fp8(w, granularity=(128, 128))
    assert q.scale.shape == (3, 3)
    expected_last = torch.maximum(w[256:, 128:256].abs().amax(), torch.tensor(1e-4)) / 448
    assert q.scale[2, 1] == expected_last
    assert quantize_fp8(w, granularity=(1, 128)).scale.shape == (300, 3)
    assert quantize_fp8(w, granularity="row").scale.shape == (300, 1)
    assert quantize_fp8(w[0], granularity="row").scale.shape == (1,)  # 1-D: one row


# ==============================================================================================
# NVFP4 global scale in every accepted form
# ==============================================================================================

GLOBAL_SCALE_FORMS = {
    "float": lambda v: v,
    "int": lambda v: int(v) if v == int(v) else v,
    "fp32": lambda v: torch.tensor(v, dtype=torch.float32),
    "bf16": lambda v: torch.tensor(v, dtype=torch.bfloat16),
    "fp16": lambda v: torch.tensor(v, dtype=torch.float16),
    "fp64": lambda v: torch.tensor(v, dtype=torch.float64),
}


# Values exact in bf16 and fp16, so every form means the same fp32 number.
@pytest.mark.parametrize("value", [1.0, 0.375, 2.0 ** -10, 3.0], ids=["1", "0.375", "2^-10", "3"])
@pytest.mark.parametrize("form", list(GLOBAL_SCALE_FORMS))
def test_nvfp4_global_scale_forms_give_identical_bits(form, value):
    x = _scaled_randn((8, 64), seed=40, spread=4)
    ref = quantize_nvfp4(x, global_scale=torch.tensor(value, dtype=torch.float32))
    q = quantize_nvfp4(x, global_scale=GLOBAL_SCALE_FORMS[form](value))
    assert torch.equal(q.data, ref.data)
    assert torch.equal(as_uint8(q.scale), as_uint8(ref.scale))
    assert q.global_scale.dtype == torch.float32 and q.global_scale.ndim == 0
    assert q.global_scale.device == x.device and q.global_scale.item() == value
    torch.testing.assert_close(dequantize_nvfp4(q.data, q.scale, GLOBAL_SCALE_FORMS[form](value)),
                               dequantize(ref), rtol=0, atol=0)


def test_nvfp4_python_float_is_rounded_to_fp32():
    x = _scaled_randn((4, 32), seed=41)
    a = quantize_nvfp4(x, global_scale=0.1)  # 0.1 is not an fp32 value: rounded to nearest
    b = quantize_nvfp4(x, global_scale=torch.tensor(0.1, dtype=torch.float32))
    assert a.global_scale.item() == f32(0.1)
    assert torch.equal(a.data, b.data) and torch.equal(as_uint8(a.scale), as_uint8(b.scale))


# ==============================================================================================
# Empty tensors, NamedTuples, dequantizers
# ==============================================================================================


@pytest.mark.parametrize("shape", [(0, 64), (2, 0, 64), (0, 3, 128)], ids=["M0", "batch-M0", "batch0"])
@pytest.mark.parametrize("fmt", ["mxfp8", "mxfp4", "nvfp4", "fp8_tensor", "fp8_row", "fp8_1x128",
                                 "fp8_128x128"])
def test_empty_leading_dims(fmt, shape):
    # No rows is fine (nothing to quantize); an empty K is an error (see the error tests).
    x = torch.zeros(shape)
    if fmt.startswith("fp8"):
        gran = {"fp8_tensor": "tensor", "fp8_row": "row", "fp8_1x128": (1, 128),
                "fp8_128x128": (128, 128)}[fmt]
        if gran != "tensor" and shape[-1] % 128:
            return
        q = quantize_fp8(x, granularity=gran)
        if gran == "tensor":
            assert q.scale.item() == 1.0
    else:
        q = _quantize(fmt, x)
        qs = _quantize(fmt, x, swizzle=True)
        assert qs.scale.shape[:-4] == shape[:-2]
        assert dequantize(qs).shape == shape
    assert dequantize(q).shape == shape


def test_named_tuples():
    x = _scaled_randn((4, 64), seed=50)
    data, scale = q = quantize_mxfp8(x, elem_dtype=torch.float8_e5m2)
    assert isinstance(q, MXFP8Tensor) and len(q) == 2 and q._fields == ("data", "scale")
    assert q.format is MXFP8_E5M2 and quantize_mxfp8(x).format is MXFP8_E4M3
    assert quantize_mxfp4(x).format is MXFP4 and isinstance(quantize_mxfp4(x), MXFP4Tensor)
    data, scale, gs = qn = quantize_nvfp4(x)
    assert isinstance(qn, NVFP4Tensor) and qn.format is NVFP4 and len(qn) == 3
    qf = quantize_fp8(x, elem_dtype=torch.float8_e5m2)
    assert isinstance(qf, FP8Tensor) and qf.format is FP8_E5M2 and len(qf) == 2
    assert quantize_fp8(x).format is FP8_E4M3 and not qf.swizzled
    with pytest.raises(AttributeError):
        q.format = None  # properties, not fields
    torch.testing.assert_close(q.dequantize(), dequantize_mxfp8(*q), rtol=0, atol=0)
    torch.testing.assert_close(qn.dequantize(), dequantize_nvfp4(*qn), rtol=0, atol=0)
    assert qf.dequantize().dtype == torch.float32


def test_dequantize_poisons_nan_blocks():
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(51))
    x[0, 3] = NAN
    for q in (quantize_mxfp8(x), quantize_mxfp4(x), quantize_nvfp4(x)):
        deq = dequantize(q)
        block = q.format.block
        assert deq[0, :block].isnan().all()
        assert not deq[0, block:].isnan().any() and not deq[1].isnan().any()


@pytest.mark.parametrize("granularity", ["tensor", "row", (1, 128), (128, 128)],
                         ids=["tensor", "row", "1x128", "128x128"])
def test_dequantize_fp8_matches_broadcast(granularity):
    x = _scaled_randn((3, 130, 256), seed=52)
    q = quantize_fp8(x, granularity=granularity)
    deq = dequantize_fp8(q.data, q.scale)
    # Element by element: data * the scale of its group.
    d = q.data.float()
    for idx in [(1, 0, 0), (2, 129, 255), (0, 64, 130), (0, 127, 127), (2, 128, 128)]:
        *b, i, j = idx
        if granularity == "tensor":
            s = q.scale
        elif granularity == "row":
            s = q.scale[(*b, i, 0)]
        elif granularity == (1, 128):
            s = q.scale[(*b, i, j // 128)]
        else:
            s = q.scale[(*b, i // 128, j // 128)]
        assert deq[idx] == d[idx] * s


# ==============================================================================================
# Errors: typed, naming the argument, the value received and what is accepted
# ==============================================================================================

X = torch.randn(4, 64)
Q8 = quantize_mxfp8(X)
Q4 = quantize_mxfp4(X)
QN = quantize_nvfp4(X)
QF = quantize_fp8(torch.randn(4, 256), granularity=(1, 128))

ERROR_CASES = [
    # Shapes and dtypes of x
    ("mxfp8-K48", lambda: quantize_mxfp8(torch.randn(4, 48)), ValueError,
     r"quantize_mxfp8: x.shape\[-1\] \(K\) must be a multiple of the block size 32, got K=48"),
    ("mxfp8-K0", lambda: quantize_mxfp8(torch.randn(4, 0)), ValueError,
     r"quantize_mxfp8: x.shape\[-1\] \(K\) must be non-zero.*got shape \(4, 0\)"),
    ("mxfp8-0d", lambda: quantize_mxfp8(torch.tensor(1.0)), ValueError,
     r"x must have at least 1 dimension.*got shape \(\)"),
    ("mxfp8-swizzle-1d", lambda: quantize_mxfp8(torch.randn(64), swizzle=True), ValueError,
     r"x must have at least 2 dimension\(s\) \(\.\.\., M, K\) with swizzle=True.*got shape \(64,\)"),
    ("mxfp8-numpy", lambda: quantize_mxfp8(np.zeros((4, 64), np.float32).tolist()), TypeError,
     r"quantize_mxfp8: x must be a torch.Tensor, got list"),
    ("mxfp8-fp64", lambda: quantize_mxfp8(torch.randn(4, 64, dtype=torch.float64)), TypeError,
     r"x.dtype must be torch.float32, torch.bfloat16 or torch.float16, got torch.float64"),
    ("mxfp8-int", lambda: quantize_mxfp8(torch.ones(4, 64, dtype=torch.int32)), TypeError,
     r"got torch.int32"),
    ("mxfp8-fp8-input", lambda: quantize_mxfp8(Q8.data), TypeError, r"got torch.float8_e4m3fn"),
    ("mxfp4-K48", lambda: quantize_mxfp4(torch.randn(4, 48)), ValueError,
     r"quantize_mxfp4: x.shape\[-1\] \(K\) must be a multiple of the block size 32, got K=48"),
    ("nvfp4-K24", lambda: quantize_nvfp4(torch.randn(4, 24)), ValueError,
     r"quantize_nvfp4: x.shape\[-1\] \(K\) must be a multiple of the block size 16, got K=24"),
    ("fp8-1x128-K100", lambda: quantize_fp8(torch.randn(4, 100), granularity=(1, 128)), ValueError,
     r"quantize_fp8: x.shape\[-1\] \(K\) must be a multiple of the block size 128, got K=100"),
    ("fp8-128x128-1d", lambda: quantize_fp8(torch.randn(256), granularity=(128, 128)), ValueError,
     r"at least 2 dimension"),
    ("fp8-tensor-K0", lambda: quantize_fp8(torch.randn(3, 0)), ValueError, r"must be non-zero"),
    # Keywords
    ("mxfp8-elem-fp16", lambda: quantize_mxfp8(X, elem_dtype=torch.float16), TypeError,
     r"quantize_mxfp8: elem_dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got torch.float16"),
    ("mxfp8-elem-str", lambda: quantize_mxfp8(X, elem_dtype="e4m3"), TypeError,
     r"elem_dtype must be .* got 'e4m3'"),
    ("mxfp8-rounding", lambda: quantize_mxfp8(X, rounding="ceil"), ValueError,
     r"quantize_mxfp8: rounding must be 'rceil' or 'floor', got 'ceil'"),
    ("mxfp4-rounding-case", lambda: quantize_mxfp4(X, rounding="RCEIL"), ValueError,
     r"quantize_mxfp4: rounding must be 'rceil' or 'floor', got 'RCEIL'"),
    ("mxfp8-swizzle-int", lambda: quantize_mxfp8(X, swizzle=1), TypeError,
     r"quantize_mxfp8: swizzle must be True or False, got 1"),
    ("nvfp4-swizzle-str", lambda: quantize_nvfp4(X, swizzle="yes"), TypeError,
     r"swizzle must be True or False, got 'yes'"),
    ("fp8-granularity", lambda: quantize_fp8(X, granularity="block"), ValueError,
     r"quantize_fp8: granularity must be 'tensor', 'row', \(1, 128\) or \(128, 128\), got 'block'"),
    ("fp8-granularity-1x64", lambda: quantize_fp8(X, granularity=(1, 64)), ValueError,
     r"granularity must be .* got \(1, 64\)"),
    ("fp8-block-e5m2", lambda: quantize_fp8(torch.randn(4, 128), granularity=(128, 128),
                                            elem_dtype=torch.float8_e5m2), ValueError,
     r"quantize_fp8: granularity \(128, 128\) needs elem_dtype=torch.float8_e4m3fn, got torch.float8_e5m2"),
    ("fp8-pow2-tensor", lambda: quantize_fp8(X, pow2_scale=True), ValueError,
     r"pow2_scale=True needs a block granularity \(1, 128\) or \(128, 128\), got granularity='tensor'"),
    ("fp8-pow2-int", lambda: quantize_fp8(X, granularity=(1, 128), pow2_scale=1), TypeError,
     r"pow2_scale must be True or False, got 1"),
    ("fp8-elem-int8", lambda: quantize_fp8(X, elem_dtype=torch.int8), TypeError,
     r"quantize_fp8: elem_dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got torch.int8"),
    # NVFP4 global scale
    ("nvfp4-gs-vector", lambda: quantize_nvfp4(X, global_scale=torch.ones(2)), ValueError,
     r"quantize_nvfp4: global_scale must be a scalar .* got a tensor of shape \(2,\)"),
    ("nvfp4-gs-shape1", lambda: quantize_nvfp4(X, global_scale=torch.ones(1)), ValueError,
     r"global_scale must be a scalar .* shape \(1,\)"),
    ("nvfp4-gs-str", lambda: quantize_nvfp4(X, global_scale="1"), TypeError,
     r"global_scale must be a Python float or a 0-d floating-point torch.Tensor, got str"),
    ("nvfp4-gs-int-tensor", lambda: quantize_nvfp4(X, global_scale=torch.tensor(2)), TypeError,
     r"global_scale must have a floating-point dtype, got torch.int64"),
    ("nvfp4-gs-zero", lambda: quantize_nvfp4(X, global_scale=0.0), ValueError,
     r"global_scale must be a positive finite decode scale, got 0.0"),
    ("nvfp4-gs-negative", lambda: quantize_nvfp4(X, global_scale=torch.tensor(-1.0)), ValueError,
     r"positive finite decode scale, got -1.0"),
    ("nvfp4-gs-inf", lambda: quantize_nvfp4(X, global_scale=INF), ValueError, r"got inf"),
    ("nvfp4-gs-nan", lambda: quantize_nvfp4(X, global_scale=torch.tensor(NAN, dtype=torch.bfloat16)),
     ValueError, r"got nan"),
    ("nvfp4-gs-fp32-overflow", lambda: quantize_nvfp4(X, global_scale=1e39), ValueError,
     r"got inf"),  # a Python float beyond fp32 rounds to inf
    # Dequantizers
    ("deq-mxfp8-data-dtype", lambda: dequantize_mxfp8(Q8.data.half(), Q8.scale), TypeError,
     r"dequantize_mxfp8: data.dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got torch.float16"),
    ("deq-mxfp8-scale-dtype", lambda: dequantize_mxfp8(Q8.data, Q8.scale.float()), TypeError,
     r"dequantize_mxfp8: scale.dtype must be torch.float8_e8m0fnu \(or torch.uint8 holding its bytes\), got torch.float32"),
    ("deq-mxfp8-scale-shape", lambda: dequantize_mxfp8(Q8.data, Q8.scale[:, :1]), ValueError,
     r"dequantize_mxfp8: scale must have shape \(4, 2\) \(logical\) for data shape \(4, 64\).*got \(4, 1\)"),
    ("deq-mxfp8-swizzled-shape", lambda: dequantize_mxfp8(Q8.data, torch.zeros(2, 1, 32, 16, dtype=torch.uint8)),
     ValueError, r"swizzled scale must have shape \(1, 1, 32, 16\) for data shape \(4, 64\), got \(2, 1, 32, 16\)"),
    ("deq-mxfp8-K", lambda: dequantize_mxfp8(Q8.data[:, :48], Q8.scale), ValueError,
     r"data.shape\[-1\] must hold a positive multiple of the block size 32 elements"),
    ("deq-mxfp8-not-tensor", lambda: dequantize_mxfp8(Q8.data, 1.0), TypeError,
     r"dequantize_mxfp8: scale must be a torch.Tensor, got float"),
    ("deq-mxfp4-data-dtype", lambda: dequantize_mxfp4(Q8.data, Q4.scale), TypeError,
     r"dequantize_mxfp4: data.dtype must be torch.uint8 \(two e2m1 per byte\), got torch.float8_e4m3fn"),
    ("deq-mxfp4-scale-e4m3", lambda: dequantize_mxfp4(Q4.data, QN.scale), TypeError,
     r"scale.dtype must be torch.float8_e8m0fnu"),
    ("deq-nvfp4-scale-e8m0", lambda: dequantize_nvfp4(QN.data, Q4.scale, 1.0), TypeError,
     r"dequantize_nvfp4: scale.dtype must be torch.float8_e4m3fn"),
    ("deq-nvfp4-gs-vector", lambda: dequantize_nvfp4(QN.data, QN.scale, torch.ones(3)), ValueError,
     r"dequantize_nvfp4: global_scale must be a scalar"),
    ("deq-fp8-scale-dtype", lambda: dequantize_fp8(QF.data, QF.scale.half()), TypeError,
     r"dequantize_fp8: scale.dtype must be torch.float32, got torch.float16"),
    ("deq-fp8-scale-shape", lambda: dequantize_fp8(QF.data, QF.scale[:3]), ValueError,
     r"dequantize_fp8: scale must be 0-d, \(\.\.\., M, 1\), .* for data shape \(4, 256\), got \(3, 2\)"),
    ("deq-fp8-scale-cols", lambda: dequantize_fp8(QF.data, torch.ones(4, 3)), ValueError,
     r"got \(4, 3\)"),
    ("deq-fp8-data-dtype", lambda: dequantize_fp8(QF.data.float(), QF.scale), TypeError,
     r"dequantize_fp8: data.dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got torch.float32"),
    ("deq-generic", lambda: dequantize((Q8.data, Q8.scale)), TypeError,
     r"dequantize: q must be an MXFP8Tensor, MXFP4Tensor, NVFP4Tensor or FP8Tensor, got tuple"),
]


@pytest.mark.parametrize("call,exc,match", [c[1:] for c in ERROR_CASES], ids=[c[0] for c in ERROR_CASES])
def test_errors(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


# ==============================================================================================
# repr
# ==============================================================================================

REPR_CASES = [
    ("mxfp8", lambda x: quantize_mxfp8(x, elem_dtype=torch.float8_e5m2),
     "MXFP8Tensor(format=mxfp8_e5m2, shape=(300, 256), data=float8_e5m2(300, 256), "
     "scale=float8_e8m0fnu(300, 8), layout=logical, device=cpu)"),
    ("mxfp4-swizzled", lambda x: quantize_mxfp4(x, swizzle=True),
     "MXFP4Tensor(format=mxfp4, shape=(300, 256), data=uint8(300, 128), "
     "scale=float8_e8m0fnu(3, 2, 32, 16), layout=swizzled, device=cpu)"),
    ("nvfp4-swizzled", lambda x: quantize_nvfp4(x, swizzle=True, global_scale=0.25),
     "NVFP4Tensor(format=nvfp4, shape=(300, 256), data=uint8(300, 128), "
     "scale=float8_e4m3fn(3, 4, 32, 16), layout=swizzled, global_scale=0.25, device=cpu)"),
    ("fp8-row", lambda x: quantize_fp8(x, granularity="row"),
     "FP8Tensor(format=fp8_e4m3, shape=(300, 256), data=float8_e4m3fn(300, 256), "
     "scale=float32(300, 1), device=cpu)"),
    ("mxfp8-numpy", lambda x: quantize_mxfp8(x.numpy()),
     "MXFP8Tensor(format=mxfp8 bytes, shape=(300, 256), data=uint8(300, 256), scale=uint8(300, 8), "
     "layout=logical, device=cpu (NumPy arrays))"),
]


@pytest.mark.parametrize("quantize,expected", [c[1:] for c in REPR_CASES], ids=[c[0] for c in REPR_CASES])
def test_quantized_tensors_print_one_line(quantize, expected):
    # The NamedTuple default printed every element (over 100 lines for a small tensor).
    q = quantize(torch.randn(300, 256, generator=torch.Generator().manual_seed(0)))
    assert repr(q) == str(q) == expected


def test_repr_does_not_read_a_device_global_scale():
    # Reading a GPU value would synchronise; a meta tensor has no value to read at all.
    meta = dict(device="meta")
    q = NVFP4Tensor(torch.empty(4, 8, dtype=torch.uint8, **meta),
                    torch.empty(4, 1, dtype=torch.float8_e4m3fn, **meta), torch.empty((), **meta))
    assert repr(q) == ("NVFP4Tensor(format=nvfp4, shape=(4, 16), data=uint8(4, 8), scale=float8_e4m3fn(4, 1), "
                       "layout=logical, global_scale=<fp32 on device>, device=meta)")


# ==============================================================================================
# GPU: the same bits as on the CPU (the reference runs on any device)
# ==============================================================================================


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("fmt", ["mxfp8", "mxfp8_floor", "mxfp4", "nvfp4", "fp8_tensor", "fp8_row",
                                 "fp8_1x128", "fp8_128x128_pow2"])
def test_cuda_gives_cpu_bits(fmt):
    x = make_input(awkward_blocks("e4m3", 32, torch.float32, seed=60), 32, 8, torch.float32)
    x[1, 5] = -NAN  # NaN payload and sign handling differ between devices
    quant = {
        "mxfp8": quantize_mxfp8, "mxfp8_floor": lambda t: quantize_mxfp8(t, rounding="floor"),
        "mxfp4": lambda t: quantize_mxfp4(t, swizzle=True), "nvfp4": quantize_nvfp4,
        "fp8_tensor": quantize_fp8, "fp8_row": lambda t: quantize_fp8(t, granularity="row"),
        "fp8_1x128": lambda t: quantize_fp8(t, granularity=(1, 128)),
        "fp8_128x128_pow2": lambda t: quantize_fp8(t, granularity=(128, 128), pow2_scale=True),
    }[fmt]
    cpu, gpu = quant(x), quant(x.cuda())
    for a, b in zip(cpu, gpu):
        assert b.device.type == "cuda"
        if a.dtype == torch.float32:
            torch.testing.assert_close(b.cpu(), a, rtol=0, atol=0, equal_nan=True)
        else:
            assert torch.equal(as_uint8(b).cpu(), as_uint8(a))


@pytest.mark.parametrize("quantize", [quantize_mxfp8, quantize_mxfp4, quantize_nvfp4],
                         ids=["mxfp8", "mxfp4", "nvfp4"])
def test_swizzle_of_a_1d_input_names_swizzle(quantize):
    # The 2-D requirement comes from swizzle=True; the message used to say only "at least 2 dimension(s)".
    with pytest.raises(ValueError, match=r"at least 2 dimension\(s\).*with swizzle=True.*swizzle=False"):
        quantize(torch.randn(64), swizzle=True)
    assert quantize(torch.randn(64)).data.ndim == 1


def test_amax_bits_without_propagation_is_over_the_finite_values():
    # NVFP4's tensor amax (also the one row-wise tensor-parallel ranks all-reduce) leaves NaN and Inf out.
    from tilemm.quantize import amax_bits, quantize_nvfp4_with_amax

    x = torch.tensor([[1.0, -3.5, INF], [NAN, 2.0, -INF]]).repeat(1, 16)
    assert amax_bits(x, "tensor", propagate_nan=False).view(torch.float32).item() == 3.5
    assert amax_bits(x, "tensor", propagate_nan=True).view(torch.float32).isnan().all()
    q = quantize_nvfp4_with_amax(x, amax_bits(x, "tensor", propagate_nan=False))
    assert torch.equal(q.scale.view(torch.uint8), quantize_nvfp4(x).scale.view(torch.uint8))
