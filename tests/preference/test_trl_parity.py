"""DPO's loss, reward statistics and gradients against TRL's DPOTrainer (and CPOTrainer's SimPO) on transformers'
GptOssForCausalLM, the same weights and pairs, fp32, at EP=1 and EP=2.

Eight pairs of random ids (prompts of 4-8 tokens, completions of 2-7) go to both sides. TRL: its own
collator pads them as [chosen; rejected] with completion masks, `compute_loss` runs the policy and the
frozen reference model (another tiny model) with its fused LM head, and backward gives the policy's
gradients; TRL's metrics are its rewards/chosen, rewards/rejected, rewards/margins, rewards/accuracies.
gptoss: the same pairs in a preference token file (two documents per pair, packed a pair at a time into
rows of 48 tokens), read by PairSource, scored by the frozen reference through the objective's
prepare_step, and the step run through the training schedule over several microbatches (EP=2: two gloo
processes, each with half of the rows and half of the experts; CP=2: two processes each holding half of
every row's positions), the gradients finalised by the buffers (divided by the step's pairs). RPO is TRL's loss_type [.., "sft"] with loss_weights [1, rpo_alpha].
SimPO is CPOTrainer's `cpo_loss` (loss_type simpo) on the mean log-probabilities of the same pairs
computed from transformers' logits here.

Error model (tests/tolerances.py): the same arithmetic in another order (padded batch against packed
documents, one batch against microbatches); the logits are dot products over the hidden size and the
log-softmax a sum over the vocabulary, compounded through the 2L + 2 layers of the backward pass.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from gptoss_cli.model.config import preset
from tests.preference.pairs import dpo_step_worker, random_pairs, write_pair_file
from tests.tolerances import assert_tensors_close, reassociation_rel

pytest.importorskip("trl")

TINY = preset("tiny")
POLICY_SEED, REFERENCE_SEED = 9, 3
N_PAIRS, SEQ = 8, 48
TRL_METRICS = {"rewards_chosen": "rewards/chosen", "rewards_rejected": "rewards/rejected",
               "rewards_margin": "rewards/margins", "rewards_accuracy": "rewards/accuracies"}
# (our DPOObjective keywords, TRL's loss types and weights)
CASES = {
    "sigmoid": ({"loss_type": "sigmoid", "beta": 0.5}, ["sigmoid"], None),
    "hinge": ({"loss_type": "hinge", "beta": 0.5}, ["hinge"], None),
    "ipo": ({"loss_type": "ipo", "beta": 0.5}, ["ipo"], None),
    "robust": ({"loss_type": "robust", "beta": 0.5, "label_smoothing": 0.2}, ["robust"], None),
    "sigmoid-rpo": ({"loss_type": "sigmoid", "beta": 0.5, "rpo_alpha": 0.7}, ["sigmoid", "sft"], [1.0, 0.7]),
    "ipo-rpo": ({"loss_type": "ipo", "beta": 0.5, "rpo_alpha": 0.3}, ["ipo", "sft"], [1.0, 0.3]),
}
SIMPO = {"loss_type": "simpo", "beta": 2.0, "simpo_gamma": 0.8, "label_smoothing": 0.1}


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """The policy and reference folders, the pairs and their token file, TRL's trainer."""
    from datasets import Dataset
    from transformers import PreTrainedTokenizerFast
    from trl import DPOConfig, DPOTrainer

    from gptoss_cli.data.tiny_tokenizer import tiny_tokenizer
    from tests.model.tiny_checkpoints import tiny_hf_model

    root = tmp_path_factory.mktemp("dpo-trl")
    policy, reference = tiny_hf_model(POLICY_SEED).float(), tiny_hf_model(REFERENCE_SEED).float()
    policy.save_pretrained(root / "policy")
    reference.save_pretrained(root / "reference")
    (root / "tokenizer.json").write_text(json.dumps(tiny_tokenizer(TINY.vocab_size)))
    tok = PreTrainedTokenizerFast(tokenizer_file=str(root / "tokenizer.json"), pad_token="<|endoftext|>",
                                  eos_token="<|return|>")
    args = DPOConfig(output_dir=str(root / "out"), report_to=[], use_cpu=True, bf16=False, max_length=None,
                     per_device_train_batch_size=N_PAIRS)
    trainer = DPOTrainer(model=policy.train(), ref_model=reference.eval(), args=args, processing_class=tok,
                         train_dataset=Dataset.from_dict({"prompt": ["a"], "chosen": ["b"], "rejected": ["c"]}))
    # TRL adds the MoE router's aux loss at config.router_aux_loss_coef; the preference loss is compared alone
    trainer.aux_loss_enabled = False
    # replies of 5-12 tokens: most pairs straddle the middle of their 48-token row, so under CP=2 a pair's tokens
    # are on both ranks (its sums cross ranks)
    pairs = random_pairs(N_PAIRS, TINY.vocab_size, seed=4, completion=(5, 12))
    prefix = write_pair_file(root / "pairs", pairs, TINY.vocab_size)
    from gptoss_cli.preference.data import PairSource

    rows = PairSource(prefix, SEQ, 0, TINY.vocab_size).num_samples
    assert rows % 2 == 0  # one step over every row, split over two data-parallel ranks at EP=2
    return SimpleNamespace(root=root, trainer=trainer, policy=policy, reference=reference, pairs=pairs, prefix=prefix,
                           rows=rows)


