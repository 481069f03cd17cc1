#!/usr/bin/env python3
"""Tensor parallelism on CPU: TP=2 vs TP=1 throughput on the same work, and what the collectives cost per step.

Every configuration runs the same seeded workload (N requests, prompt and output lengths uniform in a range,
greedy, ignore_eos) through the offline engine:
  - tp=1: the plain single-device engine (LLM, no Ray);
  - tp=N: rank 0 in this process, ranks 1..N-1 as Ray actors (cluster/tensor_parallel.py), gloo collectives;
  - with --local, also tp=N with the worker ranks as threads of this process (engine/tp/local.py).
Each configuration: a warm-up run (excluded), then --repeats timed runs; the median is reported. For TP, rank
0's time blocked in collectives is reported per step, in all and by kind (the all-reduces of the embedding and
the row-parallel layers, the broadcast of the step's inputs, the logits gather), and as a share of the wall
time, from the engine's own counters (`tp_collective_s`, `tp_all_reduce_s`, ...). Blocked time includes
waiting for the slower rank, so on oversubscribed cores it measures imbalance as much as transfer.

    python bench/bench_tp.py --json bench/results/tp_cpu.json

On a CPU machine the ranks share its cores (and its memory bandwidth) with each other and the driver, so this
measures the mechanism and its overhead, not a multi-GPU speedup; on a 2-core machine shared with other work
the figures are noisy.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

from bench_engine_cpu import machine_info, model_shape  # noqa: E402
from engine import LLM, EngineConfig, SamplingParams  # noqa: E402
from engine.config import DEFAULT_MODEL_DIR  # noqa: E402


def workload(args, vocab: int) -> tuple[list[list[int]], list[SamplingParams]]:
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(args.min_in, args.max_in))]
               for _ in range(args.requests)]
    params = [SamplingParams(max_tokens=rng.randint(args.min_out, args.max_out), temperature=0, ignore_eos=True)
              for _ in prompts]
    return prompts, params


def engine_kwargs(args, tp: int) -> dict:
    return dict(model=args.model, device="cpu", tensor_parallel_size=tp, max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_batched_tokens, enable_prefix_caching=False,
                tp_worker_num_cpus=args.worker_cpus)


def make_engine(args, tp: int, local: bool):
    """(engine-like object with generate/stats/shutdown, label)."""
    if local:
        from engine.tp import TensorParallelEngine
        from engine.tp.local import LocalTPWorkerGroup

        return _EngineLLM(TensorParallelEngine(EngineConfig(**engine_kwargs(args, tp)), LocalTPWorkerGroup)), \
            f"tp={tp} (threads)"
    return LLM(**engine_kwargs(args, tp)), f"tp={tp}" + (" (Ray actors)" if tp > 1 else "")


class _EngineLLM:
    """LLM's generate/stats/shutdown over an already built engine."""

    def __init__(self, engine):
        self.engine = engine

    def generate(self, prompts, params):
        ids = [self.engine.add_request(p, sp) for p, sp in zip(prompts, params)]
        done = {}
        while self.engine.has_unfinished():
            for out in self.engine.step():
                if out.finished:
                    done[out.request_id] = out
        return [done[i] for i in ids]

    def stats(self):
        return self.engine.stats()

    def shutdown(self):
        self.engine.shutdown()


def measure(llm, prompts, params, repeats: int) -> dict:
    llm.generate(prompts, params)  # warm-up
    runs = []
    for _ in range(repeats):
        before = llm.stats()
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params)
        wall = time.perf_counter() - t0
        after = llm.stats()
        steps = after.steps - before.steps
        tp = after.tensor_parallel_size is not None  # the tensor-parallel engine; tp=1 has no collectives

        def change(key):
            return getattr(after, key) - getattr(before, key) if tp else 0

        def per_step_ms(key):
            return 1e3 * change(key) / max(steps, 1)
        comm_s, calls = change("tp_collective_s"), change("tp_collectives")
        runs.append({"tok_s": sum(len(o.token_ids) for o in outs) / wall, "wall_s": wall, "steps": steps,
                     "collective_ms_per_step": per_step_ms("tp_collective_s"),
                     "all_reduce_ms_per_step": per_step_ms("tp_all_reduce_s"),
                     "broadcast_ms_per_step": per_step_ms("tp_broadcast_s"),
                     "gather_ms_per_step": per_step_ms("tp_gather_s"),
                     "collectives_per_step": calls / max(steps, 1), "collective_share": comm_s / wall})
    best = statistics.median(r["tok_s"] for r in runs)
    median_run = min(runs, key=lambda r: abs(r["tok_s"] - best))
    return {**median_run, "tok_s": best, "runs": [round(r["tok_s"], 1) for r in runs]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(DEFAULT_MODEL_DIR))
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--min-in", type=int, default=16)
    ap.add_argument("--max-in", type=int, default=64)
    ap.add_argument("--min-out", type=int, default=16)
    ap.add_argument("--max-out", type=int, default=32)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--max-batched-tokens", type=int, default=256)
    ap.add_argument("--worker-cpus", type=float, default=1.0, help="logical CPUs (and threads) per worker rank")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--local", action="store_true", help="also TP with the worker ranks as threads")
    ap.add_argument("--json", type=Path, help="write the results here")
    args = ap.parse_args()

    shape = model_shape(Path(args.model))
    prompts, params = workload(args, shape["vocab"])
    results = {"machine": machine_info(), "model": shape, "args": {k: str(v) for k, v in vars(args).items()},
               "configs": {}}
    import ray

    ray.init(num_cpus=max(2, args.tp + 1), include_dashboard=False, log_to_driver=False)
    configs = [(1, False), (args.tp, False)] + ([(args.tp, True)] if args.local else [])
    for tp, local in configs:
        llm, label = make_engine(args, tp, local)
        try:
            results["configs"][label] = r = measure(llm, prompts, params, args.repeats)
        finally:
            llm.shutdown()
        extra = (f", collectives {r['collective_ms_per_step']:.2f} ms/step ({r['collectives_per_step']:.0f} calls,"
                 f" {100 * r['collective_share']:.0f}% of wall; all-reduce {r['all_reduce_ms_per_step']:.2f},"
                 f" step broadcast {r['broadcast_ms_per_step']:.2f}, logits gather {r['gather_ms_per_step']:.2f})"
                 ) if tp > 1 else ""
        print(f"{label:22s} {r['tok_s']:7.1f} tok/s (runs {r['runs']}), {r['steps']} steps{extra}", flush=True)
    ray.shutdown()
    print(json.dumps({"machine": results["machine"], "model": shape}))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
