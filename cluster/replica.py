"""The engine replica: a Serve deployment whose replicas are Ray actors, each owning one engine.

The engine core runs in a child process of the replica (engine/core_proc.py; or on a thread of it with
core_process=False); the replica keeps AsyncLLM's frontend, and each request streams its outputs through its
collector back to this actor's event loop and on to the caller.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import os
import threading
from collections.abc import AsyncIterator

from engine import AsyncLLM, EngineConfig, EngineStats
from engine.async_engine import EngineDeadError
from cluster.metrics import EngineMetrics
from cluster.protocol import GenerateChunk, GenerateRequest


logger = logging.getLogger("ray.serve")
CORE_LOST_GRACE_S = 1.0


def replica_engine_config(engine_config: dict, all_cores: bool) -> EngineConfig:
    """The replica's engine config. `all_cores` (the app's only engine replica, on CPU, with neither
    cpu_threads nor replica_num_cpus given): the forward's threads are every core this process may run on,
    as vLLM's CPU server takes them, instead of the OMP_NUM_THREADS Ray derives from the replica's fractional
    CPU reservation (1), which would leave the other cores idle while the forward runs
    (docs/serving.md#other-behaviour-of-the-serving-path)."""
    config = EngineConfig(**engine_config)
    if all_cores and config.cpu_threads is None:
        config = dataclasses.replace(config, cpu_threads=len(os.sched_getaffinity(0)))
    return config


class EngineRequestError(RuntimeError):
    """The engine ended a request because of a failure, not because the client or a limit stopped it."""


class EngineReplica:
    """One engine per replica: one GPU when CUDA is visible (inside the actor it is cuda:0), else CPU."""

    def __init__(self, engine_config: dict, all_cores: bool = False, core_process: bool = False,
                 stream_events_per_s: float | None = None, core_own_cpu: bool = True):
        """`core_own_cpu`: with the core in a process, this replica's threads keep off one CPU, left to the
        core (AsyncLLM's core_own_cpu; the app's engine_core_own_cpu)."""
        self.config = replica_engine_config(engine_config, all_cores)
        self.llm = AsyncLLM(self.config, core_process=core_process, stream_events_per_s=stream_events_per_s,
                            on_core_lost=self._core_lost, core_own_cpu=core_own_cpu)
        self.metrics = EngineMetrics(self.llm)
        # Everything alive now (model, tokenizer, libraries) lives as long as the replica: keep it out of the
        # cyclic GC's full collections, which otherwise scan it every few thousand steps and stall the loop
        # (docs/serving.md#other-behaviour-of-the-serving-path).
        gc.collect()
        gc.freeze()

    @staticmethod
    def _core_lost(exc: BaseException) -> None:
        """The engine core process is gone, and with it every request of this replica (their streams have
        just failed with replica_died). The replica exits, as a crashed one would: Serve's router drops it at
        once (the ingress sends requests that have no output yet to another replica) and Serve starts a new
        one, instead of routing to a replica that can only fail until its health checks run out
        (bench/README.md, the soak). CORE_LOST_GRACE_S lets the failed streams' errors leave."""
        logger.error("engine core lost (%s); this replica exits in %.0f s so Serve replaces it", exc,
                     CORE_LOST_GRACE_S)
        threading.Timer(CORE_LOST_GRACE_S, os._exit, args=(1,)).start()

    async def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        """Stream a request's commits. Cancellation (client gone) aborts it and frees its KV blocks. A request
        the engine refuses (ValueError before any output) comes back as one rejected chunk: a user error,
        logged as one line, not raised (Serve would log it with a traceback as a failure)."""
        self.metrics.request_arrived(request.ingress_time)
        outputs = self.llm.generate(request.prompt_token_ids, request.params, request.request_id,
                                    lora_request=request.lora_request)
        try:
            try:
                out = await anext(outputs)
            except ValueError as exc:
                logger.info("request %s rejected: %s", request.request_id, exc)
                yield GenerateChunk.rejection(request.request_id, str(exc))
                return
            last_token_time: dict[int, float | None] = {}  # per sample (n > 1 samples interleave)
            while out is not None:
                last_token_time[out.index] = self.metrics.output(out, last_token_time.get(out.index))
                if out.finish_reason == "abort" and out.error is not None:
                    # The engine failed the request (a failed step, a dead pipeline stage): an error for the
                    # client (an SSE error event, or a 500), not a normal-looking "abort" finish.
                    raise self._request_failure(out.error)
                yield GenerateChunk.from_output(out)
                out = await anext(outputs, None)
        finally:
            await outputs.aclose()  # a request left early (client gone) is aborted and its blocks freed

    def _request_failure(self, error: str) -> Exception:
        """A request the engine failed. When the engine itself can no longer serve (a dead pipeline stage or
        tensor-parallel rank, a device fault: its health check now fails and Serve replaces the replica), the
        client sees the replica lost (`replica_died`, retryable, as when the replica's process dies), not an
        internal error; a failure of this request alone stays an EngineRequestError."""
        try:
            self.llm.check_health()
        except EngineDeadError as dead:
            return EngineDeadError(f"{error} (the engine cannot serve: {dead})")
        return EngineRequestError(error)

    async def abort(self, request_id: str) -> None:
        self.llm.abort(request_id)

    async def check_health(self) -> None:
        """Serve's health probe: fails once the engine loop has died, so Serve replaces the replica."""
        self.llm.check_health()

    async def stats(self) -> EngineStats:
        return self.llm.stats()

    def record_routing_stats(self) -> dict:
        """Polled by the request router: load, KV pressure and a compact summary of cached prefixes. A plain
        dict (Serve ships it to the router's process), built from the typed stats; every key is always sent,
        so the router (cluster/router.py) indexes it and only a replica with no report yet is special."""
        s = self.llm.stats()
        return {"num_waiting": s.num_waiting, "num_running": s.num_running, "kv_usage": _kv_usage(s),
                "kv_blocks_free": s.kv_blocks_free, "kv_blocks_total": s.kv_blocks_total,
                "block_size": self.config.block_size,
                "prefix_cache_hit_tokens": s.prefix_cache_hit_tokens,
                "prefix_cache_queried_tokens": s.prefix_cache_queried_tokens,
                "prefix_hashes": self.llm.prefix_summary,
                # adapters in device slots (adapter affinity); LoRA off: none
                "lora_adapters": list(s.lora_resident) if s.lora_resident is not None else []}

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Engine signals for the autoscaling policy (cluster.autoscaling)."""
        s = self.llm.stats()
        return {"num_waiting": float(s.num_waiting), "num_running": float(s.num_running),
                "kv_usage": _kv_usage(s)}

    def shutdown(self) -> None:
        """Stop the metrics thread and the engine (idempotent)."""
        if getattr(self, "_shut_down", False):
            return
        self._shut_down = True
        metrics = getattr(self, "metrics", None)
        if metrics is not None:
            metrics.stop()
        llm = getattr(self, "llm", None)
        if llm is not None:
            llm.shutdown()

    def __del__(self):
        self.shutdown()


def _kv_usage(s: EngineStats) -> float:
    """The fraction of the device KV cache in use (the engine always has at least one block)."""
    return 1.0 - s.kv_blocks_free / s.kv_blocks_total
