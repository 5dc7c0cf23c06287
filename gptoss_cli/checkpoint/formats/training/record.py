"""The on-disk form of a training checkpoint (what `gptoss train` saves): its names, the run record, finding it.

    <checkpoint.dir>/latest            one line: the name of the newest complete iter_* folder
    <checkpoint.dir>/iter_0000010/     torch.distributed.checkpoint (DCP) files (.metadata, *.distcp) holding
        model.<Hybrid name>                      every parameter (experts per global id: any EP layout reads them)
        optimizer.<Hybrid name>.<kind>           kind: master (fp32), exp_avg, exp_avg_sq, step
        rng.rank<r>                              each rank's RNG state
      train_state.json                           step, data position, lr schedule, layout, and `run` (below)

`gptoss_cli/train/checkpointing.py` writes these names and `gptoss convert` reads them; they live
here so that checkpoint/ needs nothing from train/. The `run` record makes a checkpoint
self-describing: the architecture and layer pattern it was trained with, the recipe (name and
resolved settings) and the run. It is written into the folder before the folder is renamed into
place, so it is as atomic as the rest of the checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gptoss_cli.checkpoint.formats.hybrid.config import check_stored_pattern
from gptoss_cli.errors import CheckpointError, ConfigError
from gptoss_cli.model.catalog import TARGET_MODULES
from gptoss_cli.json_input import parse_json
from gptoss_cli.limits import INT32_MAX
from gptoss_cli.model.config import GptOssArch
from gptoss_cli.model.dtypes import RECIPE_DTYPES
from gptoss_cli.outputs import replace_text

LATEST = "latest"
TRAIN_STATE = "train_state.json"
# Top-level groups of the DCP state dict; DCP flattens {"model": {name: t}} into keys "model.<name>".
MODEL = "model"
OPTIMIZER = "optimizer"
RNG = "rng"
MASTER = "master"  # the optimizer's fp32 master copy of a parameter
ITER_NAME = re.compile(r"^iter_[0-9]{1,20}$")  # ASCII digits; an iteration fits in 64 bits
PARTIAL_NAME = re.compile(r"^\.(iter_\d+\.partial|latest\.tmp)$")
RUN_KEY = "run"
RUN_RECORD_VERSION = 1
WEIGHT_SOURCES = (MODEL, MASTER)


def iter_name(step: int) -> str:
    return f"iter_{step:07d}"


def model_key(name: str) -> str:
    return f"{MODEL}.{name}"


def optimizer_key(name: str, kind: str) -> str:
    return f"{OPTIMIZER}.{name}.{kind}"


def latest_name(ckpt_dir: str | Path) -> str | None:
    """What `latest` says, unchecked (None when there is no `latest`): for messages that a failed save
    left it alone."""
    pointer = Path(ckpt_dir) / LATEST
    return pointer.read_text().strip() if pointer.is_file() else None


def latest_checkpoint(ckpt_dir: str | Path) -> Path | None:
    """The folder `latest` points at, or None when there is no `latest` (no complete checkpoint yet)."""
    pointer = Path(ckpt_dir) / LATEST
    if not pointer.is_file():
        return None
    try:
        name = pointer.read_text().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{pointer}: cannot read ({getattr(exc, 'strerror', None) or exc})") from None
    folder = Path(ckpt_dir) / name
    if not ITER_NAME.match(name) or not (folder / TRAIN_STATE).is_file():
        raise CheckpointError(
            f"{pointer} points at {name[:60]!r}, which is not a complete checkpoint",
            hint="point `latest` at an iter_* folder that has train_state.json, or delete it to start fresh",
        )
    return folder


def base_fingerprint(folder: str | Path) -> dict[str, Any]:
    """What names a LoRA run's frozen base: its resolved path and the sha256 of its weight files
    (every *.safetensors file, in name order, each hashed as its name then its bytes).

    Hashing 120B's files takes minutes, so the digest is cached (`base_hash_cache`) under the files'
    identity: name, size, mtime, ctime and inode of each. A later start or export whose files stat
    the same reads the digest back; any change to a file (a write, a copy, a rename over it) changes
    its ctime or inode and the files are hashed again. The recorded value is always the content hash."""
    folder = Path(folder).expanduser().resolve()
    files = sorted(p for p in folder.glob("*.safetensors") if p.is_file())
    if not files:
        raise CheckpointError(f"{folder}: has no *.safetensors weight files to adapt",
                              hint="point checkpoint.pretrained at a `gptoss convert` output or an HF folder")
    identity = _file_identity(files)
    cache = base_hash_cache(folder)
    digest = _cached_digest(cache, folder, identity) if cache is not None else None
    if digest is None:
        digest = hash_base_files(files)
        if cache is not None and _file_identity(files) == identity:  # unchanged while read: the digest is theirs
            _store_digest(cache, folder, identity, digest)
    return {"path": str(folder), "sha256": digest}


def hash_base_files(files: list[Path]) -> str:
    """sha256 over each file's name then its bytes, in the given order (the full read)."""
    digest = hashlib.sha256()
    for f in files:
        digest.update(f.name.encode() + b"\0")
        try:
            with open(f, "rb") as fh:
                while chunk := fh.read(16 * 1024 * 1024):
                    digest.update(chunk)
        except OSError as exc:
            raise CheckpointError(f"{f}: cannot read ({exc.strerror or exc})") from None
    return digest.hexdigest()


