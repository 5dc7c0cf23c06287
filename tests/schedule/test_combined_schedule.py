"""The combined-1F1B schedule in one process: op interleaving, the schedule seam, finalisation, delayed wgrad."""

from __future__ import annotations

import pytest
import torch

from gptoss_cli.errors import ConfigError, TrainingError
from gptoss_cli.model.gemm.grouped import WgradQueue, grouped_linear
from gptoss_cli.parallel.state import ParallelState
from gptoss_cli.schedule import get_forward_backward_func
from gptoss_cli.schedule.combined_1f1b import FINISH, RUN, START, forward_backward_combined_1f1b, run_interleaved
from gptoss_cli.schedule.plain import forward_backward_no_pipelining
from gptoss_cli.train.data import DataLoaderState
from gptoss_cli.train.objective import forward_step
from tests.schedule.workers import SEQ, TINY, build
from tests.tolerances import assert_tensors_close, reassociation_rel
from tests.train.dist_helpers import named_grads
from tests.train.workers import RandomTokens, ToyConfig, ToyModel


# --- interleaving ---------------------------------------------------------------------------
def test_comm_of_one_stream_is_in_flight_while_the_other_computes():
    trace: list[str] = []

    def op(kind, label):
        return kind, lambda: trace.append(label)

    forward = [op(RUN, "F attn"), op(START, "F dispatch issued"), op(FINISH, "F dispatch waited"), op(RUN, "F experts")]
    backward = [op(START, "B combine issued"), op(FINISH, "B combine waited"), op(RUN, "B experts")]
    run_interleaved(forward, backward)
    assert trace == ["B combine issued", "F attn", "F dispatch issued", "B combine waited", "B experts",
                     "F dispatch waited", "F experts"]


def test_with_nothing_in_flight_the_stream_nearer_its_all_to_all_computes_first():
    # The backward reaches its all-to-all after one op, the forward after two: running the backward
    # first puts communication on the link one op earlier, and the forward's ops then hide it.
    trace: list[str] = []

    def op(kind, label):
        return kind, lambda: trace.append(label)

    forward = [op(RUN, "F embed"), op(RUN, "F attn"), op(START, "F dispatch issued"), op(FINISH, "F dispatch waited")]
    backward = [op(RUN, "B loss"), op(START, "B combine issued"), op(FINISH, "B combine waited"), op(RUN, "B experts")]
    run_interleaved(forward, backward)
    assert trace == ["B loss", "B combine issued", "F embed", "F attn", "F dispatch issued", "B combine waited",
                     "B experts", "F dispatch waited"]


# --- the schedule seam and its contract -------------------------------------------------------
def _setup(overlap: bool, pattern: str = "*E*E*E"):
    return build(ParallelState(), overlap=overlap, pattern=pattern)


def _data(seed: int = 5):
    return DataLoaderState(RandomTokens(TINY.vocab_size, SEQ, seed=seed), global_batch_size=6, micro_batch_size=2,
                           dp_rank=0, dp_size=1)


def test_overlap_config_selects_the_combined_schedule():
    assert get_forward_backward_func(_setup(True).config) is forward_backward_combined_1f1b
    assert get_forward_backward_func(_setup(False).config) is forward_backward_no_pipelining


def test_same_losses_and_grads_as_plain_and_one_finalisation_per_step():
    results = {}
    for overlap in (False, True):
        setup = _setup(overlap, "[*E][*E][*E]")
        calls = []
        finalize = setup.config.finalize_model_grads_func
        setup.config.finalize_model_grads_func = lambda chunks, tokens, _f=finalize: (calls.append(float(tokens)),
                                                                                       _f(chunks, tokens))
        data = _data()
        setup.model.zero_grad_buffer()
        logs = get_forward_backward_func(setup.config)(forward_step_func=forward_step, data_iterator=data.step_iterator(),
                                                       model=setup.model, num_microbatches=3)
        assert calls == [3 * 2 * SEQ]  # once, after all microbatches, with the step's token count
        results[overlap] = ([float(l["loss_sum"]) for l in logs], named_grads(setup.model))
    (plain_losses, plain_grads), (losses, grads) = results[False], results[True]
    depth = 2 * TINY.num_hidden_layers + 1  # error model: tests/tolerances.py
    assert losses == pytest.approx(plain_losses, rel=reassociation_rel(TINY.hidden_size, depth))
    assert_tensors_close(grads, plain_grads, reassociation_rel(6 * SEQ, depth))


