"""Datasets: the built-in task or jsonl/parquet files in verl's schema, tokenized into Prompts,
and the seeded loader that walks them epoch by epoch."""

from __future__ import annotations

import dataclasses
import random
from collections import Counter
from collections.abc import Sequence
from typing import Any, Literal

from transformers import PreTrainedTokenizerBase

from specrl.config import DataConfig
from specrl.data import arithmetic
from specrl.data.files import DataError, read_examples
from specrl.types import Example, Prompt

__all__ = [
    "DataError",
    "PromptLoader",
    "encode_prompt",
    "format_prompts",
    "load_prompts",
    "prompt_text",
    "read_splits",
    "tokenize_splits",
]


def load_prompts(
    cfg: DataConfig, tokenizer: PreTrainedTokenizerBase, seed: int, log=print
) -> tuple[list[Prompt], list[Prompt]]:
    """→ (train, val) prompts. Without files, the built-in task split for `seed`."""
    return tokenize_splits(read_splits(cfg, seed), tokenizer, cfg, log)


def read_splits(cfg: DataConfig, seed: int) -> tuple[list[Example], list[Example]]:
    """→ (train, val) examples, read and checked without a tokenizer (a bad file stops a run
    before any model loads). Without files, the built-in task split for `seed`."""
    if cfg.train_files is None:
        task = arithmetic.TASKS[cfg.task]
        train_problems, val_problems = arithmetic.make_split(
            seed, cfg.train_size, cfg.val_size, task.min_digits, task.max_digits
        )
        train_examples = [p.example() for p in train_problems]
        val_examples = [p.example() for p in val_problems]
    else:
        train_examples = read_examples(cfg.train_files, cfg.prompt_key, cfg.answer_key)
        if cfg.val_files is None:
            raise DataError("data.val_files is required when data.train_files is set")
        val_examples = read_examples(
            cfg.val_files, cfg.prompt_key, cfg.answer_key, "data.val_files"
        )
    return train_examples, val_examples


def format_prompts(
    splits: tuple[list[Example], list[Example]],
    chat_template: str | None,
    apply_chat_template: Literal["auto", True, False],
) -> tuple[tuple[list[Example], list[Example]], str | None]:
    """(train, val) examples in the form the model is fed (`data.apply_chat_template`), and a
    one-line note of what was done with plain text (None when nothing needs saying). With a chat
    template, auto and true wrap a plain-text prompt as one user message; false turns messages
    into their contents joined by newlines. Checked before any model loads."""
    has_template = bool(chat_template)
    if apply_chat_template is True and not has_template:
        raise DataError(
            "data.apply_chat_template=true, and the model's tokenizer has no chat template; "
            "set data.apply_chat_template=auto (or false) to feed the prompts as they are"
        )
    plain_counts = [sum(isinstance(e.prompt, str) for e in split) for split in splits]
    chat_counts = [len(split) - n for split, n in zip(splits, plain_counts, strict=True)]
    plain, chat = _counted(plain_counts, "plain-text"), _counted(chat_counts, "chat")
    if apply_chat_template is False:
        splits = tuple([_as_text(e) for e in split] for split in splits)  # type: ignore[assignment]
        if has_template and plain:
            return splits, (
                f"data: {plain} prompts are fed as they are, without the model's chat template "
                "(data.apply_chat_template=false, TRL's plain-text format): a chat model may not "
                "answer them as you expect"
            )
        if chat:
            return splits, (
                f"data: {chat} prompts are fed as their contents joined by newlines "
                "(data.apply_chat_template=false)"
            )
        return splits, None
    if not has_template:
        if chat:
            return splits, (
                f"data: the model's tokenizer has no chat template: {chat} prompts are fed as "
                "their contents joined by newlines"
            )
        return splits, None
    if not plain:
        return splits, None
    splits = tuple([_as_message(e) for e in split] for split in splits)  # type: ignore[assignment]
    return splits, (
        f"data: {plain} prompts are rendered through the model's chat template as one user "
        "message each (data.apply_chat_template=auto, as verl); data.apply_chat_template=false "
        "feeds them as they are (TRL's plain-text format)"
    )


def _counted(counts: list[int], kind: str) -> str:
    """'3 train and 1 val plain-text' for counts [3, 1]; '' when both are 0."""
    if not any(counts):
        return ""
    return f"{counts[0]} train and {counts[1]} val {kind}"


def _as_message(example: Example) -> Example:
    if not isinstance(example.prompt, str):
        return example
    return dataclasses.replace(example, prompt=[{"role": "user", "content": example.prompt}])


def _as_text(example: Example) -> Example:
    if isinstance(example.prompt, str):
        return example
    return dataclasses.replace(example, prompt="\n".join(m["content"] for m in example.prompt))


def tokenize_splits(
    splits: tuple[list[Example], list[Example]],
    tokenizer: PreTrainedTokenizerBase,
    cfg: DataConfig,
    log=print,
) -> tuple[list[Prompt], list[Prompt]]:
    """(train, val) examples → prompts, checked against `data.max_prompt_length`."""
    train = _tokenize(splits[0], tokenizer, cfg, "train", log)
    return train, _tokenize(splits[1], tokenizer, cfg, "val", log)


def prompt_text(example: Example, tokenizer: PreTrainedTokenizerBase) -> str:
    """The prompt as the model sees it: chat messages through the tokenizer's chat template when
    it has one, else their contents joined by newlines; plain text as is."""
    if isinstance(example.prompt, str):
        return example.prompt
    if tokenizer.chat_template:
        return tokenizer.apply_chat_template(
            example.prompt, add_generation_prompt=True, tokenize=False
        )
    return "\n".join(m["content"] for m in example.prompt)


