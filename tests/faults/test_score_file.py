"""The score folder (`gptoss score`): a kill -9 mid-write leaves the old folder or none, and its reader ends any input in one line.

The reader's fuzzing follows issue 54's readers table (tests/faults/test_fuzz_readers.py, where it
exists): `score_folder` draws what a score folder holds around a valid one, `read_score` reads it as a
training run does; any input ends in success or one line with a README exit code, never a traceback.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import tempfile
from pathlib import Path

import pytest
import torch
import typer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gptoss_cli.cli.app import handle_errors
from tests.faults.conftest import digest, leftovers, stop_mid_write
from tests.support.cli import run_cli
from tests.train.sft_files import sft_documents, write_sft_file


@pytest.fixture(scope="module")
def many_documents(tmp_path_factory):
    """200 documents: a write window of a few hundred shards (one per row with --shard-tokens 1)."""
    docs, masks = sft_documents([20] * 200, 1000, seed=1)
    return write_sft_file(tmp_path_factory.mktemp("data") / "docs", docs, masks, 1000)


@pytest.mark.parametrize("existing", [False, True], ids=["new", "replacing"])
def test_kill_9_mid_write_leaves_the_old_folder_or_none_and_the_next_run_cleans_up(tiny_hf, many_documents, tmp_path,
                                                                                   existing):
    out = tmp_path / "scores"
    args = ["score", tiny_hf, "--data", many_documents, "--out", out, "--seq-length", 32, "--shard-tokens", 1, "--quiet"]
    old = tmp_path / "old-scores"
    if existing:
        first = run_cli(*args[:-3], "--quiet")  # one shard: a complete old folder
        assert first.exit_code == 0, first.output
        before = digest(out)
        out.rename(old)

    def reset():
        shutil.rmtree(out, ignore_errors=True)
        if existing:
            shutil.copytree(old, out)

    proc = stop_mid_write(args + ["--top-k", 4, "--force"], out, reset, shard="scores-*.safetensors")
    shutil.rmtree(old, ignore_errors=True)
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    if existing:
        assert digest(out) == before  # the old folder, whole
    else:
        assert not out.exists()
    assert leftovers(tmp_path) == [f".scores.partial-{proc.pid}"]

    again = run_cli(*args, "--top-k", 4, "--force")
    assert again.exit_code == 0, again.output
    assert "note: removed" in again.output and leftovers(tmp_path) == []
    from gptoss_cli.score import open_scores

    scores = open_scores(out, data=many_documents, top_k=4)
    assert scores.lookup(torch.arange(scores.manifest.trained_tokens)).trained.all()


# --- the reader fuzzed -------------------------------------------------------------------------------
def _valid_folder() -> dict[str, bytes]:
    """A real score folder of a tiny fake data file (its files' bytes), made once."""
    from gptoss_cli.score.compute import TokenScores
    from gptoss_cli.score.files import ScoreManifest, ShardWriter

    folder = Path(tempfile.mkdtemp())
    try:
        writer = ShardWriter(folder, 0, 2, 3)
        for start_at in (0, 4):
            n = 4
            writer.add(torch.arange(start_at, start_at + n), torch.arange(n),
                       TokenScores(-torch.rand(n), torch.zeros(n, 2, dtype=torch.int32), -torch.rand(n, 2),
                                   -torch.rand(n)))
        entries = writer.close()
        ScoreManifest("d", "sha256:d", 2, 8, 8, "m", "sha256:m", 10, None, "float32", 2, 1.0, tuple(entries)).write(folder)
        return {p.name: p.read_bytes() for p in folder.iterdir()}
    finally:
        shutil.rmtree(folder)


VALID = _valid_folder()


@st.composite
def score_folder(draw) -> dict[str, bytes]:
    """VALID with its manifest's fields edited or a shard's bytes cut, flipped or replaced."""
    files = dict(VALID)
    name = draw(st.sampled_from(sorted(files)))
    if name == "manifest.json" and draw(st.booleans()):
        raw = json.loads(files[name])
        path = draw(st.sampled_from([("top_k",), ("temperature",), ("data", "trained_tokens"), ("shards",),
                                     ("shards", 0, "file"), ("shards", 0, "tokens"), ("model", "vocab_size"), ("version",)]))
        value = draw(st.one_of(st.none(), st.integers(-2**70, 2**70), st.floats(allow_nan=True), st.text(max_size=8),
                               st.just("../manifest.json"), st.lists(st.integers(), max_size=2)))
        target = raw
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value
        files[name] = json.dumps(raw, allow_nan=True).encode()
        return files
    data = bytearray(files[name])
    how = draw(st.sampled_from(["truncate", "flip", "drop"]))
    if how == "drop":
        del files[name]
        return files
    if how == "truncate":
        data = data[:draw(st.integers(0, max(0, len(data) - 1)))]
    else:
        for _ in range(draw(st.integers(1, 4))):
            data[draw(st.integers(0, len(data) - 1))] = draw(st.integers(0, 255))
    files[name] = bytes(data)
    return files


def read_score(folder: Path) -> None:
    from gptoss_cli.score import open_scores

    scores = open_scores(folder, top_k=2)
    scores.lookup(torch.arange(-1, scores.manifest.trained_tokens).reshape(1, -1))


def test_valid_example_reads_back():
    folder = Path(tempfile.mkdtemp())
    try:
        for name, data in VALID.items():
            (folder / name).write_bytes(data)
        read_score(folder)
    finally:
        shutil.rmtree(folder)


@settings(max_examples=int(os.environ.get("GPTOSS_FUZZ_EXAMPLES", "40")), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(files=score_folder())
def test_the_score_reader_ends_every_input_in_success_or_one_line(files):
    folder = Path(tempfile.mkdtemp())
    try:
        for name, data in files.items():
            (folder / name).write_bytes(data)
        try:
            handle_errors(read_score)(folder)
        except typer.Exit as exc:  # handle_errors printed one line and exits with the README's code
            assert exc.exit_code in (1, 2)
    finally:
        shutil.rmtree(folder)
