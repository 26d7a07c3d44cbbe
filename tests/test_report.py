from specrl.cli import main
from specrl.trainer import Trainer
from tests.conftest import small_config


def test_report_plots_and_summarises_a_run(tiny_policy_dir, tmp_path, capsys):
    Trainer(
        small_config(
            tiny_policy_dir,
            tmp_path,
            "data.train_size=8",
            "rollout.spec.enabled=true",
            "trainer.total_training_steps=3",
        )
    ).fit()
    capsys.readouterr()
    assert main(["report", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert (tmp_path / "report.png").stat().st_size > 10_000
    assert "val/acc/mean@1 first → last" in out and "spec/reused_token_ratio, mean" in out


def test_report_on_a_directory_without_metrics(tmp_path, capsys):
    assert main(["report", str(tmp_path)]) == 2
    assert (
        capsys.readouterr().err.strip()
        == f"specrl: error: {tmp_path} has no metrics.jsonl; pass the trainer.output_dir of a run"
    )
