"""The one JSONL line reader (json_input.jsonl_lines) behind prepare-data, its harmony format and generate --prompts."""

from __future__ import annotations

import pytest

from gptoss_cli.errors import UsageError
from gptoss_cli.json_input import jsonl_lines


def utf8(raw: bytes, number: int, offset: int) -> str:
    return raw.decode("utf-8")


def test_every_byte_is_counted_and_blank_lines_are_not_values(tmp_path):
    path = tmp_path / "x.jsonl"
    path.write_bytes(b'{"a": 1}\n\n  \nnull\n{"b": "\xc3\xa9"}')  # no newline at the end
    lines = list(jsonl_lines(path, utf8))
    assert sum(line.nbytes for line in lines) == path.stat().st_size
    assert [(line.number, line.blank, line.value) for line in lines] == [
        (1, False, {"a": 1}), (2, True, None), (3, True, None), (4, False, None), (5, False, {"b": "é"})]


def test_decode_sees_each_lines_number_and_byte_offset(tmp_path):
    path = tmp_path / "x.jsonl"
    path.write_bytes(b'{}\n\n[1]\n')
    seen = []
    list(jsonl_lines(path, lambda raw, number, offset: seen.append((number, offset)) or raw.decode()))
    assert seen == [(1, 0), (2, 3), (3, 4)]


@pytest.mark.parametrize("not_json", ["not JSON", "not a JSON object"])
def test_a_line_that_is_not_json_names_file_and_line_in_the_callers_words(tmp_path, not_json):
    path = tmp_path / "x.jsonl"
    path.write_text('{}\n{"a": \n')
    with pytest.raises(UsageError, match=rf"x\.jsonl:2: {not_json} \("):
        list(jsonl_lines(path, utf8, not_json=not_json))
