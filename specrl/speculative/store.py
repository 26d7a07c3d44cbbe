"""RolloutStore: the latest rollout per (prompt id, slot) — next time's draft.

Keyed by the prompt id (a hash of the prompt's token ids), so it works with shuffled data, any
batch composition and resumed runs. Token ids are stored as int32 and current logprobs (under the
policy that produced the rollout: p_old when it is verified) as float32 arrays of their true
length (no padding): 8 bytes per token plus a small fixed cost per entry.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from specrl.types import FinishReason, Rollout


@dataclass(frozen=True)
class StoredRollout:
    token_ids: np.ndarray  # [L] int32
    current_logprobs: np.ndarray  # [L] float32, under the policy of `policy_version`
    finish_reason: FinishReason
    policy_version: int

    def __len__(self) -> int:
        return len(self.token_ids)


class RolloutStore:
    def __init__(self) -> None:
        self._entries: dict[tuple[str, int], StoredRollout] = {}
        self.num_tokens = 0  # tokens held, kept up to date by every change
        self.nbytes = 0  # bytes held by token and logprob arrays

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, prompt_id: str, slot: int) -> StoredRollout | None:
        return self._entries.get((prompt_id, slot))

    def put(self, rollout: Rollout) -> None:
        """Keep `rollout` as the next draft of its (prompt id, slot)."""
        key = (rollout.prompt.prompt_id, rollout.slot)
        entry = StoredRollout(
            np.asarray(rollout.token_ids, dtype=np.int32),
            np.asarray(rollout.current_logprobs, dtype=np.float32),
            rollout.finish_reason,
            rollout.policy_version,
        )
        old = self._entries.get(key)
        if old is not None:
            self._count(old, -1)
        self._entries[key] = entry
        self._count(entry, 1)

    def _count(self, entry: StoredRollout, sign: int) -> None:
        self.num_tokens += sign * len(entry)
        self.nbytes += sign * (entry.token_ids.nbytes + entry.current_logprobs.nbytes)

    def state_dict(self) -> dict[str, Any]:
        return self._pack(list(self._entries))

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._entries, self.num_tokens, self.nbytes = {}, 0, 0
        self.import_(state)

    def export(self, prompt_ids: Iterable[str]) -> dict[str, Any]:
        """The entries of these prompts (every slot), as flat arrays."""
        wanted = set(prompt_ids)
        return self._pack([k for k in self._entries if k[0] in wanted])

    def import_(self, state: dict[str, Any]) -> None:
        """Add (or replace) the entries `export` or `state_dict` gave."""
        offsets = np.concatenate([[0], np.cumsum(state["lengths"])])
        for i, (pid, slot) in enumerate(zip(state["prompt_ids"], state["slots"], strict=True)):
            key = (pid, int(slot))
            if key in self._entries:
                self._count(self._entries[key], -1)
            entry = StoredRollout(  # copies: the state may be a read-only buffer (Ray)
                np.array(state["token_ids"][offsets[i] : offsets[i + 1]]),
                np.array(state["current_logprobs"][offsets[i] : offsets[i + 1]]),
                state["finish_reasons"][i],
                int(state["policy_versions"][i]),
            )
            self._entries[key] = entry
            self._count(entry, 1)

    def drop(self, prompt_ids: Iterable[str]) -> None:
        """Forget these prompts (every slot): another stage owns them now."""
        gone = set(prompt_ids)
        for key in [k for k in self._entries if k[0] in gone]:
            self._count(self._entries.pop(key), -1)

    def _pack(self, keys: list[tuple[str, int]]) -> dict[str, Any]:
        entries = [self._entries[k] for k in keys]
        return {
            "prompt_ids": [k[0] for k in keys],
            "slots": np.array([k[1] for k in keys], dtype=np.int64),
            "lengths": np.array([len(e) for e in entries], dtype=np.int64),
            "token_ids": np.concatenate([np.zeros(0, np.int32), *(e.token_ids for e in entries)]),
            "current_logprobs": np.concatenate(
                [np.zeros(0, np.float32), *(e.current_logprobs for e in entries)]
            ),
            "finish_reasons": [e.finish_reason for e in entries],
            "policy_versions": np.array([e.policy_version for e in entries], dtype=np.int64),
        }
