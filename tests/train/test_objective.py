"""The training-objective seam (train/objective.py, run/objectives.py): per-token log-probabilities, an
objective of one's own run by the unchanged loop, and the same objective added as one row of the
objective table, its metric shown on the console, in metrics.jsonl, the loggers and report.

The custom objective here has GRPO's shape: `prepare_step` scores the step's microbatches with a
forward-only pass (the "old policy" log-probabilities), the loss is the clipped-ratio surrogate
`-sum(min(r A, clip(r) A))` over the trained tokens with r = exp(logp - logp_old) and every
advantage A = 1, normalised by the trained tokens, and it adds its own metric. At the old policy
r = 1, so its gradient is that of -sum(logp): the cross-entropy objective's, which is what the
comparison checks, from the same initial weights (tests/tolerances.py).
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from typer.testing import CliRunner

from gptoss_cli.cli import app
from gptoss_cli.cli.train import TrainProgressBar
from gptoss_cli.model.loss import IGNORE_INDEX, HybridOutput
from gptoss_cli.recipe import schema
from gptoss_cli.run.objectives import OBJECTIVES, ObjectiveRow, build_objective, objective_row
from gptoss_cli.run.worker import run_worker
from gptoss_cli.train.loggers import scalar_tags
from gptoss_cli.train.loop import Trainer
from gptoss_cli.train.objective import CrossEntropyObjective, TrainingObjective, forward_step, router_losses, token_log_probs
from gptoss_cli.train.progress import MetricDisplay
from tests.tolerances import U_FP32, reassociation_rel
from tests.train.workers import TINY, tiny_plan


def test_token_log_probs_match_log_softmax_of_the_full_logits_with_gradients():
    torch.manual_seed(0)
    hidden = torch.randn(2, 6, 16, requires_grad=True)
    weight = torch.randn(37, 16, requires_grad=True)
    labels = torch.randint(0, 37, (2, 6))
    labels[0, 2] = labels[1, 5] = IGNORE_INDEX
    out = HybridOutput(hidden=hidden, head_weight=weight, loss_chunk_tokens=5)  # chunks cut across rows
    got = token_log_probs(out, labels)
    (got * torch.linspace(0.5, 2.0, 12).reshape(2, 6)).sum().backward()
    got_grads = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None

    ref_all = torch.log_softmax((hidden @ weight.T).double(), dim=-1)
    safe = labels.clamp(min=0)
    ref = ref_all.gather(-1, safe[..., None])[..., 0] * (labels != IGNORE_INDEX)
    (ref * torch.linspace(0.5, 2.0, 12, dtype=torch.float64).reshape(2, 6)).sum().backward()
    assert got.shape == labels.shape and got.dtype == torch.float32
    assert got[0, 2] == 0 and got[1, 5] == 0
    rel = reassociation_rel(n_terms=37 + 16)  # a softmax over the vocabulary of dot products of 16 terms
    torch.testing.assert_close(got.double(), ref.detach(), rtol=0, atol=rel * ref.abs().max().item())
    for g, name, t in zip(got_grads, ("hidden", "weight"), (hidden, weight)):
        torch.testing.assert_close(g, t.grad, rtol=0, atol=rel * t.grad.abs().max().item(), msg=name)


@dataclasses.dataclass
class ClippedRatioObjective(TrainingObjective):
    """GRPO's surrogate with all advantages 1 (see the module docstring)."""

    aux_loss_coeff: float = 0.0
    clip: float = 0.2
    forward_only_passes: int = 0
    name = "clipped_ratio_test"
    sums = ("nll_sum", "num_tokens", "ratio_sum")
    shown_metrics = (MetricDisplay("mean_ratio", label="mean ratio p / p_old", console="ratio", format=".4f"),
                     MetricDisplay("val_score", label="held-out score", console="val score", format=".2f"))

    @classmethod
    def from_recipe(cls, config):
        return cls(aux_loss_coeff=config.moe.aux_loss_coeff)

    def prepare_step(self, microbatches, context):
        mbs = list(microbatches)
        old = context.forward_only(self._score, mbs)
        self.forward_only_passes += 1
        for mb, log in zip(mbs, old):
            mb.extras["old_logp"] = log["logp"]
        return iter(mbs)

    def _score(self, data_iterator, model):
        mb = next(data_iterator)
        return model(mb.tokens, **mb.model_inputs()), lambda out: (
            torch.zeros(()), torch.zeros(()), {"logp": token_log_probs(out, mb.labels).detach()})

    def loss(self, microbatch, config, output):
        trained = microbatch.labels != IGNORE_INDEX
        logp = token_log_probs(output, microbatch.labels)
        ratio = torch.exp(logp - microbatch.extras["old_logp"])
        surrogate = torch.minimum(ratio, ratio.clamp(1 - self.clip, 1 + self.clip))
        tokens = trained.sum()
        logs = {"nll_sum": -(logp * trained).sum().detach(), "ratio_sum": (ratio * trained).sum().detach()}
        loss_sum = -(surrogate * trained).sum() + router_losses(output, tokens, self.aux_loss_coeff, 0.0, logs)
        return loss_sum, tokens, logs

    def metrics(self, sums):
        tokens = sums["num_tokens"]
        return {"loss": sums["nll_sum"] / tokens, "tokens": tokens, "mean_ratio": sums["ratio_sum"] / tokens}


