"""`gptoss convert` of a training checkpoint: the export computes what our model computes from the
checkpoint (transformers as the reference), any EP layout exports the same bytes, only the needed
tensors are read, and a bad checkpoint is one line while the checkpoint itself is never touched."""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import pytest
import torch

from gptoss_cli.checkpoint.convert import PROVENANCE_KEY, convert
from gptoss_cli.checkpoint.load import load_hf, model_from_checkpoint
from gptoss_cli.checkpoint.formats.training.record import TRAIN_STATE
from gptoss_cli.model.build import build_model
from gptoss_cli.errors import CheckpointError, UsageError
from tests.faults.conftest import digest
from tests.model.tiny_checkpoints import load_hf_reference
from tests.support.cli import exit_and_output
from tests.tolerances import reassociation_rel
from tests.train.dist_helpers import once_per_session
from tests.train.workers import TINY, ep2_checkpoint_run, tiny_plan

# fp32 forward of the same weights by two implementations: sums of at most max(H, I, heads x head_dim)
# terms per layer, compounded over the Hybrid layers and the output layer (tests/tolerances.py).
LOGITS_REL = reassociation_rel(max(TINY.hidden_size, TINY.intermediate_size, TINY.qkv_rows),
                               depth=2 * TINY.num_hidden_layers + 1)


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """checkpoint.dir of a 3-step EP=2 run on 2 processes (iter_2, iter_3; `latest` -> iter_3), fp32
    parameters; the same run tests/train/test_train_checkpoint.py resumes from."""
    work, _ = once_per_session(tmp_path_factory, "ep2_checkpoint", ep2_checkpoint_run)
    return work / "ckpt"


def ids(seq: int = 2 * TINY.sliding_window + 8) -> torch.Tensor:
    """Longer than twice the sliding window, so window and RoPE mistakes show."""
    return torch.randint(0, TINY.vocab_size, (2, seq), generator=torch.Generator().manual_seed(5))


def assert_logits_close(got: torch.Tensor, want: torch.Tensor) -> None:
    err = (got - want).abs().max().item()
    assert err <= LOGITS_REL * want.abs().max().item(), (err, want.abs().max().item())


def test_hf_export_of_a_training_checkpoint_computes_what_our_model_computes(trained, tmp_path):
    before = digest(trained)
    out = tmp_path / "hf"
    result = convert(str(trained), out, to="hf", dtype="float32")
    reference = load_hf_reference(out)  # transformers' own loading of the export
    ours = model_from_checkpoint(trained).eval()  # our model from the same checkpoint, through `latest`
    with torch.no_grad():
        assert_logits_close(ours(ids()).logits, reference(ids()).logits)
    provenance = json.loads((out / "model.safetensors.index.json").read_text())["metadata"][PROVENANCE_KEY]
    assert provenance["iteration"] == 3 and provenance["checkpoint"].endswith("iter_0000003")
    assert provenance["run"] == "ckpt" and provenance["weights"] == "model"
    assert provenance["saved_at"]["expert_model_parallel_size"] == 2
    assert result.provenance == provenance
    assert result.workers == 1  # the DCP reader serves one stream (DcpReader.concurrent_reads)
    assert digest(trained) == before  # read only: nothing added, nothing changed


def test_mxfp4_export_loads_in_transformers(trained, tmp_path):
    out = tmp_path / "hf-mx"
    convert(str(trained / "iter_0000003"), out, to="hf", experts="mxfp4", dtype="float32")
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "mxfp4"
    reference = load_hf_reference(out)  # transformers dequantises the blocks with its own code
    ours = model_from_checkpoint(out).eval()  # and ours with gptoss_cli/model/mxfp4/codec.py
    with torch.no_grad():
        assert_logits_close(ours(ids()).logits, reference(ids()).logits)
    # The experts are the trained ones, rounded to MXFP4: e2m1 steps are at most 2 x the block's
    # power-of-two scale, which is at most amax/4 of its 32 values, so no value moves by more than amax/2.
    trained_fc2 = model_from_checkpoint(trained).decoder.layers[1].mlp.experts.linear_fc2.weight.detach()
    exported = reference.model.layers[0].mlp.experts.down_proj.detach()  # [E, I, H] in transformers' bf16 form
    exported = exported.transpose(1, 2)  # -> [E, H, I] like ours
    blocks = trained_fc2.reshape(*trained_fc2.shape[:-1], -1, 32)
    bound = blocks.abs().amax(-1, keepdim=True) / 2
    assert ((exported.reshape(blocks.shape) - blocks).abs() <= bound).all()


