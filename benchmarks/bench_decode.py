"""End-to-end decode: a Llama-3-8B-shaped model quantized by ``tilemm.quantize_model`` against bf16.

    python benchmarks/bench_decode.py                     # 32 layers, batch 1/4/16, 512 + 128 tokens
    python benchmarks/bench_decode.py --layers 16 --tokens 64   # a shorter run (says "first 16 of 32")
    python benchmarks/bench_decode.py --compile           # torch.compile(mode="reduce-overhead") + tinygemm

The model is transformers' ``LlamaForCausalLM`` from a Llama-3-8B config with random weights (nothing
is downloaded), bf16, SDPA attention; each variant is a copy with every ``nn.Linear`` but ``lm_head``
quantized (mxfp4, nvfp4, mxfp8; ``weight_only`` or ``both_sides``), built after the previous one is
freed. Per variant and batch size, one random 512-token prompt is prefilled into a static KV cache,
then tokens are decoded greedily by a hand-written loop, eagerly and as one CUDA graph per step
(forward, argmax and input update; a failed capture is recorded), from the same state after untimed
warm-up steps. Measured: time per token (decode-loop wall time / tokens, prefill excluded), tokens/s
and its speed-up over bf16 at the same batch and execution mode in the same run, the model's bytes,
the variant's peak GPU memory, and the first decoded token's logits against bf16's (max and mean
absolute difference, greedy agreement). ``--compile`` times the step under ``torch.compile(mode=
"reduce-overhead", fullgraph=True)`` instead, as torchao and gpt-fast do, with torch's int4 weight-only
kernel (``torch._weight_int4pack_mm``, groups of 32) as a peer, the prefill as the best of 3, and the
first tokens compared with an eager run (``tokens_match_eager``). Targets: ``TARGETS``. Decode loops
and prefills are wall times synchronized at both ends (``_timing.loop_seconds`` / ``wall_call``).

Writes ``decode[-compiled]-<gpu>.json``, ``.md`` and ``.png`` (the speed-up over bf16 against the batch
size) to ``--out-dir``, else ``$OUT``, else ``benchmarks/results/`` (``benchmarks/_results.py``),
rewritten after every variant so that an interrupted run keeps what it measured.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import gc
import inspect
import json
import math
import pathlib
import shlex
import sys
import time

import torch

import tilemm

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from _results import add_options, out_dir, results_path  # noqa: E402
from _timing import loop_seconds, wall_call  # noqa: E402

FULL_LAYERS = 32
LLAMA3_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                 num_key_value_heads=8)
TINY = dict(vocab_size=1000, hidden_size=256, intermediate_size=512, num_attention_heads=4,
            num_key_value_heads=2)
DEFAULTS = dict(layers=FULL_LAYERS, batches="1,4,16", prompt=512, tokens=128)
COMPILE_DEFAULTS = dict(batches="1,16", tokens=64, formats="mxfp4", modes="weight_only")
TINY_DEFAULTS = dict(layers=2, batches="1", prompt=16, tokens=4)
FORMATS = ("mxfp4", "nvfp4", "mxfp8")
MODES = ("weight_only", "both_sides")
EXECS = ("eager", "graph", "compiled")
SEED = 0
WARMUP_EAGER = 3  # untimed eager steps before the timed loop
WARMUP_GRAPH = 2  # eager steps on a side stream before the capture
WARMUP_REPLAYS = 8  # untimed replays before the timed loop
TARGETS = [  # (execution, batch, minimum speed-up over bf16) for 4-bit weight-only
    ("graph", 1, 2.0),
    ("eager", 1, 1.0),
    ("compiled", 1, 1.7),
    ("compiled", 16, 1.4),
]
PREFILL_REPS = 3  # timed prefills (best counts) after a warm-up one, with --compile


def log(msg: str, t0: float) -> None:
    print(f"[{time.time() - t0:7.1f} s] {msg}", flush=True)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ------------------------------------------------------------------------------------------- model

def build_model(shape: dict, layers: int, device: torch.device):
    """A random-weight ``LlamaForCausalLM`` in bf16 on ``device`` (fixed seed)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(num_hidden_layers=layers, max_position_embeddings=8192, rope_theta=500000.0,
                         rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=None,
                         eos_token_id=None, **shape)
    config._attn_implementation = "sdpa"
    torch.manual_seed(SEED)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # allocate and initialize in bf16 directly
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    for param in model.parameters():  # a no-op unless a submodule ignored the default dtype (buffers
        param.data = param.data.to(torch.bfloat16)  # such as RoPE's float32 inv_freq keep theirs)
    model.eval().requires_grad_(False)
    return model


