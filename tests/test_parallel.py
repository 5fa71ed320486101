"""Tensor parallelism of tilemm.nn.Linear (tilemm.parallel): shards, 2- and 4-rank runs on gloo and NCCL.

The oracle is the unsharded layer on the same device. Column-wise shards must reproduce its output
columns bit for bit (CPU); row-wise shards its output up to the reduction order over K (a bound in
units of the output dtype's rounding, times the magnitude |a| @ |W|.T + |b| of the terms summed; on
a GPU the bound derived in ``_gpu_bound`` from what the kernels sum), for every format and mode:
where the activation's scale spans K (NVFP4, FP8 per row / per tensor, both sides), the ranks
all-reduce its amax first, so they quantize exactly as the unsharded layer does.
"""

from __future__ import annotations

import pytest
import torch

import tilemm
from _gpu import GPU_SKIP_REASON
from _parallel import WORLD_SIZE, make_mlp, run_cases, tp_plan
from swizzle import swizzle_32_4_4, unswizzle_32_4_4
from tilemm.nn import Linear
from tilemm.parallel import ShardedLinear, local_shard, shard_linear

# name: (d_model, hidden, from_float keywords). hidden = 192 puts the column-wise boundary at row 96,
# inside a 128-row swizzle tile, and the row-wise one at scale column 3 (MX) / 6 (NVFP4), inside a
# 4-column tile: the shards' swizzled scales are rebuilt, not sliced. 99 splits unevenly (50 + 49).
# Four ranks need whole scale blocks per rank: hidden 256 (64 rows / 2 MX, 4 NVFP4 scale columns per
# rank, still inside the tiles), 512 for FP8 (128, 128); 99 splits 25 + 25 + 25 + 24.
CONFIGS = {
    "mxfp8": (64, 192, dict(format="mxfp8")),
    "mxfp8-logical": (64, 192, dict(format="mxfp8", swizzle=False)),
    "mxfp8-weight-only": (64, 192, dict(format="mxfp8", weight_only=True)),
    "mxfp4": (64, 192, dict(format="mxfp4")),
    "mxfp4-weight-only-swizzled": (64, 192, dict(format="mxfp4", weight_only=True, swizzle=True)),
    "nvfp4": (64, 192, dict(format="nvfp4")),
    "nvfp4-weight-only": (64, 192, dict(format="nvfp4", weight_only=True)),
    "fp8-row": (64, 192, dict(format="fp8")),
    "fp8-row-weight-only-uneven": (64, 99, dict(format="fp8", weight_only=True)),
    "fp8-tensor": (64, 192, dict(format="fp8", granularity="tensor")),
    "fp8-128x128": (128, 256, dict(format="fp8", granularity=(128, 128))),
}
# bf16 activations for a few: the partial sums are rounded to bf16 before the all-reduce.
BF16 = ("mxfp8", "mxfp4-weight-only-swizzled", "nvfp4", "nvfp4-weight-only", "fp8-128x128")
CASES = [(name, torch.float32) for name in CONFIGS] + [(name, torch.bfloat16) for name in BF16]
CASE_IDS = [f"{name}-{str(dtype).removeprefix('torch.')}" for name, dtype in CASES]

WORLD_SIZES = (2, 4)
HIDDEN_4 = {"fp8-row-weight-only-uneven": 99, "fp8-128x128": 512}  # hidden for 4 ranks (else 256)

# Both-sides configs whose activation scale spans all of K (NVFP4's global scale, FP8 per row / per
# tensor): each row-wise rank quantizes its K-slice with the amax all-reduced over the ranks.
GLOBAL_AMAX = {"nvfp4", "fp8-row", "fp8-tensor"}

# CPU: |sharded - unsharded| <= ULPS * eps(out dtype) * (|a| @ |W|.T + |b|), elementwise. Measured
# worst cases on these shapes (2 ranks): fp32 0.96 eps (weight-only; both sides 0.23 eps), bf16 0.39
# eps. (Before the amax all-reduce, the global-amax cases exceeded it: NVFP4 bf16 4 eps, fp32 up to
# 2.6e5 eps.)
ULPS = 2
# Hopper's FP8 tensor cores do not accumulate fp32-exactly (README: about 1.3e-4 relative against
# fp64), so on a GPU FP8 products get that allowance on top.
FP8_TENSOR_CORE_REL = 2e-4


# The GPU cases: every format and mode once, each kernel specialisation as few times as possible (a
# cold cuTile compile costs 0.5-6 s per specialisation and rank): one shape for every format (d_model
# 128, hidden 512: whole 128-blocks for FP8 (128, 128) on 2 and 4 ranks; the tile-boundary cases
# are the CPU's), bf16 activations, and fp32 activations where the kernels sum differently (the
# weight-only split of fp32 into bf16 parts, whose bound ``_gpu_bound`` derives).
GPU_SHAPE = (128, 512)
GPU_CASES = [("mxfp8", torch.bfloat16), ("mxfp4", torch.bfloat16), ("nvfp4", torch.bfloat16),
             ("fp8-row", torch.bfloat16), ("fp8-tensor", torch.bfloat16), ("fp8-128x128", torch.bfloat16),
             ("mxfp8-weight-only", torch.bfloat16), ("nvfp4-weight-only", torch.bfloat16),
             ("nvfp4-weight-only", torch.float32), ("mxfp4-weight-only-swizzled", torch.float32),
             ("fp8-row-weight-only-uneven", torch.bfloat16)]
