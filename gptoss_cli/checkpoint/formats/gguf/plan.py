"""`ToGguf`, the plan of `convert --to gguf`: any source the registry reads, as one GGUF file llama.cpp's `gpt-oss`
architecture loads (formats/gguf/names.py for the tensors, metadata.py for the keys, writer.py for the file).

Every tensor is read as its canonical HF tensor (mapping.py): through the stored layout of an HF or OpenAI
original source, through the mapping table's `to_hf` from a Hybrid-named one (Hybrid, training with or without
LoRA merged, Megatron), in float32, then encoded in its GGUF type (encode.py). The embedding and output rows go
in row ranges; the expert stacks in chunks of experts, the gate and the up half of `gate_up` as two jobs (two
GGUF tensors, one after the other in the file), so no stack is ever held whole. `--experts mxfp4` passes
GPT-OSS's MXFP4 bytes through (repacked, values unchanged) where the source stores them; experts a QAT run
trained in MXFP4 are encoded exactly; other experts are rounded and the rounding measured (export_cost.py),
as `--to hf --experts mxfp4` does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, ClassVar, Iterator

import torch

from gptoss_cli.checkpoint.export_cost import RoundingMeter
from gptoss_cli.checkpoint.formats.gguf import encode as enc
from gptoss_cli.checkpoint.formats.gguf.names import EXPERTS, F32, GATE, MAIN, UP, WHOLE, GgufTensor, gguf_tensors
from gptoss_cli.checkpoint.formats.plan import ConvertPlan, Empty, Job, expert_chunk, fresh
from gptoss_cli.checkpoint.formats.registry import Source, check_tensors
from gptoss_cli.checkpoint.mapping import VOCAB_PADDED_HYBRID, Unit, canonical_hf_shapes, units
from gptoss_cli.checkpoint.storage.pipeline import Task
from gptoss_cli.checkpoint.storage.readers import RowReader
from gptoss_cli.errors import UsageError
from gptoss_cli.model.mxfp4 import codec as mxfp4

DTYPES = {"f32": enc.F32, "float32": enc.F32, "fp32": enc.F32, "bf16": enc.BF16, "bfloat16": enc.BF16,
          "f16": enc.F16, "float16": enc.F16, "fp16": enc.F16, "q8_0": enc.Q8_0}
EXPERT_FORMS = ("mxfp4", "same")


@dataclass(frozen=True)
class GgufSpec:
    """One GGUF tensor of the output: name, shape (numpy order, in values), GGML type; `source` what makes it."""

    name: str
    shape: tuple[int, ...]
    ggml_type: str
    source: GgufTensor

    @property
    def nbytes(self) -> int:
        return enc.nbytes(self.ggml_type, self.shape)

    @property
    def row_bytes(self) -> int:
        return enc.nbytes(self.ggml_type, self.shape[1:]) if len(self.shape) > 1 else self.nbytes


def _shape(tensor: GgufTensor, canonical_shape: tuple[int, ...]) -> tuple[int, ...]:
    if tensor.part == WHOLE:
        return canonical_shape
    if len(canonical_shape) == 3:  # a gate_up weight stack [E, 2I, H]: half its rows
        return (canonical_shape[0], canonical_shape[1] // 2, canonical_shape[2])
    return (canonical_shape[0], canonical_shape[1] // 2)  # its bias [E, 2I]


def _half(t: torch.Tensor, part: str) -> torch.Tensor:
    """The gate (even) or up (odd) rows of a canonical gate_up weight chunk [n, 2I, ...], or columns of its bias."""
    if part == WHOLE:
        return t
    return t[:, 0::2] if part == GATE else t[:, 1::2]


# --- reading canonical tensors from any source ------------------------------------------------
def _read_canonical(source: Source, reader: RowReader, unit: Unit, name: str, start=None, stop=None) -> torch.Tensor:
    """Canonical HF tensor `name` of `unit` in float32: rows [start, stop) (experts of a stack, rows of the embedding)."""
    arch = source.arch
    if source.layout is not None:
        return source.layout.read(reader, arch, name, torch.float32, start, stop)
    if unit.per_expert:
        per_expert = [reader.read(n).float() for n in unit.hybrid[start:stop]]
        return unit.to_hf(arch, per_expert)[0]
    if start is not None:  # the embedding or the output layer: identity, rows within the vocabulary
        return reader.read(unit.hybrid[0], start, stop).float()
    ins = [reader.read(n, 0, arch.vocab_size) if n in VOCAB_PADDED_HYBRID else reader.read(n) for n in unit.hybrid]
    return dict(zip(unit.hf, unit.to_hf(arch, [t.float() for t in ins])))[name]


def _hybrid_rows(source: Source, reader: RowReader, unit: Unit, part: str, e0: int, e1: int) -> torch.Tensor:
    """A Hybrid-named source's fc1 rows of one half, for experts [e0, e1): [n, I, H] (each fc1 is [gate; up])."""
    inter = source.arch.intermediate_size
    r0 = 0 if part == GATE else inter
    return torch.stack([reader.read(n, r0, r0 + inter).float() for n in unit.hybrid[e0:e1]])


