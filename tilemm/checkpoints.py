"""Whole quantized checkpoints written by other tools: load them into a model, bit for bit, and
export a model of ``tilemm.nn.Linear`` layers in another tool's convention.

:func:`load_quantized` swaps ``torch.nn.Linear`` layers for ``tilemm.nn.Linear`` (and experts
blocks for ``tilemm.moe.MoEExperts``) and fills them from the checkpoint's quantized bytes without ever
building the high-precision weights; :func:`export_quantized` writes a model's layers in
compressed-tensors' or ModelOpt's convention. One layer's tensors go through the converters of
``tilemm.conventions`` (re-exported here: :func:`to_tilemm` / :func:`from_tilemm` and the ``from_*`` /
``to_*`` pair of each convention), which say how each convention stores its numbers.

Experts blocks become ``tilemm.moe.MoEExperts`` when the checkpoint stores their experts quantized.
gpt-oss's (transformers' ``GptOssExperts``): ``"gpt-oss"``'s MXFP4 blocks; compressed-tensors' (and
ModelOpt's) per-expert ``<experts>.<i>.{gate,up,down}_proj`` layers in NVFP4 / MXFP4 / MXFP8, gate and
up rows interleaved into gpt-oss's gate_up; ModelOpt's fused NVFP4 export. The SiLU-gated experts of
Qwen3-MoE, Qwen2-MoE and Mixtral (``Qwen3MoeExperts``, ``Qwen2MoeExperts``, ``MixtralExperts``): the
same per-expert layers, gate rows then up rows, no bias (``_load_quantized_experts``).

What is *not* carried over: static activation scales (``input_scale``, ``input_global_scale``).
``tilemm.nn.Linear`` quantizes activations on every call from their own amax (or, with
``weight_only=True``, leaves them unquantized), so a W4A4 / W8A8 checkpoint runs with dynamic
activation scales.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
from typing import Mapping

import torch

from .conventions import (ACTIVATION_SCALE_NAMES, COMPRESSED_TENSORS_FORMATS, CONVENTIONS, KV_CACHE_SCALE_NAMES,
                          MODELOPT_ALGOS, _check_convention, _torchao_classes, from_compressed_tensors, from_gpt_oss,
                          from_modelopt, from_tilemm, from_torchao, linear_options, to_compressed_tensors,
                          to_gpt_oss, to_modelopt, to_tilemm, to_torchao)
from .conventions import _e4m3_scale, _fp32_scale, _get, _logical_scale, _packed_e2m1  # (the experts loaders)
from .formats import NVFP4
from .moe import MoEExperts, check_silu_experts, experts_activation, experts_dims
from .nn import Linear
from .packed import prepack
from .quantize import FP8Tensor, MXFP4Tensor, NVFP4Tensor

__all__ = [
    "CONVENTIONS",
    "COMPRESSED_TENSORS_FORMATS",
    "to_tilemm",
    "from_tilemm",
    "from_compressed_tensors",
    "to_compressed_tensors",
    "from_modelopt",
    "to_modelopt",
    "from_gpt_oss",
    "to_gpt_oss",
    "from_torchao",
    "to_torchao",
    "linear_options",
    "load_quantized",
    "export_quantized",
]

# ----------------------------------------------------------------------------------------------
# Whole models
# ----------------------------------------------------------------------------------------------


def _read_state_dict(fn: str, source) -> tuple[Mapping[str, torch.Tensor], dict | None]:
    """A state dict, a .safetensors file, or a directory of them (with config.json): tensors + config."""
    if isinstance(source, Mapping):
        return source, None
    if not isinstance(source, (str, os.PathLike)):
        raise TypeError(f"{fn}: state_dict_or_path must be a mapping of names to tensors, a .safetensors "
                        f"file or a directory holding them, got {type(source).__name__}")
    from safetensors.torch import load_file

    path = os.fspath(source)
    if os.path.isfile(path):
        files, folder = [path], os.path.dirname(path)
    elif os.path.isdir(path):
        files = sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".safetensors"))
        folder = path
        if not files:
            raise ValueError(f"{fn}: no .safetensors files in {path!r}")
    else:
        raise ValueError(f"{fn}: {path!r} is neither a file nor a directory")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        tensors.update(load_file(f))  # memory-mapped CPU tensors, in their stored dtypes
    config = None
    for name in ("hf_quant_config.json", "config.json"):
        p = os.path.join(folder, name)
        if os.path.isfile(p):
            with open(p) as fh:
                data = json.load(fh)
            config = data.get("quantization", data.get("quantization_config"))
            if config is not None:
                break
    return tensors, config


def _matches_name(name: str, target: str) -> bool:
    """compressed-tensors' name targets: ``re:<regex>`` (``re.match`` on the module name) or the name."""
    if target.startswith("re:"):
        return re.match(target[3:], name) is not None
    return target == name


