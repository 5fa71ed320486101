"""Tensor parallelism for :class:`tilemm.nn.Linear` with ``torch.distributed`` (DTensor styles).

A quantized layer ``y = x @ W.T + b``, W (N, K), is split over the ranks of a 1-D device mesh as
Megatron-LM and ``torch.distributed.tensor.parallel`` split ``torch.nn.Linear``: column-wise
(``"colwise"``, ``ColwiseParallel``), each rank holds a slice of the N output features and computes
those output columns (a ``Shard(-1)`` tensor) from the replicated input; row-wise (``"rowwise"``,
``RowwiseParallel``), each rank holds a slice of the K input features, takes the matching ``Shard(-1)``
input and computes a partial sum, reduced over the ranks. Slices follow ``torch.chunk`` (DTensor's
``Shard``), so a column-wise layer's local output is exactly the slice a following row-wise layer expects.

Invariants (``tests/test_parallel.py`` pins them):
- Nothing is re-quantized: every shard holds bytes of the unsharded layer (``local_shard`` says what
  each buffer becomes); a shard boundary that would split a scale block raises ValueError.
- Column-wise, every format and mode: each rank's output columns are bit-identical to the unsharded layer's.
- Row-wise: each rank quantizes its K-slice of the activation to exactly the bytes the unsharded layer
  produces for it, so the result equals the unsharded one up to the order of the fp32 reduction over K
  and the rounding of each partial sum to the output dtype before the all-reduce. Where the activation
  scale spans K (both sides NVFP4, FP8 per tensor / per row), the ranks first all-reduce its amax.

Design (``ShardedLinear``): plain local tensors for the styles' default layouts, so a column-then-row
pair (an MLP) costs one collective, as in Megatron-LM, without host synchronization, and captures in a
CUDA graph; DTensor only for DTensor inputs or other layouts. ``RowwiseParallel``'s options overlap the
all-reduce with compute or hand it to the copy engines or a one-shot kernel. The layer is sharded in
place; its ``state_dict()`` is this rank's shard.
"""

from __future__ import annotations

import ctypes
import dataclasses

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor import parallel as _torch_tp
from torch.distributed.tensor.placement_types import Placement

from swizzle import swizzle_32_4_4, unswizzle_32_4_4

from . import matmul as _matmul
from . import quantize as _quantize
from . import weight_only as _weight_only
from .formats import FP8_BLOCK, Granularity
from .numerics import ceil_div
from .kernels import quantize_kernels as _quantize_kernels
from .kernels._common import stream_handle
from .kernels._large import LIMIT as _INT32_LIMIT
from .nn import _ACTIVATION_DTYPES
from .nn import Linear

#: Rows (the product of x's leading dimensions) up to which a sharded NVFP4 block-scaled layer
#: exchanges its activation's per-tile amax maxima (``_small_batch_nvfp4``, four launches); above it,
#: one amax word per rank, then the same fake quant and weight-only plan on Hopper (elsewhere the
#: block-scaled matmul).
_SMALL_BATCH_ROWS = 128

__all__ = ["STYLES", "ShardInfo", "ShardedLinear", "ColwiseParallel", "RowwiseParallel", "shard_linear",
           "local_shard", "overlapped", "all_reduce_sum", "ONE_SHOT_MAX_BYTES"]

STYLES = ("colwise", "rowwise")
_PACKED = {"mxfp4", "nvfp4"}  # two e2m1 elements per byte along K


@dataclasses.dataclass(frozen=True)
class ShardInfo:
    """Where a sharded layer sits in the unsharded one (``layer.tp_shard`` after sharding).

    ``style`` is ``"colwise"`` (the shard holds output features ``offset .. offset + length - 1``)
    or ``"rowwise"`` (input features ``offset .. offset + length - 1``) of a layer of
    ``in_features`` x ``out_features``, on ``rank`` of ``world_size`` ranks.
    """

    style: str
    rank: int
    world_size: int
    in_features: int
    out_features: int
    offset: int
    length: int


def _chunk(size: int, rank: int, world_size: int) -> tuple[int, int]:
    """(offset, length) of rank's piece of ``size`` under ``torch.chunk`` (DTensor ``Shard``)."""
    step = ceil_div(size, world_size)
    offset = min(rank * step, size)
    return offset, min(step, size - offset)


def _check_style(fn: str, style) -> str:
    if not isinstance(style, str) or style not in STYLES:
        raise ValueError(f"{fn}: style must be 'colwise' or 'rowwise', got {style!r}")
    return style


def _check_layer(fn: str, layer) -> None:
    if not isinstance(layer, Linear):
        raise TypeError(f"{fn}: layer must be a tilemm.nn.Linear, got {type(layer).__name__}")
    if getattr(layer, "tp_shard", None) is not None:
        raise ValueError(f"{fn}: layer is already sharded ({layer.tp_shard}); shard the unsharded layer")


