"""prepare-data's table of formats (data/prepare/formats.py): every option a row names is one the command line
has, every option the command line has is some format's, and a row's options are what decides "does not apply"."""

from __future__ import annotations

import dataclasses

import pytest

from gptoss_cli.data.prepare.formats import FORMATS, PrepareOptions, data_format
from gptoss_cli.errors import UsageError

OPTION_FIELDS = {f.name for f in dataclasses.fields(PrepareOptions)}


def test_every_option_a_format_takes_is_a_command_line_option():
    # a misspelt name in a row would make that option "not apply" to the format that should take it
    for fmt in FORMATS.values():
        assert fmt.options <= OPTION_FIELDS - {"errors"}, (fmt.name, sorted(fmt.options - OPTION_FIELDS))


def test_every_command_line_option_is_taken_by_some_format():
    taken = set().union(*(fmt.options for fmt in FORMATS.values())) | {"errors"}
    assert taken == OPTION_FIELDS


def test_an_option_applies_exactly_to_the_formats_whose_row_names_it():
    values = {"text_key": "body", "eos_id": 3, "analysis": "drop", "train_on": "all", "max_length": 64,
              "truncate": True, "seq_length": 64, "split": "train", "field": "chat", "batch_rows": 8}
    assert set(values) == OPTION_FIELDS - {"errors"}
    for name, value in values.items():
        options = PrepareOptions(**{name: value})
        for fmt in FORMATS.values():
            if name in fmt.options:
                assert data_format(fmt.name, options) is fmt
            else:
                flag = "--" + name.replace("_", "-")
                with pytest.raises(UsageError, match=f"^{flag} does not apply to --format {fmt.name}$"):
                    data_format(fmt.name, options)
