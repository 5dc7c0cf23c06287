"""What `convert --experts mxfp4` costs a model whose experts were not trained in MXFP4, measured and said.

Rounding the experts of a fine-tune trained in bf16/fp32 (without `precision.qat=mxfp4`) to MXFP4
can undo the fine-tune (a 40-step SFT went from held-out loss 2.60 to 3.18). The export says so in
numbers:

- always, the weight rounding error, accumulated while the experts are encoded (`RoundingMeter`):
  the relative RMS error ||Q(W) - W|| / ||W|| over all expert weights, and the worst tensor's;
- when the model fits in memory here and tokens are at hand (the run's token data, else the source's
  tokenizer.json on a fixed text), what the rounding does to the model (`measure_model`): the
  next-token loss with the source's experts and with them rounded (`round_to_mxfp4`, the export's
  own codec, so the measured model is the exported one up to the other tensors' `--dtype`), and the
  mean KL divergence between the two next-token distributions, on a few sequences. The loss is
  counted as the run's training loss was, so the two compare: over every next token of a token
  file's windows, over the trained tokens only (the loss mask) of the last conversations of an SFT
  file (version 2); the note says which.

The note points at `precision.qat=mxfp4`, which trains with the rounded experts so that the export
holds the model the run trained, or at `--to hf` with bf16 experts, which keeps it as trained.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from gptoss_cli.checkpoint.mapping import hybrid_shapes
from gptoss_cli.errors import first_line
from gptoss_cli.resources import available_memory_bytes
from gptoss_cli.model.config import GptOssArch

SEQUENCES = 4  # sequences measured
SEQ_LENGTH = 256  # tokens per sequence, at most
MAX_CONVERSATION = 4 * SEQ_LENGTH  # an SFT file's conversations measured whole, up to this length
MEMORY_SHARE = 0.5  # the fp32 model may take at most this share of the memory available
SAMPLE_TEXT = (  # a tokenizer-only measurement's text: plain prose and a little code, fixed so results compare
    "The quick brown fox jumps over the lazy dog. A model that was fine-tuned in bf16 and then rounded to "
    "four-bit floating point can lose what it learned: measure before you ship. def mean(xs):\n"
    "    return sum(xs) / len(xs)\n\nQuestion: what is the capital of France? Answer: Paris.")
QAT_HINT = ("train with precision.qat=mxfp4 so that the MXFP4 export holds the model the run trained, or export "
            "with --to hf (bf16 experts), which keeps it as trained")


class RoundingMeter:
    """Sums ||Q(W) - W||^2 and ||W||^2 over the expert weights the export encodes (thread-safe)."""

    def __init__(self):
        self._lock = threading.Lock()
        self.err_sq = self.ref_sq = 0.0
        self.worst, self.worst_name, self.tensors = 0.0, "", 0

    def add(self, name: str, weight: torch.Tensor, rounded: torch.Tensor) -> None:
        w = weight.float()
        err, ref = float((rounded.float() - w).square().sum()), float(w.square().sum())
        rel = math.sqrt(err / ref) if ref > 0 else 0.0
        with self._lock:
            self.err_sq += err
            self.ref_sq += ref
            self.tensors += 1
            if rel > self.worst:
                self.worst, self.worst_name = rel, name

    @property
    def relative_rms(self) -> float:
        return math.sqrt(self.err_sq / self.ref_sq) if self.ref_sq > 0 else 0.0


@dataclass
class ExportCost:
    """What rounding the experts to MXFP4 cost, as `convert` reports it (ConvertResult.export_cost)."""

    weight_relative_rms: float  # ||Q(W) - W|| / ||W|| over all expert weights
    worst_tensor_relative_rms: float
    worst_tensor: str
    expert_tensors: int
    tokens_from: str | None = None  # "the run's data (<path>)", "<tokenizer.json> on a fixed text", or None
    sequences: int = 0
    tokens: int = 0
    loss_before: float | None = None  # mean next-token cross-entropy with the source's experts
    loss_after: float | None = None  # ... with them rounded to MXFP4
    kl: float | None = None  # mean KL(source || rounded) of the next-token distributions, nats per token
    # the `tokens` the loss and KL are over: "trained" (a loss mask's, as an SFT run's training loss) or "all"
    counted: str = "all"
    skipped: str | None = None  # why the model was not run
    extra: dict[str, Any] = field(default_factory=dict)

    def note(self) -> str:
        parts = [f"--experts mxfp4 rounded weights the model was not trained with: the experts moved by "
                 f"{100 * self.weight_relative_rms:.1f}% RMS ({self.expert_tensors} tensors; worst "
                 f"{100 * self.worst_tensor_relative_rms:.1f}%)"]
        if self.kl is not None:
            over = (f"{self.sequences} conversations, over their {self.tokens} trained tokens as the training loss "
                    "counts them" if self.counted == "trained"
                    else f"{self.sequences} sequences, over all {self.tokens} next tokens")
            parts.append(f"on {over}, from {self.tokens_from}, the loss went {self.loss_before:.3f} -> "
                         f"{self.loss_after:.3f} and the next-token KL is {self.kl:.4f} nats")
        elif self.skipped:
            parts.append(f"the model was not run ({self.skipped})")
        return "; ".join(parts) + f"; {QAT_HINT}"


def token_sequences(source, arch: GptOssArch) -> tuple[list[torch.Tensor], str | None, list[torch.Tensor] | None]:
    """A few token sequences to measure on and where they come from: the run's data (the last windows of a
    token file; the last conversations of an SFT file, with their label masks as a third item: which next
    tokens its training loss counted), else the source's tokenizer.json on SAMPLE_TEXT; ([], None, None)
    when neither is at hand."""
    data = ((source.provenance.get("recipe_config") or {}).get("data") or {}) if source.provenance else {}
    path = data.get("path") if isinstance(data, dict) else None
    if isinstance(path, str) and path:
        seqs, masks = _from_token_file(path, arch)
        if seqs:
            return seqs, f"the run's data ({path})", masks
    tokenizer = Path(source.extras_folder) / "tokenizer.json"
    if tokenizer.is_file():
        try:
            from tokenizers import Tokenizer  # noqa: PLC0415 (the data extra)

            ids = Tokenizer.from_file(str(tokenizer)).encode(SAMPLE_TEXT).ids
        except Exception:  # noqa: BLE001 - no tokenizers package or an unreadable file: no measurement
            ids = []
        ids = [i for i in ids if 0 <= i < arch.vocab_size][:SEQ_LENGTH]
        if len(ids) >= 2:
            return [torch.tensor(ids)], f"{tokenizer} on a fixed text", None
    return [], None, None


def _from_token_file(path: str, arch: GptOssArch) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
    """(sequences, label masks or None) of a token file: its last SEQUENCES windows, or of an SFT file its
    last SEQUENCES conversations of at most MAX_CONVERSATION tokens that train something."""
    import numpy as np  # noqa: PLC0415

    from gptoss_cli.data.token_format import (  # noqa: PLC0415
        MASK_DTYPE, check_document_files, check_token_files, document_file_paths, has_documents,
    )

    try:
        bin_path, _, header, n = check_token_files(path, arch.vocab_size)
        offsets = check_document_files(path, header, n) if has_documents(header) else None
    except Exception:  # noqa: BLE001 - moved, deleted or not ours: measure without it
        return [], None
    tokens = np.memmap(bin_path, dtype=header["dtype"], mode="r", shape=(n,))
    if offsets is not None and header.get("loss_mask"):
        mask = np.memmap(document_file_paths(path)[1], dtype=MASK_DTYPE, mode="r", shape=(n,))
        seqs, masks = [], []
        for a, b in zip(offsets[-2::-1], offsets[:0:-1]):  # from the last document back
            if b - a <= MAX_CONVERSATION and mask[a + 1:b].any():
                seqs.append(torch.from_numpy(np.array(tokens[a:b], dtype=np.int64)))
                masks.append(torch.from_numpy(np.array(mask[a + 1:b], dtype=bool)))  # label t+1 of position t
                if len(seqs) == SEQUENCES:
                    break
        return seqs, masks
    length = min(SEQ_LENGTH, n // SEQUENCES)
    if length < 2:
        return [], None
    return [torch.from_numpy(np.array(tokens[n - (k + 1) * length:n - k * length], dtype=np.int64))
            for k in range(SEQUENCES)], None


def model_bytes(arch: GptOssArch) -> int:
    """fp32 bytes of the whole model's weights."""
    return 4 * sum(math.prod(shape) for shape in hybrid_shapes(arch).values())


