"""Where a rollout step's time goes, part by part, and how few trie nodes its walks needed.

    python benchmarks/trie_step_parts.py --out OUT [--arms vanilla,trie] [--steps 48]
        [key=value ...]

Each arm (the bench's arm names) trains alone from the same policy, seed and data for `--steps`
steps, one arm after the other. In every step the wall time of each part of the rollout stage
below is summed (inclusive: a part's time holds the parts under it), and the forwards are
split by kind (the engine's `forward`, the model call alone); the rest of a stage call is host
work. For arms that walk history tries, each prompt's walks give the union of the nodes their
reused tokens passed: the fewest nodes any selection could have verified and still reused every
token those walks reused (a walk moves only through verified nodes, and the distribution after
the node where it leaves is that node's own), set against the nodes the budget verified.
`OUT/parts.json` holds per arm and step the parts' seconds and calls, the walks' union and the
nodes verified, and the means over epoch 0 and over the steps after the first reuse step;
the table printed is those means. Run alone: every figure is wall time.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

# (module, attribute path): each part timed, in the order of the table
PARTS = (
    ("specrl.speculative.stage", "SpeculativeStage.rollout"),
    ("specrl.speculative.reuse.trie", "TrieReuse.before_decoding"),
    ("specrl.speculative.reuse.budget", "TrieBudget.select_all"),
    ("specrl.engines.hf.engine", "HFEngine.verify_tries"),
    ("specrl.engines.hf.engine", "tree_inputs"),
    ("specrl.engines.hf.engine", "trie_logprobs"),
    ("specrl.engines.hf.prefix_cache", "PrefixCache.add_tries"),
    ("specrl.speculative.reuse.trie", "walk_trie"),
    ("specrl.speculative.reuse.trie", "drawn_shifts"),
    ("specrl.engines.hf.decode", "Decoder.decode"),
    ("specrl.engines.hf.decode", "Decoder._prefill"),
    ("specrl.engines.hf.decode", "Decoder._first_tokens"),
    ("specrl.engines.hf.batch", "DecodeBatch.start"),
    ("specrl.engines.hf.batch", "DecodeBatch.feed"),
    ("specrl.engines.hf.decode", "Decoder._drafts"),
    ("specrl.engines.hf.decode", "Decoder._sample"),
    ("specrl.engines.hf.batch", "DecodeBatch.advance"),
    ("specrl.speculative.reuse.trie", "TrieReuse.after_decoding"),
    ("specrl.speculative.reuse.trie", "reachable"),
    ("specrl.speculative.token_trees", "TokenTree.close_round"),
)
FORWARD = ("specrl.engines.hf.engine", "HFEngine.forward")


class Parts:
    """Seconds and calls of each part, and the forwards' by kind, counted inside stage calls."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.walked = 0  # nodes the walks' reused tokens passed, per prompt, summed
        self.inside = False
        for module, path in (*PARTS, FORWARD):
            self._wrap(module, path)

    def reset(self) -> dict:
        step = {
            "seconds": dict(self.seconds),
            "calls": dict(self.calls),
            "walked_nodes": self.walked,
        }
        self.seconds, self.calls, self.walked = defaultdict(float), defaultdict(int), 0
        return step

    def _wrap(self, module: str, path: str) -> None:
        owner_name, _, name = path.rpartition(".")
        owner = importlib.import_module(module)
        if owner_name:
            owner = getattr(owner, owner_name)
        original = getattr(owner, name)
        parts = self

        @functools.wraps(original)
        def timed(*args, **kwargs):
            outer = path == "SpeculativeStage.rollout" and not parts.inside
            if outer:
                parts.inside = True
            started = time.perf_counter()
            try:
                result = original(*args, **kwargs)
            finally:
                if outer:
                    parts.inside = False
                if parts.inside or outer:
                    key = f"forward:{args[1]}" if (module, path) == FORWARD else path
                    parts.seconds[key] += time.perf_counter() - started
                    parts.calls[key] += 1
            if name == "walk_trie" and parts.inside:
                parts.walked += len({tuple(w.tokens[:i]) for w in result
                                     for i in range(1, len(w.tokens) + 1)})  # fmt: skip
            return result

        setattr(owner, name, timed)


