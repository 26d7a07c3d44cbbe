"""`specrl train | bench | project | config | report | export | toy-policy | model | data`: argument parsing and
clear one-line errors."""

from __future__ import annotations

import argparse
import sys
import typing

from specrl.config import DataConfig, describe_config, load_config, sections_help
from specrl.errors import UserError
from specrl.run_dir import RunInterrupted
from specrl.tracking import quiet_libraries


def main(argv: list[str] | None = None) -> int:
    args = parse_command(argv)
    quiet_libraries()
    try:
        if args.command == "train":
            if args.print_config:
                return _print_config(args.config, args.overrides)
            return _train(args.config, args.overrides)
        if args.command == "config":
            return _print_config(args.config, args.overrides)
        if args.command == "bench":
            return _bench(
                args.config,
                args.out,
                args.arms,
                args.seeds,
                args.warmup_steps,
                args.window,
                args.interleave,
                args.paired,
                args.overrides,
            )
        if args.command == "report":
            return _report(args.run_dir)
        if args.command == "project":
            return _project(args.bench_dir, args.device, args.model, args.stretch)
        if args.command == "export":
            return _export(args.checkpoint, args.out, args.base)
        if args.command == "model":
            return _model(args.name, args.force)
        if args.command == "data":
            return _data(args)
        return _toy_policy(args)
    except RunInterrupted as stopped:
        print(f"specrl: {stopped}", file=sys.stderr)
        return stopped.exit_code
    except UserError as err:
        print(f"specrl: error: {err}", file=sys.stderr)
        return 2


