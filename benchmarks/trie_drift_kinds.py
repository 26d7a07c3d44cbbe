"""The trie budget with one drift ρ for every move against one per kind of move
(`walkers.drift_bucket`): two trie arms of the built-in task in one process, taking turns step by
step (the first going first in odd steps), the same config, seed and data; arm `one` prices
every move with the pooled ρ (the budget before kinds), arm `kinds` as the code does.

    python benchmarks/trie_drift_kinds.py --out DIR [key=value ...]

Both arms' rollouts are the policy's samples (the exact rule), so they train alike. Per step
`results.json` gets each arm's rollout and verification seconds, nodes verified and stored,
reused and response tokens and decode forwards; the summary, over the steps after epoch 0, the
ratio of the arms' rollout seconds with the standard error of the mean log ratio of their paired
steps, and the drifts each kind had fitted at the end. Run alone.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
from pathlib import Path

import numpy as np

from specrl.bench import arm_config
from specrl.config import load_config
from specrl.speculative.reuse.budget import TrieBudget
from specrl.speculative.reuse.walkers import DRIFT_BUCKETS
from specrl.trainer import Trainer

KEYS = ("timing_s/rollout", "timing_s/verify", "spec/trie/nodes", "spec/trie/nodes_stored",
        "spec/reused_tokens", "spec/response_tokens", "perf/decode/forwards", "training/epoch")  # fmt: skip


class OneDrift(TrieBudget):
    """The budget with the pooled ρ for every kind of move."""

    @property
    def drifts(self) -> np.ndarray:
        return np.full(DRIFT_BUCKETS, self.drift)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("overrides", nargs="*", help="config key=value")
    args = parser.parse_args()
    cfg = load_config(
        None, [*args.overrides, "trainer.logger=[]", "trainer.save_freq=0", "trainer.test_freq=0"]
    )
    arms = {}
    for name in ("one", "kinds"):
        arms[name] = Trainer(arm_config(cfg, "trie", cfg.trainer.seed, args.out / name))
    budget = arms["one"].run.rollouts.stage.reuse.budget
    budget.__class__ = OneDrift
    total = cfg.trainer.total_training_steps or (
        arms["one"].run.loader.steps_per_epoch * cfg.trainer.total_epochs
    )
    result = {"command": " ".join(sys.argv), "load_average_at_start": os.getloadavg(), "steps": []}
    for step in range(1, total + 1):
        row = {}
        for name in ("one", "kinds") if step % 2 else ("kinds", "one"):
            arms[name].run.global_step = step
            metrics = arms[name].train_step()
            row[name] = {k: metrics.get(k, 0.0) for k in KEYS}
        result["steps"].append(row)
        print(step, {n: round(row[n]["timing_s/rollout"], 3) for n in row}, flush=True)
    later = [r for r in result["steps"] if r["one"]["training/epoch"] >= 1]
    logs = [math.log(r["one"]["timing_s/rollout"] / r["kinds"]["timing_s/rollout"]) for r in later]

    def total_of(name: str, key: str) -> float:
        return sum(r[name][key] for r in later)

    result["after_epoch0"] = {
        name: {
            "rollout_s": total_of(name, "timing_s/rollout"),
            "verify_s": total_of(name, "timing_s/verify"),
            "nodes_per_step": total_of(name, "spec/trie/nodes") / len(later),
            "nodes_stored_per_step": total_of(name, "spec/trie/nodes_stored") / len(later),
            "reused_token_ratio": total_of(name, "spec/reused_tokens")
            / total_of(name, "spec/response_tokens"),
            "decode_forwards": total_of(name, "perf/decode/forwards"),
            "drifts": arms[name].run.rollouts.stage.reuse.budget.drifts.tolist(),
        }
        for name in arms
    }
    result["one_over_kinds"] = total_of("one", "timing_s/rollout") / total_of(
        "kinds", "timing_s/rollout"
    )
    result["log_ratio_se"] = statistics.stdev(logs) / math.sqrt(len(logs))
    result["load_average_at_end"] = os.getloadavg()
    (args.out / "results.json").write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "steps"}, indent=1))


if __name__ == "__main__":
    main()
