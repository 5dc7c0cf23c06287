"""Microbatch schedules: the plain schedule, combined 1F1B with EP overlap, delayed weight gradients,
and pipeline parallelism (pipeline/).

`get_forward_backward_func(config)` is the one place a schedule is chosen, from the model's
runtime config (`pipeline_model_parallel_size`, `overlap_moe_expert_parallel_comm`). The EP-overlap combined-1F1B schedule plugs in
here as `gptoss_cli.schedule.combined_1f1b.forward_backward_combined_1f1b`, with the same keyword
signature as the plain schedule; it finds `build_schedule_plan` on the unwrapped model
(`gptoss_cli.parallel.grads.unwrap_model`).
"""

from __future__ import annotations

from typing import Any, Callable


def get_forward_backward_func(config: Any) -> Callable[..., Any]:
    """The schedule the recipe asks for: a pipeline schedule with PP > 1 (pipeline/schedule.py,
    imported only then: it loads torch.distributed.pipelining), combined 1F1B with overlap, else the
    plain one."""
    if getattr(config, "pipeline_model_parallel_size", 1) > 1:
        from gptoss_cli.schedule.pipeline.schedule import forward_backward_pipelining

        return forward_backward_pipelining
    if getattr(config, "overlap_moe_expert_parallel_comm", False):
        from gptoss_cli.schedule.combined_1f1b import forward_backward_combined_1f1b

        return forward_backward_combined_1f1b
    from gptoss_cli.schedule.plain import forward_backward_no_pipelining

    return forward_backward_no_pipelining


__all__ = ["get_forward_backward_func"]