def _resave_at_ep1(folder: Path, ckpt_dir: Path) -> Path:
    """Load `folder` (saved at EP=2 by two processes) into one EP=1 process and save it again."""
    from gptoss_cli.parallel.state import init_parallel
    from gptoss_cli.train.checkpointing import load_checkpoint, save_checkpoint
    from gptoss_cli.train.provider import HybridModelProvider, ModelRuntimeConfig
    from gptoss_cli.train.setup import setup_model_and_optimizer

    job = tiny_plan(str(ckpt_dir.parent / "run1"), ep_size=1)
    state = init_parallel(1, "cpu")
    runtime = ModelRuntimeConfig.from_recipe(job.config, job.arch, job.pattern)
    setup = setup_model_and_optimizer(HybridModelProvider(runtime), state, job.config.optimizer, job.config.training.lr)
    meta = load_checkpoint(folder, model=setup.model.module, optimizer=setup.optimizer, state=state)
    keep = {k: v for k, v in meta.items() if k not in ("step", "world_size", "ep_size")}
    return save_checkpoint(ckpt_dir, step=meta["step"], model=setup.model.module, optimizer=setup.optimizer,
                           train_state=keep, state=state)


def test_checkpoints_saved_at_ep2_and_ep1_export_the_same_bytes(trained, tmp_path):
    ep1 = _resave_at_ep1(trained / "iter_0000002", tmp_path / "ckpt-ep1")
    assert json.loads((ep1 / TRAIN_STATE).read_text())["ep_size"] == 1
    for to, experts in (("hf", "mxfp4"), ("hybrid", None)):
        a, b = tmp_path / f"ep2-{to}", tmp_path / f"ep1-{to}"
        convert(str(trained / "iter_0000002"), a, to=to, experts=experts)
        # and in row ranges of 4 KiB: reads of rows [r0, r1) of a cached tensor give the same bytes
        convert(str(tmp_path / "ckpt-ep1"), b, to=to, experts=experts, chunk_bytes=4096)
        shards = sorted(p.name for p in a.glob("*.safetensors"))
        assert shards and shards == sorted(p.name for p in b.glob("*.safetensors"))
        for name in shards:
            assert (a / name).read_bytes() == (b / name).read_bytes(), (to, name)
        if to == "hf":
            assert (a / "config.json").read_bytes() == (b / "config.json").read_bytes()


def test_master_weights_are_the_optimizers_fp32_copies(trained, tmp_path):
    from safetensors.torch import load_file
    from torch.distributed.checkpoint import FileSystemReader
    import torch.distributed.checkpoint as dcp

    out = tmp_path / "master"
    convert(str(trained), out, weights="master", dtype="float32")
    exported = {k: v for f in sorted(out.glob("*.safetensors")) for k, v in load_file(f).items()}
    folder = trained / "iter_0000003"
    meta = FileSystemReader(str(folder)).read_metadata().state_dict_metadata  # DCP's own reading, as a reference
    want = {f"optimizer.{n}.master": torch.empty(exported[n].shape) for n in exported}
    dcp.load(want, checkpoint_id=str(folder))
    assert set(exported) == {k[len("model."):] for k in meta if k.startswith("model.")}
    for name, t in exported.items():
        assert torch.equal(t, want[f"optimizer.{name}.master"]), name


def test_conversion_asks_dcp_for_one_tensor_or_a_few_experts_of_one_stack_at_a_time(trained, tmp_path, monkeypatch):
    import torch.distributed.checkpoint as dcp

    calls: list[list[str]] = []
    real = dcp.load

    def spy(state_dict, **kwargs):
        calls.append(list(state_dict))
        return real(state_dict, **kwargs)

    monkeypatch.setattr(dcp, "load", spy)
    convert(str(trained), tmp_path / "hf", to="hf", experts="mxfp4")
    keys = [k for call in calls for k in call]
    assert all(k.startswith("model.") for k in keys)  # never the optimizer state or the RNG
    assert len(keys) == len(set(keys))  # every tensor read once
    for call in calls:
        stems = {k.rstrip("0123456789") for k in call}
        assert len(call) == 1 or (len(stems) == 1 and ".mlp.experts." in call[0]), call


