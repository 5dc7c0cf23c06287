"""A Megatron checkpoint's non-tensor files, read without trusting them: common.pt through a restricted
unpickler, metadata.json, the tracker file, Megatron-Bridge's run_config.yaml. Torch-free.

common.pt is a torch.save zip whose pickle holds `args` (an argparse.Namespace); nothing from the
file is ever imported or run: argparse.Namespace and plain containers are admitted, any other class
(torch dtypes, Megatron's enums, functions, tensors) becomes an inert `Opaque` stand-in.
"""

from __future__ import annotations

import argparse
import builtins
import collections
import io
import pickle
import re
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gptoss_cli.checkpoint.formats.megatron.args import RecordedArgs, arch_from_args
from gptoss_cli.checkpoint.formats.megatron.names import (
    BACKEND, COMMON, METADATA_JSON, RELEASE, RUN_CONFIG, TRACKER, iter_folder_name,
)
from gptoss_cli.errors import CheckpointError, first_line
from gptoss_cli.json_input import parse_json
from gptoss_cli.model.config import GptOssArch


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


# common.pt's pickle holds `args` and a few counters (tensors are separate entries of the zip): bounded so that
# a zip entry inflating to gigabytes is refused, not decompressed into memory
MAX_COMMON_PICKLE_BYTES = 64 << 20
# containers a pickle may build by calling their type (list(range(10**12)) would allocate without end)
_MAX_ITEMS = 1 << 22


def _bounded(kind: type) -> Any:
    def make(*args: Any) -> Any:
        first = args[0] if args else ()
        n = first if isinstance(first, int) else len(first) if hasattr(first, "__len__") else None
        if n is None or n > _MAX_ITEMS:
            raise pickle.UnpicklingError(f"refusing to build a {kind.__name__} of {n if n is not None else 'unknown'} "
                                         "items")
        return kind(*args)
    return make


_COMMON_ALLOWED: dict[tuple[str, str], Any] = {
    ("argparse", "Namespace"): argparse.Namespace,
    ("collections", "OrderedDict"): collections.OrderedDict,
    **{("builtins", n): getattr(builtins, n) for n in ("slice", "range", "complex")},
    **{("builtins", n): _bounded(getattr(builtins, n)) for n in ("set", "frozenset", "bytearray", "list", "dict", "tuple")},
}


class _CommonUnpickler(pickle.Unpickler):
    """Admits argparse.Namespace and plain containers; anything else is an Opaque stand-in."""

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
            size = zf.getinfo(pkl[0]).file_size  # what it inflates to: a few KB of args, never gigabytes
            if size > MAX_COMMON_PICKLE_BYTES:
                raise CheckpointError(f"{path}: its {pkl[0]} inflates to {size} bytes; Megatron's common state is "
                                      f"a few KB (at most {MAX_COMMON_PICKLE_BYTES} are read)")
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
    elif re.fullmatch(r"[0-9]{1,18}", text):  # ASCII digits only: str.isdigit takes '²', which int() refuses
        folder = root / iter_folder_name(int(text))
    else:
        raise CheckpointError(f"{tracker}: holds {text[:40]!r}, neither 'release' nor an iteration number")
    if not folder.is_dir():
        raise CheckpointError(f"{tracker}: names {folder.name}, which does not exist in {root}")
    return folder


def read_run_config(folder: Path, root: Path) -> tuple[dict | None, Path | None]:
    """Megatron-Bridge's run_config.yaml beside the weights (the iteration folder, else the checkpoint dir):
    (its content, its path), or (None, None) when there is none."""
    for path in dict.fromkeys((folder / RUN_CONFIG, root / RUN_CONFIG)):
        if not path.is_file():
            continue
        import yaml  # noqa: PLC0415 (omegaconf's dependency; only Megatron-Bridge checkpoints need it)

        try:
            data = yaml.safe_load(path.read_text())
        except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
            raise CheckpointError(f"{path}: not readable YAML ({first_line(exc)})") from None
        if not isinstance(data, dict) or not isinstance(data.get("model", {}), dict):
            raise CheckpointError(f"{path}: expected a mapping with a `model:` section (Megatron-Bridge's run config)")
        return data, path
    return None, None


@dataclass(frozen=True)
class MegatronCheckpoint:
    folder: Path  # the iteration folder
    args: Any
    iteration: int
    arch: GptOssArch


def read_megatron_checkpoint(root: Path, arch_from: GptOssArch | None = None) -> MegatronCheckpoint:
    """Check metadata.json and common.pt of a Megatron checkpoint (dir or iteration folder) and read the
    architecture its args (and run_config.yaml) record, or take it from `arch_from` where they cannot say."""
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
    run_config, run_config_path = read_run_config(folder, root)
    recorded = RecordedArgs(common.get("args"), folder / COMMON, run_config, run_config_path)
    for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size"):
        size = recorded.get(name, 1)
        if isinstance(size, int) and size > 1:
            raise CheckpointError(
                f"{recorded.where}: saved with {name}={size}; gptoss reads Megatron checkpoints saved at TP=1 and PP=1",
                hint="re-save from Megatron-LM with --tensor-model-parallel-size 1 --pipeline-model-parallel-size 1")
    arch = arch_from_args(recorded, arch_from)
    iteration = common.get("iteration", 0)
    return MegatronCheckpoint(folder, common.get("args"), iteration if isinstance(iteration, int) else 0, arch)


__all__ = ["Opaque", "load_common", "is_megatron_checkpoint", "find_iteration_folder", "read_run_config",
           "MegatronCheckpoint", "read_megatron_checkpoint"]
