"""Checkpoints: everything a resume needs, written atomically.

Layout: RUN_DIR/checkpoints/global_step_{s}/ with the policy and tokenizer (save_pretrained) and
trainer_state.pt (optimizer, scheduler, RNG states, loader position, step, rollout store). The
directory is written under a temporary name and renamed, so a crash mid-save never leaves a half
checkpoint under the final name.
"""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from specrl.trainer import Trainer


def save_checkpoint(trainer: Trainer) -> Path:
    final = trainer.run_dir / "checkpoints" / f"global_step_{trainer.global_step}"
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
        "rng": {
            "python": random.getstate(),
            "numpy": np.random.get_state(),
            "torch": torch.get_rng_state(),
        },
    }
    torch.save(state, staging / "trainer_state.pt")
    for file in staging.iterdir():
        with open(file, "rb") as handle:
            os.fsync(handle.fileno())
    shutil.rmtree(final, ignore_errors=True)
    os.replace(staging, final)
    return final
