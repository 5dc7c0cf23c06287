"""`gptoss train` against an independent trainer: transformers' GptOssForCausalLM + torch AdamW +
clip_grad_norm_, step by step, restarting the reference from gptoss's weights at every step.

The fixture: a transformers-made HF checkpoint (fp32, `tests/model/tiny_checkpoints.py`) and a token
file in the format of `gptoss_cli/train/data.py` holding exactly one global batch, so every step of
every layout trains on the same tokens. `gptoss train`'s real loop (`run_worker` on a `TrainJob`:
`checkpoint.pretrained`, `data.kind=tokens`, constant lr, weight decay 1.0, clip 1.1, aux loss 0)
runs in every layout; a spy on `DistributedAdamW.step` records, before each update, the weights
and the finalised `main_grad` (which is what the optimizer is about to use) and, after it, the
updated weights. The loss, grad norm and lr come from the run's own `metrics.jsonl`.

Why restart (tests' standards: AdamW amplifies rounding): two trainers that follow their own
trajectories drift apart by +-lr on elements whose gradient is rounding noise, and the drift
compounds. So step t of the reference starts from gptoss's weights W_t, and each step is judged on
its own, in two independent halves:
  (a) the gradient at W_t: transformers' loss, gradients and global norm at W_t against gptoss's
      metrics.jsonl loss and grad norm and its finalised main_grad (fp32 reordering only);
  (b) the update: torch's clip_grad_norm_ + AdamW (parameter groups chosen here from the HF names),
      given W_t and gptoss's own gradients, against gptoss's W_{t+1}. Both sides do the same
      arithmetic on the same inputs, so they agree to a few ulp; no amplification can enter.
The reference AdamW keeps its own moments across steps (built from the gradients it was given), so
moment handling, bias correction, lr and decay groups are all checked from step 2 on.
"""

from __future__ import annotations

import contextlib
import json
import math
from pathlib import Path
from typing import Any

import torch

from gptoss_cli.model.config import preset
from gptoss_cli.train.optimizer import DistributedAdamW
from tests.tolerances import U_FP32
from tests.train.dist_helpers import named_grads

TINY = preset("tiny")
SEQ = 16
GLOBAL_BATCH = 4
STEPS = 3
LR = 1e-3
WEIGHT_DECAY = 1.0  # large, so that decaying a parameter that must not decay shows
CLIP = 1.1  # below the fixture's grad norms, so clipping engages at every step
BETAS = (0.9, 0.95)
EPS = 1e-8
FIXTURE_SEED = 9  # its routing margin is the largest of seeds 0-39 (see ROUTER_DELTA)

# layout name -> (processes, expert_model_parallel_size, use_distributed_optimizer[, options]).
# options: train-job fields (bucket_size, overlap_grad_reduce, global_batch_size), `steps` (default
# STEPS) and `resume_from`: the layout whose final checkpoint this one resumes at its own layout,
# continuing the same trajectory (its records and the reference's are the concatenation).
BUCKET = 20_000  # elements: the tiny model's buffers split into several buckets (dense: 179k)
LAYOUTS: dict[str, tuple] = {
    "ep1": (1, 1, True),
    "ep2": (2, 2, True),
    "dp2": (2, 1, True),
    "ep2xedp2": (4, 2, True),
    "ep2xedp2-replicated-opt": (4, 2, False),
    "ep2xedp2-buckets-overlap": (4, 2, True, {"bucket_size": BUCKET, "overlap_grad_reduce": True}),
    # the checkpoint of the run above, loaded where every shard boundary moved: EP=1 x expert-DP=4,
    # buckets of another size, then one more step
    "ep1xedp4-resumed": (4, 1, True, {"bucket_size": 3 * BUCKET // 2, "steps": 1,
                                      "resume_from": "ep2xedp2-buckets-overlap"}),
    # W=8: every rank one sample of a global batch of 8 = the file's 4 samples twice (two epochs per
    # step), so the mean loss and its gradients are those of the 4-sample batch the reference uses
    "ep4xedp2-buckets-overlap": (8, 4, True, {"bucket_size": BUCKET, "overlap_grad_reduce": True,
                                              "global_batch_size": 2 * GLOBAL_BATCH, "steps": 1}),
    # context parallel: both ranks read the same samples, each its half of every row (8 of 16
    # positions: the sliding window of 8 crosses the cut), alone and with EP=2 over the same ranks
    "cp2": (2, 1, True, {"cp_size": 2}),
    "cp2xep2": (2, 2, True, {"cp_size": 2}),
}


