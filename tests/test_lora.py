"""LoRA (`actor.lora.rank` > 0, through peft): fresh adapters change nothing, an update changes
only them, checkpoints hold them alone and resume exactly, the KL reference is the base model,
and `specrl export` writes a merged model that `from_pretrained` loads."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from specrl.actor.batch import TrainBatch
from specrl.checkpoint import load_trainer_state
from specrl.cli import main
from specrl.lora import BaseModelError, base_identity, check_base, merged_state, peft_model
from specrl.trainer import Trainer
from tests.conftest import read_metrics, save_tiny_policy, small_config
from tests.test_resume import SPEC, comparable

# an entropy bonus: the tiny random policy scores 0 everywhere, and its updates would be zero
LORA = [
    "actor.lora.rank=4",
    "actor.lora.alpha=8",
    "actor.optim.lr=1e-2",
    "actor.entropy_coeff=0.01",
]


def _rollouts(trainer: Trainer, step: int = 1):
    prompts = trainer.run.loader.next_batch()
    rollouts, _ = trainer.run.rollouts(prompts, trainer.run.cfg.rollout.n, (0, step, 0), step)
    return rollouts


def _frozen(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}


def test_fresh_adapters_sample_and_score_as_the_base_model(tiny_policy_dir, tmp_path):
    """B = 0 at initialisation: step 0's rollouts and logprobs are the base model's, token for
    token, and the reference (adapters disabled) agrees. The draft width is fixed: chosen from
    timings, it would give the two runs' forwards different shapes (logprobs equal to rounding)."""
    fixed = "rollout.spec.tree.adaptive=false"
    base = Trainer(small_config(tiny_policy_dir, tmp_path / "base", fixed))
    lora = Trainer(
        small_config(tiny_policy_dir, tmp_path / "lora", fixed, *LORA, "actor.use_kl_loss=true")
    )
    assert peft_model(lora.run.actor.policy) is not None and lora.run.actor.reference is None
    a, b = _rollouts(base), _rollouts(lora)
    assert [r.token_ids for r in a] == [r.token_ids for r in b]
    for x, y in zip(a, b, strict=True):
        assert torch.equal(torch.as_tensor(x.current_logprobs), torch.as_tensor(y.current_logprobs))
    batch = TrainBatch.collate(b, lora.run.tokenizer.pad_token_id)
    policy = lora.run.actor.logprobs(batch)
    assert torch.equal(policy, base.run.actor.logprobs(batch))
    assert torch.equal(lora.run.actor.logprobs(batch, reference=True), policy)


def test_an_update_changes_only_the_adapters_and_the_reference_stays_the_base(
    tiny_policy_dir, tmp_path
):
    trainer = Trainer(
        small_config(
            tiny_policy_dir, tmp_path, *LORA, "actor.use_kl_loss=true",
            "actor.gradient_checkpointing=true",
        )
    )  # fmt: skip
    policy = trainer.run.actor.policy
    frozen = _frozen(policy)
    adapters = {n: p.detach().clone() for n, p in policy.named_parameters() if p.requires_grad}
    assert adapters and all(".lora_" in n for n in adapters)
    assert len(trainer.run.actor.optimizer.param_groups[0]["params"]) == len(adapters)
    trainer.run.global_step = 1
    metrics = trainer.train_step()
    assert metrics["actor/skipped_updates"] == 0
    assert all(torch.equal(p, frozen[n]) for n, p in _frozen(policy).items())
    changed = [
        n
        for n, p in policy.named_parameters()
        if p.requires_grad and not torch.equal(p, adapters[n])
    ]
    assert any("lora_B" in n for n in changed)
    batch = TrainBatch.collate(_rollouts(trainer, 2), trainer.run.tokenizer.pad_token_id)
    base = AutoModelForCausalLM.from_pretrained(tiny_policy_dir).eval()
    reference = trainer.run.actor.logprobs(batch, reference=True)
    with torch.no_grad():
        trainer.run.actor.reference = base  # the base model as a separate copy scores the same
        assert torch.allclose(
            trainer.run.actor.logprobs(batch, reference=True), reference, atol=1e-6
        )
    assert not torch.allclose(trainer.run.actor.logprobs(batch), reference, atol=1e-4)


