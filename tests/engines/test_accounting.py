"""The transformers engine counts what it computes (`perf/*`): forwards, rows, positions, KV
reads and query-key pairs, equal to hand-computed counts for known lengths, drafts and tries."""

from specrl.engines import GREEDY, GenRequest, LogprobRequest, TrieRequest
from specrl.engines.accounting import ForwardCounts
from specrl.engines.hf import HFEngine
from tests.conftest import EOS, PAD, make_tiny_model
from tests.engines.test_drafts import drafting


def engine() -> HFEngine:
    return HFEngine(make_tiny_model(seed=0), [EOS], PAD)


def test_decoding_counts_one_position_per_row_and_forward():
    hf = engine()
    results = hf.generate([GenRequest([3, 4, 5], 6, GREEDY), GenRequest([6, 7], 4, GREEDY)])
    n = [len(r.token_ids) for r in results]
    assert n[0] > 0 and n[1] > 0
    c = hf.counts
    # the contexts but their last token: 2 + 1 positions in one forward, causal pairs 3 + 1
    assert (c.prefill_forwards, c.prefill_rows, c.prefill_positions) == (1, 2, 3)
    assert (c.prefill_kv_reads, c.prefill_attended) == (3, 4)
    # computed with padding: both heads padded to 2 columns
    assert (c.prefill_computed_positions, c.prefill_computed_kv_reads) == (4, 4)
    # then row i is in n_i forwards, reading its context of L_i + j tokens at step j
    reads = sum(length + j for length, k in zip((3, 2), n, strict=True) for j in range(k))
    assert (c.decode_forwards, c.decode_rows, c.decode_positions) == (max(n), sum(n), sum(n))
    assert (c.decode_kv_reads, c.decode_attended, c.decode_draft_positions) == (reads, reads, 0)
    assert c.verify_forwards == 0
    assert c.decode_computed_positions == sum(n) and c.decode_computed_kv_reads >= reads
    # each forward timed under its kind
    assert c.prefill_seconds > 0 and c.decode_seconds > 0 and c.verify_seconds == 0
    assert c.seconds == c.prefill_seconds + c.decode_seconds


def test_engines_side_by_side_add_work_and_take_the_longer_forwards_and_seconds():
    a, b = ForwardCounts(), ForwardCounts()
    a.record("decode", 8, 8, 80, 80, forwards=4)
    a.add_seconds("decode", 0.5)
    b.record("decode", 6, 6, 50, 50, forwards=6)
    b.add_seconds("decode", 0.25)
    both = a.side_by_side(b)
    assert (both.decode_rows, both.decode_kv_reads) == (14, 130)
    assert (both.decode_forwards, both.decode_seconds) == (6, 0.5)
    assert ForwardCounts.from_metrics(both.metrics()) == both


def test_drafts_are_positions_of_the_decode_forwards_that_verify_them():
    hf = engine()
    request = GenRequest([3, 4, 5], 12, GREEDY)
    own = hf.generate([request])[0].token_ids
    assert len(own) == 12  # no end of sequence: every forward below is known
    hf.counts = ForwardCounts()
    drafted = hf.generate_with_drafts([request], drafting([own], k=4))[0]
    assert drafted.token_ids == own and drafted.accepted_tokens == drafted.draft_tokens
    c = hf.counts
    # K = 4 while 5 tokens fit: forwards feed 1+4, 1+4, then 1+1 (two tokens left)
    assert (c.decode_forwards, c.decode_rows) == (3, 3)
    assert (c.decode_positions, c.decode_draft_positions) == (12, 9)
    # pasts 2, 7, 12: KV read 7 + 12 + 14; pairs (10 + 15) + (35 + 15) + (24 + 3)
    assert (c.decode_kv_reads, c.decode_attended) == (33, 102)


def test_scoring_and_tries_count_every_position_they_compute():
    hf = engine()
    hf.logprobs([LogprobRequest([3, 4], [5, 6, 7]), LogprobRequest([8], [9, 10, 11])] * 2)
    c = hf.counts  # identical requests computed once, sequences of similar lengths in one forward
    assert (c.verify_forwards, c.verify_rows, c.verify_positions) == (1, 2, 9)
    assert (c.verify_kv_reads, c.verify_attended) == (9, 15 + 10)
    assert c.verify_computed_positions == c.verify_computed_kv_reads == 10  # 4 tokens padded to 5
    assert c.as_computed().verify_positions == 10 and c.as_computed().decode_positions == 0
    hf.counts = ForwardCounts()
    hf.logprobs([LogprobRequest([3, 4], [5, 6, 7]), LogprobRequest([8], [9])])
    c = hf.counts  # 5 and 2 tokens: padded into one forward, 3 of its 10 positions would be padding
    assert (c.verify_forwards, c.verify_rows, c.verify_positions) == (2, 2, 7)
    hf.counts = ForwardCounts()
    # a prompt of 3 and a trie of 3 nodes: 1 under the root, 2 and 3 under node 1
    hf.verify_tries([TrieRequest([3, 4, 5], [0, 1, 1], [6, 7, 8])])
    c = hf.counts
    assert (c.verify_forwards, c.verify_rows, c.verify_positions, c.verify_kv_reads) == (1, 1, 6, 6)
    assert c.verify_seconds > 0 and c.prefill_seconds == c.decode_seconds == 0
    assert c.verify_attended == 6 + (3 + 1) + 2 * (
        3 + 2
    )  # the prompt causal, each node: prompt + path
