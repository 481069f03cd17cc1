"""Async streaming API: the engine loop in its own thread, one asyncio queue per request.

This is what the Ray replica actor wraps. Other threads never touch engine state: submissions and aborts
go through an inbox the loop drains at the top of each tick; outputs come back through
loop.call_soon_threadsafe onto each request's asyncio.Queue.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator

from engine.config import EngineConfig
from engine.llm_engine import create_engine
from engine.outputs import RequestOutput, StepRecord, merge_outputs
from engine.sampling_params import SamplingParams
from engine.stats import EngineStats

logger = logging.getLogger(__name__)

SUMMARY_PERIOD_S = 0.5
SUMMARY_MAX_HASHES = 4096
STATS_PERIOD_S = 0.005  # while busy, the stats snapshot is refreshed at most this often (always when idle)


class EngineDeadError(RuntimeError):
    """The engine loop thread died; every in-flight and future request fails with this."""


class AsyncLLM:
    def __init__(self, config: EngineConfig | None = None, **kwargs):
        self.engine = create_engine(config or EngineConfig(**kwargs))
        self.tokenizer = self.engine.tokenizer
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, _Collector] = {}
        self._lock = threading.Lock()  # guards _streams between the loop thread and callers
        self._stopping = False
        self.dead: BaseException | None = None
        self._stats: EngineStats = self.engine.stats()
        self.prefix_summary: list[int] = []  # recent cached block hashes, refreshed by the loop thread
        self._summary_time = 0.0
        self._stats_time = 0.0
        self._progress_time = time.monotonic()  # the loop's last completed tick (the watchdog reads it)
        self._has_work = False
        self._thread = threading.Thread(target=self._run, name="tandem-engine-loop", daemon=True)
        self._thread.start()

    # ---- caller side (asyncio) ---------------------------------------------------------------------------
    async def generate(self, prompt: str | list[int], params: SamplingParams | None = None,
                       request_id: str | None = None, lora_request=None) -> AsyncIterator[RequestOutput]:
        """Submit a request and yield its outputs as they are committed. Leaving the iteration early
        (client gone, task cancelled) aborts the request and frees its blocks. `lora_request`: the LoRA
        adapter to run under (engine.lora.LoRARequest or an adapter name; None = the base model)."""
        self.check_health()
        request_id = request_id or uuid.uuid4().hex
        # raises ValueError on bad input (an unknown or unsupported adapter too: read from disk on first use)
        if lora_request is None:
            seq = self.engine.make_sequence(prompt, params, request_id)
        else:  # an adapter's first use reads it from disk: off the caller's event loop
            seq = await asyncio.to_thread(self.engine.make_sequence, prompt, params, request_id, lora_request)
        compiled = self.engine.structured.compile_async(seq.params)
        if compiled is not None:  # compiles on the grammar pool; a bad grammar raises ValueError here
            timeout = self.engine.config.grammar_compile_timeout_s
            try:  # shield: the future is shared (cache)
                await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(compiled)), timeout)
            except asyncio.TimeoutError:
                raise self.engine.structured.timed_out(seq.params, compiled, timeout) from None
        n = seq.params.n
        q = _Collector(asyncio.get_running_loop(), n)
        with self._lock:
            if request_id in self._streams:
                raise ValueError(f"request_id {request_id!r} is already in use")
            self._streams[request_id] = q
        self._send(("add", seq))
        if self.dead is not None:  # died between the health check and the submission
            self._fail_all(EngineDeadError(f"engine loop died: {self.dead!r}"))
        unfinished = n  # n > 1: the samples' outputs interleave (RequestOutput.index), each ends on its own
        try:
            while unfinished:
                items = await q.get()
                for item in items:
                    unfinished -= item.finished
                    yield item
        finally:
            with self._lock:
                self._streams.pop(request_id, None)
            if unfinished:
                self._send(("abort", request_id))

    def abort(self, request_id: str) -> None:
        self._send(("abort", request_id))

    def check_health(self) -> None:
        """Raises EngineDeadError when the engine cannot serve: its loop died, its device faulted, or it has
        had work but made no progress for stall_timeout_s (a hung step)."""
        if self.dead is not None or not self._thread.is_alive():
            raise EngineDeadError(f"engine loop is not running: {self.dead!r}")
        broken = self.engine.health_error()
        if broken is not None:
            raise EngineDeadError(broken)
        stalled = time.monotonic() - self._progress_time
        if self._has_work and stalled > self.engine.config.stall_timeout_s:
            raise EngineDeadError(f"engine loop made no progress for {stalled:.0f} s while it had work "
                                  f"(stall_timeout_s={self.engine.config.stall_timeout_s:g})")

    def stats(self) -> EngineStats:
        """The engine's latest snapshot (engine/stats.py), refreshed by the loop thread after ticks (see
        _publish). Immutable, so every reader gets the same object, no copy."""
        return self._stats

    def drain_step_records(self) -> list[StepRecord]:
        """Per-step timing records since the last drain (for the metrics exporter, any thread)."""
        return self.engine.drain_step_records()

    def shutdown(self) -> None:
        """Stop the loop; requests still streaming fail with EngineDeadError (nobody would serve them)."""
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout=30)
        self._fail_all(EngineDeadError("the engine shut down (the replica is being removed); retry the request"))
        self.engine.shutdown()

    def _send(self, command: tuple) -> None:
        self._inbox.put(command)
        self._wake.set()

    # ---- loop thread ---------------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stopping:
                self._wake.clear()
                self._drain_inbox()
                self._progress_time = time.monotonic()
                self._has_work = self.engine.has_unfinished()
                if not self._has_work:
                    self._publish(force=True)
                    self._wake.wait()
                    continue
                outputs = self.engine.step()
                t0 = time.perf_counter()
                self._deliver(outputs)
                self._publish()
                self.engine.host_time["stream"] += time.perf_counter() - t0
        except BaseException as exc:  # the loop is dead: fail every waiting caller, never hang them
            logger.exception("engine loop died")
            self.dead = exc
            self._fail_all(EngineDeadError(f"engine loop died: {type(exc).__name__}: {exc}"))

    def _publish(self, force: bool = False) -> None:
        """Snapshot stats (at most every STATS_PERIOD_S while busy, and whenever the engine goes idle) and the
        prefix summary (at most every SUMMARY_PERIOD_S) for readers on other threads; engine state itself is
        only ever read on this thread. Building the snapshot every tick showed up in the host's time per step
        at GPU step rates (docs/engine.md#host-work-per-step)."""
        now = time.monotonic()
        if force or now - self._stats_time > STATS_PERIOD_S:
            self._stats = self.engine.stats()
            self._stats_time = now
        if force or now - self._summary_time > SUMMARY_PERIOD_S:
            self.prefix_summary = self.engine.block_manager.recent_hashes(SUMMARY_MAX_HASHES)
            self._summary_time = now

    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, arg = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                self._add(arg)
            else:
                self._deliver(self.engine.abort(arg))

    def _add(self, seq) -> None:
        with self._lock:
            sink = self._streams.get(seq.request_id)
        if sink is None:  # caller left before the loop saw the request
            return
        try:
            self.engine.add_sequence(seq, stream=True, sink=sink)
        except (ValueError, RuntimeError) as exc:  # a bad request, or an engine that turned unhealthy
            self._push(seq.request_id, exc)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """Hand a tick's outputs to their callers: one wake-up per caller event loop, not one per output
        (each call_soon_threadsafe writes to the loop's self-pipe)."""
        if not outputs:
            return
        batches: dict[asyncio.AbstractEventLoop, list] = {}
        with self._lock:
            for out in outputs:
                target = self._streams.get(out.request_id)
                if target is not None:
                    batches.setdefault(target.loop, []).append((target, out))
        for loop, items in batches.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # the caller's event loop is closed: nobody is listening any more
                pass

    def _push(self, request_id: str, item) -> None:
        with self._lock:
            target = self._streams.get(request_id)
        if target is not None:
            _put_threadsafe(target, item)

    def _fail_all(self, exc: BaseException) -> None:
        with self._lock:
            targets = list(self._streams.values())
        for target in targets:
            _put_threadsafe(target, exc)


class _Collector:
    """One request's outputs on their way from the engine thread to the caller: one slot per sample (n),
    not a queue.

    An output the caller has not taken yet is merged with the next one of the same sample (its deltas
    prepended), so a caller that falls behind the engine (a busy event loop, thousands of tokens a second)
    receives fewer, larger outputs instead of a growing backlog of wake-ups; one that keeps up gets every
    commit on its own. The engine reads `items` to skip building outputs nobody has taken. An exception
    ends the stream (raised by get() before anything pending). Lives on the caller's event loop: put() and
    get() run only there."""

    __slots__ = ("loop", "items", "error", "_pending", "_waiter")

    def __init__(self, loop: asyncio.AbstractEventLoop, n: int = 1):
        self.loop = loop
        self.items: list[RequestOutput | None] = [None] * n  # by RequestOutput.index
        self.error: BaseException | None = None
        self._pending = 0  # slots holding an output
        self._waiter: asyncio.Future | None = None

    def put(self, item: RequestOutput | BaseException) -> None:
        if isinstance(item, BaseException):
            self.error = item
        else:
            pending = self.items[item.index]
            if pending is None:
                self._pending += 1
            self.items[item.index] = item if pending is None else merge_outputs(pending, item)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def get(self) -> list[RequestOutput]:
        """The outputs pending (at least one), in sample order; raises the stream's exception."""
        while not self._pending and self.error is None:
            self._waiter = self.loop.create_future()
            await self._waiter
        if self.error is not None:
            raise self.error
        if len(self.items) == 1:
            item, self.items[0], self._pending = self.items[0], None, 0
            return [item]
        items = [i for i in self.items if i is not None]
        self.items = [None] * len(self.items)
        self._pending = 0
        return items


def _put_all(items: list[tuple[_Collector, RequestOutput]]) -> None:
    for target, item in items:
        target.put(item)


def _put_threadsafe(target: _Collector, item) -> None:
    try:
        target.loop.call_soon_threadsafe(target.put, item)
    except RuntimeError:  # the caller's event loop is closed: nobody is listening any more
        pass
