"""The rollout engine protocol and the request/result shapes every engine speaks.

The required part knows nothing of speculation: `generate`, `logprobs`, `load_weights`. What
only some engines can do is an optional capability, declared in `Capabilities` and checked once
by whoever needs it (the speculative stage, the trainer):

- `draft_decoding`: `generate_with_drafts(requests, drafter, prefixes)` verifies up to K draft
  tokens per sequence in each decode forward (model-free speculative decoding);
- `ragged_drafts` (with `draft_decoding`): a forward computes each sequence's own drafts, not K
  positions for every sequence (vLLM's speculative decoding; the transformers engine pads);
- `residual_sampling`: `GenRequest.excluded_tokens` is honoured (the first new token is drawn
  with those tokens removed and renormalised: the exact acceptance rule's residual);
- `prefix_reuse`: `new_prefixes()` returns a `Prefixes` handle. `logprobs(..., prefixes=h)` keeps
  in `h` the KV (and next-token distributions) of every sequence it verifies; `generate(...,
  prefixes=h)` continues a request whose context starts a sequence in `h` from there instead of
  computing it again. The handle is the whole contract: nothing is kept behind the caller's back,
  several `logprobs` calls (chunked verification) add to one handle, and it is only valid for
  the weights it was made with;
- `sleep`: `sleep()` / `wake_up()` free the accelerator's memory while the trainer updates;
- `own_drafts`: the engine drafts for itself while it decodes (vLLM's suffix decoding), in
  `generate`; its results count the decode forwards, draft and accepted tokens as
  `generate_with_drafts` results do;
- weights sent from outside (engines whose kind has `nccl_weight_sync`: build.py's
  `EngineKind`, known before an engine is built): `transfer_weights(phase, info)` runs one
  phase of a transfer the trainer's transfer engine drives (`WeightPhase`: init with the
  backend's init info, start, update with the update info, finish, shutdown); after finish
  the engine holds the new weights and nothing computed with the old ones;
- `trie_verification`: `verify_tries(requests, prefixes)` verifies a prompt's trie of earlier responses
  in one pass (every node attends to the prompt and its own ancestors) and returns, per node,
  what the engine's sampler needs to decide whether a slot's next token is that node
  (`TrieLogprobs`); with `prefixes`, decoding that leaves a trie at a node continues from the
  node's KV. Where the trie logprobs are `coupled`, the walk and decoding map the same uniform to the
  same token at every node; otherwise decoding after a walk excludes the children of the node
  it left at (`residual_sampling`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

import numpy as np
import torch

from specrl.engines.accounting import ForwardCounts
from specrl.types import FinishReason


@dataclass(frozen=True)
class SamplingParams:
    """The distribution tokens are drawn from: softmax(logits / temperature), then top-k, then
    top-p, each renormalised. `temperature == 0` is greedy (a point mass on the argmax)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


GREEDY = SamplingParams(temperature=0.0)


@dataclass(frozen=True)
class GenRequest:
    """Decode after `prompt_ids + prefix_ids` (the forced prefix is context, not output).

    `excluded_tokens` (engines with `residual_sampling`): the first new token is drawn from the
    sampling distribution with these tokens removed and renormalised (the exact rule's residual
    after a rejected draft token; after an uncoupled trie walk, the children of the node the
    slot left the trie at). Its reported logprob is under the full distribution.
    """

    prompt_ids: Sequence[int]
    max_new_tokens: int
    sampling: SamplingParams = SamplingParams()
    seed: int = 0
    prefix_ids: Sequence[int] = ()
    excluded_tokens: tuple[int, ...] = ()


@dataclass
class GenResult:
    token_ids: list[int]
    logprobs: list[float]  # each new token's current logprob (under the sampling distribution)
    finish_reason: FinishReason
    forwards: int = 0  # decode forwards this request took part in
    draft_tokens: int = 0  # draft tokens verified for it (draft_decoding, own_drafts)
    accepted_tokens: int = 0  # of which accepted
    # each new token's drawn interval (a, b] (`sampling.draw`), where the engine's sampler is
    # specrl's (the transformers engine; empty otherwise): the trie budget predicts walks by it
    intervals: list[tuple[float, float]] = field(default_factory=list)


@dataclass(frozen=True)
class LogprobRequest:
    """Logprob of each target token given `context_ids` and the targets before it."""

    context_ids: Sequence[int]
    target_ids: Sequence[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)


@dataclass(frozen=True)
class TrieRequest:
    """A prompt's trie to score: node i (1..N) holds `tokens[i - 1]` and hangs under node
    `parents[i - 1]` (0: the root, the empty response); a parent comes before its children."""

    prompt_ids: Sequence[int]
    parents: Sequence[int]
    tokens: Sequence[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)


