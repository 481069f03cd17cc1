"""Incremental detokenization with stop strings.

Built on tokenizers' DecodeStream, which buffers tokens until they form whole UTF-8 characters, so a
streamed chunk never ends in half a character. Stop strings may span tokens: the text is searched from a
little before each new piece, and while stop strings are set the last `len(longest) - 1` characters are
held back from the stream until it is known they do not start a stop string. With more than a few stop
strings the window is searched for all of them at once by an Aho-Corasick automaton (pyahocorasick; built
once per stop list, where the request is made), so a token costs time in the window's length, not in the
number of stop strings: a request with tens of thousands of them no longer slows every step of its batch
(docs/engine.md#structured-output-and-detokenization).

Fast path (byte-level BPE tokenizers, GPT-2 / Qwen / Llama-3 style): their decoder only concatenates each
token's bytes, so a token whose bytes are whole UTF-8 characters adds exactly its own text, whatever came
before. Those texts are decoded once per tokenizer (`token_texts`, one batched Rust call), and a commit
takes a token's text from that table instead of a DecodeStream step (a lookup instead of a call into the
tokenizer, on the engine thread, at every commit of every row). Tokens that do not decode on their own (part
of a character, ids past the vocabulary) go through a DecodeStream primed with the last whole-character
context, until the stream has emitted their text. Other decoders (SentencePiece's Metaspace: a piece's
leading space depends on its position) always use the stream.
"""

from __future__ import annotations

import bisect
import functools
import json
from collections import deque

import ahocorasick
from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from engine.sampling_params import SamplingParams

_PROMPT_CONTEXT = 4  # prompt tokens primed into the stream so the first output piece decodes in context
AHO_MIN_STOPS = 8  # from this many stop strings on, one automaton instead of a find() per string
_TABLES: dict[tuple[int, bool], tuple[Tokenizer, list[str | None] | None]] = {}


def token_texts(tokenizer: Tokenizer, skip_special_tokens: bool) -> list[str | None] | None:
    """Each token id's text when it decodes on its own (None where it does not), or None when the
    tokenizer's decoder is not byte-level concatenation. Built once per tokenizer and setting."""
    key = (id(tokenizer), skip_special_tokens)
    cached = _TABLES.get(key)
    if cached is None or cached[0] is not tokenizer:
        table = None
        if _concatenating_decoder(tokenizer):
            n = tokenizer.get_vocab_size(with_added_tokens=True)
            texts = tokenizer.decode_batch([[t] for t in range(n)], skip_special_tokens=skip_special_tokens)
            table = [None if "\ufffd" in t else t for t in texts]
        cached = _TABLES[key] = (tokenizer, table)
    return cached[1]


