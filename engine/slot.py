"""Ping-pong step slots (Photon's DecodeSlot) and the in-flight step they carry."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass

import torch

from engine.sampling_params import MAX_LOGPROBS
from engine.scheduler import ScheduledChunk
from engine.step_buffers import BufferLimits, StepBuffers


class DecodeSlot:
    """The working set of one in-flight step, allocated once and reused.

    `inputs` holds the step's fixed-address input buffers (and their host staging); the forward writes the
    sampling rows' logits into `logits` and the sampler its tokens into `sampled`. The next step's forward
    gathers its pending input tokens from `sampled`, so the CPU never waits for them. The `host_*` tensors
    (pinned on CUDA) are the landing site of the device-to-host copy the commit reads. A slot is busy from
    launch until its commit has read them; the engine cycles through its slots (two, or three with
    EngineConfig.pipeline_depth=3). On CUDA the slot's
    `sampled_ready` event anchors that copy (recorded right after sampling) and `copy_done` marks it read.
    """

    def __init__(self, index: int, limits: BufferLimits, vocab_size: int, device: torch.device,
                 logits: bool = True, transfer=None, sampled: torch.Tensor | None = None):
        """sampled: this slot's [max_seqs] part of the runner's buffer of every slot's sampled tokens (the next
        steps gather their pending tokens from it by flat index); None allocates one of its own."""
        self.index = index
        rows, pin = limits.max_seqs, device.type == "cuda"
        self.inputs = StepBuffers(limits, device, transfer)
        # [max_seqs, V]; None where no forward writes logits here (a simulated device models them)
        self.logits = torch.zeros(rows, vocab_size, dtype=torch.float32, device=device) if logits else None
        self.sampled = torch.zeros(rows, dtype=torch.long, device=device) if sampled is None else sampled  # [max_seqs]
        self.host_sampled = torch.zeros(rows, dtype=torch.long, pin_memory=pin)
        self.host_logprobs = torch.zeros(rows, dtype=torch.float32, pin_memory=pin)
        self.host_top_ids = torch.zeros(rows, MAX_LOGPROBS, dtype=torch.long, pin_memory=pin)
        self.host_top_logprobs = torch.zeros(rows, MAX_LOGPROBS, dtype=torch.float32, pin_memory=pin)
        # numpy views of the same memory, for the commit's reads: slicing and tolist() through numpy cost a few
        # microseconds on the loop, through torch's dispatcher tens of them (docs/engine.md#host-work-per-step)
        self.np_sampled, self.np_logprobs = self.host_sampled.numpy(), self.host_logprobs.numpy()  # host views
        self.np_top_ids, self.np_top_logprobs = self.host_top_ids.numpy(), self.host_top_logprobs.numpy()  # host views
        self.sampled_ready = torch.cuda.Event() if pin else None
        self.copy_done = torch.cuda.Event() if pin else None
        self.busy = False


@dataclass(slots=True)
class StepResult:
    """What a commit reads: tokens and logprobs on the host, plus timings of the device work.

    forward_s / sample_s: device time of the step's forward and sampling (CUDA events; wall time of the
    worker on CPU). period_s: from the previous step's forward start to this one's (0.0 for the first)."""

    tokens: list[int]
    logprobs: list[float] | None
    top_ids: list[list[int]] | None
    top_logprobs: list[list[float]] | None
    forward_s: float
    sample_s: float
    period_s: float = 0.0
    sample_wait_s: float = 0.0  # the compute queue idled this long between the forward and sampling
    prompt_logprobs: object | None = None  # engine.prompt_logprobs.PromptLogprobPlan, scored (host-readable)


@dataclass(slots=True)
class Step:
    """One launched step: which chunks ran, where (slot), and the handles to wait on."""

    id: int
    slot: DecodeSlot
    chunks: list[ScheduledChunk]
    sample_chunks: list[ScheduledChunk]
    num_tokens: int
    launch_time: float
    forward: Future | None = None  # the CPU worker's job (None where submitting only enqueued work)
    sample: Future | None = None
    error: Exception | None = None  # raised while enqueuing this step's work; re-raised at its wait
    graph_size: int | None = None  # padded batch size of the CUDA graph replayed, None = eager forward
    graph_seqs: int | None = None  # a mixed-step graph's sequences (graph_size is then its tokens); None: decode
    num_logprobs: int = -1  # what the sampler produced: -1 none, 0 chosen token only, k top-k too
    finalize_s: float = 0.0  # host time to build the sampling inputs (incl. constraint masks)
    prompt_logprobs: object | None = None  # engine.prompt_logprobs.PromptLogprobPlan; None for most steps
    forks: list[ScheduledChunk] = ()  # SchedulerOutput.forks: sampling rows past the chunks' (n > 1 siblings)
    # A step verifying drafts (engine/spec_decode.py): per sampling row, the drafts before its position (a chunk
    # with k drafts has k + 1 rows, row j after draft[:j]), which that row's penalties count; None: no drafts.
    drafts: list[list[int]] | None = None

    @property
    def is_decode(self) -> bool:
        """One token a chunk (the tokens are the chunks' sum, each at least one) and every chunk sampling (no
        drafts then: a chunk with drafts has more than one token), no forks: told from the counts, without a pass
        over the rows."""
        return not self.forks and self.num_tokens == len(self.chunks) == len(self.sample_chunks)
