"""specrl's vLLM proposer at the unit level (no vLLM needed): the calls vLLM's model runner makes
after each engine step, recorded as (request ids of the input batch's rows, tokens each row just
produced, row lengths, row token ids), answered from token trees through a `DraftSession`."""

from types import SimpleNamespace

import numpy as np

from specrl.engines import GenResult
from specrl.engines.vllm.proposer import DraftSession, Proposer
from specrl.speculative.draft_width import DraftWidth
from specrl.speculative.drafting import Drafting, StoredDrafts, TreeDrafts
from specrl.speculative.token_trees import TokenTree

WIDTH = 16  # columns of the recorded token_ids_cpu array


def batch(rows):
    """vLLM's per-row arrays from {request id: whole sequence so far} in row order."""
    ids = list(rows)
    token_ids = np.zeros((len(ids) + 2, WIDTH), dtype=np.int64)  # vLLM's array has spare rows
    lengths = np.zeros(len(ids) + 2, dtype=np.int32)
    for row, seq in enumerate(rows.values()):
        token_ids[row, : len(seq)] = seq
        lengths[row] = len(seq)
    return ids, lengths, token_ids


def tree_session(k=3, online=False, budgets=(10, 10)):
    """Two requests: prompt a = (3, 4) and prompt b = (7,) with forced prefix (5,); a's tree
    holds 5 6 7 8 1, b's holds 5 9 9 1."""
    tree = TokenTree()
    for pid, response in (("a", [5, 6, 7, 8, 1]), ("b", [5, 9, 9, 1])):
        tree.begin(pid)
        tree.insert(pid, response)
    drafts = TreeDrafts(tree, ["a", "b"], [[], [5]], online)
    session = DraftSession(
        Drafting(drafts, DraftWidth(k, adaptive=False)),
        max_tokens=8,
        requests=[(0, 2, budgets[0]), (1, 2, budgets[1])],  # (index, start, budget)
    )
    session.counts.add("a-x1", 0)
    session.counts.add("b-x2", 1)
    return session, tree


def test_rows_are_mapped_by_request_id_and_proposed_from_their_trees():
    session, _ = tree_session()
    # after the prefill: a sampled 5, b (context 7 5) sampled 9
    ids, lengths, token_ids = batch({"a-x1": [3, 4, 5], "b-x2": [7, 5, 9]})
    drafts = session.propose(ids, [[5], [9]], lengths, token_ids)
    assert drafts == [[6, 7, 8], [9, 1]]  # K = 3; b's new tokens after its prefix: 9 → 9 1
    # a finished; vLLM moved b to row 0, and a new request (not this session's) is in its
    # prefill in row 1: nothing sampled for it, nothing proposed
    ids, lengths, token_ids = batch({"b-x2": [7, 5, 9, 9, 1], "other": [2, 2]})
    assert session.propose(ids, [[9, 1], []], lengths, token_ids) == [[], []]
    assert session.counts.draft_tokens == [0, 2] and session.counts.accepted_tokens == [0, 1]


def test_acceptance_is_read_from_what_the_next_step_sampled():
    session, _ = tree_session()
    ids, lengths, token_ids = batch({"a-x1": [3, 4, 5], "b-x2": [7, 5, 9]})
    session.propose(ids, [[5], [9]], lengths, token_ids)
    # a accepted 6 7 of 6 7 8 and drew 2; b rejected its first draft token
    ids, lengths, token_ids = batch({"a-x1": [3, 4, 5, 6, 7, 2], "b-x2": [7, 5, 9, 3]})
    session.propose(ids, [[6, 7, 2], [3]], lengths, token_ids)
    assert session.counts.draft_tokens == [3, 2] and session.counts.accepted_tokens == [2, 0]
    width = session.drafter.width
    assert width.accept_rate == (2 + 1) / (2 + 1 + 1 + 2)  # 2 successes in 4 trials, prior 1/2
    result = GenResult([], [], "length")
    session.counts.count(0, result)
    # the prefill's step and one decode step
    assert (result.forwards, result.draft_tokens, result.accepted_tokens) == (2, 3, 2)


def test_drafts_respect_the_budget_and_the_engine_limit():
    session, _ = tree_session(k=8, budgets=(3, 10))
    ids, lengths, token_ids = batch({"a-x1": [3, 4, 5], "b-x2": [7, 5, 9]})
    # a may decode 3 new tokens: 1 so far, 1 draft, 1 for the token after it
    assert session.propose(ids, [[5], [9]], lengths, token_ids)[0] == [6]
    capped = DraftSession(session.drafter, max_tokens=1, requests=session.targets)
    capped.counts.add("a-x1", 0)
    capped.counts.add("b-x2", 1)
    assert capped.propose(ids, [[5], [9]], lengths, token_ids) == [[6], [9]]


def test_a_finished_request_joins_an_online_tree():
    session, tree = tree_session(online=True)
    session.finished(1, [7, 5, 9, 4, 1])  # context 7 5 (prompt + prefix), then 9 4 1
    assert (5, 9, 4, 1) in [t for _, t in tree.get("b").responses]


def test_stored_drafts_lead_then_trees_propose():
    tree = TokenTree()
    tree.begin("a")
    tree.insert("a", [5, 6, 7, 8, 1])
    draft = np.array([5, 2, 2, 1])
    trees = TreeDrafts(tree, ["a"] * 3, [[], [], []], online=False)
    stored = StoredDrafts([draft, draft, None], trees)
    assert stored.propose(0, [5], 2) == [2, 2]  # its own draft first
    assert stored.propose(0, [5, 2, 2], 4) == [1]  # to the draft's end
    assert stored.propose(1, [5, 6], 3) == [7, 8, 1]  # left the draft: the tree from here
    assert stored.propose(1, [5, 6, 7, 8, 2], 3) == []  # never back on it
    assert stored.propose(2, [5], 2) == [6, 7]  # no stored draft: the tree


def test_without_a_session_vllm_decodes_plainly():
    vllm_config = SimpleNamespace(speculative_config=SimpleNamespace(num_speculative_tokens=4))
    proposer = Proposer(vllm_config)
    _, lengths, token_ids = batch({"a-x1": [3, 4, 5]})
    assert proposer.propose([[5]], lengths, token_ids) == [[]]
