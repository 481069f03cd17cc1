"""Tensor parallelism for the engine core: its runner is a TPModelRunner, rank 0 of a group of N ranks.

Scheduling, sampling, commit and the two-slot pipeline are the plain EngineCore's (no engine subclass); the
runner (engine/tp/runner.py) broadcasts each step to the worker ranks inside its forward job. The workers are
started by a factory the caller provides (cluster/tensor_parallel.py: Ray actors in the replica's placement
group), so this package needs no Ray.

A rank that dies fails the step in flight (its collective raises), then every request and every later step:
the runner says the failure is fatal (is_fatal), the core treats it as a device fault, and health_error is set,
so Serve replaces the replica.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Protocol

from engine.config import EngineConfig
from engine.core import EngineCore, RunnerFactory
from engine.llm_engine import LLMEngine
from engine.models.tp import check_shardable
from engine.tp.runner import TPModelRunner
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


def tensor_parallel_runner(make_workers: WorkerGroupFactory) -> RunnerFactory:
    """The core's runner factory (engine/core.py RunnerFactory) for tensor parallelism: rank 0's TPModelRunner
    here, ranks 1..N-1 from `make_workers`."""
    def make(core: EngineCore, num_cpu_blocks: int) -> TPModelRunner:
        cfg = core.config
        check_shardable(core.spec, cfg.tensor_parallel_size)
        if core.compute_device.type != "cpu":
            raise ValueError(f"tensor_parallel_size > 1 runs on cpu (gloo) only for now; the device is "
                             f"{core.compute_device.type}")
        per_rank = rank_config(cfg)
        template = TPWorkerSpec(config=per_rank, rank=0, size=cfg.tensor_parallel_size,
                                dtype=str(core.dtype).removeprefix("torch."), max_model_len=core.max_model_len)
        workers = make_workers(template)
        try:
            return TPModelRunner(per_rank, core.hf_config, core.spec, core.compute_device, core.dtype,
                                 core.max_model_len, workers.comm, workers)
        except BaseException:
            workers.shutdown()
            raise
    return make


def TensorParallelEngine(config: EngineConfig, make_workers: WorkerGroupFactory) -> LLMEngine:
    """The in-process engine (LLMEngine) over a tensor-parallel core."""
    return LLMEngine(core=EngineCore(config, tensor_parallel_runner(make_workers)))
