"""What a resumed run must agree with in the checkpoint it resumes from: its kind (LoRA or full) and base.

A LoRA run's frozen base is fingerprinted once on rank 0 (`lora_base`) and checked against the
base the checkpoint names (`check_resume_base`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch.distributed as dist

from gptoss_cli.checkpoint.training_format import RUN_KEY, base_fingerprint, read_train_state, require_same_base
from gptoss_cli.errors import CheckpointError
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


__all__ = ["lora_base", "check_resume_base"]