def model_bytes(model: torch.nn.Module) -> int:
    tensors = {id(t): t for t in list(model.parameters()) + list(model.buffers()) if t is not None}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def make_cache(model, batch: int, max_len: int, device: torch.device, dtype=torch.bfloat16):
    """A ``StaticCache`` for ``batch`` sequences of up to ``max_len`` tokens, whatever the installed
    transformers' constructor takes (recent ones allocate lazily on the first update; older ones take
    the batch size, device and dtype)."""
    from transformers import StaticCache

    params = inspect.signature(StaticCache.__init__).parameters
    kwargs = {"config": model.config, "max_cache_len": max_len}
    for name in ("max_batch_size", "batch_size"):
        if name in params:
            kwargs[name] = batch
    if "device" in params:
        kwargs["device"] = device
    if "dtype" in params:
        kwargs["dtype"] = dtype
    return StaticCache(**kwargs)


def cache_counters(cache) -> list[tuple[object, str, torch.Tensor]]:
    """The cache's integer tensors (per-layer fill counters in recent transformers): an untimed warm-up
    step advances them, so they are saved after the prefill and restored before every decode loop."""
    found = []
    for holder in [cache] + list(getattr(cache, "layers", []) or []):
        for name, value in vars(holder).items():
            if isinstance(value, torch.Tensor) and not value.is_floating_point():
                found.append((holder, name, value.clone()))
    return found


def forward_kwargs(model) -> tuple[bool, str | None]:
    """(forward takes cache_position, the name of its keep-only-the-last-logits argument)."""
    params = inspect.signature(type(model).forward).parameters
    keep = next((n for n in ("logits_to_keep", "num_logits_to_keep") if n in params), None)
    return "cache_position" in params, keep


class Decoder:
    """Greedy decoding from a prefilled static cache, one token per ``step()``.

    The step reads and updates only static tensors (the input ids, the position), so it can be
    captured in a CUDA graph and replayed: forward, argmax, store the token, feed it back, advance.
    """

    def __init__(self, model, cache, first: torch.Tensor, start: int, tokens: int):
        self.model, self.cache, self.start = model, cache, start
        self.with_cache_position, _ = forward_kwargs(model)
        self.first = first.view(-1, 1).clone()
        self.ids = self.first.clone()
        self.pos = torch.full((1,), start, dtype=torch.long, device=first.device)
        self.out = torch.zeros(first.shape[0], tokens, dtype=torch.long, device=first.device)
        self.counters = cache_counters(cache)

    def step(self) -> None:
        kwargs = dict(input_ids=self.ids, position_ids=self.pos.view(1, 1), past_key_values=self.cache,
                      use_cache=True)
        if self.with_cache_position:
            kwargs["cache_position"] = self.pos
        logits = self.model(**kwargs).logits
        self.last = logits  # read by graph_vs_eager (a reference: no work; in a graph, its static output)
        nxt = logits[:, -1].argmax(-1, keepdim=True)
        self.out.index_copy_(1, self.pos - self.start, nxt)
        self.ids.copy_(nxt)
        self.pos.add_(1)

    def reset(self) -> None:
        """Back to the state right after the prefill (positions past it are masked, then rewritten)."""
        self.ids.copy_(self.first)
        self.pos.fill_(self.start)
        self.out.zero_()
        for holder, name, saved in self.counters:
            getattr(holder, name).copy_(saved)


class Int4Linear(torch.nn.Module):
    """A linear layer on torch's int4 weight-only kernel (``torch._weight_int4pack_mm``, int4 with
    groups of 32 along K, bf16 scales and zeros), the peer of ``--compile``."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        from bench_inference import int4_pack

        self.out_features, self.in_features = linear.weight.shape
        packed, sz = int4_pack(linear.weight.detach())
        self.register_buffer("packed", packed)
        self.register_buffer("scales_and_zeros", sz)
        self.bias = None if linear.bias is None else torch.nn.Parameter(linear.bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from bench_inference import INT4_GROUP

        y = torch._weight_int4pack_mm(x.reshape(-1, self.in_features), self.packed, INT4_GROUP,
                                      self.scales_and_zeros)
        y = y.reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias


def quantize_int4(model: torch.nn.Module, skip=("lm_head",)) -> torch.nn.Module:
    """Every ``nn.Linear`` of ``model`` but those named in ``skip`` replaced by ``Int4Linear``, in place."""
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if type(child) is torch.nn.Linear and child_name not in skip:
                setattr(module, child_name, Int4Linear(child))
    return model


def compiled_step(dec: "Decoder"):
    """``dec.step`` with the model's forward and the argmax under ``torch.compile(mode="reduce-overhead",
    fullgraph=True)``; the token bookkeeping (three small in-place ops) stays outside, as in gpt-fast.
    The cache's tensors are marked static, so the CUDA graphs may update them in place."""
    for holder in [dec.cache] + list(getattr(dec.cache, "layers", []) or []):
        for value in vars(holder).values():
            for t in (value if isinstance(value, (list, tuple)) else [value]):
                if isinstance(t, torch.Tensor):
                    torch._dynamo.mark_static_address(t)
    model, cache, with_cache_position = dec.model, dec.cache, dec.with_cache_position

    def one(ids, pos):
        kwargs = dict(input_ids=ids, position_ids=pos.view(1, 1), past_key_values=cache, use_cache=True)
        if with_cache_position:
            kwargs["cache_position"] = pos
        return model(**kwargs).logits[:, -1].argmax(-1, keepdim=True)

    fn = torch.compile(one, mode="reduce-overhead", fullgraph=True, dynamic=False)

    def step() -> None:
        nxt = fn(dec.ids, dec.pos)
        dec.out.index_copy_(1, dec.pos - dec.start, nxt)
        dec.ids.copy_(nxt)
        dec.pos.add_(1)

    return step


