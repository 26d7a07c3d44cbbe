"""specrl_local: a weight-transfer backend for vLLM's RL weight-update API that hands the
trainer's tensors to the worker's `model.load_weights` in the same process (the CPU /
single-process setup; vLLM's own nccl and ipc backends are CUDA-only). Imported only by
engine.py, after vllm."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.model_executor.model_loader.reload import (
    finalize_layerwise_reload,
    initialize_layerwise_reload,
)

BACKEND = "specrl_local"


@dataclass
class LocalInit(WeightTransferInitInfo):
    pass


@dataclass
class LocalUpdate(WeightTransferUpdateInfo):
    weights: list[tuple[str, torch.Tensor]]


class LocalWeightTransfer(WeightTransferEngine[LocalInit, LocalUpdate]):
    """Tensors from the trainer in the same process, in checkpoint format: loaded with the
    model's own `load_weights` (Hugging Face names onto vLLM's fused layers) inside vLLM's
    layerwise reload, which re-runs the post-load processing (e.g. CPU weight packing)."""

    init_info_cls = LocalInit
    update_info_cls = LocalUpdate

    def init_transfer_engine(self, init_info: LocalInit) -> None:
        pass

    def start_weight_update(self) -> None:
        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        finalize_layerwise_reload(self.model, self.model_config)

    def receive_weights(self, update_info: LocalUpdate) -> None:
        self.model.load_weights(weights=update_info.weights)

    def shutdown(self) -> None:
        pass