# --- tasks --------------------------------------------------------------------------------------
@dataclass
class _JobUnit:
    """What a job of the GGUF plan computes: the table unit, and for an expert stack the one GGUF tensor it writes."""

    unit: Unit
    tensor: GgufTensor | None = None


def _encode_whole(plan: "ToGguf", reader: RowReader, unit: Unit, specs: list[GgufSpec]):
    pieces = []
    cache: dict[str, torch.Tensor] = {}
    for spec in specs:
        c = spec.source.canonical
        if c not in cache:
            cache[c] = _read_canonical(plan.source, reader, unit, c)
        pieces.append((spec.name, enc.encode(_half(cache[c], spec.source.part), spec.ggml_type, spec.name)))
    return pieces, []


def _encode_rows(plan: "ToGguf", reader: RowReader, unit: Unit, spec: GgufSpec, r0: int, r1: int):
    values = _read_canonical(plan.source, reader, unit, spec.source.canonical, r0, r1)
    return [(spec.name, enc.encode(values, spec.ggml_type, spec.name))], []


def _encode_experts(plan: "ToGguf", reader: RowReader, unit: Unit, spec: GgufSpec, e0: int, e1: int):
    source, part, canonical = plan.source, spec.source.part, spec.source.canonical
    if spec.ggml_type == enc.MXFP4 and plan.passes_mxfp4:  # the stored bytes, repacked
        blocks, scales = source.layout.read_rowwise(reader, canonical, e0, e1)
        return [(spec.name, enc.repack_mxfp4(_half(blocks, part), _half(scales, part)))], []
    if source.layout is None and part != WHOLE and spec.source.role == EXPERTS:
        values = _hybrid_rows(source, reader, unit, part, e0, e1)
    else:
        values = _half(_read_canonical(source, reader, unit, canonical, e0, e1), part)
    if spec.ggml_type == enc.MXFP4 and plan.meter is not None:  # rounded experts the model was not trained with
        for e, t in zip(range(e0, e1), values):
            label = unit.hybrid[e] + ("" if part == WHOLE else f" ({part} rows)")
            plan.meter.add(label, t, mxfp4.round_to_mxfp4(t))
    return [(spec.name, enc.encode(values, spec.ggml_type, spec.name))], []


