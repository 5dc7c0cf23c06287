"""`gptoss train`'s progress lines show the ETA (from the steps seen so far) and MFU when the step reports it."""

from __future__ import annotations

import gptoss_cli.cli.train as train_cli
from gptoss_cli.cli.train import TrainProgressBar

STEP = {"kind": "step", "loss": 2.0, "lr": 1e-4, "grad_norm": 1.0, "tokens_per_s": 100.0, "step_time_s": 0.5}


def test_progress_lines_show_eta_and_mfu(monkeypatch, capsys):
    clock = iter([100.0, 110.0, 130.0])  # steps 1, 2, 3 seen at these times: 15 s per step from step 1
    monkeypatch.setattr(train_cli.time, "monotonic", lambda: next(clock))
    monkeypatch.setenv("COLUMNS", "200")  # one line per step, unwrapped
    bar = TrainProgressBar()
    bar({"kind": "start", "start_step": 0, "train_iters": 243, "world_size": 1, "ep_size": 1,
         "resumed_from": None, "fp8": None})
    bar({**STEP, "step": 1})
    bar({**STEP, "step": 2, "mfu": 0.4215})
    bar({**STEP, "step": 3})
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step")]
    assert "ETA" not in lines[0] and "MFU" not in lines[0]
    assert lines[1].endswith("MFU 42.1% ETA 0:40:10")  # 241 steps left x 10 s
    assert lines[2].endswith("ETA 1:00:00")  # 240 steps left x 15 s; no mfu in this event
