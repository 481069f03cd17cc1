"""Owns the model, the paged KV cache and its step slots; launches forwards and sampling.

launch() stages a step's inputs on the host and enqueues its forward, finalize() enqueues its sampling,
wait() is the commit-side wait (engine/step_runner.py). Both devices run the same code: the slot's
fixed-address buffers are filled from host staging by copies in stream order, the forward reads only them
(and, for its pending input tokens, the sampled tokens of the steps still in flight, on the device), and the
sampled tokens come back through the slot's host buffers. What differs is the executor (engine/executor.py): a
worker thread on CPU; on CUDA a compute stream, a copy stream and events, plus CUDA-graph replay of decode
steps (engine/cuda_graphs.py).
"""

from __future__ import annotations

import logging
import os
import time

import torch

from engine import prompt_logprobs
from engine.cpu import alloc as cpu_alloc
from engine.attention import get_backend, resolve_backend
from engine.config import EngineConfig
from engine.cuda_graphs import StepGraphs, engine_plan
from engine.executor import FWD_END, FWD_START, make_executor
from engine.kv_dtype import resolve_kv_dtype
from engine.kv_groups import kv_layout
from engine.kv_offload import KVOffloader, copy_blocks
from engine.lora.layers import LoRAModel
from engine.memory import CudaMeter, HostMeter, MemoryPlan, kv_blocks
from engine.models import build_model
from engine.models.decoder import ModelSpec
from engine.sampler import SamplingBatch
from engine.scheduler import SchedulerOutput
from engine.slot import DecodeSlot, Step
from engine.step_runner import StepRunner

logger = logging.getLogger(__name__)

def cpu_thread_helps(setting: bool | None) -> bool:
    """EngineConfig.cpu_executor_thread resolved: None = a forward thread only when the process has a core
    beyond the intra-op threads, for the engine loop's host work to run on (see EngineConfig)."""
    if setting is not None:
        return setting
    return torch.get_num_threads() < len(os.sched_getaffinity(0))


