"""distill: distillation from a frozen teacher (objective.kind=distill): where the teacher comes from, that it
speaks the student's vocabulary, the divergence's settings, and the layouts it runs with. On-policy distillation
also answers to the rl rules (its rollouts are GRPO's, gptoss_cli/recipe/rules/rl.py)."""

from __future__ import annotations

from dataclasses import asdict

from gptoss_cli.recipe.rules.core import ERROR, WARNING, Context, Finding, error, rule, warning
from gptoss_cli.recipe.schema import RecipeConfig
from gptoss_cli.recipe.schema_distill import DistillConfig


def _distill(cfg: RecipeConfig) -> bool:
    return cfg.objective.kind == "distill"


@rule("distill.inputs", "objective.kind=distill needs its teacher: distill.teacher_checkpoint (model) or distill.scores "
      "with distill.top_k >= 1 and one token file in data.path (precomputed: scores are looked up by the file's "
      "trained-token numbers); on-policy needs a model teacher (there are no stored scores of tokens not yet sampled); "
      "at launch the named files exist; a distill section without objective.kind=distill is ignored",
      fix="set distill.teacher_checkpoint (teacher=model), or distill.scores and distill.top_k to the `gptoss score` "
          "folder of data.path and its --top-k (teacher=precomputed)", severities=(ERROR, WARNING))
def distill_inputs(cfg: RecipeConfig, ctx: Context) -> list[Finding]:
    d = cfg.distill
    if not _distill(cfg):
        if asdict(d) != asdict(DistillConfig()):
            return [warning({"objective.kind": cfg.objective.kind}, "the distill section is ignored: "
                            f"objective.kind={cfg.objective.kind}", "set objective.kind=distill to learn from its teacher")]
        return []
    out = []
    if d.teacher == "model" and not d.teacher_checkpoint:
        out.append(error({"distill.teacher": "model", "distill.teacher_checkpoint": None},
                         "distill.teacher=model loads distill.teacher_checkpoint, which is not set"))
    if d.teacher == "precomputed":
        if d.on_policy:
            out.append(error({"distill.teacher": "precomputed", "distill.on_policy": True},
                             "on-policy distillation scores the tokens the student samples, which no stored file holds",
                             "distill.teacher=model with distill.teacher_checkpoint"))
        if not d.scores:
            out.append(error({"distill.teacher": "precomputed", "distill.scores": None},
                             "distill.teacher=precomputed reads distill.scores, which is not set"))
        if d.top_k < 1:
            out.append(error({"distill.teacher": "precomputed", "distill.top_k": d.top_k},
                             "a stored teacher is its top-K and tail: distill.top_k must be the folder's K (>= 1)"))
        data = cfg.data
        if not d.on_policy and (data.kind != "tokens" or not data.path or data.blend):
            out.append(error({"data.kind": data.kind, "data.path": data.path, "data.blend": bool(data.blend) or None},
                             "stored scores are looked up by the trained-token numbers of one token file: data.kind="
                             "tokens with data.path, not mock data or a blend"))
    if ctx.check_paths and not out:
        from pathlib import Path  # noqa: PLC0415

        for key, value in (("distill.teacher_checkpoint", d.teacher_checkpoint), ("distill.scores",
                           d.scores if d.teacher == "precomputed" else None)):
            if value and not Path(value).expanduser().exists():
                out.append(error({key: value}, f"{key}={value}: no such file or folder", bad_input=True))
    return out


@rule("distill.teacher", "the teacher speaks the student's vocabulary (teacher and student vocab_size agree; tokenizers "
      "and stored files are checked at launch); a model teacher's experts split over expert_model_parallel_size; "
      "distill.teacher_preset is the checkpoint's architecture; MXFP4 teacher experts need sizes that are multiples "
      "of 32", fix="distil between models of one tokenizer and vocabulary, with an EP size that divides both models' "
      "experts")
