import json
import math

import pytest

from specrl.bench import ARMS, alike_arms, arm_config, parse_arms, parse_seeds, run_bench
from specrl.cli import main
from specrl.config import load_config
from specrl.errors import UserError
from tests.conftest import png_panels, read_metrics, small_config


def test_bench_trains_every_arm_and_writes_json_and_plot(tiny_policy_dir, tmp_path):
    # 8 training prompts, 4 per step: every prompt is seen again from step 3 on, so drafts exist;
    # online trees give the few tokens decoded after the cuts of so short a run drafts to try
    cfg = small_config(
        tiny_policy_dir, tmp_path / "unused", "data.train_size=8", "trainer.total_training_steps=4",
        "trainer.save_freq=0", "trainer.test_freq=2", "rollout.spec.tree.adaptive=false",
        "rollout.spec.tree.online=true", "rollout.spec.acceptance=specrl",
        "rollout.spec.verify_budget=false",  # the arms' decoded tokens compared: no timings
        "rollout.verify_batching=slack",
    )  # fmt: skip
    # spec-in-decoding: the exact rule's (test_stage.py); the suffix arms: vLLM's (test_vllm.py)
    arms = tuple(a for a in ARMS if a != "spec-in-decoding" and "suffix" not in a)
    result = run_bench(cfg, tmp_path / "bench", arms, log=lambda _: None)
    on_disk = json.loads((tmp_path / "bench" / "bench.json").read_text())
    assert on_disk == result
    # an untimed warm-up ran first, apart from the arms
    assert result["warmup"]["arm"] == "vanilla" and result["warmup"]["steps"] == 2
    assert len(read_metrics(tmp_path / "bench" / "warmup")) == 2
    assert png_panels(tmp_path / "bench" / "bench.png") == 3  # four panels and the tree panel
    # the ratios are the spec arm's counts pooled over its steps, the first epoch's included
    spec_steps = read_metrics(tmp_path / "bench" / "spec")[1:]
    reused = sum(m["spec/reused_tokens"] for m in spec_steps)
    total = sum(m["spec/response_tokens"] for m in spec_steps)
    assert result["reused_token_ratio_all_steps"] == pytest.approx(reused / total)
    assert result["reused_token_ratio"] > result["reused_token_ratio_all_steps"]
    for key in ("rollout_speedup", "step_speedup", "verify_cost_ratio", "limit_speedup"):
        assert math.isfinite(result[key]) and result[key] > 0, key
    assert result["reused_token_ratio"] > 0
    assert result["final_acc_vanilla"] is not None and result["final_acc_spec"] is not None
    assert result["decoded_tokens"]["spec"] < result["decoded_tokens"]["vanilla"]
    assert set(result["arms"]) == set(arms)
    arms = result["arms"]
    assert arms["spec"]["rollout_speedup"] == result["rollout_speedup"]
    # the noise of the arms' paired steps: 4 steps over the run, 2 in epoch 0
    assert arms["trie"]["rollout_speedup_se"] > 0 and arms["trie"]["epoch0_log_ratio_se"] >= 0
    # what the trie arm's verification cost (its verification seconds taken out, the prompts'
    # prefill at vanilla's seconds: the formula is test_a_window_says_what_its_verification_cost's;
    # on 4 tiny steps the two prefills' timing noise outweighs the verification) and vanilla's
    trie_steps = read_metrics(tmp_path / "bench" / "trie")[1:]
    assert sum(m["timing_s/verify"] for m in trie_steps) > 0
    assert math.isfinite(arms["trie"]["verify_free_speedup"])
    assert arms["vanilla"]["verify_free_speedup"] == pytest.approx(1.0)
    # the spec arm is speculative rollouts as configured: by default its tail has tree drafts
    for arm in ("spec", "tree", "spec+tree"):
        assert arms[arm]["accepted_draft_tokens"] > 0 and arms[arm]["tokens_per_forward"] > 1
    assert (
        "rollout_speedup_vs_spec" in arms["tree"] and "rollout_speedup_vs_spec" in arms["spec+tree"]
    )
    # token-tree drafts never change what is sampled: same tokens, same training
    assert arms["tree"]["decoded_tokens"] == arms["vanilla"]["decoded_tokens"]
    assert arms["tree"]["final_acc"] == arms["vanilla"]["final_acc"]
    assert arms["spec+tree"]["decoded_tokens"] == arms["spec"]["decoded_tokens"]
    # trie rollouts are vanilla's samples (the exact rule, whatever the bench's): same training,
    # fewer tokens decoded
    assert arms["trie"]["final_acc"] == arms["vanilla"]["final_acc"]
    assert arms["trie"]["decoded_tokens"] < arms["vanilla"]["decoded_tokens"]
    assert arms["trie"]["trie_nodes_per_step"] > 0 and arms["vanilla"]["trie_nodes_per_step"] == 0
    # trie+tree: the same tokens as the trie arm, what is decoded drafted from token trees
    assert arms["trie+tree"]["decoded_tokens"] == arms["trie"]["decoded_tokens"]
    assert arms["trie+tree"]["final_acc"] == arms["vanilla"]["final_acc"]
    assert arms["trie+tree"]["accepted_draft_tokens"] > 0
    # tree drafts `auto`: trie+tree is the trie arm, spec+tree the spec arm, and the bench says so
    assert result["warnings"][:2] == [
        f"the arms {pair} roll out with the same config here (tree drafts `auto` are on wherever "
        "speculation is): what separates their figures is this machine's noise"
        for pair in ("spec, spec+tree", "trie, trie+tree")
    ]
    assert 0 < arms["trie"]["reused_token_ratio_per_epoch"]["1"] <= 1
    # the vanilla arm never reads the store; the spec arm starts reusing once prompts repeat
    vanilla = [
        json.loads(x)
        for x in (tmp_path / "bench" / "vanilla" / "metrics.jsonl").read_text().splitlines()
    ]
    assert all(m.get("spec/reused_tokens", 0) == 0 for m in vanilla)


