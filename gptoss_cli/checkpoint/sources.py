"""Finding a checkpoint: a local folder or a Hugging Face repo id, and what kind of checkpoint it holds."""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from gptoss_cli.checkpoint.hybrid_format import HYBRID_CONFIG, read_hybrid_config
from gptoss_cli.checkpoint.layouts import HF_LAYOUTS, OPENAI_ORIGINAL, UINT8, Layout
from gptoss_cli.checkpoint.mapping import check_vocab_padding
from gptoss_cli.checkpoint.dcp_io import DcpReader
from gptoss_cli.checkpoint.megatron_format import MegatronReader, is_megatron_checkpoint, read_megatron_checkpoint
from gptoss_cli.checkpoint.readers import TensorReader
from gptoss_cli.checkpoint.safetensors_io import CheckpointReader
from gptoss_cli.checkpoint.training_format import (
    LATEST, MASTER, MODEL, OPTIMIZER, TRAIN_STATE, WEIGHT_SOURCES, check_base, find_checkpoint_folder,
    looks_like_training_checkpoint, model_key, optimizer_key, read_training_run,
)
from gptoss_cli.errors import CheckpointError, ConfigError, UsageError
from gptoss_cli.checkpoint.hf_config import from_hf_config, from_openai_config
from gptoss_cli.model.config import GptOssArch
from gptoss_cli.model.expert_names import parse_expert_name
from gptoss_cli.json_input import parse_json
from gptoss_cli.model.mxfp4 import round_to_mxfp4

# Files copied alongside the weights in both directions.
EXTRA_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
)
HUB_PATTERNS = ["config.json", "model*.safetensors", "model.safetensors.index.json", *EXTRA_FILES]
HUB_ORIGINAL_PATTERNS = ["original/config.json", "original/*.safetensors", "original/*.json"]
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")

HF = "hf"
ORIGINAL = "openai-original"
HYBRID = "hybrid"
TRAINING = "training"  # a `gptoss train` checkpoint (DCP): Hybrid tensor names, read through DcpReader
MEGATRON = "megatron"  # a Megatron-LM torch_dist checkpoint, read under Hybrid names through MegatronReader
HYBRID_NAMED = (HYBRID, TRAINING, MEGATRON)  # sources whose tensors carry Hybrid names


@dataclass
class Source:
    """An opened checkpoint: its kind, architecture, stored layout and a reader over its shards."""

    kind: str
    origin: str  # what the user passed
    revision: str | None
    folder: Path  # the folder holding the weights
    extras_folder: Path  # where tokenizer files are looked up
    arch: GptOssArch
    reader: TensorReader  # CheckpointReader, DcpReader, MegatronReader or LoraMergedReader (or a wrapper of one)
    layout: Layout | None = None  # for HF and original sources
    hybrid_layer_pattern: str | None = None  # for Hybrid and training sources
    provenance: dict = field(default_factory=dict)  # what an output records besides SRC (training: run, iteration)
    protected: tuple[Path, ...] = ()  # more folders an output may not be in (a training run's checkpoint.dir)
    lora: dict | None = None  # a LoRA training checkpoint: its run's LoRA record (training_format.run_record)

    def close(self) -> None:
        self.reader.close()


def resolve(src: str, revision: str | None = None) -> tuple[Path, str | None]:
    """A local folder as is; otherwise a Hugging Face repo id fetched (only the needed files) into the cache."""
    path = Path(src).expanduser()
    if path.exists():
        if not path.is_dir():
            raise UsageError(f"{src}: SRC must be a checkpoint folder or a Hugging Face repo id, not a file")
        return path, revision
    if not _REPO_ID.match(src):
        raise UsageError(f"{src}: no such folder, and not a Hugging Face repo id (owner/name)")
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError
    except ImportError:  # pragma: no cover - a runtime dependency
        raise UsageError("huggingface_hub is not installed; pass a local folder") from None
    try:
        folder = Path(snapshot_download(src, revision=revision, allow_patterns=HUB_PATTERNS))
        if not (folder / "config.json").exists() and not list(folder.glob("*.safetensors")):
            folder = Path(snapshot_download(src, revision=revision, allow_patterns=HUB_ORIGINAL_PATTERNS))
    except LocalEntryNotFoundError:
        offline = os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0")
        raise UsageError(
            f"{src}: not found in the Hugging Face cache"
            + (" and HF_HUB_OFFLINE is set" if offline else " and the Hub could not be reached"),
            hint="download it once with network access, or pass a local folder",
        ) from None
    except RepositoryNotFoundError:
        raise UsageError(f"{src}: no such Hugging Face repository (or it is private and you are not logged in)") from None
    except HfHubHTTPError as exc:
        raise UsageError(f"{src}: Hugging Face Hub error ({exc})") from None
    except ValueError as exc:  # bad revision strings and the like
        raise UsageError(f"{src}: {exc}") from None
    return folder, revision


