"""The ingress and its engine in one replica (AppConfig.colocated): no engine hop.

A streamed token normally crosses two Serve hops after the engine commits it: engine replica to ingress,
ingress to Serve's HTTP proxy, each a Python process that spends CPU per chunk. On a CPU host it comes out
of the cores the forward runs on, and worse, every time a Serve process takes a core for a moment it stalls
the forward's other OpenMP thread at the next barrier; at GPU rates the hop's CPU per chunk is what limits the
streamed tokens, and its latency adds to every TTFT. Here the OpenAI ingress
builds its engine (cluster.replica.EngineReplica) inside its own replica and calls it directly: one Python
process fewer per chunk, nothing serialized between the two.

What it gives up: the engine-side request router (prefix and LoRA affinity across replicas; Serve's proxy
picks among colocated replicas by ongoing requests), ingress replicas scaled apart from engines, and the
retry of a request whose engine replica died before its first token (the ingress dies with it). It is the
default for an app of one engine replica behind one ingress (serve_app.builder.colocated_by_default).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from cluster.protocol import GenerateChunk
from cluster.replica import EngineReplica
from engine import EngineStats
from serve_app.ingress import OpenAIIngress


class _LocalStream:
    """One request's chunks straight from the in-process engine, shaped like the handle's response
    generator the ingress awaits (`__anext__`, `async for`, `cancel()`). It holds one of the engine's
    in-flight places until it ends, is cancelled or is dropped."""

    def __init__(self, chunks: AsyncIterator[GenerateChunk], engine: LocalEngine):
        self._chunks = chunks
        self._engine: LocalEngine | None = engine
        engine.in_flight += 1

    def _release(self) -> None:
        if self._engine is not None:
            self._engine.in_flight -= 1
            self._engine = None

    def __aiter__(self):
        return self

    async def __anext__(self) -> GenerateChunk:
        try:
            return await self._chunks.__anext__()
        except BaseException:  # the end, a failure or a cancellation: the place is free either way
            self._release()
            raise

    def cancel(self) -> None:
        """Stop the request: closing the replica's generator aborts it in the engine and frees its blocks
        (cluster.replica.EngineReplica.generate's `finally`). A consumer cancelled mid-chunk has closed it
        already."""
        if self._engine is None:
            return
        self._release()
        with contextlib.suppress(RuntimeError):  # no running loop: nothing left to close it on
            asyncio.get_running_loop().create_task(self._chunks.aclose())

    def __del__(self):
        self._release()


class _Refused:
    """A request over the in-flight limit: its first chunk is Serve's BackPressureError, which the ingress
    answers as for the split app (503 "overloaded" with Retry-After)."""

    def __init__(self, error: Exception):
        self._error = error

    async def __anext__(self):
        raise self._error

    def cancel(self) -> None:
        pass


class _LocalMethod:
    def __init__(self, fn):
        self._fn = fn

    def remote(self, *args, **kwargs):
        return self._fn(*args, **kwargs)


class LocalEngine:
    """The in-process engine behind the ingress's handle calls: `generate.remote(request)` streams its
    chunks, `.options(...)` is the handle's, for the same code path. At most `max_in_flight` requests run or
    wait in the engine (None: no limit): what the split app's handle allows an engine replica
    (max_ongoing_requests) plus its queue (max_queued_requests)."""

    def __init__(self, replica: EngineReplica, max_in_flight: int | None = None):
        self.replica = replica
        self.max_in_flight = max_in_flight
        self.in_flight = 0
        self.generate = _LocalMethod(self._generate)

    def _generate(self, request):
        if self.max_in_flight is not None and self.in_flight >= self.max_in_flight:
            from ray.serve.exceptions import BackPressureError

            return _Refused(BackPressureError(num_queued_requests=self.in_flight,
                                              max_queued_requests=self.max_in_flight))
        return _LocalStream(self.replica.generate(request), self)

    def options(self, **_: object) -> LocalEngine:
        return self


class ColocatedIngress(OpenAIIngress):
    """OpenAIIngress with its engine in the same replica. Serve's health probe and routing stats
    are the engine's, as on an engine replica; /health counts this replica's engine."""

    async def __init__(self, engine_config: dict, all_cores: bool, max_in_flight: int | None, *args,
                       core_process: bool = False, stream_events_per_s: float | None = None,
                       core_own_cpu: bool = True, **kwargs):
        self.replica = EngineReplica(engine_config, all_cores, core_process, stream_events_per_s, core_own_cpu)
        await super().__init__(LocalEngine(self.replica, max_in_flight), *args, **kwargs)

    async def check_health(self) -> None:
        await self.replica.check_health()

    async def stats(self) -> EngineStats:
        return await self.replica.stats()

    def record_routing_stats(self) -> dict:
        return self.replica.record_routing_stats()

    async def _running_engine_replicas(self) -> int:
        try:
            await self.replica.check_health()
        except Exception:  # noqa: BLE001 - a dead or stalled engine: no healthy replica here (503)
            return 0
        return 1

    async def __del__(self):
        try:
            await super().__del__()  # the ASGI app's shutdown
        finally:
            replica = getattr(self, "replica", None)
            if replica is not None:
                replica.shutdown()
