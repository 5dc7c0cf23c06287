"""Distillation's items in the per-GPU memory estimate (recipe/estimate/memory.py), objective.kind=distill.

- A model teacher (distill.teacher=model) is a second, frozen model of its own architecture on every rank
  (recipe/teacher.py: distill.teacher_preset or its checkpoint's config): its parameters with this rank's
  share of its experts (the run's expert-parallel size), in distill.teacher_dtype, its expert weights at 4.25
  bits each with distill.teacher_experts=mxfp4 plus one layer's decoded for the GEMM that runs. Its forward
  keeps no activations for backward; the largest layer's working set of one microbatch is counted as
  activations (`activation_bytes_per_token` of its largest layer kind).
- What the teacher hands the loss, per microbatch: its top-K ids (int64), log-probs and tail (fp32), or, at
  full vocabulary, its final hidden states in its dtype.
- The loss's chunk (gptoss_cli/distill/losses.py: the LM loss's chunk / CHUNK_DIVISOR tokens): about four
  [tokens, vocabulary] fp32 tensors beside the LM head's (the teacher's log-probs, the mixture, their terms).
- A precomputed teacher (distill.teacher=precomputed) costs only its microbatch's top-K on the device.
- On-policy (distill.on_policy): the teacher model and its forward; the loss is GRPO's (no distillation chunk), the
  rollouts' KV cache is GRPO's item (memory_rl.py).

Without a known teacher architecture (no preset, a checkpoint not at hand) the teacher's parameters are not
counted and a note says so. Pure Python, like the rest of the estimate.
"""

from __future__ import annotations

from typing import Callable, TypeVar

from gptoss_cli.model.config import GptOssArch
from gptoss_cli.model.loss_chunk import lm_loss_chunk_tokens
from gptoss_cli.recipe.estimate.parameters import parameter_layout
from gptoss_cli.recipe.schema import RecipeConfig

Item = TypeVar("Item")
ItemType = Callable[[str, str, float, str, str], Item]
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
MXFP4_BITS = 4 + 8 / 32
CHUNK_DIVISOR = 4  # gptoss_cli/distill/losses.py's (torch-free here)
CHUNK_TENSORS = 4  # fp32 [tokens, vocabulary] tensors the distillation chunk holds beside the LM head's


def distill_items(cfg: RecipeConfig, arch: GptOssArch, t: int, b: int, ep: int, item_type: ItemType[Item],
                  notes: list[str], activation_bytes: Callable[[GptOssArch, int], dict[str, float]]) -> list[Item]:
    """The items of one rank (`t` tokens per microbatch, params of `b` bytes, EP size `ep`); [] unless
    objective.kind=distill. `activation_bytes(arch, b)` is memory.py's per-token table (no recompute)."""
    if cfg.objective.kind != "distill":
        return []
    d = cfg.distill
    chunk = max(1, lm_loss_chunk_tokens(arch.vocab_size, b, "cuda") // CHUNK_DIVISOR)
    items = [] if d.on_policy else [item_type("distill.chunk", "distillation loss chunk (fp32 teacher and divergence terms)",
                       CHUNK_TENSORS * 4 * min(chunk, t) * arch.vocab_size,
                       f"{CHUNK_TENSORS} x 4 B x {min(chunk, t):,} tokens x {arch.vocab_size:,}", "-")]
    if not d.on_policy and (d.teacher == "precomputed" or d.top_k):
        k = max(d.top_k, 1)
        items.append(item_type("distill.topk", f"teacher top-{k} of a microbatch", t * (12 * k + 4),
                               f"{t:,} tokens x (12 x {k} + 4) B", "distill.top_k; training.micro_batch_size"))
    if d.teacher != "model":
        return items
    from gptoss_cli.recipe.teacher import teacher_architecture  # noqa: PLC0415

    known = teacher_architecture(cfg)
    if known is None:
        notes.append("the teacher's parameters are not counted: its architecture is unknown here (set "
                     "distill.teacher_preset, or make distill.teacher_checkpoint readable)")
        return items
    teacher, pattern = known
    tb = DTYPE_BYTES[d.teacher_dtype or cfg.precision.params_dtype]
    layout = parameter_layout(teacher, pattern, max(1, teacher.num_local_experts // ep))
    expert_w = [p for p in layout if p.expert and p.name.endswith(("linear_fc1.weight", "linear_fc2.weight"))]
    mx = sum(p.numel for p in expert_w) if d.teacher_experts == "mxfp4" else 0
    rest = sum(p.numel for p in layout) - mx
    what = f"{tb} B x {rest:,}" + (f" + {MXFP4_BITS / 8} B x {mx:,} MXFP4 expert weights" if mx else "")
    items.append(item_type("distill.teacher", f"teacher model (frozen{', experts MXFP4' if mx else ''})",
                           tb * rest + mx * MXFP4_BITS / 8, what,
                           "distill.teacher_experts=mxfp4; parallelism.expert_model_parallel_size; "
                           "distill.teacher=precomputed (no teacher on the GPU)"))
    if mx:
        largest = max(p.numel for p in expert_w)
        items.append(item_type("distill.teacher_decode", "teacher: one expert layer decoded for a GEMM",
                               tb * largest, f"{tb} B x {largest:,}", "parallelism.expert_model_parallel_size"))
    per_token = activation_bytes(teacher, tb)
    layer = max(per_token[s] for s in per_token if s not in ("head", "logits"))
    items.append(item_type("distill.teacher_forward", "teacher forward (no grad): one layer's working set",
                           t * layer, f"{t:,} tokens x {layer:,.0f} B", "training.micro_batch_size"))
    if not d.top_k and not d.on_policy:
        items.append(item_type("distill.teacher_hidden", "teacher final hidden states of a microbatch",
                               t * teacher.hidden_size * tb, f"{t:,} tokens x {teacher.hidden_size} x {tb} B",
                               "distill.top_k > 0 (the teacher's top-K instead)"))
    return items


__all__ = ["distill_items"]
