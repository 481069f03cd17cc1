"""Pipeline parallelism (SiPipe-style): the model's layers split over stages that only run forwards,
driven by an engine that schedules, samples and commits on the host. See engine/pipeline/engine.py."""

from engine.pipeline.engine import PipelineEngine, PipelineEngineCore
from engine.pipeline.local import LocalStageGroup
from engine.pipeline.stage import StageBatch, StageSpec, StageWorker, split_layers

__all__ = ["LocalStageGroup", "PipelineEngine", "PipelineEngineCore", "StageBatch", "StageSpec", "StageWorker", "split_layers"]