def prefill(model, cache, prompt: torch.Tensor) -> torch.Tensor:
    """Runs the prompt through the model; returns the last position's logits (float32, (B, vocab))."""
    with_cache_position, keep = forward_kwargs(model)
    n = prompt.shape[1]
    positions = torch.arange(n, device=prompt.device)
    kwargs = dict(input_ids=prompt, position_ids=positions.view(1, -1), past_key_values=cache,
                  use_cache=True)
    if with_cache_position:
        kwargs["cache_position"] = positions
    if keep:
        kwargs[keep] = 1
    return model(**kwargs).logits[:, -1].float()


def timed_loop(fn, tokens: int, device: torch.device) -> float:
    """Seconds for ``tokens`` decode steps (``_timing.loop_seconds``)."""
    return loop_seconds(fn, tokens, device)


GRAPH_CHECK_KEYS = ("tokens_match_eager", "graph_matches_eager", "first_step_logits_max_diff",
                    "first_step_logits_max_abs", "first_differing_step", "eager_margin_at_first_difference",
                    "logits_max_diff_at_first_difference")


def graph_vs_eager(dec: Decoder, graph, graph_logits: torch.Tensor, graph_tokens: torch.Tensor,
                   eager_tokens: torch.Tensor) -> dict:
    """Whether the CUDA graph decodes what the eager loop decodes, up to near-ties (untimed).

    ``graph_logits`` is the graph's static output (``dec.last`` right after the capture; an eager
    step rebinds ``dec.last`` to a new tensor, so the graph's logits are read from here). The graph
    may run other kernels than the eager calls (another summation order), so its logits differ from
    the eager ones by rounding, and with random weights the top two logits are often nearly tied (bf16
    logits of 4 to 8 are multiples of 2^-5): such a token may flip, and the two sequences diverge from
    there. Equal tokens do not make equal states: each loop's KV cache holds its own rounding, so the
    two trajectories' logits drift apart step by step. So both loops are rerun up to the first step
    where the tokens differ; there the largest difference of their logits (each from its own history)
    is ``noise``, and the flip counts as a near-tie only if the eager top-two margin there is at most
    4x ``noise``. ``first_step_logits_max_diff`` is the same difference at the first step.
    ``graph_matches_eager`` is False for a flip at a decisive step, or for logits that differ by more
    than 5 % of their range."""
    dec.reset()
    dec.step()
    eager0 = dec.last[:, -1].float().clone()
    dec.reset()
    graph.replay()
    graph0 = graph_logits[:, -1].float().clone()
    noise0 = (graph0 - eager0).abs().max().item()
    scale = eager0.abs().max().item()
    out = {"first_step_logits_max_diff": noise0, "first_step_logits_max_abs": scale}
    differs = (graph_tokens != eager_tokens).any(0).nonzero()
    first = int(differs[0]) if differs.numel() else None
    out["first_differing_step"] = first
    ok = noise0 <= 0.05 * max(scale, 1e-30)
    if first is not None:
        dec.reset()
        for _ in range(first + 1):  # the eager trajectory up to the flip
            dec.step()
        eager_logits = dec.last[:, -1].float().clone()
        dec.reset()
        for _ in range(first + 1):  # the graph's own trajectory up to the flip
            graph.replay()
        noise = (graph_logits[:, -1].float() - eager_logits).abs().max().item()
        top2 = eager_logits.topk(2, dim=-1).values
        rows = (graph_tokens[:, first] != eager_tokens[:, first])
        margin = (top2[:, 0] - top2[:, 1])[rows].min().item()
        out["eager_margin_at_first_difference"] = margin
        out["logits_max_diff_at_first_difference"] = noise
        ok = ok and margin <= 4 * noise
    out["graph_matches_eager"] = ok
    return out


