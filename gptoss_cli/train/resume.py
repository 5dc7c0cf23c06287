"""What a resumed run must agree with in the checkpoint it resumes from: its kind and base, its schedule.

- A LoRA run's frozen base is fingerprinted once on rank 0 (`lora_base`) and checked against the
  base the checkpoint names (`check_resume_base`); a full fine-tune resumes a full checkpoint only.
- The learning-rate schedule (`check_resume_schedule`): a resume that would change the lr of a step
  already taken or to come (the two schedules' values compared step by step; a field such as
  train_iters or min_lr that moves no lr, as on a constant schedule, changes nothing) is refused
  with one line naming the field (training.lr, min_lr, warmup_iters, lr_decay_style, or the decay
  length: lr_decay_iters, else train_iters), both values and the first step whose lr differs,
  unless checkpoint.override_lr_schedule says to continue with the recipe's schedule (Megatron
  refuses the mismatch too, and has `--override-opt_param-scheduler` for the same purpose). More
  train_iters on a decaying schedule keeps it with training.lr_decay_iters at the checkpoint's
  decay length (the hint says so).
- The data (`check_resume_data`): another data.kind, data.path or data.blend than the checkpoint's
  run record is refused like the schedule, unless checkpoint.override_data: the data position
  (consumed_samples) would otherwise carry on silently into other files.
- A LoRA run's adapters (`check_resume_lora`): another lora.target_modules (the new `latest` would
  silently drop the other adapters), rank or alpha (another scaling of the same tensors) than the
  checkpoint's run record is refused with one line naming the field and both values.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import torch.distributed as dist

from gptoss_cli.checkpoint.formats.training.record import RUN_KEY, base_fingerprint, read_train_state, require_same_base
from gptoss_cli.errors import CheckpointError, ConfigError
from gptoss_cli.parallel.state import ParallelState
from gptoss_cli.recipe.schema import RecipeConfig


def lora_base(cfg: RecipeConfig, state: ParallelState) -> dict[str, Any] | None:
    """The fingerprint of a LoRA run's frozen base (checkpoint.pretrained), hashed once on rank 0 and
    shared, so every rank records and checks the same one; None without LoRA."""
    if cfg.lora.rank == 0:
        return None
    record = [base_fingerprint(cfg.checkpoint.pretrained) if state.rank == 0 else None]
    if state.distributed:
        dist.broadcast_object_list(record, src=0)
    return record[0]


def check_resume_base(folder: Path, lora_base: dict[str, Any] | None) -> None:
    """Resuming a LoRA run needs a LoRA checkpoint of the same base (and a full run a full checkpoint)."""
    saved = read_train_state(folder).get(RUN_KEY)
    saved_lora = saved.get("lora") if isinstance(saved, dict) else None
    if (saved_lora is None) != (lora_base is None):
        what = "LoRA adapters" if saved_lora is not None else "a full fine-tune (no adapters)"
        raise CheckpointError(
            f"{folder}: holds {what}, but this run is {'a LoRA run' if lora_base else 'a full fine-tune'}",
            hint="resume with the recipe that wrote it, or start in a new checkpoint.dir")
    if lora_base is not None:
        require_same_base(saved_lora.get("base") if isinstance(saved_lora, dict) else None, lora_base, folder)


def _schedule_fields(cfg: RecipeConfig) -> list[tuple[str, str]]:
    """(key of the saved lr_schedule, the recipe field that sets it) for every field of the schedule."""
    t = cfg.training
    decay = "training.lr_decay_iters" if t.lr_decay_iters is not None else "training.train_iters"
    return [("max_lr", "training.lr"), ("warmup_iters", "training.warmup_iters"), ("style", "training.lr_decay_style"),
            ("min_lr", "training.min_lr"), ("decay_iters", decay)]


def first_changed_step(was: Any, now: Any, steps: int) -> int | None:
    """The first 0-based step below `steps` whose lr differs between the schedules `was` and `now`, or None.
    Both compute lr_at with the same formula: equal inputs give equal floats, so a difference beyond a
    relative 1e-12 (a few ulps of rearranged arithmetic) is a real change."""
    for s in range(steps):
        if not math.isclose(was.lr_at(s), now.lr_at(s), rel_tol=1e-12, abs_tol=0.0):
            return s
    return None


def check_resume_schedule(folder: Path, saved: dict[str, Any] | None, current: Any, cfg: RecipeConfig,
                          step: int) -> None:
    """Refuse a resume that would change the learning rate of a step already taken or to come (see the
    module docstring): the two schedules' values are compared at every step up to the longer of the
    checkpoint's `step` and training.train_iters, so a change that moves no lr (more steps on a
    constant schedule, min_lr of a constant one) resumes. `saved`: the checkpoint's train_state.json
    `lr_schedule` (None in checkpoints that predate it: nothing to compare); `current`: the recipe's
    WarmupCosineLR; `step`: the resume step."""
    if not isinstance(saved, dict) or cfg.checkpoint.override_lr_schedule:
        return
    mine = current.state_dict()
    was = type(current).from_state_dict({k: saved.get(k, v) for k, v in mine.items()})
    if was.state_dict() == mine:
        return
    changed = first_changed_step(was, current, max(step, cfg.training.train_iters))
    if changed is None:
        return
    key, name = next((k, n) for k, n in _schedule_fields(cfg) if not _same(was.state_dict()[k], mine[k]))
    theirs = was.state_dict()[key]
    raise ConfigError(
        f"{folder}: resuming would change the learning-rate schedule: {name}={_recipe_value(cfg, name)} gives "
        f"{key} {mine[key]}, the checkpoint's {key} is {theirs} (lr of step {changed + 1}: "
        f"{was.lr_at(changed):.3g} in the checkpoint's schedule, {current.lr_at(changed):.3g} in this one)",
        hint=_schedule_hint(was, cfg, name, key, step))


def _schedule_hint(was: Any, cfg: RecipeConfig, name: str, key: str, step: int) -> str:
    override = "checkpoint.override_lr_schedule=true to continue with this recipe's schedule"
    if key == "decay_iters" and name == "training.train_iters" and cfg.training.train_iters > step:
        return (f"to train longer on the checkpoint's schedule, keep its decay length: training.lr_decay_iters="
                f"{was.decay_iters} (the steps after it run at min_lr {was.min_lr:g}); or set {override}")
    return f"resume with the checkpoint's {name}, or set {override}"


def check_resume_lora(folder: Path, saved: Any, cfg: RecipeConfig) -> None:
    """Refuse a LoRA resume whose lora.target_modules, rank or alpha differ from the checkpoint's run
    record `saved` (its `run.lora`). A full fine-tune on either side is check_resume_base's to refuse."""
    lo = cfg.lora
    if not isinstance(saved, dict) or lo.rank == 0:
        return
    fields = [("target_modules", list(lo.target_modules), saved.get("target_modules")),
              ("rank", lo.rank, saved.get("rank")), ("alpha", float(lo.alpha), saved.get("alpha"))]
    for name, mine, theirs in fields:
        if theirs is None:
            continue
        # the order of the targets is only the order they are listed in
        same = (sorted(mine) == sorted(map(str, theirs)) if isinstance(theirs, list) and name == "target_modules"
                else _same(mine, theirs))
        if not same:
            raise ConfigError(
                f"{folder}: resuming would change the LoRA adapters: lora.{name}={mine}, the checkpoint's "
                f"lora.{name} is {theirs}",
                hint=f"resume with the checkpoint's lora.{name}, or start in a new checkpoint.dir")


