"""Forward parity, one HF block resident at a time.

Reference: transformers' own GPT-OSS modules (`GptOssDecoderLayer`, `GptOssRMSNorm`,
`GptOssRotaryEmbedding`, its eager masks) built from the HF config.json and filled from the HF
shards by their HF names; MXFP4 experts are dequantised by transformers' own
`convert_moe_packed_tensors`, not by our codec. Ours: HybridModel layers 2i (`*`) and 2i+1 (`E`)
built from hybrid_config.json and filled from the Hybrid shards by their Hybrid names. Both
streams run independently on the same tokens; hidden states are compared after the embedding
and after every block, logits at the end.
"""

from __future__ import annotations

import time
from typing import Callable

import torch
from torch import nn

from gptoss_cli.errors import CheckpointError
from gptoss_cli.model.config import GptOssArch
from gptoss_cli.checkpoint.load import read_hybrid_tensor
from gptoss_cli.model.expert_names import checkpoint_slots
from gptoss_cli.model.hybrid import build_layer, layer_windows, run_layer
from gptoss_cli.model.norm import RMSNorm
from gptoss_cli.model.pattern import parse_pattern
from gptoss_cli.model.rope import YarnRotaryEmbedding
from gptoss_cli.parity.report import LogitMetrics, StageMetrics, Thresholds, compare_hidden, compare_logits


# --- reference side (transformers) ------------------------------------------------------
class TransformersReference:
    def __init__(self, hf_folder, reader, dtype: torch.dtype, device: torch.device):
        import transformers
        from transformers.models.gpt_oss import modeling_gpt_oss

        self.mod = modeling_gpt_oss
        self.config = transformers.AutoConfig.from_pretrained(hf_folder)
        self.config._attn_implementation = "eager"
        self.config._experts_implementation = "eager"
        self.reader = reader
        self.dtype = dtype
        self.device = device

    def _tensor(self, name: str) -> torch.Tensor:
        return self.reader.read(name)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        weight = self._tensor("model.embed_tokens.weight").to(self.device, self.dtype)
        return nn.functional.embedding(ids, weight)

    def masks_and_rope(self, x: torch.Tensor, position_ids: torch.Tensor):
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        import inspect

        kw = dict(config=self.config, inputs_embeds=x, attention_mask=None, position_ids=position_ids)
        params = inspect.signature(create_causal_mask).parameters
        # transformers 5 names the cache argument `cache`; 4.x calls it past_key_values and needs cache_position.
        kw["cache" if "cache" in params else "past_key_values"] = None
        if "cache_position" in params:
            kw["cache_position"] = torch.arange(x.shape[1], device=x.device)
        kw = {k: v for k, v in kw.items() if k in params}
        masks = {
            "full_attention": create_causal_mask(**kw),
            "sliding_attention": create_sliding_window_causal_mask(**kw),
        }
        rope = self.mod.GptOssRotaryEmbedding(self.config).to(self.device)
        return masks, rope(x, position_ids)

    def block(self, i: int) -> nn.Module:
        from transformers.integrations.mxfp4 import convert_moe_packed_tensors

        prefix = f"model.layers.{i}."
        state = {}
        for name in self.reader.names():
            if not name.startswith(prefix):
                continue
            local = name[len(prefix):]
            # from_pretrained keeps the two norms in fp32 (_keep_in_fp32_modules)
            dtype = torch.float32 if local.endswith("layernorm.weight") else self.dtype
            if local.endswith("_scales"):
                continue
            if local.endswith("_blocks"):
                state[local[: -len("_blocks")]] = self._dequantize(name, dtype, convert_moe_packed_tensors)
            else:
                state[local] = self._tensor(name).to(dtype)
        # Built on the meta device and filled by assignment: one copy of the block in memory.
        with torch.device("meta"):
            layer = self.mod.GptOssDecoderLayer(self.config, i)
        layer.load_state_dict(state, strict=True, assign=True)
        del state
        return layer.to(self.device).eval()

    def _dequantize(self, blocks_name: str, dtype: torch.dtype, convert) -> torch.Tensor:
        """transformers' own MXFP4 dequantisation, [E, out, G, 16] -> [E, in, out], applied to a
        few experts at a time: on a whole 120B stack its temporaries (int32 nibble indices, an
        untransposed copy) would need about three times the block's size."""
        scales_name = blocks_name[: -len("_blocks")] + "_scales"
        e, out_dim, groups, _ = self.reader.shape(blocks_name)
        result = torch.empty(e, groups * 32, out_dim, dtype=dtype)
        for e0 in range(0, e, 8):
            e1 = min(e, e0 + 8)
            result[e0:e1] = convert(self.reader.read(blocks_name, e0, e1), self.reader.read(scales_name, e0, e1), dtype=dtype)
        return result

    def head(self, x: torch.Tensor) -> torch.Tensor:
        norm = self.mod.GptOssRMSNorm(self.config.hidden_size, eps=self.config.rms_norm_eps)
        norm.weight.data.copy_(self._tensor("model.norm.weight"))
        lm_head = self._tensor("lm_head.weight").to(self.device, self.dtype)
        return nn.functional.linear(norm.to(self.device)(x), lm_head)


