"""Can a prepared launch cost the host less than ``ct.launch``? One tilemm kernel launched through the
CUDA driver directly: its exported cubin, and a parameter buffer filled once, with the moving pointers
patched per call.

    python benchmarks/investigations/fast_launch.py --check    # no GPU: exports and parameter layouts
    python benchmarks/investigations/fast_launch.py            # GPU: output bits and host cost per call

cuTile documents the binary interface of an exported kernel (its calling convention, docs page
"Compilation and Export"): the arguments in the order of the Python parameters, ``ct.Constant`` ones
left out; an array as 1 + 2 ndim arguments (base pointer, shape, strides in elements; int32 or int64
after the constraint's ``index_dtype``); a scalar as one value of its dtype (a Python int as int32, a
float as float32 when ``ct.launch`` infers them). ``ct.launch`` passes exactly these to
``cuLaunchKernelEx``, one 8-byte word per argument, with a (1, 1, 1) block (the block size is the
kernel's own ``.reqntid``); the tensor-map descriptors the kernel reads are hidden parameters after the
visible ones, which no caller passes. Per call it also describes each argument (a DLPack export per
torch tensor), builds the specialisation key (dtypes, ranks, alignment and divisibility bits,
constants), looks the kernel up, and asks the driver for the stream's context and device.

``--check`` (CPU): export the weight-only M = 1 kernel (``_gemv_kernel``, the config ``plan`` picks for
4096 x 4096, MXFP4, bf16), a probe kernel with int32 / float32 scalars and int64 indices, and an empty
kernel, for sm_90; compute each one's parameter layout from its signature (natural alignment), and
compare it with the cubin's own records: the ``.nv.info.<kernel>`` parameter entries (ordinal, offset,
size) and the ``.entry`` parameter list of the PTX that the cubin embeds. Exits non-zero on a mismatch.

GPU (``source .devtk/enter.sh && python benchmarks/investigations/fast_launch.py``): a weight-only
``tilemm.nn.Linear`` (MXFP4, N = K = ``--n``, bf16, M = 1); the signature ``ct.launch`` specialises for
its prepared launch (``KernelSignature.from_kernel_args``) exported for the GPU's target; the same
layout check on that cubin; then outputs of ``ct.launch`` and of the direct launches compared bit for
bit (two activations, so the patched pointers are exercised; the probe kernel too), and the host time
per call (``_timing.issue_us``: 300 calls back to back, best of 5, synchronised at the ends) of: bf16
``F.linear``; an empty kernel by ``ct.launch`` and by the driver; the weight-only kernel by
``Prepared.run`` (``ct.launch``, fixed tensors pre-described) and by the driver (``cuLaunchKernel``
through ctypes, and through CuPy's driver module when CuPy is there); the whole layer as it is
(``nn.Linear``) and as output allocation + direct launch. Last, the packed-buffer form
(``CU_LAUNCH_PARAM_BUFFER_POINTER``, the offsets the check confirmed), guarded. Writes
``fast-launch-<gpu>.txt`` and ``.json`` to ``$OUT`` (or ``--out-dir``) when set.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import inspect
import io
import json
import pathlib
import re
import struct
import sys
import traceback

import cuda.tile as ct
from cuda.tile import compilation as cc

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

V2 = cc.CallingConvention.cutile_python_v2()


# --------------------------------------------------------------------------------------------------
# The calling convention: the flat parameters of a signature
# --------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Param:
    """One kernel argument as the driver takes it: ``name`` (``X.shape[1]``), ``size`` in bytes,
    ``offset`` in a packed parameter buffer (each argument at its natural alignment), ``pointer``,
    and ``arg``: the position of the Python argument it comes from."""

    name: str
    size: int
    offset: int
    pointer: bool
    arg: int


def flat_params(signature: cc.KernelSignature, names) -> list[Param]:
    """The flat argument list of ``signature`` under cutile_python_v1 / v2 (the two agree on it)."""
    out: list[Param] = []
    end = 0

    def add(name, size, pointer, arg):
        nonlocal end
        offset = -(-end // size) * size
        out.append(Param(name, size, offset, pointer, arg))
        end = offset + size

    def walk(name, c, arg):
        if isinstance(c, cc.ConstantConstraint):
            return
        if isinstance(c, cc.TupleConstraint):
            for i, item in enumerate(c.items):
                walk(f"{name}[{i}]", item, arg)
        elif isinstance(c, cc.ArrayConstraint):
            index = c.index_dtype.bitwidth // 8
            add(f"{name}.ptr", 8, True, arg)
            for what in ("shape", "stride"):
                for d in range(c.ndim):
                    add(f"{name}.{what}[{d}]", index, False, arg)
        elif isinstance(c, cc.ListConstraint):
            add(f"{name}.ptr", 8, True, arg)
            add(f"{name}.len", 4, False, arg)
        elif isinstance(c, cc.ScalarConstraint):
            add(name, c.dtype.bitwidth // 8, False, arg)
        else:
            raise TypeError(f"flat_params: no binary form known for {type(c).__name__} ({name})")

    for arg, (name, c) in enumerate(zip(names, signature.parameters, strict=True)):
        walk(name, c, arg)
    return out


def param_names(kernel) -> list[str]:
    return list(inspect.signature(kernel._pyfunc).parameters)


def export(kernel, signature: cc.KernelSignature, gpu_code: str) -> bytes:
    buf = io.BytesIO()
    cc.export_kernel(kernel, [signature], buf, gpu_code=gpu_code, output_format="cubin")
    return buf.getvalue()


# --------------------------------------------------------------------------------------------------
# What the cubin says about its parameters
# --------------------------------------------------------------------------------------------------

def elf_sections(elf: bytes) -> dict[str, bytes]:
    """Section name -> contents of a 64-bit little-endian ELF (empty for NOBITS sections)."""
    if elf[:4] != b"\x7fELF" or elf[4] != 2 or elf[5] != 1:
        raise ValueError("not a 64-bit little-endian ELF")
    shoff, = struct.unpack_from("<Q", elf, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", elf, 0x3A)
    heads = [struct.unpack_from("<IIQQQQIIQQ", elf, shoff + i * shentsize) for i in range(shnum)]
    names_at = heads[shstrndx][4]

    def name(o):
        return elf[names_at + o:elf.index(b"\0", names_at + o)].decode()

    return {name(h[0]): (b"" if h[1] == 8 else elf[h[4]:h[4] + h[5]]) for h in heads}


# EIATTR attribute codes of .nv.info records (format byte, attribute byte, then a value).
_KPARAM_INFO = 0x17        # the older parameter record: size in bits 18..31 of its last word
_KPARAM_INFO_13 = 0x45     # the parameter record CUDA 13.4's ptxas writes: size in the low 16 bits
_CBANK_PARAM_SIZE = 0x19
_REQNTID = 0x10


def nv_info(cubin: bytes, symbol: str) -> dict:
    """The kernel's ``.nv.info.<symbol>`` records: ``params`` [(ordinal, offset, size, pointer)] by
    ordinal, ``param_bytes`` (the whole parameter block, hidden parameters included), ``reqntid``."""
    data = elf_sections(cubin)[f".nv.info.{symbol}"]
    params, out, p = [], {}, 0
    while p < len(data):
        fmt, attr = data[p], data[p + 1]
        if fmt == 4:  # a sized value follows
            size, = struct.unpack_from("<H", data, p + 2)
            value, p = data[p + 4:p + 4 + size], p + 4 + size
        else:         # no value, or a 1- / 2-byte value inline
            value, p = data[p + 2:p + 4], p + 4
        if attr in (_KPARAM_INFO, _KPARAM_INFO_13) and fmt == 4:
            _, ordinal, offset, info = struct.unpack_from("<IHHI", value)
            size = info & 0xFFFF if attr == _KPARAM_INFO_13 else (info >> 18) & 0x3FFF
            params.append((ordinal, offset, size, bool(info >> 26 & 1) if attr == _KPARAM_INFO_13 else None))
        elif attr == _CBANK_PARAM_SIZE:
            out["param_bytes"], = struct.unpack("<H", value)
        elif attr == _REQNTID:
            out["reqntid"] = struct.unpack_from(f"<{len(value) // 4}I", value)
    out["params"] = sorted(params)
    return out


_PTX_BYTES = {"8": 1, "16": 2, "32": 4, "64": 8}


def ptx_params(cubin: bytes, symbol: str) -> list[tuple[int, bool, bool]] | None:
    """[(size, pointer, hidden)] of the ``.entry`` in the PTX the cubin embeds (None without one)."""
    text = elf_sections(cubin).get(".nv_debug_ptx_txt")
    if not text:
        return None
    text = text.decode(errors="replace").replace("\0", "\n")  # lines end in NUL there
    start = text.find(f".entry {symbol}(")
    if start < 0:
        return None
    body = text[start + len(f".entry {symbol}("):text.index(")", start)]
    out = []
    for decl in filter(str.strip, body.split(",")):
        kind = re.search(r"\.[busf](8|16|32|64)\b", decl)
        if ".param" not in decl or kind is None:
            raise ValueError(f"unrecognised PTX parameter {decl.strip()!r}")
        count = re.search(r"\[(\d+)\]\s*$", decl)
        out.append((_PTX_BYTES[kind.group(1)] * int(count.group(1) if count else 1), ".ptr" in decl,
                    ".hidden" in decl))
    return out


def check_layout(cubin: bytes, symbol: str, params: list[Param], say=print) -> None:
    """Compare ``params`` with the cubin's parameter records and PTX entry; AssertionError if they differ."""
    info = nv_info(cubin, symbol)
    got = [(o, off, size) for o, off, size, _ in info["params"]]
    want = [(i, p.offset, p.size) for i, p in enumerate(params)]
    assert got == want, f"{symbol}: .nv.info parameters {got} != calling convention {want}"
    flags = [ptr for *_, ptr in info["params"]]
    flagged = bool(flags) and all(f is not None for f in flags)
    if flagged:
        assert flags == [p.pointer for p in params], f"{symbol}: pointer flags {flags} differ"
    ptx = ptx_params(cubin, symbol)
    hidden = []
    if ptx is not None:
        visible = [(size, ptr) for size, ptr, hid in ptx if not hid]
        hidden = [size for size, _, hid in ptx if hid]
        assert visible == [(p.size, p.pointer) for p in params], f"{symbol}: PTX parameters {visible} differ"
    end = params[-1].offset + params[-1].size if params else 0
    say(f"  {len(params)} arguments, {end} bytes; .nv.info agrees (ordinal, offset, size"
        f"{', pointer' if flagged else ''}); "
        + ("PTX .entry agrees" if ptx is not None else "no embedded PTX")
        + (f"; {len(hidden)} hidden parameters of {sorted(set(hidden))} bytes after them" if hidden else "")
        + f"; parameter block {info.get('param_bytes')} bytes; reqntid {info.get('reqntid')}")


