"""The ingress and its engine in one replica (AppConfig.colocated): no engine hop.

A streamed token normally crosses two Serve hops after the engine commits it: engine replica to ingress,
ingress to Serve's HTTP proxy, each a Python process that spends CPU per chunk. On a GPU that CPU is spare;
on a CPU host it comes out of the cores the forward runs on, and worse, every time a Serve process takes a
core for a moment it stalls the forward's other OpenMP thread at the next barrier. Here the OpenAI ingress
builds its engine (cluster.replica.EngineReplica) inside its own replica and calls it directly: one Python
process fewer per chunk, nothing serialized between the two.

What it gives up: the engine-side request router (prefix and LoRA affinity across replicas; Serve's proxy
picks among colocated replicas by ongoing requests), ingress replicas scaled apart from engines, and the
retry of a request whose engine replica died before its first token (the ingress dies with it).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from cluster.protocol import GenerateChunk
from cluster.replica import EngineReplica
from serve_app.ingress import OpenAIIngress


class _LocalStream:
    """One request's chunks straight from the in-process engine, shaped like the handle's response
    generator the ingress awaits (`__anext__`, `async for`, `cancel()`)."""

    def __init__(self, chunks: AsyncIterator[GenerateChunk]):
        self._chunks = chunks
        self._closed = False

    def __aiter__(self):
        return self

    async def __anext__(self) -> GenerateChunk:
        return await self._chunks.__anext__()

    def cancel(self) -> None:
        """Stop the request: closing the replica's generator aborts it in the engine and frees its blocks
        (cluster.replica.EngineReplica.generate's `finally`). A cancelled consumer has closed it already."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(RuntimeError):  # still running in its consumer: that one closes it
            asyncio.get_running_loop().create_task(self._chunks.aclose())


class _LocalMethod:
    def __init__(self, fn):
        self._fn = fn

    def remote(self, *args, **kwargs):
        return self._fn(*args, **kwargs)


class LocalEngine:
    """The in-process engine behind the ingress's handle calls: `generate.remote(request)` streams its
    chunks, `.options(...)` is the handle's, for the same code path."""

    def __init__(self, replica: EngineReplica):
        self.replica = replica
        self.generate = _LocalMethod(lambda request: _LocalStream(replica.generate(request)))

    def options(self, **_: object) -> LocalEngine:
        return self


class ColocatedIngress(OpenAIIngress):
    """OpenAIIngress with its engine in the same replica. Serve's health probe, routing and autoscaling stats
    are the engine's, as on an engine replica; /health counts this replica's engine."""

    async def __init__(self, engine_config: dict, all_cores: bool, *args, **kwargs):
        self.replica = EngineReplica(engine_config, all_cores)
        await super().__init__(LocalEngine(self.replica), *args, **kwargs)

    async def check_health(self) -> None:
        await self.replica.check_health()

    async def stats(self) -> dict:
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
