"""Decode with a Llama-3-8B-shaped model sharded over GPUs by ``tilemm.parallel``, against 1 GPU.

    python -m benchmarks tp-decode --nproc-per-node 2                       # sizes 1, 2
    torchrun --nproc-per-node 4 benchmarks/bench_tp_decode.py --sizes 1,2,4 --layers 16 --tokens 64

The model is ``bench_decode.build_model``'s (transformers' ``LlamaForCausalLM``, Llama-3-8B config,
random weights broadcast from rank 0, bf16, SDPA), in each variant (``--variants``: bf16, weight-only
or both sides quantized) on 1 GPU (rank 0; the others wait) and sharded over each of ``--sizes`` GPUs
as Megatron-LM shards a decoder layer: q/k/v column-wise (each rank its heads and its slice of the KV
cache) and o_proj row-wise, the MLP's gate/up column-wise and down row-wise (two all-reduces per
layer), ``lm_head`` split over the vocabulary and its logits all-gathered; tilemm layers through
``parallelize_module``, bf16 ones on plain tensors (``benchmarks/_tp.PlainShard``).

Per variant, size and batch, ``bench_decode.run_batch`` prefills a random prompt into a static KV
cache and decodes ``--tokens`` tokens greedily, eagerly and as one CUDA graph per step (collectives
captured). Measured: tokens/s, and the speed-up over the same variant on 1 GPU and over bf16 at the
same size, batch and execution mode. Accuracy: the first decoded token's logits against the same
variant on 1 GPU, relative to their scale (sharding changes only the order of sums and rounds each
rank's partial sums to bf16), beside bf16 on 1 GPU against the same weights in fp32
(``logits_vs_fp32``); the CUDA-graph decode against the eager one (``bench_decode.graph_vs_eager``).
``+1shot`` variants send the eager row-wise all-reduces through torch's one-shot all-reduce too (CUDA
graphs take it by default).

Writes ``tp-decode-<gpu>-x<N>.json`` and ``.md`` (naming the GPUs) to ``--out-dir``, else ``$OUT``,
else ``benchmarks/results/`` (``benchmarks/_results.py``), rewritten after every run so that an
interrupted one keeps what it measured. ``--cpu-smoke``: ``--tiny``, one layer, batch 1, 2 tokens.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import gc
import json
import os
import shlex
import sys
import time
import traceback

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))

import bench_decode  # noqa: E402
import tilemm  # noqa: E402
from _results import add_options, results_path  # noqa: E402
from _tp import PlainShard, gpu_names, gpus_label, slowest, start  # noqa: E402

VARIANTS = {"bf16": None, "mxfp4-wo": ("mxfp4", True), "nvfp4-wo": ("nvfp4", True),
            "nvfp4": ("nvfp4", False), "mxfp8": ("mxfp8", False)}
ONE_SHOT = "+1shot"  # a variant name's suffix: eager row-wise all-reduces through the one-shot all-reduce too


def base_variant(name: str) -> str:
    return name.removesuffix(ONE_SHOT)


COLWISE = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
ROWWISE = ("self_attn.o_proj", "mlp.down_proj")


def make_mesh(size: int, world: int, device_type: str):
    """(mesh or None, group or None) of ranks 0 .. size - 1; called by every rank (collective)."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    if size == world:
        mesh = init_device_mesh(device_type, (world,))
    else:
        mesh = DeviceMesh(device_type, torch.arange(size))
    member = dist.get_rank() < size
    return (mesh, mesh.get_group()) if member else (None, None)


