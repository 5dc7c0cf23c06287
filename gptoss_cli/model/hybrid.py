"""HybridModel: GPT-OSS in the Megatron Hybrid layer layout, pure PyTorch (no I/O; collectives only over the
groups handed in: `set_token_dispatchers`, `set_context_parallel`).

Built from a `GptOssArch` and a parsed `hybrid_layer_pattern` (a `HybridPattern`, model/pattern.py:
`*` attention, `E` MoE, `-` dense MLP; grouping `[..]` and pipeline splits `|` are accepted and only
change scheduling, not the math).
`model.state_dict()` keys are exactly the Hybrid checkpoint names (docs/checkpoint-layouts.md,
"Hybrid layout"), e.g. `decoder.layers.0.self_attention.linear_qkv.weight`,
`decoder.layers.1.mlp.experts.linear_fc1.weight3` (the expert naming rule: model/expert_names.py).
Filling a model from a checkpoint folder is gptoss_cli/checkpoint/load.py's job; the output and
the LM loss are model/loss.py's, the initial weights model/init.py's, the GEMM numerics
model/gemm/selection.py's.

Activations are batch-first, [batch, seq, hidden].

A pipeline stage's model (gptoss_cli/schedule/pipeline/) is the same class built with `held_layers` (the
layers of the rank's stages; the others are parameterless `AbsentLayer`s, so every name keeps its
global index), and without the embedding (`pre_process=False`) or the final norm and output layer
(`post_process=False`), Megatron's names. `run_layers` runs any range of the held layers.

The attention layer j computes block index b = (number of `*` layers before j); it is sliding iff
HF block b is (`arch.layer_types[b]`), not by its physical index (docs/architecture.md, "Sliding
window").
"""

from __future__ import annotations

from typing import Callable, Iterable, Iterator

import torch
from torch import nn

from gptoss_cli.errors import ConfigError
from gptoss_cli.model.attention.layer import AttentionLayer
from gptoss_cli.model.attention.backends import warm_up
from gptoss_cli.model.catalog import SWIGLU_KERNELS
from gptoss_cli.model.config import GptOssArch
from gptoss_cli.model.context_parallel import cp_size_of
from gptoss_cli.model.gemm.dense import DenseGemm
from gptoss_cli.model.dispatcher import AllToAllTokenDispatcher
from gptoss_cli.model.expert_names import checkpoint_slots
from gptoss_cli.model.gemm.selection import set_gemms
from gptoss_cli.model.gemm.grouped import GroupedGemm
from gptoss_cli.model.init import init_weights_
from gptoss_cli.model.loss import HybridOutput
from gptoss_cli.model.gemm.main_grad import embedding
from gptoss_cli.model.mlp import DenseMLPLayer
from gptoss_cli.model.moe import GroupedExperts, MoELayer
from gptoss_cli.model.norm import RMSNorm
from gptoss_cli.model.pattern import ATTENTION, MLP, MOE, HybridPattern, default_pattern, layer_windows
from gptoss_cli.model.positions import default_position_ids
from gptoss_cli.model.recompute import RecomputePlan, checkpointed
from gptoss_cli.model.rope import YarnRotaryEmbedding
from gptoss_cli.model.router_stats import RouterStats, RouterStatsRequest
from gptoss_cli.model.routes import ExpertRoutes, LayerRoutes, collect

def buildable_pattern(arch: GptOssArch, pattern: HybridPattern) -> HybridPattern:
    """`pattern`, checked buildable and holding one attention layer per HF block of `arch`."""
    pattern.require_buildable()
    n_attn = pattern.layers.count(ATTENTION)
    if n_attn != arch.num_hidden_layers:
        raise ConfigError(
            f"hybrid_layer_pattern {pattern.text!r} has {n_attn} attention layers but the architecture has "
            f"num_hidden_layers={arch.num_hidden_layers} (one per HF block)",
            hint=f"use {arch.hybrid_layer_pattern!r} or change num_hidden_layers",
        )
    return pattern


