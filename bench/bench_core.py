#!/usr/bin/env python3
"""The engine core's targets (issue "engine core in its own process") on the simulated H100. Every figure is
SIMULATED: the host work is real and measured on this machine, the device's time comes from the cost model.

    python bench/bench_core.py busy|length|all [--out bench/results] [--repeats 3]

busy    Qwen2.5-0.5B shape, the "streams" workload of bench_sim.py (n requests of 128-512 prompt and
        128-512 output tokens at once): device busy fraction and tok/s through `LLM.generate` at 256 streams,
        with this decoder's kernels and with a fused forward's 8 per layer; and through AsyncLLM with 32 and
        256 concurrent asyncio callers, the core on a thread of the caller's process ("async") and in a
        process of its own ("proc", as a Serve replica runs it). Median of --repeats runs.
length  one request of 16,000 output tokens, streamed (an output per commit), through the in-process engine:
        host time per step over its first and last 1,000 steps. Flat means a request's per-step cost does not
        grow with its length.

Writes core_<name>.json and .md under --out, with the machine.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import bench_sim  # noqa: E402
from engine import EngineConfig, SamplingParams  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from gpu_models import machine  # noqa: E402
from harness import write_results  # noqa: E402

bench_sim.KERNELS.setdefault("fused8", 8)
MODEL = "qwen2.5-0.5b"
BUSY_VARIANTS = [("engine", "engine", 256), ("fused8", "engine", 256), ("engine", "async", 32),
                 ("engine", "proc", 32), ("engine", "async", 256), ("engine", "proc", 256),
                 ("fused8", "proc", 256)]


def busy(args) -> list[dict]:
    rows = []
    for kernels, path, n in BUSY_VARIANTS:
        runs = sorted((bench_sim.stream_run(MODEL, kernels, 2, n, False, path, "steady")
                       for _ in range(args.repeats)), key=lambda r: r["busy"])
        row = runs[len(runs) // 2] | {"busy_runs": [r["busy"] for r in runs]}
        rows.append(row)
        print(f"{kernels:7} {path:6} {n:4} streams: busy {row['busy']:.3f} {row['busy_runs']} "
              f"{row['tok_s']:>7} tok/s  step {row['step_ms']} ms  host/step: "
              + " ".join(f"{k.removesuffix('_us')} {row[k]}" for k in ("schedule_us", "prepare_us", "commit_us",
                                                                        "finalize_us", "stream_us") if k in row),
              flush=True)
    return rows


def length(args) -> list[dict]:
    n_out, window = 16000, 1000
    cfg = EngineConfig(model=bench_sim.model_dir(MODEL), device="sim", sim_gpu="h100", max_model_len=16384 + 64,
                       max_num_seqs=8)
    engine = LLMEngine(cfg)
    engine.add_request(list(range(10, 42)), SamplingParams(max_tokens=n_out, ignore_eos=True, temperature=0.7),
                       request_id="long", stream=True)
    times, tokens = [], 0
    while engine.has_unfinished():
        t0 = time.perf_counter()
        outs = engine.step()
        times.append(time.perf_counter() - t0)
        tokens += sum(len(o.delta_token_ids) for o in outs)
    engine.shutdown()
    assert tokens == n_out, tokens
    first, last = times[10:10 + window], times[-window:]
    row = {"device": "simulated h100", "model": MODEL, "output_tokens": n_out, "steps": len(times),
           "first_1000_us": round(1e6 * statistics.mean(first), 1),
           "last_1000_us": round(1e6 * statistics.mean(last), 1),
           "first_1000_median_us": round(1e6 * statistics.median(first), 1),
           "last_1000_median_us": round(1e6 * statistics.median(last), 1)}
    row["last_over_first"] = round(row["last_1000_median_us"] / row["first_1000_median_us"], 3)
    print(f"16,000-token stream: host per step, median, first 1,000 steps {row['first_1000_median_us']} us, "
          f"last 1,000 {row['last_1000_median_us']} us (x{row['last_over_first']})", flush=True)
    return [row]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["busy", "length", "all"])
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    info = machine("cpu") | {"device": "simulated h100 (host: " + machine("cpu")["device"] + ")",
                             "git": git_rev()}
    print(info, flush=True)
    for name, fn in (("length", length), ("busy", busy)):
        if args.what in (name, "all"):
            rows = fn(args)
            write_results(args.out / f"core_{name}", f"engine core: {name} (SIMULATED h100)", rows, info)


def git_rev() -> str:
    import subprocess

    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                          text=True).stdout.strip()


if __name__ == "__main__":
    main()
