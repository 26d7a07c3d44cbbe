"""Every seed's and arm's per-step figures of a multi-seed `specrl bench`, in one small file to
commit beside its bench.json (the run directories, with checkpoints, are not committed).

    python benchmarks/per_seed_steps.py BENCH_OUT benchmarks/FOLDER/per_seed_steps.json

Reads BENCH_OUT/seedN/ARM/metrics.jsonl; writes {"keys": [...], "runs": {"seedN/ARM": [row per
logged step, only the keys it has]}}: rollout and step seconds, reuse, trie nodes verified,
response length, score and held-out accuracy.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

KEYS = [
    "training/global_step", "training/epoch", "timing_s/rollout", "timing_s/step",
    "spec/reused_token_ratio", "spec/trie/nodes", "response_length/mean", "critic/score/mean",
    "val/acc/mean@1",
]  # fmt: skip


def main() -> None:
    bench, out = Path(sys.argv[1]), Path(sys.argv[2])
    runs = {}
    for metrics in sorted(bench.glob("seed*/*/metrics.jsonl")):
        rows = [json.loads(line) for line in metrics.read_text().splitlines() if line]
        name = f"{metrics.parent.parent.name}/{metrics.parent.name}"
        runs[name] = [{k: row[k] for k in KEYS if k in row} for row in rows]
    out.write_text(json.dumps({"keys": KEYS, "runs": runs}, separators=(",", ":")))


if __name__ == "__main__":
    main()
