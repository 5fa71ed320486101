"""How the benchmarks time GPU work: CUDA-graph replays between CUDA events, median of the runs.

``Timer(reps, device)(fn)`` warms ``fn`` up, captures it in a CUDA graph (the kernels alone, without
Python dispatch; a function that cannot be captured, e.g. one that reads a value back to the host, is
timed as eager calls instead) and returns the median time of ``reps`` replays in milliseconds, with
how it was taken ("graph" or "events"). Before each replay it can

* flush the L2 cache (``flush_l2``, the default: a reduction that reads 256 MB, larger than any GPU's
  L2), so that every run reads its operands from DRAM, as a layer of a model does. The flush reads
  rather than writes: a flush by writes leaves the L2 full of dirty lines, whose write-back then
  competes with the timed kernel's reads, a cost a model's layer does not pay (its predecessors leave
  clean weight lines behind) and that grows with the bytes the kernel reads. On the H100 it added
  about 10 us to a 117 MB bf16 GEMV and 2 us to its 4-bit counterpart
  (``benchmarks/results/timing-flush-nvidia-h100-80gb-hbm3.txt``);
* queue a GPU sleep of ``busy_cycles`` clock cycles, so that the GPU is still busy when the host has
  submitted the replay: the start event then fires right before the kernels, and the interval holds
  no host submission time (about 3.5 us on an H100, which matters for kernels of tens of us).

On the CPU (``device="cpu"``, the benchmarks' ``--cpu-smoke`` runs) ``Timer`` takes the median wall
time of ``reps`` calls instead and says so ("wall"): the same code path, no GPU figure.

What is not a replay of the same kernels is timed on the host, here too, so that every benchmark
times alike: ``issue_us`` (the host cost of issuing a call: back-to-back calls, best of five),
``host_ms`` (one call from an idle GPU, median), ``wall_call`` / ``loop_seconds`` (a call or a loop of
stateful steps, such as decoding tokens, synchronized at both ends).
"""

from __future__ import annotations

import statistics
import time

import torch

__all__ = ["Timer", "host_ms", "issue_us", "loop_seconds", "median_ms", "wall_call"]


def _sync(device=None) -> None:
    """Wait for the GPU (``device``: a torch.device, or None for the current CUDA device); no-op on the CPU."""
    if device is None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    elif torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def _graph_or_eager(fn):
    """``(run, how)``: the replay of a CUDA graph of ``fn``, or ``fn`` itself when it does not capture."""
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        return graph.replay, "graph"
    except Exception:  # not capturable (a host sync, a CPU fallback): time eager calls
        torch.cuda.synchronize()
        return fn, "events"


def median_ms(run, reps: int, *, flush: torch.Tensor | None = None, busy_cycles: int = 0,
              sync_each: bool = False, before_each=None) -> float:
    """Median of ``reps`` calls of ``run``, each between CUDA events, in milliseconds.

    ``flush``: a tensor read (summed) before each call (an L2 flush). ``busy_cycles``: a GPU sleep queued
    before each call. ``sync_each``: wait for each call before the next, so that an eager call's
    interval holds its Python dispatch (what one call costs a caller); otherwise the host queues the
    calls ahead and the intervals are GPU time. ``before_each``: called before each call, outside
    its interval (e.g. a barrier that lines up the ranks of a collective)."""
    events = []
    sink = torch.empty((), dtype=torch.float32, device=flush.device) if flush is not None else None
    for _ in range(reps):
        if before_each is not None:
            before_each()
        if flush is not None:
            torch.sum(flush, dim=(0,), out=sink)
        if busy_cycles:
            torch.cuda._sleep(busy_cycles)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        if sync_each:
            end.synchronize()
        events.append((start, end))
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events)


class Timer:
    """Median time of one call of a function, in milliseconds (see the module docstring)."""

    def __init__(self, reps: int, device: torch.device | None = None, *, flush_l2: bool = True,
                 busy_cycles: int = 0, warmup: int = 1, sync_each: bool = False, before_each=None):
        self.reps, self.busy_cycles, self.warmup, self.sync_each = reps, busy_cycles, warmup, sync_each
        self.before_each = before_each
        self.cpu = device is not None and torch.device(device).type == "cpu"
        self.flush = (torch.zeros(64 * 1024 * 1024, dtype=torch.float32, device=device or "cuda")
                      if flush_l2 and not self.cpu else None)

    def __call__(self, fn, capture: bool = True) -> tuple[float, str]:
        for _ in range(self.warmup):
            fn()
        if self.cpu:  # wall time of each call (no L2 flush, no graph): a smoke run's figure
            times = []
            for _ in range(self.reps):
                if self.before_each is not None:
                    self.before_each()
                times.append(wall_call(fn, "cpu")[1])
            return statistics.median(times) * 1e3, "wall"
        torch.cuda.synchronize()
        run, how = _graph_or_eager(fn) if capture else (fn, "events")
        run()
        torch.cuda.synchronize()
        busy = self.busy_cycles if how == "graph" else 0
        return median_ms(run, self.reps, flush=self.flush, busy_cycles=busy, sync_each=self.sync_each,
                         before_each=self.before_each), how


def wall_call(fn, device=None):
    """``(fn(), seconds)``: one call's wall time, the device synchronized before and after (the call's
    whole cost as its caller waits for it, e.g. a prefill)."""
    _sync(device)
    t0 = time.perf_counter()
    out = fn()
    _sync(device)
    return out, time.perf_counter() - t0


def loop_seconds(fn, calls: int, device=None) -> float:
    """Wall time of ``calls`` calls of ``fn`` back to back, synchronized at both ends, in seconds: for
    steps that change state (a decode step advances its cache), which cannot be replayed alike."""
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    _sync(device)
    return time.perf_counter() - t0


def issue_us(fn, calls: int = 300, reps: int = 5, warmup: int = 20) -> float:
    """Host time to issue one call, in microseconds: ``calls`` calls back to back (fewer than the
    GPU's launch queue holds, so the host never waits for the GPU), best of ``reps``; the GPU catches
    up between repetitions."""
    for _ in range(warmup):
        fn()
    _sync()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, time.perf_counter() - t0)
        _sync()
    return best / calls * 1e6


def host_ms(fn, reps: int, before_each=None) -> float:
    """Median host time of one call (Python and launches, not waited for), in milliseconds; each call
    starts with the GPU idle (and after ``before_each``, e.g. a barrier that lines up the ranks)."""
    times = []
    for _ in range(reps):
        _sync()
        if before_each is not None:
            before_each()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    _sync()
    return statistics.median(times) * 1e3
