"""Async streaming API: a frontend (tokenization, text, stop strings, one output slot per request) over an
engine core that runs either in a thread of this process or in a process of its own.

In process (`core_process=False`, what tests and tools use): the engine loop (LLMEngine: core plus output
processing) runs in a thread; submissions and aborts go through an inbox the loop drains at the top of each
tick, outputs come back through loop.call_soon_threadsafe onto each request's collector.

Core process (`core_process=True`, what a Serve replica uses): the core runs in a child process
(engine/core_proc.py) and this process keeps only the frontend. An output thread receives one message per
core tick (per sample, the new token ids and their logprobs), turns it into RequestOutputs
(engine/output_processor.py), tells the core about stop strings it found, and hands the outputs to their
callers. The core's loop then never shares a GIL with Serve's HTTP and streaming code.
"""

from __future__ import annotations

import asyncio
import logging
import pickle
import queue
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator

from transformers import AutoTokenizer

from engine.block_manager import prompt_block_hashes
from engine.config import EngineConfig
from engine.llm_engine import create_engine, tokenize
from engine.output_processor import OutputProcessor
from engine.outputs import RequestOutput, StepRecord, merge_outputs
from engine.sampling_params import SamplingParams, sibling_params
from engine.stats import EngineStats

logger = logging.getLogger(__name__)

SUMMARY_PERIOD_S = 0.5
SUMMARY_MAX_HASHES = 4096
STATS_PERIOD_S = 0.005  # while busy, the stats snapshot is refreshed at most this often (always when idle)
OUTPUT_POLL_MS = 200  # the output thread checks the core process is alive at least this often
STEP_RECORDS_MAX = 4096


class EngineDeadError(RuntimeError):
    """The engine loop or core process died; every in-flight and future request fails with this."""


