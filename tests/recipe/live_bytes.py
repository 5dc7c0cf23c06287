"""Live tensor memory on any device, counted by the dispatcher: what a CPU test can measure of a peak."""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveBytes(TorchDispatchMode):
    """Inside the mode, every storage an op returns is counted until the last tensor on it dies
    (autograd's saved tensors keep theirs alive, so this sees what is held for backward).
    `current` and `peak` in bytes; storages that existed before the mode (parameters, caches) are not counted,
    nor are they when an op returns a view of them (its output aliases one of its inputs)."""

    def __init__(self) -> None:
        super().__init__()
        self.refs: dict[int, int] = {}
        self.size: dict[int, int] = {}
        self.current = 0
        self.peak = 0

    def _release(self, key: int) -> None:
        self.refs[key] -= 1
        if self.refs[key] == 0:
            del self.refs[key]
            self.current -= self.size.pop(key)

    def reset_peak(self) -> None:
        self.peak = self.current

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                  if isinstance(t, torch.Tensor) and t.device.type != "meta"}
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            key = t.untyped_storage().data_ptr()
            if key == 0 or (key in inputs and key not in self.refs):  # a view of (or write into) an untracked storage
                continue
            if key not in self.refs:
                self.refs[key] = 0
                self.size[key] = t.untyped_storage().nbytes()
                self.current += self.size[key]
                self.peak = max(self.peak, self.current)
            self.refs[key] += 1
            weakref.finalize(t, self._release, key)
        return out
