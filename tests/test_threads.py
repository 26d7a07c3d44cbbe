"""trainer.num_threads=auto: the cores the machine's load leaves free when a run first starts,
kept by its checkpoints for the whole run and its resumes; an explicit count or OMP_NUM_THREADS
wins."""

import os

import pytest
import torch

import specrl.threads
from specrl.checkpoint import STATE_FILE
from specrl.threads import run_threads
from specrl.trainer import Trainer
from tests.conftest import small_config


@pytest.fixture
def machine(monkeypatch):
    """A 4-core machine whose busy cores the test sets; torch's threads restored."""
    threads = torch.get_num_threads()
    load = [0.0]
    monkeypatch.setattr(os, "cpu_count", lambda: 4)
    monkeypatch.setattr(specrl.threads, "TORCH_DEFAULT", 4)
    monkeypatch.setattr(specrl.threads, "busy_cores", lambda: load[0])
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    yield load
    torch.set_num_threads(threads)


@pytest.mark.parametrize(("load", "threads"), [(0.2, 4), (1.4, 3), (2.6, 1), (9.0, 1)])
def test_auto_takes_the_cores_the_load_leaves_free(machine, load, threads):
    machine[0] = load
    count, line = run_threads("auto", None)
    assert count == threads
    assert (line is None) == (threads == 4)
    if line:
        assert (
            line.startswith(f"torch threads: {threads} of 4 (") and f"{load:.1f} of 4 cores" in line
        )


def test_busy_cores_are_read_from_the_machine():
    assert 0.0 <= specrl.threads.busy_cores() <= os.cpu_count()


def test_auto_never_takes_more_than_torch_would(machine, monkeypatch):
    monkeypatch.setattr(specrl.threads, "TORCH_DEFAULT", 2)  # 4 hyperthreads on 2 cores
    assert run_threads("auto", None) == (2, None)


def test_an_explicit_count_a_recorded_one_and_omp_num_threads_win(machine, monkeypatch):
    machine[0] = 3.0
    assert run_threads(2, None) == (2, None)
    assert run_threads(3, 1) == (3, None)  # the config's count over the checkpoint's
    assert run_threads("auto", 4) == (4, None)  # a resume keeps its run's count
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert run_threads("auto", None) == (torch.get_num_threads(), None)


def test_a_resumed_run_computes_with_the_threads_it_started_with(
    machine, tiny_policy_dir, tmp_path, capsys
):
    machine[0] = 2.6  # busy at the first start: 1 thread
    first = ["trainer.total_training_steps=1", "trainer.logger=[console,jsonl]"]
    Trainer(small_config(tiny_policy_dir, tmp_path, *first)).fit()
    assert "torch threads: 1 of 4" in capsys.readouterr().err
    state = torch.load(tmp_path / "checkpoints" / "global_step_1" / STATE_FILE, weights_only=False)
    assert state["torch_threads"] == 1
    machine[0] = 0.0  # idle at the resume: still 1
    torch.set_num_threads(2)
    Trainer(small_config(tiny_policy_dir, tmp_path)).fit()
    assert torch.get_num_threads() == 1


@pytest.mark.parametrize("value", ["0", "-1", "two"])
def test_a_bad_thread_count_is_one_line_naming_the_key(value, capsys):
    from specrl.cli import main

    assert main(["config", f"trainer.num_threads={value}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"specrl: error: invalid config: trainer.num_threads={value}: give auto or a number of "
        "threads (1 or more)"
    ]
