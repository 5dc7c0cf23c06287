"""Tiny transformers-generated GPT-OSS checkpoints on disk (both expert forms) for model/parity tests."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tests.model.conftest import randomize_, tiny_hf_config


def tiny_hf_model(seed: int = 0, **config_overrides):
    import transformers

    torch.manual_seed(seed)
    model = transformers.GptOssForCausalLM(tiny_hf_config(**config_overrides)).eval()
    randomize_(model, seed)
    return model


def write_hf_checkpoint(folder: Path, experts: str = "bf16", seed: int = 0) -> Path:
    """An HF GPT-OSS folder (fp32 tensors). experts="mxfp4" stores the experts as blocks/scales
    ([E, out, in/32, 16] / [E, out, in/32], docs/checkpoint-layouts.md) and adds quantization_config."""
    from safetensors.torch import save_file

    from gptoss_cli.model.mxfp4 import codec as mxfp4

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    model = tiny_hf_model(seed)
    if experts == "bf16":
        model.save_pretrained(folder, safe_serialization=True)
        return folder
    sd = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    out = {}
    for name, t in sd.items():
        if name.endswith("mlp.experts.gate_up_proj") or name.endswith("mlp.experts.down_proj"):
            blocks, scales = mxfp4.encode(t.transpose(1, 2).contiguous())  # stored [E, out, in]
            out[name + "_blocks"] = blocks
            out[name + "_scales"] = scales
        else:
            out[name] = t
    save_file(out, str(folder / "model.safetensors"), metadata={"format": "pt"})
    cfg = model.config.to_dict()
    cfg["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"],
    }
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    return folder


def load_hf_reference(folder: Path):
    """transformers' own loading (it dequantizes MXFP4 itself on CPU), eager attention, fp32."""
    from gptoss_cli.parity.reference import load_transformers_model

    return load_transformers_model(folder, torch.float32, attn_implementation="eager")


def write_converted_pair(root: Path, experts: str = "bf16", seed: int = 0) -> tuple[Path, Path]:
    """(HF folder, Hybrid folder converted from it by `gptoss convert` in fp32)."""
    from gptoss_cli.checkpoint.convert import convert

    root = Path(root)
    hf = write_hf_checkpoint(root / f"hf-{experts}", experts, seed)
    hybrid = root / f"hybrid-{experts}"
    convert(str(hf), hybrid, dtype="float32")
    return hf, hybrid


def rewrite_hybrid(folder: Path, edit) -> None:
    """Apply `edit(dict name -> tensor)` to every tensor of a (single- or multi-shard) Hybrid folder."""
    from safetensors.torch import load_file, save_file

    for shard in sorted(Path(folder).glob("*.safetensors")):
        tensors = load_file(str(shard))
        edit(tensors)
        save_file(tensors, str(shard), metadata={"format": "pt"})
    index = Path(folder) / "model.safetensors.index.json"
    if index.exists():
        index.unlink()  # names may have changed; the reader falls back to the shard files


PAD_FILL = 9.0  # padding rows hold this: large enough that any leak into lookups or logits shows


def write_padded_hybrid(src: Path, dst: Path, rows: int = 1024) -> Path:
    """A copy of Hybrid folder `src` whose embedding and output layer are padded, as Megatron pads
    the vocabulary (to a multiple of 128 x TP rows), with rows of PAD_FILL after the real ones."""
    import shutil

    from gptoss_cli.checkpoint.mapping import VOCAB_PADDED_HYBRID

    shutil.copytree(src, dst)

    def pad(tensors):
        for name in VOCAB_PADDED_HYBRID:
            t = tensors[name]
            tensors[name] = torch.cat([t, torch.full((rows - t.shape[0], t.shape[1]), PAD_FILL, dtype=t.dtype)])

    rewrite_hybrid(dst, pad)
    return Path(dst)
