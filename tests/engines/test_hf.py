import dataclasses
from unittest import mock

import pytest
import torch
from scipy.stats import chisquare

from specrl.engines import GREEDY, GenRequest, LogprobRequest, SamplingParams
from specrl.engines.hf import HFEngine
from specrl.engines.hf.batching import width_batches
from specrl.engines.sampling import RowSampling, sampling_cdf, sampling_logprobs, seeded_uniform
from tests.conftest import EOS, PAD, make_tiny_model, recorded_passes
from tests.engines.test_drafts import drafting

PROMPTS = [[3, 4, 5], [6, 7], [2, 3, 4, 5, 6, 7], [8]]


def _greedy_without_cache(model, prompt: list[int], steps: int) -> list[int]:
    seq = list(prompt)
    for _ in range(steps):
        logits = model(input_ids=torch.tensor([seq])).logits[0, -1]
        seq.append(int(logits.argmax()))
        if seq[-1] == EOS:
            break
    return seq[len(prompt) :]


def test_greedy_equals_stepwise_argmax_of_full_forward(engine, tiny_model):
    results = engine.generate([GenRequest(p, 12, GREEDY) for p in PROMPTS])
    with torch.no_grad():
        for prompt, result in zip(PROMPTS, results, strict=True):
            assert result.token_ids == _greedy_without_cache(tiny_model, prompt, 12)
            assert result.finish_reason == ("stop" if result.token_ids[-1] == EOS else "length")


@pytest.mark.parametrize(
    "sampling",
    [SamplingParams(1.0), SamplingParams(0.7, top_p=0.8), SamplingParams(1.3, top_k=4)],
    ids=["plain", "top_p", "top_k"],
)
def test_generate_logprobs_equal_score(engine, sampling):
    requests = [GenRequest(p, 10, sampling, seed=i) for i, p in enumerate(PROMPTS)]
    results = engine.generate(requests)
    scores = engine.logprobs(
        [LogprobRequest(p, r.token_ids, sampling) for p, r in zip(PROMPTS, results, strict=True)]
    )
    for result, scored in zip(results, scores, strict=True):
        assert len(result.logprobs) == len(scored) > 0
        assert torch.allclose(torch.tensor(result.logprobs), scored, atol=1e-4)


def test_forced_prefix_is_context_and_continues_greedy(engine):
    full = engine.generate([GenRequest(PROMPTS[2], 10, GREEDY)])[0].token_ids
    cut = 4
    rest = engine.generate([GenRequest(PROMPTS[2], 10 - cut, GREEDY, prefix_ids=full[:cut])])[0]
    assert rest.token_ids == full[cut:]


def test_sample_does_not_depend_on_batch_composition(engine):
    alone = engine.generate([GenRequest(PROMPTS[0], 10, seed=7)])[0]
    batched = engine.generate([GenRequest(p, 10, seed=7 + i) for i, p in enumerate(PROMPTS)])[0]
    assert alone.token_ids == batched.token_ids


def test_finished_sequences_leave_the_batch(engine, tiny_model):
    batch_sizes = []
    hook = tiny_model.model.register_forward_hook(
        lambda m, args, kwargs, out: batch_sizes.append(kwargs["input_ids"].shape[0]),
        with_kwargs=True,
    )
    engine.eos_token_ids = frozenset()  # budgets alone decide when each sequence ends
    engine.generate(
        [GenRequest([3, 4], 2, seed=1), GenRequest([5, 6], 5, seed=2), GenRequest([7], 0)]
    )
    hook.remove()
    # prefill of both contexts but their last token, two steps for both (feeding that token, then
    # the first sampled one), then only the longer request for its remaining three tokens
    assert batch_sizes == [2, 2, 2, 1, 1, 1]


def test_budget_and_eos_finish_reasons(engine):
    engine.eos_token_ids = frozenset(range(12))  # every token is a stop token
    result = engine.generate([GenRequest([3], 5, seed=0)])[0]
    assert len(result.token_ids) == 1 and result.finish_reason == "stop"
    engine.eos_token_ids = frozenset()
    result = engine.generate([GenRequest([3], 5, seed=0)])[0]
    assert len(result.token_ids) == 5 and result.finish_reason == "length"


