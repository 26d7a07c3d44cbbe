"""The embedded default policies: a character tokenizer and a tiny Qwen2 model, warm-started by
supervised training on imperfect arithmetic traces (see data/arithmetic.py).

The default build of each built-in task ships inside the package (`specrl/policies/<task>/`, 4 MB
each, built by `specrl toy-policy --force` on a 2-core CPU and checked here against the checksum
in its build.json), so every machine starts from the same weights: a build is not reproducible
across CPUs (float reduction order). Any other spec, or `--force`, builds into the cache
(`SPECRL_CACHE`, default ~/.cache/specrl), one process at a time: a second process that needs
the same build waits for the first's and reuses it. Nothing is downloaded.
"""

from __future__ import annotations

import hashlib
import json
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from specrl.cache import build_once, cache_root
from specrl.config import MultiTurnConfig
from specrl.data import arithmetic
from specrl.engines import GREEDY, GenRequest
from specrl.engines.hf import HFEngine
from specrl.episodes.env import load_environment
from specrl.episodes.runner import EpisodeLoop, sampled_turns
from specrl.errors import UserError
from specrl.models import planless_attention
from specrl.rollouts import sample_rollouts
from specrl.types import Prompt

SPECIAL_TOKENS = ["<pad>", "<eos>", "<unk>"]


@dataclass(frozen=True)
class ToyPolicySpec:
    """Everything that determines the built policy; its hash names the cache entry."""

    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    sft_steps: int = 600
    sft_batch_size: int = 64
    sft_lr: float = 3e-3
    task: str = "noisy_facts"  # a key of arithmetic.TASKS: its problems and warm-start teacher
    seed: int = 0
    version: int = 2

    @property
    def definition(self) -> arithmetic.Task:
        return arithmetic.TASKS[self.task]

    def key(self) -> str:
        """The cache entry's name: every field, and a hash of the task's definition."""
        digest = hashlib.blake2b(repr(self.definition).encode(), digest_size=4).hexdigest()
        return "-".join(f"{v}" for v in asdict(self).values()) + f"-{digest}"


SHIPPED = Path(__file__).parent / "policies"
WEIGHTS = "model.safetensors"


class ShippedPolicyError(UserError):
    """A policy shipped with the package does not match its build.json."""


def toy_policy_path(spec: ToyPolicySpec = ToyPolicySpec()) -> Path:
    return cache_root() / f"toy-policy-{spec.key()}"


def shipped_policy_path(spec: ToyPolicySpec) -> Path | None:
    """The package's build of `spec`, if it ships one (the default spec of each task does)."""
    path = SHIPPED / spec.task
    if not (path / "build.json").is_file():
        return None
    report = json.loads((path / "build.json").read_text())
    return path if report["spec"] == asdict(spec) else None


def weights_digest(path: Path) -> str:
    return hashlib.sha256((path / WEIGHTS).read_bytes()).hexdigest()


def ensure_toy_policy(
    spec: ToyPolicySpec = ToyPolicySpec(), force: bool = False, log=print, device: str = "cpu"
) -> Path:
    """The policy directory of `spec`: the package's build when it ships one (checked against
    its checksum), else the cache's, built first when missing (on `device`: cpu or cuda);
    `force` builds afresh into the cache."""
    shipped = None if force else shipped_policy_path(spec)
    if shipped is not None:
        expected = json.loads((shipped / "build.json").read_text())["weights_sha256"]
        if weights_digest(shipped) != expected:
            raise ShippedPolicyError(
                f"the built-in policy {shipped} does not match the checksum in its build.json "
                "(a damaged install): reinstall specrl, or build one with `specrl toy-policy "
                f"--force --task {spec.task}` and pass its path as model.path"
            )
        return shipped
    path = toy_policy_path(spec)
    build_once(
        path, "build.json", lambda staging: _build(staging, path, spec, log, device), force, log
    )
    return path


def _build(staging: Path, path: Path, spec: ToyPolicySpec, log, device: str) -> None:
    if device == "cpu" and spec == ToyPolicySpec(task=spec.task):
        minutes = 18 if spec.task in arithmetic.MULTI_TURN_TASKS else 6  # measured on 2 cores
        log(f"building the tiny policy into {path} (cached; about {minutes} minutes on 2 cores)")
    else:
        log(f"building the tiny policy into {path} on {device} (cached)")
    report = build_toy_policy(staging, spec, log, device)
    log(
        f"built: held-out greedy accuracy {report['val_acc']:.1%}, mean response length "
        f"{report['mean_response_length']:.1f} tokens"
    )


