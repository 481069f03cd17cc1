"""What the engine hands back per request: CoreOutput from the engine core (token ids only, what is new),
RequestOutput from the frontend (text, cumulative fields, deltas)."""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec


@dataclass(slots=True)
class TokenLogprob:
    """Logprob of one generated token under the raw model distribution, plus top alternatives."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # (token id, logprob), best first
    rank: int | None = None  # prompt logprobs: 1 + tokens the model found strictly more likely


class CoreOutput(msgspec.Struct, array_like=True):
    """What one commit adds to one sample of a request, as the engine core reports it: the token ids (and
    their logprobs) committed since its previous output, and the finish. Costs O(new tokens), never the
    request's length. A msgspec Struct: built faster than a dataclass, and a core process sends a step's
    outputs as one msgpack array that the frontend decodes straight back into CoreOutputs
    (engine/core_proc.py encode_outputs), with no per-row Python either side.

    finish_reason: set once, on the sample's last output; stop_token: it ended on an EOS or stop token id,
    whose text is not part of the output. rejected: the request never ran (a grammar that does not compile,
    an unknown adapter): error says why, and the caller gets a ValueError, as for any bad input."""

    request_id: str
    index: int
    new_token_ids: list[int]
    finish_reason: str | None = None
    stop_token: bool = False
    new_logprobs: list[TokenLogprob] | None = None
    error: str | None = None
    rejected: bool = False
    # Set on a sample's first report only (they do not change afterwards; the frontend keeps them).
    num_cached_tokens: int = 0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None

    @property
    def key(self):
        """The sample's key in the core's request table (engine.sequence.Sequence.key)."""
        return self.request_id if self.index == 0 else (self.request_id, self.index)


class RequestOutput:
    """A request's state after a commit: the delta since the previous output, plus cumulative fields.

    finish_reason: "stop" (EOS, stop token or stop string), "length" (max_tokens / max_model_len) or
    "abort"; None while running.

    The cumulative fields (token_ids, text, logprobs) of a streamed output are snapshots taken when they are
    first read, not when the output is made: building them at every commit would cost the request's length
    at every token (a stream reads the deltas). A snapshot is what the output held when it was made, whenever
    it is read; its text is the text streamed so far (the deltas' concatenation).
    """

    __slots__ = ("request_id", "prompt", "prompt_token_ids", "_token_ids", "_text", "finished",
                 "finish_reason", "_logprobs", "delta_token_ids", "delta_text", "delta_logprobs",
                 "num_cached_tokens", "arrival_time", "first_scheduled_time", "first_token_time", "finish_time",
                 "output_time", "error", "prompt_logprobs", "index", "num_output_tokens", "rejected")

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                 token_ids: list[int] | _Snapshot, text: str | _Snapshot, finished: bool = False,
                 finish_reason: str | None = None, logprobs: list[TokenLogprob] | _Snapshot | None = None,
                 delta_token_ids: list[int] | None = None, delta_text: str = "",
                 delta_logprobs: list[TokenLogprob] | None = None, num_cached_tokens: int = 0,
                 arrival_time: float = 0.0, first_scheduled_time: float | None = None,
                 first_token_time: float | None = None, finish_time: float | None = None,
                 output_time: float = 0.0, error: str | None = None,
                 prompt_logprobs: list[TokenLogprob | None] | None = None, index: int = 0,
                 num_output_tokens: int | None = None, rejected: bool = False):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self._token_ids, self._text, self._logprobs = token_ids, text, logprobs
        self.finished = finished
        self.finish_reason = finish_reason
        self.delta_token_ids = [] if delta_token_ids is None else delta_token_ids
        self.delta_text = delta_text
        self.delta_logprobs = delta_logprobs
        self.num_cached_tokens = num_cached_tokens
        # Engine clock (time.monotonic() of the engine's host): only differences between these mean anything.
        self.arrival_time = arrival_time
        self.first_scheduled_time = first_scheduled_time  # launch of the first step that computed this request
        self.first_token_time = first_token_time
        self.finish_time = finish_time
        self.output_time = output_time  # when this output was produced (its tokens committed)
        self.error = error  # set when the engine failed the request (finish_reason "abort")
        # SamplingParams.prompt_logprobs: one entry per prompt token (the first None), on the first output only.
        self.prompt_logprobs = prompt_logprobs
        self.index = index  # which of the request's SamplingParams.n samples this is (outputs interleave)
        # len(token_ids), without building the snapshot
        self.num_output_tokens = len(token_ids) if num_output_tokens is None else num_output_tokens
        self.rejected = rejected  # the request never ran (the engine refused it: error says why)

    @property
    def token_ids(self) -> list[int]:
        v = self._token_ids
        if isinstance(v, _Snapshot):
            v = self._token_ids = v.token_ids()
        return v

    @token_ids.setter
    def token_ids(self, value: list[int]) -> None:
        self._token_ids = value

    @property
    def text(self) -> str:
        v = self._text
        if isinstance(v, _Snapshot):
            v = self._text = v.text()
        return v

    @text.setter
    def text(self, value: str) -> None:
        self._text = value

    @property
    def logprobs(self) -> list[TokenLogprob] | None:
        v = self._logprobs
        if isinstance(v, _Snapshot):
            v = self._logprobs = v.logprobs()
        return v

    @logprobs.setter
    def logprobs(self, value: list[TokenLogprob] | None) -> None:
        self._logprobs = value

    def __repr__(self) -> str:
        return (f"RequestOutput(request_id={self.request_id!r}, index={self.index}, "
                f"num_output_tokens={self.num_output_tokens}, delta_token_ids={self.delta_token_ids!r}, "
                f"delta_text={self.delta_text!r}, finished={self.finished}, finish_reason={self.finish_reason!r}, "
                f"error={self.error!r})")


class _Snapshot:
    """The cumulative fields of one output, read on demand from its request's growing state (a frontend
    request state with token_ids, logprobs and detok) up to the lengths it had then."""

    __slots__ = ("state", "num_tokens", "num_chars")

    def __init__(self, state, num_tokens: int, num_chars: int):
        self.state, self.num_tokens, self.num_chars = state, num_tokens, num_chars

    def token_ids(self) -> list[int]:
        return self.state.token_ids[:self.num_tokens].tolist()  # host memory (an int64 array there)

    def text(self) -> str:
        return self.state.detok.text_upto(self.num_chars)

    def logprobs(self) -> list[TokenLogprob]:
        return self.state.logprobs[:self.num_tokens]


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


def merge_outputs(older: RequestOutput, newer: RequestOutput, join_text: bool = True) -> RequestOutput:
    """`newer` extended with `older`'s deltas: what a consumer that never saw `older` must receive (the
    cumulative fields are newer's already). Mutates and returns `newer`, a fresh object of the engine's, and
    takes over `older`'s delta lists, extended in place with newer's: both outputs are the merging caller's own
    and `older` is dropped, so merging k outputs one after another costs O(k) in all, not O(k^2) (a consumer that
    falls behind a long stream). join_text=False leaves the text to the caller, who keeps the pieces of many
    merges in a row and joins them once (a str cannot grow in place: AsyncLLM's collector)."""
    ids = older.delta_token_ids
    ids += newer.delta_token_ids
    newer.delta_token_ids = ids
    if join_text:
        newer.delta_text = older.delta_text + newer.delta_text
    if newer.delta_logprobs is not None:
        lps = older.delta_logprobs
        if lps is None:
            lps = older.delta_logprobs = []
        lps += newer.delta_logprobs
        newer.delta_logprobs = lps
    if newer.prompt_logprobs is None:
        newer.prompt_logprobs = older.prompt_logprobs  # sent once: a merged-away first output carried them
    return newer
