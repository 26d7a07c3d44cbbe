"""Checkpoints: everything a resume needs, written atomically.

Layout: RUN_DIR/checkpoints/global_step_{s}/ with the policy and tokenizer (save_pretrained; a
LoRA policy: its adapters in peft's format and base_model.json, the base's path and hash) and
trainer_state.pt: the step, the RNG states and the `state_dict()` of every object handed in by
name (the trainer hands its actor: optimizer and schedule; its loader: the position in the data;
its speculative stage: drafts, token trees and draft-width statistics). Each object knows its own
state; this module only writes and reads it. The directory is written under a temporary name, fsynced and
renamed, so a process killed mid-save leaves the previous checkpoints intact and no half
checkpoint under a final name.
"""

from __future__ import annotations

import os
import random
import re
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
import yaml
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from specrl.config import flatten
from specrl.errors import UserError, first_line
from specrl.lora import save_base_identity

STATE_FILE = "trainer_state.pt"
_STEP_DIR = re.compile(r"global_step_(\d+)")


class CheckpointError(UserError):
    """A checkpoint to resume from is missing or unreadable."""


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def save_checkpoint(
    run_dir: Path,
    step: int,
    policy: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    parts: Mapping[str, Stateful],
    keep: int | None = None,
    base_model: dict[str, str] | None = None,
) -> Path:
    """Write checkpoint `step` of the run (then keep only the newest `keep`): → its directory.
    A LoRA policy saves its adapters alone, with `base_model` (its base's path and hash)."""
    root = run_dir / "checkpoints"
    final = root / f"global_step_{step}"
    staging = final.with_name(final.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    policy.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    if base_model is not None:
        save_base_identity(staging, base_model)
    state = {
        "global_step": step,
        "rng": {
            "python": random.getstate(),
            "numpy": np.random.get_state(),
            "torch": torch.get_rng_state(),
        },
        "torch_threads": torch.get_num_threads(),  # a resumed run computes with them again
        **{name: part.state_dict() for name, part in parts.items()},
    }
    torch.save(state, staging / STATE_FILE)
    for file in staging.iterdir():
        _fsync(file)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(staging, final)
    _fsync(root)
    _prune(root, keep)
    return final


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete checkpoint of a run (a `.tmp` left by a killed save is ignored)."""
    done = [p for p in _checkpoints(run_dir / "checkpoints") if (p / STATE_FILE).is_file()]
    return done[-1] if done else None


def resolve_resume(resume_mode: str, run_dir: Path) -> Path | None:
    if resume_mode == "disable":
        return None
    if resume_mode == "auto":
        return latest_checkpoint(run_dir)
    path = Path(resume_mode)
    if not (path / STATE_FILE).is_file():
        raise CheckpointError(
            f"trainer.resume_mode={resume_mode!r} is not a checkpoint directory (no {STATE_FILE}); "
            "use auto, disable or a checkpoints/global_step_N path"
        )
    return path


# What a resumed run cannot change: the prompts and order its loader's saved position points
# into, the weights it continues from, and which parts its checkpoint holds (a critic or not)
FIXED_ON_RESUME = (
    "model.path", "data.task", "data.train_files", "data.train_size", "data.train_batch_size",
    "data.shuffle", "trainer.seed", "algorithm.adv_estimator", "actor.lora.rank",
    "actor.lora.target_modules", "critic.lora.rank", "critic.lora.target_modules",
)  # fmt: skip
# what extending or moving a run changes as a matter of course: not reported
FREE_ON_RESUME = ("trainer.total_training_steps", "trainer.total_epochs", "trainer.resume_mode")


def check_resumed_config(run_dir: Path, config: dict[str, Any], step: int, log) -> None:
    """Compare a resumed run's config (`model_dump(mode="json")`) with the one the run was
    started with (RUN_DIR/config.yaml): refuse the changes of FIXED_ON_RESUME in one line, print
    the others, and keep the old config as config.step{step}.yaml beside the new one."""
    path = run_dir / "config.yaml"
    if not path.is_file():
        return
    old = dict(flatten(yaml.safe_load(path.read_text()) or {}))
    new = dict(flatten(config))
    changed = [
        key
        for key in sorted(old.keys() | new.keys())
        if old.get(key) != new.get(key) and key not in FREE_ON_RESUME
    ]
    fixed = [key for key in changed if key in FIXED_ON_RESUME]
    if fixed:
        shown = ", ".join(f"{key}: {old.get(key)!r} → {new.get(key)!r}" for key in fixed)
        raise CheckpointError(
            f"resuming {run_dir} at step {step} with {shown}: a resumed run cannot change "
            "that; restore it, use another trainer.output_dir, or set "
            "trainer.resume_mode=disable to start over"
        )
    if changed:
        kept = run_dir / f"config.step{step}.yaml"
        shutil.copyfile(path, kept)
        shown = ", ".join(f"{key}: {old.get(key)!r} → {new.get(key)!r}" for key in changed)
        log(f"resuming with a changed config ({shown}); the old one is kept as {kept}")


def load_trainer_state(path: Path) -> dict[str, Any]:
    try:
        return torch.load(path / STATE_FILE, weights_only=False)
    except Exception as err:
        raise CheckpointError(
            f"checkpoint {path} is unreadable ({type(err).__name__}: {err}); delete it to resume from an "
            "earlier one, or set trainer.resume_mode=disable to start over"
        ) from None


def restore(path: Path, state: dict[str, Any], parts: Mapping[str, Stateful]) -> int:
    """Load every part's state and the RNG states from a checkpoint's state: → its step."""
    missing = [name for name in parts if name not in state]
    if missing:
        raise CheckpointError(
            f"checkpoint {path} has no state for {', '.join(missing)} (written by an older "
            "specrl?); set trainer.resume_mode=disable to start over"
        )
    for name, part in parts.items():
        try:
            part.load_state_dict(state[name])
        except UserError:
            raise
        except Exception as err:  # each part's loader (torch, ours) raises its own
            raise CheckpointError(
                f"checkpoint {path}: its {name} state does not fit this run "
                f"({type(err).__name__}: {first_line(err)}); it was written by another specrl version "
                "or another config; set trainer.resume_mode=disable to start over"
            ) from None
    random.setstate(state["rng"]["python"])
    np.random.set_state(state["rng"]["numpy"])
    torch.set_rng_state(state["rng"]["torch"])
    return state["global_step"]


def _checkpoints(root: Path) -> list[Path]:
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.fullmatch(p.name))]
    return [p for _, p in sorted(found)]


def _prune(root: Path, keep: int | None) -> None:
    if keep is None:
        return
    for old in _checkpoints(root)[:-keep]:
        shutil.rmtree(old)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