# --------------------------------------------------------------------------------------------------
# Kernels besides tilemm's
# --------------------------------------------------------------------------------------------------

@ct.kernel
def _empty():
    pass


@ct.kernel
def _probe(A, n, B, x, C, K: ct.Constant[int]):
    """C[i, :] = A[i, 0, :] * x + B[i * K:(i + 1) * K] + n: int32 and float32 scalars between arrays."""
    i = ct.bid(0)
    a = ct.load(A, (i, 0, 0), (1, 1, K)).reshape((1, K))
    b = ct.load(B, (i,), (K,)).astype(ct.float32).reshape((1, K))
    ct.store(C, (i, 0), a * x + b + n)


PROBE_K = 16


def probe_signature() -> cc.KernelSignature:
    from tilemm.kernels._aot import array
    return cc.KernelSignature([array(ct.float32, 3), cc.ScalarConstraint(ct.int32), array(ct.uint8, 1),
                               cc.ScalarConstraint(ct.float32), array(ct.float32, 2, index_dtype=ct.int64),
                               PROBE_K], V2).with_mangled_symbol("fast_launch_probe")


def gemv_variant():
    """tilemm's AOT variant of the weight-only kernel that ``plan`` picks at M = 1, N = K = 4096, MXFP4."""
    from tilemm.kernels import weight_only_kernels as wk
    cfg = wk.plan(1, 4096, 4096, wk.LAYOUTS["mxfp4"])
    name = f"weight_only_mxfp4_bfloat16_{cfg.name}"
    [variant] = [v for v in wk.aot_variants(full=True) if v.name == name]
    return variant


