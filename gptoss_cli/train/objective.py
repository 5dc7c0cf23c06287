"""The training objective: what one step computes from its batch, behind one small interface.

A step (train/loop.py, `Trainer.train_step`) hands its microbatches to the objective's
`prepare_step`, then runs the schedule over them; the schedule calls `forward_step(data_iterator,
model)` once per microbatch (Megatron's contract: the model's output, or its schedule plan, and a
`loss_func`), and `loss_func(output)` returns `(loss_sum, normaliser, logs)`:

- `loss_sum`: the objective SUMMED over the microbatch (a scalar with gradients). Never a mean:
  gradients are divided once, after the last backward, by the normaliser summed over every
  microbatch of the step and every data-parallel rank (parallel/grads.py, `finalize_model_grads`),
  so a step's gradient is that of `sum(loss_sum) / sum(normaliser)` over the global batch whatever
  the microbatch and DP split. Next-token cross-entropy counts trained tokens; an objective that
  wants a per-sequence mean returns sequences as its normaliser and per-sequence means as its sum.
- `logs`: device tensors only (reading one back would stall the host once per microbatch). The
  names in `sums` are added up over the step's microbatches and DP ranks in the step's one
  collective (train/telemetry.py); `metrics(sums)` turns the reduced sums into the step's
  metrics.jsonl fields, of which `loss` (checked finite before the optimizer step, shown, plotted)
  and `tokens` (for tokens/s) are required.

`loss_func` must depend on the microbatch and the output only, never on state kept between calls:
the overlap schedule computes it inside the last node of a schedule plan, and a pipeline schedule
computes it on the last stage only. Per-token log-probabilities (what policy-gradient objectives
need instead of one mean loss) come from `token_log_probs(output, labels)`, chunked over tokens
like the loss itself. `prepare_step` sees the step's microbatches before the schedule does, with a
`StepContext` that can run forward-only passes over them (`forward_only`), which is where an
objective that needs the current or a reference policy's log-probabilities of the batch gets them;
per-position inputs such as advantages or those log-probabilities ride on `Microbatch.extras`.

An objective is built from a recipe by its class's `from_recipe(config)`, which reads the recipe's
section for it; gptoss_cli/run/objectives.py's table is the one place a recipe's `objective.kind`
picks the objective (and the Trainer that runs it). A `TrainJob` may carry its own instead
(`TrainJob.objective`), which is how an objective is run without a recipe kind. Objectives travel to
spawned workers inside the job: plain, picklable objects. `shown_metrics` names the metrics (of
`metrics`, or of the objective's Trainer) that `gptoss train`'s console line and `gptoss report`
show, with their labels: the loop hands them on without knowing their names (train/progress.py,
`MetricDisplay`).
"""

from __future__ import annotations

import abc
import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Iterator

import torch
import torch.nn.functional as F

from gptoss_cli.model.lm_head import chunked_log_probs, labelled_rows
from gptoss_cli.model.loss import IGNORE_INDEX, HybridOutput, lm_loss_sum
from gptoss_cli.model.loss_chunk import lm_loss_chunk_tokens
from gptoss_cli.parallel.grads import get_attr_wrapped_model, get_model_config
from gptoss_cli.parallel.state import ParallelState
from gptoss_cli.recipe.schema import RecipeConfig
from gptoss_cli.train.data import Microbatch
from gptoss_cli.train.progress import MetricDisplay

if TYPE_CHECKING:  # the provider builds the model this module's objectives score: imported for types only
    from gptoss_cli.train.provider import ModelRuntimeConfig

@dataclass
class StepContext:
    """What `prepare_step` may use: the step number, the wrapped model, and forward-only passes through
    the run's own schedule (`schedule`: `get_forward_backward_func`'s choice; a pipeline schedule runs
    them stage by stage as it runs the step)."""

    step: int  # 0-based: optimizer steps done before this one
    model: torch.nn.Module
    state: ParallelState
    schedule: Callable[..., list[dict[str, Any]]] | None = None  # None: the plain schedule

    def forward_only(self, forward_step_func: Callable[..., Any], microbatches: list[Microbatch]) -> list[dict[str, Any]]:
        """Run `forward_step_func` over `microbatches` without gradients (no backward, no gradient
        reduction; with pipeline parallelism the logs are handed from the last stage to every
        rank); one log dict per microbatch, as its loss_func returned them."""
        schedule = self.schedule
        if schedule is None:
            from gptoss_cli.schedule.plain import forward_backward_no_pipelining as schedule  # noqa: PLC0415
        with torch.no_grad():
            return schedule(forward_step_func=forward_step_func, data_iterator=iter(microbatches), model=self.model,
                            num_microbatches=len(microbatches), forward_only=True)


