"""The Python packages gptoss needs besides torch, carried to a machine that cannot fetch them.

A GPU machine may come with torch (another version, with CUDA) preinstalled and nothing else, and no
network. Here, with a network: `python tools/offline_deps.py download` has pip resolve the packages
below (within pyproject.toml's bounds; the newest each CPython takes) for CPython 3.10-3.13 on x86_64 Linux and
puts their wheels into `.whl/` at the repository root (git-ignored; pure-Python wheels plus the few
compiled ones they pull, PyYAML and pydantic-core: about 25 MB). The folder travels with the working
tree (the device tool's `carry: [".whl"]`). There, `python tools/offline_deps.py install` installs from
`.whl/` only (`pip --no-index --no-deps`) each distribution none of whose top-level modules imports
yet, into `.whl/site`, which tools/gpu_check.sh puts on PYTHONPATH: nothing the machine already has
(torch's own dependencies among them) is shadowed or replaced.

Stdlib only: it runs before anything is installed.
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WHEELS = ROOT / ".whl"
# The library (training, doctor, tools/gpu_check.py) imports omegaconf; the CLI typer and rich
# (pyproject.toml's bounds).
TOP_LEVEL = ("omegaconf>=2.3", "typer>=0.12", "rich>=13")
PYTHONS = ("3.10", "3.11", "3.12", "3.13")
PLATFORMS = ("manylinux2014_x86_64", "manylinux_2_17_x86_64", "manylinux_2_28_x86_64")


def download(dest: Path = WHEELS) -> None:
    """pip download the packages and their dependencies, as wheels, for each CPython version (needs PyPI)."""
    dest.mkdir(exist_ok=True)
    for py in PYTHONS:
        platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
        subprocess.run([sys.executable, "-m", "pip", "download", "--only-binary=:all:", "--python-version", py,
                        *platforms, "-d", str(dest), *TOP_LEVEL], check=True)


def wheel_modules(wheel: Path) -> set[str]:
    """The top-level modules and packages a wheel installs."""
    with zipfile.ZipFile(wheel) as z:
        tops = {name.split("/")[0] for name in z.namelist()}
    return {t.removesuffix(".py") for t in tops if not t.endswith((".dist-info", ".data")) and not t.endswith(".pth")}


def missing(source: Path = WHEELS) -> list[str]:
    """The distributions in `source` none of whose top-level modules imports here."""
    need = {}
    for wheel in sorted(source.glob("*.whl")):
        dist = wheel.name.split("-")[0]
        modules = wheel_modules(wheel)
        if modules and not any(importlib.util.find_spec(m) is not None for m in modules):
            need[dist.lower()] = dist
    return sorted(need.values())


def install(source: Path = WHEELS) -> Path:
    """Install what is missing from `source` only, into `source/site`; returns that folder."""
    site = source / "site"
    sys.path.insert(0, str(site))  # what an earlier call installed there is not missing
    if not source.is_dir():
        raise SystemExit(f"{source} is missing; run `python tools/offline_deps.py download` where PyPI is reachable")
    need = missing(source)
    if need:
        subprocess.run([sys.executable, "-m", "pip", "install", "--no-index", "--no-deps", "--find-links", str(source),
                        "--target", str(site), "--upgrade", "--quiet", *need], check=True)
    print(f"offline deps: installed {', '.join(need) or 'nothing (all import already)'}; PYTHONPATH gets {site}")
    return site


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("action", choices=("download", "install", "missing"))
    p.add_argument("--dir", type=Path, default=WHEELS)
    args = p.parse_args()
    if args.action == "download":
        download(args.dir)
    elif args.action == "install":
        install(args.dir)
    else:
        print("\n".join(missing(args.dir)))


if __name__ == "__main__":
    main()