# the value model with adapters too: its body's adapters and its head are in the checkpoint
GAE = ["algorithm.adv_estimator=gae", "critic.ppo_mini_batch_size=2", "critic.lora.rank=4"]


def test_a_lora_checkpoint_holds_the_adapters_and_resumes_metric_for_metric(
    tiny_policy_dir, tmp_path
):
    spec = [*SPEC, *LORA, *GAE]
    straight = tmp_path / "straight"
    Trainer(small_config(tiny_policy_dir, straight, *spec, "trainer.total_training_steps=4")).fit()
    split = tmp_path / "split"
    Trainer(small_config(tiny_policy_dir, split, *spec, "trainer.total_training_steps=2")).fit()
    checkpoint = split / "checkpoints" / "global_step_2"
    files = {p.name for p in checkpoint.iterdir()}
    assert {"adapter_model.safetensors", "adapter_config.json", "base_model.json"} <= files
    assert "model.safetensors" not in files
    assert all(".lora_" in k for k in load_file(checkpoint / "adapter_model.safetensors"))
    state = load_trainer_state(checkpoint)
    assert all(".lora_" in k for k in state["actor"]["optimizer"]["state"])
    saved = state["critic"]["model"]  # the critic's adapters and its fully trained value head
    assert all(".lora_" in k or ".score." in k for k in saved)
    assert any(".score." in k for k in saved)
    resumed = Trainer(small_config(tiny_policy_dir, split, *spec, "trainer.total_training_steps=4"))
    assert resumed.run.global_step == 2
    resumed.fit()
    a, b = comparable(read_metrics(straight)), comparable(read_metrics(split))
    assert b[3]["spec/draft_ratio"] == 1
    for x, y in zip(a, b, strict=True):
        assert x.keys() == y.keys()
        for key in x:
            assert y[key] == pytest.approx(x[key], rel=1e-5, abs=1e-6), key


def test_adapters_resume_only_on_their_base_and_export_merges_them(
    tiny_policy_dir, tmp_path, capsys
):
    run = tmp_path / "run"
    trainer = Trainer(small_config(tiny_policy_dir, run, *LORA))
    trainer.fit()
    checkpoint = run / "checkpoints" / "global_step_2"
    assert json.loads((checkpoint / "base_model.json").read_text()) == base_identity(
        tiny_policy_dir
    )
    other = save_tiny_policy(tmp_path / "other", initializer_range=0.05)
    with pytest.raises(BaseModelError, match="not the one checkpoint"):
        check_base(checkpoint, base_identity(other))
    out = tmp_path / "merged"
    assert main(["export", str(checkpoint), str(out)]) == 0
    merged = AutoModelForCausalLM.from_pretrained(out).eval()
    expected = merged_state(peft_model(trainer.run.actor.policy))
    assert merged.state_dict().keys() == expected.keys()
    for name, tensor in merged.state_dict().items():
        assert torch.allclose(tensor, expected[name], atol=1e-6), name
    assert main(["export", str(checkpoint), str(out)]) == 2
    assert main(["export", str(checkpoint), str(tmp_path / "x"), "--base", str(other)]) == 2
    err = capsys.readouterr().err
    assert "is not empty" in err and "not the one checkpoint" in err


def test_target_modules_the_model_lacks_get_one_line(tiny_policy_dir, tmp_path, capsys):
    argv = ["train", f"model.path={tiny_policy_dir}", f"trainer.output_dir={tmp_path}",
            "actor.lora.rank=4", "actor.lora.target_modules=[qkv]"]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "actor.lora.target_modules=['qkv'] matches no module" in err and "q_proj" in err
    assert len(err.splitlines()) == 1
