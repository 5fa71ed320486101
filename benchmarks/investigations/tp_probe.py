"""What the GPUs of one machine offer the tensor-parallel layers: peer access, NCCL's transport and the
all-reduce's speed by size, NCCL against torch's symmetric-memory one-shot all-reduce.

    NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,GRAPH torchrun --nproc-per-node 2 benchmarks/investigations/tp_probe.py

Rank 0 prints, for every pair of GPUs, whether CUDA peer access is possible
(``torch.cuda.can_device_access_peer``), then for bf16 all-reduces of 8 KiB .. 64 MiB, each in a
CUDA graph (median of ``--reps`` replays between CUDA events): the time, the algorithm bandwidth
(bytes / time) and the bus bandwidth (algorithm bandwidth x 2 (N - 1) / N, what each link carries
in a ring); for sizes up to 256 KiB also the one-shot all-reduce (``tilemm.parallel``'s
``RowwiseParallel(one_shot_max_bytes=...)`` path), from 1 MiB the symmetric-memory two-shot
all-reduce in place (a candidate for large outputs), or why they are unavailable. With NCCL_DEBUG=INFO,
NCCL's own lines say which transport each channel uses (``via P2P/CUMEM``, ``P2P/IPC``, ``SHM``,
``NET``) and how many channels it opened.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: _tp

from _timing import Timer  # noqa: E402
from _tp import start  # noqa: E402

SIZES = [8 << 10, 64 << 10, 256 << 10, 1 << 20, 8 << 20, 32 << 20, 64 << 20]
ONE_SHOT_MAX = 256 << 10


def graph_ms(fn, reps: int) -> float:
    """The slowest rank's median time of ``fn`` as CUDA-graph replays (``_timing.Timer``: no L2 flush,
    the ranks lined up by a barrier before each replay, each waited for)."""
    ms, how = Timer(reps, torch.device("cuda"), flush_l2=False, sync_each=True, before_each=dist.barrier)(fn)
    if how != "graph":
        raise RuntimeError("did not capture in a CUDA graph")
    t = torch.tensor([ms], device="cuda", dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    rank, world, device = start()
    import tilemm.parallel as tp

    try:
        if rank == 0:
            n = torch.cuda.device_count()
            print(f"TP PROBE: {world} ranks, torch {torch.__version__}, NCCL {torch.cuda.nccl.version()}, "
                  f"NCCL_NVLS_ENABLE={os.environ.get('NCCL_NVLS_ENABLE')}, "
                  f"TORCH_SYMM_MEM_DISABLE_MULTICAST={os.environ.get('TORCH_SYMM_MEM_DISABLE_MULTICAST')}")
            for a in range(n):
                peers = [b for b in range(n) if b != a and torch.cuda.can_device_access_peer(a, b)]
                print(f"TP PROBE: GPU {a} peer access to {peers}")
        group = dist.group.WORLD
        one_shot = tp._OneShot(group, ONE_SHOT_MAX)
        two_shot, two_shot_error = None, None
        try:  # the symmetric-memory two-shot all-reduce, in place in a symmetric buffer (no copy timed)
            from torch.distributed import _symmetric_memory as symm_mem

            two_shot = symm_mem.empty(SIZES[-1] // 2, dtype=torch.bfloat16, device=device)
            symm_mem.rendezvous(two_shot, group.group_name)
        except Exception as err:  # noqa: BLE001
            two_shot_error = f"{type(err).__name__}: {err}"[:200]
        bus = 2 * (world - 1) / world
        for size in SIZES:
            t = torch.ones(size // 2, dtype=torch.bfloat16, device=device)
            ms = graph_ms(lambda: dist.all_reduce(t), args.reps)
            line = (f"TP PROBE: all-reduce {size / 2**10:8.0f} KiB bf16: NCCL {ms * 1e3:7.1f} us, algbw "
                    f"{size / ms / 1e6:6.1f} GB/s, busbw {size * bus / ms / 1e6:6.1f} GB/s")
            if size <= ONE_SHOT_MAX:
                one_shot(t)  # set up on the first call (collective)
                if one_shot.error is None:
                    got = one_shot(torch.ones_like(t))
                    ok = bool((got == world).all().item())
                    line += f" | one-shot {graph_ms(lambda: one_shot(t), args.reps) * 1e3:7.1f} us" + (
                        "" if ok else " (WRONG SUM)")
                else:
                    line += f" | one-shot unavailable: {one_shot.error}"
            if size >= 1 << 20:
                if two_shot_error is None:
                    try:
                        view = two_shot[: size // 2]
                        ms2 = graph_ms(lambda: torch.ops.symm_mem.two_shot_all_reduce_(view, "sum", group.group_name),
                                       args.reps)
                        line += f" | two-shot (in place) {ms2 * 1e3:7.1f} us, algbw {size / ms2 / 1e6:6.1f} GB/s"
                    except Exception as err:  # noqa: BLE001 (every rank alike)
                        two_shot_error = f"{type(err).__name__}: {err}"[:200]
                if two_shot_error is not None:
                    line += f" | two-shot unavailable: {two_shot_error}"
            if rank == 0:
                print(line, flush=True)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