def _matches_class(module: torch.nn.Module, target: str) -> bool:
    """compressed-tensors' class targets: the name of any torch.nn.Module class in the module's MRO."""
    return any(issubclass(c, torch.nn.Module) and c.__name__ == target for c in type(module).__mro__)


def _matches(name: str, module: torch.nn.Module, target: str) -> bool:
    return _matches_name(name, target) or _matches_class(module, target)


def _ct_scheme(config: Mapping, name: str, module: torch.nn.Module):
    """(format, weights args) of the config group that compressed-tensors gives this module, or None if
    its weight is not quantized.

    compressed-tensors' rules (0.20, ``apply_quantization_config`` / ``match_targets``): every target of
    every group maps to its group, a later group taking a target an earlier one also lists; a module in
    ``ignore`` is left alone; of the targets that match, an exact name comes first, then a regex (each
    kind in sorted order), then a class name; the first one's group is the module's. A group without
    ``weights`` leaves the weight unquantized."""
    if any(_matches(name, module, t) for t in config.get("ignore") or ()):
        return None
    target_group: dict[str, Mapping] = {}
    for group in (config.get("config_groups") or {}).values():
        for target in group.get("targets") or ():
            target_group[target] = group
    ordered = sorted(target_group, key=lambda t: ("re:" in t, t))
    matched = [t for t in ordered if _matches_name(name, t)]
    matched += [t for t in ordered if _matches_class(module, t) and t not in matched]
    if not matched:
        return None
    group = target_group[matched[0]]
    if not group.get("weights"):
        return None
    return group.get("format") or config.get("format"), group["weights"]


def _quantization_section(fn: str, convention: str, config: Mapping | None) -> Mapping | None:
    """The quantization config proper: a whole ``config.json`` (its ``quantization_config``) or
    ``hf_quant_config.json`` (its ``quantization``) is recognized and its section taken."""
    if config is None:
        return None
    for key in ("quantization_config", "quantization"):
        if isinstance(config.get(key), Mapping):
            return config[key]
    if convention == "compressed-tensors" and "config_groups" not in config:
        raise ValueError(f"{fn}: quantization_config has no 'config_groups' (keys: "
                         f"{', '.join(map(repr, sorted(config))) or 'none'}); pass the checkpoint's "
                         f"config['quantization_config'] (config.json's section), or the whole config.json")
    if convention == "modelopt" and "quant_algo" not in config:
        raise ValueError(f"{fn}: quantization_config has no 'quant_algo' (keys: "
                         f"{', '.join(map(repr, sorted(config))) or 'none'}); pass hf_quant_config.json's "
                         f"'quantization' section, or the whole file")
    return config


def _modelopt_algo(fn: str, config: Mapping) -> tuple[str, list]:
    algo = config.get("quant_algo")
    if algo not in MODELOPT_ALGOS:
        raise ValueError(f"{fn}: ModelOpt quant_algo {algo!r} is not one tilemm reads; accepted: "
                         f"{', '.join(map(repr, MODELOPT_ALGOS))}")
    return algo, list(config.get("exclude_modules") or config.get("ignore") or ())


def _keep_kv_cache_scales(model: torch.nn.Module, tensors: Mapping) -> set[str]:
    """Register each ``<module>.k_scale`` / ``<module>.v_scale`` of ``tensors`` as a buffer of that
    module of ``model`` (where it exists); returns the keys taken."""
    taken = set()
    for key, t in tensors.items():
        prefix, _, leaf = key.rpartition(".")
        if leaf not in KV_CACHE_SCALE_NAMES or not prefix:
            continue
        try:
            module = model.get_submodule(prefix)
        except AttributeError:
            continue
        module.register_buffer(leaf, t)
        taken.add(key)
    return taken


def _tied_groups(model: torch.nn.Module) -> list[list[str]]:
    """Names of the parameters that share one tensor (tied, e.g. ``lm_head.weight`` and the input
    embedding with ``tie_word_embeddings``), one list per tensor, in ``named_parameters`` order."""
    groups: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(name)
    return [names for names in groups.values() if len(names) > 1]