def measure_model(source, meter: RoundingMeter, build: Callable[[], Any]) -> ExportCost:
    """The weight error, and, when the model fits and tokens are at hand, its loss and KL before and
    after rounding its experts (one fp32 model in memory, `build()`: the source loaded again; the
    rounding is done in place between)."""
    cost = ExportCost(meter.relative_rms, meter.worst, meter.worst_name, meter.tensors)
    seqs, where, masks = token_sequences(source, source.arch)
    need, have = model_bytes(source.arch), available_memory_bytes()
    if not seqs:
        cost.skipped = "no token data or tokenizer.json at hand to run it on"
        return cost
    if have is None or need > MEMORY_SHARE * have:
        cost.skipped = f"{need / 1e9:.1f} GB in fp32 is too large to run here; compare `gptoss eval` of both"
        return cost
    try:
        _run_both(build, seqs, where, cost, masks)
    except (Exception, MemoryError) as exc:  # noqa: BLE001 - the export is complete; the measurement is extra
        cost.skipped = f"running it failed: {first_line(exc)}"
    return cost


def _run_both(build: Callable[[], Any], seqs: list[torch.Tensor], where: str, cost: ExportCost,
              masks: list[torch.Tensor] | None = None) -> None:
    """Loss and KL before and after rounding, over the positions `masks` keeps (each sequence's next tokens
    its training loss counted; None: every next token)."""
    from gptoss_cli.model.mxfp4.codec import round_to_mxfp4  # noqa: PLC0415

    keep = masks if masks is not None else [torch.ones(len(s) - 1, dtype=torch.bool) for s in seqs]
    model = build().eval()
    before = [_logits(model, s)[k] for s, k in zip(seqs, keep)]
    with torch.no_grad():  # the stacked experts [E, out, in], rounded along their input axis as exported
        for name, param in model.named_parameters():
            if name.endswith((".experts.linear_fc1.weight", ".experts.linear_fc2.weight")):
                param.copy_(round_to_mxfp4(param))
    after = [_logits(model, s)[k] for s, k in zip(seqs, keep)]
    targets = [s[1:][k] for s, k in zip(seqs, keep)]
    cost.tokens_from, cost.sequences = where, len(seqs)
    cost.counted = "trained" if masks is not None else "all"
    cost.tokens = sum(len(t) for t in targets)
    cost.loss_before = _mean_loss(before, targets)
    cost.loss_after = _mean_loss(after, targets)
    cost.kl = sum(float(torch.nn.functional.kl_div(a.log_softmax(-1), b.log_softmax(-1), log_target=True,
                                                   reduction="sum")) for a, b in zip(after, before)) / cost.tokens


def _logits(model, seq: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(seq[None, :-1]).logits[0].float()


def _mean_loss(logits: list[torch.Tensor], targets: list[torch.Tensor]) -> float:
    total = sum(float(torch.nn.functional.cross_entropy(lg, t, reduction="sum")) for lg, t in zip(logits, targets))
    return total / sum(len(t) for t in targets)


__all__ = ["RoundingMeter", "ExportCost", "measure_model", "token_sequences", "QAT_HINT"]
