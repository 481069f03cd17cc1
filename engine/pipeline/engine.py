"""Pipeline parallelism for the engine core: its runner is a PipelineRunner over p stages.

The driver (the core, on the host) plans microbatches, the stages run them, the last stage samples (or the
driver does, pp_cpu_sampling), the driver commits. The core's loop is the plain one (engine/core.py, no engine
subclass): a step in flight per runner slot, and the PipelineRunner has one slot per stage, so up to p
microbatches are in flight and every stage has work: iteration n + p is scheduled when iteration n's tokens
return (its sequences become schedulable again at that commit). A sequence rides in at most one in-flight step
(Scheduler(one_step_per_seq=True)), so microbatches are disjoint and a step never waits for a token on another
device; the plain engine's one-step-ahead pipelining is replaced by the stage pipeline itself.

The stages are reached through a StageGroup: Ray actors over a compiled graph (cluster/pipeline.py), or
in process (engine/pipeline/local.py).
"""

from __future__ import annotations

from typing import Callable

from engine.config import EngineConfig
from engine.core import EngineCore, RunnerFactory
from engine.llm_engine import LLMEngine
from engine.models.tp import check_shardable
from engine.pipeline.runner import PipelineRunner, StageGroup
from engine.pipeline.stage import StageSpec, split_layers
from engine.step_buffers import BufferLimits
from engine.step_runner import StepRunner

StageGroupFactory = Callable[[list[StageSpec]], StageGroup]


def pipeline_runner(make_stages: StageGroupFactory) -> RunnerFactory:
    """The core's runner factory (engine/core.py RunnerFactory) for pipeline parallelism: the stages from
    `make_stages`, driven by a PipelineRunner."""
    def make(core: EngineCore, num_cpu_blocks: int) -> PipelineRunner:
        limits = StepRunner.buffer_limits(core.config, core.max_model_len)
        on_stage = samples_on_last_stage(core)
        return PipelineRunner(core.config, core.spec, make_stages(stage_specs(core, limits, on_stage)), limits,
                              on_stage)
    return make


def samples_on_last_stage(core: EngineCore) -> bool:
    """EngineConfig.pp_cpu_sampling resolved: None samples on the last stage on GPUs (its fp32 logits rows, up to
    max_num_seqs x vocab, would otherwise leave the GPU every step) and on the driver's CPU with CPU stages
    (measured faster there: docs/parallelism.md)."""
    cpu_sampling = core.config.pp_cpu_sampling
    return core.compute_device.type == "cuda" if cpu_sampling is None else not cpu_sampling


def stage_specs(core: EngineCore, limits: BufferLimits, sample_on_stage: bool) -> list[StageSpec]:
    """One per stage (its TP rank 0; the stage group derives the other ranks' specs, engine/tp/stage.py)."""
    cfg, p, tp = core.config, core.config.pipeline_parallel_size, core.config.tensor_parallel_size
    check_shardable(core.spec, tp)
    n = p * tp  # processes sharing this host's memory
    dtype = str(core.dtype).removeprefix("torch.")
    return [StageSpec(model=cfg.model_dir, gguf_file=cfg.gguf_file, index=i, num_stages=p, layers=layers,
                      block_size=cfg.block_size, limits=limits, max_model_len=core.max_model_len, dtype=dtype,
                      device=core.compute_device.type, attention_backend=cfg.attention_backend,
                      kv_cache_dtype=cfg.kv_cache_dtype,
                      num_kv_blocks=cfg.num_kv_blocks, gpu_memory_utilization=cfg.gpu_memory_utilization,
                      # the stages (and their TP ranks) share one host's memory: each takes its share
                      cpu_kv_cache_bytes=None if cfg.cpu_kv_cache_bytes is None else cfg.cpu_kv_cache_bytes // n,
                      cpu_memory_utilization=cfg.cpu_memory_utilization / n, token_safe=cfg.pp_token_safe,
                      structure_aware=cfg.pp_structure_aware, sample_on_stage=sample_on_stage,
                      seed=cfg.seed, tensor_parallel_size=tp)
            for i, layers in enumerate(split_layers(core.spec.num_layers, p))]


def PipelineEngine(config: EngineConfig, make_stages: StageGroupFactory) -> LLMEngine:
    """The in-process engine (LLMEngine) over a pipeline-parallel core."""
    return LLMEngine(core=EngineCore(config, pipeline_runner(make_stages)))
