"""A training step through one of torch's pipeline schedules, with the microbatch schedules' contract.

`forward_backward_pipelining` has the keyword signature of `forward_backward_no_pipelining`
(gptoss_cli/schedule/plain.py) and returns one log dict per microbatch on the ranks that hold the
last stage (none elsewhere), plus one log carrying the step's router telemetry rows on every rank.
`get_forward_backward_func` picks it when the model's runtime config has PP > 1.

torch.distributed.pipelining runs the stages (`PipelineStage`s built once per model and reused,
gptoss_cli/schedule/pipeline/stage.py) under the schedule the recipe names (`SCHEDULE_CLASSES`); what gptoss
adds around it:
- the objective's loss: `forward_step_func(iter([microbatch]), stand_in)` is called once per
  microbatch with a stand-in model that only records the call, to get the objective's `loss_func`;
  torch's `loss_fn(output, target)` is handed the microbatch's index as its target and applies that
  `loss_func` to the last stage's output (a HybridOutput: final-norm hidden states, the output
  layer, the router losses from the accumulator). The objective's loss stays a SUM; torch's own
  gradient scaling is off (`scale_grads=False`);
- gradient finalisation, once after the schedule, by the config's `finalize_model_grads_func`
  (parallel/grads.py): every bucket of every stage reduced over the stage's data-parallel group,
  then divided by the normaliser summed over the last stages of every data-parallel rank (the
  world group: the other stages contribute zero), so every stage divides by the same global count;
- the step's router telemetry: each stage's rows placed in one [MoE layers, E + 2] table.
"""

from __future__ import annotations

import inspect
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch import nn

from gptoss_cli.errors import ConfigError
from gptoss_cli.model.pattern import MOE
from gptoss_cli.parallel.grads import get_attr_wrapped_model, get_model_config, unwrap_model
from gptoss_cli.model.gemm.grouped import WgradQueue
from gptoss_cli.schedule.pipeline.layout import SPLIT_BACKWARD, PipelineLayout, schedule_problems
from gptoss_cli.schedule.pipeline.plan_stage import PlanStage, overlap_f_b
from gptoss_cli.schedule.pipeline.stage import RankStage, StageModule, StepTables, stage_metas
from gptoss_cli.schedule.plain import ForwardStep, StepAccounting, finalizer

SCHEDULE_CLASSES = {
    "1f1b": "Schedule1F1B",
    "interleaved_1f1b": "ScheduleInterleaved1F1B",
    "interleaved_zero_bubble": "ScheduleInterleavedZeroBubble",
    "zbv_zero_bubble": "ScheduleZBVZeroBubble",
    "dualpipev": "ScheduleDualPipeV",
}
SINGLE_STAGE = frozenset({"1f1b"})  # torch's PipelineScheduleSingle classes take one stage, not a list


class _StandIn(nn.Module):
    """What forward_step_func sees as the model under PP: the real model's config; calling it returns nothing."""

    def __init__(self, config: Any):
        super().__init__()
        self.config = config

    def forward(self, *args: Any, **kwargs: Any) -> None:
        return None

    def build_schedule_plan(self, *args: Any, **kwargs: Any) -> None:
        return None


