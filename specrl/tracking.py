"""Where metrics go: metrics.jsonl (one JSON object per step), the console (a progress bar with
live metrics, then a summary), and optionally TensorBoard and Weights & Biases (offline unless
WANDB_MODE says otherwise)."""

from __future__ import annotations

import json
import os
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table

from specrl.errors import UserError
from specrl.run_dir import heldout_metric, read_metrics_jsonl
from specrl.speculative.stats import RolloutStats

GENERATIONS = "val_generations.jsonl"  # in the run directory: what the policy wrote at evaluations
LIVE_METRICS = {  # val_reward only where the reward states no accuracy
    "critic/score/mean": "score",
    "val/acc/mean@1": "val_acc",
    "val/reward/mean@1": "val_reward",
    "response_length/mean": "len",
    "spec/reused_token_ratio": "reused",
    "timing_s/rollout": "rollout_s",
    "timing_s/step": "step_s",
}


def quiet_libraries() -> None:
    """specrl's progress and messages are the ones that matter: transformers' per-load progress
    bars and notices are noise in a run's log (every Ray worker would print its own), as is
    peft's use of a transformers name that transformers has deprecated."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated")


def make_console(stderr: bool = False) -> Console:
    """A rich console on stdout (or stderr). Off a terminal (a pipe, a log file) nothing is
    wrapped: a line of metrics, a path or a table row stays one line however long."""
    console = Console(stderr=stderr)
    if console.is_terminal:
        return console
    return Console(stderr=stderr, soft_wrap=True, width=4096)


class Tracker:
    def __init__(
        self,
        loggers: Sequence[str],
        run_dir: Path,
        console: Console | None = None,
        project: str = "specrl",
        experiment: str = "run",
    ) -> None:
        self.console = console or make_console(stderr=True)
        self.loggers = set(loggers)
        self.use_console = "console" in loggers
        self.run_dir = run_dir
        self.jsonl = run_dir / "metrics.jsonl" if "jsonl" in loggers else None
        self.generations = run_dir / GENERATIONS
        self.project, self.experiment = project, experiment
        self.history: list[dict[str, float]] = []
        self._tensorboard = None
        self._wandb = None
        self._contention_hinted = False

    def start(self, keep_through_step: int | None = None, config: dict | None = None) -> None:
        """Open every logger once everything the run needs has loaded. metrics.jsonl starts
        fresh or, when resuming, keeps the records up to the resumed step (later ones were not
        checkpointed)."""
        if self.jsonl is not None:
            self.jsonl.parent.mkdir(parents=True, exist_ok=True)
            if keep_through_step is not None and self.jsonl.is_file():
                records = read_metrics_jsonl(self.jsonl, self.warn)
                self.history = [
                    m for m in records if m["training/global_step"] <= keep_through_step
                ]
            self.jsonl.write_text("".join(json.dumps(m) + "\n" for m in self.history))
        kept = []
        if keep_through_step is not None and self.generations.is_file():
            kept = [g for g in read_generations(self.generations) if g["step"] <= keep_through_step]
        self.generations.parent.mkdir(parents=True, exist_ok=True)
        self.generations.write_text("".join(json.dumps(g) + "\n" for g in kept))
        if "tensorboard" in self.loggers:
            self._tensorboard = _optional("torch.utils.tensorboard", "tensorboard").SummaryWriter(
                log_dir=str(self.run_dir / "tensorboard")
            )
        if "wandb" in self.loggers:
            wandb = _optional("wandb", "wandb")
            self._wandb = wandb.init(
                project=self.project,
                name=self.experiment,
                dir=str(self.run_dir),
                config=config,
                mode=os.environ.get("WANDB_MODE", "offline"),
            )

    def close(self) -> None:
        if self._tensorboard is not None:
            self._tensorboard.close()
        if self._wandb is not None:
            self._wandb.finish()

    def print(self, message: str) -> None:
        if self.use_console:
            self.console.print(message, highlight=False)

    def warn(self, message: str) -> None:
        self.console.print(f"[yellow]warning:[/] {message}", highlight=False)

    def log(self, metrics: dict[str, float]) -> None:
        self.history.append(metrics)
        self._check_contention()
        if self.jsonl is not None:
            with self.jsonl.open("a") as handle:
                handle.write(json.dumps(metrics) + "\n")
        step = int(metrics["training/global_step"])
        if self._tensorboard is not None:
            for key, value in metrics.items():
                self._tensorboard.add_scalar(key, value, step)
        if self._wandb is not None:
            self._wandb.log(metrics, step=step)
        if "val/reward/mean@1" in metrics:
            key, _ = heldout_metric([metrics])
            self.print(f"step {int(metrics['training/global_step'])}: {key} = {metrics[key]:.3f}")

    def log_generations(self, step: int, rows: Sequence[dict[str, str | float]]) -> None:
        """What the policy wrote for the first held-out prompts at the evaluation of `step`:
        appended to val_generations.jsonl, a table on the console, a wandb table."""
        if not rows:
            return
        with self.generations.open("a") as handle:
            handle.writelines(json.dumps({"step": step, **row}) + "\n" for row in rows)
        if self._wandb is not None:
            columns = ["step", *rows[0]]
            data = [[step, *row.values()] for row in rows]
            table = _optional("wandb", "wandb").Table(columns=columns, data=data)
            self._wandb.log({"val/generations": table}, step=step)
        if self.use_console:
            self.console.print(generations_table(f"held-out generations at step {step}", rows))

    def _check_contention(self) -> None:
        """Once per run, a hint when the machine is busier than this process can make it: torch's
        threads then wait on each other (on 2 cores a step took 20-30x longer with 2 threads
        beside another busy process than with 1)."""
        threads, cores = torch.get_num_threads(), os.cpu_count() or 1
        if self._contention_hinted or threads == 1 or os.getloadavg()[0] <= cores + 1:
            return
        self._contention_hinted = True
        self.warn(
            f"the machine is busy (load average {os.getloadavg()[0]:.1f} on {cores} cores) and "
            f"torch runs {threads} threads here, which then wait on each other: "
            "trainer.num_threads=1 can make each step several times faster"
        )

    def last(self, key: str) -> float | None:
        return next((m[key] for m in reversed(self.history) if key in m), None)

    @contextmanager
    def progress(self, total: int, done: int = 0) -> Iterator[Callable[[dict[str, float]], None]]:
        """A live progress bar on a terminal; elsewhere (a log file, CI) a plain line every
        twentieth of the run."""
        if not self.console.is_terminal:
            yield self._log_lines(total, done)
            return
        columns = (
            TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
            TimeRemainingColumn(), TextColumn("{task.description}"),
        )  # fmt: skip
        with Progress(*columns, console=self.console, disable=not self.use_console) as bar:
            task = bar.add_task("", total=total, completed=done)

            def advance(metrics: dict[str, float]) -> None:
                bar.update(task, advance=1, description=self._live())

            yield advance

    def _log_lines(self, total: int, done: int) -> Callable[[dict[str, float]], None]:
        every, start, first = max(1, total // 20), time.perf_counter(), done

        def advance(metrics: dict[str, float]) -> None:
            step = int(metrics["training/global_step"])
            if step % every == 0 or step == total:
                elapsed = time.perf_counter() - start
                left = elapsed / max(step - first, 1) * (total - step)
                self.print(
                    f"train {step}/{total} ({elapsed:.0f} s, ~{left:.0f} s left) {self._live()}"
                )

        return advance

    def _live(self) -> str:
        live = {short: self.last(key) for key, short in LIVE_METRICS.items()}
        if live["val_acc"] is not None:
            del live["val_reward"]
        return " ".join(f"{k}={v:.3g}" for k, v in live.items() if v is not None)

    def summary(self, run_dir: Path) -> dict[str, float]:
        """The run's headline numbers, printed as a table on the console with where the run is
        and how to look at it: → them."""
        history = self.history
        spec = RolloutStats.of_steps(history)
        heldout, _ = heldout_metric(history)
        summary = {
            "steps": self.last("training/global_step"),
            f"{heldout} before": history[0].get(heldout)
            if history and history[0]["training/global_step"] == 0
            else None,
            f"{heldout} after": self.last(heldout),
            "critic/score/mean (last step)": self.last("critic/score/mean"),
            "response_length/mean (last step)": self.last("response_length/mean"),
            "spec/reused_token_ratio (whole run)": spec.ratios()["spec/reused_token_ratio"]
            if spec.speculative
            else None,
            "decoded tokens saved by reuse": spec.reused_tokens if spec.speculative else None,
            "rollout time, total (s)": spec.rollout_s,
            "train time, total (s)": sum(m.get("timing_s/step", 0.0) for m in history),
        }
        summary = {name: value for name, value in summary.items() if value is not None}
        if self.use_console and history:
            table = Table(title="specrl run summary")
            table.add_column("metric")
            table.add_column("value", justify="right")
            for name, value in summary.items():
                table.add_row(name, f"{value:.4g}")
            self.console.print(table)
            self.print(f"run directory: {run_dir} (curves and a summary: specrl report {run_dir})")
        return summary


def read_generations(path: Path) -> list[dict[str, str | float]]:
    """val_generations.jsonl's rows (a line cut short by a crash is skipped)."""
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def generations_table(title: str, rows: Sequence[dict[str, str | float]]) -> Table:
    """Prompts (their last 160 characters), responses (their first 240), ground truths and
    scores as a table."""
    table = Table(title=title, show_lines=True)
    for column in ("prompt", "response", "ground truth", "score"):
        table.add_column(column, justify="right" if column == "score" else "left")
    for row in rows:
        prompt, response = str(row["prompt"]), str(row["response"])
        table.add_row(
            ("..." if len(prompt) > 160 else "") + prompt[-160:],
            response[:240] + ("..." if len(response) > 240 else ""),
            str(row["ground_truth"]),
            f"{row['score']:.3g}",
        )
    return table


def _optional(module: str, extra: str):
    """Import an optional logger backend, or say how to install it."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise UserError(
            f"trainer.logger includes {extra} but it is not installed; pip install 'specrl[{extra}]'"
        ) from None
