"""megatron-core as an independent reference for Megatron checkpoints, run on CPU with gloo in its own processes.

    python -m tests.checkpoint.megatron_worker load CKPT_ITER_DIR OUT.safetensors [INPUT.safetensors]
        megatron-core's dist_checkpointing.load reads CKPT strictly (StrictHandling.RAISE_ALL: no key
        missing, none unexpected) into a sharded state dict whose expert part comes from real
        SequentialMLP modules; every loaded tensor is written to OUT under its state-dict name, and
        with INPUT (a tensor "x" [T, H]) each expert's output on it as `expert_out.<block>.<e>`.
    python -m tests.checkpoint.megatron_worker save HF_DIR OUT_DIR EP SINGLETON
        megatron-core's dist_checkpointing.save writes the HF checkpoint's weights as a torch_dist
        checkpoint from EP gloo ranks (each holding its experts in SequentialMLP modules), with
        optimizer-like and RNG entries besides, in the stacked or `singleton_local_shards` expert layout.
    python -m tests.checkpoint.megatron_worker model CKPT_ITER_DIR OUT.safetensors WORLD
        megatron-core's MambaModel (the hybrid stack, '*E' per block) built from CKPT's args with the
        local layer spec on WORLD gloo ranks, at EP=WORLD and then EP=1 in the same process group, its
        whole sharded state dict loaded by dist_checkpointing.load each time; OUT holds the logits on a
        fixed token batch (`logits_ep<N>`), OUT.json per EP the keys the model asked for, those it asked
        for that the checkpoint lacks, and those the checkpoint holds that it did not ask for.

The HF -> Megatron tensor mapping here is written from the HF layout and Megatron's naming alone,
independently of gptoss_cli's mapping table.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

from tests.train.dist_helpers import free_port

warnings.filterwarnings("ignore")


def _init(rank: int, world: int, port: int, ep: int = 1):
    # megatron-core's writer synchronises CUDA before copying tensors to CPU; ours are on the CPU already
    torch.cuda.synchronize = lambda *a, **k: None
    # ... and gathers its failure flags in a tensor on the current CUDA device: the CPU here
    torch.cuda.current_device = lambda: "cpu"
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(1, 1, expert_model_parallel_size=ep)
    return ps


def _experts(hidden: int, ffn: int, num_local: int, args=None):
    """megatron-core's SequentialMLP of local MLP experts; with `args`, GPT-OSS's activation as Megatron-LM
    configures it from them (quick_gelu gate, clamp, +1 on the linear half), computed unfused."""
    import torch.nn.functional as F
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron.core.fusions.fused_bias_geglu import quick_gelu

    gptoss = dict(activation_func=F.silu) if args is None else dict(activation_func=quick_gelu, glu_linear_offset=1.0,
                                          activation_func_clamp_value=args.activation_func_clamp_value,
                                          bias_activation_fusion=False)
    cfg = TransformerConfig(num_layers=2, hidden_size=hidden, num_attention_heads=1, ffn_hidden_size=ffn,
                            moe_ffn_hidden_size=ffn, num_moe_experts=num_local, gated_linear_unit=True,
                            add_bias_linear=True, use_cpu_initialization=True,
                            params_dtype=torch.float32, **gptoss)
    return SequentialMLP(num_local, cfg, MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear),
                         pg_collection=ProcessGroupCollection.use_mpu_process_groups())


def _te_extra_states(num_blocks: int) -> list[tuple[str, tuple, tuple]]:
    """(key, global_shape, global_offset) of the non-expert _extra_state objects of the TE spec's modules."""
    out = []
    for b in range(num_blocks):
        for mod in ("linear_qkv", "core_attention", "linear_proj"):
            out.append((f"decoder.layers.{2 * b}.self_attention.{mod}._extra_state", (1,), (0,)))
        out.append((f"decoder.layers.{2 * b + 1}.pre_mlp_layernorm._extra_state", (1,), (0,)))
    out.append(("decoder.final_norm._extra_state", (1,), (0,)))
    out.append(("output_layer._extra_state", (1,), (0,)))  # a ColumnParallelLinear, in every spec
    return out


