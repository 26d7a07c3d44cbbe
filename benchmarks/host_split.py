"""Where a bench arm's reuse steps spend their rollout seconds outside the model: per step the
forwards' seconds, the engine's own host work (its generate and verify calls less their
forwards) and the stage's (the rollout less the engine's calls), and, sampled by py-spy over the
steps of epoch 1, the Python function each host sample was in.

    python benchmarks/host_split.py --out DIR [--arm trie] [--steps 48] [--sample-steps 12]
        [key=value ...]

The arm (a bench arm name) trains on the built-in task (or the overrides' config) step by step;
from the first step of epoch 1 on, `py-spy record` (which must be on PATH) samples the process
at 200 Hz for `--sample-steps` steps' worth of time (the first reuse step's seconds times that
count). `DIR/steps.json` gets every step of epoch 1 on: its rollout, forward, engine-host and
stage-host seconds, decode and verify forwards, and their medians; `DIR/host.txt` the samples
taken inside the stage's rollout, split into the model's forwards and host work, the host
samples by the innermost specrl function (C code counts under its Python caller). Run alone.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def split(metrics: dict) -> dict:
    """A step's rollout seconds: in forwards, the engine's host work, the stage's."""
    kinds = ("prefill", "decode", "verify")
    forwards = sum(metrics.get(f"timing_s/forward/{kind}", 0.0) for kind in kinds)
    return {
        "step": metrics["training/global_step"],
        "rollout_s": metrics["timing_s/rollout"],
        "forwards_s": forwards,
        "engine_host_s": metrics["timing_s/engine"] - forwards,
        "stage_host_s": metrics["timing_s/rollout"] - metrics["timing_s/engine"],
        "decode_forwards": metrics.get("perf/decode/forwards", 0.0),
        "verify_forwards": metrics.get("perf/verify/forwards", 0.0),
    }


def host_table(raw: Path, top: int = 30) -> str:
    """py-spy's raw (collapsed) stacks → the rollout's samples: forwards, host, and the host
    samples by innermost specrl function."""
    rollout, forward, host = 0, 0, collections.Counter()
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        if not stack or not any(f.startswith("SpeculativeStage.rollout ") for f in frames):
            continue
        rollout += int(count)
        if any(f.startswith("HFEngine.forward ") for f in frames):
            forward += int(count)
            continue
        ours = [f for f in frames if "specrl/" in f]
        host[ours[-1].split(" (")[0] if ours else "?"] += int(count)
    lines = [
        f"samples in the stage's rollout: {rollout}",
        f"in the model's forwards: {forward} ({100 * forward / rollout:.1f}%)",
        f"host work: {rollout - forward} ({100 * (rollout - forward) / rollout:.1f}%), by function:",
    ]
    lines += [f"{n:6d} {100 * n / rollout:5.1f}%  {name}" for name, n in host.most_common(top)]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--arm", default="trie")
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--sample-steps", type=int, default=12)
    parser.add_argument("overrides", nargs="*", help="config key=value")
    args = parser.parse_args()
    from specrl.bench import arm_config
    from specrl.config import load_config
    from specrl.trainer import Trainer

    args.out.mkdir(parents=True, exist_ok=True)
    run_dir = Path(tempfile.mkdtemp())
    cfg = load_config(None, [*args.overrides, "trainer.logger=[]", "trainer.save_freq=0"])
    trainer = Trainer(arm_config(cfg, args.arm, cfg.trainer.seed, run_dir))
    raw = args.out / "py-spy.raw"
    rows, spy = [], None
    try:
        for step in range(1, args.steps + 1):
            trainer.run.global_step = step
            metrics = trainer.train_step()
            if metrics["training/epoch"] < 1:
                continue
            rows.append(split(metrics))
            print(json.dumps(rows[-1]), flush=True)
            if spy is None:
                seconds = round(metrics["timing_s/step"] * args.sample_steps)
                command = f"py-spy record --pid {os.getpid()} --rate 200 --duration {seconds}"
                spy = subprocess.Popen(
                    [*command.split(), "--format", "raw", "--nonblocking", "-o", str(raw)]
                )
    finally:
        trainer.run.rollouts.shutdown()
        trainer.run.lock.release()
    if spy is not None:
        spy.wait()
    medians = {k: statistics.median(r[k] for r in rows) for k in rows[0] if k != "step"}
    result = {
        "command": " ".join(sys.argv),
        "load_average_at_end": os.getloadavg(),
        "steps": rows,
        "median": medians,
    }
    (args.out / "steps.json").write_text(json.dumps(result, indent=1))
    if raw.exists():
        (args.out / "host.txt").write_text(host_table(raw))
        print((args.out / "host.txt").read_text())
    print("median", json.dumps(medians))


if __name__ == "__main__":
    main()
