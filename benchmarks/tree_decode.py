"""Rollout-stage benchmark of token-tree drafts with a fixed policy (no training in between).

The built-in policy rolls out the same prompts (32 × 8 slots, the quickstart's sampling) for
several rounds, once per arm, in turns (every other round in reverse order): vanilla, tree drafts
with the adaptive width, and tree drafts with a fixed width K, both with online trees. Round 0
has only the trees of finished sibling slots; later rounds also have the earlier rounds'
responses. Every arm samples the same tokens in exact arithmetic (drafts never change them; on a
real model in float32 a wider forward can flip a near-tie, docs/speculative.md, and
`identical_rollouts` says whether one did); only time and forwards differ. Writes
OUT/tree_decode.json and OUT/tree_decode.png.

    python benchmarks/tree_decode.py --out benchmarks/cpu-hf-tree-decode [KEY=VALUE ...]

KEY=VALUE overrides the run config (another model, data, sampling or lengths); `--no-online` keeps
each round's responses out of the trees until the round ends, as a speculative step's tails draft.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import torch
import transformers

from specrl.config import SpecConfig, TreeConfig, load_config
from specrl.plots import plot_metrics
from specrl.speculative.stage import SpeculativeStage
from specrl.trainer import Trainer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="tree-decode")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--fixed-k", type=int, default=8, help="0: no fixed-width arm")
    parser.add_argument("--online", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    args = parser.parse_args()
    out = Path(args.out)
    cfg = load_config(
        None,
        [
            f"trainer.output_dir={out / 'run'}",
            "trainer.logger=[]",
            "trainer.resume_mode=disable",
            *args.overrides,
        ],
    )
    trainer = Trainer(cfg)  # the built-in policy, tokenizer, data and engine
    prompts = trainer.run.loader.prompts[: args.prompts]
    R, n = cfg.data.max_response_length, cfg.rollout.n
    arms = {
        "vanilla": SpecConfig(enabled=False, tree=TreeConfig(enabled=False)),
        "tree (adaptive K)": SpecConfig(
            enabled=False, tree=TreeConfig(enabled=True, online=args.online)
        ),
    }
    if args.fixed_k:
        arms[f"tree (K = {args.fixed_k})"] = SpecConfig(
            enabled=False,
            tree=TreeConfig(
                enabled=True, online=args.online, adaptive=False, max_draft_tokens=args.fixed_k
            ),
        )
    stages = {
        name: SpeculativeStage(
            trainer.run.rollouts.engine, trainer.run.rollouts.stage.sampling, R, spec
        )
        for name, spec in arms.items()
    }
    load_average = os.getloadavg()
    histories: dict[str, list[dict[str, float]]] = {name: [] for name in arms}
    tokens: dict[str, list] = {}
    for round_ in range(args.rounds):
        # interleaved, every other round in reverse: every arm sees the same machine state
        order = list(stages.items())
        for name, stage in order if round_ % 2 == 0 else order[::-1]:
            start = time.perf_counter()
            rollouts, stats = stage(prompts, n, ("bench", round_), round_)
            metrics = {**stats.metrics(), "rollout_s": time.perf_counter() - start}
            metrics["training/global_step"] = round_
            histories[name].append(metrics)
            tokens.setdefault(round_, []).append([r.token_ids for r in rollouts])
            print(f"round {round_} {name}: {metrics['rollout_s']:.3f} s", flush=True)
    identical = all(all(t == ts[0] for t in ts) for ts in tokens.values())
    result = {
        "overrides": args.overrides,
        "online_trees": args.online,
        "load_average_at_start": load_average,
        "rounds": args.rounds,
        "prompts": len(prompts),
        "slots": n,
        "arms": {
            name: {
                "rollout_s": [m["rollout_s"] for m in h],
                "speedup_vs_vanilla": [
                    v["rollout_s"] / m["rollout_s"]
                    for v, m in zip(histories["vanilla"], h, strict=True)
                ],
                "tokens_per_forward": [
                    m.get("spec/decode_drafts/tokens_per_forward", 1.0) for m in h
                ],
                "acceptance_rate": [m.get("spec/decode_drafts/accept_rate", 0.0) for m in h],
                "mean_width": [m.get("spec/decode_drafts/mean_width", 0.0) for m in h],
                "decode_forwards": [m.get("perf/decode/forwards", 0.0) for m in h],
                "decode_computed_positions": [
                    m.get("perf/decode/computed_positions", 0.0) for m in h
                ],
            }
            for name, h in histories.items()
        },
        "cost_model_s": dict(
            zip(
                ("c0", "cs", "cd"),
                stages["tree (adaptive K)"].draft_width.cost() or (),
                strict=False,
            )
        ),
        "identical_rollouts": identical,  # drafts must never change the sampled tokens
        "engine": f"hf (transformers {transformers.__version__}, torch {torch.__version__})",
        "machine": f"{platform.machine()} {torch.get_num_threads()} threads",
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "tree_decode.json").write_text(json.dumps(result, indent=2))
    plot_metrics(
        histories,
        [
            ("rollout_s", "rollout time per round (s)"),
            ("spec/decode_drafts/tokens_per_forward", "tokens per sequence per decode forward"),
        ],
        out / "tree_decode.png",
    )
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
