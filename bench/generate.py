"""Benchmark `gptoss generate`'s decoding: KV-cache tokens/s against transformers' `generate` (its own
sliding-window cache, the peer's strongest CPU setting: eager attention, which GPT-OSS's sinks need)
and against recomputing the whole sequence at every step, all timed in the same run.

A GPT-OSS-shaped model (sliding and full layers alternating, sinks, GQA, MoE top-k, YaRN), random
weights, fp32 on CPU, greedy. Every method must produce the same tokens (checked), so the times
compare the same work. Prints the median seconds over --repeats and tokens/s, and the ratios.

    python bench/generate.py --prompt 128 --new 128 --repeats 3
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def build(args):
    import transformers

    from gptoss_cli.model.hybrid import HybridModel
    from tests.model.conftest import randomize_, tiny_hf_config

    layers = args.layers
    cfg = tiny_hf_config(num_hidden_layers=layers, hidden_size=args.hidden, intermediate_size=args.hidden * 3 // 2,
                         num_attention_heads=8, num_key_value_heads=2, head_dim=args.hidden // 8,
                         num_local_experts=8, num_experts_per_tok=2, vocab_size=8003, sliding_window=args.window,
                         layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
                         pad_token_id=8001, eos_token_id=8002)
    torch.manual_seed(0)
    hf = transformers.GptOssForCausalLM(cfg).eval()
    randomize_(hf)
    from gptoss_cli.checkpoint.hf_config import from_hf_config

    arch = from_hf_config(cfg.to_dict())
    ours = HybridModel(arch).eval()
    from tests.model.conftest import hf_to_hybrid_state_dict

    ours.load_state_dict(hf_to_hybrid_state_dict(hf.state_dict(), num_layers=layers, heads=8, kv=2,
                                                 hd=args.hidden // 8), strict=True)
    return hf, ours


def timed(fn, repeats: int):
    out, times = None, []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return out, statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--window", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    import transformers

    from gptoss_cli.generate.decode import generate_ids

    hf, ours = build(args)
    prompt = torch.randint(0, 8000, (1, args.prompt), generator=torch.Generator().manual_seed(1))
    gen_cfg = transformers.GenerationConfig(max_new_tokens=args.new, do_sample=False, eos_token_id=None, pad_token_id=0)

    def run_hf():
        with torch.no_grad():
            return hf.generate(prompt, generation_config=gen_cfg)[0, args.prompt:].tolist()

    def run_cached():
        return generate_ids(ours, prompt.tolist(), max_new_tokens=args.new)[0].output_ids

    def run_recompute():
        seq = prompt
        with torch.no_grad():
            for _ in range(args.new):
                nxt = ours(seq).logits[:, -1].argmax(-1, keepdim=True)
                seq = torch.cat([seq, nxt], dim=1)
        return seq[0, args.prompt:].tolist()

    results = {}
    for name, fn in (("transformers generate (baseline)", run_hf), ("gptoss KV cache", run_cached),
                     ("gptoss recompute each step", run_recompute)):
        results[name] = timed(fn, args.repeats)
    tokens = {name: r[0] for name, r in results.items()}
    base_name = "transformers generate (baseline)"
    agree = {name: t == tokens[base_name] for name, t in tokens.items()}
    print(f"model: hidden {args.hidden}, {args.layers} layers (window {args.window}), 8 experts top-2, vocab 8003; "
          f"prompt {args.prompt}, {args.new} new tokens, greedy, fp32, {args.threads} thread(s), "
          f"median of {args.repeats}")
    base = results[base_name][1]
    for name, (_, sec) in results.items():
        print(f"  {name:34s} {sec:8.3f} s  {args.new / sec:8.1f} tokens/s  ratio to baseline {base / sec:5.2f}x  "
              f"same tokens: {agree[name]}")
    cached = results["gptoss KV cache"][1]
    print(f"KV cache vs recompute each step: {results['gptoss recompute each step'][1] / cached:.2f}x")


if __name__ == "__main__":
    main()
