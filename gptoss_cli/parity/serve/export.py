"""What the engine loads, made with gptoss's own convert: an HF folder, a PEFT adapter, or a merged export.

- An HF checkpoint is served as it is (what a user deploys), unless other experts are asked for.
- A Hybrid, training or Megatron checkpoint: `convert --to hf` in the served dtype.
- A LoRA run: its PEFT adapter (`convert --to peft`) on the base's HF export, served with the
  engine's LoRA support where it has it for MoE experts; otherwise merged. The merge is PEFT's own
  (`merge_and_unload` of the adapter on transformers' model of the base), so the adapter file is what
  is checked; without peft and transformers installed it is gptoss's merged export (`convert --to hf`
  of the run), and the report says so.
- MXFP4 experts on an engine that cannot run them (vLLM's CPU backend): the MXFP4 export is written,
  then its dequantised layout is what the engine loads (a finding says the MXFP4 kernel was not run).

Only the public entry points of checkpoint/ are used: `open_source` and `convert`.
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass, field
from pathlib import Path

from gptoss_cli.errors import UsageError

HF_FOLDER = "hf folder"
ADAPTER = "peft adapter"
MERGED_PEFT = "merged export (PEFT's merge of the exported adapter)"
MERGED_GPTOSS = "merged export (gptoss's merge)"
DEQUANTISED = "dequantised MXFP4 export"


@dataclass
class Served:
    """What the engine is given: a folder, and for adapter serving the adapter folder on that base."""

    model: str
    form: str
    adapter: str | None = None
    artifacts: dict[str, str] = field(default_factory=dict)  # what was written on the way (adapter, mxfp4 export)
    notes: list[str] = field(default_factory=list)


def is_peft_adapter(folder: str | Path) -> bool:
    cfg = Path(folder) / "adapter_config.json"
    if not cfg.is_file():
        return False
    try:
        return json.loads(cfg.read_text()).get("peft_type") == "LORA"
    except (OSError, ValueError, AttributeError):
        return False


def peft_available() -> bool:
    return all(importlib.util.find_spec(m) is not None for m in ("peft", "transformers"))


def _convert(src: str, dst: Path, **kwargs) -> Path:
    from gptoss_cli.checkpoint.convert import convert

    convert(src, dst, **kwargs)
    return dst


def _kind(folder: str) -> str:
    from gptoss_cli.checkpoint.sources import open_source

    source = open_source(folder)
    try:
        return source.kind
    finally:
        source.close()


def _hf_export(checkpoint: str, kind: str, work: Path, name: str, dtype: str, experts: str | None = None) -> Path:
    """An HF folder of `checkpoint` in `dtype` (convert writes the other layout than an HF source's: an HF
    or OpenAI-original source goes through Hybrid in fp32 first)."""
    from gptoss_cli.checkpoint import formats

    if formats.by_name(kind).same_layout == "hf":  # convert refuses to write that source's own layout
        checkpoint = str(_convert(checkpoint, work / f"{name}-hybrid", to="hybrid", dtype="float32"))
    return _convert(checkpoint, work / name, to="hf", dtype=dtype, experts=experts)


def lora_base(checkpoint: str) -> str | None:
    """The base a LoRA run names (its checkpoint.pretrained), or None for a checkpoint that is not a LoRA run."""
    from gptoss_cli.checkpoint.sources import open_source

    source = open_source(checkpoint)
    try:
        lora = source.lora
    finally:
        source.close()
    if not lora:
        return None
    base = (lora.get("base") or {}).get("path")
    if not base:
        raise UsageError(f"{checkpoint}: the LoRA run names no base folder")
    return str(base)


def peft_merge(base_hf: Path, adapter: Path, dst: Path, dtype: str) -> Path:
    """transformers' model of `base_hf` with PEFT's adapter merged in (merge_and_unload), saved at `dst`."""
    import torch
    from peft import PeftModel

    from gptoss_cli.parity.reference import load_transformers_model

    model = load_transformers_model(base_hf, torch.float32, attn_implementation="eager")
    merged = PeftModel.from_pretrained(model, str(adapter)).merge_and_unload()
    merged.to(torch.bfloat16 if dtype in ("bfloat16", "bf16") else torch.float32)
    merged.save_pretrained(str(dst), safe_serialization=True)
    return dst


def prepare_served(checkpoint: str, kind: str, work: Path, *, dtype: str, experts: str | None, lora_mode: str,
                   engine_serves_expert_lora: bool, engine_runs_mxfp4: bool, export: str | None = None) -> Served:
    """Write (under `work`) what the engine loads for `checkpoint` of `kind` (see the module docstring)."""
    from gptoss_cli.checkpoint import formats

    is_hf = formats.by_name(kind) is formats.HF
    base = lora_base(checkpoint) if not is_hf else None
    if export is not None and not is_peft_adapter(export):
        return Served(str(export), HF_FOLDER)
    if base is not None or (export is not None and is_peft_adapter(export)):
        if base is None:
            raise UsageError(f"--export {export} is a PEFT adapter, but {checkpoint} is not a LoRA run")
        return _lora_served(checkpoint, base, work, dtype=dtype, lora_mode=lora_mode,
                            engine_serves_expert_lora=engine_serves_expert_lora, export=export)
    if is_hf and experts is None:
        served = Served(checkpoint, HF_FOLDER)
        if _hf_has_mxfp4(Path(checkpoint)) and not engine_runs_mxfp4:
            return _dequantised(checkpoint, work, dtype, served.artifacts)
        return served
    if experts == "mxfp4":
        mx = _hf_export(checkpoint, kind, work, "hf-mxfp4", dtype, "mxfp4")
        if engine_runs_mxfp4:
            return Served(str(mx), HF_FOLDER)
        return _dequantised(str(mx), work, dtype, {"mxfp4 export": str(mx)})
    return Served(str(_hf_export(checkpoint, kind, work, "hf", dtype, experts)), HF_FOLDER)


def _hf_has_mxfp4(folder: Path) -> bool:
    try:
        cfg = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return (cfg.get("quantization_config") or {}).get("quant_method") == "mxfp4"


def _dequantised(mx_folder: str, work: Path, dtype: str, artifacts: dict[str, str]) -> Served:
    out = _convert(mx_folder, work / "hybrid-from-mxfp4", to="hybrid", dtype="float32")
    hf = _convert(str(out), work / "hf-dequantised", to="hf", dtype=dtype, experts="bf16")
    return Served(str(hf), DEQUANTISED, artifacts={**artifacts, "mxfp4 export": mx_folder})


def _lora_served(checkpoint: str, base: str, work: Path, *, dtype: str, lora_mode: str,
                 engine_serves_expert_lora: bool, export: str | None) -> Served:
    adapter = Path(export) if export is not None else _convert(checkpoint, work / "adapter", to="peft")
    base_hf = _hf_export(base, _kind(base), work, "base-hf", dtype)
    artifacts = {"peft adapter": str(adapter), "base hf": str(base_hf)}
    use_adapter = lora_mode == "adapter" or (lora_mode == "auto" and engine_serves_expert_lora)
    if use_adapter:
        return Served(str(base_hf), ADAPTER, adapter=str(adapter), artifacts=artifacts)
    if peft_available():
        merged = peft_merge(base_hf, adapter, work / "merged-peft", dtype)
        return Served(str(merged), MERGED_PEFT, artifacts=artifacts)
    if export is not None:
        raise UsageError(f"--export {export}: checking a PEFT adapter without an engine that serves it needs "
                         "peft and transformers to merge it", hint="pip install peft 'gptoss-cli[parity]'")
    merged = _convert(checkpoint, work / "merged", to="hf", dtype=dtype)
    return Served(str(merged), MERGED_GPTOSS, artifacts=artifacts,
                  notes=["peft is not installed: the merged export is gptoss's own merge, the PEFT adapter file "
                         "itself was not checked (pip install peft)"])


__all__ = ["Served", "prepare_served", "is_peft_adapter", "peft_available", "lora_base", "peft_merge",
           "HF_FOLDER", "ADAPTER", "MERGED_PEFT", "MERGED_GPTOSS", "DEQUANTISED"]
