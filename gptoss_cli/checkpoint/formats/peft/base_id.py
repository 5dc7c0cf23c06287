"""What `adapter_config.json` names as the base model (`base_model_name_or_path`): what a PEFT user loads.

A LoRA run records its base as an absolute local path (the run record's `lora.base.path`), often a Hybrid
folder transformers cannot load and a path that means nothing on another machine. The adapter names
instead, in this order:

- the base's Hugging Face Hub id when it can be told: a folder in the Hub cache
  (`.../models--OWNER--NAME/snapshots/REV`), a `config.json` whose `_name_or_path` is a Hub id, or,
  for a `gptoss convert` output, what it was converted from (its `hybrid_config.json` provenance
  `source`: a Hub id as typed, or a folder looked at the same way, two conversions deep);
- else the folder name of the Hugging Face checkpoint it came from (the base itself when it is one),
  a relative name that is right where bases and adapters sit side by side.

The absolute path and the base's digest stay in the training checkpoint's run record and the
adapter file's provenance metadata. Torch-free.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

HUB_CACHE = re.compile(r"(?:^|/)models--([^/]+?)--([^/]+)(?:/|$)")  # huggingface_hub's cache folder names
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")  # owner/name, as checkpoint/sources.py reads SRC
MAX_DEPTH = 3  # the base, and what it was converted from, twice


def _json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _hub_id(where: str) -> str | None:
    """The Hub id `where` names or is a folder of, else None."""
    path = Path(where).expanduser()
    if not path.exists():
        return where if HUB_ID.match(where) else None  # SRC as typed: not a folder, so a Hub id
    cache = HUB_CACHE.search(path.resolve().as_posix())
    if cache:
        return f"{cache.group(1)}/{cache.group(2)}"
    named = _json(path / "config.json").get("_name_or_path")
    if isinstance(named, str) and HUB_ID.match(named) and not Path(named).expanduser().exists():
        return named
    return None


def base_model_id(base: str) -> str:
    """`base_model_name_or_path` for the LoRA base folder `base` (see the module docstring)."""
    from gptoss_cli.checkpoint.formats.hybrid.config import HYBRID_CONFIG  # noqa: PLC0415

    where, hf_name = base, None
    for _ in range(MAX_DEPTH):
        hub = _hub_id(where)
        if hub is not None:
            return hub
        folder = Path(where).expanduser()
        if not (folder / HYBRID_CONFIG).is_file():
            hf_name = folder.name  # an HF folder (or another kind): its name, if nothing better
            break
        provenance = _json(folder / HYBRID_CONFIG).get("provenance")
        source = provenance.get("source") if isinstance(provenance, dict) else None
        if not isinstance(source, str) or not source:
            break
        where = source
    return hf_name or Path(base).name


__all__ = ["base_model_id"]
