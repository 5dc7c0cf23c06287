"""serve-check hands the engine absolute paths, whatever the user typed; a model the engine refuses is refused first.

The engine is tests/support/fake_engine.py behind gptoss's own vLLM seam (`VllmEngine`: the process in a
temporary folder of its own, the JSON protocol): transformers' GptOssForCausalLM, which records every path
it is handed and the folder it runs in. vLLM takes a relative path that is not a folder in its working
folder for a Hub repo id; so does transformers' `from_pretrained`, so a relative path fails here as it does
there. One fake engine serves the module's checks through the library; one check runs the command line.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gptoss_cli.checkpoint.make_tiny import make_tiny
from gptoss_cli.errors import UsageError
from gptoss_cli.generate.engines.base import EngineError, local_folder
from gptoss_cli.generate.engines.vllm_offline import CPU_HEAD_SIZES, VllmEngine
from gptoss_cli.parity.serve.check import ServeCheckOptions, serve_check
from tests.support.cli import exit_and_output
from tests.support.fake_engine import RECORD_ENV, fake_engine_python, records

FEW = dict(greedy_tokens=2)


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("serve-paths")
    # bf16 experts: an HF folder is served as it is, so the path the user typed is the one handed over
    make_tiny(root / "h64", experts="bf16", dtype="float32", head_dim=64)
    (root / "prompts.jsonl").write_text('{"prompt_ids": [1, 5, 9, 200, 17, 3, 44, 8, 12, 600]}\n')
    return root


@pytest.fixture(scope="module")
def engine(root, tmp_path_factory):
    os.environ[RECORD_ENV] = str(root / "record.jsonl")
    eng = VllmEngine(fake_engine_python(tmp_path_factory.mktemp("fake")))
    yield eng
    eng.close()
    os.environ.pop(RECORD_ENV, None)


def _loaded(root: Path) -> dict:
    return [r for r in records(root / "record.jsonl") if r["op"] == "start"][-1]


@pytest.mark.parametrize("typed", ["h64", "./h64", "--export h64"])
def test_a_relative_folder_reaches_the_engine_absolute(root, engine, monkeypatch, typed):
    monkeypatch.chdir(root)
    export = typed.startswith("--export")
    folder = typed.split()[-1]
    options = ServeCheckOptions(prompts="prompts.jsonl", export=folder if export else None, **FEW)
    report = serve_check(folder, options, engine=engine)
    assert report.verdict == "pass", report.failure_line()
    loaded = _loaded(root)
    assert loaded["model"] == str((root / "h64").resolve())
    assert Path(loaded["cwd"]).resolve() != root.resolve()  # the engine ran in its own folder


def test_the_command_line_with_a_relative_folder_passes(root, monkeypatch, tmp_path):
    monkeypatch.chdir(root)
    monkeypatch.setenv(RECORD_ENV, str(tmp_path / "record.jsonl"))
    code, out = exit_and_output("serve-check", "h64", "--engine-python", fake_engine_python(tmp_path / "fake"),
                                "--prompts", "prompts.jsonl", "--greedy-tokens", "2")
    assert code == 0, out
    started = [r for r in records(tmp_path / "record.jsonl") if r["op"] == "start"]
    assert [r["model"] for r in started] == [str((root / "h64").resolve())]


def test_every_engine_path_is_resolved_at_the_seam(tmp_path, monkeypatch):
    (tmp_path / "m").mkdir()
    monkeypatch.chdir(tmp_path)
    assert local_folder("m") == str((tmp_path / "m").resolve())
    assert local_folder("./m/") == str((tmp_path / "m").resolve())
    with pytest.raises(EngineError, match="openai/gpt-oss-20b: no such folder"):
        local_folder("openai/gpt-oss-20b")  # never handed on as a Hub repo id


def test_a_head_size_the_cpu_engine_refuses_is_named_before_it_starts(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    make_tiny(tmp_path / "h16", experts="bf16", dtype="float32")  # the tiny preset's head size, 16
    assert 16 not in CPU_HEAD_SIZES
    monkeypatch.setenv(RECORD_ENV, str(tmp_path / "record.jsonl"))
    monkeypatch.setattr("gptoss_cli.parity.serve.check._engine_device", lambda: "cpu")
    with pytest.raises(UsageError, match=r"h16: head_dim 16: vLLM's CPU attention takes head sizes 32, 64") as info:
        serve_check("h16", ServeCheckOptions(engine_python=fake_engine_python(tmp_path / "fake"), **FEW))
    assert "make-tiny DST --head-dim 64" in info.value.hint
    assert records(tmp_path / "record.jsonl") == []  # no engine was started


def test_make_tiny_writes_the_head_size_asked_and_refuses_an_odd_one(tmp_path):
    import json

    code, out = exit_and_output("make-tiny", tmp_path / "h64", "--head-dim", "64", "--experts", "bf16")
    assert code == 0, out
    assert json.loads((tmp_path / "h64" / "config.json").read_text())["head_dim"] == 64
    code, out = exit_and_output("make-tiny", tmp_path / "odd", "--head-dim", "63")
    assert code == 2 and "--head-dim 63 must be an even number" in out and not (tmp_path / "odd").exists(), out
