"""The update on K = 2 learner ranks (gloo, two processes) is the update on one: same weights
after a step for every loss aggregation, with the global gradient norm clipped, under DDP and
FSDP2, for the actor and the critic; the optimizer's checkpoint state is the same for any K."""

from __future__ import annotations

import copy
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from transformers import Qwen2ForTokenClassification

from specrl.actor.batch import TrainBatch
from specrl.actor.critic import Critic, CriticStats
from specrl.actor.data_parallel import (
    SINGLE,
    Rank,
    balanced_split,
    full_model_state,
    micro_batches,
    wrap,
)
from specrl.actor.update import Actor, ActorStats, ppo_update
from specrl.algorithms.losses import ClipConfig
from specrl.config import ActorConfig, CriticConfig
from tests.actor.test_update import rollouts
from tests.conftest import make_tiny_model

MODES = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
pytestmark = pytest.mark.xdist_group("data-parallel")  # one pytest worker spawns the ranks
CASES = [(mode, 1e9) for mode in MODES] + [("token-mean", 0.05)]  # (loss_agg_mode, grad_clip)


def test_balanced_split_balances_tokens_and_keeps_the_order():
    rows = torch.tensor([5, 0, 3, 1, 4, 2])
    tokens = torch.tensor([10, 1, 1, 1, 1, 6])  # row 0 alone outweighs the rest
    assert balanced_split(rows, tokens, 1) == [rows]
    parts = balanced_split(rows, tokens, 2)
    assert [p.tolist() for p in parts] == [[0], [5, 3, 1, 4, 2]]
    assert sorted(torch.cat(parts).tolist()) == sorted(rows.tolist())
    assert all(len(p) for p in balanced_split(rows, tokens, 6))  # a row for every part


def test_micro_batches_are_as_many_on_every_rank():
    parts = [torch.tensor([0, 1, 2, 3, 4]), torch.tensor([5])]
    first = micro_batches(parts, Rank(0, 2), 2)
    second = micro_batches(parts, Rank(1, 2), 2)
    assert [(m.tolist(), w) for m, w in first] == [([0, 1], 1.0), ([2, 3], 1.0), ([4], 1.0)]
    assert [(m.tolist(), w) for m, w in second] == [([5], 1.0), ([0], 0.0), ([0], 0.0)]
    assert micro_batches([torch.arange(5)], SINGLE, 2)[-1][1] == 1.0


def _batch() -> TrainBatch:
    batch = TrainBatch.collate(rollouts(), pad_id=0)  # 16 responses of 1 to 15 tokens
    noise = torch.randn(batch.response_mask.shape, generator=torch.Generator().manual_seed(1))
    batch.old_logprobs = -1.5 + 0.3 * noise
    batch.ref_logprobs = -2.0 + 0.2 * noise
    batch.advantages = torch.linspace(-1.0, 1.0, len(batch))[:, None] * batch.response_mask
    return batch


def _update(model, rank: Rank, strategy: str, mode: str, grad_clip: float):
    """One update (two mini-batches of 8 rollouts, SGD) of `model` as `rank` runs it: → the
    full weights (rank 0) and this rank's shares."""
    cfg = ActorConfig(
        ppo_mini_batch_size=2, ppo_micro_batch_size=3, loss_agg_mode=mode, entropy_coeff=0.01,
        use_kl_loss=True, kl_loss_coef=0.1, grad_clip=grad_clip, strategy=strategy,
    )  # fmt: skip
    model = wrap(copy.deepcopy(model), cfg, rank, train=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    clip = ClipConfig(0.2, 0.28, 3.0, mode, horizon=15)
    generator = torch.Generator().manual_seed(0)
    shares = ppo_update(model, optimizer, scheduler, _batch(), cfg, clip, 1.0, 4, generator, rank)
    return full_model_state(model, rank.world), shares


def _rank_main(index: int, port: int, strategy: str, out: dict) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=index,
                            world_size=2)  # fmt: skip
    model = make_tiny_model(seed=0, init=0.3)
    for mode, grad_clip in CASES:
        weights, shares = _update(model, Rank(index, 2), strategy, mode, grad_clip)
        out[(index, mode, grad_clip)] = (weights, shares)
    cfg = ActorConfig(strategy=strategy)
    actor = Actor(copy.deepcopy(model), cfg, ClipConfig(), 1.0, rank=Rank(index, 2))
    actor.update(_batch(), 4, seed=3)
    out[(index, "checkpoint")] = actor.state_dict()
    out[(index, "critic")] = _critic_update(strategy, Rank(index, 2))
    dist.destroy_process_group()


