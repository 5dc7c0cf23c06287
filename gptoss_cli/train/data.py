"""Training data: a deterministic learnable mock source and memory-mapped token files, sharded by DP rank.

Token files are gptoss_cli/token_format.py's format (what `gptoss prepare-data` writes); epochs
reshuffle the sample order with the seed.

Sharding: the global batch of step s is samples [c, c + G) where c = consumed samples before the
step; DP rank r takes the contiguous slice [c + r*G/dp, c + (r+1)*G/dp) in microbatches of
`micro_batch_size`. The union over ranks is the same whatever the DP size, which is what makes a
DP=2 run equal a DP=1 run with gradient accumulation. The position (consumed samples) is saved in
the checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch

from gptoss_cli.errors import ConfigError
from gptoss_cli.token_format import check_token_files

# The format's dtype names as torch dtypes (gptoss_cli/token_format.py).
TOKEN_DTYPES = {"uint16": torch.uint16, "uint32": torch.uint32, "int32": torch.int32, "int64": torch.int64}


class MockSource:
    """Deterministic sequences that a model can learn, so the loss visibly falls.

    Sample i starts at a seeded random token of a small sub-vocabulary and then follows a fixed
    successor map (next = (3 * cur + 1) mod M): after learning that bigram table the next token is
    fully predictable. Identical for every process and every layout.
    """

    def __init__(self, vocab_size: int, seq_length: int, seed: int):
        self.modulus = max(2, min(vocab_size, 128))
        self.seq_length = seq_length
        self.seed = seed
        self.num_samples = 1 << 62  # unbounded
        # x_t = a_t * x_0 + b_t (mod M) with a_{t+1} = 3 a_t, b_{t+1} = 3 b_t + 1: a sample is one
        # vectorised expression instead of a Python loop over the sequence.
        a, b = torch.empty(seq_length + 1, dtype=torch.long), torch.empty(seq_length + 1, dtype=torch.long)
        a[0], b[0] = 1, 0
        for t in range(seq_length):
            a[t + 1] = (3 * a[t]) % self.modulus
            b[t + 1] = (3 * b[t] + 1) % self.modulus
        self._a, self._b = a, b

    def sample(self, index: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        start = int(torch.randint(0, self.modulus, (1,), generator=g))
        return (self._a * start + self._b) % self.modulus


class TokenFileSource:
    """Windows of S+1 tokens from a memory-mapped token file (see the module docstring)."""

    def __init__(self, path: str | Path, seq_length: int, seed: int, vocab_size: int | None = None):
        bin_path, _, header, num_tokens = check_token_files(path, vocab_size)
        dtype = TOKEN_DTYPES[header["dtype"]]
        # Memory-mapped, copy-on-write (shared=False): pages are read on demand, the file is never written.
        # The file is little-endian; every platform torch supports for training is too.
        self.tokens = torch.from_file(str(bin_path), shared=False, size=num_tokens, dtype=dtype)
        self.seq_length = seq_length
        self.seed = seed
        self.num_samples = (len(self.tokens) - 1) // seq_length
        if self.num_samples < 1:
            raise ConfigError(
                f"{bin_path}: {len(self.tokens)} tokens are fewer than one sample of seq_length+1={seq_length + 1}",
                hint="use more text or a smaller training.seq_length",
            )
        self.bin_path, self.vocab_size = bin_path, vocab_size
        self._perm_epoch = -1
        self._perm: torch.Tensor | None = None

    def sample(self, index: int) -> torch.Tensor:
        epoch, i = divmod(index, self.num_samples)
        if epoch != self._perm_epoch:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perm = torch.randperm(self.num_samples, generator=g)
            self._perm_epoch = epoch
        j = int(self._perm[i])
        window = self.tokens[j * self.seq_length : j * self.seq_length + self.seq_length + 1].to(torch.int64)
        # The header can lie (a foreign or hand-edited file): an id past the embedding would otherwise
        # surface as "IndexError: index out of range in self" deep inside the model.
        # int32 / int64 files can also hold negative ids, which index the embedding from its end or crash.
        high = self.vocab_size
        if int(window.min()) < 0 or (high is not None and int(window.max()) >= high):
            outside = (window < 0) | (window >= high) if high is not None else window < 0
            k = int(outside.nonzero()[0])
            raise ConfigError(
                f"{self.bin_path}: token id {int(window[k])} at token {j * self.seq_length + k} is outside the "
                f"model's vocabulary ({self.vocab_size})",
                hint="tokenize with the model's own tokenizer (gptoss prepare-data)",
            )
        return window


@dataclass
class Microbatch:
    tokens: torch.Tensor  # [mbs, S] inputs
    labels: torch.Tensor  # [mbs, S] next tokens


class DataLoaderState:
    """This rank's microbatches of each global batch; `consumed_samples` is the resumable position."""

    def __init__(self, source: Any, *, global_batch_size: int, micro_batch_size: int, dp_rank: int, dp_size: int,
                 consumed_samples: int = 0, device: torch.device | None = None):
        if global_batch_size % (micro_batch_size * dp_size):
            raise ConfigError(
                f"training.global_batch_size={global_batch_size} is not a multiple of micro_batch_size x "
                f"data-parallel size = {micro_batch_size} x {dp_size}",
                hint="make global_batch_size a multiple of micro_batch_size x world size",
            )
        self.source = source
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.num_microbatches = global_batch_size // (micro_batch_size * dp_size)
        self.consumed_samples = consumed_samples
        self.device = device or torch.device("cpu")

    def step_iterator(self) -> Iterator[Microbatch]:
        """The microbatches of the next global batch for this rank; advances the position."""
        base = self.consumed_samples + self.dp_rank * self.num_microbatches * self.micro_batch_size
        self.consumed_samples += self.global_batch_size
        return self._iter(base)

    def _iter(self, base: int) -> Iterator[Microbatch]:
        for m in range(self.num_microbatches):
            rows = [self.source.sample(base + m * self.micro_batch_size + j) for j in range(self.micro_batch_size)]
            batch = torch.stack(rows).to(self.device)
            yield Microbatch(tokens=batch[:, :-1].contiguous(), labels=batch[:, 1:].contiguous())

    def state_dict(self) -> dict[str, int]:
        return {"consumed_samples": self.consumed_samples}


def build_source(kind: str, *, path: str | None, seq_length: int, seed: int, vocab_size: int) -> Any:
    if kind == "mock":
        return MockSource(vocab_size, seq_length, seed)
    if kind == "tokens":
        if not path:
            raise ConfigError("data.kind=tokens needs data.path", hint="set data.path=<prefix from gptoss prepare-data>")
        return TokenFileSource(path, seq_length, seed, vocab_size)
    raise ConfigError(f"data.kind={kind!r} is not one of mock, tokens")


__all__ = ["MockSource", "TokenFileSource", "DataLoaderState", "Microbatch", "build_source", "TOKEN_DTYPES"]