def run_batch(model, batch: int, args, device: torch.device, t0: float) -> dict:
    """Prefill, then the eager and CUDA-graph decode loops, for one model and batch size."""
    generator = torch.Generator().manual_seed(SEED + batch)
    prompt = torch.randint(model.config.vocab_size, (batch, args.prompt), generator=generator).to(device)
    cache = make_cache(model, batch, args.prompt + args.tokens, device)
    logits, seconds = wall_call(lambda: prefill(model, cache, prompt), device)
    prefill_ms = seconds * 1e3
    if args.compile:  # the first prefill compiled kernels: time it again, each time into a fresh cache
        times = []
        for _ in range(PREFILL_REPS):
            del cache
            cache = make_cache(model, batch, args.prompt + args.tokens, device)
            logits, seconds = wall_call(lambda: prefill(model, cache, prompt), device)
            times.append(seconds * 1e3)
        prefill_ms = min(times)
    result = {"prefill_ms": prefill_ms, "logits": logits}
    dec = Decoder(model, cache, logits.argmax(-1), args.prompt, args.tokens)
    if args.compile:
        check = min(8, args.tokens)
        for _ in range(check):
            dec.step()
        eager_tokens = dec.out[:, :check].clone()
        dec.reset()
        step = compiled_step(dec)
        compile_s = loop_seconds(step, 3, device)  # inductor compiles, CUDA graph trees warm up, then record
        dec.reset()
        for _ in range(min(WARMUP_REPLAYS, args.tokens)):
            step()
        dec.reset()
        seconds = timed_loop(step, args.tokens, device)
        result["compiled"] = {"seconds": seconds, "compile_s": compile_s,
                              "tokens_match_eager": bool(torch.equal(dec.out[:, :check], eager_tokens))}
        log(f"    batch {batch:3d} compiled {seconds / args.tokens * 1e3:8.2f} ms/token (compile + record "
            f"{compile_s:.0f} s), prefill {prefill_ms:.1f} ms", t0)
        del dec, cache, step
        torch._dynamo.reset()
        return result

    for _ in range(min(WARMUP_EAGER, args.tokens)):
        dec.step()
    dec.reset()
    seconds = timed_loop(dec.step, args.tokens, device)
    result["eager"] = {"seconds": seconds}
    eager_tokens = dec.out.clone()
    log(f"    batch {batch:3d} eager {seconds / args.tokens * 1e3:8.2f} ms/token", t0)

    if not args.no_graphs and device.type == "cuda":
        graph = None
        try:
            dec.reset()
            side = torch.cuda.Stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                for _ in range(WARMUP_GRAPH):
                    dec.step()
            torch.cuda.current_stream(device).wait_stream(side)
            sync(device)
            dec.reset()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                dec.step()
            graph_logits = dec.last  # the graph's static output (an eager step rebinds dec.last)
            sync(device)
            dec.reset()
            for _ in range(min(WARMUP_REPLAYS, args.tokens)):
                graph.replay()
            dec.reset()
            seconds = timed_loop(graph.replay, args.tokens, device)
            result["graph"] = {"seconds": seconds, "tokens_match_eager": bool(torch.equal(dec.out, eager_tokens))}
            result["graph"].update(graph_vs_eager(dec, graph, graph_logits, dec.out.clone(), eager_tokens))
            log(f"    batch {batch:3d} graph {seconds / args.tokens * 1e3:8.2f} ms/token", t0)
        except Exception as e:  # noqa: BLE001 (record, go on with the next run)
            try:
                sync(device)
            except Exception:  # noqa: BLE001
                pass
            result["graph"] = {"error": f"{type(e).__name__}: {e}"[:500]}
            log(f"    batch {batch:3d} graph capture failed: {result['graph']['error'][:200]}", t0)
        del graph
    del dec, cache
    return result


