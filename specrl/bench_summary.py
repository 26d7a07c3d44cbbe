"""The figures of a finished `specrl bench`: every arm's speed, reuse and accuracy against the
vanilla arm's, pooled over seeds (`summarize`, what bench.json holds), and what makes its timings
untrustworthy (`timing_warnings`)."""

from __future__ import annotations

import math
import platform
import statistics
from collections.abc import Sequence
from typing import Any

import torch

from specrl.config import Config
from specrl.engines.build import describe_engine
from specrl.run_dir import heldout_metric
from specrl.speculative.stats import RolloutStats

WINDOW_STEPS = 8  # steps per window of the per-window figures
CAPTURES = ("capture_s", "vanilla_capture_s", "speedup_without_captures")  # docs/performance.md
EPOCH0_TOLERANCE = 0.15  # the arms' first epochs, the same work, may differ this much


def summarize(
    runs: dict[str, list[list[dict[str, float]]]],
    cfg: Config,
    seeds: Sequence[int],
    window: int = WINDOW_STEPS,
) -> dict[str, Any]:
    """The SPEC-RL comparison (spec against vanilla) at the top level when the spec arm ran, and
    every arm's speed and accuracy under `arms`. `runs` holds each arm's history per seed: times
    and token counts are totals over all seeds (summed `RolloutStats`), final accuracies the
    mean over seeds (each seed's under `arms.<arm>.final_acc_per_seed`) of the held-out figure
    named by `heldout_metric`: accuracy where the reward states it, else the reward. Each arm's
    `windows` give the same figures per `window` steps (every seed's steps of the window), its
    `per_seed` the run of each seed against vanilla's run of that seed."""
    steps = {arm: [m for h in hs for m in _train_steps(h)] for arm, hs in runs.items()}
    totals = {arm: RolloutStats.of_steps(s) for arm, s in steps.items()}
    heldout, _ = heldout_metric([m for hs in runs.values() for h in hs for m in h])
    final = {arm: [_last(h, heldout) for h in hs] for arm, hs in runs.items()}
    step_time = {arm: _total(s, "timing_s/step") for arm, s in steps.items()}
    result: dict[str, Any] = {}
    if "spec" in steps:
        result.update(_spec_rl(steps["spec"], totals, step_time))
        result["final_acc_vanilla"] = _mean(final["vanilla"])
        result["final_acc_spec"] = _mean(final["spec"])
    result["arms"] = {}
    vanilla = totals["vanilla"]
    decode_s = vanilla.gen_s / max(vanilla.decoded_tokens, 1)  # vanilla's seconds per token
    for arm, total in totals.items():
        a = total.ratios()["spec/reused_token_ratio"]
        # r_eff: seconds of verification (the verification pass, or the trie pass and walk) per
        # reused token, over vanilla's seconds per decoded token (none where nothing was reused)
        reused = total.reused_tokens
        r_eff = total.verify_s / reused / decode_s if reused else None
        per_step = len(steps[arm]) or 1
        speedup = vanilla.rollout_s / total.rollout_s
        summary = {
            "rollout_time_s": total.rollout_s,
            "step_time_s": step_time[arm],
            "rollout_speedup": speedup,
            # the run's ratio of vanilla's step rollout times to the arm's: its standard error
            "rollout_speedup_se": _scaled(speedup, _paired_log_se(steps[arm], steps["vanilla"])),
            # epoch 0 has nothing to reuse: the same work in every arm, a check of the machine
            "epoch0_rollout_s": _total(_epochs(steps[arm], 0, 0), "timing_s/rollout"),
            # the standard error of its log ratio to vanilla's, steps paired
            "epoch0_log_ratio_se": _paired_log_se(
                _epochs(steps[arm], 0, 0), _epochs(steps["vanilla"], 0, 0)
            ),
            "rollout_speedup_after_epoch0": _total(_epochs(steps["vanilla"], 1), "timing_s/rollout")
            / max(_total(_epochs(steps[arm], 1), "timing_s/rollout"), 1e-9),
            "step_speedup": step_time["vanilla"] / step_time[arm],
            "final_acc": _mean(final[arm]),
            "final_acc_per_seed": final[arm],
            "per_seed": _per_seed(runs[arm], runs["vanilla"], seeds, heldout),
            "second_half_acc": _mean([_second_half(h, heldout) for h in runs[arm]]),
            "response_tokens": total.response_tokens,
            "decoded_tokens": total.decoded_tokens,
            "decoded_token_ratio": total.decoded_tokens / max(vanilla.decoded_tokens, 1),
            "reused_token_ratio": a,
            "reused_token_ratio_per_epoch": _per_epoch(steps[arm]),
            "verified_tokens_per_step": total.verified_tokens / per_step,
            "trie_nodes_per_step": total.trie_nodes / per_step,
            "verify_cost_per_reused_token": r_eff,
            "limit_speedup": 1.0 / ((1.0 - a) + (r_eff or 0.0) * a),
            "verify_free_speedup": _verify_free_speedup(steps[arm], steps["vanilla"]),
            "slowest_slot_forwards_per_step": total.slowest_forwards / per_step,
            "engine_time_s": total.engine_s,
            "perf": total.compute.metrics(),  # the engine's forwards, summed over the steps
        }
        if "spec" in totals and arm != "spec":
            summary["rollout_speedup_vs_spec"] = totals["spec"].rollout_s / total.rollout_s
        if total.decode_drafts:
            ratios = total.ratios()
            summary["tokens_per_forward"] = ratios["spec/decode_drafts/tokens_per_forward"]
            summary["drafted_tokens"] = total.drafted_tokens
            summary["accepted_draft_tokens"] = total.accepted_draft_tokens
            summary["accept_rate"] = ratios["spec/decode_drafts/accept_rate"]
            summary["mean_width"] = ratios["spec/decode_drafts/mean_width"]
            summary["tree_nodes_max"] = max(m.get("spec/tree/nodes", 0) for m in steps[arm])
        summary["windows"] = _windows(steps[arm], steps["vanilla"], window)
        summary.update(_episodes(steps[arm]))
        result["arms"][arm] = summary
    result.update(
        heldout_metric=heldout,
        steps=len(steps["vanilla"]) // len(seeds),
        seeds=list(seeds),
        acceptance=cfg.rollout.spec.acceptance,
        log_lenience=cfg.rollout.spec.log_lenience,
        verify_mode=cfg.rollout.spec.verify_mode,
        rollout_is=cfg.algorithm.rollout_correction.rollout_is,
        tree=cfg.rollout.spec.tree.model_dump(),
        engine=describe_engine(cfg.rollout.name),
        machine=f"{platform.machine()} {platform.processor() or ''} "
        f"{torch.get_num_threads()} threads".strip(),
        device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
    )
    return result