def _retie(fn: str, model: torch.nn.Module, tied: list[list[str]], loaded: Mapping) -> set[str]:
    """Tie again what ``load_state_dict(assign=True)`` untied: every name of a tied group takes the
    parameter of the group's first name that the checkpoint holds (the writers store a tied tensor
    once, as transformers' ``save_pretrained`` does). Returns the names filled that way. A name whose
    own checkpoint tensor differs from that one is an error: the model ties what the checkpoint does
    not."""
    own = dict(model.named_parameters(remove_duplicate=False))
    filled: set[str] = set()
    for group in tied:
        group = [n for n in group if n in own]  # a tied Linear swapped for a tilemm layer is gone
        present = [n for n in group if n in loaded]
        if len(group) < 2 or not present:
            continue
        source = present[0]
        param = own[source]
        for name in group:
            if name == source:
                continue
            if name in loaded and not torch.equal(loaded[name], loaded[source]):
                raise ValueError(f"{fn}: the model ties {name!r} to {source!r}, but the checkpoint holds "
                                 f"different tensors for them; build the model with the checkpoint's "
                                 f"config (e.g. tie_word_embeddings=False)")
            parent, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(parent), leaf, param)
            filled.add(name)
    return filled


def load_quantized(model: torch.nn.Module, state_dict_or_path, *, convention: str,
                   quantization_config: Mapping | None = None, weight_only: bool | None = None,
                   swizzle: bool | None = None, strict: bool = True) -> torch.nn.Module:
    """Load a quantized checkpoint into ``model``, swapping its quantized ``torch.nn.Linear`` layers for
    ``tilemm.nn.Linear``, in place.

    Args:
        model: the architecture of the checkpoint (e.g. built from its config with random weights);
            layers are matched by name.
        state_dict_or_path: the checkpoint's tensors: a mapping, a ``.safetensors`` file, or a
            directory of them; a directory's ``config.json`` (``quantization_config``) or
            ``hf_quant_config.json`` (``quantization``) is read when ``quantization_config`` is None.
        convention: ``"compressed-tensors"``, ``"modelopt"`` or ``"torchao"`` (tensor-subclass
            weights in the state dict, e.g. ``model.state_dict()`` after ``torchao.quantize_``).
            ``"gpt-oss"``: the MXFP4 experts blocks (``*_blocks`` / ``*_scales``) become
            ``tilemm.moe.MoEExperts`` modules; every other tensor loads as it is.
        quantization_config: compressed-tensors: the ``quantization_config`` dict (config groups
            with targets, ``ignore``, ``format``); ModelOpt: the ``quantization`` dict of
            ``hf_quant_config.json`` (``quant_algo``, ``exclude_modules``). Required for those two.
            The whole ``config.json`` / ``hf_quant_config.json`` dict is recognized too (its
            ``quantization_config`` / ``quantization`` section is taken); a dict that is neither
            raises ValueError.
        weight_only, swizzle: as for ``tilemm.nn.Linear.from_quantized``. ``weight_only=None`` (the
            default) follows the checkpoint: True for ModelOpt ``W4A16_NVFP4`` (16-bit activations),
            False otherwise.
        strict: raise ValueError when a checkpoint tensor is not used or a parameter is missing
            (static activation scales are always accepted and dropped, see the module docstring; an
            FP8 KV cache's ``k_scale`` / ``v_scale`` are always accepted and kept, as buffers of the
            module they are stored under, e.g. ``model.model.layers[0].self_attn.k_proj.k_scale``).

    Every other tensor (embeddings, norms, unquantized layers) is loaded with
    ``load_state_dict(..., assign=True)``, so it keeps the checkpoint's dtype. Parameters the model
    ties (an ``lm_head`` tied to the input embedding, which compressed-tensors and ModelOpt
    checkpoints store once, under the embedding) stay tied: each takes the one stored tensor.

    Returns:
        ``model``.
    """
    fn = "tilemm.load_quantized"
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"{fn}: model must be a torch.nn.Module, got {type(model).__name__}")
    _check_convention(fn, convention)
    tensors, found_config = _read_state_dict(fn, state_dict_or_path)
    if convention == "gpt-oss":
        used, new_keys = _load_gpt_oss_experts(fn, model, tensors)
        return _load_rest(fn, model, tensors, used, new_keys, strict)
    config = quantization_config if quantization_config is not None else found_config
    if config is not None and not isinstance(config, Mapping):
        raise TypeError(f"{fn}: quantization_config must be a dict, got {type(config).__name__}")
    config = _quantization_section(fn, convention, config)
    if convention in ("compressed-tensors", "modelopt") and config is None:
        raise ValueError(f"{fn}: convention {convention!r} needs the checkpoint's quantization config: pass "
                         f"quantization_config= or a directory with config.json / hf_quant_config.json")
    if convention == "compressed-tensors" and config.get("quant_method", "compressed-tensors") != \
            "compressed-tensors":
        raise ValueError(f"{fn}: quantization_config has quant_method {config.get('quant_method')!r}, "
                         f"expected 'compressed-tensors'")
    if convention == "modelopt":
        algo, exclude = _modelopt_algo(fn, config)
    if weight_only is None:
        weight_only = convention == "modelopt" and algo == "W4A16_NVFP4"

    # experts blocks (gpt-oss's, SiLU-gated) whose experts the checkpoint stores quantized: MoEExperts
    used, new_keys = _load_quantized_experts(fn, model, tensors, convention, config,
                                             algo if convention == "modelopt" else None)
    converted: dict[int, Linear] = {}
    for name, module in list(model.named_modules(remove_duplicate=False)):
        if type(module) is not torch.nn.Linear:
            continue
        prefix = name + "." if name else ""
        local = {k[len(prefix):]: v for k, v in tensors.items()
                 if k.startswith(prefix) and "." not in k[len(prefix):]}
        if convention == "compressed-tensors":
            scheme = _ct_scheme(config, name, module)
            if scheme is None:
                continue
            layer, options = local, dict(format=scheme[0], weights=scheme[1])
        elif convention == "modelopt":
            if any(fnmatch.fnmatchcase(name, p) for p in exclude) or "weight_scale" not in local:
                continue
            layer, options = local, dict(quant_algo=algo)
        else:
            if not isinstance(local.get("weight"), _torchao_classes()):
                continue
            layer, options = local["weight"], {}
        if not name:
            raise ValueError(f"{fn}: model is a bare torch.nn.Linear; use tilemm.nn.Linear.from_quantized")
        bias = local.get("bias")
        if convention != "torchao":
            layer = {k: v for k, v in local.items() if k != "bias" and k not in KV_CACHE_SCALE_NAMES}
        weight_tensors = layer if convention != "torchao" else {"weight": layer}
        try:
            q = to_tilemm(layer, convention, **options)
        except (TypeError, ValueError) as err:
            raise type(err)(f"{fn}: layer {name!r}: {err}") from None
        n = q.data.shape[-2]
        k = q.data.shape[-1] if isinstance(q, FP8Tensor) else q.format.logical_k(q.data.shape[-1])
        if (module.out_features, module.in_features) != (n, k):
            raise ValueError(f"{fn}: layer {name!r} is (out, in) = ({module.out_features}, "
                             f"{module.in_features}) in the model but ({n}, {k}) in the checkpoint")
        if (bias is None) != (module.bias is None):
            raise ValueError(f"{fn}: layer {name!r} has {'a' if module.bias is not None else 'no'} bias "
                             f"in the model but {'one' if bias is not None else 'none'} in the checkpoint")
        if id(module) not in converted:
            converted[id(module)] = Linear.from_quantized(q, bias=bias, weight_only=weight_only,
                                                          swizzle=swizzle)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, converted[id(module)])
        used.update(prefix + key for key in weight_tensors)
        used.update(prefix + key for key in local if key == "bias")
        new_keys.update(prefix + key for key in converted[id(module)].state_dict())
    return _load_rest(fn, model, tensors, used, new_keys, strict)


