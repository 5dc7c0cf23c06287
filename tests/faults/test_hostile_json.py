"""JSON that is valid but hostile (a 5,000-digit integer, an array nested 100,000 deep) and run records with
wrong types or ranges: one line naming the file, exit 2, wherever gptoss reads JSON or JSONL."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from gptoss_cli.checkpoint.formats.training.record import run_record
from gptoss_cli.json_input import parse_json
from gptoss_cli.checkpoint.formats.hf.config import to_hf_config
from gptoss_cli.model.config import preset
from tests.faults.conftest import TRAIN_FAST, assert_one_line, digest
from tests.support.cli import exit_and_output as invoke

TINY = preset("tiny")
BIG = "1" * 5000
DEEP = "[" * 100_000 + "]" * 100_000
HOSTILE = {"big": (BIG, "an integer of 5000 digits"), "deep": (DEEP, "nested too deeply")}


@pytest.mark.parametrize("kind", sorted(HOSTILE))
def test_the_reader_turns_hostile_json_into_a_decode_error(kind):
    text, needle = HOSTILE[kind]
    with pytest.raises(json.JSONDecodeError, match=needle):
        parse_json('{"a": ' + text + "}")
    assert parse_json('{"a": [1, -2, 3.5, "x", null], "b": 18446744073709551615}')["b"] == 2**64 - 1


@pytest.mark.parametrize("kind", sorted(HOSTILE))
@pytest.mark.parametrize("file", ["hybrid_config.json", "config.json", "train_state.json",
                                  "model.safetensors.index.json"])
def test_convert_names_a_hostile_json_file(tmp_path, file, kind):
    text, needle = HOSTILE[kind]
    src = tmp_path / "src"
    src.mkdir()
    if file == "model.safetensors.index.json":
        (src / "config.json").write_text(json.dumps(to_hf_config(TINY)))
    (src / file).write_text('{"format": "gptoss-hybrid", "step": 3, "x": ' + text + "}")
    before = digest(src)
    code, out = invoke("convert", src, tmp_path / "dst", "--quiet")
    assert_one_line((code, out), 2, str(src / file), needle)
    assert digest(src) == before and not (tmp_path / "dst").exists()


@pytest.mark.parametrize("kind", sorted(HOSTILE))
def test_a_hostile_safetensors_header_is_one_line(tiny_hf, tmp_path, kind):
    text, needle = HOSTILE[kind]
    src = tmp_path / "src"
    shutil.copytree(tiny_hf, src)
    shard = sorted(src.glob("*.safetensors"))[0]
    header = ('{"x": ' + text + "}").encode()
    shard.write_bytes(len(header).to_bytes(8, "little") + header)
    code, out = invoke("convert", src, tmp_path / "dst", "--quiet")
    assert_one_line((code, out), 2, str(shard), needle)


@pytest.mark.parametrize("kind", sorted(HOSTILE))
def test_validate_config_names_a_hostile_checkpoint_config(tmp_path, kind):
    text, needle = HOSTILE[kind]
    (tmp_path / "config.json").write_text('{"model_type": "gpt_oss", "x": ' + text + "}")
    code, out = invoke("validate-config", "tiny_cpu_ep2", "model.preset=null", f"model.checkpoint={tmp_path}")
    assert_one_line((code, out), 2, str(tmp_path / "config.json"), needle)


@pytest.mark.parametrize("kind", sorted(HOSTILE))
def test_prepare_data_names_the_hostile_jsonl_line(tmp_path, kind):
    pytest.importorskip("tokenizers")
    from tests.faults.test_tokens import write_tokenizer

    text, needle = HOSTILE[kind]
    tok = write_tokenizer(tmp_path / "tok")
    data = tmp_path / "a.jsonl"
    data.write_text('{"text": "the quick fox"}\n{"text": "dog", "n": ' + text + "}\n")
    code, out = invoke("prepare-data", data, "--tokenizer", tok, "--out", tmp_path / "o", "--eos-id", "1", "--quiet")
    assert_one_line((code, out), 2, f"{data}:2", needle)
    assert not list(tmp_path.glob("o*")) and not list(tmp_path.glob(".o*"))


@pytest.mark.parametrize("kind", sorted(HOSTILE))
def test_train_names_a_hostile_token_header(tmp_path, kind):
    text, needle = HOSTILE[kind]
    (tmp_path / "d.bin").write_bytes(b"\0" * 64)
    (tmp_path / "d.json").write_text('{"format": "gptoss-tokens", "dtype": "uint16", "x": ' + text + "}")
    code, out = invoke("train", "--recipe", "tiny_cpu_ep2", "--nproc-per-node", "1",
                       "parallelism.expert_model_parallel_size=1", "data.kind=tokens", f"data.path={tmp_path / 'd'}",
                       f"logging.run_dir={tmp_path / 'run'}", *TRAIN_FAST)
    assert code == 2 and str(tmp_path / "d.json") in out and needle in out, out  # bad input: a malformed file
    assert "Traceback" not in out and not (tmp_path / "run").exists()


# --- the run record of a training checkpoint ----------------------------------------------------
def good_state(step: int = 3) -> dict:
    return {"step": step, "consumed_samples": 4 * step, "world_size": 1, "ep_size": 1, "name": "r",
            "lr_schedule": {"max_lr": 1e-3}, "run": run_record(arch=TINY, hybrid_layer_pattern="*E" * TINY.num_hidden_layers,
                                                                 params_dtype="fp32", name="r", run_dir="/tmp/r")}


def _del(key):
    return lambda s: s.pop(key)


def _set(key, value):
    return lambda s: s.__setitem__(key, value)


def _run(key, value):
    return lambda s: s["run"].__setitem__(key, value)


BAD_STATES = {
    "negative step": (_set("step", -3), "step is -3"),
    "step naming another folder": (_set("step", 4), "step 4 disagrees with the folder name iter_0000003"),
    "huge step": (_set("step", 10**30), "step is 1000000000000000000000000000000"),
    "missing consumed_samples": (_del("consumed_samples"), "consumed_samples is missing"),
    "negative consumed_samples": (_set("consumed_samples", -1), "consumed_samples is -1"),
    "string consumed_samples": (_set("consumed_samples", "12"), "consumed_samples is '12'"),
    "float world size": (_set("world_size", 2.0), "world_size is 2.0"),
    "run a string": (_set("run", "abc"), "run must be a JSON object, got str"),
    "lr_schedule a list": (_set("lr_schedule", [1]), "lr_schedule must be a JSON object, got list"),
    "pretrained a number": (_run("pretrained", 5), "run.pretrained must be a JSON string, got int"),
    "recipe a string": (_run("recipe", "x"), "run.recipe must be a JSON object, got str"),
    "architecture a string": (_run("architecture", "x"), "'architecture' must be a mapping"),
    "params_dtype a number": (_run("params_dtype", 16), "run.params_dtype 16 is not one of fp32 | bf16 | fp16"),
    "missing architecture": (lambda s: s["run"].pop("architecture"), "run record lacks 'architecture'"),
}


def write_checkpoint(ckpt: Path, change) -> Path:
    state = good_state()
    change(state)
    folder = ckpt / "iter_0000003"
    folder.mkdir(parents=True)
    (folder / "train_state.json").write_text(json.dumps(state))
    (ckpt / "latest").write_text("iter_0000003\n")
    return folder / "train_state.json"


@pytest.mark.parametrize("case", sorted(BAD_STATES))
def test_convert_checks_every_field_of_the_run_record(tmp_path, case):
    change, needle = BAD_STATES[case]
    path = write_checkpoint(tmp_path / "ckpt", change)
    before = digest(tmp_path / "ckpt")
    code, out = invoke("convert", tmp_path / "ckpt", tmp_path / "dst", "--quiet")
    assert_one_line((code, out), 2, str(path), needle)
    assert digest(tmp_path / "ckpt") == before and not (tmp_path / "dst").exists()


@pytest.mark.parametrize("case", ["negative step", "missing consumed_samples", "string consumed_samples",
                                  "step naming another folder"])
def test_resume_checks_the_train_state_before_training_a_step(tmp_path, case):
    change, needle = BAD_STATES[case]
    path = write_checkpoint(tmp_path / "ckpt", change)
    code, out = invoke("train", "--recipe", "tiny_cpu_ep2", "--nproc-per-node", "1", "-q",
                       "parallelism.expert_model_parallel_size=1", f"checkpoint.dir={tmp_path / 'ckpt'}",
                       f"logging.run_dir={tmp_path / 'run'}", *TRAIN_FAST, "training.train_iters=5")
    assert_one_line((code, out), 2, str(path), needle)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # not one step trained
    assert (tmp_path / "ckpt" / "latest").read_text() == "iter_0000003\n"


# --- the readers added with SFT data, generate, report and Megatron checkpoints --------------------
@pytest.mark.parametrize("kind", sorted(HOSTILE))
def test_report_names_a_hostile_metrics_line(tmp_path, kind):
    text, needle = HOSTILE[kind]
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1, "rank": 0, "loss": ' + text + "}\n"
                                       '{"step": 2, "rank": 0, "loss": 1.0}\n')
    code, out = invoke("report", run, "--no-plots")
    assert code == 2 and "metrics.jsonl:1" in out and "Traceback" not in out, out


@pytest.mark.parametrize("kind", sorted(HOSTILE))
def test_generate_names_a_hostile_messages_file(tmp_path, kind):
    text, needle = HOSTILE[kind]
    messages = tmp_path / "messages.json"
    messages.write_text('{"messages": ' + text + "}")
    tokenizer = tmp_path / "tokenizer.json"
    tokenizer.write_text("{}")
    code, out = invoke("generate", tmp_path / "missing-checkpoint", "--messages", messages, "--tokenizer", tokenizer)
    assert code == 2 and "Traceback" not in out, out
    assert len(out.strip().splitlines()) <= 2, out


@pytest.mark.parametrize("kind", sorted(HOSTILE))
def test_prepare_data_names_a_hostile_conversation_line(tmp_path, kind):
    pytest.importorskip("tokenizers")
    from tests.faults.test_tokens import write_tokenizer

    text, needle = HOSTILE[kind]
    data = tmp_path / "chats.jsonl"
    data.write_text('{"messages": ' + text + "}\n")
    write_tokenizer(tmp_path / "tok")
    code, out = invoke("prepare-data", data, "--format", "harmony", "--tokenizer", tmp_path / "tok",
                       "--out", tmp_path / "out")
    assert code == 2 and "Traceback" not in out, out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["chats.jsonl", "tok"]


# --- text Python cannot encode: a lone surrogate escape in JSON, a non-UTF-8 byte in argv -------------
def test_the_reader_refuses_a_lone_surrogate_and_keeps_pairs():
    assert parse_json('{"a": "\\ud83d\\ude00", "b": "\\\\ud800"}') == {"a": "\U0001F600", "b": "\\ud800"}
    for doc in ('{"a": "x\\ud800"}', '[{"\\uDFFF": 1}]', '{"a": "\\ude00\\ud83d"}'):  # the last: a pair reversed
        with pytest.raises(json.JSONDecodeError, match="lone surrogate"):
            parse_json(doc)


@pytest.mark.parametrize("form", ["text", "harmony"])
def test_prepare_data_names_the_line_with_a_lone_surrogate(tmp_path, form):
    pytest.importorskip("tokenizers")
    if form == "harmony":  # the real GPT-OSS tokenizer: harmony rendering needs its special tokens
        pytest.importorskip("openai_harmony")
        pytest.importorskip("bpe_openai")
        from tests.data.harmony_tokenizer import cache_folder, gpt_oss_tokenizer_json

        tok, line, extra = gpt_oss_tokenizer_json(cache_folder()), 1, []
        row = '{"messages": [{"role": "user", "content": "hi \\ud800"}, {"role": "assistant", "content": "ok"}]}'
    else:
        from tests.faults.test_tokens import write_tokenizer

        tok, line, extra = write_tokenizer(tmp_path / "tok"), 2, ["--eos-id", "1"]
        row = '{"text": "the quick fox"}\n{"text": "dog \\ud800"}'
    data = tmp_path / "in.jsonl"
    data.write_text(row + "\n")
    code, out = invoke("prepare-data", data, "--format", form, "--tokenizer", tok, "--out", tmp_path / "o", *extra)
    assert_one_line((code, out), 2, f"{data}:{line}", "lone surrogate \\ud800")
    assert not list(tmp_path.glob("o*")) and not list(tmp_path.glob(".o*"))


@pytest.mark.parametrize("args", [["--raw", "--prompt", "w1 \udcff"], ["-p", "w1", "--system", "\udcff"]])
def test_generate_names_an_argument_that_is_not_utf8(tmp_path, args):
    """Python hands a non-UTF-8 byte of argv over as a lone surrogate (surrogateescape): \\xff is \\udcff."""
    code, out = invoke("generate", tmp_path / "missing-checkpoint", *args)
    assert_one_line((code, out), 2, f"{args[-2]}: character", "not valid UTF-8")
