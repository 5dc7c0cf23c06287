"""`gptoss serve-check CHECKPOINT`: prove the serving engine computes what gptoss computes for a checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.markup import escape
from rich.table import Table

from gptoss_cli.cli.app import app, check_json_path, console, err_console, handle_errors, print_note, write_json
from gptoss_cli.errors import ParityFailure


def render(report) -> None:
    eng = report.engine
    kernels = ", ".join(f"{k} {v}" for k, v in eng.get("kernels", {}).items()) or "kernels not reported"
    where = eng.get("url") or eng.get("python") or ""
    console.print(f"engine: {escape(eng['name'])} {escape(eng['version'])} on {escape(eng['device'])} "
                  f"({escape(kernels)}) {escape(where)}", highlight=False)
    served = report.served
    adapter = f" + adapter {served['adapter']}" if served.get("adapter") else ""
    vocab = "full vocabulary" if served.get("top_k") is None else f"top-{served['top_k']} of the engine"
    console.print(f"served: {escape(served['form'])} {escape(served['model'])}{escape(adapter)} ({report.dtype}, "
                  f"logprobs over the {vocab})", highlight=False)
    table = Table(title=f"serve-check: {escape(report.checkpoint)} ({report.kind})", title_justify="left")
    for col in ("prompt", "tokens", "max |dlogprob|", "budget there", "mean KL", "greedy", "first divergence", ""):
        table.add_column(col, justify="left" if col in ("prompt", "") else "right")
    for p in report.prompts:
        greedy = f"{p.greedy_match_tokens}/{p.greedy_tokens}"
        if p.greedy_divergence_near_tie:
            greedy += " (near-tie)"
        first = "-" if p.first_divergent_position is None else f"token {p.first_divergent_position}"
        ok = "[green]ok[/]" if p.verdict == "pass" else "[bold red]FAIL[/]"
        table.add_row(escape(p.name), str(p.tokens), f"{p.max_abs_logprob_diff:.3g}", f"{p.budget:.3g}",
                      f"{p.mean_kl:.3g}", greedy, first, ok)
    console.print(table)
    for f in report.findings:
        label = "[bold red]finding[/]" if f.failing else "[yellow]finding[/]"
        console.print(f"{label} {escape(f.name)}: {escape(f.message)}", highlight=False)
    for note in report.notes:
        print_note(note)


@app.command("serve-check")
@handle_errors
def serve_check_cmd(
    checkpoint: str = typer.Argument(..., help="any checkpoint gptoss reads: HF, Hybrid, a training run or iteration "
                                               "(LoRA runs too), Megatron torch_dist"),
    engine: str = typer.Option("vllm", "--engine", help="the offline engine: vllm, or llamacpp (llama.cpp on a GGUF, "
                                                         "through llama-cpp-python: docs/gguf.md)"),
    engine_python: Optional[str] = typer.Option(
        None, "--engine-python", help="the Python of the engine's own venv (default: $GPTOSS_ENGINE_PYTHON "
                                      "for vLLM, $GPTOSS_LLAMACPP_PYTHON for llamacpp, else this one if it has it)"),
    endpoint: Optional[str] = typer.Option(None, "--endpoint", help="check a running OpenAI-compatible server "
                                                                    "instead (e.g. http://127.0.0.1:8000)"),
    served_model: Optional[str] = typer.Option(None, "--served-model", help="with --endpoint: the model name "
                                                                            "(default: the first it serves)"),
    dtype: str = typer.Option("float32", "--dtype", help="float32 or bfloat16: what the engine computes in; "
                                                         "llamacpp: the GGUF's tensors, f32, bf16, f16 or q8_0"),
    experts: Optional[str] = typer.Option(None, "--experts", help="export the experts as bf16 or mxfp4 "
                                                                  "(default: as the checkpoint has them); llamacpp: "
                                                                  "mxfp4 (default) or same (as --dtype)"),
    kv_cache: str = typer.Option("f32", "--kv-cache", help="llamacpp: the KV cache's type, f32 or f16 (llama.cpp's "
                                                          "default; its rounding is in the budget)"),
    lora: str = typer.Option("auto", "--lora", help="LoRA runs: adapter (the engine's LoRA), merged, or auto"),
    export: Optional[str] = typer.Option(None, "--export", help="check this existing export (HF folder, or PEFT "
                                                                "adapter of a LoRA run; llamacpp: a FILE.gguf) "
                                                                "instead of writing one"),
    prompts: Optional[Path] = typer.Option(None, "--prompts", help='JSONL: {"messages": [...]} conversations '
                                                                   '(SFT format) or {"prompt_ids": [...]} per line'),
    tokenizer: Optional[str] = typer.Option(None, "--tokenizer", help="tokenizer.json for --prompts conversations "
                                                                      "(default: the checkpoint's)"),
    top_k: Optional[int] = typer.Option(None, "--top-k", min=1, max=1 << 20, help="compare over the engine's top-k (default: the full "
                                                              "vocabulary up to 8192 tokens, else 20)"),
    greedy_tokens: int = typer.Option(8, "--greedy-tokens", min=0, max=4096, help="greedy tokens generated by both and compared"),
    keep: Optional[Path] = typer.Option(None, "--keep", help="write the exports here and keep them "
                                                             "(default: a temporary folder)"),
    json_path: Optional[Path] = typer.Option(None, "--json", help="also write the report as JSON"),
) -> None:
    """Serve CHECKPOINT with the engine and compare its per-token logprobs with gptoss's own forward.

    gptoss writes what the engine loads (HF folder, PEFT adapter or merged export), runs the engine on the
    same token ids, and compares every position against a budget from an error model of the dtype's
    rounding (docs/serve-check.md). Known engine divergences are named as findings.

    Exit 0 when it agrees, 1 when it does not (the prompt and token are named), 2 on bad input or an
    engine that is missing or cannot load the model (the engine's own message).

    Example: gptoss serve-check runs/sft/checkpoints --engine-python /opt/vllm/bin/python --json serve.json

    Example: gptoss serve-check ./gpt-oss-20b --endpoint http://127.0.0.1:8000 --dtype bfloat16

    Example: gptoss serve-check runs/sft/checkpoints --engine llamacpp --dtype q8_0 (exports the GGUF, runs llama.cpp)
    """
    check_json_path(json_path)
    from gptoss_cli.parity.serve.check import ServeCheckOptions, serve_check

    options = ServeCheckOptions(engine=engine, engine_python=engine_python, endpoint=endpoint,
                                served_model=served_model, dtype=dtype, experts=experts, lora=lora, export=export,
                                prompts=str(prompts) if prompts else None, tokenizer=tokenizer, top_k=top_k,
                                greedy_tokens=greedy_tokens, work_dir=str(keep) if keep else None, kv_cache=kv_cache)
    with err_console.status("serve-check: starting") as status:
        report = serve_check(checkpoint, options, progress=lambda stage: status.update(f"serve-check: {stage}"))
    render(report)
    if json_path is not None:
        write_json(json_path, report.to_json(), done="serve-check ran")
    failure = report.failure_line()
    if failure is not None:
        log = report.engine.get("log")
        raise ParityFailure(failure, hint=f"the engine's log: {log}" if log else None)
    console.print("[bold green]the engine computes what gptoss computes, within the budget[/]")
