import math

import pytest
import torch

from specrl.trainer import Trainer
from tests.conftest import read_metrics, small_config

REQUIRED_METRICS = [
    "training/global_step", "critic/score/mean", "response_length/mean", "actor/pg_loss", "actor/entropy",
    "actor/ppo_kl", "actor/pg_clipfrac", "actor/grad_norm", "timing_s/gen", "timing_s/update_actor",
    "timing_s/step", "perf/throughput",
]  # fmt: skip


def test_run_writes_config_metrics_and_checkpoints(tiny_policy_dir, tmp_path):
    Trainer(small_config(tiny_policy_dir, tmp_path)).fit()
    assert (tmp_path / "config.yaml").is_file()
    metrics = read_metrics(tmp_path)
    assert [m["training/global_step"] for m in metrics] == [0, 1, 2]
    assert "val/acc/mean@1" in metrics[0]
    for step in metrics[1:]:
        for key in [*REQUIRED_METRICS, "val/acc/mean@1"]:
            assert math.isfinite(step[key]), key
    for s in (1, 2):
        ckpt = tmp_path / "checkpoints" / f"global_step_{s}"
        assert (ckpt / "config.json").is_file() and (ckpt / "tokenizer.json").is_file()
        state = torch.load(ckpt / "trainer_state.pt", weights_only=False)
        assert state["global_step"] == s and {"actor", "loader", "stage", "rng"} <= state.keys()
        assert {"optimizer", "scheduler"} == state["actor"].keys()


def test_same_seed_same_metrics(tiny_policy_dir, tmp_path):
    """Every metric but timings; what the trie budget verifies (and so what is reused, and the
    forwards), how the engine groups verification forwards and how many draft tokens a decode
    forward verifies follow timings too: all three are fixed here. The rollouts are the same
    tokens either way (tests/speculative/test_trie.py, tests/engines/test_batching.py)."""
    runs = []
    for name in ("a", "b"):
        overrides = (
            "trainer.save_freq=0", "rollout.spec.verify_budget=false",
            "rollout.verify_batching=slack", "rollout.spec.tree.adaptive=false",
        )  # fmt: skip
        Trainer(small_config(tiny_policy_dir, tmp_path / name, *overrides)).fit()
        runs.append(
            [
                {k: v for k, v in m.items() if not k.startswith(("timing_s/", "perf/throughput"))}
                for m in read_metrics(tmp_path / name)
            ]
        )
    assert runs[0] == runs[1]
    Trainer(
        small_config(tiny_policy_dir, tmp_path / "c", "trainer.save_freq=0", "trainer.seed=2")
    ).fit()
    other = read_metrics(tmp_path / "c")[1]
    assert other["response_length/mean"] != runs[0][1]["response_length/mean"]


@pytest.mark.parametrize(
    "overrides",
    [
        ["algorithm.adv_estimator=rloo"],
        ["algorithm.norm_adv_by_std_in_grpo=false", "actor.loss_agg_mode=seq-mean-token-sum-norm"],
        ["actor.use_kl_loss=true", "actor.kl_loss_type=k2", "actor.ppo_epochs=2"],
        [
            "algorithm.filter_groups.enable=true",
            "reward_model.overlong_buffer.enable=true",
            "reward_model.overlong_buffer.len=4",
        ],
        ["rollout.top_p=0.9", "rollout.top_k=5", "rollout.temperature=0.8"],
        ["algorithm.adv_estimator=reinforce_plus_plus", "algorithm.gamma=0.99"],
        ["algorithm.adv_estimator=reinforce_plus_plus_baseline", "actor.use_kl_loss=true"],
        ["actor.policy_loss.loss_mode=gspo"],
        ["algorithm.adv_estimator=gae", "algorithm.lam=0.95", "critic.ppo_mini_batch_size=2"],
    ],
    ids=[
        "rloo",
        "dr_grpo",
        "kl",
        "dapo",
        "top_p_k",
        "reinforce_pp",
        "reinforce_pp_baseline",
        "gspo",
        "gae",
    ],
)
def test_algorithm_variants_train(tiny_policy_dir, tmp_path, overrides):
    Trainer(
        small_config(
            tiny_policy_dir,
            tmp_path,
            "trainer.total_training_steps=1",
            "trainer.save_freq=0",
            *overrides,
        )
    ).fit()
    (step,) = read_metrics(tmp_path)[1:]
    assert all(math.isfinite(step[k]) for k in REQUIRED_METRICS)
    if "actor.use_kl_loss=true" in overrides:
        assert step["actor/kl_loss"] >= 0
    if "algorithm.filter_groups.enable=true" in overrides:
        assert 1 <= step["train/num_gen_batches"] <= 4
    if "algorithm.adv_estimator=gae" in overrides:
        critic = ("vf_loss", "vf_clipfrac", "vpred_mean", "values/mean", "returns/mean",
                  "vf_explained_var", "grad_norm")  # fmt: skip
        assert all(math.isfinite(step[f"critic/{k}"]) for k in critic)


