"""Trie rollouts against vanilla's at fixed weights, on any model: where they differ, by how much
the seeded uniform missed the sampler's boundary, and what float32 arithmetic can explain.

Each round rolls out the same prompts twice with the same seeds, through the speculative stage
(history tries, walked) and through plain decoding (`sample_rollouts`); the stage's tries hold
its own earlier rounds. A slot whose tokens differ has a first difference (a flip) at response
position t: both arms drew it with the same uniform u and the same tokens before it, so they
differ only in the distribution each path computed there. For every flip the position is
scored again by the model in float64 (the reference) and in float32 by one full forward
(a third float32 path): the flip's *margin* is how far u · total lies from the nearest
boundary of the reference CDF that separates the two tokens, the float error what float32
moves that boundary by. A flip whose margin is well above the float error is not float
rounding: it is a bug (the walk and decoding disagreeing on something else). Float error
here is the bound float32 logit errors put on a boundary (`Flip.float_error`), measured at the
flip's own position."""

from __future__ import annotations

import copy
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from specrl.config import DataConfig, LoraConfig, SpecConfig
from specrl.engines import SamplingParams
from specrl.engines.hf import HFEngine
from specrl.engines.sampling import RowSampling, sampling_logprobs, seeded_uniform
from specrl.rollouts import rollout_seed, sample_rollouts
from specrl.speculative.stage import SpeculativeStage
from specrl.types import Prompt


@dataclass
class Flip:
    """The first difference of one slot's trie and vanilla tokens."""

    round: int
    prompt: int
    slot: int
    position: int  # in the response
    trie_token: int
    vanilla_token: int
    reference_token: int  # what the float64 model's sampler draws with the same uniform
    margin: float  # |u · total − the nearest separating boundary| / total, in float64
    boundary_error: float  # |float32 − float64| of that boundary / total (one full forward)
    max_logit_error: float  # max |float32 − float64| logit at the position (one full forward)

    @property
    def float_error(self) -> float:
        """How far float32 logits can move the boundary: a change of at most e in every logit
        changes every probability by a factor within e^(±2e), so a CDF value over its total by
        at most 2e (to first order)."""
        return 2 * self.max_logit_error


@dataclass
class Comparison:
    tokens: int = 0  # response tokens compared (the longer of each pair)
    agreeing: int = 0  # positions where both arms hold the same token
    reused: int = 0  # tokens the trie arm took from its tries
    slots: int = 0
    flips: list[Flip] = field(default_factory=list)

    @property
    def flip_rate(self) -> float:
        """Flips per compared token (a flip ends a slot's agreement: later tokens are not
        comparable, and are counted as tokens, not as flips)."""
        return len(self.flips) / max(self.tokens, 1)

    def summary(self) -> dict:
        worst = max((f.margin / f.float_error for f in self.flips), default=0.0)
        return {
            "tokens": self.tokens,
            "agreeing_tokens": self.agreeing,
            "token_agreement": self.agreeing / max(self.tokens, 1),
            "reused_tokens": self.reused,
            "slots": self.slots,
            "flipped_slots": len(self.flips),
            "flip_rate_per_token": self.flip_rate,
            "largest_margin_over_float_error": worst,
            "flips": [{**asdict(f), "float_error": f.float_error} for f in self.flips],
        }


def chat_prompts(tokenizer, count: int, seed: int) -> list[Prompt]:
    """`count` reasoning-gym chain_sum problems (2-4 one-digit terms) as chat prompts through the
    tokenizer's chat template, as a run would feed them."""
    from specrl.data import format_prompts, read_splits, tokenize_splits
    from specrl.data.reasoning_gym import write_task

    out = Path(tempfile.mkdtemp())
    options = ["min_terms=2", "max_terms=4", "max_digits=1"]
    write_task("chain_sum", out, count, 1, seed, options, log=lambda _: None)
    cfg = DataConfig(
        train_files=[str(out / "train.parquet")], val_files=[str(out / "val.parquet")],
        max_prompt_length=256,
    )  # fmt: skip
    splits, _ = format_prompts(read_splits(cfg, seed), tokenizer.chat_template, "auto")
    return tokenize_splits(splits, tokenizer, cfg, print)[0]


