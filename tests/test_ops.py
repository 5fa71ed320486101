"""tilemm's custom operators (``torch.ops.tilemm.*``): opcheck, fake (meta) shapes, torch.compile.

The public functions call these operators, so the rest of the suite tests their results; here we check
what PyTorch needs from a custom operator: a schema that tells the truth (no mutation, no aliasing),
fake implementations whose shapes, dtypes and strides match the real outputs, and graphs that
torch.compile can capture whole (``fullgraph=True``) with results identical to eager.
"""

from __future__ import annotations

import pytest
import torch

from _gpu import GPU_SKIP_REASON

import tilemm

ops = torch.ops.tilemm
E4M3, E5M2, E8M0 = torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e8m0fnu


def _x(*shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * 3).to(dtype)


# --------------------------------------------------------------------------------------------------
# Quantizers: the full opcheck (their inputs are float tensors that torch's schema check can compare)
# --------------------------------------------------------------------------------------------------

# Shapes: M = 1 and 7 (partial 128-row swizzle tile), 130 (two row tiles), a batch dim; K = 64 gives
# 2 MX blocks (one partial group of 4 scale columns when swizzled), 256 the FP8 128-blocks.
QUANTIZE_CASES = [
    ("mxfp8", ops.quantize_mxfp8, (_x(7, 64), None, "rceil", False)),
    ("mxfp8-e5m2-floor-swizzled", ops.quantize_mxfp8, (_x(2, 130, 64, dtype=torch.bfloat16), E5M2, "floor", True)),
    ("mxfp4-swizzled", ops.quantize_mxfp4, (_x(1, 64), "rceil", True)),
    ("mxfp4-floor", ops.quantize_mxfp4, (_x(3, 5, 64, dtype=torch.float16), "floor", False)),
    ("nvfp4", ops.quantize_nvfp4, (_x(7, 32), None, False)),
    ("nvfp4-given-global-scale-swizzled", ops.quantize_nvfp4, (_x(130, 64), torch.tensor(0.02), True)),
    ("fp8-tensor", ops.quantize_fp8, (_x(7, 48), "tensor", None, False)),
    ("fp8-row-e5m2", ops.quantize_fp8, (_x(2, 7, 48), "row", E5M2, False)),
    ("fp8-1x128", ops.quantize_fp8, (_x(7, 256), "1x128", None, False)),
    ("fp8-128x128-pow2", ops.quantize_fp8, (_x(130, 256), "128x128", None, True)),
]


@pytest.mark.parametrize("op,args", [c[1:] for c in QUANTIZE_CASES], ids=[c[0] for c in QUANTIZE_CASES])
def test_quantize_opcheck(op, args):
    torch.library.opcheck(op.default, args)


# Expected shapes written out by hand from the docstrings (32x4x4: (ceil(M/128), ceil(K/B/4), 32, 16)).
EXPECTED_QUANTIZE = {
    "mxfp8": [((7, 64), E4M3), ((7, 2), E8M0)],
    "mxfp8-e5m2-floor-swizzled": [((2, 130, 64), E5M2), ((2, 2, 1, 32, 16), E8M0)],
    "mxfp4-swizzled": [((1, 32), torch.uint8), ((1, 1, 32, 16), E8M0)],
    "mxfp4-floor": [((3, 5, 32), torch.uint8), ((3, 5, 2), E8M0)],
    "nvfp4": [((7, 16), torch.uint8), ((7, 2), E4M3), ((), torch.float32)],
    "nvfp4-given-global-scale-swizzled": [((130, 32), torch.uint8), ((2, 1, 32, 16), E4M3), ((), torch.float32)],
    "fp8-tensor": [((7, 48), E4M3), ((), torch.float32)],
    "fp8-row-e5m2": [((2, 7, 48), E5M2), ((2, 7, 1), torch.float32)],
    "fp8-1x128": [((7, 256), E4M3), ((7, 2), torch.float32)],
    "fp8-128x128-pow2": [((130, 256), E4M3), ((2, 2), torch.float32)],
}


def _meta(args):
    return tuple(a.to("meta") if isinstance(a, torch.Tensor) else a for a in args)


@pytest.mark.parametrize("name,op,args", QUANTIZE_CASES, ids=[c[0] for c in QUANTIZE_CASES])
def test_quantize_fake_shapes_match_real_outputs(name, op, args):
    real = op(*args)
    fake = op(*_meta(args))
    got = [(tuple(t.shape), t.dtype) for t in fake]
    assert got == EXPECTED_QUANTIZE[name]
    assert got == [(tuple(t.shape), t.dtype) for t in real]
    assert [t.stride() for t in fake] == [t.stride() for t in real]


# --------------------------------------------------------------------------------------------------
# Matmuls. torch's schema check compares inputs before and after with allclose, which has no float8
# kernel on the CPU ("mul_cpu_reduced_float" not implemented for Float8_e4m3fn), so for these ops
# opcheck runs its other tests and the schema (no mutation, no aliasing) is checked on the bytes here.
# --------------------------------------------------------------------------------------------------