@pytest.mark.parametrize(
    "sampling",
    [
        SamplingParams(1.0),
        SamplingParams(0.6),
        SamplingParams(1.0, top_p=0.7),
        SamplingParams(1.0, top_k=3),
    ],
    ids=["t1", "t0.6", "top_p0.7", "top_k3"],
)
def test_sampled_frequencies_match_the_sampling_distribution(sampling):
    """20k first tokens from 20k seeds against softmax(logits / T) truncated and renormalised."""
    model = make_tiny_model(seed=3, vocab_size=8, init=0.15)
    engine = HFEngine(model, eos_token_ids=[EOS], pad_token_id=PAD, max_batch_size=20_000)
    prompt = [2, 5, 3]
    n = 20_000
    results = engine.generate([GenRequest(prompt, 1, sampling, seed=s) for s in range(n)])
    counts = torch.bincount(torch.tensor([r.token_ids[0] for r in results]), minlength=8).double()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt])).logits[0, -1]
    probs = sampling_logprobs(logits[None], RowSampling.of([sampling], "cpu"))[0].double().exp()
    support = probs > 0
    assert counts[~support].sum() == 0, "sampled a token outside the top-k / top-p support"
    expected = probs[support] / probs[support].sum() * n
    assert expected.min() > 5  # chi-square validity
    # a correct sampler fails this with probability 1e-4
    assert chisquare(counts[support].numpy(), expected.numpy()).pvalue > 1e-4


def test_seeded_uniform_is_uniform_and_decorrelated():
    seeds = torch.arange(50_000)
    u = seeded_uniform(seeds, torch.full_like(seeds, 3))
    assert u.min() > 0 and u.max() < 1
    counts = torch.histc(u.float(), bins=20, min=0, max=1)
    assert chisquare(counts.numpy()).pvalue > 1e-4
    v = seeded_uniform(seeds, torch.full_like(seeds, 4))
    assert abs(torch.corrcoef(torch.stack([u, v]))[0, 1]) < 0.03


def test_each_row_is_tempered_by_its_own_temperature():
    """Rows at temperatures 1, 0.5 and 0 (greedy) in one batch: softmax(logits / T) per row, a
    point mass for the greedy one; a batch of temperature-1 rows is log_softmax(logits) bit for
    bit (nothing divided)."""
    logits = torch.randn(3, 16, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(1.0), SamplingParams(0.5), SamplingParams(0.0)]
    mixed = sampling_logprobs(logits, RowSampling.of(params, "cpu"))
    torch.testing.assert_close(mixed[0], logits[0].log_softmax(-1))
    torch.testing.assert_close(mixed[1], (logits[1] / 0.5).log_softmax(-1))
    assert mixed[2].exp().tolist() == torch.nn.functional.one_hot(logits[2].argmax(), 16).tolist()
    plain = sampling_logprobs(logits, RowSampling.of([SamplingParams(1.0)] * 3, "cpu"))
    assert torch.equal(plain, logits.log_softmax(-1))


def test_top_p_keeps_the_smallest_set_reaching_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    probs = sampling_logprobs(
        logits, RowSampling.of([SamplingParams(1.0, top_p=0.75)], "cpu")
    ).exp()
    # 0.5 alone < 0.75, 0.5 + 0.3 ≥ 0.75: keep two tokens, renormalised
    torch.testing.assert_close(probs, torch.tensor([[0.625, 0.375, 0.0, 0.0]]))
    probs = sampling_logprobs(logits, RowSampling.of([SamplingParams(1.0, top_k=3)], "cpu")).exp()
    torch.testing.assert_close(probs, torch.tensor([[0.5, 0.3, 0.15, 0.0]]) / 0.95)


