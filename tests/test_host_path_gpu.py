"""Repeated eager calls on the GPU: a call of a signature seen before runs its prepared launch (the
checks and the planning skipped, ``tilemm.kernels.PLANS``) and must give the bits that the full path
gives for the same operands; and the kernels per call of every public entry. The same launches are
compared argument by argument on the CPU in tests/test_launch_count.py.
"""

from __future__ import annotations

import pytest
import torch

import tilemm
from tilemm import kernels

from _gpu import kernels_per_call, requires_gpu

pytestmark = requires_gpu


def _bytes(value):
    if isinstance(value, torch.Tensor):
        return [value.reshape(-1).contiguous().view(torch.uint8).cpu()]  # 0-d scales too
    return [b for v in value for b in _bytes(v)]


def _same_bits_as_the_full_path(call, make_args, expect_prepared=True, forget=lambda: None,
                                kept=lambda: kernels.PLANS.values()):
    """``call`` on one set of operands, then on another of the same signature (the prepared launch,
    unless ``expect_prepared`` is False), against the full path (the plan table emptied, and ``forget()``
    called: a layer's own prepared calls dropped) on the second set. ``kept()`` lists the table the
    prepared launch lands in (a module's own table for ``MoEExperts``)."""
    first, second = make_args(1), make_args(2)  # before the table is emptied: their quantizes are not the call
    kernels.PLANS.clear()
    call(*first)
    prepared = call(*second)
    prepared_kept = any(type(v).__name__ in ("_Launch", "_QuantizeLaunch", "_MoELinearLaunch", "_MoEExpertsLaunch")
                        for v in kept())
    assert prepared_kept == expect_prepared
    kernels.PLANS.clear()
    forget()
    full = call(*second)
    for got, want in zip(_bytes(prepared), _bytes(full)):
        assert torch.equal(got, want)


def _operands(fmt, m, seed, n=512, k=1024):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, k, generator=gen, device="cuda").to(torch.bfloat16)
    w = torch.randn(n, k, generator=gen, device="cuda").to(torch.bfloat16)
    bias = torch.randn(n, generator=gen, device="cuda").to(torch.bfloat16)
    if fmt == "fp8_row":
        return tilemm.quantize_fp8(x, granularity="row"), tilemm.quantize_fp8(w, granularity="row"), bias
    if fmt == "fp8_blocks":
        return (tilemm.quantize_fp8(x, granularity=(1, 128)), tilemm.quantize_fp8(w, granularity=(128, 128)),
                bias)
    if fmt == "fp8_tensor":
        return tilemm.quantize_fp8(x, granularity="tensor"), tilemm.quantize_fp8(w, granularity="tensor"), bias
    q = getattr(tilemm, f"quantize_{fmt}")
    return q(x, swizzle=True), q(w, swizzle=True), bias


@pytest.mark.parametrize("m", [1, 16, 64])
@pytest.mark.parametrize("fmt", ["mxfp8", "mxfp4", "nvfp4", "fp8_row", "fp8_blocks", "fp8_tensor"])
def test_repeated_matmul_calls_gpu(fmt, m):
    alpha = torch.tensor(0.75, device="cuda")
    _same_bits_as_the_full_path(lambda xq, wq, bias: tilemm.linear(xq, wq, bias=bias, alpha=alpha),
                                lambda seed: _operands(fmt, m, seed))
    if fmt == "fp8_blocks":
        return
    if fmt in ("fp8_row", "fp8_tensor"):
        def matmul(xq, wq, bias):
            return tilemm.fp8_matmul(xq.data, xq.scale, wq.data.t(), wq.scale.t(), bias=bias)
    elif fmt == "nvfp4":
        def matmul(xq, wq, bias):
            return tilemm.nvfp4_matmul(xq.data, xq.scale, wq.data.t(), wq.scale, global_scale_x=xq.global_scale,
                                       global_scale_y=wq.global_scale, bias=bias)
    else:
        def matmul(xq, wq, bias):
            return getattr(tilemm, f"{fmt}_matmul")(xq.data, xq.scale, wq.data.t(), wq.scale, bias=bias)
    _same_bits_as_the_full_path(matmul, lambda seed: _operands(fmt, m, seed))
    if m <= 16:
        xq, wq, _ = _operands(fmt, m, 3)
        # one launch; a per-tensor FP8 scale reaches the kernel as its one value (no copy kernel)
        assert len(kernels_per_call(lambda: matmul(xq, wq, None))) == 1


QUANTIZERS = [("mxfp8", dict(swizzle=True)), ("mxfp4", dict(swizzle=True)), ("nvfp4", dict(swizzle=True)),
              ("nvfp4", dict(swizzle=False)), ("fp8", dict(granularity="row")),
              ("fp8", dict(granularity=(1, 128))), ("fp8", dict(granularity=(128, 128))),
              ("fp8", dict(granularity="tensor"))]


@pytest.mark.parametrize("m", [1, 16, 200])
@pytest.mark.parametrize("fmt,options", QUANTIZERS, ids=[f"{f}-{o}" for f, o in QUANTIZERS])
def test_repeated_quantize_calls_gpu(fmt, options, m):
    q = getattr(tilemm, f"quantize_{fmt}")

    def make(seed):
        gen = torch.Generator(device="cuda").manual_seed(seed)
        return (torch.randn(m, 1024, generator=gen, device="cuda").to(torch.bfloat16),)

    _same_bits_as_the_full_path(lambda x: q(x, **options), make)
    x, = make(4)
    # One launch each (NVFP4 and FP8 per tensor take the tensor amax inside it: the grid fits one
    # block per SM here).
    assert len(kernels_per_call(lambda: q(x, **options))) == 1


