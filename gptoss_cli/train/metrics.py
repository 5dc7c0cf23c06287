"""A run's metrics.jsonl: rank 0 appends one JSON line per rank and step, gathered from every rank.

The step's global values (the objective's metrics, lr, grad norm, throughput, validation) go on
every rank's line, the global router telemetry on rank 0's only (train/telemetry.py), and each
rank's own loss, tokens and step time on its line. `gptoss report` reads the file back
(train/report.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from gptoss_cli import outputs
from gptoss_cli.parallel.state import ParallelState, all_gather
from gptoss_cli.train.report import METRICS  # the file's name lives with its torch-free reader


class MetricsWriter:
    """Rank 0 appends one JSON line per rank and step to metrics.jsonl (gathered from all ranks)."""

    FIELDS = ("rank_loss", "rank_tokens", "rank_step_time_s")

    def __init__(self, run_dir: Path, state: ParallelState):
        self.state = state
        self.path = run_dir / METRICS
        if state.rank == 0:
            run_dir.mkdir(parents=True, exist_ok=True)

    def write(self, step: int, common: dict[str, Any], local: list[float],
              rank0: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        """`common` goes on every rank's line, `local` (this rank's FIELDS) on its own, `rank0` (the
        global router telemetry) on rank 0's only. Returns the step's records on rank 0 (for the
        loggers), [] elsewhere."""
        row = torch.tensor(local, dtype=torch.float64, device=self.state.device)
        if self.state.distributed:
            rows = torch.empty(self.state.world_size * len(local), dtype=torch.float64, device=self.state.device)
            all_gather(rows, row, dist.group.WORLD)  # one row per rank of the world, in rank order
            rows = rows.view(self.state.world_size, len(local))
        else:
            rows = row[None]
        if self.state.rank != 0:
            return []
        records = []
        for r, values in enumerate(rows.tolist()):
            mine = dict(zip(self.FIELDS, values))
            mine["rank_tokens"] = int(mine["rank_tokens"])
            records.append({"step": step, "rank": r, **common, **mine, **((rank0 or {}) if r == 0 else {})})
        self.append(records)
        return records

    def append(self, records: list[dict[str, Any]]) -> None:
        """Rank 0: append `records` as lines (a full disk names the file)."""
        with outputs.naming(self.path), self.path.open("a") as fh:
            fh.write("".join(json.dumps(record) + "\n" for record in records))


__all__ = ["MetricsWriter", "METRICS"]
