"""`convert --to gguf`: the file llama.cpp reads holds the source's values, in the types asked, under the names and
keys llama.cpp's gpt-oss loader reads; bad destinations are one line and leave nothing.

The GGUF is read back with the gguf package's own reader and dequantisers (llama.cpp's Python side), the source
with safetensors; the metadata is compared with what llama.cpp's own converter (convert_hf_to_gguf.py, from the
llama.cpp source that $GPTOSS_LLAMACPP_SRC names: .ci/run unpacks llama-cpp-python's sdist) writes from the same
HF checkpoint.
"""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from safetensors.torch import load_file  # noqa: E402

from gptoss_cli.checkpoint.convert import convert  # noqa: E402
from gptoss_cli.checkpoint.make_tiny import make_tiny  # noqa: E402
from gptoss_cli.model.mxfp4 import codec as mxfp4  # noqa: E402
from tests.support.cli import run_cli  # noqa: E402

LLAMACPP_SRC_ENV = "GPTOSS_LLAMACPP_SRC"
IGNORED_KEYS = {"general.name", "GGUF.kv_count", "gptoss.provenance", "gptoss.architecture"}


@pytest.fixture(scope="module")
def tiny_mx(tmp_path_factory) -> Path:
    """make-tiny's HF checkpoint: MXFP4 experts as released, bf16 tensors, its small harmony tokenizer."""
    dst = tmp_path_factory.mktemp("gguf-src") / "tiny"
    make_tiny(dst, experts="mxfp4", seed=3)
    return dst


def read(path: Path) -> dict:
    return {t.name: t for t in gguf.GGUFReader(str(path)).tensors}


def values(t) -> torch.Tensor:
    """A GGUF tensor dequantised by the gguf package, in numpy order [..., in]."""
    shape = [int(d) for d in reversed(t.shape)]
    return torch.from_numpy(np.array(gguf.quants.dequantize(np.asarray(t.data), t.tensor_type))).reshape(shape)


