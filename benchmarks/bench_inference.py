"""Small-M inference on one GPU: tilemm's weight-only and block-scaled linears against cuBLAS bf16.

    python benchmarks/bench_inference.py            # 6 shapes x M in {1, 2, 4, ..., 256, 1024}
    python benchmarks/bench_inference.py --quick    # 3 shapes x M in {1, 16, 64, 128}
    python benchmarks/bench_inference.py --shapes 4096x2880,512x2880 --ms 1,16   # any shapes and M

For (N, K) in {4096x4096, 14336x4096, 4096x14336, 8192x8192, 28672x8192, 8192x28672} and each M, with
bf16 activations and bf16 outputs, it first checks every tilemm result against an fp32 matmul of x and
the exactly dequantized weight, then times CUDA-graph replays (L2 flushed before each, median) of:

* cuBLAS bf16: ``F.linear(x, w_bf16)``, the baseline of every ratio (timed before and after the
  others at each M; the faster time counts);
* tilemm weight-only per format (``nn.Linear.from_float(..., weight_only=True)``): mxfp4, nvfp4, mxfp8;
* tilemm ``nn.Linear`` with both operands quantized (the activation quantizer included, as a model
  runs it) per format;
* ``torch._weight_int4pack_mm`` (int4, group 32), the 4-bit weight-only kernel PyTorch ships;
* at M >= 512, the weight-only layer as it was before the fused path (dequantize the whole weight on
  every call, round it to bf16, ``F.linear``);
* the HBM bound of each weight format: its bytes (data + scales) at the device-to-device copy
  bandwidth measured in the same run.

``--bias``: every layer with a bf16 bias (cuBLAS: ``F.linear(x, w, b)``, its bias in the epilogue), and
per weight-only format one more row, ``weight_only_<fmt>_b32``: the same layer with the bias as fp32
(not always a bf16 value: the large-M decode design then takes an fp32-output GEMM and a rounding pass).
torch's int4 kernel takes no bias: its row stays without one.

Host time per eager call and kernels per call: ``benchmarks/bench_host.py``.

Writes ``inference-<gpu>.json`` and ``.md`` (speed-up over bf16 per format and M, geomeans, the HBM
fraction), and ``.png`` (speed-up against M per format) to ``--out-dir`` (``benchmarks/_results.py``).
``--cpu-smoke``: one 128x64 shape at M = 1 on the CPU (the reference path; wall times).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import pathlib
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from _results import add_options, device_name, out_dir, results_path  # noqa: E402
from _timing import Timer  # noqa: E402

import tilemm  # noqa: E402
from tilemm.reference import matmul_fp32  # noqa: E402

NK = [(4096, 4096), (14336, 4096), (4096, 14336), (8192, 8192), (28672, 8192), (8192, 28672)]
NK_QUICK = [(14336, 4096), (4096, 14336), (8192, 8192)]
MS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 1024]
MS_QUICK = [1, 16, 64, 128]
FORMATS = ("mxfp4", "nvfp4", "mxfp8")
TOLERANCE = 1e-2  # bf16 output against the fp32 oracle


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.float(), ref.float()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def weight_bytes(fmt: str, n: int, k: int) -> int:
    block = {"mxfp4": 32, "nvfp4": 16, "mxfp8": 32}[fmt]
    per_elem = 1 if fmt == "mxfp8" else 0.5
    return int(n * k * per_elem + n * k // block)


def copy_bandwidth(timer: Timer, device, nbytes: int = 256 * 1024 * 1024) -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write of 2 x ``nbytes``: 512 MiB)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms, _ = timer(lambda: dst.copy_(src))
    return 2 * src.numel() / (ms * 1e-3)


INT4_GROUP = 32


def int4_pack(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w (N, K) quantized to asymmetric int4 with groups of 32 along K, in the layout of
    ``torch._weight_int4pack_mm``: (packed weight, bf16 scales and zeros)."""
    n, k = w.shape
    group = INT4_GROUP
    wg = w.float().reshape(n, k // group, group)
    lo, hi = wg.amin(-1, keepdim=True), wg.amax(-1, keepdim=True)
    scale = ((hi - lo) / 15).clamp_min(1e-6)
    q = ((wg - lo) / scale).round().clamp(0, 15).to(torch.int32).reshape(n, k)
    zero = lo + 8 * scale  # torch's convention: w = (q - 8) * scale + zero
    packed = torch._convert_weight_to_int4pack(((q[:, ::2] << 4) | q[:, 1::2]).to(torch.uint8), 8)
    sz = torch.stack([scale.reshape(n, -1), zero.reshape(n, -1)], dim=-1).transpose(0, 1).contiguous()
    return packed, sz.to(torch.bfloat16)


def int4_peer(w: torch.Tensor):
    """``torch._weight_int4pack_mm`` on w quantized to int4 with group 32, or None if unavailable."""
    try:
        packed, sz = int4_pack(w)
        return lambda x: torch._weight_int4pack_mm(x, packed, INT4_GROUP, sz)
    except Exception as e:  # noqa: BLE001 (report and go on)
        print(f"  int4 peer unavailable: {type(e).__name__}: {e}")
        return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="bench_inference.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="3 shapes, M in {1, 16, 64, 128}")
    ap.add_argument("--reps", type=int, default=20, help="timed replays per measurement (median)")
    ap.add_argument("--formats", default=",".join(FORMATS), help="comma-separated weight formats")
    ap.add_argument("--no-both-sides", action="store_true", help="skip the block-scaled nn.Linear rows")
    ap.add_argument("--ms", default=None, help="comma-separated M values (default: the full or quick list)")
    ap.add_argument("--out", default=None, help="result file stem (default inference-<gpu>)")
    ap.add_argument("--bias", action="store_true", help="layers with a bf16 bias (and fp32-bias weight-only rows)")
    ap.add_argument("--shapes", default=None, help="comma-separated NxK weight shapes (default: the full or quick list)")
    add_options(ap)
    args = ap.parse_args(argv)
    device = torch.device("cpu" if args.cpu_smoke else "cuda")
    gpu = device_name(device)
    timer = Timer(3 if args.cpu_smoke else max(args.reps, 20), device)
    formats = args.formats.split(",")
    bw = copy_bandwidth(timer, device, 1 << 20 if args.cpu_smoke else 256 * 1024 * 1024)
    print(f"{gpu}: copy bandwidth {bw / 1e12:.2f} TB/s")
    records, failures = [], []
    nks, ms = (NK_QUICK, MS_QUICK) if args.quick else (NK, MS)
    if args.cpu_smoke:
        nks, ms = [(128, 64)], [1]
    else:
        if args.ms:
            ms = [int(v) for v in args.ms.split(",")]
        if args.shapes:
            nks = [tuple(map(int, v.split("x"))) for v in args.shapes.split(",")]
    t_start = time.time()
    for n, k in nks:
        torch.manual_seed(0)
        lin = torch.nn.Linear(k, n, bias=args.bias, device=device, dtype=torch.bfloat16)
        w = lin.weight.detach()
        b = None if lin.bias is None else lin.bias.detach()
        layers = {}
        for fmt in formats:
            layers[("weight_only", fmt)] = tilemm.nn.Linear.from_float(lin, fmt, weight_only=True)
            if args.bias:
                layers[("weight_only", f"{fmt}_b32")] = b32 = tilemm.nn.Linear.from_float(lin, fmt, weight_only=True)
                b32.bias = b.float()
            if not args.no_both_sides:
                layers[("both_sides", fmt)] = tilemm.nn.Linear.from_float(lin, fmt)
        int4 = int4_peer(w)
        for m in ms:
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            ms_bf16, _ = timer(lambda: F.linear(x, w, b))
            rec = {"n": n, "k": k, "m": m, "bf16_ms": ms_bf16}
            if int4 is not None:
                rec["int4_ms"], _ = timer(lambda: int4(x))
            for (mode, fmt), layer in layers.items():
                out = layer(x)
                if mode == "weight_only":
                    ref = matmul_fp32(x.float(), layer.dequantize_weight().t())
                else:
                    ref = matmul_fp32(layer._options.quantize_activation(x).dequantize(),
                                      layer.dequantize_weight().t())
                if b is not None:
                    ref = ref + b.float()
                err = rel_err(out, ref)
                if not err < TOLERANCE:
                    failures.append(f"{mode} {fmt} m={m} n={n} k={k}: rel err {err:.3g}")
                t, how = timer(lambda: layer(x))
                rec[f"{mode}_{fmt}_ms"] = t
                rec[f"{mode}_{fmt}_err"] = err
                if mode == "weight_only" and fmt in formats:
                    rec[f"{mode}_{fmt}_hbm_fraction"] = weight_bytes(fmt, n, k) / bw / (t * 1e-3)
            # cuBLAS again, after the others: the first measurement of a shape can run slow (see
            # results/timing-flush-*.txt); the faster of the two is the baseline.
            ms_bf16 = rec["bf16_ms"] = min(ms_bf16, timer(lambda: F.linear(x, w, b))[0])
            if m >= 512:
                for fmt in formats:
                    layer = layers[("weight_only", fmt)]
                    rec[f"dequant_then_bf16_{fmt}_ms"], _ = timer(
                        lambda: F.linear(x, layer.dequantize_weight().to(torch.bfloat16), b))
            records.append(rec)
            line = " ".join(f"{key[:-3]}={ms_bf16 / v:.2f}x" for key, v in rec.items()
                            if key.endswith("_ms") and key != "bf16_ms")
            print(f"N={n:5d} K={k:5d} M={m:3d} bf16 {ms_bf16 * 1e3:7.1f} us | {line}", flush=True)
    summary = summarize(records, formats)
    meta = {"gpu": gpu, "date": datetime.date.today().isoformat(), "torch": torch.__version__,
            "copy_bandwidth_TBps": bw / 1e12, "command": " ".join(["python benchmarks/bench_inference.py", *sys.argv[1:]]), "seconds": time.time() - t_start}
    path = (out_dir(args.out_dir) / f"{args.out}.json" if args.out
            else results_path(args.out_dir, "inference", gpu, "json"))
    path.write_text(json.dumps({"meta": meta, "summary": summary, "records": records, "failures": failures},
                               indent=1))
    path.with_suffix(".md").write_text(markdown(meta, summary, records, formats))
    try:
        plot(summary, path.with_suffix(".png"), gpu, formats)
    except Exception as e:  # noqa: BLE001
        print(f"plot skipped: {e}")
    print(markdown(meta, summary, records, formats))
    if failures:
        print("FAILED:", *failures, sep="\n  ")
        return 1
    return 0


def geomean(values):
    values = [v for v in values if v and v > 0]
    return math.exp(sum(map(math.log, values)) / len(values)) if values else float("nan")


def summarize(records, formats):
    """Geomean over shapes of bf16 time / time, per row and M."""
    out = {}
    keys = sorted({k[:-3] for r in records for k in r if k.endswith("_ms") and k != "bf16_ms"})
    for key in keys:
        out[key] = {}
        for m in sorted({r["m"] for r in records}):
            rs = [r for r in records if r["m"] == m and f"{key}_ms" in r]
            out[key][m] = geomean([r["bf16_ms"] / r[f"{key}_ms"] for r in rs])
    for fmt in formats:
        key = f"weight_only_{fmt}_hbm"
        out[key] = {m: geomean([r.get(f"weight_only_{fmt}_hbm_fraction") for r in records if r["m"] == m])
                    for m in sorted({r["m"] for r in records})}
    return out


def markdown(meta, summary, records, formats) -> str:
    ms = sorted({r["m"] for r in records})
    lines = [f"# Small-M inference on {meta['gpu']} ({meta['date']})", "",
             f"`{meta['command']}`; copy bandwidth {meta['copy_bandwidth_TBps']:.2f} TB/s. Speed-up over "
             f"cuBLAS bf16 (geomean over shapes; > 1 is faster). Rows `*_hbm` are the fraction of the "
             f"HBM bound (weight bytes at copy bandwidth) that the weight-only kernel reaches.", "",
             "| row | " + " | ".join(f"M={m}" for m in ms) + " |", "|---|" + "---|" * len(ms)]
    for key, per_m in summary.items():
        lines.append(f"| {key} | " + " | ".join(f"{per_m.get(m, float('nan')):.2f}" for m in ms) + " |")
    cols = []
    for r in records:
        cols += [k for k in r if k.endswith("_ms") and k != "bf16_ms" and k not in cols]
    lines += ["", "| N | K | M | bf16 us | " + " | ".join(k[:-3] for k in cols) + " |",
              "|---|---|---|---|" + "---|" * len(cols)]
    for r in records:
        lines.append(f"| {r['n']} | {r['k']} | {r['m']} | {r['bf16_ms'] * 1e3:.1f} | " + " | ".join(
            f"{r['bf16_ms'] / r[k]:.2f}x" if k in r else "-" for k in cols) + " |")
    return "\n".join(lines) + "\n"


def plot(summary, path, gpu, formats):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for key, per_m in summary.items():
        if key.endswith("_hbm"):
            continue
        ms = sorted(per_m)
        ax.plot(ms, [per_m[m] for m in ms], marker="o", label=key,
                linestyle="-" if key.startswith("weight_only") else "--")
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("M (tokens)")
    ax.set_ylabel("speed-up over cuBLAS bf16")
    ax.set_title(f"Small-M linear layers, {gpu}")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
