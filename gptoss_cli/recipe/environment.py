"""What the rules need to know about the machine: the GPU generation and the installed torch."""

from __future__ import annotations

from importlib import metadata

# GPU generations: native FP8 GEMMs need Hopper (sm90) or newer; MXFP8 block scaling is a
# Blackwell (sm100) feature.
HOPPER_OR_NEWER = frozenset({"h100", "h200", "b200", "gb200", "gb300"})
BLACKWELL = frozenset({"b200", "gb200", "gb300"})


def gpu_from_device_name(name: str | None) -> str:
    """The system.gpu value for a CUDA device name (torch.cuda.get_device_name()); "auto" if unknown.

    train passes it as `validate_recipe(..., gpu=...)` so FP8 rules judge the GPU it runs on.
    """
    if not name:
        return "none"
    text = name.lower().replace("-", " ")
    for key in ("gb300", "gb200", "b200", "h200", "h100", "a100"):
        if key in text.replace(" ", ""):
            return key
    return "auto"


def installed_torch_version() -> str:
    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:  # pragma: no cover - torch is a dependency
        return ""


__all__ = ["gpu_from_device_name", "installed_torch_version", "HOPPER_OR_NEWER", "BLACKWELL"]
