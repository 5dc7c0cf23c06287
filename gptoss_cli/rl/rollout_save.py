"""rl.save_rollouts: a rollout batch gathered from every data-parallel rank and written by rank 0 (rl/rollout_file.py).

`save_rollout` runs after the last optimizer step of a rollout (RLTrainer), when every completion has been
trained on: each rank turns its completions into rows (the decoded prompt and completion, the reward and
advantage, the engine's log-probabilities, the trainer's at the rollout's weights, which the objective leaves in
`extras["old_logp"]` when the rollout did not score them, the importance weight rl.is_correction gave each token,
and the engine's routes as uint8), the rows go to data-parallel rank 0 in one gather, and global rank 0 writes
`logging.run_dir/rollouts/rollout_NNNNNN.parquet` whole or not at all. Checkpoints fall on rollout boundaries, so
a resumed run samples the rollouts after its checkpoint again and writes their files again, the same bytes.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from gptoss_cli.model.loss import IGNORE_INDEX
from gptoss_cli.rl.importance import ImportanceCorrection
from gptoss_cli.rl.rewards import completion_text
from gptoss_cli.rl.rollout_file import ROLLOUTS_DIR, write_rollout_file

if TYPE_CHECKING:
    from gptoss_cli.rl.batch import Rollout
    from gptoss_cli.rl.rollouts import RolloutData


def _token_columns(rollout: Rollout, correction: ImportanceCorrection) -> list[tuple[list, list | None, list]]:
    """(engine, trainer, weights) log-probs and importance weights of each completion's tokens, per microbatch row."""
    out = []
    for mb in rollout.microbatches:
        mask = (mb.labels != IGNORE_INDEX).float()
        engine = mb.extras["rollout_logp"]
        trainer = mb.extras.get("old_logp")
        weights = None if trainer is None else correction.weights(trainer - engine, mask)[0]
        picks = [t.detach().float().cpu() if t is not None else None for t in (engine, trainer, weights)]
        at = mask.bool().cpu()
        for r in range(mask.shape[0]):
            out.append(tuple(None if t is None else t[r][at[r]].tolist() for t in picks))
    return out


def rollout_rows(data: RolloutData, rollout: Rollout, first_step: int,
                    correction: ImportanceCorrection) -> tuple[list[dict[str, Any]], list[Any]]:
    """This rank's rows of the rollout file (rl/rollout_file.py) and the routes of each (uint8 numpy or None)."""
    per_step = data.num_microbatches * data.micro_batch_size  # this rank's completions per optimizer step
    rows, routes = [], []
    tokens = _token_columns(rollout, correction)
    for i, c in enumerate(rollout.completions):
        p = data.prompts[c.prompt]
        text = completion_text(c.ids, data.htok)
        engine, trainer, weights = tokens[i]
        rows.append({"step": first_step + i // per_step, "rank": data.dp_rank, "prompt": c.prompt,
                     "prompt_source": p.where, "prompt_ids": list(p.ids), "prompt_text": data.htok.decode(p.ids),
                     "completion_ids": list(c.ids), "completion_text": text.harmony, "final_text": str(text),
                     "finish": c.finish, "reward": rollout.rewards[i], "advantage": float(rollout.advantages[i]),
                     "engine_logprobs": engine, "trainer_logprobs": trainer, "is_weights": weights})
        routes.append(None if c.routes is None else c.routes.to(torch.uint8).cpu().numpy())
    return rows, routes


def save_rollout(data: RolloutData, rollout: Rollout, first_step: int, correction: ImportanceCorrection,
                 run_dir: str | Path) -> Path | None:
    """Gather the rollout's rows to data-parallel rank 0 and write its file there; the path on global rank 0, else
    None. Every data-parallel rank must call it (one collective)."""
    mine = rollout_rows(data, rollout, first_step, correction)
    state = data.state
    if state.distributed and data.dp_size > 1:
        gathered: list[Any] | None = [None] * data.dp_size if data.dp_rank == 0 else None
        dist.gather_object(mine, gathered, group=state.dp_group, group_dst=0)
        parts = gathered or []
    else:
        parts = [mine]
    if state.rank != 0:
        return None
    rows = [row for part in parts for row in part[0]]
    routes = [r for part in parts for r in part[1]]
    arch, rl = data.job.arch, data.rl
    meta: dict[str, Any] = {
        "first_step": first_step, "steps_per_rollout": rl.steps_per_rollout, "group_size": rl.group_size,
        "temperature": rl.temperature, "engine": rl.rollout.engine,
        "is_correction": {"mode": correction.mode, "is_min": correction.is_min, "is_max": correction.is_max,
                          "sequence_ratio": correction.sequence_ratio},
        "routes": None if all(r is None for r in routes) else {
            "moe_layers": [block for _, block in data.moe_layers], "top_k": arch.num_experts_per_tok,
            "dtype": "uint8", "layout": "[fed tokens][MoE layer][k] global expert ids"}}
    return write_rollout_file(Path(run_dir) / ROLLOUTS_DIR, rollout.index + 1, rows, routes, meta)


__all__ = ["save_rollout", "rollout_rows"]
