"""Owns the model, the paged KV cache and the two step slots; launches forwards and sampling.

launch() enqueues a step's forward, finalize() enqueues its sampling, wait() is the commit-side wait. On
CPU the queue is a single worker thread; the GPU runtime swaps in streams, events and graphs behind the
same three calls.
"""

from __future__ import annotations

import time

import torch

from engine.attention import AttentionMetadata, get_backend
from engine.config import EngineConfig
from engine.executor import InlineExecutor, SerialExecutor
from engine.kv_offload import KVOffloader
from engine.models import build_model
from engine.models.decoder import ModelSpec
from engine.sampler import Sampler, SamplingBatch
from engine.scheduler import SchedulerOutput
from engine.slot import DecodeSlot, HostInputs, Step, StepResult
from engine.step_timer import FORWARD_END, FORWARD_START, SAMPLE_END, SAMPLE_START
from engine.structured import allocate_bitmask

NUM_SLOTS = 2


class ModelRunner:
    def __init__(self, config: EngineConfig, hf_config, spec: ModelSpec, device: torch.device,
                 dtype: torch.dtype, num_kv_blocks: int, max_model_len: int, num_cpu_blocks: int = 0):
        self.config = config
        self.spec = spec
        self.device = device
        self.block_size = config.block_size
        self.backend = get_backend("torch", sliding_window=spec.sliding_window)
        self.model = build_model(config.model, hf_config, spec, max_model_len, self.backend, dtype, device)
        shape = (spec.num_layers, 2, num_kv_blocks, config.block_size, spec.num_kv_heads, spec.head_dim)
        self.kv_cache = torch.zeros(shape, dtype=dtype, device=device)
        self.kv_caches = [(self.kv_cache[i, 0], self.kv_cache[i, 1]) for i in range(spec.num_layers)]
        self.offloader = KVOffloader(self.kv_cache, num_cpu_blocks) if num_cpu_blocks else None
        self.sampler = Sampler(config.seed, device)
        self.slots = [DecodeSlot(i, config.max_num_seqs, device) for i in range(NUM_SLOTS)]
        # Host staging for each slot's constraint bitmask (pinned on CUDA so its upload is asynchronous);
        # per slot because a step's sampling may still read it while the next step's is being built.
        self.host_bitmasks = [allocate_bitmask(config.max_num_seqs, spec.vocab_size,
                                               pin_memory=device.type == "cuda") for _ in self.slots]
        use_thread = device.type == "cpu" and config.cpu_executor_thread and config.pipeline_depth > 1
        self.executor = SerialExecutor() if use_thread else InlineExecutor()
        self._next_step_id = 0

    @staticmethod
    def kv_bytes_per_block(spec: ModelSpec, block_size: int, dtype: torch.dtype) -> int:
        elem = torch.tensor([], dtype=dtype).element_size()
        return 2 * spec.num_layers * block_size * spec.num_kv_heads * spec.head_dim * elem

    def free_slot(self) -> DecodeSlot | None:
        return next((s for s in self.slots if not s.busy), None)

    # ---- launch ----------------------------------------------------------------------------------------
    def launch(self, sched: SchedulerOutput, slot: DecodeSlot, prev: Step | None) -> Step:
        """Enqueue the forward of a planned step into `slot`. Pending input tokens come from `prev`'s slot."""
        sample_chunks = [c for c in sched.chunks if c.samples]
        step = Step(self._next_step_id, slot, sched.chunks, sample_chunks, sched.num_tokens, time.monotonic())
        self._next_step_id += 1
        slot.busy = True
        host = self._host_inputs(step, prev)
        for row, c in enumerate(sample_chunks):
            c.seq.pending_src = (step.id, row)
        prev_sampled = prev.slot.sampled if prev is not None else None
        step.forward = self.executor.submit(self._forward_job, step, host, prev_sampled, sched.swaps)
        return step

    def _host_inputs(self, step: Step, prev: Step | None) -> HostInputs:
        h, bs = HostInputs(), self.block_size
        for c in step.chunks:
            seq, start, end = c.seq, c.start, c.start + c.num_tokens
            known = len(seq.token_ids)
            base = len(h.input_ids)
            h.input_ids.extend(seq.token_ids[start:min(end, known)])
            if end > known:  # the last position is the token sampled by the previous step, still on device
                assert end == known + 1 and prev is not None and seq.pending_src[0] == prev.id, seq
                h.gather_dst.append(base + known - start)
                h.gather_src.append(seq.pending_src[1])
                h.input_ids.append(0)
            table = seq.block_table
            h.positions.extend(range(start, end))
            h.slot_mapping.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            h.query_lens.append(c.num_tokens)
            h.seq_lens.append(end)
            h.block_tables.append(table[: -(-end // bs)])
            if c.samples:
                h.logits_indices.append(base + c.num_tokens - 1)
        return h

    def _forward_job(self, step: Step, h: HostInputs, prev_sampled: torch.Tensor | None, swaps) -> None:
        step.slot.timer.mark(FORWARD_START)
        with torch.inference_mode():
            if swaps:  # KV copies the scheduler decided on since the last step, ordered before this forward
                self.offloader.run(swaps)
            dev = self.device
            input_ids = torch.tensor(h.input_ids, dtype=torch.long, device=dev)
            if h.gather_dst:
                src = torch.tensor(h.gather_src, dtype=torch.long, device=dev)
                input_ids[torch.tensor(h.gather_dst, device=dev)] = prev_sampled.index_select(0, src)
            meta = self._metadata(h)
            self.backend.prepare(meta)
            positions = torch.tensor(h.positions, dtype=torch.long, device=dev)
            hidden = self.model(input_ids, positions, self.kv_caches, meta)
            rows = torch.tensor(h.logits_indices, dtype=torch.long, device=dev)
            step.logits = self.model.logits(hidden.index_select(0, rows))  # [R, vocab] float32
        step.slot.timer.mark(FORWARD_END)
        step.forward_end = time.perf_counter()

    def _metadata(self, h: HostInputs) -> AttentionMetadata:
        dev = self.device
        width = max(len(t) for t in h.block_tables)
        tables = [t + [0] * (width - len(t)) for t in h.block_tables]
        qsl = [0]
        for n in h.query_lens:
            qsl.append(qsl[-1] + n)
        return AttentionMetadata(
            slot_mapping=torch.tensor(h.slot_mapping, dtype=torch.long, device=dev),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(h.seq_lens, dtype=torch.int32, device=dev),
            block_tables=torch.tensor(tables, dtype=torch.int32, device=dev),
            block_size=self.block_size, query_lens_host=h.query_lens, seq_lens_host=h.seq_lens)

    # ---- finalize (sampling) and wait ---------------------------------------------------------------------
    def finalize(self, step: Step) -> None:
        """Enqueue sampling for `step`, with sampling inputs read after the previous commit."""
        if not step.sample_chunks:
            step.sample = self.executor.submit(self._empty_sample_job, step)
            return
        t0 = time.perf_counter()
        batch = SamplingBatch.build([c.seq for c in step.sample_chunks], self.device,
                                    self.host_bitmasks[step.slot.index])
        step.finalize_s = time.perf_counter() - t0
        step.sample = self.executor.submit(self._sample_job, step, batch)

    def _sample_job(self, step: Step, batch: SamplingBatch) -> StepResult:
        t0 = time.perf_counter()
        step.slot.timer.mark(SAMPLE_START)
        with torch.inference_mode():
            out = self.sampler(step.logits, batch)
            n = out.tokens.shape[0]
            step.slot.sampled[:n].copy_(out.tokens)
            if step.slot.host_sampled is not step.slot.sampled:
                step.slot.host_sampled[:n].copy_(step.slot.sampled[:n], non_blocking=True)
            step.slot.timer.mark(SAMPLE_END)
            result = StepResult(
                tokens=step.slot.host_sampled[:n].tolist(),
                logprobs=None if out.logprobs is None else out.logprobs.tolist(),
                top_ids=None if out.top_ids is None else out.top_ids.tolist(),
                top_logprobs=None if out.top_logprobs is None else out.top_logprobs.tolist(),
                forward_s=0.0, sample_s=0.0,  # filled from the slot's timer at wait()
                sample_wait_s=max(0.0, t0 - step.forward_end))
        step.logits = None
        return result

    @staticmethod
    def _empty_sample_job(step: Step) -> StepResult:
        step.slot.timer.mark(SAMPLE_START)
        step.slot.timer.mark(SAMPLE_END)
        return StepResult([], None, None, None, 0.0, 0.0)

    def wait(self, step: Step) -> StepResult:
        """Block until `step`'s tokens are readable on the host (re-raises a failed forward or sample)."""
        try:
            step.forward.result()
            result = step.sample.result()
            result.forward_s, result.sample_s = step.slot.timer.read()
            return result
        finally:
            step.slot.busy = False

    def shutdown(self) -> None:
        self.executor.shutdown()
