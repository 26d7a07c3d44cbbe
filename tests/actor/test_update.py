"""The PPO update does not depend on how a mini-batch is split into micro-batches."""

import copy

import pytest
import torch

from specrl.actor.batch import TrainBatch
from specrl.actor.update import ActorStats, ppo_update
from specrl.algorithms.losses import ClipConfig
from specrl.config import ActorConfig
from specrl.types import Prompt, Rollout
from tests.conftest import make_tiny_model


def rollouts(count=16, seed=0):
    """Responses of very different lengths (1 to 15 tokens): token-mean and the per-micro-batch
    mean differ as much as they can."""
    rng = torch.Generator().manual_seed(seed)
    out = []
    for i in range(count):
        prompt = Prompt(tuple(torch.randint(2, 12, (2 + i % 3,), generator=rng).tolist()), None)
        length = 1 + (i * 7) % 15
        tokens = torch.randint(2, 12, (length,), generator=rng).tolist()
        out.append(Rollout(prompt, i % 4, tokens, [0.0] * length, "length", 0))
    return out


def updated(micro_batch_size, mode, model):
    """The weights after one update (one mini-batch of 16 rollouts, SGD) and its statistics."""
    batch = TrainBatch.collate(rollouts(), pad_id=0)
    with torch.no_grad():
        shifted = torch.randn(batch.response_mask.shape, generator=torch.Generator().manual_seed(1))
        batch.old_logprobs = -1.5 + 0.3 * shifted  # ratios on both sides of the clip range
        batch.ref_logprobs = -2.0 + 0.2 * shifted
    batch.advantages = torch.linspace(-1.0, 1.0, len(batch))[:, None] * batch.response_mask
    cfg = ActorConfig(
        ppo_mini_batch_size=4, ppo_micro_batch_size=micro_batch_size, loss_agg_mode=mode,
        entropy_coeff=0.01, use_kl_loss=True, kl_loss_coef=0.1, grad_clip=1e9,
    )  # fmt: skip
    model = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    clip = ClipConfig(0.2, 0.28, 3.0, mode, horizon=15)
    shares = ppo_update(
        model, optimizer, scheduler, batch, cfg, clip, 1.0, 4, torch.Generator().manual_seed(0)
    )
    return model.state_dict(), ActorStats.of([shares])


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_loss_and_gradient_do_not_depend_on_the_micro_batch_size(mode):
    model = make_tiny_model(seed=0, init=0.3)
    weights, stats = updated(64, mode, model)  # one micro-batch: the whole mini-batch
    moved = max((weights[k] - v).abs().max() for k, v in model.state_dict().items())
    assert moved > 1e-3  # the update did something
    for size in (1, 8):
        other, other_stats = updated(size, mode, model)
        for key, value in weights.items():
            torch.testing.assert_close(other[key], value, rtol=1e-4, atol=1e-6)
        for field in ("pg_loss", "entropy", "kl_loss", "ppo_kl", "pg_clipfrac", "grad_norm"):
            assert getattr(other_stats, field) == pytest.approx(getattr(stats, field), rel=1e-4)


def test_extreme_ratios_and_nan_in_padding_give_a_finite_loss_and_gradient():
    from specrl.algorithms.losses import ppo_clip_loss

    logprobs = torch.tensor([[-1.0, -2.0, 0.0]], requires_grad=True)
    old = torch.tensor([[-80.0, 50.0, float("nan")]])  # log ratios +79 and -52; NaN in padding
    mask = torch.tensor([[1, 1, 0]])
    out = ppo_clip_loss(logprobs, old, torch.tensor([[1.0, -1.0, 1.0]]), mask, ClipConfig())
    out.loss.backward()
    assert torch.isfinite(out.loss) and torch.isfinite(logprobs.grad).all()
    assert torch.isfinite(out.ppo_kl)


def _actor_update(model, **overrides):
    """The weights after one `Actor.update` (AdamW) with `actor.*` overrides."""
    from specrl.actor.update import Actor

    batch = TrainBatch.collate(rollouts(), pad_id=0)
    batch.old_logprobs = torch.full(batch.response_mask.shape, -2.0)
    batch.advantages = torch.linspace(-1.0, 1.0, len(batch))[:, None] * batch.response_mask
    cfg = ActorConfig(ppo_mini_batch_size=4, ppo_micro_batch_size=5, **overrides)
    actor = Actor(copy.deepcopy(model), cfg, ClipConfig(), 1.0)
    stats = actor.update(batch, 4, seed=0)
    return {k: v.detach() for k, v in actor.policy.state_dict().items()}, stats


def test_gradient_checkpointing_gives_the_same_update():
    model = make_tiny_model(seed=0, init=0.3)
    plain, plain_stats = _actor_update(model)
    checkpointed, stats = _actor_update(model, gradient_checkpointing=True)
    for key, value in plain.items():
        torch.testing.assert_close(checkpointed[key], value, rtol=1e-5, atol=1e-7)
    assert stats.pg_loss == pytest.approx(plain_stats.pg_loss, rel=1e-5)


def test_bfloat16_autocast_updates_the_weights_the_same_way():
    model = make_tiny_model(seed=0, init=0.3)
    start = model.state_dict()
    plain, _ = _actor_update(model)
    autocast, stats = _actor_update(model, autocast="bfloat16")
    assert autocast["model.embed_tokens.weight"].dtype == torch.float32  # weights stay float32
    delta = torch.cat([(plain[k] - v).flatten() for k, v in start.items()])
    delta_bf16 = torch.cat([(autocast[k] - v).flatten() for k, v in start.items()])
    assert torch.isfinite(delta_bf16).all() and stats.skipped_updates == 0
    assert torch.nn.functional.cosine_similarity(delta, delta_bf16, dim=0) > 0.9
