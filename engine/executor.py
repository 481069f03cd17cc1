"""Where forwards and sampling run, in order: CUDA streams on a GPU, a worker thread (or inline) on CPU.

Jobs run strictly in submission order, so a forward that reads the previous step's sampled tokens always
runs after that sampling, exactly as kernels queued on one stream would. On CUDA a job's body only enqueues
kernels on the compute stream, synchronously: submit() returns nothing, and an error raised while enqueuing
is kept on the step (Step.error) and raised at its wait, so a failed step fails its own requests, not the
engine loop. Each step's sampled tokens go to pinned host memory on a copy stream, anchored to an event
recorded right after sampling, and the commit's only wait is on that copy's event. On CPU the worker
thread's Future stands in for the event and the "copies" are plain copies.

Every executor also timestamps four points of each step (forward start/end, sampling start/end) on the
device timeline — CUDA events, or the worker's clock on CPU — for the engine's per-step timings.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

import torch

logger = logging.getLogger(__name__)

FWD_START, FWD_END, SAMPLE_START, SAMPLE_END = range(4)
_RING = 4  # timestamp sets kept: in-flight steps (up to 3) plus the previous one a period is measured from


class _HostExecutor:
    """CPU: timestamps from the worker's clock, Futures as dependencies, plain copies."""

    compute_stream = None

    def __init__(self) -> None:
        self._marks = [[0.0] * 4 for _ in range(_RING)]

    def stream_context(self):
        return contextlib.nullcontext()

    def mark(self, step_id: int, point: int) -> None:
        self._marks[step_id % _RING][point] = time.perf_counter()

    def elapsed(self, a: tuple[int, int], b: tuple[int, int]) -> float:
        """Seconds from point a to point b, each (step id, point); both must have been reached."""
        return self._marks[b[0] % _RING][b[1]] - self._marks[a[0] % _RING][a[1]]

    def before_sampling(self, slot) -> None:
        """Nothing to order: the slot's previous copy-out finished before its commit released it."""

    @staticmethod
    def copy_to_host(slot, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        for dst, src in pairs:
            dst.copy_(src)

    def wait_copied(self, slot) -> None:
        """The copies ran inside the sample job, whose Future the caller has already waited on."""


def release_openmp_threads() -> None:
    """Release the calling thread's OpenMP worker threads (omp_pause_resource_all, OpenMP 5.0); the next
    parallel region anywhere starts a team afresh. The thread that builds an engine calls it when done.

    Why: OpenMP (libgomp, torch's on Linux) gives every thread that opens parallel regions a team of its own,
    and once the process's teams hold more threads than it has cores, every team's workers stop spinning
    between regions and sleep instead, so each of the forward's several hundred parallel regions pays a
    futex wake-up. An engine built on one thread (loading the weights opens regions there) and stepped on
    another (AsyncLLM's loop, a forward thread) was in that state for good, and every step paid those wake-ups
    (docs/engine.md#on-cpu-inline-forward-or-a-worker-thread). With the builder's team released, the stepping
    thread's team is the only one and spins as usual. A no-op where no OpenMP runtime with the call is loaded."""
    pause = _omp_pause_resource_all()
    if pause is not None:
        pause(1)  # omp_pause_soft: threads released, nothing else torn down


@functools.cache
def _omp_pause_resource_all():
    """omp_pause_resource_all of the OpenMP runtime torch loaded (found among the mapped libraries: torch may
    bundle its own copy, and a copy loaded by name could be another runtime), or None."""
    candidates = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split(maxsplit=5)[-1].strip()
                name = path.rsplit("/", 1)[-1]
                if path.startswith("/") and name.startswith(("libgomp", "libomp", "libiomp")):
                    candidates.append(path)
    except OSError:  # not Linux: whatever the process exports
        candidates = [None]
    for path in dict.fromkeys(candidates):  # each library is mapped several times
        try:
            fn = ctypes.CDLL(path).omp_pause_resource_all
        except (OSError, AttributeError):
            continue
        fn.argtypes, fn.restype = [ctypes.c_int], ctypes.c_int
        return fn
    logger.debug("no OpenMP runtime with omp_pause_resource_all is loaded; OpenMP teams are left as they are")
    return None


class SerialExecutor(_HostExecutor):
    """One worker thread: the engine thread plans and commits while the worker runs the forward
    (torch kernels release the GIL, so the two overlap)."""

    def __init__(self) -> None:
        super().__init__()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tandem-compute")

    def submit(self, step, fn: Callable, *args) -> Future:
        return self._pool.submit(fn, *args)

    def call(self, fn: Callable, *args):
        """Run `fn` on the worker after every job submitted so far, wait for it and return its result (a draft
        model's proposal, engine/spec_draft.py: one thread runs torch work, never two beside each other)."""
        return self._pool.submit(fn, *args).result()

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


class InlineExecutor(_HostExecutor):
    """Runs each job at submission (debugging, pipeline_depth=1 on CPU)."""

    def submit(self, step, fn: Callable, *args) -> None:
        run_now(step, fn, *args)

    @staticmethod
    def call(fn: Callable, *args):
        """Run `fn` now and return its result (SerialExecutor.call)."""
        return fn(*args)

    def shutdown(self) -> None:
        pass


class StreamExecutor:
    """CUDA: one compute stream for every forward and sampling, a copy stream for device-to-host copies.

    submit() runs the job on the calling thread with the compute stream current: it returns as soon as the
    kernels are enqueued (errors raised while enqueuing are delivered at wait, like the CPU executors')."""

    def __init__(self, device: torch.device):
        self.device = device
        self.compute_stream = torch.cuda.Stream(device)
        self.copy_stream = torch.cuda.Stream(device)
        self._marks = [[torch.cuda.Event(enable_timing=True) for _ in range(4)] for _ in range(_RING)]

    def stream_context(self):
        return torch.cuda.stream(self.compute_stream)

    def submit(self, step, fn: Callable, *args) -> None:
        with torch.cuda.stream(self.compute_stream):
            run_now(step, fn, *args)

    def call(self, fn: Callable, *args):
        """Run `fn` with the compute stream current (its kernels queue after every step's) and return its result;
        errors are raised here (SerialExecutor.call)."""
        with torch.cuda.stream(self.compute_stream):
            return fn(*args)

    def mark(self, step_id: int, point: int) -> None:
        self._marks[step_id % _RING][point].record(self.compute_stream)

    def elapsed(self, a: tuple[int, int], b: tuple[int, int]) -> float:
        # Both events precede the step's copy-done event, which the commit has waited on: no sync here.
        return self._marks[a[0] % _RING][a[1]].elapsed_time(self._marks[b[0] % _RING][b[1]]) / 1e3

    def before_sampling(self, slot) -> None:
        # Write-after-read: the slot's previous device-to-host copy must have read `sampled` first.
        self.compute_stream.wait_event(slot.copy_done)

    def copy_to_host(self, slot, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Queue dst.copy_(src) for each pair on the copy stream, after everything sampled so far."""
        slot.sampled_ready.record(self.compute_stream)
        with torch.cuda.stream(self.copy_stream):
            self.copy_stream.wait_event(slot.sampled_ready)
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)
                src.record_stream(self.copy_stream)  # a fresh sampler output must outlive the copy
            slot.copy_done.record(self.copy_stream)

    def wait_copied(self, slot) -> None:
        # The commit's one wait (Photon): the host buffers are read right after this.
        slot.copy_done.synchronize()  # sync-ok: waits on the copy-done event only

    def shutdown(self) -> None:
        pass


def make_executor(device: torch.device, threaded: bool):
    if device.type == "cuda":
        return StreamExecutor(device)
    return SerialExecutor() if threaded else InlineExecutor()


def run_now(step, fn: Callable, *args) -> None:
    """Run a job that only enqueues work; an error it raises is kept on the step for its wait (the first
    one: a failed forward explains a failed sampling after it)."""
    try:
        fn(*args)
    except Exception as exc:  # delivered at wait(), like an error surfacing at an event
        if step.error is None:
            step.error = exc
