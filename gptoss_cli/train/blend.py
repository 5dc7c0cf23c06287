"""Dataset blends (`data.blend`): samples drawn from several token files in proportion to their weights.

Megatron's blended dataset (`build_blending_indices` of megatron-core's datasets/helpers.cpp):
sample i of the blend comes from the file whose count lags its share the most,
`argmax_k (w_k * max(i, 1) - c_k)` with w the normalised weights and c_k the samples file k gave so
far (ties to the first file), and it is that file's sample c_k. Each file hands out its
own samples (version 1: windows of S+1 tokens; version 2: packed rows of whole documents) in an
order shuffled with the seed, each once, until the file is exhausted; then the next epoch of that
file reshuffles (train/data.py, `_EpochOrder`). The mixture is exact up to one sample per file at
every prefix of the stream, whatever the layout: every rank computes the same assignment.

The stream's position (`position`, equal to the consumed samples) and every file's count are saved
in the checkpoint's train_state.json (`state_dict`) and restored on resume (`load_state_dict`), so
the blend carries on where it stopped without replaying it; a resume whose blend (files or weights)
differs from the checkpoint's is refused. When some files are version 2 and others version 1,
every sample is a packed row (a window is one document of S tokens).
"""

from __future__ import annotations

import collections
from pathlib import Path
from typing import Any, Sequence

import torch

from gptoss_cli.errors import ConfigError
from gptoss_cli.train.data import PackedRow, token_file_source


class BlendedSource:
    """The samples of a weighted blend of token-file sources (see the module docstring)."""

    def __init__(self, files: Sequence[tuple[str, float]], sources: Sequence[Any]):
        total = sum(w for _, w in files)
        self.files = [{"path": str(p), "weight": float(w)} for p, w in files]
        self.weights = [w / total for _, w in files]
        self.sources = list(sources)
        self.seq_length = self.sources[0].seq_length
        # packed rows as soon as one file is a version-2 file (a microbatch holds one kind of row)
        self.documents = any(getattr(s, "documents", False) for s in self.sources)
        # the expected share of real tokens in a row (a window is all real tokens)
        self.efficiency = sum(w * getattr(s, "efficiency", 1.0) for w, s in zip(self.weights, self.sources))
        self.num_samples = sum(s.num_samples for s in self.sources)  # one epoch of every file
        self.position = 0
        self.counts = [0] * len(self.sources)
        self._pending: collections.deque[tuple[int, int, int]] = collections.deque()  # (index, file, its sample)

    def _advance_to(self, index: int) -> None:
        """Assign stream positions up to `index` (inclusive)."""
        while self.position <= index:
            i = self.position
            at = float(max(i, 1))
            k = max(range(len(self.weights)), key=lambda j: (self.weights[j] * at - self.counts[j], -j))
            self._pending.append((i, k, self.counts[k]))
            self.counts[k] += 1
            self.position += 1

    def assignment(self, index: int) -> tuple[int, int]:
        """(file, that file's sample number) of blend sample `index`; indices are asked in increasing order
        (each rank asks for its slice of every step)."""
        self._advance_to(index)
        while self._pending and self._pending[0][0] < index:
            self._pending.popleft()  # other ranks' samples
        if not self._pending or self._pending[0][0] != index:
            raise ConfigError(f"data.blend: sample {index} was asked for after later ones (the blend reads forward)")
        _, k, n = self._pending.popleft()
        return k, n

    def sample(self, index: int) -> Any:
        k, n = self.assignment(index)
        item = self.sources[k].sample(n)
        if self.documents and isinstance(item, torch.Tensor):
            return PackedRow(item[:-1].clone(), item[1:].clone(), [len(item) - 1])
        if isinstance(item, PackedRow):  # a trained-token index of one file of several identifies nothing
            item.token_index = None
        return item

    def state_dict(self, consumed_samples: int) -> dict[str, Any]:
        """What a checkpoint records: the files and weights, and every file's count at `consumed_samples`."""
        if consumed_samples > self.position:
            self._advance_to(consumed_samples - 1)
        counts = list(self.counts)
        for i, k, _ in self._pending:  # assigned past the saved position: not consumed yet
            if i >= consumed_samples:
                counts[k] -= 1
        return {"files": self.files, "position": consumed_samples, "counts": counts}

    def load_state_dict(self, state: dict[str, Any] | None, consumed_samples: int, where: Path) -> None:
        """Continue from a checkpoint's blend state; without one (a checkpoint from before the blend
        was recorded) the stream is replayed up to `consumed_samples`."""
        self._pending.clear()
        self.position, self.counts = 0, [0] * len(self.sources)
        if state is None:
            if consumed_samples:
                self._advance_to(consumed_samples - 1)
                self._pending.clear()
            return
        check_same_blend(state.get("files"), self.files, where)
        counts = state.get("counts")
        if (not isinstance(counts, list) or len(counts) != len(self.sources)
                or state.get("position") != consumed_samples or sum(counts) != consumed_samples):
            raise ConfigError(f"{where}: the recorded blend state {state!r} does not match consumed_samples="
                              f"{consumed_samples}", hint="resume from another checkpoint, or start a new checkpoint.dir")
        self.position, self.counts = consumed_samples, [int(c) for c in counts]


def blended_source(files: Sequence[tuple[str, float]], seq_length: int, seed: int,
                   vocab_size: int | None = None) -> BlendedSource:
    """The blend of `files` ((token file prefix, weight) pairs) at `seq_length`."""
    return BlendedSource(files, [token_file_source(p, seq_length, seed, vocab_size) for p, _ in files])


def check_same_blend(saved: Any, files: list[dict[str, Any]], where: Path) -> None:
    """A resume continues the checkpoint's blend: the same files with the same weights, in order."""
    if saved is None or saved == files:
        return
    raise ConfigError(f"{where}: the checkpoint trained on the blend {_describe(saved)}, this recipe's data.blend is "
                      f"{_describe(files)}", hint="resume with the checkpoint's data.blend, or start a new checkpoint.dir")


def _describe(files: Any) -> str:
    if not isinstance(files, list):
        return repr(files)
    return "[" + ", ".join(f"{f.get('path')} x {f.get('weight')}" if isinstance(f, dict) else repr(f)
                           for f in files) + "]"


__all__ = ["BlendedSource", "blended_source", "check_same_blend"]
