"""serve-check without vLLM: exit codes and one-line errors through the CLI, the worker's protocol when
its interpreter has no vLLM, and the comparison of one prompt on hand-made logprobs."""

from __future__ import annotations

import sys
from functools import partial

import numpy as np
import pytest
import torch

from gptoss_cli.checkpoint.make_tiny import make_tiny
from gptoss_cli.generate.engines.base import PromptScores
from gptoss_cli.parity.serve.reference import Reference
from gptoss_cli.parity.serve.report import ServeReport, compare_prompt
from tests.support.cli import run_cli


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("serve-cli") / "tiny"
    make_tiny(folder, experts="bf16", dtype="float32", head_dim=64)  # a head size vLLM's CPU build serves
    return folder


run = partial(run_cli, "serve-check")


def one_line_error(result, code: int, needle: str) -> None:
    assert result.exit_code == code, result.output
    assert "Traceback" not in result.output
    lines = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and needle in lines[0], result.output


def test_a_missing_engine_interpreter_is_exit_2_in_one_line(tiny, monkeypatch):
    monkeypatch.delenv("GPTOSS_ENGINE_PYTHON", raising=False)
    one_line_error(run(tiny, "--engine-python", "/nonexistent/python"), 2, "not an executable Python interpreter")


def test_an_interpreter_without_vllm_is_exit_2_with_the_engines_own_message(tiny, tmp_path, monkeypatch):
    """The worker runs, fails to import vLLM and answers that on the protocol: the message is Python's own
    (and the engine's log, kept for the user, lands in this test's folder)."""
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    one_line_error(run(tiny, "--engine-python", sys.executable, "--greedy-tokens", "0"), 2,
                   "No module named 'vllm'")


@pytest.mark.parametrize("args, needle", [
    (["--dtype", "float16"], "--dtype 'float16'"),
    (["--lora", "sometimes"], "--lora 'sometimes'"),
    (["--engine", "tgi"], "--engine 'tgi'"),
    (["--export", "/nonexistent"], "--export /nonexistent: no such folder"),
])
def test_bad_options_are_exit_2_in_one_line(tiny, args, needle):
    one_line_error(run(tiny, *args), 2, needle)


def test_a_prompts_file_with_ids_outside_the_vocabulary_is_exit_2(tiny, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt_ids": [1, 2, 5000]}\n')
    one_line_error(run(tiny, "--prompts", prompts, "--engine-python", "/nonexistent/python"), 2,
                   "token id 5000 is outside the model's vocabulary of 1003")


def _reference(n: int = 6, vocab: int = 5, flip: float = 0.0) -> Reference:
    gen = torch.Generator().manual_seed(0)
    logprobs = torch.log_softmax(torch.randn(n - 1, vocab, generator=gen, dtype=torch.float64), dim=-1)
    return Reference("p", n - 2, list(range(n)), [n - 2, n - 1], logprobs, torch.full((n - 1,), 1e-3),
                     torch.full((n,), 1e-4), torch.zeros(n, dtype=torch.bool), {}, torch.full((n - 1,), flip))


def test_the_first_position_over_its_budget_is_named_and_a_near_tie_flip_is_not_a_failure():
    ref = _reference()
    engine = ref.logprobs.clone().numpy()
    assert compare_prompt(ref, PromptScores(ref.ids, engine), ref.greedy).verdict == "pass"
    engine[2, 3] += 0.01  # token 3's distribution, 10x its budget
    result = compare_prompt(ref, PromptScores(ref.ids, engine), ref.greedy)
    assert result.verdict == "fail" and result.first_divergent_position == 3
    assert result.max_abs_logprob_diff == pytest.approx(0.01)
    # what a router flip on the other side could move there widens the budget
    assert compare_prompt(_reference(flip=0.02), PromptScores(ref.ids, engine), ref.greedy).verdict == "pass"


def test_top_k_scores_compare_only_the_returned_entries():
    ref = _reference()
    top = ref.logprobs.topk(2, dim=-1)
    ids = np.concatenate([top.indices.numpy(), -np.ones((top.indices.shape[0], 1), dtype=np.int64)], axis=1)
    lps = np.concatenate([top.values.numpy(), np.full((ids.shape[0], 1), -np.inf)], axis=1)
    result = compare_prompt(ref, PromptScores(ref.ids, lps, ids), ref.greedy)
    assert result.verdict == "pass" and result.max_abs_logprob_diff == 0.0


def test_a_failing_report_is_exit_1_naming_the_prompt_and_token(tiny, monkeypatch):
    from gptoss_cli.parity.serve import check as serve

    ref = _reference()
    engine = ref.logprobs.clone().numpy()
    engine[1:, 0] += 1.0
    prompt = compare_prompt(ref, PromptScores(ref.ids, engine), ref.greedy)
    report = ServeReport(str(tiny), "hf", "float32", {"model": str(tiny), "form": "hf folder", "top_k": None},
                         {"name": "vllm", "version": "0", "device": "cpu", "kernels": {}}, "model", [prompt], [], {})
    monkeypatch.setattr(serve, "serve_check", lambda *a, **k: report)
    result = run(tiny, "--json", tiny.parent / "r.json")
    one_line_error(result, 1, "p: the engine's logprobs leave the float32 budget at token 2 of 6")
    assert (tiny.parent / "r.json").is_file()


def test_mean_kl_is_kl_of_gptoss_from_the_engine_and_never_negative():
    ref = _reference(n=6, vocab=5)
    engine = torch.log_softmax(torch.randn(5, 5, generator=torch.Generator().manual_seed(1), dtype=torch.float64), -1)
    result = compare_prompt(ref, PromptScores(ref.ids, engine.numpy()), ref.greedy)
    p, q = ref.logprobs.exp(), engine.exp()
    forward = float((p * (p / q).log()).sum(-1).mean())  # KL(gptoss || engine): the direction serve-check reports
    backward = float((q * (q / p).log()).sum(-1).mean())
    assert result.mean_kl == pytest.approx(forward, rel=1e-12) and abs(forward - backward) > 0.05
    # the engine's distribution off by rounding only (each row sums to 1 + 5e-9): KL is 0 to rounding, not below
    rounded = (ref.logprobs + 1e-9).numpy()
    assert 0.0 <= compare_prompt(ref, PromptScores(ref.ids, rounded), ref.greedy).mean_kl < 1e-16
