"""`gptoss convert`'s library side: `convert()` (the one entry point), its options, its result and progress.

It opens SRC (checkpoint/sources.py), asks the registry for the output format (`--to`, or SRC's
default) and that format's plan (a `ConvertPlan`, formats/plan.py, built by the format's row),
and runs the plan: worker threads read and transform chunks in parallel (storage/pipeline.py), each
is checked for NaN/inf and appended to the output in order, then dropped, so memory is bounded by a
few chunks (for experts: a chunk of experts of one stack), never by the model. The output is
written under a temporary folder name next to DST and renamed only when complete.
"""

from __future__ import annotations

import shutil
import time
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Protocol

import torch

from gptoss_cli import __version__, outputs
from gptoss_cli.checkpoint import formats
from gptoss_cli.checkpoint.export_cost import measure_model
from gptoss_cli.checkpoint.formats.plan import PROVENANCE_KEY, ConvertPlan
from gptoss_cli.checkpoint.formats.registry import Format, Source, check_tensors
from gptoss_cli.checkpoint.mapping import VOCAB_PADDED_HYBRID, hybrid_shapes
from gptoss_cli.checkpoint.sources import open_source
from gptoss_cli.checkpoint.storage.finite import NonFiniteCheck
from gptoss_cli.checkpoint.storage.pipeline import Pipeline, StageClock, torch_threads, worker_count
from gptoss_cli.checkpoint.storage.torch_bytes import signals_deferred
from gptoss_cli.errors import UsageError
from gptoss_cli.model.config import GptOssArch
from gptoss_cli.model.dtypes import torch_dtype
from gptoss_cli.resources import peak_rss_bytes

OUTPUT_DTYPES = ("bfloat16", "float32", "bf16", "fp32")
EXPERT_FORMS = ("bf16", "mxfp4")
# convert's options that only some outputs take (`Format.writer_options`), and what to say when misused
WRITER_OPTIONS = {"experts": "--experts applies to HF and GGUF outputs only; Hybrid, Megatron and PEFT outputs "
                             "hold bf16/fp32 experts or none",
                  "vocab_multiple": "--vocab-multiple applies to --to megatron only"}


class ConvertProgress(Protocol):
    """What convert() reports its progress to (the CLI's bar; the demo's)."""

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
    export_cost: dict | None = None  # --experts mxfp4 of experts not trained in MXFP4: checkpoint/export_cost.py

    @property
    def throughput_bytes_per_s(self) -> float:
        return self.bytes_written / self.seconds if self.seconds > 0 else 0.0

    def to_json(self) -> dict:
        d = asdict(self)
        d["throughput_bytes_per_s"] = self.throughput_bytes_per_s
        return d


