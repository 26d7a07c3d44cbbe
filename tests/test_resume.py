import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from specrl.checkpoint import CheckpointError, latest_checkpoint
from specrl.cli import main
from specrl.config import load_config
from specrl.trainer import Trainer
from tests.conftest import read_metrics, small_config

SPEC = [
    "data.train_size=8",
    "rollout.spec.enabled=true",
    "rollout.spec.tree.enabled=true",
    "rollout.spec.tree.adaptive=false",  # the adaptive width depends on timings
    "rollout.spec.verify_budget=false",  # so does what the trie budget verifies
    "rollout.verify_batching=slack",  # and how the engine groups verification forwards
    "trainer.test_freq=2",
]


def comparable(metrics):
    return [
        {k: v for k, v in m.items() if not k.startswith(("timing_s/", "perf/throughput"))}
        for m in metrics
    ]


ENV = """
class Environment:
    def reset(self, row):
        self.turns = 0

    def step(self, response):
        self.turns += 1
        if self.turns == 2:
            return "", response.count("1") / 4, True
        return "7;", 0.0, False
"""


@pytest.mark.parametrize(
    "extra",
    [
        [],
        ["algorithm.adv_estimator=gae", "algorithm.lam=0.95", "critic.ppo_mini_batch_size=2"],
        ["env.path={env}", "data.max_response_length=16"],
    ],
    ids=["grpo", "gae", "episodes"],
)
def test_resume_at_an_epoch_boundary_with_speculation_matches_the_straight_run(
    tiny_policy_dir, tmp_path, extra
):
    # 8 prompts, 4 per step: step 2 ends epoch 0, steps 3-4 reuse drafts from the restored store;
    # with gae the critic's weights and optimizer are restored too; with episodes, the record of
    # their observations
    env = tmp_path / "env.py"
    env.write_text(ENV)
    spec = [*SPEC, *(x.format(env=env) for x in extra)]
    straight = tmp_path / "straight"
    Trainer(small_config(tiny_policy_dir, straight, *spec, "trainer.total_training_steps=4")).fit()
    split = tmp_path / "split"
    Trainer(small_config(tiny_policy_dir, split, *spec, "trainer.total_training_steps=2")).fit()
    resumed = Trainer(small_config(tiny_policy_dir, split, *spec, "trainer.total_training_steps=4"))
    assert resumed.run.global_step == 2 and resumed.run.resume_from.name == "global_step_2"
    resumed.fit()
    a, b = comparable(read_metrics(straight)), comparable(read_metrics(split))
    assert [m["training/global_step"] for m in b] == [0, 1, 2, 3, 4]
    assert b[3]["training/epoch"] == 1
    if "env.path" in " ".join(extra):  # a turn is a draft where the stored episode reached it
        assert b[3]["spec/draft_ratio"] > 0 and b[3]["spec/turn_1/response_tokens"] > 0
    else:
        assert b[3]["spec/draft_ratio"] == 1
    assert b[3]["spec/tree/nodes"] > 0  # restored trees: equal node counts below
    if "gae" in " ".join(extra):
        assert "critic/vf_loss" in b[3] and "critic/vf_explained_var" in b[3]
    for x, y in zip(a, b, strict=True):
        assert x.keys() == y.keys()
        for key in x:
            assert y[key] == pytest.approx(x[key], rel=1e-5, abs=1e-6), key


def test_resume_disable_starts_over_and_max_ckpt_to_keep_prunes(tiny_policy_dir, tmp_path):
    cfg = small_config(
        tiny_policy_dir, tmp_path, "trainer.total_training_steps=3", "trainer.max_ckpt_to_keep=2"
    )
    Trainer(cfg).fit()
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        "global_step_2",
        "global_step_3",
    ]
    again = Trainer(small_config(tiny_policy_dir, tmp_path, "trainer.resume_mode=disable"))
    assert again.run.global_step == 0 and again.run.resume_from is None


def test_resuming_with_a_changed_config_names_the_changes_and_refuses_what_breaks_it(
    tiny_policy_dir, tmp_path, capsys
):
    Trainer(small_config(tiny_policy_dir, tmp_path, "trainer.total_training_steps=1")).fit()
    capsys.readouterr()
    with pytest.raises(CheckpointError, match=r"data\.train_size: 16 → 32: a resumed run cannot"):
        Trainer(small_config(tiny_policy_dir, tmp_path, "data.train_size=32"))
    resumed = Trainer(small_config(tiny_policy_dir, tmp_path, "rollout.n=2"))
    assert resumed.run.global_step == 1
    err = " ".join(capsys.readouterr().err.split())
    assert "resuming with a changed config (rollout.n: 4 → 2)" in err
    kept = tmp_path / "config.step1.yaml"
    assert "n: 4" in kept.read_text() and f"kept as {kept}" in err


