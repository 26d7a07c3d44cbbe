"""`specrl bench`: vanilla and speculative training, same config, seed and data, one process.

Writes DIR/bench.json and DIR/bench.png. Speeds are totals over the whole run, measured with
wall clocks around the rollout stage (verification included) and around whole steps.
"""

from __future__ import annotations

import json
import platform
from pathlib import Path
from typing import Any

import torch
import transformers

from specrl.config import Config
from specrl.plots import plot_metrics
from specrl.trainer import Trainer

ARMS = ("vanilla", "spec")
BENCH_PANELS = [
    ("timing_s/rollout", "rollout time per step (s)"),
    ("critic/score/mean", "reward (critic/score/mean)"),
    ("val/acc/mean@1", "held-out accuracy (val/acc/mean@1)"),
    ("spec/reused_token_ratio", "reused token ratio"),
]


def run_bench(cfg: Config, out_dir: Path, log=print) -> dict[str, Any]:
    histories: dict[str, list[dict[str, float]]] = {}
    for arm in ARMS:
        arm_cfg = cfg.model_copy(deep=True)
        arm_cfg.rollout.spec.enabled = arm == "spec"
        arm_cfg.trainer.output_dir = str(out_dir / arm)
        arm_cfg.trainer.resume_mode = "disable"  # a benchmark always measures a fresh run
        arm_cfg.trainer.experiment_name = f"{cfg.trainer.experiment_name}-{arm}"
        log(f"bench: training the {arm} arm into {out_dir / arm}")
        trainer = Trainer(arm_cfg)
        trainer.fit()
        histories[arm] = trainer.tracker.history
    result = summarize(histories["vanilla"], histories["spec"], cfg)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "bench.json").write_text(json.dumps(result, indent=2))
    plot_metrics(histories, BENCH_PANELS, out_dir / "bench.png")
    return result


def summarize(
    vanilla: list[dict[str, float]], spec: list[dict[str, float]], cfg: Config
) -> dict[str, Any]:
    v_steps, s_steps = _train_steps(vanilla), _train_steps(spec)
    v_rollout, s_rollout = _total(v_steps, "timing_s/rollout"), _total(s_steps, "timing_s/rollout")
    # r: seconds per verified token (spec arm) over seconds per decoded token (vanilla arm)
    verify_per_token = _total(s_steps, "timing_s/verify") / max(
        _total(s_steps, "spec/verified_tokens"), 1
    )
    decode_per_token = _total(v_steps, "timing_s/gen") / max(
        _total(v_steps, "spec/decoded_tokens"), 1
    )
    r = verify_per_token / decode_per_token
    a = _reuse(s_steps)
    later = [m for m in s_steps if m["training/epoch"] >= 1]
    return {
        "rollout_speedup": v_rollout / s_rollout,
        "step_speedup": _total(v_steps, "timing_s/step") / _total(s_steps, "timing_s/step"),
        "reused_token_ratio": _reuse(later) if later else 0.0,
        "reused_token_ratio_all_steps": a,
        "full_reuse_ratio": sum(m["spec/full_reuse_ratio"] for m in later) / max(len(later), 1),
        "verified_token_ratio": _total(s_steps, "spec/verified_tokens")
        / max(_total(s_steps, "spec/response_tokens"), 1),
        "verify_cost_ratio": r,
        "limit_speedup": 1.0 / ((1.0 - a) + r * a),
        "final_acc_vanilla": _last(vanilla, "val/acc/mean@1"),
        "final_acc_spec": _last(spec, "val/acc/mean@1"),
        "rollout_time_s": {"vanilla": v_rollout, "spec": s_rollout},
        "step_time_s": {
            "vanilla": _total(v_steps, "timing_s/step"),
            "spec": _total(s_steps, "timing_s/step"),
        },
        "decoded_tokens": {
            "vanilla": _total(v_steps, "spec/decoded_tokens"),
            "spec": _total(s_steps, "spec/decoded_tokens"),
        },
        "steps": len(s_steps),
        "acceptance": cfg.rollout.spec.acceptance,
        "log_lenience": cfg.rollout.spec.log_lenience,
        "verify_mode": cfg.rollout.spec.verify_mode,
        "engine": f"{cfg.rollout.name} (transformers {transformers.__version__}, torch {torch.__version__})",
        "machine": f"{platform.machine()} {platform.processor() or ''} {torch.get_num_threads()} threads".strip(),
        "device": "cpu",
    }


def _train_steps(history: list[dict[str, float]]) -> list[dict[str, float]]:
    return [m for m in history if m["training/global_step"] > 0]


def _total(steps: list[dict[str, float]], key: str) -> float:
    return float(sum(m.get(key, 0.0) for m in steps))


def _reuse(steps: list[dict[str, float]]) -> float:
    return _total(steps, "spec/reused_tokens") / max(_total(steps, "spec/response_tokens"), 1)


def _last(history: list[dict[str, float]], key: str) -> float | None:
    return next((m[key] for m in reversed(history) if key in m), None)