def cpu_check(say=print) -> None:
    variant = gemv_variant()
    sig = cc.KernelSignature(list(variant.params), V2).with_mangled_symbol(variant.name)
    cases = [(variant.name, variant.kernel, sig),
             ("probe (int32 / float32 scalars, int64 indices)", _probe, probe_signature()),
             ("empty", _empty, cc.KernelSignature([], V2).with_mangled_symbol("fast_launch_empty"))]
    for title, kernel, sig in cases:
        say(f"{title}, sm_90:")
        params = flat_params(sig, param_names(kernel))
        check_layout(export(kernel, sig, "sm_90"), sig.symbol, params, say)
        say("  " + ", ".join(f"{p.name}@{p.offset}" for p in params))

    # The buffers for example (CPU) tensors: each argument where the calling convention puts it.
    import torch
    a, b, c = torch.zeros(4, 1, PROBE_K), torch.zeros(4 * PROBE_K, dtype=torch.uint8), torch.zeros(4, PROBE_K)
    probe = DriverLaunch(_probe, (a, -3, b, 0.5, c, PROBE_K), (4,), "sm_90", probe_signature(),
                         say=lambda *_: None)
    raw = bytes(probe.packed)[:probe.packed_size.value]
    want = [("<Q", a.data_ptr()), *(("<i", v) for v in (*a.shape, *a.stride())), ("<i", -3), ("<Q", b.data_ptr()),
            ("<i", b.numel()), ("<i", 1), ("<f", 0.5), ("<Q", c.data_ptr()),
            *(("<q", v) for v in (*c.shape, *c.stride()))]
    got = [struct.unpack_from(f, raw, p.offset)[0] for (f, _), p in zip(want, probe.params, strict=True)]
    assert got == [v for _, v in want], f"probe buffer {got} != {[v for _, v in want]}"
    words = [probe.words[i] for i in range(len(probe.params))]
    assert words[probe.pointer_word[0]] == a.data_ptr() and words[probe.pointer_word[4]] == c.data_ptr()
    say(f"probe parameter buffer for example tensors: {len(raw)} bytes, every argument at its offset")


