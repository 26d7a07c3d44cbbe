"""specrl's cache (`SPECRL_CACHE`, default ~/.cache/specrl): what it builds once per machine
(toy policies, converted models), each entry built by one process at a time."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

from filelock import FileLock, Timeout


def cache_root() -> Path:
    return Path(os.environ.get("SPECRL_CACHE", Path.home() / ".cache" / "specrl"))


def build_once(path: Path, done: str, build: Callable[[Path], None], force: bool, log) -> None:
    """Make the directory `path` by `build(staging)` unless it holds `done` already (or with
    `force`). Builds take a file lock: a second process waits for the first's and reuses it.
    The build goes into a staging directory renamed into place, so a killed build leaves
    nothing half-written, and the entry is readable by every user of a shared cache."""
    if (path / done).is_file() and not force:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(path.with_name(path.name + ".lock"))
    try:
        lock.acquire(blocking=False)
    except Timeout:
        log(f"waiting for another process's build of {path}")
        lock.acquire()
    try:
        if (path / done).is_file() and not force:
            log(f"the other process built it: using {path}")
            return
        staging = path.with_name(path.name + f".tmp{os.getpid()}")
        shutil.rmtree(staging, ignore_errors=True)
        build(staging)
        staging.chmod(0o755)  # safetensors writes its files 0600
        for file in staging.iterdir():
            file.chmod(0o644)
        shutil.rmtree(path, ignore_errors=True)
        staging.rename(path)
    finally:
        lock.release()
