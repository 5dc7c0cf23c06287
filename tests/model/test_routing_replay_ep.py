"""Routing replay under expert parallelism (EP=2, two gloo processes): each rank holds half the experts and
replays global ids through the dispatcher's all-to-all; its log-probabilities and router gradients equal
transformers' with patched routers on the rank's own batch, and the experts' gradients the sum over both
ranks' batches (fp32, tests/model/test_routing_replay.py's tolerance). The rollout engine, decoding in step
over the group, records global ids: transformers' top-k of every fed token.
One spawned pair (about 15 s on 2 cores): EP is the path the brief names."""

from __future__ import annotations

import torch

from tests.model.replay_inputs import TINY, TOL, batch, random_routes, weights_for
from tests.train.dist_helpers import run_distributed

PROMPTS = {0: [[5, 17, 300, 2], [100]], 1: [[9, 8, 7, 6, 5, 4, 3], [44, 45]]}


def _hf_reference():
    from tests.model.conftest import randomize_, tiny_hf_config, transformers

    torch.manual_seed(0)
    hf = transformers.GptOssForCausalLM(tiny_hf_config()).eval()
    randomize_(hf)
    return hf


def _worker(rank: int, weights: str) -> dict:
    import torch.distributed as dist

    from gptoss_cli.generate.decode import Sampling
    from gptoss_cli.model.dispatcher import AllToAllTokenDispatcher
    from gptoss_cli.model.hybrid import HybridModel
    from gptoss_cli.model.routes import ExpertRoutes
    from gptoss_cli.rl.sampling import sample_completions
    from gptoss_cli.train.objective import token_log_probs

    group = dist.group.WORLD
    model = HybridModel(TINY, expert_offset=2 * rank, num_local_experts=2,
                        token_dispatcher_factory=lambda j, layer: AllToAllTokenDispatcher(4, 2, rank, group)).train()
    model.load_state_dict(torch.load(weights), strict=False)  # the parent's transformers weights, rearranged
    model.aux_loss_coef = 0.0
    ids, labels = batch(seed=1 + rank)
    out = model(ids, routes=ExpertRoutes(replay=random_routes(*ids.shape, seed=3 + rank)))
    logp = token_log_probs(out, labels)
    (logp * weights_for(ids)).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.eval()
    samples = sample_completions(model, PROMPTS[rank], max_new_tokens=5, stop_ids=[], sampling=Sampling(1.0, 1.0),
                                 generator=torch.Generator().manual_seed(rank), group=group, routes=True)
    return {"logp": logp.detach(), "grads": grads, "samples": samples}


def test_replay_and_capture_at_ep2_equal_transformers(tmp_path):
    from tests.model.conftest import hf_to_hybrid_state_dict
    from tests.model.test_routing_replay import hf_copy, hf_run, patch_routers

    hf_base = _hf_reference()
    torch.save(hf_to_hybrid_state_dict(hf_base.state_dict()), tmp_path / "weights.pt")
    got = run_distributed(_worker, 2, tmp_path / "out", str(tmp_path / "weights.pt"), timeout=300,
                          preload=("gptoss_cli.model.hybrid", "gptoss_cli.rl.sampling"))
    expert_sum: dict[str, torch.Tensor] = {}
    for rank in (0, 1):
        ids, labels = batch(seed=1 + rank)
        hf = hf_copy(hf_base)
        patch_routers(hf, random_routes(*ids.shape, seed=3 + rank))
        want_logp, want_grads = hf_run(hf, ids, labels, weights_for(ids))
        torch.testing.assert_close(got[rank]["logp"], want_logp, **TOL)
        for name, grad in want_grads.items():
            if "experts" in name:
                expert_sum[name] = expert_sum.get(name, 0) + grad
            elif "router" in name:  # the rank's own tokens only (no data-parallel reduction here)
                torch.testing.assert_close(got[rank]["grads"][name], grad, **TOL, msg=lambda m, n=name: f"{n}: {m}")
    for rank in (0, 1):  # each rank's experts got the gradients of both ranks' tokens routed to them
        for name, grad in got[rank]["grads"].items():
            if "experts" in name:
                torch.testing.assert_close(grad, expert_sum[name][2 * rank:2 * rank + 2], **TOL,
                                           msg=lambda m, n=name: f"rank {rank} {n}: {m}")
    _captures_are_transformers_top_k(hf_base, got)


def _captures_are_transformers_top_k(hf, got) -> None:
    seen: list = []
    for layer in hf.model.layers:
        layer.mlp.router.register_forward_hook(lambda m, i, o: seen.append(o[2]))
    for rank in (0, 1):
        for prompt, (ids, _, _, routes) in zip(PROMPTS[rank], got[rank]["samples"]):
            seen.clear()
            with torch.no_grad():
                hf(torch.tensor([prompt + ids[:-1]]))
            want = torch.stack(seen, dim=1).sort(-1).values
            assert torch.equal(routes.long().sort(-1).values, want), (rank, prompt)
