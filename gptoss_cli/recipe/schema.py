"""The recipe schema: one dataclass per group, with Megatron's field names, defaults and docs.

Every field carries `metadata["help"]` (shown by `describe_schema`); string fields with a fixed
set of values carry `metadata["choices"]`, and numeric fields the range their consumer accepts in
`metadata["min"]` / `metadata["max"]` (`"below"`: a strict upper bound). Every integer field has a
maximum: sizes that become tensor shapes and counts that become loop bounds stop at INT32_MAX, seeds
at SEED_MAX.
Loading (`gptoss_cli.recipe.load`) checks names, types and choices (and `LoraConfig.pairing_problems`:
LoRA targets with lora.rank=0 are malformed, exit 2); the bounds and everything else that relates
two fields are rules (`gptoss_cli.recipe.rules`), so they come back as findings.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from gptoss_cli.fp8.catalog import FORMATS as FP8_FORMATS, RECIPES as FP8_RECIPES
from gptoss_cli.limits import INT32_MAX, SEED_MAX
from gptoss_cli.model.catalog import (ATTENTION_BACKEND_DEFAULT, ATTENTION_BACKENDS, SWIGLU_KERNEL_DEFAULT,
                                      SWIGLU_KERNELS, TARGET_MODULES as LORA_TARGETS)
from gptoss_cli.model.dtypes import RECIPE_DTYPES
from gptoss_cli.schedule.pipeline.layout import SCHEDULES as PIPELINE_SCHEDULES
from gptoss_cli.recipe.field_spec import spec as _f
from gptoss_cli.recipe.schema_dpo import DPO_LOSSES, DPO_REFERENCES, DPOConfig
from gptoss_cli.recipe.schema_distill import DISTILL_LOSSES, DISTILL_TEACHERS, DistillConfig
from gptoss_cli.recipe.schema_rl import (IS_CORRECTIONS, IS_SEQUENCE_RATIOS, RL_LOSSES, ROLLOUT_ENGINES,
                                        ROUTING_REPLAY, RLConfig, RolloutConfig)

# A step that makes no progress for a day is a hang whatever the model; the collective timeout is 10 minutes.
HEARTBEAT_MAX_S = 86_400.0


@dataclass
class ModelConfig:
    preset: Optional[str] = _f(
        None, "architecture preset: gpt_oss_20b, gpt_oss_120b or tiny (set this or `checkpoint`)",
        choices=("gpt_oss_20b", "gpt_oss_120b", "tiny", None),
    )
    checkpoint: Optional[str] = _f(
        None, "read the architecture from a checkpoint folder instead: hybrid_config.json "
        "(gptoss convert output) or a Hugging Face config.json; relative to the working directory",
    )
    hybrid_layer_pattern: Optional[str] = _f(
        None, "Megatron hybrid layer pattern; null = '*E' per HF block (the layout convert writes)",
    )
    architecture: Dict[str, Any] = _f(
        help="overrides of GptOssArch fields, e.g. {num_hidden_layers: 2}", factory=dict,
    )
    mtp_num_layers: Optional[int] = _f(
        None, "multi-token-prediction layers; GPT-OSS has none, so null or 0", min=0, max=INT32_MAX,
    )
    swiglu_kernel: str = _f(
        SWIGLU_KERNEL_DEFAULT, "clamped SwiGLU: auto = one compiled (torch.compile) kernel for forward and one for backward "
        "where they work, else eager with a warning; eager = elementwise torch ops (docs/benchmarks.md)",
        choices=SWIGLU_KERNELS,
    )
    attention_backend: str = _f(
        ATTENTION_BACKEND_DEFAULT, "kernel of attention with sinks: auto = per device and layer (CPU: the flash "
        "kernel; CUDA: the flash kernel on full layers, FlexAttention on sliding-window layers and packed "
        "documents); flash = a flash kernel's log-sum-exp rescaled by the sink (CUDA: full layers only); flex = "
        "FlexAttention with a block mask; sdpa = SDPA with the sink as a padded extra key (docs/architecture.md)",
        choices=ATTENTION_BACKENDS,
    )


@dataclass
class ParallelismConfig:
    tensor_model_parallel_size: int = _f(1, "tensor parallel size (TP)", min=1, max=INT32_MAX)
    pipeline_model_parallel_size: int = _f(1, "pipeline parallel size (PP)", min=1, max=INT32_MAX)
    virtual_pipeline_model_parallel_size: Optional[int] = _f(
        None, "virtual pipeline (interleaved) stages per pipeline rank; null = off", min=1, max=INT32_MAX,
    )
    pipeline_schedule: str = _f(
        "1f1b", "pipeline schedule (torch.distributed.pipelining, docs/pipeline-parallel.md): 1f1b; "
        "interleaved_1f1b (VPP >= 2); interleaved_zero_bubble (ZB1P); zbv_zero_bubble and dualpipev "
        "(VPP = 2, two stages per rank in a V)", choices=PIPELINE_SCHEDULES,
    )
    pipeline_model_parallel_layout: Optional[str] = _f(
        None, "the stages in Megatron's --pipeline-model-parallel-layout grammar: E embedding, t one decoder "
        "block (*E), L loss, | stage boundary, X*N repeats, e.g. 'Et*8|t*10|t*10|t*8L'; null = the blocks "
        "split evenly over PP x VPP stages",
    )
    context_parallel_size: int = _f(1, "context parallel size (CP)", min=1, max=INT32_MAX)
    expert_model_parallel_size: int = _f(1, "expert parallel size (EP)", min=1, max=INT32_MAX)
    expert_tensor_parallel_size: int = _f(1, "expert tensor parallel size (ETP)", min=1, max=INT32_MAX)
    sequence_parallel: bool = _f(False, "shard activations along the sequence across TP ranks")
    data_parallel_size: Optional[int] = _f(
        None, "data parallel size; null = derived: world_size / (TP x PP x CP)", min=1, max=INT32_MAX,
    )
    world_size: Optional[int] = _f(None, "total processes; null = nodes x gpus_per_node", min=1, max=INT32_MAX)
    nodes: Optional[int] = _f(None, "number of nodes (with gpus_per_node gives world_size)", min=1, max=INT32_MAX)
    gpus_per_node: Optional[int] = _f(None, "processes per node", min=1, max=INT32_MAX)
    backend: str = _f("auto", "torch.distributed backend; auto = nccl on cuda, gloo on cpu",
                      choices=("auto", "nccl", "gloo"))
    use_megatron_fsdp: bool = _f(False, "Megatron FSDP instead of DDP / distributed optimizer")


@dataclass
class MoEConfig:
    token_dispatcher_type: str = _f("alltoall", "token dispatcher", choices=("alltoall", "flex", "allgather"))
    capacity_factor: Optional[float] = _f(None, "expert capacity factor; null = dropless", min=0.0)
    aux_loss_coeff: float = _f(0.0, "load-balancing aux loss coefficient (0 = off)", min=0.0)
    z_loss_coeff: float = _f(0.0, "router z-loss coefficient, Megatron's moe_z_loss_coeff (0 = off)", min=0.0)
    freeze_router: bool = _f(False, "keep the router weights and biases fixed (fine-tunes that must not move routing)")
    router_dtype: Optional[str] = _f(
        None, "dtype of the router GEMM and softmax; null = the params dtype", choices=(None, "fp32", "fp64"),
    )
    shared_expert_overlap: bool = _f(False, "overlap shared-expert compute with dispatch (needs shared experts)")


@dataclass
class OverlapConfig:
    overlap_moe_expert_parallel_comm: bool = _f(
        False, "overlap EP all-to-all with compute of another microbatch (combined 1F1B, docs/megatron-rules.md)",
    )
    delay_wgrad_compute: bool = _f(
        False, "defer weight-gradient GEMMs into the overlap schedule (needs the overlap flag)",
    )
    overlap_grad_reduce: bool = _f(False, "overlap data-parallel gradient reduction with backward")
    overlap_param_gather: bool = _f(False, "overlap distributed-optimizer parameter all-gather with forward")


@dataclass
class PrecisionConfig:
    params_dtype: str = _f("bf16", "dtype of parameters and activations", choices=RECIPE_DTYPES)
    fp8_recipe: str = _f("none", "FP8 GEMM recipe", choices=("none", *FP8_RECIPES))
    fp8_format: str = _f("e4m3", "FP8 element format (hybrid = e4m3 forward, e5m2 backward)", choices=FP8_FORMATS)
    fp8_emulation: bool = _f(
        False, "allow FP8 to be emulated (quantize-dequantize) where native kernels are unavailable; "
        "numerics only, no speed-up",
    )
    qat: str = _f("none", "quantisation-aware training: mxfp4 computes the experts with their weights rounded "
                  "as `convert --experts mxfp4` writes them (straight-through gradient)", choices=("none", "mxfp4"))


@dataclass
class CudaGraphConfig:
    cuda_graph_impl: str = _f("none", "CUDA graph capture", choices=("none", "local", "full_iteration"))
    cuda_graph_scope: List[str] = _f(
        help="modules captured by local graphs; empty = whole layer", factory=list,
        choices=("attn", "mlp", "moe", "moe_router", "moe_preprocess"),
    )
    paged_stash: bool = _f(False, "paged activation stash for full-iteration graphs")


@dataclass
class RecomputeConfig:
    recompute_granularity: str = _f("none", "activation recompute (docs/recompute.md)",
                                    choices=("none", "full", "selective"))
    recompute_method: Optional[str] = _f(None, "full recompute method", choices=("uniform", "block", None))
    recompute_num_layers: Optional[int] = _f(
        None, "hybrid layers (2 per HF block) per recompute unit (uniform) or recomputed from the first (block)",
        min=1, max=INT32_MAX)
    recompute_modules: List[str] = _f(
        help="selective recompute pieces: attention core, experts' activation, norms, dense MLP, experts' MLP "
             "(not its all-to-all)", factory=list,
        choices=("core_attn", "moe_act", "layernorm", "mlp", "moe"),
    )


@dataclass
class TrainingConfig:
    seq_length: int = _f(4096, "tokens per sample", min=1, max=INT32_MAX)
    micro_batch_size: int = _f(1, "samples per microbatch per data-parallel rank", min=1, max=INT32_MAX)
    global_batch_size: int = _f(8, "samples per optimizer step across all data-parallel ranks", min=1, max=INT32_MAX)
    train_iters: int = _f(1000, "optimizer steps", min=1, max=INT32_MAX)
    lr: float = _f(3.0e-4, "peak learning rate", min=0.0)
    min_lr: float = _f(3.0e-5, "learning rate at the end of decay", min=0.0)
    warmup_iters: int = _f(100, "linear warm-up steps", min=0, max=INT32_MAX)
    lr_decay_style: str = _f("cosine", "decay after warm-up", choices=("cosine", "linear", "constant"))
    lr_decay_iters: Optional[int] = _f(None, "steps over which to decay; null = train_iters", min=1, max=INT32_MAX)
    seed: int = _f(1234, "random seed (model init, mock data, routing ties)", min=0, max=SEED_MAX)


@dataclass
class OptimizerConfig:
    name: str = _f("adamw", "optimizer", choices=("adamw",))
    weight_decay: float = _f(0.1, "AdamW decoupled weight decay", min=0.0)
    adam_beta1: float = _f(0.9, "AdamW beta1", min=0.0, below=1.0)
    adam_beta2: float = _f(0.95, "AdamW beta2", min=0.0, below=1.0)
    adam_eps: float = _f(1.0e-8, "AdamW epsilon", min=0.0)
    clip_grad: float = _f(1.0, "global gradient-norm clip (0 = off)", min=0.0)
    use_distributed_optimizer: bool = _f(False, "shard optimizer state over data-parallel ranks")
    grad_reduce_in_fp32: bool = _f(
        True, "accumulate and reduce gradients in fp32 (false: in the params dtype, half the gradient buffer for bf16)",
    )
    bucket_size: Optional[int] = _f(
        None, "elements per gradient bucket (one reduce-scatter and one all-gather each); "
        "null = Megatron's default, max(40M, 1M x DP)", min=1, max=INT32_MAX,
    )


@dataclass
class BlendSource:
    """One token file of a dataset blend (`data.blend`)."""

    path: str = _f("", "token file prefix (a `gptoss prepare-data` output)")
    weight: float = _f(1.0, "share of the samples drawn from this file (weights are normalised)", min=0.0)


@dataclass
class DataConfig:
    kind: str = _f("mock", "mock = random tokens; tokens = a flat binary token file", choices=("mock", "tokens"))
    path: Optional[str] = _f(
        None, "token file prefix OUT (OUT.bin + OUT.json header, written by `gptoss prepare-data`); kind=tokens",
    )
    blend: List[BlendSource] = _f(
        help="kind=tokens from several token files instead of data.path: a list of {path, weight}; samples are "
        "drawn in proportion to the weights, each file's documents without repetition until it is exhausted "
        "(Megatron's blended dataset; docs/recipes.md)", factory=list,
    )


@dataclass
class CheckpointConfig:
    dir: Optional[str] = _f(None, "where training checkpoints are saved; null = no checkpoints")
    save_interval: Optional[int] = _f(None, "save every N steps (and at the end); null = only at the end", min=1, max=INT32_MAX)
    resume: bool = _f(True, "resume from the latest checkpoint in `dir` if there is one")
    pretrained: Optional[str] = _f(None, "initial weights for fine-tuning (a `gptoss convert` output folder)")
    format: str = _f("gptoss", "checkpoint format", choices=("gptoss", "torch_dist", "fsdp_dtensor"))
    keep_last: Optional[int] = _f(
        None, "keep only the newest N checkpoints of this run (older ones are deleted after each save; `latest` "
        "and the one being written never are); null = keep all", min=1, max=INT32_MAX,
    )
    keep_every: Optional[int] = _f(
        None, "with keep_last, also keep every checkpoint whose step is a multiple of N; null = none extra",
        min=1, max=INT32_MAX,
    )
    async_save: bool = _f(False, "write checkpoints while the next steps run (a host copy, counted in the estimate; "
                          "`latest` moves once one is complete): docs/reliability.md")
    save_on_signal: bool = _f(False, "on SIGTERM / SIGINT every rank finishes the step, saves it and exits 143 / 130; "
                              "false = stop at once (steps since the last save are lost)")
    override_lr_schedule: bool = _f(
        False, "resume with this recipe's learning-rate schedule (training.lr, min_lr, warmup_iters, lr_decay_style, "
        "lr_decay_iters or train_iters) even where it differs from the checkpoint's; false = such a resume is refused",
    )
    override_data: bool = _f(
        False, "resume on this recipe's data (data.kind, path, blend) even where it differs from the checkpoint's "
        "run, carrying on from the checkpoint's position (consumed_samples); false = such a resume is refused",
    )


@dataclass
class LoraConfig:
    rank: int = _f(0, "LoRA rank (Megatron-Bridge's `dim`); 0 = off (full fine-tuning). With a rank the base "
                   "model is frozen and only the adapters train (docs/lora.md)", min=0, max=INT32_MAX)
    alpha: float = _f(32.0, "LoRA alpha; the low-rank path is scaled by alpha / rank (PEFT's convention)", min=0.0)
    dropout: float = _f(0.0, "dropout on an adapter's input during training", min=0.0)
    target_modules: List[str] = _f(
        help="layers that get adapters (Megatron's names); linear_fc1 / linear_fc2 on the experts: one pair per "
        "expert. Empty with a lora.rank: all four that the layer pattern has (Megatron-Bridge's default)",
        factory=list, choices=LORA_TARGETS,
    )
    base_experts: str = _f("bf16", "storage of the frozen experts: bf16 (params_dtype) or mxfp4 (as released, "
                           "dequantised per GEMM)", choices=("bf16", "mxfp4"))

    def pairing_problems(self) -> list[str]:
        """Targets with LoRA off (rank 0) are a contradiction, malformed input like an unknown target:
        load_recipe refuses them (exit 2); so is a rank with alpha 0, whose adapters are scaled by 0 and
        get no gradient (it trains nothing). A rank without targets gets the usual ones when the recipe
        loads (gptoss_cli/recipe/load.py, `default_lora_targets`)."""
        targets = list(self.target_modules)
        if self.rank == 0 and targets:
            return [f"lora.rank=0 turns LoRA off, but lora.target_modules={targets} asks for adapters "
                    "(set lora.rank, e.g. 32, or lora.target_modules=[] for full fine-tuning)"]
        if self.rank > 0 and self.alpha == 0:
            return [f"lora.alpha=0 scales the adapters of lora.rank={self.rank} by alpha / rank = 0: they get no "
                    "gradient and the run trains nothing (set lora.alpha, e.g. 2 x rank, or lora.rank=0)"]
        return []


@dataclass
class ValidationConfig:
    data: Optional[str] = _f(
        None, "held-out token file prefix (a `gptoss prepare-data` output); its loss over the trained tokens is "
        "logged as val_loss, computed as `gptoss eval` computes it; null = no validation",
    )
    interval: Optional[int] = _f(
        None, "validate every N steps (and after the last); null = after the last step only", min=1, max=INT32_MAX,
    )
    iters: Optional[int] = _f(
        None, "batches of training.global_batch_size rows scored per validation, in file order; null = the whole "
        "file", min=1, max=INT32_MAX,
    )


@dataclass
class LoggingConfig:
    log_interval: int = _f(1, "print metrics every N steps", min=1, max=INT32_MAX)
    run_dir: Optional[str] = _f(None, "folder for metrics.jsonl and the resolved recipe; null = runs/<recipe name>")
    tensorboard: bool = _f(False, "also write TensorBoard event files to <run_dir>/tensorboard (extra .[tensorboard])")
    wandb_project: Optional[str] = _f(None, "also log to this Weights & Biases project (extra .[wandb]); null = off")
    wandb_mode: str = _f("online", "Weights & Biases mode; offline writes <run_dir>/wandb without a network",
                         choices=("online", "offline"))


@dataclass
class ServeCheckConfig:
    engine: Optional[str] = _f(None, "at the end of the run, `gptoss serve-check` the final checkpoint with this engine "
                               "and write serve_check.json into the run folder (docs/serve-check.md); a failed check "
                               "ends train with exit 1 after the checkpoint is saved; null = off",
                               choices=(None, "vllm"))
    engine_python: Optional[str] = _f(None, "the Python of the engine's venv; null = $GPTOSS_ENGINE_PYTHON")
    dtype: str = _f("float32", "what the engine computes in", choices=("float32", "bfloat16"))


# What a training step minimises (gptoss_cli/train/objective.py): the kinds of gptoss_cli/run/objectives.py's table.
OBJECTIVES = ("cross_entropy", "grpo", "dpo", "distill")
@dataclass
class ObjectiveConfig:
    kind: str = _f("cross_entropy", "what a step minimises: cross_entropy (pre-training, SFT: the data section), "
                   "grpo (reinforcement learning from rewards of sampled completions: the rl section, docs/rl.md), "
                   "dpo (preference pairs of the data section: the dpo section, docs/dpo.md) or "
                   "distill (a frozen teacher's distributions: the distill section, docs/distill.md)",
                   choices=OBJECTIVES)


@dataclass
class SystemConfig:
    device: str = _f("auto", "where to train; auto = cuda if available", choices=("auto", "cpu", "cuda"))
    gpu: str = _f(
        "auto", "target GPU generation, used by FP8 rules; auto = detect at launch",
        choices=("auto", "none", "a100", "h100", "h200", "b200", "gb200", "gb300"),
    )
    heartbeat_timeout_s: float = _f(
        180.0, "end the job, naming the rank, when a rank makes no progress in a step (or its process stops) "
        "for this many seconds; far below the 10-minute collective timeout", min=1.0, max=HEARTBEAT_MAX_S,
    )


@dataclass
class RecipeConfig:
    name: str = _f("", "recipe name (defaults to the file name)")
    description: str = _f("", "one line about what this recipe is for")
    model: ModelConfig = field(default_factory=ModelConfig)
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)
    overlap: OverlapConfig = field(default_factory=OverlapConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    cuda_graphs: CudaGraphConfig = field(default_factory=CudaGraphConfig)
    recompute: RecomputeConfig = field(default_factory=RecomputeConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    validation: ValidationConfig = field(default_factory=ValidationConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    system: SystemConfig = field(default_factory=SystemConfig)
    serve_check: ServeCheckConfig = field(default_factory=ServeCheckConfig)
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    rl: RLConfig = field(default_factory=RLConfig)
    dpo: DPOConfig = field(default_factory=DPOConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)


def iter_fields(cls: type = RecipeConfig, prefix: str = ""):
    """Yield (dotted name, dataclasses.Field) for every leaf field of the schema."""
    for f in dataclasses.fields(cls):
        name = f"{prefix}{f.name}"
        sub = f.type if isinstance(f.type, type) else None
        if sub is None and isinstance(f.type, str):
            sub = _GROUPS.get(f.type)
        if sub is not None and dataclasses.is_dataclass(sub):
            yield from iter_fields(sub, name + ".")
        else:
            yield name, f


def describe_schema() -> list[tuple[str, str, str]]:
    """(dotted name, default, help) for every field; docs/recipes.md's field table comes from here."""
    rows = []
    for name, f in iter_fields():
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
            default = f.default_factory()  # type: ignore[misc]
        else:  # pragma: no cover - every field has a default
            default = None
        help_text = f.metadata.get("help", "")
        choices = f.metadata.get("choices")
        if choices:
            help_text += " [" + " | ".join("null" if c is None else str(c) for c in choices) + "]"
        rows.append((name, _yaml_text(default), help_text))
    return rows


