"""The embedded default end to end: build the tiny policy from scratch, then RL with the CLI.
Slow (about 3 minutes on 2 cores); CI runs it."""

import json
import os
import subprocess
import sys

import pytest

from specrl.toy_policy import ensure_toy_policy


@pytest.mark.slow
def test_toy_policy_build_and_grpo_raises_heldout_accuracy(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECRL_CACHE", str(tmp_path / "cache"))
    path = ensure_toy_policy(log=lambda _: None)
    report = json.loads((path / "build.json").read_text())
    # the warm start leaves RL room: imperfect but not hopeless, long responses, varied samples
    assert 0.10 <= report["val_acc"] <= 0.60
    assert report["mean_response_length"] >= 40
    assert report["distinct_samples_of_16"] >= 4
    assert ensure_toy_policy(log=pytest.fail) == path  # cached: no second build

    run = tmp_path / "run"
    command = [
        sys.executable,
        "-m",
        "specrl",
        "train",
        f"trainer.output_dir={run}",
        "trainer.total_training_steps=8",
        "trainer.test_freq=8",
    ]
    subprocess.run(command, check=True, env={**os.environ, "SPECRL_CACHE": str(tmp_path / "cache")})
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    before, after = metrics[0]["val/acc/mean@1"], metrics[-1]["val/acc/mean@1"]
    assert after - before >= 0.20, (before, after)
