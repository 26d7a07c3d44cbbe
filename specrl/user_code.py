"""What users write in Python files: loading it (reward functions, environments) and calling it
with a time limit."""

from __future__ import annotations

import importlib.util
import queue
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from specrl.errors import UserError


def load_from_file(path: str, name: str, key: str, what: str, error: type[UserError]) -> Any:
    """The object `name` (a `what`: function, class) of the Python file at `path`; `key` is the
    config section that gave the path, for the message when the file is missing, fails to import
    or lacks `name`."""
    file = Path(path)
    if not file.is_file():
        raise error(f"{key}.path {path!r} does not exist")
    spec = importlib.util.spec_from_file_location(f"specrl_user_{file.stem}", file)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as err:
        raise error(f"{key}.path {path!r} failed to import: {err!r}") from None
    value = getattr(module, name, None)
    if value is None:
        raise error(f"{path!r} has no {what} {name!r} (set {key}.name)")
    return value


def call_with_timeout(
    fn: Callable[..., Any], args: tuple, timeout_s: float
) -> tuple[Any, str | None]:
    """Run fn(*args) on a daemon thread; → (value, None) or (None, error message). Works from any
    thread (no signals); a call that hangs is abandoned, not killed."""
    box: queue.Queue = queue.Queue(maxsize=1)

    def run() -> None:
        try:
            box.put((fn(*args), None))
        except Exception as err:
            box.put((None, f"raised {err!r}"))

    threading.Thread(target=run, daemon=True).start()
    try:
        return box.get(timeout=timeout_s)
    except queue.Empty:
        return None, f"timed out after {timeout_s:g}s"
