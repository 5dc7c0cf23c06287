"""Values: options, recipe fields and checkpoint configs are checked for type, finiteness and range before any work."""

from __future__ import annotations

import json
import time

import pytest
from typer.testing import CliRunner

from gptoss_cli.cli import app
from gptoss_cli.errors import ConfigError
from gptoss_cli.checkpoint.formats.hf.config import from_hf_config, to_hf_config
from gptoss_cli.model.config import GptOssArch, preset
from tests.faults.conftest import assert_one_line, gptoss

runner = CliRunner()


def test_a_checkpoint_config_with_absurd_sizes_is_one_line_not_a_memory_blow_up(tmp_path):
    # num_hidden_layers=1e8 without layer_types once grew memory at 30 MB/s until the process died.
    cfg = to_hf_config(preset("tiny"))
    del cfg["layer_types"]
    cfg["num_hidden_layers"] = 100_000_000
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    t0 = time.monotonic()
    proc = gptoss("validate-config", "tiny_cpu_ep2", "model.preset=null", f"model.checkpoint={tmp_path}",
                  cwd=tmp_path, timeout=60)
    assert_one_line(proc, 2, "num_hidden_layers=100000000", "implausibly large", str(tmp_path / "config.json"))
    assert time.monotonic() - t0 < 30


@pytest.mark.parametrize("value", [".inf", ".nan", "1e400", "-.inf", "1e39"])
def test_validate_config_calls_a_non_finite_learning_rate_invalid(value):
    result = runner.invoke(app, ["validate-config", "tiny_cpu_ep2", f"training.lr={value}"])
    assert result.exit_code == 1, result.output
    assert "field.range" in result.output and "INVALID" in result.output


def test_train_refuses_a_non_finite_value_before_any_process_starts(tmp_path):
    result = runner.invoke(app, ["train", "--recipe", "tiny_cpu_ep2", "optimizer.adam_beta2=.nan",
                                 f"logging.run_dir={tmp_path / 'run'}", f"checkpoint.dir={tmp_path / 'ck'}"])
    assert result.exit_code == 1 and "optimizer.adam_beta2=nan is not a finite" in result.output, result.output
    assert not (tmp_path / "run").exists() and not (tmp_path / "ck").exists()


@pytest.mark.parametrize("field, value, needle", [
    ("rope_theta", "abc", "rope_theta='abc' must be a finite number"),
    ("rope_theta", float("nan"), "rope_theta=nan must be a finite number"),
    ("rms_norm_eps", 0.0, "rms_norm_eps=0.0 must be > 0"),
    ("hidden_size", 64.5, "hidden_size=64.5 must be a positive integer"),
    ("vocab_size", 1 << 40, "implausibly large"),
    ("rope_truncate", "false", "rope_truncate='false' must be true or false"),
    ("eos_token_id", 5000, "eos_token_id=5000 must be a token id in [0, vocab_size=1003)"),
])
def test_architecture_fields_are_checked_for_type_finiteness_and_range(field, value, needle):
    data = preset("tiny").to_dict()
    data[field] = value
    with pytest.raises(ConfigError, match=__import__("re").escape(needle)):
        GptOssArch.from_dict(data, source="hybrid_config.json")


def test_rope_scaling_null_means_gpt_oss_yarn_with_truncate_false_as_transformers_reads_it():
    transformers = pytest.importorskip("transformers")
    cfg = to_hf_config(preset("tiny"))
    cfg["rope_scaling"] = None
    ours = from_hf_config(cfg)
    theirs = transformers.GptOssConfig(**{k: v for k, v in cfg.items() if k != "quantization_config"}).rope_parameters
    assert theirs["rope_type"] == "yarn"
    assert ours.rope_truncate is theirs["truncate"] is False
    assert (ours.rope_scaling_factor, ours.rope_beta_fast, ours.rope_beta_slow) == (
        theirs["factor"], theirs["beta_fast"], theirs["beta_slow"])
    assert ours.rope_original_max_position_embeddings == theirs["original_max_position_embeddings"]


@pytest.mark.parametrize("args, needle", [
    (["--max-shard-size", "nan"], "--max-shard-size nan must be a finite number"),
    (["--max-shard-size", "inf"], "--max-shard-size inf must be a finite number"),
    (["--max-shard-size", "0"], "--max-shard-size 0.0 must be a finite number in (0"),
])
def test_convert_options_are_checked_before_any_work(tiny_hf, tmp_path, args, needle):
    result = runner.invoke(app, ["convert", str(tiny_hf), str(tmp_path / "out"), "--quiet", *args])
    assert result.exit_code == 2 and needle in result.output, result.output
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("option, value", [("--top1-min", "1.5"), ("--kl-max", "nan"), ("--cosine-min", "-inf")])
def test_parity_thresholds_must_be_finite_and_in_range(tmp_path, option, value):
    result = runner.invoke(app, ["parity-check", str(tmp_path), str(tmp_path), option, value])
    assert result.exit_code == 2 and f"{option} " in result.output and "finite number" in result.output, result.output