def parse_command(argv: list[str] | None) -> argparse.Namespace:
    """The command line, parsed; `specrl data`'s key=value options may also follow its flags
    (argparse alone takes them only before)."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and args.command == "data" and all("=" in e for e in extra):
        args.options = [*args.options, *extra]
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def build_parser() -> argparse.ArgumentParser:
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
        help="comma-separated arms: vanilla and any of spec, trie, trie+tree, spec-in-decoding, "
        "tree, spec+tree, suffix, spec+suffix (default: vanilla,spec,trie)",
    )
    bench.add_argument(
        "--warmup-steps",
        type=int,
        help="untimed vanilla steps before the timed arms, into OUT/warmup (default 2; 0: none)",
    )
    bench.add_argument(
        "--window",
        type=int,
        default=8,
        help="steps per window of the per-window figures in bench.json (default 8)",
    )
    bench.add_argument(
        "--seeds",
        help="comma-separated seeds: every arm trains once per seed and bench.json pools them "
        "(default: trainer.seed)",
    )
    bench.add_argument(
        "--interleave",
        action="store_true",
        help="train each seed's arms at once, one step of each in turn, so every window's times "
        "are measured over the same minutes (all arms' models in memory at once)",
    )
    bench.add_argument(
        "--paired",
        action="store_true",
        help="with --interleave: every arm rolls out with the vanilla arm's weights at every step, "
        "so a window's ratio measures speculation alone, not two trainings that drifted apart",
    )
    bench.add_argument(
        "overrides",
        nargs="*",
        metavar="key=value",
        help="dotted overrides, e.g. rollout.spec.acceptance=exact",
    )
    project = commands.add_parser(
        "project",
        help="price a finished bench's recorded forwards on another device and model shape "
        "(a projection, with the cost model checked on the bench's own machine)",
    )
    project.add_argument("bench_dir", help="a `specrl bench --out` directory")
    project.add_argument(
        "--device",
        default="h100",
        help="h100, h200, or name=...,flops=...,bandwidth=...,overhead_ms=...",
    )
    project.add_argument(
        "--model",
        default="qwen2.5-7b",
        help="qwen2.5-1.5b, qwen2.5-7b, or the path of a Hugging Face config.json",
    )
    project.add_argument(
        "--stretch",
        default="1",
        help="comma-separated factors the responses are stretched by, e.g. 1,20,100 (default 1)",
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
    export = commands.add_parser(
        "export",
        help="write a checkpoint's policy as a Hugging Face model directory (a LoRA checkpoint: "
        "its adapters merged into its base model)",
    )
    export.add_argument("checkpoint", help="RUN_DIR/checkpoints/global_step_N")
    export.add_argument("out", help="a new directory for the model")
    export.add_argument(
        "--base", help="the LoRA checkpoint's base model directory, if it has moved"
    )
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
    for flag, field, what in (
        ("--hidden-size", "hidden_size", "model width"),
        ("--layers", "num_layers", "transformer layers"),
        ("--heads", "num_heads", "attention heads"),
        ("--sft-steps", "sft_steps", "warm-start steps"),
    ):
        toy.add_argument(
            flag,
            type=int,
            dest=field,
            help=f"{what} (default: the built-in policy's; another builds into the cache)",
        )
    toy.add_argument(
        "--sft-lr",
        type=float,
        dest="sft_lr",
        help="warm-start peak learning rate (default: the built-in policy's 3e-3; wider "
        "models may need less)",
    )
    toy.add_argument(
        "--device",
        default="cpu",
        choices=["cpu", "cuda"],
        help="where to build (default cpu); the weights are saved the same way",
    )
    model = commands.add_parser(
        "model",
        help="print the directory of a built-in pretrained model (model.path=builtin:NAME), "
        "converted into the cache from its installed package on first use",
    )
    model.add_argument("name", help="smollm2-135m-instruct")
    model.add_argument("--force", action="store_true", help="convert again")
    data = commands.add_parser(
        "data",
        help="write a reasoning-gym task as verl-schema parquet (train.parquet, val.parquet) "
        "for data.train_files / data.val_files, scored by the task's own scorer",
    )
    data.add_argument("task", help="a reasoning-gym dataset, e.g. chain_sum, basic_arithmetic")
    data.add_argument("--out", required=True, help="output directory")
    data.add_argument("--train-size", type=int, default=1024, help="training problems")
    data.add_argument("--val-size", type=int, default=200, help="held-out problems")
    data.add_argument("--seed", type=int, default=1, help="generator seed (splits are disjoint)")
    data.add_argument(
        "options",
        nargs="*",
        metavar="key=value",
        help="the generator's options, e.g. min_terms=2 max_terms=2 max_digits=1",
    )
    return parser


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
    config_path: str | None,
    out: str,
    arms: str,
    seeds: str | None,
    warmup_steps: int | None,
    window: int,
    interleave: bool,
    paired: bool,
    overrides: list[str],
) -> int:
    import json
    from pathlib import Path

    from specrl.bench import WARMUP_STEPS, parse_arms, parse_seeds, run_bench

    arm_names, seed_list = (parse_arms(arms) if arms else None), parse_seeds(seeds)
    warmup_steps = WARMUP_STEPS if warmup_steps is None else warmup_steps
    if warmup_steps < 0:
        raise UserError(f"--warmup-steps {warmup_steps}: give 0 (no warm-up) or more steps")
    if window < 1:
        raise UserError(f"--window {window}: give a number of steps, 1 or more")
    cfg = load_config(config_path, overrides, log=_note)
    result = run_bench(
        cfg, Path(out), arm_names, seed_list, warmup_steps=warmup_steps, window=window,
        interleave=interleave, paired=paired,
    )  # fmt: skip
    print(json.dumps(result, indent=2))
    return 0


def _report(run_dir: str) -> int:
    from pathlib import Path

    from specrl.report import report

    print(f"wrote {report(Path(run_dir))}")
    return 0


def _project(bench_dir: str, device: str, model: str, stretch: str) -> int:
    from pathlib import Path

    from specrl.cost_model import Device, ModelShape
    from specrl.projection import check_lines, project_bench

    try:
        stretches = [float(s) for s in stretch.split(",")]
    except ValueError:
        raise UserError(
            f"--stretch {stretch!r}: give comma-separated factors, e.g. 1,20,100"
        ) from None
    target, shape = Device.named(device), ModelShape.named(model)
    result = project_bench(Path(bench_dir), target, shape, stretches)
    check = result["check"]
    if check:
        print(f"cost model on {result['measured_on']}:")
        for line in check_lines(check):
            print(f"  {line}")
    print(
        f"PROJECTION (not a measurement) for {shape.name} ({shape.params / 1e9:.2f}B parameters) "
        f"on {target.name}: {target.source}"
    )
    for projection in result["projections"]:
        stretched = projection["response_stretch"]
        for arm, p in projection["arms"].items():
            speedup = p["projected_rollout_speedup"]
            print(
                f"  responses x{stretched:g} {arm:>10}: {p['projected_rollout_s']:9.1f} s"
                + (f", {speedup:.2f}x vanilla" if speedup else "")
            )
    for limit in result["cannot_know"]:
        print(f"  it cannot know: {limit}")
    return 0


def _export(checkpoint: str, out: str, base: str | None) -> int:
    from pathlib import Path

    from specrl.export import export_checkpoint

    print(export_checkpoint(Path(checkpoint), Path(out), base, log=_note))
    return 0


def _toy_policy(args: argparse.Namespace) -> int:
    import torch

    from specrl.toy_policy import ToyPolicySpec, ensure_toy_policy

    sizes = ("hidden_size", "num_layers", "num_heads", "sft_steps", "sft_lr")
    spec = ToyPolicySpec(
        task=args.task, **{k: getattr(args, k) for k in sizes if getattr(args, k) is not None}
    )
    if min(spec.hidden_size, spec.num_layers, spec.num_heads) < 1:
        raise UserError("--hidden-size, --layers and --heads must be at least 1")
    if spec.sft_steps < 20:  # the one-cycle schedule warms up over a tenth of them
        raise UserError(f"--sft-steps {spec.sft_steps}: the warm start needs at least 20")
    if not 0 < spec.sft_lr < 1:
        raise UserError(f"--sft-lr {spec.sft_lr}: a learning rate in (0, 1)")
    if spec.hidden_size % spec.num_heads:
        raise UserError(
            f"--hidden-size {spec.hidden_size} is not a multiple of --heads {spec.num_heads}"
        )
    if args.device == "cuda" and not torch.cuda.is_available():
        raise UserError(f"--device cuda: torch {torch.__version__} sees no GPU")
    print(ensure_toy_policy(spec, force=args.force, log=_note, device=args.device))
    return 0


def _model(name: str, force: bool) -> int:
    from specrl.models import ensure_model

    print(ensure_model(name, force=force, log=_note))
    return 0


def _data(args: argparse.Namespace) -> int:
    from pathlib import Path

    from specrl.data.reasoning_gym import write_task

    for path in write_task(
        args.task, Path(args.out), args.train_size, args.val_size, args.seed, args.options, _note
    ):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