def test_reader_fetches_experts_of_one_stack_ahead_within_its_budget(trained):
    from gptoss_cli.checkpoint.sources import open_source

    source = open_source(str(trained))
    reader = source.reader
    stack = [f"decoder.layers.1.mlp.experts.linear_fc1.weight{e}" for e in range(TINY.num_local_experts)]
    reader.budget_bytes = 2 * reader.spec(stack[0]).nbytes  # two experts per fetch
    got = [reader.read(name).clone() for name in stack]
    assert reader.loads == 2  # experts 0-1, then 2-3
    reader.read("decoder.final_norm.weight")
    assert reader.loads == 3
    want = model_from_checkpoint(trained).decoder.layers[1].mlp.experts.linear_fc1.weight
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    source.close()


def invoke(*args: object) -> tuple[int, str]:
    code, output = exit_and_output(*args)
    return code, " ".join(output.split())  # rich wraps long lines at the runner's 80 columns


@pytest.fixture
def copy_of(trained, tmp_path):
    def make(edit=None) -> Path:
        dst = tmp_path / "copy"
        shutil.copytree(trained, dst)
        if edit:
            edit(dst)
        return dst
    return make


def test_a_checkpoint_dir_without_latest_names_its_iter_folders(copy_of, tmp_path):
    src = copy_of(lambda d: (d / "latest").unlink())
    code, out = invoke("convert", src, tmp_path / "out", "--to", "hf")
    assert code == 2 and "has no `latest` pointer" in out and "iter_0000003" in out, out
    assert not (tmp_path / "out").exists()


def test_a_checkpoint_saved_before_runs_were_recorded_is_a_clear_error(copy_of, tmp_path):
    def drop_record(d: Path) -> None:
        path = d / "iter_0000003" / TRAIN_STATE
        state = json.loads(path.read_text())
        del state["run"]
        path.write_text(json.dumps(state))

    code, out = invoke("convert", copy_of(drop_record), tmp_path / "out")
    assert code == 2 and "records no model architecture" in out and "older gptoss" in out, out


def test_a_truncated_shard_is_one_line_naming_the_file(copy_of, tmp_path):
    def truncate(d: Path) -> None:
        shard = sorted((d / "iter_0000003").glob("*.distcp"))[-1]
        shard.write_bytes(shard.read_bytes()[:100])

    code, out = invoke("convert", copy_of(truncate), tmp_path / "out")
    assert code == 2 and ".distcp" in out and "truncated or incomplete" in out, out
    assert not (tmp_path / "out").exists()


def test_metadata_that_would_run_code_is_refused_unexecuted(copy_of, tmp_path):
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (Path.touch, (marker,))

    src = copy_of(lambda d: (d / "iter_0000003" / ".metadata").write_bytes(pickle.dumps(Payload())))
    code, out = invoke("convert", src, tmp_path / "out")
    assert code == 2 and "not readable DCP metadata" in out and "refusing to load pathlib" in out, out
    assert not marker.exists()


def test_resume_reads_metadata_through_the_allow_list_and_refuses_code_unexecuted(copy_of, tmp_path):
    """`gptoss train`'s resume reads the same .metadata pickle: it must not run it either (it is
    refused before any model state is touched, so no model is needed here)."""
    from gptoss_cli.train.checkpointing import load_checkpoint

    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (Path.touch, (marker,))

    src = copy_of(lambda d: (d / "iter_0000003" / ".metadata").write_bytes(pickle.dumps(Payload())))
    with pytest.raises(CheckpointError, match="not readable DCP metadata.*refusing to load pathlib"):
        load_checkpoint(src / "iter_0000003", model=None, optimizer=None, state=None)
    assert not marker.exists()


def test_loading_a_training_checkpoint_as_hf_is_a_checkpoint_error(trained):
    with pytest.raises(CheckpointError, match="is a training checkpoint, not a Hugging Face one"):
        load_hf(build_model(TINY), trained)


def test_dst_inside_the_checkpoint_dir_is_refused(trained, tmp_path):
    before = digest(trained)
    with pytest.raises(UsageError, match="lies inside the source"):
        convert(str(trained), trained / "export")
    assert digest(trained) == before


