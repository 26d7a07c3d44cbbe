"""`specrl bench`: vanilla and speculative training, same config, seed and data, one process.

Arms: vanilla, spec (SPEC-RL: each slot verifies its own stored draft, `rollout.spec.reuse=slot`,
with token-tree drafts for the decoded tokens where `rollout.spec.tree.enabled` says so, by
default), trie (every slot walks its prompt's history trie, `reuse=trie`, always under the exact
rule, its default unless drafts are verified in decoding; tree drafts as configured), trie+tree
(history tries, and token-tree drafts for what is decoded whatever the config), spec-in-decoding (spec
with `rollout.spec.verify_mode=decoding`: stored drafts verified inside decoding, exact rule), tree (specrl's token-tree drafts only), spec+tree (both, whatever the
config), suffix (vLLM's own suffix decoding, `rollout.spec.tree.method=suffix`, no prefix reuse:
the anchor on the vllm engine) and spec+suffix (prefix reuse verified in one pass before decoding, the
rest drafted by vLLM's suffix decoding); the default is vanilla, spec and trie, `--arms`
picks others.
`--seeds 1,2,3` trains every arm once per seed: one run's final accuracy on a small held-out set
moves by a few points from seed to seed.

Before the timed arms, an untimed warm-up run (`--warmup-steps` vanilla steps, into DIR/warmup)
pays what the first training in a process pays once (on a GPU the CUDA context, the allocator's
pools and the kernels' first launches made the first arm's first epoch 3-4x slower than the
same work in later arms).

`--paired` (interleaved): every speculative arm rolls out with the vanilla arm's weights at every
step. Two runs of a real model in float32 part after a few steps (a near-tie sampled one way by a
decode forward and the other by a verification pass: "Exact, as measured" in
docs/speculative.md), and from there each arm trains its own policy: per-window ratios then
compare two trainings as much as two ways of rolling out. Paired, the arms' policies are one, so
a window's ratio is speculation's alone, and each step says what share of a speculative arm's
responses are vanilla's to the token (`bench/identical_responses`).

Writes DIR/bench.json and DIR/bench.png. Speeds are totals over the whole run, measured with
wall clocks around the rollout stage (verification included) and around whole steps.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import random
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch

from specrl.assemble import trainer_device
from specrl.bench_summary import WINDOW_STEPS, summarize, timing_warnings, window_lines
from specrl.config import Config, ConfigError, validated
from specrl.cost_model import ModelShape
from specrl.engines.build import engine_kind, hf_engine, rollout_policy
from specrl.errors import UserError
from specrl.lora import load_trained_weights
from specrl.models import eos_token_ids
from specrl.plots import plot_metrics
from specrl.projection import (
    calibrate,
    check_lines,
    machine_check,
    priced_window_lines,
    priced_windows,
    recorded_steps,
)
from specrl.run_dir import heldout_metric
from specrl.threads import run_threads
from specrl.trainer import Trainer
from specrl.types import Rollout

SPECRL_TREES = {"tree.enabled": True, "tree.method": "specrl"}
SUFFIX = {"tree.enabled": True, "tree.method": "suffix", "verify_mode": "full"}
SLOT = {"enabled": True, "reuse": "slot"}
# verify_mode only concerns slot drafts; full keeps vllm's resolved `decoding` off the walk
TRIE = {"enabled": True, "acceptance": "exact", "reuse": "trie", "verify_mode": "full"}
ARMS = {  # arm → what it sets under rollout.spec (the rest as configured)
    "vanilla": {"enabled": False, "tree.enabled": False},
    "spec": SLOT,
    "trie": TRIE,
    "trie+tree": {**TRIE, **SPECRL_TREES},
    "spec-in-decoding": {**SLOT, "verify_mode": "decoding", "tree.method": "specrl"},
    "tree": {"enabled": False, **SPECRL_TREES},
    "spec+tree": {**SLOT, **SPECRL_TREES},
    "suffix": {"enabled": False, **SUFFIX},
    "spec+suffix": {**SLOT, **SUFFIX},
}


DEFAULT_ARMS = ("vanilla", "spec", "trie")
WARMUP_STEPS = 2  # untimed vanilla steps before the timed arms


BENCH_PANELS = [
    ("timing_s/rollout", "rollout time per step (s)"),
    ("critic/score/mean", "reward (critic/score/mean)"),
    ("spec/reused_token_ratio", "reused token ratio"),
]
TREE_PANEL = ("spec/decode_drafts/tokens_per_forward", "tokens per sequence per decode forward")


def parse_arms(text: str) -> tuple[str, ...]:
    arms = tuple(a.strip() for a in text.split(",") if a.strip())
    unknown = [a for a in arms if a not in ARMS]
    if unknown or "vanilla" not in arms or len(arms) < 2:
        raise UserError(
            f"--arms {text!r}: give vanilla and at least one of {', '.join(list(ARMS)[1:])}, "
            "comma-separated" + (f" (unknown: {', '.join(unknown)})" if unknown else "")
        )
    return tuple(dict.fromkeys(arms))


def parse_seeds(text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        seeds = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        seeds = []
    if not seeds or any(seed < 0 for seed in seeds):
        raise UserError(f"--seeds {text!r}: give comma-separated non-negative integers, e.g. 1,2,3")
    return list(dict.fromkeys(seeds))


def run_bench(
    cfg: Config,
    out_dir: Path,
    arms: Sequence[str] | None = None,
    seeds: Sequence[int] | None = None,
    log=print,
    warmup_steps: int = WARMUP_STEPS,
    window: int = WINDOW_STEPS,
    interleave: bool = False,
    paired: bool = False,
) -> dict[str, Any]:
    """Every arm once per seed (default: the config's `trainer.seed`); with several seeds each
    seed's runs go to DIR/seed<N>/<arm> and bench.json pools them (see `summarize`). The arms
    take turns going first: seed k runs them rotated by k (`arm_order`), so with as many seeds
    as arms each arm runs once in every place, and a machine that slows down (or speeds up)
    over a long bench favours none of them. `interleave`: each seed's arms train at once, one
    step each in turn (`train_in_turns`), so a window's figures of two arms are measured over
    the same minutes. `paired` (interleaved only): the speculative arms roll out with the
    vanilla arm's weights at every step (`train_in_turns`)."""
    seeds = list(seeds or [cfg.trainer.seed])
    arms = arms or DEFAULT_ARMS
    if paired and (not interleave or "vanilla" not in arms):
        raise UserError("--paired: the arms share the vanilla arm's weights step by step; "
                        "add --interleave, and vanilla to the arms")  # fmt: skip
    if paired and cfg.learner_ranks > 1:
        raise UserError(
            f"--paired: the update runs on {cfg.learner_ranks} learner ranks, whose weights the "
            "bench cannot replace between steps; pair arms with one learner rank"
        )
    if interleave and engine_kind(cfg.rollout.name).one_per_process:
        raise UserError(
            f"--interleave: the arms would take turns in one {cfg.rollout.name} engine per "
            "process, each rolling out with the weights of the arm that updated last; run them "
            "one after another (without --interleave)"
        )
    if cfg.trainer.num_threads == "auto":  # decided once: every arm computes with the same
        cfg = cfg.model_copy(deep=True)
        cfg.trainer.num_threads, why = run_threads("auto", None)
        log(f"bench: {why or f'torch threads: {cfg.trainer.num_threads}'} (every arm)")
    # an arm the config cannot run stops the bench before any training
    configs = {arm: arm_config(cfg, arm, seeds[0], out_dir) for arm in arms}
    alike = [
        f"the arms {', '.join(group)} roll out with the same config here (tree drafts `auto` are "
        "on wherever speculation is): what separates their figures is this machine's noise"
        for group in alike_arms(configs)
    ]
    for warning in alike:
        log(f"bench: warning: {warning}")
    runs: dict[str, list[list[dict[str, float]]]] = {arm: [] for arm in arms}
    plotted: dict[str, list[dict[str, float]]] = {}
    load = {"start": _load_average()}  # the machine's load before and after each run
    warmup = warm_up(cfg, out_dir / "warmup", warmup_steps, log) if warmup_steps else None
    shape = None
    order = {seed: [*arms[k % len(arms) :], *arms[: k % len(arms)]] for k, seed in enumerate(seeds)}
    for seed in seeds:
        seed_dir = out_dir if len(seeds) == 1 else out_dir / f"seed{seed}"
        if interleave:
            log(f"bench: training the arms {', '.join(order[seed])} (seed {seed}) step by step, "
                f"taking turns, into {seed_dir}")  # fmt: skip
            histories, model_dir = train_in_turns(cfg, order[seed], seed, seed_dir, log, paired)
            load[f"seed {seed}"] = _load_average()
        else:
            histories = {}
            for arm in order[seed]:
                log(f"bench: training the {arm} arm (seed {seed}) into {seed_dir / arm}")
                trainer = Trainer(arm_config(cfg, arm, seed, seed_dir))
                trainer.fit()
                histories[arm], model_dir = trainer.run.tracker.history, trainer.run.model_dir
                load[f"{arm} seed {seed}"] = _load_average()
        model_dir = Path(model_dir)
        shape = shape or policy_shape(model_dir)
        for arm, history in histories.items():
            runs[arm].append(history)
            plotted[arm if len(seeds) == 1 else f"{arm} seed {seed}"] = history
    result = summarize(runs, cfg, seeds, window)
    result["arm_order"] = {str(seed): arms_run for seed, arms_run in order.items()}
    result["interleaved"] = interleave
    result["paired"] = paired
    result["warmup"] = warmup
    result["load_average"] = load
    result["warnings"] = alike + timing_warnings(result, load, os.cpu_count() or 1)
    for line in window_lines(result):
        log(f"bench: {line}")
    for warning in result["warnings"][len(alike) :]:
        log(f"bench: warning: {warning}")
    result["model_shape"] = asdict(shape)
    if engine_kind(cfg.rollout.name).timed_forwards:
        result["cost_model_check"] = check = _check_cost_model(cfg, runs, shape, model_dir, window)
        for line in check_lines(check):
            log(f"bench: cost model on this machine: {line}")
        for line in priced_window_lines(check["windows"]):
            log(f"bench: cost model on this machine: {line}")
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "bench.json").write_text(json.dumps(result, indent=2))
    title = f"specrl bench: {', '.join(arms)} ({cfg.rollout.spec.acceptance} rule)"
    heldout = heldout_metric([m for h in plotted.values() for m in h])
    panels = [*BENCH_PANELS[:2], heldout, *BENCH_PANELS[2:], TREE_PANEL]
    plot_metrics(plotted, panels, out_dir / "bench.png", title)
    return result


