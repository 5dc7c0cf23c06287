"""`gptoss report`'s library side: read a run folder's metrics.jsonl, summarise the run, draw its PNG plots.

A run's metrics.jsonl (written by train/metrics.py) holds one line per rank and step; the step's
global values (loss, lr, grad norm, tokens/s, i23's mfu when present, the validation loss at the
steps it ran, the router telemetry, the objective's metrics) are on rank 0's line. A resumed run
appends again from its checkpoint's step: the later line of a (step, rank) wins. A run killed while
rank 0 wrote a line leaves that last line torn (no newline at its end): it is dropped with a note
naming the file and line, and the rest is summarised. Any other line
that is not a JSON record, or whose fields the summary reads have the wrong shape (a list where a
number belongs, an `expert_load` layer without experts), is an error naming the file, line and
field (docs/router-telemetry.md).

Which of the objective's metrics are curves, and under what label, the run folder's objective.json
says (written at the start of the run from the objective's `shown_metrics`, train/objective.py):
this module knows no objective's metrics by name. A folder written before objective.json existed
gets the curves report drew then (`BEFORE_OBJECTIVE_FILE`).
"""

from __future__ import annotations

import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

from gptoss_cli.errors import UsageError, file_system_error, require_extra
from gptoss_cli.json_input import parse_json
from gptoss_cli.train.progress import MetricDisplay

METRICS = "metrics.jsonl"
OBJECTIVE = "objective.json"  # the run's objective and the metrics of it that report shows
# The loop's and the model's per-step curves, drawn when the records carry them (mfu / tflops_per_gpu
# come from i23's FLOPs accounting; aux_loss and z_loss from the router losses any objective may add);
# the objective's own follow them (objective.json).
CURVES = (("loss", "loss"), ("lr", "learning rate"), ("grad_norm", "gradient norm"),
          ("tokens_per_s", "tokens/s"), ("mfu", "MFU"), ("tflops_per_gpu", "TFLOP/s per GPU"),
          ("aux_loss", "aux loss"), ("z_loss", "router z-loss"), ("val_loss", "validation loss"))
# A run folder without objective.json was written before it existed: the objective curves report
# drew then (a GRPO run's; absent from other runs' records, so drawn for none of them).
BEFORE_OBJECTIVE_FILE = (("reward_mean", "mean reward"), ("mismatch_kl", "mismatch KL (engine || trainer)"),
                         ("mismatch_logp_abs", "mean |logprob engine - trainer|"))
_PLAIN_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*\Z")  # a metric's name is also its plot's file name


def objective_record(name: str, shown: Sequence[MetricDisplay]) -> dict[str, Any]:
    """objective.json's content: the objective's name and how its shown metrics are shown."""
    return {"objective": name, "shown_metrics": [asdict(m) for m in shown]}


@dataclass
class RunMetrics:
    """The parsed records of one run folder."""

    path: Path
    steps: list[dict[str, Any]]  # rank 0's record of each step, by step
    ranks: dict[int, list[dict[str, Any]]]  # every rank's records, by step
    notes: list[str] = field(default_factory=list)
    train_iters: int | None = None  # from the run's recipe.json, when present
    # (field, label) of every curve: the loop's (CURVES), then the objective's (objective.json)
    curves: tuple[tuple[str, str], ...] = CURVES


