"""tilemm's matmuls against their peers, side by side, on one GPU in one run.

    python benchmarks/bench_matmul.py                 # full sweep (< 8 minutes on an H100)
    python benchmarks/bench_matmul.py --quick         # 4096^3 and 8192^3 only

For each shape it first checks correctness (tilemm against the exact reference computed by the peer
path on the same quantized inputs), then times every implementation with CUDA graphs (CUDA events
where capture fails) after warm-up, reporting the median of ``--reps`` (>= 20) replays.

Peers, per format:
* fp8 (tensor and row scales, fast and precise accumulation): ``torch._scaled_mm`` in the same mode.
* mxfp8 / mxfp4 / nvfp4: cuBLAS bf16 (``torch.matmul`` on bf16 copies), Triton ``tl.dot_scaled``
  (MX formats; emulated on Hopper) and eager dequantize + cuBLAS bf16.

Writes ``benchmarks/results/<gpu>.json``, a markdown table (``<gpu>.md``) and a plot (``<gpu>.png``:
TFLOPS against M per format, peers as lines).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import pathlib
import statistics
import sys

import torch

import tilemm

RESULTS = pathlib.Path(__file__).resolve().parent / "results"

SQUARE = [(4096, 4096, 4096), (8192, 8192, 8192)]
LLM_NK = [(4096, 4096), (14336, 4096), (4096, 14336), (8192, 8192), (28672, 8192), (8192, 28672)]
LLM_M = [16, 128, 1024, 8192]


def shapes(quick: bool):
    out = [("square", m, n, k) for m, n, k in SQUARE]
    if not quick:
        out += [("llm", m, n, k) for n, k in LLM_NK for m in LLM_M]
    return out


# ------------------------------------------------------------------------------------------ timing

def time_ms(fn, reps: int) -> float:
    """Median time of ``fn`` in milliseconds: CUDA-graph replays if it captures, else CUDA events."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    try:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        run = graph.replay
    except Exception:  # not capturable: time eager launches
        torch.cuda.synchronize()
        run = fn
    run()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.float(), ref.float()
    return ((out - ref).norm() / ref.norm()).item()


# ------------------------------------------------------------------------------------------ Triton peer

_triton_kernel = None


