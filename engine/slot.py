"""Ping-pong step slots (Photon's DecodeSlot) and the in-flight step they carry."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from engine.scheduler import ScheduledChunk
from engine.step_timer import StepTimer


class DecodeSlot:
    """The working set of one in-flight step, allocated once and reused.

    `sampled` is where the step's sampler writes its tokens on the device; the next step's forward gathers
    its pending input tokens from it, so the CPU never waits for them. `host_sampled` is the landing site of
    the device-to-host copy (the same tensor on CPU; pinned memory on CUDA). A slot is busy from launch until
    its commit has read `host_sampled`; the engine alternates between two slots.
    """

    def __init__(self, index: int, max_rows: int, device: torch.device):
        self.index = index
        self.sampled = torch.zeros(max_rows, dtype=torch.long, device=device)  # [max_num_seqs]
        self.host_sampled = self.sampled if device.type == "cpu" else torch.zeros(
            max_rows, dtype=torch.long, pin_memory=True)
        self.timer = StepTimer(device)
        self.busy = False


@dataclass(slots=True)
class HostInputs:
    """A step's inputs assembled on the host (Python lists) before the launch copies them over."""

    input_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slot_mapping: list[int] = field(default_factory=list)
    query_lens: list[int] = field(default_factory=list)
    seq_lens: list[int] = field(default_factory=list)
    block_tables: list[list[int]] = field(default_factory=list)
    logits_indices: list[int] = field(default_factory=list)  # last token of each sampling chunk
    gather_dst: list[int] = field(default_factory=list)  # token index whose id is pending on the device
    gather_src: list[int] = field(default_factory=list)  # ... and its row in the previous slot's `sampled`


@dataclass(slots=True)
class StepResult:
    """What a commit reads: tokens and logprobs on the host, plus timings of the device work."""

    tokens: list[int]
    logprobs: list[float] | None
    top_ids: list[list[int]] | None
    top_logprobs: list[list[float]] | None
    forward_s: float
    sample_s: float
    sample_wait_s: float = 0.0  # the worker idled this long between the forward and sampling (CPU executor)


@dataclass(slots=True)
class Step:
    """One launched step: which chunks ran, where (slot), and the handles to wait on."""

    id: int
    slot: DecodeSlot
    chunks: list[ScheduledChunk]
    sample_chunks: list[ScheduledChunk]
    num_tokens: int
    launch_time: float
    forward: Future | None = None
    sample: Future | None = None
    logits: torch.Tensor | None = None  # [num_sampling_rows, vocab], set by the forward job
    forward_s: float = 0.0
    forward_end: float = 0.0  # perf_counter when the forward job ended
    finalize_s: float = 0.0  # host time to build the sampling inputs (incl. constraint masks)
