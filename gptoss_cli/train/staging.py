"""The host copy an asynchronous checkpoint is written from (checkpoint.async_save's stager).

`dcp.async_save` first asks a stager for a copy of the state that later steps cannot change, then writes
that copy on its upload thread. DCP's own stager deep-copies whole storages and cannot copy a
ShardedTensor (the distributed optimizer's entries whose shard boundary cuts a parameter); this one
(`HostStager`, a DCP `AsyncStager`) copies what the checkpoint holds and nothing more:

- every tensor into a host buffer of its own shape and dtype (pinned on CUDA, for a faster copy out of the
  GPU), kept under its key from one save to the next and refilled in place, so only the first save
  allocates (and faults in) its pages;
- a ShardedTensor as a new ShardedTensor over copies of its local shards, under the same global metadata;
- the same elements seen under two keys (fp32 parameters are their own master weights:
  `model.X` and `optimizer.X.master` are one view) copied once and shared, as DCP writes them.

The copy is taken on the training thread, inside `dcp.async_save`: it is the stall a save still costs
(bench/async_save.py). The buffers may be refilled only once the upload that reads them has ended:
train/async_save.py keeps one save in flight and waits for it before staging the next.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.staging import AsyncStager

from gptoss_cli import torch_private


def _is_sharded(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and hasattr(value, "local_shards")


class HostStager(AsyncStager):
    """Stages a checkpoint's state into host buffers reused across saves (see the module docstring)."""

    def __init__(self, pin_memory: bool = False):
        self.pin_memory = pin_memory
        self.buffers: dict[str, torch.Tensor] = {}

    @torch.no_grad()
    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        memo: dict[tuple, torch.Tensor] = {}
        return {k: self._copy(f"{k}", v, memo) for k, v in state_dict.items()}

    def _copy(self, key: str, value: Any, memo: dict[tuple, torch.Tensor]) -> Any:
        if _is_sharded(value):
            st = torch_private.sharded_tensor_api()
            shards = [st.Shard(self._tensor(f"{key}#{i}", s.tensor, memo), s.metadata)
                      for i, s in enumerate(value.local_shards())]
            return st.from_local_shards(shards, value.metadata())
        if isinstance(value, torch.Tensor):
            return self._tensor(key, value, memo)
        if isinstance(value, dict):
            return {k: self._copy(f"{key}.{k}", v, memo) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(self._copy(f"{key}[{i}]", v, memo) for i, v in enumerate(value))
        return value  # numbers and strings: immutable

    def _tensor(self, key: str, t: torch.Tensor, memo: dict[tuple, torch.Tensor]) -> torch.Tensor:
        ident = (t.device, t.data_ptr(), tuple(t.shape), t.stride(), t.dtype)
        if ident in memo:
            return memo[ident]
        buf = self.buffers.get(key)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            buf = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=self.pin_memory)
            self.buffers[key] = buf
        buf.copy_(t)
        memo[ident] = buf
        return buf

    @property
    def should_synchronize_after_execute(self) -> bool:
        return False  # the copy is complete when `stage` returns

    @property
    def nbytes(self) -> int:
        """Bytes of the host buffers held."""
        return sum(b.numel() * b.element_size() for b in self.buffers.values())

    def close(self) -> None:
        self.buffers.clear()


__all__ = ["HostStager"]