def _triton_dot_scaled():
    """A plain Triton MX matmul with ``tl.dot_scaled`` (A (M, K), B given as (N, K), e8m0 scales)."""
    global _triton_kernel
    if _triton_kernel is not None:
        return _triton_kernel
    import triton
    import triton.language as tl

    @triton.jit
    def kernel(a_ptr, as_ptr, b_ptr, bs_ptr, c_ptr, M, N, K,
               FMT: tl.constexpr, PACK: tl.constexpr,
               BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        pid = tl.program_id(0)
        grid_n = tl.cdiv(N, BN)
        pm, pn = pid // grid_n, pid % grid_n
        rm = pm * BM + tl.arange(0, BM)
        rn = pn * BN + tl.arange(0, BN)
        rk = tl.arange(0, BK // PACK)
        rs = tl.arange(0, BK // 32)
        kd, ks = K // PACK, K // 32
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, K, BK):
            a = tl.load(a_ptr + rm[:, None] * kd + (k0 // PACK + rk)[None, :], mask=rm[:, None] < M, other=0)
            b = tl.load(b_ptr + rn[None, :] * kd + (k0 // PACK + rk)[:, None], mask=rn[None, :] < N, other=0)
            sa = tl.load(as_ptr + rm[:, None] * ks + (k0 // 32 + rs)[None, :], mask=rm[:, None] < M, other=0)
            sb = tl.load(bs_ptr + rn[:, None] * ks + (k0 // 32 + rs)[None, :], mask=rn[:, None] < N, other=0)
            acc = tl.dot_scaled(a, sa, FMT, b, sb, FMT, acc)
        c = acc.to(tl.bfloat16)
        tl.store(c_ptr + rm[:, None] * N + rn[None, :], c, mask=(rm[:, None] < M) & (rn[None, :] < N))

    _triton_kernel = kernel
    return kernel


def triton_mx_matmul(a, sa, b_nk, sb, fmt: str, config):
    """a (M, Kd), b_nk (N, Kd) raw bytes/fp8; sa (M, K/32), sb (N, K/32) uint8."""
    import triton

    bm, bn, bk, warps, stages = config
    m, n = a.shape[0], b_nk.shape[0]
    pack = 2 if fmt == "e2m1" else 1
    k = a.shape[1] * pack
    c = torch.empty(m, n, dtype=torch.bfloat16, device=a.device)
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
    _triton_dot_scaled()[grid](a, sa, b_nk, sb, c, m, n, k, FMT=fmt, PACK=pack, BM=bm, BN=bn, BK=bk,
                               num_warps=warps, num_stages=stages)
    return c


TRITON_CONFIGS = [(128, 128, 128, 8, 3), (128, 256, 64, 8, 3), (64, 128, 128, 4, 4)]


# ------------------------------------------------------------------------------------------ cases

def bench_shape(m, n, k, reps, records, log):
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(m * 7 + n * 3 + k)
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16, generator=gen)
    w = torch.randn(n, k, device=dev, dtype=torch.bfloat16, generator=gen) / math.sqrt(k)
    flops = 2.0 * m * n * k

    def record(fmt, impl, ms, err=None, note=""):
        tflops = flops / (ms * 1e-3) / 1e12
        records.append(dict(format=fmt, impl=impl, m=m, n=n, k=k, ms=ms, tflops=tflops,
                            rel_err=err, note=note))
        log(f"  {fmt:<10} {impl:<28} {ms:9.3f} ms {tflops:8.1f} TFLOPS"
            + ("" if err is None else f"  err {err:.1e}"))

    # cuBLAS bf16: the common ceiling
    bf16_ms = time_ms(lambda: torch.matmul(x, w.t()), reps)
    record("bf16", "cublas_bf16", bf16_ms)

    # ---------------- FP8 tensor / row vs torch._scaled_mm
    for gran in ("tensor", "row"):
        xq = tilemm.quantize_fp8(x, granularity=gran)
        wq = tilemm.quantize_fp8(w, granularity=gran)
        sa = xq.scale.reshape(1, 1) if gran == "tensor" else xq.scale
        sb = wq.scale.reshape(1, 1) if gran == "tensor" else wq.scale.reshape(1, n)
        for fast in (False, True):
            mode = "fast" if fast else "precise"
            peer = lambda: torch._scaled_mm(xq.data, wq.data.t(), sa.reshape(()) if gran == "tensor" else sa,
                                            sb.reshape(()) if gran == "tensor" else sb,
                                            out_dtype=torch.bfloat16, use_fast_accum=fast)
            ref = peer()
            kwargs = {"use_fast_accum": True} if fast else {}
            try:
                mine = lambda: tilemm.linear(xq, wq, **kwargs)
                err = rel_err(mine(), ref)
                record(f"fp8_{gran}", f"tilemm_{mode}", time_ms(mine, reps), err)
            except TypeError as e:  # no fast-accumulation switch in this build
                log(f"  fp8_{gran} tilemm_{mode}: skipped ({e})")
            record(f"fp8_{gran}", f"torch_scaled_mm_{mode}", time_ms(peer, reps))

    # ---------------- block-scaled formats
    quantizers = {"mxfp8": tilemm.quantize_mxfp8, "mxfp4": tilemm.quantize_mxfp4,
                  "nvfp4": tilemm.quantize_nvfp4}
    for fmt, quantize in quantizers.items():
        xq, wq = quantize(x, swizzle=True), quantize(w, swizzle=True)
        xl, wl = quantize(x), quantize(w)  # logical scales for the peers
        xd = tilemm.dequantize(xl).to(torch.bfloat16)
        wd = tilemm.dequantize(wl).to(torch.bfloat16)
        ref = torch.matmul(xd, wd.t())
        mine = lambda: tilemm.linear(xq, wq)
        record(fmt, "tilemm", time_ms(mine, reps), rel_err(mine(), ref))
        record(fmt, "cublas_bf16", bf16_ms, note="torch.matmul on the bf16 originals")
        eager = lambda: torch.matmul(tilemm.dequantize(xl).to(torch.bfloat16),
                                     tilemm.dequantize(wl).to(torch.bfloat16).t())
        record(fmt, "eager_dequant_cublas_bf16", time_ms(eager, reps))
        if fmt in ("mxfp8", "mxfp4"):
            tfmt = "e4m3" if fmt == "mxfp8" else "e2m1"
            sa, sb = xl.scale.view(torch.uint8), wl.scale.view(torch.uint8)
            best = None
            for cfg in TRITON_CONFIGS:
                try:
                    fn = lambda: triton_mx_matmul(xl.data, sa, wl.data, sb, tfmt, cfg)
                    err = rel_err(fn(), ref)
                    if err > 1e-2:
                        log(f"  triton {cfg}: wrong result (err {err:.1e}), not timed")
                        continue
                    ms = time_ms(fn, reps)
                    if best is None or ms < best[0]:
                        best = (ms, err, cfg)
                except Exception as e:  # a config that does not compile on this GPU
                    log(f"  triton {cfg}: {type(e).__name__}: {str(e)[:120]}")
            if best:
                record(fmt, "triton_dot_scaled", best[0], best[1], note=f"best of {len(TRITON_CONFIGS)}: {best[2]}")


def geomean(values):
    values = [v for v in values if v > 0]
    return math.exp(sum(map(math.log, values)) / len(values)) if values else float("nan")


def summarize(records):
    """Ratios of tilemm to each peer, per format, at 8192^3 and as a geomean over LLM shapes M >= 1024."""
    by = {}
    for r in records:
        by.setdefault((r["format"], r["m"], r["n"], r["k"]), {})[r["impl"]] = r["tflops"]
    rows = []
    formats = sorted({r["format"] for r in records if r["format"] != "bf16"})
    for fmt in formats:
        impls = {i for (f, *_), d in by.items() if f == fmt for i in d}
        mine = [i for i in impls if i.startswith("tilemm")]
        peers = [i for i in impls if not i.startswith("tilemm")]
        for me in sorted(mine):
            for peer in sorted(peers):
                if fmt.startswith("fp8") and peer.split("_")[-1] != me.split("_")[-1]:
                    continue  # compare like accumulation modes only
                big = by.get((fmt, 8192, 8192, 8192), {})
                r8k = big[me] / big[peer] if me in big and peer in big else float("nan")
                llm = [d[me] / d[peer] for (f, m, n, k), d in by.items()
                       if f == fmt and m >= 1024 and (n, k) in LLM_NK and me in d and peer in d]
                small = [d[me] / d[peer] for (f, m, n, k), d in by.items()
                         if f == fmt and m <= 16 and me in d and peer in d]
                rows.append(dict(format=fmt, tilemm=me, peer=peer, ratio_8192=r8k,
                                 geomean_llm_m_ge_1024=geomean(llm), geomean_m_le_16=geomean(small)))
    return rows


def markdown(records, summary, meta) -> str:
    lines = [f"# tilemm matmul benchmark: {meta['gpu']} ({meta['date']})", "",
             f"`{meta['command']}`; torch {meta['torch']}; median of {meta['reps']} (CUDA graphs).", "",
             "## Ratios (tilemm / peer, > 1 means tilemm is faster)", "",
             "| format | tilemm | peer | 8192^3 | geomean LLM M>=1024 | geomean M<=16 |", "|---|---|---|---|---|---|"]
    for s in summary:
        lines.append(f"| {s['format']} | {s['tilemm']} | {s['peer']} | {s['ratio_8192']:.2f} | "
                     f"{s['geomean_llm_m_ge_1024']:.2f} | {s['geomean_m_le_16']:.2f} |")
    lines += ["", "## All timings", "", "| format | impl | M | N | K | ms | TFLOPS | rel err |",
              "|---|---|---|---|---|---|---|---|"]
    for r in records:
        err = "" if r["rel_err"] is None else f"{r['rel_err']:.1e}"
        lines.append(f"| {r['format']} | {r['impl']} | {r['m']} | {r['n']} | {r['k']} | {r['ms']:.3f} | "
                     f"{r['tflops']:.1f} | {err} |")
    return "\n".join(lines) + "\n"


def plot(records, path, title):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    formats = ["fp8_row", "mxfp8", "mxfp4", "nvfp4"]
    fig, axes = plt.subplots(1, len(formats), figsize=(5 * len(formats), 4), sharey=True)
    for ax, fmt in zip(axes, formats):
        for impl in sorted({r["impl"] for r in records if r["format"] == fmt}):
            pts = {}
            for r in records:
                if r["format"] == fmt and r["impl"] == impl and (r["n"], r["k"]) == (14336, 4096):
                    pts[r["m"]] = r["tflops"]
            if pts:
                ms = sorted(pts)
                style = "-o" if impl.startswith("tilemm") else "--"
                ax.plot(ms, [pts[m] for m in ms], style, label=impl)
        ax.set_xscale("log", base=2)
        ax.set_title(f"{fmt}, N=14336, K=4096")
        ax.set_xlabel("M")
        ax.legend(fontsize=7)
    axes[0].set_ylabel("TFLOPS")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="tilemm matmul benchmark")
    parser.add_argument("--quick", action="store_true", help="only 4096^3 and 8192^3")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_matmul: needs a CUDA GPU; none found")
        return 2
    try:
        from tqdm import tqdm
    except ImportError:  # the progress bar is a nicety
        tqdm = None

    gpu = torch.cuda.get_device_name().replace(" ", "_")
    meta = dict(gpu=torch.cuda.get_device_name(), date=datetime.date.today().isoformat(),
                torch=torch.__version__, reps=args.reps,
                command="python benchmarks/bench_matmul.py" + (" --quick" if args.quick else ""))
    records = []
    todo = shapes(args.quick)
    bar = tqdm(todo, file=sys.stderr) if tqdm else todo
    for kind, m, n, k in bar:
        log = (bar.write if tqdm else print)
        log(f"{kind} M={m} N={n} K={k}")
        bench_shape(m, n, k, args.reps, records, log)
    summary = summarize(records)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{gpu}.json").write_text(json.dumps(dict(meta=meta, summary=summary, records=records), indent=1))
    md = markdown(records, summary, meta)
    (args.out / f"{gpu}.md").write_text(md)
    plot(records, args.out / f"{gpu}.png", f"tilemm vs peers on {meta['gpu']} ({meta['date']})")
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
