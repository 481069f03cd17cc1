"""The CPU kernels, compiled at first use and cached: paged decode and prefill attention (cpu_decode.cpp,
cpu_prefill.cpp), the decoder's fused elementwise ops (engine/models/cpu_fused.cpp: residual add + RMSNorm,
SiLU * up, RoPE) and the fp32 GEMM of its linears (engine/models/cpu_gemm.cpp, AVX-512 only).

`load()` builds it with torch.utils.cpp_extension (g++ and ninja; -O3 -march=native, so the build is
named after this CPU's feature flags and the sources' digest and paths, so checkouts with other kernel sources
sharing one cache do not rebuild over each other; cached in TORCH_EXTENSIONS_DIR, default
~/.cache/torch_extensions)
and returns the module, or None, with one warning naming why, when it cannot be built; callers then keep
the gather + SDPA path.
The first build takes ~30-60 s on 2 cores; later processes load the cached .so in well under a second.
TANDEM_CPU_KERNELS=0 turns it off.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import shutil
from pathlib import Path

logger = logging.getLogger(__name__)

_SOURCES = (Path(__file__).with_name("cpu_decode.cpp"), Path(__file__).with_name("cpu_prefill.cpp"),
            Path(__file__).parents[1] / "models" / "cpu_fused.cpp",
            Path(__file__).parents[1] / "models" / "cpu_gemm.cpp")
_HEADERS = (Path(__file__).with_name("cpu_simd.h"),)  # in the digest: they are compiled into the sources
# -fopenmp: at::parallel_for is OpenMP in torch's CPU build (without it the kernel runs on one thread);
# -fno-math-errno lets `omp simd` call glibc's vector expf; the reassociation flags let GCC vectorize the
# dot products' sums (a tree of vector adds instead of one scalar chain) without -ffast-math's
# finite-math assumption (the softmax starts from -inf).
_CFLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fassociative-math", "-fno-signed-zeros",
           "-fno-trapping-math"]
@functools.cache
def load():
    """The compiled module (`paged_decode`, `paged_prefill` where the CPU has AVX-512 (`prefill_dtypes` says
    which dtypes), `rms_norm` (bf16), `rms_norm_f32`, `silu_mul`, `rope_`, and cpu_gemm.cpp's `gemm_pack` /
    `gemm_linear` for the dtypes in `gemm_dtypes` and `gemm_silu_mul` where `gemm_silu`; every op runs without
    the GIL), or None if disabled or it does not build here. Concurrent first calls may both reach the build;
    cpp_extension's lock file makes the second wait and reuse it."""
    if os.environ.get("TANDEM_CPU_KERNELS", "1") == "0":
        return None
    return _build()


def _isa_tag() -> str:
    """A digest of this CPU's feature flags: -march=native code is only reused on the same kind of CPU
    (a home directory shared by different machines would otherwise load an .so with instructions the CPU
    lacks)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        flags = platform.processor()
    return hashlib.sha1(flags.encode()).hexdigest()[:10]


def _build():
    try:
        from torch.utils import cpp_extension

        if shutil.which("ninja") is None:  # the `ninja` wheel's binary, when its venv is not on PATH
            import ninja
            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")

        # The sources' contents and where they live: checkouts (git worktrees) with equal sources at other paths
        # would otherwise share one build directory whose ninja file names the other checkout's paths, and
        # rebuild over each other.
        source_tag = hashlib.sha1(b"".join(src.read_bytes() + str(src).encode()
                                           for src in _SOURCES + _HEADERS)).hexdigest()[:8]
        return cpp_extension.load(name=f"tandem_cpu_decode_{_isa_tag()}_{source_tag}",
                                  sources=[str(src) for src in _SOURCES],
                                  extra_cflags=_CFLAGS, extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as exc:  # no compiler, no ninja, a build error: the torch path still works
        logger.warning("CPU decode kernel unavailable (%s: %s); using gather + SDPA",
                       type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
        return None
