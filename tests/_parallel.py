"""Multi-process tensor-parallel runs of tilemm MLPs, shared by the gloo (CPU) and NCCL (GPU) tests.

``run_cases(cases, backend, tmp_dir, world_size)`` spawns ``world_size`` processes once (NCCL: one
GPU each, ranks 0 .. world_size - 1 on cuda:0 ..); each builds a column-then-row parallel MLP for
every case, runs it (on a GPU also replayed from a CUDA graph), checks the state_dict round trip, and
saves what it computed (next to the unsharded model's output on the same device) for the test
process to compare. Rank 0 prints a line before and after each case on the real stderr (visible with
``pytest -s``). A worker that raises prints its traceback there and ends its process at once (the
others are then stopped, and ``run_cases`` raises with every failed rank's traceback); every
collective fails after ``TILEMM_TP_COLLECTIVE_TIMEOUT`` seconds (default 90) instead of waiting for
a rank that never joins; every worker dumps its threads' stacks after ``TILEMM_TP_HANG_DUMP_SECONDS``
(default 240), and at ``TILEMM_TP_HANG_DUMP_AT`` ``run_cases`` has every worker print its stacks,
stops them and raises TimeoutError, so that a slow or hung run says where it is.
"""

from __future__ import annotations

import copy
import faulthandler
import os
import signal
import socket
import sys
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import tilemm
from tilemm.nn import Linear

WORLD_SIZE = 2  # the default; the tests also run 4


class MLP(torch.nn.Module):
    """fc2(relu(fc1(x))): the column-then-row pair of a transformer feed-forward block."""

    def __init__(self, fc1: torch.nn.Module, fc2: torch.nn.Module):
        super().__init__()
        self.fc1, self.fc2 = fc1, fc2

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def make_mlp(d_model: int, hidden: int, seed: int = 0, **quantize) -> MLP:
    """A float MLP (d_model -> hidden -> d_model, with biases) quantized with ``from_float(**quantize)``."""
    torch.manual_seed(seed)
    fc1, fc2 = torch.nn.Linear(d_model, hidden), torch.nn.Linear(hidden, d_model)
    return MLP(Linear.from_float(fc1, **quantize), Linear.from_float(fc2, **quantize))


def empty_like(layer: Linear) -> Linear:
    """A zero layer of ``layer``'s shape and options, built by the constructor (for load_state_dict)."""
    return Linear(layer.in_features, layer.out_features, layer.bias is not None, format=layer.format,
                  bias_dtype=layer.bias.dtype, **layer._options.as_kwargs())


def tp_plan():
    return {"fc1": tilemm.parallel.ColwiseParallel(), "fc2": tilemm.parallel.RowwiseParallel()}


def fast_plan():
    """fc2 in 3 tapered row pieces (6 rows: 3, 1, 2) whose sums the copy engines do (any size), the
    one-shot all-reduce (and amax exchange) for what is not split."""
    return {"fc1": tilemm.parallel.ColwiseParallel(),
            "fc2": tilemm.parallel.RowwiseParallel(chunks=3, chunk_min_rows=1, copy_min_bytes=1, taper=True,
                                                   one_shot_max_bytes=1 << 20)}


