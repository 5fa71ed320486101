"""Which GPU architecture a tensor lives on, and which kernel family serves it. One place for all of it.

``TILEMM_ARCH`` (e.g. ``sm_90``, ``sm_100``, ``sm_120``) overrides the detected compute capability,
for tests and for ahead-of-time compilation.
"""

from __future__ import annotations

import enum
import functools
import os
import re

import torch

__all__ = ["Family", "capability", "family", "family_for_capability", "has_kernels", "gpu_code",
           "is_datacenter_blackwell", "table_for_capability", "UnsupportedGPUError"]


class UnsupportedGPUError(RuntimeError):
    """The tensor's GPU is below sm_90 (or otherwise not served by tilemm's kernels)."""


class Family(enum.Enum):
    """Kernel families: Hopper emulates block scaling exactly; Blackwell uses ``ct.mma_scaled``."""

    HOPPER = "hopper"        # sm_90
    BLACKWELL = "blackwell"  # sm_100 (datacenter), sm_120 (consumer)


def _parse_arch(text: str) -> tuple[int, int]:
    m = re.fullmatch(r"sm_?(\d+)(\d)a?", text.strip().lower())
    if not m:
        raise ValueError(f"TILEMM_ARCH must look like 'sm_90', 'sm_100' or 'sm_120', got {text!r}")
    return int(m.group(1)), int(m.group(2))


@functools.lru_cache(maxsize=None)
def _device_capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def capability(device: torch.device | int | None = None) -> tuple[int, int]:
    """Compute capability (major, minor) of ``device``, honouring ``TILEMM_ARCH``."""
    override = os.environ.get("TILEMM_ARCH")
    if override:
        return _parse_arch(override)
    if isinstance(device, torch.device):
        index = device.index if device.index is not None else torch.cuda.current_device()
    else:
        index = torch.cuda.current_device() if device is None else int(device)
    return _device_capability(index)


def family_for_capability(cap: tuple[int, int]) -> Family:
    major, _ = cap
    if major == 9:
        return Family.HOPPER
    if major in (10, 11, 12):
        return Family.BLACKWELL
    raise UnsupportedGPUError(
        f"tilemm's GPU kernels need compute capability 9.x (Hopper) or 10.x/12.x (Blackwell); this GPU "
        f"is sm_{cap[0]}{cap[1]}. Move the tensors to the CPU to use the reference path."
    )


def family(device: torch.device) -> Family:
    """The kernel family for a CUDA device."""
    return family_for_capability(capability(device))


def has_kernels(device: torch.device) -> bool:
    """Whether tilemm's cuTile kernels serve ``device``: a CUDA device of sm_90 or newer."""
    return device.type == "cuda" and capability(device)[0] >= 9


def gpu_code(cap: tuple[int, int]) -> str:
    """The ``gpu_code`` string cuTile's compiler takes, e.g. ``"sm_100"``."""
    return f"sm_{cap[0]}{cap[1]}"


def is_datacenter_blackwell(cap: tuple[int, int]) -> bool:
    """Whether ``cap`` is compute capability 10.x: tcgen05 with 2-SM MMA and 228 KB of shared memory,
    which the 2-CTA tiles and the CuTe-DSL kernels need (11.x / 12.x have neither)."""
    return cap[0] == 10


def table_for_capability(cap: tuple[int, int]) -> str:
    """The config table of the Blackwell kernels for a Blackwell compute capability: "sm_100" (10.x:
    tcgen05 with 2-SM MMA and 228 KB of shared memory) or "sm_120" (11.x / 12.x: no 2-CTA tile, about
    100 KB)."""
    return "sm_100" if is_datacenter_blackwell(cap) else "sm_120"
