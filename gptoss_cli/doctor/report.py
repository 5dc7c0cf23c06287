"""`run_doctor`: the machine's facts, what each shipped recipe would get here, and the device checks, as one report."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gptoss_cli.doctor.checks import FAIL, Check, run_checks
from gptoss_cli.doctor.machine import MachineFacts, machine_facts, resolve_device
from gptoss_cli.doctor.recipes import RecipeVerdict, recipe_verdicts


@dataclass
class DoctorReport:
    machine: MachineFacts
    recipes: list[RecipeVerdict] = field(default_factory=list)
    checks: list[Check] = field(default_factory=list)

    @property
    def failed(self) -> list[Check]:
        return [c for c in self.checks if c.status == FAIL]

    @property
    def ok(self) -> bool:
        """No check failed (a recipe this machine would refuse is information, not a failure)."""
        return not self.failed

    def to_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "machine": self.machine.to_dict(), "recipes": [r.to_dict() for r in self.recipes],
                "checks": [c.to_dict() for c in self.checks]}


def run_doctor(device: str = "auto", *, recipes: bool = True, checks: bool = True,
               only: tuple[str, ...] = ()) -> DoctorReport:
    """The report for `device` ("auto": the GPU where torch sees one, else the CPU); `only` limits the
    checks to those whose names start with one of its entries (e.g. "attention", "fp8 mxfp8")."""
    dev = resolve_device(device)
    facts = machine_facts(dev)
    report = DoctorReport(machine=facts)
    if recipes:
        report.recipes = recipe_verdicts(dev, facts.generation)
    if checks:
        report.checks = run_checks(dev, only)
    return report


__all__ = ["DoctorReport", "run_doctor"]
