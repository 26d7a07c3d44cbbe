"""Training on episodes: every estimator, DAPO, a user's environment on a user's data, the CLI."""

import json

import pytest

from specrl.cli import main
from specrl.trainer import Trainer
from tests.conftest import read_metrics, small_config

ENV = """
class Environment:
    '''Two turns around the observation `7;`; the reward: the row's `bonus` column for the
    first turn, the count of 1s of the second.'''

    def reset(self, row):
        self.turns, self.bonus = 0, float(row.get("bonus", 0.0))

    def step(self, response):
        self.turns += 1
        if self.turns == 2:
            return "", response.count("1") / 4, True
        return "7;", self.bonus, False
"""


@pytest.fixture
def env_file(tmp_path):
    path = tmp_path / "env.py"
    path.write_text(ENV)
    return path


@pytest.mark.parametrize(
    "overrides",
    [
        ["algorithm.adv_estimator=grpo"],
        ["algorithm.adv_estimator=rloo"],
        ["algorithm.adv_estimator=reinforce_plus_plus"],
        ["algorithm.adv_estimator=gae", "critic.ppo_mini_batch_size=2"],
        ["algorithm.filter_groups.enable=true", "reward_model.overlong_buffer.enable=true"],
    ],
    ids=["grpo", "rloo", "reinforce_plus_plus", "gae", "dapo"],
)
def test_episodes_train_with_every_estimator(tiny_policy_dir, tmp_path, env_file, overrides):
    # every trie node verified: the budget decides from timings (a turn's few reachable tokens
    # may not pay for its pass)
    cfg = small_config(
        tiny_policy_dir, tmp_path / "run", f"env.path={env_file}", "data.max_response_length=16",
        "data.train_size=4", "rollout.spec.verify_budget=false", *overrides,
    )  # fmt: skip
    Trainer(cfg).fit()
    metrics = read_metrics(tmp_path / "run")
    step = metrics[-1]
    assert step["training/global_step"] == 2
    assert 1.0 < step["num_turns/mean"] <= 2.0
    assert step["episode/env_errors"] == 0
    assert sum(step[f"episode/finish/{r}"] for r in ("stop", "length", "max_turns")) == 1.0
    assert step["spec/turn_1/response_tokens"] > 0  # the same prompts again: drafts per turn
    assert step["spec/turn_0/reused_token_ratio"] > 0
    assert all(m["val/num_turns/mean"] >= 1.0 for m in metrics if "val/acc/mean@1" in m)
    for key in ("actor/pg_loss", "actor/entropy", "critic/score/mean"):
        assert key in step


def test_a_users_environment_sees_every_column_of_a_users_dataset(
    tiny_policy_dir, tmp_path, env_file
):
    rows = [{"prompt": f"{i}+{i}=", "answer": str(2 * i), "bonus": 1.0} for i in range(10, 18)]
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = small_config(
        tiny_policy_dir, tmp_path / "run", f"env.path={env_file}", f"data.train_files={data}",
        f"data.val_files={data}", "data.answer_key=answer", "trainer.total_training_steps=1",
    )  # fmt: skip
    Trainer(cfg).fit()
    step = read_metrics(tmp_path / "run")[-1]
    assert step["critic/score/min"] >= 1.0  # every episode got its row's bonus


def test_bad_environment_config_is_one_line_from_the_cli(tiny_policy_dir, tmp_path, capsys):
    base = [f"model.path={tiny_policy_dir}", f"trainer.output_dir={tmp_path / 'run'}"]
    assert main(["train", *base, f"env.path={tmp_path / 'missing.py'}"]) != 0
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "env.path" in err and "does not exist" in err
    assert main(["train", *base, "data.task=calculator", "rollout.num_workers=2"]) != 0
    assert "rollout.num_workers=0" in capsys.readouterr().err


def test_bench_reports_turns_and_reuse_per_turn(tiny_policy_dir, tmp_path, env_file):
    from specrl.bench import run_bench

    cfg = small_config(
        tiny_policy_dir, tmp_path / "unused", f"env.path={env_file}", "data.max_response_length=16",
        "data.train_size=4", "trainer.total_training_steps=3", "trainer.save_freq=0",
    )  # fmt: skip
    result = run_bench(cfg, tmp_path / "bench", ("vanilla", "spec"), log=lambda _: None)
    vanilla, spec = result["arms"]["vanilla"], result["arms"]["spec"]
    assert "reused_token_ratio_per_turn" not in vanilla and vanilla["num_turns_mean"] > 1.0
    per_turn = spec["reused_token_ratio_per_turn"]
    assert set(per_turn) == {0, 1} and per_turn[0] > 0  # steps 2 and 3 repeat the prompts
    assert 0 < vanilla["env_time_s"] < vanilla["rollout_time_s"]