def _yaml_text(value: Any) -> str:
    """A default as it would be written in a recipe: null, true, 1.0e-08, '', [], {}."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str):
        return value if value else "''"
    return repr(value)


_GROUPS: dict[str, type] = {
    c.__name__: c for c in (
        ModelConfig, ParallelismConfig, MoEConfig, OverlapConfig, PrecisionConfig, CudaGraphConfig,
        RecomputeConfig, TrainingConfig, OptimizerConfig, DataConfig, CheckpointConfig, LoraConfig, ValidationConfig,
        LoggingConfig, SystemConfig, ServeCheckConfig, ObjectiveConfig, RLConfig, RolloutConfig, DPOConfig, DistillConfig,
    )
}

__all__ = [
    "RecipeConfig", "ModelConfig", "ParallelismConfig", "MoEConfig", "OverlapConfig", "PrecisionConfig",
    "CudaGraphConfig", "RecomputeConfig", "TrainingConfig", "OptimizerConfig", "DataConfig",
    "CheckpointConfig", "LoraConfig", "ValidationConfig", "BlendSource", "LoggingConfig", "SystemConfig",
    "ServeCheckConfig", "ObjectiveConfig", "RLConfig", "RolloutConfig", "OBJECTIVES", "RL_LOSSES", "ROLLOUT_ENGINES",
    "ROUTING_REPLAY", "IS_CORRECTIONS", "IS_SEQUENCE_RATIOS",
    "DPOConfig", "DPO_LOSSES", "DPO_REFERENCES",
    "DistillConfig", "DISTILL_LOSSES", "DISTILL_TEACHERS",
    "iter_fields", "describe_schema",
]
