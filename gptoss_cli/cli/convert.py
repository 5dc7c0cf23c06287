"""`gptoss convert`: parse options, run the conversion, render a summary table or JSON."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.table import Table
from rich.text import Text

from gptoss_cli.cli.app import app, check_json_path, check_number, console, handle_errors, print_note, write_json
from gptoss_cli.cli.render import ConvertProgressBar, human_bytes
from gptoss_cli.outputs import check_separate


@app.command("convert")
@handle_errors
def convert_cmd(
    src: str = typer.Argument(..., help="HF folder or Hugging Face repo id (owner/name), OpenAI original/ folder, a Hybrid "
                              "folder, a training checkpoint (a run's checkpoint.dir, read through `latest`, or one "
                              "iter_* folder), or a Megatron-LM torch_dist checkpoint (its dir or one iteration folder)."),
    dst: Path = typer.Argument(..., help="Output folder, or DST.gguf for --to gguf (written under a temporary name, "
                               "renamed when complete)."),
    to: Optional[str] = typer.Option(None, "--to", help="Output layout: hybrid or hf (a LoRA training checkpoint: its "
                                     "base with the adapters merged in), megatron (a Megatron-LM torch_dist "
                                     "checkpoint), peft (a LoRA run's adapters as a PEFT adapter, docs/lora.md), or gguf (one "
                                     "DST.gguf file for llama.cpp, docs/gguf.md). Default: the other layout than "
                                     "SRC's; hybrid for a training or Megatron checkpoint; gguf for a DST.gguf."),
    experts: Optional[str] = typer.Option(None, "--experts", help="Expert form of an HF output: bf16 (default) or "
                                          "mxfp4; of a GGUF: mxfp4 (default) or same (as --dtype)."),
    weights: Optional[str] = typer.Option(
        None, "--weights", help="Training checkpoints only. model (default): the weights the run computed with, in "
        "its params_dtype, so the export computes what the run's losses measured. master: the optimizer's fp32 master "
        "copies, which keep the precision that rounding to params_dtype drops (pair with --dtype float32)."),
    dtype: str = typer.Option("bfloat16", "--dtype", help="dtype of non-expert tensors and dequantized experts: "
                              "bfloat16 or float32; a GGUF's: f32, bf16, f16 or q8_0."),
    revision: Optional[str] = typer.Option(None, "--revision", help="Hub revision (branch, tag or commit) when SRC is a repo id."),
    force: bool = typer.Option(False, "--force", help="Replace a non-empty DST (only after the new one is complete)."),
    vocab_multiple: Optional[int] = typer.Option(
        None, "--vocab-multiple", min=1, max=1 << 16,
        help="--to megatron only: pad the embedding and output rows to a multiple of this "
        "(Megatron's --make-vocab-size-divisible-by; default 128; at most 65536)."),
    arch_from: Optional[str] = typer.Option(
        None, "--arch-from", help="Megatron SRC only: take the architecture from this HF config.json (or its folder) "
        "or preset (gpt_oss_20b, gpt_oss_120b, tiny) where the checkpoint's args (and run_config.yaml) do not "
        "record it, e.g. the sliding window or the position limit; it must agree with what they do record."),
    max_shard_gb: float = typer.Option(5.0, "--max-shard-size", help="Maximum output shard size in GB."),
    json_path: Optional[Path] = typer.Option(None, "--json", help="Also write a machine-readable summary to this file."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar and no table."),
) -> None:
    """Convert a GPT-OSS checkpoint between Hugging Face, Megatron Hybrid (*E) and Megatron-LM torch_dist layouts.

    The direction comes from SRC: an HF checkpoint (config.json, model_type gpt_oss; MXFP4 or bf16
    experts) or OpenAI's original/ layout becomes a Hybrid checkpoint (HF block i -> layers 2i, 2i+1);
    a Hybrid checkpoint (hybrid_config.json) becomes an HF one. A training checkpoint of `gptoss
    train` becomes a Hybrid checkpoint, or an HF one with --to hf; its architecture comes from the
    run it records, and it is only read, never modified. --to megatron writes a torch_dist checkpoint
    Megatron-LM loads (docs/megatron-checkpoints.md); a Megatron torch_dist checkpoint saved at TP=1
    and PP=1 is itself a SRC (Hybrid by default, or --to hf / megatron). Memory stays bounded by one tensor group,
    so 120B converts on a 24 GiB machine.

    Example: gptoss convert openai/gpt-oss-20b ./gpt-oss-20b-hybrid

    Example: gptoss convert runs/ft/checkpoints ./ft-hf --to hf   (bf16 experts; --experts mxfp4 says what
    rounding them costs a run trained without precision.qat=mxfp4)

    Example: gptoss convert openai/gpt-oss-20b ./gpt-oss-20b-megatron --to megatron

    Example: gptoss convert runs/ft/checkpoints ft.gguf --to gguf --dtype q8_0   (llama.cpp; MXFP4 experts)
    """
    check_number("--max-shard-size", max_shard_gb, low=0.0, low_inclusive=False, high=1e6)
    check_json_path(json_path)
    if Path(src).expanduser().is_dir():  # refuse at once, before torch is even imported (convert checks again)
        check_separate(Path(src).expanduser(), Path(dst).expanduser())
    from gptoss_cli.checkpoint.convert import convert
    from gptoss_cli.resources import keep_freed_memory

    keep_freed_memory()  # this process is the command's: glibc keeps freed chunk buffers (resources.py)
    with ConvertProgressBar(console, "converting", enabled=not quiet) as progress:
        result = convert(
            src, dst, experts=experts, dtype=dtype, revision=revision, force=force, to=to, weights=weights,
            progress=progress, vocab_multiple=vocab_multiple, arch_from=arch_from,
            max_shard_bytes=max(1, int(max_shard_gb * 1e9)),
        )
    for note in [] if quiet else result.notes:
        print_note(note)
    if json_path:
        write_json(json_path, result.to_json(), done=f"converted to {result.destination}")
    if quiet:
        return
    table = Table(title=Text(f"converted {result.direction}"), show_header=False)
    rows = [
        ("source", f"{result.source}" + (f" @ {result.revision}" if result.revision else "")),
        ("destination", result.destination),
        ("experts", f"{result.experts_in} -> {result.experts_out}"),
        ("dtype", result.dtype),
        ("tensors", str(result.num_tensors)),
        ("written", f"{human_bytes(result.bytes_written)} in {result.num_shards} shard(s)"),
        ("time", f"{result.seconds:.2f} s ({human_bytes(result.throughput_bytes_per_s)}/s)"),
        ("peak RSS", human_bytes(result.peak_rss_bytes)),
    ]
    p = result.provenance
    if "iteration" in p:  # a training checkpoint: which run, which step, which weights
        rows.insert(2, ("from run", f"{p['run']} at iteration {p['iteration']} ({p['weights']} weights)"))
    for k, v in rows:
        table.add_row(k, Text(v))  # paths are data, not markup
    console.print(table)
