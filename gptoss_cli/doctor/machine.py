"""The machine's facts for `gptoss doctor`: torch, CUDA, NCCL and driver versions, the device, its
generation as recipes name it (system.gpu), compute capability and free memory; the host's cores and memory."""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import asdict, dataclass
from typing import Any

import torch

from gptoss_cli import torch_private
from gptoss_cli.errors import UsageError
from gptoss_cli.recipe.environment import gpu_from_device_name, installed_torch_version


@dataclass(frozen=True)
class MachineFacts:
    device: str  # "cuda" or "cpu": where the checks run
    torch_version: str
    cuda_version: str | None  # the CUDA torch was built with
    nccl_version: str | None
    driver_version: str | None  # nvidia-smi's, else the CUDA driver API's
    gpu_name: str | None
    gpu_count: int
    capability: tuple[int, int] | None
    generation: str  # system.gpu: h100, b200, ..., "none" without a GPU, "auto" when unknown
    gpu_memory_free_gb: float | None
    gpu_memory_total_gb: float | None
    cpu_cores: int
    host_memory_gb: float | None

    @property
    def cpu_only(self) -> bool:
        return self.device == "cpu"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def resolve_device(device: str = "auto") -> str:
    """"auto" is cuda where torch sees a GPU, else cpu; "cuda" without a GPU is a UsageError (exit 2)."""
    if device not in ("auto", "cpu", "cuda"):
        raise UsageError(f"--device {device!r} is not one of auto, cpu, cuda")
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: torch sees no CUDA GPU here", hint="--device cpu checks the CPU paths")
    return device


def machine_facts(device: str) -> MachineFacts:
    """The facts of this machine, with the checks to run on `device` ("cuda" or "cpu")."""
    cuda = torch.cuda.is_available()
    name = torch.cuda.get_device_name(0) if cuda else None
    free = total = None
    if cuda:
        free_b, total_b = torch.cuda.mem_get_info(0)
        free, total = free_b / 1e9, total_b / 1e9
    return MachineFacts(
        device=device,
        torch_version=installed_torch_version() or torch.__version__,
        cuda_version=torch.version.cuda,
        nccl_version=_nccl_version() if cuda else None,
        driver_version=_driver_version() if cuda else None,
        gpu_name=name,
        gpu_count=torch.cuda.device_count() if cuda else 0,
        capability=tuple(torch.cuda.get_device_capability(0)) if cuda else None,
        generation=gpu_from_device_name(name),
        gpu_memory_free_gb=free,
        gpu_memory_total_gb=total,
        cpu_cores=os.cpu_count() or 1,
        host_memory_gb=_host_memory_gb(),
    )


def _nccl_version() -> str | None:
    try:
        v = torch.cuda.nccl.version()
    except Exception:  # noqa: BLE001 - a build without NCCL
        return None
    return ".".join(str(x) for x in v) if isinstance(v, tuple) else str(v)


def _driver_version() -> str | None:
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            out = subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True,
                                 text=True, timeout=20, check=True).stdout.split()
            if out:
                return out[0]
        except (OSError, subprocess.SubprocessError):
            pass
    try:
        v = torch_private.cuda_driver_version()  # e.g. 12040: the CUDA version the driver supports
    except Exception:  # noqa: BLE001
        return None
    return f"CUDA {v // 1000}.{v % 1000 // 10} driver API"


def _host_memory_gb() -> float | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9
    except (ValueError, OSError, AttributeError):
        return None


__all__ = ["MachineFacts", "machine_facts", "resolve_device"]
