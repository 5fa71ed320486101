"""What a cuTile launch costs on the host, per kind of argument, next to the PyTorch calls around it.

    python benchmarks/investigations/launch_cost.py

Each row is the host time to issue one call (300 calls back to back, best of 5, then one
synchronisation): ``ct.launch`` of empty kernels with 0-9 torch tensors and 9 constants, with the
stream as an int, with objects that carry a ready ``__cuda_array_interface__``, with CuPy arrays; the
PyTorch pieces (DLPack export, ``__cuda_array_interface__``, ``torch.cuda.current_stream()``, the raw
stream handle, ``torch.empty``, ``view``); bf16 ``F.linear`` and ``nn.Linear``; and tilemm's weight-only
layer and its parts at N = K = 1024, M = 1.
"""

import pathlib
import sys

import cuda.tile as ct
import torch
import torch.nn.functional as F

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # benchmarks/: _timing
from _timing import issue_us  # noqa: E402  (300 calls back to back, best of 5)


@ct.kernel
def k1(A):
    pass


@ct.kernel
def k3(A, B, C):
    pass


@ct.kernel
def k6(A, B, C, D, E, F_):
    pass


@ct.kernel
def k9(A, B, C, D, E, F_, G, H, I):
    pass


@ct.kernel
def k9c(A, B, C, D, E, F_, G, H, I, c1: ct.Constant[int], c2: ct.Constant[int], c3: ct.Constant[int],
        c4: ct.Constant[int], c5: ct.Constant[int], c6: ct.Constant[int], c7: ct.Constant[int],
        c8: ct.Constant[int], c9: ct.Constant[int]):
    pass


@ct.kernel
def k0c(c1: ct.Constant[int], c2: ct.Constant[int], c3: ct.Constant[int], c4: ct.Constant[int],
        c5: ct.Constant[int], c6: ct.Constant[int], c7: ct.Constant[int], c8: ct.Constant[int],
        c9: ct.Constant[int]):
    pass


@ct.kernel
def k0():
    pass


class CAI:
    def __init__(self, t):
        self.__cuda_array_interface__ = t.__cuda_array_interface__


def main():
    dev = torch.device("cuda")
    ts = [torch.zeros(64, 64, device=dev) for _ in range(9)]
    s = torch.cuda.current_stream()
    rows = {}
    rows["ct.launch 0 args"] = issue_us(lambda: ct.launch(s, (1,), k0, ()))
    rows["ct.launch 9 consts"] = issue_us(lambda: ct.launch(s, (1,), k0c, (1, 2, 3, 4, 5, 6, 7, 8, 9)))
    rows["ct.launch 1 tensor"] = issue_us(lambda: ct.launch(s, (1,), k1, (ts[0],)))
    rows["ct.launch 3 tensors"] = issue_us(lambda: ct.launch(s, (1,), k3, tuple(ts[:3])))
    rows["ct.launch 6 tensors"] = issue_us(lambda: ct.launch(s, (1,), k6, tuple(ts[:6])))
    rows["ct.launch 9 tensors"] = issue_us(lambda: ct.launch(s, (1,), k9, tuple(ts[:9])))
    args = tuple(ts) + (1, 2, 3, 4, 5, 6, 7, 8, 9)
    rows["ct.launch 9 tensors + 9 consts"] = issue_us(lambda: ct.launch(s, (1,), k9c, args))
    rows["ct.launch 9 same tensor"] = issue_us(lambda: ct.launch(s, (1,), k9, (ts[0],) * 9))
    raw = torch.cuda.current_stream().cuda_stream
    rows["ct.launch 1 tensor, int stream"] = issue_us(lambda: ct.launch(raw, (1,), k1, (ts[0],)))
    cai = [CAI(t) for t in ts]
    rows["ct.launch 9 CAI objects"] = issue_us(lambda: ct.launch(s, (1,), k9, tuple(cai)))
    try:
        import cupy as cp

        cps = [cp.from_dlpack(t) for t in ts]
        rows["ct.launch 9 cupy arrays"] = issue_us(lambda: ct.launch(s, (1,), k9, tuple(cps)))
    except ImportError:
        pass
    t = ts[0]
    rows["torch._C._to_dlpack"] = issue_us(lambda: torch._C._to_dlpack(t))
    rows["t.__cuda_array_interface__"] = issue_us(lambda: t.__cuda_array_interface__)
    rows["torch.cuda.current_stream()"] = issue_us(lambda: torch.cuda.current_stream())
    rows["torch.cuda.current_stream(dev)"] = issue_us(lambda: torch.cuda.current_stream(dev))
    rows["torch._C._cuda_getCurrentRawStream(0)"] = issue_us(lambda: torch._C._cuda_getCurrentRawStream(0))
    rows["torch.empty((1,1024)) bf16"] = issue_us(lambda: torch.empty((1, 1024), dtype=torch.bfloat16, device=dev))
    rows["t.view(1,64,64)"] = issue_us(lambda: t.view(1, 64, 64))
    lin = torch.nn.Linear(1024, 1024, device=dev, dtype=torch.bfloat16)
    x = torch.randn(1, 1024, device=dev, dtype=torch.bfloat16)
    w = lin.weight
    rows["F.linear(x, w)"] = issue_us(lambda: F.linear(x, w))
    rows["nn.Linear module call"] = issue_us(lambda: lin(x))
    import tilemm

    for fmt in ("mxfp4", "nvfp4", "mxfp8"):
        wo = tilemm.nn.Linear.from_float(lin, fmt, weight_only=True)
        wo(x)
        runner = wo._runner
        prepared = runner._prepared[(1, x.dtype)]
        out = torch.empty(1, 1024, device=dev, dtype=x.dtype)
        rows[f"{fmt} prepared.run"] = issue_us(lambda: prepared.run(x, out, s))
        rows[f"{fmt} runner(x)"] = issue_us(lambda: runner(x))
        rows[f"{fmt} nn.Linear"] = issue_us(lambda: wo(x))
        rows[f"{fmt} split"] = prepared.split
    for k, v in rows.items():
        print(f"{k:45s} {v:8.2f}" if isinstance(v, float) else f"{k:45s} {v}")


if __name__ == "__main__":
    main()
