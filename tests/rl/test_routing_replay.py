"""Routing replay in GRPO (docs/rl.md, "Routing replay"): gptoss's rollouts record the experts every fed token
went to, as transformers routes the same tokens; vLLM's routed experts are mapped to gptoss's numbering; a
corrupted capture stops the step in one line; in bf16 the trainer's live routing flips against the engine's
and replay takes the mismatch down; GRPO learns with replay on, and a resumed run is the whole one bit for bit."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from gptoss_cli.errors import TrainingError
from gptoss_cli.generate.decode import Sampling
from gptoss_cli.model.config import preset
from gptoss_cli.model.hybrid import HybridModel
from gptoss_cli.rl.routes import check_routes, moe_blocks, vllm_routes
from gptoss_cli.rl.sampling import sample_completions

TINY = preset("tiny")
LAYERS = moe_blocks(HybridModel(TINY, device="meta").pattern.layers)  # [(1, 0), (3, 1), (5, 2)]


# --- capture -----------------------------------------------------------------------------------
def test_rollout_routes_are_transformers_top_k_of_every_fed_token():
    """Rows of 3 prompt lengths (left padding in the batch), fp32: each row's routes are the top-k sets that
    transformers' routers choose for its prompt and every sampled token but the last, run alone."""
    from tests.model.conftest import hf_to_hybrid_state_dict, randomize_, tiny_hf_config, transformers

    torch.manual_seed(0)
    hf = transformers.GptOssForCausalLM(tiny_hf_config()).eval()
    randomize_(hf)
    ours = HybridModel(TINY).eval()
    ours.load_state_dict(hf_to_hybrid_state_dict(hf.state_dict()))
    prompts = [[5, 17, 300, 2], [9, 8, 7, 6, 5, 4, 3], [100]]
    got = sample_completions(ours, prompts, max_new_tokens=6, stop_ids=[], sampling=Sampling(1.0, 1.0),
                             generator=torch.Generator().manual_seed(0), routes=True)
    seen: list = []
    for layer in hf.model.layers:
        layer.mlp.router.register_forward_hook(lambda m, i, o: seen.append(o[2]))
    for prompt, (ids, _, _, routes) in zip(prompts, got):
        seen.clear()
        with torch.no_grad():
            hf(torch.tensor([prompt + ids[:-1]]))
        want = torch.stack(seen, dim=1).sort(-1).values  # [tokens, layers, k]
        assert routes.dtype == torch.uint8 and routes.shape == (len(prompt) + len(ids) - 1, 3, TINY.num_experts_per_tok)
        assert torch.equal(routes.long().sort(-1).values, want)


# --- vLLM's layout -----------------------------------------------------------------------------
def vllm_array(tokens: int, hf_layers: int, k: int, experts: int, seed: int = 0) -> np.ndarray:
    """What vLLM's CompletionOutput.routed_experts holds: [tokens, HF layers, k] uint8, distinct ids per row."""
    g = np.random.default_rng(seed)
    return np.stack([[g.permutation(experts)[:k] for _ in range(hf_layers)] for _ in range(tokens)]).astype(np.uint8)


def test_vllm_routes_map_hf_blocks_to_the_patterns_moe_layers():
    """A pattern whose block 1 has a dense `-` layer instead of experts: MoE layers 0 and 1 read vLLM's layers 0
    and 2; a longer array (a token vLLM computed past the fed ones) is cut to prompt + completion - 1."""
    layers = moe_blocks(list("*E*-*E"))
    assert layers == [(1, 0), (5, 2)]
    array = vllm_array(4 + 3, 3, 2, 4)
    mapped = vllm_routes(array, prompt=4, completion=3, layers=layers)
    assert mapped.shape == (6, 2, 2) and mapped.dtype == torch.uint8
    assert torch.equal(mapped[:, 0], torch.from_numpy(array[:6, 0])) and torch.equal(mapped[:, 1], torch.from_numpy(array[:6, 2]))
    check_routes(mapped, tokens=6, layers=layers, top_k=2, num_experts=4, where="step 1")


