"""The GPU benchmarks' code on CPU (bench/bench_gpu.py --device cpu --tiny): each subcommand that
scripts/gpu_check.sh runs on a GPU, end to end on a toy model, so a device call's few minutes are not spent
finding a broken harness (the photon table once failed on a counter that had moved to the scheduler)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_bench(what: str, out: Path, *extra: str, env: dict | None = None) -> list[dict]:
    cmd = [sys.executable, str(ROOT / "bench" / "bench_gpu.py"), what, "--device", "cpu", "--tiny",
           "--models", "qwen2.5-0.5b", "--out", str(out), *extra]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=os.environ | (env or {}))
    assert res.returncode == 0, res.stderr[-3000:]
    rows = json.loads((out / f"{what}_cpu_tiny.json").read_text())["rows"]
    assert rows and not [r for r in rows if "error" in r], rows
    return rows


@pytest.mark.parametrize("what,extra,keys", [
    ("photon", ("--streams", "1", "2"), {"forward_ms", "period_ms", "gpu_idle_ms", "observed_speedup_pct"}),
    ("graphs", ("--streams", "1", "2", "--forward", "default", "layers"), {"step_ms", "step_ms_unprofiled"}),
    ("bs1", ("--hf-tokens", "8"), {"tandem_ms_per_tok", "hf_ms_per_tok", "forward"}),
    ("mixed", (), {"eager_host_ms", "eager_device_ms", "graph_shape", "tokens"}),
])
def test_bench_gpu_runs_on_cpu(tmp_path, what, extra, keys):
    rows = run_bench(what, tmp_path, *extra)
    assert all(keys <= r.keys() for r in rows)
    if what == "photon":  # one row per stream count; the zombie rows come from the scheduler's counters
        assert [r["streams"] for r in rows] == [1, 2] and all("zombie_rows" in r for r in rows)
    if what == "graphs":
        assert {r["forward"] for r in rows} == {"layers"} and len(rows) == 4  # CPU: both variants run the layers
    if what == "mixed":  # three shapes; no graphs on the CPU
        assert len(rows) == 3 and all(r["graph_shape"] is None and r["eager_device_ms"] > 0 for r in rows)


def test_bench_gpu_kernels_sweep_checks_each_tiling(tmp_path):
    """The gate/up sweep under Triton's interpreter: each tiling's output is compared with the shipped one."""
    rows = run_bench("kernels", tmp_path, "--streams", "1", env={"TRITON_INTERPRET": "1"})
    grid = rows[0]["grid"]
    assert grid and all(g.get("same") for g in grid), grid
    assert rows[0]["best_tiles"] is not None and rows[0]["cublas_act_us"] > 0
