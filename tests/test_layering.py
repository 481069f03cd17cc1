"""The engine package knows neither Ray nor the Ray side (cluster/): docs/architecture.md's layering, checked.

The pipeline-parallel engine, which drives Ray stage actors, reaches the engine through the `tandem.engines`
entry point instead (engine.llm_engine.create_engine)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ENGINE = Path(__file__).resolve().parents[1] / "engine"
IMPORT = re.compile(r"^\s*(from|import)\s+(ray|cluster|serve_app)\b", re.M)


def test_no_engine_module_imports_ray_or_cluster():
    found = {str(p.relative_to(ENGINE)): IMPORT.findall(p.read_text()) for p in ENGINE.rglob("*.py")}
    assert {k: v for k, v in found.items() if v} == {}


def test_importing_the_engine_loads_no_ray():
    code = ("import sys, engine, engine.llm_engine, engine.sim.runner, engine.pipeline; "
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('ray', 'cluster', 'serve_app')); "
            "print(bad); sys.exit(1 if bad else 0)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_pipeline_engine_is_found_through_its_entry_point():
    from engine.llm_engine import engine_plugin

    factory = engine_plugin("pipeline")
    assert factory.__module__ == "cluster.pipeline"
