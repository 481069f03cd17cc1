"""SimRunner: every step's host side is the real code; the accelerator's work is priced on a virtual clock.

What runs for real, exactly as on CUDA: the scheduler's plan staged into the slot's buffers (persistent
block tables included), the sampling inputs built at finalize (per-row parameters, penalties,
constraint bitmasks filled by xgrammar after the previous commit), the commit's wait and its reading of the
slot's host buffers, and everything the engine does around them. What is modelled (engine/sim/device.py,
engine/sim/cost_model.py): the uploads, the forward, the sampling kernels, the device-to-host copy and KV
swap copies, each an item on the compute or copy stream with the cost model's duration, launched at the
host cost the CUDA path would pay. The sampled tokens themselves come from engine/sim/tokens.py and are
written into the slot's host buffers when the sampling is enqueued; the commit reads them only after
waiting for the copy's event, as on CUDA.

Steps "replay a CUDA graph" exactly when the CUDA runner with the Triton attention backend would (the same
GraphPlan, engine/cuda_graphs.py: decode steps padded to a captured batch size, steps with prompt chunks to a
captured token and sequence count): the padding is priced, and the launch is one replay.
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch

from engine.config import EngineConfig
from engine.cuda_graphs import engine_plan
from engine.executor import FWD_END, FWD_START, SAMPLE_END, SAMPLE_START, run_now
from engine.kv_dtype import is_fp8, resolve_kv_dtype
from engine.kv_groups import kv_layout
from engine.memory import MemoryPlan, kv_blocks, modelled_plan
from engine.models.decoder import ModelSpec
from engine.models.quantized_checkpoint import checkpoint_scheme
from engine.sampler import PenaltyPool, SamplingBatch
from engine.scheduler import SchedulerOutput, SwapOp
from engine.sim.cost_model import CostModel, StepShape, profile
from engine.sim.device import SimDevice, SimEvent
from engine.sim.tokens import SimTokens, fake_logprobs
from engine.slot import DecodeSlot, Step
from engine.step_runner import StepRunner, host_rows

_RING = 4


class SimExecutor:
    """The executor interface over the simulated device: jobs run inline (they only enqueue priced items);
    step timestamps are the virtual start/end times of those items."""

    def __init__(self, device: SimDevice, num_slots: int):
        self.device = device
        self._marks = [[0.0] * 4 for _ in range(_RING)]
        self.copy_done = [SimEvent() for _ in range(num_slots)]

    def submit(self, step, fn, *args) -> None:
        run_now(step, fn, *args)

    def stream_context(self):
        return contextlib.nullcontext()

    def mark(self, step_id: int, point: int, t: float) -> None:
        self._marks[step_id % _RING][point] = t

    def elapsed(self, a: tuple[int, int], b: tuple[int, int]) -> float:
        return self._marks[b[0] % _RING][b[1]] - self._marks[a[0] % _RING][a[1]]

    def wait_copied(self, slot: DecodeSlot) -> None:
        self.device.synchronize(self.copy_done[slot.index])  # sync-ok: the simulated device's own wait

    def shutdown(self) -> None:
        pass


class SimOffloader:
    """KV swaps as copies on the copy stream: each waits for the compute stream (the blocks' last writer)
    and the next forward waits for it (it reads swapped-in blocks or reuses swapped-out ones)."""

    def __init__(self, device: SimDevice, cost: CostModel, block_size: int, page_share: float = 1.0):
        self.device, self.cost = device, cost
        self.bytes_per_block = cost.model.kv_bytes_per_token * block_size * page_share
        self.blocks_out = self.blocks_in = 0

    def run(self, ops: list[SwapOp]) -> None:
        dev, host_copy = self.device, self.cost.profile.host_copy_s
        ready = dev.record(dev.compute)
        for op in ops:
            n = len(op.device_blocks)
            # One gather (out) or scatter (in) kernel plus a copy per contiguous run; priced as one copy.
            item = dev.run(dev.copy, self.cost.copy_s(n * self.bytes_per_block), f"swap_{op.direction}",
                           host_s=3 * host_copy, waits=(ready,))
            ready = SimEvent(item.end)
            if op.direction == "out":
                self.blocks_out += n
            else:
                self.blocks_in += n
        dev.wait_event(dev.compute, ready)


class SimRunner(StepRunner):
    """The runner for `device="sim"`: no model, no weights, no KV tensors."""

    def __init__(self, config: EngineConfig, spec: ModelSpec, dtype: torch.dtype, max_model_len: int,
                 tokenizer, num_cpu_blocks: int = 0):
        self.sim = SimDevice()
        gpu = profile(config.sim_gpu)
        kv_dtype = resolve_kv_dtype(config.kv_cache_dtype, dtype, "sim")
        if is_fp8(kv_dtype) and not gpu.fp8:
            raise ValueError(f"kv_cache_dtype={config.kv_cache_dtype!r} needs fp8 conversions (compute capability "
                             f"8.9+), which sim_gpu={config.sim_gpu!r} lacks; use h100, h200 or b200")
        scheme = checkpoint_scheme(config.model_dir)  # FP8 / int4 linears: the bytes their GPU layout holds
        self.cost = CostModel(spec, torch.tensor([], dtype=dtype).element_size(), gpu, config.sim_kernels_per_layer,
                              config.tensor_parallel_size, torch.tensor([], dtype=kv_dtype).element_size(),
                              None if scheme is None else scheme.linear_bytes)
        self.kv_layout = kv_layout(config, spec)  # sliding-window KV groups: a block is a page of g layers
        slots = self.num_slots(config)
        super().__init__(config, spec, torch.device("cpu"),
                         self.buffer_limits(config, max_model_len, self.kv_layout, slots), SimExecutor(self.sim, slots),
                         num_slots=slots, slot_logits=False, transfer=self._upload)
        # The penalty pool's tables are the device's (no data here): its host work is real, its kernels are priced
        # with the sampling (sampling_work), not run on this CPU
        self.penalty_pool = PenaltyPool(self.limits.table_rows - 1, spec.vocab_size, torch.device("meta"))
        tp = config.tensor_parallel_size
        self.backend_name = f"sim:{config.sim_gpu}" + (f", tensor parallel x{tp} (modelled)" if tp > 1 else "")
        self.tokens = SimTokens(tokenizer, config.sim_eos_rate, config.seed)
        page_share = self.kv_layout.layers_per_page / spec.num_layers  # of a position's KV, one page's
        self.offloader = SimOffloader(self.sim, self.cost, config.block_size, page_share) if num_cpu_blocks else None
        self.graphs = engine_plan(self.limits.max_seqs, self.limits.max_tokens, config.cuda_graphs_mixed) \
            if config.cuda_graphs else None
        self.memory = self._plan(spec, self.cost.model.dtype_bytes)
        self.num_kv_blocks = kv_blocks(
            self.memory, int(self.cost.model.kv_bytes_per_token * page_share) * config.block_size,
            self.limits.max_seqs * self.limits.max_blocks * self.kv_layout.pages_per_block, config.num_kv_blocks)

    def _plan(self, spec: ModelSpec, dtype_bytes: int) -> MemoryPlan:
        """The memory profiling pass on modelled numbers (engine/memory.py): what the CUDA runner would hold
        besides the KV cache on this GPU."""
        lim = self.limits
        buffers = len(self.slots) * (lim.max_seqs * spec.vocab_size * 4 + self.slots[0].inputs.step.nbytes
                                     + self.slots[0].inputs.sampling.nbytes + lim.max_seqs * lim.max_blocks * 4) \
            + lim.table_rows * lim.max_blocks * 4
        return modelled_plan(memory_bytes=self.cost.profile.memory_bytes,
                             utilization=self.config.gpu_memory_utilization, weight_bytes=self._checkpoint_bytes(spec),
                             buffer_bytes=buffers, max_tokens=lim.max_tokens, max_seqs=lim.max_seqs,
                             hidden=spec.hidden_size, intermediate=spec.intermediate_size, vocab=spec.vocab_size,
                             dtype_bytes=dtype_bytes, graphs=self.graphs is not None,
                             mixed_graphs=bool(self.graphs and self.graphs.mixed))

    def _checkpoint_bytes(self, spec: ModelSpec) -> float:
        """All weights held on one device (one rank's shard under tensor parallelism): what a decode reads plus
        the input embedding when untied (vocabulary-sharded like the head)."""
        m = self.cost.model
        return m.weight_bytes + (0 if spec.tie_word_embeddings else m.head_weight_bytes)

    # ---- launch ----------------------------------------------------------------------------------------
    def launch(self, sched: SchedulerOutput, slot: DecodeSlot, prev: Step | None) -> Step:
        step = self._new_step(sched, slot)
        self._plan_graph(step, self.graphs.for_step(step) if self.graphs is not None else None)
        step.forward = self.executor.submit(step, self._forward_job, step, sched.swaps)
        return step

    def max_graph_batch_size(self) -> int:
        return self.graphs.decode_sizes[-1] if self.graphs is not None else 0

    def _forward_job(self, step: Step, swaps: list[SwapOp]) -> None:
        with self.sim.emulating():  # pricing the step is the simulator's work, not the host's (device.py)
            self._price_forward(step, swaps)

    def _price_forward(self, step: Step, swaps: list[SwapOp]) -> None:
        if swaps:
            self.offloader.run(swaps)
        bufs = step.slot.inputs
        self._upload_item = None
        bufs.upload()  # -> self._upload: the staged inputs' H2D copies, priced on the compute stream
        first = self._upload_item
        graph = step.graph_size is not None
        n = bufs.np  # the staged step as the device would read it (padding included: rows and positions, no keys)
        s = bufs.num_seqs
        # Logits rows: a decode graph's every row, a mixed graph's one per sequence, an eager step's sampled ones.
        rows = s if step.graph_seqs is not None else bufs.num_rows + s - len(step.chunks)
        shape = StepShape(np.diff(n["query_start_loc"][:s + 1]), n["seq_lens"][:s], rows, bufs.num_tokens)
        item = self.sim.run(self.sim.compute, self.cost.forward_s(shape, graph), "forward",
                            host_s=self.cost.host_forward_launch_s(graph))
        self.executor.mark(step.id, FWD_START, (first or item).start)
        self.executor.mark(step.id, FWD_END, item.end)

    def _upload(self, nbytes: int, copies: int) -> None:
        p = self.cost.profile
        self._upload_item = self.sim.run(self.sim.compute, self.cost.copy_s(nbytes, copies), "h2d",
                                         host_s=copies * p.host_copy_s)

    # ---- sampling ----------------------------------------------------------------------------------------
    def _sample_job(self, step: Step, batch: SamplingBatch | None) -> None:
        with self.sim.emulating():  # drawing and pricing the tokens is the device's work (device.py)
            self._price_sampling(step, batch)

    def _price_sampling(self, step: Step, batch: SamplingBatch | None) -> None:
        slot, n, dev, ex = step.slot, len(step.sample_chunks), self.sim, self.executor
        p = self.cost.profile
        if batch is None:  # nothing samples: the copy-done event only marks the step's uploads consumed
            t = dev.record(dev.compute)
            ex.mark(step.id, SAMPLE_START, t.time)
            ex.mark(step.id, SAMPLE_END, t.time)
            ex.copy_done[slot.index] = t
            return
        nbytes, copies = self._write_results(step, batch)
        kernels, passes = sampling_work(batch)
        item = dev.run(dev.compute, self.cost.sample_s(n, kernels, passes), "sample",
                       host_s=kernels * p.host_op_s + p.host_copy_s, waits=(ex.copy_done[slot.index],))
        ex.mark(step.id, SAMPLE_START, item.start)
        ex.mark(step.id, SAMPLE_END, item.end)
        copy = dev.run(dev.copy, self.cost.copy_s(nbytes, copies), "d2h", host_s=(copies + 2) * p.host_copy_s,
                       waits=(SimEvent(item.end),))
        ex.copy_done[slot.index] = SimEvent(copy.end)

    def _write_results(self, step: Step, batch: SamplingBatch) -> tuple[int, int]:
        """Draw the step's tokens (and logprobs) into the slot's host buffers; return the bytes and copies the
        device-to-host transfer of them would take."""
        slot, n = step.slot, len(step.sample_chunks)
        seqs = [c.seq for c in step.sample_chunks]
        rows = batch.bitmask_rows
        if not any(c.draft for c in step.chunks):
            positions = [c.start + c.num_tokens for c in step.sample_chunks]
            tokens, h = self.tokens.sample(seqs, positions, batch.bitmask if rows else None, rows)
        else:  # a chunk verifying k drafts has k + 1 rows, row i giving the token after position start + i
            positions, draft_rows, drafts = [], [], []
            for c in step.chunks:
                if c.draft:
                    draft_rows += range(len(positions), len(positions) + len(c.draft))
                    drafts += c.draft
                    positions += range(c.start + 1, c.start + c.num_tokens + 1)
                elif c.samples:
                    positions.append(c.start + c.num_tokens)
            positions += [c.start + c.num_tokens for c in step.forks]
            tokens, h = self.tokens.sample(seqs, positions, batch.bitmask if rows else None, rows)
            if self.config.sim_spec_acceptance is not None:
                self.tokens.accept_drafts(tokens, h, draft_rows, drafts, self.config.sim_spec_acceptance)
        slot.np_sampled[:n] = tokens
        nbytes, copies = 8 * n, 1
        k = batch.num_logprobs
        if k >= 0:
            chosen, top_ids, top_lp = fake_logprobs(tokens, h, self.tokens.candidates, k)
            slot.np_logprobs[:n] = chosen
            nbytes, copies = nbytes + 4 * n, copies + 1
            if k > 0:
                host_rows(slot.np_top_ids, n, k)[:] = top_ids
                host_rows(slot.np_top_logprobs, n, k)[:] = top_lp
                nbytes, copies = nbytes + 12 * n * k, copies + 2
        return nbytes, copies

    def note_idle(self) -> None:
        self.sim.idle()

    def device_stats(self) -> dict:
        return {**self.sim.stats(), "sim_gpu": self.cost.profile.name}


# The penalties of every penalized row at once: the pool's update when the batch is built (engine.sampler.PenaltyPool:
# the new tokens' upload, two index_puts and a fill, the rows' upload, three gathers) and the sampler's edit
# (Sampler._apply_penalties: the rows' gather, the repetition's compare, multiply, divide and two selects, the
# counts' conversion, compare, two multiplies, add and subtract, the scatter back). The simulated pool does the
# update's host work but runs none of these kernels.
PENALTY_KERNELS = 22


def sampling_work(batch: SamplingBatch) -> tuple[int, float]:
    """(kernels, passes over the [rows, vocab] logits) the CUDA sampler (engine/sampler.py) runs for `batch`."""
    kernels, passes = 2, 1.0  # argmax, copy into the slot's sampled buffer
    if batch.penalties or batch.banned or batch.logit_bias or batch.bitmask_rows:
        kernels += 1 + (PENALTY_KERNELS if batch.penalties is not None else 0) + len(batch.banned) + \
            len(batch.logit_bias) + (2 if batch.bitmask_rows else 0)
        passes += 3
    if not batch.all_greedy:
        kernels += 7 + 2 * len(batch.generators)  # a seeded row draws its own noise: rand, and its copy into u
        passes += 6
        if batch.top_k is not None:
            kernels, passes = kernels + 4, passes + 3  # topk of the largest k, gather, mask
        if batch.top_p is not None:
            kernels, passes = kernels + 6, passes + 10
        if batch.min_p is not None:
            kernels, passes = kernels + 3, passes + 3
    if batch.num_logprobs >= 0:
        kernels, passes = kernels + 2, passes + 3
        if batch.num_logprobs > 0:
            kernels, passes = kernels + 1, passes + 1
    return kernels, passes
