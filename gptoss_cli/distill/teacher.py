"""The teacher a distillation run learns from: a `gptoss score` folder, or a frozen checkpoint beside the student.

Both answer `attach(microbatch)`, which puts the teacher at the microbatch's positions into its `extras`
(train/objective.py: `loss` reads them from there), and `head_weight` (the teacher's output layer, for a
full-vocabulary teacher; None otherwise):

- `ScoreTeacher` (distill.teacher=precomputed): the stored top-K ids, log-probs and tail mass of every
  trained token, looked up by the microbatch's trained-token numbers (gptoss_cli/score/reader.py,
  `ScoreFile.attach`, under the reader's EXTRAS names).
- `ModelTeacher` (distill.teacher=model): the teacher checkpoint built from its own config (its
  architecture, not the student's: 120B teaching 20B), frozen in eval mode, its experts split over the
  run's expert-parallel group as the student's are and kept in MXFP4 when distill.teacher_experts says so.
  Per microbatch one forward without gradients; with distill.top_k = K > 0 its top-K and tail at the
  trained positions, computed by `gptoss score`'s own function (score/compute.py, `score_positions`)
  under the same names as a stored file's, so the loss cannot tell the two apart; with K = 0 its final
  hidden states (`TEACHER_HIDDEN`), from which the loss computes its full-vocabulary logits chunk by chunk.

`open_teacher` checks the teacher against the student first, each refusal one line naming both values
(ConfigError, exit 2): a stored file of other data, K, vocabulary, tokenizer or temperature
(`open_scores`), a checkpoint whose vocabulary or tokenizer is not the student's, a teacher preset that is
not the checkpoint's architecture.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from gptoss_cli.errors import ConfigError
from gptoss_cli.model.config import GptOssArch
from gptoss_cli.model.loss import IGNORE_INDEX
from gptoss_cli.recipe.schema import RecipeConfig

TEACHER_HIDDEN = "distill_teacher_hidden"  # [mbs, S, H_teacher]: a full-vocabulary model teacher's final hidden states


class ScoreTeacher:
    """distill.teacher=precomputed (module docstring)."""

    head_weight = None

    def __init__(self, scores: Any):
        self.scores = scores

    def attach(self, mb: Any) -> Any:
        return self.scores.attach(mb)

    def close(self) -> None:
        self.scores.close()


class ModelTeacher:
    """distill.teacher=model (module docstring)."""

    def __init__(self, model: torch.nn.Module, top_k: int, temperature: float):
        self.model, self.top_k, self.temperature = model, top_k, temperature

    @property
    def head_weight(self) -> torch.Tensor | None:
        return None if self.top_k else self.model.output_layer.weight

    def forward(self, tokens: torch.Tensor, **inputs: Any) -> Any:
        with torch.no_grad():
            return self.model(tokens, **inputs)

    def attach(self, mb: Any) -> Any:
        out = self.forward(mb.tokens, **mb.model_inputs())
        if not self.top_k:
            mb.extras[TEACHER_HIDDEN] = out.hidden
            return mb
        from gptoss_cli.score.compute import score_positions  # noqa: PLC0415
        from gptoss_cli.score.reader import EXTRAS  # noqa: PLC0415

        labels = mb.labels.reshape(-1)
        at = torch.nonzero(labels != IGNORE_INDEX).flatten()
        hidden = out.hidden.reshape(-1, out.hidden.shape[-1]).index_select(0, at)
        with torch.no_grad():
            got = score_positions(hidden, out.head_weight, labels.index_select(0, at), top_k=self.top_k,
                                  temperature=self.temperature)
        n, shape = labels.numel(), mb.labels.shape
        for name, value, dtype in (("topk_ids", got.topk_ids, torch.int64),
                                   ("topk_logprobs", got.topk_logprobs, torch.float32),
                                   ("tail_logmass", got.tail_logmass, torch.float32)):
            full = torch.zeros((n, *value.shape[1:]), dtype=dtype, device=labels.device)
            full[at] = value.to(dtype)
            mb.extras[EXTRAS[name]] = full.reshape(*shape, *value.shape[1:])
        return mb

    def close(self) -> None:
        pass


def student_tokenizer(cfg: RecipeConfig) -> Path | None:
    """The tokenizer.json the student's data and prompts were made with: rl.tokenizer on-policy, else
    checkpoint.pretrained's; None when the recipe names neither (a student from a seed)."""
    from gptoss_cli.data.tokenizer import tokenizer_path  # noqa: PLC0415

    if cfg.distill.on_policy and cfg.rl.tokenizer:
        return tokenizer_path(cfg.rl.tokenizer)
    if cfg.checkpoint.pretrained:
        from gptoss_cli.checkpoint.sources import open_source  # noqa: PLC0415

        source = open_source(str(cfg.checkpoint.pretrained))
        try:
            file = Path(source.extras_folder) / "tokenizer.json"
        finally:
            source.close()
        return file if file.is_file() else None
    return None


