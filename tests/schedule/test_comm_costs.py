"""What a training step costs in host synchronisations, and the simulated link the overlap bench uses.

Host syncs are counted on CPU by tests/schedule/host_syncs.py (every call that would block the host
on a GPU, by call site). The budget: at most one per MoE layer and microbatch in the default
(grouped-GEMM) path, the split sizes of the token all-to-all under expert parallelism; one per step
for gradient finalisation; nothing per microbatch in the schedules.

The link model (tests/support/simlink.py, a communication object the bench injects) must make an
all-to-all last its modelled time, in the synchronous path of the plain schedule and the
asynchronous one of the overlap schedule alike, by sleeping: a busy wait would take a core from the
compute it is meant to overlap with; installed on a model, it must carry every all-to-all of a step.
"""

from __future__ import annotations

import pytest

from gptoss_cli.model.gemm import grouped as grouped_gemm
from tests.support.simlink import LinkModel
from gptoss_cli.parallel.state import ParallelState
from tests.schedule.workers import (LINK_LATENCY_S, LINK_WIRE_S, SYNC_MICROBATCHES, TINY, build,
                                    comm_costs_worker, count_step_host_syncs)
from tests.train.dist_helpers import once_per_session, run_distributed

MICROBATCHES = SYNC_MICROBATCHES
MOE_LAYERS = TINY.num_hidden_layers  # "*E*E*E"
MODEL_FILES = ("model/dispatcher.py", "model/gemm/grouped.py", "model/moe.py", "model/router_stats.py", "model/mlp.py",
               "model/schedule_plan.py")
SCHEDULE_FILES = ("schedule/plain.py", "schedule/combined_1f1b.py")
# A sleeping wait costs the process (its gloo threads included) well under a millisecond of CPU
# per all-to-all; a spinning one costs the whole wait. A quarter of the wait separates the two
# with room for a loaded machine's scheduling noise.
SPIN_SHARE = 0.25


@pytest.fixture(scope="module")
def ep2(tmp_path_factory):
    return once_per_session(tmp_path_factory, "comm-costs-ep2",
                            lambda folder: run_distributed(comm_costs_worker, 2, folder, timeout=240))


def _report(sites: dict[str, int]) -> str:
    return "\n".join(f"  {n} x {site}" for site, n in sorted(sites.items()))


def _in(sites: dict[str, int], files: tuple[str, ...]) -> int:
    return sum(n for site, n in sites.items() if site.split(":")[0].endswith(files))


# --- host synchronisations ------------------------------------------------------------------
@pytest.mark.parametrize("schedule", ["plain", "overlap"])
def test_expert_parallel_step_syncs_at_most_once_per_moe_layer_and_microbatch(ep2, schedule):
    for rank, result in enumerate(ep2):
        sites = result["syncs"][schedule]
        budget = MOE_LAYERS * MICROBATCHES
        assert _in(sites, MODEL_FILES) <= budget, f"rank {rank}, {schedule}:\n{_report(sites)}"
        assert _in(sites, SCHEDULE_FILES) == 0, f"rank {rank}, {schedule}:\n{_report(sites)}"
        # forward + backward of every microbatch and the one gradient finalisation
        assert sum(sites.values()) <= budget + 1, f"rank {rank}, {schedule}:\n{_report(sites)}"


@pytest.mark.parametrize("schedule", ["plain", "overlap"])
def test_the_count_exchange_runs_on_its_own_group_and_the_tokens_on_the_ep_group(ep2, schedule):
    # On the EP group's communicator the count exchange (and its .tolist()) would queue behind the
    # other microbatch's token all-to-all in flight there (NCCL: one stream per communicator).
    for result in ep2:
        assert result["groups"][schedule] == {"control": ["ep_control"], "bulk": ["ep"]}


def test_without_expert_parallelism_the_moe_layers_never_sync():
    sites = count_step_host_syncs(build(ParallelState(), overlap=False, pattern="*E*E*E"), ParallelState(),
                                  microbatches=MICROBATCHES)
    assert _in(sites, MODEL_FILES + SCHEDULE_FILES) == 0, _report(sites)


