"""Mixture-of-experts layers and models with MXFP4 / NVFP4 experts (``tilemm.moe``) against bf16.

    python benchmarks/bench_moe.py --quick        # the layers: gpt-oss shapes at every T, anchor at T = 1, 2, 4
    python benchmarks/bench_moe.py --layers-only  # every layer shape at every T, both routings, the designs
    python benchmarks/bench_moe.py --e2e          # gpt-oss-20b (bf16 vs MXFP4 experts) and -120b decode steps
    python benchmarks/bench_moe.py --profile      # per-kernel GPU time of the layers at T = 1 and 16

Layers: one MoE block (gate_up, gating, down, the router's weights applied) at T = 1 .. 1024 tokens,
routing "uniform" or "skewed" (expert e with probability ~ 1 / (e + 1)^1.2): gpt-oss-20b (hidden and
intermediate 2880, 32 experts, top-4, MXFP4, biases, clamped SwiGLU), gpt-oss-120b (128 experts), and
the anchor (Qwen3-MoE-style: hidden 2048, intermediate 512, 256 experts, top-8, NVFP4 and MXFP4, SiLU,
no biases) at the published figures' T = 1, 2, 4. Random packed expert weights are made on the GPU;
the bf16 baselines get them exactly dequantized: ``hf``, transformers' module (``GptOssExperts``,
``Qwen3MoeExperts``) as a model from the config selects it, and ``grouped``, ``torch._grouped_mm`` over
tokens sorted by expert. Each variant is checked against the fp32 layer on the same weights (tilemm,
which rounds to bf16 after gate_up, the gating and down, within 1e-2 relative; the baselines' errors
recorded), then timed by ``benchmarks/_timing.py``'s timer: CUDA-graph replays (eager where none
captures, as the results say), L2 flushed, median.

End to end: gpt-oss's decoder (``DecodeModel``, random weights, bf16 attention, router and unembedding),
one decode step in a CUDA graph replayed ``--tokens`` times back to back; tokens/s = batch / step time.
gpt-oss-20b-shaped at batch 1, MXFP4 experts against the same experts in bf16; gpt-oss-120b-shaped,
MXFP4 experts only (bf16 ones would take about 234 GB), batch 1 and 8, with the peak GPU memory.

Results: ``moe[-<mode>]-<gpu>.json`` and ``.md`` in ``--out-dir``, else ``$OUT``, else
``benchmarks/results/`` (``benchmarks/_results.py``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import pathlib
import shlex
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import tilemm  # noqa: E402
from tilemm.moe import MoEExperts  # noqa: E402
from tilemm.kernels.moe_kernels import SWIGLU_ALPHA, SWIGLU_LIMIT  # noqa: E402
from tilemm.packed import PackedWeight, expert, layout_of, unpack  # noqa: E402
from tilemm.reference import decode_scales  # noqa: E402
from _results import add_options, results_path  # noqa: E402

SEED = 0

#: (name, hidden, intermediate, experts, top_k, formats, activation): "gpt-oss" layers have biases,
#: "silu" ones none.
LAYERS = [("gpt-oss-20b", 2880, 2880, 32, 4, ("mxfp4",), "gpt-oss"),
          ("gpt-oss-120b", 2880, 2880, 128, 4, ("mxfp4",), "gpt-oss"),
          ("qwen-a3b-anchor", 2048, 512, 256, 8, ("nvfp4", "mxfp4"), "silu")]
#: ``--cpu-smoke``'s layers: tiny shapes of both gatings.
SMOKE_LAYERS = [("tiny", 256, 256, 8, 2, ("mxfp4", "nvfp4"), "gpt-oss"),
                ("tiny-silu", 256, 128, 8, 2, ("nvfp4",), "silu")]
TOKENS = (1, 4, 16, 64, 256, 1024)
#: The anchor shape's tokens: the published figures' 1, 2, 4 (``--quick``), then TOKENS' larger ones.
ANCHOR_TOKENS = (1, 2, 4)


def tokens_for(layer: str, quick: bool) -> tuple:
    """The T of one layer shape: gpt-oss's TOKENS always; the anchor's ANCHOR_TOKENS, and with
    ``--layers-only`` TOKENS' larger ones too."""
    if layer.startswith("gpt-oss"):
        return TOKENS
    return ANCHOR_TOKENS if quick else ANCHOR_TOKENS + tuple(t for t in TOKENS if t > ANCHOR_TOKENS[-1])

ROUTINGS = ("uniform", "skewed")
#: Targets of the MXFP4 layer over the fastest bf16 baseline (gpt-oss shapes), by T.
TARGETS = {1: 2.5, 4: 2.5, 16: 2.5, 64: 1.5, 256: 1.0, 1024: 1.0}
#: The published anchor (cuTile NVFP4 W4A16 fused MoE, H100 NVL), microseconds by T.
ANCHOR_US = {1: 93.5, 2: 98.8, 4: 116.6}

GPT_OSS_20B = dict(hidden_size=2880, intermediate_size=2880, num_hidden_layers=24, num_attention_heads=64,
                   num_key_value_heads=8, head_dim=64, num_local_experts=32, num_experts_per_tok=4,
                   vocab_size=201088, sliding_window=128)
GPT_OSS_120B = dict(GPT_OSS_20B, num_hidden_layers=36, num_local_experts=128)
TINY = dict(hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=2, vocab_size=128,
            sliding_window=8, max_position_embeddings=128)


def log(msg: str, t0: float) -> None:
    print(f"[{time.time() - t0:7.1f} s] {msg}", flush=True)


# ------------------------------------------------------------------------------------------ weights

