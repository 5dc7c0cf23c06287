"""`gptoss make-tiny`: write a small GPT-OSS HF checkpoint with the real layout, for demos and tests.

Besides the weights and config.json it writes a small tokenizer.json with harmony's special tokens
(gptoss_cli/data/tiny_tokenizer.py; when the vocabulary has room for them), so the data commands,
eval and generate run on it without a download.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from gptoss_cli import outputs
from gptoss_cli.checkpoint.convert import parse_dtype
from gptoss_cli.checkpoint.formats import HF
from gptoss_cli.checkpoint.formats.hf.config import to_hf_config
from gptoss_cli.checkpoint.formats.hf.layouts import HF_LAYOUTS
from gptoss_cli.checkpoint.formats.hf.plan import plan_to_hf
from gptoss_cli.checkpoint.mapping import canonical_hf_shapes, units
from gptoss_cli.checkpoint.storage.safetensors_io import ShardedWriter
from gptoss_cli.data.tiny_tokenizer import SPECIAL as TINY_SPECIAL, tiny_tokenizer
from gptoss_cli.data.tokenizer import TOKENIZER_FILE
from gptoss_cli.errors import UsageError
from gptoss_cli.model.config import GptOssArch, preset
from gptoss_cli.model.dtypes import dtype_name


@dataclass
class MakeTinyResult:
    destination: str
    experts: str
    seed: int
    num_tensors: int
    bytes_written: int
    architecture: dict
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        return self.__dict__.copy()


def random_canonical_tensor(name: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """Weights with unit-scale activations (1/sqrt(fan_in)), so that layout bugs change outputs visibly."""
    t = torch.randn(shape, generator=gen)
    if name.endswith(("layernorm.weight", "norm.weight")):
        return 1.0 + 0.1 * t
    if name.endswith("sinks"):
        return 0.5 * t
    if name.endswith("embed_tokens.weight"):
        return t
    if name.endswith(("bias", "proj_bias")):
        return 0.05 * t
    return t / shape[-1] ** 0.5


def make_tiny(
    dst: str | Path,
    *,
    experts: str = "mxfp4",
    seed: int = 0,
    arch: GptOssArch | None = None,
    dtype: str = "bfloat16",
    force: bool = False,
    max_shard_bytes: int = 5 * 1024**3,
    head_dim: int | None = None,
) -> MakeTinyResult:
    arch = arch or preset("tiny")
    if head_dim is not None:
        if isinstance(head_dim, bool) or not isinstance(head_dim, int) or not 2 <= head_dim <= 512 or head_dim % 2:
            raise UsageError(f"--head-dim {head_dim!r} must be an even number from 2 to 512 (RoPE rotates pairs)")
        arch = dataclasses.replace(arch, head_dim=head_dim)
    if experts not in HF_LAYOUTS:
        raise UsageError(f"--experts {experts!r} is not supported; use bf16 or mxfp4")
    torch_dtype = parse_dtype(dtype)
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
        raise UsageError(f"--seed {seed!r} must be an integer in [0, 2**63)")
    dst = Path(dst).expanduser()
    # First, what killed runs left for DST: a stranded old DST goes back in place before DST is judged.
    notes = outputs.recover(dst)
    outputs.check_destination(dst, force)
    if force:
        HF.replaceable(dst)
    layout = HF_LAYOUTS[experts]
    gen = torch.Generator().manual_seed(seed)
    shapes = canonical_hf_shapes(arch)
    jobs = plan_to_hf(arch, layout, torch_dtype)
    plan = [s for j in jobs for s in j.outputs]
    tmp = outputs.start_folder(dst, sum(s.nbytes for s in plan))
    with outputs.removed_on_error(tmp, dst):
        writer = ShardedWriter(tmp, plan, max_shard_bytes=max_shard_bytes)
        for unit in units(arch):
            for canonical in unit.hf:
                t = random_canonical_tensor(canonical, shapes[canonical], gen).to(torch_dtype)
                for name, piece in layout.store(canonical, t):
                    writer.write(name, piece.to(torch_dtype) if piece.is_floating_point() else piece)
        writer.close()
        config = to_hf_config(arch, experts_form=experts, torch_dtype=dtype_name(torch_dtype))
        outputs.write_text(tmp / "config.json", json.dumps(config, indent=2) + "\n")
        if arch.vocab_size >= 256 + len(TINY_SPECIAL):
            outputs.write_text(tmp / TOKENIZER_FILE, json.dumps(tiny_tokenizer(arch.vocab_size)) + "\n")
        outputs.commit(tmp, dst)
    return MakeTinyResult(str(dst), experts, seed, len(plan), writer.bytes_written, arch.to_dict(), notes)
