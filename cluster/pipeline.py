"""Pipeline stages as Ray actors, wired together by a Ray compiled graph.

One stage group per engine replica: p stage actors (engine.pipeline.StageWorker under ray.remote), each
holding a contiguous slice of the layers and its slice of the paged KV cache (engine/pipeline/stage.py),
ganged by a placement group: the Serve replica's own when there is one (build_app adds a bundle per stage
to the deployment, sized for the stage's TP group under tensor parallelism), else one made here
(STRICT_PACK: one node; PACK/SPREAD let the stages spread over nodes, a stage's TP ranks always sharing its
bundle's node). The driver (the engine replica, or the
offline LLM's process) sends each step once into the graph; every stage reads it from the graph's input,
hidden states go stage to stage, the last stage's logits come back to the driver.

Transport: Ray's compiled graphs (`experimental_compile`) with NCCL between GPU stages and shared-memory
channels on CPU; the graph keeps p executions in flight, so all stages work on different microbatches at
once. Structure-aware transmission maps onto the channel's `_static_shape`/`_direct_return` hints: a stage
sends its hidden states in a fixed layout, so the receiver pre-allocates and no shape metadata travels.

A stage actor that dies breaks the graph: every in-flight and later step fails (its requests end with an
error, never hang), `healthy()` turns False, and the replica's health check fails so Serve replaces the
replica, which builds a fresh stage group.
"""

from __future__ import annotations

import logging
import os
import uuid
from concurrent.futures import Future

import ray
from ray.dag import InputNode
from ray.util.placement_group import get_current_placement_group, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from engine.pipeline.runner import failed_future
from engine.pipeline.stage import StageBatch, StageSpec, StageWorker
from engine.tp.comm import open_store
from engine.tp.stage import stage_rank_specs

logger = logging.getLogger(__name__)

STAGE_START_TIMEOUT_S = 300.0
STAGE_TP_TIMEOUT_S = 120.0  # a stage's TP collectives within a step (EngineConfig.stall_timeout_s's default)
LOCAL = "127.0.0.1"


def stage_bundles(num_stages: int, device: str, stage_num_cpus: float, tp: int = 1) -> list[dict]:
    """One placement-group bundle per stage, sized for the stage's whole TP group (tp ranks): a bundle is
    placed on one node, so a stage's ranks always share a node (their group talks over loopback) while
    PACK/SPREAD may still put different stages on different nodes."""
    return [{"GPU": tp, "CPU": tp * stage_num_cpus} if device == "cuda" else {"CPU": tp * stage_num_cpus}
            for _ in range(num_stages)]


def release(actors: list, own_pg) -> None:
    """Kill a group's actors and remove the placement group it made for itself (None: it ran in the Serve
    replica's, which Serve removes); nothing to do once the Ray session is gone, its actors with it."""
    if not ray.is_initialized():
        return
    for actor in actors:
        ray.kill(actor)
    if own_pg is not None:
        remove_placement_group(own_pg)


