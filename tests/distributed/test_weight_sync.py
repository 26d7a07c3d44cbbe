"""Which weight-sync backend a run gets (no Ray, no GPU needed)."""

import pytest

from specrl.config import load_config
from specrl.distributed.weight_sync import resolve_backend
from specrl.errors import UserError


def test_auto_is_the_object_store_without_gpu_workers():
    assert resolve_backend(load_config(None, ["rollout.num_workers=2"])) == "object_store"
    vllm_on_cpu = load_config(None, ["rollout.num_workers=2", "rollout.name=vllm"])
    assert resolve_backend(vllm_on_cpu) == "object_store"


def test_nccl_where_it_cannot_run_says_what_it_needs():
    cfg = load_config(None, ["rollout.num_workers=2", "rollout.checkpoint_engine.backend=nccl"])
    with pytest.raises(UserError, match="needs vLLM rollout workers on GPUs"):
        resolve_backend(cfg)