def _load_json(path: Path) -> dict:
    try:
        data = parse_json(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    return data


def _config_error(exc: ConfigError) -> CheckpointError:
    return CheckpointError(exc.message, exc.hint)


def open_source(src: str, revision: str | None = None, *, weights: str | None = None,
                adapters_only: bool = False) -> Source:
    """Resolve SRC, detect HF / OpenAI original / Hybrid / training checkpoint, read its config and open it.

    `weights` picks what a training checkpoint's tensors are read from (`model` or `master`). A LoRA
    training checkpoint reads as its base with the adapters merged in (checkpoint/lora_merge.py), or,
    with `adapters_only`, as its adapters alone (`Source.lora` says which run made them)."""
    root, revision = resolve(src, revision)
    if weights is not None and not looks_like_training_checkpoint(root):
        raise UsageError(f"--weights {weights} applies to training checkpoints only; {src} is not one")
    if (root / HYBRID_CONFIG).exists():
        cfg = read_hybrid_config(root)
        return Source(HYBRID, src, revision, root, root, cfg.arch, CheckpointReader(root),
                      hybrid_layer_pattern=cfg.hybrid_layer_pattern)
    config = root / "config.json"
    if config.exists():
        data = _load_json(config)
        if "model_type" in data:
            try:
                arch = from_hf_config(data, source=str(config))
            except ConfigError as exc:
                raise _config_error(exc) from None
            reader = CheckpointReader(root)
            try:
                layout = _hf_layout(reader, data, config)
            except BaseException:
                reader.close()
                raise
            return Source(HF, src, revision, root, root, arch, reader, layout=layout)
        if "experts_per_token" in data and "num_experts" in data:  # SRC is itself an original/ folder
            return _open_original(src, revision, root, root.parent)
        raise CheckpointError(f"{config}: has no model_type; is this a GPT-OSS checkpoint?")
    if (root / "original" / "config.json").exists():
        return _open_original(src, revision, root / "original", root)
    if is_megatron_checkpoint(root):
        if weights is not None:
            raise UsageError(f"--weights {weights} applies to gptoss training checkpoints only; {src} is a Megatron one")
        return open_megatron(src, root)
    if looks_like_training_checkpoint(root):
        return open_training(src, root, weights or MODEL, adapters_only=adapters_only)
    raise CheckpointError(
        f"{root}: no config.json (HF), original/config.json (OpenAI), {HYBRID_CONFIG} (Hybrid), "
        f"{LATEST} / {TRAIN_STATE} (a training checkpoint) or latest_checkpointed_iteration.txt (Megatron) found",
        hint="point SRC at the checkpoint folder",
    )


def open_training(src: str, root: Path, weights: str = MODEL, *, adapters_only: bool = False) -> Source:
    """A training checkpoint: a checkpoint.dir (read through `latest`) or one iter_* folder.

    The architecture and layer pattern come from the run record in train_state.json; the tensors
    are the model state (`weights="model"`) or the optimizer's fp32 master copies (`"master"`),
    under their Hybrid names. Nothing is written into the checkpoint."""
    if weights not in WEIGHT_SOURCES:
        raise UsageError(f"--weights {weights!r} is not one of {' | '.join(WEIGHT_SOURCES)}")
    folder, ckpt_dir = find_checkpoint_folder(root)
    run = read_training_run(folder)
    if weights == MODEL:
        prefix = f"{MODEL}."
        reader = DcpReader(folder, model_key, lambda k: k[len(prefix):] if k.startswith(prefix) else None)
    else:
        prefix, suffix = f"{OPTIMIZER}.", f".{MASTER}"
        reader = DcpReader(folder, lambda n: optimizer_key(n, MASTER),
                           lambda k: k[len(prefix):-len(suffix)] if k.startswith(prefix) and k.endswith(suffix) else None)
    # Tokenizer files come from the weights the run started from, when that folder is still there.
    extras = Path(run.pretrained) if run.pretrained and Path(run.pretrained).is_dir() else folder
    if run.lora is not None:
        # A LoRA run's state is its adapters, merged into the base as the forward computed: the base's
        # experts rounded when it kept them in MXFP4 (lora.base_experts=mxfp4), and under QAT the merged
        # expert weights (base + adapters) rounded.
        if not adapters_only:
            reader = _merged_with_base(run, folder, reader)
    elif run.qat == "mxfp4":
        reader = Mxfp4QatReader(reader)
    return Source(TRAINING, src, None, folder, extras, run.arch, reader, hybrid_layer_pattern=run.hybrid_layer_pattern,
                  provenance={**run.provenance(), "weights": weights}, protected=(ckpt_dir,) if ckpt_dir else (),
                  lora=run.lora)


def _merged_with_base(run, folder: Path, adapters):
    """The base a LoRA run names (checked byte for byte), read under Hybrid names (an HF or OpenAI-original
    base through `HfHybridView`) with the run's adapters merged in."""
    from gptoss_cli.checkpoint.lora_merge import HfHybridView, LoraMergedReader

    base_source = None
    try:
        check_base(run.lora["base"], folder / TRAIN_STATE)
        base_source = open_source(run.lora["base"]["path"])
        if base_source.kind not in (HYBRID, HF, ORIGINAL):
            raise CheckpointError(f"{folder}: its LoRA base {base_source.folder} is a {base_source.kind} checkpoint; "
                                  "the adapters merge into a Hybrid, HF or OpenAI-original base")
        base = base_source.reader
        if base_source.layout is not None:  # HF or original: Hybrid names through the mapping table
            check_tensors(base_source, base_source.layout.stored_specs(base_source.arch))
            base = HfHybridView(base, base_source.layout, base_source.arch)
    except BaseException:
        if base_source is not None:
            base_source.close()
        adapters.close()
        raise
    if run.lora.get("base_experts") == "mxfp4":  # the model stored the base's experts encoded: W is Q(W)
        base = Mxfp4QatReader(base)
    merged = LoraMergedReader(base, adapters, float(run.lora["alpha"]) / int(run.lora["rank"]))
    # QAT rounded the merged expert weights, W + scaling * B @ A, in the forward: so does the reader
    return Mxfp4QatReader(merged) if run.qat == "mxfp4" else merged


def open_megatron(src: str, root: Path) -> Source:
    """A Megatron-LM torch_dist checkpoint (its dir, read through the tracker file, or one iteration
    folder): the architecture from common.pt's args, the model weights under Hybrid names."""
    ckpt = read_megatron_checkpoint(root)
    reader = MegatronReader(ckpt.folder, ckpt.arch)
    provenance = {"megatron_iteration": ckpt.iteration, "checkpoint": str(ckpt.folder.resolve()),
                  "expert_layout": reader.layout}
    return Source(MEGATRON, src, None, ckpt.folder, ckpt.folder, ckpt.arch, reader,
                  hybrid_layer_pattern=ckpt.arch.hybrid_layer_pattern, provenance=provenance,
                  protected=(root,) if root != ckpt.folder else ())


def _is_expert_weight(name: str) -> bool:
    """A per-expert weight under its Hybrid name: decoder.layers.<i>.mlp.experts.linear_fc<1|2>.weight<e>."""
    per_expert = parse_expert_name(name)
    return per_expert is not None and per_expert.is_base and per_expert.kind == "weight"


class Mxfp4QatReader:
    """A training checkpoint of a `precision.qat=mxfp4` run (or the base of a `lora.base_experts=mxfp4`
    run, which the model stored encoded), read as its forward computed: every expert
    weight rounded to MXFP4 along its input axis (`round_to_mxfp4`, the export's own codec), every
    other tensor as stored. Rows are rounded independently, so row-range reads round the same."""

    def __init__(self, reader):
        self._reader = reader

    def __getattr__(self, name):
        return getattr(self._reader, name)

    def read(self, name: str, start: int | None = None, stop: int | None = None) -> torch.Tensor:
        t = self._reader.read(name, start, stop)
        if not _is_expert_weight(name) or not t.is_floating_point() or not torch.isfinite(t).all():
            return t  # non-finite weights are left for the finite checks to name
        return round_to_mxfp4(t)


def _open_original(src: str, revision: str | None, folder: Path, extras: Path) -> Source:
    config = folder / "config.json"
    try:
        arch = from_openai_config(_load_json(config), source=str(config))
    except ConfigError as exc:
        raise _config_error(exc) from None
    return Source(ORIGINAL, src, revision, folder, extras, arch, CheckpointReader(folder), layout=OPENAI_ORIGINAL)


def _hf_layout(reader: CheckpointReader, config: dict, config_path: Path) -> Layout:
    """The expert form, from the tensors present (never from shapes), cross-checked with quantization_config."""
    names = set(reader.names())
    has_mx = any(n.endswith("mlp.experts.gate_up_proj_blocks") for n in names)
    has_bf16 = any(n.endswith("mlp.experts.gate_up_proj") for n in names)
    if has_mx and has_bf16:
        raise CheckpointError(f"{reader.folder}: holds both MXFP4 (*_blocks) and bf16 (gate_up_proj) experts")
    form = "mxfp4" if has_mx else "bf16"
    quant = (config.get("quantization_config") or {}).get("quant_method")
    if quant == "mxfp4" and form != "mxfp4" and has_bf16:
        raise CheckpointError(
            f"{config_path}: quantization_config says mxfp4 but the shards hold bf16 gate_up_proj experts",
            hint="remove quantization_config from config.json or restore the MXFP4 shards",
        )
    if quant not in (None, "mxfp4"):
        raise CheckpointError(f"{config_path}: quantization method {quant!r} is not supported (mxfp4 or none)")
    return HF_LAYOUTS[form]


def check_tensors(source: Source, expected: dict[str, tuple[tuple[int, ...], str]], *, padded_rows: tuple = ()) -> None:
    """Every expected tensor present with the right shape and dtype kind; nothing unexpected."""
    present = set(source.reader.names())
    missing = [n for n in expected if n not in present]
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise CheckpointError(f"{source.folder}: tensor {missing[0]!r} is missing{more} (the config expects it)")
    unexpected = sorted(n for n in present - set(expected) if not n.endswith("._extra_state"))
    if unexpected:
        more = f" and {len(unexpected) - 1} more" if len(unexpected) > 1 else ""
        raise CheckpointError(
            f"{source.reader.file_of(unexpected[0])}: unexpected tensor {unexpected[0]!r}{more} "
            f"(not part of a GPT-OSS {source.kind} checkpoint with this config)"
        )
    for name, (shape, kind) in expected.items():
        spec = source.reader.spec(name)
        padded = name in padded_rows and spec.shape[1:] == shape[1:] and len(shape) >= 1
        if padded and spec.shape[0] > shape[0]:
            check_vocab_padding(spec.shape[0], source.arch, source.reader.file_of(name), name)
        ok_shape = spec.shape == shape or (padded and spec.shape[0] > shape[0])
        if not ok_shape:
            raise CheckpointError(
                f"{source.reader.file_of(name)}: tensor {name!r} has shape {list(spec.shape)}, "
                f"expected {list(shape)} for this config"
            )
        is_float = spec.dtype.is_floating_point
        if (kind == UINT8 and spec.dtype != torch.uint8) or (kind != UINT8 and not is_float):
            raise CheckpointError(
                f"{source.reader.file_of(name)}: tensor {name!r} has dtype {spec.dtype}, expected "
                + ("uint8 (MXFP4)" if kind == UINT8 else "a floating-point dtype")
            )
