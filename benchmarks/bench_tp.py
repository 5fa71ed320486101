"""A tensor-parallel tilemm MLP on N GPUs (NCCL) against the same MLP unsharded on one GPU, same run.

    torchrun --nproc-per-node 2 benchmarks/bench_tp.py                 # every format, M = 1, 16, 1024, 4096
    torchrun --nproc-per-node 4 benchmarks/bench_tp.py --formats bf16,nvfp4-wo --rows 1,4096

The MLP is a transformer feed-forward block without gating, fc2(relu(fc1(x))), with Llama-3-8B's
sizes: d_model 4096, hidden 14336, bf16 activations. Each tilemm format (mxfp8, mxfp4, nvfp4, fp8 per
row; both sides quantized, or ``-wo`` weight-only) is sharded with ``parallelize_module(mlp, mesh,
{"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})`` from ``tilemm.parallel``; ``bf16`` is the
torch MLP sharded the same way on plain tensors (``benchmarks/_tp.PlainShard``). One all-reduce of
the (M, 4096) output per call (NVFP4 / FP8 per row both-sides: one more, of the activation amax).

Correctness first, per case: the sharded output against the unsharded one (relative Frobenius
error; every rank quantizes the same bytes as the unsharded layer, so only the order of the sums
and the bf16 rounding of the partial sums differ: at most ``TOLERANCE``).

Timing, per case, with ``benchmarks/_timing.py``'s timer (the L2 flushed by a 256 MB read before each
call, median of ``--reps``):

* ``graph``: the MLP captured in a CUDA graph (NCCL all-reduce included), replays between CUDA
  events; the GPU time of one call;
* ``eager``: eager calls between CUDA events, each waited for before the next
  (``sync_each``): what one call costs a caller, Python dispatch included wherever it is longer than
  the flush that precedes it (about 0.1 ms), which it is where it matters.

The unsharded MLP runs on rank 0 while the other ranks wait; the sharded one on all ranks at once
(the slowest rank's median is reported). ``all-reduce`` is one (M, 4096) bf16 all-reduce alone, in
a CUDA graph: the floor the row-wise layer adds.

Writes ``tp-mlp-<gpu>-x<N>.json`` and ``.md`` to ``$OUT`` when it is set, else to
``benchmarks/results/``, naming the GPUs (``torch.cuda.get_device_name`` of every rank).
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import shlex
import sys
import time
import traceback

import torch
import torch.distributed as dist

sys.path.insert(0, __import__("os").path.dirname(__file__))

import tilemm  # noqa: E402
from _timing import Timer  # noqa: E402
from _tp import PlainShard, gpu_names, gpus_label, out_dir, slowest, start  # noqa: E402
from tilemm.nn import Linear  # noqa: E402

D_MODEL, HIDDEN = 4096, 14336
M_VALUES = (1, 16, 1024, 4096)
FORMATS = {  # name: from_float keywords (None: bf16 torch.nn.Linear)
    "bf16": None,
    "mxfp8": dict(format="mxfp8"),
    "mxfp8-wo": dict(format="mxfp8", weight_only=True),
    "mxfp4": dict(format="mxfp4"),
    "mxfp4-wo": dict(format="mxfp4", weight_only=True),
    "nvfp4": dict(format="nvfp4"),
    "nvfp4-wo": dict(format="nvfp4", weight_only=True),
    "fp8-row": dict(format="fp8"),
    "fp8-row-wo": dict(format="fp8", weight_only=True),
}
TOLERANCE = 1e-2  # relative Frobenius error, bf16 output with bf16-rounded partial sums
TARGETS = {2: (1.7, 1024), 4: (3.0, 4096)}  # world size: (speed-up at least, from M on)


class MLP(torch.nn.Module):
    def __init__(self, fc1, fc2):
        super().__init__()
        self.fc1, self.fc2 = fc1, fc2

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.float(), ref.float()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def shard(full: MLP, mesh, bf16: bool) -> MLP:
    if bf16:
        group = mesh.get_group()
        return MLP(PlainShard(full.fc1, "colwise", group), PlainShard(full.fc2, "rowwise", group))
    from torch.distributed.tensor.parallel import parallelize_module

    plan = {"fc1": tilemm.parallel.ColwiseParallel(), "fc2": tilemm.parallel.RowwiseParallel()}
    return parallelize_module(copy.deepcopy(full), mesh, plan)


def time_both(fn, timer_graph: Timer, timer_eager: Timer) -> dict:
    graph_ms, how = timer_graph(fn)
    eager_ms, _ = timer_eager(fn, capture=False)
    return dict(graph_ms=graph_ms if how == "graph" else None, eager_ms=eager_ms,
                graph_error=None if how == "graph" else "did not capture")


def bench(args, rank, world, device) -> int:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (world,))
    names = gpu_names()
    timer_graph = Timer(args.reps, device)
    timer_eager = Timer(args.reps, device, sync_each=True)
    torch.manual_seed(0)
    fc1 = torch.nn.Linear(D_MODEL, HIDDEN, device=device, dtype=torch.bfloat16)
    fc2 = torch.nn.Linear(HIDDEN, D_MODEL, device=device, dtype=torch.bfloat16)
    for p in (*fc1.parameters(), *fc2.parameters()):  # every rank the same weights
        dist.broadcast(p.data, 0)
    records, failed, t0 = [], [], time.time()
    formats = [f for f in args.formats.split(",") if f]
    skipped = []
    for name in formats:
        kw = FORMATS[name]
        if args.max_seconds > 0 and slowest(time.time() - t0, device) > args.max_seconds:
            skipped.append(name)  # every rank sees the same (slowest) elapsed time: the same decision
            continue
        try:
            with torch.no_grad():
                full = MLP(fc1, fc2) if kw is None else MLP(Linear.from_float(fc1, **kw),
                                                            Linear.from_float(fc2, **kw))
                sharded = shard(full, mesh, kw is None)
        except Exception as err:  # noqa: BLE001 (record, go on)
            failed.append(f"{name}: sharding failed: {err}")
            if rank == 0:
                traceback.print_exc()
            dist.barrier()
            continue
        for m in args.m:
            rec = dict(format=name, m=m, world_size=world)
            try:
                g = torch.Generator(device=device).manual_seed(m)
                x = torch.randn(m, D_MODEL, device=device, dtype=torch.bfloat16, generator=g)
                with torch.no_grad():
                    rec["rel_err_vs_unsharded"] = err = rel_err(sharded(x), full(x))
                    rec["correct"] = err <= TOLERANCE
                    dist.barrier()
                    if rank == 0:
                        unsharded = time_both(lambda: full(x), timer_graph, timer_eager)
                    else:
                        unsharded = dict(graph_ms=0.0, eager_ms=0.0, graph_error=None)
                    dist.barrier()
                    sharded_t = time_both(lambda: sharded(x), timer_graph, timer_eager)
                    out = torch.empty(m, D_MODEL, device=device, dtype=torch.bfloat16)
                    allreduce_ms, _ = timer_graph(lambda: dist.all_reduce(out))
                for key in ("graph_ms", "eager_ms"):
                    u = slowest(unsharded[key] if unsharded[key] is not None else float("nan"), device)
                    s = slowest(sharded_t[key] if sharded_t[key] is not None else float("nan"), device)
                    rec[f"unsharded_{key}"], rec[f"sharded_{key}"] = u, s
                    rec[f"speedup_{key.removesuffix('_ms')}"] = u / s
                rec["allreduce_ms"] = slowest(allreduce_ms, device)
                if unsharded["graph_error"] or sharded_t["graph_error"]:
                    rec["graph_error"] = "the MLP did not capture in a CUDA graph"
                if not rec["correct"]:
                    failed.append(f"{name} M={m}: sharded differs from unsharded by {err:.2e} > {TOLERANCE}")
            except Exception as e:  # noqa: BLE001
                rec["error"] = f"{type(e).__name__}: {e}"[:400]
                failed.append(f"{name} M={m}: {rec['error']}")
                if rank == 0:
                    traceback.print_exc()
                torch.cuda.synchronize()
            records.append(rec)
            if rank == 0:
                print(line(rec), flush=True)
        del full, sharded
        torch.cuda.empty_cache()
        if rank == 0:  # after every format, so that an interrupted run keeps what it measured
            write(records, names, failed, skipped, args, time.time() - t0, final=False)
    if rank == 0:
        write(records, names, failed, skipped, args, time.time() - t0, final=True)
    return 1 if failed else 0


def line(r: dict) -> str:
    if "error" in r:
        return f"{r['format']:10s} M={r['m']:5d}  FAILED: {r['error']}"
    return (f"{r['format']:10s} M={r['m']:5d}  graph 1 GPU {r['unsharded_graph_ms']:7.3f} ms  "
            f"{r['world_size']} GPUs {r['sharded_graph_ms']:7.3f} ms  x{r['speedup_graph']:5.2f} | eager "
            f"{r['unsharded_eager_ms']:7.3f} / {r['sharded_eager_ms']:7.3f} ms  x{r['speedup_eager']:5.2f} | "
            f"all-reduce {r['allreduce_ms']:.3f} ms | err {r['rel_err_vs_unsharded']:.1e}"
            + ("" if r["correct"] else "  WRONG"))


def targets(records, world) -> list[str]:
    """The issues' targets, checked on the CUDA-graph times: M = 1 no slower than one GPU; from M on
    (TARGETS) at least the speed-up."""
    out = []
    speedup, from_m = TARGETS.get(world, (None, None))
    for r in records:
        if "speedup_graph" not in r:
            continue
        if r["m"] == 1:
            ok = r["sharded_graph_ms"] <= r["unsharded_graph_ms"]
            out.append(f"{r['format']} M=1 graph: {r['sharded_graph_ms']:.3f} vs {r['unsharded_graph_ms']:.3f} ms "
                       f"(no slower than 1 GPU: {'met' if ok else 'NOT met'})")
        if speedup and r["m"] >= from_m:
            ok = r["speedup_graph"] >= speedup
            out.append(f"{r['format']} M={r['m']} graph: x{r['speedup_graph']:.2f} (>= {speedup}: "
                       f"{'met' if ok else 'NOT met'})")
    return out


def write(records, names, failed, skipped, args, seconds, final: bool) -> None:
    world = len(names)
    meta = dict(gpus=names, gpu=names[0], world_size=world, backend="nccl",
                date=datetime.date.today().isoformat(), torch=torch.__version__, tilemm=tilemm.__version__,
                command=f"torchrun --nproc-per-node {world} benchmarks/bench_tp.py {shlex.join(args.argv)}".strip(),
                skipped=skipped, timing="benchmarks/_timing.Timer: L2 flushed by a 256 MB read before each call, median of "
                       f"{args.reps}; graph = CUDA-graph replay, eager = eager calls waited for one by one; "
                       "sharded = the slowest rank", seconds=seconds)
    stem = f"tp-mlp-{names[0].lower().replace(' ', '-')}-x{world}"
    path = out_dir() / f"{stem}.json"
    checks = targets(records, world)
    path.write_text(json.dumps(dict(meta=meta, records=records, targets=checks, failed=failed), indent=1))
    lines = [f"# Tensor-parallel MLP ({D_MODEL} -> {HIDDEN} -> {D_MODEL}, bf16 activations) on "
             f"{gpus_label(names)}, {meta['date']}", "", f"`{meta['command']}`", "", f"Timing: {meta['timing']}.",
             "", "| format | M | 1 GPU graph ms | sharded graph ms | speed-up | 1 GPU eager ms | sharded eager ms "
             "| speed-up | all-reduce ms | rel. err vs 1 GPU |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        if "error" in r:
            lines.append(f"| {r['format']} | {r['m']} | failed: {r['error'][:100].replace('|', '/')} "
                         f"| | | | | | | |")
            continue
        lines.append(f"| {r['format']} | {r['m']} | {r['unsharded_graph_ms']:.4f} | {r['sharded_graph_ms']:.4f} | "
                     f"{r['speedup_graph']:.2f} | {r['unsharded_eager_ms']:.4f} | {r['sharded_eager_ms']:.4f} | "
                     f"{r['speedup_eager']:.2f} | {r['allreduce_ms']:.4f} | {r['rel_err_vs_unsharded']:.1e}"
                     f"{'' if r['correct'] else ' (WRONG)'} |")
    if checks:
        lines += ["", "Targets:", ""] + [f"- {c}" for c in checks]
    if skipped:
        lines += ["", f"Skipped (past --max-seconds {args.max_seconds:g}): {', '.join(skipped)}."]
    if failed:
        lines += ["", "Failures:", ""] + [f"- {f}" for f in failed]
    path.with_suffix(".md").write_text("\n".join(lines) + "\n")
    if final:
        print("\n".join(lines))
        print(f"wrote {path} and {path.with_suffix('.md')}")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--formats", default=",".join(FORMATS),
                        help=f"comma-separated, of: {', '.join(FORMATS)} (default all)")
    parser.add_argument("--rows", default=",".join(map(str, M_VALUES)), help="comma-separated rows of x")
    parser.add_argument("--reps", type=int, default=30, help="timed calls per case (median)")
    parser.add_argument("--max-seconds", type=float, default=0,
                        help="start no new format after this long (0: no limit); the results list those skipped")
    args = parser.parse_args(argv)
    args.argv = argv
    args.m = [int(v) for v in args.rows.split(",")]
    unknown = [f for f in args.formats.split(",") if f and f not in FORMATS]
    if unknown:
        parser.error(f"--formats: unknown {unknown} (choose from {', '.join(FORMATS)})")
    rank, world, device = start()
    try:
        return bench(args, rank, world, device)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    raise SystemExit(main())
