"""Megatron-LM's `torch_dist` checkpoint of a GPT-OSS hybrid model: its names, its files, writing and reading them.

A Megatron checkpoint folder (docs/megatron-checkpoints.md):

    <dir>/latest_checkpointed_iteration.txt   "release" or an iteration number
    <dir>/release/ or <dir>/iter_0000100/
        metadata.json      {"sharded_backend": "torch_dist", ...}: how the rest is stored
        common.pt          torch.save of the non-sharded state: `args` (an argparse.Namespace with the
                           architecture), `iteration`, `checkpoint_version`
        .metadata          DCP's pickled Metadata: every key, its global shape and its chunks
        __<rank>_<n>.distcp  the chunks, each a torch.save'd tensor (or raw bytes for objects)

Keys are the sharded keys of Megatron's TE layer specs, which equal our Hybrid names except for
the experts: Megatron stores one `[E, ...]` tensor per layer and weight
(`...mlp.experts.experts.linear_fc1.weight`, the MoE layer's `experts` module adding its own
`experts.`), each expert a chunk at offset e of axis 0, with the gate and up halves of fc1 as two
chunks (the swiglu split), the same for SequentialMLP and TEGroupedMLP; or, with
`singleton_local_shards`, one key per expert (`...mlp.experts.experts.<e>.linear_fc1.weight_w` /
`_v`, `...linear_fc2.weight`). TE
modules also carry `_extra_state` objects, which a strict load expects; we write empty ones and
never unpickle the ones we read. The embedding and output rows are padded to a multiple of
`make_vocab_size_divisible_by`.
"""

from __future__ import annotations

import argparse
import io
import json
import pickle
import re
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from gptoss_cli import outputs
from gptoss_cli.checkpoint.dcp_io import METADATA, SpecReader, check_storage_files, first_line, read_metadata
from gptoss_cli.checkpoint.mapping import VOCAB_PADDED_HYBRID, hybrid_shapes
from gptoss_cli.checkpoint.safetensors_io import TensorSpec
from gptoss_cli.errors import CheckpointError, ConfigError, UsageError
from gptoss_cli.model.config import FULL, SLIDING, GptOssArch
from gptoss_cli.model.expert_names import ExpertName, parse_expert_name
from gptoss_cli.json_input import parse_json

TRACKER = "latest_checkpointed_iteration.txt"
RELEASE = "release"
METADATA_JSON = "metadata.json"
COMMON = "common.pt"
BACKEND = "torch_dist"
CHECKPOINT_VERSION = 3.0
DEFAULT_VOCAB_MULTIPLE = 128  # Megatron-LM's --make-vocab-size-divisible-by default
_ITER = re.compile(r"^iter_(\d{7,})$")


def iter_folder_name(iteration: int) -> str:
    return f"iter_{iteration:07d}"


