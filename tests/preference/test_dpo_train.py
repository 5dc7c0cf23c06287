"""`gptoss train` with objective.kind=dpo on the tiny model, offline: it learns pairs a tiny model can learn, it does
not with training.lr=0, and a precomputed reference gives the same logged losses as the model reference, bit for bit.

The pairs (gptoss_cli/demo.py, `preference_pairs`): "What is a plus b?", both sides answer the sum, the chosen
side ends in " Thanks" and the rejected one in " please"; held-out pairs use other numbers. The preference is
one token at the end of the reply, which the tiny model learns in a few steps whatever the prompt. At the start
the policy is the reference, so every reward is exactly 0 and no pair is won (accuracy counts chosen >
rejected, as TRL's): the held-out accuracy starts at 0, not at a coin's 0.5.

Three runs of the tiny_cpu_dpo recipe share one module fixture (about 25 s each on 2 busy cores: the proof
the issue asks for): the recipe as shipped (6 steps, the frozen reference model, validation after steps 3
and 6), the same with dpo.reference=precomputed (the pairs scored once before the policy is built, into
PREFIX.reference), and training.lr=0.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from gptoss_cli.demo import preference_pairs
from tests.support.cli import run_cli


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("dpo")
    assert run_cli("make-tiny", root / "tiny-hf").exit_code == 0
    for name, held_out in (("pairs", False), ("pairs_val", True)):
        (root / f"{name}.jsonl").write_text("".join(json.dumps(p) + "\n" for p in preference_pairs(held_out)))
        r = run_cli("prepare-data", root / f"{name}.jsonl", "--format", "preference", "--tokenizer", root / "tiny-hf",
                    "--out", root / "data" / name, "--seq-length", 128, "--quiet")
        assert r.exit_code == 0, r.output
    out = {}
    for name, extra in (("model", []), ("precomputed", ["dpo.reference=precomputed"]), ("lr0", ["training.lr=0",
                                                                                                "training.min_lr=0"])):
        result = run_cli("train", "--recipe", "tiny_cpu_dpo", f"checkpoint.pretrained={root / 'tiny-hf'}",
                         f"data.path={root / 'data' / 'pairs'}", f"validation.data={root / 'data' / 'pairs_val'}",
                         "checkpoint.dir=null", "checkpoint.keep_last=null", f"logging.run_dir={root / name}", *extra)
        assert result.exit_code == 0, result.output
        out[name] = (_metrics(root / name), result.output)
    out["root"] = root
    return out


def test_held_out_accuracy_rises_above_0_9_and_not_with_lr_0(runs):
    lines, console = runs["model"]
    validated = [m for m in lines if "val_rewards_accuracy" in m]
    assert [m["step"] for m in validated] == [3, 6]
    assert lines[0]["rewards_accuracy"] == 0.0 and lines[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert validated[-1]["val_rewards_accuracy"] > 0.9 and validated[-1]["val_rewards_margin"] > 0
    assert validated[-1]["val_loss"] < 0.5 * math.log(2)
    assert "acc" in console and "val acc" in console  # the objective's metrics on the console line
    report = run_cli("report", runs["root"] / "model")
    assert report.exit_code == 0, report.output
    for name in ("rewards_accuracy", "rewards_margin", "rewards_chosen", "rewards_rejected", "val_rewards_accuracy"):
        assert f"{name}.png" in report.output
    frozen = [m for m in runs["lr0"][0] if "val_rewards_accuracy" in m]
    assert [m["val_rewards_accuracy"] for m in frozen] == [0.0, 0.0]
    assert all(m["val_loss"] == pytest.approx(math.log(2), abs=1e-6) for m in frozen)


def test_precomputed_reference_equals_the_model_reference_bit_for_bit(runs):
    model, precomputed = runs["model"][0], runs["precomputed"][0]
    assert len(model) == len(precomputed) == 6
    for a, b in zip(model, precomputed):
        for key in ("loss", "grad_norm", "rewards_chosen", "rewards_rejected", "rewards_margin", "rewards_accuracy",
                    "val_loss", "val_rewards_margin"):
            assert a.get(key) == b.get(key), (a["step"], key)
    assert (runs["root"] / "data" / "pairs.reference" / "manifest.json").is_file()
    assert (runs["root"] / "data" / "pairs_val.reference" / "manifest.json").is_file()


def test_a_reference_scored_from_other_data_is_refused_naming_both_digests(runs, tmp_path):
    root = runs["root"]
    other = tmp_path / "pairs"
    pairs = preference_pairs(False)[::-1]  # the same pairs in another order: other data
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pairs))
    assert run_cli("prepare-data", tmp_path / "pairs.jsonl", "--format", "preference", "--tokenizer",
                   root / "tiny-hf", "--out", other, "--quiet").exit_code == 0
    (root / "data" / "pairs.reference").rename(tmp_path / "pairs.reference")  # a foreign folder next to it
    try:
        result = run_cli("train", "--recipe", "tiny_cpu_dpo", f"checkpoint.pretrained={root / 'tiny-hf'}",
                         f"data.path={other}", "validation.data=null", "validation.interval=null",
                         "dpo.reference=precomputed", "checkpoint.dir=null", "checkpoint.keep_last=null",
                         f"logging.run_dir={tmp_path / 'run'}", "training.train_iters=1")
    finally:
        (tmp_path / "pairs.reference").rename(root / "data" / "pairs.reference")
    assert result.exit_code == 2, result.output
    line = [ln for ln in result.output.splitlines() if "stale or foreign" in ln][0]
    from gptoss_cli.score import data_digest

    stored = json.loads((root / "data" / "pairs.reference" / "manifest.json").read_text())["data"]["digest"]
    assert stored in line and data_digest(other) in line and stored != data_digest(other)
