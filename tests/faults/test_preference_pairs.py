"""Preference pairs a user hands `prepare-data --format preference`, fuzzed, and the reference pass killed mid-write.

Any drawn pair file (JSONL lines of hostile JSON around the three TRL forms: wrong types,
missing or extra sides, empty or identical sides, unknown roles, messages that are not objects) ends in success or in exactly one `error:` line with exit 1 or 2, through the CLI's own error
handling, never a traceback. `pairs_folder` and `read_pairs` are the row issue 54's readers table
(tests/faults/test_fuzz_readers.py) takes when it lands: `"preference-pairs": Reader(pairs_folder, read_pairs)`.

The pass that scores the reference before training (dpo.reference=precomputed) writes PREFIX.reference with
`gptoss score`'s function: a kill -9 while it writes leaves no folder, and the next run scores it whole.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import tempfile
from pathlib import Path

import pytest
import typer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gptoss_cli.cli.app import handle_errors
from gptoss_cli.demo import preference_pairs
from tests.faults.conftest import leftovers, start, wait_for
from tests.support.cli import run_cli

JSON = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(-(2**40), 2**40), st.text(max_size=6),
                              st.floats(allow_nan=False, allow_infinity=False)),
                    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=5), inner,
                                                                                          max_size=3)), max_leaves=8)
MESSAGE = st.one_of(st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant", "system", "tool", "developer", "x", 3])},
    optional={"content": st.one_of(st.text(max_size=8), JSON), "channel": st.sampled_from(["final", "analysis", "x"]),
              "thinking": JSON, "tool_calls": JSON, "recipient": JSON}), JSON)
MESSAGES = st.lists(MESSAGE, max_size=3)
SIDE = st.one_of(MESSAGES, MESSAGES, st.text(max_size=6), st.fixed_dictionaries({"messages": MESSAGES}), JSON)
PAIR = st.fixed_dictionaries({"chosen": SIDE, "rejected": SIDE},
                             optional={"prompt": SIDE, "reasoning_effort": JSON, "tools": JSON})
ROW = st.one_of(PAIR, PAIR, PAIR, JSON)  # mostly pair-shaped: the checks past the first are what is fuzzed


@st.composite
def pairs_folder(draw) -> tuple[dict[str, bytes], dict[str, int]]:
    """A JSONL pair file around the valid example. (Parquet rows reach the same checks as dicts; damaged Parquet
    and hostile JSON text are data/rows.py's and json_input.py's, which every conversation format shares and
    issue 54's table fuzzes.)"""
    rows = draw(st.lists(ROW, max_size=3)) + draw(st.sampled_from([[], preference_pairs(True)[:1]]))
    return {"pairs.jsonl": b"\n".join(json.dumps(r).encode() for r in rows) or b"{}"}, {}


def read_pairs(folder: Path, tokenizer: Path) -> None:
    from gptoss_cli.data.prepare.preference import prepare_preference

    inputs = sorted(p for p in folder.iterdir() if p.suffix in (".jsonl", ".parquet"))
    # --errors skip: every row is checked, not only those before the first bad one
    prepare_preference(inputs, folder / "out" / "pairs", tokenizer, errors="skip")


@pytest.fixture(scope="module")
def tiny_tokenizer_folder(tmp_path_factory):
    from gptoss_cli.data.tiny_tokenizer import tiny_tokenizer

    folder = tmp_path_factory.mktemp("tok")
    (folder / "tokenizer.json").write_text(json.dumps(tiny_tokenizer(1003)))
    return folder


def test_a_pair_file_ends_in_success_or_one_line(tiny_tokenizer_folder):
    @settings(max_examples=80, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(drawn=pairs_folder())
    def check(drawn):
        files, _ = drawn
        with tempfile.TemporaryDirectory() as tmp:
            folder = Path(tmp)
            for name, data in files.items():
                (folder / name).write_bytes(data)
            err = io.StringIO()
            code = None
            with contextlib.redirect_stderr(err):
                try:
                    handle_errors(lambda: read_pairs(folder, tiny_tokenizer_folder))()
                except typer.Exit as exc:
                    code = exc.exit_code
        if code is not None:
            lines = [ln for ln in err.getvalue().splitlines() if ln.startswith("error:")]
            assert code in (1, 2) and len(lines) == 1 and "Traceback" not in err.getvalue(), err.getvalue()

    check()


def test_kill_9_while_the_reference_is_scored_leaves_no_folder_and_the_next_run_scores_it(tmp_path):
    assert run_cli("make-tiny", tmp_path / "tiny-hf").exit_code == 0
    pairs = preference_pairs(False) * 8  # enough rows that the pass takes a while to write
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pairs))
    assert run_cli("prepare-data", tmp_path / "pairs.jsonl", "--format", "preference", "--tokenizer",
                   tmp_path / "tiny-hf", "--out", tmp_path / "pairs", "--quiet").exit_code == 0
    args = ["train", "--recipe", "tiny_cpu_dpo", f"checkpoint.pretrained={tmp_path / 'tiny-hf'}",
            f"data.path={tmp_path / 'pairs'}", "validation.data=null", "validation.interval=null",
            "dpo.reference=precomputed", "checkpoint.dir=null", "checkpoint.keep_last=null",
            f"logging.run_dir={tmp_path / 'run'}", "training.train_iters=1"]
    proc = start(*args)
    partial = wait_for(lambda: next(iter(tmp_path.glob(".pairs.reference.partial-*")), None)
                       or ("exited" if proc.poll() is not None else None), 120, "the reference pass's folder",
                       interval=0.001)
    assert partial != "exited", proc.communicate()
    writer = int(partial.name.rsplit("-", 1)[1])  # the worker that writes it
    os.kill(writer, signal.SIGKILL)
    proc.communicate(timeout=120)
    assert proc.returncode != 0 and not (tmp_path / "pairs.reference").exists()
    again = run_cli(*args)
    assert again.exit_code == 0, again.output
    assert (tmp_path / "pairs.reference" / "manifest.json").is_file() and leftovers(tmp_path) == []
