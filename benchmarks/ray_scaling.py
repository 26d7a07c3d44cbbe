"""Scaling on Ray: the rollout stage with 1 and 2 rollout workers (fixed policy), then whole
training steps with N = 1, 2 rollout workers and K = 1, 2 learner ranks.

Part 1, the rollout stage.

The built-in policy rolls out 64 training prompts of the default task for several rounds (each
round a batch of `data.train_batch_size` = 32 prompts × `rollout.n` slots; two batches per epoch,
so from round 2 on every prompt has drafts, verified with the default exact rule, and a tree). Four arms, each
with its own stage state and the same seeds, run interleaved round by round so they see the
same machine state: in-process (torch at 1 thread), 1 worker, 2 workers (1 thread each), and 2
workers with SRT run-ahead (after each round the workers sample one response per prompt of the
next batch into its trees; in training that overlaps the update, here it is timed apart).
Every arm samples the same tokens; only time differs.

Per arm and round it records the rollout wall time, the busiest worker's time (the rest is
dispatch: planning, hand-over, (de)serialisation), the predicted and measured imbalance, the
prompts migrated, and the time of one weight sync (ray.put + every worker loading it). From
them: Ray's overhead (T1 / T_in-process), the parallel efficiency T_in-process / (2 · T2), and a
step-time model

    T(N) = d(N) + W · imbalance(N) / N

with W the in-process rollout time and d the dispatch overhead measured at N = 1; its
prediction for N = 2 is checked against the measurement and it projects larger N (dispatch
held at its N = 2 value, imbalance at 1.08, the planner's level at 8-64 workers). The 1-minute
load average is recorded before and after: a run started on a busy machine (load > 0.5) is
flagged.

Part 2, training steps. Four trainers with the default config (1 torch thread in the trainer's
process, in each worker and in each rank), N rollout workers and K learner ranks for (N, K) in
{1, 2}², train step by step interleaved, from the same policy, seeds and data. Per step the
trainer's own timings: step, rollout, actor update (with K > 1: the ranks' update and the
gather of the new weights into the trainer), weight sync. From them: the update's parallel
efficiency U(1) / (2 U(2)) and a step-time model

    T(N, K) = R(N) + U(K) + O

with R(N) measured at (N, 1), U(K) at (1, K) and O, everything else, at (1, 1); its prediction
for (2, 2) is checked against the measurement, and it projects N = K = k (R: dispatch d(1) +
(R(1) - d(1)) * 1.08 / k; U: its K = 2 overhead U(2) - U(1) / 2, held constant, + U(1) / k).

Writes OUT/ray_scaling.json and OUT/ray_scaling.png.

    python benchmarks/ray_scaling.py --out benchmarks/cpu-hf-ray-scaling
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import numpy as np
import ray
import torch
import transformers

from specrl.config import load_config
from specrl.distributed.learner import LearnerGroup
from specrl.distributed.ray_cluster import start_ray
from specrl.distributed.rollout import RolloutWorkers
from specrl.models import eos_token_ids
from specrl.speculative.stage import SpeculativeStage
from specrl.trainer import Trainer

ARMS = ("in-process", "1 worker", "2 workers", "2 workers + run-ahead")
STEP_ARMS = ((1, 1), (1, 2), (2, 1), (2, 2))  # (rollout workers N, learner ranks K)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="ray-scaling")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--steps", type=int, default=10, help="training steps per (N, K) arm")
    args = parser.parse_args()
    out = Path(args.out)
    load_before = os.getloadavg()[0]
    cfg = load_config(
        None,
        [
            f"trainer.output_dir={out / 'run'}",
            "trainer.logger=[]",
            "trainer.resume_mode=disable",
            # logical CPUs: part 1's five workers, then part 2's ten workers and ranks all
            # exist; one group runs at a time
            "ray_kwargs.ray_init.num_cpus=10",
            # two batches per epoch: from round 2 on every prompt has drafts and a tree
            "data.train_size=64",
        ],
    )
    trainer = Trainer(cfg)  # the built-in policy, tokenizer, data and engine
    start_ray(cfg.ray_kwargs.ray_init)
    sampling = trainer.run.rollouts.stage.sampling
    policy = trainer.run.actor.policy
    eos = eos_token_ids(policy, trainer.run.tokenizer)
    groups = {
        k: RolloutWorkers(
            cfg.model_copy(update={"rollout": cfg.rollout.model_copy(update={"num_workers": k})}),
            trainer.run.model_dir,
            eos,
            trainer.run.tokenizer.pad_token_id,
            sampling,
        )
        for k in (1, 2)
    }
    ahead_cfg = cfg.model_copy(
        update={"rollout": cfg.rollout.model_copy(update={"num_workers": 2, "run_ahead": True})}
    )
    groups["ahead"] = RolloutWorkers(
        ahead_cfg, trainer.run.model_dir, eos, trainer.run.tokenizer.pad_token_id, sampling
    )
    sync_s = {k: [] for k in (1, 2)}
    for k, group in groups.items():
        for _ in range(3):
            start = time.perf_counter()
            group.load_weights(policy.state_dict(), 0)
            if k in sync_s:
                sync_s[k].append(time.perf_counter() - start)
    R, n = cfg.data.max_response_length, cfg.rollout.n
    local = SpeculativeStage(trainer.run.rollouts.engine, sampling, R, cfg.rollout.spec)
    torch.set_num_threads(1)  # as each worker runs
    history: dict[str, list[dict[str, float]]] = {arm: [] for arm in ARMS}
    identical = True
    for round_ in range(args.rounds):
        batch = trainer.run.loader.next_batch()
        tokens = []
        for arm, stage in zip(ARMS, (local, groups[1], groups[2], groups["ahead"]), strict=True):
            start = time.perf_counter()
            rollouts, stats = stage(batch, n, ("ray-bench", round_), 0)
            wall = time.perf_counter() - start
            busy = stats.worker_busy_max_s if stats.workers else wall
            history[arm].append(
                {
                    "training/global_step": round_,
                    "rollout_s": wall,
                    "busiest_worker_s": busy,
                    "dispatch_s": wall - busy,
                    "imbalance": stats.ratios().get("perf/rollout_imbalance", 1.0),
                    "migrated_prompts": stats.migrated_prompts,
                    "reused_token_ratio": stats.ratios()["spec/reused_token_ratio"],
                }
            )
            tokens.append([r.token_ids for r in rollouts])
            if arm.endswith("run-ahead"):  # timed apart: in training it overlaps the update
                start = time.perf_counter()
                stage.run_ahead(trainer.run.loader.peek(), ("ray-bench-ahead", round_), 0)
                stage.collect_run_ahead()
                history[arm][-1]["run_ahead_s"] = time.perf_counter() - start
                history[arm][-1]["drafted_tokens"] = stats.drafted_tokens
            print(f"round {round_} {arm}: {wall:.2f} s", flush=True)
        identical &= all(t == tokens[0] for t in tokens)
    for group in groups.values():
        group.shutdown()

    def mean(arm: str, key: str) -> float:
        return float(np.mean([m[key] for m in history[arm][2:]]))  # from the first drafts on

    w, t1, t2 = (
        mean("in-process", "rollout_s"),
        mean("1 worker", "rollout_s"),
        mean("2 workers", "rollout_s"),
    )
    d1, d2 = mean("1 worker", "dispatch_s"), mean("2 workers", "dispatch_s")
    imbalance2 = mean("2 workers", "imbalance")
    predicted2 = d1 + w * imbalance2 / 2
    projection = {
        str(k): d2 + w * 1.08 / k for k in (4, 8, 16, 32, 64)
    }  # in-process seconds of this batch, spread over k workers
    steps, step_history = step_scaling(cfg, out, args.steps, d1)
    load_after = os.getloadavg()[0]
    result = {
        "rounds": args.rounds,
        "prompts_per_round": cfg.data.train_batch_size,
        "slots": n,
        "acceptance": cfg.rollout.spec.acceptance,
        "rollout_s": {"in-process": w, "1 worker": t1, "2 workers": t2},
        "ray_overhead": t1 / w,
        "parallel_efficiency": w / (2 * t2),
        "speedup_2_workers": w / t2,
        "dispatch_s": {"1 worker": d1, "2 workers": d2},
        "imbalance_2_workers": imbalance2,
        "migrated_prompts_per_round": mean("2 workers", "migrated_prompts"),
        "sync_s": {f"{k} worker(s)": float(np.median(v)) for k, v in sync_s.items()},
        "run_ahead": {
            "rollout_s": mean("2 workers + run-ahead", "rollout_s"),
            "run_ahead_s": mean("2 workers + run-ahead", "run_ahead_s"),
            "rollout_saved_s": t2 - mean("2 workers + run-ahead", "rollout_s"),
            "pays_if_not_overlapped": t2
            > mean("2 workers + run-ahead", "rollout_s")
            + mean("2 workers + run-ahead", "run_ahead_s"),
        },
        "model": {
            "formula": "T(N) = d(N) + W * imbalance(N) / N",
            "W_s": w,
            "predicted_2_workers_s": predicted2,
            "measured_2_workers_s": t2,
            "relative_error": predicted2 / t2 - 1,
            "projection_s": projection,
        },
        "identical_rollouts": identical,
        "steps": steps,
        "load_average": {"before": load_before, "after": load_after},
        "busy_machine": load_before > 0.5,
        "engine": f"hf (transformers {transformers.__version__}, torch {torch.__version__})",
        "ray": ray.__version__,
        "machine": f"{platform.machine()} {os.cpu_count()} cores, 1 torch thread per arm",
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "ray_scaling.json").write_text(json.dumps(result, indent=2))
    _plot(history, step_history, result, out / "ray_scaling.png")
    print(json.dumps(result, indent=2))


STEP_KEYS = {
    "step": "timing_s/step",
    "rollout": "timing_s/rollout",
    "update_actor": "timing_s/update_actor",
    "sync": "timing_s/sync",
}


def step_scaling(
    cfg, out: Path, count: int, d1: float
) -> tuple[dict, dict[str, list[dict[str, float]]]]:
    """Part 2: `count` training steps per (N, K) arm, interleaved step by step (the first two,
    warm-up, left out of the means). → the summary and each arm's timings per step."""
    trainers = {}
    for n, k in STEP_ARMS:
        arm_cfg = load_config(
            None,
            [
                f"trainer.output_dir={out / f'run-{n}-{k}'}",
                "trainer.logger=[]",
                "trainer.resume_mode=disable",
                "trainer.num_threads=1",
                "ray_kwargs.ray_init.num_cpus=10",
                f"data.train_size={cfg.data.train_size}",
                f"rollout.num_workers={n}",
                f"actor.num_workers={k}",
            ],
        )
        trainers[f"N={n} K={k}"] = Trainer(arm_cfg)
    torch.set_num_threads(1)
    history: dict[str, list[dict[str, float]]] = {arm: [] for arm in trainers}
    for step in range(1, count + 1):
        for arm, trainer in trainers.items():
            trainer.run.global_step = step
            metrics = trainer.train_step()
            history[arm].append(
                {"training/global_step": step, **{k: metrics[v] for k, v in STEP_KEYS.items()}}
            )
            print(f"step {step} {arm}: {metrics['timing_s/step']:.2f} s", flush=True)
    for trainer in trainers.values():
        trainer.run.rollouts.shutdown()
        if isinstance(trainer.run.actor, LearnerGroup):
            trainer.run.actor.shutdown()
        trainer.run.lock.release()

    def mean(arm: str, key: str) -> float:
        return float(np.mean([m[key] for m in history[arm][2:]]))

    T = {arm: mean(arm, "step") for arm in trainers}
    R = {n: mean(f"N={n} K=1", "rollout") for n in (1, 2)}
    U = {k: mean(f"N=1 K={k}", "update_actor") for k in (1, 2)}
    other = T["N=1 K=1"] - R[1] - U[1]
    predicted = R[2] + U[2] + other
    update_overhead = U[2] - U[1] / 2
    projection = {
        str(k): d1 + (R[1] - d1) * 1.08 / k + update_overhead + U[1] / k + other
        for k in (4, 8, 16, 32, 64)
    }
    summary = {
        "steps_per_arm": count,
        "step_s": T,
        "rollout_s": {arm: mean(arm, "rollout") for arm in trainers},
        "update_actor_s": {arm: mean(arm, "update_actor") for arm in trainers},
        "sync_s": {arm: mean(arm, "sync") for arm in trainers},
        "update_parallel_efficiency": U[1] / (2 * U[2]),
        "update_speedup_2_ranks": U[1] / U[2],
        "step_speedup_2x2": T["N=1 K=1"] / T["N=2 K=2"],
        "model": {
            "formula": "T(N, K) = R(N) + U(K) + O",
            "R_s": R,
            "U_s": U,
            "O_s": other,
            "predicted_2_2_s": predicted,
            "measured_2_2_s": T["N=2 K=2"],
            "relative_error": predicted / T["N=2 K=2"] - 1,
            "projection_N_eq_K_s": projection,
        },
    }
    return summary, history