def run_arm(arm: str, overrides: list[str], steps: int, out: Path, parts: Parts) -> dict:
    from specrl.bench import arm_config
    from specrl.config import load_config
    from specrl.trainer import Trainer

    cfg = load_config(None, [*overrides, "trainer.logger=[]", "trainer.save_freq=0"])
    trainer = Trainer(arm_config(cfg, arm, cfg.trainer.seed, out))
    per_epoch = trainer.run.loader.steps_per_epoch
    records = []
    try:
        for step in range(1, steps + 1):
            trainer.run.global_step = step
            parts.reset()
            metrics = trainer.train_step()
            record = {"step": step, "epoch": metrics["training/epoch"], **parts.reset()}
            record["nodes_verified"] = metrics.get("spec/trie/nodes", 0.0)
            records.append(record)
            print(f"{arm} step {step}: rollout {metrics['timing_s/rollout']:.3f} s", flush=True)
    finally:
        trainer.run.rollouts.shutdown()
        trainer.run.lock.release()
    return {
        "steps": records,
        "epoch0": means([r for r in records if r["step"] <= per_epoch]),
        "reuse_steps": means([r for r in records if r["step"] > per_epoch + 1]),
    }


def means(records: list[dict]) -> dict:
    """Per-step means of the parts' seconds and calls, the host work (a stage call less its
    forwards), the walks' union and the nodes verified."""
    if not records:
        return {}
    n = len(records)
    keys = {k for r in records for k in r["seconds"]}
    seconds = {k: sum(r["seconds"].get(k, 0.0) for r in records) / n for k in keys}
    calls = {k: sum(r["calls"].get(k, 0) for r in records) / n for k in keys}
    forwards = sum(v for k, v in seconds.items() if k.startswith("forward:"))
    return {
        "steps": [records[0]["step"], records[-1]["step"]],
        "seconds": seconds,
        "calls": calls,
        "forwards_s": forwards,
        "host_s": seconds.get("SpeculativeStage.rollout", 0.0) - forwards,
        "walked_nodes": sum(r["walked_nodes"] for r in records) / n,
        "nodes_verified": sum(r["nodes_verified"] for r in records) / n,
    }


def table(result: dict) -> str:
    """The arms' means after the first reuse step: ms a step (calls a step) of each part."""
    arms = {arm: r["reuse_steps"] for arm, r in result["arms"].items()}
    forwards = sorted({k for m in arms.values() for k in m.get("seconds", {}) if "forward:" in k})
    lines = ["ms a step (calls), after the first reuse step".ljust(48)
             + "".join(arm.rjust(22) for arm in arms)]  # fmt: skip
    for part in [p for _, p in PARTS] + forwards:
        cells = [
            f"{1e3 * m['seconds'][part]:9.1f} ({m['calls'][part]:6.1f})"
            if part in m.get("seconds", {}) else ""
            for m in arms.values()
        ]  # fmt: skip
        if any(cells):
            lines.append(part.ljust(48) + "".join(c.rjust(22) for c in cells))
    for key, scale in (
        ("forwards_s", 1e3),
        ("host_s", 1e3),
        ("walked_nodes", 1),
        ("nodes_verified", 1),
    ):
        cells = [f"{scale * m.get(key, 0.0):9.1f}".ljust(18).rjust(22) for m in arms.values()]
        lines.append(key.ljust(48) + "".join(cells))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--arms", default="vanilla,trie")
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("overrides", nargs="*", help="config key=value")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    parts = Parts()
    result = {
        "command": " ".join(sys.argv),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "load_average_at_start": os.getloadavg(),
        "arms": {
            arm: run_arm(arm, args.overrides, args.steps, args.out, parts)
            for arm in args.arms.split(",")
        },
        "load_average_at_end": os.getloadavg(),
    }
    (args.out / "parts.json").write_text(json.dumps(result, indent=1))
    print(table(result))


if __name__ == "__main__":
    main()
