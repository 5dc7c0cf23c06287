"""Per-GPU memory of a recipe at its layout, from formulas: what validate-config and train's pre-flight
check judge (rule `memory.fits`) and what bench/scale.py prints next to the real buffers.

Pure Python: validation must not need torch. The layout is gptoss train's (PP x DP x EP x CP, no TP):

- Parameters and gradients live in one flat buffer per reduction group (dense: DP = world;
  experts: expert-DP = world / EP), of the parameters' dtype and of fp32 (`main_grad`; the params
  dtype with `optimizer.grad_reduce_in_fp32=false`), split into
  buckets of whole parameters, each padded to a multiple of ALIGN x shards elements
  (gptoss_cli/parallel/grads.py; `buffer_numel` mirrors its layout exactly).
- The optimizer keeps an fp32 master copy and two fp32 Adam moments (12 bytes per element) of its
  shard of every bucket: 1/DP of the dense buffer and 1/expert-DP of the expert buffer with
  `optimizer.use_distributed_optimizer`, all of both without it.
- Activations per microbatch: what autograd saves for backward, per token, summed over layers
  (`activation_bytes_per_token`; t = micro_batch_size x seq_length tokens; b = bytes of the
  params dtype). Attention's core is counted as a fused kernel (q, k, v, output, log-sum-exp), the
  GPU path; the CPU's math path also saves the attention probabilities. The overlap schedule
  (combined 1F1B) holds one more layer of another microbatch. FP8 recipes are estimated as if the
  saved activations were in the params dtype (an upper bound).
- Recompute (`recompute` section, gptoss_cli/model/recompute.py): selective pieces shrink their
  layer kinds' bytes per token (`activation_bytes_per_token(..., modules)`); a full unit keeps only
  its input (b*h per token) and its layers' activations come back, one unit at a time, during its
  backward (the largest unit is counted once on top).
- The LM head and loss run a GPU's chunk of tokens at a time (gptoss_cli/model/loss_chunk.py: 1280
  at GPT-OSS's vocabulary in bf16) with their gradients computed in the forward pass (`gptoss_cli.model.hybrid`): one chunk's logits and fp32 loss tensors, the output
  layer's gradient (an fp32 accumulator, then its params-dtype copy held until backward) and the
  hidden states' gradient (b*h per token, counted with the head).
- Transients: the largest parameter's gradient before it is added into its buffer.
- LoRA: the frozen base in the params dtype (no gradient, no optimizer state) and the adapters as
  parameters; with `lora.base_experts=mxfp4` the expert weights at 4.25 bits each plus one expert
  layer's weight decoded to the params dtype for the GEMM that runs (twice that under MXFP4 QAT).

- Pipeline parallelism (gptoss_cli/schedule/pipeline/layout.py): every pipeline rank holds the parameters of its
  stages' layers (the embedding on the first stage's rank, the final norm and output layer on the
  last's), its buffers reduced over the stage's world / PP ranks; its activations are those of its
  layers times the microbatches in flight at its peak (`in_flight`: the first rank of 1F1B holds PP),
  the head's only on the last stage's rank. The estimate is that of the largest rank; `stages` lists
  every rank's.

- checkpoint.async_save (train/async_save.py): a save's staged copy in host memory (`host_items`, not
  counted against the GPU): what the checkpoint holds of the rank, its parameters' buffers (a LoRA run's
  adapters) and its optimizer state, as the items above count them (DCP's stager copies whole storages, and
  fp32 parameters are their own master weights: one copy). Kept from one save to the next; per host, times
  the ranks on it. On the CPU (system.device=cpu) host memory is the device's.

- GRPO (objective.kind=grpo, recipe/estimate/memory_rl.py): the rollout's KV cache with the gptoss engine, the
  vLLM engine's share of the GPU when it runs on the training GPUs, the KL reference of full fine-tuning.
- DPO (objective.kind=dpo, recipe/estimate/memory_dpo.py): the frozen reference model of full fine-tuning with
  dpo.reference=model.
- Distillation (objective.kind=distill, recipe/estimate/memory_distill.py): a model teacher's parameters (its own
  architecture, MXFP4 experts allowed) and forward, the teacher's top-K or hidden states of a microbatch, the loss chunk.

Not included: the CUDA context, NCCL and allocator slack; the 90% warning leaves room for them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from gptoss_cli.buckets import ALIGN, default_bucket_size
from gptoss_cli.model.catalog import SLIDING_QUERY_BLOCK
from gptoss_cli.model.config import GptOssArch
from gptoss_cli.model.loss_chunk import LM_LOSS_CHUNK_TOKENS as LM_LOSS_CHUNK  # noqa: F401 (tests read it here)
from gptoss_cli.model.loss_chunk import lm_loss_chunk_tokens
from gptoss_cli.model.pattern import ATTENTION, MLP, MOE, HybridPattern
from gptoss_cli.model.recompute_plan import RecomputePlan
from gptoss_cli.recipe.estimate.memory_dpo import dpo_items
from gptoss_cli.recipe.estimate.memory_distill import distill_items
from gptoss_cli.recipe.estimate.memory_rl import rl_items
from gptoss_cli.recipe.estimate.parameters import ParamSpec, buffer_numel, lora_layout, parameter_layout
from gptoss_cli.recipe.schema import RecipeConfig

GB = 1e9
# Memory of one GPU of each `system.gpu` generation, in GB (10^9 bytes), as the vendors state it.
GPU_MEMORY_GB = {"h100": 80, "h200": 141, "b200": 180, "gb200": 186, "gb300": 288}
WARN_FRACTION = 0.9
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
FP32 = 4
ADAM_STATE_BYTES = 3 * FP32  # fp32 master, exp_avg, exp_avg_sq
# fp32 parameters are their own master weights (train/optimizer.py): only the two moments
ADAM_MOMENT_BYTES = 2 * FP32
MXFP4_BITS = 4 + 8 / 32  # per weight: an E2M1 code, and one E8M0 scale per 32 (gptoss_cli/model/mxfp4/experts.py)


def size_text(n: float) -> str:
    """Bytes in GB, MB or KB (powers of 10), or B."""
    for unit, scale in (("GB", GB), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


# --- activations ----------------------------------------------------------------------------------
def attention_head_dim_padded(head_dim: int) -> int:
    """q and k carry one extra feature for the sinks, padded to a multiple of 8 (model/attention/sink_padded.py)."""
    return -(-(head_dim + 1) // 8) * 8


def attention_core_bytes_per_token(arch: GptOssArch, b: int) -> float:
    """What a fused attention kernel saves per token: q, k and v with the sink feature (head dim d'
    = head_dim + 1 padded to 8) and its d'-wide output in the params dtype, the fp32 log-sum-exp per
    head. A sliding-window layer runs per query block (model/attention/masks.py) and each block holds its
    own copy of the keys and values it sees, its block and the window before it: k and v count
    (block + window) / block times, at most twice; the bound of the worst layer is used for all."""
    nh, kv, d = arch.num_attention_heads, arch.num_key_value_heads, arch.head_dim
    dp = attention_head_dim_padded(d)
    copies = 1.0
    if any(arch.is_sliding(i) for i in range(arch.num_hidden_layers)):
        copies += arch.sliding_window / max(SLIDING_QUERY_BLOCK, arch.sliding_window)
    return b * (2 * nh * dp + copies * 2 * kv * dp) + 4 * nh


def activation_bytes_per_token(arch: GptOssArch, b: int, aux_loss: bool, modules: frozenset[str] | set[str] = frozenset()
                               ) -> dict[str, float]:
    """Bytes autograd saves per token for each layer kind (b = bytes of the params dtype).

    norm (fp32 RMSNorm): the fp32 input and the fp32 normalised input          8h
    attention (`*`):  norm + qkv GEMM input b*h + fused attention's q (nh x d'), k and v (kv x d',
                      up to twice in sliding layers), output (nh x d') in b, log-sum-exp 4*nh;
                      out-projection input b*nh*d  (d = head_dim, d' = head_dim + 1 padded to 8)
    MoE (`E`):        norm + router input b*h + per routed copy (k of them): fc1 input b*h,
                      fc1 output b*2I (all the clamped SwiGLU saves: its backward recomputes
                      from it), the activation = fc2 input b*I, fc2 output b*h
                      (kept for the routing weight) and the weighted rows b*h (index_add keeps
                      its source), permutation indices 2*8, routing weight b; top-k indices 8k
                      and weights b*k; with the aux loss the fp32 router probabilities 4E
    dense MLP (`-`):  norm + fc1 input b*h + fc1 output b*2I + the activation = fc2 input b*I
    head:             final norm + the gradient of its output b*h, which the chunked loss
                      computes in the forward pass and holds until backward
    logits (per token of one chunk, not of the microbatch): the chunk's logits b*V, cross-entropy's
                      fp32 log-probabilities 4V and the fp32 gradients 2*4V

    Selective recompute `modules` (model/recompute.py) take away:
    layernorm:  the norm's fp32 tensors 8h (its input b*h is kept instead of its output, same size)
    core_attn:  the fused core's tensors, keeping q, k and v (b*(nh + 2*kv)*d)
    moe_act:    the activation b*I per routed copy
    moe:        fc1's output and the activation, 3*b*I per routed copy (the experts' input stays)
    mlp:        everything of a dense layer but its input b*h
    """
    h, i, v, k, e = arch.hidden_size, arch.intermediate_size, arch.vocab_size, arch.num_experts_per_tok, arch.num_local_experts
    nh, kv, d = arch.num_attention_heads, arch.num_key_value_heads, arch.head_dim
    norm = 0 if "layernorm" in modules else 8 * h
    core = b * (nh + 2 * kv) * d if "core_attn" in modules else attention_core_bytes_per_token(arch, b)
    expert_mid = 0 if "moe" in modules else (2 * b * i + (0 if "moe_act" in modules else b * i))
    return {
        ATTENTION: norm + b * h + core + b * nh * d,
        MOE: norm + b * h + k * (b * h + expert_mid + 2 * b * h + 2 * 8 + b) + 8 * k + b * k
        + (4 * e if aux_loss else 0),
        MLP: b * h if "mlp" in modules else norm + b * h + 2 * b * i + b * i,
        "head": 8 * h + b * h,
        "logits": b * v + 4 * v + 2 * 4 * v,  # per token of one LM-head chunk (model/loss_chunk.py)
    }


def recompute_plan(cfg: RecipeConfig, pattern: HybridPattern) -> RecomputePlan:
    """The recipe's `recompute` section as the plan the model runs (model/recompute_plan.py)."""
    r = cfg.recompute
    return RecomputePlan.from_settings(r.recompute_granularity, r.recompute_modules, r.recompute_method,
                                       r.recompute_num_layers, len(pattern.layers))


# --- the estimate ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class MemoryItem:
    key: str
    label: str
    bytes: float
    formula: str
    knobs: str  # the recipe fields that shrink it


@dataclass
class MemoryEstimate:
    """Per-GPU memory of one rank (every rank holds the same amounts in this layout)."""

    items: list[MemoryItem]
    world_size: int
    ep_size: int
    dp_size: int
    expert_dp_size: int
    tokens_per_microbatch: int
    buckets: dict[str, int]
    gpu: str = "auto"
    capacity_bytes: float | None = None
    notes: list[str] = field(default_factory=list)
    pp_size: int = 1
    pipeline_rank: int = 0  # with PP > 1, the rank these items are of: the one that needs the most
    stages: list[dict[str, Any]] = field(default_factory=list)  # every pipeline rank: its stages, total
    host_items: list[MemoryItem] = field(default_factory=list)  # per rank in host memory, not the GPU's

    @property
    def host_bytes(self) -> float:
        return sum(it.bytes for it in self.host_items)

    @property
    def total_bytes(self) -> float:
        return sum(it.bytes for it in self.items)

    def bytes_of(self, prefix: str) -> float:
        return sum(it.bytes for it in self.items if it.key == prefix or it.key.startswith(prefix + "."))

    @property
    def fraction(self) -> float | None:
        return self.total_bytes / self.capacity_bytes if self.capacity_bytes else None

    def biggest(self, n: int = 3) -> list[MemoryItem]:
        return sorted(self.items, key=lambda it: -it.bytes)[:n]

    def summary(self) -> str:
        """One line: total, the GPU's share, the biggest items."""
        cap = (f" of the {self.gpu.upper()}'s {self.capacity_bytes / GB:.0f} GB ({100 * self.fraction:.0f}%)"
               if self.capacity_bytes else "")
        top = ", ".join(f"{it.label} {size_text(it.bytes)}" for it in self.biggest(3))
        where = f" (pipeline rank {self.pipeline_rank} of {self.pp_size}, the largest)" if self.pp_size > 1 else ""
        host = "".join(f"; host memory per rank: {it.label} {size_text(it.bytes)}" for it in self.host_items)
        return f"{size_text(self.total_bytes)} per GPU{where}{cap}; biggest: {top}{host}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "total_gb": self.total_bytes / GB,
            "capacity_gb": self.capacity_bytes / GB if self.capacity_bytes else None,
            "fraction": self.fraction,
            "gpu": self.gpu,
            "world_size": self.world_size, "ep_size": self.ep_size, "dp_size": self.dp_size,
            "expert_dp_size": self.expert_dp_size, "tokens_per_microbatch": self.tokens_per_microbatch,
            "buckets": dict(self.buckets),
            "items": [{**asdict(it), "gb": it.bytes / GB} for it in self.items],
            "notes": list(self.notes),
            "pp_size": self.pp_size, "pipeline_rank": self.pipeline_rank, "stages": list(self.stages),
            "host_items": [{**asdict(it), "gb": it.bytes / GB} for it in self.host_items],
            "host_gb": self.host_bytes / GB,
        }


