"""Checkpoints: atomic with a `latest` pointer, bitwise resume on CPU, loading at another EP/DP layout."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed.checkpoint as dcp

from gptoss_cli.errors import TrainingError
from gptoss_cli.train.checkpointing import latest_checkpoint
from gptoss_cli.run.worker import run_worker
from gptoss_cli.train.progress import CheckpointSaved
from tests.tolerances import reassociation_rel
from tests.train.dist_helpers import once_per_session
from tests.train.workers import TINY, ep2_checkpoint_run, tiny_plan


class Killed(Exception):
    pass


def _kill_after_checkpoint(step: int):
    def progress(event):
        if isinstance(event, CheckpointSaved) and event.step == step:
            raise Killed(step)
    return progress


def _load_all(folder) -> dict[str, torch.Tensor]:
    """Every tensor of a DCP checkpoint, read independently of the training code."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    meta = FileSystemReader(str(folder)).read_metadata().state_dict_metadata
    out = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in meta.items()
           if isinstance(m, TensorStorageMetadata)}
    dcp.load(out, checkpoint_id=str(folder))
    return out


def test_save_kill_resume_gives_the_same_losses_bitwise(tmp_path):
    full = run_worker(tiny_plan(str(tmp_path / "full"), train_iters=6))
    ckpt = str(tmp_path / "ckpt")
    with pytest.raises(Killed):
        run_worker(tiny_plan(str(tmp_path / "a"), train_iters=6, checkpoint_dir=ckpt, save_interval=3),
                   _kill_after_checkpoint(3))
    # A save that died half-way must not become the latest.
    (tmp_path / "ckpt" / ".iter_0000004.partial").mkdir()
    resumed = run_worker(tiny_plan(str(tmp_path / "b"), train_iters=6, checkpoint_dir=ckpt, save_interval=3))
    assert resumed.resumed_from.endswith("iter_0000003")
    assert resumed.losses == full.losses[3:]
    assert resumed.grad_norms == full.grad_norms[3:]
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "iter_0000006"


def test_checkpoint_holds_model_optimizer_data_position_and_rng(tmp_path):
    run_worker(tiny_plan(str(tmp_path / "r"), train_iters=2, checkpoint_dir=str(tmp_path / "c")))
    folder = latest_checkpoint(tmp_path / "c")
    state = json.loads((folder / "train_state.json").read_text())
    assert state["step"] == 2 and state["consumed_samples"] == 8
    tensors = _load_all(folder)
    assert "model.decoder.layers.1.mlp.experts.linear_fc1.weight3" in tensors
    name = "decoder.layers.1.mlp.router.weight"
    assert {f"optimizer.{name}.{k}" for k in ("master", "exp_avg", "exp_avg_sq", "step")} <= tensors.keys()
    assert float(tensors[f"optimizer.{name}.step"]) == 2.0
    assert "rng.rank0" in tensors


def test_nan_loss_stops_with_training_error_and_is_never_checkpointed(tmp_path):
    # fp16 with an absurd learning rate overflows to NaN on the second step.
    plan = tiny_plan(str(tmp_path / "r"), params_dtype="fp16", lr=1e4, min_lr=1e4, warmup_iters=0, clip_grad=0.0,
                     train_iters=5, checkpoint_dir=str(tmp_path / "c"), save_interval=1, aux_loss_coeff=0.0,
                     seq_length=8, micro_batch_size=2, global_batch_size=2)
    with pytest.raises(TrainingError, match=r"loss is nan at step 2"):
        run_worker(plan)
    assert (tmp_path / "c" / "latest").read_text().strip() == "iter_0000001"
    assert not (tmp_path / "c" / "iter_0000002").exists()


@pytest.fixture(scope="module")
def ep2_checkpoint(tmp_path_factory):
    return once_per_session(tmp_path_factory, "ep2_checkpoint", ep2_checkpoint_run)


def test_checkpoint_saved_at_ep2_loads_at_ep1(ep2_checkpoint, tmp_path):
    import shutil

    work, ranks = ep2_checkpoint
    ckpt = tmp_path / "ckpt"
    shutil.copytree(work / "ckpt", ckpt)
    (ckpt / "latest").write_text("iter_0000002\n")
    saved = _load_all(ckpt / "iter_0000002")
    resumed = run_worker(tiny_plan(str(tmp_path / "run"), ep_size=1, train_iters=3, checkpoint_dir=str(ckpt)))
    assert resumed.resumed_from.endswith("iter_0000002") and resumed.steps == 1
    # Step 3 at EP=1 from the loaded step-2 state and step 3 of the EP=2 run start from the same
    # weights on the same batch, so their losses differ only by the order of sums
    # (tests/tolerances.py); a wrongly loaded expert or a lost data position moves it far more.
    loss_rel = reassociation_rel(TINY.hidden_size, depth=2 * TINY.num_hidden_layers + 1)
    assert resumed.losses[0] == pytest.approx(ranks[0]["losses"][2], rel=loss_rel)
    # Step 1 of both layouts starts from the same seeded weights (init depends on names, not ranks).
    reference = run_worker(tiny_plan(str(tmp_path / "ref"), ep_size=1, train_iters=1))
    assert ranks[0]["losses"][0] == pytest.approx(reference.losses[0], rel=loss_rel)
    # Every expert of the EP=2 checkpoint (written by two ranks) is present once, with its AdamW state.
    experts = [k for k in saved if k.startswith("model.") and ".mlp.experts." in k]
    assert len(experts) == 3 * 4 * 4  # 3 MoE layers x 4 experts x (fc1, fc2) x (weight, bias)
    assert all(f"optimizer.{k[len('model.'):]}.exp_avg" in saved for k in experts)
