"""What the engine hands back per request."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class TokenLogprob:
    """Logprob of one generated token under the raw model distribution, plus top alternatives."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # (token id, logprob), best first
    rank: int | None = None  # prompt logprobs: 1 + tokens the model found strictly more likely


@dataclass(slots=True)
class RequestOutput:
    """A request's state after a commit. Cumulative fields plus the delta since the previous output.

    finish_reason: "stop" (EOS, stop token or stop string), "length" (max_tokens / max_model_len) or
    "abort"; None while running.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finished: bool = False
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None
    delta_token_ids: list[int] = field(default_factory=list)
    delta_text: str = ""
    delta_logprobs: list[TokenLogprob] | None = None
    num_cached_tokens: int = 0
    # Engine clock (time.monotonic() of the engine's process): only differences between these mean anything.
    arrival_time: float = 0.0
    first_scheduled_time: float | None = None  # launch of the first step that computed this request
    first_token_time: float | None = None
    finish_time: float | None = None
    output_time: float = 0.0  # when this output was produced (its tokens committed)
    error: str | None = None  # set when the engine failed the request (finish_reason "abort")
    # SamplingParams.prompt_logprobs: one entry per prompt token (the first None), on the first output only.
    prompt_logprobs: list[TokenLogprob | None] | None = None
    index: int = 0  # which of the request's SamplingParams.n samples this is (outputs of one request interleave)


@dataclass(slots=True)
class StepRecord:
    """Timing of one committed step, appended by the engine loop and drained in batches by the metrics
    side (the engine itself does nothing more with it).

    forward_s / sample_s: device time (CUDA events on GPU, wall time of the compute thread on CPU).
    period_s: time since the previous commit, or None when the engine was idle in between (an idle engine
    has no bubble to measure)."""

    num_seqs: int
    num_tokens: int
    forward_s: float
    sample_s: float
    period_s: float | None


def merge_outputs(older: RequestOutput, newer: RequestOutput) -> RequestOutput:
    """`newer` extended with `older`'s deltas: what a consumer that never saw `older` must receive (the
    cumulative fields are newer's already). Mutates and returns `newer`, a fresh object of the engine's."""
    newer.delta_token_ids = older.delta_token_ids + newer.delta_token_ids
    newer.delta_text = older.delta_text + newer.delta_text
    if newer.delta_logprobs is not None:
        newer.delta_logprobs = (older.delta_logprobs or []) + newer.delta_logprobs
    if newer.prompt_logprobs is None:
        newer.prompt_logprobs = older.prompt_logprobs  # sent once: a merged-away first output carried them
    return newer
