"""A GRPO run's data: prompts in, rollouts sampled and scored, microbatches out; what the Trainer reads as `data`.

`RolloutData` answers the loop's data interface (`step_iterator`, `num_microbatches`,
`consumed_samples`) from the current rollout, and `sample(index, ...)` makes rollout `index`:

1. the engine is brought up to the policy's weights (rl/engines.py, `sync`);
2. this data-parallel rank's prompts of the rollout (rl/prompts.py, `PromptOrder`), each repeated
   rl.group_size times, are sampled (rl/engines.py);
3. every completion is scored by the reward (rl/rewards.py; a failure is a warning and advantage 0);
   advantages are relative to the group (rl/objective.py); groups never cross ranks;
4. the completions become microbatches (rl/batch.py), with the experts the engine routed each token
   to when it reported them (checked first: rl/routes.py) and what rl.routing_replay replays; when the
   rollout is trained over several steps the trainer's log-probabilities at the rollout's weights are
   scored now (`old_logp`; under old_policy replay that forward's own routes are recorded for the
   updates to replay), and with a KL term the reference policy's (`ref_logp`, rl/reference.py, routed
   live), all through forward-only passes;
5. the rollout's statistics are reduced over the data-parallel ranks in one collective.
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.distributed as dist

from gptoss_cli.errors import ConfigError, TrainingError
from gptoss_cli.generate.decode import Sampling
from gptoss_cli.rl.batch import Rollout, SampledCompletion, split_microbatches, step_microbatches
from gptoss_cli.rl.logprobs import policy_log_probs
from gptoss_cli.rl.objective import group_advantages
from gptoss_cli.model.routes import ExpertRoutes
from gptoss_cli.rl.prompts import PromptOrder, read_records, render_records
from gptoss_cli.rl.routes import check_routes, moe_blocks
from gptoss_cli.rl.rewards import RewardFailure, call_reward, completion_text, load_reward
from gptoss_cli.train.data import Microbatch
from gptoss_cli.train.objective import StepContext

if TYPE_CHECKING:
    from gptoss_cli.model.config import GptOssArch
    from gptoss_cli.parallel.state import ParallelState
    from gptoss_cli.recipe.schema import RecipeConfig
    from gptoss_cli.train.heartbeat import Heartbeat
    from gptoss_cli.train.job import TrainJob

MAX_WARNINGS_PER_ROLLOUT = 3
ENGINE_LOG = "rollout-engine.log"  # in the run folder: the vLLM engine's own output, kept
# fields of train_state.json's rl entry a resume must find unchanged
RESUME_FIELDS = ("prompts", "prompts_digest", "reward", "seed", "group_size", "steps_per_rollout")


def open_tokenizer(cfg: RecipeConfig, arch: GptOssArch):
    """(tokenizers.Tokenizer, its path): rl.tokenizer, else checkpoint.pretrained's tokenizer.json."""
    from gptoss_cli.data.tokenizer import TOKENIZER_FILE, read_tokenizer, tokenizer_path

    if cfg.rl.tokenizer:
        file = tokenizer_path(cfg.rl.tokenizer)
    elif cfg.checkpoint.pretrained:
        from gptoss_cli.generate.session import open_checkpoint

        file = open_checkpoint(cfg.checkpoint.pretrained).tokenizer_file
    else:
        raise ConfigError("objective.kind=grpo renders harmony prompts: set rl.tokenizer (or checkpoint.pretrained "
                          f"with a {TOKENIZER_FILE})")
    if not file.is_file():
        raise ConfigError(f"rl.tokenizer={cfg.rl.tokenizer}: {file} not found")
    return read_tokenizer(file, "train (objective.kind=grpo)"), file


def _every_rank(exc: TrainingError) -> TrainingError:
    exc.every_rank = True  # raised alike on every rank: RLTrainer may save before stopping
    return exc


