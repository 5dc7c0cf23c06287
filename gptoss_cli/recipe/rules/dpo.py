"""dpo: preference tuning (objective.kind=dpo): its data, its loss settings, where its reference comes from."""

from __future__ import annotations

import dataclasses

from gptoss_cli.recipe.rules.core import ERROR, WARNING, Context, Finding, error, rule, warning
from gptoss_cli.recipe.schema import DPOConfig, RecipeConfig

SMOOTHED = ("robust", "simpo")  # the losses that take dpo.label_smoothing (TRL's DPO sigmoid, ipo, hinge take none)


def _dpo(cfg: RecipeConfig) -> bool:
    return cfg.objective.kind == "dpo"


@rule("dpo.inputs", "objective.kind=dpo trains on the preference pairs of data.path (data.kind=tokens, no blend); at "
      "launch data.path and validation.data are `prepare-data --format preference` files whose pairs (both sides "
      "together) fit in training.seq_length; a dpo section without objective.kind=dpo is ignored",
      fix="data.kind=tokens data.path=PREFIX of `gptoss prepare-data FILE --format preference --seq-length S`, and "
          "training.seq_length >= its longest pair", severities=(ERROR, WARNING))
def dpo_inputs(cfg: RecipeConfig, ctx: Context) -> list[Finding]:
    if not _dpo(cfg):
        changed = {f"dpo.{f.name}": getattr(cfg.dpo, f.name) for f in dataclasses.fields(DPOConfig)
                   if getattr(cfg.dpo, f.name) != f.default}
        if changed:
            return [warning({"objective.kind": cfg.objective.kind, **changed}, "the dpo section is ignored: the "
                            f"objective is {cfg.objective.kind}", "set objective.kind=dpo to train on preference pairs")]
        return []
    d = cfg.data
    if d.kind != "tokens" or not d.path or d.blend:
        return [error({"data.kind": d.kind, "data.path": d.path, "data.blend": len(d.blend)},
                      "DPO trains on the preference pairs of one token file: data.kind=tokens with data.path "
                      "(mock data and blends hold no pairs)")]
    if not ctx.check_paths:
        return []
    return [p for name, path in (("data.path", d.path), ("validation.data", cfg.validation.data)) if path
            for p in _pair_file_problems(name, path, cfg.training.seq_length)]


def _pair_file_problems(name: str, path: str, seq_length: int) -> list[Finding]:
    import numpy as np  # noqa: PLC0415

    from gptoss_cli.data.token_format import INDEX_DTYPE, document_file_paths  # noqa: PLC0415
    from gptoss_cli.errors import GptossError  # noqa: PLC0415
    from gptoss_cli.data.preference import check_preference_file  # noqa: PLC0415

    try:
        check_preference_file(path)
        offsets = np.fromfile(document_file_paths(path)[0], dtype=INDEX_DTYPE)
    except GptossError as exc:
        return [error({name: path}, exc.message, exc.hint, bad_input=True)]
    except OSError:
        return []  # data.source names an unreadable file
    pairs = offsets[2::2] - offsets[:-2:2]
    if len(pairs) and int(pairs.max()) > seq_length:
        k = int(pairs.argmax())
        return [error({"training.seq_length": seq_length, name: path},
                      f"{path}: pair {k} has {int(pairs[k])} tokens (both sides), more than a row of "
                      f"training.seq_length={seq_length} holds (a pair is packed whole, never split)",
                      f"set training.seq_length >= {int(pairs.max())}, or re-create the file with a smaller "
                      "--max-length")]
    return []


@rule("dpo.loss", "dpo.beta > 0; dpo.label_smoothing only with the robust and simpo losses; simpo needs no reference "
      "(dpo.reference is not used)", fix="dpo.beta > 0 (0.1 for DPO, 2 to 10 for SimPO); dpo.label_smoothing=0 with "
      "sigmoid, ipo and hinge (or dpo.loss=robust)", severities=(ERROR, WARNING))
def dpo_loss(cfg: RecipeConfig, ctx: Context) -> list[Finding]:
    d, out = cfg.dpo, []
    if not _dpo(cfg):
        return []
    if d.beta <= 0:
        out.append(error({"dpo.beta": d.beta}, "dpo.beta=0: the rewards are beta x log-ratios, and ipo and simpo "
                         "divide by beta"))
    if d.label_smoothing > 0 and d.loss not in SMOOTHED:
        out.append(error({"dpo.loss": d.loss, "dpo.label_smoothing": d.label_smoothing},
                         f"dpo.loss={d.loss} takes no label smoothing (TRL's neither); robust is conservative DPO "
                         "with it"))
    if d.loss == "simpo" and d.reference == "precomputed":
        out.append(warning({"dpo.loss": "simpo", "dpo.reference": "precomputed"}, "simpo is reference-free: "
                           "nothing is scored or read for dpo.reference", "leave dpo.reference at its default"))
    return out


@rule("dpo.reference", "dpo.reference=precomputed scores checkpoint.pretrained (the reference); at launch a pipeline- "
      "or context-parallel run finds the scores already made; dpo.reference=model under full fine-tuning runs a "
      "frozen second model outside the pipeline schedule, so not with pipeline parallelism; held-out pairs are "
      "scored without the pipeline schedule too",
      fix="checkpoint.pretrained for precomputed (or dpo.reference=model); with pipeline parallelism LoRA or "
          "dpo.reference=precomputed, and validation.data=null; `gptoss score` the files first under PP or CP")
def dpo_reference(cfg: RecipeConfig, ctx: Context) -> list[Finding]:
    d, p, out = cfg.dpo, cfg.parallelism, []
    if not _dpo(cfg) or d.loss == "simpo":
        return out
    pp, cp = p.pipeline_model_parallel_size, p.context_parallel_size
    if d.reference == "precomputed" and not cfg.checkpoint.pretrained:
        out.append(error({"dpo.reference": "precomputed", "checkpoint.pretrained": None},
                         "the precomputed reference is checkpoint.pretrained scored once; there is none"))
    if d.reference == "model" and cfg.lora.rank == 0 and pp > 1:
        out.append(error({"dpo.reference": "model", "lora.rank": 0, "parallelism.pipeline_model_parallel_size": pp},
                         "the frozen reference model of full fine-tuning is called outside the pipeline schedule"))
    if pp > 1 and cfg.validation.data:
        out.append(error({"parallelism.pipeline_model_parallel_size": pp, "validation.data": cfg.validation.data},
                         "held-out pairs are scored with the whole model on each rank, not through the pipeline"))
    if d.reference == "precomputed" and (pp > 1 or cp > 1) and ctx.check_paths and cfg.checkpoint.pretrained:
        from gptoss_cli.data.preference import reference_folder  # noqa: PLC0415

        for name, path in (("data.path", cfg.data.path), ("validation.data", cfg.validation.data)):
            if path and not reference_folder(path).is_dir():
                out.append(error({name: path, "dpo.reference": "precomputed"},
                                 f"{reference_folder(path)}: no reference scores, and a pipeline- or context-parallel "
                                 "run does not score them itself", f"gptoss score {cfg.checkpoint.pretrained} --data "
                                 f"{path} --out {reference_folder(path)} --seq-length {cfg.training.seq_length}",
                                 bad_input=True))
    return out


__all__ = ["dpo_inputs", "dpo_loss", "dpo_reference"]
