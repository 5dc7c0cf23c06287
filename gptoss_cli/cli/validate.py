"""`gptoss validate-config`: load a recipe with overrides, run every rule, render the findings and a verdict."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, List, Optional

import typer
from rich.markup import escape
from rich.table import Table

from gptoss_cli.cli.app import app, check_json_path, console, handle_errors, write_json
from gptoss_cli.errors import UsageError

if TYPE_CHECKING:  # the recipe package (omegaconf, yaml, the rules) is imported when the command runs,
    from gptoss_cli.recipe.validate import ValidationReport  # not for `gptoss --help` (cli/__init__.py)


def _style(severity: str) -> str:
    from gptoss_cli.recipe.validate import NOTE

    return {"error": "bold red", "warning": "yellow", NOTE: "dim"}[severity]


def _yaml_value(v: object) -> str:
    return "null" if v is None else str(v).lower() if isinstance(v, bool) else str(v)


def _fields(fields: dict) -> str:
    return "\n".join(f"{k}={_yaml_value(v)}" for k, v in fields.items())


def _memory_row(report: ValidationReport) -> tuple[str, str, str] | None:
    from gptoss_cli.recipe.estimate.memory import size_text

    est = report.memory
    if est is None:
        return None
    who = "[bold]memory.estimate[/]\n[dim]" + escape(f"world {est.world_size}, EP {est.ep_size}, "
                                                     f"{est.tokens_per_microbatch} tokens/microbatch") + "[/]"
    lines = [escape(est.summary())]
    lines += [f"[dim]{escape(it.label)}: {size_text(it.bytes)}[/]" for it in est.items]
    lines += [f"[dim]host memory, {escape(it.label)}: {size_text(it.bytes)}[/]" for it in est.host_items]
    lines += [escape(n) for n in est.notes]
    lines += [escape(f"pipeline rank {s['rank']} ({s['stages']}, {s['in_flight']:g} microbatches in flight): "
                     f"{size_text(s['total_bytes'])}") for s in est.stages]
    return "[dim]estimate[/]", who, "\n".join(lines)


def render_report(report: ValidationReport) -> None:
    from gptoss_cli.recipe.validate import NOTE

    memory = _memory_row(report)
    if report.findings or memory:
        # Three columns keep long dotted names and fixes readable on an 80-column terminal.
        table = Table(show_lines=True, title=f"{report.recipe} (target {report.target})", title_justify="left")
        table.add_column("severity", no_wrap=True)
        table.add_column("rule / fields", overflow="fold", ratio=2)
        table.add_column("problem / fix", overflow="fold", ratio=3)
        order = {"error": 0, "warning": 1, NOTE: 2}
        for f in sorted(report.findings, key=lambda f: order[report.severity(f)]):
            sev = report.severity(f)
            who = f"[bold]{escape(f.rule)}[/]" + (f"\n[dim]{escape(_fields(f.fields))}[/]" if f.fields else "")
            what = escape(f.message) + (f"\n[cyan]fix:[/] {escape(f.hint)}" if f.hint else "")
            table.add_row(f"[{_style(sev)}]{sev}[/]", who, what)
        if memory:
            table.add_row(*memory)
        console.print(table)
    if report.flops is not None:
        f = report.flops
        console.print(f"[dim]model FLOPs per token: {f.model_flops_per_token / 1e9:.2f} GFLOP (6 x {f.matmul_params / 1e9:.2f} B "
                      f"active matmul parameters + attention {f.attention / 1e9:.2f} GFLOP; docs/flops.md)[/]",
                      soft_wrap=True, highlight=False)
    if report.pipeline is not None:
        pl = report.pipeline
        console.print(escape(f"pipeline: PP {pl['pp']} x VPP {pl['vpp']}, {pl['schedule']}, layout {pl['layout']}; "
                             f"{pl['microbatches']} microbatches per step: bubble {100 * pl['bubble_fraction']:.1f}% "
                             "in theory (equal stages, no communication; docs/pipeline-parallel.md)"),
                      soft_wrap=True, highlight=False)
    style = "bold green" if report.ok else "bold red"
    console.print(f"[{style}]{escape(report.verdict)}[/]", soft_wrap=True, highlight=False)
    if report.notes:
        console.print(f"[dim]{len(report.notes)} option(s) above are not implemented in gptoss train yet; "
                      "--target gptoss counts them as errors.[/]", soft_wrap=True)


def render_rules() -> None:
    from gptoss_cli.recipe import list_rules

    table = Table(title="rules (gptoss_cli.recipe.rules)", title_justify="left")
    table.add_column("rule", overflow="fold")
    table.add_column("kind", no_wrap=True)
    table.add_column("checks", overflow="fold")
    for rule_id, kind, description in list_rules():
        table.add_row(escape(rule_id), kind, escape(description))
    console.print(table)


def render_fields() -> None:
    from gptoss_cli.recipe import describe_schema

    table = Table(title="recipe fields (gptoss_cli.recipe.schema)", title_justify="left")
    table.add_column("field", overflow="fold")
    table.add_column("default", overflow="fold")
    table.add_column("meaning", overflow="fold")
    for name, default, help_text in describe_schema():
        table.add_row(escape(name), escape(default), escape(help_text))
    console.print(table)


@app.command(
    "validate-config",
    help=(
        "Check a recipe before launch: types, Megatron's rules (EP overlap, delayed wgrad, CUDA graphs, "
        "parallel arithmetic, FP8) and the model's capabilities.\n\n"
        "RECIPE is a YAML file or a name from recipes/ (e.g. gb200_bf16); OVERRIDES are key=value.\n\n"
        "Exit 0: no errors (warnings allowed); 1: errors; 2: missing or malformed recipe/override.\n\n"
        "Example: gptoss validate-config tiny_cpu_ep2_overlap overlap.delay_wgrad_compute=false --world-size 2"
    ),
)
@handle_errors
def validate_config(
    recipe: Optional[str] = typer.Argument(None, help="recipe YAML path, or a name in recipes/", show_default=False),
    overrides: Optional[List[str]] = typer.Argument(
        None, help="dotlist overrides, e.g. training.train_iters=10 parallelism.expert_model_parallel_size=4",
        show_default=False,
    ),
    world_size: Optional[int] = typer.Option(
        None, "--world-size", min=1,
        help="processes to check against; default: parallelism.world_size, nodes x gpus_per_node, or the smallest fit",
    ),
    target: str = typer.Option(
        "gptoss", "--target",
        help="gptoss: can `gptoss train` run it (unsupported options are errors); "
             "megatron: Megatron's rules only (unsupported options become notes)",
    ),
    json_path: Optional[Path] = typer.Option(None, "--json", help="also write the report as JSON here"),
    rules: bool = typer.Option(False, "--list-rules", help="list every rule and exit"),
    fields: bool = typer.Option(False, "--list-fields", help="list every recipe field with its default and exit"),
) -> None:
    from gptoss_cli.recipe import available_recipes, load_and_validate
    from gptoss_cli.recipe.validate import TARGETS

    if rules or fields:
        if rules:
            render_rules()
        if fields:
            render_fields()
        return
    if recipe is None:
        names = ", ".join(available_recipes()) or "none"
        raise UsageError("missing RECIPE", hint=f"give a YAML path or one of: {names}")
    if target not in TARGETS:
        raise UsageError(f"--target {target!r} is not one of {' | '.join(TARGETS)}")
    check_json_path(json_path)
    loaded, report = load_and_validate(recipe, list(overrides or []), world_size=world_size, target=target)
    render_report(report)
    if json_path is not None:
        payload = report.to_dict()
        payload["sources"] = [str(p) for p in loaded.sources]
        payload["overrides"] = list(loaded.overrides)
        write_json(json_path, payload)
    if not report.ok:
        raise typer.Exit(1)