def test_arms_are_checked(capsys, tmp_path):
    assert parse_arms("vanilla, tree,tree") == ("vanilla", "tree")
    with pytest.raises(UserError, match="unknown: fast"):
        parse_arms("vanilla,fast")
    assert main(["bench", "--arms", "spec,tree"]) == 2
    err = capsys.readouterr().err
    assert "give vanilla and at least one of spec, trie, trie+tree, spec-in-decoding, tree" in err
    assert main(["bench", "--warmup-steps", "-1"]) == 2
    assert "--warmup-steps -1: give 0 (no warm-up) or more steps" in capsys.readouterr().err
    lenient = load_config(None, ["rollout.spec.acceptance=specrl"])
    with pytest.raises(UserError, match=r"--arms spec-in-decoding: invalid config: rollout\.spec"):
        run_bench(lenient, tmp_path, ("vanilla", "spec", "spec-in-decoding"))  # before training
    with pytest.raises(UserError, match=r"--arms suffix: .*vLLM's built-in suffix decoding"):
        run_bench(load_config(None, []), tmp_path, ("vanilla", "suffix"))
    assert not any(tmp_path.iterdir())
    assert parse_seeds("1, 2,1") == [1, 2] and parse_seeds(None) is None
    assert main(["bench", "--seeds", "1,x"]) == 2
    assert "--seeds '1,x': give comma-separated non-negative integers" in capsys.readouterr().err


def test_arms_that_roll_out_alike_are_found_whatever_their_names(tmp_path):
    """Tree drafts `auto` are on wherever speculation is, so under the defaults an arm that turns
    them on is the arm without: the bench names such arms before it trains (a difference between
    them is noise); with tree drafts off every arm is its own."""
    hf = [arm for arm in ARMS if "suffix" not in arm]  # the suffix arms are vLLM's
    for overrides, alike in (
        ([], [["spec", "spec+tree"], ["trie", "trie+tree"]]),
        (["rollout.spec.tree.enabled=false"], []),
    ):
        cfg = load_config(None, overrides)
        assert alike_arms({arm: arm_config(cfg, arm, 1, tmp_path) for arm in hf}) == alike


