"""The schedules' warm-up depth (`layout.in_flight`) equals what torch's schedules actually issue.

`in_flight(schedule, pp, vpp, microbatches, rank)` is the number of microbatches (in units of a
rank's whole stage set: a chunk counts 1 / VPP) whose activations a pipeline rank holds at its peak,
the memory estimate's factor for activations (gptoss_cli/recipe/estimate/memory.py). For the 1F1B
family that peak is reached when the first backward starts: every forward issued before it is in
flight. The independent reference is torch.distributed.pipelining's own action order: the
`pipeline_order` an interleaved schedule builds at construction, and Schedule1F1B's
`_get_pipeline_order` (the schedule IR torch documents for it), built here over stand-in stages
(the attributes the constructors read), no processes. For every PP, VPP and microbatch count torch
accepts, the forwards a rank issues before its first backward (full, or for inputs only under zero
bubble) divided by VPP must be `in_flight`.

The zero-bubble schedule (ZB1P, interleaved_zero_bubble) is the point: its warm-up keeps ONE chunk
forward per hop from the last rank where interleaved 1F1B keeps two, so the two differ by
PP - 1 - rank chunks. ZB-V and DualPipeV are V schedules whose peak is not their warm-up count (ZB-V
claims 1F1B's memory, DualPipeV's table PP + 1); they are not judged here.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from gptoss_cli.schedule.pipeline.layout import in_flight, schedule_problems

pipelining = pytest.importorskip("torch.distributed.pipelining")
schedules = pytest.importorskip("torch.distributed.pipelining.schedules")

INTERLEAVED = {"interleaved_1f1b": "ScheduleInterleaved1F1B", "interleaved_zero_bubble": "ScheduleInterleavedZeroBubble"}
BACKWARDS = {"B", "I"}  # torch's FULL_BACKWARD and BACKWARD_INPUT actions


def stand_in_stages(pp: int, vpp: int, rank: int) -> list[SimpleNamespace]:
    """What torch's schedule constructors read of a rank's stages (its stage i is global stage rank + i x PP)."""
    n = pp * vpp
    return [SimpleNamespace(num_stages=n, group_size=pp, group_rank=rank, stage_index=rank + i * pp,
                            is_first=rank + i * pp == 0, is_last=rank + i * pp == n - 1, submod=None)
            for i in range(vpp)]


def forwards_before_first_backward(actions: list) -> int:
    kinds = [str(a.computation_type.value) for a in actions if a is not None]
    first = next(i for i, kind in enumerate(kinds) if kind in BACKWARDS)
    return sum(kind == "F" for kind in kinds[:first])


def torch_orders(schedule: str, pp: int, vpp: int, m: int) -> dict[int, list]:
    """torch's action order of every rank for `schedule`."""
    if schedule == "1f1b":
        built = pipelining.Schedule1F1B(stand_in_stages(pp, 1, 0)[0], m, loss_fn=lambda out, target: out)
        return built._get_pipeline_order()
    cls = getattr(pipelining, INTERLEAVED[schedule])
    return cls(stand_in_stages(pp, vpp, 0), m, loss_fn=lambda out, target: out).pipeline_order


CASES = [(s, pp, vpp, m) for s in ("1f1b", *INTERLEAVED) for pp in (2, 3, 4, 8)
         for vpp in ((1,) if s == "1f1b" else (2, 3)) for m in range(1, 3 * pp + 1)
         if not schedule_problems(s, pp, vpp, m)]


@pytest.mark.parametrize("schedule", ["1f1b", *INTERLEAVED])
def test_in_flight_is_the_forwards_torch_issues_before_the_first_backward(schedule):
    cases = [c for c in CASES if c[0] == schedule]
    assert len(cases) > 20
    wrong = []
    for _, pp, vpp, m in cases:
        orders = torch_orders(schedule, pp, vpp, m)
        for rank in range(pp):
            issued = forwards_before_first_backward(orders[rank])
            if in_flight(schedule, pp, vpp, m, rank) * vpp != issued:
                wrong.append(f"PP={pp} VPP={vpp} m={m} rank {rank}: in_flight x VPP = "
                             f"{in_flight(schedule, pp, vpp, m, rank) * vpp:g}, torch issues {issued}")
    assert not wrong, "\n".join(wrong[:10])


def test_zero_bubble_warms_up_one_chunk_per_hop_where_interleaved_1f1b_warms_up_two():
    """The published ZB1P warm-up against interleaved 1F1B's, rank by rank (PP = 4, VPP = 2, 8 microbatches)."""
    zb = [forwards_before_first_backward(a) for a in torch_orders("interleaved_zero_bubble", 4, 2, 8).values()]
    i1 = [forwards_before_first_backward(a) for a in torch_orders("interleaved_1f1b", 4, 2, 8).values()]
    assert zb == [8, 7, 6, 5] and i1 == [11, 9, 7, 5]
    assert [in_flight("interleaved_zero_bubble", 4, 2, 8, r) * 2 for r in range(4)] == zb
