"""Loading the policy and its frozen KL reference from local Hugging Face directories."""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from specrl.actor.data_parallel import SINGLE, Rank
from specrl.actor.update import Actor
from specrl.algorithms.losses import ClipConfig
from specrl.config import Config
from specrl.errors import UserError, first_line
from specrl.lora import load_adapters, with_adapters

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelLoadError(UserError):
    """The configured model directory is missing or unusable."""


def load_policy(
    path: str | Path, dtype: str, log=print
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """A local Hugging Face causal LM and its tokenizer."""
    directory = Path(path)
    if not (directory / "config.json").is_file():
        what = "does not exist" if not directory.exists() else "has no config.json"
        raise ModelLoadError(
            f"model.path {str(directory)!r} {what}; point it at a local Hugging Face model directory "
            "(config.json, weights, tokenizer files) or leave it unset for the built-in tiny policy"
        )
    try:
        tokenizer = AutoTokenizer.from_pretrained(directory)
        model = AutoModelForCausalLM.from_pretrained(directory, dtype=DTYPES[dtype])
    except Exception as err:  # transformers, safetensors and tokenizers each raise their own
        raise ModelLoadError(
            f"model.path {str(directory)!r} could not be loaded ({type(err).__name__}: {first_line(err)}); "
            "check that its weights and tokenizer files are complete"
        ) from None
    _check_vocabulary(directory, model, tokenizer)
    if tokenizer.pad_token_id is None:
        if tokenizer.eos_token is None:
            raise ModelLoadError(
                f"the tokenizer in {str(directory)!r} has neither a pad nor an eos token; "
                "add an eos_token to its tokenizer_config.json"
            )
        tokenizer.pad_token = tokenizer.eos_token
        log(
            f"warning: the tokenizer has no pad token; padding with its eos token {tokenizer.eos_token!r}"
        )
    return model, tokenizer


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


def _check_vocabulary(
    directory: Path, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase
) -> None:
    """transformers builds a tokenizer of a single token from a directory without tokenizer
    files, and the run would only fail later: a vocabulary that is trivial or larger than the
    model's embedding stops here."""
    rows = model.get_input_embeddings().num_embeddings
    if 2 < len(tokenizer) <= rows:
        return
    present = [f for f in TOKENIZER_FILES if (directory / f).is_file()]
    files = f"it has {', '.join(present)}" if present else f"none of {', '.join(TOKENIZER_FILES)}"
    raise ModelLoadError(
        f"the tokenizer in model.path {str(directory)!r} has {len(tokenizer)} tokens for a model "
        f"with {rows} token embeddings ({files}); copy the model's own tokenizer files into it"
    )


def reference_policy(
    policy: PreTrainedModel, policy_path: Path, initial_path: Path, dtype: str, log=print
) -> PreTrainedModel:
    """The frozen KL reference: the initial policy (a copy of `policy` when it was loaded from
    `initial_path`; loaded from there again when `policy` was resumed from a checkpoint)."""
    if Path(policy_path) == Path(initial_path):
        reference = copy.deepcopy(policy)
    else:
        reference = load_policy(initial_path, dtype, log)[0]
    return reference.eval().requires_grad_(False)


def load_trained_policy(
    cfg: Config, model_dir: Path, initial_dir: Path, log=print
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The policy as training sees it and its tokenizer: the model in `model_dir` (a checkpoint
    or `initial_dir`); with `actor.lora.rank` > 0, the base model in `initial_dir` with the
    adapters of the checkpoint in `model_dir`, or fresh ones (seeded: every copy is the same)."""
    lora = cfg.actor.lora
    if not lora.rank:
        return load_policy(model_dir, cfg.model.dtype, log)
    base, tokenizer = load_policy(initial_dir, cfg.model.dtype, log)
    if Path(model_dir) != Path(initial_dir):
        return load_adapters(base, Path(model_dir)), tokenizer
    return with_adapters(base, lora, cfg.trainer.seed), tokenizer


def load_actor(
    cfg: Config,
    model_dir: Path,
    initial_dir: Path,
    log=print,
    rank: Rank = SINGLE,
    device: torch.device | str = "cpu",
) -> tuple[Actor, PreTrainedTokenizerBase]:
    """The actor of a run, as learner `rank` runs it on `device` (the policy from `model_dir`,
    a checkpoint or `initial_dir`; the frozen reference from `initial_dir` when a KL loss is
    on; with LoRA, the policy with its adapters disabled) and the policy's tokenizer."""
    policy, tokenizer = load_trained_policy(cfg, model_dir, initial_dir, log)
    policy.to(device)
    reference = None
    if cfg.actor.use_kl_loss and not cfg.actor.lora.rank:
        reference = reference_policy(policy, model_dir, initial_dir, cfg.model.dtype, log)
        reference.to(device)
    loss = cfg.actor.policy_loss
    gspo = loss.loss_mode == "gspo"  # GSPO clips sequence ratios, within its own ranges
    clip = ClipConfig(
        loss.gspo_clip_ratio_low if gspo else cfg.actor.clip_ratio_low,
        loss.gspo_clip_ratio_high if gspo else cfg.actor.clip_ratio_high,
        cfg.actor.clip_ratio_c,
        cfg.actor.loss_agg_mode,
        cfg.data.max_response_length,
        loss.loss_mode,
    )
    return Actor(policy, cfg.actor, clip, cfg.rollout.temperature, reference, rank), tokenizer


def eos_token_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """The ids that end a response: the generation config's, else the tokenizer's eos."""
    eos = model.generation_config.eos_token_id
    return [eos] if isinstance(eos, int) else list(eos or [tokenizer.eos_token_id])
