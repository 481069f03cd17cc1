"""Count what a forward launches: PyTorch operators that run a kernel, view-only operators (host dispatch,
no kernel) and Triton kernel launches. Device-independent: on CPU tensors, with the Triton kernels under
Triton's interpreter, it counts the same operators the CUDA path dispatches (tests/test_fused_forward.py
holds the fused decoder to its launch plan with it; scripts/gpu_check.sh reads the profiler on a GPU).

Allocations (empty, empty_strided) run no kernel and are not counted; neither is anything the Triton
interpreter does with torch while it runs a kernel (it copies tensors in and out), since counting pauses
inside a Triton launch.
"""

from __future__ import annotations

from collections import Counter

from torch.utils._python_dispatch import TorchDispatchMode

try:
    from triton.runtime import interpreter as _interp, jit as _jit
    _LAUNCHERS = [cls for cls in (getattr(_jit, "JITFunction", None), getattr(_interp, "InterpretedFunction", None))
                  if cls is not None]
except ImportError:  # pragma: no cover - CPU torch without triton: only PyTorch operators exist to count
    _LAUNCHERS = []

# Operators that allocate or only describe memory: no kernel runs.
_NO_KERNEL = {"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "_unsafe_view", "lift_fresh",
              "set_", "resize_"}


class LaunchCounter(TorchDispatchMode):
    """`with LaunchCounter() as c: forward()`; then c.aten, c.views, c.triton (and c.names: a Counter of
    operator and kernel names)."""

    def __init__(self):
        super().__init__()
        self.aten = self.views = self.triton = 0
        self.names: Counter[str] = Counter()
        self._paused = 0
        self._saved: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self._paused:
            name = func.overloadpacket.__name__
            if func.is_view or name in ("view", "t", "transpose", "as_strided", "alias", "detach"):
                self.views += 1
                self.names[f"view:{name}"] += 1
            elif name not in _NO_KERNEL:
                self.aten += 1
                self.names[name] += 1
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        counter = self
        for cls in _LAUNCHERS:
            original = cls.run

            def run(fn_self, *args, __original=original, **kwargs):
                counter.triton += 1
                counter.names[f"triton:{getattr(fn_self, '__name__', None) or fn_self.fn.__name__}"] += 1
                counter._paused += 1
                try:
                    return __original(fn_self, *args, **kwargs)
                finally:
                    counter._paused -= 1

            self._saved.append((cls, original))
            cls.run = run
        return super().__enter__()

    def __exit__(self, *exc):
        for cls, original in self._saved:
            cls.run = original
        self._saved.clear()
        return super().__exit__(*exc)

    @property
    def kernels(self) -> int:
        return self.aten + self.triton