class TrainingObjective(abc.ABC):
    """What a training step computes from its batch (see the module docstring for the contract)."""

    name: ClassVar[str]
    # Names in every microbatch's logs that the step adds up (device scalars). The schedule puts
    # `loss_sum` and `num_tokens` (the normaliser) in every log itself.
    sums: ClassVar[tuple[str, ...]] = ("loss_sum", "num_tokens")
    # The step's metrics (metrics.jsonl fields) the console line and `gptoss report` show, in this
    # order, with their labels and formats; every metric goes to metrics.jsonl and the loggers anyway.
    shown_metrics: ClassVar[tuple[MetricDisplay, ...]] = ()

    @classmethod
    def from_recipe(cls, config: RecipeConfig) -> "TrainingObjective":
        """The objective a recipe (`RecipeConfig`) asks for, from its section for this objective: what
        the objective table (gptoss_cli/run/objectives.py) calls for the recipe's `objective.kind`."""
        raise NotImplementedError(f"{cls.__name__} is not built from a recipe: hand it to the run in TrainJob.objective")

    def prepare_step(self, microbatches: Iterator[Microbatch], context: StepContext) -> Iterator[Microbatch]:
        """The step's microbatches, before the schedule runs them; the default hands them on as they come."""
        return microbatches

    def forward_step(self, data_iterator: Iterator[Microbatch], model: torch.nn.Module,
                     return_schedule_plan: bool = False) -> tuple[Any, Callable[[Any], Any]]:
        """Megatron's forward_step: the next microbatch through the model (or its schedule plan, which
        the overlap schedule asks for and runs itself), and the loss_func for its output."""
        mb = next(data_iterator)
        loss_func = functools.partial(self.loss, mb, get_model_config(model))
        if return_schedule_plan:
            return get_attr_wrapped_model(model, "build_schedule_plan")(mb.tokens, **mb.model_inputs()), loss_func
        return model(mb.tokens, **mb.model_inputs()), loss_func

    @abc.abstractmethod
    def loss(self, microbatch: Microbatch, config: ModelRuntimeConfig, output: HybridOutput
             ) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
        """(objective summed over the microbatch, normaliser, device logs) of one microbatch's output;
        `config` is the model's runtime config (`get_model_config(model)`)."""

    @abc.abstractmethod
    def metrics(self, sums: dict[str, float]) -> dict[str, float]:
        """The step's metrics.jsonl fields from its reduced `sums`: at least `loss` and `tokens`."""


def router_losses(output: HybridOutput, weight: torch.Tensor, aux_coeff: float, z_coeff: float,
                  logs: dict[str, Any]) -> torch.Tensor | int:
    """The model's router losses (aux, z) as a sum to add to an objective's `loss_sum`: each is a
    per-microbatch mean, weighted by `weight` (the microbatch's normaliser) so that the global division
    by the step's normaliser keeps it exact. Logs `aux_loss_sum` / `z_loss_sum` (weighted) and the
    router table (train/telemetry.py sums it over the step); 0 when neither is on."""
    total: torch.Tensor | int = 0
    if getattr(output, "aux_loss", None) is not None and aux_coeff > 0:
        total = total + aux_coeff * output.aux_loss * weight
        logs["aux_loss_sum"] = (output.aux_loss * weight).detach()
    if getattr(output, "z_loss", None) is not None and z_coeff > 0:
        total = total + z_coeff * output.z_loss * weight
        logs["z_loss_sum"] = (output.z_loss * weight).detach()
    if getattr(output, "router_table", None) is not None:
        logs["router_table"] = output.router_table
    return total