# --- our side (HybridModel layers from the Hybrid checkpoint) ----------------------------
class Ours:
    def __init__(self, arch: GptOssArch, pattern: str, reader, dtype: torch.dtype, device: torch.device):
        self.arch = arch
        self.reader = reader
        self.dtype = dtype
        self.device = device
        self.windows = layer_windows(arch, parse_pattern(pattern))

    def _load(self, module: nn.Module, prefix: str) -> nn.Module:
        module = module.to_empty(device=self.device)
        with torch.no_grad():
            for name, dest in checkpoint_slots(module, prefix):
                if name not in self.reader:
                    raise CheckpointError(f"{self.reader.folder}: tensor {name} is missing")
                dest.copy_(read_hybrid_tensor(self.reader, name, tuple(dest.shape), self.arch))
        return module.eval()

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        shape = (self.arch.vocab_size, self.arch.hidden_size)  # given weight: see HybridModel's embedding
        emb = nn.Embedding(*shape, _weight=torch.empty(shape, device="meta", dtype=self.dtype))
        emb = self._load(emb, "embedding.word_embeddings.")
        return emb(ids)

    def rope(self, position_ids: torch.Tensor):
        return YarnRotaryEmbedding(self.arch).to(self.device)(position_ids, self.dtype)

    def block(self, i: int) -> tuple[nn.Module, nn.Module]:
        attn = build_layer(self.arch, "*", self.windows[2 * i], device="meta", dtype=self.dtype)
        moe = build_layer(self.arch, "E", device="meta", dtype=self.dtype)
        return self._load(attn, f"decoder.layers.{2 * i}."), self._load(moe, f"decoder.layers.{2 * i + 1}.")

    def head(self, x: torch.Tensor) -> torch.Tensor:
        norm = self._load(RMSNorm(self.arch.hidden_size, self.arch.rms_norm_eps, "meta", self.dtype), "decoder.final_norm.")
        out = nn.Linear(self.arch.hidden_size, self.arch.vocab_size, bias=False, device="meta", dtype=self.dtype)
        out = self._load(out, "output_layer.")
        return out(norm(x))


def _free() -> None:
    # The modules are dropped by reference counting; gc.collect() would cost more than a tiny block.
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


@torch.no_grad()
def forward_parity(
    ref: TransformersReference,
    ours: Ours,
    ids: torch.Tensor,
    num_blocks: int,
    thresholds: Thresholds,
    progress: Callable[[str], None] | None = None,
) -> tuple[list[StageMetrics], LogitMetrics | None, list[float]]:
    stages: list[StageMetrics] = []
    seconds: list[float] = []
    position_ids = torch.arange(ids.shape[1], device=ids.device)[None]
    ref_x = ref.embed(ids)
    try:
        our_x = ours.embed(ids)
    except CheckpointError as exc:
        stages.append(StageMetrics("embedding", None, float("nan"), float("nan"), float("nan"), float("nan"), False, exc.message))
        return stages, None, seconds
    stages.append(compare_hidden("embedding", None, our_x, ref_x, thresholds))
    masks, (ref_cos, ref_sin) = ref.masks_and_rope(ref_x, position_ids)
    cos, sin = ours.rope(position_ids.expand(ids.shape[0], -1))
    for i in range(num_blocks):
        t0 = time.perf_counter()
        if progress is not None:
            progress(f"block {i}")
        layer = ref.block(i)
        ref_x = layer(
            ref_x, attention_mask=masks[ref.config.layer_types[i]], position_embeddings=(ref_cos, ref_sin),
            position_ids=position_ids,
        )
        del layer
        _free()
        try:
            attn, moe = ours.block(i)
        except CheckpointError as exc:
            nan = float("nan")
            stages.append(StageMetrics(f"block {i}", i, nan, nan, nan, nan, False, exc.message))
            return stages, None, seconds
        our_x = run_layer(moe, run_layer(attn, our_x, cos, sin), cos, sin)
        del attn, moe
        _free()
        stages.append(compare_hidden(f"block {i}", i, our_x, ref_x, thresholds))
        seconds.append(time.perf_counter() - t0)
    if progress is not None:
        progress("logits")
    ref_logits = ref.head(ref_x).float()
    try:
        our_logits = ours.head(our_x).float()
    except CheckpointError as exc:
        nan = float("nan")
        stages.append(StageMetrics("final norm + output layer", None, nan, nan, nan, nan, False, exc.message))
        return stages, None, seconds
    return stages, compare_logits(our_logits, ref_logits, thresholds), seconds