def _is_expert_weight(spec: ParamSpec) -> bool:
    return spec.expert and spec.name.endswith(("linear_fc1.weight", "linear_fc2.weight"))


def _mxfp4_base_items(cfg: RecipeConfig, frozen: list[ParamSpec], b: int, ep_knob: str) -> list[MemoryItem]:
    """A frozen base whose expert weights are MXFP4 (lora.base_experts=mxfp4): those at 4.25 bits per
    weight, the rest in the params dtype, and the one layer's weight decoded for each GEMM."""
    dtype = cfg.precision.params_dtype
    mx_n = sum(p.numel for p in frozen if _is_expert_weight(p))
    rest_n = sum(p.numel for p in frozen if not _is_expert_weight(p))
    largest = max((p.numel for p in frozen if _is_expert_weight(p)), default=0)
    copies = 2 if cfg.precision.qat == "mxfp4" else 1  # QAT's rounded copy of the decoded weight
    return [
        MemoryItem("params.frozen", f"frozen base ({dtype}, experts MXFP4)", b * rest_n + mx_n * MXFP4_BITS / 8,
                   f"{b} B x {rest_n:,} + {MXFP4_BITS / 8} B x {mx_n:,} MXFP4 expert weights", ep_knob),
        MemoryItem("transient.decode", "one expert layer's weight decoded for a GEMM", copies * b * largest,
                   f"{copies} x {b} B x {largest:,}", ep_knob),
    ]


