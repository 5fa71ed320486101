"""tilemm's CuTe-DSL cross-check path: tilemm.cute and tilemm.crosscheck.

What runs where:
* CPU (CI, with ``pip install -e .[dev,cute]``): the kernels are compiled for sm_100a (``aot``), the
  scale layout the kernel builds is evaluated coordinate by coordinate and compared with
  ``swizzle.swizzle_index`` and with the bytes ``swizzle_32_4_4`` writes, and every argument check
  is exercised.
* A compute capability 10.x GPU (``gpu``): the kernel runs against the reference and the cuTile
  kernel. Elsewhere those tests skip, saying so.
"""

from __future__ import annotations

import pathlib
import re
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

pytest.importorskip("cutlass.cute", reason="nvidia-cutlass-dsl is not installed "
                                           "(pip install -e '.[cute]' to test the CuTe-DSL kernels)")

import swizzle  # noqa: E402
import tilemm  # noqa: E402
import tilemm.cute as tc  # noqa: E402
from tilemm.cute import blockscaled_gemm as bsg  # noqa: E402

FORMATS = list(tc.SUPPORTED_FORMATS)  # mxfp8_e4m3, mxfp8_e5m2, mxfp4, nvfp4
OUT_DTYPES = [torch.bfloat16, torch.float16, torch.float32]
BLACKWELL = tc.blackwell_device()
needs_blackwell = pytest.mark.skipif(BLACKWELL is None, reason=tc.NO_BLACKWELL)


def _quantize(fmt_name: str, x: torch.Tensor, *, swizzle_scales: bool = True):
    if fmt_name.startswith("mxfp8"):
        elem = torch.float8_e4m3fn if fmt_name.endswith("e4m3") else torch.float8_e5m2
        return tilemm.quantize_mxfp8(x, elem_dtype=elem, swizzle=swizzle_scales)
    if fmt_name == "mxfp4":
        return tilemm.quantize_mxfp4(x, swizzle=swizzle_scales)
    return tilemm.quantize_nvfp4(x, swizzle=swizzle_scales)