def _plain_tensors(hf: dict, cfg: dict, padded_vocab: int) -> dict[str, torch.Tensor]:
    """Megatron's non-expert tensors from HF tensors (qkv fused per kv group: q heads, k, v)."""
    H, heads, kv, d = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    r = heads // kv
    out = {}

    def pad(t):
        return torch.cat([t, t.new_zeros(padded_vocab - t.shape[0], H)])

    out["embedding.word_embeddings.weight"] = pad(hf["model.embed_tokens.weight"])
    out["output_layer.weight"] = pad(hf["lm_head.weight"])
    out["decoder.final_norm.weight"] = hf["model.norm.weight"]
    for b in range(cfg["num_hidden_layers"]):
        p, a, m = f"model.layers.{b}.", f"decoder.layers.{2 * b}.", f"decoder.layers.{2 * b + 1}."
        for kind in ("weight", "bias"):
            q = hf[p + f"self_attn.q_proj.{kind}"].reshape(kv, r * d, *hf[p + f"self_attn.q_proj.{kind}"].shape[1:])
            k = hf[p + f"self_attn.k_proj.{kind}"].reshape(kv, d, *q.shape[2:])
            v = hf[p + f"self_attn.v_proj.{kind}"].reshape(kv, d, *q.shape[2:])
            out[a + f"self_attention.linear_qkv.{kind}"] = torch.cat([q, k, v], dim=1).reshape(-1, *q.shape[2:])
        out[a + "self_attention.linear_qkv.layer_norm_weight"] = hf[p + "input_layernorm.weight"]
        out[a + "self_attention.linear_proj.weight"] = hf[p + "self_attn.o_proj.weight"]
        out[a + "self_attention.linear_proj.bias"] = hf[p + "self_attn.o_proj.bias"]
        out[a + "self_attention.core_attention.softmax_offset"] = hf[p + "self_attn.sinks"]
        out[m + "pre_mlp_layernorm.weight"] = hf[p + "post_attention_layernorm.weight"]
        out[m + "mlp.router.weight"] = hf[p + "mlp.router.weight"]
        out[m + "mlp.router.bias"] = hf[p + "mlp.router.bias"]
    return out


def _expert_params(hf: dict, block: int, e: int) -> dict[str, torch.Tensor]:
    """One expert of an HF block (bf16 form: gate_up_proj [E, H, 2I] with gate/up interleaved on the last
    axis) as Megatron's MLP holds it: fc1 [2I, H] = [gate; up], fc2 [H, I]."""
    p = f"model.layers.{block}.mlp.experts."
    gu, gub = hf[p + "gate_up_proj"][e], hf[p + "gate_up_proj_bias"][e]
    return {"linear_fc1.weight": torch.cat([gu[:, 0::2], gu[:, 1::2]], dim=1).t().contiguous(),
            "linear_fc1.bias": torch.cat([gub[0::2], gub[1::2]]),
            "linear_fc2.weight": hf[p + "down_proj"][e].t().contiguous(),
            "linear_fc2.bias": hf[p + "down_proj_bias"][e]}