def _made_by() -> dict[str, str]:
    """What every output's provenance says of the tool and the time that wrote it."""
    return {"tool": f"gptoss {__version__}", "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def parse_dtype(name: str) -> torch.dtype:
    """The --dtype of non-expert tensors and dequantised experts."""
    return torch_dtype(name, "--dtype", allowed=OUTPUT_DTYPES)


def target_for(source: Source, to: str | None, src: str) -> Format:
    """The output format: `to`, or by default the source's (`Format.default_target`: the other layout
    than SRC's, hybrid for a training or Megatron checkpoint); refuses rewriting SRC's own layout."""
    target = formats.writer(to or source.format.default_target)
    if target.name == source.format.same_layout:
        raise UsageError(f"{src}: is already {target.title} checkpoint ({source.kind}); "
                         f"convert writes the other layout", hint="drop --to, or choose the other value")
    return target


def make_plan(source: Source, target: Format, *, experts: str | None, dtype: torch.dtype,
              vocab_multiple: int | None = None) -> ConvertPlan:
    """The plan converting `source` to `target` (from `target_for`), after checking that the source's
    tensors are what its record says."""
    if source.format.hybrid_named and not target.reads_adapters:
        check_tensors(source, {n: (s, "float") for n, s in hybrid_shapes(source.arch).items()},
                      padded_rows=VOCAB_PADDED_HYBRID)
    return target.plan(source, experts=experts, dtype=dtype, vocab_multiple=vocab_multiple)



# --- the command -------------------------------------------------------------------------
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
    progress: ConvertProgress | None = None,
    max_shard_bytes: int = 5 * 1024**3,
    chunk_bytes: int = 32 * 1024**2,
    vocab_multiple: int | None = None,
    arch_from: str | None = None,
) -> ConvertResult:
    """Convert SRC (HF folder or repo id, OpenAI original/, Hybrid folder, a training or Megatron checkpoint) at DST.

    `to` is the output format (hybrid, hf, megatron or peft); by default the other layout than SRC's,
    and hybrid for a training or Megatron checkpoint. `weights` (training checkpoints only): `model` or
    `master`, see the CLI's help. `vocab_multiple` (megatron output only): the embedding and output rows
    are padded to a multiple of it (Megatron's make-vocab-size-divisible-by, default 128). `arch_from`
    (Megatron sources only): an HF config.json (or its folder) or a preset name giving the architecture
    that the checkpoint's args cannot say."""
    t0 = time.perf_counter()
    dst = Path(dst).expanduser()
    asked = _check_options(to, experts, vocab_multiple, max_shard_bytes, dst)
    to = asked.name if asked is not None else None  # DST.gguf names its format
    out_dtype = dtype if asked is not None and asked.dtypes else parse_dtype(dtype)
    if asked is not None and asked.dtypes and dtype not in asked.dtypes + OUTPUT_DTYPES + ("float16", "fp16"):
        raise UsageError(f"--dtype {dtype!r} is not one of {', '.join(asked.dtypes)} for {asked.title} output")
    # First, what killed runs left for DST: a stranded old DST goes back in place before DST is judged.
    notes = outputs.recover(dst)
    if asked is not None and asked.file_suffix:
        outputs.check_file_destination(dst, force)
    else:
        outputs.check_destination(dst, force)
    source = open_source(str(src), revision, weights=weights, adapters_only=bool(asked and asked.reads_adapters),
                         arch_from=read_arch_from(arch_from))
    try:
        for folder in {source.folder, source.extras_folder, *source.protected}:
            outputs.check_separate(folder, dst)
        target = target_for(source, to, str(src))
        for option, value in (("experts", experts), ("vocab_multiple", vocab_multiple)):
            if value is not None and option not in target.writer_options:
                raise UsageError(WRITER_OPTIONS[option])
        if force:
            target.replaceable(dst)
        # asked of the reader itself, before it is wrapped: a DcpReader serves one stream of reads
        concurrent_reads = getattr(source.reader, "concurrent_reads", True)
        source.reader = finite = NonFiniteCheck(source.reader)
        plan = make_plan(source, target, experts=experts, dtype=out_dtype, vocab_multiple=vocab_multiple)
        provenance = {"source": str(src), "revision": revision, "source_format": source.kind,
                      "experts_form": plan.experts_in, **_made_by(), **source.provenance}
        tmp = outputs.start_folder(dst, plan.total_bytes)
        with outputs.removed_on_error(tmp, dst):
            run = _write(plan, source, finite, tmp, dst, provenance, progress=progress, max_shard_bytes=max_shard_bytes,
                         chunk_bytes=chunk_bytes, concurrent_reads=concurrent_reads)
            if target.file_suffix:  # one file: it was written inside tmp under the plan's name
                outputs.commit_file(tmp / plan.file_name, dst, tmp)
            else:
                outputs.commit(tmp, dst)
    finally:
        source.close()
    result = _result(plan, source, target, run, src=str(src), dst=dst, revision=revision, t0=t0,
                     notes=notes + plan.notes, provenance=provenance)
    meter = getattr(plan, "meter", None)
    if meter is not None and meter.err_sq > 0:  # experts rounded to MXFP4 that were not trained so: what it cost
        from gptoss_cli.checkpoint.load import model_from_checkpoint  # noqa: PLC0415

        cost = measure_model(source, meter, lambda: model_from_checkpoint(str(src), weights=weights))
        result.notes.append(cost.note())
        result.export_cost = asdict(cost)
    return result


def _check_options(to: str | None, experts: str | None, vocab_multiple: int | None, max_shard_bytes: int,
                   dst: Path) -> Format | None:
    """Options checked before anything is opened; the output format `to` names (or DST's suffix), if any."""
    if to is None:  # DST.gguf: the one format written as a file of that suffix
        to = next((f.name for f in formats.FORMATS if f.file_suffix and dst.suffix == f.file_suffix), None)
    asked = formats.writer(to) if to is not None else None
    if asked is not None and asked.file_suffix and dst.suffix != asked.file_suffix:
        raise UsageError(f"DST {dst}: {asked.title} output is one file whose name ends in {asked.file_suffix}",
                         hint=f"name it {dst.name}{asked.file_suffix}")
    forms = asked.expert_forms if asked is not None and asked.expert_forms else EXPERT_FORMS
    if experts is not None and experts not in forms:
        raise UsageError(f"--experts {experts!r} is not supported; use {' or '.join(forms)}")
    if vocab_multiple is not None and (asked is None or "vocab_multiple" not in asked.writer_options):
        raise UsageError(WRITER_OPTIONS["vocab_multiple"])
    if vocab_multiple is not None and (isinstance(vocab_multiple, bool) or not isinstance(vocab_multiple, int)
                                       or not 1 <= vocab_multiple <= 1 << 16):
        # Megatron pads to make-vocab-size-divisible-by x TP (128 x 512 at most); each padding row is written
        raise UsageError(f"--vocab-multiple {vocab_multiple!r} must be an integer from 1 to {1 << 16}")
    if isinstance(max_shard_bytes, bool) or not isinstance(max_shard_bytes, int) or max_shard_bytes < 1:
        raise UsageError(f"max shard size {max_shard_bytes!r} must be a positive number of bytes")
    return asked