def options(layout: str) -> dict[str, Any]:
    spec = LAYOUTS[layout]
    return dict(spec[3]) if len(spec) > 3 else {}


def layout_steps(layout: str) -> int:
    """Optimizer steps of the layout's trajectory (a resumed layout continues its source's)."""
    opts = options(layout)
    before = layout_steps(opts["resume_from"]) if "resume_from" in opts else 0
    return before + opts.get("steps", STEPS)


# --- fixture ------------------------------------------------------------------------------------
def write_fixture(folder: Path) -> tuple[Path, Path]:
    """(HF checkpoint written by transformers, token-file prefix holding one global batch)."""
    from tests.model.tiny_checkpoints import write_hf_checkpoint

    folder = Path(folder)
    hf = write_hf_checkpoint(folder / "hf", "bf16", seed=FIXTURE_SEED)
    n = GLOBAL_BATCH * SEQ + 1  # sample i = tokens[i*S : i*S+S+1]; exactly GLOBAL_BATCH samples
    g = torch.Generator().manual_seed(FIXTURE_SEED + 17)
    tokens = torch.randint(0, TINY.vocab_size, (n,), generator=g, dtype=torch.int64)
    prefix = folder / "tokens"
    # The format of gptoss_cli/train/data.py, written here by hand: raw little-endian uint16 + header.
    prefix.with_suffix(".bin").write_bytes(tokens.to(torch.int32).numpy().astype("<u2").tobytes())
    prefix.with_suffix(".json").write_text(json.dumps({
        "format": "gptoss-tokens", "version": 1, "dtype": "uint16", "num_tokens": n, "num_documents": 1,
        "vocab_size": TINY.vocab_size, "eos_token_id": TINY.eos_token_id, "tokenizer": None, "sources": [],
    }))
    return hf, prefix


def windows(prefix: Path) -> torch.Tensor:
    """[GLOBAL_BATCH, SEQ+1]: every sample of the token file (the whole global batch)."""
    import numpy as np

    tokens = torch.from_numpy(np.fromfile(str(prefix.with_suffix(".bin")), dtype="<u2").astype("int64"))
    return torch.stack([tokens[i * SEQ : i * SEQ + SEQ + 1] for i in range(GLOBAL_BATCH)])


def plan(layout: str, run_dir: Path, hf: Path, prefix: Path):
    from tests.train.jobs import train_job

    _, ep, distributed_opt = LAYOUTS[layout][:3]
    opts = options(layout)
    source = opts.pop("resume_from", None)
    opts.pop("steps", None)
    # Every run saves at its end; a resumed run continues in its source's checkpoint folder.
    ckpt = run_dir.parent / (source or layout) / "ckpt"
    fields = dict(
        ep_size=ep, device="cpu", params_dtype="fp32", aux_loss_coeff=0.0, seq_length=SEQ, micro_batch_size=1,
        global_batch_size=GLOBAL_BATCH, train_iters=layout_steps(layout), lr=LR, min_lr=LR, warmup_iters=0,
        lr_decay_style="constant", weight_decay=WEIGHT_DECAY, adam_beta1=BETAS[0], adam_beta2=BETAS[1], adam_eps=EPS,
        clip_grad=CLIP, use_distributed_optimizer=distributed_opt, data_kind="tokens", data_path=str(prefix),
        pretrained=str(hf), checkpoint_dir=str(ckpt) if (source or _resumed_by_some(layout)) else None,
    )
    return train_job(run_dir, name=f"reference-{layout}", **{**fields, **opts})


def _resumed_by_some(layout: str) -> bool:
    return any(options(other).get("resume_from") == layout for other in LAYOUTS)


# --- gptoss side (runs in the training processes) -------------------------------------------------
@contextlib.contextmanager
def recording_optimizer_steps(records: list[dict[str, Any]], grads=None):
    """Spy on DistributedAdamW.step: weights and finalised main_grad before, weights after (checkpoint names).
    `grads(module, buffers)` names the gradients (default named_grads)."""
    grads = grads or named_grads
    real = DistributedAdamW.step

    def weights(module) -> dict[str, torch.Tensor]:
        return {n: t.detach().clone() for n, t in module.named_checkpoint_slots()}

    def step(self, lr):
        buffers = list(dict.fromkeys(s.buffer for s in self.shards))  # in the same order on every rank
        record = {"before": weights(self._module), "grads": grads(self._module, buffers), "lr_arg": lr}
        record["norm"] = real(self, lr)
        record["after"] = weights(self._module)
        record["owned"] = self.owned()  # which elements of which parameter this rank stepped
        records.append(record)
        return record["norm"]

    DistributedAdamW.step = step
    try:
        yield records
    finally:
        DistributedAdamW.step = real


