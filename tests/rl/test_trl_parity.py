"""GRPO's loss and gradients against TRL's GRPOTrainer on transformers' GptOssForCausalLM, same weights, fp32.

Fixed prompts, completions, advantages and old / reference / engine log-probabilities go to both
sides: TRL's `compute_loss` on transformers' model, and gptoss's GRPO objective through the real
training path (the schedule over two microbatches, the gradient buffers' finalisation that divides by
the step's normaliser). The old log-probabilities are the current ones moved by +-0.35, so the
ratio leaves [1 - 0.2, 1 + 0.28] on both sides and clipping is active (checked). Every loss type
(grpo, dapo, dr_grpo), with and without the KL term, and every importance-sampling correction
(rl.is_correction) are compared; TRL's ratio for the latter is computed by TRL's own code
(`trl_importance_ratio`: the vLLM-correction block of GRPOTrainer._generate_and_score_completions, run
on the test's log-probabilities), with engine log-probabilities that put tokens on both sides of the
bounds and one completion (the 2-token one) wholly outside them, so that masks drop tokens and a
whole sequence (checked).

Error model (tests/tolerances.py): the same arithmetic in another order; the logits are dot products
over the hidden size and the log-softmax a sum over the vocabulary, compounded through the 2L + 2
layers of the backward pass.
"""

from __future__ import annotations

import inspect
import json
import math
import textwrap
from types import SimpleNamespace

import pytest
import torch

from gptoss_cli.model.config import preset
from gptoss_cli.parallel.state import init_parallel
from gptoss_cli.rl.batch import SampledCompletion, completion_rows
from gptoss_cli.rl.importance import MASKING, TRL_MODES, ImportanceCorrection
from gptoss_cli.rl.objective import GRPOObjective
from gptoss_cli.schedule import get_forward_backward_func
from gptoss_cli.train.provider import HybridModelProvider
from gptoss_cli.train.setup import setup_model_and_optimizer
from tests.tolerances import assert_tensors_close, reassociation_rel

pytest.importorskip("trl")

TINY = preset("tiny")
SEED = 9  # tests/train/reference.py: its routing margin is the largest of seeds 0-39
P, T, B = 5, 6, 4  # prompt tokens, completion tokens (max), completions (2 prompts x group 2)
LENGTHS = (6, 4, 6, 2)
ADVANTAGES = (1.0, -1.0, 0.5, -0.5)
TEMPERATURE = 0.7
CLIP_LOW, CLIP_HIGH = 0.2, 0.28
IS_CAP = 1.5  # the TIS cases' upper bound
IS_MIN, IS_MAX = 0.5, 2.0  # the correction cases' bounds


@pytest.fixture(scope="module")
def hf_and_trl(tmp_path_factory):
    from datasets import Dataset
    from transformers import PreTrainedTokenizerFast
    from trl import GRPOConfig, GRPOTrainer

    from gptoss_cli.data.tiny_tokenizer import tiny_tokenizer
    from tests.model.tiny_checkpoints import tiny_hf_model

    root = tmp_path_factory.mktemp("trl")
    (root / "tokenizer.json").write_text(json.dumps(tiny_tokenizer(TINY.vocab_size)))
    tok = PreTrainedTokenizerFast(tokenizer_file=str(root / "tokenizer.json"), pad_token="<|endoftext|>",
                                  eos_token="<|return|>")
    model = tiny_hf_model(SEED).float().train()
    # beta 0 here (TRL would load a reference model from a path); each case sets trainer.beta itself
    args = GRPOConfig(output_dir=str(root / "out"), beta=0.0, temperature=TEMPERATURE, max_completion_length=T,
                      num_generations=2, per_device_train_batch_size=B, report_to=[], use_cpu=True, bf16=False)
    trainer = GRPOTrainer(model=model, reward_funcs=lambda completions, **kw: [0.0] * len(completions), args=args,
                          train_dataset=Dataset.from_dict({"prompt": ["a", "b"]}), processing_class=tok)
    trainer.current_gradient_accumulation_steps = 1
    trainer.epsilon_low, trainer.epsilon_high = CLIP_LOW, CLIP_HIGH
    # TRL adds an MoE model's router aux loss at config.router_aux_loss_coef (0.9 here); the GRPO loss is
    # compared alone (gptoss's aux loss against transformers': tests/model/test_hybrid_vs_transformers.py)
    trainer.aux_loss_enabled = False
    return model, trainer


