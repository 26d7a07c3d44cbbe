"""What tail drafts cost the trie arm where they are rarely accepted: a vanilla stage, a trie
stage with token-tree drafts (`rollout.spec.tree.enabled=auto`, the trie arm's default) and a
trie stage without them take turns on one engine, at fixed weights, over the built-in task's
prompts (4 prompts x 2 slots per call, the default response length).

    python benchmarks/draft_host_cost.py --policy DIR [--calls 60] [--out FILE]

DIR is a built policy (`specrl toy-policy --hidden-size 32 --layers 1 --heads 2 --sft-steps 20`
prints it: the GPU bench's dry-run policy, which has hardly learned the task, so few drafts are
accepted and forwards take about 2 ms). Each call's prompts come round every 8 calls, so tries
and trees hold the stage's own earlier responses. Per stage, over the calls after the first 8:
rollout seconds, the engine's decode forward seconds, forwards and positions computed, and the
host seconds (rollout less forwards). Run alone, with one torch thread.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics

import torch

from specrl.config import SpecConfig, load_config
from specrl.config.rollout import TreeConfig
from specrl.data import load_prompts
from specrl.engines import SamplingParams
from specrl.engines.hf import HFEngine
from specrl.models import eos_token_ids, load_policy
from specrl.speculative.stage import SpeculativeStage

TRIE = {"enabled": True, "acceptance": "exact", "reuse": "trie", "verify_mode": "full"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--policy", required=True)
    parser.add_argument("--calls", type=int, default=60)
    parser.add_argument("--out")
    args = parser.parse_args()
    torch.set_num_threads(1)
    cfg = load_config(None, [f"model.path={args.policy}", "data.train_size=32", "data.val_size=8"])
    policy, tokenizer = load_policy(args.policy, "float32")
    prompts = load_prompts(cfg.data, tokenizer, 1, print)[0][:32]
    engine = HFEngine(policy.eval(), eos_token_ids(policy, tokenizer), tokenizer.pad_token_id)
    sampling, length = SamplingParams(1.0), cfg.data.max_response_length
    configs = {
        "vanilla": SpecConfig(enabled=False),
        "trie": SpecConfig(**TRIE),
        "trie-without-tree-drafts": SpecConfig(**TRIE, tree=TreeConfig(enabled=False)),
    }
    stages = {name: SpeculativeStage(engine, sampling, length, c) for name, c in configs.items()}
    calls: dict[str, list[dict[str, float]]] = {name: [] for name in stages}
    for call in range(args.calls):
        batch = prompts[(call % 8) * 4 : (call % 8) * 4 + 4]
        order = list(stages) if call % 2 == 0 else list(stages)[::-1]
        for name in order:
            before = copy.copy(engine.counts)
            _, stats = stages[name](batch, 2, (1, call, 0), call)
            after = engine.counts
            forwards_s = sum(
                getattr(after, f"{k}_seconds") - getattr(before, f"{k}_seconds")
                for k in ("prefill", "decode", "verify")
            )
            calls[name].append({
                "rollout_s": stats.rollout_s,
                "decode_forward_s": after.decode_seconds - before.decode_seconds,
                "host_s": stats.rollout_s - forwards_s,
                "decode_forwards": after.decode_forwards - before.decode_forwards,
                "decode_computed_positions": (
                    after.decode_computed_positions - before.decode_computed_positions
                ),
                "reused_tokens": stats.reused_tokens,
            })  # fmt: skip
    summary = {}
    for name, rows in calls.items():
        rows = rows[8:]
        summary[name] = {key: sum(r[key] for r in rows) for key in rows[0]}
        summary[name]["median_rollout_ms"] = 1000 * statistics.median(r["rollout_s"] for r in rows)
    vanilla = summary["vanilla"]["rollout_s"]
    for name, s in summary.items():
        s["rollout_over_vanilla"] = s["rollout_s"] / vanilla
        print(
            f"{name:25} rollout {s['rollout_s']:.3f} s ({s['rollout_over_vanilla']:.2f}x vanilla's"
            f" time), decode forwards {s['decode_forward_s']:.3f} s over {s['decode_forwards']:.0f}"
            f" ({s['decode_computed_positions']:.0f} positions), host {s['host_s']:.3f} s"
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"calls": args.calls, "summary": summary, "per_call": calls}, f, indent=1)


if __name__ == "__main__":
    main()
