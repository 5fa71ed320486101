"""SiLU-gated experts (Qwen3-MoE, Qwen2-MoE, Mixtral): ``MoEExperts(activation="silu")`` against
transformers' own bf16 experts blocks on the dequantized weights, its GPU launches on the CPU
emulator against its CPU path, ``quantize_model`` swapping the experts of whole tiny models, and
``load_quantized`` filling them from per-expert compressed-tensors / ModelOpt layers.
"""

from __future__ import annotations

import json

import pytest
import torch

import tilemm
from tilemm import checkpoints
from tilemm.moe import MoEExperts, silu_glu
from tilemm.packed import unpack

from test_moe import FORMAT_NAMES, QUANTIZERS, emulated, stacked  # noqa: F401 (emulated: a fixture)

transformers = pytest.importorskip("transformers")

H, I, E, TOP_K = 64, 32, 4, 2

#: family -> (experts class, causal LM class, config class, config keywords of a tiny model)
FAMILIES = {
    "qwen3_moe": ("transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeExperts", "Qwen3MoeForCausalLM",
                  "Qwen3MoeConfig", dict(moe_intermediate_size=I, num_experts=E, head_dim=16, norm_topk_prob=True)),
    "qwen2_moe": ("transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeExperts", "Qwen2MoeForCausalLM",
                  "Qwen2MoeConfig", dict(moe_intermediate_size=I, num_experts=E, shared_expert_intermediate_size=64)),
    "mixtral": ("transformers.models.mixtral.modeling_mixtral.MixtralExperts", "MixtralForCausalLM",
                "MixtralConfig", dict(intermediate_size=I, num_local_experts=E, head_dim=16)),
}


def tiny_config(family: str, **kw):
    cfg = dict(vocab_size=96, hidden_size=H, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               num_experts_per_tok=TOP_K, max_position_embeddings=64, intermediate_size=64)
    cfg.update(FAMILIES[family][3])
    cfg.update(kw)
    return getattr(transformers, FAMILIES[family][2])(**cfg)


def experts_class(family: str):
    module, _, name = FAMILIES[family][0].rpartition(".")
    import importlib

    return getattr(importlib.import_module(module), name)


def _halves(gate_up: torch.Tensor) -> torch.Tensor:
    """(E, 2I, K) rows interleaved (MoEExperts' layout) -> gate rows then up rows (transformers')."""
    return torch.cat((gate_up[:, 0::2], gate_up[:, 1::2]), dim=1)


def _dequantized_into(hf_experts, ours: MoEExperts):
    """transformers' SiLU experts given our dequantized weights ((E, N, K), its own layout: gate_up's
    interleaved rows put back as halves)."""
    with torch.no_grad():
        for proj in ("gate_up", "down"):
            w = unpack(ours.packed(proj))
            dq = torch.stack([q.dequantize() for q in w]) if isinstance(w, list) else w.dequantize()
            getattr(hf_experts, proj + "_proj").copy_(_halves(dq) if proj == "gate_up" else dq)


def _routing(tokens: int, fp32_weights: bool, seed: int):
    """The router's (ids, weights): top-2 of random logits, softmax weights (bf16 as Qwen's router
    returns them, fp32 as Mixtral's does)."""
    gen = torch.Generator().manual_seed(seed)
    top, ids = torch.topk(torch.randn(tokens, E, generator=gen), TOP_K, dim=-1)
    weights = torch.softmax(top, dim=-1)
    return ids, weights if fp32_weights else weights.to(torch.bfloat16)


# --------------------------------------------------------------------------------------------------
# The module against transformers' experts
# --------------------------------------------------------------------------------------------------

