"""GRPO with vLLM rollouts (its CPU build, in its own venv): one engine for the whole test.

The Trainer is driven step by step on a tiny transformers-made checkpoint in fp32 (head size 64, as vLLM's
CPU attention needs): the engine starts on the initial weights (fingerprint checked), rollout 1 samples,
the step updates the policy, rollout 2 pushes the new weights (fingerprint checked again) and samples.
Then, on the same engine:
- the trainer/engine mismatch in fp32 stays within serve-check's error budget for this model;
- a planted mismatch (the engine given the policy with block 1's output projection, sinks and experts
  perturbed) shows in mismatch_kl, and
  GRPO's loss with truncated importance sampling equals the importance-weighted loss computed here in
  float64 from the engine's and the trainer's log-probabilities;
- vLLM's own in-place reload leaves the engine serving a mix of weights, which the fingerprint catches,
  where the push gptoss uses passes.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from gptoss_cli.errors import TrainingError
from gptoss_cli.model.loss import IGNORE_INDEX
from gptoss_cli.parallel.state import destroy_parallel, init_parallel
from gptoss_cli.rl.logprobs import policy_log_probs
from tests.parity.vllm_fixtures import engine_python, write_hf
from tests.rl.helpers import grpo_job, metrics

pytestmark = pytest.mark.xdist_group("vllm")
IS_CAP = 3.0


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    from gptoss_cli.checkpoint.convert import convert
    from gptoss_cli.checkpoint.load import checkpoint_architecture
    from gptoss_cli.rl.trainer import RLTrainer
    from gptoss_cli.run.objectives import build_objective

    python = engine_python()
    root = tmp_path_factory.mktemp("grpo-vllm")
    convert(str(write_hf(root / "hf", seed=3)), root / "hybrid", dtype="float32")
    arch, _ = checkpoint_architecture(root / "hybrid")
    job = grpo_job(root, arch=arch, pretrained=str(root / "hybrid"), rollout_engine="vllm", engine_python=python,
                   train_iters=2, is_max=IS_CAP, lr=1e-2)
    job = dataclasses.replace(job, objective=build_objective(job.config))  # what run_worker does
    state = init_parallel(1, "cpu")
    t = RLTrainer(job, state)
    try:
        t.resume()
        outcomes = [t.train_step(0), t.train_step(1)]
        for out in outcomes:
            t.record_step(out)
        yield t, outcomes
    finally:
        t.close()
        destroy_parallel()


def _trainer_logp(t, rollout) -> list[torch.Tensor]:
    with torch.no_grad():
        return [policy_log_probs(t.model.module(mb.tokens), mb.labels)[0] for mb in rollout.microbatches]


def test_vllm_rollouts_push_weights_and_match_the_trainer_in_fp32(trainer):
    t, outcomes = trainer
    rows = metrics(t.job.run_dir)
    assert [r["weights_version"] for r in rows] == [0, 1]  # rollout 2 sampled the policy after step 1
    assert rows[1]["weight_push_s"] > 0 and rows[0]["weight_push_s"] == 0
    last = t.data.engine.check.last  # the push's fingerprint: serve-check's fp32 budget of these weights on the probe
    budget = last.budget
    assert last.verdict == "passed" and last.max_abs_logprob_diff <= budget
    assert rows[1]["fingerprint_logp_abs"] == last.max_abs_logprob_diff and rows[1]["fingerprint_budget"] == budget
    for r in rows:
        # per token |engine - trainer| within the budget of one logprob; k3 ~ d^2 / 2 below it squared
        assert r["mismatch_logp_abs"] < budget and r["mismatch_kl"] < budget**2, r
        assert r["is_weight"] == pytest.approx(1.0, abs=2 * budget)
    assert "mismatch_kl" in outcomes[0].metrics and outcomes[1].metrics["reward_mean"] >= 0

    # --- a planted mismatch: the engine serves the policy with some of block 1's weights perturbed -----------
    from gptoss_cli.rl.weights import write_hf_folder

    model = t.model.module
    # block 1's output projection, sinks and experts (hybrid layers 2, 3): vLLM's in-place reload misses the
    # last two
    planted = {n: p for n, p in model.named_parameters()
               if n.startswith(("decoder.layers.2.", "decoder.layers.3.")) and (
                   "linear_proj.weight" in n or "softmax_offset" in n or ".experts.linear_fc2.weight" in n)}
    assert any("softmax_offset" in n for n in planted) and any(".experts." in n for n in planted), sorted(planted)
    saved = {n: p.detach().clone() for n, p in planted.items()}
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in planted.values():
            p.add_(0.2 * torch.randn(p.shape, generator=gen))
        perturbed = write_hf_folder(model, model.arch, t.data.engine.stage.path / "perturbed", qat=False, dtype="float32")
        for n, p in planted.items():
            p.copy_(saved[n])
    t.data.engine.engine.load_weights(perturbed)
    rollout = t.data.sample(7, version=t.data.engine.version, context=_context(t))
    logp = _trainer_logp(t, rollout)
    objective = t.objective
    sums: dict[str, float] = {}
    reference_num, reference_den = 0.0, 0
    for mb, lp in zip(rollout.microbatches, logp):
        out = t.model.module(mb.tokens)
        loss_sum, norm, logs = objective.loss(mb, None, out)
        for k, v in logs.items():
            if k in objective.sums:
                sums[k] = sums.get(k, 0.0) + float(v)
        sums["num_tokens"] = sums.get("num_tokens", 0.0) + float(norm)
        sums["pg"] = sums.get("pg", 0.0) + float(loss_sum)
        # the importance-weighted GRPO loss in float64: ratio 1 at the old policy (one step per rollout), so
        # each token's loss is -A * min(p_trainer / p_engine, cap), averaged per completion, then over them
        mask = mb.labels != IGNORE_INDEX
        w = torch.clamp(torch.exp(lp.double() - mb.extras["rollout_logp"].double()), max=IS_CAP)
        per_token = -mb.extras["advantages"].double() * w * mask
        reference_num += float((per_token.sum(-1) / mask.sum(-1)).sum())
        reference_den += mb.labels.shape[0]
    metrics_ = objective.metrics(sums)
    print("fp32 rows", [(r["mismatch_kl"], r["mismatch_logp_abs"]) for r in rows], "budget", budget,
          "planted", metrics_["mismatch_kl"], metrics_["mismatch_logp_abs"], metrics_["is_weight"])
    assert metrics_["mismatch_kl"] > 100 * budget and metrics_["mismatch_logp_abs"] > 10 * budget, metrics_
    assert metrics_["is_weight"] != pytest.approx(1.0, abs=0.01)
    assert sums["pg"] / sums["num_tokens"] == pytest.approx(reference_num / reference_den, rel=1e-5, abs=1e-7)

    # --- stale weights: vLLM's in-place reload of other weights, caught by the fingerprint ----------------
    engine = t.data.engine
    engine.engine.load_weights(perturbed)  # what the engine serves now: not the policy
    with pytest.raises(TrainingError, match=r"does not serve the policy's weights of version"):
        engine._fingerprint(model, "in the test")
    policy = write_hf_folder(model, model.arch, engine.stage.path / "policy", qat=False, dtype="float32")
    engine.engine.load_weights(policy, method="vllm_inplace")  # vLLM's reload_weights: experts, sinks stay stale
    with pytest.raises(TrainingError, match=r"differ from the trainer's by up to"):
        engine._fingerprint(model, "after vLLM's in-place reload")
    engine.engine.load_weights(policy)  # gptoss's push: the engine serves the policy again
    engine._fingerprint(model, "after gptoss's push")


def _context(t):
    from gptoss_cli.train.objective import StepContext

    return StepContext(step=0, model=t.model, state=t.state)
