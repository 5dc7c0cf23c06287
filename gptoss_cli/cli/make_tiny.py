"""`gptoss make-tiny`: write a small GPT-OSS HF checkpoint with the real layout."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from rich.text import Text

from gptoss_cli.cli.app import app, check_json_path, console, handle_errors, print_note, write_json
from gptoss_cli.cli.render import human_bytes


@app.command("make-tiny")
@handle_errors
def make_tiny_cmd(
    dst: Path = typer.Argument(..., help="Output folder."),
    experts: str = typer.Option("mxfp4", "--experts", help="Expert form: mxfp4 (as released) or bf16."),
    seed: int = typer.Option(0, "--seed", min=0, max=2**63 - 1, help="Random seed for the weights."),
    dtype: str = typer.Option("bfloat16", "--dtype", help="bfloat16 or float32 for the float tensors."),
    head_dim: int = typer.Option(16, "--head-dim", help="Attention head size: 16 keeps the tiny preset's (what "
                                 "model.preset: tiny recipes build); 64, GPT-OSS's own, is what vLLM's CPU build "
                                 "serves (serve-check, GRPO with vLLM rollouts)."),
    force: bool = typer.Option(False, "--force", help="Replace a non-empty DST."),
    json_path: Optional[Path] = typer.Option(None, "--json", help="Also write a machine-readable summary."),
) -> None:
    """Write a tiny GPT-OSS checkpoint in the real Hugging Face layout, for demos and tests.

    3 blocks, 4 experts (top-2), hidden 64, intermediate 96, 6 query / 2 kv heads of size 16 (--head-dim),
    vocab 1003, sliding window 8: small, but shaped so that layout bugs show.

    Example: gptoss make-tiny /tmp/tiny --experts mxfp4 && gptoss convert /tmp/tiny /tmp/tiny-hybrid

    Example: gptoss make-tiny h64-hf --head-dim 64 && gptoss serve-check h64-hf
    """
    check_json_path(json_path)
    from gptoss_cli.checkpoint.make_tiny import make_tiny

    result = make_tiny(dst, experts=experts, seed=seed, dtype=dtype, force=force,
                       head_dim=head_dim)
    for note in result.notes:
        print_note(note)
    if json_path:
        write_json(json_path, result.to_json(), done=f"wrote {result.destination}")
    console.print(
        Text("wrote tiny GPT-OSS checkpoint to ") + Text(result.destination, style="bold")
        + Text(f" ({result.experts} experts, {result.num_tensors} tensors, {human_bytes(result.bytes_written)})"),
        highlight=False,
    )
