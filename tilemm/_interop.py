"""CuPy and NumPy arrays in, the same kind of array out.

tilemm's functions work on torch tensors. ``accepts_cupy`` lets a public function also take CuPy
arrays (zero-copy through DLPack) and return CuPy arrays when any input was one. CuPy has no float8
or e8m0 dtypes, so FP8 data and scales travel as their raw bytes (uint8); pass ``elem_dtype`` where
the function needs to know which FP8 encoding the bytes hold.
"""

from __future__ import annotations

import functools

import torch


def is_cupy(obj) -> bool:
    return type(obj).__module__.startswith("cupy")


def to_torch(obj):
    if is_cupy(obj):
        return torch.from_dlpack(obj)
    return obj


def to_cupy(obj):
    import cupy

    if isinstance(obj, torch.Tensor):
        if obj.dtype.itemsize == 1 and obj.dtype not in (torch.uint8, torch.int8):
            obj = obj.view(torch.uint8)  # float8 / e8m0 bytes: CuPy has no such dtypes
        return cupy.from_dlpack(obj)
    if isinstance(obj, tuple):
        converted = [to_cupy(o) for o in obj]
        return type(obj)(*converted) if hasattr(obj, "_fields") else tuple(converted)
    return obj


def accepts_cupy(fn):
    """Run ``fn`` on torch views of any CuPy arguments; return CuPy if any argument was CuPy."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if not any(is_cupy(a) for a in (*args, *kwargs.values())):
            return fn(*args, **kwargs)
        args = tuple(to_torch(a) for a in args)
        kwargs = {k: to_torch(v) for k, v in kwargs.items()}
        return to_cupy(fn(*args, **kwargs))

    return wrapper