def _per_seed(
    histories: list[list[dict[str, float]]],
    vanilla: list[list[dict[str, float]]],
    seeds: Sequence[int],
    heldout: str,
) -> dict[str, dict[str, float | None]]:
    """Per seed: rollout seconds, speedups against vanilla's run of the same seed (whole run and
    after epoch 0), reuse and the final held-out figure."""
    out = {}
    for seed, history, base in zip(seeds, histories, vanilla, strict=True):
        steps, base_steps = _train_steps(history), _train_steps(base)
        total, base_total = RolloutStats.of_steps(steps), RolloutStats.of_steps(base_steps)
        later = _total(_epochs(steps, 1), "timing_s/rollout")
        out[str(seed)] = {
            "rollout_time_s": total.rollout_s,
            "rollout_speedup": base_total.rollout_s / total.rollout_s,
            "rollout_speedup_after_epoch0": _total(_epochs(base_steps, 1), "timing_s/rollout")
            / max(later, 1e-9),
            "reused_token_ratio": total.ratios()["spec/reused_token_ratio"],
            "final_acc": _last(history, heldout),
        }
    return out


def _spec_rl(
    s_steps: list[dict[str, float]],
    totals: dict[str, RolloutStats],
    step_time: dict[str, float],
) -> dict[str, Any]:
    vanilla, spec = totals["vanilla"], totals["spec"]
    # r: seconds per verified token (spec arm) over seconds per decoded token (vanilla arm)
    r = (spec.verify_s / max(spec.verified_tokens, 1)) / (
        vanilla.gen_s / max(vanilla.decoded_tokens, 1)
    )
    a = spec.ratios()["spec/reused_token_ratio"]
    later = RolloutStats.of_steps([m for m in s_steps if m["training/epoch"] >= 1]).ratios()
    return {
        "rollout_speedup": vanilla.rollout_s / spec.rollout_s,
        "step_speedup": step_time["vanilla"] / step_time["spec"],
        "reused_token_ratio": later["spec/reused_token_ratio"],
        "reused_token_ratio_all_steps": a,
        "full_reuse_ratio": later["spec/full_reuse_ratio"],
        "verified_token_ratio": spec.ratios()["spec/verified_token_ratio"],
        "verify_cost_ratio": r,
        "limit_speedup": 1.0 / ((1.0 - a) + r * a),
        "rollout_time_s": {"vanilla": vanilla.rollout_s, "spec": spec.rollout_s},
        "step_time_s": {"vanilla": step_time["vanilla"], "spec": step_time["spec"]},
        "decoded_tokens": {"vanilla": vanilla.decoded_tokens, "spec": spec.decoded_tokens},
    }