def _graph_replay_equal(run, static_in, new_in, device):
    """Whether ``run()`` captured in a CUDA graph and replayed on ``new_in`` (copied into
    ``static_in``) gives what an eager ``run()`` gives then: True / False, or why it did not capture
    (on any rank). Collective: every rank calls it at the same point."""
    graph, error = None, None
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), torch.no_grad():
            run()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph), torch.no_grad():
            static_out = run()
    except Exception as err:  # noqa: BLE001 (reported by the test as this case's failure)
        error = f"capture raised {type(err).__name__}: {err}"[:300]
    torch.cuda.synchronize()
    if not _all_ranks_ok(error is None, device):
        return error or "another rank's capture failed"
    static_in.copy_(new_in)
    graph.replay()
    with torch.no_grad():
        eager = run()
    torch.cuda.synchronize()
    return bool(torch.equal(static_out, eager))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _all_ranks_ok(ok: bool, device) -> bool:
    """Whether ``ok`` holds on every rank (one MIN all-reduce; every rank calls it at the same point)."""
    flag = torch.tensor([1 if ok else 0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return flag.item() == 1


def _run_case(mlp: MLP, x: torch.Tensor, mesh, device) -> dict:
    from torch.distributed.tensor import DTensor, Replicate
    from torch.distributed.tensor.parallel import parallelize_module

    x = x.to(device)
    full = copy.deepcopy(mlp).to(device)
    with torch.no_grad():
        hidden_full = full.fc1(x)
        out_full = full(x)
        hidden_act = torch.relu(hidden_full)

    # shard_linear on single layers: a DTensor output (gathered), and a replicated DTensor input that
    # the row-wise hook redistributes to its shard.
    fc1 = tilemm.shard_linear(copy.deepcopy(mlp.fc1), mesh, "colwise", use_local_output=False)
    fc2 = tilemm.shard_linear(copy.deepcopy(mlp.fc2), mesh, "rowwise")
    with torch.no_grad():
        hidden_gathered = fc1(x).full_tensor()
        out_rowwise = fc2(DTensor.from_local(hidden_act, mesh, [Replicate()], run_check=False))

    model = parallelize_module(copy.deepcopy(mlp), mesh, tp_plan())
    first_hidden = {}  # fc1's output in the MLP's first call (the hook runs on every later call too)

    def keep_first_hidden(mod, args, out):  # returns None: a hook's return value replaces the output
        first_hidden.setdefault("hidden", out)

    model.fc1.register_forward_hook(keep_first_hidden)
    with torch.no_grad():
        out = model(x)
    # The same MLP with every all-reduce through the ProcessGroup (on NCCL the default calls NCCL
    # directly, ``_DirectNccl``): the same sums, so the same bits.
    pg_plan = {"fc1": tilemm.parallel.ColwiseParallel(), "fc2": tilemm.parallel.RowwiseParallel(direct_nccl=False)}
    with torch.no_grad():
        out_pg = parallelize_module(copy.deepcopy(mlp), mesh, pg_plan)(x)
    # The two-shot all-reduce for every size (symmetric memory; NCCL where it is unavailable).
    two_shot_plan = {"fc1": tilemm.parallel.ColwiseParallel(),
                     "fc2": tilemm.parallel.RowwiseParallel(one_shot_max_bytes=0, two_shot_min_bytes=16)}
    two_shot_model = parallelize_module(copy.deepcopy(mlp), mesh, two_shot_plan)
    with torch.no_grad():
        out_two_shot = two_shot_model(x)
    two_shot = two_shot_model.fc2._tp.two_shot
    two_shot_setup = dict(error=two_shot.error, used=any(v is not None for v in two_shot.buffers.values()))
    direct = tilemm.parallel._DirectNccl._FOR.get(tilemm.parallel._DirectNccl.key(mesh.get_group(), device))
    direct_setup = dict(used=direct is not None and direct.comm is not None,
                        error=None if direct is None else direct.error)

    # The all-reduce overlapped with compute: the row-wise layer in 2 pieces (RowwiseParallel(chunks=2)),
    # and the whole MLP in 2 pieces (overlapped); rows are independent, so each row is summed as in
    # the unsharded MLP. Layers with one activation scale per tensor are not split (chunks) or refused
    # (overlapped).
    chunked_plan = {"fc1": tilemm.parallel.ColwiseParallel(),
                    "fc2": tilemm.parallel.RowwiseParallel(chunks=2, chunk_min_rows=1)}
    chunked = parallelize_module(copy.deepcopy(mlp), mesh, chunked_plan)
    # The symmetric-memory paths (GPU; elsewhere they fall back to the process group's all-reduce):
    # the pieces' sums by the copy engines, and, for layers with one amax per tensor (not split into
    # pieces), the one-shot all-reduce with the amax exchanged through it.
    fast = parallelize_module(copy.deepcopy(mlp), mesh, fast_plan())
    rows = x.reshape(-1, x.shape[-1])
    with torch.no_grad():
        out_chunked = chunked(rows)
        out_fast = fast(rows)
        try:
            out_overlapped = tilemm.parallel.overlapped(model, rows, 2)
        except ValueError as err:
            out_overlapped = str(err)

    # state_dict round trip: a zero model sharded the same way loads this rank's shard.
    fresh = parallelize_module(MLP(empty_like(mlp.fc1), empty_like(mlp.fc2)), mesh, tp_plan())
    state = model.state_dict()
    fresh.load_state_dict(state)
    with torch.no_grad():
        out_fresh = fresh(x)
    fresh_state = fresh.state_dict()
    same_state = state.keys() == fresh_state.keys() and all(
        a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        if a.element_size() == 1 else torch.equal(a, b) for a, b in zip(state.values(), fresh_state.values()))

    # On a GPU: the sharded MLP (both collectives included) captured in a CUDA graph and replayed on a
    # new input gives the eager call's bits.
    graph_equal = graph_overlapped_equal = graph_fast_equal = graph_one_shot = graph_nccl_equal = None
    ce, one_shot = fast.fc2._tp.copy, fast.fc2._tp.one_shot
    fast_setup = dict(copy_error=ce.error, copy_used=any(v is not None for v in ce.states.values()),
                      one_shot_error=one_shot.error,
                      one_shot_used=any(v is not None for v in one_shot.buffers.values()),
                      amax_error=one_shot.amax_error, amax_exchange=one_shot.amax_slots is not None,
                      amax=fast.fc2._tp.amax)
    if device.type == "cuda":
        graph, error = None, None
        try:
            static_x = x.clone()
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side), torch.no_grad():
                model(static_x)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph), torch.no_grad():
                static_out = model(static_x)
        except Exception as err:  # noqa: BLE001 (reported by the test as this case's failure)
            error = f"capture raised {type(err).__name__}: {err}"[:300]
        torch.cuda.synchronize()
        # Replay only if every rank captured: a lone replay would wait for the others' collectives.
        x2 = torch.randn(x.shape, generator=torch.Generator().manual_seed(7)).to(device=device, dtype=x.dtype)
        if _all_ranks_ok(error is None, device):
            static_x.copy_(x2)
            graph.replay()
            # The graph's small all-reduce is the one-shot one (rank order); the eager call sums the
            # same way for the comparison (NCCL's order of more than two ranks may differ).
            default_one_shot = model.fc2._tp.one_shot
            default_one_shot.eager = True
            try:
                with torch.no_grad():
                    eager = model(x2)
            finally:
                default_one_shot.eager = False
            with torch.no_grad():
                eager_nccl = model(x2)  # the default eager call: NCCL's sums and amax MAX
            torch.cuda.synchronize()
            graph_equal = bool(torch.equal(static_out, eager))
            graph_nccl_equal = bool(torch.equal(static_out, eager_nccl))
            graph_one_shot = dict(error=default_one_shot.error,
                                  used=any(v is not None for v in default_one_shot.buffers.values()))
        else:
            graph_equal = error or "another rank's capture failed"
        del graph
        static_rows = rows.clone()
        graph_fast_equal = _graph_replay_equal(lambda: fast(static_rows), static_rows, x2.reshape(rows.shape),
                                               device)
        graph_overlapped_equal = None  # the overlapped MLP (async all-reduces) in a CUDA graph
        if not isinstance(out_overlapped, str):
            graph, error = None, None
            static_rows = rows.clone()
            run = lambda: tilemm.parallel.overlapped(model, static_rows, 2)  # noqa: E731
            try:
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side), torch.no_grad():
                    run()
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph), torch.no_grad():
                    static_out = run()
            except Exception as err:  # noqa: BLE001
                error = f"capture of overlapped() raised {type(err).__name__}: {err}"[:300]
            torch.cuda.synchronize()
            if _all_ranks_ok(error is None, device):
                graph.replay()
                torch.cuda.synchronize()
                graph_overlapped_equal = bool(torch.equal(static_out, out_overlapped))
            else:
                graph_overlapped_equal = error or "another rank's capture failed"
            del graph

    cpu = lambda t: t.detach().cpu()  # noqa: E731
    return dict(out=cpu(out), out_pg=cpu(out_pg), direct_setup=direct_setup, graph_equal=graph_equal,
                out_two_shot=cpu(out_two_shot), two_shot_setup=two_shot_setup,
                graph_one_shot=graph_one_shot, graph_nccl_equal=graph_nccl_equal,
                sharded_class=type(model.fc2).__name__,
                out_chunked=cpu(out_chunked).reshape(out.shape), out_fast=cpu(out_fast).reshape(out.shape),
                graph_fast_equal=graph_fast_equal, fast_setup=fast_setup,
                out_overlapped=(out_overlapped if isinstance(out_overlapped, str)
                                else cpu(out_overlapped).reshape(out.shape)),
                graph_overlapped_equal=graph_overlapped_equal,
                out_full=cpu(out_full), hidden=cpu(first_hidden["hidden"]),
                hidden_full=cpu(hidden_full), hidden_gathered=cpu(hidden_gathered),
                out_rowwise=cpu(out_rowwise), out_fresh=cpu(out_fresh), same_state=bool(same_state),
                shards={name: (m.tp_shard.offset, m.tp_shard.length) for name, m in
                        (("fc1", model.fc1), ("fc2", model.fc2))})


