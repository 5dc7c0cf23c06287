"""Training checkpoints with torch.distributed.checkpoint (DCP): atomic, with a `latest` pointer.

A checkpoint folder `<dir>/iter_0000010/` holds the DCP shards of
  model.*      every parameter under its Hybrid name (experts per global id, so any EP layout reads them);
               a LoRA run's adapters only, its base named by train_state.json's run record,
  optimizer.*  fp32 master weights and AdamW moments per parameter name (from their owners),
  rng.rank{r}  each rank's torch RNG state,
plus `train_state.json` (step, data position, learning-rate schedule, the layout that wrote it, and
the run record that lets `gptoss convert` rebuild the model: gptoss_cli/checkpoint/formats/training/record.py).
It is written under a temporary name and renamed when every rank has finished, then `latest`
(one line: the folder name) is replaced atomically; a run killed mid-save leaves the previous
checkpoint as the latest. Loading asks DCP only for the keys this rank's layout needs, which is
what lets a checkpoint saved at one DP/EP layout load at another.

Before a save every rank checks that its parameters and optimizer state are finite: a non-finite
state is never written and never becomes `latest`. Before a load, the names, shapes and dtypes
this model needs are checked against the checkpoint's metadata and every shard file against the
bytes the metadata places in it, so a changed architecture or a truncated `.distcp` is one line
naming the tensor or file. `.iter_*.partial` folders of killed runs are removed by the next run
(`remove_partial_checkpoints`, called while the run holds the directory's lock).

Retention (`prune_checkpoints`, checkpoint.keep_last / keep_every): after a save, rank 0 deletes the
complete checkpoints beyond the newest `keep_last` whose step is not a multiple of `keep_every`;
never the one `latest` names (the one just written). A deleted folder is first renamed to its
`.iter_*.partial` name, so a kill mid-delete leaves nothing that looks complete.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from gptoss_cli import outputs

# The on-disk names belong to checkpoint/ (conversion reads these folders without the trainer).
from gptoss_cli.checkpoint.storage.dcp_io import (
    check_storage_files, dcp_error, interruption, quiet_single_process, read_metadata, storage_reader,
)
from gptoss_cli.checkpoint.storage.finite import all_finite
from gptoss_cli.checkpoint.storage.torch_bytes import signals_held
from gptoss_cli.checkpoint.formats.training.record import (
    ITER_NAME, LATEST, MODEL, OPTIMIZER, PARTIAL_NAME, RNG, TRAIN_STATE, iter_name, latest_checkpoint, latest_name,
    read_train_state,
)
from gptoss_cli.errors import CheckpointError, TrainingError, signal_since, signals_seen
from gptoss_cli.model.lora import has_lora, is_adapter_name
from gptoss_cli.parallel.state import ParallelState, barrier


def remove_partial_checkpoints(ckpt_dir: str | Path) -> list[str]:
    """Remove `.iter_*.partial` folders and `.latest.tmp` that killed runs left; returns one note per item.

    Only call this while holding the directory's run lock: then no other run is writing them.
    """
    ckpt_dir = Path(ckpt_dir)
    notes = []
    if not ckpt_dir.is_dir():
        return notes
    for entry in sorted(ckpt_dir.iterdir()):
        if PARTIAL_NAME.match(entry.name):
            size = sum(f.stat().st_size for f in entry.rglob("*") if f.is_file()) if entry.is_dir() else 0
            shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
            notes.append(f"removed {entry} ({size / 1e6:.1f} MB), an incomplete checkpoint of a killed run")
    return notes


def prune_checkpoints(ckpt_dir: str | Path, keep_last: int | None, keep_every: int | None = None) -> list[Path]:
    """Delete the checkpoints retention does not keep (see the module docstring); returns what went.
    Rank 0 only, while the run holds the directory's lock."""
    if keep_last is None:
        return []
    ckpt_dir = Path(ckpt_dir)
    protected = latest_name(ckpt_dir)
    steps = sorted((int(p.name[len("iter_"):]), p) for p in ckpt_dir.iterdir() if ITER_NAME.match(p.name) and p.is_dir())
    removed = []
    for step, folder in steps[:max(0, len(steps) - keep_last)]:
        if folder.name == protected or (keep_every and step % keep_every == 0):
            continue
        doomed = folder.with_name(f".{folder.name}.partial")
        os.replace(folder, doomed)
        shutil.rmtree(doomed)
        removed.append(folder)
    return removed


