"""What a decode forward's rows cost on this CPU, measured two ways:

1. the LM head's matrix product alone (a [M, hidden] @ [hidden, vocab] `F.linear` at the
   model's shape) for M = 1 ... 16 rows: milliseconds, and which M compute the first rows
   bit for bit as M = 4 does (the BLAS's kernels take rows in blocks; rows outside a full
   block go through other kernels, at other speeds and with other rounding);
2. the transformers engine's decode iterations (forward, sampling, bookkeeping, as
   `DraftWidth` times them for the budgets) over B distinct sequences, B = 1 ... 16, with no
   end-of-sequence token, so each call's B rows decode to the end together; and the linear fit
   c0 + cs·B that `DraftWidth` makes of them, fitted to all of them at once and to the
   iterations of 1-3 rows alone (the late steps of a real model's RL run decode that few).

    python benchmarks/decode_rows.py --out OUT [--model builtin:smollm2-135m-instruct]

Writes OUT/decode_rows.json and OUT/decode_rows.png. Run alone: every figure is wall time.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import torch

from specrl.engines import GenRequest, SamplingParams
from specrl.engines.hf import HFEngine
from specrl.models import load_policy, resolve_model_path
from specrl.speculative.draft_width import DraftWidth
from specrl.speculative.drafting import TimedDecoding

ROWS = range(1, 17)


class RecordedWidth(DraftWidth):
    """A `DraftWidth` that also keeps every decode iteration it is shown: (rows, seconds)."""

    def __init__(self) -> None:
        super().__init__(max_tokens=0)
        self.iterations: list[tuple[int, float]] = []

    def observe_forward(self, sequences: int, fed_tokens: int, seconds: float) -> None:
        self.iterations.append((sequences, seconds))
        super().observe_forward(sequences, fed_tokens, seconds)


def head_product(head: torch.Tensor, repeats: int) -> dict[str, list]:
    """Median ms of the LM head's product per number of rows M, and the M whose first rows are
    bitwise those of M = 4 (M ≥ 4) or of M itself."""
    x = torch.randn(max(ROWS), 1, head.shape[1], generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        out = {m: torch.nn.functional.linear(x[:m], head) for m in ROWS}
        ms = []
        for m in ROWS:
            times = []
            for _ in range(repeats):
                started = time.perf_counter()
                torch.nn.functional.linear(x[:m], head)
                times.append(1000 * (time.perf_counter() - started))
            ms.append(statistics.median(times))
    as_four = [m for m in ROWS if m >= 4 and torch.equal(out[m][:4], out[4])]
    return {"rows": list(ROWS), "ms": ms, "first_four_rows_as_at_m4": as_four}


def decode_iterations(
    model_path: str, repeats: int, tokens: int
) -> tuple[dict[str, object], torch.Tensor]:
    """Every decode iteration of `repeats` rounds of calls over B = 1 ... 16 distinct random
    prompts of 48 tokens, `tokens` new tokens each, and the linear fits of them; the model's LM
    head."""
    policy, tokenizer = load_policy(resolve_model_path(model_path), "float32")
    engine = HFEngine(policy.eval(), [], tokenizer.pad_token_id)  # no end: rows decode to the end
    width, rng = RecordedWidth(), random.Random(0)
    vocab = policy.config.get_text_config().vocab_size
    for _ in range(repeats):
        for rows in ROWS:
            requests = [
                GenRequest([rng.randrange(vocab) for _ in range(48)], tokens, SamplingParams(1.0),
                           seed=rng.randrange(1 << 30))
                for _ in range(rows)
            ]  # fmt: skip
            engine.generate_with_drafts(requests, TimedDecoding(width), None)
    rows_seconds = np.array(width.iterations)  # [I, 2]
    by_rows = {
        int(b): 1000 * float(np.median(rows_seconds[rows_seconds[:, 0] == b, 1]))
        for b in sorted(set(rows_seconds[:, 0].tolist()))
    }
    return {
        "median_ms_by_rows": by_rows,
        "fit_all_rows_ms": _linear_fit(rows_seconds),
        "fit_1_to_3_rows_ms": _linear_fit(rows_seconds[rows_seconds[:, 0] <= 3]),
        "iterations": rows_seconds.tolist(),
    }, policy.get_output_embeddings().weight.detach()


def _linear_fit(rows_seconds: np.ndarray) -> dict[str, float]:
    x = np.stack([np.ones(len(rows_seconds)), rows_seconds[:, 0]], 1)
    (c0, cs), *_ = np.linalg.lstsq(x, rows_seconds[:, 1], rcond=None)
    return {"c0": 1000 * float(c0), "cs": 1000 * float(cs)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--model", default="builtin:smollm2-135m-instruct")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=24)
    args = parser.parse_args()
    torch.set_num_threads(2)
    decode, weight = decode_iterations(args.model, args.repeats, args.tokens)
    head = head_product(weight, 15)
    result = {"model": args.model, "threads": 2, "head_product": head, "decode": decode}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "decode_rows.json").write_text(json.dumps(result, indent=1))
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.plot(head["rows"], head["ms"], "o-")
    left.set(xlabel="rows M", ylabel="ms", title="LM head product")
    medians = decode["median_ms_by_rows"]
    right.plot(list(medians), list(medians.values()), "o-")
    right.set(xlabel="rows", ylabel="ms (median)", title="decode iteration")
    fig.tight_layout()
    fig.savefig(args.out / "decode_rows.png", dpi=100)
    print(
        "LM head ms by M:", " ".join(f"{m}:{t:.1f}" for m, t in zip(ROWS, head["ms"], strict=True))
    )
    print("first 4 rows as at M=4 for M =", head["first_four_rows_as_at_m4"])
    print("decode iteration median ms by rows:", {b: round(t, 1) for b, t in medians.items()})
    print("fit, all rows:", decode["fit_all_rows_ms"], "1-3 rows:", decode["fit_1_to_3_rows_ms"])


if __name__ == "__main__":
    main()
