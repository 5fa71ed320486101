"""Mixture of experts: stacked ``prepack``, ``tilemm.moe_linear`` (CPU reference and the grouped
kernel's tile code on the CPU emulator), gpt-oss's experts module against transformers' own, and
loading a gpt-oss checkpoint directory.

The kernel runs through tests/_emulator.py (exact bf16 operands at every MMA, index arithmetic of the
gathers and scatters); its result is compared with the reference, which is compared with a float64
product of the dequantized weights.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

import tilemm
from tilemm import checkpoints
from tilemm.formats import MXFP4, MXFP8_E4M3, NVFP4
from tilemm.kernels import moe_kernels as mk
from tilemm.moe import MoEExperts, reference_moe
from tilemm.packed import expert, prepack, unpack

from _emulator import LaunchProxy, TileEmulator, assert_matches

QUANTIZERS = {"mxfp4": tilemm.quantize_mxfp4, "nvfp4": tilemm.quantize_nvfp4, "mxfp8": tilemm.quantize_mxfp8}
FORMAT_NAMES = list(QUANTIZERS)


def stacked(fmt: str, e: int, n: int, k: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    w_q = QUANTIZERS[fmt](torch.randn(e, n, k, generator=gen))
    return w_q, prepack(w_q)


def reference64(x, w_q, ids, bias=None):
    """float64 x[t] @ dequantize(W[e]).T (+ bias[e]) per (token, slot); NaN for ids outside [0, E)."""
    w = w_q.dequantize().to(torch.float64)  # (E, N, K)
    e = w.shape[0]
    ok = (ids >= 0) & (ids < e)
    safe = torch.where(ok, ids, torch.zeros_like(ids))
    every = torch.einsum("tk,enk->ten", x.to(torch.float64), w)  # (T, E, N): every expert, every token
    out = torch.gather(every, 1, safe[..., None].expand(-1, -1, w.shape[1]))
    if bias is not None:
        out = out + bias.to(torch.float64)[safe]
    return torch.where(ok[..., None], out, torch.full_like(out, float("nan")))


# --------------------------------------------------------------------------------------------------
# Stacked prepack
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", FORMAT_NAMES)
def test_stacked_prepack_round_trips(fmt):
    # K = 96: not a multiple of tile_k (zero-padded words); N = 20: not a multiple of any tile.
    w_q, packed = stacked(fmt, 3, 20, 96)
    assert packed.num_experts == 3 and packed.shape == (3, 20, 96)
    assert packed.words.shape[:2] == (3, 20) and packed.scale_t.shape == (3, 96 // w_q.format.block, 20)
    assert packed.constants.shape == (3, 2)
    back = unpack(packed)
    assert torch.equal(back.data.view(torch.uint8), w_q.data.view(torch.uint8))
    assert torch.equal(back.scale.view(torch.uint8), w_q.scale.view(torch.uint8))
    # expert(packed, e) is expert e's 2-D weight, with the shared exponent
    one = unpack(expert(packed, 1))
    assert torch.equal(one.data.view(torch.uint8), w_q.data[1].view(torch.uint8))


def test_stacked_nvfp4_keeps_per_expert_global_scales():
    gen = torch.Generator().manual_seed(3)
    experts = [tilemm.quantize_nvfp4(torch.randn(16, 64, generator=gen) * (e + 1)) for e in range(3)]
    packed = prepack(experts)
    assert packed.global_scale.shape == (3,)
    back = unpack(packed)
    assert isinstance(back, list) and len(back) == 3  # distinct per-tensor scales: one weight per expert
    for w, b in zip(experts, back):
        assert torch.equal(b.data, w.data) and torch.equal(b.global_scale, w.global_scale)
    x = torch.randn(4, 64, generator=gen).to(torch.bfloat16)
    ids = torch.tensor([[0, 2], [1, 1], [2, 0], [1, 2]])
    out = tilemm.moe_linear(x, packed, ids)
    w64 = torch.stack([w.dequantize() for w in experts]).to(torch.float64)
    ref = torch.einsum("tk,tjnk->tjn", x.to(torch.float64), w64[ids])
    assert_matches(out.float(), ref, torch.bfloat16)


def test_stacked_exponent_is_shared():
    """An expert with large scales moves every expert's multipliers down by the same 2^E."""
    gen = torch.Generator().manual_seed(1)
    small = tilemm.quantize_mxfp4(torch.randn(8, 64, generator=gen))
    large = tilemm.quantize_mxfp4(torch.randn(8, 64, generator=gen) * 2.0 ** 20)
    packed = prepack([small, large])
    assert packed.exponent == prepack(large).exponent > 0
    assert torch.equal(packed.constants[:, 1], torch.full((2,), 2.0 ** (126 - packed.exponent)))
    x = torch.randn(3, 64, generator=gen).to(torch.bfloat16)
    ids = torch.tensor([[0, 1], [1, 0], [0, 0]])
    w_q = tilemm.MXFP4Tensor(torch.stack([small.data, large.data]), torch.stack([small.scale, large.scale]))
    assert_matches(tilemm.moe_linear(x, packed, ids).float(), reference64(x, w_q, ids), torch.bfloat16)


