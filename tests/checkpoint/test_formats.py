"""The registry of checkpoint formats (checkpoint/formats/): every row is reachable from detection and from
the CLI's `convert --to`, a format is one package and one row, detection and the architecture read need no
torch, nothing outside the rows asks what kind a folder is, and a training checkpoint is a `model.checkpoint`
for validate-config as it is a SRC for convert.

The folders are what each format's own writer wrote: transformers (HF), OpenAI's naming rules
(tests/checkpoint/test_convert_sources.py), `gptoss train` (a 2-step LoRA run) and `gptoss convert --to NAME`.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from gptoss_cli.checkpoint import formats
from gptoss_cli.checkpoint.convert import convert
from gptoss_cli.checkpoint.formats.plan import ConvertPlan
from gptoss_cli.checkpoint.load import checkpoint_architecture
from gptoss_cli.cli import app
from gptoss_cli.model.config import GptOssArch
from gptoss_cli.run.worker import run_worker
from tests.checkpoint.test_convert_sources import write_openai_original
from tests.train.jobs import train_job

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "gptoss_cli"
FORMATS_DIR = PACKAGE / "checkpoint" / "formats"


@pytest.fixture(scope="module")
def lora_run(hybrid_from_bf16, tmp_path_factory) -> Path:
    """The checkpoint.dir of a 2-step LoRA run on the tiny model (saved at step 2)."""
    run = tmp_path_factory.mktemp("formats-run")
    arch, _ = checkpoint_architecture(hybrid_from_bf16)
    run_worker(train_job(run / "run", arch=arch, pretrained=str(hybrid_from_bf16), lora_rank=2, lora_alpha=4.0,
                         lora_targets=["linear_qkv", "linear_fc1"], seq_length=16, global_batch_size=2,
                         micro_batch_size=1, train_iters=2, save_interval=2, checkpoint_dir=str(run / "ckpt"),
                         use_distributed_optimizer=False))
    return run / "ckpt"


@pytest.fixture(scope="module")
def folders(hf_bf16, hf_mxfp4, hybrid_from_bf16, lora_run, tmp_path_factory) -> dict[str, Path]:
    """One folder per row; a writable row's is the output of the command `gptoss convert SRC DST --to <its name>`."""
    root = tmp_path_factory.mktemp("formats")
    write_openai_original(hf_mxfp4, root / "repo")
    made = {"hybrid": hf_bf16, "hf": hybrid_from_bf16, "megatron": hf_bf16, "peft": lora_run}
    out = {"openai-original": root / "repo", "training": lora_run}
    for name, src in made.items():
        out[name] = root / name
        result = CliRunner().invoke(app, ["convert", str(src), str(out[name]), "--to", name, "--dtype", "float32",
                                          "--quiet"])
        assert result.exit_code == 0, (name, result.output)
    if importlib.util.find_spec("gguf") is not None:  # a GGUF carries its tokenizer: make-tiny's model has one
        from gptoss_cli.checkpoint.make_tiny import make_tiny

        make_tiny(root / "tiny", experts="mxfp4")
        out["gguf"] = root / "model.gguf"
        result = CliRunner().invoke(app, ["convert", str(root / "tiny"), str(out["gguf"]), "--to", "gguf", "--quiet"])
        assert result.exit_code == 0, result.output
    return out


def test_every_row_is_reachable_from_detection_and_every_writer_from_convert_to(folders):
    pytest.importorskip("gguf")
    assert {f.name for f in formats.FORMATS} == set(folders)
    assert set(formats.WRITERS) == {f.name for f in formats.FORMATS if f.plan is not None} == {
        "hybrid", "hf", "megatron", "peft", "gguf"}
    for name, folder in folders.items():
        assert formats.detect(folder) is formats.by_name(name), (name, formats.detect(folder))


def test_convert_to_refuses_every_row_without_a_plan_and_names_the_writers(folders, tmp_path):
    """The CLI's --to choices are the rows with a plan: each of the others is refused in one line (exit 2) that
    names exactly those, and nothing is written; the option's help names every one of them."""
    readers_only = [f.name for f in formats.FORMATS if f.plan is None]
    assert readers_only == ["openai-original", "training"]
    for name in readers_only:
        result = CliRunner().invoke(app, ["convert", str(folders["hf"]), str(tmp_path / name), "--to", name])
        assert result.exit_code == 2, (name, result.output)
        assert f"--to {name!r} is not supported; use {' or '.join(formats.WRITERS)}" in result.output
        assert not (tmp_path / name).exists()
    help_text = next(p.help for p in typer.main.get_command(app).commands["convert"].params if p.name == "to")
    assert [w for w in formats.WRITERS if not re.search(rf"\b{w}\b", help_text)] == [], help_text