def test_an_objective_of_ones_own_runs_in_the_loop_and_adds_its_metrics(tmp_path):
    plan = tiny_plan(str(tmp_path / "ce"), train_iters=1)
    default = run_worker(plan)
    objective = ClippedRatioObjective(aux_loss_coeff=plan.config.moe.aux_loss_coeff)
    custom = run_worker(dataclasses.replace(plan, run_dir=str(tmp_path / "own"), objective=objective))

    tokens = plan.config.training.global_batch_size * plan.config.training.seq_length
    # Same weights, same tokens: the two losses and gradients differ by the order of fp32 sums only
    # (over the tokens and the vocabulary; through the layers for the gradient).
    rel = reassociation_rel(n_terms=tokens + TINY.vocab_size, depth=2 * TINY.num_hidden_layers + 2)
    assert custom.losses[0] == pytest.approx(default.losses[0], rel=rel)
    assert custom.grad_norms[0] == pytest.approx(default.grad_norms[0], rel=rel)
    (record,) = [json.loads(line) for line in (tmp_path / "own" / "metrics.jsonl").read_text().splitlines()]
    assert abs(record["mean_ratio"] - 1.0) <= 8 * U_FP32  # the forward-only pass scored the same weights
    assert record["loss"] == custom.losses[0] and record["rank_tokens"] == tokens
    assert objective.forward_only_passes == 1  # one step: one forward-only scoring of its microbatches


class EvenStepValidation(Trainer):
    """The loop's Trainer with a held-out number of its own on even steps (as a kind's Trainer may have:
    DPO's held-out accuracy); its metrics.jsonl field is shown like the objective's own."""

    def validate(self, done):
        return {"val_score": 0.25 * done} if done % 2 == 0 else {}


def test_a_new_objective_is_one_class_and_one_table_row(tmp_path, monkeypatch, capsys):
    """The objective above as a row of the objective table and nothing else: the recipe's objective.kind
    picks it, and the metrics it declares are on the console line (its words and formats), in
    metrics.jsonl, in the loggers' scalars and in `gptoss report`'s summary and curves (its labels)."""
    row = ObjectiveRow(ClippedRatioObjective.from_recipe, EvenStepValidation)
    monkeypatch.setitem(OBJECTIVES, "clipped_ratio", row)
    monkeypatch.setenv("COLUMNS", "200")  # one line per step, unwrapped
    run = tmp_path / "run"
    run_worker(tiny_plan(str(run), train_iters=2, objective="clipped_ratio"), TrainProgressBar())

    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step")]
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) == len(records) == 2 and records[-1]["val_score"] == 0.5 and "val_score" not in records[0]
    assert f"loss {records[0]['loss']:.4f} ratio {records[0]['mean_ratio']:.4f} lr " in lines[0], lines[0]
    assert f"loss {records[1]['loss']:.4f} ratio {records[1]['mean_ratio']:.4f} val score 0.50 lr " in lines[1]
    for key in ("mean_ratio", "val_score"):
        assert scalar_tags(records[-1])[f"train/{key}"] == records[-1][key]  # TensorBoard / W&B
    result = CliRunner().invoke(app, ["report", str(run), "--no-plots", "--json", str(tmp_path / "summary.json")])
    assert result.exit_code == 0, result.output
    summary = json.loads((tmp_path / "summary.json").read_text())
    for key in ("mean_ratio", "val_score"):
        assert summary["curves"][key]["last"] == records[-1][key] and key in result.output
    from gptoss_cli.train.report import read_metrics

    assert read_metrics(run).curves[-2:] == (("mean_ratio", "mean ratio p / p_old"), ("val_score", "held-out score"))


def test_the_objective_table_has_a_row_for_every_kind_a_recipe_may_name():
    assert tuple(OBJECTIVES) == schema.OBJECTIVES
    from gptoss_cli.errors import ConfigError

    config = schema.RecipeConfig()
    config.objective.kind = "kto"
    with pytest.raises(ConfigError, match="objective.kind='kto': no such training objective"):
        objective_row(config)


def test_the_default_objective_is_the_recipes_cross_entropy(tmp_path):
    plan = tiny_plan(str(tmp_path), aux_loss_coeff=0.01)
    objective = build_objective(plan.config)
    assert isinstance(objective, CrossEntropyObjective) and objective.aux_loss_coeff == 0.01
    sums = {"lm_loss_sum": 12.0, "num_tokens": 4.0, "aux_loss_sum": 2.0, "z_loss_sum": 0.0}
    assert objective.metrics(sums) == {"loss": 3.0, "tokens": 4.0, "aux_loss": 0.5}
    assert callable(forward_step)