@pytest.mark.parametrize("fmt", ["mxfp4", "mxfp8"])
def test_experts_state_dict_of_an_older_word_layout_loads(fmt):
    """MoEExperts keeps its prepacked words in its state dict, under the word layout's version: a state
    dict saved with layout 1 (before the e2m1 fields moved) loads as the same elements."""
    from tilemm.packed import LAYOUT_VERSION, relayout_words

    _, gate_up = stacked(fmt, 2, 64, 64, seed=5)  # (E, 2I, H)
    _, down = stacked(fmt, 2, 64, 32, seed=6)  # (E, H, I)
    module = MoEExperts(gate_up, down)
    state = module.state_dict()
    assert state._metadata[""]["version"] == MoEExperts._version
    assert MoEExperts._WORD_LAYOUT[MoEExperts._version] == LAYOUT_VERSION  # a new word layout needs a new version
    old = dict(state)
    for name in ("gate_up_words", "down_words"):
        old[name] = relayout_words(state[name], gate_up.fmt, LAYOUT_VERSION, 1)
    assert fmt == "mxfp8" or not torch.equal(old["gate_up_words"], state["gate_up_words"])
    fresh = MoEExperts(*(stacked(fmt, 2, n, k, seed=9)[1] for n, k in ((64, 64), (64, 32))))
    fresh.load_state_dict(old)  # no metadata: version 1
    for name in ("gate_up_words", "down_words"):
        assert torch.equal(getattr(fresh, name), state[name])
    fresh.load_state_dict(state)  # the current version as it is
    assert torch.equal(fresh.gate_up_words, state["gate_up_words"])
    assert torch.equal(unpack(fresh.packed("gate_up")).data, unpack(gate_up).data)


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_experts_state_dict_of_version_3_loads_as_it_is(fmt):
    """Version 4 (layout 3) changed only single NVFP4 weights' scale orientation: a version-3 state
    dict's stacked words and (E, K/B, N) scales load unchanged, NVFP4's included."""
    _, gate_up = stacked(fmt, 2, 64, 64, seed=5)
    _, down = stacked(fmt, 2, 64, 32, seed=6)
    state = MoEExperts(gate_up, down).state_dict()
    assert tuple(state["gate_up_scale_t"].shape) == (2, 64 // gate_up.fmt.block, 64)
    old = type(state)(state)
    old._metadata = {"": {"version": 3}}
    fresh = MoEExperts(*(stacked(fmt, 2, n, k, seed=9)[1] for n, k in ((64, 64), (64, 32))))
    fresh.load_state_dict(old)
    for name, t in state.items():
        assert torch.equal(getattr(fresh, name), t), name


def test_stacked_prepack_errors():
    a = tilemm.quantize_mxfp4(torch.randn(8, 64))
    with pytest.raises(ValueError, match="one format and shape"):
        prepack([a, tilemm.quantize_mxfp4(torch.randn(8, 32))])
    with pytest.raises(ValueError, match="one format and shape"):
        prepack([a, tilemm.quantize_nvfp4(torch.randn(8, 64))])
    with pytest.raises(ValueError, match="at least one expert"):
        prepack([])
    with pytest.raises(TypeError, match="expert 1 must be"):
        prepack([a, torch.zeros(8, 64)])
    with pytest.raises(ValueError, match="needs logical scales"):
        prepack(tilemm.quantize_mxfp4(torch.randn(2, 128, 64), swizzle=True))
    with pytest.raises(ValueError, match="2-D .* or a 3-D"):
        prepack(tilemm.quantize_mxfp4(torch.randn(2, 2, 4, 64)))


# --------------------------------------------------------------------------------------------------
# moe_linear on the CPU
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", FORMAT_NAMES)
@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_moe_linear_reference(fmt, x_dtype):
    # T = 7 tokens, top-3 over 5 experts (one expert chosen twice by a token, one never chosen).
    w_q, packed = stacked(fmt, 5, 24, 64, seed=2)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(7, 64, generator=gen).to(x_dtype)
    ids = torch.randint(0, 4, (7, 3), generator=gen)
    ids[0] = torch.tensor([2, 2, 0])
    bias = torch.randn(5, 24, generator=gen)
    out = tilemm.moe_linear(x, packed, ids, bias)
    assert out.shape == (7, 3, 24) and out.dtype == x_dtype
    assert_matches(out.float(), reference64(x, w_q, ids, bias), x_dtype)
    assert torch.equal(tilemm.moe_linear(x, packed, ids.to(torch.int32), bias), out)


def test_moe_linear_empty_and_single_token():
    w_q, packed = stacked("mxfp4", 4, 16, 64)
    x = torch.randn(0, 64).to(torch.bfloat16)
    assert tilemm.moe_linear(x, packed, torch.zeros(0, 2, dtype=torch.long)).shape == (0, 2, 16)
    x = torch.randn(1, 64).to(torch.bfloat16)
    ids = torch.tensor([[3]])
    assert_matches(tilemm.moe_linear(x, packed, ids).float(), reference64(x, w_q, ids), torch.bfloat16)


def test_out_of_range_ids_give_nan_rows_or_an_error():
    w_q, packed = stacked("mxfp4", 4, 16, 64)
    x = torch.randn(3, 64).to(torch.bfloat16)
    ids = torch.tensor([[0, 4], [-1, 1], [3, 2]])
    out = tilemm.moe_linear(x, packed, ids)
    bad = (ids < 0) | (ids >= 4)
    assert out[bad].isnan().all() and not out[~bad].isnan().any()
    assert_matches(out[~bad].float(), reference64(x, w_q, ids)[~bad], torch.bfloat16)
    with pytest.raises(ValueError, match=r"topk_ids must lie in \[0, 4\) .* got values in \[-1, 4\]"):
        tilemm.moe_linear(x, packed, ids, check_ids=True)


def test_moe_linear_errors_name_the_argument():
    _, packed = stacked("mxfp4", 4, 16, 64)
    x = torch.randn(3, 64).to(torch.bfloat16)
    ids = torch.zeros(3, 2, dtype=torch.long)
    with pytest.raises(TypeError, match="w must be a stacked expert PackedWeight"):
        tilemm.moe_linear(x, prepack(tilemm.quantize_mxfp4(torch.randn(16, 64))), ids)
    with pytest.raises(TypeError, match="x must be bfloat16 or float16, got torch.float32"):
        tilemm.moe_linear(x.float(), packed, ids)
    with pytest.raises(ValueError, match=r"x must be \(T, K\) with K = 64 .* got shape \(3, 32\)"):
        tilemm.moe_linear(x[:, :32], packed, ids)
    with pytest.raises(TypeError, match="topk_ids must be int32 or int64, got torch.float32"):
        tilemm.moe_linear(x, packed, ids.float())
    with pytest.raises(ValueError, match=r"topk_ids must be \(T, k\) with T = 3"):
        tilemm.moe_linear(x, packed, ids[:2])
    with pytest.raises(ValueError, match=r"bias must be \(E, N\) = \(4, 16\), got \(16,\)"):
        tilemm.moe_linear(x, packed, ids, torch.zeros(16))
    with pytest.raises(TypeError, match="bias must be float32, bfloat16 or float16"):
        tilemm.moe_linear(x, packed, ids, torch.zeros(4, 16, dtype=torch.int32))
    with pytest.raises(ValueError, match="multiple of"):  # K not a multiple of the block: refused when quantizing
        tilemm.quantize_mxfp4(torch.randn(2, 16, 40))


def test_moe_linear_errors_more():
    _, packed = stacked("mxfp4", 4, 16, 64)
    x = torch.randn(3, 64).to(torch.bfloat16)
    ids = torch.zeros(3, 2, dtype=torch.long)
    with pytest.raises(TypeError, match="x must be a torch.Tensor, got list"):
        tilemm.moe_linear([[0.0] * 64], packed, ids)
    with pytest.raises(TypeError, match="topk_ids must be a torch.Tensor, got list"):
        tilemm.moe_linear(x, packed, [[0, 1]] * 3)
    with pytest.raises(ValueError, match=r"topk_ids must be \(T, k\) with T = 3 \(x's rows\) and k >= 1, got shape "
                                         r"\(3, 0\)"):
        tilemm.moe_linear(x, packed, ids[:, :0])
    with pytest.raises(ValueError, match=r"x must be \(T, K\) with K = 64"):
        tilemm.moe_linear(x.reshape(3, 1, 64), packed, ids)
    with pytest.raises(TypeError, match="bias must be a torch.Tensor or None, got float"):
        tilemm.moe_linear(x, packed, ids, 0.5)
    with pytest.raises(ValueError, match=r"topk_ids must lie in \[0, 4\) .* got values in \[0, 7\]"):
        tilemm.moe_linear(x, packed, torch.tensor([[0, 7], [1, 2], [3, 3]]), check_ids=True)


def test_experts_module_errors_name_the_argument():
    """MoEExperts: weights that do not fit each other, biases of the wrong shape or type, and
    forward's arguments: typed errors naming them."""
    fn = "tilemm.moe.MoEExperts"
    _, gu = stacked("mxfp4", 4, 64, 64, seed=50)
    _, dn = stacked("mxfp4", 4, 64, 32, seed=51)
    _, dn_bad = stacked("mxfp4", 3, 64, 32, seed=52)
    with pytest.raises(TypeError, match=f"{fn}: gate_up must be a stacked expert PackedWeight"):
        MoEExperts(prepack(tilemm.quantize_mxfp4(torch.randn(64, 64))), dn)
    with pytest.raises(ValueError, match=r"gate_up \(E, 2I, H\) = \(4, 64, 64\) and down \(E, H, I\) = \(3, 64, 32\) "
                                         r"do not fit"):
        MoEExperts(gu, dn_bad)
    with pytest.raises(ValueError, match=r"down_bias must be \(E, N\) = \(4, 64\), got \(4, 32\)"):
        MoEExperts(gu, dn, None, torch.zeros(4, 32))
    with pytest.raises(TypeError, match="gate_up_bias must be a float torch.Tensor"):
        MoEExperts(gu, dn, torch.zeros(4, 64, dtype=torch.int64))
    ours = MoEExperts(gu, dn)
    x = torch.randn(3, 64).to(torch.bfloat16)
    ids = torch.tensor([[0, 1], [2, 3], [1, 0]])
    w = torch.full((3, 2), 0.5, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"hidden_states must be \(\.\.\., 64\), got \(3, 32\)"):
        ours(x[:, :32], ids, w)
    with pytest.raises(TypeError, match="hidden_states must be bfloat16 or float16, got torch.float32"):
        ours(x.float(), ids, w)
    with pytest.raises(TypeError, match="router_indices must be int32 or int64, got torch.float32"):
        ours(x, ids.float(), w)
    with pytest.raises(ValueError, match=r"router_indices must be \(T, k\) for the T = 3 tokens"):
        ours(x, ids[:2], w)
    with pytest.raises(ValueError, match=r"routing_weights must have router_indices' shape \(3, 2\)"):
        ours(x, ids, w[:, :1])
    with pytest.raises(TypeError, match="routing_weights must be a float tensor, got torch.int64"):
        ours(x, ids, ids)
    with pytest.raises(TypeError, match="routing_weights must be a torch.Tensor, got list"):
        ours(x, ids, [[0.5, 0.5]] * 3)


def test_moe_linear_compiles_fullgraph():
    """The custom op with its fake implementation traces as one op under torch.compile(fullgraph=True)."""
    w_q, packed = stacked("nvfp4", 4, 16, 64)
    x = torch.randn(5, 64).to(torch.bfloat16)
    ids = torch.randint(0, 4, (5, 2))

    def f(x, ids):
        return tilemm.moe_linear(x, packed, ids) * 2

    compiled = torch.compile(f, fullgraph=True, backend="eager")
    assert torch.equal(compiled(x, ids), f(x, ids))


# --------------------------------------------------------------------------------------------------
# The grouped kernel's tile code on the CPU
# --------------------------------------------------------------------------------------------------

@pytest.fixture
def emulated(monkeypatch):
    emu = TileEmulator()
    monkeypatch.setattr(mk, "ct", LaunchProxy(emu))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a, **k: None)
    return emu