def _episodes(steps: list[dict[str, float]]) -> dict[str, Any]:
    """Multi-turn runs: turns per episode, the environment's seconds (inside the rollout time)
    and, in speculative arms, the reused token ratio of each turn."""
    if not any("num_turns/mean" in m for m in steps):
        return {}
    out: dict[str, Any] = {
        "num_turns_mean": _total(steps, "num_turns/mean") / len(steps),
        "env_time_s": _total(steps, "timing_s/env"),
    }
    suffix = "/response_tokens"
    turns = sorted(
        {int(k.split("/")[1].removeprefix("turn_")) for m in steps for k in m
         if k.startswith("spec/turn_") and k.endswith(suffix)}
    )  # fmt: skip
    if turns:
        out["reused_token_ratio_per_turn"] = {
            t: _total(steps, f"spec/turn_{t}/reused_tokens")
            / max(_total(steps, f"spec/turn_{t}{suffix}"), 1.0)
            for t in turns
        }
    return out


def _windows(
    steps: list[dict[str, float]], vanilla: list[dict[str, float]], window: int
) -> list[dict[str, Any]]:
    """Per `window` steps: rollout seconds (and vanilla's over the same steps), reuse, and the
    trie's nodes stored, verified and prompts skipped per step (the budget's decisions). The
    speedup's standard error is that of the mean log ratio of the arms' steps, paired step by
    step (each seed's steps in order): the machine's noise, and how the ratio varies over the
    window, in one figure. What verification cost, and what a budget could still gain:
    `verify_free_speedup` is the speedup had verification taken no time (its forwards, walks
    and host work; the prompts' prefill, which a trie pass includes, at vanilla's cost), at the
    reuse the arm got; `reachable_token_ratio` the share of the response tokens a walk of the
    whole tries would have reused (what the budget's pruning left); with graphs, `CAPTURES`."""
    last = int(max((m["training/global_step"] for m in steps), default=0))
    out = []
    for first in range(1, last + 1, window):
        end = min(first + window - 1, last)
        mine = [m for m in steps if first <= m["training/global_step"] <= end]
        theirs = [m for m in vanilla if first <= m["training/global_step"] <= end]
        total = RolloutStats.of_steps(mine)
        rollout_s = _total(mine, "timing_s/rollout")
        vanilla_s = _total(theirs, "timing_s/rollout")
        speedup = vanilla_s / max(rollout_s, 1e-9)
        log_se = _paired_log_se(mine, theirs)
        captures = [_total(arm, "timing_s/capture/decode") for arm in (mine, theirs)]
        out.append(
            {
                "steps": f"{first}-{end}",
                "rollout_s": rollout_s,
                "vanilla_rollout_s": vanilla_s,
                "rollout_speedup": speedup,
                "rollout_speedup_se": _scaled(speedup, log_se),
                "verify_s": total.verify_s,
                "verify_free_speedup": _verify_free_speedup(mine, theirs),
                "reused_token_ratio": total.ratios()["spec/reused_token_ratio"],
                "reachable_token_ratio": total.trie_reachable_tokens
                / max(total.response_tokens, 1),
                "response_tokens_per_step": total.response_tokens / max(len(mine), 1),
                "trie_nodes_stored_per_step": total.trie_nodes_stored / max(len(mine), 1),
                "trie_nodes_per_step": total.trie_nodes / max(len(mine), 1),
                "trie_prompts_skipped": total.trie_prompts_skipped,
                "trie_passes_skipped": total.trie_passes_skipped,
                "trie_expected_tokens": total.trie_expected_tokens,
                "reused_tokens": total.reused_tokens,
            }
        )
        if any(captures):
            without = (vanilla_s - captures[1]) / max(rollout_s - captures[0], 1e-9)
            out[-1] |= dict(zip(CAPTURES, [*captures, without], strict=True))
        identical = [
            m["bench/identical_responses"] for m in mine if "bench/identical_responses" in m
        ]
        if identical:  # a paired bench: the share of responses that are vanilla's to the token
            out[-1]["identical_responses"] = statistics.fmean(identical)
    return out


