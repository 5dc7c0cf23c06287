"""Rewards: the recipe's `rl.reward` loaded once per rank, called safely, and the built-ins. Torch-free.

A reward is `fn(prompt_messages, completion_text, completion_ids, record) -> float`:
- `prompt_messages`: the prompt's conversation, the `messages` list as the prompts file holds it;
- `completion_text`: the text of the completion's final-channel message(s) (harmony); it is a `str`
  whose attribute `harmony` holds the whole completion decoded, special tokens included, and
  `messages` the assistant messages parsed from it (gptoss_cli/data/harmony.py, `parse_completion`);
- `completion_ids`: the sampled token ids (the stop token included when one ended it);
- `record`: the prompt record's other fields (e.g. `answer`).

`rl.reward` is `"module:function"` (imported in each training process, so importable from the run's
environment) or a built-in's name. A reward that raises or returns something other than a finite
number does not stop the run: that completion gets advantage 0 and its group's statistics are over the
others (TRL's unscorable completions); the run prints one line naming the prompt's FILE:LINE
(`RewardFailure`) and the step logs how many failed (`reward_failures`).
"""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from gptoss_cli.data.harmony import HarmonyTokenizer, parse_completion
from gptoss_cli.errors import ConfigError

RewardFn = Callable[[list, str, list, dict], float]


class CompletionText(str):
    """The final-channel text of a completion, with the whole completion as `harmony` and its parsed `messages`."""

    harmony: str
    messages: list


def completion_text(ids: Sequence[int], tok: HarmonyTokenizer) -> CompletionText:
    messages = parse_completion(ids, tok)
    final = "".join("".join(p for p in m.content if isinstance(p, str)) for m in messages if m.channel == "final")
    text = CompletionText(final)
    text.harmony = tok.decode(list(ids))
    text.messages = messages
    return text


# --- built-ins ---------------------------------------------------------------------------------
def exact_answer(prompt_messages: list, completion_text: str, completion_ids: list, record: dict) -> float:
    """1.0 when the final-channel text, stripped, equals str(record['answer']) stripped; else 0.0."""
    if "answer" not in record:
        raise ValueError("the prompt record has no 'answer' field (exact_answer compares the final answer with it)")
    return float(completion_text.strip() == str(record["answer"]).strip())


def harmony_format(prompt_messages: list, completion_text: str, completion_ids: list, record: dict) -> float:
    """1.0 when the completion is well-formed harmony ending the turn: every message has a header and
    a body, the last is on the final channel and <|return|> closed it; else 0.0."""
    messages = getattr(completion_text, "messages", None)
    harmony = getattr(completion_text, "harmony", "")
    if not messages or not harmony.endswith("<|return|>"):
        return 0.0
    return float(messages[-1].channel == "final" and all(m.channel for m in messages))


def even_tokens(prompt_messages: list, completion_text: str, completion_ids: list, record: dict) -> float:
    """The share of completion tokens with an even id: a toy reward a random model starts near 0.5 on and
    can move, for checking that training learns (docs/rl.md)."""
    if not completion_ids:
        return 0.0
    return sum(1 for t in completion_ids if t % 2 == 0) / len(completion_ids)


BUILTINS: dict[str, RewardFn] = {"exact_answer": exact_answer, "harmony_format": harmony_format,
                                 "even_tokens": even_tokens}


def load_reward(spec: str) -> RewardFn:
    """The function `spec` names: a built-in, or "module:function" importable here; a ConfigError otherwise."""
    if spec in BUILTINS:
        return BUILTINS[spec]
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"rl.reward={spec!r} is neither a built-in ({', '.join(BUILTINS)}) nor 'module:function'")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 - any import failure is the recipe's problem, said in one line
        raise ConfigError(f"rl.reward={spec!r}: cannot import {module_name} ({type(exc).__name__}: {exc})",
                          hint="the module must be importable in the training processes (PYTHONPATH)") from None
    fn = module
    for part in attr.split("."):
        fn = getattr(fn, part, None)
        if fn is None:
            raise ConfigError(f"rl.reward={spec!r}: {module_name} has no {attr}")
    if not callable(fn):
        raise ConfigError(f"rl.reward={spec!r}: {attr} is not callable")
    return fn


@dataclass(frozen=True)
class RewardFailure:
    """A reward that raised or returned a non-finite value: where the prompt came from and what happened."""

    where: str
    message: str

    def line(self) -> str:
        return f"reward failed on the prompt at {self.where}: {self.message} (its advantage is 0)"


def call_reward(fn: RewardFn, prompt_messages: list, text: CompletionText, ids: list[int], record: dict[str, Any],
                where: str) -> float | RewardFailure:
    """fn's reward as a float, or the RewardFailure that says why there is none."""
    try:
        value = fn(prompt_messages, text, list(ids), dict(record))
    except Exception as exc:  # noqa: BLE001 - a user's reward may raise anything; it is reported, not fatal
        message = " ".join(f"{type(exc).__name__}: {exc}".split())[:300]
        return RewardFailure(where, message)
    try:
        number = float(value)
    except (TypeError, ValueError):
        return RewardFailure(where, f"returned {type(value).__name__} {str(value)[:60]!r}, not a number")
    if not math.isfinite(number):
        return RewardFailure(where, f"returned {number}")
    return number


__all__ = ["RewardFn", "CompletionText", "completion_text", "exact_answer", "harmony_format", "even_tokens",
           "BUILTINS", "load_reward", "RewardFailure", "call_reward"]
