"""The large-M weight-only designs on the GPU (``tilemm.kernels.hopper_weight_only_large``) against the fp64
oracle, the runner's dispatch through the plan, and one kernel per weight-only linear inside a
CUDA graph (no fill of a workspace, no zero bias)."""

from __future__ import annotations

import cuda.tile as ct
import pytest
import torch

import tilemm
from tilemm.formats import MXFP4, MXFP8_E4M3, MXFP8_E5M2, NVFP4
from tilemm.kernels import weight_only_kernels as wo
from tilemm.kernels import hopper_weight_only_large as wl

from _gpu import kernels_per_call, requires_gpu
from test_weight_only import quantized_weight
from test_weight_only_gpu import _check, _oracle

pytestmark = requires_gpu

DEV = torch.device("cuda")
FORMATS = [MXFP4, NVFP4, MXFP8_E4M3, MXFP8_E5M2]
IDS = [f.name for f in FORMATS]
# Every fused config of the sweep on MXFP4; the first (and the plan's fused configs) on every format.
_PLAN_FUSED = [c for r in wl.RULES.values() for c in (r.large, *(f for f, _ in r.fused))
               if c.kind == "fused"]
_CASES = ([(MXFP4, c) for c in wl.CANDIDATES]
          + [(f, c) for f in FORMATS[1:] for c in dict.fromkeys([wl.CANDIDATES[0], *_PLAN_FUSED])])


def _weight(fmt, n, k, seed):
    return quantized_weight(fmt, n, k, seed=seed, scale_bytes=(112, 124) if fmt.is_mx else (1, 0x50))


@pytest.mark.parametrize("fmt,cfg", _CASES, ids=[f"{f.name}-{c.name}" for f, c in _CASES])
def test_fused_kernel_matches_the_oracle(fmt, cfg):
    """M = 300 (a partial last x tile), N = 200 (a partial weight tile), K = 4128 (a partial last K
    tile), with a bias; on 3 persistent blocks (each takes several tiles) and on one block per SM."""
    m, n, k = 300, 200, 4128
    w_q = _weight(fmt, n, k, seed=3)
    packed = tilemm.prepack(w_q).to(DEV)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    bias = torch.randn(n)
    ref = _oracle(x, w_q, bias)
    for sms in (3, torch.cuda.get_device_properties(DEV).multi_processor_count):
        out = torch.full((m, n), float("nan"), device=DEV, dtype=torch.bfloat16)
        wl.launch(x.to(DEV), packed.words, packed.scale_t, packed.constants, bias.to(DEV), out, packed.layout,
                  cfg, sms, torch.cuda.current_stream())
        _check(out, ref, torch.bfloat16)


# The sweep's structural variants (``VARIANTS``): every one on its family's first format, the first of
# each family on the other formats.
_VARIANT_CASES = ([(f, v) for f in (MXFP4, MXFP8_E4M3) for v in wl.VARIANTS[wl.family(wo.LAYOUTS[
                      "mxfp4" if f is MXFP4 else "mxfp8_e4m3"])]]
                  + [(f, wl.VARIANTS["4bit" if f is NVFP4 else "8bit"][0]) for f in (NVFP4, MXFP8_E5M2)])


@pytest.mark.parametrize("fmt,variant", _VARIANT_CASES,
                         ids=[f"{f.name}-{v[0].name}{'_sauto' if v[1] else ''}" for f, v in _VARIANT_CASES])
