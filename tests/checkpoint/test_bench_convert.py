"""bench/convert.py's refusal of a work folder without O_DIRECT: one line naming it, before any work."""

from __future__ import annotations

import errno
import sys

import pytest

from bench import convert as bench_convert
from gptoss_cli.checkpoint.storage import direct_write


def test_a_workdir_without_o_direct_is_one_line_naming_it_and_the_ways_out(tmp_path, monkeypatch, capsys):
    def refuse(path, flags):  # what tmpfs before Linux 6.6 answers
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(direct_write, "open_direct", refuse)
    monkeypatch.setattr(bench_convert, "write_synthetic", lambda *a: pytest.fail("not refused before the work"))
    work = tmp_path / "shm"
    monkeypatch.setattr(sys, "argv", ["convert.py", "--decode-rounds", "0", "--rounds", "1", "--workdir", str(work)])
    with pytest.raises(SystemExit) as exc:
        bench_convert.main()
    message = str(exc.value.code)
    assert "\n" not in message and str(work) in message and "--workdir" in message and "--copies cp" in message
    assert list(work.iterdir()) == []  # refused before writing the synthetic checkpoint


def test_a_disk_taking_o_direct_passes_the_probe_and_keeps_no_file(tmp_path):
    if not bench_convert.takes_o_direct(tmp_path):
        pytest.skip(f"{tmp_path}: this filesystem does not take O_DIRECT writes")
    assert list(tmp_path.iterdir()) == []