def _sharded_dict(ps, cfg: dict, tensors: dict[str, torch.Tensor], ep_rank: int, ep: int, singleton: bool,
                  hf: dict | None, args=None):
    """Megatron's sharded state dict: `tensors` as plain ShardedTensors, the TE extra states, and per MoE
    layer the sharded state dict of a real SequentialMLP (its experts from `hf` when given)."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

    E, H, I = cfg["num_local_experts"], cfg["hidden_size"], cfg["intermediate_size"]
    local = E // ep
    meta = {"dp_cp_group": ps.get_data_parallel_group(with_context_parallel=True), "singleton_local_shards": singleton}
    sd, modules = {}, {}
    for name, t in tensors.items():
        sd[name] = ShardedTensor.from_rank_offsets(name, t, replica_id=(0, 0, ep_rank))
    for key, shape, offset in _te_extra_states(cfg["num_hidden_layers"]):
        sd[key] = ShardedObject(key, None, shape, offset, replica_id=(0, 0, ep_rank))
    for b in range(cfg["num_hidden_layers"]):
        mlp = _experts(H, I, local, args)
        if hf is not None:
            with torch.no_grad():
                for le, expert in enumerate(mlp.local_experts):
                    for n, t in _expert_params(hf, b, ep_rank * local + le).items():
                        dict(expert.named_parameters())[n].copy_(t)
        modules[b] = mlp
        sd.update(mlp.sharded_state_dict(prefix=f"decoder.layers.{2 * b + 1}.mlp.experts.", metadata=meta))
    return sd, modules


def load(ckpt: str, out: str, inputs: str | None = None) -> None:
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling
    from safetensors.torch import save_file

    ps = _init(0, 1, free_port())
    common = dist_checkpointing.load_common_state_dict(ckpt)
    args = common["args"]
    cfg = {"num_hidden_layers": args.num_layers // 2, "hidden_size": args.hidden_size,
           "num_attention_heads": args.num_attention_heads, "num_key_value_heads": args.num_query_groups,
           "head_dim": args.kv_channels, "num_local_experts": args.num_experts,
           "intermediate_size": args.moe_ffn_hidden_size}
    metadata = dist_checkpointing.load_tensors_metadata(ckpt)  # megatron's reading of the shapes
    plain = {k: torch.empty(tuple(v.global_shape), dtype=v.dtype) for k, v in metadata.items()
             if ".mlp.experts." not in k}
    sd, modules = _sharded_dict(ps, cfg, plain, 0, 1, False, None, args)
    state = dist_checkpointing.load(sd, ckpt, strict=StrictHandling.RAISE_ALL)
    flat = {k: v.contiguous() for k, v in state.items() if isinstance(v, torch.Tensor)}
    if inputs is not None:  # megatron-core's experts compute on the loaded weights
        from safetensors.torch import load_file

        x = load_file(inputs)["x"]
        for b, mlp in modules.items():
            prefix = f"decoder.layers.{2 * b + 1}.mlp.experts."
            mlp.load_state_dict({k[len(prefix):]: v for k, v in flat.items() if k.startswith(prefix)}, strict=False)
            with torch.no_grad():
                for e, expert in enumerate(mlp.local_experts):
                    y, bias = expert(x)
                    flat[f"expert_out.{b}.{e}"] = (y + bias if bias is not None else y).contiguous()
    save_file(flat, out)
    Path(out + ".json").write_text(json.dumps({"args": {k: v for k, v in vars(args).items()
                                                          if isinstance(v, (int, float, str, bool, list, tuple))
                                                          or v is None},
                                                "iteration": common.get("iteration"),
                                                "checkpoint_version": common.get("checkpoint_version"),
                                                "plain_keys": sorted(plain)}, default=str))
    dist.destroy_process_group()


def _rope(cfg: dict) -> dict:
    """The YaRN settings of an HF config (transformers 5 writes rope_parameters, the release rope_scaling)."""
    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    rope.setdefault("rope_theta", cfg.get("rope_theta"))
    return rope


def _save_rank(rank: int, hf_dir: str, out: str, ep: int, singleton: bool, port: int) -> None:
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
    from safetensors.torch import load_file

    ps = _init(rank, ep, port, ep)
    cfg = json.loads((Path(hf_dir) / "config.json").read_text())
    hf = {}
    for f in sorted(Path(hf_dir).glob("*.safetensors")):
        hf.update(load_file(f))
    padded = -(-cfg["vocab_size"] // 128) * 128
    plain = _plain_tensors(hf, cfg, padded)
    sd, _ = _sharded_dict(ps, cfg, plain, rank, ep, singleton, hf)
    # what a training save holds besides the model: optimizer state and each rank's RNG state
    sd["optimizer.state.exp_avg.decoder.final_norm.weight"] = ShardedTensor.from_rank_offsets(
        "optimizer.state.exp_avg.decoder.final_norm.weight", torch.ones(cfg["hidden_size"]), replica_id=(0, 0, rank))
    sd["rng_state"] = ShardedObject("rng_state", {"random_rng_state": [1, 2, 3]}, (ep,), (rank,), replica_id=0)
    sd["args"] = argparse.Namespace(
        num_layers=2 * cfg["num_hidden_layers"], hybrid_override_pattern="*E" * cfg["num_hidden_layers"],
        hidden_size=cfg["hidden_size"], ffn_hidden_size=cfg["intermediate_size"],
        moe_ffn_hidden_size=cfg["intermediate_size"], num_attention_heads=cfg["num_attention_heads"],
        num_query_groups=cfg["num_key_value_heads"], kv_channels=cfg["head_dim"], num_experts=cfg["num_local_experts"],
        moe_router_topk=cfg["num_experts_per_tok"], vocab_size=cfg["vocab_size"], padded_vocab_size=padded,
        make_vocab_size_divisible_by=128, max_position_embeddings=cfg["max_position_embeddings"],
        norm_epsilon=cfg["rms_norm_eps"], rotary_base=_rope(cfg)["rope_theta"],
        yarn_rotary_scaling_factor=_rope(cfg)["factor"],
        yarn_original_max_position_embeddings=_rope(cfg)["original_max_position_embeddings"],
        yarn_beta_fast=_rope(cfg)["beta_fast"], yarn_beta_slow=_rope(cfg)["beta_slow"],
        activation_func_clamp_value=cfg["swiglu_limit"], window_size=(cfg["sliding_window"] - 1, 0),
        window_attn_skip_freq=[int(t == "sliding_attention") if i % 2 == 0 else 0
                               for i, t in enumerate(x for lt in cfg["layer_types"] for x in (lt, None))],
        tensor_model_parallel_size=1, pipeline_model_parallel_size=1, expert_model_parallel_size=ep,
        moe_aux_loss_coeff=cfg.get("router_aux_loss_coef"), init_method_std=cfg.get("initializer_range"),
        params_dtype=torch.float32)
    sd["iteration"] = 7
    sd["checkpoint_version"] = 3.0
    dist_checkpointing.save(sd, out, sharded_strategy=("torch_dist", 1))
    dist.barrier()
    dist.destroy_process_group()


def save(hf_dir: str, out: str, ep: int, singleton: bool) -> None:
    import torch.multiprocessing as mp

    Path(out).mkdir(parents=True, exist_ok=True)
    port = free_port()  # a fixed port collides with any other test or job on this host
    if ep == 1:
        _save_rank(0, hf_dir, out, 1, singleton, port)
    else:
        mp.spawn(_save_rank, args=(hf_dir, out, ep, singleton, port), nprocs=ep)


# --- the whole model ------------------------------------------------------------------------
TOKENS = [[5, 17, 401, 999, 3, 250, 77, 1001, 64, 8, 512, 33]]  # [batch, seq]: ids below the tiny vocabulary


def _config(args):
    """A TransformerConfig for GPT-OSS from Megatron-LM's args, as Megatron-LM and Megatron-Bridge set it
    up (quick_gelu gate with clamp and +1 on the linear half, learnable softmax offset = sinks, sliding
    windows, YaRN read by the attention from the config's yarn_* fields), unfused for the CPU."""
    from megatron.core.fusions.fused_bias_geglu import quick_gelu
    from megatron.core.transformer.transformer_config import TransformerConfig

    cfg = TransformerConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size, num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups, kv_channels=args.kv_channels, ffn_hidden_size=args.ffn_hidden_size,
        moe_ffn_hidden_size=args.moe_ffn_hidden_size, num_moe_experts=args.num_experts,
        moe_router_topk=args.moe_router_topk, moe_router_load_balancing_type="none",
        moe_token_dispatcher_type="allgather", gated_linear_unit=True, activation_func=quick_gelu,
        glu_linear_offset=args.glu_linear_offset, activation_func_clamp_value=args.activation_func_clamp_value,
        add_bias_linear=True, add_qkv_bias=True, normalization="RMSNorm", layernorm_epsilon=args.norm_epsilon,
        softmax_type="learnable", window_size=tuple(args.window_size),
        window_attn_skip_freq=args.window_attn_skip_freq, hidden_dropout=0.0, attention_dropout=0.0,
        bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
        apply_rope_fusion=False, gradient_accumulation_fusion=False, persist_layer_norm=False,
        use_cpu_initialization=True, params_dtype=torch.float32, expert_model_parallel_size=args.ep)
    for name in ("yarn_rotary_scaling_factor", "yarn_original_max_position_embeddings", "yarn_beta_fast",
                 "yarn_beta_slow", "yarn_correction_range_round_to_int"):
        setattr(cfg, name, getattr(args, name))  # Megatron-Bridge's GPT provider carries them as fields
    cfg.yarn_mscale = cfg.yarn_mscale_all_dim = None
    return cfg


