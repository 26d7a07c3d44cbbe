"""A finished bench's per-window figures computed again from its arms' metrics.jsonl, as the
bench's code computes them now (`bench_summary._windows`): for benches committed before a figure
existed, such as the verification-free speedup and the reachable token ratio.

    python benchmarks/bench_windows.py BENCH_DIR [--window 8] [--out FILE]

Reads BENCH_DIR/ARM/metrics.jsonl (one seed); prints each speculative arm's windows, then the
whole run as one window, as `specrl bench` prints them; where bench.json has the cost model's
check of its machine, also the windows' rollouts priced by the work each arm counted on that
check's constants (`projection.priced_windows`); `--out` writes them as JSON.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from specrl.bench_summary import _train_steps, _windows, window_lines
from specrl.cost_model import ModelShape
from specrl.projection import checked_device, priced_window_lines, priced_windows, recorded_steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("bench", type=Path)
    parser.add_argument("--window", type=int, default=8)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    histories = {  # the arms; not the bench's untimed warm-up run (DIR/warmup)
        path.parent.name: [json.loads(line) for line in path.open() if line.strip()]
        for path in sorted(args.bench.glob("*/metrics.jsonl"))
        if path.parent.name != "warmup"
    }
    steps = {arm: _train_steps(history) for arm, history in histories.items()}
    if "vanilla" not in steps:
        raise SystemExit(f"{args.bench}: no vanilla/metrics.jsonl (a one-seed bench's folder)")
    vanilla = steps.pop("vanilla")
    arms = {
        arm: {
            "windows": _windows(mine, vanilla, args.window),
            "run": _windows(mine, vanilla, len(vanilla))[0],
        }
        for arm, mine in steps.items()
    }
    for line in window_lines(
        {"arms": {a: {"windows": [*w["windows"], w["run"]]} for a, w in arms.items()}}
    ):
        print(line)
    result = {"window": args.window, "arms": arms}
    bench = json.loads((args.bench / "bench.json").read_text())
    if "cost_model_check" in bench:
        priced = priced_windows(
            {arm: [recorded_steps(history)] for arm, history in histories.items()},
            ModelShape(**bench["model_shape"]),
            checked_device(bench["cost_model_check"]),
            args.window,
        )
        for line in priced_window_lines(priced):
            print(line)
        result["priced"] = priced
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
