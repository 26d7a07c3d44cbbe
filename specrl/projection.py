"""A bench's rollout stages priced by the cost model: checked on the machine that ran them, then
projected to a named device and model shape (`specrl project`).

The check: this machine's constants (overhead per forward, FLOP/s, bytes/s) are fitted to the
timed forwards of engine calls at varied sizes (`calibrate`: none of them a bench step), then
every arm's seconds in forwards are predicted from its own recorded forwards and compared with
what the engine measured (`timing_s/forward/<kind>`; where a run has none, vLLM's, its
time in engine calls). The rest of a rollout stage is host work, inside the engine's calls (masks, KV
gathered from a verification pass, first tokens, drafts) and outside them (walks, cuts,
bookkeeping): measured, reported apart, and carried over as it is. The projection prices the
same forwards for another model on another device, optionally with the responses stretched.
"""

from __future__ import annotations

import copy
import json
import sys
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import numpy as np

from specrl.cost_model import Device, ModelShape, fit_device, step_seconds, stretched
from specrl.engines import GenRequest, LogprobRequest, SamplingParams, TrieRequest
from specrl.engines.accounting import ForwardCounts
from specrl.engines.hf import HFEngine
from specrl.errors import UserError
from specrl.run_dir import read_metrics_jsonl

CHECK_TOLERANCE = 0.15  # the cost model must predict each arm's engine time this well

# a run's training steps: (counts, seconds in engine calls, rollout seconds)
Steps = list[tuple[ForwardCounts, float, float]]


def recorded_steps(history: list[dict[str, float]]) -> Steps:
    """The training steps of a run's logged metrics that recorded their forwards."""
    return [
        (ForwardCounts.from_metrics(m), m["timing_s/engine"], m["timing_s/rollout"])
        for m in history
        if m["training/global_step"] > 0 and "timing_s/engine" in m
    ]


def calibrate(engine: HFEngine, shape: ModelShape, seed: int = 0) -> Device:
    """This machine as a `Device`: the engine's generate, scoring and trie calls at varied
    batch sizes and lengths (decodes as long as a bench's: the KV cache grows), their forwards
    counted and timed, fitted by `fit_device` (decode forwards with an overhead of their own
    where the engine replays them as CUDA graphs)."""
    rng = np.random.default_rng(seed)
    vocab = shape.vocab

    def ids(n: int) -> list[int]:
        return rng.integers(2, vocab, n).tolist()

    def trie(nodes: int) -> tuple[list[int], list[int]]:
        parents = [0] + [
            int(rng.integers(0, i)) if rng.random() < 0.2 else i for i in range(1, nodes)
        ]
        return parents, ids(nodes)

    sampling = SamplingParams(1.0)
    calls: list[Callable[[], object]] = []
    # batch, context and length varied apart, so forwards, FLOPs and bytes are told apart
    for rows, prompt, new in (
        (1, 12, 64),
        (16, 12, 64),
        (128, 12, 32),
        (256, 12, 64),
        (32, 96, 32),
    ):
        requests = [GenRequest(ids(prompt), new, sampling, seed=i) for i in range(rows)]
        calls.append(lambda r=requests: engine.generate(r))
    for rows, context, targets in ((4, 12, 24), (64, 12, 48), (256, 12, 24), (16, 96, 96)):
        requests = [LogprobRequest(ids(context), ids(targets), sampling) for _ in range(rows)]
        calls.append(lambda r=requests: engine.logprobs(r))
    for rows, nodes in ((1, 64), (8, 128), (32, 128)):
        requests = [TrieRequest(ids(12), *trie(nodes), sampling) for _ in range(rows)]
        calls.append(lambda r=requests: engine.verify_tries(r))
    timed, captures, capture_seconds = [], 0, 0.0
    for call in calls:  # each call's fastest of three: what the machine does undisturbed
        runs = []
        for _ in range(3):
            before = copy.copy(engine.counts)
            call()
            runs.append(engine.counts - before)
        captures += sum(c.decode_captures for c in runs)
        capture_seconds += sum(c.decode_capture_seconds for c in runs)
        counts = min(runs, key=lambda c: c.seconds)
        timed.append((counts.as_computed(), counts.seconds - counts.decode_capture_seconds))
    device = fit_device(timed, shape, "this machine", engine.capabilities.graph_decoding)
    return replace(device, capture_s=capture_seconds / captures) if captures else device


def machine_check(arms: dict[str, Steps], shape: ModelShape, device: Device) -> dict[str, Any]:
    """Every arm's seconds in forwards predicted from its recorded forwards on this machine's
    `calibrate`d constants (CUDA graph captures at the calibration's mean cost of one): → the
    constants and, per arm, measured and predicted seconds, their relative residual, and the
    host work (inside the engine's calls and outside them) that completes the rollout time."""
    out: dict[str, Any] = {
        "calibrated_on": "timed forwards of engine calls of varied sizes (no bench step)",
        "overhead_ms_per_forward": device.overhead_s * 1e3,
        **(
            {"overhead_ms_per_graph_decode_forward": device.decode_overhead_s * 1e3}
            if device.decode_overhead_s is not None
            else {}
        ),
        **({"ms_per_graph_capture": device.capture_s * 1e3} if device.capture_s else {}),
        "gflops_per_s": device.peak_flops / 1e9,
        "gbytes_per_s": device.bandwidth / 1e9,
        "tolerance": CHECK_TOLERANCE,
        "arms": {},
    }
    for arm, steps in arms.items():
        engine = sum(seconds for _, seconds, _ in steps)
        forwards = sum(counts.seconds for counts, _, _ in steps)
        measured = forwards or engine  # runs without forward timings: their engine calls
        predicted = sum(step_seconds(c.as_computed(), shape, device) for c, _, _ in steps)
        residual = predicted / measured - 1 if measured else 0.0
        rollout = sum(seconds for _, _, seconds in steps)
        out["arms"][arm] = {
            "compared": "forwards" if forwards else "engine calls",
            "measured_s": measured,
            "graph_captures": sum(counts.decode_captures for counts, _, _ in steps),
            "capture_s": sum(counts.decode_capture_seconds for counts, _, _ in steps),
            "predicted_s": predicted,
            "residual": residual,
            "within_tolerance": abs(residual) <= CHECK_TOLERANCE,
            "engine_host_s": engine - measured,
            "host_s": rollout - engine,
            "measured_rollout_s": rollout,
            "predicted_rollout_s": predicted + rollout - measured,
        }
    return out


