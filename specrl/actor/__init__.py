"""The policy being trained: loading (policy.py), rollouts as tensors (batch.py) and the PPO
update (update.py)."""
