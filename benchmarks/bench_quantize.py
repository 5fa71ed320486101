"""tilemm's GPU quantizers against a device-to-device copy of the same input, on one GPU in one run.

    python benchmarks/bench_quantize.py               # 64 MiB and 256 MiB bf16 inputs
    python benchmarks/bench_quantize.py --warm-only   # compile every kernel the run needs, time nothing

For each input size (bf16 (M, K), 64 MiB and 256 MiB) it first checks every quantizer's GPU result bit
for bit against the eager PyTorch reference on the same GPU, then times the copy and all quantizers
back to back (``benchmarks/_timing.py``: CUDA-graph replays, each queued behind a GPU sleep of
``GPU_BUSY_CYCLES``, median of ``--reps``), then the eager calls and references (milliseconds each,
so they do not sit between the kernels compared): the quantizer (``tilemm.quantize_*``: the cuTile
kernels, NVFP4's and per-tensor FP8's amax pass included), the eager reference
(``tilemm.quantize._quantize_*_reference``), and a device-to-device copy (``dst.copy_(x)``), the
memory-bound ceiling.

GB/s counts the bytes a quantizer must move once: the input read plus data and scales written (an
amax pass re-reads the input, uncredited); the copy moves the input's bytes twice; ``% copy`` is the
ratio. "kernel only" rows call ``tilemm.kernels.quantize_kernels``' launcher with the scale / amax
known (what the quantizer runs after its amax pass; NVFP4 "given scale" is that kernel behind the public
function's checks, which a CUDA graph does not replay); "amax pass alone" is ``tensor_amax``, a read.
A quantizer with an amax pass (NVFP4 without a global scale, FP8 per tensor, FP8 per row along
axis=-2) moves 2/5 more bytes than credited, so it tops out near 60 % of the copy.

Writes ``quantize-<gpu>.json`` to ``--out-dir``, else ``$OUT``, else ``benchmarks/results/``
(``benchmarks/_results.py``), and prints a markdown table. ``--cpu-smoke``: one 128x128 input on the
CPU, the public quantizers only, wall times.
"""

from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import sys

import torch

import tilemm
from _results import add_options, command, device_name, results_path  # run as a script: benchmarks/ is on sys.path
from _timing import Timer, median_ms
from tilemm import quantize as q
from tilemm.formats import FP8_E4M3, MXFP4, MXFP8_E4M3, MXFP8_E5M2

MIB = 1 << 20
# bf16 (M, K) inputs of 64 MiB and 256 MiB.
SIZES = {"64MiB": (8192, 4096), "256MiB": (16384, 8192)}