@pytest.fixture
def fresh_dynamo():
    """Dynamo's caches emptied before and after: every MoEExperts instance compiled is one more entry
    of the forward's code object, and fullgraph=True fails hard past the recompile limit (8), which a
    run of many such tests in one process would otherwise reach."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_silu_glu_is_halves_in_fp32_rounded_once():
    """silu_glu: gate = the first half of the columns, up = the second (transformers' chunk(2)),
    silu(gate) * up from fp32, one rounding."""
    gate_up = torch.randn(3, 5, 8).to(torch.bfloat16)
    g, u = gate_up.float()[..., :4], gate_up.float()[..., 4:]
    expected = (g / (1 + torch.exp(-g.double())) * u.double()).to(torch.bfloat16)
    out = silu_glu(gate_up)
    assert out.dtype == torch.bfloat16 and out.shape == (3, 5, 4)
    # fp32 vs fp64 silu: the same bf16 value but where the fp32 value sits within an fp32 ulp of a tie
    assert torch.allclose(out.float(), expected.float(), rtol=2 ** -8, atol=0)


@pytest.mark.parametrize("fmt", FORMAT_NAMES)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_silu_experts_match_transformers(fmt, family, fresh_dynamo):
    """MoEExperts.from_silu_experts against transformers' own experts block (bf16) on the dequantized
    weights. Both compute gate_up with fp32 sums rounded to bf16 and down likewise; transformers then
    rounds silu(gate), silu(gate) * up, each weighted slot and each partial sum of the k slots to bf16
    (k + 2 more roundings of relative size <= 2^-9, ours rounds h and the output once), and NVFP4's
    dequantized weights are rounded to bf16 for it: the relative Frobenius error of a few independent
    2^-9 roundings, well below 1e-2 (the bound the gpt-oss test uses for the same reasons)."""
    torch.manual_seed(0)
    cfg = tiny_config(family)
    hf = experts_class(family)(cfg)
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.1)
    ours = MoEExperts.from_silu_experts(hf, fmt)
    assert ours.activation == "silu" and ours.gate_up_bias is None and ours.down_bias is None
    hf = hf.to(torch.bfloat16)
    _dequantized_into(hf, ours)
    x = torch.randn(9, H).to(torch.bfloat16)
    ids, weights = _routing(9, fp32_weights=family == "mixtral", seed=1)
    ref = hf(x, ids, weights)
    out = ours(x, ids, weights)
    assert out.dtype == torch.bfloat16 and out.shape == (9, H)
    assert torch.equal(torch.compile(ours, fullgraph=True, backend="eager")(x, ids, weights), out)
    err = ((out.double() - ref.double()).norm() / ref.double().norm()).item()
    assert err < 1e-2, err


def test_silu_experts_reference_is_the_stated_arithmetic():
    """The CPU path, step by step in float64 from the same rounded intermediates: gate_up per pair
    rounded to bf16, silu(gate) * up rounded once, down rounded to bf16, the weighted sum over the
    slots rounded once; equal up to fp32 summation order (at most an ulp of bf16 here and there)."""
    torch.manual_seed(2)
    hf = experts_class("qwen3_moe")(tiny_config("qwen3_moe"))
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.1)
    ours = MoEExperts.from_silu_experts(hf, "mxfp4")
    gu = unpack(ours.packed("gate_up"))
    dn = unpack(ours.packed("down"))
    wg = torch.stack([q.dequantize() for q in gu]).double() if isinstance(gu, list) else gu.dequantize().double()
    wd = torch.stack([q.dequantize() for q in dn]).double() if isinstance(dn, list) else dn.dequantize().double()
    x = torch.randn(5, H).to(torch.bfloat16)
    ids, weights = _routing(5, fp32_weights=False, seed=3)
    out = ours(x, ids, weights)
    expected = torch.empty(5, H, dtype=torch.float64)
    for t in range(5):
        total = torch.zeros(H, dtype=torch.float64)
        for j in range(TOP_K):
            e = ids[t, j]
            gate_up = (wg[e] @ x[t].double()).to(torch.bfloat16).double()
            g, u = gate_up[0::2], gate_up[1::2]  # MoEExperts' rows: gate / up interleaved
            h = (g * torch.sigmoid(g) * u).to(torch.bfloat16).double()
            y = (wd[e] @ h).to(torch.bfloat16).double()
            total += y * weights[t, j].double()
        expected[t] = total
    expected = expected.to(torch.bfloat16)
    diff = (out.float() - expected.float()).abs()
    assert (diff <= 2 ** -7 * expected.float().abs() + 1e-6).all(), diff.max()
    assert (out == expected).float().mean() > 0.9  # mostly bit-equal: the differences are rare ulps


@pytest.mark.parametrize("design", ["sorted", "pairs_combine", "pairs_bmm"])
def test_silu_experts_launches_on_emulator(emulated, design):  # noqa: F811
    """The GPU path (``_experts_launches`` with activation "silu": gate_up with the SiLU gating fused
    in its epilogue, down, the weighted sum) on the CPU emulator against the CPU path: equal up to
    fp32 summation order. fp32 router weights (Mixtral's); expert 0 takes most rows (two chunks of 16);
    one id out of range gives a NaN token."""
    from tilemm.moe import _experts_launches, run_experts

    hidden, inter = 64, 32
    gen = torch.Generator().manual_seed(21)
    _, gu = stacked("nvfp4", E, 2 * inter, hidden, seed=22)
    _, dn = stacked("nvfp4", E, hidden, inter, seed=23)
    x = torch.randn(12, hidden, generator=gen).to(torch.bfloat16)
    ids = torch.randint(0, E, (12, 2), generator=gen)
    ids[:10, 0] = 0
    ids[:9, 1] = (ids[:9, 1] % (E - 1)) + 1  # a token's k experts are distinct
    ids[11, 1] = E
    weights = torch.softmax(torch.randn(12, 2, generator=gen), -1)
    args = (x, ids, weights, gu.words, gu.scale_t, gu.constants, "nvfp4", None, dn.words, dn.scale_t,
            dn.constants, "nvfp4", None, 0.0, 0.0)
    out = _experts_launches(*args, design=design, activation="silu")
    ref = run_experts(*args, activation="silu")  # the CPU path
    assert out[11].isnan().all() and ref[11].isnan().all()
    assert torch.isfinite(out[:11]).all()
    err = ((out[:11].double() - ref[:11].double()).norm() / ref[:11].double().norm()).item()
    assert err < 4e-3, err


def test_silu_experts_opcheck():
    _, gu = stacked("mxfp8", E, 2 * I, H)
    _, dn = stacked("mxfp8", E, H, I)
    x = torch.randn(3, H).to(torch.bfloat16)
    ids = torch.tensor([[0, 3], [2, 1], [1, 0]])
    weights = torch.rand(3, 2)
    torch.library.opcheck(torch.ops.tilemm.silu_experts.default,
                          (x, ids, weights, gu.words, gu.scale_t, gu.constants, gu.fmt.name, dn.words, dn.scale_t,
                           dn.constants, dn.fmt.name))


def test_silu_experts_errors():
    """Bad activation, a bias on SiLU experts, another act_fn, a mis-shaped block: typed errors naming
    the argument."""
    _, gu = stacked("mxfp4", E, 2 * I, H)
    _, dn = stacked("mxfp4", E, H, I)
    fn = "tilemm.moe.MoEExperts"
    with pytest.raises(ValueError, match=rf"{fn}: activation must be one of 'gpt-oss', 'silu', got 'gelu'"):
        MoEExperts(gu, dn, activation="gelu")
    with pytest.raises(ValueError, match=rf"{fn}: down_bias must be None with activation='silu'"):
        MoEExperts(gu, dn, None, torch.zeros(E, H), activation="silu")
    gelu = experts_class("qwen3_moe")(tiny_config("qwen3_moe", hidden_act="gelu"))
    with pytest.raises(ValueError, match=rf"{fn}.from_silu_experts: experts.act_fn must be SiLU .* got "
                                         r"GELUActivation"):
        MoEExperts.from_silu_experts(gelu, "mxfp4")
    hf = experts_class("mixtral")(tiny_config("mixtral"))
    hf.down_proj = torch.nn.Parameter(torch.zeros(E, H, 2 * I))
    with pytest.raises(ValueError, match=rf"{fn}.from_silu_experts: experts.down_proj must be \(E, N, K\) = "
                                         rf"\({E}, {H}, {I}\) .* got \({E}, {H}, {2 * I}\)"):
        MoEExperts.from_silu_experts(hf, "mxfp4")
    with pytest.raises(ValueError, match=rf"{fn}.from_silu_experts: format must be one of"):
        MoEExperts.from_silu_experts(experts_class("mixtral")(tiny_config("mixtral")), "fp8")
    # quantize_model on a model whose experts are not SiLU-gated: the error, and skip= leaves them
    model = transformers.Qwen3MoeForCausalLM(tiny_config("qwen3_moe", hidden_act="gelu"))
    with pytest.raises(ValueError, match=r"tilemm.quantize_model: experts 'model.layers.0.mlp.experts': "
                                         r"experts.act_fn must be SiLU"):
        tilemm.quantize_model(model, "mxfp4", weight_only=True)
    assert not any(isinstance(m, tilemm.nn.Linear) for m in model.modules())  # refused before any change
    tilemm.quantize_model(model, "mxfp4", weight_only=True, skip=lambda n, m: n.endswith("mlp.experts"))
    assert not any(isinstance(m, MoEExperts) for m in model.modules())


# --------------------------------------------------------------------------------------------------
# Whole tiny models: quantize_model
# --------------------------------------------------------------------------------------------------

def _model(family: str, seed: int):
    torch.manual_seed(seed)
    model = getattr(transformers, FAMILIES[family][1])(tiny_config(family)).to(torch.bfloat16).eval()
    with torch.no_grad():  # experts' weights are left uninitialised by some versions' _init_weights
        for name, p in model.named_parameters():
            if "experts" in name:
                p.normal_(0, 0.05)
    return model


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_quantize_model_swaps_silu_experts(family, fmt):
    """quantize_model(weight_only=True) replaces every experts block of a tiny Qwen3-MoE / Qwen2-MoE /
    Mixtral model by a SiLU MoEExperts; its logits are those of transformers' bf16 model on the
    dequantized experts up to the roundings of test_silu_experts_match_transformers (2e-2: the
    gpt-oss whole-model bound, two layers of them). The Linear layers are left out here (the
    checkpoint-style split); the default call swaps them too."""
    model = _model(family, seed=4)
    reference = _model(family, seed=4)
    tilemm.quantize_model(model, fmt, weight_only=True, skip=lambda n, m: isinstance(m, torch.nn.Linear))
    experts = [m for m in model.modules() if isinstance(m, MoEExperts)]
    assert len(experts) == 2 and all(m.activation == "silu" and m.formats == (fmt, fmt) for m in experts)
    hf_experts = [m for m in reference.modules() if type(m).__name__ == experts_class(family).__name__]
    assert not any(type(m).__name__ == type(hf_experts[0]).__name__ for m in model.modules())
    for ours, hf in zip(experts, hf_experts):
        _dequantized_into(hf, ours)
    ids = torch.randint(0, 96, (2, 6), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        out = model(ids).logits
        ref = reference(ids).logits
    err = ((out.double() - ref.double()).norm() / ref.double().norm()).item()
    assert err < 2e-2, err

    everything = tilemm.quantize_model(_model(family, seed=4), fmt, weight_only=True)
    assert isinstance(everything.model.layers[0].self_attn.q_proj, tilemm.nn.Linear)
    assert isinstance(everything.model.layers[0].mlp.experts, MoEExperts)
    with torch.no_grad():
        assert torch.isfinite(everything(ids).logits).all()


# --------------------------------------------------------------------------------------------------
# Loading per-expert checkpoints
# --------------------------------------------------------------------------------------------------

def _expert_layers(fmt: str, num_experts: int = E, seed: int = 30, shared_gate_up_scale: bool = True):
    """Per expert {proj: quantized (N, K)}: separate gate / up / down projections, as per-expert
    checkpoints store them (NVFP4 gate and up sharing one per-tensor scale, as llm-compressor and
    ModelOpt write them for fused gate_up kernels)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(num_experts):
        layer = {}
        for proj, (n, k) in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I))):
            w = torch.randn(n, k, generator=gen)
            if fmt == "nvfp4":
                shared = shared_gate_up_scale and proj != "down_proj"
                layer[proj] = tilemm.quantize_nvfp4(w, global_scale=torch.tensor(0.02 + 0.01 * i) if shared else None)
            else:
                layer[proj] = QUANTIZERS[fmt](w)
        out.append(layer)
    return out