def _critic_update(strategy: str, rank: Rank):
    """Values before, and weights and shares after, one update (SGD) of a tiny critic as
    `rank` runs it, with the value clip active on part of the tokens."""
    torch.manual_seed(0)
    config = make_tiny_model(seed=0).config
    config.num_labels, config.classifier_dropout = 1, 0.0  # as load_critic_model
    cfg = CriticConfig(ppo_mini_batch_size=2, ppo_micro_batch_size=3, cliprange_value=0.05)
    critic = Critic(Qwen2ForTokenClassification(config), cfg, ActorConfig(strategy=strategy), rank)
    critic.optimizer = torch.optim.SGD(critic.model.parameters(), lr=1.0)
    batch = _batch()
    parts = balanced_split(torch.arange(len(batch)), batch.attention_mask.sum(-1), rank.world)
    values = critic.values(batch, parts)
    batch.values = 0.1 * batch.advantages  # the values GAE used (the same on every rank)
    batch.returns = batch.advantages + 0.1
    shares = critic.update_shares(batch, 4, seed=0)
    return values, parts[rank.index], full_model_state(critic.model, rank.world), shares


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module", params=["ddp", "fsdp2"])
def two_ranks(request):
    """What two gloo ranks computed, per case, under one strategy."""
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_rank_main, args=(_free_port(), request.param, out), nprocs=2)
        return request.param, dict(out)


@pytest.mark.parametrize(("mode", "grad_clip"), CASES)
def test_two_ranks_update_the_weights_as_one(two_ranks, mode, grad_clip):
    strategy, out = two_ranks
    model = make_tiny_model(seed=0, init=0.3)
    weights, shares = _update(model, SINGLE, strategy, mode, grad_clip)
    moved = max((weights[k] - v).abs().max() for k, v in model.state_dict().items())
    assert moved > 1e-3  # the update did something
    ranked, _ = out[(0, mode, grad_clip)]
    assert ranked.keys() == weights.keys()
    for key, value in weights.items():
        torch.testing.assert_close(ranked[key], value, rtol=1e-4, atol=1e-6)
    one = ActorStats.of([shares])
    two = ActorStats.of([out[(0, mode, grad_clip)][1], out[(1, mode, grad_clip)][1]])
    for field in ("pg_loss", "entropy", "kl_loss", "ppo_kl", "pg_clipfrac", "grad_norm"):
        assert getattr(two, field) == pytest.approx(getattr(one, field), rel=1e-4), field
    if grad_clip < 1:
        assert one.grad_norm > grad_clip  # the clip was active


def test_the_optimizer_checkpoint_is_the_same_for_any_number_of_ranks(two_ranks):
    strategy, out = two_ranks
    model = make_tiny_model(seed=0, init=0.3)
    actor = Actor(copy.deepcopy(model), ActorConfig(strategy=strategy), ClipConfig(), 1.0)
    actor.update(_batch(), 4, seed=3)
    one = actor.state_dict()
    two = out[(0, "checkpoint")]
    assert two["scheduler"] == one["scheduler"]
    assert two["optimizer"]["state"].keys() == one["optimizer"]["state"].keys()
    for name, state in one["optimizer"]["state"].items():
        for key, value in state.items():
            torch.testing.assert_close(
                two["optimizer"]["state"][name][key], value, rtol=1e-4, atol=1e-6
            )
    fresh = Actor(copy.deepcopy(model), ActorConfig(), ClipConfig(), 1.0)
    fresh.load_state_dict(two)  # a K = 2 checkpoint loads on one rank
    assert fresh.scheduler.last_epoch == actor.scheduler.last_epoch


def test_two_ranks_update_the_critic_as_one(two_ranks):
    strategy, out = two_ranks
    values, _, weights, shares = _critic_update(strategy, SINGLE)
    first, second = out[(0, "critic")], out[(1, "critic")]
    for ranked_values, rows, *_ in (first, second):
        torch.testing.assert_close(ranked_values, values[rows], rtol=1e-5, atol=1e-6)
    for key, value in weights.items():
        torch.testing.assert_close(first[2][key], value, rtol=1e-4, atol=1e-6)
    one, two = CriticStats.of([shares]), CriticStats.of([first[3], second[3]])
    assert 0 < one.vf_clipfrac < 1  # the value clip is active on some tokens only
    for field in ("vf_loss", "vf_clipfrac", "vpred_mean", "grad_norm"):
        assert getattr(two, field) == pytest.approx(getattr(one, field), rel=1e-4), field
