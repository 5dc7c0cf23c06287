"""DcpReader's fetch-ahead: the experts of one per-expert stack (model/expert_names.py) are read together
up to the budget, every value as torch.distributed.checkpoint saved it."""

from __future__ import annotations

import torch

from gptoss_cli.checkpoint.storage.dcp_io import DcpReader, quiet_single_process

EXPERTS = 4
STACKS = ["decoder.layers.1.mlp.experts.linear_fc1.weight", "decoder.layers.1.mlp.experts.linear_fc2.bias",
          "decoder.layers.1.mlp.experts.linear_fc1.adapter.linear_in.weight"]
DENSE = ["decoder.layers.0.self_attention.linear_qkv.weight", "decoder.final_norm.weight"]


def _save(folder) -> dict[str, torch.Tensor]:
    import torch.distributed.checkpoint as dcp

    g = torch.Generator().manual_seed(0)
    tensors = {n: torch.randn(3, 5, generator=g) for n in DENSE}
    tensors |= {f"{s}{e}": torch.randn(6, 2, generator=g) for s in STACKS for e in range(EXPERTS)}
    with quiet_single_process():
        dcp.save({f"model.{n}": t for n, t in tensors.items()}, checkpoint_id=str(folder), no_dist=True)
    return tensors


def _reader(folder, budget: int) -> DcpReader:
    return DcpReader(folder, lambda n: f"model.{n}",
                     lambda k: k.removeprefix("model.") if k.startswith("model.") else None, budget_bytes=budget)


def test_one_load_per_stack_within_the_budget(tmp_path):
    saved = _save(tmp_path)
    reader = _reader(tmp_path, budget=EXPERTS * 6 * 2 * 4)  # exactly one stack of fp32 experts
    for s in STACKS:
        for e in range(EXPERTS):
            assert torch.equal(reader.read(f"{s}{e}"), saved[f"{s}{e}"])
    assert reader.loads == len(STACKS)  # LoRA factors are per-expert stacks like the base experts
    for n in DENSE:
        assert torch.equal(reader.read(n), saved[n])
    assert reader.loads == len(STACKS) + len(DENSE)


def test_a_budget_of_one_expert_loads_each_alone(tmp_path):
    saved = _save(tmp_path)
    reader = _reader(tmp_path, budget=1)
    for e in range(EXPERTS):
        assert torch.equal(reader.read(f"{STACKS[0]}{e}"), saved[f"{STACKS[0]}{e}"])
    assert reader.loads == EXPERTS