def distill_teacher(cfg: RecipeConfig, ctx: Context) -> list[Finding]:
    from gptoss_cli.recipe.teacher import checkpoint_teacher, size_mismatch, teacher_architecture  # noqa: PLC0415

    d = cfg.distill
    if not _distill(cfg):
        return []
    known = teacher_architecture(cfg)
    if known is None:
        return []
    arch, out = known[0], []
    source = (f"distill.teacher_preset={d.teacher_preset}" if d.teacher_preset
              else f"distill.teacher_checkpoint={d.teacher_checkpoint}")
    if arch.vocab_size != ctx.arch.vocab_size:
        out.append(error({"teacher vocab_size": arch.vocab_size, "student vocab_size": ctx.arch.vocab_size},
                         f"{source}: the teacher's vocabulary is {arch.vocab_size} tokens, the student's "
                         f"{ctx.arch.vocab_size}: its distributions are over other tokens"))
    ep = cfg.parallelism.expert_model_parallel_size
    if d.teacher == "model" and arch.num_local_experts % ep:
        out.append(error({"teacher experts": arch.num_local_experts, "parallelism.expert_model_parallel_size": ep},
                         f"the teacher's {arch.num_local_experts} experts do not split over {ep} expert-parallel ranks"))
    if d.teacher == "model" and d.teacher_experts == "mxfp4" and (arch.hidden_size % 32 or arch.intermediate_size % 32):
        out.append(error({"distill.teacher_experts": "mxfp4", "hidden_size": arch.hidden_size,
                          "intermediate_size": arch.intermediate_size},
                         "MXFP4 experts are blocked by 32 along both sizes", "distill.teacher_experts=bf16"))
    if d.teacher_preset and d.teacher_checkpoint:
        stored = checkpoint_teacher(d.teacher_checkpoint)
        for field, preset_value, value in size_mismatch(arch, stored[0]) if stored else []:
            out.append(error({"distill.teacher_preset": d.teacher_preset, field: value},
                             f"distill.teacher_checkpoint has {field}={value}, distill.teacher_preset="
                             f"{d.teacher_preset} {preset_value}", "distill.teacher_preset=null (the checkpoint's own)"))
    return out


@rule("distill.loss", "distill.temperature > 0; jsd needs 0 < distill.jsd_beta < 1 (its ends are forward_kl and "
      "reverse_kl); on-policy the loss is the per-token reverse KL of the samples at rl.temperature: distill.loss="
      "reverse_kl, distill.temperature = rl.temperature, no distill.top_k or distill.ce_weight; ce_weight=1 leaves "
      "the teacher unused", fix="distill.temperature=1.0; distill.loss=forward_kl or reverse_kl at the ends of the "
      "JSD; on-policy distill.loss=reverse_kl, distill.temperature=rl.temperature, top_k=0, ce_weight=0",
      severities=(ERROR, WARNING))
def distill_loss(cfg: RecipeConfig, ctx: Context) -> list[Finding]:
    d = cfg.distill
    if not _distill(cfg):
        return []
    out = []
    if d.temperature <= 0:
        out.append(error({"distill.temperature": d.temperature}, "the distributions are softmax(logits / temperature): "
                         "it must be above 0"))
    if d.loss == "jsd" and not 0 < d.jsd_beta < 1:
        out.append(error({"distill.loss": "jsd", "distill.jsd_beta": d.jsd_beta},
                         f"the JSD at beta={d.jsd_beta} is {'0' if d.jsd_beta == 0 else 'the reverse KL'}",
                         "0 < distill.jsd_beta < 1, or distill.loss=forward_kl (beta 0) / reverse_kl (beta 1)"))
    if d.on_policy:
        bad = {k: v for k, v in (("distill.loss", d.loss if d.loss != "reverse_kl" else None),
                                 ("distill.top_k", d.top_k or None), ("distill.ce_weight", d.ce_weight or None))
               if v is not None}
        if d.temperature != cfg.rl.temperature:
            bad.update({"distill.temperature": d.temperature, "rl.temperature": cfg.rl.temperature})
        if bad:
            out.append(error({"distill.on_policy": True, **bad}, "on-policy the loss is the per-token reverse KL of the "
                             f"student's samples at rl.temperature; these settings are for offline distillation: {bad}"))
    elif d.ce_weight == 1:
        out.append(warning({"distill.ce_weight": 1.0}, "distill.ce_weight=1 is plain cross-entropy: the teacher is "
                           "loaded and never used", "distill.ce_weight < 1, or objective.kind=cross_entropy"))
    return out


@rule("distill.layout", "distillation runs without pipeline or context parallelism (the teacher runs beside the "
      "student on each rank's whole microbatch)", fix="parallelism.pipeline_model_parallel_size=1, "
      "parallelism.context_parallel_size=1")
def distill_layout(cfg: RecipeConfig, ctx: Context) -> list[Finding]:
    if not _distill(cfg):
        return []
    par = cfg.parallelism
    bad = {k: v for k, v in (("parallelism.pipeline_model_parallel_size", par.pipeline_model_parallel_size),
                             ("parallelism.context_parallel_size", par.context_parallel_size)) if v > 1}
    if not bad:
        return []
    return [error(bad, f"distillation is not implemented with {', '.join(bad)} above 1")]


__all__ = ["distill_inputs", "distill_teacher", "distill_loss", "distill_layout"]