@dataclass(frozen=True)
class RankView:
    """What one pipeline rank holds (the whole model without pipeline parallelism)."""

    layers: frozenset[int] | None = None  # None: every layer
    embedding: bool = True
    head: bool = True
    in_flight: float = 1.0  # microbatches whose activations it holds at its peak (schedule/pipeline/layout.py)
    rank: int = 0
    text: str = ""  # its stages in the layout grammar


def _activation_items(cfg: RecipeConfig, arch: GptOssArch, pattern: HybridPattern, plan: RecomputePlan,
                      t: int, b: int, view: RankView = RankView()) -> list[MemoryItem]:
    """Activations of one microbatch of `t` tokens per rank (times the microbatches a pipeline rank holds
    in flight): each layer kind's saved bytes (less the recomputed pieces), full recompute's unit inputs
    and one unit rebuilt, the head, the chunked logits with the output layer's gradient (last stage only),
    and the overlap schedule's extra layer."""
    aux = cfg.moe.aux_loss_coeff > 0
    lora = cfg.lora.rank > 0
    act_knob = "training.micro_batch_size, training.seq_length, parallelism.context_parallel_size"
    if view.in_flight != 1:
        act_knob += ", parallelism.pipeline_schedule (microbatches in flight)"
    per_token = activation_bytes_per_token(arch, b, aux, plan.modules)
    plain = activation_bytes_per_token(arch, b, aux)
    held = set(range(pattern.num_layers)) if view.layers is None else set(view.layers)
    units = [(s, e) for s, e in plan.full_units if held & set(range(s, e))]
    in_units = {j for s, e in units for j in range(s, e)}
    counts = {s: sum(1 for j, x in enumerate(pattern.layers) if x == s and j in held and j not in in_units)
              for s in (ATTENTION, MOE, MLP)}
    f, times = view.in_flight, (f" x {view.in_flight:g} in flight" if view.in_flight != 1 else "")
    items = []
    names = {ATTENTION: "attention", MOE: "MoE", MLP: "dense MLP"}
    for s in (ATTENTION, MOE, MLP):
        if counts[s]:
            items.append(MemoryItem(f"activations.{names[s].split()[0].lower()}", f"activations, {names[s]} layers",
                                    f * counts[s] * t * per_token[s],
                                    f"{counts[s]} layers x {t:,} tokens x {per_token[s]:,.0f} B{times}", act_knob))
    if units:
        largest = max(sum(plain[pattern.layers[j]] for j in range(s, e) if j in held) for s, e in units)
        items.append(MemoryItem("activations.recompute_inputs", "activations, full recompute unit inputs",
                                f * t * len(units) * b * arch.hidden_size,
                                f"{len(units)} units x {t:,} tokens x {b * arch.hidden_size:,} B{times}", act_knob))
        items.append(MemoryItem("activations.recompute_unit", "activations, 1 unit recomputed in backward",
                                t * largest, f"{t:,} tokens x {largest:,.0f} B",
                                f"{act_knob}; smaller recompute.recompute_num_layers (uniform)"))
    if view.head:
        items += _head_items(cfg, arch, t, b, per_token, f, times, act_knob, lora)
    if cfg.overlap.overlap_moe_expert_parallel_comm:
        layer = max((per_token[s] for s in (ATTENTION, MOE, MLP) if counts[s]), default=0)
        items.append(MemoryItem("activations.overlap", "activations, 1 layer more (overlap)",
                                t * layer, f"{t:,} tokens x {layer:,.0f} B",
                                f"{act_knob}; overlap.overlap_moe_expert_parallel_comm=false"))
    return items


