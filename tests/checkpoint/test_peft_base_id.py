"""`convert --to peft` names the base as PEFT users load it (issue 53): adapter_config.json's
`base_model_name_or_path` is the base's Hub id where it can be told (a Hub-cache folder, a config.json's
`_name_or_path`, what a Hybrid base was converted from), else the HF folder's name, never an absolute path."""

from __future__ import annotations

import json
from pathlib import Path

from gptoss_cli.checkpoint.formats.hybrid.config import HYBRID_CONFIG
from gptoss_cli.checkpoint.formats.peft.base_id import base_model_id


def _hf(folder: Path, **config) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "gpt_oss", **config}))
    return folder


def _hybrid(folder: Path, source: str) -> Path:
    folder.mkdir(parents=True)
    (folder / HYBRID_CONFIG).write_text(json.dumps({"format": "gptoss-hybrid", "provenance": {"source": source}}))
    return folder


def test_a_base_in_the_hub_cache_is_named_by_its_hub_id(tmp_path):
    snapshot = _hf(tmp_path / "hub" / "models--openai--gpt-oss-20b" / "snapshots" / "0123abc")
    assert base_model_id(str(snapshot)) == "openai/gpt-oss-20b"


def test_a_hybrid_base_is_named_by_what_it_was_converted_from(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert base_model_id(str(_hybrid(tmp_path / "h1", "openai/gpt-oss-120b"))) == "openai/gpt-oss-120b"
    cached = _hf(tmp_path / "cache" / "models--openai--gpt-oss-20b" / "snapshots" / "r")
    assert base_model_id(str(_hybrid(tmp_path / "h2", str(cached)))) == "openai/gpt-oss-20b"
    named = _hf(tmp_path / "local-20b", _name_or_path="openai/gpt-oss-20b")
    assert base_model_id(str(_hybrid(tmp_path / "h3", str(named)))) == "openai/gpt-oss-20b"


def test_an_unknown_local_base_is_named_by_its_hf_folder_never_an_absolute_path(tmp_path):
    hf = _hf(tmp_path / "models" / "my-gpt-oss")
    assert base_model_id(str(hf)) == "my-gpt-oss"
    assert base_model_id(str(_hybrid(tmp_path / "models" / "my-gpt-oss-hybrid", str(hf)))) == "my-gpt-oss"
