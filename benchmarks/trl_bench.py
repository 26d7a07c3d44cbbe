"""TRL's GRPOTrainer on specrl's built-in task, three ways: TRL's own generation (`trl`), specrl's
rollout function with speculation off (`specrl-off`) and on (`specrl`: the exact rule, history
tries). Same shipped policy, problems, seed and hyperparameters (specrl's quickstart in TRL's
terms: 32 prompts x 8 completions per rollout step, two optimizer steps of 128 completions each,
lr 7e-6 after 5 warm-up steps, clip 0.2 / 0.28, token-mean loss, no KL, float32).

    python benchmarks/trl_bench.py --out benchmarks/cpu-hf-trl-noisy-facts

Per rollout step: the seconds of TRL's `_generate` (the rollout function's call, or TRL's own
tokenizing and decoding) and of the step (its two optimizer steps, generation included); the
reused token ratio of the specrl arm; the old-logprob passes TRL left out, taking the rollouts'
logprobs (two optimizer steps per generation batch: TRL would recompute them); held-out
accuracy (greedy, specrl's transformers engine, the same for every arm) before training and
every `--eval-every` rollout steps. An untimed
warm-up (a few steps of the `trl` arm) runs first. Writes results.json and results.png. Run
alone: it times.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import time
from pathlib import Path

import torch

ARMS = ("trl", "specrl-off", "specrl")


def timed_trainer_class():
    from trl import GRPOTrainer

    class TimedGRPOTrainer(GRPOTrainer):
        """GRPOTrainer timing each generation (`_generate`: the rollout function's call, or TRL's
        own tokenizing and decoding)."""

        generation_s: list[float]

        def _generate(self, prompts):
            started = time.perf_counter()
            out = super()._generate(prompts)
            self.generation_s.append(time.perf_counter() - started)
            return out

    return TimedGRPOTrainer


def held_out_accuracy(model, tokenizer, val) -> float:
    """Greedy responses to the held-out prompts (tokenized as TRL tokenizes text), scored by
    the task's checker."""
    from specrl.engines import GREEDY
    from specrl.engines.hf import HFEngine
    from specrl.rewards import builtin_compute_score
    from specrl.rollouts import sample_rollouts
    from specrl.types import Example, Prompt

    engine = HFEngine(model, [tokenizer.eos_token_id], tokenizer.pad_token_id)
    texts, truths, sources = (
        list(val[column]) for column in ("prompt", "ground_truth", "data_source")
    )
    prompts = [
        Prompt(tuple(ids), Example(text, truth, source))
        for ids, text, truth, source in zip(
            tokenizer(text=texts)["input_ids"], texts, truths, sources, strict=True
        )
    ]
    training = model.training
    model.eval()
    with torch.no_grad():
        rollouts = sample_rollouts(engine, prompts, 1, GREEDY, 72, ("eval",), 0)
    model.train(training)
    texts = tokenizer.batch_decode([r.token_ids for r in rollouts], skip_special_tokens=True)
    scores = [
        builtin_compute_score(p.example.data_source, text, p.example.ground_truth)["acc"]
        for p, text in zip(prompts, texts, strict=True)
    ]
    return sum(scores) / len(scores)


