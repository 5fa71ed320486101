"""The grouped MoE kernel on the GPU: ``tilemm.moe_linear`` against the CPU reference on the same
stacked packed weight (shapes, formats, uniform / skewed / out-of-range routings), inside a CUDA graph
(routing changed between replays), under ``torch.compile(fullgraph=True)``, and gpt-oss's experts
module against transformers' on the GPU; SiLU-gated (Qwen3-MoE) experts against their CPU path, and
their fused gating against ``silu_glu`` of the unfused gate_up."""

from __future__ import annotations

import pytest
import torch

import tilemm
from tilemm.kernels import moe_kernels as mk
from tilemm.moe import MoEExperts

from _gpu import capture, kernels_per_call, requires_gpu
from test_moe import QUANTIZERS, reference64

pytestmark = requires_gpu

DEV = torch.device("cuda")
TOL = {torch.bfloat16: 4e-3 + 1e-5, torch.float16: 1e-3 + 1e-5}


def _check(out, ref, dtype):
    out64, ref = out.double().cpu(), ref.double().cpu()
    ok = ~ref.isnan()
    assert out64[~ok].isnan().all(), "rows of out-of-range ids must be NaN"
    assert torch.isfinite(out64[ok]).all()
    err = ((out64[ok] - ref[ok]).norm() / ref[ok].norm()).item()
    assert err < TOL[dtype], err


def _routing(kind, t, k, e, gen):
    if kind == "uniform":
        return torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)])
    if kind == "skewed":  # most tokens pick experts 0 .. k-1, a few others
        ids = torch.arange(k).repeat(t, 1)
        ids[::7] = torch.randint(0, e, (ids[::7].shape[0], k), generator=gen)
        return ids
    ids = torch.randint(0, e, (t, k), generator=gen)  # "invalid": some ids outside [0, E)
    ids[0, 0], ids[-1, -1] = e, -3  # (the same row when T = 1)
    return ids


def _cases():
    """(fmt, x dtype, (T, k, E, N, K), routing). Shapes: decode (T = 1, tile_m 16); a few tokens with
    N = 200 and K = 4128 not tile multiples, sorted (T = 5 of 6 experts) and per pair (T = 3 of 16); T = 100 top-4 of 16 (tile_m 32); T = 300 top-4 of 8
    (tile_m 128, several chunks per expert under skewed routing). fp16 on the first two shapes (each
    new (format, dtype, tile_m) is one more JIT compile)."""
    shapes = [(1, 4, 8, 256, 512), (5, 2, 6, 200, 4128), (100, 4, 16, 192, 256), (300, 4, 8, 128, 512),
              (3, 2, 16, 200, 4128)]
    for fmt in QUANTIZERS:
        for i, shape in enumerate(shapes):
            for routing in ("uniform", "skewed", "invalid"):
                yield pytest.param(fmt, torch.bfloat16, shape, routing, id=f"{fmt}-bf16-{shape}-{routing}")
                if i < 2:
                    yield pytest.param(fmt, torch.float16, shape, routing, id=f"{fmt}-fp16-{shape}-{routing}")


@pytest.mark.parametrize("fmt,x_dtype,shape,routing", list(_cases()))
def test_moe_linear_matches_reference(fmt, x_dtype, shape, routing):
    t, k, e, n, kdim = shape
    gen = torch.Generator().manual_seed(t + n)
    w_q = QUANTIZERS[fmt](torch.randn(e, n, kdim, generator=gen))
    packed = tilemm.prepack(w_q).to(DEV)
    x = torch.randn(t, kdim, generator=gen).to(x_dtype)
    ids = _routing(routing, t, k, e, gen)
    bias = torch.randn(e, n, generator=gen)
    out = tilemm.moe_linear(x.to(DEV), packed, ids.to(DEV), bias.to(DEV))
    assert out.shape == (t, k, n) and out.dtype == x_dtype
    _check(out, reference64(x, w_q, ids, bias), x_dtype)
    cpu = tilemm.moe_linear(x, packed.to("cpu"), ids, bias)
    _check(out, cpu.double(), x_dtype)


def test_one_token_launches_no_routing():
    """One token through gpt-oss's experts: the per-pair kernel twice (gate_up with the SwiGLU, down)
    and the weighted sum (a batched GEMM at this hidden size: ``moe_kernels.plan``), no routing."""
    gen = torch.Generator().manual_seed(1)
    gate_up = tilemm.prepack(tilemm.quantize_mxfp4(torch.randn(8, 512, 256, generator=gen))).to(DEV)
    down = tilemm.prepack(tilemm.quantize_mxfp4(torch.randn(8, 256, 256, generator=gen))).to(DEV)
    ours = MoEExperts(gate_up, down)
    x = torch.randn(1, 256, device=DEV, dtype=torch.bfloat16)
    ids = torch.tensor([[5, 1, 6, 2]], device=DEV)
    weights = torch.full((1, 4), 0.25, device=DEV, dtype=torch.bfloat16)
    names = kernels_per_call(lambda: ours(x, ids, weights))
    assert len(names) == 3, names
    assert not any(word in name.lower() for name in names for word in ("sort", "index", "search")), names