def shard_model(model, mesh, group, size: int, one_shot: bool = False) -> None:
    """Shard every decoder layer (column then row, see the module docstring) and the lm_head, in place;
    The row-wise layers' small all-reduces take the one-shot all-reduce inside CUDA graphs (the
    library's default, NCCL where it is unavailable); ``one_shot``: in eager calls too."""
    from torch.distributed.tensor.parallel import parallelize_module

    for key in ("num_attention_heads", "num_key_value_heads"):  # before anything is sharded
        if getattr(model.config, key) % size:
            raise ValueError(f"{key}={getattr(model.config, key)} does not split over {size} GPUs")
    for layer in model.model.layers:
        plan = {}
        for name in COLWISE + ROWWISE:
            sub = layer.get_submodule(name)
            style = "colwise" if name in COLWISE else "rowwise"
            if isinstance(sub, tilemm.nn.Linear):
                plan[name] = (tilemm.parallel.ColwiseParallel() if style == "colwise" else
                              tilemm.parallel.RowwiseParallel(one_shot_eager=one_shot))
            else:  # bf16 torch.nn.Linear
                parent, _, child = name.rpartition(".")
                setattr(layer.get_submodule(parent), child,
                        PlainShard(sub, style, group, one_shot_eager=one_shot))
        if plan:
            parallelize_module(layer, mesh, plan)
    model.lm_head = PlainShard(model.lm_head, "colwise", group, gather=True)
    config = model.config  # the KV cache holds this rank's heads only
    config.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    for key in ("num_attention_heads", "num_key_value_heads"):
        setattr(config, key, getattr(config, key) // size)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variants", default="bf16,nvfp4-wo,mxfp4-wo",
                    help=f"comma-separated, of {', '.join(VARIANTS)}; a name + '{ONE_SHOT}' (e.g. "
                    f"nvfp4-wo{ONE_SHOT}) sends the eager row-wise all-reduces through torch's symmetric-memory "
                    "one-shot all-reduce too, as graphs do by default (sharded sizes only; list the base variant first)")
    ap.add_argument("--sizes", default=None, help="comma-separated GPU counts to shard over (default 1 and all)")
    ap.add_argument("--layers", type=int, default=32, help="decoder layers, the first N of 32")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--no-graphs", action="store_true")
    ap.add_argument("--max-seconds", type=float, default=0, help="start no new run after this long (0: no limit)")
    ap.add_argument("--tiny", action="store_true", help="bench_decode's tiny config on the CPU with gloo, eager "
                    "only (a smoke test of the sharding: torchrun --nproc-per-node 2 ... --tiny)")
    add_options(ap)
    args = ap.parse_args(argv)
    if args.cpu_smoke:
        given = {a.split("=")[0] for a in argv}
        args.tiny = True
        for name, value in (("layers", 1), ("batches", "1"), ("prompt", 8), ("tokens", 2),
                            ("variants", "bf16,nvfp4-wo")):
            if "--" + name not in given:
                setattr(args, name, value)
    args.compile = False  # bench_decode.run_batch's torch.compile path is not sharded here
    if args.tiny:
        args.no_graphs = True
    variants = [v for v in args.variants.split(",") if v]
    bad = [v for v in variants if base_variant(v) not in VARIANTS]
    if bad:
        ap.error(f"--variants: unknown {bad}")
    rank, world, device = start(cpu=args.tiny)
    sizes = [int(s) for s in args.sizes.split(",")] if args.sizes else sorted({1, world})
    if any(s < 1 or s > world for s in sizes):
        ap.error(f"--sizes must be in 1 .. {world}, got {sizes}")
    if rank:
        bench_decode.log = lambda msg, t0: None  # one rank prints
    try:
        return run(args, argv, variants, sizes, rank, world, device)
    finally:
        dist.destroy_process_group()


def run(args, argv, variants, sizes, rank, world, device) -> int:
    t0 = time.time()
    names = gpu_names()
    meshes = {s: make_mesh(s, world, device.type) for s in sizes if s > 1}
    batches = [int(b) for b in args.batches.split(",")]
    # The tiny config with 4 KV heads, so that it splits over 4 ranks too.
    shape = dict(bench_decode.TINY, num_key_value_heads=4) if args.tiny else bench_decode.LLAMA3_8B
    meta = dict(gpus=names, gpu=names[0], world_size=world, date=datetime.date.today().isoformat(),
                torch=torch.__version__, transformers=__import__("transformers").__version__,
                command=f"torchrun --nproc-per-node {world} benchmarks/bench_tp_decode.py {shlex.join(argv)}".strip(),
                model=("tiny Llama (CPU smoke test)" if args.tiny else "Llama-3-8B shape, random weights")
                + f", first {args.layers} of {32 if not args.tiny else args.layers} layers", layers=args.layers,
                batches=batches, prompt=args.prompt, tokens=args.tokens, sizes=sizes, skipped=[], failed=[])
    with torch.no_grad():
        base = bench_decode.build_model(shape, args.layers, device)
        for t in list(base.parameters()) + list(base.buffers()):
            dist.broadcast(t.data, 0)
        bench_decode.log(f"{gpus_label(names)}: bf16 model built ({bench_decode._size(bench_decode.model_bytes(base))})", t0)
        records, logits_1gpu = [], {}
        for variant in variants:
            for size in sizes:
                if size == 1 and variant.endswith(ONE_SHOT):
                    continue  # one GPU has no all-reduce: the base variant's 1-GPU run stands for it
                if args.max_seconds > 0 and slowest(time.time() - t0, device) > args.max_seconds:
                    meta["skipped"].append(f"{variant} x{size}")
                    continue
                member = rank < size
                err = None
                if member:
                    try:
                        records += run_variant(base, variant, size, meshes.get(size), batches, args, device,
                                               t0, logits_1gpu)
                    except Exception as e:  # noqa: BLE001 (record, go on)
                        err = f"{variant} x{size}: {type(e).__name__}: {e}"[:500]
                        traceback.print_exc()
                        bench_decode.sync(device)
                failures = [None] * world
                dist.all_gather_object(failures, err)
                meta["failed"] += sorted({f for f in failures if f})
                gc.collect()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                dist.barrier()
                if rank == 0:
                    add_speedups(records)
                    meta["seconds"] = time.time() - t0
                    write(meta, records, args.out_dir)
    if rank == 0:
        print(markdown(meta, records))
    return 1 if meta["failed"] else 0