# -------------------------------------------------------------------------------------------- main

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="bench_decode.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=None,
                    help=f"decoder layers, the first N of Llama-3-8B's {FULL_LAYERS} (default {FULL_LAYERS})")
    ap.add_argument("--batches", default=None, help="comma-separated batch sizes (default 1,4,16)")
    ap.add_argument("--prompt", type=int, default=None, help="prompt tokens (default 512)")
    ap.add_argument("--tokens", type=int, default=None, help="decoded tokens (default 128)")
    ap.add_argument("--formats", default=",".join(FORMATS), help="comma-separated weight formats")
    ap.add_argument("--modes", default=",".join(MODES), help="comma-separated modes: weight_only, both_sides")
    ap.add_argument("--no-graphs", action="store_true", help="eager decoding only (no CUDA graphs)")
    ap.add_argument("--tiny", action="store_true",
                    help="tiny config (hidden 256, 2 layers, vocab 1000, prompt 16, 4 tokens, batch 1) for "
                         "smoke tests; runs on the CPU when there is no GPU")
    ap.add_argument("--max-seconds", type=float, default=420.0,
                    help="stop starting new variants after this long, 0 for no limit (the results say "
                         "which were skipped; default 420)")
    ap.add_argument("--compile", action="store_true",
                    help='the decode step under torch.compile(mode="reduce-overhead", fullgraph=True) for '
                         'every variant, plus torch\'s int4 tinygemm; no eager or CUDA-graph loops '
                         '(defaults: mxfp4 weight-only, batches 1,16, 64 tokens)')
    ap.add_argument("--no-tinygemm", action="store_true", help="with --compile: leave out the int4 peer")
    ap.add_argument("--out", default=None, help="result file stem (default decode-<gpu>, "
                    "decode-compiled-<gpu> with --compile)")
    add_options(ap)
    explicit = set()
    for a in (sys.argv[1:] if argv is None else argv):
        explicit.add(a.split("=")[0].lstrip("-").replace("-", "_"))
    args = ap.parse_args(argv)
    if args.cpu_smoke:
        if args.compile:
            ap.error("--cpu-smoke: --compile's CUDA graphs need a GPU")
        args.tiny = args.no_graphs = True
        if "formats" not in explicit:
            args.formats = "nvfp4"  # one format, both modes: the code paths, in seconds
        args.layers, args.tokens = args.layers or 1, args.tokens or 2
    if args.compile:
        for key, value in COMPILE_DEFAULTS.items():
            if key not in explicit:
                setattr(args, key, value)
    for key, value in (TINY_DEFAULTS if args.tiny else DEFAULTS).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    batches = [int(b) for b in args.batches.split(",")]
    formats = [f for f in args.formats.split(",") if f]
    modes = [m for m in args.modes.split(",") if m]
    for m in modes:
        if m not in MODES:
            ap.error(f"--modes: unknown mode {m!r} (choose from {', '.join(MODES)})")
    if args.layers < 1 or args.prompt < 1 or args.tokens < 1 or min(batches) < 1:
        ap.error("--layers, --prompt, --tokens and the batch sizes must be positive")
    if not args.tiny and args.layers > FULL_LAYERS:
        ap.error(f"--layers: Llama-3-8B has {FULL_LAYERS} layers")

    if torch.cuda.is_available() and not args.cpu_smoke:
        device = torch.device("cuda")
        gpu = torch.cuda.get_device_name(device)
    elif args.tiny:
        device, gpu = torch.device("cpu"), "cpu"
    else:
        ap.error("no CUDA device: the full-size model needs a GPU (use --tiny for a CPU smoke test)")
    is_cuda = device.type == "cuda"
    t0 = time.time()
    shape = TINY if args.tiny else LLAMA3_8B
    if args.tiny:
        layers_note = f"tiny config, {args.layers} layers"
    elif args.layers < FULL_LAYERS:
        layers_note = f"first {args.layers} of {FULL_LAYERS} layers"
    else:
        layers_note = f"all {FULL_LAYERS} layers"
    command = "python benchmarks/bench_decode.py" + (
        " " + shlex.join(sys.argv[1:] if argv is None else list(argv)) if (argv or sys.argv[1:]) else "")
    meta = {"gpu": gpu, "date": datetime.date.today().isoformat(), "torch": torch.__version__,
            "transformers": __import__("transformers").__version__, "command": command,
            "model": "tiny Llama" if args.tiny else "Llama-3-8B shape, random weights",
            "config": dict(shape, num_hidden_layers=args.layers), "layers": args.layers,
            "layers_note": layers_note, "batches": batches, "prompt": args.prompt, "tokens": args.tokens,
            "formats": formats, "modes": modes, "graphs": not args.no_graphs and is_cuda and not args.compile,
            "compiled": args.compile,
            "skipped": [], "seconds": None}
    stem = (out_dir(args.out_dir) / args.out if args.out else
            results_path(args.out_dir, "decode", gpu, "json", variant="compiled" if args.compile else None
                         ).with_suffix(""))
    log(f"{gpu}: {meta['model']}, {layers_note}; batches {batches}, prompt {args.prompt}, "
        f"{args.tokens} tokens", t0)

    records, accuracy, variants = [], [], {}
    with torch.no_grad():
        if is_cuda:
            torch.cuda.init()
        allocated_at_start = torch.cuda.memory_allocated(device) if is_cuda else 0
        base = build_model(shape, args.layers, device)
        log(f"bf16 model built: {_size(model_bytes(base))}", t0)
        plan = [("bf16", None, None)] + [(f"{fmt}-{mode.replace('_', '-')}", fmt, mode)
                                         for mode in modes for fmt in formats]
        if args.compile and not args.no_tinygemm and is_cuda:
            plan.append(("int4-tinygemm", "int4", "tinygemm"))
        reference = {}
        for name, fmt, mode in plan:
            if args.max_seconds > 0 and time.time() - t0 > args.max_seconds:
                meta["skipped"].append(name)
                log(f"{name}: skipped (past --max-seconds {args.max_seconds:g})", t0)
                continue
            gc.collect()
            if is_cuda:
                torch.cuda.empty_cache()
            # Peak memory is counted from here: for the bf16 model, from before it was built; for a
            # quantized copy, on top of the bf16 model (kept for the next copies) and its logits.
            if fmt is None:
                before = allocated_at_start
            else:
                before = torch.cuda.memory_allocated(device) if is_cuda else 0
            info = {"format": fmt or "bf16", "mode": mode or "bf16"}
            t = time.time()
            try:
                if fmt is None:
                    model = base
                else:
                    model = copy.deepcopy(base)
                    if mode == "tinygemm":
                        quantize_int4(model)
                    else:
                        tilemm.quantize_model(model, fmt, skip=["lm_head"], weight_only=(mode == "weight_only"))
                    sync(device)
                    info["quantize_s"] = time.time() - t
                info["model_bytes"] = model_bytes(model)
            except Exception as e:  # noqa: BLE001
                info["error"] = f"{type(e).__name__}: {e}"[:500]
                variants[name] = info
                log(f"{name}: quantization failed: {info['error'][:200]}", t0)
                model = None
                continue
            variants[name] = info
            log(f"{name}: model {_size(info['model_bytes'])}"
                + (f", quantized in {info['quantize_s']:.1f} s" if "quantize_s" in info else ""), t0)
            for batch in batches:
                if is_cuda:
                    torch.cuda.reset_peak_memory_stats(device)
                try:
                    res = run_batch(model, batch, args, device, t0)
                except Exception as e:  # noqa: BLE001
                    err = f"{type(e).__name__}: {e}"[:500]
                    log(f"    batch {batch:3d} failed: {err[:200]}", t0)
                    records.append({"variant": name, "format": info["format"], "mode": info["mode"],
                                    "batch": batch, "exec": "eager", "error": err})
                    continue
                peak = (torch.cuda.max_memory_allocated(device) - before) if is_cuda else None
                for ex in EXECS:
                    r = res.get(ex)
                    if r is None:
                        continue
                    rec = {"variant": name, "format": info["format"], "mode": info["mode"], "batch": batch,
                           "exec": ex, "model_gib": info["model_bytes"] / 2**30,
                           "peak_gib": None if peak is None else peak / 2**30,
                           "prefill_ms": res["prefill_ms"]}
                    if "error" in r:
                        rec["error"] = r["error"]
                    else:
                        rec["ms_per_token"] = r["seconds"] / args.tokens * 1e3
                        rec["tokens_per_s"] = batch * args.tokens / r["seconds"]
                        for key in GRAPH_CHECK_KEYS:
                            if key in r:
                                rec[key] = r[key]
                        if "compile_s" in r:
                            rec["compile_s"] = r["compile_s"]
                    records.append(rec)
                logits = res["logits"]
                if fmt is None:
                    reference[batch] = logits
                elif batch in reference:
                    ref = reference[batch]
                    diff = (logits - ref).abs()
                    accuracy.append({"variant": name, "batch": batch, "max_abs_diff": diff.max().item(),
                                     "mean_abs_diff": diff.mean().item(),
                                     "ref_mean_abs": ref.abs().mean().item(),
                                     "first_token_agreement": (logits.argmax(-1) == ref.argmax(-1))
                                     .float().mean().item()})
                del res, logits
            if model is not base:
                del model
            model = None
            gc.collect()
            if is_cuda:
                torch.cuda.empty_cache()
            add_speedups(records)
            meta["seconds"] = time.time() - t0
            write(stem, meta, variants, records, accuracy, plot_too=False)
        del base, reference
    add_speedups(records)
    meta["seconds"] = time.time() - t0
    summary = write(stem, meta, variants, records, accuracy, plot_too=True)
    print(markdown(meta, variants, records, accuracy, summary))
    log(f"wrote {stem}.json, .md, .png", t0)
    return 0


