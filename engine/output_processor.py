"""The frontend's half of a request: turns the engine core's token deltas into RequestOutputs.

The core (engine/core.py) reports per step, per sample, only the token ids committed since its last report.
Here each sample keeps what the core never needs: its text (an incremental detokenizer), its stop strings,
the cumulative token ids and logprobs a caller may read. A stop string found here ends the sample; the caller
(LLMEngine, or AsyncLLM's frontend) tells the core to finish it, and whatever the core committed for it after
the stop (it runs a step or more ahead) is dropped here. Every output costs O(new tokens).
"""

from __future__ import annotations

import time
from array import array

from tokenizers import Tokenizer

from engine.detokenizer import IncrementalDetokenizer, token_texts
from engine.outputs import CoreOutput, RequestOutput, TokenLogprob, _Snapshot
from engine.sampling_params import SamplingParams


class RequestState:
    """One sample of a request, as the frontend knows it."""

    __slots__ = ("request_id", "index", "prompt", "prompt_token_ids", "params", "detok", "token_ids",
                 "logprobs", "finished", "arrival_time", "stream", "prompt_logprobs", "num_cached_tokens",
                 "first_scheduled_time", "first_token_time")

    def __init__(self, request_id: str, index: int, prompt: str | None, prompt_token_ids: list[int],
                 params: SamplingParams, detok: IncrementalDetokenizer, arrival_time: float, stream: bool):
        self.request_id, self.index = request_id, index
        self.prompt, self.prompt_token_ids, self.params = prompt, prompt_token_ids, params
        self.detok = detok
        self.token_ids = array("q")  # not a list: the collector need not visit each token (Sequence)
        self.logprobs: list[TokenLogprob] | None = [] if params.logprobs is not None else None
        self.finished = False
        self.arrival_time = arrival_time
        self.stream = stream  # an output at every core report (else only the final one)
        self.prompt_logprobs = None  # the core's (on its first report), until an output carries them
        self.num_cached_tokens = 0  # from the core's first report
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None


class OutputProcessor:
    """Per-sample text state and RequestOutput building for the requests of one frontend. Single-threaded:
    one thread calls add/process/abort (LLMEngine's caller, or AsyncLLM's output thread)."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer  # the Rust tokenizer (tokenizers.Tokenizer)
        token_texts(tokenizer, True)  # the detokenizer's table, built now, not mid-request
        self.states: dict[str | tuple[str, int], RequestState] = {}

    def add(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
            arrival_time: float, stream: bool, sample_params: list[SamplingParams]) -> None:
        """Track a request's samples (`sample_params`: each sample's own params, index order)."""
        if request_id in self.states:
            raise ValueError(f"request_id {request_id!r} is already in use")
        for i, p in enumerate(sample_params):
            detok = IncrementalDetokenizer(self.tokenizer, prompt_token_ids, p)
            key = request_id if i == 0 else (request_id, i)
            self.states[key] = RequestState(request_id, i, prompt, prompt_token_ids, p, detok, arrival_time,
                                            stream)

    def has(self, request_id: str) -> bool:
        return request_id in self.states

    def discard(self, request_id: str, n: int) -> None:
        """Forget a request's samples without an output (its caller is gone)."""
        self.states.pop(request_id, None)
        for i in range(1, n):
            self.states.pop((request_id, i), None)

    def process(self, outputs: list[CoreOutput]) -> tuple[list[RequestOutput], list]:
        """The RequestOutputs for one core report, and the keys of samples a stop string ended (the caller
        finishes them in the core)."""
        results, stopped, states = [], [], self.states
        now = time.monotonic()
        for co in outputs:
            key = co.request_id if co.index == 0 else (co.request_id, co.index)
            state = states.get(key)
            if state is None:
                continue  # ended here already (a stop string, an abort): the core's late news is dropped
            finish = co.finish_reason
            if co.prompt_logprobs is not None:
                state.prompt_logprobs = co.prompt_logprobs
            if co.first_scheduled_time is not None:  # the first report
                state.num_cached_tokens = co.num_cached_tokens
                state.first_scheduled_time, state.first_token_time = co.first_scheduled_time, co.first_token_time
            if self._append(state, co):
                if finish is None:
                    stopped.append(key)
                finish = "stop"
            if finish is not None:
                del states[key]
                state.finished = True
            elif not state.stream:
                continue
            results.append(self._output(state, co, finish, now))
        return results, stopped

    def _append(self, state: RequestState, co: CoreOutput) -> bool:
        """Add the new tokens' text; True when a stop string completed (later tokens are dropped)."""
        ids, detok, new = state.token_ids, state.detok, co.new_token_ids
        last = len(new) - 1 if co.stop_token else len(new)  # an EOS / stop token id adds no text
        stopped = False
        if not state.params.stop_strings:  # nothing to look for: every token's text at once
            ids.extend(new)
            detok.extend(new[:last] if last < len(new) else new)
        else:
            min_tokens = state.params.min_tokens
            for i, token in enumerate(new):
                ids.append(token)
                if i < last and detok.add(token, check_stops=not min_tokens or len(ids) >= min_tokens):
                    del new[i + 1:]  # (the list is this report's own)
                    if co.new_logprobs is not None:
                        del co.new_logprobs[i + 1:]
                    stopped = True
                    break
        if state.logprobs is not None and co.new_logprobs:
            state.logprobs += co.new_logprobs
        return stopped

    @staticmethod
    def _output(state: RequestState, co: CoreOutput, finish: str | None, now: float) -> RequestOutput:
        finished = finish is not None
        detok = state.detok
        delta_text = detok.take_delta(finished)
        n = len(state.token_ids)
        prompt_logprobs, state.prompt_logprobs = state.prompt_logprobs, None
        snap = _Snapshot(state, n, detok.num_chars if finished else detok._fixed_len)
        # Positional, in RequestOutput.__init__'s order: matching 22 keywords is a large part of this call, which
        # every streamed output pays (bench/README.md, "A streamed output, cheaper on both sides").
        return RequestOutput(
            state.request_id, state.prompt, state.prompt_token_ids, snap, snap, finished, finish,
            snap if state.logprobs is not None else None, co.new_token_ids, delta_text, co.new_logprobs,
            state.num_cached_tokens, state.arrival_time, state.first_scheduled_time, state.first_token_time,
            now if finished else None, now, co.error, prompt_logprobs, state.index, n, co.rejected)
