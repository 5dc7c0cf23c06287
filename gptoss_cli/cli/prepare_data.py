"""`gptoss prepare-data`: tokenize text/JSONL files into the token file format training reads."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import List, Optional

import typer
from rich.markup import escape
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn
from rich.table import Table

from gptoss_cli.cli.app import app, check_json_path, console, err_console, handle_errors, write_json


@app.command(
    "prepare-data",
    help=(
        "Tokenize text or JSONL files with a checkpoint's tokenizer.json into OUT.bin + OUT.json "
        "(uint16/uint32 tokens, documents separated by EOS), the format `data.kind=tokens` trains on.\n\n"
        "JSONL: one object per line, text under --text-key. Other files: plain text, blank lines separate documents.\n\n"
        "Example: gptoss prepare-data corpus.jsonl --tokenizer /models/gpt-oss-20b --out data/corpus\n"
        "then: gptoss train --recipe R data.kind=tokens data.path=data/corpus"
    ),
)
@handle_errors
def prepare_data_cmd(
    inputs: List[Path] = typer.Argument(..., help="text or .jsonl files", show_default=False),
    out: Path = typer.Option(..., "--out", "-o", help="output prefix: writes OUT.bin and OUT.json"),
    tokenizer: Path = typer.Option(..., "--tokenizer", "-t", help="tokenizer.json, or a checkpoint folder holding it"),
    text_key: str = typer.Option("text", "--text-key", help="JSONL field with the text"),
    eos_id: Optional[int] = typer.Option(None, "--eos-id", min=0, help="end-of-document id (default: config.json's eos_token_id)"),
    errors: str = typer.Option(
        "strict", "--errors", help="invalid UTF-8: strict (an error naming the file and byte offset) or replace (U+FFFD)",
    ),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="no progress bar or table"),
    json_path: Optional[Path] = typer.Option(None, "--json", help="also write the result as JSON"),
) -> None:
    check_json_path(json_path)
    from gptoss_cli.train.prepare_data import prepare_data

    bar = Progress(TextColumn("[bold]tokenizing"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                   TimeRemainingColumn(), console=err_console, transient=True,
                   disable=quiet or not err_console.is_terminal)
    with bar:
        task = bar.add_task("tokenizing", total=None)

        def progress(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)

        result = prepare_data(list(inputs), out, tokenizer, text_key=text_key, eos_token_id=eos_id, progress=progress,
                              errors=errors)
    if not quiet:
        table = Table(title="prepare-data", title_justify="left", show_header=False)
        table.add_column("", style="bold")
        table.add_column("")
        table.add_row("tokens", f"{result.num_tokens:,} {result.dtype}")
        table.add_row("documents", f"{result.num_documents:,}")
        table.add_row("vocab / eos", f"{result.vocab_size} / {result.eos_token_id}")
        table.add_row("files", escape(f"{result.bin_path}, {result.header_path}"))
        console.print(table)
    if json_path:
        write_json(json_path, dataclasses.asdict(result), done=f"wrote {result.bin_path}")
