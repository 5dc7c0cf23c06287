"""The recipe's `distill` section: distillation from a frozen teacher (objective.kind=distill, docs/distill.md;
gptoss_cli/distill/)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from gptoss_cli.limits import INT32_MAX
from gptoss_cli.model.dtypes import RECIPE_DTYPES
from gptoss_cli.recipe.field_spec import spec

DISTILL_TEACHERS = ("model", "precomputed")
# the per-token divergences (gptoss_cli/distill/losses.py); TRL's generalized_jsd_loss at beta 0, 1 and between
DISTILL_LOSSES = ("forward_kl", "reverse_kl", "jsd")
TEACHER_EXPERTS = ("bf16", "mxfp4")


@dataclass
class DistillConfig:
    teacher: str = spec(
        "model", "where the teacher's distributions come from: model (a frozen checkpoint, distill.teacher_checkpoint, "
        "built from its own config beside the student) or precomputed (a `gptoss score --top-k K` folder of data.path, "
        "distill.scores: the teacher never sits beside the student)", choices=DISTILL_TEACHERS)
    teacher_checkpoint: Optional[str] = spec(
        None, "model: the teacher, any checkpoint gptoss reads (Hugging Face with MXFP4 or bf16 experts, Hybrid, a "
        "training run), of its own architecture (e.g. 120B teaching 20B); precomputed: when set, distill.scores must "
        "have been scored from it (its digest is checked at launch)")
    teacher_preset: Optional[str] = spec(
        None, "the teacher's architecture where its checkpoint is not at hand (validate-config, the memory estimate): "
        "a model.preset name; at launch it must be the checkpoint's; null = read from distill.teacher_checkpoint",
        choices=(None, "gpt_oss_20b", "gpt_oss_120b", "tiny"))
    teacher_experts: str = spec(
        "bf16", "model: storage of the teacher's expert weights: bf16 (distill.teacher_dtype) or mxfp4 (as released, "
        "4.25 bits per weight, one layer decoded per GEMM)", choices=TEACHER_EXPERTS)
    teacher_dtype: Optional[str] = spec(None, "model: what the teacher computes in; null = precision.params_dtype",
                                        choices=(None, *RECIPE_DTYPES))
    scores: Optional[str] = spec(
        None, "precomputed: the folder `gptoss score TEACHER --data data.path --top-k distill.top_k --temperature "
        "distill.temperature` wrote; a folder of other data, K, vocabulary, tokenizer or temperature is refused")
    top_k: int = spec(
        0, "the teacher's distribution as its K most likely tokens and the mass of the rest (docs/distill.md); "
        "precomputed: the folder's K (at least 1); 0 = the whole vocabulary (model only)", min=0, max=INT32_MAX)
    loss: str = spec(
        "forward_kl", "the per-token divergence: forward_kl = KL(teacher || student), reverse_kl = KL(student || "
        "teacher), jsd = the generalised Jensen-Shannon divergence at distill.jsd_beta (TRL's GKD)",
        choices=DISTILL_LOSSES)
    jsd_beta: float = spec(0.5, "jsd: the teacher's weight in the mixture, 0 < beta < 1 (TRL's beta; its ends are "
                           "forward_kl and reverse_kl)", min=0.0, max=1.0)
    temperature: float = spec(1.0, "both distributions are softmax(logits / temperature) (no temperature-squared "
                              "factor, as TRL); on-policy it must equal rl.temperature", min=0.0)
    ce_weight: float = spec(0.0, "the loss of a trained token is (1 - ce_weight) x the divergence + ce_weight x the "
                            "ordinary cross-entropy of its label; 0 = distillation only", min=0.0, max=1.0)
    on_policy: bool = spec(
        False, "the student samples completions of rl.prompts with GRPO's rollouts (the rl section: sampling, engine, "
        "batch, mismatch handling) and the teacher scores the sampled tokens; the loss is the per-token reverse KL on "
        "those samples (advantage = teacher log-prob - student log-prob); needs distill.teacher=model")


__all__ = ["DistillConfig", "DISTILL_TEACHERS", "DISTILL_LOSSES", "TEACHER_EXPERTS"]
