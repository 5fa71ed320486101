"""Tensors of 2^31 elements and more on the GPU: every quantizer and matmul family against the same
kernels run on pieces below 2^31 (``tilemm.kernels._large``), bit for bit.

The big tensors: a (65600, 32768) bf16 activation (2.15e9 elements, 4.3 GB), a stacked (66, 1024,
32768) bf16 weight (2.21e9 elements) and an NVFP4 weight whose packed bytes alone are 2.7e9. The
references are the public functions on row (or batch entry, or weight row) chunks below 2^31
elements (each one launch, uncut), compared chunk by chunk, so no second full-size result is ever
held; matmul chunks are large enough that the launchers pick the same design and config as for the
whole. Peak memory stays near 14 GB.
"""

from __future__ import annotations

import pytest
import torch

import tilemm
from tilemm.formats import FP8_E4M3
from tilemm.kernels import quantize_kernels as qk

from _gpu import requires_gpu

pytestmark = requires_gpu

M_BIG, K_BIG = 65600, 32768  # 65600 * 32768 = 2.15e9 > 2^31; 65600 is not a multiple of 128
CHUNK = 16384                # rows per reference chunk (a multiple of 128 and of every tile)
#: Matmul reference chunks: no short last chunk, whose smaller M would pick another design or config.
MATMUL_CHUNKS = [(0, 32768), (32768, M_BIG)]


@pytest.fixture(scope="module")
def x_big():
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(M_BIG, K_BIG, device="cuda", dtype=torch.bfloat16, generator=gen)
    assert x.numel() > 2 ** 31
    yield x
    del x
    torch.cuda.empty_cache()


def _bytes(t):
    return t.view(torch.uint8) if t.dtype.itemsize == 1 else t


def _chunks(n, step=CHUNK):
    return [(i, min(i + step, n)) for i in range(0, n, step)]


