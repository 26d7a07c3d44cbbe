"""Rollout workers on a local Ray (marker `ray`; skipped where ray is not installed): the same
rollouts as in-process, faults that lose nothing, resume with any number of workers."""

from __future__ import annotations

import logging

import pytest
import torch

pytest.importorskip("ray", reason="ray is not installed (pip install 'specrl[ray]')")

from specrl.data import load_prompts
from specrl.distributed.ray_cluster import RAY_AUTH_LOGGER, start_ray, token_auth_enabled_notice
from specrl.distributed.rollout import RolloutWorkers
from specrl.engines import SamplingParams
from specrl.engines.build import hf_engine
from specrl.models import eos_token_ids, load_policy
from specrl.speculative.stage import SpeculativeStage
from specrl.trainer import Trainer
from tests.conftest import read_metrics, save_tiny_policy, small_config

pytestmark = pytest.mark.ray

RULES = {
    "lenient": ["rollout.spec.acceptance=specrl"],
    "exact": ["rollout.spec.acceptance=exact"],
}
# the adaptive draft width, what the trie budget verifies and how the engine groups verification
# forwards follow timings: fixed / off, so that runs compare bitwise
COMMON = [
    "rollout.spec.tree.enabled=true",
    "rollout.spec.tree.adaptive=false",
    "rollout.spec.verify_budget=false",
    "rollout.verify_batching=slack",
]
ROUNDS, BATCH, N = 4, 6, 4


@pytest.fixture(scope="module")
def ray_cluster():
    import ray

    from specrl.config import RayInitConfig

    start_ray(RayInitConfig(num_cpus=2))
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def peaked_policy_dir(tmp_path_factory):
    """Peaked logits: drafts are partly accepted under both rules."""
    return save_tiny_policy(tmp_path_factory.mktemp("peaked"), initializer_range=0.5)


def _setup(policy_dir, tmp_path, *overrides):
    cfg = small_config(policy_dir, tmp_path, *COMMON, *overrides)
    policy, tokenizer = load_policy(policy_dir, "float32")
    prompts, _ = load_prompts(cfg.data, tokenizer, 1, print)
    sampling = SamplingParams(cfg.rollout.temperature)
    return cfg, policy.eval(), tokenizer, prompts[:BATCH], sampling


def _perturb(policy, round_: int) -> None:
    """New weights between rounds, the same in every arm."""
    generator = torch.Generator().manual_seed(round_)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=generator))


def _in_process(policy_dir, tmp_path, overrides):
    cfg, policy, tokenizer, prompts, sampling = _setup(policy_dir, tmp_path, *overrides)
    threads = torch.get_num_threads()
    torch.set_num_threads(cfg.rollout.num_cpus_per_worker)  # as a worker runs
    try:
        engine = hf_engine(cfg, policy, eos_token_ids(policy, tokenizer), tokenizer.pad_token_id)
        stage = SpeculativeStage(engine, sampling, cfg.data.max_response_length, cfg.rollout.spec)
        rounds = []
        for r in range(1, ROUNDS + 1):
            rounds.append(stage(prompts, N, (1, r, 0), r)[0])
            _perturb(policy, r)
    finally:
        torch.set_num_threads(threads)
    return rounds


def _on_workers(policy_dir, tmp_path, overrides, faults=()):
    """Rounds on rollout workers; `faults`: (round, worker, kind) whose call exits or hangs
    mid-rollout."""
    cfg, policy, tokenizer, prompts, sampling = _setup(policy_dir, tmp_path, *overrides)
    workers = RolloutWorkers(
        cfg, policy_dir, eos_token_ids(policy, tokenizer), tokenizer.pad_token_id, sampling
    )
    rounds, stats = [], []
    try:
        workers.load_weights(policy.state_dict(), 1)
        for r in range(1, ROUNDS + 1):
            for fault_round, w, kind in faults:
                if fault_round == r:
                    workers.handles[w].arm_fault.remote(kind)
            rollouts, round_stats = workers(prompts, N, (1, r, 0), r)
            rounds.append(rollouts)
            stats.append(round_stats)
            _perturb(policy, r)
            workers.load_weights(policy.state_dict(), r + 1)
        live = list(workers.live)
    finally:
        workers.shutdown()
    return rounds, stats, live


