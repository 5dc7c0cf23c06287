"""`gptoss report` on a real tiny run that was killed half-way (SIGKILL, torn last line), and on bad run folders."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from gptoss_cli.cli import app

plt = pytest.importorskip("matplotlib.pyplot")

TRAIN_ITERS = 400  # far more than the test waits for: the run is killed half-way


def _rank0_steps(metrics: Path) -> int:
    try:
        return sum(1 for line in metrics.read_text().splitlines() if '"rank": 0' in line)
    except FileNotFoundError:
        return 0


@pytest.fixture(scope="module")
def killed_run(tmp_path_factory) -> Path:
    """One-process tiny run with aux loss, SIGKILLed after 4 steps; then the torn line such a kill
    leaves when it lands inside a write (a record without its end and newline)."""
    root = tmp_path_factory.mktemp("killed")
    run_dir = root / "run"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "gptoss_cli", "train", "--recipe", "tiny_cpu_ep2", "--quiet",
         "parallelism.world_size=1", "parallelism.expert_model_parallel_size=1", "precision.params_dtype=fp32",
         f"training.train_iters={TRAIN_ITERS}", "training.seq_length=16", "training.global_batch_size=2",
         "training.micro_batch_size=1", "checkpoint.dir=null", "checkpoint.save_interval=null",
         "moe.aux_loss_coeff=0.01", f"logging.run_dir={run_dir}"],
        cwd=root, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while _rank0_steps(run_dir / "metrics.jsonl") < 4:
            assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
            assert time.monotonic() < deadline, "the run did not reach step 4"
            time.sleep(0.05)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    metrics = run_dir / "metrics.jsonl"
    assert metrics.read_text().endswith("\n")
    with metrics.open("a") as fh:
        fh.write('{"step": 999, "rank": 0, "loss": 7.1, "lr"')
    return run_dir


def _not_blank(png: Path) -> None:
    """Read back by matplotlib's PNG reader: a real image with drawn content, not a flat colour."""
    image = plt.imread(str(png))
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100, image.shape
    rgb = image[..., :3]
    assert rgb.std() > 0.05, png  # a blank (single-colour) image has none
    assert (rgb.min(axis=-1) < 0.5).mean() > 0.005, png  # lines, text, heatmap cells: dark pixels


def test_report_on_a_killed_run_summarises_it_and_draws_every_plot(killed_run, tmp_path):
    out = tmp_path / "plots"
    result = CliRunner().invoke(app, ["report", str(killed_run), "--out", str(out), "--json", str(tmp_path / "s.json")])
    assert result.exit_code == 0, result.output
    note = [line for line in result.output.splitlines() if line.startswith("note:")]
    assert len(note) == 1 and "metrics.jsonl:" in note[0] and "cut off" in note[0]
    rows = [json.loads(line) for line in (killed_run / "metrics.jsonl").read_text().splitlines()[:-1]]
    last = max(r["step"] for r in rows)
    assert 4 <= last < TRAIN_ITERS
    assert f"step {last} of {TRAIN_ITERS} (stopped before the end)" in result.output
    summary = json.loads((tmp_path / "s.json").read_text())
    assert summary["last_step"] == last and summary["finished"] is False
    final = next(r for r in rows if r["step"] == last)
    assert summary["curves"]["loss"]["last"] == final["loss"]
    layer = next(iter(final["expert_load"]))
    load = final["expert_load"][layer]
    assert summary["router"]["layers"][layer]["most_loaded"] == {"expert": load.index(max(load)),
                                                                 "share": max(load) / sum(load)}
    names = {Path(p).name for p in summary["plots"]}
    # tflops_per_gpu is in every CPU record; mfu is null there (no known peak), so it has no plot
    assert names == {"loss.png", "lr.png", "grad_norm.png", "tokens_per_s.png", "tflops_per_gpu.png", "aux_loss.png",
                     "expert_load.png"}
    for png in out.glob("*.png"):
        _not_blank(png)
    assert not [p for p in out.iterdir() if p.name.startswith(".")]  # no temporary names left


def _write(run: Path, text: str) -> Path:
    run.mkdir(parents=True, exist_ok=True)
    (run / "metrics.jsonl").write_text(text)
    return run


GOOD = '{"step": 1, "rank": 0, "loss": 7.0, "lr": 0.0}\n{"step": 2, "rank": 0, "loss": 6.5, "lr": 1e-4}\n'