@dataclass(frozen=True)
class TrieLogprobs:
    """The current policy over a verified trie, indexed by node (0: the root). A walk at node v
    with a uniform u moves to the child whose interval (low[c], high[c]] holds u · total[v], and
    leaves the trie at v when none does.

    `coupled` (the transformers engine): the intervals are the engine's sampler's own, so
    decoding from v with the same u draws the token the walk drew, and a walk is token for token
    vanilla decoding. Otherwise (vLLM, whose sampler specrl does not drive) the children's
    intervals are laid end to end from 0 with lengths p(c) and total[v] = 1: the walk takes
    child c with probability p(c), and a slot that leaves at v draws its next token from the
    residual without v's children (`GenRequest.excluded_tokens`), so its response is
    distributed exactly as the policy samples."""

    logprobs: np.ndarray  # [N + 1] sampling logprob of node i's token after its parent
    low: np.ndarray  # [N + 1] float64
    high: np.ndarray  # [N + 1] float64
    total: np.ndarray  # [N + 1] float64: the mass u is scaled by after node v (NaN: not read)
    coupled: bool = True


# the phases of a weight transfer driven from outside the engine, in order (init and shutdown
# once per transfer group, start / update / finish once per step)
WeightPhase = Literal["init", "start", "update", "finish", "shutdown"]


@dataclass(frozen=True)
class Capabilities:
    """What an engine can do beyond the required protocol (see the module docstring)."""

    draft_decoding: bool = False
    residual_sampling: bool = False
    prefix_reuse: bool = False
    sleep: bool = False
    own_drafts: bool = False
    ragged_drafts: bool = False
    trie_verification: bool = False
    # decode forwards replay CUDA graphs (hf with rollout.static_decode on CUDA): a row of a
    # forward costs nothing, so the verification budgets price a reused token by the forwards
    # its reuse removes alone
    graph_decoding: bool = False


class Prefixes(Protocol):
    """An engine's handle on the KV of verified sequences (`Capabilities.prefix_reuse`); opaque to
    callers."""


class Drafter(Protocol):
    """Draft tokens for `generate_with_drafts` and the number K to verify per forward. The engine
    calls, per decode forward: `worthwhile(B)`, then `propose` per sequence, `choose` once, and
    `observe` with what was accepted, how many sequences and positions the forward computed and
    how long it took; `finished` per sequence. An engine whose sequences decode together in one
    loop reports each loop (`observe_loop`: its forwards, its longest sequence's new tokens,
    the draft tokens accepted per sequence summed over its forwards). One whose forwards' cost
    steps with the KV columns they attend (static decoding's column buckets) gives that `span`
    with each question and observation; None elsewhere."""

    max_tokens: int

    def worthwhile(self, batch_size: int, span: int | None = None) -> bool: ...

    def propose(self, request: int, new_tokens: Sequence[int], max_tokens: int) -> list[int]: ...

    def choose(self, lengths: Sequence[int], span: int | None = None) -> int: ...

    def observe(
        self,
        proposed: Sequence[int],
        accepted: Sequence[int],
        sequences: int,
        fed_tokens: int,
        seconds: float,
        span: int | None = None,
    ) -> None: ...

    def observe_loop(self, forwards: int, longest: int, accepted_per_sequence: float) -> None: ...

    def finished(self, request: int, new_tokens: Sequence[int]) -> None: ...


class RolloutEngine(Protocol):
    eos_token_ids: frozenset[int]
    capabilities: Capabilities
    counts: ForwardCounts  # every forward so far (`accounting`): the stage reads its growth

    def generate(
        self, requests: Sequence[GenRequest], prefixes: Prefixes | None = None
    ) -> list[GenResult]: ...

    def logprobs(
        self, requests: Sequence[LogprobRequest], prefixes: Prefixes | None = None
    ) -> list[torch.Tensor]: ...

    def load_weights(self, state: Mapping[str, torch.Tensor]) -> None: ...


def distinct_requests(
    requests: Sequence[LogprobRequest],
) -> tuple[list[LogprobRequest], list[int]]:
    """Identical requests (the n slots of a prompt often hold the same draft), computed once:
    → (the distinct requests, the index into them of every request)."""
    index: dict[tuple, int] = {}
    distinct: list[LogprobRequest] = []
    where = []
    for r in requests:
        key = (tuple(r.context_ids), tuple(r.target_ids), r.sampling)
        if key not in index:
            index[key] = len(distinct)
            distinct.append(r)
        where.append(index[key])
    return distinct, where
