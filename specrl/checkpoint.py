"""Checkpoints: everything a resume needs, written atomically.

Layout: RUN_DIR/checkpoints/global_step_{s}/ with the policy and tokenizer (save_pretrained) and
trainer_state.pt (optimizer, scheduler, RNG states, loader position, step, rollout store, token
trees and draft-width statistics). The directory is written under a temporary name, fsynced and
renamed, so a process killed mid-save leaves the previous checkpoints intact and no half
checkpoint under a final name.
"""

from __future__ import annotations

import os
import random
import re
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from specrl.errors import UserError

if TYPE_CHECKING:
    from specrl.trainer import Trainer

STATE_FILE = "trainer_state.pt"
_STEP_DIR = re.compile(r"global_step_(\d+)")


class CheckpointError(UserError):
    """A checkpoint to resume from is missing or unreadable."""


def save_checkpoint(trainer: Trainer) -> Path:
    root = trainer.run_dir / "checkpoints"
    final = root / f"global_step_{trainer.global_step}"
    staging = final.with_name(final.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    trainer.policy.save_pretrained(staging)
    trainer.tokenizer.save_pretrained(staging)
    state = {
        "global_step": trainer.global_step,
        "optimizer": trainer.optimizer.state_dict(),
        "scheduler": trainer.scheduler.state_dict(),
        "loader": trainer.loader.state_dict(),
        "rollout_store": trainer.store.state_dict(),
        "token_tree": None if trainer.rollout.tree is None else trainer.rollout.tree.state_dict(),
        "draft_width": trainer.rollout.draft_width.state_dict(),
        "rng": {
            "python": random.getstate(),
            "numpy": np.random.get_state(),
            "torch": torch.get_rng_state(),
        },
    }
    torch.save(state, staging / STATE_FILE)
    for file in staging.iterdir():
        _fsync(file)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(staging, final)
    _fsync(root)
    _prune(root, trainer.cfg.trainer.max_ckpt_to_keep)
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


def load_trainer_state(path: Path) -> dict[str, Any]:
    try:
        return torch.load(path / STATE_FILE, weights_only=False)
    except Exception as err:
        raise CheckpointError(
            f"checkpoint {path} is unreadable ({type(err).__name__}: {err}); delete it to resume from an "
            "earlier one, or set trainer.resume_mode=disable to start over"
        ) from None


def restore(trainer: Trainer, state: dict[str, Any]) -> None:
    trainer.global_step = state["global_step"]
    trainer.optimizer.load_state_dict(state["optimizer"])
    trainer.scheduler.load_state_dict(state["scheduler"])
    trainer.loader.load_state_dict(state["loader"])
    trainer.store.load_state_dict(state["rollout_store"])
    if trainer.rollout.tree is not None and state.get("token_tree") is not None:
        trainer.rollout.tree.load_state_dict(state["token_tree"])
    if "draft_width" in state:
        trainer.rollout.draft_width.load_state_dict(state["draft_width"])
    random.setstate(state["rng"]["python"])
    np.random.set_state(state["rng"]["numpy"])
    torch.set_rng_state(state["rng"]["torch"])


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
