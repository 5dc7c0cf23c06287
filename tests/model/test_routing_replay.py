"""Routing replay (model/routes.py) against an independent forward: transformers' GptOssForCausalLM whose
router modules are patched to send each token to given expert ids, weighted by the softmax of the router's
own logits at those ids. Log-probabilities and every gradient (the routers' included) must agree in fp32,
as the unpatched models agree (tests/model/test_hybrid_vs_transformers.py: same sums in another order,
rtol/atol 1e-5); the routes must survive activation recompute and the overlap schedule's plan."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gptoss_cli.model.hybrid import HybridModel
from gptoss_cli.model.recompute import RecomputePlan
from gptoss_cli.model.routes import ExpertRoutes
from gptoss_cli.train.objective import token_log_probs
from tests.model.conftest import TINY, hf_to_hybrid_state_dict
from tests.model.replay_inputs import TOL, E, K, L, batch, random_routes, weights_for

def patch_routers(hf_model, routes: torch.Tensor | None, seen: list | None = None) -> None:
    """Each HF router sends token t of layer i to routes[..., i, :] (flattened like its input), with the
    softmax of its own logits at those ids; -1 rows keep its top-k. `seen` collects the live top-k."""
    for i, layer in enumerate(hf_model.model.layers):
        router = layer.mlp.router

        def forward(hidden, _r=router, _i=i):
            logits = F.linear(hidden, _r.weight, _r.bias)
            top, live = torch.topk(logits, _r.top_k, dim=-1)
            if seen is not None:
                seen.append(live)
            if routes is None:
                return logits, torch.softmax(top, dim=1), live
            given = routes[:, :, _i].reshape(-1, K).long()
            ids = torch.where(given[:, :1] >= 0, given, live)
            return logits, torch.softmax(logits.gather(-1, ids), dim=1), ids

        router.forward = forward


def ours_from(hf_model) -> HybridModel:
    model = HybridModel(TINY).train()
    model.load_state_dict(hf_to_hybrid_state_dict(hf_model.state_dict()), strict=True)
    model.aux_loss_coef = 0.0
    return model


def hf_copy(hf_tiny):
    import copy

    return copy.deepcopy(hf_tiny).train()


def hf_run(hf_model, ids, labels, w):
    logits = hf_model(ids).logits.float()
    logp = torch.log_softmax(logits, -1).gather(-1, labels[..., None])[..., 0]
    (logp * w).sum().backward()
    as_ours = HybridModel(TINY, device="meta").to_empty(device="cpu")  # the grads under our names and layout
    as_ours.load_state_dict(hf_to_hybrid_state_dict({n: p.grad for n, p in hf_model.named_parameters()}))
    return logp.detach(), {n: p.detach() for n, p in as_ours.named_parameters()}


def ours_run(model, ids, labels, w, routes):
    out = model(ids, routes=routes)
    logp = token_log_probs(out, labels)
    (logp * w).sum().backward()
    return logp.detach(), {n: p.grad for n, p in model.named_parameters()}, out


def test_replayed_forward_equals_transformers_with_patched_routers(hf_tiny):
    ids, labels = batch()
    routes = random_routes(*ids.shape)
    w = weights_for(ids)
    hf = hf_copy(hf_tiny)
    patch_routers(hf, routes)
    want_logp, want_grads = hf_run(hf, ids, labels, w)
    got_logp, got_grads, _ = ours_run(ours_from(hf_tiny), ids, labels, w, ExpertRoutes(replay=routes))
    torch.testing.assert_close(got_logp, want_logp, **TOL)
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, **TOL, msg=lambda m, n=name: f"{n}: {m}")
    assert got_grads["decoder.layers.1.mlp.router.weight"].abs().sum() > 0  # the router learns under replay


def test_replay_changes_the_forward_where_the_ids_differ_from_live(hf_tiny):
    """The check above is not vacuous: the replayed forward is not the live one."""
    ids, labels = batch()
    model = ours_from(hf_tiny)
    with torch.no_grad():
        live = token_log_probs(model(ids), labels)
        replayed = token_log_probs(model(ids, routes=ExpertRoutes(replay=random_routes(*ids.shape))), labels)
    assert (live - replayed).abs().max() > 1e-2


def test_replaying_the_live_routes_is_the_live_forward_bit_for_bit(hf_tiny):
    ids, labels = batch()
    model = ours_from(hf_tiny)
    with torch.no_grad():
        live = model(ids, routes=ExpertRoutes(record=True))
        again = model(ids, routes=ExpertRoutes(engine=live.live_routes, replay=live.live_routes))
        plain = model(ids)
    assert torch.equal(token_log_probs(again, labels), token_log_probs(plain, labels))
    assert int(again.route_flips.sum()) == 0 and int(again.route_pairs.sum()) == ids.numel() * L


def test_flips_count_the_token_layer_pairs_whose_live_set_differs(hf_tiny):
    """Counted against transformers' top-k (its patched routers' own, each on the input the replay of the
    layers before gave it), by sets: the order of the k ids does not count."""
    ids, labels = batch()
    routes = random_routes(*ids.shape)
    seen: list = []
    hf = hf_copy(hf_tiny)
    patch_routers(hf, routes, seen)
    with torch.no_grad():
        hf(ids)
    live = torch.stack(seen, dim=1).reshape(*ids.shape, L, K)
    given = routes[..., 0] >= 0
    differ = (live.sort(-1).values != routes.long().sort(-1).values).any(-1) & given
    same = (~differ & given).nonzero()[0]
    routes[tuple(same)] = routes[tuple(same)].flip(-1)  # the same set in another order is no flip
    with torch.no_grad():
        out = ours_from(hf_tiny)(ids, routes=ExpertRoutes(engine=routes, replay=routes, record=True))
    assert int(out.route_flips.sum()) == int(differ.sum()) > 0
    assert int(out.route_pairs.sum()) == int(given.sum())
    assert torch.equal(out.live_routes, live)  # recorded before replay: the live ids, not the given


@pytest.mark.parametrize("plan", [RecomputePlan(full_units=((0, 6),)), RecomputePlan(modules=frozenset({"moe", "layernorm"}))],
                         ids=["full", "selective"])
def test_recompute_replays_the_same_ids(hf_tiny, plan):
    ids, labels = batch()
    routes = ExpertRoutes(replay=random_routes(*ids.shape))
    w = weights_for(ids)
    want_logp, want_grads, _ = ours_run(ours_from(hf_tiny), ids, labels, w, routes)
    model = ours_from(hf_tiny)
    model.set_recompute(plan)
    got_logp, got_grads, _ = ours_run(model, ids, labels, w, routes)
    assert torch.equal(got_logp, want_logp)
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, rtol=0, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


def test_schedule_plan_routes_as_the_forward(hf_tiny):
    """The overlap schedule's plan (model/schedule_plan.py) hands each E layer's pre_dispatch node its ids."""
    ids, labels = batch()
    routes = random_routes(*ids.shape)
    model = ours_from(hf_tiny)
    with torch.no_grad():
        want = model(ids, labels=labels, routes=ExpertRoutes(engine=routes, replay=routes))
        got = model.build_schedule_plan(ids, labels=labels, routes=ExpertRoutes(engine=routes, replay=routes)).forward()
    torch.testing.assert_close(got["loss"], want.loss, rtol=0, atol=0)
    assert torch.equal(got["extra"].route_flips, want.route_flips) and int(want.route_flips.sum()) > 0


def test_aux_loss_under_replay_counts_the_replayed_experts_with_live_probabilities(hf_tiny):
    """docs/rl.md, "Routing replay": f_e from the experts the tokens went to, P_e from the live router's softmax,
    computed here from transformers' router logits (patched model) and the ids."""
    ids, _ = batch()
    routes = random_routes(*ids.shape, live_every=None)  # every token replayed
    hf = hf_copy(hf_tiny)
    patch_routers(hf, routes)
    with torch.no_grad():
        logits = hf(ids, output_router_logits=True).router_logits
    probs = torch.cat([torch.softmax(x.float(), -1) for x in logits])
    counts = torch.cat([F.one_hot(routes[:, :, i].reshape(-1, K).long(), E).sum(1) for i in range(L)]).float()
    want = E * (counts.mean(0) * probs.mean(0)).sum()  # f_e: assignments per token and layer
    model = ours_from(hf_tiny)
    model.aux_loss_coef = 0.01
    out = model(ids, routes=ExpertRoutes(replay=routes))
    torch.testing.assert_close(out.aux_loss.detach(), want, **TOL)


