"""The pipeline-parallel training runs the tests judge: one launch per world size, many configurations each.

Every configuration is `gptoss train`'s real loop (`run_worker`) from the transformers-made fixture
of tests/train/reference.py (fp32, a token file holding one global batch, constant lr, weight decay
1.0, clip 1.1 engaged), with the optimizer spy of that module recording, per step, the weights before,
the finalised gradients and the weights after, on every rank (each pipeline rank records its own
stages' tensors; merged over the ranks they cover the model once). A worker loops over the
configurations of its world size inside ONE process-group launch (`train_configs`): on 2 cores the
launches, not the steps, are what costs.

The tiny fixture has 3 decoder blocks, so the layouts use Megatron's grammar to place them
(`E|t|t|tL` at PP = 4: the first stage holds the embedding alone, the last a block and the head;
8 stages hold empty ones, which the grammar allows). With EP = 2 every stage has DP = 2 (the two EP
ranks read different microbatches); a global batch of 8 or 16 repeats the file's 4 samples (2 or 4
epochs per step), which leaves the mean loss and its gradients those of the 4-sample batch.

Mutations (`MUTATIONS`) re-run a configuration with one finalisation rule broken, to show that the
checks catch it: the clip norm computed per stage, the token division per stage, a stage's router
losses left out of the accumulator.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from tests.train import reference as R

# name -> (world, train-job fields beyond COMMON, mutation or None)
CONFIGS: dict[str, tuple[int, dict[str, Any], str | None]] = {}


def _add(name: str, world: int, mutation: str | None = None, **fields: Any) -> None:
    CONFIGS[name] = (world, fields, mutation)


PP2 = "Et*2|tL"  # 3 blocks on 2 stages
PP2V = "Et|t|t|L"  # 4 stages (VPP = 2)
PP4 = "E|t|t|tL"
PP4V = "E|t|t|t||||L"  # 8 stages (VPP = 2)
SCHEDULES = {  # name -> (pipeline_schedule, vpp, layout at PP=2, layout at PP=4)
    "1f1b": ("1f1b", None, PP2, PP4),
    "i1f1b": ("interleaved_1f1b", 2, PP2V, PP4V),
    "zb1p": ("interleaved_zero_bubble", None, PP2, PP4),
    "zbv": ("zbv_zero_bubble", 2, PP2V, PP4V),
    "dualpipev": ("dualpipev", 2, PP2V, PP4V),
}

# PP = 1 baselines (gptoss's own layouts the PP runs must equal), in the world-2 launch
_add("pp1", 2)
_add("pp1-ep2", 2, ep_size=2)
_add("pp1-aux", 2, aux_loss_coeff=0.01, z_loss_coeff=0.001)
for short, (schedule, vpp, lay2, lay4) in SCHEDULES.items():
    common = dict(pipeline_schedule=schedule, vpp_size=vpp)
    # DualPipeV needs 2 x PP microbatches per data-parallel rank: repeat the 4 samples
    _add(f"pp2-{short}", 2, pp_size=2, pipeline_layout=lay2, **common)
    _add(f"pp2xep2-{short}", 4, pp_size=2, ep_size=2, pipeline_layout=lay2, global_batch_size=8, **common)
    _add(f"pp4-{short}", 4, pp_size=4, pipeline_layout=lay4, global_batch_size=8 if short == "dualpipev" else 4,
         **common)
    _add(f"pp4xep2-{short}", 8, pp_size=4, ep_size=2, pipeline_layout=lay4,
         global_batch_size=16 if short == "dualpipev" else 8, **common)
# the router losses across stages (against pp1-aux), packed into the world-2 launch
_add("pp2-aux", 2, pp_size=2, pipeline_layout=PP2, aux_loss_coeff=0.01, z_loss_coeff=0.001)
_add("pp2-aux-zbv", 2, pp_size=2, vpp_size=2, pipeline_schedule="zbv_zero_bubble", pipeline_layout=PP2V,
     aux_loss_coeff=0.01, z_loss_coeff=0.001)
# EP all-to-all overlap in DualPipeV's overlapped forward-backward, with delayed expert wgrad
OVERLAP = dict(pipeline_schedule="dualpipev", vpp_size=2, overlap_moe_expert_parallel_comm=True,
               delay_wgrad_compute=True)
_add("pp2xep2-overlap", 4, pp_size=2, ep_size=2, pipeline_layout=PP2V, global_batch_size=8, **OVERLAP)
_add("pp2xep2-overlap-aux", 4, pp_size=2, ep_size=2, pipeline_layout=PP2V, global_batch_size=8,
     aux_loss_coeff=0.01, z_loss_coeff=0.001, **OVERLAP)
_add("pp4xep2-overlap", 8, pp_size=4, ep_size=2, pipeline_layout=PP4V, global_batch_size=16, **OVERLAP)
# context parallel inside the stages
_add("pp2xcp2", 4, pp_size=2, cp_size=2, pipeline_layout=PP2)
# an objective of one's own whose prepare_step scores the microbatches forward-only (GRPO's shape,
# tests/train/test_objective.py): at the old policy its gradient is cross-entropy's
_add("pp2-objective", 2, pp_size=2, pipeline_layout=PP2, objective="clipped_ratio")
# features under PP, each against itself at PP = 1 in the same launch (FEATURES): LoRA on the frozen
# fixture, MXFP4 QAT, emulated MXFP8, full recompute in units of 3 layers (cut at the stage boundary
# after layer 4), packed documents with per-document attention (a version-2 token file)
FEATURES = {
    "lora": dict(lora_rank=4, lora_alpha=8.0, lora_targets=["linear_qkv", "linear_fc1"]),
    "qat": dict(qat="mxfp4"),
    "fp8": dict(fp8_recipe="mxfp8", fp8_emulation=True),
    "recompute": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=3),
    "packed": dict(data="packed"),
}
for feature, changes in FEATURES.items():
    _add(f"feat-{feature}-pp1", 2, **changes)
    _add(f"feat-{feature}-pp2", 2, pp_size=2, pipeline_layout=PP2, **changes)
# mutations: each finalisation rule broken once
MUTATIONS = ("stage_clip_norm", "stage_token_division", "stage_router_loss_left_out")
_add("mut-stage_clip_norm", 2, "stage_clip_norm", pp_size=2, pipeline_layout=PP2)
_add("mut-stage_token_division", 2, "stage_token_division", pp_size=2, pipeline_layout=PP2)
_add("mut-stage_router_loss_left_out", 2, "stage_router_loss_left_out", pp_size=2, pipeline_layout=PP2,
     aux_loss_coeff=0.01, z_loss_coeff=0.001)
# checkpoints: a PP run and a PP = 1 run converted to HF (2 steps, no clip: bitwise-equal weights)
_add("ckpt-pp1-ep2", 2, ep_size=2, train_iters=2, clip_grad=0.0, checkpoint_dir="ckpt-pp1-ep2")
_add("ckpt-pp2xep2", 4, pp_size=2, ep_size=2, pipeline_layout=PP2, train_iters=2, clip_grad=0.0,
     checkpoint_dir="ckpt-pp2xep2")
# resume: one step and a checkpoint, then one more step from it, against two steps in one go
_add("resume-a", 2, pp_size=2, pipeline_layout=PP2, train_iters=1, checkpoint_dir="resume")
_add("resume-b", 2, pp_size=2, pipeline_layout=PP2, train_iters=2, checkpoint_dir="resume")
_add("resume-full", 2, pp_size=2, pipeline_layout=PP2, train_iters=2)
# the step-1 checkpoint of resume-a resumed at PP = 4 (DCP reshards every tensor by name)
_add("resume-pp4", 4, pp_size=4, pipeline_layout=PP4, train_iters=2, checkpoint_dir="resume-at-pp4")


def write_packed(prefix: Path) -> None:
    """A version-2 token file: documents of 3 to 13 tokens with loss masks, packed into rows of R.SEQ."""
    from tests.train.sft_files import sft_documents, write_sft_file

    lengths = [5, 9, 3, 12, 7, 4, 10, 6, 8, 11, 13, 5, 6, 9, 4, 7]
    docs, masks = sft_documents(lengths, R.TINY.vocab_size, seed=5)
    write_sft_file(prefix, docs, masks, R.TINY.vocab_size)


def job(name: str, run_dir: Path, hf: Path, prefix: Path, fields: dict[str, Any] | None = None):
    """The train job of configuration `name` (its CONFIGS fields, or `fields` for one not in CONFIGS)."""
    from tests.train.jobs import train_job

    fields = dict(CONFIGS[name][1] if fields is None else fields)
    ckpt = fields.pop("checkpoint_dir", None)
    objective = fields.pop("objective", None)
    if fields.pop("data", None) == "packed":
        prefix = prefix.parent / "packed"
    base = dict(device="cpu", params_dtype="fp32", aux_loss_coeff=0.0, seq_length=R.SEQ, micro_batch_size=1,
                global_batch_size=R.GLOBAL_BATCH, train_iters=1, lr=R.LR, min_lr=R.LR, warmup_iters=0,
                lr_decay_style="constant", weight_decay=R.WEIGHT_DECAY, adam_beta1=R.BETAS[0], adam_beta2=R.BETAS[1],
                adam_eps=R.EPS, clip_grad=R.CLIP, use_distributed_optimizer=True, data_kind="tokens",
                data_path=str(prefix), pretrained=str(hf),
                checkpoint_dir=str(run_dir.parent.parent / "checkpoints" / ckpt) if ckpt else None)
    plan = train_job(run_dir, name=f"pp-{name}", **{**base, **fields})
    if objective == "clipped_ratio":
        from tests.train.test_objective import ClippedRatioObjective

        plan = dataclasses.replace(plan, objective=ClippedRatioObjective())
    return plan


@contextlib.contextmanager
def mutated(mutation: str | None):
    """One finalisation rule broken (see the module docstring); nothing when `mutation` is None."""
    if mutation is None:
        yield
        return
    import torch.distributed as dist

    from gptoss_cli.parallel import grads as grads_module
    from gptoss_cli.schedule.pipeline import stage as stage_module
    from gptoss_cli.train import optimizer as optimizer_module

    def per_stage(real):
        # the world group swapped for this stage's data-parallel group: a sum over one stage
        def reduce(tensor, group, op=None):
            if group is dist.group.WORLD:
                group = _STAGE_GROUP[0]
            return real(tensor, group, op)
        return reduce

    if mutation == "stage_clip_norm":
        target, attr = optimizer_module, "all_reduce"
        patched = per_stage(optimizer_module.all_reduce)
    elif mutation == "stage_token_division":
        target, attr = grads_module, "all_reduce"
        patched = per_stage(grads_module.all_reduce)
    else:
        real_terms = stage_module.router_terms
        target, attr = stage_module, "router_terms"

        def patched(stats, num_experts, device):  # stage 0 (rank 0 at PP = 2) adds nothing
            terms = real_terms(stats, num_experts, device)
            return terms * 0 if dist.get_rank() == 0 else terms
    real = getattr(target, attr)
    setattr(target, attr, patched)
    try:
        yield
    finally:
        setattr(target, attr, real)


_STAGE_GROUP: list[Any] = [None]


def recording_steps(records: list[dict[str, Any]]):
    """tests/train/reference.py's optimizer spy, the gradients of trained tensors only (a LoRA run's frozen
    base has no gradient buffer)."""
    from tests.train.dist_helpers import reduced_main_grads
    from tests.train.reference import recording_optimizer_steps

    def grads(module, buffers) -> dict[str, torch.Tensor]:
        by_id = reduced_main_grads(buffers)
        out = {}
        for name, param in module.named_parameters():
            if id(param) in by_id:
                out.update(_per_checkpoint_name(module, name, by_id[id(param)]))
        return out

    return recording_optimizer_steps(records, grads)


def _per_checkpoint_name(module, name: str, grad: torch.Tensor) -> dict[str, torch.Tensor]:
    """A parameter's gradient under its checkpoint name(s): a stacked expert parameter per global expert id."""
    from gptoss_cli.model.expert_names import PerExpertParams

    owner_name = name.rpartition(".")[0]
    owner = module.get_submodule(owner_name) if owner_name else module
    if not isinstance(owner, PerExpertParams):
        return {name: grad.clone()}
    return {key: grad[i].clone() for i, key in enumerate(owner.expert_names(name))}


