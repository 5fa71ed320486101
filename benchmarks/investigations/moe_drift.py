"""How far the logits of bench_moe's gpt-oss decode step drift between MXFP4 experts and the same
weights in bf16 as the model gets deeper (CPU, random weights, one step from ``start_state``).

Each experts layer alone differs by bf16 rounding (a few 1e-3, relative); a difference that tips one
router's top-k choice somewhere sends the token through other experts from there on, so the logits
of a deep random model can differ by tens of percent while every layer is right. Prints the relative
error of the logits for 1 to 24 layers.

    python benchmarks/investigations/moe_drift.py
"""

import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

import bench_moe as b  # noqa: E402


def main() -> None:
    device = torch.device("cpu")
    shape = dict(b.TINY, hidden_size=256, intermediate_size=256, num_local_experts=32, num_experts_per_tok=4,
                 vocab_size=512)
    for layers in (1, 2, 4, 8, 16, 24):
        config = b.gpt_oss_config(shape, layers)
        packed = b.packed_experts(config, layers, device, seed=7)
        model = b.DecodeModel(config, packed, 1, 64, device)
        quantized = b.first_step_logits(model, device)
        model.experts = torch.nn.ModuleList(b.bf16_experts(packed))
        bf16 = b.first_step_logits(model, device)
        print(f"{layers:3d} layers: logits relative error {float((quantized - bf16).norm() / bf16.norm()):.3e}",
              flush=True)


if __name__ == "__main__":
    main()
