"""The simulated device: in-order streams on a virtual clock anchored to wall time (time.perf_counter).

No thread runs the device and nothing spins on its behalf. Work is priced when the host enqueues it: an
item starts at max(its stream's free time, the moment the host issued it, the completion of every event it
waits for) and ends its modelled duration later, so an event is simply that end time. The host blocks only
in `synchronize`, and only when the event lies in the future. Two streams, compute and copy, as on CUDA;
`wait_event` makes a stream's next item wait for another stream's event.

Device idle is read off the compute stream: a gap where the stream had finished its previous item and the
host had not yet enqueued the next one (host-caused: the bubble pipelining hides), plus, for an eager
forward, the time its kernels waited for the host to launch them. A gap where an item was enqueued but
waited for an event (a KV swap copy) counts separately as `dep_wait_s`. Gaps after the engine reported
itself idle (no requests) are not counted: the time until the next request is not a bubble.

Launch cost: the CUDA path spends host time launching what it enqueues (operator dispatch, graph replay,
cudaMemcpyAsync); `run(..., host_s=...)` charges that time to the calling thread by keeping it busy, as the
real launch would, and the item cannot end before its last kernel was launched.

Emulation is off the clock: the simulator's own host work, which stands in for the device's (pricing a step
with the cost model, drawing its tokens and writing them where the device-to-host copy would), runs inside
`emulating()`, and the CPU time it takes, less the launch charges made within it, is taken off the virtual
clock (`emulation_s`). A GPU would do that work on the device, so charging it to the host's step made the
simulated device idle for the simulator's sake. The clock is wall time less that total, so every other host
cycle, real or charged, still delays the device exactly as before.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

_wall = time.perf_counter
# The host's wait sleeps until this long before the event, then yields in a loop: plain sleep overshoots by
# the kernel's timer slack, while cudaEventSynchronize spin-waits by default. The tail covers the overshoot
# measured on the development host (docs/simulated-device.md).
SPIN_TAIL_S = 150e-6
TRACE_ITEMS = 4096


class SimEvent:
    """A point on the virtual clock: when the work it was recorded after completes."""

    __slots__ = ("time",)

    def __init__(self, t: float = 0.0):
        self.time = t


class SimStream:
    __slots__ = ("name", "free_at", "busy_s", "_waits")

    def __init__(self, name: str):
        self.name = name
        self.free_at = 0.0  # when the last enqueued item ends
        self.busy_s = 0.0
        self._waits: list[float] = []  # events the next item waits for (wait_event)


@dataclass(frozen=True, slots=True)
class Item:
    stream: str
    kind: str
    issued: float
    start: float
    end: float


class SimDevice:
    """Two in-order streams and the accounting of the compute stream's busy and idle time."""

    def __init__(self, trace: bool = False):
        self.compute = SimStream("compute")
        self.copy = SimStream("copy")
        self.idle_s = 0.0  # compute stream free, nothing enqueued (or kernels waiting to be launched)
        self.dep_wait_s = 0.0  # compute stream free, next item waiting on another stream's event
        self.host_launch_s = 0.0  # host time charged for launching work
        self.host_blocked_s = 0.0  # host time spent in synchronize()
        self.emulation_s = 0.0  # the simulator's own host work, off the virtual clock (emulating)
        self._emulation = _Emulation(self)
        self._fresh = True  # the next compute item opens an active period: the gap before it is not idle
        self.trace: deque[Item] | None = deque(maxlen=TRACE_ITEMS) if trace else None

    def now(self) -> float:
        """The virtual clock: wall time less the simulator's own work so far."""
        return _wall() - self.emulation_s

    def emulating(self) -> "_Emulation":
        """A context: take the calling thread's CPU time in it, less the launch charges made in it, off the clock;
        the block does what the device would (see the module docstring). CPU time, not wall time, so a wait for
        the GIL or the core inside the block stays on the host's account. (One reusable object, not a
        contextlib generator: it runs twice a step.)"""
        return self._emulation

    # ---- enqueueing ---------------------------------------------------------------------------------------
    def run(self, stream: SimStream, duration: float, kind: str = "", host_s: float = 0.0,
            waits: tuple[SimEvent, ...] = ()) -> Item:
        """Enqueue `duration` seconds of work on `stream`, launched by the caller in `host_s` of its time."""
        issued = launched = self.now()
        if host_s > 0:
            _busy(host_s)
            self.host_launch_s += host_s
            launched = self.now()
        ready = issued
        for t in stream._waits:
            ready = max(ready, t)
        for ev in waits:
            ready = max(ready, ev.time)
        stream._waits.clear()
        start = max(stream.free_at, ready)
        launch_wait = max(0.0, launched - (start + duration))  # eager kernels run only once launched
        end = start + duration + launch_wait
        if stream is self.compute:
            self._account(stream.free_at, issued, start, launch_wait)
        stream.free_at = end
        stream.busy_s += duration
        item = Item(stream.name, kind, issued, start, end)
        if self.trace is not None:
            self.trace.append(item)
        return item

    def _account(self, free_at: float, issued: float, start: float, launch_wait: float) -> None:
        if self._fresh:
            self._fresh = False
        elif start > free_at:
            host_gap = max(0.0, min(issued, start) - free_at)
            self.idle_s += host_gap
            self.dep_wait_s += start - free_at - host_gap
        self.idle_s += launch_wait

    def record(self, stream: SimStream) -> SimEvent:
        """An event completing when everything enqueued on `stream` so far has completed."""
        return SimEvent(max(stream.free_at, self.now()))

    def wait_event(self, stream: SimStream, event: SimEvent) -> None:
        """The next item enqueued on `stream` starts no earlier than `event`."""
        stream._waits.append(event.time)

    # ---- the host side ---------------------------------------------------------------------------------------
    def synchronize(self, event: SimEvent) -> None:
        """Block the calling thread until `event` has completed on the virtual clock."""
        remaining = event.time - self.now()
        if remaining <= 0:
            return
        t0 = self.now()
        if remaining > SPIN_TAIL_S:
            time.sleep(remaining - SPIN_TAIL_S)
        while self.now() < event.time:
            time.sleep(0)  # yields the GIL and the core
        self.host_blocked_s += self.now() - t0

    def idle(self) -> None:
        """The engine has no work: the gap until its next item is not device idle."""
        self._fresh = True

    # ---- stats -----------------------------------------------------------------------------------------------
    @property
    def busy_s(self) -> float:
        return self.compute.busy_s

    def stats(self) -> dict:
        busy, idle, dep = self.compute.busy_s, self.idle_s, self.dep_wait_s
        total = busy + idle + dep
        return {"device_busy_s": busy, "device_idle_s": idle, "device_dep_wait_s": dep,
                "device_busy_fraction": busy / total if total else 0.0, "device_copy_busy_s": self.copy.busy_s,
                "host_launch_s": self.host_launch_s, "host_blocked_s": self.host_blocked_s,
                "sim_emulation_s": self.emulation_s}


class _Emulation:
    """SimDevice.emulating()'s context (not reentrant: the runner's jobs do not nest)."""

    __slots__ = ("device", "t0", "charged")

    def __init__(self, device: SimDevice):
        self.device = device
        self.t0 = self.charged = 0.0

    def __enter__(self) -> None:
        self.t0, self.charged = time.thread_time(), self.device.host_launch_s

    def __exit__(self, *exc) -> None:
        dev = self.device
        dev.emulation_s += max(0.0, time.thread_time() - self.t0 - (dev.host_launch_s - self.charged))


def _busy(seconds: float) -> None:
    """Keep this thread busy for `seconds` (a launch's CPU time: the real call holds the thread too)."""
    end = _wall() + seconds
    while _wall() < end:
        pass