BAD_FIELDS = {  # a record whose fields the summary reads have the wrong shape
    "empty expert_load layer": '"expert_load": {"1": []}',
    "list in expert_load": '"expert_load": {"1": [1, [2]]}',
    "expert_load a list": '"expert_load": [4, 4]',
    "list for a number": '"loss": [6.0]',
    "list for a layer's entropy": '"expert_load": {"1": [1, 3]}, "router_entropy": {"1": [0.5]}',
}


BAD_OBJECTIVE_FILES = {  # objective.json (the objective's shown metrics) that is not such a record
    "objective.json not JSON": ("{oops", "objective.json: not a record with a 'shown_metrics' list"),
    "shown metric named a path": ('{"shown_metrics": [{"name": "../loss", "label": "x"}]}',
                                  "objective.json: shown_metrics[0] is {'name': '../loss'"),
    "shown metric not a number": ('{"shown_metrics": [{"name": "ratio", "label": "ratio"}]}',
                                  "metrics.jsonl:3: field 'ratio' is [1.0], not a number"),
}


@pytest.mark.parametrize("case,expect", [
    ("no folder", "not a run folder"),
    ("no metrics", "no metrics.jsonl"),
    ("empty", "no step records"),
    ("corrupt middle line", "metrics.jsonl:2: not a JSON record"),
    ("corrupt last line with newline", "metrics.jsonl:3: not a JSON record"),
    ("no step field", "metrics.jsonl:1: a record needs integer 'step' and 'rank'"),
    ("empty expert_load layer", "metrics.jsonl:3: field 'expert_load' layer 1: [] is not a non-empty list"),
    ("list in expert_load", "metrics.jsonl:3: field 'expert_load' layer 1: [2] is not a token count"),
    ("expert_load a list", "metrics.jsonl:3: field 'expert_load' is [4, 4], not an object"),
    ("list for a number", "metrics.jsonl:3: field 'loss' is [6.0], not a number"),
    ("list for a layer's entropy", "metrics.jsonl:3: field 'router_entropy' layer 1: [0.5] is not a number"),
    *[(case, expect) for case, (_, expect) in BAD_OBJECTIVE_FILES.items()],
])
def test_bad_run_folder_is_one_line_exit_2(tmp_path, case, expect):
    run = tmp_path / "run"
    if case == "no metrics":
        run.mkdir()
    elif case == "empty":
        _write(run, "")
    elif case == "corrupt middle line":
        _write(run, GOOD.replace("\n", "\n{oops\n", 1))
    elif case == "corrupt last line with newline":  # complete lines are never torn by a kill
        _write(run, GOOD + '{"step": 3, "rank": 0, "loss"\n')
    elif case == "no step field":
        _write(run, '{"rank": 0, "loss": 1.0}\n')
    elif case in BAD_FIELDS:
        _write(run, GOOD + '{"step": 3, "rank": 0, %s}\n' % BAD_FIELDS[case])
    elif case in BAD_OBJECTIVE_FILES:
        _write(run, GOOD + '{"step": 3, "rank": 0, "ratio": [1.0]}\n')
        (run / "objective.json").write_text(BAD_OBJECTIVE_FILES[case][0])
    result = CliRunner().invoke(app, ["report", str(run), "--no-plots"])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and expect in lines[0], result.output


def test_a_resumed_run_keeps_the_later_record_of_a_step(tmp_path):
    run = _write(tmp_path / "run", GOOD + '{"step": 2, "rank": 0, "loss": 6.0, "lr": 1e-4}\n')
    result = CliRunner().invoke(app, ["report", str(run), "--no-plots", "--json", str(tmp_path / "s.json")])
    assert result.exit_code == 0, result.output
    summary = json.loads((tmp_path / "s.json").read_text())
    assert summary["steps_recorded"] == 2 and summary["curves"]["loss"]["last"] == 6.0


