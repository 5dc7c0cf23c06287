"""GRPO runs on the tiny model for tests: the tiny harmony tokenizer, short prompts, jobs, and their metrics.

Prompts are harmony-form conversations with an empty system message and a one-word user turn (about 10
tokens with the tiny tokenizer; harmony's default system message would be 90 more), so a row of
prompt + 8 sampled tokens fits 32 positions. The toy reward is the share of even token ids
(`even_tokens`), which a randomly initialised model starts near 0.5 on.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from gptoss_cli.data.tiny_tokenizer import tiny_tokenizer
from gptoss_cli.model.config import preset
from tests.train.jobs import train_job

TINY = preset("tiny")
WORDS = ("Hi", "Hello", "How are you", "Thanks", "help", "today", "the answer", "question")
EMPTY_SYSTEM = {"role": "system", "content": [{"type": "system_content", "model_identity": None,
                                                "reasoning_effort": None, "knowledge_cutoff": None,
                                                "channel_config": None}]}


def write_inputs(folder: Path, extra: dict[str, Any] | None = None) -> tuple[Path, Path]:
    """(tokenizer.json, prompts.jsonl) in `folder`; `extra` fields go into every record."""
    folder.mkdir(parents=True, exist_ok=True)
    tok = folder / "tokenizer.json"
    tok.write_text(json.dumps(tiny_tokenizer(TINY.vocab_size)))
    prompts = folder / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"messages": [EMPTY_SYSTEM, {"role": "user", "content": [
        {"type": "text", "text": w}]}], **(extra or {})}) + "\n" for w in WORDS))
    return tok, prompts


def grpo_job(folder: Path, **changes: Any):
    """A GRPO job on the tiny model: 2 prompts x 8 completions of 8 tokens per step, even_tokens reward."""
    tok, prompts = write_inputs(folder / "inputs")
    settings = dict(objective="grpo", rl_prompts=str(prompts), rl_tokenizer=str(tok), rl_reward="even_tokens",
                    group_size=8, max_new_tokens=8, seq_length=32, global_batch_size=16, micro_batch_size=8,
                    train_iters=4, lr=2e-2, min_lr=2e-2, warmup_iters=0, clip_grad=1.0)
    settings.update(changes)
    return train_job(folder / "run", **settings)


def metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """Rank 0's metrics.jsonl lines."""
    lines = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return [r for r in lines if r.get("rank", 0) == 0]


__all__ = ["TINY", "WORDS", "write_inputs", "grpo_job", "metrics"]