def train_layouts(rank: int, plans: list) -> list[list[dict[str, Any]]]:
    """run_worker for each plan in turn (in an initialised gloo group); this rank's step records per plan."""
    from gptoss_cli.run.worker import run_worker

    out = []
    for p in plans:
        records: list[dict[str, Any]] = []
        with recording_optimizer_steps(records):
            run_worker(p)
        out.append(records)
    return out


def run_layouts(folder: Path, layouts: list[str], hf: Path, prefix: Path) -> dict[str, dict[str, Any]]:
    """Train every layout (all of one world size: one launch); per layout the ranks' records and metrics."""
    from tests.train.dist_helpers import run_distributed

    worlds = {LAYOUTS[name][0] for name in layouts}
    assert len(worlds) == 1, layouts
    world = worlds.pop()
    plans = [plan(name, folder / name, hf, prefix) for name in layouts]
    if world == 1:
        per_rank = [train_layouts(0, plans)]
    else:
        # 4 or 8 workers start from a forkserver (dist_helpers.run_distributed): spawning them costs 10-20 s
        preload = ("tests.train.reference", "gptoss_cli.train.loop") if world > 2 else None
        per_rank = run_distributed(train_layouts, world, folder / "ranks", plans, timeout=600.0, preload=preload)
    out: dict[str, dict[str, Any]] = {}
    for i, name in enumerate(layouts):
        rows = [json.loads(line) for line in (folder / name / "metrics.jsonl").read_text().splitlines()]
        run = {"ranks": [r[i] for r in per_rank], "metrics": rows, "world": world}
        source = options(name).get("resume_from")
        if source is not None:  # one trajectory: the source's steps, then this layout's
            run["resumed"] = True
            run["ranks"] = [a + b for a, b in zip(out[source]["ranks"], run["ranks"])]
            run["metrics"] = out[source]["metrics"] + rows
        out[name] = run
    return out