def _row_packages() -> list[str]:
    return sorted(p.parent.name for p in FORMATS_DIR.glob("*/__init__.py"))


def test_a_format_is_one_package_holding_its_row_its_functions_and_its_plan():
    """`formats/<name>/__init__.py` is exactly one row of FORMATS, every function of the row is defined in that
    package, and a writable row's plan is the package's plan.py (the only ConvertPlan whose target it is)."""
    rows = {}
    for package in _row_packages():
        module = importlib.import_module(f"gptoss_cli.checkpoint.formats.{package}")
        defined = [v for v in vars(module).values() if isinstance(v, formats.Format)]
        assert len(defined) == 1, (package, defined)
        rows[defined[0].name] = module.__name__
    assert sorted(rows) == sorted(f.name for f in formats.FORMATS)
    plans = {}
    for fmt in formats.FORMATS:
        home = rows[fmt.name]
        functions = {k: v for k in ("detect", "architecture", "open", "plan", "replaceable")
                     if (v := getattr(fmt, k)) is not None}
        strays = {k: v.__module__ for k, v in functions.items() if not (v.__module__ + ".").startswith(home + ".")}
        assert strays == {}, (fmt.name, strays)
        has_plan = (FORMATS_DIR / home.rsplit(".", 1)[1] / "plan.py").is_file()
        assert has_plan == fmt.writable, fmt.name
        if has_plan:
            plans[fmt.name] = importlib.import_module(f"{home}.plan")
    found = []
    todo = list(ConvertPlan.__subclasses__())
    while todo:
        cls = todo.pop()
        todo += cls.__subclasses__()
        if cls.__module__.startswith("gptoss_cli."):
            found.append((cls.target, cls.__module__))
    assert sorted(found) == sorted((name, module.__name__) for name, module in plans.items())


def test_detection_and_the_architecture_read_import_no_torch(folders, hf_bf16):
    """What validate-config needs of a checkpoint, in a fresh interpreter: the row and its architecture."""
    readable = {k: str(v) for k, v in folders.items() if k != "peft"}
    code = ("import json, sys; from pathlib import Path; from gptoss_cli.checkpoint import formats\n"
            f"out = {{k: formats.architecture(Path(v))[1][0].to_dict() for k, v in {readable!r}.items()}}\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n"
            "print(json.dumps(out))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout)
    want, _ = checkpoint_architecture(hf_bf16)  # opened the ordinary way, with torch
    for name in ("hybrid", "hf", "megatron", "training"):  # Megatron's args record no token ids
        assert GptOssArch.from_dict(got[name]).differences(want) == [], name


def test_a_training_checkpoint_is_a_model_checkpoint_for_validate_config(lora_run, hf_bf16):
    """validate-config read only hybrid_config.json / config.json / Megatron args, so a run's checkpoint.dir,
    which convert, generate and checkpoint.pretrained accept, was refused (exit 2)."""
    want, _ = checkpoint_architecture(hf_bf16)
    for ckpt in (lora_run, lora_run / "iter_0000002"):
        result = CliRunner().invoke(app, ["validate-config", "tiny_cpu_ep2", "model.preset=null",
                                          f"model.checkpoint={ckpt}"])
        assert result.exit_code == 0, result.output
    from gptoss_cli.recipe.load import load_recipe

    recipe = load_recipe("tiny_cpu_ep2", ["model.preset=null", f"model.checkpoint={lora_run}"])
    assert recipe.arch.differences(want) == [] and recipe.pattern.text == want.hybrid_layer_pattern


def test_only_the_registry_asks_what_kind_a_checkpoint_is():
    """No `kind ==` / `kind in (...)` switchboards on format names outside checkpoint/formats/."""
    names = "|".join(re.escape(repr(f.name)[1:-1]) for f in formats.FORMATS)
    switch = re.compile(rf"\bkind\s*(==|!=|\bin\b|\bnot in\b)\s*\(?\s*(HF|ORIGINAL|HYBRID|TRAINING|MEGATRON|PEFT|"
                        rf"HYBRID_NAMED|[\"'](?:{names})[\"'])")
    found = [f"{p.relative_to(ROOT)}:{i}" for p in sorted(PACKAGE.rglob("*.py")) if "formats" not in p.parts
             for i, line in enumerate(p.read_text().splitlines(), 1) if switch.search(line)]
    assert not found, found
