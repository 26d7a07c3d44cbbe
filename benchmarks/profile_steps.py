"""Where a training step's time goes, by op and by Python function: `torch.profiler` and
`cProfile` over chosen steps of bench arms (issue: plain decode forwards on an H100 took 8 ms in
epoch 0 and 31-44 ms after it, with no speculation involved; reuse steps' forwards 45-150 ms).

    python benchmarks/profile_steps.py --out DIR [--arms vanilla,trie] [--steps 1,5]
        [--python-steps 6] [key=value ...]

Each arm (`--arms`: the bench's arm names, default vanilla,trie) trains from the same policy,
seed and data, step by step; the steps named by `--steps` (default: the first of epoch 0 and the
first of epoch 1, so the vanilla arm's two are the same work before and after an epoch boundary,
and the trie arm's second is a reuse step) run under the profiler with CPU activities, CUDA ones
where there is a GPU, and shapes recorded. Per profiled step `profile.json` gets the step's own
timings, the top ops by self CPU time and by self device time, the host-device syncs
(`aten::item`, `aten::_local_scalar_dense`, `aten::nonzero`, `cudaStreamSynchronize`,
`cudaDeviceSynchronize`: calls and seconds) and the allocator's calls (`cudaMalloc`, `cudaFree`);
`ARM-stepN.txt` holds the profiler's tables (by device time, then by CPU time). The steps of
`--python-steps` run under `cProfile` instead: `ARM-stepN-python.txt` lists the Python functions
by own and by cumulative time. Every step, profiled or not, gets its timings, the seconds the
garbage collector paused it, and the CUDA allocator's counts (device allocations and frees,
retries) in `profile.json`'s `steps`. Run alone.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import gc
import io
import json
import os
import pstats
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

SYNCS = (
    "aten::item",
    "aten::_local_scalar_dense",
    "aten::nonzero",
    "cudaStreamSynchronize",
    "cudaDeviceSynchronize",
)
ALLOCATOR = ("cudaMalloc", "cudaFree")
STEP_KEYS = ("timing_s/step", "timing_s/rollout", "timing_s/gen", "timing_s/verify",
             "timing_s/update_actor", "perf/decode/forwards", "perf/decode/seconds",
             "perf/prefill/forwards", "perf/prefill/seconds", "perf/verify/forwards",
             "perf/verify/seconds", "spec/reused_token_ratio")  # fmt: skip


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


class GCPauses:
    """Seconds the garbage collector held the process, and its collections, since `reset`."""

    def __init__(self) -> None:
        self.seconds, self.collections, self._started = 0.0, 0, 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._started
            self.collections += 1

    def reset(self) -> dict:
        counts = {"gc_pause_s": self.seconds, "gc_collections": self.collections}
        self.seconds, self.collections = 0.0, 0
        return counts

    def close(self) -> None:
        gc.callbacks.remove(self._callback)


def allocator_counts() -> dict:
    """The CUDA caching allocator's device allocations, frees and retries so far (none on CPU)."""
    if not torch.cuda.is_available():
        return {}
    stats = torch.cuda.memory_stats()
    keys = ("num_device_alloc", "num_device_free", "num_alloc_retries")
    return {k: stats.get(k, 0) for k in keys} | {
        "reserved_mb": stats.get("reserved_bytes.all.current", 0) / 2**20
    }


def python_profile(profiler: cProfile.Profile, top: int = 40) -> str:
    """The Python functions of a step by own time, then by cumulative time."""
    text = io.StringIO()
    for key in ("tottime", "cumulative"):
        pstats.Stats(profiler, stream=text).sort_stats(key).print_stats(top)
    return text.getvalue()


def profile_arm(
    arm: str, overrides: list[str], steps: list[int] | None, python_steps: list[int], out: Path
) -> dict:
    """The arm's run, its `steps` profiled (None: the first of epochs 0 and 1), its
    `python_steps` under cProfile."""
    from specrl.bench import arm_config
    from specrl.config import load_config
    from specrl.trainer import Trainer

    cfg = load_config(None, [*overrides, "trainer.logger=[]", "trainer.save_freq=0"])
    trainer = Trainer(arm_config(cfg, arm, cfg.trainer.seed, out))
    steps = steps or [1, trainer.run.loader.steps_per_epoch + 1]
    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    name = arm.replace("+", "-")
    result: dict = {"steps": []}
    pauses = GCPauses()
    try:
        for step in range(1, max([*steps, *python_steps]) + 1):
            trainer.run.global_step = step
            before = allocator_counts()
            pauses.reset()
            if step in steps:
                watch = profile(activities=activities, record_shapes=True)
            elif step in python_steps:
                watch = cProfile.Profile()
            else:
                watch = contextlib.nullcontext()
            with watch:
                metrics = trainer.train_step()
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
            paused = pauses.reset()
            if step in steps:
                tables = [
                    watch.key_averages(group_by_input_shape=True).table(sort_by=key, row_limit=40)
                    for key in ("self_cuda_time_total", "self_cpu_time_total")
                    if key != "self_cuda_time_total" or torch.cuda.is_available()
                ]
                (out / f"{name}-step{step}.txt").write_text("\n\n".join(tables))
                result[f"step{step}"] = summarize(watch)
            elif step in python_steps:
                (out / f"{name}-step{step}-python.txt").write_text(python_profile(watch))
            after = allocator_counts()
            result["steps"].append({
                "step": step,
                "epoch": metrics["training/epoch"],
                "profiled": "torch" if step in steps else "python" if step in python_steps else None,
                **{k: metrics[k] for k in STEP_KEYS if k in metrics},
                **paused,
                **{k: after[k] - before.get(k, 0) if k != "reserved_mb" else after[k]
                   for k in after},
            })  # fmt: skip
            print(f"{arm} step {step}: {metrics['timing_s/step']:.2f} s", flush=True)
    finally:
        pauses.close()
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
    parser.add_argument("--python-steps", default="", help="steps to run under cProfile")
    parser.add_argument("overrides", nargs="*", help="config key=value")
    args = parser.parse_args()
    steps = [int(s) for s in args.steps.split(",")] if args.steps else None
    python_steps = [int(s) for s in args.python_steps.split(",") if s]
    args.out.mkdir(parents=True, exist_ok=True)
    result = {
        "command": " ".join(sys.argv),
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "load_average_at_start": os.getloadavg(),
        "arms": {
            arm: profile_arm(arm, args.overrides, steps, python_steps, args.out)
            for arm in args.arms.split(",")
        },
        "load_average_at_end": os.getloadavg(),
    }
    (args.out / "profile.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
