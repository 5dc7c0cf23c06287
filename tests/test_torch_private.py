"""gptoss_cli/torch_private.py: a torch outside the tested range is refused where a private torch name is
used, in one sentence naming the version and the feature, and never when a module is imported.

tests/test_private_imports.py checks that no other module reaches a private torch name.
"""

from __future__ import annotations

import ast
import inspect
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from packaging.version import Version

from gptoss_cli import torch_private
from gptoss_cli.errors import ConfigError
from gptoss_cli.model.gemm.grouped import GroupedGemm

PACKAGE = Path(torch_private.__file__).resolve().parent
# The guard's questions (they only look, on any torch); every other function of it uses a private name.
QUESTIONS = {"minor_version", "tested", "require", "has_grouped_mm", "has_scaled_grouped_mm", "has_flex_attention_op",
             "has_cpu_flash_attention"}
USES = sorted(name for name, fn in vars(torch_private).items()
              if inspect.isfunction(fn) and fn.__module__ == torch_private.__name__ and name not in QUESTIONS)
FEATURES = {value for name, value in vars(torch_private).items() if name.isupper() and isinstance(value, str)}


@pytest.mark.parametrize("version", ["2.10.2", "2.11.0", "2.12.1+cu128", "2.13.0+cpu", "2.14.0.dev20260301+cpu",
                                     "3.0.0", "2.9.0a0+git1234"])
def test_the_tested_range_compares_major_and_minor_versions(version):
    release = Version(version).release[:2]  # packaging's reading of the version: the reference
    assert torch_private.tested(version) == (torch_private.TESTED[0] <= release <= torch_private.TESTED[1])


def test_the_suite_runs_on_a_tested_torch():
    assert torch_private.tested(torch.__version__), f"torch {torch.__version__} is outside {torch_private.TESTED}"


@pytest.mark.parametrize("name", USES)
def test_every_use_refuses_an_untested_torch_in_one_sentence(name, monkeypatch):
    monkeypatch.setattr(torch, "__version__", "2.14.0.dev20260301+cpu")
    fn = getattr(torch_private, name)
    required = [p for p in inspect.signature(fn).parameters.values()
                if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    keywords = {p.name: None for p in inspect.signature(fn).parameters.values()
                if p.default is p.empty and p.kind is p.KEYWORD_ONLY}
    with pytest.raises(ConfigError) as caught:  # before it touches an argument: None would fail otherwise
        fn(*[None] * len(required), **keywords)
    message = caught.value.message
    feature, _, rest = message.partition(" is private to torch and untested on torch 2.14.0.dev20260301+cpu: ")
    assert feature in FEATURES and rest == "gptoss is tested with torch 2.11 to 2.13", message
    assert "\n" not in str(caught.value) and caught.value.exit_code == 2


def test_the_experts_grouped_gemm_is_refused_on_an_untested_torch(monkeypatch):
    x, w = torch.ones(4, 8), torch.ones(2, 16, 8)
    counts = torch.tensor([1, 3])
    expected = torch.full((4, 16), 8.0)  # every product a sum of eight ones
    torch.testing.assert_close(GroupedGemm().fprop(x, w, counts), expected, rtol=0, atol=0)
    monkeypatch.setattr(torch, "__version__", "2.10.0")
    with pytest.raises(ConfigError, match=r"^torch\._grouped_mm \(the experts' grouped GEMM\) is private to torch and "
                                          r"untested on torch 2\.10\.0"):
        GroupedGemm().fprop(x, w, counts)


def test_an_untested_torch_imports_every_module_and_refuses_only_at_use():
    # A fresh interpreter: the modules' import-time code runs under the untested version. Several seconds
    # (torch.distributed.pipelining's import among them): the only way to see an import refuse.
    users = sorted(".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
                   for path in PACKAGE.rglob("*.py") if path.name != "torch_private.py"
                   and any(isinstance(n, ast.ImportFrom) and n.module == "gptoss_cli"
                           and any(a.name == "torch_private" for a in n.names)
                           for n in ast.walk(ast.parse(path.read_text()))))
    assert "gptoss_cli.schedule.pipeline.stage" in users and len(users) >= 10
    code = "\n".join(["import torch", "torch.__version__ = '2.99.0'", *(f"import {m}" for m in users),
                      "from gptoss_cli.model.decode.kv_cache import fused_sink_attention",
                      "try:", "    fused_sink_attention(*[torch.zeros(1, 1, 1, 8)] * 3, torch.zeros(1), None)",
                      "except Exception as exc:", "    print(type(exc).__name__, exc)"])
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("ConfigError aten._scaled_dot_product_flash_attention_for_cpu"), out.stdout
