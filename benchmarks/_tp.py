"""What the tensor-parallel benchmarks (``bench_tp.py``, ``bench_tp_decode.py``) share: starting the
ranks, a bf16 ``nn.Linear`` sharded the way ``tilemm.parallel`` shards a tilemm layer (the baseline),
the GPUs' names (results go where ``_results.py`` says).

``PlainShard`` is the bf16 baseline: torch's own ``ColwiseParallel`` / ``RowwiseParallel`` would turn
the weight into a DTensor and dispatch every call through DTensor, a per-call host cost that
``tilemm.parallel.ShardedLinear`` does not pay; comparing against that would flatter tilemm. So the
bf16 layer is sharded like the tilemm one: the local slice of the weight (``torch.chunk`` slices, as
DTensor's ``Shard``), ``F.linear`` on plain tensors, and row-wise one ``all_reduce`` of the partial
sums (bias on rank 0 only).
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

import tilemm


def start(cpu: bool = False) -> tuple[int, int, torch.device]:
    """(rank, world size, this rank's GPU) under torchrun: NCCL process group initialized (``cpu``:
    gloo and the CPU, for smoke tests)."""
    # A time limit's SIGTERM (tp_suite.sh's `timeout`) prints every thread's stack before the process
    # ends, so that a hang says where each rank was.
    faulthandler.register(signal.SIGTERM, file=sys.stderr, all_threads=True, chain=True)
    if "RANK" not in os.environ:
        raise SystemExit("run under torchrun, e.g. `torchrun --nproc-per-node 2 " + os.path.basename(
            sys.argv[0]) + "`")
    if cpu:
        dist.init_process_group("gloo")
        return dist.get_rank(), dist.get_world_size(), torch.device("cpu")
    local = int(os.environ.get("LOCAL_RANK", os.environ["RANK"]))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    return dist.get_rank(), dist.get_world_size(), torch.device("cuda", local)


def gpu_names() -> list[str]:
    """Every rank's ``torch.cuda.get_device_name()``, in rank order (collective)."""
    names = [None] * dist.get_world_size()
    dist.all_gather_object(names, torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu")
    return names


def gpus_label(names: list[str]) -> str:
    """``"2x NVIDIA H100 80GB HBM3"`` (or the list, if the GPUs differ)."""
    return f"{len(names)}x {names[0]}" if len(set(names)) == 1 else ", ".join(names)


def slowest(value: float, device) -> float:
    """The largest of the ranks' ``value`` (collective)."""
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _chunk(size: int, rank: int, world: int) -> tuple[int, int]:
    step = -(-size // world)
    lo = min(rank * step, size)
    return lo, min(lo + step, size)


class MLP(torch.nn.Module):
    """fc2(relu(fc1(x))): the 4096 -> 14336 -> 4096 MLP the tensor-parallel benchmarks shard."""

    def __init__(self, fc1, fc2):
        super().__init__()
        self.fc1, self.fc2 = fc1, fc2

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


class PlainShard(torch.nn.Module):
    """Rank ``rank``'s piece of a bf16 ``nn.Linear`` (see the module docstring).

    ``style``: "colwise" (output features; output stays sharded, or with ``gather`` all-gathered back
    to the whole feature dimension, as a vocabulary-parallel ``lm_head`` is) or "rowwise" (input
    features; all-reduced output). ``group``: the process group of the ranks sharing the layer.
    """

    def __init__(self, linear: torch.nn.Linear, style: str, group, gather: bool = False,
                 one_shot_max_bytes: int = tilemm.parallel.ONE_SHOT_MAX_BYTES, copy_min_bytes: int = 0,
                 chunks: int = 1, chunk_min_rows: int = 1024, taper: bool = False, direct_nccl: bool = True,
                 one_shot_eager: bool = False, two_shot_min_bytes: int = 0):
        super().__init__()
        self.direct_nccl = direct_nccl  # tilemm.parallel.all_reduce_sum's direct NCCL call (eager)
        # Row-wise: outputs of at most this many bytes are summed by the one-shot all-reduce (inside
        # CUDA graphs; eagerly too with one_shot_eager), of at least copy_min_bytes by the copy
        # engines, and inputs of at least chunk_min_rows rows are multiplied in ``chunks`` pieces
        # (``taper``: halving toward the end) whose copy all-reduces overlap the next piece's matmul, as tilemm's RowwiseParallel(one_shot_max_bytes=...,
        # one_shot_eager=..., copy_min_bytes=..., chunks=..., taper=...) does.
        self.one_shot = (tilemm.parallel._OneShot(group, one_shot_max_bytes, one_shot_eager)
                         if one_shot_max_bytes and style == "rowwise" else None)
        self.copy = (tilemm.parallel._CopyAllReduce(group, copy_min_bytes)
                     if copy_min_bytes and style == "rowwise" else None)
        self.two_shot = (tilemm.parallel._TwoShot(group, two_shot_min_bytes)  # RowwiseParallel(two_shot_min_bytes=...)
                         if two_shot_min_bytes and style == "rowwise" else None)
        self.chunks, self.chunk_min_rows, self.taper = chunks, chunk_min_rows, taper
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        self.style, self.group, self.world, self.gather = style, group, world, gather
        w = linear.weight.detach()
        if style == "colwise":
            lo, hi = _chunk(w.shape[0], rank, world)
            if gather and (w.shape[0] % world):
                raise ValueError(f"PlainShard: gather needs out_features % world == 0, got {w.shape[0]}")
            self.weight = torch.nn.Parameter(w[lo:hi].contiguous(), requires_grad=False)
            b = None if linear.bias is None else linear.bias.detach()[lo:hi].contiguous()
        else:
            lo, hi = _chunk(w.shape[1], rank, world)
            self.weight = torch.nn.Parameter(w[:, lo:hi].contiguous(), requires_grad=False)
            b = None if linear.bias is None or rank != 0 else linear.bias.detach().clone()
        self.bias = None if b is None else torch.nn.Parameter(b, requires_grad=False)

    def forward(self, x):
        if (self.style == "rowwise" and self.copy is not None and self.chunks > 1 and x.ndim == 2
                and x.shape[0] >= self.chunk_min_rows and tilemm.parallel._PENDING is None):
            return self._chunked(x)
        out = F.linear(x, self.weight, self.bias)
        if self.style == "rowwise":
            if self.one_shot is not None:
                reduced = self.one_shot(out)
                if reduced is not None:
                    return reduced
            # Overlaps inside tilemm.parallel.overlapped.
            tilemm.parallel.all_reduce_sum(out, self.group, copy=self.copy, direct_nccl=self.direct_nccl,
                                           two_shot=self.two_shot)
        elif self.gather:
            local = out.reshape(-1, out.shape[-1]).contiguous()
            rows, cols = local.shape
            parts = torch.empty((self.world * rows, cols), dtype=out.dtype, device=out.device)
            dist.all_gather_into_tensor(parts, local, group=self.group)  # rank r's rows r*rows ..
            out = parts.view(self.world, rows, cols).transpose(0, 1).reshape(*out.shape[:-1], self.world * cols)
        return out

    def _chunked(self, x):
        """The rows in pieces, each piece's sum by the copy engines into its rows of the output while
        the next piece is multiplied (tilemm's ``ShardedLinear._chunked``); pieces outside the
        copies' sizes go to the process group."""
        out = torch.empty(x.shape[0], self.weight.shape[0], dtype=x.dtype, device=x.device)
        parts, waits, start = [], [], 0  # parts stay referenced until the waits (the side stream reads them)
        pieces = (x.split(tilemm.parallel._tapered(x.shape[0], self.chunks)) if self.taper
                  else x.chunk(self.chunks))
        for piece in pieces:
            part = F.linear(piece, self.weight, self.bias)
            target = out[start:start + piece.shape[0]]
            waiter = self.copy.start(part, target)
            if waiter is None:
                tilemm.parallel.all_reduce_sum(part, self.group)
                target.copy_(part)
            else:
                waits.append(waiter)
            parts.append(part)
            start += piece.shape[0]
        for waiter in waits:
            waiter.wait()
        return out
