"""The driver's side of a pipeline-parallel engine: plans go out to the stages, logits come back, the
driver samples them on its CPU (SiPipe's CPU sampling, so the last stage is not the straggler); or the last
stage samples on the parameters sent with the step and only token ids (and their logprobs) come back
(pp_cpu_sampling; the default is the driver on CPU stages, the last stage on GPU stages).

It is the engine core's runner (engine/step_runner.py: launch / finalize / wait) and reuses its host-input
assembly, sampling job and result reading; what differs is where the forward runs. One DecodeSlot per
microbatch in flight (one per stage) holds the returned logits, the sampled tokens and the host buffers the
commit reads. Nothing is sampled until the step's commit waits for it (`wait`): microbatches in flight are
disjoint, so the sampling inputs are as current then as right after launch, and `finalize` (called right after
launch) has nothing to do.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Protocol

import torch

from engine.config import EngineConfig
from engine.executor import FWD_END, FWD_START, SAMPLE_END, SAMPLE_START, InlineExecutor
from engine.models.decoder import ModelSpec
from engine.pipeline.stage import StageBatch
from engine.sampler import SamplingBatch
from engine.scheduler import SchedulerOutput
from engine.slot import DecodeSlot, Step, StepResult
from engine.step_buffers import BufferLimits
from engine.step_runner import StepRunner, host_rows


class StageGroup(Protocol):
    """The stages of one pipeline, however they are reached (Ray actors, or in process)."""

    num_stages: int
    num_kv_blocks: int  # the smallest KV capacity over the stages: what the driver's block manager gets
    description: str
    error: BaseException | None

    def submit(self, batch: StageBatch) -> Future:
        """Start `batch` through every stage; the Future gives the last stage's output."""

    def busy_seconds(self) -> list[float]:
        """Each stage's busy time since the last call (prepare + forward)."""

    def healthy(self) -> bool:
        """False once a stage has died: every later step fails (`error` says why)."""

    def shutdown(self) -> None: ...


class PipelineRunner(StepRunner):
    """Driver-side runner: no model, no KV cache (the stages hold those); samples on the driver or the last stage."""

    one_step_per_seq = True  # microbatches in flight are disjoint: a step never reads an uncommitted token

    def __init__(self, config: EngineConfig, spec: ModelSpec, stages: StageGroup, limits: BufferLimits,
                 sample_on_stage: bool):
        super().__init__(config, spec, torch.device("cpu"), limits, InlineExecutor(),
                         num_slots=stages.num_stages)
        self.stages = stages
        self.num_kv_blocks = stages.num_kv_blocks
        self.backend_name = stages.description
        self.offloader = self.graphs = None
        self.sample_on_stage = sample_on_stage  # the last stage samples (engine/pipeline/engine.py)

    def launch(self, sched: SchedulerOutput, slot: DecodeSlot, prev: Step | None = None) -> Step:
        """Send a planned microbatch down the pipeline. Every token it reads is committed already: the
        pipeline engine never schedules a sequence that is still in flight."""
        step = self._new_step(sched, slot)
        self._stage(step)
        sampling = None
        if self.sample_on_stage and step.sample_chunks:  # every parameter travels: the stage keeps no request state
            sampling = SamplingBatch.build([c.seq for c in step.sample_chunks], self.device, draw_seeded=True,
                                           penalty_pool=self.penalty_pool)
            step.num_logprobs = sampling.num_logprobs
        self.executor.mark(step.id, FWD_START)
        step.forward = self.stages.submit(StageBatch(step.id, slot.inputs.snapshot(), sampling))
        return step

    def finalize(self, step: Step) -> None:
        """Nothing yet: the step is sampled when its commit waits for it (the module's docstring)."""

    def wait(self, step: Step) -> StepResult:
        self._receive(step)
        return super().wait(step)

    def _receive(self, step: Step) -> None:
        """Wait for the step's logits, then sample them here (or take the tokens the last stage sampled)."""
        try:
            out = step.forward.result()
        except Exception as exc:  # raised by wait(), which fails the step's requests
            step.error = exc
            return
        self.executor.mark(step.id, FWD_END)
        n = len(step.sample_chunks)
        if self.sample_on_stage:  # the tokens came back sampled: only the commit's host buffers to fill
            self.executor.mark(step.id, SAMPLE_START)
            slot, k = step.slot, step.num_logprobs
            tokens, logprobs, top_ids, top_logprobs = out if isinstance(out, tuple) else (out, None, None, None)
            slot.host_sampled[:n].copy_(tokens)
            if logprobs is not None:
                slot.host_logprobs[:n].copy_(logprobs)
            if top_ids is not None:
                host_rows(slot.host_top_ids, n, k).copy_(top_ids)
                host_rows(slot.host_top_logprobs, n, k).copy_(top_logprobs)
            self.executor.mark(step.id, SAMPLE_END)
            return
        if n:
            step.slot.logits[:n].copy_(out)
        super().finalize(step)

    def health_error(self) -> str | None:
        return None if self.stages.healthy() else f"a pipeline stage failed: {self.stages.error!r}"

    def stats(self) -> dict:
        return {"pipeline_parallel_size": self.stages.num_stages,
                "microbatches_in_flight": sum(slot.busy for slot in self.slots)}

    def shutdown(self) -> None:
        self.stages.shutdown()


def failed_future(exc: BaseException) -> Future:
    """A Future that raises `exc` when its result is asked for."""
    fut: Future = Future()
    fut.set_exception(exc)
    return fut

