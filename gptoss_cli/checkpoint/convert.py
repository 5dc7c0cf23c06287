"""`gptoss convert`: stream a GPT-OSS checkpoint HF (or OpenAI original) <-> Hybrid, one tensor group at a time.

Memory is bounded by one table unit (for experts: a chunk of experts of one stack), never by the
model: each unit is read, transformed and appended to the output shard, then dropped. The output
is written under a temporary folder name next to DST and renamed only when complete.
"""

from __future__ import annotations

import json
import resource
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Protocol

import torch

from gptoss_cli import __version__, outputs
from gptoss_cli.checkpoint import mxfp4
from gptoss_cli.checkpoint.hybrid_format import FORMAT_NAME, HYBRID_CONFIG, HybridCheckpointConfig, write_hybrid_config
from gptoss_cli.checkpoint.layouts import HF_LAYOUTS, UINT8, Layout
from gptoss_cli.checkpoint.mapping import VOCAB_PADDED_HYBRID, Unit, hybrid_shapes, identity, units
from gptoss_cli.checkpoint.safetensors_io import ShardedWriter, TensorSpec
from gptoss_cli.checkpoint.sources import (
    EXTRA_FILES, HF, HYBRID, HYBRID_NAMED, TRAINING, Source, check_tensors, open_source,
)
from gptoss_cli.errors import CheckpointError, UsageError, file_system_error
from gptoss_cli.model.config import GptOssArch

DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float32": torch.float32, "fp32": torch.float32}
EXPERT_FORMS = ("bf16", "mxfp4")
TARGETS = (HYBRID, HF)
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
    try:
        return DTYPES[name]
    except KeyError:
        raise UsageError(f"--dtype {name!r} is not supported; use bfloat16 or float32") from None


def keep_freed_memory() -> None:
    """Ask glibc to keep freed chunk buffers for reuse instead of unmapping them.

    Streaming allocates and frees a buffer of the same size for every chunk; by default glibc
    returns each large buffer to the OS and the next one page-faults in afresh, which measured
    as most of the decode time. Peak memory is unchanged: it is still one chunk's worth.
    """
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 1 << 30)  # M_MMAP_THRESHOLD: serve chunk-sized buffers from the heap
        libc.mallopt(-1, 1 << 31)  # M_TRIM_THRESHOLD: do not hand freed heap back right away
    except (OSError, AttributeError):  # not glibc: nothing to tune
        pass


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# --- planning ----------------------------------------------------------------------------
@dataclass
class _Job:
    """A bound table unit plus the output tensors it writes, in write order."""

    unit: Unit
    outputs: list[TensorSpec]


def _form_of(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float32: "fp32", torch.float16: "fp16"}.get(dtype, str(dtype))


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
def _cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t.to(dtype) if t.is_floating_point() else t


def _read_hybrid(source: Source, name: str, dtype: torch.dtype) -> torch.Tensor:
    if name in VOCAB_PADDED_HYBRID:  # strip Megatron's vocabulary padding
        return _cast(source.reader.read(name, 0, source.arch.vocab_size), dtype)
    return _cast(source.reader.read(name), dtype)


