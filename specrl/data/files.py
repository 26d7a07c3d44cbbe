"""jsonl and parquet readers for verl's schema: `prompt` as chat messages (or text),
`reward_model.ground_truth` (or a plain `answer` column via data.answer_key), optional
`data_source` and `extra_info`."""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from specrl.errors import UserError
from specrl.types import Example


class DataError(UserError):
    """A dataset problem, with a message naming the file (and line) and the fix."""


def read_examples(
    files: Sequence[str], prompt_key: str, answer_key: str, option: str = "data.train_files"
) -> list[Example]:
    examples: list[Example] = []
    for name in files:
        path = Path(name)
        if not path.is_file():
            raise DataError(f"dataset file {name} does not exist; check {option}")
        for where, row in _rows(path):
            examples.append(_example(row, where, prompt_key, answer_key))
    if not examples:
        raise DataError(f"dataset files {', '.join(files)} hold no rows")
    return examples


def _rows(path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            table = pq.read_table(path)
        except Exception as err:
            raise DataError(f"{path} is not a readable parquet file: {err}") from None
        for i, row in enumerate(table.to_pylist()):
            yield f"{path} row {i}", row
    elif path.suffix in (".jsonl", ".json"):
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except UnicodeDecodeError as err:
            raise DataError(
                f"{path} is not UTF-8 text ({err.reason} at byte {err.start}); re-encode it as UTF-8"
            ) from None
        for i, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise DataError(f"{path} line {i} is not valid JSON: {err.msg}") from None
            if not isinstance(row, dict):
                raise DataError(
                    f"{path} line {i} is a JSON {type(row).__name__}, expected an object"
                )
            yield f"{path} line {i}", row
    else:
        raise DataError(
            f"{path}: unsupported dataset format {path.suffix!r}; use .jsonl or .parquet"
        )


def _example(row: dict[str, Any], where: str, prompt_key: str, answer_key: str) -> Example:
    prompt = _lookup(row, prompt_key, where, "data.prompt_key")
    if isinstance(prompt, str):
        pass
    elif isinstance(prompt, list) and all(
        isinstance(m, dict) and "content" in m and "role" in m for m in prompt
    ):
        prompt = [{"role": str(m["role"]), "content": str(m["content"])} for m in prompt]
    else:
        raise DataError(
            f"{where}: {prompt_key!r} must be text or a list of {{role, content}} messages"
        )
    answer = _lookup(row, answer_key, where, "data.answer_key")
    extra = row.get("extra_info") or {}
    return Example(
        prompt=prompt,
        ground_truth=str(answer),
        data_source=str(row.get("data_source") or "unknown"),
        extra_info=extra if isinstance(extra, dict) else {"value": extra},
        columns={k: v for k, v in row.items() if k != prompt_key},
    )


def _lookup(row: dict[str, Any], dotted: str, where: str, option: str) -> Any:
    value: Any = row
    for part in dotted.split("."):
        if not isinstance(value, dict) or part not in value:
            raise DataError(
                f"{where} has no column {dotted!r} (columns: {', '.join(row)}); set {option}"
            )
        value = value[part]
    return value
