"""specrl as the rollout function of TRL's GRPOTrainer (marker `trl`; CI installs specrl[trl]
and runs them with `pytest -m trl`, where they must not skip)."""

import sys

import pytest
import torch

from specrl.config import SpecConfig
from specrl.errors import UserError

pytest.importorskip("trl", reason="trl is not installed (pip install 'specrl[trl]')")
from trl import GRPOConfig, GRPOTrainer

from specrl.integrations.trl import SpeculativeRollouts, builtin_task

pytestmark = pytest.mark.trl


class Recorded(SpeculativeRollouts):
    """The rollout function, keeping what each call returned."""

    def __init__(self, spec=None, **kwargs):
        super().__init__(spec, **kwargs)
        self.outputs = []
        self.old_logprobs = []  # what each no-gradient logprob pass of TRL's gave

    def _build(self, trainer):
        stage = super()._build(trainer)
        answer = trainer._get_per_token_logps_and_entropies

        def recorded(*args, **kwargs):
            out = answer(*args, **kwargs)
            if not torch.is_grad_enabled():
                self.old_logprobs.append(out[0])
            return out

        trainer._get_per_token_logps_and_entropies = recorded
        return stage

    def __call__(self, prompts, trainer):
        out = super().__call__(prompts, trainer)
        self.outputs.append(out)
        return out


def grpo_trainer(out_dir, rollouts, steps=8, **overrides):
    """The shipped policy on 16 problems of the built-in task, 4 prompts x 4 completions per
    step: 4 steps per epoch."""
    train, _, reward, model, tokenizer = builtin_task(train_size=16, val_size=8)
    settings = dict(
        output_dir=str(out_dir), per_device_train_batch_size=16, num_generations=4,
        max_completion_length=72, max_steps=steps, learning_rate=1e-4, logging_steps=1,
        report_to=[], save_strategy="no", use_cpu=True, seed=1, beta=0.0, shuffle_dataset=False,
        bf16=False, gradient_checkpointing=False,  # as specrl trains: float32, no recomputation
    )  # fmt: skip
    args = GRPOConfig(**{**settings, **overrides})
    return GRPOTrainer(
        model=model, processing_class=tokenizer, reward_funcs=reward, train_dataset=train,
        args=args, rollout_func=rollouts,
    )  # fmt: skip


def test_grpo_trainer_trains_with_speculative_rollouts_reused_from_the_second_epoch(tmp_path):
    rollouts = Recorded()
    trainer = grpo_trainer(tmp_path, rollouts)
    trainer.train()
    history = [m for m in trainer.state.log_history if "loss" in m]
    assert len(history) == 8
    reuse = [m["specrl/reused_token_ratio"] for m in history]
    assert reuse[:4] == [0.0] * 4  # the first epoch has no history
    assert all(r > 0 for r in reuse[4:]), reuse
    assert rollouts.stats.reused_tokens > 0
    assert rollouts.logprobs_reused == 0 and not rollouts.old_logprobs  # TRL needs none
    for out in rollouts.outputs:
        assert len(out["prompt_ids"]) == len(out["completion_ids"]) == len(out["logprobs"]) == 16
        assert all(
            len(c) == len(lp) for c, lp in zip(out["completion_ids"], out["logprobs"], strict=True)
        )


def test_speculation_off_samples_the_same_completions(tmp_path):
    """Exact rule, same seeds: the completions of every call are the tokens plain decoding
    draws, and so the two runs train the same."""
    on, off = Recorded(), Recorded(SpecConfig(enabled=False))
    grpo_trainer(tmp_path / "on", on).train()
    grpo_trainer(tmp_path / "off", off).train()
    assert on.stats.reused_tokens > 0 and off.stats.reused_tokens == 0
    assert [o["completion_ids"] for o in on.outputs] == [o["completion_ids"] for o in off.outputs]


def test_where_trl_recomputes_the_old_logprobs_it_takes_the_rollouts_instead(tmp_path):
    """Two optimizer steps per generation batch: TRL would run a forward over each batch for the
    old policy's logprobs; it takes the rollouts' (the same model and weights), which agree with
    its own, and the completions are the same tokens as with its own."""
    settings = dict(per_device_train_batch_size=8, steps_per_generation=2)
    reused, own = Recorded(), Recorded(reuse_logprobs=False)
    grpo_trainer(tmp_path / "reused", reused, **settings).train()
    grpo_trainer(tmp_path / "own", own, **settings).train()
    assert reused.logprobs_reused == len(reused.outputs) == 4 and own.logprobs_reused == 0
    assert len(reused.old_logprobs) == len(own.old_logprobs) == 4
    first = reused.outputs[0]["completion_ids"]
    assert first == own.outputs[0]["completion_ids"]  # the same weights: before any update
    mask = torch.zeros_like(own.old_logprobs[0], dtype=torch.bool)
    for i, ids in enumerate(first):
        mask[i, : len(ids)] = True
    gap = (reused.old_logprobs[0] - own.old_logprobs[0]).abs()[mask]
    assert gap.max() < 1e-4, gap.max()
    assert (reused.old_logprobs[0][~mask] == 0).all()
    assert [o["completion_ids"] for o in reused.outputs] == [
        o["completion_ids"] for o in own.outputs
    ]


def test_what_the_rollout_function_cannot_do_is_refused_in_one_line(tmp_path, monkeypatch):
    with pytest.raises(UserError, match="TRL's loss applies no importance weights"):
        SpeculativeRollouts(SpecConfig(acceptance="specrl"))
    trainer = grpo_trainer(tmp_path, SpeculativeRollouts(), repetition_penalty=1.1)
    with pytest.raises(UserError, match=r"does not support repetition_penalty=1\.1"):
        trainer.train()
    rollouts = SpeculativeRollouts()
    trainer = grpo_trainer(tmp_path, rollouts)
    trainer.use_vllm = True  # what GRPOConfig(use_vllm=True) sets (it needs vllm installed)
    with pytest.raises(UserError, match=r"does not support use_vllm=True"):
        rollouts(["12+34="], trainer)
    monkeypatch.setitem(sys.modules, "trl", None)
    with pytest.raises(UserError, match=r"pip install 'specrl\[trl\]'"):
        SpeculativeRollouts()
