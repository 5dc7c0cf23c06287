"""Scaffolding the benches share: the model presets they measure, the load average during a run,
the allocator and thread settings both sides get, and interleaved rounds with rotating order.

A bench compares gptoss with a peer on a host shared with other jobs. What keeps the comparison
fair: both sides run in the same process (or in processes started with the same environment:
`peer_env`), with the same torch thread count and the same glibc allocator setting; rounds
alternate which side goes first; each side's time is taken by this process's CPU time where one
thread runs (work, not waiting); and every bench prints the load average seen during its run
(`LoadMonitor`), so a figure measured on a busy host says so.
"""

from __future__ import annotations

import os
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Sequence

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


# --- the host's load during a run ---------------------------------------------------------------
def load_average() -> float:
    """The 1-minute load average (runnable + uninterruptible tasks, averaged by the kernel)."""
    try:
        return float(Path("/proc/loadavg").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return os.getloadavg()[0]


class LoadMonitor:
    """Samples the 1-minute load average every `interval` seconds while the `with` block runs;
    `text()` is the line a bench prints: min-max and median over the run, and the CPUs."""

    def __init__(self, interval: float = 2.0):
        self.interval = interval
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while True:
            self.samples.append(load_average())
            if self._stop.wait(self.interval):
                return

    def __enter__(self) -> "LoadMonitor":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.samples.append(load_average())

    def summary(self) -> dict:
        s = self.samples or [load_average()]
        return {"load_min": min(s), "load_median": statistics.median(s), "load_max": max(s),
                "cpus": os.cpu_count()}

    def text(self) -> str:
        d = self.summary()
        return (f"load average during the run: {d['load_min']:.1f}-{d['load_max']:.1f} "
                f"(median {d['load_median']:.1f}) on {d['cpus']} CPUs")


# --- the settings both sides share ----------------------------------------------------------------
def allocator_text(kept: bool) -> str:
    """How this process's allocator is set, as a bench prints it."""
    if not kept:
        return "glibc's default allocator"
    from gptoss_cli.resources import ALLOCATOR_SETTING

    return ALLOCATOR_SETTING


def peer_env(threads: int, extra: dict | None = None) -> dict:
    """The environment a bench gives every process it starts, ours and the peer's alike: the same
    thread count for torch (OMP/MKL) and nothing else changed."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    env.update(extra or {})
    return env


# --- interleaved rounds ---------------------------------------------------------------------------
def rotating(sides: Sequence, round_index: int) -> list:
    """The sides in the order of round `round_index`: rotated by one each round, so no side always
    runs first (after the other's allocations, or first after a pause in the host's load)."""
    k = round_index % len(sides)
    return list(sides[k:]) + list(sides[:k])


def cpu_clock() -> float:
    """This process's CPU time (all its threads): with one torch thread, the work of a step, not its waiting."""
    return time.process_time()


def median_min_max(values: Sequence[float]) -> tuple[float, float, float]:
    return statistics.median(values), min(values), max(values)


def ratio_text(values: Sequence[float]) -> str:
    med, lo, hi = median_min_max(values)
    return f"{med:.2f}x [{lo:.2f}, {hi:.2f}]"


__all__ = ["bench_arch", "hf_peer", "hybrid_weights", "LoadMonitor", "load_average", "peer_env", "rotating",
           "cpu_clock", "median_min_max", "ratio_text", "allocator_text", "Callable"]