def test_bench_pools_seeds(tiny_policy_dir, tmp_path):
    cfg = small_config(
        tiny_policy_dir, tmp_path / "unused", "data.train_size=8", "trainer.total_training_steps=3",
        "trainer.save_freq=0", "trainer.test_freq=3",
    )  # fmt: skip
    result = run_bench(
        cfg, tmp_path / "bench", ("vanilla", "spec"), [3, 4], log=lambda _: None, warmup_steps=0
    )
    assert result["seeds"] == [3, 4] and result["steps"] == 3
    assert result["arm_order"] == {"3": ["vanilla", "spec"], "4": ["spec", "vanilla"]}
    for arm in ("vanilla", "spec"):
        runs = [tmp_path / "bench" / f"seed{seed}" / arm / "metrics.jsonl" for seed in (3, 4)]
        histories = [[json.loads(x) for x in run.read_text().splitlines()] for run in runs]
        finals = [next(m["val/acc/mean@1"] for m in reversed(h) if "val/acc/mean@1" in m)
                  for h in histories]  # fmt: skip
        assert result["arms"][arm]["final_acc_per_seed"] == finals
        assert result["arms"][arm]["final_acc"] == pytest.approx(sum(finals) / 2)
        rollout = sum(m.get("timing_s/rollout", 0) for h in histories for m in h)
        assert result["arms"][arm]["rollout_time_s"] == pytest.approx(rollout)
        per_seed = result["arms"][arm]["per_seed"]
        for seed, h in zip(("3", "4"), histories, strict=True):
            seconds = sum(m.get("timing_s/rollout", 0) for m in h)
            assert per_seed[seed]["rollout_time_s"] == pytest.approx(seconds)
            assert per_seed[seed]["final_acc"] == finals[int(seed) - 3]
        vanilla_s = result["arms"]["vanilla"]["per_seed"]["3"]["rollout_time_s"]
        assert per_seed["3"]["rollout_speedup"] == pytest.approx(vanilla_s / per_seed["3"]["rollout_time_s"])  # fmt: skip
    # different seeds sample different responses
    assert histories[0][1]["response_length/mean"] != histories[1][1]["response_length/mean"]


def test_timings_of_a_disturbed_bench_are_flagged():
    """A busy machine at the start, a load beyond what the runs make, an arm's first epoch apart
    from vanilla's and an arm faster than its own limit are each named, the last two when they
    are beyond the noise of the arms' paired steps; a quiet bench within its limits gets no
    warning."""
    from specrl.bench_summary import timing_warnings

    quiet = {"start": [0.1, 0.5, 1.0], "vanilla seed 1": [2.0, 1.9, 1.5]}
    arms = {"vanilla": {"rollout_speedup": 1.0, "limit_speedup": 1.0, "response_tokens": 1000,
                        "epoch0_rollout_s": 100.0},
            "trie": {"rollout_speedup": 1.5, "limit_speedup": 1.6, "response_tokens": 1000,
                     "epoch0_rollout_s": 112.0},
            # above its limit only because its responses were shorter: per token within it
            "spec": {"rollout_speedup": 0.8, "limit_speedup": 0.72, "response_tokens": 900,
                     "epoch0_rollout_s": 95.0}}  # fmt: skip
    assert timing_warnings({"arms": arms}, quiet, 2) == []
    busy = {"start": [1.2, 0.5, 1.0], "trie seed 1": [3.5, 2.0, 1.5]}
    impossible = {
        **arms, "trie": {"rollout_speedup": 2.03, "limit_speedup": 1.79, "response_tokens": 1000,
                         "epoch0_rollout_s": 40.0}
    }  # fmt: skip
    warnings = timing_warnings({"arms": impossible}, busy, 2)
    assert len(warnings) == 4
    assert "busy when the bench started (load average 1.20 on 2 cores)" in warnings[0]
    assert "after trie seed 1" in warnings[1]
    assert (
        "trie arm's first epoch, the same work as vanilla's, took 40.0 s against 100.0 s"
        in (warnings[2])
    )
    assert (
        "trie arm's rollout speedup per response token 2.03 exceeds its limit 1.79" in warnings[3]
    )
    # the same differences with the standard errors of their paired steps: beyond two of them
    # they are named; within two, they are the steps' noise
    measured = {**impossible["trie"], "epoch0_log_ratio_se": 0.3, "rollout_speedup_se": 0.05}
    assert len(timing_warnings({"arms": {**arms, "trie": measured}}, quiet, 2)) == 2
    noisy = {**impossible["trie"], "epoch0_log_ratio_se": 0.5, "rollout_speedup_se": 0.2}
    assert timing_warnings({"arms": {**arms, "trie": noisy}}, quiet, 2) == []


