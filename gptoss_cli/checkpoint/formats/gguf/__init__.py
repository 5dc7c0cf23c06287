"""A GGUF file for llama.cpp's `gpt-oss` architecture: its registry row. Torch-free at import.

gptoss writes one (`convert SRC DST.gguf --to gguf`, from any source the registry reads) and recognises one (a
file starting with GGUF's magic: `serve-check --export FILE.gguf` checks it against its checkpoint), but reads
none as a model. Beside the row:
- names.py      the GGUF tensor names and which canonical HF tensor each comes from, in which type
- metadata.py   the architecture and tokenizer keys llama.cpp reads, and gptoss's provenance key
- encode.py     values to GGML bytes (F32, F16, BF16, Q8_0) and GPT-OSS's MXFP4 repacked to ggml's block_mxfp4
- writer.py     the streaming file writer (the gguf package writes header, keys and tensor table)
- reader.py     a bounded reader of a GGUF header (keys, tensor table)
- plan.py       `ToGguf`, the plan of `convert --to gguf`
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gptoss_cli.checkpoint.formats.gguf.metadata import ARCH_KEY, PROVENANCE_KEY
from gptoss_cli.checkpoint.formats.gguf.reader import is_gguf, read_header
from gptoss_cli.checkpoint.formats.registry import Format, OpenOptions
from gptoss_cli.errors import CheckpointError, ConfigError, UsageError
from gptoss_cli.model.config import FULL, SLIDING, GptOssArch

if TYPE_CHECKING:
    from gptoss_cli.checkpoint.formats.registry import Source

SUFFIX = ".gguf"
DTYPES = ("f32", "bf16", "f16", "q8_0")  # --dtype of a GGUF (float32, bfloat16, float16 are taken too)
EXPERT_FORMS = ("mxfp4", "same")


def detect(root: Path) -> bool:
    return is_gguf(root)


def architecture(root: Path, options: OpenOptions | None = None) -> tuple[GptOssArch, str | None]:
    """The architecture a GGUF holds: gptoss's own record of it where gptoss wrote the file, else read from the
    keys llama.cpp's gpt-oss loader reads."""
    meta = read_header(root).metadata
    if meta.get("general.architecture") != "gpt-oss":
        raise CheckpointError(f"{root}: a GGUF of architecture {meta.get('general.architecture')!r}, not gpt-oss")
    if isinstance(meta.get(ARCH_KEY), str):
        try:
            return GptOssArch.from_dict(json.loads(meta[ARCH_KEY])), None
        except (ValueError, ConfigError) as exc:
            raise CheckpointError(f"{root}: {ARCH_KEY} is not an architecture gptoss reads ({exc})") from None
    return _from_keys(root, meta), None


def _from_keys(root: Path, meta: dict) -> GptOssArch:
    def key(name: str, default: Any = None) -> Any:
        value = meta.get(f"gpt-oss.{name}", default)
        if value is None:
            raise CheckpointError(f"{root}: has no gpt-oss.{name}")
        return value

    layers = int(key("block_count"))
    pattern = meta.get("gpt-oss.attention.sliding_window_pattern")
    layer_types = tuple(SLIDING if (pattern[i] if isinstance(pattern, list) else i % 2 == 0) else FULL
                        for i in range(layers))
    tokens = meta.get("tokenizer.ggml.tokens")
    vocab = tokens[1] if isinstance(tokens, tuple) else len(tokens or [])
    fields = dict(
        num_hidden_layers=layers, num_local_experts=int(key("expert_count")),
        num_experts_per_tok=int(key("expert_used_count")), hidden_size=int(key("embedding_length")),
        intermediate_size=int(key("expert_feed_forward_length")), num_attention_heads=int(key("attention.head_count")),
        num_key_value_heads=int(key("attention.head_count_kv")), head_dim=int(key("attention.key_length")),
        vocab_size=int(vocab), sliding_window=int(key("attention.sliding_window")), layer_types=layer_types,
        max_position_embeddings=int(key("context_length")), rms_norm_eps=float(key("attention.layer_norm_rms_epsilon")),
        rope_theta=float(key("rope.freq_base")), rope_scaling_factor=float(key("rope.scaling.factor", 1.0)),
        rope_beta_fast=float(key("rope.scaling.yarn_beta_fast", 32.0)),
        rope_beta_slow=float(key("rope.scaling.yarn_beta_slow", 1.0)),
        rope_original_max_position_embeddings=int(key("rope.scaling.original_context_length", 4096)),
        rope_truncate=True,  # llama.cpp rounds YaRN's correction dimensions whatever the file says
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"), eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
        pad_token_id=meta.get("tokenizer.ggml.padding_token_id"),
    )
    try:
        return GptOssArch(**fields)
    except (ValueError, TypeError, ConfigError) as exc:
        raise CheckpointError(f"{root}: its gpt-oss keys are not a GPT-OSS architecture ({exc})") from None


def open_gguf(src: str, root: Path, revision: str | None, options: OpenOptions) -> Source:
    raise UsageError(f"{root}: is a GGUF file, an export for llama.cpp; gptoss reads none as a checkpoint",
                     hint="use the checkpoint it was made from (serve-check CKPT --engine llamacpp --export FILE.gguf "
                          "checks the file against it)")


def plan(source: Source, *, experts: str | None, dtype: Any, vocab_multiple: int | None = None):
    from gptoss_cli.checkpoint.formats.gguf.plan import to_gguf_plan  # noqa: PLC0415 (imports torch)

    return to_gguf_plan(source, experts=experts, dtype=dtype)


def provenance(path: Path) -> dict | None:
    """What gptoss recorded of the source in a GGUF it wrote; None for any other file."""
    if not is_gguf(path):
        return None
    try:
        value = read_header(path).metadata.get(PROVENANCE_KEY)
        return json.loads(value) if isinstance(value, str) else None
    except (CheckpointError, ValueError):
        return None


def replaceable(dst: Path) -> None:
    """--force replaces a GGUF file gptoss wrote, and nothing else."""
    if not dst.exists():
        return
    if dst.is_dir() or provenance(dst) is None:
        raise UsageError(f"{dst}: --force replaces only a GGUF file gptoss wrote (one with {PROVENANCE_KEY})",
                         hint="choose another DST, or remove it yourself")


GGUF = Format(
    name="gguf", title="a GGUF", detect=detect, architecture=architecture, open=open_gguf, plan=plan,
    replaceable=replaceable, writer_options=frozenset({"experts"}), default_target="hybrid", arch_file="its header",
    file_suffix=SUFFIX, dtypes=DTYPES, expert_forms=EXPERT_FORMS,
)

__all__ = ["GGUF", "SUFFIX", "DTYPES", "EXPERT_FORMS", "provenance"]