# --------------------------------------------------------------------------------------------------
# Launching through the driver
# --------------------------------------------------------------------------------------------------

class CtypesDriver:
    """libcuda through ctypes: module load and ``cuLaunchKernel``."""

    name = "ctypes"

    def __init__(self):
        self.lib = ctypes.CDLL("libcuda.so.1")
        self.modules = []

    def _ok(self, rc, what):
        if rc:
            text = ctypes.c_char_p()
            self.lib.cuGetErrorString(rc, ctypes.byref(text))
            raise RuntimeError(f"{what}: CUresult {rc} ({text.value.decode() if text.value else '?'})")

    def load(self, cubin: bytes, symbol: str) -> int:
        """The kernel as ``ct.launch`` loads it (``cuLibraryLoadData``, ``cuLibraryGetKernel``: a CUkernel,
        which launch calls take in place of a CUfunction); a module function where that fails."""
        library, kernel = ctypes.c_void_p(), ctypes.c_void_p()
        rc = self.lib.cuLibraryLoadData(ctypes.byref(library), cubin, None, None, 0, None, None, 0)
        if rc == 0:
            self.modules.append(library)
            self._ok(self.lib.cuLibraryGetKernel(ctypes.byref(kernel), library, symbol.encode()),
                     "cuLibraryGetKernel")
            return kernel.value
        module, function = ctypes.c_void_p(), ctypes.c_void_p()
        self._ok(self.lib.cuModuleLoadData(ctypes.byref(module), cubin), "cuModuleLoadData")
        self.modules.append(module)
        self._ok(self.lib.cuModuleGetFunction(ctypes.byref(function), module, symbol.encode()),
                 "cuModuleGetFunction")
        return function.value

    def launcher(self, function: int, grid, stream: int, argv, extra=None):
        launch, ok = self.lib.cuLaunchKernel, self._ok
        f, s = ctypes.c_void_p(function), ctypes.c_void_p(stream)
        gx, gy, gz = grid

        def go():
            rc = launch(f, gx, gy, gz, 1, 1, 1, 0, s, argv, extra)
            if rc:
                ok(rc, "cuLaunchKernel")
        return go