def test_a_windows_speedup_comes_with_the_standard_error_of_its_paired_steps():
    """Steps paired in order: log ratios 0, ln 1.2, ln(1/1.2), 0 have a standard error of
    0.0744 around their mean; a window of one step has none."""
    from specrl.bench_summary import _windows, window_lines

    def steps(seconds):
        return [
            {"training/global_step": s + 1, "timing_s/rollout": t} for s, t in enumerate(seconds)
        ]

    windows = _windows(steps([10, 10, 12, 12, 5]), steps([10, 12, 10, 12, 6]), 4)
    assert windows[0]["rollout_speedup"] == 1.0
    assert windows[0]["rollout_speedup_se"] == pytest.approx(0.0744, abs=1e-4)
    assert windows[1]["rollout_speedup"] == 1.2 and windows[1]["rollout_speedup_se"] is None
    lines = window_lines({"arms": {"trie": {"windows": windows}}})
    assert "(1.00x ± 0.07)" in lines[0] and "(1.20x)" in lines[1]


def test_a_window_says_what_its_verification_cost():
    """10 s of rollouts, 3 s of them verifying (the prompts' 1 s of prefill inside, vanilla's
    0.5 s): free, the window would have taken 7.5 s against vanilla's 15 s: 2x, 1.5x measured.
    60 of 100 response tokens reachable, 40 reused."""
    from specrl.bench_summary import _windows, window_lines

    def step(rollout, verify, prefill, reused):
        return {"training/global_step": 1, "timing_s/rollout": rollout, "timing_s/verify": verify,
                "timing_s/forward/prefill": prefill, "spec/response_tokens": 100,
                "spec/reused_tokens": reused, "spec/trie/reachable_tokens": 60 if reused else 0}  # fmt: skip

    (window,) = _windows([step(10, 3, 0, 40)], [step(15, 0, 0.5, 0)], 8)
    assert window["rollout_speedup"] == 1.5 and window["verify_s"] == 3
    assert window["verify_free_speedup"] == pytest.approx(2.0)
    assert window["reused_token_ratio"] == 0.4 and window["reachable_token_ratio"] == 0.6
    assert "verification-free 2.00x" in window_lines({"arms": {"trie": {"windows": [window]}}})[0]


def test_a_window_of_graph_captures_says_its_speedup_without_them():
    """Steps 1-2: the arm spent 3 s of its 8 s capturing CUDA graphs, vanilla 1 s of 11 s: 1.38x
    measured, 2x with both captures taken out (paid once per shape in a longer run). Steps 3-4
    captured nothing in either arm: no such figure."""
    from specrl.bench_summary import _windows, window_lines

    def steps(pairs):
        return [
            {"training/global_step": s + 1, "timing_s/rollout": t, "timing_s/capture/decode": c}
            for s, (t, c) in enumerate(pairs)
        ]

    windows = _windows(
        steps([(5, 3), (3, 0), (2, 0), (2, 0)]), steps([(6, 1), (5, 0), (4, 0), (4, 0)]), 2
    )
    assert windows[0]["rollout_speedup"] == pytest.approx(11 / 8)
    assert windows[0]["capture_s"] == 3 and windows[0]["vanilla_capture_s"] == 1
    assert windows[0]["speedup_without_captures"] == pytest.approx(2.0)
    assert "speedup_without_captures" not in windows[1]
    lines = window_lines({"arms": {"trie": {"windows": windows}}})
    assert "graph captures 3.0 s (vanilla's 1.0 s): 2.00x without them" in lines[0]
    assert "captures" not in lines[1]


def learning_config(tiny_policy_dir, tmp_path, *overrides):
    """4 steps of the tiny policy with LoRA and a reward its samples vary in, so it learns; the
    verification budget, adaptive drafts and the fitted grouping of verification forwards decide
    from timings: off, so runs can repeat."""
    reward = tmp_path / "reward.py"
    reward.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return solution_str.count('7') / max(len(solution_str), 1)\n"
    )
    return small_config(
        tiny_policy_dir, tmp_path / "unused", "data.train_size=8", "trainer.total_training_steps=4",
        "trainer.save_freq=0", "trainer.test_freq=2", "rollout.spec.verify_budget=false",
        "rollout.spec.tree.adaptive=false", "rollout.verify_batching=slack", "actor.lora.rank=4",
        f"custom_reward_function.path={reward}", "actor.optim.lr=3e-3", *overrides,
    )  # fmt: skip


