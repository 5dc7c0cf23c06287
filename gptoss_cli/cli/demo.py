"""`gptoss demo`: run the whole job on a built-in tiny GPT-OSS, a line per stage, then a summary table."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Iterator, Optional

import typer
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from gptoss_cli.cli.app import app, check_json_path, console, handle_errors, write_json
from gptoss_cli.cli.render import ConvertProgressBar
from gptoss_cli.cli.train import TrainProgressBar

STYLE = {"passed": "green", "failed": "bold red", "skipped": "yellow", "not run": "dim"}


class _Hooks:
    def __init__(self, quiet: bool):
        self.quiet = quiet

    def stage(self, index: int, name: str, what: str) -> None:
        if self.quiet:
            return
        if console.is_terminal:
            console.rule(Text(f"{index}. {name}: {what}"), align="left")
        else:  # a log: one line, not a rule as wide as the log's unbounded width
            console.print(Text(f"--- {index}. {name}: {what}"), highlight=False)

    @contextlib.contextmanager
    def convert_progress(self, label: str) -> Iterator[ConvertProgressBar]:
        with ConvertProgressBar(console, label, enabled=not self.quiet) as progress:
            yield progress

    def train_progress(self) -> TrainProgressBar:
        return TrainProgressBar(self.quiet)

    def result(self, stage: Any) -> None:
        if not self.quiet:
            line = Text(f"{stage.status}: ", style=STYLE[stage.status])
            line.append(stage.summary)
            console.print(line, highlight=False, soft_wrap=True)
            for text in stage.lines:
                console.print(Text("  " + text), highlight=False, soft_wrap=True)


def render_summary(result: Any) -> None:
    table = Table(title=f"gptoss demo ({escape(result.workdir)})", title_justify="left")
    for col in ("stage", "result", "time", "key figure"):
        table.add_column(col)
    for i, s in enumerate(result.stages, 1):
        table.add_row(f"{i}. {s.name}", Text(s.status, style=STYLE[s.status]), f"{s.seconds:.1f} s",
                      escape(s.figure or "-"))
    console.print(table)
    console.print(Text(verdict(result), style="bold green" if result.ok else "bold red"), highlight=False, soft_wrap=True)


def verdict(result: Any) -> str:
    """The demo's last line: whether it passed, and which stages were skipped and why."""
    failed = [s.name for s in result.stages if s.status not in ("passed", "skipped")]
    if failed:
        text = f"demo FAILED: {', '.join(failed)} did not pass"
    elif result.skipped:
        text = f"demo OK: {len(result.stages) - len(result.skipped)} of {len(result.stages)} stages passed"
    else:
        text = "demo OK: every stage passed"
    if result.skipped:
        text += "; skipped: " + "; ".join(f"{s.name} ({s.summary})" for s in result.skipped)
    return f"{text} in {result.seconds:.0f} s"


@app.command("demo")
@handle_errors
def demo_cmd(
    workdir: Optional[Path] = typer.Option(
        None, "--workdir", help="Folder for the demo's outputs (default: a new temporary folder, kept). "
        "An existing folder must be empty or an earlier demo's.", show_default=False,
    ),
    steps: int = typer.Option(30, "--steps", min=1, max=10_000, help="Training steps of stage 4."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Only the summary table."),
    json_path: Optional[Path] = typer.Option(None, "--json", help="Also write every stage's result as JSON."),
) -> None:
    """The whole job in one command, on a built-in tiny GPT-OSS, with no GPU and no network.

    1. convert: a deterministic tiny GPT-OSS with MXFP4 experts (as released) -> Hybrid;
    2. parity-check: weights, then block-by-block logits against transformers (skipped without
    the .\\[parity] extra); 3. validate-config: the tiny EP=2 overlap recipe passes, a production
    recipe is rejected with the message a user would get; 4. train: 2 local processes, EP=2,
    overlap schedule + delayed wgrad, from the converted checkpoint, on learnable data; 5. sft:
    harmony conversations through prepare-data with make-tiny's tokenizer, a fine-tune with
    validation, eval and one generated reply (skipped without the .\\[data] extra); 6. export:
    the training checkpoint -> HF with MXFP4 experts, reloaded, same next-token predictions.

    Exit 0 when every stage passed (or was skipped: the last line names them), 1 when a stage
    failed, 2 for a bad option.

    Example: gptoss demo --workdir /tmp/gptoss-demo --steps 30 --json demo.json
    """
    check_json_path(json_path)
    from gptoss_cli.demo import run_demo

    result = run_demo(workdir, steps, hooks=_Hooks(quiet))
    render_summary(result)
    if json_path:
        write_json(json_path, result.to_dict(), done=f"demo {'passed' if result.ok else 'failed'}")
    if not result.ok:
        raise typer.Exit(1)
