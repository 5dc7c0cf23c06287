"""One training step's loss terms and router telemetry: summed on the device, reduced in one collective, read once.

Every microbatch's log (the training objective's `loss_func`, train/objective.py) carries device
tensors: the sums the objective names (for cross-entropy: the summed token cross-entropy, the
tokens, the aux and z-loss weighted by the microbatch's tokens), and the model's router table
(model/router_stats.py, `router_table`: per MoE layer the tokens routed to each
expert, the summed router entropy and the tokens routed). `StepTotals` adds them up on the
device into one float64 vector, the loop all-reduces it over the data-parallel world (one small
collective) and reads it back with one host sync; `router_record` turns the router part into the
`metrics.jsonl` fields (docs/router-telemetry.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from gptoss_cli.model.router_stats import ENTROPY_COL, TOKENS_COL

@dataclass
class StepTotals:
    """The layout of one step's vector: the `scalars` (the objective's `sums`, in order; a log
    without one adds 0), then `layers` x (experts + 2) router values."""

    layers: list[int]  # the physical decoder-layer number of each MoE layer, in order
    num_experts: int
    scalars_names: tuple[str, ...] = field(default=("loss_sum", "num_tokens"))

    @property
    def width(self) -> int:
        return len(self.scalars_names) + len(self.layers) * (self.num_experts + 2)

    def vector(self, logs: list[dict[str, Any]], device: torch.device) -> torch.Tensor:
        """float64 [width]: the step's microbatch logs summed on the device (no host sync)."""
        out = torch.zeros(self.width, dtype=torch.float64, device=device)
        head = len(self.scalars_names)
        for log in logs:
            for i, name in enumerate(self.scalars_names):
                if name in log:
                    out[i] += log[name].double()
            table = log.get("router_table")
            if table is not None and self.layers:
                out[head:] += table.reshape(-1)
        return out

    def scalars(self, values: list[float]) -> dict[str, float]:
        return dict(zip(self.scalars_names, values[:len(self.scalars_names)]))

    def router_record(self, values: list[float]) -> dict[str, Any]:
        """metrics.jsonl's router fields from the reduced vector (as a list): `expert_load`
        {layer: [tokens routed to each expert]}, `router_cv` {layer: std/mean of that load},
        `router_entropy` {layer: mean entropy in nats of the router's softmax over all experts}.
        Empty when the model has no MoE layer or no statistics were collected."""
        if not self.layers:
            return {}
        width = self.num_experts + 2
        head = len(self.scalars_names)
        rows = [values[head + i * width: head + (i + 1) * width] for i in range(len(self.layers))]
        if not any(row[TOKENS_COL] for row in rows):
            return {}
        load, cv, entropy = {}, {}, {}
        for layer, row in zip(self.layers, rows):
            counts = [int(round(c)) for c in row[:self.num_experts]]
            load[str(layer)] = counts
            cv[str(layer)] = coefficient_of_variation(counts)
            entropy[str(layer)] = row[ENTROPY_COL] / row[TOKENS_COL] if row[TOKENS_COL] else 0.0
        return {"expert_load": load, "router_cv": cv, "router_entropy": entropy}


def coefficient_of_variation(counts: list[int]) -> float:
    """Population standard deviation over mean of an expert load (0 = perfectly balanced,
    sqrt(E - 1) = every token on one expert)."""
    n = len(counts)
    mean = sum(counts) / n if n else 0.0
    if mean == 0:
        return 0.0
    return math.sqrt(sum((c - mean) ** 2 for c in counts) / n) / mean


__all__ = ["StepTotals", "coefficient_of_variation"]
