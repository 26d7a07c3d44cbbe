"""RolloutStore: the latest rollout per (prompt id, slot) — next time's draft.

Keyed by the prompt id (a hash of the prompt's token ids), so it works with shuffled data, any
batch composition and resumed runs. Token ids are stored as int32 and behaviour logprobs as
float32 arrays of their true length (no padding): 8 bytes per token plus a small fixed cost per
entry.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from specrl.engines import FinishReason


@dataclass(frozen=True)
class StoredRollout:
    token_ids: np.ndarray  # [L] int32
    logprobs: np.ndarray  # [L] float32, behaviour logprobs under the policy of `policy_step`
    finish_reason: FinishReason
    policy_step: int

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

    def put(
        self,
        prompt_id: str,
        slot: int,
        token_ids: list[int],
        logprobs: list[float],
        finish_reason: FinishReason,
        policy_step: int,
    ) -> None:
        entry = StoredRollout(
            np.asarray(token_ids, dtype=np.int32),
            np.asarray(logprobs, dtype=np.float32),
            finish_reason,
            policy_step,
        )
        old = self._entries.get((prompt_id, slot))
        if old is not None:
            self._count(old, -1)
        self._entries[(prompt_id, slot)] = entry
        self._count(entry, 1)

    def _count(self, entry: StoredRollout, sign: int) -> None:
        self.num_tokens += sign * len(entry)
        self.nbytes += sign * (entry.token_ids.nbytes + entry.logprobs.nbytes)

    def state_dict(self) -> dict[str, Any]:
        keys = list(self._entries)
        entries = [self._entries[k] for k in keys]
        lengths = np.array([len(e) for e in entries], dtype=np.int64)
        return {
            "prompt_ids": [k[0] for k in keys],
            "slots": np.array([k[1] for k in keys], dtype=np.int64),
            "lengths": lengths,
            "token_ids": np.concatenate([e.token_ids for e in entries])
            if entries
            else np.zeros(0, np.int32),
            "logprobs": np.concatenate([e.logprobs for e in entries])
            if entries
            else np.zeros(0, np.float32),
            "finish_reasons": [e.finish_reason for e in entries],
            "policy_steps": np.array([e.policy_step for e in entries], dtype=np.int64),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        offsets = np.concatenate([[0], np.cumsum(state["lengths"])])
        self._entries = {
            (pid, int(slot)): StoredRollout(
                state["token_ids"][offsets[i] : offsets[i + 1]],
                state["logprobs"][offsets[i] : offsets[i + 1]],
                state["finish_reasons"][i],
                int(state["policy_steps"][i]),
            )
            for i, (pid, slot) in enumerate(zip(state["prompt_ids"], state["slots"], strict=True))
        }
        self.num_tokens = self.nbytes = 0
        for entry in self._entries.values():
            self._count(entry, 1)
