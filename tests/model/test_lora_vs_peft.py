"""LoRA against PEFT: transformers + PEFT with our exported adapter computes our logits, the merged
model computes them too, and the adapters' gradients equal PEFT's autograd on the same batch."""

from __future__ import annotations

import pytest
import torch

from gptoss_cli.checkpoint.load import model_from_checkpoint
from gptoss_cli.checkpoint.formats.peft.adapter import (
    ADAPTER_CONFIG, ADAPTER_WEIGHTS, adapter_config, adapter_config_text, peft_tensors,
)
from gptoss_cli.model.lora import LoraSettings, adapter_modules, adapter_tensors, attach_lora, merge_lora_
from tests.model.tiny_checkpoints import load_hf_reference, write_converted_pair
from tests.tolerances import reassociation_rel

peft = pytest.importorskip("peft")

ALL = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return write_converted_pair(tmp_path_factory.mktemp("lora"), "bf16", seed=3)


def _adapted(hybrid, targets=ALL, rank=4, alpha=8.0, seed=5):
    """Our model with adapters whose B is random too (a fresh B is zero and would test nothing)."""
    model = model_from_checkpoint(hybrid, dtype=torch.float32).eval()
    settings = LoraSettings(rank=rank, alpha=alpha, target_modules=targets)
    attach_lora(model, settings, seed=seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, adapter in adapter_modules(model):
            w = adapter.linear_out.weight
            w.copy_(torch.randn(w.shape, generator=g) * 0.05)
    return model, settings


def _write_peft(folder, model, settings, hf):
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    tensors = peft_tensors(model.arch, adapter_tensors(model), settings.target_modules)
    save_file(tensors, str(folder / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    cfg = adapter_config(rank=settings.rank, alpha=settings.alpha, dropout=settings.dropout,
                         target_modules=settings.target_modules, base_model=str(hf))
    (folder / ADAPTER_CONFIG).write_text(adapter_config_text(cfg))
    return folder


def _tokens(vocab, seed=2, shape=(2, 10)):
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))


# Logits: a sum over hidden (64) per GEMM, through 3 blocks of attention + experts; both paths fp32.
LOGITS_REL = reassociation_rel(96, depth=12)


@pytest.mark.parametrize("targets", [ALL, ("linear_qkv",), ("linear_fc1",), ("linear_proj", "linear_fc2")])
def test_peft_applies_our_adapter_and_gives_our_logits(pair, tmp_path, targets):
    hf, hybrid = pair
    model, settings = _adapted(hybrid, targets)
    folder = _write_peft(tmp_path / "adapter", model, settings, hf)
    ids = _tokens(model.arch.vocab_size)
    with torch.no_grad():
        ours = model(ids).logits
        base = load_hf_reference(hf)
        plain = base(ids).logits
        theirs = peft.PeftModel.from_pretrained(base, str(folder)).eval()(ids).logits
    # the adapter changes the output by far more than the tolerance, so a dropped adapter shows
    assert (plain - theirs).abs().max() > 100 * LOGITS_REL * theirs.abs().max()
    err = (ours - theirs).abs().max().item()
    assert err <= LOGITS_REL * theirs.abs().max().item(), err


def test_merged_model_gives_the_adapted_logits(pair):
    _, hybrid = pair
    model, _ = _adapted(hybrid)
    ids = _tokens(model.arch.vocab_size)
    with torch.no_grad():
        adapted = model(ids).logits
        assert merge_lora_(model) == 3 * 4
        merged = model(ids).logits
    assert not any(True for _ in adapter_modules(model))
    assert (merged - adapted).abs().max().item() <= LOGITS_REL * adapted.abs().max().item()


def test_adapter_gradients_equal_peft_autograd(pair, tmp_path):
    """Step 0 of training: our adapters' gradients of the LM loss equal PEFT's on the same batch."""
    hf, hybrid = pair
    model, settings = _adapted(hybrid)
    model.aux_loss_coef = 0.0
    folder = _write_peft(tmp_path / "adapter", model, settings, hf)
    ids, labels = _tokens(model.arch.vocab_size, 2), _tokens(model.arch.vocab_size, 3)
    model.train()
    model(ids, labels=labels).loss.backward()
    trainable = [k for k, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(".adapter." in k for k in trainable)
    ours_grads = adapter_tensors(model, grads=True)
    assert all(p.grad is None for k, p in model.named_parameters() if not p.requires_grad)
    # The same gradients in PEFT's layout, by the export's own mapping.
    ours = peft_tensors(model.arch, ours_grads, settings.target_modules)

    base = load_hf_reference(hf)
    peft_model = peft.PeftModel.from_pretrained(base, str(folder), is_trainable=True)
    peft_model.train()
    logits = peft_model(ids).logits
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1))
    loss.backward()
    theirs = {}
    for name, p in peft_model.named_parameters():
        if p.requires_grad:
            key = name.replace(".default", "")
            theirs[key] = p.grad
    assert set(ours) == set(theirs), sorted(set(ours) ^ set(theirs))[:4]
    # q, k and v share our fused A: PEFT's three A gradients add up to ours.
    for key, g in theirs.items():
        if ".self_attn.q_proj.lora_A" in key:
            k_key, v_key = key.replace("q_proj", "k_proj"), key.replace("q_proj", "v_proj")
            theirs[key] = g + theirs[k_key] + theirs[v_key]
            theirs[k_key] = theirs[v_key] = theirs[key]
            ours[k_key] = ours[v_key] = ours[key]
    rel = reassociation_rel(96, depth=12)
    for key, want in theirs.items():
        err = (ours[key] - want).abs().max().item()
        assert err <= rel * want.abs().max().item() + 1e-12, (key, err, want.abs().max().item())


