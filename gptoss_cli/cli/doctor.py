"""`gptoss doctor`: this machine's versions and device, what each shipped recipe gets here, and quick
checks of the device against a CPU reference; exit 1 when a check fails."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer
from rich.markup import escape
from rich.table import Table

from gptoss_cli.cli.app import app, check_json_path, console, handle_errors, write_json

_STYLE = {"PASS": "green", "FAIL": "bold red", "SKIP": "yellow"}


def render(report) -> None:
    m = report.machine
    facts = Table(title="machine", title_justify="left", show_header=False)
    facts.add_column("", style="bold")
    facts.add_column("")
    facts.add_row("torch", f"{m.torch_version} (CUDA {m.cuda_version or 'none'})")
    if m.cpu_only:
        facts.add_row("device", "no CUDA GPU: checking the CPU paths")
    else:
        facts.add_row("GPU", f"{m.gpu_name} x {m.gpu_count}, sm{m.capability[0]}{m.capability[1]} "
                             f"(system.gpu {m.generation})")
        facts.add_row("GPU memory", f"{m.gpu_memory_free_gb:.1f} GB free of {m.gpu_memory_total_gb:.1f} GB")
        facts.add_row("driver, NCCL", f"{m.driver_version or '?'}, NCCL {m.nccl_version or 'none'}")
    host = f"{m.cpu_cores} cores" + (f", {m.host_memory_gb:.0f} GB" if m.host_memory_gb else "")
    facts.add_row("host", host)
    console.print(facts)
    if report.recipes:
        rt = Table(title=f"shipped recipes on this machine ({m.device}, system.gpu {m.generation})", title_justify="left")
        for col in ("recipe", "params", "FP8", "attention (full / sliding)", "refused here"):
            rt.add_column(col)
        for r in report.recipes:
            attention = " / ".join(r.attention.values())
            refused = "; ".join(r.refused[:2]) + (f" (+{len(r.refused) - 2})" if len(r.refused) > 2 else "")
            rt.add_row(r.recipe, r.params_dtype, r.fp8, attention, escape(refused) or "-")
        console.print(rt)
    if report.checks:
        ct = Table(title=f"checks on {m.device} against a CPU reference", title_justify="left")
        for col in ("check", "result", "s", "detail"):
            ct.add_column(col, justify="right" if col == "s" else "left")
        for c in report.checks:
            ct.add_row(c.name, f"[{_STYLE[c.status]}]{c.status}[/]", f"{c.seconds:.1f}", escape(c.detail))
        console.print(ct)
        verdict = "all checks passed" if report.ok else f"{len(report.failed)} check(s) FAILED"
        console.print(verdict, style="green" if report.ok else "bold red", highlight=False)


@app.command(
    "doctor",
    help=(
        "Check this machine before a launch: torch, CUDA, NCCL and driver versions, the GPU, its capability "
        "and free memory; which precision, FP8 path and attention kernels each shipped recipe gets here and "
        "what would be refused; then quick checks of the device against a CPU reference (a tiny model's "
        "forward and backward, each attention backend, the grouped GEMM, the FP8 GEMMs, one collective per "
        "backend). Exit 1 when a check fails. Without a GPU it says so and checks the CPU paths.\n\n"
        "Example: gptoss doctor --json /tmp/doctor.json"
    ),
)
@handle_errors
def doctor_cmd(
    device: str = typer.Option("auto", "--device", help="auto (the GPU if torch sees one), cpu or cuda"),
    only: Optional[List[str]] = typer.Option(
        None, "--check", help="run only the checks whose name starts with this (repeatable), e.g. attention, fp8"),
    no_checks: bool = typer.Option(False, "--no-checks", help="facts and recipes only"),
    no_recipes: bool = typer.Option(False, "--no-recipes", help="skip the shipped recipes' table"),
    json_path: Optional[Path] = typer.Option(None, "--json", help="also write the report as JSON"),
) -> None:
    check_json_path(json_path)
    from gptoss_cli.doctor.report import run_doctor

    report = run_doctor(device, recipes=not no_recipes, checks=not no_checks, only=tuple(only or ()))
    render(report)
    if json_path is not None:
        write_json(json_path, report.to_dict())
    if not report.ok:
        raise typer.Exit(1)