def _ct_tensors(layers, prefix: str):
    """compressed-tensors tensors of per-expert layers under ``<prefix>.<i>.<proj>``, and the
    quantization config (one group targeting the experts by regex)."""
    tensors, formats = {}, set()
    for i, layer in enumerate(layers):
        for proj, q in layer.items():
            t, fmt, args = checkpoints.to_compressed_tensors(q)
            formats.add((fmt, json.dumps(args, sort_keys=True)))
            tensors.update({f"{prefix}.{i}.{proj}.{k}": v for k, v in t.items()})
    (fmt, args), = formats
    config = {"quant_method": "compressed-tensors", "format": fmt, "ignore": [],
              "config_groups": {"group_0": {"targets": [r"re:.*mlp\.experts\..*"], "weights": json.loads(args),
                                            "format": fmt}}}
    return tensors, config


def _experts_holder(family: str, **kw):
    model = torch.nn.Module()
    model.mlp = torch.nn.Module()
    model.mlp.experts = experts_class(family)(tiny_config(family, **kw))
    return model


def _check_interleaved(ours: MoEExperts, layers):
    """gate_up row 2j = gate row j, row 2j + 1 = up row j, down as stored: exactly the stored values."""
    assert isinstance(ours, MoEExperts) and ours.activation == "silu" and ours.gate_up_words.dtype == torch.int32
    for proj in ("gate_up", "down"):
        w = unpack(ours.packed(proj))
        dq = [q.dequantize().float() for q in w] if isinstance(w, list) else list(w.dequantize().float())
        for e, layer in enumerate(layers):
            if proj == "down":
                expected = layer["down_proj"].dequantize().float()
            else:
                expected = torch.stack((layer["gate_proj"].dequantize().float(), layer["up_proj"].dequantize().float()),
                                       dim=1).reshape(2 * I, -1)
            assert torch.equal(dq[e], expected), (proj, e)