def test_adapter_a_starts_uniform_within_pefts_bound():
    """A's initial values against PEFT's own initialisation of a LoRA layer with the same input width:
    PEFT draws kaiming_uniform(a=sqrt 5), i.e. uniform on [-b, b] with b = 1/sqrt(in). Pooled per input
    width, our values must stay inside PEFT's range and reach its top (the largest of n uniform draws
    falls short of b by a fraction ~1/n; below 0.97 b on either side has probability < 0.985**n < 1e-6 at
    n >= 1000), and B starts at zero as PEFT's does."""
    from gptoss_cli.model.config import preset
    from gptoss_cli.model.hybrid import HybridModel

    model = HybridModel(preset("tiny"))
    attach_lora(model, LoraSettings(rank=4, alpha=8.0, target_modules=ALL), seed=7)
    ours: dict[int, list[torch.Tensor]] = {}
    for name, t in adapter_tensors(model).items():
        if ".linear_in." in name:
            ours.setdefault(t.shape[-1], []).append(t.float().flatten())
        else:
            assert not t.any(), f"{name} does not start at zero"
    assert len(ours) >= 2, sorted(ours)  # hidden 64, intermediate 96 (and the attention widths) differ
    for width, values in sorted(ours.items()):
        torch.manual_seed(width)
        base = torch.nn.Sequential(torch.nn.Linear(width, 8))
        ref = peft.get_peft_model(base, peft.LoraConfig(r=4096, lora_alpha=8, target_modules=["0"]))
        peft_a = next(p for n, p in ref.named_parameters() if "lora_A" in n).detach()
        peft_bound = peft_a.abs().max().item()  # n = 4096 * width draws: within ~1e-5 of b
        got = torch.cat(values)
        assert got.numel() >= 1000, (width, got.numel())
        top = got.abs().max().item()
        assert top <= peft_bound * (1 + 1e-5), f"in={width}: |A| reaches {top:.4g} > PEFT's {peft_bound:.4g}"
        for side, reach in (("+", got.max().item()), ("-", -got.min().item())):  # both ends, as PEFT's
            assert reach >= 0.97 * peft_bound, f"in={width}: A's {side} side reaches {reach:.4g}, PEFT's {peft_bound:.4g}"
