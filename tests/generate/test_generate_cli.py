"""`gptoss generate` end to end on tiny checkpoints: the reply's ids equal transformers' `generate`
for HF and converted Hybrid folders, a JSONL batch equals each prompt alone, bad input is one line."""

from __future__ import annotations

import json
import shutil
from functools import partial

import pytest
import torch
from typer.testing import CliRunner

from gptoss_cli.cli import app
from tests.faults.conftest import assert_one_line
from tests.model.conftest import transformers
from tests.model.tiny_checkpoints import load_hf_reference, write_converted_pair
from tests.support.cli import run_cli

SPECIALS = ["<|endoftext|>", "<|return|>", "<|call|>"]


def write_word_tokenizer(folder, vocab_size: int = 1003):
    """A word-level tokenizer.json: word `w{i}` is id i, then the stop tokens as the last ids, so every
    id the tiny model can emit decodes to text."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = vocab_size - len(SPECIALS)
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(words)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(SPECIALS)
    tok.save(str(folder / "tokenizer.json"))
    return tok


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(HF folder, Hybrid folder converted from it), both with the tokenizer."""
    root = tmp_path_factory.mktemp("gen")
    hf = root / "hf-bf16"
    hf.mkdir()
    write_word_tokenizer(hf)  # before converting, so convert copies it as users' checkpoints have it
    hf, hybrid = write_converted_pair(root)
    assert (hybrid / "tokenizer.json").is_file()
    return hf, hybrid


@pytest.fixture(scope="module")
def reference(pair):
    return load_hf_reference(pair[0])


def hf_greedy(model, prompt_ids: list[int], new: int, stops: set[int]) -> list[int]:
    """transformers' greedy generate, cut after the first stop token (as ours stops there)."""
    cfg = transformers.GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0)
    out = model.generate(torch.tensor([prompt_ids]), generation_config=cfg)[0, len(prompt_ids):].tolist()
    for i, t in enumerate(out):
        if t in stops:
            return out[:i + 1]
    return out


run = partial(run_cli, "generate")


@pytest.mark.parametrize("kind", ["hf", "hybrid"])
def test_reply_ids_equal_transformers_generate(pair, reference, kind, tmp_path):
    folder = pair[0] if kind == "hf" else pair[1]
    out = tmp_path / "gen.json"
    result = run(folder, "--raw", "--prompt", "w5 w17 w999 w3", "-n", 20, "--json", out, "--device", "cpu")
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    (reply,) = data["replies"]
    assert reply["prompt_ids"] == [5, 17, 999, 3]
    stops = set(data["stop_token_ids"])
    assert stops == {1000, 1001, 1002}
    assert reply["output_ids"] == hf_greedy(reference, reply["prompt_ids"], 20, stops)
    assert data["kind"] == kind
    # streamed to stdout as it came: the decoded reply, then a newline
    body = [t for t in reply["output_ids"] if t not in stops]
    assert reply["text"] == " ".join(f"w{t}" for t in body)
    assert result.stdout == reply["text"] + "\n"
    assert reply["stop_reason"] in ("stop_token", "max_new_tokens") and reply["tokens_per_s"] > 0


def test_a_jsonl_batch_equals_each_prompt_generated_alone(pair, reference, tmp_path):
    prompts = ["w1 w2 w3 w4 w5 w6 w7 w8 w9 w10 w11", "w400", "w9 w8 w7"]
    file = tmp_path / "p.jsonl"
    file.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts) + "\n")
    out = tmp_path / "gen.json"
    result = run(pair[1], "--raw", "--prompts", file, "-n", 12, "--json", out, "--device", "cpu")
    assert result.exit_code == 0, result.output
    replies = json.loads(out.read_text())["replies"]
    assert [r["prompt"] for r in replies] == prompts
    for r in replies:
        assert r["output_ids"] == hf_greedy(reference, r["prompt_ids"], 12, {1000, 1001, 1002})
    assert "3 prompts in one batch" in result.stdout


def test_sampling_is_reproducible_from_its_seed(pair, tmp_path):
    def sample(seed):
        out = tmp_path / f"s{seed}.json"
        result = run(pair[1], "--raw", "-p", "w1 w2", "-n", 16, "--temperature", 1.5, "--top-p", 0.95,
                     "--seed", seed, "--json", out, "--device", "cpu")
        assert result.exit_code == 0, result.output
        return json.loads(out.read_text())["replies"][0]["output_ids"]

    assert sample(1) == sample(1)
    assert sample(1) != sample(2)


@pytest.fixture(scope="module")
def no_tokenizer(pair, tmp_path_factory):
    folder = tmp_path_factory.mktemp("notok") / "hybrid"
    shutil.copytree(pair[1], folder)
    (folder / "tokenizer.json").unlink()
    return folder


