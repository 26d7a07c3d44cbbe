"""The rollout engine a run's config names, over the trainer's policy."""

from __future__ import annotations

from pathlib import Path

from transformers import PreTrainedModel

from specrl.config import Config
from specrl.engines.hf import HFEngine
from specrl.engines.protocol import RolloutEngine, SamplingParams
from specrl.lora import rollout_weights, with_adapters
from specrl.models import load_policy


def build_engine(
    cfg: Config, policy: PreTrainedModel, eos_ids: list[int], pad_id: int, model_dir: Path
) -> RolloutEngine:
    """hf wraps the trainer's own model object: weights are shared, so the sync after each update
    copies nothing. vllm loads `model_dir` (with LoRA: the base model) and then takes the
    policy's current weights."""
    if cfg.rollout.name == "hf":
        return HFEngine(policy, eos_ids, pad_id, cfg.rollout.max_batch_size)
    engine = _vllm_engine(cfg, eos_ids, model_dir)
    engine.load_weights(rollout_weights(policy, "vllm"))
    return engine


def build_worker_engine(
    cfg: Config, eos_ids: list[int], pad_id: int, model_dir: Path, weight_transfer: str
) -> RolloutEngine:
    """The engine of a rollout worker: its own copy of the model in `model_dir` (the weights are
    replaced by the trainer's at the first sync, through `weight_transfer`: local or nccl). With
    LoRA, hf carries the same adapters as the policy, so a sync sends only them."""
    if cfg.rollout.name == "hf":
        policy = load_policy(model_dir, cfg.model.dtype)[0]
        if cfg.actor.lora.rank:
            policy = with_adapters(policy, cfg.actor.lora, cfg.trainer.seed)
        policy.eval().requires_grad_(False)
        return HFEngine(policy, eos_ids, pad_id, cfg.rollout.max_batch_size)
    return _vllm_engine(cfg, eos_ids, model_dir, weight_transfer)


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
    )


def logprobs_are_the_trainers(cfg: Config, sampling: SamplingParams) -> bool:
    """Whether the rollout logprobs are the trainer's own old log-probs: the engine is the
    trainer's model code (hf: its model object in-process, an exact copy of its weights on a
    rollout worker) sampling from softmax(logits / T) untruncated, so they need no
    recomputation."""
    return (
        cfg.rollout.name == "hf"
        and sampling.temperature > 0
        and sampling.top_p == 1
        and sampling.top_k == 0
    )
