"""The pipeline layout (gptoss_cli/schedule/pipeline/layout.py): Megatron's layout grammar, stage cuts between
HF blocks only, which rank holds which stage, the schedules' requirements and their theory."""

from __future__ import annotations

import re

import pytest

from gptoss_cli.errors import ConfigError
from gptoss_cli.model.pattern import parse_pattern
from gptoss_cli.schedule.pipeline.layout import (
    BLOCK_RULE, balanced_layout, bubble_fraction, expand_layout, in_flight, pipeline_layout, schedule_problems,
)

P36 = parse_pattern("*E" * 36)  # GPT-OSS 120B
P24 = parse_pattern("*E" * 24)  # GPT-OSS 20B


def test_grammar_expands_repeats_groups_and_commas():
    assert expand_layout("Et*2|(tt|)*2,tL") == [["E", "t", "t"], ["t", "t"], ["t", "t"], ["t", "L"]]
    assert expand_layout("E|t|t||L") == [["E"], ["t"], ["t"], [], ["L"]]  # an empty stage is allowed


@pytest.mark.parametrize("text, words", [
    ("Et*2|tX", "unknown symbol 'X'"), ("Et*|tL", "without a count"), ("E(t|tL", "never closed"),
    ("Et)|tL", "without '('"), ("Et|m|tL", "no multi-token-prediction"),
])
def test_grammar_errors_name_the_position(text, words):
    with pytest.raises(ConfigError, match=re.escape(words)):
        expand_layout(text)


def test_even_split_and_megatron_bridge_h100_layout():
    layout = pipeline_layout(P36, 4)
    assert layout.text() == "Et*9|t*9|t*9|t*9L" and layout.source == "even"
    assert [s.layers for s in layout.stages] == [(0, 18), (18, 36), (36, 54), (54, 72)]
    assert [s.rank for s in layout.stages] == [0, 1, 2, 3]


def test_layout_places_fewer_blocks_on_the_ends():
    layout = pipeline_layout(P36, 4, layout="Et*8|t*10|t*10|t*8L")
    assert [s.num_blocks for s in layout.stages] == [8, 10, 10, 8]
    assert layout.stages[1].layers == (16, 36) and layout.stages[0].embedding and layout.stages[-1].loss


def test_interleaved_and_v_placement():
    loop = pipeline_layout(P24, 4, 2, "interleaved_1f1b")
    assert [s.rank for s in loop.stages] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert loop.rank_layers(0) == list(range(0, 6)) + list(range(24, 30))
    v = pipeline_layout(P24, 4, 2, "dualpipev")
    assert [s.rank for s in v.stages] == [0, 1, 2, 3, 3, 2, 1, 0]  # rank 0 holds the first and the last stage
    assert [(s.embedding, s.loss) for s in v.rank_stages(0)] == [(True, False), (False, True)]


def test_a_stage_boundary_never_separates_attention_from_its_moe_layer():
    with pytest.raises(ConfigError) as exc:
        pipeline_layout(parse_pattern("*E*|E*E"), 2)
    assert BLOCK_RULE in str(exc.value) and "layer 3" in str(exc.value)
    assert pipeline_layout(parse_pattern("*E*E|*E"), 2).text() == "Et*2|tL"


@pytest.mark.parametrize("kwargs, words", [
    (dict(pp=4), "do not divide into PP x VPP = 4"), (dict(pp=2, layout="Et|t|tL"), "has 3 stages"),
    (dict(pp=2, layout="Et*2|tL"), "places 3 decoder blocks"), (dict(pp=2, layout="tE|t*4L"), "must open"),
    (dict(pp=2, layout="Et*2|t*2"), "must close"),
])
def test_layout_errors(kwargs, words):
    with pytest.raises(ConfigError, match=words):
        pipeline_layout(parse_pattern("*E" * 6), **kwargs)


def test_a_suggested_layout_is_valid():
    text = balanced_layout(37, 8)
    assert pipeline_layout(parse_pattern("*E" * 37), 8, layout=text).text().count("t") > 0
    assert text.startswith("Et*4|") and text.endswith("|t*4L")  # the extra blocks go to the middle stages


def test_schedule_requirements():
    assert schedule_problems("1f1b", 4, None, 8) == []
    assert "1f1b needs at least PP=4" in schedule_problems("1f1b", 4, None, 2)[0][0]
    assert "VPP >= 2" in schedule_problems("interleaved_1f1b", 4, None, 8)[0][0]
    assert "exactly two stages" in schedule_problems("dualpipev", 4, 3, 8)[0][0]
    assert "2 x PP = 8" in schedule_problems("dualpipev", 4, 2, 4)[0][0]
    assert schedule_problems("interleaved_1f1b", 4, 2, 10) == []  # 2 rounds of 5: fine in torch
    assert schedule_problems("interleaved_1f1b", 4, 2, 9)[0][0].startswith("interleaved_1f1b needs the 9")


def test_bubble_theory():
    assert bubble_fraction("1f1b", 4, None, 32) == pytest.approx(3 / 35)  # (p-1)/(m+p-1)
    assert bubble_fraction("interleaved_1f1b", 4, 2, 32) == pytest.approx(1.5 / 33.5)
    # zero bubble: the deferred weight gradients fill the bubble, (p-1)(f+b-w)/v
    assert bubble_fraction("interleaved_zero_bubble", 4, None, 32, 1, 1, 1) == pytest.approx(3 / 99)
    assert bubble_fraction("1f1b", 1, None, 8) == 0.0


def test_microbatches_in_flight():
    assert [in_flight("1f1b", 4, None, 32, r) for r in range(4)] == [4, 3, 2, 1]
    assert in_flight("1f1b", 4, None, 2, 0) == 2  # never more than the step's microbatches
    # interleaved: torch's warm-up (v-1) x per-round + 2(p-1-rank) chunk forwards, plus one
    assert in_flight("interleaved_1f1b", 4, 2, 32, 0) == pytest.approx((4 + 6 + 1) / 2)
    assert in_flight("dualpipev", 4, 2, 32, 0) == 5


def test_bench_replay_of_1f1b_matches_the_closed_form():
    """bench/pipeline.py's event replay of torch's 1F1B order, equal stages and free communication: each
    rank idles (PP - 1)(f + b) of m (f + b) + (PP - 1)(f + b), the closed form."""
    from torch.distributed.pipelining.schedules import _Action

    from bench.pipeline import one_f_one_b_order, replay

    for pp, m in ((2, 8), (4, 8)):
        order = {r: [_Action.from_str(a) for a in acts] for r, acts in one_f_one_b_order(pp, m).items()}
        durations = {(s, k): t for s in range(pp) for k, t in (("F", 1.0), ("B", 2.0))}
        idle = replay(order, durations, pp)
        assert all(v == pytest.approx(bubble_fraction("1f1b", pp, None, m, 1.0, 2.0, 0.0)) for v in idle.values())


def test_absurd_sizes_are_refused_at_once():
    with pytest.raises(ConfigError, match="more than 4096"):
        pipeline_layout(P36, 2**31 - 1)
    with pytest.raises(ConfigError, match="expands to more than"):
        expand_layout("((t|)*1000000)*1000000")