@pytest.fixture(scope="module")
def ours(hf_and_trl):
    from tests.model.conftest import hf_to_hybrid_state_dict
    from tests.train.jobs import optimizer_config, runtime_config

    state = init_parallel(1, "cpu")
    setup = setup_model_and_optimizer(HybridModelProvider(runtime_config(), seed=SEED), state,
                                      optimizer_config(), 1e-3)
    with torch.no_grad():
        setup.model.module.load_state_dict(hf_to_hybrid_state_dict(hf_and_trl[0].state_dict()), strict=True)
    return setup


def _inputs(hf):
    g = torch.Generator().manual_seed(5)
    prompts = torch.randint(0, TINY.vocab_size, (2, P), generator=g)
    completion = torch.randint(0, TINY.vocab_size, (B, T), generator=g)
    mask = torch.tensor([[1] * n + [0] * (T - n) for n in LENGTHS])
    completion = completion * mask
    prompt_ids = prompts.repeat_interleave(2, dim=0)
    with torch.no_grad():  # the current policy's log-probs at the temperature, for old / ref / engine
        logits = hf(input_ids=torch.cat([prompt_ids, completion], 1)).logits[:, P - 1:-1] / TEMPERATURE
        current = torch.log_softmax(logits.float(), -1).gather(-1, completion[..., None])[..., 0]
    sign = torch.tensor([1.0, -1.0, 1.0])[torch.arange(B * T) % 3].reshape(B, T)
    old = current + 0.35 * sign  # ratios exp(-+0.35): outside [0.8, 1.28] on both sides
    ref = current + 0.1 * torch.randn(B, T, generator=g)
    engine = old + 0.6 * torch.randn(B, T, generator=g)  # a planted engine mismatch, for TIS
    engine[3] = old[3] - 2.0  # the 2-token completion: rho = e^2 = 7.4, outside every bound on every token
    return prompt_ids, completion, mask, old * mask, ref * mask, engine * mask


def trl_importance_ratio(mode: str, old, sampling, mask, clip_min, clip_max):
    """TRL's importance-sampling ratio for the vLLM correction `mode` (token_truncate, ...), computed by the block
    of GRPOTrainer._generate_and_score_completions that computes it, run on these log-probabilities."""
    from trl import GRPOTrainer

    source = inspect.getsource(GRPOTrainer._generate_and_score_completions)
    diff = source.index("per_token_logps_diff = (old_per_token_logps - sampling_per_token_logps) * mask")
    start = source.rindex("mask = completion_mask if tool_mask is None else completion_mask * tool_mask", 0, diff)
    end = source.index("# Compute the per-token log probabilities for the reference model", start)
    block = textwrap.dedent(source[source.rindex("\n", 0, start) + 1:end])
    me = SimpleNamespace(vllm_importance_sampling_mode=mode, vllm_importance_sampling_clip_min=clip_min,
                         vllm_importance_sampling_clip_max=clip_max)
    scope = dict(self=me, torch=torch, math=math, completion_mask=mask, tool_mask=None,
                 old_per_token_logps=old, sampling_per_token_logps=sampling)
    exec(compile(block, "trl-grpo-importance-sampling", "exec"), scope)  # noqa: S102 (TRL's own code)
    return scope["vllm_importance_sampling_ratio"]