def _remember_stage_group():
    """Record the stage's data-parallel group when the state is built (for the per-stage mutations)."""
    from gptoss_cli.parallel import state as state_module

    real = state_module.state_from_world

    def spy(*args, **kwargs):
        st = real(*args, **kwargs)
        _STAGE_GROUP[0] = st.dp_group
        return st

    return state_module, real, spy


def train_configs(rank: int, plans: list[tuple[Any, str | None]]) -> list[list[dict[str, Any]]]:
    """run_worker for each (job, mutation) in turn, in one gloo group; this rank's step records per job."""
    from gptoss_cli.schedule.pipeline.plan_stage import OVERLAPPED
    from gptoss_cli.run.worker import run_worker

    module, real, spy = _remember_stage_group()
    module.state_from_world = spy
    out = []
    try:
        for plan, mutation in plans:
            records: list[dict[str, Any]] = []
            before, cpu = OVERLAPPED["pairs"], time.process_time()
            with recording_steps(records), mutated(mutation):
                run_worker(plan)
            records[-1]["overlapped"] = OVERLAPPED["pairs"] - before  # DualPipeV's overlapped F-B actions run here
            records[-1]["cpu_s"] = time.process_time() - cpu  # this rank's CPU time (the tests' cost, load-free)
            out.append(records)
        out[-1][-1]["launch_cpu_s"] = time.process_time()  # this rank's CPU time since it started (imports too)
    finally:
        module.state_from_world = real
    return out