def padded_vocab(vocab: int, multiple: int) -> int:
    """Megatron's `_vocab_size_with_padding` at TP=1: the next multiple of `multiple`."""
    return -(-vocab // multiple) * multiple


# --- names -------------------------------------------------------------------------------
@dataclass(frozen=True)
class ExpertSlot:
    """Where one Hybrid per-expert tensor lives in the stacked Megatron layout."""

    key: str  # the stacked key, e.g. decoder.layers.1.mlp.experts.experts.linear_fc1.weight
    expert: int
    num_experts: int
    glu: bool  # fc1: stored as two chunks (gate half, up half) along the first per-expert axis


def _hybrid_expert(name: str) -> ExpertName | None:
    """A Hybrid per-expert name of the experts' fc1 / fc2 (model/expert_names.py), else None."""
    per_expert = parse_expert_name(name)
    return per_expert if per_expert is not None and per_expert.is_base else None


def expert_slot(name: str, arch: GptOssArch) -> ExpertSlot | None:
    m = _hybrid_expert(name)
    if m is None:
        return None
    return ExpertSlot(f"{m.experts}.experts.{m.module}.{m.kind}", m.expert, arch.num_local_experts,
                      m.module == "linear_fc1")


def singleton_keys(name: str) -> list[str] | None:
    """The `singleton_local_shards` keys of a Hybrid per-expert name: fc1 as `_w` (gate) and `_v` (up)."""
    m = _hybrid_expert(name)
    if m is None:
        return None
    base = f"{m.experts}.experts.{m.expert}.{m.module}.{m.kind}"
    return [f"{base}_w", f"{base}_v"] if m.module == "linear_fc1" else [base]


def extra_state_keys(arch: GptOssArch) -> list[str]:
    """The ShardedObject keys (`<key>/shard_<offset>_<shape>`) of the TE modules' `_extra_state`.

    Per attention layer: linear_qkv, core_attention, linear_proj; per MoE layer: pre_mlp_layernorm
    and, per expert, linear_fc1 and linear_fc2 (offset e of E); the final norm."""
    keys = []
    for b in range(arch.num_hidden_layers):
        a, m = 2 * b, 2 * b + 1
        for mod in ("linear_qkv", "core_attention", "linear_proj"):
            keys.append(f"decoder.layers.{a}.self_attention.{mod}._extra_state/shard_0_1")
        keys.append(f"decoder.layers.{m}.pre_mlp_layernorm._extra_state/shard_0_1")
        for mod in ("linear_fc1", "linear_fc2"):
            keys.extend(f"decoder.layers.{m}.mlp.experts.experts.{mod}._extra_state/shard_{e}_{arch.num_local_experts}"
                        for e in range(arch.num_local_experts))
    keys.append("decoder.final_norm._extra_state/shard_0_1")
    return keys


# --- args: the architecture as Megatron-LM records it ------------------------------------
def megatron_args(arch: GptOssArch, *, vocab_multiple: int, params_dtype: torch.dtype) -> argparse.Namespace:
    """The `args` Megatron-LM checks on load (and `--use-checkpoint-args` copies) for this model."""
    window = [0] * arch.num_hybrid_layers  # Megatron's per-layer list: 1 = sliding window at layer i+1
    for b in range(arch.num_hidden_layers):
        window[2 * b] = int(arch.is_sliding(b))
    return argparse.Namespace(
        num_layers=arch.num_hybrid_layers,
        hybrid_override_pattern=arch.hybrid_layer_pattern,
        is_hybrid_model=True,
        hidden_size=arch.hidden_size,
        ffn_hidden_size=arch.intermediate_size,
        moe_ffn_hidden_size=arch.intermediate_size,
        num_attention_heads=arch.num_attention_heads,
        group_query_attention=True,
        num_query_groups=arch.num_key_value_heads,
        kv_channels=arch.head_dim,
        num_experts=arch.num_local_experts,
        moe_router_topk=arch.num_experts_per_tok,
        moe_grouped_gemm=True,
        moe_aux_loss_coeff=arch.router_aux_loss_coef,
        vocab_size=arch.vocab_size,
        padded_vocab_size=padded_vocab(arch.vocab_size, vocab_multiple),
        make_vocab_size_divisible_by=vocab_multiple,
        max_position_embeddings=arch.max_position_embeddings,
        position_embedding_type="yarn",
        add_position_embedding=False,
        rotary_base=arch.rope_theta,
        yarn_rotary_scaling_factor=arch.rope_scaling_factor,
        yarn_original_max_position_embeddings=arch.rope_original_max_position_embeddings,
        yarn_beta_fast=arch.rope_beta_fast,
        yarn_beta_slow=arch.rope_beta_slow,
        yarn_correction_range_round_to_int=arch.rope_truncate,
        normalization="RMSNorm",
        norm_epsilon=arch.rms_norm_eps,
        swiglu=True,
        activation_func_clamp_value=arch.swiglu_limit,
        glu_linear_offset=1.0,
        gptoss_swiglu_alpha=arch.swiglu_alpha,
        add_bias_linear=True,
        add_qkv_bias=True,
        softmax_type="learnable",
        window_size=(arch.sliding_window - 1, 0),  # Megatron counts the keys before the query
        window_attn_skip_freq=window,
        untie_embeddings_and_output_weights=True,
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1,
        expert_model_parallel_size=1,
        params_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=False,
        init_method_std=arch.initializer_range,
        ckpt_format=BACKEND,
    )


def _arg(args: Any, name: str, default: Any = None) -> Any:
    return getattr(args, name, default) if getattr(args, name, None) is not None else default


def arch_from_args(args: Any, source: Path) -> GptOssArch:
    """The GptOssArch a Megatron checkpoint's `args` describe; CheckpointError naming the field otherwise.

    Fields Megatron does not record (token ids, swiglu alpha when not ours) keep GPT-OSS's values."""
    try:
        return _arch_from_args(args, source)
    except (TypeError, ValueError, IndexError, KeyError, AttributeError) as exc:  # e.g. a field of the wrong type
        raise CheckpointError(f"{source}: args describe no valid GPT-OSS architecture ({first_line(exc)})") from None


def _arch_from_args(args: Any, source: Path) -> GptOssArch:
    if not isinstance(args, argparse.Namespace):
        raise CheckpointError(f"{source}: 'args' is a {type(args).__name__}, not Megatron-LM's argparse.Namespace")
    for name in ("num_layers", "hidden_size", "num_attention_heads", "num_experts"):
        if not isinstance(getattr(args, name, None), int):
            raise CheckpointError(f"{source}: args.{name} is {getattr(args, name, None)!r}; "
                                  "not a GPT-OSS mixture-of-experts checkpoint")
    pattern = _arg(args, "hybrid_override_pattern")
    if not isinstance(pattern, str) or pattern.replace("|", "") != "*E" * (args.num_layers // 2) or args.num_layers % 2:
        raise CheckpointError(
            f"{source}: args.hybrid_override_pattern is {pattern!r}; gptoss reads hybrid GPT-OSS checkpoints whose "
            f"pattern is '*E' per block ({args.num_layers} layers)")
    blocks = args.num_layers // 2
    window, skip = _arg(args, "window_size"), _arg(args, "window_attn_skip_freq")
    if not window:
        layer_types, sliding = [FULL] * blocks, GptOssArch.sliding_window
    else:
        sliding = int(window[0]) + 1
        if isinstance(skip, list) and len(skip) == args.num_layers:
            layer_types = [SLIDING if skip[2 * b] else FULL for b in range(blocks)]
        elif skip is None or isinstance(skip, int):  # Megatron's rule: layer n (1-based) slides iff n % freq
            layer_types = [SLIDING if skip is None or (2 * b + 1) % skip else FULL for b in range(blocks)]
        else:
            raise CheckpointError(f"{source}: args.window_attn_skip_freq {skip!r} is neither an int nor a list "
                                  f"of {args.num_layers} entries")
    vocab = _arg(args, "vocab_size", _arg(args, "padded_vocab_size"))
    if not isinstance(vocab, int):
        raise CheckpointError(f"{source}: args records neither vocab_size nor padded_vocab_size")
    defaults = GptOssArch()
    fields = dict(
        num_hidden_layers=blocks, num_local_experts=args.num_experts,
        num_experts_per_tok=_arg(args, "moe_router_topk", defaults.num_experts_per_tok),
        hidden_size=args.hidden_size,
        intermediate_size=_arg(args, "moe_ffn_hidden_size", _arg(args, "ffn_hidden_size")),
        num_attention_heads=args.num_attention_heads,
        num_key_value_heads=_arg(args, "num_query_groups", args.num_attention_heads),
        head_dim=_arg(args, "kv_channels", args.hidden_size // args.num_attention_heads),
        vocab_size=vocab, sliding_window=sliding, layer_types=layer_types,
        max_position_embeddings=_arg(args, "max_position_embeddings", defaults.max_position_embeddings),
        rms_norm_eps=_arg(args, "norm_epsilon", defaults.rms_norm_eps),
        rope_theta=_arg(args, "rotary_base", defaults.rope_theta),
        rope_scaling_factor=_arg(args, "yarn_rotary_scaling_factor", defaults.rope_scaling_factor),
        rope_beta_fast=_arg(args, "yarn_beta_fast", defaults.rope_beta_fast),
        rope_beta_slow=_arg(args, "yarn_beta_slow", defaults.rope_beta_slow),
        rope_original_max_position_embeddings=_arg(args, "yarn_original_max_position_embeddings",
                                                   defaults.rope_original_max_position_embeddings),
        rope_truncate=bool(_arg(args, "yarn_correction_range_round_to_int", False)),
        swiglu_limit=_arg(args, "activation_func_clamp_value", defaults.swiglu_limit),
        swiglu_alpha=_arg(args, "gptoss_swiglu_alpha", defaults.swiglu_alpha),
        router_aux_loss_coef=_arg(args, "moe_aux_loss_coeff", defaults.router_aux_loss_coef),
        initializer_range=_arg(args, "init_method_std", defaults.initializer_range),
    )
    try:
        return GptOssArch().replace(**fields)
    except (ConfigError, TypeError) as exc:
        raise CheckpointError(f"{source}: args describe no valid GPT-OSS architecture "
                              f"({getattr(exc, 'message', None) or first_line(exc)})") from None


# --- common.pt: a restricted unpickler ---------------------------------------------------
class Opaque:
    """What a restricted load makes of any class it does not admit: inert, never the class itself."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args = args

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def __repr__(self) -> str:
        return "<opaque>"


def _opaque_class(module: str, name: str) -> type:
    return type(f"Opaque[{module}.{name}]", (Opaque,), {"__module__": __name__})


_COMMON_ALLOWED: dict[tuple[str, str], Any] = {
    ("argparse", "Namespace"): argparse.Namespace,
    ("collections", "OrderedDict"): __import__("collections").OrderedDict,
    **{("builtins", n): getattr(__import__("builtins"), n)
       for n in ("set", "frozenset", "slice", "range", "complex", "bytearray", "list", "dict", "tuple")},
    **{("torch", n): getattr(torch, n) for n in dir(torch) if isinstance(getattr(torch, n, None), torch.dtype)},
}


class _CommonUnpickler(pickle.Unpickler):
    """Admits argparse.Namespace, plain containers and torch dtypes; any other class (Megatron's enums,
    functions, tensors) becomes an inert Opaque stand-in: nothing from the file is ever imported or run."""

    def find_class(self, module: str, name: str) -> Any:
        return _COMMON_ALLOWED.get((module, name)) or _opaque_class(module, name)

    def persistent_load(self, pid: Any) -> Any:  # tensor storages: not needed, never read
        return Opaque()


def load_common(path: Path) -> dict:
    """common.pt (a torch.save zip) through the restricted unpickler; CheckpointError if unreadable."""
    try:
        with zipfile.ZipFile(path) as zf:
            pkl = [n for n in zf.namelist() if n.endswith("/data.pkl") or n == "data.pkl"]
            if not pkl:
                raise CheckpointError(f"{path}: not a torch.save archive (no data.pkl)")
            data = _CommonUnpickler(io.BytesIO(zf.read(pkl[0]))).load()
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing; the Megatron checkpoint is incomplete") from None
    except CheckpointError:
        raise
    except Exception as exc:  # a damaged archive or pickle
        raise CheckpointError(f"{path}: not a readable Megatron common.pt ({first_line(exc)})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: holds a {type(data).__name__}, not Megatron's common state dict")
    return data


# --- the folder --------------------------------------------------------------------------
def is_megatron_checkpoint(path: Path) -> bool:
    """A Megatron checkpoint dir (its tracker file) or one of its iteration folders (metadata.json + common.pt)."""
    return (path / TRACKER).is_file() or ((path / METADATA_JSON).is_file() and (path / COMMON).is_file())


def find_iteration_folder(root: Path) -> Path:
    """The folder the tracker file names (`release` or iter_NNNNNNN), or `root` itself if it is one."""
    if not (root / TRACKER).is_file():
        return root
    tracker = root / TRACKER
    try:
        text = tracker.read_text().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{tracker}: cannot read ({getattr(exc, 'strerror', None) or exc})") from None
    if text == RELEASE:
        folder = root / RELEASE
    elif re.fullmatch(r"[0-9]{1,20}", text):  # ASCII digits that fit in 64 bits (int() of 5000 digits raises)
        folder = root / iter_folder_name(int(text))
    else:
        raise CheckpointError(f"{tracker}: holds {text[:40]!r}, neither 'release' nor an iteration number")
    if not folder.is_dir():
        raise CheckpointError(f"{tracker}: names {folder.name}, which does not exist in {root}")
    return folder


@dataclass(frozen=True)
class MegatronCheckpoint:
    folder: Path  # the iteration folder
    args: argparse.Namespace
    iteration: int
    arch: GptOssArch


def read_megatron_checkpoint(root: Path) -> MegatronCheckpoint:
    """Check metadata.json and common.pt of a Megatron checkpoint (dir or iteration folder)."""
    folder = find_iteration_folder(root)
    meta_path = folder / METADATA_JSON
    try:
        meta = parse_json(meta_path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{meta_path}: missing; {folder} is not a Megatron distributed checkpoint") from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{meta_path}: not valid JSON ({first_line(exc)})") from None
    backend = meta.get("sharded_backend") if isinstance(meta, dict) else None
    if backend != BACKEND:
        raise CheckpointError(f"{meta_path}: sharded_backend is {backend!r}; gptoss reads {BACKEND!r} checkpoints",
                              hint="save with --ckpt-format torch_dist")
    common = load_common(folder / COMMON)
    args = common.get("args")
    where = folder / COMMON
    for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size"):
        size = getattr(args, name, 1)
        if isinstance(size, int) and size > 1:
            raise CheckpointError(
                f"{where}: saved with {name}={size}; gptoss reads Megatron checkpoints saved at TP=1 and PP=1",
                hint="re-save from Megatron-LM with --tensor-model-parallel-size 1 --pipeline-model-parallel-size 1")
    arch = arch_from_args(args, where)
    iteration = common.get("iteration", 0)
    return MegatronCheckpoint(folder, args, iteration if isinstance(iteration, int) else 0, arch)


# --- reading the tensors -----------------------------------------------------------------
class MegatronReader(SpecReader):
    """A Megatron torch_dist checkpoint's model weights under Hybrid names, read chunk by chunk.

    Works for any DP/EP layout at TP=PP=1 and both expert layouts: a Hybrid tensor (or rows of it)
    is assembled from whichever stored chunks overlap it, each read from its byte range with
    torch.load(weights_only=True). The vocabulary padding is hidden (the embedding and output
    present `vocab_size` rows). Optimizer, RNG and `_extra_state` entries are never read.
    """

    concurrent_reads = False  # the last chunk read is cached for the next rows

    def __init__(self, folder: Path, arch: GptOssArch):
        self.folder = Path(folder)
        self.arch = arch
        self.metadata = read_metadata(self.folder)
        check_storage_files(self.folder, self.metadata)
        md = self.metadata.state_dict_metadata
        self._storage = {(i.fqn, tuple(i.offset or ())): info for i, info in (self.metadata.storage_data or {}).items()}
        # name -> its sources: (key, leading offsets in the key (the expert), the rows of the name it holds)
        self._sources: dict[str, list[tuple[str, tuple[int, ...], int, int]]] = {}
        self._specs: dict[str, TensorSpec] = {}
        self.layout = None
        for name, shape in hybrid_shapes(arch).items():
            slot = expert_slot(name, arch)
            if slot is not None and slot.key in md:
                self.layout = self.layout or "stacked"
                self._sources[name] = [(slot.key, (slot.expert,), 0, shape[0])]
            elif slot is not None and all(k in md for k in singleton_keys(name)):
                self.layout = self.layout or "singleton"
                keys = singleton_keys(name)
                rows = shape[0] // len(keys)  # fc1: the gate half (_w), then the up half (_v)
                self._sources[name] = [(k, (), i * rows, rows) for i, k in enumerate(keys)]
            elif name in md:
                self._sources[name] = [(name, (), 0, shape[0])]
            else:
                continue
            for key, lead, _, rows in self._sources[name]:
                self._check_entry(md, name, key, (*([arch.num_local_experts] if lead else []), rows, *shape[1:]))
            self._specs[name] = TensorSpec(name, tuple(shape), md[self._sources[name][0][0]].properties.dtype)
        self._cache: tuple[Any, torch.Tensor] | None = None

    def _check_entry(self, md: dict, name: str, key: str, want: tuple[int, ...]) -> None:
        """`key` is a tensor of the global shape the architecture gives it (vocabulary rows may be padded)."""
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        if not isinstance(md[key], TensorStorageMetadata):
            raise CheckpointError(f"{self.folder / METADATA}: {key!r} is not a tensor entry")
        stored = tuple(md[key].size)
        ok = stored == want or (name in VOCAB_PADDED_HYBRID and stored[1:] == want[1:] and stored[0] >= want[0])
        if not ok:
            raise CheckpointError(f"{self.folder / METADATA}: {key!r} has global shape {list(stored)}, "
                                  f"expected {list(want)} for the architecture in {COMMON}")

    def close(self) -> None:
        self._cache = None

    def file_of(self, name: str) -> Path:
        key = self._sources[name][0][0] if name in self._sources else name
        for (fqn, _), info in self._storage.items():
            if fqn == key:
                return self.folder / info.relative_path
        return self.folder / METADATA

    def read(self, name: str, start: int | None = None, stop: int | None = None) -> torch.Tensor:
        """Tensor `name`, or rows [start, stop) of it."""
        if name not in self._specs:
            raise CheckpointError(f"{self.folder}: tensor {name!r} is missing")
        shape = self._specs[name].shape
        r0, r1 = start or 0, shape[0] if stop is None else stop
        out = torch.empty((r1 - r0, *shape[1:]), dtype=self._specs[name].dtype)
        for key, lead, row0, rows in self._sources[name]:
            lo, hi = max(r0, row0), min(r1, row0 + rows)
            if lo < hi:
                region = (*((x, 1) for x in lead), (lo - row0, hi - lo), *((0, n) for n in shape[1:]))
                out[lo - r0:hi - r0] = self._assemble(key, region).reshape(hi - lo, *shape[1:])
        return out

    def _assemble(self, key: str, region: tuple[tuple[int, int], ...]) -> torch.Tensor:
        """The `region` (per-axis start, size) of stored key `key`, from the chunks overlapping it."""
        meta = self.metadata.state_dict_metadata[key]
        out = torch.empty(tuple(s for _, s in region), dtype=meta.properties.dtype)
        covered = 0
        for chunk in meta.chunks:
            lo = [max(r0, c0) for (r0, _), c0 in zip(region, chunk.offsets)]
            hi = [min(r0 + rs, c0 + cs) for (r0, rs), c0, cs in zip(region, chunk.offsets, chunk.sizes)]
            if any(a >= b for a, b in zip(lo, hi)) and region:
                continue
            data = self._chunk(key, tuple(chunk.offsets), tuple(chunk.sizes))
            src = tuple(slice(a - c0, b - c0) for a, b, c0 in zip(lo, hi, chunk.offsets))
            dst = tuple(slice(a - r0, b - r0) for a, b, (r0, _) in zip(lo, hi, region))
            out[dst] = data[src]
            n = 1
            for a, b in zip(lo, hi):
                n *= b - a
            covered += n
        if covered != out.numel():
            raise CheckpointError(f"{self.folder / METADATA}: the chunks of {key!r} do not cover "
                                  f"{[(s, s + n) for s, n in region]} (a shard is missing from the metadata)")
        return out

    def _chunk(self, key: str, offsets: tuple, sizes: tuple) -> torch.Tensor:
        if self._cache is not None and self._cache[0] == (key, offsets):
            return self._cache[1]
        info = self._storage.get((key, offsets))
        if info is None:
            raise CheckpointError(f"{self.folder / METADATA}: records no storage for chunk {list(offsets)} of {key!r}")
        path = self.folder / info.relative_path
        if getattr(info, "transform_descriptors", None):
            raise CheckpointError(f"{path}: chunk {list(offsets)} of {key!r} is stored with transforms "
                                  f"{info.transform_descriptors}, which gptoss does not read")
        self._cache = None
        try:
            with open(path, "rb") as f:
                data = torch.load(_Window(f, info.offset, info.length), map_location="cpu", weights_only=True)
        except OSError as exc:
            raise CheckpointError(f"{path}: cannot read ({exc.strerror or exc})") from None
        except Exception as exc:
            raise CheckpointError(f"{path}: chunk {list(offsets)} of {key!r} is not a readable tensor "
                                  f"({first_line(exc)})", hint="the checkpoint is damaged") from None
        if not isinstance(data, torch.Tensor) or tuple(data.shape) != sizes:
            raise CheckpointError(f"{path}: chunk {list(offsets)} of {key!r} holds "
                                  f"{list(data.shape) if isinstance(data, torch.Tensor) else type(data).__name__}, "
                                  f"the metadata says {list(sizes)}")
        self._cache = ((key, offsets), data)
        return data


class _Window(io.RawIOBase):
    """Bytes [offset, offset + length) of an open file as a seekable file of their own, so that
    torch.load reads one chunk in place instead of from a copy of its bytes."""

    def __init__(self, f, offset: int, length: int):
        self._f, self._offset, self._length, self._pos = f, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._length}[whence]
        self._pos = max(0, min(self._length, base + pos))
        return self._pos

    def readinto(self, buffer) -> int:
        n = min(len(buffer), self._length - self._pos)
        if n <= 0:
            return 0
        self._f.seek(self._offset + self._pos)
        got = self._f.readinto(memoryview(buffer)[:n])
        self._pos += got
        return got


# --- writing -----------------------------------------------------------------------------
def _empty_extra_state() -> bytes:
    buf = io.BytesIO()
    torch.save([None], buf)  # what Megatron writes for a module without FP8 state: a list of one None
    return buf.getvalue()


class MegatronWriter:
    """Writes Hybrid-named tensors, in plan order and in row pieces, as a torch_dist checkpoint.

    Same interface as the safetensors ShardedWriter (`write`, `close`, `abort`, `bytes_written`,
    `file_names`, `io_seconds`). Each piece becomes one DCP chunk, appended to `__0_<n>.distcp`
    files of at most `max_shard_bytes`; expert pieces go to their stacked key at offset e (fc1
    split at the gate/up boundary, as Megatron stores it); vocabulary tensors get zero rows up to
    `padded_rows`. `close` writes `.metadata` (the chunk list, never the data) last.
    """

    def __init__(self, folder: Path, plan: Sequence[TensorSpec], arch: GptOssArch, *, padded_rows: int,
                 max_shard_bytes: int, on_bytes: Callable[[int], None] | None = None):
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.arch = arch
        self.plan = {s.name: s for s in plan}
        self.padded_rows = padded_rows
        self.max_shard_bytes = max_shard_bytes
        self.on_bytes = on_bytes
        self._rows: dict[str, int] = {}
        self._chunks: dict[str, list[tuple[tuple[int, ...], tuple[int, ...]]]] = {}
        self._dtypes: dict[str, torch.dtype] = {}
        self._global: dict[str, tuple[int, ...]] = {}
        self._storage: list[tuple[str, tuple[int, ...] | None, str, int, int]] = []  # key, offsets, file, off, len
        self.file_names: list[str] = []
        self._file = None
        self.bytes_written = 0
        self.io_seconds = 0.0

    def _stream(self, nbytes: int):
        if self._file is None or (self._file.tell() and self._file.tell() + nbytes > self.max_shard_bytes):
            if self._file is not None:
                self._file.close()
            name = f"__0_{len(self.file_names)}.distcp"
            with outputs.naming(self.folder / name):
                self._file = open(self.folder / name, "wb")
            self.file_names.append(name)
        return self._file

    def _put(self, key: str, offsets: tuple[int, ...] | None, payload: torch.Tensor | bytes) -> None:
        t0 = time.perf_counter()
        nbytes = len(payload) if isinstance(payload, bytes) else payload.numel() * payload.element_size()
        f = self._stream(nbytes)
        start = f.tell()
        with outputs.naming(self.folder / self.file_names[-1]):
            if isinstance(payload, bytes):
                f.write(payload)
            else:
                torch.save(payload.contiguous().clone() if payload.storage_offset() or not payload.is_contiguous()
                           or payload.untyped_storage().nbytes() != nbytes else payload, f)
        length = f.tell() - start
        self._storage.append((key, offsets, self.file_names[-1], start, length))
        self.bytes_written += length
        self.io_seconds += time.perf_counter() - t0
        if self.on_bytes and not isinstance(payload, bytes):  # the planned tensor bytes, as the progress total
            self.on_bytes(nbytes)

    def _tensor(self, key: str, global_shape: tuple[int, ...], offsets: tuple[int, ...], data: torch.Tensor) -> None:
        self._global.setdefault(key, global_shape)
        self._dtypes.setdefault(key, data.dtype)
        self._chunks.setdefault(key, []).append((offsets, tuple(data.shape)))
        self._put(key, offsets, data)

    def write(self, name: str, chunk: torch.Tensor) -> None:
        spec = self.plan[name]
        row = self._rows.get(name, 0)
        n = chunk.shape[0] if chunk.dim() else 1
        self._rows[name] = row + n
        slot = expert_slot(name, self.arch)
        if slot is None:
            rows = self.padded_rows if name in VOCAB_PADDED_HYBRID else (spec.shape[0] if spec.shape else 0)
            shape = (rows, *spec.shape[1:]) if spec.shape else ()
            self._tensor(name, shape, (row, *(0,) * (len(shape) - 1)) if shape else (), chunk)
            if name in VOCAB_PADDED_HYBRID and self._rows[name] == spec.shape[0]:
                # zero rows up to the padded size, in pieces no larger than the last real one (streaming)
                for r in range(spec.shape[0], rows, max(1, n)):
                    pad = torch.zeros((min(rows, r + max(1, n)) - r, *spec.shape[1:]), dtype=chunk.dtype)
                    self._tensor(name, shape, (r, *(0,) * (len(shape) - 1)), pad)
            return
        shape = (slot.num_experts, *spec.shape)
        cuts = [row, row + n]
        half = spec.shape[0] // 2
        if slot.glu and row < half < row + n:  # the gate and up halves are separate chunks in Megatron
            cuts = [row, half, row + n]
        for a, b in zip(cuts, cuts[1:]):
            piece = chunk[a - row:b - row]
            self._tensor(slot.key, shape, (slot.expert, a, *(0,) * (len(spec.shape) - 1)), piece.unsqueeze(0))

    def close(self, index_metadata: dict | None = None) -> None:
        from torch.distributed.checkpoint.filesystem import _StorageInfo
        from torch.distributed.checkpoint.metadata import (
            BytesStorageMetadata, ChunkStorageMetadata, Metadata, MetadataIndex, StorageMeta, TensorProperties,
            TensorStorageMetadata,
        )

        for name, spec in self.plan.items():
            if self._rows.get(name, 0) != (spec.shape[0] if spec.shape else 1):
                raise RuntimeError(f"tensor {name} got {self._rows.get(name, 0)} rows, planned {spec.shape}")
        extra = _empty_extra_state()
        for key in extra_state_keys(self.arch):
            self._put(key, None, extra)
        if self._file is not None:
            self._file.close()
            self._file = None
        state: dict[str, Any] = {}
        for key, shape in self._global.items():
            chunks = [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in self._chunks[key]]
            state[key] = TensorStorageMetadata(TensorProperties(dtype=self._dtypes[key]), torch.Size(shape), chunks)
        storage = {}
        index: dict[str, int] = {}
        for key, offsets, file, off, length in self._storage:
            if offsets is None:
                state[key] = BytesStorageMetadata()
                storage[MetadataIndex(key)] = _StorageInfo(file, off, length)
            else:
                i = index[key] = index.get(key, -1) + 1
                storage[MetadataIndex(key, torch.Size(offsets), i)] = _StorageInfo(file, off, length)
        metadata = Metadata(state_dict_metadata=state, planner_data={}, storage_data=storage,
                            storage_meta=StorageMeta(checkpoint_id=None, save_id=None, load_id=None))
        _write_bytes(self.folder / METADATA, pickle.dumps(metadata))

    def abort(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def write_folder_files(folder: Path, args: argparse.Namespace, iteration: int, provenance: dict) -> None:
    """metadata.json and common.pt of an iteration folder (the DCP files are the writer's)."""
    outputs.write_text(folder / METADATA_JSON, json.dumps(
        {"sharded_backend": BACKEND, "sharded_backend_version": 1, "common_backend": "torch",
         "common_backend_version": 1}) + "\n")
    buf = io.BytesIO()
    torch.save({"args": args, "checkpoint_version": CHECKPOINT_VERSION, "iteration": iteration,
                "num_floating_point_operations_so_far": 0, "gptoss_provenance": provenance}, buf)
    _write_bytes(folder / COMMON, buf.getvalue())


def _write_bytes(path: Path, data: bytes) -> None:
    with outputs.naming(path):
        path.write_bytes(data)


def check_replaceable(dst: Path) -> None:
    """--force replaces only an empty folder or a previous `convert --to megatron` output: the tracker
    file and iteration folders holding only what the writer writes."""
    if not dst.is_dir() or not any(dst.iterdir()):
        return
    refuse = f"{dst}: --force replaces only an empty folder or a previous gptoss Megatron output"
    ours = {METADATA_JSON, COMMON, METADATA}
    for entry in sorted(dst.iterdir()):
        if entry.name == TRACKER and entry.is_file():
            continue
        if entry.is_dir() and (entry.name == RELEASE or _ITER.match(entry.name)) and all(
                f.is_file() and (f.name in ours or re.fullmatch(r"__\d+_\d+\.distcp", f.name)) for f in entry.iterdir()):
            continue
        raise UsageError(f"{refuse}; it also holds {entry.name!r}, which gptoss does not write",
                         hint="choose another DST, or move that out first")
    if not (dst / TRACKER).is_file():
        raise UsageError(f"{refuse}, and it has no {TRACKER}", hint="choose another DST, or empty it yourself")


__all__ = ["TRACKER", "RELEASE", "METADATA_JSON", "COMMON", "BACKEND", "DEFAULT_VOCAB_MULTIPLE", "MegatronReader",
           "MegatronWriter", "MegatronCheckpoint", "read_megatron_checkpoint", "is_megatron_checkpoint",
           "megatron_args", "arch_from_args", "load_common", "extra_state_keys", "expert_slot", "singleton_keys",
           "padded_vocab", "write_folder_files", "check_replaceable", "iter_folder_name", "Opaque"]
