"""A `specrl train` run with CUDA graphs emulated on the CPU and each capture taking `--capture-s`
seconds more, as on a GPU (27-50 ms an H200 capture, benchmarks/gpu-h200-hf-captures-315af38),
so that what the fitted costs make of captures shows here: per step the captures, decode
forwards, mean draft width, trie nodes verified, reuse and the fitted costs of the trie budget.

    python benchmarks/capture_costs.py --out DIR [--capture-s 0.05] [CONFIG OVERRIDES...]

Graphs are emulated as in benchmarks/graph_captures.py (tests/engines/graphs.py); the run
decodes with `rollout.static_decode=true` and logs to DIR/metrics.jsonl; DIR/steps.json gets
the per-step figures printed. Run alone.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from specrl.cli import main as specrl_main
from specrl.engines.hf.static_decode import Arena

ROOT = Path(__file__).resolve().parents[1]  # the tests package lives there
sys.path.insert(0, str(ROOT))

FIGURES = {
    "rollout_s": "timing_s/rollout",
    "captures": "perf/decode/captures",
    "capture_s": "timing_s/capture/decode",
    "decode_forwards": "perf/decode/forwards",
    "mean_draft_width": "spec/decode_drafts/mean_width",
    "trie_nodes": "spec/trie/nodes",
    "trie_nodes_stored": "spec/trie/nodes_stored",
    "trie_prompts_skipped": "spec/trie/prompts_skipped",
    "reused_token_ratio": "spec/reused_token_ratio",
    "forward_cost_s": "timing_s/trie_forward_cost",
    "token_cost_s": "timing_s/trie_token_cost",
    "node_cost_s": "timing_s/trie_node_cost",
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--capture-s", type=float, default=0.05)
    args, overrides = parser.parse_known_args()
    from tests.engines.graphs import emulate_graphs

    emulate_graphs(setattr)
    capture = Arena.capture

    def slow_capture(self, model, shape):
        time.sleep(args.capture_s)
        return capture(self, model, shape)

    Arena.capture = slow_capture
    load = os.getloadavg()
    specrl_main(
        ["train", "rollout.static_decode=true", f"trainer.output_dir={args.out}",
         "trainer.logger=[jsonl]", *overrides]
    )  # fmt: skip
    steps = []
    for line in (args.out / "metrics.jsonl").open():
        metrics = json.loads(line)
        if "timing_s/rollout" in metrics:
            step = {"step": metrics["training/global_step"]}
            steps.append(step | {k: metrics.get(name, 0.0) for k, name in FIGURES.items()})
            print(" ".join(f"{k} {v:.4g}" for k, v in steps[-1].items()))
    result = {"command": " ".join(sys.argv), "load_average_at_start": load, "steps": steps}
    (args.out / "steps.json").write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
