"""What the engine benchmarks share (bench_gpu.py on CUDA, bench_sim.py on the simulated accelerator).

Photon's per-step table, computed the same way for every device: drive the engine one tick at a time, keep
each committed step's timing, and read forward / sampling / period / GPU idle off steady full-batch decode
steps, blocking (pipeline_depth=1) vs pipelined (2), with Photon's cost model speedup = T_block / T_pipe x
(1 - z) beside the observed one. And the results' JSON + markdown files.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

from engine import LLM, SamplingParams


@dataclass
class Run:
    wall_s: float
    timings: list[dict]  # engine.last_step_timing of every committed step, in step order
    output_lens: list[int]
    counters: dict  # engine counter deltas over the run


def drive(llm: LLM, requests: list[tuple[list[int], SamplingParams]], on_step=None) -> Run:
    engine = llm.engine

    def counters() -> dict:  # the core counts steps; the scheduler what they commit (tokens, zombie rows)
        return {**engine.counters, **engine.scheduler.counters}

    before = counters()
    timings, lens, seen = [], [], engine.counters["steps"]
    t0 = time.perf_counter()
    for prompt, params in requests:
        engine.add_request(prompt, params)
    while engine.has_unfinished():
        lens += [len(o.token_ids) for o in engine.step() if o.finished]
        if engine.counters["steps"] != seen:
            seen = engine.counters["steps"]
            timings.append(dict(engine.last_step_timing))
            if on_step is not None:
                on_step(len(timings))
    wall = time.perf_counter() - t0
    after = counters()
    return Run(wall, timings, lens, {k: after[k] - before[k] for k in before})


def decode_pairs(timings: list[dict], batch: int) -> list[tuple[dict, float]]:
    """(step, its device period) for consecutive full pure-decode steps: a step's period is the next step's
    forward start minus its own (forward + sampling + whatever idle followed)."""
    full = [t["num_seqs"] == batch and t["num_tokens"] == batch for t in timings]
    return [(timings[i - 1], timings[i]["device_period_s"]) for i in range(1, len(timings))
            if full[i - 1] and full[i]]


def med(xs) -> float:
    xs = list(xs)
    return statistics.median(xs) if xs else float("nan")


def ms(x: float) -> float:
    return round(1e3 * x, 3)


def photon_rows(runs: dict[int, dict[int, Run]], streams: list[int], labels: dict) -> list[dict]:
    """One row per stream count from runs[depth][streams]; `labels` (device, model, ...) lead each row."""
    rows, fs_one = [], None
    for n in streams:
        pipe, block = runs[2][n], runs[1][n]
        pairs, block_pairs = decode_pairs(pipe.timings, n), decode_pairs(block.timings, n)
        fwd, smp = med(t["forward_s"] for t, _ in pairs), med(t["sample_s"] for t, _ in pairs)
        t_pipe, t_block = med(p for _, p in pairs), med(p for _, p in block_pairs)
        if n == 1:
            fs_one = fwd + smp
        # Zombie tax: each zombie row costs a whole step on one stream, else about the marginal cost of a row.
        c_row = t_pipe if n == 1 else max(0.0, (fwd + smp - fs_one) / (n - 1)) if fs_one else 0.0
        busy = sum(t["device_period_s"] for t in pipe.timings[1:])
        z = pipe.counters["zombie_rows"] * c_row / busy if busy else 0.0
        rows.append({
            **labels, "streams": n,
            "forward_ms": ms(fwd), "sampling_ms": ms(smp), "period_ms": ms(t_pipe),
            "period_over_fwd_smp": round(t_pipe / (fwd + smp), 4),
            "gpu_idle_ms": ms(med(p - t["forward_s"] - t["sample_s"] for t, p in pairs)),
            "blocking_idle_ms": ms(med(p - t["forward_s"] - t["sample_s"] for t, p in block_pairs)),
            "t_block_ms": ms(t_block), "t_pipe_ms": ms(t_pipe),
            "L": round(statistics.mean(pipe.output_lens), 1), "zombie_rows": pipe.counters["zombie_rows"],
            "z": round(z, 4), "predicted_speedup_pct": round(100 * (t_block / t_pipe * (1 - z) - 1), 2),
            "observed_speedup_pct": round(100 * (block.wall_s / pipe.wall_s - 1), 2),
            "same_outputs": sorted(pipe.output_lens) == sorted(block.output_lens),
            "steady_steps": len(pairs), "graph_steps": pipe.counters["graph_steps"],
            "steps": pipe.counters["steps"], "wall_pipe_s": round(pipe.wall_s, 3),
            "wall_block_s": round(block.wall_s, 3)})
    return rows


def write_results(stem: Path, title: str, rows: list[dict], meta: dict) -> None:
    """<stem>.json ({"meta", "rows"}) and <stem>.md (a table with every key any row has)."""
    stem.parent.mkdir(parents=True, exist_ok=True)
    stem.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    md = [f"## {title}", "", f"machine: {json.dumps(meta)}", ""]
    if rows:
        # Lists (a row's kernel breakdown, say) stay in the JSON; the table holds the scalars.
        keys = [k for k in dict.fromkeys(k for r in rows for k in r) if not any(isinstance(r.get(k), list)
                                                                                 for r in rows)]
        md += ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
        md += ["| " + " | ".join(str(r.get(k, "")) for k in keys) + " |" for r in rows]
    stem.with_suffix(".md").write_text("\n".join(md) + "\n")


def pyplot():
    """matplotlib's pyplot on the Agg backend, or None where matplotlib is not installed (PNGs skipped)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("  (no matplotlib: PNG skipped)")
        return None
    return plt
