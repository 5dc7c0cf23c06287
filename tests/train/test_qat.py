"""MXFP4 QAT in training: EP=2 (plain and overlap schedule with delayed wgrad) computes what EP=1
computes; the run records QAT; `convert --experts mxfp4` of its checkpoint writes exactly the
weights the forward used (read back by transformers' own MXFP4 dequantiser), transformers on that
export gives the training forward's logits, and `gptoss eval` computes with the rounded weights."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from gptoss_cli.checkpoint.load import model_from_checkpoint
from gptoss_cli.checkpoint.formats.training.readers import Mxfp4QatReader
from gptoss_cli.checkpoint.sources import open_source
from gptoss_cli.checkpoint.formats.training.record import TRAIN_STATE
from gptoss_cli.model.mxfp4.qat import Mxfp4QatGemm, qat_gemms, rounded_weight
from gptoss_cli.parallel.state import ParallelState, init_parallel
from tests.model.tiny_checkpoints import load_hf_reference
from tests.tolerances import assert_tensors_close, reassociation_rel
from tests.train.dist_helpers import once_per_session, run_distributed
from tests.train.workers import SEQ, TINY, one_step_grads, run_plan_worker, tiny_plan

DEPTH = 2 * TINY.num_hidden_layers + 1
GRAD_REL = reassociation_rel(4 * SEQ, DEPTH)  # as tests/train/test_parallel_ep.py: same weights, other sum order
LOGITS_REL = reassociation_rel(max(TINY.hidden_size, TINY.intermediate_size, TINY.qkv_rows), depth=DEPTH)


def qat_grads_worker(rank: int, ep: int, changes: dict) -> dict:
    return one_step_grads(init_parallel(ep, "cpu"), qat="mxfp4", **changes)


def _ep_runs(folder: Path) -> dict:
    return {
        "ep1": one_step_grads(ParallelState(), qat="mxfp4"),
        "ep1_full": one_step_grads(ParallelState()),  # the same step without QAT
        "ep2": run_distributed(qat_grads_worker, 2, folder / "plain", 2, {}),
        "ep2_overlap": run_distributed(qat_grads_worker, 2, folder / "overlap", 2,
                                       {"overlap_moe_expert_parallel_comm": True, "delay_wgrad_compute": True}),
    }


@pytest.fixture(scope="module")
def ep_runs(tmp_path_factory):
    return once_per_session(tmp_path_factory, "qat_ep_runs", _ep_runs)


def _merged(ranks: list[dict]) -> dict[str, torch.Tensor]:
    grads: dict[str, torch.Tensor] = {}
    for r in ranks:
        for name, g in r["grads"].items():
            assert name not in grads or torch.equal(grads[name], g) or "experts" not in name
            grads.setdefault(name, g)
    return grads


@pytest.mark.parametrize("layout", ["ep2", "ep2_overlap"])
def test_qat_at_ep2_equals_ep1(ep_runs, layout):
    ref, ranks = ep_runs["ep1"], ep_runs[layout]
    loss = sum(r["loss_sum"] for r in ranks) / sum(r["tokens"] for r in ranks)
    assert loss == pytest.approx(ref["loss_sum"] / ref["tokens"], rel=reassociation_rel(TINY.hidden_size, DEPTH))
    assert_tensors_close(_merged(ranks), ref["grads"], GRAD_REL, layout)


def test_qat_changes_the_step(ep_runs):
    """The comparison above is not between two full-precision runs: QAT moves the expert gradients far
    beyond rounding (the loss moves too, but at init by only ~5x its rounding bound)."""
    qat, full = ep_runs["ep1"], ep_runs["ep1_full"]
    name = next(n for n in qat["grads"] if "experts.linear_fc1.weight" in n)
    diff = (qat["grads"][name] - full["grads"][name]).abs().max()
    assert diff > 100 * GRAD_REL * full["grads"][name].abs().max()


# --- the run's checkpoint, its export, eval --------------------------------------------------------
def _qat_run(work: Path):
    plan = tiny_plan(str(work / "run"), ep_size=2, train_iters=3, save_interval=3, checkpoint_dir=str(work / "ckpt"),
                     qat="mxfp4", lr=3e-2)
    return work, run_distributed(run_plan_worker, 2, work / "out", plan)


@pytest.fixture(scope="module")
def qat_checkpoint(tmp_path_factory) -> Path:
    work, _ = once_per_session(tmp_path_factory, "qat_ep2_checkpoint", _qat_run)
    return work / "ckpt"


def _raw_expert_weights(ckpt: Path) -> dict[str, torch.Tensor]:
    """The expert weights as training held them (full precision), bypassing the rounding reader."""
    source = open_source(str(ckpt))
    try:
        assert isinstance(source.reader, Mxfp4QatReader)
        raw = source.reader._reader
        return {n: raw.read(n) for n in raw.names() if ".mlp.experts.linear_fc" in n and ".weight" in n}
    finally:
        source.close()


def ids(seq: int = 2 * TINY.sliding_window + 8) -> torch.Tensor:
    return torch.randint(0, TINY.vocab_size, (2, seq), generator=torch.Generator().manual_seed(5))


def test_the_run_records_qat(qat_checkpoint):
    state = json.loads((qat_checkpoint / "iter_0000003" / TRAIN_STATE).read_text())
    assert state["run"]["qat"] == "mxfp4"


def test_mxfp4_export_is_the_forwards_weights_element_for_element(qat_checkpoint, tmp_path):
    from gptoss_cli.checkpoint.convert import convert
    from tests.train.reference import HfView

    out = tmp_path / "hf-mx"
    convert(str(qat_checkpoint), out, to="hf", experts="mxfp4", dtype="float32")
    reference = load_hf_reference(out)  # transformers dequantises the blocks with its own code
    raw = _raw_expert_weights(qat_checkpoint)
    assert raw and all(not torch.equal(rounded_weight(w), w) for w in raw.values())  # training kept full precision
    # every Hybrid tensor, with the expert weights as the forward used them: Q(raw)
    hybrid = {**model_from_checkpoint(qat_checkpoint).state_dict(), **{n: rounded_weight(w) for n, w in raw.items()}}
    view = HfView(reference)
    want = view.to_hf({n: hybrid[n] for n in view.index})
    for name, p in reference.named_parameters():
        if ".experts." in name and not name.endswith("bias"):
            assert torch.equal(p.detach(), want[name]), name

    # transformers on the export gives the training forward's logits: raw weights + the QAT gemm
    ours = model_from_checkpoint(qat_checkpoint)
    ours.load_state_dict(raw, strict=False)
    ours.set_gemms(grouped=qat_gemms("mxfp4"))
    full = model_from_checkpoint(qat_checkpoint)
    full.load_state_dict(raw, strict=False)  # the same weights in full precision (post-training quantisation)
    with torch.no_grad():
        theirs = reference(ids()).logits
        got = ours.eval()(ids()).logits
        err = (got - theirs).abs().max().item()
        assert err <= LOGITS_REL * theirs.abs().max().item(), err
        ptq = (full.eval()(ids()).logits - theirs).abs().max().item()
        assert ptq > 100 * LOGITS_REL * theirs.abs().max().item()  # without QAT the export would differ


def test_bf16_export_and_eval_compute_with_the_rounded_weights(qat_checkpoint, tmp_path):
    from gptoss_cli.checkpoint.convert import convert

    raw = _raw_expert_weights(qat_checkpoint)
    loaded = model_from_checkpoint(qat_checkpoint).state_dict()  # what `gptoss eval` builds
    for name, w in raw.items():
        assert torch.equal(loaded[name], rounded_weight(w)), name
    out = tmp_path / "hybrid"
    convert(str(qat_checkpoint), out, to="hybrid", dtype="bfloat16")
    exported = model_from_checkpoint(out, dtype=torch.float32).state_dict()
    for name, w in raw.items():  # MXFP4 values are exact in bf16
        assert torch.equal(exported[name], rounded_weight(w)), name
    # and --weights master reads the fp32 master copies, rounded the same way
    master = open_source(str(qat_checkpoint), weights="master")
    try:
        name = next(iter(raw))
        assert torch.equal(master.reader.read(name), rounded_weight(master.reader._reader.read(name)))
    finally:
        master.close()


def test_a_model_with_qat_gemms_is_idempotent_on_rounded_weights(qat_checkpoint):
    """eval builds a plain model from the rounded weights; the training forward (QAT gemm on raw
    weights) and a QAT gemm on the rounded weights compute the same: rounding twice is rounding once."""
    raw = _raw_expert_weights(qat_checkpoint)
    for w in raw.values():
        assert torch.equal(rounded_weight(rounded_weight(w)), rounded_weight(w))
    assert isinstance(qat_gemms("mxfp4")("x"), Mxfp4QatGemm)
