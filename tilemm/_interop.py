"""NumPy and CuPy arrays in, the same kind of array out.

tilemm's functions work on torch tensors. ``accepts_arrays`` lets a public function also take NumPy
arrays (CPU, zero-copy through ``torch.from_numpy``: the exact reference path) and CuPy arrays (GPU,
zero-copy through DLPack: the kernels), and return arrays of the same kind when any argument was one.

Neither library has float8, e8m0 or bfloat16 dtypes, so:

* FP8 data and e8m0 / e4m3 scales travel as their raw bytes (uint8). Functions that read FP8 bytes
  take ``elem_dtype=`` (``torch.float8_e4m3fn``, the default, or ``torch.float8_e5m2``) to say which
  encoding the bytes hold; e8m0 and NVFP4's e4m3 scales are unambiguous.
* A function with an ``out_dtype`` keyword returns float32 by default when given arrays (its torch
  default is bfloat16); ``numpy.float16`` / ``numpy.float32`` are accepted as ``out_dtype`` too.
"""

from __future__ import annotations

import functools
import inspect
import sys
import warnings

import numpy as np
import torch

__all__ = ["accepts_arrays", "accepts_cupy", "array_kind", "to_torch", "from_torch"]

_NUMPY_OUT_DTYPES = {np.dtype(np.float32): torch.float32, np.dtype(np.float16): torch.float16}


def is_cupy(obj) -> bool:
    cupy = sys.modules.get("cupy")  # an argument can only be a CuPy array if CuPy is loaded
    return cupy is not None and isinstance(obj, cupy.ndarray)


def array_kind(obj) -> str | None:
    """'numpy' or 'cupy' for an array tilemm converts, else None (torch tensors, Python values)."""
    if isinstance(obj, np.ndarray):
        return "numpy"
    if is_cupy(obj):
        return "cupy"
    return None


def to_torch(obj):
    """A torch view of a NumPy / CuPy array (no copy); anything else is returned as it is."""
    kind = array_kind(obj)
    if kind == "cupy":
        return torch.from_dlpack(obj)
    if kind == "numpy":
        with warnings.catch_warnings():
            # A read-only array gives a read-only view; tilemm never writes to its inputs.
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            return torch.from_numpy(obj)
    return obj


def _raw(t: torch.Tensor) -> torch.Tensor:
    """float8 / e8m0 / float4 tensors as their uint8 bytes (the array libraries have no such dtypes)."""
    if t.element_size() == 1 and t.is_floating_point():
        return t.view(torch.uint8)
    return t


def from_torch(obj, kind: str):
    """Tensors (also inside tuples and NamedTuples) as arrays of ``kind`` ('numpy' or 'cupy')."""
    if isinstance(obj, torch.Tensor):
        obj = _raw(obj)
        if obj.dtype == torch.bfloat16:
            raise TypeError(f"a bfloat16 result cannot be returned as a {kind} array ({kind} has no "
                            f"bfloat16); pass out_dtype=torch.float32 or torch.float16")
        if kind == "numpy":
            return obj.detach().cpu().numpy()
        import cupy

        return cupy.from_dlpack(obj.detach())
    if isinstance(obj, tuple):
        converted = [from_torch(o, kind) for o in obj]
        return type(obj)(*converted) if hasattr(obj, "_fields") else tuple(converted)
    return obj


def to_cupy(obj):
    return from_torch(obj, "cupy")


def _out_dtype(fn_name: str, value):
    """``out_dtype`` for array callers: float32 by default, NumPy float dtypes accepted."""
    if isinstance(value, torch.dtype):
        if value == torch.bfloat16:
            raise TypeError(f"{fn_name}: out_dtype=torch.bfloat16 cannot be returned as a NumPy or CuPy "
                            f"array (they have no bfloat16); pass out_dtype=torch.float32 or torch.float16")
        return value
    try:
        return _NUMPY_OUT_DTYPES[np.dtype(value)]
    except (TypeError, KeyError):
        return value  # not a NumPy float dtype: the function's own check names it


def accepts_arrays(fn):
    """Run ``fn`` on torch views of any NumPy / CuPy arguments; return arrays of that kind.

    NumPy and CuPy arguments together are refused (one lives on the CPU, the other on a GPU).
    """
    takes_out_dtype = "out_dtype" in inspect.signature(fn).parameters

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if torch.compiler.is_compiling():  # torch.compile traces torch tensors only
            return fn(*args, **kwargs)
        tensor = torch.Tensor
        for a in args:
            if type(a) is not tensor and array_kind(a) is not None:
                break
        else:
            for a in kwargs.values():
                if type(a) is not tensor and array_kind(a) is not None:
                    break
            else:
                return fn(*args, **kwargs)  # no arrays: the common call, at the cost of a loop
        kinds = {k for k in map(array_kind, (*args, *kwargs.values())) if k is not None}
        if not kinds:
            return fn(*args, **kwargs)
        if len(kinds) > 1:
            raise TypeError(f"{fn.__name__}: got both NumPy and CuPy arrays; NumPy arrays live on the "
                            f"CPU and CuPy arrays on a GPU, so pass one kind")
        (kind,) = kinds
        if takes_out_dtype:
            kwargs["out_dtype"] = _out_dtype(fn.__name__, kwargs.get("out_dtype", torch.float32))
        args = tuple(to_torch(a) for a in args)
        kwargs = {k: to_torch(v) for k, v in kwargs.items()}
        return from_torch(fn(*args, **kwargs), kind)

    return wrapper


#: The earlier, CuPy-only name of :func:`accepts_arrays`.
accepts_cupy = accepts_arrays
