import json
import math

from specrl.bench import run_bench
from tests.conftest import small_config


def test_bench_trains_both_arms_and_writes_json_and_plot(tiny_policy_dir, tmp_path):
    # 8 training prompts, 4 per step: every prompt is seen again from step 3 on, so drafts exist
    cfg = small_config(
        tiny_policy_dir, tmp_path / "unused", "data.train_size=8", "trainer.total_training_steps=4",
        "trainer.save_freq=0", "trainer.test_freq=2",
    )  # fmt: skip
    result = run_bench(cfg, tmp_path / "bench", log=lambda _: None)
    on_disk = json.loads((tmp_path / "bench" / "bench.json").read_text())
    assert on_disk == result
    assert (tmp_path / "bench" / "bench.png").stat().st_size > 10_000
    for key in ("rollout_speedup", "step_speedup", "verify_cost_ratio", "limit_speedup"):
        assert math.isfinite(result[key]) and result[key] > 0, key
    assert 0 < result["reused_token_ratio"] <= 1
    assert result["final_acc_vanilla"] is not None and result["final_acc_spec"] is not None
    assert result["decoded_tokens"]["spec"] < result["decoded_tokens"]["vanilla"]
    # the vanilla arm never reads the store; the spec arm starts reusing once prompts repeat
    vanilla = [
        json.loads(x)
        for x in (tmp_path / "bench" / "vanilla" / "metrics.jsonl").read_text().splitlines()
    ]
    assert all(m.get("spec/reused_tokens", 0) == 0 for m in vanilla)
