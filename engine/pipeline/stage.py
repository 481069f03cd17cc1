"""One pipeline stage: a contiguous slice of the model's layers and the matching slice of the paged KV cache.

A stage only runs forwards. The driver (engine/pipeline/engine.py) owns the scheduler, the block manager
(one block table for all stages: block ids mean the same thing on every stage), the sampler and the
detokenizer; each step it sends every stage the same `StageBatch` (the token layout of the step), and the
stages pass hidden states down the line. The last stage returns the logits of the sampling rows, or, in
the SiPipe ablation without CPU sampling, the sampled tokens.

Token-safe execution (SiPipe's TSEM): `prepare(batch)` writes a step's inputs into one of two versions of
the stage's fixed-address input buffers (version = step id % 2) and `forward(version, hidden)` runs the
layers on that version. The transport runs `prepare` as its own task, so a stage prepares step i while it
still waits for step i's hidden states from upstream; with two versions the staging of step i+1 can never
overwrite what step i's (possibly still queued, on CUDA) uploads and forward read.

No Ray here: cluster/pipeline.py wraps a StageWorker in an actor; engine/pipeline/local.py calls it in
process (tests, and the single-stage baseline of the benchmark).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from engine.attention import get_backend, resolve_backend
from engine.kv_dtype import resolve_kv_dtype
from engine.memory import HostMeter
from engine.models import build_model, load_hf_config, model_spec
from engine.models.tp import local_spec
from engine.sampler import Sampler, SamplingBatch
from engine.step_buffers import BufferLimits, StagedStep, StepBuffers
from engine.tp.stage import StageTP


@dataclass(frozen=True, slots=True)
class StageSpec:
    """Everything a stage needs to start (picklable: it travels to the stage actor)."""

    model: str  # the checkpoint directory (for a GGUF file: its config and tokenizer, EngineConfig.model_dir)
    index: int
    num_stages: int
    layers: tuple[int, int]  # [start, end) in the full model's numbering
    block_size: int
    limits: BufferLimits
    max_model_len: int
    dtype: str  # a torch dtype name, e.g. "float32"
    device: str  # "cpu" | "cuda" (inside a Ray actor the visible GPU is cuda:0)
    attention_backend: str = "auto"
    kv_cache_dtype: str = "auto"  # EngineConfig.kv_cache_dtype (engine/kv_dtype.py)
    num_kv_blocks: int | None = None  # None: size from the stage's own memory (see kv_capacity)
    gpu_memory_utilization: float = 0.85
    cpu_kv_cache_bytes: int | None = None  # None: cpu_memory_utilization x available RAM (engine/memory.py)
    cpu_memory_utilization: float = 0.5
    token_safe: bool = True  # two input-buffer versions (TSEM); False: one, prepared after the hidden arrives
    # Structure-aware transmission (SAT): hidden states leave in a fixed [max_tokens, hidden] layout, so the
    # receiver knows shape and dtype in advance and takes the step's rows by the token count it already has
    # from its StageBatch. False: a dict with the tensor and its metadata (structure-unaware).
    structure_aware: bool = True
    sample_on_stage: bool = False  # the last stage samples (EngineConfig.pp_cpu_sampling off)
    seed: int = 0
    # TP x PP (engine/tp/stage.py): the stage's layers sharded over this many ranks; `tp` says which rank this
    # worker is and where its group meets (filled in by the stage group, which opens the rendezvous).
    tensor_parallel_size: int = 1
    tp: object | None = None  # engine.tp.stage.StageTPSpec
    gguf_file: str | None = None  # the weights come from this GGUF file (EngineConfig.gguf_file), not `model`

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.num_stages - 1


@dataclass(slots=True)
class StageBatch:
    """One step as every stage sees it: the driver's staged token layout (and, when the last stage samples,
    the per-row sampling parameters). Sent once per step to all stages; hidden states travel separately."""

    step_id: int
    inputs: StagedStep
    sampling: SamplingBatch | None = None  # built on the driver, every feature (sample_on_stage)


def split_layers(num_layers: int, num_stages: int) -> list[tuple[int, int]]:
    """Contiguous, as even as possible; the remainder goes to the first stages (the last one also runs
    the final norm and the LM head)."""
    if not 1 <= num_stages <= num_layers:
        raise ValueError(f"pipeline_parallel_size must be in [1, {num_layers}] (the model has {num_layers} "
                         f"layers), got {num_stages}")
    base, extra = divmod(num_layers, num_stages)
    bounds, start = [], 0
    for i in range(num_stages):
        end = start + base + (i < extra)
        bounds.append((start, end))
        start = end
    return bounds


class StageWorker:
    """Holds one stage's weights and KV slice and runs its part of each step's forward."""

    def __init__(self, spec: StageSpec):
        self.spec = spec
        self.device = torch.device(spec.device)
        dtype = getattr(torch, spec.dtype)
        hf_config = load_hf_config(spec.model)
        self.model_spec = model_spec(hf_config)
        kv_dtype = resolve_kv_dtype(spec.kv_cache_dtype, dtype, self.device, spec.attention_backend)
        backend_name = resolve_backend(spec.attention_backend, self.device, spec.block_size,
                                       softcap=self.model_spec.attn_softcap is not None, kv_cast=kv_dtype != dtype)
        self.backend = get_backend(backend_name, sliding_window=self.model_spec.sliding_window)
        self.tp = StageTP(spec.tp, self.model_spec) if spec.tp is not None else None
        build_spec = local_spec(self.model_spec, spec.tp.size) if self.tp else self.model_spec
        self.model = build_model(spec.model, hf_config, build_spec, spec.max_model_len, self.backend,
                                 dtype, self.device, layers=spec.layers, tp=self.tp.shard if self.tp else None,
                                 gguf_file=spec.gguf_file)
        self.num_kv_blocks = spec.num_kv_blocks or self.kv_capacity(kv_dtype)
        if self.tp is not None:
            self.num_kv_blocks = self.tp.agree(self.num_kv_blocks)
        n_layers = spec.layers[1] - spec.layers[0]
        ms = self.model.spec  # a TP rank's own share of the KV heads
        self.kv_cache = torch.zeros((n_layers, 2, self.num_kv_blocks, spec.block_size, ms.num_kv_heads,
                                     ms.head_dim), dtype=kv_dtype, device=self.device)
        self.kv_caches = [(self.kv_cache[i, 0], self.kv_cache[i, 1]) for i in range(n_layers)]
        self.buffers = [StepBuffers(spec.limits, self.device) for _ in range(2 if spec.token_safe else 1)]
        # This stage's copy of the driver's persistent block tables (engine/block_tables.py), kept current by
        # the deltas each step carries (steps arrive in order).
        self.device_tables = torch.zeros(spec.limits.table_rows, spec.limits.max_blocks, dtype=torch.int32,
                                         device=self.device)
        self.sampling: list[SamplingBatch | None] = [None] * len(self.buffers)
        # SAT: one fixed-layout output buffer per input version (a send may still read the previous one).
        # Only on CUDA, where the channel is NCCL and the fixed shape lets Ray skip the shape exchange; the
        # CPU channel serializes whatever it is given, so there the bare [T, hidden] tensor is sent.
        fixed = spec.structure_aware and not spec.is_last and self.device.type == "cuda"
        self.out_bufs = [torch.zeros(spec.limits.max_tokens, ms.hidden_size, dtype=dtype, device=self.device)
                         for _ in self.buffers] if fixed else None
        self.sampler = Sampler(spec.seed, self.device) if spec.is_last and spec.sample_on_stage else None
        self.busy_s = 0.0  # time spent in prepare + forward (the stage's busy fraction, for the benchmark)

    def info(self) -> tuple[int, str]:
        """(KV blocks this stage holds, attention backend class): what the group asks a new stage actor."""
        return self.num_kv_blocks, type(self.backend).__name__

    def kv_capacity(self, kv_dtype: torch.dtype) -> int:
        """KV blocks this stage's memory holds for its own layers (the driver uses the smallest over stages)."""
        ms, spec = self.model.spec, self.spec
        elem = torch.tensor([], dtype=kv_dtype).element_size()
        per_block = 2 * (spec.layers[1] - spec.layers[0]) * spec.block_size * ms.num_kv_heads * ms.head_dim * elem
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = int(free * spec.gpu_memory_utilization)
        else:
            usable, in_use = HostMeter.usage(spec.cpu_kv_cache_bytes, spec.cpu_memory_utilization)
            budget = int(usable - in_use)
        useful = spec.limits.max_seqs * -(-spec.max_model_len // spec.block_size)
        return max(1, min(useful, budget // per_block))

    # ---- the step ---------------------------------------------------------------------------------------------
    def prepare(self, batch: StageBatch) -> int:
        """Stage and upload `batch` into its buffer version; returns the version for forward()."""
        t0 = _now()
        version = batch.step_id % len(self.buffers)
        bufs = self.buffers[version]
        bufs.load(batch.inputs)
        bufs.upload()
        bufs.apply_tables(self.device_tables, full_width=False)
        self.sampling[version] = batch.sampling
        self.busy_s += _now() - t0
        return version

    @torch.inference_mode()
    def forward(self, version: int, hidden) -> torch.Tensor | dict:
        """Run this stage's layers on the prepared step. Returns its hidden states (see `_send`), or on the
        last stage float32 logits [rows, vocab] (sampled token ids [rows] when it samples), on the host."""
        t0 = _now()
        bufs = self.buffers[version]
        if hidden is not None:
            hidden = _received(hidden)[:bufs.num_tokens].to(self.device, non_blocking=True)  # [T, hidden]
        if self.tp is not None:  # the stage's other TP ranks run the same step
            self.tp.send(bufs, hidden)
        x = self._layers(bufs, hidden)
        out = self._last_stage_output(x, version) if self.spec.is_last else self._send(x, version)
        self.busy_s += _now() - t0
        return out

    def _layers(self, bufs: StepBuffers, hidden: torch.Tensor | None) -> torch.Tensor:
        """This stage's layers over the step: their hidden states, or on the last stage the sampled rows' only
        (its last layer runs past the attention on those alone, as engine.model_runner's eager forward)."""
        meta = bufs.metadata(self.spec.block_size)
        self.backend.prepare(meta)
        t = bufs.num_tokens
        ids = bufs.dev["input_ids"][:t] if self.spec.is_first else None
        positions = bufs.dev["positions"][:t]
        if not self.spec.is_last:
            return self.model(ids, positions, self.kv_caches, meta, hidden=hidden)
        return self.model.sampled_hidden(ids, positions, self.kv_caches, meta,
                                         bufs.dev["logits_indices"][:bufs.num_rows], hidden=hidden)

    def follow(self) -> int:
        """A TP rank > 0 of this stage: run rank 0's steps (engine/tp/stage.py) until it stops the group."""
        bufs, steps = self.buffers[0], 0
        hidden_buf = None if self.spec.is_first else torch.zeros(
            self.spec.limits.max_tokens, self.model_spec.hidden_size, dtype=getattr(torch, self.spec.dtype),
            device=self.device)
        while True:
            with torch.inference_mode():
                running, hidden = self.tp.receive(bufs, self.device_tables, hidden_buf)
                if not running:
                    return steps
                x = self._layers(bufs, hidden)
                if self.spec.is_last:  # this rank's vocabulary shard of the logits, gathered to rank 0
                    self.model.logits(x)
            steps += 1

    def stop_followers(self) -> None:
        """Rank 0: end the other TP ranks' `follow` (a stage group shutting down in process)."""
        if self.tp is not None:
            try:
                self.tp.channel.stop()
            except RuntimeError:  # the group broke earlier (a rank died): nothing left to stop
                pass

    def _send(self, x: torch.Tensor, version: int):
        if not self.spec.structure_aware:  # the receiver learns the layout from metadata sent along
            return {"hidden": x, "shape": tuple(x.shape), "dtype": str(x.dtype)}
        if self.out_bufs is None:
            return x  # [T, hidden]: the receiver knows T from its StageBatch
        buf = self.out_bufs[version]
        buf[:x.shape[0]].copy_(x)
        return buf  # [max_tokens, hidden]: always the same shape and dtype

    def _last_stage_output(self, rows: torch.Tensor, version: int):
        """float32 logits [rows, vocab] of the sampled rows for the driver to sample; or, when this stage samples,
        the token ids [rows], with (logprobs, top ids, top logprobs) after them when the step asks for any."""
        out = self.model.logits(rows)  # `rows` are the sampled rows' hidden states
        if self.sampler is None:
            return out.cpu()  # sync-ok: the driver samples on the host, over Ray; a no-op on cpu
        batch = self.sampling[version]  # None for a step with no sampling rows (a mid-prompt chunk)
        if batch is None:
            return torch.empty(0, dtype=torch.long)
        sampled = self.sampler(out, batch.to(self.device))
        if batch.num_logprobs < 0:
            return sampled.tokens.cpu()  # sync-ok: the driver commits on the host
        return tuple(None if t is None else t.cpu() for t in  # sync-ok: as above
                     (sampled.tokens, sampled.logprobs, sampled.top_ids, sampled.top_logprobs))

    def run(self, batch: StageBatch, hidden: torch.Tensor | None) -> torch.Tensor:
        """prepare + forward in one call (the transport without token-safe execution)."""
        return self.forward(self.prepare(batch), hidden)

    def take_busy_s(self) -> float:
        busy, self.busy_s = self.busy_s, 0.0
        return busy


def _received(hidden) -> torch.Tensor:
    return hidden["hidden"] if isinstance(hidden, dict) else hidden


def _now() -> float:
    return time.perf_counter()