# ------------------------------------------------------------------------------------------ output

def add_speedups(records) -> None:
    """tokens/s over bf16's at the same batch size and execution mode."""
    bf16 = {(r["batch"], r["exec"]): r["tokens_per_s"] for r in records
            if r["variant"] == "bf16" and "tokens_per_s" in r}
    prefill = {(r["batch"], r["exec"]): r["prefill_ms"] for r in records
               if r["variant"] == "bf16" and "prefill_ms" in r}
    for r in records:
        key = (r["batch"], r["exec"])
        if "tokens_per_s" in r and key in bf16:
            r["speedup_vs_bf16"] = r["tokens_per_s"] / bf16[key]
        if "prefill_ms" in r and key in prefill:
            r["prefill_speedup_vs_bf16"] = prefill[key] / r["prefill_ms"]


def targets(records) -> list[dict]:
    """The targets of 4-bit weight-only variants: tokens/s over bf16 (``TARGETS``); compiled, also the
    prefill no slower than bf16's and tokens/s above int4 tinygemm's at the same batch size."""
    out = []
    four_bit = [r for r in records if r.get("mode") == "weight_only" and r.get("format") in ("mxfp4", "nvfp4")]
    for ex, batch, minimum in TARGETS:
        for r in four_bit:
            if r["exec"] == ex and r["batch"] == batch and "speedup_vs_bf16" in r:
                out.append({"variant": r["variant"], "exec": ex, "batch": batch, "what": "tokens/s over bf16",
                            "minimum": minimum, "speedup": r["speedup_vs_bf16"],
                            "met": r["speedup_vs_bf16"] >= minimum})
    for r in four_bit:
        if r["exec"] != "compiled" or "speedup_vs_bf16" not in r:
            continue
        if "prefill_speedup_vs_bf16" in r:
            out.append({"variant": r["variant"], "exec": "prefill", "batch": r["batch"],
                        "what": "prefill over bf16", "minimum": 1.0, "speedup": r["prefill_speedup_vs_bf16"],
                        "met": r["prefill_speedup_vs_bf16"] >= 1.0})
        peer = next((p for p in records if p["variant"] == "int4-tinygemm" and p["exec"] == "compiled"
                     and p["batch"] == r["batch"] and "speedup_vs_bf16" in p), None)
        if peer is not None:
            out.append({"variant": r["variant"], "exec": "compiled", "batch": r["batch"],
                        "what": "tokens/s over int4 tinygemm", "minimum": 1.0,
                        "speedup": r["tokens_per_s"] / peer["tokens_per_s"],
                        "met": r["tokens_per_s"] > peer["tokens_per_s"]})
    return out


