import json
import os

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from specrl.config import load_config
from specrl.engines.hf import HFEngine
from specrl.toy_policy import build_tokenizer

EOS = 1
PAD = 0

if os.environ.get("PYTEST_XDIST_WORKER"):
    # pytest runs one worker per core (pyproject's addopts): each computes on one thread, and so
    # do the runs it starts in subprocesses; two threads per worker on 2 cores ran ~7x slower
    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"


def pytest_collection_modifyitems(items):
    """Tests that start a local Ray cluster run one after another, on one pytest worker."""
    for item in items:
        if item.get_closest_marker("ray"):
            item.add_marker(pytest.mark.xdist_group("ray"))


def make_tiny_model(
    seed: int = 0, vocab_size: int = 12, init: float = 0.3, hidden_size: int = 32
) -> Qwen2ForCausalLM:
    """A random 2-layer, 2-head Qwen2 over a small vocabulary; `init` sets how peaked its logits
    are. (vLLM's CPU attention needs hidden_size ≥ 64: head_dim 32.)"""
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=128,
        initializer_range=init,
        pad_token_id=PAD,
        eos_token_id=EOS,
    )
    return Qwen2ForCausalLM(config).eval()


def recorded_passes(model):
    """Input shapes of the model's forward passes, recorded until the hook is removed."""
    passes = []
    hook = model.model.register_forward_hook(
        lambda m, args, kwargs, out: passes.append(tuple(kwargs["input_ids"].shape)),
        with_kwargs=True,
    )
    return passes, hook


# A tiny policy shaped like a real chat model (SmolLM2's template): a vocabulary of thousands,
# pad == eos == the end-of-turn token, which also occurs inside every prompt
CHAT_VOCAB, CHAT_EOS, CHAT_START = 4096, 2, 3  # <|im_end|> (eos and pad), <|im_start|>
CHAT_SYSTEM, CHAT_USER, CHAT_ASSISTANT, CHAT_NEWLINE = 4, 5, 6, 7


def make_chat_like_model(seed: int = 0) -> Qwen2ForCausalLM:
    """A random 2-layer Qwen2 over CHAT_VOCAB tokens, its logits peaked enough that a prompt's
    samples share prefixes (a trie to walk), pad == eos."""
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=CHAT_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=256,
        initializer_range=2.0, pad_token_id=CHAT_EOS, eos_token_id=CHAT_EOS, tie_word_embeddings=True,
    )  # fmt: skip
    return Qwen2ForCausalLM(config).eval()


def chat_like_prompts(count: int, seed: int = 0) -> list:
    """`count` prompts as a chat template renders them, of different lengths: a system turn and
    a user turn, each closed by the eos token, then the assistant's header."""
    from specrl.types import Example, Prompt

    generator = torch.Generator().manual_seed(seed)
    prompts = []
    for i in range(count):
        system = torch.randint(100, CHAT_VOCAB, (3,), generator=generator).tolist()
        length = int(torch.randint(2, 30, (1,), generator=generator))
        user = torch.randint(100, CHAT_VOCAB, (length,), generator=generator).tolist()
        ids = [
            CHAT_START, CHAT_SYSTEM, CHAT_NEWLINE, *system, CHAT_EOS, CHAT_NEWLINE,
            CHAT_START, CHAT_USER, CHAT_NEWLINE, *user, CHAT_EOS, CHAT_NEWLINE,
            CHAT_START, CHAT_ASSISTANT, CHAT_NEWLINE,
        ]  # fmt: skip
        prompts.append(Prompt(tuple(ids), Example(f"prompt {i}", "", "chat-like")))
    return prompts


@pytest.fixture
def tiny_model() -> Qwen2ForCausalLM:
    return make_tiny_model()


@pytest.fixture
def engine(tiny_model) -> HFEngine:
    return HFEngine(tiny_model, eos_token_ids=[EOS], pad_token_id=PAD)


def save_tiny_policy(path, initializer_range: float = 0.02):
    """A random tiny Qwen2 over the built-in character tokenizer, saved as a local HF directory
    (head_dim 32: the smallest vLLM's CPU attention supports); `initializer_range` sets how
    peaked its logits are. → path"""
    tokenizer = build_tokenizer()
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(
        Qwen2Config(
            vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=128,
            initializer_range=initializer_range, eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
    )  # fmt: skip
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_policy_dir(tmp_path_factory):
    return save_tiny_policy(tmp_path_factory.mktemp("tiny-policy"))


def small_config(policy_dir, out_dir, *overrides):
    return load_config(
        None,
        [
            f"model.path={policy_dir}", f"trainer.output_dir={out_dir}", "trainer.logger=[jsonl]",
            "data.train_size=16", "data.val_size=8", "data.train_batch_size=4", "rollout.n=4",
            "actor.ppo_mini_batch_size=2", "actor.ppo_micro_batch_size=3", "data.max_response_length=12",
            "trainer.total_training_steps=2", "trainer.test_freq=1", "trainer.save_freq=1", *overrides,
        ],
    )  # fmt: skip


def read_metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def png_panels(path) -> int:
    """Rows of panels in a figure of `plot_metrics` (11 x 3.5 inches per row at 100 dpi), after
    checking that it is a PNG of that width with something drawn on it."""
    from matplotlib.image import imread

    image = imread(path)  # [H, W, 4] floats
    assert image.shape[1] == 1100 and image.shape[0] % 350 == 0
    assert (image[..., :3] < 0.9).any(axis=-1).mean() > 0.01  # lines, axes and text drawn
    return image.shape[0] // 350