def test_one_kernel_after_routing():
    """One cuTile launch per projection (the routing at this size: one more, ``_route_kernel``)."""
    w_q = tilemm.quantize_mxfp4(torch.randn(8, 256, 512))
    packed = tilemm.prepack(w_q).to(DEV)
    x = torch.randn(4, 512, device=DEV, dtype=torch.bfloat16)
    ids = torch.randint(0, 8, (4, 2), device=DEV)
    names = kernels_per_call(lambda: tilemm.moe_linear(x, packed, ids))
    assert sum("moe_kernel" in name for name in names) == 1, names
    assert sum("route_kernel" in name for name in names) == 1, names
    assert not any("sort" in name.lower() for name in names), names


@pytest.mark.parametrize("rows_e", [(4, 6), (64, 128), (32, 256), (128, 32), (1, 8), (40, 9)])
@pytest.mark.parametrize("id_dtype", [torch.int64, torch.int32])
def test_route_kernel_matches_sorting_route(rows_e, id_dtype):
    """``_route_kernel`` on the GPU: order and offsets equal to the PyTorch route's, its slots the
    experts with rows busiest first then -1 (gpt-oss-120b at T = 16, the anchor at T = 4, gpt-oss-20b
    at T = 32, skewed and out-of-range ids)."""
    rows, e = rows_e
    gen = torch.Generator().manual_seed(rows + e)
    ids = torch.randint(-1, e + 2, (rows, 1), generator=gen)
    ids[: rows // 2] = torch.randint(0, 3, (rows // 2, 1), generator=gen)  # skewed: a few busy experts
    ids = ids.to(id_dtype).to(DEV)
    assert mk.route_kernel_fits(rows, e)
    order, offsets, slots, longest = mk.route(ids, e, kernel=False)
    k_order, k_offsets, k_slots, k_longest = mk.route(ids, e)
    assert torch.equal(k_order, order) and torch.equal(k_offsets, offsets) and torch.equal(k_longest, longest)
    counts = (offsets[1:] - offsets[:-1]).tolist()
    busiest = sorted((b for b in range(e + 1) if counts[b]), key=lambda b: (-counts[b], b))
    assert k_slots.tolist() == busiest + [-1] * (k_slots.numel() - len(busiest))


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_persistent_grid_equals_full_grid(fmt):
    """Skewed routing (the persistent grid, many empty slots): bit for bit the one-block-per-item
    result, with either routing's slots."""
    gen = torch.Generator().manual_seed(5)
    e, n, kdim, t, k = 64, 320, 512, 12, 4
    w_q = QUANTIZERS[fmt](torch.randn(e, n, kdim, generator=gen))
    packed = tilemm.prepack(w_q).to(DEV)
    x = torch.randn(t, kdim, generator=gen).to(torch.bfloat16).to(DEV)
    ids = torch.multinomial(1.0 / (torch.arange(e) + 1.0) ** 1.2, k, generator=gen).repeat(t, 1)
    ids[::3] = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(ids[::3].shape[0])])
    ids = ids.to(DEV)
    layout = tilemm.packed.layout_of(packed.fmt)
    cfg = mk.plan(t, k, e, n, kdim, layout, design="sorted").config
    assert mk.grid_blocks(10 ** 6, cfg, DEV) < 10 ** 6
    outs = []
    for kernel in (True, False):
        routed = mk.route(ids, e, kernel=kernel)
        xs = mk.sort_rows(x, routed, k)
        for blocks in (None, 2 ** 31 - 1):
            out = torch.empty(t * k, n, dtype=torch.bfloat16, device=DEV)
            mk.launch(xs, packed.words, packed.scale_t, packed.constants, None, routed, t, out, layout,
                      blocks=blocks)
            outs.append(out)
    for out in outs[1:]:
        assert torch.equal(out, outs[0])
    _check(outs[0].reshape(t, k, n), reference64(x.cpu(), w_q, ids.cpu()), torch.bfloat16)


