"""The one-line pointer files a checkpoint folder holds: training's `latest` and Megatron's
latest_checkpointed_iteration.txt. Whatever they hold (5000 digits, digits that are not ASCII), the
answer is one line naming the file, exit 2, never a traceback or a path thousands of characters long."""

from __future__ import annotations

import pytest

from tests.support.cli import run_cli


HOSTILE = {"5000 digits": "9" * 5000, "superscript two": "\u00b2", "arabic-indic three": "\u0663"}


def _one_line_error(args: list[str]) -> str:
    result = run_cli(*args)
    text = " ".join(result.output.split())
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output and text.count("error:") == 1, result.output
    assert len(text) < 600, text  # the file's content is quoted short, not whole
    return text


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_megatron_tracker_with_a_hostile_iteration_is_one_line(tmp_path, case):
    src = tmp_path / "mg"
    (src / "release").mkdir(parents=True)
    (src / "latest_checkpointed_iteration.txt").write_text(HOSTILE[case] + "\n")
    text = _one_line_error(["convert", str(src), str(tmp_path / "out")])
    assert "latest_checkpointed_iteration.txt" in text and "neither 'release' nor an iteration number" in text


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_training_latest_with_a_hostile_iteration_is_one_line(tmp_path, case):
    src = tmp_path / "ckpt"
    (src / "iter_0000001").mkdir(parents=True)
    (src / "iter_0000001" / "train_state.json").write_text("{}")
    (src / "latest").write_text(f"iter_{HOSTILE[case]}\n")
    text = _one_line_error(["convert", str(src), str(tmp_path / "out")])
    assert "latest points at" in text and "which is not a complete checkpoint" in text
