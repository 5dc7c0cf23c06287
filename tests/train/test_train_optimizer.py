"""AdamW with fp32 master weights, weight-decay groups, global-norm clipping, non-finite guards and the
warmup + cosine schedule (the class, and the lr column the training loop writes)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn

from gptoss_cli.errors import TrainingError
from gptoss_cli.parallel.grads import GradAccumulatingModel
from gptoss_cli.parallel.state import ParallelState
from gptoss_cli.model.config import preset
from gptoss_cli.model.hybrid import HybridModel
from gptoss_cli.model.pattern import parse_pattern
from tests.train.jobs import optimizer_config, train_job
from gptoss_cli.train.optimizer import DistributedAdamW, WarmupCosineLR, decays, flat_range_boxes

TINY = preset("tiny")


class Linear(nn.Module):
    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(4, 4, dtype=dtype))

    def forward(self, x):
        return (self.weight * x).sum()


def _model(dtype=torch.float32) -> GradAccumulatingModel:
    return GradAccumulatingModel(Linear(dtype), ParallelState())


def test_bf16_parameters_keep_fp32_master_weights():
    model = _model(torch.bfloat16)
    opt = DistributedAdamW(model, ParallelState(), optimizer_config(weight_decay=0.0, clip_grad=0.0), lr=1e-4)
    for _ in range(5):
        model.zero_grad_buffer()
        model(torch.ones(()).to(torch.bfloat16)).backward()
        opt.step(1e-4)
    master = opt.state_dict()["weight.master"]
    assert master.dtype == torch.float32
    assert float(master[0, 0]) == pytest.approx(1.0 - 5e-4, abs=1e-6)  # 5 Adam steps of lr each
    assert torch.equal(model.module.weight, master.to(torch.bfloat16))  # bf16 cannot hold 0.9995: still 1.0
    assert float(model.module.weight[0, 0]) == 1.0


def test_fp32_parameters_are_their_own_master_weights():
    # No second fp32 copy of fp32 weights: the master state is the parameter's storage, an update
    # lands in the parameter, and a loaded master (resume) is the parameter at once.
    model = _model()
    opt = DistributedAdamW(model, ParallelState(), optimizer_config(weight_decay=0.0, clip_grad=0.0), lr=1e-4)
    master = opt.state_dict()["weight.master"]
    assert master.data_ptr() == model.module.weight.data_ptr()
    model(torch.ones(())).backward()
    opt.step(1e-4)
    assert float(model.module.weight[0, 0]) == pytest.approx(1.0 - 1e-4, abs=1e-7)
    assert torch.equal(master, model.module.weight.detach())
    master.copy_(torch.full((4, 4), 3.0))  # what DCP's in-place load does
    opt.after_load()
    assert torch.equal(model.module.weight.detach(), torch.full((4, 4), 3.0))


def test_gradients_are_clipped_to_the_global_norm():
    model = _model()
    opt = DistributedAdamW(model, ParallelState(), optimizer_config(clip_grad=0.5), lr=1e-3)
    model(torch.full((), 10.0)).backward()
    assert opt.step(1e-3) == pytest.approx(40.0)  # ||10 * ones(4,4)|| = 40
    assert float(model.module.weight.main_grad.norm()) == pytest.approx(0.5, rel=1e-5)


def test_non_finite_gradient_norm_stops_before_the_update():
    model = _model()
    opt = DistributedAdamW(model, ParallelState(), optimizer_config(clip_grad=0.0), lr=1e-3)
    model(torch.full((), float("inf"))).backward()
    with pytest.raises(TrainingError, match="gradient norm is"):
        opt.step(1e-3)
    assert torch.equal(model.module.weight, torch.ones(4, 4))


def megatron_lr(step: int, lr: float, min_lr: float, warmup: int, decay: int, style: str = "cosine") -> float:
    """Megatron's OptimizerParamScheduler.get_lr with num_steps = steps done before this one and
    lr_warmup_init = 0 (docs/megatron-rules.md, "Learning-rate schedule"), written out by hand."""
    if warmup > 0 and step <= warmup:
        return lr * step / warmup
    if style == "constant":
        return lr
    if step > decay:
        return min_lr
    ratio = (step - warmup) / (decay - warmup)
    coeff = 1.0 - ratio if style == "linear" else 0.5 * (math.cos(math.pi * ratio) + 1.0)
    return min_lr + coeff * (lr - min_lr)


def test_warmup_starts_at_zero_and_reaches_lr_at_step_warmup_iters_as_megatron():
    s = WarmupCosineLR(lr=1.0, min_lr=0.1, warmup_iters=4, decay_iters=14)
    assert [s.lr_at(i) for i in range(5)] == [0.0, 0.25, 0.5, 0.75, 1.0]
    assert s.lr_at(9) == pytest.approx(0.55)  # half way through the decay
    assert s.lr_at(14) == pytest.approx(0.1) and s.lr_at(100) == pytest.approx(0.1)
    for style in ("cosine", "linear", "constant"):
        s = WarmupCosineLR(lr=1.0, min_lr=0.1, warmup_iters=3, decay_iters=11, style=style)
        assert [s.lr_at(i) for i in range(14)] == pytest.approx(
            [megatron_lr(i, 1.0, 0.1, 3, 11, style) for i in range(14)], rel=1e-12, abs=0)


def test_without_warmup_the_first_step_uses_the_full_lr():
    s = WarmupCosineLR(lr=2.0, min_lr=0.0, warmup_iters=0, decay_iters=4)
    assert [s.lr_at(i) for i in range(5)] == pytest.approx([megatron_lr(i, 2.0, 0.0, 0, 4) for i in range(5)])
    assert s.lr_at(0) == 2.0


def test_metrics_lr_column_follows_megatron_schedule_through_the_loop(tmp_path):
    from gptoss_cli.run.worker import run_worker

    plan = train_job(tmp_path, name="lr", device="cpu", seq_length=8, micro_batch_size=1, global_batch_size=1,
                     train_iters=7, lr=1e-3, min_lr=1e-4, warmup_iters=2, lr_decay_iters=6, lr_decay_style="cosine")
    run_worker(plan)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 8))  # step = steps done after this row's update
    assert [r["lr"] for r in rows] == pytest.approx([megatron_lr(i, 1e-3, 1e-4, 2, 6) for i in range(7)],
                                                    rel=1e-12, abs=0)
    assert rows[0]["lr"] == 0.0 and rows[2]["lr"] == 1e-3 and rows[6]["lr"] == pytest.approx(1e-4)


# --- weight-decay groups by name --------------------------------------------------------------
# Independent of `decays`: the leaves of the Hybrid model that must not decay, by what they are.
NO_DECAY_SUFFIXES = (
    "self_attention.linear_qkv.layer_norm_weight", "self_attention.linear_qkv.bias",
    "self_attention.core_attention.softmax_offset", "self_attention.linear_proj.bias",
    "pre_mlp_layernorm.weight", "mlp.router.bias", "mlp.experts.linear_fc1.bias", "mlp.experts.linear_fc2.bias",
    "mlp.linear_fc1.bias", "mlp.linear_fc2.bias", "decoder.final_norm.weight",
)
DECAY_SUFFIXES = (
    "embedding.word_embeddings.weight", "self_attention.linear_qkv.weight", "self_attention.linear_proj.weight",
    "mlp.router.weight", "mlp.experts.linear_fc1.weight", "mlp.experts.linear_fc2.weight",
    "mlp.linear_fc1.weight", "mlp.linear_fc2.weight", "output_layer.weight",
)


def _decayed_by_one_step(pattern: str, **model_kw) -> tuple[set[str], set[str], set[str]]:
    """(all parameter names, decayed, not decayed) after one step of DistributedAdamW with zero
    gradients on a real HybridModel: Adam's update is then exactly 0, so a parameter changes only
    by AdamW's decoupled decay, p <- p * (1 - lr * weight_decay), element by element."""
    lr, wd = 0.25, 0.5
    module = HybridModel(TINY, parse_pattern(pattern), **model_kw)
    with torch.no_grad():
        for p in module.parameters():
            p.fill_(1.0)
    opt = DistributedAdamW(GradAccumulatingModel(module, ParallelState()), ParallelState(),
                           optimizer_config(weight_decay=wd, clip_grad=0.0, use_distributed_optimizer=False), lr=lr)
    opt.step(lr)
    decayed, kept = set(), set()
    for name, p in module.named_parameters():
        if torch.equal(p, torch.full_like(p, 1.0 - lr * wd)):
            decayed.add(name)
        elif torch.equal(p, torch.ones_like(p)):
            kept.add(name)
    return {n for n, _ in module.named_parameters()}, decayed, kept