def train_in_turns(
    cfg: Config, arms: Sequence[str], seed: int, seed_dir: Path, log, paired: bool = False
) -> tuple[dict[str, list[dict[str, float]]], str]:
    """The arms' runs of one seed trained at once in one process, one step of each in turn (the
    first arm going first in odd steps, the last in even ones; a step's rollouts of every arm
    back to back, then their updates, so that they are timed as close together as they can
    be): their histories, and the policy they trained. Each run keeps its own global random
    generators (`RandomState`), so it computes what it would alone; the arms' own console lines
    give way to one line per step. `paired`: the vanilla arm updates first, and every other arm,
    after its own update, takes vanilla's weights (`adopt_weights`) before it evaluates, saves or
    rolls out again, so all roll out (and evaluate) one policy; each logs the share of its
    responses that equal vanilla's to the token."""
    trainers, states = {}, {}
    followers = [arm for arm in arms if arm != "vanilla"] if paired else []
    for arm in arms:
        arm_cfg = arm_config(cfg, arm, seed, seed_dir)
        arm_cfg.trainer.logger = [x for x in arm_cfg.trainer.logger if x != "console"]
        trainers[arm] = Trainer(arm_cfg)
        states[arm] = RandomState()  # as its build left them
    with contextlib.ExitStack() as stack:  # leaving, shuts the runs down
        for arm, trainer in trainers.items():
            with states[arm].active():
                stack.enter_context(trainer.running())
        turn = list(arms)
        while not all(t.finished for t in trainers.values()):
            collected, seconds = {}, {}
            for arm in turn:  # the arms' rollouts back to back, then their updates
                with states[arm].active():
                    collected[arm] = trainers[arm].begin_step()
            for arm in followers:
                collected[arm].metrics["bench/identical_responses"] = identical_share(
                    collected[arm].rollouts, collected["vanilla"].rollouts
                )
            for arm in sorted(turn, key=lambda a: a in followers):  # paired: vanilla's first
                adopt = None
                if arm in followers:
                    adopt = functools.partial(adopt_weights, trainers[arm], trainers["vanilla"])
                with states[arm].active():
                    metrics = trainers[arm].finish_step(collected[arm], adopt)
                seconds[arm] = metrics["timing_s/rollout"]
            step = trainers[arms[0]].run.global_step
            log(
                f"bench: step {step}: rollouts "
                + ", ".join(f"{a} {s:.2f} s" for a, s in seconds.items())
            )
            turn.reverse()
    histories = {arm: t.run.tracker.history for arm, t in trainers.items()}
    return histories, trainers[arms[0]].run.model_dir


