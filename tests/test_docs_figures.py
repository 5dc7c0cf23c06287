"""Figures and claims in docs/ that the code computes, read back from the code (issue 53: docs drifted): the
per-pipeline-rank memory pipeline-parallel.md quotes for h100_pp4_ep8 is validate-config's estimate, and the
aux-loss coefficient sft-training.md gives the SFT recipes is theirs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from gptoss_cli.recipe.load import available_recipes, load_recipe
from gptoss_cli.recipe.validate import validate_recipe

DOCS = Path(__file__).resolve().parent.parent / "docs"


def _text(name: str) -> str:
    return " ".join((DOCS / name).read_text().split())


def test_pipeline_parallel_quotes_every_ranks_memory_as_validate_config_estimates_it():
    quoted = re.search(r"`h100_pp4_ep8`: ([\d.]+) GB on the first rank, ([\d.]+), ([\d.]+) and ([\d.]+) GB on the "
                       r"others", _text("pipeline-parallel.md"))
    assert quoted, "pipeline-parallel.md no longer quotes h100_pp4_ep8's memory per rank"
    stages = validate_recipe(load_recipe("h100_pp4_ep8")).memory.stages
    assert [float(q) for q in quoted.groups()] == [round(s["total_bytes"] / 1e9, 1) for s in stages]


def test_sft_training_gives_the_sft_recipes_aux_loss_coefficient():
    said = re.search(r"`moe\.aux_loss_coeff`, ([\d.]+) in the SFT recipes", _text("sft-training.md"))
    assert said, "sft-training.md no longer says the SFT recipes' aux-loss coefficient"
    sft = [n for n in available_recipes() if "sft" in n]
    assert sft and {n: load_recipe(n).config.moe.aux_loss_coeff for n in sft} == {n: float(said.group(1)) for n in sft}
