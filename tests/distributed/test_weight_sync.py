"""Which weight-sync backend a run gets (no Ray, no GPU needed)."""

import pytest

from specrl.config import load_config
from specrl.distributed.weight_sync import resolve_backend
from specrl.errors import UserError


def test_auto_is_the_object_store_without_gpu_workers():
    assert resolve_backend(load_config(None, ["rollout.num_workers=2"])) == "object_store"
    vllm_on_cpu = load_config(None, ["rollout.num_workers=2", "rollout.name=vllm"])
    assert resolve_backend(vllm_on_cpu) == "object_store"


def test_nccl_where_it_cannot_run_says_what_it_needs(monkeypatch):
    """The combination of keys fails at load; a valid one on a process without a GPU fails when
    the backend is resolved."""
    with pytest.raises(UserError, match="needs vLLM rollout workers on GPUs"):
        load_config(None, ["rollout.num_workers=2", "rollout.checkpoint_engine.backend=nccl"])
    gpu_workers = [
        "rollout.name=vllm",
        "rollout.num_workers=2",
        "rollout.num_gpus_per_worker=1",
        "rollout.checkpoint_engine.backend=nccl",
    ]
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    with pytest.raises(UserError, match="this process has none"):
        resolve_backend(load_config(None, gpu_workers))
