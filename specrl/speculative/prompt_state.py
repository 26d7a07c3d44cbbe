"""The speculative state of prompts, by prompt id: their drafts (every slot's last response, a
`RolloutStore`) and their token trees (a `TokenTree`, or None where no trees are kept).

One class for every holder of it: the speculative stage, and the Ray controller's copy of what
its workers last reported (which adopts the trees that arrive). What moves with a prompt
between holders (`export` / `import_` / `drop`) and what a checkpoint holds (`state_dict`) are
the same formats everywhere, so a run saved by one holder resumes in another.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from specrl.speculative.store import RolloutStore
from specrl.speculative.token_trees import TokenTree


class PromptState:
    def __init__(self, tree: TokenTree | None, adopt_trees: bool = False) -> None:
        """`tree`: the prompts' token trees, or None without trees; `adopt_trees`: start one
        (never evicting) when trees arrive (the controller's copy: its workers evict, each
        within its share)."""
        self.store = RolloutStore()
        self.tree = tree
        self.adopt_trees = adopt_trees

    def export(self, prompt_ids: Iterable[str]) -> dict[str, Any]:
        """The state of these prompts: their drafts (every slot) and token trees."""
        prompt_ids = list(prompt_ids)
        return {
            "store": self.store.export(prompt_ids),
            "tree": None if self.tree is None else self.tree.export(prompt_ids),
        }

    def import_(self, state: dict[str, Any]) -> None:
        """Take over prompts `export` gave (replacing what was held for them)."""
        self.store.import_(state["store"])
        if self._takes(state["tree"]):
            self.tree.import_(state["tree"])

    def drop(self, prompt_ids: Iterable[str]) -> None:
        """Forget these prompts (they moved to another holder)."""
        prompt_ids = list(prompt_ids)
        self.store.drop(prompt_ids)
        if self.tree is not None:
            self.tree.drop(prompt_ids)

    def state_dict(self) -> dict[str, Any]:
        return {
            "store": self.store.state_dict(),
            "tree": None if self.tree is None else self.tree.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.store.load_state_dict(state["store"])
        if self._takes(state["tree"]):
            self.tree.load_state_dict(state["tree"])

    def _takes(self, tree_state: dict[str, Any] | None) -> bool:
        """Whether a tree state that arrived is kept (starting a tree to keep it in)."""
        if tree_state is not None and self.tree is None and self.adopt_trees:
            self.tree = TokenTree()
        return tree_state is not None and self.tree is not None
