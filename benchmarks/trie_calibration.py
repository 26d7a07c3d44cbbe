"""How well the trie budget predicts where the walks go, step by step in one trie run: the
expected walkers at every stored node (`expected_walkers`, what the budget chooses by) against
the walkers that reached it in hindsight (the responses' paths through the trie as the step
found it: a walk of the whole trie), at the budget's fitted sharpening δ and at δ = 0 (the
intervals as held, the same step's state otherwise).

    python benchmarks/trie_calibration.py --out DIR [--steps 34] [key=value ...]

Per step `calibration.json` gets δ, σ and ρ as fitted, the predicted walkers summed over the
stored nodes at both δ, the realised ones, and what each choice is worth at the step's prices:
the nodes whose predicted walkers pay for their position (reach · c_token > c_node), and the
seconds they save, Σ (realised walkers · c_token − c_node) over them, against the best choice
in hindsight (every node whose realised walkers pay). A pass's own costs (c0, its prompts) are
left out: this scores the choice of nodes, not the decision to pass. The run's rollouts are the
policy's samples whatever is chosen (the exact rule), so the realised walkers are the same at
both δ. Timing is not measured: the costs are the budget's fits, and the load does not move
the figures beyond those fits.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from specrl.bench import arm_config
from specrl.config import load_config
from specrl.speculative.reuse.budget import TrieBudget
from specrl.speculative.reuse.trie import TrieReuse
from specrl.speculative.reuse.walkers import expected_walkers
from specrl.trainer import Trainer


class Recorder:
    """The budget's view of each step (its tries, walkers and fits as it chose) and, after
    decoding, what the responses reached."""

    def __init__(self) -> None:
        self.steps: list[dict] = []
        self.pending: dict = {}

    def selected(self, budget: TrieBudget, trees, walkers, uniforms) -> None:
        fitted = budget.sharpening
        self.pending = {
            "trees": [(tree, len(tree.count)) for tree in trees],
            "predicted": expected_walkers(
                trees, walkers, uniforms, budget.drifts, budget.shift, fitted
            ),
            "held": expected_walkers(trees, walkers, uniforms, budget.drifts, budget.shift),
            "sharpening": fitted,
            "shift": budget.shift,
            "drift": budget.drift,
            "node_cost": budget.node_cost,
            "token_cost": budget.hindsight_token_cost,
        }

    def decoded(self, order: list[str], slots, responses) -> None:
        pending, self.pending = self.pending, {}
        if not pending:
            return
        row = {k: pending[k] for k in ("sharpening", "shift", "drift")}
        realised = []
        for prompt_id, (tree, size) in zip(order, pending["trees"], strict=True):
            paths = [r for s, r in zip(slots, responses, strict=True) if s == prompt_id]
            realised.append(walked_nodes(tree, size, paths))
        row["realised"] = float(sum(r.sum() for r in realised))
        for name in ("predicted", "held"):
            reach = pending[name]
            row[name] = float(sum(r.sum() for r in reach))
            row[f"{name}_choice"] = choice_value(reach, realised, pending)
        row["best_choice"] = choice_value(realised, realised, pending)
        self.steps.append(row)


def walked_nodes(tree, size: int, responses) -> np.ndarray:
    """Walkers that reached each of the first `size` nodes of `tree`: the responses' paths."""
    reached = np.zeros(size)
    for response in responses:
        node = 0
        for token in response:
            child = tree.children[node].get(token)
            if child is None or child >= size:
                break
            reached[child] += 1
            node = child
    return reached


def choice_value(reach, realised, pending) -> dict | None:
    """The nodes whose `reach` pays at the step's prices, and the seconds their realised walkers
    save beyond their positions (None: the prices not fitted yet)."""
    node_cost, token_cost = pending["node_cost"], pending["token_cost"]
    if node_cost is None or token_cost is None:
        return None
    nodes = saving = 0.0
    for predicted, walked in zip(reach, realised, strict=True):
        chosen = predicted * token_cost > node_cost
        nodes += chosen.sum()
        saving += (walked[chosen] * token_cost - node_cost).sum()
    return {"nodes": int(nodes), "saving_s": float(saving)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=34)
    parser.add_argument("overrides", nargs="*", help="config key=value")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    recorder = Recorder()
    select_all, before, after = (
        TrieBudget.select_all,
        TrieReuse.before_decoding,
        TrieReuse.after_decoding,
    )

    def recording_select(self, trees, walkers, uniforms):
        recorder.selected(self, trees, walkers, uniforms)
        return select_all(self, trees, walkers, uniforms)

    def recording_before(self, slots, *rest):
        recorder.pending = {}
        return before(self, slots, *rest)

    def recording_after(self, slots, results, stats):
        order = list(self._snapshots)  # the prompts with tries, in the order the budget saw them
        responses = [
            [*s.kept, *(results[i].token_ids if i in results else ())] for i, s in enumerate(slots)
        ]
        recorder.decoded(order, [s.prompt.prompt_id for s in slots], responses)
        return after(self, slots, results, stats)

    TrieBudget.select_all = recording_select
    TrieReuse.before_decoding = recording_before
    TrieReuse.after_decoding = recording_after
    overrides = [*args.overrides, "trainer.logger=[]", "trainer.save_freq=0", "trainer.test_freq=0",
                 f"trainer.total_training_steps={args.steps}"]  # fmt: skip
    cfg = load_config(None, overrides)
    trainer = Trainer(arm_config(cfg, "trie", cfg.trainer.seed, args.out))
    rows = []
    try:
        for step in range(1, args.steps + 1):
            trainer.run.global_step = step
            metrics = trainer.train_step()
            walked = recorder.steps.pop() if recorder.steps else {}  # one stage call a step
            rows.append({"step": step, "entropy": metrics.get("actor/entropy"),
                         "reused_tokens": metrics.get("spec/reused_tokens"), **walked})  # fmt: skip
            print(json.dumps(rows[-1]), flush=True)
            (args.out / "calibration.json").write_text(json.dumps(rows, indent=1))
    finally:
        trainer.run.rollouts.shutdown()
        trainer.run.lock.release()


if __name__ == "__main__":
    main()
