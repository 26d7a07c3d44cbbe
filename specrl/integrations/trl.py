"""Speculative rollouts for TRL: `GRPOTrainer(rollout_func=SpeculativeRollouts())`.

TRL's `GRPOTrainer` (1.16) calls `rollout_func(prompts, trainer)` once per generation batch with
the process's prompts, raw (chat messages kept) and as its sampler repeated them: each prompt
`num_generations` times. `SpeculativeRollouts` rolls them out through specrl's speculative stage
over the trainer's own model in the same process (the transformers engine wraps it: its weights
are always the current policy's, nothing is synced), with TRL's sampling settings. A prompt's k-th
occurrence in a call is its slot k; the stage keeps every prompt's history across calls and, from
a prompt's second rollout on, reuses what the current policy would sample again (by default the
exact rule and history tries: the completions are the tokens plain decoding would draw with the
same seeds). It returns what TRL expects (`prompt_ids`, `completion_ids`, `logprobs`) and the
call's share of reused tokens (`specrl_reused_token_ratio`, which reward functions receive as a
keyword), and adds specrl's figures to TRL's logged metrics (`specrl/*`).

Where TRL would recompute the old policy's logprobs of a generation batch (its optimizer steps
outrun its generations: `gradient_accumulation_steps` not a multiple of `steps_per_generation ×
num_iterations`), it takes the ones the rollout function computed instead: the same model
object, the same weights, the same untruncated softmax(logits / temperature), with no gradient
and in eval mode, so the forward over the whole batch is not run twice (`reuse_logprobs`).
"""

from __future__ import annotations

import functools
import inspect
import warnings
from collections import Counter
from collections.abc import Sequence
from typing import Any

import torch

from specrl.config import SpecConfig
from specrl.engines import SamplingParams
from specrl.engines.hf import HFEngine
from specrl.errors import UserError
from specrl.rollouts import SlotRequest
from specrl.speculative.stage import SpeculativeStage
from specrl.speculative.stats import RolloutStats
from specrl.types import Example, Prompt

TESTED_TRL = "1.16"  # the TRL release whose rollout_func contract this follows
LOGGED = (
    "spec/reused_token_ratio",
    "spec/full_reuse_ratio",
    "spec/verified_token_ratio",
    "timing_s/rollout",
    "timing_s/verify",
    "timing_s/gen",
)


def _check_trl() -> None:
    """TRL is installed and its GRPOTrainer takes a `rollout_func` (one line when not)."""
    try:
        import trl
        from trl import GRPOTrainer
    except ImportError:
        raise UserError("specrl.integrations.trl needs TRL: pip install 'specrl[trl]'") from None
    if "rollout_func" not in inspect.signature(GRPOTrainer.__init__).parameters:
        raise UserError(
            f"TRL {trl.__version__}'s GRPOTrainer takes no rollout_func: "
            f"pip install 'specrl[trl]' (TRL {TESTED_TRL})"
        )
    if not trl.__version__.startswith(f"{TESTED_TRL}."):
        warnings.warn(
            f"specrl's rollout function follows TRL {TESTED_TRL}'s rollout_func contract, an "
            f"experimental API; this is TRL {trl.__version__}",
            stacklevel=3,
        )


