"""HybridModel: the Megatron Hybrid layout of GPT-OSS in pure PyTorch (reference sections 2 and 4).

Built from a `GptOssArch` and a `hybrid_layer_pattern` (`*` attention, `E` MoE, `-` dense MLP;
grouping `[..]` and pipeline splits `|` are accepted and only change scheduling, not the math).
`model.state_dict()` keys are exactly the Hybrid checkpoint names of section 4, e.g.
`decoder.layers.0.self_attention.linear_qkv.weight`, `decoder.layers.1.mlp.experts.linear_fc1.weight3`.

Activations are batch-first, [batch, seq, hidden].

The attention layer j computes block index b = (number of `*` layers before j); it is sliding iff
HF block b is (`arch.layer_types[b]`), as section 4 prescribes, not by its physical index.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from gptoss_cli.checkpoint.mapping import VOCAB_PADDED_HYBRID
from gptoss_cli.errors import CheckpointError, ConfigError
from gptoss_cli.model.attention import AttentionLayer
from gptoss_cli.model.config import GptOssArch
from gptoss_cli.model.dispatcher import AllToAllTokenDispatcher
from gptoss_cli.model.moe import DenseMLPLayer, ExpertLinear, MoELayer, load_balancing_loss
from gptoss_cli.model.norm import RMSNorm
from gptoss_cli.model.pattern import ATTENTION, MLP, MOE, HybridPattern, parse_pattern
from gptoss_cli.model.rope import YarnRotaryEmbedding

IGNORE_INDEX = -100


@dataclass
class HybridOutput:
    logits: torch.Tensor  # [B, S, V]
    # lm_loss + aux_loss_coef * aux_loss when labels are given (the HF convention), else None
    loss: torch.Tensor | None = None
    lm_loss: torch.Tensor | None = None  # mean token cross-entropy over labels != -100
    aux_loss: torch.Tensor | None = None  # unscaled load-balancing loss, when collected


def layer_windows(arch: GptOssArch, pattern: HybridPattern) -> dict[int, int | None]:
    """Sliding window of every attention layer, keyed by physical layer index (section 4)."""
    windows: dict[int, int | None] = {}
    block = 0
    for j, symbol in enumerate(pattern.layers):
        if symbol == ATTENTION:
            windows[j] = arch.sliding_window if arch.is_sliding(block) else None
            block += 1
    return windows


def check_pattern(arch: GptOssArch, pattern: str | HybridPattern) -> HybridPattern:
    parsed = parse_pattern(pattern) if isinstance(pattern, str) else pattern
    parsed.require_buildable()
    n_attn = parsed.layers.count(ATTENTION)
    if n_attn != arch.num_hidden_layers:
        raise ConfigError(
            f"hybrid_layer_pattern {parsed.text!r} has {n_attn} attention layers but the architecture has "
            f"num_hidden_layers={arch.num_hidden_layers} (one per HF block)",
            hint=f"use {arch.hybrid_layer_pattern!r} or change num_hidden_layers",
        )
    return parsed


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


def run_layer(layer: nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return layer(x, cos, sin) if isinstance(layer, AttentionLayer) else layer(x)


def init_weights_(module: nn.Module, std: float) -> None:
    """Random init for training from scratch / tests: normal(std) matrices, zero biases, unit norms."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if leaf in ("layer_norm_weight",) or name.endswith("layernorm.weight") or name.endswith("norm.weight"):
                p.fill_(1.0)
            elif leaf == "bias":
                p.zero_()
            else:
                p.normal_(0.0, std)


def checkpoint_slots(
    module: nn.Module, prefix: str = "", *, all_experts: bool = False, num_experts: int | None = None
) -> Iterator[tuple[str, torch.Tensor | None]]:
    """(checkpoint name, destination tensor) for every parameter of `module` (a model or one layer,
    names prefixed by `prefix`). Expert names map to a row of their stacked parameter; with
    all_experts, names of experts this module does not hold come with None."""
    owners = {name: m for name, m in module.named_modules() if isinstance(m, ExpertLinear)}
    for name, param in module.named_parameters():
        owner_name, _, leaf = name.rpartition(".")
        owner = owners.get(owner_name)
        if owner is None:
            yield prefix + name, param
            continue
        ids = range(num_experts) if all_experts and num_experts is not None else owner.global_ids()
        for e in ids:
            local = e - owner.expert_offset
            held = 0 <= local < owner.num_local_experts
            yield f"{prefix}{owner_name}.{leaf}{e}", (param[local] if held else None)


