"""`gptoss eval` over agent traces (tool definitions, calls, results, several exchanges) prepared by
`prepare-data --format harmony`, against transformers scoring each conversation alone.

Reference: transformers' GptOssForCausalLM (eager, fp32) on each conversation by itself, its ids and trained
positions from openai-harmony's rendering (tests/data/test_harmony.py's `expected`, not our file), summed
cross-entropy. The tiny model gets the real vocabulary so harmony's ids fit. Tolerance: as
tests/train/test_eval.py (fp32 logits agree to 1e-5, so the sums to a relative 1e-5).
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import torch.nn.functional as F
from typer.testing import CliRunner

from gptoss_cli.cli import app
from tests.data.conftest import gpt_oss_tokenizer_file, harmony, harmony_cache  # noqa: F401  (fixtures)
from tests.model.tiny_checkpoints import load_hf_reference, tiny_hf_model

h = pytest.importorskip("openai_harmony")
VOCAB = 201088


def _traces():
    from tests.data.test_harmony import SYSTEM as SYS, msg
    from tests.data.test_harmony_tools import call, result

    Role = h.Role
    dev = msg(Role.DEVELOPER, h.DeveloperContent.new().with_function_tools([h.ToolDescription.new(
        "lookup", "Looks a word up.", parameters={"type": "object", "properties": {"word": {"type": "string"}},
                                                  "required": ["word"]})]))
    one = [SYS, dev, msg(Role.USER, "Define 猫"), msg(Role.ASSISTANT, "Look it up.", "analysis"),
           call("functions.lookup", '{"word": "猫"}'), result("functions.lookup", "cat"),
           msg(Role.ASSISTANT, "猫 means cat.", "final")]
    two = [SYS, dev, msg(Role.USER, "Hi"), msg(Role.ASSISTANT, "Hello", "final"), msg(Role.USER, "Define dog twice"),
           call("functions.lookup", '{"word": "dog"}'), result("functions.lookup", "Error: <|end|> busy"),
           call("functions.lookup", '{"word": "dog"}'), result("functions.lookup", "a canine"),
           msg(Role.ASSISTANT, "A canine.", "final")]
    return [one, two]


def test_eval_of_agent_traces_equals_transformers_on_each_conversation_alone(tmp_path, gpt_oss_tokenizer_file,
                                                                             harmony):
    from tests.data.test_harmony import as_json, expected

    traces = _traces()
    (tmp_path / "traces.jsonl").write_text("".join(json.dumps(as_json(t)) + "\n" for t in traces))
    runner = CliRunner()
    result = runner.invoke(app, ["prepare-data", str(tmp_path / "traces.jsonl"), "--format", "harmony", "--tokenizer",
                                 str(gpt_oss_tokenizer_file), "--out", str(tmp_path / "val"), "--quiet"])
    assert result.exit_code == 0, result.output
    folder = tmp_path / "hf"
    tiny_hf_model(seed=3, vocab_size=VOCAB).save_pretrained(folder, safe_serialization=True)
    shutil.copy(gpt_oss_tokenizer_file, folder / "tokenizer.json")
    result = runner.invoke(app, ["eval", str(folder), "--data", str(tmp_path / "val"), "--json",
                                 str(tmp_path / "e.json"), "--quiet"])
    assert result.exit_code == 0, result.output
    got = json.loads((tmp_path / "e.json").read_text())

    model = load_hf_reference(folder)
    sums, counts = [], []
    for trace in traces:
        ids, mask = expected(harmony, trace, "keep", "last")
        doc = torch.tensor(ids)
        with torch.no_grad():
            logits = model(input_ids=doc[None]).logits[0, :-1]
        targets = doc[1:].clone()
        targets[torch.tensor(mask[1:]) == 0] = -100
        sums.append(float(F.cross_entropy(logits.double(), targets, ignore_index=-100, reduction="sum")))
        counts.append(int((targets != -100).sum()))
    for entry, s, c in zip(got["documents"], sums, counts):
        assert entry["loss_tokens"] == c
        assert entry["loss_sum"] == pytest.approx(s, rel=1e-5)
    assert got["loss"] == pytest.approx(sum(sums) / sum(counts), rel=1e-5)