def write(stem, meta, variants, records, accuracy, plot_too: bool) -> dict:
    summary = {"targets": targets(records)}
    stem = pathlib.Path(stem)
    stem.with_name(stem.name + ".json").write_text(json.dumps(
        {"meta": meta, "summary": summary, "variants": variants, "records": records, "accuracy": accuracy},
        indent=1))
    stem.with_name(stem.name + ".md").write_text(markdown(meta, variants, records, accuracy, summary))
    if plot_too:
        try:
            plot(meta, records, stem.with_name(stem.name + ".png"))
        except Exception as e:  # noqa: BLE001
            print(f"plot skipped: {e}", flush=True)
    return summary


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _gib(value) -> str:
    if value is None:
        return "-"
    return f"{value:.2f}" if value >= 0.1 else f"{value:.2g}"


def _f(value, fmt: str) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, fmt)


def markdown(meta, variants, records, accuracy, summary) -> str:
    lines = [f"# End-to-end decode on {meta['gpu']} ({meta['date']})", "",
             f"`{meta['command']}`", "",
             f"{meta['model']}, {meta['layers_note']} (embeddings, final norm and bf16 `lm_head` full "
             f"size); every other linear quantized with `tilemm.quantize_model`. Greedy decoding of "
             f"{meta['tokens']} tokens after a {meta['prompt']}-token prompt with a static KV cache; "
             f"time per token is the decode loop's wall time / tokens (prefill excluded), speed-up is "
             f"tokens/s over the bf16 model at the same batch size and execution mode (> 1 is faster). "
             f"Peak GiB: GPU memory the variant allocated at most (weights, KV cache, activations, CUDA "
             f"graph pool). torch {meta['torch']}, transformers {meta['transformers']}"
             + (f"; {meta['seconds']:.0f} s in all." if meta.get("seconds") else "."), ""]
    if meta.get("compiled"):
        lines += ['Decode steps under `torch.compile(mode="reduce-overhead", fullgraph=True)` (exec '
                  '"compiled"; compile and CUDA-graph recording excluded from the timing), prefill timed '
                  'eagerly (best of 3 after a warm-up); the eager and CUDA-graph loops were not run.', ""]
    elif not meta["graphs"]:
        lines += ["CUDA graphs not run.", ""]
    if meta["skipped"]:
        lines += [f"Skipped (time limit): {', '.join(meta['skipped'])}.", ""]
    if summary["targets"]:
        lines += ["Targets (4-bit weight-only):", ""]
        for t in summary["targets"]:
            lines.append(f"- {t['variant']} {t['exec']} batch {t['batch']}, {t.get('what', 'tokens/s over bf16')}: "
                         f"{t['speedup']:.2f}x (>= {t['minimum']:g}x: {'met' if t['met'] else 'NOT met'})")
        lines.append("")
    lines += ["| variant | batch | exec | ms/token | tokens/s | speed-up | prefill ms | prefill speed-up | "
              "model GiB | peak GiB |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        if "error" in r:
            lines.append(f"| {r['variant']} | {r['batch']} | {r['exec']} | failed: "
                         f"{r['error'][:120].replace('|', '/')} | | | | | | |")
            continue
        lines.append(f"| {r['variant']} | {r['batch']} | {r['exec']} | {r['ms_per_token']:.2f} | "
                     f"{r['tokens_per_s']:.1f} | {_f(r.get('speedup_vs_bf16'), '.2f')}x | "
                     f"{_f(r.get('prefill_ms'), '.1f')} | {_f(r.get('prefill_speedup_vs_bf16'), '.2f')}x | "
                     f"{_gib(r['model_gib'])} | {_gib(r['peak_gib'])} |")
    mismatched = [f"{r['variant']} batch {r['batch']}" for r in records
                  if r["exec"] != "compiled" and r.get("graph_matches_eager", r.get("tokens_match_eager")) is False]
    if mismatched:
        lines += ["", "Tokens differ from the eager ones (CUDA graph: at a decisive step, not a near-tie; see "
                  "graph_vs_eager): " + ", ".join(mismatched)]
    compiled = [f"{r['variant']} batch {r['batch']}" for r in records
                if r["exec"] == "compiled" and r.get("tokens_match_eager") is False]
    if compiled:
        lines += ["", "Compiled tokens differ from an eager run's within the first 8 (no near-tie analysis in "
                  "this mode: inductor's fused bf16 roundings can flip a nearly tied token of a random-weight "
                  "model): " + ", ".join(compiled)]
    failed = {n: v["error"] for n, v in variants.items() if "error" in v}
    if failed:
        lines += [""] + [f"- {n}: quantization failed: {e}" for n, e in failed.items()]
    if accuracy:
        lines += ["", "Logits of the first decoded token (the prefill's last position) against bf16, "
                  "float32; agreement is the fraction of sequences whose greedy token is the same:", "",
                  "| variant | batch | max abs diff | mean abs diff | bf16 mean abs | agreement |",
                  "|---|---|---|---|---|---|"]
        for a in accuracy:
            lines.append(f"| {a['variant']} | {a['batch']} | {a['max_abs_diff']:.4g} | "
                         f"{a['mean_abs_diff']:.4g} | {a['ref_mean_abs']:.4g} | "
                         f"{a['first_token_agreement']:.2f} |")
    return "\n".join(lines) + "\n"


def plot(meta, records, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    execs = [ex for ex in EXECS if any(r["exec"] == ex and "speedup_vs_bf16" in r for r in records)]
    if not execs:
        return
    fig, axes = plt.subplots(1, len(execs), figsize=(6 * len(execs), 4.5), squeeze=False, sharey=True)
    variants = list(dict.fromkeys(r["variant"] for r in records if r["variant"] != "bf16"))
    for ax, ex in zip(axes[0], execs):
        for name in variants:
            rs = sorted((r for r in records if r["variant"] == name and r["exec"] == ex
                         and "speedup_vs_bf16" in r), key=lambda r: r["batch"])
            if rs:
                ax.plot([r["batch"] for r in rs], [r["speedup_vs_bf16"] for r in rs], marker="o", label=name,
                        linestyle="-" if "weight-only" in name else "--")
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_xscale("log", base=2)
        batches = sorted({r["batch"] for r in records})
        ax.set_xticks(batches, [str(b) for b in batches])
        ax.minorticks_off()
        ax.set_xlabel("batch size")
        ax.set_title("CUDA graphs" if ex == "graph" else "eager")
        ax.legend(fontsize=7)
    axes[0][0].set_ylabel("decode tokens/s over bf16")
    fig.suptitle(f"Decode, {meta['model']} ({meta['layers_note']}), {meta['prompt']} + {meta['tokens']} "
                 f"tokens, {meta['gpu']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
