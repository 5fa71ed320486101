"""Where the host time of one sharded MLP call goes: a per-step wall-clock breakdown and a profile.

    torchrun --nproc-per-node 2 benchmarks/investigations/tp_host.py                    # NCCL, one GPU per rank
    torchrun --nproc-per-node 2 benchmarks/investigations/tp_host.py --cpu --dims 256,1024   # gloo on the CPU

The MLP is ``bench_tp.py``'s (fc2(relu(fc1(x))), 4096 -> 14336 -> 4096 unless ``--dims``), sharded
column-then-row with ``tilemm.parallel`` (bf16: ``_tp.PlainShard``), at ``--rows`` rows (default 1).
For each format, the median over ``--reps`` calls of the host time (``time.perf_counter`` around the
call alone, not waited for) of:

* the whole call, unsharded and sharded, the unsharded layers alone, and the sharded call's steps one
  at a time: fc1 (column-wise,
  no communication), relu, fc2's local matmul (``ShardedLinear._partial``: for both-sides NVFP4 the
  amax all-reduce included), and the all-reduce of fc2's partial sums by each way of calling it:
  ``ProcessGroup.allreduce`` with prebuilt options (what ``ShardedLinear`` does) split into the call
  and ``Work.wait``, ``dist.all_reduce``, the functional ``torch.ops._c10d_functional.all_reduce_`` +
  ``wait_tensor``, the direct NCCL call (``tilemm.parallel._DirectNccl``, alone and through
  ``all_reduce_sum``), the symmetric-memory one-shot all-reduce, the copy-engine all-reduce; and the amax
  exchange alone (NCCL MAX of the layer's per-tile amax slots, ``quantize_kernels.amax_slots`` of the
  widest K-slice, against the one-shot exchange of one int32);
* with the GPU idle when the call starts (synchronized, ranks lined up by a barrier; "idle", and
  "settled" 2 ms later) and with the GPU still busy (a ``--busy-us`` GPU sleep queued first), because
  a launch can cost the host more when the GPU is idle; and "loop": the mean over ``--reps`` calls
  back to back, the host cost per call in steady state, comparable between a step alone and a whole
  call (a step timed alone after a sync pays the first launch's cost each time; in a whole call only
  its first launch does);

then rank 0's ``cProfile`` of ``--profile-calls`` sharded calls (top functions by own time). On the
CPU every step includes its compute (gloo and the reference kernels are synchronous): use small
``--dims`` and read the profile for the Python overhead around them.

Writes ``tp-host-<device>-x<N>.txt`` to ``$OUT`` when it is set, else prints only. Its own
``perf_counter`` timing, not ``benchmarks/_timing.py``'s: what it times is host time, step by step,
with the ranks lined up by a barrier before each call and the GPU idle or busy on purpose.
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import io
import os
import pstats
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: _tp

import tilemm  # noqa: E402
from _tp import MLP, PlainShard, gpu_names, gpus_label, slowest, start  # noqa: E402
from tilemm.nn import Linear  # noqa: E402

FORMATS = {"bf16": None, "nvfp4-wo": dict(format="nvfp4", weight_only=True),
           "mxfp4-wo": dict(format="mxfp4", weight_only=True), "nvfp4": dict(format="nvfp4"),
           "mxfp8": dict(format="mxfp8")}


def host_us(fn, reps: int, device, busy_cycles: int, after=None, settle_s: float = 0.0) -> float:
    """Median host time of ``fn()`` in us, each call started with the GPU idle (``busy_cycles`` 0) or
    behind a GPU sleep of that many cycles, ranks lined up by a barrier first (and ``settle_s``
    seconds of host sleep after it); the slowest rank's. ``after``: called after each timed call,
    untimed."""
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        dist.barrier()
        if settle_s:
            time.sleep(settle_s)
        if busy_cycles:
            torch.cuda._sleep(busy_cycles)
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        if after is not None:
            after()
    if device.type == "cuda":
        torch.cuda.synchronize()
    dist.barrier()
    return slowest(statistics.median(times) * 1e6, device)


def loop_us(fn, reps: int, device) -> float:
    """Host time per call of ``reps`` calls of ``fn()`` back to back (after a device sync and a
    barrier, nothing between the calls): what each call costs the host once the first has started
    the GPU, as in a decode loop; the slowest rank's."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    per_call = (time.perf_counter() - t0) / reps
    if device.type == "cuda":
        torch.cuda.synchronize()
    dist.barrier()
    return slowest(per_call * 1e6, device)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpu", action="store_true", help="gloo on the CPU (default: NCCL, one GPU per rank)")
    ap.add_argument("--formats", default="bf16,nvfp4-wo,nvfp4", help=f"comma-separated, of {', '.join(FORMATS)}")
    ap.add_argument("--dims", default="4096,14336", help="d_model,hidden")
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--busy-us", type=float, default=300.0, help="the GPU sleep queued before a 'busy' call")
    ap.add_argument("--profile-calls", type=int, default=200)
    ap.add_argument("--no-flight-recorder", action="store_true",
                    help="TORCH_FR_BUFFER_SIZE=0: ProcessGroupNCCL records no entry (with its Python stack) per "
                         "collective")
    args = ap.parse_args()
    if args.no_flight_recorder:
        os.environ["TORCH_FR_BUFFER_SIZE"] = "0"  # read when the process group is created
    rank, world, device = start(cpu=args.cpu)
    d_model, hidden = (int(v) for v in args.dims.split(","))
    dtype = torch.bfloat16
    group = dist.group.WORLD
    names = gpu_names()
    label = gpus_label(names) if device.type == "cuda" else f"{world} CPU ranks (gloo)"
    busy = int(args.busy_us * 1e3 * 1.8) if device.type == "cuda" else 0  # ~1.8 GHz clock cycles
    # idle: right after the barrier; settled: 2 ms after it (whatever the barrier's completion wakes
    # on the host, e.g. NCCL's watchdog, has finished); busy: behind a GPU sleep.
    conditions = [("idle", 0, 0.0), ("settled", 0, 2e-3)] + ([("busy", busy, 0.0)] if busy else [])
    lines = [f"# Host time of one sharded MLP call ({d_model} -> {hidden} -> {d_model}, M = {args.rows}, "
             f"bf16 activations) on {label}", "",
             f"`torchrun --nproc-per-node {world} benchmarks/investigations/tp_host.py {' '.join(sys.argv[1:])}`", "",
             f"torch {torch.__version__}; median of {args.reps} calls, us, the slowest rank. Each call after "
             f"a device sync and a barrier; idle: at once; settled: 2 ms later (host sleep); busy: behind a "
             f"{args.busy_us:g} us GPU sleep.", ""]
    torch.manual_seed(0)
    fc1 = torch.nn.Linear(d_model, hidden, device=device, dtype=dtype)
    fc2 = torch.nn.Linear(hidden, d_model, device=device, dtype=dtype)
    for p in (*fc1.parameters(), *fc2.parameters()):
        dist.broadcast(p.data, 0)
    x = torch.randn(args.rows, d_model, device=device, dtype=dtype)
    dist.broadcast(x, 0)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    mesh = init_device_mesh(device.type, (world,))
    one_shot = tilemm.parallel._OneShot(group, 256 * 1024)
    copy_ar = tilemm.parallel._CopyAllReduce(group, 1)
    for name in [f for f in args.formats.split(",") if f]:
        kw = FORMATS[name]
        with torch.no_grad():
            full = MLP(fc1, fc2) if kw is None else MLP(Linear.from_float(fc1, **kw), Linear.from_float(fc2, **kw))
            if kw is None:
                sharded = MLP(PlainShard(fc1, "colwise", group), PlainShard(fc2, "rowwise", group))
            else:
                plan = {"fc1": tilemm.parallel.ColwiseParallel(), "fc2": tilemm.parallel.RowwiseParallel()}
                sharded = parallelize_module(copy.deepcopy(full), mesh, plan)
                fast = parallelize_module(copy.deepcopy(full), mesh, {
                    "fc1": tilemm.parallel.ColwiseParallel(),
                    "fc2": tilemm.parallel.RowwiseParallel(one_shot_max_bytes=256 * 1024)})
            h = torch.relu(sharded.fc1(x))
            if kw is None:
                part_fn = lambda: torch.nn.functional.linear(h, sharded.fc2.weight, sharded.fc2.bias)  # noqa: E731
            else:
                tp = sharded.fc2._tp
                part_fn = lambda: sharded.fc2._partial(h, tp)  # noqa: E731
            part = part_fn()
            opts = tilemm.parallel._reduce_opts(dist.ReduceOp.SUM, False)
            works = []

            def pg_call():
                works.append(group.allreduce([part], opts))

            def pg_wait():
                work = works.pop()
                if work is not None:
                    work.wait()

            def pg_both():
                pg_call()
                pg_wait()

            h_full = torch.relu(full.fc1(x))
            steps = [("unsharded call", lambda: full(x)), ("sharded call", lambda: sharded(x)),
                     ("  unsharded fc1", lambda: full.fc1(x)), ("  unsharded fc2", lambda: full.fc2(h_full)),
                     ("  fc1 (column-wise)", lambda: sharded.fc1(x)), ("  relu", lambda: torch.relu(h)),
                     ("  fc2 local matmul", part_fn),
                     ("  all-reduce: ProcessGroup.allreduce + wait", pg_both),
                     ("  all-reduce: dist.all_reduce", lambda: dist.all_reduce(part))]
            fn = getattr(getattr(torch.ops, "_c10d_functional", None), "all_reduce_", None)
            if fn is not None:
                gname = group.group_name
                steps.append(("  all-reduce: _c10d_functional.all_reduce_ + wait_tensor",
                              lambda: torch.ops._c10d_functional.wait_tensor(fn(part, "sum", gname))))
            if device.type == "cuda":
                direct = tilemm.parallel._DirectNccl.for_group(group, part.device)  # set up (collective)
                if direct is not None:
                    steps.append(("  all-reduce: direct NCCL (ctypes ncclAllReduce)",
                                  lambda: direct.all_reduce(part, direct.SUM)))
                    steps.append(("  all-reduce: direct NCCL, the call's checks included",
                                  lambda: tilemm.parallel.all_reduce_sum(part, group)))
                if one_shot(part) is not None:  # set up (collective)
                    steps.append(("  all-reduce: symmetric-memory one-shot", lambda: one_shot(part)))
                if copy_ar.start(part) is not None:
                    steps.append(("  all-reduce: copy engines", lambda: copy_ar.start(part).wait()))
                if kw is not None and sharded.fc2._tp.amax == "tensor":
                    slots = tilemm.kernels.quantize_kernels.amax_slots(args.rows, sharded.fc2._tp.widest_k)
                    bits = torch.zeros(slots, dtype=torch.int32, device=device)
                    max_opts = tilemm.parallel._reduce_opts(dist.ReduceOp.MAX, False)

                    def nccl_max():
                        work = group.allreduce([bits], max_opts)
                        if work is not None:
                            work.wait()
                    steps.append(("  amax exchange: NCCL MAX", nccl_max))
                    fast(x)  # sets the exchange up (collective)
                    fast_one_shot = fast.fc2._tp.one_shot
                    if fast_one_shot.amax_slots is not None:
                        steps.append(("  amax exchange: one-shot", lambda: fast_one_shot.amax_max(
                            fast_one_shot.amax_slots[0])))
                    steps.append(("sharded call, one-shot all-reduce and amax exchange", lambda: fast(x)))
            for _, step in steps:  # warm-up (first calls build runners, compile kernels)
                step()
            pg_both()
            steps.insert(8, ("  all-reduce: ProcessGroup.allreduce call alone", (pg_call, pg_wait)))
            lines += [f"## {name}", "", "| step | " + " | ".join(c for c, _, _ in conditions) + " | loop |",
                      "|---|" + "---|" * (len(conditions) + 1)]
            for label_, step in steps:
                call, after = step if isinstance(step, tuple) else (step, None)
                cells = [f"{host_us(call, args.reps, device, cycles, after, settle):.1f}"
                         for _, cycles, settle in conditions]
                cells.append("-" if after is not None else f"{loop_us(call, args.reps, device):.1f}")
                lines.append(f"| {label_} | " + " | ".join(cells) + " |")
            lines.append("")
            # The profile: rank 0's own time per function over many sharded calls.
            profiler = cProfile.Profile()
            dist.barrier()
            profiler.enable()
            for _ in range(args.profile_calls):
                sharded(x)
            profiler.disable()
            if device.type == "cuda":
                torch.cuda.synchronize()
            dist.barrier()
            if rank == 0:
                text = io.StringIO()
                pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(25)
                body = "\n".join(ln for ln in text.getvalue().splitlines() if ln.strip())
                lines += [f"cProfile, rank 0, {args.profile_calls} sharded calls (own time, top 25):", "",
                          "```", body, "```", ""]
        del full, sharded
    if rank == 0:
        report = "\n".join(lines) + "\n"
        print(report)
        if os.environ.get("OUT"):
            tag = names[0].lower().replace(" ", "-") if device.type == "cuda" else "cpu"
            path = os.path.join(os.environ["OUT"], f"tp-host-{tag}-x{world}.txt")
            with open(path, "w") as f:
                f.write(report)
            print(f"wrote {path}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
