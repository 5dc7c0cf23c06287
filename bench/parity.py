"""Peak RSS and time per block of `gptoss parity-check` on synthetic checkpoints with 120B dimensions.

Claim: parity-check holds one HF block (Hybrid layers 2i, 2i+1) at a time, so its peak memory
does not grow with the number of blocks. We build synthetic GPT-OSS 120B-shaped checkpoints
(hidden = intermediate = 2880, 64 q / 8 kv heads, head_dim 64, 128 experts top-4, MXFP4
experts as released) with 1, 2 and 4 blocks, convert each to Hybrid with `convert`, and run
parity-check in a fresh process per size. Printed: peak RSS per size and its ratio to the
1-block run (flat = ~1.0), seconds per block, and the RSS of the same process after imports.

The vocabulary is kept small (default 2048 instead of 201088) so the embedding and output
layer, which are not per-block, do not dominate; pass --vocab 201088 for the real one.
Disk: about 1.7 GB (HF, MXFP4) + 6.4 GB (Hybrid, bf16) per block with 128 experts.

The run is in bfloat16 (a 120B block in fp32 needs ~13 GB per side). The "passed" column is not
the point here: on random weights with 32+ experts, bf16 rounding differences between
transformers' eager path and ours flip near-tied top-4 routing decisions, so bf16 runs can
diverge beyond the bf16 defaults; the same synthetic checkpoints pass in float32 (measured at
real dims with 4 and 32 experts: block max abs diff < 1e-4, logits KL < 1e-12).

    python bench/parity.py --workdir /tmp/parity-bench [--experts 128] [--blocks 1 2 4]
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench import harness  # noqa: E402


def arch_for(blocks: int, experts: int, vocab: int):
    from gptoss_cli.model.config import preset

    return preset("gpt_oss_120b").replace(num_hidden_layers=blocks, num_local_experts=experts, vocab_size=vocab)


def write_block(path: Path, arch, i: int) -> None:
    """One HF block with MXFP4 experts, as the released checkpoints store it (docs/checkpoint-layouts.md)."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(1000 + i)
    H, I, E = arch.hidden_size, arch.intermediate_size, arch.num_local_experts
    q, kv = arch.num_attention_heads * arch.head_dim, arch.num_key_value_heads * arch.head_dim
    bf = torch.bfloat16

    def randn(*shape, std=0.02):
        return (torch.randn(*shape, generator=g) * std).to(bf)

    def mx(e, out, inp):
        blocks = torch.randint(0, 256, (e, out, inp // 32, 16), generator=g, dtype=torch.uint8)
        scales = torch.full((e, out, inp // 32), 121, dtype=torch.uint8)  # 2**-6: weights ~ 0.05
        return blocks, scales

    p = f"model.layers.{i}."
    t = {
        p + "input_layernorm.weight": torch.ones(H, dtype=bf),
        p + "post_attention_layernorm.weight": torch.ones(H, dtype=bf),
        p + "self_attn.q_proj.weight": randn(q, H), p + "self_attn.q_proj.bias": randn(q),
        p + "self_attn.k_proj.weight": randn(kv, H), p + "self_attn.k_proj.bias": randn(kv),
        p + "self_attn.v_proj.weight": randn(kv, H), p + "self_attn.v_proj.bias": randn(kv),
        p + "self_attn.o_proj.weight": randn(H, q), p + "self_attn.o_proj.bias": randn(H),
        p + "self_attn.sinks": randn(arch.num_attention_heads, std=1.0),
        p + "mlp.router.weight": randn(E, H), p + "mlp.router.bias": randn(E),
        p + "mlp.experts.gate_up_proj_bias": randn(E, 2 * I), p + "mlp.experts.down_proj_bias": randn(E, H),
    }
    t[p + "mlp.experts.gate_up_proj_blocks"], t[p + "mlp.experts.gate_up_proj_scales"] = mx(E, 2 * I, H)
    t[p + "mlp.experts.down_proj_blocks"], t[p + "mlp.experts.down_proj_scales"] = mx(E, H, I)
    save_file(t, str(path), metadata={"format": "pt"})


def write_globals(path: Path, arch) -> None:
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(7)
    H, V = arch.hidden_size, arch.vocab_size
    save_file(
        {
            "model.embed_tokens.weight": (torch.randn(V, H, generator=g) * 0.02).bfloat16(),
            "model.norm.weight": torch.ones(H, dtype=torch.bfloat16),
            "lm_head.weight": (torch.randn(V, H, generator=g) * 0.02).bfloat16(),
        },
        str(path),
        metadata={"format": "pt"},
    )


def hf_view(shards: Path, folder: Path, arch) -> None:
    """An HF folder of the first `arch.num_hidden_layers` blocks: hard-linked shards + index + config."""
    from safetensors import safe_open

    from gptoss_cli.checkpoint.formats.hf.config import to_hf_config

    folder.mkdir(parents=True)
    files = ["globals.safetensors"] + [f"block-{i:05d}.safetensors" for i in range(arch.num_hidden_layers)]
    weight_map = {}
    for f in files:
        os.link(shards / f, folder / f)  # hard links: the reader refuses links leaving the folder
        with safe_open(str(shards / f), "pt") as fh:
            weight_map.update({k: f for k in fh.keys()})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (folder / "config.json").write_text(json.dumps(to_hf_config(arch, experts_form="mxfp4"), indent=2))


def child(hf: str, hybrid: str, dtype: str, seq_len: int) -> None:
    import transformers  # noqa: F401  (counted in the after-imports baseline)

    from gptoss_cli.parity import run_parity

    from gptoss_cli.resources import peak_rss_bytes

    base = peak_rss_bytes()
    t0 = time.perf_counter()
    report = run_parity(hf, hybrid, dtype=dtype, seq_len=seq_len)
    print(json.dumps({
        "passed": report.passed, "summary": report.summary(), "peak_rss": report.peak_rss_bytes,
        "rss_after_imports": base, "seconds_per_block": report.seconds_per_block,
        "seconds": time.perf_counter() - t0,
    }))


def main() -> None:
    ap = harness.parser(__doc__)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/gptoss-parity-bench"))
    ap.add_argument("--blocks", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--seq-len", type=int, default=288)
    ap.add_argument("--child", nargs=2, metavar=("HF", "HYBRID"))
    args = ap.parse_args()
    if args.child:
        child(*args.child, args.dtype, args.seq_len)
        return

    from gptoss_cli.checkpoint.convert import convert
    from gptoss_cli.resources import keep_freed_memory

    keep_freed_memory()  # as `gptoss convert` does before converting
    run = harness.Run("parity", args, clock="wall").__enter__()
    work = args.workdir
    shutil.rmtree(work, ignore_errors=True)
    shards = work / "shards"
    shards.mkdir(parents=True)
    top = arch_for(max(args.blocks), args.experts, args.vocab)
    t0 = time.perf_counter()
    write_globals(shards / "globals.safetensors", top)
    for i in range(top.num_hidden_layers):
        write_block(shards / f"block-{i:05d}.safetensors", top, i)
    print(f"synthetic HF shards: {max(args.blocks)} blocks, {args.experts} experts, vocab {args.vocab}: "
          f"{time.perf_counter() - t0:.1f}s")

    rows = []
    for n in args.blocks:
        hf = work / f"hf-{n}"
        hybrid = work / f"hybrid-{n}"
        hf_view(shards, hf, arch_for(n, args.experts, args.vocab))
        t0 = time.perf_counter()
        convert(str(hf), hybrid, dtype="bfloat16")
        t_convert = time.perf_counter() - t0
        out = subprocess.run(
            [sys.executable, __file__, "--child", str(hf), str(hybrid), "--dtype", args.dtype,
             "--seq-len", str(args.seq_len)],
            capture_output=True, text=True,
        )
        if out.returncode != 0:
            sys.exit(f"parity-check child failed for {n} blocks:\n{out.stderr[-3000:]}")
        r = json.loads(out.stdout.strip().splitlines()[-1])
        r.update(blocks=n, convert_seconds=t_convert)
        rows.append(r)
        shutil.rmtree(hybrid)
        print(f"{n} blocks done: {r['summary']}", flush=True)
        case = f"{n} block{'s' if n > 1 else ''}, {args.experts} experts, {args.dtype}"
        run.add(case, "parity-check", "peak_rss_gb", r["peak_rss"] / 1e9)
        run.add(case, "parity-check", "rss_after_imports_gb", r["rss_after_imports"] / 1e9)
        run.add(case, "parity-check", "seconds_per_block_s", r["seconds_per_block"] or [float("nan")])
        run.add(case, "convert", "time_s", t_convert)

    base = rows[0]["peak_rss"]
    print(f"\n{'blocks':>6} {'peak RSS GB':>12} {'vs 1 block':>10} {'RSS after imports GB':>21} "
          f"{'s/block (mean)':>15} {'convert s':>10}  passed")
    for r in rows:
        spb = sum(r["seconds_per_block"]) / max(1, len(r["seconds_per_block"]))
        print(f"{r['blocks']:>6} {r['peak_rss'] / 1e9:>12.2f} {r['peak_rss'] / base:>10.3f} "
              f"{r['rss_after_imports'] / 1e9:>21.2f} {spb:>15.1f} {r['convert_seconds']:>10.1f}  {r['passed']}")
    shutil.rmtree(work, ignore_errors=True)
    run.extra["runs"] = rows
    run.finish()


if __name__ == "__main__":
    main()
