import math

import pytest
import torch

from specrl.algorithms.advantages import (
    ADV_ESTIMATORS,
    AdvantageInputs,
    compute_advantages,
    grpo_advantages,
    rloo_advantages,
)
from specrl.algorithms.losses import (
    POLICY_LOSSES,
    ClipConfig,
    agg_loss,
    entropy_from_logits,
    gspo_loss,
    kl_penalty,
    ppo_clip_loss,
    value_loss,
)
from specrl.algorithms.rollout_correction import rollout_is_weights
from specrl.config import GROUP_BASELINES, AlgorithmConfig, PolicyLossConfig


def test_grpo_normalises_by_unbiased_group_std():
    scores = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0]])
    adv = grpo_advantages(scores)
    # group 0: mean 0.5, unbiased std sqrt(4 * 0.25 / 3) = 0.57735 → ±0.5 / 0.57735 = ±0.8660
    torch.testing.assert_close(
        adv[0], torch.tensor([0.8660, -0.8660, -0.8660, 0.8660]), atol=1e-4, rtol=0
    )
    # group 1: all equal → no signal
    torch.testing.assert_close(adv[1], torch.zeros(4))


def test_dr_grpo_only_centres_and_every_token_gets_its_response_advantage():
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [0, 0, 0]])
    inputs = AdvantageInputs(torch.tensor([[1.0, 0.0, 0.0, 1.0]]), mask, norm_by_std=False)
    adv, returns = compute_advantages("grpo", inputs)
    expected = torch.tensor([[0.5, 0.5, 0], [-0.5, 0, 0], [-0.5, -0.5, -0.5], [0, 0, 0]])
    torch.testing.assert_close(adv, expected)
    torch.testing.assert_close(returns, expected)


def test_the_config_offers_exactly_the_registered_estimators_and_losses():
    offered = AlgorithmConfig.model_fields["adv_estimator"].annotation.__args__
    assert set(offered) == set(ADV_ESTIMATORS)
    assert set(PolicyLossConfig.model_fields["loss_mode"].annotation.__args__) == set(POLICY_LOSSES)


def test_exactly_the_group_baselines_learn_nothing_from_groups_of_one():
    """What `rollout.n=1` is refused for (`GROUP_BASELINES`): with one rollout per prompt
    their advantages are all 0 (or they refuse), the other estimators' are not."""
    scores = torch.tensor([[1.0], [0.0], [0.5]])  # three prompts, one rollout each
    mask = torch.ones(3, 4)
    inputs = AdvantageInputs(scores, mask, values=torch.full((3, 4), 0.2))
    for name in ADV_ESTIMATORS:
        try:
            advantages = compute_advantages(name, inputs)[0]
        except ValueError:
            advantages = torch.zeros(())
        assert (advantages.abs().max().item() < 1e-6) == (name in GROUP_BASELINES), name


RAGGED = torch.tensor([[1, 1, 1], [1, 1, 0]])  # two responses of 3 and 2 tokens


def test_reinforce_plus_plus_discounts_from_the_last_token_then_whitens_over_tokens():
    inputs = AdvantageInputs(torch.tensor([[1.0, 2.0]]), RAGGED, gamma=0.5)
    adv, returns = compute_advantages("reinforce_plus_plus", inputs)
    # returns: response 0 (reward 1 at t=2): 0.25, 0.5, 1; response 1 (reward 2 at t=1): 1, 2
    torch.testing.assert_close(returns, torch.tensor([[0.25, 0.5, 1.0], [1.0, 2.0, 0.0]]))
    tokens = torch.tensor([0.25, 0.5, 1.0, 1.0, 2.0])  # mean 0.95, unbiased var 0.45
    whitened = (tokens - 0.95) / math.sqrt(0.45 + 1e-8)
    torch.testing.assert_close(adv[RAGGED.bool()], whitened)
    assert adv[1, 2] == 0


def test_reinforce_plus_plus_baseline_centres_per_group_then_whitens_over_tokens():
    inputs = AdvantageInputs(torch.tensor([[1.0, 3.0]]), RAGGED)
    adv, returns = compute_advantages("reinforce_plus_plus_baseline", inputs)
    # group mean 2: -1 on response 0's three tokens, +1 on response 1's two
    torch.testing.assert_close(returns, torch.tensor([[-1.0, -1.0, -1.0], [1.0, 1.0, 0.0]]))
    tokens = torch.tensor([-1.0, -1.0, -1.0, 1.0, 1.0])  # mean -0.2, unbiased var 1.2
    torch.testing.assert_close(adv[RAGGED.bool()], (tokens + 0.2) / math.sqrt(1.2 + 1e-8))


