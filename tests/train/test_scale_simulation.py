"""The scale simulator (tests/support/simulate.py, bench/scale.py) against closed-form numbers,
and the memory estimate against the measured peak of a real training step of the tiny recipes."""

from __future__ import annotations

import pytest

from gptoss_cli.model.hybrid import HybridModel
from gptoss_cli.parallel.grads import ALIGN
from gptoss_cli.recipe import load_recipe
from gptoss_cli.recipe.estimate.memory import estimate_memory
from tests.support.simulate import simulate_rank

BUCKET = 20_000


def tiny(world: int, *overrides: str):
    """tiny_cpu_ep2 (EP=2, bf16, distributed optimizer) at `world`, small buckets, one microbatch of 2 x 32 tokens per rank."""
    return load_recipe("tiny_cpu_ep2", [f"optimizer.bucket_size={BUCKET}", f"training.global_batch_size={2 * world}",
                                        *overrides])


def simulate(world: int, rank: int = 0, *overrides: str):
    r = tiny(world, *overrides)
    return r, simulate_rank(r.config, r.arch, r.pattern, world, rank)


def test_simulated_rank_holds_what_the_estimate_says_and_every_rank_the_same():
    r, sim = simulate(4)
    _, last = simulate(4, 3)
    est = estimate_memory(r.config, r.arch, r.pattern, 4)
    assert sim.memory == last.memory and sim.buckets == last.buckets
    assert sim.memory["params"] == est.bytes_of("params")
    assert sim.memory["grads"] == est.bytes_of("grads")
    optimizer = sum(sim.memory[f"optimizer.{k}"] for k in ("master", "exp_avg", "exp_avg_sq"))
    assert optimizer == est.bytes_of("optimizer")