def run_arm(arm: str, out_dir: Path, steps: int, eval_every: int, val_size: int) -> dict:
    from transformers import TrainerCallback
    from trl import GRPOConfig

    from specrl.config import SpecConfig
    from specrl.integrations.trl import SpeculativeRollouts, builtin_task

    train, val, reward, model, tokenizer = builtin_task(val_size=val_size)
    rollouts = {
        "trl": None,
        "specrl-off": SpeculativeRollouts(SpecConfig(enabled=False)),
        "specrl": SpeculativeRollouts(),
    }[arm]
    optimizer_steps = 2 * steps  # two optimizer steps per rollout step
    args = GRPOConfig(
        output_dir=str(out_dir / arm), per_device_train_batch_size=64,
        gradient_accumulation_steps=2, steps_per_generation=4, num_generations=8,
        max_completion_length=72, max_steps=optimizer_steps, learning_rate=7e-6,
        lr_scheduler_type="constant_with_warmup", warmup_steps=5, adam_beta2=0.99,
        weight_decay=0.0, max_grad_norm=1.0, epsilon=0.2, epsilon_high=0.28, loss_type="dapo",
        beta=0.0, temperature=1.0, bf16=False, gradient_checkpointing=False, use_cpu=True,
        seed=1, report_to=[], save_strategy="no", logging_steps=2,
    )  # fmt: skip
    accuracy: dict[int, float] = {}
    step_s: list[float] = []

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            self.started = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            step_s.append(time.perf_counter() - self.started)
            if state.global_step % (2 * eval_every) == 0:
                accuracy[state.global_step // 2] = held_out_accuracy(model, tokenizer, val)

    accuracy[0] = held_out_accuracy(model, tokenizer, val)
    trainer = timed_trainer_class()(
        model=model, processing_class=tokenizer, reward_funcs=reward, train_dataset=train,
        args=args, rollout_func=rollouts, callbacks=[Clock()],
    )  # fmt: skip
    trainer.generation_s = []
    started = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - started
    reuse = [m.get("specrl/reused_token_ratio") for m in trainer.state.log_history if "loss" in m]
    rollout_steps = [step_s[i] + step_s[i + 1] for i in range(0, len(step_s), 2)]
    return {
        "generation_s_per_step": trainer.generation_s,
        "step_s_per_step": rollout_steps,
        "generation_s": sum(trainer.generation_s),
        "step_s": sum(rollout_steps),
        "train_wall_s": wall,
        "reused_token_ratio_per_logging_step": reuse,
        "reused_tokens": rollouts.stats.reused_tokens if rollouts else 0,
        "old_logprob_passes_left_out": rollouts.logprobs_reused if rollouts else 0,
        "response_tokens": rollouts.stats.response_tokens if rollouts else None,
        "held_out_accuracy": accuracy,
        "load_average_after": os.getloadavg(),
    }


def warm_up(out_dir: Path) -> float:
    """Untimed: a few optimizer steps of TRL's own generation (first-run costs paid here)."""
    started = time.perf_counter()
    run_arm("trl", out_dir / "warmup", 2, 10**6, 8)
    return time.perf_counter() - started


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (gen, acc) = plt.subplots(1, 2, figsize=(11, 4))
    for arm, r in results["arms"].items():
        gen.plot(
            range(1, len(r["generation_s_per_step"]) + 1), r["generation_s_per_step"], label=arm
        )
        points = sorted((int(k), v) for k, v in r["held_out_accuracy"].items())
        acc.plot([k for k, _ in points], [v for _, v in points], marker="o", label=arm)
    gen.set(xlabel="rollout step", ylabel="generation seconds", title="TRL GRPOTrainer: generation")
    acc.set(xlabel="rollout step", ylabel="held-out accuracy (greedy)", title="held-out accuracy")
    gen.legend()
    acc.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--steps", type=int, default=128, help="rollout steps per arm")
    parser.add_argument("--eval-every", type=int, default=32, help="rollout steps")
    parser.add_argument("--val-size", type=int, default=200, help="held-out problems")
    parser.add_argument("--arms", default=",".join(ARMS))
    args = parser.parse_args()
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    import transformers
    import trl

    args.out.mkdir(parents=True, exist_ok=True)
    results = {
        "command": f"python benchmarks/trl_bench.py --out {args.out} --steps {args.steps} "
        f"--eval-every {args.eval_every} --val-size {args.val_size} --arms {args.arms}",
        "commit": subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip(),
        "machine": f"{platform.machine()} {platform.processor() or ''} "
        f"{torch.get_num_threads()} threads".strip(),
        "versions": {
            "trl": trl.__version__,
            "transformers": transformers.__version__,
            "torch": torch.__version__,
        },
        "load_average_at_start": os.getloadavg(),
        "warmup_s": warm_up(args.out / "runs"),
        "arms": {},
    }
    for arm in args.arms.split(","):
        print(f"trl bench: the {arm} arm", flush=True)
        results["arms"][arm] = run_arm(
            arm, args.out / "runs", args.steps, args.eval_every, args.val_size
        )
    base = results["arms"].get("trl")
    if base:
        results["speedup_vs_trl"] = {
            arm: {
                "generation": base["generation_s"] / r["generation_s"],
                "step": base["step_s"] / r["step_s"],
            }
            for arm, r in results["arms"].items()
        }
    (args.out / "results.json").write_text(json.dumps(results, indent=2))
    plot(results, args.out / "results.png")
    print(json.dumps(results.get("speedup_vs_trl"), indent=2))


if __name__ == "__main__":
    main()
