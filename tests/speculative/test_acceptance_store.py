import math

import numpy as np
import torch

from specrl.speculative.acceptance import ExactRule, LenientRule, cut_indices
from specrl.speculative.store import RolloutStore
from specrl.types import Example, Prompt, Rollout

NEW = torch.log(torch.tensor([[0.5, 0.5, 0.5], [0.9, 0.1, 0.9]]))
OLD = torch.log(torch.tensor([[0.5, 0.5, 0.5], [0.9, 0.9, 0.9]]))


def test_cut_is_first_rejection_within_the_draft():
    accepted = torch.tensor(
        [[True, False, True], [True, True, True], [False, True, True], [True, True, False]]
    )
    lengths = torch.tensor([3, 3, 3, 2])
    # row 3: the rejection at position 2 lies beyond its draft of length 2 → whole draft kept
    assert cut_indices(accepted, lengths).tolist() == [1, 3, 0, 2]


def test_specrl_rule_with_lenience():
    u = torch.tensor([[0.99, 0.99, 0.99], [0.5, 0.5, 0.5]])
    # row 0: p_new = p_old → ratio 1 → always accepted; row 1: token 1 has ratio 1/9 < u = 0.5
    assert LenientRule(0.0).accept_mask(NEW, OLD, u).tolist() == [[True] * 3, [True, False, True]]
    # lenience e^2 ≈ 7.4: 7.4 / 9 = 0.82 > 0.5 → now accepted
    assert LenientRule(2.0).accept_mask(NEW, OLD, u)[1].tolist() == [True] * 3
    assert not LenientRule(-math.inf).accept_mask(NEW, OLD, u).any()
    assert LenientRule(math.inf).accept_mask(NEW - 50, OLD, u).all()


def test_exact_rule_accepts_with_the_current_probability():
    u = torch.tensor([[0.49, 0.51, 0.2], [0.89, 0.11, 0.95]])
    assert ExactRule().accept_mask(NEW, OLD, u).tolist() == [
        [True, False, True],
        [True, False, False],
    ]


ABC = Prompt((1, 2), Example("abc", "", "test"))
DEF = Prompt((3,), Example("def", "", "test"))


def rollout(prompt, slot, tokens, logprobs, finish, version):
    return Rollout(prompt, slot, tokens, logprobs, finish, version)


def filled_store():
    store = RolloutStore()
    store.put(rollout(ABC, 0, [1, 2, 3], [-0.1, -0.2, -0.3], "stop", 4))
    store.put(rollout(ABC, 1, [5], [-1.0], "length", 4))
    store.put(rollout(DEF, 0, [7, 8], [-0.5, -0.5], "stop", 2))
    store.put(rollout(DEF, 0, [], [], "stop", 3))  # replaces the entry of the same (prompt, slot)
    return store


def test_store_is_compact_and_round_trips():
    store = filled_store()
    assert store.num_tokens == 4
    assert store.nbytes / store.num_tokens == 8  # int32 token + float32 logprob, no padding
    restored = RolloutStore()
    restored.load_state_dict(store.state_dict())
    assert len(restored) == 3
    assert (restored.num_tokens, restored.nbytes) == (store.num_tokens, store.nbytes)
    entry = restored.get(ABC.prompt_id, 0)
    assert entry.token_ids.tolist() == [1, 2, 3]
    assert entry.finish_reason == "stop" and entry.policy_version == 4
    np.testing.assert_allclose(entry.current_logprobs, [-0.1, -0.2, -0.3], rtol=1e-6)
    assert restored.get(ABC.prompt_id, 1).token_ids.tolist() == [5]
    assert restored.get(DEF.prompt_id, 0).token_ids.tolist() == []
    assert restored.get("xyz", 0) is None


def test_store_exports_and_imports_one_prompts_entries():
    store = filled_store()
    other = RolloutStore()
    other.put(rollout(ABC, 0, [9], [-2.0], "length", 1))  # replaced by the import
    other.import_(store.export([ABC.prompt_id]))
    assert len(other) == 2 and other.get(DEF.prompt_id, 0) is None
    assert other.get(ABC.prompt_id, 0).token_ids.tolist() == [1, 2, 3]
    assert (other.num_tokens, other.nbytes) == (4, 32)
