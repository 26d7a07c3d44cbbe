"""Which rollout worker rolls out which prompt: prompt affinity, balanced. Pure (no Ray).

A prompt's drafts and token tree live on the worker that owns it, so rolling it out anywhere
else first moves that state (a few KB). The planner keeps each prompt on its owner unless that
pushes the owner past `(1 + max_imbalance)` times the mean predicted load; such prompts, and
prompts no worker owns yet, go to the least-loaded worker, largest first (LPT). The predicted cost
of a prompt is the length of its last rollouts (the mean of known costs for a prompt never
rolled out). The result is deterministic: it depends only on the arguments.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Plan:
    """`shards[j]`: positions (in the batch) of the prompts the j-th live worker rolls out, in
    batch order; `targets`: prompt id → the worker that rolls it out (and owns it from now on);
    `loads[j]`: the j-th live worker's predicted cost."""

    shards: list[list[int]]
    targets: dict[str, int]
    loads: list[float]

    @property
    def imbalance(self) -> float:
        """Predicted max / mean load (1.0 is perfect balance)."""
        mean = sum(self.loads) / len(self.loads)
        return max(self.loads) / mean if mean > 0 else 1.0


def plan_dispatch(
    prompt_ids: Sequence[str],
    costs: Mapping[str, float],
    owners: Mapping[str, int],
    workers: Sequence[int],
    max_imbalance: float,
) -> Plan:
    """Assign each prompt of a batch (ids may repeat: each position is rolled out) to one of
    `workers` (the live worker indices; an owner not among them counts as no owner)."""
    known = [costs[p] for p in prompt_ids if p in costs]
    default = sum(known) / len(known) if known else 1.0
    cost = [costs.get(p, default) for p in prompt_ids]
    slot = {w: i for i, w in enumerate(workers)}
    loads = [0.0] * len(workers)
    cap = (1 + max_imbalance) * sum(cost) / len(workers)
    assigned: list[int | None] = [None] * len(prompt_ids)
    placed: dict[str, int] = {}  # a repeated prompt goes where its first position went
    for i, pid in enumerate(prompt_ids):
        owner = slot.get(owners.get(pid, -1))
        if owner is not None and loads[owner] + cost[i] <= cap:
            assigned[i] = placed[pid] = owner
            loads[owner] += cost[i]
    for i in sorted(range(len(prompt_ids)), key=lambda i: (-cost[i], i)):
        if assigned[i] is not None:
            continue
        pid = prompt_ids[i]
        target = placed.get(pid)
        if target is None:
            target = min(range(len(workers)), key=lambda w: (loads[w], w))
            placed[pid] = target
        assigned[i] = target
        loads[target] += cost[i]
    shards: list[list[int]] = [[] for _ in workers]
    for i, w in enumerate(assigned):
        shards[w].append(i)
    return Plan(shards, {pid: workers[j] for pid, j in placed.items()}, loads)