def _assert_same(a_rounds, b_rounds, atol: float) -> None:
    for a_round, b_round in zip(a_rounds, b_rounds, strict=True):
        assert len(a_round) == len(b_round) == BATCH * N
        for a, b in zip(a_round, b_round, strict=True):
            assert (a.prompt.prompt_id, a.slot) == (b.prompt.prompt_id, b.slot)
            assert a.token_ids == b.token_ids
            assert a.finish_reason == b.finish_reason
            assert a.current_logprobs == pytest.approx(b.current_logprobs, abs=atol, rel=0)
            if a.behaviour_logprobs is None:
                assert b.behaviour_logprobs is None
            else:
                assert a.behaviour_logprobs == pytest.approx(b.behaviour_logprobs, abs=atol, rel=0)


@pytest.fixture(scope="module")
def two_workers(ray_cluster, peaked_policy_dir, tmp_path_factory):
    """rule → the rounds, stats and live workers of two workers without faults (each run once,
    when first asked for)."""
    runs = {}

    def run(rule: str):
        if rule not in runs:
            out = tmp_path_factory.mktemp(f"two-{rule}")
            runs[rule] = _on_workers(
                peaked_policy_dir, out, [*RULES[rule], "rollout.num_workers=2"]
            )
        return runs[rule]

    return run


@pytest.mark.parametrize("rule", list(RULES))
def test_one_worker_is_in_process_bitwise_and_two_agree(
    two_workers, peaked_policy_dir, tmp_path, rule
):
    local = _in_process(peaked_policy_dir, tmp_path, RULES[rule])
    drafted = [r for r in local[-1] if r.policy_version == ROUNDS]
    assert drafted
    one, _, _ = _on_workers(peaked_policy_dir, tmp_path, [*RULES[rule], "rollout.num_workers=1"])
    _assert_same(local, one, atol=0.0)
    two, stats, _ = two_workers(rule)
    _assert_same(local, two, atol=1e-4)
    later = stats[-1]
    assert later.workers == 2 and later.drafts == BATCH * N
    assert 0 < later.reused_tokens < later.response_tokens  # drafts partly accepted
    assert later.drafted_tokens > 0


def test_a_worker_dying_or_hanging_mid_rollout_loses_nothing(
    two_workers, peaked_policy_dir, tmp_path
):
    overrides = [
        *RULES["exact"],
        "rollout.num_workers=2",
        "rollout.fault_tolerance.step_timeout_s=10",  # a call here takes well under 1 s
    ]
    clean = two_workers("exact")[0]
    faults = [(2, 0, "exit"), (3, 1, "hang")]
    killed, stats, live = _on_workers(peaked_policy_dir, tmp_path, overrides, faults=faults)
    _assert_same(clean, killed, atol=0.0)  # restarted, given their shards, the same calls: bitwise
    assert [s.worker_restarts for s in stats] == [0, 1, 1, 0]
    assert live == [0, 1]


def test_restarts_exhausted_the_run_goes_on_with_fewer_workers(
    two_workers, peaked_policy_dir, tmp_path
):
    overrides = [
        *RULES["exact"],
        "rollout.num_workers=2",
        "rollout.fault_tolerance.max_restarts=0",
    ]
    clean = two_workers("exact")[0]
    killed, stats, live = _on_workers(
        peaked_policy_dir, tmp_path, overrides, faults=[(2, 1, "exit")]
    )
    assert live == [0]
    assert [s.workers for s in stats] == [2, 1, 1, 1]
    # round 2: worker 1's call went to worker 0 with its prompts' drafts and trees
    assert stats[1].worker_restarts == 1 and stats[1].migrated_prompts > 0
    assert [s.migrated_prompts for s in stats[2:]] == [0, 0]
    _assert_same(clean, killed, atol=1e-4)