def check_resume_recipe(folder: Path, saved: dict[str, Any], cfg: RecipeConfig) -> None:
    """What the recipe may not change in a resume from `folder` (its train_state.json `saved`): the LoRA
    settings, the lr schedule, and the data (kind, path or blend: train/blend.py)."""
    from gptoss_cli.train.blend import check_same_blend  # noqa: PLC0415
    from gptoss_cli.train.optimizer import WarmupCosineLR  # noqa: PLC0415

    run = saved.get(RUN_KEY)
    check_resume_lora(folder, run.get("lora") if isinstance(run, dict) else None, cfg)
    check_resume_schedule(folder, saved.get("lr_schedule"), WarmupCosineLR.from_training(cfg.training), cfg,
                          int(saved.get("step", 0)))
    check_resume_data(folder, saved, cfg)
    blend = saved.get("blend")
    if isinstance(blend, dict) and cfg.data.blend and not cfg.checkpoint.override_data:
        check_same_blend(blend.get("files"), [{"path": b.path, "weight": float(b.weight)} for b in cfg.data.blend],
                         folder)


def _data_source(data: Any) -> tuple[str, Any] | None:
    """What a run trains on, from a recipe's data section (the typed one, or the run record's plain copy):
    ("data.kind", "mock"), ("data.path", path) or ("data.blend", [(path, weight), ...]); None when unknown."""
    get = data.get if isinstance(data, dict) else (lambda key: getattr(data, key, None))
    kind = get("kind")
    if kind == "mock":
        return "data.kind", "mock"
    if kind != "tokens":
        return None
    blend = get("blend") or []
    if blend:
        pairs = [(b.get("path"), b.get("weight")) if isinstance(b, dict) else (b.path, b.weight) for b in blend]
        return "data.blend", [(str(p), float(w)) for p, w in pairs]
    return "data.path", get("path")