def build_layer(
    arch: GptOssArch,
    symbol: str,
    window: int | None = None,
    *,
    expert_offset: int = 0,
    num_local_experts: int | None = None,
    token_dispatcher: AllToAllTokenDispatcher | None = None,
    device=None,
    dtype=None,
) -> nn.Module:
    """One physical layer; its state_dict keys are the checkpoint names after `decoder.layers.{j}.`."""
    if symbol == ATTENTION:
        return AttentionLayer(arch, window, device, dtype)
    if symbol == MOE:
        return MoELayer(
            arch, expert_offset=expert_offset, num_local_experts=num_local_experts,
            token_dispatcher=token_dispatcher, device=device, dtype=dtype,
        )
    if symbol == MLP:
        return DenseMLPLayer(arch, device, dtype)
    raise ConfigError(f"layer symbol {symbol!r} cannot be built", hint="use '*', 'E' or '-'")


class AbsentLayer(nn.Module):
    """A layer of the stack that another pipeline stage holds: no parameters, never run."""

    def __init__(self, symbol: str):
        super().__init__()
        self.symbol = symbol

    def set_recompute(self, pieces: set[str]) -> None:
        pass

    def forward(self, *args, **kwargs):
        raise RuntimeError(f"a {self.symbol!r} layer held by another pipeline stage was run on this one")


def run_layer(layer: nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
              cu_seqlens: tuple[int, ...] | None = None) -> torch.Tensor:
    return layer(x, cos, sin, cu_seqlens) if isinstance(layer, AttentionLayer) else layer(x)


class LanguageModelEmbedding(nn.Module):
    """The token embedding, `embedding.word_embeddings.weight [V, H]` (Megatron's name)."""

    def __init__(self, vocab_size: int, hidden_size: int, device=None, dtype=None):
        super().__init__()
        # Given weight: nn.Embedding's own normal_ init imports torch._dynamo on the meta device (about
        # 2 s per process); init_weights_ sets every value anyway.
        self.word_embeddings = nn.Embedding(
            vocab_size, hidden_size, _weight=torch.empty(vocab_size, hidden_size, device=device, dtype=dtype),
        )


class HybridStack(nn.Module):
    """The decoder: `decoder.layers.{j}` in pattern order and `decoder.final_norm` (Megatron's names);
    a pipeline stage without the last layers has no final norm (`final_norm=None`)."""

    def __init__(self, layers: Iterable[nn.Module], final_norm: RMSNorm | None):
        super().__init__()
        self.layers = nn.ModuleList(layers)
        if final_norm is not None:
            self.final_norm = final_norm


