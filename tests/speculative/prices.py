"""Verification budgets at fixed prices (seconds per verified position and per decoded token),
so that what they verify does not depend on this machine's speed; what they fit from the
rollouts (the trie's drift, the drafts' accept rate) is still fitted."""

from specrl.speculative.reuse.budget import DraftBudget, TrieBudget


class FixedPrices:
    def __init__(self, node_cost: float, token_cost: float, prompt_cost: float = 0.0) -> None:
        super().__init__()
        self.prices = node_cost, token_cost, prompt_cost

    @property
    def node_cost(self) -> float:
        return self.prices[0]

    @property
    def prompt_cost(self) -> float:
        return self.prices[2]

    def token_cost(self, reuse: float) -> float:
        return self.prices[1]


class TriePrices(FixedPrices, TrieBudget):
    pass


class DraftPrices(FixedPrices, DraftBudget):
    pass