# Fields that do not change what the network computes; checkpoints may differ from the model in them.
NON_ARCHITECTURAL = frozenset({"router_aux_loss_coef", "initializer_range", "bos_token_id", "eos_token_id", "pad_token_id"})


def architecture_differences(a: GptOssArch, b: GptOssArch) -> list[str]:
    """'field: A vs B' for every field that changes the computation."""
    import dataclasses

    return [
        f"{f.name}: {getattr(a, f.name)!r} vs {getattr(b, f.name)!r}"
        for f in dataclasses.fields(GptOssArch)
        if f.name not in NON_ARCHITECTURAL and getattr(a, f.name) != getattr(b, f.name)
    ]


def _copy_checked(dest: torch.Tensor, src: torch.Tensor, name: str, folder) -> None:
    if tuple(src.shape) != tuple(dest.shape):
        raise CheckpointError(f"{folder}: tensor {name} has shape {list(src.shape)}, the model expects {list(dest.shape)}")
    dest.copy_(src)




def read_hybrid_tensor(reader, name: str, shape: tuple[int, ...], arch: GptOssArch) -> torch.Tensor:
    """Read `name` from a Hybrid checkpoint, checking its shape (vocabulary padding is stripped)."""
    stored = tuple(reader.shape(name))
    if name in VOCAB_PADDED_HYBRID and stored[1:] == shape[1:] and stored[0] >= shape[0]:
        return reader.read(name, 0, shape[0])
    if stored != shape:
        raise CheckpointError(
            f"{reader.file_of(name)}: tensor {name} has shape {list(stored)}, the model expects {list(shape)}",
            hint="hybrid_config.json does not describe these tensors",
        )
    return reader.read(name)


