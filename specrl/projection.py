"""A bench's rollout stages priced by the cost model: checked on the machine that ran them, then
projected to a named device and model shape (`specrl project`).

The check: this machine's constants (overhead per forward, FLOP/s) are fitted to the vanilla
arm's steps alone, then every arm's rollout time is predicted from its own recorded forwards
and compared with what was measured. The projection prices the same forwards for another
model on another device, optionally with the responses stretched.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from specrl.cost_model import Device, ModelShape, fit_device, step_seconds, stretched
from specrl.engines.accounting import ForwardCounts
from specrl.errors import UserError

CHECK_TOLERANCE = 0.15  # the cost model must predict each arm's measured rollout time this well

Steps = list[tuple[ForwardCounts, float]]  # a run's training steps: (counts, rollout seconds)


def recorded_steps(history: list[dict[str, float]]) -> Steps:
    """The training steps of a run's logged metrics that recorded their forwards."""
    return [
        (ForwardCounts.from_metrics(m), m["timing_s/rollout"])
        for m in history
        if m["training/global_step"] > 0 and "perf/decode/forwards" in m
    ]


def machine_check(arms: dict[str, Steps], shape: ModelShape) -> dict[str, Any]:
    """Fit this machine to the vanilla arm, predict every arm: → the fitted constants and, per
    arm, measured and predicted rollout seconds and their relative residual."""
    if not arms.get("vanilla"):
        raise UserError("the cost model's check fits this machine to a vanilla arm: bench one")
    device = fit_device(arms["vanilla"], shape, "this machine")
    out: dict[str, Any] = {
        "fitted_on": "vanilla",
        "overhead_ms_per_forward": device.overhead_s * 1e3,
        "gflops_per_s": device.peak_flops / 1e9,
        "tolerance": CHECK_TOLERANCE,
        "arms": {},
    }
    for arm, steps in arms.items():
        measured = sum(seconds for _, seconds in steps)
        predicted = sum(step_seconds(counts, shape, device) for counts, _ in steps)
        residual = predicted / measured - 1 if measured else 0.0
        out["arms"][arm] = {
            "measured_s": measured,
            "predicted_s": predicted,
            "residual": residual,
            "within_tolerance": abs(residual) <= CHECK_TOLERANCE,
        }
    return out


def project(
    arms: dict[str, Steps], shape: ModelShape, device: Device, stretch: float = 1.0
) -> dict[str, Any]:
    """Projected rollout seconds per arm and speedup over vanilla, with the assumptions."""
    seconds = {
        arm: sum(step_seconds(stretched(c, stretch), shape, device) for c, _ in steps)
        for arm, steps in arms.items()
    }
    vanilla = seconds.get("vanilla")
    return {
        "projection": True,
        "device": asdict(device),
        "model": {**asdict(shape), "params": shape.params},
        "response_stretch": stretch,
        "arms": {
            arm: {
                "projected_rollout_s": s,
                "projected_rollout_speedup": vanilla / s if vanilla and s else None,
            }
            for arm, s in seconds.items()
        },
    }


def bench_steps(bench_dir: Path) -> tuple[dict[str, Any], dict[str, Steps]]:
    """A finished bench folder's bench.json and each arm's recorded steps (all seeds)."""
    path = bench_dir / "bench.json"
    if not path.is_file():
        raise UserError(f"{bench_dir} is not a finished bench (no bench.json)")
    bench = json.loads(path.read_text())
    seeds = bench.get("seeds") or [None]
    arms: dict[str, Steps] = {}
    for arm in bench["arms"]:
        for seed in seeds:
            run = bench_dir / arm if len(seeds) == 1 else bench_dir / f"seed{seed}" / arm
            metrics = run / "metrics.jsonl"
            if not metrics.is_file():
                raise UserError(f"{bench_dir}: the {arm} arm's {metrics} is missing")
            history = [json.loads(line) for line in metrics.read_text().splitlines() if line]
            arms.setdefault(arm, []).extend(recorded_steps(history))
    if not any(arms.values()):
        raise UserError(f"{bench_dir}: its runs recorded no forwards (perf/*): rerun the bench")
    return bench, arms


def project_bench(
    bench_dir: Path, device: Device, shape: ModelShape, stretches: list[float]
) -> dict[str, Any]:
    """`specrl project`: the bench's check on its own machine and the projection at each
    stretch, written to BENCH/projection-<device>-<model>.json."""
    bench, arms = bench_steps(bench_dir)
    result: dict[str, Any] = {
        "bench": str(bench_dir),
        "measured_on": bench.get("machine"),
        "check": bench.get("cost_model_check"),
        "projections": [project(arms, shape, device, s) for s in stretches],
        "cannot_know": CANNOT_KNOW,
    }
    device_name = "-".join(device.name.lower().split())
    name = f"projection-{device_name}-{shape.name}.json".replace("/", "_")
    (bench_dir / name).write_text(json.dumps(result, indent=2))
    return result


CANNOT_KNOW = [
    "how acceptance and reuse change with a larger policy, another task and longer responses "
    "(the trace's are kept: a stretch scales work, not reuse)",
    "the spread of response lengths: the stretch keeps the trace's shape, so the tail that "
    "decides a GPU's rollout time is the trace's tail scaled",
    "batching limits and KV-cache capacity: a long-response batch may not fit and be preempted",
    "kernel efficiency: the fractions of peak and the overhead per forward are assumptions",
]