class SpeculativeRollouts:
    """A `rollout_func` for TRL's GRPOTrainer. `spec`: specrl's speculation settings (default:
    the exact rule with history tries; `SpecConfig(enabled=False)` decodes every token, with the
    same seeds); `max_batch_size`: sequences per forward of the engine; `reuse_logprobs`: hand
    TRL the rollouts' logprobs as the old policy's where it would recompute them (False: TRL
    runs its own forward for them)."""

    def __init__(
        self, spec: SpecConfig | None = None, max_batch_size: int = 512, reuse_logprobs: bool = True
    ) -> None:
        _check_trl()
        self.spec = spec or SpecConfig()
        if self.spec.enabled and self.spec.acceptance != "exact":
            raise UserError(
                "rollout.spec.acceptance=specrl samples from a mix of old and new policies and "
                "TRL's loss applies no importance weights for it: use the exact rule (the default)"
            )
        self.max_batch_size = max_batch_size
        self.reuse_logprobs = reuse_logprobs
        self.stage: SpeculativeStage | None = None
        self.pending: tuple[list[list[int]], torch.Tensor] | None = None  # the last call's
        self.logprobs_reused = 0  # TRL forwards over a generation batch left out
        self.calls: Counter[str] = Counter()  # per mode: what keys each call's seeds
        self.stats = RolloutStats()  # every call's, summed

    def __call__(self, prompts: Sequence[Any], trainer: Any) -> dict[str, Any]:
        mode = "train" if trainer.model.training else "eval"
        stage = self.stage or self._build(trainer)
        ids = self._tokenize(prompts, trainer)
        seen: Counter[tuple[int, ...]] = Counter()
        requests = []
        for prompt, row in zip(prompts, ids, strict=True):
            key = tuple(row)
            example = Example(prompt, "", "trl")
            requests.append(SlotRequest(Prompt(key, example), seen[key], stage.max_response_length))
            seen[key] += 1
        seed_key = (trainer.args.seed, mode, trainer.accelerator.process_index, self.calls[mode])
        self.calls[mode] += 1
        model = stage.engine.model
        training = model.training
        model.eval()
        try:
            with torch.no_grad():
                rollouts, stats = stage.rollout(requests, seed_key, trainer.state.global_step)
        finally:
            model.train(training)
        self.stats += stats
        if self.reuse_logprobs:
            self.pending = self._padded(rollouts)
        metrics = getattr(trainer, "_metrics", {}).get(mode)
        if metrics is not None:  # TRL averages these per logging step, as its own
            logged = stats.metrics()
            for name in LOGGED:
                if name in logged:
                    metrics[f"specrl/{name.split('/', 1)[1]}"].append(logged[name])
        return {
            "prompt_ids": [list(r.prompt.ids) for r in rollouts],
            "completion_ids": [list(r.token_ids) for r in rollouts],
            "logprobs": [list(r.current_logprobs) for r in rollouts],
            "specrl_reused_token_ratio": stats.ratios()["spec/reused_token_ratio"],
        }

    def _build(self, trainer: Any) -> SpeculativeStage:
        """The stage over the trainer's model, with its sampling settings; refuses (one line)
        what specrl's sampler does not reproduce."""
        args = trainer.args
        unsupported = {
            "use_vllm=True (specrl decodes in the trainer's process)": trainer.use_vllm,
            "tools or environments": bool(trainer.tools) or trainer.environment_factories,
            "a vision-language model": getattr(trainer, "_is_vlm", False),
            f"min_p={args.min_p}": args.min_p not in (None, 0.0),
            f"repetition_penalty={args.repetition_penalty}": args.repetition_penalty != 1.0,
            "generation_kwargs": bool(args.generation_kwargs),
        }
        refused = [what for what, present in unsupported.items() if present]
        if refused:
            raise UserError(
                f"specrl's rollout function does not support {', '.join(refused)}: "
                "leave it out of the GRPOConfig, or drop rollout_func"
            )
        model = trainer.accelerator.unwrap_model(trainer.model)
        tokenizer = trainer.processing_class
        sampling = SamplingParams(args.temperature, args.top_p or 1.0, args.top_k or 0)
        engine = HFEngine(model, trainer.eos_token_ids, tokenizer.pad_token_id, self.max_batch_size)
        self.stage = SpeculativeStage(engine, sampling, args.max_completion_length, self.spec)
        generate_every = args.steps_per_generation * trainer.num_iterations
        recomputes = args.gradient_accumulation_steps % generate_every != 0  # as TRL decides
        untruncated = sampling.temperature > 0 and sampling.top_p == 1 and sampling.top_k == 0
        self.reuse_logprobs = self.reuse_logprobs and recomputes and untruncated
        if self.reuse_logprobs:
            trainer._get_per_token_logps_and_entropies = self._old_logprobs_first(
                trainer._get_per_token_logps_and_entropies
            )
        return self.stage

    @staticmethod
    def _padded(rollouts: Sequence[Any]) -> tuple[list[list[int]], torch.Tensor]:
        """The completions' ids, and their logprobs right-padded with zeros ([B, longest])."""
        logprobs = torch.zeros(len(rollouts), max(len(r.token_ids) for r in rollouts))
        for i, r in enumerate(rollouts):
            logprobs[i, : len(r.token_ids)] = torch.tensor(r.current_logprobs)
        return [list(r.token_ids) for r in rollouts], logprobs

    def _old_logprobs_first(self, compute: Any) -> Any:
        """TRL's per-token logprob pass, answered by the last call's logprobs when it is the
        old-logprob pass over that call's batch: the first pass after the call, without gradient
        or entropies, over its completions (right-padded, as TRL pads them); any other pass is
        TRL's own."""
        pad_id = self.stage.engine.pad_token_id

        @functools.wraps(compute)
        def per_token_logps(model, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
            pending, self.pending = self.pending, None
            if pending is not None and not torch.is_grad_enabled():
                completion_ids, logprobs = pending
                padded = [ids + [pad_id] * (logits_to_keep - len(ids)) for ids in completion_ids]
                if (
                    not kwargs.get("compute_entropy")
                    and input_ids[:, input_ids.shape[1] - logits_to_keep :].tolist() == padded
                ):
                    self.logprobs_reused += 1
                    old = logprobs.new_zeros(len(padded), logits_to_keep)
                    old[:, : logprobs.shape[1]] = logprobs
                    return old.to(input_ids.device), None, None
            return compute(model, input_ids, attention_mask, logits_to_keep, *args, **kwargs)

        return per_token_logps

    @staticmethod
    def _tokenize(prompts: Sequence[Any], trainer: Any) -> list[list[int]]:
        """The prompts' token ids as TRL's own generation makes them: chat messages through the
        chat template with the generation prompt, text as it is."""
        tokenizer = trainer.processing_class
        if isinstance(prompts[0], list):
            return tokenizer.apply_chat_template(
                conversation=list(prompts),
                chat_template=trainer.chat_template,
                add_generation_prompt=True,
                tokenize=True,
                return_dict=True,
                **trainer.chat_template_kwargs,
            )["input_ids"]
        return tokenizer(text=list(prompts))["input_ids"]


def builtin_task(
    task: str = "noisy_facts", train_size: int = 1024, val_size: int = 1000, seed: int = 1
) -> tuple[Any, Any, Any, Any, Any]:
    """specrl's built-in task for a TRL run, nothing downloaded: (train dataset, held-out
    dataset, reward function, the task's shipped policy, its tokenizer). The datasets have TRL's
    `prompt` column (text) and `ground_truth`, `data_source`; the reward function is TRL-style
    (completions and columns in, one score per completion out), the task's own checker."""
    from datasets import Dataset

    from specrl.data.arithmetic import MULTI_TURN_TASKS, TASKS, make_split
    from specrl.models import load_policy
    from specrl.rewards import builtin_compute_score
    from specrl.toy_policy import ToyPolicySpec, ensure_toy_policy

    single_turn = [t for t in TASKS if t not in MULTI_TURN_TASKS]
    if task not in single_turn:
        raise UserError(f"task {task!r}: give one of {', '.join(single_turn)}")
    spec = TASKS[task]
    train, val = make_split(seed, train_size, val_size, spec.min_digits, spec.max_digits)

    def rows(problems) -> Any:
        examples = [p.example() for p in problems]
        return Dataset.from_dict(
            {
                "prompt": [e.prompt for e in examples],
                "ground_truth": [e.ground_truth for e in examples],
                "data_source": [e.data_source for e in examples],
            }
        )

    def correct(completions, ground_truth, data_source, **_) -> list[float]:
        return [
            builtin_compute_score(source, text, truth)["score"]
            for text, truth, source in zip(completions, ground_truth, data_source, strict=True)
        ]

    model, tokenizer = load_policy(ensure_toy_policy(ToyPolicySpec(task=task)), "float32")
    return rows(train), rows(val), correct, model, tokenizer
