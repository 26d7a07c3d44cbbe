"""A bench's cost model check again, with a fresh calibration, on its committed arms' metrics
(the code on PYTHONPATH calibrates): → the check as `bench.json` has it, with the load average
at the start and the seconds it took.

    python benchmarks/cpu-hf-smollm2-lora-calibration/recheck.py BENCH_DIR OUT.json
"""

import json
import os
import sys
import time
from pathlib import Path

import torch

from specrl import bench
from specrl.config import load_config
from specrl.models import resolve_model_path
from specrl.run_dir import read_metrics_jsonl


def main() -> None:
    source, out = Path(sys.argv[1]), Path(sys.argv[2])
    cfg = load_config(source / "vanilla" / "config.yaml")
    torch.set_num_threads(cfg.trainer.num_threads)
    model_dir = Path(resolve_model_path(cfg.model.path))
    runs = {
        arm: [read_metrics_jsonl(source / arm / "metrics.jsonl", print)]
        for arm in ("vanilla", "trie")
    }
    load, started = os.getloadavg(), time.time()
    check = bench._check_cost_model(cfg, runs, bench.policy_shape(model_dir), model_dir, 8)
    check["load_average_at_start"], check["seconds"] = load, time.time() - started
    out.write_text(json.dumps(check, indent=1) + "\n")
    for arm, figures in check["arms"].items():
        print(arm, figures["measured_s"], figures["predicted_s"], figures["residual"])


if __name__ == "__main__":
    main()
