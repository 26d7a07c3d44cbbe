"""`specrl train | toy-policy`: argument parsing and clear one-line errors."""

from __future__ import annotations

import argparse
import sys
import typing

from specrl.config import DataConfig, describe_config, load_config, sections_help
from specrl.errors import UserError
from specrl.run_dir import RunInterrupted


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="specrl", description="On-policy RL for language models with speculative rollouts."
    )
    commands = parser.add_subparsers(dest="command", required=True)
    train = commands.add_parser(
        "train",
        help="train a policy (default: GRPO on the built-in arithmetic task)",
        epilog=sections_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    train.add_argument("--config", help="YAML run config; defaults are the built-in quickstart")
    train.add_argument(
        "--print-config",
        action="store_true",
        help="print the resolved config (each key with its description and default) and exit",
    )
    train.add_argument(
        "overrides", nargs="*", metavar="key=value", help="dotted overrides, e.g. rollout.n=4"
    )
    bench = commands.add_parser(
        "bench", help="train vanilla and speculative arms, write bench.json + bench.png"
    )
    bench.add_argument("--config", help="YAML run config; defaults are the built-in quickstart")
    bench.add_argument("--out", default="bench", help="output directory (default: bench)")
    bench.add_argument(
        "--arms",
        help="comma-separated arms: vanilla and any of spec, trie, spec-in-decoding, tree, "
        "spec+tree, suffix, spec+suffix (default: vanilla,spec,trie; vanilla,spec on vllm)",
    )
    bench.add_argument(
        "--seeds",
        help="comma-separated seeds: every arm trains once per seed and bench.json pools them "
        "(default: trainer.seed)",
    )
    bench.add_argument(
        "overrides",
        nargs="*",
        metavar="key=value",
        help="dotted overrides, e.g. rollout.spec.acceptance=exact",
    )
    config = commands.add_parser(
        "config", help="print the resolved config, each key with its description and default"
    )
    config.add_argument("--config", help="YAML run config")
    config.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides")
    report = commands.add_parser(
        "report", help="plot a run's metrics (RUN_DIR/report.png) and print a summary"
    )
    report.add_argument("run_dir", help="the run's trainer.output_dir")
    toy = commands.add_parser(
        "toy-policy",
        help="print the path of a built-in task's tiny policy (shipped with specrl for the "
        "default build); --force builds it from scratch into the cache",
    )
    toy.add_argument(
        "--force",
        action="store_true",
        help="build from scratch into SPECRL_CACHE (6 minutes, calculator 18, on 2 cores), even "
        "when shipped or cached; use the printed path as model.path",
    )
    toy.add_argument(
        "--task",
        default="noisy_facts",
        choices=typing.get_args(DataConfig.model_fields["task"].annotation),
        help="the built-in task whose warm-start policy to build (data.task; default noisy_facts)",
    )
    args = parser.parse_args(argv)
    _quiet_libraries()
    try:
        if args.command == "train":
            if args.print_config:
                return _print_config(args.config, args.overrides)
            return _train(args.config, args.overrides)
        if args.command == "config":
            return _print_config(args.config, args.overrides)
        if args.command == "bench":
            return _bench(args.config, args.out, args.arms, args.seeds, args.overrides)
        if args.command == "report":
            return _report(args.run_dir)
        return _toy_policy(args.force, args.task)
    except RunInterrupted as stopped:
        print(f"specrl: {stopped}", file=sys.stderr)
        return stopped.exit_code
    except UserError as err:
        print(f"specrl: error: {err}", file=sys.stderr)
        return 2


def _quiet_libraries() -> None:
    """Our progress bar is the one that matters; transformers' per-load bars are noise here."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


def _note(message: str) -> None:
    print(f"specrl: {message}", file=sys.stderr)


def _train(config_path: str | None, overrides: list[str]) -> int:
    from specrl.trainer import Trainer

    Trainer(load_config(config_path, overrides, log=_note)).fit()
    return 0


def _print_config(config_path: str | None, overrides: list[str]) -> int:
    print(describe_config(load_config(config_path, overrides, log=_note)))
    return 0


def _bench(
    config_path: str | None, out: str, arms: str, seeds: str | None, overrides: list[str]
) -> int:
    import json
    from pathlib import Path

    from specrl.bench import parse_arms, parse_seeds, run_bench

    arm_names, seed_list = (parse_arms(arms) if arms else None), parse_seeds(seeds)
    cfg = load_config(config_path, overrides, log=_note)
    result = run_bench(cfg, Path(out), arm_names, seed_list)
    print(json.dumps(result, indent=2))
    return 0


def _report(run_dir: str) -> int:
    from pathlib import Path

    from specrl.report import report

    print(f"wrote {report(Path(run_dir))}")
    return 0


def _toy_policy(force: bool, task: str) -> int:
    from specrl.toy_policy import ToyPolicySpec, ensure_toy_policy

    print(ensure_toy_policy(ToyPolicySpec(task=task), force=force))
    return 0


if __name__ == "__main__":
    sys.exit(main())