def base_hash_cache(folder: Path) -> Path | None:
    """Where the digest of the base at `folder` is cached: $GPTOSS_CACHE_DIR (default
    $XDG_CACHE_HOME/gptoss, else ~/.cache/gptoss)/base-sha256/<sha256 of the path>.json; None without
    a home to put it in. Not in the base's folder: a base is an input, often read-only or shared, and
    training leaves it untouched."""
    root = os.environ.get("GPTOSS_CACHE_DIR")
    if not root:
        home = os.path.expanduser("~")
        root = os.environ.get("XDG_CACHE_HOME") or (None if home == "~" else os.path.join(home, ".cache"))
        if root is None:
            return None
        root = os.path.join(root, "gptoss")
    return Path(root) / "base-sha256" / f"{hashlib.sha256(str(folder).encode()).hexdigest()[:32]}.json"


def _file_identity(files: list[Path]) -> list[list[Any]]:
    out = []
    for f in files:
        try:
            st = f.stat()
        except OSError as exc:
            raise CheckpointError(f"{f}: cannot read ({exc.strerror or exc})") from None
        out.append([f.name, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino])
    return out


def _cached_digest(cache: Path, folder: Path, identity: list[list[Any]]) -> str | None:
    """The cached digest when it was computed for these very files; None otherwise (and for a cache
    that cannot be read or parsed: it is only a cache)."""
    try:
        record = parse_json(cache.read_bytes())
    except Exception:  # noqa: BLE001 - a missing or broken cache means: hash again
        return None
    if not isinstance(record, dict) or record.get("path") != str(folder) or record.get("files") != identity:
        return None
    digest = record.get("sha256")
    return digest if isinstance(digest, str) and len(digest) == 64 else None


def _store_digest(cache: Path, folder: Path, identity: list[list[Any]], digest: str) -> None:
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        replace_text(cache, json.dumps({"path": str(folder), "files": identity, "sha256": digest}) + "\n")
    except OSError:  # an unwritable cache costs the next start a full hash, nothing else
        pass


def check_base(recorded: dict[str, Any], where: str | Path, path: str | Path | None = None) -> dict[str, Any]:
    """The base a LoRA checkpoint names (its `lora.base` record) must be the one at `path` (default:
    the recorded path), byte for byte; returns the fingerprint of what is there."""
    path = Path(path if path is not None else recorded.get("path") or "")
    if not str(path) or not path.is_dir():
        raise CheckpointError(f"{where}: its LoRA adapters need their base model {str(path)!r}, which is not there",
                              hint="put the base checkpoint back at that path")
    found = base_fingerprint(path)
    require_same_base(recorded, found, where)
    return found


def require_same_base(recorded: Any, found: dict[str, Any], where: str | Path) -> None:
    """A CheckpointError unless the recorded base fingerprint is `found`'s (same content hash)."""
    sha = recorded.get("sha256") if isinstance(recorded, dict) else None
    if sha != found["sha256"]:
        raise CheckpointError(
            f"{where}: its LoRA adapters were trained on a base with sha256 {str(sha)[:16]}..., "
            f"but {found['path']} has sha256 {found['sha256'][:16]}... (a different base)",
            hint="use the base the adapters were trained on (checkpoint.pretrained), or start a new checkpoint.dir")