def test_corrupt_or_missing_checkpoint_gives_one_clear_error(tiny_policy_dir, tmp_path, capsys):
    Trainer(small_config(tiny_policy_dir, tmp_path, "trainer.total_training_steps=1")).fit()
    state = tmp_path / "checkpoints" / "global_step_1" / "trainer_state.pt"
    state.write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match="is unreadable"):
        Trainer(small_config(tiny_policy_dir, tmp_path))
    args = [f"model.path={tiny_policy_dir}", f"trainer.output_dir={tmp_path}"]
    capsys.readouterr()  # drop what the first run printed
    assert main(["train", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "trainer.resume_mode=disable" in err[0]
    assert main(["train", *args, f"trainer.resume_mode={tmp_path / 'nope'}"]) == 2
    assert "is not a checkpoint directory" in capsys.readouterr().err


def test_a_checkpoint_state_that_does_not_fit_gives_one_clear_error(tiny_policy_dir, tmp_path):
    """An optimizer state in an older layout (keyed by index, not by parameter name)."""
    Trainer(small_config(tiny_policy_dir, tmp_path, "trainer.total_training_steps=1")).fit()
    path = tmp_path / "checkpoints" / "global_step_1" / "trainer_state.pt"
    state = torch.load(path, weights_only=False)
    state["actor"]["optimizer"] = {"state": {0: {}}, "param_groups": [{"params": [0]}]}
    torch.save(state, path)
    with pytest.raises(CheckpointError, match="its actor state does not fit this run"):
        Trainer(small_config(tiny_policy_dir, tmp_path))


def test_sigkill_during_a_checkpoint_save_leaves_the_last_good_one(tiny_policy_dir, tmp_path):
    """Kill a training process the moment a checkpoint is being written, then resume."""
    run = tmp_path / "run"
    overrides = [
        f"model.path={tiny_policy_dir}", f"trainer.output_dir={run}", "trainer.logger=[jsonl]", "data.train_size=16", "data.val_size=4", "data.train_batch_size=4", "rollout.n=2",
        "actor.ppo_mini_batch_size=2", "data.max_response_length=8", "trainer.total_training_steps=40",
        "trainer.save_freq=1", "trainer.test_freq=0", "trainer.total_epochs=10",
    ]  # fmt: skip
    command = [sys.executable, "-m", "specrl", "train", *overrides]
    for _attempt in range(5):
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        killed = False
        while process.poll() is None:
            saving = any(p.name.endswith(".tmp") for p in (run / "checkpoints").glob("*"))
            if saving and latest_checkpoint(run) is not None:  # a later save, not the first
                os.kill(process.pid, signal.SIGKILL)
                killed = True
                break
            time.sleep(0.0005)
        process.wait()
        if killed:
            break
    assert killed, "never caught the process inside a checkpoint save"
    last = latest_checkpoint(run)
    assert last is not None and not last.name.endswith(".tmp")
    resumed = Trainer(load_config(None, [*overrides, "trainer.save_freq=0"]))
    step = resumed.run.global_step
    assert step == int(last.name.removeprefix("global_step_")) >= 1
    resumed.fit()
    steps = [m["training/global_step"] for m in read_metrics(run)]
    assert steps[-1] == 40 and steps == sorted(set(steps))  # no step logged twice


def test_non_finite_losses_are_skipped_then_stop_the_run_after_saving(
    tiny_policy_dir, tmp_path, monkeypatch
):
    import dataclasses

    import torch

    from specrl.algorithms.losses import POLICY_LOSSES
    from specrl.trainer import TrainingDivergedError

    real = POLICY_LOSSES["vanilla"]

    def nan_loss(*args, **kwargs):
        out = real(*args, **kwargs)
        return dataclasses.replace(out, loss=out.loss * float("nan"))

    monkeypatch.setitem(POLICY_LOSSES, "vanilla", nan_loss)
    cfg = small_config(
        tiny_policy_dir,
        tmp_path,
        "trainer.total_training_steps=5",
        "trainer.max_bad_steps=2",
        "trainer.save_freq=0",
    )
    trainer = Trainer(cfg)
    before = {k: v.clone() for k, v in trainer.run.actor.policy.state_dict().items()}
    with pytest.raises(TrainingDivergedError, match="2 steps in a row had non-finite losses"):
        trainer.fit()
    steps = read_metrics(tmp_path)[1:]
    assert [m["training/global_step"] for m in steps] == [1, 2]
    assert all(m["actor/skipped_updates"] > 0 for m in steps)
    assert (tmp_path / "checkpoints" / "global_step_2" / "trainer_state.pt").is_file()
    assert all(
        torch.equal(before[k], v) for k, v in trainer.run.actor.policy.state_dict().items()
    )  # never applied
