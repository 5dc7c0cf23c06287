"""The FP8 NaN/inf check of a training step: every quantised operand's largest magnitude kept on the device, one flag read with the step's totals.

Casting to FP8 would hide a non-finite input (inf saturates to the format's max, a NaN poisons its
whole scale group), so every operand's amax is checked (fp8/scaling.py). Checking at once costs
one host synchronisation per operand; in training the gemms record into a `NonFiniteGuard`
instead (`deferred = True`, set by the training loop): `record(peak, where)` keeps the peak (a
0-d tensor, or one value per local expert for the grouped GEMMs, whose `where` then holds
`{expert}`) and nothing is read. After the step's forward and backward the loop reads `flag()`,
the float64 sum of every peak recorded, together with the step's loss totals (one read for both):
the peaks are non-negative and at most fp32's max, so the sum is finite exactly when every peak
was. `check(value)` then clears the record, or, when the flag is NaN or inf, finds the first
operand in the order they ran (a second read, only on that failure path) and raises the same
error the immediate check raises, naming layer, GEMM, operand and local expert. The run stops
before the optimizer step, as it did; what is lost is only the rest of that step's compute.
"""

from __future__ import annotations

import math

import torch

from gptoss_cli.fp8.scaling import nonfinite_error



class NonFiniteGuard:
    """Deferred NaN/inf checks of one rank's FP8 operands (shared by all its gemms)."""

    def __init__(self) -> None:
        self.deferred = False  # False: the gemms check every operand at once (one host read each)
        self._peaks: list[tuple[torch.Tensor, str]] = []

    def __len__(self) -> int:
        return len(self._peaks)

    def record(self, peak: torch.Tensor, where: str) -> None:
        """Keep an operand's largest magnitude (0-d, or [local experts] with `{expert}` in `where`)."""
        self._peaks.append((peak.detach(), where))

    def flag(self, device: torch.device) -> torch.Tensor:
        """float64 0-d on `device`: the sum of every recorded peak (NaN or inf iff one was); no host read."""
        if not self._peaks:
            return torch.zeros((), dtype=torch.float64, device=device)
        flat = torch.cat([p.reshape(-1).to(device=device, dtype=torch.float64) for p, _ in self._peaks])
        return flat.sum()

    def check(self, value: float, step: int | None = None) -> None:
        """After the flag was read as `value`: clear the record, or raise for the first non-finite
        operand (`step`, when given, is named in the error)."""
        peaks, self._peaks = self._peaks, []
        if math.isfinite(value):
            return
        at = f" at step {step}" if step is not None else ""
        when = f" (checked once after the forward and backward{at}, before the optimizer step)"
        for peak, where in peaks:
            values = peak.reshape(-1).tolist()
            for expert, v in enumerate(values):
                if not math.isfinite(v):
                    raise nonfinite_error(where.replace("{expert}", str(expert)), v, when)
        raise nonfinite_error("an FP8 operand of this step", value, when)  # not reached: amaxes cannot overflow the sum

    def clear(self) -> None:
        self._peaks.clear()


__all__ = ["NonFiniteGuard"]
