"""`gptoss eval CHECKPOINT --data PREFIX`: mean loss and perplexity over the trained tokens of a token file."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Optional

import typer
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from gptoss_cli.cli.app import app, check_json_path, console, err_console, handle_errors, write_json


def render(result) -> None:
    table = Table(title="eval", title_justify="left", show_header=False)
    table.add_column("", style="bold")
    table.add_column("")
    loss = "-" if not math.isfinite(result.loss) else f"{result.loss:.4f}"
    ppl = "-" if math.isnan(result.perplexity) else f"{result.perplexity:.4g}"
    table.add_row("loss", f"{loss} (mean over {result.loss_tokens:,} trained tokens)")
    table.add_row("perplexity", ppl)
    what = (f"{len(result.documents):,} documents packed into {result.rows:,} rows of {result.seq_length} "
            f"({result.packing_efficiency:.1%} real tokens)" if result.documents is not None
            else f"{result.rows:,} windows of {result.seq_length} tokens (every next token)")
    table.add_row("data", f"{escape(result.data)}: {what}")
    where = f"{result.dtype} on {result.device}"
    if result.world_size > 1:
        where += f", {result.world_size} processes, EP {result.expert_parallel}"
    table.add_row("model", f"{escape(result.checkpoint)} ({where})")
    console.print(table)


@app.command("eval")
@handle_errors
def eval_cmd(
    checkpoint: str = typer.Argument(..., help="checkpoint folder: Hybrid, Hugging Face, OpenAI original, "
                                               "a training run's checkpoints folder or one iteration"),
    data: str = typer.Option(..., "--data", help="token file prefix (from `gptoss prepare-data`)"),
    seq_length: Optional[int] = typer.Option(
        None, "--seq-length", min=1, max=1 << 24,
        help="row length: training.seq_length (default: 4096, or the longest document if longer; at most the "
             "model's max_position_embeddings and what the data can fill)"),
    dtype: str = typer.Option("float32", "--dtype", help="float32 or bfloat16"),
    device: str = typer.Option("auto", "--device", help="auto, cpu or cuda"),
    micro_batch_size: int = typer.Option(1, "--micro-batch-size", min=1, max=1 << 16, help="rows per forward pass"),
    expert_parallel: int = typer.Option(
        1, "--expert-parallel", min=1, max=1 << 16,
        help="under torchrun: split the experts over this many ranks (training's EP), for models that do not fit one device"),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="no progress bar and no table"),
    json_path: Optional[Path] = typer.Option(None, "--json", help="also write the result (with per-document figures) as JSON"),
) -> None:
    """Mean loss over the trained tokens of a token file, with the packing and loss mask training uses.

    A version-2 file (prepare-data --format harmony) counts the tokens its loss mask marks, documents
    packed whole with per-document attention; a version-1 file counts every next-token prediction of
    training's windows. A model that does not fit one device runs under torchrun with
    --expert-parallel N (the experts split over N ranks, as in training).

    Exit 0, or 2 on bad input (a file, option or checkpoint that cannot be used).

    Example: gptoss eval runs/sft/checkpoints --data data/chat_val --seq-length 4096 --json eval.json

    Example: torchrun --nproc-per-node 8 -m gptoss_cli eval ckpt/gpt-oss-120b-hybrid --data data/chat_val --expert-parallel 8
    """
    check_json_path(json_path)
    from gptoss_cli.model.dtypes import torch_dtype
    from gptoss_cli.train.evaluate import evaluate

    torch_dt = torch_dtype(dtype, "--dtype", allowed=("float32", "bfloat16", "fp32", "bf16"))
    progress = Progress(TextColumn("[bold]eval"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        console=err_console, transient=True, disable=quiet or not err_console.is_terminal)
    with progress:
        task = progress.add_task("eval", total=None)
        result = evaluate(checkpoint, data, seq_length=seq_length, dtype=torch_dt, device=device,
                          micro_batch_size=micro_batch_size, expert_parallel=expert_parallel,
                          progress=lambda done, total: progress.update(task, completed=done, total=total))
    if os.environ.get("RANK", "0") != "0":  # under torchrun only rank 0 reports
        return
    if not quiet:
        render(result)
    if json_path is not None:
        write_json(json_path, result.to_json(), done="eval finished")