def test_ppo_update_moves_the_policy_toward_higher_advantage(tiny_policy_dir, tmp_path):
    """Reward = response is exactly 'the token 7' repeated: after a few steps its logprob rises."""
    reward = tmp_path / "reward.py"
    reward.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return solution_str.count('7') / max(len(solution_str), 1)\n"
    )
    cfg = small_config(
        tiny_policy_dir, tmp_path / "run", f"custom_reward_function.path={reward}", "trainer.total_training_steps=6",
        "trainer.save_freq=0", "trainer.test_freq=0", "actor.optim.lr=3e-3", "actor.optim.lr_warmup_steps=0",
    )  # fmt: skip
    Trainer(cfg).fit()
    records = read_metrics(tmp_path / "run")
    assert not [k for m in records[1:] for k in m if k.startswith("val")]  # test_freq=0: never
    steps = records[1:]
    scores = [m["critic/score/mean"] for m in steps]
    assert scores[-1] > scores[0]
    assert [m["reward/compute_score/mean"] for m in steps] == pytest.approx(scores)


@pytest.mark.parametrize(
    ("spec", "tree"),
    [(False, False), (True, False), (False, True)],
    ids=["vanilla", "spec", "tree"],
)
def test_rollout_logprobs_handed_to_the_trainer_equal_recomputed_old_logprobs(
    tiny_policy_dir, tmp_path, spec, tree
):
    from specrl.actor.batch import TrainBatch

    cfg = small_config(
        tiny_policy_dir,
        tmp_path,
        "data.train_size=4",
        f"rollout.spec.enabled={spec}",
        "rollout.spec.acceptance=specrl",
        "rollout.spec.log_lenience=.inf",
        f"rollout.spec.tree.enabled={tree}",
        "rollout.spec.tree.adaptive=false",
        "rollout.spec.verify_budget=false",  # drafts verified whole: the budget decides from timings
    )
    trainer = Trainer(cfg)
    assert trainer.run.rollout_logprobs_are_old_logprobs
    for step in (1, 2):  # with train_size = batch size, step 2 rolls out the same prompts again
        trainer.run.global_step = step
        metrics = {}
        rollouts, _ = trainer.collect_rollouts(metrics)
        batch = TrainBatch.collate(rollouts, trainer.run.tokenizer.pad_token_id)
        with torch.no_grad():
            recomputed = trainer.run.actor.logprobs(batch) * batch.response_mask
        handed = batch.pad_responses([r.current_logprobs for r in rollouts])
        assert torch.allclose(handed, recomputed, atol=1e-4)
    assert metrics.get("spec/reused_token_ratio", 0.0) == (1.0 if spec else 0.0)
    if tree:  # some of the handed logprobs come from multi-token verification forwards
        assert metrics["spec/decode_drafts/accepted_tokens"] > 0


def test_speculative_training_reuses_drafts_from_the_second_epoch(tiny_policy_dir, tmp_path):
    cfg = small_config(
        tiny_policy_dir,
        tmp_path,
        "data.train_size=8",
        "trainer.total_training_steps=4",
        "rollout.spec.acceptance=specrl",
        "rollout.spec.verify_budget=false",  # drafts verified: the budget decides from timings
    )
    Trainer(cfg).fit()
    steps = read_metrics(tmp_path)[1:]
    assert [m["training/epoch"] for m in steps] == [0, 0, 1, 1]
    assert steps[0]["spec/draft_ratio"] == steps[1]["spec/draft_ratio"] == 0
    assert steps[2]["spec/draft_ratio"] == steps[3]["spec/draft_ratio"] == 1
    assert steps[2]["spec/verified_tokens"] > 0 and "timing_s/verify" in steps[2]
    # rollout_is auto, decided by the rollouts: sampled plainly (epoch 0) they carry no behaviour
    # logprobs and nothing is weighed; drafted, they carry them and are weighed by p/q
    assert "rollout_corr/rollout_is_mean" not in steps[0]
    assert 0 < steps[2]["rollout_corr/rollout_is_mean"] != 1.0
    state = torch.load(
        tmp_path / "checkpoints" / "global_step_4" / "trainer_state.pt", weights_only=False
    )
    assert len(state["stage"]["store"]["prompt_ids"]) == 8 * 4  # every (prompt id, slot) is saved


