"""Owns the model, the paged KV cache and the two step slots; launches forwards and sampling.

launch() stages a step's inputs on the host and enqueues its forward, finalize() enqueues its sampling,
wait() is the commit-side wait. Both devices run the same code: the slot's fixed-address buffers are filled
from host staging by copies in stream order, the forward reads only them (and, for its pending input tokens,
the previous slot's sampled tokens on the device), and the sampled tokens come back through the slot's host
buffers. What differs is the executor (engine/executor.py): a worker thread on CPU; on CUDA a compute
stream, a copy stream and events, plus CUDA-graph replay of decode steps (engine/cuda_graphs.py).
"""

from __future__ import annotations

import logging
import time

import torch

from engine.attention import get_backend, resolve_backend
from engine.config import EngineConfig
from engine.cuda_graphs import DecodeGraphs, capture_sizes
from engine.executor import FWD_END, FWD_START, SAMPLE_END, SAMPLE_START, make_executor
from engine.kv_offload import KVOffloader
from engine.models import build_model
from engine.models.decoder import ModelSpec
from engine.sampler import Sampler, SamplingBatch
from engine.scheduler import SchedulerOutput
from engine.slot import DecodeSlot, HostInputs, Step, StepResult
from engine.step_buffers import BufferLimits
from engine.structured import allocate_bitmask

logger = logging.getLogger(__name__)

NUM_SLOTS = 2
MAX_GRAPH_BATCH_SIZE = 512


