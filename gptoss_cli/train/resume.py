"""What a resumed run must agree with in the checkpoint it resumes from: its kind and base, its schedule.

- A LoRA run's frozen base is fingerprinted once on rank 0 (`lora_base`) and checked against the
  base the checkpoint names (`check_resume_base`); a full fine-tune resumes a full checkpoint only.
- The learning-rate schedule (`check_resume_schedule`): a resume that would change it (training.lr,
  min_lr, warmup_iters, lr_decay_style, or the decay length: lr_decay_iters, else train_iters) is
  refused with one line naming the field and both values, unless checkpoint.override_lr_schedule
  says to continue with the recipe's schedule (Megatron refuses the mismatch too, and has
  `--override-opt_param-scheduler` for the same purpose).
- A LoRA run's adapters (`check_resume_lora`): another lora.target_modules (the new `latest` would
  silently drop the other adapters), rank or alpha (another scaling of the same tensors) than the
  checkpoint's run record is refused with one line naming the field and both values.
"""

from __future__ import annotations

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
    """(key of the saved lr_schedule, the recipe field that sets it) for what shapes the lr from here on."""
    t = cfg.training
    fields = [("max_lr", "training.lr"), ("warmup_iters", "training.warmup_iters"), ("style", "training.lr_decay_style")]
    if t.lr_decay_style != "constant":
        decay = "training.lr_decay_iters" if t.lr_decay_iters is not None else "training.train_iters"
        fields += [("min_lr", "training.min_lr"), ("decay_iters", decay)]
    return fields


def check_resume_schedule(folder: Path, saved: dict[str, Any] | None, current: Any, cfg: RecipeConfig,
                          step: int) -> None:
    """Refuse a resume whose learning-rate schedule differs from the checkpoint's (see the module
    docstring). `saved`: the checkpoint's train_state.json `lr_schedule` (None in checkpoints that
    predate it: nothing to compare); `current`: the recipe's WarmupCosineLR; `step`: the resume step."""
    if not isinstance(saved, dict) or cfg.checkpoint.override_lr_schedule:
        return
    mine = current.state_dict()
    if saved.get("style") == "constant" and mine["style"] == "constant":
        keys = [k for k in _schedule_fields(cfg) if k[0] in ("max_lr", "warmup_iters", "style")]
    else:
        keys = _schedule_fields(cfg)
    for key, name in keys:
        theirs = saved.get(key)
        if theirs is None or _same(theirs, mine[key]):
            continue
        was = type(current).from_state_dict({k: saved.get(k, v) for k, v in mine.items()})
        lr_then, lr_now = was.lr_at(step), current.lr_at(step)
        raise ConfigError(
            f"{folder}: resuming would change the learning-rate schedule: {name}={_recipe_value(cfg, name)} gives "
            f"{key} {mine[key]}, the checkpoint's {key} is {theirs} (lr of step {step + 1}: {lr_then:.3g} in the "
            f"checkpoint's schedule, {lr_now:.3g} in this one)",
            hint=f"resume with the checkpoint's {name}, or set checkpoint.override_lr_schedule=true to continue with "
                 "this recipe's schedule")


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
    settings, the lr schedule, and the data blend (train/blend.py)."""
    from gptoss_cli.train.blend import check_same_blend  # noqa: PLC0415
    from gptoss_cli.train.optimizer import WarmupCosineLR  # noqa: PLC0415

    run = saved.get(RUN_KEY)
    check_resume_lora(folder, run.get("lora") if isinstance(run, dict) else None, cfg)
    check_resume_schedule(folder, saved.get("lr_schedule"), WarmupCosineLR.from_training(cfg.training), cfg,
                          int(saved.get("step", 0)))
    blend = saved.get("blend")
    if isinstance(blend, dict) and cfg.data.blend:
        check_same_blend(blend.get("files"), [{"path": b.path, "weight": float(b.weight)} for b in cfg.data.blend],
                         folder)


def check_resume_point(cfg: RecipeConfig) -> None:
    """Before any worker starts: when the run will resume (checkpoint.dir has a `latest`), the recipe
    agrees with that checkpoint (`check_resume_recipe`)."""
    from gptoss_cli.train.checkpointing import latest_checkpoint  # noqa: PLC0415

    ckpt = cfg.checkpoint
    folder = latest_checkpoint(ckpt.dir) if ckpt.dir and ckpt.resume else None
    if folder is not None:
        check_resume_recipe(folder, read_train_state(folder), cfg)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return float(a) == float(b)
    return a == b


def _recipe_value(cfg: RecipeConfig, dotted: str) -> Any:
    section, name = dotted.split(".")
    return getattr(getattr(cfg, section), name)


__all__ = ["lora_base", "check_resume_base", "check_resume_lora", "check_resume_schedule", "check_resume_recipe", "check_resume_point"]
