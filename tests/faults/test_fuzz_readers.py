"""Every reader of bytes a user hands gptoss, fuzzed: any input ends in success or in one line with a README exit
code, never a traceback, and memory stays bounded.

`READERS` is the table: one `Reader` per kind of user file, with a hypothesis strategy for what a folder holds
(file name -> bytes, drawn around a valid example: hostile JSON, wrong types, huge and negative numbers,
truncations, byte flips, sparse files claiming terabytes) and the library entry that reads it as a command
does. Each drawn folder is read through the CLI's own error handling (`handle_errors`); the test asserts that
it returned, or ended with exit 1 or 2 and exactly one `error:` line. Any other exception (a KeyError, a
TypeError: a bug) escapes `handle_errors` and fails the test with hypothesis's shrunk example.

Memory: every claim a reader allocates for goes through gptoss_cli/allocation.py, whose ceiling is set to
MEMORY_CAP here (a claim above it must be refused before allocating, not attempted), and the process's peak
resident memory (VmHWM, reset before each reader) may grow by at most PEAK_GROWTH while a reader is fuzzed.

A new reader (preference pairs, teacher top-k files, rollout files, GGUF headers) is one entry in
`READERS`: a strategy for its folder and the function that reads it. Examples are derandomised (the
"ci" profile of tests/conftest.py), EXAMPLES each, all readers together well under a minute;
`GPTOSS_FUZZ_EXAMPLES=2000 HYPOTHESIS_PROFILE=explore python -m pytest tests/faults/test_fuzz_readers.py`
is the longer local run (fresh random examples, more of them).
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
import os
import pickle
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import pytest
import typer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gptoss_cli import allocation
from gptoss_cli.cli.app import handle_errors
from tests.faults.test_preference_pairs import pairs_folder, read_pairs
from tests.faults.test_score_file import read_score, score_folder

EXAMPLES = int(os.environ.get("GPTOSS_FUZZ_EXAMPLES", "100"))
MEMORY_CAP = 256 << 20
PEAK_GROWTH = 768 << 20
TB = 1 << 40

Folder = dict[str, bytes]


# --- building blocks ---------------------------------------------------------------------------------
json_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.sampled_from([0, 1, -1, 2**31, 2**63, 2**64]),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=8))
json_values = st.recursive(json_scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=6), inner, max_size=4)), max_leaves=12)


def dumps(value: Any) -> bytes:
    return json.dumps(value, allow_nan=True).encode()


@st.composite
def mutated(draw, valid: bytes) -> bytes:
    """`valid`, or it cut short, or with a few bytes changed, or random bytes."""
    how = draw(st.sampled_from(["keep", "truncate", "flip", "random", "empty"]))
    if how == "truncate" and valid:
        return valid[:draw(st.integers(0, len(valid) - 1))]
    if how == "flip" and valid:
        data = bytearray(valid)
        for _ in range(draw(st.integers(1, 4))):
            data[draw(st.integers(0, len(data) - 1))] = draw(st.integers(0, 255))
        return bytes(data)
    if how == "random":
        return draw(st.binary(max_size=64))
    return b"" if how == "empty" else valid


@st.composite
def edited_json(draw, valid: dict) -> bytes:
    """`valid` with fields replaced by any JSON (one level deep or in a nested object), or dropped, or hostile text."""
    value = json.loads(json.dumps(valid))
    for _ in range(draw(st.integers(0, 3))):
        target = value
        path = draw(st.lists(st.sampled_from(sorted(_keys(value))), min_size=1, max_size=1)) if _keys(value) else []
        for key in path[:-1]:
            target = target[key]
        if path:
            if draw(st.booleans()):
                target[path[-1]] = draw(json_values)
            else:
                target.pop(path[-1], None)
    how = draw(st.sampled_from(["json", "json", "json", "deep", "bigint", "surrogate", "bytes"]))
    if how == "deep":
        return b"[" * 5000 + b"]" * 5000
    if how == "bigint":
        return b'{"step": ' + b"9" * 5000 + b"}"
    if how == "surrogate":
        return b'{"a": "\\ud800"}'
    if how == "bytes":
        return draw(mutated(dumps(value)))
    return dumps(value)


def _keys(value: Any) -> set:
    return set(value) if isinstance(value, dict) else set()


def write(folder: Path, files: Folder, sparse: dict[str, int] | None = None) -> None:
    for name, data in files.items():
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    for name, size in (sparse or {}).items():
        os.truncate(folder / name, size)


# --- readers ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Reader:
    """One kind of user file: `folder` draws (files, sparse sizes) and `read(path)` reads it as a command does."""

    folder: Callable[[], st.SearchStrategy]
    read: Callable[[Path], Any]


SAFETENSORS_DTYPES = ["F32", "BF16", "F16", "F64", "I64", "U8", "BOOL", "F8_E4M3", "F4", "", 7]
dims = st.one_of(st.integers(0, 6), st.sampled_from([-1, 2**31, 2**40, 2**62, 2**64]), st.text(max_size=1))


@st.composite
def safetensors_folder(draw) -> tuple[Folder, dict[str, int]]:
    entries, offset = {}, 0
    for i in range(draw(st.integers(0, 3))):
        shape = draw(st.lists(dims, max_size=3))
        n = 4
        for d in shape:
            n = n * d if isinstance(d, int) and not isinstance(d, bool) else n
        size = draw(st.one_of(st.just(n), st.integers(-4, 64), st.just(TB)))
        offsets = draw(st.one_of(st.just([offset, offset + size]), st.lists(st.integers(-2, 2**41), max_size=3),
                                 json_values))
        entries[draw(st.sampled_from([f"t{i}", "__metadata__", "w"]))] = draw(st.one_of(
            st.just({"dtype": draw(st.sampled_from(SAFETENSORS_DTYPES)), "shape": shape, "data_offsets": offsets}),
            json_values))
        offset += max(0, size) if isinstance(size, int) else 0
    header = dumps(entries)
    length = draw(st.one_of(st.just(len(header)), st.integers(0, 2**64 - 1)))
    data = draw(st.binary(max_size=64))
    raw = length.to_bytes(8, "little") + header + data
    files = {"model.safetensors": draw(st.one_of(st.just(raw), mutated(raw)))}
    sparse = {"model.safetensors": 8 + len(header) + TB + 64} if draw(st.integers(0, 3)) == 0 else {}
    if draw(st.integers(0, 3)) == 0:
        files["model.safetensors.index.json"] = draw(edited_json({"weight_map": {"t0": "model.safetensors"}}))
    return files, sparse


def read_safetensors(folder: Path) -> None:
    from gptoss_cli.checkpoint.storage.safetensors_io import CheckpointReader

    with CheckpointReader(folder) as reader:
        for name in reader.names():
            reader.read(name)


def _dcp_example() -> Folder:
    """A small DCP checkpoint as torch writes it (what a training checkpoint's files look like)."""
    import torch
    import torch.distributed.checkpoint as dcp

    from gptoss_cli.checkpoint.storage.dcp_io import quiet_single_process

    with tempfile.TemporaryDirectory() as tmp, quiet_single_process():
        dcp.save({"model": {"a": torch.arange(6.0).view(2, 3), "b": torch.ones(4, dtype=torch.bfloat16)}},
                 checkpoint_id=tmp)
        return {p.name: p.read_bytes() for p in Path(tmp).iterdir()}


@st.composite
def dcp_folder(draw) -> tuple[Folder, dict[str, int]]:
    import torch

    files = dict(DCP_EXAMPLE)
    what = draw(st.sampled_from(["metadata-bytes", "metadata-fields", "shard"]))
    if what == "metadata-bytes":
        files[".metadata"] = draw(mutated(files[".metadata"]))
    elif what == "shard":
        shard = next(n for n in files if n.endswith(".distcp"))
        files[shard] = draw(mutated(files[shard]))
    else:  # allow-listed classes with hostile fields
        meta = pickle.loads(files[".metadata"])
        key = draw(st.sampled_from(sorted(meta.state_dict_metadata)))
        entry = meta.state_dict_metadata[key]
        field = draw(st.sampled_from(["size", "chunks", "offsets", "length"]))
        value = draw(st.one_of(json_values, st.just(torch.Size([2**20, 2**20])), st.just(torch.Size([2**40]))))
        target = {"size": entry, "chunks": entry}.get(field) or next(iter(meta.storage_data.values()))
        if field == "offsets" and getattr(entry, "chunks", None):
            target, field = entry.chunks[0], "sizes"
        object.__setattr__(target, field, value)
        files[".metadata"] = pickle.dumps(meta)
    return files, {}


def read_dcp(folder: Path) -> None:
    from gptoss_cli.checkpoint.storage.dcp_io import DcpReader

    reader = DcpReader(folder, lambda n: f"model.{n}", lambda k: k[6:] if k.startswith("model.") else None)
    for name in reader.names():
        reader.read(name)


@st.composite
def megatron_folder(draw) -> tuple[Folder, dict[str, int]]:
    import argparse

    import torch

    buf = io.BytesIO()
    args = argparse.Namespace(num_layers=draw(json_values), hidden_size=64, tensor_model_parallel_size=draw(json_values))
    torch.save({"args": args, "iteration": draw(json_values)}, buf)
    common = draw(st.one_of(st.just(buf.getvalue()), mutated(buf.getvalue()), st.just(_zip_bomb())))
    files = {"iter_0000001/common.pt": common, "iter_0000001/metadata.json": draw(edited_json(
        {"sharded_backend": "torch_dist"})),
        "latest_checkpointed_iteration.txt": draw(st.one_of(st.sampled_from([b"1", b"release", b"\xb2", b"-1"]),
                                                            st.binary(max_size=24)))}
    return files, {}


@functools.cache
def _zip_bomb() -> bytes:
    """A zip whose data.pkl inflates to 1 GiB from about a megabyte."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_DEFLATED, compresslevel=1) as zf:
        with zf.open("archive/data.pkl", "w", force_zip64=True) as fh:
            chunk = b"\0" * (1 << 24)
            for _ in range(64):
                fh.write(chunk)
    return buf.getvalue()


def read_megatron(folder: Path) -> None:
    from gptoss_cli.checkpoint.formats.megatron.common import find_iteration_folder, load_common

    find_iteration_folder(folder)
    load_common(folder / "iter_0000001" / "common.pt")


TOKEN_HEADER = {"format": "gptoss-tokens", "version": 2, "dtype": "uint16", "num_tokens": 6, "num_documents": 2,
                "vocab_size": 1003, "eos_token_id": 1002, "documents": True, "loss_mask": True}


@st.composite
def token_folder(draw) -> tuple[Folder, dict[str, int]]:
    import numpy as np

    files = {"data.json": draw(edited_json(TOKEN_HEADER)),
             "data.bin": draw(mutated(np.arange(6, dtype="<u2").tobytes())),
             "data.idx": draw(mutated(np.array([0, 3, 6], dtype="<i8").tobytes())),
             "data.mask": draw(mutated(bytes([0, 1, 1, 0, 1, 1])))}
    sparse = {"data.idx": draw(st.sampled_from([8 * (2**37 + 1), 8 * 3]))} if draw(st.integers(0, 4)) == 0 else {}
    return files, sparse


def read_tokens(folder: Path) -> None:
    from gptoss_cli.data.token_format import check_token_files

    check_token_files(folder / "data", vocab_size=1003)


def _run_record() -> dict:
    from gptoss_cli.checkpoint.formats.training.record import run_record
    from gptoss_cli.model.config import preset

    lora = {"rank": 2, "alpha": 4.0, "dropout": 0.0, "target_modules": ["linear_qkv"],
            "base": {"path": "/nonexistent", "sha256": "0" * 64}}
    run = run_record(arch=preset("tiny"), hybrid_layer_pattern="*E*E*E", params_dtype="fp32", name="r", run_dir="/tmp",
                     recipe={"training": {"lr": 1e-3}}, lora=lora)
    return {"step": 2, "consumed_samples": 8, "lr_schedule": {"max_lr": 1e-3, "min_lr": 1e-4}, "name": "r",
            "run": run, "world_size": 1, "ep_size": 1, "pp_size": 1}


@st.composite
def run_record_folder(draw) -> tuple[Folder, dict[str, int]]:
    state = json.loads(json.dumps(_run_record()))
    section = draw(st.sampled_from(["state", "run", "lora", "architecture"]))
    target = {"state": state, "run": state["run"], "lora": state["run"]["lora"],
              "architecture": state["run"]["architecture"]}[section]
    for _ in range(draw(st.integers(1, 3))):
        key = draw(st.sampled_from(sorted(target)))
        target[key] = draw(st.one_of(json_values, st.sampled_from([float("nan"), float("inf"), -1, 2**64, 0])))
    text = draw(st.one_of(st.just(dumps(state)), edited_json(state)))
    return {"iter_0000002/train_state.json": text}, {}


def read_run(folder: Path) -> None:
    from gptoss_cli.checkpoint.formats.training.record import read_training_run

    read_training_run(folder / "iter_0000002")


@st.composite
def prompts_folder(draw) -> tuple[Folder, dict[str, int]]:
    lines = draw(st.lists(st.one_of(
        st.builds(lambda v: dumps(v), json_values),
        st.builds(lambda m: dumps({"messages": m}), st.lists(st.dictionaries(
            st.sampled_from(["role", "content", "channel", "recipient", "name"]), json_values, max_size=4), max_size=3)),
        st.binary(max_size=16)), max_size=4))
    return {"prompts.jsonl": b"\n".join(lines)}, {}


def read_prompts(folder: Path) -> None:
    from gptoss_cli.rl.prompts import read_records

    read_records(str(folder / "prompts.jsonl"))


@st.composite
def conversations_folder(draw) -> tuple[Folder, dict[str, int]]:
    message = st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system", "tool", "x", 3])},
                                    optional={"content": json_values, "channel": json_values, "name": json_values,
                                              "tool_calls": json_values, "thinking": json_values})
    rows = draw(st.lists(st.one_of(st.fixed_dictionaries({"messages": st.lists(message, max_size=3)},
                                                         optional={"tools": json_values}), json_values), max_size=3))
    kind = draw(st.sampled_from(["jsonl", "parquet"]))
    if kind == "jsonl":
        return {"conv.jsonl": b"\n".join(dumps(r) for r in rows) or b"{}"}, {}
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({"messages": [json.dumps(r.get("messages") if isinstance(r, dict) else r, allow_nan=True)
                                   for r in rows] or ["[]"]})
    buf = io.BytesIO()
    pq.write_table(table, buf)
    return {"conv.parquet": draw(st.one_of(st.just(buf.getvalue()), mutated(buf.getvalue())))}, {}


def read_conversations(folder: Path) -> None:
    from gptoss_cli.data.prepare.conversations import prepare_conversations

    inputs = sorted(p for p in folder.iterdir() if p.suffix in (".jsonl", ".parquet"))
    prepare_conversations(inputs, folder / "out" / "sft", TOKENIZER_FOLDER)


@st.composite
def config_folder(draw) -> tuple[Folder, dict[str, int]]:
    """An HF config.json (architecture fields), a Hybrid hybrid_config.json, a PEFT adapter_config.json."""
    from gptoss_cli.checkpoint.formats.hf.config import to_hf_config
    from gptoss_cli.checkpoint.formats.peft.adapter import adapter_config
    from gptoss_cli.model.config import preset

    which = draw(st.sampled_from(["config.json", "adapter_config.json"]))
    valid = (to_hf_config(preset("tiny")) if which == "config.json" else
             adapter_config(rank=2, alpha=4.0, dropout=0.0, target_modules=("linear_qkv",), base_model="/b"))
    return {which: draw(edited_json(valid))}, {}


def read_config(folder: Path) -> None:
    from gptoss_cli.checkpoint import formats
    from gptoss_cli.checkpoint.formats.peft import replaceable
    from gptoss_cli.checkpoint.load import checkpoint_architecture

    if (folder / "adapter_config.json").exists():
        replaceable(folder)  # --force reads it to decide whether DST is a PEFT adapter of ours
        formats.detect(folder)
        return
    checkpoint_architecture(folder)


@st.composite
def rollouts_folder(draw) -> tuple[Folder, dict[str, int]]:
    """A run folder's rollout file (rl.save_rollouts): valid, its bytes mutated, its metadata record edited, or a
    table whose columns have other types, nulls or per-token lists of other lengths."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from gptoss_cli.rl.rollout_file import META_KEY, file_name, write_rollout_file

    with tempfile.TemporaryDirectory() as tmp:
        n = draw(st.integers(0, 3))
        rows = [{"step": draw(st.integers(-2, 2**40)), "rank": 0, "prompt": 0, "prompt_source": "p:1",
                 "prompt_ids": [1], "prompt_text": draw(st.text(max_size=4)), "completion_ids": list(range(n)),
                 "completion_text": "c", "final_text": "f", "finish": draw(st.sampled_from(["stop", "length", ""])),
                 "reward": draw(st.one_of(st.none(), st.floats(allow_nan=True, allow_infinity=True))),
                 "advantage": 0.0, "engine_logprobs": [-1.0] * draw(st.sampled_from([n, n + 1])),
                 "trainer_logprobs": None, "is_weights": draw(st.lists(st.floats(0, 3), min_size=n, max_size=n))}
                for _ in range(draw(st.integers(0, 3)))]
        meta = {"is_correction": {"mode": draw(st.sampled_from(["icepop", "tis", 7]))}}
        path = write_rollout_file(Path(tmp), 1, rows, [None] * len(rows), meta)
        raw = path.read_bytes()
        how = draw(st.sampled_from(["bytes", "meta", "columns"]))
        if how == "meta":
            table = pq.read_table(path)
            record = json.loads(table.schema.metadata[META_KEY])
            table = table.replace_schema_metadata({META_KEY: draw(edited_json(record))})
            pq.write_table(table, path)
            raw = path.read_bytes()
        elif how == "columns":
            table = pq.read_table(path)
            name = draw(st.sampled_from(table.column_names))
            column = draw(st.sampled_from([pa.array([None] * len(table), pa.int64()), pa.array(["x"] * len(table)),
                                           pa.array([[1.5]] * len(table))]))
            pq.write_table(table.set_column(table.column_names.index(name), name, column), path)
            raw = path.read_bytes()
        else:
            raw = draw(mutated(raw))
    return {f"rollouts/{file_name(1)}": raw}, {}


def read_rollouts(folder: Path) -> None:
    from gptoss_cli.rl.rollout_file import summarise_rollouts

    summarise_rollouts(folder)


# --- this turn's inputs: score folders, preference pairs, GGUF headers ---------------------------------------
@st.composite
def score_files(draw) -> tuple[Folder, dict[str, int]]:
    return draw(score_folder()), {}  # a real tiny score folder (tests/faults/test_score_file.py), edited


def read_scores(folder: Path) -> None:
    read_score(folder)


def read_preference(folder: Path) -> None:
    read_pairs(folder, TOKENIZER_FOLDER)


@functools.lru_cache(maxsize=1)
def _gguf_example() -> bytes:
    """make-tiny's checkpoint written by `convert --to gguf` (f32 tensors, MXFP4 experts): the file's bytes."""
    from gptoss_cli.checkpoint.convert import convert
    from gptoss_cli.checkpoint.make_tiny import make_tiny

    with tempfile.TemporaryDirectory() as tmp:
        src, out = Path(tmp) / "tiny", Path(tmp) / "m.gguf"
        make_tiny(src, experts="mxfp4", seed=3)
        convert(str(src), out, to="gguf", dtype="f32")
        return out.read_bytes()


@st.composite
def gguf_folder(draw) -> tuple[Folder, dict[str, int]]:
    """The example GGUF with its header's bytes flipped, cut, or a count / length claimed huge (the header is the
    first few kB: the edits land there), or the file cut short of its tensors."""
    raw = bytearray(_gguf_example())
    header_end = min(len(raw), 1 << 14)
    how = draw(st.sampled_from(["flip", "truncate", "u64", "version"]))
    if how == "flip":
        for _ in range(draw(st.integers(1, 6))):
            raw[draw(st.integers(0, header_end - 1))] = draw(st.integers(0, 255))
    elif how == "truncate":
        raw = raw[:draw(st.one_of(st.integers(0, header_end), st.integers(header_end, len(raw) - 1)))]
    elif how == "u64":  # a length or count field: 8 bytes anywhere in the header set to a huge or odd value
        at = draw(st.integers(8, header_end - 8))
        raw[at:at + 8] = draw(st.sampled_from([2**63, 2**64 - 1, TB, 2**31])).to_bytes(8, "little")
    else:
        raw[4:8] = draw(st.integers(0, 2**32 - 1)).to_bytes(4, "little")
    return {"model.gguf": bytes(raw)}, {}


def read_gguf(folder: Path) -> None:
    """What serve-check --export and convert --force read of a GGUF they are handed: the architecture it holds,
    its tensors' types, whether gptoss wrote it."""
    from gptoss_cli.checkpoint import formats
    from gptoss_cli.checkpoint.formats.gguf import reader
    from gptoss_cli.parity.serve.llamacpp import _gguf_types

    path = folder / "model.gguf"
    formats.GGUF.architecture(path)
    _gguf_types(path, "f32")
    reader.read_header(path)


READERS: dict[str, Reader] = {
    "safetensors": Reader(safetensors_folder, read_safetensors),
    "dcp-metadata": Reader(dcp_folder, read_dcp),
    "megatron-common": Reader(megatron_folder, read_megatron),
    "token-files": Reader(token_folder, read_tokens),
    "run-record": Reader(run_record_folder, read_run),
    "rl-prompts-jsonl": Reader(prompts_folder, read_prompts),
    "conversations-jsonl-parquet": Reader(conversations_folder, read_conversations),
    "configs": Reader(config_folder, read_config),
    "rollout-files": Reader(rollouts_folder, read_rollouts),
    "score-folder": Reader(score_files, read_scores),
    "preference-pairs": Reader(pairs_folder, read_preference),
    "gguf-header": Reader(gguf_folder, read_gguf),
}


# --- the test --------------------------------------------------------------------------------------------
DCP_EXAMPLE: Folder = {}
TOKENIZER_FOLDER: Path = Path()


@pytest.fixture(scope="module", autouse=True)
def _examples(tmp_path_factory):
    global DCP_EXAMPLE, TOKENIZER_FOLDER
    from gptoss_cli.data.tiny_tokenizer import tiny_tokenizer

    DCP_EXAMPLE = _dcp_example()
    TOKENIZER_FOLDER = tmp_path_factory.mktemp("tok")
    (TOKENIZER_FOLDER / "tokenizer.json").write_text(json.dumps(tiny_tokenizer(1003)))


def one_line_or_success(read: Callable[[], Any]) -> tuple[int | None, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            handle_errors(read)()
        except typer.Exit as exc:
            return exc.exit_code, err.getvalue()
    return None, err.getvalue()


def _peak_rss() -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _reset_peak() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")  # Linux: VmHWM back to the current resident set
        return True
    except OSError:
        return False


@pytest.mark.parametrize("name", sorted(READERS))
def test_a_reader_ends_every_input_in_success_or_one_line(name, monkeypatch):
    monkeypatch.setattr(allocation, "memory_ceiling_bytes", lambda: MEMORY_CAP)
    reader = READERS[name]
    measured = _reset_peak()
    before = _peak_rss()

    @settings(max_examples=EXAMPLES, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                                            HealthCheck.large_base_example])
    @given(drawn=reader.folder())
    def check(drawn):
        files, sparse = drawn
        with tempfile.TemporaryDirectory() as tmp:
            folder = Path(tmp)
            write(folder, files, sparse)
            code, err = one_line_or_success(lambda: reader.read(folder))
        if code is not None:
            lines = [line for line in err.splitlines() if line.strip()]
            assert code in (1, 2) and len(lines) == 1 and lines[0].startswith("error: "), (code, err)
            assert "Traceback" not in err

    check()
    if measured and before is not None:
        assert _peak_rss() - before <= PEAK_GROWTH, f"{name}: peak memory grew by {(_peak_rss() - before) >> 20} MiB"
