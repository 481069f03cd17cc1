"""Stages in the driver's own process, called one after another: the reference StageGroup.

No overlap between stages (a step runs start to finish inside submit), so it is for tests and for checking
the stage split itself; cluster/pipeline.py runs the same StageWorkers as Ray actors that overlap.
"""

from __future__ import annotations

from concurrent.futures import Future

from engine.pipeline.stage import StageBatch, StageSpec, StageWorker


class LocalStageGroup:
    def __init__(self, specs: list[StageSpec]):
        self.workers = [StageWorker(s) for s in specs]
        self.num_stages = len(specs)
        self.num_kv_blocks = min(w.num_kv_blocks for w in self.workers)
        self.description = f"local pipeline x{self.num_stages} ({self.workers[0].backend.__class__.__name__})"

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
        pass