def _run_kernel(x, packed, ids, bias, cfg, act=0, sorted_out=None, blocks=None):
    """The kernel on x's rows sorted by expert; its output in (token, slot) row order (a sorted output
    put back in that order here)."""
    t, k = ids.shape
    e, n = packed.words.shape[:2]
    n_out = n // 2 if act else n
    out = torch.full((t * k, n_out), 12345.0, dtype=x.dtype)  # poison: every row must be written
    b = None if bias is None else bias.float()
    routed = mk.route(ids, e)
    moe_plan = mk.plan(t, k, e, n, x.shape[1], packed.layout, design="sorted", config=cfg)
    mk.launch(mk.sort_rows(x, routed, k), packed.words, packed.scale_t, packed.constants, b, routed, t, out,
              packed.layout, act=act, moe_plan=moe_plan, sorted_out=sorted_out, blocks=blocks)
    if (act if sorted_out is None else sorted_out):
        unsorted = torch.empty_like(out)
        unsorted[routed[0]] = out
        out = unsorted
    return out.reshape(t, k, n_out)


def test_routing_is_fixed_size_and_sorted():
    ids = torch.tensor([[2, 0], [2, 5], [-1, 2], [0, 7]])
    order, offsets, slot_expert, longest = mk.route(ids, 6)
    assert order.shape == (8,) and offsets.shape == (8,) and slot_expert.shape == (7,)
    assert longest.tolist() == [3]  # expert 2
    keys = torch.where((ids.reshape(-1) >= 6) | (ids.reshape(-1) < 0), 6, ids.reshape(-1))
    assert torch.equal(keys[order], torch.sort(keys, stable=True).values)
    assert torch.equal(order[:2], torch.tensor([1, 6]))  # stable: rows of one expert in row order
    assert offsets.tolist() == [0, 2, 2, 5, 5, 5, 6, 8]
    assert slot_expert.tolist() == [2, 0, 6, 5, 1, 3, 4]  # 8 rows >= E + 1: every expert, busiest first
    # fewer rows than experts: by decreasing rows (ties by id), then the empty experts
    assert mk.route(ids[:3], 9)[2].tolist() == [2, 0, 5, 9, 1, 3]  # 3 rows, 1, 1, 1 (the extra), none
    # one token, one expert: a single slot; far out-of-range ids still land on the extra expert
    assert mk.route(torch.tensor([[3]]), 6)[2].tolist() == [3]
    assert mk.route(torch.tensor([[2 ** 40, -2 ** 40]]), 6)[2].tolist() == [6, 0]  # (expert 0: no rows)


def _route_both(ids, e):
    """``route`` by the PyTorch operations and by ``_route_kernel`` (on the emulator)."""
    return mk.route(ids, e, kernel=False), mk.route(ids, e, kernel=True)


def test_route_kernel_matches_the_sorting_route(emulated):
    """The one-block routing kernel: the same order (stable) and offsets as the PyTorch route; its
    slots the same experts with rows in the same order (busiest first, ties by id), then -1 where
    the PyTorch route lists experts without rows. Out-of-range ids (negative, >= E, huge), int32 ids,
    a single row, every row on one expert, more rows than experts."""
    gen = torch.Generator().manual_seed(31)
    cases = [(torch.tensor([[2, 0], [2, 5], [-1, 2], [0, 7]]), 6), (torch.tensor([[3]]), 6),
             (torch.tensor([[2 ** 40, -2 ** 40]]), 6), (torch.full((5, 2), 4, dtype=torch.int32), 9),
             (torch.randint(-2, 40, (16, 4), generator=gen), 37), (torch.randint(0, 8, (12, 3), generator=gen), 8)]
    for ids, e in cases:
        (order, offsets, slots, longest), (k_order, k_offsets, k_slots, k_longest) = _route_both(ids, e)
        assert torch.equal(k_order, order) and torch.equal(k_offsets, offsets), (ids, e)
        assert k_longest.tolist() == longest.tolist() == [int((offsets[1:] - offsets[:-1]).max())]
        assert k_slots.shape == slots.shape and k_slots.dtype == torch.int64
        counts = (offsets[1:] - offsets[:-1]).tolist()  # (E + 1,): the extra expert E last
        busiest = sorted((b for b in range(e + 1) if counts[b]), key=lambda b: (-counts[b], b))
        assert k_slots.tolist() == busiest + [-1] * (len(k_slots) - len(busiest)), (ids, e)
        assert slots[:len(busiest)].tolist() == busiest  # the PyTorch route's order too
    assert mk.route_kernel_fits(64, 128) and not mk.route_kernel_fits(128, 128)  # 120b: T = 16, not 32
    assert mk.route_kernel_fits(128, 32) and mk.route_kernel_fits(32, 256) and not mk.route_kernel_fits(64, 256)


def test_kernel_after_route_kernel(emulated):
    """The grouped kernel on the routing kernel's slots (-1 entries: nothing to do), persistent grid."""
    e, n, k = 7, 32, 256
    w_q, packed = stacked("mxfp4", e, n, k, seed=32)
    gen = torch.Generator().manual_seed(33)
    x = (torch.randn(3, k, generator=gen) * 2).to(torch.bfloat16)
    ids = torch.tensor([[1, 1 + 0], [1, 4], [9, 1]])[:, :2]
    ids[0, 1] = 3
    routed = mk.route(ids, e, kernel=True)
    assert routed[2].tolist() == [1, 3, 4, 7, -1, -1]
    out = torch.full((6, n), 12345.0, dtype=torch.bfloat16)
    moe_plan = mk.plan(3, 2, e, n, k, packed.layout, design="sorted", config=mk.MoEConfig(16, 16, 4, None, cat=1))
    mk.launch(mk.sort_rows(x, routed, 2), packed.words, packed.scale_t, packed.constants, None, routed, 3, out,
              packed.layout, moe_plan=moe_plan, blocks=2)
    out = out.reshape(3, 2, n)
    ok = ids < e
    assert out[~ok].isnan().all()
    assert_matches(out[ok].float(), reference64(x, w_q, ids)[ok], torch.bfloat16)