def _operands(fmt_name: str, m: int, n: int, k: int, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    x = _quantize(fmt_name, torch.randn(m, k, generator=g).to(device))
    w = _quantize(fmt_name, torch.randn(n, k, generator=g).to(device))
    return x, w


def _args(fmt_name: str, x, w):
    """Positional and keyword arguments of block_scaled_matmul for quantized x and w."""
    kw = {}
    if fmt_name == "nvfp4":
        kw = dict(global_scale_a=x.global_scale, global_scale_b=w.global_scale)
    return (fmt_name, x.data, x.scale, w.data, w.scale), kw


# --------------------------------------------------------------------------------------------------
# Compiled for sm_100a, no GPU
# --------------------------------------------------------------------------------------------------

@pytest.mark.aot
@pytest.mark.parametrize("out_dtype", OUT_DTYPES, ids=str)
@pytest.mark.parametrize("fmt_name", FORMATS)
def test_compiles_for_sm100a(fmt_name, out_dtype):
    compiled = tc.compile_for_sm100(fmt_name, out_dtype)
    kfmt = bsg.KERNEL_FORMATS[fmt_name]
    ptx = compiled.ptx
    assert ".target sm_100a" in ptx
    # The block-scaled MMA of the right kind, with one scale per `block` elements.
    mma = f"tcgen05.mma.cta_group::1.kind::{kfmt.ptx_kind}.block_scale.block{kfmt.block}"
    assert mma in ptx, sorted(set(re.findall(r"tcgen05\.mma\S*", ptx)))
    assert "tcgen05.cp.cta_group::1.32x128b.warpx4" in ptx  # scales SMEM -> TMEM, one 32x4x4 atom
    assert "cp.async.bulk.tensor" in ptx  # TMA loads
    assert "tcgen05.ld.sync.aligned.32x32b" in ptx  # accumulator TMEM -> registers
    # One RNE rounding to the output type, after the fp32 multiply by alpha.
    cvt = {torch.bfloat16: r"cvt\.rn\.bf16(x2)?\.f32", torch.float16: r"cvt\.rn\.f16(x2)?\.f32"}
    if out_dtype in cvt:
        assert re.search(cvt[out_dtype], ptx)
    # A CUDA ELF (EM_CUDA = 190) built by ptxas for sm_100a.
    cubin = compiled.cubin
    assert cubin[:4] == b"\x7fELF" and int.from_bytes(cubin[18:20], "little") == 190
    assert b"sm_100a" in cubin


def _cuobjdump():
    try:
        import nvidia  # the CUDA toolkit wheels that cuda-tile[tileiras] brings
        found = [p for root in nvidia.__path__ for p in pathlib.Path(root).glob("cu*/bin/cuobjdump")]
    except ImportError:
        found = []
    return str(found[0]) if found else shutil.which("cuobjdump")


@pytest.mark.aot
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("fmt_name", FORMATS)
def test_no_register_spills(fmt_name, out_dtype, tmp_path):
    # 128 fp32 accumulator values per thread in the epilogue: check they stay in registers.
    tool = _cuobjdump()
    if tool is None:
        pytest.skip("cuobjdump not found")
    cubin = tmp_path / "kernel.cubin"
    cubin.write_bytes(tc.compile_for_sm100(fmt_name, out_dtype).cubin)
    usage = subprocess.run([tool, "--dump-resource-usage", str(cubin)], check=True,
                           capture_output=True, text=True).stdout
    regs = re.search(r"REG:(\d+) STACK:(\d+) .*LOCAL:(\d+)", usage)
    assert regs, usage
    assert int(regs[1]) <= 255 and regs[2] == "0" and regs[3] == "0", usage


@pytest.mark.aot
def test_compiled_once_per_format_and_dtype():
    # M, N and K are runtime arguments: asking again returns the same compiled kernel.
    assert tc.compile_for_sm100("nvfp4") is tc.compile_for_sm100(tilemm.NVFP4, torch.bfloat16)


# --------------------------------------------------------------------------------------------------
# The kernel's scale layout is tilemm's 32x4x4 swizzle
# --------------------------------------------------------------------------------------------------

# Rows: 1 and 7 (one partial 128-row tile), 128 (exactly one), 129 (one row into the second), 300.
# Scale columns: 1 and 3 (partial 4-column group), 4, 5, 9. Blocks 16 (NVFP4) and 32 (MX).
LAYOUT_CASES = [(1, 1), (7, 3), (128, 4), (129, 5), (300, 9)]


@pytest.mark.parametrize("block", [16, 32])
@pytest.mark.parametrize("rows,cols", LAYOUT_CASES)
def test_scale_layout_equals_swizzle_index(rows, cols, block):
    offsets = bsg.scale_factor_offsets(rows, cols * block, block)
    row_tiles, col_tiles, _, _ = swizzle.swizzled_shape(rows, cols)
    # The layout's domain is the padded (round_up(rows, 128), round_up(cols, 4)) scale matrix.
    assert offsets.shape == (row_tiles * 128, col_tiles * 4)
    r, c = np.meshgrid(np.arange(offsets.shape[0]), np.arange(offsets.shape[1]), indexing="ij")
    np.testing.assert_array_equal(offsets, swizzle.swizzle_index(r, c, cols))
    # ... and a bijection onto the swizzled tensor's elements.
    np.testing.assert_array_equal(np.sort(offsets.ravel()), np.arange(offsets.size))


@pytest.mark.parametrize("rows,cols", LAYOUT_CASES)
def test_scale_layout_reads_the_swizzled_bytes(rows, cols):
    # Read swizzle_32_4_4's output through the kernel's layout: every scale comes back, and every
    # padded position reads zero.
    rng = np.random.default_rng(rows * 31 + cols)
    scale = rng.integers(1, 256, size=(rows, cols), dtype=np.uint8)
    flat = swizzle.swizzle_32_4_4(scale).ravel()
    offsets = bsg.scale_factor_offsets(rows, cols * 32, 32)
    read = flat[offsets]
    np.testing.assert_array_equal(read[:rows, :cols], scale)
    assert not read[rows:, :].any() and not read[:, cols:].any()


# --------------------------------------------------------------------------------------------------
# Arguments (CPU tensors: every check runs before the GPU is looked at)
# --------------------------------------------------------------------------------------------------

M, N, K = 7, 17, 64


@pytest.fixture(scope="module")
def mx():
    return _operands("mxfp8_e4m3", M, N, K)


@pytest.fixture(scope="module")
def nv():
    return _operands("nvfp4", M, N, K)


def test_valid_arguments_reach_the_gpu_check(mx):
    (args, kw) = _args("mxfp8_e4m3", *mx)
    with pytest.raises(tilemm.UnsupportedGPUError, match=r"compute capability 10\.x.*tensors are on cpu"):
        tc.block_scaled_matmul(*args, **kw)


@pytest.mark.parametrize("fmt,error,match", [
    ("fp8_e4m3", ValueError, r"fmt must be one of .*'nvfp4'.*got 'fp8_e4m3' \(plain FP8 has no block"),
    ("mxfp6", ValueError, r"fmt must be one of .*got 'mxfp6'"),
    (tilemm.FP8_E4M3, ValueError, r"fmt must be a block-scaled format .*got Format\(fp8_e4m3\)"),
    (3, TypeError, r"fmt must be a format name .*got int"),
])
def test_bad_format(mx, fmt, error, match):
    (_, *rest), kw = _args("mxfp8_e4m3", *mx)
    with pytest.raises(error, match=match):
        tc.block_scaled_matmul(fmt, *rest, **kw)


def test_bad_operands(mx, nv):
    x, w = mx
    f = tc.block_scaled_matmul
    with pytest.raises(TypeError, match=r"\ba must be a torch.Tensor .*got ndarray"):
        f("mxfp8_e4m3", x.data.float().numpy(), x.scale, w.data, w.scale)
    with pytest.raises(TypeError, match=r"\ba must have dtype torch.float8_e4m3fn for mxfp8_e4m3, got torch.uint8"):
        f("mxfp8_e4m3", x.data.view(torch.uint8), x.scale, w.data, w.scale)
    with pytest.raises(TypeError, match=r"\bb must have dtype uint8 \(two e2m1 per byte.*got torch.float8_e4m3fn"):
        f("nvfp4", nv[0].data, nv[0].scale, w.data, nv[1].scale, global_scale_a=1.0, global_scale_b=1.0)
    with pytest.raises(ValueError, match=r"\ba must be 2-D \(M, K\), got shape \(1, 7, 64\)"):
        f("mxfp8_e4m3", x.data[None], x.scale, w.data, w.scale)
    with pytest.raises(ValueError, match=r"\bb must be contiguous .*got strides \(1, 17\)"):
        f("mxfp8_e4m3", x.data, x.scale, w.data.t().contiguous().t(), w.scale)
    with pytest.raises(ValueError, match=r"K differ: a \(7, 64\), b \(17, 32\)"):
        f("mxfp8_e4m3", x.data, x.scale, w.data[:, :32].contiguous(), w.scale)


def test_k_constraints():
    # K = 48 is a whole number of NVFP4 blocks but its fp4 rows (24 bytes) cannot start on 16-byte
    # boundaries; K = 40 is not a whole number of blocks at all.
    x, w = _operands("nvfp4", M, N, 48)
    args, kw = _args("nvfp4", x, w)
    with pytest.raises(ValueError, match=r"K must be a multiple of 32 \(TMA .*got K=48"):
        tc.block_scaled_matmul(*args, **kw)
    a = torch.zeros(M, 20, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"K must be a multiple of the nvfp4 block size 16, got K=40"):
        tc.block_scaled_matmul("nvfp4", a, x.scale, a, w.scale, global_scale_a=1.0, global_scale_b=1.0)


def test_bad_scales(mx, nv):
    x, w = mx
    f = tc.block_scaled_matmul
    logical = tilemm.quantize_mxfp8(torch.randn(M, K)).scale  # (7, 2): not swizzled
    with pytest.raises(ValueError, match=r"a_scale must be the swizzled 32x4x4 scale of a, shape "
                                         r"\(ceil\(7/128\), ceil\(2/4\), 32, 16\) = \(1, 1, 32, 16\).*got \(7, 2\)"):
        f("mxfp8_e4m3", x.data, logical, w.data, w.scale)
    with pytest.raises(TypeError, match=r"b_scale must have dtype torch.float8_e8m0fnu or torch.uint8 "
                                        r"for mxfp8_e4m3, got torch.float32"):
        f("mxfp8_e4m3", x.data, x.scale, w.data, w.scale.view(torch.uint8).float())
    with pytest.raises(TypeError, match=r"a_scale must have dtype torch.float8_e4m3fn for nvfp4, got torch.uint8"):
        f("nvfp4", nv[0].data, nv[0].scale.view(torch.uint8), nv[1].data, nv[1].scale,
          global_scale_a=1.0, global_scale_b=1.0)
    with pytest.raises(ValueError, match=r"b_scale must be contiguous"):
        f("mxfp8_e4m3", x.data, x.scale, w.data, w.scale.transpose(-1, -2).contiguous().transpose(-1, -2))
    # uint8 bytes are accepted for e8m0: this gets as far as the GPU check.
    with pytest.raises(tilemm.UnsupportedGPUError):
        f("mxfp8_e4m3", x.data, x.scale.view(torch.uint8), w.data, w.scale.view(torch.uint8))


def test_bad_scalars_and_out_dtype(mx, nv):
    x, w = mx
    f = tc.block_scaled_matmul
    base = ("mxfp8_e4m3", x.data, x.scale, w.data, w.scale)
    with pytest.raises(TypeError, match=r"out_dtype must be one of torch.bfloat16, torch.float16, "
                                        r"torch.float32, got torch.float8_e4m3fn"):
        f(*base, out_dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"alpha must be a scalar .*got a tensor of shape \(2,\)"):
        f(*base, alpha=torch.ones(2))
    with pytest.raises(TypeError, match=r"alpha must be a float or a 0-d float tensor, got str"):
        f(*base, alpha="2")
    with pytest.raises(TypeError, match=r"global_scale_a / global_scale_b are NVFP4's .*mxfp8_e4m3 has none"):
        f(*base, global_scale_a=1.0)
    nv_args, _ = _args("nvfp4", *nv)
    with pytest.raises(TypeError, match=r"nvfp4 needs global_scale_a and global_scale_b .*missing global_scale_b"):
        f(*nv_args, global_scale_a=nv[0].global_scale)


def test_compile_for_sm100_arguments():
    with pytest.raises(ValueError, match=r"compile_for_sm100: fmt must be one of"):
        tc.compile_for_sm100("fp8_e5m2")
    with pytest.raises(TypeError, match=r"compile_for_sm100: out_dtype must be one of"):
        tc.compile_for_sm100("nvfp4", torch.int8)


def test_import_without_the_dsl():
    # `import tilemm` and `tilemm.cute` work without nvidia-cutlass-dsl; compiling says what to install.
    code = textwrap.dedent("""
        import sys
        sys.modules["cutlass"] = None  # as if nvidia-cutlass-dsl were not installed
        import tilemm, tilemm.cute
        assert not tilemm.cute.is_available()
        try:
            tilemm.cute.compile_for_sm100("nvfp4")
        except tilemm.cute.CuteDSLMissingError as err:
            assert "pip install 'tilemm[cute]'" in str(err), err
        else:
            raise AssertionError("compile_for_sm100 did not raise")
        assert "cutlass" not in {m.split(".")[0] for m in sys.modules if sys.modules[m] is not None}
    """)
    subprocess.run([sys.executable, "-c", code], check=True)


# --------------------------------------------------------------------------------------------------
# tilemm.crosscheck
# --------------------------------------------------------------------------------------------------

def test_crosscheck_arguments(mx, nv):
    with pytest.raises(ValueError, match=r"fmt_name is 'nvfp4' but x_q holds mxfp8_e4m3 data"):
        tilemm.crosscheck("nvfp4", *mx)
    with pytest.raises(TypeError, match=r"x_q must be a quantized tensor .*got Tensor"):
        tilemm.crosscheck("mxfp8_e4m3", mx[0].data, mx[1])
    with pytest.raises(ValueError, match=r"fmt_name must be one of .*got 'fp8_e4m3' \(plain FP8"):
        tilemm.crosscheck("fp8_e4m3", *mx)


@pytest.mark.skipif(BLACKWELL is not None, reason="a compute capability 10.x GPU is present")
def test_crosscheck_says_why_it_cannot_run(nv):
    with pytest.raises(tilemm.UnsupportedGPUError,
                       match=r"needs a compute capability 10\.x GPU \(Blackwell\); none present"):
        tilemm.crosscheck("nvfp4", *nv)


# --------------------------------------------------------------------------------------------------
# On a compute capability 10.x GPU
# --------------------------------------------------------------------------------------------------

# M = 1 and N = 17 (single partial tiles), M = 100 / N = 129 (partial second tile in N), K = 320
# (not a multiple of the 128- or 256-element k-tile), and a square case with several k-tiles.
GPU_SHAPES = [(1, 17, 64), (100, 129, 320), (256, 256, 1024)]


@pytest.mark.gpu
@needs_blackwell
@pytest.mark.parametrize("m,n,k", GPU_SHAPES)
@pytest.mark.parametrize("fmt_name", FORMATS)
def test_crosscheck(fmt_name, m, n, k):
    x, w = _operands(fmt_name, m, n, k, seed=m + n + k)
    report = tilemm.crosscheck(fmt_name, x, w, out_dtype=torch.float32)
    # Two fp32 accumulations of the same exact products, in different orders (docs/numerics.md tolerance).
    for pair, err in report.errors.items():
        assert err.rel_fro < 1e-5, f"{pair}: {err}\n{report}"


@pytest.mark.gpu
@needs_blackwell
@pytest.mark.parametrize("out_dtype", OUT_DTYPES, ids=str)
@pytest.mark.parametrize("fmt_name", FORMATS)
def test_out_dtypes_and_alpha(fmt_name, out_dtype):
    x, w = _operands(fmt_name, 100, 129, 320, device=BLACKWELL)
    args, kw = _args(fmt_name, x, w)
    out = tc.block_scaled_matmul(*args, **kw, alpha=0.5, out_dtype=out_dtype)
    expected = tilemm.linear(type(x)(*(t.cpu() for t in x)), type(w)(*(t.cpu() for t in w)),
                             out_dtype=torch.float32, alpha=0.5)
    assert out.dtype == out_dtype and out.shape == (100, 129)
    err = (out.float().cpu() - expected).norm() / expected.norm()
    assert err < {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 4e-3}[out_dtype]


@pytest.mark.gpu
@needs_blackwell
@pytest.mark.parametrize("fmt_name", FORMATS)
def test_padded_scale_rows_are_not_mixed_in(fmt_name):
    # The kernel loads whole 128-row scale tiles; rows past M / N meet zero-filled data and land in
    # output rows that are never stored. Poison them (0xFF is NaN in e8m0 and e4m3) to prove it.
    m, n, k = 100, 17, 128
    x, w = _operands(fmt_name, m, n, k, device=BLACKWELL)
    args, kw = _args(fmt_name, x, w)
    clean = tc.block_scaled_matmul(*args, **kw, out_dtype=torch.float32)
    a_scale, b_scale = x.scale.clone(), w.scale.clone()
    for s, rows in ((a_scale, m), (b_scale, n)):
        u8 = s.view(torch.uint8)
        for row in range(rows, 128):  # 32x4x4: row r is block row r % 32, columns 4 (r // 32) + 0..3
            u8[0, :, row % 32, (row // 32) * 4:(row // 32) * 4 + 4] = 0xFF
    poisoned = tc.block_scaled_matmul(fmt_name, x.data, a_scale, w.data, b_scale, **kw,
                                      out_dtype=torch.float32)
    torch.testing.assert_close(poisoned, clean, rtol=0, atol=0)