def _cases():
    """name -> (GPU quantizer, eager reference); both take the CUDA input x."""
    gs = {}

    def nvfp4_given(x):
        return tilemm.quantize_nvfp4(x, global_scale=gs["nvfp4"], swizzle=True)

    def nvfp4_given_ref(x):
        return q._quantize_nvfp4_reference(x, gs["nvfp4"], True)

    def nvfp4_kernel_only(x):
        from tilemm.kernels import quantize_kernels as qk

        data, scale, decode = qk.quantize_nvfp4(x, gs["nvfp4"], True)
        return data, scale.view(torch.float8_e4m3fn), decode

    def fp8_tensor_kernel_only(x):
        from tilemm.kernels import quantize_kernels as qk

        return qk.quantize_fp8(x, FP8_E4M3, "tensor", False, amax=gs["fp8 amax"])

    def amax_alone(x):  # the per-block maxima, one launch; checked as their maximum (CHECKED_AS)
        from tilemm.kernels import quantize_kernels as qk

        return (qk.tensor_amax(x, propagate_nan=False),)

    def amax_ref(x):
        a = x.float().abs()
        return (torch.where(torch.isnan(a), 0.0, a).amax().reshape(1),)

    cases = {
        "mxfp8 e4m3": (lambda x: tilemm.quantize_mxfp8(x),
                       lambda x: q._quantize_mxfp8_reference(x, MXFP8_E4M3, "rceil", False)),
        "mxfp8 e4m3 swizzled": (lambda x: tilemm.quantize_mxfp8(x, swizzle=True),
                                lambda x: q._quantize_mxfp8_reference(x, MXFP8_E4M3, "rceil", True)),
        "mxfp8 e5m2 floor swizzled": (
            lambda x: tilemm.quantize_mxfp8(x, elem_dtype=torch.float8_e5m2, rounding="floor", swizzle=True),
            lambda x: q._quantize_mxfp8_reference(x, MXFP8_E5M2, "floor", True)),
        "mxfp8 e4m3 swizzled axis=-2": (
            lambda x: tilemm.quantize_mxfp8(x, swizzle=True, axis=-2),
            lambda x: q._quantize_mxfp8_reference(x.mT, MXFP8_E4M3, "rceil", True)),
        "mxfp8 e4m3 axis=-2": (lambda x: tilemm.quantize_mxfp8(x, axis=-2),
                               lambda x: q._quantize_mxfp8_reference(x.mT, MXFP8_E4M3, "rceil", False)),
        "mxfp4 swizzled": (lambda x: tilemm.quantize_mxfp4(x, swizzle=True),
                           lambda x: q._quantize_mxfp4_reference(x, "rceil", True)),
        "mxfp4 swizzled axis=-2": (lambda x: tilemm.quantize_mxfp4(x, swizzle=True, axis=-2),
                                   lambda x: q._quantize_mxfp4_reference(x.mT, "rceil", True)),
        "nvfp4 swizzled (amax pass)": (lambda x: tilemm.quantize_nvfp4(x, swizzle=True),
                                       lambda x: q._quantize_nvfp4_reference(x, None, True)),
        "nvfp4 swizzled (given scale)": (nvfp4_given, nvfp4_given_ref),
        "nvfp4 swizzled (given scale, kernel only)": (nvfp4_kernel_only, nvfp4_given_ref),
        "nvfp4 swizzled axis=-2 (given scale, kernel only)": (
            lambda x: nvfp4_kernel_only(x.mT), lambda x: nvfp4_given_ref(x.mT)),
        "amax pass alone (reads x)": (amax_alone, amax_ref),
        "fp8 tensor (amax pass)": (lambda x: tilemm.quantize_fp8(x),
                                   lambda x: q._quantize_fp8_reference(x, FP8_E4M3, "tensor", False)),
        "fp8 tensor (kernel only, amax given)": (
            fp8_tensor_kernel_only, lambda x: q._quantize_fp8_reference(x, FP8_E4M3, "tensor", False)),
        "fp8 tensor axis=-2 (kernel only, amax given)": (
            lambda x: fp8_tensor_kernel_only(x.mT),
            lambda x: q._quantize_fp8_reference(x.mT, FP8_E4M3, "tensor", False)),
        "fp8 row": (lambda x: tilemm.quantize_fp8(x, granularity="row"),
                    lambda x: q._quantize_fp8_reference(x, FP8_E4M3, "row", False)),
        "fp8 row axis=-2": (lambda x: tilemm.quantize_fp8(x, granularity="row", axis=-2),
                            lambda x: q._quantize_fp8_reference(x.mT, FP8_E4M3, "row", False)),
        "fp8 1x128": (lambda x: tilemm.quantize_fp8(x, granularity=(1, 128)),
                      lambda x: q._quantize_fp8_reference(x, FP8_E4M3, (1, 128), False)),
        "fp8 128x128": (lambda x: tilemm.quantize_fp8(x, granularity=(128, 128)),
                        lambda x: q._quantize_fp8_reference(x, FP8_E4M3, (128, 128), False)),
        "fp8 1x128 axis=-2": (lambda x: tilemm.quantize_fp8(x, granularity=(1, 128), axis=-2),
                              lambda x: q._quantize_fp8_reference(x.mT, FP8_E4M3, (1, 128), False)),
        "fp8 128x128 axis=-2": (lambda x: tilemm.quantize_fp8(x, granularity=(128, 128), axis=-2),
                                lambda x: q._quantize_fp8_reference(x.mT, FP8_E4M3, (128, 128), False)),
    }
    return cases, gs


def _amax_of_partials(got):
    from tilemm.kernels import quantize_kernels as qk

    return (qk.amax_value(got[0]),)


