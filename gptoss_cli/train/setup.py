"""Training setup: build the model from its provider, wrap it, build the optimizer, install callbacks.

The callbacks (`finalize_model_grads_func`, `grad_scale_func`, `no_sync_func`) go on the config
the schedule reads, `get_model_config(model)`: the built model's own config, which a provider may
have deep-copied. Installing them on the provider's config is the silent-skip bug of
docs/upstream-failures.md, "Callbacks on a copied config".
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Protocol

from torch import nn

from gptoss_cli.parallel import grads
from gptoss_cli.parallel.grads import GradAccumulatingModel, GradBufferConfig, get_model_config
from gptoss_cli.parallel.state import ParallelState
from gptoss_cli.recipe.schema import OptimizerConfig
from gptoss_cli.train.optimizer import DistributedAdamW
from gptoss_cli.train.provider import ModelRuntimeConfig


class ModelProvider(Protocol):
    """What builds a rank's model (train/provider.py's `HybridModelProvider`): the model carries its own
    runtime config as `model.config`."""

    def provide(self, state: ParallelState) -> nn.Module: ...


@dataclass
class TrainingSetup:
    model: GradAccumulatingModel
    optimizer: DistributedAdamW
    config: ModelRuntimeConfig  # the runtime config the schedule reads, with the callbacks installed


def install_training_callbacks(model: nn.Module, state: ParallelState) -> ModelRuntimeConfig:
    """Install the training callbacks on the runtime config of the BUILT model; returns that config."""
    config = get_model_config(model)
    # Looked up through the module at call time so a test can observe the real call.
    config.finalize_model_grads_func = functools.partial(grads.finalize_model_grads, parallel_state=state)
    # fp32/bf16 need no loss scaling; fp16 dynamic loss scaling would install its scaler here.
    config.grad_scale_func = None
    config.no_sync_func = model.no_sync if hasattr(model, "no_sync") else None
    return config


def setup_model_and_optimizer(provider: ModelProvider, state: ParallelState, optimizer: OptimizerConfig, lr: float, *,
                               overlap_grad_reduce: bool = False) -> TrainingSetup:
    """provider.provide(state) -> gradient-buffer wrapper (bucketed, sharded as the optimizer is) ->
    distributed AdamW (the recipe's optimizer section, initial `lr`) -> callbacks."""
    model, adamw = wrap_model_and_optimizer(provider.provide(state), state, optimizer, lr,
                                            overlap_grad_reduce=overlap_grad_reduce)
    config = install_training_callbacks(model, state)
    return TrainingSetup(model=model, optimizer=adamw, config=config)


def wrap_model_and_optimizer(built: nn.Module, state: ParallelState, optimizer: OptimizerConfig, lr: float, *,
                             overlap_grad_reduce: bool = False) -> tuple[GradAccumulatingModel, DistributedAdamW]:
    """A built model in its gradient buffers (bucketed, sharded as the optimizer is) and the distributed
    AdamW over them: what training builds and tests/support/simulate.py measures, from one recipe mapping."""
    buffers = GradBufferConfig(use_distributed_optimizer=optimizer.use_distributed_optimizer,
                               overlap_grad_reduce=overlap_grad_reduce, bucket_size=optimizer.bucket_size,
                               grad_reduce_in_fp32=optimizer.grad_reduce_in_fp32)
    model = GradAccumulatingModel(built, state, buffers)
    return model, DistributedAdamW(model, state, optimizer, lr=lr)


__all__ = ["TrainingSetup", "install_training_callbacks", "setup_model_and_optimizer", "wrap_model_and_optimizer"]
