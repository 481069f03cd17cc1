"""Forward and sampling time of one step, on the device's own timeline.

On CUDA the host only enqueues kernels, so host wall time says nothing about how long the GPU worked:
the marks are CUDA events recorded on the current stream and read at the commit, after the wait that
the commit does anyway. On CPU the jobs run on the compute thread and the marks are perf_counter().
"""

from __future__ import annotations

import time

import torch

FORWARD_START, FORWARD_END, SAMPLE_START, SAMPLE_END = range(4)


class StepTimer:
    """Four marks per step, owned by one DecodeSlot and reused (no allocation per step). A slot carries
    one step at a time, so its marks are never overwritten before the commit has read them."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self._events = [torch.cuda.Event(enable_timing=True) for _ in range(4)] if self.cuda else None
        self._times = [0.0] * 4

    def mark(self, which: int) -> None:
        if self.cuda:
            self._events[which].record()
        else:
            self._times[which] = time.perf_counter()

    def read(self) -> tuple[float, float]:
        """(forward_s, sample_s). Call after the step's results have been waited for."""
        if self.cuda:
            ev = self._events
            # The commit already waited for the step's device-to-host copy, which follows SAMPLE_END on
            # the stream; this wait returns at once and only guards elapsed_time against a not-ready event.
            ev[SAMPLE_END].synchronize()
            return (ev[FORWARD_START].elapsed_time(ev[FORWARD_END]) / 1e3,
                    ev[SAMPLE_START].elapsed_time(ev[SAMPLE_END]) / 1e3)
        t = self._times
        return t[FORWARD_END] - t[FORWARD_START], t[SAMPLE_END] - t[SAMPLE_START]