#: Cases whose result is compared with the reference after a reduction that the timed call leaves out.
CHECKED_AS = {"amax pass alone (reads x)": _amax_of_partials}


def _bytes(t) -> int:
    return sum(v.numel() * v.element_size() for v in t)


#: GPU clock cycles of ``torch.cuda._sleep`` queued before each timed graph replay (~0.1 ms): the GPU
#: is still busy when the host has submitted the replay, so the start event fires right before the
#: kernels and the interval is GPU time. Timed from an idle GPU instead, the interval also holds the
#: host's submission (about 3.5 us on the H100, 7 % of a 64 MiB copy), and single runs varied by 3-4
#: points of the copy where they now vary by about 1.
GPU_BUSY_CYCLES = 200_000

#: Where the run times (the CPU for ``--cpu-smoke``).
DEVICE = torch.device("cuda")


def time_ms(fn, reps: int) -> tuple[float, str]:
    """Median time of ``fn`` in ms and how it was taken: CUDA-graph replays when ``fn`` captures (the
    kernels alone, no Python dispatch, each replay queued behind ``GPU_BUSY_CYCLES`` of GPU sleep),
    else eager calls between CUDA events. No L2 flush: the inputs are larger than the L2."""
    return Timer(reps, DEVICE, flush_l2=False, busy_cycles=GPU_BUSY_CYCLES, warmup=3, sync_each=True)(fn)


def _eager_ms(fn, reps: int) -> float:
    """Median of ``reps`` eager calls of fn, each between CUDA events: Python dispatch included, what
    one call costs."""
    if DEVICE.type == "cpu":
        return Timer(reps, DEVICE)(fn)[0]
    return median_ms(fn, reps, sync_each=True)


def _same_bits(a, b) -> bool:
    for x, y in zip(a, b):
        if x.shape != y.shape or x.dtype != y.dtype:
            return False
        xv, yv = x.contiguous(), y.contiguous()
        width = {1: torch.uint8, 4: torch.int32}[x.element_size()]
        if not torch.equal(xv.view(width), yv.view(width)):
            return False
    return True


def _sweep_plan():
    """(quantizer, input orientation, config slot, candidates): a slot is (name, key) of a module-level
    config of quantize_kernels -- a QuantizeConfig, or the entry ``key`` of a dict of them; the current
    config is timed first."""
    from tilemm.kernels.quantize_kernels import QuantizeConfig as T

    logical_t = [T(128, 64), T(64, 128), T(128, 128, 2), T(256, 64, 2)]
    swizzled_t = [T(32, 256), T(64, 128), T(128, 128, 2)]  # whole 4-column scale groups (128 of K) for MX
    return [
        ("mxfp4 swizzled", "", ("BLOCK_CONFIGS", ("mxfp4", True, False)), [T(64, 128), T(32, 128)]),
        ("nvfp4 swizzled (given scale)", "", ("BLOCK_CONFIGS", ("nvfp4", True, False)), [T(64, 128), T(128, 64)]),
        ("mxfp8 e4m3 swizzled", "", ("BLOCK_CONFIGS", ("mxfp8", True, False)), [T(32, 256), T(64, 256, 2)]),
        ("mxfp8 e4m3 swizzled axis=-2", "t", ("BLOCK_CONFIGS", ("mxfp8", True, True)), swizzled_t),
        ("mxfp8 e4m3 axis=-2", "t", ("BLOCK_CONFIGS", ("mxfp8", False, True)), logical_t),
        ("mxfp4 swizzled axis=-2", "t", ("BLOCK_CONFIGS", ("mxfp4", True, True)), swizzled_t),
        ("mxfp4 axis=-2", "t", ("BLOCK_CONFIGS", ("mxfp4", False, True)), logical_t),
        ("nvfp4 swizzled axis=-2", "t", ("BLOCK_CONFIGS", ("nvfp4", True, True)), [T(128, 64), *swizzled_t]),
        ("nvfp4 axis=-2", "t", ("BLOCK_CONFIGS", ("nvfp4", False, True)), logical_t),
        ("fp8 1x128", "", ("FP8_1X128_CONFIG", None), [T(32, 128), T(16, 256), T(64, 128, 3)]),
        ("fp8 128x128", "", ("FP8_BLOCK_CONFIGS", (False, 2)), [T(128, 128, 2), T(128, 128, 4)]),
        ("fp8 128x128 axis=-2", "t", ("FP8_BLOCK_CONFIGS", (True, 2)), [T(128, 128, 2), T(128, 128, 3)]),
        ("fp8 row axis=-2", "t", ("ROW_TRANSPOSED_CONFIG", None), [T(16, 512), T(32, 128)]),
        ("fp8 row axis=-2 (amax pass)", "t", ("ROW_AMAX_CONFIG", None), [T(128, 64), T(32, 256)]),
    ]