def test_silu_experts_of_another_act_fn_refused_by_the_loader():
    """A Qwen3-MoE experts block whose act_fn is not SiLU is not filled as SiLU-gated experts."""
    tensors, config = _ct_tensors(_expert_layers("mxfp4"), "mlp.experts")
    with pytest.raises(ValueError, match=r"experts 'mlp.experts': experts.act_fn must be SiLU"):
        tilemm.load_quantized(_experts_holder("qwen3_moe", hidden_act="gelu"), tensors,
                              convention="compressed-tensors", quantization_config=config)


@pytest.mark.parametrize("fmt", FORMAT_NAMES)
@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_silu_experts_from_compressed_tensors(fmt, family):
    """Per-expert compressed-tensors layers (``experts.<i>.{gate,up,down}_proj``) fill a SiLU
    MoEExperts: packed bytes, gate and up rows interleaved, exactly the stored values; its forward
    equals the module quantize_model builds from those dequantized weights when the formats quantize
    them back to the same bytes (MX: row-wise blocks)."""
    layers = _expert_layers(fmt)
    tensors, config = _ct_tensors(layers, "mlp.experts")
    model = tilemm.load_quantized(_experts_holder(family), tensors, convention="compressed-tensors",
                                  quantization_config=config)
    stored = [{proj: checkpoints.from_compressed_tensors(*checkpoints.to_compressed_tensors(q)[:2])
               for proj, q in layer.items()} for layer in layers]
    _check_interleaved(model.mlp.experts, stored)
    if fmt != "nvfp4":
        hf = experts_class(family)(tiny_config(family))
        with torch.no_grad():
            hf.gate_up_proj.copy_(torch.stack([torch.cat((s["gate_proj"].dequantize(), s["up_proj"].dequantize()))
                                               for s in stored]))
            hf.down_proj.copy_(torch.stack([s["down_proj"].dequantize() for s in stored]))
        again = MoEExperts.from_silu_experts(hf, fmt)
        x = torch.randn(5, H).to(torch.bfloat16)
        ids, weights = _routing(5, fp32_weights=True, seed=6)
        assert torch.equal(model.mlp.experts(x, ids, weights), again(x, ids, weights))


