"""`serve-check --engine llamacpp`: llama.cpp, run by llama-cpp-python in its own interpreter, on the GGUF gptoss
exports, agrees with gptoss's forward within the budget on a tiny GPT-OSS with the real vocabulary (prompts past
the window), and a planted error (a block's sinks zeroed, two experts swapped) fails it with exit 1; an engine
that dies or answers garbage and a GGUF of another model are one line, exit 2.

llama.cpp's interpreter comes from $GPTOSS_LLAMACPP_PYTHON (.ci/run builds llama-cpp-python into its own venv and
sets it); without it the engine tests skip and say why. The bad-engine tests need no llama.cpp.
"""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from gptoss_cli.checkpoint.convert import convert  # noqa: E402
from gptoss_cli.checkpoint.make_tiny import make_tiny  # noqa: E402
from gptoss_cli.generate.engines.llamacpp import LLAMACPP_PYTHON_ENV  # noqa: E402
from tests.support.cli import run_cli  # noqa: E402


def llamacpp_python() -> str:
    python = os.environ.get(LLAMACPP_PYTHON_ENV)
    if not python:
        reason = (f"llama.cpp tests skipped: ${LLAMACPP_PYTHON_ENV} is not set (the python of a venv with "
                  "llama-cpp-python; .ci/run builds one, docs/gguf.md says how)")
        print(reason, file=sys.stderr)
        pytest.skip(reason)
    return python


@pytest.fixture(scope="module")
def real_hf(tmp_path_factory) -> Path:
    from tests.checkpoint.gguf_fixtures import real_vocab_tiny

    return real_vocab_tiny(tmp_path_factory.mktemp("llamacpp") / "hf")


@pytest.fixture(scope="module")
def exported(real_hf, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("llamacpp-gguf") / "model.gguf"
    convert(str(real_hf), out, to="gguf", dtype="f32", experts="same")
    return out


@pytest.fixture(scope="module")
def short_prompt(tmp_path_factory) -> Path:
    """One prompt of 40 ids, past the window of 8 three times over."""
    path = tmp_path_factory.mktemp("prompts") / "p.jsonl"
    ids = np.random.default_rng(0).integers(0, 199998, 40).tolist()
    path.write_text(json.dumps({"prompt_ids": ids}) + "\n")
    return path


def _serve_check(ckpt, *extra):
    return run_cli("serve-check", ckpt, "--engine", "llamacpp", *extra)


def test_llamacpp_computes_what_gptoss_computes_on_the_real_vocabulary(real_hf, tmp_path):
    """f32 tensors and experts, f32 KV cache, the built-in harmony conversations past the window: pass within the
    float32 budget, and the YaRN truncation llama.cpp cannot avoid is named with its measured effect. (MXFP4 and
    Q8_0 weights make llama.cpp quantise activations to Q8_0: on this random model that flips near-tied routers,
    whose cascades the budget's first-order envelope does not always cover: docs/gguf.md.)"""
    llamacpp_python()
    report = tmp_path / "report.json"
    result = _serve_check(real_hf, "--dtype", "f32", "--experts", "same", "--json", report)
    assert result.exit_code == 0, result.output
    data = json.loads(report.read_text())
    assert data["verdict"] == "pass" and data["engine"]["name"] == "llama.cpp"
    assert min(p["tokens"] for p in data["prompts"]) > 2 * 8
    assert [f["name"] for f in data["findings"]] == ["yarn_truncate"]
    print("llama.cpp f32:", data["max_abs_logprob_diff"], [p["budget"] for p in data["prompts"]])


def _planted(exported: Path, dst: Path, plant) -> Path:
    dst.write_bytes(exported.read_bytes())
    reader = gguf.GGUFReader(str(dst), "r+")
    plant({t.name: t for t in reader.tensors})
    del reader
    return dst


@pytest.mark.parametrize("plant", ["sinks", "experts"])
def test_a_planted_error_fails_with_exit_1(real_hf, exported, short_prompt, tmp_path, plant):
    llamacpp_python()

    def zero_sinks(t):
        t["blk.1.attn_sinks.weight"].data[:] = 0

    def swap_experts(t):  # experts 0 and 1 of block 0's down projection ([E, H, I])
        data = t["blk.0.ffn_down_exps.weight"].data
        first = np.array(data[0])
        data[0] = data[1]
        data[1] = first

    bad = _planted(exported, tmp_path / "bad.gguf", {"sinks": zero_sinks, "experts": swap_experts}[plant])
    result = _serve_check(real_hf, "--export", bad, "--prompts", short_prompt, "--greedy-tokens", "0")
    assert result.exit_code == 1, result.output
    assert "leave the f32 budget" in result.output


def test_a_gguf_of_another_model_is_one_line(real_hf, tmp_path, monkeypatch):
    other = tmp_path / "other"
    make_tiny(other, experts="mxfp4", seed=1)
    convert(str(other), tmp_path / "other.gguf", to="gguf")
    monkeypatch.setenv(LLAMACPP_PYTHON_ENV, sys.executable)  # never started: refused before
    result = _serve_check(real_hf, "--export", tmp_path / "other.gguf")
    assert result.exit_code == 2 and len(result.output.strip().splitlines()) == 1, result.output
    assert "holds another model" in result.output and "head_dim: 16 vs 64" in result.output


@pytest.mark.parametrize("behaviour", ["crash", "garbage"])
def test_an_engine_that_dies_or_answers_garbage_is_one_line(tmp_path, monkeypatch, behaviour):
    tiny = tmp_path / "tiny"
    make_tiny(tiny, experts="mxfp4", seed=2)
    fake = tmp_path / "python"
    body = {"crash": "echo 'Segmentation fault' >&2; exit 139", "garbage": "read line; echo 'hello, world'"}[behaviour]
    fake.write_text(f"#!/bin/sh\n{body}\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv(LLAMACPP_PYTHON_ENV, str(fake))
    result = _serve_check(tiny, "--greedy-tokens", "0")
    assert result.exit_code == 2 and len(result.output.strip().splitlines()) == 1, result.output
    assert {"crash": "ended (exit 139)", "garbage": "not the worker's JSON"}[behaviour] in result.output
