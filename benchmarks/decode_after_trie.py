"""Decode forwards after a trie pass against plain decoding of the same continuations, on a real
model (SmolLM2-135M-Instruct with LoRA adapters, as the chain_sum benches train it).

    python benchmarks/decode_after_trie.py --out benchmarks/cpu-hf-smollm2-decode-after-trie

Issue 53's SmolLM2 checks measured the trie arm's decode forwards at 191 against vanilla's 169 ms
over a window (`cpu-hf-smollm2-chain-sum-check-seed71`), with the two arms' rows and responses
already apart. Here the work is the same: a stage rolls out `--slots` slots of `--prompts`
chain_sum prompts once (their tries), then once more with other seeds; its continuation
requests (each slot's prompt and the tokens its walk reused, its budget, seed and exclusions) are
then decoded `--pairs` times from the KV of that trie pass (the prefix cache: what the trie arm
does) and as often from scratch (the context prefilled: what plain decoding of the same rows
does), the two alternating, which goes first switching every pair. Per call: the seconds inside
decode forwards, their count and rows; the prefill is left out (it is what the trie pass
replaces). Writes results.json. Run alone.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]  # the tests package lives there
sys.path.insert(0, str(ROOT))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--pairs", type=int, default=12)
    parser.add_argument("--seed", type=int, default=71, help="the chain_sum data seed")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from specrl.config import SpecConfig
    from specrl.config.rollout import TreeConfig
    from specrl.engines import SamplingParams
    from specrl.engines.hf import HFEngine
    from specrl.models import eos_token_ids, load_policy, resolve_model_path
    from specrl.speculative.stage import SpeculativeStage
    from tests.speculative.exactness import chat_prompts, with_moved_adapters

    started_load = os.getloadavg()
    path = resolve_model_path("builtin:smollm2-135m-instruct")
    model, tokenizer = load_policy(path, "float32")
    model = with_moved_adapters(model.eval(), seed=1)
    engine = HFEngine(model, eos_token_ids(model, tokenizer), tokenizer.pad_token_id)
    prompts = chat_prompts(tokenizer, args.prompts, seed=args.seed)
    spec = SpecConfig(
        enabled=True,
        acceptance="exact",
        reuse="trie",
        verify_budget=False,
        tree=TreeConfig(enabled=False),
    )
    stage = SpeculativeStage(engine, SamplingParams(1.0), args.tokens, spec)

    captured: dict = {}
    generate = engine.generate

    def capturing(requests, prefixes=None):
        captured["requests"], captured["prefixes"] = list(requests), prefixes
        return generate(requests, prefixes)

    engine.generate = capturing
    stage(prompts, args.slots, (0, 0, 0), 0)  # the tries
    _, stats = stage(prompts, args.slots, (1, 0, 0), 0)  # walked with other seeds
    engine.generate = generate
    requests, prefixes = captured["requests"], captured["prefixes"]

    calls: dict[str, list[dict]] = {"after_trie": [], "plain": []}
    tokens: dict[str, list[list[int]]] = {}
    for pair in range(args.pairs):
        order = ("after_trie", "plain") if pair % 2 else ("plain", "after_trie")
        for path_name in order:
            before = engine.counts.decode_forwards, engine.counts.decode_rows
            seconds = engine.counts.decode_seconds
            started = time.perf_counter()
            results = engine.generate(requests, prefixes if path_name == "after_trie" else None)
            calls[path_name].append({
                "pair": pair,
                "decode_s": engine.counts.decode_seconds - seconds,
                "call_s": time.perf_counter() - started,
                "decode_forwards": engine.counts.decode_forwards - before[0],
                "decode_rows": engine.counts.decode_rows - before[1],
            })  # fmt: skip
            tokens.setdefault(path_name, [r.token_ids for r in results])
    ratios = np.log(
        np.array([c["decode_s"] for c in calls["after_trie"]])
        / np.array([c["decode_s"] for c in calls["plain"]])
    )
    differing = [
        {"request": i, "first_difference": _first_difference(a, b)}
        for i, (a, b) in enumerate(zip(tokens["after_trie"], tokens["plain"], strict=True))
        if a != b
    ]
    result = {
        "command": " ".join(sys.argv),
        "torch": torch.__version__,
        "threads": args.threads,
        "load_average_at_start": started_load,
        "load_average_at_end": os.getloadavg(),
        "requests": len(requests),
        "reused_tokens": stats.reused_tokens,
        "calls": calls,
        "after_trie_over_plain_decode_s": float(np.exp(ratios.mean())),
        "log_ratio_standard_error": float(ratios.std(ddof=1) / np.sqrt(len(ratios))),
        "differing_requests": differing,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(result, indent=1))
    print(
        f"decode seconds after a trie pass / plain: {result['after_trie_over_plain_decode_s']:.3f}"
        f" (log se {result['log_ratio_standard_error']:.3f}) over {args.pairs} pairs; "
        f"{len(differing)} of {len(requests)} requests' tokens differ"
    )


def _first_difference(a: list[int], b: list[int]) -> int:
    pairs = enumerate(zip(a, b, strict=False))
    return next((j for j, (x, y) in pairs if x != y), min(len(a), len(b)))


if __name__ == "__main__":
    main()