def run_world(folder: Path, world: int, names: list[str], hf: Path, prefix: Path) -> dict[str, dict[str, Any]]:
    from tests.train.dist_helpers import run_distributed

    plans = [(job(name, folder / "runs" / name, hf, prefix), CONFIGS[name][2]) for name in names]
    preload = ("tests.schedule.pipeline.runs", "gptoss_cli.train.loop", "gptoss_cli.schedule.pipeline.schedule")
    per_rank = run_distributed(train_configs, world, folder / f"ranks{world}", plans, timeout=900.0, preload=preload)
    out = {}
    for i, name in enumerate(names):
        rows = [json.loads(line) for line in (folder / "runs" / name / "metrics.jsonl").read_text().splitlines()]
        out[name] = {"ranks": [r[i] for r in per_rank], "metrics": rows, "world": world}
    return out


def compute(folder: Path) -> dict[str, Any]:
    """Every configuration, launch by launch (world 2, 4, 8), then the reference per configuration."""
    folder = Path(folder)
    hf, prefix = R.write_fixture(folder / "fixture")
    write_packed(prefix.parent / "packed")
    runs: dict[str, dict[str, Any]] = {}
    seconds: dict[int, float] = {}  # wall time of each launch (the tests' cost, docs/pipeline-parallel.md)
    for world in (2, 4, 8):
        names = [n for n, (w, _, _) in CONFIGS.items() if w == world]
        if not names:
            continue
        if "resume-pp4" in names:  # resume-pp4 starts from resume-a's step-1 checkpoint (resume-b moved `latest` on)
            src, dst = folder / "checkpoints" / "resume", folder / "checkpoints" / "resume-at-pp4"
            shutil.copytree(src / "iter_0000001", dst / "iter_0000001")
            (dst / "latest").write_text("iter_0000001\n")
        started = time.perf_counter()
        runs.update(run_world(folder, world, names, hf, prefix))
        seconds[world] = time.perf_counter() - started
    reference = Reference(hf, prefix)
    result = {}
    for name, run in runs.items():
        fields = CONFIGS[name][1]
        entry = {"world": run["world"], "metrics": run["metrics"],
                 "grads": R.merge_ranks(run["ranks"], "grads", 0)[0],
                 "grads_steps": [R.merge_ranks(run["ranks"], "grads", t)[0] for t in range(len(run["ranks"][0]))],
                 "before": [R.merge_ranks(run["ranks"], "before", t)[0] for t in range(len(run["ranks"][0]))],
                 "after": [R.merge_ranks(run["ranks"], "after", t)[0] for t in range(len(run["ranks"][0]))],
                 "norms": [[r["norm"] for r in records] for records in run["ranks"]],
                 "spread": max(R.merge_ranks(run["ranks"], key, 0)[1] for key in ("before", "grads", "after")),
                 "overlapped": [records[-1]["overlapped"] for records in run["ranks"]],
                 "cpu_s": sum(records[-1]["cpu_s"] for records in run["ranks"])}
        if fields.get("aux_loss_coeff", 0.0) == 0.0 and not name.startswith(("ckpt", "resume", "pp2-objective", "feat")):
            entry["reference"] = reference.judge(run)  # transformers + torch AdamW, from the fixture's weights
        result[name] = entry
    result["launch_seconds"] = seconds
    result["launch_cpu_s"] = {w: sum(records[-1].get("launch_cpu_s", 0.0) for n, r in runs.items() if r["world"] == w
                                     for records in r["ranks"]) for w in seconds}
    result["reference"] = {"loss": reference.loss, "norm": reference.norm, "margin_over_bound": reference.margin}
    result["checkpoints"] = {name: str(folder / "checkpoints" / name) for name in ("ckpt-pp1-ep2", "ckpt-pp2xep2")
                             if name in CONFIGS}
    return result


