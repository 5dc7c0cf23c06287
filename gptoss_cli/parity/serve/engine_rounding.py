"""What llama.cpp computes with a GGUF, in gptoss's model: the weights as the GGUF rounds them, and the spread its
activation roundings leave on the log-probabilities (serve-check's llama.cpp budget, docs/serve-check.md).

The weights. The GGUF holds each weight in its type: F32 exactly; BF16 and F16 rounded to nearest; Q8_0 per
block of 32 values of a row, d = max|x| / 127 stored in F16 and q = round(x / d) (ties away from zero), value
q * d; MXFP4 the experts' E2M1 codes (model/mxfp4/codec.py, the export's own encoder). `round_weights` applies
the same rounding, computed here (not read back from the file), to gptoss's model of the checkpoint, so that a
GGUF whose bytes are not the checkpoint's rounding fails the check.

The activations. ggml's CPU matrix product converts its activation operand to the weight type's dot-product
type before multiplying: F32 weights keep it F32, BF16 and F16 weights round it to BF16 / F16, Q8_0 and MXFP4
weights quantise it to Q8_0 (per 32 values, as above). An F16 KV cache stores keys and values in F16, and the
products with it round the query and the attention probabilities to F16 too. Those roundings are not
gptoss's; each is an error of about half a quantum per element, of either sign, nearly independent between
elements. `rounding_spread` runs gptoss's forward again over ROWS rows of the same ids with every such point
given a random error of that size (uniform: +-half a quantum for Q8_0, +-half an ulp relative for BF16 and
F16), every router held to the experts the plain forward chose, and returns, per position, the root mean
square over the rows of how far the log-probabilities moved (the largest over the vocabulary), and per block
the router margins' spread (a near-tie: serve-check flips such routers as for any engine). llama.cpp's own
rounding is one draw of that process, so the budget is SAFETY (4) times the spread, on top of the float32
budget of budget.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gptoss_cli.model.mxfp4.codec import round_to_mxfp4

ROWS = 8  # noisy forwards per prompt
SAFETY = 4.0
Q8_BLOCK = 32
UNIT = {"BF16": 2.0**-8, "F16": 2.0**-11}  # unit roundoff (half an ulp, relative)
# the dot-product type ggml's CPU backend converts the activation operand to, per weight type
VEC_DOT = {"F32": "F32", "F16": "F16", "BF16": "BF16", "Q8_0": "Q8_0", "MXFP4": "Q8_0"}


@dataclass(frozen=True)
class GgufTypes:
    """The GGML types of the served GGUF: the attention and output weights', the experts', the KV cache's."""

    main: str  # attn_q/k/v/output, token_embd, output
    experts: str  # ffn_{gate,up,down}_exps
    kv_cache: str = "F32"

    @property
    def rounds_anything(self) -> bool:
        return VEC_DOT[self.main] != "F32" or VEC_DOT[self.experts] != "F32" or self.kv_cache != "F32"


# --- the weights --------------------------------------------------------------------------------
def q8_0_round(x: torch.Tensor) -> torch.Tensor:
    """`x` [..., n] (n a multiple of 32) as Q8_0 holds it: ggml's quantize_row_q8_0_ref, then dequantised."""
    blocks = x.float().reshape(*x.shape[:-1], -1, Q8_BLOCK)
    d = blocks.abs().amax(dim=-1, keepdim=True) / 127
    inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    scaled = blocks * inv
    q = torch.sign(scaled) * torch.floor(scaled.abs() + 0.5)  # roundf: ties away from zero
    return (q * d.half().float()).reshape(x.shape)


def round_to(x: torch.Tensor, ggml_type: str) -> torch.Tensor:
    if ggml_type == "F32":
        return x.float()
    if ggml_type == "BF16":
        return x.to(torch.bfloat16).float()
    if ggml_type == "F16":
        return x.to(torch.float16).float()
    if ggml_type == "Q8_0":
        return q8_0_round(x)
    if ggml_type == "MXFP4":
        return round_to_mxfp4(x.float())
    raise ValueError(f"GGML type {ggml_type} is not one serve-check models")