def test_routes_of_the_wrong_shape_are_one_line(hf_tiny):
    from gptoss_cli.errors import ConfigError

    ids, _ = batch()
    with pytest.raises(ConfigError, match=r"routes.replay has shape .*3 MoE layers"):
        ours_from(hf_tiny)(ids, routes=ExpertRoutes(replay=random_routes(*ids.shape)[:, :, :2]))


def test_lora_adapted_experts_follow_the_replayed_ids(tmp_path):
    """LoRA on every target (the experts' fc1 and fc2 included) with replay: transformers + PEFT with our
    exported adapter and patched routers gives our logits (tests/model/test_lora_vs_peft.py's tolerance)."""
    peft = pytest.importorskip("peft")
    from tests.model.test_lora_vs_peft import LOGITS_REL, _adapted, _tokens, _write_peft
    from tests.model.tiny_checkpoints import load_hf_reference, write_converted_pair

    hf, hybrid = write_converted_pair(tmp_path / "pair", "bf16", seed=3)
    model, settings = _adapted(hybrid)
    folder = _write_peft(tmp_path / "adapter", model, settings, hf)
    ids = _tokens(model.arch.vocab_size)
    routes = random_routes(*ids.shape)
    base = load_hf_reference(hf)
    patch_routers(base, routes)
    with torch.no_grad():
        ours = model(ids, routes=ExpertRoutes(replay=routes)).logits
        live = model(ids).logits
        theirs = peft.PeftModel.from_pretrained(base, str(folder)).eval()(ids).logits
    assert (live - theirs).abs().max() > 100 * LOGITS_REL * theirs.abs().max()  # the replay shows
    assert (ours - theirs).abs().max().item() <= LOGITS_REL * theirs.abs().max().item()