class Reference:
    """The first step of every configuration judged as tests/train/reference.py judges a step: (a) the
    loss, grad norm and finalised gradients against transformers' at the fixture's weights (DELTA),
    (b) the update against torch's clip_grad_norm_ + AdamW given those weights and gptoss's own
    gradients (a few ulp). Every configuration starts from the same weights, so transformers runs once."""

    def __init__(self, hf: Path, prefix: Path):
        from tests.model.tiny_checkpoints import load_hf_reference

        self.model = load_hf_reference(hf).train()
        self.view = R.HfView(self.model)
        self.params = self.view.params
        self.initial = {n: p.detach().clone() for n, p in self.params.items()}
        batch = R.windows(prefix)
        logits = self.model(input_ids=batch[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), batch[:, 1:].reshape(-1))
        loss.backward()
        self.grads = {n: p.grad.detach().clone() for n, p in self.params.items()}
        self.loss = float(loss.detach())
        self.norm = float(torch.sqrt(sum(g.double().pow(2).sum() for g in self.grads.values())))
        self.margin = self.routing_margin(batch[:, :-1])

    def routing_margin(self, tokens: torch.Tensor) -> float:
        """The smallest gap between a token's k-th and (k+1)-th router logit over the logits' fp32 error
        bound (> 10: no routing decision can flip between the implementations)."""
        outs: list[tuple[torch.Tensor, torch.Tensor, torch.nn.Module]] = []
        hooks = [m.register_forward_hook(lambda m, i, o: outs.append((i[0].detach(), o[0].detach(), m)))
                 for n, m in self.model.named_modules() if n.endswith("mlp.router")]
        with torch.no_grad():
            self.model(input_ids=tokens)
        for h in hooks:
            h.remove()
        k = R.TINY.num_experts_per_tok
        ratios = []
        for h, z, router in outs:
            top = z.topk(k + 1, dim=-1).values
            bound = R.ROUTER_DELTA * (h.abs() @ router.weight.detach().abs().T + router.bias.detach().abs())
            ratios.append(((top[:, k - 1] - top[:, k]) / (2 * bound.max(dim=-1).values)).min())
        return float(min(ratios))

    def to_hf(self, hybrid: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """R.HfView.to_hf as one scatter through the permutation, built once."""
        if not hasattr(self, "_order"):
            self._names = sorted(self.view.index)
            self._order = torch.cat([self.view.index[n] for n in self._names])
        assert sorted(hybrid) == self._names, sorted(set(hybrid) ^ set(self._names))[:5]
        flat = torch.empty(sum(self.view.sizes), dtype=torch.float32)
        flat[self._order] = torch.cat([hybrid[n].reshape(-1).to(torch.float32) for n in self._names])
        parts = torch.split(flat, self.view.sizes)
        return {n: part.view(self.params[n].shape) for n, part in zip(self.view.names, parts)}

    def judge(self, run: dict[str, Any]) -> dict[str, Any]:
        before, _ = R.merge_ranks(run["ranks"], "before", 0)
        grads, _ = R.merge_ranks(run["ranks"], "grads", 0)
        after, _ = R.merge_ranks(run["ranks"], "after", 0)
        ours_before, ours_grads, ours_after = (self.to_hf(t) for t in (before, grads, after))
        out: dict[str, Any] = {
            "initial_diff": max(float((ours_before[n] - self.initial[n]).abs().max()) for n in self.params),
            "grad_diff": {n: (float((ours_grads[n] - g).norm()), float(g.norm())) for n, g in self.grads.items()},
        }
        with torch.no_grad():
            for n, p in self.params.items():
                p.copy_(self.initial[n])
                p.grad = ours_grads[n].clone()
        optimizer = torch.optim.AdamW(
            [{"params": [p for n, p in self.params.items() if R.hf_decays(n)], "weight_decay": R.WEIGHT_DECAY},
             {"params": [p for n, p in self.params.items() if not R.hf_decays(n)], "weight_decay": 0.0}],
            lr=R.LR, betas=R.BETAS, eps=R.EPS, foreach=False)
        torch.nn.utils.clip_grad_norm_(list(self.params.values()), R.CLIP)
        optimizer.step()
        out["update_excess"] = {}
        for n, p in self.params.items():
            tol = R.ULPS * 2.0**-23 * torch.maximum(p.detach().abs(), self.initial[n].abs()) + R.UPDATE_ATOL
            out["update_excess"][n] = float(((ours_after[n] - p.detach()).abs() / tol).max())
        return out


def load(tmp_path_factory: Any) -> dict[str, Any]:
    """`compute` once per test session (shared by the xdist workers); skips without transformers."""
    import pytest

    from tests.train.dist_helpers import once_per_session

    pytest.importorskip("transformers")
    return once_per_session(tmp_path_factory, "pipeline_runs", compute)


def rank0(run: dict[str, Any]) -> list[dict[str, Any]]:
    return [m for m in run["metrics"] if m["rank"] == 0]


def max_rel_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> tuple[str, float]:
    """The tensor whose max |a - b| relative to its max |b| is largest, and that ratio."""
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))[:5]
    worst = max(a, key=lambda n: float((a[n] - b[n]).abs().max()) / max(float(b[n].abs().max()), 1e-30))
    return worst, float((a[worst] - b[worst]).abs().max()) / max(float(b[worst].abs().max()), 1e-30)


__all__ = ["CONFIGS", "SCHEDULES", "MUTATIONS", "compute", "load", "rank0", "max_rel_diff", "train_configs"]
