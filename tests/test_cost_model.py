"""The cost model: shapes from Hugging Face configs, the roofline price of a step's forwards
(hand-computed), the fit of a machine's constants, stretched traces, and `specrl project` over a
finished bench."""

import json
import math
from dataclasses import replace

import pytest

from specrl.cli import main
from specrl.cost_model import (
    DEVICES,
    Device,
    ModelShape,
    fit_device,
    step_seconds,
    stretched,
)
from specrl.engines.accounting import KINDS, ForwardCounts
from specrl.errors import UserError
from specrl.projection import check_lines, checked_device, machine_check, priced_windows
from tests.conftest import read_metrics, small_config


def test_shapes_have_their_published_parameter_counts():
    assert ModelShape.named("qwen2.5-7b").params == pytest.approx(7.62e9, rel=0.005)
    small = ModelShape.named("qwen2.5-1.5b")
    assert small.params == pytest.approx(1.54e9, rel=0.005)
    assert small.kv_bytes_per_token == 2 * 28 * 2 * 128 * 2  # K and V, layers, KV heads, bf16


def test_a_shape_from_a_config_file_and_bad_names_in_one_line(tmp_path):
    config = {
        "num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128,
        "num_attention_heads": 4, "vocab_size": 100, "tie_word_embeddings": True,
        "torch_dtype": "float32",
    }  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    shape = ModelShape.named(str(tmp_path))
    assert (shape.kv_heads, shape.head_dim, shape.dtype_bytes) == (4, 16, 4)
    assert shape.params == 2 * (64 * 16 * 16 + 3 * 64 * 128) + 100 * 64
    with pytest.raises(UserError, match=r"neither qwen2\.5-1\.5b"):
        ModelShape.named(str(tmp_path / "nowhere"))
    with pytest.raises(UserError, match=r"name=\.\.\.,flops="):
        Device.named("flops=1e12")  # no bandwidth
    custom = Device.named("name=gpu,flops=1e15,bandwidth=2e12,overhead_ms=4")
    assert (custom.peak_flops, custom.bandwidth, custom.overhead_s) == (1e15, 2e12, 4e-3)


def test_a_step_costs_its_forwards_at_the_larger_of_compute_and_memory():
    shape, h100 = ModelShape.named("qwen2.5-7b"), DEVICES["h100"]
    counts = ForwardCounts()
    # 10 decode forwards of 64 rows, each row reading 1000 KV entries: memory-bound
    counts.record("decode", 640, 640, 640_000, 640_000, forwards=10)
    # one verification pass of 8192 positions: compute-bound
    counts.record("verify", 64, 8192, 8192, 8192 * 128)
    decode_memory = (shape.weight_bytes + shape.kv_bytes_per_token * 64_000) / (3.35e12 * 0.8)
    decode_compute = (shape.flops_per_position * 64 + shape.flops_per_pair * 64_000) / (
        989e12 * 0.6
    )
    assert decode_memory > decode_compute
    score_compute = (shape.flops_per_position * 8192 + shape.flops_per_pair * 8192 * 128) / (
        989e12 * 0.6
    )
    expected = 10 * (2e-3 + decode_memory) + 2e-3 + score_compute
    assert step_seconds(counts, shape, h100) == pytest.approx(expected)
    # work recorded without forwards of its own (vLLM's prefills) costs its compute only
    counts.record("prefill", 0, 1000, 1000, 500_500, forwards=0)
    extra = (shape.flops_per_position * 1000 + shape.flops_per_pair * 500_500) / (989e12 * 0.6)
    assert step_seconds(counts, shape, h100) == pytest.approx(expected + extra)


def test_the_fit_recovers_a_machines_constants():
    shape = ModelShape.named("qwen2.5-1.5b")
    machine = Device("cpu", 2e11, 2e10, 4e-3, 1.0, 1.0, overlap=False)
    calls = []
    for forwards, positions, kv in [(50, 400, 9e3), (80, 300, 2e5), (20, 900, 5e4), (65, 650, 1)]:
        counts = ForwardCounts()
        counts.record("decode", positions, positions, kv, kv, forwards=forwards)
        calls.append((counts, step_seconds(counts, shape, machine)))
    fitted = fit_device(calls, shape, "cpu")
    assert fitted.overhead_s == pytest.approx(4e-3, rel=1e-6)
    assert fitted.bandwidth == pytest.approx(2e10, rel=1e-6)
    assert fitted.peak_flops == pytest.approx(2e11, rel=1e-6)
    assert not fitted.overlap  # a CPU: compute and memory time add up