def test_training_checkpoint_to_megatron_and_back_is_the_direct_export(trained, tmp_path):
    """training -> Megatron torch_dist -> HF gives the bytes training -> HF gives; common.pt keeps the iteration."""
    from tests.checkpoint.test_convert_layout import load_all

    before = digest(trained)
    convert(str(trained), tmp_path / "mg", to="megatron", dtype="float32")
    common = torch.load(tmp_path / "mg" / "release" / "common.pt", weights_only=False)
    assert common["iteration"] == 3 and common["gptoss_provenance"]["run"] == "ckpt"
    convert(str(tmp_path / "mg"), tmp_path / "via", to="hf", dtype="float32")
    convert(str(trained), tmp_path / "direct", to="hf", dtype="float32")
    via, direct = load_all(tmp_path / "via"), load_all(tmp_path / "direct")
    assert sorted(via) == sorted(direct) and all(torch.equal(via[k], direct[k]) for k in via)
    assert digest(trained) == before


def _edit_metadata(folder: Path, edit) -> None:
    """Rewrite iter_0000003/.metadata with `edit(metadata)` applied (the test's own plain pickle)."""
    path = folder / "iter_0000003" / ".metadata"
    metadata = pickle.loads(path.read_bytes())
    edit(metadata)
    path.write_bytes(pickle.dumps(metadata))


def _set(obj, name, value) -> None:
    object.__setattr__(obj, name, value)  # some of DCP's metadata dataclasses are frozen


def _first_tensor(metadata):
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    return next((k, m) for k, m in metadata.state_dict_metadata.items() if isinstance(m, TensorStorageMetadata))


def _first_storage(metadata):
    return next(iter(metadata.storage_data.items()))


WRONG_TYPES = {  # allow-listed classes whose attributes hold the wrong types
    "size a string": (lambda m: _set(_first_tensor(m)[1], "size", "64x64"), "is not a shape"),
    "size negative": (lambda m: _set(_first_tensor(m)[1], "size", torch.Size([-4, 2])), "is not a shape"),
    "size huge": (lambda m: _set(_first_tensor(m)[1], "size", torch.Size([2**40, 2**40])), "does not fit"),
    "dtype a string": (lambda m: _set(_first_tensor(m)[1].properties, "dtype", "float32"), "name no dtype"),
    "chunks a dict": (lambda m: _set(_first_tensor(m)[1], "chunks", {}), "is not a list"),
    "chunk outside": (lambda m: _set(_first_tensor(m)[1].chunks[0], "offsets", torch.Size([10**6] * len(
        _first_tensor(m)[1].size))), "does not lie in"),
    "storage a list": (lambda m: _set(m, "storage_data", []), "storage_data is a list"),
    "file an int": (lambda m: _set(_first_storage(m)[1], "relative_path", 7), "is not a file name inside"),
    "file outside": (lambda m: _set(_first_storage(m)[1], "relative_path", "../../etc/passwd"),
                     "is not a file name inside"),
    "offset a string": (lambda m: _set(_first_storage(m)[1], "offset", "0"), "offset '0' is not a byte count"),
    "length a float": (lambda m: _set(_first_storage(m)[1], "length", 1.5), "length 1.5 is not a byte count"),
    "fqn an int": (lambda m: _set(_first_storage(m)[0], "fqn", 3), "not a tensor index"),
    "key an int": (lambda m: m.state_dict_metadata.__setitem__(5, _first_tensor(m)[1]), "key 5 is not a name"),
}


@pytest.mark.parametrize("case", sorted(WRONG_TYPES))
def test_allow_listed_metadata_with_wrong_attribute_types_is_one_line(copy_of, tmp_path, case):
    """Only DCP's classes unpickle, but their fields can hold anything: each case is one line naming
    .metadata and what is wrong, exit 2, for convert and for resume (both read through read_metadata)."""
    from gptoss_cli.train.checkpointing import load_checkpoint

    edit, words = WRONG_TYPES[case]
    src = copy_of(lambda d: _edit_metadata(d, edit))
    code, out = invoke("convert", src, tmp_path / "out", "--to", "hf")
    assert code == 2 and ".metadata: not readable DCP metadata" in out and words in out, out
    assert "Traceback" not in out and not (tmp_path / "out").exists()
    with pytest.raises(CheckpointError, match=words.replace("(", r"\(")):
        load_checkpoint(src / "iter_0000003", model=None, optimizer=None, state=None)
