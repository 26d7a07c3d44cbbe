import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from specrl.engines.hf import HFEngine

EOS = 1
PAD = 0


def make_tiny_model(seed: int = 0, vocab_size: int = 12, init: float = 0.3) -> Qwen2ForCausalLM:
    """A random 2-layer Qwen2 over a small vocabulary; `init` sets how peaked its logits are."""
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=128,
        initializer_range=init,
        pad_token_id=PAD,
        eos_token_id=EOS,
    )
    return Qwen2ForCausalLM(config).eval()


@pytest.fixture
def tiny_model() -> Qwen2ForCausalLM:
    return make_tiny_model()


@pytest.fixture
def engine(tiny_model) -> HFEngine:
    return HFEngine(tiny_model, eos_token_ids=[EOS], pad_token_id=PAD)