def _local_stack_spec(num_experts: int):
    """MambaStack with megatron-core's local (non-Transformer-Engine) modules: what get_gpt_layer_local_spec
    builds, split into the hybrid stack's attention and MoE layers, its layernorms keyed as the TE spec
    stores them (`input_layernorm.` -> `self_attention.linear_qkv.layer_norm_`)."""
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.ssm.mamba_block import MambaStack, MambaStackSubmodules
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_layer import (
        MoETransformerLayer, TransformerLayer, TransformerLayerSubmodules,
    )

    attention = ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
        input_layernorm=WrappedTorchNorm,
        self_attention=ModuleSpec(module=SelfAttention, params={"attn_mask_type": AttnMaskType.causal},
                                  submodules=SelfAttentionSubmodules(linear_qkv=ColumnParallelLinear,
                                                                     core_attention=DotProductAttention,
                                                                     linear_proj=RowParallelLinear)),
        self_attn_bda=get_bias_dropout_add,
        sharded_state_dict_keys_map={"input_layernorm.": "self_attention.linear_qkv.layer_norm_"}))
    moe = ModuleSpec(module=MoETransformerLayer, submodules=TransformerLayerSubmodules(
        pre_mlp_layernorm=WrappedTorchNorm, mlp=get_moe_module_spec(use_te=False, num_experts=num_experts),
        mlp_bda=get_bias_dropout_add))
    return ModuleSpec(module=MambaStack, submodules=MambaStackSubmodules(attention_layer=attention, moe_layer=moe))


