#!/usr/bin/env python3
"""Pipeline parallelism: throughput of p stages vs 1 on the same total work, SiPipe's ablation, stage busy.

Every configuration runs the same seeded workload (N requests, prompt and output lengths uniform in a range,
ignore_eos, top-k/top-p sampling as in SiPipe's evaluation, no seeds so the last stage can sample in the
ablation) through the pipeline engine over Ray stage actors and a compiled graph:
  - p=1: one stage actor holding every layer (same driver, transport and sampling path: the baseline);
  - p=2 (or --stages): all three SiPipe techniques on; then each one off in turn (the paper's ablation):
    no CPU sampling (the last stage samples), no token-safe execution (one input-buffer version, prepared
    after the hidden states arrive), no structure-aware transmission (hidden states sent with metadata).
The plain single-device engine (LLM, no Ray) is measured in the same run as a reference.
Each configuration: a warm-up run (excluded), then --repeats timed runs; the median is reported, with each
stage's busy fraction (its prepare + forward time over the wall time of the run).

    python bench/bench_pipeline.py --json bench/results/pipeline_cpu.json

Stage actors reserve --stage-cpus logical CPUs each; Ray sets their torch threads to that number. On a CPU
machine the stages share its cores with the driver, so this measures the mechanism, not a GPU speedup.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

from bench_engine_cpu import build_checkpoint, machine_info, model_shape  # noqa: E402
from engine import LLM, EngineConfig, SamplingParams  # noqa: E402


def workload(args) -> tuple[list[list[int]], list[SamplingParams]]:
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(1, args.vocab) for _ in range(rng.randint(args.min_in, args.max_in))]
               for _ in range(args.requests)]
    params = [SamplingParams(max_tokens=rng.randint(args.min_out, args.max_out), temperature=0.8, top_k=50,
                             top_p=0.95, ignore_eos=True) for _ in prompts]
    return prompts, params


def engine_config(model: str, args, stages: int, **switches) -> EngineConfig:
    return EngineConfig(model=model, device="cpu", pipeline_parallel_size=max(stages, 1),
                        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_batched_tokens,
                        enable_prefix_caching=False, pp_stage_num_cpus=args.stage_cpus, **switches)


def make_pipeline(model: str, args, stages: int, **switches):
    from cluster.pipeline import RayStageGroup
    from engine.pipeline import PipelineEngine

    cfg = engine_config(model, args, stages, **switches)
    return PipelineEngine(cfg, lambda specs: RayStageGroup(specs, stage_num_cpus=args.stage_cpus))


def timed_run(engine, prompts, params) -> dict:
    stages = getattr(engine.runner, "stages", None)  # a PipelineRunner's stage group
    if stages is not None:
        stages.busy_seconds()  # zero the stages' counters
    t0 = time.perf_counter()
    for p, sp in zip(prompts, params):
        engine.add_request(p, sp)
    tokens = 0
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                tokens += len(out.token_ids)
    wall = time.perf_counter() - t0
    busy = stages.busy_seconds() if stages is not None else []
    return {"wall_s": wall, "tokens": tokens, "tok_s": tokens / wall, "stage_busy": [b / wall for b in busy],
            "steps": engine.stats().steps}


def measure(name: str, engine, prompts, params, repeats: int) -> dict:
    timed_run(engine, prompts, params)  # warm-up
    runs = [timed_run(engine, prompts, params) for _ in range(repeats)]
    med = sorted(runs, key=lambda r: r["wall_s"])[len(runs) // 2]
    row = {"name": name, "tok_s": med["tok_s"], "wall_s": med["wall_s"], "tokens": med["tokens"],
           "stage_busy": [round(b, 3) for b in med["stage_busy"]],
           "tok_s_all": [round(r["tok_s"], 1) for r in runs]}
    busy = " ".join(f"{b:.0%}" for b in row["stage_busy"]) or "-"
    print(f"{name:<34} {row['tok_s']:8.1f} tok/s  wall {row['wall_s']:6.2f} s  stage busy {busy}", flush=True)
    return row


# key -> (label, stages: 0 = the plain single engine, -1 = --stages, switches)
CONFIGS = {
    "single": ("single engine (no Ray)", 0, {}),
    "p1": ("p=1 (one stage actor)", 1, {}),
    "all": ("p={p} SiPipe (all on)", -1, {}),
    "no_cpu_sampling": ("p={p} w/o CPU sampling", -1, {"pp_cpu_sampling": False}),
    "no_tsem": ("p={p} w/o token-safe exec", -1, {"pp_token_safe": False}),
    "no_sat": ("p={p} w/o structure-aware tx", -1, {"pp_structure_aware": False}),
    "none": ("p={p} none of the three", -1, {"pp_cpu_sampling": False, "pp_token_safe": False,
                                             "pp_structure_aware": False}),
}


def run_config(key: str, model: str, args, prompts, params) -> dict:
    label, stages, switches = CONFIGS[key]
    label = label.format(p=args.stages)
    if stages == 0:
        llm = LLM(model, device="cpu", max_num_seqs=args.max_num_seqs,
                  max_num_batched_tokens=args.max_batched_tokens, enable_prefix_caching=False)
        try:
            return {"key": key, **measure(f"{label}, {torch.get_num_threads()} thr", llm.engine, prompts, params,
                                          args.repeats)}
        finally:
            llm.shutdown()
    engine = make_pipeline(model, args, args.stages if stages < 0 else stages, **switches)
    try:
        return {"key": key, **measure(label, engine, prompts, params, args.repeats)}
    finally:
        engine.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--min-in", type=int, default=32)
    ap.add_argument("--max-in", type=int, default=128)
    ap.add_argument("--min-out", type=int, default=32)
    ap.add_argument("--max-out", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--stage-cpus", type=float, default=1.0)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-batched-tokens", type=int, default=512)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--intermediate", type=int, default=1408)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--max-position", type=int, default=1024)
    ap.add_argument("--init-std", type=float, default=0.02)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only", default=",".join(CONFIGS),
                    help=f"comma-separated subset of {','.join(CONFIGS)} (the first two are the baselines)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    import ray

    tmp = tempfile.mkdtemp(prefix="tdr", dir="/tmp")
    ray.init(num_cpus=max(4, int(args.stages * args.stage_cpus) + 2), include_dashboard=False, _temp_dir=tmp,
             log_to_driver=False)
    model = str(build_checkpoint(args, Path(tempfile.mkdtemp(prefix="pp_bench"))))
    prompts, params = workload(args)
    info = {"machine": machine_info(), "model": model_shape(Path(model)), "stages": args.stages,
            "requests": args.requests, "stage_cpus": args.stage_cpus}
    print(f"machine: {info['machine']['cpu']} ({info['machine']['cores']} cores), device: cpu stages "
          f"({args.stage_cpus} CPU each), model {info['model']}", flush=True)
    torch.set_num_threads(max(1, int(args.stage_cpus)))  # the single engine gets what one stage gets
    rows = [run_config(key, model, args, prompts, params) for key in args.only.split(",")]
    by_key = {r["key"]: r for r in rows}
    if "p1" in by_key and "all" in by_key:
        print(f"p={args.stages} vs p=1 throughput: {by_key['all']['tok_s'] / by_key['p1']['tok_s']:.2f}x")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({**info, "args": {k: str(v) for k, v in vars(args).items()},
                                         "rows": rows}, indent=2))
    ray.shutdown()


if __name__ == "__main__":
    main()