class RolloutData:
    """The rollouts of a GRPO run as the Trainer's data (see the module docstring). A subclass with
    `rewarded = False` samples without a reward (advantages 0, no reward statistics) and adds what its
    objective needs to the microbatches in `_score_policies` (on-policy distillation: the teacher's
    log-probabilities of the sampled tokens, gptoss_cli/distill/on_policy.py)."""

    rewarded = True

    def __init__(self, job: TrainJob, state: ParallelState, model: torch.nn.Module, heartbeat: Heartbeat | None = None):
        from gptoss_cli.data.harmony import HarmonyTokenizer
        from gptoss_cli.generate.session import HARMONY_STOP_TOKENS, stop_token_ids

        cfg = job.config
        self.cfg, self.rl, self.state, self.model, self.job = cfg, cfg.rl, state, model, job
        t = cfg.training
        self.dp_size, self.dp_rank = state.data_parallel_size, state.data_parallel_rank
        self.global_batch_size, self.micro_batch_size = t.global_batch_size, t.micro_batch_size
        self.num_microbatches = t.global_batch_size // (t.micro_batch_size * self.dp_size)
        per_rollout = t.global_batch_size * self.rl.steps_per_rollout
        if per_rollout % (self.rl.group_size * self.dp_size):
            raise ConfigError(f"a rollout of training.global_batch_size x rl.steps_per_rollout = {per_rollout} "
                              f"completions does not split into groups of rl.group_size={self.rl.group_size} "
                              f"over {self.dp_size} data-parallel ranks")
        self.prompts_per_rollout = per_rollout // self.rl.group_size
        self.seed = t.seed if self.rl.seed is None else self.rl.seed
        tok, self.tokenizer_file = open_tokenizer(cfg, job.arch)
        self.htok = HarmonyTokenizer(tok, str(self.tokenizer_file))
        self.prompts = render_records(read_records(self.rl.prompts), self.htok,
                                      max_prompt_tokens=t.seq_length - self.rl.max_new_tokens)
        self.order = PromptOrder(len(self.prompts), self.seed)
        # a run whose objective scores the samples itself (on-policy distillation) has no reward
        self.reward = load_reward(self.rl.reward) if self.rewarded else None
        self.stop_ids = stop_token_ids(tok, HARMONY_STOP_TOKENS)
        self.consumed_samples = 0
        self.rollout: Rollout | None = None
        self.step_in_rollout = 0
        self._warnings: list[str] = []
        self.moe_layers = moe_blocks(model.module.pattern.layers)  # (layer, HF block) of each MoE layer
        self.engine = self._engine(model)
        self.reference = self._reference()

    # --- setup ---------------------------------------------------------------------------------
    def _engine(self, model: torch.nn.Module):
        from gptoss_cli.rl.engines import GptossRollout, VllmRollout

        rl, state, inner = self.rl, self.state, model.module
        sampling = Sampling(temperature=rl.temperature, top_p=rl.top_p)
        if rl.rollout.engine == "gptoss":  # its routes cost little: the flip rate is logged whatever the replay
            return GptossRollout(inner, sampling=sampling, max_new_tokens=rl.max_new_tokens, stop_ids=self.stop_ids,
                                 batch_size=rl.rollout.batch_size, seed=self.seed, dp_rank=self.dp_rank,
                                 group=state.ep_group if state.ep_size > 1 else None, routes=True)
        dtype = rl.rollout.dtype or {"fp32": "float32", "bf16": "bfloat16"}[self.cfg.precision.params_dtype]
        return VllmRollout(inner, self.job.arch, state, sampling=sampling, max_new_tokens=rl.max_new_tokens,
                           stop_ids=self.stop_ids, seed=self.seed, dtype=dtype,
                           max_model_len=self.cfg.training.seq_length, qat=self.cfg.precision.qat == "mxfp4",
                           probe=self.prompts[0].ids, python=rl.rollout.engine_python, version=0,
                           rollout_rows=self.prompts_per_rollout * rl.group_size, stage_dir=rl.rollout.stage_dir,
                           log_file=Path(self.job.run_dir) / ENGINE_LOG,
                           routes_of=self.moe_layers if rl.routing_replay == "rollout" else None)

    def _reference(self):
        if self.rl.kl_coeff <= 0 or self.cfg.lora.rank > 0:
            return None  # no KL term, or LoRA: the base with the adapters off
        from gptoss_cli.rl.reference import frozen_copy
        from gptoss_cli.train.provider import HybridModelProvider, ModelRuntimeConfig

        runtime = ModelRuntimeConfig.from_recipe(self.cfg, self.job.arch, self.job.pattern)
        return frozen_copy(HybridModelProvider(runtime, seed=self.cfg.training.seed,
                                               weights=self.cfg.checkpoint.pretrained), self.state)

    # --- the loop's data interface -----------------------------------------------------------------
    def step_iterator(self):
        self.consumed_samples += self.global_batch_size
        return step_microbatches(self.rollout, self.step_in_rollout, self.num_microbatches)

    def state_dict(self) -> dict[str, Any]:
        rl = self.rl
        return {"rollouts": self.consumed_samples // (self.global_batch_size * rl.steps_per_rollout),
                "weights_version": self.engine.version, "prompts": rl.prompts, "prompts_digest": self.digest(),
                "reward": rl.reward, "seed": self.seed, "group_size": rl.group_size,
                "steps_per_rollout": rl.steps_per_rollout, "engine": rl.rollout.engine}

    def digest(self) -> str:
        h = hashlib.sha256()
        for p in self.prompts:
            h.update(repr(p.ids).encode())
        return h.hexdigest()[:16]

    def resumed(self, start_step: int, meta: dict[str, Any] | None) -> None:
        """Check a resumed checkpoint's rl entry against this run (what must not change)."""
        if meta is None:
            return
        saved, now = meta.get("rl"), self.state_dict()
        if saved is None:
            raise ConfigError("the checkpoint was not written by a GRPO run (no rl entry in train_state.json)",
                              hint="start a new checkpoint.dir, or train it with its own objective")
        for key in RESUME_FIELDS:
            if saved.get(key) != now[key]:
                raise ConfigError(f"resuming a GRPO run with rl.{key} changed: the checkpoint has {saved.get(key)!r}, "
                                  f"this run {now[key]!r}", hint="resume with the checkpoint's settings, or start a "
                                  "new checkpoint.dir")
        if start_step % self.rl.steps_per_rollout:
            raise ConfigError(f"the checkpoint is at step {start_step}, inside a rollout of rl.steps_per_rollout="
                              f"{self.rl.steps_per_rollout} steps", hint="resume with the steps_per_rollout it was "
                              "saved with")

    # --- a rollout ---------------------------------------------------------------------------------
    def sample(self, index: int, *, version: int, context: StepContext,
               beat: Callable[[], None] | None = None) -> Rollout:
        """Rollout `index` (0-based) with the policy after `version` optimizer steps."""
        t0 = time.perf_counter()
        self.engine.sync(self.model.module, version)
        self._warnings += self.engine.warnings  # what the engine's check carries on with
        self.engine.warnings.clear()
        push = self.engine.push_seconds if version else 0.0
        rl = self.rl
        picked = self.order.rank_slice(index, self.prompts_per_rollout, self.dp_rank, self.dp_size)
        repeated = [i for i in picked for _ in range(rl.group_size)]
        t_sample = time.perf_counter()
        samples = self.engine.sample(index, [list(self.prompts[i].ids) for i in repeated])
        sample_seconds = time.perf_counter() - t_sample
        completions = [SampledCompletion(i, self.prompts[i].ids, *sample) for i, sample in zip(repeated, samples)]
        self._check_routes(completions, version, index)
        if beat:
            beat()
        if self.reward is None:
            rollout = Rollout(index, completions, [None] * len(completions), [0.0] * len(completions))
        else:
            rewards = [self._score(c) for c in completions]
            rollout = Rollout(index, completions, rewards, group_advantages(rewards, rl.group_size, rl.scale_rewards))
        rollout.microbatches = split_microbatches(rollout, self.micro_batch_size, self.cfg.training.seq_length,
                                                  self.state.device)
        if rl.routing_replay == "rollout":  # R3: every forward of the rollout routes to the engine's experts
            for mb in rollout.microbatches:
                mb.routes.replay = mb.routes.engine
        self._score_policies(rollout.microbatches, context)
        rollout.seconds = time.perf_counter() - t0
        rollout.stats = self._stats(rollout, sample_seconds, push)
        self.rollout = rollout
        return rollout

    def _score(self, c: SampledCompletion) -> float | None:
        p = self.prompts[c.prompt]
        value = call_reward(self.reward, p.messages, completion_text(c.ids, self.htok), c.ids, p.record, p.where)
        if isinstance(value, RewardFailure):
            self._warnings.append(value.line())
            return None
        return value

    def _check_routes(self, completions: list[SampledCompletion], version: int, index: int) -> None:
        """Every reported capture is whole and valid (rl/routes.py), and there is one where replay needs it."""
        needed = self.rl.routing_replay == "rollout" or self.rl.rollout.engine == "gptoss"
        arch = self.job.arch
        for n, c in enumerate(completions):
            if c.routes is None and not needed:
                continue
            check_routes(c.routes, tokens=len(c.prompt_ids) + len(c.ids) - 1, layers=self.moe_layers,
                         top_k=arch.num_experts_per_tok, num_experts=arch.num_local_experts,
                         where=f"step {version + 1} (rollout {index + 1}), prompt {self.prompts[c.prompt].where}, "
                               f"completion {n} of rank {self.state.rank}")

    def _score_policies(self, microbatches: list[Microbatch], context: StepContext) -> None:
        """old_logp (the rollout is trained over several steps; with old_policy replay, that forward's routes
        too) and ref_logp (a KL term, routed live), forward-only."""
        if self.rl.steps_per_rollout > 1:
            record = self.rl.routing_replay == "old_policy"
            for mb in microbatches:
                if record:
                    mb.routes = ExpertRoutes(engine=None if mb.routes is None else mb.routes.engine, record=True)
            for mb, log in zip(microbatches, context.forward_only(self._score_step, microbatches)):
                mb.extras["old_logp"] = log["logp"]
                if "route_pairs" in log:  # the flips at the rollout's weights; the updates need not count them
                    mb.extras.update(route_flips=log["route_flips"], route_pairs=log["route_pairs"])
                    mb.routes.engine = None
                if record:  # the updates replay the old policy's own routes
                    mb.routes = ExpertRoutes(replay=log["routes"])
        if self.rl.kl_coeff <= 0:
            return
        live = [dataclasses.replace(mb, routes=None) for mb in microbatches]
        if self.reference is None:  # LoRA: the base with the adapters off
            from gptoss_cli.rl.reference import adapters_off

            with adapters_off(self.model.module):
                logs = context.forward_only(self._score_step, live)
            for mb, log in zip(microbatches, logs):
                mb.extras["ref_logp"] = log["logp"]
            return
        with torch.no_grad():
            for mb, plain in zip(microbatches, live):
                out = self.reference(plain.tokens, **plain.model_inputs())
                mb.extras["ref_logp"] = policy_log_probs(out, mb.labels, self.rl.temperature)[0]

    def _score_step(self, data_iterator, model, return_schedule_plan: bool = False):
        mb = next(data_iterator)
        temperature = self.rl.temperature
        zero = torch.zeros((), device=mb.tokens.device)

        def scored(out):
            log = {"logp": policy_log_probs(out, mb.labels, temperature)[0].detach()}
            if getattr(out, "live_routes", None) is not None:
                log["routes"] = out.live_routes.to(torch.int16)
            if getattr(out, "route_pairs", None) is not None:
                log.update(route_flips=out.route_flips.float(), route_pairs=out.route_pairs.float())
            return zero, zero, log

        return model(mb.tokens, **mb.model_inputs()), scored

    def _stats(self, rollout: Rollout, sample_seconds: float, push_seconds: float) -> dict[str, float]:
        """The rollout's statistics over every data-parallel rank (one all-reduce of sums, one of maxima)."""
        g = self.rl.group_size
        scored = [r for r in rollout.rewards if r is not None]
        groups = [rollout.rewards[s:s + g] for s in range(0, len(rollout.rewards), g)]
        zero_var = sum(1 for grp in groups if len({r for r in grp if r is not None}) <= 1)
        tokens = sum(len(c.ids) for c in rollout.completions)
        sums = torch.tensor([sum(scored), sum(r * r for r in scored), len(scored), len(rollout.rewards) - len(scored),
                             zero_var, len(groups), tokens,
                             sum(1 for c in rollout.completions if c.finish != "stop")], dtype=torch.float64)
        maxima = torch.tensor([sample_seconds, rollout.seconds, push_seconds], dtype=torch.float64)
        if self.state.distributed:
            dist.all_reduce(sums, group=self.state.dp_group)
            dist.all_reduce(maxima, op=dist.ReduceOp.MAX, group=self.state.dp_group)
        total, squares, n, failed, zero_var, n_groups, tokens, truncated = sums.tolist()
        sample_s, rollout_s, push_s = maxima.tolist()
        common = {"truncated_fraction": truncated / (n + failed), "rollout_time_s": rollout_s, "rollout_tokens": tokens,
                  "rollout_tokens_per_s": tokens / sample_s if sample_s > 0 else 0.0, "weight_push_s": push_s}
        if self.reward is None:
            return common
        if n == 0:  # every rank knows it (the sums above are all-reduced)
            raise _every_rank(TrainingError(f"every reward of rollout {rollout.index + 1} failed ({self._warnings[0] if self._warnings else 'rl.reward'})",
                                hint="fix rl.reward; the run stops before training on rewards it does not have"))
        mean = total / n
        var = (squares - n * mean * mean) / (n - 1) if n > 1 else 0.0
        return {"reward_mean": mean, "reward_std": max(var, 0.0) ** 0.5, "zero_variance_groups": zero_var / n_groups,
                "reward_failures": failed, **common}

    def step_metrics(self, step_in_rollout: int, *, train_seconds: float) -> dict[str, Any]:
        """What a step adds to its metrics.jsonl line: the rollout's statistics (its time on its first step)."""
        stats = dict(self.rollout.stats)
        if step_in_rollout:
            stats.update(rollout_time_s=0.0, weight_push_s=0.0)
        stats.update(train_time_s=train_seconds, rollout=self.rollout.index + 1, weights_version=self.engine.version)
        if not step_in_rollout:  # the push's fingerprint (vLLM, rank 0): worst |dlogprob| on the probe, its budget
            stats.update(getattr(self.engine, "last_fingerprint", {}))
        return stats

    def started_notes(self) -> list[str]:
        """Which rollout engine, where its log is, how long it took to start (rank 0's; vLLM only)."""
        s = getattr(self.engine, "started", None)
        if not s:
            return []
        return [f"rollout engine: {s['engine']} ({s['python']}), started in {s['seconds']:.1f} s; its log: {s['log']}; "
                f"pushes staged in {s['stage']}"]

    def take_warnings(self) -> list[str]:
        lines, self._warnings = self._warnings, []
        if len(lines) > MAX_WARNINGS_PER_ROLLOUT:
            lines = lines[:MAX_WARNINGS_PER_ROLLOUT] + [f"... and {len(lines) - MAX_WARNINGS_PER_ROLLOUT} more "
                                                        "reward failures on this rank (reward_failures counts all)"]
        return lines

    def mismatch_suspects(self) -> str:
        """The layers of this run that make the engine and the trainer compute differently, likeliest first."""
        cfg, rl = self.cfg, self.rl
        out = []
        if rl.rollout.engine != "gptoss":
            dtype = rl.rollout.dtype or cfg.precision.params_dtype
            out.append(f"the engine ({rl.rollout.engine}, its own kernels, in {dtype}) against the trainer's")
        if cfg.precision.params_dtype != "fp32":
            out.append(f"{cfg.precision.params_dtype} rounding (the decode path's attention and sums in another order "
                       "than training's)")
        if cfg.precision.fp8_recipe != "none":
            out.append(f"FP8 GEMMs ({cfg.precision.fp8_recipe}) in both passes, quantised per call")
        if rl.top_p < 1.0:
            out.append(f"rl.top_p={rl.top_p}: the engine reports the nucleus' renormalised log-probabilities")
        if not out:
            out.append("none expected in fp32 with gptoss's engine: check the model's layers (a kernel whose decode "
                       "and training paths differ)")
        return "; ".join(out)

    def close(self) -> None:
        self.engine.close()


__all__ = ["RolloutData", "open_tokenizer"]
