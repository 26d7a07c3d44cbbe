"""Prefix KV kept from verification passes, for decoding that continues a verified sequence or a node
of a verified trie."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specrl.engines.protocol import SamplingParams


@dataclass(frozen=True)
class Hit:
    """Where a context's KV lies in a cached batch: its row and the KV columns it attends to, in
    order (contiguous for a verified sequence; the prompt's and the node's ancestors' for a trie
    node), and the row of the batch's kept distributions that follows it (None: not kept)."""

    batch: int
    row: int
    columns: torch.Tensor  # [len(context)]
    distribution: int | None


@dataclass
class _Trie:
    """A verified trie in a cached batch: its row, where its prompt starts, and its nodes (node i
    at column `nodes_start + i - 1`; node 0 is the root, after the prompt's last column)."""

    batch: int
    row: int
    prompt: tuple[int, ...]
    prompt_start: int
    nodes_start: int
    children: list[dict[int, int]]  # of every node: token → child


class PrefixCache:
    """The transformers engine's `Prefixes` handle: KV of the sequences `logprobs` verified into it
    and of the tries `verify_tries` verified, so decoding that continues a verified sequence (prompt +
    draft[:k]) or leaves a trie at a node does not compute its prefix again, and the sampling
    distributions there, so that its first new token needs no forward either (kept when they
    take no more memory than the KV: small vocabularies). Valid for the weights it was verified
    with."""

    def __init__(self) -> None:
        self.batches: list[tuple[list[torch.Tensor], torch.Tensor]] = []  # per-layer KV, mask
        self.distributions: list[tuple[torch.Tensor, Sequence[SamplingParams]] | None] = []
        self._rows: dict[int, list[tuple[int, int, tuple[int, ...]]]] = {}  # by first token
        self._tries: dict[int, list[_Trie]] = {}  # by the first token of the prompt
        # what `find` answered since the last batch came in: decoding asks twice per context,
        # for its first token's distribution, then for its KV
        self._found: dict[tuple[int, ...], Hit | None] = {}

    def add(
        self,
        sequences: list[list[int]],
        kv: list[torch.Tensor],
        attention: torch.Tensor,
        distributions: torch.Tensor | None = None,
        sampling: Sequence[SamplingParams] = (),
    ) -> None:
        """`distributions` [B, n + 1, V]: column j is the sampling distribution (logprobs) of
        the token at column W - n + j of the right-aligned sequences (width W), j = n the one
        after them; `sampling`: each row's params."""
        batch = self._add_batch(kv, attention, distributions, sampling)
        for row, seq in enumerate(sequences):
            self._rows.setdefault(seq[0], []).append((batch, row, tuple(seq)))

    def add_tries(
        self,
        tries: Sequence[tuple[Sequence[int], Sequence[int], Sequence[int]]],
        kv: list[torch.Tensor],
        attention: torch.Tensor,
        distributions: torch.Tensor | None = None,
        sampling: Sequence[SamplingParams] = (),
    ) -> None:
        """A batch of verified tries, one per row: (prompt ids, parent of each node, token of each
        node), nodes 1..N in an order where parents come first, right-aligned after the prompt.
        `distributions` [B, N + 1, V]: row b's sampling distribution after its node i (i = 0:
        after the prompt)."""
        batch = self._add_batch(kv, attention, distributions, sampling)
        width = attention.shape[1]
        for row, (prompt, parents, tokens) in enumerate(tries):
            children: list[dict[int, int]] = [{} for _ in range(len(tokens) + 1)]
            for node, (parent, token) in enumerate(zip(parents, tokens, strict=True), start=1):
                children[parent][token] = node
            nodes_start = width - len(tokens)
            trie = _Trie(
                batch, row, tuple(prompt), nodes_start - len(prompt), nodes_start, children
            )
            self._tries.setdefault(prompt[0], []).append(trie)

    def _add_batch(
        self,
        kv: list[torch.Tensor],
        attention: torch.Tensor,
        distributions: torch.Tensor | None,
        sampling: Sequence[SamplingParams],
    ) -> int:
        self.batches.append((kv, attention))
        self._found.clear()
        self.distributions.append(None if distributions is None else (distributions, sampling))
        return len(self.batches) - 1

    def next_token(self, context: list[int], sampling: SamplingParams) -> torch.Tensor | None:
        """The sampling distribution [V] of the token after `context`, if it continues a verified
        sequence or trie node whose distribution there was kept."""
        hit = self.find(context)
        if hit is None or hit.distribution is None:
            return None
        distributions, params = self.distributions[hit.batch]
        if params[hit.row] != sampling:
            return None
        return distributions[hit.row, hit.distribution]

    def find(self, head: list[int]) -> Hit | None:
        """Where the KV of `head` is cached, if a verified sequence starts with it or it is a node
        of a verified trie."""
        if not head:
            return None
        key = tuple(head)
        if key not in self._found:
            self._found[key] = self._find(head)
        return self._found[key]

    def _find(self, head: list[int]) -> Hit | None:
        for trie in self._tries.get(head[0], ()):
            hit = self._trie_hit(trie, head)
            if hit is not None:
                return hit
        for batch, row, seq in self._rows.get(head[0], ()):
            if len(seq) >= len(head) and list(seq[: len(head)]) == head:
                _, valid = self.batches[batch]
                start = int(valid[row].argmax())  # its first real (non-pad) column
                columns = torch.arange(start, start + len(head), device=valid.device)
                kept = self.distributions[batch]
                column = None if kept is None else kept[0].shape[1] - 1 - len(seq) + len(head)
                return Hit(batch, row, columns, None if column is None or column < 0 else column)
        return None

    def _trie_hit(self, trie: _Trie, head: list[int]) -> Hit | None:
        """The context of a node, or a head of the prompt (a slot that left its trie at the
        root feeds the prompt's last token after the KV of the rest; with a large vocabulary the
        root's distribution is not kept, and that token is not drawn from here first)."""
        prompt = len(trie.prompt)
        if tuple(head[:prompt]) != trie.prompt[: len(head)]:
            return None
        node, path = 0, []
        for token in head[prompt:]:
            node = trie.children[node].get(token)
            if node is None:
                return None
            path.append(node)
        columns = [
            *range(trie.prompt_start, trie.prompt_start + min(len(head), prompt)),
            *(trie.nodes_start + n - 1 for n in path),
        ]
        _, valid = self.batches[trie.batch]
        kept = self.distributions[trie.batch]
        return Hit(
            trie.batch, trie.row, torch.tensor(columns, device=valid.device),
            None if kept is None or len(head) < prompt else node,
        )  # fmt: skip
