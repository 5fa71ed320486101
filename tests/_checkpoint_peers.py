"""Quantized checkpoints made by the libraries that write them, for tests/test_checkpoints.py.

compressed-tensors is the format library of llm-compressor: llm-compressor attaches a quantization
scheme to each Linear, observes the weights' min / max to compute the scales, and lets compressed-
tensors' ``ModelCompressor`` turn every module into its stored tensors. ``compressed_tensors_model``
does the same with compressed-tensors alone: ``apply_quantization_config``, then the scales from
compressed-tensors' own ``calculate_qparams`` / ``generate_gparam`` over the whole weight (what
llm-compressor's default min-max observer feeds them), then ``ModelCompressor.compress_model``.
"""

from __future__ import annotations

import warnings

import torch


def tiny_llama(seed: int = 0, dtype=torch.bfloat16, hidden=256, intermediate=512, layers=2, vocab=512,
               tie=False):
    """A LlamaForCausalLM built from a config with random weights (no download); ``tie``:
    tie_word_embeddings (lm_head shares the input embedding's weight)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=128, tie_word_embeddings=tie)
    return LlamaForCausalLM(config).to(dtype).eval()


def calibrate_weights(model: torch.nn.Module) -> None:
    """Fill every quantized module's weight_scale (and weight_global_scale) as a min-max observer would."""
    from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam

    for _, module in model.named_modules():
        scheme = getattr(module, "quantization_scheme", None)
        if scheme is None or scheme.weights is None:
            continue
        args, w = scheme.weights, module.weight.data
        global_scale = None
        if args.strategy == "tensor_group":
            amin, amax = torch.aminmax(w)
            global_scale = generate_gparam(amin.float(), amax.float())
            module.weight_global_scale.data.copy_(global_scale)
        if args.strategy == "tensor":
            lo, hi = w.amin(), w.amax()
        elif args.strategy == "channel":
            lo, hi = w.amin(dim=1, keepdim=True), w.amax(dim=1, keepdim=True)
        elif args.strategy == "block":
            bh, bw = args.block_structure
            tiles = w.reshape(w.shape[0] // bh, bh, w.shape[1] // bw, bw)
            lo, hi = tiles.amin(dim=(1, 3)), tiles.amax(dim=(1, 3))
        else:  # group, tensor_group: one scale per group_size elements of a row
            groups = w.unflatten(-1, (w.shape[-1] // args.group_size, args.group_size))
            lo, hi = groups.amin(dim=-1), groups.amax(dim=-1)
        scale, _ = calculate_qparams(lo, hi, args, global_scale=global_scale)
        module.weight_scale.data = scale.to(module.weight_scale.dtype).reshape(module.weight_scale.shape)


def compressed_tensors_model(preset, model: torch.nn.Module, ignore=("lm_head",)):
    """Quantize ``model`` in place with a compressed-tensors preset scheme ("NVFP4A16", "MXFP4A16",
    "MXFP8", "FP8_DYNAMIC", "FP8", "FP8_BLOCK", ...) for every Linear, or with several
    (``{preset: targets, ...}``, one config group each, in that order), and compress it.

    Returns ``(compressor, state_dict, quantization_config)``: the stored tensors and the
    ``quantization_config`` dict that compressed-tensors writes into config.json.
    """
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (QuantizationConfig, apply_quantization_config,
                                                 preset_name_to_scheme)

    presets = {preset: ["Linear"]} if isinstance(preset, str) else preset
    groups = {f"group_{i}": preset_name_to_scheme(name, list(targets))
              for i, (name, targets) in enumerate(presets.items())}
    config = QuantizationConfig(config_groups=groups, ignore=list(ignore))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        apply_quantization_config(model, config)
        calibrate_weights(model)
        compressor = ModelCompressor.from_pretrained_model(model)
        compressor.compress_model(model)
    qconfig = compressor.quantization_config.model_dump(exclude=["quant_method"])
    qconfig["quant_method"] = "compressed-tensors"
    state = {k: v.detach() for k, v in model.state_dict().items()}
    return compressor, state, _jsonable(qconfig)


def _jsonable(value):
    """The config as config.json holds it (dtypes as strings), as compressed-tensors' update_config writes."""
    import json

    return json.loads(json.dumps(value, default=str))


def modelopt_checkpoint(model: torch.nn.Module, path, config: str = "NVFP4_DEFAULT_CFG", kv_fp8: bool = False):
    """Quantize ``model`` in place with ModelOpt (``mtq.quantize`` with the named config, calibrated on
    one random batch; ``kv_fp8`` adds ``FP8_KV_CFG``, an FP8 KV cache, as ModelOpt's examples do by
    default) and export it with ``export_hf_checkpoint`` to ``path`` (safetensors, config.json and
    hf_quant_config.json)."""
    import copy

    import modelopt.torch.quantization as mtq
    from modelopt.torch.export import export_hf_checkpoint

    model.config.architectures = [type(model).__name__]
    cfg = copy.deepcopy(getattr(mtq, config))
    if kv_fp8:
        cfg["quant_cfg"] = list(cfg["quant_cfg"]) + list(mtq.FP8_KV_CFG["quant_cfg"])
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mtq.quantize(model, cfg, forward_loop=lambda m: m(ids))
        export_hf_checkpoint(model, export_dir=str(path))
    return path
