"""`convert RUN --to hf --experts mxfp4` of a run trained without QAT rounds its experts: the export says what
that cost (the weight rounding error; with the run's data at hand, the loss before and after and the KL) and
points at precision.qat=mxfp4. The figures are checked against transformers on the exported folders (its own
MXFP4 dequantiser for the rounded export)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from gptoss_cli.checkpoint.convert import convert
from gptoss_cli.checkpoint.export_cost import SEQ_LENGTH, SEQUENCES
from gptoss_cli.cli import app
from gptoss_cli.data.token_format import token_file_paths, write_atomically, write_token_header
from gptoss_cli.model.mxfp4.codec import decode
from gptoss_cli.run.worker import run_worker
from tests.model.tiny_checkpoints import load_hf_reference, write_hf_checkpoint
from tests.train.jobs import train_job

pytest.importorskip("transformers")
NUM_TOKENS = 700


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(a 2-step full fine-tune on token data, trained without QAT from a bf16-form HF base whose expert
    values are not MXFP4 values; its Hybrid export, which records no data and has no tokenizer; the tokens)."""
    root = tmp_path_factory.mktemp("export-cost")
    hf = write_hf_checkpoint(root / "hf", experts="bf16", seed=5)
    cfg = json.loads((hf / "config.json").read_text())
    tokens = torch.randint(0, cfg["vocab_size"], (NUM_TOKENS,), generator=torch.Generator().manual_seed(4))
    bin_path, json_path = token_file_paths(root / "data")
    write_atomically(bin_path, tokens.numpy().astype(np.uint16))
    write_token_header(json_path, dtype="uint16", num_tokens=NUM_TOKENS, num_documents=1,
                       vocab_size=cfg["vocab_size"], eos_token_id=None, tokenizer=None, sources=["test"])
    from gptoss_cli.checkpoint.load import checkpoint_architecture

    arch, _ = checkpoint_architecture(hf)
    job = train_job(root / "run", arch=arch, pretrained=str(hf), seq_length=16, global_batch_size=2,
                    micro_batch_size=1, train_iters=2, save_interval=2, lr=1e-3, checkpoint_dir=str(root / "ckpt"),
                    use_distributed_optimizer=False, data_kind="tokens", data_path=str(root / "data"))
    # the resolved recipe, as `gptoss train` records it in the run (train_job leaves it out)
    run_worker(dataclasses.replace(job, recipe=json.loads(json.dumps(dataclasses.asdict(job.config), default=str))))
    convert(str(root / "ckpt"), root / "hybrid", dtype="float32")
    return root / "ckpt", root / "hybrid", tokens


def _loss(model, seqs) -> float:
    total = count = 0
    with torch.no_grad():
        for s in seqs:
            logits = model(s[None, :-1]).logits[0]
            total += float(torch.nn.functional.cross_entropy(logits, s[1:], reduction="sum"))
            count += len(s) - 1
    return total / count


def test_the_mxfp4_export_of_a_run_without_qat_says_what_it_cost(runs, tmp_path):
    ckpt, _, tokens = runs
    result = CliRunner().invoke(app, ["convert", str(ckpt), str(tmp_path / "mx"), "--to", "hf", "--experts", "mxfp4",
                                      "--dtype", "float32", "--json", str(tmp_path / "r.json")])
    assert result.exit_code == 0, result.output
    assert "precision.qat=mxfp4" in result.output and "the loss went" in result.output, result.output
    cost = json.loads((tmp_path / "r.json").read_text())["export_cost"]
    length = min(SEQ_LENGTH, NUM_TOKENS // SEQUENCES)
    seqs = [tokens[NUM_TOKENS - (k + 1) * length:NUM_TOKENS - k * length].long() for k in range(SEQUENCES)]
    assert cost["sequences"] == SEQUENCES and cost["tokens"] == SEQUENCES * (length - 1)
    convert(str(ckpt), tmp_path / "exact", to="hf", dtype="float32")  # bf16-form experts: the run's own weights
    rel = 1e-4  # fp32 forwards of the same weights differ by reassociation only (tests/tolerances.py: ~1e-5 here)
    assert cost["loss_before"] == pytest.approx(_loss(load_hf_reference(tmp_path / "exact"), seqs), rel=rel)
    assert cost["loss_after"] == pytest.approx(_loss(load_hf_reference(tmp_path / "mx"), seqs), rel=rel)
    assert cost["kl"] > 0 and cost["loss_after"] != pytest.approx(cost["loss_before"], rel=rel)


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory):
    """(a 2-step fine-tune, without QAT, on an SFT file (documents with a loss mask); its documents and masks)."""
    from tests.train.sft_files import sft_documents, write_sft_file

    root = tmp_path_factory.mktemp("export-cost-sft")
    hf = write_hf_checkpoint(root / "hf", experts="bf16", seed=5)
    cfg = json.loads((hf / "config.json").read_text())
    docs, masks = sft_documents([9, 16, 5, 12, 7, 14, 11, 6, 13], cfg["vocab_size"], seed=2)
    data = write_sft_file(root / "sft", docs, masks, cfg["vocab_size"])
    from gptoss_cli.checkpoint.load import checkpoint_architecture

    arch, _ = checkpoint_architecture(hf)
    job = train_job(root / "run", arch=arch, pretrained=str(hf), seq_length=16, global_batch_size=2,
                    micro_batch_size=1, train_iters=2, save_interval=2, lr=1e-3, checkpoint_dir=str(root / "ckpt"),
                    use_distributed_optimizer=False, data_kind="tokens", data_path=str(data))
    run_worker(dataclasses.replace(job, recipe=json.loads(json.dumps(dataclasses.asdict(job.config), default=str))))
    return root / "ckpt", docs, masks