def random_packed(fmt_name: str, e: int, n: int, k: int, device, seed: int) -> PackedWeight:
    """A stacked (E, N, K) packed weight of random element codes and scale bytes, made directly in the
    packed layout on ``device`` (with a generator there: gpt-oss-120b's experts are 61 GB): MX scales
    2^-9 .. 2^-5, NVFP4 e4m3 scales 2^-3 .. 2^1 with a per-tensor decode scale 1/64; the exponent and
    constants as ``prepack`` sets them."""
    fmt = {"mxfp4": tilemm.MXFP4, "nvfp4": tilemm.NVFP4, "mxfp8": tilemm.MXFP8_E4M3}[fmt_name]
    layout = layout_of(fmt)
    gen = torch.Generator(device=device).manual_seed(seed)
    words = torch.zeros((e, n, -(-k // layout.tile_k) * layout.words_per_tile), dtype=torch.int32, device=device)
    words[..., :k // layout.elements_per_word] = torch.randint(  # (words past K, if any, stay zero)
        -2 ** 31, 2 ** 31, (e, n, k // layout.elements_per_word), dtype=torch.int64, generator=gen,
        device=device).to(torch.int32)
    if fmt.element == "e4m3" and not fmt.is_packed:  # no NaN codes (0x7F / 0xFF in any byte)
        words &= 0x7E7E7E7E
    lo, hi = (118, 123) if fmt.is_mx else (0x28, 0x48)
    scale_t = torch.randint(lo, hi, (e, k // fmt.block, n), dtype=torch.uint8, generator=gen, device=device)
    top = float(decode_scales(fmt, scale_t.view(fmt.scale_dtype)).max())
    exponent = max(0, math.floor(math.log2(top)) + layout.offset - 127)
    gs = torch.full((e,), 1 / 64, dtype=torch.float32) if fmt.has_global_scale else None
    alpha = torch.full((e,), 2.0 ** exponent) * (gs if gs is not None else 1.0)
    constants = torch.stack((alpha, torch.full((e,), 2.0 ** (layout.offset - exponent))), dim=1)
    return PackedWeight(fmt=fmt, words=words, scale_t=scale_t, constants=constants.contiguous().to(device),
                        exponent=exponent, in_features=k, global_scale=None if gs is None else gs.to(device),
                        alpha_host=float(alpha[0]))


def dequantized(packed: PackedWeight) -> torch.Tensor:
    """The stacked weight (E, N, K) in bf16, exactly (expert by expert, to bound the fp32 temporaries)."""
    out = torch.empty(packed.shape, dtype=torch.bfloat16, device=packed.device)
    for e in range(packed.num_experts):
        out[e] = unpack(expert(packed, e)).dequantize().to(torch.bfloat16)
    return out


def routing(kind: str, t: int, e: int, k: int, device, gen: torch.Generator):
    """(ids (T, k) int64, weights (T, k) bf16: softmax of random logits)."""
    if kind == "uniform":
        ids = torch.rand(t, e, generator=gen).topk(k, dim=-1).indices
    else:
        p = 1.0 / (torch.arange(e, dtype=torch.float64) + 1) ** 1.2
        ids = torch.multinomial(p.expand(t, e), k, replacement=False, generator=gen)
    weights = torch.softmax(torch.randn(t, k, generator=gen), dim=-1).to(torch.bfloat16)
    return ids.to(device), weights.to(device)


# ----------------------------------------------------------------------------------- bf16 baselines

def _gpt_oss_glu(gate_up, alpha=1.702, limit=7.0):
    gate, up = gate_up[..., ::2], gate_up[..., 1::2]
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def _silu_glu(gate_up):
    """SiLU gating of interleaved gate / up columns (bf16 in, bf16 out, as a bf16 model computes it)."""
    return torch.nn.functional.silu(gate_up[..., ::2]) * gate_up[..., 1::2]


class GroupedBF16Experts(torch.nn.Module):
    """bf16 experts, grouped: the (token, slot) rows sorted by expert and one ``torch._grouped_mm``
    per projection (no host synchronisation); without ``_grouped_mm`` (or on the CPU), the chosen
    experts' weights gathered (T * k of them) and ``torch.bmm``. Weights in gpt-oss's layout
    (x @ W): gate_up (E, H, 2I) with gate / up columns interleaved, down (E, I, H); the gating
    gpt-oss's SwiGLU or SiLU (``activation``)."""

    def __init__(self, gate_up, gate_up_bias, down, down_bias, alpha=1.702, limit=7.0, activation="gpt-oss"):
        super().__init__()
        self.gate_up, self.down = gate_up, down
        self.gate_up_bias, self.down_bias = gate_up_bias, down_bias  # (E, N) or None
        self.alpha, self.limit, self.activation = alpha, limit, activation
        self.grouped = hasattr(torch, "_grouped_mm") and gate_up.is_cuda

    def _project(self, rows, w, bias, expert_of_row, offsets):
        if self.grouped:
            out = torch._grouped_mm(rows, w, offs=offsets)
        else:
            out = torch.bmm(rows.unsqueeze(1), w[expert_of_row]).squeeze(1)
        return out if bias is None else out + bias[expert_of_row].to(out.dtype)

    def forward(self, hidden_states, router_indices, routing_weights):
        t, k = router_indices.shape
        flat = router_indices.reshape(-1)
        order = torch.argsort(flat, stable=True)
        expert_of_row = flat[order]
        offsets = torch.searchsorted(expert_of_row, torch.arange(1, self.gate_up.shape[0] + 1,
                                                                 device=flat.device)).to(torch.int32)
        rows = hidden_states[order // k]
        gate_up = self._project(rows, self.gate_up, self.gate_up_bias, expert_of_row, offsets)
        h = _silu_glu(gate_up) if self.activation == "silu" else _gpt_oss_glu(gate_up, self.alpha, self.limit)
        y = self._project(h, self.down, self.down_bias, expert_of_row, offsets)
        y = y * routing_weights.reshape(-1)[order, None].to(y.dtype)
        out = torch.zeros_like(hidden_states)
        return out.index_add_(0, order // k, y)


def reference_layer(x, ids, weights, gate_up, gate_up_bias, down, down_bias, alpha=1.702, limit=7.0,
                    activation="gpt-oss"):
    """The layer in fp32 on the exact (bf16) weights, expert by expert (a host loop: the oracle, not
    timed). Weights in gpt-oss's layout (``GroupedBF16Experts``')."""
    t, k = ids.shape
    out = torch.zeros(t, down.shape[2], dtype=torch.float32, device=x.device)
    for e in torch.unique(ids).tolist():
        tok, slot = (ids == e).nonzero(as_tuple=True)
        gu = x[tok].float() @ gate_up[e].float()
        if gate_up_bias is not None:
            gu = gu + gate_up_bias[e].float()
        if activation == "silu":
            h = torch.nn.functional.silu(gu[:, ::2]) * gu[:, 1::2]
        else:
            g, u = gu[:, ::2].clamp(max=limit), gu[:, 1::2].clamp(-limit, limit)
            h = (u + 1) * (g * torch.sigmoid(g * alpha))
        y = h @ down[e].float()
        if down_bias is not None:
            y = y + down_bias[e].float()
        out.index_add_(0, tok, y * weights[tok, slot, None].float())
    return out


def hf_experts_implementation() -> str | None:
    """The experts implementation a transformers model selects when none is asked for (``None``
    where the installed transformers has no ``ExpertsInterface``): ``"grouped_mm"`` where it is
    registered and PyTorch has ``torch._grouped_mm`` (what ``get_correct_experts_implementation``
    picks), else ``"eager"``."""
    try:
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    except ImportError:
        return None
    return "grouped_mm" if "grouped_mm" in ALL_EXPERTS_FUNCTIONS and hasattr(torch, "_grouped_mm") else "eager"


def hf_experts(config_kw: dict, gate_up, gate_up_bias, down, down_bias, activation="gpt-oss"):
    """transformers' experts module holding the given bf16 weights (gpt-oss's layout: (E, H, 2I) with
    gate / up columns interleaved, (E, I, H)), with the experts implementation a model built from
    the config would give it (``hf_experts_implementation``; a standalone module would otherwise run
    with none set): ``GptOssExperts``, or for ``activation`` "silu" ``Qwen3MoeExperts`` (no biases;
    its layout (E, 2I, H) with gate / up halves, (E, H, I))."""
    if activation == "silu":
        from transformers import Qwen3MoeConfig
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

        cfg = Qwen3MoeConfig(hidden_size=config_kw["hidden_size"], moe_intermediate_size=config_kw["intermediate_size"],
                             num_experts=config_kw["num_local_experts"],
                             num_experts_per_tok=config_kw["num_experts_per_tok"], hidden_act="silu")
        experts_class = Qwen3MoeExperts
    else:
        from transformers import GptOssConfig
        from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

        cfg = GptOssConfig(**config_kw)
        experts_class = GptOssExperts
    impl = hf_experts_implementation()
    if impl is not None:
        try:
            cfg._experts_implementation = impl
        except Exception:  # noqa: BLE001 (then the module's own default; the records say which ran)
            pass
    with torch.device("meta"):
        module = experts_class(cfg)
    e, two_i, hidden = gate_up.shape[0], gate_up.shape[2], gate_up.shape[1]
    if activation == "silu":
        halves = torch.cat((gate_up[..., 0::2], gate_up[..., 1::2]), dim=2).transpose(1, 2).contiguous()
        module.gate_up_proj = torch.nn.Parameter(halves, requires_grad=False)
        module.down_proj = torch.nn.Parameter(down.transpose(1, 2).contiguous(), requires_grad=False)
        return module
    module.gate_up_proj = torch.nn.Parameter(gate_up, requires_grad=False)
    module.down_proj = torch.nn.Parameter(down, requires_grad=False)
    zeros = lambda n: torch.zeros(e, n, dtype=torch.bfloat16, device=gate_up.device)  # noqa: E731
    module.gate_up_proj_bias = torch.nn.Parameter(
        gate_up_bias.to(torch.bfloat16) if gate_up_bias is not None else zeros(two_i), requires_grad=False)
    module.down_proj_bias = torch.nn.Parameter(
        down_bias.to(torch.bfloat16) if down_bias is not None else zeros(hidden), requires_grad=False)
    return module


# ------------------------------------------------------------------------------------- alternatives

#: Structurally different launches of the same layer, timed next to the chosen one at T <= 16:
#: "pairs_combine" / "pairs_bmm": no routing, one block per ((token, slot) pair, N tile) on the FMA
#: pipes, the weighted sum in the down launch (a block per (token, N tile) running the token's k
#: experts in turn) or as a batched GEMM (the default at T = 1 picks one: ``moe_kernels.plan``; at
#: larger T an expert shared by several tokens is read once per token); "sorted": the routing, x's
#: rows sorted by expert, one block per (active expert, N tile) on the tensor cores (the default
#: from T = 2); "all_experts": the sorted design with a block per (expert, N tile) for every expert
#: (the empty ones exit at once) instead of the active experts first; "unfused": the sorted design
#: with the gate_up products written out and gpt-oss's SwiGLU as PyTorch operations, instead of the
#: fused epilogue; "full_grid": the sorted design with one block per work item (as many chunk
#: groups as the shapes allow, those past the busiest expert's chunks exiting at once) instead of the
#: persistent grid (``moe_kernels.grid_blocks``), timed at every T >= 2 (``--quick`` included).
DESIGNS = ("pairs_combine", "pairs_bmm", "sorted", "all_experts", "unfused", "full_grid")
DESIGN_MAX_T = 16


def designs_for(t: int, pairs_default: bool, quick: bool = False) -> tuple:
    """The DESIGNS to time at T = ``t``, where the default is the per-pair design or not
    (``pairs_default``, ``moe_kernels.plan``): the sorted one only where it is not the default,
    full_grid where it is; the others only at T <= DESIGN_MAX_T and not with ``quick``."""
    out = []
    for d in DESIGNS:
        if d == "full_grid":
            if not pairs_default:
                out.append(d)
        elif not quick and t <= DESIGN_MAX_T and (d != "sorted" or pairs_default):
            out.append(d)
    return tuple(out)


def pairs_default(t: int, k: int, experts) -> bool:
    """Whether the MoEExperts module ``experts`` takes the per-pair design at T = ``t``, top-``k``."""
    from tilemm.kernels import moe_kernels as mk

    gu, dn = experts.packed("gate_up"), experts.packed("down")
    expert_bytes = mk.expert_bytes(gu.words, gu.scale_t, dn.words, dn.scale_t)
    return mk.plan(t, k, gu.words.shape[0], gu.shape[1], gu.shape[2], gu.layout, expert_bytes).design == "pairs"


def designed(ours: MoEExperts, design: str):
    """``ours``'s forward with one design choice changed (the same numbers but for the gating's exp)."""
    from tilemm.kernels import moe_kernels as mk
    from tilemm.moe import _weighted_sum, gpt_oss_glu, silu_glu

    from tilemm.moe import _experts_launches

    gu, dn = ours.packed("gate_up"), ours.packed("down")
    every = torch.arange(ours.num_experts + 1, device=gu.device)
    if design.startswith("pairs") or design == "sorted":
        def launches(x, ids, weights):
            return _experts_launches(x, ids, weights, gu.words, gu.scale_t, gu.constants, gu.fmt.name,
                                     ours.gate_up_bias, dn.words, dn.scale_t, dn.constants, dn.fmt.name,
                                     ours.down_bias, ours.alpha, ours.limit, design=design,
                                     activation=ours.activation)

        return launches

    def forward(x, ids, weights):
        t, k = ids.shape
        order, offsets, slots, longest = mk.route(ids, ours.num_experts)
        routed = (order, offsets, every if design == "all_experts" else slots, longest)
        blocks = 2 ** 31 - 1 if design == "full_grid" else None  # (the launcher clamps it to the items)
        xs = mk.sort_rows(x, routed, k)
        h = torch.empty(t * k, ours.intermediate_size, dtype=x.dtype, device=x.device)
        if design == "unfused":
            gate_up = torch.empty(t * k, 2 * ours.intermediate_size, dtype=x.dtype, device=x.device)
            mk.launch(xs, gu.words, gu.scale_t, gu.constants, ours.gate_up_bias, routed, t, gate_up, gu.layout,
                      sorted_out=1)
            h = (silu_glu(gate_up, interleaved=True) if ours.activation == "silu"
                 else gpt_oss_glu(gate_up, ours.alpha, ours.limit))
        else:
            act = mk.ACT_SILU if ours.activation == "silu" else mk.ACT_GPT_OSS
            mk.launch(xs, gu.words, gu.scale_t, gu.constants, ours.gate_up_bias, routed, t, h, gu.layout, act=act,
                      blocks=blocks)
        y = torch.empty(t * k, ours.hidden_size, dtype=x.dtype, device=x.device)
        mk.launch(h, dn.words, dn.scale_t, dn.constants, ours.down_bias, routed, t, y, dn.layout, blocks=blocks)
        return _weighted_sum(y.reshape(t, k, ours.hidden_size), weights)

    return forward


# ------------------------------------------------------------------------------------------- layers

def rel_err(a, b) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def bench_layers(args, device, timer, t0) -> list[dict]:
    records = []
    layers = SMOKE_LAYERS if args.cpu_smoke else LAYERS
    for name, hidden, inter, e, k, formats, activation in layers:
        biases = activation == "gpt-oss"
        tokens = (1, 3, 5) if args.cpu_smoke else args.ts or tokens_for(name, args.quick)
        gen = torch.Generator().manual_seed(SEED)
        gub = torch.randn(e, 2 * inter, generator=gen).to(device) * 0.1 if biases else None
        db = torch.randn(e, hidden, generator=gen).to(device) * 0.1 if biases else None
        for fmt in formats:
            gate_up = random_packed(fmt, e, 2 * inter, hidden, device, seed=SEED + 1)
            down = random_packed(fmt, e, hidden, inter, device, seed=SEED + 2)
            ours = MoEExperts(gate_up, down, gub, db, activation=activation)  # (random rows: either layout)
            # gpt-oss's layout (E, K, N), made once (the grouped GEMM and its module share it)
            w_gu = dequantized(gate_up).transpose(1, 2).contiguous()
            w_d = dequantized(down).transpose(1, 2).contiguous()
            grouped = GroupedBF16Experts(w_gu, gub, w_d, db, activation=activation)
            cfg_kw = dict(hidden_size=hidden, intermediate_size=inter, num_local_experts=e,
                          num_experts_per_tok=k)
            hf = hf_experts(cfg_kw, w_gu, gub, w_d, db, activation)
            weight_mb = sum(t.numel() * t.element_size() for t in (gate_up.words, gate_up.scale_t,
                                                                   down.words, down.scale_t)) / 2 ** 20
            hf_impl = getattr(getattr(hf, "config", None), "_experts_implementation", None)
            log(f"{name} {fmt} ({activation}): E={e} top-{k}, packed experts {weight_mb:.0f} MiB; hf experts "
                f"implementation {hf_impl}", t0)
            for routing_kind in ROUTINGS:
                for t in tokens:
                    ids, weights = routing(routing_kind, t, e, k, device, gen)
                    x = (torch.randn(t, hidden, generator=gen) * 0.5).to(torch.bfloat16).to(device)
                    ref = reference_layer(x, ids, weights, w_gu, gub, w_d, db, activation=activation)
                    err = rel_err(ours(x, ids, weights), ref)
                    can_group = grouped.grouped or t * k <= 64
                    rec = {"layer": name, "format": fmt, "routing": routing_kind, "T": t, "E": e, "top_k": k,
                           "hidden": hidden, "intermediate": inter, "activation": activation, "rel_err": err,
                           "hf_impl": getattr(getattr(hf, "config", None), "_experts_implementation", None)}
                    for bname, module in (("hf", hf), ("grouped", grouped if can_group else None)):
                        if module is None:
                            continue
                        try:  # a baseline that fails is recorded, the run goes on
                            rec[f"{bname}_rel_err"] = rel_err(module(x, ids, weights), ref)
                        except Exception as err_:  # noqa: BLE001
                            rec[f"{bname}_error"] = f"{type(err_).__name__}: {err_}"[:300]
                            can_group = can_group and bname != "grouped"
                    if not err < 1e-2:
                        rec["error"] = f"correctness: relative error {err:.3g} >= 1e-2; not timed"
                        records.append(rec)
                        log(f"  {routing_kind:7s} T={t:5d} FAILED correctness ({err:.3g})", t0)
                        continue
                    if timer is not None:
                        variants = {"tilemm": lambda: ours(x, ids, weights)}
                        if "hf_error" not in rec:
                            variants["hf"] = lambda: hf(x, ids, weights)
                        if can_group:
                            variants["grouped"] = lambda: grouped(x, ids, weights)
                        # the alternative designs (--quick: full_grid only; --profile times the others)
                        for design in designs_for(t, pairs_default(t, k, ours), args.quick):
                            try:  # a design that fails or is wrong is recorded, not timed
                                fwd = designed(ours, design)
                                rec[f"{design}_rel_err"] = d_err = rel_err(fwd(x, ids, weights), ref)
                                if not d_err < 1e-2:
                                    raise ValueError(f"relative error {d_err:.3g} >= 1e-2")
                            except Exception as err_:  # noqa: BLE001
                                rec[f"{design}_error"] = f"{type(err_).__name__}: {err_}"[:300]
                                log(f"  design {design} T={t}: {rec[f'{design}_error']}", t0)
                                continue
                            variants[design] = (lambda f: lambda: f(x, ids, weights))(fwd)
                        for vname, fn in variants.items():
                            try:
                                ms, how = timer(fn)
                                rec[f"{vname}_us"], rec[f"{vname}_how"] = ms * 1e3, how
                            except Exception as err_:  # noqa: BLE001 (record and go on)
                                rec[f"{vname}_error"] = f"{type(err_).__name__}: {err_}"[:300]
                        base = [rec[f"{b}_us"] for b in ("hf", "grouped") if f"{b}_us" in rec]
                        if base and "tilemm_us" in rec:
                            rec["speedup"] = min(base) / rec["tilemm_us"]
                        log(f"  {routing_kind:7s} T={t:5d} tilemm {rec.get('tilemm_us', float('nan')):9.1f} us"
                            f"  hf {rec.get('hf_us', float('nan')):9.1f} us ({rec.get('hf_how', '-')})"
                            f"  grouped {rec.get('grouped_us', float('nan')):9.1f} us"
                            f"  x{rec.get('speedup', float('nan')):.2f}  err {err:.1e}"
                            + "".join(f"  {d} {rec[d + '_us']:.1f}" for d in DESIGNS if d + "_us" in rec), t0)
                    records.append(rec)
            del ours, grouped, hf, w_gu, w_d, gate_up, down
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return records


# ---------------------------------------------------------------------------------------- profile

#: ``--profile``: these layers (name, format) at these T, uniform routing.
PROFILE_LAYERS = (("gpt-oss-20b", "mxfp4", ("uniform",)), ("gpt-oss-120b", "mxfp4", ("uniform", "skewed")),
                  ("qwen-a3b-anchor", "nvfp4", ("uniform",)))
PROFILE_TOKENS = (1, 16)
PROFILE_CALLS = 5
#: The designs profiled next to the default (the structurally different ones; each is a few more JIT
#: compiles).
PROFILE_DESIGNS = ("pairs_combine", "pairs_bmm", "sorted", "full_grid")


def kernel_table(fn, calls: int, device) -> list[tuple[str, float, float]]:
    """(kernel name, GPU time in us per call, launches per call) of ``calls`` calls of ``fn`` under
    torch.profiler (after one warm-up call), slowest first; on the CPU, the CPU operators instead."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        for _ in range(calls):
            fn()
        if cuda:
            torch.cuda.synchronize()
    totals: dict = {}
    for ev in prof.events():
        if (ev.device_type.name == "CUDA") != cuda:
            continue
        if not cuda and ev.cpu_parent is not None:  # CPU: top-level operators only
            continue
        us, n = totals.get(ev.name, (0.0, 0))
        totals[ev.name] = (us + ev.time_range.elapsed_us(), n + 1)
    rows = [(name, us / calls, n / calls) for name, (us, n) in totals.items()]
    return sorted(rows, key=lambda r: -r[1])


def profile_layers(args, device, timer, t0) -> list[dict]:
    """Per-kernel GPU time of one layer (tilemm, its alternative designs and the grouped bf16
    baseline) at T in PROFILE_TOKENS: where the time of a layer goes. Printed, and returned."""
    out = []
    layers = {(n, f): (n, h, i, e, k, a) for n, h, i, e, k, fs, a in LAYERS for f in fs}
    todo = [(layers[(n, f)], f, r) for n, f, r in PROFILE_LAYERS]
    tokens = args.ts or PROFILE_TOKENS
    if args.cpu_smoke:
        todo, tokens = [((n, h, i, e, k, a), fs[0], ("uniform",)) for n, h, i, e, k, fs, a in SMOKE_LAYERS], (1,)
    for (name, hidden, inter, e, k, activation), fmt, routings in todo:
        biases = activation == "gpt-oss"
        gen = torch.Generator().manual_seed(SEED)
        gub = torch.randn(e, 2 * inter, generator=gen).to(device) * 0.1 if biases else None
        db = torch.randn(e, hidden, generator=gen).to(device) * 0.1 if biases else None
        gate_up = random_packed(fmt, e, 2 * inter, hidden, device, seed=SEED + 1)
        down = random_packed(fmt, e, hidden, inter, device, seed=SEED + 2)
        ours = MoEExperts(gate_up, down, gub, db, activation=activation)
        grouped = GroupedBF16Experts(dequantized(gate_up).transpose(1, 2).contiguous(), gub,
                                     dequantized(down).transpose(1, 2).contiguous(), db, activation=activation)
        for routing_kind, t in [(r, t) for r in routings for t in tokens]:
            ids, weights = routing(routing_kind, t, e, k, device, gen)
            x = (torch.randn(t, hidden, generator=gen) * 0.5).to(torch.bfloat16).to(device)
            variants = {"tilemm": lambda: ours(x, ids, weights), "grouped": lambda: grouped(x, ids, weights)}
            for design in designs_for(t, pairs_default(t, k, ours)) if device.type == "cuda" else ():  # (the designs launch the kernel)
                if design not in PROFILE_DESIGNS:
                    continue
                variants[design] = (lambda f: lambda: f(x, ids, weights))(designed(ours, design))
            for vname, fn in variants.items():
                rec = {"layer": name, "format": fmt, "routing": routing_kind, "T": t, "variant": vname}
                try:
                    if timer is not None:
                        ms, how = timer(fn)
                        rec["layer_us"], rec["how"] = ms * 1e3, how
                    rec["kernels"] = kernel_table(fn, PROFILE_CALLS, device)
                except Exception as err:  # noqa: BLE001 (record and go on)
                    rec["error"] = f"{type(err).__name__}: {err}"[:300]
                    log(f"{name} {fmt} T={t} {vname}: {rec['error']}", t0)
                    out.append(rec)
                    continue
                total = sum(us for _, us, _ in rec["kernels"])
                launches = sum(n for *_, n in rec["kernels"])
                log(f"{name} {fmt} {routing_kind} T={t} {vname}: layer {_f(rec.get('layer_us'), '.1f')} us "
                    f"({rec.get('how', '-')}); kernels {total:.1f} us in {launches:.0f} launches:", t0)
                for kname, us, n in rec["kernels"]:
                    print(f"    {us:8.1f} us  x{n:<4.1f} {kname[:110]}", flush=True)
                out.append(rec)
        del ours, grouped, gate_up, down
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return out


# --------------------------------------------------------------------------------------- end to end

class DecodeModel(torch.nn.Module):
    """gpt-oss's decoder for one token per sequence per step, built from a transformers
    ``GptOssConfig`` with random bf16 weights made on the device, the experts blocks given.

    What a step computes, per layer: RMSNorm, attention (q / k / v / o projections with biases,
    rotary embedding at the step's position, grouped-query attention over a static KV cache, sliding
    window on the config's ``sliding_attention`` layers, one learned sink logit per head in the
    softmax), the residual; RMSNorm, the router (a biased linear map to E logits, top-k, softmax of
    the k logits), the experts block (``experts[i](x, ids, weights)``), the residual; then the final
    RMSNorm, the unembedding and the greedy next token. The rotary embedding is plain RoPE with the
    config's theta (gpt-oss's YaRN scaling changes the angles, not the work). Everything reads and
    writes static tensors (the tokens, the position, the cache), with no host synchronisation, so a
    step is captured in one CUDA graph and replayed."""

    def __init__(self, config, experts: list, batch: int, max_len: int, device, seed: int = SEED):
        super().__init__()
        c = config
        self.h, self.nh, self.nkv, self.hd = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.k, self.eps, self.window = c.num_experts_per_tok, c.rms_norm_eps, c.sliding_window
        layers = c.num_hidden_layers
        self.sliding = [t == "sliding_attention" for t in c.layer_types[:layers]]
        theta = (getattr(c, "rope_parameters", None) or {}).get("rope_theta", getattr(c, "rope_theta", 150000.0))
        gen = torch.Generator(device=device).manual_seed(seed)
        bf16 = dict(dtype=torch.bfloat16, device=device)

        def rand(*shape, std=0.02):
            return torch.randn(*shape, generator=gen, **bf16) * std

        q, kv = self.nh * self.hd, self.nkv * self.hd
        self.embed = rand(c.vocab_size, self.h, std=1.0)
        self.lm_head = rand(c.vocab_size, self.h)
        self.norm = torch.ones(self.h, **bf16)
        self.attn = [dict(ln=torch.ones(self.h, **bf16), qkv=rand(q + 2 * kv, self.h), qkv_b=rand(q + 2 * kv),
                          o=rand(self.h, q), o_b=rand(self.h), sinks=rand(self.nh, std=1.0),
                          ln2=torch.ones(self.h, **bf16), router=rand(c.num_local_experts, self.h),
                          router_b=rand(c.num_local_experts)) for _ in range(layers)]
        self.experts = torch.nn.ModuleList(experts)
        self.k_cache = torch.zeros(layers, batch, self.nkv, max_len, self.hd, **bf16)
        self.v_cache = torch.zeros_like(self.k_cache)
        self.inv_freq = 1.0 / theta ** (torch.arange(0, self.hd, 2, device=device, dtype=torch.float32) / self.hd)
        self.slots = torch.arange(max_len, device=device)
        self.ids = torch.zeros(batch, dtype=torch.long, device=device)
        self.pos = torch.zeros(1, dtype=torch.long, device=device)
        self.logits = None

    def _rms(self, x, w):
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * w

    def _rope(self, t, cos, sin):  # t (B, heads, hd): the halves rotated
        a, b = t[..., : self.hd // 2], t[..., self.hd // 2:]
        return torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1)

    def _attention(self, i, x, cos, sin, allowed):
        p = self.attn[i]
        bsz = x.shape[0]
        qkv = torch.nn.functional.linear(x, p["qkv"], p["qkv_b"])
        q_, kv = self.nh * self.hd, self.nkv * self.hd
        q = self._rope(qkv[:, :q_].view(bsz, self.nh, self.hd), cos, sin)
        k = self._rope(qkv[:, q_:q_ + kv].view(bsz, self.nkv, self.hd), cos, sin)
        v = qkv[:, q_ + kv:].view(bsz, self.nkv, self.hd)
        self.k_cache[i].index_copy_(2, self.pos, k.unsqueeze(2))
        self.v_cache[i].index_copy_(2, self.pos, v.unsqueeze(2))
        q = q.view(bsz, self.nkv, self.nh // self.nkv, self.hd)
        scores = torch.matmul(q, self.k_cache[i].transpose(-1, -2)).float() * self.hd ** -0.5  # (B, KV, G, L)
        scores = scores.masked_fill(~allowed[i], float("-inf"))
        sinks = p["sinks"].float().view(1, self.nkv, self.nh // self.nkv, 1).expand(bsz, -1, -1, 1)
        probs = torch.softmax(torch.cat((scores, sinks), dim=-1), dim=-1)[..., :-1].to(x.dtype)
        out = torch.matmul(probs, self.v_cache[i]).reshape(bsz, self.nh * self.hd)
        return torch.nn.functional.linear(out, p["o"], p["o_b"])

    def step(self) -> None:
        """One greedy decode step at position ``pos`` for every sequence: logits, next tokens into
        ``ids``, ``pos`` advanced."""
        x = self.embed[self.ids]
        angles = self.pos.float() * self.inv_freq
        cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
        causal = self.slots <= self.pos
        window = causal & (self.slots > self.pos - self.window)
        allowed = [window if s else causal for s in self.sliding]
        for i, experts in enumerate(self.experts):
            x = x + self._attention(i, self._rms(x, self.attn[i]["ln"]), cos, sin, allowed)
            h = self._rms(x, self.attn[i]["ln2"])
            logits = torch.nn.functional.linear(h, self.attn[i]["router"], self.attn[i]["router_b"])
            top, ids = torch.topk(logits, self.k, dim=-1)
            weights = torch.softmax(top.float(), dim=-1).to(h.dtype)
            x = x + experts(h, ids, weights)
        self.logits = torch.nn.functional.linear(self._rms(x, self.norm), self.lm_head)
        self.ids.copy_(self.logits.argmax(-1))
        self.pos.add_(1)

    def weight_bytes(self) -> int:
        tensors = [self.embed, self.lm_head] + [t for p in self.attn for t in p.values()]
        tensors += list(self.experts.buffers()) + [b for m in self.experts for b in vars(m).values()
                                                  if isinstance(b, torch.Tensor)]
        return sum(t.numel() * t.element_size() for t in {id(t): t for t in tensors}.values())


def gpt_oss_config(shape: dict, layers: int):
    from transformers import GptOssConfig

    kw = dict(shape, num_hidden_layers=layers)
    kw["layer_types"] = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    return GptOssConfig(**kw)


def packed_experts(config, layers: int, device, seed: int) -> list:
    """``layers`` MoEExperts of random packed MXFP4 weights of the config's shape, made on the device
    layer by layer (never a bf16 expert), with random fp32 biases."""
    e, h, i = config.num_local_experts, config.hidden_size, config.intermediate_size
    gen = torch.Generator(device=device).manual_seed(seed)
    out = []
    for layer in range(layers):
        out.append(MoEExperts(random_packed("mxfp4", e, 2 * i, h, device, seed=seed + 2 * layer),
                              random_packed("mxfp4", e, h, i, device, seed=seed + 2 * layer + 1),
                              torch.randn(e, 2 * i, generator=gen, device=device) * 0.1,
                              torch.randn(e, h, generator=gen, device=device) * 0.1,
                              alpha=float(getattr(config, "swiglu_alpha", SWIGLU_ALPHA)),
                              limit=float(getattr(config, "swiglu_limit", SWIGLU_LIMIT))))
    return out


def bf16_experts(packed: list) -> list:
    """The same experts in bf16 (exactly dequantized, transformers' (E, K, N) layout) on the grouped
    bf16 module (``torch._grouped_mm``, capturable)."""
    out = []
    for m in packed:
        gu, dn = m.packed("gate_up"), m.packed("down")
        out.append(GroupedBF16Experts(dequantized(gu).transpose(1, 2).contiguous(), m.gate_up_bias,
                                      dequantized(dn).transpose(1, 2).contiguous(), m.down_bias, m.alpha, m.limit))
    return out


#: End to end: the decode position the timed steps start from (the cache before it holds random
#: keys and values: the work of a step does not depend on them), untimed eager steps, graph replays.
E2E_START = 32
E2E_EAGER_STEPS = 3


def _loop_ms(fn, calls: int, device, before=None) -> float:
    """ms per call of ``calls`` calls of ``fn`` back to back, as a decode loop makes them: one interval
    of the shared timer (CUDA events around the whole loop, no L2 flush: each step advances the state,
    so steps are not replayed alike), after one such loop as warm-up; ``before`` runs before the timed
    loop, outside its interval."""
    from _timing import Timer

    ms, _ = Timer(1, device, flush_l2=False, warmup=0, before_each=before)(
        lambda: [fn() for _ in range(calls)], capture=False)
    return ms / calls


def time_decode(model: DecodeModel, steps: int, device, t0, label: str) -> dict:
    """Tokens/s of ``model`` (its batch) over ``steps`` decode steps: eager steps, then one step
    captured in a CUDA graph and replayed ``steps`` times back to back (the graph's own position and
    tokens advance each replay; ``_loop_ms``). On the CPU: one eager step, no timing."""
    batch = model.ids.shape[0]
    start_state(model, device, SEED + batch)
    rec = {"batch": batch}
    if device.type != "cuda":
        model.step()
        rec.update(tokens_per_s=None, how="cpu", finite=bool(model.logits.isfinite().all()))
        return rec
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):  # warm-up: JIT compiles, caches (routing bounds, zero biases)
        for _ in range(E2E_EAGER_STEPS):
            model.step()
    torch.cuda.current_stream(device).wait_stream(side)
    torch.cuda.synchronize(device)
    rec["eager_ms_per_token"] = _loop_ms(model.step, E2E_EAGER_STEPS, device)
    model.pos.fill_(E2E_START)
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            model.step()
    except Exception as err:  # noqa: BLE001 (recorded: the eager figure stands)
        torch.cuda.synchronize(device)
        rec.update(how="eager", graph_error=f"{type(err).__name__}: {err}"[:300],
                   tokens_per_s=batch / rec["eager_ms_per_token"] * 1e3)
        log(f"  {label} batch {batch}: graph capture failed ({rec['graph_error']})", t0)
        return rec
    model.pos.fill_(E2E_START)  # the warm-up loop and the timed one each start here
    ms = _loop_ms(graph.replay, steps, device, before=lambda: model.pos.fill_(E2E_START))
    rec.update(how="graph", ms_per_token=ms, tokens_per_s=batch / ms * 1e3,
               finite=bool(model.logits.isfinite().all()))
    log(f"  {label} batch {batch}: {rec['tokens_per_s']:.1f} tokens/s ({ms:.3f} ms per step in a CUDA graph; "
        f"eager {rec['eager_ms_per_token']:.2f} ms)", t0)
    del graph
    return rec


def start_state(model: DecodeModel, device, seed: int = SEED) -> None:
    """A fixed decode state: random keys and values in the cache, random tokens, position E2E_START."""
    gen = torch.Generator(device=device).manual_seed(seed)
    model.k_cache.normal_(generator=gen)
    model.v_cache.normal_(generator=gen)
    model.ids.copy_(torch.randint(model.embed.shape[0], (model.ids.shape[0],), generator=gen, device=device))
    model.pos.fill_(E2E_START)


def first_step_logits(model: DecodeModel, device) -> torch.Tensor:
    """Logits of one eager step from ``start_state`` (the same for every experts block)."""
    start_state(model, device)
    model.step()
    return model.logits.float()


def bench_e2e(args, device, t0) -> dict:
    """gpt-oss-20b-shaped: bf16 experts against MXFP4 experts (same dequantized weights, the rest the
    same bf16 tensors), batch 1; gpt-oss-120b-shaped: MXFP4 experts, batch 1 and 8, peak memory.
    A model whose run fails is recorded with its error (the other one still runs)."""
    out = {}
    for name, run in (("gpt-oss-20b", _e2e_20b), ("gpt-oss-120b", _e2e_120b)):
        try:
            out[name] = run(args, device, t0)
        except Exception as err:  # noqa: BLE001 (recorded; main's exit status says so)
            out[name] = {"error": f"{type(err).__name__}: {err}"[:500]}
            log(f"{name}: FAILED {out[name]['error']}", t0)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return out


def _e2e_steps(args) -> tuple[int, int]:
    steps = 4 if args.cpu_smoke else args.tokens
    return steps, E2E_START + E2E_EAGER_STEPS * 2 + steps + 8


def _e2e_20b(args, device, t0) -> dict:
    steps, max_len = _e2e_steps(args)
    cuda = device.type == "cuda"
    shape20 = TINY if args.cpu_smoke else GPT_OSS_20B
    config = gpt_oss_config(shape20, shape20["num_hidden_layers"])
    layers = config.num_hidden_layers
    packed = packed_experts(config, layers, device, seed=SEED + 100)
    model = DecodeModel(config, packed, 1, max_len, device)
    rec = {"model": "gpt-oss-20b shape" if not args.cpu_smoke else "tiny gpt-oss", "layers": layers,
           "steps": steps, "weights_gib": model.weight_bytes() / 2 ** 30}
    logits_q = first_step_logits(model, device)
    rec["mxfp4"] = time_decode(model, steps, device, t0, "gpt-oss-20b experts mxfp4")
    model.experts = torch.nn.ModuleList(bf16_experts(packed))  # the same weights in bf16, the rest shared
    del packed
    if cuda:
        torch.cuda.empty_cache()
    rec["bf16_weights_gib"] = model.weight_bytes() / 2 ** 30
    logits_b = first_step_logits(model, device)
    rec["logits_rel_err"] = float((logits_q - logits_b).norm() / logits_b.norm())
    rec["same_greedy_token"] = bool(torch.equal(logits_q.argmax(-1), logits_b.argmax(-1)))
    rec["bf16"] = time_decode(model, steps, device, t0, "gpt-oss-20b bf16")
    if rec["bf16"].get("tokens_per_s") and rec["mxfp4"].get("tokens_per_s"):
        rec["speedup"] = rec["mxfp4"]["tokens_per_s"] / rec["bf16"]["tokens_per_s"]
    log(f"gpt-oss-20b: logits of MXFP4 vs bf16 experts, relative error {rec['logits_rel_err']:.2e}; speed-up "
        f"{_f(rec.get('speedup'), '.2f')}x", t0)
    return rec


def _e2e_120b(args, device, t0) -> dict:
    steps, max_len = _e2e_steps(args)
    cuda = device.type == "cuda"
    shape120 = dict(TINY, num_local_experts=16) if args.cpu_smoke else GPT_OSS_120B
    config = gpt_oss_config(shape120, shape120["num_hidden_layers"])
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    experts = packed_experts(config, config.num_hidden_layers, device, seed=SEED + 200)
    rec = {"model": "gpt-oss-120b shape" if not args.cpu_smoke else "tiny gpt-oss, 16 experts",
           "layers": config.num_hidden_layers, "steps": steps,
           "bf16_experts_gb": config.num_hidden_layers * config.num_local_experts * 3 * config.hidden_size
           * config.intermediate_size * 2 / 1e9}
    for batch in (1, 8):
        model = DecodeModel(config, experts, batch, max_len, device)
        rec.setdefault("weights_gib", model.weight_bytes() / 2 ** 30)
        rec[f"batch{batch}"] = time_decode(model, steps, device, t0, "gpt-oss-120b experts mxfp4")
        del model
        if cuda:
            torch.cuda.empty_cache()
    if cuda:
        rec["peak_gib"] = torch.cuda.max_memory_allocated(device) / 2 ** 30
        rec["gpu_gib"] = torch.cuda.get_device_properties(device).total_memory / 2 ** 30
    log(f"gpt-oss-120b: weights {rec['weights_gib']:.1f} GiB, peak {_f(rec.get('peak_gib'), '.1f')} GiB "
        f"(bf16 experts alone would be {rec['bf16_experts_gb']:.0f} GB)", t0)
    return rec


# ------------------------------------------------------------------------------------------- output

def _f(v, fmt):
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, fmt)


def markdown(meta, layers, e2e) -> str:
    lines = [f"# MoE layers and models: {meta['gpu']}", "",
             f"`{meta['command']}` ({meta['date']}, torch {meta['torch']}, transformers {meta['transformers']}).",
             ] + ([] if not layers else [
             "Times in us per layer (CUDA-graph replays, L2 flushed, median); `hf`: transformers' "
             "GptOssExperts (eager where its loop reads the routing back: marked `*`); `grouped`: bf16 "
             "grouped GEMM; speed-up of tilemm over the faster bf16 baseline. Targets (gpt-oss shapes): "
             ">= 2.5x at T <= 16, 1.5x at 64, 1.0x from 256.", "",
             "| layer | fmt | routing | T | tilemm | hf | grouped | speed-up | target | rel. err tilemm / hf |",
             "|---|---|---|---|---|---|---|---|---|---|"])
    for r in layers:
        target = TARGETS.get(r["T"]) if r["layer"].startswith("gpt-oss") else None
        hf = _f(r.get("hf_us"), ".1f") + ("*" if r.get("hf_how") == "events" else "")
        lines.append(f"| {r['layer']} | {r['format']} | {r['routing']} | {r['T']} | {_f(r.get('tilemm_us'), '.1f')} "
                     f"| {hf} | {_f(r.get('grouped_us'), '.1f')} | {_f(r.get('speedup'), '.2f')} | "
                     f"{_f(target, '.1f')} | {r['rel_err']:.1e} / {_f(r.get('hf_rel_err'), '.1e')} |")
    designs = [r for r in layers if any(f"{d}_us" in r for d in DESIGNS)]
    if designs:
        lines += ["", "Alternative launches of the same layer (us; see ``DESIGNS`` in the script; `-` where the "
                  "design is not timed at that T): pairs_combine / pairs_bmm = no routing, a block per (token, "
                  "slot) pair on the FMA pipes, the weighted sum in the down launch or a batched GEMM; sorted "
                  "= routing, rows sorted by expert, tensor "
                  "cores; all_experts = sorted with a block per (expert, N tile) for every expert; unfused = "
                  "sorted with the SwiGLU outside the kernel; full_grid = the default's sorted launches with one "
                  "block per work item instead of the persistent grid.", "",
                  "| layer | fmt | routing | T | tilemm | " + " | ".join(DESIGNS) + " |",
                  "|---|---|---|---|---|" + "---|" * len(DESIGNS)]
        for r in designs:
            lines.append(f"| {r['layer']} | {r['format']} | {r['routing']} | {r['T']} | "
                         f"{_f(r.get('tilemm_us'), '.1f')} | "
                         + " | ".join(_f(r.get(f"{d}_us"), ".1f") for d in DESIGNS) + " |")
    anchor = [r for r in layers if r["layer"].startswith("qwen") and r["T"] in ANCHOR_US and "tilemm_us" in r]
    if anchor:
        lines += ["", "Anchor (published cuTile NVFP4 W4A16 fused MoE on an H100 NVL: "
                  + ", ".join(f"{v} us at T = {t}" for t, v in ANCHOR_US.items()) + "; target 3x faster):", ""]
        for r in anchor:
            lines.append(f"- {r['format']} {r['routing']} T = {r['T']}: {r['tilemm_us']:.1f} us, "
                         f"{ANCHOR_US[r['T']] / r['tilemm_us']:.1f}x the anchor")
    if e2e:
        lines += ["", "## End to end (greedy decode steps of a gpt-oss-shaped model, random weights, one CUDA "
                  "graph per step)", ""]
        for name, r in e2e.items():
            if "error" in r:
                lines.append(f"- {name}: failed: {r['error']}")
        r = e2e.get("gpt-oss-20b")
        if r and "error" not in r:
            lines.append(f"- {r['model']}, {r['layers']} layers, batch 1, {r['steps']} steps: experts MXFP4 "
                         f"{_f(r['mxfp4'].get('tokens_per_s'), '.1f')} tokens/s ({r['mxfp4'].get('how')}; eager "
                         f"{_f(r['mxfp4'].get('eager_ms_per_token'), '.2f')} ms per step), experts bf16 "
                         f"{_f(r['bf16'].get('tokens_per_s'), '.1f')} tokens/s ({r['bf16'].get('how')}; eager "
                         f"{_f(r['bf16'].get('eager_ms_per_token'), '.2f')} ms per step): "
                         f"{_f(r.get('speedup'), '.2f')}x (target 1.5x); weights {_f(r.get('weights_gib'), '.1f')} "
                         f"GiB against {_f(r.get('bf16_weights_gib'), '.1f')} GiB; logits of one step, MXFP4 against "
                         f"bf16 experts on the same (dequantized) weights: relative error "
                         f"{_f(r.get('logits_rel_err'), '.1e')}, same greedy token: {r.get('same_greedy_token')}")
        r = e2e.get("gpt-oss-120b")
        if r and "error" not in r:
            per = ", ".join(f"batch {b} {_f(r[f'batch{b}'].get('tokens_per_s'), '.1f')} tokens/s "
                            f"({r[f'batch{b}'].get('how')})" for b in (1, 8) if f"batch{b}" in r)
            lines.append(f"- {r['model']}, {r['layers']} layers, experts MXFP4 (random packed weights, everything "
                         f"else bf16): {per}; weights {_f(r.get('weights_gib'), '.1f')} GiB, peak "
                         f"{_f(r.get('peak_gib'), '.1f')} GiB of {_f(r.get('gpu_gib'), '.1f')} GiB. In bf16 its "
                         f"experts alone would take {r['bf16_experts_gb']:.0f} GB: not one 80 GB GPU.")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="bench_moe.py", description=__doc__.split("\n\n")[0])
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="the layers: gpt-oss shapes at every T, both "
                      "routings, the anchor at T = 1, 2, 4 (alternative designs: full_grid only); no end to end")
    mode.add_argument("--layers-only", action="store_true", help="the layer benchmark only")
    mode.add_argument("--e2e", action="store_true", help="the end-to-end decodes only: gpt-oss-20b-shaped (24 "
                      "layers, batch 1, MXFP4 and bf16 experts), gpt-oss-120b-shaped (36 layers, batch 1 and 8)")
    mode.add_argument("--profile", action="store_true",
                      help="per-kernel GPU time of one layer (gpt-oss-20b and -120b MXFP4, anchor NVFP4) at T = 1, 16 "
                           "(--ts to choose; 120b: uniform and skewed routing)")
    ap.add_argument("--tokens", type=int, default=64, help="timed decode steps per end-to-end run (default 64)")
    ap.add_argument("--ts", type=lambda v: tuple(int(t) for t in v.split(",")), default=None,
                    help="the layers' T, comma-separated (default: TOKENS, the anchor's ANCHOR_TOKENS)")
    ap.add_argument("--reps", type=int, default=30, help="timed replays per layer variant (default 30)")
    add_options(ap, out_dir_aliases=("--out",))  # --cpu-smoke: tiny shapes on the CPU, no timing
    args = ap.parse_args(argv)
    if args.cpu_smoke:
        device, gpu = torch.device("cpu"), "cpu"
    elif torch.cuda.is_available():
        device, gpu = torch.device("cuda"), torch.cuda.get_device_name()
    else:
        ap.error("no CUDA device (use --cpu-smoke for the CPU code paths)")
    t0 = time.time()
    timer = None
    if device.type == "cuda":
        from _timing import Timer

        timer = Timer(args.reps, device)
    command = "python benchmarks/bench_moe.py" + (" " + shlex.join(sys.argv[1:] if argv is None else list(argv))
                                                   if (argv or sys.argv[1:]) else "")
    meta = {"gpu": gpu, "date": datetime.date.today().isoformat(), "torch": torch.__version__,
            "transformers": __import__("transformers").__version__, "command": command,
            "grouped_mm": hasattr(torch, "_grouped_mm"), "hf_experts_implementation": hf_experts_implementation()}
    if args.profile:
        records = profile_layers(args, device, timer, t0)
        path = results_path(args.out_dir, "moe", gpu, "json", variant="profile")
        path.write_text(json.dumps({"meta": meta, "profile": records}, indent=1))
        log(f"wrote {path}", t0)
        return 1 if any("error" in r for r in records) else 0
    layers = [] if args.e2e else bench_layers(args, device, timer, t0)
    e2e = {} if (args.layers_only or args.quick) else bench_e2e(args, device, t0)
    meta["seconds"] = time.time() - t0
    variant = "quick" if args.quick else "layers" if args.layers_only else "e2e" if args.e2e else None
    path = results_path(args.out_dir, "moe", gpu, "json", variant=variant)
    path.write_text(json.dumps({"meta": meta, "layers": layers, "e2e": e2e}, indent=1))
    path.with_suffix(".md").write_text(markdown(meta, layers, e2e))
    log(f"wrote {path} / .md", t0)
    failed = [r for r in layers if "error" in r] + [r for r in e2e.values() if "error" in r]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