def test_context_parallel_slices_the_ids_with_their_tokens():
    """Each CP rank's microbatch holds the ids of exactly its tokens (the MoE layers are token-local, so a
    rank's forward replays its tokens' ids): Microbatch.context_slice cuts both along the sequence alike."""
    from gptoss_cli.train.data import Microbatch

    ids, labels = batch()
    routes = random_routes(*ids.shape)
    position = torch.arange(ids.shape[1]).expand(ids.shape[0], -1)
    stamped = routes.clone()
    stamped[..., 0] = torch.where(routes[..., 0] >= 0, position[..., None].to(routes.dtype), routes[..., 0])
    mb = Microbatch(tokens=ids[:, :20], labels=labels[:, :20], routes=ExpertRoutes(engine=stamped[:, :20],
                                                                                     replay=stamped[:, :20]))
    for rank in (0, 1):
        part = mb.context_slice(2, rank)
        assert torch.equal(part.tokens, ids[:, 10 * rank:10 * rank + 10])
        for t in (part.routes.engine, part.routes.replay):
            given = t[..., 0] >= 0
            assert torch.equal(t[..., 0][given].long(), (position[:, 10 * rank:10 * rank + 10, None]
                                                         .expand(-1, -1, L)[given]))
        assert part.model_inputs()["routes"] is part.routes
