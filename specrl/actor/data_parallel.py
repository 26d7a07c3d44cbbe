"""The update on K learner ranks of a torch.distributed group (`actor.num_workers`,
`actor.strategy`): which rows of a mini-batch each rank computes, how its model is wrapped, and
when gradients are reduced. With K = 1 (the in-process actor) every function here is the
identity, so one code path serves both.

Each mini-batch is split across ranks by token count (not by sequence count). Losses keep the
mini-batch's global normalisation (`AggScale` of the whole mini-batch: its tokens and sequences
over all ranks), so the ranks' losses are shares that add up to the mini-batch's loss. DDP and
FSDP2 average gradients over ranks; each rank's loss is multiplied by K first, so the reduced
gradient is the sum of the shares' gradients: K ranks compute the update one rank would.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from specrl.config import ActorConfig


@dataclass(frozen=True)
class Rank:
    """This process's place in the learner group."""

    index: int = 0
    world: int = 1


SINGLE = Rank()  # the one rank of the in-process actor


def balanced_split(rows: torch.Tensor, tokens: torch.Tensor, world: int) -> list[torch.Tensor]:
    """Split `rows` (indices into a batch whose per-row token counts are `tokens`) into `world`
    parts of near-equal token counts: largest rows first, each to the least-loaded part (LPT).
    Each part keeps the order of `rows`; with world = 1 the one part is `rows`."""
    if world == 1:
        return [rows]
    cost = tokens[rows].tolist()
    loads = [0.0] * world
    part_of = [0] * len(cost)
    for i in sorted(range(len(cost)), key=lambda i: (-cost[i], i)):
        part = min(range(world), key=lambda w: (loads[w], w))
        part_of[i] = part
        loads[part] += cost[i]
    return [rows[[i for i, p in enumerate(part_of) if p == w]] for w in range(world)]


def micro_batches(
    parts: list[torch.Tensor], rank: Rank, size: int
) -> list[tuple[torch.Tensor, float]]:
    """This rank's micro-batches of `size` rows from its part, each with the weight of its loss:
    as many as the part with the most (every FSDP forward gathers parameters from all ranks, so
    ranks run equally many), the missing ones one row of another part at weight 0."""
    mine = list(parts[rank.index].split(size))
    count = max(-(-len(p) // size) for p in parts)
    filler = next(p for p in parts if len(p))[:1]
    return [(m, 1.0) for m in mine] + [(filler, 0.0)] * (count - len(mine))


def wrap(model: torch.nn.Module, cfg: ActorConfig, rank: Rank, train: bool) -> torch.nn.Module:
    """The model (the policy, the KL reference or the critic) as this rank runs it: activation
    checkpointing (`actor.gradient_checkpointing`) for a model being trained; with K > 1 ranks,
    `actor.strategy`: DDP (replicas, gradients all-reduced) or FSDP2 (`fully_shard` of each
    transformer block and of the root: parameters, gradients and optimizer state sharded across
    ranks). A frozen model (the KL reference) is sharded under FSDP2 and left as it is under
    DDP."""
    if train and cfg.gradient_checkpointing:
        model.activation_checkpointing_enable({"use_reentrant": False})
    if rank.world == 1:
        return model
    if cfg.strategy == "fsdp2":
        blocks = set(getattr(model, "_no_split_modules", None) or ())
        for module in model.modules():
            if type(module).__name__ in blocks:
                fully_shard(module)
        fully_shard(model)
        return model
    if not train:
        return model
    device_ids = [model.device.index] if model.device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=device_ids, forward_sync_buffers=False)


@contextlib.contextmanager
def gradient_sync(model: torch.nn.Module, enabled: bool) -> Iterator[None]:
    """Reduce gradients across ranks in this backward (the last micro-batch of a mini-batch)
    or only accumulate them locally."""
    if isinstance(model, DistributedDataParallel) and not enabled:
        with model.no_sync():
            yield
        return
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(enabled)
    yield


def full_norm(norm: torch.Tensor) -> torch.Tensor:
    """The global gradient norm as a plain tensor (FSDP2's `clip_grad_norm_` returns a DTensor)."""
    return norm.full_tensor() if isinstance(norm, DTensor) else norm


def _full(world: int) -> StateDictOptions:
    """Full (unsharded) state on every rank's call, offloaded to CPU on rank 0 with K > 1."""
    return StateDictOptions(full_state_dict=True, cpu_offload=world > 1)


def full_model_state(model: torch.nn.Module, world: int) -> dict[str, torch.Tensor]:
    """The model's full state dict under its own parameter names (every rank calls; with
    K > 1 only rank 0 gets it)."""
    return get_model_state_dict(model, options=_full(world))


def load_model_state(
    model: torch.nn.Module, state: dict[str, torch.Tensor], strict: bool = True
) -> None:
    """Load a `full_model_state` (each rank keeps its shard under FSDP2); not `strict`: a part of
    one (a LoRA model's trained weights)."""
    set_model_state_dict(
        model, state, options=StateDictOptions(full_state_dict=True, strict=strict)
    )


def full_optimizer_state(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, world: int
) -> dict:
    """The optimizer's full state keyed by parameter names: the same for any K, so a
    checkpoint resumes on any number of ranks (every rank calls; with K > 1 only rank 0 gets
    it)."""
    return get_optimizer_state_dict(model, optimizer, options=_full(world))


def load_optimizer_state(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict
) -> None:
    """Load a `full_optimizer_state` (each rank keeps its shard under FSDP2). torch's own layout,
    keyed by parameter index, would be ignored without a word: it is refused."""
    keys = [*state["state"], *(p for group in state["param_groups"] for p in group["params"])]
    if not all(isinstance(k, str) for k in keys):
        raise ValueError("optimizer state keyed by parameter index, not by parameter name")
    set_optimizer_state_dict(
        model, optimizer, state, options=StateDictOptions(full_state_dict=True)
    )
