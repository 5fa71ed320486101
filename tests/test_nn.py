"""tilemm.nn.Linear and tilemm.quantize_model on the CPU (the exact reference path).

The oracle for the quantized forward is the same computation spelled out with the public functions
(quantize the rows of x, ``tilemm.linear``), which the matmul and quantizer tests pin against fp64;
here the point is the module plumbing: shapes, dtypes, buffers, state_dict, dtype casts, swapping.
"""

from __future__ import annotations

import copy
import io
import warnings

import pytest
import torch

from _gpu import GPU_SKIP_REASON
import torch.nn.functional as F

import tilemm
from tilemm.nn import Linear

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2

# (id, from_float keywords, quantizer for the activation rows, quantizer for the weight)
CONFIGS = [
    ("mxfp8", dict(format="mxfp8"), lambda t: tilemm.quantize_mxfp8(t, swizzle=True), None),
    ("mxfp8-e5m2-floor-logical", dict(format="mxfp8", elem_dtype=E5M2, rounding="floor", swizzle=False),
     lambda t: tilemm.quantize_mxfp8(t, elem_dtype=E5M2, rounding="floor"), None),
    ("mxfp4", dict(format="mxfp4"), lambda t: tilemm.quantize_mxfp4(t, swizzle=True), None),
    ("nvfp4", dict(format="nvfp4"), lambda t: tilemm.quantize_nvfp4(t, swizzle=True), None),
    ("fp8-row", dict(format="fp8"), lambda t: tilemm.quantize_fp8(t, granularity="row"), None),
    ("fp8-tensor-e5m2", dict(format="fp8", granularity="tensor", elem_dtype=E5M2),
     lambda t: tilemm.quantize_fp8(t, granularity="tensor", elem_dtype=E5M2), None),
    ("fp8-128x128", dict(format="fp8", granularity=(128, 128)),
     lambda t: tilemm.quantize_fp8(t, granularity=(1, 128)),
     lambda t: tilemm.quantize_fp8(t, granularity=(128, 128))),
]
CONFIG_IDS = [c[0] for c in CONFIGS]
WEIGHT_ONLY = [("mxfp8", {}), ("mxfp4", {}), ("nvfp4", {}), ("fp8", {}), ("nvfp4", dict(swizzle=True))]


def _linear(in_features=256, out_features=17, bias=True, seed=0):
    torch.manual_seed(seed)
    return torch.nn.Linear(in_features, out_features, bias=bias)


