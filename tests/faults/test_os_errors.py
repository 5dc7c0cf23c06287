"""Errors: every OSError is one line naming the path; messages are printed verbatim, never as markup."""

from __future__ import annotations

import json
import math
import shutil


from tests.faults.conftest import assert_one_line, gptoss, leftovers
from tests.support.cli import exit_and_output as invoke


def test_a_path_that_looks_like_markup_is_printed_verbatim(tmp_path):
    src = f"{tmp_path}/x[/y]"  # rich markup would read "[/y]" as a closing tag and crash the error printer
    proc = gptoss("convert", src, tmp_path / "out", cwd=tmp_path)
    assert_one_line(proc, 2, f"{src}: no such folder")


def test_dst_under_a_file_is_one_line(tiny_hf, tmp_path):
    (tmp_path / "file").write_text("x")
    code, out = invoke("convert", tiny_hf, tmp_path / "file" / "dst", "--quiet")
    assert code == 2 and len(out.strip().splitlines()) == 1 and f"{tmp_path / 'file'} is a file" in out, out


def test_read_only_parent_is_one_line_before_any_work(tiny_hf, tmpfs):
    ro = tmpfs("1m", read_only=True)
    code, out = invoke("convert", tiny_hf, ro / "dst", "--quiet")
    assert code == 2 and len(out.strip().splitlines()) == 1, out
    assert f"{ro} is not writable (read-only file system)" in out, out


def test_disk_full_while_writing_hybrid_config_is_one_line_and_leaves_nothing(tiny_hf, tiny_hybrid, tmpfs):
    # Room for about the shard (the free-space check, which counts tensor bytes, passes), then one
    # page more at a time, until the first file that does not fit is hybrid_config.json.
    shard_pages = math.ceil(next(tiny_hybrid.glob("*.safetensors")).stat().st_size / 4096)
    named = []
    for extra in range(5):
        full = tmpfs(str((shard_pages + extra) * 4096))
        code, out = invoke("convert", tiny_hf, full / "dst", "--quiet")
        if code == 0:
            break
        assert code == 2 and len(out.strip().splitlines()) == 1 and str(full) in out, out
        assert list(full.iterdir()) == []
        named.append(out)
    assert any("hybrid_config.json: No space left on device" in out for out in named), named


def test_unwritable_json_after_a_successful_conversion_keeps_the_result(tiny_hf, tmp_path, tmpfs):
    full = tmpfs("64k")
    (full / "filler").write_bytes(b"\0" * (64 * 1024))
    code, out = invoke("convert", tiny_hf, tmp_path / "dst", "--quiet", "--json", full / "result.json")
    assert code == 2 and len(out.strip().splitlines()) == 1, out
    assert f"converted to {tmp_path / 'dst'}, but the JSON summary could not be written" in out, out
    assert json.loads((tmp_path / "dst" / "hybrid_config.json").read_text())["format"] == "gptoss-hybrid"
    assert leftovers(full) == [] and leftovers(tmp_path) == []


def test_json_path_in_a_read_only_folder_is_refused_before_any_work(tiny_hf, tmp_path, tmpfs):
    ro = tmpfs("1m", read_only=True)
    code, out = invoke("convert", tiny_hf, tmp_path / "dst", "--quiet", "--json", ro / "r.json")
    assert code == 2 and f"{ro} is not writable" in out, out
    assert not (tmp_path / "dst").exists()


def test_an_os_error_the_library_did_not_expect_is_still_one_line_naming_the_path(tiny_hf, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(tiny_hf, src)
    (src / "config.json").unlink()
    (src / "config.json").mkdir()  # reading it raises IsADirectoryError deep in the source detection
    code, out = invoke("convert", src, tmp_path / "dst", "--quiet")
    assert code == 2 and out.strip() == f"error: {src / 'config.json'}: Is a directory", out
