"""The one interface the engine core runs forwards through, and what every runner shares: the step slots,
host-input assembly, sampling at finalize, the commit's wait.

A runner turns the scheduler's plan into device work in three calls the engine loop makes (Photon's
launch / commit / finalize): `launch` stages a step's inputs and enqueues its forward, `finalize` builds the
step's sampling inputs (after the previous commit, so masks and penalties are current) and enqueues its
sampling, `wait` is the commit's one wait for the sampled tokens to be readable on the host. Besides those:
`free_slot` (one step in flight per slot), `health_error` / `is_fatal` (a worker that died, a failure that
ends the engine), `stats` (what the runner adds to EngineStats), `shutdown`.

Subclasses say where the forward runs, and the core (engine/core.py) is the same for all of them:
ModelRunner (this device: CPU or CUDA), TPModelRunner (rank 0 of a tensor-parallel group, engine/tp),
PipelineRunner (pipeline stages, engine/pipeline), SimRunner (a simulated accelerator whose time is modelled).
"""

from __future__ import annotations

import time

import torch

from engine.block_tables import BlockTables
from engine.kv_groups import KVLayout
from engine.config import EngineConfig
from engine.executor import FWD_END, FWD_START, SAMPLE_END, SAMPLE_START
from engine.models.decoder import ModelSpec
from engine.sampler import PenaltyPool, Sampler, SamplingBatch
from engine.scheduler import SchedulerOutput
from engine.slot import DecodeSlot, Step, StepResult
from engine.step_buffers import BufferLimits
from engine.structured import allocate_bitmask

NUM_SLOTS = 2