def test_graph_decode_forwards_get_an_overhead_of_their_own():
    """An engine that replays decode forwards as CUDA graphs and runs its prefills, scoring and
    trie passes eagerly: one overhead per forward cannot fit both (the H200's graph bench
    predicted decode forwards at 2.7-5.7x what they took); with `graph_decoding` the fit
    recovers each, and a step is priced with each."""
    shape = ModelShape.from_config(
        "small",
        {"num_hidden_layers": 8, "hidden_size": 512, "intermediate_size": 1408,
         "num_attention_heads": 8, "vocab_size": 2048},
    )  # fmt: skip
    machine = Device("gpu", 1e13, 1e12, 9e-3, 1.0, 1.0, overlap=False, decode_overhead_s=1.5e-3)
    calls = []
    for forwards, positions, kv, scored in [
        (50, 400, 9e3, 0), (80, 300, 2e5, 1), (20, 900, 5e4, 3), (65, 650, 1, 2), (30, 90, 40, 5),
    ]:  # fmt: skip
        counts = ForwardCounts()
        counts.record("decode", positions, positions, kv, kv, forwards=forwards)
        counts.record("verify", 8, 64 * scored, 64 * scored, 2080 * scored, forwards=scored)
        calls.append((counts, step_seconds(counts, shape, machine)))
    fitted = fit_device(calls, shape, "gpu", graph_decoding=True)
    assert fitted.decode_overhead_s == pytest.approx(1.5e-3, rel=1e-6)
    assert fitted.overhead_s == pytest.approx(9e-3, rel=1e-6)
    assert fitted.peak_flops == pytest.approx(1e13, rel=1e-4)
    one = fit_device(calls, shape, "gpu")  # a single overhead: decode forwards mispriced
    assert one.decode_overhead_s is None
    counts = calls[0][0]
    assert step_seconds(counts, shape, fitted) == pytest.approx(calls[0][1])
    assert abs(step_seconds(counts, shape, one) / calls[0][1] - 1) > 0.05


def test_windows_are_priced_by_the_work_counted_not_the_seconds_measured():
    """Two arms that did the same work are priced alike however differently the machine ran
    them; fewer decode forwards are priced lower; host work is carried as measured; the
    constants a check reports give back the device it fitted."""
    shape, machine = ModelShape.named("qwen2.5-1.5b"), Device("cpu", 2e11, 2e10, 4e-3, 1.0, 1.0)

    def step(forwards: int, measured: float, host: float = 0.1) -> tuple:
        counts = ForwardCounts()
        counts.record("decode", 64 * forwards, 64 * forwards, 6400 * forwards, 6400 * forwards,
                      forwards=forwards)  # fmt: skip
        counts.add_seconds("decode", measured)
        return counts, measured + 0.05, measured + host

    vanilla = [step(60, 2.0), step(60, 2.4), step(60, 1.9)]
    same_work_slower_machine = [step(60, 2.6), step(60, 3.0), step(60, 2.5)]
    fewer_forwards = [step(60, 2.0), step(30, 1.5), step(30, 0.9, host=0.3)]
    windows = priced_windows(
        {"vanilla": [vanilla], "same": [same_work_slower_machine], "fewer": [fewer_forwards]},
        shape, machine, window=2,
    )  # fmt: skip
    assert [w["steps"] for w in windows["same"]] == ["1-2", "3-3", "all"]
    assert all(w["priced_speedup"] == pytest.approx(1.0) for w in windows["same"])
    priced = [step_seconds(c, shape, machine) for c, _, _ in fewer_forwards]
    first, last, run = windows["fewer"]
    assert first["priced_rollout_s"] == pytest.approx(priced[0] + priced[1] + 0.2)
    assert last["priced_rollout_s"] == pytest.approx(priced[2] + 0.3)
    assert run["priced_rollout_s"] == pytest.approx(sum(priced) + 0.5)
    assert first["priced_speedup"] > 1 and run["vanilla_priced_rollout_s"] == pytest.approx(
        windows["same"][-1]["vanilla_priced_rollout_s"]
    )
    check = machine_check({"vanilla": vanilla}, shape, machine)
    assert checked_device(check) == replace(machine, name="this machine", overlap=False,
                                            source=check["calibrated_on"])  # fmt: skip
    assert "captures" not in check_lines(check)[0]
    captured = [step(60, 2.0)]
    captured[0][0].add_capture(0.5)  # a graph captured in the forwards' 2.0 s
    check = machine_check({"graphs": captured}, shape, machine)
    assert (check["arms"]["graphs"]["graph_captures"], check["arms"]["graphs"]["capture_s"]) == (
        1, 0.5,
    )  # fmt: skip
    line = "(CUDA graph captures: 1, 0.5 s of them, unpriced: the calibration captured none)"
    assert line in check_lines(check)[0]
    capturing = replace(machine, capture_s=0.4)  # a calibration that captured graphs
    priced = machine_check({"graphs": captured}, shape, capturing)
    assert priced["arms"]["graphs"]["predicted_s"] == pytest.approx(
        check["arms"]["graphs"]["predicted_s"] + 0.4
    )
    assert "captures: 1, 0.5 s of them, priced at 400.0 ms each)" in check_lines(priced)[0]
    assert checked_device(priced).capture_s == pytest.approx(0.4)