def _load_rest(fn: str, model, tensors, used: set, new_keys: set, strict: bool):
    """Load the checkpoint tensors the swapped modules did not take (``load_state_dict(assign=True)``),
    and with ``strict`` refuse a missing parameter or an unused tensor. Parameters the model ties stay
    tied (``_retie``)."""
    tied = _tied_groups(model)  # before load_state_dict(assign=True) breaks the ties
    dropped = {k for k in tensors if k.rpartition(".")[2] in ACTIVATION_SCALE_NAMES}
    own = set(model.state_dict())
    kv_scales = _keep_kv_cache_scales(model, {k: v for k, v in tensors.items() if k not in own})
    used |= kv_scales
    new_keys |= kv_scales
    rest = {k: v for k, v in tensors.items() if k not in used and k not in dropped}
    result = model.load_state_dict({k: v for k, v in rest.items() if k in own}, strict=False, assign=True)
    retied = _retie(fn, model, tied, rest)
    if strict:
        missing = sorted(set(result.missing_keys) - new_keys - retied)
        unexpected = sorted(k for k in rest if k not in own)
        if missing or unexpected:
            raise ValueError(f"{fn}: the checkpoint does not fit the model: missing "
                             f"{', '.join(missing) or 'none'}; not used {', '.join(unexpected) or 'none'}")
    return model