GPU_CASE_IDS = [f"{name}-{str(dtype).removeprefix('torch.')}" for name, dtype in GPU_CASES]


def _gpu_case(name, dtype, world_size, seed=1):
    d_model, hidden = GPU_SHAPE
    if name == "fp8-row-weight-only-uneven":
        hidden = 99  # F.linear, no kernel to compile
    g = torch.Generator().manual_seed(seed)
    return make_mlp(d_model, hidden, **CONFIGS[name][2]), torch.randn(2, 3, d_model, generator=g).to(dtype)


def _case(name, dtype, seed=1, world_size=WORLD_SIZE):
    d_model, hidden, kw = CONFIGS[name]
    if world_size == 4:
        hidden = HIDDEN_4.get(name, 256)
    g = torch.Generator().manual_seed(seed)
    return make_mlp(d_model, hidden, **kw), torch.randn(2, 3, d_model, generator=g).to(dtype)


def _magnitude(layer: Linear, a: torch.Tensor) -> torch.Tensor:
    """|a_q| @ |W|.T + |b| in fp64: the size of the terms the layer sums for each output."""
    rows = a.reshape(-1, layer.in_features)
    if not layer.weight_only:
        rows = layer._options.quantize_activation(rows).dequantize()
    out = rows.abs().double() @ layer.dequantize_weight().abs().double().T
    if layer.bias is not None:
        out = out + layer.bias.abs().double()
    return out.reshape(*a.shape[:-1], layer.out_features)


def _assert_within_reduction_bound(got, want, magnitude):
    eps = torch.finfo(want.dtype).eps
    bound = ULPS * eps * magnitude
    diff = (got.double() - want.double()).abs()
    worst = (diff / bound.clamp_min(torch.finfo(torch.float64).tiny)).max().item()
    assert worst <= 1, f"sharded output differs from the unsharded one by {worst:.3g}x the bound"


