"""LoRA adapters through peft (`actor.lora.rank` > 0; `critic.lora` for the value model).

The policy is then the base model with adapters: only the adapters are trained, and the KL
reference is the same model with its adapters disabled (no second copy of the weights). What
leaves the trainer after an update is the adapters alone (`trained_weights`: a transformers
engine that carries the same adapters loads them) or the merged weights under the base model's
parameter names (`merged_state`: for vLLM, which then serves base + adapter as one model).
Checkpoints hold the adapters, their optimizer state and the base model's identity
(`base_identity`: its path and a hash of its weight files), which a resume checks before loading.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import peft
import torch
from peft.tuners.lora import LoraLayer
from transformers import PreTrainedModel

from specrl.config import LoraConfig
from specrl.errors import UserError, first_line

BASE_FILE = "base_model.json"
WEIGHT_SUFFIXES = (".safetensors", ".bin")


class LoraTargetError(UserError):
    """`target_modules` names no module of the model."""


class BaseModelError(UserError):
    """A checkpoint resumed as a LoRA one that is not, or whose adapters were trained on another
    base model."""


def with_adapters(
    model: PreTrainedModel,
    cfg: LoraConfig,
    seed: int,
    task_type: str = "CAUSAL_LM",
    key: str = "actor.lora",
) -> peft.PeftModel:
    """`model` with fresh adapters (A random, B = 0: the model computes what the base does).
    Their initialisation is seeded, so every learner rank and every copy builds the same ones.
    A token-classification model (the critic) trains its value head fully beside them. `key`:
    the config section, named when its target modules are not in the model."""
    exclude = ["score", "classifier"] if task_type == "TOKEN_CLS" else None
    config = peft.LoraConfig(
        r=cfg.rank,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules=cfg.target_modules,
        exclude_modules=exclude,
        task_type=task_type,
        bias="none",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        try:
            return peft.get_peft_model(model, config)
        except ValueError as err:  # no module matches (peft's NoMatchingPeftModuleError)
            linear = sorted(
                {
                    n.rsplit(".", 1)[-1]
                    for n, m in model.named_modules()
                    if type(m).__name__ == "Linear"
                }
            )
            raise LoraTargetError(
                f"{key}.target_modules={cfg.target_modules!r} matches no module of the model "
                f"({first_line(err)}); its linear layers are {', '.join(linear)}, or use all-linear"
            ) from None


def load_adapters(model: PreTrainedModel, directory: Path) -> peft.PeftModel:
    """`model` with the trainable adapters saved in `directory` (a checkpoint)."""
    return peft.PeftModel.from_pretrained(model, directory, is_trainable=True)


def peft_model(model: torch.nn.Module) -> peft.PeftModel | None:
    """The PeftModel inside `model` (as it is, or wrapped by DDP), or None without adapters."""
    inner = getattr(model, "module", model)
    return inner if isinstance(inner, peft.PeftModel) else None


def trained_weights(
    model: torch.nn.Module, full: dict[str, torch.Tensor] | None = None
) -> dict[str, torch.Tensor]:
    """The entries of the model's state dict that training changes, under the model's own names
    (any copy built the same way loads them): all of them, or with adapters the adapters (and a
    critic's value head). `full`: the full state dict when already gathered from sharded ranks."""
    state = model.state_dict() if full is None else full
    adapted = peft_model(model)
    if adapted is None:
        return state
    trained = {name for name, p in adapted.named_parameters() if p.requires_grad}
    return {name: tensor for name, tensor in state.items() if name in trained}


def load_trained_weights(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load `trained_weights` into a copy of the model built the same way."""
    adapted = peft_model(model)
    result = model.load_state_dict(state, strict=adapted is None)
    if result.unexpected_keys:
        raise KeyError(f"weights this model does not have: {result.unexpected_keys[:3]}")


@torch.no_grad()
def merged_state(model: peft.PeftModel) -> dict[str, torch.Tensor]:
    """The weights of base + adapters as one model, under the base model's parameter names (the
    training model is left as it is: nothing is merged in place)."""
    base = model.get_base_model()
    deltas = {
        f"{name}.weight": layer.get_delta_weight(layer.active_adapters[0])
        for name, layer in base.named_modules()
        if isinstance(layer, LoraLayer)
    }
    merged = {}
    for name, tensor in base.state_dict().items():
        if ".lora_" in name:
            continue
        name = name.replace(".base_layer.", ".")
        merged[name] = tensor + deltas[name].to(tensor.dtype) if name in deltas else tensor
    return merged


def rollout_weights(model: torch.nn.Module, adapters: bool) -> dict[str, torch.Tensor]:
    """What a rollout engine loads after an update: `trained_weights` for an engine whose model
    carries the same adapters (`adapters`, the transformers engine: with LoRA only they travel);
    else the merged weights of base + adapters (vLLM: measured against vLLM's own LoRA serving
    in docs/lora.md)."""
    adapted = peft_model(model)
    if not adapters and adapted is not None:
        return merged_state(adapted)
    return trained_weights(model)


def state_bytes(state: dict[str, torch.Tensor]) -> int:
    """The bytes of a state dict as they travel: a storage shared by several names (tied
    embeddings) once."""
    storages = {
        t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in state.values()
    }
    return sum(storages.values())


def base_identity(path: str | Path) -> dict[str, str]:
    """The base model of a LoRA run: its directory and a SHA-256 over its weight files."""
    digest = hashlib.sha256()
    directory = Path(path)
    for file in sorted(p for p in directory.iterdir() if p.name.endswith(WEIGHT_SUFFIXES)):
        digest.update(file.name.encode())
        with file.open("rb") as f:
            while chunk := f.read(1 << 24):
                digest.update(chunk)
    return {"path": str(directory.resolve()), "sha256": digest.hexdigest()}


def save_base_identity(directory: Path, identity: dict[str, str]) -> None:
    (directory / BASE_FILE).write_text(json.dumps(identity, indent=1))


def check_base(checkpoint: Path, base: dict[str, str]) -> None:
    """A LoRA checkpoint's adapters apply to the base model they were trained on: stop in one
    line when `base` (a `base_identity`) is another model (before any model is loaded)."""
    recorded = checkpoint / BASE_FILE
    if not recorded.is_file():
        raise BaseModelError(
            f"checkpoint {checkpoint} holds no {BASE_FILE}: it is not a LoRA checkpoint (set "
            "actor.lora.rank as the run that wrote it did)"
        )
    saved = json.loads(recorded.read_text())
    if base["sha256"] != saved["sha256"]:
        raise BaseModelError(
            f"the base model {base['path']} is not the one checkpoint {checkpoint} was trained "
            f"on (its weights differ from those of {saved['path']}); point model.path at that model"
        )
