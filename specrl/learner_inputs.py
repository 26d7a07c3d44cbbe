"""The learner's inputs from a step's rollouts (docs/design.md: rollout → rewards → advantages
→ update): the rollouts as tensors, with the old policy's logprobs, the rollout importance
weights, the reference policy's logprobs, the critic's values and the advantages."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from specrl.actor.batch import TrainBatch
from specrl.algorithms.advantages import AdvantageInputs, compute_advantages
from specrl.algorithms.rollout_correction import correction_weights
from specrl.metrics import logprob_mismatch, timed, value_metrics
from specrl.rewards import Scores
from specrl.types import Rollout

if TYPE_CHECKING:
    from specrl.assemble import Run


def learner_batch(
    run: Run, rollouts: list[Rollout], scores: Scores, metrics: dict[str, float]
) -> TrainBatch:
    """Rollouts as tensors with what the update needs: old logprobs, rollout importance
    weights, reference logprobs and advantages (and values, with a critic)."""
    cfg = run.cfg
    batch = TrainBatch.collate(rollouts, run.tokenizer.pad_token_id)
    rollout_logprobs = batch.pad_responses([r.current_logprobs for r in rollouts])
    with timed(metrics, "old_log_prob"):
        if run.rollout_logprobs_are_old_logprobs:
            batch.old_logprobs = rollout_logprobs
        else:
            batch.old_logprobs = run.actor.logprobs(batch)
    metrics.update(logprob_mismatch(batch.old_logprobs, rollout_logprobs, batch.response_mask))
    off_policy = any(r.behaviour_logprobs is not None for r in rollouts)
    behaviour = batch.pad_responses(  # what each token was sampled with
        [r.behaviour_logprobs or r.current_logprobs for r in rollouts]
    )
    batch.is_weights, corrected = correction_weights(
        batch.old_logprobs, behaviour, batch.response_mask, cfg.algorithm.rollout_correction,
        off_policy,
    )  # fmt: skip
    metrics.update(corrected)
    if cfg.actor.use_kl_loss:
        with timed(metrics, "ref"):
            batch.ref_logprobs = run.actor.logprobs(batch, reference=True)
    if run.critic is not None:
        with timed(metrics, "values"):
            batch.values = run.critic.values(batch)
    with timed(metrics, "adv"):
        inputs = AdvantageInputs(
            torch.tensor(scores.scores).view(-1, cfg.rollout.n), batch.response_mask,
            cfg.algorithm.gamma, cfg.algorithm.norm_adv_by_std_in_grpo, batch.values,
            cfg.algorithm.lam,
        )  # fmt: skip
        batch.advantages, batch.returns = compute_advantages(cfg.algorithm.adv_estimator, inputs)
    if run.critic is not None:
        metrics.update(value_metrics(batch.values, batch.returns, batch.response_mask))
    return batch
