"""The recipe's `rl` section: GRPO's prompts, rewards, loss, the trainer/engine mismatch corrections, routing replay
and the rollout engine (objective.kind=grpo, docs/rl.md; gptoss_cli/rl/)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from gptoss_cli.limits import INT32_MAX, SEED_MAX
from gptoss_cli.recipe.field_spec import spec as _f

# GRPO's loss normalisations, as TRL names them (docs/rl.md)
RL_LOSSES = ("grpo", "dapo", "dr_grpo")
ROLLOUT_ENGINES = ("gptoss", "vllm")
# what the trainer's MoE layers route a rollout's tokens to (docs/rl.md, "Routing replay")
ROUTING_REPLAY = ("none", "rollout", "old_policy")
# the trainer/engine importance-sampling corrections (gptoss_cli/rl/importance.py, docs/rl.md)
IS_CORRECTIONS = ("tis", "mis", "icepop", "seq_tis", "seq_mis", "none")
IS_SEQUENCE_RATIOS = ("geometric", "product")


@dataclass
class RolloutConfig:
    engine: str = _f("gptoss", "what samples the completions: gptoss (generate's KV cache on the training model, on "
                     "every rank) or vllm (vLLM in its own interpreter, fed by rank 0, the policy's weights pushed "
                     "after every update)", choices=ROLLOUT_ENGINES)
    engine_python: Optional[str] = _f(None, "vllm: the Python of the engine's venv; null = $GPTOSS_ENGINE_PYTHON")
    dtype: Optional[str] = _f(None, "vllm: what the engine computes in; null = precision.params_dtype",
                              choices=(None, "float32", "bfloat16"))
    stage_dir: Optional[str] = _f(
        None, "vllm: the folder each push writes the policy's served weights to for the engine to load (a folder "
        "gptoss-rl-weights-PID-* made there, removed when the run ends however it ends; room for two copies in the "
        "engine's dtype: about 84 GB for gpt-oss-20b in bf16); null = $TMPDIR")
    batch_size: Optional[int] = _f(
        None, "gptoss: completions decoded at once per rank (the KV cache holds this many rows); null = all of the "
        "rank's completions of a rollout", min=1, max=INT32_MAX)
    mismatch_warn: float = _f(1.0e-3, "mismatch_kl (engine vs trainer, per token) above which a step warns, naming "
                              "the likely source", min=0.0)
    gpu_memory_utilization: float = _f(
        0.0, "vllm on the training GPUs: the share of each GPU's memory the engine takes (vLLM's own setting; the "
        "memory estimate counts it); 0 = the engine runs elsewhere", min=0.0, max=1.0)


@dataclass
class RLConfig:
    prompts: Optional[str] = _f(
        None, "objective.kind=grpo: the prompts, conversations in the SFT data's JSON forms (JSONL, one per line) "
        "ending before the assistant's turn; a record's other fields (e.g. answer) go to the reward; "
        "builtin:arithmetic = 256 generated sums with their answers")
    tokenizer: Optional[str] = _f(None, "tokenizer.json that renders the prompts; null = checkpoint.pretrained's")
    reward: str = _f("exact_answer", "module:function called as fn(prompt_messages, completion_text, completion_ids, "
                     "record) -> float, or a built-in: exact_answer (final-channel text equals record['answer']), "
                     "harmony_format (well-formed harmony ending on the final channel), even_tokens (share of even "
                     "token ids, a toy)")
    group_size: int = _f(8, "completions sampled per prompt; advantages are relative to the prompt's group",
                         min=2, max=INT32_MAX)
    steps_per_rollout: int = _f(1, "optimizer steps made on each rollout batch (training.global_batch_size "
                                "completions each); a rollout samples global_batch_size x steps_per_rollout "
                                "completions", min=1, max=INT32_MAX)
    max_new_tokens: int = _f(256, "most tokens sampled per completion", min=1, max=INT32_MAX)
    temperature: float = _f(1.0, "sampling temperature; the policy trained is softmax(logits / temperature)",
                            min=0.0)
    top_p: float = _f(1.0, "nucleus sampling: the smallest set of most likely tokens whose probability reaches "
                      "top_p", min=0.0, max=1.0)
    seed: Optional[int] = _f(None, "sampling seed; null = training.seed", min=0, max=SEED_MAX)
    loss: str = _f("grpo", "grpo = per-completion token mean, then the mean over completions; dapo = mean over every "
                   "completion token of the step; dr_grpo = token sum / (completions x max_new_tokens)",
                   choices=RL_LOSSES)
    scale_rewards: bool = _f(True, "divide each advantage by its group's reward standard deviation (+1e-4); "
                             "Dr. GRPO: false")
    clip_low: float = _f(0.2, "PPO clip: the ratio is held above 1 - clip_low", min=0.0, below=1.0)
    clip_high: float = _f(0.2, "PPO clip: the ratio is held below 1 + clip_high (DAPO: 0.28)", min=0.0)
    kl_coeff: float = _f(0.0, "weight of the per-token KL to the reference policy (the initial weights; under LoRA "
                         "the base with the adapters off); 0 = off", min=0.0)
    kl_unbiased: bool = _f(True, "multiply the KL term by the ratio p / p_old, which makes its gradient the unbiased "
                           "reverse-KL gradient (DeepSeek-V3.2; TRL's use_bias_correction_kl); false = GRPO's plain k3 "
                           "estimator")
    # --- the trainer/engine mismatch (docs/rl.md, "Importance-sampling corrections") ---
    is_correction: str = _f("tis", "how each token's loss is weighted by rho = p_trainer / p_engine of the sampled "
                            "token: tis (clamp(rho, is_min, is_max)), mis (rho, 0 above is_max), icepop (rho, 0 "
                            "outside [is_min, is_max]), seq_tis / seq_mis (the completion's ratio, rl.is_sequence_ratio, "
                            "truncated / masked alike on every token), none (TRL's vLLM importance-sampling modes)",
                            choices=IS_CORRECTIONS)
    is_max: float = _f(3.0, "upper bound of the importance ratio (TRL's vllm_importance_sampling_clip_max)", min=1.0)
    is_min: Optional[float] = _f(None, "lower bound of the importance ratio (TRL's vllm_importance_sampling_clip_min); "
                                 "null = none; icepop needs one (IcePop: 0.5)", min=0.0, max=1.0)
    is_sequence_ratio: str = _f("geometric", "seq_tis / seq_mis: the completion's ratio is the geometric mean of its "
                                "tokens' (exp of the mean log-ratio) or their product (TRL's sequence modes)",
                                choices=IS_SEQUENCE_RATIOS)
    save_rollouts: bool = _f(False, "write each rollout batch to logging.run_dir/rollouts/ as Parquet (prompts, "
                             "completions, rewards, advantages, engine and trainer log-probs, IS weights, routes; "
                             "pyarrow: the datasets extra); `gptoss report` summarises them")
    # --- routing replay (docs/rl.md, "Routing replay") ---
    routing_replay: str = _f("none", "which experts the trainer's MoE layers send a rollout's tokens to: none (their "
                             "own live top-k), rollout (the experts the rollout engine used, R3; needs an engine that "
                             "reports them), old_policy (the trainer's own at the rollout's weights, for every update "
                             "of the rollout: rl.steps_per_rollout > 1); the combine weights are the live router's "
                             "softmax at those experts either way", choices=ROUTING_REPLAY)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
