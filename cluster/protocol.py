"""Typed messages between the ingress and the engine replicas (they cross a Ray process boundary)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from engine.lora.request import LoRARequest
from engine.outputs import RequestOutput, TokenLogprob
from engine.sampling_params import SamplingParams


@dataclass(slots=True)
class GenerateRequest:
    """A tokenized request; the router reads prompt_token_ids for prefix affinity."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    ingress_time: float = field(default_factory=time.time)  # wall clock: comparable across processes
    # The LoRA adapter the request's `model` named (resolved by the ingress); None = the base model. The
    # router prefers replicas holding it and seeds the prompt's prefix hashes with its hash_root.
    lora_request: LoRARequest | None = None


@dataclass(slots=True)
class GenerateChunk:
    """What one engine commit adds to a request, streamed back to the ingress."""

    request_id: str
    delta_text: str
    delta_token_ids: list[int]
    delta_logprobs: list[TokenLogprob] | None
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    error: str | None = None
    # The engine's timestamps (its own monotonic clock; see RequestOutput): the ingress subtracts the
    # engine's share from what it measured itself to get the time spent in Serve.
    arrival_time: float = 0.0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    output_time: float = 0.0
    rejected: bool = False  # the request itself was bad (error says why): the ingress answers 400
    prompt_logprobs: list[TokenLogprob | None] | None = None  # SamplingParams.prompt_logprobs, first chunk only
    index: int = 0  # the sample (SamplingParams.n) this chunk belongs to: a request's samples interleave

    @classmethod
    def rejection(cls, request_id: str, message: str) -> "GenerateChunk":
        """The first and only chunk of a request the engine refused (a grammar that does not compile, a
        prompt larger than the KV cache, ...): sent as data, not raised, so no traceback is logged for it."""
        return cls(request_id, "", [], None, True, "abort", 0, 0, 0, error=message, rejected=True)

    @classmethod
    def from_output(cls, out: RequestOutput) -> "GenerateChunk":
        return cls(out.request_id, out.delta_text, out.delta_token_ids, out.delta_logprobs, out.finished,
                   out.finish_reason, len(out.prompt_token_ids), out.num_output_tokens, out.num_cached_tokens,
                   out.error, out.arrival_time, out.first_scheduled_time, out.first_token_time,
                   out.finish_time, out.output_time, prompt_logprobs=out.prompt_logprobs, index=out.index)
