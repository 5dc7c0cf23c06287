"""The figures table of bench/README.md, generated from the committed bench records under bench/results/.

Every bench writes its run as one JSON record with `--json PATH` (bench/harness.py, schema
`gptoss-bench/1`). The records kept as the project's figures live in bench/results/ (one file per
headline run; the history of each is the file's git history). This script checks each record
against the schema and renders one markdown table: per case, each ratio (median of the per-round
ratios, with their min and max) and the medians of the two settings it compares; a case without
ratios shows each setting's metrics.

    python bench/report.py                 # print the table
    python bench/report.py --write         # regenerate the table in bench/README.md
    python bench/report.py --check         # exit 1 when bench/README.md's table is not this output
    python bench/report.py a.json b.json   # check and print these records instead

Exit codes: 0 done; 1 --check found the README stale; 2 a record or the README is not what it must
be (one line naming the file and the field).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent
RESULTS = BENCH / "results"
README = BENCH / "README.md"
SCHEMA = "gptoss-bench/1"  # bench/harness.py's
BEGIN, END = "<!-- figures:begin -->", "<!-- figures:end -->"
REQUIRED = {"schema": str, "bench": str, "command": str, "date": str, "source": str, "machine": dict,
            "options": dict, "settings": list, "cases": dict, "extra": dict}


class RecordError(ValueError):
    """A record that does not follow the schema: its message names the file and the field."""


def _number(value) -> bool:
    return value is None or (isinstance(value, (int, float)) and not isinstance(value, bool))


def _check_stat(where: str, stat) -> None:
    if not isinstance(stat, dict) or "median" not in stat:
        raise RecordError(f"{where}: must be an object with a median")
    for key in ("median", "min", "max"):
        if not _number(stat.get(key)):
            raise RecordError(f"{where}.{key}: {stat.get(key)!r} is not a number")
    if not isinstance(stat.get("values", []), list) or not all(_number(v) for v in stat.get("values", [])):
        raise RecordError(f"{where}.values: must be a list of numbers")


def check_record(record, name: str) -> dict:
    """`record` if it follows the schema, else RecordError naming `name` and the field."""
    if not isinstance(record, dict):
        raise RecordError(f"{name}: a record is a JSON object")
    for key, kind in REQUIRED.items():
        if not isinstance(record.get(key), kind):
            raise RecordError(f"{name}: field {key!r} must be a {kind.__name__}, not {record.get(key)!r:.60}")
    if record["schema"] != SCHEMA:
        raise RecordError(f"{name}: field 'schema' is {record['schema']!r}, this report reads {SCHEMA!r}")
    if not isinstance(record["machine"].get("cpu"), str):
        raise RecordError(f"{name}: field 'machine.cpu' must name the CPU")
    load = record.get("load")
    if load is not None and not (isinstance(load, dict) and all(_number(load.get(k)) for k in ("min", "max"))):
        raise RecordError(f"{name}: field 'load' must hold min and max")
    for case, body in record["cases"].items():
        where = f"{name}: cases[{case!r}]"
        if not isinstance(body, dict) or not isinstance(body.get("settings"), dict) or \
                not isinstance(body.get("ratios", {}), dict):
            raise RecordError(f"{where}: must hold 'settings' (and 'ratios') objects")
        for setting, metrics in body["settings"].items():
            if not isinstance(metrics, dict):  # empty where only a ratio was recorded
                raise RecordError(f"{where}.settings[{setting!r}]: must map metrics to their figures")
            for metric, stat in metrics.items():
                _check_stat(f"{where}.settings[{setting!r}][{metric!r}]", stat)
        for ratio, stat in body.get("ratios", {}).items():
            _check_stat(f"{where}.ratios[{ratio!r}]", stat)
            for key in ("num", "den", "metric"):
                if not isinstance(stat.get(key), str):
                    raise RecordError(f"{where}.ratios[{ratio!r}].{key}: must name a setting or metric")
    return record


def load_records(paths: list[Path]) -> list[tuple[Path, dict]]:
    out = []
    for path in paths:
        try:
            record = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError) as exc:
            raise RecordError(f"{path}: cannot be read ({exc.__class__.__name__}: {exc})") from None
        except json.JSONDecodeError as exc:
            raise RecordError(f"{path}: not JSON (line {exc.lineno}: {exc.msg})") from None
        out.append((path, check_record(record, str(path))))
    return out


# --- rendering ------------------------------------------------------------------------------------
def _sig(x: float) -> str:
    return f"{x:.3g}" if abs(x) < 1000 else f"{x:,.0f}"


def value_text(metric: str, x) -> str:
    """A figure with the unit its metric's name says (`_s`, `_ms`, `_gb`, `_share`, ...)."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    if metric.endswith("_share"):
        return f"{100 * x:.1f}%"
    if metric.endswith("_bytes") or metric == "bytes":
        for unit, size in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
            if abs(x) >= size:
                return f"{_sig(x / size)} {unit}"
        return f"{x:.0f} B"
    for suffix, unit in UNITS:
        if metric.endswith(suffix):
            return f"{_sig(x)} {unit}"
    if metric.endswith("_s"):
        return f"{_sig(x * 1e3)} ms" if abs(x) < 1 else f"{_sig(x)} s"
    return _sig(x)