def _x(*shape, dtype=torch.float32, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(dtype)


# --------------------------------------------------------------------------------------------------
# forward
# --------------------------------------------------------------------------------------------------

# Leading dims: none (a single vector), one, two; 0 rows (an empty batch); bf16 / fp16 / fp32.
SHAPES = [(256,), (7, 256), (2, 3, 256), (0, 256)]


@pytest.mark.parametrize("name,kw,quantize_x,quantize_w", CONFIGS, ids=CONFIG_IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_forward_is_quantize_then_tilemm_linear(name, kw, quantize_x, quantize_w, dtype):
    lin = _linear()
    q = Linear.from_float(lin, **kw)
    w_q = (quantize_w or quantize_x)(lin.weight.detach())
    for shape in SHAPES:
        x = _x(*shape, dtype=dtype)
        out = q(x)
        assert out.shape == (*shape[:-1], 17) and out.dtype == dtype
        rows = x.reshape(-1, 256)
        expected = tilemm.linear(quantize_x(rows), w_q, bias=lin.bias.detach(), out_dtype=dtype)
        torch.testing.assert_close(out, expected.reshape(*shape[:-1], 17), rtol=0, atol=0)


@pytest.mark.parametrize("fmt,kw", WEIGHT_ONLY, ids=[f"{f}{'-swizzled' if k else ''}" for f, k in WEIGHT_ONLY])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_weight_only_forward(fmt, kw, dtype):
    """Block-scaled formats: the fused weight-only path, x @ dequantize(w).T accumulated in fp32 and
    rounded once (equal to tilemm.linear on the prepacked weight, close to an fp64 product). fp8:
    dequantize, round to x's dtype, F.linear."""
    lin = _linear()
    q = Linear.from_float(lin, fmt, weight_only=True, **kw)
    x = _x(2, 5, 256, dtype=dtype)
    w_q = q.quantized_weight()
    assert w_q.swizzled == kw.get("swizzle", False)
    out = q(x)
    if fmt == "fp8":
        w = tilemm.dequantize(w_q).to(dtype)
        torch.testing.assert_close(out, F.linear(x, w, lin.bias.detach().to(dtype)), rtol=0, atol=0)
        return
    bias = lin.bias.detach()
    torch.testing.assert_close(out, tilemm.linear(x, tilemm.prepack(w_q), bias=bias), rtol=0, atol=0)
    ref = x.double() @ tilemm.dequantize(w_q).double().T + bias.double()
    err = ((out.double() - ref).norm() / ref.norm()).item()
    assert err < (1e-6 if dtype == torch.float32 else 4e-3), err


def test_quantized_weight_is_what_the_quantizer_returns():
    lin = _linear(bias=False)
    q = Linear.from_float(lin, "nvfp4")
    ref = tilemm.quantize_nvfp4(lin.weight.detach(), swizzle=True)
    got = q.quantized_weight()
    assert type(got) is tilemm.NVFP4Tensor and q.bias is None
    assert all(torch.equal(a.view(torch.uint8) if a.element_size() == 1 else a,
                           b.view(torch.uint8) if b.element_size() == 1 else b) for a, b in zip(got, ref))


def test_close_to_the_float_layer():
    # A coarse sanity bound (relative Frobenius error) on Gaussian data, not a numerics contract.
    lin = _linear(512, 64)
    x = _x(32, 512)
    ref = lin(x).detach()
    bounds = {"mxfp8": 0.06, "fp8": 0.06, "mxfp4": 0.25, "nvfp4": 0.2}
    for fmt, bound in bounds.items():
        err = (Linear.from_float(lin, fmt)(x) - ref).norm() / ref.norm()
        assert err < bound, (fmt, err.item())


def test_compile_fullgraph_equals_eager():
    torch._dynamo.reset()
    model = torch.nn.Sequential(_linear(128, 64), torch.nn.GELU(), _linear(64, 32, seed=2))
    tilemm.quantize_model(model, "mxfp8")
    x = _x(4, 9, 128)
    assert torch.equal(torch.compile(model, fullgraph=True)(x), model(x))


# --------------------------------------------------------------------------------------------------
# state_dict, dtype casts
# --------------------------------------------------------------------------------------------------

def _roundtrip(state_dict):
    buf = io.BytesIO()
    torch.save(state_dict, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def _same_bytes(a, b):
    return a.dtype == b.dtype and torch.equal(a.view(torch.uint8) if a.element_size() == 1 else a,
                                              b.view(torch.uint8) if b.element_size() == 1 else b)


@pytest.mark.parametrize("name,kw,quantize_x,quantize_w", CONFIGS, ids=CONFIG_IDS)
def test_state_dict_round_trip_into_a_new_module(name, kw, quantize_x, quantize_w):
    q = Linear.from_float(_linear(), **kw)
    saved = _roundtrip(q.state_dict())
    fresh = Linear(256, 17, True, **kw)
    assert not torch.equal(fresh(_x(3, 256)), q(_x(3, 256)))  # a fresh module holds zeros
    fresh.load_state_dict(saved)
    assert all(_same_bytes(a, b) for a, b in zip(fresh.state_dict().values(), q.state_dict().values()))
    x = _x(3, 256)
    assert torch.equal(fresh(x), q(x))


def test_state_dict_round_trip_of_a_quantized_model():
    def make(seed):
        torch.manual_seed(seed)
        return torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.ReLU(), torch.nn.Linear(96, 8))

    model = tilemm.quantize_model(make(0), "nvfp4")
    saved = _roundtrip(model.state_dict())
    other = tilemm.quantize_model(make(1), "nvfp4")  # different weights until loaded
    x = _x(5, 64)
    assert not torch.equal(other(x), model(x))
    other.load_state_dict(saved)
    assert torch.equal(other(x), model(x))


def test_loading_another_encoding_is_refused():
    saved = Linear.from_float(_linear(), "mxfp8", elem_dtype=E5M2).state_dict()
    with pytest.raises(RuntimeError, match=r"weight: the state dict holds torch.float8_e5m2 but this "
                                           r"tilemm.nn.Linear \(format='mxfp8', swizzle=True\) stores torch.float8_e4m3fn"):
        Linear(256, 17, format="mxfp8").load_state_dict(saved)


@pytest.mark.parametrize("cast", ["to_bf16", "half", "bfloat16", "double"])
def test_dtype_casts_keep_the_quantized_buffers(cast):
    q = Linear.from_float(_linear(), "nvfp4")
    before = {k: v.clone() for k, v in q.state_dict().items() if k != "bias"}
    {"to_bf16": lambda: q.to(torch.bfloat16), "half": q.half, "bfloat16": q.bfloat16, "double": q.double}[cast]()
    after = q.state_dict()
    assert all(_same_bytes(before[k], after[k]) for k in before)
    target = {"to_bf16": torch.bfloat16, "half": torch.float16, "bfloat16": torch.bfloat16, "double": torch.float64}
    assert q.bias.dtype == target[cast]  # the bias follows the module, like nn.Linear's
    if cast != "double":  # activations are float32 / bf16 / fp16
        x = _x(3, 256, dtype=target[cast])
        assert q(x).dtype == target[cast]


def test_extra_repr_names_the_storage():
    r = repr(Linear.from_float(_linear(), "fp8", granularity=(128, 128)))
    assert r == ("Linear(in_features=256, out_features=17, bias=True, format='fp8', granularity=(128, 128), "
                 "weight_only=False)")


# --------------------------------------------------------------------------------------------------
# quantize_model
# --------------------------------------------------------------------------------------------------

class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(64, 128)
        self.down = torch.nn.Linear(128, 64)
        self.odd = torch.nn.Linear(48, 64)  # in_features not a multiple of 32

    def forward(self, x):
        return self.down(torch.relu(self.up(x))) + self.odd(x[..., :48])


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList([_Block(), _Block()])
        self.attn = torch.nn.MultiheadAttention(64, 4, batch_first=True)
        self.head = torch.nn.Linear(64, 10)
        self.tied = self.head  # the same module under a second name
        self.tiny = torch.nn.Linear(20, 2)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        x = self.attn(x, x, x, need_weights=False)[0]
        return self.head(x)


def _quantized_names(model):
    return sorted(n for n, m in model.named_modules(remove_duplicate=False) if isinstance(m, Linear))


def test_quantize_model_swaps_in_place_and_warns_once_about_misfits():
    net = _Net()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = tilemm.quantize_model(net, "mxfp4", skip=["blocks.1"])
    assert out is net
    assert _quantized_names(net) == ["blocks.0.down", "blocks.0.up", "head", "tied"]
    assert net.head is net.tied  # tied modules stay one module
    assert type(net.attn.out_proj) is not Linear  # MultiheadAttention reads out_proj.weight itself
    assert len(caught) == 1 and issubclass(caught[0].category, UserWarning)
    assert str(caught[0].message) == (
        "tilemm.quantize_model: left 2 torch.nn.Linear layer(s) unquantized because their in_features is "
        "not a multiple of 32 (the mxfp4 block size): blocks.0.odd (in_features=48), tiny (in_features=20)")
    assert net(_x(2, 3, 64)).shape == (2, 3, 10)


def test_quantize_model_changes_nothing_when_a_layer_fails(monkeypatch):
    # Every layer is converted before any is swapped in: an error on the third leaves the model as it was.
    net = _Net()
    before = [(n, type(m)) for n, m in net.named_modules()]
    real, calls = Linear.from_float, []

    def failing(module, *args, **kwargs):
        calls.append(module)
        if len(calls) == 3:
            raise ValueError("this layer cannot be quantized")
        return real(module, *args, **kwargs)

    monkeypatch.setattr(Linear, "from_float", staticmethod(failing))
    with pytest.raises(ValueError, match="this layer cannot be quantized"):
        tilemm.quantize_model(net, "fp8")
    assert len(calls) == 3 and [(n, type(m)) for n, m in net.named_modules()] == before


def test_quantize_model_skip_predicate_and_fp8_needs_no_block():
    net = _Net()
    tilemm.quantize_model(net, "fp8", skip=lambda name, m: name.endswith("up"))
    assert _quantized_names(net) == ["blocks.0.down", "blocks.0.odd", "blocks.1.down", "blocks.1.odd",
                                     "head", "tied", "tiny"]


def test_quantize_model_passes_options_through():
    with pytest.warns(UserWarning, match=r"blocks.0.odd \(in_features=48\), blocks.1.odd"):
        net = tilemm.quantize_model(_Net(), "mxfp8", weight_only=True, elem_dtype=E5M2, skip="tiny")
    assert net.head.weight_only and net.head.quantized_weight().data.dtype == E5M2


def test_quantize_model_of_a_bare_linear_returns_the_quantized_module():
    q = tilemm.quantize_model(_linear(), "nvfp4")
    assert isinstance(q, Linear) and q.format == "nvfp4"


# --------------------------------------------------------------------------------------------------
# errors
# --------------------------------------------------------------------------------------------------

def test_errors_name_the_argument_and_what_is_accepted():
    lin = _linear()
    with pytest.raises(ValueError, match=r"from_float: format must be one of 'mxfp8', 'mxfp4', 'nvfp4', 'fp8', got 'int8'"):
        Linear.from_float(lin, "int8")
    with pytest.raises(TypeError, match=r"format must be a str, .*got dtype"):
        Linear.from_float(lin, torch.float8_e4m3fn)
    with pytest.raises(TypeError, match=r"from_float: linear must be a torch.nn.Linear, got torch.nn.modules.conv.Conv1d"):
        Linear.from_float(torch.nn.Conv1d(2, 2, 1), "mxfp8")
    with pytest.raises(ValueError, match=r"granularity applies to format 'fp8' only, got granularity='row' with format 'nvfp4'"):
        Linear.from_float(lin, "nvfp4", granularity="row")
    with pytest.raises(ValueError, match=r"fp8 weight granularity must be 'row', 'tensor' or \(128, 128\), got \(1, 128\)"):
        Linear.from_float(lin, "fp8", granularity=(1, 128))
    with pytest.raises(ValueError, match=r"swizzle=True applies to the block-scaled formats"):
        Linear.from_float(lin, "fp8", swizzle=True)
    with pytest.raises(ValueError, match=r"elem_dtype applies to formats 'mxfp8' and 'fp8' only"):
        Linear.from_float(lin, "mxfp4", elem_dtype=E4M3)
    with pytest.raises(TypeError, match=r"elem_dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got torch.bfloat16"):
        Linear.from_float(lin, "mxfp8", elem_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"rounding applies to formats 'mxfp8' and 'mxfp4' only"):
        Linear.from_float(lin, "nvfp4", rounding="floor")
    with pytest.raises(ValueError, match=r"rounding must be 'rceil' or 'floor', got 'up'"):
        Linear.from_float(lin, "mxfp4", rounding="up")
    with pytest.raises(ValueError, match=r"fp8 \(128, 128\) blocks are defined for float8_e4m3fn"):
        Linear.from_float(lin, "fp8", granularity=(128, 128), elem_dtype=E5M2)
    with pytest.raises(ValueError, match=r"in_features must be a multiple of 16 for format='nvfp4', swizzle=True, got 24"):
        Linear.from_float(torch.nn.Linear(24, 4), "nvfp4")
    with pytest.raises(TypeError, match=r"weight_only must be True or False, got 1"):
        Linear.from_float(lin, "mxfp8", weight_only=1)
    q = Linear.from_float(lin, "mxfp8")
    with pytest.raises(TypeError, match=r"input dtype must be torch.float32, torch.bfloat16 or torch.float16, got torch.int64"):
        q(torch.ones(2, 256, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"input must be \(..., in_features\) = \(..., 256\), got shape \(2, 128\)"):
        q(torch.ones(2, 128))
    with pytest.raises(ValueError, match=r"quantize_model: skip names not found in the model: 'blocks.9'"):
        tilemm.quantize_model(_Net(), "mxfp8", skip=["blocks.9"])
    with pytest.raises(TypeError, match=r"quantize_model: model must be a torch.nn.Module, got dict"):
        tilemm.quantize_model({}, "mxfp8")
    with pytest.raises(ValueError, match=r"quantize_model: format must be one of"):
        tilemm.quantize_model(_Net(), "fp4")


# --------------------------------------------------------------------------------------------------
# GPU: the kernels behind the same module
# --------------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(GPU_SKIP_REASON is not None, reason=GPU_SKIP_REASON or "")
@pytest.mark.parametrize("name,kw,quantize_x,quantize_w", CONFIGS, ids=CONFIG_IDS)
def test_gpu_module_matches_cpu_module(name, kw, quantize_x, quantize_w):
    q = Linear.from_float(_linear(), **kw)
    x = _x(2, 33, 256, dtype=torch.bfloat16)
    cpu = q(x)
    gpu = q.to("cuda")(x.cuda())
    # Same quantized operands on both sides; only the fp32 summation order differs, then one bf16 rounding.
    torch.testing.assert_close(gpu.cpu().float(), cpu.float(), rtol=1e-2, atol=1e-2)


@pytest.mark.gpu
@pytest.mark.skipif(GPU_SKIP_REASON is not None, reason=GPU_SKIP_REASON or "")
@pytest.mark.parametrize("rows,k,n", [(300, 512, 200), (2400, 512, 200), (300, 4096, 4096)], ids=str)
@pytest.mark.parametrize("fmt", ["mxfp8", "mxfp4", "nvfp4"])
def test_gpu_block_scaled_module_at_many_rows_matches_cpu(fmt, rows, k, n):
    # Prefill sizes on Hopper run the fake quant and the weight-only plan of that many rows, with an
    # fp32 bias: 512 -> 200 (a weight whose bf16 copy stays in L2) the weight decoded for cuBLAS, or
    # for NVFP4, whose activation decode scale is a device alpha, the fused kernel; 4096 -> 4096 at
    # 300 rows the fused large-M kernel for every format.
    q = Linear.from_float(_linear(k, n), format=fmt)
    x = _x(rows, k, dtype=torch.bfloat16)
    cpu = q(x)
    gpu = q.to("cuda")(x.cuda())
    torch.testing.assert_close(gpu.cpu().float(), cpu.float(), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("weight_only", [False, True])
def test_moving_a_layer_drops_its_cached_runner(weight_only):
    # The runner holds device tensors (a block-scaled layer's small-batch runner: a prepacked copy of
    # the weight); a move must not keep them alive on the old device.
    layer = tilemm.nn.Linear.from_float(torch.nn.Linear(64, 8), "mxfp4", weight_only=weight_only)
    layer._runner = object()
    layer.to(torch.bfloat16)
    assert layer._runner is None


def test_quantizing_a_quantized_model_raises_unless_asked_to_requantize():
    # quantize_model(mxfp4_model, "nvfp4") used to keep mxfp4 without a word.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16))
    reference = copy.deepcopy(model)
    tilemm.quantize_model(model, "mxfp4")
    with pytest.raises(ValueError, match=r"already holds 2 tilemm.nn.Linear.*'0', '2'.*requantize=True"):
        tilemm.quantize_model(model, "nvfp4")
    assert model[0].format == "mxfp4"
    # Skipped layers are not counted.
    with pytest.raises(ValueError, match=r"1 tilemm.nn.Linear layer\(s\) \('2'\)"):
        tilemm.quantize_model(model, "nvfp4", skip=["0"])
    old = model[0].dequantize_weight()
    tilemm.quantize_model(model, "nvfp4", requantize=True)
    assert model[0].format == model[2].format == "nvfp4"
    expected = tilemm.quantize_nvfp4(old).dequantize()
    assert torch.equal(model[0].dequantize_weight(), expected)
    assert torch.equal(model[0].bias, reference[0].bias.detach())
    with pytest.raises(TypeError, match="requantize must be a bool"):
        tilemm.quantize_model(model, "nvfp4", requantize="yes")
    # A bare quantized layer too.
    bare = Linear.from_float(torch.nn.Linear(64, 32), "mxfp8")
    with pytest.raises(ValueError, match="requantize"):
        tilemm.quantize_model(bare, "nvfp4")
    assert tilemm.quantize_model(bare, "nvfp4", requantize=True).format == "nvfp4"


def test_from_float_of_a_tilemm_layer_says_so():
    layer = Linear.from_float(torch.nn.Linear(64, 32), "mxfp4")
    with pytest.raises(TypeError, match=r"already a tilemm.nn.Linear \(format='mxfp4'.*requantize=True"):
        Linear.from_float(layer, "nvfp4")
    with pytest.raises(TypeError, match=r"got torch.nn.modules.conv.Conv1d"):
        Linear.from_float(torch.nn.Conv1d(4, 4, 1), "nvfp4")


@pytest.mark.parametrize("weight_only", [False, True], ids=["block_scaled", "weight_only"])
def test_layers_are_inference_only(weight_only):
    # loss.backward() through a tilemm layer gave torch's generic "does not require grad". Where the
    # input requires grad (in grad mode) the output now carries a backward that says the layers are
    # for inference; the forward itself is the same as under no_grad.
    layer = Linear.from_float(torch.nn.Linear(64, 32), "nvfp4", weight_only=weight_only)
    x = torch.randn(4, 64, requires_grad=True)
    y = layer(x)
    with torch.no_grad():
        expected = layer(x)
    assert torch.equal(y.detach(), expected) and not expected.requires_grad
    with pytest.raises(RuntimeError, match="for inference only.*torch.no_grad"):
        y.square().sum().backward()
    # A float layer before the quantized one: its parameters require grad, so does its output.
    net = torch.nn.Sequential(torch.nn.Linear(8, 64), layer)
    with pytest.raises(RuntimeError, match="for inference only"):
        net(torch.randn(2, 8)).sum().backward()
    with torch.inference_mode():
        assert torch.equal(layer(x), expected)
    assert not layer(x.detach()).requires_grad


def test_inference_only_under_compile():
    # torch.compile traces the backward when the input requires grad: the same message comes up then
    # (wrapped in dynamo's error), and under no_grad the compiled layer runs as usual.
    layer = Linear.from_float(torch.nn.Linear(64, 32), "mxfp4", weight_only=True)
    x = torch.randn(2, 64, requires_grad=True)
    with pytest.raises(Exception, match="for inference only"):
        torch.compile(layer, fullgraph=True)(x).sum().backward()
    with torch.no_grad():
        assert torch.equal(torch.compile(layer, fullgraph=True)(x), layer(x))
