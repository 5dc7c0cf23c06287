"""`gptoss convert`: stream a GPT-OSS checkpoint HF (or OpenAI original) <-> Hybrid, one tensor group at a time.

Memory is bounded by a few chunks (for experts: a chunk of experts of one stack), never by the
model: worker threads read and transform chunks in parallel, and each is appended to the output
shard in order, then dropped. The output
is written under a temporary folder name next to DST and renamed only when complete.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Callable, Protocol

import torch

from gptoss_cli import __version__, outputs
from gptoss_cli.checkpoint import mxfp4
from gptoss_cli.checkpoint.finite import all_finite
from gptoss_cli.checkpoint.hybrid_format import FORMAT_NAME, HYBRID_CONFIG, HybridCheckpointConfig, write_hybrid_config
from gptoss_cli.checkpoint.layouts import HF_LAYOUTS, UINT8, Layout
from gptoss_cli.checkpoint.mapping import VOCAB_PADDED_HYBRID, Unit, hybrid_shapes, identity, units
from gptoss_cli.checkpoint.safetensors_io import ShardedWriter, TensorSpec
from gptoss_cli.checkpoint import megatron_format
from gptoss_cli.checkpoint.sources import (
    EXTRA_FILES, HF, HYBRID, HYBRID_NAMED, MEGATRON, TRAINING, check_tensors, open_source,
)
from gptoss_cli.errors import CheckpointError, UsageError
from gptoss_cli.model.config import GptOssArch
from gptoss_cli.model.dtypes import dtype_name, short_dtype_name, torch_dtype
from gptoss_cli.resources import keep_freed_memory, peak_rss_bytes
from gptoss_cli.json_input import parse_json

OUTPUT_DTYPES = ("bfloat16", "float32", "bf16", "fp32")
EXPERT_FORMS = ("bf16", "mxfp4")
PEFT = "peft"  # a LoRA run's adapters in PEFT's layout (checkpoint/peft_format.py)
TARGETS = (HYBRID, HF, MEGATRON, PEFT)
PROVENANCE_KEY = "gptoss_provenance"  # HF outputs: in the index's metadata (config.json stays as released)


class Progress(Protocol):
    def start(self, total_tensors: int, total_bytes: int) -> None: ...
    def advance(self, tensors: int = 0, nbytes: int = 0) -> None: ...


@dataclass
class ConvertResult:
    direction: str
    source: str
    revision: str | None
    destination: str
    source_format: str
    experts_in: str
    experts_out: str
    dtype: str
    num_tensors: int
    bytes_written: int
    num_shards: int
    seconds: float
    peak_rss_bytes: int
    write_seconds: float = 0.0  # file I/O time; close to `seconds` means the disk is the bottleneck
    # busy seconds of the reading and transforming (decode, re-layout, cast) stages, summed over
    # `workers` threads: read_bytes / read_seconds is one thread's read rate, and so on
    read_seconds: float = 0.0
    read_bytes: int = 0
    transform_seconds: float = 0.0
    workers: int = 0
    architecture: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)  # e.g. leftovers of killed runs that were removed
    provenance: dict = field(default_factory=dict)  # what the output records about its source

    @property
    def throughput_bytes_per_s(self) -> float:
        return self.bytes_written / self.seconds if self.seconds > 0 else 0.0

    def to_json(self) -> dict:
        d = asdict(self)
        d["throughput_bytes_per_s"] = self.throughput_bytes_per_s
        return d


def parse_dtype(name: str) -> torch.dtype:
    """The --dtype of non-expert tensors and dequantised experts."""
    return torch_dtype(name, "--dtype", allowed=OUTPUT_DTYPES)


# --- planning ----------------------------------------------------------------------------
@dataclass
class _Job:
    """A bound table unit plus the output tensors it writes, in write order."""

    unit: Unit
    outputs: list[TensorSpec]


def _expert_chunk(arch: GptOssArch, unit: Unit, dtype: torch.dtype, budget: int) -> int:
    """How many experts fit in one chunk of `budget` bytes of transformed output."""
    per_expert = max(1, _canonical_numel_per_expert(arch, unit.hf[0]) * torch.empty((), dtype=dtype).element_size())
    return max(1, min(arch.num_local_experts, budget // per_expert))


def _canonical_numel_per_expert(arch: GptOssArch, name: str) -> int:
    H, I = arch.hidden_size, arch.intermediate_size
    if name.endswith("gate_up"):
        return 2 * I * H
    if name.endswith("down"):
        return H * I
    if name.endswith("gate_up_proj_bias"):
        return 2 * I
    return H


def plan_to_hybrid(arch: GptOssArch, dtype: torch.dtype) -> list[_Job]:
    shapes = hybrid_shapes(arch)
    return [_Job(u, [TensorSpec(n, shapes[n], dtype) for n in u.hybrid]) for u in units(arch)]


def plan_to_hf(arch: GptOssArch, layout: Layout, dtype: torch.dtype) -> list[_Job]:
    specs = layout.stored_specs(arch)
    jobs = []
    for u in units(arch):
        outs = []
        for canonical in u.hf:
            for name in layout.stored_names(canonical):
                shape, kind = specs[name]
                outs.append(TensorSpec(name, shape, torch.uint8 if kind == UINT8 else dtype))
        jobs.append(_Job(u, outs))
    return jobs


# --- execution ---------------------------------------------------------------------------
# A task computes some output pieces (name, tensor) on a worker thread; the pieces are written in
# task order. A task returns the pieces to write now and those held back until its job's
# `_RELEASE_HELD` marker (MXFP4 scales follow all blocks of their stack in the file).
Piece = tuple[str, torch.Tensor]
Task = Callable[[], tuple[list[Piece], list[Piece]]]
_RELEASE_HELD = object()


def _cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t.to(dtype) if t.is_floating_point() else t


def _read_hybrid(reader, arch: GptOssArch, name: str, dtype: torch.dtype) -> torch.Tensor:
    if name in VOCAB_PADDED_HYBRID:  # strip Megatron's vocabulary padding
        return _cast(reader.read(name, 0, arch.vocab_size), dtype)
    return _cast(reader.read(name), dtype)


def _row_ranges(spec: TensorSpec, budget: int):
    """Row ranges of about `budget` bytes, so that a 1 GB embedding is never held whole."""
    step = max(1, budget // max(1, spec.row_bytes))
    rows = spec.shape[0] if spec.shape else 1
    return [(r, min(rows, r + step)) for r in range(0, rows, step)]


def _streams_rows(unit: Unit, spec: TensorSpec) -> bool:
    return unit.mapping.to_hybrid is identity and len(unit.hf) == 1 and len(spec.shape) >= 1


def _experts_to_hybrid(reader, arch: GptOssArch, layout: Layout, unit: Unit, dtype: torch.dtype, e0: int, e1: int):
    names = unit.hybrid[e0:e1]
    stored = layout.read_rowwise(reader, unit.hf[0], e0, e1)
    if stored is not None:  # MXFP4: de-interleave/unstack the bytes, then decode each expert
        moved = [unit.to_hybrid(arch, [t]) for t in stored]
        return [(name, layout.load(unit.hf[0], list(parts), dtype)) for name, parts in zip(names, zip(*moved))], []
    chunk = layout.read(reader, arch, unit.hf[0], dtype, e0, e1)
    return [(name, _cast(t, dtype)) for name, t in zip(names, unit.to_hybrid(arch, [chunk]))], []


def _tasks_copy(reader, job: _Job, dtype: torch.dtype, budget: int):
    """Hybrid names in, the same names out (a training checkpoint becoming a Hybrid one), in row ranges."""
    for out in job.outputs:
        for r0, r1 in _row_ranges(out, budget):
            yield lambda out=out, r0=r0, r1=r1: ([(out.name, _cast(reader.read(out.name, r0, r1), dtype))], [])


def _unit_to_hybrid(reader, arch: GptOssArch, layout: Layout, unit: Unit, dtype: torch.dtype):
    ins = [layout.read(reader, arch, n, dtype) for n in unit.hf]
    return [(name, _cast(t, dtype)) for name, t in zip(unit.hybrid, unit.to_hybrid(arch, ins))], []


def _tasks_to_hybrid(reader, arch: GptOssArch, layout: Layout, job: _Job, dtype: torch.dtype, budget: int):
    unit, out = job.unit, job.outputs[0]
    if _streams_rows(unit, out):
        for r0, r1 in _row_ranges(out, budget):
            yield lambda r0=r0, r1=r1: ([(out.name, layout.read(reader, arch, unit.hf[0], dtype, r0, r1))], [])
        return
    if unit.per_expert:
        n = _expert_chunk(arch, unit, dtype, budget)
        for e0 in range(0, arch.num_local_experts, n):
            yield partial(_experts_to_hybrid, reader, arch, layout, unit, dtype, e0, min(arch.num_local_experts, e0 + n))
        return
    yield partial(_unit_to_hybrid, reader, arch, layout, unit, dtype)


def _experts_to_hf(reader, arch: GptOssArch, layout: Layout, unit: Unit, dtype: torch.dtype, e0: int, e1: int):
    per_expert = [_read_hybrid(reader, arch, name, dtype) for name in unit.hybrid[e0:e1]]
    (chunk,) = unit.to_hf(arch, per_expert)
    try:
        stored = layout.store(unit.hf[0], chunk)
    except mxfp4.NonFiniteError as exc:
        raise CheckpointError(
            f"{unit.hybrid[e0 + exc.index[0]]}: holds {exc.value}; MXFP4 has no encoding for NaN or Inf"
        ) from None
    pieces = [(name, _cast(t, dtype)) for name, t in stored]
    return pieces[:1], pieces[1:]  # MXFP4 scales are held: they follow all blocks (1/16 of their size)


def _unit_to_hf(reader, arch: GptOssArch, layout: Layout, unit: Unit, dtype: torch.dtype):
    ins = [_read_hybrid(reader, arch, n, dtype) for n in unit.hybrid]
    out = []
    for canonical, t in zip(unit.hf, unit.to_hf(arch, ins)):
        out.extend((name, _cast(piece, dtype)) for name, piece in layout.store(canonical, t))
    return out, []


def _tasks_to_hf(reader, arch: GptOssArch, job: _Job, dtype: torch.dtype, layout: Layout, budget: int):
    unit, out = job.unit, job.outputs[0]
    if _streams_rows(unit, out) and len(job.outputs) == 1:
        for r0, r1 in _row_ranges(out, budget):
            yield lambda r0=r0, r1=r1: ([(out.name, _cast(reader.read(unit.hybrid[0], r0, r1), dtype))], [])
        return
    if unit.per_expert:
        n = _expert_chunk(arch, unit, dtype, budget)
        for e0 in range(0, arch.num_local_experts, n):
            yield partial(_experts_to_hf, reader, arch, layout, unit, dtype, e0, min(arch.num_local_experts, e0 + n))
        yield _RELEASE_HELD
        return
    yield partial(_unit_to_hf, reader, arch, layout, unit, dtype)


class _StageClock:
    """Reads through to a checkpoint reader, and sums the busy seconds of the read and the
    transform (decode, re-layout, cast) stages over the worker threads."""

    def __init__(self, reader):
        self._reader = reader
        self._lock = threading.Lock()
        self._local = threading.local()
        self.read_seconds = self.transform_seconds = 0.0
        self.read_bytes = 0

    def read(self, name: str, start: int | None = None, stop: int | None = None) -> torch.Tensor:
        t0 = time.perf_counter()
        t = self._reader.read(name, start, stop)
        dt = time.perf_counter() - t0
        self._local.read_seconds = getattr(self._local, "read_seconds", 0.0) + dt
        with self._lock:
            self.read_seconds += dt
            self.read_bytes += t.numel() * t.element_size()
        return t

    def run(self, task: Task):
        self._local.read_seconds = 0.0
        t0 = time.perf_counter()
        out = task()
        dt = time.perf_counter() - t0 - self._local.read_seconds
        with self._lock:
            self.transform_seconds += dt
        return out


def _worker_count() -> int:
    """Threads that read and transform: one per core, at most eight.

    The shard writer needs little CPU (with O_DIRECT it mostly waits for the disk), so it does
    not get a core of its own: on 2 cores, 2 workers converted 1.25x faster than 1. Eight
    already outrun any disk (each decodes MXFP4 at gigabytes per second), and each holds a task's
    output, so more would only add memory.
    """
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, min(8, cores))


class _Pipeline:
    """Runs tasks on worker threads and hands their pieces to `write` in task order.

    At most `depth` tasks are queued, running or finished but not yet written, which bounds
    memory by a few tasks' output (plus the writer's own queue). torch's gather, copy and file
    reads release the GIL, so the workers and the writer thread run in parallel.

    Jobs start in order: the tasks of one job (the expert chunks of a stack) run in parallel, and
    the next job's tasks start once they have all finished, so an error or an interrupt stops the
    conversion at the job where it happened, with nothing computed past it.
    """

    def __init__(self, write: Callable[[str, torch.Tensor], None], workers: int, clock: _StageClock):
        self._write = write
        self._clock = clock
        self.workers = workers
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="gptoss-convert")
        self._depth = 2 * workers + 1
        self._pending: deque = deque()  # (future or _RELEASE_HELD, callback once written)
        self._held: dict[str, list[torch.Tensor]] = {}

    def next_job(self) -> None:
        """Wait until every submitted task has finished (the writer keeps writing meanwhile);
        raise the first error among them, in task order."""
        futures = [item for item, _ in self._pending if item is not _RELEASE_HELD]
        wait(futures)
        for f in futures:
            f.result()

    def submit(self, task, done: Callable[[], None] | None = None) -> None:
        item = task if task is _RELEASE_HELD else self._pool.submit(self._clock.run, task)
        self._pending.append((item, done))
        while len(self._pending) > self._depth:
            self._retire()

    def _retire(self) -> None:
        item, done = self._pending.popleft()
        if item is _RELEASE_HELD:
            for name, chunks in self._held.items():
                for t in chunks:
                    self._write(name, t)
            self._held.clear()
        else:
            now, held = item.result()
            for name, t in now:
                self._write(name, t)
            for name, t in held:
                self._held.setdefault(name, []).append(t)
        if done is not None:
            done()

    def finish(self) -> None:
        while self._pending:
            self._retire()
        self._pool.shutdown()

    def abort(self) -> None:
        self._pending.clear()
        self._pool.shutdown(wait=True, cancel_futures=True)


# --- the command -------------------------------------------------------------------------
def _is_gptoss_hybrid(config: Path) -> bool:
    try:
        return parse_json(config.read_text()).get("format") == FORMAT_NAME
    except (OSError, ValueError, AttributeError):
        return False


def _is_gpt_oss_hf(config: Path) -> bool:
    try:
        return parse_json(config.read_text()).get("model_type") == "gpt_oss"
    except (OSError, ValueError, AttributeError):
        return False


def check_replaceable_output(dst: Path, kind: str) -> None:
    """--force may replace DST only if it is empty or a previous gptoss output of this kind."""
    if kind == MEGATRON:
        megatron_format.check_replaceable(dst)
    elif kind == HYBRID:
        outputs.check_replaceable(dst, HYBRID_CONFIG, _is_gptoss_hybrid, "Hybrid", EXTRA_FILES)
    else:
        outputs.check_replaceable(dst, "config.json", _is_gpt_oss_hf, "Hugging Face", EXTRA_FILES)


def _is_peft_adapter(config: Path) -> bool:
    try:
        return parse_json(config.read_text()).get("peft_type") == "LORA"
    except (OSError, ValueError, AttributeError):
        return False


class _NonFiniteCheck:
    """Refuse NaN/inf weights, naming the tensor: every forward through one would be NaN.

    Wraps the source reader. Float tensors are checked as read (one min/max pass per chunk). MXFP4
    tensors are checked through their scales: byte 255 is NaN (OCP E8M0), and only bytes >= 253
    (2**126 and up) can push a decoded value past the bf16/fp32 range; then, and only then, the
    decoded outputs are checked too. Transforms of finite values are finite otherwise, so the
    common case costs one cheap pass over the float tensors and none over decoded experts.
    """

    def __init__(self, reader):
        self._reader = reader
        self.check_outputs = False

    def __getattr__(self, name):
        return getattr(self._reader, name)

    def read(self, name: str, start: int | None = None, stop: int | None = None) -> torch.Tensor:
        t = self._reader.read(name, start, stop)
        if t.is_floating_point():
            _check_finite(t, name, f"{self._reader.file_of(name)}: tensor", start or 0)
        elif t.dtype == torch.uint8 and name.endswith("scales") and t.numel():
            top = int(t.max())
            if top == 255:
                raise CheckpointError(
                    f"{self._reader.file_of(name)}: tensor {name!r} holds the MXFP4 scale byte 255, which is NaN "
                    "(OCP E8M0)", hint="the checkpoint is corrupt; convert a finite one",
                )
            self.check_outputs |= top >= 253
        return t

    def wrap_write(self, write, where: Path):
        offsets: dict[str, int] = {}

        def checked(name: str, chunk: torch.Tensor) -> None:
            if self.check_outputs:
                _check_finite(chunk, name, f"{where}: output tensor", offsets.get(name, 0))
                offsets[name] = offsets.get(name, 0) + (chunk.shape[0] if chunk.dim() else 1)
            write(name, chunk)

        return checked


def _check_finite(t: torch.Tensor, name: str, what: str, row0: int) -> None:
    if all_finite(t):
        return
    bad = ~torch.isfinite(t)
    index = [int(i) for i in bad.nonzero()[0]]
    value = t[tuple(index)].item()
    if index:  # chunks are row ranges: report the index in the whole tensor
        index[0] += row0
    raise CheckpointError(
        f"{what} {name!r} holds non-finite values (first: {value} at {index}; {int(bad.sum())} in the rows read)",
        hint="the checkpoint is corrupt or diverged; convert a finite one",
    )


def convert(
    src: str,
    dst: str | Path,
    *,
    experts: str | None = None,
    dtype: str = "bfloat16",
    revision: str | None = None,
    force: bool = False,
    to: str | None = None,
    weights: str | None = None,
    progress: Progress | None = None,
    max_shard_bytes: int = 5 * 1024**3,
    chunk_bytes: int = 32 * 1024**2,
    vocab_multiple: int | None = None,
) -> ConvertResult:
    """Convert SRC (HF folder or repo id, OpenAI original/, Hybrid folder, or a training checkpoint) at DST.

    `to` is the output layout (hybrid, hf or megatron); by default the other one than SRC's, and hybrid
    for a training or Megatron checkpoint. `weights` (training checkpoints only): `model` or `master`,
    see the CLI's help. `vocab_multiple` (megatron output only): the embedding and output rows are
    padded to a multiple of it (Megatron's make-vocab-size-divisible-by, default 128)."""
    t0 = time.perf_counter()
    keep_freed_memory()
    torch_dtype = parse_dtype(dtype)
    dst = Path(dst).expanduser()
    if experts is not None and experts not in EXPERT_FORMS:
        raise UsageError(f"--experts {experts!r} is not supported; use bf16 or mxfp4")
    if to is not None and to not in TARGETS:
        raise UsageError(f"--to {to!r} is not supported; use {' or '.join(TARGETS)}")
    if vocab_multiple is not None and to != MEGATRON:
        raise UsageError("--vocab-multiple applies to --to megatron only")
    if vocab_multiple is not None and (isinstance(vocab_multiple, bool) or not isinstance(vocab_multiple, int)
                                       or not 1 <= vocab_multiple <= 1 << 16):
        # Megatron pads to make-vocab-size-divisible-by x TP (128 x 512 at most); each padding row is written
        raise UsageError(f"--vocab-multiple {vocab_multiple!r} must be an integer from 1 to {1 << 16}")
    if isinstance(max_shard_bytes, bool) or not isinstance(max_shard_bytes, int) or max_shard_bytes < 1:
        raise UsageError(f"max shard size {max_shard_bytes!r} must be a positive number of bytes")
    # First, what killed runs left for DST: a stranded old DST goes back in place before DST is judged.
    notes = outputs.recover(dst)
    outputs.check_destination(dst, force)
    if to == PEFT:
        return _convert_to_peft(src, dst, experts=experts, weights=weights, force=force, progress=progress,
                                notes=notes, t0=t0)

    source = open_source(str(src), revision, weights=weights)
    try:
        for folder in {source.folder, source.extras_folder, *source.protected}:
            outputs.check_separate(folder, dst)
        arch = source.arch
        target = to or (HF if source.kind == HYBRID else HYBRID)
        to_hf, to_megatron = target == HF, target == MEGATRON
        if not to_megatron and source.kind not in (TRAINING, MEGATRON) and to_hf != (source.kind in HYBRID_NAMED):
            raise UsageError(f"{src}: is already a{'n HF' if to_hf else ' Hybrid'} checkpoint ({source.kind}); "
                             f"convert writes the other layout", hint="drop --to, or choose the other value")
        if force:
            check_replaceable_output(dst, target)
        # asked of the reader itself, before it is wrapped: a DcpReader serves one stream of reads
        concurrent_reads = getattr(source.reader, "concurrent_reads", True)
        source.reader = finite = _NonFiniteCheck(source.reader)
        if source.kind in HYBRID_NAMED:
            check_tensors(
                source, {n: (s, "float") for n, s in hybrid_shapes(arch).items()}, padded_rows=VOCAB_PADDED_HYBRID
            )
        if to_hf:
            out_form = experts or "bf16"
            if out_form == "mxfp4" and (arch.hidden_size % 32 or arch.intermediate_size % 32):
                raise UsageError(
                    f"--experts mxfp4 needs hidden_size and intermediate_size divisible by 32 "
                    f"(got {arch.hidden_size}, {arch.intermediate_size})"
                )
            out_layout = HF_LAYOUTS[out_form]
            jobs = plan_to_hf(arch, out_layout, torch_dtype)
            experts_in = "bf16"
        else:
            if experts is not None:
                raise UsageError(
                    "--experts applies to HF output only; Hybrid and Megatron checkpoints store bf16/fp32 experts"
                )
            if source.layout is not None:
                check_tensors(source, source.layout.stored_specs(arch))
            jobs = plan_to_hybrid(arch, torch_dtype)
            out_form = "bf16"
            experts_in = source.layout.experts_form if source.layout else "bf16"
        if source.kind in (TRAINING, MEGATRON):
            experts_in = short_dtype_name(source.reader.dtype(next(u.hybrid[0] for u in units(arch) if u.per_expert)))
        plan = [spec for job in jobs for spec in job.outputs]
        total = sum(s.nbytes for s in plan)
        provenance = {
            "source": str(src),
            "revision": revision,
            "source_format": source.kind,
            "experts_form": experts_in,
            "tool": f"gptoss {__version__}",
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            **source.provenance,
        }
        multiple = vocab_multiple or megatron_format.DEFAULT_VOCAB_MULTIPLE
        padded_rows = megatron_format.padded_vocab(arch.vocab_size, multiple)
        if to_megatron:  # the zero rows of the vocabulary padding
            total += 2 * (padded_rows - arch.vocab_size) * arch.hidden_size * torch.empty((), dtype=torch_dtype).element_size()
        tmp = outputs.start_folder(dst, total)
        with outputs.removed_on_error(tmp, dst):
            on_bytes = (lambda n: progress.advance(nbytes=n)) if progress else None
            if to_megatron:
                writer = megatron_format.MegatronWriter(tmp / megatron_format.RELEASE, plan, arch,
                                                        padded_rows=padded_rows, max_shard_bytes=max_shard_bytes,
                                                        on_bytes=on_bytes)
            else:
                writer = ShardedWriter(tmp, plan, max_shard_bytes=max_shard_bytes, on_bytes=on_bytes)
            if progress:
                progress.start(len(plan), total)
            clock = _StageClock(source.reader)
            threads = torch.get_num_threads()
            # one torch thread per worker: intra-op thread teams of several workers would contend
            # for the same cores, and a team waits at its barrier for its slowest thread
            torch.set_num_threads(1)
            workers = _worker_count() if concurrent_reads else 1
            pipeline = _Pipeline(finite.wrap_write(writer.write, dst), workers, clock)
            try:
                for job in jobs:
                    pipeline.next_job()
                    if to_hf:
                        tasks = list(_tasks_to_hf(clock, arch, job, torch_dtype, out_layout, chunk_bytes))
                    elif source.kind in HYBRID_NAMED:
                        tasks = list(_tasks_copy(clock, job, torch_dtype, chunk_bytes))
                    else:
                        tasks = list(_tasks_to_hybrid(clock, arch, source.layout, job, torch_dtype, chunk_bytes))
                    for i, task in enumerate(tasks):
                        last = i == len(tasks) - 1
                        done = partial(progress.advance, tensors=len(job.outputs)) if progress and last else None
                        pipeline.submit(task, done)
                pipeline.finish()
                writer.close(index_metadata={PROVENANCE_KEY: provenance} if to_hf else None)
            except BaseException:
                pipeline.abort()
                writer.abort()
                raise
            finally:
                torch.set_num_threads(threads)
            if to_megatron:
                # written as Megatron's `release` (weights without optimizer state); common.pt keeps the step
                iteration = source.provenance.get("iteration", source.provenance.get("megatron_iteration", 0))
                megatron_format.write_folder_files(
                    tmp / megatron_format.RELEASE,
                    megatron_format.megatron_args(arch, vocab_multiple=multiple, params_dtype=torch_dtype),
                    iteration, provenance)
                outputs.write_text(tmp / megatron_format.TRACKER, megatron_format.RELEASE + "\n")
            elif to_hf:
                config = arch.to_hf_config(experts_form=out_form, torch_dtype=dtype_name(torch_dtype))
                outputs.write_text(tmp / "config.json", json.dumps(config, indent=2) + "\n")
            else:
                write_hybrid_config(
                    tmp,
                    HybridCheckpointConfig(
                        arch=arch, hybrid_layer_pattern=arch.hybrid_layer_pattern, dtype=dtype_name(torch_dtype),
                        provenance=provenance
                    ),
                )
            for name in () if to_megatron else EXTRA_FILES:  # Megatron finds its tokenizer by its own options
                if (source.extras_folder / name).is_file():
                    with outputs.naming(tmp / name):
                        shutil.copyfile(source.extras_folder / name, tmp / name)
            outputs.commit(tmp, dst)
    finally:
        source.close()

    return ConvertResult(
        direction=f"{source.kind} -> {target}",
        source=str(src),
        revision=revision,
        destination=str(dst),
        source_format=source.kind,
        experts_in=experts_in,
        experts_out=out_form,
        dtype=dtype_name(torch_dtype),
        num_tensors=len(plan),
        bytes_written=writer.bytes_written,
        num_shards=len(writer.file_names),
        seconds=time.perf_counter() - t0,
        peak_rss_bytes=peak_rss_bytes(),
        write_seconds=writer.io_seconds,
        read_seconds=clock.read_seconds,
        read_bytes=clock.read_bytes,
        transform_seconds=clock.transform_seconds,
        workers=pipeline.workers,
        architecture=arch.to_dict(),
        notes=notes,
        provenance=provenance,
    )


# --to peft of a precision.qat=mxfp4 LoRA run: PEFT adds the adapters to whatever base it is given.
QAT_PEFT_NOTE = ("these adapters were trained against the base's experts rounded to MXFP4 (precision.qat=mxfp4): "
                 "apply them to a base with MXFP4 experts (as released), or merge them with --to hf, which adds "
                 "them to the rounded base")


def _convert_to_peft(src, dst: Path, *, experts: str | None, weights: str | None, force: bool,
                     progress: Progress | None, notes: list[str], t0: float) -> ConvertResult:
    """A LoRA training checkpoint's adapters -> a PEFT adapter folder (adapter_config.json,
    adapter_model.safetensors) for transformers' GptOssForCausalLM of the base."""
    from safetensors.torch import save_file

    from gptoss_cli.checkpoint.peft_format import (
        ADAPTER_CONFIG, ADAPTER_WEIGHTS, adapter_config, adapter_config_text, peft_tensors,
    )
    from gptoss_cli.checkpoint.training_format import check_base

    if experts is not None:
        raise UsageError("--experts applies to --to hf only; a PEFT adapter holds no expert weights")
    source = open_source(str(src), weights=weights, adapters_only=True)
    try:
        if source.kind != TRAINING or source.lora is None:
            what = "a full fine-tune (no LoRA adapters)" if source.kind == TRAINING else f"a {source.kind} checkpoint"
            raise UsageError(f"{src}: --to peft exports the LoRA adapters of a training checkpoint, but this is {what}",
                             hint="use --to hf or --to hybrid for full weights")
        for folder in {source.folder, *source.protected}:
            outputs.check_separate(folder, dst)
        if force:
            outputs.check_replaceable(dst, ADAPTER_CONFIG, _is_peft_adapter, "PEFT adapter", (ADAPTER_WEIGHTS,))
        lora, arch = source.lora, source.arch
        if source.hybrid_layer_pattern != arch.hybrid_layer_pattern:
            raise UsageError(f"{src}: trained with the layer pattern {source.hybrid_layer_pattern!r}; a PEFT adapter "
                             f"for transformers needs {arch.hybrid_layer_pattern!r} (one '*E' per HF block)")
        check_base(lora["base"], source.folder)  # the adapters belong to this base, byte for byte
        if source.provenance.get("qat") == "mxfp4":
            notes.append(QAT_PEFT_NOTE)
        names = source.reader.names()
        if progress:
            progress.start(len(names), sum(source.reader.spec(n).nbytes for n in names))
        adapters = {}
        for n in names:
            adapters[n] = source.reader.read(n).clone()
            if progress:
                progress.advance(tensors=1, nbytes=source.reader.spec(n).nbytes)
        tensors = peft_tensors(arch, adapters, tuple(lora["target_modules"]))
        config = adapter_config(rank=int(lora["rank"]), alpha=float(lora["alpha"]), dropout=float(lora.get("dropout", 0.0)),
                                target_modules=tuple(lora["target_modules"]), base_model=lora["base"]["path"])
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        provenance = {"source": str(src), "source_format": TRAINING, "tool": f"gptoss {__version__}",
                      "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **source.provenance}
        tmp = outputs.start_folder(dst, total)
        with outputs.removed_on_error(tmp, dst):
            with outputs.naming(tmp / ADAPTER_WEIGHTS):
                save_file(tensors, str(tmp / ADAPTER_WEIGHTS),
                          metadata={"format": "pt", PROVENANCE_KEY: json.dumps(provenance, default=str)})
            outputs.write_text(tmp / ADAPTER_CONFIG, adapter_config_text(config))
            outputs.commit(tmp, dst)
        dtype = short_dtype_name(next(iter(tensors.values())).dtype) if tensors else "-"
    finally:
        source.close()
    return ConvertResult(
        direction=f"{TRAINING} -> {PEFT}", source=str(src), revision=None, destination=str(dst),
        source_format=TRAINING, experts_in="-", experts_out="-", dtype=dtype, num_tensors=len(tensors),
        bytes_written=total, num_shards=1, seconds=time.perf_counter() - t0, peak_rss_bytes=peak_rss_bytes(),
        architecture=arch.to_dict(), notes=notes, provenance=provenance,
    )


__all__ = ["convert", "ConvertResult", "Progress", "plan_to_hf", "plan_to_hybrid", "parse_dtype"]
