"""`gptoss train`: validate a recipe with the shared rules, launch the workers, show rank 0's progress."""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path
from typing import Any, List, Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from gptoss_cli.cli.app import app, check_json_path, console, handle_errors, make_console, print_note, write_json
from gptoss_cli.train.progress import (
    CheckpointSaved, MetricDisplay, RunWarning, StepDone, TrainEvent, TrainFinished, TrainStarted,
)


class TrainProgressBar:
    """The library's `TrainProgress` callback: rank 0's process renders its events (it is pickled into the worker).

    A live bar (loss, the objective's shown metrics, lr, grad norm, tokens/s, step time, MFU when the
    step reports it, ETA) on a terminal; one plain line per logged step otherwise, so CI logs keep the
    loss curve. The objective's metrics are those `TrainStarted.shown_metrics` names, each under its
    console word and format (known by no name here). The ETA is the mean time per step since the
    first step this process saw (which includes warm-up) times the steps left.
    """

    def __init__(self, quiet: bool = False):
        self.quiet = quiet
        self._console: Console | None = None
        self._progress: Progress | None = None
        self._task: Any = None
        self._train_iters = 0
        self._first: tuple[float, int] | None = None  # (monotonic time, step) of the first step event
        self._shown: tuple[MetricDisplay, ...] = ()  # the objective's metrics the step lines show

    def __getstate__(self) -> dict[str, Any]:
        return {"quiet": self.quiet}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["quiet"])

    def __call__(self, event: TrainEvent) -> None:
        if self.quiet:
            return
        if isinstance(event, TrainStarted):
            self._start(event)
        elif isinstance(event, StepDone):
            text = (f"loss {event.loss:.4f} "
                    + (f"val {event.val_loss:.4f} " if event.val_loss is not None else "")
                    + shown_text(self._shown, event.objective_metrics)
                    + f"lr {event.lr:.1e} gnorm {event.grad_norm:.3f} "
                    f"{event.tokens_per_s:.0f} tok/s {event.step_time_s * 1000:.0f} ms/step "
                    f"{flops_text(event.tflops_per_gpu, event.mfu)}")
            eta = self._eta(event.step)
            if eta is not None:
                text += f" ETA {eta}"
            if self._progress is not None:
                self._progress.update(self._task, completed=event.step, metrics=text)
            elif self._console is not None:
                self._console.print(f"step {event.step}: {text}", highlight=False)
        elif isinstance(event, CheckpointSaved) and self._console is not None:
            removed = f" (removed {len(event.removed)} older: {', '.join(Path(p).name for p in event.removed)})"
            (self._progress.console if self._progress else self._console).print(
                f"saved checkpoint {escape(event.path)}" + (escape(removed) if event.removed else ""), highlight=False)
        elif isinstance(event, RunWarning):
            out = self._progress.console if self._progress else (self._console or make_console())
            out.print(f"[yellow]warning[/yellow] (step {event.step}): {escape(event.message)}", highlight=False)
        elif isinstance(event, TrainFinished) and self._progress is not None:
            self._progress.stop()

    def _start(self, event: TrainStarted) -> None:
        self._train_iters = event.train_iters
        self._shown = event.shown_metrics
        self._console = make_console()
        where = f"world {event.world_size}, EP {event.ep_size}"
        if event.pp_size > 1:
            where += f", PP {event.pp_size} ({event.pipeline_schedule})"
        if event.cp_size > 1:
            where += f", CP {event.cp_size}"
        if event.fp8:
            where += f", fp8 {event.fp8}"
        if event.qat != "none":
            where += f", QAT {event.qat} (experts)"
        self._console.print(f"training on {where}", highlight=False)
        for note in event.notes:
            self._console.print(escape(note), highlight=False)
        if event.resumed_from:
            self._console.print(f"resuming from [bold]{escape(event.resumed_from)}[/] at step {event.start_step}")
        if self._console.is_terminal:
            self._progress = Progress(
                TextColumn("[bold]train"), BarColumn(bar_width=10), MofNCompleteColumn(),
                TextColumn("{task.fields[metrics]}"), TimeElapsedColumn(), console=self._console,
            )
            self._progress.start()
            self._task = self._progress.add_task("train", total=event.train_iters, completed=event.start_step,
                                                 metrics="")

    def _eta(self, step: int) -> str | None:
        now = time.monotonic()
        if self._first is None:
            self._first = (now, step)
            return None
        t0, s0 = self._first
        if step <= s0:
            return None
        left = max(0, self._train_iters - step) * (now - t0) / (step - s0)
        minutes, seconds = divmod(int(round(left)), 60)
        hours, minutes = divmod(minutes, 60)
        return f"{hours}:{minutes:02d}:{seconds:02d}"