class _Yarn(torch.nn.Module):
    """MambaModel (0.16.1) offers rope or none; GPTModel's yarn path hands the attention YarnRotaryEmbedding's
    frequencies (the attention scales cos/sin by the config's YaRN mscale). So does this stand-in."""

    def __init__(self, args):
        super().__init__()
        from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import YarnRotaryEmbedding

        self.yarn = YarnRotaryEmbedding(
            kv_channels=args.kv_channels, rotary_base=args.rotary_base, use_cpu_initialization=True,
            scaling_factor=args.yarn_rotary_scaling_factor,
            original_max_position_embeddings=args.yarn_original_max_position_embeddings,
            beta_fast=args.yarn_beta_fast, beta_slow=args.yarn_beta_slow, mscale=None, mscale_all_dim=None,
            correction_range_round_to_int=args.yarn_correction_range_round_to_int)

    def get_rotary_seq_len(self, *a, **k):
        return self.yarn.get_rotary_seq_len(*a, **k)

    def forward(self, seq_len, packed_seq=False):
        return self.yarn(seq_len, packed_seq=packed_seq)[0]


def _masks_on_cpu() -> None:
    """megatron-core's softmax builds its causal and sliding-window masks on "cuda": the same masks on the CPU."""
    from megatron.core.fusions import fused_softmax
    from megatron.core.transformer import utils

    real_default, real_window = utils.get_default_causal_mask, utils.get_sliding_window_causal_mask
    cuda = torch.device("cuda")

    def on_cpu(fn):
        def call(*a):
            real_ones = torch.ones
            torch.ones = lambda *s, device=None, **k: real_ones(*s, **k, device="cpu" if device in ("cuda", cuda) else device)
            try:
                return fn(*a)
            finally:
                torch.ones = real_ones
        return call

    fused_softmax.get_default_causal_mask = on_cpu(real_default)
    fused_softmax.get_sliding_window_causal_mask = on_cpu(real_window)
    # no dropout here (rates 0): the CUDA RNG tracker the attention forks is not needed
    from megatron.core.tensor_parallel import random

    random.CudaRNGStatesTracker.fork = lambda self, *a, **k: contextlib.nullcontext()
    # 0.16.1's moe_utils names Transformer Engine's kernels only when TE imports, then tests them for None
    from megatron.core.transformer.moe import moe_utils

    for name in ("te_general_gemm", "fused_topk_with_score_function", "fused_permute", "fused_unpermute",
                 "fused_permute_with_probs", "fused_sort_chunks_by_index", "fused_sort_chunks_by_index_with_probs",
                 "fused_moe_aux_loss", "fused_compute_score_for_moe_aux_loss"):
        if not hasattr(moe_utils, name):
            setattr(moe_utils, name, None)


