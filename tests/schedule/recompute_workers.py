"""Per-rank body of the recompute tests (importable by spawned processes): one training step's
gradients under each recompute setting, with counts of the recomputed functions and all-to-alls."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch.distributed as dist

import gptoss_cli.model.attention.layer as attention
import gptoss_cli.model.mlp as mlp
import gptoss_cli.model.moe as moe
import gptoss_cli.model.norm as norm
from gptoss_cli.parallel.state import init_parallel
from gptoss_cli.schedule import get_forward_backward_func
from gptoss_cli.train.data import DataLoaderState
from gptoss_cli.train.objective import forward_step
from gptoss_cli.train.provider import HybridModelProvider
from gptoss_cli.train.setup import setup_model_and_optimizer
from tests.train.dist_helpers import named_grads
from tests.train.jobs import TINY, optimizer_config, runtime_config
from tests.train.workers import RandomTokens

SEQ = 16
SETTINGS: dict[str, dict[str, Any]] = {
    "none": {},
    "selective": dict(recompute_granularity="selective", recompute_modules=["core_attn", "moe_act", "layernorm"]),
    "selective_moe": dict(recompute_granularity="selective", recompute_modules=["moe", "mlp", "layernorm"]),
    "full_uniform": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=2),
    "full_block": dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=3),
}
# name: the (module, attribute) places of the function whose calls show what ran again (the experts
# call the clamped SwiGLU as model/moe.py imported it, the `-` layers as model/mlp.py defines it)
COUNTED = {"sink_attention": ((attention, "document_attention"),),  # the core's one call per forward
           "clamped_swiglu": ((moe, "clamped_swiglu"), (mlp, "clamped_swiglu")),
           "qkv_norm": ((attention, "rms_norm"),), "mlp_norm": ((norm, "rms_norm"),),
           "all_to_all": ((dist, "all_to_all_single"),)}


@contextlib.contextmanager
def counting(calls: dict[str, int]) -> Iterator[None]:
    saved = {(name, i): getattr(mod, attr) for name, places in COUNTED.items() for i, (mod, attr) in enumerate(places)}

    def wrap(name: str, fn: Any) -> Any:
        def counted(*args: Any, **kwargs: Any) -> Any:
            calls[name] = calls.get(name, 0) + 1
            return fn(*args, **kwargs)
        return counted

    try:
        for name, places in COUNTED.items():
            for i, (mod, attr) in enumerate(places):
                setattr(mod, attr, wrap(name, saved[name, i]))
        yield
    finally:
        for name, places in COUNTED.items():
            for i, (mod, attr) in enumerate(places):
                setattr(mod, attr, saved[name, i])


def recompute_worker(rank: int, ep: int, overlap: bool, pattern: str, names: list[str]) -> dict[str, Any]:
    """For each setting in `names`: a fresh model from the same seed, one step (4 microbatches of 2
    samples per rank) through the recipe's schedule; its microbatch losses, finalised gradients and
    call counts."""
    state = init_parallel(ep, "cpu")
    out: dict[str, Any] = {}
    for name in names:
        runtime = runtime_config(pattern=pattern, aux_loss_coeff=0.01, ep_size=ep, overlap_moe_expert_parallel_comm=overlap,
                                 delay_wgrad_compute=overlap, **SETTINGS[name])
        setup = setup_model_and_optimizer(HybridModelProvider(runtime, seed=7), state,
                                          optimizer_config(clip_grad=1.0, bucket_size=20_000 if overlap else None),
                                          3e-3, overlap_grad_reduce=overlap)
        data = DataLoaderState(RandomTokens(TINY.vocab_size, SEQ, seed=5), global_batch_size=16, micro_batch_size=2,
                               dp_rank=state.dp_rank, dp_size=state.dp_size)
        schedule = get_forward_backward_func(setup.config)
        setup.model.zero_grad_buffer()
        calls: dict[str, int] = {}
        with counting(calls):
            logs = schedule(forward_step_func=forward_step, data_iterator=data.step_iterator(), model=setup.model,
                            num_microbatches=data.num_microbatches)
        out[name] = {"loss_sums": [float(l["loss_sum"]) for l in logs], "grads": named_grads(setup.model),
                     "calls": calls, "schedule": schedule.__name__, "plan": repr(setup.config.recompute)}
    return out
