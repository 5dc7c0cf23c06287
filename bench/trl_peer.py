"""TRL's GRPOTrainer as bench/grpo.py's peer: the same model, prompts and GRPO settings as `tiny_cpu_grpo`, timed
per step with the rollout / training split, and the step-1 loss check on one fixed rollout.

The policy both sides train is transformers' GptOssForCausalLM with the tests' random weights
(bench/peers.py), saved as an HF folder with a tiny harmony tokenizer of its vocabulary; gptoss
loads it as `checkpoint.pretrained`. TRL runs with transformers' generation (no vLLM), fp32, on the
CPU, at gptoss's settings: group size 4, 16 completions per optimizer step in two microbatches of 8,
16 new tokens at temperature 1 and top_p 1, loss type grpo, clip 0.2, no KL, AdamW at the recipe's
lr, betas, eps, weight decay and clip, a constant lr, the router's aux loss off on both sides. TRL is
handed gptoss's rendered prompt ids (its `_tokenize_prompts` looks them up) so both sample from the
same prompts; its reward is the same `even_tokens`.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch

from bench import harness
from bench.peers import hf_peer

MICRO_BATCH, STEP_ROWS, GROUP, NEW_TOKENS, SEQ = 8, 16, 4, 16, 160
# The recipe's settings TRL is given (recipes/tiny_cpu_grpo.yaml and its bases)
LR, BETAS, EPS, WEIGHT_DECAY, CLIP_GRAD, CLIP = 2.0e-2, (0.9, 0.95), 1.0e-8, 0.1, 1.0, 0.2


def write_policy(arch, folder: Path) -> Path:
    """The HF folder both sides start from: weights and tokenizer.json."""
    from gptoss_cli.data.tiny_tokenizer import tiny_tokenizer

    folder.mkdir(parents=True, exist_ok=True)
    hf_peer(arch, torch.float32).save_pretrained(folder)
    (folder / "tokenizer.json").write_text(json.dumps(tiny_tokenizer(arch.vocab_size)))
    return folder


def prompt_ids(folder: Path) -> list[list[int]]:
    """The builtin:arithmetic prompts rendered as gptoss renders them for GRPO (rl/prompts.py)."""
    from gptoss_cli.data.harmony import HarmonyTokenizer
    from gptoss_cli.data.tokenizer import read_tokenizer
    from gptoss_cli.rl.prompts import read_records, render_records

    file = folder / "tokenizer.json"
    htok = HarmonyTokenizer(read_tokenizer(file, "bench"), str(file))
    return [list(p.ids) for p in render_records(read_records("builtin:arithmetic"), htok,
                                                max_prompt_tokens=SEQ - NEW_TOKENS)]


def _tokenizer(folder: Path):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"), pad_token="<|endoftext|>",
                                   eos_token="<|return|>")


def _even_tokens(prompts=None, completions=None, completion_ids=None, **_):
    from gptoss_cli.rl.rewards import even_tokens

    return [even_tokens([], "", list(ids), {}) for ids in completion_ids]


def trl_trainer(folder: Path, prompts: list[list[int]], steps: int, out: Path):
    """GRPOTrainer on the policy folder at gptoss's settings; `rollouts` and `steps` collect per-call counters."""
    from datasets import Dataset
    from transformers import GptOssForCausalLM, PrinterCallback, ProgressCallback, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    by_key = {f"prompt {i}": ids for i, ids in enumerate(prompts)}

    class Timed(GRPOTrainer):
        rollouts: list[dict] = []

        def _tokenize_prompts(self, texts):  # gptoss's rendered ids for the same prompts
            return [list(by_key[t]) for t in texts], None, {}

        def _generate_and_score_completions(self, inputs):
            out, metrics = harness.measure(lambda: super(Timed, self)._generate_and_score_completions(inputs))
            metrics["completion_tokens"] = float(out["completion_mask"].sum())
            self.rollouts.append(metrics)
            return out

    class Steps(TrainerCallback):
        def __init__(self):
            self.calls: list[dict] = []
            self._start: tuple[float, dict] | None = None

        def on_step_begin(self, args, state, control, **kw):
            self._start = (harness.cpu_clock(), harness.usage())

        def on_step_end(self, args, state, control, **kw):
            t0, before = self._start
            self.calls.append({"time_s": harness.cpu_clock() - t0, **harness.usage_since(before)})

    args = GRPOConfig(output_dir=str(out), per_device_train_batch_size=MICRO_BATCH,
                      gradient_accumulation_steps=STEP_ROWS // MICRO_BATCH, num_generations=GROUP,
                      max_completion_length=NEW_TOKENS, temperature=1.0, top_p=1.0, beta=0.0, epsilon=CLIP,
                      loss_type="grpo", learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0,
                      max_grad_norm=CLIP_GRAD, adam_beta1=BETAS[0], adam_beta2=BETAS[1], adam_epsilon=EPS,
                      weight_decay=WEIGHT_DECAY, optim="adamw_torch", max_steps=steps, logging_steps=1,
                      report_to=[], use_cpu=True, bf16=False, save_strategy="no", seed=0,
                      dataloader_num_workers=0)
    model = GptOssForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).train()
    data = Dataset.from_dict({"prompt": list(by_key) * (steps * STEP_ROWS // GROUP // len(by_key) + 1)})
    trainer = Timed(model=model, reward_funcs=_even_tokens, args=args, train_dataset=data,
                    processing_class=_tokenizer(folder))
    trainer.aux_loss_enabled = False  # as gptoss's run (moe.aux_loss_coeff=0)
    for quiet in (PrinterCallback, ProgressCallback):  # the bench prints its own table
        trainer.remove_callback(quiet)
    trainer.rollouts = []
    trainer.step_calls = Steps()
    trainer.add_callback(trainer.step_calls)
    return trainer


def trl_step_times(trainer) -> dict[str, list[float]]:
    """Train; per optimizer step: CPU time, user/system seconds, minor faults, the rollout's CPU time and
    completion tokens (the step that generated; one generation per step here)."""
    trainer.train()
    steps, rollouts = trainer.step_calls.calls, trainer.rollouts
    out: dict[str, list[float]] = {k: [c[k] for c in steps] for k in ("time_s", "user_s", "system_s", "minor_faults")}
    out["rollout_s"] = [r["time_s"] for r in rollouts[:len(steps)]]
    out["completion_tokens"] = [r["completion_tokens"] for r in rollouts[:len(steps)]]
    return out


def fixed_rollout(prompts: list[list[int]], vocab: int, seed: int = 5) -> dict[str, Any]:
    """One step's worth of completions fed to both losses: 4 prompts (cut to one length, so no row is
    padded and positions agree on both sides) x 4 completions of 16 random tokens, fixed advantages."""
    g = torch.Generator().manual_seed(seed)
    length = min(len(p) for p in prompts[:STEP_ROWS // GROUP])
    prompt = torch.tensor([p[:length] for p in prompts[:STEP_ROWS // GROUP]]).repeat_interleave(GROUP, 0)
    completion = torch.randint(0, vocab - 32, (STEP_ROWS, NEW_TOKENS), generator=g)
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5] * (STEP_ROWS // 4))
    return {"prompt": prompt, "completion": completion, "advantages": advantages}


def trl_step1_loss(trainer, rollout: dict[str, Any]) -> tuple[float, torch.Tensor]:
    """TRL's GRPO loss of the fixed rollout at the initial weights, old log-probs the current ones +-0.35 (so
    the clip is active), and the current log-probs (what gptoss's side shifts the same way)."""
    model, prompt, completion = trainer.model, rollout["prompt"], rollout["completion"]
    p = prompt.shape[1]
    with torch.no_grad():
        logits = model(input_ids=torch.cat([prompt, completion], 1)).logits[:, p - 1:-1].float()
        current = torch.log_softmax(logits, -1).gather(-1, completion[..., None])[..., 0]
    old = current + _shift(completion.shape)
    mask = torch.ones_like(completion)
    inputs = dict(prompt_ids=prompt, prompt_mask=torch.ones_like(prompt), completion_ids=completion,
                  completion_mask=mask, advantages=rollout["advantages"], old_per_token_logps=old,
                  num_items_in_batch=mask.sum().float())
    trainer.current_gradient_accumulation_steps = 1
    with torch.no_grad():
        loss = trainer.compute_loss(model, inputs)
    return float(loss), old


def _shift(shape) -> torch.Tensor:
    sign = torch.tensor([1.0, -1.0, 1.0])[torch.arange(shape[0] * shape[1]) % 3].reshape(shape)
    return 0.35 * sign


def gptoss_step1_loss(folder: Path, arch, rollout: dict[str, Any], old: torch.Tensor) -> float:
    """gptoss's GRPO loss of the same rollout and old log-probs, through the training path (the plain
    schedule over two microbatches) on the model loaded from the same folder."""
    from gptoss_cli.model.pattern import default_pattern
    from gptoss_cli.parallel.grads import get_model_config
    from gptoss_cli.parallel.state import init_parallel
    from gptoss_cli.recipe import load_recipe
    from gptoss_cli.rl.batch import SampledCompletion, completion_rows
    from gptoss_cli.rl.objective import GRPOObjective
    from gptoss_cli.schedule import get_forward_backward_func
    from gptoss_cli.train.provider import HybridModelProvider, ModelRuntimeConfig
    from gptoss_cli.train.setup import setup_model_and_optimizer

    cfg = load_recipe("tiny_cpu_grpo", ["moe.aux_loss_coeff=0", f"checkpoint.pretrained={folder}"]).config
    state = init_parallel(1, "cpu")
    runtime = ModelRuntimeConfig.from_recipe(cfg, arch, default_pattern(arch))
    setup = setup_model_and_optimizer(HybridModelProvider(runtime, seed=0, weights=str(folder)), state,
                                      cfg.optimizer, LR)
    prompt, completion, adv = rollout["prompt"], rollout["completion"], rollout["advantages"].tolist()
    p = prompt.shape[1]
    comps = [SampledCompletion(0, prompt[i].tolist(), completion[i].tolist(), [0.0] * NEW_TOKENS)
             for i in range(STEP_ROWS)]
    mbs = []
    for start in range(0, STEP_ROWS, MICRO_BATCH):
        rows = slice(start, start + MICRO_BATCH)
        mb = completion_rows(comps[rows], adv[rows], SEQ, torch.device("cpu"))
        at = torch.zeros_like(mb.extras["rollout_logp"])
        at[:, p - 1:p - 1 + NEW_TOKENS] = old[rows]
        mb.extras["old_logp"] = mb.extras["rollout_logp"] = at
        mbs.append(mb)
    objective = GRPOObjective(loss_type="grpo", clip_low=CLIP, clip_high=CLIP, temperature=1.0,
                              max_new_tokens=NEW_TOKENS)
    schedule = get_forward_backward_func(get_model_config(setup.model))
    with torch.no_grad():
        logs = schedule(forward_step_func=objective.forward_step, data_iterator=iter(mbs), model=setup.model,
                        num_microbatches=len(mbs), forward_only=True)
    sums = {k: float(sum(float(log[k]) for log in logs if k in log)) for k in objective.sums}
    return objective.metrics(sums)["loss"]


def step1_check(trainer, folder: Path, arch, prompts: list[list[int]]) -> dict[str, float]:
    """Both losses of one fixed rollout at the initial weights, and their relative difference."""
    rollout = fixed_rollout(prompts, arch.vocab_size)
    t0 = time.perf_counter()
    trl_loss, old = trl_step1_loss(trainer, rollout)
    ours = gptoss_step1_loss(folder, arch, rollout, old)
    return {"gptoss_loss": ours, "trl_loss": trl_loss, "relative_difference": abs(ours - trl_loss) / abs(trl_loss),
            "check_s": time.perf_counter() - t0}


__all__ = ["write_policy", "prompt_ids", "trl_trainer", "trl_step_times", "step1_check"]