def _head_items(cfg: RecipeConfig, arch: GptOssArch, t: int, b: int, per_token: dict[str, float], f: float,
                times: str, act_knob: str, lora: bool) -> list[MemoryItem]:
    """The head's activations (of every microbatch in flight) and one chunk's logits with the output
    layer's gradient."""
    items = [MemoryItem("activations.head", "activations, head", f * t * per_token["head"],
                        f"{t:,} tokens x {per_token['head']:,.0f} B{times}", act_knob)]
    chunk = min(t, lm_loss_chunk_tokens(arch.vocab_size, b, "cuda"))  # the GPU's chunk
    head_n = arch.vocab_size * arch.hidden_size
    head_grad = 0 if lora else (FP32 + b) * head_n  # a frozen output layer has no gradient
    items.append(MemoryItem("activations.logits", "logits and loss (chunked) + output-layer gradient",
                            chunk * per_token["logits"] + head_grad,
                            f"{chunk:,} tokens x (b + 12) x {arch.vocab_size:,} B + (4 + b) B x {head_n:,}",
                            "-"))
    return items


def estimate_memory(cfg: RecipeConfig, arch: GptOssArch, pattern: HybridPattern, world_size: int,
                    gpu: str | None = None, pipeline_rank: int | None = None) -> MemoryEstimate | None:
    """The per-GPU estimate of `cfg` at `world_size` (with PP > 1: of the pipeline rank that needs the
    most, or of `pipeline_rank`; every rank's total in `stages`); None when TP or ETP is above 1 (not what gptoss train runs),
    the sizes do not divide or the pipeline layout does not fit (the rules say why). Under context
    parallel a rank holds S/CP positions of every row (attention: all S positions of h/CP heads, the
    same bytes)."""
    par = cfg.parallelism
    if (par.tensor_model_parallel_size, par.expert_tensor_parallel_size) != (1, 1):
        return None
    cp, ep, pp = par.context_parallel_size, par.expert_model_parallel_size, par.pipeline_model_parallel_size
    if world_size < 1 or world_size % pp or cfg.training.seq_length % cp:
        return None
    stage_world = world_size // pp
    if stage_world % cp or ep < 1 or stage_world % ep or arch.num_local_experts % ep:
        return None
    views = _rank_views(cfg, pattern, stage_world // cp)
    if views is None:
        return None
    estimates = [_rank_estimate(cfg, arch, pattern, world_size, stage_world, gpu, view) for view in views]
    worst = max(estimates, key=lambda e: e.total_bytes) if pipeline_rank is None else estimates[pipeline_rank]
    if pp > 1:
        worst.stages = [{"rank": v.rank, "stages": v.text, "in_flight": v.in_flight, "total_bytes": e.total_bytes}
                        for v, e in zip(views, estimates)]
    return worst


def _rank_views(cfg: RecipeConfig, pattern: HybridPattern, data_parallel: int) -> list[RankView] | None:
    """One view per pipeline rank (one whole view without PP); None when the layout does not fit."""
    par, t = cfg.parallelism, cfg.training
    pp, vpp = par.pipeline_model_parallel_size, par.virtual_pipeline_model_parallel_size
    if pp == 1:
        return [RankView()]
    from gptoss_cli.errors import ConfigError
    from gptoss_cli.schedule.pipeline.layout import in_flight, pipeline_layout

    try:
        layout = pipeline_layout(pattern, pp, vpp, par.pipeline_schedule, par.pipeline_model_parallel_layout)
    except ConfigError:
        return None
    step = t.micro_batch_size * data_parallel
    microbatches = max(1, t.global_batch_size // step) if step else 1
    views = []
    for rank in range(pp):
        stages = layout.rank_stages(rank)
        views.append(RankView(layers=frozenset(layout.rank_layers(rank)), embedding=any(s.embedding for s in stages),
                              head=any(s.loss for s in stages), rank=rank, text=" + ".join(s.text() or "-" for s in stages),
                              in_flight=in_flight(par.pipeline_schedule, pp, vpp, microbatches, rank)))
    return views


def _rank_estimate(cfg: RecipeConfig, arch: GptOssArch, pattern: HybridPattern, world_size: int, stage_world: int,
                   gpu: str | None, view: RankView) -> MemoryEstimate:
    """The estimate of one rank holding `view` of the model, its buffers reduced over `stage_world` ranks."""
    par = cfg.parallelism
    cp, ep = par.context_parallel_size, par.expert_model_parallel_size
    b = DTYPE_BYTES[cfg.precision.params_dtype]
    dp, edp = stage_world, stage_world // ep
    opt = cfg.optimizer
    distributed = opt.use_distributed_optimizer
    layers = None if view.layers is None else set(view.layers)
    layout = parameter_layout(arch, pattern, arch.num_local_experts // ep, layers=layers, embedding=view.embedding,
                              head=view.head)
    lora = cfg.lora.rank > 0
    frozen_layout = layout
    frozen_n = sum(p.numel for p in layout) if lora else 0
    if lora:  # a frozen base (no gradient, no optimizer state): buffers hold the adapters only
        layout = lora_layout(arch, pattern, cfg.lora.rank, cfg.lora.target_modules, arch.num_local_experts // ep,
                             layers=layers)
    dense_numels = [p.numel for p in layout if not p.expert]
    expert_numels = [p.numel for p in layout if p.expert]
    dense_shards, expert_shards = (dp, edp) if distributed else (1, 1)
    dense_n, dense_buckets = (buffer_numel(dense_numels, dense_shards, opt.bucket_size or default_bucket_size(dp))
                              if dense_numels else (0, 0))
    expert_n, expert_buckets = (buffer_numel(expert_numels, expert_shards, opt.bucket_size or default_bucket_size(edp))
                                if expert_numels else (0, 0))
    t = cfg.training.micro_batch_size * cfg.training.seq_length // cp  # this rank's tokens of a microbatch
    notes = []
    try:
        plan = recompute_plan(cfg, pattern)
    except ValueError:  # incomplete full-recompute settings: rule recompute.settings reports them
        plan = RecomputePlan()
        notes.append("recompute settings are incomplete (rule recompute.settings): estimated without recompute")
    items = _state_items(cfg, b, dense_n, expert_n, dense_shards, expert_shards)
    if lora:
        ep_knob = "parallelism.expert_model_parallel_size (fewer experts per GPU)"
        dtype = cfg.precision.params_dtype
        items[0] = MemoryItem("params", f"LoRA adapters ({dtype})", b * (dense_n + expert_n),
                              f"{b} B x ({dense_n:,} dense + {expert_n:,} expert adapter elements)", "lora.rank")
        if cfg.lora.base_experts == "mxfp4":
            items[0:0] = _mxfp4_base_items(cfg, frozen_layout, b, ep_knob)
        else:
            items.insert(0, MemoryItem("params.frozen", f"frozen base ({dtype})", b * frozen_n,
                                       f"{b} B x {frozen_n:,} elements", ep_knob))
    items += _activation_items(cfg, arch, pattern, plan, t, b, view)
    largest = max((p.numel for p in layout), default=0)  # none: LoRA without targets
    items.append(MemoryItem("transient.grad", "largest parameter .grad", b * largest,
                            f"{b} B x {largest:,}", "-"))
    if cfg.precision.fp8_recipe != "none":
        notes.append("FP8: saved activations estimated in the params dtype (an upper bound)")
    if plan.enabled:
        in_units = sum(e - s for s, e in plan.full_units)
        what = (f"selective: {', '.join(sorted(plan.modules))}" if plan.modules
                else f"full: {len(plan.full_units)} units of {in_units} layers")
        notes.append(f"activation recompute ({what}) is modelled")
    gpu = gpu or cfg.system.gpu
    cap = GPU_MEMORY_GB.get(gpu)
    items += rl_items(cfg, arch, pattern, dp, b, cap * GB if cap else None, MemoryItem, notes,
                      rank_params=sum(p.numel for p in frozen_layout))
    items += dpo_items(cfg, b, sum(p.numel for p in frozen_layout), MemoryItem)
    items += distill_items(cfg, arch, t, b, ep, MemoryItem, notes, lambda a, nb: activation_bytes_per_token(a, nb, False))
    return MemoryEstimate(items=items, world_size=world_size, ep_size=ep, dp_size=dp, expert_dp_size=edp,
                          tokens_per_microbatch=t, buckets={"dense": dense_buckets, "expert": expert_buckets},
                          gpu=gpu, capacity_bytes=cap * GB if cap else None, notes=notes,
                          pp_size=par.pipeline_model_parallel_size, pipeline_rank=view.rank,
                          host_items=_staged_items(cfg, items))


def staged_checkpoint_bytes(items: list[MemoryItem]) -> float:
    """What a rank's checkpoint holds, from its items: the trained parameters' buffers and the optimizer state."""
    return sum(it.bytes for it in items if it.key == "params" or it.key.startswith("optimizer."))


def _staged_items(cfg: RecipeConfig, items: list[MemoryItem]) -> list[MemoryItem]:
    """checkpoint.async_save's staged copy (module docstring); none without it or without a checkpoint dir."""
    if not (cfg.checkpoint.async_save and cfg.checkpoint.dir):
        return []
    staged = staged_checkpoint_bytes(items)
    return [MemoryItem("host.checkpoint_staged", "async checkpoint's staged copy", staged,
                       "parameters + optimizer state of the rank (as above)",
                       "checkpoint.async_save=false; more GPUs (a smaller shard per rank)")]


def _state_items(cfg: RecipeConfig, b: int, dense_n: int, expert_n: int, dense_shards: int,
                 expert_shards: int) -> list[MemoryItem]:
    """Parameters, gradients and the Adam state of the rank's buffers."""
    dtype = cfg.precision.params_dtype
    opt = cfg.optimizer
    grad_b = FP32 if opt.grad_reduce_in_fp32 else b  # main_grad's dtype (gptoss_cli/parallel/grads.py)
    ep_knob = "parallelism.expert_model_parallel_size (fewer experts per GPU)"
    shard_knob = ("optimizer.use_distributed_optimizer=true" if not opt.use_distributed_optimizer
                  else "more GPUs (larger data-parallel groups shard it thinner)")
    adam_b = ADAM_MOMENT_BYTES if b == FP32 else ADAM_STATE_BYTES
    adam_what = "2 moments; fp32 parameters are their own master" if b == FP32 else "fp32 master, 2 moments"
    return [
        MemoryItem("params", f"parameters ({dtype})", b * (dense_n + expert_n),
                   f"{b} B x ({dense_n:,} dense + {expert_n:,} expert elements, buckets padded)", ep_knob),
        MemoryItem("grads", f"gradients ({'fp32' if grad_b == FP32 else dtype})", grad_b * (dense_n + expert_n),
                   f"{grad_b} B x ({dense_n:,} + {expert_n:,})",
                   ep_knob + ("; optimizer.grad_reduce_in_fp32=false" if grad_b > b else "")),
        MemoryItem("optimizer.dense", f"Adam state, dense ({adam_what})",
                   adam_b * dense_n / dense_shards, f"{adam_b} B x {dense_n:,} / {dense_shards}", shard_knob),
        MemoryItem("optimizer.expert", f"Adam state, experts ({adam_what})",
                   adam_b * expert_n / expert_shards, f"{adam_b} B x {expert_n:,} / {expert_shards}",
                   f"{ep_knob}; {shard_knob}"),
    ]


__all__ = ["RankView", "GB", "size_text", "GPU_MEMORY_GB", "WARN_FRACTION", "ALIGN", "ParamSpec", "parameter_layout", "lora_layout", "buffer_numel",
           "activation_bytes_per_token", "attention_core_bytes_per_token", "default_bucket_size", "MemoryItem", "MemoryEstimate", "estimate_memory",
           "staged_checkpoint_bytes"]
