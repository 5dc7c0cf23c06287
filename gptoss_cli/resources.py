"""What this process uses: its peak resident memory, as convert, parity-check and the benches report it."""

from __future__ import annotations

import resource
from pathlib import Path


def peak_rss_bytes() -> int:
    """Peak resident memory of this process: VmHWM where Linux has it, because ru_maxrss carries the
    launching process's peak across exec (a bench's own peak would show up as every child's)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


__all__ = ["peak_rss_bytes"]
