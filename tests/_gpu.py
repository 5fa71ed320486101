"""One definition of "a GPU tilemm's kernels can run on", shared by the GPU tests."""

import pytest
import torch


def gpu_skip_reason() -> str | None:
    """None when a CUDA GPU of compute capability >= 9.0 and cuda-tile are present, else why not."""
    if not torch.cuda.is_available():
        return "needs a CUDA GPU (torch.cuda.is_available() is False)"
    cap = torch.cuda.get_device_capability()
    if cap < (9, 0):
        return f"needs compute capability >= 9.0 (Hopper or Blackwell), this GPU is sm_{cap[0]}{cap[1]}"
    try:
        import cuda.tile  # noqa: F401
    except ImportError as err:
        return f"needs cuda-tile ({err})"
    return None


GPU_SKIP_REASON = gpu_skip_reason()

# Mark a test (or a module, as ``pytestmark = requires_gpu``) as a GPU test that skips with the reason.
requires_gpu = [pytest.mark.gpu, pytest.mark.skipif(GPU_SKIP_REASON is not None, reason=GPU_SKIP_REASON or "")]


def capture(fn, x: torch.Tensor):
    """``fn(x)`` captured in a CUDA graph after one warm-up call on a side stream: (graph, the static
    input to write new values into, the static output that each replay refreshes)."""
    static_x = x.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn(static_x)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = fn(static_x)
    return graph, static_x, static_out


def kernels_per_call(fn) -> list[str]:
    """The names of the CUDA kernels one call of ``fn`` launches (after a warm-up call)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type.name == "CUDA"]
