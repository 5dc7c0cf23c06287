"""Shared rendering helpers for commands: the rich progress bar of a conversion, human-readable sizes."""

from __future__ import annotations

from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn


class ConvertProgressBar:
    """convert's progress callback (bytes and tensors) on a terminal; silent when output is not a terminal or
    with --quiet."""

    def __init__(self, console: Console, label: str, enabled: bool = True):
        self.enabled = enabled and console.is_terminal
        self.label = label
        self._progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            DownloadColumn(),
            TransferSpeedColumn(),
            TimeRemainingColumn(),
            console=console,
            transient=True,
        )
        self._task = None
        self._tensors = 0
        self._total_tensors = 0

    def __enter__(self) -> "ConvertProgressBar":
        if self.enabled:
            self._progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.enabled:
            self._progress.stop()

    def _description(self) -> str:
        return f"{self.label} {self._tensors}/{self._total_tensors} tensors"

    def start(self, total_tensors: int, total_bytes: int) -> None:
        self._total_tensors = total_tensors
        if self.enabled:
            self._task = self._progress.add_task(self._description(), total=total_bytes)

    def advance(self, tensors: int = 0, nbytes: int = 0) -> None:
        self._tensors += tensors
        if self._task is not None:
            self._progress.update(self._task, advance=nbytes, description=self._description())


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"