@pytest.mark.parametrize("ties", [False, True], ids=["distinct", "tied"])
def test_top_k_ranks_only_the_kept_tokens_and_masks_as_a_sort_does(ties):
    """With a top-k in every row the CPU ranks k + 1 logits, not the vocabulary, and keeps the
    same tokens as sorting it: top-k alone, with top-p, rows of different k; logits in whole
    numbers tie at the cut, where the vocabulary is sorted as before."""
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 2048, generator=generator) * 3
    if ties:
        logits = logits.round()
    params = [
        SamplingParams(1.0, top_k=k, top_p=p)
        for k, p in [(50, 1.0), (50, 0.9), (5, 0.5), (1, 1.0), (300, 0.95), (1500, 1.0)]
    ]
    rows = [params[i % len(params)] for i in range(64)]
    ranked = RowSampling.of(rows, "cpu")
    assert ranked.most_kept == 1500
    sorted_ = dataclasses.replace(ranked, most_kept=0)  # the vocabulary sorted
    sorts = []
    sort = torch.Tensor.sort

    def counted_sort(tensor, *args, **kwargs):
        sorts.append(tensor.shape)
        return sort(tensor, *args, **kwargs)

    with mock.patch.object(torch.Tensor, "sort", counted_sort):
        got = sampling_logprobs(logits, ranked)
    assert bool(sorts) == ties  # distinct logits: no sort
    want = sampling_logprobs(logits, sorted_)
    assert torch.equal(got, want)
    assert ((got > float("-inf")).sum(-1) <= ranked.top_k).all()


def test_the_sampling_cdf_is_computed_in_a_copy():
    """The CDF is built in place in one float64 copy: a float64 input is left as it was."""
    logprobs = torch.randn(4, 50, generator=torch.Generator().manual_seed(0)).log_softmax(-1)
    for given in (logprobs, logprobs.double()):
        before = given.clone()
        cdf = sampling_cdf(given)
        assert torch.equal(given, before)
        assert torch.equal(cdf, logprobs.double().exp().cumsum(-1))


def test_from_pretrained_loads_a_local_model_directory(tiny_model, tmp_path):
    tiny_model.generation_config.eos_token_id = EOS
    tiny_model.generation_config.pad_token_id = PAD
    tiny_model.save_pretrained(tmp_path)
    loaded = HFEngine.from_pretrained(tmp_path)
    assert loaded.eos_token_ids == {EOS} and loaded.pad_token_id == PAD
    direct = HFEngine(tiny_model, [EOS], PAD)
    request = [GenRequest(PROMPTS[1], 8, seed=4)]
    assert loaded.generate(request)[0].token_ids == direct.generate(request)[0].token_ids


def test_identical_score_requests_are_computed_once(engine, tiny_model):
    rows = []
    hook = tiny_model.model.register_forward_hook(
        lambda m, args, kwargs, out: rows.append(kwargs["input_ids"].shape[0]), with_kwargs=True
    )
    a, b = LogprobRequest([3, 4], [5, 6, 7]), LogprobRequest([3, 4, 5], [6, 7])
    scored = engine.logprobs([a, b, a, a, b])
    hook.remove()
    assert rows == [2]
    assert torch.equal(scored[0], scored[2]) and torch.equal(scored[1], scored[4])
    # the same tokens split differently: the shared targets get the same logprobs
    assert torch.allclose(scored[0][1:], scored[1], atol=1e-5)


def test_a_prompts_slots_share_one_prefill(engine, tiny_model):
    """n slots of a prompt (GRPO's group) prefill its context once; each slot decodes as it
    would alone."""
    prefill_rows = []
    hook = tiny_model.model.register_forward_hook(
        lambda m, args, kwargs, out: prefill_rows.append(kwargs["input_ids"].shape),
        with_kwargs=True,
    )
    requests = [
        GenRequest(p, 8, SamplingParams(1.0), seed=s) for p in PROMPTS[:2] for s in range(4)
    ]
    before = engine.counts.prefill_positions
    together = engine.generate(requests)
    hook.remove()
    assert prefill_rows[0][0] == 2  # one row per distinct context
    assert engine.counts.prefill_positions - before == len(PROMPTS[0]) - 1 + len(PROMPTS[1]) - 1
    for request, result in zip(requests, together, strict=True):
        [alone] = engine.generate([request])
        assert result.token_ids == alone.token_ids
        assert torch.allclose(
            torch.tensor(result.logprobs), torch.tensor(alone.logprobs), atol=1e-5
        )


