"""A tensor-parallel tilemm MLP on 2 GPUs (NCCL) against the same MLP unsharded on one GPU.

    torchrun --nproc-per-node 2 benchmarks/bench_tp.py            # or: python benchmarks/bench_tp.py
    torchrun --nproc-per-node 2 benchmarks/bench_tp.py --quick    # mxfp8 and nvfp4 only

The MLP is a transformer feed-forward block without gating, fc2(relu(fc1(x))), with Llama-3-8B's
sizes: d_model 4096, hidden 14336, bf16 activations. Each format (mxfp8, mxfp4, nvfp4, fp8 per row),
both sides quantized and weight-only, is sharded with ``parallelize_module(mlp, mesh, {"fc1":
ColwiseParallel(), "fc2": RowwiseParallel()})`` from ``tilemm.parallel``, and run at M = 1 (decode)
and M = 1024 (prefill).

For each case it first checks correctness: the sharded output against the unsharded one on rank 0
(relative Frobenius error; up to bf16 rounding of the partial sums, about 4e-3, where both quantize
the same bytes; NVFP4 and FP8 per row with both sides quantize each rank's slice of the hidden
activation with its own scale, see ``tilemm/parallel.py``, and differ by a quantization-level amount).
Then it times eager forward calls with CUDA events (the DTensor hooks and the NCCL all-reduce run
on the host and the network, so they are part of what is timed), the L2 flushed before each, median
of ``--reps``: the unsharded MLP on rank 0's GPU while rank 1 waits, then the sharded MLP on both
(the slower rank's median), and the all-reduce of one (M, 4096) bf16 output alone, the floor that
the row-wise layer adds.

Writes ``benchmarks/results/tp-<gpu>-x2.json`` (meta and records) and ``.md`` (a table).
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import pathlib
import statistics
import sys

import torch
import torch.distributed as dist

import tilemm
from tilemm.nn import Linear

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
D_MODEL, HIDDEN = 4096, 14336
M_VALUES = (1, 1024)
# (name, from_float keywords, the activation scale spans all of K, so row-wise shards differ)
CONFIGS = [
    ("mxfp8", dict(format="mxfp8"), False),
    ("mxfp8 weight-only", dict(format="mxfp8", weight_only=True), False),
    ("mxfp4", dict(format="mxfp4"), False),
    ("mxfp4 weight-only", dict(format="mxfp4", weight_only=True), False),
    ("nvfp4", dict(format="nvfp4"), True),
    ("nvfp4 weight-only", dict(format="nvfp4", weight_only=True), False),
    ("fp8 row", dict(format="fp8"), True),
    ("fp8 row weight-only", dict(format="fp8", weight_only=True), False),
]
QUICK = ("mxfp8", "mxfp8 weight-only", "nvfp4", "nvfp4 weight-only")
SAME_BYTES_TOLERANCE = 1e-2  # bf16 output, partial sums rounded to bf16 before the all-reduce
PER_SLICE_TOLERANCE = 0.15   # a different quantization of the hidden activation (NVFP4 about 0.1)


class MLP(torch.nn.Module):
    def __init__(self, fc1, fc2):
        super().__init__()
        self.fc1, self.fc2 = fc1, fc2

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def time_ms(fn, reps: int, flush: torch.Tensor) -> float:
    """Median of ``reps`` eager calls, CUDA events around each, L2 flushed before each."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    events = []
    for _ in range(reps):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        events.append((start, end))
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.float(), ref.float()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def slowest(ms: float, device) -> float:
    t = torch.tensor([ms], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def bench(args) -> int:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device())
    mesh = init_device_mesh("cuda", (world,))
    flush = torch.empty(64 * 1024 * 1024, dtype=torch.float32, device=device)  # 256 MB > L2
    torch.manual_seed(0)
    fc1 = torch.nn.Linear(D_MODEL, HIDDEN, device=device, dtype=torch.bfloat16)
    fc2 = torch.nn.Linear(HIDDEN, D_MODEL, device=device, dtype=torch.bfloat16)
    records, failed = [], False
    for name, kw, per_slice in CONFIGS:
        if args.quick and name not in QUICK:
            continue
        full = MLP(Linear.from_float(fc1, **kw), Linear.from_float(fc2, **kw))
        plan = {"fc1": tilemm.parallel.ColwiseParallel(), "fc2": tilemm.parallel.RowwiseParallel()}
        sharded = parallelize_module(copy.deepcopy(full), mesh, plan)
        for m in M_VALUES:
            g = torch.Generator(device=device).manual_seed(m)
            x = torch.randn(m, D_MODEL, device=device, dtype=torch.bfloat16, generator=g)
            with torch.no_grad():
                err = rel_err(sharded(x), full(x))
                tolerance = PER_SLICE_TOLERANCE if per_slice else SAME_BYTES_TOLERANCE
                ok = err <= tolerance
                failed |= not ok
                dist.barrier()
                unsharded_ms = time_ms(lambda: full(x), args.reps, flush) if rank == 0 else 0.0
                unsharded_ms = slowest(unsharded_ms, device)
                dist.barrier()
                sharded_ms = slowest(time_ms(lambda: sharded(x), args.reps, flush), device)
                out = torch.empty(m, D_MODEL, device=device, dtype=torch.bfloat16)
                allreduce_ms = slowest(time_ms(lambda: dist.all_reduce(out), args.reps, flush), device)
            record = dict(format=name, m=m, d_model=D_MODEL, hidden=HIDDEN, unsharded_ms=unsharded_ms,
                          sharded_ms=sharded_ms, speedup=unsharded_ms / sharded_ms,
                          allreduce_ms=allreduce_ms, rel_err_vs_unsharded=err, tolerance=tolerance,
                          correct=ok)
            records.append(record)
            if rank == 0:
                print(f"{name:22s} M={m:5d}  unsharded {unsharded_ms:8.3f} ms  2 GPUs {sharded_ms:8.3f} ms  "
                      f"x{record['speedup']:.2f}  (all-reduce {allreduce_ms:.3f} ms)  err {err:.2e}"
                      f"{'' if ok else '  FAILED'}", flush=True)
        del full, sharded
        torch.cuda.empty_cache()
    if rank == 0:
        write(records, args.out)
    return 1 if failed else 0


