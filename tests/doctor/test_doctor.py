"""`gptoss doctor` on a CPU-only machine: it says so, checks the CPU paths against float64, tells what each
shipped recipe gets here, and exits 1 when a check fails (a planted kernel bug) or 2 for a device it lacks."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from gptoss_cli.cli.app import app

runner = CliRunner()


@pytest.fixture(scope="module")
def cpu_report(tmp_path_factory):
    if torch.cuda.is_available():
        pytest.skip("this module checks the CPU-only machine")
    out = tmp_path_factory.mktemp("doctor") / "doctor.json"
    result = runner.invoke(app, ["doctor", "--device", "cpu", "--json", str(out)])
    return result, json.loads(out.read_text()) if out.exists() else None


def test_on_a_cpu_only_machine_every_check_passes_or_is_skipped_and_exit_is_0(cpu_report):
    result, report = cpu_report
    assert result.exit_code == 0, result.output
    assert "no CUDA GPU: checking the CPU paths" in result.output and "all checks passed" in result.output
    assert report["ok"] and report["machine"]["device"] == "cpu" and report["machine"]["gpu_name"] is None
    status = {c["name"]: c["status"] for c in report["checks"]}
    assert status.pop("collective nccl") == "SKIP"
    assert set(status) == {"model", "attention flash", "attention flex", "attention sdpa", "grouped GEMM",
                           "fp8 tensorwise", "fp8 rowwise", "fp8 mxfp8", "collective gloo"}
    assert set(status.values()) == {"PASS"}, status


def test_the_recipes_table_says_what_this_machine_runs_and_refuses(cpu_report):
    _, report = cpu_report
    recipes = {r["recipe"]: r for r in report["recipes"]}
    # the rule registry's verdict on a CPU: MXFP8 without emulation has no kernel here, with it runs emulated
    assert recipes["gb200_fp8mx"]["fp8"].startswith("mxfp8: refused")
    assert any("[fp8.native_gpu]" in r for r in recipes["gb200_fp8mx"]["refused"])
    assert recipes["tiny_cpu_ep2_mxfp8"]["fp8"] == "mxfp8: emulated" and recipes["tiny_cpu_ep2_mxfp8"]["ok"]
    # attention on a CPU: the CPU flash kernel for both layer kinds
    assert recipes["gpt_oss_20b_pretrain"]["attention"] == {"full": "flash", "sliding": "flash"}


def test_a_wrong_attention_kernel_fails_its_check_and_exit_is_1(monkeypatch):
    # Planted bug: the flash path's sliding-window blocks see one key too many.
    import gptoss_cli.model.attention.backends as backends
    from gptoss_cli.model.attention.masks import query_blocks

    monkeypatch.setattr(backends, "query_blocks", lambda s, w, device, dtype: query_blocks(
        s, None if w is None else w + 1, device, dtype))
    result = runner.invoke(app, ["doctor", "--device", "cpu", "--no-recipes", "--check", "attention flash"])
    assert result.exit_code == 1, result.output
    assert "FAIL" in result.output and "1 check(s) FAILED" in result.output


def test_a_device_the_machine_lacks_is_one_line_exit_2():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    result = runner.invoke(app, ["doctor", "--device", "cuda"])
    assert result.exit_code == 2 and "torch sees no CUDA GPU" in result.output and "Traceback" not in result.output
