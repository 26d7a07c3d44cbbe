"""How many torch threads a run computes with (`trainer.num_threads`).

Alone on a 2-core machine two threads are the fastest; beside another busy process they wait on
each other and a step runs several times slower than with one. `auto` therefore takes the cores
other work leaves free when a run first starts, and keeps that count for the whole run:
its checkpoints record it and a resumed run computes with it again, since the thread count
changes the order of float reductions (a resumed run then computes as the uninterrupted one).
"""

from __future__ import annotations

import os
import time

import torch

SAMPLE_S = 0.5
TORCH_DEFAULT = torch.get_num_threads()  # torch's own choice: the physical cores


def busy_cores() -> float:
    """Cores busy right now: the machine's CPU time over `SAMPLE_S` (Linux /proc/stat; the
    1-minute load average elsewhere, which still counts work that has just ended)."""
    try:
        first = _cpu_times()
        time.sleep(SAMPLE_S)
        second = _cpu_times()
    except OSError:
        return os.getloadavg()[0]
    total = sum(second) - sum(first)
    idle = (second[3] + second[4]) - (first[3] + first[4])  # idle and iowait
    return (os.cpu_count() or 1) * (1 - idle / total) if total > 0 else 0.0


def _cpu_times() -> list[int]:
    with open("/proc/stat") as stat:
        return [int(x) for x in stat.readline().split()[1:]]


def free_cores(busy: float) -> int:
    """The cores `busy` leaves free (at least 1), no more than torch would take by itself
    (`os.cpu_count` counts hyperthreads)."""
    cores = os.cpu_count() or 1
    return max(1, min(TORCH_DEFAULT, cores - round(busy)))


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
    busy = busy_cores()
    threads = free_cores(busy)
    if threads == TORCH_DEFAULT:
        return threads, None
    return threads, (
        f"torch threads: {threads} of {TORCH_DEFAULT} (trainer.num_threads=auto: other work keeps "
        f"{busy:.1f} of {os.cpu_count()} cores busy; kept for the whole run)"
    )
