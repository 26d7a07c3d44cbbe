"""The sections of where a run's inputs come from and how it runs: `data`, `model`, `trainer`,
`ray_kwargs`."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator

from specrl.config.section import Section


class DataConfig(Section):
    task: Literal["noisy_facts", "addition", "calculator"] = Field(
        "noisy_facts",
        description="built-in task (without train_files) and its warm-start policy: noisy_facts "
        "(RL keeps learning for the whole default run), addition (solved in a few steps) or "
        "calculator (multi-turn: episodes with a calculator the policy calls between turns)",
    )
    train_files: list[str] | None = Field(
        None, description="jsonl/parquet files in verl's schema; None uses the built-in task"
    )
    val_files: list[str] | None = Field(
        None, description="held-out jsonl/parquet files; None uses the built-in task's test split"
    )
    prompt_key: str = Field(
        "prompt", description="column holding the prompt (chat messages or text)"
    )
    answer_key: str = Field(
        "reward_model.ground_truth",
        description="dotted column path of the ground truth; plain jsonl may use 'answer'",
    )
    apply_chat_template: Literal["auto", True, False] = Field(
        "auto",
        description="render prompts with the tokenizer's chat template: auto (as verl) templates "
        "chat messages and, when the model has a template, wraps plain-text prompts as one user "
        "message; true does the same and stops when the model has no template; false feeds "
        "plain text as is and joins messages' contents by newlines (TRL's plain-text format). "
        "Either way the run says at load what it does with plain text",
    )
    train_size: int = Field(1024, ge=1, description="built-in task: number of training problems")
    val_size: int = Field(
        1000,
        ge=1,
        description="built-in task: number of held-out problems (1000: ±1 point binomial noise)",
    )
    max_prompt_length: int = Field(64, ge=1, description="most tokens per prompt (see truncation)")
    truncation: Literal["error", "filter"] = Field(
        "error",
        description="prompts over max_prompt_length: error stops, filter drops and counts them",
    )
    max_response_length: int = Field(
        72,
        ge=1,
        description="R: most tokens per response; of an episode: its turns and observations",
    )
    train_batch_size: int = Field(32, ge=1, description="prompts per training step")
    val_batch_size: int = Field(256, ge=1, description="prompts per evaluation batch")
    shuffle: bool = Field(True, description="reshuffle the training prompts every epoch")

    @field_validator("train_files", "val_files", mode="before")
    @classmethod
    def _one_path_is_a_list(cls, value: Any) -> Any:
        """A single path is accepted for a list of one (as verl does)."""
        return [value] if isinstance(value, str) else value


class ModelConfig(Section):
    path: str | None = Field(
        None,
        description="local Hugging Face causal LM directory, or builtin:smollm2-135m-instruct "
        "(converted once from its package); None uses the built-in task's tiny policy",
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="parameter dtype of policy and engine"
    )


class TrainerConfig(Section):
    project_name: str = Field("specrl", description="project name")
    experiment_name: str = Field("quickstart", description="run name")
    output_dir: str | None = Field(
        None, description="run directory; default runs/<experiment_name>"
    )
    total_epochs: int = Field(4, ge=1, description="passes over the training prompts")
    total_training_steps: int | None = Field(
        None, ge=1, description="stop after this many steps (None: total_epochs decides)"
    )
    test_freq: int = Field(
        16, ge=0, description="evaluate every this many steps and at the end; 0 never (as verl)"
    )
    val_before_train: bool = Field(True, description="evaluate before the first step")
    log_val_generations: int = Field(
        3,
        ge=0,
        description="at every evaluation, the first this many held-out prompts with the "
        "policy's response, ground truth and score: a table on the console, every one in the "
        "run directory's val_generations.jsonl (and a wandb table); 0: none (verl's default)",
    )
    save_freq: int = Field(
        16,
        ge=0,
        description="checkpoint every this many steps and at the end (0: only at the end); "
        "an interrupted run loses at most this many steps",
    )
    max_ckpt_to_keep: int | None = Field(
        None, ge=1, description="keep only the newest this many checkpoints; None keeps all"
    )
    resume_mode: str = Field(
        "auto",
        description="auto: resume from the run's newest checkpoint; disable: start over; or a checkpoint path",
    )
    seed: int = Field(1, ge=0, description="seed of data order, sampling and initialisation")
    max_bad_steps: int = Field(
        3,
        ge=1,
        description="stop, after saving, when this many steps in a row had non-finite losses",
    )
    num_threads: Literal["auto"] | int = Field(
        "auto",
        description="torch CPU threads; auto: the cores other work leaves free when the run "
        "first starts (OMP_NUM_THREADS wins where set), kept for the whole run and its "
        "resumes; a machine that gets busier prints a one-line hint to set 1 (2 threads beside "
        "a busy process ran 7x slower)",
    )
    nnodes: int = Field(
        1, ge=1, description="GPU nodes of the learner group (with n_gpus_per_node)"
    )
    n_gpus_per_node: int = Field(
        0,
        ge=0,
        description="GPUs per node, one learner rank on each (nccl); 0: learners on CPUs "
        "(actor.num_workers of them)",
    )
    logger: list[Literal["console", "jsonl", "tensorboard", "wandb"]] = Field(
        ["console", "jsonl"], description="where metrics go (one name or a list)"
    )

    @field_validator("num_threads", mode="before")
    @classmethod
    def _auto_or_a_count(cls, value: Any) -> Any:
        if value == "auto" or (
            isinstance(value, int | str) and str(value).isdigit() and int(value) >= 1
        ):
            return value
        raise ValueError(
            f"trainer.num_threads={value}: give auto or a number of threads (1 or more)"
        )

    @field_validator("logger", mode="before")
    @classmethod
    def _one_logger_is_a_list(cls, value: Any) -> Any:
        """verl's scalar `trainer.logger=console` is a list of one."""
        return [value] if isinstance(value, str) else value

    @property
    def run_dir(self) -> Path:
        return Path(self.output_dir or f"runs/{self.experiment_name}")


class RayInitConfig(Section):
    address: str | None = Field(
        None, description="a Ray cluster to join; None starts a local one on loopback"
    )
    num_cpus: int | None = Field(
        None,
        ge=1,
        description="CPUs of a local Ray; None: all cores. Rollout workers and learner ranks "
        "each take their num_cpus_per_worker of them",
    )


class RayKwargsConfig(Section):
    ray_init: RayInitConfig = Field(default_factory=RayInitConfig)
