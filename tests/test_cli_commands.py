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


# What `gptoss ARGS` imported, for each ARGS in turn in one fresh interpreter (the console script's
# entry point): the union of what they imported.
_IMPORTS = ("import sys\nfrom gptoss_cli.cli import main\n"
            "for args in sys.argv[1:]:\n"
            "    sys.argv = ['gptoss'] + args.split()\n"
            "    try:\n        main()\n    except SystemExit:\n        pass\n"
            "print('IMPORTED', *sorted({m.split('.')[0] for m in sys.modules}), file=sys.stderr)")


def _imported(*runs: str) -> set[str]:
    proc = subprocess.run([sys.executable, "-c", _IMPORTS, *runs], capture_output=True, text=True, timeout=120)
    line = [x for x in proc.stderr.splitlines() if x.startswith("IMPORTED ")]
    assert line, proc.stderr[-2000:]
    return set(line[-1].split()[1:])


def test_help_and_validate_config_import_no_torch():
    """Start-up (cli/__init__.py): `gptoss --help` and every command's --help load no torch and no
    recipe machinery (omegaconf); validate-config reads a recipe without torch."""
    from gptoss_cli.cli import app

    helps = ["--help"] + [f"{c.name} --help" for c in app.registered_commands]
    assert len(helps) > 5 and not _imported(*helps) & {"torch", "omegaconf", "transformers", "numpy", "safetensors"}
    assert "torch" not in _imported("validate-config tiny_cpu_ep2")
