"""Context-parallel checks before launch: the rules' boundaries, the memory estimate with CP, and the
one-line error of a CP size that does not divide the processes."""

from __future__ import annotations

import pytest

from gptoss_cli.errors import ConfigError
from gptoss_cli.parallel.state import init_parallel
from gptoss_cli.recipe.estimate import memory as M
from gptoss_cli.recipe.load import load_recipe
from tests.recipe.recipe_helpers import run_rule

CP2 = ["parallelism.context_parallel_size=2", "parallelism.world_size=4"]


def test_seq_divisible_by_cp_but_not_2cp_is_only_a_warning_for_megatron_ring_attention():
    (f,) = run_rule("parallel.context_parallel_seq", [*CP2, "training.seq_length=30"])
    assert f.severity == "warning" and "Megatron" in f.message
    (f,) = run_rule("parallel.context_parallel_seq", [*CP2, "training.seq_length=31"])
    assert f.severity == "error" and "seq_length=31" in f.message


def test_cp_up_to_the_kv_heads_and_no_further():
    """The tiny model has 6 heads and 2 kv heads: CP=2 is allowed, CP=3 and CP=6 are not (kv heads)."""
    assert run_rule("parallel.context_parallel_heads", CP2) == []
    for cp in (3, 6):
        (f,) = run_rule("parallel.context_parallel_heads", [f"parallelism.context_parallel_size={cp}",
                                                              f"parallelism.world_size={cp}"])
        assert f.severity == "error" and "num_key_value_heads=2" in f.message
    (f,) = run_rule("parallel.context_parallel_heads", ["parallelism.context_parallel_size=4",
                                                          "parallelism.world_size=4"])
    assert "num_attention_heads=6" in f.message and "num_key_value_heads=2" in f.message


def test_cp_with_the_overlap_schedule_is_an_error():
    (f,) = run_rule("parallel.context_parallel_combinations",
                    [*CP2, "moe.aux_loss_coeff=0", "overlap.overlap_moe_expert_parallel_comm=true"])
    assert "overlap.overlap_moe_expert_parallel_comm" in f.fields


def test_memory_estimate_divides_activations_by_cp_and_keeps_the_rest():
    r1 = load_recipe("gpt_oss_20b_sft_32k", ["parallelism.context_parallel_size=1"])
    r8 = load_recipe("gpt_oss_20b_sft_32k")
    e1 = M.estimate_memory(r1.config, r1.arch, r1.pattern, 8)
    e8 = M.estimate_memory(r8.config, r8.arch, r8.pattern, 8)
    assert e8.tokens_per_microbatch * 8 == e1.tokens_per_microbatch == 32768
    for key in ("activations.attention", "activations.moe", "activations.head"):
        assert e8.bytes_of(key) == pytest.approx(e1.bytes_of(key) / 8, rel=1e-12), key
    for key in ("params", "grads", "optimizer"):
        assert e8.bytes_of(key) == e1.bytes_of(key), key
    assert e8.total_bytes < 0.9 * 141e9 < e1.total_bytes  # CP is what makes 32k rows fit an H200


def test_cp_that_does_not_divide_the_processes_is_a_config_error():
    with pytest.raises(ConfigError, match="context_parallel_size=2 does not divide the world size 1"):
        init_parallel(1, "cpu", cp_size=2)
