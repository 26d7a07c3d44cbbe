"""The training loop, top to bottom as in DESIGN.md: rollout → rewards → advantages → update →
(sync) → log. Everything speculative happens inside the rollout stage."""

from __future__ import annotations

import copy
import gc
import random
import time
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from specrl.algorithms.advantages import compute_advantages
from specrl.algorithms.dapo import groups_with_signal, overlong_penalty
from specrl.algorithms.losses import (
    ClipConfig,
    agg_loss,
    entropy_from_logits,
    kl_penalty,
    ppo_clip_loss,
    rollout_is_weights,
)
from specrl.checkpoint import load_trainer_state, resolve_resume, restore, save_checkpoint
from specrl.config import Config, save_config
from specrl.data import PromptLoader, load_prompts, prompt_text
from specrl.engines import GREEDY, RolloutEngine, SamplingParams
from specrl.engines.hf import HFEngine
from specrl.errors import UserError
from specrl.rewards import RewardOutputs, load_reward_function
from specrl.spec.rollout import RolloutStage, generate_rollouts
from specrl.spec.store import RolloutStore
from specrl.toy_policy import ensure_toy_policy
from specrl.tracking import Tracker
from specrl.types import Rollout

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class TrainingDivergedError(UserError):
    """Training cannot continue: repeated non-finite losses or gradients."""


class ModelLoadError(UserError):
    """The configured model directory is missing or unusable."""


