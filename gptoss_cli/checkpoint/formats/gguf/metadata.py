"""The key-value metadata of a gptoss GGUF: the architecture llama.cpp's gpt-oss loader reads, the tokenizer, and
what gptoss records of the source. Torch-free; the `gguf` package (the `gguf` extra) is imported inside.

The architecture keys are those llama.cpp's own converter writes for an HF GPT-OSS (convert_hf_to_gguf.py's
GptOssModel and TextModel.set_gguf_parameters), with the same types, so that the file reads the same in
llama.cpp: sizes, the context, RoPE base and YaRN (factor, original context, beta fast and slow), the RMS
epsilon, experts and experts per token, the head sizes, the sliding window. Two keys only when the model
needs them: `attention.sliding_window_pattern` (one bool per block) when its layer_types are not GPT-OSS's
alternation, which llama.cpp's loader otherwise assumes (sliding on even blocks), and none for YaRN's
`truncate`, which GGUF has no key for (llama.cpp always rounds the correction dimensions: docs/gguf.md).

The tokenizer is llama.cpp's `gpt2` (byte-level BPE) model: the token strings of tokenizer.json by id (ids it
does not name become `[PAD<id>]`, as llama.cpp's converter writes them), their types (an added token is
CONTROL when special or shaped `<|...|>`, else USER_DEFINED), the merges, the special token ids, the add-bos/eos
flags and the chat template, the last four read by the gguf package's own `SpecialVocab` exactly as llama.cpp's
converter reads them; `tokenizer.ggml.pre` is `gpt-4o` for o200k's pre-tokenizer (harmony's).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from gptoss_cli.checkpoint.formats.gguf.names import ARCH
from gptoss_cli.errors import CheckpointError, UsageError
from gptoss_cli.model.config import SLIDING, GptOssArch

PROVENANCE_KEY = "gptoss.provenance"  # JSON: what gptoss records of the source (read back by --force, serve-check)
ARCH_KEY = "gptoss.architecture"  # JSON: the architecture as gptoss's config reads it (GptOssArch.to_dict)
TOKENIZER_FILE = "tokenizer.json"
# o200k_base's pre-tokenizer (tiktoken's openai_public.py), which llama.cpp names "gpt-4o"
O200K_PATTERN = "|".join([
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n/]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])
# llama.cpp's file types (llama_ftype): what the bulk of the file is, informational
FILE_TYPES = {"f32": 0, "f16": 1, "q8_0": 7, "bf16": 32}
FILE_TYPE_MXFP4_MOE = 38
NORMAL, CONTROL, USER_DEFINED, UNUSED = 1, 3, 4, 5  # gguf.TokenType


def alternating(arch: GptOssArch) -> bool:
    """Whether layer_types is GPT-OSS's (sliding on even blocks), which llama.cpp's loader assumes."""
    return all((t == SLIDING) == (i % 2 == 0) for i, t in enumerate(arch.layer_types))


def architecture_keys(writer: Any, arch: GptOssArch) -> None:
    """The architecture keys (module docstring) on a gguf.GGUFWriter, in llama.cpp's converter's order."""
    writer.add_type("model")
    writer.add_block_count(arch.num_hidden_layers)
    writer.add_context_length(arch.max_position_embeddings)
    writer.add_embedding_length(arch.hidden_size)
    writer.add_feed_forward_length(arch.intermediate_size)
    writer.add_head_count(arch.num_attention_heads)
    writer.add_head_count_kv(arch.num_key_value_heads)
    if arch.rope_scaling_factor > 1:
        import gguf  # noqa: PLC0415

        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(arch.rope_scaling_factor)
        writer.add_rope_scaling_orig_ctx_len(arch.rope_original_max_position_embeddings)
        writer.add_rope_scaling_yarn_beta_fast(arch.rope_beta_fast)
        writer.add_rope_scaling_yarn_beta_slow(arch.rope_beta_slow)
    writer.add_rope_freq_base(arch.rope_theta)
    writer.add_layer_norm_rms_eps(arch.rms_norm_eps)
    writer.add_expert_count(arch.num_local_experts)
    writer.add_expert_used_count(arch.num_experts_per_tok)
    writer.add_key_length(arch.head_dim)
    writer.add_value_length(arch.head_dim)


def window_keys(writer: Any, arch: GptOssArch) -> None:
    writer.add_sliding_window(arch.sliding_window)
    writer.add_expert_feed_forward_length(arch.intermediate_size)
    if not alternating(arch):  # llama.cpp reads one bool per block where given (load_swa_pattern)
        writer.add_array(f"{ARCH}.attention.sliding_window_pattern", [t == SLIDING for t in arch.layer_types])


# --- the tokenizer ----------------------------------------------------------------------------
def _load_tokenizer(folder: Path) -> dict:
    path = folder / TOKENIZER_FILE
    if not path.is_file():
        raise UsageError(f"{folder}: no {TOKENIZER_FILE}; a GGUF carries its tokenizer, and llama.cpp loads none "
                         "without one", hint=f"copy the model's {TOKENIZER_FILE} next to the weights")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: not a readable tokenizer ({exc})") from None
    model = data.get("model") if isinstance(data, dict) else None
    if not isinstance(model, dict) or model.get("type") != "BPE" or not isinstance(model.get("vocab"), dict):
        raise CheckpointError(f"{path}: not a BPE tokenizer (GGUF's gpt2 model needs one)")
    return data


def is_o200k(tokenizer: dict) -> bool:
    """Whether the pre-tokenizer splits with o200k's pattern (the GPT-OSS tokenizer's)."""
    pre = tokenizer.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", [pre]) if isinstance(pre, dict) else []
    return any(isinstance(s, dict) and s.get("type") == "Split"
               and (s.get("pattern") or {}).get("Regex") == O200K_PATTERN for s in steps)


def token_table(tokenizer: dict, vocab_size: int, where: Path) -> tuple[list[str], list[int]]:
    """(token strings by id, their GGUF token types), `vocab_size` long (module docstring)."""
    tokens: list[str | None] = [None] * vocab_size
    types = [UNUSED] * vocab_size
    for text, tid in tokenizer["model"]["vocab"].items():
        if isinstance(tid, int) and 0 <= tid < vocab_size:
            tokens[tid], types[tid] = text, NORMAL
        elif isinstance(tid, int) and tid >= vocab_size:
            raise CheckpointError(f"{where}: token {text!r} has id {tid}, beyond the model's vocabulary of {vocab_size}")
    for added in tokenizer.get("added_tokens") or []:
        tid, text = added.get("id"), added.get("content")
        if not isinstance(tid, int) or not isinstance(text, str):
            continue
        if not 0 <= tid < vocab_size:
            raise CheckpointError(f"{where}: added token {text!r} has id {tid}, beyond the model's vocabulary of "
                                  f"{vocab_size}")
        special = bool(added.get("special")) or (text.startswith("<|") and text.endswith("|>"))
        tokens[tid], types[tid] = text, CONTROL if special else USER_DEFINED
    return [t if t is not None else f"[PAD{i}]" for i, t in enumerate(tokens)], types


def tokenizer_keys(writer: Any, folder: Path, arch: GptOssArch) -> list[str]:
    """The tokenizer keys (module docstring) on a gguf.GGUFWriter, from `folder`'s tokenizer files; notes."""
    import gguf  # noqa: PLC0415

    data = _load_tokenizer(folder)
    tokens, types = token_table(data, arch.vocab_size, folder / TOKENIZER_FILE)
    notes = []
    o200k = is_o200k(data)
    if not o200k:
        notes.append(f"{folder / TOKENIZER_FILE}: not o200k's pre-tokenizer; the GGUF names llama.cpp's default one, "
                     "so llama.cpp may split text differently (token ids given to it are served as they are)")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-4o" if o200k else "default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    special = gguf.SpecialVocab(folder, load_merges=True, n_vocab=arch.vocab_size)
    post = data.get("post_processor") or {}
    if any(isinstance(p, dict) and p.get("type") == "ByteLevel" for p in post.get("processors", [post])):
        # a byte-level post-processor adds no BOS or EOS: llama.cpp's converter says so (newer SpecialVocab)
        special.add_special_token.setdefault("bos", False)
        special.add_special_token.setdefault("eos", False)
    for typ, tid in (("bos", arch.bos_token_id), ("eos", arch.eos_token_id), ("pad", arch.pad_token_id)):
        if isinstance(tid, int) and 0 <= tid < arch.vocab_size:  # the config's ids where the files name none
            special.special_token_ids.setdefault(typ, tid)
    special.add_to_gguf(writer, quiet=True)
    return notes


__all__ = ["architecture_keys", "window_keys", "tokenizer_keys", "token_table", "is_o200k", "alternating",
           "PROVENANCE_KEY", "ARCH_KEY", "FILE_TYPES", "FILE_TYPE_MXFP4_MOE", "O200K_PATTERN"]
