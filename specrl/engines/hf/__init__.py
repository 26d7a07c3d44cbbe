"""The transformers rollout engine: facade and batching (engine.py), the decode loop (decode.py),
its KV cache (kv_cache.py) and the prefix KV kept from verification passes (prefix_cache.py)."""

from specrl.engines.hf.engine import HFEngine

__all__ = ["HFEngine"]
