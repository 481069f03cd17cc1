"""Incremental detokenization with stop strings.

Built on tokenizers' DecodeStream, which buffers tokens until they form whole UTF-8 characters, so a
streamed chunk never ends in half a character. Stop strings may span tokens: the text is searched from a
little before each new piece, and while stop strings are set the last `len(longest) - 1` characters are
held back from the stream until it is known they do not start a stop string.
"""

from __future__ import annotations

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from engine.sampling_params import SamplingParams

_PROMPT_CONTEXT = 4  # prompt tokens primed into the stream so the first output piece decodes in context


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], params: SamplingParams):
        context = prompt_token_ids[-_PROMPT_CONTEXT:]
        # A prompt (given as token ids) may end inside a UTF-8 character: its text then ends in U+FFFD, and
        # once output bytes follow, the stream's prefix no longer lines up with the text, so prompt text
        # would leak into the output. Prime only up to the last whole character.
        while context and tokenizer.decode(context, skip_special_tokens=params.skip_special_tokens).endswith(
                "\ufffd"):
            context = context[:-1]
        self._stream = DecodeStream(ids=context, skip_special_tokens=params.skip_special_tokens)
        self._tokenizer = tokenizer
        self._stops = params.stop_strings
        self._include_stop = params.include_stop_str_in_output
        self._hold = max((len(s) for s in self._stops), default=1) - 1
        self.text = ""
        self._emitted = 0

    def add(self, token_id: int, check_stops: bool = True) -> bool:
        """Append one token; True when a stop string completed (the text is then cut at it).

        check_stops=False (before min_tokens is reached) appends without looking for stop strings."""
        piece = self._stream.step(self._tokenizer, token_id)
        if not piece:
            return False
        if not self._stops:  # most requests: nothing to search
            self.text += piece
            return False
        search_from = max(0, len(self.text) - self._hold)
        self.text += piece
        return check_stops and self._cut_at_stop(search_from)

    def _cut_at_stop(self, search_from: int) -> bool:
        best, best_len = -1, 0
        for stop in self._stops:
            i = self.text.find(stop, search_from)
            if i != -1 and (best == -1 or i < best):
                best, best_len = i, len(stop)
        if best == -1:
            return False
        self.text = self.text[: best + best_len] if self._include_stop else self.text[:best]
        return True

    def take_delta(self, finished: bool) -> str:
        """The text not yet streamed, minus the tail that might still turn into a stop string."""
        end = len(self.text) if finished else max(self._emitted, len(self.text) - self._hold)
        delta = self.text[self._emitted:end]
        self._emitted = end
        return delta