def sweep(x: torch.Tensor, reps: int, warm_only: bool) -> list[dict]:
    """Tile shapes and occupancies of the quantizer kernels on one input (kernel launchers called
    directly, so every variant captures in a CUDA graph); each variant is checked bit for bit against
    the current config's output."""
    from tilemm.kernels import quantize_kernels as qk

    gs = torch.tensor(1.0 / 336.0, device=x.device)
    runs = {
        "mxfp4 swizzled": lambda v: qk.quantize_mx(v, MXFP4, "rceil", True),
        "nvfp4 swizzled (given scale)": lambda v: qk.quantize_nvfp4(v, gs, True),
        "mxfp8 e4m3 swizzled": lambda v: qk.quantize_mx(v, MXFP8_E4M3, "rceil", True),
        "mxfp8 e4m3 swizzled axis=-2": lambda v: qk.quantize_mx(v, MXFP8_E4M3, "rceil", True),
        "mxfp8 e4m3 axis=-2": lambda v: qk.quantize_mx(v, MXFP8_E4M3, "rceil", False),
        "mxfp4 swizzled axis=-2": lambda v: qk.quantize_mx(v, MXFP4, "rceil", True),
        "mxfp4 axis=-2": lambda v: qk.quantize_mx(v, MXFP4, "rceil", False),
        "nvfp4 swizzled axis=-2": lambda v: qk.quantize_nvfp4(v, gs, True),
        "nvfp4 axis=-2": lambda v: qk.quantize_nvfp4(v, gs, False),
        "fp8 1x128": lambda v: qk.quantize_fp8(v, FP8_E4M3, (1, 128), False),
        "fp8 128x128": lambda v: qk.quantize_fp8(v, FP8_E4M3, (128, 128), False),
        "fp8 128x128 axis=-2": lambda v: qk.quantize_fp8(v, FP8_E4M3, (128, 128), False),
        "fp8 row axis=-2": lambda v: qk.quantize_fp8(v, FP8_E4M3, "row", False),
        "fp8 row axis=-2 (amax pass)": lambda v: qk.quantize_fp8(v, FP8_E4M3, "row", False),
    }
    dst = torch.empty_like(x)
    time_ms(lambda: dst.copy_(x), reps)  # settle
    copy_before_ms, _ = time_ms(lambda: dst.copy_(x), reps)
    rows = []
    for name, orient, (attr, key), candidates in _sweep_plan():
        v = x.mT if orient == "t" else x
        holder = getattr(qk, attr)
        current = holder[key] if key is not None else holder

        def use(cfg):
            if key is not None:
                holder[key] = cfg
            else:
                setattr(qk, attr, cfg)

        fn = lambda: runs[name](v)  # noqa: E731
        ref = [t.clone() for t in fn()]
        try:
            for cfg in [current, *[c for c in candidates if c != current]]:
                use(cfg)
                got = fn()
                exact = _same_bits(got, ref)
                moved = x.numel() * x.element_size() + _bytes(got)
                if warm_only:
                    continue
                ms, how = time_ms(fn, reps)
                rows.append({"quantizer": name, "tile": [cfg.tile_r, cfg.tile_k], "occupancy": cfg.occupancy,
                             "bit_exact": exact, "ms": ms, "timing": how, "gb_s": moved / ms / 1e6})
        finally:
            use(current)
    # As in main(): the copy before and after, the faster the ceiling.
    copy_after_ms, _ = time_ms(lambda: dst.copy_(x), reps)
    copy_ms = min(copy_before_ms, copy_after_ms)
    copy_gbs = 2 * x.numel() * x.element_size() / copy_ms / 1e6
    for r in rows:
        r["pct_copy"] = 100 * r["gb_s"] / copy_gbs
    return [{"quantizer": "copy (dst.copy_(x))", "ms": copy_ms, "ms_before_kernels": copy_before_ms,
             "ms_after_kernels": copy_after_ms, "gb_s": copy_gbs, "pct_copy": 100.0}, *rows]