# Seconds after which a worker prints every thread's Python stack to stderr (and again every as many
# seconds after), so that a hang (a collective one rank never joins, a compile that never ends) shows
# where each rank is before an outer time limit kills it. 0: never.
# TILEMM_TP_HANG_DUMP_AT (seconds since the epoch) sets the first dump at that moment instead, so that
# a caller with a time limit for several spawns gets the dump before its limit, whichever spawn hangs.
HANG_DUMP_SECONDS = float(os.environ.get("TILEMM_TP_HANG_DUMP_SECONDS", "240"))


def _hang_dump_seconds() -> float:
    at = os.environ.get("TILEMM_TP_HANG_DUMP_AT")
    return max(float(at) - time.time(), 5.0) if at else HANG_DUMP_SECONDS


def _progress(rank: int, message: str) -> None:
    """A line on the real stderr (pytest does not capture the workers'), rank 0 only."""
    if rank == 0:
        print(f"[tp rank 0] {message}", file=sys.__stderr__, flush=True)


# Seconds a collective may wait for the other ranks before it fails with an error (the process
# group's timeout): a collective that only some ranks call becomes an error, not a hang. It has to
# exceed the longest stretch of one rank's work between two collectives (cold kernel compiles).
COLLECTIVE_TIMEOUT = float(os.environ.get("TILEMM_TP_COLLECTIVE_TIMEOUT", "90"))


