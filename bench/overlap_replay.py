"""Replay the combined-1F1B schedule against a simulated link in virtual time: what it can hide on an idle host.

bench/overlap.py measures the overlap schedule in wall time on 2 processes; on a machine shared
with other jobs its numbers move with the load. This script separates the schedule's own ability
to hide communication from the host's noise:
  1. one process (EP=1, the same widened tiny model as bench/overlap.py) runs a training step
     through the combined-1F1B schedule and records, for every merged op (gptoss_cli/schedule/
     combined_1f1b.py `run_interleaved`), its CPU time; the delayed expert weight gradients that
     run right after a backward all-to-all is issued are timed apart from the issue;
  2. for each communication/compute ratio r, the recorded op streams are fed to the real
     `run_interleaved` again (the production merge policy) as ops that advance a virtual clock:
     compute ops by their recorded time, each all-to-all through the FIFO link of
     tests/support/simlink.py with r x compute / (number of all-to-alls) on the wire;
  3. the plain schedule is compute + communication, the overlap schedule the replayed clock;
     hidden = 1 - (time spent waiting) / communication.
Communication is spread evenly over the all-to-alls (dispatch and combine move the same rows,
forward and backward alike); count exchanges are left out (latency only).

Two bounds hold for any combined-1F1B order. F(0) and B(N-1) have no partner microbatch: about 1/N
of the communication stays exposed. And a microbatch's backward is a chain of compute and its own
all-to-alls (6 per `*E*E*E` pass), so a forward/backward pair takes at least B + 6c for backward
compute B and all-to-all time c, against F + B of compute: with B about 2F, at comm = compute
(c = (F + B)/12) the pair needs 14c for 12c of compute, and at most about 83% of the
communication can be hidden; the 90% mark needs comm <= about 0.7 x compute.

    python bench/overlap_replay.py --microbatches 16 --micro-batch 2
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench import harness  # noqa: E402
from bench.overlap import add_model_args  # noqa: E402
from tests.support.simlink import LinkModel  # noqa: E402
from gptoss_cli.model.gemm import grouped as grouped_gemm  # noqa: E402
from gptoss_cli.schedule import combined_1f1b as c1f1b  # noqa: E402


def record(args: argparse.Namespace) -> list[tuple[list, list]]:
    """One step's run_interleaved calls: per call, the forward and backward op streams as
    (kind, cpu seconds before the issue, cpu seconds after it) in stream order (median of steps)."""
    from bench.overlap import build_model
    from gptoss_cli.parallel.state import ParallelState
    from gptoss_cli.train.data import DataLoaderState
    from gptoss_cli.train.objective import forward_step

    _, setup, source = build_model(vars(args), ParallelState())  # the optimizer never steps here

    after_issue = [0.0]  # CPU time of the delayed wgrad GEMMs run inside the current op
    execute = grouped_gemm.WgradQueue.execute

    def timed_execute(self):
        t0 = time.thread_time()
        n = execute(self)
        after_issue[0] += time.thread_time() - t0
        return n

    run = c1f1b.run_interleaved
    calls: list[tuple[list, list]] = []

    def recording_run(f_ops, b_ops):
        rec: tuple[list, list] = ([], [])

        def wrap(ops, out):
            def timed(kind, fn):
                def op():
                    after_issue[0] = 0.0
                    t0 = time.thread_time()
                    fn()
                    total = time.thread_time() - t0
                    out.append((kind, total - after_issue[0], after_issue[0]))
                return op
            return [(kind, timed(kind, fn)) for kind, fn in ops]

        run(wrap(f_ops, rec[0]), wrap(b_ops, rec[1]))
        calls.append(rec)

    steps = []
    grouped_gemm.WgradQueue.execute, c1f1b.run_interleaved = timed_execute, recording_run
    try:
        for _ in range(args.steps + 1):  # the first step warms up
            calls.clear()
            setup.model.zero_grad_buffer()
            data = DataLoaderState(source, global_batch_size=args.micro_batch * args.microbatches,
                                   micro_batch_size=args.micro_batch, dp_rank=0, dp_size=1)
            c1f1b.forward_backward_combined_1f1b(forward_step_func=forward_step, data_iterator=data.step_iterator(),
                                                 model=setup.model, num_microbatches=args.microbatches)
            steps.append([(list(f), list(b)) for f, b in calls])
    finally:
        grouped_gemm.WgradQueue.execute, c1f1b.run_interleaved = execute, run
    measured = steps[1:]

    def median_op(per_step: list[list]) -> list:
        return [(per_step[0][i][0], statistics.median(s[i][1] for s in per_step),
                 statistics.median(s[i][2] for s in per_step)) for i in range(len(per_step[0]))]

    return [(median_op([s[c][0] for s in measured]), median_op([s[c][1] for s in measured]))
            for c in range(len(measured[0]))]


def replay(calls: list[tuple[list, list]], wire_s: float) -> tuple[float, float]:
    """(virtual step time, time spent waiting for the link) of the real merge over recorded ops."""
    clock = [0.0]
    waited = [0.0]
    link = LinkModel(gbps=8e-9, latency_us=0.0)  # 1 byte/s: a transfer of n "bytes" lasts n seconds

    def stream(ops: list) -> list:
        in_flight: list[float] = []
        out = []
        for kind, before, after in ops:
            if kind == c1f1b.START:
                def op(before=before, after=after):
                    clock[0] += before
                    in_flight.append(link.reserve(wire_s, clock[0]))
                    clock[0] += after
            elif kind == c1f1b.FINISH:  # wait, then the op's own compute (combine's unpermute, ...)
                def op(before=before, after=after):
                    done = in_flight.pop()
                    waited[0] += max(0.0, done - clock[0])
                    clock[0] = max(clock[0], done) + before + after
            else:
                def op(before=before):
                    clock[0] += before
            out.append((kind, op))
        return out

    for f_ops, b_ops in calls:
        c1f1b.run_interleaved(stream(f_ops), stream(b_ops))
    return clock[0], waited[0]


def main() -> None:
    ap = harness.parser(__doc__)
    add_model_args(ap, microbatches=16, micro_batch=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--ratios", default="0.25,0.5,1,2")
    args = ap.parse_args()
    torch.set_num_threads(1)
    run = harness.Run("overlap_replay", args, clock="cpu").__enter__()  # op times: CPU time of the recording thread
    calls = record(args)
    ops = [op for f, b in calls for op in f + b]
    compute = sum(before + after for kind, before, after in ops)
    comms = sum(1 for kind, *_ in ops if kind == c1f1b.START)
    idle_clock, _ = replay(calls, 0.0)
    print(f"{args.microbatches} microbatches of {args.micro_batch}x{args.seq} tokens, hidden {args.hidden}, "
          f"{args.experts} experts, pattern {args.pattern or 'preset'}: compute {1e3 * compute:.0f} ms CPU per step, "
          f"{comms} all-to-alls")
    for r in (float(x) for x in args.ratios.split(",")):
        comm = r * compute
        clock, waited = replay(calls, comm / comms)
        plain = compute + comm
        print(f"  comm = {r:g} x compute: plain {1e3 * plain:.0f} ms, overlap {1e3 * clock:.0f} ms -> "
              f"{plain / clock:.2f}x, hidden {100 * (1 - waited / comm):.1f}%")
        case = f"comm = {r:g} x compute (virtual time)"
        run.add(case, "plain", "step_s", plain)
        run.add(case, "overlap", "step_s", clock)
        run.add(case, "overlap", "hidden_share", 1 - waited / comm)
        run.ratio(case, "plain", "overlap", "step_s", name="overlap / plain speed")
    assert abs(idle_clock - compute) < 1e-9 * max(1.0, compute)
    run.extra.update(compute_s=compute, all_to_alls=comms)
    run.finish()


if __name__ == "__main__":
    main()
