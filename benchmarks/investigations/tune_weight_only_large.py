"""Sweep of the large-M weight-only designs (``tilemm.kernels.hopper_weight_only_large``) against cuBLAS bf16,
on one GPU; prints what the committed plan reaches against the issue's targets and against the best
candidate per shape.

    python benchmarks/investigations/tune_weight_only_large.py                  # mxfp4, nvfp4, mxfp8; M = 1 ... 4096
    python benchmarks/investigations/tune_weight_only_large.py --formats nvfp4 --ms 256,1024 --json out.json

For each format, (N, K) in 14336x4096, 4096x14336, 8192x8192 (the README's shapes), 1024x4096 (GQA
k / v) and 6144x4096 (fused qkv), and each M, with bf16 x and bf16 output, it first checks every
candidate against an fp32 product of x and the exactly dequantized weight (a candidate that fails is
reported and left out), then times CUDA-graph replays (L2 flushed before each, median of ``--reps``;
``benchmarks/_timing.py``) of:

* ``bf16``: cuBLAS ``F.linear(x, w_bf16)``, the baseline of every ratio (timed before and after the
  others; the faster time counts);
* ``small``: the small-M kernels as ``weight_only_kernels.plan`` configures them;
* ``plan``: ``tilemm.nn.Linear(weight_only=True)``'s runner as the committed plan dispatches it;
* from M = 32 on (``LARGE_M``): ``old2pass``, the weight decoded to bf16, cuBLAS with an fp32 output,
  then a cast (the large-M path before ``hopper_weight_only_large``, the reference point), and the
  family's designs of ``hopper_weight_only_large.SWEEP``: fused configs (``fused_...``), the whole
  weight decoded for cuBLAS writing bf16 itself (``decode_c0``) and, from M = 256, the overlapped
  decode + GEMM in chunks of weight rows (``overlap_cN``);
* the fused kernel's structural variants (``hopper_weight_only_large.VARIANTS``, each in its range
  of M, below ``LARGE_M`` too; ``--no-variants`` leaves them out): the K split that fills the GPU (``_sauto``,
  ``with_split``), one-warpgroup blocks (``_w4``), 2-CTA clusters sharing the x tile (``_2cta``).
  A candidate that fails (a wrong result, or a compile over ``COMPILE_TIMEOUT``) is reported once
  and not tried again in the run.

Prints one line per (format, shape, M) with every candidate's speed-up over bf16; per weight family
("4bit", "8bit") and M the geomean over shapes of each candidate; then, per problem and per (family,
M), the rules' pick (``hopper_weight_only_large.plan``) against the fastest candidate of each shape
(``plan_rule_check.py``, which reads the JSON offline); and last the wired plan's geomean per format against
the issue's targets. Runtime on an H100: about 3 minutes with the defaults and ``--no-variants``
(kernels compiled before, e.g. by the GPU tests: each new specialisation compiles once per machine,
0.5-6 s); the variants add about 250 timings and 25 compiles.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

import cuda.tile as ct
import torch
import torch.nn.functional as F

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # benchmarks/: _timing
from _timing import Timer  # noqa: E402

import tilemm  # noqa: E402
from tilemm.kernels import weight_only_kernels as wo  # noqa: E402
from tilemm.kernels import hopper_weight_only_large as wl  # noqa: E402
from plan_rule_check import check, geomean  # noqa: E402

NK = [(14336, 4096), (4096, 14336), (8192, 8192), (1024, 4096), (6144, 4096)]
MS = [1, 16, 64, 128, 256, 512, 1024, 2048, 4096]
LARGE_M = 32
OVERLAP_M = 256
#: The issue's targets (speed-up over cuBLAS bf16, geomean over shapes, H100) per family: (M, target)
#: rows, each for the Ms up to the next row.
TARGETS = {"4bit": ((1, 2.5), (16, 2.2), (64, 1.6), (128, 1.25), (256, 1.0)),
           "8bit": ((1, 1.8), (16, 1.6), (64, 1.3), (128, 1.1), (256, 1.0))}
TOLERANCE = 1e-2  # relative Frobenius error of a bf16 output against the fp32 oracle
COMPILE_TIMEOUT = 120  # seconds per kernel compile (tileiras), so that one slow variant cannot stall the sweep


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.float(), ref.float()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def _stream(device):
    """The current stream's raw handle, read at call time (inside a CUDA-graph capture it is the
    capture stream)."""
    return torch._C._cuda_getCurrentRawStream(device.index)


def target(fam: str, m: int) -> float | None:
    """The issue's target for (family, M), or None for an M below the first row."""
    got = None
    for first, value in TARGETS[fam]:
        if m >= first:
            got = value
    return got