def run_record(*, arch: GptOssArch, hybrid_layer_pattern: str, params_dtype: str, name: str, run_dir: str | Path,
               recipe: dict[str, Any] | None = None, pretrained: str | None = None, qat: str = "none",
               lora: dict[str, Any] | None = None) -> dict[str, Any]:
    """What a training checkpoint records about its run (train_state.json's `run`): enough to rebuild
    the model without the recipe file, and to say where the weights came from. A LoRA run adds
    `lora`: rank, alpha, dropout, target_modules and `base` (base_fingerprint): its model state is
    the adapters only."""
    return {
        "lora": lora,
        "version": RUN_RECORD_VERSION,
        "name": name,
        "run_dir": str(Path(run_dir).expanduser().resolve()),
        "architecture": arch.to_dict(),
        "hybrid_layer_pattern": hybrid_layer_pattern,
        "params_dtype": params_dtype,
        # precision.qat: "mxfp4" means the forward computed the experts with MXFP4-rounded weights, so
        # convert and eval round them too (docs/qat.md); absent in records older than QAT: "none"
        "qat": qat,
        "pretrained": str(Path(pretrained).expanduser().resolve()) if pretrained else None,
        # the resolved recipe as plain JSON (anything else shown as text)
        "recipe": json.loads(json.dumps(recipe or {}, default=str)),
    }


@dataclass(frozen=True)
class TrainingRun:
    """One training checkpoint folder and the run that wrote it (from train_state.json)."""

    folder: Path  # the iter_* folder
    step: int
    arch: GptOssArch
    hybrid_layer_pattern: str
    params_dtype: str
    name: str
    run_dir: str
    pretrained: str | None
    recipe: dict[str, Any]
    world_size: int | None
    ep_size: int | None
    qat: str = "none"  # precision.qat of the run: "mxfp4" when the forward used MXFP4-rounded expert weights
    lora: dict[str, Any] | None = None  # a LoRA run: its settings and base (run_record)

    def provenance(self) -> dict[str, Any]:
        """What an export records about where its weights came from."""
        return {"run": self.name, "run_dir": self.run_dir, "iteration": self.step, "checkpoint": str(self.folder.resolve()),
                "recipe": self.recipe.get("name") or self.name, "recipe_config": self.recipe,
                "saved_at": {"world_size": self.world_size, "expert_model_parallel_size": self.ep_size},
                "pretrained": self.pretrained, "qat": self.qat, **({"lora": self.lora} if self.lora else {})}


def read_train_state(folder: str | Path) -> dict[str, Any]:
    """train_state.json of an iter_* folder: a JSON object with an integer `step`."""
    path = Path(folder) / TRAIN_STATE
    try:
        data = parse_json(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{folder}: has no {TRAIN_STATE}; it is not a complete gptoss training checkpoint",
                              hint="use an iter_* folder that `latest` pointed at, or the checkpoint.dir") from None
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read ({exc.strerror or exc})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(data, dict) or not isinstance(data.get("step"), int) or isinstance(data.get("step"), bool):
        raise CheckpointError(f"{path}: not a gptoss train state (no integer 'step')")
    check_train_state(path, data)
    return data


# What a resume and a conversion trust in train_state.json, checked before either uses it: a negative
# step once trained at a negative learning rate, a wrong type crashed deep inside.
_COUNTS = {  # field: (required, lowest, highest)
    "step": (True, 1, INT32_MAX),
    "consumed_samples": (True, 0, 2**63 - 1),  # the sample index: train_iters x global_batch_size
    "world_size": (False, 1, INT32_MAX),
    "ep_size": (False, 1, INT32_MAX),
}
_TYPED = {"lr_schedule": dict, "name": str, RUN_KEY: dict}


