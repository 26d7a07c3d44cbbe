"""The docs cannot drift from the code: every `specrl` command in a bash block of README.md and
docs/ parses with the CLI, its overrides load as a config and its arms, model and task exist;
no link leaves the repository; docs/design.md names every module; the README stays short."""

import re
import shlex
from pathlib import Path

import pytest

from specrl.bench import parse_arms, parse_seeds
from specrl.cli import parse_command
from specrl.config import load_config
from specrl.models import MODELS

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def bash_commands(page: Path) -> list[str]:
    """The shell commands of a page's ```bash blocks: continuation lines joined, comments cut,
    `&&` chains split."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", page.read_text(), flags=re.DOTALL):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" #", 1)[0].strip()
            if line and not line.startswith("#"):
                commands += [part.strip() for part in line.split("&&")]
    return commands


def inline_commands(page: Path) -> list[str]:
    """The `specrl ...` commands quoted in a page's prose (code spans may wrap lines)."""
    spans = re.findall(r"`((?:[A-Z_]+=\S+ )*specrl [^`]+)`", page.read_text())
    return [" ".join(span.split()) for span in spans]


def specrl_argv(command: str) -> list[str] | None:
    """The arguments of a `specrl` command (after `VAR=value` prefixes and a path to the
    executable), or None for any other command."""
    words = shlex.split(command)
    while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):
        words = words[1:]
    if not words or Path(words[0]).name != "specrl":
        return None
    return words[1:]


DOCUMENTED = [
    (page.relative_to(ROOT).as_posix(), argv)
    for page in PAGES
    for command in bash_commands(page) + inline_commands(page)
    if (argv := specrl_argv(command)) is not None and "--help" not in argv
]


def test_the_docs_show_the_main_commands():
    shown = {argv[0] for _, argv in DOCUMENTED}
    assert {"train", "bench", "config", "model", "data"} <= shown
    assert len(DOCUMENTED) >= 25


@pytest.mark.parametrize(("page", "argv"), DOCUMENTED, ids=[" ".join(a) for _, a in DOCUMENTED])
def test_every_documented_command_is_one_the_cli_takes(page, argv):
    args = parse_command(argv)  # an unknown command or flag exits here
    if args.command in ("train", "bench", "config"):
        overrides = [o for o in args.overrides if re.match(r"[A-Za-z_][\w.]*=", o)]
        load_config(None, overrides)  # an unknown or renamed key raises ConfigError
    if args.command == "bench":
        if args.arms:
            parse_arms(args.arms)
        parse_seeds(args.seeds)
    if args.command == "model":
        assert args.name in MODELS
    if args.command == "data":
        pytest.importorskip("reasoning_gym")
        from specrl.data.reasoning_gym import _options

        _options(args.task, args.options)


def test_no_link_leaves_the_repository():
    for page in PAGES:
        text = page.read_text()
        assert "../shared" not in text and "](../" not in text, page


def test_the_design_page_names_every_module():
    design = (ROOT / "docs" / "design.md").read_text()
    modules = [p for p in (ROOT / "specrl").rglob("*.py") if not p.name.startswith("__")]
    missing = [str(p.relative_to(ROOT)) for p in modules if p.name not in design]
    folders = {p.parent.name + "/" for p in modules if p.parent.name != "specrl"}
    missing += [f for f in folders if f not in design]
    assert not missing


def test_the_readme_is_short():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 250


# The README's results table and the bench it quotes: each row's figures read back from the
# committed bench.json, so a rerun that changes a figure fails here until the README says so.
RESULTS_BENCH = "benchmarks/cpu-hf-noisy-facts-3seeds-current"
RESULTS_COLUMNS = [  # (key in bench.json's arms.<arm>, how the README prints it)
    ("rollout_time_s", "{:.1f} s"),
    ("rollout_speedup", "{:.2f}x"),
    ("rollout_speedup_after_epoch0", "({:.2f}x)"),
    ("step_speedup", "{:.2f}x"),
    ("decoded_token_ratio", "{:.2f}"),
    ("verified_tokens_per_step", "{:,.0f}"),
    ("final_acc", "{:.3f}"),
]
RESULTS_PER_SEED = [("rollout_speedup", "{:.2f}x")]  # each seed's, from arms.<arm>.per_seed


def test_the_readme_results_table_is_its_bench_json():
    import json

    readme = (ROOT / "README.md").read_text()
    assert f"`{RESULTS_BENCH}`" in readme
    arms = json.loads((ROOT / RESULTS_BENCH / "bench.json").read_text())["arms"]
    rows = {
        cells[0]: cells[1:]
        for line in readme.splitlines()
        if line.startswith("| ") and (cells := [c.strip() for c in line.strip("|").split("|")])
        and cells[0] in arms
    }  # fmt: skip
    assert set(rows) == set(arms)
    for arm, cells in rows.items():
        words = " ".join(cells).replace(",", "")
        for key, form in RESULTS_COLUMNS:
            assert form.format(arms[arm][key]).replace(",", "") in words, (arm, key, cells)
        for seed, figures in arms[arm]["per_seed"].items():
            for key, form in RESULTS_PER_SEED:
                assert form.format(figures[key]) in words, (arm, seed, key, cells)


def test_every_benchmark_folder_the_docs_name_exists():
    named = {
        match
        for page in [*PAGES, ROOT / "benchmarks" / "README.md"]
        for match in re.findall(r"`benchmarks/([\w.+-]+)", page.read_text())
    }
    assert named and [name for name in named if not (ROOT / "benchmarks" / name).exists()] == []
