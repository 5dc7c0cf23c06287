"""Every numeric recipe field has the range its consumer accepts, and validate-config (train's pre-launch
check runs the same rule) drives each field past it: a finding naming the field, never a traceback later."""

from __future__ import annotations

import dataclasses
import random
import typing

import pytest
import torch

from gptoss_cli.limits import INT32_MAX
from gptoss_cli.recipe import schema
from gptoss_cli.recipe.schema import SEED_MAX, iter_fields
from gptoss_cli.recipe.validate import validate_recipe
from gptoss_cli.recipe.load import load_recipe
from tests.recipe.recipe_helpers import run_rule


def _numeric(f: dataclasses.Field) -> type | None:
    names = {**vars(typing), **vars(schema)}  # a field's type may name a schema class (data.blend)
    tp = f.type if not isinstance(f.type, str) else eval(f.type, names)  # noqa: S307 - our own annotations
    args = [a for a in typing.get_args(tp) if a is not type(None)] or [tp]
    return args[0] if args[0] in (int, float) else None


NUMERIC = [(name, f, _numeric(f)) for name, f in iter_fields() if _numeric(f) is not None]
# (name, the largest accepted value, the smallest refused one)
BOUNDED = [(name, f.metadata["max"], f.metadata["max"] + 1 if kind is int else f.metadata["max"] * 1.5, kind)
           for name, f, kind in NUMERIC if "max" in f.metadata]
BOUNDED += [(name, f.metadata["below"] * (1 - 2**-20), f.metadata["below"], kind)
            for name, f, kind in NUMERIC if "below" in f.metadata]


def test_every_integer_field_has_a_maximum_and_a_minimum():
    ints = [name for name, _, kind in NUMERIC if kind is int]
    assert "training.seed" in ints and "training.seq_length" in ints
    assert [n for n, f, k in NUMERIC if k is int and ("max" not in f.metadata or "min" not in f.metadata)] == []


@pytest.mark.parametrize("name, largest, past, kind", BOUNDED, ids=[b[0] for b in BOUNDED])
def test_each_bounded_field_past_its_bound_is_a_field_range_error(name, largest, past, kind):
    findings = run_rule("field.range", [f"{name}={past}"])
    assert [f.fields for f in findings] == [{name: past}], findings
    assert run_rule("field.range", [f"{name}={largest}"]) == []


@pytest.mark.parametrize("value", ["100000000000000000000000", "1" + "0" * 3000])
def test_a_huge_seed_or_size_is_invalid_before_any_rule_does_arithmetic_on_it(value):
    for name in ("training.seed", "training.seq_length", "training.global_batch_size"):
        report = validate_recipe(load_recipe("tiny_cpu_ep2", [f"{name}={value}"]))
        assert [f.rule for f in report.findings] == ["field.range"] and report.skipped
        message = report.findings[0].message
        assert message.startswith(f"{name}=") and "above its maximum" in message and len(message) < 200, message


def test_no_rule_crashes_with_any_field_at_its_largest_value():
    for name, largest, _, kind in BOUNDED:
        report = validate_recipe(load_recipe("tiny_cpu_ep2", [f"{name}={largest}"]))
        crashed = [f.message for f in report.findings if "crashed" in f.message]
        assert crashed == [] and not any(f.rule == "field.range" for f in report.findings), (name, crashed)


def test_the_largest_seed_is_one_every_consumer_takes():
    from gptoss_cli.train.data import MockSource

    random.seed(SEED_MAX)
    torch.manual_seed(SEED_MAX)
    numpy = pytest.importorskip("numpy")
    numpy.random.seed(SEED_MAX)  # Megatron seeds numpy: its limit is the reason for SEED_MAX
    with pytest.raises(ValueError):
        numpy.random.seed(SEED_MAX + 1)
    # sample indices reach train_iters x global_batch_size
    assert MockSource(1003, 8, SEED_MAX).sample(INT32_MAX * INT32_MAX).shape == (9,)


@pytest.mark.parametrize("command", [["validate-config", "tiny_cpu_ep2", "--world-size"],
                                     ["train", "--recipe", "tiny_cpu_ep2", "--nproc-per-node"]])
def test_a_world_size_option_past_int32_is_one_line_before_any_work(command, tmp_path):
    from typer.testing import CliRunner

    from gptoss_cli.cli import app

    result = CliRunner().invoke(app, [*command, str(INT32_MAX + 1), f"logging.run_dir={tmp_path / 'run'}"])
    assert result.exit_code == 2, result.output
    assert f"world size {INT32_MAX + 1} must be an integer in [1, {INT32_MAX}]" in result.output, result.output
    assert not (tmp_path / "run").exists()
