"""The embedded default end to end: build the tiny policy from scratch, then the whole default
run with the CLI. Slow (about 8 minutes on 2 cores); CI runs it."""

import json
import os
import subprocess
import sys

import pytest

from specrl.toy_policy import ensure_toy_policy


@pytest.mark.slow
def test_toy_policy_build_and_vanilla_grpo_keeps_learning_through_the_default_run(
    tmp_path, monkeypatch
):
    monkeypatch.setenv("SPECRL_CACHE", str(tmp_path / "cache"))
    path = ensure_toy_policy(log=lambda _: None)
    report = json.loads((path / "build.json").read_text())
    # the warm start leaves RL room: imperfect but not hopeless, long responses, varied samples
    assert 0.05 <= report["val_acc"] <= 0.40
    assert report["mean_response_length"] >= 40
    assert report["distinct_samples_of_16"] >= 4
    assert ensure_toy_policy(log=pytest.fail) == path  # cached: no second build
    for file in path.iterdir():  # readable by every user of a shared cache
        assert file.stat().st_mode & 0o777 == 0o644, file

    run = tmp_path / "run"
    command = [
        sys.executable, "-m", "specrl", "train", f"trainer.output_dir={run}",
        "rollout.spec.enabled=false", "rollout.spec.tree.enabled=false",
    ]  # fmt: skip
    subprocess.run(command, check=True, env={**os.environ, "SPECRL_CACHE": str(tmp_path / "cache")})
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    curve = {
        m["training/global_step"]: m["val/acc/mean@1"] for m in metrics if "val/acc/mean@1" in m
    }
    last = max(curve)
    gain = curve[last] - curve[0]
    assert gain >= 0.20, curve  # RL learns the task
    assert curve[last] - curve[last // 2] >= 0.05, curve  # and is still learning in its second half
