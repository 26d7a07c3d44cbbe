"""The embedded default end to end: build the tiny policy from scratch, then the whole default
run with the CLI, in-process and on two Ray rollout workers; the multi-turn calculator task
likewise. Slow (about 8 minutes on 2 cores each); CI runs them."""

import json
import os
import subprocess
import sys

import pytest

from specrl.toy_policy import ToyPolicySpec, ensure_toy_policy


@pytest.fixture(scope="module")
def fresh_cache(tmp_path_factory):
    """A cache into which the built-in policy is built from scratch, once for this module."""
    cache = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SPECRL_CACHE", str(cache))
        path = ensure_toy_policy(log=lambda _: None)
    return cache, path


def train_curve(run, cache, *overrides) -> dict[int, float]:
    """`specrl train` with the default config and `overrides` → held-out accuracy by step."""
    command = [sys.executable, "-m", "specrl", "train", f"trainer.output_dir={run}", *overrides]
    subprocess.run(command, check=True, env={**os.environ, "SPECRL_CACHE": str(cache)})
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {
        m["training/global_step"]: m["val/acc/mean@1"] for m in metrics if "val/acc/mean@1" in m
    }


def assert_keeps_learning(curve: dict[int, float]) -> None:
    last = max(curve)
    assert curve[last] - curve[0] >= 0.20, curve  # RL learns the task
    assert curve[last] - curve[last // 2] >= 0.05, curve  # and is still learning in its second half


@pytest.mark.slow
def test_toy_policy_build_and_vanilla_grpo_keeps_learning_through_the_default_run(
    tmp_path, fresh_cache, monkeypatch
):
    cache, path = fresh_cache
    monkeypatch.setenv("SPECRL_CACHE", str(cache))
    report = json.loads((path / "build.json").read_text())
    # the warm start leaves RL room: imperfect but not hopeless, long responses, varied samples
    assert 0.05 <= report["val_acc"] <= 0.40
    assert report["mean_response_length"] >= 40
    assert report["distinct_samples_of_16"] >= 4
    assert ensure_toy_policy(log=pytest.fail) == path  # cached: no second build
    for file in path.iterdir():  # readable by every user of a shared cache
        assert file.stat().st_mode & 0o777 == 0o644, file
    curve = train_curve(
        tmp_path / "run", cache, "rollout.spec.enabled=false", "rollout.spec.tree.enabled=false"
    )
    assert_keeps_learning(curve)


@pytest.mark.slow
@pytest.mark.ray
def test_the_default_run_on_two_rollout_workers_and_two_learner_ranks(tmp_path, fresh_cache):
    pytest.importorskip("ray", reason="ray is not installed (pip install 'specrl[ray]')")
    cache, _ = fresh_cache
    run = tmp_path / "run"
    curve = train_curve(
        run,
        cache,
        "rollout.num_workers=2",
        "actor.num_workers=2",
        "ray_kwargs.ray_init.num_cpus=4",
    )  # the default otherwise: speculative, exact
    last = max(curve)
    assert curve[last] - curve[0] >= 0.20, curve  # learns as the quickstart does
    assert curve[last] > curve[last // 2], curve  # and still rises in its second half
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in metrics if "rollout/num_workers" in m]
    assert len(steps) == 128 and all(m["rollout/num_workers"] == 2 for m in steps)
    assert sum(m["spec/reused_tokens"] for m in steps) > 0


@pytest.mark.slow
def test_the_default_run_with_a_critic(tmp_path, fresh_cache):
    """PPO with GAE (a value model from the policy's warm start with a fresh head), otherwise
    the default run: held-out accuracy rises as with GRPO."""
    cache, _ = fresh_cache
    run = tmp_path / "run"
    curve = train_curve(run, cache, "algorithm.adv_estimator=gae")
    assert curve[max(curve)] - curve[0] >= 0.20, curve
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert all("critic/vf_loss" in m for m in metrics if m["training/global_step"] > 0)


@pytest.mark.slow
def test_the_multi_turn_calculator_task_keeps_learning(tmp_path, fresh_cache, monkeypatch):
    """data.task=calculator: its own warm start, then the default run on episodes (speculative,
    exact rule): held-out success rises by 20 points; training episodes call the calculator."""
    cache, _ = fresh_cache
    monkeypatch.setenv("SPECRL_CACHE", str(cache))
    path = ensure_toy_policy(ToyPolicySpec(task="calculator"), log=lambda _: None)
    report = json.loads((path / "build.json").read_text())
    assert 0.05 <= report["val_acc"] <= 0.50 and report["mean_turns"] >= 1.0
    run = tmp_path / "run"
    curve = train_curve(run, cache, "data.task=calculator")
    assert curve[max(curve)] - curve[0] >= 0.20, curve
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in metrics if m["training/global_step"] > 0 and "num_turns/mean" in m]
    assert len(steps) == 128 and sum(m["num_turns/mean"] for m in steps) / 128 > 1.2
    assert sum(m["spec/turn_1/reused_tokens"] for m in steps[64:]) > 0  # drafts after turn 0