def _trl_ratio(data, correction: ImportanceCorrection | None):
    """TRL's ratio for `correction` (TIS at IS_CAP when None); a geometric-mean sequence ratio is TRL's sequence
    ratio (the product) of the per-token log-differences divided by the completion's length."""
    _, _, mask, old, _, engine = data
    if correction is None:
        return trl_importance_ratio("token_truncate", old, engine, mask, None, IS_CAP)
    c = correction
    sampling = engine
    if c.mode.startswith("seq_") and c.sequence_ratio == "geometric":
        sampling = old - (old - engine) / mask.sum(-1, keepdim=True).clamp(min=1)
    return trl_importance_ratio(TRL_MODES[c.mode], old, sampling, mask, None if c.mode == "mis" else c.is_min,
                                c.is_max)


def _trl(trainer, model, data, loss_type: str, beta: float, tis: bool, unbiased: bool = True,
         correction: ImportanceCorrection | None = None):
    prompt_ids, completion, mask, old, ref, engine = data
    trainer.loss_type, trainer.beta = loss_type, beta
    trainer.args.use_bias_correction_kl = unbiased
    trainer.use_vllm = trainer.vllm_importance_sampling_correction = tis
    inputs = dict(prompt_ids=prompt_ids, prompt_mask=torch.ones_like(prompt_ids), completion_ids=completion,
                  completion_mask=mask, advantages=torch.tensor(ADVANTAGES), old_per_token_logps=old,
                  ref_per_token_logps=ref, num_items_in_batch=mask.sum().float())
    if tis:
        inputs["importance_sampling_ratio"] = _trl_ratio(data, correction)
    model.zero_grad(set_to_none=True)
    loss = trainer.compute_loss(model, inputs)
    loss.backward()
    return float(loss.detach()), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _ours(setup, data, loss_type: str, beta: float, tis: bool, unbiased: bool = True,
          correction: ImportanceCorrection | None = None):
    from gptoss_cli.parallel.grads import get_model_config
    from tests.train.dist_helpers import named_grads

    prompt_ids, completion, mask, old, ref, engine = data
    comps = [SampledCompletion(0, prompt_ids[i].tolist(), completion[i, :n].tolist(), engine[i, :n].tolist())
             for i, n in enumerate(LENGTHS)]
    mbs = []
    for rows in (slice(0, 2), slice(2, 4)):
        mb = completion_rows(comps[rows], ADVANTAGES[rows], P + T, torch.device("cpu"))
        for key, value in (("old_logp", old), ("ref_logp", ref)):
            at = torch.zeros_like(mb.extras["rollout_logp"])
            at[:, P - 1:P - 1 + T] = value[rows]
            mb.extras[key] = at
        mbs.append(mb)
    objective = GRPOObjective(loss_type=loss_type, clip_low=CLIP_LOW, clip_high=CLIP_HIGH, kl_coeff=beta,
                              temperature=TEMPERATURE, max_new_tokens=T, kl_unbiased=unbiased,
                              correction=(correction or ImportanceCorrection("tis", None, IS_CAP)) if tis else
                              ImportanceCorrection("none"))
    setup.model.zero_grad_buffer()
    schedule = get_forward_backward_func(get_model_config(setup.model))
    logs = schedule(forward_step_func=objective.forward_step, data_iterator=iter(mbs), model=setup.model,
                    num_microbatches=2)
    sums = {k: float(sum(float(log[k]) for log in logs if k in log)) for k in objective.sums}
    return objective.metrics(sums), named_grads(setup.model)


# (loss type, KL coefficient, TIS, the KL term's ratio); beta 0.5 so that the KL term's gradient is not
# lost in the tolerance of the policy term's
CASES = [("grpo", 0.0, False, True), ("grpo", 0.5, False, True), ("grpo", 0.5, False, False),
         ("dapo", 0.0, False, True), ("dapo", 0.5, False, True), ("dr_grpo", 0.0, False, True),
         ("dr_grpo", 0.5, False, True), ("grpo", 0.5, True, True)]


@pytest.mark.parametrize("loss_type,beta,tis,unbiased", CASES,
                         ids=[f"{c[0]}-kl{c[1]}{'-tis' if c[2] else ''}{'' if c[3] else '-k3'}" for c in CASES])
