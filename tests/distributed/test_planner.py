"""The dispatch planner: affinity within the slack, balance, determinism (no Ray)."""

from __future__ import annotations

import random

import pytest

from specrl.distributed.planner import plan_dispatch


def moves(plan, owners):
    """(prompt id, from, to) for the prompts the plan takes off an owner."""
    return [(p, owners[p], w) for p, w in plan.targets.items() if owners.get(p, w) != w]


def _batch(seed: int, prompts: int, workers: int, owned: float):
    rng = random.Random(seed)
    ids = [f"p{i}" for i in range(prompts)]
    costs = {p: rng.uniform(8, 400) for p in ids if rng.random() < 0.9}
    owners = {p: rng.randrange(workers) for p in ids if rng.random() < owned}
    return ids, costs, owners


@pytest.mark.parametrize("workers", [2, 3, 8])
@pytest.mark.parametrize("seed", range(5))
def test_every_prompt_once_and_load_bounded(workers, seed):
    ids, costs, owners = _batch(seed, 64, workers, owned=0.8)
    slack = 0.1
    plan = plan_dispatch(ids, costs, owners, list(range(workers)), slack)
    positions = sorted(i for shard in plan.shards for i in shard)
    assert positions == list(range(len(ids)))
    for j, shard in enumerate(plan.shards):
        assert shard == sorted(shard)  # batch order within a shard
        assert all(plan.targets[ids[i]] == j for i in shard)
    known = [costs[p] for p in ids if p in costs]
    cost = [costs.get(p, sum(known) / len(known)) for p in ids]
    mean = sum(cost) / workers
    # kept prompts fill an owner up to the cap; the rest go LPT to the least loaded
    assert max(plan.loads) <= max((1 + slack) * mean, mean + max(cost)) + 1e-9
    # affinity: an owned prompt leaves its owner only when the owner is past the cap with it
    for pid, old, new in moves(plan, owners):
        assert old != new and owners[pid] == old
    assert plan == plan_dispatch(ids, costs, owners, list(range(workers)), slack)


def test_owned_prompts_stay_when_balanced():
    ids = [f"p{i}" for i in range(8)]
    costs = dict.fromkeys(ids, 10.0)
    owners = {p: i % 2 for i, p in enumerate(ids)}
    plan = plan_dispatch(ids, costs, owners, [0, 1], max_imbalance=0.0)
    assert moves(plan, owners) == []
    assert plan.shards == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert plan.imbalance == 1.0


def test_overloaded_owner_sheds_to_the_least_loaded():
    ids = [f"p{i}" for i in range(6)]
    costs = dict.fromkeys(ids, 10.0)
    owners = dict.fromkeys(ids, 0)  # one worker owns everything
    plan = plan_dispatch(ids, costs, owners, [0, 1, 2], max_imbalance=0.0)
    assert plan.loads == [20.0, 20.0, 20.0]
    assert plan.shards[0] == [0, 1]  # the first ones in batch order stay
    assert {(p, o) for p, o, _ in moves(plan, owners)} == {(p, 0) for p in ids[2:]}


def test_first_seen_and_dead_owners_go_least_loaded():
    ids = ["a", "b", "c", "d"]
    costs = {"a": 30.0, "b": 10.0}  # c, d never rolled out: the mean, 20
    owners = {"a": 5, "b": 0}  # worker 5 is dead (not among the live)
    plan = plan_dispatch(ids, costs, owners, [0, 1], max_imbalance=0.5)
    assert plan.targets["b"] == 0
    assert plan.targets["a"] == 1  # largest unplaced first, to the least loaded
    assert ("a", 5, 1) in moves(plan, owners)
    assert sorted(plan.loads) == [30.0, 50.0]


def test_a_repeated_prompt_goes_to_one_worker():
    ids = ["a", "b", "a", "c"]
    plan = plan_dispatch(ids, {}, {}, [0, 1], max_imbalance=0.0)
    assert plan.targets["a"] in (0, 1)
    shard = plan.shards[plan.targets["a"]]
    assert 0 in shard and 2 in shard


def test_affinity_beats_static_hashing_on_balance():
    """Prompt affinity with overflow stays within the slack where static ownership does not."""
    rng = random.Random(0)
    ids = [f"p{i}" for i in range(256)]
    costs = {p: rng.lognormvariate(4, 0.8) for p in ids}
    owners = {p: rng.randrange(8) for p in ids}
    static = [0.0] * 8
    for p in ids:
        static[owners[p]] += costs[p]
    plan = plan_dispatch(ids, costs, owners, list(range(8)), max_imbalance=0.08)
    assert plan.imbalance <= 1.08 + max(costs.values()) / (sum(costs.values()) / 8)
    assert plan.imbalance < max(static) / (sum(static) / 8)
