"""The one e8m0 and e2m1 tile decode (``tilemm.kernels._common``), bit for bit, on the CPU emulator.

Every kernel decodes through ``e2m1_bits`` and ``e8m0_bits_bf16``; here each field placement the
kernels use (the nibbles of packed bytes, the weight-only layout's planes) and each scale byte is
checked against the formats' own tables. Inputs are random words, so the bits around a field (the
other nibble, the other planes) are poison that the masks must keep out.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import cuda.tile as ct
from tilemm.kernels import _common
from tilemm.kernels.weight_only_kernels import E2M1_FIELDS

from _emulator import Tile, TileEmulator

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def _emulated(fn):
    """``fn`` (a tile helper) with ``ct`` replaced by the emulator, as a kernel that inlines it sees it."""
    return TileEmulator()._rebind(fn, {})


def _float_bits(values, fp16: bool) -> np.ndarray:
    """The 16-bit patterns of ``values`` (exact in the target) as int64."""
    t = torch.tensor(values, dtype=torch.float64).to(torch.float16 if fp16 else torch.bfloat16)
    return t.view(torch.int16).to(torch.int64).numpy() & 0xFFFF


def _expected_lane(lane: np.ndarray, mag_at: int, sign_at: int, fp16: bool) -> np.ndarray:
    code = ((lane >> mag_at) & 0x7) | (((lane >> sign_at) & 1) << 3)
    offset = 2.0 ** -14 if fp16 else 2.0 ** -126
    return _float_bits([E2M1[c] * offset for c in code.ravel()], fp16).reshape(lane.shape)


# (MAG_AT, SIGN_AT, LANES) as the kernels call it: packed bytes' low and high nibbles (block-scaled
# and quantize kernels, one lane), and the weight-only / MoE planes (two lanes per word).
PLACEMENTS = [(0, 3, 1), (4, 7, 1)] + [(mag, sign, 2) for mag, sign in E2M1_FIELDS]


@pytest.mark.parametrize("fp16", [0, 1], ids=["bf16", "fp16"])
@pytest.mark.parametrize("mag_at,sign_at,lanes", PLACEMENTS,
                         ids=[f"mag{m}_sign{s}_lanes{n}" for m, s, n in PLACEMENTS])
def test_e2m1_bits_decodes_every_code_at_every_placement(mag_at, sign_at, lanes, fp16):
    rng = np.random.default_rng(mag_at * 16 + sign_at)
    if lanes == 1:  # a uint16 tile of packed bytes
        raw = np.concatenate([np.arange(256), rng.integers(0, 256, 256)]).astype(np.int64)
        w = Tile(raw, ct.uint16)
    else:  # uint32 words, every other bit random
        raw = rng.integers(0, 2 ** 32, 1024, dtype=np.int64)
        w = Tile(raw, ct.uint32)
    out = np.asarray(_emulated(_common.e2m1_bits)(w, mag_at, sign_at, fp16, lanes), dtype=np.int64)
    np.testing.assert_array_equal(out & 0xFFFF, _expected_lane(raw & 0xFFFF, mag_at, sign_at, fp16))
    if lanes == 2:
        np.testing.assert_array_equal(out >> 16, _expected_lane(raw >> 16, mag_at, sign_at, fp16))
    else:
        assert (out >> 16 == 0).all()


def test_e2m1_bits_covers_every_code_of_each_placement():
    """The random words above hold all 16 codes at every weight-only plane (so no code goes unchecked)."""
    raw = np.random.default_rng(0).integers(0, 2 ** 32, 1024, dtype=np.int64)
    for mag_at, sign_at in E2M1_FIELDS:
        for lane in (raw & 0xFFFF, raw >> 16):
            codes = ((lane >> mag_at) & 0x7) | (((lane >> sign_at) & 1) << 3)
            assert set(codes.tolist()) == set(range(16))


def _e8m0_bits(s: np.ndarray) -> np.ndarray:
    """bf16 bits of 2^(s - 127) (byte 255: the quiet NaN 0x7FC0), from torch's own e8m0 type."""
    f = torch.from_numpy(s.astype(np.uint8)).view(torch.float8_e8m0fnu).to(torch.float32)
    bits = (f.view(torch.int32).to(torch.int64).numpy() >> 16) & 0xFFFF
    return np.where(s == 255, 0x7FC0, bits)


@pytest.mark.parametrize("dtype", [ct.uint16, ct.int32], ids=["uint16", "int32"])
def test_e8m0_bits_plain_decode_of_every_byte(dtype):
    s = np.arange(256, dtype=np.int64)
    out = np.asarray(_emulated(_common.e8m0_bits_bf16)(Tile(s, ct.uint8), dtype, 0, 0), dtype=np.int64)
    np.testing.assert_array_equal(out & 0xFFFF, _e8m0_bits(s))
    assert out[0] == 0x0040 and out[255] == 0x7FC0  # 2^-127 (subnormal) and NaN, not 0 and +inf


@pytest.mark.parametrize("shift", [1, 7, 126])
def test_e8m0_bits_shifted_form_multiplies_by_a_power_of_two(shift):
    """SHIFTED = 1, base = shift * 128: bits of 2^(s - 127 + shift) for every byte the weight-only
    layout allows (s + shift <= 254), and NaN for byte 255."""
    s = np.concatenate([np.arange(0, 255 - shift), [255]]).astype(np.int64)
    out = np.asarray(_emulated(_common.e8m0_bits_bf16)(Tile(s, ct.uint8), ct.uint16, shift * 128, 1),
                     dtype=np.int64)
    finite = s != 255
    np.testing.assert_array_equal(out[finite], _e8m0_bits(s[finite] + shift))
    assert (out[~finite] == 0x7FC0).all()
