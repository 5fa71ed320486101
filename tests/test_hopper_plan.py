"""Config choice of the Hopper kernels (CPU only: plain arithmetic on shapes)."""

from tilemm.formats import MXFP4, MXFP8_E4M3, NVFP4, Granularity
from tilemm.kernels import hopper_block_scaled as hbs
from tilemm.kernels import hopper_fp8 as hfp8


def test_fp8_fast_takes_the_large_tile_when_its_waves_are_full():
    # 64 x 56 = 3584 tiles of 128x256: 27.2 waves on 132 SMs (99 % busy)
    assert hfp8.plan(Granularity.TENSOR, 1, 8192, 14336, fast_accum=True).tile_n == 256
    # 8 x 32 = 256 tiles: 1.94 waves (97 %)
    assert hfp8.plan(Granularity.ROW, 1, 1024, 8192, fast_accum=True).tile_n == 256


def test_fp8_fast_takes_the_small_tile_for_a_mostly_empty_last_wave():
    # 8 x 56 = 448 tiles of 128x256: 3.4 waves (85 %); 896 of 128x128: 6.8 waves (97 %)
    cfg = hfp8.plan(Granularity.TENSOR, 1, 1024, 14336, fast_accum=True)
    assert (cfg.tile_m, cfg.tile_n) == (128, 128)
    # fewer large tiles than SMs
    assert hfp8.plan(Granularity.TENSOR, 1, 128, 14336, fast_accum=True).tile_n == 128
    # the SM count enters: on 112 SMs, 448 tiles are exactly 4 waves
    assert hfp8.plan(Granularity.TENSOR, 1, 1024, 14336, fast_accum=True, sms=112).tile_n == 256


def test_fp8_precise_keeps_one_tile():
    for m, n in ((1024, 14336), (8192, 8192), (16, 4096)):
        cfg = hfp8.plan(Granularity.ROW, 1, m, n, fast_accum=False)
        assert (cfg.tile_m, cfg.tile_n) == (128, 128)


def test_stream_config_small_m_uses_64_weight_rows_and_one_warpgroup():
    for fmt in (MXFP8_E4M3, MXFP4, NVFP4):
        cfg = hbs.plan(fmt, 1, 16, 14336, 4096)
        assert (cfg.tile_m, cfg.tile_n, cfg.num_worker_warps, cfg.occupancy) == (16, 64, 4, 4)
        # 224 output tiles split K until 4 blocks per SM have work: 224 * 4 >= 4 * 132
        assert cfg.split_k == 4
    assert hbs.plan(MXFP4, 1, 100, 4096, 4096).tile_n == 128


def test_stream_config_reads_a_16_bit_activation_copy_only_above_m_16_without_a_split():
    # Up to M = 16 every block decodes its activation tile, so that a call is one launch (every format);
    # a K split always decodes in the kernel (see hopper_block_scaled._x16).
    for fmt in (MXFP8_E4M3, MXFP4, NVFP4):
        assert not hbs.plan(fmt, 1, 1, 4096, 4096).x16
        assert not hbs.plan(fmt, 1, 16, 4096, 4096).x16
        split = hbs.plan(fmt, 1, 128, 4096, 4096)
        assert split.split_k > 1 and not split.x16
        whole = hbs.plan(fmt, 1, 128, 65536, 4096)
        assert whole.split_k == 1 and whole.x16


def test_two_pass_dequantizes_4_bit_formats_in_16x512_tiles():
    for fmt, tiles in ((MXFP8_E4M3, (64, 128)), (MXFP4, (16, 512)), (NVFP4, (16, 512))):
        cfg = hbs.plan(fmt, 1, 1024, 4096, 4096)
        assert (cfg.dequant_rows, cfg.dequant_k) == tiles
