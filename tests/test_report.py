import json

from specrl.cli import main
from specrl.run_dir import RENAMED_METRICS, read_metrics_jsonl
from specrl.speculative.stats import RolloutStats
from specrl.trainer import Trainer
from tests.conftest import png_panels, small_config


def test_report_plots_and_summarises_a_run(tiny_policy_dir, tmp_path, capsys):
    Trainer(
        small_config(
            tiny_policy_dir,
            tmp_path,
            "data.train_size=8",
            "rollout.spec.acceptance=specrl",
            "trainer.total_training_steps=3",
        )
    ).fit()
    capsys.readouterr()
    assert main(["report", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert png_panels(tmp_path / "report.png") == 3  # five panels, two per row
    assert "val/acc/mean@1 first → last" in out and "spec/reused_token_ratio, whole run" in out
    # what the policy wrote: the first 3 held-out prompts at each of the 4 evaluations (steps
    # 0-3), the last evaluation's in the report
    rows = [json.loads(line) for line in (tmp_path / "val_generations.jsonl").open()]
    assert [r["step"] for r in rows] == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]
    assert set(rows[0]) == {"step", "prompt", "response", "ground_truth", "score"}
    assert "held-out generations at step 3" in out and rows[-1]["ground_truth"] in out


def test_a_run_written_under_old_metric_names_reads_as_a_new_one(tiny_policy_dir, tmp_path, capsys):
    """Renamed metrics (spec/tree/* → spec/decode_drafts/*) keep old runs readable: the same
    run's metrics.jsonl written under the old names gives the same records and report."""
    Trainer(small_config(tiny_policy_dir, tmp_path, "trainer.total_training_steps=5")).fit()
    path = tmp_path / "metrics.jsonl"
    new = read_metrics_jsonl(path, print)
    assert RolloutStats.of_steps(new).drafted_tokens > 0  # tree drafts: renamed metrics logged
    capsys.readouterr()
    assert main(["report", str(tmp_path)]) == 0
    report_new = capsys.readouterr().out
    old_names = {current: old for old, current in RENAMED_METRICS.items()}
    path.write_text(
        "".join(json.dumps({old_names.get(k, k): v for k, v in m.items()}) + "\n" for m in new)
    )
    assert "spec/tree/draft_tokens" in path.read_text()
    assert read_metrics_jsonl(path, print) == new
    assert main(["report", str(tmp_path)]) == 0
    assert capsys.readouterr().out == report_new


def test_report_on_a_directory_without_metrics(tmp_path, capsys):
    assert main(["report", str(tmp_path)]) == 2
    assert (
        capsys.readouterr().err.strip()
        == f"specrl: error: {tmp_path} has no metrics.jsonl; pass the trainer.output_dir of a run"
    )


def test_tensorboard_and_offline_wandb_loggers(tiny_policy_dir, tmp_path, monkeypatch):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.delenv("WANDB_MODE", raising=False)  # the default must be offline: no network here
    monkeypatch.chdir(tmp_path)
    cfg = small_config(
        tiny_policy_dir, tmp_path, "trainer.logger=[jsonl,tensorboard,wandb]", "trainer.save_freq=0"
    )
    Trainer(cfg).fit()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    scalars = events.Tags()["scalars"]
    assert "critic/score/mean" in scalars and "val/acc/mean@1" in scalars
    assert [e.step for e in events.Scalars("actor/pg_loss")] == [1, 2]
    offline_runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(offline_runs) == 1 and any(offline_runs[0].glob("*.wandb"))


def test_missing_logger_backend_is_a_clear_error(tiny_policy_dir, tmp_path, monkeypatch, capsys):
    import sys

    monkeypatch.setitem(sys.modules, "wandb", None)  # as if wandb were not installed
    args = [
        f"model.path={tiny_policy_dir}",
        f"trainer.output_dir={tmp_path}",
        "trainer.logger=[wandb]",
    ]
    capsys.readouterr()
    assert main(["train", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert (
        err
        == "specrl: error: trainer.logger includes wandb but it is not installed; pip install 'specrl[wandb]'"
    )


def test_the_report_of_a_vanilla_run_leaves_out_what_it_cannot_show(tiny_policy_dir, tmp_path):
    Trainer(
        small_config(
            tiny_policy_dir,
            tmp_path,
            "rollout.spec.enabled=false",
            "rollout.spec.tree.enabled=false",
        )
    ).fit()
    assert main(["report", str(tmp_path)]) == 0
    assert png_panels(tmp_path / "report.png") == 2  # no reused token ratio: four panels


def test_off_a_terminal_progress_is_plain_lines_and_the_summary_names_the_run(
    tiny_policy_dir, tmp_path
):
    import io

    from rich.console import Console

    from specrl.tracking import Tracker

    out = io.StringIO()  # not a terminal, as a log file or CI
    cfg = small_config(tiny_policy_dir, tmp_path, "trainer.logger=[console,jsonl]")
    tracker = Tracker(cfg.trainer.logger, tmp_path, console=Console(file=out, width=200))
    Trainer(cfg, tracker=tracker).fit()
    lines = out.getvalue().splitlines()
    progress = [line for line in lines if line.startswith("train ")]
    assert [line.split()[1] for line in progress] == ["1/2", "2/2"]
    assert "s left) score=" in progress[0]
    assert not any("━" in line for line in progress)  # no bar drawn into the log
    assert f"run directory: {tmp_path} (curves and a summary: specrl report {tmp_path})" in lines


def test_off_a_terminal_long_lines_and_table_rows_are_not_wrapped(capsys):
    """Piped output (as in a log file): a long progress line and a wide table row each stay on
    one line, where rich would wrap them at 80 columns."""
    from rich.table import Table

    from specrl.tracking import make_console

    console = make_console()  # stdout is captured: not a terminal
    line = "train 12/128 (32 s, ~308 s left) " + " ".join(f"metric_{i}=0.{i}" for i in range(20))
    console.print(line, highlight=False)
    table = Table()
    table.add_column("metric")
    table.add_column("value")
    table.add_row("runs/" + "quickstart-" * 12, "0.5")
    console.print(table)
    out = capsys.readouterr().out.splitlines()
    assert out[0] == line
    assert any(("runs/" + "quickstart-" * 12) in row for row in out)


def test_a_busy_machine_gets_one_hint_about_threads(tmp_path, monkeypatch):
    import io
    import os

    import torch
    from rich.console import Console

    from specrl.tracking import Tracker

    out = io.StringIO()
    tracker = Tracker(["jsonl"], tmp_path, console=Console(file=out, width=300))
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    monkeypatch.setattr(os, "getloadavg", lambda: (1.5, 1.0, 1.0))  # this run's own load
    tracker.log({"training/global_step": 1})
    assert out.getvalue() == ""
    monkeypatch.setattr(os, "getloadavg", lambda: (6.2, 4.0, 2.0))
    for step in (2, 3):
        tracker.log({"training/global_step": step})
    lines = out.getvalue().strip().splitlines()
    assert len(lines) == 1 and "load average 6.2 on 2 cores" in lines[0]
    assert "trainer.num_threads=1" in lines[0]
