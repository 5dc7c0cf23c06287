"""Every numeric option of every command, driven past the bound its consumer accepts: one `error:` line naming
the option (a range Typer checks included, not its boxed usage text), exit 2, before any work. The list is
checked against the commands' signatures, so a new numeric option needs a case."""

from __future__ import annotations

import inspect
import typing

import pytest
import typer
from typer.testing import CliRunner

from gptoss_cli.cli import app

runner = CliRunner()
I32 = 2**31 - 1

# (command, option): (arguments before the option, the value past its bound, text the error shows)
CASES = {
    ("convert", "--max-shard-size"): (["SRC", "DST"], "1e7", "--max-shard-size 10000000.0 must be a finite number in (0, 1e+06]"),
    ("make-tiny", "--seed"): (["DST"], str(2**63), "Invalid value for '--seed'"),
    ("validate-config", "--world-size"): (["tiny_cpu_ep2"], str(I32 + 1), f"must be an integer in [1, {I32}]"),
    ("parity-check", "--seq-len"): (["HF", "HY"], str((1 << 20) + 1), "Invalid value for '--seq-len'"),
    ("parity-check", "--batch"): (["HF", "HY"], str((1 << 16) + 1), "Invalid value for '--batch'"),
    ("parity-check", "--top1-min"): (["HF", "HY"], "1.5", "--top1-min 1.5 must be a finite number in [0, 1]"),
    ("parity-check", "--kl-max"): (["HF", "HY"], "-1", "--kl-max -1.0 must be a finite number"),
    ("parity-check", "--cosine-min"): (["HF", "HY"], "1.5", "--cosine-min 1.5 must be a finite number in [-1, 1]"),
    ("parity-check", "--hidden-cosine-min"): (["HF", "HY"], "-2", "--hidden-cosine-min -2.0 must be a finite number"),
    ("parity-check", "--hidden-rel-max"): (["HF", "HY"], "-1", "--hidden-rel-max -1.0 must be a finite number"),
    ("train", "--nproc-per-node"): (["--recipe", "tiny_cpu_ep2"], str(I32 + 1), f"must be an integer in [1, {I32}]"),
    ("prepare-data", "--eos-id"): (["IN", "--out", "OUT", "--tokenizer", "TOK"], str(10**30),
                                   f"--eos-id {10**30} is outside the vocabulary"),
    ("demo", "--steps"): ([], "10001", "Invalid value for '--steps'"),
    ("convert", "--vocab-multiple"): (["SRC", "DST", "--to", "megatron"], str((1 << 16) + 1),
                                      "Invalid value for '--vocab-multiple'"),
    ("eval", "--seq-length"): (["CKPT", "--data", "DATA"], str((1 << 24) + 1), "Invalid value for '--seq-length'"),
    ("eval", "--micro-batch-size"): (["CKPT", "--data", "DATA"], str((1 << 16) + 1),
                                     "Invalid value for '--micro-batch-size'"),
    ("eval", "--expert-parallel"): (["CKPT", "--data", "DATA"], str((1 << 16) + 1),
                                    "Invalid value for '--expert-parallel'"),
    ("generate", "--max-new-tokens"): (["CKPT", "-p", "hi"], str((1 << 20) + 1),
                                       f"--max-new-tokens {(1 << 20) + 1} must be in [1, {1 << 20}]"),
    ("generate", "--seed"): (["CKPT", "-p", "hi"], str(2**63), f"--seed {2**63} must be in [0, 2**63)"),
    ("generate", "--temperature"): (["CKPT", "-p", "hi"], "1e-300",
                                    "--temperature 1e-300 must be 0 (greedy) or a finite number in [1e-06, 100]"),
    ("generate", "--top-p"): (["CKPT", "-p", "hi"], "1.5", "--top-p 1.5 must be a finite number in (0, 1]"),
    ("prepare-data", "--max-length"): (["IN", "--out", "OUT", "--tokenizer", "TOK", "--format", "harmony"],
                                       str(I32 + 1), f"--max-length {I32 + 1} must be at least 2 tokens and at most"),
    ("prepare-data", "--seq-length"): (["IN", "--out", "OUT", "--tokenizer", "TOK", "--format", "harmony"],
                                       str(I32 + 1), f"--seq-length {I32 + 1} must be at least 2 tokens and at most"),
    ("prepare-data", "--batch-rows"): (["IN", "--out", "OUT", "--tokenizer", "TOK", "--format", "harmony"],
                                       str((1 << 20) + 1), "Invalid value for '--batch-rows'"),
    ("serve-check", "--top-k"): (["CKPT"], str((1 << 20) + 1), "Invalid value for '--top-k'"),
    ("serve-check", "--greedy-tokens"): (["CKPT"], "4097", "Invalid value for '--greedy-tokens'"),
    ("make-tiny", "--head-dim"): (["DST"], "7", "--head-dim 7 must be an even number from 2 to 512"),
    ("score", "--top-k"): (["CKPT", "--data", "DATA", "--out", "OUT"], str((1 << 20) + 1), "Invalid value for '--top-k'"),
    ("score", "--temperature"): (["CKPT", "--data", "DATA", "--out", "OUT"], "1e-300",
                                 "--temperature 1e-300 must be a finite number in [1e-06, 100]"),
    ("score", "--seq-length"): (["CKPT", "--data", "DATA", "--out", "OUT"], str((1 << 24) + 1),
                                "Invalid value for '--seq-length'"),
    ("score", "--micro-batch-size"): (["CKPT", "--data", "DATA", "--out", "OUT"], str((1 << 16) + 1),
                                      "Invalid value for '--micro-batch-size'"),
    ("score", "--expert-parallel"): (["CKPT", "--data", "DATA", "--out", "OUT"], str((1 << 16) + 1),
                                     "Invalid value for '--expert-parallel'"),
    ("score", "--shard-tokens"): (["CKPT", "--data", "DATA", "--out", "OUT"], str((1 << 40) + 1),
                                  "Invalid value for '--shard-tokens'"),
}


