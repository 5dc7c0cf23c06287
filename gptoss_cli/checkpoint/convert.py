"""`gptoss convert`: stream a GPT-OSS checkpoint HF (or OpenAI original) <-> Hybrid, one tensor group at a time.

Memory is bounded by a few chunks (for experts: a chunk of experts of one stack), never by the
model: worker threads read and transform chunks in parallel (checkpoint/pipeline.py), and each is
appended to the output shard in order, then dropped. What is read, computed and written for each
direction is its plan's (checkpoint/convert_plan.py). The output is written under a temporary
folder name next to DST and renamed only when complete.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Protocol

import torch

from gptoss_cli import __version__, outputs
from gptoss_cli.checkpoint import megatron_format
from gptoss_cli.checkpoint.convert_plan import PROVENANCE_KEY, make_plan, target_for
from gptoss_cli.checkpoint.finite import NonFiniteCheck
from gptoss_cli.checkpoint.hybrid_format import FORMAT_NAME, HYBRID_CONFIG
from gptoss_cli.checkpoint.pipeline import Pipeline, StageClock, torch_threads, worker_count
from gptoss_cli.checkpoint.sources import EXTRA_FILES, HF, HYBRID, MEGATRON, TRAINING, open_source
from gptoss_cli.errors import UsageError
from gptoss_cli.json_input import parse_json
from gptoss_cli.model.dtypes import dtype_name, short_dtype_name, torch_dtype
from gptoss_cli.resources import peak_rss_bytes

OUTPUT_DTYPES = ("bfloat16", "float32", "bf16", "fp32")
EXPERT_FORMS = ("bf16", "mxfp4")
PEFT = "peft"  # a LoRA run's adapters in PEFT's layout (checkpoint/peft_format.py)
TARGETS = (HYBRID, HF, MEGATRON, PEFT)


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
) -> ConvertResult:
    """Convert SRC (HF folder or repo id, OpenAI original/, Hybrid folder, or a training checkpoint) at DST.

    `to` is the output layout (hybrid, hf or megatron); by default the other one than SRC's, and hybrid
    for a training or Megatron checkpoint. `weights` (training checkpoints only): `model` or `master`,
    see the CLI's help. `vocab_multiple` (megatron output only): the embedding and output rows are
    padded to a multiple of it (Megatron's make-vocab-size-divisible-by, default 128)."""
    t0 = time.perf_counter()
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
        target = target_for(source, to, str(src))
        if force:
            check_replaceable_output(dst, target)
        # asked of the reader itself, before it is wrapped: a DcpReader serves one stream of reads
        concurrent_reads = getattr(source.reader, "concurrent_reads", True)
        source.reader = finite = NonFiniteCheck(source.reader)
        plan = make_plan(source, target, experts=experts, dtype=torch_dtype, vocab_multiple=vocab_multiple)
        specs, total = plan.specs, plan.total_bytes
        provenance = {
            "source": str(src),
            "revision": revision,
            "source_format": source.kind,
            "experts_form": plan.experts_in,
            **_made_by(),
            **source.provenance,
        }
        tmp = outputs.start_folder(dst, total)
        with outputs.removed_on_error(tmp, dst):
            on_bytes = (lambda n: progress.advance(nbytes=n)) if progress else None
            writer = plan.open_writer(tmp, max_shard_bytes=max_shard_bytes, on_bytes=on_bytes)
            if progress:
                progress.start(len(specs), total)
            clock = StageClock(source.reader)
            workers = worker_count() if concurrent_reads else 1
            pipeline = Pipeline(finite.wrap_write(writer.write, dst), workers, clock)
            empty = plan.allocator(writer)
            with torch_threads(1):  # one torch thread per worker (pipeline.torch_threads)
                try:
                    for job in plan.jobs:
                        pipeline.next_job()
                        tasks = list(plan.tasks(clock, job, chunk_bytes, empty))
                        for i, task in enumerate(tasks):
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
            outputs.commit(tmp, dst)
    finally:
        source.close()

    return ConvertResult(
        direction=f"{source.kind} -> {target}",
        source=str(src),
        revision=revision,
        destination=str(dst),
        source_format=source.kind,
        experts_in=plan.experts_in,
        experts_out=plan.experts_out,
        dtype=dtype_name(torch_dtype),
        num_tensors=len(specs),
        bytes_written=writer.bytes_written,
        num_shards=len(writer.file_names),
        seconds=time.perf_counter() - t0,
        peak_rss_bytes=peak_rss_bytes(),
        write_seconds=writer.io_seconds,
        read_seconds=clock.read_seconds,
        read_bytes=clock.read_bytes,
        transform_seconds=clock.transform_seconds,
        workers=pipeline.workers,
        architecture=source.arch.to_dict(),
        notes=notes,
        provenance=provenance,
    )


# --to peft of a LoRA run whose experts computed in MXFP4. PEFT adds the adapters, unrounded, to whatever base
# it is given: what a run on MXFP4-stored experts computed, when that base has them; not what a QAT run
# computed, whose forward rounded the merged expert weights.
MXFP4_PEFT_NOTE = ("these adapters were trained against the base's experts rounded to MXFP4 (lora.base_experts=mxfp4): "
                   "apply them to a base with MXFP4 experts (as released), or merge them with --to hf, which adds "
                   "them to the rounded base")
QAT_PEFT_NOTE = ("these adapters were trained with the merged expert weights (base + adapters) rounded to MXFP4 "
                 "(precision.qat=mxfp4{also}); PEFT adds them unrounded, which is not quite the trained model: for that, "
                 "merge them with --to hf --experts mxfp4 (or --to hf), which rounds the merged experts as training did")


def _convert_to_peft(src, dst: Path, *, experts: str | None, weights: str | None, force: bool,
                     progress: ConvertProgress | None, notes: list[str], t0: float) -> ConvertResult:
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
        mxfp4_base = lora.get("base_experts") == "mxfp4"
        if source.provenance.get("qat") == "mxfp4":
            notes.append(QAT_PEFT_NOTE.format(also=", on lora.base_experts=mxfp4" if mxfp4_base else ""))
        elif mxfp4_base:
            notes.append(MXFP4_PEFT_NOTE)
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
        provenance = {"source": str(src), "source_format": TRAINING, **_made_by(), **source.provenance}
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


__all__ = ["convert", "ConvertResult", "ConvertProgress", "PROVENANCE_KEY", "parse_dtype", "check_replaceable_output"]