def test_the_counter_sees_the_per_expert_loop_fallback(monkeypatch):
    # Where torch._grouped_mm cannot run, the loop over experts reads the counts back once per GEMM
    # (fprop, dgrad, wgrad of fc1 and fc2): the hook must see those, or it proves nothing.
    monkeypatch.setattr(grouped_gemm, "_grouped_mm_usable", lambda *a: False)
    sites = count_step_host_syncs(build(ParallelState(), overlap=False, pattern="*E*E*E"), ParallelState(),
                                  microbatches=MICROBATCHES)
    assert _in(sites, ("model/gemm/grouped.py",)) == 6 * MOE_LAYERS * MICROBATCHES, _report(sites)


# --- the simulated link -----------------------------------------------------------------------
def test_link_queues_bulk_transfers_and_lets_latency_and_control_messages_pass():
    link = LinkModel(gbps=8e-9 * 1e6, latency_us=1000.0)  # 1 MB/s: 1000 bytes take 1 ms on the wire
    assert link.reserve(1000, issued_at=10.0) == pytest.approx(10.002)
    # issued while the first is on the wire: starts when the link is free (latency does not hold it)
    assert link.reserve(1000, issued_at=10.0005) == pytest.approx(10.003)
    assert link.reserve(8, issued_at=10.0005, queued=False) == pytest.approx(10.0005 + 0.001 + 8e-6)
    assert link.reserve(0, issued_at=20.0) == pytest.approx(20.001)
    assert link.transfers == 4 and link.bytes_moved == 2008
    assert link.modeled_s == pytest.approx(4 * 0.001 + 2008e-6)
    with pytest.raises(ValueError, match="gbps"):
        LinkModel(gbps=0.0)


@pytest.mark.parametrize("kind", ["latency_sync", "latency_async"])
def test_all_to_all_under_a_link_lasts_its_latency_and_sleeps(ep2, kind):
    for result in ep2:
        wall, cpu = result["link"][kind]
        assert wall >= LINK_LATENCY_S
        assert cpu < SPIN_SHARE * LINK_LATENCY_S, f"{kind}: {cpu:.3f} s of CPU in a {wall:.3f} s wait"


def test_asynchronous_all_to_all_returns_at_issue_and_waits_in_wait(ep2):
    for result in ep2:
        assert result["link"]["async_issue_s"] < LINK_LATENCY_S / 2


def test_all_to_all_under_a_link_lasts_bytes_over_bandwidth(ep2):
    for result in ep2:
        wall, cpu = result["link"]["wire_sync"]
        assert wall >= LINK_WIRE_S and cpu < SPIN_SHARE * LINK_WIRE_S
        # two transfers issued together share the link: the second finishes after both wire times
        wall, cpu = result["link"]["wire_two_async"]
        assert wall >= 2 * LINK_WIRE_S and cpu < SPIN_SHARE * 2 * LINK_WIRE_S


def test_link_counts_what_it_carried_and_the_blocked_time(ep2):
    for result in ep2:
        transfers, nbytes, modeled, blocked = result["link"]["latency_link"]
        assert (transfers, nbytes) == (2, 2 * 32 * 32 * 4)  # two all-to-alls of 32 rows of 32 fp32 each way
        assert modeled == pytest.approx(2 * LINK_LATENCY_S)
        assert blocked >= LINK_LATENCY_S  # the synchronous one blocked for all of its latency


def test_without_a_link_the_all_to_all_is_not_delayed(ep2):
    for result in ep2:
        assert result["link"]["no_link_sleeps"] == []


@pytest.mark.parametrize("schedule", ["plain", "overlap"])
def test_a_link_installed_on_the_model_carries_every_all_to_all_of_a_step_and_is_removed_after(ep2, schedule):
    for result in ep2:
        got = result["model_link"][schedule]
        assert got["inside"] == [True] * MOE_LAYERS and got["restored"] == [True] * MOE_LAYERS
        # per MoE layer and microbatch: one count exchange; dispatch and combine, forward and backward
        assert got["counts"] == {"control": MOE_LAYERS * MICROBATCHES, "bulk": 4 * MOE_LAYERS * MICROBATCHES}