def check_train_state(path: Path, data: dict[str, Any]) -> None:
    """Every field of a train state has its type and range, and `step` is the one the folder is named for."""
    for key, (required, low, high) in _COUNTS.items():
        value = data.get(key)
        if value is None and not required:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            shown = "missing" if key not in data else f"{value!r}"[:40]
            raise CheckpointError(f"{path}: {key} is {shown}; a gptoss train state has an integer in [{low}, {high}]",
                                  hint="the file was edited or is not from gptoss train; resume from another iter_* folder")
    bad = non_finite_field(data)
    if bad is not None:
        raise CheckpointError(f"{path}: {bad} is not a finite number (NaN or infinity)",
                              hint="the file was edited or is not from gptoss train; resume from another iter_* folder")
    for key, kind in _TYPED.items():
        if data.get(key) is not None and not isinstance(data[key], kind):
            raise CheckpointError(f"{path}: {key} must be a JSON {'object' if kind is dict else 'string'}, "
                                  f"got {type(data[key]).__name__}")
    folder = path.parent.name
    if ITER_NAME.match(folder) and int(folder[len("iter_"):]) != data["step"]:
        raise CheckpointError(f"{path}: step {data['step']} disagrees with the folder name {folder}",
                              hint="the file was edited or moved; resume from another iter_* folder")


def read_training_run(folder: str | Path) -> TrainingRun:
    """The run record of a checkpoint folder; a checkpoint saved before runs were recorded is an error."""
    folder = Path(folder)
    path = folder / TRAIN_STATE
    state = read_train_state(folder)
    run = state.get(RUN_KEY)
    if run is None:
        raise CheckpointError(
            f"{path}: records no model architecture (the checkpoint was saved by an older gptoss), so it cannot "
            "be converted on its own",
            hint="resume the run with this gptoss for one more step (training.train_iters=+1) to save a checkpoint "
            "that records it",
        )
    if not isinstance(run, dict) or run.get("version") != RUN_RECORD_VERSION:
        version = run.get("version") if isinstance(run, dict) else run
        raise CheckpointError(f"{path}: run record version {version!r} is not supported "
                              f"(this gptoss reads {RUN_RECORD_VERSION})")
    try:
        arch = GptOssArch.from_dict(run["architecture"], source=f"{path} run.architecture")
        pattern = run["hybrid_layer_pattern"]
        params_dtype = run["params_dtype"]
    except KeyError as exc:
        raise CheckpointError(f"{path}: run record lacks {exc.args[0]!r}") from None
    except ConfigError as exc:
        raise CheckpointError(exc.message, exc.hint) from None
    if not isinstance(pattern, str):
        raise CheckpointError(f"{path}: run.hybrid_layer_pattern must be a string, got {pattern!r}")
    check_stored_pattern(pattern, arch, path)
    if params_dtype not in RECIPE_DTYPES:
        raise CheckpointError(f"{path}: run.params_dtype {params_dtype!r} is not one of {' | '.join(RECIPE_DTYPES)}")
    for key, kind in (("name", str), ("run_dir", str), ("pretrained", str), ("recipe", dict)):
        if run.get(key) is not None and not isinstance(run[key], kind):
            raise CheckpointError(f"{path}: run.{key} must be a JSON {'object' if kind is dict else 'string'}, "
                                  f"got {type(run[key]).__name__}")
    recipe = run.get("recipe") or {}
    ints = {k: state.get(k) if isinstance(state.get(k), int) else None for k in ("world_size", "ep_size")}
    return TrainingRun(folder=folder, step=state["step"], arch=arch, hybrid_layer_pattern=pattern,
                       params_dtype=str(params_dtype), name=str(run.get("name") or ""),
                       run_dir=str(run.get("run_dir") or ""), pretrained=run.get("pretrained"), recipe=recipe,
                       world_size=ints["world_size"], ep_size=ints["ep_size"], qat=_qat_of(run, path),
                       lora=_lora_record(run.get("lora"), path))


def _qat_of(run: dict[str, Any], path: Path) -> str:
    qat = run.get("qat", "none")
    if qat not in ("none", "mxfp4"):
        raise CheckpointError(f"{path}: run.qat {qat!r} is not one this gptoss knows (none or mxfp4)")
    return qat


# run.lora's numbers, as a recipe bounds them (recipe/schema.py LoraConfig): (lowest, lowest allowed, highest).
# An export writes them (adapter_config.json's r, lora_alpha, lora_dropout) and a merge scales by alpha / rank.
_LORA_NUMBERS = {"rank": (1, True, INT32_MAX), "alpha": (0.0, False, None), "dropout": (0.0, True, 1.0)}