class HybridModel(nn.Module):
    """GPT-OSS as a Hybrid layer stack.

    expert_offset / num_local_experts: every MoE layer holds experts
    [expert_offset, expert_offset + num_local_experts) (default: all). With a slice, pass
    `token_dispatcher_factory(layer_number, moe_layer) -> dispatcher` (or call
    `set_token_dispatchers`) with an expert-parallel dispatcher.
    """

    cp_group = None  # context parallel (set_context_parallel); None: every rank holds whole rows

    def __init__(
        self,
        arch: GptOssArch,
        pattern: HybridPattern | None = None,
        *,
        expert_offset: int = 0,
        num_local_experts: int | None = None,
        token_dispatcher_factory: Callable[[int, MoELayer], AllToAllTokenDispatcher] | None = None,
        device=None,
        dtype=None,
        held_layers: Iterable[int] | None = None,
        pre_process: bool = True,
        post_process: bool = True,
    ):
        super().__init__()
        self.arch = arch
        self.pattern = buildable_pattern(arch, pattern or default_pattern(arch))
        held = set(range(self.pattern.num_layers)) if held_layers is None else set(held_layers)
        self.pre_process, self.post_process = pre_process, post_process
        self.is_stage = not (pre_process and post_process and len(held) == self.pattern.num_layers)
        self.aux_loss_coef = arch.router_aux_loss_coef
        self.z_loss_coef = 0.0  # Megatron's moe_z_loss_coeff; HF GPT-OSS has none
        self.loss_chunk_tokens: int | None = None  # tokens per LM-head chunk; None: the device's (model/loss_chunk.py)
        self.recompute = RecomputePlan()  # set_recompute
        windows = layer_windows(arch, self.pattern)
        self.embedding = (LanguageModelEmbedding(arch.vocab_size, arch.hidden_size, device, dtype)
                          if pre_process else nn.Module())
        self.decoder = HybridStack(
            (build_layer(arch, symbol, windows.get(j), expert_offset=expert_offset,
                         num_local_experts=num_local_experts, device=device, dtype=dtype)
             if j in held else AbsentLayer(symbol)
             for j, symbol in enumerate(self.pattern.layers)),
            RMSNorm(arch.hidden_size, arch.rms_norm_eps, device, dtype) if post_process else None,
        )
        if post_process:
            self.output_layer = nn.Linear(arch.hidden_size, arch.vocab_size, bias=False, device=device, dtype=dtype)
        self.rotary_pos_emb = YarnRotaryEmbedding(arch)
        if token_dispatcher_factory is not None:
            self.set_token_dispatchers(token_dispatcher_factory)
        if device is None or torch.device(device).type != "meta":
            # seeded from torch's global generator, so torch.manual_seed decides the weights
            init_weights_(self, arch.initializer_range, int(torch.randint(0, 1 << 62, ())))

    # --- the overlap schedule's entry point (as Megatron's models have it) -----------------------
    def build_schedule_plan(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        cu_seqlens: tuple[int, ...] | None = None,
        routes: ExpertRoutes | None = None,
    ):
        """One microbatch's combined-1F1B schedule plan: nodes per layer with detached inputs
        (gptoss_cli/model/schedule_plan.py); the schedule configures it (`SchedulePlan.configure`)."""
        from gptoss_cli.model.schedule_plan import build_hybrid_schedule_plan

        return build_hybrid_schedule_plan(self, input_ids, position_ids, labels, cu_seqlens, routes)

    # --- structure helpers ----------------------------------------------------------------
    def moe_layers(self) -> Iterator[tuple[int, MoELayer]]:
        for j, layer in enumerate(self.decoder.layers):
            if isinstance(layer, MoELayer):
                yield j, layer

    def set_token_dispatchers(self, factory: Callable[[int, MoELayer], AllToAllTokenDispatcher]) -> None:
        for j, layer in self.moe_layers():
            layer.token_dispatcher = factory(j, layer)

    def set_context_parallel(self, group) -> None:
        """Context parallel over `group` (model/context_parallel.py; None: off): from now on forward
        takes this rank's slice of every row (input_ids, labels, position_ids [B, S/CP]) and the
        cu_seqlens of the full rows; every attention layer trades sequence for heads around attention."""
        self.cp_group = group if cp_size_of(group) > 1 else None
        for layer in self.decoder.layers:
            if isinstance(layer, AttentionLayer):
                layer.self_attention.cp_group = self.cp_group

    def set_recompute(self, plan: RecomputePlan | None) -> None:
        """What backward recomputes instead of keeping (model/recompute.py). Selective pieces are
        flags on the layers; a layer inside a full unit keeps none (the unit recomputes it whole),
        and a piece inside a recomputed piece is dropped (`moe` covers `moe_act`, `mlp` covers the
        `-` layer's norm): checkpoints do not nest."""
        plan = plan or RecomputePlan()
        for s, e in plan.full_units:
            if not 0 <= s < e <= len(self.decoder.layers):
                raise ConfigError(f"recompute unit of layers [{s}, {e}) is outside the model's "
                                  f"{len(self.decoder.layers)} layers")
        self.recompute = plan
        pieces = plan.layer_pieces(self.pattern.layers)
        for j, layer in enumerate(self.decoder.layers):
            layer.set_recompute(set() if "layer" in pieces[j] else pieces[j])

    def set_swiglu_kernel(self, kernel: str) -> None:
        """How every MoE and `-` layer computes the clamped SwiGLU (model.swiglu_kernel): "auto" with the
        compiled single-pass kernels where they work, "eager" without (model/swiglu_kernel.py)."""
        if kernel not in SWIGLU_KERNELS:
            raise ConfigError(f"model.swiglu_kernel {kernel!r} is not one of {', '.join(SWIGLU_KERNELS)}")
        for m in self.modules():
            if isinstance(m, (GroupedExperts, DenseMLPLayer)):
                m.swiglu_kernel = kernel

    def set_attention_backend(self, backend: str) -> None:
        """Which kernel computes every attention layer's core (model.attention_backend; model/attention/backends.py).
        A name that is not a backend is a ConfigError. On a GPU, `auto` probes its kernels here, once."""
        for layer in self.decoder.layers:
            if isinstance(layer, AttentionLayer):
                layer.self_attention.core_attention.set_backend(backend)
        if backend == "auto":  # a pipeline stage may hold no output layer: any parameter names the device
            warm_up(self.params_device, self.params_dtype, self.arch.head_dim)

    def set_gemms(self, *, dense: Callable[[str], DenseGemm] | None = None,
                  grouped: Callable[[str], GroupedGemm] | None = None) -> list[str]:
        """The numerics of the attention projections and expert GEMMs; see `set_gemms`."""
        return set_gemms(self, dense=dense, grouped=grouped)

    def reset_buffers(self) -> None:
        """Recompute non-persistent buffers (after `to_empty` from the meta device)."""
        rope = YarnRotaryEmbedding(self.arch)
        self.rotary_pos_emb.inv_freq = rope.inv_freq.to(self.params_device)

    @property
    def params_device(self) -> torch.device:
        return next(self.parameters()).device

    @property
    def params_dtype(self) -> torch.dtype:
        """The dtype of the model's floating parameters (its params_dtype)."""
        return next(p.dtype for p in self.parameters() if p.is_floating_point())

    def held_layers(self) -> list[int]:
        """The layers this model (a pipeline stage's, or the whole stack) holds."""
        return [j for j, layer in enumerate(self.decoder.layers) if not isinstance(layer, AbsentLayer)]

    # --- forward --------------------------------------------------------------------------
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        # the lookup of nn.Embedding (no padding row, no max_norm); in training, its gradient goes
        # straight into the buffers' main_grad (model/gemm/main_grad.py)
        return embedding(input_ids, self.embedding.word_embeddings.weight)

    def rope(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None, dtype: torch.dtype,
             cu_seqlens: tuple[int, ...] | None = None):
        """cos/sin of `position_ids`, by default those of model/positions.py (rows, documents, CP slice)."""
        if position_ids is None:
            position_ids = default_position_ids(input_ids, cu_seqlens, self.cp_group)
        return self.rotary_pos_emb(position_ids, dtype)

    def output(self, x: torch.Tensor) -> HybridOutput:
        """The last decoder layer's output -> HybridOutput with the LM head deferred (see HybridOutput)."""
        return HybridOutput(hidden=self.decoder.final_norm(x), head_weight=self.output_layer.weight,
                            loss_chunk_tokens=self.loss_chunk_tokens)

    def forward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cu_seqlens: tuple[int, ...] | None = None,
        routes: ExpertRoutes | None = None,
    ) -> HybridOutput:
        """input_ids [B, S]; labels [B, S] are the targets of each position, ALREADY shifted
        (Megatron convention: labels[t] = input_ids[t+1]), -100 to ignore.

        cu_seqlens: packed documents, as start offsets into the flattened [B*S] tokens including
        every row start (model/attention/backends.py, `document_attention`): attention stays within each
        document and positions restart at 0 in each (unless position_ids are given).

        routes: expert ids per token and MoE layer (routing replay, model/routes.py); what the routers
        found is in the output's route_flips, route_pairs and live_routes."""
        want = self.router_stats_request()
        x = self.embed(input_ids)
        cos, sin = self.rope(input_ids, position_ids, x.dtype, cu_seqlens)
        by_layer = self.layer_routes(routes)
        x, stats = self.run_layers(0, len(self.decoder.layers), x, cos, sin, cu_seqlens, want, by_layer)
        out = self.output(x)
        self.attach_router_stats(out, stats)
        self.attach_routes(out, by_layer, input_ids.shape)
        return self.attach_losses(out, labels)

    def run_layers(self, start: int, end: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   cu_seqlens: tuple[int, ...] | None = None, want: RouterStatsRequest | None = None,
                   routes: dict[int, LayerRoutes] | None = None) -> tuple[torch.Tensor, list[RouterStats]]:
        """Layers [start, end) -> (x, the MoE layers' routing statistics when `want` asks for them),
        a full-recompute unit kept as one checkpoint (cut at `start` and `end`: a pipeline stage
        recomputes only its own layers; the unit's recompute routes to the same `routes`)."""
        stats: list[RouterStats] = []
        units = self.recompute.full_units
        j = start
        while j < end:
            unit = next(((s, e) for s, e in units if s <= j < e), None)
            stop = min(unit[1], end) if unit else j + 1
            if unit:  # full recompute: the unit keeps only its input
                x, got = checkpointed(self._run_layers, j, stop, x, cos, sin, cu_seqlens, want, routes)
            else:
                x, got = self._run_layers(j, stop, x, cos, sin, cu_seqlens, want, routes)
            stats.extend(got)
            j = stop
        return x, stats

    def layer_routes(self, routes: ExpertRoutes | None) -> dict[int, LayerRoutes] | None:
        """Each MoE layer's view of `routes` by physical layer index (the i-th `E` of the full pattern
        reads index i of the ids, whatever stage holds it); None without routes."""
        if routes is None:
            return None
        moe = [j for j, symbol in enumerate(self.pattern.layers) if symbol == MOE]
        for name, ids in (("engine", routes.engine), ("replay", routes.replay)):
            if ids is not None and (ids.dim() != 4 or ids.shape[2] != len(moe)
                                    or ids.shape[3] != self.arch.num_experts_per_tok):
                raise ConfigError(f"routes.{name} has shape {tuple(ids.shape)}; the model takes [batch, seq, "
                                  f"{len(moe)} MoE layers, {self.arch.num_experts_per_tok}]")
        return {j: routes.layer(i) for i, j in enumerate(moe)}

    def attach_routes(self, out: HybridOutput, routes: dict[int, LayerRoutes] | None, shape: torch.Size) -> None:
        """What the routers found about the given routes -> out.route_flips, route_pairs, live_routes."""
        if routes is not None:
            held = [routes[j] for j in sorted(routes) if isinstance(self.decoder.layers[j], MoELayer)]
            out.route_flips, out.route_pairs, out.live_routes = collect(held, shape[0], shape[1])

    def router_stats_request(self) -> RouterStatsRequest | None:
        """What the MoE layers return in a forward: in training, the telemetry and the terms of
        the router losses that are on; nothing in eval."""
        if not self.training:
            return None
        return RouterStatsRequest(aux_loss=self.aux_loss_coef > 0, z_loss=self.z_loss_coef > 0)

    def attach_router_stats(self, out: HybridOutput, stats: list[RouterStats]) -> None:
        """The MoE layers' statistics -> out.router_table, and out.aux_loss / out.z_loss when on."""
        out.add_router_stats(stats, self.arch.num_local_experts, aux_loss=self.aux_loss_coef > 0,
                             z_loss=self.z_loss_coef > 0)

    def _run_layers(self, start: int, end: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    cu_seqlens: tuple[int, ...] | None = None, want: RouterStatsRequest | None = None,
                    routes: dict[int, LayerRoutes] | None = None) -> tuple[torch.Tensor, list[RouterStats]]:
        """Layers [start, end) -> (x, the MoE layers' routing statistics when `want` asks for them)."""
        stats: list[RouterStats] = []
        for j in range(start, end):
            layer = self.decoder.layers[j]
            route = None if routes is None else routes.get(j)
            if want is not None and isinstance(layer, MoELayer):
                x, got = layer(x, want, route)  # through __call__: the layer's hooks run
                stats.append(got)
            elif route is not None:
                x = layer(x, None, route)
            else:
                x = run_layer(layer, x, cos, sin, cu_seqlens)
        return x, stats

    def attach_losses(self, out: HybridOutput, labels: torch.Tensor | None) -> HybridOutput:
        """out.loss and out.lm_loss when labels are given (`HybridOutput.add_losses`)."""
        return out.add_losses(labels, self.aux_loss_coef, self.z_loss_coef)

    # --- checkpoint names -----------------------------------------------------------------
    def checkpoint_names(self) -> list[str]:
        """Every tensor name of the full Hybrid checkpoint for this architecture and pattern
        (all experts and all layers, whatever slice or pipeline stage this instance holds)."""
        if not self.is_stage:
            return [name for name, _ in self.named_checkpoint_slots(all_experts=True)]
        full = HybridModel(self.arch, self.pattern, device="meta")
        return [name for name, _ in checkpoint_slots(full, all_experts=True, num_experts=self.arch.num_local_experts)]

    def named_checkpoint_slots(self, all_experts: bool = False) -> Iterator[tuple[str, torch.Tensor | None]]:
        """(checkpoint name, destination tensor) for every tensor; see `checkpoint_slots`. With
        all_experts, a pipeline stage's model also names the other stages' tensors, with None."""
        slots = checkpoint_slots(self, all_experts=all_experts, num_experts=self.arch.num_local_experts)
        if not (all_experts and self.is_stage):
            return slots
        held = dict(slots)
        return ((name, held.get(name)) for name in self.checkpoint_names())