class HybridModel(nn.Module):
    """GPT-OSS as a Hybrid layer stack.

    expert_offset / num_local_experts: every MoE layer holds experts
    [expert_offset, expert_offset + num_local_experts) (default: all). With a slice, pass
    `token_dispatcher_factory(layer_number, moe_layer) -> dispatcher` (or call
    `set_token_dispatchers`) with an expert-parallel dispatcher.
    """

    def __init__(
        self,
        arch: GptOssArch,
        pattern: str | HybridPattern | None = None,
        *,
        expert_offset: int = 0,
        num_local_experts: int | None = None,
        token_dispatcher_factory: Callable[[int, MoELayer], AllToAllTokenDispatcher] | None = None,
        device=None,
        dtype=None,
    ):
        super().__init__()
        self.arch = arch
        self.pattern = check_pattern(arch, pattern or arch.hybrid_layer_pattern)
        self.aux_loss_coef = arch.router_aux_loss_coef
        windows = layer_windows(arch, self.pattern)
        self.embedding = nn.Module()
        self.embedding.word_embeddings = nn.Embedding(arch.vocab_size, arch.hidden_size, device=device, dtype=dtype)
        self.decoder = nn.Module()
        self.decoder.layers = nn.ModuleList(
            build_layer(
                arch, symbol, windows.get(j), expert_offset=expert_offset,
                num_local_experts=num_local_experts, device=device, dtype=dtype,
            )
            for j, symbol in enumerate(self.pattern.layers)
        )
        self.decoder.final_norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, device, dtype)
        self.output_layer = nn.Linear(arch.hidden_size, arch.vocab_size, bias=False, device=device, dtype=dtype)
        self.rotary_pos_emb = YarnRotaryEmbedding(arch)
        if token_dispatcher_factory is not None:
            self.set_token_dispatchers(token_dispatcher_factory)
        if device is None or torch.device(device).type != "meta":
            init_weights_(self, arch.initializer_range)

    # --- capabilities ---------------------------------------------------------------------
    @classmethod
    def supports_schedule_plan(cls, pattern: str | None = None) -> tuple[bool, str]:
        """Whether this model can build the EP A2A overlap schedule plan (section 5) for `pattern`:
        (True, "") when every symbol has plan nodes (`*`, `E`, `-`, grouped or not), else
        (False, reason naming the symbol)."""
        from gptoss_cli.model.schedule_plan import plan_support

        return plan_support(pattern)

    def build_schedule_plan(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        **kwargs,
    ):
        """One microbatch's combined-1F1B schedule plan (section 5): nodes per layer with detached
        inputs; see gptoss_cli/model/schedule_plan.py (kwargs: wgrad_queue, loss_fn, sync_timing)."""
        from gptoss_cli.model.schedule_plan import build_hybrid_schedule_plan

        return build_hybrid_schedule_plan(self, input_ids, position_ids, labels, **kwargs)

    # --- structure helpers ----------------------------------------------------------------
    def moe_layers(self) -> Iterator[tuple[int, MoELayer]]:
        for j, layer in enumerate(self.decoder.layers):
            if isinstance(layer, MoELayer):
                yield j, layer

    def set_token_dispatchers(self, factory: Callable[[int, MoELayer], AllToAllTokenDispatcher]) -> None:
        for j, layer in self.moe_layers():
            layer.token_dispatcher = factory(j, layer)

    def reset_buffers(self) -> None:
        """Recompute non-persistent buffers (after `to_empty` from the meta device)."""
        rope = YarnRotaryEmbedding(self.arch)
        self.rotary_pos_emb.inv_freq = rope.inv_freq.to(self.output_layer.weight.device)

    # --- forward --------------------------------------------------------------------------
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embedding.word_embeddings(input_ids)

    def rope(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None, dtype: torch.dtype):
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).expand(input_ids.shape[0], -1)
        return self.rotary_pos_emb(position_ids, dtype)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        return self.output_layer(self.decoder.final_norm(x))

    def forward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> HybridOutput:
        """input_ids [B, S]; labels [B, S] are the targets of each position, ALREADY shifted
        (Megatron convention: labels[t] = input_ids[t+1]), -100 to ignore."""
        collect = self.training and self.aux_loss_coef > 0
        for _, layer in self.moe_layers():
            layer.collect_router_stats = collect
            layer.router_stats = None
        x = self.embed(input_ids)
        cos, sin = self.rope(input_ids, position_ids, x.dtype)
        for layer in self.decoder.layers:
            x = run_layer(layer, x, cos, sin)
        logits = self.head(x)
        out = HybridOutput(logits=logits)
        if collect:
            stats = [layer.router_stats for _, layer in self.moe_layers() if layer.router_stats is not None]
            if stats:
                out.aux_loss = load_balancing_loss(stats, self.arch.num_local_experts)
        if labels is not None:
            out.lm_loss = F.cross_entropy(
                logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=IGNORE_INDEX
            )
            out.loss = out.lm_loss
            if out.aux_loss is not None:
                out.loss = out.lm_loss + self.aux_loss_coef * out.aux_loss
        return out

    # --- checkpoint names -----------------------------------------------------------------
    def checkpoint_names(self) -> list[str]:
        """Every tensor name of the full Hybrid checkpoint for this architecture and pattern
        (all experts, whatever slice this instance holds)."""
        names = []
        for name, tensor in self.named_checkpoint_slots(all_experts=True):
            names.append(name)
        return names

    def named_checkpoint_slots(self, all_experts: bool = False) -> Iterator[tuple[str, torch.Tensor | None]]:
        """(checkpoint name, destination tensor) for every tensor; see `checkpoint_slots`."""
        return checkpoint_slots(self, all_experts=all_experts, num_experts=self.arch.num_local_experts)

    # --- loading --------------------------------------------------------------------------
    def load_hybrid_tensors(self, folder: str | Path, progress: Callable[[str], None] | None = None) -> None:
        """Fill every parameter from a Hybrid checkpoint folder, one tensor at a time, strictly
        by name: a missing or unexpected tensor, or a shape mismatch, raises CheckpointError."""
        from gptoss_cli.checkpoint.safetensors_io import CheckpointReader

        from gptoss_cli.checkpoint.hybrid_format import HYBRID_CONFIG, read_hybrid_config

        folder = Path(folder)
        if (folder / HYBRID_CONFIG).exists():
            diff = architecture_differences(read_hybrid_config(folder).arch, self.arch)
            if diff:
                raise CheckpointError(
                    f"{folder / HYBRID_CONFIG}: describes a different architecture than this model "
                    f"(checkpoint vs model: {'; '.join(diff)})"
                )
        with CheckpointReader(folder) as reader:
            present = set(reader.names())
            expected = list(self.checkpoint_names())
            missing = [n for n in expected if n not in present]
            unexpected = sorted(present - set(expected))
            if missing or unexpected:
                parts = []
                if missing:
                    parts.append(f"{len(missing)} missing tensors (first: {missing[:3]})")
                if unexpected:
                    parts.append(f"{len(unexpected)} unexpected tensors (first: {unexpected[:3]})")
                raise CheckpointError(
                    f"{folder}: does not match the model for pattern {self.pattern.text!r}: " + "; ".join(parts),
                    hint="re-run `gptoss convert`, or check hybrid_config.json against the tensors",
                )
            with torch.no_grad():
                for name, dest in self.named_checkpoint_slots():
                    dest.copy_(read_hybrid_tensor(reader, name, tuple(dest.shape), self.arch))
                    if progress is not None:
                        progress(name)

    def load_hf_tensors(self, folder: str | Path, progress: Callable[[str], None] | None = None) -> None:
        """Fill every parameter from an HF GPT-OSS folder (bf16 or MXFP4 experts) or OpenAI's original/
        layout through the mapping table, one table unit at a time (experts in chunks, only the
        experts this model holds), so memory stays at one unit."""
        from gptoss_cli.checkpoint.mapping import units
        from gptoss_cli.checkpoint.sources import HYBRID, check_tensors, open_source

        if self.pattern.layers != tuple(self.arch.hybrid_layer_pattern):
            raise ConfigError(
                f"an HF checkpoint maps onto the pattern {self.arch.hybrid_layer_pattern!r}, not {self.pattern.text!r}"
            )
        source = open_source(str(folder))
        try:
            if source.kind == HYBRID:
                raise CheckpointError(f"{folder}: is a Hybrid checkpoint; load it with load_hybrid_tensors")
            diff = architecture_differences(source.arch, self.arch)
            if diff:
                raise CheckpointError(
                    f"{folder}: config.json describes a different architecture than this model "
                    f"(checkpoint vs model: {'; '.join(diff)})"
                )
            check_tensors(source, source.layout.stored_specs(self.arch))
            slots = dict(self.named_checkpoint_slots(all_experts=True))
            dtype = self.output_layer.weight.dtype
            chunk = 8
            with torch.no_grad():
                for unit in units(self.arch):
                    if unit.per_expert:
                        # only this rank's contiguous expert range is read, a few experts at a time
                        held = [e for e, n in enumerate(unit.hybrid) if slots[n] is not None]
                        lo, hi = (held[0], held[-1] + 1) if held else (0, 0)
                        for e0 in range(lo, hi, chunk):
                            e1 = min(hi, e0 + chunk)
                            stack = source.layout.read(source.reader, self.arch, unit.hf[0], dtype, e0, e1)
                            for name, t in zip(unit.hybrid[e0:e1], unit.to_hybrid(self.arch, [stack])):
                                _copy_checked(slots[name], t, name, folder)
                        continue
                    ins = [source.layout.read(source.reader, self.arch, n, dtype) for n in unit.hf]
                    for name, t in zip(unit.hybrid, unit.to_hybrid(self.arch, ins)):
                        _copy_checked(slots[name], t, name, folder)
                    if progress is not None:
                        progress(", ".join(unit.hf))
        finally:
            source.close()

    @classmethod
    def from_hf_checkpoint(
        cls,
        folder: str | Path,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        **kwargs,
    ) -> "HybridModel":
        """Build from an HF GPT-OSS folder's config.json and load it through the mapping (streaming)."""
        from gptoss_cli.checkpoint.sources import HF, open_source

        source = open_source(str(folder))
        try:
            if source.kind != HF:
                raise CheckpointError(f"{folder}: is a {source.kind} checkpoint, not a Hugging Face one")
            arch = source.arch
        finally:
            source.close()
        model = cls(arch, device="meta", dtype=dtype, **kwargs)
        model.to_empty(device=device)
        model.reset_buffers()
        model.load_hf_tensors(folder)
        return model

    @classmethod
    def from_hybrid_checkpoint(
        cls,
        folder: str | Path,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        *,
        expert_offset: int = 0,
        num_local_experts: int | None = None,
        token_dispatcher_factory: Callable[[int, MoELayer], AllToAllTokenDispatcher] | None = None,
        progress: Callable[[str], None] | None = None,
    ) -> "HybridModel":
        """Build from `hybrid_config.json` and load the safetensors shards (see load_hybrid_tensors)."""
        from gptoss_cli.checkpoint.hybrid_format import read_hybrid_config

        cfg = read_hybrid_config(folder)
        model = cls(
            cfg.arch, cfg.hybrid_layer_pattern, expert_offset=expert_offset, num_local_experts=num_local_experts,
            token_dispatcher_factory=token_dispatcher_factory, device="meta", dtype=dtype,
        )
        model.to_empty(device=device)
        model.reset_buffers()
        model.load_hybrid_tensors(folder, progress=progress)
        return model
