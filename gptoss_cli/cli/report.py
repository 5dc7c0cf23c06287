"""`gptoss report`: PNG plots and a terminal summary of a training run folder (its metrics.jsonl)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import typer
from rich.markup import escape
from rich.table import Table

from gptoss_cli.cli.app import app, check_json_path, console, handle_errors, print_note, write_json


def _value(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v:.4g}" if abs(v) >= 1e-3 or v == 0 else f"{v:.3e}"


def _trend(t: float | None) -> str:
    if t is None:
        return "-"  # too few values, or a start at the series' noise level (train/report.py, trend)
    word = "up" if t > 0 else "down" if t < 0 else "flat"
    return f"{word} {abs(t) * 100:.1f}%"


def render_summary(summary: dict[str, Any], plots: list[Path]) -> None:
    reached = f"step {summary['last_step']}"
    if summary["train_iters"] is not None:
        reached += f" of {summary['train_iters']}" + ("" if summary["finished"] else " (stopped before the end)")
    table = Table(title=f"run: {reached}, {summary['steps_recorded']} steps recorded", title_justify="left")
    table.add_column("metric", style="bold")
    table.add_column("last", justify="right")
    table.add_column("min", justify="right")
    table.add_column("max", justify="right")
    table.add_column("trend (first -> last tenth)")
    for key, c in summary["curves"].items():
        table.add_row(key, _value(c["last"]), _value(c["min"]), _value(c["max"]), _trend(c["trend"]))
    console.print(table)
    router = summary["router"]
    if router:
        rt = Table(title=f"router at step {router['step']}", title_justify="left")
        for name in ("MoE layer", "most loaded expert", "least loaded expert", "load CV", "entropy (nats)"):
            rt.add_column(name, justify="right" if name != "MoE layer" else "left")
        for layer, r in router["layers"].items():
            rt.add_row(layer, f"{r['most_loaded']['expert']} ({r['most_loaded']['share'] * 100:.1f}%)",
                       f"{r['least_loaded']['expert']} ({r['least_loaded']['share'] * 100:.1f}%)",
                       _value(r["cv"]), _value(r["entropy"]))
        console.print(rt)
    ranks = summary["ranks"]
    if len(ranks) > 1:
        slow = max(ranks, key=lambda r: ranks[r]["mean_step_time_s"])
        fast = min(ranks, key=lambda r: ranks[r]["mean_step_time_s"])
        console.print(f"slowest rank {slow}: {ranks[slow]['mean_step_time_s'] * 1000:.0f} ms/step "
                      f"(fastest rank {fast}: {ranks[fast]['mean_step_time_s'] * 1000:.0f} ms/step)", highlight=False)
    if plots:
        console.print(f"plots: {escape(str(plots[0].parent))} ({', '.join(p.name for p in plots)})", highlight=False)


def render_rollouts(r: dict[str, Any]) -> None:
    """The saved rollouts' summary (rl/rollout_file.py, `summarise_rollouts`)."""
    steps = f", steps {r['steps'][0]}-{r['steps'][1]}" if r["steps"] else ""
    table = Table(title=f"rollouts: {r['completions']} completions in {r['files']} files{steps}", title_justify="left",
                  show_header=False)
    table.add_column("", style="bold")
    table.add_column("")
    w = r["reward"]
    if "mean" in w:
        table.add_row("reward", f"mean {_value(w['mean'])}, std {_value(w['std'])}; min {_value(w['min'])}, quartiles "
                      f"{_value(w['p25'])} / {_value(w['median'])} / {_value(w['p75'])}, max {_value(w['max'])}")
    if w["failed"]:
        table.add_row("reward failed", str(w["failed"]))
    n = r["completion_length"]
    if n["mean"] is not None:
        table.add_row("completion tokens", f"mean {n['mean']:.1f}, min {n['min']}, max {n['max']}; "
                      f"{n['truncated'] * 100:.1f}% stopped at rl.max_new_tokens")
    if r["masked_tokens"] is not None:
        table.add_row("masked (rl.is_correction)", f"{r['masked_tokens'] * 100:.2f}% of tokens, "
                      f"{r['masked_completions'] * 100:.2f}% of completions wholly")
    console.print(table)
    for e in r["examples"]:
        console.print(f"[bold]{escape(e['which'])}[/bold] (step {e['step']}, reward {_value(e['reward'])}, "
                      f"{e['tokens']} tokens): {escape(e['prompt'])} -> {escape(e['completion'])}", highlight=False)
    console.print(f"rollout files: {escape(r['folder'])}", highlight=False)


@app.command(
    "report",
    help=(
        "Plot and summarise a training run from its folder's metrics.jsonl: PNGs of loss, lr, grad norm, "
        "tokens/s (and MFU, aux/z-loss and the metrics the run's objective shows when recorded), a heatmap of expert load per MoE layer, and a "
        "summary table (last values, trends, most and least loaded experts); with a GRPO run's saved rollouts "
        "(rl.save_rollouts: RUN_DIR/rollouts/, pyarrow) their rewards, lengths, masked share and example "
        "completions. Works on a run that is still going or was killed. Plots need matplotlib (the plot extra of "
        "gptoss-cli).\n\n"
        "Example: gptoss report runs/tiny_cpu_ep2 --out /tmp/plots --json /tmp/summary.json"
    ),
)
@handle_errors
def report_cmd(
    run_dir: Path = typer.Argument(..., help="the run folder (logging.run_dir) holding metrics.jsonl", show_default=False),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="folder for the PNGs (default: RUN_DIR/report)"),
    no_plots: bool = typer.Option(False, "--no-plots", help="only the summary (no matplotlib needed)"),
    json_path: Optional[Path] = typer.Option(None, "--json", help="also write the summary as JSON"),
) -> None:
    check_json_path(json_path)
    from gptoss_cli.rl.rollout_file import summarise_rollouts
    from gptoss_cli.train.report import read_metrics, summarise, write_plots

    metrics = read_metrics(run_dir)
    for note in metrics.notes:
        print_note(note)
    summary = summarise(metrics)
    plots = [] if no_plots else write_plots(metrics, out if out is not None else Path(run_dir) / "report")
    summary["plots"] = [str(p) for p in plots]
    rollouts = summarise_rollouts(run_dir)
    if rollouts is not None:
        summary["rollouts"] = rollouts
    render_summary(summary, plots)
    if rollouts is not None:
        render_rollouts(rollouts)
    if json_path:
        write_json(json_path, summary, done="the plots were written" if plots else None)
