"""`gptoss parity-check HF HYBRID`: prove a converted checkpoint computes what the HF one computes."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Optional

import typer
from rich.markup import escape
from rich.table import Table

from gptoss_cli.cli.app import app, check_json_path, check_number, console, err_console, handle_errors, write_json
from gptoss_cli.errors import ParityFailure


def _fmt(x: float, spec: str = ".3e") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def render(report) -> None:
    arch = report.architecture_differences
    if arch:
        console.print("[bold red]architecture differs[/] (HF config.json vs hybrid_config.json): " + escape("; ".join(arch)))
    w = report.weights
    if w is not None:
        status = "[green]OK[/]" if w.passed else "[bold red]FAIL[/]"
        note = f", Hybrid rounded to {w.rounded_to}" if w.rounded_to else ""
        console.print(f"weights HF <-> Hybrid: {status} ({w.tensors_checked} Hybrid tensors both ways{note})")
        for m in w.mismatches[:10]:
            console.print(f"  [red]{escape(str(m['direction']))}[/] {escape(str(m['tensor']))}: {escape(str(m['detail']))}")
        for label, names in (("missing in HF", w.missing_hf), ("missing in Hybrid", w.missing_hybrid),
                             ("left over in HF", w.leftover_hf), ("left over in Hybrid", w.leftover_hybrid)):
            if names:
                console.print(f"  [red]{len(names)} {label}[/]: {escape(', '.join(names[:5]))}{' ...' if len(names) > 5 else ''}")
    t = report.thresholds
    table = Table(title=f"forward parity ({report.dtype}, {report.device}, batch {report.batch} x {report.seq_len} tokens)")
    for col in ("stage", "max |diff|", "mean |diff|", "cosine", "max rel diff", ""):
        table.add_column(col, justify="left" if col == "stage" else "right")
    for s in report.stages:
        ok = "[green]ok[/]" if s.passed else "[bold red]DIVERGES[/]"
        if s.error:
            ok = f"[bold red]{escape(str(s.error))}[/]"
        table.add_row(s.stage, _fmt(s.max_abs_diff), _fmt(s.mean_abs_diff), _fmt(s.cosine, ".7f"), _fmt(s.rel_max_diff), ok)
    console.print(table)
    lg = report.logits
    if lg is not None:
        logits = Table(title="logits")
        for col in ("max |diff|", "mean |diff|", "cosine", "KL(ref||ours)", "top-1 agreement", ""):
            logits.add_column(col, justify="right")
        logits.add_row(
            _fmt(lg.max_abs_diff), _fmt(lg.mean_abs_diff), _fmt(lg.cosine, ".7f"), _fmt(lg.kl),
            f"{lg.top1_agreement:.2%}", "[green]ok[/]" if lg.passed else "[bold red]FAIL[/]",
        )
        console.print(logits)
    console.print(
        f"thresholds: top-1 >= {t.top1_min:.2%}, KL <= {t.kl_max:g}, logits cosine >= {t.logits_cosine_min}, "
        f"block cosine >= {t.hidden_cosine_min}, block max rel diff <= {t.hidden_rel_max:g}"
    )


@app.command("parity-check")
@handle_errors
def parity_check(
    hf: str = typer.Argument(..., help="Hugging Face GPT-OSS folder (bf16 or MXFP4 experts): the reference."),
    hybrid: Path = typer.Argument(..., help="Hybrid checkpoint folder (from `gptoss convert`)."),
    tokens: Optional[str] = typer.Option(
        None, help='Token ids to run, "1,2,3" or @file; default: deterministic ids longer than 2x the sliding window.'
    ),
    seq_len: Optional[int] = typer.Option(None, "--seq-len", min=1, max=1 << 20,
                                          help="Length of the default prompt (or cut --tokens)."),
    batch: int = typer.Option(1, min=1, max=1 << 16, help="Rows in the batch."),
    dtype: str = typer.Option("float32", help="float32 or bfloat16 (both sides)."),
    device: str = typer.Option("cpu", help="torch device, e.g. cpu or cuda."),
    top1_min: Optional[float] = typer.Option(None, "--top1-min", help="Min top-1 agreement (fp32 default 1.0, bf16 0.8)."),
    kl_max: Optional[float] = typer.Option(None, "--kl-max", help="Max mean KL(ref||ours) (fp32 1e-6, bf16 1e-2)."),
    cosine_min: Optional[float] = typer.Option(None, "--cosine-min", help="Min logits cosine (fp32 0.99999, bf16 0.99)."),
    hidden_cosine_min: Optional[float] = typer.Option(None, "--hidden-cosine-min", help="Min per-block hidden-state cosine."),
    hidden_rel_max: Optional[float] = typer.Option(None, "--hidden-rel-max", help="Max per-block max|diff|/max|ref|."),
    skip_weights: bool = typer.Option(False, "--skip-weights", help="Skip the HF <-> Hybrid weight comparison."),
    json_path: Optional[Path] = typer.Option(None, "--json", help="Write the whole report as JSON here."),
) -> None:
    """Compare HYBRID with HF: weights both ways, then a forward pass block by block against transformers.

    Holds one HF block (Hybrid layers 2i and 2i+1) at a time. Exit 0 on pass, 1 on a parity
    failure (the first diverging block is named), 2 on bad input.

    Example: gptoss parity-check /ckpt/gpt-oss-20b /ckpt/gpt-oss-20b-hybrid --json parity.json
    """
    check_number("--top1-min", top1_min, low=0.0, high=1.0)
    check_number("--kl-max", kl_max, low=0.0)
    check_number("--cosine-min", cosine_min, low=-1.0, high=1.0)
    check_number("--hidden-cosine-min", hidden_cosine_min, low=-1.0, high=1.0)
    check_number("--hidden-rel-max", hidden_rel_max, low=0.0)
    check_json_path(json_path)
    from gptoss_cli.parity.check import run_parity

    thresholds = dict(top1_min=top1_min, kl_max=kl_max, logits_cosine_min=cosine_min,
                      hidden_cosine_min=hidden_cosine_min, hidden_rel_max=hidden_rel_max)
    with err_console.status("parity-check: starting") as status:
        report = run_parity(
            hf, hybrid, tokens=tokens, seq_len=seq_len, batch=batch, dtype=dtype, device=device,
            thresholds=thresholds, check_weights_step=not skip_weights,
            progress=lambda stage: status.update(f"parity-check: {stage}"),
        )
    render(report)
    if json_path is not None:
        write_json(json_path, report.to_json(), done="parity-check ran")
    if not report.passed:
        raise ParityFailure(report.summary())
    console.print(f"[bold green]{escape(report.summary())}[/]")