@dataclass
class ToGguf(ConvertPlan):
    """Any source -> one GGUF file (module docstring)."""

    target: ClassVar[str] = "gguf"
    ggml_type: str = enc.BF16  # --dtype
    expert_type: str = enc.MXFP4  # --experts: MXFP4, or --dtype's type
    passes_mxfp4: bool = False  # the source stores MXFP4 bytes this plan passes through
    meter: Any = None  # export_cost.RoundingMeter: MXFP4 experts the source was not trained with
    file_name: str = "model.gguf"  # the name inside the temporary folder; convert renames it to DST
    writer_notes: list[str] = field(default_factory=list)

    def tasks(self, reader: RowReader, job: Job, budget: int, empty: Empty = fresh) -> Iterator[Task | object]:
        what: _JobUnit = job.unit
        unit = what.unit
        if what.tensor is not None:  # one GGUF tensor of an expert stack, in chunks of experts
            spec = job.outputs[0]
            n = expert_chunk(self.source.arch, unit, torch.float32, budget)
            for e0 in range(0, self.source.arch.num_local_experts, n):
                yield partial(_encode_experts, self, reader, unit, spec, e0, min(self.source.arch.num_local_experts,
                                                                                   e0 + n))
            return
        if len(job.outputs) == 1 and unit.mapping.scope == "global" and len(job.outputs[0].shape) == 2:
            spec = job.outputs[0]  # the embedding or the output layer: row ranges
            step_bytes = max(spec.row_bytes, spec.shape[1] * 4)  # float32 rows are read
            for r0, r1 in row_ranges_of(spec.shape[0], step_bytes, budget):
                yield partial(_encode_rows, self, reader, unit, spec, r0, r1)
            return
        yield partial(_encode_whole, self, reader, unit, job.outputs)

    def open_writer(self, folder: Path, *, provenance: dict, max_shard_bytes: int, on_bytes=None):
        from gptoss_cli.checkpoint.formats.gguf.writer import GgufWriter  # noqa: PLC0415

        writer = GgufWriter(folder / self.file_name, self.specs, on_bytes=on_bytes)
        self.writer_notes = writer.add_metadata(self, provenance)
        writer.start()
        return writer

    def allocator(self, writer) -> Empty:
        return fresh

    def close_writer(self, writer, provenance: dict) -> None:
        writer.close()

    def write_files(self, folder: Path, provenance: dict) -> None:
        self.notes.extend(self.writer_notes)

    def dtype_label(self) -> str:
        return self.ggml_type.lower()


def row_ranges_of(rows: int, row_bytes: int, budget: int) -> list[tuple[int, int]]:
    step = max(1, budget // max(1, row_bytes))
    return [(r, min(rows, r + step)) for r in range(0, rows, step)]


def _jobs(source: Source, ggml_type: str, expert_type: str) -> list[Job]:
    shapes = canonical_hf_shapes(source.arch)
    types = {MAIN: ggml_type, EXPERTS: expert_type, F32: enc.F32}
    jobs = []
    for unit in units(source.arch):
        specs = [GgufSpec(t.name, _shape(t, shapes[c]), types[t.role], t) for c in unit.hf for t in gguf_tensors(c)]
        if unit.per_expert:
            jobs.extend(Job(_JobUnit(unit, s.source), [s]) for s in specs)
        else:
            jobs.append(Job(_JobUnit(unit), specs))
    return jobs


def _check_rows(jobs: list[Job], ggml_type: str, expert_type: str) -> None:
    for spec in (s for j in jobs for s in j.outputs):
        block = enc.BLOCKS[spec.ggml_type][0]
        if spec.shape[-1] % block:
            flag = "--experts" if spec.ggml_type == expert_type and spec.source.role == EXPERTS else "--dtype"
            raise UsageError(f"{flag} {spec.ggml_type.lower()}: tensor {spec.name!r} has rows of {spec.shape[-1]} values, "
                             f"not a multiple of the {block}-value blocks of {spec.ggml_type}",
                             hint="choose f32, bf16 or f16 (and --experts same)")


def to_gguf_plan(source: Source, *, experts: str | None, dtype: str) -> ToGguf:
    ggml_type = DTYPES[dtype]
    form = experts or "mxfp4"
    if form not in EXPERT_FORMS:
        raise UsageError(f"--experts {form!r} is not supported for GGUF; use mxfp4 or same")
    expert_type = enc.MXFP4 if form == "mxfp4" else ggml_type
    if source.layout is not None:
        check_tensors(source, source.layout.stored_specs(source.arch))
    jobs = _jobs(source, ggml_type, expert_type)
    _check_rows(jobs, ggml_type, expert_type)
    stored_mx = source.layout is not None and source.experts_form == "mxfp4"
    passes = expert_type == enc.MXFP4 and stored_mx
    rounds = expert_type == enc.MXFP4 and not stored_mx and source.provenance.get("qat") != "mxfp4"
    compute = torch.float32
    experts_out = "mxfp4" if expert_type == enc.MXFP4 else ggml_type.lower()
    return ToGguf(source, compute, jobs, source.experts_form, experts_out, ggml_type=ggml_type, expert_type=expert_type,
                  passes_mxfp4=passes, meter=RoundingMeter() if rounds else None)


__all__ = ["ToGguf", "GgufSpec", "to_gguf_plan", "DTYPES", "EXPERT_FORMS"]