@pytest.mark.parametrize("drafted", [False, True], ids=["plain", "drafts"])
def test_a_decode_call_writes_its_cache_where_the_prefill_put_it(tiny_model, drafted):
    """The cache a decode call starts from has room for every column it writes, its accepted
    drafts' included: it is never copied into a larger one, however long the responses.
    Rejected drafts' columns may still outgrow it."""
    engine = HFEngine(tiny_model, eos_token_ids=[], pad_token_id=PAD)  # every slot runs to 48
    requests = [GenRequest(p, 48, SamplingParams(1.0), seed=i) for i, p in enumerate(PROMPTS)]
    references = [r.token_ids for r in engine.generate(requests)]
    with mock.patch("specrl.engines.hf.kv_cache._grown", side_effect=AssertionError("grown")):
        if drafted:
            results = engine.generate_with_drafts(requests, drafting(references))
        else:
            results = engine.generate(requests)
    assert [r.token_ids for r in results] == references
    assert all(len(r) == 48 for r in references)


@pytest.mark.parametrize("drafted", [False, True], ids=["plain", "drafts"])
def test_sequences_of_one_context_share_a_decode_row_until_they_part(drafted):
    """A peaked policy's slots of one prompt draw the same tokens for a while: they are fed as
    one row, copied where they draw different tokens (or accept different drafts); each
    sequence comes out as it would alone."""
    engine = HFEngine(make_tiny_model(seed=0, init=2.0), [EOS], PAD)
    requests = [
        GenRequest(p, 16, SamplingParams(1.0), seed=s) for p in PROMPTS[:3] for s in range(8)
    ]
    if drafted:  # the same policy's samples under other seeds: some drafts agree, some do not
        other = engine.generate([dataclasses.replace(r, seed=r.seed + 50) for r in requests])
        together = engine.generate_with_drafts(requests, drafting([r.token_ids for r in other]))
        assert 0 < sum(r.accepted_tokens for r in together) < sum(r.draft_tokens for r in together)
    else:
        before = engine.counts.decode_rows
        together = engine.generate(requests)
        rows = engine.counts.decode_rows - before
        tokens = sum(len(r.token_ids) for r in together)
        assert rows < tokens / 2  # measured: 153 rows for 384 tokens
    responses = {
        (tuple(r.prompt_ids), tuple(t.token_ids)) for r, t in zip(requests, together, strict=True)
    }
    assert 3 < len(responses) < len(requests)  # parted, and not all of them
    for request, result in zip(requests, together, strict=True):
        [alone] = engine.generate([request])
        assert result.token_ids == alone.token_ids
        assert torch.allclose(
            torch.tensor(result.logprobs), torch.tensor(alone.logprobs), atol=1e-4
        )
        assert torch.allclose(
            torch.tensor(result.intervals), torch.tensor(alone.intervals), atol=1e-4
        )


def test_sequences_of_similar_widths_share_a_forward():
    widths = [10, 100, 9, 90, 8, 95, 30]
    keys = [(i,) for i in range(len(widths))]
    # widest first; 30 padded to 100: 400 positions for 315 real ones, over 1.25 x
    assert width_batches(widths, keys, 512, 0.25) == [[1, 5, 3], [6], [0, 2, 4]]
    assert width_batches(widths, keys, 2, 0.25) == [[1, 5], [3], [6], [0, 2], [4]]
    assert width_batches(widths, keys, 512, 0.25, 200) == [[1, 5], [3], [6], [0, 2, 4]]
    assert width_batches(widths, keys, 512, 10.0) == [[1, 5, 3, 6, 0, 2, 4]]
    # equal widths are ordered by their keys: the same batches whatever order they come in
    same = [(3, 1), (1, 2), (2, 2), (9, 9, 9, 9)]
    batches = width_batches([len(k) for k in same], same, 2, 0.25)
    assert batches == [[3], [1, 2], [0]]
    shuffled = [same[i] for i in (2, 0, 3, 1)]
    regrouped = width_batches([len(k) for k in shuffled], shuffled, 2, 0.25)
    assert [[shuffled[i] for i in b] for b in regrouped] == [[same[i] for i in b] for b in batches]


