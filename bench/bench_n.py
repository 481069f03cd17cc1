#!/usr/bin/env python3
"""n > 1 samples per request (prompt computed once, blocks shared copy-on-write) vs the same samples sent as
separate requests, on one engine, in one run.

    python bench/bench_n.py --json bench/results/n_cpu.json

Workload: --prompts prompts of --prompt-len random tokens, --n samples each, --max-tokens tokens per sample
(temperature 1, EOS ignored). "forked" sends each prompt once with n=N and seed s; "separate" sends N
requests per prompt seeded s+i, which are the same samples (sample i of a forked request is seeded s+i), so
the outputs are compared token for token. Both run on the embedded default model (CPU, fp32). With prefix
caching on (the default), "separate" already shares the prompt's full blocks through the cache (copies
admitted in the same pass hit the blocks the first one's planning hashed), so forking saves only the
partial last block; --no-prefix-caching shows what forking saves on its own. Interleaved repeats, median
reported; the first pair is a warm-up. TTFT: from submission to a request's first streamed token.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_engine_cpu import engine_revision, machine_info  # noqa: E402

from engine import LLM, SamplingParams  # noqa: E402


def run(llm: LLM, prompts: list[list[int]], args, forked: bool) -> dict:
    engine = llm.engine
    steps0, computed = engine.counters["steps"], 0
    if forked:
        reqs = [(p, SamplingParams(n=args.n, temperature=1.0, seed=args.seed, max_tokens=args.max_tokens,
                                   ignore_eos=True)) for p in prompts]
    else:
        reqs = [(p, SamplingParams(temperature=1.0, seed=args.seed + i, max_tokens=args.max_tokens,
                                   ignore_eos=True)) for p in prompts for i in range(args.n)]
    first: dict = {}
    outputs: dict = {}
    peak_used = 0
    t0 = time.perf_counter()
    ids = [engine.add_request(p, sp, stream=True) for p, sp in reqs]
    while engine.has_unfinished():
        for out in engine.step():
            key = (out.request_id, out.index)
            if out.token_ids and key not in first:
                first[key] = time.perf_counter() - t0
            if out.finished:
                outputs[key] = out.token_ids
        computed += engine.last_step_timing.get("num_tokens", 0) if engine.counters["steps"] != steps0 else 0
        steps0 = engine.counters["steps"]
        bm = engine.block_manager
        peak_used = max(peak_used, bm.num_blocks - bm.num_free)
    wall = time.perf_counter() - t0
    if forked:  # prompt order, then sample order: comparable with the separate run's request order
        tokens = [outputs[rid, i] for rid in ids for i in range(args.n)]
    else:
        tokens = [outputs[rid, 0] for rid in ids]
    return {"wall_s": wall, "output_tok_s": sum(map(len, tokens)) / wall,
            "ttft_p50_ms": 1e3 * statistics.median(first.values()), "tokens_computed": computed,
            "peak_kv_blocks": peak_used, "tokens": tokens}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=300)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-prefix-caching", action="store_true", help="separate requests then share nothing")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    llm = LLM(max_num_seqs=64, enable_prefix_caching=not args.no_prefix_caching)
    vocab = llm.engine.spec.vocab_size
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(10, vocab) for _ in range(args.prompt_len)] for _ in range(args.prompts)]
    results: dict[str, list[dict]] = {"forked": [], "separate": []}
    for rep in range(args.repeats + 1):
        for mode in ("forked", "separate") if rep % 2 else ("separate", "forked"):
            llm.engine.block_manager.reset_prefix_cache()  # every run starts cold
            r = run(llm, prompts, args, mode == "forked")
            if rep:
                results[mode].append(r)
            print(f"[bench] rep {rep} {mode}: {r['wall_s']:.2f} s, {r['output_tok_s']:.0f} tok/s", file=sys.stderr)
    same = all(a["tokens"] == b["tokens"] for a, b in zip(results["forked"], results["separate"]))
    summary = {mode: {k: statistics.median(r[k] for r in rs) for k in rs[0] if k != "tokens"}
               for mode, rs in results.items()}
    report = {"machine": machine_info(), "engine": engine_revision(), "device": "cpu (measured, not simulated)",
              "workload": vars(args) | {"json": str(args.json) if args.json else None},
              "outputs_identical": same, **summary,
              "speedup_wall": summary["separate"]["wall_s"] / summary["forked"]["wall_s"]}
    print(json.dumps(report, indent=2))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    llm.shutdown()


if __name__ == "__main__":
    main()