def test_after_an_sft_run_the_loss_is_over_the_trained_tokens_as_its_training_loss(sft_run, tmp_path):
    """An SFT run's training loss counts the trained tokens only; the export's loss is counted the same way on
    the file's last conversations (all of the next tokens would compare a prompt's loss with the run's)."""
    ckpt, docs, masks = sft_run
    result = convert(str(ckpt), tmp_path / "mx", to="hf", experts="mxfp4", dtype="float32")
    cost = result.export_cost
    last = list(range(len(docs)))[-SEQUENCES:][::-1]  # the last conversations, the last first
    labels = [masks[i][1:].bool() for i in last]  # the mask marks trained tokens; position t predicts token t+1
    assert cost["tokens"] == sum(int(m.sum()) for m in labels) < sum(len(docs[i]) - 1 for i in last)
    assert cost["counted"] == "trained" and cost["sequences"] == SEQUENCES
    convert(str(ckpt), tmp_path / "exact", to="hf", dtype="float32")

    def masked_loss(folder) -> float:
        model, total = load_hf_reference(folder), 0.0
        with torch.no_grad():
            for i, keep in zip(last, labels):
                logits = model(docs[i][None, :-1].long()).logits[0]
                total += float(torch.nn.functional.cross_entropy(logits[keep], docs[i][1:].long()[keep],
                                                                 reduction="sum"))
        return total / cost["tokens"]

    rel = 1e-4  # fp32 forwards of the same weights differ by reassociation only (as above)
    assert cost["loss_before"] == pytest.approx(masked_loss(tmp_path / "exact"), rel=rel)
    assert cost["loss_after"] == pytest.approx(masked_loss(tmp_path / "mx"), rel=rel)
    assert any(f"over their {cost['tokens']} trained tokens as the training loss counts them" in n
               for n in result.notes), result.notes


def test_without_data_or_a_tokenizer_the_weight_error_is_said(runs, tmp_path):
    _, ckpt, _ = runs  # the run's Hybrid export: no run data recorded, no tokenizer.json
    result = convert(str(ckpt), tmp_path / "mx", to="hf", experts="mxfp4", dtype="float32")
    convert(str(ckpt), tmp_path / "exact", to="hf", dtype="float32")
    cost = result.export_cost
    assert cost["kl"] is None and "no token data or tokenizer.json" in cost["skipped"]
    assert any("precision.qat=mxfp4" in n and "RMS" in n for n in result.notes), result.notes
    mx = {k: v for f in sorted((tmp_path / "mx").glob("*.safetensors")) for k, v in load_file(f).items()}
    exact = {k: v for f in sorted((tmp_path / "exact").glob("*.safetensors")) for k, v in load_file(f).items()}
    err = ref = 0.0
    for name, w in exact.items():  # HF's [E, in, out] stacks; the MXFP4 form stores [E, out, in/32, 16]
        if name.endswith(("gate_up_proj", "down_proj")):
            got = decode(mx[name + "_blocks"], mx[name + "_scales"], torch.float32).transpose(1, 2)
            err += float((got - w).square().sum())
            ref += float(w.square().sum())
    assert cost["weight_relative_rms"] == pytest.approx((err / ref) ** 0.5, rel=1e-5)


def test_an_export_that_rounds_nothing_says_nothing(runs, tmp_path):
    """Rounding an MXFP4 export again loses nothing (OCP floor rule): no cost note."""
    ckpt, _, _ = runs
    convert(str(ckpt), tmp_path / "mx", to="hf", experts="mxfp4", dtype="float32")
    convert(str(tmp_path / "mx"), tmp_path / "hyb", dtype="float32")
    again = convert(str(tmp_path / "hyb"), tmp_path / "mx2", experts="mxfp4", dtype="float32")
    assert again.export_cost is None and not again.notes
