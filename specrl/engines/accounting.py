"""What an engine computed, forward by forward: the counts a GPU's time follows.

Every engine keeps a running `ForwardCounts` (`engine.counts`); the stage records how much it
grew over a call in its `RolloutStats`, logged per step as `perf/<kind>/<quantity>`:

- kinds: `prefill` (contexts before decoding), `decode` (one token per sequence, plus the
  draft tokens verified in the same forward), `verify` (verification passes: drafts, trie
  nodes, behaviour logprobs; on the transformers engine the context is recomputed with them);
- quantities: `forwards` (model calls, one after another: the latency path of the kind),
  `rows` (sequences, summed over forwards), `positions` (token positions computed, padding
  excluded), `draft_positions` (decode: of which draft tokens), `kv_reads` (KV entries read:
  each row reads its whole context once per forward), `attended` (query-key pairs: the
  attention FLOPs follow them), `computed_positions` and `computed_kv_reads` (the same,
  padding included: what an engine that pads its batches computed; the transformers engine pads
  its rows to the widest, a paged engine does not); and, logged as `timing_s/forward/<kind>`,
  the wall seconds
  inside the kind's forwards as the engine timed them, synchronised on a GPU: what the cost
  model prices, apart from the engine's host work around them (0 on vLLM, which runs its
  forwards inside its own steps);
- with static decoding on CUDA, `perf/decode/captures`: the CUDA graphs captured, and
  `timing_s/capture/decode`: the seconds their captures took, within the decode seconds (a
  capture runs the forward twice and records it a third time; a replay is what the cost
  model prices).

The transformers engine counts its own forwards exactly. vLLM schedules internally: its
forwards are the engine steps, and the positions and KV reads are derived from the requests
(every context prefilled whole, as when the prefix cache misses).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, fields

KINDS = ("prefill", "decode", "verify")


@dataclass
class ForwardCounts:
    prefill_forwards: int = 0
    prefill_rows: int = 0
    prefill_positions: int = 0
    prefill_kv_reads: int = 0
    prefill_attended: int = 0
    decode_forwards: int = 0
    decode_rows: int = 0
    decode_positions: int = 0
    decode_draft_positions: int = 0
    decode_kv_reads: int = 0
    decode_attended: int = 0
    verify_forwards: int = 0
    verify_rows: int = 0
    verify_positions: int = 0
    verify_kv_reads: int = 0
    verify_attended: int = 0
    prefill_computed_positions: int = 0
    prefill_computed_kv_reads: int = 0
    decode_computed_positions: int = 0
    decode_computed_kv_reads: int = 0
    verify_computed_positions: int = 0
    verify_computed_kv_reads: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    verify_seconds: float = 0.0
    decode_captures: int = 0
    decode_capture_seconds: float = 0.0

    def record(
        self,
        kind: str,
        rows: int,
        positions: int,
        kv_reads: int,
        attended: int,
        draft_positions: int = 0,
        forwards: int = 1,
        computed: tuple[int, int] | None = None,
    ) -> None:
        """Add `forwards` model calls of `kind` (one, unless an engine reports several);
        `computed`: their (positions, KV reads) with padding (None: no padding)."""
        if kind not in KINDS:
            raise ValueError(f"forward kind {kind!r} is none of {KINDS}")
        computed_positions, computed_kv_reads = computed or (positions, kv_reads)
        values = {
            "forwards": forwards,
            "rows": rows,
            "positions": positions,
            "kv_reads": kv_reads,
            "attended": attended,
            "computed_positions": computed_positions,
            "computed_kv_reads": computed_kv_reads,
        }
        if kind == "decode":
            values["draft_positions"] = draft_positions
        for quantity, value in values.items():
            name = f"{kind}_{quantity}"
            setattr(self, name, getattr(self, name) + int(value))

    def add_seconds(self, kind: str, seconds: float) -> None:
        """Add the wall seconds of a forward of `kind`."""
        if kind not in KINDS:
            raise ValueError(f"forward kind {kind!r} is none of {KINDS}")
        name = f"{kind}_seconds"
        setattr(self, name, getattr(self, name) + seconds)

    def add_capture(self, seconds: float) -> None:
        """Count a CUDA graph captured for a decode forward, in `seconds` (which that forward's
        seconds include)."""
        self.decode_captures += 1
        self.decode_capture_seconds += seconds

    def as_computed(self) -> ForwardCounts:
        """These counts with the positions and KV reads the engine computed, padding included
        (what its forwards' time follows; counts logged before they were kept: as counted)."""
        out = copy.copy(self)
        for kind in KINDS:
            for quantity in ("positions", "kv_reads"):
                padded = getattr(self, f"{kind}_computed_{quantity}")
                setattr(out, f"{kind}_{quantity}", padded or getattr(self, f"{kind}_{quantity}"))
        return out

    @property
    def seconds(self) -> float:
        """Wall seconds inside forwards, every kind."""
        return self.prefill_seconds + self.decode_seconds + self.verify_seconds

    def __add__(self, other: ForwardCounts) -> ForwardCounts:
        return ForwardCounts(
            **{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)}
        )

    def __sub__(self, other: ForwardCounts) -> ForwardCounts:
        return ForwardCounts(
            **{f.name: getattr(self, f.name) - getattr(other, f.name) for f in fields(self)}
        )

    def side_by_side(self, other: ForwardCounts) -> ForwardCounts:
        """Two engines that ran at the same time (rollout workers): the work adds up, the
        forwards one after another and their seconds are the longer sequence's."""
        out = self + other
        for kind in KINDS:
            for quantity in ("forwards", "seconds"):
                name = f"{kind}_{quantity}"
                setattr(out, name, max(getattr(self, name), getattr(other, name)))
        return out

    def metrics(self) -> dict[str, float]:
        return {metric_name(f.name): float(getattr(self, f.name)) for f in fields(self)}

    @classmethod
    def from_metrics(cls, metrics: Mapping[str, float]) -> ForwardCounts:
        return cls(
            **{
                f.name: (float if f.name.endswith("_seconds") else int)(
                    metrics[metric_name(f.name)]
                )
                for f in fields(cls)
                if metric_name(f.name) in metrics
            }
        )


def metric_name(field_name: str) -> str:
    """perf/<kind>/<quantity>; the seconds, a timing that no two runs repeat, under timing_s/."""
    kind, quantity = field_name.split("_", 1)
    if quantity == "seconds":
        return f"timing_s/forward/{kind}"
    if quantity == "capture_seconds":
        return f"timing_s/capture/{kind}"
    return f"perf/{kind}/{quantity}"


def causal_attended(positions, past):
    """Query-key pairs of `positions` new tokens after `past` cached ones, causally (ints, or
    tensors of them row by row)."""
    return positions * past + positions * (positions + 1) // 2
