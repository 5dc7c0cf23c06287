"""The four checkpoint readers answer `TensorReader` with the same signatures, so code typed against
the Protocol can take any of them; the conversion wrappers keep `RowReader`'s `read`."""

from __future__ import annotations

import inspect

import pytest

from gptoss_cli.checkpoint.storage.dcp_io import DcpReader
from gptoss_cli.checkpoint.storage.finite import NonFiniteCheck
from gptoss_cli.checkpoint.formats.training.readers import LoraMergedReader
from gptoss_cli.checkpoint.formats.megatron.reader import MegatronReader
from gptoss_cli.checkpoint.storage.pipeline import StageClock
from gptoss_cli.checkpoint.storage.readers import RowReader, TensorReader
from gptoss_cli.checkpoint.storage.safetensors_io import CheckpointReader, SafetensorsFile
from gptoss_cli.checkpoint.formats.training.readers import Mxfp4QatReader


def _protocol_methods(protocol) -> list[str]:
    return sorted(n for n, v in vars(protocol).items() if inspect.isfunction(v) and not n.startswith("_"))


def _parameters(fn) -> list[tuple[str, object]]:
    """(name, default) of each parameter: callers pass `start`/`stop` by position and by name."""
    return [(p.name, p.default) for p in inspect.signature(fn).parameters.values()]


@pytest.mark.parametrize("cls", [CheckpointReader, DcpReader, MegatronReader, LoraMergedReader])
def test_each_checkpoint_reader_has_the_protocols_methods_and_signatures(cls):
    methods = _protocol_methods(TensorReader) + _protocol_methods(RowReader)
    assert len(methods) == 7
    for name in methods:
        proto = getattr(TensorReader, name)
        assert callable(getattr(cls, name, None)), f"{cls.__name__} has no {name}()"
        assert _parameters(getattr(cls, name)) == _parameters(proto), f"{cls.__name__}.{name}"


@pytest.mark.parametrize("cls", [SafetensorsFile, Mxfp4QatReader, NonFiniteCheck, StageClock])
def test_wrappers_and_single_files_read_rows_as_the_protocol_says(cls):
    assert _parameters(cls.read) == _parameters(RowReader.read)
