"""Golden rollouts: fixed seeds give the same rollouts, bit for bit in the token ids and to 1e-4
in the logprobs, through refactors. Four arms over four training steps of the built-in task (two
epochs, so the second epoch verifies drafts from a policy two updates older); the width of tree
drafts is fixed (the adaptive one follows timings). A changed hash means a change of behaviour:
explain it in the commit that updates it. Float reductions depend on torch's thread count:
the runs use two threads (`trainer.num_threads=2`) on any machine."""

import hashlib

import pytest

from specrl.trainer import Trainer
from tests.conftest import read_metrics, save_tiny_policy, small_config

ARMS = {
    "vanilla": ["rollout.spec.enabled=false", "rollout.spec.tree.enabled=false"],
    "lenient": ["rollout.spec.enabled=true", "rollout.spec.acceptance=specrl",
                "rollout.spec.tree.enabled=false"],
    "exact": ["rollout.spec.enabled=true", "rollout.spec.acceptance=exact",
              "rollout.spec.tree.enabled=false"],
    "lenient+tree": ["rollout.spec.enabled=true", "rollout.spec.acceptance=specrl",
                     "rollout.spec.tree.enabled=true", "rollout.spec.tree.adaptive=false",
                     "rollout.spec.tree.online=true"],
    "exact+tree": ["rollout.spec.enabled=true", "rollout.spec.acceptance=exact",
                   "rollout.spec.tree.enabled=true", "rollout.spec.tree.adaptive=false"],
}  # fmt: skip
GOLDEN = {
    "vanilla": "a62e9b75d598c860-3d00d30aac8c9967-3393454309e318bf-e1e781a505a3c43e",
    "lenient": "a62e9b75d598c860-3d00d30aac8c9967-6fd1a136dc6c73c3-33cb6e0622200667",
    "exact": "a62e9b75d598c860-3d00d30aac8c9967-188b38add7fbe358-f1942f44abfec254",
    "lenient+tree": "a62e9b75d598c860-9fd2b7fa5669e908-d4beb8e2f80c7df1-2ced77796d6b8da8",
    "exact+tree": "a62e9b75d598c860-3d00d30aac8c9967-94925c571404aa85-38b4b8a9b50fc557",
}


@pytest.fixture(scope="module")
def peaked_policy_dir(tmp_path_factory):
    """Peaked logits (initializer range 0.5): some draft tokens are accepted and some rejected
    under both rules."""
    return save_tiny_policy(tmp_path_factory.mktemp("peaked-policy"), initializer_range=0.5)


def rollout_digest(rollouts) -> str:
    rows = [
        (
            r.prompt.prompt_id,
            r.slot,
            list(r.token_ids),
            [round(x, 4) for x in r.current_logprobs],
            None if r.behaviour_logprobs is None else [round(x, 4) for x in r.behaviour_logprobs],
            r.finish_reason,
        )
        for r in rollouts
    ]
    return hashlib.blake2b(repr(rows).encode(), digest_size=8).hexdigest()


REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return solution_str.count("1") / 4  # a signal a random policy finds: its updates move it
"""


def run_digests(policy_dir, out_dir, overrides) -> list[str]:
    reward = out_dir / "reward.py"
    reward.parent.mkdir(parents=True, exist_ok=True)
    reward.write_text(REWARD)
    # micro-batch = mini-batch (8 sequences): the loss does not depend on how a mini-batch is split
    cfg = small_config(
        policy_dir, out_dir, f"custom_reward_function.path={reward}", "data.train_size=8", "trainer.total_training_steps=4",
        "trainer.save_freq=0", "trainer.test_freq=0", "trainer.val_before_train=false",
        "actor.ppo_micro_batch_size=8", "actor.optim.lr=0.01", "trainer.num_threads=2", *overrides,
    )  # fmt: skip
    trainer = Trainer(cfg)
    digests = []
    collect = trainer.collect_rollouts

    def recording(metrics):
        rollouts, scores = collect(metrics)
        digests.append(rollout_digest(rollouts))
        return rollouts, scores

    trainer.collect_rollouts = recording
    trainer.fit()
    return digests


@pytest.mark.parametrize("arm", list(ARMS))
def test_rollouts_match_the_golden_hashes(peaked_policy_dir, tmp_path, arm):
    digests = run_digests(peaked_policy_dir, tmp_path, ARMS[arm])
    later = read_metrics(tmp_path)[2:]  # epoch 2: drafts partly accepted, tree drafts tried
    if arm != "vanilla":
        assert all(m["spec/reused_tokens"] > 0 and m["spec/decoded_tokens"] > 0 for m in later)
    if "tree" in arm:
        assert sum(m["spec/tree/accepted_tokens"] for m in later) > 0
    assert "-".join(digests) == GOLDEN[arm]
