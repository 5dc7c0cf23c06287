"""The rollout files rl.save_rollouts writes (one Parquet file per rollout batch), their reader and their summary.

`logging.run_dir/rollouts/rollout_NNNNNN.parquet` holds rollout NNNNNN (1-based) of a GRPO run, every data-parallel
rank's completions, one row each, in rank order and within a rank in sampling order (groups of rl.group_size
consecutive rows). Columns:

    step              int64          the optimizer step (1-based) that trains the completion
    rank              int32          the data-parallel rank that sampled it
    prompt            int64          the prompt's index in rl.prompts; prompt_source its FILE:LINE
    prompt_ids        list<int32>    the rendered prompt; prompt_text its decoding (harmony tokens included)
    completion_ids    list<int32>    the sampled tokens; completion_text their decoding, final_text the final
                                     channel's text (what the reward read), finish "stop" or "length"
    reward            float64        null where the reward failed
    advantage         float64
    engine_logprobs   list<float32>  per completion token, the engine's log-probability of it
    trainer_logprobs  list<float32>  the trainer's at the rollout's weights (null when it was not kept)
    is_weights        list<float32>  the rl.is_correction weight each token's loss got (0: masked)
    routes            list<fixed_size_binary[L*k]>   per fed token (prompt + completion - 1), the uint8 global
                                     expert ids of every MoE layer, layer-major: row[l * k + j]; null without
                                     a capture

The file's key-value metadata `gptoss.rollouts` (JSON) says the format and version, the rollout and its first
step, rl.group_size, the correction (mode and bounds) and, with routes, their shape (`moe_layers`: the HF block of
each MoE layer, `top_k`). A file is written under a temporary name in the same folder and renamed into place,
so a kill leaves it whole or absent (a temporary `.rollout_NNNNNN.parquet.tmp-PID` is removed by the next write
of that rollout, and never read).

`summarise_rollouts(run_dir)` is what `gptoss report` shows: the files and completions, the reward's
distribution, completion lengths, the share of tokens and completions the correction masked, a few example
completions. Torch-free: it needs pyarrow only (the `datasets` extra).
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path
from typing import Any, Iterable, Iterator

from gptoss_cli.errors import UsageError, file_system_error, require_extra

ROLLOUTS_DIR = "rollouts"
FORMAT, VERSION = "gptoss-rollouts", 1
META_KEY = b"gptoss.rollouts"
_NAME = re.compile(r"rollout_(\d{6,})\.parquet\Z")
HINT = "rollout files are written by gptoss train (rl.save_rollouts); restore the file or remove it"
BATCH_ROWS = 256  # rows decoded at once when a file is read
EXAMPLE_CHARS = 240  # of each text an example shows


def file_name(rollout: int) -> str:
    """The file of rollout `rollout` (1-based)."""
    return f"rollout_{rollout:06d}.parquet"


def _pyarrow():
    require_extra("pyarrow", "rl.save_rollouts' Parquet files", "datasets", field="rl.save_rollouts")
    import pyarrow as pa
    import pyarrow.parquet  # noqa: F401

    return pa


def schema(pa: Any, route_width: int | None) -> Any:
    """The files' Arrow schema (the module docstring); `route_width` = MoE layers x top-k (any, without routes)."""
    ints, floats = pa.list_(pa.int32()), pa.list_(pa.float32())
    return pa.schema([
        ("step", pa.int64()), ("rank", pa.int32()), ("prompt", pa.int64()), ("prompt_source", pa.string()),
        ("prompt_ids", ints), ("prompt_text", pa.string()), ("completion_ids", ints), ("completion_text", pa.string()),
        ("final_text", pa.string()), ("finish", pa.string()), ("reward", pa.float64()), ("advantage", pa.float64()),
        ("engine_logprobs", floats), ("trainer_logprobs", floats), ("is_weights", floats),
        ("routes", pa.list_(pa.binary(route_width or 1)))])