def _model_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter; of a LoRA model (frozen base) the adapters only: the base is named, not copied."""
    lora = has_lora(model)
    return {k: v for k, v in model.state_dict().items()
            if isinstance(v, torch.Tensor) and (not lora or is_adapter_name(k))}


def _rng_state(state: ParallelState) -> dict[str, torch.Tensor]:
    rng = {f"rank{state.rank}": torch.get_rng_state()}
    if state.device.type == "cuda":
        rng[f"rank{state.rank}.cuda"] = torch.cuda.get_rng_state()
    return rng


def checkpoint_payload(model: torch.nn.Module, optimizer: Any, state: ParallelState) -> dict[str, Any]:
    """What a checkpoint holds (module docstring): the model, the optimizer's state, this rank's RNG."""
    return {MODEL: _model_state(model), OPTIMIZER: optimizer.state_dict(), RNG: _rng_state(state)}


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
    tmp, final = partial_folder(ckpt_dir, step), ckpt_dir / iter_name(step)
    payload = checkpoint_payload(model, optimizer, state)
    check_finite_state(ckpt_dir, step, payload[MODEL], payload[OPTIMIZER], state)
    mark = signals_seen()
    try:
        prepare_folder(ckpt_dir, tmp, state)
        _write_shards(ckpt_dir, tmp, step, payload, mark)
        barrier()
        if state.rank == 0:
            publish_checkpoint(ckpt_dir, tmp, final, step, train_state, state)
    except BaseException:
        if state.rank == 0:  # whatever stopped the save (a signal anywhere in it): the partial folder goes
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    barrier()
    # a signal whose exception a C++ frame swallowed: the save completed (`latest` names it), the run still stops
    stop = signal_since(mark)
    if stop is not None:
        raise stop
    return final


def partial_folder(ckpt_dir: Path, step: int) -> Path:
    """Where the save of `step` is written before it is renamed into place."""
    return ckpt_dir / f".{iter_name(step)}.partial"


def prepare_folder(ckpt_dir: Path, tmp: Path, state: ParallelState) -> None:
    """Rank 0 creates checkpoint.dir and clears `tmp`; every rank waits for it."""
    if state.rank == 0:
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
    barrier()


def save_failed(ckpt_dir: Path, tmp: Path, step: int, exc: BaseException, mark: int) -> BaseException:
    """What a failed DCP save ends as: the signal that stopped it (Ctrl-C or SIGTERM inside DCP is not a failed
    save: exit 130 / 143; DCP wraps the signal's exception, or torch's zip writer turned it into its own
    RuntimeError, "unexpected pos": the record says which), else a CheckpointError naming the folder, the
    first rank's error and the free space."""
    stop = interruption(exc) or signal_since(mark)
    if stop is not None:
        return stop
    latest = latest_name(ckpt_dir)
    # torch's own message for a full disk can be as cryptic as "unexpected pos 704 vs 598"
    free = shutil.disk_usage(ckpt_dir).free if ckpt_dir.is_dir() else 0
    return CheckpointError(
        f"{tmp}: saving the checkpoint of step {step} failed ({dcp_error(exc)}; {free / 1e6:.1f} MB free "
        f"there); `latest` " + (f"still points at {latest}" if latest else "was not created"),
        hint="free space in checkpoint.dir, then resume",
    )


def _write_shards(ckpt_dir: Path, tmp: Path, step: int, payload: dict[str, Any], mark: int) -> None:
    """DCP's shards of every rank into `tmp` (a collective)."""
    import torch.distributed.checkpoint as dcp  # lazy: importing DCP costs every worker about a second

    from torch.distributed.checkpoint.api import CheckpointException

    try:
        with quiet_single_process():
            dcp.save(payload, checkpoint_id=str(tmp))
    except (Exception, CheckpointException) as exc:  # DCP wraps each rank's OSError (a full disk) in one
        raise save_failed(ckpt_dir, tmp, step, exc, mark) from None


def publish_checkpoint(ckpt_dir: Path, tmp: Path, final: Path, step: int, train_state: dict[str, Any],
                       state: ParallelState) -> None:
    """Rank 0, once every rank's shards are in `tmp`: train_state.json, the rename to `final`, then `latest`."""
    # held: a signal lands before the folder is in place or after `latest` names it, never between
    with signals_held():
        meta = dict(train_state)
        meta.update(step=step, world_size=state.world_size, ep_size=state.ep_size, pp_size=state.pp_size)
        outputs.write_text(tmp / TRAIN_STATE, json.dumps(meta, indent=2) + "\n")  # a full disk names the file
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        pointer_tmp = ckpt_dir / f".{LATEST}.tmp"
        outputs.write_text(pointer_tmp, final.name + "\n")
        os.replace(pointer_tmp, ckpt_dir / LATEST)


def _local_parts(t: Any) -> list[torch.Tensor]:
    """The tensors this rank holds of a state entry: itself, or its local shards when the distributed
    optimizer saved it as a ShardedTensor (a shard boundary cut through it)."""
    if isinstance(t, torch.Tensor) and hasattr(t, "local_shards"):
        return [shard.tensor for shard in t.local_shards()]
    return [t] if isinstance(t, torch.Tensor) else []


def _first_non_finite(tensors: dict[str, Any]) -> tuple[int, str | None]:
    """(how many entries hold a NaN or inf, the first one's name). The same elements seen under two names (fp32
    parameters are their own master weights: `model.X` and `optimizer.X.master` are one view) are read once."""
    bad, first = 0, None
    seen: dict[tuple, bool] = {}

    def finite(p: torch.Tensor) -> bool:
        ident = (p.device, p.data_ptr(), tuple(p.shape), p.stride(), p.dtype)
        if ident not in seen:
            seen[ident] = all_finite(p)
        return seen[ident]

    for name, t in tensors.items():
        if not all(finite(p) for p in _local_parts(t)):
            bad += 1
            first = first or name
    return bad, first


