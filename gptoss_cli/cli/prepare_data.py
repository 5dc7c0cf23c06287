"""`gptoss prepare-data`: files into the token files training reads, in the format --format names (data/prepare/)."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer
from rich.markup import escape
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn
from rich.table import Table

from gptoss_cli.cli.app import app, check_json_path, console, err_console, handle_errors, write_json
from gptoss_cli.data.prepare.formats import FORMATS, PrepareOptions, data_format


@app.command(
    "prepare-data",
    help=(
        "Tokenize text or JSONL files with a checkpoint's tokenizer.json into OUT.bin + OUT.json "
        "(uint16/uint32 tokens, documents separated by EOS), the format `data.kind=tokens` trains on.\n\n"
        "JSONL: one object per line, text under --text-key. Other files: plain text, blank lines separate documents.\n\n"
        "--format harmony: each JSONL line, Parquet or Arrow row is a conversation (harmony's JSON or the Hugging "
        "Face chat form, tools and tool calls included), rendered in harmony with a loss mask on what the assistant "
        "writes; writes OUT.idx and OUT.mask too. Inputs may also be Hugging Face dataset folders (save_to_disk) "
        "or dataset ids in the Hub cache (docs/sft-data.md).\n\n"
        "--format preference: each row is a preference pair (TRL's prompt/chosen/rejected or chosen/rejected "
        "conversations, harmony's JSON form); both sides rendered in harmony with the loss mask on the reply, two "
        "documents a pair, for objective.kind=dpo (docs/dpo.md).\n\n"
        "Example: gptoss prepare-data corpus.jsonl --tokenizer /models/gpt-oss-20b --out data/corpus\n"
        "then: gptoss train --recipe R data.kind=tokens data.path=data/corpus"
    ),
)
@handle_errors
def prepare_data_cmd(
    inputs: List[str] = typer.Argument(..., help="text or .jsonl files (harmony: also .parquet, dataset folders "
                                                 "and ids)", show_default=False),
    out: Path = typer.Option(..., "--out", "-o", help="output prefix: writes OUT.bin and OUT.json"),
    tokenizer: Path = typer.Option(..., "--tokenizer", "-t", help="tokenizer.json, or a checkpoint folder holding it"),
    text_key: str = typer.Option("text", "--text-key", help="JSONL field with the text"),
    eos_id: Optional[int] = typer.Option(None, "--eos-id", min=0, help="end-of-document id (default: config.json's eos_token_id)"),
    errors: str = typer.Option(
        "strict", "--errors", help="invalid UTF-8: strict (an error naming the file and byte offset) or replace (U+FFFD); "
        "harmony, preference: or skip (rows that do not parse are left out and counted)",
    ),
    split: Optional[str] = typer.Option(None, "--split", help="harmony, preference: the split of a dataset folder or id "
                                                              "(default: its only split, else train)", show_default=False),
    field_name: Optional[str] = typer.Option(None, "--field", help="harmony: the column holding the messages, or a "
                                                                   "string of a conversation's JSON (default: messages)",
                                             show_default=False),
    batch_rows: Optional[int] = typer.Option(None, "--batch-rows", min=1, max=1 << 20,
                                             help="harmony, preference: rows rendered per batch (memory is bounded by a batch; "
                                                  "default 256)", show_default=False),
    fmt: str = typer.Option("text", "--format", help=" or ".join(f"{f.name} ({f.reads})" for f in FORMATS.values())),
    analysis: Optional[str] = typer.Option(
        None, "--analysis", help="harmony, preference: keep (default; the last turn's analysis is trained, earlier ones dropped) "
        "or drop (no analysis messages)", show_default=False),
    train_on: Optional[str] = typer.Option(None, "--train-on", help="harmony: last (default: every assistant turn after the "
                                           "last user message) or all assistant turns",
                                           show_default=False),
    max_length: Optional[int] = typer.Option(
        None, "--max-length", help="harmony: longer conversations are dropped and counted (default: --seq-length); "
        "preference: longer pairs (both sides together)",
        show_default=False),
    truncate: bool = typer.Option(False, "--truncate", help="harmony: cut conversations at --max-length instead"),
    seq_length: Optional[int] = typer.Option(
        None, "--seq-length", help="harmony, preference: training row length to report packing efficiency for", show_default=False),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="no progress bar or table"),
    json_path: Optional[Path] = typer.Option(None, "--json", help="also write the result as JSON"),
) -> None:
    check_json_path(json_path)
    options = PrepareOptions(text_key=text_key, eos_id=eos_id, analysis=analysis, train_on=train_on,
                             max_length=max_length, truncate=truncate, seq_length=seq_length, split=split,
                             field=field_name, errors=errors, batch_rows=batch_rows)
    writer = data_format(fmt, options)  # an unknown format or an option it does not take: one line, before the bar
    bar = Progress(TextColumn("[bold]tokenizing"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                   TimeRemainingColumn(), console=err_console, transient=True,
                   disable=quiet or not err_console.is_terminal)
    with bar:
        task = bar.add_task("tokenizing", total=None)
        result = writer.write(list(inputs), out, tokenizer, options,
                              lambda done, total: bar.update(task, completed=done, total=total))
    for line in result.skipped:
        err_console.print(f"[yellow]skipped[/] {escape(line)}", highlight=False)
    if result.num_skipped > len(result.skipped):
        err_console.print(f"[yellow]skipped[/] {result.num_skipped - len(result.skipped)} more rows", highlight=False)
    if not quiet:
        table = Table(title="prepare-data", title_justify="left", show_header=False)
        table.add_column("", style="bold")
        table.add_column("")
        for label, value in [("tokens", f"{result.num_tokens:,} {result.dtype}"), *result.summary,
                             ("files", escape(", ".join(result.files)))]:
            table.add_row(label, value)
        console.print(table)
    if json_path:
        write_json(json_path, result.to_dict(), done=f"wrote {result.bin_path}")
