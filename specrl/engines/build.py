"""The rollout engine a run's config names, over the trainer's policy."""

from __future__ import annotations

from pathlib import Path

from transformers import PreTrainedModel

from specrl.config import Config
from specrl.engines.hf import HFEngine
from specrl.engines.protocol import RolloutEngine, SamplingParams


def build_engine(
    cfg: Config, policy: PreTrainedModel, eos_ids: list[int], pad_id: int, model_dir: Path
) -> RolloutEngine:
    """hf wraps the trainer's own model object: weights are shared, so the sync after each update
    copies nothing. vllm loads `model_dir` and then takes the policy's current weights."""
    if cfg.rollout.name == "hf":
        return HFEngine(policy, eos_ids, pad_id, cfg.rollout.max_batch_size)
    from specrl.engines.vllm.engine import VLLMEngine

    engine = VLLMEngine.shared(
        str(model_dir),
        eos_ids,
        dtype=cfg.model.dtype,
        max_model_len=cfg.data.max_prompt_length + cfg.data.max_response_length,
        gpu_memory_utilization=cfg.rollout.gpu_memory_utilization,
        sleep_mode=cfg.rollout.enable_sleep_mode,
        seed=cfg.trainer.seed,
    )
    engine.load_weights(policy.state_dict())
    return engine


def logprobs_are_the_trainers(
    engine: RolloutEngine, policy: PreTrainedModel, sampling: SamplingParams
) -> bool:
    """Whether the rollout logprobs are the trainer's own old log-probs: the engine runs the
    trainer's model object and samples from softmax(logits / T) untruncated, so they need no
    recomputation."""
    return (
        isinstance(engine, HFEngine)
        and engine.model is policy
        and sampling.temperature > 0
        and sampling.top_p == 1
        and sampling.top_k == 0
    )