def window_lines(result: dict[str, Any]) -> list[str]:
    """The per-window figures of every speculative arm, as table rows."""
    lines = []
    for arm, summary in result["arms"].items():
        if arm == "vanilla":
            continue
        for w in summary["windows"]:
            lines.append(
                f"{arm} steps {w['steps']}: rollouts {w['rollout_s']:.1f} s vs vanilla's "
                f"{w['vanilla_rollout_s']:.1f} s ({w['rollout_speedup']:.2f}x"
                + (
                    f" ± {w['rollout_speedup_se']:.2f}"
                    if w["rollout_speedup_se"] is not None
                    else ""
                )
                + f"), verification {w['verify_s']:.1f} s (verification-free "
                f"{w['verify_free_speedup']:.2f}x), reuse {w['reused_token_ratio']:.3f} of "
                f"{w['reachable_token_ratio']:.3f} reachable, trie nodes verified/stored per step "
                f"{w['trie_nodes_per_step']:.0f}/{w['trie_nodes_stored_per_step']:.0f}, "
                f"prompts skipped {w['trie_prompts_skipped']:.0f}, passes skipped "
                f"{w['trie_passes_skipped']:.0f}"
                + (
                    f", responses identical to vanilla's {w['identical_responses']:.3f}"
                    if "identical_responses" in w
                    else ""
                )
                + (
                    ", graph captures {:.1f} s (vanilla's {:.1f} s): {:.2f}x without them".format(
                        *map(w.get, CAPTURES)
                    )
                    if "capture_s" in w
                    else ""
                )
            )
    return lines


def _verify_free_speedup(mine: list[dict[str, float]], vanilla: list[dict[str, float]]) -> float:
    """Vanilla's rollout seconds over the arm's had its verification taken none (its forwards,
    walks and host work), the prompts' prefill (inside a trie pass) at vanilla's cost."""
    arm, theirs = RolloutStats.of_steps(mine), RolloutStats.of_steps(vanilla)
    free_s = arm.rollout_s - arm.verify_s - arm.compute.prefill_seconds
    return theirs.rollout_s / max(free_s + theirs.compute.prefill_seconds, 1e-9)


def _epochs(steps: list[dict[str, float]], first: int, last: float = math.inf) -> list[dict]:
    """The steps of epochs `first` to `last`."""
    return [m for m in steps if first <= m["training/epoch"] <= last]


def _per_epoch(steps: list[dict[str, float]]) -> dict[str, float]:
    """The reused token ratio of each epoch ("0": the first, which has nothing to reuse)."""
    epochs = sorted({int(m["training/epoch"]) for m in steps})
    return {
        str(e): RolloutStats.of_steps(_epochs(steps, e, e)).ratios()["spec/reused_token_ratio"]
        for e in epochs
    }


def _second_half(history: list[dict[str, float]], key: str) -> float | None:
    """The mean of `key` over the evaluations of a run's second half (its last step's included)."""
    last = max(m["training/global_step"] for m in history)
    values = [m[key] for m in history if key in m and 2 * m["training/global_step"] > last]
    return sum(values) / len(values) if values else None