def _load_gpt_oss_experts(fn: str, model: torch.nn.Module, tensors: Mapping) -> tuple[set, set]:
    """Replace every gpt-oss experts block of ``model`` (transformers' ``GptOssExperts``, or a
    ``tilemm.moe.MoEExperts`` with activation "gpt-oss") by a ``MoEExperts`` filled from the
    checkpoint's ``<name>.gate_up_proj_blocks`` / ``_scales`` / ``_bias`` and ``<name>.down_proj_*``:
    the MXFP4 bytes are prepacked expert by expert on the module's device (the CPU for a meta
    module); no bf16 expert is built. Returns (checkpoint keys used, the new modules' state-dict
    keys)."""
    used: set[str] = set()
    new_keys: set[str] = set()
    found = 0
    for name, module in list(model.named_modules()):
        if experts_activation(module) != "gpt-oss" or not name:
            continue
        found += 1
        prefix = name + "."
        keys = {f"{p}_{s}": prefix + f"{p}_{s}" for p in ("gate_up_proj", "down_proj")
                for s in ("blocks", "scales")}
        missing = [k for k in keys.values() if k not in tensors]
        if missing:
            raise ValueError(f"{fn}: experts {name!r}: the checkpoint has no {', '.join(missing)} (gpt-oss "
                             f"MXFP4 experts are stored as <name>.gate_up_proj_blocks / _scales and "
                             f"<name>.down_proj_blocks / _scales)")
        try:
            gate_up = from_gpt_oss(tensors[keys["gate_up_proj_blocks"]], tensors[keys["gate_up_proj_scales"]])
            down = from_gpt_oss(tensors[keys["down_proj_blocks"]], tensors[keys["down_proj_scales"]])
        except (TypeError, ValueError) as err:
            raise type(err)(f"{fn}: experts {name!r}: {err}") from None
        e, h, i = module.num_experts, module.hidden_size, module.intermediate_size
        for proj, q, want in (("gate_up_proj", gate_up, (e, 2 * i, h)), ("down_proj", down, (e, h, i))):
            got = (*q.data.shape[:-1], 2 * q.data.shape[-1])
            if got != want:
                raise ValueError(f"{fn}: experts {name!r}: {proj} is (E, N, K) = {want} in the model but "
                                 f"{got} in the checkpoint")
        biases = {}
        for proj, n in (("gate_up_proj", 2 * i), ("down_proj", h)):
            b = tensors.get(prefix + proj + "_bias")
            if b is not None and tuple(b.shape) != (e, n):
                raise ValueError(f"{fn}: experts {name!r}: {proj}_bias is {tuple(b.shape)} in the checkpoint, "
                                 f"expected (E, N) = ({e}, {n})")
            biases[proj] = b
            if b is not None:
                used.add(prefix + proj + "_bias")
        device = next((t.device for t in module.buffers() if t.device.type != "meta"),
                      next((t.device for t in module.parameters() if t.device.type != "meta"),
                           torch.device("cpu")))
        packed = [prepack([MXFP4Tensor(q.data[x].to(device), q.scale[x].to(device)) for x in range(e)])
                  for q in (gate_up, down)]
        new = MoEExperts(*packed, biases["gate_up_proj"], biases["down_proj"],
                         alpha=getattr(module, "alpha", 1.702), limit=getattr(module, "limit", 7.0))
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, new)
        used.update(keys.values())
        new_keys.update(prefix + k for k in new.state_dict())
    if not found:
        raise ValueError(f"{fn}: convention 'gpt-oss' loads gpt-oss experts blocks (GptOssExperts), and "
                         f"model has none")
    return used, new_keys