def _worker(rank: int, backend: str, port: int, tmp_dir: str, world_size: int) -> None:
    import datetime

    from torch.distributed.device_mesh import init_device_mesh

    # Stacks on the real stderr (fd 2, which the parent's pytest -s leaves alone): every
    # HANG_DUMP_SECONDS, and at once on SIGUSR1 (run_cases sends it when its deadline passes).
    dump_after = _hang_dump_seconds()
    if dump_after > 0:
        faulthandler.dump_traceback_later(dump_after, repeat=True, file=sys.__stderr__)
    faulthandler.register(signal.SIGUSR1, file=sys.__stderr__, all_threads=True)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
            device = torch.device("cuda", rank)
        else:
            device = torch.device("cpu")
        # NCCL: the communicator bound to this rank's GPU now (device_id), not lazily at the first
        # collective on whatever device is current then.
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world_size, timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT),
                                **(dict(device_id=device) if backend == "nccl" else {}))
        mesh = init_device_mesh(device.type, (world_size,))
        cases = torch.load(os.path.join(tmp_dir, "cases.pt"), weights_only=False)
        _progress(rank, f"{backend}, {world_size} ranks: {len(cases)} cases")
        results, t_all = {}, time.time()
        for i, (name, (mlp, x)) in enumerate(cases.items()):
            _progress(rank, f"case {i + 1}/{len(cases)} {name} ...")
            t0 = time.time()
            results[name] = _run_case(mlp, x, mesh, device)
            _progress(rank, f"case {i + 1}/{len(cases)} {name}: done in {time.time() - t0:.1f} s")
        _progress(rank, f"all cases in {time.time() - t_all:.1f} s")
        torch.save(results, os.path.join(tmp_dir, f"rank{rank}.pt"))
    except BaseException:
        # Said at once, on the real stderr and in a file for run_cases; then the process ends without
        # tearing the process group down: destroying an NCCL communicator waits for the other ranks'
        # outstanding collectives and for CUDA graphs that captured it (the traceback keeps them
        # alive), which can be forever. The parent sees the exit and stops the other ranks.
        text = f"[tp rank {rank}] failed:\n{traceback.format_exc()}"
        with open(os.path.join(tmp_dir, f"rank{rank}.err"), "w") as f:
            f.write(text)
        print(text, file=sys.__stderr__, flush=True)
        os._exit(1)
    faulthandler.cancel_dump_traceback_later()  # only now: a hang in the teardown still dumps
    dist.destroy_process_group()


