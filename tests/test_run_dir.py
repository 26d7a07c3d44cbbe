"""Runs that survive users: unusable or shared output directories, starting over, interrupts, a
crashed metrics log."""

import json
import signal
import subprocess
import sys
import time

import pytest

from specrl.cli import main
from specrl.run_dir import RunInterrupted
from specrl.trainer import Trainer
from tests.conftest import read_metrics, small_config

ARGS = [
    "trainer.logger=[jsonl]", "data.train_size=16", "data.val_size=4", "data.train_batch_size=4",
    "rollout.n=2", "actor.ppo_mini_batch_size=2", "data.max_response_length=8",
    "trainer.test_freq=0", "trainer.total_epochs=50", "rollout.spec.tree.adaptive=false",
]  # fmt: skip


def train_command(policy_dir, run, *overrides):
    return [
        sys.executable, "-m", "specrl", "train", f"model.path={policy_dir}",
        f"trainer.output_dir={run}", *ARGS, *overrides,
    ]  # fmt: skip


def wait_for_steps(run, steps, process):
    """Until metrics.jsonl holds `steps` records (the process must still be running)."""
    metrics = run / "metrics.jsonl"
    while not metrics.is_file() or len(metrics.read_text().splitlines()) < steps:
        assert process.poll() is None, process.communicate()
        time.sleep(0.05)


def one_error_line(capsys):
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def test_an_output_dir_that_is_a_file_or_not_writable_stops_before_the_model_loads(
    tmp_path, capsys
):
    file = tmp_path / "taken"
    file.write_text("x")
    nowhere = tmp_path / "no-model"  # would fail too, but later: the output dir is checked first
    assert main(["train", f"model.path={nowhere}", f"trainer.output_dir={file}"]) == 2
    assert "is a file, not a directory" in one_error_line(capsys)
    below = file / "run"  # cannot be created (as root, too)
    assert main(["train", f"model.path={nowhere}", f"trainer.output_dir={below}"]) == 2
    assert "cannot be created (Not a directory)" in one_error_line(capsys)


def test_a_second_run_into_the_same_dir_is_refused_and_the_first_is_intact(
    tiny_policy_dir, tmp_path
):
    run = tmp_path / "run"
    steps = "trainer.total_training_steps=150"  # still running when the second one starts
    first = subprocess.Popen(
        train_command(tiny_policy_dir, run, steps), stderr=subprocess.PIPE, text=True
    )
    wait_for_steps(run, 2, first)
    second = subprocess.run(
        train_command(tiny_policy_dir, run, steps), capture_output=True, text=True
    )
    assert second.returncode == 2
    assert second.stderr.strip().splitlines() == [
        f"specrl: error: trainer.output_dir {str(run)!r} is in use by another specrl run (pid "
        f"{first.pid}); wait for it to finish or choose another trainer.output_dir"
    ]
    first.send_signal(signal.SIGINT)  # it saves and stops
    assert first.wait() == 128 + signal.SIGINT, first.stderr.read()
    logged = [m["training/global_step"] for m in read_metrics(run)]
    assert logged == list(range(len(logged)))  # every step once, in order: nothing interleaved
    # the lock went with the first process: a third run may resume there
    resume = train_command(tiny_policy_dir, run, f"trainer.total_training_steps={len(logged)}")
    assert main(resume[3:]) == 0
    assert read_metrics(run)[-1]["training/global_step"] == len(logged)


def test_starting_over_moves_the_earlier_run_aside(tiny_policy_dir, tmp_path):
    Trainer(small_config(tiny_policy_dir, tmp_path, "trainer.total_training_steps=1")).fit()
    earlier = (tmp_path / "metrics.jsonl").read_text()
    again = Trainer(small_config(tiny_policy_dir, tmp_path, "trainer.resume_mode=disable"))
    assert not (tmp_path / "checkpoints").exists()  # a later auto resume cannot pick them up
    aside = tmp_path / "previous-1"
    assert (aside / "checkpoints" / "global_step_1").is_dir()
    assert (aside / "metrics.jsonl").read_text() == earlier
    again.fit()
    assert [m["training/global_step"] for m in read_metrics(tmp_path)] == [0, 1, 2]