@pytest.mark.parametrize("fmt", FORMAT_NAMES)
@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_kernel_matches_reference(emulated, fmt, x_dtype):
    # E = 5, N = 20 (a partial 16-row tile), K = 320 (not a multiple of tile_k: zero-padded words and
    # x columns past K gathered as zeros). Expert 1 gets 19 rows: two chunks of TM = 16. Expert 4
    # gets none; ids 5 and -1 are out of range (NaN rows).
    e, n, k = 5, 20, 320
    w_q, packed = stacked(fmt, e, n, k, seed=4)
    gen = torch.Generator().manual_seed(6)
    x = (torch.randn(12, k, generator=gen) * 3).to(x_dtype)
    ids = torch.randint(0, 4, (12, 2), generator=gen)
    ids[:10, 0] = 1
    ids[:9, 1] = 1
    ids[10, 1], ids[11, 0] = 5, -1
    bias = torch.randn(e, n, generator=gen)
    ref = reference_moe(x, packed.words, packed.scale_t, packed.constants, packed.fmt.name, k, ids, bias)
    ok = (ids >= 0) & (ids < e)
    # tile_m 16: expert 1's two chunks in one block (T = 12: one chunk group); tile_m 8: two chunk
    # groups (expert 1's three chunks over two blocks); tile_m 32: one chunk.
    for cfg in (mk.MoEConfig(16, 16, 4, None, cat=1), mk.MoEConfig(16, 16, 4, None, cat=0),
                mk.MoEConfig(16, 16, 4, None, cat=1, unroll=2),
                mk.MoEConfig(8, 16, 4, None, cat=1), mk.MoEConfig(32, 16, 4, None)):
        out = _run_kernel(x, packed, ids, bias, cfg)
        assert out[~ok].isnan().all()
        assert_matches(out[ok].float(), ref[ok].float(), x_dtype)
        assert_matches(out[ok].float(), reference64(x, w_q, ids, bias)[ok], x_dtype)


def test_kernel_single_token_top4(emulated):
    """Decode: one token, four experts of eight, the planned config (tile_m 16)."""
    w_q, packed = stacked("mxfp4", 8, 64, 256, seed=7)
    x = torch.randn(1, 256).to(torch.bfloat16)
    ids = torch.tensor([[6, 1, 3, 0]])
    cfg = mk.plan(1, 4, 8, 64, 256, packed.layout, design="sorted").config
    assert cfg.tile_m == 16 and cfg.cat == 1
    out = _run_kernel(x, packed, ids, None, cfg)
    assert_matches(out.float(), reference64(x, w_q, ids), torch.bfloat16)


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_fused_swiglu_epilogue(emulated, fmt):
    """ACT = 1: gate_up rows interleaved, the epilogue writes gpt-oss's SwiGLU of each pair (from the
    rounded products, in fp32, rounded once), as ``gpt_oss_glu`` of the unfused output."""
    from tilemm.moe import gpt_oss_glu

    e, n, k = 4, 64, 256
    w_q, packed = stacked(fmt, e, n, k, seed=8)
    gen = torch.Generator().manual_seed(9)
    x = (torch.randn(5, k, generator=gen) * 2).to(torch.bfloat16)
    ids = torch.tensor([[0, 3], [3, 1], [1, 0], [2, 3], [3, 0]])
    bias = torch.randn(e, n, generator=gen)
    cfg = mk.MoEConfig(16, 16, 4, None, cat=1)
    plain = _run_kernel(x, packed, ids, bias, cfg)
    fused = _run_kernel(x, packed, ids, bias, cfg, act=1)
    expected = gpt_oss_glu(plain, mk.SWIGLU_ALPHA, mk.SWIGLU_LIMIT)
    assert (plain[..., ::2].float() > mk.SWIGLU_LIMIT).any()  # the clamp matters in this case
    # exp's rounding aside, equal: at most one bf16 ulp apart
    assert torch.allclose(fused.float(), expected.float(), rtol=2 ** -7, atol=1e-6)


@pytest.mark.parametrize("design", ["sorted", "pairs_combine", "pairs_bmm"])
@pytest.mark.parametrize("unfused", [False, True], ids=["fused", "unfused"])
def test_experts_launches_chain(emulated, unfused, design):
    """The experts block's GPU paths on the emulator, equal to the CPU path up to summation order:
    "sorted": x sorted once, gate_up writing h in expert order, down reading it and scattering to
    (token, slot) rows; "pairs_*": the per-pair kernel, the weighted sum in the down launch or as a
    batched GEMM (any T is correct; the default takes the per-pair kernel at T = 1 only). Expert 0
    gets 19 of the 24 rows (two chunks of 16); one id is out of range (NaN token)."""
    from tilemm.moe import _experts_launches, run_experts

    e, hidden, inter = 4, 64, 32
    gen = torch.Generator().manual_seed(12)
    _, gu = stacked("mxfp4", e, 2 * inter, hidden, seed=13)
    _, dn = stacked("mxfp4", e, hidden, inter, seed=14)
    gub, db = torch.randn(e, 2 * inter, generator=gen), torch.randn(e, hidden, generator=gen)
    x = torch.randn(12, hidden, generator=gen).to(torch.bfloat16)
    ids = torch.randint(0, e, (12, 2), generator=gen)
    ids[:10, 0] = 0
    ids[:9, 1] = 0
    ids[11, 1] = e
    weights = torch.softmax(torch.randn(12, 2, generator=gen), -1).to(torch.bfloat16)
    limit = 6.5 if unfused else mk.SWIGLU_LIMIT
    args = (x, ids, weights, gu.words, gu.scale_t, gu.constants, "mxfp4", gub, dn.words, dn.scale_t,
            dn.constants, "mxfp4", db, mk.SWIGLU_ALPHA, limit)
    out = _experts_launches(*args, design=design)
    ref = run_experts(*args)  # the CPU path
    assert out[11].isnan().all() and ref[11].isnan().all()
    # the fused SwiGLU's exp may differ by an ulp of h; the rest is summation order
    err = ((out[:11].double() - ref[:11].double()).norm() / ref[:11].double().norm()).item()
    assert err < 4e-3, err


@pytest.mark.parametrize("fmt", FORMAT_NAMES)
def test_pairs_kernel_matches_reference(emulated, fmt):
    """The per-pair FMA kernel (no routing): one token's 4 experts, an id out of range (a NaN row, no
    weight read); K = 320: a partial K tile and a partial load of 2 K tiles (zero padding); N = 40:
    a partial 16-row tile. Also two tokens with a shared expert (correct, that expert read twice)."""
    e, n, k = 5, 40, 320
    w_q, packed = stacked(fmt, e, n, k, seed=15)
    gen = torch.Generator().manual_seed(16)
    bias = torch.randn(e, n, generator=gen)
    for t, ids in ((1, torch.tensor([[3, 0, 5, 1]])), (2, torch.tensor([[4, 2], [2, -1]]))):
        x = (torch.randn(t, k, generator=gen) * 2).to(torch.bfloat16)
        out = torch.full((ids.numel(), n), 12345.0, dtype=torch.bfloat16)
        moe_plan = mk.plan(t, ids.shape[1], e, n, k, packed.layout, design="pairs")
        assert moe_plan.config.unroll == 2 and not moe_plan.combine
        mk.launch_pairs(x, packed.words, packed.scale_t, packed.constants, bias, ids.reshape(-1), out,
                        packed.layout, moe_plan=moe_plan)
        out = out.reshape(*ids.shape, n)
        ok = (ids >= 0) & (ids < e)
        assert out[~ok].isnan().all()
        ref = reference_moe(x, packed.words, packed.scale_t, packed.constants, packed.fmt.name, k, ids, bias)
        assert_matches(out[ok].float(), ref[ok].float(), torch.bfloat16)
        assert_matches(out[ok].float(), reference64(x, w_q, ids, bias)[ok], torch.bfloat16)


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_pairs_kernel_wide_blocks_match_reference(emulated, fmt):
    """The per-pair kernel with 64-row blocks (the shape ``moe_pairs_tune.py --plans rows64`` times):
    N = 100 leaves a partial block, K = 1344 a second load of 4 K tiles reaching past K."""
    e, n, k = 3, 100, 1344
    w_q, packed = stacked(fmt, e, n, k, seed=19)
    gen = torch.Generator().manual_seed(20)
    bias = torch.randn(e, n, generator=gen)
    x = (torch.randn(1, k, generator=gen) * 2).to(torch.bfloat16)
    ids = torch.tensor([[2, 0]])
    out = torch.empty(2, n, dtype=torch.bfloat16)
    cfg = mk.PairsConfig(4, tile_n=64, occupancy=8)
    mk.launch_pairs(x, packed.words, packed.scale_t, packed.constants, bias, ids.reshape(-1), out, packed.layout,
                    moe_plan=mk.MoEPlan("pairs", cfg, False))
    assert_matches(out.float(), reference64(x, w_q, ids, bias).reshape(2, n), torch.bfloat16)