class AsyncLLM:
    def __init__(self, config: EngineConfig | None = None, core_process: bool = False,
                 stream_events_per_s: float | None = None, on_core_lost=None, core_own_cpu: bool = False,
                 **kwargs):
        """`core_process`: run the engine core in a child process (what Serve replicas do). `stream_events_per_s`:
        pace streams so that all of them together get at most about this many outputs a second (a stream's
        interval is the number of open streams over it; its first output and its finish are never held): under
        load each output carries more tokens, and the serving path, which costs per output, keeps up. None:
        every commit is handed out as soon as the caller takes it. `on_core_lost(exc)`: called (on the output
        thread) once the core process is gone, after its streams were failed."""
        config = config or EngineConfig(**kwargs)
        if stream_events_per_s is not None and not stream_events_per_s > 0:
            raise ValueError(f"stream_events_per_s must be > 0 (or None for no pacing); got {stream_events_per_s!r}")
        self._pace = None if stream_events_per_s is None else \
            (lambda: len(self._streams) / stream_events_per_s)
        self._streams: dict[str, _Collector] = {}
        self._lock = threading.Lock()  # guards _streams (and the processor in core-process mode) across threads
        self._stopping = False
        self.dead: BaseException | None = None
        self.prefix_summary: list[int] = []  # recent cached block hashes, refreshed by the loop / output thread
        self._summary_time = 0.0
        self._stats_time = 0.0
        self._progress_time = time.monotonic()  # the last completed tick / core message (the watchdog reads it)
        self._has_work = False
        self.core_process = core_process
        self._on_core_lost = on_core_lost
        if core_process:
            from engine.core_client import CoreProcess, CpuReservation  # (pyzmq only where a core process runs)

            self.engine = None
            self.config = config
            self._core = CoreProcess(config)
            try:  # a frontend that fails to start stops its core process now, not when this process exits
                self._limits, self.eos_token_ids = self._core.limits, self._core.eos_token_ids
                self.tokenizer = AutoTokenizer.from_pretrained(config.model_dir, local_files_only=True)
                self._processor = OutputProcessor(self.tokenizer.backend_tokenizer)
                self._stats_blob: bytes = self._core.stats_blob  # the core's snapshot as it started
                self._stats_cache: tuple[bytes | None, EngineStats | None] = (None, None)
                self._core_health: str | None = None
                self._records: deque[StepRecord] = deque(maxlen=STEP_RECORDS_MAX)
                self._send_lock = threading.Lock()  # zmq sockets are not thread-safe
                self._thread = threading.Thread(target=self._run_outputs, name="tandem-core-outputs", daemon=True)
                self._thread.start()
            except BaseException:
                self._core.close(timeout_s=0)
                raise
            # (last: nothing after it raises, so a frontend that failed to start never holds the reservation; it
            # moves the output thread too, as every thread of the process)
            self._cpu_reservation = CpuReservation() if core_own_cpu else None
        else:
            self.engine = create_engine(config)
            self.config = self.engine.config
            self.tokenizer = self.engine.tokenizer
            self._inbox: queue.SimpleQueue = queue.SimpleQueue()
            self._wake = threading.Event()
            self._stats: EngineStats = self.engine.stats()
            self._thread = threading.Thread(target=self._run, name="tandem-engine-loop", daemon=True)
            self._thread.start()

    # ---- caller side (asyncio) ---------------------------------------------------------------------------
    async def generate(self, prompt: str | list[int], params: SamplingParams | None = None,
                       request_id: str | None = None, lora_request=None) -> AsyncIterator[RequestOutput]:
        """Submit a request and yield its outputs as they are committed. Leaving the iteration early
        (client gone, task cancelled) aborts the request and frees its blocks. `lora_request`: the LoRA
        adapter to run under (engine.lora.LoRARequest or an adapter name; None = the base model).
        A request the engine refuses raises ValueError naming the problem, before any output."""
        self.check_health()
        request_id = request_id or uuid.uuid4().hex
        q = _Collector(asyncio.get_running_loop(), (params or SamplingParams()).n
                       if isinstance(params, SamplingParams) else 1, self._pace)
        if self.core_process:
            self._submit_to_process(prompt, params, request_id, lora_request, q)
        else:
            await self._submit_in_process(prompt, params, request_id, lora_request, q)
        if self.dead is not None:  # died between the health check and the submission
            self._fail_all(EngineDeadError(f"engine loop died: {self.dead!r}"))
        unfinished = len(q.items)  # n > 1: the samples' outputs interleave (RequestOutput.index)
        first = True
        try:
            while unfinished:
                items = await q.get()
                for item in items:
                    if first and item.rejected:
                        unfinished = 0
                        raise ValueError(item.error)
                    first = False
                    unfinished -= item.finished
                    yield item
        finally:
            with self._lock:
                self._streams.pop(request_id, None)
                if unfinished and self.core_process:  # its late outputs are dropped
                    self._processor.discard(request_id, len(q.items))
            if unfinished:
                self.abort(request_id)

    async def _submit_in_process(self, prompt, params, request_id, lora_request, q) -> None:
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
        with self._lock:
            if request_id in self._streams:
                raise ValueError(f"request_id {request_id!r} is already in use")
            self._streams[request_id] = q
        self._inbox.put(("add", seq))
        self._wake.set()

    def _submit_to_process(self, prompt, params, request_id, lora_request, q) -> None:
        """Tokenize and check here (errors raise at once); grammars and adapters are the core's, which
        refuses a request it cannot run with a rejected output (raised as ValueError by generate)."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        text, ids = tokenize(self.tokenizer, prompt)
        self._limits.check(ids, params)
        samples = [params] + [sibling_params(params, i) for i in range(1, params.n)]
        # The prompt's block hashes, made here rather than on the core's loop (EngineCore.make_sequence); an
        # adapter's requests hash from the adapter's root, which the core knows.
        hashes = prompt_block_hashes(ids, self.config.block_size) \
            if self.config.enable_prefix_caching and lora_request is None else None
        arrival = time.monotonic()
        with self._lock:
            if request_id in self._streams or self._processor.has(request_id):
                raise ValueError(f"request_id {request_id!r} is already in use")
            self._streams[request_id] = q
            self._processor.add(request_id, text, ids, params, arrival, True, samples)
        try:
            self._send("add", (request_id, ids, params, lora_request, arrival, hashes))
        except EngineDeadError:
            with self._lock:
                self._streams.pop(request_id, None)
                self._processor.discard(request_id, len(samples))
            raise

    def abort(self, request_id: str) -> None:
        if self.core_process:
            self._send("abort", request_id)
        else:
            self._inbox.put(("abort", request_id))
            self._wake.set()

    def check_health(self) -> None:
        """Raises EngineDeadError when the engine cannot serve: its loop or core process died, its device
        faulted, or it has had work but made no progress for stall_timeout_s (a hung step)."""
        if self.dead is not None or not self._thread.is_alive():
            raise EngineDeadError(f"engine loop is not running: {self.dead!r}")
        if self.core_process:
            code = self._core.exitcode()
            if code is not None:
                raise EngineDeadError(f"the engine core process exited with code {code}")
            broken = self._core_health
        else:
            broken = self.engine.health_error()
        if broken is not None:
            raise EngineDeadError(broken)
        stalled = time.monotonic() - self._progress_time
        if self._has_work and stalled > self.config.stall_timeout_s:
            raise EngineDeadError(f"engine loop made no progress for {stalled:.0f} s while it had work "
                                  f"(stall_timeout_s={self.config.stall_timeout_s:g})")

    def stats(self) -> EngineStats:
        """The engine's latest snapshot (engine/stats.py), refreshed by the loop thread (or the core process)
        while it runs. Immutable, so every reader gets the same object, no copy."""
        if not self.core_process:
            return self._stats
        blob, cached = self._stats_cache
        if blob is not self._stats_blob:
            blob = self._stats_blob
            cached = pickle.loads(blob)
            self._stats_cache = (blob, cached)
        return cached

    def drain_step_records(self) -> list[StepRecord]:
        """Per-step timing records since the last drain (for the metrics exporter, any thread)."""
        source = self._records if self.core_process else self.engine.step_records
        records = []
        while source:
            records.append(source.popleft())
        return records

    def shutdown(self) -> None:
        """Stop the loop (and the core process); requests still streaming fail with EngineDeadError."""
        if self._stopping:
            return
        self._stopping = True
        if self.core_process:
            with self._send_lock:
                self._core.close()
            self._thread.join(timeout=30)
            if self._cpu_reservation is not None:
                self._cpu_reservation.release()
        else:
            self._wake.set()
            self._thread.join(timeout=30)
        self._fail_all(EngineDeadError("the engine shut down (the replica is being removed); retry the request"))
        if not self.core_process:
            self.engine.shutdown()

    # ---- core process: the output thread -------------------------------------------------------------------
    def _send(self, kind: str, arg) -> None:
        """To the core. An abort or finish the core cannot receive any more is moot (it is gone with its
        requests); a new request that cannot be sent fails as the engine being dead."""
        with self._send_lock:
            delivered = self._stopping or self._core.send(kind, arg)
        if not delivered and kind == "add":
            raise EngineDeadError("the engine core process is not reachable")

    def _run_outputs(self) -> None:
        from engine.core_proc import DEAD, OUT, decode_outputs, decode_records

        core = self._core
        try:
            while not self._stopping:
                msg = core.recv(OUTPUT_POLL_MS)
                if msg is None:
                    with self._lock:
                        self._has_work = bool(self._streams)
                    code = core.exitcode()
                    if code is not None and not self._stopping:
                        raise EngineDeadError(f"the engine core process exited with code {code}")
                    continue
                self._progress_time = time.monotonic()
                if msg[0] == DEAD:
                    raise EngineDeadError(msg[1])
                if msg[0] != OUT:
                    continue
                _, rows, stats, records, summary, health = msg
                if stats is not None:
                    self._stats_blob, self._core_health = stats, health
                if records:
                    self._records.extend(decode_records(records))
                if summary is not None:
                    self.prefix_summary = summary
                if rows:
                    with self._lock:
                        outputs, stopped = self._processor.process(decode_outputs(rows))
                        self._has_work = bool(self._streams)
                    if stopped:
                        self._send("finish", stopped)
                    self._deliver(outputs)
        except BaseException as exc:  # the core is gone: fail every waiting caller, never hang them
            if self._stopping:
                return
            logger.error("engine core lost: %s", exc)
            self.dead = exc
            self._fail_all(exc if isinstance(exc, EngineDeadError) else
                           EngineDeadError(f"engine core lost: {type(exc).__name__}: {exc}"))
            if self._on_core_lost is not None:
                self._on_core_lost(exc)

    # ---- in process: the loop thread -----------------------------------------------------------------------
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
            self.engine.add_sequence(seq, stream=True)
        except (ValueError, RuntimeError) as exc:  # a bad request, or an engine that turned unhealthy
            self._push(seq.request_id, exc)

    # ---- both ----------------------------------------------------------------------------------------------
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
    commit on its own. With a pacing interval (AsyncLLM's stream_events_per_s), get() hands out at most one
    batch per interval, except that a finish (or an error) is handed out at once: later commits merge into
    what waits. An exception ends the stream (raised by get() before anything pending). Lives on the caller's
    event loop: put() and get() run only there."""

    __slots__ = ("loop", "items", "error", "_pending", "_texts", "_waiter", "_interval", "_next_at", "_finished")

    def __init__(self, loop: asyncio.AbstractEventLoop, n: int = 1, interval=None):
        self.loop = loop
        self.items: list[RequestOutput | None] = [None] * n  # by RequestOutput.index
        self.error: BaseException | None = None
        self._pending = 0  # slots holding an output
        # The text pieces of a slot whose output merged later ones (None: it did not), joined once by get():
        # joining them at every merge would copy the text so far each time, O(k^2) over k merges
        self._texts: list[list[str] | None] = [None] * n
        self._waiter: asyncio.Future | None = None
        self._interval = interval  # () -> seconds between handed-out batches; None: no pacing
        self._next_at = 0.0  # loop time before which get() holds what is pending (pacing)
        self._finished = False  # a pending output ends its sample: hand it out now

    def put(self, item: RequestOutput | BaseException) -> None:
        first = not self._pending  # get() is waiting for anything at all: wake it (it paces with a timer)
        if isinstance(item, BaseException):
            self.error = item
        else:
            i = item.index
            pending = self.items[i]
            if pending is None:
                self._pending += 1
                self.items[i] = item
            else:
                parts = self._texts[i]
                if parts is None:
                    parts = self._texts[i] = [pending.delta_text]
                parts.append(item.delta_text)
                self.items[i] = merge_outputs(pending, item, join_text=False)
            self._finished |= item.finished
        waiter = self._waiter
        if waiter is not None and not waiter.done() and (
                first or self._interval is None or self.error is not None or self._finished):
            waiter.set_result(None)

    async def get(self) -> list[RequestOutput]:
        """The outputs pending (at least one), in sample order; raises the stream's exception."""
        while self.error is None:
            if self._pending:
                wait = 0.0 if self._interval is None or self._finished else self._next_at - self.loop.time()
                if wait <= 0:
                    break
                self._waiter = self.loop.create_future()  # paced: merge until the interval ends (or a finish)
                self.loop.call_later(wait, _wake, self._waiter)
            else:
                self._waiter = self.loop.create_future()
            await self._waiter
        if self.error is not None:
            raise self.error
        if self._interval is not None:
            self._next_at = self.loop.time() + self._interval()
        self._finished = False
        texts = self._texts
        for i, parts in enumerate(texts):
            if parts is not None:
                self.items[i].delta_text = "".join(parts)
                texts[i] = None
        if len(self.items) == 1:
            item, self.items[0], self._pending = self.items[0], None, 0
            return [item]
        items = [i for i in self.items if i is not None]
        self.items = [None] * len(self.items)
        self._pending = 0
        return items


def _wake(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_result(None)


def _put_all(items: list[tuple[_Collector, RequestOutput]]) -> None:
    for target, item in items:
        target.put(item)


def _put_threadsafe(target: _Collector, item) -> None:
    try:
        target.loop.call_soon_threadsafe(target.put, item)
    except RuntimeError:  # the caller's event loop is closed: nobody is listening any more
        pass
