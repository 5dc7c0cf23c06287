"""`gptoss demo`: the whole job in one command, judged from outside (exit code, JSON, transformers)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from gptoss_cli import demo
from gptoss_cli.cli import app
from gptoss_cli.model.config import preset
from tests.faults.conftest import assert_one_line, gptoss
from tests.model.tiny_checkpoints import load_hf_reference

STAGES = ["convert", "parity", "validate", "train", "sft", "export"]


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    """One real run through the CLI in a child process, as a user runs it (default steps)."""
    root = tmp_path_factory.mktemp("demo")
    proc = gptoss("demo", "--workdir", root / "work", "--json", root / "demo.json", timeout=300)
    return proc, json.loads((root / "demo.json").read_text()) if (root / "demo.json").is_file() else None


def test_every_stage_passes_in_order_and_the_summary_table_says_so(demo_run):
    proc, report = demo_run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert [s["name"] for s in report["stages"]] == STAGES
    assert [s["status"] for s in report["stages"]] == ["passed"] * 6 and report["ok"]
    assert proc.stdout.strip().splitlines()[-1].startswith("demo OK: every stage passed")
    for i, s in enumerate(report["stages"], 1):  # each stage: its result line, and a row with its figure
        assert f"passed: {s['summary']}" in proc.stdout
        assert f"{i}. {s['name']}" in proc.stdout and s["figure"] in proc.stdout and s["seconds"] > 0


def test_the_validate_stage_shows_the_rejection_a_user_would_get(demo_run):
    proc, report = demo_run
    rejected = report["stages"][2]["details"]["rejected"]
    assert rejected["recipe"] == demo.REJECTED_RECIPE and rejected["errors"]
    assert "overlap.cuda_graphs" in {e["rule"] for e in rejected["errors"]}
    assert "cuda_graph_impl=none" in proc.stdout  # the fix, as printed


def test_the_loss_falls_on_the_learnable_data(demo_run):
    _, report = demo_run
    losses = report["stages"][3]["details"]["losses"]
    assert len(losses) == demo.DEFAULT_STEPS
    # the cycle makes every next token a function of the current one: about ln(vocab) = 6.9 at the
    # start; a model that learns it ends near 0 (a model that does not stays near ln(vocab))
    assert losses[0] > 5 and losses[-1] < 0.1 * losses[0]


def test_the_exported_mxfp4_checkpoint_predicts_the_cycle_in_transformers(demo_run):
    """Independent of our code: transformers loads the export and its greedy next tokens on the start
    of the training data are the ones the permutation cycle dictates."""
    _, report = demo_run
    export = Path(report["stages"][5]["details"]["hf"])
    config = json.loads((export / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "mxfp4"
    prompt = demo.learnable_tokens(preset("tiny"), demo.PROMPT_TOKENS + 1)
    model = load_hf_reference(export)
    with torch.no_grad():
        predicted = model(prompt[:-1].view(1, -1)).logits[0].argmax(-1)
    assert predicted.tolist() == prompt[1:].tolist()
    details = report["stages"][5]["details"]
    assert details["top1_agree"] == details["transformers_top1_agree"] == demo.PROMPT_TOKENS


def test_the_sft_stage_fine_tunes_offline_and_eval_agrees_with_validation(demo_run):
    """The SFT path with make-tiny's tokenizer: harmony token files, a fine-tune whose held-out loss
    falls, `eval` of the result equal to the validation loss the run logged, and a reply."""
    proc, report = demo_run
    details = report["stages"][4]["details"]
    assert details["after"] < 0.9 * details["before"]
    assert details["validation"] == pytest.approx(details["after"], rel=1e-4)
    assert details["reply"] and "generate 'What is 7 plus 3?'" in proc.stdout


def test_a_failed_stage_exits_1_and_the_stages_that_need_it_do_not_run(tmp_path, monkeypatch):
    """Without transformers parity is skipped (not failed); a validate stage whose production recipe
    is accepted fails, so train and export do not run, and the exit code is 1."""
    monkeypatch.setattr(demo, "_transformers_available", lambda: False)
    monkeypatch.setattr(demo, "REJECTED_RECIPE", "tiny_cpu_ep2")  # a valid recipe: the stage must fail
    out = tmp_path / "demo.json"
    result = CliRunner().invoke(app, ["demo", "--workdir", str(tmp_path / "work"), "--json", str(out), "--quiet"])
    assert result.exit_code == 1, result.output
    stages = json.loads(out.read_text())["stages"]
    assert [s["status"] for s in stages] == ["passed", "skipped", "failed", "not run", "not run", "not run"]
    assert "install .[parity]" in stages[1]["summary"]
    # the last line names what failed and what was skipped, and why
    last = result.output.strip().splitlines()[-1]
    assert last.startswith("demo FAILED: validate") and "skipped: parity (install .[parity]" in last
    assert "should be rejected" in stages[2]["summary"]
    assert not (tmp_path / "work" / "train").exists()


def test_a_workdir_with_other_files_is_refused_untouched(tmp_path):
    work = tmp_path / "mine"
    work.mkdir()
    (work / "notes.txt").write_text("keep me")
    assert_one_line(gptoss("demo", "--workdir", work), 2, str(work), "not made by `gptoss demo`")
    assert [p.name for p in work.iterdir()] == ["notes.txt"]


def test_help_names_the_extras_that_skipped_stages_need():
    """rich markup must not eat `[parity]` (it reads it as a tag)."""
    result = CliRunner().invoke(app, ["demo", "--help"], env={"COLUMNS": "200"})
    text = " ".join(result.output.split())
    assert result.exit_code == 0 and ".[parity]" in text and ".[data]" in text, result.output