def export_quantized(model: torch.nn.Module, convention: str) -> tuple[dict[str, torch.Tensor], dict]:
    """A model's state dict in ``convention`` (``"compressed-tensors"`` or ``"modelopt"``) and the
    quantization config to put next to it (compressed-tensors: ``config.json``'s
    ``quantization_config``; ModelOpt: ``hf_quant_config.json``'s ``quantization``).

    Every ``tilemm.nn.Linear`` becomes that convention's tensors (see :func:`to_compressed_tensors`,
    :func:`to_modelopt`); every other tensor is passed through. Tensors are views where the layouts
    agree, so save them (``safetensors.torch.save_file``) before changing the model.
    """
    fn = "tilemm.export_quantized"
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"{fn}: model must be a torch.nn.Module, got {type(model).__name__}")
    if convention not in ("compressed-tensors", "modelopt"):
        raise ValueError(f"{fn}: convention must be 'compressed-tensors' or 'modelopt', got {convention!r}")
    state = dict(model.state_dict())
    groups: dict[tuple, list[str]] = {}
    algos = set()
    layers = [(n, m) for n, m in model.named_modules() if isinstance(m, Linear)]
    if not layers:
        raise ValueError(f"{fn}: model has no tilemm.nn.Linear layer to export")
    ignore = [n for n, m in model.named_modules() if type(m) is torch.nn.Linear]
    for name, module in layers:
        prefix = name + "." if name else ""
        for key in ("weight", "weight_scale", "weight_global_scale"):
            state.pop(prefix + key, None)
        q = module.quantized_weight()
        if convention == "compressed-tensors":
            tensors, fmt, args = to_compressed_tensors(q)
            groups.setdefault((fmt, json.dumps(args, sort_keys=True)), []).append(name)
        else:
            tensors = to_modelopt(q)
            algos.add("NVFP4" if isinstance(q, NVFP4Tensor) else "FP8")
        state.update({prefix + k: v for k, v in tensors.items()})
    if convention == "modelopt":
        if len(algos) != 1:
            raise ValueError(f"{fn}: a ModelOpt checkpoint has one quant_algo; the model mixes "
                             f"{', '.join(sorted(algos))}")
        algo = algos.pop()
        config = {"quant_algo": algo, "exclude_modules": ignore}
        if algo == "NVFP4":
            config["group_size"] = NVFP4.block
        return state, config
    config_groups = {}
    for i, ((fmt, args), names) in enumerate(sorted(groups.items())):
        config_groups[f"group_{i}"] = {"targets": names, "weights": json.loads(args),
                                       "input_activations": None, "output_activations": None,
                                       "format": fmt}
    formats = {fmt for fmt, _ in groups}
    config = {"quant_method": "compressed-tensors", "quantization_status": "compressed",
              "format": formats.pop() if len(formats) == 1 else "mixed-precision",
              "config_groups": config_groups, "ignore": ignore}
    return state, config


# ----------------------------------------------------------------------------------------------
# Mixture-of-experts blocks from compressed-tensors and ModelOpt checkpoints
# ----------------------------------------------------------------------------------------------

#: The projections of one expert in per-expert checkpoints (``<experts>.<i>.<proj>.<tensor>``).
_EXPERT_PROJS = ("gate_proj", "up_proj", "down_proj")


def _experts_device(module: torch.nn.Module) -> torch.device:
    return next((t.device for t in list(module.buffers()) + list(module.parameters()) if t.device.type != "meta"),
                torch.device("cpu"))


def _expert_indices(tensors: Mapping, prefix: str) -> list[int]:
    """The expert numbers i of the keys ``<prefix><i>.<proj>.<tensor>``, sorted."""
    found = set()
    for key in tensors:
        if key.startswith(prefix):
            head, _, rest = key[len(prefix):].partition(".")
            if head.isdigit() and rest.partition(".")[0] in _EXPERT_PROJS:
                found.add(int(head))
    return sorted(found)


def _fuse_gate_up(fn: str, where: str, gate, up):
    """One expert's gate_up rows from separate gate (I, H) and up (I, H) quantized weights, in
    ``MoEExperts``' layout for either gating: interleaved (row 2j = gate row j, row 2j + 1 = up row
    j). Rows are quantized independently along K, so the fused tensor holds exactly both weights'
    values. NVFP4 needs one per-tensor scale for both."""
    if type(gate) is not type(up) or gate.data.shape != up.data.shape:
        raise ValueError(f"{fn}: {where}: gate_proj ({type(gate).__name__} {tuple(gate.data.shape)}) and up_proj "
                         f"({type(up).__name__} {tuple(up.data.shape)}) must have one format and shape")

    def rows(a, b):
        return torch.stack((a, b), dim=-2).reshape(*a.shape[:-2], 2 * a.shape[-2], a.shape[-1])

    data = rows(gate.data, up.data)
    scale = rows(_logical_scale(gate), _logical_scale(up))
    if isinstance(gate, NVFP4Tensor):
        if not bool((gate.global_scale == up.global_scale).all()):
            raise ValueError(f"{fn}: {where}: gate_proj and up_proj have different NVFP4 per-tensor scales "
                             f"({float(gate.global_scale)!r} and {float(up.global_scale)!r}); the fused gate_up "
                             f"projection has one per expert (quantize with shared gate / up global scales)")
        return NVFP4Tensor(data, scale.view(torch.float8_e4m3fn), gate.global_scale)
    return type(gate)(data, scale)


def _refuse_fp8_experts(fn: str, where: str, q) -> None:
    if isinstance(q, FP8Tensor):
        raise ValueError(f"{fn}: {where}: FP8 experts (per tensor, per channel or 128x128 blocks) have no "
                         f"grouped-kernel layout; tilemm.moe takes MXFP4, NVFP4 or MXFP8 experts")


