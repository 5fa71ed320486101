"""Sweep of the large-M weight-only designs (``tilemm.kernels.hopper_weight_only_large``) against cuBLAS bf16,
on one GPU; prints the plan table that the measurements pick.

    python benchmarks/tune_weight_only_large.py                      # mxfp4, mxfp8; M = 64 ... 4096
    python benchmarks/tune_weight_only_large.py --formats nvfp4 --ms 256,1024 --json out.json

For each format, (N, K) in 14336x4096, 4096x14336, 8192x8192 (the README's shapes), 1024x4096 (GQA
k / v) and 6144x4096 (fused qkv), and each M, with bf16 x and bf16 output, it first checks every
candidate against an fp32 product of x and the exactly dequantized weight (a candidate that fails is
reported and left out of the plan), then times CUDA-graph replays (L2 flushed before each, median of
``--reps``; ``benchmarks/_timing.py``) of:

* ``bf16``: cuBLAS ``F.linear(x, w_bf16)``, the baseline of every ratio (timed before and after the
  others; the faster time counts);
* ``small``: the small-M fused kernel as ``weight_only_kernels.plan`` configures it;
* ``old2pass``: the weight decoded to bf16, cuBLAS with an fp32 output, then a cast (the large-M path
  before ``hopper_weight_only_large``);
* ``decode_cN``: ``hopper_weight_only_large.decode_gemm``, N weight rows decoded per GEMM (0: all at once),
  cuBLAS writing bf16 itself;
* ``fused_...``: ``hopper_weight_only_large._large_kernel`` per config of ``hopper_weight_only_large.CANDIDATES``;
* ``plan``: ``tilemm.nn.Linear(weight_only=True)``'s runner as the committed plan dispatches it.

Prints one line per (format, shape, M) with every candidate's speed-up over bf16, then per weight
family ("4bit", "8bit") and M the geomean over shapes of each candidate, and last the table
``hopper_weight_only_large.PLAN`` built from the winners (``small`` means the small-M plan: ``None``), ready
to paste. Runtime on an H100: about 4 minutes with the defaults.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from _timing import Timer  # noqa: E402

import tilemm  # noqa: E402
from tilemm.kernels import weight_only_kernels as wo  # noqa: E402
from tilemm.kernels import hopper_weight_only_large as wl  # noqa: E402

NK = [(14336, 4096), (4096, 14336), (8192, 8192), (1024, 4096), (6144, 4096)]
MS = [64, 128, 256, 512, 1024, 2048, 4096]
CHUNKS = (0, 4096, 2048)
TOLERANCE = 1e-2  # relative Frobenius error of a bf16 output against the fp32 oracle


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.float(), ref.float()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def _stream(device):
    """The current stream's raw handle, read at call time (inside a CUDA-graph capture it is the
    capture stream)."""
    return torch._C._cuda_getCurrentRawStream(device.index)


def candidates(packed, x, out, sms):
    """name -> callable writing ``out`` (M, N) bf16, launching on the current stream."""
    dev = x.device
    layout, n, k = packed.layout, packed.out_features, packed.in_features
    m = x.shape[0]
    zero = wo.zero_bias(x.device, n)
    cands = {}
    small = wo.Prepared(packed.words, packed.scale_t, packed.constants, zero, layout, wo.plan(m, n, k, layout, sms),
                        m, x.dtype)
    cands["small"] = lambda: small.run(x, out, _stream(dev))

    def old2pass():
        w16 = wo.dequantize(packed.words, packed.scale_t, packed.constants, layout, k)
        out.copy_(torch.addmm(zero, x, w16.t(), out_dtype=torch.float32, alpha=packed.alpha_host))

    cands["old2pass"] = old2pass
    for chunk in CHUNKS:  # a chunk of N rows or more is the whole weight at once
        cands[f"decode_c{chunk}"] = (lambda c: lambda: wl.decode_gemm(
            x, packed.words, packed.scale_t, packed.constants, packed.alpha_host, out, layout, k, c,
            _stream(dev)))(chunk)
    for cfg in wl.CANDIDATES:
        cands[cfg.name] = (lambda c: lambda: wl.launch(x, packed.words, packed.scale_t, packed.constants, zero,
                                                       out, layout, c, sms, _stream(dev)))(cfg)
    return cands


def config_of(name: str):
    """The plan-table entry of a candidate name (None: the small-M plan), or False (not a plan option)."""
    if name == "small":
        return None
    if name.startswith("decode_c"):
        return wl.LargeConfig("decode", chunk=int(name[len("decode_c"):]))
    for cfg in wl.CANDIDATES:
        if cfg.name == name:
            return cfg
    return False


def plan_text(best: dict) -> str:
    """``PLAN = {...}`` from {family: {m: name}}, merging consecutive Ms with the same winner."""
    lines = ["PLAN = {"]
    for fam, per_m in best.items():
        lines.append(f'    "{fam}": (')
        last = object()
        for m in sorted(per_m):
            cfg = config_of(per_m[m])
            if cfg is False or cfg == last:
                continue
            lines.append(f"        ({m}, {cfg!r}),")
            last = cfg
        lines.append("    ),")
    lines.append("}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="tune_weight_only_large.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--formats", default="mxfp4,mxfp8")
    ap.add_argument("--ms", default=",".join(map(str, MS)))
    ap.add_argument("--shapes", default=None, help="NxK,NxK,... (default: the five above)")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--json", default=None, help="also write every measurement to this file")
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    torch.manual_seed(0)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    timer = Timer(args.reps, dev)
    shapes = [tuple(map(int, s.split("x"))) for s in args.shapes.split(",")] if args.shapes else NK
    ms = [int(v) for v in args.ms.split(",")]
    print(f"# {torch.cuda.get_device_name(dev)}, {sms} SMs, torch {torch.__version__}", flush=True)
    rows, failed = [], set()
    started = time.time()
    for fmt in args.formats.split(","):
        for n, k in shapes:
            lin = torch.nn.Linear(k, n, bias=False, device=dev, dtype=torch.bfloat16)
            layer = tilemm.nn.Linear.from_float(lin, fmt, weight_only=True)
            packed = layer.packed_weight()
            w = lin.weight.detach()
            w_deq = tilemm.unpack(packed).dequantize().float()
            fam = wl.family(packed.layout)
            for m in ms:
                x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
                ref = x.float() @ w_deq.T
                out = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
                cands = candidates(packed, x, out, sms)
                cands["plan"] = lambda: layer(x)
                line, times = [], {}
                t_bf16 = timer(lambda: F.linear(x, w))[0]
                for name, fn in cands.items():
                    try:
                        out.fill_(float("nan"))
                        res = fn()
                        got = res if name == "plan" else out
                        torch.cuda.synchronize()
                        err = rel_err(got, ref)
                        if not err < TOLERANCE:
                            raise AssertionError(f"relative error {err:.2e}")
                    except Exception as e:  # a failing candidate is reported, never timed or planned
                        failed.add(name)
                        line.append(f"{name}: FAILED ({type(e).__name__}: {str(e)[:80]})")
                        continue
                    times[name] = timer(fn)[0]
                t_bf16 = min(t_bf16, timer(lambda: F.linear(x, w))[0])
                for name, t in times.items():
                    rows.append({"fmt": fmt, "family": fam, "n": n, "k": k, "m": m, "cand": name,
                                 "us": t * 1e3, "bf16_us": t_bf16 * 1e3, "vs_bf16": t_bf16 / t})
                    line.append(f"{name} {t_bf16 / t:.2f}")
                print(f"{fmt} {n}x{k} M={m} bf16 {t_bf16 * 1e3:.1f}us | " + " | ".join(line), flush=True)
    print(f"# sweep took {time.time() - started:.0f} s; failed candidates: {sorted(failed) or 'none'}")

    # Geomean over shapes (and formats of one family) per (family, M, candidate).
    best: dict = {}
    print("\n# geomean speed-up over cuBLAS bf16, per weight family and M (all shapes)")
    for fam in ("4bit", "8bit"):
        for m in ms:
            sel = [r for r in rows if r["family"] == fam and r["m"] == m]
            if not sel:
                continue
            names = sorted({r["cand"] for r in sel}, key=lambda c: list(dict.fromkeys(r["cand"] for r in sel)).index(c))
            cells = []
            geo = {}
            for name in names:
                vals = [r["vs_bf16"] for r in sel if r["cand"] == name]
                if len(vals) != len({(r["fmt"], r["n"], r["k"]) for r in sel}):
                    continue  # not measured on every shape: not comparable
                geo[name] = math.exp(sum(map(math.log, vals)) / len(vals))
                cells.append(f"{name} {geo[name]:.2f}")
            options = {c: g for c, g in geo.items() if config_of(c) is not False and c not in failed}
            if options:
                best.setdefault(fam, {})[m] = max(options, key=options.get)
            print(f"{fam} M={m}: " + " | ".join(cells) + f"  => {best.get(fam, {}).get(m)}")
    print(f"\n# the plan these measurements pick on {torch.cuda.get_device_name(dev)} "
          f"(tilemm/kernels/hopper_weight_only_large.py):")
    print(plan_text(best))
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps({"rows": rows, "failed": sorted(failed)}, indent=0))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
