"""A pipeline stage opens its gradient-sync window on its LAST backward microbatch (overlap_grad_reduce).

With `overlap_grad_reduce` a bucket's data-parallel reduction starts as soon as the backward outside
the model's `no_sync` has produced the bucket's gradients (gptoss_cli/parallel/grads.py); a stage
(gptoss_cli/schedule/pipeline/stage.py, `RankStage.backward_one_chunk`; plan_stage.py, `PlanStage.begin_backward`
under DualPipeV with the EP overlap) must run every backward but its last inside `no_sync`, or a reduction starts on a partial sum and the microbatches after it never
reach the other data-parallel replica. That is only visible with DP > 1 under PP > 1 and the
overlap on: PP = 2 x DP = 2 (4 gloo processes, tests/schedule/pipeline/runs.py's `gptoss train`
loop and fixture), 4 microbatches per stage (a global batch of 8 = the fixture's 4 samples twice,
whose mean gradient is the 4-sample batch's), buckets of tests/train/reference.py's BUCKET size so
that several reductions start during the last backward.

Judged against transformers at the fixture's weights (R.DELTA, the error model of
tests/train/reference.py) and against the same layout without the overlap in the same launch
(PP_REL: the same arithmetic, the DP sum in another order at worst).
"""

from __future__ import annotations

import pytest

from tests.schedule.pipeline import runs as P
from tests.tolerances import reassociation_rel
from tests.train import reference as R

PP_REL = reassociation_rel(8, depth=6)  # 8 microbatches' contributions, through a backward of 6 layers
BASE = dict(pp_size=2, pipeline_layout=P.PP2, pipeline_schedule="1f1b", global_batch_size=2 * R.GLOBAL_BATCH,
            bucket_size=R.BUCKET)
RUNS = {"pp2xdp2": BASE, "pp2xdp2-overlap": {**BASE, "overlap_grad_reduce": True},
        # the same window in the EP-overlap stages (plan_stage.py, DualPipeV): PP 2 x EP 2, both ranks of a
        # stage data-parallel for the dense parameters
        "pp2xep2-dualpipev-overlap": {**BASE, **P.OVERLAP, "pipeline_layout": P.PP2V, "ep_size": 2,
                                      "overlap_grad_reduce": True}}


def _compute(folder):
    from tests.train.dist_helpers import run_distributed

    hf, prefix = R.write_fixture(folder / "fixture")
    plans = [(P.job(name, folder / "runs" / name, hf, prefix, fields), None) for name, fields in RUNS.items()]
    preload = ("tests.schedule.pipeline.runs", "gptoss_cli.train.loop", "gptoss_cli.schedule.pipeline.schedule")
    per_rank = run_distributed(P.train_configs, 4, folder / "ranks4", plans, timeout=300.0, preload=preload)
    reference = P.Reference(hf, prefix)
    out = {"reference_norm": reference.norm}
    for i, name in enumerate(RUNS):
        ranks = [r[i] for r in per_rank]
        out[name] = {"grads": P.R.merge_ranks(ranks, "grads", 0)[0], "reference": reference.judge({"ranks": ranks}),
                     "norms": {records[0]["norm"] for records in ranks}}
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    pytest.importorskip("transformers")
    return _compute(tmp_path_factory.mktemp("grad_sync_window"))


@pytest.mark.parametrize("name", list(RUNS))
def test_pp2xdp2_gradients_equal_transformers(runs, name):
    judged = runs[name]["reference"]
    assert judged["initial_diff"] == 0.0
    bad = {n: diff / norm for n, (diff, norm) in judged["grad_diff"].items() if diff > R.DELTA * norm}
    assert not bad, f"{name}: gradients off transformers' (relative error, bound {R.DELTA:.2g}): {bad}"
    assert len(runs[name]["norms"]) == 1, runs[name]["norms"]


@pytest.mark.parametrize("name", ["pp2xdp2-overlap", "pp2xep2-dualpipev-overlap"])
def test_overlap_grad_reduce_opens_the_window_on_the_last_microbatch(runs, name):
    tensor, rel = P.max_rel_diff(runs[name]["grads"], runs["pp2xdp2"]["grads"])
    assert rel <= PP_REL, f"gradient of {tensor} with overlap_grad_reduce vs without: {rel:.3g} relative"
