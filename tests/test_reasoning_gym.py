"""reasoning-gym tasks as verl-schema parquet, scored by the task's own scorer."""

import pytest

from specrl.data import DataError
from specrl.data.reasoning_gym import extract_answer, write_task
from specrl.rewards import builtin_compute_score

pytest.importorskip("reasoning_gym", reason="reasoning-gym is not installed (specrl[dev])")


@pytest.fixture(scope="module")
def chain_sum(tmp_path_factory):
    out = tmp_path_factory.mktemp("chain_sum")
    return write_task("chain_sum", out, 64, 16, 3, ["min_terms=2", "max_terms=2", "max_digits=2"])


def test_a_task_is_written_as_disjoint_seeded_splits_in_verls_schema(chain_sum, tmp_path):
    import pyarrow.parquet as pq

    train, val = (pq.read_table(p).to_pylist() for p in chain_sum)
    assert (len(train), len(val)) == (64, 16)
    row = train[0]
    assert row["data_source"] == "reasoning_gym/chain_sum"
    assert [m["role"] for m in row["prompt"]] == ["system", "user"]
    assert "<answer>" in row["prompt"][0]["content"]
    assert row["prompt"][1]["content"].startswith("State the final answer")
    assert not {r["prompt"][1]["content"] for r in train} & {r["prompt"][1]["content"] for r in val}
    again = write_task(
        "chain_sum", tmp_path, 64, 16, 3, ["min_terms=2", "max_terms=2", "max_digits=2"]
    )
    assert [pq.read_table(p).to_pylist() for p in again] == [train, val]  # seeded


def test_the_built_in_reward_is_the_tasks_scorer_on_the_extracted_answer(chain_sum):
    import pyarrow.parquet as pq

    row = pq.read_table(chain_sum[0]).to_pylist()[0]
    source, truth, extra = (
        row["data_source"],
        row["reward_model"]["ground_truth"],
        row["extra_info"],
    )
    right, wrong = {"score": 1.0, "acc": 1.0}, {"score": 0.0, "acc": 0.0}
    assert builtin_compute_score(source, f"<answer>{truth}</answer>", truth, extra) == right
    assert builtin_compute_score(source, f"so it is {truth}.", truth, extra) == right
    assert (
        builtin_compute_score(source, f"<answer>{int(truth) + 1}</answer>", truth, extra) == wrong
    )
    assert builtin_compute_score(source, "no idea", truth, extra) == wrong
    assert extract_answer("a\n<answer> 7 </answer> then <answer>8</answer>", "8") == "8"
    assert extract_answer("first line\nlast line ", "cat") == "last line"


def test_bad_tasks_and_options_are_one_line(tmp_path):
    with pytest.raises(DataError, match=r"reasoning-gym has no task 'chain_sums'.*chain_sum"):
        write_task("chain_sums", tmp_path, 8, 4, 1)
    with pytest.raises(DataError, match="option 'terms=2' is not key=value with a key among"):
        write_task("chain_sum", tmp_path, 8, 4, 1, ["terms=2"])
    with pytest.raises(DataError, match="its generator refused"):
        write_task("chain_sum", tmp_path, 8, 4, 1, ["min_terms=3", "max_terms=2"])