def check_finite_state(ckpt_dir: Path, step: int, model_state: dict[str, Any], optimizer_state: dict[str, Any],
                       state: ParallelState) -> None:
    """Every rank checks its parameters and optimizer state (the state dicts about to be saved); any
    non-finite tensor stops the save on all ranks."""
    payload = {**{f"{MODEL}.{k}": v for k, v in model_state.items()},
               **{f"{OPTIMIZER}.{k}": v for k, v in optimizer_state.items()}}
    bad, first = _first_non_finite(payload)
    counts = torch.tensor([bad, len(payload)], dtype=torch.float64)
    if state.distributed:
        import torch.distributed as dist

        flags = counts.to(state.device)
        dist.all_reduce(flags)
        counts = flags.cpu()
        if int(counts[0]):
            names: list[Any] = [None] * state.world_size
            dist.all_gather_object(names, first)
            first = next(n for n in names if n)
    if int(counts[0]):
        latest = latest_name(ckpt_dir)
        raise TrainingError(
            f"after step {step}, {int(counts[0])} of {int(counts[1])} parameter and optimizer tensors are not finite "
            f"(first: {first}); this state was not saved and `latest` "
            + (f"still points at {latest}" if latest else "was not created"),
            hint="check training.lr and the optimizer settings (adam_eps > 0), then resume from the last good checkpoint",
        )


def _check_against_metadata(folder: Path, payload: dict[str, Any], metadata: Any) -> None:
    """Names, shapes and dtypes of what this model needs, then the shard files' sizes; first mismatch in one line."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    saved = metadata.state_dict_metadata
    for group, tensors in payload.items():
        for key, t in tensors.items():
            fqn = f"{group}.{key}"
            meta = saved.get(fqn)
            if meta is None:
                missing = [f"{g}.{k}" for g in payload for k in payload[g] if f"{g}.{k}" not in saved]
                raise CheckpointError(
                    f"{folder}: checkpoint lacks {len(missing)} tensors this model needs, e.g. {missing[0]}",
                    hint="resume with the same model architecture the checkpoint was trained with",
                )
            if not isinstance(t, torch.Tensor):
                continue
            if not isinstance(meta, TensorStorageMetadata):
                raise CheckpointError(f"{folder}: {fqn} is not a tensor in the checkpoint")
            if tuple(meta.size) != tuple(t.shape) or meta.properties.dtype != t.dtype:
                raise CheckpointError(
                    f"{folder}: tensor {fqn} is {list(meta.size)} {meta.properties.dtype} in the checkpoint, "
                    f"the model has {list(t.shape)} {t.dtype}",
                    hint="resume with the architecture and precision.params_dtype the checkpoint was trained with, "
                    "or start in a new checkpoint.dir",
                )
    check_storage_files(folder, metadata)


def load_checkpoint(
    folder: str | Path, *, model: torch.nn.Module, optimizer: Any, state: ParallelState
) -> dict[str, Any]:
    """Load model, optimizer and (same layout only) RNG in place; returns train_state.json."""
    import torch.distributed.checkpoint as dcp

    folder = Path(folder)
    meta = read_train_state(folder)
    # .metadata is a pickle: read once with dcp_io's allow-list, and handed to DCP by the storage reader
    metadata = read_metadata(folder)
    saved = metadata.state_dict_metadata
    payload: dict[str, Any] = {MODEL: _model_state(model), OPTIMIZER: optimizer.state_dict()}
    _check_against_metadata(folder, payload, metadata)
    # RNG streams belong to ranks: restored only when the layout is the same (else the seed's).
    same_layout = (meta.get("world_size") == state.world_size and meta.get("ep_size") == state.ep_size
                   and meta.get("pp_size", 1) == state.pp_size)
    rng = _rng_state(state)
    if same_layout and all(f"{RNG}.{k}" in saved for k in rng):
        payload[RNG] = rng
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        with quiet_single_process():
            dcp.load(payload, storage_reader=storage_reader(folder, metadata))
    except (Exception, CheckpointException) as exc:  # DCP wraps every rank's failure in one CheckpointException
        stop = interruption(exc)
        if stop is not None:
            raise stop from None
        raise CheckpointError(f"{folder}: cannot load checkpoint ({dcp_error(exc)})") from None
    if RNG in payload:
        torch.set_rng_state(payload[RNG][f"rank{state.rank}"])
        if f"rank{state.rank}.cuda" in payload[RNG]:
            torch.cuda.set_rng_state(payload[RNG][f"rank{state.rank}.cuda"])
    optimizer.after_load()
    return meta


__all__ = ["remove_partial_checkpoints", "prune_checkpoints", "check_finite_state", "save_checkpoint", "load_checkpoint", "latest_checkpoint", "LATEST", "TRAIN_STATE"]
