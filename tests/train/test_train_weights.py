"""Initial weights for training: seeded (layout-free), Hybrid checkpoint or HF checkpoint, own experts only."""

from __future__ import annotations

import math

import pytest
import torch

from gptoss_cli.checkpoint.convert import convert
from gptoss_cli.checkpoint.make_tiny import make_tiny
from gptoss_cli.checkpoint.storage.safetensors_io import CheckpointReader
from gptoss_cli.model.config import preset
from gptoss_cli.parallel.state import ParallelState
from gptoss_cli.train.provider import HybridModelProvider
from tests.train.jobs import runtime_config, train_job

TINY = preset("tiny")


def _provider(weights=None) -> HybridModelProvider:
    return HybridModelProvider(runtime_config(), seed=11, weights=weights)


def _slots(model) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in model.named_checkpoint_slots()}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("weights")
    make_tiny(root / "hf", experts="bf16", dtype="float32", seed=3)
    convert(str(root / "hf"), root / "hybrid", dtype="float32")
    return root / "hf", root / "hybrid"


def test_seeded_init_is_the_same_for_every_ep_layout():
    full = _slots(_provider().provide(ParallelState()))
    for ep_rank in (0, 1):
        part = _slots(_provider().provide(ParallelState(ep_size=2, ep_rank=ep_rank)))
        assert part and all(torch.equal(t, full[n]) for n, t in part.items())
        assert {n for n in part if ".experts." in n} < {n for n in full if ".experts." in n}


def test_hf_checkpoint_maps_to_the_same_weights_as_its_hybrid_conversion(checkpoints):
    hf, hybrid = checkpoints
    from_hf = _slots(_provider(str(hf)).provide(ParallelState()))
    from_hybrid = _slots(_provider(str(hybrid)).provide(ParallelState()))
    assert from_hf.keys() == from_hybrid.keys()
    for name in from_hf:
        assert torch.equal(from_hf[name], from_hybrid[name]), name


def test_each_ep_rank_reads_only_its_own_experts(checkpoints, monkeypatch):
    hf, hybrid = checkpoints
    reads: list[tuple[str, int | None, int | None]] = []
    original = CheckpointReader.read

    def spy(self, name, start=None, stop=None):
        reads.append((name, start, stop))
        return original(self, name, start, stop)

    monkeypatch.setattr(CheckpointReader, "read", spy)
    model = _provider(str(hybrid)).provide(ParallelState(ep_size=2, ep_rank=1))
    expert_reads = [n for n, _, _ in reads if ".mlp.experts." in n]
    assert expert_reads and all(n.endswith(("2", "3")) for n in expert_reads)  # experts 2 and 3 only
    reads.clear()
    from_hf = _slots(_provider(str(hf)).provide(ParallelState(ep_size=2, ep_rank=1)))
    stacked = [(s, e) for n, s, e in reads if ".mlp.experts." in n]
    assert stacked and all((s, e) == (2, 4) for s, e in stacked)  # HF stacks read as rows [2, 4)
    ref = _slots(model)
    assert all(torch.equal(from_hf[n], ref[n]) for n in ref)


def test_training_from_a_vocab_padded_hybrid_equals_training_from_the_unpadded_one(checkpoints, tmp_path):
    """Two steps from a Hybrid folder with Megatron's vocabulary padding (1024 rows) give the losses
    and gradient norms of the same steps from the unpadded folder, and no padding row is trained."""
    from tests.model.tiny_checkpoints import write_padded_hybrid
    from gptoss_cli.run.worker import run_worker

    _, hybrid = checkpoints
    padded = write_padded_hybrid(hybrid, tmp_path / "padded")

    def train(weights, run):
        plan = train_job(tmp_path / run, name="pad", seq_length=16, micro_batch_size=2, global_batch_size=2,
                         train_iters=2, device="cpu", pretrained=str(weights), lr=1e-3, warmup_iters=0)
        return run_worker(plan)

    ours, want = train(padded, "padded"), train(hybrid, "unpadded")
    assert ours.losses == want.losses and ours.grad_norms == want.grad_norms
    assert abs(want.losses[0] - math.log(TINY.vocab_size)) < 2  # a real model's loss, not a padded-logit one