def checked_device(check: dict[str, Any]) -> Device:
    """The constants a `machine_check` reported (a bench.json's `cost_model_check`) as the
    `Device` that `calibrate` fitted."""
    graph_ms = check.get("overhead_ms_per_graph_decode_forward")
    return Device(
        "this machine", check["gflops_per_s"] * 1e9, check["gbytes_per_s"] * 1e9,
        check["overhead_ms_per_forward"] / 1e3, 1.0, 1.0, source=check["calibrated_on"],
        overlap=False, decode_overhead_s=None if graph_ms is None else graph_ms / 1e3,
        capture_s=check.get("ms_per_graph_capture", 0.0) / 1e3,
    )  # fmt: skip


def priced_windows(
    runs: dict[str, list[Steps]], shape: ModelShape, device: Device, window: int
) -> dict[str, list[dict[str, Any]]]:
    """Per `window` steps and over the run, every speculative arm's rollout seconds with its
    forwards priced on this machine's constants and its host work as measured, against
    vanilla's priced the same way: the work each arm did, without the machine's speed, which on
    a shared CPU moves by ±10% from one step to the next (two arms doing the same work differ
    by that much). A prediction, not a measurement: it holds as far as the cost model prices
    both arms' forwards alike (`machine_check`). `runs`: per arm, each seed's steps in order;
    a window pools the seeds' same steps."""

    def priced(steps: Steps) -> list[float]:
        return [
            step_seconds(c.as_computed(), shape, device) + rollout - (c.seconds or engine)
            for c, engine, rollout in steps
        ]

    if "vanilla" not in runs:
        return {}
    seconds = {arm: [priced(steps) for steps in seeds] for arm, seeds in runs.items()}
    length = min(len(s) for seeds in seconds.values() for s in seeds)
    spans = [(first, min(first + window, length)) for first in range(0, length, window)]
    vanilla = seconds["vanilla"]
    out: dict[str, list[dict[str, Any]]] = {}
    for arm, seeds in seconds.items():
        if arm == "vanilla":
            continue
        out[arm] = []
        labelled = [(first, end, f"{first + 1}-{end}") for first, end in spans]
        for first, end, label in [*labelled, (0, length, "all")]:
            mine = sum(sum(s[first:end]) for s in seeds)
            theirs = sum(sum(s[first:end]) for s in vanilla)
            out[arm].append({
                "steps": label,
                "priced_rollout_s": mine,
                "vanilla_priced_rollout_s": theirs,
                "priced_speedup": theirs / mine if mine else None,
            })  # fmt: skip
    return out


def priced_window_lines(windows: dict[str, list[dict[str, Any]]]) -> list[str]:
    """`priced_windows`' figures, a line per window."""
    return [
        f"{arm} steps {w['steps']}: rollouts priced by their counted work "
        f"{w['priced_rollout_s']:.1f} s vs vanilla's {w['vanilla_priced_rollout_s']:.1f} s "
        f"({w['priced_speedup']:.2f}x)"
        for arm, rows in windows.items()
        for w in rows
    ]


def check_lines(check: dict[str, Any]) -> list[str]:
    """`machine_check`'s result, a line per arm."""
    return [
        f"{arm}: {c.get('compared', 'engine calls')} measured {c['measured_s']:.1f} s"
        + (
            f" (CUDA graph captures: {c['graph_captures']}, {c['capture_s']:.1f} s of them, "
            + (
                f"priced at {check['ms_per_graph_capture']:.1f} ms each)"
                if check.get("ms_per_graph_capture")
                else "unpriced: the calibration captured none)"
            )
            if c.get("graph_captures")
            else ""
        )
        + f", predicted {c['predicted_s']:.1f} s ({c['residual']:+.1%}); host work "
        f"{c.get('engine_host_s', 0):.1f} s in engine calls, {c['host_s']:.1f} s around them"
        for arm, c in check["arms"].items()
    ]


def project(
    arms: dict[str, Steps], shape: ModelShape, device: Device, stretch: float = 1.0
) -> dict[str, Any]:
    """Projected rollout seconds per arm and speedup over vanilla, with the assumptions: the
    engine's forwards priced on `device`; the stage's host work (measured here, outside the
    engine's calls) carried over as it is, stretched with the responses."""
    engine = {
        arm: sum(step_seconds(stretched(c, stretch), shape, device) for c, _, _ in steps)
        for arm, steps in arms.items()
    }
    host = {arm: stretch * sum(r - e for _, e, r in steps) for arm, steps in arms.items()}
    seconds = {arm: engine[arm] + host[arm] for arm in arms}
    vanilla = seconds.get("vanilla")
    return {
        "projection": True,
        "device": asdict(device),
        "model": {**asdict(shape), "params": shape.params},
        "response_stretch": stretch,
        "arms": {
            arm: {
                "projected_rollout_s": s,
                "projected_engine_s": engine[arm],
                "host_s": host[arm],
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
            history = read_metrics_jsonl(
                metrics, lambda m: print(f"specrl: warning: {m}", file=sys.stderr)
            )
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