_MAIN = ("embedding.word_embeddings.weight", "output_layer.weight", "self_attention.linear_qkv.weight",
         "self_attention.linear_proj.weight")
_EXPERTS = (".experts.linear_fc1.weight", ".experts.linear_fc2.weight")


def round_weights(model: torch.nn.Module, types: GgufTypes) -> None:
    """The model's weights as the GGUF holds them (module docstring); biases, norms, sinks, router stay F32."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(_EXPERTS):  # [E, out, in], rounded along `in` as stored
                param.copy_(round_to(param, types.experts))
            elif name.endswith(_MAIN):
                param.copy_(round_to(param, types.main))


# --- the activations ------------------------------------------------------------------------------
def _noise(x: torch.Tensor, kind: str, gen: torch.Generator) -> torch.Tensor:
    """`x` plus a random error the size of rounding it to `kind` (module docstring)."""
    if kind == "F32":
        return x
    u = torch.rand(x.shape, generator=gen, dtype=torch.float64) - 0.5  # uniform in [-1/2, 1/2)
    if kind == "Q8_0":
        blocks = x.reshape(*x.shape[:-1], -1, Q8_BLOCK)
        d = blocks.abs().amax(dim=-1, keepdim=True) / 127
        return (blocks + u.reshape(blocks.shape).to(x.dtype) * d).reshape(x.shape)
    return x * (1 + 2 * UNIT[kind] * u.to(x.dtype))


class _NoisyDense:
    """A dense GEMM whose activation operand carries llama.cpp's conversion error (model/gemm/dense.py's seam)."""

    name = "llama.cpp rounding"

    def __init__(self, kind: str, gen: torch.Generator):
        self.kind, self.gen = kind, gen

    def fprop(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return _noise(x, self.kind, self.gen) @ weight.t()


class _NoisyGrouped:
    """The grouped expert GEMM with the same (model/gemm/grouped.py's seam)."""

    name = "llama.cpp rounding"

    def __init__(self, kind: str, gen: torch.Generator):
        from gptoss_cli.model.gemm.grouped import GroupedGemm

        self.kind, self.gen, self.inner = kind, gen, GroupedGemm()

    def fprop(self, x: torch.Tensor, weight: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        return self.inner.fprop(_noise(x, self.kind, self.gen), weight, tokens_per_expert)


def _hooks(model, types: GgufTypes, gen: torch.Generator, chosen: list, margins: list) -> list:
    """The F16 cache's roundings on attention, and the routers held to the plain forward's choices (`chosen`,
    per block in order) while their noisy margins are recorded."""
    from gptoss_cli.model.attention.layer import CoreAttention
    from gptoss_cli.model.moe import Router, RouterOutput

    handles = []
    if types.kv_cache == "F16":
        def pre(mod, args, kwargs):
            q, k, v = (_noise(t, "F16", gen) for t in args[:3])
            return (q, k, v, *args[3:]), kwargs

        def post(mod, args, kwargs, out):  # the probabilities' rounding, carried to the output
            return _noise(out, "F16", gen)

        for m in model.modules():
            if isinstance(m, CoreAttention):
                handles.append(m.register_forward_pre_hook(pre, with_kwargs=True))
                handles.append(m.register_forward_hook(post, with_kwargs=True))
    routers = [m for m in model.modules() if isinstance(m, Router)]
    for block, router in enumerate(routers):
        def hold(mod, inputs, output, block=block):
            logits = output.logits.reshape(-1, output.logits.shape[-1])
            idx = chosen[block].reshape(-1, mod.top_k)
            kth = logits.gather(1, idx).min(dim=-1).values
            best_other = logits.scatter(1, idx, float("-inf")).max(dim=-1).values
            margins.append((block, (kth - best_other).detach()))
            probs = torch.softmax(logits.gather(1, idx), dim=-1)
            return RouterOutput(logits=output.logits, probs=probs.reshape(output.indices.shape),
                                indices=idx.reshape(output.indices.shape))
        handles.append(router.register_forward_hook(hold))
    return handles


def _router_outputs(model, ids: list[int]) -> list:
    """Each block's RouterOutput of the plain forward of `ids`, in block order."""
    from gptoss_cli.model.moe import Router

    found: list = []
    hooks = [m.register_forward_hook(lambda mod, i, out: found.append(out))
             for m in model.modules() if isinstance(m, Router)]
    try:
        with torch.no_grad():
            model(torch.tensor([ids]))
    finally:
        for h in hooks:
            h.remove()
    return found


def _choices(model, ids: list[int]) -> list[torch.Tensor]:
    return [out.indices.detach() for out in _router_outputs(model, ids)]


@dataclass
class Spread:
    logprob: torch.Tensor  # [len(ids) - 1]: RMS over rows of max over the vocabulary of |moved log-prob|
    router_margin_sd: list[torch.Tensor]  # per block, [len(ids)]: the spread of the k-th vs (k+1)-th margin


def rounding_spread(model, ids: list[int], logprobs: torch.Tensor, types: GgufTypes, seed: int = 0) -> Spread:
    """The spread of llama.cpp's activation roundings on `model`'s log-probabilities of `ids` (module docstring);
    `logprobs` [len(ids) - 1, V] the plain forward's."""
    from gptoss_cli.model.gemm.selection import set_gemms

    n = len(ids) - 1
    if not types.rounds_anything:
        return Spread(torch.zeros(n, dtype=torch.float64), [])
    gen = torch.Generator().manual_seed(seed)
    chosen = _choices(model, ids)
    main, experts = VEC_DOT[types.main], VEC_DOT[types.experts]
    set_gemms(model, dense=lambda name: _NoisyDense(main, gen), grouped=lambda name: _NoisyGrouped(experts, gen))
    sq = torch.zeros(n, dtype=torch.float64)
    per_block: dict[int, list[torch.Tensor]] = {}
    try:
        for _ in range(ROWS):
            margins: list = []
            handles = _hooks(model, types, gen, chosen, margins)
            try:
                with torch.no_grad():
                    out = model(torch.tensor([ids]))
                    hidden = out.hidden.reshape(len(ids), -1).float()
                    logits = _noise(hidden, main, gen) @ out.head_weight.float().t()  # the output layer's input too
            finally:
                for h in handles:
                    h.remove()
            moved = (torch.log_softmax(logits.double(), dim=-1)[:-1] - logprobs).abs().max(dim=-1).values
            sq += moved ** 2
            for block, m in margins:
                per_block.setdefault(block, []).append(m.double())
    finally:
        set_gemms(model)
    sds = [torch.stack(per_block[b]).std(dim=0) if len(per_block[b]) > 1 else torch.zeros_like(per_block[b][0])
           for b in sorted(per_block)]
    return Spread((sq / ROWS).sqrt(), sds)


def budget_from(spread: Spread) -> torch.Tensor:
    return SAFETY * spread.logprob


def near_ties(model, ids: list[int], spread: Spread) -> list[torch.Tensor]:
    """Per block, the positions whose router margin lies within SAFETY spreads of zero ([len(ids)] bool)."""
    if not spread.router_margin_sd:
        return []
    routed = _router_outputs(model, ids)  # plain margins: recomputed with routers observed, not held
    out = []
    for logits, idx, sd in zip((r.logits for r in routed), (r.indices for r in routed), spread.router_margin_sd):
        flat = logits.reshape(-1, logits.shape[-1]).double()
        picked = idx.reshape(flat.shape[0], -1)
        kth = flat.gather(1, picked).min(dim=-1).values
        other = flat.scatter(1, picked, float("-inf")).max(dim=-1).values
        out.append((kth - other) <= SAFETY * sd)
    return out


__all__ = ["GgufTypes", "round_weights", "round_to", "q8_0_round", "rounding_spread", "budget_from", "near_ties",
           "Spread", "VEC_DOT", "ROWS", "SAFETY"]