class CupyDriver:
    """CuPy's driver module (Cython): ``moduleLoadData`` and ``launchKernel``."""

    name = "cupy"

    def __init__(self):
        from cupy.cuda import driver
        self.d = driver
        self.modules = []

    def load(self, cubin: bytes, symbol: str) -> int:
        module = self.d.moduleLoadData(cubin)
        self.modules.append(module)
        return self.d.moduleGetFunction(module, symbol)

    def launcher(self, function: int, grid, stream: int, argv, extra=None):
        launch = self.d.launchKernel
        gx, gy, gz = grid
        p, e = ctypes.addressof(argv), (0 if extra is None else ctypes.addressof(extra))

        def go():
            launch(function, gx, gy, gz, 1, 1, 1, 0, stream, p, e)
        return go


def _describe(a):
    """(pointer, shape, strides in elements) of a torch tensor or a ``__cuda_array_interface__`` object."""
    t = getattr(a, "_tensor", a)
    if hasattr(t, "data_ptr"):
        return t.data_ptr(), tuple(t.shape), tuple(t.stride())
    cai = a.__cuda_array_interface__
    shape, itemsize = tuple(cai["shape"]), int(cai["typestr"][2:])
    strides = cai.get("strides")
    if strides is None:
        strides, step = [], 1
        for n in reversed(shape):
            strides.insert(0, step)
            step *= n
    else:
        strides = [s // itemsize for s in strides]
    return cai["data"][0], shape, tuple(strides)


class DriverLaunch:
    """A kernel specialisation loaded through the driver, with its arguments in one word array
    (``words``: one 8-byte word per argument, as ``ct.launch`` builds them) and a packed buffer
    (``packed``: the arguments at their offsets). ``pointer_word[i]`` is the word of argument i's base
    pointer, what a caller patches per call for a tensor that changes."""

    def __init__(self, kernel, args, grid, gpu_code: str, signature: cc.KernelSignature | None = None,
                 say=print):
        sig = signature or cc.KernelSignature.from_kernel_args(kernel, tuple(args), V2)
        self.symbol = sig.symbol
        self.params = flat_params(sig, param_names(kernel))
        self.cubin = export(kernel, sig, gpu_code)
        check_layout(self.cubin, self.symbol, self.params, say)
        n = len(self.params)
        self.words = (ctypes.c_uint64 * max(n, 1))()
        self.pointer_word: dict[int, int] = {}
        values = []
        for arg, c in enumerate(sig.parameters):
            values += self._values(arg, args[arg], c)
        assert len(values) == n
        for i, (p, v) in enumerate(zip(self.params, values)):
            self.words[i] = v
            if p.pointer:
                self.pointer_word.setdefault(p.arg, i)
        base = ctypes.addressof(self.words)
        self.argv = (ctypes.c_void_p * max(n, 1))(*(base + 8 * i for i in range(n)))
        self.grid = tuple(grid) + (1,) * (3 - len(grid))
        end = self.params[-1].offset + self.params[-1].size if n else 0
        self.packed = (ctypes.c_uint8 * max(end, 8))()
        self.packed_size = ctypes.c_size_t(end)
        self.extra = (ctypes.c_void_p * 5)(1, ctypes.addressof(self.packed), 2,
                                           ctypes.addressof(self.packed_size), 0)
        self.sync_packed()

    @staticmethod
    def _values(arg, value, c) -> list[int]:
        if isinstance(c, cc.ConstantConstraint):
            return []
        if isinstance(c, cc.ArrayConstraint):
            ptr, shape, strides = _describe(value)
            mask = (1 << c.index_dtype.bitwidth) - 1
            return [ptr] + [v & mask for v in (*shape, *strides)]
        if isinstance(c, cc.ScalarConstraint):
            if c.dtype == ct.float32:
                return [struct.unpack("<I", struct.pack("<f", value))[0]]
            if c.dtype == ct.float64:
                return [struct.unpack("<Q", struct.pack("<d", value))[0]]
            return [int(value) & ((1 << c.dtype.bitwidth) - 1)]
        raise TypeError(f"argument {arg}: {type(c).__name__} not handled here")

    def sync_packed(self) -> None:
        """Copy the words into the packed buffer at the arguments' offsets."""
        for i, p in enumerate(self.params):
            ctypes.memmove(ctypes.addressof(self.packed) + p.offset, ctypes.addressof(self.words) + 8 * i, p.size)


# --------------------------------------------------------------------------------------------------
# The GPU run
# --------------------------------------------------------------------------------------------------

def _bits_equal(a, b) -> bool:
    import torch
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    view = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a.contiguous().view(view), b.contiguous().view(view))


