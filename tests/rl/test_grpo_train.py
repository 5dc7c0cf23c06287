"""GRPO through `gptoss train`'s own loop on the tiny model: gptoss rollouts agree with the trainer, it learns a
toy reward at EP=1 and EP=2 (and does not with the gradient zeroed), a resumed run is the uninterrupted one
bit for bit, and a failing reward is a warning, not a crash.

The toy task (tests/rl/helpers.py): the reward is the share of even token ids in a completion, which a
randomly initialised model starts near 0.5 on; 2 prompts x 8 completions of 8 tokens per step, lr 2e-2.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from gptoss_cli.rl.objective import GRPOObjective
from gptoss_cli.run.worker import run_worker
from gptoss_cli.train.progress import RunWarning
from tests.rl.helpers import grpo_job, metrics
from tests.train.dist_helpers import run_distributed

LEARN_STEPS = 16


def _rewards(run_dir) -> list[float]:
    return [r["reward_mean"] for r in metrics(run_dir)]


def _first_last(rewards: list[float], k: int = 4) -> tuple[float, float]:
    return sum(rewards[:k]) / k, sum(rewards[-k:]) / k


class ZeroGradient(GRPOObjective):
    """GRPO whose loss is multiplied by 0: every gradient is zero, the sampling and rewards as before."""

    def loss(self, microbatch, config, output):
        loss_sum, normaliser, logs = super().loss(microbatch, config, output)
        return loss_sum * 0.0, normaliser, logs


def test_gptoss_rollouts_in_fp32_match_the_trainer_and_log_every_metric(tmp_path):
    job = grpo_job(tmp_path, train_iters=2, steps_per_rollout=2, kl_coeff=0.1)
    result = run_worker(job)
    rows = metrics(job.run_dir)
    assert [r["step"] for r in rows] == [1, 2] and result.steps == 2
    for r in rows:
        # the KV-cache decode against training's forward, same weights, fp32: rounding only (k3 ~ d^2 / 2)
        assert 0 <= r["mismatch_kl"] < 1e-6 and r["mismatch_logp_abs"] < 1e-4
        for field in ("reward_mean", "reward_std", "zero_variance_groups", "kl_ref", "clip_fraction", "entropy",
                      "completion_length", "rollout_time_s", "train_time_s", "rollout_tokens_per_s", "tokens_per_s",
                      "weights_version", "reward_failures"):
            assert field in r, field
        assert 1 <= r["completion_length"] <= 8
    assert rows[0]["kl_ref"] == 0.0 and rows[1]["kl_ref"] > 0  # the reference is the initial policy
    assert rows[0]["clip_fraction"] == 0.0  # at the old policy the ratio is 1
    assert rows[1]["rollout_time_s"] == 0.0 and rows[0]["rollout_time_s"] > 0  # one rollout, two steps


def test_reward_rises_at_ep1_and_not_with_the_gradient_zeroed(tmp_path):
    learn = grpo_job(tmp_path / "learn", train_iters=LEARN_STEPS)
    run_worker(learn)
    zero = dataclasses.replace(grpo_job(tmp_path / "zero", train_iters=LEARN_STEPS),
                               objective=ZeroGradient(temperature=1.0, max_new_tokens=8))
    run_worker(zero)
    first, last = _first_last(_rewards(learn.run_dir))
    z_first, z_last = _first_last(_rewards(zero.run_dir))
    # measured: 0.52 -> 0.99 with lr 2e-2; the control's rewards are a random walk around 0.5 (std of a
    # 16-completion mean of shares of 8 tokens: about 0.04)
    assert 0.35 < first < 0.65 and last > first + 0.25 and last > 0.8, _rewards(learn.run_dir)
    assert abs(z_last - 0.5) < 0.15 and abs(z_last - z_first) < 0.15, _rewards(zero.run_dir)


def _ep2_worker(rank: int, folder: str) -> list[float]:
    job = grpo_job(Path(folder), train_iters=LEARN_STEPS, ep_size=2, save_rollouts=True)
    run_worker(job)
    return _rewards(job.run_dir) if rank == 0 else []


def test_reward_rises_at_ep2(tmp_path):
    """EP=2 on 2 processes (DP=2): each rank samples its own prompt's group with its half of the experts, the
    decode steps in step over the EP group (rl/sampling.py); rank 0 writes both ranks' completions of each rollout
    (rl.save_rollouts), whose rewards are the step's reward_mean."""
    pq = pytest.importorskip("pyarrow.parquet")

    rewards = run_distributed(_ep2_worker, 2, tmp_path / "out", str(tmp_path), timeout=300)[0]
    first, last = _first_last(rewards)
    assert len(rewards) == LEARN_STEPS
    assert 0.35 < first < 0.65 and last > first + 0.25 and last > 0.8, rewards
    files = sorted((tmp_path / "run" / "rollouts").iterdir())
    assert len(files) == LEARN_STEPS
    for path, reward in zip(files, rewards):
        table = pq.read_table(path)
        assert table.column("rank").to_pylist() == [0] * 8 + [1] * 8
        assert sum(table.column("reward").to_pylist()) / 16 == pytest.approx(reward, rel=1e-12)