def _lora_record(lora: Any, path: Path) -> dict[str, Any] | None:
    if lora is None:
        return None
    ok = (isinstance(lora, dict) and isinstance(lora.get("target_modules"), list)
          and all(t in TARGET_MODULES for t in lora["target_modules"])
          and isinstance(lora.get("base"), dict) and isinstance(lora["base"].get("sha256"), str)
          and isinstance(lora["base"].get("path"), str) and lora.get("base_experts", "bf16") in ("bf16", "mxfp4"))
    if not ok:
        raise CheckpointError(f"{path}: run.lora is not a LoRA record (rank, alpha, target_modules among "
                              f"{list(TARGET_MODULES)}, base with path and sha256)")
    for key, (low, inclusive, high) in _LORA_NUMBERS.items():
        value = lora.get(key, 0.0 if key == "dropout" else None)
        number = isinstance(value, (int, float)) and not isinstance(value, bool) and (key != "rank" or isinstance(value, int))
        if not number or not math.isfinite(value) or (value < low if inclusive else value <= low) or \
                (high is not None and value > high):
            bound = f"{'>=' if inclusive else '>'} {low:g}" + (f" and <= {high:g}" if high is not None else "")
            kind = "an integer" if key == "rank" else "a finite number"
            raise CheckpointError(f"{path}: run.lora.{key} is {value!r:.40}; a LoRA record holds {kind} {bound}",
                                  hint="the file was edited or is not from gptoss train")
    return lora


def non_finite_field(value: Any, where: str = "") -> str | None:
    """The dotted name of the first NaN or infinite number in a JSON value, or None: JSON has no such
    numbers, Python's reader accepts them, and no field of a gptoss record may hold one."""
    if isinstance(value, float) and not math.isfinite(value):
        return where or "(the document)"
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, list):
        items = ((f"[{i}]", v) for i, v in enumerate(value))
    else:
        return None
    for key, item in items:
        name = f"{where}{key}" if str(key).startswith("[") else (f"{where}.{key}" if where else str(key))
        found = non_finite_field(item, name)
        if found is not None:
            return found
    return None


def looks_like_training_checkpoint(path: Path) -> bool:
    """A checkpoint.dir (a `latest` pointer or iter_* folders) or one iter_* folder (DCP files, train state)."""
    try:
        if (path / LATEST).exists() or (path / TRAIN_STATE).exists() or (path / ".metadata").exists():
            return True
        return any(ITER_NAME.match(p.name) and p.is_dir() for p in path.iterdir())
    except OSError:
        return False


def find_checkpoint_folder(path: str | Path) -> tuple[Path, Path | None]:
    """(the iter_* folder to read, the checkpoint.dir when `path` is one) for a checkpoint.dir or an iter_* folder.

    A checkpoint.dir is read through its `latest` pointer: the newest checkpoint that was complete.
    """
    path = Path(path)
    if (path / TRAIN_STATE).exists() or (path / ".metadata").exists():
        return path, None
    folder = latest_checkpoint(path)
    if folder is None:
        iters = sorted(p.name for p in path.iterdir() if ITER_NAME.match(p.name) and p.is_dir())
        raise CheckpointError(
            f"{path}: has no `{LATEST}` pointer, so no checkpoint in it is known to be complete",
            hint=f"pass one iter_* folder instead, e.g. {path / iters[-1]}" if iters else
            "point SRC at a checkpoint.dir of `gptoss train` or at one of its iter_* folders",
        )
    return folder, path


__all__ = [
    "LATEST", "TRAIN_STATE", "MODEL", "OPTIMIZER", "RNG", "MASTER", "ITER_NAME", "PARTIAL_NAME",
    "WEIGHT_SOURCES", "TrainingRun", "iter_name", "model_key", "optimizer_key", "latest_name", "latest_checkpoint",
    "run_record", "base_fingerprint", "hash_base_files", "base_hash_cache", "check_base", "require_same_base",
    "read_train_state", "check_train_state", "non_finite_field", "read_training_run", "looks_like_training_checkpoint", "find_checkpoint_folder",
]