def _train_steps(history: list[dict[str, float]]) -> list[dict[str, float]]:
    return [m for m in history if m["training/global_step"] > 0]


def _total(steps: list[dict[str, float]], key: str) -> float:
    return float(sum(m.get(key, 0.0) for m in steps))


def _paired_log_se(mine: list[dict[str, float]], theirs: list[dict[str, float]]) -> float | None:
    """The standard error of the mean log ratio of two arms' rollout seconds, their steps paired
    in order (None for fewer than two)."""
    return _standard_error([
        math.log(v["timing_s/rollout"] / m["timing_s/rollout"])
        for m, v in zip(mine, theirs, strict=True)
    ])  # fmt: skip


def _standard_error(values: Sequence[float]) -> float | None:
    """Of the mean of `values` (None for fewer than two)."""
    return statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else None


def _scaled(ratio: float, log_se: float | None) -> float | None:
    """A ratio's standard error from that of its log."""
    return None if log_se is None else ratio * log_se


def _mean(values: Sequence[float | None]) -> float | None:
    return None if None in values else sum(values) / len(values)  # type: ignore[arg-type]


def _last(history: list[dict[str, float]], key: str) -> float | None:
    return next((m[key] for m in reversed(history) if key in m), None)


def timing_warnings(result: dict[str, Any], load: dict[str, list[float]], cores: int) -> list[str]:
    """What makes the timings of a bench untrustworthy: a machine already busy when it started
    (1-minute load average ≥ half the cores), busier than the runs themselves make it (≥ 1.5x
    the cores after a run), an arm whose first epoch (nothing to reuse yet: the same work as
    vanilla's) took a different time, or an arm faster per response token than its own limit
    `1 / ((1 − a) + r_eff · a)`, which only a disturbed vanilla arm produces. The last two only
    where the difference is also beyond two standard errors of the arms' paired steps: within
    them it is the steps' own noise (short steps on a busy host), which the windows' "± se"
    states."""
    warnings = []
    if load["start"][0] >= cores / 2:
        warnings.append(
            f"the machine was busy when the bench started (load average {load['start'][0]:.2f} "
            f"on {cores} cores): run benchmarks alone"
        )
    busy = [run for run, (one, *_) in load.items() if run != "start" and one >= 1.5 * cores]
    if busy:
        warnings.append(
            f"the machine was busier than the bench makes it after {', '.join(busy)} (1-minute "
            f"load average ≥ {1.5 * cores:g} on {cores} cores): other work disturbed the timings"
        )
    vanilla_tokens = result["arms"]["vanilla"]["response_tokens"]
    first = result["arms"]["vanilla"]["epoch0_rollout_s"]
    for arm, summary in result["arms"].items():
        apart = summary["epoch0_rollout_s"] / first - 1 if first else 0.0
        log_se = summary.get("epoch0_log_ratio_se")
        beyond_noise = log_se is None or abs(math.log1p(apart)) > 2 * log_se
        if arm != "vanilla" and abs(apart) > EPOCH0_TOLERANCE and beyond_noise:
            warnings.append(
                f"the {arm} arm's first epoch, the same work as vanilla's, took "
                f"{summary['epoch0_rollout_s']:.1f} s against {first:.1f} s ({apart:+.0%}): the "
                "machine's speed moved during the bench, or the arm's own work around the model "
                "(its stage's host work, which short steps show) costs that much; compare within "
                "arms, or rerun alone"
            )
        # the limit holds per response token: arms that train apart sample responses of their
        # own lengths (on a real model, visibly)
        per_token = summary["response_tokens"] / max(vanilla_tokens, 1)
        speedup = summary["rollout_speedup"] * per_token
        se = (summary.get("rollout_speedup_se") or 0.0) * per_token
        limit = summary["limit_speedup"]
        if arm != "vanilla" and speedup > 1.02 * limit and speedup - 2 * se > limit:
            warnings.append(
                f"the {arm} arm's rollout speedup per response token {speedup:.2f} exceeds its "
                f"limit {limit:.2f}: the vanilla arm was slowed by something "
                "else; rerun alone"
            )
    return warnings