class ModelRunner(StepRunner):
    supports_prompt_logprobs = True
    supports_forks = True

    def __init__(self, config: EngineConfig, hf_config, spec: ModelSpec, device: torch.device,
                 dtype: torch.dtype, max_model_len: int, num_cpu_blocks: int = 0, draft_kv_bytes_per_page: int = 0):
        """draft_kv_bytes_per_page: what a draft model's KV cache (engine/spec_draft.py, one page for each of this
        cache's) adds per page, so the memory profile sizes the two together."""
        if device.type == "cpu":
            cpu_alloc.advise()  # glibc's malloc costs the CPU forward page faults every step
            if config.cpu_threads is not None:
                torch.set_num_threads(config.cpu_threads)  # before cpu_thread_helps reads it
        threaded = config.pipeline_depth != 1 and cpu_thread_helps(config.cpu_executor_thread)
        self.kv_layout = kv_layout(config, spec)  # sliding-window layers' KV groups (engine/kv_groups.py)
        slots = self.num_slots(config)
        super().__init__(config, spec, device, self.buffer_limits(config, max_model_len, self.kv_layout, slots),
                         make_executor(device, threaded), num_slots=slots)
        self.forward_overlaps_loop = device.type == "cuda" or threaded
        # the KV cache's (engine/kv_dtype.py)
        kv_dtype = resolve_kv_dtype(config.kv_cache_dtype, dtype, device, config.attention_backend)
        self.backend_name = resolve_backend(config.attention_backend, device, config.block_size,
                                            softcap=spec.attn_softcap is not None, kv_cast=kv_dtype != dtype)
        self.backend = get_backend(self.backend_name, sliding_window=spec.sliding_window)
        self.model = self._build_model(hf_config, spec, max_model_len, dtype)
        self.model.kv_group = self.kv_layout.layer_group
        # Multi-LoRA: the targeted linears wrapped with every slot's stacked adapters (before the memory
        # profile, which then counts them); None, and nothing changed, without enable_lora.
        self.lora = LoRAModel(self.model, config.max_loras, config.max_lora_rank) if config.enable_lora else None
        # The persistent block tables' device copy (engine/block_tables.py): deltas scattered in stream order.
        self.device_tables = torch.zeros(self.limits.table_rows, self.kv_layout.num_groups * self.limits.max_blocks,
                                         dtype=torch.int32, device=device)
        kv_spec = self.model.spec  # a tensor-parallel rank's own: its share of the KV heads (engine/tp)
        layout = self.kv_layout
        per_block = self.kv_bytes_per_block(kv_spec, config.block_size, kv_dtype, layout.layers_per_page) \
            + draft_kv_bytes_per_page
        self.memory = self._profile(kv_dtype) if config.num_kv_blocks is None else None
        useful = self.limits.max_seqs * self.limits.max_blocks * layout.pages_per_block
        self.num_kv_blocks = self._agree_kv_blocks(kv_blocks(self.memory, per_block, useful, config.num_kv_blocks))
        # [g, 2, pages, block_size, kv heads, head_dim]: a page is one block of one KV group's g layers (all layers
        # with one group)
        shape = (layout.layers_per_page, 2, self.num_kv_blocks, config.block_size, kv_spec.num_kv_heads,
                 spec.head_dim)
        self.kv_cache = torch.zeros(shape, dtype=kv_dtype, device=device)
        self.kv_caches = self._layer_caches(self.kv_cache)
        self.offloader = KVOffloader(self.kv_cache, num_cpu_blocks) if num_cpu_blocks else None
        self.graphs: StepGraphs | None = None
        if device.type == "cuda" and config.cuda_graphs and self.backend.supports_graphs:
            self.capture_graphs()

    def _build_model(self, hf_config, spec: ModelSpec, max_model_len: int, dtype: torch.dtype):
        return build_model(self.config.model_dir, hf_config, spec, max_model_len, self.backend, dtype, self.device,
                           cpu_onednn=self.config.cpu_onednn, fused=self.config.fused_forward,
                           gguf_file=self.config.gguf_file)

    def _agree_kv_blocks(self, num_blocks: int) -> int:
        """The KV blocks this runner's cache gets (a tensor-parallel group agrees on its ranks' minimum)."""
        return num_blocks

    @staticmethod
    def kv_bytes_per_block(spec: ModelSpec, block_size: int, dtype: torch.dtype, layers: int | None = None) -> int:
        """Bytes of one block (a page: `layers` layers' K and V; default every layer)."""
        elem = torch.tensor([], dtype=dtype).element_size()
        layers = spec.num_layers if layers is None else layers
        return 2 * layers * block_size * spec.num_kv_heads * spec.head_dim * elem

    def _layer_caches(self, kv_cache: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's (K, V) cache: its slot of the page tensor (engine/kv_groups.py)."""
        return [(kv_cache[i, 0], kv_cache[i, 1]) for i in self.kv_layout.layer_slot]

    # ---- the memory profiling pass (engine/memory.py) -----------------------------------------------------------
    def _profile(self, kv_dtype: torch.dtype) -> MemoryPlan:
        """Dummy steps at the engine's limits, before the KV cache exists, and what they leave for it: a
        forward of max_num_batched_tokens tokens over max_num_seqs sampled rows, then sampling every row the
        expensive way; on CUDA with graphs also a decode forward at the largest graph batch (the graphs'
        private pool holds its activations)."""
        spec, lim, cuda = self.model.spec, self.limits, self.device.type == "cuda"
        # one block: every dummy position uses it
        scratch = torch.zeros((self.kv_layout.layers_per_page, 2, 1, self.block_size, spec.num_kv_heads,
                               spec.head_dim), dtype=kv_dtype, device=self.device)
        self.kv_caches = self._layer_caches(scratch)
        meter = CudaMeter(self.device) if cuda else HostMeter()
        with meter:
            self._dummy_step(lim.max_tokens, lim.max_seqs, sample=True)
        graph_pool = 0
        if cuda and self.config.cuda_graphs and self.backend.supports_graphs:
            plan = engine_plan(lim.max_seqs, lim.max_tokens, self.mixed_graph_refusal() is None)
            rows = plan.decode_sizes[-1]
            shapes = [(rows, rows)] + plan.mixed[-1:]
            for tokens, seqs in shapes:  # the pool holds the larger of the largest decode and mixed graphs
                graph = CudaMeter(self.device)
                with graph:
                    self._dummy_step(tokens, seqs, sample=False)
                graph_pool = max(graph_pool, graph.peak)
        del scratch, self.kv_caches
        usable, in_use = meter.usage(self.config.gpu_memory_utilization) if cuda else \
            meter.usage(self.config.cpu_kv_cache_bytes, self.config.cpu_memory_utilization)
        plan = MemoryPlan(usable, in_use, meter.peak, graph_pool, "measured")
        logger.info("memory profile: %s", plan)
        return plan

    @torch.inference_mode()
    def _dummy_step(self, num_tokens: int, num_seqs: int, sample: bool) -> None:
        slot = self.slots[0]
        bufs = slot.inputs
        bufs.stage_dummy(num_tokens, num_seqs, self.block_size)
        bufs.upload()
        bufs.apply_tables(self.device_tables, full_width=False)
        self._eager_forward(slot)
        if sample:
            rows = bufs.num_rows
            self.sampler(slot.logits[:rows], SamplingBatch.worst_case(rows, self.device, self.spec.vocab_size))

    # ---- CUDA graphs ------------------------------------------------------------------------------------------
    def capture_graphs(self, max_batch_size: int | None = None, emulate: bool = False,
                       mixed: bool | None = None) -> None:
        """Capture decode graphs for padded batch sizes up to max_batch_size (default: max_num_seqs), and (mixed:
        default where mixed_graph_refusal allows) graphs for steps with prompt chunks (engine/cuda_graphs.py).

        emulate=True records plain replays on CPU (tests); it needs a backend that reads only tensors."""
        if not self.backend.supports_graphs:
            raise ValueError(f"attention backend {self.backend_name!r} cannot run inside a CUDA graph")
        reason = self.mixed_graph_refusal()
        if mixed and reason is not None:
            raise ValueError(f"graphs for steps with prompt chunks cannot run here: {reason}")
        mixed = reason is None if mixed is None else mixed
        graphs = StepGraphs(engine_plan(self.limits.max_seqs, self.limits.max_tokens, mixed, max_batch_size),
                            emulate=emulate)
        t0 = time.perf_counter()
        graphs.capture(self.slots, self._decode_forward, self._mixed_forward, self.block_size,
                       self.executor.compute_stream)
        self.graphs = graphs
        logger.info("captured %d graphs (decode batch sizes %s; %d mixed-step shapes up to %s) in %.1f s",
                    len(graphs), graphs.plan.decode_sizes, len(graphs.plan.mixed),
                    graphs.plan.mixed[-1] if graphs.plan.mixed else None, time.perf_counter() - t0)

    def mixed_graph_refusal(self) -> str | None:
        """Why steps with prompt chunks cannot replay graphs here; None when they can."""
        if not self.config.cuda_graphs_mixed:
            return "cuda_graphs_mixed is off"
        if not getattr(self.backend, "supports_mixed_graphs", False):
            return f"attention backend {self.backend_name!r} reads host values when it runs prompt chunks"
        if self.model.spec.moe is not None:
            return f"{self.model.spec.family} is a mixture-of-experts model (its routed layers are not captured)"
        return None

    def max_graph_batch_size(self) -> int:
        return self.graphs.plan.decode_sizes[-1] if self.graphs else 0

    def _graph_key(self, step: Step) -> tuple[int, int | None] | None:
        return self.graphs.plan.for_step(step) if self.graphs is not None else None

    # ---- launch ----------------------------------------------------------------------------------------
    def launch(self, sched: SchedulerOutput, slot: DecodeSlot, prev: Step | None) -> Step:
        """Enqueue the forward of a planned step into `slot`. Pending input tokens come from the slots of the
        steps that sampled them (every slot's `sampled`, one buffer), when a step is in flight (`prev`)."""
        step = self._new_step(sched, slot)
        if sched.prompt_logprobs:
            step.prompt_logprobs = prompt_logprobs.plan_step(sched.chunks)
        self._plan_graph(step, self._graph_key(step))
        sampled = self.sampled if prev is not None else None
        step.forward = self.executor.submit(step, self._forward_job, step, sampled, sched.swaps,
                                            sched.lora_loads, sched.copies)
        return step

    def _forward_job(self, step: Step, sampled: torch.Tensor | None, swaps: list, lora_loads: list,
                     copies: list) -> None:
        ex = self.executor
        if swaps:  # KV copies the scheduler decided on since the last step, ordered before this forward
            self.offloader.run(swaps)
        if copies:  # copy-on-write of blocks shared by n > 1 siblings, after the forward that wrote them
            copy_blocks(self.kv_cache, copies)
        for op in lora_loads:  # adapters into the slots this step reads, after every forward that read them
            self.lora.load_slot(op.slot, op.adapter)
        ex.mark(step.id, FWD_START)
        with torch.inference_mode():
            bufs = step.slot.inputs
            bufs.upload()
            bufs.apply_tables(self.device_tables, full_width=step.graph_size is not None)
            if sampled is not None:
                bufs.gather_pending(sampled)
            if step.graph_size is not None:
                self.graphs.replay(step.slot, step.graph_size, step.graph_seqs)
            else:
                hidden = self._eager_forward(step.slot, every_row=step.prompt_logprobs is not None)
                if step.prompt_logprobs is not None:
                    prompt_logprobs.compute(step.prompt_logprobs, hidden, self.model.logits)
        ex.mark(step.id, FWD_END)

    def _eager_forward(self, slot: DecodeSlot, every_row: bool = False) -> torch.Tensor:
        """The step's forward, its sampling rows' logits into the slot; returns the hidden states: every
        token's when `every_row` (prompt scoring reads them), else the sampled rows' only.

        The last layer runs on the sampled rows alone past its attention (DecoderLM.sampled_hidden), except
        under an adapter (LoRA's per-token scales are laid out for every token). Tensor-parallel ranks decide
        alike (their row-parallel all-reduce needs it): they get the staged inputs, and a TP group runs neither
        prompt scoring nor adapters."""
        b = slot.inputs
        meta = b.metadata(self.block_size)
        for m in meta.groups or (meta,):
            self.backend.prepare(m)
        if self.lora is not None:
            self.lora.prepare(b.dev["lora_slots"][:b.num_tokens], b.lora_active)
        ids, positions = b.dev["input_ids"][:b.num_tokens], b.dev["positions"][:b.num_tokens]
        sampled = b.dev["logits_indices"][:b.num_rows]
        if every_row:
            hidden = self.model(ids, positions, self.kv_caches, meta)
            rows = hidden.index_select(0, sampled)
        else:
            lora = self.lora is not None and b.lora_active
            hidden = rows = self.model.sampled_hidden(ids, positions, self.kv_caches, meta, sampled, prune=not lora)
        if b.num_rows:
            self.model.logits(rows, out=slot.logits[:b.num_rows])
        return hidden

    def _decode_forward(self, slot: DecodeSlot, size: int, meta) -> None:
        """What a decode graph holds: `size` one-token rows, all sampled, logits into the slot's buffer."""
        b = slot.inputs
        if self.lora is not None:
            self.lora.prepare(b.dev["lora_slots"][:size])
        hidden = self.model(b.dev["input_ids"][:size], b.dev["positions"][:size], self.kv_caches, meta)
        self.model.logits(hidden, out=slot.logits[:size])

    def _mixed_forward(self, slot: DecodeSlot, tokens: int, seqs: int, meta) -> None:
        """What a mixed-step graph holds: `tokens` positions over `seqs` sequences, and the logits of `seqs` rows
        (logits_indices: the step's sampling rows, then row 0 for the padding) into the slot's buffer. The last
        layer runs past its attention on those rows only, as an eager step does, except under adapters."""
        b = slot.inputs
        if self.lora is not None:
            self.lora.prepare(b.dev["lora_slots"][:tokens])
        hidden = self.model.sampled_hidden(b.dev["input_ids"][:tokens], b.dev["positions"][:tokens], self.kv_caches,
                                           meta, b.dev["logits_indices"][:seqs], prune=self.lora is None)
        self.model.logits(hidden, out=slot.logits[:seqs])