def _assert_rows_equal(big, piece, r0, r1, scale_rows=1):
    """big[r0:r1] (rows of data, or of logical scales) equals piece; ``scale_rows`` rows per index
    (128 for swizzled and 128x128 scales)."""
    a = big[r0 // scale_rows: -(-r1 // scale_rows)]
    assert torch.equal(_bytes(a), _bytes(piece)), f"rows {r0}:{r1} differ"


@pytest.mark.parametrize("kind", ["mxfp8_swizzled", "mxfp4_logical", "nvfp4_swizzled", "fp8_tensor", "fp8_row",
                                  "fp8_1x128", "fp8_128x128"])
def test_quantizers_2d(x_big, kind):
    g = torch.tensor(2.0 ** -9, device="cuda")  # a fixed NVFP4 decode scale, so chunks agree
    if kind == "mxfp8_swizzled":
        quant, rows = (lambda x: tilemm.quantize_mxfp8(x, swizzle=True)), 128
    elif kind == "mxfp4_logical":
        quant, rows = (lambda x: tilemm.quantize_mxfp4(x)), 1
    elif kind == "nvfp4_swizzled":
        quant, rows = (lambda x: tilemm.quantize_nvfp4(x, global_scale=g, swizzle=True)), 128
    elif kind == "fp8_tensor":
        # the chunks take the whole tensor's amax, as the big launch does (over all its pieces)
        amax = torch.maximum(x_big.amax(), -x_big.amin()).float().reshape(1)
        quant, rows = (lambda x: qk.quantize_fp8(x, FP8_E4M3, "tensor", False, amax=amax)), None
    else:
        gran = {"fp8_row": "row", "fp8_1x128": (1, 128), "fp8_128x128": (128, 128)}[kind]
        quant, rows = (lambda x: qk.quantize_fp8(x, FP8_E4M3, gran, False)), (128 if kind == "fp8_128x128" else 1)
    big = tuple(quant(x_big))
    if kind == "fp8_tensor":
        # the launcher's own amax pass over every piece gives the same scale
        assert torch.equal(tilemm.quantize_fp8(x_big).scale, big[1])
    for r0, r1 in _chunks(M_BIG):
        piece = tuple(quant(x_big[r0:r1]))
        _assert_rows_equal(big[0], piece[0], r0, r1)
        if rows is None:
            assert torch.equal(big[1], piece[1])
        else:
            _assert_rows_equal(big[1], piece[1], r0, r1, rows)
    del big, piece


def test_nvfp4_global_scale_from_the_whole_tensor(x_big):
    # without a global scale, the amax pass runs over every piece: S_dec = 1 / (2688 / amax)
    q = tilemm.quantize_nvfp4(x_big, swizzle=True)
    amax = torch.maximum(x_big.amax(), -x_big.amin()).float()
    expected = 1.0 / (2688.0 / amax)
    assert torch.equal(q.global_scale, expected.reshape(()))
    del q


def test_mxfp8_along_axis_minus_2(x_big):
    # x.mT (32768 rows, K = 65600) read as stored: the launch is cut along K and along rows at once
    big = tilemm.quantize_mxfp8(x_big, swizzle=True, axis=-2)
    for c0, c1 in _chunks(K_BIG):
        # a contiguous copy of the columns, so that the reference itself is one uncut launch
        piece = tilemm.quantize_mxfp8(x_big[:, c0:c1].contiguous(), swizzle=True, axis=-2)
        _assert_rows_equal(big.data, piece.data, c0, c1)
        _assert_rows_equal(big.scale, piece.scale, c0, c1, 128)
    del big, piece


@pytest.mark.parametrize("kind", ["nvfp4_swizzled", "mxfp8_logical", "fp8_128x128"])
def test_quantizers_stacked_weight(kind):
    # (66, 1024, 32768): 2.21e9 elements; swizzled scales are cut along the batch, logical ones
    # along the rows of the flattened batch
    gen = torch.Generator(device="cuda").manual_seed(1)
    w = torch.randn(66, 1024, K_BIG, device="cuda", dtype=torch.bfloat16, generator=gen)
    g = torch.tensor(2.0 ** -9, device="cuda")
    quant = {"nvfp4_swizzled": lambda t: tuple(tilemm.quantize_nvfp4(t, global_scale=g, swizzle=True))[:2],
             "mxfp8_logical": lambda t: tuple(tilemm.quantize_mxfp8(t)),
             "fp8_128x128": lambda t: tuple(tilemm.quantize_fp8(t, granularity=(128, 128)))}[kind]
    big = quant(w)
    for b0, b1 in _chunks(w.shape[0], 16):
        piece = quant(w[b0:b1])
        assert torch.equal(_bytes(big[0][b0:b1]), _bytes(piece[0]))
        assert torch.equal(_bytes(big[1][b0:b1]), _bytes(piece[1]))
    del w, big, piece
    torch.cuda.empty_cache()


def test_mxfp8_matmul_big_activation(x_big):
    # M = 65600 >= 512: the dequantize pass and the GEMM are both cut along M. Reference chunks of
    # 32768 and 32832 rows: both take the two-pass design with the whole problem's config.
    gen = torch.Generator(device="cuda").manual_seed(2)
    w = torch.randn(256, K_BIG, device="cuda", dtype=torch.bfloat16, generator=gen)
    xq = tilemm.quantize_mxfp8(x_big, swizzle=True)
    wq = tilemm.quantize_mxfp8(w, swizzle=True)
    out = tilemm.mxfp8_matmul(xq.data, xq.scale, wq.data.t(), wq.scale)
    for r0, r1 in MATMUL_CHUNKS:
        piece = tilemm.mxfp8_matmul(xq.data[r0:r1], xq.scale[r0 // 128: -(-r1 // 128)], wq.data.t(), wq.scale)
        assert torch.equal(out[r0:r1], piece), f"rows {r0}:{r1} differ"
    del xq, out, piece
    torch.cuda.empty_cache()


@pytest.mark.parametrize("granularity", ["row", "block"])
def test_fp8_matmul_big_activation(x_big, granularity):
    gen = torch.Generator(device="cuda").manual_seed(3)
    w = torch.randn(256, K_BIG, device="cuda", dtype=torch.bfloat16, generator=gen)
    gx, gw = ("row", "row") if granularity == "row" else ((1, 128), (128, 128))
    xq = tilemm.quantize_fp8(x_big, granularity=gx)
    wq = tilemm.quantize_fp8(w, granularity=gw)
    out = tilemm.linear(xq, wq)
    for r0, r1 in MATMUL_CHUNKS:
        piece = tilemm.linear(type(xq)(xq.data[r0:r1], xq.scale[r0:r1]), wq)
        assert torch.equal(out[r0:r1], piece), f"rows {r0}:{r1} differ"
    del xq, out, piece
    torch.cuda.empty_cache()


def test_nvfp4_matmul_big_weight():
    # a weight whose packed bytes alone are 327680 x 8192 = 2.7e9 (K = 16384), at M = 16: the stream
    # kernel is cut along N. Random codes and positive e4m3 scales; no bf16 source is needed. The
    # reference chunks of 65536 weight rows give enough output tiles for no K split, as the whole.
    gen = torch.Generator(device="cuda").manual_seed(4)
    n, k, m = 327680, 16384, 16
    w = torch.randint(0, 256, (n, k // 2), device="cuda", dtype=torch.uint8, generator=gen)
    assert w.numel() > 2 ** 31
    w_scale = torch.randint(0, 0x7F, (n // 128, k // 64, 32, 16), device="cuda", dtype=torch.uint8,
                            generator=gen).view(torch.float8_e4m3fn)
    xq = tilemm.quantize_nvfp4(torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen), swizzle=True)
    g = torch.tensor(2.0 ** -12, device="cuda")
    out = tilemm.nvfp4_matmul(xq.data, xq.scale, w.t(), w_scale, global_scale_x=xq.global_scale, global_scale_y=g)
    step = 65536
    for n0, n1 in _chunks(n, step):
        piece = tilemm.nvfp4_matmul(xq.data, xq.scale, w[n0:n1].t(), w_scale[n0 // 128: n1 // 128],
                                    global_scale_x=xq.global_scale, global_scale_y=g)
        assert torch.equal(out[:, n0:n1], piece), f"columns {n0}:{n1} differ"
    del w, w_scale, out, piece
    torch.cuda.empty_cache()