def test_resume_with_two_one_and_no_workers(ray_cluster, tiny_policy_dir, tmp_path):
    common = ["trainer.total_training_steps=4", "trainer.save_freq=2", "trainer.test_freq=2"]
    full_dir = tmp_path / "full"
    Trainer(small_config(tiny_policy_dir, full_dir, *common, "rollout.num_workers=2")).fit()
    full = [m for m in read_metrics(full_dir) if m["training/global_step"] > 2]
    checkpoint = full_dir / "checkpoints" / "global_step_2"
    assert (checkpoint / "trainer_state.pt").is_file()
    for workers in (2, 1, 0):
        out = tmp_path / f"resumed-{workers}"
        cfg = small_config(
            tiny_policy_dir,
            out,
            *common,
            f"rollout.num_workers={workers}",
            f"trainer.resume_mode={checkpoint}",
        )
        Trainer(cfg).fit()
        resumed = [m for m in read_metrics(out) if m["training/global_step"] > 2]
        assert [m["training/global_step"] for m in resumed] == [3, 4]
        for a, b in zip(full, resumed, strict=True):
            for key in ("critic/score/mean", "response_length/mean", "spec/reused_tokens",
                        "spec/decoded_tokens", "val/acc/mean@1", "actor/pg_loss"):  # fmt: skip
                if key in a:
                    assert b[key] == pytest.approx(a[key], abs=1e-4), (workers, key)


def test_run_ahead_seeds_trees_and_leaves_the_samples_alone(
    ray_cluster, peaked_policy_dir, tmp_path
):
    """Prompts rolled out for the first time have no trees; run-ahead gives them one response
    each beforehand. Tree drafts are verified with the exact rule, so the samples stay."""
    overrides = [*RULES["exact"], "rollout.num_workers=2", "rollout.run_ahead=true"]
    cfg, policy, tokenizer, prompts, sampling = _setup(peaked_policy_dir, tmp_path, *overrides)
    eos = eos_token_ids(policy, tokenizer)
    results = {}
    for ahead in (False, True):
        workers = RolloutWorkers(cfg, peaked_policy_dir, eos, tokenizer.pad_token_id, sampling)
        try:
            workers.load_weights(policy.state_dict(), 1)
            if ahead:
                workers.run_ahead(prompts, (1, 1, "run-ahead"), 1)
            results[ahead] = workers(prompts, N, (1, 1, 0), 1)
            if ahead:
                assert workers.state_dict()["tree"]["prompt_ids"]
        finally:
            workers.shutdown()
    (plain, plain_stats), (seeded, seeded_stats) = results[False], results[True]
    assert plain_stats.drafted_tokens == 0  # nothing to draft from in a first rollout
    assert seeded_stats.drafted_tokens > 0 and seeded_stats.accepted_draft_tokens > 0
    _assert_same([plain], [seeded], atol=1e-4)


def test_rays_token_auth_notice_is_dropped_and_its_warning_kept(ray_cluster):
    """Ray 2.60 turns token authentication on for a new local cluster and says so in every
    run: start_ray drops that notice; the warning that authentication is off still prints."""
    from ray._private.authentication import authentication_token_setup as setup

    logger = logging.getLogger(RAY_AUTH_LOGGER)
    assert setup.logger is logger and token_auth_enabled_notice in logger.filters
    seen = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    logger.addHandler(handler)
    try:
        setup._warn_token_auth_enabled()
        setup._warn_token_auth_disabled()
    finally:
        logger.removeHandler(handler)
    assert len(seen) == 1 and seen[0].startswith("Token authentication is disabled")
