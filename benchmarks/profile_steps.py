"""Where a training step's time goes, by op: `torch.profiler` over chosen steps of a vanilla run
and of a trie run (issue: plain decode forwards on an H100 took 8 ms in epoch 0 and 31-44 ms
after it, with no speculation involved).

    python benchmarks/profile_steps.py --out DIR [--steps 1,3] [--device cuda] [key=value ...]

Each arm (`--arms`, default vanilla,trie) trains from the same policy, seed and data, step by
step; the steps named by `--steps` (default: the first of epoch 0 and the first of epoch 1, so
the vanilla arm's two are the same work before and after an epoch boundary, and the trie arm's
second is a reuse step) run under the profiler with CPU activities, CUDA ones where there is a
GPU, and shapes recorded. Per profiled step `profile.json` gets the step's own timings, the top
ops by self CPU time and by self device time, the host-device syncs (`aten::item`,
`aten::_local_scalar_dense`, `aten::nonzero`, `cudaStreamSynchronize`, `cudaDeviceSynchronize`:
calls and seconds) and the allocator's calls (`cudaMalloc`, `cudaFree`); `ARM-stepN.txt` is the
profiler's own table. The steps before are run unprofiled. Run alone.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

ARMS = {  # the bench's arms of the same names
    "vanilla": ["rollout.spec.enabled=false"],
    "trie": [
        "rollout.spec.enabled=true",
        "rollout.spec.acceptance=exact",
        "rollout.spec.reuse=trie",
    ],
}
SYNCS = (
    "aten::item",
    "aten::_local_scalar_dense",
    "aten::nonzero",
    "cudaStreamSynchronize",
    "cudaDeviceSynchronize",
)
ALLOCATOR = ("cudaMalloc", "cudaFree")
STEP_KEYS = ("timing_s/step", "timing_s/rollout", "timing_s/gen", "timing_s/verify",
             "timing_s/update_actor", "perf/decode/forwards", "perf/decode/seconds")  # fmt: skip


def summarize(prof, top: int = 15) -> dict:
    """The profile's top ops by self CPU and self device time, its syncs and allocator calls."""
    events = prof.key_averages()

    def device_us(e) -> float:
        return getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0.0))

    def row(e) -> dict:
        return {"op": e.key, "calls": e.count, "self_cpu_ms": e.self_cpu_time_total / 1e3,
                "self_device_ms": device_us(e) / 1e3}  # fmt: skip

    by_name = {e.key: e for e in events}
    return {
        "self_cpu_ms": sum(e.self_cpu_time_total for e in events) / 1e3,
        "self_device_ms": sum(device_us(e) for e in events) / 1e3,
        "top_cpu": [row(e) for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[:top]],
        "top_device": [row(e) for e in sorted(events, key=lambda e: -device_us(e))[:top]],
        "syncs": {k: row(by_name[k]) for k in SYNCS if k in by_name},
        "allocator": {k: row(by_name[k]) for k in ALLOCATOR if k in by_name},
    }


def profile_arm(arm: str, overrides: list[str], steps: list[int] | None, out: Path) -> dict:
    """The arm's run, its `steps` profiled (None: the first of epochs 0 and 1)."""
    from specrl.config import load_config
    from specrl.trainer import Trainer

    cfg = load_config(
        None,
        [*overrides, *ARMS[arm], f"trainer.output_dir={out / arm}", "trainer.logger=[]",
         "trainer.resume_mode=disable", "trainer.save_freq=0"],
    )  # fmt: skip
    trainer = Trainer(cfg)
    steps = steps or [1, trainer.run.loader.steps_per_epoch + 1]
    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    result = {}
    try:
        for step in range(1, max(steps) + 1):
            trainer.run.global_step = step
            if step not in steps:
                trainer.train_step()
                continue
            with profile(activities=activities, record_shapes=True) as prof:
                metrics = trainer.train_step()
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
            sort = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
            table = prof.key_averages(group_by_input_shape=True).table(sort_by=sort, row_limit=40)
            (out / f"{arm}-step{step}.txt").write_text(table)
            result[f"step{step}"] = {
                "epoch": metrics["training/epoch"],
                "metrics": {k: metrics[k] for k in STEP_KEYS if k in metrics},
                **summarize(prof),
            }
            print(f"{arm} step {step}: {metrics['timing_s/step']:.2f} s", flush=True)
    finally:
        trainer.run.rollouts.shutdown()
        trainer.run.lock.release()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--arms", default="vanilla,trie")
    parser.add_argument(
        "--steps", help="steps to profile, e.g. 1,3 (default: the first of epochs 0 and 1)"
    )
    parser.add_argument("overrides", nargs="*", help="config key=value")
    args = parser.parse_args()
    steps = [int(s) for s in args.steps.split(",")] if args.steps else None
    args.out.mkdir(parents=True, exist_ok=True)
    result = {
        "command": " ".join(sys.argv),
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "load_average_at_start": os.getloadavg(),
        "arms": {
            arm: profile_arm(arm, args.overrides, steps, args.out) for arm in args.arms.split(",")
        },
        "load_average_at_end": os.getloadavg(),
    }
    (args.out / "profile.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
