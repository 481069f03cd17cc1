"""tcmalloc for the CPU engine's processes, as vLLM's CPU build asks for (its docs preload it).

A CPU forward allocates and frees its activations every step: a prefill step's are tens of MB. glibc's malloc
hands blocks that size back to the kernel when they are freed, so every step faults their pages in again and
the kernel clears them; tcmalloc keeps them. What that costs is in docs/engine.md#memory-allocator.

An allocator can only be preloaded when a process starts, so the Serve app starts its CPU engine replicas with
`preload_env()` in their environment (serve_app/builder.py; tensor- and pipeline-parallel workers inherit it),
and an offline `LLM` on CPU says once how to run with it when it is installed but not loaded. Debian/Ubuntu:
`apt-get install libtcmalloc-minimal4`. TANDEM_TCMALLOC=0 turns it off.
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path

logger = logging.getLogger(__name__)

_NAMES = ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4")
_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib", "/usr/local/lib")
# tcmalloc reports every allocation over 1 GiB on stderr; the KV pool is one.
_QUIET = {"TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD": str(1 << 50)}


def find_tcmalloc() -> str | None:
    """The tcmalloc shared library installed on this machine, or None."""
    return next((str(Path(d) / n) for d in _DIRS for n in _NAMES if (Path(d) / n).exists()), None)


@functools.cache
def tcmalloc_path() -> str | None:
    """The tcmalloc the engine uses: find_tcmalloc(), or None when TANDEM_TCMALLOC=0."""
    return None if os.environ.get("TANDEM_TCMALLOC", "1") == "0" else find_tcmalloc()


def preload_env() -> dict[str, str]:
    """Environment variables that start a process on tcmalloc ({} when there is none): LD_PRELOAD with it in
    front of this process's own LD_PRELOAD."""
    path = tcmalloc_path()
    if path is None:
        return {}
    rest = [p for p in os.environ.get("LD_PRELOAD", "").replace(" ", ":").split(":") if p and p != path]
    return {"LD_PRELOAD": ":".join([path, *rest]), **_QUIET}


def loaded() -> bool:
    """Whether this process runs on tcmalloc."""
    try:
        with open("/proc/self/maps") as f:
            return any("libtcmalloc" in line for line in f)
    except OSError:
        return False


@functools.cache
def advise() -> None:
    """Once per process: log how to preload tcmalloc when it is installed but this process does not use it."""
    if tcmalloc_path() is not None and not loaded():
        logger.warning("CPU engine on glibc malloc: start the process with LD_PRELOAD=%s (the Serve app's CPU "
                       "replicas do) for faster steps (fp32 prefill ~4%%); TANDEM_TCMALLOC=0 silences this",
                       tcmalloc_path())