def test_vllm_routes_survive_the_engine_worker_protocol():
    """vllm_worker.py sends the array as base64 bytes with shape and dtype; vllm_offline.py reads it back, and
    VllmRollout turns each completion into a sample carrying the mapped routes."""
    from gptoss_cli.generate.engines.base import Completion
    from gptoss_cli.generate.engines.vllm_offline import _array as decode
    from gptoss_cli.generate.engines.vllm_worker import _array as encode
    from gptoss_cli.rl.engines import VllmRollout

    array = vllm_array(5 + 4 - 1, 3, 2, 4, seed=1)
    back = decode(encode(array))
    assert back.dtype == np.uint8 and np.array_equal(back, array)
    engine = VllmRollout.__new__(VllmRollout)
    engine.routes_of = LAYERS
    ids, logprobs, finish, routes = engine._sample([1, 2, 3, 4, 5], Completion([7, 8, 9, 10], [-1.0] * 4, "stop", back))
    assert finish == "stop" and torch.equal(routes, torch.from_numpy(array))
    engine.routes_of = None
    assert len(engine._sample([1], Completion([7], [-1.0], "length", back))) == 3  # not asked: no routes


# --- validity ------------------------------------------------------------------------------------
def good(tokens: int = 5) -> torch.Tensor:
    return torch.tensor([[[0, 1], [2, 3], [1, 3]]] * tokens, dtype=torch.uint8)


CORRUPT = {
    "zeros": (lambda r: torch.zeros_like(r), r"MoE layer 0 \(decoder.layers.1\) are all zeros"),
    "repeated id": (lambda r: r.index_put((torch.tensor([2]), torch.tensor([1])), torch.tensor([[3, 3]], dtype=r.dtype)),
                    r"token 2 of MoE layer 1 \(decoder.layers.3\) is routed to \[3, 3\]: an expert twice"),
    "one layer short": (lambda r: r[:, :2], r"routes for 2 MoE layers, the model has 3 \(missing from decoder.layers.5\)"),
    "out of range": (lambda r: r.index_put((torch.tensor([4]), torch.tensor([2])), torch.tensor([[1, 9]], dtype=r.dtype)),
                     r"token 4 of MoE layer 2 \(decoder.layers.5\) is routed to expert 9, outside \[0, 4\)"),
    "short": (lambda r: r[:3], r"routes for 3 tokens; the prompt and the fed completion hold 5"),
    "missing": (lambda r: None, r"returned no expert routes"),
}


@pytest.mark.parametrize("case", sorted(CORRUPT))
def test_a_corrupted_capture_is_refused_in_one_line(case):
    corrupt, message = CORRUPT[case]
    where = "step 3 (rollout 2), prompt prompts.jsonl:7, completion 1 of rank 0"
    with pytest.raises(TrainingError, match=message) as info:
        check_routes(corrupt(good()), tokens=5, layers=LAYERS, top_k=2, num_experts=4, where=where)
    assert str(info.value.message).startswith(where) and "\n" not in info.value.message
    check_routes(good(), tokens=5, layers=LAYERS, top_k=2, num_experts=4, where=where)  # the intact one passes


def test_a_zeroed_capture_stops_the_grpo_step_naming_step_prompt_and_layer(tmp_path, monkeypatch):
    """Through the loop: the engine's capture zeroed (vLLM's fused MoE has returned that without an error)
    stops step 1 before it trains; the line names the prompt's file and line and the layer."""
    from gptoss_cli.rl import engines
    from gptoss_cli.run.worker import run_worker
    from tests.rl.helpers import grpo_job

    real = engines.GptossRollout.sample

    def zeroed(self, rollout, prompts):
        return [(*s[:3], torch.zeros_like(s[3])) for s in real(self, rollout, prompts)]

    monkeypatch.setattr(engines.GptossRollout, "sample", zeroed)
    job = grpo_job(tmp_path, train_iters=1, routing_replay="rollout")
    with pytest.raises(TrainingError, match=r"^step 1 \(rollout 1\), prompt .*prompts.jsonl:\d+, completion 0 of rank 0: "
                                            r"the expert routes of MoE layer 0 \(decoder.layers.1\) are all zeros"):
        run_worker(job)


# --- the measured mismatch -------------------------------------------------------------------------
# A small model where near-ties are common (16 experts, top-4: bench/rl_replay.py's `small`), bf16, one rollout
# of 8 random prompts x 16 tokens. Measured over seeds 0-7 (bench/rl_replay.py): mismatch_kl without replay /
# with replay from 4.4x to 107x, the replayed one 5e-7 to 8e-7 (what attention and the LM head round
# differently), flip rate 0.9% to 3.6%. The margin, 2x, is half the smallest measured ratio.
REPLAY_MARGIN = 2.0