def test_stretched_responses_scale_decoding_and_keep_prefills():
    counts = ForwardCounts()
    counts.record("prefill", 8, 100, 100, 5050)
    counts.record("decode", 80, 90, 2000, 2100, draft_positions=10, forwards=10)
    counts.record("verify", 8, 50, 50, 1275)
    long = stretched(counts, 20)
    assert (long.prefill_positions, long.prefill_forwards) == (100, 1)
    assert (long.decode_forwards, long.decode_positions, long.decode_draft_positions) == (
        200, 1800, 200,
    )  # fmt: skip
    assert (long.decode_kv_reads, long.verify_attended) == (2000 * 400, 1275 * 400)
    assert (long.verify_forwards, long.verify_positions) == (1, 1000)


def test_the_cost_model_check_calibrates_through_the_arms_lora_adapters(
    tiny_policy_dir, tmp_path, monkeypatch
):
    """With LoRA the arms decode through unmerged adapters (each adapted layer's extra matmuls and
    peft's dispatch in every forward), and so does the calibration (SmolLM2 chain_sum with LoRA
    at 5486040: calibrated on the base model, the check priced both arms' forwards 21% under what
    they took)."""
    import peft

    from specrl import bench

    class Calibrated(Exception):
        pass

    models = []

    def calibrate(engine, shape):
        models.append(engine.model)
        raise Calibrated

    monkeypatch.setattr(bench, "calibrate", calibrate)
    shape = bench.policy_shape(tiny_policy_dir)
    for rank in (0, 4):
        cfg = small_config(tiny_policy_dir, tmp_path / str(rank), f"actor.lora.rank={rank}")
        with pytest.raises(Calibrated):
            bench._check_cost_model(cfg, {}, shape, tiny_policy_dir, 8)
    base, adapted = models
    assert not isinstance(base, peft.PeftModel) and not base.training
    assert isinstance(adapted, peft.PeftModel) and not adapted.training
    assert adapted.peft_config["default"].r == 4


def test_bench_checks_the_cost_model_and_project_prices_its_trace(
    tiny_policy_dir, tmp_path, capsys
):
    from specrl.bench import run_bench

    cfg = small_config(
        tiny_policy_dir, tmp_path / "unused", "data.train_size=8", "trainer.total_training_steps=4",
        "trainer.save_freq=0", "trainer.test_freq=0", "trainer.val_before_train=false",
        "rollout.spec.verify_budget=false",  # passes to price: the budget decides from timings
    )  # fmt: skip
    out = tmp_path / "bench"
    result = run_bench(cfg, out, ("vanilla", "trie"), log=lambda _: None)
    check = result["cost_model_check"]
    assert check["gflops_per_s"] > 0 and set(check["arms"]) == {"vanilla", "trie"}
    for name, arm in check["arms"].items():  # forwards and host work: the rollout time
        assert arm["compared"] == "forwards" and arm["measured_s"] > 0
        assert math.isfinite(arm["residual"]) and arm["engine_host_s"] > 0
        engine = arm["measured_s"] + arm["engine_host_s"]
        assert engine == pytest.approx(result["arms"][name]["engine_time_s"])
        assert engine + arm["host_s"] == pytest.approx(arm["measured_rollout_s"])
        seconds = sum(result["arms"][name]["perf"][f"timing_s/forward/{k}"] for k in KINDS)
        assert arm["measured_s"] == pytest.approx(seconds)
    run = check["windows"]["trie"][-1]  # the windows' whole run: the check's prediction
    assert run["steps"] == "all" and "vanilla" not in check["windows"]
    assert run["priced_rollout_s"] == pytest.approx(check["arms"]["trie"]["predicted_rollout_s"])
    steps = [m for m in read_metrics(out / "trie") if m["training/global_step"] > 0]
    perf = result["arms"]["trie"]["perf"]  # bench.json: each arm's forwards summed
    assert perf["perf/verify/forwards"] == sum(m["perf/verify/forwards"] for m in steps) > 0
    assert result["arms"]["vanilla"]["perf"]["perf/verify/forwards"] == 0
    config = json.loads((tiny_policy_dir / "config.json").read_text())
    assert result["model_shape"]["vocab"] == config["vocab_size"]
    capsys.readouterr()
    assert main(["project", str(out), "--model", "qwen2.5-7b", "--stretch", "1,20"]) == 0
    printed = capsys.readouterr().out
    assert "PROJECTION (not a measurement) for qwen2.5-7b" in printed
    written = json.loads((out / "projection-nvidia-h100-sxm5-80gb-qwen2.5-7b.json").read_text())
    one, twenty = written["projections"]
    assert one["projection"] and (one["response_stretch"], twenty["response_stretch"]) == (1, 20)
    for projection in (one, twenty):
        arms = projection["arms"]
        assert arms["vanilla"]["projected_rollout_speedup"] == 1.0
        assert arms["trie"]["projected_rollout_s"] > 0
    assert (
        twenty["arms"]["vanilla"]["projected_rollout_s"]
        > one["arms"]["vanilla"]["projected_rollout_s"]
    )
    assert main(["project", str(tmp_path)]) == 2  # not a bench: one line
    assert "is not a finished bench" in capsys.readouterr().err
