"""The vLLM rollout engine (engine.py, the only importer of vllm) and its in-process weight
transfer backend (weights.py). Import `specrl.engines.vllm.engine` only when vllm is wanted."""