def run_variant(base, variant, size, mesh_group, batches, args, device, t0, logits_1gpu) -> list[dict]:
    model = copy.deepcopy(base)
    spec = VARIANTS[base_variant(variant)]
    if spec is not None:
        tilemm.quantize_model(model, spec[0], skip=["lm_head"], weight_only=spec[1])
    if size > 1:
        mesh, group = mesh_group
        shard_model(model, mesh, group, size, one_shot=variant.endswith(ONE_SHOT))
    bench_decode.log(f"{variant} on {size} GPU(s): {bench_decode._size(bench_decode.model_bytes(model))} per GPU", t0)
    out = []
    for batch in batches:
        res = bench_decode.run_batch(model, batch, args, device, t0)
        logits = res["logits"]
        if size == 1:
            logits_1gpu[(base_variant(variant), batch)] = logits
            if variant == "bf16":  # the rounding of bf16 itself, the scale for the sharded differences
                res["vs_fp32"] = logits_vs_fp32(base, batch, args, device, logits)
        ref = logits_1gpu.get((base_variant(variant), batch))
        for ex in bench_decode.EXECS:
            r = res.get(ex)
            if r is None:
                continue
            rec = dict(variant=variant, size=size, batch=batch, exec=ex, prefill_ms=res["prefill_ms"])
            if "error" in r:
                rec["error"] = r["error"]
            else:
                rec["ms_per_token"] = r["seconds"] / args.tokens * 1e3
                rec["tokens_per_s"] = batch * args.tokens / r["seconds"]
                for key in bench_decode.GRAPH_CHECK_KEYS:
                    if key in r:
                        rec[key] = r[key]
            if "vs_fp32" in res:
                rec.update(res["vs_fp32"])
            if ref is not None and size > 1:
                rec.update(logits_vs_1gpu(logits, ref))
                rec["first_token_agreement_vs_1gpu"] = (logits.argmax(-1) == ref.argmax(-1)).float().mean().item()
            out.append(rec)
    del model
    return out


def logits_vs_1gpu(logits: torch.Tensor, ref: torch.Tensor) -> dict:
    """The first decoded token's logits (B, vocab) against the same variant's on 1 GPU, relative to
    their scale: the max abs difference over the max abs logit, and the RMS difference over the RMS
    logit (``rel``). bf16 logits from a model whose sums run in another order (the shards' partial
    sums each rounded to bf16, then added) differ by rounding that grows over the layers; a wrong
    shard or scale gives a relative difference of order 1."""
    ref, diff = ref.double(), (logits.double() - ref.double())
    return {"logits_max_abs_diff_vs_1gpu": diff.abs().max().item(),
            "logits_max_abs_vs_1gpu": ref.abs().max().item(),
            "logits_rel_max_diff_vs_1gpu": (diff.abs().max() / ref.abs().max().clamp_min(1e-30)).item(),
            "logits_rel_rms_diff_vs_1gpu": (diff.norm() / ref.norm().clamp_min(1e-30)).item()}


def logits_vs_fp32(base, batch: int, args, device, logits: torch.Tensor) -> dict:
    """bf16 on 1 GPU against the same weights in fp32 (no TF32), same prompt as ``run_batch``'s: how
    far bf16's own rounding moves the first decoded token's logits over the layers, the yardstick
    for the sharded model's difference from 1 GPU (which comes from rounding in another order)."""
    generator = torch.Generator().manual_seed(bench_decode.SEED + batch)
    prompt = torch.randint(base.config.vocab_size, (batch, args.prompt), generator=generator).to(device)
    try:
        model = copy.deepcopy(base).float()
    except Exception as e:  # noqa: BLE001 (out of memory: the yardstick is left out, the run goes on)
        return {"bf16_vs_fp32_error": f"{type(e).__name__}: {e}"[:200]}
    cache = bench_decode.make_cache(model, batch, args.prompt + args.tokens, device, dtype=torch.float32)
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        ref = bench_decode.prefill(model, cache, prompt)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
        del model, cache
        if device.type == "cuda":
            torch.cuda.empty_cache()
    out = logits_vs_1gpu(logits, ref)
    return {k.replace("_vs_1gpu", "_bf16_vs_fp32"): v for k, v in out.items()}


