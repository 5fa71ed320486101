"""Checkpoints written by other libraries, read by tilemm bit for bit (tilemm/checkpoints.py).

Oracles are the libraries themselves, never tilemm's reading of their documentation:

* compressed-tensors (the format library of llm-compressor and vLLM): checkpoints made by its own
  ``ModelCompressor`` and decompressed by it (``_checkpoint_peers.py`` says how the scales are
  observed); tilemm's exporter is checked by compressed-tensors' decompressors and config parser.
* torchao: its ``NVFP4Tensor`` / ``MXTensor`` quantizers and ``dequantize``.
* NVIDIA ModelOpt: its ``NVFP4QTensor`` quantizer and ``dequantize``.
* gpt-oss: no writer library exists on PyPI; the tensors are built from the published layout
  (uint8 ``*_blocks`` (..., N, K/32, 16) and ``*_scales`` (..., N, K/32)) and decoded by
  transformers' ``convert_moe_packed_tensors``, the reader of that layout.

What "bit for bit" means per format. MX and FP8: the dequantized weights are equal bit for bit (the
products are exact). NVFP4: the stored bytes and the per-tensor scale are carried over exactly, and the
peer's dequantized weight equals *its own formula evaluated on tilemm's buffers* bit for bit; the
peers round the product of the two scales (``s_b / encode`` or ``s_b * decode``) before multiplying by
the element, tilemm multiplies ``element * s_b`` (exact) and rounds once after the decode scale, so
the two dequantizations agree bit for bit when the per-tensor scale is a power of two and within
2^-22 relative otherwise (docs/checkpoints.md, "Where the peers differ").
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch

import tilemm
from tilemm import checkpoints, conventions
from tilemm.nn import Linear
from tilemm.numerics import e2m1_decode, unpack_e2m1

warnings.filterwarnings("ignore", message=".*Enum subclass.*")

REL_NVFP4 = 2.0 ** -22  # two fp32 roundings on each side of the NVFP4 scale product


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({4: torch.int32, 2: torch.int16, 1: torch.uint8}[t.element_size()])


def _assert_bits_equal(a: torch.Tensor, b: torch.Tensor):
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, b.dtype, a.shape, b.shape)
    diff = (_bits(a) != _bits(b)).sum().item()
    assert diff == 0, f"{diff} of {a.numel()} elements differ"


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _elements(data: torch.Tensor) -> torch.Tensor:
    return e2m1_decode(unpack_e2m1(data))


def _weights(seed=0, n=160, k=256, dtype=torch.float32):
    """A weight with rows of different magnitudes; N = 160 is not a multiple of 128 (partial blocks)."""
    g = torch.Generator().manual_seed(seed)
    rows = torch.logspace(-3, 1, n).unsqueeze(1)
    return (torch.randn(n, k, generator=g) * rows).to(dtype)


# ==================================================================================================
# compressed-tensors
# ==================================================================================================

from _checkpoint_peers import compressed_tensors_model, tiny_llama  # noqa: E402


def _ct():
    return pytest.importorskip("compressed_tensors", reason="compressed-tensors is in the 'test' extra "
                               "(pip install -e '.[test]')")

CT_PRESETS = [  # (preset, tilemm format, what the stored weight_scale holds)
    ("NVFP4A16", "nvfp4", "e4m3 block scales + fp32 encode scale"),
    ("MXFP4A16", "mxfp4", "uint8 biased exponents"),
    ("MXFP8", "mxfp8", "uint8 biased exponents"),
    ("FP8_DYNAMIC", "fp8", "bf16 per channel"),
    ("FP8", "fp8", "bf16 per tensor"),
    ("FP8_BLOCK", "fp8", "bf16 per 128x128 block"),
]


@pytest.fixture(scope="module", params=CT_PRESETS, ids=[p[0] for p in CT_PRESETS])
def ct_checkpoint(request):
    """A two-layer Llama quantized by compressed-tensors, and the same model decompressed by it."""
    _ct()
    preset, fmt, _ = request.param
    model = tiny_llama(seed=3, hidden=256, intermediate=384, layers=1, vocab=256)
    compressor, state, config = compressed_tensors_model(preset, model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compressor.decompress_model(model)
    return preset, fmt, state, config, model


def _ct_layers(model):
    return [(n, m) for n, m in model.named_modules() if type(m) is torch.nn.Linear and n != "lm_head"]


def test_compressed_tensors_format_names():
    _ct()
    # The names this module accepts are the ones the installed compressed-tensors writes.
    from compressed_tensors.config import CompressionFormat

    for name in checkpoints.COMPRESSED_TENSORS_FORMATS:
        assert CompressionFormat(name).value == name


def test_compressed_tensors_layers_load_without_copies(ct_checkpoint):
    preset, fmt, state, config, _ = ct_checkpoint
    group = config["config_groups"]["group_0"]
    model = tilemm.load_quantized(tiny_llama(seed=9, hidden=256, intermediate=384, layers=1, vocab=256),
                                  state, convention="compressed-tensors", quantization_config=config,
                                  swizzle=False)
    layers = [(n, m) for n, m in model.named_modules() if isinstance(m, Linear)]
    assert len(layers) == 7 and all(m.format == fmt for _, m in layers)
    assert type(model.lm_head) is torch.nn.Linear  # "ignore": ["lm_head"]
    for name, layer in layers:
        stored = state[f"{name}.weight_packed" if fmt in ("nvfp4", "mxfp4") else f"{name}.weight"]
        assert _same_storage(layer.weight, stored), "the element bytes are taken as they are"
        if fmt in ("nvfp4", "mxfp4", "mxfp8"):
            assert _same_storage(layer.weight_scale, state[f"{name}.weight_scale"])
        if fmt == "nvfp4":
            encode = state[f"{name}.weight_global_scale"]
            assert group["format"] == "nvfp4-pack-quantized"
            _assert_bits_equal(layer.weight_global_scale, (torch.tensor(1.0) / encode).reshape(()))
    # Everything else (embeddings, norms, lm_head) is the checkpoint's own tensor.
    assert torch.equal(model.model.embed_tokens.weight, state["model.embed_tokens.weight"])


def test_compressed_tensors_dequantize_bit_for_bit(ct_checkpoint):
    """tilemm's weights against compressed-tensors' decompressed model, layer by layer."""
    preset, fmt, state, config, theirs = ct_checkpoint
    for name, module in _ct_layers(theirs):
        q = checkpoints.from_compressed_tensors(
            {k.rpartition(".")[2]: v for k, v in state.items() if k.rpartition(".")[0] == name},
            config["config_groups"]["group_0"]["format"], weights=config["config_groups"]["group_0"]["weights"])
        their_w = module.weight.data  # bf16, as compressed-tensors decompresses
        ours = q.dequantize()
        if fmt != "nvfp4":
            # Exact fp32 products, rounded once to their dtype: equal bit for bit.
            _assert_bits_equal(ours.to(their_w.dtype), their_w)
            continue
        # NVFP4: their formula on tilemm's buffers (nibbles, e4m3 bytes, 1 / decode = encode).
        encode = state[f"{name}.weight_global_scale"]
        s_b = q.scale.to(torch.float32).repeat_interleave(16, dim=-1)
        _assert_bits_equal((_elements(q.data) * (s_b / encode)).to(their_w.dtype), their_w)
        theirs_f32 = _elements(q.data) * (s_b / encode)
        assert ((ours - theirs_f32).abs() <= REL_NVFP4 * theirs_f32.abs()).all()


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "mxfp8", "fp8-row", "fp8-tensor", "fp8-128x128"])
def test_compressed_tensors_reads_what_tilemm_writes(fmt):
    """tilemm's exporter, checked by compressed-tensors' own decompressors and config parser."""
    _ct()
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme

    w = _weights(seed=1)
    if fmt == "nvfp4":
        # A power-of-two per-tensor scale makes both dequantization formulas exact.
        q = tilemm.quantize_nvfp4(w, global_scale=2.0 ** -8, swizzle=True)
    elif fmt == "mxfp4":
        q = tilemm.quantize_mxfp4(w, swizzle=True)
    elif fmt == "mxfp8":
        q = tilemm.quantize_mxfp8(w)
    else:
        q = tilemm.quantize_fp8(w, granularity={"fp8-row": "row", "fp8-tensor": "tensor",
                                                "fp8-128x128": (128, 128)}[fmt])
    tensors, format, args = checkpoints.to_compressed_tensors(q)
    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(**args))
    state = BaseCompressor.load_from_registry(format).decompress(dict(tensors), scheme)
    theirs = state["weight"]
    _assert_bits_equal(q.dequantize().to(theirs.dtype), theirs)
    # And the model-level config is one compressed-tensors parses, with the format tilemm named.
    layer = Linear.from_quantized(q)
    model = torch.nn.Sequential(layer, torch.nn.Linear(256, 4))
    sd, config = tilemm.export_quantized(model, "compressed-tensors")
    parsed = QuantizationConfig.model_validate(config)
    assert parsed.format == format and parsed.ignore == ["1"]
    assert torch.equal(sd["0.weight_packed" if "pack" in format else "0.weight"].view(torch.uint8),
                       q.data.view(torch.uint8))
    back = tilemm.load_quantized(torch.nn.Sequential(torch.nn.Linear(256, 160, bias=False), torch.nn.Linear(256, 4)), sd,
                                 convention="compressed-tensors", quantization_config=config)
    _assert_bits_equal(back[0].dequantize_weight(), layer.dequantize_weight())


def test_compressed_tensors_nvfp4_quantizer_agrees_with_tilemm():
    """Where the two specifications agree the bytes agree: same global scale (448 * 6 / amax, fp32),
    block scales e4m3(amax_b / 6 * S_enc), elements e2m1 RNE. The two round the scale products in
    different places (docs/checkpoints.md); on these data no product lands on a rounding boundary."""
    _ct()
    from compressed_tensors.compressors.nvfp4.helpers import quantize_and_pack_fp4
    from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam
    from compressed_tensors.quantization import preset_name_to_scheme

    w = _weights(seed=2)
    args = preset_name_to_scheme("NVFP4A16", ["Linear"]).weights
    gs = generate_gparam(w.amin(), w.amax())
    groups = w.unflatten(-1, (16, 16))
    scale, _ = calculate_qparams(groups.amin(-1), groups.amax(-1), args, global_scale=gs)
    packed = quantize_and_pack_fp4(w, scale, global_scale=gs, group_size=16)
    q = tilemm.quantize_nvfp4(w)
    _assert_bits_equal(q.global_scale, (torch.tensor(1.0) / gs).reshape(()))
    _assert_bits_equal(q.scale, scale.to(torch.float8_e4m3fn))
    _assert_bits_equal(q.data, packed)


@pytest.mark.parametrize("fmt", ["mxfp4", "mxfp8"])
def test_compressed_tensors_mx_scales_are_floor_below_1_75(fmt):
    _ct()
    """compressed-tensors' MX scale rounds the block amax to a power of two with e2m1's mantissa
    (``round_to_power_2``: up from 1.75 * 2^e), then subtracts emax: that is OCP FLOOR for blocks whose
    amax mantissa is below 1.75 and FLOOR + 1 from 1.75 on (for MXFP8 too). Bytes equal tilemm's
    ``rounding="floor"`` on the first kind of block, and the scale is one more on the second."""
    from compressed_tensors.quantization import preset_name_to_scheme
    from compressed_tensors.quantization.utils import calculate_qparams
    from compressed_tensors.compressors import BaseCompressor

    preset, format = {"mxfp4": ("MXFP4A16", "mxfp4-pack-quantized"), "mxfp8": ("MXFP8A16", "mxfp8-quantized")}[fmt]
    scheme = preset_name_to_scheme(preset, ["Linear"])
    w = _weights(seed=4, n=64)
    blocks = w.unflatten(-1, (8, 32))
    amax = blocks.abs().amax(-1, keepdim=True)
    # Set each block's amax to 1.5 * 2^e or 1.875 * 2^e (alternating blocks), keeping the others.
    target = torch.exp2(torch.floor(torch.log2(amax))) * torch.where(
        torch.arange(8).reshape(1, 8, 1) % 2 == 0, 1.5, 1.875)
    at = blocks.abs().argmax(-1, keepdim=True)
    blocks.scatter_(-1, at, target * torch.sign(blocks.gather(-1, at)))
    blocks = torch.where(blocks.abs() > target, torch.sign(blocks) * target * 0.9, blocks)
    w = blocks.flatten(-2)
    g = w.unflatten(-1, (8, 32))
    scale, _ = calculate_qparams(g.amin(-1), g.amax(-1), scheme.weights)
    tensors = BaseCompressor.load_from_registry(format).compress(
        {"weight": w, "weight_scale": scale}, scheme)
    theirs = checkpoints.from_compressed_tensors(tensors, format)
    ours = tilemm.quantize_mxfp4(w, rounding="floor") if fmt == "mxfp4" else \
        tilemm.quantize_mxfp8(w, rounding="floor")
    floor_blocks = (torch.arange(8) % 2 == 0).expand(64, 8)
    their_s, our_s = theirs.scale.view(torch.uint8), ours.scale.view(torch.uint8)
    assert torch.equal(their_s[floor_blocks], our_s[floor_blocks])
    assert torch.equal(their_s[~floor_blocks].int(), our_s[~floor_blocks].int() + 1)
    per_byte = 16 if fmt == "mxfp4" else 32
    their_d = theirs.data.view(torch.uint8).unflatten(-1, (8, per_byte))
    our_d = ours.data.view(torch.uint8).unflatten(-1, (8, per_byte))
    assert torch.equal(their_d[floor_blocks], our_d[floor_blocks])


def test_compressed_tensors_fp8_quantizer_agrees_with_tilemm():
    """FP8 per channel / per tensor: both compute s = amax / 448 and cast x / s with RNE saturation."""
    _ct()
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import preset_name_to_scheme
    from compressed_tensors.quantization.utils import calculate_qparams

    w = _weights(seed=5)
    for preset, gran, lo, hi in (("FP8_DYNAMIC", "row", w.amin(1, keepdim=True), w.amax(1, keepdim=True)),
                                 ("FP8", "tensor", w.amin(), w.amax())):
        scheme = preset_name_to_scheme(preset, ["Linear"])
        scale, _ = calculate_qparams(lo, hi, scheme.weights)
        tensors = BaseCompressor.load_from_registry("float-quantized").compress(
            {"weight": w, "weight_scale": scale}, scheme)
        theirs = checkpoints.from_compressed_tensors(tensors, "float-quantized", weights=scheme.weights.model_dump())
        ours = tilemm.quantize_fp8(w, granularity=gran)
        _assert_bits_equal(theirs.data, ours.data)
        _assert_bits_equal(theirs.scale, ours.scale)


# ==================================================================================================
# Worked example: a tiny Llama quantized by compressed-tensors, saved, loaded by tilemm, run on CPU
# ==================================================================================================


def _save(tmp_path, state, config):
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": config}))
    return tmp_path


def test_worked_example_mxfp4_logits_match_compressed_tensors(tmp_path):
    """MXFP4 dequantizes exactly, so tilemm's weight-only model has the very weights of compressed-
    tensors' decompressed model and the logits may differ only by accumulation order: at most one
    bf16 rounding of the largest logit. (On one CPU the two run the same bf16 matmuls: equal.)"""
    _ct()
    model = tiny_llama(seed=0)
    compressor, state, config = compressed_tensors_model("MXFP4A16", model)
    path = _save(tmp_path, state, config)
    ours = tilemm.load_quantized(tiny_llama(seed=1), path, convention="compressed-tensors", weight_only=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compressor.decompress_model(model)
    ids = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours_logits, their_logits = ours(ids).logits, model(ids).logits
    bound = 2.0 ** -8 * their_logits.abs().max().item()
    assert (ours_logits.float() - their_logits.float()).abs().max().item() <= bound


def test_worked_example_nvfp4_fp32_logits_match_compressed_tensors(tmp_path):
    """NVFP4 in fp32: the reference weights are compressed-tensors' own dequantization in fp32
    (``dequantize`` of its unpacked elements and scales); tilemm's differ from them by at most 2^-22
    relative (the scale product is rounded elsewhere), so the logits agree to fp32 accumulation-order
    level: 1e-5 of the largest logit."""
    _ct()
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
    from compressed_tensors.quantization.lifecycle.forward import dequantize

    model = tiny_llama(seed=0, dtype=torch.float32)
    _, state, config = compressed_tensors_model("NVFP4A16", model)
    path = _save(tmp_path, state, config)
    ours = tilemm.load_quantized(tiny_llama(seed=1, dtype=torch.float32), path,
                                 convention="compressed-tensors", weight_only=True)
    reference = tiny_llama(seed=1, dtype=torch.float32)
    reference.load_state_dict({k: v for k, v in state.items() if k in reference.state_dict()}, strict=False)
    from compressed_tensors.quantization import QuantizationArgs

    args = QuantizationArgs(**config["config_groups"]["group_0"]["weights"])
    for name, module in _ct_layers(reference):
        packed = state[f"{name}.weight_packed"]
        elements = unpack_fp4_from_uint8(packed, packed.shape[0], 2 * packed.shape[1], dtype=torch.float32)
        module.weight.data = dequantize(elements, state[f"{name}.weight_scale"].float(), args=args,
                                        global_scale=state[f"{name}.weight_global_scale"],
                                        dtype=torch.float32)
    ids = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours_logits, their_logits = ours(ids).logits, reference(ids).logits
    assert (ours_logits - their_logits).abs().max().item() <= 1e-5 * their_logits.abs().max().item()


# ==================================================================================================
# torchao
# ==================================================================================================


def _torchao():
    pytest.importorskip("torchao", reason="torchao is in the 'test' extra")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from torchao.prototype.mx_formats.config import ScaleCalculationMode
        from torchao.prototype.mx_formats.mx_tensor import MXTensor
        from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor
    return MXTensor, NVFP4Tensor, ScaleCalculationMode


MX_CASES = [(torch.float8_e4m3fn, "mxfp8"), (torch.float8_e5m2, "mxfp8"), (torch.float4_e2m1fn_x2, "mxfp4")]


@pytest.mark.parametrize("elem,fmt", MX_CASES, ids=["e4m3", "e5m2", "fp4"])
@pytest.mark.parametrize("mode", ["floor", "rceil"])
@pytest.mark.parametrize("swizzled", [False, True])
def test_torchao_mx_both_directions(elem, fmt, mode, swizzled):
    MXTensor, _, ScaleCalculationMode = _torchao()
    w = _weights(seed=6)
    t = MXTensor.to_mx(w, elem, 32, scaling_mode=ScaleCalculationMode(mode), is_swizzled_scales=swizzled)
    q = checkpoints.from_torchao(t)
    assert _same_storage(q.data, t.qdata) and _same_storage(q.scale, t.scale)
    assert q.swizzled == swizzled
    _assert_bits_equal(q.dequantize(), t.dequantize(torch.float32))
    # tilemm's quantizer writes the same bytes with the same rounding mode.
    ours = (tilemm.quantize_mxfp4(w, rounding=mode, swizzle=swizzled) if fmt == "mxfp4" else
            tilemm.quantize_mxfp8(w, elem_dtype=elem, rounding=mode, swizzle=swizzled))
    _assert_bits_equal(ours.data.view(torch.uint8), q.data.view(torch.uint8))
    _assert_bits_equal(ours.scale, q.scale)
    back = checkpoints.to_torchao(ours, orig_dtype=torch.float32)
    assert back.is_swizzled_scales == swizzled and _same_storage(back.qdata, ours.data)
    _assert_bits_equal(back.dequantize(torch.float32), ours.dequantize())


@pytest.mark.parametrize("swizzled", [False, True])
def test_torchao_nvfp4_both_directions(swizzled):
    _, NVFP4Tensor, _ = _torchao()
    w = _weights(seed=7)
    for pts in (torch.tensor(2.0 ** -9), w.abs().amax() / (448 * 6)):
        t = NVFP4Tensor.to_nvfp4(w, per_tensor_scale=pts, is_swizzled_scales=swizzled)
        q = checkpoints.from_torchao(t)
        assert _same_storage(q.data, t.qdata) and _same_storage(q.scale, t.scale)
        _assert_bits_equal(q.global_scale, pts.float())  # torchao's per_tensor_scale is a decode scale
        theirs = t.dequantize(torch.float32)
        # torchao: element * fp32(per_tensor_scale * s_b); tilemm: (element * s_b) * decode.
        s_b = conventions._logical_scale(q).to(torch.float32).repeat_interleave(16, -1)
        _assert_bits_equal(_elements(q.data) * (q.global_scale * s_b), theirs)
        ours = q.dequantize()
        assert ((ours - theirs).abs() <= REL_NVFP4 * theirs.abs()).all()
        if pts.item() == 2.0 ** -9:
            _assert_bits_equal(ours, theirs)
        back = checkpoints.to_torchao(q, orig_dtype=torch.float32)
        _assert_bits_equal(back.dequantize(torch.float32), theirs)


def test_torchao_nvfp4_quantizer_agrees_with_tilemm_and_clamps_small_block_scales():
    """With a power-of-two per-tensor scale both quantizers compute the same block scales and
    elements, except that torchao clamps block scales below 2^-6 up to 2^-6 (tilemm does not)."""
    _, NVFP4Tensor, _ = _torchao()
    w = _weights(seed=8)
    w[:8] *= 1e-4  # rows whose block scales fall below 2^-6
    pts = torch.tensor(2.0 ** -9)
    t = NVFP4Tensor.to_nvfp4(w, per_tensor_scale=pts)
    ours = tilemm.quantize_nvfp4(w, global_scale=pts)
    tiny = ours.scale.to(torch.float32) < 2.0 ** -6
    assert tiny.any() and (~tiny).any(), "the data must hold both kinds of block"
    _assert_bits_equal(ours.scale[~tiny], t.scale[~tiny])
    assert (t.scale[tiny].to(torch.float32) == 2.0 ** -6).all()
    keep = (~tiny).repeat_interleave(8, dim=-1)
    assert torch.equal(ours.data[keep], t.qdata[keep])


# ==================================================================================================
# NVIDIA ModelOpt
# ==================================================================================================


def _modelopt():
    pytest.importorskip("modelopt", reason="nvidia-modelopt is in the 'test' extra")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor
    return NVFP4QTensor


def _modelopt_dequantize(qt, scale, scale_2):
    return qt.dequantize(dtype=torch.float32, scale=scale, double_scale=scale_2, block_sizes={-1: 16})


def test_modelopt_nvfp4_both_directions():
    NVFP4QTensor = _modelopt()
    w = _weights(seed=9)
    qt, scale, scale_2 = NVFP4QTensor.quantize(w, 16)
    layer = {"weight": qt._quantized_data, "weight_scale": scale, "weight_scale_2": scale_2,
             "input_scale": torch.tensor(0.01)}
    q = checkpoints.from_modelopt(layer, quant_algo="NVFP4")
    assert _same_storage(q.data, qt._quantized_data) and _same_storage(q.scale, scale)
    _assert_bits_equal(q.global_scale, scale_2)  # weight_scale_2 is a decode scale: taken as it is
    theirs = _modelopt_dequantize(qt, scale, scale_2)
    s_b = q.scale.to(torch.float32).repeat_interleave(16, -1)
    # ModelOpt decodes the e2m1 code 8 (-0) as +0; "+ 0.0" turns tilemm's -0.0 into +0.0 and changes
    # nothing else.
    assert (unpack_e2m1(q.data) == 8).any()
    _assert_bits_equal(_elements(q.data) * (s_b * q.global_scale) + 0.0, theirs)
    assert ((q.dequantize() - theirs).abs() <= REL_NVFP4 * theirs.abs()).all()
    # tilemm -> ModelOpt, decoded by ModelOpt: exact with a power-of-two decode scale.
    ours = tilemm.quantize_nvfp4(w, global_scale=2.0 ** -9, swizzle=True)
    out = checkpoints.to_modelopt(ours)
    packed = NVFP4QTensor(w.shape, torch.float32, out["weight"])
    _assert_bits_equal(_modelopt_dequantize(packed, out["weight_scale"], out["weight_scale_2"]),
                       ours.dequantize() + 0.0)


def test_modelopt_nvfp4_quantizer_agrees_with_tilemm_given_the_decode_scale():
    """Given the same power-of-two decode scale, ModelOpt's and tilemm's NVFP4 bytes agree on blocks
    whose scale is at least 2^-9 (ModelOpt clamps smaller block scales up to 2^-9 and stores 1.0 for
    an all-zero block; tilemm stores what the formula gives)."""
    NVFP4QTensor = _modelopt()
    w = _weights(seed=10)
    w[3, 16:32] = 0.0  # one all-zero block
    decode = torch.tensor(2.0 ** -9)
    qt, scale, _ = NVFP4QTensor.quantize(w, 16, weights_scaling_factor_2=decode)
    ours = tilemm.quantize_nvfp4(w, global_scale=decode)
    normal = ours.scale.to(torch.float32) >= 2.0 ** -9
    assert not normal[3, 1] and scale[3, 1].to(torch.float32) == 1.0
    _assert_bits_equal(ours.scale[normal], scale[normal])
    keep = normal.repeat_interleave(8, dim=-1)
    assert torch.equal(ours.data[keep], qt._quantized_data[keep])


def test_modelopt_fp8_from_the_published_layout():
    """ModelOpt FP8 (per tensor): ``weight`` float8_e4m3fn and ``weight_scale`` fp32 0-d, built here
    from the published layout (dequantized = weight * weight_scale)."""
    w = _weights(seed=11)
    scale = w.abs().amax() / 448
    data = (w / scale).to(torch.float8_e4m3fn)
    q = checkpoints.from_modelopt({"weight": data, "weight_scale": scale, "input_scale": torch.tensor(1.0)})
    _assert_bits_equal(q.dequantize(), data.to(torch.float32) * scale)
    assert checkpoints.to_modelopt(q)["weight"] is data


def test_modelopt_model_round_trip(tmp_path):
    w = _weights(seed=12, n=64, k=128)
    model = torch.nn.Sequential(torch.nn.Linear(128, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    model[0].weight.data = w
    tilemm.quantize_model(model, "nvfp4", skip=["2"])
    state, config = tilemm.export_quantized(model, "modelopt")
    assert config == {"quant_algo": "NVFP4", "exclude_modules": ["2"], "group_size": 16}
    assert state["0.weight_scale_2"] is model[0].weight_global_scale or torch.equal(
        state["0.weight_scale_2"], model[0].weight_global_scale)
    fresh = torch.nn.Sequential(torch.nn.Linear(128, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    tilemm.load_quantized(fresh, state, convention="modelopt", quantization_config=config)
    assert isinstance(fresh[0], Linear) and type(fresh[2]) is torch.nn.Linear
    _assert_bits_equal(fresh[0].dequantize_weight(), model[0].dequantize_weight())


# ==================================================================================================
# gpt-oss
# ==================================================================================================


def _gpt_oss_tensors(experts=3, n=64, k=128, seed=13):
    """gpt-oss MXFP4 tensors from the published layout: random element bytes, e8m0 scale bytes in a
    range where every value is a normal bf16 (transformers decodes to bf16)."""
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (experts, n, k // 32, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(110, 140, (experts, n, k // 32), generator=g, dtype=torch.uint8)
    return blocks, scales


def test_gpt_oss_matches_transformers():
    pytest.importorskip("transformers")
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    blocks, scales = _gpt_oss_tensors()
    q = checkpoints.from_gpt_oss(blocks, scales)
    assert _same_storage(q.data, blocks) and _same_storage(q.scale, scales)
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16)  # (E, K, N): x @ W
    _assert_bits_equal(q.dequantize().transpose(1, 2).to(torch.bfloat16), theirs)
    back_blocks, back_scales = checkpoints.to_gpt_oss(q)
    assert torch.equal(back_blocks, blocks) and torch.equal(back_scales, scales)
    # One expert as a weight-only Linear computes x @ W[e] + b as transformers' expert does.
    bias = torch.randn(64)
    layer = Linear.from_quantized((blocks[1], scales[1]), convention="gpt-oss", bias=bias, weight_only=True)
    x = torch.randn(5, 128)
    # The same fp32 weights on both sides: equal up to the order of the fp32 accumulation.
    expected = x @ theirs[1].float() + bias
    assert (layer(x) - expected).abs().max() <= 1e-5 * expected.abs().max()


# ==================================================================================================
# tilemm.nn.Linear.from_quantized and the errors at the boundary
# ==================================================================================================


@pytest.mark.parametrize("fmt", ["mxfp8", "mxfp4", "nvfp4", "fp8"])
@pytest.mark.parametrize("weight_only", [False, True])
def test_from_quantized_equals_from_float(fmt, weight_only):
    """A Linear built from an already-quantized weight is the one from_float builds (buffers and output)."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(256, 40)
    reference = Linear.from_float(linear, fmt, weight_only=weight_only)
    layer = Linear.from_quantized(reference.quantized_weight()._replace(), bias=linear.bias,
                                  weight_only=weight_only)
    for name, buf in reference.named_buffers():
        _assert_bits_equal(getattr(layer, name), buf)
    x = torch.randn(3, 256)
    _assert_bits_equal(layer(x), reference(x))
    assert layer.extra_repr() == reference.extra_repr()


