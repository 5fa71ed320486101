"""Where a compiled decode step's GPU time goes: the Llama-3-8B-shaped model of ``bench_decode.py`` (its
first few layers, the full-size ``lm_head``), bf16 against 4-bit weight-only (``quantize_model``), at
the batch sizes given.

    python benchmarks/investigations/decode_step_profile.py [--layers 4] [--format mxfp4] [--batches 1,16]

Per variant and batch: the step under ``torch.compile(mode="reduce-overhead", fullgraph=True)`` as
``bench_decode.py --compile`` runs it, its wall time per step (a loop of replays), and the GPU time of
one step's kernels (torch.profiler) summed by class: the quantized layers' kernels (tilemm's cuTile
kernels), the GEMMs left to cuBLAS (the bf16 model's linears; in both variants ``lm_head``), attention
(SDPA's kernels) and the rest (norms, rotary, the cache update, the argmax: inductor's kernels and
copies). The share of the step that is not a quantized linear bounds what a faster weight-only kernel
can gain end to end (Amdahl): with the linears' GPU time t_lin of the bf16 step and the rest t_rest,
a speed-up s of the linears gives (t_lin + t_rest) / (t_lin / s + t_rest) at most.
"""

from __future__ import annotations

import argparse
import collections
import copy
import pathlib
import sys

import torch

sys.path[:0] = [str(pathlib.Path(__file__).resolve().parents[1]), str(pathlib.Path(__file__).resolve().parents[2])]

import tilemm  # noqa: E402
from bench_decode import LLAMA3_8B, Decoder, build_model, compiled_step, make_cache, prefill  # noqa: E402
from _timing import loop_seconds  # noqa: E402

#: Kernel-name fragments per class, tried in this order (a kernel takes the first class that matches).
CLASSES = (
    ("tilemm", ("_gemv_kernel", "_weight_only_kernel", "_large_kernel", "_partial_sum", "_dequantize_kernel")),
    ("cublas gemm", ("gemm", "nvjet", "xmma", "cutlass", "sm90_")),
    ("attention", ("flash", "fmha", "attention", "efficient", "sdpa")),
)


def classify(name: str) -> str:
    low = name.lower()
    for label, keys in CLASSES:
        if any(k.lower() in low for k in keys):
            return label
    return "rest"


def profile_step(step, device: torch.device) -> tuple[dict, list]:
    """GPU microseconds per class of one step's kernels, and the 12 kernels that took the most."""
    torch.cuda.synchronize(device)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize(device)
    per_class, per_kernel = collections.Counter(), collections.Counter()
    for ev in prof.events():
        if ev.device_type != torch.autograd.DeviceType.CUDA:
            continue
        us = ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total
        per_class[classify(ev.name)] += us
        per_kernel[ev.name[:90]] += us
    return dict(per_class), per_kernel.most_common(12)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="decode_step_profile.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--format", default="mxfp4")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--steps", type=int, default=32, help="replays timed per variant and batch")
    args = ap.parse_args(argv)
    device = torch.device("cuda")
    print(f"# {torch.cuda.get_device_name(device)}; {args.layers} layers of Llama-3-8B + full lm_head, "
          f"prompt {args.prompt}; compiled step (reduce-overhead); GPU us per step by class", flush=True)
    base = build_model(LLAMA3_8B, args.layers, device)
    variants = [("bf16", base)]
    quantized = tilemm.quantize_model(copy.deepcopy(base), args.format, weight_only=True, skip=("lm_head",))
    variants.append((f"{args.format}-weight-only", quantized))
    for batch in map(int, args.batches.split(",")):
        totals = {}
        for label, model in variants:
            prompt = torch.randint(model.config.vocab_size, (batch, args.prompt),
                                   generator=torch.Generator().manual_seed(batch)).to(device)
            cache = make_cache(model, batch, args.prompt + args.steps + 8, device)
            logits = prefill(model, cache, prompt)
            dec = Decoder(model, cache, logits.argmax(-1), args.prompt, args.steps + 8)
            step = compiled_step(dec)
            for _ in range(3):  # compile, warm up, record
                step()
            dec.reset()
            seconds = loop_seconds(step, args.steps, device)
            dec.reset()
            classes, top = profile_step(step, device)
            total = sum(classes.values())
            totals[label] = classes
            print(f"{label} batch {batch}: {seconds / args.steps * 1e3:.3f} ms/step wall, {total:.0f} us GPU: "
                  + ", ".join(f"{k} {v:.0f}" for k, v in sorted(classes.items(), key=lambda kv: -kv[1])), flush=True)
            for name, us in top:
                print(f"    {us:8.1f} us  {name}")
            del dec, cache, step
            torch._dynamo.reset()
        bf16, q = totals["bf16"], totals[f"{args.format}-weight-only"]
        lin_bf16 = bf16.get("cublas gemm", 0.0)
        lin_q = q.get("tilemm", 0.0) + q.get("cublas gemm", 0.0)
        rest_bf16 = sum(bf16.values()) - lin_bf16
        print(f"batch {batch}: bf16 linears (lm_head included) {lin_bf16:.0f} us, the rest {rest_bf16:.0f} us; "
              f"{args.format} weight-only linears (lm_head on cuBLAS included) {lin_q:.0f} us; step GPU time ratio "
              f"{sum(bf16.values()) / max(sum(q.values()), 1):.2f}x", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
