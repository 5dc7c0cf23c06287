"""`gptoss generate CHECKPOINT`: talk to a checkpoint of any kind, with a KV cache, streaming the reply."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Callable, Optional

import typer
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from gptoss_cli.cli.app import app, check_json_path, console, err_console, handle_errors, write_json
from gptoss_cli.generate.command import GenerateHooks, GenerateOptions, GenerateResult, generate


def _short(text: str, width: int = 60) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 3] + "..."


def _note_empty_answer(r: Any, write_out: Callable[[str], None]) -> None:
    """A harmony reply without a final answer: what it holds instead; a reply that did not parse as
    harmony at all (an untrained model's) is shown as its raw text."""
    if not r.extra.get("harmony", True):
        err_console.print("[yellow]note:[/] the reply did not parse as harmony (no message text); its raw text:",
                          highlight=False)
        write_out(r.extra.get("raw_text", "") + "\n")
        return
    has = ", ".join(r.extra.get("channels", {})) or "nothing"
    calls = [m["recipient"] for m in r.extra.get("reply_messages", []) if m["recipient"]]
    note = f"a call to {calls[-1]}" if calls else f"no final-channel answer (the reply holds: {has})"
    err_console.print(f"[yellow]note:[/] {escape(note)}", highlight=False)


@app.command("generate")
@handle_errors
def generate_cmd(
    checkpoint: str = typer.Argument(..., help="HF, OpenAI-original or Hybrid folder, HF repo id, or a `gptoss train` "
                                               "checkpoint.dir / iter_* folder."),
    prompt: Optional[str] = typer.Option(None, "--prompt", "-p", help="one user turn (with --raw: the plain-text prompt)"),
    messages: Optional[Path] = typer.Option(None, "--messages", help="a JSON file with one conversation, in the form "
                                                                     "the SFT data takes ({\"messages\": [...]})"),
    prompts: Optional[Path] = typer.Option(None, "--prompts", help='JSONL file, one {"prompt": "..."} or conversation '
                                                                   "per line, generated as one batch"),
    system: Optional[str] = typer.Option(None, "--system", help="with --prompt: the system message's model identity"),
    developer: Optional[str] = typer.Option(None, "--developer", help="with --prompt: developer instructions"),
    reasoning_effort: Optional[str] = typer.Option(None, "--reasoning-effort", help="with --prompt: low, medium "
                                                                                    "(harmony's default) or high"),
    raw: bool = typer.Option(False, "--raw", help="plain-text prompt, no harmony rendering"),
    show_analysis: bool = typer.Option(False, "--show-analysis", help="also show the analysis (and other non-final "
                                                                      "channels) on stderr"),
    tokenizer: Optional[Path] = typer.Option(None, "--tokenizer", "-t",
                                             help="tokenizer.json or a folder holding it (default: the checkpoint's)"),
    max_new_tokens: int = typer.Option(512, "--max-new-tokens", "-n", help="most new tokens per prompt"),
    temperature: float = typer.Option(0.0, "--temperature", help="0 = greedy (default); else sample (1e-6 to 100)"),
    top_p: float = typer.Option(1.0, "--top-p", help="nucleus sampling: keep the most likely tokens up to this mass"),
    seed: int = typer.Option(0, "--seed", help="seed of the sampler"),
    device: Optional[str] = typer.Option(None, "--device", help="torch device (default: cuda if available, else cpu)"),
    dtype: str = typer.Option("auto", "--dtype", help="auto (bfloat16 on GPUs, float32 on CPUs), float32 or bfloat16"),
    json_path: Optional[Path] = typer.Option(None, "--json", help="also write prompt and output ids, text per channel, "
                                                                  "stop reasons, tokens/s"),
) -> None:
    """Talk to CHECKPOINT in the harmony format, streaming the final channel; stops at <|return|> or <|call|>.

    Examples: gptoss generate /ckpt/gpt-oss-20b -p "What is 2+2?" --reasoning-effort low;
    gptoss generate /runs/sft/checkpoints --messages chat.json --show-analysis --json reply.json;
    gptoss generate /ckpt/gpt-oss-20b --raw -p "The capital of France is" -n 16
    """
    options = GenerateOptions(
        checkpoint=checkpoint, prompt=prompt, messages=messages, prompts=prompts, system=system, developer=developer,
        reasoning_effort=reasoning_effort, raw=raw, show_analysis=show_analysis, tokenizer=tokenizer,
        max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, seed=seed, device=device, dtype=dtype,
    )
    options.check()
    check_json_path(json_path)
    with _Screen(checkpoint) as screen:
        result = generate(options, screen.hooks())
    _render(result)
    if json_path is not None:
        write_json(json_path, result.to_json(), done="generated")


def _write(stream) -> Callable[[str], None]:
    def write(text: str) -> None:
        stream.write(text)
        stream.flush()

    return write


class _Screen:
    """The terminal while generate runs: a spinner naming what loads, then a progress bar over a batch's
    prompts (none for a single prompt, whose reply streams to stdout)."""

    def __init__(self, checkpoint: str):
        self.status = err_console.status(f"generate: loading {escape(checkpoint)}")
        self.bar: Progress | None = None
        self.task = None

    def __enter__(self) -> "_Screen":
        self.status.start()
        return self

    def __exit__(self, *exc) -> None:
        self.status.stop()
        if self.bar is not None:
            self.bar.stop()

    def _started(self, prompts: int) -> None:
        self.status.stop()
        self.bar = Progress(TextColumn("[bold]generating"), BarColumn(), MofNCompleteColumn(), TextColumn("prompts"),
                            TimeElapsedColumn(), console=err_console, transient=True,
                            disable=prompts == 1 or not err_console.is_terminal)
        self.bar.start()
        self.task = self.bar.add_task("generating", total=prompts)

    def hooks(self) -> GenerateHooks:
        return GenerateHooks(loading=lambda name: self.status.update(f"generate: loading {escape(name)}"),
                             started=self._started, write_out=_write(sys.stdout), write_err=_write(sys.stderr),
                             # per-row progress only for a person watching: otherwise the batch decodes
                             # without reading each step's tokens back
                             row_done=(lambda row: self.bar.advance(self.task)) if err_console.is_terminal else None)


def _render(result: GenerateResult) -> None:
    """After the replies: a single prompt's stop reason and speed; a batch's table."""
    results = result.replies
    if len(results) == 1:
        r = results[0]
        write_out = _write(sys.stdout)
        write_out("\n")
        if not result.options.raw and not r.text:
            _note_empty_answer(r, write_out)
        err_console.print(f"[dim]{escape(r.stop_text())}; {len(r.generation.output_ids)} new tokens, "
                          f"{r.tokens_per_s:.1f} tokens/s[/]", highlight=False)
        return
    table = Table(title=f"generate: {len(results)} prompts in one batch", title_justify="left")
    for col in ("#", "prompt", "reply", "new tokens", "stop"):
        table.add_column(col, justify="right" if col in ("#", "new tokens") else "left")
    for i, r in enumerate(results):
        table.add_row(str(i), escape(_short(r.prompt, 30)), escape(_short(r.text)),
                      str(len(r.generation.output_ids)), escape(r.stop_text()))
    console.print(table)
    total = sum(len(r.generation.output_ids) for r in results)
    err_console.print(f"[dim]{total} new tokens, {total / max(results[0].seconds, 1e-9):.1f} tokens/s over the batch[/]",
                      highlight=False)
