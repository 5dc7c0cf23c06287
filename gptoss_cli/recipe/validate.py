"""Run every registered rule on a recipe and judge it for a target; the one check validate-config and train share.

Targets:
- "gptoss" (default): can `gptoss train` run this recipe? Semantic and `unsupported.*` errors count.
- "megatron": is the recipe sound by Megatron's rules and the model's capabilities? `unsupported.*`
  findings are reported as notes and do not fail it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from gptoss_cli.errors import ConfigError, UsageError, ValidationFailed
from gptoss_cli.recipe.load import Recipe, load_recipe, recipe_from_config
from gptoss_cli.recipe.environment import installed_torch_version
from gptoss_cli.schedule.pipeline.layout import SPLIT_BACKWARD, bubble_fraction, pipeline_layout
from gptoss_cli.recipe.estimate.flops import FlopCount, count_flops, pipeline_op_flops, recompute_flops_per_token
from gptoss_cli.recipe.rules.parallel import microbatches_per_step
from gptoss_cli.recipe.estimate.memory import MemoryEstimate, recompute_plan
from gptoss_cli.recipe.rules import ERROR, RULES, SEMANTIC, UNSUPPORTED, WARNING, Context, Finding, Rule
from gptoss_cli.recipe.estimate.sizes import data_parallel_size, expert_data_parallel_size, resolve_world_size
from gptoss_cli.limits import INT32_MAX
from gptoss_cli.recipe.schema import RecipeConfig

TARGETS = ("gptoss", "megatron")
NOTE = "note"


@dataclass
class ValidationReport:
    """Findings for one recipe, and the verdict for one target."""

    recipe: str
    target: str
    world_size: int
    world_size_source: str
    data_parallel_size: int | None
    expert_data_parallel_size: int | None
    findings: list[Finding] = field(default_factory=list)
    skipped: bool = False  # other rules were skipped because field bounds failed
    memory: MemoryEstimate | None = None  # per-GPU estimate at this layout (recipe/estimate/memory.py)
    flops: FlopCount | None = None  # model FLOPs per token at training.seq_length (recipe/estimate/flops.py)
    hardware_flops_per_token: float | None = None  # + what the recipe's recompute repeats
    pipeline: dict[str, Any] | None = None  # with PP > 1: layout, schedule, microbatches, bubble in theory

    def severity(self, f: Finding) -> str:
        """error / warning, or note for an unsupported-option finding when judging Megatron semantics."""
        if f.kind == UNSUPPORTED and self.target == "megatron":
            return NOTE
        return f.severity

    @property
    def errors(self) -> list[Finding]:
        return [f for f in self.findings if self.severity(f) == ERROR]

    @property
    def warnings(self) -> list[Finding]:
        return [f for f in self.findings if self.severity(f) == WARNING]

    @property
    def notes(self) -> list[Finding]:
        return [f for f in self.findings if self.severity(f) == NOTE]

    @property
    def ok(self) -> bool:
        return not self.errors

    def error_rules(self) -> list[str]:
        return sorted({f.rule for f in self.errors})

    @property
    def verdict(self) -> str:
        what = "runnable by gptoss train" if self.target == "gptoss" else "valid by Megatron's rules"
        semantic = sum(1 for f in self.errors if f.kind == SEMANTIC)
        unsupported = len(self.errors) - semantic
        parts = [f"{len(self.errors)} error{'s' * (len(self.errors) != 1)}"]
        if unsupported and self.target == "gptoss":
            parts[0] += f" ({semantic} semantic, {unsupported} not implemented in gptoss yet)"
        parts.append(f"{len(self.warnings)} warning{'s' * (len(self.warnings) != 1)}")
        if self.notes:
            parts.append(f"{len(self.notes)} option{'s' * (len(self.notes) != 1)} gptoss train cannot run yet")
        head = f"{self.recipe}: {'VALID' if self.ok else 'INVALID'} - {what if self.ok else 'not ' + what}"
        tail = f" (world size {self.world_size}, DP {self.data_parallel_size or '?'})"
        skipped = "; other rules skipped until the field bounds are fixed" if self.skipped else ""
        return f"{head}: {', '.join(parts)}{tail}{skipped}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "recipe": self.recipe,
            "target": self.target,
            "valid": self.ok,
            "verdict": self.verdict,
            "world_size": self.world_size,
            "world_size_source": self.world_size_source,
            "data_parallel_size": self.data_parallel_size,
            "expert_data_parallel_size": self.expert_data_parallel_size,
            "errors": len(self.errors),
            "warnings": len(self.warnings),
            "notes": len(self.notes),
            "findings": [{**f.to_dict(), "counted_as": self.severity(f)} for f in self.findings],
            "memory": self.memory.to_dict() if self.memory is not None else None,
            "model_flops_per_token": self.flops.model_flops_per_token if self.flops is not None else None,
            "hardware_flops_per_token": self.hardware_flops_per_token,
            "pipeline": self.pipeline,
        }

    def raise_for_errors(self) -> None:
        """ValidationFailed (exit 1) naming every failing rule, with the first error's fix as hint; a
        missing or unreadable input file is bad input instead: ConfigError (exit 2) naming it."""
        if self.ok:
            return
        bad_input = [f for f in self.errors if f.bad_input]
        if bad_input:
            raise ConfigError(bad_input[0].message, hint=bad_input[0].hint)
        first = self.errors[0]
        rules = ", ".join(self.error_rules())
        raise ValidationFailed(
            f"{self.verdict}; failing rules: {rules}; first: [{first.rule}] {first.message}",
            hint=first.hint or "run `gptoss validate-config` on the recipe for the full table",
        )


def validate_recipe(
    recipe: Recipe | RecipeConfig,
    *,
    world_size: int | None = None,
    target: str = "gptoss",
    gpu: str | None = None,
    check_paths: bool = False,
    rules: Sequence[Rule] | None = None,
) -> ValidationReport:
    """Run the rules on a loaded recipe and return the report for `target`.

    world_size: the launched world (train) or --world-size; None = from the recipe.
    gpu: the detected GPU generation (train); None = the recipe's system.gpu.
    check_paths: also require data/pretrained paths to exist (train sets it).
    """
    if target not in TARGETS:
        raise ValueError(f"target must be one of {TARGETS}, got {target!r}")
    if world_size is not None and (isinstance(world_size, bool) or not isinstance(world_size, int)
                                   or not 1 <= world_size <= INT32_MAX):
        raise UsageError(f"world size {world_size!r} must be an integer in [1, {INT32_MAX}]")
    if isinstance(recipe, RecipeConfig):
        recipe = recipe_from_config(recipe)
    cfg = recipe.config
    world, source = resolve_world_size(cfg, world_size)
    ctx = Context(
        arch=recipe.arch,
        pattern=recipe.pattern,
        world_size=world,
        world_size_source=source,
        explicit_world_size=world_size,
        gpu=gpu or cfg.system.gpu,
        torch_version=installed_torch_version(),
        check_paths=check_paths,
    )
    report = ValidationReport(
        recipe=cfg.name or (recipe.path.stem if recipe.path else "recipe"),
        target=target,
        world_size=world,
        world_size_source=source,
        data_parallel_size=data_parallel_size(cfg, world) if world > 0 else None,
        expert_data_parallel_size=expert_data_parallel_size(cfg, world) if world > 0 else None,
    )
    selected = list(rules) if rules is not None else list(RULES.values())
    bounds = [r for r in selected if r.gate]
    others = [r for r in selected if not r.gate]
    for r in bounds:
        report.findings.extend(r(cfg, ctx))
    if any(f.severity == ERROR for f in report.findings) or world <= 0:
        # Sizes below 1 make the arithmetic rules meaningless; report the bounds first.
        report.skipped = bool(others)
        return report
    # after the bound gates: a size past its bound never reaches the arithmetic
    if cfg.training.seq_length >= 1:
        report.flops = count_flops(recipe.arch, cfg.training.seq_length, recipe.pattern)
        try:
            pieces = recompute_plan(cfg, recipe.pattern).layer_pieces(recipe.pattern.layers)
        except ValueError:  # incomplete recompute settings: rule recompute.settings reports them
            pieces = {}
        report.hardware_flops_per_token = report.flops.model_flops_per_token + recompute_flops_per_token(
            recipe.arch, cfg.training.seq_length, recipe.pattern, pieces)
    report.pipeline = pipeline_summary(cfg, recipe, world)
    try:
        report.memory = ctx.memory_estimate(cfg)  # computed once: the memory rule reads the same
    except Exception:  # the estimate is information; the memory rule reports a failure of it
        report.memory = None
    for r in others:
        try:
            report.findings.extend(r(cfg, ctx))
        except Exception as exc:  # a rule bug must surface as a finding, never a traceback
            report.findings.append(Finding(
                rule=r.id, severity=ERROR, fields={}, kind=r.kind,
                message=f"rule crashed: {type(exc).__name__}: {exc}",
                hint="this is a bug in gptoss; please report it with the recipe",
            ))
    return report


def pipeline_summary(cfg: RecipeConfig, recipe: Recipe, world: int) -> dict[str, Any] | None:
    """With PP > 1 and a layout that fits: the stages, the schedule, microbatches per step and the bubble
    in theory (schedule/pipeline/layout.py's `bubble_fraction`, at the model's forward, input-gradient and
    deferred weight-gradient FLOPs: recipe/estimate/flops.py)."""
    p = cfg.parallelism
    m = microbatches_per_step(cfg, world)
    if p.pipeline_model_parallel_size == 1 or m is None or cfg.training.seq_length < 1:
        return None
    try:
        layout = pipeline_layout(recipe.pattern, p.pipeline_model_parallel_size, p.virtual_pipeline_model_parallel_size,
                                 p.pipeline_schedule, p.pipeline_model_parallel_layout)
    except UsageError:  # rule parallel.pipeline_layout reports it
        return None
    f, b, w = pipeline_op_flops(recipe.arch, cfg.training.seq_length, recipe.pattern)
    split = p.pipeline_schedule in SPLIT_BACKWARD
    bubble = bubble_fraction(p.pipeline_schedule, layout.pp, layout.vpp, m, f, b if split else b + w, w if split else 0)
    return {"pp": layout.pp, "vpp": layout.vpp, "schedule": p.pipeline_schedule, "layout": layout.text(),
            "layout_source": layout.source, "microbatches": m, "bubble_fraction": bubble,
            "op_flops": {"forward": f, "backward_input": b, "backward_weight": w}}


def load_and_validate(
    ref: str | Path, overrides: Sequence[str] = (), **kwargs: Any
) -> tuple[Recipe, ValidationReport]:
    """load_recipe + validate_recipe: what validate-config runs (ConfigError on malformed input)."""
    recipe = load_recipe(ref, overrides)
    return recipe, validate_recipe(recipe, **kwargs)


def preflight(recipe: Recipe, *, world_size: int, gpu: str | None = None) -> ValidationReport:
    """train's pre-launch check: target gptoss, real world size and paths; raises ValidationFailed."""
    report = validate_recipe(recipe, world_size=world_size, target="gptoss", gpu=gpu, check_paths=True)
    report.raise_for_errors()
    return report


__all__ = ["ValidationReport", "validate_recipe", "load_and_validate", "preflight", "TARGETS", "NOTE"]
