"""Version-2 token files (documents, index, loss mask): what a valid file is, and the one-line errors for broken ones."""

from __future__ import annotations

import json

import numpy as np
import pytest

from gptoss_cli.errors import ConfigError
from gptoss_cli.data.token_format import (
    check_token_files, document_file_paths, read_token_header, write_document_index, write_token_header,
)

DOCS = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
MASKS = [[0, 1, 1], [0, 1], [0, 0, 1, 1]]


def write_v2(prefix, docs=DOCS, masks=MASKS, *, loss_mask=True, **overrides):
    """A version-2 file written the way prepare-data writes it: .bin, .idx, .mask, then the header."""
    tokens = [t for d in docs for t in d]
    prefix.with_suffix(".bin").write_bytes(np.asarray(tokens, "<u2").tobytes())
    write_document_index(prefix, np.cumsum([0] + [len(d) for d in docs]))
    if loss_mask:
        prefix.with_suffix(".mask").write_bytes(np.asarray([m for d in masks for m in d], "u1").tobytes())
    fields = dict(dtype="uint16", num_tokens=len(tokens), num_documents=len(docs), vocab_size=50, eos_token_id=None,
                  tokenizer=None, sources=["c.jsonl"])
    documents = dict(loss_mask=loss_mask, kind="harmony", num_loss_tokens=int(sum(map(sum, masks))),
                     max_document_length=max(map(len, docs)), num_dropped=0, rendering={})
    return write_token_header(prefix.with_suffix(".json"), **fields, documents=documents)


def test_a_valid_v2_file_passes_and_its_header_says_version_2(tmp_path):
    header = write_v2(tmp_path / "c")
    assert read_token_header(tmp_path / "c") == header
    assert header["version"] == 2 and header["documents"] is True and header["loss_mask"] is True
    _, _, got, n = check_token_files(tmp_path / "c", 50)
    assert n == 9 and got == header
    assert [p.name for p in document_file_paths(tmp_path / "c.bin")] == ["c.idx", "c.mask"]
    assert np.fromfile(tmp_path / "c.idx", "<i8").tolist() == [0, 3, 5, 9]


def test_a_v2_file_without_a_mask_needs_no_mask_file(tmp_path):
    write_v2(tmp_path / "c", loss_mask=False)
    check_token_files(tmp_path / "c", 50)


def _corrupt_index(prefix, values):
    prefix.with_suffix(".idx").write_bytes(np.asarray(values, "<i8").tobytes())


@pytest.mark.parametrize(
    "corrupt, message",
    [
        (lambda p: p.with_suffix(".idx").unlink(), "c.idx not found"),
        (lambda p: p.with_suffix(".mask").unlink(), "c.mask not found"),
        (lambda p: _corrupt_index(p, [0, 3, 9]), "do not hold the 4 int64 offsets"),
        (lambda p: _corrupt_index(p, [0, 3, 5, 8]), "offsets run from 0 to 8, not from 0 to num_tokens=9"),
        (lambda p: _corrupt_index(p, [1, 3, 5, 9]), "offsets run from 1 to 9"),
        (lambda p: _corrupt_index(p, [0, 5, 3, 9]), "document 1 has -2 tokens"),
        (lambda p: _corrupt_index(p, [0, 1, 5, 9]), "document 0 has 1 tokens"),
        (lambda p: p.with_suffix(".mask").write_bytes(bytes([0, 1, 1, 0, 1, 0, 0, 1])), "8 bytes, not one per token (9)"),
        (lambda p: p.with_suffix(".mask").write_bytes(bytes([0, 1, 1, 0, 1, 0, 0, 1, 1, 0])),
         "10 bytes, not one per token (9)"),
        (lambda p: p.with_suffix(".mask").write_bytes(bytes([0, 1, 1, 0, 2, 0, 0, 1, 1])), "value 2 at token 4"),
        (lambda p: p.with_suffix(".mask").write_bytes(bytes([0, 1, 1, 1, 1, 0, 0, 1, 1])),
         "first token of document 1 (token 3) is marked trained"),
    ],
    ids=["no-index", "no-mask", "index-length", "index-end", "index-start", "index-decreasing", "one-token-document",
         "mask-short", "mask-long", "mask-value", "mask-first-token"],
)
def test_broken_v2_files_are_one_line_errors_naming_the_file(corrupt, message, tmp_path):
    write_v2(tmp_path / "c")
    corrupt(tmp_path / "c")
    with pytest.raises(ConfigError) as exc:
        check_token_files(tmp_path / "c", 50)
    assert message in str(exc.value) and "\n" not in str(exc.value)


@pytest.mark.parametrize(
    "edit, message",
    [
        ({"version": 3}, "token format version 3 is not one this gptoss reads"),
        ({"documents": False}, "a version-2 header needs"),
        ({"loss_mask": "yes"}, "a version-2 header needs"),
        ({"num_documents": 0}, "num_documents=0 is not a positive count"),
    ],
)
def test_bad_v2_headers_are_refused(edit, message, tmp_path):
    header = write_v2(tmp_path / "c")
    (tmp_path / "c.json").write_text(json.dumps({**header, **edit}))
    with pytest.raises(ConfigError, match=message):
        read_token_header(tmp_path / "c")


def test_the_launch_rule_reports_a_broken_v2_file(tmp_path):
    """train's pre-launch rule shares the check: a v2 file that lost its mask is an error there too."""
    from tests.recipe.recipe_helpers import run_rule

    write_v2(tmp_path / "c")
    over = ["data.kind=tokens", f"data.path={tmp_path / 'c'}"]
    assert run_rule("data.source", over, check_paths=True) == []
    (tmp_path / "c.mask").unlink()
    (finding,) = run_rule("data.source", over, check_paths=True)
    assert "c.mask not found" in finding.message