def encode_prompt(example: Example, tokenizer: PreTrainedTokenizerBase) -> Prompt:
    # a chat template writes its own special tokens; plain text gets the tokenizer's (e.g. BOS)
    templated = not isinstance(example.prompt, str) and bool(tokenizer.chat_template)
    ids = tokenizer(prompt_text(example, tokenizer), add_special_tokens=not templated)["input_ids"]
    return Prompt(tuple(ids), example)


def _tokenize(
    examples: Sequence[Example],
    tokenizer: PreTrainedTokenizerBase,
    cfg: DataConfig,
    split: str,
    log,
) -> list[Prompt]:
    """Prompts longer than data.max_prompt_length, and prompts with no token the tokenizer
    knows (empty text, or only characters it lacks), stop the run (data.truncation=error) or are
    dropped and counted (data.truncation=filter). Prompts that lose some characters to the
    tokenizer's unknown token are counted in a warning."""
    prompts = [encode_prompt(e, tokenizer) for e in examples]
    unknown = tokenizer.unk_token_id
    known = [p for p in prompts if any(t != unknown for t in p.ids)]
    empty = [p for p in prompts if all(t == unknown for t in p.ids)]
    if empty and cfg.truncation == "error":
        raise DataError(
            f"{len(empty)} of {len(prompts)} {split} prompts have no token the tokenizer knows "
            f"(first: {prompt_text(empty[0].example, tokenizer)!r}); remove them, or set "
            "data.truncation=filter to drop them"
        )
    if empty:
        log(
            f"data.truncation=filter: dropped {len(empty)} of {len(prompts)} {split} prompts "
            "with no token the tokenizer knows"
        )
        prompts = known
    lost = [(p, _lost_characters(p, tokenizer)) for p in prompts]
    lossy = [(p, characters) for p, characters in lost if characters]
    if lossy:
        text = prompt_text(lossy[0][0].example, tokenizer)
        seen = tokenizer.decode(lossy[0][0].ids, skip_special_tokens=True)
        characters = sorted(set().union(*(c for _, c in lossy)))
        log(
            f"warning: {len(lossy)} of {len(prompts)} {split} prompts lose characters to the "
            f"tokenizer ({''.join(characters[:20])!r}{'...' if len(characters) > 20 else ''}; "
            f"first: {text!r} → {seen!r}): the model never sees them. The built-in policies "
            "know only their task's characters: train on your data with a model that knows "
            "them (model.path=<a Hugging Face model directory> or "
            "builtin:smollm2-135m-instruct)"
        )
    kept = [p for p in prompts if len(p.ids) <= cfg.max_prompt_length]
    too_long = len(prompts) - len(kept)
    if too_long and cfg.truncation == "error":
        longest = max(len(p.ids) for p in prompts)
        raise DataError(
            f"{too_long} of {len(prompts)} {split} prompts are longer than data.max_prompt_length="
            f"{cfg.max_prompt_length} tokens (longest: {longest}); raise data.max_prompt_length "
            "or set data.truncation=filter to drop them"
        )
    if too_long:
        log(
            f"data.truncation=filter: dropped {too_long} of {len(prompts)} {split} prompts longer than {cfg.max_prompt_length} tokens"
        )
    if not kept:
        raise DataError(
            f"no {split} prompt fits in data.max_prompt_length={cfg.max_prompt_length} tokens"
        )
    return kept


def _lost_characters(prompt: Prompt, tokenizer: PreTrainedTokenizerBase) -> set[str]:
    """The characters of the prompt's text that its tokens do not give back (whitespace and
    special tokens aside): unknown characters, and characters a tokenizer drops silently."""
    text = prompt_text(prompt.example, tokenizer)
    back = tokenizer.decode(prompt.ids, skip_special_tokens=False)
    for special in tokenizer.all_special_tokens:
        text, back = text.replace(special, ""), back.replace(special, "")
    return {c for c in Counter(text) - Counter(back) if not c.isspace()}


class PromptLoader:
    """Batches of prompts in a seeded order, reshuffled every epoch; the last partial batch of an
    epoch is dropped. Its position is part of a checkpoint."""

    def __init__(
        self, prompts: Sequence[Prompt], batch_size: int, shuffle: bool, seed: int
    ) -> None:
        if len(prompts) < batch_size:
            raise DataError(
                f"{len(prompts)} training prompts is fewer than data.train_batch_size={batch_size}"
            )
        self.prompts = list(prompts)
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.position = 0
        self._order = self._epoch_order(self.epoch)

    @property
    def steps_per_epoch(self) -> int:
        return len(self.prompts) // self.batch_size

    def next_batch(self) -> list[Prompt]:
        if self.position + self.batch_size > len(self.prompts):
            self.epoch += 1
            self.position = 0
            self._order = self._epoch_order(self.epoch)
        batch = [
            self.prompts[i] for i in self._order[self.position : self.position + self.batch_size]
        ]
        self.position += self.batch_size
        return batch

    def peek(self) -> list[Prompt]:
        """The batch `next_batch` will return, without moving."""
        order, position = self._order, self.position
        if position + self.batch_size > len(self.prompts):
            order, position = self._epoch_order(self.epoch + 1), 0
        return [self.prompts[i] for i in order[position : position + self.batch_size]]

    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(range(len(self.prompts)))
        if self.shuffle:
            random.Random(f"loader-{self.seed}-{epoch}").shuffle(order)
        return order

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self.position = state["epoch"], state["position"]
        self._order = self._epoch_order(self.epoch)