def test_pairs_kernel_swiglu_and_combine(emulated):
    """The per-pair kernel's fused SwiGLU (as the sorted kernel's) and its weighted sum over a token's
    slots (COMBINE: the down projection writes the layer's output)."""
    from tilemm.moe import _weighted_sum, gpt_oss_glu

    e, n, k = 6, 32, 512
    w_q, packed = stacked("mxfp4", e, n, k, seed=17)
    gen = torch.Generator().manual_seed(18)
    bias = torch.randn(e, n, generator=gen)
    x = (torch.randn(1, k, generator=gen) * 2).to(torch.bfloat16)
    ids = torch.tensor([[5, 2, 0]])
    plain = torch.empty(3, n, dtype=torch.bfloat16)
    fused = torch.empty(3, n // 2, dtype=torch.bfloat16)
    mk.launch_pairs(x, packed.words, packed.scale_t, packed.constants, bias, ids.reshape(-1), plain, packed.layout)
    mk.launch_pairs(x, packed.words, packed.scale_t, packed.constants, bias, ids.reshape(-1), fused, packed.layout,
                    act=1)
    assert (plain[:, ::2].float() > mk.SWIGLU_LIMIT).any()
    assert torch.allclose(fused.float(), gpt_oss_glu(plain, mk.SWIGLU_ALPHA, mk.SWIGLU_LIMIT).float(),
                          rtol=2 ** -7, atol=1e-6)
    # COMBINE: x one row per pair (as the down projection's input), out (T, N)
    rows = (torch.randn(3, k, generator=gen)).to(torch.bfloat16)
    weights = torch.softmax(torch.randn(1, 3, generator=gen), -1).to(torch.bfloat16)
    per_pair = torch.empty(3, n, dtype=torch.bfloat16)
    mk.launch_pairs(rows, packed.words, packed.scale_t, packed.constants, bias, ids.reshape(-1), per_pair,
                    packed.layout)
    # one pair per step, or two (3 slots: one step of two, then the last alone)
    for slots in (1, 2):
        cfg = dataclasses.replace(mk._pairs_config(k, packed.layout), slots=slots)
        combined = torch.empty(1, n, dtype=torch.bfloat16)
        mk.launch_pairs(rows, packed.words, packed.scale_t, packed.constants, bias, ids.reshape(-1), combined,
                        packed.layout, weights=weights, moe_plan=mk.MoEPlan("pairs", cfg, True))
        assert torch.equal(combined, _weighted_sum(per_pair.reshape(1, 3, n), weights)), slots


def test_combining_two_pairs_per_step_matches_one(emulated):
    """The combining block's two pairs per step (``_pair_rows2``) against one per step and against
    the per-pair rows summed: int32 ids, an odd top_k (two steps and a tail); an id out of range in
    the first or second pair of a step or in the tail (negative or >= E) makes that token's row NaN,
    never another expert's product."""
    from tilemm.moe import _weighted_sum

    e, n, k = 6, 32, 512
    _, packed = stacked("nvfp4", e, n, k, seed=31)
    gen = torch.Generator().manual_seed(32)
    bias = torch.randn(e, n, generator=gen)
    ids = torch.tensor([[5, 2, 0, 3, 1], [-1, 4, 2, 2, 0], [1, 9, 3, 0, 5], [0, 1, 2, 3, -7]], dtype=torch.int32)
    t, top_k = ids.shape
    rows = torch.randn(t * top_k, k, generator=gen).to(torch.bfloat16)
    weights = torch.softmax(torch.randn(t, top_k, generator=gen), -1).to(torch.bfloat16)
    per_pair = torch.empty(t * top_k, n, dtype=torch.bfloat16)
    mk.launch_pairs(rows, packed.words, packed.scale_t, packed.constants, bias, ids.reshape(-1), per_pair,
                    packed.layout)
    outs = []
    for slots in (1, 2):
        cfg = dataclasses.replace(mk._pairs_config(k, packed.layout), slots=slots)
        combined = torch.empty(t, n, dtype=torch.bfloat16)
        mk.launch_pairs(rows, packed.words, packed.scale_t, packed.constants, bias, ids.reshape(-1), combined,
                        packed.layout, weights=weights, moe_plan=mk.MoEPlan("pairs", cfg, True))
        outs.append(combined)
    assert torch.equal(outs[0][0], _weighted_sum(per_pair.reshape(t, top_k, n), weights)[0])
    assert torch.equal(outs[1][0], outs[0][0])
    for out in outs:
        assert out[1:].isnan().all()


def test_pairs_config_slots_are_one_or_two():
    with pytest.raises(ValueError, match="slots must be 1 or 2"):
        mk.PairsConfig(2, slots=3)


def test_pairs_plan_unroll_wastes_little():
    layout = tilemm.packed.layout_of(MXFP4)
    # K = 2560: 10 K tiles, 4 per load would pad 2 of them (more than an eighth): 2 per load
    plans = [mk.plan(1, 4, 32, 2880, k, layout, design="pairs") for k in (2880, 2048, 512, 256, 8192, 2560)]
    assert [p.config.unroll for p in plans] == [4, 4, 2, 2, 4, 2]
    assert {p.config.occupancy for p in plans} == {8}


def _combines(tokens: int, n: int, sms: int) -> bool:
    """Whether the plan of an experts block's down projection (per pair, N = ``n``) combines."""
    return mk.plan(tokens, 4, 32, n, 2880, tilemm.packed.layout_of(MXFP4), sms=sms, design="pairs",
                   combine=None).combine


def test_combine_only_with_one_and_a_half_blocks_per_sm():
    # gpt-oss-20b's down projection at T = 1: 180 blocks of (token, 16 rows) on 132 SMs -> no;
    # the 2048-wide anchor layer at T = 2: 256 blocks -> yes
    assert not _combines(1, 2880, 132) and not _combines(1, 2048, 132)
    assert _combines(1, 7168, 132) and _combines(2, 2880, 132) and _combines(2, 2048, 132)
    # choosing needs the SM count; the sorted design never combines
    layout = tilemm.packed.layout_of(MXFP4)
    with pytest.raises(ValueError, match="combine=None.*needs sms"):
        mk.plan(1, 4, 32, 2880, 2880, layout, design="pairs", combine=None)
    with pytest.raises(ValueError, match="combine=True needs the per-pair design"):
        mk.plan(64, 4, 32, 2880, 2880, layout, design="sorted", combine=True)
    assert not mk.plan(64, 4, 32, 2880, 2880, layout, design="sorted", combine=None).combine


def _design(tokens: int, top_k: int, num_experts: int, expert_bytes: float) -> str:
    return mk.plan(tokens, top_k, num_experts, 2880, 2880, tilemm.packed.layout_of(MXFP4), expert_bytes).design


def test_pairs_for_a_few_tokens():
    # one token always; then while the pairs are at most half the experts and read <= 256 MiB
    gpt_oss, anchor = 13 * 2 ** 20, 1.6 * 2 ** 20  # one expert's gate_up + down bytes in MXFP4
    assert [t for t in (1, 2, 4, 8, 16, 32) if _design(t, 4, 32, gpt_oss) == "pairs"] == [1, 2, 4]
    assert [t for t in (1, 2, 4, 8, 16, 32) if _design(t, 4, 128, gpt_oss) == "pairs"] == [1, 2, 4]
    assert [t for t in (1, 2, 4, 8, 16, 32) if _design(t, 8, 256, anchor) == "pairs"] == [1, 2, 4, 8, 16]
    assert _design(1, 8, 8, 10 ** 12) == "pairs" and _design(2, 2, 6, 1) == "sorted"
    with pytest.raises(ValueError, match="design=None.*needs expert_bytes"):
        mk.plan(1, 4, 32, 2880, 2880, tilemm.packed.layout_of(MXFP4))
    with pytest.raises(ValueError, match="design must be one of"):
        mk.plan(1, 4, 32, 2880, 2880, tilemm.packed.layout_of(MXFP4), design="grouped")
    w = torch.zeros(4, 10, 3, dtype=torch.int32)
    assert mk.expert_bytes(w, torch.zeros(4, 5, dtype=torch.uint8)) == 10 * 3 * 4 + 5


def _chunk_groups(tokens: int) -> int:
    """The chunk groups of the sorted design's plan at tile_m 16 for T = ``tokens``."""
    return mk.plan(tokens, 2, 3, 16, 256, tilemm.packed.layout_of(MXFP4), design="sorted",
                   config=mk.MoEConfig(16, 16, 4, None, cat=1)).groups


def test_chunk_groups_spread_a_popular_expert(emulated):
    """Every token picks expert 2 (skewed routing at large T): its chunks spread over G blocks; the
    result is the same whatever G."""
    assert [_chunk_groups(t) for t in (1, 40, 10 ** 4)] == [1, 3, 8]
    w_q, packed = stacked("mxfp4", 3, 16, 256, seed=11)
    x = torch.randn(40, 256).to(torch.bfloat16)
    ids = torch.stack([torch.full((40,), 2), torch.arange(40) % 2], dim=1)
    out = _run_kernel(x, packed, ids, None, mk.MoEConfig(16, 16, 4, None, cat=1))
    assert_matches(out.float(), reference64(x, w_q, ids), torch.bfloat16)


def test_persistent_grid_runs_every_item(emulated):
    """A grid smaller than the work items (the persistent grid of skewed decode batches): each block
    runs items b, b + blocks, ..; the result is the one-block-per-item result, bit for bit. Skewed
    routing, fewer pairs than experts: most slots hold no rows; an expert with two chunks and
    chunk groups > 1; one id out of range (a NaN row)."""
    e, n, k = 9, 48, 256
    _, packed = stacked("mxfp4", e, n, k, seed=21)
    gen = torch.Generator().manual_seed(22)
    x = (torch.randn(20, k, generator=gen) * 2).to(torch.bfloat16)
    ids = torch.stack([torch.zeros(20, dtype=torch.long), torch.full((20,), 9)], dim=1)[:4]  # 8 pairs <= E
    ids[3, 1] = 4
    x = x[:4]
    bias = torch.randn(e, n, generator=gen)
    cfg = mk.MoEConfig(16, 16, 4, None, cat=1)
    full = _run_kernel(x, packed, ids, bias, cfg)
    for blocks in (1, 2, 5):
        assert torch.equal(_run_kernel(x, packed, ids, bias, cfg, blocks=blocks).isnan(), full.isnan())
        same = ~full.isnan()
        assert torch.equal(_run_kernel(x, packed, ids, bias, cfg, blocks=blocks)[same], full[same])
    assert full[:3, 1].isnan().all() and not full[3, 1].isnan().any()
    # chunk groups > 1 (T = 40 tokens on expert 2, two chunks of 16 spread over 3 groups), 3 blocks
    x40 = torch.randn(40, k, generator=gen).to(torch.bfloat16)
    ids40 = torch.stack([torch.full((40,), 2), torch.arange(40) % 2], dim=1)
    assert torch.equal(_run_kernel(x40, packed, ids40, None, cfg, blocks=3), _run_kernel(x40, packed, ids40, None, cfg))
    # fewer chunk groups than the shapes allow (T = 40: 3; no expert over 16 rows: the kernel takes 1)
    w_q, packed = stacked("mxfp4", 3, 16, 256, seed=23)
    ids3 = (torch.arange(40) % 3).reshape(40, 1)
    out = _run_kernel(x40, packed, ids3, None, cfg, blocks=4)
    assert _chunk_groups(40) == 3
    assert_matches(out.float(), reference64(x40, w_q, ids3), torch.bfloat16)
    # E + 2 = 72 offsets (two loads of 64 when the kernel looks for the longest run): the busiest
    # expert, 69, in the second
    w_q, packed = stacked("mxfp4", 70, 16, 256, seed=24)
    ids69 = torch.stack([torch.full((40,), 69), torch.arange(40) % 7], dim=1)
    out = _run_kernel(x40, packed, ids69, None, cfg, blocks=5)
    assert_matches(out.float(), reference64(x40, w_q, ids69), torch.bfloat16)
    # the launcher's choice: one block per item on the CPU (the emulator)
    assert mk.grid_blocks(500, cfg, torch.device("cpu")) == 500


def test_plan_tile_m_follows_tokens_per_expert():
    def tile(tokens, top_k, num_experts, fmt=MXFP4):
        return mk.plan(tokens, top_k, num_experts, 2880, 2880, tilemm.packed.layout_of(fmt), design="sorted").config

    assert tile(1, 4, 32).tile_m == 16
    assert tile(64, 4, 32).tile_m == 16        # 8 per expert
    assert tile(256, 4, 32).tile_m == 32       # 32 per expert
    assert tile(1024, 4, 32).tile_m == 64       # 128 per expert: two 64-row chunks
    assert tile(2048, 4, 32).tile_m == 128      # 256 per expert
    assert tile(1024, 8, 256).tile_m == 32
    assert tile(16, 4, 32, MXFP8_E4M3).occupancy == 2
    # the design chosen: sorted past a few tokens, its chunk groups with it
    chosen = mk.plan(1024, 4, 32, 2880, 2880, tilemm.packed.layout_of(MXFP4), 13 * 2 ** 20)
    assert chosen == mk.MoEPlan("sorted", tile(1024, 4, 32), groups=8)


# --------------------------------------------------------------------------------------------------
# gpt-oss: the experts module and whole models
# --------------------------------------------------------------------------------------------------

transformers = pytest.importorskip("transformers")


def tiny_gpt_oss_config(**kw):
    cfg = dict(vocab_size=96, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
               max_position_embeddings=64, layer_types=["sliding_attention", "full_attention"],
               sliding_window=8, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    cfg.update(kw)
    return transformers.GptOssConfig(**cfg)


def _dequantized_into(hf_experts, ours: MoEExperts):
    """transformers' experts given our dequantized weights (its (E, K, N) layout)."""
    with torch.no_grad():
        for proj in ("gate_up", "down"):
            w = unpack(ours.packed(proj))
            dq = torch.stack([q.dequantize() for q in w]) if isinstance(w, list) else w.dequantize()
            getattr(hf_experts, proj + "_proj").copy_(dq.transpose(1, 2))
            getattr(hf_experts, proj + "_proj_bias").copy_(getattr(ours, proj + "_bias"))


@pytest.mark.parametrize("fmt", FORMAT_NAMES)
@pytest.mark.parametrize("impl", ["eager", "grouped_mm"])
def test_experts_module_matches_transformers(fmt, impl):
    """MoEExperts against transformers' GptOssExperts (bf16) on the dequantized weights: equal up to
    summation order (transformers rounds gate_up to bf16 before adding its bias and sums the k
    weighted expert outputs in bf16, hence the bf16 tolerance of a few roundings)."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    torch.manual_seed(0)
    cfg = tiny_gpt_oss_config()
    cfg._experts_implementation = impl
    hf = GptOssExperts(cfg)
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.1)
    ours = MoEExperts.from_gpt_oss(hf, fmt)
    hf = hf.to(torch.bfloat16)
    _dequantized_into(hf, ours)
    x = torch.randn(9, 64).to(torch.bfloat16)
    logits = torch.randn(9, 4)
    top, ids = torch.topk(logits, 2, dim=-1)
    weights = torch.softmax(top, dim=-1).to(torch.bfloat16)
    ref = hf(x, ids, weights)
    out = ours(x, ids, weights)
    assert torch.equal(torch.compile(ours, fullgraph=True, backend="eager")(x, ids, weights), out)
    assert out.dtype == torch.bfloat16 and out.shape == (9, 64)
    err = ((out.double() - ref.double()).norm() / ref.double().norm()).item()
    assert err < 1e-2, err


def _write_gpt_oss_checkpoint(model, path):
    """``model``'s state dict in the gpt-oss layout: experts as MXFP4 ``*_blocks`` / ``*_scales``
    (quantized along K per expert), everything else in bf16; plus config.json."""
    from safetensors.torch import save_file

    tensors = {}
    for name, t in model.state_dict().items():
        base, _, leaf = name.rpartition(".")
        if leaf in ("gate_up_proj", "down_proj"):
            q = tilemm.quantize_mxfp4(t.transpose(1, 2).float().contiguous())  # (E, N, K)
            blocks, scales = checkpoints.to_gpt_oss(q)
            tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks.contiguous(), scales.contiguous()
        else:
            tensors[name] = t.to(torch.bfloat16).contiguous()
    save_file(tensors, str(path / "model.safetensors"))
    config = model.config.to_dict() | {"quantization_config": {"quant_method": "mxfp4"}}
    (path / "config.json").write_text(json.dumps(config))


def test_whole_gpt_oss_model_quantized_and_loaded(tmp_path):
    """A tiny GptOssForCausalLM: written in the gpt-oss layout and loaded with load_quantized, it
    gives exactly the logits of the same model quantized in memory with quantize_model, and the
    logits of transformers' bf16 model on the dequantized experts up to summation order."""
    torch.manual_seed(1)
    cfg = tiny_gpt_oss_config()
    model = transformers.GptOssForCausalLM(cfg).to(torch.bfloat16).eval()
    _write_gpt_oss_checkpoint(model, tmp_path)

    fresh = transformers.GptOssForCausalLM(cfg).to(torch.bfloat16).eval()
    tilemm.load_quantized(fresh, tmp_path, convention="gpt-oss")
    experts = [m for m in fresh.modules() if isinstance(m, MoEExperts)]
    assert len(experts) == 2 and not any(type(m).__name__ == "GptOssExperts" for m in fresh.modules())
    assert experts[0].gate_up_words.dtype == torch.int32  # packed words, never a bf16 expert

    in_memory = tilemm.quantize_model(model, "mxfp4", weight_only=True, skip=lambda n, m: isinstance(
        m, torch.nn.Linear))  # the experts only, as the checkpoint stores them
    ids = torch.randint(0, 96, (2, 6), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        loaded = fresh(ids).logits
        quantized = in_memory(ids).logits
    assert torch.equal(loaded, quantized)

    reference = transformers.GptOssForCausalLM(cfg).to(torch.bfloat16).eval()
    reference.load_state_dict(model.state_dict(), strict=False)
    for ours, hf in zip(experts, [m for m in reference.modules() if type(m).__name__ == "GptOssExperts"]):
        _dequantized_into(hf, ours)
    with torch.no_grad():
        ref = reference(ids).logits
    err = ((loaded.double() - ref.double()).norm() / ref.double().norm()).item()
    assert err < 2e-2, err


def test_gpt_oss_checkpoint_errors(tmp_path):
    cfg = tiny_gpt_oss_config()
    model = transformers.GptOssForCausalLM(cfg).to(torch.bfloat16)
    _write_gpt_oss_checkpoint(model, tmp_path)
    from safetensors.torch import load_file

    tensors = load_file(str(tmp_path / "model.safetensors"))
    other = transformers.GptOssForCausalLM(tiny_gpt_oss_config(num_local_experts=8)).to(torch.bfloat16)
    with pytest.raises(ValueError, match=r"experts 'model.layers.0.mlp.experts': gate_up_proj is \(E, N, K\) "
                                         r"= \(8, 128, 64\) in the model but \(4, 128, 64\)"):
        tilemm.load_quantized(other, tensors, convention="gpt-oss")
    del tensors["model.layers.1.mlp.experts.down_proj_scales"]
    with pytest.raises(ValueError, match=r"has no model.layers.1.mlp.experts.down_proj_scales"):
        tilemm.load_quantized(transformers.GptOssForCausalLM(cfg), tensors, convention="gpt-oss")


def test_benchmark_cpu_smoke(tmp_path):
    """benchmarks/bench_moe.py's code paths on tiny shapes (its correctness checks included)."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "bench_moe.py"
    spec = importlib.util.spec_from_file_location("bench_moe", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main(["--cpu-smoke", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "moe-cpu.json").read_text())
    assert result["layers"] and all(r["rel_err"] < 1e-2 for r in result["layers"])
    # both gatings (the SiLU layer as the anchor runs it); transformers' module on the same weights agrees
    assert {r["activation"] for r in result["layers"]} == {"gpt-oss", "silu"}
    assert all(r["hf_rel_err"] < 2e-2 for r in result["layers"])
    assert set(result["e2e"]) == {"gpt-oss-20b", "gpt-oss-120b"}
    r20, r120 = result["e2e"]["gpt-oss-20b"], result["e2e"]["gpt-oss-120b"]
    # the same decode step with MXFP4 and bf16 experts on the same weights: close logits
    assert r20["logits_rel_err"] < 2e-2 and r20["mxfp4"]["finite"] and r20["bf16"]["finite"]
    assert r120["batch1"]["finite"] and r120["batch8"]["finite"]
    assert bench.main(["--profile", "--cpu-smoke", "--out", str(tmp_path)]) == 0
    profiled = json.loads((tmp_path / "moe-profile-cpu.json").read_text())["profile"]
    assert {r["variant"] for r in profiled} == {"tilemm", "grouped"} and all(r["kernels"] for r in profiled)


def test_quantize_model_passes_the_element_dtype_to_the_experts():
    torch.manual_seed(3)
    model = transformers.GptOssForCausalLM(tiny_gpt_oss_config()).to(torch.bfloat16)
    tilemm.quantize_model(model, "mxfp8", weight_only=True, elem_dtype=torch.float8_e5m2)
    experts = [m for m in model.modules() if isinstance(m, MoEExperts)]
    assert len(experts) == 2 and experts[0].formats == ("mxfp8_e5m2", "mxfp8_e5m2")
    assert isinstance(model.model.layers[0].self_attn.q_proj, tilemm.nn.Linear)
    with torch.no_grad():
        assert torch.isfinite(model(torch.tensor([[1, 2, 3]])).logits).all()


def test_custom_ops_opcheck():
    """torch.library.opcheck of both ops (fake shapes, schema, autograd registration)."""
    _, packed = stacked("mxfp4", 4, 64, 64)
    x = torch.randn(3, 64).to(torch.bfloat16)
    ids = torch.tensor([[0, 3], [2, 2], [1, 0]])
    torch.library.opcheck(torch.ops.tilemm.moe_linear.default,
                          (x, packed.words, packed.scale_t, packed.constants, "mxfp4", 64, ids, torch.zeros(4, 64)))
    _, down = stacked("mxfp4", 4, 64, 32)
    weights = torch.rand(3, 2).to(torch.bfloat16)
    torch.library.opcheck(torch.ops.tilemm.gpt_oss_experts.default,
                          (x, ids, weights, packed.words, packed.scale_t, packed.constants, "mxfp4", None,
                           down.words, down.scale_t, down.constants, "mxfp4", torch.zeros(4, 64), 1.702, 7.0))


# --------------------------------------------------------------------------------------------------
# Experts from compressed-tensors and ModelOpt checkpoints
# --------------------------------------------------------------------------------------------------

E_CK, H_CK, I_CK = 3, 64, 32


def _experts_model(num_experts=E_CK, hidden=H_CK, inter=I_CK):
    """A module holding one transformers GptOssExperts at ``mlp.experts``."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    model = torch.nn.Module()
    model.mlp = torch.nn.Module()
    model.mlp.experts = GptOssExperts(tiny_gpt_oss_config(hidden_size=hidden, intermediate_size=inter,
                                                          num_local_experts=num_experts))
    return model


def _expert_weights(fmt: str, seed: int = 40, shared_gate_up_scale: bool = True):
    """Per expert {proj: (quantized (N, K), bias (N,))} for gpt-oss-shaped experts with separate gate
    and up projections (as per-expert checkpoints store them)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(E_CK):
        gs = torch.tensor(0.02 + 0.01 * i)
        layer = {}
        for proj, (n, k) in (("gate_proj", (I_CK, H_CK)), ("up_proj", (I_CK, H_CK)), ("down_proj", (H_CK, I_CK))):
            w = torch.randn(n, k, generator=gen)
            if fmt == "nvfp4":
                shared = shared_gate_up_scale and proj != "down_proj"
                q = tilemm.quantize_nvfp4(w, global_scale=gs if shared else None)
            else:
                q = QUANTIZERS[fmt](w)
            layer[proj] = (q, torch.randn(n, generator=gen).to(torch.bfloat16))
        out.append(layer)
    return out


def _dequant(q):
    return q.dequantize().float()


def _check_loaded_experts(model, weights):
    """The loaded MoEExperts holds exactly the checkpoint's values: gate_up row 2j = gate row j, row
    2j + 1 = up row j (and the biases alike), down as stored."""
    ours = model.mlp.experts
    assert isinstance(ours, MoEExperts) and ours.gate_up_words.dtype == torch.int32
    for proj in ("gate_up", "down"):
        w = unpack(ours.packed(proj))
        dq = [_dequant(q) for q in w] if isinstance(w, list) else list(_dequant(w))
        for e, layer in enumerate(weights):
            if proj == "down":
                expected, bias = _dequant(layer["down_proj"][0]), layer["down_proj"][1].float()
            else:
                expected = torch.stack((_dequant(layer["gate_proj"][0]), _dequant(layer["up_proj"][0])), 1)
                expected = expected.reshape(2 * I_CK, H_CK)
                bias = torch.stack((layer["gate_proj"][1], layer["up_proj"][1]), 1).reshape(-1).float()
            assert torch.equal(dq[e], expected), (proj, e)
            assert torch.equal(getattr(ours, proj + "_bias")[e], bias)
    # and it runs: the module's forward against the same arithmetic on the dequantized weights
    x = torch.randn(5, H_CK).to(torch.bfloat16)
    ids = torch.tensor([[0, 2], [1, 0], [2, 1], [0, 1], [2, 0]])
    weights_ = torch.full((5, 2), 0.5, dtype=torch.bfloat16)
    assert torch.isfinite(ours(x, ids, weights_)).all()


def _ct_checkpoint(weights):
    tensors, formats = {}, set()
    for i, layer in enumerate(weights):
        for proj, (q, bias) in layer.items():
            t, fmt, args = checkpoints.to_compressed_tensors(q)
            formats.add((fmt, json.dumps(args, sort_keys=True)))
            tensors.update({f"mlp.experts.{i}.{proj}.{k}": v for k, v in t.items()})
            tensors[f"mlp.experts.{i}.{proj}.bias"] = bias
    (fmt, args), = formats
    config = {"quant_method": "compressed-tensors", "format": fmt, "ignore": [],
              "config_groups": {"group_0": {"targets": ["Linear"], "weights": json.loads(args), "format": fmt}}}
    return tensors, config


@pytest.mark.parametrize("fmt", FORMAT_NAMES)
def test_experts_from_compressed_tensors(fmt):
    """Per-expert compressed-tensors layers (``experts.<i>.{gate,up,down}_proj.weight_packed`` /
    ``weight`` + scales) load into MoEExperts: packed bytes, no bf16 expert, exactly the stored values."""
    weights = _expert_weights(fmt)
    tensors, config = _ct_checkpoint(weights)
    model = tilemm.load_quantized(_experts_model(), tensors, convention="compressed-tensors",
                                  quantization_config=config)
    # the stored values (NVFP4: the per-tensor scale travels as its encode reciprocal)
    stored = [{proj: (checkpoints.from_compressed_tensors(*checkpoints.to_compressed_tensors(q)[:2]), b)
               for proj, (q, b) in layer.items()} for layer in weights]
    _check_loaded_experts(model, stored)


def test_experts_from_modelopt_per_expert_and_fused():
    """ModelOpt NVFP4: per-expert layers (``weight``, ``weight_scale``, ``weight_scale_2``), and the
    fused gpt-oss export (``gate_up_proj`` (E, K/2, N) bytes, ``gate_up_proj_weight_scale`` (E, K/16,
    N), ``_weight_scale_2`` shared or per expert, ``_input_scale`` dropped, ``_bias``)."""
    weights = _expert_weights("nvfp4")
    tensors = {}
    for i, layer in enumerate(weights):
        for proj, (q, bias) in layer.items():
            tensors.update({f"mlp.experts.{i}.{proj}.{k}": v for k, v in checkpoints.to_modelopt(q).items()})
            tensors[f"mlp.experts.{i}.{proj}.input_scale"] = torch.tensor(1.0)
            tensors[f"mlp.experts.{i}.{proj}.bias"] = bias
    config = {"quant_algo": "NVFP4", "exclude_modules": []}
    model = tilemm.load_quantized(_experts_model(), tensors, convention="modelopt", quantization_config=config)
    _check_loaded_experts(model, weights)

    fused = {}
    for proj in ("gate_up_proj", "down_proj"):
        if proj == "gate_up_proj":
            qs = [checkpoints._fuse_gate_up("t", "t", w["gate_proj"][0], w["up_proj"][0]) for w in weights]
            bias = torch.stack([torch.stack((w["gate_proj"][1], w["up_proj"][1]), 1).reshape(-1) for w in weights])
        else:
            qs = [w["down_proj"][0] for w in weights]
            bias = torch.stack([w["down_proj"][1] for w in weights])
        fused[f"mlp.experts.{proj}"] = torch.stack([q.data for q in qs]).transpose(1, 2).contiguous()
        fused[f"mlp.experts.{proj}_weight_scale"] = torch.stack([q.scale for q in qs]).transpose(1, 2).contiguous()
        fused[f"mlp.experts.{proj}_weight_scale_2"] = torch.stack([q.global_scale for q in qs])
        fused[f"mlp.experts.{proj}_input_scale"] = torch.tensor(1.0)
        fused[f"mlp.experts.{proj}_bias"] = bias
    model = tilemm.load_quantized(_experts_model(), fused, convention="modelopt", quantization_config=config)
    _check_loaded_experts(model, weights)


def test_expert_checkpoint_errors():
    """Expert count or shapes that disagree with the model, gate / up NVFP4 scales that cannot share
    one per-tensor scale, FP8 experts: ValueErrors naming the experts block and what differs."""
    fn = "tilemm.load_quantized"
    weights = _expert_weights("mxfp4")
    tensors, config = _ct_checkpoint(weights)
    load = lambda model, t: tilemm.load_quantized(model, t, convention="compressed-tensors",  # noqa: E731
                                                  quantization_config=config)
    with pytest.raises(ValueError, match=rf"{fn}: experts 'mlp.experts': the model has 4 experts, the checkpoint "
                                         r"experts 0 .. 2 \(3 of them\)"):
        load(_experts_model(num_experts=4), tensors)
    with pytest.raises(ValueError, match=r"experts 'mlp.experts': gate_up_proj is \(N, K\) = \(128, 64\) per "
                                         r"expert in the model but \(64, 64\) in the checkpoint"):
        load(_experts_model(inter=64), tensors)
    missing = {k: v for k, v in tensors.items() if not k.startswith("mlp.experts.1.")}
    with pytest.raises(ValueError, match=r"the model has 3 experts, the checkpoint experts 0 .. 2 \(2 of them\)"):
        load(_experts_model(), missing)
    nv, nv_config = _ct_checkpoint(_expert_weights("nvfp4", shared_gate_up_scale=False))
    with pytest.raises(ValueError, match=r"experts 'mlp.experts': expert 0: gate_proj and up_proj have different "
                                         r"NVFP4 per-tensor scales"):
        tilemm.load_quantized(_experts_model(), nv, convention="compressed-tensors", quantization_config=nv_config)
    fp8 = [{proj: (tilemm.quantize_fp8(q.dequantize().float()), b) for proj, (q, b) in w.items()} for w in weights]
    f8, f8_config = _ct_checkpoint(fp8)
    with pytest.raises(ValueError, match=r"expert 0 gate_proj: FP8 experts .* have no grouped-kernel layout"):
        tilemm.load_quantized(_experts_model(), f8, convention="compressed-tensors", quantization_config=f8_config)