def source_tensors(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def test_every_tensor_holds_the_sources_values_and_mxfp4_bytes_pass_through(tiny_mx, tmp_path):
    """f32: every tensor equals the source's (bf16 values, exact); the MXFP4 experts' gate (even rows of
    gate_up) and up (odd rows) and down dequantise, by the gguf package, to the source's blocks decoded."""
    out = tmp_path / "m.gguf"
    convert(str(tiny_mx), out, to="gguf", dtype="f32")
    got, src = read(out), source_tensors(tiny_mx)
    for i in range(3):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        for hf_name, name in (("self_attn.q_proj.weight", "attn_q.weight"), ("self_attn.o_proj.weight", "attn_output.weight"),
                              ("self_attn.sinks", "attn_sinks.weight"), ("mlp.router.weight", "ffn_gate_inp.weight"),
                              ("post_attention_layernorm.weight", "post_attention_norm.weight")):
            assert torch.equal(values(got[b + name]), src[p + hf_name].float()), name
        assert got[b + "ffn_gate_exps.weight"].tensor_type.name == "MXFP4"
        for stack, parts in (("gate_up_proj", {"gate": slice(0, None, 2), "up": slice(1, None, 2)}),
                             ("down_proj", {"down": slice(None)})):
            decoded = mxfp4.decode(src[p + f"mlp.experts.{stack}_blocks"], src[p + f"mlp.experts.{stack}_scales"],
                                   torch.float32)
            for part, rows in parts.items():
                assert torch.equal(values(got[b + f"ffn_{part}_exps.weight"]), decoded[:, rows]), (i, part)
        bias = src[p + "mlp.experts.gate_up_proj_bias"].float()
        assert torch.equal(values(got[b + "ffn_gate_exps.bias"]), bias[:, 0::2])
        assert torch.equal(values(got[b + "ffn_up_exps.bias"]), bias[:, 1::2])
    assert torch.equal(values(got["token_embd.weight"]), src["model.embed_tokens.weight"].float())
    assert torch.equal(values(got["output.weight"]), src["lm_head.weight"].float())


@pytest.mark.parametrize("dtype", ["bf16", "f16", "q8_0"])
def test_each_dtype_rounds_as_its_type_says(tiny_mx, tmp_path, dtype):
    """bf16 and f16 hold the (bf16) source exactly; Q8_0 within half a quantum d = max|x|/127 of every value, plus
    127 times the rounding of d to f16 (2**-11 d: q is at most 127); norms, biases, sinks and the router stay F32, as llama.cpp's converter keeps them."""
    out = tmp_path / "m.gguf"
    convert(str(tiny_mx), out, to="gguf", dtype=dtype)
    got, src = read(out), source_tensors(tiny_mx)
    want = src["model.layers.1.self_attn.k_proj.weight"].float()
    have = values(got["blk.1.attn_k.weight"])
    assert got["blk.1.attn_k.weight"].tensor_type.name == dtype.upper()
    if dtype == "q8_0":
        quantum = want.reshape(want.shape[0], -1, 32).abs().amax(-1, keepdim=True) / 127
        err = (have - want).reshape(quantum.shape[0], -1, 32).abs()
        assert bool((err <= quantum * (0.5 + 127 * 2.0**-11)).all()) and float(err.max()) > 0
    else:
        assert torch.equal(have, want)
    for name in ("blk.1.attn_norm.weight", "blk.1.ffn_gate_inp.weight", "blk.1.attn_sinks.weight", "blk.1.attn_k.bias"):
        assert got[name].tensor_type.name == "F32", name


def test_hybrid_and_training_sources_write_the_same_file_as_their_hf_source(tiny_mx, tmp_path):
    """A Hybrid-named source goes through the mapping table (fused QKV split, experts re-interleaved): the same
    bytes as the HF source's export, and its experts re-encoded to MXFP4 give the released bytes back."""
    hybrid = tmp_path / "hybrid"
    convert(str(tiny_mx), hybrid, dtype="float32")
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    convert(str(tiny_mx), a, to="gguf", dtype="f32")
    result = convert(str(hybrid), b, to="gguf", dtype="f32")
    assert result.export_cost is None  # an exact round trip costs nothing
    ta, tb = read(a), read(b)
    assert list(ta) == list(tb)
    for name in ta:
        assert np.array_equal(np.asarray(ta[name].data), np.asarray(tb[name].data)), name


def test_metadata_llamacpp_reads_equals_what_its_own_converter_writes(tmp_path):
    """Every key llama.cpp's converter writes from the same HF checkpoint (real o200k tokenizer, head_dim 64),
    with the same value and type, and every tensor with the same name, type, shape and bytes (f32, MXFP4)."""
    src_dir = os.environ.get(LLAMACPP_SRC_ENV)
    if not src_dir or not (Path(src_dir) / "convert_hf_to_gguf.py").is_file():
        pytest.skip(f"${LLAMACPP_SRC_ENV} names no llama.cpp source with convert_hf_to_gguf.py (.ci/run unpacks it)")
    from tests.checkpoint.gguf_fixtures import real_vocab_tiny

    hf = real_vocab_tiny(tmp_path / "hf")
    ours, theirs = tmp_path / "ours.gguf", tmp_path / "theirs.gguf"
    convert(str(hf), ours, to="gguf", dtype="f32")
    proc = subprocess.run([sys.executable, str(Path(src_dir) / "convert_hf_to_gguf.py"), str(hf), "--outfile",
                           str(theirs), "--outtype", "f32"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ra, rb = gguf.GGUFReader(str(ours)), gguf.GGUFReader(str(theirs))
    keys = (set(ra.fields) | set(rb.fields)) - IGNORED_KEYS
    for key in sorted(keys):
        fa, fb = ra.fields.get(key), rb.fields.get(key)
        assert fa is not None and fb is not None, (key, fa is None)
        assert fa.types == fb.types and fa.contents() == fb.contents(), key
    ta, tb = {t.name: t for t in ra.tensors}, {t.name: t for t in rb.tensors}
    assert set(ta) == set(tb)
    for name in ta:
        x, y = ta[name], tb[name]
        assert (x.tensor_type, list(x.shape)) == (y.tensor_type, list(y.shape)), name
        assert np.array_equal(np.asarray(x.data), np.asarray(y.data)), name


# --- bad input ------------------------------------------------------------------------------------
def _one_line_failure(result, *needles):
    out = result.output
    assert result.exit_code == 2, out
    assert "Traceback" not in out and len([ln for ln in out.splitlines() if ln.strip()]) == 1, out
    for needle in needles:
        assert needle in out, (needle, out)


def test_a_destination_without_gguf_is_refused_and_nothing_is_written(tiny_mx, tmp_path):
    r = run_cli("convert", tiny_mx, tmp_path / "model.bin", "--to", "gguf", "--quiet")
    _one_line_failure(r, "ends in .gguf")
    assert list(tmp_path.iterdir()) == []


def test_an_existing_file_is_kept_without_force_and_replaced_only_if_gptoss_wrote_it(tiny_mx, tmp_path):
    dst = tmp_path / "m.gguf"
    dst.write_bytes(b"somebody's file")
    _one_line_failure(run_cli("convert", tiny_mx, dst, "--quiet"), "--force")
    _one_line_failure(run_cli("convert", tiny_mx, dst, "--quiet", "--force"), "replaces only a GGUF file gptoss wrote")
    assert dst.read_bytes() == b"somebody's file"
    dst.unlink()
    assert run_cli("convert", tiny_mx, dst, "--quiet", "--dtype", "f32").exit_code == 0  # DST.gguf names the format
    assert run_cli("convert", tiny_mx, dst, "--quiet", "--force").exit_code == 0
    assert read(dst)["blk.0.attn_q.weight"].tensor_type.name == "BF16"


def test_a_full_disk_leaves_no_file_and_no_partial_folder(tiny_mx, tmp_path, monkeypatch):
    from gptoss_cli.checkpoint.formats.gguf import writer

    class FullDisk:
        def __init__(self, fh):
            self.fh, self.calls = fh, 0

        def write(self, data):
            self.calls += 1
            if self.calls > 3:
                raise OSError(errno.ENOSPC, "No space left on device")
            return self.fh.write(data)

        def __getattr__(self, name):
            return getattr(self.fh, name)

    start = writer.GgufWriter.start

    def full_start(self):
        start(self)
        self._fh = FullDisk(self._fh)

    monkeypatch.setattr(writer.GgufWriter, "start", full_start)
    dst = tmp_path / "m.gguf"
    _one_line_failure(run_cli("convert", tiny_mx, dst, "--quiet"), "No space left on device", "nothing was changed")
    assert list(tmp_path.iterdir()) == []


def test_options_the_gguf_writer_does_not_take_are_one_line(tiny_mx, tmp_path):
    _one_line_failure(run_cli("convert", tiny_mx, tmp_path / "m.gguf", "--dtype", "fp8"), "--dtype 'fp8'")
    _one_line_failure(run_cli("convert", tiny_mx, tmp_path / "m.gguf", "--experts", "bf16"), "mxfp4 or same")
    assert list(tmp_path.iterdir()) == []
