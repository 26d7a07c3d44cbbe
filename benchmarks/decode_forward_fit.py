"""Is a speculative arm's decode forward slower than vanilla's for the same work? A least-squares
fit, over every step of both arms of an interleaved bench, of a step's seconds per decode forward
against the positions and the draft positions a forward computed, with an offset for the
speculative arm:

    ms per forward = c0 + cp · positions per forward + cd · draft positions per forward
                     + offset · [speculative arm]

    python benchmarks/decode_forward_fit.py BENCH_DIR... [--arms vanilla,trie]

Prints the fitted terms with their standard errors per bench folder (each arm's metrics.jsonl).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np


def steps(path: Path) -> list[dict]:
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return [r for r in rows if "timing_s/rollout" in r and r.get("perf/decode/forwards")]


def fit(bench: Path, arms: list[str]) -> tuple[np.ndarray, np.ndarray, int]:
    x, y = [], []
    for speculative, arm in enumerate(arms):
        for r in steps(bench / arm / "metrics.jsonl"):
            n = r["perf/decode/forwards"]
            positions = r["perf/decode/computed_positions"] / n
            drafts = r.get("perf/decode/draft_positions", 0) / n
            x.append([1.0, positions, drafts, float(speculative)])
            y.append(1000 * r["timing_s/forward/decode"] / n)
    a, b = np.array(x), np.array(y)
    coef, *_ = np.linalg.lstsq(a, b, rcond=None)
    residual = b - a @ coef
    variance = (residual**2).sum() / (len(b) - a.shape[1])
    return coef, np.sqrt(variance * np.diag(np.linalg.pinv(a.T @ a))), len(b)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("benches", nargs="+", type=Path)
    parser.add_argument("--arms", default="vanilla,trie")
    args = parser.parse_args()
    arms = args.arms.split(",")
    print(
        "bench                                   steps   c0 ms    per position   per draft   offset ms"
    )
    for bench in args.benches:
        coef, se, n = fit(bench, arms)
        cells = "  ".join(f"{c:6.1f} ± {s:4.1f}" for c, s in zip(coef, se, strict=True))
        print(f"{bench.name:40s} {n:5d}  {cells}")


if __name__ == "__main__":
    main()