def _checkpoint_weights(folder) -> dict[str, torch.Tensor]:
    import torch.distributed.checkpoint as dcp

    from gptoss_cli.checkpoint.storage.dcp_io import read_metadata

    meta = read_metadata(folder)
    want = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in meta.state_dict_metadata.items()
            if k.startswith(("model.", "optimizer.")) and hasattr(m, "size")}
    dcp.load(want, checkpoint_id=str(folder))
    return want


def test_resume_mid_run_gives_the_same_rewards_weights_and_rollout_files_bit_for_bit(tmp_path):
    """4 steps (2 rollouts of 2 steps: old log-probs scored at rollout time) against 2 steps, a checkpoint, and
    a second run that resumes it for the last 2; both save their rollouts (rl.save_rollouts), the same rows."""
    common = dict(train_iters=4, steps_per_rollout=2, save_interval=2, kl_coeff=0.05, lr_decay_style="constant",
                  save_rollouts=True)
    whole = grpo_job(tmp_path / "whole", checkpoint_dir=str(tmp_path / "whole" / "ckpt"), **common)
    run_worker(whole)
    ckpt = str(tmp_path / "split" / "ckpt")
    run_worker(grpo_job(tmp_path / "split", checkpoint_dir=ckpt, **{**common, "train_iters": 2}))
    resumed = grpo_job(tmp_path / "split", checkpoint_dir=ckpt, **common)
    result = run_worker(resumed)
    assert result.resumed_from is not None and result.steps == 2
    want, got = metrics(whole.run_dir), metrics(resumed.run_dir)
    for field in ("reward_mean", "loss", "grad_norm", "mismatch_kl", "kl_ref", "entropy"):
        assert [r[field] for r in got] == [r[field] for r in want], field
    from gptoss_cli.checkpoint.formats.training.record import iter_name

    a, b = (_checkpoint_weights(tmp_path / run / "ckpt" / iter_name(4)) for run in ("whole", "split"))
    assert a.keys() == b.keys() and any(k.startswith("model.") for k in a)
    assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])][:3]
    state = json.loads((tmp_path / "split" / "ckpt" / iter_name(4) / "train_state.json").read_text())
    assert state["rl"]["rollouts"] == 2 and state["rl"]["weights_version"] == 2
    files = [sorted((Path(job.run_dir) / "rollouts").iterdir()) for job in (whole, resumed)]
    assert [p.name for p in files[0]] == [p.name for p in files[1]] == ["rollout_000001.parquet", "rollout_000002.parquet"]
    for a, b in zip(*files):  # the same rows; prompt_source names each run's own prompts file
        pq = pytest.importorskip("pyarrow.parquet")
        ta, tb = pq.read_table(a), pq.read_table(b)
        assert ta.drop(["prompt_source"]).equals(tb.drop(["prompt_source"])) and ta.schema.equals(tb.schema, True)
        assert [s.replace("whole", "split") for s in ta.column("prompt_source").to_pylist()] == \
            tb.column("prompt_source").to_pylist()


def flaky_reward(prompt_messages, completion_text, completion_ids, record):
    """Raises on the prompt 'Hi', returns NaN on 'Thanks', the even share elsewhere."""
    text = prompt_messages[-1]["content"][0]["text"]
    if text == "Hi":
        raise RuntimeError("sandbox timed out")
    if text == "Thanks":
        return float("nan")
    return sum(1 for t in completion_ids if t % 2 == 0) / len(completion_ids)


