"""GRPO's per-step numbers against values computed here from their definitions (rl/objective.py's docstring):
a failed reward left out of its group's statistics, clip_fraction, mismatch_kl as KL(engine || trainer) and
kl_ref per completion token. Pure functions on a hand-made microbatch: no model, no engine.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from gptoss_cli.model.loss import IGNORE_INDEX
from gptoss_cli.rl.objective import ADVANTAGE_EPS, GRPOObjective, group_advantages
from gptoss_cli.train.data import Microbatch


def test_a_failed_reward_is_left_out_of_its_groups_mean_and_std():
    # group 1: rewards 1, (failed), 3, 5 -> mean 3, unbiased std 2 over the three that scored
    got = group_advantages([1.0, None, 3.0, 5.0, 0.0, 2.0], group_size=4, scale=True)
    want = [(1 - 3) / (2 + ADVANTAGE_EPS), 0.0, 0.0, (5 - 3) / (2 + ADVANTAGE_EPS)]
    assert got[:4] == pytest.approx(want, rel=1e-6)
    # group 2 (two completions, none failed): mean 1, std sqrt(2)
    assert got[4:] == pytest.approx([-1 / (math.sqrt(2) + ADVANTAGE_EPS), 1 / (math.sqrt(2) + ADVANTAGE_EPS)], rel=1e-6)
    assert group_advantages([2.0, None, 4.0], group_size=3, scale=False) == [-1.0, 0.0, 1.0]


def _microbatch(logits: torch.Tensor, labels: torch.Tensor, **extras: torch.Tensor) -> tuple[Microbatch, object]:
    return Microbatch(tokens=torch.zeros_like(labels), labels=labels, extras=extras), SimpleNamespace(
        logits=logits, hidden=None)


def test_clip_fraction_mismatch_kl_and_kl_ref_are_their_definitions_per_completion_token():
    g = torch.Generator().manual_seed(0)
    rows, seq, vocab = 2, 5, 7
    logits = torch.randn(rows, seq, vocab, generator=g)
    labels = torch.randint(0, vocab, (rows, seq), generator=g)
    labels[0, :2] = IGNORE_INDEX  # the prompt: not completion tokens
    labels[1, 4] = IGNORE_INDEX
    logp = torch.log_softmax(logits, -1).gather(-1, labels.clamp(min=0)[..., None])[..., 0]
    mask = labels != IGNORE_INDEX
    old = logp + torch.tensor([[0, 0, 0.5, -0.5, 0.01], [0.3, -0.3, 0.0, 0.25, 0]])  # ratio = exp(logp - old)
    engine = old + torch.randn(rows, seq, generator=g) * 0.3
    ref = logp + torch.randn(rows, seq, generator=g) * 0.2
    adv = torch.tensor([[1.0] * seq, [-1.0] * seq])
    objective = GRPOObjective(kl_coeff=0.1, clip_low=0.2, clip_high=0.2)
    mb, output = _microbatch(logits, labels, advantages=adv, old_logp=old, rollout_logp=engine, ref_logp=ref)
    _, _, logs = objective.loss(mb, None, output)
    sums = {k: float(v) for k, v in logs.items()}
    sums.setdefault("num_tokens", float(mask.sum()))
    sums.update({k: 0.0 for k in objective.sums if k not in sums})
    metrics = objective.metrics(sums)

    tokens = mask.sum().item()
    ratio = torch.exp(logp - old)
    clipped = ((ratio < 0.8) & (adv < 0)) | ((ratio > 1.2) & (adv > 0))
    assert metrics["clip_fraction"] == pytest.approx((clipped & mask).sum().item() / tokens, abs=1e-6)
    assert 0 < metrics["clip_fraction"] < 1  # the case exercises both sides of the mask
    # KL(engine || trainer) per token sampled by the engine: E_engine[log q_engine - log p_trainer]; its
    # k3 estimate from the engine's samples is exp(d) - 1 - d with d = log p_trainer - log q_engine
    d = old - engine
    want_mismatch = ((torch.exp(d) - 1 - d) * mask).sum().item() / tokens
    assert metrics["mismatch_kl"] == pytest.approx(want_mismatch, rel=1e-5)
    reverse = ((torch.exp(-d) - 1 + d) * mask).sum().item() / tokens  # the other direction: must differ
    assert abs(reverse - want_mismatch) > 1e-3 * want_mismatch
    # kl_ref: k3 of the policy against the reference, exp(ref - logp) - (ref - logp) - 1, per completion token
    diff = ref - logp
    want_kl = ((torch.exp(diff) - diff - 1) * mask).sum().item() / tokens
    assert metrics["kl_ref"] == pytest.approx(want_kl, rel=1e-5)
    per_row = ((torch.exp(diff) - diff - 1) * mask).sum().item() / rows
    assert abs(metrics["kl_ref"] - per_row) > 1e-3 * want_kl  # per token, not per completion


def test_data_parallel_ranks_sample_different_prompts_and_together_the_whole_rollout():
    from gptoss_cli.rl.prompts import PromptOrder

    order = PromptOrder(num_prompts=10, seed=3)
    for rollout in range(4):  # rollouts 1 and 3 cross an epoch boundary (8 prompts a rollout, 10 prompts)
        ranks = [order.rank_slice(rollout, 8, r, 4) for r in range(4)]
        positions = [order.index(k) for k in range(rollout * 8, rollout * 8 + 8)]
        assert sum(ranks, []) == positions  # the rollout's prompts, split between the ranks, none twice


def test_each_rank_and_each_rollout_samples_from_its_own_random_stream(monkeypatch):
    from gptoss_cli.rl import engines

    drawn = []
    monkeypatch.setattr(engines, "sample_completions",
                        lambda model, prompts, generator, **kw: drawn.append(torch.rand(4, generator=generator)))

    def stream(rollout: int, dp_rank: int, seed: int = 7) -> torch.Tensor:
        engine = engines.GptossRollout(None, sampling=None, max_new_tokens=1, stop_ids=[], batch_size=None, seed=seed,
                                       dp_rank=dp_rank)
        engine.sample(rollout, [[1]])
        return drawn[-1]

    assert torch.equal(stream(0, 0), stream(0, 0))  # reproducible: a resumed run samples the same
    assert not torch.equal(stream(0, 0), stream(0, 1))  # another data-parallel rank
    assert not torch.equal(stream(0, 0), stream(1, 0))  # another rollout
    assert not torch.equal(stream(0, 0), stream(0, 0, seed=8))  # another rl.seed


@pytest.mark.parametrize("field", ["seed", "group_size", "prompts_digest"])
def test_a_resume_with_another_rl_setting_is_refused(field):
    from gptoss_cli.errors import ConfigError
    from gptoss_cli.rl.rollouts import RolloutData

    saved = {"prompts": "builtin:arithmetic", "prompts_digest": "ab", "reward": "r", "seed": 1, "group_size": 4,
             "steps_per_rollout": 1}
    now = {**saved, field: saved[field] + (1 if isinstance(saved[field], int) else "c")}
    run = SimpleNamespace(state_dict=lambda: now, rl=SimpleNamespace(steps_per_rollout=1))
    with pytest.raises(ConfigError, match=f"rl.{field} changed"):
        RolloutData.resumed(run, 2, {"rl": saved})
    RolloutData.resumed(SimpleNamespace(state_dict=lambda: saved, rl=run.rl), 2, {"rl": saved})


def test_keeping_the_trainer_logprobs_for_the_rollout_file_changes_neither_loss_nor_gradient():
    """rl.save_rollouts: with one step per rollout the loss leaves its own detached log-probs in extras["old_logp"]
    (the trainer's at the rollout's weights), after using them, exactly as the plain objective computes."""
    g = torch.Generator().manual_seed(1)
    labels = torch.randint(0, 7, (2, 5), generator=g)
    labels[:, 0] = IGNORE_INDEX
    extras = dict(advantages=torch.tensor([[1.0] * 5, [-0.5] * 5]), rollout_logp=-torch.rand(2, 5, generator=g))
    base = torch.randn(2, 5, 7, generator=g)
    got = []
    for keep in (False, True):
        logits = base.clone().requires_grad_(True)
        mb, output = _microbatch(logits, labels, **{k: v.clone() for k, v in extras.items()})
        loss, _, _ = GRPOObjective(keep_old_logp=keep, kl_coeff=0.0).loss(mb, None, output)
        loss.backward()
        got.append((loss.detach(), logits.grad, mb.extras.get("old_logp")))
    (plain_loss, plain_grad, none), (loss, grad, kept) = got
    assert none is None and torch.equal(plain_loss, loss) and torch.equal(plain_grad, grad)
    logp = torch.log_softmax(base, -1).gather(-1, labels.clamp(min=0)[..., None])[..., 0]
    at = labels != IGNORE_INDEX
    assert torch.allclose(kept[at], logp[at], rtol=0, atol=1e-6) and not kept.requires_grad
