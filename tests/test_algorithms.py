import math

import pytest
import torch

from specrl.algorithms.advantages import compute_advantages, grpo_advantages, rloo_advantages
from specrl.algorithms.losses import (
    ClipConfig,
    agg_loss,
    entropy_from_logits,
    kl_penalty,
    ppo_clip_loss,
)
from specrl.algorithms.rollout_correction import rollout_is_weights


def test_grpo_normalises_by_unbiased_group_std():
    scores = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0]])
    adv = grpo_advantages(scores)
    # group 0: mean 0.5, unbiased std sqrt(4 * 0.25 / 3) = 0.57735 → ±0.5 / 0.57735 = ±0.8660
    torch.testing.assert_close(
        adv[0], torch.tensor([0.8660, -0.8660, -0.8660, 0.8660]), atol=1e-4, rtol=0
    )
    # group 1: all equal → no signal
    torch.testing.assert_close(adv[1], torch.zeros(4))


def test_dr_grpo_only_centres():
    adv = compute_advantages(
        torch.tensor([[1.0, 0.0, 0.0, 1.0]]), "grpo", norm_adv_by_std_in_grpo=False
    )
    torch.testing.assert_close(adv, torch.tensor([[0.5, -0.5, -0.5, 0.5]]))


def test_rloo_leaves_one_out():
    adv = rloo_advantages(torch.tensor([[1.0, 0.0, 0.0, 1.0]]))
    # slot 0: 1 - (0 + 0 + 1) / 3 = 2/3; slot 1: 0 - (1 + 0 + 1) / 3 = -2/3
    torch.testing.assert_close(adv, torch.tensor([[2 / 3, -2 / 3, -2 / 3, 2 / 3]]))
    with pytest.raises(ValueError, match=r"rollout\.n"):
        rloo_advantages(torch.tensor([[1.0]]))


def test_agg_loss_modes():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    assert agg_loss(loss, mask, "token-mean").item() == pytest.approx(10 / 4)
    assert agg_loss(loss, mask, "seq-mean-token-mean").item() == pytest.approx((2 + 4) / 2)
    # Dr.GRPO: per-sequence sums over a constant horizon (here T = 3)
    assert agg_loss(loss, mask, "seq-mean-token-sum-norm").item() == pytest.approx(
        (6 / 3 + 4 / 3) / 2
    )
    assert agg_loss(loss, mask, "seq-mean-token-sum-norm", horizon=6).item() == pytest.approx(
        (1 + 4 / 6) / 2
    )


def test_ppo_clip_asymmetric_and_dual_clip():
    old = torch.zeros(1, 3)
    new = torch.tensor([[0.5, -0.5, 2.0]])
    adv = torch.tensor([[1.0, -1.0, -1.0]])
    out = ppo_clip_loss(new, old, adv, torch.ones(1, 3), ClipConfig(0.2, 0.28, 3.0))
    # token 0: ratio e^0.5 = 1.649 > 1.28 → clipped: -1.28
    # token 1: ratio e^-0.5 = 0.607 < 0.8, A < 0 → clipped: max(0.607, 0.8) = 0.8
    # token 2: ratio e^2 = 7.39, A < 0 → max(7.39, 1.28) = 7.39, dual clip → min(3, 7.39) = 3
    assert out.loss.item() == pytest.approx((-1.28 + 0.8 + 3.0) / 3, abs=1e-5)
    assert out.pg_clipfrac.item() == pytest.approx(2 / 3)
    assert out.pg_clipfrac_lower.item() == pytest.approx(1 / 3)
    assert out.ppo_kl.item() == pytest.approx((-0.5 + 0.5 - 2.0) / 3)


def test_ppo_clip_ignores_masked_tokens_and_has_policy_gradient():
    new = torch.zeros(1, 2, requires_grad=True)
    out = ppo_clip_loss(
        new, torch.zeros(1, 2), torch.tensor([[2.0, 100.0]]), torch.tensor([[1, 0]]), ClipConfig()
    )
    out.loss.backward()
    # at ratio 1 the gradient of -A·ratio w.r.t. the logprob is -A, averaged over 1 token
    torch.testing.assert_close(new.grad, torch.tensor([[-2.0, 0.0]]))


def test_kl_estimators():
    logp, ref = torch.tensor([-1.0]), torch.tensor([-2.0])
    assert kl_penalty(logp, ref, "k1").item() == pytest.approx(1.0)
    assert kl_penalty(logp, ref, "k2").item() == pytest.approx(0.5)
    assert kl_penalty(logp, ref, "low_var_kl").item() == pytest.approx(math.exp(-1) + 1 - 1)
    assert kl_penalty(logp, logp, "low_var_kl").item() == 0.0


def test_entropy():
    assert entropy_from_logits(torch.zeros(4)).item() == pytest.approx(math.log(4))
    assert entropy_from_logits(torch.tensor([0.0, -1e9])).item() == pytest.approx(0.0, abs=1e-6)


def test_overlong_penalty_ramps_over_the_buffer():
    from specrl.algorithms.dapo import overlong_penalty

    # R = 20, buffer 4: no penalty up to 16 tokens, then -0.25 per token to -1 at 20
    lengths = torch.tensor([10, 16, 17, 18, 20])
    torch.testing.assert_close(
        overlong_penalty(lengths, 20, 4, 1.0), torch.tensor([0.0, 0.0, -0.25, -0.5, -1.0])
    )
    torch.testing.assert_close(
        overlong_penalty(torch.tensor([18]), 20, 4, 0.5), torch.tensor([-0.25])
    )


def test_dynamic_sampling_drops_groups_with_equal_scores():
    from specrl.algorithms.dapo import groups_with_signal

    scores = torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0], [0.0, 1.0, 0.0]])
    assert groups_with_signal(scores).tolist() == [False, False, True]


def test_rollout_importance_weights_are_truncated_per_token_or_per_sequence():
    old = torch.tensor([[-1.0, -2.0, -0.5], [-1.0, -1.0, 0.0]])
    rollout = torch.tensor([[-1.5, -1.0, -0.5], [-1.0, -2.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    token = rollout_is_weights(old, rollout, mask, "token", threshold=2.0)
    expected = torch.tensor([[math.exp(0.5), math.exp(-1.0), 1.0], [1.0, 2.0, 0.0]])
    torch.testing.assert_close(token, expected)  # e^1 = 2.72 truncated to 2; padding gets 0
    sequence = rollout_is_weights(old, rollout, mask, "sequence", threshold=2.0)
    # row 0: exp(0.5 - 1 + 0) = e^-0.5 on every token; row 1: exp(1) truncated to 2
    torch.testing.assert_close(sequence, torch.tensor([[math.exp(-0.5)] * 3, [2.0, 2.0, 0.0]]))


def test_importance_weights_scale_each_token_loss():
    logprobs = torch.tensor([[-1.0, -1.0]])
    adv = torch.ones(1, 2)
    mask = torch.ones(1, 2)
    cfg = ClipConfig(0.2, 0.2, 3.0, "token-mean", 2)
    plain = ppo_clip_loss(logprobs, logprobs, adv, mask, cfg).loss
    weighted = ppo_clip_loss(logprobs, logprobs, adv, mask, cfg, torch.tensor([[2.0, 0.0]])).loss
    assert plain.item() == pytest.approx(-1.0) and weighted.item() == pytest.approx(-1.0)
    weighted = ppo_clip_loss(logprobs, logprobs, adv, mask, cfg, torch.tensor([[2.0, 1.0]])).loss
    assert weighted.item() == pytest.approx(-1.5)
