"""Golden rollouts: fixed seeds give the same rollouts, bit for bit in the token ids and to 1e-4
in the logprobs, through refactors. Four arms over four training steps of the built-in task (two
epochs, so the second epoch verifies drafts from a policy two updates older); the width of tree
drafts is fixed (the adaptive one follows timings). A changed hash means a change of behaviour:
explain it in the commit that updates it."""

import hashlib

import pytest

from specrl.trainer import Trainer
from tests.conftest import small_config

ARMS = {
    "vanilla": ["rollout.spec.enabled=false", "rollout.spec.tree.enabled=false"],
    "lenient": ["rollout.spec.enabled=true", "rollout.spec.acceptance=specrl",
                "rollout.spec.tree.enabled=false"],
    "exact": ["rollout.spec.enabled=true", "rollout.spec.acceptance=exact",
              "rollout.spec.tree.enabled=false"],
    "lenient+tree": ["rollout.spec.enabled=true", "rollout.spec.acceptance=specrl",
                     "rollout.spec.tree.enabled=true", "rollout.spec.tree.adaptive=false",
                     "rollout.spec.tree.online=true"],
}  # fmt: skip
GOLDEN = {
    "vanilla": "f819a39499b94674-edd19a04a4339424-198998b500f2dd4d-10dab3003ab940fe",
    "lenient": "f819a39499b94674-edd19a04a4339424-ab179627960d04fd-82a582765c498215",
    "exact": "f819a39499b94674-edd19a04a4339424-41120fcb4022da24-3bcb124a7d4c9a1e",
    "lenient+tree": "f819a39499b94674-edd19a04a4339424-ab179627960d04fd-82a582765c498215",
}


def rollout_digest(rollouts) -> str:
    rows = [
        (
            r.prompt.prompt_id,
            r.slot,
            list(r.token_ids),
            [round(x, 4) for x in r.logprobs],
            None if r.behaviour_logprobs is None else [round(x, 4) for x in r.behaviour_logprobs],
            r.finish_reason,
        )
        for r in rollouts
    ]
    return hashlib.blake2b(repr(rows).encode(), digest_size=8).hexdigest()


def run_digests(policy_dir, out_dir, overrides) -> list[str]:
    # micro-batch = mini-batch (8 sequences): the loss does not depend on how a mini-batch is split
    cfg = small_config(
        policy_dir, out_dir, "data.train_size=8", "trainer.total_training_steps=4",
        "trainer.save_freq=0", "trainer.test_freq=0", "trainer.val_before_train=false",
        "actor.ppo_micro_batch_size=8", "actor.optim.lr=0.01", *overrides,
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
def test_rollouts_match_the_golden_hashes(tiny_policy_dir, tmp_path, arm):
    digests = run_digests(tiny_policy_dir, tmp_path, ARMS[arm])
    assert "-".join(digests) == GOLDEN[arm]