def _row_ranges(spec: TensorSpec, budget: int):
    """Row ranges of about `budget` bytes, so that a 1 GB embedding is never held whole."""
    step = max(1, budget // max(1, spec.row_bytes))
    rows = spec.shape[0] if spec.shape else 1
    return [(r, min(rows, r + step)) for r in range(0, rows, step)]


def _streams_rows(unit: Unit, spec: TensorSpec) -> bool:
    return unit.mapping.to_hybrid is identity and len(unit.hf) == 1 and len(spec.shape) >= 1


def _run_to_hybrid(source: Source, job: _Job, write, dtype: torch.dtype, budget: int) -> None:
    arch, unit, layout = source.arch, job.unit, source.layout
    out = job.outputs[0]
    if _streams_rows(unit, out):
        for r0, r1 in _row_ranges(out, budget):
            write(out.name, layout.read(source.reader, arch, unit.hf[0], dtype, r0, r1))
        return
    if unit.per_expert:
        n = _expert_chunk(arch, unit, dtype, budget)
        for e0 in range(0, arch.num_local_experts, n):
            e1 = min(arch.num_local_experts, e0 + n)
            chunk = layout.read(source.reader, arch, unit.hf[0], dtype, e0, e1)
            for name, t in zip(unit.hybrid[e0:e1], unit.to_hybrid(arch, [chunk])):
                write(name, _cast(t, dtype))
            del chunk
        return
    ins = [layout.read(source.reader, arch, n, dtype) for n in unit.hf]
    for name, t in zip(unit.hybrid, unit.to_hybrid(arch, ins)):
        write(name, _cast(t, dtype))


def _run_copy(source: Source, job: _Job, write, dtype: torch.dtype, budget: int) -> None:
    """Hybrid names in, the same names out (a training checkpoint becoming a Hybrid one), in row ranges."""
    for out in job.outputs:
        for r0, r1 in _row_ranges(out, budget):
            write(out.name, _cast(source.reader.read(out.name, r0, r1), dtype))


def _run_to_hf(source: Source, job: _Job, write, dtype: torch.dtype, layout: Layout, budget: int) -> None:
    arch, unit = source.arch, job.unit
    out = job.outputs[0]
    if _streams_rows(unit, out) and len(job.outputs) == 1:
        for r0, r1 in _row_ranges(out, budget):
            write(out.name, _cast(source.reader.read(unit.hybrid[0], r0, r1), dtype))
        return
    if unit.per_expert:
        n = _expert_chunk(arch, unit, dtype, budget)
        stash: dict[str, list[torch.Tensor]] = {}
        for e0 in range(0, arch.num_local_experts, n):
            e1 = min(arch.num_local_experts, e0 + n)
            per_expert = [_read_hybrid(source, name, dtype) for name in unit.hybrid[e0:e1]]
            (chunk,) = unit.to_hf(arch, per_expert)
            try:
                pieces = layout.store(unit.hf[0], chunk)
            except mxfp4.NonFiniteError as exc:
                raise CheckpointError(
                    f"{unit.hybrid[e0 + exc.index[0]]}: holds {exc.value}; MXFP4 has no encoding for NaN or Inf"
                ) from None
            write(pieces[0][0], _cast(pieces[0][1], dtype))
            # MXFP4 scales follow their blocks in the file; they are 1/16 of the blocks' size
            for name, t in pieces[1:]:
                stash.setdefault(name, []).append(t)
        for name, chunks in stash.items():
            for t in chunks:
                write(name, _cast(t, dtype))
        return
    ins = [_read_hybrid(source, n, dtype) for n in unit.hybrid]
    for canonical, t in zip(unit.hf, unit.to_hf(arch, ins)):
        for name, piece in layout.store(canonical, t):
            write(name, _cast(piece, dtype))


# --- the command -------------------------------------------------------------------------
def _is_gptoss_hybrid(config: Path) -> bool:
    try:
        return json.loads(config.read_text()).get("format") == FORMAT_NAME
    except (OSError, ValueError, AttributeError):
        return False


def _is_gpt_oss_hf(config: Path) -> bool:
    try:
        return json.loads(config.read_text()).get("model_type") == "gpt_oss"
    except (OSError, ValueError, AttributeError):
        return False


def check_replaceable_output(dst: Path, kind: str) -> None:
    """--force may replace DST only if it is empty or a previous gptoss output of this kind."""
    if kind == HYBRID:
        outputs.check_replaceable(dst, HYBRID_CONFIG, _is_gptoss_hybrid, "Hybrid", EXTRA_FILES)
    else:
        outputs.check_replaceable(dst, "config.json", _is_gpt_oss_hf, "Hugging Face", EXTRA_FILES)


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


def _all_finite(t: torch.Tensor) -> bool:
    # min/max propagate NaN and show +-inf, in one vectorised pass without a mask tensor: about 35x
    # faster than isfinite().all(), which made the check cost more than the conversion itself.
    if not t.is_floating_point() or t.numel() == 0:
        return True
    lo, hi = torch.aminmax(_memory_order(t))
    return bool(torch.isfinite(lo) & torch.isfinite(hi))


def _memory_order(t: torch.Tensor) -> torch.Tensor:
    """A 1-D view of `t`'s elements in memory order when they fill a dense block (a transposed or
    permuted transform output); reducing a strided view directly is about 18x slower."""
    expected = 1
    for stride, size in sorted(zip(t.stride(), t.shape)):
        if size != 1 and stride != expected:
            return t
        expected *= size
    return t.as_strided((t.numel(),), (1,))


def _check_finite(t: torch.Tensor, name: str, what: str, row0: int) -> None:
    if _all_finite(t):
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
    chunk_bytes: int = 128 * 1024**2,
) -> ConvertResult:
    """Convert SRC (HF folder or repo id, OpenAI original/, Hybrid folder, or a training checkpoint) at DST.

    `to` is the output layout (hybrid or hf); by default the other one than SRC's, and hybrid for a
    training checkpoint. `weights` (training checkpoints only): `model` or `master`, see the CLI's help."""
    t0 = time.perf_counter()
    keep_freed_memory()
    torch_dtype = parse_dtype(dtype)
    dst = Path(dst).expanduser()
    if experts is not None and experts not in EXPERT_FORMS:
        raise UsageError(f"--experts {experts!r} is not supported; use bf16 or mxfp4")
    if to is not None and to not in TARGETS:
        raise UsageError(f"--to {to!r} is not supported; use {' or '.join(TARGETS)}")
    if isinstance(max_shard_bytes, bool) or not isinstance(max_shard_bytes, int) or max_shard_bytes < 1:
        raise UsageError(f"max shard size {max_shard_bytes!r} must be a positive number of bytes")
    # First, what killed runs left for DST: a stranded old DST goes back in place before DST is judged.
    notes = outputs.recover(dst)
    outputs.check_destination(dst, force)

    source = open_source(str(src), revision, weights=weights)
    try:
        for folder in {source.folder, source.extras_folder, *source.protected}:
            outputs.check_separate(folder, dst)
        arch = source.arch
        to_hf = (to == HF) if to is not None else source.kind == HYBRID
        if to_hf != (source.kind in HYBRID_NAMED) and source.kind != TRAINING:
            raise UsageError(f"{src}: is already a{'n HF' if to_hf else ' Hybrid'} checkpoint ({source.kind}); "
                             f"convert writes the other layout", hint="drop --to, or choose the other value")
        if force:
            check_replaceable_output(dst, HF if to_hf else HYBRID)
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
                    "--experts applies to HF output only; Hybrid checkpoints store one bf16/fp32 tensor per expert"
                )
            if source.kind != TRAINING:
                check_tensors(source, source.layout.stored_specs(arch))
            jobs = plan_to_hybrid(arch, torch_dtype)
            out_form = "bf16"
            experts_in = source.layout.experts_form if source.layout else "bf16"
        if source.kind == TRAINING:
            experts_in = _form_of(source.reader.dtype(next(u.hybrid[0] for u in units(arch) if u.per_expert)))
        plan = [spec for job in jobs for spec in job.outputs]
        total = sum(s.nbytes for s in plan)
        outputs.check_free_space(dst, total)
        provenance = {
            "source": str(src),
            "revision": revision,
            "source_format": source.kind,
            "experts_form": experts_in,
            "tool": f"gptoss {__version__}",
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            **source.provenance,
        }

        tmp = outputs.temp_path(dst)
        try:
            dst.parent.mkdir(parents=True, exist_ok=True)
            tmp.mkdir()
        except OSError as exc:
            raise file_system_error(exc, "cannot create the output folder") from None
        try:
            writer = ShardedWriter(
                tmp,
                plan,
                max_shard_bytes=max_shard_bytes,
                on_bytes=(lambda n: progress.advance(nbytes=n)) if progress else None,
            )
            if progress:
                progress.start(len(plan), total)
            write = finite.wrap_write(writer.write, dst)
            try:
                for job in jobs:
                    if to_hf:
                        _run_to_hf(source, job, write, torch_dtype, out_layout, chunk_bytes)
                    elif source.kind in HYBRID_NAMED:
                        _run_copy(source, job, write, torch_dtype, chunk_bytes)
                    else:
                        _run_to_hybrid(source, job, write, torch_dtype, chunk_bytes)
                    if progress:
                        progress.advance(tensors=len(job.outputs))
                writer.close(index_metadata={PROVENANCE_KEY: provenance} if to_hf else None)
            except BaseException:
                writer.abort()
                raise
            dtype_name = "bfloat16" if torch_dtype == torch.bfloat16 else "float32"
            if to_hf:
                config = arch.to_hf_config(experts_form=out_form, torch_dtype=dtype_name)
                outputs.write_text(tmp / "config.json", json.dumps(config, indent=2) + "\n")
            else:
                write_hybrid_config(
                    tmp,
                    HybridCheckpointConfig(
                        arch=arch, hybrid_layer_pattern=arch.hybrid_layer_pattern, dtype=dtype_name, provenance=provenance
                    ),
                )
            for name in EXTRA_FILES:
                if (source.extras_folder / name).is_file():
                    with outputs.naming(tmp / name):
                        shutil.copyfile(source.extras_folder / name, tmp / name)
            outputs.commit(tmp, dst)
        except OSError as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            raise file_system_error(exc, f"writing {dst} failed (nothing was changed at DST)") from None
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    finally:
        source.close()

    return ConvertResult(
        direction=f"{source.kind} -> {'hf' if to_hf else 'hybrid'}",
        source=str(src),
        revision=revision,
        destination=str(dst),
        source_format=source.kind,
        experts_in=experts_in,
        experts_out=out_form,
        dtype="bfloat16" if torch_dtype == torch.bfloat16 else "float32",
        num_tensors=len(plan),
        bytes_written=writer.bytes_written,
        num_shards=len(writer.file_names),
        seconds=time.perf_counter() - t0,
        peak_rss_bytes=peak_rss_bytes(),
        write_seconds=writer.io_seconds,
        architecture=arch.to_dict(),
        notes=notes,
        provenance=provenance,
    )


__all__ = ["convert", "ConvertResult", "Progress", "plan_to_hf", "plan_to_hybrid", "parse_dtype"]
