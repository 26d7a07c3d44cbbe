"""What a trie pass costs against the prefill of the same prompts, op by op, on a real model.
The first `--prompts` prompts of a parquet (`specrl data ...`, templated as training templates
them) get `--n` responses each, sampled by the policy (temperature 1, `--max-tokens`); each
prompt's trie of them is verified in one `verify_tries` call (every node, no budget), against a
`generate` of one token per slot (the prefill of the same prompts, which a trie pass replaces).
Each call is timed `--repeats` times after one untimed call, then profiled once with
torch.profiler.

    python benchmarks/trie_pass_ops.py --out DIR --data cs/train.parquet \
        [--model builtin:smollm2-135m-instruct] [--prompts 4] [--n 8] [--max-tokens 48]

`DIR/trie_pass.json`: positions, nodes and median seconds of both calls, and each call's top ops
by self CPU time; `DIR/ops.txt` the two op tables. Run alone.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path


def trie_of(prompt: list[int], responses: list[list[int]], sampling):
    """The prompt's trie of its responses, nodes in insertion order (a parent before its
    children)."""
    from specrl.engines import TrieRequest

    children: list[dict[int, int]] = [{}]
    parents, tokens = [], []
    for response in responses:
        node = 0
        for token in response:
            if token not in children[node]:
                children.append({})
                parents.append(node)
                tokens.append(token)
                children[node][token] = len(children) - 1
            node = children[node][token]
    return TrieRequest(prompt, parents, tokens, sampling)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--model", default="builtin:smollm2-135m-instruct")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    import torch

    from specrl.config import load_config
    from specrl.data import load_prompts
    from specrl.engines import GenRequest, SamplingParams
    from specrl.engines.hf import HFEngine
    from specrl.models import eos_token_ids, load_policy, resolve_model_path

    torch.set_num_threads(args.threads)
    model, tokenizer = load_policy(resolve_model_path(args.model), "float32")
    engine = HFEngine(model.eval(), eos_token_ids(model, tokenizer), tokenizer.pad_token_id)
    cfg = load_config(None, [f"data.train_files={args.data}", f"data.val_files={args.data}"])
    train, _ = load_prompts(cfg.data, tokenizer, cfg.trainer.seed, log=lambda _: None)
    prompts = [list(p.ids) for p in train[: args.prompts]]  # as training feeds them
    sampling = SamplingParams(1.0)
    slots = [(k, s) for k in range(len(prompts)) for s in range(args.n)]
    sampled = engine.generate(
        [GenRequest(prompts[k], args.max_tokens, sampling, seed=1000 * k + s) for k, s in slots]
    )
    tries = [
        trie_of(p, [r.token_ids for r in sampled[k * args.n : (k + 1) * args.n]], sampling)
        for k, p in enumerate(prompts)
    ]

    def prefill():
        engine.generate([GenRequest(prompts[k], 1, sampling, seed=s) for k, s in slots])

    def trie_pass():
        engine.verify_tries(tries, engine.new_prefixes())

    args.out.mkdir(parents=True, exist_ok=True)
    result = {
        "command": " ".join(sys.argv),
        "load_average_at_start": os.getloadavg(),
        "prompt_positions": sum(len(p) for p in prompts),
        "trie_nodes": [len(t.tokens) for t in tries],
        "threads": args.threads,
    }
    tables = []
    for name, call in (("prefill", prefill), ("trie_pass", trie_pass)):
        call()
        seconds = []
        for _ in range(args.repeats):
            started = time.perf_counter()
            call()
            seconds.append(time.perf_counter() - started)
        with torch.profiler.profile() as profile:
            call()
        ops = sorted(profile.key_averages(), key=lambda e: -e.self_cpu_time_total)[:12]
        total = sum(e.self_cpu_time_total for e in profile.key_averages())
        result[name] = {
            "seconds": seconds,
            "median_s": statistics.median(seconds),
            "top_ops_self_cpu_share": {e.key: e.self_cpu_time_total / total for e in ops},
        }
        tables.append(f"{name}\n" + profile.key_averages().table(
            sort_by="self_cpu_time_total", row_limit=14
        ))  # fmt: skip
    result["load_average_at_end"] = os.getloadavg()
    (args.out / "trie_pass.json").write_text(json.dumps(result, indent=1))
    (args.out / "ops.txt").write_text("\n".join(tables))
    print(json.dumps({k: v for k, v in result.items() if k not in ("prefill", "trie_pass")}))
    for name in ("prefill", "trie_pass"):
        print(name, round(result[name]["median_s"], 3), "s")


if __name__ == "__main__":
    main()
