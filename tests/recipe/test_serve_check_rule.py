"""The serve_check section: the end-of-run check needs a saved checkpoint, and at launch an engine interpreter."""

from __future__ import annotations

from typer.testing import CliRunner

from gptoss_cli.cli import app

runner = CliRunner()


def test_serve_check_without_a_checkpoint_dir_is_the_rules_finding():
    result = runner.invoke(app, ["validate-config", "tiny_cpu_ep2", "serve_check.engine=vllm", "checkpoint.dir=null",
                                 "checkpoint.save_interval=null"])
    assert result.exit_code == 1, result.output
    assert "serve_check.engine" in result.output and "Traceback" not in result.output


def test_an_engine_interpreter_that_does_not_exist_stops_train_before_any_process(tmp_path, monkeypatch):
    monkeypatch.delenv("GPTOSS_ENGINE_PYTHON", raising=False)
    result = runner.invoke(app, ["train", "--recipe", "tiny_cpu_ep2", "serve_check.engine=vllm",
                                 "serve_check.engine_python=/nonexistent/python", f"checkpoint.dir={tmp_path / 'c'}",
                                 f"logging.run_dir={tmp_path / 'r'}"])
    assert result.exit_code == 1, result.output
    text = " ".join(result.output.split())
    assert "serve_check.engine" in text and "/nonexistent/python" in text and "Traceback" not in text
    assert not (tmp_path / "r" / "metrics.jsonl").exists()


def test_the_section_is_valid_with_a_checkpoint_dir():
    result = runner.invoke(app, ["validate-config", "tiny_cpu_ep2", "serve_check.engine=vllm"])
    assert result.exit_code == 0, result.output