# --- the reference ------------------------------------------------------------------------------
def hybrid_to_hf_index(hf_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """For each Hybrid checkpoint name, the flat positions of its elements in one global flat space
    over the HF tensors, from the test-local HF -> Hybrid re-arrangement of tests/model/conftest.py
    applied to element ids (a pure permutation, so the inverse is exact)."""
    from tests.model.conftest import hf_to_hybrid_state_dict

    ids, start = {}, 0
    for name, t in hf_state.items():
        ids[name] = torch.arange(start, start + t.numel(), dtype=torch.int64).view(t.shape)
        start += t.numel()
    index = {n: t.reshape(-1) for n, t in hf_to_hybrid_state_dict(ids).items()}
    covered = torch.cat(list(index.values()))
    assert torch.equal(covered.sort().values, torch.arange(start)), "the re-arrangement is not a bijection"
    return index


class HfView:
    """Hybrid-named tensors <-> the HF model's parameters, through `hybrid_to_hf_index`."""

    def __init__(self, model: torch.nn.Module):
        self.params = dict(model.named_parameters())
        self.names = list(self.params)
        self.index = hybrid_to_hf_index({n: p.detach() for n, p in self.params.items()})
        self.sizes = [p.numel() for p in self.params.values()]

    def to_hf(self, hybrid: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        assert hybrid.keys() == self.index.keys(), sorted(set(hybrid) ^ set(self.index))[:5]
        flat = torch.full((sum(self.sizes),), float("nan"), dtype=torch.float32)
        for name, pos in self.index.items():
            flat[pos] = hybrid[name].reshape(-1).to(torch.float32)
        parts = torch.split(flat, self.sizes)
        return {n: part.view(self.params[n].shape) for n, part in zip(self.names, parts)}


def hf_decays(name: str) -> bool:
    """The reference's weight-decay rule, on transformers' names: no decay for biases (`*.bias`,
    `*_bias`: the router's and the experts' stacked [E, out] biases), norms and sinks."""
    return not name.endswith(("bias", "norm.weight", ".sinks"))


def merge_ranks(ranks: list[list[dict[str, Any]]], key: str, step: int) -> tuple[dict[str, torch.Tensor], float]:
    """One dict over every rank's tensors of `key` at `step`; the largest difference between replicas."""
    merged: dict[str, torch.Tensor] = {}
    spread = 0.0
    for records in ranks:
        for name, t in records[step][key].items():
            if name in merged:
                spread = max(spread, float((merged[name] - t).abs().max()))
            else:
                merged[name] = t
    return merged, spread


def router_logits_gptoss(hybrid_weights: dict[str, torch.Tensor], tokens: torch.Tensor) -> list[torch.Tensor]:
    """Router logits of every MoE layer of gptoss's HybridModel (EP=1) at the given weights."""
    from gptoss_cli.model.hybrid import HybridModel

    model = HybridModel(TINY).train()
    model.aux_loss_coef = 0.0
    model.load_state_dict(hybrid_weights, strict=True)
    logits: list[torch.Tensor] = []
    hooks = [layer.mlp.router.register_forward_hook(lambda m, i, o: logits.append(o.logits.detach()))
             for _, layer in model.moe_layers()]
    with torch.no_grad():
        model(tokens)
    for h in hooks:
        h.remove()
    return logits


# --- error model ---------------------------------------------------------------------------------
# Both sides evaluate the same fp32 function at the same weights with the same routing decisions
# (see ROUTER_DELTA), so they differ only by rounding in another order: grouped GEMMs against
# transformers' loop over experts, SDPA with the sink column against eager attention, partial sums
# over microbatches and ranks. fp32 rounds each operation with relative error U = 2^-24; a sum of n
# terms taken in another order moves by about sqrt(n)*U of the sum of the magnitudes (random walk),
# and the D sequential stages of a computation add their errors: DELTA = D * sqrt(n) * U.
U = U_FP32
# Loss, gradients and the grad norm: forward and backward through 3 blocks of ~10 stages each plus
# the head, softmax and mean (D = 64); the longest sum is the vocabulary softmax (n = 1024).
DELTA = 64 * math.sqrt(1024) * U  # 1.2e-4
# Router logits: only the forward up to the routers (D = 30); the longest sum before them is a
# 96-wide GEMM (n = 96). A logit z = h.w + b then carries at most ROUTER_DELTA * (|h|.|w| + |b|).
ROUTER_DELTA = 30 * math.sqrt(96) * U  # 1.8e-5
# The update: torch's AdamW and ours do the same arithmetic on the same weights and gradients; they
# differ by a few roundings of the new weight (ULPS ulp of |W|) and by the clip coefficient, whose
# norms differ by at most DELTA relative; Adam's update moves by at most lr times a relative change
# of the gradient scale (it is scale-invariant up to eps).
ULPS = 4
UPDATE_ATOL = LR * DELTA


def reference_steps(hf: Path, prefix: Path, run: dict[str, Any]) -> list[dict[str, Any]]:
    """Per step of one gptoss run: (a) the gradient check and (b) the update check, as numbers
    against the error model (per tensor), the routing margin, and the spread between replicas."""
    from tests.model.tiny_checkpoints import load_hf_reference

    model = load_hf_reference(hf).train()
    view = HfView(model)
    params = view.params
    initial = {n: p.detach().clone() for n, p in params.items()}
    optimizer = torch.optim.AdamW(
        [{"params": [p for n, p in params.items() if hf_decays(n)], "weight_decay": WEIGHT_DECAY},
         {"params": [p for n, p in params.items() if not hf_decays(n)], "weight_decay": 0.0}],
        lr=LR, betas=BETAS, eps=EPS, foreach=False,
    )
    batch = windows(prefix)
    inputs, labels = batch[:, :-1], batch[:, 1:]
    routers: list[tuple[torch.nn.Module, torch.Tensor, torch.Tensor]] = []  # (router, input h, logits) per layer
    for name, module in model.named_modules():
        if name.endswith("mlp.router"):
            module.register_forward_hook(lambda m, i, o: routers.append((m, i[0].detach(), o[0].detach())))
    k = TINY.num_experts_per_tok
    out = []
    for t in range(len(run["ranks"][0])):
        before, before_spread = merge_ranks(run["ranks"], "before", t)
        grads, _ = merge_ranks(run["ranks"], "grads", t)
        after, after_spread = merge_ranks(run["ranks"], "after", t)
        ours_before, ours_grads, ours_after = view.to_hf(before), view.to_hf(grads), view.to_hf(after)
        step: dict[str, Any] = {"replica_spread": max(before_spread, after_spread)}
        if t == 0:
            step["initial_diff"] = max(float((ours_before[n] - initial[n]).abs().max()) for n in params)
        else:  # the weights a step starts from are those the step before ended with (across a resume too)
            step["carried_diff"] = max(float((before[n] - prev_after[n]).abs().max()) for n in before)
        prev_after = after
        # (a) transformers' loss and gradients at gptoss's weights W_t
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(ours_before[n])
        model.zero_grad(set_to_none=True)
        routers.clear()
        logits = model(input_ids=inputs).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1))
        loss.backward()
        ref_grads = {n: p.grad.detach().clone() for n, p in params.items()}
        step["loss_ref"] = float(loss.detach())
        step["norm_ref"] = float(torch.sqrt(sum(g.double().pow(2).sum() for g in ref_grads.values())))
        step["grad_diff"] = {n: (float((ours_grads[n] - g).norm()), float(g.norm())) for n, g in ref_grads.items()}
        # routing: the gap between the k-th and (k+1)-th logit against the logits' error bound
        margins, bounds, measured = [], [], []
        ours_router = router_logits_gptoss(before, inputs)
        for (router, h, z), z_ours in zip(routers, ours_router):
            top = z.topk(k + 1, dim=-1).values
            margins.append(top[:, k - 1] - top[:, k])
            bound = ROUTER_DELTA * (h.abs() @ router.weight.detach().abs().T + router.bias.detach().abs())  # [T, E]
            bounds.append(2 * bound.max(dim=-1).values)  # both logits of the pair may move
            measured.append(((z_ours - z).abs() / bound).max())
        margins_t = torch.cat(margins)
        step["routing_margin"] = float(margins_t.min())
        step["margin_over_bound"] = float((margins_t / torch.cat(bounds)).min())
        step["router_diff_over_bound"] = float(max(measured))
        # (b) torch's clip_grad_norm_ + AdamW, given W_t and gptoss's own gradients
        for n, p in params.items():
            p.grad = ours_grads[n].clone()
        step["norm_of_our_grads"] = float(torch.nn.utils.clip_grad_norm_(list(params.values()), CLIP))
        for group in optimizer.param_groups:
            group["lr"] = LR  # the constant schedule, written here, not read from gptoss
        optimizer.step()
        excess = {}
        for n, p in params.items():
            new = p.detach()
            tol = ULPS * 2.0**-23 * torch.maximum(new.abs(), ours_before[n].abs()) + UPDATE_ATOL
            excess[n] = float(((ours_after[n] - new).abs() / tol).max())
        step["update_excess"] = excess  # <= 1: within the error model
        out.append(step)
    return out