def test_from_quantized_relays_scales_to_the_layout_asked_for():
    w = _weights(seed=14)
    logical = tilemm.quantize_nvfp4(w)
    layer = Linear.from_quantized(logical)  # default: swizzled for the W4A4 path
    assert layer.quantized_weight().swizzled
    assert not Linear.from_quantized(tilemm.quantize_nvfp4(w, swizzle=True), weight_only=True).quantized_weight().swizzled
    _assert_bits_equal(layer.dequantize_weight(), logical.dequantize())


def test_errors_name_the_tensor_and_what_is_accepted():
    w = _weights(seed=15, n=32, k=64)
    q = tilemm.quantize_nvfp4(w)
    ok = {"weight_packed": q.data, "weight_scale": q.scale, "weight_global_scale": torch.tensor([1.0])}
    with pytest.raises(ValueError, match=r"convention must be one of 'compressed-tensors', 'modelopt', "
                                         r"'gpt-oss', 'torchao', got 'gguf'"):
        Linear.from_quantized(ok, convention="gguf")
    with pytest.raises(ValueError, match=r"format must be one of .*got 'nvfp4'"):
        checkpoints.from_compressed_tensors(ok, "nvfp4")
    with pytest.raises(TypeError, match=r"weight_packed must hold packed e2m1 bytes \(torch.uint8\), got "
                                        r"torch.float32"):
        checkpoints.from_compressed_tensors(dict(ok, weight_packed=w), "nvfp4-pack-quantized")
    with pytest.raises(ValueError, match=r"weight_scale must have shape \(32, 4\), got \(32, 2\)"):
        checkpoints.from_compressed_tensors(dict(ok, weight_scale=q.scale[:, :2]), "nvfp4-pack-quantized")
    with pytest.raises(ValueError, match=r"needs a tensor named 'weight_global_scale'; got tensors "
                                         r"weight_packed, weight_scale"):
        checkpoints.from_compressed_tensors({k: ok[k] for k in ("weight_packed", "weight_scale")},
                                            "nvfp4-pack-quantized")
    with pytest.raises(ValueError, match=r"does not use tensor\(s\) 'weight_zero_point'"):
        checkpoints.from_compressed_tensors(dict(ok, weight_zero_point=torch.zeros(32, 4)),
                                            "nvfp4-pack-quantized")
    with pytest.raises(ValueError, match=r"holds torch.float32 values that are not all float8_e4m3fn"):
        checkpoints.from_compressed_tensors(dict(ok, weight_scale=torch.full((32, 4), 0.3)),
                                            "nvfp4-pack-quantized")
    with pytest.raises(ValueError, match=r"num_bits=8, group_size=32 do not describe nvfp4-pack-quantized"):
        checkpoints.from_compressed_tensors(ok, "nvfp4-pack-quantized",
                                            weights={"num_bits": 8, "group_size": 32, "type": "float"})
    with pytest.raises(TypeError, match=r"scales must hold e8m0 bytes .* got torch.float32"):
        checkpoints.from_gpt_oss(torch.zeros(2, 4, 16, dtype=torch.uint8), torch.zeros(2, 4))
    with pytest.raises(ValueError, match=r"a Linear weight is 2-D"):
        Linear.from_quantized((torch.zeros(2, 4, 2, 16, dtype=torch.uint8),
                               torch.zeros(2, 4, 2, dtype=torch.uint8)), convention="gpt-oss")
    with pytest.raises(TypeError, match=r"expected a tilemm MXFP8Tensor, .* got dict"):
        Linear.from_quantized(ok)
    with pytest.raises(ValueError, match=r"ModelOpt checkpoints hold NVFP4 or per-tensor"):
        checkpoints.to_modelopt(tilemm.quantize_mxfp4(w))
    model = torch.nn.Sequential(torch.nn.Linear(64, 32))
    with pytest.raises(ValueError, match=r"needs the checkpoint's quantization config"):
        tilemm.load_quantized(model, {}, convention="compressed-tensors")
    with pytest.raises(ValueError, match=r"convention 'gpt-oss' loads gpt-oss experts blocks .* model has none"):
        tilemm.load_quantized(model, {}, convention="gpt-oss")
    config = {"format": "nvfp4-pack-quantized", "ignore": [],
              "config_groups": {"g": {"targets": ["Linear"], "weights": {"num_bits": 4, "group_size": 16}}}}
    with pytest.raises(ValueError, match=r"layer '0' is \(out, in\) = \(32, 64\) in the model but \(32, 32\)"):
        tilemm.load_quantized(model, {"0." + k: v[:, : v.shape[1] // 2] if v.ndim == 2 else v
                                      for k, v in ok.items()} | {"0.bias": torch.zeros(32)},
                              convention="compressed-tensors", quantization_config=config)
    layer_tensors = {"0." + k: v for k, v in ok.items()} | {"0.bias": torch.zeros(32)}
    with pytest.raises(ValueError, match=r"layer '0': .*does not use tensor\(s\) 'extra'"):
        tilemm.load_quantized(torch.nn.Sequential(torch.nn.Linear(64, 32)),
                              layer_tensors | {"0.extra": torch.zeros(1)},
                              convention="compressed-tensors", quantization_config=config)
    with pytest.raises(ValueError, match=r"does not fit the model: missing none; not used stray.weight"):
        tilemm.load_quantized(torch.nn.Sequential(torch.nn.Linear(64, 32)),
                              layer_tensors | {"stray.weight": torch.zeros(1)},
                              convention="compressed-tensors", quantization_config=config)
    loaded = tilemm.load_quantized(torch.nn.Sequential(torch.nn.Linear(64, 32)),
                                   layer_tensors | {"stray.weight": torch.zeros(1)}, strict=False,
                                   convention="compressed-tensors", quantization_config=config)
    assert isinstance(loaded[0], Linear)


# ==================================================================================================
# What real checkpoints and their users pass
# ==================================================================================================


def test_load_quantized_recognizes_a_whole_config_json():
    # Passing the whole config.json (with its "quantization_config" section) used to report every
    # quantized tensor missing; a dict that is no quantization config says what to pass.
    _ct()
    model = tiny_llama(seed=3, hidden=256, intermediate=384, layers=1, vocab=256)
    _, state, config = compressed_tensors_model("MXFP4A16", model)
    whole = {"architectures": ["LlamaForCausalLM"], "hidden_size": 256, "quantization_config": config}
    fresh = tiny_llama(seed=4, hidden=256, intermediate=384, layers=1, vocab=256)
    tilemm.load_quantized(fresh, state, convention="compressed-tensors", quantization_config=whole)
    assert isinstance(fresh.model.layers[0].mlp.down_proj, Linear)
    with pytest.raises(ValueError, match=r"config\['quantization_config'\]"):
        tilemm.load_quantized(tiny_llama(seed=4, hidden=256, intermediate=384, layers=1, vocab=256), state,
                              convention="compressed-tensors", quantization_config={"hidden_size": 256})
    # ModelOpt: the whole hf_quant_config.json, {"producer": ..., "quantization": {...}}.
    m = torch.nn.Sequential(torch.nn.Linear(128, 64))
    tilemm.quantize_model(m, "nvfp4")
    mstate, mconfig = tilemm.export_quantized(m, "modelopt")
    fresh_m = torch.nn.Sequential(torch.nn.Linear(128, 64))
    tilemm.load_quantized(fresh_m, mstate, convention="modelopt",
                          quantization_config={"producer": {"name": "modelopt"}, "quantization": mconfig})
    assert isinstance(fresh_m[0], Linear)


def test_tied_lm_head_stays_tied_as_compressed_tensors_saves_it(tmp_path):
    # compressed-tensors (through transformers' save_pretrained) stores a tied lm_head.weight once,
    # under the embedding. strict=True used to raise "missing lm_head.weight", strict=False to leave
    # lm_head at its random initialization (the tie broken by load_state_dict(assign=True)).
    _ct()
    model = tiny_llama(seed=0, hidden=256, intermediate=384, layers=1, vocab=256, tie=True)
    compressor, _, _ = compressed_tensors_model("MXFP4A16", model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.save_pretrained(tmp_path)
        compressor.update_config(str(tmp_path))
    from safetensors.torch import load_file

    stored = load_file(str(tmp_path / "model.safetensors"))
    assert "lm_head.weight" not in stored and "model.embed_tokens.weight" in stored  # the writer's layout
    for strict in (True, False):
        ours = tilemm.load_quantized(tiny_llama(seed=1, hidden=256, intermediate=384, layers=1, vocab=256, tie=True),
                                     tmp_path, convention="compressed-tensors", weight_only=True, strict=strict)
        assert ours.lm_head.weight is ours.model.embed_tokens.weight
        assert torch.equal(ours.lm_head.weight, stored["model.embed_tokens.weight"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compressor.decompress_model(model)
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours_logits, their_logits = ours(ids).logits, model(ids).logits
    assert (ours_logits.float() - their_logits.float()).abs().max().item() <= 2.0 ** -8 * their_logits.abs().max().item()
    # A checkpoint that holds a different lm_head for a model that ties it is refused.
    state = dict(stored)
    state["lm_head.weight"] = state["model.embed_tokens.weight"] + 1
    with pytest.raises(ValueError, match="ties 'lm_head.weight' to 'model.embed_tokens.weight'"):
        tilemm.load_quantized(tiny_llama(seed=1, hidden=256, intermediate=384, layers=1, vocab=256, tie=True),
                              state, convention="compressed-tensors",
                              quantization_config=json.loads((tmp_path / "config.json").read_text()))


@pytest.mark.parametrize("groups", [{"NVFP4A16": ["Linear"], "MXFP8A16": ["re:.*down_proj$"]},
                                    {"MXFP8A16": ["re:.*down_proj$"], "NVFP4A16": ["Linear"]},
                                    {"NVFP4A16": ["re:.*proj$"], "MXFP4A16": ["model.layers.0.mlp.up_proj"]}],
                         ids=["class_first", "regex_first", "regex_and_name"])
def test_mixed_precision_targets_resolve_as_compressed_tensors_does(groups):
    # compressed-tensors gives an exact name priority over a regex, and a regex over a class name,
    # whatever the order of the config groups; tilemm used to take the first group that matched
    # (down_proj read as NVFP4 although it was written in MXFP8).
    _ct()
    model = tiny_llama(seed=3, hidden=256, intermediate=384, layers=1, vocab=256)
    _, state, config = compressed_tensors_model(groups, model)
    written = {n: m.quantization_scheme for n, m in model.named_modules()
               if getattr(m, "quantization_scheme", None) is not None}
    ours = tilemm.load_quantized(tiny_llama(seed=4, hidden=256, intermediate=384, layers=1, vocab=256), state,
                                 convention="compressed-tensors", quantization_config=config)
    by_format = {"nvfp4": "NVFP4A16", "mxfp8": "MXFP8A16", "mxfp4": "MXFP4A16"}
    from compressed_tensors.quantization import preset_name_to_scheme

    assert len(written) == 7
    for name, scheme in written.items():
        layer = ours.get_submodule(name)
        assert isinstance(layer, Linear), name
        expected = preset_name_to_scheme(by_format[layer.format], ["x"]).weights
        assert scheme.weights == expected, (name, layer.format)
    assert ours.model.layers[0].mlp.down_proj.format in ("mxfp8", "nvfp4")


def _modelopt_llama(tmp_path, config, kv_fp8=False):
    _modelopt()
    from _checkpoint_peers import modelopt_checkpoint

    model = tiny_llama(seed=0, hidden=256, intermediate=384, layers=1, vocab=256, dtype=torch.float32)
    path = modelopt_checkpoint(model, tmp_path, config, kv_fp8=kv_fp8)
    from safetensors.torch import load_file

    return path, load_file(str(path / "model.safetensors"))


def test_modelopt_nvfp4_with_an_fp8_kv_cache_keeps_k_and_v_scales(tmp_path):
    # ModelOpt's example default (NVFP4 weights, FP8 KV cache) stores k_scale / v_scale beside the
    # k / v projections; load_quantized used to refuse the whole checkpoint, even with strict=False.
    path, stored = _modelopt_llama(tmp_path, "NVFP4_DEFAULT_CFG", kv_fp8=True)
    assert "model.layers.0.self_attn.k_proj.k_scale" in stored  # the writer's layout
    for strict in (True, False):
        ours = tilemm.load_quantized(tiny_llama(seed=1, hidden=256, intermediate=384, layers=1, vocab=256,
                                                dtype=torch.float32), path, convention="modelopt", strict=strict)
        attn = ours.model.layers[0].self_attn
        assert isinstance(attn.k_proj, Linear) and attn.k_proj.format == "nvfp4" and not attn.k_proj.weight_only
        assert torch.equal(attn.k_proj.k_scale, stored["model.layers.0.self_attn.k_proj.k_scale"])
        assert torch.equal(attn.v_proj.v_scale, stored["model.layers.0.self_attn.v_proj.v_scale"])
        assert torch.equal(attn.k_proj.weight, stored["model.layers.0.self_attn.k_proj.weight"])
    # The scales travel with the model's state dict (and so with export_quantized).
    assert "model.layers.0.self_attn.v_proj.v_scale" in ours.state_dict()


def test_modelopt_w4a16_nvfp4_loads_weight_only(tmp_path):
    # ModelOpt's weight-only NVFP4 (quant_algo W4A16_NVFP4, the same tensors as NVFP4) was refused.
    path, stored = _modelopt_llama(tmp_path, "W4A16_NVFP4_CFG")
    assert json.loads((path / "hf_quant_config.json").read_text())["quantization"]["quant_algo"] == "W4A16_NVFP4"
    ours = tilemm.load_quantized(tiny_llama(seed=1, hidden=256, intermediate=384, layers=1, vocab=256,
                                            dtype=torch.float32), path, convention="modelopt")
    layers = [(n, m) for n, m in ours.named_modules() if isinstance(m, Linear)]
    assert len(layers) == 7 and all(m.format == "nvfp4" and m.weight_only for _, m in layers)
    NVFP4QTensor = _modelopt()
    for name, layer in layers:
        w = stored[f"{name}.weight"]
        theirs = _modelopt_dequantize(NVFP4QTensor((w.shape[0], 2 * w.shape[1]), torch.float32, w),
                                      stored[f"{name}.weight_scale"], stored[f"{name}.weight_scale_2"])
        assert ((layer.dequantize_weight() - theirs).abs() <= REL_NVFP4 * theirs.abs()).all(), name
    # Asked explicitly, the activations are quantized too.
    block = tilemm.load_quantized(tiny_llama(seed=1, hidden=256, intermediate=384, layers=1, vocab=256,
                                             dtype=torch.float32), path, convention="modelopt", weight_only=False)
    assert not block.model.layers[0].mlp.down_proj.weight_only