@pytest.mark.parametrize("pattern,model_kw", [
    ("*E*E*E", {}),
    ("*E*-[*E]", {"expert_offset": 2, "num_local_experts": 2}),  # a dense MLP layer, an EP slice of experts
], ids=["moe", "dense-and-ep-slice"])
def test_weight_decay_applies_by_parameter_name(pattern, model_kw):
    names, decayed, kept = _decayed_by_one_step(pattern, **model_kw)
    assert decayed | kept == names and not decayed & kept  # every element of every parameter one way
    assert kept == {n for n in names if n.endswith(NO_DECAY_SUFFIXES)}
    assert decayed == {n for n in names if n.endswith(DECAY_SUFFIXES)}
    # the stacked expert biases [E_local, out] are 2-D yet biases: the bug a shape rule had
    stacked_biases = {n for n in kept if ".mlp.experts." in n}
    assert stacked_biases and all(dict(HybridModel(TINY, parse_pattern(pattern), **model_kw).named_parameters())[n].dim() == 2
                                  for n in stacked_biases)
    assert any(".mlp.router.bias" in n for n in kept) and any("softmax_offset" in n for n in kept)


def test_decay_rule_equals_megatrons_on_per_expert_checkpoint_tensors():
    # Megatron holds one 1-D bias per expert, where its rule `name.endswith(".bias") or dim == 1`
    # is right; on those names and shapes ours must agree with it.
    model = HybridModel(TINY)
    slots = list(model.named_checkpoint_slots())
    assert any(n.endswith("linear_fc1.bias3") for n, _ in slots)
    for name, tensor in slots:
        assert decays(name) == (not (name.endswith(".bias") or tensor.dim() == 1)), name


def test_a_flat_range_is_cut_into_boxes_that_cover_it_in_order():
    """How a shard that cuts through a parameter is saved: its flat range of the row-major tensor
    as boxes (what DCP stores), each box exactly the next contiguous run of the range."""
    shape = (3, 4, 5)
    for lo, hi in [(0, 60), (7, 8), (7, 53), (20, 40), (3, 18), (5, 5)]:
        flat = torch.zeros(60, dtype=torch.long)
        boxes = flat_range_boxes(lo, hi, shape)
        assert len(boxes) <= 1 + 2 * (len(shape) - 1)
        cursor = lo
        for k, (offsets, sizes, a, b) in enumerate(boxes, start=1):
            assert a == cursor and b > a
            flat.view(shape)[tuple(slice(o, o + n) for o, n in zip(offsets, sizes))] = k
            assert bool((flat[a:b] == k).all()) and int((flat == k).sum()) == b - a
            cursor = b
        assert cursor == hi if boxes else lo == hi
        assert torch.equal(flat > 0, (torch.arange(60) >= lo) & (torch.arange(60) < hi))