def test_decode_step_captures_in_a_cuda_graph():
    """benchmarks/bench_moe.py's decode step (tiny gpt-oss shape, MXFP4 experts, batch 1 and 8):
    captured in a CUDA graph, a replay gives the eager step's logits and next tokens."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "bench_moe.py"
    spec = importlib.util.spec_from_file_location("bench_moe_gpu", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    config = bench.gpt_oss_config(bench.TINY, 2)
    experts = bench.packed_experts(config, 2, DEV, seed=3)
    for batch in (1, 8):
        model = bench.DecodeModel(config, experts, batch, 64, DEV)
        eager = bench.first_step_logits(model, DEV).clone()
        eager_ids = model.ids.clone()
        bench.first_step_logits(model, DEV)  # warm-up: compiles, caches
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            model.step()
        bench.start_state(model, DEV)  # the state of the eager step again
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(model.logits.float(), eager) and torch.equal(model.ids, eager_ids)
        assert int(model.pos) == bench.E2E_START + 1


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_cuda_graph_with_new_routing_each_replay(fmt):
    gen = torch.Generator().manual_seed(0)
    w_q = QUANTIZERS[fmt](torch.randn(16, 256, 512, generator=gen))
    packed = tilemm.prepack(w_q).to(DEV)
    x = torch.randn(8, 512, generator=gen).to(torch.bfloat16).to(DEV)
    static_ids = torch.randint(0, 16, (8, 4), generator=gen).to(DEV)
    graph, static_x, static_out = capture(lambda x: tilemm.moe_linear(x, packed, static_ids), x)
    for seed in range(3):
        g = torch.Generator().manual_seed(seed + 10)
        new_x = torch.randn(8, 512, generator=g).to(torch.bfloat16)
        new_ids = _routing(["uniform", "skewed", "invalid"][seed], 8, 4, 16, g)
        static_x.copy_(new_x)
        static_ids.copy_(new_ids)
        graph.replay()
        torch.cuda.synchronize()
        _check(static_out, reference64(new_x, w_q, new_ids), torch.bfloat16)


def test_compile_fullgraph():
    w_q = tilemm.quantize_mxfp4(torch.randn(8, 128, 256))
    packed = tilemm.prepack(w_q).to(DEV)
    x = torch.randn(3, 256, device=DEV, dtype=torch.bfloat16)
    ids = torch.randint(0, 8, (3, 4), device=DEV)

    def f(x, ids):
        return tilemm.moe_linear(x, packed, ids).float().sum(dim=1)

    eager = f(x, ids)
    assert torch.equal(torch.compile(f, fullgraph=True)(x, ids), eager)
    assert torch.equal(torch.compile(f, mode="reduce-overhead")(x, ids), eager)


@pytest.mark.parametrize("tokens", [1, 6])  # the per-pair design (T = 1) and the sorted one
def test_gpt_oss_experts_on_gpu_match_cpu(tokens):
    transformers = pytest.importorskip("transformers")
    from test_moe import tiny_gpt_oss_config

    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    torch.manual_seed(0)
    hf = GptOssExperts(tiny_gpt_oss_config(hidden_size=256, intermediate_size=512, num_local_experts=8))
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.05)
    ours = MoEExperts.from_gpt_oss(hf, "mxfp4")
    x = torch.randn(tokens, 256).to(torch.bfloat16)
    top, ids = torch.topk(torch.randn(tokens, 8), 2, dim=-1)
    weights = torch.softmax(top, dim=-1).to(torch.bfloat16)
    cpu = ours(x, ids, weights)
    gpu = ours.to(DEV)(x.to(DEV), ids.to(DEV), weights.to(DEV))
    # the same arithmetic (the fused SwiGLU's exp aside): a few bf16 ulps apart at most
    err = ((gpu.double().cpu() - cpu.double()).norm() / cpu.double().norm()).item()
    assert err < 1e-2, err
    compiled = torch.compile(ours, fullgraph=True)
    assert torch.equal(compiled(x.to(DEV), ids.to(DEV), weights.to(DEV)), gpu)
    ids_dev, weights_dev = ids.to(DEV), weights.to(DEV)  # (no host-to-device copy inside the capture)
    graph, static_x, static_out = capture(lambda x: ours(x, ids_dev, weights_dev), x.to(DEV))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static_out, gpu)
    del transformers


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4", "mxfp8"])
@pytest.mark.parametrize("tokens", [1, 4, 40])  # by default per pair (T = 1; 16 pairs of 32 experts), sorted (40)
def test_silu_experts_on_gpu_match_cpu(fmt, tokens):
    """SiLU-gated experts (a Qwen3-MoE block, top-4 of 32; Mixtral's fp32 router weights at T = 40)
    on the GPU against the CPU path on the same packed weights: the same roundings (gate_up, h, y, the
    weighted sum), so equal up to fp32 summation order, which may flip a bf16 rounding here and there
    (the bound of the gpt-oss test). Every design ("sorted", "pairs_combine", "pairs_bmm") is checked
    too; under torch.compile(fullgraph=True) and in a CUDA graph the module is bit-equal to eager."""
    pytest.importorskip("transformers")
    from test_moe_silu import experts_class, tiny_config

    from tilemm.moe import _experts_launches

    torch.manual_seed(0)
    hf = experts_class("qwen3_moe")(tiny_config("qwen3_moe", hidden_size=256, moe_intermediate_size=512,
                                                num_experts=32, num_experts_per_tok=4))
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.05)
    ours = MoEExperts.from_silu_experts(hf, fmt)
    x = torch.randn(tokens, 256).to(torch.bfloat16)
    top, ids = torch.topk(torch.randn(tokens, 32), 4, dim=-1)
    weights = torch.softmax(top, dim=-1)
    if tokens != 40:
        weights = weights.to(torch.bfloat16)
    cpu = ours(x, ids, weights).double()

    def rel_err(out):
        return ((out.double().cpu() - cpu).norm() / cpu.norm()).item()

    ours = ours.to(DEV)
    x_dev, ids_dev, weights_dev = x.to(DEV), ids.to(DEV), weights.to(DEV)
    gpu = ours(x_dev, ids_dev, weights_dev)
    assert torch.isfinite(gpu).all()
    assert rel_err(gpu) < 1e-2
    gu, dn = ours.packed("gate_up"), ours.packed("down")
    for design in ("sorted", "pairs_combine", "pairs_bmm"):
        out = _experts_launches(x_dev, ids_dev, weights_dev, gu.words, gu.scale_t, gu.constants, gu.fmt.name, None,
                                dn.words, dn.scale_t, dn.constants, dn.fmt.name, None, 0.0, 0.0, design=design,
                                activation="silu")
        assert rel_err(out) < 1e-2, design
    torch._dynamo.reset()  # each instance compiled is one more entry; fullgraph fails past the limit
    compiled = torch.compile(ours, fullgraph=True)
    assert torch.equal(compiled(x_dev, ids_dev, weights_dev), gpu)
    graph, static_x, static_out = capture(lambda x: ours(x, ids_dev, weights_dev), x_dev)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static_out, gpu)


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4", "mxfp8"])
@pytest.mark.parametrize("tokens", [1, 40])  # the per-pair kernel (T = 1) and the sorted one (tile_m 16)
def test_fused_silu_epilogue_on_gpu(fmt, tokens):
    """ACT = 2 on the GPU: the fused gating of interleaved gate / up rows against ``silu_glu`` of the
    same kernel's unfused gate_up (the same rounded products). The arithmetic is the same; only the
    hardware exp may round its fp32 result differently, which reaches the bf16 output rarely and by
    one ulp: at most one bf16 ulp apart, and nearly all bit-equal. K = 2048 (the anchor's hidden)."""
    from tilemm.moe import silu_glu

    e, n, k, top_k = 32, 512, 2048, 4
    gen = torch.Generator().manual_seed(60)
    w_q = QUANTIZERS[fmt](torch.randn(e, n, k, generator=gen) * 0.5)
    packed = tilemm.prepack(w_q).to(DEV)
    x = torch.randn(tokens, k, generator=gen).to(torch.bfloat16).to(DEV)
    ids = torch.stack([torch.randperm(e, generator=gen)[:top_k] for _ in range(tokens)]).to(DEV)
    args = (packed.words, packed.scale_t, packed.constants, None)
    plain = torch.empty((tokens * top_k, n), dtype=torch.bfloat16, device=DEV)
    fused = torch.empty((tokens * top_k, n // 2), dtype=torch.bfloat16, device=DEV)
    if tokens == 1:
        mk.launch_pairs(x, *args, ids.reshape(-1), plain, packed.layout)
        mk.launch_pairs(x, *args, ids.reshape(-1), fused, packed.layout, act=mk.ACT_SILU)
    else:
        routed = mk.route(ids, e)
        xs = mk.sort_rows(x, routed, top_k)
        mk.launch(xs, *args, routed, tokens, plain, packed.layout, sorted_out=1)
        mk.launch(xs, *args, routed, tokens, fused, packed.layout, act=mk.ACT_SILU)
    expected = silu_glu(plain, interleaved=True).float().cpu()
    fused = fused.float().cpu()
    assert torch.isfinite(expected).all() and (plain[:, 0::2].abs() > 20).any()
    ulp = torch.where(expected == 0, torch.full_like(expected, 2.0 ** -133),
                      2.0 ** (torch.floor(torch.log2(expected.abs())) - 7))
    assert ((fused - expected).abs() <= ulp).all()
    assert (fused == expected).float().mean() > 0.99
