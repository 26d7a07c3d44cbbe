"""Prompt lookup drafts: what they propose, and that a prompt's first rollout drafts with them and
still samples vanilla's tokens."""

import random

from specrl.config import SpecConfig, TreeConfig
from specrl.engines import SamplingParams
from specrl.engines.hf import HFEngine
from specrl.rollouts import sample_rollouts
from specrl.speculative.lookup import FirstProposal, PromptLookup
from specrl.speculative.stage import SpeculativeStage
from specrl.types import Example, Prompt
from tests.conftest import EOS, PAD, make_tiny_model


def searched(context: list[int], k: int, longest: int) -> list[int]:
    """The tokens after the latest earlier occurrence of the context's last n tokens, the
    longest n first, by scanning the context."""
    for n in range(min(longest, len(context) - 1), 0, -1):
        for start in range(len(context) - n - 1, -1, -1):
            if context[start : start + n] == context[-n:]:
                return context[start + n : start + n + k]
    return []


def test_proposals_equal_a_scan_of_the_context_as_tokens_arrive():
    rng = random.Random(0)
    for trial in range(30):
        longest = rng.choice([1, 2, 3, 4])
        contexts = [[rng.randrange(5) for _ in range(rng.randrange(0, 12))] for _ in range(3)]
        lookup = PromptLookup(contexts, longest)
        new = [[] for _ in contexts]
        for _ in range(25):
            request = rng.randrange(len(contexts))
            new[request] += [rng.randrange(5) for _ in range(rng.randrange(0, 3))]
            k = rng.randrange(1, 6)
            expected = searched(contexts[request] + new[request], k, longest)
            assert lookup.propose(request, new[request], k) == expected, trial


def test_a_sequence_that_repeats_itself_is_drafted_its_repetition():
    lookup = PromptLookup([[7, 1, 2, 3, 9]], longest=3)
    assert lookup.propose(0, [1, 2], 4) == [3, 9, 1, 2]
    assert lookup.propose(0, [1, 2, 8], 4) == []


class Fixed:
    def __init__(self, tokens):
        self.tokens, self.done = tokens, {}

    def propose(self, request, new_tokens, max_tokens):
        return self.tokens[:max_tokens]

    def finished(self, request, new_tokens):
        self.done[request] = list(new_tokens)


def test_the_first_source_that_proposes_is_taken_and_every_source_hears_of_the_end():
    first, then = Fixed([]), Fixed([4, 5, 6])
    assert FirstProposal(first, then).propose(0, [], 2) == [4, 5]
    assert FirstProposal(then, Fixed([1])).propose(0, [], 8) == [4, 5, 6]
    FirstProposal(first, then).finished(3, [1, 2])
    assert first.done == then.done == {3: [1, 2]}


PROMPTS = [Prompt(ids, Example(str(ids), "", "t")) for ids in [(3, 4, 3, 4), (5, 6, 5), (2, 9)]]
SAMPLING = SamplingParams(1.0)


def test_first_rollouts_draft_by_lookup_and_sample_vanillas_tokens():
    engine = HFEngine(make_tiny_model(seed=0, init=1.0), [EOS], PAD)
    stats = {}
    for n in (0, 3):
        tree = TreeConfig(enabled=True, adaptive=False, prompt_lookup=n)
        stage = SpeculativeStage(engine, SAMPLING, 16, SpecConfig(enabled=True, tree=tree))
        rollouts, stats[n] = stage(PROMPTS, 6, ("s", 1), 1)
        vanilla = sample_rollouts(engine, PROMPTS, 6, SAMPLING, 16, ("s", 1), 1)
        assert [r.token_ids for r in rollouts] == [r.token_ids for r in vanilla]
    assert stats[0].drafted_tokens == 0  # the trees hold nothing yet
    assert 0 < stats[3].accepted_draft_tokens < stats[3].drafted_tokens
    assert stats[3].draft_forwards < stats[0].draft_forwards
