"""Pipeline parallelism (SiPipe-style): the model's layers split over stages that only run forwards,
driven by the engine core through a PipelineRunner. See engine/pipeline/engine.py."""

from engine.pipeline.engine import PipelineEngine, pipeline_runner
from engine.pipeline.local import LocalStageGroup
from engine.pipeline.stage import StageBatch, StageSpec, StageWorker, split_layers

__all__ = ["LocalStageGroup", "PipelineEngine", "StageBatch", "StageSpec", "StageWorker", "pipeline_runner",
           "split_layers"]
