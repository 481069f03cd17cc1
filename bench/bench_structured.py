#!/usr/bin/env python3
"""Structured output cost and the pipeline: a batch with half its requests JSON-schema constrained vs the
same batch all unconstrained, at pipeline_depth 1 (blocking) and 2 (pipelined), on one engine.

    python bench/bench_structured.py                      # embedded model, CPU (or the visible GPU)
    python bench/bench_structured.py --device cuda --batch 64 --json bench/results/structured_gpu.json

Workload (seeded): `--batch` requests, each `--max-tokens` tokens, all running to max_tokens so every setting
does the same work: plain rows ignore EOS; constrained rows follow an unbounded JSON array of records
(ints with ranges, strings with a pattern, enum tags) of at least 100 items, so their grammar never ends
before max_tokens and every one of their steps needs a mask. Seeded sampling at temperature 0.8. One
warm-up run per setting (excluded, also compiles the schema), then `--repeats` rounds that run every setting once
in turn (so load from other processes hits all settings alike); medians are printed.

Per-step figures (medians over the steps of all measured runs, engine.last_step_timing): `forward` and
`sample` are the device work, `finalize` the host time to build sampling inputs (the constraint masks),
`commit wait` how long the engine thread waited for a step's tokens, and `worker idle` how long the
CPU worker sat between a forward and its sampling (waiting for the finalize that needs the previous
commit). Sampling unconstrained rows earlier could at most win back `worker idle`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from dataclasses import asdict, dataclass
from importlib.metadata import version

import torch

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.sampling_params import StructuredOutputsParams

RECORDS = {"type": "array", "minItems": 100, "items": {"type": "object", "required": ["id", "name", "tags"],
                                                      "properties": {
    "id": {"type": "integer", "minimum": 0, "maximum": 9999},
    "name": {"type": "string", "pattern": "^[A-Za-z][a-z]{1,11}$"},
    "tags": {"type": "array", "items": {"enum": ["io", "net", "os", "sys"]}, "maxItems": 3}}}}
PROMPTS = ["Return the records as JSON:", "def load(path):", "The configuration file", "import os\n",
           "List the users:", "class Config:", "Open the file and", "Convert a string to"]
TIMING_KEYS = ("forward_s", "sample_s", "finalize_s", "commit_wait_s", "sample_wait_s", "period_s")


@dataclass
class Result:
    setting: str
    depth: int
    constrained: int
    requests: int
    tokens: int
    wall_s: float
    tok_s: float
    steps: int
    forward_ms: float
    sample_ms: float
    finalize_ms: float
    commit_wait_ms: float
    worker_idle_ms: float
    period_ms: float


def requests(batch: int, constrained_every: int | None, max_tokens: int, seed: int):
    out = []
    for i in range(batch):
        constrained = constrained_every is not None and i % constrained_every == 0
        so = StructuredOutputsParams(json=RECORDS, disable_any_whitespace=True) if constrained else None
        out.append((PROMPTS[i % len(PROMPTS)], SamplingParams(
            max_tokens=max_tokens, temperature=0.8, seed=seed + i, ignore_eos=True, structured_outputs=so)))
    return out


def run_once(engine: LLMEngine, reqs) -> tuple[float, int, list[dict]]:
    for prompt, sp in reqs:
        engine.add_request(prompt, sp)
    timings, tokens, seen = [], 0, engine.counters["steps"]
    t0 = time.perf_counter()
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                assert out.finish_reason == "length", (out.finish_reason, out.text[-80:])
                tokens += len(out.token_ids)
        if engine.counters["steps"] != seen:
            seen = engine.counters["steps"]
            timings.append(dict(engine.last_step_timing))
    return time.perf_counter() - t0, tokens, timings


@dataclass
class Setting:
    depth: int
    constrained_every: int | None  # None: all plain; 2: every second request; 1: all
    engine: LLMEngine
    walls: list[float]
    tokens: list[int]
    timings: list[dict]


def measure_all(args, settings: list[tuple[int, int | None]]) -> list[Result]:
    """Round-robin over the settings in every repeat, so load from other processes hits all alike."""
    runs = []
    for depth, every in settings:
        engine = LLMEngine(EngineConfig(model=args.model, device=args.device, pipeline_depth=depth,
                                        max_num_seqs=max(args.batch, 8)))
        run_once(engine, requests(args.batch, every, args.max_tokens, seed=10_000))  # warm-up (+ compile)
        runs.append(Setting(depth, every, engine, [], [], []))
    for r in range(args.repeats):
        for run in runs:
            wall, tokens, steps = run_once(run.engine, requests(args.batch, run.constrained_every,
                                                                args.max_tokens, seed=r))
            run.walls.append(wall)
            run.tokens.append(tokens)
            run.timings += steps[1:]  # the first step is the prefill of the whole batch
    for run in runs:
        run.engine.check_integrity()
        run.engine.shutdown()
    return [summarize(args, run) for run in runs]


def summarize(args, run: Setting) -> Result:
    every = run.constrained_every
    n_constrained = 0 if every is None else len(range(0, args.batch, every))
    med = {k: 1e3 * statistics.median(t[k] for t in run.timings) for k in TIMING_KEYS}
    name = f"depth {run.depth}, " + ("all plain" if not n_constrained else
                                     "all constrained" if n_constrained == args.batch else "half constrained")
    wall = statistics.median(run.walls)
    return Result(name, run.depth, n_constrained, args.batch, run.tokens[0], wall,
                  statistics.median(run.tokens) / wall, len(run.timings) // args.repeats, med["forward_s"],
                  med["sample_s"], med["finalize_s"], med["commit_wait_s"], med["sample_wait_s"],
                  med["period_s"])


def machine(device: str) -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if "model name" in line), "?")
    gpu = f", {torch.cuda.get_device_name(0)}" if device == "cuda" else ""
    return (f"{cpu}, {os.cpu_count()} cores{gpu}, load average {os.getloadavg()[0]:.2f}, torch "
            f"{torch.__version__} ({torch.get_num_threads()} threads), xgrammar {version('xgrammar')}, "
            f"python {platform.python_version()}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="checkpoint dir (default: the embedded model)")
    p.add_argument("--device", default="auto")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--all-constrained", action="store_true", help="also run every request constrained")
    p.add_argument("--json", default=None, help="write the results here too")
    args = p.parse_args()
    args.device = "cuda" if args.device == "auto" and torch.cuda.is_available() else \
        "cpu" if args.device == "auto" else args.device
    print(f"machine: {machine(args.device)}")
    print(f"workload: {args.batch} requests x {args.max_tokens} tokens, seeded sampling (T=0.8), half "
          f"constrained = every 2nd request follows a JSON schema; median of {args.repeats} runs (+1 warm-up)")
    mixes = [None, 2] + ([1] if args.all_constrained else [])
    results = measure_all(args, [(depth, every) for depth in (1, 2) for every in mixes])
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    head = (f"{'setting':26} {'tok/s':>8} {'wall s':>7} {'steps':>6} {'period':>8} {'forward':>8} "
            f"{'sample':>7} {'finalize':>8} {'commit wait':>11} {'worker idle':>11}   (per step, ms)")
    print(head)
    for r in results:
        print(f"{r.setting:26} {r.tok_s:>8.1f} {r.wall_s:>7.3f} {r.steps:>6} {r.period_ms:>8.2f} "
              f"{r.forward_ms:>8.2f} {r.sample_ms:>7.2f} {r.finalize_ms:>8.2f} {r.commit_wait_ms:>11.2f} "
              f"{r.worker_idle_ms:>11.2f}")
    by = {(r.depth, r.constrained): r for r in results}
    half = len(range(0, args.batch, 2))
    for depth in (1, 2):
        print(f"depth {depth}: half constrained runs at {by[depth, half].tok_s / by[depth, 0].tok_s:.1%} "
              f"of all-plain throughput")
    for n, label in ((0, "all plain"), (half, "half constrained")):
        print(f"{label}: depth 2 vs depth 1 throughput {by[2, n].tok_s / by[1, n].tok_s - 1:+.1%}")
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"machine": machine(args.device), "args": vars(args),
                       "results": [asdict(r) for r in results]}, f, indent=2)


if __name__ == "__main__":
    main()
