"""Count what would block the host on a GPU, on CPU, by call site: the test hook of the host-sync budget.

On a CPU every tensor is already on the host, so nothing ever waits; the calls that would wait on a
GPU are still the same calls. `HostSyncCounter` counts them while it is active:
- reading a tensor's values on the host: `.tolist()`, `.cpu()`, `.numpy()` (Tensor methods,
  patched because they never reach the dispatcher), and `.item()` / `int(t)` / `float(t)` /
  `bool(t)` / `if t:` (all of them `aten._local_scalar_dense`);
- ops whose output size depends on the values, which must read them back first: `nonzero`,
  `masked_select`, `unique`, boolean-mask indexing, `repeat_interleave` without `output_size`.
The aten ops are seen by a TorchDispatchMode, so autograd's backward is counted too.

Each count is attributed to the innermost frame inside gptoss_cli/ (file:line), so a failing test
names the site. `suspended()` stops counting for a stretch (a test's CPU stand-in for a CUDA kernel,
which reads its own arguments on the host, is not the code under test).

What it cannot see: waits inside a kernel's own host code below the dispatcher (a C++ kernel that
copies its offsets to the host, as torch's `_grouped_mm` does on GPUs without its fast path), waits
that are not a value read (`torch.cuda.synchronize()`, a pageable-memory copy, an allocator retry,
a collective's `wait()` in NCCL's blocking mode), and branches taken only on a GPU that the test
did not force onto the CPU. It counts calls, not their cost: a read right after another costs little.
"""

from __future__ import annotations

import collections
import contextlib
import traceback
from pathlib import Path
from typing import Any, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

PACKAGE = str(Path(__file__).resolve().parents[2] / "gptoss_cli")
# Tensor methods that read values to the host without going through the dispatcher.
_METHODS = ("tolist", "cpu", "numpy")
_DATA_DEPENDENT = {"nonzero", "masked_select", "_unique2", "unique_dim", "unique_consecutive", "_unique"}


def _site() -> str:
    for frame in reversed(traceback.extract_stack()[:-2]):
        if frame.filename.startswith(PACKAGE):
            return f"{Path(frame.filename).relative_to(Path(PACKAGE).parent)}:{frame.lineno} {frame.name}"
    return "outside gptoss_cli"


class _Mode(TorchDispatchMode):
    def __init__(self, counter: "HostSyncCounter"):
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name == "_local_scalar_dense" or name in _DATA_DEPENDENT:
            self.counter.hit(name)
        elif func is torch.ops.aten.repeat_interleave.Tensor and kwargs.get("output_size") is None:
            self.counter.hit("repeat_interleave without output_size")
        elif name == "index" and any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] or ())
                                     if i is not None):
            self.counter.hit("boolean-mask indexing")
        return func(*args, **kwargs)


class HostSyncCounter:
    """`with HostSyncCounter() as c: ...` then `c.sites` (Counter of 'file:line fn (what)') and `c.total`."""

    def __init__(self) -> None:
        self.sites: collections.Counter[str] = collections.Counter()
        self._saved: dict[str, Any] = {}
        self._mode = _Mode(self)
        self._suspended = 0

    @property
    def total(self) -> int:
        return sum(self.sites.values())

    def hit(self, what: str) -> None:
        if not self._suspended:
            self.sites[f"{_site()} ({what})"] += 1

    @contextlib.contextmanager
    def suspended(self) -> Iterator[None]:
        """Nothing inside is counted."""
        self._suspended += 1
        try:
            yield
        finally:
            self._suspended -= 1

    def in_files(self, *names: str) -> int:
        """Counts at sites in files whose path ends with one of `names` (e.g. 'model/dispatcher.py')."""
        return sum(n for site, n in self.sites.items() if site.split(":")[0].endswith(names))

    def __enter__(self) -> "HostSyncCounter":
        for name in _METHODS:
            self._saved[name] = torch.Tensor.__dict__.get(name)
            original = getattr(torch.Tensor, name)

            def counted(t, *a, _original=original, _name=name, **kw):
                self.hit(_name)
                return _original(t, *a, **kw)

            setattr(torch.Tensor, name, counted)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._mode.__exit__(*exc)
        for name, saved in self._saved.items():
            if saved is None:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, saved)
