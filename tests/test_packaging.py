"""The project's own files: the README's commands are what CI runs, and every package ships."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def quickstart_commands() -> list[str]:
    """The command lines of the README's Quickstart section (first the main job, then the tests)."""
    text = (ROOT / "README.md").read_text()
    section = text.split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```bash\n(.*?)```", section, flags=re.S)
    return [line.strip() for block in blocks for line in block.splitlines() if line.strip()]


def test_ci_runs_the_readme_quickstart_commands_verbatim():
    commands = quickstart_commands()
    assert len(commands) == 2, commands
    ci_lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    for command in commands:
        assert command in ci_lines, f".ci/run does not run the README line {command!r}"


def test_the_readme_says_how_a_cpu_only_machine_installs_the_pinned_torch_without_cuda():
    """From PyPI alone `pip install torch==X` on Linux is the CUDA build: the README names PyTorch's CPU index."""
    pinned = re.search(r"pip install (torch==\S+)", quickstart_commands()[0]).group(1)
    section = " ".join((ROOT / "README.md").read_text().split("## Quickstart", 1)[1].split("\n## ", 1)[0].split())
    assert f"pip install {pinned} --index-url https://download.pytorch.org/whl/cpu" in section


def test_ci_runs_the_main_job_in_a_venv_without_extras():
    main_job = quickstart_commands()[0]
    assert "pip install -e . " in main_job + " " and ".[" not in main_job


def test_every_package_folder_is_listed_in_pyproject():
    tomllib = pytest.importorskip("tomllib")
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    on_disk = {
        ".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "gptoss_cli").rglob("__init__.py")
    }
    assert on_disk <= listed, f"packages missing from pyproject.toml: {sorted(on_disk - listed)}"
    assert config["package-dir"]["gptoss_cli.recipes_data"] == "recipes"
    assert {"gptoss_cli.recipes_data", "gptoss_cli.recipes_data.bases"} <= listed


def test_no_test_reads_pytests_cache():
    """The suite passes under `-p no:cacheprovider` (and on a fresh clone): no test or fixture reads
    `config.cache`, which that flag removes (tests/data/harmony_tokenizer.cache_folder keeps the built tokenizer)."""
    import ast

    tests = Path(__file__).resolve().parent
    found = []
    for path in sorted(tests.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (isinstance(node, ast.Attribute) and node.attr == "cache" and isinstance(node.value, ast.Attribute)
                    and node.value.attr == "config"):
                found.append(f"{path.relative_to(tests)}:{node.lineno}")
    assert found == []
