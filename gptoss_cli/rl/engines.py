"""The rollout engines a GRPO run samples with (`rl.rollout.engine`): gptoss's own and vLLM.

Both answer `sample(rollout, prompts) -> [(ids, logprobs, finish)]` for this rank's prompts (each
prompt already repeated rl.group_size times) and `sync(model, version)`, called before a rollout
with the policy as it is after `version` optimizer steps.

- `GptossRollout` decodes with the training model itself on every rank (rl/sampling.py); nothing to
  sync. With `routes` each sample also carries the experts its tokens went to (routing replay). Its generator is seeded by (rl.seed, rollout, data-parallel rank), so a resumed run samples
  what an uninterrupted one does.
- `VllmRollout` runs vLLM in its own interpreter (generate/engines/vllm_offline.py), fed by rank 0:
  every rank's prompts are gathered there and the completions sent back. Each completion has its
  own vLLM seed, from (rl.seed, rollout, its index in the rollout). `sync` writes the policy's
  served weights to an HF folder (rl/weights.py) in the stage folder (rl.rollout.stage_dir, an
  outputs.ScratchFolder: removed however the run ends) and has the engine serve them without a restart
  (vLLM's loader builds them in the engine's process and they replace the served tensors in place:
  vLLM's own in-place reload leaves GPT-OSS's experts, sinks and CPU-packed linear layers stale,
  generate/engines/vllm_worker.py), then checks a fingerprint (rl/fingerprint.py): the engine's
  log-probabilities of a probe prompt over the whole vocabulary against the trainer's own, within the
  error budget of the pushed weights. A push the engine did not take, or other weights served, is a
  TrainingError naming the version and the likely cause, on every rank; an engine that only rounds more
  than the budget allows is a warning. The engine's log goes to the run folder (rollout-engine.log).
  The engine's log-probabilities are vLLM's `processed_logprobs`: after temperature and top_p, the
  distribution it sampled from, as gptoss's engine reports them. With `routes` (rl.routing_replay:
  rollout) vLLM is asked for the experts each token went to (`enable_return_routed_experts`, its V2
  model runner: a GPU; refused in one line on an engine that cannot) and they are mapped to gptoss's
  numbering (rl/routes.py, `vllm_routes`).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import torch
import torch.distributed as dist

from gptoss_cli.errors import TrainingError
from gptoss_cli.generate.decode import Sampling
from gptoss_cli.rl.sampling import sample_completions

if TYPE_CHECKING:
    from gptoss_cli.model.config import GptOssArch
    from gptoss_cli.parallel.state import ParallelState

Sample = tuple  # (ids, logprobs, finish) and, when asked, the routes (rl/routes.py)


def mixed_seed(*parts: int) -> int:
    """A 63-bit seed from integers (splitmix64 over them): distinct parts give unrelated streams."""
    x = 0x9E3779B97F4A7C15
    for p in parts:
        x = (x ^ (int(p) & 0xFFFFFFFFFFFFFFFF)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
        x = (x ^ (x >> 27)) * 0x94D049BB133111EB & 0xFFFFFFFFFFFFFFFF
        x ^= x >> 31
    return x & 0x7FFFFFFFFFFFFFFF


class GptossRollout:
    """Sampling with the training model on every rank (see the module docstring)."""

    name = "gptoss"

    def __init__(self, model: torch.nn.Module, *, sampling: Sampling, max_new_tokens: int, stop_ids: Sequence[int],
                 batch_size: int | None, seed: int, dp_rank: int, group=None, routes: bool = False):
        self.model, self.sampling, self.max_new_tokens, self.routes = model, sampling, max_new_tokens, routes
        self.stop_ids, self.batch_size, self.seed, self.dp_rank, self.group = stop_ids, batch_size, seed, dp_rank, group
        self.version = 0
        self.push_seconds = 0.0
        self.warnings: list[str] = []

    def sync(self, model: torch.nn.Module, version: int) -> None:
        self.version = version  # the engine is the policy itself

    def sample(self, rollout: int, prompts: list[list[int]]) -> list[Sample]:
        generator = torch.Generator().manual_seed(mixed_seed(self.seed, rollout, self.dp_rank))
        return sample_completions(self.model, prompts, max_new_tokens=self.max_new_tokens, stop_ids=self.stop_ids,
                                  sampling=self.sampling, generator=generator, batch_size=self.batch_size,
                                  group=self.group, routes=self.routes)

    def close(self) -> None:
        pass


class VllmRollout:
    """vLLM fed by rank 0, the policy pushed after every update (see the module docstring)."""

    name = "vllm"

    def __init__(self, model: torch.nn.Module, arch: GptOssArch, state: ParallelState, *, sampling: Sampling, max_new_tokens: int,
                 stop_ids: Sequence[int], seed: int, dtype: str, max_model_len: int, qat: bool, probe: Sequence[int],
                 python: str | None, version: int, rollout_rows: int = 1, stage_dir: str | Path | None = None,
                 log_file: str | Path | None = None, routes_of: Sequence[tuple[int, int]] | None = None):
        from gptoss_cli.rl.fingerprint import FingerprintCheck

        self.arch, self.state, self.sampling, self.max_new_tokens = arch, state, sampling, max_new_tokens
        self.stop_ids, self.seed, self.dtype, self.qat = list(stop_ids), seed, dtype, qat
        self.engine = None
        self.stage = None
        self.version = version
        self.push_seconds = 0.0
        self.check = FingerprintCheck(list(probe))
        self.warnings: list[str] = []  # what the run carries on with (RolloutData passes them on)
        self.started: dict[str, Any] = {}  # which engine, its log, its start-up seconds (rank 0)
        self.routes_of = routes_of  # the MoE layers' (index, HF block) when routes are asked for (rl/routes.py)
        if state.rank == 0:
            try:
                self._start(model, python, max_model_len, rollout_rows, stage_dir, log_file)
            except BaseException:
                self.close()
                raise
        self._agree(lambda: self._fingerprint(model, "at start"))

    def _start(self, model: torch.nn.Module, python: str | None, max_model_len: int, rollout_rows: int,
               stage_dir: str | Path | None, log_file: str | Path | None) -> None:
        from gptoss_cli.generate.engines.vllm_offline import VllmEngine, shape_problem
        from gptoss_cli.outputs import ScratchFolder
        from gptoss_cli.rl.weights import write_hf_folder

        t0 = time.perf_counter()
        # the pushes' folder goes with this process however it ends (outputs.ScratchFolder)
        self.stage = ScratchFolder("gptoss-rl-weights-", stage_dir)
        self.engine = VllmEngine(python, log_dir=self.stage.path, log_file=log_file)
        problem = shape_problem(self.arch.head_dim, self.engine.info.device)
        if problem is not None:  # the rule rl.layout refuses it first where the recipe says the device
            raise TrainingError(f"the vLLM rollout engine cannot serve this model: {problem}",
                                hint="a model with head_dim 64 (`gptoss make-tiny DST --head-dim 64`), or "
                                     "rl.rollout.engine=gptoss")
        self._routes_possible()
        folder = write_hf_folder(model, self.arch, self.stage.path / "policy", qat=self.qat, dtype=self.dtype)
        engine_args = {}
        if self.engine.info.device == "cpu":
            # vLLM's CPU build fails a seeded request whose prompt is prefilled in chunks ("CPU Generator
            # does not use offset"): a token budget that holds every prompt of a rollout avoids the chunks
            engine_args["max_num_batched_tokens"] = max(max_model_len, rollout_rows * max_model_len)
        self.engine.load_model(folder, dtype=self.dtype, max_model_len=max_model_len, vocab_size=self.arch.vocab_size,
                               seed=self.seed, logprobs_mode="processed_logprobs", engine_args=engine_args,
                               routed_experts=self.routes_of is not None)
        info = self.engine.info
        self.started = {"engine": f"{info.name} {info.version} on {info.device}", "python": info.python,
                        "log": str(self.engine.log_path), "stage": str(self.stage.path),
                        "seconds": time.perf_counter() - t0}

    def _routes_possible(self) -> None:
        if self.routes_of is not None and self.engine.info.device != "cuda":
            raise TrainingError(f"rl.routing_replay=rollout needs the engine's routed experts, which vLLM returns only "
                                f"with its V2 model runner on a GPU; this vLLM runs on {self.engine.info.device}",
                                hint="rl.rollout.engine=gptoss, or rl.routing_replay=old_policy / none")

    def _agree(self, fn) -> None:
        """Run `fn` on rank 0; every rank raises the TrainingError or EngineError it raised (no rank waits alone)."""
        from gptoss_cli.generate.engines.base import EngineError

        error = None
        if self.state.rank == 0:
            try:
                fn()
            except (TrainingError, EngineError) as exc:
                error = (type(exc) is EngineError, exc.message, exc.hint)
        if self.state.distributed:
            box = [error]
            dist.broadcast_object_list(box, src=0)
            error = box[0]
        if error is not None:
            exc = (EngineError if error[0] else TrainingError)(error[1], hint=error[2])
            exc.every_rank = True  # RLTrainer may save before stopping: every rank stops here alike
            raise exc

    def _fingerprint(self, model: torch.nn.Module, when: str) -> None:
        from gptoss_cli.rl.fingerprint import PASSED, ROUNDING
        from gptoss_cli.rl.weights import ENGINE_DTYPES

        # the coarser of the two dtypes sets the budget (serve-check's error model, parity/serve/budget.py)
        dtype = max(ENGINE_DTYPES[self.dtype], next(model.parameters()).dtype, key=lambda d: torch.finfo(d).eps)
        fp = self.check.check(model, lambda probe: self.engine.score([probe])[0], self.version, dtype)
        if fp.verdict == PASSED:
            return
        text = fp.describe(when, len(self.check.probe))
        if fp.verdict == ROUNDING:
            self.warnings.append(f"the rollout engine's {text}; likely cause: {self.check.cause(fp)}")
            return
        self.engine.keep_log()
        raise TrainingError(f"the rollout engine does not serve the policy's weights of {text}",
                            hint=f"likely cause: {self.check.cause(fp)} (docs/rl.md, 'Weight pushes'); the engine's "
                                 f"log: {self.engine.log_path}")

    @property
    def last_fingerprint(self) -> dict[str, float]:
        return self.check.last.metrics() if self.check.last is not None else {}

    def sync(self, model: torch.nn.Module, version: int) -> None:
        if version == self.version:
            return
        t0 = time.perf_counter()
        self.version = version

        def push() -> None:
            from gptoss_cli.rl.weights import write_hf_folder

            folder = write_hf_folder(model, self.arch, self.stage.path / "policy", qat=self.qat, dtype=self.dtype)
            self.engine.load_weights(folder)
            self._fingerprint(model, "after the push")

        self._agree(push)
        self.push_seconds = time.perf_counter() - t0

    def sample(self, rollout: int, prompts: list[list[int]]) -> list[Sample]:
        state = self.state
        everyone = [prompts]
        if state.distributed:
            everyone = [None] * state.world_size
            dist.all_gather_object(everyone, prompts)
        results: list[Any] = [None]
        if state.rank == 0:
            flat = [p for rank_prompts in everyone for p in rank_prompts]
            seeds = [mixed_seed(self.seed, rollout, k) % 2**31 for k in range(len(flat))]  # vLLM takes int32 seeds
            sampling = _engine_sampling(self.sampling, self.max_new_tokens, self.stop_ids, seeds)
            done = self.engine.generate(flat, sampling)
            out, at = [], 0
            for rank_prompts in everyone:
                out.append([self._sample(p, c) for p, c in zip(rank_prompts, done[at:at + len(rank_prompts)])])
                at += len(rank_prompts)
            results = [out]
        if state.distributed:
            dist.broadcast_object_list(results, src=0)
        return results[0][state.rank]

    def _sample(self, prompt: list[int], c: Any) -> Sample:
        finish = "stop" if c.finish_reason == "stop" else "length"
        if self.routes_of is None:
            return c.ids, c.logprobs, finish
        from gptoss_cli.rl.routes import vllm_routes

        routes = None if c.routed_experts is None else vllm_routes(c.routed_experts, prompt=len(prompt),
                                                                   completion=len(c.ids), layers=self.routes_of)
        return c.ids, c.logprobs, finish, routes

    def close(self) -> None:
        try:
            if self.engine is not None:
                self.engine.close()
                self.engine = None
        finally:
            if self.stage is not None:
                self.stage.remove()
                self.stage = None


def _engine_sampling(sampling: Sampling, max_new_tokens: int, stop_ids: list[int], seeds: list[int]):
    from gptoss_cli.generate.engines.base import SamplingParams

    return SamplingParams(max_tokens=max_new_tokens, temperature=sampling.temperature, top_p=sampling.top_p,
                          stop_token_ids=stop_ids, seeds=seeds)


__all__ = ["GptossRollout", "VllmRollout", "mixed_seed", "Sample"]
