"""What a training checkpoint holds beyond the weights: the optimizer state is checked before a save and
exported on request, in the cases where it differs from the model (bf16 parameters, a bad Adam moment)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gptoss_cli.errors import TrainingError
from gptoss_cli.checkpoint.formats.training.record import run_record
from gptoss_cli.model.config import preset
from gptoss_cli.parallel.state import ParallelState
from gptoss_cli.schedule import get_forward_backward_func
from gptoss_cli.train.checkpointing import save_checkpoint
from gptoss_cli.train.data import DataLoaderState
from gptoss_cli.train.objective import forward_step
from gptoss_cli.train.provider import HybridModelProvider
from gptoss_cli.train.setup import setup_model_and_optimizer
from tests.train.jobs import optimizer_config, runtime_config
from tests.train.workers import SEQ, RandomTokens

TINY = preset("tiny")


def _stepped(params_dtype: str):
    """A one-process model and optimizer after one AdamW step (so the master copies moved off the grid of
    `params_dtype`)."""
    state = ParallelState()
    provider = HybridModelProvider(runtime_config(params_dtype=params_dtype), seed=7)
    setup = setup_model_and_optimizer(provider, state, optimizer_config(), 1e-2)
    data = DataLoaderState(RandomTokens(TINY.vocab_size, SEQ), global_batch_size=2, micro_batch_size=2,
                           dp_rank=0, dp_size=1)
    get_forward_backward_func(setup.config)(forward_step_func=forward_step, data_iterator=data.step_iterator(),
                                            model=setup.model, num_microbatches=data.num_microbatches)
    setup.optimizer.step(1e-2)
    return state, setup


def _save(ckpt: Path, state, setup, params_dtype: str) -> Path:
    record = run_record(arch=TINY, hybrid_layer_pattern="*E" * TINY.num_hidden_layers, params_dtype=params_dtype,
                        name="saved-state", run_dir=ckpt.parent / "run")
    return save_checkpoint(ckpt, step=1, model=setup.model.module, optimizer=setup.optimizer,
                           train_state={"consumed_samples": 2, "run": record}, state=state)


def test_a_nan_only_in_an_adam_moment_stops_the_save(tmp_path):
    state, setup = _stepped("fp32")
    shard = setup.optimizer.shards[-1]
    shard.exp_avg_sq[shard.exp_avg_sq.numel() // 2] = float("nan")  # the parameters and the master stay finite
    assert all(torch.isfinite(p).all() for p in setup.model.module.parameters())
    ckpt = tmp_path / "ckpt"
    with pytest.raises(TrainingError, match=r"1 of \d+ parameter and optimizer tensors are not finite "
                                            r"\(first: optimizer\.\S+\.exp_avg_sq\)"):
        _save(ckpt, state, setup, "fp32")
    assert not ckpt.exists() or sorted(p.name for p in ckpt.iterdir()) == []


def test_convert_weights_master_exports_the_fp32_masters_of_a_bf16_run(tmp_path):
    from safetensors.torch import load_file

    import torch.distributed.checkpoint as dcp
    from gptoss_cli.checkpoint.convert import convert

    state, setup = _stepped("bf16")
    folder = _save(tmp_path / "ckpt", state, setup, "bf16")
    outs = {}
    for weights in ("master", "model"):
        outs[weights] = tmp_path / weights
        convert(str(tmp_path / "ckpt"), outs[weights], weights=weights, dtype="float32")
    exported = {w: {k: v for f in sorted(o.glob("*.safetensors")) for k, v in load_file(f).items()}
                for w, o in outs.items()}
    # DCP's own reading of the checkpoint is the reference for both sources.
    want = {f"optimizer.{n}.master": torch.empty(t.shape) for n, t in exported["master"].items()}
    want.update({f"model.{n}": torch.empty(t.shape, dtype=torch.bfloat16) for n, t in exported["model"].items()})
    dcp.load(want, checkpoint_id=str(folder))
    differ = 0
    for name, t in exported["master"].items():
        assert torch.equal(t, want[f"optimizer.{name}.master"]), name
        assert torch.equal(exported["model"][name], want[f"model.{name}"].float()), name
        differ += not torch.equal(t, exported["model"][name])
    # bf16 parameters are the masters rounded to 8 significant bits: after a step nearly every tensor differs.
    assert differ >= len(exported["master"]) - 2, (differ, len(exported["master"]))