@dataclass
class CrossEntropyObjective(TrainingObjective):
    """Next-token cross-entropy over the trained tokens (labels != IGNORE_INDEX), plus the router's
    aux and z-losses at the recipe's coefficients (`moe.aux_loss_coeff`, `moe.z_loss_coeff`; the
    model collects them only when those are on): pre-training and SFT."""

    aux_loss_coeff: float = 0.0
    z_loss_coeff: float = 0.0
    name: ClassVar[str] = "cross_entropy"
    sums: ClassVar[tuple[str, ...]] = ("lm_loss_sum", "num_tokens", "aux_loss_sum", "z_loss_sum")

    @classmethod
    def from_recipe(cls, config: RecipeConfig) -> "CrossEntropyObjective":
        return cls(config.moe.aux_loss_coeff, config.moe.z_loss_coeff)

    def loss(self, microbatch: Microbatch, config: ModelRuntimeConfig, output: HybridOutput
             ) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
        labels = microbatch.labels
        lm_sum = lm_loss_sum(output, labels)  # chunked over tokens for HybridOutput (model/loss.py)
        num_tokens = (labels != IGNORE_INDEX).sum()
        logs: dict[str, Any] = {"lm_loss_sum": lm_sum.detach()}
        loss_sum = lm_sum + router_losses(output, num_tokens, self.aux_loss_coeff, self.z_loss_coeff, logs)
        return loss_sum, num_tokens, logs

    def metrics(self, sums: dict[str, float]) -> dict[str, float]:
        tokens = sums["num_tokens"]
        out = {"loss": sums["lm_loss_sum"] / tokens if tokens else float("nan"), "tokens": tokens}
        for name, coeff in (("aux_loss", self.aux_loss_coeff), ("z_loss", self.z_loss_coeff)):
            if coeff > 0:
                out[name] = sums[f"{name}_sum"] / tokens if tokens else float("nan")
        return out


def forward_step(data_iterator: Iterator[Microbatch], model: torch.nn.Module,
                 return_schedule_plan: bool = False) -> tuple[Any, Callable[[Any], Any]]:
    """The cross-entropy objective at the model's own router-loss coefficients (its runtime config):
    what tests and benches drive a schedule with."""
    config = get_model_config(model)
    objective = CrossEntropyObjective(config.aux_loss_coeff, getattr(config, "z_loss_coeff", 0.0))
    return objective.forward_step(data_iterator, model, return_schedule_plan)


def token_log_probs(output: HybridOutput, labels: torch.Tensor, chunk_tokens: int | None = None) -> torch.Tensor:
    """log p(label) of every position of a model output, [*labels.shape] fp32, 0 where the label is
    IGNORE_INDEX; differentiable. Computed `chunk_tokens` positions at a time from the final hidden
    states and the output layer (HybridOutput; model/lm_head.py, `chunked_log_probs`), each chunk's
    logits recomputed in backward rather than kept, so no [tokens, vocabulary] tensor outlives its
    chunk; from `output.logits` otherwise."""
    flat = labels.reshape(-1)
    valid = flat != IGNORE_INDEX
    safe = torch.where(valid, flat, torch.zeros_like(flat))
    hidden = getattr(output, "hidden", None)
    if hidden is None:
        logits = output.logits.float().reshape(flat.shape[0], -1)
        picked = -F.cross_entropy(logits, safe, reduction="none")
        return torch.where(valid, picked, torch.zeros_like(picked)).reshape(labels.shape)
    h = hidden.reshape(-1, hidden.shape[-1])
    chunk = chunk_tokens or getattr(output, "loss_chunk_tokens", None)
    # the loss's own chunk where the output does not set one (model/loss_chunk.py: per vocabulary and device)
    chunk = max(1, int(chunk or lm_loss_chunk_tokens(output.head_weight.shape[0], h.element_size(), h.device.type)))
    rows = labelled_rows(h, valid)  # the CPU: only the labelled positions (model/lm_head.py)
    if rows is not None:
        picked, _ = chunked_log_probs(h[rows], output.head_weight, safe[rows], 1.0, chunk, with_entropy=False)
        return h.new_zeros(flat.shape[0], dtype=torch.float32).index_put((rows,), picked).reshape(labels.shape)
    picked, _ = chunked_log_probs(h, output.head_weight, safe, 1.0, chunk, with_entropy=False)
    return torch.where(valid, picked, torch.zeros_like(picked)).reshape(labels.shape)


__all__ = ["TrainingObjective", "CrossEntropyObjective", "StepContext", "forward_step",
           "router_losses", "token_log_probs"]