def main(argv=None) -> None:
    global DEVICE
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=20, help="timed runs per measurement (>= 20)")
    parser.add_argument("--ref-reps", type=int, default=20, help="timed runs of the eager reference")
    parser.add_argument("--warm-only", action="store_true", help="compile the kernels and exit")
    parser.add_argument("--out", type=pathlib.Path, default=None,
                        help="JSON path (default: quantize-<gpu>.json in --out-dir)")
    parser.add_argument("--sweep", action="store_true",
                        help="also time other tile shapes and occupancies of the kernels")
    parser.add_argument("--sweep-only", action="store_true", help="only the sweep")
    parser.add_argument("--sweep-size", choices=sorted(SIZES), default="256MiB",
                        help="the sweep's input size")
    add_options(parser)
    args = parser.parse_args(argv)
    sizes = SIZES
    if args.cpu_smoke:
        DEVICE, sizes, args.reps, args.ref_reps = torch.device("cpu"), {"128x128": (128, 128)}, 2, 2
        if args.sweep or args.sweep_only:
            parser.error("--sweep times kernel variants: it needs a GPU")
    elif not torch.cuda.is_available():
        raise SystemExit("bench_quantize.py needs a CUDA GPU (--cpu-smoke runs the CPU path)")

    dev = DEVICE
    cases, gs = _cases()
    if dev.type == "cpu":  # the kernel launchers called directly need a GPU
        cases = {name: c for name, c in cases.items() if "kernel only" not in name and "alone" not in name}
    gs["nvfp4"] = torch.tensor(1.0 / 2688.0 * 8.0, device=dev)
    rows = []
    sweep_rows = []
    if args.sweep or args.sweep_only:
        m, k = SIZES[args.sweep_size]
        sweep_rows = sweep(torch.randn(m, k, device=dev, dtype=torch.bfloat16), args.reps, args.warm_only)
    for size_name, (m, k) in ({} if args.sweep_only else sizes).items():
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16) * 4
        gs["fp8 amax"] = x.float().abs().amax().reshape(1)
        in_bytes = x.numel() * x.element_size()
        dst = torch.empty_like(x)
        if args.warm_only:
            for fn, _ in cases.values():
                fn(x)
            if dev.type == "cuda":
                torch.cuda.synchronize()
            continue
        # Bit-exactness first; then the copy and the kernels back to back (the eager references run
        # for milliseconds each and would sit between them); then eager calls and references.
        checked = {}
        for name, (fn, ref_fn) in cases.items():
            got = fn(x)
            as_checked = CHECKED_AS.get(name, lambda t: t)(got)
            checked[name] = (_same_bits(as_checked, ref_fn(x)), in_bytes + _bytes(as_checked))
            del got
        # The copy right after the references measured up to 15 % slow on the H100, so it is timed
        # before and after the kernels and the faster of the two is the ceiling.
        time_ms(lambda: dst.copy_(x), args.reps)  # settle
        copy_before_ms, _ = time_ms(lambda: dst.copy_(x), args.reps)
        timed = {name: time_ms(lambda: fn(x), args.reps) for name, (fn, _) in cases.items()}
        copy_after_ms, _ = time_ms(lambda: dst.copy_(x), args.reps)
        copy_ms = min(copy_before_ms, copy_after_ms)
        copy_gbs = 2 * in_bytes / copy_ms / 1e6
        rows.append({"size": size_name, "shape": [m, k], "quantizer": "copy (dst.copy_(x))",
                     "ms": copy_ms, "ms_before_kernels": copy_before_ms, "ms_after_kernels": copy_after_ms,
                     "bytes": 2 * in_bytes, "gb_s": copy_gbs, "pct_copy": 100.0})
        for name, (fn, ref_fn) in cases.items():
            exact, moved = checked[name]
            ms, how = timed[name]
            eager_ms = _eager_ms(lambda: fn(x), args.reps)
            ref_ms, _ = time_ms(lambda: ref_fn(x), args.ref_reps)
            rows.append({"size": size_name, "shape": [m, k], "quantizer": name, "bit_exact": exact,
                         "ms": ms, "timing": how, "eager_call_ms": eager_ms, "bytes": moved,
                         "gb_s": moved / ms / 1e6,
                         "pct_copy": 100.0 * moved / ms / 1e6 / copy_gbs,
                         "ref_ms": ref_ms, "speedup_vs_ref": ref_ms / ms})
        del x, dst
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    if args.warm_only:
        print("kernels compiled")
        return

    gpu = device_name(dev)
    now = datetime.datetime.now(datetime.timezone.utc)
    result = {
        "date": now.date().isoformat(),
        "recorded": now.isoformat(timespec="seconds"),
        "gpu": gpu, "torch": torch.__version__, "cuda": torch.version.cuda,
        "command": command("bench_quantize.py", argv),
        "input_dtype": "bfloat16", "reps": args.reps,
        "method": "median of CUDA-event timings of CUDA-graph replays, each queued behind "
                  f"torch.cuda._sleep({GPU_BUSY_CYCLES}) so that the interval is GPU time (eager calls "
                  "where a quantizer does not capture) after 3 warm-up calls; per size the copy and every "
                  "quantizer are timed back to back, the copy before and after them (the faster is the ceiling), after "
                  "the bit-exact checks and before the eager calls and references; GB/s = (input read + data and "
                  "scales written) / time; copy GB/s = 2 * input bytes / time; eager_call_ms: one eager "
                  "call between events, Python dispatch included",
        "rows": rows,
        **({"method": "--cpu-smoke: the median wall time of calls on the CPU (tilemm's reference path)"}
           if dev.type == "cpu" else {}),
        "sweep_size": args.sweep_size if sweep_rows else None,
        "sweep": sweep_rows,
    }
    if sweep_rows:
        print(f"\n| sweep ({args.sweep_size}) | tile | occupancy | bit-exact | time (us) | GB/s "
              "| % of copy |")
        print("|---|---|---:|---|---:|---:|---:|")
        for r in sweep_rows:
            if "tile" not in r:
                print(f"| {r['quantizer']} | | | | {r['ms'] * 1e3:.1f} | {r['gb_s']:.0f} | 100 |")
                continue
            print(f"| {r['quantizer']} | {r['tile'][0]}x{r['tile'][1]} | {r['occupancy']} | "
                  f"{'yes' if r['bit_exact'] else 'NO'} | {r['ms'] * 1e3:.1f} | {r['gb_s']:.0f} | "
                  f"{r['pct_copy']:.0f} |")
    if args.sweep_only:
        return
    out = args.out or results_path(args.out_dir, "quantize", gpu, "json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")

    print(f"\n{gpu}, bf16 input, median of {args.reps}\n")
    print("| input | quantizer | bit-exact | time (us) | GB/s | % of copy | one eager call (us) "
          "| eager ref (us) | speedup |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        if "ref_ms" not in r:
            print(f"| {r['size']} | {r['quantizer']} | | {r['ms'] * 1e3:.1f} | {r['gb_s']:.0f} | 100 | | | |")
            continue
        timed = "" if r["timing"] == "graph" else f" ({r['timing']})"
        print(f"| {r['size']} | {r['quantizer']} | {'yes' if r['bit_exact'] else 'NO'} | "
              f"{r['ms'] * 1e3:.1f}{timed} | {r['gb_s']:.0f} | {r['pct_copy']:.0f} | "
              f"{r['eager_call_ms'] * 1e3:.0f} | {r['ref_ms'] * 1e3:.0f} | {r['speedup_vs_ref']:.0f}x |")
    print(f"\nwrote {out}")


if __name__ == "__main__":
    sys.exit(main())
