"""`Reuse`: what every reuse strategy does at the four points of a stage call where reuse happens,
and what it does when a strategy does nothing there (as when speculation is off: nothing is
reused, every slot is decoded from its prompt)."""

from __future__ import annotations

from collections.abc import Sequence

from specrl.engines import GenRequest, GenResult, Prefixes
from specrl.speculative.drafting import DraftSource
from specrl.speculative.slots import Slot
from specrl.speculative.stats import RolloutStats
from specrl.types import Rollout


class Reuse:
    """A way of reusing history, chosen once per stage (speculative/reuse/__init__.py). The
    stage runs `before_decoding` (each slot's `reused`), decodes what is left with `drafter`'s
    drafts, then `after_decoding` and, once rollouts are assembled, `keep`."""

    # stored drafts are verified inside decoding: the engine's results count them
    drafts_in_decoding: bool = False
    # what a slot reuses is verified under its own context (a trie pass), so every turn of an
    # episode may reuse, not only turns whose earlier observations agree with its stored draft's
    every_turn_reuses: bool = False

    def before_decoding(
        self, slots: list[Slot], seed_key: tuple, prefixes: Prefixes | None, stats: RolloutStats
    ) -> None:
        """Set `reused` of the slots that reuse something before decoding: none here."""

    def drafter(
        self, slots: Sequence[Slot], requests: dict[int, GenRequest], trees: DraftSource | None
    ) -> DraftSource | None:
        """What proposes drafts while `requests` (by slot index) are decoded: the token trees'
        drafts, or none."""
        return trees

    def after_decoding(
        self, slots: list[Slot], results: dict[int, GenResult], stats: RolloutStats
    ) -> None:
        """What decoding settled (drafts verified inside it; `stats` holds its seconds):
        nothing here."""

    def keep(self, rollouts: Sequence[Rollout]) -> None:
        """Keep what later calls reuse beyond the token trees: nothing here."""
