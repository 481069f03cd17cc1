"""The CPU kernels, compiled at first use and cached: paged decode and prefill attention (decode_attention.cpp,
prefill_attention.cpp), the decoder's fused elementwise ops (fused.cpp: residual add + RMSNorm, SiLU * up, RoPE)
and the GEMM of its linears (gemm.cpp; gemm_quant.cpp and gemm_quant_int8.cpp for GGUF-quantized weights), all
in engine/cpu/ and built into one module (bindings.cpp binds them: the one source that includes PyTorch's Python
headers, see ops.h).

Every kernel has three builds of the same sources, one per instruction-set level, as PyTorch's own CPU kernels
do (`torch.backends.cpu.get_cpu_capability()`):

- "avx512": AVX-512 F/BW/VL/DQ, plus whatever else the CPU has (-march=native: AVX512-BF16 turns on the
  VDPBF16PS paths), hand-written intrinsics;
- "avx2": x86-64-v3 (AVX2, FMA, F16C): the same algorithms in 8-lane GCC vectors or 16-lane vectors lowered to
  two AVX2 registers; bf16 widened to fp32 in registers;
- "default": x86-64's baseline (SSE2), the same portable code, compiled without the newer instructions.

The level is PyTorch's: the CPU's best, or lower where `ATEN_CPU_CAPABILITY` (default | avx2 | avx512) says
so, so one variable switches PyTorch's kernels and Tandem's together (the fused ops reproduce PyTorch's
arithmetic at the same level: its SiLU calls the same vector exp), and a machine with AVX-512 can run and test
the paths of one without. `load(isa)` builds any level the CPU can run (the tests use it);
`isas()` lists them. Each build is named after its level, the sources' digest and paths (checkouts with other
kernel sources sharing one cache do not rebuild over each other) and, for "avx512", this CPU's feature flags
(-march=native code is reused only on the same kind of CPU). Cached in TORCH_EXTENSIONS_DIR (default
~/.cache/torch_extensions): later processes load the .so in well under a second. `scripts/bootstrap.sh` builds
this CPU's level at install (`engine.cpu.kernels.main`), so the first server does not.

`load()` returns the module, or None, with one warning naming why, when it cannot be built; callers then keep
the torch paths (gather + SDPA, eager ops, oneDNN or F.linear). TANDEM_CPU_KERNELS=0 turns it off.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import shutil
import sys
import time
from pathlib import Path

try:
    import fcntl
except ImportError:  # not a POSIX system: torch's own lock file only
    fcntl = None

logger = logging.getLogger(__name__)

_HERE = Path(__file__).parent
_SOURCES = tuple(_HERE / name for name in ("bindings.cpp", "decode_attention.cpp", "prefill_attention.cpp", "fused.cpp",
                                             "gemm.cpp", "gemm_quant.cpp", "gemm_quant_int8.cpp"))
# In the digest: they are compiled into the sources.
_HEADERS = tuple(_HERE / name for name in ("ops.h", "simd.h", "quant_blocks.h", "quant_ints.h", "quant_pairs.h"))
# -fopenmp: at::parallel_for is OpenMP in torch's CPU build (without it the kernel runs on one thread);
# -fno-math-errno lets `omp simd` call glibc's vector expf; the reassociation flags let GCC vectorize the
# dot products' sums (a tree of vector adds instead of one scalar chain) without -ffast-math's
# finite-math assumption (the softmax starts from -inf).
_CFLAGS = ["-O3", "-fopenmp", "-fno-math-errno", "-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math"]
# The instruction-set levels, best first, and what each compiles with.
ISA_FLAGS = {"avx512": ["-march=native"], "avx2": ["-march=x86-64-v3"], "default": ["-march=x86-64"]}
_CPU_FLAGS = {"avx512": {"avx512f", "avx512bw", "avx512vl", "avx512dq"}, "avx2": {"avx2", "fma", "f16c"},
              "default": set()}


def load(isa: str | None = None):
    """The compiled module for instruction-set level `isa` (None: PyTorch's, `current_isa()`), or None if
    disabled or it does not build here. Its ops: `paged_decode`, `paged_prefill` (for the dtypes in
    `prefill_dtypes`), `rms_norm` (bf16), `rms_norm_f32`, `silu_mul`, `rope_`, and gemm.cpp's `gemm_pack` /
    `gemm_linear` (for the dtypes in `gemm_dtypes`) and `gemm_silu_mul` (where `gemm_silu`), gemm_quant.cpp's
    `gemm_q_linear` (GGUF weights of the types in `gemm_q_types`; x fp32 or quantized to int8 blocks) and
    `quantize_q8_0` (that quantization, for tests); `isa` names the level it was built for. Every op runs
    without the GIL. Concurrent first calls may both reach the build; the second waits for it and reuses it
    (`_load_locked`)."""
    if os.environ.get("TANDEM_CPU_KERNELS", "1") == "0":
        return None
    isa = isa or current_isa()
    if isa not in ISA_FLAGS:
        raise ValueError(f"unknown CPU instruction-set level {isa!r}; valid: {', '.join(ISA_FLAGS)}")
    if isa not in isas():
        raise ValueError(f"this CPU cannot run the {isa!r} kernels; it runs {', '.join(isas())}")
    return _build(isa)


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return set(next((line for line in f if line.startswith("flags")), "").split(":")[-1].split())
    except OSError:
        return set()


@functools.cache
def isas() -> tuple[str, ...]:
    """The levels this CPU can run, best first ("default" everywhere; the SIMD ones on x86-64 CPUs with the
    features their builds use)."""
    if not _x86():
        return ("default",)
    flags = _cpu_flags()
    return tuple(isa for isa, need in _CPU_FLAGS.items() if need <= flags)


def current_isa() -> str:
    """The level the kernels run at: PyTorch's (its CPU's best, or ATEN_CPU_CAPABILITY's), where this CPU can
    run Tandem's build of it."""
    try:
        import torch
        torch_isa = torch.backends.cpu.get_cpu_capability().lower()
    except Exception:  # an old torch: the CPU's best
        torch_isa = isas()[0]
    # PyTorch names only these three levels on x86-64; elsewhere (or a level this CPU lacks) the portable build
    return torch_isa if torch_isa in isas() else "default"


def _x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")


def _flags_for(isa: str) -> list[str]:
    """The compiler's target flags: the level's, on x86-64; elsewhere (one portable level) this CPU's own."""
    return ISA_FLAGS[isa] if _x86() else ["-march=native"]


def _isa_tag(isa: str) -> str:
    """For -march=native builds ("avx512", and every build off x86-64) a digest of this CPU's feature flags, so a
    home directory shared by different machines never loads an .so with instructions the CPU lacks; the other
    levels name fixed instruction sets."""
    if _flags_for(isa) != ["-march=native"]:
        return isa
    digest = hashlib.sha1((platform.machine() + " ".join(sorted(_cpu_flags()))).encode()).hexdigest()[:10]
    return f"{isa}_{digest}"


@functools.cache
def _build(isa: str):
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
        name = f"tandem_cpu_{_isa_tag(isa)}_{source_tag}"
        built = _built(cpp_extension, name)
        if not built:  # say so: the first build takes a minute or more on 2 cores, inside whatever called it
            print(f"tandem: compiling the CPU kernels for {isa} (first use after install or a change; "
                  f"about a minute)...", file=sys.stderr, flush=True)
        start = time.monotonic()
        module = _load_locked(cpp_extension, name, sources=[str(src) for src in _SOURCES],
                              extra_cflags=_CFLAGS + _flags_for(isa), extra_ldflags=["-fopenmp"], verbose=False)
        if not built:
            print(f"tandem: CPU kernels for {isa} built in {time.monotonic() - start:.0f} s", file=sys.stderr,
                  flush=True)
        module.isa = isa
        return module
    except Exception as exc:  # no compiler, no ninja, a build error: the torch path still works
        logger.warning("CPU kernels (%s) unavailable (%s: %s); using the torch paths", isa,
                       type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
        return None


def _load_locked(cpp_extension, name: str, **kwargs):
    """cpp_extension.load(name, **kwargs) holding an flock of Tandem's own on the build directory.

    torch's lock is a `lock` file in that directory that only the process that made it removes, and every load
    takes it, even of a module already built. A process killed while holding it (Ctrl-C during the minute-long
    first compile, a CI job cancelled) left it behind, and every later load waited on it forever. The kernel
    drops an flock when its holder dies, so while this process holds it no live Tandem process is inside load()
    for this build: a `lock` file found then is stale and removed. A second process still waits for the first
    one's build, on the flock instead of the file."""
    build_dir = Path(cpp_extension._get_build_directory(name, verbose=False))
    with open(build_dir / "tandem.flock", "a") as held:
        if fcntl is not None:
            fcntl.flock(held, fcntl.LOCK_EX)  # released when the file closes, or when this process dies
            stale = build_dir / "lock"
            if stale.exists():
                logger.warning("removing %s: an interrupted build left it, and torch's load would wait on it "
                               "forever", stale)
                stale.unlink(missing_ok=True)
        return cpp_extension.load(name=name, build_directory=str(build_dir), **kwargs)


def _built(cpp_extension, name: str) -> bool:
    """Whether `name`'s .so is already in the extensions cache (then loading it is quick)."""
    try:
        root = Path(cpp_extension._get_build_directory(name, verbose=False))
    except Exception:
        return False
    return (root / f"{name}.so").exists()


def main(argv: list[str] | None = None) -> int:
    """scripts/bootstrap.sh: build this CPU's level (or the one named) now, not inside the first replica."""
    argv = sys.argv[1:] if argv is None else argv
    if os.environ.get("TANDEM_CPU_KERNELS", "1") == "0":
        print("tandem: CPU kernels off (TANDEM_CPU_KERNELS=0)")
        return 0
    mod = load(argv[0] if argv else None)
    print(f"tandem: CPU kernels ready ({mod.isa})" if mod is not None else
          "tandem: CPU kernels unavailable (see the warning above); the engine uses the torch paths")
    return 0 if mod is not None else 1