class StepRunner:
    """Slots, step ids and the host side of a step; `launch` is the subclass's."""

    # False: a sequence may ride in two launched steps at once (the next forward reads its pending token on
    # the device). The pipeline-parallel runner sets it: its microbatches must be disjoint.
    one_step_per_seq = False
    # Whether the forward can score prompt tokens (SamplingParams.prompt_logprobs); others reject such requests.
    supports_prompt_logprobs = False
    # Whether steps may carry forks (SamplingParams.n > 1) and copy-on-write block copies; others reject n > 1.
    supports_forks = False
    num_kv_blocks: int  # the KV cache's size in blocks, set by the subclass once its memory is profiled
    # Its cache's KV groups (engine/kv_groups.py); None: one group of every layer (pipeline stages).
    kv_layout: KVLayout | None = None

    def __init__(self, config: EngineConfig, spec: ModelSpec, device: torch.device, limits: BufferLimits,
                 executor, num_slots: int = NUM_SLOTS, slot_logits: bool = True, transfer=None):
        self.config = config
        self.spec = spec
        self.device = device  # where sampling inputs live
        self.block_size = config.block_size
        self.limits = limits
        self.executor = executor
        # Whether a launched forward runs beside the engine loop (what pipeline_depth=None picks 2 for); the CPU
        # ModelRunner with its forward inline on the loop thread says False.
        self.forward_overlaps_loop = True
        self.sampler = Sampler(config.seed, device)
        # Every slot's sampled tokens in one buffer, slot after slot: a step gathers each pending token from the
        # slot of the step that sampled it (Sequence.pending_src = slot index * max_seqs + row), whichever it is.
        # pipeline_depth=3 (one device): a step may be finalized while the step launched before it is uncommitted
        self.three_slots = config.pipeline_depth == 3
        rows = limits.max_seqs
        self.sampled = torch.zeros(num_slots * rows, dtype=torch.long, device=device)
        self.slots = [DecodeSlot(i, limits, spec.vocab_size, device, logits=slot_logits, transfer=transfer,
                                 sampled=self.sampled[i * rows:(i + 1) * rows]) for i in range(num_slots)]
        # Host staging for each slot's constraint bitmask (pinned on CUDA so its upload is asynchronous);
        # per slot because a step's sampling may still read it while the next step's is being built.
        self.host_bitmasks = [allocate_bitmask(config.max_num_seqs, spec.vocab_size,
                                               pin_memory=device.type == "cuda") for _ in self.slots]
        # Persistent block tables (engine/block_tables.py); the last device row is the padding rows' spare.
        self.tables = BlockTables(limits.table_rows - 1, limits.max_blocks, limits.window_groups)
        # Penalized sequences' penalty inputs, kept from step to step (rows for the same sequences as the tables')
        self.penalty_pool = PenaltyPool(limits.table_rows - 1, spec.vocab_size, device)
        self._next_step_id = 0

    @staticmethod
    def num_slots(config: EngineConfig) -> int:
        """Step slots of a single device's runner: three for pipeline_depth=3, else Photon's two."""
        return 3 if config.pipeline_depth == 3 else NUM_SLOTS

    @staticmethod
    def buffer_limits(config: EngineConfig, max_model_len: int, layout: KVLayout | None = None,
                      slots: int = NUM_SLOTS) -> BufferLimits:
        return BufferLimits(max_tokens=max(config.max_num_batched_tokens, config.max_num_seqs),
                            max_seqs=config.max_num_seqs, max_blocks=-(-max_model_len // config.block_size),
                            lora=config.enable_lora, window_groups=layout.num_window_groups if layout else 0,
                            slots=slots)

    def max_graph_batch_size(self) -> int:
        """The largest decode batch replayed as a CUDA graph (0: no graphs)."""
        return 0

    def free_slot(self) -> DecodeSlot | None:
        return next((s for s in self.slots if not s.busy), None)

    def launch(self, sched: SchedulerOutput, slot: DecodeSlot, prev: Step | None) -> Step:
        raise NotImplementedError

    def _new_step(self, sched: SchedulerOutput, slot: DecodeSlot) -> Step:
        # One entry per sampling row: a chunk verifying k drafts has k + 1 rows (engine/spec_decode.py).
        drafts = None
        if sched.num_draft_tokens:
            rows = [c for c in sched.chunks for _ in range(c.num_rows)]
            drafts = [c.draft[:j] if j else [] for c in sched.chunks for j in range(c.num_rows)]  # row j: draft[:j]
        elif sched.num_samples == len(sched.chunks):  # every chunk samples (a decode step): no pass to find them
            rows = list(sched.chunks)  # (a copy: forks are appended to it)
        else:
            rows = [c for c in sched.chunks if c.samples]
        step = Step(self._next_step_id, slot, sched.chunks, rows, sched.num_tokens, time.monotonic())
        if sched.forks:
            step.forks = sched.forks
            step.sample_chunks += sched.forks
            if drafts is not None:
                drafts += [[]] * len(sched.forks)
        step.drafts = drafts
        self._next_step_id += 1
        slot.busy = True
        return step

    def _plan_graph(self, step: Step, key: tuple[int, int | None] | None) -> None:
        """Stage `step` padded to the graph it replays (engine/cuda_graphs.py GraphPlan.for_step; None: eager)."""
        step.graph_size, step.graph_seqs = key if key is not None else (None, None)
        self._stage(step, step.graph_size, step.graph_seqs)

    def _stage(self, step: Step, pad_to: int | None = None, pad_seqs: int | None = None) -> None:
        """Stage `step` into its slot (engine/step_buffers.py); its sampling rows' tokens will be pending there."""
        slot = step.slot
        slot.inputs.stage_step(step.chunks, self.tables, self.block_size, pad_to, step.forks, pad_seqs,
                               step.is_decode)
        base = slot.index * self.limits.max_seqs
        if self.three_slots:  # the step id only the three-slot scheduler reads (Scheduler.latest_step)
            sid = step.id
            for row, c in enumerate(step.sample_chunks, base):
                seq = c.seq
                seq.pending_src, seq.pending_step = row, sid
        else:
            for row, c in enumerate(step.sample_chunks, base):
                c.seq.pending_src = row

    # ---- finalize (sampling) and wait ---------------------------------------------------------------------
    def finalize(self, step: Step) -> None:
        """Enqueue sampling for `step`, with sampling inputs read after the previous commit."""
        if not step.sample_chunks:
            step.sample = self.executor.submit(step, self._sample_job, step, None)
            return
        t0 = time.perf_counter()
        with self.executor.stream_context():  # the parameter uploads go in stream order, before sampling
            inputs = step.slot.inputs
            # Three slots: the step launched before this one is not committed yet, so a row's input token may be
            # one it sampled, which penalties must count (PenaltyRows.pending)
            pending_from = (step.sample_chunks, inputs.np["logits_indices"], inputs.dev.get("input_ids")) \
                if self.three_slots else None
            batch = SamplingBatch.build([c.seq for c in step.sample_chunks], self.device, inputs,
                                        self.host_bitmasks[step.slot.index], penalty_pool=self.penalty_pool,
                                        drafts=step.drafts, pending_from=pending_from)
        step.finalize_s = time.perf_counter() - t0
        step.num_logprobs = batch.num_logprobs
        step.sample = self.executor.submit(step, self._sample_job, step, batch)

    def _sample_job(self, step: Step, batch: SamplingBatch | None) -> None:
        ex, slot, n = self.executor, step.slot, len(step.sample_chunks)
        ex.before_sampling(slot)
        ex.mark(step.id, SAMPLE_START)
        pairs = []
        if batch is not None:
            with torch.inference_mode():
                out = self.sampler(slot.logits[:n], batch)
                slot.sampled[:n].copy_(out.tokens)
            pairs.append((slot.host_sampled[:n], slot.sampled[:n]))
            if out.logprobs is not None:
                pairs.append((slot.host_logprobs[:n], out.logprobs))
            if out.top_ids is not None:
                k = out.top_ids.shape[1]
                pairs += [(host_rows(slot.host_top_ids, n, k), out.top_ids),
                          (host_rows(slot.host_top_logprobs, n, k), out.top_logprobs)]
        ex.mark(step.id, SAMPLE_END)
        # Also for a step that samples nothing: its copy-done event then marks the step's uploads consumed.
        ex.copy_to_host(slot, pairs)

    def wait(self, step: Step) -> StepResult:
        """Block until `step`'s tokens are readable on the host (re-raises a failed forward or sample)."""
        try:
            for job in (step.forward, step.sample):
                if job is not None:
                    job.result()
            if step.error is not None:
                raise step.error
            self.executor.wait_copied(step.slot)
            return self._read_result(step)
        finally:
            step.slot.busy = False

    def _read_result(self, step: Step) -> StepResult:
        """Host buffers only: the copy into them has completed (wait_copied)."""
        slot, n, k, ex = step.slot, len(step.sample_chunks), step.num_logprobs, self.executor
        period = ex.elapsed((step.id - 1, FWD_START), (step.id, FWD_START)) if step.id else 0.0
        return StepResult(
            tokens=slot.np_sampled[:n].tolist(),  # host memory
            logprobs=slot.np_logprobs[:n].tolist() if k >= 0 else None,  # host memory
            top_ids=host_rows(slot.np_top_ids, n, k).tolist() if k > 0 else None,  # host memory
            top_logprobs=host_rows(slot.np_top_logprobs, n, k).tolist() if k > 0 else None,  # host memory
            forward_s=ex.elapsed((step.id, FWD_START), (step.id, FWD_END)),
            sample_s=ex.elapsed((step.id, SAMPLE_START), (step.id, SAMPLE_END)), period_s=period,
            sample_wait_s=max(0.0, ex.elapsed((step.id, FWD_END), (step.id, SAMPLE_START))),
            prompt_logprobs=step.prompt_logprobs)

    # ---- health and stats ---------------------------------------------------------------------------------
    def health_error(self) -> str | None:
        """Why this runner cannot run steps any more (a worker rank or stage died); None while it can."""
        return None

    def is_fatal(self, exc: BaseException) -> bool:
        """Whether a failed step leaves the runner unable to run any other (beyond device faults, which the
        core recognises itself): the core then fails every request and reports unhealthy."""
        return False

    def stats(self) -> dict:
        """Fields this runner adds to EngineStats."""
        return {}

    def shutdown(self) -> None:
        self.executor.shutdown()


def host_rows(buf, n: int, k: int):
    """The first n*k elements of a [rows, MAX] host buffer (a tensor, or its numpy view) as a contiguous [n, k]
    view: where the device-to-host copy of a step's top-k rows lands."""
    return buf.reshape(-1)[: n * k].reshape(n, k)