def identical_share(rollouts: Sequence[Rollout], reference: Sequence[Rollout]) -> float:
    """The share of `rollouts` whose tokens equal those of the same prompt's same slot in
    `reference` (a step's responses of two arms)."""
    tokens = {(r.prompt.prompt_id, r.slot): r.token_ids for r in reference}
    same = sum(tokens.get((r.prompt.prompt_id, r.slot)) == r.token_ids for r in rollouts)
    return same / max(len(rollouts), 1)


def adopt_weights(follower: Trainer, leader: Trainer) -> None:
    """The follower's policy takes the leader's trained weights (all of them, or with LoRA its
    adapters), and its rollout engine with them."""
    with torch.no_grad():
        load_trained_weights(follower.run.actor.policy, leader.run.actor.weights())
    follower.run.sync_weights()


class RandomState:
    """The process's global random generators (Python's, NumPy's, torch's on the CPU and on
    CUDA) as one run left them: runs taking turns in one process each draw from their own."""

    def __init__(self) -> None:
        self.save()

    def save(self) -> None:
        self.state = (
            random.getstate(),
            np.random.get_state(),
            torch.get_rng_state(),
            torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
        )

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        python, numpy, cpu, cuda = self.state
        random.setstate(python)
        np.random.set_state(numpy)
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)
        try:
            yield
        finally:
            self.save()