# Seconds run_cases waits for the workers before it dumps their stacks and stops them (0: forever).
SPAWN_DEADLINE = float(os.environ.get("TILEMM_TP_DEADLINE_SECONDS", "0"))


def _deadline_seconds() -> float:
    at = os.environ.get("TILEMM_TP_HANG_DUMP_AT")
    return max(float(at) - time.time(), 5.0) if at else SPAWN_DEADLINE


def run_cases(cases: dict, backend: str, tmp_dir: str, world_size: int = WORLD_SIZE) -> list[dict]:
    """Run every ``name: (mlp, x)`` case on ``world_size`` ranks; returns one ``{name: results}`` per
    rank. A worker that fails ends its process: this raises RuntimeError with every failed rank's
    traceback. Past the deadline (``TILEMM_TP_HANG_DUMP_AT``, else ``TILEMM_TP_DEADLINE_SECONDS``),
    every worker prints its stacks (SIGUSR1), is stopped, and this raises TimeoutError."""
    torch.save(cases, os.path.join(tmp_dir, "cases.pt"))

    def errors() -> str:
        return "\n".join(open(os.path.join(tmp_dir, f)).read() for f in sorted(os.listdir(tmp_dir))
                         if f.endswith(".err"))

    context = mp.spawn(_worker, args=(backend, _free_port(), str(tmp_dir), world_size), nprocs=world_size,
                       join=False)
    deadline = _deadline_seconds()
    end = time.time() + deadline if deadline > 0 else None
    try:
        while not context.join(timeout=1.0):
            if end is not None and time.time() > end:
                for p in context.processes:
                    if p.is_alive():
                        os.kill(p.pid, signal.SIGUSR1)
                time.sleep(3.0)  # the stacks reach stderr
                for p in context.processes:
                    if p.is_alive():
                        p.kill()
                raise TimeoutError(f"tensor-parallel workers ({backend}, {world_size} ranks) still running "
                                   f"after {deadline:.0f} s; their stacks are on stderr above\n{errors()}")
    except (mp.ProcessRaisedException, mp.ProcessExitedException) as err:  # show the tracebacks
        raise RuntimeError("a tensor-parallel worker failed:\n" + errors()) from err
    return [torch.load(os.path.join(tmp_dir, f"rank{r}.pt"), weights_only=False)
            for r in range(world_size)]
