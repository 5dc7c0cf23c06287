"""`gptoss score CHECKPOINT --data PREFIX --out DIR`: a frozen model's per-token scores (log-probs, top-K) of a token file."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Optional

import typer
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from gptoss_cli.cli.app import app, check_json_path, console, err_console, handle_errors, print_note, write_json


def _short(digest: str | None) -> str:
    return "-" if not digest else digest[:23] + "…"


def render(result) -> None:
    table = Table(title="score", title_justify="left", show_header=False)
    table.add_column("", style="bold")
    table.add_column("")
    what = "log-prob of each trained token" + (f", top-{result.top_k} and the tail mass" if result.top_k else "")
    if result.temperature != 1.0:
        what += f", at temperature {result.temperature:g}"
    table.add_row("wrote", f"{escape(result.out)}: {what}")
    table.add_row("tokens", f"{result.trained_tokens:,} trained tokens in {result.rows:,} rows of {result.seq_length} "
                            f"({result.shards} shards, {result.bytes / 1e6:,.1f} MB)")
    mean = "-" if not math.isfinite(result.mean_logprob) else f"{result.mean_logprob:.4f}"
    table.add_row("mean log-prob", mean)
    table.add_row("data", f"{escape(result.data)} (v{result.format_version}, {_short(result.data_digest)})")
    where = f"{result.dtype} on {result.device}"
    if result.world_size > 1:
        where += f", {result.world_size} processes, EP {result.expert_parallel}"
    table.add_row("model", f"{escape(result.checkpoint)} ({where}, {_short(result.model_digest)})")
    table.add_row("vocabulary", f"{result.vocab_size:,}, tokenizer {_short(result.tokenizer_digest)}")
    rate = result.trained_tokens / result.seconds if result.seconds > 0 else 0.0
    table.add_row("time", f"{result.seconds:.1f} s ({rate:,.0f} tokens/s)")
    console.print(table)


@app.command("score")
@handle_errors
def score_cmd(
    checkpoint: str = typer.Argument(..., help="checkpoint folder: Hybrid, Hugging Face (MXFP4 experts too), OpenAI "
                                               "original, a training run's checkpoints folder or one iteration"),
    data: str = typer.Option(..., "--data", help="token file prefix (from `gptoss prepare-data`)"),
    out: Path = typer.Option(..., "--out", help="the score folder to write (manifest.json and safetensors shards)"),
    top_k: int = typer.Option(0, "--top-k", min=0, max=1 << 20,
                              help="also store the K most likely tokens, their log-probs and the tail mass (distillation)"),
    temperature: float = typer.Option(1.0, "--temperature", help="score softmax(logits / T): every stored value is at T"),
    seq_length: Optional[int] = typer.Option(
        None, "--seq-length", min=1, max=1 << 24,
        help="row length (default: 4096, or the longest document if longer); a version-1 file's windows depend on it"),
    dtype: str = typer.Option("float32", "--dtype", help="float32 or bfloat16"),
    device: str = typer.Option("auto", "--device", help="auto, cpu or cuda"),
    micro_batch_size: int = typer.Option(1, "--micro-batch-size", min=1, max=1 << 16, help="rows per forward pass"),
    expert_parallel: int = typer.Option(
        1, "--expert-parallel", min=1, max=1 << 16,
        help="under torchrun: split the experts over this many ranks (training's EP), for models that do not fit one device"),
    shard_tokens: Optional[int] = typer.Option(None, "--shard-tokens", min=1, max=1 << 40,
                                               help="trained tokens per shard file (default: about 1 GB per shard)"),
    force: bool = typer.Option(False, "--force", help="replace a previous score folder at --out"),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="no progress bar and no table"),
    json_path: Optional[Path] = typer.Option(None, "--json", help="also write the result as JSON"),
) -> None:
    """Score every trained token of a token file with a frozen model, once, for training to read back.

    Stores the log-prob of each trained token (a DPO reference) and, with --top-k K, the K most likely
    tokens, their log-probs and the log of the remaining mass (a distillation teacher), all at
    --temperature. The rows are `gptoss eval`'s: documents packed whole, the loss mask's tokens only. The
    folder is written whole or not at all, with a manifest of the data's, model's and tokenizer's digests
    that training checks. A model that does not fit one device runs under torchrun with --expert-parallel N.

    Exit 0, or 2 on bad input (a file, option or checkpoint that cannot be used, an --out in the way).

    Example: gptoss score runs/sft/checkpoints --data data/pairs --out data/pairs.ref

    Example: torchrun --nproc-per-node 8 -m gptoss_cli score gpt-oss-120b --data data/sft --top-k 32 --out data/sft.teacher --expert-parallel 8
    """
    check_json_path(json_path)
    from gptoss_cli.model.dtypes import torch_dtype
    from gptoss_cli.score.command import score

    torch_dt = torch_dtype(dtype, "--dtype", allowed=("float32", "bfloat16", "fp32", "bf16"))
    progress = Progress(TextColumn("[bold]score"), BarColumn(), MofNCompleteColumn(), TextColumn("rows"),
                        TimeElapsedColumn(), TimeRemainingColumn(), console=err_console, transient=True,
                        disable=quiet or not err_console.is_terminal or os.environ.get("RANK", "0") != "0")
    with progress:
        task = progress.add_task("score", total=None)
        result = score(checkpoint, data, out, top_k=top_k, temperature=temperature, seq_length=seq_length,
                       dtype=torch_dt, device=device, micro_batch_size=micro_batch_size,
                       expert_parallel=expert_parallel, force=force, shard_tokens=shard_tokens,
                       progress=lambda done, total: progress.update(task, completed=done, total=total))
    if os.environ.get("RANK", "0") != "0":  # under torchrun only rank 0 reports
        return
    for note in result.notes or ():
        print_note(note)
    if not quiet:
        render(result)
    if json_path is not None:
        write_json(json_path, result.to_json(), done=f"scores written to {out}")