def gpu_run(args, say) -> dict:
    import torch
    import torch.nn.functional as F
    import tilemm
    from _timing import issue_us

    dev = torch.device("cuda")
    torch.manual_seed(0)
    major, minor = torch.cuda.get_device_capability(dev)
    gpu_code = f"sm_{major}{minor}"
    stream = torch.cuda.current_stream(dev).cuda_stream
    torch.zeros(1, device=dev)  # the primary context, current on this thread, before any driver call
    drivers = [CtypesDriver()]
    try:
        drivers.append(CupyDriver())
    except ImportError as e:
        say(f"(no CuPy: {e})")
    record = {"gpu": torch.cuda.get_device_name(dev), "n": args.n, "checks": {}, "host_us": {}}
    checks, host = record["checks"], record["host_us"]

    # The layer and its prepared launch (the one ``nn.Linear`` runs at M = 1).
    n = k = args.n
    lin = torch.nn.Linear(k, n, bias=False, device=dev, dtype=torch.bfloat16)
    layer = tilemm.nn.Linear.from_float(lin, "mxfp4", weight_only=True)
    x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
    x2 = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
    layer(x)
    prepared = layer._runner._prepared[(1, torch.bfloat16)]

    def ct_args(xx, out):
        return (xx, *prepared.fixed, out, prepared.alpha, *prepared.rest, *prepared._workspace(out, stream),
                *prepared.consts)

    out_a = torch.empty(1, n, device=dev, dtype=torch.bfloat16)
    say(f"weight-only kernel {prepared.kernel._pyfunc.__name__}, grid {prepared.grid}, target {gpu_code}:")
    direct = DriverLaunch(prepared.kernel, ct_args(x, out_a), prepared.grid, gpu_code, say=say)
    words = direct.words
    x_word = direct.pointer_word[0]
    out_words = [direct.pointer_word[i] for i, a in enumerate(ct_args(x, out_a)) if a is out_a]

    launches = {}
    for drv in drivers:
        try:
            launches[drv.name] = (drv, drv.launcher(drv.load(direct.cubin, direct.symbol), direct.grid, stream,
                                                    direct.argv))
        except Exception as e:  # CuPy's driver module may differ; ctypes must work
            if drv.name == "ctypes":
                raise
            say(f"  ({drv.name}: {e})")

    def direct_call(go):
        def call(xx, out):
            words[x_word] = xx.data_ptr()
            p = out.data_ptr()
            for w in out_words:
                words[w] = p
            go()
        return call

    # Bits: ct.launch against each direct launch, for two activations.
    for xx, tag in ((x, "x1"), (x2, "x2")):
        ref = torch.empty(1, n, device=dev, dtype=torch.bfloat16)
        ct.launch(stream, prepared.grid, prepared.kernel, ct_args(xx, ref))
        via_layer = layer(xx)
        for name, (_, go) in launches.items():
            got = torch.full((1, n), float("nan"), device=dev, dtype=torch.bfloat16)
            direct_call(go)(xx, got)
            torch.cuda.synchronize()
            checks[f"gemv {name} {tag} == ct.launch"] = _bits_equal(got, ref)
        checks[f"gemv ct.launch {tag} == nn.Linear"] = _bits_equal(via_layer, ref)

    # The probe: int32 / float32 scalars and int64 indices, through the driver, against ct.launch.
    a = torch.randn(4, 1, PROBE_K, device=dev)
    b = torch.randint(0, 256, (4 * PROBE_K,), device=dev, dtype=torch.uint8)
    c_ref, c_got = torch.zeros(4, PROBE_K, device=dev), torch.zeros(4, PROBE_K, device=dev)
    ct.launch(stream, (4,), _probe, (a, 3, b, 0.5, c_ref, PROBE_K))
    say("probe kernel:")
    probe = DriverLaunch(_probe, (a, 3, b, 0.5, c_got, PROBE_K), (4,), gpu_code, probe_signature(), say=say)
    drivers[0].launcher(drivers[0].load(probe.cubin, probe.symbol), probe.grid, stream, probe.argv)()
    torch.cuda.synchronize()
    checks["probe ctypes == ct.launch"] = _bits_equal(c_got, c_ref)
    checks["probe == torch"] = bool(torch.allclose(c_ref, a[:, 0, :] * 0.5 + b.view(4, PROBE_K).float() + 3))
    for name, ok in checks.items():
        say(f"  {name:40s} {'yes' if ok else 'NO'}")

    # Host cost per call.
    say("host us per call (300 back to back, best of 5):")
    empty = DriverLaunch(_empty, (), (1,), gpu_code, say=lambda *_: None)
    w = lin.weight
    out = torch.empty(1, n, device=dev, dtype=torch.bfloat16)
    rows = {"F.linear bf16 (1 x %d x %d)" % (k, n): lambda: F.linear(x, w),
            "ct.launch, empty kernel": lambda: ct.launch(stream, (1,), _empty, ())}
    for name, (drv, _) in launches.items():
        rows[f"{name} cuLaunchKernel, empty kernel"] = drv.launcher(
            drv.load(empty.cubin, empty.symbol), (1, 1, 1), stream, empty.argv)
    rows["Prepared.run (ct.launch, described fixed tensors)"] = lambda: prepared.run(x, out, stream)
    for name, (_, go) in launches.items():
        call = direct_call(go)
        rows[f"{name} cuLaunchKernel, weight-only (x, out patched)"] = lambda call=call: call(x, out)
    rows["nn.Linear weight-only (as it is)"] = lambda: layer(x)
    call = direct_call(launches["ctypes"][1])
    rows["torch.empty + ctypes cuLaunchKernel (a direct layer)"] = lambda: call(
        x, torch.empty(1, n, device=dev, dtype=torch.bfloat16))
    for label, fn in rows.items():
        try:
            host[label] = issue_us(fn)
            say(f"  {label:58s} {host[label]:7.2f}")
        except Exception as e:  # keep the other rows
            say(f"  {label:58s} failed: {e}")
    torch.cuda.synchronize()

    # Last, because a wrong layout could fault: the packed buffer (offsets from the check above).
    try:
        drv = drivers[0]
        go = drv.launcher(drv.load(direct.cubin, direct.symbol), direct.grid, stream, None, direct.extra)
        ref = torch.empty(1, n, device=dev, dtype=torch.bfloat16)
        ct.launch(stream, prepared.grid, prepared.kernel, ct_args(x2, ref))
        got = torch.full((1, n), float("nan"), device=dev, dtype=torch.bfloat16)
        words[x_word] = x2.data_ptr()
        for wd in out_words:
            words[wd] = got.data_ptr()
        direct.sync_packed()
        go()
        torch.cuda.synchronize()
        record["packed_buffer_bits_equal"] = ok = _bits_equal(got, ref)
        say(f"  {'gemv packed buffer x2 == ct.launch':40s} {'yes' if ok else 'NO'}")
        if ok:
            host["ctypes cuLaunchKernel, packed buffer (no patching)"] = t = issue_us(go)
            say(f"  {'ctypes cuLaunchKernel, packed buffer (no patching)':58s} {t:7.2f}")
    except Exception as e:  # informative only: not among the checks that set the exit status
        record["packed_buffer_bits_equal"] = f"failed: {e}"
        say(f"  packed buffer form: failed: {e}")
    return record


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="CPU only: exports and parameter layouts")
    ap.add_argument("--n", type=int, default=4096, help="N = K of the weight-only layer (GPU run)")
    ap.add_argument("--out-dir", type=pathlib.Path, default=None, help="results directory (default: $OUT if set)")
    args = ap.parse_args(argv)
    if args.check:
        cpu_check()
        print("layouts agree")
        return 0
    import os
    from _results import Transcript, command, results_path
    import torch
    gpu = torch.cuda.get_device_name()
    cmd = command("investigations/fast_launch.py", argv)
    say = Transcript(cmd, gpu)
    try:
        record = gpu_run(args, say)
    except Exception:
        say(traceback.format_exc())
        record = None
    if args.out_dir or os.environ.get("OUT"):
        say.write(results_path(args.out_dir, "fast-launch", gpu, "txt"))
        if record is not None:
            record = {"gpu": record.pop("gpu"), "command": cmd, **record}
            results_path(args.out_dir, "fast-launch", gpu, "json").write_text(json.dumps(record, indent=1) + "\n")
    if record is None:
        return 1
    return 0 if all(v is True for v in record["checks"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
