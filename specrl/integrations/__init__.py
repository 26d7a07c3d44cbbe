"""specrl inside other trainers: `trl` (TRL's GRPOTrainer, `rollout_func`)."""
