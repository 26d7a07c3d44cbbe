import math
import threading
import time

import pytest

from specrl.config import CustomRewardConfig
from specrl.engines.hf.engine import HFEngine
from specrl.evaluation import evaluate
from specrl.rewards import (
    RewardFunctionError,
    Scores,
    builtin_compute_score,
    load_reward_function,
    load_reward_functions,
)
from specrl.toy_policy import build_tokenizer
from specrl.types import Example, Prompt
from specrl.user_code import call_with_timeout
from tests.conftest import make_tiny_model

EXAMPLES = [Example("p", "42", "user/math"), Example("q", "7", "user/math")]


def test_builtin_dispatches_arithmetic_and_math_verify_and_states_accuracy():
    right, wrong = {"score": 1.0, "acc": 1.0}, {"score": 0.0, "acc": 0.0}
    assert builtin_compute_score("specrl/arithmetic", "1+2+0=3;#3", "3") == right
    assert (
        builtin_compute_score("openai/gsm8k", "so the answer is \\boxed{\\frac{1}{2}}", "0.5")
        == right
    )
    assert builtin_compute_score("openai/gsm8k", "so the answer is \\boxed{3}", "0.5") == wrong


def test_math_verify_runs_off_the_main_thread():
    result = {}
    thread = threading.Thread(
        target=lambda: result.update(v=builtin_compute_score("m", "\\boxed{42}", "42"))
    )
    thread.start()
    thread.join()
    assert result["v"]["score"] == 1.0


def test_verl_style_function_from_a_file(tmp_path):
    path = tmp_path / "reward.py"
    path.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return {'score': float(solution_str.strip() == ground_truth)}\n"
    )
    fn = load_reward_function(str(path), "compute_score", timeout_s=5)
    out = fn(["42", "8"], EXAMPLES, ["p", "q"])
    assert out.scores == [1.0, 0.0] and out.acc == [None, None]  # a score, no stated accuracy


def test_trl_style_function_gets_completions_and_columns(tmp_path):
    path = tmp_path / "reward.py"
    path.write_text(
        "def my_reward(completions, ground_truth, **kwargs):\n"
        "    return [float(c == g) + 0.5 * (kwargs['prompts'][i] == 'q') for i, (c, g) in enumerate(zip(completions, ground_truth))]\n"
    )
    fn = load_reward_function(str(path), "my_reward", timeout_s=5)
    assert fn.style == "trl"
    assert fn(["42", "7"], EXAMPLES, ["p", "q"]).scores == [1.0, 1.5]


def test_failing_calls_are_counted_not_silently_zero(tmp_path):
    path = tmp_path / "reward.py"
    path.write_text(
        "import time\n"
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    if solution_str == 'raise': raise RuntimeError('boom')\n"
        "    if solution_str == 'hang': time.sleep(30)\n"
        "    if solution_str == 'nan': return float('nan')\n"
        "    if solution_str == 'none': return None\n"
        "    return 1.0\n"
    )
    fn = load_reward_function(str(path), "compute_score", timeout_s=0.2)
    start = time.perf_counter()
    out = fn(["ok", "raise", "hang", "nan", "none"], [EXAMPLES[0]] * 5, ["p"] * 5)
    assert time.perf_counter() - start < 5
    assert out.scores == [1.0, 0.0, 0.0, 0.0, 0.0]
    assert out.errors == 4 and "boom" in out.first_error


def test_call_with_timeout_from_a_worker_thread():
    box = {}
    thread = threading.Thread(
        target=lambda: box.update(r=call_with_timeout(time.sleep, (10,), 0.1))
    )
    thread.start()
    thread.join(timeout=5)
    assert box["r"] == (None, "timed out after 0.1s")
    assert call_with_timeout(math.sqrt, (4.0,), 1.0) == (2.0, None)


def test_bad_reward_function_config(tmp_path):
    with pytest.raises(RewardFunctionError, match="does not exist"):
        load_reward_function(str(tmp_path / "missing.py"), "f", 1.0)
    path = tmp_path / "reward.py"
    path.write_text("def f(x, y):\n    return 0\n")
    with pytest.raises(RewardFunctionError, match="has no function 'g'"):
        load_reward_function(str(path), "g", 1.0)
    with pytest.raises(RewardFunctionError, match="like verl"):
        load_reward_function(str(path), "f", 1.0)