UNITS = (("tokens_per_s", "tokens/s"), ("us_per_token", "µs/token"), ("_per_s", "/s"), ("_ms", "ms"), ("_gb", "GB"),
         ("_mib", "MiB"), ("_gbps", "GB/s"), ("_tflops", "TFLOP/s"), ("gflops", "GFLOP/s"))


def metric_label(metric: str) -> str:
    """A metric's name without the unit its value already shows."""
    for suffix in ("_share", "_bytes", "_s", "_gb", "_mib", "_ms"):
        if metric.endswith(suffix) and not metric.endswith("_per_s"):
            return metric[: -len(suffix)]
    return metric


def spread_text(stat: dict, fmt) -> str:
    text = fmt(stat["median"])
    lo, hi = stat.get("min"), stat.get("max")
    if lo is not None and hi is not None and lo != hi:
        text += f" [{fmt(lo)}, {fmt(hi)}]"
    return text


def _ratio_text(x) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.2f}x"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def run_text(record: dict) -> str:
    date = record["date"].replace("T", " ")[:16]
    load = record.get("load")
    if load is None:
        text = date
    elif load["min"] == load["max"]:
        text = f"{date}, load {load['min']:.1f}"
    else:
        text = f"{date}, load {load['min']:.1f}-{load['max']:.1f}"
    return text + (" †" if record["source"] != "measured" else "")


def rows_of(path: Path, record: dict) -> list[list[str]]:
    """The table rows of one record: per case its ratios, or (no ratio) its settings' metrics."""
    rel = path.relative_to(BENCH).as_posix() if path.is_relative_to(BENCH) else path.as_posix()
    head = f"`{record['command']}` ([record]({rel}))"
    rows = []
    for case, body in record["cases"].items():
        settings = body["settings"]
        if body.get("ratios"):
            for name, r in body["ratios"].items():
                sides = [f"{s} {value_text(r['metric'], settings[s][r['metric']]['median'])}"
                         for s in (r["num"], r["den"]) if r["metric"] in settings.get(s, {})]
                rows.append([case, name, spread_text(r, _ratio_text), "; ".join(sides)])
        else:  # one row per setting, its metrics side by side
            for setting, metrics in settings.items():
                rows.append([case, setting, "; ".join(
                    f"{metric_label(m)} {spread_text(s, lambda x, m=m: value_text(m, x))}" for m, s in metrics.items()),
                    ""])
    for i, row in enumerate(rows):
        row.insert(0, head if i == 0 else "")
        row.append(run_text(record) if i == 0 else "")
    return rows


def machines_text(records: list[tuple[Path, dict]]) -> list[str]:
    seen: dict[str, None] = {}
    for _, r in records:
        m = r["machine"]
        parts = [m["cpu"]] + [f"{m[k]} {label}" for k, label in (("cpus", "CPUs"), ("memory_gib", "GiB"))
                              if m.get(k)] + ([m["accelerator"]] if m.get("accelerator") else [])
        seen[", ".join(str(p) for p in parts) + (f" ({m['note']})" if m.get("note") else "")] = None
    return list(seen)


def table(records: list[tuple[Path, dict]]) -> str:
    """The generated block: the table, the machines, what † means."""
    lines = ["| bench | case | figure | median [min, max] | per setting, median | run |", "|---|---|---|---|---|---|"]
    for path, record in records:
        lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows_of(path, record)]
    lines.append("")
    lines.append("Machines: " + "; ".join(machines_text(records)) + ".")
    sources = sorted({r["source"] for _, r in records if r["source"] != "measured"})
    if sources:
        lines.append("† " + "; ".join(sources) + ": figures copied from the notebook this table replaced, "
                     "not re-measured (the record keeps the command and the load of that run).")
    return "\n".join(lines) + "\n"


def replace_block(text: str, block: str, where: str) -> str:
    pattern = re.compile(re.escape(BEGIN) + r"\n.*?" + re.escape(END), re.S)
    if not pattern.search(text):
        raise RecordError(f"{where}: no {BEGIN} ... {END} markers around the figures table")
    return pattern.sub(lambda _: BEGIN + "\n" + block + END, text, count=1)


def generated_block(text: str) -> str | None:
    m = re.search(re.escape(BEGIN) + r"\n(.*?)" + re.escape(END), text, re.S)
    return m.group(1) if m else None


def _write_whole(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("records", nargs="*", type=Path, help="records to check and print (default: bench/results/*.json)")
    what = ap.add_mutually_exclusive_group()
    what.add_argument("--write", action="store_true", help="regenerate the figures table in bench/README.md")
    what.add_argument("--check", action="store_true", help="exit 1 when bench/README.md's table is stale")
    args = ap.parse_args(argv)
    paths = args.records or sorted(RESULTS.glob("*.json"))
    try:
        block = table(load_records(paths))
        if args.write or args.check:
            text = README.read_text()
            fresh = replace_block(text, block, str(README))
            if args.check:
                if fresh != text:
                    print(f"{README}: the figures table is not bench/report.py's output; run `python bench/report.py "
                          f"--write`", file=sys.stderr)
                    return 1
                return 0
            if fresh != text:
                _write_whole(README, fresh)
            print(f"{README}: figures table regenerated from {len(paths)} records")
            return 0
    except RecordError as exc:
        print(f"bench/report.py: {exc}", file=sys.stderr)
        return 2
    print(block, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
