"""LoRA training end to end on a tiny converted checkpoint: only adapters train and are saved, the base
is named by its content hash, resume is bitwise, and the exports (PEFT adapter, merged HF) compute
the trained model's logits in transformers (+ PEFT)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from gptoss_cli.checkpoint.convert import convert
from gptoss_cli.checkpoint.storage.dcp_io import read_metadata
from gptoss_cli.checkpoint.load import checkpoint_architecture, model_from_checkpoint
from gptoss_cli.checkpoint.sources import open_source
from gptoss_cli.checkpoint.formats.training.record import TRAIN_STATE, latest_checkpoint
from gptoss_cli.cli import app
from gptoss_cli.errors import CheckpointError
from gptoss_cli.run.worker import run_worker
from tests.checkpoint.test_convert_errors import assert_clean_failure, run_convert
from tests.model.tiny_checkpoints import load_hf_reference, rewrite_hybrid, write_converted_pair
from tests.tolerances import reassociation_rel
from tests.train.jobs import train_job

peft = pytest.importorskip("peft")

ALL = ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """(HF folder, Hybrid folder converted from it in fp32, its architecture)."""
    hf, hybrid = write_converted_pair(tmp_path_factory.mktemp("lora-base"), "bf16", seed=11)
    arch, _ = checkpoint_architecture(hybrid)
    return hf, hybrid, arch


def _job(run: Path, hybrid: Path, arch, *, iters: int, save_interval: int | None = None, **changes):
    settings = dict(pretrained=str(hybrid), lora_rank=4, lora_alpha=8.0, lora_targets=list(ALL), lr=1e-2,
                    seq_length=16, global_batch_size=2, micro_batch_size=1, train_iters=iters,
                    checkpoint_dir=str(run / "ckpt"), save_interval=save_interval, use_distributed_optimizer=False,
                    lr_decay_iters=3)  # one schedule for every run length: resumed runs compare bitwise
    settings.update(changes)
    return train_job(run / "run", arch=arch, **settings)


def _adapters(ckpt: Path) -> dict[str, torch.Tensor]:
    source = open_source(str(ckpt), adapters_only=True)
    try:
        return {n: source.reader.read(n).clone() for n in source.reader.names()}
    finally:
        source.close()


def _with_adapters(folder: Path, ckpt: Path, **load):
    """The model of `folder` (fp32; `load` goes to model_from_checkpoint, e.g. base_experts) with the LoRA
    adapters of the training checkpoint `ckpt` attached, in evaluation mode."""
    from gptoss_cli.model.expert_names import checkpoint_slots
    from gptoss_cli.model.lora import LoraSettings, attach_lora

    model = model_from_checkpoint(folder, **load)
    attach_lora(model, LoraSettings(rank=4, alpha=8.0, target_modules=tuple(ALL)))
    adapters = _adapters(ckpt)
    with torch.no_grad():
        for name, dest in checkpoint_slots(model):
            if name in adapters:
                dest.copy_(adapters.pop(name))
    assert not adapters
    return model.eval()


@pytest.fixture(scope="module")
def trained(base, tmp_path_factory):
    """3 LoRA steps, saved at step 2 and 3."""
    _, hybrid, arch = base
    run = tmp_path_factory.mktemp("lora-run")
    result = run_worker(_job(run, hybrid, arch, iters=3, save_interval=2))
    return run, result


def test_only_adapters_are_saved_and_the_base_is_named(base, trained):
    _, hybrid, _ = base
    run, result = trained
    folder = latest_checkpoint(run / "ckpt")
    keys = list(read_metadata(folder).state_dict_metadata)
    model_keys = [k for k in keys if k.startswith("model.")]
    optim_keys = [k for k in keys if k.startswith("optimizer.")]
    assert model_keys and all(".adapter.linear_" in k for k in model_keys)
    assert optim_keys and all(".adapter.linear_" in k for k in optim_keys)  # no optimizer state for the base
    assert any(".mlp.experts.linear_fc1.adapter.linear_in.weight3" in k for k in model_keys)  # one pair per expert
    lora = json.loads((folder / TRAIN_STATE).read_text())["run"]["lora"]
    assert lora["rank"] == 4 and lora["target_modules"] == ALL
    assert lora["base"]["path"] == str(hybrid.resolve()) and len(lora["base"]["sha256"]) == 64
    assert all(torch.isfinite(torch.tensor(result.losses)))


def test_training_changes_adapted_weights_only(base, trained):
    """The merged checkpoint equals the base bit for bit except the adapted weights (the base is frozen:
    embeddings, norms, biases, router, sinks, output layer untouched), which did move."""
    _, hybrid, _ = base
    run, _ = trained
    before = dict(model_from_checkpoint(hybrid).state_dict())
    after = dict(model_from_checkpoint(run / "ckpt").state_dict())
    assert set(before) == set(after)
    adapted = [n for n in before if n.endswith(("linear_qkv.weight", "linear_proj.weight"))
               or ".linear_fc1.weight" in n or ".linear_fc2.weight" in n]
    assert len(adapted) == 3 * 2 + 3 * 2 * 4
    for name, t in before.items():
        if name in adapted:
            assert not torch.equal(t, after[name]), name
        else:
            assert torch.equal(t, after[name]), name


def test_resume_is_bitwise(base, trained, tmp_path):
    """Step 2 saved, resumed to step 3 in a new process state: the adapters equal the straight run's."""
    _, hybrid, arch = base
    run, _ = trained
    straight = _adapters(run / "ckpt")
    resumed_run = tmp_path
    run_worker(_job(resumed_run, hybrid, arch, iters=2))
    result = run_worker(_job(resumed_run, hybrid, arch, iters=3))
    assert result.resumed_from is not None and result.steps == 1
    again = _adapters(resumed_run / "ckpt")
    assert set(again) == set(straight)
    for name, t in straight.items():
        assert torch.equal(t, again[name]), name


