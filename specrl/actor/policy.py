"""The policy as training holds it (with LoRA: base + adapters), its frozen KL reference, and
the actor around them."""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from transformers import (
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from specrl.actor.data_parallel import SINGLE, Rank
from specrl.actor.update import Actor
from specrl.algorithms.losses import ClipConfig
from specrl.config import Config
from specrl.lora import load_adapters, with_adapters
from specrl.models import load_policy


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
