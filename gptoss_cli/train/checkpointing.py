"""Training checkpoints with torch.distributed.checkpoint (DCP): atomic, with a `latest` pointer.

A checkpoint folder `<dir>/iter_0000010/` holds the DCP shards of
  model.*      every parameter under its Hybrid name (experts per global id, so any EP layout reads them),
  optimizer.*  fp32 master weights and AdamW moments per parameter name (from their owners),
  rng.rank{r}  each rank's torch RNG state,
plus `train_state.json` (step, data position, learning-rate schedule, the layout that wrote it).
It is written under a temporary name and renamed when every rank has finished, then `latest`
(one line: the folder name) is replaced atomically; a run killed mid-save leaves the previous
checkpoint as the latest. Loading asks DCP only for the keys this rank's layout needs, which is
what lets a checkpoint saved at one DP/EP layout load at another.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import warnings
from pathlib import Path
from typing import Any, Iterator

import torch

from gptoss_cli.errors import CheckpointError
from gptoss_cli.parallel.state import ParallelState, barrier

LATEST = "latest"
TRAIN_STATE = "train_state.json"


def _model_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}


@contextlib.contextmanager
def _quiet_single_process() -> Iterator[None]:
    """DCP warns that it assumes a single process when torch.distributed is not initialised; that is intended."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _rng_state(state: ParallelState) -> dict[str, torch.Tensor]:
    rng = {f"rank{state.rank}": torch.get_rng_state()}
    if state.device.type == "cuda":
        rng[f"rank{state.rank}.cuda"] = torch.cuda.get_rng_state()
    return rng


def latest_checkpoint(ckpt_dir: str | Path) -> Path | None:
    """The folder `latest` points at, or None when there is no complete checkpoint."""
    pointer = Path(ckpt_dir) / LATEST
    if not pointer.is_file():
        return None
    name = pointer.read_text().strip()
    folder = Path(ckpt_dir) / name
    if not (folder / TRAIN_STATE).is_file():
        raise CheckpointError(
            f"{pointer} points at {name!r}, which is not a complete checkpoint",
            hint="point `latest` at an iter_* folder that has train_state.json, or delete it to start fresh",
        )
    return folder


def save_checkpoint(
    ckpt_dir: str | Path,
    *,
    step: int,
    model: torch.nn.Module,
    optimizer: Any,
    train_state: dict[str, Any],
    state: ParallelState,
) -> Path:
    """Write checkpoint `iter_{step}` atomically and point `latest` at it; returns its folder."""
    ckpt_dir = Path(ckpt_dir)
    name = f"iter_{step:07d}"
    final = ckpt_dir / name
    tmp = ckpt_dir / f".{name}.partial"
    if state.rank == 0:
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
    barrier()
    import torch.distributed.checkpoint as dcp  # lazy: importing DCP costs every worker about a second

    payload: dict[str, Any] = {
        "model": _model_state(model),
        "optimizer": optimizer.state_dict(),
        "rng": _rng_state(state),
    }
    with _quiet_single_process():
        dcp.save(payload, checkpoint_id=str(tmp))
    barrier()
    if state.rank == 0:
        meta = dict(train_state)
        meta.update(step=step, world_size=state.world_size, ep_size=state.ep_size)
        (tmp / TRAIN_STATE).write_text(json.dumps(meta, indent=2) + "\n")
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        pointer_tmp = ckpt_dir / f".{LATEST}.tmp"
        pointer_tmp.write_text(name + "\n")
        os.replace(pointer_tmp, ckpt_dir / LATEST)
    barrier()
    return final


def load_checkpoint(
    folder: str | Path, *, model: torch.nn.Module, optimizer: Any, state: ParallelState
) -> dict[str, Any]:
    """Load model, optimizer and (same layout only) RNG in place; returns train_state.json."""
    import torch.distributed.checkpoint as dcp

    folder = Path(folder)
    try:
        meta = json.loads((folder / TRAIN_STATE).read_text())
        saved = dcp.FileSystemReader(str(folder)).read_metadata().state_dict_metadata
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{folder}: cannot read checkpoint ({exc})") from None
    payload: dict[str, Any] = {"model": _model_state(model), "optimizer": optimizer.state_dict()}
    missing = [f"{group}.{k}" for group in ("model", "optimizer") for k in payload[group] if f"{group}.{k}" not in saved]
    if missing:
        raise CheckpointError(
            f"{folder}: checkpoint lacks {len(missing)} tensors this model needs, e.g. {missing[0]}",
            hint="resume with the same model architecture the checkpoint was trained with",
        )
    # RNG streams belong to ranks: restored only when the layout is the same (else the seed's).
    same_layout = meta.get("world_size") == state.world_size and meta.get("ep_size") == state.ep_size
    rng = _rng_state(state)
    if same_layout and all(f"rng.{k}" in saved for k in rng):
        payload["rng"] = rng
    with _quiet_single_process():
        dcp.load(payload, checkpoint_id=str(folder))
    if "rng" in payload:
        torch.set_rng_state(payload["rng"][f"rank{state.rank}"])
        if f"rank{state.rank}.cuda" in payload["rng"]:
            torch.cuda.set_rng_state(payload["rng"][f"rank{state.rank}.cuda"])
    optimizer.after_load()
    return meta


__all__ = ["save_checkpoint", "load_checkpoint", "latest_checkpoint", "LATEST", "TRAIN_STATE"]
