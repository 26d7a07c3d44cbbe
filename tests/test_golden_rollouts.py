"""Golden rollouts: fixed seeds give the same rollouts, bit for bit in the token ids and to 1e-5
(relative) in the sums of their logprobs, through refactors. Four arms over four training steps of the built-in task (two
epochs, so the second epoch verifies drafts from a policy two updates older); the width of tree
drafts is fixed (the adaptive one follows timings). A changed hash means a change of behaviour:
explain it in the commit that updates it. Float reductions depend on torch's thread count
and on the CPU's vector instructions (AVX2 and AVX-512 kernels differ in the last bits): the runs
use two threads (`trainer.num_threads=2`) on any machine, the token ids are hashed exactly and the
logprobs compared as sums with a tolerance (a hash of rounded logprobs changed with the CPU)."""

import hashlib

import pytest

from specrl.trainer import Trainer
from tests.conftest import read_metrics, save_tiny_policy, small_config

ARMS = {
    "vanilla": ["rollout.spec.enabled=false", "rollout.spec.tree.enabled=false"],
    "lenient": ["rollout.spec.enabled=true", "rollout.spec.acceptance=specrl",
                "rollout.spec.tree.enabled=false"],
    "exact": ["rollout.spec.enabled=true", "rollout.spec.acceptance=exact",
              "rollout.spec.reuse=slot", "rollout.spec.tree.enabled=false"],
    "lenient+tree": ["rollout.spec.enabled=true", "rollout.spec.acceptance=specrl",
                     "rollout.spec.tree.enabled=true", "rollout.spec.tree.adaptive=false",
                     "rollout.spec.tree.online=true"],
    "exact+tree": ["rollout.spec.enabled=true", "rollout.spec.acceptance=exact",
                   "rollout.spec.reuse=slot", "rollout.spec.tree.enabled=true",
                   "rollout.spec.tree.adaptive=false"],
    "trie": ["rollout.spec.enabled=true", "rollout.spec.acceptance=exact",
             "rollout.spec.reuse=trie", "rollout.spec.tree.enabled=false"],
    "trie+tree": ["rollout.spec.enabled=true", "rollout.spec.acceptance=exact",
                  "rollout.spec.reuse=trie", "rollout.spec.tree.enabled=true",
                  "rollout.spec.tree.adaptive=false"],
}  # fmt: skip
GOLDEN = {  # per arm: the hashes of the four steps' rollouts, their logprob sums
    "vanilla": ("5624125d7f5f0100-1bbcc8df2afddbe8-0cf498f3b2304caf-fea1a444c5ab09fd", [-120.356, -66.221, -57.603, -99.242]),
    "lenient": ("5624125d7f5f0100-1bbcc8df2afddbe8-1988264507606087-5d0490143337aa25", [-120.356, -66.221, -104.11, -184.993]),
    "exact": ("5624125d7f5f0100-1bbcc8df2afddbe8-bfa7e55d891903dd-61379b138e4313fb", [-120.356, -66.221, -55.185, -91.879]),
    "lenient+tree": ("5624125d7f5f0100-1bbcc8df2afddbe8-1988264507606087-5d0490143337aa25", [-120.356, -66.22, -104.108, -184.968]),
    "exact+tree": ("5624125d7f5f0100-1bbcc8df2afddbe8-bfa7e55d891903dd-61379b138e4313fb", [-120.356, -66.221, -55.185, -91.879]),
    # trie rollouts are vanilla's samples, token for token: the same training, the same hashes
    "trie": ("5624125d7f5f0100-1bbcc8df2afddbe8-0cf498f3b2304caf-fea1a444c5ab09fd", [-120.356, -66.221, -57.603, -99.242]),
    "trie+tree": ("5624125d7f5f0100-1bbcc8df2afddbe8-0cf498f3b2304caf-fea1a444c5ab09fd", [-120.356, -66.221, -57.603, -99.242]),
}  # fmt: skip


@pytest.fixture(scope="module")
def peaked_policy_dir(tmp_path_factory):
    """Peaked logits (initializer range 0.5): some draft tokens are accepted and some rejected
    under both rules."""
    return save_tiny_policy(tmp_path_factory.mktemp("peaked-policy"), initializer_range=0.5)


def rollout_digest(rollouts) -> tuple[str, float]:
    """(hash of what was sampled, the sum of every current and behaviour logprob)."""
    rows = [(r.prompt.prompt_id, r.slot, list(r.token_ids), r.finish_reason) for r in rollouts]
    logprobs = sum(sum(r.current_logprobs) + sum(r.behaviour_logprobs or ()) for r in rollouts)
    return hashlib.blake2b(repr(rows).encode(), digest_size=8).hexdigest(), logprobs


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
        assert sum(m["spec/decode_drafts/accepted_tokens"] for m in later) > 0
    hashes, logprobs = GOLDEN[arm]
    assert "-".join(d for d, _ in digests) == hashes
    assert [s for _, s in digests] == pytest.approx(logprobs, rel=1e-5)