def _per_expert_weights(fn: str, name: str, tensors: Mapping, indices: list[int], convention: str,
                        config: Mapping | None, algo: str | None,
                        activation: str = "gpt-oss") -> tuple[list, list, dict, set]:
    """Per-expert checkpoints (compressed-tensors, ModelOpt per-expert export):
    ``<name>.<i>.{gate,up,down}_proj.<tensor>`` -> (gate_up quantized per expert, gate / up rows
    interleaved (``_fuse_gate_up``), down per expert, biases, keys used). "silu" experts have no bias:
    a stored bias raises ValueError."""
    probe = torch.nn.Linear(1, 1, device="meta")  # compressed-tensors' class targets ("Linear") match it
    gate_up, down, used = [], [], set()
    biases: dict[str, list] = {"gate_up_proj": [], "down_proj": []}
    for i in indices:
        qs = {}
        for proj in _EXPERT_PROJS:
            layer = f"{name}.{i}.{proj}"
            local = {k[len(layer) + 1:]: v for k, v in tensors.items()
                     if k.startswith(layer + ".") and "." not in k[len(layer) + 1:]}
            bias = local.pop("bias", None)
            where = f"experts {name!r}: expert {i} {proj}"
            if bias is not None and activation == "silu":
                raise ValueError(f"{fn}: {where}: the checkpoint has a bias ({layer}.bias), but the model's "
                                 f"SiLU-gated experts have none")
            try:
                if convention == "compressed-tensors":
                    scheme = _ct_scheme(config, layer, probe)
                    if scheme is None:
                        raise ValueError("the quantization config leaves it unquantized (no config group "
                                         "targets it, or it is ignored)")
                    q = from_compressed_tensors(local, scheme[0], weights=scheme[1])
                else:
                    q = from_modelopt(local, quant_algo=algo)
            except (TypeError, ValueError) as err:
                raise type(err)(f"{fn}: {where}: {err}") from None
            _refuse_fp8_experts(fn, where, q)
            qs[proj] = (q, bias)
            used.update(f"{layer}.{k}" for k in local)
            if bias is not None:
                used.add(f"{layer}.bias")
        gate_up.append(_fuse_gate_up(fn, f"experts {name!r}: expert {i}", qs["gate_proj"][0], qs["up_proj"][0]))
        down.append(qs["down_proj"][0])
        gb, ub = qs["gate_proj"][1], qs["up_proj"][1]
        if (gb is None) != (ub is None):
            raise ValueError(f"{fn}: experts {name!r}: expert {i} has a bias on only one of gate_proj and up_proj")
        biases["gate_up_proj"].append(None if gb is None else torch.stack((gb, ub), dim=-1).reshape(-1))
        biases["down_proj"].append(qs["down_proj"][1])
    stacked = {}
    for proj, values in biases.items():
        if all(v is None for v in values):
            stacked[proj] = None
        elif any(v is None for v in values):
            raise ValueError(f"{fn}: experts {name!r}: {proj} has a bias on some experts only")
        else:
            stacked[proj] = torch.stack(values)
    return gate_up, down, stacked, used


