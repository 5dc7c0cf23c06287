"""Pipeline parallelism trains what a single model trains: every schedule at PP = 2 and PP = 4, with
and without EP = 2 (and CP = 2), against transformers + torch AdamW and against gptoss at PP = 1.

Each configuration's first step (tests/schedule/pipeline/runs.py: `gptoss train`'s loop on gloo processes, the
fixture and error model of tests/train/reference.py) is judged on (a) the loss, the grad norm and
every parameter's finalised gradient against transformers at the same weights (DELTA), (b) the update
against torch's clip_grad_norm_ + AdamW given the same weights and gptoss's own gradients (a few ulp;
the clip engages), and (c) every gradient against the PP = 1 run's of the same EP (PP_REL: the runs
differ only in the order the microbatches' contributions are summed). Router losses (aux and z) are
checked against PP = 1 with the losses on. Each finalisation rule is then broken once (`runs.MUTATIONS`)
and the same checks must fail. One launch per world size (2, 4 and 8 processes) serves all of it.
"""

from __future__ import annotations

import pytest

from tests.schedule.pipeline import runs as P
from tests.tolerances import U_FP32, reassociation_rel
from tests.train import reference as R

# PP vs PP = 1 (error model of tests/tolerances.py): the same per-microbatch arithmetic, the
# contributions of up to 16 microbatches summed in another order (DP split, pipeline order), the
# router statistics of 6 layers summed in another grouping, through a backward of 6 layers.
PP_REL = reassociation_rel(16, depth=6)
PIPELINED = ([f"{pp}-{s}" for pp in ("pp2", "pp2xep2", "pp4", "pp4xep2") for s in P.SCHEDULES]
             + ["pp2xcp2", "pp2xep2-overlap", "pp4xep2-overlap"])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return P.load(tmp_path_factory)


def baseline(name: str) -> str:
    """The PP = 1 run a configuration must equal: same EP, same router losses."""
    fields = P.CONFIGS[name][1]
    if fields.get("aux_loss_coeff", 0.0) > 0:
        return "pp1-aux"
    return "pp1-ep2" if fields.get("ep_size", 1) == 2 else "pp1"


def problems(runs: dict, name: str) -> list[str]:
    """Every check of the module docstring that `name`'s first step fails (empty: it passes)."""
    run, base = runs[name], runs[baseline(name)]
    ref, out = runs["reference"], []
    m = P.rank0(run)[0]
    if "reference" in run:  # (a) and (b): the configurations without router losses
        judged = run["reference"]
        if judged["initial_diff"] != 0.0:
            out.append("does not start from the fixture's weights")
        if abs(m["loss"] - ref["loss"]) > R.DELTA * ref["loss"]:
            out.append(f"loss {m['loss']} vs transformers {ref['loss']}")
        if abs(m["grad_norm"] - ref["norm"]) > R.DELTA * ref["norm"]:
            out.append(f"grad norm {m['grad_norm']} vs transformers {ref['norm']}")
        bad = [n for n, (diff, norm) in judged["grad_diff"].items() if diff > R.DELTA * norm]
        if bad:
            out.append(f"gradients of {bad[:3]} vs transformers")
        worst = max(judged["update_excess"], key=judged["update_excess"].get)
        if judged["update_excess"][worst] > 1:
            out.append(f"update of {worst} vs torch AdamW ({judged['update_excess'][worst]:.3g} x the bound)")
    tensor, rel = P.max_rel_diff(run["grads"], base["grads"])  # (c)
    if rel > PP_REL:
        out.append(f"gradient of {tensor} vs {baseline(name)}: {rel:.3g} relative")
    if abs(m["loss"] - P.rank0(base)[0]["loss"]) > PP_REL * abs(m["loss"]):
        out.append(f"loss vs {baseline(name)}")
    if run["spread"] != 0.0:
        out.append(f"replicas differ by {run['spread']}")
    if len({tuple(n) for n in run["norms"]}) != 1:
        out.append(f"ranks returned different grad norms {run['norms']}")
    return out


def test_fixture_routes_far_from_ties_and_clips(runs):
    """Premises (tests/train/reference.py): no routing decision can flip, and the clip engages."""
    assert runs["reference"]["margin_over_bound"] > 10
    assert runs["reference"]["norm"] > 2 * R.CLIP


def test_pp1_baselines_equal_transformers(runs):
    assert problems(runs, "pp1") == [] and problems(runs, "pp1-ep2") == []


@pytest.mark.parametrize("name", PIPELINED)
def test_pipelined_first_step_equals_transformers_and_pp1(runs, name):
    assert runs[name]["world"] == {"pp2": 2, "pp2xep2": 4, "pp4": 4, "pp4xep2": 8, "pp2xcp2": 4}[name.split("-")[0]]
    assert problems(runs, name) == []


