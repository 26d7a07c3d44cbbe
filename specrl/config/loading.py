"""Loading a config: YAML, dotted overrides, verl's spellings, one-line errors; and printing one
(every key with its description and default)."""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from specrl.config.schema import Config
from specrl.config.section import ConfigError

# verl's spellings of our keys: a key or a dotted prefix → ours (keys first: the first match wins)
VERL_ALIASES = {
    "actor_rollout_ref.model.lora_rank": "actor.lora.rank",
    "actor_rollout_ref.model.lora_alpha": "actor.lora.alpha",
    "actor_rollout_ref.model.target_modules": "actor.lora.target_modules",
    "critic.model.lora_rank": "critic.lora.rank",
    "critic.model.lora_alpha": "critic.lora.alpha",
    "critic.model.target_modules": "critic.lora.target_modules",
    "actor_rollout_ref.rollout.": "rollout.",
    "actor_rollout_ref.actor.": "actor.",
    "actor_rollout_ref.model.": "model.",
    "trainer.default_local_dir": "trainer.output_dir",
}


def load_config(path: str | Path | None = None, overrides: Sequence[str] = (), log=None) -> Config:
    """Defaults, then the YAML file, then `key=value` overrides (values parsed as YAML). verl's
    spellings of a key (VERL_ALIASES) are accepted, with a note to `log`."""
    pairs = flatten(_read_yaml(Path(path))) if path is not None else []
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} is not of the form key=value (e.g. rollout.n=4)")
        pairs.append((key.strip(), yaml.safe_load(value) if value.strip() else None))
    raw: dict[str, Any] = {}
    for key, value in pairs:
        _set_dotted(raw, _unaliased(key, log), value)
    return validated(raw)


def validated(raw: dict[str, Any]) -> Config:
    """The config of a nested dict of values, or one `ConfigError` naming the problem."""
    try:
        return Config.model_validate(raw)
    except ValidationError as err:
        raise ConfigError(_describe(err.errors()[0])) from None


def describe_config(cfg: BaseModel, indent: str = "") -> str:
    """The config as YAML, every key with its description and default in a comment."""
    lines = []
    for name, field in type(cfg).model_fields.items():
        value = getattr(cfg, name)
        if isinstance(value, BaseModel):
            lines.append(f"{indent}{name}:  # {field.description or ''}".rstrip(" #"))
            lines.append(describe_config(value, indent + "  "))
            continue
        shown = _yaml_scalar(value)
        default = field.get_default(call_default_factory=True)
        note = field.description or ""
        if default != value:
            note += f" (default: {_yaml_scalar(default)})"
        lines.append(f"{indent}{name}: {shown}  # {note}")
    return "\n".join(lines)


def sections_help() -> str:
    """The sections of a config and how to set a key, for `specrl train --help`."""
    rows = [f"  {name:24} {field.description}" for name, field in Config.model_fields.items()]
    return "\n".join(
        [
            "config sections (every key with its description and default: specrl config):",
            *rows,
            "set a key with a dotted override, e.g. rollout.n=16 actor.optim.lr=3e-6, or in a "
            "YAML file given with --config; verl's names (actor_rollout_ref.rollout.n, "
            "trainer.default_local_dir) are accepted",
        ]
    )


def _yaml_scalar(value: Any) -> str:
    if isinstance(value, tuple):
        value = list(value)
    return (
        yaml.safe_dump(value, default_flow_style=True, width=1000)
        .strip()
        .removesuffix("...")
        .strip()
    )


def save_config(cfg: Config, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))


def _unaliased(key: str, log) -> str:
    """Our name for `key`: verl's prefixes (VERL_ALIASES) mapped, and verl's `X_per_gpu` batch
    sizes (e.g. ppo_micro_batch_size_per_gpu) are our `X`, which is per learner rank."""
    mapped = key
    for theirs, ours in VERL_ALIASES.items():
        if key == theirs or (theirs.endswith(".") and key.startswith(theirs)):
            mapped = ours + key.removeprefix(theirs)
            break
    if mapped.endswith("_per_gpu") and _is_field(mapped.removesuffix("_per_gpu")):
        mapped = mapped.removesuffix("_per_gpu")
    if mapped != key and log is not None:
        log(f"note: {key} is verl's name; specrl calls it {mapped}")
    return mapped


def _is_field(key: str) -> bool:
    model: Any = Config
    for part in key.split("."):
        field = getattr(model, "model_fields", {}).get(part)
        if field is None:
            return False
        model = field.annotation
    return True


def flatten(raw: dict[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    """Nested sections → (dotted key, value) pairs; values that are not sections stay whole."""
    out = []
    for key, value in raw.items():
        if isinstance(value, dict) and value:
            out += flatten(value, f"{prefix}{key}.")
        else:
            out.append((f"{prefix}{key}", value))
    return out


def _read_yaml(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f":{mark.line + 1}:{mark.column + 1}" if mark is not None else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ConfigError(f"config file {path}{where} is not valid YAML: {problem}") from None
    if not isinstance(raw, dict):
        raise ConfigError(
            f"config file {path} must hold a mapping of sections, not {type(raw).__name__}"
        )
    return raw


def _set_dotted(raw: dict[str, Any], key: str, value: Any) -> None:
    *parents, leaf = key.split(".")
    node = raw
    for i, part in enumerate(parents):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"cannot set {key}: {'.'.join(parents[: i + 1])} is not a section")
        node = child
    node[leaf] = value


def _describe(error: dict[str, Any]) -> str:
    loc = [str(p) for p in error["loc"]]
    key = ".".join(loc) or "config"
    if error["type"] == "extra_forbidden":
        return f"unknown config key {key!r}{_suggestion(loc)}"
    if error["type"] == "value_error":
        return f"invalid config: {str(error['msg']).removeprefix('Value error, ')}"
    value = error.get("input")
    return f"invalid value for {key}: {value!r} ({error['msg'].lower()})"


def _suggestion(loc: list[str]) -> str:
    """' (did you mean ...?)' for the closest valid key of the section that holds `loc[-1]`."""
    model: type[BaseModel] = Config
    for part in loc[:-1]:
        field = model.model_fields.get(part)
        if (
            field is None
            or not isinstance(field.annotation, type)
            or not issubclass(field.annotation, BaseModel)
        ):
            return ""
        model = field.annotation
    valid = list(model.model_fields)
    match = difflib.get_close_matches(loc[-1], valid, n=1)
    prefix = ".".join(loc[:-1])
    if match:
        return f" (did you mean {'.'.join([*loc[:-1], match[0]])!r}?)"
    return f"; valid keys{' of ' + prefix if prefix else ''}: {', '.join(valid)}"
