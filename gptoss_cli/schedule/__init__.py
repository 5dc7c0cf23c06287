"""Microbatch schedules: the plain schedule, combined 1F1B with EP overlap, delayed weight gradients.

`get_forward_backward_func(config)` is the one place a schedule is chosen, from the model's
runtime config (`overlap_moe_expert_parallel_comm`). The EP-overlap combined-1F1B schedule plugs in
here as `gptoss_cli.schedule.combined_1f1b.forward_backward_combined_1f1b`, with the same keyword
signature as the plain schedule; it finds `build_schedule_plan` on the unwrapped model
(`gptoss_cli.parallel.grads.unwrap_model`).
"""

from __future__ import annotations

import importlib
from typing import Any, Callable

from gptoss_cli.errors import ConfigError


def get_forward_backward_func(config: Any) -> Callable[..., Any]:
    """The schedule the recipe asks for; overlap without its implementation is a clear error."""
    if getattr(config, "overlap_moe_expert_parallel_comm", False):
        try:
            module = importlib.import_module("gptoss_cli.schedule.combined_1f1b")
        except ModuleNotFoundError as exc:
            if exc.name != "gptoss_cli.schedule.combined_1f1b":
                raise
            raise ConfigError(
                "overlap_moe_expert_parallel_comm=true needs the combined-1F1B schedule, which this build lacks",
                hint="set overlap_moe_expert_parallel_comm=false (and delay_wgrad_compute=false)",
            ) from None
        return module.forward_backward_combined_1f1b
    from gptoss_cli.schedule.plain import forward_backward_no_pipelining

    return forward_backward_no_pipelining


__all__ = ["get_forward_backward_func"]
