"""The expert naming rule (model/expert_names.py) against the converter's own spelling of every name and
against the layouts expert parallelism builds."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from gptoss_cli.checkpoint.mapping import units
from gptoss_cli.model.config import preset
from gptoss_cli.model.expert_names import ep_slice, expert_name, is_expert_name, parse_expert_name
from gptoss_cli.model.hybrid import HybridModel
from gptoss_cli.model.lora import LoraSettings, adapter_tensors, attach_lora

TINY = preset("tiny")


def test_every_name_of_the_conversion_table_parses_back():
    # checkpoint/mapping.py spells the Hybrid names with its own `{e}` templates: the per-expert ones
    # parse to (stack, global id) and format back, every other name is not an expert's.
    for unit in units(TINY):
        for e, name in enumerate(unit.hybrid):
            parsed = parse_expert_name(name)
            assert is_expert_name(name) == unit.per_expert, name
            if not unit.per_expert:
                assert parsed is None, name
                continue
            assert parsed is not None and parsed.expert == e and parsed.is_base, name
            assert expert_name(parsed.stack, parsed.expert) == name
            assert parsed.experts == name.rsplit(".", 2)[0] and parsed.module in ("linear_fc1", "linear_fc2")


def test_the_stacks_are_the_models_expert_parameters():
    model = HybridModel(TINY, device="meta")
    attach_lora(model, LoraSettings(rank=2, alpha=4.0))
    stacks = {n for n in dict(model.named_parameters()) if is_expert_name(n)}
    names = set(model.checkpoint_names()) | set(adapter_tensors(model))
    parsed = {n: parse_expert_name(n) for n in names}
    assert {p.stack for p in parsed.values() if p is not None} == stacks  # base weights, biases, LoRA factors
    assert {n for n, p in parsed.items() if p is None} == {n for n in names if not is_expert_name(n)}
    factor = parse_expert_name("decoder.layers.1.mlp.experts.linear_fc1.adapter.linear_in.weight3")
    assert (factor.module, factor.kind, factor.expert, factor.is_base) == ("linear_fc1.adapter.linear_in", "weight", 3,
                                                                          False)


@pytest.mark.parametrize("num_experts,ep", [(4, 1), (4, 2), (4, 4), (32, 8), (128, 16)])
def test_ep_slices_partition_the_experts_in_rank_order(num_experts, ep):
    held = [ep_slice(num_experts, ep, r) for r in range(ep)]
    assert [e for block in held for e in block] == list(range(num_experts))
    assert len({len(block) for block in held}) == 1


def test_every_ep_layout_saves_the_names_of_the_whole_model():
    whole = HybridModel(TINY, device="meta").checkpoint_names()
    for ep in (2, 4):
        saved: list[str] = []
        for r in range(ep):
            held = ep_slice(TINY.num_local_experts, ep, r)
            part = HybridModel(TINY, expert_offset=held.start, num_local_experts=len(held), device="meta")
            saved += [n for n in part.state_dict() if n not in saved]
        assert sorted(saved) == sorted(whole)


def test_no_other_module_spells_the_rule_as_a_regex():
    # The rule used to be re-derived as regexes in five modules; a new one would drift from it.
    package = Path(__file__).resolve().parents[2] / "gptoss_cli"
    found = []
    for path in package.rglob("*.py"):
        if path.name == "expert_names.py" and path.parent.name == "model":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            func = getattr(node, "func", None)
            if (isinstance(func, ast.Attribute) and getattr(func.value, "id", None) == "re" and node.args
                    and isinstance(node.args[0], ast.Constant) and "experts" in str(node.args[0].value)):
                found.append(f"{path.relative_to(package)}:{node.lineno}")
    assert found == []