class ModelRunner:
    def __init__(self, config: EngineConfig, hf_config, spec: ModelSpec, device: torch.device,
                 dtype: torch.dtype, num_kv_blocks: int, max_model_len: int, num_cpu_blocks: int = 0):
        self.config = config
        self.spec = spec
        self.device = device
        self.block_size = config.block_size
        self.backend_name = resolve_backend(config.attention_backend, device, config.block_size)
        self.backend = get_backend(self.backend_name, sliding_window=spec.sliding_window)
        self.model = build_model(config.model, hf_config, spec, max_model_len, self.backend, dtype, device)
        shape = (spec.num_layers, 2, num_kv_blocks, config.block_size, spec.num_kv_heads, spec.head_dim)
        self.kv_cache = torch.zeros(shape, dtype=dtype, device=device)
        self.kv_caches = [(self.kv_cache[i, 0], self.kv_cache[i, 1]) for i in range(spec.num_layers)]
        self.offloader = KVOffloader(self.kv_cache, num_cpu_blocks) if num_cpu_blocks else None
        self.sampler = Sampler(config.seed, device)
        self.limits = BufferLimits(max_tokens=max(config.max_num_batched_tokens, config.max_num_seqs),
                                   max_seqs=config.max_num_seqs, max_blocks=-(-max_model_len // self.block_size))
        self.slots = [DecodeSlot(i, self.limits, spec.vocab_size, device) for i in range(NUM_SLOTS)]
        # Host staging for each slot's constraint bitmask (pinned on CUDA so its upload is asynchronous);
        # per slot because a step's sampling may still read it while the next step's is being built.
        self.host_bitmasks = [allocate_bitmask(config.max_num_seqs, spec.vocab_size,
                                               pin_memory=device.type == "cuda") for _ in self.slots]
        threaded = config.cpu_executor_thread and config.pipeline_depth > 1
        self.executor = make_executor(device, threaded)
        self.graphs: DecodeGraphs | None = None
        self._next_step_id = 0
        if device.type == "cuda" and config.cuda_graphs and self.backend.supports_graphs:
            self.capture_graphs()

    @staticmethod
    def kv_bytes_per_block(spec: ModelSpec, block_size: int, dtype: torch.dtype) -> int:
        elem = torch.tensor([], dtype=dtype).element_size()
        return 2 * spec.num_layers * block_size * spec.num_kv_heads * spec.head_dim * elem

    # ---- what other engine parts (KV offload) hook into -----------------------------------------------------
    @property
    def compute_stream(self) -> torch.cuda.Stream | None:
        """The stream every forward and sampling runs on (None on CPU)."""
        return self.executor.compute_stream

    def wait_before_next_forward(self, dep) -> None:
        """Make the next launched forward wait for `dep` (a torch.cuda.Event on CUDA, a Future on CPU)."""
        self.executor.wait_before_next_forward(dep)

    def free_slot(self) -> DecodeSlot | None:
        return next((s for s in self.slots if not s.busy), None)

    # ---- CUDA graphs ------------------------------------------------------------------------------------------
    def capture_graphs(self, max_batch_size: int | None = None, emulate: bool = False) -> None:
        """Capture decode graphs for padded batch sizes up to max_batch_size (default: max_num_seqs).

        emulate=True records plain replays on CPU (tests); it needs a backend that reads only tensors."""
        if not self.backend.supports_graphs:
            raise ValueError(f"attention backend {self.backend_name!r} cannot run inside a CUDA graph")
        limit = min(max_batch_size or self.config.max_num_seqs, self.limits.max_seqs, MAX_GRAPH_BATCH_SIZE)
        graphs = DecodeGraphs(capture_sizes(limit), emulate=emulate)
        t0 = time.perf_counter()
        graphs.capture(self.slots, self._decode_forward, self.block_size, self.executor.compute_stream)
        self.graphs = graphs
        logger.info("captured %d decode graphs (batch sizes %s) in %.1f s", len(graphs), graphs.sizes,
                    time.perf_counter() - t0)

    def _graph_size(self, step: Step) -> int | None:
        if self.graphs is None or not all(c.num_tokens == 1 and c.samples for c in step.chunks):
            return None
        return self.graphs.padded_size(len(step.chunks))

    # ---- launch ----------------------------------------------------------------------------------------
    def launch(self, sched: SchedulerOutput, slot: DecodeSlot, prev: Step | None) -> Step:
        """Enqueue the forward of a planned step into `slot`. Pending input tokens come from `prev`'s slot."""
        sample_chunks = [c for c in sched.chunks if c.samples]
        step = Step(self._next_step_id, slot, sched.chunks, sample_chunks, sched.num_tokens, time.monotonic())
        self._next_step_id += 1
        slot.busy = True
        host = self._host_inputs(step, prev)
        step.graph_size = self._graph_size(step)
        slot.inputs.stage(host, pad_to=step.graph_size)
        for row, c in enumerate(sample_chunks):
            c.seq.pending_src = (step.id, row)
        prev_sampled = prev.slot.sampled if prev is not None else None
        step.forward = self.executor.submit(self._forward_job, step, host, prev_sampled,
                                            self.executor.take_deps(), sched.swaps)
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

    def _forward_job(self, step: Step, host: HostInputs, prev_sampled: torch.Tensor | None, deps: list,
                     swaps: list) -> None:
        ex = self.executor
        ex.wait_on(deps)
        if swaps:  # KV copies the scheduler decided on since the last step, ordered before this forward
            self.offloader.run(swaps)
        ex.mark(step.id, FWD_START)
        with torch.inference_mode():
            bufs = step.slot.inputs
            bufs.upload()
            if prev_sampled is not None:
                bufs.gather_pending(prev_sampled)
            if step.graph_size is not None:
                self.graphs.replay(step.slot, step.graph_size)
            else:
                self._eager_forward(step.slot, host)
        ex.mark(step.id, FWD_END)

    def _eager_forward(self, slot: DecodeSlot, host: HostInputs) -> None:
        b = slot.inputs
        meta = b.metadata(self.block_size, host)
        self.backend.prepare(meta)
        hidden = self.model(b.dev["input_ids"][:b.num_tokens], b.dev["positions"][:b.num_tokens],
                            self.kv_caches, meta)
        if b.num_rows:
            rows = hidden.index_select(0, b.dev["logits_indices"][:b.num_rows])
            self.model.logits(rows, out=slot.logits[:b.num_rows])

    def _decode_forward(self, slot: DecodeSlot, size: int, meta) -> None:
        """What a decode graph holds: `size` one-token rows, all sampled, logits into the slot's buffer."""
        b = slot.inputs
        hidden = self.model(b.dev["input_ids"][:size], b.dev["positions"][:size], self.kv_caches, meta)
        self.model.logits(hidden, out=slot.logits[:size])

    # ---- finalize (sampling) and wait ---------------------------------------------------------------------
    def finalize(self, step: Step) -> None:
        """Enqueue sampling for `step`, with sampling inputs read after the previous commit."""
        if not step.sample_chunks:
            step.sample = self.executor.submit(self._sample_job, step, None)
            return
        t0 = time.perf_counter()
        with self.executor.stream_context():  # the parameter uploads go in stream order, before sampling
            batch = SamplingBatch.build([c.seq for c in step.sample_chunks], self.device, step.slot.inputs,
                                        self.host_bitmasks[step.slot.index])
        step.finalize_s = time.perf_counter() - t0
        step.num_logprobs = batch.num_logprobs
        step.sample = self.executor.submit(self._sample_job, step, batch)

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
                pairs += [(_rows(slot.host_top_ids, n, k), out.top_ids),
                          (_rows(slot.host_top_logprobs, n, k), out.top_logprobs)]
        ex.mark(step.id, SAMPLE_END)
        # Also for a step that samples nothing: its copy-done event then marks the step's uploads consumed.
        ex.copy_to_host(slot, pairs)

    def wait(self, step: Step) -> StepResult:
        """Block until `step`'s tokens are readable on the host (re-raises a failed forward or sample)."""
        try:
            step.forward.result()
            step.sample.result()
            self.executor.wait_copied(step.slot)
            return self._read_result(step)
        finally:
            step.slot.busy = False

    def _read_result(self, step: Step) -> StepResult:
        """Host buffers only: the copy into them has completed (wait_copied)."""
        slot, n, k, ex = step.slot, len(step.sample_chunks), step.num_logprobs, self.executor
        period = ex.elapsed((step.id - 1, FWD_START), (step.id, FWD_START)) if step.id else 0.0
        return StepResult(
            tokens=slot.host_sampled[:n].tolist(),  # host memory
            logprobs=slot.host_logprobs[:n].tolist() if k >= 0 else None,  # host memory
            top_ids=_rows(slot.host_top_ids, n, k).tolist() if k > 0 else None,  # host memory
            top_logprobs=_rows(slot.host_top_logprobs, n, k).tolist() if k > 0 else None,  # host memory
            forward_s=ex.elapsed((step.id, FWD_START), (step.id, FWD_END)),
            sample_s=ex.elapsed((step.id, SAMPLE_START), (step.id, SAMPLE_END)), period_s=period,
            sample_wait_s=max(0.0, ex.elapsed((step.id, FWD_END), (step.id, SAMPLE_START))))

    def shutdown(self) -> None:
        self.executor.shutdown()


def _rows(buf: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The first n*k elements of a [rows, MAX] host buffer as a contiguous [n, k] view."""
    return buf.view(-1)[: n * k].view(n, k)