def test_fused_variants_match_the_oracle(fmt, variant):
    """M = 100 with N = 200 (a partial x tile and weight tile; with the K split: 4 ranges of K = 4128,
    its last partial K tile in the last range), with a bias, launched twice (the second launch reuses
    the split's partial workspace); M = 300 without a split, on 3 blocks and on every SM."""
    cfg, split, _, _ = variant
    m, n, k = (100, 200, 4128) if split else (300, 200, 4128)
    w_q = _weight(fmt, n, k, seed=7)
    packed = tilemm.prepack(w_q).to(DEV)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(8)).to(torch.bfloat16)
    bias = torch.randn(n)
    ref = _oracle(x, w_q, bias)
    sms = torch.cuda.get_device_properties(DEV).multi_processor_count
    if split:
        cfg = wl.with_split(cfg, m, n, k, packed.layout, sms)
        assert cfg.split_k > 1
    for blocks in ((sms, sms) if split else (3, sms)):
        out = torch.full((m, n), float("nan"), device=DEV, dtype=torch.bfloat16)
        with ct.compiler_timeout(300):  # a compile that hangs fails here instead of stalling the run
            wl.launch(x.to(DEV), packed.words, packed.scale_t, packed.constants, bias.to(DEV), out,
                      packed.layout, cfg, blocks, torch.cuda.current_stream())
        _check(out, ref, torch.bfloat16)

@pytest.mark.parametrize("fmt", [MXFP4, NVFP4, MXFP8_E4M3], ids=["mxfp4", "nvfp4", "mxfp8_e4m3"])
@pytest.mark.parametrize("chunk", [0, 64])
def test_decode_gemm_matches_the_oracle(fmt, chunk):
    """Decode + cuBLAS, the whole weight or 64 rows at a time (N = 200: a partial last chunk); NVFP4's
    alpha (2^E * decode scale) goes through cuBLAS's epilogue."""
    m, n, k = 520, 200, 4128
    w_q = _weight(fmt, n, k, seed=4)
    packed = tilemm.prepack(w_q).to(DEV)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    out = torch.empty((m, n), device=DEV, dtype=torch.bfloat16)
    wl.decode_gemm(x.to(DEV), packed.words, packed.scale_t, packed.constants, packed.alpha_host, out,
                   packed.layout, k, chunk, torch.cuda.current_stream())
    _check(out, _oracle(x, w_q, None), torch.bfloat16)


@pytest.mark.parametrize("fmt,m", [(NVFP4, 600), (MXFP4, 2048), (MXFP8_E4M3, 2048)], ids=["nvfp4", "mxfp4", "mxfp8_e4m3"])
def test_decode_design_adds_a_bf16_bias_before_its_one_rounding(fmt, m):
    """The runner on the decode design (NVFP4 from 512 rows, every format from 2048) with a bf16 bias:
    cuBLAS's epilogue adds it in fp32, then rounds once. Against the fp64 oracle rounded once to bf16,
    at most 2 % of the outputs differ (only where the fp32 sums' order moves a value across a rounding
    boundary); a bias added after a first rounding to bf16 would change far more. N = 200, K = 4128."""
    n, k = 200, 4128
    w_q = _weight(fmt, n, k, seed=5)
    packed = tilemm.prepack(w_q).to(DEV)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    ref0 = _oracle(x, w_q, None)
    bias = (torch.randn(n, generator=torch.Generator().manual_seed(7)) * ref0.std()).to(torch.bfloat16)
    runner = tilemm.weight_only.WeightOnlyRunner(packed, bias.to(DEV))
    assert wl.plan(m, n, k, packed.layout).kind == "decode"
    out = runner(x.to(DEV))
    ref = ref0 + bias.double()
    _check(out, ref, torch.bfloat16)
    differ = (out.cpu() != ref.to(torch.bfloat16)).double().mean().item()
    assert differ <= 0.02, differ


