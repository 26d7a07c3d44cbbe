"""reasoning-gym tasks as verl-schema datasets, scored by each task's own scorer.

`specrl data chain_sum --out data/chain_sum min_terms=2 max_terms=2` writes `train.parquet` and
`val.parquet` (rows: `prompt` as chat messages, a system message asking for the answer in
`<answer>` tags and the generated question; `reward_model.ground_truth`; `data_source`
`reasoning_gym/<task>`; `extra_info.entry`, the generated item as JSON) for `data.train_files`
and `data.val_files`. The problems are generated from a seed, nothing is downloaded; the
held-out split comes from another seed and leaves out every question of the training split.

The built-in reward (`compute_score`, chosen by the data source) gives the task's
`score_answer` the content of the response's last `<answer>` tag, as reasoning-gym's own
evaluations do; a response without tags is read as its last number when the answer is a
number, else as its last line, so a small model that answers plainly is still scored.
`gsm_symbolic` regenerates word problems from GSM8K-test templates: its accuracy is not GSM8K's.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import yaml

from specrl.data.files import DataError

DATA_SOURCE = "reasoning_gym/"
SYSTEM_PROMPT = (
    "Answer the question directly. Give the final answer between <answer> and </answer> tags."
)
VAL_SEED_OFFSET = 1_000_003  # the held-out split's generator seed, past any training index
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def write_task(
    task: str,
    out: Path,
    train_size: int,
    val_size: int,
    seed: int,
    options: Sequence[str] = (),
    log=print,
) -> list[Path]:
    """Generate the task's training and held-out problems and write them as parquet."""
    gym = _reasoning_gym()
    generator = _options(task, options)
    train = _items(gym, task, generator, seed, train_size)
    seen = {item["question"] for item in train}
    pool = _items(gym, task, generator, seed + VAL_SEED_OFFSET, 4 * val_size)
    val = [item for item in pool if item["question"] not in seen][:val_size]
    if len(val) < val_size:
        log(
            f"{task}: {len(val)} held-out problems not among the training ones (asked for "
            f"{val_size}): the task's options leave few distinct problems"
        )
    if not val:
        raise DataError(f"{task}: every held-out problem also is a training problem")
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for split, items in (("train", train), ("val", val)):
        path = out / f"{split}.parquet"
        _write_parquet(path, [_row(task, split, i, item) for i, item in enumerate(items)])
        paths.append(path)
    return paths


def compute_score(
    data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None
) -> float:
    """The task's own score of the response's answer (see the module docstring)."""
    entry = json.loads((extra_info or {})["entry"])
    answer = extract_answer(solution_str, ground_truth)
    return float(_scorer(data_source.removeprefix(DATA_SOURCE))(answer, entry))


def extract_answer(response: str, ground_truth: str) -> str | None:
    tagged = re.findall(r"<answer>\s?(.*?)\s?</answer>", response, flags=re.DOTALL)
    if tagged:
        return tagged[-1].strip()
    if _NUMBER.fullmatch(ground_truth.strip()):
        numbers = _NUMBER.findall(response)
        return numbers[-1] if numbers else None
    lines = [line.strip() for line in response.splitlines() if line.strip()]
    return lines[-1] if lines else None


@functools.cache
def _scorer(task: str) -> Callable[[str | None, dict], float]:
    return _reasoning_gym().get_score_answer_fn(task)


def _reasoning_gym():
    try:
        import reasoning_gym
    except ImportError:
        raise DataError(
            "reasoning-gym tasks need reasoning-gym: pip install 'specrl[reasoning-gym]'"
        ) from None
    return reasoning_gym


def _options(task: str, options: Sequence[str]) -> dict[str, Any]:
    """key=value options of the task's generator, checked against its config's fields."""
    from reasoning_gym.factory import DATASETS

    if task not in DATASETS:
        near = [name for name in sorted(DATASETS) if task in name or name in task][:5]
        hint = f" (did you mean {', '.join(near)}?)" if near else ""
        raise DataError(f"reasoning-gym has no task {task!r}{hint}")
    fields = {f.name for f in dataclasses.fields(DATASETS[task][1])} - {"seed", "size"}
    parsed = {}
    for option in options:
        key, sep, value = option.partition("=")
        if not sep or key not in fields:
            raise DataError(
                f"{task}: option {option!r} is not key=value with a key among "
                f"{', '.join(sorted(fields))}"
            )
        parsed[key] = yaml.safe_load(value)
    return parsed


def _items(gym, task: str, options: dict[str, Any], seed: int, size: int) -> list[dict]:
    try:
        dataset = gym.create_dataset(task, seed=seed, size=size, **options)
    except (AssertionError, TypeError, ValueError) as err:
        raise DataError(f"{task}: its generator refused {options}: {err or 'invalid'}") from None
    return [dataset[i] for i in range(size)]


def _row(task: str, split: str, index: int, item: dict) -> dict[str, Any]:
    entry = {"question": item["question"], "answer": item["answer"], "metadata": item["metadata"]}
    return {
        "data_source": DATA_SOURCE + task,
        "prompt": [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": item["question"]},
        ],
        "ability": "reasoning",
        "reward_model": {"style": "rule", "ground_truth": str(item["answer"])},
        "extra_info": {"split": split, "index": index, "entry": json.dumps(entry, default=str)},
    }


def _write_parquet(path: Path, rows: list[dict[str, Any]]) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