def read_metrics(run_dir: str | Path) -> RunMetrics:
    """Parse `run_dir/metrics.jsonl` (see the module docstring for what is an error)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise UsageError(f"{run_dir}: not a run folder (no such folder)", hint="give the logging.run_dir of a run")
    path = run_dir / METRICS
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise UsageError(f"{path}: no {METRICS} in this folder (not a training run folder, or the run "
                         "stopped before its first step)", hint="give the logging.run_dir of a run") from None
    except OSError as exc:
        raise file_system_error(exc) from None
    curves = CURVES + tuple(c for c in objective_curves(run_dir) if c[0] not in dict(CURVES))
    numbers = tuple(key for key, _ in curves) + ("rank_step_time_s",)
    lines = raw.split(b"\n")
    torn = lines.pop() if lines else b""  # the text after the last newline: empty unless a write was cut
    notes: list[str] = []
    records: dict[tuple[int, int], dict[str, Any]] = {}
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        records_key, record = _parse(path, number, line, numbers)
        records[records_key] = record
    if torn.strip():
        try:
            key, record = _parse(path, len(lines) + 1, torn, numbers)
            records[key] = record  # complete JSON, only its newline is missing
        except UsageError:
            notes.append(f"{path}:{len(lines) + 1}: the last line is cut off (the run was killed while writing "
                         "it); it was left out")
    if not records:
        raise UsageError(f"{path}: no step records (the file is empty)",
                         hint="the run stopped before its first step; run gptoss train again")
    steps = [r for (step, rank), r in sorted(records.items()) if rank == 0]
    ranks: dict[int, list[dict[str, Any]]] = {}
    for (step, rank), r in sorted(records.items()):
        ranks.setdefault(rank, []).append(r)
    return RunMetrics(path=path, steps=steps, ranks=ranks, notes=notes, train_iters=_train_iters(run_dir),
                      curves=curves)


def objective_curves(run_dir: Path) -> tuple[tuple[str, str], ...]:
    """(field, label) of the objective metrics the run's objective.json names (BEFORE_OBJECTIVE_FILE
    without one); a file that is not such a record is an error naming it and the entry."""
    path = run_dir / OBJECTIVE
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return BEFORE_OBJECTIVE_FILE
    except OSError as exc:
        raise file_system_error(exc) from None
    hint = "objective.json is written by gptoss train from the objective's shown_metrics; restore or remove it"
    try:
        shown = parse_json(raw)["shown_metrics"]
    except (ValueError, UnicodeDecodeError, KeyError, TypeError):
        raise UsageError(f"{path}: not a record with a 'shown_metrics' list", hint=hint) from None
    if not isinstance(shown, list):
        raise UsageError(f"{path}: 'shown_metrics' is {_short(shown)}, not a list", hint=hint)
    out = []
    for i, entry in enumerate(shown):
        name = entry.get("name") if isinstance(entry, dict) else None
        label = entry.get("label", name) if isinstance(entry, dict) else None
        if not isinstance(name, str) or not _PLAIN_NAME.match(name) or not isinstance(label, str):
            raise UsageError(f"{path}: shown_metrics[{i}] is {_short(entry)}, not {{'name': a metrics.jsonl field, "
                             "'label': text}", hint=hint)
        out.append((name, label))
    return tuple(out)


def _parse(path: Path, number: int, line: bytes,
           numbers: tuple[str, ...]) -> tuple[tuple[int, int], dict[str, Any]]:
    try:
        record = parse_json(line)
    except (ValueError, UnicodeDecodeError):
        raise UsageError(f"{path}:{number}: not a JSON record: {line[:60]!r}",
                         hint="metrics.jsonl is written by gptoss train; restore it or remove the line") from None
    if not isinstance(record, dict) or not _is_int(record.get("step")) or not _is_int(record.get("rank")):
        raise UsageError(f"{path}:{number}: a record needs integer 'step' and 'rank' fields",
                         hint="metrics.jsonl is written by gptoss train; restore it or remove the line")
    problem = _shape_problem(record, numbers)
    if problem:
        raise UsageError(f"{path}:{number}: {problem}",
                         hint="metrics.jsonl is written by gptoss train; restore it or remove the line")
    return (record["step"], record["rank"]), record


# Fields the summary and the plots read, beyond step and rank: the curves' and rank_step_time_s
# (numbers, null allowed), and the router's per-layer tables (docs/router-telemetry.md).
PER_LAYER_NUMBERS = ("router_cv", "router_entropy")


def _shape_problem(record: dict[str, Any], numbers: tuple[str, ...]) -> str | None:
    """What is wrong with the fields of `record` the summary reads (`numbers`: those that are numbers), or None."""
    for key in numbers:
        value = record.get(key)
        if value is not None and _number(value) is None:
            return f"field {key!r} is {_short(value)}, not a number"
    for key in PER_LAYER_NUMBERS:
        table = record.get(key)
        if table is None:
            continue
        if not isinstance(table, dict):
            return f"field {key!r} is {_short(table)}, not an object of layer -> number"
        for layer, value in table.items():
            if value is not None and _number(value) is None:
                return f"field {key!r} layer {layer}: {_short(value)} is not a number"
    load = record.get("expert_load")
    if load is None:
        return None
    if not isinstance(load, dict):
        return f"field 'expert_load' is {_short(load)}, not an object of layer -> tokens per expert"
    for layer, counts in load.items():
        if not isinstance(counts, list) or not counts:
            return f"field 'expert_load' layer {layer}: {_short(counts)} is not a non-empty list of token counts"
        for c in counts:
            if _number(c) is None or not 0 <= c < float("inf"):
                return f"field 'expert_load' layer {layer}: {_short(c)} is not a token count"
    return None


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _train_iters(run_dir: Path) -> int | None:
    try:
        value = parse_json((run_dir / "recipe.json").read_text())["training"]["train_iters"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return value if _is_int(value) else None


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def series(metrics: RunMetrics, key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of a global per-step field on rank 0's records, where present and numeric."""
    xs, ys = [], []
    for r in metrics.steps:
        v = _number(r.get(key))
        if v is not None:
            xs.append(r["step"])
            ys.append(v)
    return xs, ys