def _load_and_run(ckpt: str, args, ep: int) -> tuple[torch.Tensor, dict]:
    """Build the model for this rank at expert parallel size `ep`, load CKPT into it with megatron-core's
    loader, and run it on TOKENS: (logits [seq, batch, padded vocab], what the load found)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling
    from megatron.core.models.mamba.mamba_model import MambaModel

    args.ep = ep
    torch.manual_seed(0)
    model = MambaModel(config=_config(args), mamba_stack_spec=_local_stack_spec(args.num_experts),
                       vocab_size=args.padded_vocab_size, max_sequence_length=args.max_position_embeddings,
                       hybrid_override_pattern=args.hybrid_override_pattern, position_embedding_type="rope",
                       rotary_base=args.rotary_base, share_embeddings_and_output_weights=False)
    model.rotary_pos_emb = _Yarn(args)
    sharded = model.sharded_state_dict()
    # RETURN_ALL: the load reports instead of raising. megatron-core's words: "unexpected" = asked for by the
    # model, absent from the checkpoint (the default strictness raises "Missing key in checkpoint state_dict");
    # "missing" = in the checkpoint, not asked for (Megatron-LM's default assume_ok_unexpected ignores those)
    state, missing, unexpected = dist_checkpointing.load(sharded, ckpt, strict=StrictHandling.RETURN_ALL)
    own = model.state_dict()
    model.load_state_dict({k: v for k, v in state.items() if k in own})  # strict: every module state present
    model.eval()
    tokens = torch.tensor(TOKENS)
    with torch.no_grad():
        logits = model(tokens, torch.arange(tokens.shape[1]).unsqueeze(0), attention_mask=None)
    return logits, {"absent": sorted(map(str, unexpected)), "not_asked": sorted(map(str, missing)),
                    "requested": sorted(sharded)}


def _model_rank(rank: int, ckpt: str, out: str, world: int, port: int) -> None:
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron.core.ssm import mamba_block
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from safetensors.torch import save_file

    mamba_block.TENorm = WrappedTorchNorm  # the stack's final norm is TE's in 0.16.1; the local spec's otherwise
    _init(rank, world, port, world)
    _masks_on_cpu()
    args = dist_checkpointing.load_common_state_dict(ckpt)["args"]
    logits, report = {}, {}
    for ep in (world, 1):  # one process group: EP=world first, then every rank holding every expert
        if ep != world:
            ps.destroy_model_parallel()
            ps.initialize_model_parallel(1, 1, expert_model_parallel_size=ep)
        logits[f"logits_ep{ep}"], report[f"ep{ep}"] = _load_and_run(ckpt, args, ep)
    if rank == 0:
        save_file({k: v.float().contiguous() for k, v in logits.items()}, out)
        Path(out + ".json").write_text(json.dumps(report))
    dist.barrier()
    dist.destroy_process_group()


def model(ckpt: str, out: str, world: int) -> None:
    import torch.multiprocessing as mp

    port = free_port()
    if world == 1:
        _model_rank(0, ckpt, out, 1, port)
    else:
        mp.spawn(_model_rank, args=(ckpt, out, world, port), nprocs=world)


if __name__ == "__main__":
    torch.set_num_threads(1)
    if sys.argv[1] == "load":
        load(sys.argv[2], sys.argv[3], *sys.argv[4:5])
    elif sys.argv[1] == "model":
        model(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    else:
        save(sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5] == "1")