def _same_path(a: Any, b: Any) -> bool:
    """Two spellings of one token file prefix: equal once normalised, or the same place from here."""
    if not isinstance(a, str) or not isinstance(b, str):
        return a == b
    if os.path.normpath(a) == os.path.normpath(b):
        return True
    try:
        return Path(a).expanduser().resolve() == Path(b).expanduser().resolve()
    except (OSError, ValueError, RuntimeError):
        return False


def _same_source(a: tuple[str, Any], b: tuple[str, Any]) -> bool:
    if a[0] != b[0]:
        return False
    if a[0] == "data.blend":
        return len(a[1]) == len(b[1]) and all(_same_path(p, q) and float(w) == float(v)
                                              for (p, w), (q, v) in zip(a[1], b[1]))
    return _same_path(a[1], b[1])


def check_resume_data(folder: Path, saved: dict[str, Any], cfg: RecipeConfig) -> None:
    """Refuse a resume on other data than the checkpoint's run trained on (its run record's data.kind,
    data.path or data.blend), unless checkpoint.override_data: "resume" means this run carried on, and
    the data position (consumed_samples) would silently index into another file."""
    run = saved.get(RUN_KEY)
    recipe = run.get("recipe") if isinstance(run, dict) else None
    theirs = _data_source(recipe.get("data")) if isinstance(recipe, dict) else None
    mine = _data_source(cfg.data)
    if theirs is None or mine is None or cfg.checkpoint.override_data or _same_source(theirs, mine):
        return
    field = "data.kind" if "data.kind" in (mine[0], theirs[0]) else mine[0]
    shown = {"data.kind": lambda v: v, "data.path": lambda v: v,
             "data.blend": lambda v: "[" + ", ".join(f"{p} x {w:g}" for p, w in v) + "]"}
    what = "mock data" if theirs[0] == "data.kind" else f"{theirs[0]}={shown[theirs[0]](theirs[1])}"
    now = "mock data" if mine[0] == "data.kind" else f"{mine[0]}={shown[mine[0]](mine[1])}"
    raise ConfigError(
        f"{folder}: resuming would change the data: {field} differs from the checkpoint's (it trained on {what}, "
        f"this recipe trains on {now})",
        hint=f"resume with the checkpoint's data, start a new checkpoint.dir, or set checkpoint.override_data=true to "
             f"carry on with this data from the checkpoint's position (consumed_samples)")


def check_resume_point(cfg: RecipeConfig) -> tuple[Path, dict[str, Any]] | None:
    """Before any worker starts: when the run will resume (checkpoint.dir has a `latest`), the recipe
    agrees with that checkpoint (`check_resume_recipe`); returns (that checkpoint, its train state), or None."""
    from gptoss_cli.train.checkpointing import latest_checkpoint  # noqa: PLC0415

    ckpt = cfg.checkpoint
    folder = latest_checkpoint(ckpt.dir) if ckpt.dir and ckpt.resume else None
    if folder is None:
        return None
    saved = read_train_state(folder)
    check_resume_recipe(folder, saved, cfg)
    return folder, saved


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return float(a) == float(b)
    return a == b


def _recipe_value(cfg: RecipeConfig, dotted: str) -> Any:
    section, name = dotted.split(".")
    return getattr(getattr(cfg, section), name)


__all__ = ["lora_base", "check_resume_base", "check_resume_lora", "check_resume_schedule", "check_resume_recipe", "check_resume_point",
           "check_resume_data", "first_changed_step"]
