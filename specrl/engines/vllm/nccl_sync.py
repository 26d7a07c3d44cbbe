"""Weights to vLLM rollout workers on GPUs through vLLM's NCCL weight-transfer engine.

The trainer's process is rank 0 of an NCCL group with every worker's vLLM and broadcasts each
tensor from GPU memory: vLLM's `NCCLTrainerWeightTransferEngine`, driven over the rollout worker
actors by `WorkerClient` (vLLM's weight-sync client protocol, each call one phase of the
workers' `transfer_weights`). Imports vLLM; used only with `rollout.checkpoint_engine.backend`
nccl (see weight_sync.py).
"""

from __future__ import annotations

import socket
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource
from vllm.distributed.weight_transfer.nccl_engine import (
    NCCLTrainerInitInfo,
    NCCLTrainerWeightTransferEngine,
)


class StateDictSource(WeightSource):
    """A state dict as vLLM's `WeightSource` (metadata and iteration in the same order, tensors
    moved to the GPU), re-pointed at each step's weights."""

    def __init__(self) -> None:
        self.state: Mapping[str, torch.Tensor] = {}

    def metadata(self) -> list[ParamMeta]:
        return [ParamMeta(name, t.dtype, tuple(t.shape)) for name, t in self.state.items()]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in self.state.items():
            yield name, tensor.detach().to("cuda", non_blocking=True)


class WorkerClient:
    """vLLM's `VLLMWeightSyncClient` protocol (structural) over rollout worker actors: every
    call runs one phase of each worker's `transfer_weights` and waits for all of them."""

    def __init__(self, ray: Any, handles: list[Any]) -> None:
        self._ray = ray
        self.handles = handles

    def _all(self, phase: str, info: dict[str, Any] | None = None) -> None:
        self._ray.get([h.transfer_weights.remote(phase, info) for h in self.handles])

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._all("init", init_info)

    def start_weight_update(self) -> None:
        self._all("start")

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self._all("update", update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._all("finish")  # the version is specrl's: `weights_received`

    def shutdown_weight_transfer_engine(self) -> None:
        self._all("shutdown")


class NcclWeightSync:
    """Rank 0 of an NCCL group with the workers' vLLM engines."""

    def __init__(self, ray: Any) -> None:
        self._ray = ray
        self.source = StateDictSource()
        self.engine: NCCLTrainerWeightTransferEngine | None = None

    def connect(self, handles: list[Any]) -> None:
        """(Re)build the group with these workers, at ranks 1, 2, ... (a group that lost a
        member cannot broadcast: the survivors leave it and everyone joins a new one)."""
        client = WorkerClient(self._ray, handles)
        if self.engine is not None:
            client.shutdown_weight_transfer_engine()
            self.engine.shutdown()
        info = NCCLTrainerInitInfo(
            master_address=self._ray.util.get_node_ip_address(),
            master_port=_free_port(),
            world_size=1 + len(handles),
            rank=0,
        )
        self.engine = NCCLTrainerWeightTransferEngine.trainer_init(
            info, client=client, source=self.source
        )

    def send(self, state: Mapping[str, torch.Tensor], handles: list[Any], version: int) -> None:
        """Broadcast `state` to every worker of the group and set their policy version."""
        self.source.state = state
        self.engine.send_weights()
        self._ray.get([h.weights_received.remote(version) for h in handles])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]
