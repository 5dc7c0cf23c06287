"""bench/ as one suite: every script answers --help and runs through bench/harness.py, the harness
pairs ratios round by round and rotates the order, its records round-trip through bench/report.py,
and bench/README.md's figures table is the report of the committed records. No timing is asserted."""

from __future__ import annotations

import importlib
import json
import statistics
import sys
from pathlib import Path

import pytest

from bench import harness, report

ROOT = Path(__file__).resolve().parent.parent
SHARED = {"harness", "peers", "report", "trl_peer"}  # bench/'s modules that are not benchmarks
BENCHES = sorted(p.stem for p in (ROOT / "bench").glob("*.py") if p.stem not in SHARED)
TOOLS = sorted(p.stem for p in (ROOT / "tools").glob("*.py"))


def _help(module, script: Path, monkeypatch, capsys) -> str:
    monkeypatch.setattr(sys, "argv", [str(script), "--help"])
    with pytest.raises(SystemExit) as exc:
        module.main()
    assert exc.value.code in (0, None), f"{script} --help exited {exc.value.code}"
    return capsys.readouterr().out


@pytest.mark.parametrize("name", BENCHES)
def test_every_bench_answers_help_and_records_through_the_harness(name, monkeypatch, capsys):
    module = importlib.import_module(f"bench.{name}")
    out = _help(module, ROOT / "bench" / f"{name}.py", monkeypatch, capsys)
    assert "--json PATH" in out, f"bench/{name}.py has no --json record"
    assert getattr(module, "harness", None) is harness, f"bench/{name}.py does not run through bench/harness.py"


@pytest.mark.parametrize("name", TOOLS)
def test_every_tool_answers_help(name, monkeypatch, capsys):
    module = importlib.import_module(f"tools.{name}")
    assert _help(module, ROOT / "tools" / f"{name}.py", monkeypatch, capsys)


def test_a_ratio_pairs_the_two_sides_of_each_round():
    run = harness.Run("probe", {})
    run.add("case", "a", "time_s", [1.0, 4.0, 2.0])
    run.add("case", "b", "time_s", [1.0, 4.0, 1.0])
    r = run.ratio("case", "a", "b")
    # per round 1, 1, 2: median 1 (the ratio of the medians, 2 / 1, would mix rounds)
    assert r["values"] == [1.0, 1.0, 2.0] and (r["median"], r["min"], r["max"]) == (1.0, 1.0, 2.0)
    assert run.cases["case"]["settings"]["a"]["time_s"]["median"] == statistics.median([1.0, 4.0, 2.0])


def test_rounds_rotate_the_order_and_record_the_kernel_counters():
    calls = []
    sides = {name: (lambda name=name: calls.append(name)) for name in "abc"}
    rounds = harness.interleave(sides, 2, steps=2, warmup=1, clock="wall")
    assert calls == list("abc") + list("abc") + list("bca") + list("cab") + list("abc")
    for name in "abc":
        assert set(rounds[name]) == {"time_s", "user_s", "system_s", "minor_faults"}
        assert all(len(v) == 2 for v in rounds[name].values())  # one value per round: the median of its steps


def test_a_side_that_times_itself_overrides_the_harness_clock():
    rounds = harness.interleave({"own": lambda: {"time_s": 7.0, "tokens": 3}}, 1, warmup=0, clock="cpu")
    assert rounds["own"]["time_s"] == [7.0] and rounds["own"]["tokens"] == [3.0]


def test_a_record_round_trips_through_the_report(tmp_path):
    with harness.Run("probe", {"rounds": 3, "json": tmp_path / "x"}, clock="cpu") as run:
        run.add("tiny", "ours", "time_s", [0.5, 1.0, 2.0])
        run.add("tiny", "peer", "time_s", [1.5, 1.0, 8.0])
        run.ratio("tiny", "peer", "ours", name="ours / peer speed")
        run.add("tiny", "ours", "minor_faults", [10, 20, 30])
        run.extra["note"] = "kept as is"
    path = tmp_path / "probe.json"
    record = run.finish(path, quiet=True)
    assert json.loads(path.read_text()) == json.loads(json.dumps(record))
    assert record["options"] == {"rounds": 3}  # --json itself is not an option of the run
    (_, loaded), = report.load_records([path])
    assert loaded["extra"] == {"note": "kept as is"} and loaded["machine"]["cpu"]
    table = report.table([(path, loaded)])
    row = next(line for line in table.splitlines() if "ours / peer speed" in line)
    assert "| 3.00x [1.00x, 4.00x] |" in row and "peer 1.5 s; ours 1 s" in row


@pytest.mark.parametrize("field, value, says", [
    ("schema", "other/2", "'schema'"),
    ("cases", {"c": {"settings": {"a": {"time_s": {"min": 1}}}}}, "cases['c'].settings['a']['time_s']"),
    ("cases", {"c": {"settings": {}, "ratios": {"r": {"median": 1.0, "num": "a"}}}}, "ratios['r'].den"),
    ("machine", {}, "machine.cpu"),
])
def test_a_bad_record_is_one_line_naming_the_file_and_field(tmp_path, capsys, field, value, says):
    record = harness.Run("probe", {}).record()
    record[field] = value
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(record))
    assert report.main([str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and str(bad) in err and says in err, err


def test_every_committed_record_follows_the_schema_and_the_readme_table_is_their_report():
    paths = sorted(report.RESULTS.glob("*.json"))
    assert paths, "bench/results/ holds no records"
    records = report.load_records(paths)
    assert report.generated_block(report.README.read_text()) == report.table(records), \
        "bench/README.md's figures table is stale: run `python bench/report.py --write`"


def test_run_with_peak_reports_the_child_s_own_peak_whatever_the_parent_held(tmp_path):
    """A child that touches 64 MiB reports about that (its own VmHWM), not this process's high-water mark,
    which wait4's ru_maxrss carries into every child started by vfork; the three command forms run as
    `python` runs them (exit codes and argv included)."""
    import os

    held = bytearray(256 << 20)  # this process's high-water mark at least 256 MiB
    held[::4096] = b"\1" * len(held[::4096])
    touch = "import sys; x = bytearray(int(sys.argv[1]) << 20); sys.exit(int(sys.argv[2]))"
    code, _, peak = harness.run_with_peak([sys.executable, "-c", touch, "64", "3"], tmp_path / "p")
    assert code == 3
    assert 64 << 20 <= peak < 160 << 20, peak  # Python's own ~10-30 MiB on top
    del held
    script = tmp_path / "s.py"
    script.write_text("import sys, helper; sys.exit(helper.CODE + len(sys.argv))\n")
    (tmp_path / "helper.py").write_text("CODE = 10\n")
    assert harness.run_with_peak([sys.executable, str(script), "a"], tmp_path / "p")[0] == 12
    code, _, peak = harness.run_with_peak([sys.executable, "-m", "json.tool", os.devnull], tmp_path / "p",
                                          stdout=harness.subprocess.DEVNULL, stderr=harness.subprocess.DEVNULL)
    assert code == 1 and 0 < peak < 160 << 20  # json.tool on an empty file: "Expecting value", exit 1
