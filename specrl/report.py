"""`specrl report RUN_DIR`: curves (report.png) and a summary table of a run's metrics.jsonl."""

from __future__ import annotations

import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

from specrl.errors import UserError
from specrl.plots import plot_metrics
from specrl.run_dir import heldout_metric, read_metrics_jsonl
from specrl.speculative.stats import RolloutStats
from specrl.tracking import GENERATIONS, generations_table, make_console, read_generations

REPORT_PANELS = [
    ("critic/score/mean", "reward (critic/score/mean)"),
    ("response_length/mean", "response length (tokens)"),
    ("spec/reused_token_ratio", "reused token ratio"),
    ("timing_s/rollout", "rollout time per step (s)"),
]
REPORT_GENERATIONS = 3  # of the last evaluation's, from val_generations.jsonl


def read_history(run_dir: Path) -> list[dict[str, float]]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise UserError(f"{run_dir} has no metrics.jsonl; pass the trainer.output_dir of a run")
    history = read_metrics_jsonl(path, lambda m: print(f"specrl: warning: {m}", file=sys.stderr))
    if not history:
        raise UserError(f"{path} is empty: the run logged no step yet")
    return history


def report(run_dir: Path, console: Console | None = None) -> Path:
    history = read_history(run_dir)
    out = run_dir / "report.png"
    heldout, label = heldout_metric(history)
    panels = [REPORT_PANELS[0], (heldout, label), *REPORT_PANELS[1:]]
    plot_metrics({run_dir.name: history}, panels, out, title=f"specrl run {run_dir}")
    steps = [m for m in history if m["training/global_step"] > 0]
    vals = [m[heldout] for m in history if heldout in m]
    rows = {
        "steps": len(steps),
        f"{heldout} first → last": f"{vals[0]:.3f} → {vals[-1]:.3f}" if vals else "not evaluated",
        "critic/score/mean, last step": _fmt(steps[-1].get("critic/score/mean") if steps else None),
        "response_length/mean, last step": _fmt(
            steps[-1].get("response_length/mean") if steps else None
        ),
        "spec/reused_token_ratio, whole run": _fmt(
            RolloutStats.of_steps(steps).ratios()["spec/reused_token_ratio"]
        ),
        "rollout time per step (s), mean": _fmt(_mean(steps, "timing_s/rollout")),
        "step time (s), mean": _fmt(_mean(steps, "timing_s/step")),
        "reward errors, total": _fmt(sum(m.get("reward/errors", 0) for m in steps)),
        "skipped updates, total": _fmt(sum(m.get("actor/skipped_updates", 0) for m in steps)),
    }
    table = Table(title=f"specrl report: {run_dir}")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for name, value in rows.items():
        table.add_row(name, str(value))
    console = console or make_console()
    console.print(table)
    if (run_dir / GENERATIONS).is_file() and (rows := read_generations(run_dir / GENERATIONS)):
        last = rows[-1]["step"]
        shown = [r for r in rows if r["step"] == last][:REPORT_GENERATIONS]
        console.print(generations_table(f"held-out generations at step {last}", shown))
    return out


def _mean(steps: list[dict[str, float]], key: str) -> float | None:
    values = [m[key] for m in steps if key in m]
    return sum(values) / len(values) if values else None


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.4g}"
