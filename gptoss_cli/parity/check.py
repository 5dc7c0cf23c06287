"""`gptoss parity-check HF HYBRID`: weights both ways, then block-streamed forward vs transformers."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch

from gptoss_cli.errors import CheckpointError, UsageError
from gptoss_cli.model.config import GptOssArch
from gptoss_cli.model.dtypes import torch_dtype as parse_dtype
from gptoss_cli.parity.report import ParityReport, Thresholds
from gptoss_cli.resources import peak_rss_bytes

PROMPT_SEED = 20250805  # any fixed number: the default prompt must be the same on every run


def require_transformers() -> None:
    try:
        import transformers  # noqa: F401
        from transformers.models.gpt_oss import modeling_gpt_oss  # noqa: F401
    except ImportError:
        raise UsageError(
            "parity-check runs transformers' GPT-OSS as the reference, and transformers is not installed "
            "(or has no gpt_oss model)",
            hint="pip install 'gptoss-cli[parity]'",
        ) from None


def default_seq_len(arch: GptOssArch) -> int:
    """Longer than twice the sliding window, so window and RoPE bugs show (short prompts hide them)."""
    return 2 * arch.sliding_window + 32


def default_tokens(arch: GptOssArch, batch: int, seq_len: int) -> torch.Tensor:
    """Deterministic pseudo-random ids in [0, vocab) (no tokenizer needed), one row per batch entry."""
    g = torch.Generator().manual_seed(PROMPT_SEED)
    return torch.randint(0, arch.vocab_size, (batch, seq_len), generator=g)


def parse_tokens(text: str, arch: GptOssArch, batch: int) -> torch.Tensor:
    """`--tokens "1,2,3"` (commas or spaces) or `--tokens @ids.txt`; the row repeats for --batch."""
    if text.startswith("@"):
        path = Path(text[1:])
        try:
            text = path.read_text()
        except OSError as exc:
            raise UsageError(f"--tokens {path}: cannot read ({exc.strerror})") from None
    parts = text.replace(",", " ").split()
    try:
        ids = [int(p) for p in parts]
    except ValueError:
        raise UsageError(f"--tokens: {text[:40]!r} is not a list of integer token ids", hint='e.g. --tokens "1,2,3"') from None
    if not ids:
        raise UsageError("--tokens is empty")
    bad = [i for i in ids if not 0 <= i < arch.vocab_size]
    if bad:
        raise UsageError(f"--tokens: id {bad[0]} is outside the vocabulary [0, {arch.vocab_size})")
    return torch.tensor(ids, dtype=torch.long).expand(batch, -1).clone()


def architecture_differences(hf: GptOssArch, hybrid: GptOssArch) -> list[str]:
    return [f"{d.split(':')[0]}: HF vs Hybrid{d[d.index(':'):]}" for d in hf.differences(hybrid)]


def run_parity(
    hf: str | Path,
    hybrid: str | Path,
    *,
    tokens: str | None = None,
    seq_len: int | None = None,
    batch: int = 1,
    dtype: str = "float32",
    device: str = "cpu",
    thresholds: dict | None = None,
    check_weights_step: bool = True,
    progress: Callable[[str], None] | None = None,
) -> ParityReport:
    """Compare HYBRID (a converted checkpoint) with HF. Returns the report; raises UsageError /
    CheckpointError for bad input. The caller decides pass/fail from `report.passed`."""
    require_transformers()
    from gptoss_cli.checkpoint.formats.hybrid.config import read_hybrid_config
    from gptoss_cli.checkpoint.storage.safetensors_io import CheckpointReader
    from gptoss_cli.checkpoint import formats
    from gptoss_cli.checkpoint.formats.registry import check_tensors
    from gptoss_cli.checkpoint.sources import open_source
    from gptoss_cli.parity.forward import Ours, TransformersReference, forward_parity
    from gptoss_cli.parity.weights import check_weights

    torch_dtype = parse_dtype(dtype, "--dtype", allowed=("float32", "bfloat16", "fp32", "bf16"))
    if batch < 1:
        raise UsageError(f"--batch {batch} must be at least 1")
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise UsageError(f"--device {device!r} is not a torch device (cpu, cuda, cuda:1, ...)") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"--device {device}: CUDA is not available here", hint="use --device cpu")

    source = open_source(str(hf))
    try:
        if source.format is not formats.HF:
            raise UsageError(f"{hf}: is a {source.kind} checkpoint; HF must be a Hugging Face GPT-OSS folder")
        hybrid_path = Path(hybrid)
        if not hybrid_path.is_dir():
            raise UsageError(f"{hybrid}: no such Hybrid checkpoint folder")
        cfg = read_hybrid_config(hybrid_path)
        arch = source.arch
        # Names, shapes and dtypes from the headers before any read: a header may claim a 1 TB tensor.
        check_tensors(source, source.layout.stored_specs(arch))
        expected_layers = tuple("*E" * cfg.arch.num_hidden_layers)
        pattern_layers = tuple(c for c in cfg.hybrid_layer_pattern if c in "*E-M")
        if pattern_layers != expected_layers:
            raise CheckpointError(
                f"{hybrid_path}: hybrid_layer_pattern {cfg.hybrid_layer_pattern!r} is not one '*E' pair per HF block",
                hint="parity-check compares GPT-OSS conversions, whose pattern is '*E' repeated",
            )
        if seq_len is not None and seq_len < 1:
            raise UsageError(f"--seq-len {seq_len} must be at least 1")
        if tokens is not None:
            ids = parse_tokens(tokens, arch, batch)
        else:
            ids = default_tokens(arch, batch, seq_len or default_seq_len(arch))
        if seq_len is not None and tokens is not None:
            ids = ids[:, :seq_len]
        limits = Thresholds.for_dtype(torch_dtype).replace(**(thresholds or {}))
        report = ParityReport(
            hf=str(hf), hybrid=str(hybrid), dtype=dtype, device=str(dev), batch=ids.shape[0], seq_len=ids.shape[1],
            thresholds=limits, architecture_differences=architecture_differences(arch, cfg.arch),
        )
        with CheckpointReader(hybrid_path) as hybrid_reader:
            if check_weights_step:
                report.weights = check_weights(source, hybrid_reader, arch, progress)
            ref = TransformersReference(source.folder, source.reader, torch_dtype, dev)
            ours = Ours(cfg.arch, cfg.hybrid_layer_pattern, hybrid_reader, torch_dtype, dev)
            blocks = min(arch.num_hidden_layers, cfg.arch.num_hidden_layers)
            report.stages, report.logits, report.seconds_per_block = forward_parity(
                ref, ours, ids.to(dev), blocks, limits, progress
            )
    finally:
        source.close()
    report.peak_rss_bytes = peak_rss_bytes()
    return report


__all__ = ["run_parity", "default_tokens", "default_seq_len", "parse_tokens"]
