"""What every serving engine answers, and the results it returns (torch-free: numpy arrays).

An engine serves one model. `score` returns, for each prompt of n token ids, the log-probabilities of
the n - 1 next tokens given their prefixes (row p predicts token p + 1), either over the whole
vocabulary or over the engine's top-k plus the token that actually follows. `generate` continues
prompts and returns the new ids with the log-probability of each sampled token. `load_weights`
pushes new weights into the running engine (the path RL rollouts take after each update). Every path
an engine is handed goes through `local_folder` first: absolute, and an existing folder.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, Sequence

import numpy as np

from gptoss_cli.errors import UsageError

# The environment variable naming the Python interpreter that has the engine installed.
ENGINE_PYTHON_ENV = "GPTOSS_ENGINE_PYTHON"


class EngineError(UsageError):
    """The engine is missing, refused the model or failed: exit 2, with the engine's own message."""


@dataclass
class EngineInfo:
    """Which engine answered, for the report: name, version, device, the kernels it chose."""

    name: str
    version: str
    device: str = "unknown"
    kernels: dict[str, str] = field(default_factory=dict)
    python: str | None = None  # the interpreter it runs in (offline engines)
    url: str | None = None  # the server (endpoints)
    lora_experts: bool = False  # serves PEFT adapters on the MoE experts (target_parameters)
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class PromptScores:
    """Next-token log-probabilities at every position of one prompt.

    `logprobs[p]` is the distribution of token p + 1 given tokens 0..p. With the full vocabulary,
    `ids` is None and `logprobs` is [n - 1, V]; with top-k, `ids` and `logprobs` are [n - 1, K'] (the
    engine's top-k and the actual next token, padded with id -1 and logprob -inf)."""

    prompt_ids: list[int]
    logprobs: np.ndarray
    ids: np.ndarray | None = None

    @property
    def full_vocab(self) -> bool:
        return self.ids is None


@dataclass
class SamplingParams:
    """How `generate` picks tokens: temperature 0 is greedy."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    stop_token_ids: Sequence[int] = ()
    logprobs: int = 0  # besides the sampled token's, the top-k of each step (0: none)
    seeds: Sequence[int] | None = None  # one seed per prompt (RL rollouts), instead of `seed` for all

    def to_json(self) -> dict[str, Any]:
        return {"max_tokens": self.max_tokens, "temperature": self.temperature, "top_p": self.top_p,
                "seed": self.seed, "stop_token_ids": list(self.stop_token_ids), "logprobs": self.logprobs,
                "seeds": None if self.seeds is None else [int(x) for x in self.seeds]}


@dataclass
class Completion:
    """One continuation: the new ids and the log-probability of each under the engine's distribution."""

    ids: list[int]
    logprobs: list[float]
    finish_reason: str | None = None
    # the experts every fed token went to, as the engine reports them (vLLM: numpy [tokens, layers, k]); None: not asked
    routed_experts: Any = None


class Engine(Protocol):
    info: EngineInfo

    def score(self, prompts: Sequence[Sequence[int]], top_k: int | None = None) -> list[PromptScores]:
        """Prompt logprobs: the full vocabulary when `top_k` is None, else the top-k and the actual token."""
        ...

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams) -> list[Completion]:
        ...

    def load_weights(self, folder: str) -> None:
        """Replace the served weights with those of an HF folder of the same architecture."""
        ...

    def close(self) -> None:
        ...


def local_folder(path: str | Path, what: str = "the model") -> str:
    """`path` as an engine must be handed it: an existing folder, absolute. An engine works in a folder of its own
    (vLLM's worker starts in a temporary one), and vLLM takes a relative path that is not a folder there for a
    Hub repo id: a network error offline, the Hub's model online. Every engine resolves what it is given here."""
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise EngineError(f"{what} {path}: no such folder")
    return str(folder.resolve())


def one_line(text: str, limit: int = 600) -> str:
    """An engine's message on one line, cut to `limit` characters."""
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


__all__ = ["ENGINE_PYTHON_ENV", "EngineError", "EngineInfo", "PromptScores", "SamplingParams", "Completion", "Engine",
           "local_folder", "one_line"]
