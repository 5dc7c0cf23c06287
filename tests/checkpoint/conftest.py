"""Fixtures for conversion tests: transformers-written tiny GPT-OSS checkpoints in both expert forms."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from gptoss_cli.checkpoint.convert import convert  # noqa: E402
from tests.model.tiny_checkpoints import write_hf_checkpoint  # noqa: E402


@pytest.fixture(scope="session")
def hf_bf16(tmp_path_factory) -> Path:
    """Written by transformers' save_pretrained (bf16 expert form: gate_up_proj [E, H, 2I], fp32 values)."""
    return write_hf_checkpoint(tmp_path_factory.mktemp("hf_bf16") / "ckpt", experts="bf16", seed=1)


@pytest.fixture(scope="session")
def hf_mxfp4(tmp_path_factory) -> Path:
    """The same kind of model with experts stored as MXFP4 blocks/scales, as the released checkpoints."""
    return write_hf_checkpoint(tmp_path_factory.mktemp("hf_mx") / "ckpt", experts="mxfp4", seed=2)


@pytest.fixture(scope="session")
def hybrid_from_bf16(hf_bf16, tmp_path_factory) -> Path:
    dst = tmp_path_factory.mktemp("hyb_bf16") / "hybrid"
    convert(str(hf_bf16), dst, dtype="float32")
    return dst


@pytest.fixture(scope="session")
def hybrid_from_mxfp4(hf_mxfp4, tmp_path_factory) -> Path:
    dst = tmp_path_factory.mktemp("hyb_mx") / "hybrid"
    convert(str(hf_mxfp4), dst, dtype="float32")
    return dst


@pytest.fixture
def hf_copy(hf_bf16, tmp_path) -> Path:
    """A private copy of the bf16-form checkpoint that a test may corrupt."""
    dst = tmp_path / "src"
    shutil.copytree(hf_bf16, dst)
    return dst