def test_forward_only_never_finalises():
    setup = _setup(True)
    calls = []
    setup.config.finalize_model_grads_func = lambda *a: calls.append(a)
    with torch.no_grad():
        logs = forward_backward_combined_1f1b(forward_step_func=forward_step, data_iterator=_data().step_iterator(),
                                              model=setup.model, num_microbatches=3, forward_only=True)
    assert len(logs) == 3 and calls == []


def test_model_without_build_schedule_plan_is_a_clear_error():
    model = ToyModel(ToyConfig(overlap_moe_expert_parallel_comm=True, finalize_model_grads_func=lambda *a: None))
    with pytest.raises(ConfigError, match="no build_schedule_plan") as exc:
        forward_backward_combined_1f1b(forward_step_func=lambda it, m: m(1.0), data_iterator=iter([None]),
                                       model=model, num_microbatches=1)
    assert "overlap.overlap_moe_expert_parallel_comm=false" in exc.value.hint


# --- delayed weight gradients -----------------------------------------------------------------
def _expert_linear_case():
    g = torch.Generator().manual_seed(0)
    counts = torch.tensor([3, 0, 5])
    x = torch.randn(8, 16, generator=g, requires_grad=True)
    w = torch.nn.Parameter(torch.randn(3, 12, 16, generator=g))
    b = torch.nn.Parameter(torch.randn(3, 12, generator=g))
    dy = torch.randn(8, 12, generator=g)
    return counts, x, w, b, dy


def test_delayed_linear_gives_dx_now_and_dw_only_when_the_queue_runs():
    counts, x, w, b, dy = _expert_linear_case()
    grouped_linear(x, w, b, counts).backward(dy)
    ref = (x.grad.clone(), w.grad.clone(), b.grad.clone())
    x.grad = w.grad = b.grad = None

    queue = WgradQueue()
    grouped_linear(x, w, b, counts, wgrad_queue=queue).backward(dy)
    torch.testing.assert_close(x.grad, ref[0])
    assert w.grad is None and b.grad is None and len(queue) == 1
    w.main_grad = torch.zeros_like(w)  # the training buffers: dW lands in main_grad
    assert queue.execute() == 1 and len(queue) == 0
    torch.testing.assert_close(w.main_grad, ref[1])
    torch.testing.assert_close(b.grad, ref[2])
    queue.finish_step()  # empty: no error


def test_queued_wgrad_left_unconsumed_raises_at_the_end_of_the_step():
    counts, x, w, b, dy = _expert_linear_case()
    queue = WgradQueue()
    grouped_linear(x, w, b, counts, wgrad_queue=queue, name="decoder.layers.1.mlp.experts.linear_fc1").backward(dy)
    with pytest.raises(TrainingError, match=r"1 delayed weight-gradient GEMMs .* never run .*layers\.1\.mlp\.experts"):
        queue.finish_step()


def test_schedule_that_skips_the_queued_wgrad_fails_instead_of_losing_gradients(monkeypatch):
    monkeypatch.setattr(WgradQueue, "execute", lambda self: 0)
    setup = _setup(True)
    with pytest.raises(TrainingError, match="never run"):
        forward_backward_combined_1f1b(forward_step_func=forward_step, data_iterator=_data().step_iterator(),
                                       model=setup.model, num_microbatches=2)


def test_a_stream_counts_the_ops_before_its_next_all_to_all_at_every_position():
    """The merge's ordering rule reads this count (the stream nearer its next all-to-all computes
    first); expected values counted by hand, FINISH ops count like compute ops."""
    from gptoss_cli.schedule.combined_1f1b import _Stream

    kinds = [RUN, RUN, START, FINISH, RUN, START, RUN]
    stream = _Stream([(k, lambda: None) for k in kinds])
    seen = []
    while not stream.done:
        seen.append(stream.runs_before_comm())
        stream.step()
    assert seen == [2, 1, 0, 2, 1, 0, float("inf")]
    assert stream.runs_before_comm() == float("inf")