def test_data_reward_and_environment_are_checked_before_any_model_loads(tmp_path, capsys):
    """With a model path that cannot load, a bad data line, a missing reward function, a
    missing environment or an absent GPU is still what the one-line error names: they are
    checked first."""
    from specrl.cli import main

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "1+1=", "answer": "2"}\nnot json\n')
    good = tmp_path / "good.jsonl"
    good.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    base = ["model.path=/nonexistent/model", f"trainer.output_dir={tmp_path / 'run'}",
            "data.answer_key=answer", "trainer.logger=[jsonl]"]  # fmt: skip
    cases = [
        ([f"data.train_files={bad}", f"data.val_files={good}"], f"{bad} line 2 is not valid JSON"),
        ([f"data.train_files={good}", f"data.val_files={good}",
          f"custom_reward_function.path={tmp_path / 'none.py'}"], "none.py"),
        ([f"data.train_files={good}", f"data.val_files={good}",
          f"env.path={tmp_path / 'no_env.py'}"], "no_env.py"),
    ]  # fmt: skip
    if not torch.cuda.is_available():  # a GPU asked for where there is none
        cases.append((["trainer.n_gpus_per_node=1"], "trainer.n_gpus_per_node=1 trains on a GPU"))
    for overrides, named in cases:
        assert main(["train", *base, *overrides]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and named in err[0] and "/nonexistent/model" not in err[0], err


def test_plain_text_for_a_chat_model_and_a_run_without_signal_are_said(tiny_policy_dir, tmp_path):
    """A new user's own data on a chat model: plain-text prompts are rendered through the chat
    template, with a note at load; a reward that never differs within a group (here always 0)
    gets one warning naming the likely causes, not one per step."""
    import io
    import shutil

    from rich.console import Console
    from transformers import AutoTokenizer

    from specrl.tracking import Tracker

    chat = tmp_path / "chat-policy"
    shutil.copytree(tiny_policy_dir, chat)
    tokenizer = AutoTokenizer.from_pretrained(chat)
    tokenizer.chat_template = "{% for m in messages %}##{{ m['content'] }}{% endfor %};"
    tokenizer.save_pretrained(chat)
    data = tmp_path / "problems.jsonl"
    data.write_text("".join(f'{{"prompt": "{a}+{b}=", "answer": "{a + b}"}}\n' for a in range(4) for b in range(2)))  # fmt: skip
    reward = tmp_path / "reward.py"
    reward.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.0\n")  # fmt: skip
    cfg = small_config(
        chat, tmp_path / "run", f"data.train_files={data}", f"data.val_files={data}",
        "data.answer_key=answer", f"custom_reward_function.path={reward}", "trainer.test_freq=0",
        "trainer.total_training_steps=4", "trainer.logger=[console,jsonl]", "trainer.val_before_train=false",
    )  # fmt: skip
    out = io.StringIO()
    trainer = Trainer(cfg, Tracker(cfg.trainer.logger, cfg.trainer.run_dir, Console(file=out, width=400)))  # fmt: skip
    assert (
        "8 train and 8 val plain-text prompts are rendered through the model's chat template"
        in out.getvalue()
    )
    assert trainer.run.loader.prompts[0].ids[:2] == tuple(tokenizer.encode("##", add_special_tokens=False))  # fmt: skip
    trainer.fit()
    said = out.getvalue()
    assert said.count("every advantage is 0") == 1 and "steps 1-3: every group's scores were equal (scores 0.0)" in said  # fmt: skip
    assert "data.apply_chat_template" in said and "data.answer_key" in said