class RayStageGroup:
    """The StageGroup (engine/pipeline/runner.py) of Ray actors driven through a compiled graph.

    `first_bundle`: index of the first stage's bundle in the current placement group (a Serve replica
    reserves bundle 0 for itself); used only when the caller runs inside a placement group."""

    def __init__(self, specs: list[StageSpec], stage_num_cpus: float = 1.0, strategy: str = "STRICT_PACK",
                 first_bundle: int = 1):
        if not ray.is_initialized():
            ray.init()
        self.num_stages = len(specs)
        self.device = specs[0].device
        tp = specs[0].tensor_parallel_size
        self._own_pg = None
        pg, offset = get_current_placement_group(), first_bundle
        if pg is None:
            pg = self._own_pg = placement_group(stage_bundles(self.num_stages, self.device, stage_num_cpus, tp),
                                                strategy=strategy)
            ray.get(pg.ready(), timeout=STAGE_START_TIMEOUT_S)
            offset = 0
        actor_cls = ray.remote(StageWorker)  # one GPU each on CUDA; inside the actor it is cuda:0
        follower_cls = ray.remote(_StageFollower)
        self.name = f"tandem-pp-{uuid.uuid4().hex[:8]}"  # unique: two groups on one node never collide

        def start(name: str, bundle: int, spec: StageSpec):
            cls = actor_cls if spec.tp is None or spec.tp.rank == 0 else follower_cls
            return cls.options(
                name=f"{self.name}-{name}", num_cpus=stage_num_cpus, num_gpus=1 if self.device == "cuda" else 0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=pg, placement_group_bundle_index=offset + bundle)).remote(spec)

        # TP x PP (engine/tp/stage.py): stage i's TP rank 0 is the graph's stage actor and its other ranks
        # follow it, all in bundle i (so on one node: their gloo group binds loopback), in a group whose
        # rendezvous store is opened here, on this process's node address (the stage may be on another node).
        self._stores, self.followers, self._follows = [], [], []
        ranks = [[spec] for spec in specs]
        if tp > 1:
            store_host = ray.util.get_node_ip_address()  # reachable from the stage's node, wherever it is
            for i, spec in enumerate(specs):
                store = open_store(store_host, tp)
                self._stores.append(store)
                ranks[i] = stage_rank_specs(spec, store_host, store.port, LOCAL, STAGE_TP_TIMEOUT_S)
        self.actors = [start(f"stage{i}", i, r[0]) for i, r in enumerate(ranks)]
        for i, stage_ranks in enumerate(ranks):
            for r, rank_spec in enumerate(stage_ranks[1:], start=1):
                actor = start(f"stage{i}-tp{r}", i, rank_spec)
                self.followers.append(actor)
                self._follows.append(actor.follow.remote())
        try:
            infos = ray.get([a.info.remote() for a in self.actors], timeout=STAGE_START_TIMEOUT_S)
            self.num_kv_blocks = min(blocks for blocks, _ in infos)
            backend = infos[0][1]
        except Exception:
            self.shutdown()
            raise
        self.transport = "nccl" if self.device == "cuda" else "shm"
        self.description = (f"pipeline x{self.num_stages}{f' x tensor parallel {tp}' if tp > 1 else ''} over Ray "
                            f"({self.transport}, {backend})")
        self.dag = self._compile(specs[0])
        self.error: BaseException | None = None

    def _compile(self, spec: StageSpec):
        """InputNode -> stage 0 -> ... -> stage p-1 -> driver. With token-safe execution each stage's
        prepare is its own node reading only the graph input, so it runs before upstream hidden states
        arrive; without, a stage prepares only after it has received them."""
        with InputNode() as batch:
            hidden = None
            for i, actor in enumerate(self.actors):
                if spec.token_safe:
                    hidden = actor.forward.bind(actor.prepare.bind(batch), hidden)
                else:
                    hidden = actor.run.bind(batch, hidden)
                if i < self.num_stages - 1:
                    hidden = hidden.with_tensor_transport(
                        transport=self.transport, _static_shape=spec.structure_aware,
                        _direct_return=spec.structure_aware)
        return hidden.experimental_compile(_max_inflight_executions=self.num_stages + 1)

    def submit(self, batch: StageBatch) -> Future:
        """Start a step; the Future resolves to the last stage's output (raises if a stage failed)."""
        if self.error is not None:
            return failed_future(RuntimeError(f"pipeline stage group is broken: {self.error!r}"))
        try:
            ref = self.dag.execute(batch)
        except Exception as exc:  # a dead stage closes the graph's channels
            return self._broken(exc)
        return _LazyResult(ref, self)

    def _broken(self, exc: BaseException) -> Future:
        if self.error is None:
            logger.error("pipeline stage group failed: %r", exc)
            self.error = exc
        return failed_future(exc)

    def healthy(self) -> bool:
        if self.error is None and self._follows and ray.wait(self._follows, timeout=0)[0]:
            self.error = RuntimeError("a stage's tensor-parallel rank stopped")  # it died, or its group broke
        return self.error is None

    def busy_seconds(self) -> list[float]:
        """Not through the graph (an actor runs one thing at a time): call between steps, when idle."""
        return ray.get([a.take_busy_s.remote() for a in self.actors])

    def shutdown(self) -> None:
        dag, self.dag = getattr(self, "dag", None), None
        if dag is not None:
            try:
                dag.teardown()
            except Exception:  # noqa: BLE001 - a broken graph may fail to tear down cleanly
                logger.debug("compiled graph teardown failed", exc_info=True)
        actors, self.actors = getattr(self, "actors", []) + getattr(self, "followers", []), []
        self.followers, self._follows = [], []
        own_pg, self._own_pg = self._own_pg, None
        release(actors, own_pg)


class _StageFollower(StageWorker):
    """A stage's TP rank > 0 as an actor: a rank that fails exits, so its closed sockets tell the stage's
    rank 0 (blocked in a collective) at once instead of at the step timeout."""

    def follow(self) -> int:
        try:
            return super().follow()
        except BaseException:
            logger.exception("pipeline stage %d, tensor-parallel rank %d failed", self.spec.index, self.spec.tp.rank)
            os._exit(1)


class _LazyResult(Future):
    """A Future over a CompiledDAGRef: its value is fetched (once) when first asked for."""

    def __init__(self, ref, group: RayStageGroup):
        super().__init__()
        self._ref, self._group = ref, group

    def result(self, timeout=None):
        if not self.done():
            try:
                # No timeout (Ray's default get timeout is 10 s: a long prefill on a slow stage is not a
                # failure); a dead stage still ends the wait, as the graph tears itself down and the read
                # raises RayChannelError.
                self.set_result(self._ref.get(timeout=-1))
            except Exception as exc:  # noqa: BLE001 - a stage died or raised: fail this step
                if isinstance(exc, (ray.exceptions.RayChannelError, ray.exceptions.ActorDiedError,
                                    ray.exceptions.RayActorError)):
                    self._group._broken(exc)
                self.set_exception(exc)
        return super().result(timeout)


def make_pipeline_engine(config):
    """The engine core for `pipeline_parallel_size > 1`: the driver here, the stages as Ray actors. The same entry
    point also makes the tensor-parallel engine (cluster/tensor_parallel.py), so installs made before it
    existed find it without reinstalling."""
    if config.tensor_parallel_size > 1 and config.pipeline_parallel_size == 1:
        from cluster.tensor_parallel import make_tensor_parallel_engine

        return make_tensor_parallel_engine(config)
    from engine.core import EngineCore
    from engine.pipeline import pipeline_runner

    return EngineCore(config, pipeline_runner(lambda specs: RayStageGroup(specs,
                                                                          stage_num_cpus=config.pp_stage_num_cpus)))