def _batch(pairs):
    from trl.trainer.dpo_trainer import DataCollatorForPreference

    return DataCollatorForPreference(pad_token_id=0)(
        [{"prompt_ids": p, "chosen_ids": c, "rejected_ids": r} for p, c, r in pairs])


def trl_step(w, loss_types, loss_weights, beta, label_smoothing=0.0):
    t = w.trainer
    t.loss_types, t.loss_weights = loss_types, loss_weights or [1.0] * len(loss_types)
    t.beta, t.label_smoothing = beta, label_smoothing
    t._metrics["train"].clear()
    w.policy.zero_grad(set_to_none=True)
    loss = t.compute_loss(w.policy, _batch(w.pairs))
    loss.backward()
    metrics = {ours: t._metrics["train"][theirs][-1] for ours, theirs in TRL_METRICS.items()}
    return float(loss.detach()), metrics, {n: p.grad.detach().clone() for n, p in w.policy.named_parameters()}


def simpo_step(w, beta, gamma, label_smoothing):
    """CPOTrainer's SimPO loss (trl.experimental.cpo) on the policy's mean log-probs of each side."""
    from trl.experimental.cpo import CPOTrainer

    batch = _batch(w.pairs)
    w.policy.zero_grad(set_to_none=True)
    logits = w.policy(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
    mask = batch["completion_mask"][:, 1:].float()
    logp = torch.log_softmax(logits.float(), -1).gather(-1, batch["input_ids"][:, 1:, None])[..., 0]
    avg = (logp * mask).sum(1) / mask.sum(1)
    c, r = avg.chunk(2)
    fake = SimpleNamespace(alpha=0.0, beta=beta, simpo_gamma=gamma, loss_type="simpo", label_smoothing=label_smoothing,
                           accelerator=SimpleNamespace(device=torch.device("cpu")))
    losses, chosen_rewards, rejected_rewards = CPOTrainer.cpo_loss(fake, c, r)
    loss = losses.mean()
    loss.backward()
    metrics = {"rewards_chosen": float(chosen_rewards.mean()), "rewards_rejected": float(rejected_rewards.mean()),
               "rewards_margin": float((chosen_rewards - rejected_rewards).mean()),
               "rewards_accuracy": float((chosen_rewards > rejected_rewards).float().mean())}
    return float(loss.detach()), metrics, {n: p.grad.detach().clone() for n, p in w.policy.named_parameters()}


def ours(w, cases, ep: int, tmp_path, cp: int = 1):
    """Each case's (metrics, gradients under transformers' names) from gptoss's training path."""
    from tests.train.dist_helpers import run_distributed
    from tests.train.reference import HfView

    args = (str(w.prefix), str(w.root / "policy"), str(w.root / "reference"), SEQ, w.rows, 1, ep, cases, cp)
    if ep * cp == 1:
        ranks = [dpo_step_worker(0, *args)]
    else:
        ranks = run_distributed(dpo_step_worker, ep * cp, tmp_path / "ranks", *args, timeout=300)
    out = []
    for k in range(len(cases)):
        grads = {}
        for rank in ranks:
            grads.update(rank[k]["grads"])  # dense tensors are the same on every rank; experts each on one
        out.append((ranks[0][k]["metrics"], HfView(w.policy).to_hf(grads)))
    return out


def _check(got, want, context):
    (metrics, grads), (want_loss, want_metrics, want_grads) = got, want
    rel = reassociation_rel(n_terms=TINY.vocab_size + TINY.hidden_size, depth=2 * TINY.num_hidden_layers + 2)
    assert metrics["loss"] == pytest.approx(want_loss, rel=rel, abs=rel * 1e-3), context
    for name, value in want_metrics.items():
        # the rewards are beta x sums of per-token log-probs: the loss's error model, an absolute floor for 0
        assert metrics[name] == pytest.approx(value, rel=rel, abs=rel), (context, name)
    assert metrics["pairs"] == N_PAIRS
    assert_tensors_close(grads, want_grads, rel, context=context)


@pytest.mark.parametrize("ep,cp", [(1, 1), (2, 1), (1, 2)], ids=["ep1", "ep2", "cp2"])
def test_loss_metrics_and_gradients_equal_trl_dpo_trainer(world, ep, cp, tmp_path):
    """EP=2: two data-parallel ranks with half the experts each; CP=2: two ranks holding halves of the same rows,
    each pair's sums added over them."""
    cases = list(CASES)
    got = ours(world, [CASES[c][0] for c in cases] + [SIMPO], ep, tmp_path, cp)
    for name, result in zip(cases, got):
        kw, types, weights = CASES[name]
        want = trl_step(world, types, weights, kw["beta"], kw.get("label_smoothing", 0.0))
        assert 0.0 < want[1]["rewards_accuracy"] < 1.0  # the pairs are not all won (or lost) already
        _check(result, want, f"{name} EP={ep} CP={cp}")
    _check(got[-1], simpo_step(world, SIMPO["beta"], SIMPO["simpo_gamma"], SIMPO["label_smoothing"]),
           f"simpo EP={ep} CP={cp}")


LR = 1e-3


def test_three_adamw_steps_equal_trl_gradients_and_torch_adamw(world):
    """Three DPO steps (sigmoid with RPO) through gptoss's training path and its AdamW. At every step, from the same
    weights: the finalised gradients equal TRL's on transformers' model (the error model above), and the step
    equals torch.optim.AdamW's given those gradients, its moments carried over the three steps: the same
    elementwise fp32 arithmetic in another order, so within 16 ulp of the weights' scale (1e-6 x max |w|).
    (Comparing AdamW steps taken on the two paths' gradients would not be: AdamW divides each gradient element by
    its own running size, so a rounding-level difference in a near-zero element becomes a whole step;
    tests/tolerances.py.)"""
    from gptoss_cli.parallel.grads import get_model_config, unwrap_model
    from gptoss_cli.parallel.state import init_parallel
    from gptoss_cli.preference.data import PairSource
    from gptoss_cli.preference.objective import DPOObjective
    from gptoss_cli.rl.reference import frozen_copy
    from gptoss_cli.schedule import get_forward_backward_func
    from gptoss_cli.train.data import DataLoaderState
    from gptoss_cli.train.objective import StepContext
    from gptoss_cli.train.provider import HybridModelProvider
    from gptoss_cli.train.setup import setup_model_and_optimizer
    from tests.preference.pairs import ModelReference
    from tests.train.dist_helpers import named_grads
    from tests.train.jobs import optimizer_config, runtime_config
    from tests.train.reference import HfView

    state, runtime = init_parallel(1, "cpu"), runtime_config(aux_loss_coeff=0.0)
    opt = optimizer_config(weight_decay=0.0, clip_grad=1e9)
    setup = setup_model_and_optimizer(HybridModelProvider(runtime, weights=str(world.root / "policy")), state, opt, LR)
    objective = DPOObjective(loss_type="sigmoid", beta=0.5, rpo_alpha=0.7)
    objective.reference = ModelReference(frozen_copy(HybridModelProvider(runtime, weights=str(world.root / "reference")),
                                                     state))
    schedule = get_forward_backward_func(get_model_config(setup.model))
    data = DataLoaderState(PairSource(world.prefix, SEQ, 0, TINY.vocab_size), global_batch_size=world.rows,
                           micro_batch_size=1, dp_rank=0, dp_size=1)
    inner, view = unwrap_model(setup.model), HfView(world.policy)

    def ours_as_hf():
        return view.to_hf({name: t.detach() for name, t in inner.named_checkpoint_slots()})

    saved = {n: p.detach().clone() for n, p in world.policy.named_parameters()}
    plain = {n: torch.nn.Parameter(p.clone()) for n, p in saved.items()}  # torch's AdamW on gptoss's gradients
    torch_adamw = torch.optim.AdamW(plain.values(), lr=LR, betas=(opt.adam_beta1, opt.adam_beta2), eps=opt.adam_eps,
                                    weight_decay=0.0, foreach=False)
    rel = reassociation_rel(n_terms=TINY.vocab_size + TINY.hidden_size, depth=2 * TINY.num_hidden_layers + 2)
    try:
        for step in range(3):
            before = ours_as_hf()
            with torch.no_grad():
                for name, p in world.policy.named_parameters():
                    p.copy_(before[name])
                    plain[name].copy_(before[name])
            want = trl_step(world, ["sigmoid", "sft"], [1.0, 0.7], 0.5)[2]
            setup.model.zero_grad_buffer()
            context = StepContext(step=step, model=setup.model, state=state, schedule=schedule)
            schedule(forward_step_func=objective.forward_step, model=setup.model, num_microbatches=data.num_microbatches,
                     data_iterator=objective.prepare_step(data.step_iterator(), context))
            grads = view.to_hf(named_grads(setup.model))
            assert_tensors_close(grads, want, rel, context=f"step {step + 1} gradients")
            for name, p in plain.items():
                p.grad = grads[name].clone()
            torch_adamw.step()
            setup.optimizer.step(LR)
            after = ours_as_hf()
            for name, p in plain.items():
                err, scale = float((after[name] - p.detach()).abs().max()), float(p.detach().abs().max())
                assert err <= 1e-6 * scale, f"step {step + 1}: {name} differs from torch's AdamW by {err:.3g}"
                assert float((after[name] - before[name]).abs().max()) > 0.5 * LR  # it moved by about lr
    finally:
        with torch.no_grad():
            for name, p in world.policy.named_parameters():
                p.copy_(saved[name])