def _shard_of(fn: str, layer: Linear, style: str, rank: int, world_size: int) -> ShardInfo:
    """The slice rank gets, or a ValueError naming the constraint a boundary breaks."""
    for name, value in (("world_size", world_size), ("rank", rank)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{fn}: {name} must be an int, got {type(value).__name__}")
    if world_size < 1:
        raise ValueError(f"{fn}: world_size must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"{fn}: rank must be in [0, {world_size}), got {rank}")
    options = layer._options
    what = "out_features" if style == "colwise" else "in_features"
    size = layer.out_features if style == "colwise" else layer.in_features
    step = ceil_div(size, world_size)
    offset, length = _chunk(size, rank, world_size)
    if length <= 0:
        raise ValueError(f"{fn}: {what}={size} split over world_size={world_size} ranks as torch.chunk "
                         f"does ({step} per rank) leaves rank {rank} without features; every rank needs "
                         f"at least one (use at most {ceil_div(size, step)} ranks)")
    if style == "rowwise":
        multiple = options.k_multiple  # a scale block may not straddle two ranks
    elif options.format == "fp8" and options.fp8_granularity.is_block:
        multiple = FP8_BLOCK
    else:
        multiple = 1
    if world_size > 1 and step % multiple:
        raise ValueError(f"{fn}: {style} sharding splits {what}={size} into pieces of {step} "
                         f"(ceil({size} / world_size={world_size})), which must be a multiple of "
                         f"{multiple}, the scale block along {'K' if style == 'rowwise' else 'N'} of "
                         f"{options.describe()}: a scale block cannot straddle two ranks")
    return ShardInfo(style, rank, world_size, layer.in_features, layer.out_features, offset, length)


def _shard_tensors(layer: Linear, shard: ShardInfo) -> dict[str, torch.Tensor]:
    """The local shard's buffers (new tensors; the layer is not modified)."""
    options = layer._options
    n, k = layer.out_features, layer.in_features
    lo, hi = shard.offset, shard.offset + shard.length
    col = shard.style == "colwise"
    w_q = layer.quantized_weight()  # the interchange tensors (weight-only layers store a packed form)
    data = w_q.data
    if col:
        data = data[lo:hi]
    else:
        per_byte = 2 if options.format in _PACKED else 1
        data = data[:, lo // per_byte: hi // per_byte]
    out = {"weight": data.contiguous()}

    scale = w_q.scale
    if options.format == "fp8":
        if scale.ndim == 0:  # per tensor
            pass
        elif options.fp8_granularity is Granularity.ROW:  # (N, 1)
            scale = scale[lo:hi] if col else scale
        else:  # (128, 128) blocks: (ceil(N / 128), K / 128); boundaries checked to fall on blocks
            b = FP8_BLOCK
            scale = scale[lo // b: ceil_div(hi, b)] if col else scale[:, lo // b: hi // b]
    else:
        block = options.k_multiple
        logical = unswizzle_32_4_4(scale, n, k // block) if options.swizzle else scale
        logical = logical[lo:hi] if col else logical[:, lo // block: hi // block]
        scale = swizzle_32_4_4(logical) if options.swizzle else logical
    out["weight_scale"] = scale.contiguous()
    if "weight_global_scale" in layer._buffers and layer.weight_global_scale is not None:
        out["weight_global_scale"] = layer.weight_global_scale.clone()
    if layer.bias is not None:
        if col:
            out["bias"] = layer.bias[lo:hi].contiguous()
        elif shard.rank == 0:  # added once to the reduced sum
            out["bias"] = layer.bias.clone()
        else:
            out["bias"] = torch.zeros_like(layer.bias)
    return out


def _device_of(layer: Linear) -> torch.device:
    return next(iter(layer.buffers())).device


def _build_local(layer: Linear, shard: ShardInfo, device) -> Linear:
    """A new Linear of the shard's shape, built by the constructor and filled by load_state_dict."""
    in_features = shard.length if shard.style == "rowwise" else layer.in_features
    out_features = shard.length if shard.style == "colwise" else layer.out_features
    bias = layer.bias
    local = Linear(in_features, out_features, bias is not None, format=layer.format, device=device,
                   bias_dtype=torch.float32 if bias is None else bias.dtype, **layer._options.as_kwargs())
    state = {name: t.to(device) for name, t in _shard_tensors(layer, shard).items()}
    # Only the interchange buffers are loaded; anything else the layer keeps is derived from them,
    # by its load path or by _refresh() below.
    _, unexpected = local.load_state_dict(state, strict=False)
    if unexpected:
        raise RuntimeError(f"tilemm.parallel: tilemm.nn.Linear no longer has buffers {unexpected}")
    refresh = getattr(local, "_refresh", None)
    if callable(refresh):
        refresh()
    local.tp_shard = shard
    return local


def local_shard(layer: Linear, style: str, rank: int, world_size: int) -> Linear:
    """Rank ``rank``'s piece of ``layer`` as a new, ordinary :class:`tilemm.nn.Linear`; no communication.

    ``style`` is ``"colwise"`` (out_features split) or ``"rowwise"`` (in_features split). Rank r of W
    ranks gets ``ceil(S / W)`` features starting at ``r * ceil(S / W)``, the last rank what is left
    (``torch.chunk``). Nothing is re-quantized; every shard holds bytes of the unsharded layer:

    - ``weight``: rows (column-wise) or columns (row-wise; for MXFP4 / NVFP4 two elements per byte).
    - ``weight_scale``, logical: the matching rows, or the matching columns of scale blocks. Swizzled
      (32x4x4): unswizzled to (N, K / block), sliced, and swizzled again for the shard's own shape, so
      a shard boundary inside a 128-row or 4-column swizzle tile is handled exactly (the shard's new
      padding is zero, as docs/numerics.md requires). FP8 scales: per tensor, replicated; per row,
      sliced column-wise and replicated row-wise; (128, 128) blocks, sliced by block.
    - ``weight_global_scale`` (NVFP4): replicated. It stays the one decode scale of the whole weight,
      so every shard decodes exactly the values the unsharded layer decodes.
    - ``bias``: sliced column-wise. Row-wise, rank 0 holds the whole bias and every other rank a zero
      bias, so the reduced sum adds it once (a ``Partial`` bias in DTensor's terms); the reduction then
      happens in the activation dtype, like ``torch.nn.Linear`` under ``RowwiseParallel``.

    A shard boundary that would split a scale block raises ``ValueError`` naming the constraint:
    row-wise, ``ceil(in_features / world_size)`` must be a multiple of the block (32 for MXFP8 / MXFP4,
    16 for NVFP4, 128 for FP8 (128, 128)); column-wise with FP8 (128, 128), ``ceil(out_features /
    world_size)`` must be a multiple of 128. Every rank must also receive at least one feature.

    The result's forward computes this rank's output columns (colwise) or partial sum (rowwise) from
    local inputs; summing the row-wise pieces' outputs over ranks gives the unsharded output up to
    the reduction order (except where the activation scale spans K: see ``ShardedLinear``).
    ``layer`` is left as it is. ``shard_linear`` and the styles build on this.
    """
    fn = "tilemm.parallel.local_shard"
    _check_layer(fn, layer)
    style = _check_style(fn, style)
    shard = _shard_of(fn, layer, style, rank, world_size)
    return _build_local(layer, shard, _device_of(layer))


# --------------------------------------------------------------------------------------------------
# In-place sharding with DTensor input / output hooks
# --------------------------------------------------------------------------------------------------

def _mesh_device(mesh: DeviceMesh) -> torch.device:
    if mesh.device_type == "cpu":
        return torch.device("cpu")
    module = torch.get_device_module(mesh.device_type)
    return torch.device(mesh.device_type, module.current_device())


def _broadcast_layer(layer: Linear, mesh: DeviceMesh, src_data_rank: int) -> None:
    """Make every rank's buffers equal src_data_rank's.

    The bytes travel as uint8, which every backend carries (gloo has no float8 or int16), and are
    never converted.
    """
    group = mesh.get_group()
    for name in list(layer._buffers):
        t = layer._buffers.get(name)
        if t is None:
            continue
        raw = t.contiguous().reshape(-1).view(torch.uint8)
        dist.broadcast(raw, group=group, group_src=src_data_rank)
        layer._buffers[name] = raw.view(t.dtype).reshape(t.shape)


def _adopt(module: Linear, local: Linear) -> None:
    """Make ``module`` the local shard in place: take every attribute of ``local`` except hooks.

    parallelize_module does not put the module a style returns back into its parent, so the shard
    must live in the original object. Copying all of local's state (buffers, sizes, options and any
    state derived from the buffers) rather than naming fields keeps this right as the class grows;
    ``module``'s own hooks and training flag stay.
    """
    for key, value in vars(local).items():
        if "hook" in key or key == "training":
            continue
        module.__dict__[key] = value


def _input_to_local(x, mesh: DeviceMesh, given: tuple[Placement, ...], desired: tuple[Placement, ...]):
    if not isinstance(x, DTensor):
        if given == desired:  # already this rank's local input: skip the DTensor round trip
            return x
        x = DTensor.from_local(x, mesh, given, run_check=False)
    if tuple(x.placements) != desired:
        x = x.redistribute(placements=desired)
    return x.to_local()


def _contiguous_stride(shape) -> tuple[int, ...]:
    stride, acc = [], 1
    for d in reversed(shape):
        stride.append(acc)
        acc *= max(d, 1)
    return tuple(reversed(stride))


def _global_activation_scale(layer: Linear):
    """The activation amax a row-wise rank must share: ``Granularity.TENSOR`` (NVFP4's decode scale, FP8
    per tensor) or ``Granularity.ROW`` (FP8 per row), or None where the activation scales are local along K
    (weight-only; MXFP8, MXFP4: 32-blocks; FP8 (128, 128): 1x128 activation blocks), so that a rank's
    K-slice quantizes to the unsharded layer's bytes with nothing shared."""
    options = layer._options
    if options.weight_only:
        return None
    if options.format == "nvfp4":
        return Granularity.TENSOR
    if options.format == "fp8" and not options.fp8_granularity.is_block:
        return options.fp8_granularity
    return None


# All-reduces up to this size take the one-shot all-reduce inside CUDA graphs by default
# (RowwiseParallel's one_shot_max_bytes): on 2 and 4 H200s it beat NCCL there at M = 1 and 16
# (benchmarks/results/tp-mlp-*).
ONE_SHOT_MAX_BYTES = 256 * 1024


class _TPConfig:
    """How one sharded layer talks to the others (``layer._tp``): immutable, shared by copies."""

    __slots__ = ("style", "mesh", "group", "input_layouts", "output_layouts", "use_local_output",
                 "desired_input", "local_output", "plain_input", "plain_output", "amax", "full_out",
                 "sum_opts", "sum_async_opts", "max_opts", "max_async_opts", "chunks", "chunk_min_rows",
                 "one_shot", "copy", "tensor_scale", "taper", "widest_k", "direct_nccl", "two_shot")

    def __init__(self, style, mesh, input_layouts, output_layouts, use_local_output, amax, full_out,
                 chunks=1, chunk_min_rows=1024, one_shot_max_bytes=0, tensor_scale=False, copy_min_bytes=0,
                 taper=False, widest_k=0, direct_nccl=True, one_shot_eager=False, two_shot_min_bytes=0):
        self.style, self.mesh, self.group = style, mesh, mesh.get_group()
        self.direct_nccl = direct_nccl  # eager all-reduces through ``_DirectNccl`` where it sets up
        # Row-wise: the longest K-slice of any rank (rank 0's, torch.chunk's step), which fixes how
        # many amax slots every rank exchanges (``ShardedLinear._small_batch_nvfp4``).
        self.widest_k = widest_k
        self.input_layouts, self.output_layouts = tuple(input_layouts), tuple(output_layouts)
        self.use_local_output, self.amax, self.full_out = use_local_output, amax, full_out
        # Built once: dist.all_reduce builds its options and checks its arguments on every call.
        self.sum_opts = _reduce_opts(dist.ReduceOp.SUM, False)
        self.sum_async_opts = _reduce_opts(dist.ReduceOp.SUM, True)
        self.max_opts = _reduce_opts(dist.ReduceOp.MAX, False)
        self.max_async_opts = _reduce_opts(dist.ReduceOp.MAX, True)
        self.chunks, self.chunk_min_rows, self.taper = chunks, chunk_min_rows, taper
        self.tensor_scale = tensor_scale  # one activation scale for the whole tensor: rows may not split
        self.one_shot = (_OneShot(self.group, one_shot_max_bytes, one_shot_eager) if one_shot_max_bytes > 0
                         else None)
        self.copy = _CopyAllReduce(self.group, copy_min_bytes) if copy_min_bytes > 0 else None
        self.two_shot = _TwoShot(self.group, two_shot_min_bytes) if two_shot_min_bytes > 0 else None
        if style == "colwise":
            self.desired_input, self.local_output = (Replicate(),), (Shard(-1),)
        else:
            self.desired_input, self.local_output = (Shard(-1),), (Partial(),)
        # The layouts of ``ColwiseParallel()`` / ``RowwiseParallel()`` (and of shard_linear) with a plain
        # tensor input: no DTensor at all, only the all-reduce of a row-wise layer.
        self.plain_input = self.input_layouts == self.desired_input
        self.plain_output = use_local_output and (
            self.output_layouts == self.local_output if style == "colwise"
            else self.output_layouts == (Replicate(),))

    def __deepcopy__(self, memo):  # process groups do not copy; the configuration never changes
        return self

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """SUM of ``t`` over the ranks, in place (NCCL: on the current stream; the two-shot or the
        copy-engine all-reduce for a large ``t`` where that is set up), or the one-shot all-reduce's
        new tensor for a small ``t`` where that is set up; returns the result."""
        one_shot = self.one_shot
        if one_shot is not None:
            reduced = one_shot(t)
            if reduced is not None:
                return reduced
        two_shot = self.two_shot
        if two_shot is not None and two_shot(t) is not None:
            return t
        copy = self.copy
        if copy is not None:
            waiter = copy.start(t)
            if waiter is not None:
                waiter.wait()
                return t
        direct = _direct_nccl(self.group, t, self.direct_nccl)
        if direct is not None:
            return direct.all_reduce(t, _DirectNccl.SUM)
        work = self.group.allreduce([t], self.sum_opts)
        if work is not None:
            work.wait()
        return t

    def all_reduce_max(self, t: torch.Tensor, on_nccl_stream: bool = False) -> None:
        """MAX of ``t`` over the ranks, in place: on NCCL's own stream for a caller inside
        ``overlapped`` (``on_nccl_stream``), else waited for by the current stream (the direct
        communicator where it applies)."""
        direct = None if on_nccl_stream else _direct_nccl(self.group, t, self.direct_nccl)
        if direct is not None:
            direct.all_reduce(t, _DirectNccl.MAX)
            return
        work = self.group.allreduce([t], self.max_async_opts if on_nccl_stream else self.max_opts)
        if work is not None:
            work.wait()

    def start_all_reduce(self, t: torch.Tensor, out: torch.Tensor | None = None):
        """The SUM of ``t`` started, not waited for: the copy-engine all-reduce on its side stream
        (into ``out`` if given, else in place) where it applies, else NCCL on its own stream (in
        place; ``out``, if given, is then filled by the caller after the wait). Returns (waiter or None,
        whether ``out`` was written)."""
        copy = self.copy
        if copy is not None:
            waiter = copy.start(t, out)
            if waiter is not None:
                return waiter, out is not None
        return self.group.allreduce([t], self.sum_async_opts), False


class _DirectNccl:
    """NCCL all-reduces called through ctypes, on the library PyTorch itself loads: an eager call costs
    the host one library call, where ``ProcessGroup.allreduce`` also builds a work object, records
    events and queues them for its watchdog (the host time of each, ``benchmarks/results/tp-host-*``).
    Same NCCL kernels and protocol, so the same sums.

    One communicator per (group, device), shared by every layer of the group, made on the first eager
    all-reduce that asks for it: a collective step (the ranks agree that each found the library, rank
    0's unique id goes to the others through the group, every rank joins the communicator, one
    all-reduce of known values is checked, and the ranks agree on the result); where any of it fails
    on any rank, ``error`` says why and the group's ``ProcessGroup`` path stays. Each call runs on the
    current stream, in place. Not used during CUDA-graph capture or torch.compile tracing (those take
    the ``ProcessGroup`` path, whose capture is what the graph tests pin)."""

    _LIB = None
    _FOR: dict = {}  # (group name, device index) -> _DirectNccl
    # ncclDataType_t and ncclRedOp_t (nccl.h)
    DTYPES = {torch.int8: 0, torch.uint8: 1, torch.int32: 2, torch.int64: 4, torch.float16: 6, torch.float32: 7,
              torch.float64: 8, torch.bfloat16: 9}
    SUM, MAX = 0, 2

    class _UniqueId(ctypes.Structure):
        _fields_ = [("internal", ctypes.c_byte * 128)]

    def __init__(self):
        self.comm = None
        self.error: str | None = None
        self._call = None

    @staticmethod
    def key(group, device: torch.device) -> tuple:
        """``_FOR``'s key: the group's name (never reused, unlike an object's id) and the device."""
        return getattr(group, "group_name", None) or id(group), device.index

    @classmethod
    def for_group(cls, group, device: torch.device) -> "_DirectNccl | None":
        """The group's communicator on ``device``, set up (collectively) on first use; None where it
        is unavailable (then ``ProcessGroup.allreduce``)."""
        key = cls.key(group, device)
        found = cls._FOR.get(key)
        if found is None:
            found = cls._FOR[key] = cls()
            found._setup(group, device)
        return found if found.comm is not None else None

    @classmethod
    def _library(cls):
        if cls._LIB is None:
            lib = ctypes.CDLL("libnccl.so.2")  # the copy libtorch_cuda already loaded
            lib.ncclGetUniqueId.argtypes = [ctypes.POINTER(cls._UniqueId)]
            lib.ncclCommInitRank.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, cls._UniqueId,
                                             ctypes.c_int]
            lib.ncclAllReduce.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                          ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
            lib.ncclGetErrorString.restype = ctypes.c_char_p
            cls._LIB = lib
        return cls._LIB

    def _setup(self, group, device: torch.device) -> None:
        try:  # the same on every rank of the group: no need to agree (and nothing to agree over)
            backend = dist.get_backend(group)
        except Exception as err:  # noqa: BLE001
            backend = f"unknown ({type(err).__name__}: {err})"
        if backend != "nccl":
            self.error = f"the group's backend is {backend!r}, not 'nccl'"[:300]
            return
        error, lib = None, None
        try:
            lib = self._library()
        except Exception as err:  # noqa: BLE001 (reported in self.error; the ProcessGroup path stays)
            error = f"{type(err).__name__}: {err}"[:300]
        if not _ranks_agree(group, device, error is None):
            self.error = error or "another rank could not load NCCL"
            return
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        uid = self._UniqueId()
        if rank == 0:
            try:
                self._check(lib.ncclGetUniqueId(ctypes.byref(uid)))
            except Exception as err:  # noqa: BLE001
                error = f"{type(err).__name__}: {err}"[:300]
        # Every rank takes part in the broadcast whatever rank 0 got, then they agree on it.
        raw = torch.tensor(list(bytes(uid.internal)), dtype=torch.uint8, device=device)
        dist.broadcast(raw, src=dist.get_global_rank(group, 0), group=group)
        if not _ranks_agree(group, device, error is None):
            self.error = error or "rank 0 could not make an NCCL unique id"
            return
        ctypes.memmove(uid.internal, bytes(raw.cpu().tolist()), 128)
        comm = ctypes.c_void_p()
        try:
            with torch.cuda.device(device):
                self._check(lib.ncclCommInitRank(ctypes.byref(comm), world, uid, rank))
            self.comm, self._call = comm, lib.ncclAllReduce
            probe = torch.full((8,), rank + 1.0, dtype=torch.float32, device=device)
            self.all_reduce(probe, self.SUM)
            if not torch.equal(probe, torch.full_like(probe, world * (world + 1) / 2)):
                raise RuntimeError(f"the all-reduce of 1 .. {world} gave {probe.tolist()}")
        except Exception as err:  # noqa: BLE001
            error = f"{type(err).__name__}: {err}"[:300]
        if not _ranks_agree(group, device, error is None):
            self.error = error or "another rank's check of the direct NCCL all-reduce failed"
            self.comm = None  # (the communicator is left to the process's exit)

    def _check(self, result: int) -> None:
        if result != 0:
            raise RuntimeError(f"NCCL error {result}: {self._library().ncclGetErrorString(result).decode()}")

    def all_reduce(self, t: torch.Tensor, op: int) -> torch.Tensor:
        """``op`` (SUM or MAX) of contiguous ``t`` over the ranks, in place, on the current stream."""
        result = self._call(t.data_ptr(), t.data_ptr(), t.numel(), self.DTYPES[t.dtype], op, self.comm,
                            stream_handle(t.device))
        if result != 0:
            self._check(result)
        return t


def _ranks_agree(group, device, ok: bool) -> bool:
    """Whether every rank of ``group`` passed ``ok`` True (a MIN all-reduce through the process group,
    read back: a set-up step's collective agreement, so that all ranks take the same path)."""
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return flag.item() == 1


def _direct_nccl(group, t: torch.Tensor, enabled: bool = True) -> "_DirectNccl | None":
    """The group's direct NCCL communicator for an eager all-reduce of ``t`` (contiguous, CUDA, a dtype
    NCCL reduces), or None: the ``ProcessGroup`` path (capture, tracing, or none available)."""
    if (not enabled or not t.is_cuda or t.dtype not in _DirectNccl.DTYPES or not t.is_contiguous()
            or torch.compiler.is_compiling() or torch.cuda.is_current_stream_capturing()):
        return None
    return _DirectNccl.for_group(group, t.device)


def _reduce_opts(op, async_op: bool):
    opts = dist.AllreduceOptions()
    opts.reduceOp = op
    if hasattr(opts, "asyncOp"):
        opts.asyncOp = async_op
    return opts


_SUM, _SUM_ASYNC = _reduce_opts(dist.ReduceOp.SUM, False), _reduce_opts(dist.ReduceOp.SUM, True)


class _OneShot:
    """Small all-reduces through ``torch.distributed._symmetric_memory``'s one-shot all-reduce.

    Each rank copies its tensor into a symmetric-memory buffer and reads every rank's buffer over
    NVLink (peer-to-peer loads, no multicast), summing in rank order: one kernel instead of NCCL's
    launch and protocol, for tensors of at most ``max_bytes``. Set up on the first eager call that
    fits (a buffer per dtype, a rendezvous: collective, every rank makes the same calls in the same
    order); where torch lacks it or it fails on any rank (the ranks agree through one NCCL
    all-reduce), the layer keeps NCCL and ``error`` says why. Never set up during CUDA-graph capture;
    until it is set up, calls go to NCCL.

    ``eager`` False: only CUDA-graph capture takes it (eager calls set it up and return None, for the
    caller's NCCL). In a graph its one kernel costs less than NCCL's; eagerly the host time of the
    symmetric-memory op's call costs more than the direct NCCL call's
    (``benchmarks/results/tp-mlp-*``, ``tp-host-*``). Never under torch.compile's tracing.
    """

    def __init__(self, group, max_bytes: int, eager: bool = True):
        self.group, self.max_bytes, self.eager = group, max_bytes, eager
        self.buffers: dict = {}  # dtype -> symmetric buffer (or None: failed)
        self.error: str | None = None
        self.group_name = getattr(group, "group_name", None)
        self.amax_slots = None  # the amax exchange's (slots, this rank's slot), set up on first use
        self.amax_error: str | None = None
        self.amax_tile_vectors: dict = {}  # (device, tiles per rank) -> (vector, this rank's region)

    # One buffer per (group, dtype, device, size), shared by every layer: the kernel synchronizes the
    # ranks at its start and its end, so a buffer is free again when the kernel ends.
    _BUFFERS: dict = {}

    def live(self) -> bool:
        """Whether this call takes the one-shot path (where it is set up and the tensor fits): always
        when ``eager``, else only during CUDA-graph capture; never while torch.compile traces."""
        if torch.compiler.is_compiling():
            return False
        return self.eager or torch.cuda.is_current_stream_capturing()

    def __call__(self, t: torch.Tensor):
        # Never while torch.compile traces (asked first: the checks below read the tensor's address).
        # The common eager call of a graphs-only all-reduce, once set up: straight to the caller's NCCL
        # (a set-up dtype implies a CUDA build, where the capture query works).
        if torch.compiler.is_compiling() or (not self.eager and t.dtype in self.buffers
                                             and not torch.cuda.is_current_stream_capturing()):
            return None
        if (not t.is_cuda or t.numel() * t.element_size() > self.max_bytes or self.error is not None
                or t.data_ptr() % 16 or not t.is_contiguous()):  # the kernel's alignment and layout
            return None
        capturing = torch.cuda.is_current_stream_capturing()
        buf = self.buffers.get(t.dtype)
        if buf is None:
            if t.dtype in self.buffers or capturing:
                return None
            buf = self._setup(t)
            if buf is None:
                return None
        if not (self.eager or capturing):
            return None
        n = t.numel()
        out = torch.ops.symm_mem.one_shot_all_reduce_copy(buf[:n], t.reshape(-1), "sum", self.group_name)
        return out.view(t.shape)

    def _setup(self, t: torch.Tensor):
        def probe(buf):
            ones = torch.ones(8, dtype=t.dtype, device=t.device)
            got = torch.ops.symm_mem.one_shot_all_reduce_copy(buf[:8], ones, "sum", self.group_name)
            if not torch.equal(got, ones * dist.get_world_size(self.group)):
                raise RuntimeError(f"one_shot_all_reduce_copy of ones gave {got.tolist()}")

        return _symmetric_setup(self, t, self.max_bytes // t.element_size(), _OneShot._BUFFERS,
                                (self.group_name, t.dtype, t.device, self.max_bytes), probe, "one-shot")

    # The amax exchange: every rank's amax gathered by the one-shot SUM, then the maximum locally.
    # Rank r writes its amax (fp32 bits) into slot r of its own zero vector; the one-shot kernel sums
    # the ranks' vectors, and a sum of one value and zeros is that value, bit for bit (IEEE addition
    # without flush-to-zero, checked at set-up with subnormal bit patterns; NaN stays a NaN, +Inf +Inf).
    # One kernel instead of NCCL's MAX all-reduce, whose launch and protocol cost more at 4 bytes.
    AMAX_SLOTS_MIN = 4  # 16 bytes: the one-shot kernel's vector width

    def amax_slot(self, device):
        """``(slots, mine)``: the exchange's int32 vector (one slot per rank, the others zero for good)
        and this rank's (1,) slot to write the local amax bits into; None where the exchange is not
        available (then NCCL's MAX all-reduce). Set up (collective) on the first eager call."""
        if self.amax_slots is not None:
            return self.amax_slots
        if self.amax_error is not None or self.error is not None or torch.cuda.is_current_stream_capturing():
            return None
        world, rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        n = max(ceil_div(world, self.AMAX_SLOTS_MIN) * self.AMAX_SLOTS_MIN, self.AMAX_SLOTS_MIN)
        slots = torch.zeros(n, dtype=torch.int32, device=device)
        buf = self.buffers.get(torch.float32)
        if buf is None and torch.float32 not in self.buffers:
            buf = self._setup(torch.empty(8, dtype=torch.float32, device=device))  # collective
        error = None if buf is not None else (self.error or "no fp32 one-shot buffer")
        if buf is not None:
            try:
                # Subnormal bit patterns 1 .. world (the values flush-to-zero arithmetic would lose).
                probe = torch.zeros(n, dtype=torch.int32, device=device)
                probe[rank] = rank + 1
                got = torch.ops.symm_mem.one_shot_all_reduce_copy(buf[:n], probe.view(torch.float32), "sum",
                                                                   self.group_name).view(torch.int32)
                want = torch.zeros(n, dtype=torch.int32, device=device)
                want[:world] = torch.arange(1, world + 1, dtype=torch.int32, device=device)
                if not torch.equal(got, want):
                    error = f"the one-shot sum of one-hot fp32 bits gave {got.tolist()}, not {want.tolist()}"
            except Exception as err:  # noqa: BLE001 (reported in amax_error; NCCL stays)
                error = f"{type(err).__name__}: {err}"[:300]
        if not _ranks_agree(self.group, device, error is None) and error is None:
            error = "another rank could not set up the one-shot amax exchange"
        if error is not None:
            self.amax_error = error
            return None
        self.amax_slots = (slots, slots[rank:rank + 1])
        return self.amax_slots

    def amax_tiles(self, device, per_rank: int):
        """``(vector, mine)`` for exchanging ``per_rank`` per-tile amax maxima (``tile_amax``'s slots)
        instead of one word: an int32 vector with a region of ``per_rank`` words per rank (rank r's at
        ``r * per_rank``; the rest zero for good) and this rank's region, for ``tile_amax`` to write
        into. Its one-shot sum (``amax_gather``) is every rank's maxima side by side, the one-hot sum
        the set-up checked (``amax_slot``), which the small-batch fake-quantize kernel reduces
        itself: no reduction launch before the exchange nor after it. None where the exchange is not
        set up, the vector would exceed ``AMAX_PARTIALS`` words, or a capture asks for a vector no
        eager call made (every rank makes the same calls, so every rank answers alike)."""
        key = (device, per_rank)
        got = self.amax_tile_vectors.get(key)
        if got is not None or self.amax_slots is None or torch.cuda.is_current_stream_capturing():
            return got
        world, rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        n = ceil_div(world * per_rank, self.AMAX_SLOTS_MIN) * self.AMAX_SLOTS_MIN
        if n > _quantize_kernels.AMAX_PARTIALS or n > self.max_bytes // 4:
            return None
        vector = torch.zeros(n, dtype=torch.int32, device=device)
        got = self.amax_tile_vectors[key] = (vector, vector[rank * per_rank:(rank + 1) * per_rank])
        return got

    def amax_gather(self, vector: torch.Tensor) -> torch.Tensor:
        """Every rank's region of an ``amax_tiles`` (or ``amax_slot``) vector, side by side: (n,) int32,
        one kernel."""
        n = vector.numel()
        got = torch.ops.symm_mem.one_shot_all_reduce_copy(self.buffers[torch.float32][:n], vector.view(torch.float32),
                                                          "sum", self.group_name)
        return got.view(torch.int32)

    def amax_max(self, slots: torch.Tensor) -> torch.Tensor:
        """The maximum over the ranks of the amax bits each wrote into its slot of ``slots``: (1,)
        int32 (the int32 order of non-negative fp32 bits is their numeric order, NaN above +Inf)."""
        return self.amax_gather(slots).amax(0, keepdim=True)


class _TwoShot:
    """Large all-reduces through ``torch.distributed._symmetric_memory``'s two-shot all-reduce.

    The tensor is copied into a symmetric-memory buffer; then each rank sums its 1 / world slice of
    every rank's buffer (peer loads over NVLink, ranks in rank order) and writes that slice of the sum
    into every rank's output (peer stores): a reduce-scatter and an all-gather in one kernel on all
    SMs, no multicast. For tensors of at least ``min_bytes`` and at most ``MAX_BYTES`` (the buffer).
    Set up as ``_OneShot`` is (first eager call that fits, collective, the ranks agree; never during
    CUDA-graph capture or torch.compile tracing; NCCL until then and wherever it fails, ``error``
    says why). With two ranks each sum is one addition, as NCCL's; with more, rank order.
    """

    MAX_BYTES = 64 << 20  # 4096 rows of 8192 bf16 features
    _BUFFERS: dict = {}  # (group, dtype, device) -> buffer, shared by the group's layers

    def __init__(self, group, min_bytes: int):
        self.group, self.min_bytes = group, min_bytes
        self.group_name = getattr(group, "group_name", None)
        self.buffers: dict = {}  # dtype -> symmetric buffer (or None: failed)
        self.error: str | None = None

    def __call__(self, t: torch.Tensor):
        if torch.compiler.is_compiling():  # asked first: the checks below read the tensor's address
            return None
        size = t.numel() * t.element_size()
        if (not t.is_cuda or not self.min_bytes <= size <= self.MAX_BYTES or size % 16 or t.data_ptr() % 16
                or not t.is_contiguous() or self.error is not None):
            return None
        buf = self.buffers.get(t.dtype)
        if buf is None:
            if t.dtype in self.buffers or torch.cuda.is_current_stream_capturing():
                return None
            buf = self._setup(t)
            if buf is None:
                return None
        flat, n = t.view(-1), t.numel()
        buf[:n].copy_(flat)
        torch.ops.symm_mem.two_shot_all_reduce_out(buf[:n], "sum", self.group_name, flat)
        return t

    def _setup(self, t: torch.Tensor):
        def probe(buf):
            # Small integers: every partial sum exact in any float dtype, whatever the order.
            world, rank = dist.get_world_size(self.group), dist.get_rank(self.group)
            base = torch.arange(1024, device=t.device) % 16
            got = (base + rank).to(t.dtype)
            buf[:1024].copy_(got)
            torch.ops.symm_mem.two_shot_all_reduce_out(buf[:1024], "sum", self.group_name, got)
            if not torch.equal(got, (base * world + world * (world - 1) // 2).to(t.dtype)):
                raise RuntimeError("two_shot_all_reduce_out of a probe gave a wrong sum")

        return _symmetric_setup(self, t, self.MAX_BYTES // t.element_size(), _TwoShot._BUFFERS,
                                (self.group_name, t.dtype, t.device), probe, "two-shot")


def _symmetric_setup(owner, t: torch.Tensor, elements: int, shared: dict, key, probe, what: str):
    """``owner``'s (a ``_OneShot`` or ``_TwoShot``) symmetric buffer of ``elements`` of t's dtype, made
    and checked once per ``key`` in ``shared`` (every rank makes the same calls in the same order:
    collective), or None where torch lacks it or it fails on any rank (the ranks agree through one
    NCCL all-reduce; ``owner.error`` says why). ``probe(buf)`` raises if the all-reduce sums wrong."""
    buf = shared.get(key)
    if buf is not None:  # every rank set it up at the same call
        owner.buffers[t.dtype] = buf
        return buf
    error = None
    try:
        from torch.distributed import _symmetric_memory as symm_mem

        if owner.group_name is None:
            raise RuntimeError("the process group has no group_name")
        enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
        if enable is not None:
            enable(owner.group_name)
        buf = symm_mem.empty(elements, dtype=t.dtype, device=t.device)
        symm_mem.rendezvous(buf, owner.group_name)
        probe(buf)
    except Exception as err:  # noqa: BLE001 (reported in owner.error; NCCL stays)
        error = f"{type(err).__name__}: {err}"[:300]
    if not _ranks_agree(owner.group, t.device, error is None) and error is None:
        error = f"another rank could not set up the {what} all-reduce"
    if error is not None:
        owner.error = error
        owner.buffers[t.dtype] = None
        return None
    owner.buffers[t.dtype] = shared[key] = buf
    return buf


class _Waiter:
    """What ``_CopyAllReduce.start`` returns: ``wait()`` makes the current stream wait for the side
    stream's work queued so far (no host sync; capturable)."""

    __slots__ = ("stream",)

    def __init__(self, stream):
        self.stream = stream

    def wait(self):
        torch.cuda.current_stream(self.stream.device).wait_stream(self.stream)


class _CopyAllReduce:
    """A SUM all-reduce done by the GPUs' copy engines, for large outputs, so that it can run beside
    matmuls without taking their SMs (NCCL's reduction kernels do: overlapped with a matmul, both slow
    down).

    Every rank holds one symmetric-memory buffer (``torch.distributed._symmetric_memory``, mapped
    into every peer over NVLink, no multicast) of ``world_size + 1`` slots: an inbox slot per rank and
    an outbox. For a tensor t of n elements (n a multiple of world_size W, chunk = n / W), queued on a
    side stream after what the current stream has queued:

    1. reduce-scatter by copies: rank r copies chunk p of t into slot r of rank p's inbox (a
       peer-to-peer ``copy_``, a DMA by a copy engine, no SM) and its own chunk into its own slot r;
    2. a symmetric-memory barrier (every rank's copies have landed);
    3. one sum kernel: the W inbox slots, in rank order, summed in fp32 and rounded once to t's
       dtype, into the outbox (chunk r of the result; every rank receives these same bits);
    4. a barrier (every outbox is written);
    5. all-gather by copies: chunk p of the result <- rank p's outbox (copies again), into ``out``
       (default: t itself).

    Only the sum and the two barriers (one block each) run on SMs. The next call's copies into a
    peer's inbox come after that peer's sum (barrier 4), and its sum after every peer's copies out of
    the outbox (barrier 2 of the next call), so one buffer serves every call in turn, queued on one
    side stream per (group, dtype, device) that every layer shares. The sum is each element's W
    partial sums added in one fixed order: it equals NCCL's up to the order and rounding of the final
    sum. Set up (a collective: allocation, rendezvous, a check of one all-reduce against the known
    sum, agreed by all ranks) on the first eager call that fits; where torch lacks symmetric memory
    or the check fails on any rank, ``error`` says why and calls return None (the caller uses NCCL).
    Tensors of fewer than ``min_bytes`` or more than ``MAX_BYTES`` bytes, non-contiguous or not
    divisible by W also return None.
    """

    MAX_BYTES = 64 << 20  # the buffer's capacity for t: (W + 1) / W times this is allocated per rank
    SLOT_ALIGN = 64  # elements: each slot starts 128-byte aligned for bf16
    _STATES: dict = {}  # (group name, dtype, device) -> _CopyState, shared by every layer

    def __init__(self, group, min_bytes: int):
        self.group, self.min_bytes = group, min_bytes
        self.group_name = getattr(group, "group_name", None)
        self.states: dict = {}  # dtype -> _CopyState or None (failed)
        self.error: str | None = None

    def start(self, t: torch.Tensor, out: torch.Tensor | None = None):
        """Queue the all-reduce of ``t`` (result into ``out``, default ``t``) on the side stream; returns a
        ``_Waiter`` or None where this all-reduce does not apply (nothing queued)."""
        nbytes = t.numel() * t.element_size()
        if (not t.is_cuda or nbytes < self.min_bytes or nbytes > self.MAX_BYTES or self.error is not None
                or not t.is_contiguous() or (out is not None and not out.is_contiguous())):
            return None
        state = self.states.get(t.dtype)
        if state is None:
            if t.dtype in self.states or torch.cuda.is_current_stream_capturing():
                return None
            state = self._setup(t)
            if state is None:
                return None
        if t.numel() % state.world:
            return None
        state.run(t.reshape(-1), t.reshape(-1) if out is None else out.reshape(-1))
        return _Waiter(state.stream)

    def _setup(self, t: torch.Tensor):
        key = (self.group_name, t.dtype, t.device)
        shared = _CopyAllReduce._STATES.get(key)
        if shared is not None:  # every rank set it up at the same call
            self.states[t.dtype] = shared
            return shared
        state, error = None, None
        try:
            if self.group_name is None:
                raise RuntimeError("the process group has no group_name")
            state = _CopyState(self.group, self.group_name, t.dtype, t.device, self.MAX_BYTES // t.element_size(),
                               self.SLOT_ALIGN)
            world, rank = state.world, state.rank
            # Small integers: exact in every float dtype, and so is their sum.
            n = world * 3 * self.SLOT_ALIGN
            base = torch.arange(n, device=t.device) % 7
            probe = (base + rank).to(t.dtype)
            want = (base * world + world * (world - 1) // 2).to(t.dtype)
            state.run(probe, probe)
            _Waiter(state.stream).wait()
            if not torch.equal(probe, want):
                bad = (probe != want).nonzero()[:4].flatten().tolist()
                raise RuntimeError(f"the copy all-reduce of a known tensor differs at elements {bad}")
        except Exception as err:  # noqa: BLE001 (reported in self.error; NCCL stays)
            error = f"{type(err).__name__}: {err}"[:300]
        if not _ranks_agree(self.group, t.device, error is None) and error is None:
            error = "another rank could not set up the copy all-reduce"
        if error is not None:
            self.error = error
            self.states[t.dtype] = None
            return None
        self.states[t.dtype] = _CopyAllReduce._STATES[key] = state
        return state


class _CopyState:
    """One (group, dtype, device)'s symmetric buffer, its views of every rank's buffer and the side
    stream of ``_CopyAllReduce`` (see there for the steps)."""

    BARRIER_CHANNEL = 1  # the symmetric-memory kernels (one-shot all-reduce) signal on channel 0

    def __init__(self, group, group_name, dtype, device, capacity: int, align: int):
        from torch.distributed import _symmetric_memory as symm_mem

        enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
        if enable is not None:
            enable(group_name)
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.slot = ceil_div(ceil_div(capacity, self.world), align) * align
        rows = self.world + 1
        self.buffer = symm_mem.empty(rows * self.slot, dtype=dtype, device=device)
        self.handle = symm_mem.rendezvous(self.buffer, group_name)
        # views[p]: rank p's buffer as (W + 1, slot): rows 0 .. W - 1 its inbox, row W its outbox.
        self.views = [self.buffer.view(rows, self.slot) if p == self.rank
                      else self.handle.get_buffer(p, (rows, self.slot), dtype) for p in range(self.world)]
        self.stream = torch.cuda.Stream(device=device)
        # With more than one peer, the copies to (from) different peers go on streams of their own,
        # so that several copy engines work at once instead of one after the other.
        self.peer_streams = ([torch.cuda.Stream(device=device) for _ in range(self.world - 1)]
                             if self.world > 2 else [])

    def run(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Queue steps 1-5 for the flat ``src`` into the flat ``dst`` (may be ``src``)."""
        chunk = src.numel() // self.world
        stream = self.stream
        stream.wait_stream(torch.cuda.current_stream(src.device))
        with torch.cuda.stream(stream):
            self._on_peer_streams(self.scatter, src, chunk)
            self.handle.barrier(self.BARRIER_CHANNEL)  # 2.
            self.reduce(chunk)
            self.handle.barrier(self.BARRIER_CHANNEL)  # 4.
            self._on_peer_streams(self.gather, dst, chunk)

    def _on_peer_streams(self, step, t: torch.Tensor, chunk: int) -> None:
        """``step``'s copies, each peer's on its own stream (forked from and joined back into the
        current one) where there are several peers; else all on the current stream."""
        if not self.peer_streams:
            step(t, chunk)
            return
        current = torch.cuda.current_stream(t.device)
        for p, peer_stream in zip(self._peers(), self.peer_streams):
            peer_stream.wait_stream(current)
            with torch.cuda.stream(peer_stream):
                step(t, chunk, only=p)
        step(t, chunk, only=self.rank)
        for peer_stream in self.peer_streams:
            current.wait_stream(peer_stream)

    def _peers(self):
        return [(self.rank + 1 + step) % self.world for step in range(self.world - 1)]

    # The steps on the current stream (``run`` puts them on the side stream between the barriers);
    # ``views``, ``rank`` and ``world`` are all they read, so a test can drive them on CPU tensors.
    def scatter(self, src: torch.Tensor, chunk: int, only: int | None = None) -> None:
        """1. Chunk p of src into slot ``rank`` of rank p's inbox (own chunk last: the peers' first);
        ``only``: that p alone."""
        world, rank, views = self.world, self.rank, self.views
        for step in range(world):
            p = (rank + 1 + step) % world
            if only is None or p == only:
                views[p][rank, :chunk].copy_(src[p * chunk:(p + 1) * chunk])

    def reduce(self, chunk: int) -> None:
        """3. The inbox slots in rank order, summed (fp32 accumulation, one rounding) into the outbox."""
        mine, world = self.views[self.rank], self.world
        torch.sum(mine[:world, :chunk], dim=0, out=mine[world, :chunk])

    def gather(self, dst: torch.Tensor, chunk: int, only: int | None = None) -> None:
        """5. Chunk p of dst from rank p's outbox; ``only``: that p alone."""
        world, rank, views = self.world, self.rank, self.views
        for step in range(world):
            p = (rank + step) % world
            if only is None or p == only:
                dst[p * chunk:(p + 1) * chunk].copy_(views[p][world, :chunk])


_PENDING: list | None = None  # the all-reduces that overlapped() waits for, while it runs


def all_reduce_sum(t: torch.Tensor, group, copy: "_CopyAllReduce | None" = None,
                   direct_nccl: bool = True, two_shot: "_TwoShot | None" = None) -> torch.Tensor:
    """SUM of ``t`` over ``group``, in place, as a row-wise layer reduces its partial sums: waited for
    by the current stream (an eager call on NCCL through the group's direct communicator,
    ``_DirectNccl``, unless ``direct_nccl`` is False), or, inside :func:`overlapped`, started on
    NCCL's stream (``copy``, a ``_CopyAllReduce`` of the group, where it applies: on its side stream,
    by the copy engines) and waited for at its end; ``two_shot`` (a ``_TwoShot`` of the group), where
    it applies and not inside :func:`overlapped`: the two-shot all-reduce. For layers outside tilemm
    (a bf16 ``torch.nn.Linear`` sharded by hand) that should overlap like tilemm's. Returns ``t``."""
    if group is None:
        group = dist.group.WORLD
    if two_shot is not None and _PENDING is None and two_shot(t) is not None:
        return t
    waiter = copy.start(t) if copy is not None else None
    if _PENDING is not None:
        _PENDING.append(waiter if waiter is not None else group.allreduce([t], _SUM_ASYNC))
        return t
    if waiter is not None:
        waiter.wait()
        return t
    direct = _direct_nccl(group, t, direct_nccl)
    if direct is not None:
        return direct.all_reduce(t, _DirectNccl.SUM)
    work = group.allreduce([t], _SUM)
    if work is not None:
        work.wait()
    return t


def overlapped(fn, x: torch.Tensor, chunks: int) -> torch.Tensor:
    """``fn(x)`` computed on ``chunks`` pieces of x's rows, each row-wise layer's all-reduce of piece
    i running (on NCCL's own stream, or by the copy engines on their side stream for a layer with
    ``copy_min_bytes``) while piece i + 1 is computed; returns the pieces' outputs
    joined, after the current stream has waited for every all-reduce (no host sync; captures in a
    CUDA graph).

    For a column-then-row pair such as an MLP, ``fn = lambda t: fc2(act(fc1(t)))``: only the last
    piece's all-reduce is left exposed, where one all-reduce at the end exposes all of it. ``fn``
    must return the row-wise layers' outputs without reading them (their sums arrive when
    ``overlapped`` returns) and treat rows independently. Layers that quantize the activation with
    one scale for the whole tensor (NVFP4 both sides, FP8 per tensor) raise ValueError: a piece's
    scale would differ from the whole tensor's. Weight-only layers that multiply the pieces through
    their weight decoded to bf16 (many rows) decode it once for all pieces
    (``tilemm.weight_only.decoded_once``). Not reentrant.
    """
    global _PENDING
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"tilemm.parallel.overlapped: chunks must be an int >= 1, got {chunks!r}")
    if _PENDING is not None:
        raise RuntimeError("tilemm.parallel.overlapped: already running (not reentrant)")
    pending: list = []
    _PENDING = pending
    try:
        with _weight_only.decoded_once():  # a weight decoded for cuBLAS (many rows) is decoded once
            outs = [fn(piece) for piece in x.chunk(chunks, dim=0)]
    finally:
        _PENDING = None
        for work in pending:
            if work is not None:
                work.wait()
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)


def _tapered(rows: int, pieces: int) -> list[int]:
    """Row counts of at most ``pieces`` pieces that halve toward the end (the last two about equal):
    4096 rows in 6 -> 2048, 1024, 512, 256, 128, 128. Piece i's all-reduce then runs during piece
    i + 1's matmul, at least half as long, and the one left exposed, the last, is small. Multiples of
    16 rows where the rows allow it."""
    unit = 16 if rows >= 64 * pieces else 1
    sizes, left = [], rows
    for _ in range(pieces - 1):
        size = (left // 2) // unit * unit
        if size < unit:
            break
        sizes.append(size)
        left -= size
    sizes.append(left)
    return sizes


class ShardedLinear(Linear):
    """A :class:`tilemm.nn.Linear` sharded in place by ``ColwiseParallel`` / ``RowwiseParallel`` /
    ``shard_linear`` (its class becomes this one; ``isinstance(layer, tilemm.nn.Linear)`` still holds).

    Its buffers are its rank's shard (see ``local_shard``), and its forward runs on plain local
    tensors: column-wise, the local matmul (the output stays this rank's ``Shard(-1)`` slice; same
    activation, same bytes, same per-column reduction over K as the unsharded layer); row-wise, the
    local matmul of this rank's K-slice and one all-reduce (SUM, in the activation dtype, on the
    current CUDA stream for NCCL) of the partial sums. With both
    sides quantized to NVFP4 or FP8 per tensor / per row, a row-wise layer first all-reduces (MAX)
    the activation's amax (the fp32 bits as int32, ``tilemm.quantize.amax_bits``; (M, 1) per row; NVFP4
    at small batch on Hopper: its K-slice's per-tile maxima, slot by slot) and quantizes its slice with
    it, so every rank quantizes exactly as the unsharded layer does. Nothing
    syncs with the host and every allocation has the same size each call, so a column-then-row pair
    captures in one CUDA graph with one all-reduce (two with the amax).

    DTensor is used only where the caller asks for it: a DTensor input, or input / output layouts
    other than the styles' defaults, go through ``DTensor.from_local`` / ``redistribute`` as torch's
    styles do (their host time per call exceeds the all-reduce's). The all-reduce goes straight to the
    process group with options built once (``dist.all_reduce`` checks its arguments and builds its
    options on every call).

    Its buffers are plain local tensors, so ``state_dict()`` holds this rank's shard and loads into a
    layer sharded the same way (same mesh size and style); it is not a DTensor state dict for
    ``torch.distributed.checkpoint``.
    """

    def forward(self, x):
        tp = self._tp
        if tp.plain_input and type(x) is torch.Tensor:
            local = x
        else:
            local = _input_to_local(x, tp.mesh, tp.input_layouts, tp.desired_input)
        if _PENDING is not None and (tp.tensor_scale or not tp.plain_output):
            raise ValueError(f"tilemm.parallel.overlapped: this layer ({self._options.describe()}) "
                             + ("quantizes its activation with one scale for the whole tensor; splitting the "
                                "rows would change it" if tp.tensor_scale else "has a non-default output layout, "
                                "whose DTensor collectives would run beside the queued all-reduces")
                             + "; call it without overlapped")
        if tp.style == "colwise":
            out = Linear.forward(self, local)
            return out if tp.plain_output else self._to_output_layout(out, tp)
        if tp.plain_output:
            pending = _PENDING
            if pending is not None:  # inside overlapped(): reduce asynchronously, wait at its end
                out = self._partial(local, tp, on_nccl_stream=True)
                pending.append(tp.start_all_reduce(out)[0])
                return out
            if (tp.chunks > 1 and not tp.tensor_scale and local.ndim >= 2
                    and local.numel() >= tp.chunk_min_rows * self.in_features):
                return self._chunked(local, tp)
            return tp.all_reduce(self._partial(local, tp))
        return self._to_output_layout(self._partial(local, tp), tp)

    def _partial(self, local: torch.Tensor, tp: _TPConfig, on_nccl_stream: bool = False) -> torch.Tensor:
        """This rank's partial sum over its K-slice (row-wise), before any reduction.

        ``on_nccl_stream``: the amax all-reduce (if any) goes to NCCL's own stream, behind the pieces'
        sums already queued there, so that no two collectives of the communicator run at once on
        two streams (which NCCL does not allow)."""
        if tp.amax is not None:
            return self._partial_with_global_amax(local, tp, on_nccl_stream)
        return Linear.forward(self, local)

    def _chunked(self, local: torch.Tensor, tp: _TPConfig) -> torch.Tensor:
        """The rows in ``tp.chunks`` pieces: piece i's all-reduce (NCCL's own stream, or the copy
        engines' side stream) runs while piece i + 1 is multiplied; the current stream waits for all
        of them (no host sync), then the pieces are joined (the copies write each piece's sum into its
        rows of the output directly). Same sums as one all-reduce, row by row."""
        rows = local.reshape(-1, self.in_features)
        pieces = rows.split(_tapered(rows.shape[0], tp.chunks)) if tp.taper else rows.chunk(tp.chunks)
        # The copy-engine all-reduce writes each piece's sum straight into its rows of the output
        # (no concatenation at the end); NCCL sums each piece in place.
        out = (torch.empty(rows.shape[0], self.out_features, dtype=local.dtype, device=local.device)
               if tp.copy is not None else None)
        # Every piece's partial sum stays referenced until the waits: the side stream reads it while
        # the current stream goes on, which could otherwise reuse its memory.
        parts, works, start = [], [], 0
        with _weight_only.decoded_once():  # a weight decoded for cuBLAS (many rows): once, not per piece
            for piece in pieces:
                part = self._partial(piece, tp, on_nccl_stream=True)
                target = None if out is None else out[start:start + piece.shape[0]]
                work, written = tp.start_all_reduce(part, target)
                works.append(work)
                parts.append((part, None if written else target))
                start += piece.shape[0]
        for work in works:
            if work is not None:
                work.wait()
        if out is None:
            out = torch.cat([part for part, _ in parts])
        else:
            for part, target in parts:
                if target is not None:  # a piece that went to NCCL (outside the copies' sizes)
                    target.copy_(part)
        return out.reshape(*local.shape[:-1], self.out_features)

    def _partial_with_global_amax(self, x: torch.Tensor, tp: _TPConfig,
                                  on_nccl_stream: bool = False) -> torch.Tensor:
        """This rank's partial sum, its K-slice quantized with the amax of the whole activation.

        The ranks all-reduce the amax (MAX over the fp32 bits as int32: NaN propagates where the
        quantizer propagates it), and each quantizes its slice with it
        (``tilemm.quantize.quantize_nvfp4_with_amax`` / ``quantize_fp8_with_amax``). NVFP4 on the GPU
        takes its slice's amax from the quantize kernels' own ``tensor_amax`` (one read of the
        activation in its dtype, then one small reduction), the amax the unsharded layer's quantizer
        computes; at small batch on Hopper the per-tile maxima themselves are exchanged
        (``_small_batch_nvfp4``: by NCCL, or in a CUDA graph by the one-shot kernel, ``amax_tiles``);
        elsewhere ``quantize.amax_bits``."""
        one_shot = tp.one_shot
        if one_shot is not None and not on_nccl_stream and tp.amax is Granularity.TENSOR and x.is_cuda:
            if one_shot.live():
                exchange = one_shot.amax_slot(x.device)
            else:  # eager, NCCL's MAX: the exchange set up (collective, once) for a later capture
                exchange = None
                if not torch.compiler.is_compiling():
                    if one_shot.amax_slots is None:
                        one_shot.amax_slot(x.device)
                    m = x.numel() // max(x.shape[-1], 1)
                    if self._options.format == "nvfp4" and m <= _SMALL_BATCH_ROWS:  # the vector, for a capture
                        one_shot.amax_tiles(x.device, _quantize_kernels.amax_slots(m, tp.widest_k))
        else:
            exchange = None
        small = self._runner
        if (small is not None and type(x) is torch.Tensor and x.ndim == 2 and x.is_cuda
                and x.shape[0] <= _SMALL_BATCH_ROWS and x.shape[1] == self.in_features
                and x.dtype in _ACTIVATION_DTYPES and self._options.format == "nvfp4" and small.runner is not None
                and small.source == self._small_batch_key(x.device) and not torch.compiler.is_compiling()):
            # The common call, checked as Linear.forward checks its own small-batch call.
            slots = _quantize_kernels.amax_slots(x.shape[0], tp.widest_k)
            tiles = None if exchange is None else one_shot.amax_tiles(x.device, slots)
            if slots <= _quantize_kernels.AMAX_PARTIALS and (exchange is None or tiles is not None):
                return self._small_batch_nvfp4(x, x, tp, small.runner, slots, on_nccl_stream, tiles)
        self._check_input(x)
        rows = x.reshape(-1, self.in_features)
        options = self._options
        kernels = _quantize._quantize_kernels(rows) if options.format == "nvfp4" else None
        # ``exchange``: the symmetric-memory exchange (one one-shot kernel) where the layer's one-shot
        # all-reduce is live for this call and there is one amax for the whole tensor; else NCCL's MAX.
        runner, amax = None, None
        if kernels is not None and rows.numel() < _INT32_LIMIT and not torch.compiler.is_compiling():
            # What Linear.forward runs on Hopper at any number of rows (fake quant, then the weight-only
            # plan), here with the exchanged amax; None elsewhere, and for an activation of 2^31
            # elements or more (the fake quant's offsets are int32).
            runner = self._small_batch_runner(x.device)
        if kernels is not None and rows.shape[0] <= _SMALL_BATCH_ROWS and not torch.compiler.is_compiling():
            slots = kernels.amax_slots(rows.shape[0], tp.widest_k)
            tiles = None if exchange is None else one_shot.amax_tiles(x.device, slots)
            if slots <= kernels.AMAX_PARTIALS and (exchange is None or tiles is not None):
                if runner is not None:
                    return self._small_batch_nvfp4(x, rows, tp, runner, slots, on_nccl_stream, tiles)
                # Every rank exchanges the same ``slots`` words, whether or not its own slice has a
                # runner (prepack may refuse one rank's slice): collectives of one length on all ranks.
                rows = rows if rows.is_contiguous() else rows.contiguous()
                amax = kernels.tile_amax(rows, slots, stream_handle(x.device), out=None if tiles is None else tiles[1])
                if tiles is None:
                    tp.all_reduce_max(amax, on_nccl_stream)
                    amax = amax.amax().reshape(1)
                else:
                    amax = one_shot.amax_max(tiles[0])
        if amax is None:  # not the per-tile maxima, exchanged above: the slice's amax, then its exchange
            if kernels is not None:
                partial = kernels.tensor_amax(rows, propagate_nan=False)
                if exchange is not None:
                    torch.amax(partial, 0, keepdim=True, out=exchange[1])
                else:
                    amax = partial.amax().reshape(1)
            else:
                nan = options.format == "fp8"  # FP8's amax propagates NaN; NVFP4's is over the finite values
                amax = _quantize.amax_bits(rows, tp.amax, propagate_nan=nan)
                if exchange is not None:
                    exchange[1].copy_(amax)
            if exchange is not None:
                amax = one_shot.amax_max(exchange[0])
            else:
                tp.all_reduce_max(amax, on_nccl_stream)
        if options.format == "nvfp4":
            if runner is not None:
                rows = rows if rows.is_contiguous() else rows.contiguous()
                xq, alpha = runner.fake_quant.run(rows, stream_handle(x.device), amax=amax)
                out = runner.inner(xq, alpha, out_dtype=x.dtype)
                return out.reshape(*x.shape[:-1], self.out_features)
            x_q = _quantize.quantize_nvfp4_with_amax(rows, amax, swizzle=options.swizzle)
        else:
            x_q = _quantize.quantize_fp8_with_amax(rows, amax, granularity=tp.amax,
                                                   elem_dtype=options.elem_dtype)
        out = _matmul.linear(x_q, self.quantized_weight(), bias=self.bias, out_dtype=x.dtype)
        return out.reshape(*x.shape[:-1], self.out_features)

    def _small_batch_nvfp4(self, x: torch.Tensor, rows: torch.Tensor, tp: _TPConfig, runner, slots: int,
                           on_nccl_stream: bool, tiles=None) -> torch.Tensor:
        """``_partial_with_global_amax`` for NVFP4 at small batch on Hopper, with nothing worked out
        per call that the layer's shape fixes: the slice's per-tile amax maxima
        (``quantize_kernels.tile_amax``, ``slots`` of them, as many on every rank: the widest slice's
        tiles), their exchange, and the small-batch runner's two launches, which reduce the maxima
        themselves. Four launches (amax, exchange, fake-quantize, matmul), one fewer than reducing the
        maxima to one word before the exchange; the same amax bits, so the same bytes. The exchange:
        NCCL's elementwise MAX all-reduce, or with ``tiles`` (``_OneShot.amax_tiles``, inside a CUDA
        graph) the one-shot kernel gathering every rank's maxima side by side."""
        rows = rows if rows.is_contiguous() else rows.contiguous()
        stream = stream_handle(x.device)
        if tiles is not None:
            vector, mine = tiles
            _quantize_kernels.tile_amax(rows, slots, stream, out=mine)
            amax = tp.one_shot.amax_gather(vector)
        else:
            amax = _quantize_kernels.tile_amax(rows, slots, stream)
            tp.all_reduce_max(amax, on_nccl_stream)
        xq, alpha = runner.fake_quant.run(rows, stream, amax=amax)
        out = runner.inner(xq, alpha, out_dtype=x.dtype)
        return out if x.ndim == 2 else out.reshape(*x.shape[:-1], self.out_features)

    def _to_output_layout(self, out: torch.Tensor, tp: _TPConfig):
        if tp.style == "colwise":
            shape = (*out.shape[:-1], tp.full_out)
            out = DTensor.from_local(out, tp.mesh, tp.local_output, run_check=False, shape=torch.Size(shape),
                                     stride=_contiguous_stride(shape))
        else:
            out = DTensor.from_local(out, tp.mesh, tp.local_output, run_check=False)
        if tuple(out.placements) != tp.output_layouts:
            out = out.redistribute(placements=tp.output_layouts)
        return out.to_local() if tp.use_local_output else out


def _shard_in_place(fn: str, module: Linear, mesh: DeviceMesh, style: str, *, src_data_rank,
                    input_layouts: tuple[Placement, ...], output_layouts: tuple[Placement, ...],
                    use_local_output: bool, chunks: int = 1, chunk_min_rows: int = 1024,
                    one_shot_max_bytes: int = ONE_SHOT_MAX_BYTES, copy_min_bytes: int = 0, taper: bool = False,
                    direct_nccl: bool = True, one_shot_eager: bool = False, two_shot_min_bytes: int = 0) -> Linear:
    """Shard ``module`` in place: the same :class:`tilemm.nn.Linear` object, rebuilt for its shard through
    the public constructor and ``load_state_dict`` (so state derived from the buffers follows the shard),
    its class switched to :class:`ShardedLinear` (a subclass: only ``forward`` differs)."""
    _check_layer(fn, module)
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"{fn}: device_mesh must be a torch.distributed.device_mesh.DeviceMesh, got "
                        f"{type(mesh).__name__}")
    if mesh.ndim != 1:
        raise ValueError(f"{fn}: device_mesh must be 1-D (slice a multi-dimensional mesh, e.g. "
                         f"mesh['tp']), got a {mesh.ndim}-D mesh of shape {tuple(mesh.shape)}")
    if src_data_rank is not None and (isinstance(src_data_rank, bool) or not isinstance(src_data_rank, int)
                                      or not 0 <= src_data_rank < mesh.size()):
        raise ValueError(f"{fn}: src_data_rank must be None or a rank of the mesh in [0, {mesh.size()}), "
                         f"got {src_data_rank!r}")
    rank, world_size = mesh.get_local_rank(), mesh.size()
    shard = _shard_of(fn, module, style, rank, world_size)  # check before any communication
    device = _mesh_device(mesh)
    if _device_of(module) != device:
        module.to(device)
    if src_data_rank is not None:
        _broadcast_layer(module, mesh, src_data_rank)
    _adopt(module, _build_local(module, shard, device))
    amax = _global_activation_scale(module) if style == "rowwise" and world_size > 1 else None
    tensor_scale = _global_activation_scale(module) is Granularity.TENSOR
    module._tp = _TPConfig(style, mesh, input_layouts, output_layouts, use_local_output, amax,
                           shard.out_features, chunks=chunks, chunk_min_rows=chunk_min_rows,
                           one_shot_max_bytes=one_shot_max_bytes if world_size > 1 and style == "rowwise" else 0,
                           one_shot_eager=one_shot_eager,
                           two_shot_min_bytes=two_shot_min_bytes if world_size > 1 and style == "rowwise" else 0,
                           tensor_scale=tensor_scale, copy_min_bytes=copy_min_bytes if world_size > 1 else 0,
                           taper=taper, widest_k=ceil_div(shard.in_features, world_size), direct_nccl=direct_nccl)
    module.__class__ = ShardedLinear
    return module


class ColwiseParallel(_torch_tp.ColwiseParallel):
    """``torch.distributed.tensor.parallel.ColwiseParallel`` that also shards :class:`tilemm.nn.Linear`.

    Same keywords (``input_layouts``, default ``Replicate()``; ``output_layouts``, default
    ``Shard(-1)``; ``use_local_output``, default True) and the same placements on the module's
    inputs and outputs. A tilemm layer is sharded in place as ``local_shard`` describes
    (output features split; the quantized bytes come from rank ``src_data_rank`` of
    ``parallelize_module``, default 0, or from each rank itself with None); any other module goes to
    torch's style, so one plan can mix tilemm and torch layers.
    """

    def _apply(self, module: torch.nn.Module, device_mesh: DeviceMesh) -> torch.nn.Module:
        if not isinstance(module, Linear):
            return super()._apply(module, device_mesh)
        return _shard_in_place("tilemm.parallel.ColwiseParallel", module, device_mesh, "colwise",
                               src_data_rank=self.src_data_rank, input_layouts=self.input_layouts,
                               output_layouts=self.output_layouts, use_local_output=self.use_local_output)


class RowwiseParallel(_torch_tp.RowwiseParallel):
    """``torch.distributed.tensor.parallel.RowwiseParallel`` that also shards :class:`tilemm.nn.Linear`.

    Same keywords (``input_layouts``, default ``Shard(-1)``; ``output_layouts``, default
    ``Replicate()``, reached by an all-reduce of the partial sums, or ``Shard(...)`` by a
    reduce-scatter; ``use_local_output``, default True). A tilemm layer is sharded in place (input
    features split; bias on rank 0 only, so the sum adds it once); any other module goes to torch's
    style. Two more keywords choose how a tilemm layer's all-reduce runs (default layouts only):

    - ``chunks`` (default 1: one all-reduce at the end): with an input of at least
      ``chunk_min_rows`` rows (default 1024), the rows are multiplied in ``chunks`` pieces and piece
      i's all-reduce runs on NCCL's stream while piece i + 1 is multiplied (not for layers with one
      activation scale for the whole tensor, whose pieces would be quantized differently).
    - ``one_shot_max_bytes`` (default ``ONE_SHOT_MAX_BYTES``, 256 KiB: a decode step's output up to
      32 rows of 4096 bf16 features; 0: off): inside CUDA-graph capture, all-reduces of at most this
      many bytes go through torch's symmetric-memory one-shot all-reduce (``_OneShot``: one kernel
      that reads the peers' buffers over NVLink and sums in rank order; NCCL where it is
      unavailable). With both sides NVFP4 or FP8 per tensor, the activation amax is then exchanged
      through it too (one one-shot kernel instead of NCCL's MAX all-reduce). It is set up, a
      collective step, on the first eager call that fits, so warm the layer up eagerly before
      capturing, as CUDA graphs need anyway. With more than two ranks a graph's sum may then differ
      from the eager call's in the last bits (NCCL's order of the ranks is not rank order).
    - ``one_shot_eager`` (default False): eager calls take the one-shot all-reduce too (where it
      fits). Off by default because eagerly its op's host time exceeds the direct NCCL call's.
    - ``two_shot_min_bytes`` (default 0: off): all-reduces of at least this many bytes (at most
      ``_TwoShot.MAX_BYTES``) go through torch's symmetric-memory two-shot all-reduce (``_TwoShot``:
      a copy into a symmetric buffer, then one kernel on all SMs that sums a slice per rank over
      NVLink and writes it to every rank; NCCL where it is unavailable), eagerly and in graphs.
    - ``copy_min_bytes`` (default 0: off): all-reduces of at least this many bytes (at most
      ``_CopyAllReduce.MAX_BYTES``) are done by the copy engines through symmetric memory
      (``_CopyAllReduce``: peer-to-peer copies, one sum kernel; NCCL where it is unavailable). With
      ``chunks``, piece i's copies run on a side stream while piece i + 1 is multiplied, taking no
      SMs from the matmul.
    - ``taper`` (default False: equal pieces): with ``chunks``, pieces that halve toward the end
      (``_tapered``: 4096 rows in 6 -> 2048, 1024, 512, 256, 128, 128), so that the one all-reduce
      left exposed, the last piece's, is short.
    - ``direct_nccl`` (default True): eager all-reduces (the sum and the activation amax's MAX) call
      NCCL directly on a communicator of the group's ranks (``_DirectNccl``: one library call of host
      time instead of ``ProcessGroup.allreduce``'s bookkeeping; the same NCCL reduction); CUDA-graph
      capture and torch.compile keep the ``ProcessGroup``. False: always the ``ProcessGroup``.
    """

    def __init__(self, *, chunks: int = 1, chunk_min_rows: int = 1024, one_shot_max_bytes: int = ONE_SHOT_MAX_BYTES,
                 copy_min_bytes: int = 0, taper: bool = False, direct_nccl: bool = True, one_shot_eager: bool = False,
                 two_shot_min_bytes: int = 0, **kwargs):
        super().__init__(**kwargs)
        for name, flag in (("taper", taper), ("direct_nccl", direct_nccl), ("one_shot_eager", one_shot_eager)):
            if not isinstance(flag, bool):
                raise TypeError(f"tilemm.parallel.RowwiseParallel: {name} must be True or False, got {flag!r}")
        self.taper, self.direct_nccl, self.one_shot_eager = taper, direct_nccl, one_shot_eager
        for name, value, low in (("chunks", chunks, 1), ("chunk_min_rows", chunk_min_rows, 1),
                                 ("one_shot_max_bytes", one_shot_max_bytes, 0), ("copy_min_bytes", copy_min_bytes, 0),
                                 ("two_shot_min_bytes", two_shot_min_bytes, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"tilemm.parallel.RowwiseParallel: {name} must be an int >= {low}, "
                                 f"got {value!r}")
        self.chunks, self.chunk_min_rows, self.one_shot_max_bytes = chunks, chunk_min_rows, one_shot_max_bytes
        self.copy_min_bytes, self.two_shot_min_bytes = copy_min_bytes, two_shot_min_bytes

    def _apply(self, module: torch.nn.Module, device_mesh: DeviceMesh) -> torch.nn.Module:
        if not isinstance(module, Linear):
            return super()._apply(module, device_mesh)
        return _shard_in_place("tilemm.parallel.RowwiseParallel", module, device_mesh, "rowwise",
                               src_data_rank=self.src_data_rank, input_layouts=self.input_layouts,
                               output_layouts=self.output_layouts, use_local_output=self.use_local_output,
                               chunks=self.chunks, chunk_min_rows=self.chunk_min_rows,
                               one_shot_max_bytes=self.one_shot_max_bytes, copy_min_bytes=self.copy_min_bytes,
                               taper=self.taper, direct_nccl=self.direct_nccl, one_shot_eager=self.one_shot_eager,
                               two_shot_min_bytes=self.two_shot_min_bytes)


def shard_linear(layer: Linear, device_mesh: DeviceMesh, style: str, *, src_data_rank: int | None = 0,
                 use_local_output: bool = True) -> Linear:
    """Shard an already-quantized :class:`tilemm.nn.Linear` over a 1-D mesh, in place; returns it.

    ``style="colwise"`` is ``parallelize_module(layer, device_mesh, ColwiseParallel())``: replicated
    input, output features split, the local output is this rank's ``Shard(-1)`` slice.
    ``style="rowwise"`` is the same with ``RowwiseParallel()``: ``Shard(-1)`` input (a local slice of
    the features, as a column-wise layer returns it, or a DTensor), partial sums all-reduced to a
    replicated output. Nothing is re-quantized (see ``local_shard`` for the exact bytes each rank
    keeps and the ValueErrors for boundaries inside a scale block). ``src_data_rank`` (default 0)
    broadcasts that rank's layer first, so all ranks shard the same bytes; None uses each rank's own.
    The layer moves to the mesh's device (the current CUDA device for a "cuda" mesh).
    """
    fn = "tilemm.shard_linear"
    _check_layer(fn, layer)
    style = _check_style(fn, style)
    if not isinstance(use_local_output, bool):
        raise TypeError(f"{fn}: use_local_output must be True or False, got {use_local_output!r}")
    given = (Replicate(),) if style == "colwise" else (Shard(-1),)
    output = (Shard(-1),) if style == "colwise" else (Replicate(),)
    return _shard_in_place(fn, layer, device_mesh, style, src_data_rank=src_data_rank, input_layouts=given,
                           output_layouts=output, use_local_output=use_local_output)