def write(records, out_dir: pathlib.Path) -> None:
    gpu = torch.cuda.get_device_name().replace(" ", "_")
    meta = dict(gpu=torch.cuda.get_device_name(), gpus=dist.get_world_size(), backend="nccl",
                date=datetime.date.today().isoformat(), torch=torch.__version__, tilemm=tilemm.__version__,
                timing="eager forward, CUDA events, L2 flushed, median; sharded = slower rank")
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"tp-{gpu}-x{meta['gpus']}.json"
    path.write_text(json.dumps(dict(meta=meta, records=records), indent=1))
    lines = [f"# Tensor-parallel MLP ({D_MODEL} -> {HIDDEN} -> {D_MODEL}, bf16) on {meta['gpus']}x "
             f"{meta['gpu']}, {meta['date']}", "", f"Timing: {meta['timing']}.", "",
             "| format | M | unsharded ms | 2 GPUs ms | speedup | all-reduce ms | rel. err vs unsharded |",
             "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['format']} | {r['m']} | {r['unsharded_ms']:.3f} | {r['sharded_ms']:.3f} | "
              f"{r['speedup']:.2f} | {r['allreduce_ms']:.3f} | {r['rel_err_vs_unsharded']:.2e}"
              f"{'' if r['correct'] else ' (FAILED)'} |" for r in records]
    path.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print(f"wrote {path} and {path.with_suffix('.md')}")


def _spawned(rank: int, world: int, port: int, argv) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    code = main(argv)
    if code:
        raise SystemExit(code)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="mxfp8 and nvfp4 only")
    parser.add_argument("--reps", type=int, default=50, help="timed calls per case (median)")
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS)
    args = parser.parse_args(argv)
    if "RANK" not in os.environ:  # not under torchrun: start the two processes here
        if torch.cuda.device_count() < 2:
            print(f"bench_tp needs 2 CUDA GPUs, found {torch.cuda.device_count()}")
            return 1
        import socket

        import torch.multiprocessing as mp

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.spawn(_spawned, args=(2, port, argv), nprocs=2, join=True)
        return 0
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    try:
        return bench(args)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    raise SystemExit(main())