OPCHECK_WITHOUT_SCHEMA = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


def _matmul_cases():
    x, w = _x(2, 7, 64), _x(17, 64, seed=1)  # batched x, shared 2-D y; N = 17 fits no tile
    bias, alpha = _x(17, seed=2), torch.tensor(0.5)
    mx = tilemm.quantize_mxfp8(x, swizzle=True), tilemm.quantize_mxfp8(w, swizzle=True)
    m4 = tilemm.quantize_mxfp4(x), tilemm.quantize_mxfp4(w)
    nv = tilemm.quantize_nvfp4(x, swizzle=True), tilemm.quantize_nvfp4(w, swizzle=True)
    f8 = tilemm.quantize_fp8(x, granularity="row"), tilemm.quantize_fp8(w, granularity="row")
    return [
        ("mxfp8-swizzled-bias-alpha", ops.mxfp8_matmul,
         (mx[0].data, mx[0].scale, mx[1].data.t(), mx[1].scale, torch.float32, bias, alpha)),
        ("mxfp4-logical-fp16", ops.mxfp4_matmul,
         (m4[0].data, m4[0].scale, m4[1].data.t(), m4[1].scale.t(), torch.float16, None, None)),
        ("nvfp4-swizzled", ops.nvfp4_matmul,
         (nv[0].data, nv[0].scale, nv[1].data.t(), nv[1].scale, nv[0].global_scale, nv[1].global_scale,
          torch.bfloat16, bias.to(torch.bfloat16), None)),
        ("fp8-row", ops.fp8_matmul,
         (f8[0].data, f8[0].scale, f8[1].data.t(), f8[1].scale.t(), torch.float32, None, alpha, False)),
    ]


MATMUL_CASES = _matmul_cases()
MATMUL_IDS = [c[0] for c in MATMUL_CASES]


@pytest.mark.parametrize("op,args", [c[1:] for c in MATMUL_CASES], ids=MATMUL_IDS)
def test_matmul_opcheck(op, args):
    torch.library.opcheck(op.default, args, test_utils=OPCHECK_WITHOUT_SCHEMA)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8).clone() if t.ndim else t.reshape(1).view(torch.uint8).clone()


@pytest.mark.parametrize("op,args", [c[1:] for c in MATMUL_CASES], ids=MATMUL_IDS)
def test_matmul_neither_mutates_nor_aliases_its_inputs(op, args):
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    before = [_bytes(t) for t in tensors]
    out = op(*args)
    assert all(torch.equal(b, _bytes(t)) for b, t in zip(before, tensors))
    storages = {t.untyped_storage().data_ptr() for t in tensors}
    assert out.untyped_storage().data_ptr() not in storages


@pytest.mark.parametrize("op,args", [c[1:] for c in MATMUL_CASES], ids=MATMUL_IDS)
def test_matmul_fake_shapes_match_real_outputs(op, args):
    real, fake = op(*args), op(*_meta(args))
    assert (tuple(fake.shape), fake.dtype, fake.stride()) == (tuple(real.shape), real.dtype, real.stride())
    assert tuple(real.shape) == (2, 7, 17) and real.dtype == args[-4 if op is ops.fp8_matmul else -3]


def test_public_function_equals_the_op():
    """One code path: the public function is the operator plus argument handling."""
    for _, op, args in MATMUL_CASES:
        name = op._qualified_op_name.split("::")[1]
        public = getattr(tilemm, name)
        if op is ops.nvfp4_matmul:
            x, sx, y, sy, gx, gy, out_dtype, bias, alpha = args
            got = public(x, sx, y, sy, global_scale_x=gx, global_scale_y=gy, out_dtype=out_dtype, bias=bias)
        elif op is ops.fp8_matmul:
            x, sx, y, sy, out_dtype, bias, alpha, fast = args
            got = public(x, sx, y, sy, out_dtype=out_dtype, bias=bias, alpha=alpha)
        else:
            x, sx, y, sy, out_dtype, bias, alpha = args
            got = public(x, sx, y, sy, out_dtype=out_dtype, bias=bias, alpha=alpha)
        assert torch.equal(got, op(*args))


# --------------------------------------------------------------------------------------------------
# The operators check their arguments with the public functions' messages, on real and fake tensors.
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_ops_check_their_arguments(device):
    x = _x(4, 64).to(device)
    with pytest.raises(ValueError, match=r"quantize_mxfp8: rounding must be 'rceil' or 'floor', got 'up'"):
        ops.quantize_mxfp8(x, None, "up", False)
    with pytest.raises(TypeError, match=r"quantize_mxfp8: elem_dtype must be .*got torch.float16"):
        ops.quantize_mxfp8(x, torch.float16, "rceil", False)
    with pytest.raises(ValueError, match=r"quantize_mxfp4: x.shape\[-1\] \(K\) must be a multiple of the block size 32, got K=48"):
        ops.quantize_mxfp4(x[:, :48], "rceil", False)
    with pytest.raises(ValueError, match=r"granularity must be 'tensor', 'row', '1x128' or '128x128', got '2x2'"):
        ops.quantize_fp8(x, "2x2", None, False)
    with pytest.raises(ValueError, match=r"quantize_nvfp4: global_scale must be a scalar"):
        ops.quantize_nvfp4(x, torch.ones(2, device=device), False)
    q = ops.quantize_mxfp8(x, None, "rceil", False)
    with pytest.raises(ValueError, match=r"mxfp8_matmul: x is \(..., M, K\) and y \(..., K, N\) but their K differ"):
        ops.mxfp8_matmul(q[0], q[1], q[0][:, :32].t(), q[1][:, :1].t(), torch.float32, None, None)
    with pytest.raises(TypeError, match=r"mxfp8_matmul: out_dtype must be one of .*got torch.int32"):
        ops.mxfp8_matmul(q[0], q[1], q[0].t(), q[1].t(), torch.int32, None, None)


