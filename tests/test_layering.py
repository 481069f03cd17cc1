"""The engine package knows neither Ray nor the Ray side (cluster/): docs/architecture.md's layering, checked.

The pipeline-parallel engine, which drives Ray stage actors, reaches the engine through the `tandem.engines`
entry point instead (engine.core.create_core)."""

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
    from engine.core import engine_plugin

    factory = engine_plugin("pipeline")
    assert factory.__module__ == "cluster.pipeline"


# ---- the engine core and its frontend ------------------------------------------------------------------------
FRONTEND = {"engine.detokenizer", "engine.output_processor", "engine.llm_engine", "engine.async_engine",
            "engine.llm", "engine.core_client"}
CORE_ENTRY = ("engine.core", "engine.core_proc")
ENGINE_IMPORT = re.compile(r"^\s*(?:from\s+(engine(?:\.\w+)*)\s+import\s+([\w ,()]+)|import\s+(engine(?:\.\w+)*))",
                           re.M)


def _module_file(name: str) -> Path | None:
    path = ENGINE.parent.joinpath(*name.split("."))
    for candidate in (path.with_suffix(".py"), path / "__init__.py"):
        if candidate.exists():
            return candidate
    return None


def _engine_imports(name: str) -> set[str]:
    """The engine modules `name` imports, at any depth of its source (function-level imports included), not
    counting the `engine` package's own __init__ (which re-exports the public API, frontend included)."""
    found = set()
    for base, names, plain in ENGINE_IMPORT.findall(_module_file(name).read_text()):
        mod = base or plain
        if base:  # `from engine.x import y`: y may be a submodule
            for sub in (n.strip(" ()") for n in names.split(",")):
                if sub and _module_file(f"{base}.{sub}") is not None:
                    found.add(f"{base}.{sub}")
        if mod != "engine" and _module_file(mod) is not None:
            found.add(mod)
    return found


def test_the_engine_core_imports_nothing_of_the_frontend():
    """The core (engine/core.py, and the loop of its process) reaches no frontend module: detokenization,
    output processing and the serving API live in the replica's process, never in the core's loop."""
    seen, todo, reached_from = set(), list(CORE_ENTRY), {}
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        for dep in _engine_imports(name) - seen:
            reached_from.setdefault(dep, name)
            todo.append(dep)
    assert "engine.scheduler" in seen and "engine.model_runner" in seen  # the walk does follow the core
    bad = {m: reached_from[m] for m in seen & FRONTEND}
    assert bad == {}, f"frontend modules reached from the core (module: imported by): {bad}"
