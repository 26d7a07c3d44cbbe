"""Trie passes batched by the engine's fitted costs against batched within a fixed padding slack.

A trie stage rolls out the same prompts `--calls` times with the weights fixed (the tries fill up
as in a sharp policy's run; the verification budget on unless `--no-budget`), and every
`verify_tries` call it makes is recorded. The engine's `PassCost` has then seen every forward of
those passes. Each recorded call is verified again, `--rounds` times, with the two groupings
taking turns: its sequences within `trie_padding_slack` (the engine's rule until its costs are
fitted) and by the fit as it stood after the recording (frozen, so both see the same calls).

    python benchmarks/trie_batching.py --out OUT                       # the built-in task
    python benchmarks/trie_batching.py --out OUT --model builtin:smollm2-135m-instruct \
        --data cs/train.parquet --prompts 4 --max-tokens 48

Writes OUT/trie_batching.json (per call and grouping: forwards, padded positions, seconds) and
prints the totals. Run alone: every figure is wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from specrl.config import SpecConfig, load_config
from specrl.data import load_prompts
from specrl.engines import SamplingParams
from specrl.engines.hf import HFEngine
from specrl.engines.hf.batching import width_batches
from specrl.models import eos_token_ids, load_policy, resolve_model_path
from specrl.speculative.stage import SpeculativeStage
from specrl.trainer import Trainer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--model", default=None, help="default: the built-in task's policy")
    parser.add_argument("--data", default=None, help="a parquet of prompts (default: built-in)")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=72)
    parser.add_argument("--calls", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--no-budget", action="store_true")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    data = [f"data.train_files={args.data}", f"data.val_files={args.data}"] if args.data else []
    with tempfile.TemporaryDirectory() as out:
        cfg = load_config(None, [f"trainer.output_dir={out}", "trainer.logger=[jsonl]", *data])
        path = resolve_model_path(args.model) if args.model else Trainer(cfg).run.model_dir
    policy, tokenizer = load_policy(path, "float32")
    prompts = load_prompts(cfg.data, tokenizer, 1, lambda _: None)[0][: args.prompts]
    engine = HFEngine(policy.eval(), eos_token_ids(policy, tokenizer), tokenizer.pad_token_id)
    spec = SpecConfig(reuse="trie", verify_budget=not args.no_budget)
    stage = SpeculativeStage(engine, SamplingParams(1.0), args.max_tokens, spec)
    recorded, verify_tries = [], engine.verify_tries

    def recording(requests, prefixes=None):
        recorded.append(list(requests))
        return verify_tries(requests, prefixes)

    engine.verify_tries = recording
    for call in range(args.calls):
        stage(prompts, args.n, (1, call, 0), call)
    engine.verify_tries = verify_tries
    fit = engine.verify_cost.fit()
    vocab = policy.config.get_text_config().vocab_size
    groupings = {"slack": lambda: None, "fitted": lambda: fit}
    seconds: dict[str, list[list[float]]] = {g: [[] for _ in recorded] for g in groupings}
    for _ in range(args.rounds):
        for k, requests in enumerate(recorded):
            for name, cost in groupings.items():
                engine.verify_cost.fit = cost
                started = time.perf_counter()
                engine.verify_tries(requests, engine.new_prefixes())
                seconds[name][k].append(time.perf_counter() - started)
    calls = []
    for k, requests in enumerate(recorded):
        widths = [len(r.prompt_ids) + len(r.tokens) for r in requests]
        keys = [(tuple(r.prompt_ids), tuple(r.tokens), tuple(r.parents)) for r in requests]
        kept = [len(r.tokens) + 1 for r in requests]
        row = {"tries": len(requests), "positions": sum(widths)}
        for name, cost in groupings.items():
            batches = width_batches(
                widths, keys, engine.max_batch_size, engine.trie_padding_slack,
                engine.logits_budget // vocab, kept, cost(),
            )  # fmt: skip
            row[name] = {
                "forwards": len(batches),
                "padded_positions": sum(len(b) * widths[b[0]] for b in batches),
                "median_s": statistics.median(seconds[name][k]),
                "seconds": seconds[name][k],
            }
        calls.append(row)
    totals = {g: sum(c[g]["median_s"] for c in calls) for g in groupings}
    result = {
        "command": " ".join(sys.argv),
        "model": str(args.model or "built-in task policy"),
        "threads": args.threads,
        "load_average_at_end": os.getloadavg(),
        "fit": None if fit is None else vars(fit),
        "total_median_s": totals,
        "calls": calls,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "trie_batching.json").write_text(json.dumps(result, indent=1))
    print("fit:", result["fit"])
    for c in calls:
        print(
            f"{c['tries']} tries, {c['positions']} positions: "
            + ", ".join(
                f"{g} {c[g]['forwards']} forwards {c[g]['padded_positions']} padded "
                f"{c[g]['median_s']:.3f} s"
                for g in groupings
            )
        )
    print("total of the medians:", {g: round(s, 3) for g, s in totals.items()})


if __name__ == "__main__":
    main()