def test_state_and_collectives_per_step_in_closed_form():
    """W=4, EP=2: each rank holds 2 of the 4 experts; dense state sharded over 4, expert state over 2."""
    r, sim = simulate(4)
    arch = r.arch
    params = dict(HybridModel(arch, device="meta").named_parameters())
    dense = sum(p.numel() for n, p in params.items() if ".mlp.experts." not in n)
    experts = sum(p.numel() for n, p in params.items() if ".mlp.experts." in n) // 2
    # buckets are padded to ALIGN x shards elements: at most that much more per bucket
    dense_buf, expert_buf = (sum(sim.bucket_numel[g]) for g in ("dense", "expert"))
    assert 0 <= dense_buf - dense < sim.buckets["dense"] * ALIGN * 4
    assert 0 <= expert_buf - experts < sim.buckets["expert"] * ALIGN * 2
    assert sim.memory["params"] == 2 * (dense_buf + expert_buf)  # bf16
    assert sim.memory["grads"] == 4 * (dense_buf + expert_buf)  # fp32
    assert sim.memory["optimizer.master"] == 4 * (dense_buf // 4 + expert_buf // 2)
    # the dispatcher, per MoE layer and microbatch: a count exchange (E int64) and four token
    # all-to-alls (dispatch and combine, forward and backward) of T*k rows of h bf16 values
    tokens, k, h = 2 * 32, arch.num_experts_per_tok, arch.hidden_size
    (dispatch,) = [p for p in sim.phases if p.name.startswith("dispatcher")]
    assert dispatch.per_step == 3 * 1  # 3 MoE layers x 1 microbatch
    assert [(c.op, c.group_size, c.payload_bytes) for c in dispatch.calls] == (
        [("all_to_all", 2, 8 * arch.num_local_experts)] + [("all_to_all", 2, tokens * k * h * 2)] * 4)
    assert all(c.wire_bytes == c.payload_bytes / 2 for c in dispatch.calls)  # balanced: half to the peer
    # finalisation: one reduce-scatter per bucket (4 B x bucket) + the token count; the optimizer:
    # the norm, then one all-gather per bucket (2 B x bucket)
    fin = [c for c in sim.collectives() if c[0] == "finalize_model_grads"]
    rs = [c for _, c, _ in fin if c.op == "reduce_scatter"]
    assert [c.payload_bytes for c in rs] == [4 * n for n in sim.bucket_numel["dense"] + sim.bucket_numel["expert"]]
    assert [c.group for c in rs] == ["dp"] * sim.buckets["dense"] + ["expert_dp"] * sim.buckets["expert"]
    opt = [c for ph, c, _ in sim.collectives() if ph == "optimizer step"]
    assert [c.op for c in opt] == ["all_reduce"] + ["all_gather"] * (sim.buckets["dense"] + sim.buckets["expert"])
    assert [c.payload_bytes for c in opt[1:]] == [2 * n for n in sim.bucket_numel["dense"] + sim.bucket_numel["expert"]]
    assert sim.count() == 5 * 3 + len(rs) + 1 + len(opt) + 2


def test_optimizer_makes_two_collectives_per_bucket_whatever_the_world_size():
    counts = {}
    for world in (2, 4, 8):
        _, sim = simulate(world)
        reduced = sim.buckets["dense"] + (sim.buckets["expert"] if sim.expert_dp_size > 1 else 0)
        counts[world] = (reduced, sim.count("reduce_scatter"), sim.count("all_gather", "optimizer step"),
                         sim.count("all_reduce", "optimizer step"))
    # W=2 (expert-DP 1): the expert buckets need no reduction; W=4, 8: the same buckets, the same calls
    assert counts[4] == counts[8] and counts[4][1] == counts[4][2] == counts[4][0] > counts[2][0]
    assert all(rs == ag == reduced and ar == 1 for reduced, rs, ag, ar in counts.values())


def _peak_bytes(fn) -> int:
    """Peak of the bytes torch allocated while fn ran (the profiler's CPU memory events)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    live = peak = 0
    for e in events:
        live += e.nbytes()
        peak = max(peak, live)
    return peak


@pytest.mark.parametrize("name", ["tiny_cpu_ep2", "tiny_cpu_ep2_overlap"])
def test_measured_peak_of_a_tiny_recipe_step_is_within_15_percent_of_the_estimate(name, tmp_path):
    """Rank 0 of the recipe (W=2, EP=2) trains one step through `run_worker` in this process on the
    fake process group (collectives simulated, tests/support/simulate.py): from building the
    model to the optimizer step, the peak of what torch allocated against the estimate's total
    (state, activations and transients). On the CPU attention runs SDPA's math path, which saves
    more than the fused kernel the estimate counts; at 32 tokens that difference is small."""
    from gptoss_cli.train.job import TrainJob
    from gptoss_cli.run.worker import run_worker
    from tests.support.simulate import CollectiveRecorder, fake_world

    r = load_recipe(name, ["training.train_iters=1", "checkpoint.dir=null", "checkpoint.save_interval=null",
                           f"logging.run_dir={tmp_path}"])
    with fake_world(2, 0), CollectiveRecorder({}):
        peak = _peak_bytes(lambda: run_worker(TrainJob.from_recipe(r)))
    est = estimate_memory(r.config, r.arch, r.pattern, 2)
    state = sum(est.bytes_of(k) for k in ("params", "grads", "optimizer"))
    assert peak > state  # the step really ran
    assert peak == pytest.approx(est.total_bytes, rel=0.15)


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap_grad_reduce", "after-backward"])
def test_overlap_grad_reduce_issues_every_bucket_during_the_last_backward(overlap, tmp_path, monkeypatch):
    """Rank 0 of tiny_cpu_ep2 at W=4 (plain schedule, 1 microbatch) on the fake process group: with
    overlap_grad_reduce every bucket's reduce-scatter is issued during backward, before
    finalize_model_grads waits for them; without it, none is."""
    from gptoss_cli.parallel import grads
    from gptoss_cli.train.job import TrainJob
    from gptoss_cli.run.worker import run_worker
    from tests.support.simulate import CollectiveRecorder, fake_world

    r = tiny(4, "training.train_iters=1", "checkpoint.dir=null", "checkpoint.save_interval=null",
             f"logging.run_dir={tmp_path}", f"overlap.overlap_grad_reduce={str(overlap).lower()}")
    issued_before_finish: list[int] = []
    real = grads.GradBuffers.finish_grad_sync

    def finish(self):
        issued_before_finish.append(sum(c.op == "reduce_scatter" for c in rec.calls))
        return real(self)

    monkeypatch.setattr(grads.GradBuffers, "finish_grad_sync", finish)
    with fake_world(4, 0), CollectiveRecorder({}) as rec:
        run_worker(TrainJob.from_recipe(r))
    reduce_scatters = [c for c in rec.calls if c.op == "reduce_scatter"]
    assert len(reduce_scatters) > 2 and len(issued_before_finish) == 1
    assert issued_before_finish[0] == (len(reduce_scatters) if overlap else 0)


def test_pipeline_ranks_hold_what_the_per_stage_estimate_says():
    """PP = 2 x EP = 2 (tiny_cpu_pp2_ep2: blocks 2 + 1): each pipeline rank's real buffers and optimizer
    shards equal its stage's estimate; the stages' dense parameters are the model's, each once; a
    stage sends each microbatch's activations on, and its gradient back, once per stage boundary."""
    r = load_recipe("tiny_cpu_pp2_ep2", [f"optimizer.bucket_size={BUCKET}"])
    sims = [simulate_rank(r.config, r.arch, r.pattern, 4, rank) for rank in (0, 2)]
    assert [s.pp_rank for s in sims] == [0, 1]
    for sim in sims:
        est = estimate_memory(r.config, r.arch, r.pattern, 4, pipeline_rank=sim.pp_rank)
        assert sim.memory["params"] == est.bytes_of("params") and sim.memory["grads"] == est.bytes_of("grads")
        assert sum(sim.memory[f"optimizer.{k}"] for k in ("master", "exp_avg", "exp_avg_sq")) == est.bytes_of("optimizer")
        (sends,) = [p for p in sim.phases if p.name.startswith("pipeline sends")]
        assert len(sends.calls) == 1 and sends.per_step == sim.microbatches == 2
    worst = estimate_memory(r.config, r.arch, r.pattern, 4)
    assert worst.pipeline_rank == 0 and [s["stages"] for s in worst.stages] == ["Et*2", "tL"]
    params = dict(HybridModel(r.arch, device="meta").named_parameters())
    dense = sum(p.numel() for n, p in params.items() if ".mlp.experts." not in n)
    padding = sum(sum(s.bucket_numel["dense"]) for s in sims) - dense
    assert 0 <= padding < sum(s.buckets["dense"] for s in sims) * ALIGN * 2  # buckets padded, nothing twice
