"""GRPO's loss and gradients against TRL's GRPOTrainer on transformers' GptOssForCausalLM, same weights, fp32.

Fixed prompts, completions, advantages and old / reference / engine log-probabilities go to both
sides: TRL's `compute_loss` on transformers' model, and gptoss's GRPO objective through the real
training path (the schedule over two microbatches, the gradient buffers' finalisation that divides by
the step's normaliser). The old log-probabilities are the current ones moved by +-0.35, so the
ratio leaves [1 - 0.2, 1 + 0.28] on both sides and clipping is active (checked). Every loss type
(grpo, dapo, dr_grpo), with and without the KL term, and truncated importance sampling (TRL's vLLM
correction, given the ratio its own formula makes) are compared.

Error model (tests/tolerances.py): the same arithmetic in another order; the logits are dot products
over the hidden size and the log-softmax a sum over the vocabulary, compounded through the 2L + 2
layers of the backward pass.
"""

from __future__ import annotations

import json

import pytest
import torch

from gptoss_cli.model.config import preset
from gptoss_cli.parallel.state import init_parallel
from gptoss_cli.rl.batch import SampledCompletion, completion_rows
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
IS_CAP = 1.5


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
    return prompt_ids, completion, mask, old * mask, ref * mask, engine * mask


def _trl(trainer, model, data, loss_type: str, beta: float, tis: bool, unbiased: bool = True):
    prompt_ids, completion, mask, old, ref, engine = data
    trainer.loss_type, trainer.beta = loss_type, beta
    trainer.args.use_bias_correction_kl = unbiased
    trainer.use_vllm = trainer.vllm_importance_sampling_correction = tis
    inputs = dict(prompt_ids=prompt_ids, prompt_mask=torch.ones_like(prompt_ids), completion_ids=completion,
                  completion_mask=mask, advantages=torch.tensor(ADVANTAGES), old_per_token_logps=old,
                  ref_per_token_logps=ref, num_items_in_batch=mask.sum().float())
    if tis:  # TRL's token_truncate ratio (grpo_trainer.py, _generate_and_score_completions)
        inputs["importance_sampling_ratio"] = torch.clamp(torch.exp((old - engine) * mask), max=IS_CAP)
    model.zero_grad(set_to_none=True)
    loss = trainer.compute_loss(model, inputs)
    loss.backward()
    return float(loss.detach()), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _ours(setup, data, loss_type: str, beta: float, tis: bool, unbiased: bool = True):
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
                              temperature=TEMPERATURE, max_new_tokens=T, is_cap=IS_CAP if tis else None,
                              kl_unbiased=unbiased)
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