def test_loss_and_gradients_equal_trl_grpo_trainer(hf_and_trl, ours, loss_type, beta, tis, unbiased):
    from tests.train.reference import HfView

    model, trainer = hf_and_trl
    data = _inputs(model)
    want_loss, want = _trl(trainer, model, data, loss_type, beta, tis, unbiased)
    metrics, grads = _ours(ours, data, loss_type, beta, tis, unbiased)
    assert metrics["clip_fraction"] > 0.1  # the clipped branch is taken on both sides
    rel = reassociation_rel(n_terms=TINY.vocab_size + TINY.hidden_size, depth=2 * TINY.num_hidden_layers + 2)
    assert metrics["loss"] == pytest.approx(want_loss, rel=rel, abs=rel * 1e-3)
    if beta:
        assert metrics["kl_ref"] > 0
    assert_tensors_close(HfView(model).to_hf(grads), want, rel, context=f"{loss_type} beta={beta} tis={tis} unbiased={unbiased}")


# Each rl.is_correction against TRL's mode of the same name on the same inputs (grpo's per-completion mean, where a
# wholly masked completion still counts; dapo once, where it does not change the token count either)
CORRECTIONS = [("grpo", ImportanceCorrection("tis", IS_MIN, IS_MAX)), ("grpo", ImportanceCorrection("mis", None, IS_MAX)),
               ("grpo", ImportanceCorrection("icepop", IS_MIN, IS_MAX)),
               ("dapo", ImportanceCorrection("icepop", IS_MIN, IS_MAX)),
               ("grpo", ImportanceCorrection("seq_tis", IS_MIN, IS_MAX, "geometric")),
               ("grpo", ImportanceCorrection("seq_tis", IS_MIN, IS_MAX, "product")),
               ("grpo", ImportanceCorrection("seq_mis", IS_MIN, IS_MAX, "geometric")),
               ("grpo", ImportanceCorrection("seq_mis", IS_MIN, IS_MAX, "product"))]


@pytest.mark.parametrize("loss_type,correction", CORRECTIONS,
                         ids=[f"{c.mode}-{c.sequence_ratio if c.mode.startswith('seq') else 'token'}-{t}"
                              for t, c in CORRECTIONS])
def test_each_importance_sampling_correction_equals_trls_mode(hf_and_trl, ours, loss_type, correction):
    from tests.train.reference import HfView

    model, trainer = hf_and_trl
    data = _inputs(model)
    mask = data[2].bool()
    ratio = _trl_ratio(data, correction).expand_as(data[2])
    want_loss, want = _trl(trainer, model, data, loss_type, 0.0, True, correction=correction)
    metrics, grads = _ours(ours, data, loss_type, 0.0, True, correction=correction)
    rel = reassociation_rel(n_terms=TINY.vocab_size + TINY.hidden_size, depth=2 * TINY.num_hidden_layers + 2)
    assert metrics["loss"] == pytest.approx(want_loss, rel=rel, abs=rel * 1e-3)
    assert_tensors_close(HfView(model).to_hf(grads), want, rel, context=f"{correction}")
    assert metrics["is_weight"] == pytest.approx(float(ratio[mask].mean()), rel=1e-6)
    if correction.mode in MASKING:  # TRL's zeros are the masked tokens; some, not all, and one whole completion
        zero = (ratio == 0) & mask
        assert metrics["is_masked_fraction"] == pytest.approx(float(zero.sum() / mask.sum()))
        assert 0 < metrics["is_masked_fraction"] < 1
        wholly = sum(bool(zero[i].sum() == mask[i].sum()) for i in range(B))
        assert metrics["is_masked_sequences"] == pytest.approx(wholly / B) and wholly >= 1
    else:  # truncated: the weights TRL clipped
        clipped = ((ratio == IS_MAX) | (ratio == IS_MIN)) & mask
        assert metrics["is_capped_fraction"] == pytest.approx(float(clipped.sum() / mask.sum()))
        assert metrics["is_capped_fraction"] > 0