def test_interleaved_arms_train_as_they_do_one_after_another(tiny_policy_dir, tmp_path):
    # adapter dropout draws from the global generators, which each arm keeps its own of
    cfg = learning_config(tiny_policy_dir, tmp_path, "actor.lora.dropout=0.1")
    lines = []
    arms = ("vanilla", "spec", "trie")
    apart = run_bench(cfg, tmp_path / "apart", arms, log=lambda _: None, warmup_steps=0)
    turns = run_bench(cfg, tmp_path / "turns", arms, log=lines.append, warmup_steps=0,
                      interleave=True)  # fmt: skip
    assert turns["interleaved"] and not apart["interleaved"]
    assert sum(line.startswith("bench: step ") for line in lines) == 4
    assert "bench: step 2: rollouts trie" in "\n".join(lines)  # the last arm goes first
    keys = ("critic/score/mean", "response_length/mean", "actor/pg_loss", "actor/grad_norm",
            "spec/reused_tokens")  # fmt: skip
    for arm in arms:
        runs = [read_metrics(tmp_path / bench / arm)[1:] for bench in ("apart", "turns")]
        assert all(m["actor/grad_norm"] > 0 for m in runs[0])  # it learns
        assert [[m[k] for k in keys] for m in runs[0]] == [[m[k] for k in keys] for m in runs[1]]
    assert turns["arms"]["trie"]["reused_token_ratio"] > 0


def test_paired_arms_roll_out_the_vanilla_arms_policy(tiny_policy_dir, tmp_path):
    """`--paired`: after every update the speculative arms take the vanilla arm's weights, so
    the lenient spec arm, whose own updates would train another policy, evaluates and saves
    vanilla's; each step logs the share of an arm's responses that are vanilla's to the token."""
    from safetensors.torch import load_file

    cfg = learning_config(tiny_policy_dir, tmp_path, "rollout.spec.acceptance=specrl")
    arms = ("vanilla", "spec", "trie")
    lines = []
    result = run_bench(cfg, tmp_path / "paired", arms, log=lines.append, warmup_steps=0,
                       interleave=True, paired=True)  # fmt: skip
    assert result["paired"]
    runs = {arm: read_metrics(tmp_path / "paired" / arm) for arm in arms}
    held_out = {
        arm: [{k: v for k, v in m.items() if k.startswith("val/")} for m in runs[arm]]
        for arm in arms
    }
    held_out = {arm: [m for m in evaluations if m] for arm, evaluations in held_out.items()}
    assert len(held_out["vanilla"]) == 3  # before training, at steps 2 and 4
    for arm in ("spec", "trie"):
        assert held_out[arm] == held_out["vanilla"]
        assert "bench/identical_responses" not in runs["vanilla"][1]
    # the trie arm samples what vanilla does, token for token; the lenient rule keeps drafts
    # vanilla would not have sampled, in some step
    assert all(m["bench/identical_responses"] == 1.0 for m in runs["trie"][1:])
    assert min(m["bench/identical_responses"] for m in runs["spec"][1:]) < 1.0
    assert "responses identical to vanilla's 1.000" in "\n".join(lines)
    # the lenient arm's own updates differ (the rollouts they learn from do): it still saved
    # the vanilla arm's adapters
    losses = {
        arm: [m["actor/pg_loss"] for m in runs[arm][1:] if "actor/pg_loss" in m] for arm in arms
    }
    assert losses["spec"] != losses["vanilla"]
    saved = {
        arm: load_file(next((tmp_path / "paired" / arm).glob("checkpoints/global_step_4/*.safetensors")))
        for arm in arms
    }  # fmt: skip
    for arm in ("spec", "trie"):
        assert saved[arm].keys() == saved["vanilla"].keys()
        assert all(saved[arm][k].equal(saved["vanilla"][k]) for k in saved["vanilla"])


def test_pairing_arms_needs_them_interleaved_and_one_learner(tmp_path):
    cfg = load_config(None, [])
    with pytest.raises(UserError, match=r"--paired: .*add --interleave"):
        run_bench(cfg, tmp_path / "bench", paired=True, log=lambda _: None)
    two = load_config(None, ["trainer.n_gpus_per_node=2"])
    with pytest.raises(UserError, match="--paired: the update runs on 2 learner ranks"):
        run_bench(two, tmp_path / "bench", interleave=True, paired=True, log=lambda _: None)
    assert not (tmp_path / "bench").exists()


def test_interleaving_refuses_an_engine_the_arms_would_share(tmp_path):
    """vLLM's engine is one per process (`EngineKind.one_per_process`): arms taking turns in it
    would roll out with each other's weights. The bench says so before it builds anything."""
    cfg = load_config(None, ["rollout.name=vllm"])
    with pytest.raises(UserError, match="--interleave: the arms would take turns in one vllm"):
        run_bench(cfg, tmp_path / "bench", interleave=True, log=lambda _: None)
    assert not (tmp_path / "bench").exists()
