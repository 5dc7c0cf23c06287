"""GRPO with LoRA on a tiny converted checkpoint: the adapters train, the base does not, and the KL term's
reference is the base with the adapters off.

At the first step the adapters' B matrices are zero, so the policy is the base exactly and the k3 estimate
of KL(policy || reference) is 0 to rounding; after one update the adapters move the policy and it is not.
A reference that kept the adapters on would stay at 0 (the policy itself). The saved checkpoint holds
only the adapters, the B matrices nonzero, and the base with its adapters detached computes the
pretrained checkpoint's logits bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from gptoss_cli.checkpoint.load import checkpoint_architecture, model_from_checkpoint
from gptoss_cli.checkpoint.sources import open_source
from gptoss_cli.checkpoint.formats.training.record import latest_checkpoint
from gptoss_cli.model.expert_names import checkpoint_slots
from gptoss_cli.model.lora import LoraSettings, attach_lora
from gptoss_cli.rl.reference import adapters_off
from gptoss_cli.run.worker import run_worker
from tests.model.tiny_checkpoints import write_converted_pair
from tests.rl.helpers import grpo_job, metrics

ALL = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")


def test_grpo_lora_trains_the_adapters_against_the_base_with_adapters_off(tmp_path):
    _, hybrid = write_converted_pair(tmp_path / "base", "bf16", seed=5)
    arch, _ = checkpoint_architecture(hybrid)
    job = grpo_job(tmp_path, arch=arch, pretrained=str(hybrid), lora_rank=4, lora_alpha=8.0, lora_targets=list(ALL),
                   kl_coeff=0.1, train_iters=2, checkpoint_dir=str(tmp_path / "ckpt"), save_interval=2,
                   use_distributed_optimizer=False)
    run_worker(job)
    rows = metrics(job.run_dir)
    # k3 at identical log-probabilities is exp(0) - 0 - 1 = 0; after one update the policy has moved
    assert rows[0]["kl_ref"] < 1e-7 and rows[1]["kl_ref"] > 1e-5, [r["kl_ref"] for r in rows]

    source = open_source(str(latest_checkpoint(tmp_path / "ckpt")), adapters_only=True)
    try:
        adapters = {n: source.reader.read(n).clone() for n in source.reader.names()}
    finally:
        source.close()
    assert adapters and all(".adapter." in n for n in adapters), sorted(adapters)[:4]
    trained = [n for n in adapters if "linear_out" in n]  # B: zero at the start (model/lora.py)
    assert trained and all(adapters[n].abs().max() > 0 for n in trained)

    base = model_from_checkpoint(hybrid).eval()
    policy = model_from_checkpoint(hybrid)
    attach_lora(policy, LoraSettings(rank=4, alpha=8.0, target_modules=ALL))
    with torch.no_grad():
        for name, dest in checkpoint_slots(policy):
            if name in adapters:
                dest.copy_(adapters.pop(name))
    assert not adapters
    tokens = torch.arange(3, 19).reshape(1, 16)
    with torch.no_grad():
        moved = policy.eval()(tokens)
        with adapters_off(policy):
            off = policy(tokens)
        reference = base(tokens)
    logits = (lambda out: out if isinstance(out, torch.Tensor) else out.logits)
    assert torch.equal(logits(off), logits(reference))
    assert not torch.allclose(logits(moved), logits(reference))