@pytest.mark.parametrize("fmt", [MXFP4, NVFP4, MXFP8_E4M3], ids=["mxfp4", "nvfp4", "mxfp8_e4m3"])
@pytest.mark.parametrize("chunk", [64, 200])
def test_overlap_gemm_matches_the_oracle_eager_and_in_a_graph(fmt, chunk):
    """The overlapped design: 64-row chunks (4, the last partial: each ping-pong buffer decoded into
    twice while the other is multiplied) or one chunk; eagerly, then captured into a CUDA graph on a
    stream of its own and replayed twice on new x (the side stream forked from and joined back to the
    capture stream)."""
    m, n, k = 520, 200, 4128
    w_q = _weight(fmt, n, k, seed=4)
    packed = tilemm.prepack(w_q).to(DEV)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    xd = x.to(DEV)
    out = torch.full((m, n), float("nan"), device=DEV, dtype=torch.bfloat16)
    call = lambda: wl.overlap_gemm(xd, packed.words, packed.scale_t, packed.constants,  # noqa: E731
                                   packed.alpha_host, out, packed.layout, k, chunk)
    call()
    _check(out, _oracle(x, w_q, None), torch.bfloat16)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        call()  # sizes this stream's buffers (and the graph buffers) outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        call()
    for seed in (5, 6):
        x2 = torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
        xd.copy_(x2)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        _check(out, _oracle(x2, w_q, None), torch.bfloat16)


@pytest.mark.parametrize("m,n,k", [(256, 384, 2048), (600, 384, 2048), (2100, 384, 2048), (200, 4096, 4096),
                                   (600, 4096, 4096)])
@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
def test_runner_follows_the_plan(m, n, k, bias):
    """``tilemm.linear`` at large M dispatches as ``hopper_weight_only_large.plan`` says (with a bias, the
    decode design's fp32-output GEMM) and matches the oracle: a weight small enough for the decode
    design at any M, and a 4096 x 4096 one that takes the fused kernels (64 x 128 tiles at M = 200,
    128 x 128 at M = 600)."""
    assert n != 4096 or wl.plan(m, n, k, wo.LAYOUTS["mxfp4"]).kind == "fused"
    w_q = _weight(MXFP4, n, k, seed=5)
    packed = tilemm.prepack(w_q).to(DEV)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(torch.bfloat16)
    b = torch.randn(n) if bias else None
    out = tilemm.linear(x.to(DEV), packed, bias=None if b is None else b.to(DEV))
    _check(out, _oracle(x, w_q, b), torch.bfloat16)


def _graph_kernels(fn, warm_on_capture_stream: bool) -> list[str]:
    """What one replay of a CUDA graph of ``fn()`` runs on the GPU, as the profiler names it (kernels,
    memsets), after a warm-up call on the capture stream (as torch.compile's graphs do) or on a side
    stream, the graph then captured on torch's default capture stream (as ``tests/_gpu.capture``)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream if warm_on_capture_stream else None):
        fn()
    return kernels_per_call(graph.replay)


@pytest.mark.parametrize("m", [1, 4])
@pytest.mark.parametrize("warm", ["capture_stream", "side_stream"])
def test_custom_op_is_one_kernel_in_a_cuda_graph(m, warm):
    """The custom op (what torch.compile runs) on a GQA k / v shape with a long K (1024 x 14336), which
    splits K (over K = 4096 the few-row plans do not): no memset or fill per replay (the split-K
    workspace and the zero bias are persistent buffers): one kernel at M = 1 (the small-M kernel ends
    its split itself), and at M = 4, where the plan takes the fused kernel's K split, its two launches
    (the partial tiles, then their sum)."""
    n, k = 1024, 14336
    w_q = _weight(MXFP4, n, k, seed=6)
    packed = tilemm.prepack(w_q).to(DEV)
    x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
    large = wl.plan(m, n, k, packed.layout)
    if m == 1:
        assert large is None and wo.plan(m, n, k, packed.layout).split_k > 1
    else:
        assert large.kind == "fused" and large.split_k > 1
    op = torch.ops.tilemm.weight_only_linear
    call = lambda: op(x, packed.words, packed.scale_t, packed.constants, "mxfp4", k)  # noqa: E731
    names = _graph_kernels(call, warm == "capture_stream")
    assert len(names) == (1 if m == 1 else 2), names
    assert m == 1 or "partial_sum" in names[1], names
    assert not any("fill" in name.lower() or "memset" in name.lower() for name in names), names
    _check(call(), _oracle(x.cpu(), w_q, None), torch.bfloat16)
