"""`specrl export CHECKPOINT OUT`: a checkpoint's policy as an ordinary Hugging Face model
directory (weights, config, tokenizer) that `from_pretrained` loads. A LoRA checkpoint's adapters
are merged into its base model (checked against the hash the checkpoint recorded); a full
checkpoint is written out as it is."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from specrl.checkpoint import STATE_FILE
from specrl.errors import UserError
from specrl.lora import BASE_FILE, base_identity, check_base, load_adapters
from specrl.models import load_policy


class ExportError(UserError):
    """What `specrl export` was given is not a checkpoint, or its output would overwrite files."""


def export_checkpoint(checkpoint: Path, out: Path, base: str | None = None, log=print) -> Path:
    """Write the policy of `checkpoint` to `out` (a LoRA checkpoint: merged into its base model,
    the recorded one or `base`): → `out`."""
    if not (checkpoint / STATE_FILE).is_file():
        raise ExportError(
            f"{checkpoint} is not a checkpoint (no {STATE_FILE}); give a "
            "RUN_DIR/checkpoints/global_step_N directory"
        )
    if out.exists() and any(out.iterdir()):
        raise ExportError(f"{out} exists and is not empty; give a new directory")
    dtype = _run_dtype(checkpoint)
    recorded = checkpoint / BASE_FILE
    if recorded.is_file():
        base_dir = base or json.loads(recorded.read_text())["path"]
        if not (Path(base_dir) / "config.json").is_file():
            raise ExportError(
                f"the base model {base_dir} of LoRA checkpoint {checkpoint} is missing; give its "
                "directory with --base"
            )
        check_base(checkpoint, base_identity(base_dir))
        model, tokenizer = load_policy(base_dir, dtype, log)
        model = load_adapters(model, checkpoint).merge_and_unload()
        log(f"merged the adapters of {checkpoint} into {base_dir}")
    else:
        model, tokenizer = load_policy(checkpoint, dtype, log)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def _run_dtype(checkpoint: Path) -> str:
    """The dtype the run trained in (RUN_DIR/config.yaml beside its checkpoints), else float32."""
    config = checkpoint.parent.parent / "config.yaml"
    if not config.is_file():
        return "float32"
    return (yaml.safe_load(config.read_text()) or {}).get("model", {}).get("dtype", "float32")
