"""Stages in the driver's own process, called one after another: the reference StageGroup.

No overlap between stages (a step runs start to finish inside submit), so it is for tests and for checking
the stage split itself; cluster/pipeline.py runs the same StageWorkers as Ray actors that overlap.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future

from engine.pipeline.stage import StageBatch, StageSpec, StageWorker
from engine.tp.comm import open_store
from engine.tp.stage import stage_rank_specs

LOCAL = "127.0.0.1"
TP_STEP_TIMEOUT_S = 120.0  # a stage's TP collectives (EngineConfig.stall_timeout_s's default)


class LocalStageGroup:
    def __init__(self, specs: list[StageSpec]):
        self.followers: list[Future] = []  # TP x PP: each stage's TP ranks > 0, as threads
        self.workers = [self._stage(s) for s in specs]
        self.num_stages = len(specs)
        self.num_kv_blocks = min(w.num_kv_blocks for w in self.workers)
        tp = specs[0].tensor_parallel_size
        self.description = (f"local pipeline x{self.num_stages}{f' x tensor parallel {tp}' if tp > 1 else ''} "
                            f"({self.workers[0].backend.__class__.__name__})")

    def _stage(self, spec: StageSpec) -> StageWorker:
        if spec.tensor_parallel_size == 1:
            return StageWorker(spec)
        store = open_store(LOCAL, spec.tensor_parallel_size)
        rank0, *others = stage_rank_specs(spec, LOCAL, store.port, LOCAL, TP_STEP_TIMEOUT_S)
        for rank_spec in others:
            fut: Future = Future()
            threading.Thread(target=_follow, args=(rank_spec, fut), daemon=True).start()
            self.followers.append(fut)
        worker = StageWorker(rank0)
        worker.store = store  # kept alive with the stage
        return worker

    def submit(self, batch: StageBatch) -> Future:
        fut: Future = Future()
        try:
            hidden = None
            for w in self.workers:
                hidden = w.run(batch, hidden)
            fut.set_result(hidden)
        except Exception as exc:  # delivered when the driver waits, like a failed remote stage
            fut.set_exception(exc)
        return fut

    error = None  # in process: a failing stage fails its step only

    def healthy(self) -> bool:
        return True

    def busy_seconds(self) -> list[float]:
        return [w.take_busy_s() for w in self.workers]

    def shutdown(self) -> None:
        for w in self.workers:
            w.stop_followers()
        for fut in self.followers:
            try:
                fut.exception(timeout=5.0)
            except TimeoutError:  # a rank still blocked in a broken group: a daemon thread, left behind
                pass


def _follow(spec: StageSpec, fut: Future) -> None:
    try:
        fut.set_result(StageWorker(spec).follow())
    except BaseException as exc:  # noqa: BLE001 - handed to the group
        fut.set_exception(exc)