def _concatenating_decoder(tokenizer: Tokenizer) -> bool:
    decoder = json.loads(tokenizer.to_str()).get("decoder") or {}
    parts = decoder.get("decoders", [decoder]) if decoder.get("type") == "Sequence" else [decoder]
    return bool(parts) and all(p.get("type") == "ByteLevel" for p in parts)


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], params: SamplingParams):
        context = prompt_token_ids[-_PROMPT_CONTEXT:]
        # A prompt (given as token ids) may end inside a UTF-8 character: its text then ends in U+FFFD, and
        # once output bytes follow, the stream's prefix no longer lines up with the text, so prompt text
        # would leak into the output. Prime only up to the last whole character.
        while context and tokenizer.decode(context, skip_special_tokens=params.skip_special_tokens).endswith(
                "\ufffd"):
            context = context[:-1]
        self._skip_special = params.skip_special_tokens
        self._texts = token_texts(tokenizer, params.skip_special_tokens)
        self._context = deque(context, maxlen=_PROMPT_CONTEXT)  # the last tokens, ending at a whole character
        self._stream = None if self._texts is not None else DecodeStream(ids=context,
                                                                          skip_special_tokens=self._skip_special)
        self._in_char = False  # the stream holds bytes of an unfinished character
        self._tokenizer = tokenizer
        self._stops = params.stop_strings
        self._matcher = stop_matcher(self._stops) if len(self._stops) >= AHO_MIN_STOPS else None
        self._include_stop = params.include_stop_str_in_output
        self._hold = max((len(s) for s in self._stops), default=1) - 1
        # The text is the fixed pieces no stop string can cut any more, plus a tail of at most `_hold` (plus
        # the newest piece's) characters a stop string may still end in: a token costs its piece and the
        # hold, never the length of the text so far (a 16k-token output costs the same per token at its end
        # as at its start). `text` joins them on demand.
        self._parts: list[str] = []
        self._tail = ""
        self._fixed_len = 0
        self._sent = 0  # _parts already handed out by take_delta
        self._joined = ("", 0)  # "".join(_parts[:n]) and n, kept for repeated `text` reads

    @property
    def text(self) -> str:
        """The output text so far (stop string cut off, unless include_stop_str_in_output)."""
        joined, n = self._joined
        if n != len(self._parts):
            joined = joined + "".join(self._parts[n:])
            self._joined = (joined, len(self._parts))
        return joined + self._tail

    def text_upto(self, n_chars: int) -> str:
        """The first n_chars characters of the text (a snapshot of an earlier, shorter output)."""
        return self.text[:n_chars]

    @property
    def num_chars(self) -> int:
        return self._fixed_len + len(self._tail)

    def add(self, token_id: int, check_stops: bool = True) -> bool:
        """Append one token; True when a stop string completed (the text is then cut at it).

        check_stops=False (before min_tokens is reached) appends without looking for stop strings."""
        texts = self._texts
        if texts is None:
            piece = self._stream.step(self._tokenizer, token_id)
        else:
            piece = texts[token_id] if not self._in_char and token_id < len(texts) else None
            if piece is None:
                piece = self._stream_step(token_id)
            self._context.append(token_id)
        if not piece:
            return False
        if not self._stops:  # most requests: nothing to search, nothing held back
            self._parts.append(piece)
            self._fixed_len += len(piece)
            return False
        search_from = max(0, len(self._tail) - self._hold)  # the tail always holds the last _hold chars
        self._tail += piece
        if check_stops and self._cut_at_stop(search_from):
            return True
        if len(self._tail) > self._hold:  # what a later stop string can no longer reach becomes fixed
            cut = len(self._tail) - self._hold
            self._parts.append(self._tail[:cut])
            self._fixed_len += cut
            self._tail = self._tail[cut:]
        return False

    def extend(self, token_ids: list[int]) -> None:
        """Append tokens of a request without stop strings: the text add() would build one token at a time, as
        one join over the decoded-text table for each run of tokens that decode on their own; only a token that
        does not (part of a character) and those finishing its character go through add()."""
        texts = self._texts
        if texts is None or self._stops:
            for t in token_ids:
                self.add(t)
            return
        size, n = len(texts), len(token_ids)
        if n == 1 and not self._in_char:  # a streamed report's usual one token: no lists built
            t = token_ids[0]
            piece = texts[t] if t < size else None
            if piece is not None:
                self._context.append(t)
                if piece:
                    self._parts.append(piece)
                    self._fixed_len += len(piece)
                return
        pieces = [texts[t] if t < size else None for t in token_ids]
        if not self._in_char and None not in pieces:  # the usual case: every token decodes on its own
            self._join(token_ids, pieces, 0, n)
            return
        nones = [k for k, piece in enumerate(pieces) if piece is None] + [n]
        i = 0
        while i < n:
            while self._in_char and i < n:  # a character still being finished: through the stream
                self.add(token_ids[i])
                i += 1
            if i == n:
                break
            j = nones[bisect.bisect_left(nones, i)]  # the next token that does not decode on its own
            self._join(token_ids, pieces, i, j)
            if j < n:
                self.add(token_ids[j])
            i = j + 1

    def _join(self, token_ids: list[int], pieces: list[str], i: int, j: int) -> None:
        """Append tokens i..j-1, each of which decodes on its own, as one piece of text."""
        if j > i:
            text = "".join(pieces[i:j])
            self._context.extend(token_ids[max(i, j - _PROMPT_CONTEXT):j])
            if text:
                self._parts.append(text)
                self._fixed_len += len(text)

    def _stream_step(self, token_id: int) -> str | None:
        """A token that does not decode on its own: through a DecodeStream primed with the whole-character
        context before it, kept until the stream emits (the character is complete)."""
        if not self._in_char:
            self._stream = DecodeStream(ids=list(self._context), skip_special_tokens=self._skip_special)
        piece = self._stream.step(self._tokenizer, token_id)
        self._in_char = piece is None
        return piece

    def _cut_at_stop(self, search_from: int) -> bool:
        found = find_stop(self._tail, search_from, self._stops, self._matcher)
        if found is None:
            return False
        start, length = found
        self._tail = self._tail[: start + length] if self._include_stop else self._tail[:start]
        return True

    def take_delta(self, finished: bool) -> str:
        """The text not yet streamed, minus the tail that might still turn into a stop string (all of it
        once finished)."""
        if finished and self._tail:
            self._parts.append(self._tail)
            self._fixed_len += len(self._tail)
            self._tail = ""
        parts, sent = self._parts, self._sent
        if sent == len(parts):
            return ""
        self._sent = len(parts)
        return parts[sent] if sent + 1 == len(parts) else "".join(parts[sent:])


@functools.lru_cache(maxsize=64)
def stop_matcher(stops: tuple[str, ...]) -> ahocorasick.Automaton:
    """An automaton finding every stop string at once; each word carries (its first index, its length)."""
    automaton = ahocorasick.Automaton()
    for i, stop in enumerate(stops):
        if not automaton.exists(stop):
            automaton.add_word(stop, (i, len(stop)))
    automaton.make_automaton()
    return automaton


def find_stop(text: str, search_from: int, stops: tuple[str, ...],
              matcher: ahocorasick.Automaton | None = None) -> tuple[int, int] | None:
    """(start, length) of the stop string occurring earliest in text[search_from:] (ties: the one listed
    first), or None. With a matcher, one pass over the window whatever the number of stop strings."""
    best: tuple[int, int, int] | None = None  # (start, list index, length)
    if matcher is not None:
        for end, (i, n) in matcher.iter(text, search_from):
            found = (end - n + 1, i, n)
            if best is None or found < best:
                best = found
    else:
        for i, stop in enumerate(stops):
            at = text.find(stop, search_from)
            if at != -1 and (best is None or (at, i) < best[:2]):
                best = (at, i, len(stop))
    return None if best is None else (best[0], best[2])
