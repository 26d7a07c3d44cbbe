"""The run directory: checked before anything loads, locked for the life of a run, and never
mixed between runs.

- `trainer.output_dir` must be (or become) a writable directory; a file or a read-only place
  stops the run at once with one line.
- An exclusive lock (`fcntl.flock` on RUN_DIR/.lock, which holds the owner's pid) keeps a second
  run out of a directory in use: its metrics would interleave and its checkpoints overwrite. The
  kernel drops the lock when its process ends, however it ends, so a stale lock file of a dead
  run is no obstacle.
- A run that starts over (`trainer.resume_mode=disable`) in a directory holding an earlier run
  moves that run's checkpoints and metrics into RUN_DIR/previous-N/ and says so: a later `auto`
  resume cannot pick them up, and nothing is lost.
- `read_metrics_jsonl`: metrics.jsonl as records; an unparsable last line (what a crash in the
  middle of a write leaves) is dropped with a warning. `heldout_metric`: the held-out figure a
  run's records hold (accuracy where the reward states one, else the reward).
- `StopSignals`: SIGINT / SIGTERM during a run are noted, not raised, so the loop can finish the
  step, save a checkpoint and stop cleanly (`RunInterrupted`); a second signal stops at once.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import IO

from specrl.errors import UserError

LOCK_FILE = ".lock"
EARLIER_RUN = ("checkpoints", "metrics.jsonl", "config.yaml", "tensorboard", "wandb")


class RunDirError(UserError):
    """The run directory is unusable or in use."""


class RunLock:
    """An exclusive lock on a run directory, held until `release` (or the process ends)."""

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / LOCK_FILE
        self._file: IO[str] | None = open(self.path, "a+")  # noqa: SIM115 (held for the run)
        try:
            fcntl.flock(self._file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._file.seek(0)
            owner = self._file.read().strip() or "unknown"
            self._file.close()
            raise RunDirError(
                f"trainer.output_dir {str(run_dir)!r} is in use by another specrl run (pid "
                f"{owner}); wait for it to finish or choose another trainer.output_dir"
            ) from None
        self._file.seek(0)
        self._file.truncate()
        self._file.write(f"{os.getpid()}\n")
        self._file.flush()

    def release(self) -> None:
        if self._file is not None:
            self._file.close()  # closing the descriptor drops the lock
            self._file = None


def open_run_dir(run_dir: Path, starting_over: bool, log: Callable[[str], None]) -> RunLock:
    """Check that `run_dir` can hold a run, lock it, and, when `starting_over`, move an earlier
    run in it aside. → the lock."""
    if run_dir.exists() and not run_dir.is_dir():
        raise RunDirError(
            f"trainer.output_dir {str(run_dir)!r} is a file, not a directory; "
            "choose another trainer.output_dir"
        )
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise RunDirError(
            f"trainer.output_dir {str(run_dir)!r} cannot be created ({err.strerror}); "
            "choose a writable trainer.output_dir"
        ) from None
    if not os.access(run_dir, os.W_OK | os.X_OK):
        raise RunDirError(
            f"trainer.output_dir {str(run_dir)!r} is not writable; choose a writable "
            "trainer.output_dir"
        )
    lock = RunLock(run_dir)
    if starting_over:
        _move_earlier_run_aside(run_dir, log)
    return lock


def _move_earlier_run_aside(run_dir: Path, log: Callable[[str], None]) -> None:
    found = [run_dir / name for name in EARLIER_RUN if (run_dir / name).exists()]
    if not found:
        return
    number = 1
    while (run_dir / f"previous-{number}").exists():
        number += 1
    aside = run_dir / f"previous-{number}"
    aside.mkdir()
    for path in found:
        path.rename(aside / path.name)
    log(
        f"trainer.resume_mode=disable: moved the earlier run in {run_dir} "
        f"({', '.join(p.name for p in found)}) to {aside}"
    )


# metrics renamed since runs were first written (old name → current): the drafts verified in
# decoding, named by what they count whatever proposed them (trees, stored drafts, vLLM's suffix
# decoding), and the verification forwards. Records are read under the current names, so
# `specrl report`, resuming and projections read old runs as new ones.
RENAMED_METRICS = {
    f"spec/tree/{old}": f"spec/decode_drafts/{new}"
    for old, new in {
        "forwards": "forwards",
        "output_tokens": "output_tokens",
        "draft_tokens": "drafted_tokens",
        "accepted_tokens": "accepted_tokens",
        "width_forwards": "width_forwards",
        "width_sum": "width_sum",
        "acceptance_estimate": "accept_rate_estimate",
        "mean_accepted_per_forward": "tokens_per_forward",
        "acceptance_rate": "accept_rate",
        "mean_width": "mean_width",
    }.items()
} | {
    f"perf/score/{quantity}": f"perf/verify/{quantity}"
    for quantity in ("forwards", "rows", "positions", "kv_reads", "attended")
}


def read_metrics_jsonl(path: Path, warn: Callable[[str], None]) -> list[dict[str, float]]:
    """The records of a metrics.jsonl, every metric under its current name (`RENAMED_METRICS`).
    An unparsable last line is dropped with a warning (a run killed while writing it); an
    unparsable line before the last is an error."""
    lines = [(n, line) for n, line in enumerate(path.read_text().splitlines(), 1) if line.strip()]
    records = []
    for i, (number, line) in enumerate(lines):
        try:
            records.append({RENAMED_METRICS.get(k, k): v for k, v in json.loads(line).items()})
        except json.JSONDecodeError:
            if i < len(lines) - 1:
                raise UserError(
                    f"{path} line {number} is not valid JSON; the file was changed by hand or "
                    "by another program"
                ) from None
            warn(f"{path}: dropped the unparsable last line {number} (a run killed mid-write)")
    return records


def heldout_metric(history: list[dict[str, float]]) -> tuple[str, str]:
    """→ (key, label) of the held-out figure of a run: its accuracy (`val/acc/mean@1`) where the
    reward states one, else its reward (`val/reward/mean@1`)."""
    if any("val/acc/mean@1" in m for m in history):
        return "val/acc/mean@1", "held-out accuracy (val/acc/mean@1)"
    return "val/reward/mean@1", "held-out reward (val/reward/mean@1)"


class RunInterrupted(Exception):
    """The run stopped on a signal after saving; `exit_code` is the shell's 128 + signal."""

    def __init__(self, message: str, signum: int) -> None:
        super().__init__(message)
        self.exit_code = 128 + signum


class StopSignals:
    """While entered (in the main thread), SIGINT and SIGTERM set `received` instead of
    interrupting; a second one restores the default handlers and re-raises at once."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.received: int | None = None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._note) for s in self.SIGNALS}
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}

    def _note(self, signum: int, frame: FrameType | None) -> None:
        if self.received is not None:  # the second signal: stop now
            self.__exit__()
            signal.raise_signal(signum)
            return
        self.received = signum