def _plot(
    history: dict[str, list[dict[str, float]]],
    step_history: dict[str, list[dict[str, float]]],
    result: dict,
    path: Path,
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right, steps) = plt.subplots(1, 3, figsize=(16, 3.5))
    for arm, rows in history.items():
        left.plot(
            [m["training/global_step"] for m in rows], [m["rollout_s"] for m in rows], label=arm
        )
    left.set_title("rollout time per round (s)")
    left.set_xlabel("round")
    left.legend()
    measured = {1: result["rollout_s"]["1 worker"], 2: result["rollout_s"]["2 workers"]}
    projected = {int(k): v for k, v in result["model"]["projection_s"].items()}
    right.plot(list(measured), list(measured.values()), "o", label="measured")
    right.plot([2], [result["model"]["predicted_2_workers_s"]], "x", label="model at N = 2")
    right.plot(list(projected), list(projected.values()), "--", label="model, projected")
    right.axhline(result["rollout_s"]["in-process"], color="grey", lw=0.8, label="in-process")
    right.set_xscale("log", base=2)
    right.set_yscale("log")
    right.set_title("rollout time per batch vs rollout workers N")
    right.set_xlabel("N")
    right.legend()
    arms = list(step_history)
    parts = ("rollout", "update_actor", "sync")
    bottom = np.zeros(len(arms))
    for part in parts:
        values = np.array([np.mean([m[part] for m in step_history[a][2:]]) for a in arms])
        steps.bar(arms, values, bottom=bottom, label=part)
        bottom += values
    totals = [result["steps"]["step_s"][a] for a in arms]
    steps.plot(arms, totals, "k_", markersize=30, label="step (incl. the rest)")
    steps.plot(
        [arms[-1]], [result["steps"]["model"]["predicted_2_2_s"]], "rx", label="model at (2, 2)"
    )
    steps.set_title("training step (s): N rollout workers, K learner ranks")
    steps.legend(fontsize=7)
    fig.suptitle("specrl on Ray (1 thread per process)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    main()
