"""One rank of a tensor-parallel group: a ModelRunner over a sharded DecoderLM and its share of the KV cache.

Rank 0 is the engine's own runner (in the engine's process): it schedules, stages, samples and commits
exactly as the single-device ModelRunner does, two-slot pipeline included. The only difference is inside the
forward job: once the step's inputs are final on rank 0 (uploaded, block-table deltas applied, the pending
tokens of the previous step gathered into input_ids), rank 0 broadcasts them (engine/tp/channel.py: a fixed
header of sizes and the step region's used bytes), then any copy-on-write block pairs, and every rank runs the
same forward on the same buffers. The collectives inside the model (engine/models/tp.py) keep the ranks in
step; the sampling rows' logits are gathered to rank 0, which samples.

Ranks 1..N-1 (`follow`) are the same class driven by those broadcasts: they hold no scheduler, sampler
state or host bookkeeping, only one slot's buffers, their copy of the persistent block table (kept current by
the deltas, which arrive in step order) and their KV shard. A header with op STOP ends the loop.

The memory profiling pass runs in lock step too (rank 0's dummy steps are broadcast like real ones) and the
ranks agree on the smallest KV block count any of them can hold.

Any failure inside rank 0's forward job leaves the group in an unknown state (a peer may wait in a collective
that will never come), so the runner turns it into a TensorParallelError and refuses every later step: the
engine fails its requests and reports unhealthy (engine/tp/engine.py).
"""

from __future__ import annotations

import logging

import torch

from engine.config import EngineConfig
from engine.kv_offload import copy_blocks
from engine.model_runner import ModelRunner
from engine.models import build_model
from engine.models.decoder import ModelSpec
from engine.models.tp import TPShard, local_spec
from engine.tp.channel import StepChannel

logger = logging.getLogger(__name__)


class TensorParallelError(RuntimeError):
    """The tensor-parallel group failed (a rank died or a collective failed): the engine cannot go on."""


class TPModelRunner(ModelRunner):
    supports_prompt_logprobs = False  # the prompt-scoring pass reads logits rank 0 alone cannot compute

    def __init__(self, config: EngineConfig, hf_config, spec: ModelSpec, device: torch.device,
                 dtype: torch.dtype, max_model_len: int, comm, workers=None):
        """comm: this rank's GroupComm (engine/tp/comm.py); workers: on rank 0, the group of the other ranks
        (shut down with this runner; its `error()` says whether one has died)."""
        self.comm, self.workers = comm, workers
        self.shard = TPShard(comm.rank, comm.size, spec, comm)
        self.error: BaseException | None = None
        self._copies: list[tuple[int, int]] = []
        self.channel = StepChannel(comm)
        super().__init__(config, hf_config, spec, device, dtype, max_model_len)
        comm.started()
        if not self.is_driver:  # a worker never holds logits (they are gathered to rank 0): drop the slots'
            for slot in self.slots:  # [max_seqs, vocab] fp32 buffers (~150 MB each at a 150k vocabulary)
                slot.logits = torch.empty(slot.logits.shape[0], 0, device=device)
        self.backend_name = f"{self.backend_name}, tensor parallel x{comm.size} (gloo)"

    @property
    def is_driver(self) -> bool:
        return self.comm.rank == 0

    def _build_model(self, hf_config, spec: ModelSpec, max_model_len: int, dtype: torch.dtype):
        return build_model(self.config.model_dir, hf_config, local_spec(spec, self.comm.size), max_model_len,
                           self.backend, dtype, self.device, cpu_onednn=self.config.cpu_onednn, tp=self.shard,
                           fused=self.config.fused_forward, gguf_file=self.config.gguf_file)

    def _agree_kv_blocks(self, num_blocks: int) -> int:
        return self.comm.all_reduce_min(num_blocks)

    # ---- rank 0 -----------------------------------------------------------------------------------------------
    def _forward_job(self, step, sampled, swaps, lora_loads, copies) -> None:
        if self.error is not None:
            raise TensorParallelError(f"the tensor-parallel group is broken: {self.error!r}")
        self._copies = copies
        try:
            super()._forward_job(step, sampled, swaps, lora_loads, copies)
        except Exception as exc:
            self.error = exc
            raise TensorParallelError(f"tensor-parallel step failed: {type(exc).__name__}: {exc}") from exc

    def _eager_forward(self, slot, every_row: bool = False):
        if self.is_driver:
            self._send_step(slot.inputs)
        return super()._eager_forward(slot, every_row)

    def _send_step(self, b) -> None:
        """The step's final inputs to every rank (engine/tp/channel.py), then its copy-on-write pairs."""
        copies, self._copies = self._copies, []
        self.channel.send(b, extra=len(copies))
        if copies:
            self.comm.broadcast(torch.tensor(copies, dtype=torch.long))

    def is_fatal(self, exc: BaseException) -> bool:
        return isinstance(exc, TensorParallelError)  # the group is in an unknown state: no step can follow

    def health_error(self) -> str | None:
        """Why the group cannot serve (None while it can): a failed step, or a worker that has exited."""
        if self.error is not None:
            return f"tensor-parallel group failed: {self.error!r}"
        dead = self.workers.error() if self.workers is not None else None
        return f"tensor-parallel worker failed: {dead}" if dead else None

    def stats(self) -> dict:
        return {"tensor_parallel_size": self.comm.size, **self.comm.stats()}

    def shutdown(self) -> None:
        super().shutdown()  # the executor: no forward runs after this
        if self.is_driver and self.error is None and self.workers is not None and self.workers.error() is None:
            try:
                self.channel.stop()
            except Exception:  # noqa: BLE001 - a worker that is gone already needs no stop
                logger.debug("tensor-parallel stop broadcast failed", exc_info=True)
        if self.workers is not None:
            self.workers.shutdown()

    # ---- ranks 1..N-1 -----------------------------------------------------------------------------------------
    def follow(self) -> int:
        """Run rank 0's steps until it sends STOP; returns how many ran."""
        steps = 0
        while self._follow_one():
            steps += 1
        return steps

    @torch.inference_mode()
    def _follow_one(self) -> bool:
        slot = self.slots[0]
        ncopies = self.channel.receive(slot.inputs, self.device_tables)
        if ncopies is None:
            return False
        if ncopies:
            pairs = torch.zeros(ncopies, 2, dtype=torch.long)
            self.comm.broadcast(pairs)
            copy_blocks(self.kv_cache, pairs.tolist())  # host memory
        super()._eager_forward(slot)
        return True

    def _dummy_step(self, num_tokens: int, num_seqs: int, sample: bool) -> None:
        """The memory profile: a worker runs rank 0's dummy step as broadcast (it samples nothing)."""
        if self.is_driver:
            return super()._dummy_step(num_tokens, num_seqs, sample)
        self._follow_one()