class PipelineRuntime:
    """A rank's stages and the torch schedule over them, for one microbatch count and shape."""

    def __init__(self, model: nn.Module, state: Any, layout: PipelineLayout, num_microbatches: int,
                 micro_shape: tuple[int, int]):
        inner = unwrap_model(model)
        config = get_model_config(model)
        problems = schedule_problems(layout.schedule, layout.pp, layout.vpp, num_microbatches)
        if problems:
            raise ConfigError(problems[0][0], hint=problems[0][1])
        self.layout, self.num_microbatches, self.micro_shape = layout, num_microbatches, micro_shape
        self.tables = StepTables()
        carry = bool(inner.aux_loss_coef > 0 or inner.z_loss_coef > 0)
        # EP overlap (DualPipeV only): the stages run as schedule-plan nodes (plan_stage.py)
        self.overlap = bool(getattr(config, "overlap_moe_expert_parallel_comm", False))
        self.queue = WgradQueue() if self.overlap and getattr(config, "delay_wgrad_compute", False) else None
        stage_cls = PlanStage if self.overlap else RankStage
        no_sync = getattr(config, "no_sync_func", None)
        self.modules: list[StageModule] = []
        self.metas: list[tuple[tuple, tuple]] = []  # (input_args, output_args) of each stage
        self.stages = []
        for spec in layout.rank_stages(state.pp_rank):
            module = StageModule(inner, spec, self.tables, carry)
            inputs, outputs = stage_metas(spec, micro_shape, inner.arch.hidden_size, inner.params_dtype, carry,
                                          inner.arch.num_local_experts)
            self.modules.append(module)
            self.metas.append((inputs, outputs))
            self.stages.append(stage_cls(module, index=spec.index, num_stages=layout.num_stages, device=state.device,
                                         input_args=inputs, output_args=outputs, group=state.pp_group,
                                         microbatches=num_microbatches, no_sync=no_sync,
                                         defer_wgrad=layout.schedule in SPLIT_BACKWARD and not self.overlap))
        for stage in self.stages if self.overlap else ():
            stage.queue = self.queue
        self.holds_first = any(s.embedding for s in layout.rank_stages(state.pp_rank))
        self.last = next((m for m in self.modules if m.stage.loss), None)
        self.schedule = self._schedule(self.stages, self._loss)
        if self.overlap:
            from torch.distributed.pipelining.schedules import OVERLAP_F_B

            self.schedule.register_custom_function(OVERLAP_F_B, overlap_f_b)
        # forward-only passes: the same modules in stages of their own, the schedule without a loss
        # (torch runs only its forward actions then), built on first use
        self._state, self._eval = state, None
        self.moe_layers = [j for j, s in enumerate(inner.pattern.layers) if s == MOE]
        self._accounting: StepAccounting | None = None
        self._loss_funcs: list[Any] = []
        self._logs: dict[int, dict[str, Any]] = {}

    def _schedule(self, stages: list[Any], loss_fn: Any) -> Any:
        import torch.distributed.pipelining as pipelining

        cls = getattr(pipelining, SCHEDULE_CLASSES[self.layout.schedule])
        return cls(stages[0] if self.layout.schedule in SINGLE_STAGE else stages, self.num_microbatches,
                   loss_fn=loss_fn, scale_grads=False)

    def _loss(self, output: Any, target: torch.Tensor, **_: Any) -> torch.Tensor:
        index = int(target.reshape(-1)[0])
        outputs = output if isinstance(output, tuple) else (output,)
        loss_sum, num_tokens, extra = self._loss_funcs[index](self.last.output(outputs))
        self._logs[index] = {"loss_sum": loss_sum.detach(), "num_tokens": num_tokens.detach(), **extra}
        self._accounting.total_tokens = self._accounting.total_tokens + num_tokens.detach().float().to(
            self._accounting.total_tokens.device)
        return self._accounting.scaled(loss_sum)

    def router_log(self, device: torch.device, num_experts: int) -> dict[str, Any] | None:
        """The step's router rows of this rank's stages in the table of every MoE layer (zeros elsewhere)."""
        if not self.tables.router_rows:
            return None
        table = torch.zeros(len(self.moe_layers), num_experts + 2, dtype=torch.float64, device=device)
        for first, rows in self.tables.router_rows.items():
            at = next(i for i, j in enumerate(self.moe_layers) if j >= first)
            table[at:at + rows.shape[0]] += rows
        return {"router_table": table}

    def run(self, microbatches: list[Any], loss_funcs: list[Any], accounting: StepAccounting) -> list[dict[str, Any]]:
        """One step over `microbatches`; the per-microbatch logs of this rank (last stage only)."""
        n = len(microbatches)
        self.tables.start(microbatches)
        self._loss_funcs, self._logs, self._accounting = loss_funcs, {}, accounting
        args = (torch.cat([mb.tokens for mb in microbatches]),) if self.holds_first else ()
        kwargs: dict[str, Any] = {"target": torch.arange(n), "losses": None, "mb": torch.arange(n)}
        if "return_outputs" in inspect.signature(self.schedule.step).parameters:
            kwargs["return_outputs"] = False  # torch >= 2.12: the last stage keeps no outputs for the caller
        try:
            self.schedule.step(*args, **kwargs)
        except BaseException:
            if self.queue is not None:
                self.queue.clear()  # the step failed anyway; do not mask its error with a second one
            raise
        if self.queue is not None:
            self.queue.finish_step()  # raises if a delayed weight gradient was queued but never run
        return [self._logs[i] for i in sorted(self._logs)]

    def set_observer(self, observer: Any) -> None:
        """Watch the all-to-alls of the overlapped plans (bench/pipeline.py); None: stop."""
        for stage in self.stages if self.overlap else ():
            stage.observer = observer


    def forward_only(self, microbatches: list[Any], loss_funcs: list[Any]) -> list[dict[str, Any]]:
        """Every microbatch through the stages without gradients; the logs its loss_func returns on the
        last stage (with loss_sum and num_tokens), handed to every pipeline rank (an objective's
        prepare_step attaches them to the microbatches, whichever stage it runs on)."""
        if self._eval is None:
            cls, state = RankStage, self._state
            stages = [cls(m, index=m.stage.index, num_stages=self.layout.num_stages, device=state.device,
                          input_args=ins, output_args=outs, group=state.pp_group, microbatches=self.num_microbatches,
                          no_sync=None, defer_wgrad=False) for m, (ins, outs) in zip(self.modules, self.metas)]
            self._eval = (stages, self._schedule(stages, None))
        stages, schedule = self._eval
        self.tables.start(microbatches)
        args = (torch.cat([mb.tokens for mb in microbatches]),) if self.holds_first else ()
        with torch.no_grad():
            schedule.step(*args, mb=torch.arange(len(microbatches)))
        last = next((st for st in stages if st.submod.stage.loss), None)
        logs: list[dict[str, Any]] = []
        if last is not None:
            with torch.no_grad():
                for output, loss_func in zip(last.output_chunks, loss_funcs):
                    outputs = output if isinstance(output, tuple) else (output,)
                    loss_sum, num_tokens, extra = loss_func(self.last.output(outputs))
                    logs.append({"loss_sum": loss_sum, "num_tokens": num_tokens, **extra})
        box = [logs]
        holder = dist.get_global_rank(self._state.pp_group, self.layout.stages[-1].rank)
        dist.broadcast_object_list(box, src=holder, group=self._state.pp_group, device=self._state.device)
        return box[0]