def add_speedups(records) -> None:
    by = {(r["variant"], r["size"], r["batch"], r["exec"]): r.get("tokens_per_s") for r in records}
    for r in records:
        tps = r.get("tokens_per_s")
        if tps is None:
            continue
        one = by.get((base_variant(r["variant"]), 1, r["batch"], r["exec"]))
        bf16 = by.get(("bf16", r["size"], r["batch"], r["exec"]))
        r["speedup_vs_1gpu"] = tps / one if one else None
        r["speedup_vs_bf16_same_size"] = tps / bf16 if bf16 else None


def _f(v, fmt) -> str:
    return "-" if v is None else format(v, fmt)


def markdown(meta, records) -> str:
    lines = [f"# Tensor-parallel decode on {gpus_label(meta['gpus'])} ({meta['date']})", "", f"`{meta['command']}`", "",
             f"{meta['model']}; greedy decoding of {meta['tokens']} tokens after a {meta['prompt']}-token prompt, "
             f"static KV cache; time per token = decode-loop wall time / tokens. Sharded: attention q/k/v and MLP "
             f"gate/up column-wise, o_proj and down_proj row-wise (tilemm.parallel; bf16 on plain tensors the "
             f"same way), lm_head split over the vocabulary and gathered. torch {meta['torch']}, transformers "
             f"{meta['transformers']}" + (f"; {meta['seconds']:.0f} s in all." if meta.get("seconds") else "."), "",
             "| variant | GPUs | batch | exec | ms/token | tokens/s | vs 1 GPU | vs bf16 same GPUs | "
             "logits vs 1 GPU: rel. RMS diff | max diff / max abs |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        if "error" in r:
            lines.append(f"| {r['variant']} | {r['size']} | {r['batch']} | {r['exec']} | failed: "
                         f"{r['error'][:100].replace('|', '/')} | | | | | |")
            continue
        lines.append(f"| {r['variant']} | {r['size']} | {r['batch']} | {r['exec']} | {r['ms_per_token']:.2f} | "
                     f"{r['tokens_per_s']:.1f} | {_f(r.get('speedup_vs_1gpu'), '.2f')} | "
                     f"{_f(r.get('speedup_vs_bf16_same_size'), '.2f')} | "
                     f"{_f(r.get('logits_rel_rms_diff_vs_1gpu'), '.2%')} | "
                     + (f"{r['logits_max_abs_diff_vs_1gpu']:.3g} / {r['logits_max_abs_vs_1gpu']:.3g}"
                        if "logits_max_abs_vs_1gpu" in r else "-") + " |")
    mismatched = [f"{r['variant']} x{r['size']} batch {r['batch']}" for r in records
                  if r.get("graph_matches_eager") is False]
    flips = [f"{r['variant']} x{r['size']} batch {r['batch']} (step {r['first_differing_step']}, margin "
             f"{r['eager_margin_at_first_difference']:.3g} <= 4 x "
             f"{r.get('logits_max_diff_at_first_difference', r['first_step_logits_max_diff']):.3g})"
             for r in records if r.get("graph_matches_eager") and r.get("first_differing_step") is not None]
    if mismatched:
        lines += ["", "CUDA-graph decoding differs from the eager one at a decisive step (WRONG): "
                  + ", ".join(mismatched)]
    if flips:
        lines += ["", "CUDA graph and eager agree up to a near-tie (top-two margin within the rounding "
                  "difference of their logits), where the token flipped: " + ", ".join(flips)]
    fp32 = [r for r in records if "logits_rel_rms_diff_bf16_vs_fp32" in r and r["exec"] == "eager"]
    if fp32:
        lines += ["", "The rounding of bf16 itself (the yardstick for the column above): bf16 on 1 GPU against the "
                  "same weights in fp32, first decoded token's logits: " + ", ".join(
                      f"batch {r['batch']}: rel. RMS diff {r['logits_rel_rms_diff_bf16_vs_fp32']:.2%}, max diff "
                      f"{r['logits_max_abs_diff_bf16_vs_fp32']:.3g} / {r['logits_max_abs_bf16_vs_fp32']:.3g}"
                      for r in fp32)]
    if meta["skipped"]:
        lines += ["", "Skipped (time limit): " + ", ".join(meta["skipped"])]
    if meta["failed"]:
        lines += ["", "Failures:", ""] + [f"- {f}" for f in meta["failed"]]
    return "\n".join(lines) + "\n"


def write(meta, records, directory=None) -> None:
    path = results_path(directory, "tp-decode", meta["gpu"], "json", gpus=meta["world_size"])
    path.write_text(json.dumps(dict(meta=meta, records=records), indent=1))
    path.with_suffix(".md").write_text(markdown(meta, records))


if __name__ == "__main__":
    raise SystemExit(main())
