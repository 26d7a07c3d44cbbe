"""A decode forward of SmolLM2-135M-Instruct with and without the LoRA adapters the 40-step
chain_sum bench trains (rank 8, unmerged, as the transformers engine decodes through them), in
turns: each shape's median over four alternating pairs of five-forward medians.

    python benchmarks/cpu-hf-smollm2-lora-calibration/lora_forward_ab.py
"""

import statistics
import time
from pathlib import Path

import torch

from specrl.config import load_config
from specrl.engines.build import rollout_policy
from specrl.models import resolve_model_path

CONFIG = "benchmarks/cpu-hf-smollm2-chain-sum-40-5486040/vanilla/config.yaml"


def decode_seconds(model, generator, rows: int, context: int, reps: int = 5) -> float:
    """The median seconds of one decode forward of `rows` rows after `context` tokens."""
    ids = torch.randint(100, 40000, (rows, context), generator=generator)
    with torch.inference_mode():
        cache = model(input_ids=ids, use_cache=True).past_key_values
        seconds = []
        for _ in range(reps):
            started = time.perf_counter()
            model(input_ids=ids[:, -1:], past_key_values=cache)
            seconds.append(time.perf_counter() - started)
            cache.crop(-1)
    return statistics.median(seconds)


def main() -> None:
    torch.set_num_threads(2)
    cfg = load_config(CONFIG)
    model_dir = Path(resolve_model_path(cfg.model.path))
    lora = rollout_policy(cfg, model_dir)[0]
    base = rollout_policy(load_config(CONFIG, ["actor.lora.rank=0"]), model_dir)[0]
    generator = torch.Generator().manual_seed(0)
    for rows, context in ((1, 60), (8, 80), (32, 100)):
        pairs = [
            (
                decode_seconds(base, generator, rows, context),
                decode_seconds(lora, generator, rows, context),
            )
            for _ in range(4)
        ]
        plain, adapted = (statistics.median(p[k] for p in pairs) for k in (0, 1))
        print(
            f"rows {rows} ctx {context}: base {plain * 1e3:.1f} ms, lora {adapted * 1e3:.1f} ms, "
            f"+{(adapted / plain - 1) * 100:.0f}%"
        )


if __name__ == "__main__":
    main()
