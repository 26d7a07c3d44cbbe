"""How new weights reach the rollout workers (`rollout.checkpoint_engine.backend`).

- object_store (CPU, hf workers, and the generic fallback): one `ray.put` of the state dict per
  step; every worker gets it from Ray's object store and loads it into its engine (vLLM through
  specrl's local weight-transfer backend). Driven by `RolloutWorkers` itself, call by call.
- nccl (vLLM workers on GPUs): vLLM's NCCL weight-transfer engine. The trainer's process is
  rank 0 of an NCCL group with every worker's vLLM and broadcasts each tensor from GPU memory
  (`NCCLTrainerWeightTransferEngine`, driven over the worker actors by vLLM's
  `RayVLLMWeightSyncClient`). A group that lost a member is rebuilt with the live workers.

`auto` is nccl where it can run (vLLM workers with GPUs, the policy on a GPU in the trainer's
process), else object_store. With several learner ranks the trainer's process holds a CPU copy
of the policy, gathered from them after each update (rank 0 gathers the full tensors; under FSDP2
every rank takes part), and publishes it through the object store. The nccl side lives in `engines/vllm/nccl_sync.py`, imported only when it is chosen (it
imports vLLM).
"""

from __future__ import annotations

import torch

from specrl.config import Config
from specrl.engines.build import engine_kind
from specrl.errors import UserError


def resolve_backend(cfg: Config) -> str:
    """The backend `rollout.checkpoint_engine.backend` names, with `auto` resolved (the config
    checked the combination of keys; what remains is whether this process has a GPU)."""
    backend = cfg.rollout.checkpoint_engine.backend
    kind = engine_kind(cfg.rollout.name)
    gpu_workers = kind.nccl_weight_sync and cfg.rollout.num_gpus_per_worker > 0
    gpu_trainer = torch.cuda.is_available() and cfg.learner_ranks == 1
    if backend == "auto":
        return "nccl" if gpu_workers and gpu_trainer else "object_store"
    if backend == "nccl" and not torch.cuda.is_available():
        raise UserError(
            "rollout.checkpoint_engine.backend=nccl broadcasts from the trainer's GPU, and this "
            "process has none; use object_store (or auto) here"
        )
    return backend