def shown_text(shown: tuple[MetricDisplay, ...], values: dict[str, float]) -> str:
    """The objective's shown metrics of one step, each as "word value " in its format (those the step has)."""
    return "".join(f"{m.console} {values[m.name]:{m.format}} " for m in shown if values.get(m.name) is not None)


def flops_text(tflops: float, mfu: float | None) -> str:
    """Model TFLOP/s per GPU, and MFU where the GPU's peak is known (docs/flops.md)."""
    return f"{tflops:.3g} TFLOP/s/GPU" + (f" MFU {100 * mfu:.1f}%" if mfu is not None else "")


def render_result(result: Any) -> None:
    table = Table(title="training", title_justify="left", show_header=False)
    table.add_column("", style="bold")
    table.add_column("")
    table.add_row("steps", f"{result.steps} (reached step {result.final_step})")
    if result.losses:
        table.add_row("loss", f"{result.losses[0]:.4f} -> {result.losses[-1]:.4f}")
    for m in result.shown:  # the objective's own numbers (GRPO: the reward), first and last step
        table.add_row(escape(m["label"]), f"{m['first']:{m['format']}} -> {m['last']:{m['format']}}")
    if result.steps:  # a run with nothing to do measured nothing
        table.add_row("tokens/s", f"{result.tokens_per_s:.0f} (world {result.world_size}, EP {result.ep_size})")
        table.add_row("model FLOPs", f"{flops_text(result.tflops_per_gpu, result.mfu)} "
                                     f"({result.model_flops_per_token / 1e9:.3g} GFLOP per token"
                                     + (f", peak {result.peak_tflops:.0f} TFLOP/s)" if result.peak_tflops
                                        else ", no known peak here)"))
    if result.fp8:
        f = result.fp8
        table.add_row("fp8", f"{f['recipe']} {f['format']}: {f['path']} ({f['kernel']}) on {f['device']}, "
                             f"{f['gemms']} FP8 GEMMs on rank 0")
    if result.qat != "none":
        table.add_row("qat", f"{result.qat}: expert GEMMs used MXFP4-rounded weights (straight-through gradient); "
                             "convert --experts mxfp4 writes exactly those")
    if result.packing:
        p = result.packing
        table.add_row("packing", f"{p['efficiency']:.1%} of {p['rows']} rows of {p['seq_length']} tokens hold "
                                 "documents (the rest is padding)")
    table.add_row("run folder", escape(str(result.run_dir)) + " (metrics.jsonl)")
    if result.resumed_from:
        table.add_row("resumed from", escape(result.resumed_from))
    if result.checkpoint:
        table.add_row("checkpoint", escape(result.checkpoint))
    console.print(table)


@app.command(
    "train",
    help=(
        "Train a GPT-OSS model from a recipe (expert parallel x data parallel, AdamW, checkpoints).\n\n"
        "The recipe is checked with the same rules as validate-config before any process starts. "
        "Without torchrun, --nproc-per-node N workers are started on this machine (default: the "
        "recipe's world size); under torchrun each process trains directly.\n\n"
        "Example: gptoss train --recipe tiny_cpu_ep2 training.train_iters=5\n\n"
        "Multi-node: torchrun --nnodes 8 --nproc-per-node 8 ... -m gptoss_cli train --recipe gpt_oss_120b_pretrain"
    ),
)
@handle_errors
def train_cmd(
    recipe: str = typer.Option(..., "--recipe", "-r", help="recipe YAML path or a name in recipes/"),
    overrides: Optional[List[str]] = typer.Argument(
        None, help="dotlist overrides, e.g. training.train_iters=10 checkpoint.dir=/tmp/ckpt", show_default=False,
    ),
    nproc_per_node: Optional[int] = typer.Option(
        None, "--nproc-per-node", min=1, help="worker processes on this machine (default: the recipe's world size)",
    ),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="no progress output"),
    json_path: Optional[Path] = typer.Option(None, "--json", help="also write the result as JSON"),
) -> None:
    check_json_path(json_path)
    from gptoss_cli.recipe.load import load_recipe
    from gptoss_cli.run.launch import train

    loaded = load_recipe(recipe, overrides or [])
    result = train(loaded, nproc_per_node=nproc_per_node, progress=TrainProgressBar(quiet))
    if os.environ.get("RANK", "0") != "0":  # under torchrun only rank 0 reports
        return
    if not quiet:
        for note in result.notes:
            print_note(note)
        render_result(result)
    if json_path:
        write_json(json_path, dataclasses.asdict(result), done=f"training finished at step {result.final_step}")