def _tokenizer_digest(cfg: RecipeConfig) -> str | None:
    from gptoss_cli.score.digests import file_sha256  # noqa: PLC0415

    file = student_tokenizer(cfg)
    return None if file is None or not file.is_file() else "sha256:" + file_sha256(file)


def _check_teacher_checkpoint(cfg: RecipeConfig, student: GptOssArch) -> GptOssArch:
    """The teacher checkpoint's architecture, refused when its vocabulary, tokenizer or preset is not the recipe's."""
    from gptoss_cli.checkpoint.load import checkpoint_architecture  # noqa: PLC0415
    from gptoss_cli.model.config import PRESETS  # noqa: PLC0415
    from gptoss_cli.recipe.teacher import size_mismatch  # noqa: PLC0415
    from gptoss_cli.score.digests import tokenizer_digest  # noqa: PLC0415

    d = cfg.distill
    arch, _ = checkpoint_architecture(d.teacher_checkpoint)
    where = f"distill.teacher_checkpoint={d.teacher_checkpoint}"
    if arch.vocab_size != student.vocab_size:
        raise ConfigError(f"{where}: the teacher's vocabulary is {arch.vocab_size} tokens, the student's "
                          f"{student.vocab_size}", hint="distil between models of one tokenizer and vocabulary")
    if d.teacher_preset is not None:
        for field, preset_value, stored in size_mismatch(PRESETS[d.teacher_preset], arch):
            raise ConfigError(f"{where}: its {field} is {stored}, but distill.teacher_preset={d.teacher_preset} "
                              f"has {preset_value}", hint="set distill.teacher_preset to the checkpoint's, or null")
    theirs, ours = tokenizer_digest(d.teacher_checkpoint), _tokenizer_digest(cfg)
    if theirs is not None and ours is not None and theirs != ours:
        raise ConfigError(f"{where}: the teacher's tokenizer is {theirs}, the student's {ours}",
                          hint="distil between models of one tokenizer")
    return arch


def open_teacher(cfg: RecipeConfig, student: GptOssArch, state: Any) -> ScoreTeacher | ModelTeacher:
    """The recipe's teacher for this rank, checked against the student (module docstring)."""
    d = cfg.distill
    if d.teacher == "precomputed":
        from gptoss_cli.score import checkpoint_digest, open_scores  # noqa: PLC0415

        if not d.scores:
            raise ConfigError("distill.teacher=precomputed reads distill.scores, which is not set",
                              hint="gptoss score TEACHER --data DATA --top-k K --out DIR, then distill.scores=DIR")
        model_digest = checkpoint_digest(d.teacher_checkpoint) if d.teacher_checkpoint else None
        scores = open_scores(d.scores, data=cfg.data.path, model_digest=model_digest, top_k=d.top_k,
                             vocab_size=student.vocab_size, tokenizer_digest=_tokenizer_digest(cfg),
                             temperature=d.temperature, seq_length=cfg.training.seq_length)
        return ScoreTeacher(scores)
    if not d.teacher_checkpoint:
        raise ConfigError("distill.teacher=model loads distill.teacher_checkpoint, which is not set")
    arch = _check_teacher_checkpoint(cfg, student)
    return ModelTeacher(build_teacher_model(cfg, arch, state), d.top_k, d.temperature)


def build_teacher_model(cfg: RecipeConfig, arch: GptOssArch, state: Any) -> torch.nn.Module:
    """The teacher checkpoint built from its own config and loaded, this rank's experts only (the run's EP
    group), frozen, in eval mode, in distill.teacher_dtype (else the student's) with its experts as
    distill.teacher_experts says."""
    from gptoss_cli.checkpoint.load import model_from_checkpoint  # noqa: PLC0415
    from gptoss_cli.model.dtypes import torch_dtype  # noqa: PLC0415
    from gptoss_cli.train.provider import dispatcher_factory  # noqa: PLC0415

    d = cfg.distill
    if arch.num_local_experts % state.ep_size:
        raise ConfigError(f"distill.teacher_checkpoint={d.teacher_checkpoint}: its {arch.num_local_experts} experts "
                          f"do not split over expert_model_parallel_size={state.ep_size}")
    offset, n_local = state.local_expert_range(arch.num_local_experts)
    model = model_from_checkpoint(d.teacher_checkpoint, dtype=torch_dtype(d.teacher_dtype or cfg.precision.params_dtype),
                                  device=state.device, base_experts=d.teacher_experts, expert_offset=offset,
                                  num_local_experts=n_local,
                                  token_dispatcher_factory=dispatcher_factory(arch.num_local_experts, state))
    model.set_attention_backend(cfg.model.attention_backend)
    model.requires_grad_(False)
    return model.eval()


__all__ = ["ScoreTeacher", "ModelTeacher", "open_teacher", "build_teacher_model", "student_tokenizer",
           "TEACHER_HIDDEN"]