def test_given_global_scale_is_checked_when_the_op_runs():
    with pytest.raises(ValueError, match=r"quantize_nvfp4: global_scale must be a positive finite decode scale, got -1.0"):
        tilemm.quantize_nvfp4(_x(4, 32), global_scale=-1.0)
    with pytest.raises(ValueError, match=r"global_scale must be a positive finite decode scale, got inf"):
        ops.quantize_nvfp4(_x(4, 32), torch.tensor(float("inf")), False)


def test_no_autograd_formula_backward_raises():
    bias = torch.zeros(17, requires_grad=True)
    _, op, args = MATMUL_CASES[0]
    out = op(*args[:5], bias, args[6])
    with pytest.raises(RuntimeError, match=r"no autograd formula"):
        out.sum().backward()


# --------------------------------------------------------------------------------------------------
# torch.compile: quantize -> matmul for every format in one graph, identical to eager.
# --------------------------------------------------------------------------------------------------

def _quantize_and_multiply(x, w, bias):
    """x (M, K) activations, w (N, K) weight: each format's linear, summed so that one graph holds all."""
    outs = []
    for quantize, kw in ((tilemm.quantize_mxfp8, dict(swizzle=True)),
                         (tilemm.quantize_mxfp4, dict(rounding="floor")),
                         (tilemm.quantize_nvfp4, dict(swizzle=True)),
                         (tilemm.quantize_fp8, dict(granularity="row"))):
        outs.append(tilemm.linear(quantize(x, **kw), quantize(w, **kw), bias=bias, out_dtype=torch.float32))
    xb, wb = tilemm.quantize_fp8(x, granularity=(1, 128)), tilemm.quantize_fp8(w, granularity=(128, 128))
    outs.append(tilemm.linear(xb, wb, out_dtype=torch.float32))
    return torch.stack(outs)


def _check_compiled_equals_eager(device):
    torch._dynamo.reset()
    x, w, bias = _x(33, 256).to(device), _x(40, 256, seed=1).to(device), _x(40, seed=2).to(device)
    eager = _quantize_and_multiply(x, w, bias)
    compiled = torch.compile(_quantize_and_multiply, fullgraph=True)(x, w, bias)
    assert compiled.shape == (5, 33, 40)
    assert torch.equal(compiled, eager)


def test_compile_fullgraph_equals_eager_cpu():
    # About 10-20 s on a 2-core CPU (inductor compiles the glue around the opaque tilemm ops).
    _check_compiled_equals_eager("cpu")


@pytest.mark.gpu
@pytest.mark.skipif(GPU_SKIP_REASON is not None, reason=GPU_SKIP_REASON or "")
def test_compile_fullgraph_equals_eager_gpu():
    _check_compiled_equals_eager("cuda")


@pytest.mark.gpu
@pytest.mark.skipif(GPU_SKIP_REASON is not None, reason=GPU_SKIP_REASON or "")
@pytest.mark.parametrize("op,args", [c[1:] for c in MATMUL_CASES], ids=MATMUL_IDS)
def test_matmul_fake_shapes_match_real_outputs_gpu(op, args):
    args = tuple(a.cuda() if isinstance(a, torch.Tensor) else a for a in args)
    real, fake = op(*args), op(*_meta(args))
    assert (tuple(fake.shape), fake.dtype, fake.stride()) == (tuple(real.shape), real.dtype, real.stride())


@pytest.mark.gpu
@pytest.mark.skipif(GPU_SKIP_REASON is not None, reason=GPU_SKIP_REASON or "")
@pytest.mark.parametrize("name,op,args", QUANTIZE_CASES, ids=[c[0] for c in QUANTIZE_CASES])
def test_quantize_fake_shapes_match_real_outputs_gpu(name, op, args):
    # The GPU quantizers write their own outputs: their shapes, dtypes and strides must be the fake's.
    args = tuple(a.cuda() if isinstance(a, torch.Tensor) else a for a in args)
    real, fake = op(*args), op(*_meta(args))
    assert [(tuple(t.shape), t.dtype, t.stride()) for t in fake] == \
        [(tuple(t.shape), t.dtype, t.stride()) for t in real]
    assert all(t.device.type == "cuda" for t in real)
