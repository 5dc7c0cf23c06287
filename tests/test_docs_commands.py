"""The README's and docs' commands that a tiny model can run, run as written, from another directory.

A fenced block whose info string is `bash tiny` holds commands that need nothing but a tiny model
(make-tiny's checkpoint and tokenizer, the tiny recipes found by name). Each file's blocks run in
order, in a new empty folder (never the repository: recipes are found by name, paths are relative
to where the reader stands), through the CLI in this process; a line's `# comment` is dropped and
`&&` chains commands. What a reader brings, their own conversations (`conversations.jsonl`,
`held_out.jsonl`: plain exchanges and conversations with tool definitions, calls and results) and
preference pairs (`pairs.jsonl`, `held_out_pairs.jsonl`), is written first. Every command must exit 0.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
from typer.testing import CliRunner

from gptoss_cli.cli import app
from gptoss_cli.demo import preference_pairs, sft_conversations

ROOT = Path(__file__).resolve().parent.parent
FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```bash tiny\s*\n(.*?)^```", re.M | re.S)


def tiny_commands(path: Path) -> list[list[str]]:
    """Every command (argv after `gptoss`) of the `bash tiny` blocks of `path`, in order."""
    commands = []
    for block in FENCE.findall(path.read_text()):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            while words:
                cut = words.index("&&") if "&&" in words else len(words)
                command, words = words[:cut], words[cut + 1:]
                assert command[0] == "gptoss", f"{path.name}: a `bash tiny` block runs gptoss only: {line!r}"
                commands.append(command[1:])
    return commands


DOCUMENTED = {p.relative_to(ROOT).as_posix(): tiny_commands(p) for p in FILES}


def test_the_offline_path_is_documented_and_run():
    readme = [c[0] for c in DOCUMENTED["README.md"]]
    assert {"make-tiny", "prepare-data", "train", "eval", "generate"} <= set(readme), readme
    assert any("--format" in c and "harmony" in c for c in DOCUMENTED["README.md"])


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Gets the current weather in a city.",
    "parameters": {"type": "object", "properties": {"location": {"type": "string", "description": "the city"},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["location"]}}}


def tool_conversation(city: str, temp: int) -> dict:
    """A conversation with a tool (docs/sft-data.md's form): its definition, a call, the result, the answer."""
    return {"tools": [WEATHER], "messages": [
        {"role": "user", "content": f"What is the weather in {city}?"},
        {"role": "assistant", "thinking": "Use the tool.", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"location": city}}}]},
        {"role": "tool", "tool_call_id": "c1", "content": {"temp": temp, "unit": "celsius"}},
        {"role": "assistant", "content": f"It is {temp} °C in {city}."}]}


def reader_conversations(held_out: bool) -> list[dict]:
    """What a reader brings: plain exchanges, and conversations with tools."""
    cities = [("Oslo", 3), ("Lima", 19)] if held_out else [("Tokyo", 21), ("Paris", 14), ("Cairo", 30), ("Quito", 12)]
    return sft_conversations(held_out) + [tool_conversation(c, t) for c, t in cities]


@pytest.mark.parametrize("name", sorted(n for n, commands in DOCUMENTED.items() if commands))
def test_tiny_commands_run_as_written_from_another_directory(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for file, held_out in (("conversations.jsonl", False), ("held_out.jsonl", True)):
        Path(file).write_text("".join(json.dumps(c) + "\n" for c in reader_conversations(held_out)))
    for file, held_out in (("pairs.jsonl", False), ("held_out_pairs.jsonl", True)):
        Path(file).write_text("".join(json.dumps(p) + "\n" for p in preference_pairs(held_out)))
    runner = CliRunner()
    for argv in DOCUMENTED[name]:
        result = runner.invoke(app, argv)
        assert result.exit_code == 0, f"{name}: gptoss {shlex.join(argv)} exited {result.exit_code}:\n{result.output}"


def test_no_documented_command_names_a_recipe_by_its_repository_path():
    """Recipes are found by name from anywhere; `recipes/x.yaml` works only from the repository root."""
    bad = []
    for path in FILES:
        for block in re.findall(r"^```[^\n]*\n(.*?)^```", path.read_text(), re.M | re.S):
            bad += [f"{path.name}: {line.strip()}" for line in block.splitlines()
                    if line.lstrip().startswith("gptoss ") and re.search(r"\brecipes/\w+\.ya?ml", line)]
    assert not bad, bad


def test_every_command_in_a_recipes_comments_names_its_recipe_with_recipe():
    bad = []
    for recipe in sorted((ROOT / "recipes").glob("*.yaml")):
        comments = " ".join(line for line in recipe.read_text().splitlines() if line.startswith("#"))
        bad += [f"{recipe.name}: {m}" for m in re.findall(r"gptoss train(?! --recipe \w)[^.;]{0,40}", comments)]
    assert not bad, bad