@pytest.mark.parametrize("args, needles", [
    (["--raw", "-p", "w1"], ["no tokenizer.json in", "--tokenizer"]),
    (["--raw", "-p", "w1", "--tokenizer", "/nonexistent/tok.json"], ["--tokenizer /nonexistent/tok.json", "not found"]),
    (["--raw", "-p", ""], ["--prompt is empty"]),
    (["--raw", "-p", "w1", "-n", "0"], ["--max-new-tokens 0 must be in"]),
    (["--raw"], ["exactly one of --prompt"]),
    (["--raw", "-p", "w1", "--top-p", "0"], ["--top-p 0.0"]),
    (["--raw", "-p", "w1", "--temperature", "nan"], ["--temperature nan"]),
    (["--raw", "-p", "w1", "--dtype", "float8"], ["--dtype 'float8'"]),
    (["--raw", "-p", "w1", "--device", "foo"], ["--device 'foo' is not a torch device"]),
    (["--raw", "-p", "w1", "--device", "foo", "--dtype", "float32"], ["--device 'foo' is not a torch device"]),
])
def test_bad_input_is_one_line_exit_2(pair, no_tokenizer, args, needles):
    folder = no_tokenizer if "no tokenizer.json in" in needles else pair[1]
    result = run(folder, *args, *([] if "--device" in args else ["--device", "cpu"]))
    assert_one_line((result.exit_code, result.stderr), 2, *needles)


@pytest.mark.parametrize("content, needle", [
    ("not json\n", ":1: not a JSON object"),
    ('{"text": "w1"}\n', ":1: neither a string field 'prompt' nor a conversation"),
    ('{"prompt": "w1"}\n{"prompt": ""}\n', ":2: the prompt is empty"),
    ("\n\n", "holds no prompts"),
    ('{"prompt": "w1"}\n{"messages": [{"role": "user", "content": "w1"}]}\n', ":2: --raw takes"),
])
def test_a_bad_prompts_file_is_one_line_exit_2(pair, tmp_path, content, needle):
    file = tmp_path / "p.jsonl"
    file.write_text(content)
    result = run(pair[1], "--raw", "--prompts", file, "--device", "cpu")
    assert_one_line((result.exit_code, result.stderr), 2, str(file) if "holds" not in needle else needle, needle)


def test_a_model_too_big_for_the_device_says_what_fits_where(monkeypatch, pair):
    import gptoss_cli.generate.session as session

    monkeypatch.setattr(session, "device_memory", lambda device: (1000, f"{device} has 1.0 KB free"))
    result = run(pair[1], "--raw", "-p", "w1", "--device", "cpu")
    assert_one_line((result.exit_code, result.stderr), 2, "parameters take", "cpu has 1.0 KB free",
                    "expert-parallel generation")


def test_a_training_checkpoint_generates_what_its_hf_export_generates_in_transformers(tmp_path_factory, tmp_path):
    """A `gptoss train` checkpoint.dir (EP=2 run, read through `latest`): no tokenizer.json of its own, so
    --tokenizer; the reply equals transformers' greedy generate on `gptoss convert`'s HF export."""
    from gptoss_cli.checkpoint.convert import convert
    from tests.train.dist_helpers import once_per_session
    from tests.train.workers import ep2_checkpoint_run

    work, _ = once_per_session(tmp_path_factory, "ep2_checkpoint", ep2_checkpoint_run)
    ckpt = work / "ckpt"
    no_tok = run(ckpt, "--raw", "-p", "w1", "--device", "cpu")
    assert_one_line((no_tok.exit_code, no_tok.stderr), 2, "no tokenizer.json in", "--tokenizer")
    write_word_tokenizer(tmp_path)
    out = tmp_path / "gen.json"
    result = run(ckpt, "--raw", "-p", "w7 w8 w9", "-n", 10, "--tokenizer", tmp_path, "--json", out, "--device", "cpu")
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert data["kind"] == "training"
    export = tmp_path / "hf"
    convert(str(ckpt), export, to="hf", dtype="float32")
    (reply,) = data["replies"]
    assert reply["output_ids"] == hf_greedy(load_hf_reference(export), reply["prompt_ids"], 10, {1000, 1001, 1002})


def test_a_reply_that_is_not_harmony_is_shown_as_raw_text(tmp_path):
    """An untrained model's reply does not parse as harmony: generate says so and shows the decoded
    text (the tokenizer's own decoding of the new ids), not an empty answer."""
    from tokenizers import Tokenizer

    from gptoss_cli.checkpoint.make_tiny import make_tiny

    make_tiny(tmp_path / "hf")  # random weights, and make-tiny's tokenizer.json
    result = CliRunner().invoke(app, ["generate", str(tmp_path / "hf"), "-p", "Hi", "-n", "8",
                                      "--json", str(tmp_path / "r.json")])
    assert result.exit_code == 0, result.output
    (reply,) = json.loads((tmp_path / "r.json").read_text())["replies"]
    raw = Tokenizer.from_file(str(tmp_path / "hf" / "tokenizer.json")).decode(reply["output_ids"],
                                                                              skip_special_tokens=False)
    assert reply["harmony"] is False and reply["text"] == "" and reply["raw_text"] == raw and raw
    assert "did not parse as harmony" in result.output and raw in result.output