@pytest.mark.parametrize("seed", [0, 1])
def test_in_bf16_routes_flip_and_replay_takes_the_mismatch_down(seed):
    from bench.peers import bench_arch
    from tests.rl.replay_mismatch import measure

    got = measure(bench_arch("tiny", "num_local_experts=16,num_experts_per_tok=4"), seed)
    none, replay = got["none"], got["rollout"]
    assert none["routing_flip_rate"] > 0 and none["mismatch_kl"] > 0
    assert replay["replayed_as_engine"] == 1.0  # every token with engine ids went to exactly those experts
    assert none["replayed_as_engine"] == 0.0  # ... which live routing does not do
    assert none["mismatch_kl"] > REPLAY_MARGIN * replay["mismatch_kl"], got


# --- GRPO with replay on ------------------------------------------------------------------------------------
def test_grpo_learns_with_rollout_replay(tmp_path):
    """tests/rl/test_grpo_train.py's toy task (reward: the share of even token ids) at its settings, every
    forward replaying the engine's routes: the reward rises as it does without replay (measured 0.52 ->
    0.99 there). 16 steps of the tiny model (about 15 s): learning is what this checks."""
    from gptoss_cli.run.worker import run_worker
    from tests.rl.helpers import grpo_job, metrics

    job = grpo_job(tmp_path, train_iters=16, routing_replay="rollout")
    run_worker(job)
    rows = metrics(job.run_dir)
    rewards = [r["reward_mean"] for r in rows]
    first, last = sum(rewards[:4]) / 4, sum(rewards[-4:]) / 4
    assert 0.35 < first < 0.65 and last > first + 0.25 and last > 0.8, rewards
    assert all(r["routing_flip_rate"] == 0.0 for r in rows)  # fp32: the decode routes as the forward does


def test_resume_with_old_policy_replay_is_the_whole_run_bit_for_bit(tmp_path):
    """2 rollouts of 2 steps, each update replaying the routes the trainer's scoring forward recorded at the
    rollout's weights; checkpoints fall between rollouts, so a resumed run records them anew."""
    import json as _json

    from gptoss_cli.checkpoint.formats.training.record import iter_name
    from gptoss_cli.run.worker import run_worker
    from tests.rl.helpers import grpo_job, metrics
    from tests.rl.test_grpo_train import _checkpoint_weights

    common = dict(train_iters=4, steps_per_rollout=2, save_interval=2, lr_decay_style="constant",
                  routing_replay="old_policy")
    whole = grpo_job(tmp_path / "whole", checkpoint_dir=str(tmp_path / "whole" / "ckpt"), **common)
    run_worker(whole)
    ckpt = str(tmp_path / "split" / "ckpt")
    run_worker(grpo_job(tmp_path / "split", checkpoint_dir=ckpt, **{**common, "train_iters": 2}))
    result = run_worker(grpo_job(tmp_path / "split", checkpoint_dir=ckpt, **common))
    assert result.resumed_from is not None and result.steps == 2
    want, got = metrics(whole.run_dir), metrics(tmp_path / "split" / "run")  # the split run appends to its file
    for field in ("reward_mean", "loss", "grad_norm", "mismatch_kl", "routing_flip_rate", "clip_fraction"):
        assert [r[field] for r in got] == [r[field] for r in want], field
    a, b = (_checkpoint_weights(tmp_path / run / "ckpt" / iter_name(4)) for run in ("whole", "split"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert _json.loads((tmp_path / "split" / "ckpt" / iter_name(4) / "train_state.json").read_text())["rl"]["rollouts"] == 2


def test_old_policy_replays_the_routes_at_the_rollouts_weights(tmp_path):
    """In fp32 the engine routes as the trainer's forward at the rollout's weights (flip rate 0), so replaying
    the old policy's recorded routes and the engine's is the same run, bit for bit; the second update of a
    rollout routes live otherwise, to other experts for some tokens after a step at lr 2e-2."""
    from gptoss_cli.run.worker import run_worker
    from tests.rl.helpers import grpo_job, metrics

    losses = {}
    for mode in ("none", "rollout", "old_policy"):
        job = grpo_job(tmp_path / mode, train_iters=2, steps_per_rollout=2, routing_replay=mode)
        run_worker(job)
        losses[mode] = [(r["loss"], r["grad_norm"]) for r in metrics(job.run_dir)]
    assert losses["old_policy"] == losses["rollout"]
    assert losses["none"][0] == losses["rollout"][0] and losses["none"][1] != losses["rollout"][1]