def _run(cfg, packed, x, out, zero, sms):
    layout, k, dev = packed.layout, packed.in_features, x.device
    if cfg.kind == "fused":
        return lambda: wl.launch(x, packed.words, packed.scale_t, packed.constants, zero, out, layout, cfg, sms,
                                 _stream(dev))
    if cfg.kind == "decode":
        return lambda: wl.decode_gemm(x, packed.words, packed.scale_t, packed.constants, packed.alpha_host, out,
                                      layout, k, cfg.chunk, _stream(dev))
    return lambda: wl.overlap_gemm(x, packed.words, packed.scale_t, packed.constants, packed.alpha_host, out,
                                   layout, k, cfg.chunk)


def candidates(packed, x, out, sms, variants=True):
    """name -> callable writing ``out`` (M, N) bf16, launching on the current stream; ``variants``:
    also the fused kernel's structural variants (``hopper_weight_only_large.VARIANTS``)."""
    dev = x.device
    layout, n, k = packed.layout, packed.out_features, packed.in_features
    m = x.shape[0]
    zero = wo.zero_bias(x.device, n)
    cands = {}
    small = wo.Prepared(packed.words, packed.scale_t, packed.constants, zero, layout, wo.plan(m, n, k, layout, sms),
                        m, x.dtype)
    cands["small"] = lambda: small.run(x, out, _stream(dev))
    if m >= LARGE_M:
        def old2pass():
            w16 = wo.dequantize(packed.words, packed.scale_t, packed.constants, layout, k)
            out.copy_(torch.addmm(zero, x, w16.t(), out_dtype=torch.float32, alpha=packed.alpha_host))

        cands["old2pass"] = old2pass
        for cfg in wl.SWEEP[wl.family(layout)]:
            if cfg.kind == "overlap" and m < OVERLAP_M:
                continue
            cands[cfg.name] = _run(cfg, packed, x, out, zero, sms)
    if variants:
        for cfg, split, first, last in wl.VARIANTS[wl.family(layout)]:
            if first <= m <= last:
                run = wl.with_split(cfg, m, n, k, layout, sms) if split else cfg
                cands[cfg.name + ("_sauto" if split else "")] = _run(run, packed, x, out, zero, sms)
    return cands


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="tune_weight_only_large.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--formats", default="mxfp4,nvfp4,mxfp8")
    ap.add_argument("--ms", default=",".join(map(str, MS)))
    ap.add_argument("--shapes", default=None, help="NxK,NxK,... (default: the five above)")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--json", default=None, help="also write every measurement to this file")
    ap.add_argument("--no-variants", action="store_true",
                    help="leave out the fused kernel's structural variants (VARIANTS)")
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

    def save():
        if args.json:
            pathlib.Path(args.json).write_text(json.dumps(
                {"device": torch.cuda.get_device_name(dev), "sms": sms, "rows": rows, "failed": sorted(failed)},
                indent=0))

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
                cands = candidates(packed, x, out, sms, not args.no_variants)
                cands["plan"] = lambda: layer(x)
                line, times = [], {}
                t_bf16 = timer(lambda: F.linear(x, w))[0]
                for name, fn in cands.items():
                    if name in failed:  # failed before (a wrong result, or a compile over the timeout)
                        continue
                    try:
                        out.fill_(float("nan"))
                        # A variant's first call compiles it: a compile that hangs fails the candidate.
                        with ct.compiler_timeout(COMPILE_TIMEOUT):
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
            save()  # after every shape: a run cut short keeps what it measured
    print(f"# sweep took {time.time() - started:.0f} s; failed candidates: {sorted(failed) or 'none'}")

    # Geomean over shapes (and formats of one family) per (family, M, candidate).
    print("\n# geomean speed-up over cuBLAS bf16, per weight family and M (all shapes)")
    for fam in ("4bit", "8bit"):
        for m in ms:
            sel = [r for r in rows if r["family"] == fam and r["m"] == m]
            if not sel:
                continue
            problems = len({(r["fmt"], r["n"], r["k"]) for r in sel})
            cells = []
            for name in dict.fromkeys(r["cand"] for r in sel):
                vals = [r["vs_bf16"] for r in sel if r["cand"] == name]
                if len(vals) == problems:  # measured on every shape: comparable
                    cells.append(f"{name} {geomean(vals):.2f}")
            print(f"{fam} M={m}: " + " | ".join(cells))

    print("\n# the rules' picks (tilemm/kernels/hopper_weight_only_large.py RULES) against the best measured "
          "candidate per shape")
    check([r for r in rows if r["m"] >= LARGE_M], sms)

    print(f"\n# the wired plan (tilemm.nn.Linear(weight_only=True)) on {torch.cuda.get_device_name(dev)}: geomean "
          "over shapes of its speed-up over cuBLAS bf16, against the issue's target")
    for fmt in args.formats.split(","):
        cells = []
        for m in ms:
            sel = [r for r in rows if r["fmt"] == fmt and r["m"] == m and r["cand"] == "plan"]
            if sel:
                g, want = geomean(r["vs_bf16"] for r in sel), target(sel[0]["family"], m)
                cells.append(f"M={m} {g:.2f} (>= {want}: {'met' if g >= want else 'MISSED'})")
        if cells:
            print(f"{fmt}: " + " | ".join(cells))
    save()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
