"""The tolerance of the golden-rollout test, measured: every arm of tests/test_golden_rollouts.py
run under each CPU instruction set torch can be told to use (ATEN_CPU_CAPABILITY) and each
thread count, one subprocess per setting. Per arm and setting: the hashes of its four steps'
rollouts and the largest |rollout logprob - its recomputation by one full forward|.

    python benchmarks/golden_tolerance.py --out benchmarks/golden-logprob-tolerance

Writes results.json; run it alone (it times nothing, but four threads on two cores are slow).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]  # the tests package lives there
sys.path.insert(0, str(ROOT))
CAPABILITIES = ("default", "avx2", "avx512")
THREADS = (1, 2, 4)

ONE_SETTING = """
import json, sys, tempfile
from pathlib import Path
from tests.conftest import save_tiny_policy
from tests.test_golden_rollouts import ARMS, run_digests

threads = int(sys.argv[1])
root = Path(tempfile.mkdtemp())
policy = save_tiny_policy(root / "policy", initializer_range=0.5)
out = {arm: run_digests(policy, root / arm, overrides, threads) for arm, overrides in ARMS.items()}
print(json.dumps(out))
"""


def measure(capability: str, threads: int, cache: str) -> dict:
    env = {**os.environ, "ATEN_CPU_CAPABILITY": capability, "SPECRL_CACHE": cache}
    done = subprocess.run(
        [sys.executable, "-c", ONE_SETTING, str(threads)],
        env=env, capture_output=True, text=True, check=True, cwd=ROOT,
    )  # fmt: skip
    digests = json.loads(done.stdout.strip().splitlines()[-1])
    return {
        arm: {
            "hashes": "-".join(h for h, _ in steps),
            "max_logprob_error": max(e for _, e in steps),
        }
        for arm, steps in digests.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    from tests.test_golden_rollouts import GOLDEN, LOGPROB_ATOL

    load = os.getloadavg()
    cache = tempfile.mkdtemp()
    settings = []
    for capability in CAPABILITIES:
        for threads in THREADS:
            arms = measure(capability, threads, cache)
            settings.append({"capability": capability, "threads": threads, "arms": arms})
            worst = max(a["max_logprob_error"] for a in arms.values())
            same = all(a["hashes"] == GOLDEN[arm] for arm, a in arms.items())
            print(f"{capability:8} {threads} threads: max error {worst:.2e}, hashes golden: {same}")
    errors = [a["max_logprob_error"] for s in settings for a in s["arms"].values()]
    result = {
        "command": "python benchmarks/golden_tolerance.py --out " + str(args.out),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.processor() or ''}",
        "torch": torch.__version__,
        "cpu_capability_native": torch.backends.cpu.get_cpu_capability(),
        "load_average_at_start": load,
        "max_logprob_error": max(errors),
        "hashes_golden_everywhere": all(
            a["hashes"] == GOLDEN[arm] for s in settings for arm, a in s["arms"].items()
        ),
        "settings": settings,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(result, indent=1) + "\n")
    print(f"max error {max(errors):.2e} (tolerance {LOGPROB_ATOL:g}); {args.out / 'results.json'}")


if __name__ == "__main__":
    main()
