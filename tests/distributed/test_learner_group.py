"""The actor (and the critic) on two learner ranks (Ray actors in a gloo group; marker `ray`,
skipped where ray is not installed): a run trains as on one, resumes with any number of ranks,
next to rollout workers, and stops with a message when a rank dies or the local Ray is too
small."""

from __future__ import annotations

import pytest

pytest.importorskip("ray", reason="ray is not installed (pip install 'specrl[ray]')")

from specrl.config import RayInitConfig
from specrl.distributed.learner import LearnerGroupError
from specrl.distributed.ray_cluster import require_cpus, start_ray
from specrl.errors import UserError
from specrl.lora import state_bytes
from specrl.models import load_policy
from specrl.trainer import Trainer
from tests.conftest import read_metrics, small_config

pytestmark = pytest.mark.ray

KEYS = ("critic/score/mean", "response_length/mean", "val/acc/mean@1", "actor/pg_loss",
        "actor/grad_norm", "actor/entropy")  # fmt: skip
COMMON = ["trainer.total_training_steps=4", "trainer.save_freq=2", "trainer.test_freq=2"]


@pytest.fixture(scope="module")
def ray_cluster():
    import ray

    start_ray(RayInitConfig(num_cpus=4))  # two learner ranks and two rollout workers
    yield ray
    ray.shutdown()


def _run(policy_dir, out, *overrides) -> list[dict]:
    Trainer(small_config(policy_dir, out, *COMMON, *overrides)).fit()
    return read_metrics(out)


def _assert_same(a: list[dict], b: list[dict]) -> None:
    assert [m["training/global_step"] for m in a] == [m["training/global_step"] for m in b]
    for x, y in zip(a, b, strict=True):
        for key in KEYS:
            if key in x:
                assert y[key] == pytest.approx(x[key], rel=1e-3, abs=1e-4), key


def test_two_ranks_train_as_one_and_resume_with_any_number(ray_cluster, tiny_policy_dir, tmp_path):
    one = _run(tiny_policy_dir, tmp_path / "one", "actor.num_workers=1")
    two = _run(tiny_policy_dir, tmp_path / "two", "actor.num_workers=2")
    _assert_same(one, two)
    checkpoint = tmp_path / "two" / "checkpoints" / "global_step_2"
    for ranks in (1, 2):
        out = tmp_path / f"resumed-{ranks}"
        resumed = _run(tiny_policy_dir, out, f"actor.num_workers={ranks}",
                       f"trainer.resume_mode={checkpoint}")  # fmt: skip
        _assert_same([m for m in two if m["training/global_step"] > 2], resumed)


def test_a_critic_on_two_ranks_trains_as_on_one(ray_cluster, tiny_policy_dir, tmp_path):
    gae = [
        "algorithm.adv_estimator=gae",
        "critic.ppo_mini_batch_size=2",
        "trainer.total_training_steps=3",
    ]
    one = _run(tiny_policy_dir, tmp_path / "one", *gae)
    two = _run(tiny_policy_dir, tmp_path / "two", "actor.num_workers=2", *gae)
    _assert_same(one, two)
    for a, b in zip(one[1:], two[1:], strict=True):
        for key in ("critic/vf_loss", "critic/values/mean", "critic/grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=1e-3, abs=1e-5), key


def test_fsdp2_ranks_next_to_rollout_workers(ray_cluster, tiny_policy_dir, tmp_path):
    """Speculative training (the default: exact rule, history tries) on two rollout workers and
    two FSDP2 learner ranks: every step's metrics and the held-out accuracy are the
    one-process run's."""
    one = _run(tiny_policy_dir, tmp_path / "one", "actor.num_workers=1")
    both = _run(tiny_policy_dir, tmp_path / "both", "actor.num_workers=2",
                "actor.strategy=fsdp2", "rollout.num_workers=2")  # fmt: skip
    _assert_same(one, both)
    assert all(m["rollout/num_workers"] == 2 for m in both if "rollout/num_workers" in m)


LORA = ["actor.lora.rank=4", "actor.optim.lr=1e-2", "actor.entropy_coeff=0.01",
        "actor.use_kl_loss=true", "trainer.total_training_steps=2"]  # fmt: skip


@pytest.fixture(scope="module")
def lora_in_one_process(tiny_policy_dir, tmp_path_factory):
    return _run(tiny_policy_dir, tmp_path_factory.mktemp("lora-one"), *LORA)


def test_lora_with_ddp_ranks_and_two_workers_trains_as_in_one_process(
    ray_cluster, lora_in_one_process, tiny_policy_dir, tmp_path
):
    """LoRA adapters trained with DDP on two ranks and sent alone to two rollout workers (which
    carry the same adapters on their base copy): every step as in one process."""
    one = lora_in_one_process
    both = _run(tiny_policy_dir, tmp_path / "both", *LORA, "actor.num_workers=2",
                "rollout.num_workers=2")  # fmt: skip
    _assert_same(one, both)
    assert one[-1]["actor/grad_norm"] > 0 and one[-1]["actor/kl_loss"] > 0
    full = state_bytes(load_policy(tiny_policy_dir, "float32")[0].state_dict())
    assert 0 < both[-1]["sync/weight_bytes"] < full / 4
    assert one[-1]["sync/weight_bytes"] == 0  # in-process: the engine holds the model


def test_lora_with_fsdp2_ranks_trains_as_in_one_process(
    ray_cluster, lora_in_one_process, tiny_policy_dir, tmp_path
):
    fsdp = _run(tiny_policy_dir, tmp_path / "fsdp", *LORA, "actor.num_workers=2",
                "actor.strategy=fsdp2")  # fmt: skip
    _assert_same(lora_in_one_process, fsdp)


def test_a_dead_rank_stops_the_run_with_a_message(ray_cluster, tiny_policy_dir, tmp_path):
    cfg = small_config(tiny_policy_dir, tmp_path, "actor.num_workers=2")
    trainer = Trainer(cfg)
    ray_cluster.kill(trainer.run.actor.ranks[1], no_restart=True)
    with pytest.raises(LearnerGroupError, match="resume from the last checkpoint"):
        trainer.fit()


def test_more_actors_than_the_local_ray_has_cpus_is_an_error(
    ray_cluster, tiny_policy_dir, tmp_path
):
    cfg = small_config(tiny_policy_dir, tmp_path, "actor.num_workers=3", "rollout.num_workers=2")
    with pytest.raises(UserError, match=r"ray_kwargs\.ray_init\.num_cpus=5"):
        require_cpus(ray_cluster, cfg)
