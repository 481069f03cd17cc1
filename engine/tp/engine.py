"""Tensor-parallel engine: the single-device engine with a TPModelRunner as rank 0 of a group of N ranks.

Scheduling, sampling, commit and the two-slot pipeline are the plain EngineCore's; the runner
(engine/tp/runner.py) broadcasts each step to the worker ranks inside its forward job. The workers are
started by a factory the caller provides (cluster/tensor_parallel.py: Ray actors in the replica's placement
group), so this package needs no Ray.

A rank that dies fails the step in flight (its collective raises), then every request and every later step:
the engine treats it as a device fault (health_error is set, so Serve replaces the replica).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Protocol

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.llm_engine import LLMEngine
from engine.models.tp import check_shardable
from engine.outputs import CoreOutput
from engine.slot import Step
from engine.stats import EngineStats
from engine.tp.runner import TensorParallelError, TPModelRunner
from engine.tp.worker import TPWorkerSpec


class WorkerGroup(Protocol):
    """Ranks 1..N-1, however they run. `comm` is rank 0's GroupComm, joined once every worker has."""

    comm: object
    description: str

    def error(self) -> str | None:
        """Why a worker is gone (None while all run)."""

    def shutdown(self) -> None: ...


WorkerGroupFactory = Callable[[TPWorkerSpec], WorkerGroup]


def rank_config(config: EngineConfig) -> EngineConfig:
    """The config each rank builds its runner from: the ranks share one host's memory, so each takes its share
    of the CPU KV budget (as pipeline stages do)."""
    n = config.tensor_parallel_size
    return dataclasses.replace(
        config, cpu_memory_utilization=config.cpu_memory_utilization / n,
        cpu_kv_cache_bytes=None if config.cpu_kv_cache_bytes is None else config.cpu_kv_cache_bytes // n)


class TensorParallelEngineCore(EngineCore):
    def __init__(self, config: EngineConfig, make_workers: WorkerGroupFactory):
        self._make_workers = make_workers
        super().__init__(config)

    def _make_runner(self, num_cpu_blocks: int) -> tuple[TPModelRunner, int]:
        cfg = self.config
        check_shardable(self.spec, cfg.tensor_parallel_size)
        if self.compute_device.type != "cpu":
            raise ValueError(f"tensor_parallel_size > 1 runs on cpu (gloo) only for now; the device is "
                             f"{self.compute_device.type}")
        per_rank = rank_config(cfg)
        template = TPWorkerSpec(config=per_rank, rank=0, size=cfg.tensor_parallel_size,
                                dtype=str(self.dtype).removeprefix("torch."), max_model_len=self.max_model_len)
        workers = self._make_workers(template)
        try:
            runner = TPModelRunner(per_rank, self.hf_config, self.spec, self.compute_device, self.dtype,
                                   self.max_model_len, workers.comm, workers)
        except BaseException:
            workers.shutdown()
            raise
        return runner, runner.num_kv_blocks

    def health_error(self) -> str | None:
        return super().health_error() or self.runner.group_error()

    def _fail_step(self, step: Step, exc: Exception, error: str | None = None) -> list[CoreOutput]:
        """A broken group fails everything, like a device fault (EngineCore._device_failed), once."""
        if error is None and self.fault is None and isinstance(exc, TensorParallelError):
            return self._device_failed(step, exc)
        return super()._fail_step(step, exc, error)

    def stats(self) -> EngineStats:
        return dataclasses.replace(super().stats(), **self.runner.stats())


def TensorParallelEngine(config: EngineConfig, make_workers: WorkerGroupFactory) -> LLMEngine:
    """The in-process engine (LLMEngine) over a tensor-parallel core."""
    return LLMEngine(core=TensorParallelEngineCore(config, make_workers))
