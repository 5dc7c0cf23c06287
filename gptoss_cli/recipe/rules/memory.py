"""Per-GPU memory against the GPU's (rule `memory.fits`; the formulas are gptoss_cli/recipe/estimate/memory.py)."""

from __future__ import annotations

from gptoss_cli.recipe.estimate.memory import GB, WARN_FRACTION
from gptoss_cli.recipe.rules.core import ERROR, WARNING, Context, Finding, error, rule, warning
from gptoss_cli.recipe.schema import RecipeConfig


@rule("memory.fits", "estimated per-GPU memory (parameters, gradients, optimizer state, activations) fits "
      f"system.gpu's; a warning above {WARN_FRACTION:.0%}",
      fix="shrink what the message names (training.micro_batch_size, training.seq_length, more EP, the "
          "distributed optimizer), or a GPU with more memory; above 90% a warning",
      severities=(ERROR, WARNING))
def memory_fits(cfg: RecipeConfig, ctx: Context) -> list[Finding]:
    est = ctx.memory_estimate(cfg)
    if est is None or est.capacity_bytes is None:  # another layout, or a GPU without a known size
        return []
    fraction = est.fraction
    if fraction <= WARN_FRACTION:
        return []
    top = est.biggest(3)
    fields = {"system.gpu": est.gpu, "parallelism.world_size": ctx.world_size,
              "parallelism.expert_model_parallel_size": est.ep_size,
              "optimizer.use_distributed_optimizer": cfg.optimizer.use_distributed_optimizer,
              "training.micro_batch_size": cfg.training.micro_batch_size,
              "training.seq_length": cfg.training.seq_length}
    knobs = "; ".join(dict.fromkeys(f"{it.label}: {it.knobs}" for it in top if it.knobs != "-"))
    if fraction > 1.0:
        return [error(fields, f"estimated {est.summary()}: does not fit",
                      f"shrink the biggest items ({knobs}), or use a GPU with more than "
                      f"{est.total_bytes / GB:.0f} GB")]
    return [warning(fields, f"estimated {est.summary()}: little room for the CUDA context, communication "
                            "buffers and allocator slack", f"to make room: {knobs}")]
