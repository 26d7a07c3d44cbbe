"""The built-in default end to end, in minutes: the shipped policies are their builds, a build
runs and caches (once, however many processes want it), and the default run trains, with a
critic too, and on the calculator's episodes (on two Ray rollout workers and two learner ranks
it trains as in one process: tests/distributed/test_learner_group.py). How far RL gets over whole runs is measured by `specrl bench`
(benchmarks/README.md), not re-proved here."""

import json
import os
import subprocess
import sys
from dataclasses import asdict

import pytest
from filelock import FileLock

from specrl.toy_policy import (
    SHIPPED,
    ToyPolicySpec,
    ensure_toy_policy,
    evaluate_toy_policy,
    weights_digest,
)
from tests.conftest import read_metrics

# a short run that shows learning: 16 training prompts seen six times (from the second epoch
# on, speculative rollouts reuse), a higher learning rate, 100 held-out problems
SHORT = [
    "data.train_size=16",
    "data.train_batch_size=16",
    "actor.ppo_mini_batch_size=16",
    "actor.optim.lr=1e-4",
    "actor.optim.lr_warmup_steps=0",
    "trainer.total_epochs=6",
    "data.val_size=100",
    "trainer.test_freq=6",
    "trainer.save_freq=0",
    "trainer.logger=[jsonl]",
]


def train(run, *overrides) -> list[dict]:
    """`specrl train` as a user runs it → its logged metrics."""
    command = [sys.executable, "-m", "specrl", "train", f"trainer.output_dir={run}", *overrides]
    subprocess.run(command, check=True, capture_output=True)
    return read_metrics(run)


def accuracy(metrics: list[dict]) -> dict[int, float]:
    return {
        m["training/global_step"]: m["val/acc/mean@1"] for m in metrics if "val/acc/mean@1" in m
    }


def assert_learns(metrics: list[dict], gain: float) -> None:
    """The reward on the training prompts rises by `gain` from the first step to the last two;
    held-out accuracy does not fall."""
    score = [m["critic/score/mean"] for m in metrics if m["training/global_step"] > 0]
    assert len(score) == 6 and (score[-1] + score[-2]) / 2 - score[0] >= gain, score
    curve = accuracy(metrics)
    assert curve[6] >= curve[0], curve


@pytest.mark.parametrize("task", ["noisy_facts", "calculator"])
def test_the_shipped_policies_are_their_builds(task):
    spec = ToyPolicySpec(task=task)
    path = ensure_toy_policy(spec, log=pytest.fail)  # shipped: nothing to build
    assert path == SHIPPED / task
    report = json.loads((path / "build.json").read_text())
    assert report["spec"] == asdict(spec)
    assert weights_digest(path) == report["weights_sha256"]
    # the warm start leaves RL room: imperfect but not hopeless, long responses, varied samples
    assert 0.05 <= report["val_acc"] <= (0.50 if task == "calculator" else 0.40)
    assert report["mean_response_length"] >= 40
    assert report["distinct_samples_of_16"] >= 4
    if task == "calculator":
        assert report["mean_turns"] >= 1.0
    from specrl.models import load_policy

    model, tokenizer = load_policy(path, "float32")
    again = evaluate_toy_policy(model.eval(), tokenizer, spec)
    assert abs(again["val_acc"] - report["val_acc"]) <= 0.02  # float order differs by CPU


@pytest.mark.slow
def test_a_build_runs_once_for_concurrent_processes_and_is_cached(tmp_path):
    spec = ToyPolicySpec(hidden_size=32, num_layers=1, num_heads=2, sft_steps=20, sft_batch_size=8)
    build = (
        "import dataclasses, sys; from specrl.toy_policy import ToyPolicySpec, ensure_toy_policy; "
        f"print(ensure_toy_policy(ToyPolicySpec(**{asdict(spec)!r})))"
    )
    env = {**os.environ, "SPECRL_CACHE": str(tmp_path)}
    path = tmp_path / f"toy-policy-{spec.key()}"
    # both processes start while the build's lock is held here, so both wait for it (on a busy
    # machine the second could otherwise start after the first finished, and find it cached)
    held = FileLock(path.with_name(path.name + ".lock"))
    held.acquire()
    processes = [
        subprocess.Popen([sys.executable, "-c", build], env=env, stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    waiting = [p.stdout.readline() for p in processes]
    held.release()
    logs = [line + p.communicate()[0] for line, p in zip(waiting, processes, strict=True)]
    assert all(p.returncode == 0 for p in processes), logs
    assert all(line.startswith("waiting for another process's build") for line in waiting), logs
    assert sum("building the tiny policy" in log for log in logs) == 1, logs
    assert sum("the other process built it" in log for log in logs) == 1, logs
    assert {log.strip().splitlines()[-1] for log in logs} == {str(path)}
    report = json.loads((path / "build.json").read_text())
    assert report["spec"] == asdict(spec) and report["weights_sha256"] == weights_digest(path)
    assert 0 <= report["val_acc"] <= 1 and report["mean_response_length"] > 0
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SPECRL_CACHE", str(tmp_path))
        assert ensure_toy_policy(spec, log=pytest.fail) == path  # cached: no second build
    for file in path.iterdir():  # readable by every user of a shared cache
        assert file.stat().st_mode & 0o777 == 0o644, file


@pytest.mark.slow
def test_the_default_run_learns(tmp_path):
    """The default config (speculative, exact rule) on the shipped policy: training reward
    rises, and rollouts reuse from the second epoch on."""
    metrics = train(tmp_path / "run", *SHORT)
    assert_learns(metrics, 0.10)
    assert all(m["spec/reused_token_ratio"] > 0.3 for m in metrics[2:]), metrics


@pytest.mark.slow
def test_the_default_run_with_a_critic_trains(tmp_path):
    """PPO with GAE: a value model from the policy's warm start with a fresh head learns the
    returns (its loss falls) while the policy learns as with GRPO."""
    critic = ["algorithm.adv_estimator=gae", "critic.optim.lr=1e-3"]
    metrics = train(tmp_path / "run", *SHORT, *critic)
    steps = [m for m in metrics if m["training/global_step"] > 0]
    assert steps[-1]["critic/vf_loss"] < 0.75 * steps[0]["critic/vf_loss"], steps
    gain = steps[-1]["critic/vf_explained_var"] - steps[0]["critic/vf_explained_var"]
    assert gain >= 0.1, steps
    assert_learns(metrics, 0.05)


@pytest.mark.slow
def test_the_calculator_episodes_train(tmp_path):
    """data.task=calculator on its shipped policy: episodes call the calculator, their reward
    rises, and from the second epoch on later turns reuse. Every trie verified: whether a later
    turn's pass pays is the budget's call from this machine's seconds (on this task it mostly
    does not: its prompts are long), and the rollouts are the same either way."""
    budget_off = "rollout.spec.verify_budget=false"
    metrics = train(tmp_path / "run", *SHORT, "data.task=calculator", budget_off)
    steps = [m for m in metrics if m["training/global_step"] > 0]
    assert sum(m["num_turns/mean"] for m in steps) / len(steps) > 1.0
    assert sum(m["spec/turn_1/reused_tokens"] for m in steps[1:]) > 0
    assert_learns(metrics, 0.05)