def test_the_objective_curves_are_those_objective_json_names_and_grpos_in_a_folder_written_before_it(tmp_path):
    """The run folder's objective.json names the objective's curves (report knows none by name); a folder
    without one was written before it existed, when report drew a GRPO run's reward_mean and mismatch_kl."""
    lines = GOOD.replace('"lr": 0.0}', '"lr": 0.0, "reward_mean": 0.5, "mismatch_kl": 1e-7, "entropy": 2.0}')
    run = _write(tmp_path / "run", lines)
    assert "reward_mean" in lines
    before = CliRunner().invoke(app, ["report", str(run), "--no-plots", "--json", str(tmp_path / "before.json")])
    (run / "objective.json").write_text('{"objective": "own", "shown_metrics": [{"name": "entropy", "label": "H"}]}')
    after = CliRunner().invoke(app, ["report", str(run), "--no-plots", "--json", str(tmp_path / "after.json")])
    assert before.exit_code == after.exit_code == 0, before.output + after.output
    curves = [set(json.loads((tmp_path / f"{name}.json").read_text())["curves"]) for name in ("before", "after")]
    assert curves == [{"loss", "lr", "reward_mean", "mismatch_kl"}, {"loss", "lr", "entropy"}]


def test_json_summary_is_strict_json_when_the_run_recorded_nan_and_infinity(tmp_path):
    """A diverged run writes NaN and Infinity (Python's json does); the summary's JSON holds null there,
    which strict readers accept."""
    run = _write(tmp_path / "run", GOOD + '{"step": 3, "rank": 0, "loss": NaN, "grad_norm": Infinity}\n')
    result = CliRunner().invoke(app, ["report", str(run), "--no-plots", "--json", str(tmp_path / "s.json")])
    assert result.exit_code == 0, result.output

    def refuse(constant):
        raise ValueError(f"not strict JSON: {constant}")

    summary = json.loads((tmp_path / "s.json").read_text(), parse_constant=refuse)
    assert summary["curves"]["loss"]["last"] is None and summary["curves"]["grad_norm"]["max"] is None
    assert summary["curves"]["loss"]["first"] == 7.0


def test_missing_matplotlib_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    result = CliRunner().invoke(app, ["report", str(_write(tmp_path / "run", GOOD))])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and "pip install 'gptoss-cli[plot]'" in lines[0]


def test_line_plots_keep_the_step_axis_label_inside_the_image():
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from gptoss_cli.train.report import curve_figure

    fig = curve_figure([1, 2, 3], [3.0, 2.0, 1.0], "validation loss", plt)
    fig.canvas.draw()
    renderer, image = fig.canvas.get_renderer(), fig.bbox
    for label in (fig.axes[0].xaxis.label, fig.axes[0].yaxis.label):
        box = label.get_window_extent(renderer)
        assert box.x0 >= image.x0 and box.y0 >= image.y0 and box.x1 <= image.x1 and box.y1 <= image.y1, box
    plt.close(fig)


def test_a_grpo_run_gets_reward_and_mismatch_plots(tmp_path):
    """A real 1-step GRPO run (tests/rl/helpers.py, 4 completions of 4 tokens): its reward_mean and mismatch_kl are plotted and summarised."""
    from gptoss_cli.run.worker import run_worker
    from tests.rl.helpers import grpo_job

    job = grpo_job(tmp_path, train_iters=1, group_size=4, global_batch_size=4, micro_batch_size=4,
                   max_new_tokens=4)
    run_worker(job)
    out = tmp_path / "plots"
    result = CliRunner().invoke(app, ["report", str(job.run_dir), "--out", str(out), "--json", str(tmp_path / "s.json")])
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in (Path(job.run_dir) / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((tmp_path / "s.json").read_text())
    for key in ("reward_mean", "mismatch_kl", "mismatch_logp_abs"):
        assert summary["curves"][key]["last"] == rows[-1][key]
        _not_blank(out / f"{key}.png")


def test_a_trend_is_given_only_where_the_start_stands_out_of_the_series_noise():
    from gptoss_cli.train.report import trend

    assert trend([4.5, 4.2, 3.9, 3.6, 3.0]) == pytest.approx((3.0 - 4.5) / 4.5)  # a falling loss
    assert trend([0.5, 0.6, 0.8, 0.9, 1.0]) == pytest.approx(1.0)  # a rising reward
    assert trend([2e-2] * 5) == 0.0  # a constant learning rate: flat, not noise
    # a GRPO loss about 0 and a mismatch KL flipping sign: no percentage of roundings
    assert trend([1.2e-8, -3e-7, 2.5e-7, -1e-7, -4e-8]) is None
    assert trend([4.6e-9, 8.0e-9, -4.4e-11, 2.1e-10, 0.0]) is None
