"""SmolLM2-135M-Instruct and chat prompts of reasoning-gym's number_sorting (~200 tokens each):
the long-prompt workload of the vLLM benchmark scripts (vllm_trie_waves.py, vllm_block_size.py)."""

from __future__ import annotations

from pathlib import Path

import reasoning_gym

from specrl.models import ensure_model, eos_token_ids, load_policy


def smollm2_number_sorting(count: int) -> tuple[Path, list[int], list[list[int]]]:
    """The model's directory, its end-of-sequence ids and `count` tokenized prompts (seed 1)."""
    path = ensure_model("smollm2-135m-instruct", log=lambda _: None)
    model, tokenizer = load_policy(path, "float32")
    eos = eos_token_ids(model, tokenizer)
    questions = reasoning_gym.create_dataset("number_sorting", size=count, seed=1)
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": q["question"]}], add_generation_prompt=True, tokenize=True
        )["input_ids"]
        for q in questions
    ]
    return path, eos, prompts
