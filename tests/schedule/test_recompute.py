"""Activation recompute (gptoss_cli/model/recompute.py) changes memory, not results: at EP=2 on 2 gloo
processes in fp32, one step's gradients under each recompute setting equal those without, with the
overlap schedule and delayed wgrad on (selective) and in the plain schedule (full); the recomputed
pieces really run again, and selective pieces never repeat an all-to-all.

Exact equality is the bound: a recompute runs the same CPU kernels on the same inputs in the same
order as the forward it replaces, so every saved tensor it rebuilds is bitwise the original, and the
backward that reads it is the same computation."""

from __future__ import annotations

import torch

from tests.schedule.recompute_workers import recompute_worker
from tests.train.dist_helpers import run_distributed

PATTERN = "*E*-*E"  # attention, MoE and a dense layer: every selective module has a layer


def _assert_same(runs: dict, name: str, rank: int) -> None:
    base, other = runs["none"], runs[name]
    assert other["loss_sums"] == base["loss_sums"], (name, rank)
    assert base["grads"].keys() == other["grads"].keys()
    for key, g in base["grads"].items():
        assert torch.equal(other["grads"][key], g), (name, rank, key, (other["grads"][key] - g).abs().max())


def test_selective_recompute_in_the_overlap_schedule_with_delayed_wgrad(tmp_path):
    ranks = run_distributed(recompute_worker, 2, tmp_path, 2, True, PATTERN, ["none", "selective", "selective_moe"],
                            timeout=300)
    for rank, runs in enumerate(ranks):
        assert {r["schedule"] for r in runs.values()} == {"forward_backward_combined_1f1b"}
        for name in ("selective", "selective_moe"):
            _assert_same(runs, name, rank)
        none, sel, moe = (runs[n]["calls"] for n in ("none", "selective", "selective_moe"))
        # what ran again: the attention core and the activation once more per call; each norm twice more
        # (the checkpointed norm's own backward, and its discarded output rebuilt for the GEMM)
        assert sel["sink_attention"] == 2 * none["sink_attention"]
        assert sel["clamped_swiglu"] == none["clamped_swiglu"] + none["clamped_swiglu"] * 2 // 3  # 2 of 3 are experts
        assert sel["qkv_norm"] == 3 * none["qkv_norm"]
        # moe + mlp: every SwiGLU (experts and the dense layer) runs twice; attention not again
        assert moe["clamped_swiglu"] == 2 * none["clamped_swiglu"] and moe["sink_attention"] == none["sink_attention"]
        # never a second all-to-all for a selective piece
        assert sel["all_to_all"] == moe["all_to_all"] == none["all_to_all"] > 0


def test_full_recompute_in_the_plain_schedule_repeats_the_layers(tmp_path):
    ranks = run_distributed(recompute_worker, 2, tmp_path, 2, False, PATTERN, ["none", "full_uniform", "full_block"],
                            timeout=300)
    for rank, runs in enumerate(ranks):
        assert {r["schedule"] for r in runs.values()} == {"forward_backward_no_pipelining"}
        for name in ("full_uniform", "full_block"):
            _assert_same(runs, name, rank)
        none, uni, block = (runs[n]["calls"] for n in ("none", "full_uniform", "full_block"))
        # uniform 2: every layer runs twice; block 3: layers 0-2 (*, E, *) twice, 3-5 (-, *, E) once,
        # so 2 of the 3 attention layers run twice
        assert uni["sink_attention"] == 2 * none["sink_attention"]
        assert uni["clamped_swiglu"] == 2 * none["clamped_swiglu"]
        assert block["sink_attention"] == none["sink_attention"] // 3 * 5
        # full recompute of an E layer repeats its all-to-alls (docs/recompute.md)
        assert uni["all_to_all"] > none["all_to_all"] and block["all_to_all"] > none["all_to_all"]


def test_bad_recompute_settings_exit_1_before_any_process_starts(tmp_path):
    from typer.testing import CliRunner

    from gptoss_cli.cli import app

    full = ["recompute.recompute_granularity=full", "recompute.recompute_method=block"]
    cases = [
        ([*full, "recompute.recompute_num_layers=7"], "recompute.layers"),  # tiny has 6 hybrid layers
        ([*full, "recompute.recompute_num_layers=1", "overlap.overlap_moe_expert_parallel_comm=true",
          "overlap.delay_wgrad_compute=true"], "overlap.recompute"),  # full repeats the all-to-all
        (["recompute.recompute_granularity=selective"], "recompute.settings"),  # no modules: nothing to do
    ]
    for overrides, rule in cases:
        result = CliRunner().invoke(app, ["train", "--recipe", "tiny_cpu_ep2", *overrides,
                                          f"logging.run_dir={tmp_path}", "checkpoint.dir=null",
                                          "checkpoint.save_interval=null"])
        assert result.exit_code == 1, (rule, result.output)
        assert rule in result.output and "Traceback" not in result.output
        assert not (tmp_path / "metrics.jsonl").exists()
    # an unknown module is a malformed recipe: one line naming the field and the value, exit 2
    result = CliRunner().invoke(app, ["validate-config", "tiny_cpu_ep2", "recompute.recompute_granularity=selective",
                                      "recompute.recompute_modules=[attention]"])
    assert result.exit_code == 2 and "recompute.recompute_modules" in result.output and "attention" in result.output