def numeric_options() -> set[tuple[str, str]]:
    found = set()
    for info in app.registered_commands:
        name = info.name or info.callback.__name__.replace("_", "-")
        hints = typing.get_type_hints(info.callback)
        for pname, param in inspect.signature(info.callback).parameters.items():
            default = param.default
            if not isinstance(default, typer.models.OptionInfo):
                continue
            kinds = set(typing.get_args(hints[pname])) or {hints[pname]}
            if kinds & {int, float}:
                option = next((d for d in default.param_decls if d.startswith("--")), "--" + pname.replace("_", "-"))
                found.add((name, option))
    return found


def test_every_numeric_option_has_a_case():
    assert numeric_options() == set(CASES)


@pytest.mark.parametrize("command, option", sorted(CASES), ids=[f"{c} {o}" for c, o in sorted(CASES)])
def test_each_numeric_option_past_its_bound_is_refused_before_any_work(tmp_path, command, option):
    before, value, needle = CASES[(command, option)]
    if command == "prepare-data":
        pytest.importorskip("tokenizers")
        from tests.faults.test_tokens import write_tokenizer

        (tmp_path / "IN").write_text("the quick brown fox\n")
        write_tokenizer(tmp_path / "TOK")
    args = [str(tmp_path / a) if a.isupper() else a for a in before]
    if command == "demo":
        args = ["--workdir", str(tmp_path / "demo")]
    result = runner.invoke(app, [command, *args, option, value])
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output  # one line, not Typer's usage box
    assert needle in lines[0], result.output
    assert "Traceback" not in result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p for p in ("IN", "TOK") if (tmp_path / p).exists())


@pytest.mark.parametrize("argv, needle", [(["train", "--bogus"], "No such option: --bogus"),
                                          (["nosuch"], "No such command 'nosuch'"),
                                          (["train"], "Missing option '--recipe'")])
def test_other_usage_errors_are_one_line_too(argv, needle):
    result = runner.invoke(app, argv)
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert result.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error: "), result.output
    assert needle in lines[0] and "--help" in lines[0], result.output


def test_help_is_still_help():
    """No arguments and --help print the usage and the commands (exit 2 and 0, as click does), not an error line."""
    for argv, code in (([], 2), (["--help"], 0), (["train", "--help"], 0)):
        result = runner.invoke(app, argv)
        assert result.exit_code == code and "Usage:" in result.output and "error:" not in result.output, result.output
    assert "prepare-data" in runner.invoke(app, []).output


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory):
    from tests.model.tiny_checkpoints import write_hf_checkpoint

    return write_hf_checkpoint(tmp_path_factory.mktemp("eval-ckpt") / "hf", "bf16", 0)


@pytest.mark.parametrize("kind", ["documents", "windows"])
def test_eval_seq_length_is_bounded_by_the_model_and_the_data(tiny_hf, tmp_path, kind):
    """`eval --seq-length` within Typer's range but past what the checkpoint or the data can use (rows that
    are padding, which grew until the process was OOM-killed): one line naming the option, exit 2, before
    the model is built. The largest row the data can use still runs."""
    import numpy as np

    from gptoss_cli.data.token_format import token_file_paths, write_atomically, write_token_header
    from tests.train.sft_files import sft_documents, write_sft_file

    hf = tiny_hf
    if kind == "documents":
        docs, masks = sft_documents([6, 29, 11], 1003, seed=5)
        data = write_sft_file(tmp_path / "val", docs, masks, 1003)
        data_bound = "a row of 4096 holds them all"
    else:
        data = tmp_path / "plain"
        bin_path, json_path = token_file_paths(data)
        write_atomically(bin_path, np.arange(53, dtype=np.uint16))
        write_token_header(json_path, dtype="uint16", num_tokens=53, num_documents=1, vocab_size=1003,
                           eos_token_id=None, tokenizer=None, sources=["test"])
        data_bound = "a window of 53 tokens"
    for value, needle in ((131073, "max_position_embeddings 131072"), (100000, data_bound)):
        result = runner.invoke(app, ["eval", str(hf), "--data", str(data), "--seq-length", str(value)])
        lines = [line for line in result.output.splitlines() if line.strip()]
        assert result.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error: "), result.output
        assert f"--seq-length {value}" in lines[0] and needle in lines[0], result.output
    ok = 4096 if kind == "documents" else 52
    assert runner.invoke(app, ["eval", str(hf), "--data", str(data), "--seq-length", str(ok)]).exit_code == 0
