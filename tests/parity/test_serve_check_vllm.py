"""serve-check against vLLM itself (its CPU build, in its own venv): checkpoints of every kind pass in fp32
on a prompt longer than the sliding window with greedy tokens agreeing, bf16 passes within the error
model, and the negative controls fail naming the first divergent token.

vLLM is the independent reference here: its GPT-OSS model, weight loader, attention with sinks and
MoE kernels are its own. One engine process serves every check of the module (vLLM is imported once);
each check loads its model into it. The --endpoint check talks to `vllm serve` on a loopback port.
All tests share one xdist group, so they run in one worker.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from gptoss_cli.checkpoint.convert import convert
from gptoss_cli.checkpoint.load import checkpoint_architecture
from gptoss_cli.parity.serve.check import ServeCheckOptions, serve_check
from gptoss_cli.parity.serve.export import MERGED_PEFT
from tests.parity.vllm_fixtures import WINDOW, VllmServer, engine_python, write_hf

pytestmark = pytest.mark.xdist_group("vllm")
ALL = ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]


@pytest.fixture(scope="module")
def python():
    return engine_python()


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("serve-check")


@pytest.fixture(scope="module")
def hf(root):
    return write_hf(root / "hf", seed=3)


@pytest.fixture(scope="module")
def server(python, hf, root):
    """Started before the engine so that it boots while the offline checks run."""
    srv = VllmServer(python, hf, root / "vllm-serve.log")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def engine(python, server):
    from gptoss_cli.generate.engines.vllm_offline import VllmEngine

    eng = VllmEngine(python)
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def hybrid(hf, root):
    convert(str(hf), root / "hybrid", dtype="float32")
    return root / "hybrid"


def _train(root: Path, hybrid: Path, name: str, **changes) -> Path:
    from gptoss_cli.run.worker import run_worker
    from tests.train.jobs import train_job

    arch, _ = checkpoint_architecture(hybrid)
    run = root / name
    job = train_job(run / "run", arch=arch, pretrained=str(hybrid), seq_length=2 * WINDOW, global_batch_size=2,
                    micro_batch_size=1, train_iters=2, lr=1e-2, checkpoint_dir=str(run / "ckpt"),
                    use_distributed_optimizer=False, **changes)
    run_worker(job)
    return run / "ckpt"


@pytest.fixture(scope="module")
def full_run(root, hybrid):
    return _train(root, hybrid, "full")


@pytest.fixture(scope="module")
def lora_run(root, hybrid):
    return _train(root, hybrid, "lora", lora_rank=4, lora_alpha=8.0, lora_targets=list(ALL))


def check(checkpoint, engine, **options):
    return serve_check(str(checkpoint), ServeCheckOptions(**options), engine=engine)


def assert_passes(report):
    assert report.verdict == "pass", (report.failure_line(), report.to_json())
    for p in report.prompts:
        assert p.max_abs_logprob_diff <= p.budget
        assert p.greedy_match_tokens == p.greedy_tokens == 8
    assert report.prompts[0].prompt_tokens > 2 * WINDOW  # past the sliding window


def assert_fails_at_a_named_token(report):
    assert report.verdict == "fail"
    line = report.failure_line()
    first = report.overall()["first_divergent_position"]
    assert first is not None and f"token {first['position']} " in line, line
    return first["position"]


def test_an_hf_checkpoint_serves_what_gptoss_computes_in_fp32(hf, engine):
    report = check(hf, engine)
    assert_passes(report)
    assert report.engine["name"] == "vllm" and report.engine["kernels"].get("moe")
    assert report.overall()["max_abs_logprob_diff"] < 1e-4  # the fp32 figure
    assert report.findings == []


def test_a_full_fine_tune_and_a_megatron_checkpoint_pass(full_run, hf, root, engine):
    assert_passes(check(full_run, engine))
    convert(str(hf), root / "megatron", to="megatron", dtype="float32")
    report = check(root / "megatron", engine)
    assert report.kind == "megatron"
    assert_passes(report)


def test_a_lora_run_passes_through_peffs_merge_of_its_exported_adapter(lora_run, engine):
    report = check(lora_run, engine)
    assert_passes(report)
    assert report.served["form"] == MERGED_PEFT
    assert [f.name for f in report.findings] == ["lora_experts"]  # vLLM's CPU build has no expert LoRA


def test_bf16_stays_within_the_error_model(hf, engine):
    report = check(hf, engine, dtype="bfloat16")
    assert report.verdict == "pass", report.failure_line()
    # the budget is the model's, not a number tuned on this run: fp32's would be far tighter
    assert min(p.budget for p in report.prompts) > 1e-2


def test_sinks_zeroed_in_the_export_fail_at_a_named_token(hf, root, engine):
    from safetensors.torch import load_file, save_file

    bad = root / "no-sinks"
    shutil.copytree(hf, bad)
    for shard in bad.glob("*.safetensors"):
        tensors = load_file(str(shard))
        save_file({k: torch.zeros_like(v) if k.endswith(".sinks") else v for k, v in tensors.items()}, str(shard),
                  metadata={"format": "pt"})
    assert_fails_at_a_named_token(check(hf, engine, export=str(bad)))


def test_an_adapter_with_gate_and_up_not_interleaved_fails(lora_run, root, engine):
    from safetensors.torch import load_file, save_file

    adapter = root / "adapter-bad"
    convert(str(lora_run), adapter, to="peft")
    file = adapter / "adapter_model.safetensors"
    tensors = load_file(str(file))
    key = next(k for k in tensors if k.endswith("mlp.experts.base_layer.lora_B.weight"))  # gate_up_proj's B
    for k in [k for k in tensors if k.endswith("mlp.experts.base_layer.lora_B.weight")]:
        b = tensors[k]
        tensors[k] = torch.cat([b[0::2], b[1::2]]).contiguous()  # [gate; up] rows, as ours are stored
    save_file(tensors, str(file), metadata={"format": "pt"})
    assert key
    assert_fails_at_a_named_token(check(lora_run, engine, export=str(adapter)))


def test_layer_types_that_do_not_alternate_are_a_named_finding_and_fail(root, engine):
    hf = write_hf(root / "hf-layer-types", seed=4, layer_types=["full_attention", "sliding_attention",
                                                                "sliding_attention"])
    report = check(hf, engine)
    assert "layer_types" in [f.name for f in report.findings]
    assert_fails_at_a_named_token(report)


def test_the_endpoint_of_a_running_vllm_server_passes(hf, server):
    url = server.wait()
    report = serve_check(str(hf), ServeCheckOptions(endpoint=url))
    assert_passes(report)
    assert report.engine["url"] == url and report.engine["name"] == "vllm"


def test_mxfp4_on_this_cpu_checks_the_dequantised_layout_and_says_so(hybrid, engine):
    report = check(hybrid, engine, experts="mxfp4")
    assert report.verdict == "pass", report.failure_line()
    assert [f.name for f in report.findings] == ["mxfp4_kernel"]
    assert json.dumps(report.to_json())  # the JSON report serialises


def test_train_checks_its_final_checkpoint_and_writes_the_proof_into_the_run(hybrid, root, engine, python,
                                                                              monkeypatch):
    """`serve_check.engine=vllm`: after the last save, train runs the check and writes serve_check.json
    (the module's engine process stands in for a fresh one, so vLLM is not imported again)."""
    from typer.testing import CliRunner

    from gptoss_cli.cli import app
    from gptoss_cli.parity.serve import check as serve

    real = serve.serve_check
    monkeypatch.setattr(serve, "serve_check", lambda ckpt, options, **kw: real(ckpt, options, engine=engine))
    run = root / "train-hook"
    args = ["train", "--recipe", "tiny_cpu_ep2", "--nproc-per-node", "1", "--quiet",
            "parallelism.world_size=1", "parallelism.expert_model_parallel_size=1", "precision.params_dtype=fp32",
            f"model.checkpoint={hybrid}", "model.preset=null", f"checkpoint.pretrained={hybrid}",
            "training.train_iters=1", "training.warmup_iters=0", "training.seq_length=16", "training.global_batch_size=2",
            "training.micro_batch_size=2", "checkpoint.save_interval=null",
            f"checkpoint.dir={run / 'ckpt'}", f"logging.run_dir={run / 'run'}",
            "serve_check.engine=vllm", f"serve_check.engine_python={python}"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    proof = json.loads((run / "run" / "serve_check.json").read_text())
    assert proof["verdict"] == "pass" and proof["kind"] == "training"
    assert proof["max_abs_logprob_diff"] < 1e-4