def compute_all(folder: Path, layouts: list[str]) -> dict[str, Any]:
    """Fixture, gptoss runs of `layouts` (one launch per world size), and the reference per layout."""
    folder = Path(folder)
    hf, prefix = write_fixture(folder / "fixture")
    runs: dict[str, dict[str, Any]] = {}
    by_world: dict[int, list[str]] = {}
    for name in layouts:
        by_world.setdefault(LAYOUTS[name][0], []).append(name)
    for world, names in sorted(by_world.items()):
        runs.update(run_layouts(folder / f"world{world}", names, hf, prefix))
    result = {}
    for name in layouts:
        run = runs[name]
        result[name] = {"metrics": run["metrics"], "world": run["world"],
                        "steps": reference_steps(hf, prefix, run),
                        "lr_args": [r["lr_arg"] for r in run["ranks"][0]],
                        "norms_returned": [[r["norm"] for r in records] for records in run["ranks"]],
                        "owned": [[r["owned"] for r in records] for records in run["ranks"]]}
    return result


def load_runs(tmp_path_factory: Any, name: str, layouts: list[str]) -> dict[str, Any]:
    """compute_all(layouts) once per test session (tests/train/dist_helpers.py: once_per_session);
    skips without transformers, the reference."""
    import pytest

    from tests.train.dist_helpers import once_per_session

    pytest.importorskip("transformers")
    return once_per_session(tmp_path_factory, name, lambda folder: compute_all(folder, layouts))


def rows(run: dict[str, Any]) -> list[dict]:
    """metrics.jsonl's rows of rank 0, one per step (loss, lr and grad norm are global)."""
    return [m for m in run["metrics"] if m["rank"] == 0]


def cuts(owned_per_rank: list[dict[str, tuple[int, int]]]) -> dict[str, list[tuple[int, int]]]:
    """Parameters that a shard boundary cuts: stepped in parts by several ranks, with their ranges."""
    held: dict[str, list[tuple[int, int]]] = {}
    for owned in owned_per_rank:
        for name, rng in owned.items():
            held.setdefault(name, []).append(rng)
    return {n: sorted(r) for n, r in held.items() if len(set(r)) > 1}


__all__ = ["compute_all", "load_runs", "rows", "cuts", "LAYOUTS", "STEPS", "layout_steps", "LR", "CLIP", "WEIGHT_DECAY", "DELTA", "ROUTER_DELTA", "hf_decays"]