def read_arch_from(arch_from: str | None) -> GptOssArch | None:
    """`--arch-from`: a preset name, or an HF config.json (or the folder holding one)."""
    if arch_from is None:
        return None
    from gptoss_cli.model.config import PRESETS  # noqa: PLC0415

    if arch_from in PRESETS:
        return PRESETS[arch_from]
    path = Path(arch_from).expanduser()
    path = path / "config.json" if path.is_dir() else path
    if not path.is_file():
        raise UsageError(f"--arch-from {arch_from!r} is neither a preset ({', '.join(sorted(PRESETS))}) nor an HF "
                         "config.json (or a folder holding one)")
    from gptoss_cli.checkpoint.formats.hf import load_json  # noqa: PLC0415
    from gptoss_cli.checkpoint.formats.hf.config import from_hf_config  # noqa: PLC0415

    return from_hf_config(load_json(path), source=str(path))


class _PlanRun:
    """What running a plan measured: its writer's bytes, files and I/O time, the stage clock, the workers."""

    def __init__(self, writer, clock: StageClock, workers: int):
        self.writer, self.clock, self.workers = writer, clock, workers


def _write(plan: ConvertPlan, source: Source, finite: NonFiniteCheck, tmp: Path, dst: Path, provenance: dict, *,
           progress: ConvertProgress | None, max_shard_bytes: int, chunk_bytes: int,
           concurrent_reads: bool) -> _PlanRun:
    """Run `plan` into the temporary folder `tmp`: its jobs, cut into tasks, through the worker pipeline
    into the plan's writer; then its folder files and the source's tokenizer files."""
    on_bytes = (lambda n: progress.advance(nbytes=n)) if progress else None
    writer = plan.open_writer(tmp, provenance=provenance, max_shard_bytes=max_shard_bytes, on_bytes=on_bytes)
    if progress:
        progress.start(len(plan.specs), plan.total_bytes)
    clock = StageClock(source.reader)
    pipeline = Pipeline(finite.wrap_write(writer.write, dst), worker_count() if concurrent_reads else 1, clock)
    empty = plan.allocator(writer)
    with torch_threads(1):  # one torch thread per worker (pipeline.torch_threads)
        try:
            # Ctrl-C / SIGTERM take effect between tasks, never inside the locks the workers share
            with signals_deferred() as signal_point:
                for job in plan.jobs:
                    pipeline.next_job()
                    tasks = list(plan.tasks(clock, job, chunk_bytes, empty))
                    for i, task in enumerate(tasks):
                        signal_point()
                        last = i == len(tasks) - 1
                        done = partial(progress.advance, tensors=len(job.outputs)) if progress and last else None
                        pipeline.submit(task, done)
                pipeline.finish()
                plan.close_writer(writer, provenance)
        except BaseException:
            pipeline.abort()
            writer.abort()
            raise
    plan.write_files(tmp, provenance)
    for name in plan.extra_files:
        if (source.extras_folder / name).is_file():
            with outputs.naming(tmp / name):
                shutil.copyfile(source.extras_folder / name, tmp / name)
    return _PlanRun(writer, clock, pipeline.workers)


def _result(plan: ConvertPlan, source: Source, target: Format, run: _PlanRun, *, src: str, dst: Path,
            revision: str | None, t0: float, notes: list[str], provenance: dict) -> ConvertResult:
    return ConvertResult(
        direction=f"{source.kind} -> {target.name}", source=src, revision=revision, destination=str(dst),
        source_format=source.kind, experts_in=plan.experts_in, experts_out=plan.experts_out,
        dtype=plan.dtype_label(), num_tensors=len(plan.specs), bytes_written=run.writer.bytes_written,
        num_shards=len(run.writer.file_names), seconds=time.perf_counter() - t0, peak_rss_bytes=peak_rss_bytes(),
        write_seconds=run.writer.io_seconds, read_seconds=run.clock.read_seconds, read_bytes=run.clock.read_bytes,
        transform_seconds=run.clock.transform_seconds, workers=run.workers, architecture=source.arch.to_dict(),
        notes=notes, provenance=provenance,
    )


__all__ = ["convert", "ConvertResult", "ConvertProgress", "PROVENANCE_KEY", "parse_dtype", "read_arch_from"]
