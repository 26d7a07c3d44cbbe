"""Two versions of the code, each trained alone with the same config and seed, in pairs (A B A B
...): their reuse steps' per-step means side by side, as JSON and a plot of each run's rollout
seconds per step. For a change whose arms a bench cannot hold in one process (the same arm at two
commits).

    python benchmarks/runs_ab.py OUT RUN [RUN ...] [--after STEP]

Each RUN is a run directory (its metrics.jsonl) whose name starts with its version's label and a
dash (`old-...`, `new-...`); the pairs are the runs in the order given. `--after`: the first
step counted (default 34: the built-in task's epoch 1 after its first reuse step).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

KEYS = (
    "timing_s/rollout",
    "timing_s/gen",
    "timing_s/verify",
    "timing_s/forward/decode",
    "timing_s/forward/verify",
    "spec/trie/nodes",
    "spec/trie/nodes_stored",
    "spec/reused_token_ratio",
    "spec/decoded_tokens",
    "perf/decode/forwards",
    "perf/decode/computed_positions",
)


def steps(run: Path) -> list[dict[str, float]]:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return [m for line in lines if "timing_s/rollout" in (m := json.loads(line))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("runs", type=Path, nargs="+")
    parser.add_argument("--after", type=int, default=34)
    args = parser.parse_args()
    summary = []
    fig, ax = plt.subplots(figsize=(8, 4))
    for run in args.runs:
        history = steps(run)
        counted = [m for m in history if m["training/global_step"] >= args.after]
        means = {k: sum(m[k] for m in counted) / len(counted) for k in KEYS}
        summary.append({"run": run.name, "version": run.name.split("-")[0], "steps": len(counted),
                        "means": means})  # fmt: skip
        ax.plot([m["training/global_step"] for m in history],
                [m["timing_s/rollout"] for m in history], label=run.name, lw=0.8)  # fmt: skip
    pairs = [
        {"a": a["run"], "b": b["run"],
         "rollout_b_over_a": b["means"]["timing_s/rollout"] / a["means"]["timing_s/rollout"]}
        for a, b in zip(summary[::2], summary[1::2], strict=False)
    ]  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    result = {"from_step": args.after, "runs": summary, "pairs": pairs}
    (args.out / "runs_ab.json").write_text(json.dumps(result, indent=2))
    ax.set_xlabel("step")
    ax.set_ylabel("rollout seconds")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(args.out / "runs_ab.png", dpi=120)
    for run in summary:
        print(run["run"], " ".join(f"{k}={v:.4g}" for k, v in run["means"].items()))
    for pair in pairs:
        print(f"{pair['b']} / {pair['a']}: rollout {pair['rollout_b_over_a']:.3f}")


if __name__ == "__main__":
    main()