def build_tokenizer() -> PreTrainedTokenizerFast:
    """One token per character of the task alphabet."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + list(arithmetic.ALPHABET))}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )


def build_toy_policy(out: Path, spec: ToyPolicySpec, log=print, device: str = "cpu") -> dict:
    start = time.perf_counter()
    torch.manual_seed(spec.seed)
    tokenizer = build_tokenizer()
    model = Qwen2ForCausalLM(
        Qwen2Config(
            vocab_size=len(tokenizer),
            hidden_size=spec.hidden_size,
            intermediate_size=4 * spec.hidden_size,
            num_hidden_layers=spec.num_layers,
            num_attention_heads=spec.num_heads,
            num_key_value_heads=spec.num_heads,
            max_position_embeddings=256,
            tie_word_embeddings=True,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
            bos_token_id=tokenizer.eos_token_id,
        )
    )
    model.to(device)
    _supervised_warm_start(model, tokenizer, spec, log)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    report = {"spec": asdict(spec), **evaluate_toy_policy(model, tokenizer, spec)}
    report["num_parameters"] = sum(p.numel() for p in model.parameters())
    report["build_seconds"] = round(time.perf_counter() - start, 1)
    report["build_device"] = torch.cuda.get_device_name() if device == "cuda" else device
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    report["weights_sha256"] = weights_digest(out)
    (out / "build.json").write_text(json.dumps(report, indent=2))
    return report


def _supervised_warm_start(
    model: Qwen2ForCausalLM, tokenizer: PreTrainedTokenizerFast, spec: ToyPolicySpec, log
) -> None:
    """Next-token loss on the sampled tokens of imperfect traces for random training problems:
    the response, or each turn of an episode (up to its end of turn), not the calculator's
    observations between them."""
    rng = random.Random(f"toy-policy-sft-{spec.seed}")
    task = spec.definition
    _, held_out = arithmetic.make_split(0, 0, 1000, task.min_digits, task.max_digits)
    held_out_set = set(held_out)
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.sft_lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=spec.sft_lr, total_steps=spec.sft_steps, pct_start=0.1
    )
    model.train()
    device = model.device
    for step in range(spec.sft_steps):
        sequences, masks = [], []
        while len(sequences) < spec.sft_batch_size:
            problem = arithmetic.sample_problem(rng, task.min_digits, task.max_digits)
            if problem in held_out_set:
                continue
            ids = tokenizer.encode(problem.prompt)
            mask = [0] * len(ids)
            for turn, observation in arithmetic.solution_turns(problem, rng, task.teacher):
                sampled = [*tokenizer.encode(turn), tokenizer.eos_token_id]
                forced = tokenizer.encode(observation) if observation else []
                ids += sampled + forced
                mask += [1] * len(sampled) + [0] * len(forced)
            sequences.append(ids)
            masks.append(mask)
        width = max(map(len, sequences))
        ids = torch.tensor(
            [s + [tokenizer.pad_token_id] * (width - len(s)) for s in sequences], device=device
        )  # [B, T]
        mask = torch.tensor(
            [m + [0] * (width - len(m)) for m in masks], dtype=torch.float32, device=device
        )  # [B, T]
        with planless_attention():  # widths change every batch
            logits = model(input_ids=ids).logits[:, :-1]  # [B, T-1, V]
        token_loss = torch.nn.functional.cross_entropy(
            logits.transpose(1, 2), ids[:, 1:], reduction="none"
        )
        loss = (token_loss * mask[:, 1:]).sum() / mask[:, 1:].sum()
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        if (step + 1) % 100 == 0:
            log(f"  warm-start step {step + 1}/{spec.sft_steps}: loss {loss.item():.3f}")
    model.eval()


def evaluate_toy_policy(
    model: Qwen2ForCausalLM,
    tokenizer: PreTrainedTokenizerFast,
    spec: ToyPolicySpec,
    size: int = 200,
) -> dict:
    """Greedy accuracy and response length on held-out problems (of greedy episodes on a
    multi-turn task, with their mean number of turns), and how varied samples are."""
    engine = HFEngine(model, [tokenizer.eos_token_id], tokenizer.pad_token_id)
    task = spec.definition
    _, held_out = arithmetic.make_split(0, 0, size, task.min_digits, task.max_digits)
    prompts = [Prompt(tuple(tokenizer.encode(p.prompt)), p.example()) for p in held_out]
    report = {}
    if spec.task in arithmetic.MULTI_TURN_TASKS:
        calculator = load_environment(None, "", timeout_s=10.0)
        loop = EpisodeLoop(calculator, tokenizer, MultiTurnConfig().max_turns, 80)
        greedy, stats = loop.run(prompts, 1, sampled_turns(engine, GREEDY, ("toy",), 0), 0)
        scores = [r.reward for r in greedy]
        report["mean_turns"] = stats.turns / size
    else:
        greedy = sample_rollouts(engine, prompts, 1, GREEDY, 80, ("toy",), 0)
        texts = [tokenizer.decode(r.token_ids, skip_special_tokens=True) for r in greedy]
        scores = [
            arithmetic.compute_score("", t, p.answer) for t, p in zip(texts, held_out, strict=True)
        ]
    sampled = engine.generate([GenRequest(prompts[0].ids, 80, seed=s) for s in range(16)])
    return {
        "val_acc": sum(scores) / size,
        "mean_response_length": sum(len(r.token_ids) for r in greedy) / size,
        **report,
        "distinct_samples_of_16": len({tuple(r.token_ids) for r in sampled}),
    }