NOISE_SHARE = 0.1  # a start within this share of the series' range of zero has no relative trend


def trend(values: list[float]) -> float | None:
    """Relative change from the mean of the first tenth of the values to the mean of the last
    tenth (at least one value each); None for fewer than 2 values, or a series about zero: one that
    takes both signs, or starts within NOISE_SHARE of its range of zero (a GRPO loss of +-1e-7, a
    mismatch KL of 1e-9 that rounding makes negative: a percentage of those is a ratio of roundings)."""
    if len(values) < 2 or (min(values) < 0 < max(values)):
        return None
    w = max(1, len(values) // 10)
    first, last = sum(values[:w]) / w, sum(values[-w:]) / w
    if abs(first) <= NOISE_SHARE * (max(values) - min(values)) or first == 0:
        return None
    return (last - first) / abs(first)


def summarise(metrics: RunMetrics) -> dict[str, Any]:
    """The run in numbers: steps reached, each curve's last value and trend, the router's most and
    least loaded experts per MoE layer at the last step with telemetry, the slowest rank."""
    last_step = metrics.steps[-1]["step"] if metrics.steps else max(r[-1]["step"] for r in metrics.ranks.values())
    out: dict[str, Any] = {
        "metrics": str(metrics.path), "steps_recorded": len(metrics.steps), "last_step": last_step,
        "train_iters": metrics.train_iters,
        "finished": metrics.train_iters is not None and last_step >= metrics.train_iters,
        "curves": {}, "router": {}, "ranks": {}, "notes": list(metrics.notes),
    }
    for key, _ in metrics.curves:
        _, ys = series(metrics, key)
        if ys:
            out["curves"][key] = {"last": ys[-1], "first": ys[0], "min": min(ys), "max": max(ys), "trend": trend(ys)}
    with_load = [r for r in metrics.steps if isinstance(r.get("expert_load"), dict)]
    if with_load:
        last = with_load[-1]
        router: dict[str, Any] = {"step": last["step"], "layers": {}}
        for layer, load in last["expert_load"].items():
            total = sum(load) or 1
            hi = max(range(len(load)), key=lambda e: load[e])
            lo = min(range(len(load)), key=lambda e: load[e])
            router["layers"][layer] = {
                "most_loaded": {"expert": hi, "share": load[hi] / total},
                "least_loaded": {"expert": lo, "share": load[lo] / total},
                "cv": _number((last.get("router_cv") or {}).get(layer)),
                "entropy": _number((last.get("router_entropy") or {}).get(layer)),
            }
        out["router"] = router
    for rank, records in metrics.ranks.items():
        times = [t for t in (_number(r.get("rank_step_time_s")) for r in records[1:] or records) if t is not None]
        if times:
            out["ranks"][str(rank)] = {"mean_step_time_s": sum(times) / len(times)}
    return out


def write_plots(metrics: RunMetrics, out_dir: str | Path) -> list[Path]:
    """PNG plots into `out_dir`: one per curve the records carry (`metrics.curves`) and `expert_load.png`, a
    heatmap per MoE layer of each expert's share of the layer's routed tokens over the steps.
    Each file is written under a temporary name and renamed into place. Needs matplotlib (`.[plot]`)."""
    require_extra("matplotlib", "gptoss report's plots", "plot")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise file_system_error(exc) from None
    written: list[Path] = []
    for key, label in metrics.curves:
        xs, ys = series(metrics, key)
        if ys:
            written.append(_save(curve_figure(xs, ys, label, plt), out_dir / f"{key}.png"))
    heat = _expert_load_figure(metrics, plt)
    if heat is not None:
        written.append(_save(heat, out_dir / "expert_load.png"))
    return written


def curve_figure(xs: list[int], ys: list[float], label: str, plt: Any) -> Any:
    """One curve over the steps; laid out so the axis labels stay inside the image."""
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.plot(xs, ys, marker="." if len(xs) < 50 else None)
    ax.set_xlabel("step")
    ax.set_ylabel(label)
    ax.set_title(f"{label} over steps")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def _expert_load_figure(metrics: RunMetrics, plt: Any) -> Any:
    with_load = [r for r in metrics.steps if isinstance(r.get("expert_load"), dict)]
    if not with_load:
        return None
    layers = list(with_load[-1]["expert_load"])
    fig, axes = plt.subplots(len(layers), 1, figsize=(8, 1.0 + 1.6 * len(layers)), squeeze=False)
    steps = [r["step"] for r in with_load]
    for ax, layer in zip(axes[:, 0], layers):
        columns = []
        for r in with_load:
            load = r["expert_load"].get(layer) or [0] * len(with_load[-1]["expert_load"][layer])
            total = sum(load) or 1
            columns.append([c / total for c in load])
        grid = [list(row) for row in zip(*columns)]  # [experts, steps]
        image = ax.imshow(grid, aspect="auto", interpolation="nearest", cmap="viridis", origin="lower",
                          extent=(steps[0] - 0.5, steps[-1] + 0.5, -0.5, len(grid) - 0.5))
        ax.set_ylabel(f"layer {layer}\nexpert")
        fig.colorbar(image, ax=ax, label="share")
    axes[-1, 0].set_xlabel("step")
    axes[0, 0].set_title("expert load: each expert's share of its layer's routed tokens")
    fig.tight_layout()
    return fig


def _save(fig: Any, path: Path) -> Path:
    import matplotlib.pyplot as plt

    from gptoss_cli.outputs import TMP, naming, temp_path

    tmp = temp_path(path, TMP)
    try:
        with naming(path):
            fig.savefig(tmp, format="png", dpi=100)
            os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise file_system_error(exc) from None
    finally:
        plt.close(fig)
    return path


__all__ = ["RunMetrics", "read_metrics", "summarise", "write_plots", "curve_figure", "series", "trend", "CURVES",
           "METRICS", "OBJECTIVE", "BEFORE_OBJECTIVE_FILE", "objective_record", "objective_curves"]
