"""How many torch threads a run computes with (`trainer.num_threads`).

Alone on a 2-core machine two threads are the fastest; beside another busy process they wait on
each other and a step runs several times slower than with one. `auto` therefore takes the cores
the machine's load leaves free when a run first starts, and keeps that count for the whole run:
its checkpoints record it and a resumed run computes with it again, since the thread count
changes the order of float reductions (a resumed run then computes as the uninterrupted one).
"""

from __future__ import annotations

import os

import torch


def free_cores() -> int:
    """The cores the machine's 1-minute load average leaves free; at least 1."""
    cores = os.cpu_count() or 1
    return max(1, min(cores, cores - round(os.getloadavg()[0])))


def run_threads(setting: int | str, recorded: int | None) -> tuple[int, str | None]:
    """The torch threads of a run from `trainer.num_threads` and the count its checkpoint
    recorded (None: a fresh run) → (count, a line to print where `auto` chose fewer than the
    cores, else None). OMP_NUM_THREADS, where set, is the user's choice and wins over `auto`."""
    if setting != "auto":
        return int(setting), None
    if recorded:
        return recorded, None
    if "OMP_NUM_THREADS" in os.environ:
        return torch.get_num_threads(), None
    threads, cores = free_cores(), os.cpu_count() or 1
    if threads == cores:
        return threads, None
    return threads, (
        f"torch threads: {threads} of {cores} cores (trainer.num_threads=auto: the machine's "
        f"load average is {os.getloadavg()[0]:.1f}; kept for the whole run)"
    )