@pytest.mark.parametrize("chunks", [1, 2])
def test_decoding_after_scoring_reuses_the_prefixes_it_is_handed(tiny_model, chunks):
    """Continuing prompt + draft[:k] after scoring prompt + draft into a `prefixes` handle takes
    the prefix's KV from the verification pass: no prefill pass, same tokens and logprobs as a cold
    engine. Scored in two calls (chunked verification), both calls' sequences are kept."""
    drafts = [[5, 6, 7, 8, 9], [2, 2, 3], [4, 4, 4, 4]]
    cuts = [2, 0, 4]
    requests = [
        GenRequest(PROMPTS[i], 6, seed=i, prefix_ids=d[:k])
        for i, (d, k) in enumerate(zip(drafts, cuts, strict=True))
    ]
    requests += [GenRequest(PROMPTS[3], 6, seed=9), GenRequest([11, 3, 3], 6, seed=8)]  # misses
    cold = HFEngine(tiny_model, [EOS], PAD).generate(requests)

    warm = HFEngine(tiny_model, [EOS], PAD)
    prefixes = warm.new_prefixes()
    scored = [LogprobRequest(PROMPTS[i], d) for i, d in enumerate(drafts)]
    for part in (scored[:1], scored[1:]) if chunks == 2 else (scored,):
        warm.logprobs(part, prefixes)
    passes, hook = recorded_passes(tiny_model)
    hot = warm.generate(requests, prefixes)
    hook.remove()
    assert passes[0] == (1, 2)  # only the context of [11, 3, 3] needed a prefill ([8] has no head)
    for a, b in zip(cold, hot, strict=True):
        assert a.token_ids == b.token_ids
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5)


def test_first_token_after_a_cut_is_sampled_from_the_scoring_pass(tiny_model):
    """The distribution at the cut was computed by scoring: a continuation's first token needs no
    forward, and it is the token a cold engine samples there (with the same uniform, from the
    residual when a draft token was rejected); so is the token after a whole scored sequence."""
    sampling = SamplingParams(1.0)
    draft = [5, 6, 7, 8, 9]
    requests = [
        GenRequest(PROMPTS[0], 1, sampling, seed=s, prefix_ids=draft[:k])
        for s, k in [(1, 0), (2, 3), (3, 5)]
    ]
    requests += [
        GenRequest(
            PROMPTS[0], 1, sampling, seed=s, prefix_ids=draft[:2], excluded_tokens=(draft[2],)
        )
        for s in range(4, 40)
    ]
    cold = HFEngine(tiny_model, [EOS], PAD).generate(requests)

    warm = HFEngine(tiny_model, [EOS], PAD)
    prefixes = warm.new_prefixes()
    warm.logprobs([LogprobRequest(PROMPTS[0], draft, sampling)], prefixes)
    passes, hook = recorded_passes(tiny_model)
    hot = warm.generate(requests, prefixes)
    hook.remove()
    assert passes == []
    for a, b in zip(cold, hot, strict=True):
        assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
    assert all(r.token_ids != [draft[2]] for r in hot[3:])
    assert len({r.token_ids[0] for r in hot[3:]}) > 1


def test_load_weights_copies_new_weights_including_tied_ones():
    model = make_tiny_model(seed=0)
    model.config.tie_word_embeddings = True
    model.tie_weights()
    engine = HFEngine(model, [EOS], PAD)
    other = make_tiny_model(seed=1)
    other.config.tie_word_embeddings = True
    other.tie_weights()
    request = [GenRequest(PROMPTS[0], 8, GREEDY)]
    assert (
        engine.generate(request)[0].token_ids
        != HFEngine(other, [EOS], PAD).generate(request)[0].token_ids
    )
    engine.load_weights(other.state_dict())
    assert (
        engine.generate(request)[0].token_ids
        == HFEngine(other, [EOS], PAD).generate(request)[0].token_ids
    )


def test_nothing_is_reused_without_a_prefixes_handle(engine, tiny_model):
    """Scoring keeps nothing behind the caller's back: without the handle, generate prefills."""
    engine.logprobs([LogprobRequest(PROMPTS[0], [5, 6])])
    passes, hook = recorded_passes(tiny_model)
    engine.generate([GenRequest(PROMPTS[0], 1, prefix_ids=[5])])
    hook.remove()
    assert passes[0] == (1, len(PROMPTS[0]))  # the prompt + [5] minus the token fed first
