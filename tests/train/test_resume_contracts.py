"""What a resume must refuse, field by field: every learning-rate schedule field the checkpoint recorded, min_lr
included (a cosine decay ends at it), compared through `check_resume_recipe` as `gptoss train` calls it."""

from __future__ import annotations

import pytest

from gptoss_cli.errors import ConfigError
from gptoss_cli.train.optimizer import WarmupCosineLR
from gptoss_cli.train.resume import check_resume_recipe
from tests.train.jobs import recipe_config

SAVED = recipe_config(lr=3e-4, min_lr=3e-5, warmup_iters=2, train_iters=10, lr_decay_style="cosine")


def _saved_state() -> dict:
    return {"step": 4, "lr_schedule": WarmupCosineLR.from_training(SAVED.training).state_dict()}


@pytest.mark.parametrize("field, value, key", [
    ("min_lr", 1e-5, "min_lr"), ("lr", 1e-3, "max_lr"), ("warmup_iters", 3, "warmup_iters"),
    ("train_iters", 20, "decay_iters"), ("lr_decay_style", "linear", "style"),
])
def test_a_resume_that_changes_a_schedule_field_is_refused_naming_it(tmp_path, field, value, key):
    changed = recipe_config(**{**dict(lr=3e-4, min_lr=3e-5, warmup_iters=2, train_iters=10,
                                      lr_decay_style="cosine"), field: value})
    with pytest.raises(ConfigError, match=rf"training\.{field}={value}.* gives {key} .*the checkpoint's {key} is"):
        check_resume_recipe(tmp_path, _saved_state(), changed)
    check_resume_recipe(tmp_path, _saved_state(), SAVED)  # the same schedule resumes
    changed.checkpoint.override_lr_schedule = True  # and the override lets the change through
    check_resume_recipe(tmp_path, _saved_state(), changed)
