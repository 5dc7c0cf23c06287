"""The CLI package imports every command module itself: none is skipped, and a missing one fails loudly."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

CLI = Path(__file__).resolve().parent.parent / "gptoss_cli" / "cli"


def test_every_module_that_defines_a_command_is_registered():
    import gptoss_cli.cli  # noqa: F401

    defining = sorted(p.stem for p in CLI.glob("*.py") if "@app.command" in p.read_text())
    assert defining and [m for m in defining if f"gptoss_cli.cli.{m}" not in sys.modules] == []


def test_a_missing_command_module_is_an_import_error_not_a_missing_command():
    code = ("import sys; sys.modules['gptoss_cli.cli.report'] = None\n"
            "try:\n    import gptoss_cli.cli\nexcept ImportError as exc:\n    print('refused:', exc)\n"
            "else:\n    raise SystemExit('gptoss_cli.cli imported without its report command')")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    assert "refused:" in out and "gptoss_cli.cli.report" in out
