"""Where forwards and sampling run: an ordered work queue, the CPU stand-in for a CUDA stream.

Jobs run strictly in submission order, so a forward that reads the previous step's sampled tokens always
runs after that sampling, exactly as kernels queued on one stream would. Waiting on a job's Future is the
CPU counterpart of waiting on a CUDA event.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable


class SerialExecutor:
    """One worker thread: the engine thread plans and commits while the worker runs the forward
    (torch kernels release the GIL, so the two overlap)."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tandem-compute")

    def submit(self, fn: Callable, *args) -> Future:
        return self._pool.submit(fn, *args)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


class InlineExecutor:
    """Runs each job at submission (debugging, and CUDA, where the launch itself is asynchronous)."""

    def submit(self, fn: Callable, *args) -> Future:
        fut: Future = Future()
        try:
            fut.set_result(fn(*args))
        except BaseException as exc:  # delivered at wait(), like an error surfacing at an event
            fut.set_exception(exc)
        return fut

    def shutdown(self) -> None:
        pass
