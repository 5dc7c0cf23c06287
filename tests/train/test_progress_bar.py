"""`gptoss train`'s progress lines show the ETA (from the steps seen so far) and MFU when the step reports it."""

from __future__ import annotations

from dataclasses import replace

import gptoss_cli.cli.train as train_cli
from gptoss_cli.cli.train import TrainProgressBar
from gptoss_cli.train.progress import StepDone, TrainStarted

# the step event as train/loop.py emits it: mfu is None where the GPU's peak is unknown (a CPU)
STEP = StepDone(step=0, loss=2.0, lr=1e-4, grad_norm=1.0, tokens_per_s=100.0, step_time_s=0.5, consumed_samples=0,
                model_flops_per_token=1e9, tflops_per_gpu=0.5, mfu=None, hardware_tflops_per_gpu=0.5)


def test_progress_lines_show_eta_and_mfu(monkeypatch, capsys):
    clock = iter([100.0, 110.0, 130.0])  # steps 1, 2, 3 seen at these times: 15 s per step from step 1
    monkeypatch.setattr(train_cli.time, "monotonic", lambda: next(clock))
    monkeypatch.setenv("COLUMNS", "200")  # one line per step, unwrapped
    bar = TrainProgressBar()
    bar(TrainStarted(start_step=0, train_iters=243, world_size=1, ep_size=1))
    bar(replace(STEP, step=1))
    bar(replace(STEP, step=2, mfu=0.4215))
    bar(replace(STEP, step=3))
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step")]
    assert "ETA" not in lines[0] and "MFU" not in lines[0]
    assert lines[1].endswith("MFU 42.1% ETA 0:40:10")  # 241 steps left x 10 s
    assert lines[2].endswith("ETA 1:00:00")  # 240 steps left x 15 s; no mfu in this event


def test_step_lines_show_the_objectives_metrics_as_it_declares_them(monkeypatch, capsys):
    """GRPO's declared metrics (rl/objective.py) in its words and formats, after the loss and the validation
    loss; the step's other metrics (entropy here) stay in metrics.jsonl."""
    from gptoss_cli.rl.objective import GRPOObjective

    monkeypatch.setenv("COLUMNS", "200")
    bar = TrainProgressBar()
    bar(TrainStarted(start_step=0, train_iters=3, world_size=1, ep_size=1, shown_metrics=GRPOObjective.shown_metrics))
    bar(replace(STEP, step=1, val_loss=1.5, objective_metrics={"mismatch_kl": 2.5e-7, "entropy": 3.0,
                                                               "reward_mean": 0.25}))
    bar(replace(STEP, step=2, objective_metrics={"reward_mean": 0.5}))
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step")]
    assert "step 1: loss 2.0000 val 1.5000 reward 0.250 mismatch 2.5e-07 lr 1.0e-04 " in lines[0]
    assert "step 2: loss 2.0000 reward 0.500 lr 1.0e-04 " in lines[1]
    assert "entropy" not in lines[0] + lines[1]


def test_the_loop_emits_typed_events_that_carry_the_metrics_line_and_pickle(tmp_path):
    """run_worker's events in order, each a plain dataclass that survives pickling (the callback runs in a
    spawned worker); a step event holds exactly the numbers of rank 0's metrics.jsonl line for that step,
    the objective's (here cross-entropy's aux_loss) in `objective_metrics`."""
    import json
    import pickle
    from dataclasses import asdict, fields

    from gptoss_cli.run.worker import run_worker
    from gptoss_cli.train.progress import CheckpointSaved, TrainFinished
    from tests.train.workers import tiny_plan

    events = []
    result = run_worker(tiny_plan(str(tmp_path / "run"), train_iters=2, checkpoint_dir=str(tmp_path / "ckpt")),
                        events.append)
    assert [type(e) for e in events] == [TrainStarted, StepDone, StepDone, CheckpointSaved, TrainFinished]
    assert all(pickle.loads(pickle.dumps(e)) == e for e in events)
    start, *steps, saved, end = events
    assert (start.start_step, start.train_iters, start.world_size, start.resumed_from) == (0, 2, 1, None)
    assert (saved.step, saved.path) == (2, result.checkpoint) and end.result == result
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    for event, line in zip(steps, lines, strict=True):
        expected = {f.name: line.get(f.name) for f in fields(StepDone)}
        expected["objective_metrics"] = {"aux_loss": line["aux_loss"]}  # tiny_plan's moe.aux_loss_coeff > 0
        assert asdict(event) == expected


def test_start_line_names_the_pipeline(monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", "200")
    TrainProgressBar()(TrainStarted(start_step=0, train_iters=3, world_size=4, ep_size=2, pp_size=2,
                                    pipeline_schedule="1f1b"))
    assert "training on world 4, EP 2, PP 2 (1f1b)" in capsys.readouterr().out
