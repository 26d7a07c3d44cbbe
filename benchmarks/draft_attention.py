"""The attention of one decode forward on the CPU: transformers' `sdpa` (PyTorch's
scaled_dot_product_attention, flash kernel) against specrl's matmul-softmax (`matmul_attention`,
which `small_query_attention` in specrl/engines/hf/attention.py uses for 2 or more query columns
after a cache whose product with the keys is at most `SMALL_QUERY`) over the shapes decoding with drafts feeds: a
token and up to 8 drafts (1-9 query columns, then 16-64) over caches of 70-1000 keys, at the
built-in policy's heads (4 of dimension 32) and SmolLM2-135M's (9 query heads on 3 KV heads of
dimension 64), the keys and values views of a buffer with spare columns as the engine's cache
holds them, a boolean causal mask with a left-padded row.

    python benchmarks/draft_attention.py --out DIR [--threads 2] [--repeats 200]

Each call is timed `--repeats` times after 10 untimed ones, the two functions alternating per
shape; `DIR/draft_attention.json` has per shape both medians in ms, their ratio, the largest
difference of the outputs, and which one the engine uses; `DIR/draft_attention.png` plots the
ratio against query columns x keys. Run alone.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

HEADS = {"builtin": (60, 4, 4, 32), "smollm2": (64, 9, 3, 64)}  # rows, heads, KV heads, dim
COLUMNS = (1, 2, 3, 4, 6, 9, 16, 32)
KEYS = (70, 250, 1000)


class Heads:
    def __init__(self, heads: int, kv_heads: int) -> None:
        self.num_key_value_groups = heads // kv_heads
        self.is_causal = True


def timed(fn, repeats: int) -> float:
    """The median seconds of `fn()` over `repeats` calls, after 10 untimed ones."""
    for _ in range(10):
        fn()
    seconds = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        seconds.append(time.perf_counter() - started)
    return statistics.median(seconds)


def measure(model: str, columns: int, keys: int, repeats: int) -> dict:
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from specrl.engines.hf.attention import matmul_attention, uses_matmul
    from specrl.models import planless_attention

    rows, heads, kv_heads, dim = HEADS[model]
    torch.manual_seed(0)
    query = torch.randn(rows, heads, columns, dim)
    key, value = torch.randn(2, rows, kv_heads, keys + 32, dim)[:, :, :, :keys]
    mask = torch.ones(rows, 1, columns, keys, dtype=torch.bool)
    mask[..., keys - columns :] = torch.ones(columns, columns, dtype=torch.bool).tril()
    mask[0, ..., :5] = False
    module = Heads(heads, kv_heads)
    with torch.inference_mode(), planless_attention():
        sdpa = lambda: sdpa_attention_forward(module, query, key, value, mask)[0]  # noqa: E731
        ours = lambda: matmul_attention(query, key, value, mask)  # noqa: E731
        difference = float((sdpa() - ours()).abs().max())
        sdpa_s, ours_s = timed(sdpa, repeats), timed(ours, repeats)
    return {
        "model": model,
        "rows": rows,
        "columns": columns,
        "keys": keys,
        "sdpa_ms": sdpa_s * 1e3,
        "matmul_ms": ours_s * 1e3,
        "sdpa_over_matmul": sdpa_s / ours_s,
        "max_abs_difference": difference,
        "engine_uses": "matmul" if uses_matmul(columns, keys, heads // kv_heads) else "sdpa",
    }


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for model, marker in (("builtin", "o"), ("smollm2", "s")):
        for uses, color in (("matmul", "tab:green"), ("sdpa", "tab:gray")):
            shown = [r for r in results if r["model"] == model and r["engine_uses"] == uses]
            ax.scatter(
                [r["columns"] * r["keys"] for r in shown],
                [r["sdpa_over_matmul"] for r in shown],
                marker=marker,
                color=color,
                label=f"{model}, engine uses {uses}",
            )
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("query columns x keys")
    ax.set_ylabel("SDPA ms / matmul-softmax ms")
    ax.set_title("Decode-forward attention on the CPU, one layer")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    load = os.getloadavg()
    results = [
        measure(model, columns, keys, args.repeats)
        for model in HEADS
        for keys in KEYS
        for columns in COLUMNS
        if columns < keys
    ]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "draft_attention.json").write_text(
        json.dumps(
            {
                "torch": torch.__version__,
                "threads": args.threads,
                "load_average_at_start": load,
                "load_average_at_end": os.getloadavg(),
                "results": results,
            },
            indent=1,
        )
    )
    plot(results, args.out / "draft_attention.png")
    for r in results:
        print(
            f"{r['model']:8} {r['columns']:3} x {r['keys']:5}: sdpa {r['sdpa_ms']:.3f} ms, "
            f"matmul {r['matmul_ms']:.3f} ms ({r['sdpa_over_matmul']:.2f}x), "
            f"engine: {r['engine_uses']}"
        )


if __name__ == "__main__":
    main()
