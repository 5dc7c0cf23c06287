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
  served weights to an HF folder (rl/weights.py) and has the engine serve them without a restart
  (vLLM's loader builds them in the engine's process and they replace the served tensors in place:
  vLLM's own in-place reload leaves GPT-OSS's experts, sinks and CPU-packed linear layers stale,
  generate/engines/vllm_worker.py), then checks a fingerprint: the engine's log-probabilities of a probe prompt over the whole vocabulary
  against the trainer's own, within serve-check's error budget for the engine's dtype
  (parity/serve/budget.py). A push the engine did not take is a TrainingError naming the version.
  The engine's log-probabilities are vLLM's `processed_logprobs`: after temperature and top_p, the
  distribution it sampled from, as gptoss's engine reports them. With `routes` (rl.routing_replay:
  rollout) vLLM is asked for the experts each token went to (`enable_return_routed_experts`, its V2
  model runner: a GPU; refused in one line on an engine that cannot) and they are mapped to gptoss's
  numbering (rl/routes.py, `vllm_routes`).
"""

from __future__ import annotations

import tempfile
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
                 python: str | None, version: int, rollout_rows: int = 1, log_dir: str | Path | None = None,
                 routes_of: Sequence[tuple[int, int]] | None = None):
        self.arch, self.state, self.sampling, self.max_new_tokens = arch, state, sampling, max_new_tokens
        self.stop_ids, self.seed, self.dtype, self.qat, self.probe = list(stop_ids), seed, dtype, qat, list(probe)
        self.engine = None
        self.version = version
        self.push_seconds = 0.0
        self.last_fingerprint: dict[str, Any] = {}
        self.routes_of = routes_of  # the MoE layers' (index, HF block) when routes are asked for (rl/routes.py)
        if state.rank == 0:
            from gptoss_cli.generate.engines.vllm_offline import VllmEngine
            from gptoss_cli.rl.weights import write_hf_folder

            self._tmp = Path(tempfile.mkdtemp(prefix="gptoss-rl-weights-", dir=log_dir))
            folder = write_hf_folder(model, arch, self._tmp / "policy", qat=qat, dtype=dtype)
            self.engine = VllmEngine(python, log_dir=log_dir)
            self._routes_possible()
            engine_args = {}
            if self.engine.info.device == "cpu":
                # vLLM's CPU build fails a seeded request whose prompt is prefilled in chunks ("CPU Generator
                # does not use offset"): a token budget that holds every prompt of a rollout avoids the chunks
                engine_args["max_num_batched_tokens"] = max(max_model_len, rollout_rows * max_model_len)
            self.engine.load_model(folder, dtype=dtype, max_model_len=max_model_len, vocab_size=arch.vocab_size,
                                   seed=seed, logprobs_mode="processed_logprobs", engine_args=engine_args,
                                   routed_experts=routes_of is not None)
        self._agree(lambda: self._fingerprint(model, "at start"))

    def _routes_possible(self) -> None:
        if self.routes_of is not None and self.engine.info.device != "cuda":
            device = self.engine.info.device
            self.engine.close()
            raise TrainingError(f"rl.routing_replay=rollout needs the engine's routed experts, which vLLM returns only "
                                f"with its V2 model runner on a GPU; this vLLM runs on {device}",
                                hint="rl.rollout.engine=gptoss, or rl.routing_replay=old_policy / none")

    def _agree(self, fn) -> None:
        """Run `fn` on rank 0; every rank raises the TrainingError it raised (no rank waits alone)."""
        error = None
        if self.state.rank == 0:
            try:
                fn()
            except TrainingError as exc:
                error = (exc.message, exc.hint)
        if self.state.distributed:
            box = [error]
            dist.broadcast_object_list(box, src=0)
            error = box[0]
        if error is not None:
            raise TrainingError(error[0], hint=error[1])

    def _fingerprint(self, model: torch.nn.Module, when: str) -> None:
        from gptoss_cli.parity.serve.reference import reference_for
        from gptoss_cli.parity.serve.report import compare_prompt
        from gptoss_cli.rl.weights import ENGINE_DTYPES

        # the coarser of the two dtypes sets the budget (serve-check's error model, parity/serve/budget.py)
        dtype = max(ENGINE_DTYPES[self.dtype], next(model.parameters()).dtype, key=lambda d: torch.finfo(d).eps)
        ref = reference_for(model, "probe", self.probe, greedy_tokens=0, dtype=dtype)
        result = compare_prompt(ref, self.engine.score([self.probe])[0], [])
        self.last_fingerprint = {"max_abs_logprob_diff": result.max_abs_logprob_diff, "budget": result.max_budget}
        if result.first_divergent_position is not None:
            raise TrainingError(
                f"the rollout engine does not serve the policy's weights of version {self.version} ({when}): on a "
                f"{len(self.probe)}-token probe its log-probabilities differ from the trainer's by up to "
                f"{result.max_abs_logprob_diff:.3g} (budget {result.budget:.2g}, first at token "
                f"{result.first_divergent_position})",
                hint="the weight push did not reach every layer (docs/rl.md, 'Weight pushes'); the engine's log: "
                     f"{self.engine.log_path}")

    def sync(self, model: torch.nn.Module, version: int) -> None:
        if version == self.version:
            return
        t0 = time.perf_counter()
        self.version = version

        def push() -> None:
            from gptoss_cli.rl.weights import write_hf_folder

            folder = write_hf_folder(model, self.arch, self._tmp / "policy", qat=self.qat, dtype=self.dtype)
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
        if self.engine is not None:
            self.engine.close()
            self.engine = None


def _engine_sampling(sampling: Sampling, max_new_tokens: int, stop_ids: list[int], seeds: list[int]):
    from gptoss_cli.generate.engines.base import SamplingParams

    return SamplingParams(max_tokens=max_new_tokens, temperature=sampling.temperature, top_p=sampling.top_p,
                          stop_token_ids=stop_ids, seeds=seeds)


__all__ = ["GptossRollout", "VllmRollout", "mixed_seed", "Sample"]