def load_policy(
    path: str | None, dtype: str, log=print
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """A local Hugging Face causal LM and its tokenizer; None means the built-in tiny policy."""
    directory = Path(path) if path is not None else ensure_toy_policy(log=log)
    if not (directory / "config.json").is_file():
        what = "does not exist" if not directory.exists() else "has no config.json"
        raise ModelLoadError(
            f"model.path {str(directory)!r} {what}; point it at a local Hugging Face model directory "
            "(config.json, weights, tokenizer files) or leave it unset for the built-in tiny policy"
        )
    try:
        tokenizer = AutoTokenizer.from_pretrained(directory)
        model = AutoModelForCausalLM.from_pretrained(directory, dtype=DTYPES[dtype])
    except Exception as err:  # transformers, safetensors and tokenizers each raise their own
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else ""
        raise ModelLoadError(
            f"model.path {str(directory)!r} could not be loaded ({type(err).__name__}: {first_line}); "
            "check that its weights and tokenizer files are complete"
        ) from None
    if tokenizer.pad_token_id is None:
        if tokenizer.eos_token is None:
            raise ModelLoadError(
                f"the tokenizer in {str(directory)!r} has neither a pad nor an eos token; "
                "add an eos_token to its tokenizer_config.json"
            )
        tokenizer.pad_token = tokenizer.eos_token
        log(
            f"warning: the tokenizer has no pad token; padding with its eos token {tokenizer.eos_token!r}"
        )
    return model, tokenizer


@dataclass
class TrainBatch:
    """Rollouts as tensors: prompts left-padded to width P, responses right-padded to width R."""

    input_ids: torch.Tensor  # [B, P + R]
    attention_mask: torch.Tensor  # [B, P + R]
    position_ids: torch.Tensor  # [B, P + R]
    response_mask: torch.Tensor  # [B, R]
    prompt_width: int

    @classmethod
    def collate(cls, rollouts: list[Rollout], pad_id: int) -> TrainBatch:
        width_p = max(len(r.prompt.ids) for r in rollouts)
        width_r = max(max(len(r.token_ids) for r in rollouts), 1)
        ids = torch.full((len(rollouts), width_p + width_r), pad_id, dtype=torch.long)
        attention = torch.zeros_like(ids)
        for row, r in enumerate(rollouts):
            p = len(r.prompt.ids)
            ids[row, width_p - p : width_p] = torch.tensor(r.prompt.ids)
            ids[row, width_p : width_p + len(r.token_ids)] = torch.tensor(
                r.token_ids, dtype=torch.long
            )
            attention[row, width_p - p : width_p + len(r.token_ids)] = 1
        positions = (attention.cumsum(-1) - 1).clamp(min=0)
        return cls(ids, attention, positions, attention[:, width_p:].clone(), width_p)

    def pad_responses(self, values: list[list[float]]) -> torch.Tensor:
        """Per-token values of each response → [B, R], zero-padded like the response tokens."""
        out = torch.zeros(self.response_mask.shape)
        for row, v in enumerate(values):
            out[row, : len(v)] = torch.tensor(v)
        return out

    def rows(self, index: torch.Tensor) -> TrainBatch:
        return TrainBatch(
            self.input_ids[index],
            self.attention_mask[index],
            self.position_ids[index],
            self.response_mask[index],
            self.prompt_width,
        )


def response_logprobs(
    model: PreTrainedModel, batch: TrainBatch, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logprobs [B, R] of the response tokens under softmax(logits / temperature), and the
    entropy [B, R] of that distribution (top-p / top-k are not applied, as in verl)."""
    logits = model(
        input_ids=batch.input_ids,
        attention_mask=batch.attention_mask,
        position_ids=batch.position_ids,
    ).logits[:, batch.prompt_width - 1 : -1]  # [B, R, V]
    logits = logits.float() / (temperature or 1.0)
    targets = batch.input_ids[:, batch.prompt_width :]
    logprobs = logits.log_softmax(-1).gather(-1, targets[..., None]).squeeze(-1)
    return logprobs, entropy_from_logits(logits)


@contextmanager
def timed(metrics: dict[str, float], name: str):
    start = time.perf_counter()
    yield
    metrics[f"timing_s/{name}"] = metrics.get(f"timing_s/{name}", 0.0) + time.perf_counter() - start


def _mismatch_metrics(
    old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor
) -> dict[str, float]:
    """How far the rollout engine's logprobs are from the trainer's (0 when they are the same
    numbers, as with the transformers engine over the trainer's own model)."""
    diff = (old_logprobs - rollout_logprobs).abs()[mask.bool()]
    if diff.numel() == 0:
        return {}
    return {
        "rollout_corr/logprob_abs_diff_mean": float(diff.mean()),
        "rollout_corr/logprob_abs_diff_max": float(diff.max()),
    }


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


class Trainer:
    def __init__(self, cfg: Config, tracker: Tracker | None = None) -> None:
        self.cfg = cfg
        self.run_dir = cfg.trainer.run_dir
        self.tracker = tracker or Tracker(
            cfg.trainer.logger,
            self.run_dir,
            project=cfg.trainer.project_name,
            experiment=cfg.trainer.experiment_name,
        )
        if cfg.trainer.num_threads:
            torch.set_num_threads(cfg.trainer.num_threads)
        seed_everything(cfg.trainer.seed)
        self.resume_from = resolve_resume(cfg.trainer.resume_mode, self.run_dir)
        state = load_trainer_state(self.resume_from) if self.resume_from else None
        self.policy, self.tokenizer = load_policy(
            str(self.resume_from) if self.resume_from else cfg.model.path,
            cfg.model.dtype,
            log=self.tracker.print,
        )
        self.reference = self._reference_policy() if cfg.actor.use_kl_loss else None
        eos = self.policy.generation_config.eos_token_id
        eos_ids = [eos] if isinstance(eos, int) else list(eos or [self.tokenizer.eos_token_id])
        self.engine = self._engine(eos_ids)
        train, self.val_prompts = load_prompts(
            cfg.data, self.tokenizer, cfg.trainer.seed, log=self.tracker.print
        )
        self.loader = PromptLoader(
            train, cfg.data.train_batch_size, cfg.data.shuffle, cfg.trainer.seed
        )
        self.reward_fn = load_reward_function(
            cfg.custom_reward_function.path,
            cfg.custom_reward_function.name,
            cfg.reward_model.timeout_s,
        )
        self.sampling = SamplingParams(
            cfg.rollout.temperature, cfg.rollout.top_p, cfg.rollout.top_k
        )
        self.store = RolloutStore()
        self.rollout = RolloutStage(
            self.engine, self.sampling, cfg.data.max_response_length, cfg.rollout.spec, self.store
        )
        # Rollout logprobs are the trainer's own old log-probs when the engine runs the trainer's
        # model and samples from softmax(logits / T) untruncated: no recomputation needed.
        self.rollout_logprobs_are_old_logprobs = (
            isinstance(self.engine, HFEngine)
            and self.engine.model is self.policy
            and cfg.rollout.temperature > 0
            and cfg.rollout.top_p == 1
            and cfg.rollout.top_k == 0
        )
        self.optimizer = torch.optim.AdamW(
            self.policy.parameters(),
            lr=cfg.actor.optim.lr,
            betas=cfg.actor.optim.betas,
            weight_decay=cfg.actor.optim.weight_decay,
        )
        warmup = cfg.actor.optim.lr_warmup_steps
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: min(1.0, (s + 1) / (warmup + 1))
        )
        self.global_step = 0
        self.bad_steps = 0  # consecutive steps with skipped (non-finite) updates
        steps = cfg.trainer.total_epochs * self.loader.steps_per_epoch
        self.total_steps = min(steps, cfg.trainer.total_training_steps or steps)
        if state is not None:
            restore(self, state)

    def _engine(self, eos_ids: list[int]) -> RolloutEngine:
        cfg = self.cfg
        if cfg.rollout.name == "hf":
            # The engine wraps the trainer's own model object: weights are shared, so the sync
            # after each update copies nothing (it only drops the engine's prefix cache).
            return HFEngine(
                self.policy, eos_ids, self.tokenizer.pad_token_id, cfg.rollout.max_batch_size
            )
        from specrl.engines.vllm import VLLMEngine

        engine = VLLMEngine.shared(
            str(self.resume_from or cfg.model.path or ensure_toy_policy(log=self.tracker.print)),
            eos_ids,
            dtype=cfg.model.dtype,
            max_model_len=cfg.data.max_prompt_length + cfg.data.max_response_length,
            gpu_memory_utilization=cfg.rollout.gpu_memory_utilization,
            sleep_mode=cfg.rollout.enable_sleep_mode,
            seed=cfg.trainer.seed,
        )
        engine.load_weights(self.policy.state_dict())
        return engine

    def _reference_policy(self) -> PreTrainedModel:
        """The frozen KL reference: the initial policy, also when resuming from a checkpoint."""
        if self.resume_from is None:
            reference = copy.deepcopy(self.policy)
        else:
            reference = load_policy(
                self.cfg.model.path, self.cfg.model.dtype, log=self.tracker.print
            )[0]
        return reference.eval().requires_grad_(False)

    # ---------------------------------------------------------------- loop
    def fit(self) -> dict[str, float]:
        save_config(self.cfg, self.run_dir / "config.yaml")
        if self.resume_from is not None:
            self.tracker.print(
                f"resuming from {self.resume_from} at step {self.global_step} "
                "(trainer.resume_mode=disable starts over)"
            )
            self.tracker.start(keep_through_step=self.global_step, config=self.cfg.model_dump())
        else:
            self.tracker.start(config=self.cfg.model_dump())
            if self.cfg.trainer.val_before_train:
                self.tracker.log({"training/global_step": 0, **self.validate()})
        summary: dict[str, float] = {}
        first = self.tracker.history[0] if self.tracker.history else {}
        if first.get("training/global_step") == 0 and "val/acc/mean@1" in first:
            summary["val_acc_before"] = first["val/acc/mean@1"]
        # Everything alive now (model, data, library objects: ~400k) lives through the run; frozen,
        # the garbage collector stops scanning it (as vLLM does after start-up): a full collection
        # took ~0.1 s here, several times per epoch.
        gc.collect()
        gc.freeze()
        try:
            self._train_loop()
        finally:
            gc.unfreeze()
            self.tracker.close()
        last = self.tracker.last("val/acc/mean@1")
        if last is not None:
            summary["val_acc_after"] = last
        self.tracker.summary(summary)
        return summary

    def _train_loop(self) -> None:
        with self.tracker.progress(self.total_steps, self.global_step) as advance:
            while self.global_step < self.total_steps:
                self.global_step += 1
                metrics = self.train_step()
                self._check_finite(metrics)
                if self._due(self.cfg.trainer.test_freq):
                    metrics.update(self.validate())
                if self._due(self.cfg.trainer.save_freq):
                    save_checkpoint(self)
                self.tracker.log(metrics)
                advance(metrics)

    def _check_finite(self, metrics: dict[str, float]) -> None:
        """Skipped updates are reported every step; trainer.max_bad_steps in a row stop the run
        after saving a checkpoint (of the last good weights: bad updates are never applied)."""
        skipped = metrics["actor/skipped_updates"]
        self.bad_steps = self.bad_steps + 1 if skipped else 0
        if skipped:
            self.tracker.warn(
                f"step {self.global_step}: {skipped} updates skipped (non-finite loss or gradient)"
            )
        if self.bad_steps >= self.cfg.trainer.max_bad_steps:
            self.tracker.log(metrics)
            path = save_checkpoint(self)
            raise TrainingDivergedError(
                f"{self.bad_steps} steps in a row had non-finite losses or gradients; stopped after "
                f"saving {path}. Lower actor.optim.lr or actor.grad_clip, or check the reward scale"
            )

    def _due(self, freq: int) -> bool:
        return self.global_step == self.total_steps or (freq > 0 and self.global_step % freq == 0)

    def train_step(self) -> dict[str, float]:
        cfg = self.cfg
        metrics: dict[str, float] = {"training/global_step": self.global_step}
        step_start = time.perf_counter()
        rollouts, scores = self.collect_rollouts(metrics)
        batch = TrainBatch.collate(rollouts, self.tokenizer.pad_token_id)
        rollout_logprobs = batch.pad_responses([r.logprobs for r in rollouts])
        with timed(metrics, "old_log_prob"), torch.no_grad():
            if self.rollout_logprobs_are_old_logprobs:
                old_logprobs = rollout_logprobs
            else:
                old_logprobs = self._logprobs(self.policy, batch)
        metrics.update(_mismatch_metrics(old_logprobs, rollout_logprobs, batch.response_mask))
        is_weights = None
        correction = cfg.algorithm.rollout_correction
        level = correction.level(cfg.rollout.spec)
        if level is not None:
            # weighed against what each token was sampled with: the engine's logprobs, or the
            # lenient specrl rule's own probability where it decided the token
            behaviour = [
                r.logprobs if r.behaviour_logprobs is None else r.behaviour_logprobs
                for r in rollouts
            ]
            is_weights = rollout_is_weights(
                old_logprobs,
                batch.pad_responses(behaviour),
                batch.response_mask.float(),
                level,
                correction.rollout_is_threshold,
            )
            metrics["rollout_corr/rollout_is_mean"] = float(
                is_weights.sum() / batch.response_mask.sum().clamp(min=1)
            )
        ref_logprobs = None
        if self.reference is not None:
            with timed(metrics, "ref"), torch.no_grad():
                ref_logprobs = self._logprobs(self.reference, batch)
        with timed(metrics, "adv"):
            advantages = compute_advantages(
                scores.view(-1, cfg.rollout.n),
                cfg.algorithm.adv_estimator,
                cfg.algorithm.norm_adv_by_std_in_grpo,
            ).flatten()  # [N]
        if cfg.rollout.enable_sleep_mode:  # the trainer gets the GPU memory during the update
            self.engine.sleep()
        with timed(metrics, "update_actor"):
            metrics.update(
                self.update_policy(batch, old_logprobs, ref_logprobs, advantages, is_weights)
            )
        if cfg.rollout.enable_sleep_mode:
            self.engine.wake_up()
        with timed(metrics, "sync"):  # hf: shared weights, copies nothing, drops the prefix cache
            self.engine.load_weights(self.policy.state_dict())
        metrics["timing_s/step"] = time.perf_counter() - step_start
        metrics.update(self._data_metrics(rollouts, scores, advantages, metrics["timing_s/step"]))
        metrics["training/epoch"] = self.loader.epoch
        return metrics

    # ---------------------------------------------------------------- rollout + rewards
    def collect_rollouts(self, metrics: dict[str, float]) -> tuple[list[Rollout], torch.Tensor]:
        """Rollouts and their scores [N] for data.train_batch_size prompts. With DAPO dynamic
        sampling, groups whose scores are all equal are dropped and more prompts are rolled out,
        up to algorithm.filter_groups.max_num_gen_batches batches."""
        cfg = self.cfg
        n, want = cfg.rollout.n, cfg.data.train_batch_size
        kept: list[Rollout] = []
        kept_scores: list[torch.Tensor] = []
        filtering = cfg.algorithm.filter_groups
        for gen_batch in range(filtering.max_num_gen_batches if filtering.enable else 1):
            prompts = self.loader.next_batch()
            seed_key = (cfg.trainer.seed, self.global_step, gen_batch)
            rollouts = self.rollout(prompts, n, seed_key, self.global_step, metrics)
            with timed(metrics, "reward"):
                scores = self.score(rollouts, metrics).view(-1, n)  # [G, n]
            keep = (
                groups_with_signal(scores)
                if filtering.enable
                else torch.ones(len(prompts), dtype=torch.bool)
            )
            for g in keep.nonzero().flatten().tolist():
                kept.extend(rollouts[g * n : (g + 1) * n])
                kept_scores.append(scores[g])
            metrics["train/num_gen_batches"] = gen_batch + 1
            if len(kept_scores) >= want:
                break
        if not kept_scores:  # every group was filtered: train on the last batch (zero advantages)
            kept, kept_scores = rollouts, list(scores)
        kept, kept_scores = kept[: want * n], kept_scores[:want]
        return kept, torch.stack(kept_scores).flatten()

    def score(self, rollouts: list[Rollout], metrics: dict[str, float]) -> torch.Tensor:
        """Reward per rollout [N], with DAPO's soft overlong penalty when enabled."""
        out = self.reward(rollouts)
        scores = torch.tensor(out.scores)
        metrics["reward/errors"] = metrics.get("reward/errors", 0) + out.errors
        if out.first_error:
            self.tracker.warn(
                f"reward function {self.reward_fn.name}: {out.errors} failed calls, first: {out.first_error}"
            )
        buffer = self.cfg.reward_model.overlong_buffer
        if buffer.enable:
            lengths = torch.tensor([len(r.token_ids) for r in rollouts])
            scores = scores + overlong_penalty(
                lengths, self.cfg.data.max_response_length, buffer.len, buffer.penalty_factor
            )
        for r, s in zip(rollouts, scores.tolist(), strict=True):
            r.score = s
        return scores

    def reward(self, rollouts: list[Rollout]) -> RewardOutputs:
        """Decode each response (kept on the rollout) and run the reward function on the batch."""
        for r in rollouts:
            r.text = self.tokenizer.decode(r.token_ids, skip_special_tokens=True)
        return self.reward_fn(
            [r.text for r in rollouts],
            [r.prompt.example for r in rollouts],
            [prompt_text(r.prompt.example, self.tokenizer) for r in rollouts],
        )

    # ---------------------------------------------------------------- update
    def _logprobs(self, model: PreTrainedModel, batch: TrainBatch) -> torch.Tensor:
        size = self.cfg.actor.ppo_micro_batch_size
        parts = [
            response_logprobs(
                model,
                batch.rows(torch.arange(i, min(i + size, len(batch.input_ids)))),
                self.cfg.rollout.temperature,
            )[0]
            for i in range(0, len(batch.input_ids), size)
        ]
        return torch.cat(parts)

    def update_policy(
        self,
        batch: TrainBatch,
        old_logprobs: torch.Tensor,
        ref_logprobs: torch.Tensor | None,
        advantages: torch.Tensor,
        is_weights: torch.Tensor | None = None,
    ) -> dict[str, float]:
        """ppo_epochs passes; each splits the rollouts into mini-batches (one optimizer step each)
        and those into micro-batches (gradient accumulation)."""
        actor = self.cfg.actor
        clip = ClipConfig(
            actor.clip_ratio_low,
            actor.clip_ratio_high,
            actor.clip_ratio_c,
            actor.loss_agg_mode,
            self.cfg.data.max_response_length,
        )
        num = len(batch.input_ids)
        mini = actor.ppo_mini_batch_size * self.cfg.rollout.n
        generator = torch.Generator().manual_seed(
            self.cfg.trainer.seed * 1_000_003 + self.global_step
        )
        sums: dict[str, list[float]] = defaultdict(list)
        skipped = 0
        self.policy.train()
        for _ in range(actor.ppo_epochs):
            order = torch.randperm(num, generator=generator)
            for start in range(0, num, mini):
                rows = order[start : start + mini]
                self.optimizer.zero_grad(set_to_none=True)
                for micro in rows.split(actor.ppo_micro_batch_size):
                    part = batch.rows(micro)
                    logprobs, entropy = response_logprobs(
                        self.policy, part, self.cfg.rollout.temperature
                    )
                    mask = part.response_mask.float()
                    adv = advantages[micro][:, None].expand_as(logprobs)
                    out = ppo_clip_loss(
                        logprobs,
                        old_logprobs[micro],
                        adv,
                        mask,
                        clip,
                        None if is_weights is None else is_weights[micro],
                    )
                    entropy_mean = agg_loss(entropy, mask, actor.loss_agg_mode, clip.horizon)
                    loss = out.loss - actor.entropy_coeff * entropy_mean
                    if ref_logprobs is not None:
                        kl = agg_loss(
                            kl_penalty(logprobs, ref_logprobs[micro], actor.kl_loss_type),
                            mask,
                            actor.loss_agg_mode,
                            clip.horizon,
                        )
                        loss = loss + actor.kl_loss_coef * kl
                        sums["actor/kl_loss"].append(kl.item())
                    (loss * len(micro) / len(rows)).backward()
                    sums["actor/pg_loss"].append(out.loss.item())
                    sums["actor/pg_clipfrac"].append(out.pg_clipfrac.item())
                    sums["actor/pg_clipfrac_lower"].append(out.pg_clipfrac_lower.item())
                    sums["actor/ppo_kl"].append(out.ppo_kl.item())
                    sums["actor/entropy"].append(entropy_mean.item())
                grad_norm = torch.nn.utils.clip_grad_norm_(
                    self.policy.parameters(), actor.grad_clip
                )
                sums["actor/grad_norm"].append(grad_norm.item())
                if torch.isfinite(grad_norm):
                    self.optimizer.step()
                    self.scheduler.step()  # the schedule counts applied updates
                else:  # a NaN / inf loss or gradient: keep the weights, report the skip
                    skipped += 1
        self.policy.eval()
        metrics = {k: float(np.mean(v)) for k, v in sums.items()}
        metrics["actor/skipped_updates"] = skipped
        metrics["actor/lr"] = self.scheduler.get_last_lr()[0]
        return metrics

    # ---------------------------------------------------------------- evaluation + metrics
    @torch.no_grad()
    def validate(self) -> dict[str, float]:
        """Greedy accuracy on the held-out prompts: val/acc/mean@1."""
        start = time.perf_counter()
        rollouts: list[Rollout] = []
        size = self.cfg.data.val_batch_size
        for i in range(0, len(self.val_prompts), size):
            rollouts += generate_rollouts(
                self.engine,
                self.val_prompts[i : i + size],
                1,
                GREEDY,
                self.cfg.data.max_response_length,
                ("val",),
                self.global_step,
            )
        out = self.reward(rollouts)
        return {
            "val/acc/mean@1": float(np.mean(out.scores)),
            "val/response_length/mean": float(np.mean([len(r.token_ids) for r in rollouts])),
            "val/reward_errors": out.errors,
            "timing_s/testing": time.perf_counter() - start,
        }

    def _data_metrics(
        self,
        rollouts: list[Rollout],
        scores: torch.Tensor,
        advantages: torch.Tensor,
        step_time: float,
    ) -> dict[str, float]:
        lengths = torch.tensor([len(r.token_ids) for r in rollouts], dtype=torch.float32)
        prompt_lengths = torch.tensor([len(r.prompt.ids) for r in rollouts], dtype=torch.float32)
        total_tokens = float(lengths.sum() + prompt_lengths.sum())
        return {
            "critic/score/mean": scores.mean().item(),
            "critic/rewards/mean": scores.mean().item(),
            "critic/score/max": scores.max().item(),
            "critic/score/min": scores.min().item(),
            "critic/advantages/mean": advantages.mean().item(),
            "critic/advantages/max": advantages.max().item(),
            "critic/advantages/min": advantages.min().item(),
            "response_length/mean": lengths.mean().item(),
            "response_length/max": lengths.max().item(),
            "response_length/min": lengths.min().item(),
            "response_length/clip_ratio": float(
                np.mean([r.finish_reason == "length" for r in rollouts])
            ),
            "prompt_length/mean": prompt_lengths.mean().item(),
            "perf/total_num_tokens": total_tokens,
            "perf/throughput": total_tokens / step_time,
        }
