"""The models the benches measure and the peers they compare with: the `medium` and `wide` presets,
transformers' GptOssForCausalLM with the tests' random weights, and those weights re-arranged into
ours by the test-local HF -> Hybrid mapping (so both sides start from the same weights).

How the benches time and record what they compare: bench/harness.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # the benches import tests/ helpers (the HF <-> Hybrid re-arrangement)
    sys.path.insert(0, str(ROOT))

# The presets the benches name (besides the model presets of gptoss_cli/model/config.py):
#   medium: the tiny preset at hidden 512, intermediate 512, 16 experts top-4 (tiny's attention:
#           6 query / 2 kv heads of 16, vocabulary 1003);
#   wide:   medium with 8 query / 2 kv heads of 64 and a 20480-token vocabulary (61M parameters),
#           where the experts, attention and LM head all have realistic shares of the work.
MEDIUM = dict(hidden_size=512, intermediate_size=512, num_local_experts=16, num_experts_per_tok=4)
WIDE = dict(MEDIUM, num_attention_heads=8, num_key_value_heads=2, head_dim=64, vocab_size=20480,
            eos_token_id=20479, pad_token_id=20478)


def bench_arch(name: str, overrides: str | None = None):
    """A model preset, `medium` or `wide`, with `key=value,...` integer overrides."""
    from gptoss_cli.model.config import preset

    if name == "medium":
        arch = preset("tiny").replace(**MEDIUM)
    elif name == "wide":
        arch = preset("tiny").replace(**WIDE)
    else:
        arch = preset(name)
    if overrides:
        arch = arch.replace(**{k: int(v) for k, v in (kv.split("=") for kv in overrides.split(","))})
    return arch


def hf_peer(arch, dtype=None, seed: int = 0):
    """transformers' GptOssForCausalLM of `arch` at its default attention and expert implementations,
    with the tests' random weights (tests/model/conftest.py `randomize_`: sinks, norms, biases and
    router at scales where each matters)."""
    import torch
    from transformers import GptOssConfig, GptOssForCausalLM

    from gptoss_cli.checkpoint.formats.hf.config import to_hf_config
    from tests.model.conftest import randomize_

    cfg = to_hf_config(arch)
    cfg.update(output_router_logits=False)
    cfg.pop("torch_dtype", None)
    torch.manual_seed(seed)
    model = GptOssForCausalLM(GptOssConfig(**cfg))
    randomize_(model, seed=seed)
    return model if dtype is None else model.to(dtype)


def hybrid_weights(arch, hf_model) -> dict:
    """The Hybrid state dict of an HF model, by the test-local re-arrangement (independent of convert)."""
    from tests.model.conftest import hf_to_hybrid_state_dict

    if arch.hybrid_layer_pattern != "*E" * arch.num_hidden_layers:
        raise SystemExit(f"bench: the HF -> Hybrid re-arrangement expects the pattern '*E' x layers, "
                         f"not {arch.hybrid_layer_pattern!r}")
    return hf_to_hybrid_state_dict(hf_model.state_dict(), arch.num_hidden_layers, arch.num_attention_heads,
                                   arch.num_key_value_heads, arch.head_dim)


__all__ = ["MEDIUM", "WIDE", "bench_arch", "hf_peer", "hybrid_weights"]