def test_a_reward_function_that_always_fails_stops_the_run_in_one_line(
    tiny_policy_dir, tmp_path, capsys
):
    from specrl.cli import main

    path = tmp_path / "reward.py"
    path.write_text("def compute_score(data_source, solution_str, ground_truth):\n    return 1.0\n")
    args = [f"model.path={tiny_policy_dir}", f"trainer.output_dir={tmp_path / 'run'}",
            f"custom_reward_function.path={path}", "data.train_size=8", "data.val_size=4",
            "data.train_batch_size=4", "rollout.n=2", "actor.ppo_mini_batch_size=2",
            "data.max_response_length=8", "trainer.val_before_train=false", "trainer.logger=[jsonl]"]  # fmt: skip
    assert main(["train", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(
        f"specrl: error: reward function {path}:compute_score"
    )
    assert "failed on 8 of 8 responses at step 1 (first: raised TypeError(" in err[0]
    assert "reward_model.max_error_ratio" in err[0]


def test_trl_functions_get_every_column_and_conversational_completions(tmp_path):
    """As TRL calls them: every dataset column by name; chat prompts give message completions."""
    path = tmp_path / "reward.py"
    path.write_text(
        "def exact(completions, solution, prompts, **kwargs):\n"
        "    return [float(c[0]['content'] == s) for c, s in zip(completions, solution)]\n"
        "def polite(completions, difficulty, **kwargs):\n"
        "    assert kwargs['prompts'][0] == [{'role': 'user', 'content': '1+1='}]\n"
        "    return [0.5 * d for d in difficulty]\n"
    )
    chat = [{"role": "user", "content": "1+1="}]
    examples = [
        Example(chat, "2", "t", columns={"solution": "2", "difficulty": 1}),
        Example(chat, "3", "t", columns={"solution": "3", "difficulty": 2}),
    ]
    functions = load_reward_functions(
        [CustomRewardConfig(path=str(path), name="exact", weight=2.0),
         CustomRewardConfig(path=str(path), name="polite", weight=1.0)],
        timeout_s=5,
    )  # fmt: skip
    out = functions(["2", "4"], examples, ["1+1=", "1+1="])
    assert out.errors == 0, out.first_error
    assert out.components == {"exact": [1.0, 0.0], "polite": [0.5, 1.0]}
    assert out.scores == [2.0 * 1.0 + 0.5, 2.0 * 0.0 + 1.0]


def test_accuracy_is_what_a_reward_states_never_a_weighted_score(tmp_path):
    """A correctness function stating `acc` and a length penalty, weighted: the score is their
    weighted sum (negative here), the accuracy the correctness function's alone; evaluation
    logs `val/acc/mean@1` only when the reward states it, `val/reward/mean@1` always."""
    path = tmp_path / "reward.py"
    path.write_text(
        "def correct(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    right = float(solution_str == ground_truth)\n"
        "    return {'score': right, 'acc': right}\n"
        "def strict(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    assert solution_str == ground_truth\n"
        "    return {'score': 1.0, 'acc': 1.0}\n"
        "def length(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return -float(len(solution_str))\n"
    )
    both = load_reward_functions(
        [CustomRewardConfig(path=str(path), name="correct", weight=0.1),
         CustomRewardConfig(path=str(path), name="length", weight=1.0)],
        timeout_s=5,
    )  # fmt: skip
    out = both(["42", "8"], EXAMPLES, ["p", "q"])
    assert out.scores == pytest.approx([0.1 - 2.0, -1.0]) and out.acc == [1.0, 0.0]
    alone = load_reward_functions(
        [CustomRewardConfig(path=str(path), name="length", weight=1.0)], timeout_s=5
    )
    assert alone(["42", "8"], EXAMPLES, ["p", "q"]).acc == [None, None]
    failing = load_reward_functions([CustomRewardConfig(path=str(path), name="strict")], 5)
    out = failing(["42", "8"], EXAMPLES, ["p", "q"])
    assert (out.acc, out.errors) == ([1.0, None], 1)  # a failed call states nothing ...
    scored = Scores(["42", "8"], out.scores, out.scores, out.acc)
    assert scored.stated_acc == [1.0, 0.0]  # ... and is wrong where the batch states accuracy
    assert Scores(["a"], [0.5], [0.5], [None]).stated_acc is None

    tokenizer = build_tokenizer()
    prompt = Prompt(tuple(tokenizer.encode("1+1=")), Example("1+1=", "2", "t"))
    engine = HFEngine(make_tiny_model(vocab_size=len(tokenizer)), [tokenizer.eos_token_id], 0)
    for functions, keys in [(both, {"val/acc/mean@1", "val/reward/mean@1"}),
                            (alone, {"val/reward/mean@1"})]:  # fmt: skip
        metrics = evaluate(engine, [prompt] * 2, functions, tokenizer, 2, 4, 0).metrics
        assert {k for k in metrics if k.startswith(("val/acc", "val/reward/"))} == keys
        assert metrics["val/reward/mean@1"] <= 0.1 and metrics.get("val/acc/mean@1", 0) >= 0