def routes_array(pa: Any, routes: list[Any], width: int) -> Any:
    """The routes column from one uint8 array [tokens, layers, k] (numpy, C order) or None per row, built on the
    arrays' bytes without a Python object per token."""
    import numpy as np

    have = [r for r in routes if r is not None]
    data = np.concatenate([np.ascontiguousarray(r, dtype=np.uint8).reshape(-1) for r in have]) if have else \
        np.zeros(0, np.uint8)
    values = pa.FixedSizeBinaryArray.from_buffers(pa.binary(width), len(data) // width, [None, pa.py_buffer(data)])
    offsets = np.zeros(len(routes) + 1, np.int32)
    np.cumsum([0 if r is None else len(r) for r in routes], out=offsets[1:])
    return pa.ListArray.from_arrays(pa.array(offsets), values, mask=pa.array([r is None for r in routes], pa.bool_()))


def write_rollout_file(folder: Path, rollout: int, rows: list[dict[str, Any]], routes: list[Any],
                       meta: dict[str, Any]) -> Path:
    """Write rollout `rollout`'s rows (dicts of the columns but routes; `routes`: one uint8 array or None per row)
    into `folder`, whole or not at all; returns the file's path."""
    from gptoss_cli.outputs import TMP, naming, recover, temp_path

    pa = _pyarrow()
    import pyarrow.parquet as pq

    width = None
    if meta.get("routes"):
        width = len(meta["routes"]["moe_layers"]) * meta["routes"]["top_k"]
    sch = schema(pa, width)
    columns = {f.name: [r[f.name] for r in rows] for f in sch if f.name != "routes"}
    arrays = [pa.array(columns[f.name], type=f.type) for f in sch if f.name != "routes"]
    arrays.append(routes_array(pa, routes, width or 1))
    table = pa.Table.from_arrays(arrays, schema=sch.with_metadata({META_KEY: json.dumps(
        {"format": FORMAT, "version": VERSION, "rollout": rollout, **meta}).encode()}))
    path = Path(folder) / file_name(rollout)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        recover(path)  # a temporary name left by a killed writer of this rollout
        tmp = temp_path(path, TMP)
        with naming(path):
            try:
                pq.write_table(table, str(tmp))
                with open(tmp, "rb") as fh:
                    os.fsync(fh.fileno())
                os.replace(tmp, path)
            finally:
                tmp.unlink(missing_ok=True)
    except OSError as exc:
        raise file_system_error(exc, f"cannot write the rollout file {path}") from None
    return path


def rollout_files(run_dir: str | Path) -> list[Path]:
    """The rollout files of a run folder, by rollout (temporary names left out); [] without a rollouts folder."""
    folder = Path(run_dir) / ROLLOUTS_DIR
    try:
        names = [p for p in folder.iterdir() if _NAME.match(p.name)]
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise file_system_error(exc) from None
    return sorted(names, key=lambda p: int(_NAME.match(p.name)[1]))


# --- reading ---------------------------------------------------------------------------------------------
def file_meta(pf: Any, path: Path) -> dict[str, Any]:
    """A rollout file's `gptoss.rollouts` record, checked."""
    raw = (pf.schema_arrow.metadata or {}).get(META_KEY)
    try:
        meta = json.loads(raw) if raw is not None else None
    except (ValueError, UnicodeDecodeError, RecursionError):
        meta = None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise UsageError(f"{path}: not a gptoss rollout file (no {META_KEY.decode()} record of format {FORMAT})",
                         hint=HINT)
    if meta.get("version") != VERSION:
        raise UsageError(f"{path}: rollout file version {_short(meta.get('version'))}; this gptoss reads version "
                         f"{VERSION}", hint="read it with the gptoss that wrote it")
    return meta


def open_rollout_file(path: Path) -> tuple[Any, dict[str, Any]]:
    """(pyarrow ParquetFile, its `gptoss.rollouts` record) of a rollout file; anything else is one line naming it."""
    pa = _pyarrow()
    try:
        pf = pa.parquet.ParquetFile(str(path))
        return pf, file_meta(pf, path)
    except (pa.ArrowException, OSError, ValueError, TypeError) as exc:
        raise _unreadable(pa, path, exc) from None


def read_rows(path: Path, columns: Iterable[str]) -> Iterator[dict[str, Any]]:
    """The rows of a rollout file (the given columns), `BATCH_ROWS` decoded at a time; a file that is not a rollout
    file, or a column of another type, or per-token lists of another length than the completion, is an error
    naming the file (and row)."""
    pa = _pyarrow()
    columns = list(columns)
    pf, _ = open_rollout_file(path)
    want = {f.name: f.type for f in schema(pa, None)}
    have = {f.name: f.type for f in pf.schema_arrow}
    for name in [*columns, *(n for n in have if n in want and n not in columns)]:  # every known column's type
        if name not in have:
            raise UsageError(f"{path}: no column {name!r}", hint=HINT)
        if name != "routes" and have[name] != want[name]:
            raise UsageError(f"{path}: column {name!r} is {have[name]}, not {want[name]}", hint=HINT)
    index = 0
    try:
        for batch in pf.iter_batches(batch_size=BATCH_ROWS, columns=columns):
            for row in batch.to_pylist():
                _check_row(path, index, row)
                yield row
                index += 1
    except (pa.ArrowException, OSError, ValueError, TypeError) as exc:
        raise _unreadable(pa, path, exc) from None


def _unreadable(pa: Any, path: Path, exc: BaseException) -> Exception:
    if isinstance(exc, UsageError):
        return exc
    if isinstance(exc, OSError) and not isinstance(exc, pa.ArrowException) and exc.errno is not None:
        return file_system_error(exc)
    return UsageError(f"{path}: not a readable rollout file ({_first(exc)})", hint=HINT)


PER_TOKEN = ("engine_logprobs", "trainer_logprobs", "is_weights")


def _check_row(path: Path, index: int, row: dict[str, Any]) -> None:
    ids = row.get("completion_ids")
    if "completion_ids" in row and ids is None:
        raise UsageError(f"{path}: row {index}: completion_ids is null", hint=HINT)
    for name in PER_TOKEN:
        values = row.get(name)
        if values is not None and ids is not None and len(values) != len(ids):
            raise UsageError(f"{path}: row {index}: {name} has {len(values)} values for {len(ids)} completion tokens",
                             hint=HINT)


# --- the summary ---------------------------------------------------------------------------------------
SUMMARY_COLUMNS = ("step", "prompt_text", "completion_ids", "final_text", "completion_text", "finish", "reward",
                   *PER_TOKEN)  # the per-token columns are read to be checked
MASKING = ("mis", "icepop", "seq_mis")  # the corrections whose weight 0 means masked (rl/importance.py)


def summarise_rollouts(run_dir: str | Path) -> dict[str, Any] | None:
    """What `gptoss report` shows of a run's rollout files (the module docstring); None without any."""
    files = rollout_files(run_dir)
    if not files:
        return None
    rewards: list[float] = []
    lengths: list[int] = []
    failed = truncated = masked_tokens = tokens = masked_rows = masking_rows = 0
    examples: dict[str, dict[str, Any]] = {}
    steps: list[int] = []
    for n, path in enumerate(files):
        correction = open_rollout_file(path)[1].get("is_correction")
        mode = correction.get("mode") if isinstance(correction, dict) else None
        best = worst = None
        for row in read_rows(path, SUMMARY_COLUMNS):
            if isinstance(row["step"], int):
                steps.append(row["step"])
            r = row["reward"]
            if r is None or not math.isfinite(r):
                failed += 1
            else:
                rewards.append(r)
                best = row if best is None or r > best["reward"] else best
                worst = row if worst is None or r < worst["reward"] else worst
            lengths.append(len(row["completion_ids"]))
            truncated += row["finish"] == "length"
            weights = row["is_weights"]
            if mode in MASKING and weights is not None:
                zero = sum(1 for w in weights if w == 0)
                masked_tokens, tokens, masking_rows = masked_tokens + zero, tokens + len(weights), masking_rows + 1
                masked_rows += int(bool(weights) and zero == len(weights))
            if n == 0 and "first" not in examples:
                examples["first"] = row
        if n == len(files) - 1:
            examples.update({k: v for k, v in (("best of the last", best), ("worst of the last", worst)) if v})
    count = len(lengths)
    return {"folder": str(Path(run_dir) / ROLLOUTS_DIR), "files": len(files), "completions": count,
            "steps": [min(steps), max(steps)] if steps else None, "reward": _distribution(rewards, failed),
            "completion_length": {"mean": sum(lengths) / count if count else None, "min": min(lengths, default=None),
                                  "max": max(lengths, default=None), "truncated": truncated / count if count else None},
            "masked_tokens": masked_tokens / tokens if tokens else None,
            "masked_completions": masked_rows / masking_rows if masking_rows else None,
            "examples": [_example(label, row) for label, row in examples.items()]}


def _distribution(values: list[float], failed: int) -> dict[str, Any]:
    out: dict[str, Any] = {"failed": failed}
    if not values:
        return out
    s = sorted(values)
    mean = sum(s) / len(s)
    try:
        var = sum((v - mean) ** 2 for v in s) / (len(s) - 1) if len(s) > 1 else 0.0
    except OverflowError:  # rewards near the float range's edge
        var = math.inf

    def q(p: float) -> float:  # linear interpolation between the closest ranks
        x = p * (len(s) - 1)
        lo = int(x)
        return s[lo] + (s[min(lo + 1, len(s) - 1)] - s[lo]) * (x - lo)

    out.update(mean=mean, std=math.sqrt(var), min=s[0], p25=q(0.25), median=q(0.5), p75=q(0.75), max=s[-1])
    return out


def _example(label: str, row: dict[str, Any]) -> dict[str, Any]:
    def cut(text: Any, tail: bool = False) -> str:
        text = text if isinstance(text, str) else ""
        if len(text) <= EXAMPLE_CHARS:
            return text
        return "..." + text[-EXAMPLE_CHARS:] if tail else text[:EXAMPLE_CHARS] + "..."

    return {"which": label, "step": row["step"], "reward": row["reward"], "prompt": cut(row["prompt_text"], tail=True),
            "final": cut(row["final_text"]), "completion": cut(row["completion_text"]),
            "tokens": len(row["completion_ids"])}


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _first(exc: BaseException) -> str:
    return (str(exc) or type(exc).__name__).splitlines()[0][:200]


__all__ = ["ROLLOUTS_DIR", "FORMAT", "VERSION", "META_KEY", "file_name", "schema", "write_rollout_file",
           "rollout_files", "open_rollout_file", "read_rows", "summarise_rollouts"]