def test_a_failing_reward_is_one_line_naming_the_prompt_and_the_run_goes_on(tmp_path):
    job = grpo_job(tmp_path, train_iters=4, global_batch_size=32, micro_batch_size=16,
                   rl_reward="tests.rl.test_grpo_train:flaky_reward")
    events = []
    result = run_worker(job, progress=events.append)
    assert result.steps == 4
    warnings = [e.message for e in events if isinstance(e, RunWarning)]
    rows = metrics(job.run_dir)
    failures = sum(r["reward_failures"] for r in rows)
    assert failures >= 8 and failures % 8 == 0  # whole groups: every completion of 'Hi' / 'Thanks'
    lines = [w for w in warnings if w.startswith("reward failed")]
    assert lines and all("\n" not in w and "prompts.jsonl:" in w for w in lines)
    assert any("RuntimeError: sandbox timed out" in w for w in lines) or any("returned nan" in w for w in lines)


RECOMPUTE = {
    "full": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=3),
    "selective": dict(recompute_granularity="selective", recompute_modules=["core_attn", "moe_act", "layernorm"]),
}


def _step_figures(run_dir) -> list[tuple]:
    return [(r["loss"], r["grad_norm"], r["reward_mean"], r["kl_ref"], r["mismatch_kl"]) for r in metrics(run_dir)]


@pytest.fixture(scope="module")
def plain_grpo_run(tmp_path_factory):
    job = grpo_job(tmp_path_factory.mktemp("plain"), train_iters=2, steps_per_rollout=1, kl_coeff=0.1)
    run_worker(job)
    return _step_figures(job.run_dir)


@pytest.mark.parametrize("recompute", sorted(RECOMPUTE))
def test_grpo_under_activation_recompute_equals_the_plain_run_bit_for_bit(tmp_path, recompute, plain_grpo_run,
                                                                          monkeypatch):
    """Recompute runs the same forward again for the backward on the same inputs, so two GRPO steps (rollout,
    policy and reference log-probs, the update) give the plain run's rewards exactly and its loss, gradient
    norm and KLs to the rounding of one fp32 reduction; the spy shows the recompute ran.

    Error model: a recomputed activation may come back in another memory layout, and a CPU reduction over
    it may then add its terms in another order (which order depends on the CPU's vector width: an AVX-512
    EPYC differed in the last bit of kl_ref). Two fp32 sums of the same n terms differ by at most
    (n - 1) * 2**-24 * sum|x_i|; the KLs are sums of non-negative terms over a step's 128 completion
    tokens, so 127 * 2**-24 < 1e-5 relative, which bounds the loss and the norm here too. A recompute that
    computes something else (another input, a dropped piece) moves them by orders of magnitude more."""
    from gptoss_cli.model import recompute as recompute_module

    calls = []
    real = recompute_module.checkpoint
    monkeypatch.setattr(recompute_module, "checkpoint", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    job = grpo_job(tmp_path, train_iters=2, steps_per_rollout=1, kl_coeff=0.1, **RECOMPUTE[recompute])
    run_worker(job)
    assert calls, "no recomputed piece ran"
    got = _step_figures(job.run_dir)
    assert [step[2] for step in got] == [step[2] for step in plain_grpo_run]  # rewards: the rollouts are not recomputed
    assert got == [tuple(pytest.approx(v, rel=1e-5, abs=1e-12) for v in step) for step in plain_grpo_run]


def test_grpo_with_emulated_mxfp8_rollouts_agree_with_the_trainer(tmp_path, plain_grpo_run):
    """Under MXFP8 the rollout's decode and the trainer's forward quantise each token's activations in
    the same blocks of 32 along the row, so they still differ by fp32 summation order only: the same
    bound as the fp32 test above. The figures differ from the plain fp32 run's (FP8 took effect)."""
    job = grpo_job(tmp_path, train_iters=2, steps_per_rollout=1, kl_coeff=0.1, fp8_recipe="mxfp8", fp8_emulation=True)
    run_worker(job)
    rows = metrics(job.run_dir)
    for r in rows:
        assert 0 <= r["mismatch_kl"] < 1e-6 and r["mismatch_logp_abs"] < 1e-4
        assert all(map(lambda v: v == v, (r["loss"], r["grad_norm"])))  # finite, not NaN
    assert _step_figures(job.run_dir) != plain_grpo_run