@pytest.mark.parametrize("special", ["finite", "nan", "inf"])
@pytest.mark.parametrize("m", [1, 16, 200])
def test_fp8_per_tensor_amax_in_the_launch_gpu(special, m):
    # The one-launch FP8 per tensor (the amax taken inside the launch) gives the bits of the launch after a
    # separate tensor amax and of the reference; NaN propagates into the scale.
    from tilemm import quantize as tq
    from tilemm.formats import FP8_E4M3
    from tilemm.kernels import quantize_kernels as qk

    gen = torch.Generator(device="cuda").manual_seed(6)
    x = torch.randn(m, 1024, generator=gen, device="cuda").to(torch.bfloat16)
    if special != "finite":
        x[m // 2, 5] = float(special)
    kernels.PLANS.clear()
    assert len(kernels_per_call(lambda: tilemm.quantize_fp8(x, granularity="tensor"))) == 1
    one = tilemm.quantize_fp8(x, granularity="tensor")
    kernels.PLANS.clear()
    two = qk.quantize_fp8(x, FP8_E4M3, "tensor", False, amax=qk.tensor_amax(x, propagate_nan=True))
    ref = tq._quantize_fp8_reference(x.cpu(), FP8_E4M3, "tensor", False)
    for got, other, want in zip(_bytes(one), _bytes(two), _bytes(ref)):
        assert torch.equal(got, want) and torch.equal(other, want)


@pytest.mark.parametrize("granularity", ["row", "tensor", (128, 128)], ids=["row", "tensor", "blocks"])
@pytest.mark.parametrize("m", [1, 16])
def test_fp8_linear_layer_gpu(granularity, m):
    torch.manual_seed(0)
    lin = torch.nn.Linear(1024, 512, device="cuda", dtype=torch.bfloat16)
    layer = tilemm.nn.Linear.from_float(lin, "fp8", granularity=granularity)
    _same_bits_as_the_full_path(layer, lambda seed: (torch.randn(m, 1024, device="cuda").to(torch.bfloat16),),
                                forget=lambda: setattr(layer, "_runner", None))
    assert type(layer._runner).__name__ == "_PreparedFP8"  # the layer's own prepared calls
    x = torch.randn(m, 1024, device="cuda").to(torch.bfloat16)
    assert len(kernels_per_call(lambda: layer(x))) == 2  # the activation's quantize and the matmul


@pytest.mark.parametrize("tokens", [1, 16])
def test_repeated_moe_calls_gpu(tokens):
    # moe_linear and MoEExperts.forward: the prepared repeated call gives the full path's bits.
    def experts(n, k, seed):
        gen = torch.Generator(device="cuda").manual_seed(seed)
        w = torch.randn(8, n, k, generator=gen, device="cuda").to(torch.bfloat16)
        return tilemm.prepack(tilemm.quantize_mxfp4(w))

    stacked = experts(512, 1024, 1)
    block = tilemm.moe.MoEExperts(experts(2 * 256, 1024, 2), experts(1024, 256, 3))

    def make(seed):
        gen = torch.Generator(device="cuda").manual_seed(seed)
        x = torch.randn(tokens, 1024, generator=gen, device="cuda").to(torch.bfloat16)
        ids = torch.randint(0, 8, (tokens, 2), generator=gen, device="cuda", dtype=torch.int32)
        weights = torch.rand(tokens, 2, generator=gen, device="cuda").to(torch.bfloat16)
        return x, ids, weights

    _same_bits_as_the_full_path(lambda x, ids, weights: tilemm.moe_linear(x, stacked, ids), make)
    _same_bits_as_the_full_path(lambda x, ids, weights: block(x, ids, weights), make,
                                forget=block._launches.clear, kept=lambda: block._launches.values())
    silu = tilemm.moe.MoEExperts(experts(2 * 256, 1024, 4), experts(1024, 256, 5), activation="silu")
    _same_bits_as_the_full_path(lambda x, ids, weights: silu(x, ids, weights), make,
                                forget=silu._launches.clear, kept=lambda: silu._launches.values())
    # ... and the custom operators' bits (the route torch.compile and CPU tensors take)
    x, ids, weights = make(7)
    assert torch.equal(tilemm.moe_linear(x, stacked, ids),
                       torch.ops.tilemm.moe_linear(x, stacked.words, stacked.scale_t, stacked.constants,
                                                   stacked.fmt.name, stacked.in_features, ids, None))
    for m in (block, silu):
        tensors = (m.gate_up_words, m.gate_up_scale_t, m.gate_up_constants, m.formats[0])
        down = (m.down_words, m.down_scale_t, m.down_constants, m.formats[1])
        if m.activation == "silu":
            want = torch.ops.tilemm.silu_experts(x, ids, weights, *tensors, *down)
        else:
            want = torch.ops.tilemm.gpt_oss_experts(x, ids, weights, *tensors, m.gate_up_bias, *down, m.down_bias,
                                                    m.alpha, m.limit)
        assert torch.equal(m(x, ids, weights), want)
