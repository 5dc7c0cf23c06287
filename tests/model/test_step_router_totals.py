"""A training step's router numbers against transformers' router and Megatron's z-loss, over microbatches
of different sizes: metrics.jsonl's `router_entropy` is the mean over routed tokens (not token x k
assignments) of the entropy of the softmax over all experts, and the step's `aux_loss` and `z_loss` are
each microbatch's value weighted by its trained tokens (as they enter the objective, train/objective.py).

The path is training's own: `CrossEntropyObjective.loss` per microbatch (logged as the schedules log it),
`StepTotals.vector` over the step with the objective's `sums`, its `metrics` and `router_record`."""

from __future__ import annotations

import pytest
import torch

from gptoss_cli.model.hybrid import HybridModel
from gptoss_cli.train.data import Microbatch
from gptoss_cli.train.objective import CrossEntropyObjective
from gptoss_cli.train.telemetry import StepTotals
from tests.model.conftest import TINY, hf_to_hybrid_state_dict
from tests.model.test_router_telemetry import _hf_router_outputs
from tests.tolerances import reassociation_rel

IGNORE = -100
AUX, Z = 0.01, 1e-3


def test_step_entropy_aux_and_z_equal_transformers_router_weighted_by_each_microbatchs_tokens(hf_tiny):
    from transformers.models.gpt_oss.modeling_gpt_oss import load_balancing_loss_func

    moe_utils = pytest.importorskip("megatron.core.transformer.moe.moe_utils")
    g = torch.Generator().manual_seed(40)
    # two microbatches: 2 x 10 routed tokens with 19 trained, 1 x 6 with 2 trained
    batches = [torch.randint(0, TINY.vocab_size, shape, generator=g) for shape in ((2, 10), (1, 6))]
    labels = [b.clone() for b in batches]
    labels[0][0, 0] = IGNORE
    labels[1][0, :4] = IGNORE
    model = HybridModel(TINY)
    model.load_state_dict(hf_to_hybrid_state_dict(hf_tiny.state_dict()), strict=True)
    model.aux_loss_coef, model.z_loss_coef = AUX, Z
    model.train()
    objective = CrossEntropyObjective(aux_loss_coeff=AUX, z_loss_coeff=Z)
    logs = []
    with torch.no_grad():
        for ids, lab in zip(batches, labels):
            loss_sum, num_tokens, extra = objective.loss(Microbatch(tokens=ids, labels=lab), None, model(ids))
            logs.append({"loss_sum": loss_sum, "num_tokens": num_tokens, **extra})  # as schedule/plain.py records it
    moe_layers = [j for j, s in enumerate(model.pattern.layers) if s == "E"]
    totals = StepTotals(layers=moe_layers, num_experts=TINY.num_local_experts, scalars_names=objective.sums)
    values = totals.vector(logs, torch.device("cpu")).tolist()
    scalars = totals.scalars(values)
    metrics = objective.metrics(scalars)
    record = totals.router_record(values)

    trained = [int((lab != IGNORE).sum()) for lab in labels]
    assert scalars["num_tokens"] == sum(trained) == 21
    # per microbatch, per layer [T, E]
    per_mb = [[logits.double() for logits, _ in _hf_router_outputs(hf_tiny, ids)] for ids in batches]
    aux = [float(load_balancing_loss_func(tuple(layers), TINY.num_local_experts, TINY.num_experts_per_tok))
           for layers in per_mb]
    z = [float(sum(moe_utils.z_loss_func(logits, 1.0) for logits in layers)) for layers in per_mb]
    want_aux = sum(a * n for a, n in zip(aux, trained)) / sum(trained)
    want_z = sum(v * n for v, n in zip(z, trained)) / sum(trained)
    # fp32 router statistics against float64 logits: a few ulps per term over 26 tokens x 4 experts x 3 layers
    rel = reassociation_rel(26 * TINY.num_local_experts * TINY.num_hidden_layers, depth=4)
    assert metrics["aux_loss"] == pytest.approx(want_aux, rel=rel)
    assert metrics["z_loss"] == pytest.approx(want_z, rel=rel)
    assert abs(aux[0] - aux[1]) > 100 * rel * want_aux and abs(z[0] - z[1]) > 100 * rel * want_z  # weighting shows
    for log, a, v, n in zip(logs, aux, z, trained):  # and the objective: each microbatch's terms x its tokens
        added = float(log["loss_sum"] - log["lm_loss_sum"])
        assert added == pytest.approx(AUX * a * n + Z * v * n, rel=rel)

    for i, layer in enumerate(moe_layers):
        logits = torch.cat([layers[i] for layers in per_mb])  # all 26 routed tokens of the step
        p = torch.softmax(logits, dim=-1)
        want = float(-(p * p.log()).sum(-1).mean())
        assert record["router_entropy"][str(layer)] == pytest.approx(want, rel=rel), layer
        assert sum(record["expert_load"][str(layer)]) == logits.shape[0] * TINY.num_experts_per_tok
