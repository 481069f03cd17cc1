"""Pipeline-parallel engine: the single-device engine's scheduler, sampler and commit over p stages.

The driver (this object, on the host) plans microbatches, the stages run them, the driver samples and
commits. Up to p microbatches are in flight, one per stage, so every stage has work: iteration n + p is
scheduled when iteration n's tokens return (its sequences become schedulable again at that commit).
A sequence rides in at most one in-flight step (Scheduler(one_step_per_seq=True)), so microbatches are
disjoint and a step never waits for a token on another device; the plain engine's one-step-ahead pipelining
is replaced by the stage pipeline itself.

The stages are reached through a StageGroup: Ray actors over a compiled graph (cluster/pipeline.py), or
in process (engine/pipeline/local.py).
"""

from __future__ import annotations

import dataclasses
from collections import deque
from typing import Callable

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.llm_engine import LLMEngine
from engine.models.tp import check_shardable
from engine.outputs import CoreOutput
from engine.pipeline.runner import PipelineRunner, StageGroup
from engine.pipeline.stage import StageSpec, split_layers
from engine.slot import Step
from engine.stats import EngineStats
from engine.step_buffers import BufferLimits
from engine.step_runner import StepRunner

StageGroupFactory = Callable[[list[StageSpec]], StageGroup]


class PipelineEngineCore(EngineCore):
    def __init__(self, config: EngineConfig, make_stages: StageGroupFactory):
        self._make_stages = make_stages
        self.pending: deque[Step] = deque()  # launched microbatches, oldest first
        super().__init__(config)

    def _make_runner(self, num_cpu_blocks: int) -> tuple[PipelineRunner, int]:
        cfg = self.config
        limits = StepRunner.buffer_limits(cfg, self.max_model_len)
        stages = self._make_stages(self.stage_specs(limits))
        return PipelineRunner(cfg, self.spec, stages, limits), stages.num_kv_blocks

    def stage_specs(self, limits: BufferLimits) -> list[StageSpec]:
        """One per stage (its TP rank 0; the stage group derives the other ranks' specs, engine/tp/stage.py)."""
        cfg, p, tp = self.config, self.config.pipeline_parallel_size, self.config.tensor_parallel_size
        check_shardable(self.spec, tp)
        n = p * tp  # processes sharing this host's memory
        dtype = str(self.dtype).removeprefix("torch.")
        return [StageSpec(model=cfg.model, index=i, num_stages=p, layers=layers, block_size=cfg.block_size,
                          limits=limits, max_model_len=self.max_model_len, dtype=dtype,
                          device=self.compute_device.type, attention_backend=cfg.attention_backend,
                          num_kv_blocks=cfg.num_kv_blocks, gpu_memory_utilization=cfg.gpu_memory_utilization,
                          # the stages (and their TP ranks) share one host's memory: each takes its share
                          cpu_kv_cache_bytes=None if cfg.cpu_kv_cache_bytes is None else cfg.cpu_kv_cache_bytes // n,
                          cpu_memory_utilization=cfg.cpu_memory_utilization / n, token_safe=cfg.pp_token_safe,
                          structure_aware=cfg.pp_structure_aware, sample_on_stage=not cfg.pp_cpu_sampling,
                          seed=cfg.seed, tensor_parallel_size=tp)
                for i, layers in enumerate(split_layers(self.spec.num_layers, p))]

    def _stage_sampling(self) -> bool:
        return not self.config.pp_cpu_sampling  # requests are checked against what the last stage samples

    def health_error(self) -> str | None:
        stages = self.runner.stages
        return super().health_error() or (None if stages.healthy() else f"a pipeline stage failed: {stages.error!r}")

    def inflight_steps(self) -> list[Step]:
        return list(self.pending)

    def has_unfinished(self) -> bool:
        return bool(self.requests) or bool(self.pending)

    def step(self) -> list[CoreOutput]:
        """One tick: launch a microbatch into a free slot if any sequence is free to run; commit the oldest
        in-flight one when the pipeline is full or nothing new could start."""
        outputs = self._admit_compiled() if self.compiling else []
        launched = False
        slot = self.runner.free_slot()
        if slot is not None and self.scheduler.has_work():
            sched = self.scheduler.schedule()
            if sched:
                self.pending.append(self.runner.launch(sched, slot))
                launched = True
        if self.pending and (not launched or self.runner.free_slot() is None):
            step = self.pending.popleft()
            self.runner.finalize(step)  # waits for the step's logits and samples them on the host
            outputs += self._commit(step)
        elif not self.pending and not launched:
            outputs += self._idle_tick(bool(outputs))
        self._note_idle()
        return outputs

    def _idle_tick(self, had_outputs: bool) -> list[CoreOutput]:
        if self.scheduler.has_work():
            return self._end_stuck()
        if self.compiling and not had_outputs:
            self._wait_for_compile()
        return []

    def stats(self) -> EngineStats:
        return dataclasses.replace(super().stats(), pipeline_parallel_size=self.config.pipeline_parallel_size,
                                   microbatches_in_flight=len(self.pending))

    def stage_busy_seconds(self) -> list[float]:
        """Each stage's busy time (prepare + forward) since the last call: the benchmark's busy fraction."""
        return self.runner.stages.busy_seconds()


def PipelineEngine(config: EngineConfig, make_stages: StageGroupFactory) -> LLMEngine:
    """The in-process engine (LLMEngine) over a pipeline-parallel core."""
    return LLMEngine(core=PipelineEngineCore(config, make_stages))
