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
