"""`gptoss generate CHECKPOINT`: talk to a checkpoint of any kind, with a KV cache, streaming the reply."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer
from rich.markup import escape
from rich.table import Table

from gptoss_cli.cli.app import app, check_json_path, check_number, console, err_console, handle_errors, write_json
from gptoss_cli.errors import UsageError


def _short(text: str, width: int = 60) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 3] + "..."


@app.command("generate")
@handle_errors
def generate_cmd(
    checkpoint: str = typer.Argument(..., help="HF, OpenAI-original or Hybrid folder, HF repo id, or a `gptoss train` "
                                               "checkpoint.dir / iter_* folder."),
    prompt: Optional[str] = typer.Option(None, "--prompt", "-p", help="the prompt text"),
    prompts: Optional[Path] = typer.Option(None, "--prompts", help='JSONL file, one {"prompt": "..."} per line, '
                                                                   "generated as one batch"),
    raw: bool = typer.Option(False, "--raw", help="plain-text prompt, no chat rendering"),
    tokenizer: Optional[Path] = typer.Option(None, "--tokenizer", "-t",
                                             help="tokenizer.json or a folder holding it (default: the checkpoint's)"),
    max_new_tokens: int = typer.Option(256, "--max-new-tokens", "-n", help="most new tokens per prompt"),
    temperature: float = typer.Option(0.0, "--temperature", help="0 = greedy (default); else sample"),
    top_p: float = typer.Option(1.0, "--top-p", help="nucleus sampling: keep the most likely tokens up to this mass"),
    seed: int = typer.Option(0, "--seed", help="seed of the sampler"),
    device: Optional[str] = typer.Option(None, "--device", help="torch device (default: cuda if available, else cpu)"),
    dtype: str = typer.Option("auto", "--dtype", help="auto (bfloat16 on GPUs, float32 on CPUs), float32 or bfloat16"),
    json_path: Optional[Path] = typer.Option(None, "--json", help="also write prompts, ids, texts, stop reasons, tokens/s"),
) -> None:
    """Generate a reply from CHECKPOINT, streaming tokens as they come; stops at a stop token or --max-new-tokens.

    Example: gptoss generate /ckpt/gpt-oss-20b --raw --prompt "The capital of France is" -n 32
    """
    from gptoss_cli.generate.decode import Sampling
    from gptoss_cli.generate.session import (
        RAW_STOP_TOKENS, default_device, load_model, load_tokenizer, open_checkpoint, read_prompts_file,
        resolve_dtype, run_generation, stop_token_ids,
    )

    if (prompt is None) == (prompts is None):
        raise UsageError("give exactly one of --prompt TEXT or --prompts FILE.jsonl")
    if prompt is not None and not prompt:
        raise UsageError("--prompt is empty")
    if not raw:
        raise UsageError("only plain-text prompts are supported so far", hint="pass --raw")
    if max_new_tokens < 1 or max_new_tokens > 1 << 20:
        raise UsageError(f"--max-new-tokens {max_new_tokens} must be in [1, {1 << 20}]")
    check_number("--temperature", temperature, low=0.0, high=100.0)
    check_number("--top-p", top_p, low=0.0, high=1.0, low_inclusive=False)
    if not 0 <= seed < 1 << 63:
        raise UsageError(f"--seed {seed} must be in [0, 2**63)")
    check_json_path(json_path)
    texts = [prompt] if prompt is not None else [p["prompt"] for p in read_prompts_file(prompts)]

    ckpt = open_checkpoint(checkpoint, tokenizer)
    tok = load_tokenizer(ckpt.tokenizer_file, ckpt.arch.vocab_size)
    device = device or default_device()
    torch_dtype = resolve_dtype(dtype, device)
    with err_console.status(f"generate: loading {escape(checkpoint)}") as status:
        model = load_model(ckpt, torch_dtype, device, progress=lambda name: status.update(f"generate: loading {escape(name)}"))
    stop_ids = stop_token_ids(tok, RAW_STOP_TOKENS)
    sampling = Sampling(temperature=temperature, top_p=top_p, seed=seed)

    single = len(texts) == 1

    def stream(row: int, text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    replies = run_generation(model, tok, texts, max_new_tokens=max_new_tokens, stop_ids=stop_ids, sampling=sampling,
                             on_text=stream if single else None)
    if single:
        sys.stdout.write("\n")
        sys.stdout.flush()
        r = replies[0]
        err_console.print(f"[dim]{escape(r.stop_text())}; {len(r.generation.output_ids)} new tokens, "
                          f"{r.tokens_per_s:.1f} tokens/s[/]", highlight=False)
    else:
        table = Table(title=f"generate: {len(replies)} prompts in one batch", title_justify="left")
        for col in ("#", "prompt", "reply", "new tokens", "stop"):
            table.add_column(col, justify="right" if col in ("#", "new tokens") else "left")
        for i, r in enumerate(replies):
            table.add_row(str(i), escape(_short(r.prompt, 30)), escape(_short(r.text)),
                          str(len(r.generation.output_ids)), escape(r.stop_text()))
        console.print(table)
        err_console.print(f"[dim]{sum(len(r.generation.output_ids) for r in replies)} new tokens, "
                          f"{sum(len(r.generation.output_ids) for r in replies) / replies[0].seconds:.1f} tokens/s "
                          f"over the batch[/]", highlight=False)
    if json_path is not None:
        payload = {
            "checkpoint": checkpoint, "kind": ckpt.kind, "tokenizer": str(ckpt.tokenizer_file), "mode": "raw",
            "device": device, "dtype": str(torch_dtype).removeprefix("torch."),
            "sampling": {"temperature": temperature, "top_p": top_p, "seed": seed, "greedy": sampling.greedy},
            "max_new_tokens": max_new_tokens, "stop_token_ids": stop_ids,
            "replies": [r.to_json() for r in replies],
        }
        write_json(json_path, payload, done="generated")
