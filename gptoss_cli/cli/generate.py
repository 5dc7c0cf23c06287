"""`gptoss generate CHECKPOINT`: talk to a checkpoint of any kind, with a KV cache, streaming the reply."""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any, Callable, Optional

import typer
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from gptoss_cli.cli.app import app, check_json_path, check_number, console, err_console, handle_errors, write_json
from gptoss_cli.errors import UsageError


MIN_TEMPERATURE = 1e-6  # far from fp32 overflow of logits / temperature, far below any useful temperature
MAX_TEMPERATURE = 100.0


def _short(text: str, width: int = 60) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 3] + "..."


def _check_options(prompt: str | None, messages: Path | None, prompts: Path | None, raw: bool, show_analysis: bool,
                   prompt_options: tuple, max_new_tokens: int, temperature: float, top_p: float, seed: int) -> None:
    """The option combinations and bounds generate refuses before it loads anything (one line, exit 2)."""
    if sum(x is not None for x in (prompt, messages, prompts)) != 1:
        raise UsageError("give exactly one of --prompt TEXT, --messages FILE.json or --prompts FILE.jsonl")
    if prompt is not None and not prompt:
        raise UsageError("--prompt is empty")
    if raw and (messages is not None or show_analysis):
        raise UsageError("--raw takes a plain-text --prompt or --prompts, not --messages or --show-analysis")
    if (raw or prompt is None and prompts is None) and any(x is not None for x in prompt_options):
        raise UsageError("--system, --developer and --reasoning-effort go with a harmony --prompt or --prompts; "
                         "write them into the conversation of --messages")
    if max_new_tokens < 1 or max_new_tokens > 1 << 20:
        raise UsageError(f"--max-new-tokens {max_new_tokens} must be in [1, {1 << 20}]")
    # logits / temperature is fp32: below ~1e-38 it overflows to inf and the softmax turns NaN
    if temperature != 0.0 and not (math.isfinite(temperature) and MIN_TEMPERATURE <= temperature <= MAX_TEMPERATURE):
        raise UsageError(f"--temperature {temperature!r} must be 0 (greedy) or a finite number in "
                         f"[{MIN_TEMPERATURE:g}, {MAX_TEMPERATURE:g}]")
    check_number("--top-p", top_p, low=0.0, high=1.0, low_inclusive=False)
    if not 0 <= seed < 1 << 63:
        raise UsageError(f"--seed {seed} must be in [0, 2**63)")


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
    from gptoss_cli.generate.chat import prepare_prompts
    from gptoss_cli.generate.decode import Sampling
    from gptoss_cli.generate.session import (
        default_device, load_model, load_tokenizer, open_checkpoint, resolve_dtype, run_generation,
    )

    _check_options(prompt, messages, prompts, raw, show_analysis, (system, developer, reasoning_effort),
                   max_new_tokens, temperature, top_p, seed)
    check_json_path(json_path)
    device = device or default_device()
    torch_dtype = resolve_dtype(dtype, device)

    ckpt = open_checkpoint(checkpoint, tokenizer)
    tok = load_tokenizer(ckpt.tokenizer_file, ckpt.arch.vocab_size)
    items, replies, stop_ids = prepare_prompts(
        tok, str(ckpt.tokenizer_file), raw=raw, prompt=prompt, messages=messages, prompts=prompts, system=system,
        developer=developer, reasoning_effort=reasoning_effort, show_analysis=show_analysis,
    )

    with err_console.status(f"generate: loading {escape(checkpoint)}") as status:
        model = load_model(ckpt, torch_dtype, device, progress=lambda name: status.update(f"generate: loading {escape(name)}"))
    sampling = Sampling(temperature=temperature, top_p=top_p, seed=seed)

    def write_out(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    def write_err(text: str) -> None:
        sys.stderr.write(text)
        sys.stderr.flush()

    bar = Progress(TextColumn("[bold]generating"), BarColumn(), MofNCompleteColumn(), TextColumn("prompts"),
                   TimeElapsedColumn(), console=err_console, transient=True,
                   disable=len(items) == 1 or not err_console.is_terminal)
    with bar:
        task = bar.add_task("generating", total=len(items))
        results = run_generation(model, tok, items, replies, max_new_tokens=max_new_tokens, stop_ids=stop_ids,
                                 sampling=sampling, write_out=write_out, write_err=write_err,
                                 on_done=lambda row: bar.advance(task))
    if len(results) == 1:
        r = results[0]
        write_out("\n")
        if not raw and not r.text:
            _note_empty_answer(r, write_out)
        err_console.print(f"[dim]{escape(r.stop_text())}; {len(r.generation.output_ids)} new tokens, "
                          f"{r.tokens_per_s:.1f} tokens/s[/]", highlight=False)
    else:
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
    if json_path is not None:
        payload = {
            "checkpoint": checkpoint, "kind": ckpt.kind, "tokenizer": str(ckpt.tokenizer_file),
            "mode": "raw" if raw else "harmony", "device": device, "dtype": str(torch_dtype).removeprefix("torch."),
            "sampling": {"temperature": temperature, "top_p": top_p, "seed": seed, "greedy": sampling.greedy},
            "max_new_tokens": max_new_tokens, "stop_token_ids": stop_ids,
            "replies": [r.to_json() for r in results],
        }
        write_json(json_path, payload, done="generated")
