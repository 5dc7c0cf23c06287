"""The engines' process seam (generate/engines/worker_process.py), for vLLM and llama.cpp: an engine that dies before
or after a request, or writes anything but the worker's JSON on its stdout (a library printing to stdout), is one
EngineError naming what happened and the engine's log, never a traceback; a slow host that lets the process end
before the first request says the same. An interpreter named by a relative path starts (the worker runs in a
folder of its own)."""

from __future__ import annotations

import stat
import subprocess
import time

import pytest

from gptoss_cli.generate.engines.base import EngineError
from gptoss_cli.generate.engines.llamacpp import LlamaCppEngine
from gptoss_cli.generate.engines.vllm_offline import VllmEngine

ENGINES = {"vllm": VllmEngine, "llamacpp": LlamaCppEngine}

BODIES = {"crash": "echo 'Segmentation fault' >&2; exit 139",
          "garbage": "read line; echo 'INFO 12-03 vllm: loading'",
          "not-json-object": "read line; echo '[1, 2]'"}
SAYS = {"crash": "ended (exit 139)", "garbage": "not the worker's JSON", "not-json-object": "not the worker's JSON"}


def _fake(tmp_path, body: str):
    fake = tmp_path / "python"
    fake.write_text(f"#!/bin/sh\n{body}\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    return str(fake)


@pytest.mark.parametrize("engine", sorted(ENGINES))
@pytest.mark.parametrize("behaviour", sorted(BODIES))
@pytest.mark.parametrize("slow_host", [False, True], ids=["at-once", "ended-before-the-request"])
def test_an_engine_that_dies_or_answers_garbage_is_one_error(tmp_path, monkeypatch, engine, behaviour, slow_host):
    if slow_host:  # the process has ended (or is waiting) before the first request is written
        real = subprocess.Popen

        class Slow(real):
            def __init__(self, *args, **kwargs):
                super().__init__(*args, **kwargs)
                time.sleep(0.3)

        monkeypatch.setattr(subprocess, "Popen", Slow)
    with pytest.raises(EngineError) as err:
        ENGINES[engine](_fake(tmp_path, BODIES[behaviour]), log_dir=tmp_path)
    text = str(err.value)
    assert SAYS[behaviour] in text and "\n" not in text, text
    assert "the engine's log: " in err.value.hint and (tmp_path / err.value.hint.split(": ", 1)[1]).is_file()


@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_an_interpreter_named_by_a_relative_path_starts(tmp_path, monkeypatch, engine):
    (tmp_path / "venv").mkdir()
    fake = _fake(tmp_path / "venv", """read line; echo '{"ok": true, "version": "0", "device": "cpu"}'; read line""")
    monkeypatch.chdir(tmp_path)
    with ENGINES[engine]("venv/python", log_dir=tmp_path / "logs") as started:
        assert started.python == fake and started.info.version == "0"
    assert list((tmp_path / "logs").iterdir()) == []  # the scratch folder went with close
