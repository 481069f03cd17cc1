"""Tensor-parallel worker ranks as Ray actors: one per device, in the replica's placement group.

The engine (engine/tp) is rank 0 in the driver's process (the Serve replica, or the offline LLM's process);
ranks 1..N-1 are engine.tp.TPWorker actors, each in its own bundle of the current placement group (the Serve
replica's: build_app adds one bundle per worker, STRICT_PACK by default) or of one made here. The driver opens
the rendezvous store, starts the actors, and joins the gloo group as rank 0 while watching the actors: one
that fails to start ends the wait with its error instead of the rendezvous timeout. Each actor then runs
`follow` (one long call, rank 0's broadcasts drive it); its ObjectRef resolving means the worker is gone,
which the engine's health check reports.

Placement: STRICT_PACK puts every rank on the driver's node and the group talks over 127.0.0.1; PACK or
SPREAD may place ranks on other nodes, and then each rank's gloo device binds its node's IP.
"""

from __future__ import annotations

import logging
import uuid

import ray
from ray.util.placement_group import get_current_placement_group, placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from cluster.pipeline import release
from engine.tp.comm import START_TIMEOUT_S, GroupComm, open_store
from engine.tp.worker import TPWorker, TPWorkerSpec

logger = logging.getLogger(__name__)

LOCAL = "127.0.0.1"


def worker_bundles(num_workers: int, device: str, num_cpus: float) -> list[dict]:
    """One placement-group bundle per worker rank (ranks 1..N-1; rank 0 is the replica's own bundle)."""
    return [{"GPU": 1, "CPU": num_cpus} if device == "cuda" else {"CPU": num_cpus} for _ in range(num_workers)]


class RayTPWorkerGroup:
    """engine.tp.engine.WorkerGroup of Ray actors. `first_bundle`: the first worker's bundle index in the
    current placement group (a Serve replica holds bundle 0)."""

    def __init__(self, template: TPWorkerSpec, num_cpus: float = 1.0, strategy: str = "STRICT_PACK",
                 first_bundle: int = 1):
        if not ray.is_initialized():
            ray.init()
        size, self._own_pg = template.size, None
        pg, offset = get_current_placement_group(), first_bundle
        if pg is None:
            pg = self._own_pg = placement_group(worker_bundles(size - 1, "cpu", num_cpus), strategy=strategy)
            ray.get(pg.ready(), timeout=START_TIMEOUT_S)
            offset = 0
        host = LOCAL if strategy == "STRICT_PACK" else ray.util.get_node_ip_address()
        store = open_store(host, size)
        self.name = f"tandem-tp-{uuid.uuid4().hex[:8]}"
        actor_cls = ray.remote(_RayTPWorker)
        threads = max(1, int(num_cpus)) if num_cpus else None
        self.actors = [
            actor_cls.options(
                name=f"{self.name}-rank{r}", num_cpus=num_cpus,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=pg, placement_group_bundle_index=offset + r - 1),
            ).remote(TPWorkerSpec(**{**_fields(template), "rank": r, "store_host": host, "store_port": store.port,
                                     "bind_host": host if strategy == "STRICT_PACK" else None,
                                     "num_threads": threads}))
            for r in range(1, size)]
        self.loops = [a.follow.remote() for a in self.actors]  # queued behind each actor's __init__
        self.description = f"tensor parallel x{size} over Ray ({strategy})"
        try:
            self.comm = GroupComm.host_watching(store, size, host, template.config.stall_timeout_s,
                                                self._raise_if_exited)
        except BaseException:
            self.shutdown()
            raise

    def _raise_if_exited(self) -> None:
        done, _ = ray.wait(self.loops, timeout=0)
        if done:
            ray.get(done[0])  # raises the worker's start error
            raise RuntimeError("a tensor-parallel worker exited before joining the group")

    def error(self) -> str | None:
        if not self.loops:
            return None
        done, _ = ray.wait(self.loops, timeout=0)
        if not done:
            return None
        try:
            ray.get(done[0])
            return "a worker rank stopped following the group"
        except Exception as exc:  # noqa: BLE001 - the worker's death or error, reported
            return f"{type(exc).__name__}: {exc}"

    def shutdown(self) -> None:
        actors, self.actors, self.loops = getattr(self, "actors", []), [], []
        own_pg, self._own_pg = self._own_pg, None
        release(actors, own_pg)


class _RayTPWorker(TPWorker):
    """A worker that binds its gloo device to its own node's IP when the group may span nodes."""

    def __init__(self, spec: TPWorkerSpec):
        if spec.bind_host is None:
            spec = TPWorkerSpec(**{**_fields(spec), "bind_host": ray.util.get_node_ip_address()})
        super().__init__(spec)


def _fields(spec: TPWorkerSpec) -> dict:
    return {f: getattr(spec, f) for f in spec.__dataclass_fields__}


def make_tensor_parallel_engine(config):
    """The engine core for `tensor_parallel_size > 1`: rank 0 here, the other ranks as Ray actors."""
    from engine.core import EngineCore
    from engine.tp import tensor_parallel_runner

    return EngineCore(config, tensor_parallel_runner(lambda template: RayTPWorkerGroup(
        template, num_cpus=config.tp_worker_num_cpus)))