def test_gspo_uses_one_clipped_ratio_per_sequence():
    """Response 0: token log-ratios 0.1, 0.2, 0.3 → s = e^0.2, clipped to 1 + high for A > 0;
    response 1: log-ratios 0, -0.0002 → s = e^-0.0001, inside [1 - low, 1 + high]."""
    old = torch.zeros(2, 3)
    new = torch.tensor([[0.1, 0.2, 0.3], [0.0, -0.0002, 0.0]], requires_grad=True)
    adv = torch.tensor([[1.0, 1.0, 1.0], [-2.0, -2.0, 0.0]])
    cfg = ClipConfig(3e-4, 4e-4, loss_agg_mode="token-mean", loss_mode="gspo")
    out = gspo_loss(new, old, adv, RAGGED, cfg)
    s1 = math.exp(-0.0001)
    # per sequence: -min(s·A, clip(s)·A) averaged over its tokens (equal), then over sequences
    expected = (-(1 + 4e-4) * 1.0 + 2.0 * s1) / 2
    assert out.loss.item() == pytest.approx(expected, rel=1e-6)
    assert out.pg_clipfrac.item() == pytest.approx(3 / 5)  # response 0's three tokens
    out.loss.backward()
    # clipped response 0 has no gradient; response 1: d/dlogp_t of 2·s/2 over its 2 tokens
    torch.testing.assert_close(new.grad[0], torch.zeros(3))
    torch.testing.assert_close(new.grad[1, :2], torch.full((2,), s1 / 2))
    # the sequence ratio is the geometric mean: same as the token loss when every ratio agrees
    same = torch.full((2, 3), 0.0001)
    vanilla = ppo_clip_loss(
        same, old, adv, RAGGED, ClipConfig(0.2, 0.2, loss_agg_mode="seq-mean-token-mean")
    )
    assert gspo_loss(
        same, old, adv, RAGGED, ClipConfig(0.2, 0.2, loss_mode="gspo")
    ).loss.item() == pytest.approx(vanilla.loss.item())


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


def test_kl_estimators_clamp_only_where_verl_does():
    """verl 0.9.1 (`kl_penalty_forward`): k1 and k2 are not clamped, so 30 nats of drift keep
    their full value and gradient; k3 clamps log r to ±20 and the estimate to [-10, 10]."""
    logp = torch.tensor([-1.0], requires_grad=True)
    ref = torch.tensor([-31.0])
    assert kl_penalty(logp, ref, "k1").item() == pytest.approx(30.0)
    k2 = kl_penalty(logp, ref, "k2")
    assert k2.item() == pytest.approx(450.0)
    k2.sum().backward()
    assert logp.grad.item() == pytest.approx(30.0)  # d/dlogp ½(logp - ref)²
    assert kl_penalty(logp, ref, "low_var_kl").item() == pytest.approx(10.0)  # e^-20 + 20 - 1
    assert kl_penalty(ref, logp, "low_var_kl").item() == pytest.approx(10.0)  # clamped above


def test_gspo_averages_unclamped_token_log_ratios_and_clamps_the_sequence_one():
    """verl's GSPO: the sequence log-ratio is the mean of the raw token log-ratios (one token
    at +30 nats counts in full), and only the sequence ratio is clamped (log ≤ 10)."""
    old = torch.zeros(1, 3)
    new = torch.tensor([[30.0, -27.0, 0.0]], requires_grad=True)  # mean 1.0 over 3 tokens
    adv = torch.tensor([[-1.0, -1.0, -1.0]])
    mask = torch.ones(1, 3)
    out = gspo_loss(new, old, adv, mask, ClipConfig(0.2, 0.2, loss_mode="gspo"))
    assert out.loss.item() == pytest.approx(math.e)  # A < 0: -A · max(s, clip(s)) with s = e
    far = torch.tensor([[40.0, 40.0, 40.0]])
    out = gspo_loss(far, old, adv, mask, ClipConfig(0.2, 0.2, loss_mode="gspo"))
    assert out.loss.item() == pytest.approx(math.exp(10.0))


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


def test_gae_by_hand_on_ragged_responses():
    """γ = 0.9, λ = 0.8 (γλ = 0.72). Response 0 (3 tokens, reward 1): δ = 0.8, −0.22, −0.14 →
    A = 0.8, 0.356, 0.11632. Response 1 (2 tokens, reward 0; the value past its end is
    padding): δ = −0.3, 0.17 → A = −0.3, −0.046."""
    values = torch.tensor([[0.5, 0.4, 0.2], [0.1, 0.3, 9.0]])
    inputs = AdvantageInputs(torch.tensor([[1.0, 0.0]]), RAGGED, 0.9, values=values, lam=0.8)
    adv, returns = compute_advantages("gae", inputs)
    raw = torch.tensor([0.11632, 0.356, 0.8, -0.046, -0.3])
    torch.testing.assert_close(
        returns, torch.tensor([[0.61632, 0.756, 1.0], [0.054, 0.0, 0.0]]), atol=1e-6, rtol=0
    )
    whitened = (raw - raw.mean()) / raw.std()  # unbiased, over the five tokens
    torch.testing.assert_close(adv[RAGGED.bool()], whitened, atol=1e-5, rtol=0)
    assert adv[1, 2] == 0
    with pytest.raises(ValueError, match="critic"):
        compute_advantages("gae", AdvantageInputs(torch.tensor([[1.0, 0.0]]), RAGGED))


def test_value_loss_clips_only_where_the_clipped_error_is_larger():
    """cliprange 0.2. Token a: 0.5 → 0.9 is clipped to 0.7, return 1: errors 0.01 / 0.09, the
    clipped one counts (no gradient). Token b: 0.5 → 0.6 inside the range, return 0: 0.36.
    Token c: 0 → 0.5 clipped to 0.2, return −1: errors 2.25 / 1.44, the unclipped counts."""
    vpreds = torch.tensor([[0.9, 0.6, 0.5]], requires_grad=True)
    old = torch.tensor([[0.5, 0.5, 0.0]])
    returns = torch.tensor([[1.0, 0.0, -1.0]])
    out = value_loss(vpreds, old, returns, torch.ones(1, 3), 0.2)
    assert out.loss.item() == pytest.approx(0.5 * (0.09 + 0.36 + 2.25) / 3)
    assert out.vf_clipfrac.item() == pytest.approx(1 / 3)
    assert out.vpred_mean.item() == pytest.approx(2.0 / 3)
    out.loss.backward()
    torch.testing.assert_close(vpreds.grad, torch.tensor([[0.0, 0.6 / 3, 1.5 / 3]]))