@pytest.mark.parametrize("name", ["pp2-1f1b", "pp4xep2-i1f1b", "pp4-dualpipev", "pp2xep2-overlap"])
def test_telemetry_and_mfu_count_every_stage_once(runs, name):
    """Each stage adds its own MoE layers' router rows to the step's totals: the expert load of every
    layer equals the PP = 1 run's (token counts, exact; times the repeats of the 4 samples in a larger
    global batch), its entropy and CV within PP_REL; the model FLOPs per token (MFU's numerator) are the
    whole model's, counted once, not per stage."""
    m, base = P.rank0(runs[name])[0], P.rank0(runs[baseline(name)])[0]
    repeats = P.CONFIGS[name][1].get("global_batch_size", R.GLOBAL_BATCH) // R.GLOBAL_BATCH
    assert m["expert_load"] == {j: [repeats * c for c in v] for j, v in base["expert_load"].items()}
    assert len(m["expert_load"]) == 3
    for key in ("router_entropy", "router_cv"):
        assert m[key].keys() == base[key].keys()
        assert all(m[key][j] == pytest.approx(v, rel=PP_REL) for j, v in base[key].items()), key
    assert m["model_flops_per_token"] == base["model_flops_per_token"] > 0


@pytest.mark.parametrize("name", ["pp2xep2-overlap", "pp2xep2-overlap-aux", "pp4xep2-overlap"])
def test_ep_overlap_under_pipelining_ran_and_equals_pp1(runs, name):
    """DualPipeV's overlapped forward-backward actions, each a forward and a backward plan interleaved
    around their all-to-alls (pipeline/plan_stage.py), ran on every rank and change nothing: the same
    checks as every schedule (router losses included)."""
    assert all(n > 0 for n in runs[name]["overlapped"]), runs[name]["overlapped"]
    assert problems(runs, name) == []
    assert sum(runs["pp2xep2-dualpipev"]["overlapped"]) == 0  # the plain DualPipeV runs them in sequence


@pytest.mark.parametrize("name", ["pp2-aux", "pp2-aux-zbv"])
def test_router_losses_summed_across_stages(runs, name):
    """The aux loss pooled over the layers of every stage and the z-loss summed over them: the same
    losses and gradients as one model (the accumulator carried between stages)."""
    m, base = P.rank0(runs[name])[0], P.rank0(runs["pp1-aux"])[0]
    assert m["aux_loss"] == pytest.approx(base["aux_loss"], rel=PP_REL) and m["aux_loss"] > 1.0
    assert m["z_loss"] == pytest.approx(base["z_loss"], rel=PP_REL) and m["z_loss"] > 0.0
    assert problems(runs, name) == []


@pytest.mark.parametrize("mutation, failing", [
    ("stage_clip_norm", ["grad norm", "update of"]),
    ("stage_token_division", ["grad norm", "gradients of", "gradient of"]),
    ("stage_router_loss_left_out", ["gradient of"]),
])
def test_each_finalisation_rule_broken_fails(runs, mutation, failing):
    """Clip norm per stage, token division per stage, a stage's router losses left out: each makes
    the checks above fail (the mutation runs the real loop with that one rule broken)."""
    found = problems(runs, f"mut-{mutation}")
    for what in failing:
        assert any(p.startswith(what) for p in found), (mutation, found)


def test_forward_only_passes_of_an_objective(runs):
    """An objective whose prepare_step scores the step's microbatches forward-only (the old policy's
    log-probabilities, tests/train/test_objective.py): under PP the scores come from the last stage to
    every rank, the ratio is 1 and the gradient that of cross-entropy at PP = 1."""
    (m,) = P.rank0(runs["pp2-objective"])
    assert abs(m["mean_ratio"] - 1.0) <= 8 * U_FP32
    assert m["loss"] == pytest.approx(P.rank0(runs["pp1"])[0]["loss"], rel=PP_REL)
    tensor, rel = P.max_rel_diff(runs["pp2-objective"]["grads"], runs["pp1"]["grads"])
    assert rel <= PP_REL, (tensor, rel)


@pytest.mark.parametrize("feature", list(P.FEATURES))
def test_features_under_pipelining_equal_pp1(runs, feature):
    """LoRA, MXFP4 QAT, emulated MXFP8, full recompute (a unit cut at the stage boundary) and packed
    documents: the first step at PP = 2 equals the same feature at PP = 1 (loss, every gradient)."""
    pp1, pp2 = runs[f"feat-{feature}-pp1"], runs[f"feat-{feature}-pp2"]
    assert P.rank0(pp2)[0]["loss"] == pytest.approx(P.rank0(pp1)[0]["loss"], rel=PP_REL)
    tensor, rel = P.max_rel_diff(pp2["grads"], pp1["grads"])
    assert rel <= PP_REL, (tensor, rel)
    assert pp2["spread"] == 0.0
    if feature == "lora":
        assert all(".adapter." in n for n in pp2["grads"])  # the frozen base has no gradient buffers