@pytest.fixture(scope="module")
def straight_run(tiny_policy_dir, tmp_path_factory) -> list[dict]:
    """The metrics of an uninterrupted 10-step run."""
    straight = tmp_path_factory.mktemp("straight")
    subprocess.run(train_command(tiny_policy_dir, straight, STEPS), check=True)
    return read_metrics(straight)


STEPS = "trainer.total_training_steps=10"


@pytest.mark.xdist_group("straight-run")  # one pytest worker runs the fixture
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_an_interrupted_run_saves_and_its_rerun_resumes_as_if_uninterrupted(
    tiny_policy_dir, straight_run, tmp_path, signum
):
    steps = STEPS
    run = tmp_path / "run"
    process = subprocess.Popen(
        train_command(tiny_policy_dir, run, steps, "trainer.save_freq=0"),
        stderr=subprocess.PIPE,
        text=True,
    )
    wait_for_steps(run, 3, process)
    process.send_signal(signum)
    _, err = process.communicate()
    assert process.returncode == 128 + signum, err[-4000:]
    # the tiny random policy never scores: the run says so once, as a warning
    lines = [line for line in err.strip().splitlines() if not line.startswith("warning: ")]
    assert len(lines) == 1 and lines[0].startswith("specrl: interrupted at step "), lines
    step = int(lines[0].split("interrupted at step ")[1].split(";")[0])
    assert f"saved {run / 'checkpoints' / f'global_step_{step}'}" in lines[0]
    assert lines[0].endswith("rerun the same command to resume")
    subprocess.run(train_command(tiny_policy_dir, run, steps, "trainer.save_freq=0"), check=True)
    a, b = straight_run, read_metrics(run)
    assert [m["training/global_step"] for m in b] == list(range(11))
    for x, y in zip(a, b, strict=True):
        for key in ("critic/score/mean", "response_length/mean", "actor/pg_loss"):
            assert x.get(key) == pytest.approx(y.get(key), rel=1e-5, abs=1e-6), key


class LateSignal:
    """A signal that arrives while a step is being finished: after the step first asks."""

    def __init__(self):
        self.asked = 0

    @property
    def received(self):
        self.asked += 1
        return None if self.asked == 1 else signal.SIGTERM


def test_a_signal_arriving_as_a_step_ends_stops_the_next_step_after_saving(
    tiny_policy_dir, tmp_path
):
    trainer = Trainer(small_config(tiny_policy_dir, tmp_path / "run", "trainer.save_freq=0"))
    with pytest.raises(RunInterrupted) as stopped, trainer.running():
        trainer._stop = LateSignal()
        trainer.step()  # the step had asked before the signal came: it ends as usual
        assert trainer.run.global_step == 1
        trainer.step()
    assert stopped.value.exit_code == 128 + signal.SIGTERM
    assert f"interrupted at step 2; saved {tmp_path / 'run' / 'checkpoints'}" in str(stopped.value)
    assert (tmp_path / "run" / "checkpoints" / "global_step_2").is_dir()


def test_a_truncated_last_metrics_line_is_dropped_by_resume_and_report(
    tiny_policy_dir, tmp_path, capsys
):
    Trainer(small_config(tiny_policy_dir, tmp_path, "trainer.total_training_steps=1")).fit()
    metrics = tmp_path / "metrics.jsonl"
    whole = metrics.read_text()
    metrics.write_text(whole + '{"training/global_step": 2, "critic/sc')  # killed mid-write
    capsys.readouterr()
    assert main(["report", str(tmp_path)]) == 0
    assert "dropped the unparsable last line 3" in capsys.readouterr().err
    Trainer(small_config(tiny_policy_dir, tmp_path)).fit()  # resumes from step 1
    assert [m["training/global_step"] for m in read_metrics(tmp_path)] == [0, 1, 2]
    assert json.loads(whole.splitlines()[1]) == read_metrics(tmp_path)[1]