def test_silu_experts_from_modelopt():
    """ModelOpt NVFP4 per-expert layers (``weight``, ``weight_scale``, ``weight_scale_2``,
    ``input_scale`` dropped) fill a SiLU MoEExperts with exactly the stored values."""
    layers = _expert_layers("nvfp4")
    tensors = {}
    for i, layer in enumerate(layers):
        for proj, q in layer.items():
            tensors.update({f"mlp.experts.{i}.{proj}.{k}": v for k, v in checkpoints.to_modelopt(q).items()})
            tensors[f"mlp.experts.{i}.{proj}.input_scale"] = torch.tensor(1.0)
    model = tilemm.load_quantized(_experts_holder("qwen2_moe"), tensors, convention="modelopt",
                                  quantization_config={"quant_algo": "NVFP4", "exclude_modules": []})
    _check_interleaved(model.mlp.experts, layers)


def test_whole_qwen3_moe_model_from_compressed_tensors(tmp_path):
    """A tiny Qwen3MoeForCausalLM written as a compressed-tensors checkpoint (experts as per-expert
    MXFP4 layers, everything else bf16) and loaded with load_quantized gives exactly the logits of
    the same model quantized in memory with quantize_model (MXFP4 blocks are row-wise, so quantizing
    gate and up apart or together gives the same bytes)."""
    from safetensors.torch import save_file

    model = _model("qwen3_moe", seed=7)
    tensors = {}
    for name, t in model.state_dict().items():
        base, _, leaf = name.rpartition(".")
        if leaf in ("gate_up_proj", "down_proj"):
            for e in range(t.shape[0]):
                parts = ({"gate_proj": t[e, :I], "up_proj": t[e, I:]} if leaf == "gate_up_proj"
                         else {"down_proj": t[e]})
                for proj, w in parts.items():
                    q = tilemm.quantize_mxfp4(w.float().contiguous())
                    t_ct, fmt, args = checkpoints.to_compressed_tensors(q)
                    tensors.update({f"{base}.{e}.{proj}.{k}": v.contiguous() for k, v in t_ct.items()})
        else:
            tensors[name] = t.contiguous()
    save_file(tensors, str(tmp_path / "model.safetensors"))
    config = model.config.to_dict() | {"quantization_config": {
        "quant_method": "compressed-tensors", "format": fmt, "ignore": [],
        "config_groups": {"group_0": {"targets": [r"re:.*mlp\.experts\..*"], "weights": args, "format": fmt}}}}
    (tmp_path / "config.json").write_text(json.dumps(config))

    fresh = transformers.Qwen3MoeForCausalLM(tiny_config("qwen3_moe")).to(torch.bfloat16).eval()
    tilemm.load_quantized(fresh, tmp_path, convention="compressed-tensors")
    experts = [m for m in fresh.modules() if isinstance(m, MoEExperts)]
    assert len(experts) == 2 and all(m.activation == "silu" for m in experts)
    assert not any(isinstance(m, tilemm.nn.Linear) for m in fresh.modules())  # only the experts are quantized
    in_memory = tilemm.quantize_model(model, "mxfp4", weight_only=True,
                                      skip=lambda n, m: isinstance(m, torch.nn.Linear))
    ids = torch.randint(0, 96, (2, 6), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        assert torch.equal(fresh(ids).logits, in_memory(ids).logits)


def test_silu_expert_checkpoint_errors():
    """Expert count or shapes that disagree with the model, a bias on SiLU experts, gate / up NVFP4
    scales that cannot share one per-tensor scale: ValueErrors naming the experts block and what
    differs."""
    fn = "tilemm.load_quantized"
    layers = _expert_layers("mxfp4")
    tensors, config = _ct_tensors(layers, "mlp.experts")

    def load(model, t, c=config):
        return tilemm.load_quantized(model, t, convention="compressed-tensors", quantization_config=c)

    with pytest.raises(ValueError, match=rf"{fn}: experts 'mlp.experts': the model has 8 experts, the checkpoint "
                                         r"experts 0 .. 3 \(4 of them\)"):
        load(_experts_holder("qwen3_moe", num_experts=8), tensors)
    with pytest.raises(ValueError, match=rf"{fn}: experts 'mlp.experts': gate_up_proj is \(N, K\) = \(128, 64\) "
                                         r"per expert in the model but \(64, 64\) in the checkpoint"):
        load(_experts_holder("mixtral", intermediate_size=64), tensors)
    with pytest.raises(ValueError, match=rf"{fn}: experts 'mlp.experts': down_proj is \(N, K\) = \(64, 32\) per "
                                         r"expert in the model but \(64, 64\) in the checkpoint"):
        wide = _expert_layers("mxfp4")
        for layer in wide:
            layer["down_proj"] = tilemm.quantize_mxfp4(torch.randn(H, 2 * I))
        load(_experts_holder("qwen3_moe"), *_ct_tensors(wide, "mlp.experts"))
    with pytest.raises(ValueError, match=rf"{fn}: experts 'mlp.experts': expert 0 gate_proj: the checkpoint has a "
                                         r"bias \(mlp.experts.0.gate_proj.bias\), but the model's SiLU-gated experts"):
        load(_experts_holder("qwen3_moe"), tensors | {"mlp.experts.0.gate_proj.bias": torch.zeros(I)})
    nv, nv_config = _ct_tensors(_expert_layers("nvfp4", shared_gate_up_scale=False), "mlp.experts")
    with pytest.raises(ValueError, match=r"experts 'mlp.experts': expert 0: gate_proj and up_proj have different "
                                         r"NVFP4 per-tensor scales"):
        load(_experts_holder("qwen3_moe"), nv, nv_config)
    missing = {k: v for k, v in tensors.items() if not k.startswith("mlp.experts.2.")}
    with pytest.raises(ValueError, match=r"the model has 4 experts, the checkpoint experts 0 .. 3 \(3 of them\)"):
        load(_experts_holder("qwen3_moe"), missing)


# --------------------------------------------------------------------------------------------------
# The fused SiLU epilogue (ACT = 2) on the CPU emulator, and the interleaved gate_up layout
# --------------------------------------------------------------------------------------------------

def _silu_case(fmt: str, n: int = 40, k: int = 256, tokens: int = 6):
    """Stacked experts (E, N, K) with gates past +-88 (exp(-gate) overflows to Inf: silu(gate) = -0)
    and an id out of range (NaN rows)."""
    from test_moe import stacked as stacked_

    _, packed = stacked_(fmt, E, n, k, seed=40)
    gen = torch.Generator().manual_seed(41)
    x = (torch.randn(tokens, k, generator=gen) * 4).to(torch.bfloat16)
    ids = torch.stack([torch.arange(tokens) % E, (torch.arange(tokens) + 1) % E], dim=1)
    ids[:4, 0] = 0  # expert 0: 4 rows + 1
    ids[-1, 1] = E
    return packed, x, ids


@pytest.mark.parametrize("fmt", FORMAT_NAMES)
def test_fused_silu_epilogue_sorted_kernel(emulated, fmt):
    """ACT = 2 in the grouped kernel: gate_up rows interleaved; each product rounded to bf16 as without
    ACT, then silu(gate) * up in fp32, rounded once: bit for bit ``silu_glu`` of the unfused output and
    of the CPU path's gate_up (``reference_moe``; the emulator's exact exp is the reference's). N = 40:
    a partial weight tile (its padded rows' outputs fall outside Out); the output in the sorted order
    (what down reads) and scattered to (token, slot) rows; NaN rows for the id out of range."""
    from test_moe import _run_kernel
    from tilemm.kernels import moe_kernels as mk
    from tilemm.moe import reference_moe

    packed, x, ids = _silu_case(fmt)
    ok = (ids >= 0) & (ids < E)
    ref = reference_moe(x, packed.words, packed.scale_t, packed.constants, packed.fmt.name, packed.in_features,
                        ids, None)
    expected = silu_glu(ref, interleaved=True)
    gates = ref[..., 0::2][ok].float()
    assert (gates < -88).any() and (gates > 88).any()  # exp(-gate) overflows, and underflows to 0
    planned = mk.plan(6, 2, E, packed.out_features, packed.in_features, packed.layout, design="sorted").config
    for cfg in (mk.MoEConfig(16, 16, 4, None, cat=1), planned):
        plain = _run_kernel(x, packed, ids, None, cfg)
        for sorted_out in (1, 0):
            fused = _run_kernel(x, packed, ids, None, cfg, act=mk.ACT_SILU, sorted_out=sorted_out)
            assert fused.shape == (6, 2, 20) and fused[~ok].isnan().all()
            assert torch.equal(fused[ok], silu_glu(plain, interleaved=True)[ok])
            assert torch.equal(fused[ok], expected[ok])


@pytest.mark.parametrize("fmt", FORMAT_NAMES)
def test_fused_silu_epilogue_pairs_kernel(emulated, fmt):
    """ACT = 2 in the per-pair kernel: one token's experts and two tokens sharing one, an id out of range;
    bit for bit ``silu_glu`` of the CPU path's gate_up."""
    from tilemm.kernels import moe_kernels as mk
    from tilemm.moe import reference_moe

    packed, x, ids = _silu_case(fmt, k=320)  # K = 320: a partial K tile
    for xs, pairs in ((x[:1], torch.tensor([[3, 0, 2, 1]])), (x[:2], ids[-2:])):
        out = torch.full((pairs.numel(), 20), 12345.0, dtype=torch.bfloat16)
        mk.launch_pairs(xs, packed.words, packed.scale_t, packed.constants, None, pairs.reshape(-1), out,
                        packed.layout, act=mk.ACT_SILU)
        out = out.reshape(*pairs.shape, 20)
        ok = (pairs >= 0) & (pairs < E)
        ref = reference_moe(xs, packed.words, packed.scale_t, packed.constants, packed.fmt.name,
                            packed.in_features, pairs, None)
        assert out[~ok].isnan().all()
        assert torch.equal(out[ok], silu_glu(ref, interleaved=True)[ok])


@pytest.mark.parametrize("fmt", FORMAT_NAMES)
@pytest.mark.parametrize("design", ["sorted", "pairs_combine", "pairs_bmm"])
def test_silu_experts_launches_bit_exact_on_emulator(emulated, fmt, design):
    """The whole GPU path of a SiLU block (gate_up with the fused gating, down, the weighted sum) on the
    emulator equals the CPU path bit for bit: the emulator sums exactly as the reference does here,
    and the fused gating is ``silu_glu``'s arithmetic."""
    from tilemm.moe import _experts_launches, run_experts

    from test_moe import stacked as stacked_

    _, gu = stacked_(fmt, E, 2 * I, H, seed=42)
    _, dn = stacked_(fmt, E, H, I, seed=43)
    gen = torch.Generator().manual_seed(44)
    x = (torch.randn(7, H, generator=gen) * 2).to(torch.bfloat16)
    ids = torch.stack([torch.arange(7) % E, (torch.arange(7) + 2) % E], dim=1)
    weights = torch.softmax(torch.randn(7, 2, generator=gen), -1).to(torch.bfloat16)
    args = (x, ids, weights, gu.words, gu.scale_t, gu.constants, gu.fmt.name, None, dn.words, dn.scale_t,
            dn.constants, dn.fmt.name, None, 0.0, 0.0)
    out = _experts_launches(*args, design=design, activation="silu")
    ref = run_experts(*args, activation="silu")
    assert torch.isfinite(ref).all() and torch.equal(out, ref)


@pytest.mark.parametrize("fmt", FORMAT_NAMES)
def test_interleave_gate_up_permutes_whole_rows(fmt):
    """interleave_gate_up: row 2j = gate row j, row 2j + 1 = up row j of the packed words and scale
    bytes (an MXFP8 NaN block's original scale bytes too); the quantized values are the halves'
    values, moved; constants kept. Errors name the argument."""
    from tilemm.moe import interleave_gate_up

    from test_moe import stacked as stacked_

    w_q, packed = stacked_(fmt, 3, 2 * I, H, seed=45)
    if fmt == "mxfp8":  # a NaN element: its block's scale byte is 255 in scale_t, the original in nan_scale
        data = w_q.data.clone()
        data.view(torch.uint8)[1, 5, 7] = 0x7F
        w_q = type(w_q)(data, w_q.scale)
        packed = tilemm.prepack(w_q)
        assert packed.nan_scale is not None
    out = interleave_gate_up(packed)
    assert torch.equal(out.constants, packed.constants) and out.exponent == packed.exponent
    back = unpack(out)
    rows = torch.stack((torch.arange(I), torch.arange(I) + I), dim=1).reshape(-1)
    assert torch.equal(back.data.view(torch.uint8), w_q.data.view(torch.uint8)[:, rows])
    assert torch.equal(back.scale.view(torch.uint8), w_q.scale.view(torch.uint8)[:, rows])
    if fmt == "nvfp4":
        assert torch.equal(out.global_scale, packed.global_scale)
    with pytest.raises(TypeError, match=r"tilemm.moe.interleave_gate_up: w must be a stacked expert PackedWeight"):
        interleave_gate_up(tilemm.prepack(QUANTIZERS[fmt](torch.randn(8, H))))
    with pytest.raises(ValueError, match=r"tilemm.moe.interleave_gate_up: w must have an even number of rows"):
        interleave_gate_up(stacked_(fmt, 2, 3, H)[1])


def _silu_module(fmt: str = "mxfp4", seed: int = 46) -> MoEExperts:
    torch.manual_seed(seed)
    hf = experts_class("qwen3_moe")(tiny_config("qwen3_moe"))
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.1)
    return MoEExperts.from_silu_experts(hf, fmt)


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_silu_state_dict_with_halves_loads(fmt):
    """State dicts of SiLU MoEExperts saved before gate_up rows were interleaved (module version 2:
    gate / up halves; no version, 1: halves and the older word layout) load as the interleaved module;
    the current version loads as it is; a gpt-oss module's gate_up is never permuted; a version newer
    than the module's is an error."""
    from tilemm.packed import relayout_words

    module = _silu_module(fmt)
    state = module.state_dict()
    assert state._metadata[""]["version"] == MoEExperts._version == 4
    halves = dict(state)
    halves["gate_up_words"] = torch.cat((state["gate_up_words"][:, 0::2], state["gate_up_words"][:, 1::2]), 1)
    halves["gate_up_scale_t"] = torch.cat((state["gate_up_scale_t"][..., 0::2], state["gate_up_scale_t"][..., 1::2]),
                                          2)
    assert not torch.equal(halves["gate_up_words"], state["gate_up_words"])
    version2 = type(state)(halves)
    version2._metadata = {"": {"version": 2}}
    version1 = {k: relayout_words(v, module.packed(k[:-6]).fmt, 2, 1) if k.endswith("_words") else v
                for k, v in halves.items()}  # a plain dict: no metadata
    for old in (version2, version1, state):
        fresh = _silu_module(fmt, seed=47)
        fresh.load_state_dict(old)
        for name, t in state.items():
            assert torch.equal(getattr(fresh, name), t), name
    x = torch.randn(3, H).to(torch.bfloat16)
    ids, weights = _routing(3, fp32_weights=False, seed=48)
    assert torch.equal(fresh(x, ids, weights), module(x, ids, weights))

    gpt_oss = MoEExperts(module.packed("gate_up"), module.packed("down"))  # the same buffers, gpt-oss gating
    gpt_oss.load_state_dict(version2)
    assert torch.equal(gpt_oss.gate_up_words, halves["gate_up_words"])  # taken as given
    newer = type(state)(state)
    newer._metadata = {"": {"version": MoEExperts._version + 1}}
    with pytest.raises(RuntimeError, match=r"a state dict of version 5, which this tilemm does not know"):
        fresh.load_state_dict(newer)