def _modelopt_fused_weights(fn: str, name: str, tensors: Mapping, algo: str) -> tuple[list, list, dict, set]:
    """ModelOpt's export of fused (bmm-style) gpt-oss experts, NVFP4 (ModelOpt 0.47,
    ``_export_quantized_weight``): ``<name>.gate_up_proj`` uint8 (E, K/2, N), the packed (E, N, K/2)
    bytes transposed back to transformers' (E, in, out) order; ``<name>.gate_up_proj_weight_scale``
    e4m3 (E, K/16, N) likewise; ``<name>.gate_up_proj_weight_scale_2`` fp32, the decode scale, one
    for all experts (() or (1,)) or one per expert (E,); ``_input_scale`` not used; ``_bias`` (E, N);
    the same for ``down_proj``. Each expert's bytes are transposed back (a byte copy)."""
    if algo not in ("NVFP4", "W4A16_NVFP4"):
        raise ValueError(f"{fn}: experts {name!r}: ModelOpt {algo} fused experts have no grouped-kernel layout; "
                         f"tilemm.moe takes NVFP4 ones from ModelOpt")
    out, used, biases = {}, set(), {}
    for proj in ("gate_up_proj", "down_proj"):
        key = f"{name}.{proj}"
        where = f"experts {name!r}: {proj}"
        data = _packed_e2m1(fn, key, _get(fn, tensors, key, where), 1)
        if data.ndim != 3:
            raise ValueError(f"{fn}: {key} must be (E, K/2, N), got shape {tuple(data.shape)}")
        e, half_k, n = data.shape
        if (2 * half_k) % NVFP4.block:
            raise ValueError(f"{fn}: {key} is (E, K/2, N) = {tuple(data.shape)}: K = {2 * half_k} is not a "
                             f"multiple of NVFP4's block {NVFP4.block}")
        scale = _e4m3_scale(fn, key + "_weight_scale", _get(fn, tensors, key + "_weight_scale", where),
                            (e, 2 * half_k // NVFP4.block, n))
        s2 = _get(fn, tensors, key + "_weight_scale_2", where)
        decode = _fp32_scale(fn, key + "_weight_scale_2", s2, ((), (1,), (e,))).reshape(-1).expand(e)
        data, scale = data.transpose(1, 2), scale.transpose(1, 2)
        out[proj] = [NVFP4Tensor(data[x].contiguous(), scale[x].contiguous(), decode[x].clone()) for x in range(e)]
        used.update(k for k in (key, key + "_weight_scale", key + "_weight_scale_2", key + "_input_scale")
                    if k in tensors)
        biases[proj] = tensors.get(key + "_bias")
        if biases[proj] is not None:
            used.add(key + "_bias")
    return out["gate_up_proj"], out["down_proj"], biases, used


def _load_quantized_experts(fn: str, model: torch.nn.Module, tensors: Mapping, convention: str,
                            config: Mapping | None, algo: str | None) -> tuple[set, set]:
    """Replace every experts block of ``model`` (``tilemm.moe.experts_activation``: gpt-oss's, the
    SiLU-gated ones, or a ``MoEExperts``) whose quantized experts the checkpoint holds by a
    ``tilemm.moe.MoEExperts`` of the same gating (compressed-tensors: per-expert
    ``<name>.<i>.{gate,up,down}_proj`` layers; ModelOpt: the same per-expert layers, or for gpt-oss
    the fused NVFP4 export). gate_proj and up_proj rows are fused into gate_up interleaved, the
    module's layout for either gating (``_fuse_gate_up``); bytes are prepacked on the module's
    device, no high-precision expert is built. A block the checkpoint stores unquantized is left to
    the plain state-dict load. Returns (checkpoint keys used, the new modules' keys)."""
    used: set[str] = set()
    new_keys: set[str] = set()
    for name, module in list(model.named_modules()):
        activation = experts_activation(module)
        if not name or activation is None:
            continue
        indices = _expert_indices(tensors, name + ".")
        if indices:
            gate_up, down, biases, keys = _per_expert_weights(fn, name, tensors, indices, convention, config, algo,
                                                              activation)
        elif activation == "gpt-oss" and convention == "modelopt" and f"{name}.gate_up_proj_weight_scale" in tensors:
            gate_up, down, biases, keys = _modelopt_fused_weights(fn, name, tensors, algo)
        else:
            continue
        if activation == "silu" and not isinstance(module, MoEExperts):
            check_silu_experts(f"{fn}: experts {name!r}", module)  # its act_fn is SiLU, no bias
        e, h, i = experts_dims(module)
        if indices and indices != list(range(e)):
            raise ValueError(f"{fn}: experts {name!r}: the model has {e} experts, the checkpoint experts "
                             f"{indices[0]} .. {indices[-1]} ({len(indices)} of them)")
        if len(gate_up) != e:
            raise ValueError(f"{fn}: experts {name!r}: the model has {e} experts, the checkpoint {len(gate_up)}")
        for proj, qs, want in (("gate_up_proj", gate_up, (2 * i, h)), ("down_proj", down, (h, i))):
            got = (qs[0].data.shape[-2], qs[0].format.logical_k(qs[0].data.shape[-1]))
            if got != want:
                raise ValueError(f"{fn}: experts {name!r}: {proj} is (N, K) = {want} per expert in the model but "
                                 f"{got} in the checkpoint")
            b = biases[proj]
            if b is not None and tuple(b.shape) != (e, want[0]):
                raise ValueError(f"{fn}: experts {name!r}: {proj}_bias is {tuple(b.shape)} in the checkpoint, "
                                 f"expected (E, N) = ({e}, {want[0]})")
        device = _experts_device(module)
        try:
            packed = [prepack([type(q)(*(t.to(device) for t in q)) for q in qs]) for qs in (gate_up, down)]
        except (TypeError, ValueError) as err:
            raise type(err)(f"{fn}: experts {name!r}: {err}") from None
        new = MoEExperts(*packed, biases["gate_up_proj"], biases["down_proj"],
                         alpha=getattr(module, "alpha", 1.702), limit=getattr(module, "limit", 7.0),
                         activation=activation)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, new)
        used |= keys
        new_keys.update(f"{name}.{k}" for k in new.state_dict())
    return used, new_keys