# --------------------------------------------------------------------------------------------------
# local_shard: the bytes each rank keeps (one process, no communication)
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("style", ["colwise", "rowwise"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_shards_hold_the_unsharded_bytes(name, style):
    mlp, _ = _case(name, torch.float32)
    for layer in (mlp.fc1 if style == "colwise" else mlp.fc2,):  # the MLP's pairing
        shards = [local_shard(layer, style, r, WORLD_SIZE) for r in range(WORLD_SIZE)]
        axis = 0 if style == "colwise" else 1
        # Every shard decodes exactly its slice of the unsharded weight: same bytes, and NVFP4's
        # decode scale is the whole weight's, not one recomputed per shard.
        decoded = torch.cat([s.dequantize_weight() for s in shards], dim=axis)
        assert torch.equal(decoded, layer.dequantize_weight())
        if layer.format == "nvfp4":
            assert all(torch.equal(s.weight_global_scale, layer.weight_global_scale) for s in shards)
        for r, s in enumerate(shards):
            assert s.tp_shard.offset == r * s.tp_shard.length or r == WORLD_SIZE - 1
            if s._options.swizzle:
                # The rebuilt swizzled scale is the shard's own layout with zero padding.
                rows, cols = s.out_features, s.in_features // s._options.k_multiple
                scale = s.quantized_weight().scale
                rebuilt = swizzle_32_4_4(unswizzle_32_4_4(scale, rows, cols))
                assert torch.equal(rebuilt.view(torch.uint8), scale.view(torch.uint8))
        biases = [s.bias for s in shards]
        if style == "colwise":
            assert torch.equal(torch.cat(biases), layer.bias)
        else:  # added once to the reduced sum
            assert torch.equal(biases[0], layer.bias) and not any(b.any() for b in biases[1:])


def test_local_shard_leaves_the_layer_alone():
    mlp, _ = _case("nvfp4", torch.float32)
    before = {k: v.clone() for k, v in mlp.fc1.state_dict().items()}
    local_shard(mlp.fc1, "rowwise", 1, 2)
    assert mlp.fc1.in_features == 64 and getattr(mlp.fc1, "tp_shard", None) is None
    assert all(torch.equal(v.view(torch.uint8) if v.element_size() == 1 else v,
                           before[k].view(torch.uint8) if v.element_size() == 1 else before[k])
               for k, v in mlp.fc1.state_dict().items())


# Boundaries inside a scale block are refused, naming the constraint.
@pytest.mark.parametrize("kw,in_features,out_features,style,world_size,match", [
    # 96 / 2 = 48 K-columns per rank: not a whole number of 32-blocks.
    (dict(format="mxfp8"), 96, 8, "rowwise", 2, r"pieces of 48 .* multiple of 32"),
    (dict(format="mxfp4", weight_only=True), 96, 8, "rowwise", 2, r"multiple of 32"),
    # 48 / 2 = 24: not a whole number of NVFP4's 16-blocks.
    (dict(format="nvfp4"), 48, 8, "rowwise", 2, r"pieces of 24 .* multiple of 16"),
    # FP8 (128, 128): 256 rows over 4 ranks = 64, inside a 128-row block; K likewise.
    (dict(format="fp8", granularity=(128, 128)), 128, 256, "colwise", 4,
     r"out_features=256 .* multiple of 128"),
    (dict(format="fp8", granularity=(128, 128)), 256, 8, "rowwise", 4,
     r"in_features=256 .* multiple of 128"),
    # 5 rows over 4 ranks, 2 per rank as torch.chunk splits: the last rank gets none.
    (dict(format="fp8"), 32, 5, "colwise", 4, r"leaves rank 3 without features"),
])
def test_boundary_inside_a_scale_block_raises(kw, in_features, out_features, style, world_size, match):
    layer = Linear.from_float(torch.nn.Linear(in_features, out_features), **kw)
    with pytest.raises(ValueError, match=match):
        local_shard(layer, style, world_size - 1, world_size)


def test_argument_errors():
    layer = Linear.from_float(torch.nn.Linear(64, 8), "mxfp8")
    with pytest.raises(ValueError, match=r"style must be 'colwise' or 'rowwise', got 'column'"):
        local_shard(layer, "column", 0, 2)
    with pytest.raises(TypeError, match=r"layer must be a tilemm.nn.Linear, got Linear"):
        local_shard(torch.nn.Linear(64, 8), "colwise", 0, 2)
    with pytest.raises(ValueError, match=r"rank must be in \[0, 2\), got 2"):
        local_shard(layer, "colwise", 2, 2)
    with pytest.raises(ValueError, match=r"world_size must be >= 1, got 0"):
        local_shard(layer, "colwise", 0, 0)
    with pytest.raises(ValueError, match=r"already sharded"):
        local_shard(local_shard(layer, "colwise", 0, 2), "rowwise", 0, 2)
    with pytest.raises(TypeError, match=r"device_mesh must be a torch.distributed.device_mesh.DeviceMesh, "
                                        r"got str"):
        shard_linear(layer, "cpu", "colwise")
    with pytest.raises(TypeError, match=r"use_local_output must be True or False, got 1"):
        shard_linear(layer, None, "colwise", use_local_output=1)


def test_overlap_options_are_checked():
    with pytest.raises(ValueError, match=r"RowwiseParallel: chunks must be an int >= 1, got 0"):
        tilemm.parallel.RowwiseParallel(chunks=0)
    with pytest.raises(ValueError, match=r"one_shot_max_bytes must be an int >= 0, got -1"):
        tilemm.parallel.RowwiseParallel(one_shot_max_bytes=-1)
    with pytest.raises(ValueError, match=r"copy_min_bytes must be an int >= 0, got 1.5"):
        tilemm.parallel.RowwiseParallel(copy_min_bytes=1.5)
    with pytest.raises(TypeError, match=r"taper must be True or False, got 1"):
        tilemm.parallel.RowwiseParallel(taper=1)
    with pytest.raises(TypeError, match=r"direct_nccl must be True or False, got 'yes'"):
        tilemm.parallel.RowwiseParallel(direct_nccl="yes")
    with pytest.raises(TypeError, match=r"one_shot_eager must be True or False, got 1"):
        tilemm.parallel.RowwiseParallel(one_shot_eager=1)


def test_two_shot_is_opt_in():
    assert tilemm.parallel.RowwiseParallel().two_shot_min_bytes == 0
    with pytest.raises(ValueError, match=r"two_shot_min_bytes must be an int >= 0, got -1"):
        tilemm.parallel.RowwiseParallel(two_shot_min_bytes=-1)
    two_shot = tilemm.parallel._TwoShot(None, 16)
    assert two_shot(torch.ones(64)) is None  # CPU tensors: the caller's collective


def test_one_shot_defaults_to_graphs_only():
    # The default row-wise style takes the one-shot all-reduce for small sums inside CUDA graphs only.
    style = tilemm.parallel.RowwiseParallel()
    assert style.one_shot_max_bytes == tilemm.parallel.ONE_SHOT_MAX_BYTES == 256 * 1024
    assert style.one_shot_eager is False
    graphs_only = tilemm.parallel._OneShot(None, 1024, eager=False)
    everywhere = tilemm.parallel._OneShot(None, 1024, eager=True)
    assert everywhere.live()
    if torch.cuda.is_available():  # the capture query needs a CUDA build
        assert not graphs_only.live()  # outside capture
    cpu = torch.ones(4)
    assert graphs_only(cpu) is None and everywhere(cpu) is None  # CPU tensors: the caller's collective


@pytest.mark.parametrize("rows, pieces, sizes", [
    (4096, 6, [2048, 1024, 512, 256, 128, 128]),
    (1024, 5, [512, 256, 128, 64, 64]),
    (1000, 4, [496, 240, 128, 136]),  # multiples of 16 but the last
    (6, 3, [3, 1, 2]),  # too few rows for 16-row pieces
    (1, 4, [1]),  # fewer pieces where rows run out
])
def test_tapered_pieces(rows, pieces, sizes):
    from tilemm.parallel import _tapered

    assert _tapered(rows, pieces) == sizes and sum(sizes) == rows
    with pytest.raises(ValueError, match=r"overlapped: chunks must be an int >= 1, got True"):
        tilemm.parallel.overlapped(lambda t: t, torch.zeros(4, 2), True)


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_copy_all_reduce_steps_sum_every_rank(world, dtype):
    # The copy all-reduce's data movement, its ranks driven in lockstep in one process (the barriers'
    # order) on CPU tensors standing for the symmetric buffers: every rank ends with the same sum,
    # each element its ranks' values summed once in fp32 (exact here: small integers), into a
    # separate output and in place; slots longer than the chunk are never read.
    from tilemm.parallel import _CopyState

    slot, n = 40, world * 12
    buffers = [torch.full((world + 1, slot), float("nan"), dtype=dtype) for _ in range(world)]  # poison
    states = []
    for rank in range(world):
        state = object.__new__(_CopyState)
        state.world, state.rank, state.slot, state.views = world, rank, slot, buffers
        states.append(state)
    src = [((torch.arange(n) * (r + 3)) % 11).to(dtype) for r in range(world)]
    want = sum(t.double() for t in src).to(dtype)
    for in_place, per_peer in ((False, False), (True, False), (False, True)):
        srcs = [t.clone() for t in src]
        dsts = srcs if in_place else [torch.full((n,), -1.0, dtype=dtype) for _ in range(world)]
        chunk = n // world
        for state, t in zip(states, srcs):
            # per_peer: the copies one peer at a time, as _on_peer_streams issues them (peers, then self).
            for only in ([*state._peers(), state.rank] if per_peer else [None]):
                state.scatter(t, chunk, only=only)
        for state in states:
            state.reduce(chunk)
        for state, d in zip(states, dsts):
            for only in ([*state._peers(), state.rank] if per_peer else [None]):
                state.gather(d, chunk, only=only)
        for d in dsts:
            assert torch.equal(d, want)


def test_exported_from_tilemm():
    assert tilemm.shard_linear is shard_linear and tilemm.parallel.local_shard is local_shard


# --------------------------------------------------------------------------------------------------
# Two ranks: parallelize_module(mlp, mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
# --------------------------------------------------------------------------------------------------

def _run(backend, tmp_path_factory, world_size):
    if backend == "nccl":
        cases = {case_id: _gpu_case(name, dtype, world_size) for case_id, (name, dtype) in zip(GPU_CASE_IDS, GPU_CASES)}
    else:
        cases = {case_id: _case(name, dtype, world_size=world_size) for case_id, (name, dtype) in zip(CASE_IDS, CASES)}
    ranks = run_cases(cases, backend, str(tmp_path_factory.mktemp(f"tp-{backend}-{world_size}")), world_size)
    return cases, ranks


@pytest.fixture(scope="module", params=WORLD_SIZES, ids=[f"{w}ranks" for w in WORLD_SIZES])
def gloo_runs(request, tmp_path_factory):
    """Every rank's results for every case: one spawn of 2 (then 4) gloo processes runs them all."""
    return _run("gloo", tmp_path_factory, request.param)


def _check_colwise(cases, ranks, case_id, exact, on_gpu=False):
    mlp, x = cases[case_id]
    for result in (r[case_id] for r in ranks):
        offset, length = result["shards"]["fc1"]
        want = result["hidden_full"][..., offset: offset + length]
        if exact:
            assert torch.equal(result["hidden"], want)
            assert torch.equal(result["hidden_gathered"], result["hidden_full"])
        else:
            magnitude = _magnitude(mlp.fc1, x)[..., offset: offset + length]
            if on_gpu:  # both sum all of K, with kernels chosen for different N
                k = mlp.fc1.in_features
                _assert_within(result["hidden"], want, _gpu_bound(mlp.fc1, x.dtype, magnitude, k, k, 1))
            else:
                _assert_within_reduction_bound(result["hidden"], want, magnitude)


def _check_mlp(cases, ranks, case_id, on_gpu):
    mlp, x = cases[case_id]
    first = ranks[0][case_id]
    # The all-reduce leaves every rank with the same bits.
    assert all(torch.equal(r[case_id]["out"], first["out"]) for r in ranks)
    hidden = torch.relu(first["hidden_full"])
    magnitude = _magnitude(mlp.fc2, hidden)
    if on_gpu:
        k, world = mlp.fc2.in_features, len(ranks)
        bound = _gpu_bound(mlp.fc2, hidden.dtype, magnitude, k, -(-k // world), world)
        _assert_within(first["out"], first["out_full"], bound)
    else:
        _assert_within_reduction_bound(first["out"], first["out_full"], magnitude)


def _check_overlap(cases, ranks, case_id, on_gpu):
    """RowwiseParallel(chunks=2) and overlapped(mlp, x, 2) against the unsharded MLP, like the MLP."""
    mlp, x = cases[case_id]
    first = ranks[0][case_id]
    tensor_scale = case_id.rsplit("-", 1)[0] in ("nvfp4", "fp8-tensor")  # one activation scale per tensor
    for key in ("out_chunked", "out_overlapped", "out_fast"):
        got = first[key]
        if key == "out_overlapped" and tensor_scale:
            assert isinstance(got, str) and "one scale for the whole tensor" in got
            continue
        assert all(torch.equal(r[case_id][key], got) for r in ranks)
        hidden = torch.relu(first["hidden_full"])
        magnitude = _magnitude(mlp.fc2, hidden)
        if on_gpu:
            k, world = mlp.fc2.in_features, len(ranks)
            _assert_within(got, first["out_full"], _gpu_bound(mlp.fc2, hidden.dtype, magnitude, k,
                                                              -(-k // world), world))
        else:
            _assert_within_reduction_bound(got, first["out_full"], magnitude)


def _check_state_dict_round_trip(ranks, case_id):
    for r in ranks:
        assert r[case_id]["same_state"]
        assert torch.equal(r[case_id]["out_fresh"], r[case_id]["out"])


def _platform_blas(case_id):
    """FP8 weight-only layers multiply through ``F.linear``, whose CPU BLAS picks its kernel by shape and
    stride (MKL on an AVX-512 AMD EPYC gives other bits for the 99-column shard than for the whole
    matrix), so their shards agree with the unsharded layer up to the reduction order, not bit for bit."""
    return case_id.startswith("fp8") and "weight-only" in case_id


@pytest.mark.parametrize("case_id", CASE_IDS)
def test_colwise_output_is_the_unsharded_slice(gloo_runs, case_id):
    _check_colwise(*gloo_runs, case_id, exact=not _platform_blas(case_id))


@pytest.mark.parametrize("case_id", CASE_IDS)
def test_mlp_matches_unsharded_up_to_reduction_order(gloo_runs, case_id):
    # Every format, including NVFP4 and FP8 per row / per tensor with both sides quantized: their
    # row-wise ranks quantize with the all-reduced amax, the bytes of the unsharded quantization.
    assert gloo_runs[1][0][case_id]["sharded_class"] == "ShardedLinear"
    _check_mlp(*gloo_runs, case_id, on_gpu=False)


@pytest.mark.parametrize("case_id", CASE_IDS)
def test_overlapped_all_reduce_matches_unsharded(gloo_runs, case_id):
    # Each row is summed as without the pieces; NVFP4 / FP8 per tensor both sides refuse overlapped().
    _check_overlap(*gloo_runs, case_id, on_gpu=False)


@pytest.mark.parametrize("case_id", CASE_IDS)
def test_state_dict_round_trips(gloo_runs, case_id):
    _check_state_dict_round_trip(gloo_runs[1], case_id)


@pytest.mark.parametrize("case_id", CASE_IDS)
def test_shard_linear_rowwise_redistributes_a_replicated_input(gloo_runs, case_id):
    # shard_linear(fc2, mesh, "rowwise") given the whole activation as a replicated DTensor slices it
    # to each rank's features itself: the same local inputs as in the MLP, so the same bits.
    for r in gloo_runs[1]:
        if _platform_blas(case_id):
            torch.testing.assert_close(r[case_id]["out_rowwise"], r[case_id]["out"], rtol=2e-6, atol=2e-6)
        else:
            assert torch.equal(r[case_id]["out_rowwise"], r[case_id]["out"])


# --------------------------------------------------------------------------------------------------
# Quantizing a K-slice with the whole tensor's amax (one process)
# --------------------------------------------------------------------------------------------------

def _uint8(t):
    return t.view(torch.uint8) if t.element_size() == 1 else t


@pytest.mark.parametrize("swizzle", [False, True])
def test_nvfp4_slice_with_the_whole_amax_is_the_whole_quantization(swizzle):
    from tilemm.quantize import amax_bits, quantize_nvfp4, quantize_nvfp4_with_amax

    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, 256, generator=g) * torch.logspace(-3, 3, 256)  # the amax in the second half
    x[2, 5] = float("nan")  # ignored by NVFP4's tensor amax
    whole = quantize_nvfp4(x)
    amax = torch.maximum(amax_bits(x[:, :128], "tensor", propagate_nan=False),
                         amax_bits(x[:, 128:], "tensor", propagate_nan=False))
    for lo, hi in ((0, 128), (128, 256)):
        part = quantize_nvfp4_with_amax(x[:, lo:hi].contiguous(), amax, swizzle=swizzle)
        assert torch.equal(part.global_scale, whole.global_scale)
        assert torch.equal(part.data, whole.data[:, lo // 2: hi // 2])
        scale = unswizzle_32_4_4(part.scale, 6, 8) if swizzle else part.scale
        assert torch.equal(_uint8(scale), _uint8(whole.scale[:, lo // 16: hi // 16]))


def test_amax_bits_nvfp4_is_over_the_finite_values():
    # NVFP4's tensor amax leaves NaN and +-Inf out; FP8's propagates NaN and counts Inf.
    from tilemm.quantize import amax_bits

    x = torch.tensor([[1.5, -3.0, float("nan")], [float("inf"), 2.0, -float("inf")]])
    finite = amax_bits(x, "tensor", propagate_nan=False).view(torch.float32)
    assert finite.tolist() == [3.0]
    rows = amax_bits(x, "row", propagate_nan=False).view(torch.float32)
    assert rows.tolist() == [[3.0], [2.0]]
    assert amax_bits(x[1:], "tensor", propagate_nan=True).view(torch.float32).item() == float("inf")
    assert amax_bits(x, "tensor", propagate_nan=True).view(torch.float32).isnan().all()
    assert amax_bits(torch.full((2, 2), float("inf")), "tensor", propagate_nan=False).item() == 0


@pytest.mark.parametrize("granularity", ["tensor", "row"])
def test_fp8_slice_with_the_whole_amax_is_the_whole_quantization(granularity):
    from tilemm.quantize import amax_bits, quantize_fp8, quantize_fp8_with_amax

    g = torch.Generator().manual_seed(4)
    x = torch.randn(5, 256, generator=g) * torch.logspace(-2, 2, 256)
    x[1, 200] = float("inf")  # row 1's (and the tensor's) scale becomes NaN, as in the whole tensor
    whole = quantize_fp8(x, granularity=granularity)
    amax = torch.maximum(amax_bits(x[:, :128], granularity, propagate_nan=True),
                         amax_bits(x[:, 128:], granularity, propagate_nan=True))
    for lo, hi in ((0, 128), (128, 256)):
        part = quantize_fp8_with_amax(x[:, lo:hi], amax, granularity=granularity)
        assert torch.equal(_uint8(part.data), _uint8(whole.data[:, lo:hi]))
        assert torch.equal(part.scale.isnan(), whole.scale.isnan())
        assert torch.equal(part.scale.nan_to_num(), whole.scale.nan_to_num())
    with pytest.raises(ValueError, match=r"amax must be|needs granularity"):
        quantize_fp8_with_amax(x, amax.float(), granularity=granularity)


def test_sharded_forward_uses_no_dtensor(monkeypatch, tmp_path):
    # One gloo rank: the styles' default layouts with plain tensors never build a DTensor (the
    # per-call cost this path removes); a DTensor output asked for still gets one.
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import parallelize_module

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        mlp, x = _case("nvfp4", torch.float32)
        want = mlp(x)
        model = parallelize_module(mlp, mesh, tp_plan())
        assert type(model.fc1) is ShardedLinear and isinstance(model.fc1, Linear)

        def refuse(*args, **kwargs):
            raise AssertionError("DTensor built on the plain path")

        with monkeypatch.context() as m:
            m.setattr(DTensor, "from_local", refuse)
            got = model(x)
        assert torch.equal(got, want)
        gathered = shard_linear(_case("mxfp8", torch.float32)[0].fc1, mesh, "colwise", use_local_output=False)
        assert isinstance(gathered(x), DTensor)
    finally:
        dist.destroy_process_group()


# --------------------------------------------------------------------------------------------------
# The same on 2 and 4 GPUs with NCCL
# --------------------------------------------------------------------------------------------------

# The GPU bound, derived from what the kernels sum. For one output element, both the sharded and the
# unsharded computation approximate the same exact value S = sum_k a_k w_k + b (a the activation as
# the layer reads it, w the dequantized weight); every intermediate they form is a partial sum of a
# subset of these terms, or one times an exact power of two or NVFP4's decode scale (which
# ``_magnitude`` includes), so its magnitude is at most mag = sum_k |a_k w_k| + |b|. A rounding of
# such a value to fp32 errs by at most one ulp <= eps32 * mag (a whole ulp: the tensor cores truncate
# instead of rounding to nearest), to the output dtype by at most eps_out * mag. What a kernel rounds,
# over a K-slice of length k (tilemm/kernels/weight_only_kernels.py, the block-scaled kernels):
#   1. no product: the decoded weight is exact in bf16 and bf16 x bf16 products are exact in fp32.
#      An fp32 activation is split exactly into 3 bf16 parts (fp16 into 2), each its own MMA into the
#      same accumulator: 3k (2k) addends, not k. Both-sides layers read a quantized (bf16-exact)
#      activation: k addends.
#   2. the accumulation: the tensor cores align an MMA's addends to the largest and truncate, so each
#      of the parts * k addends can lose up to one ulp of a value <= mag, and each k=16 MMA step
#      rounds its sum once more: (parts * k + parts * ceil(k / 16)) * eps32 * mag. (The one-row FMA
#      kernel rounds once per FMA, parts * k times: covered.)
#   3. split-K: at most SPLIT_K_MAX - 1 = 15 fp32 additions of partial tiles, in a fixed order.
#   4. the epilogue: alpha (2^E and NVFP4's decode scale) and the bias: 2 fp32 roundings.
#   5. the output: the sharded result is world_size partial sums rounded to the output dtype, then
#      world_size - 1 additions in that dtype (the all-reduce); the unsharded one is rounded once:
#      2 * world_size roundings of at most eps_out * mag.
# The CPU bound above (2 eps_out) is what one correctly rounded fp32 sum of k terms by the CPU's BLAS
# gave in practice; on the GPU an fp32 activation's 3k truncated addends exceeded it (measured on two
# H200s: MXFP4 weight-only 2.8 eps32, NVFP4 2.5 eps32). The bound below holds whatever the order;
# a wrong shard, scale or bias errs by O(mag), 10^4 times more than it allows. FP8 tensor cores do not
# accumulate fp32-exactly (README: about 1.3e-4 relative), so FP8 layers get that on top.
SPLIT_K_MAX = 16
MMA_K = 16
X_PARTS = {torch.float32: 3, torch.float16: 2, torch.bfloat16: 1}


def _kernel_roundings(k: int, parts: int) -> int:
    return parts * k + parts * -(-k // MMA_K) + (SPLIT_K_MAX - 1) + 2


def _gpu_bound(layer: Linear, x_dtype, magnitude, k_a: int, k_b: int, world_size: int):
    """The bound above for two computations over K-slices of k_a and k_b, the second one sharded over
    ``world_size`` ranks (1: not sharded, its output rounded once)."""
    parts = X_PARTS[x_dtype] if layer.weight_only else 1
    eps32, eps_out = torch.finfo(torch.float32).eps, torch.finfo(x_dtype).eps
    roundings = _kernel_roundings(k_a, parts) + _kernel_roundings(k_b, parts)
    bound = roundings * eps32 * magnitude + 2 * world_size * eps_out * magnitude
    if layer.format == "fp8":
        bound = bound + FP8_TENSOR_CORE_REL * magnitude
    return bound


def _assert_within(got, want, bound):
    diff = (got.double() - want.double()).abs()
    worst = (diff / bound.clamp_min(torch.finfo(torch.float64).tiny)).max().item()
    assert worst <= 1, f"sharded output differs from the unsharded one by {worst:.3g}x the bound"


def _gpus_skip_reason(world_size):
    if GPU_SKIP_REASON is not None:
        return GPU_SKIP_REASON
    if torch.cuda.device_count() < world_size:
        return f"needs {world_size} CUDA GPUs for NCCL tensor parallelism, found {torch.cuda.device_count()}"
    if not torch.distributed.is_nccl_available():
        return "needs torch.distributed with NCCL"
    return None


@pytest.mark.gpu
@pytest.mark.parametrize("world_size", [pytest.param(w, marks=pytest.mark.skipif(
    _gpus_skip_reason(w) is not None, reason=_gpus_skip_reason(w) or "")) for w in WORLD_SIZES])
def test_gpus_nccl(tmp_path_factory, world_size):
    # One spawn, every GPU case (GPU_CASES); the kernels pick tile shapes and split-K by problem size, so on the GPU
    # the column-wise shards are held to the derived bound, not bit equality. Each rank also replays
    # the sharded MLP from a CUDA graph (both collectives captured) and must get the eager bits.
    cases, ranks = _run("nccl", tmp_path_factory, world_size)
    failures = []
    for case_id in GPU_CASE_IDS:
        checks = [lambda: _check_colwise(cases, ranks, case_id, exact=False, on_gpu=True),
                  lambda: _check_state_dict_round_trip(ranks, case_id),
                  lambda: _check_overlap(cases, ranks, case_id, on_gpu=True),
                  lambda: _check_mlp(cases, ranks, case_id, on_gpu=True)]
        for check in checks:
            try:
                check()
            except AssertionError as err:
                failures.append(f"{case_id}: {err}")
        for rank, r in enumerate(ranks):
            # The symmetric-memory paths must have run (else the checks above tested NCCL): the copy
            # all-reduce for the pieces, the one-shot one (and its amax exchange, for one amax per
            # tensor) for a layer that is not split.
            setup = r[case_id]["fast_setup"]
            tensor_scale = case_id.rsplit("-", 1)[0] in ("nvfp4", "fp8-tensor")
            wanted = (("one_shot", "one_shot_used", "one_shot_error"), ("amax exchange", "amax_exchange", "amax_error")
                      ) if tensor_scale else (("copy", "copy_used", "copy_error"),)
            for what, used, error in wanted:
                if not setup[used]:
                    failures.append(f"{case_id}: rank {rank}: the {what} path did not run "
                                    f"({setup[error] or 'not set up'}): NCCL did the sums")
            # The direct NCCL all-reduce (the eager default on NCCL) ran, and gave the ProcessGroup's bits.
            if not r[case_id]["direct_setup"]["used"]:
                failures.append(f"{case_id}: rank {rank}: the direct NCCL all-reduce did not run "
                                f"({r[case_id]['direct_setup']['error'] or 'not set up'})")
            if not torch.equal(r[case_id]["out"], r[case_id]["out_pg"]):
                failures.append(f"{case_id}: rank {rank}: the direct NCCL all-reduce differs from the ProcessGroup's")
            # The two-shot all-reduce ran (on a CPU tensor it never applies) and summed as NCCL does: with
            # two ranks each sum is one addition, so the same bits; with more, rank order may differ from
            # NCCL's by the roundings of the world_size - 1 additions.
            if not r[case_id]["two_shot_setup"]["used"]:
                failures.append(f"{case_id}: rank {rank}: the two-shot all-reduce did not run "
                                f"({r[case_id]['two_shot_setup']['error'] or 'not set up'})")
            got, want = r[case_id]["out_two_shot"].float(), r[case_id]["out_pg"].float()
            if world_size == 2 and not torch.equal(got, want):
                failures.append(f"{case_id}: rank {rank}: the two-shot all-reduce differs from NCCL's")
            elif world_size > 2:
                eps = torch.finfo(r[case_id]["out_pg"].dtype).eps
                if (got - want).abs().max() > 2 * (world_size - 1) * eps * want.abs().max():
                    failures.append(f"{case_id}: rank {rank}: the two-shot all-reduce differs from NCCL's by more "
                                    "than the order of its additions")
            if r[case_id]["graph_fast_equal"] is not True:
                failures.append(f"{case_id}: rank {rank}: the copy / one-shot MLP in a CUDA graph: "
                                f"{r[case_id]['graph_fast_equal']}")
            if r[case_id]["graph_overlapped_equal"] not in (True, None):
                failures.append(f"{case_id}: rank {rank}: overlapped() in a CUDA graph: "
                                f"{r[case_id]['graph_overlapped_equal']}")
            # The default plan's graph took the one-shot all-reduce (set up by the eager warm-up call).
            graph_one_shot = r[case_id]["graph_one_shot"]
            if graph_one_shot is not None and not graph_one_shot["used"]:
                failures.append(f"{case_id}: rank {rank}: the default plan's CUDA graph did not take the one-shot "
                                f"all-reduce ({graph_one_shot['error'] or 'not set up'})")
            # With two ranks each sum is one addition in either order, and the exchanged amax is the
            # same maximum: the graph (one-shot sums and amax exchange) gives the NCCL eager call's bits.
            if world_size == 2 and r[case_id]["graph_nccl_equal"] is False:
                failures.append(f"{case_id}: rank {rank}: the CUDA-graph replay (one-shot) differs from the "
                                "default eager call (NCCL)")
            if r[case_id]["graph_equal"] is not True:
                failures.append(f"{case_id}: rank {rank}: the CUDA-graph replay differs from the eager call"
                                if r[case_id]["graph_equal"] is False else f"{case_id}: rank {rank}: "
                                f"{r[case_id]['graph_equal']}")
    assert not failures, "\n".join(failures)


# --------------------------------------------------------------------------------------------------
# The direct NCCL all-reduce's set-up, on the CPU: a fake NCCL library and fake collectives
# --------------------------------------------------------------------------------------------------

class _FakeNccl:
    """ncclGetUniqueId / ncclCommInitRank / ncclAllReduce / ncclGetErrorString as ctypes would call
    them: ``uid_result`` / ``init_result`` are the codes returned, ``sums_to`` what the all-reduce
    writes into a float32 tensor (the peers' sum), ``calls`` what ncclAllReduce received."""

    def __init__(self, uid_result=0, init_result=0, sums_to=3.0):
        self.uid_result, self.init_result, self.sums_to, self.calls = uid_result, init_result, sums_to, []

    def ncclGetUniqueId(self, uid):
        return self.uid_result

    def ncclCommInitRank(self, comm, world, uid, rank):
        return self.init_result

    def ncclAllReduce(self, send, recv, count, dtype, op, comm, stream):
        self.calls.append((count, dtype, op))
        if dtype == 7:  # float32: the set-up's probe
            import ctypes
            ctypes.memmove(recv, torch.full((count,), self.sums_to).numpy().tobytes(), 4 * count)
        return 0

    def ncclGetErrorString(self, code):
        return b"fake failure"


@pytest.fixture
def fake_collectives(monkeypatch):
    """A group of 2 ranks seen from rank 0: ``log`` records the collectives; ``others_ok`` is what the
    other rank brings to each agreement."""
    import contextlib

    from tilemm import parallel as par

    state = {"log": [], "others_ok": True, "backend": "nccl"}

    def all_reduce(t, op=None, group=None):
        state["log"].append("agree")
        if not state["others_ok"]:
            t.fill_(0)

    monkeypatch.setattr(par.dist, "get_backend", lambda group: state["backend"])
    monkeypatch.setattr(par.dist, "get_rank", lambda group: 0)
    monkeypatch.setattr(par.dist, "get_world_size", lambda group: 2)
    monkeypatch.setattr(par.dist, "get_global_rank", lambda group, r: r)
    monkeypatch.setattr(par.dist, "broadcast", lambda t, src, group: state["log"].append("broadcast"))
    monkeypatch.setattr(par.dist, "all_reduce", all_reduce)
    monkeypatch.setattr(par.torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(par, "stream_handle", lambda device: 0)
    monkeypatch.setattr(par._DirectNccl, "_FOR", {})
    return state


def _direct_with(monkeypatch, lib):
    from tilemm import parallel as par

    monkeypatch.setattr(par._DirectNccl, "_library", classmethod(lambda cls: lib))
    d = par._DirectNccl()
    d._setup(object(), torch.device("cpu"))
    return d


def test_direct_nccl_sets_up_checks_and_calls(monkeypatch, fake_collectives):
    lib = _FakeNccl()  # the probe of ranks 1 and 2 sums to 3
    d = _direct_with(monkeypatch, lib)
    assert d.error is None and d.comm is not None
    assert fake_collectives["log"] == ["agree", "broadcast", "agree", "agree"]
    t = torch.zeros(5, dtype=torch.bfloat16)
    assert d.all_reduce(t, d.SUM) is t and lib.calls[-1] == (5, 9, 0)  # ncclBfloat16, ncclSum
    d.all_reduce(torch.zeros(3, dtype=torch.int32), d.MAX)
    assert lib.calls[-1] == (3, 2, 2)  # ncclInt32, ncclMax


@pytest.mark.parametrize("case", ["not nccl", "library missing", "no unique id", "init fails", "wrong sum",
                                  "another rank fails"])
def test_direct_nccl_falls_back_without_hanging(monkeypatch, fake_collectives, case):
    """Every failure leaves no communicator and says why; every rank takes part in the same
    collectives up to the point all of them agree on (none for a group that is not NCCL's)."""
    lib = _FakeNccl(uid_result=5 if case == "no unique id" else 0, init_result=5 if case == "init fails" else 0,
                    sums_to=4.0 if case == "wrong sum" else 3.0)
    if case == "not nccl":
        fake_collectives["backend"] = "gloo"
    if case == "another rank fails":
        fake_collectives["others_ok"] = False
    if case == "library missing":
        from tilemm import parallel as par

        def missing(cls):
            raise OSError("libnccl.so.2: cannot open shared object file")

        monkeypatch.setattr(par._DirectNccl, "_library", classmethod(missing))
        d = par._DirectNccl()
        d._setup(object(), torch.device("cpu"))
    else:
        d = _direct_with(monkeypatch, lib)
    assert d.comm is None and d.error
    log = fake_collectives["log"]
    expected = {"not nccl": ([], "not 'nccl'"), "library missing": (["agree"], "cannot open"),
                "no unique id": (["agree", "broadcast", "agree"], "fake failure"),
                "init fails": (["agree", "broadcast", "agree", "agree"], "fake failure"),
                "wrong sum": (["agree", "broadcast", "agree", "agree"], "gave [4.0"),
                "another rank fails": (["agree"], "another rank")}[case]
    assert log == expected[0] and expected[1] in d.error, (log, d.error)