def test_peft_export_and_merged_export_compute_the_trained_model(base, trained, tmp_path):
    """transformers + PEFT with the exported adapter, and transformers on the merged HF export, give the
    logits of our model loaded from the training checkpoint (the adapters merged in fp32)."""
    hf, _, _ = base
    run, _ = trained
    cli = CliRunner().invoke(app, ["convert", str(run / "ckpt"), str(tmp_path / "adapter"), "--to", "peft"])
    assert cli.exit_code == 0 and "training -> peft" in cli.output, cli.output
    assert "MXFP4" not in cli.output  # no QAT: no note
    convert(str(run / "ckpt"), tmp_path / "merged", to="hf", dtype="float32")
    assert {p.name for p in (tmp_path / "adapter").iterdir()} == {"adapter_config.json", "adapter_model.safetensors"}
    # the base as PEFT users load it: the HF folder the Hybrid base was converted from, by name, not a local path
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == hf.name
    ours = model_from_checkpoint(run / "ckpt").eval()
    ids = torch.randint(0, ours.arch.vocab_size, (2, 10), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = ours(ids).logits
        plain = load_hf_reference(hf)
        base_logits = plain(ids).logits
        with_adapter = peft.PeftModel.from_pretrained(plain, str(tmp_path / "adapter")).eval()(ids).logits
        merged = load_hf_reference(tmp_path / "merged")(ids).logits
    rel = reassociation_rel(ours.arch.intermediate_size, depth=4 * ours.arch.num_hidden_layers)
    scale = want.abs().max().item()
    assert (base_logits - want).abs().max().item() > 100 * rel * scale  # training moved the logits
    assert (with_adapter - want).abs().max().item() <= rel * scale
    assert (merged - want).abs().max().item() <= rel * scale


def test_peft_export_after_mxfp4_qat_notes_the_rounded_merge_in_one_line(base, tmp_path):
    """PEFT adds the adapters unrounded; a run whose forward rounded the merged experts to MXFP4 says so
    on export and points at the merged export (one note line; the export itself succeeds)."""
    _, hybrid, arch = base
    run_worker(_job(tmp_path, hybrid, arch, iters=1, qat="mxfp4"))
    cli = CliRunner().invoke(app, ["convert", str(tmp_path / "ckpt"), str(tmp_path / "adapter"), "--to", "peft"])
    assert cli.exit_code == 0 and (tmp_path / "adapter" / "adapter_model.safetensors").is_file(), cli.output
    notes = [line for line in cli.output.splitlines() if "rounded to MXFP4" in line]
    assert len(notes) == 1 and notes[0].startswith("note: ") and "precision.qat=mxfp4" in notes[0], cli.output
    assert "--to hf --experts mxfp4" in cli.output.replace("\n", " "), cli.output


def test_lora_qat_mxfp4_export_holds_the_rounded_merge_and_computes_the_training_forward(base, tmp_path):
    """After LoRA + precision.qat=mxfp4, `--to hf --experts mxfp4` writes blocks and scales that encode
    Q(W + s B @ A) (W the base, A and B the checkpoint's, Q torchao's MXFP4 rounding) bit for bit, and
    transformers on that export gives the logits of the training forward (base + adapters + the QAT
    gemm), within reassociation: the same weights. `--to hybrid` writes Q(W + s B A) for the experts and
    the unrounded merge for attention (QAT rounds experts only). Rounding the base alone and adding the
    adapters unrounded (the behaviour before) is far from the export."""
    from safetensors import safe_open

    from gptoss_cli.model.mxfp4 import codec as mxfp4
    from gptoss_cli.model.lora import merged_weight
    from gptoss_cli.model.moe import ExpertLinear
    from gptoss_cli.model.mxfp4.qat import qat_gemms
    from tests.model.test_lora_qat import torchao_round
    from tests.train.reference import HfView

    _, hybrid, arch = base
    run_worker(_job(tmp_path, hybrid, arch, iters=2, qat="mxfp4", lr=3e-2))
    ckpt = tmp_path / "ckpt"
    adapters = _adapters(ckpt)
    scaling = 8.0 / 4
    plain = dict(model_from_checkpoint(hybrid).state_dict())  # the base, fp32
    want = dict(plain)  # every Hybrid tensor as the export should hold it
    for name, w in plain.items():
        stem, _, e = name.rpartition(".weight")
        a_name = f"{stem}.adapter.linear_in.weight{e}"
        if a_name not in adapters:
            continue
        b = adapters[f"{stem}.adapter.linear_out.weight{e}"].double()
        m = (w.double() + scaling * (b @ adapters[a_name].double())).float()
        want[name] = torchao_round(m) if ".mlp.experts." in name else m
    experts = [n for n in want if ".mlp.experts.linear_fc" in n and ".weight" in n]
    assert len(experts) == arch.num_hidden_layers * 2 * arch.num_local_experts
    moved = [n for n in experts if not torch.equal(want[n], torchao_round(plain[n]))]
    assert moved == experts  # the adapters moved every expert's rounded weights

    out = tmp_path / "hf-mx"
    convert(str(ckpt), out, to="hf", experts="mxfp4", dtype="float32")
    reference = load_hf_reference(out)  # transformers' own MXFP4 dequantiser
    view = HfView(reference)
    want_hf = view.to_hf({n: want[n] for n in view.index})
    stored = {}
    for f in out.glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            stored.update({k: st.get_tensor(k) for k in st.keys() if k.endswith(("_blocks", "_scales"))})
    assert stored
    for name, p in reference.named_parameters():
        if ".experts." in name and not name.endswith("bias"):
            assert torch.equal(p.detach(), want_hf[name]), name
            blocks, scales = mxfp4.encode(want_hf[name].transpose(1, 2))  # HF stores [E, out, in/32, 16]
            assert torch.equal(stored[f"{name}_blocks"], blocks) and torch.equal(stored[f"{name}_scales"], scales), name

    ours = _with_adapters(hybrid, ckpt)  # the training forward: base, adapters, the QAT gemm
    ours.set_gemms(grouped=qat_gemms("mxfp4"))
    before = _with_adapters(hybrid, ckpt)  # the behaviour before: rounded base + unrounded adapters
    with torch.no_grad():
        for m in before.modules():
            if isinstance(m, ExpertLinear):
                m.weight.copy_(torchao_round(m.weight))
    ids = torch.randint(0, arch.vocab_size, (2, 10), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        theirs, got, old = reference(ids).logits, ours.eval()(ids).logits, before.eval()(ids).logits
    rel = reassociation_rel(max(arch.hidden_size, arch.intermediate_size), depth=4 * arch.num_hidden_layers)
    scale = theirs.abs().max().item()
    assert (got - theirs).abs().max().item() <= rel * scale
    assert (old - theirs).abs().max().item() > 100 * rel * scale

    convert(str(ckpt), tmp_path / "hybrid", to="hybrid", dtype="float32")
    written = dict(model_from_checkpoint(tmp_path / "hybrid").state_dict())
    for name in want:
        assert torch.equal(written[name], want[name]), name
    a_name = "decoder.layers.0.self_attention.linear_qkv.weight"
    assert torch.equal(written[a_name], merged_weight(plain[a_name], adapters[a_name.replace(".weight", ".adapter.linear_in.weight")],
                                                      adapters[a_name.replace(".weight", ".adapter.linear_out.weight")], scaling))


def test_peft_export_of_a_full_fine_tune_is_a_one_line_error(base, tmp_path):
    _, hybrid, arch = base
    run_worker(train_job(tmp_path / "run", arch=arch, pretrained=str(hybrid), train_iters=1, seq_length=16,
                         global_batch_size=1, checkpoint_dir=str(tmp_path / "ckpt")))
    result, output = run_convert(tmp_path / "ckpt", tmp_path / "adapter", "--to", "peft")
    assert_clean_failure(result, output, "--to peft exports the LoRA adapters", "a full fine-tune",
                         dst=tmp_path / "adapter")


def test_another_base_is_refused_by_resume_and_export(base, tmp_path):
    """Adapters trained on one base, applied to another (same architecture, one weight changed): resume
    and every export name the hash mismatch."""
    _, hybrid, arch = base
    import shutil

    copy = tmp_path / "base"
    shutil.copytree(hybrid, copy)
    run_worker(_job(tmp_path, copy, arch, iters=1))

    def nudge(tensors):
        name = "decoder.layers.0.self_attention.linear_qkv.bias"
        tensors[name] = tensors[name] + 1.0

    rewrite_hybrid(copy, nudge)
    with pytest.raises(CheckpointError, match=r"sha256 .*\(a different base\)"):
        run_worker(_job(tmp_path, copy, arch, iters=2))
    for to in ("peft", "hf", "hybrid"):
        result, output = run_convert(tmp_path / "ckpt", tmp_path / f"out-{to}", "--to", to)
        assert_clean_failure(result, output, "sha256", "(a different base)", dst=tmp_path / f"out-{to}")


@pytest.mark.parametrize("experts,storage", [("bf16", "bf16"), ("mxfp4", "bf16"), ("mxfp4", "mxfp4")])
def test_merged_exports_of_a_run_on_an_hf_base_equal_peft_merged(experts, storage, tmp_path):
    """A LoRA run trained on an HF folder (experts bf16, or MXFP4 as released; held in the params dtype,
    or with lora.base_experts=mxfp4 as MXFP4 blocks/scales) exports merged: `--to hf` loads in
    transformers and `--to hybrid` in our model, and both give the logits of transformers + PEFT with
    the run's `--to peft` adapter on the same HF base (its MXFP4 experts dequantised by transformers),
    merged by PEFT (`merge_and_unload`); unmerged, PEFT's logits are those of our model read from the
    training checkpoint."""
    from tests.model.tiny_checkpoints import write_hf_checkpoint

    hf = write_hf_checkpoint(tmp_path / "base", experts, seed=12)
    arch, _ = checkpoint_architecture(hf)
    run_worker(_job(tmp_path, hf, arch, iters=2, lora_base_experts=storage))
    ckpt = tmp_path / "ckpt"
    for to, dtype in (("peft", []), ("hf", ["--dtype", "float32"]), ("hybrid", ["--dtype", "float32"])):
        cli = CliRunner().invoke(app, ["convert", str(ckpt), str(tmp_path / to), "--to", to, *dtype])
        assert cli.exit_code == 0, cli.output
        if to == "peft":  # the adapters were trained against MXFP4 experts: one note says so
            assert ("lora.base_experts=mxfp4" in " ".join(cli.output.split())) == (storage == "mxfp4"), cli.output
    ids = torch.randint(0, arch.vocab_size, (2, 10), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        base_logits = load_hf_reference(hf)(ids).logits
        adapted = peft.PeftModel.from_pretrained(load_hf_reference(hf), str(tmp_path / "peft")).eval()
        unmerged = adapted(ids).logits
        want = adapted.merge_and_unload().eval()(ids).logits
        merged_hf = load_hf_reference(tmp_path / "hf")(ids).logits
        merged_hybrid = model_from_checkpoint(tmp_path / "hybrid").eval()(ids).logits
        ours = model_from_checkpoint(ckpt).eval()(ids).logits
    rel = reassociation_rel(arch.intermediate_size, depth=4 * arch.num_hidden_layers)
    scale = want.abs().max().item()
    assert (base_logits - want).abs().max().item() > 100 * rel * scale  # training moved the logits
    assert (merged_hf - want).abs().max().item() <= rel * scale
    assert (merged_hybrid - want).abs().max().item() <= rel * scale
    assert (unmerged - ours).abs().max().item() <= rel * scale


def test_resume_on_an_mxfp4_base_is_bitwise(tmp_path):
    """lora.base_experts=mxfp4 on an HF MXFP4 base: step 2 saved and resumed to step 3 in a new run gives the
    adapters of a straight 3-step run, bit for bit (the base is loaded again, byte for byte as released)."""
    from tests.model.tiny_checkpoints import write_hf_checkpoint

    hf = write_hf_checkpoint(tmp_path / "base", "mxfp4", seed=12)
    arch, _ = checkpoint_architecture(hf)
    run_worker(_job(tmp_path / "straight", hf, arch, iters=3, lora_base_experts="mxfp4"))
    run_worker(_job(tmp_path / "resumed", hf, arch, iters=2, lora_base_experts="mxfp4"))
    result = run_worker(_job(tmp_path / "resumed", hf, arch, iters=3, lora_base_experts="mxfp4"))
    assert result.resumed_from is not None and result.steps == 1
    straight, again = _adapters(tmp_path / "straight" / "ckpt"), _adapters(tmp_path / "resumed" / "ckpt")
    assert set(again) == set(straight) and straight
    for name, t in straight.items():
        assert torch.equal(t, again[name]), name


def test_merged_export_of_a_bf16_base_trained_as_mxfp4_is_what_the_run_computed(tmp_path):
    """lora.base_experts=mxfp4 on a base with bf16 experts: the run computed with the experts rounded to
    MXFP4 (quantised as loaded), so reading the checkpoint merged gives the logits of that model: an
    MXFP4-stored base with the trained adapters attached, not the unrounded base plus the adapters."""
    from tests.model.tiny_checkpoints import write_hf_checkpoint

    hf = write_hf_checkpoint(tmp_path / "base", "bf16", seed=12)
    arch, _ = checkpoint_architecture(hf)
    run_worker(_job(tmp_path, hf, arch, iters=2, lora_base_experts="mxfp4"))

    ids = torch.randint(0, arch.vocab_size, (2, 10), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want = _with_adapters(hf, tmp_path / "ckpt", base_experts="mxfp4")(ids).logits
        unrounded = _with_adapters(hf, tmp_path / "ckpt", base_experts="bf16")(ids).logits
        merged = model_from_checkpoint(tmp_path / "ckpt").eval()(ids).logits
    rel = reassociation_rel(arch.intermediate_size, depth=4 * arch.num_hidden_layers)
    scale = want.abs().max().item()
    assert (merged - want).abs().max().item() <= rel * scale
    assert (unrounded - want).abs().max().item() > 100 * rel * scale  # rounding the experts matters here


def test_lora_qat_on_an_mxfp4_stored_base_exports_the_rounded_merge_of_the_decoded_experts(tmp_path):
    """lora.base_experts=mxfp4 + precision.qat=mxfp4 on a base with fp32 experts (storing them in MXFP4
    rounds them to W_dec = Q(W)): the run computed with Q(W_dec + s B A), so `--to hybrid` holds exactly
    that for every expert (Q torchao's MXFP4 rounding, both times), neither Q(W + s B A) (the base's
    storage forgotten) nor W_dec + s B A (the merge unrounded, the no-QAT export); `--to hf --experts
    mxfp4` loads in transformers with the same expert weights and gives the logits of the training
    forward (the MXFP4-stored base, the adapters, the QAT gemm) within reassociation; `--to peft` notes
    the rounded merge once."""
    from gptoss_cli.model.mxfp4.qat import qat_gemms
    from tests.model.test_lora_qat import torchao_round
    from tests.model.tiny_checkpoints import write_hf_checkpoint
    from tests.train.reference import HfView

    hf = write_hf_checkpoint(tmp_path / "base", "bf16", seed=12)
    arch, _ = checkpoint_architecture(hf)
    run_worker(_job(tmp_path, hf, arch, iters=2, lora_base_experts="mxfp4", qat="mxfp4", lr=3e-2))
    ckpt = tmp_path / "ckpt"
    adapters = _adapters(ckpt)
    plain = dict(model_from_checkpoint(hf).state_dict())  # the base as stored (fp32)
    want, base_forgotten, merge_unrounded = {}, {}, {}
    for name, w in plain.items():
        stem, _, e = name.rpartition(".weight")
        if ".mlp.experts.linear_fc" not in name or not stem:
            continue
        b, a = adapters[f"{stem}.adapter.linear_out.weight{e}"].double(), adapters[f"{stem}.adapter.linear_in.weight{e}"].double()
        delta = 2.0 * (b @ a)  # alpha / rank = 8 / 4
        merge_unrounded[name] = (torchao_round(w).double() + delta).float()
        want[name] = torchao_round(merge_unrounded[name])
        base_forgotten[name] = torchao_round((w.double() + delta).float())
    assert len(want) == arch.num_hidden_layers * 2 * arch.num_local_experts

    cli = CliRunner().invoke(app, ["convert", str(ckpt), str(tmp_path / "adapter"), "--to", "peft"])
    assert cli.exit_code == 0, cli.output
    notes = " ".join(cli.output.split())
    assert notes.count("note: ") == 1 and "precision.qat=mxfp4, on lora.base_experts=mxfp4" in notes, cli.output
    convert(str(ckpt), tmp_path / "hybrid", to="hybrid", dtype="float32")
    written = dict(model_from_checkpoint(tmp_path / "hybrid").state_dict())
    for name, w in want.items():
        assert torch.equal(written[name], w), name
        assert not torch.equal(w, base_forgotten[name]) and not torch.equal(w, merge_unrounded[name]), name

    out = tmp_path / "hf-mx"
    convert(str(ckpt), out, to="hf", experts="mxfp4", dtype="float32")
    reference = load_hf_reference(out)  # transformers' own MXFP4 dequantiser
    view = HfView(reference)
    want_hf = view.to_hf({n: written[n] for n in view.index})
    experts = [(n, p) for n, p in reference.named_parameters() if ".experts." in n and not n.endswith("bias")]
    assert experts
    for name, p in experts:
        assert torch.equal(p.detach(), want_hf[name]), name
    ours = _with_adapters(hf, ckpt, base_experts="mxfp4")
    ours.set_gemms(grouped=qat_gemms("mxfp4"))
    ids = torch.randint(0, arch.vocab_size, (2, 10), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        theirs, got = reference(ids).logits, ours(ids).logits
    rel = reassociation_rel(max(arch.hidden_size, arch.intermediate_size), depth=4 * arch.num_hidden_layers)
    assert (got - theirs).abs().max().item() <= rel * theirs.abs().max().item()


@pytest.mark.parametrize("change,field,ours,theirs", [
    (dict(lora_targets=["linear_qkv", "linear_proj"]), "lora.target_modules", "['linear_qkv', 'linear_proj']", str(ALL)),
    (dict(lora_alpha=16.0), "lora.alpha", "16.0", "8.0"),
    (dict(lora_rank=8), "lora.rank", "8", "4"),
])
def test_resume_with_other_lora_settings_is_refused_in_one_line(base, trained, tmp_path, change, field, ours, theirs):
    """A resume whose recipe adapts other modules (its `latest` would silently lose the other adapters), or
    scales them differently (another alpha or rank), is refused before any worker starts (train's
    pre-launch check) and by the worker, in one line naming the field and both values; nothing is written."""
    import shutil

    from gptoss_cli.errors import ConfigError
    from gptoss_cli.train.resume import check_resume_point

    _, hybrid, arch = base
    run, _ = trained
    shutil.copytree(run / "ckpt", tmp_path / "ckpt")
    job = _job(tmp_path, hybrid, arch, iters=4, **change)
    with pytest.raises(ConfigError) as err:
        check_resume_point(job.config)
    message = str(err.value)
    assert len(message.splitlines()) == 1 and err.value.exit_code == 2, message
    assert f"{field}={ours}" in message and f"the checkpoint's {field} is {theirs}" in message, message
    if field == "lora.target_modules":  # the worker refuses it too, before loading anything
        with pytest.raises(ConfigError, match=r"lora\.target_modules"):
            run_worker(job)
        assert (tmp_path / "ckpt" / "latest").read_text().strip() == "iter_0000003"


def _edit_record(ckpt: Path, **lora) -> None:
    """Set fields of the run's LoRA record in the latest checkpoint's train_state.json."""
    path = latest_checkpoint(ckpt) / TRAIN_STATE
    state = json.loads(path.read_text())
    state["run"]["lora"].update(lora)
    path.write_text(json.dumps(state))


@pytest.mark.parametrize("lora,words", [
    (dict(rank=8), ["decoder.layers.0.self_attention.linear_proj.adapter.linear_in.weight", "rank 4",
                    "run.lora.rank is 8"]),
    (dict(target_modules=["linear_qkv", "linear_proj", "linear_fc1"]),
     ["decoder.layers.1.mlp.experts.linear_fc2.adapter.linear_in.weight0", "linear_fc2", "run.lora.target_modules"]),
])
def test_export_refuses_a_lora_record_the_adapter_tensors_contradict(base, trained, tmp_path, lora, words):
    """The adapter tensors are the truth: a record with another rank (a merge scaled by alpha/8 instead of
    alpha/4, a PEFT config saying r=8) or fewer targets than there are adapters (a PEFT export missing
    them) is refused by every export in one line naming the tensor, nothing written."""
    import shutil

    run, _ = trained
    shutil.copytree(run / "ckpt", tmp_path / "ckpt")
    _edit_record(tmp_path / "ckpt", **lora)
    for to in ("peft", "hf"):
        result, output = run_convert(tmp_path / "ckpt", tmp_path / f"out-{to}", "--to", to)
        assert result.exit_code == 2, output
        assert_clean_failure(result, output, *words, dst=tmp_path / f"out-{to}")


def test_export_refuses_a_lora_target_without_its_adapter_tensors(base, tmp_path):
    """A record naming a target whose adapters are not in the checkpoint is refused, naming the missing tensor."""
    _, hybrid, arch = base
    run_worker(_job(tmp_path, hybrid, arch, iters=1, lora_targets=["linear_qkv"]))
    _edit_record(tmp_path / "ckpt", target_modules=["linear_qkv", "linear_proj"])
    result, output = run_convert(tmp_path / "ckpt", tmp_path / "out", "--to", "peft")
    assert_clean_failure(result, output, "decoder.layers.0.self_attention.linear_proj.adapter.linear_in.weight",
                         "not in the checkpoint", dst=tmp_path / "out")