def warm_up(cfg: Config, out_dir: Path, steps: int, log) -> dict[str, Any]:
    """An untimed vanilla run of `steps` steps (no evaluation, no checkpoint) with the bench's
    config: what the first training in a process pays once is paid here, not by the first arm."""
    warm = arm_config(cfg, "vanilla", cfg.trainer.seed, out_dir)
    warm.trainer.output_dir = str(out_dir)
    warm.trainer.total_training_steps = steps
    warm.trainer.val_before_train = False
    warm.trainer.test_freq = 0
    warm.trainer.save_freq = 0
    warm.trainer.logger = ["jsonl"]
    log(f"bench: warming up with {steps} untimed vanilla steps into {out_dir}")
    started = time.perf_counter()
    Trainer(warm).fit()
    return {"arm": "vanilla", "steps": steps, "seconds": time.perf_counter() - started}


def _check_cost_model(
    cfg: Config,
    runs: dict[str, list[list[dict[str, float]]]],
    shape: ModelShape,
    model_dir: Path,
    window: int,
) -> dict[str, Any]:
    """The cost model on this machine: constants from timed forwards of a transformers engine
    on the bench's policy (the arms' threads and device, decoding as they did: through its LoRA
    adapters, at static shapes, as CUDA graphs on CUDA, with `rollout.static_decode`), every
    arm's seconds in forwards predicted from its steps, and per `window` steps (`windows`) its
    rollout seconds priced by the work it did (`priced_windows`)."""
    policy, tokenizer = rollout_policy(cfg, model_dir)
    engine = hf_engine(
        cfg, policy.to(trainer_device(cfg)), eos_token_ids(policy, tokenizer),
        tokenizer.pad_token_id,
    )  # fmt: skip
    per_seed = {arm: [recorded_steps(h) for h in histories] for arm, histories in runs.items()}
    device = calibrate(engine, shape)
    check = machine_check(
        {arm: [s for steps in seeds for s in steps] for arm, seeds in per_seed.items()},
        shape,
        device,
    )
    check["windows"] = priced_windows(per_seed, shape, device, window)
    return check


def policy_shape(model_dir: Path) -> ModelShape:
    """The shape of the policy a bench trains, for the cost model."""
    config = json.loads((model_dir / "config.json").read_text())
    return ModelShape.from_config(model_dir.name, config)


def _load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def alike_arms(configs: dict[str, Config]) -> list[list[str]]:
    """The groups of arms whose rollouts are configured alike once `auto` token-tree drafts are
    resolved (`uses_tree`): under the defaults trie and trie+tree, spec and spec+tree."""
    groups: dict[str, list[str]] = {}
    for arm, arm_cfg in configs.items():
        spec = arm_cfg.rollout.spec.model_copy(deep=True)
        spec.tree.enabled = spec.uses_tree()
        groups.setdefault(spec.model_dump_json(), []).append(arm)
    return [group for group in groups.values() if len(group) > 1]


def arm_config(cfg: Config, arm: str, seed: int, seed_dir: Path) -> Config:
    """The config of one arm's run: the bench's config with the arm's speculation, seed and
    output directory."""
    arm_cfg = cfg.model_copy(deep=True)
    for key, value in ARMS[arm].items():
        *sections, name = key.split(".")
        setattr(functools.reduce(getattr, sections, arm_cfg.rollout.spec), name, value)
    arm_cfg.trainer.seed = seed
    arm_cfg.trainer.output_dir = str(seed_dir / arm)
    arm_cfg.trainer.resume_mode = "disable"  # a benchmark always measures a fresh run
    arm_cfg.trainer.experiment_name = f"{cfg.trainer.experiment_name}-{arm}"
    try:
        return validated(arm_cfg.model_dump())  # the checks across keys, per arm
    except ConfigError as err:
        raise UserError(f"--arms {arm}: {err}") from None