def with_moved_adapters(model, seed: int):
    """The model with LoRA adapters (rank 8 on every linear layer) whose B matrices are not
    zero, as after some training: the engine computes base + adapters."""
    from specrl.lora import with_adapters

    model = with_adapters(model, LoraConfig(rank=8), seed)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 1e-3)
    return model.eval()


def compare_trie_with_vanilla(
    engine: HFEngine,
    prompts: Sequence[Prompt],
    n: int,
    sampling: SamplingParams,
    max_tokens: int,
    rounds: int,
    seed: int = 1,
) -> Comparison:
    """`rounds` rounds of n slots per prompt, trie against vanilla at the engine's weights."""
    stage = SpeculativeStage(
        engine,
        sampling,
        max_tokens,  # every node verified: the budget decides from timings
        SpecConfig(enabled=True, acceptance="exact", reuse="trie", verify_budget=False),
    )
    reference = copy.deepcopy(engine.model).double()
    out = Comparison()
    for r in range(rounds):
        key = (seed, r, 0)
        trie, stats = stage(prompts, n, key, r)
        vanilla = sample_rollouts(engine, prompts, n, sampling, max_tokens, key, r)
        out.reused += stats.reused_tokens
        for i, (a, b) in enumerate(zip(trie, vanilla, strict=True)):
            out.slots += 1
            out.tokens += max(len(a.token_ids), len(b.token_ids))
            same = [x == y for x, y in zip(a.token_ids, b.token_ids, strict=False)]
            t = same.index(False) if False in same else len(same)
            out.agreeing += t
            if a.token_ids == b.token_ids:
                continue
            # both stop at an end-of-sequence token or at the same budget: one response cannot
            # be a prefix of the other
            assert t < len(same), (a.token_ids, b.token_ids)
            prompt = prompts[i // n]
            u = float(seeded_uniform(torch.tensor([rollout_seed(*key, prompt.prompt_id, a.slot)]),
                                     torch.tensor([len(prompt.ids) + t]))[0])  # fmt: skip
            context = [*prompt.ids, *a.token_ids[:t]]
            tokens = (a.token_ids[t], b.token_ids[t])
            flip = _flip(
                engine.model, reference, context, sampling, u, (r, i // n, a.slot, t), *tokens
            )
            out.flips.append(flip)
    return out


@torch.inference_mode()
def _flip(model, reference, context, sampling, u, where, trie_token, vanilla_token) -> Flip:
    """The flip at the end of `context`, measured against the float64 reference."""
    ids = torch.tensor([context])
    rows = RowSampling.of([sampling], "cpu")
    logits32 = model(input_ids=ids).logits[0, -1:].float()  # [1, V]
    logits64 = reference(input_ids=ids).logits[0, -1:]  # [1, V] float64
    cdf32 = sampling_logprobs(logits32, rows).double().exp().cumsum(-1)[0]  # [V]
    cdf64 = _cdf64(logits64, sampling)
    total32, total64 = float(cdf32[-1]), float(cdf64[-1])
    target = u * total64
    reference_token = int(torch.searchsorted(cdf64, torch.tensor([target], dtype=torch.float64)))
    low, high = sorted((trie_token, vanilla_token))
    # the boundaries between the two tokens' intervals: the end of the lower one's and the
    # start of the higher one's (equal when no token between them carries mass)
    bounds = [low, high - 1]
    margin = min(abs(target - float(cdf64[b])) for b in bounds) / total64
    error = max(abs(float(cdf32[b]) / total32 - float(cdf64[b]) / total64) for b in bounds)
    return Flip(*where, trie_token, vanilla_token, reference_token, margin, error,
                float((logits32.double() - logits64).abs().max()))  # fmt: skip


def _cdf64(logits: torch.Tensor, sampling: SamplingParams) -> torch.Tensor:
    """The sampler's CDF in float64 throughout (sampling_logprobs' transform, not its float32)."""
    scaled = logits.double() / (sampling.temperature or 1.0)
    if sampling.top_k or sampling.top_p < 1:
        rows = RowSampling.of([sampling], "cpu")
        keep = sampling_logprobs(logits.float(), rows).isfinite()  # the same support
        scaled = scaled.masked_fill(~keep, float("-inf"))
    return scaled.log_softmax(-1).exp().cumsum(-1)[0]
