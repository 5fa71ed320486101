"""The Python cost of a sharded layer's eager call against the unsharded layer's, measured on the CPU.

    python benchmarks/investigations/tp_host_cpu.py [--dims 4096,14336 --formats nvfp4-wo,mxfp4-wo,nvfp4]
                                                    [--world 2] [--profile STEP]

No GPU and no second process: the calls take the sm_90 CUDA route on CPU tensors with launches
recorded, not run (``host_path.cuda_route``), and the process group is torch's ``fake`` backend of
``--world`` ranks in this one process (this process is rank 0; every collective returns at once
having done nothing). So each figure is the Python that tilemm (and torch.distributed's call into the
process group) runs per call, not the launch or the communication. ``--world 1`` uses a real gloo
group of one rank instead (its all-reduce is gloo's, on a tensor that has no peer).

The MLP is ``bench_tp.py``'s, fc2(relu(fc1(x))) with ``--dims`` d_model,hidden at M = ``--rows``,
bf16 activations, sharded column-then-row by ``tilemm.parallel`` (``ColwiseParallel`` /
``RowwiseParallel``, as ``parallelize_module`` applies them). Steps, per format:

* fc1 and fc2 unsharded (``tilemm.nn.Linear``), and the same layers at the shard's shape (an
  unsharded layer of hidden / world features: what the shape alone costs);
* fc1 and fc2 sharded, fc2's local matmul alone (``ShardedLinear._partial``) and fc2's all-reduce
  call alone (``_TPConfig.all_reduce`` on the partial sum);
* the whole MLP unsharded and sharded.

Each figure: best of seven timings of ``--number`` calls back to back, us per call, after warm-up
calls (``host_path.measure``: host time on the CPU, with no GPU work, so not ``benchmarks/_timing.py``). ``--profile STEP`` prints cProfile's top functions for that step (a name as printed), per format.
"""

from __future__ import annotations

import argparse
import copy
import os
import pathlib
import sys
import tempfile

import torch
import torch.distributed as dist

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))  # the repository: tilemm
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # benchmarks: _tp
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # host_path

import tilemm  # noqa: E402
from _tp import MLP  # noqa: E402
from host_path import cuda_route, measure  # noqa: E402
from tilemm.nn import Linear  # noqa: E402

FORMATS = {"nvfp4-wo": dict(format="nvfp4", weight_only=True),
           "mxfp4-wo": dict(format="mxfp4", weight_only=True), "nvfp4": dict(format="nvfp4"),
           "mxfp8": dict(format="mxfp8"), "mxfp4": dict(format="mxfp4")}


def start(world: int) -> None:
    if world == 1:
        dist.init_process_group("gloo", init_method=f"file://{tempfile.mktemp()}", rank=0, world_size=1)
    else:
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)


def steps(kw: dict, d_model: int, hidden: int, rows: int, world: int):
    """(name, callable) per step for one format."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    torch.manual_seed(0)
    dtype = torch.bfloat16
    fc1 = torch.nn.Linear(d_model, hidden, dtype=dtype)
    fc2 = torch.nn.Linear(hidden, d_model, dtype=dtype)
    local = -(-hidden // world)
    fc1_s = torch.nn.Linear(d_model, local, dtype=dtype)
    fc2_s = torch.nn.Linear(local, d_model, dtype=dtype)
    with torch.no_grad():
        fc1_s.weight.copy_(fc1.weight[:local])
        fc1_s.bias.copy_(fc1.bias[:local])
        fc2_s.weight.copy_(fc2.weight[:, :local])
        fc2_s.bias.copy_(fc2.bias)
    x = torch.randn(rows, d_model, dtype=dtype)
    full = MLP(Linear.from_float(fc1, **kw), Linear.from_float(fc2, **kw))
    shape = MLP(Linear.from_float(fc1_s, **kw), Linear.from_float(fc2_s, **kw))
    mesh = init_device_mesh("cpu", (world,))
    sharded = parallelize_module(copy.deepcopy(full), mesh, {"fc1": tilemm.parallel.ColwiseParallel(),
                                                             "fc2": tilemm.parallel.RowwiseParallel()})
    h_full = torch.relu(torch.randn(rows, hidden, dtype=dtype))
    h = h_full[:, :local].contiguous()
    tp = sharded.fc2._tp
    with cuda_route():
        part = sharded.fc2._partial(h, tp)
    return [("unsharded fc1", lambda: full.fc1(x)), ("shard-shaped fc1", lambda: shape.fc1(x)),
            ("sharded fc1", lambda: sharded.fc1(x)),
            ("unsharded fc2", lambda: full.fc2(h_full)), ("shard-shaped fc2", lambda: shape.fc2(h)),
            ("sharded fc2", lambda: sharded.fc2(h)),
            ("  fc2 local matmul", lambda: sharded.fc2._partial(h, tp)),
            ("  fc2 all-reduce call", lambda: tp.all_reduce(part)),
            ("relu", lambda: torch.relu(h)),
            ("unsharded MLP", lambda: full(x)), ("sharded MLP", lambda: sharded(x))]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="tp_host_cpu.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--dims", default="4096,14336", help="d_model,hidden")
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--formats", default="nvfp4-wo,mxfp4-wo,nvfp4", help=f"comma-separated, of {', '.join(FORMATS)}")
    ap.add_argument("--number", type=int, default=2000, help="calls per timing")
    ap.add_argument("--profile", default=None, help="a step's name: print its cProfile top functions")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    d_model, hidden = (int(v) for v in args.dims.split(","))
    start(args.world)
    backend = "gloo" if args.world == 1 else "fake"
    print(f"# CPU, {d_model} -> {hidden} -> {d_model} MLP, M={args.rows}, {args.world} rank(s) ({backend} "
          f"group): Python us per eager call on the sm_90 route (no launch, no communication), launches")
    for fmt in (f for f in args.formats.split(",") if f):
        print(f"## {fmt}")
        for name, fn in steps(FORMATS[fmt], d_model, hidden, args.rows, args.world):
            us, launches = measure(fn, args.number,
                                   profile=args.profile is not None and args.profile.strip() == name.strip(),
                                   top=int(os.environ.get("TOP", "20")), sort=os.environ.get("SORT", "tottime"))
            print(f"{name:24s} {us:8.1f} us  {launches} launch(es)", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