def pipeline_runtime(model: nn.Module, microbatches: list[Any]) -> PipelineRuntime:
    """The model's pipeline runtime, built on first use and rebuilt when the microbatches change count or shape."""
    inner = unwrap_model(model)
    config = get_model_config(model)
    state = get_attr_wrapped_model(model, "parallel_state")
    shape = tuple(microbatches[0].tokens.shape)
    runtime = getattr(inner, "pipeline_runtime", None)
    if runtime is None or runtime.num_microbatches != len(microbatches) or runtime.micro_shape != shape:
        runtime = PipelineRuntime(model, state, config.pipeline_layout(), len(microbatches), shape)
        inner.pipeline_runtime = runtime
    return runtime


def forward_backward_pipelining(
    *,
    forward_step_func: ForwardStep,
    data_iterator: Iterator[Any],
    model: nn.Module,
    num_microbatches: int,
    forward_only: bool = False,
) -> list[dict[str, Any]]:
    """The step through torch's pipeline schedule (see the module docstring); logs as the other schedules'."""
    config = get_model_config(model)
    if getattr(config, "overlap_moe_expert_parallel_comm", False) and config.pipeline_schedule != "dualpipev":
        raise ConfigError("EP all-to-all overlap under pipeline parallelism runs with the dualpipev schedule only "
                          f"(its overlapped forward and backward), not {config.pipeline_schedule} "
                          "(rule unsupported.pipeline_ep_overlap)",
                          hint="set parallelism.pipeline_schedule=dualpipev, or overlap.overlap_moe_expert_parallel_comm"
                               "=false overlap.delay_wgrad_compute=false")
    microbatches = [next(data_iterator) for _ in range(num_microbatches)]
    stand_in = _StandIn(config)
    loss_funcs = [forward_step_func(iter([mb]), stand_in)[1] for mb in microbatches]
    runtime = pipeline_runtime(model, microbatches)
    if forward_only:
        return runtime.forward_only(microbatches, loss_funcs)
    finalize = finalizer(config)
    step = StepAccounting(config)
    logs = runtime.run(microbatches, loss_funcs, step)
    state = get_attr_wrapped_model(model, "parallel_state")
    finalize([model], step.total_tokens.to(state.device))
    router = runtime.router_log(state.device, unwrap_model(model).arch.num_local_experts)
    return logs + ([router] if router is not None else [])


__all__ = ["forward_backward_pipelining", "PipelineRuntime", "pipeline_runtime", "SCHEDULE_CLASSES"]
