"""Incremental detokenization with stop strings.

Emits what tokenizers' DecodeStream would (and uses one where the decoder is not byte level): tokens are
buffered until they form whole UTF-8 characters, so a streamed chunk never ends in half a character. Stop
strings may span tokens: the text is searched from a little before each new piece, and while stop strings are
set the last `len(longest) - 1` characters are held back from the stream until it is known they do not start a
stop string. With more than a few stop strings the window is searched for all of them at once by an
Aho-Corasick automaton (pyahocorasick; built once per stop list, where the request is made), so a token costs time
in the window's length, not in the number of stop strings: a request with tens of thousands of them no longer
slows every step of its batch (docs/engine.md#structured-output-and-detokenization).

Fast path (byte-level BPE tokenizers, GPT-2 / Qwen / Llama-3 style): their decoder only concatenates each
token's bytes, so a token whose bytes are whole UTF-8 characters adds exactly its own text, whatever came
before. Those texts are decoded once per tokenizer (`token_texts`, one batched Rust call), and a commit
takes a token's text from that table instead of a DecodeStream step (a lookup instead of a call into the
tokenizer, on the engine thread, at every commit of every row). A token that does not decode on its own (part
of a character) adds its raw bytes (read once off its vocabulary string through GPT-2's byte map, gguf's copy
of it) to a pending run, which Python's UTF-8 codec decodes; the run's text goes out once it no longer ends in
U+FFFD, DecodeStream's own rule, so every token adds the text a DecodeStream would. A report of many tokens is
its tokens' bytes (a second table: every token's, whole or not) joined and decoded at once, one C-level join
and one UTF-8 decode instead of a Python step per token (bench/bench_detok.py measures both against
DecodeStream). Other decoders
(SentencePiece's Metaspace: a piece's leading space depends on its position) always use the stream.
"""

from __future__ import annotations

import functools
import json

import ahocorasick
from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from engine.sampling_params import SamplingParams

_PROMPT_CONTEXT = 4  # prompt tokens primed into the stream so the first output piece decodes in context
_BACKTRACK = 8  # tokens extend() looks back for the last whole character before going token by token
AHO_MIN_STOPS = 8  # from this many stop strings on, one automaton instead of a find() per string
_TABLES: dict[tuple[int, bool], tuple[Tokenizer, tuple[list[str | None], dict[int, bytes]] | None]] = {}


def token_texts(tokenizer: Tokenizer, skip_special_tokens: bool) -> list[str | None] | None:
    """Each token id's text when it decodes on its own (None where it does not), or None when the
    tokenizer's decoder is not byte-level concatenation. Built once per tokenizer and setting."""
    tables = _byte_level_tables(tokenizer, skip_special_tokens)
    return None if tables is None else tables[0]


def _byte_level_tables(tokenizer: Tokenizer, skip_special_tokens: bool):
    """(token_texts, every token's raw bytes), or None where the decoder is not byte-level or a token's bytes
    cannot be read off its vocabulary string (then every token uses the stream)."""
    key = (id(tokenizer), skip_special_tokens)
    cached = _TABLES.get(key)
    if cached is None or cached[0] is not tokenizer:
        tables = None
        if _concatenating_decoder(tokenizer):
            n = tokenizer.get_vocab_size(with_added_tokens=True)
            texts = tokenizer.decode_batch([[t] for t in range(n)], skip_special_tokens=skip_special_tokens)
            table = [None if "\ufffd" in t else t for t in texts]
            partial = _partial_bytes(tokenizer, table)
            # A whole token's bytes are its text's; a part of a character's, its vocabulary string's through the map
            tables = None if partial is None else (table, [partial[t] if text is None else text.encode()
                                                           for t, text in enumerate(table)])
        cached = _TABLES[key] = (tokenizer, tables)
    return cached[1]


def _partial_bytes(tokenizer: Tokenizer, texts: list[str | None]) -> dict[int, bytes] | None:
    """The raw bytes of every token whose text is None (part of a character), read off its vocabulary string
    through the byte map; None when one cannot be, or when the map does not give the whole-character tokens'
    own texts (then the decoder is not GPT-2's byte level after all)."""
    from gguf import bytes_to_unicode  # GPT-2's byte map (tokenizers does not expose it), read only here

    to_byte = {c: b for b, c in bytes_to_unicode().items()}

    def raw(t: int) -> bytes | None:
        piece = tokenizer.id_to_token(t)
        if piece is None or any(c not in to_byte for c in piece):
            return None
        return bytes(to_byte[c] for c in piece)

    checked = 0
    for t, text in enumerate(texts):
        if checked == 256:
            break
        mapped = raw(t) if text else None  # (an added token's string is not byte-mapped: None)
        if mapped is not None:
            if mapped != text.encode():
                return None
            checked += 1
    partial = {t: raw(t) for t, text in enumerate(texts) if text is None}
    return None if None in partial.values() else partial


def _concatenating_decoder(tokenizer: Tokenizer) -> bool:
    decoder = json.loads(tokenizer.to_str()).get("decoder") or {}
    parts = decoder.get("decoders", [decoder]) if decoder.get("type") == "Sequence" else [decoder]
    return bool(parts) and all(p.get("type") == "ByteLevel" for p in parts)


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], params: SamplingParams):
        self._skip_special = params.skip_special_tokens
        tables = _byte_level_tables(tokenizer, params.skip_special_tokens)
        self._texts, self._bytes = tables if tables is not None else (None, None)
        self._in_char = False  # bytes of an unfinished character are waiting (_pending, or the stream's)
        self._pending = b""  # byte level: the raw bytes of a character not yet whole
        self._stream = None
        if self._texts is None:  # the stream, primed with the prompt's last tokens so the output decodes in context
            context = prompt_token_ids[-_PROMPT_CONTEXT:]
            # A prompt (given as token ids) may end inside a UTF-8 character: its text then ends in U+FFFD, and
            # once output bytes follow, the stream's prefix no longer lines up with the text, so prompt text
            # would leak into the output. Prime only up to the last whole character.
            while context and tokenizer.decode(context, skip_special_tokens=self._skip_special).endswith("\ufffd"):
                context = context[:-1]
            self._stream = DecodeStream(ids=context, skip_special_tokens=self._skip_special)
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
                piece = self._bytes_step(token_id)
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
        one decode of the report's joined bytes (and of the bytes still pending from the last report); where
        those end inside a character, _extend_bytes."""
        texts = self._texts
        if texts is None or self._stops:
            for t in token_ids:
                self.add(t)
            return
        size = len(texts)
        if len(token_ids) == 1:  # a streamed report's usual one token: no lists built
            t = token_ids[0]
            piece = texts[t] if t < size and not self._in_char else None
            if piece is None:  # part of a character, or one pending: its bytes (add)
                self.add(t)
            elif piece:  # (inline: every streamed token of every row passes here)
                self._parts.append(piece)
                self._fixed_len += len(piece)
            return
        raw = self._bytes
        try:
            data = self._pending + b"".join(map(raw.__getitem__, token_ids))
        except IndexError:  # an id past the tokenizer's vocabulary (the model's may be larger): it adds no bytes
            data = self._pending + b"".join([raw[t] if t < size else b"" for t in token_ids])
        text = data.decode("utf-8", "replace")
        if text[-1:] != "\ufffd":  # the usual case: the report ends on a whole character (add()'s rule)
            self._pending, self._in_char = b"", False
            self._append_text(text)
        else:
            self._extend_bytes(token_ids, data)

    def _extend_bytes(self, token_ids: list[int], data: bytes) -> None:
        """A report whose bytes (`data`, the pending bytes and its tokens') end inside a character: decoded at
        once up to the last token after which the text ends on a whole character (add()'s rule: not in U+FFFD),
        and the few tokens after it through add(). add() cuts its runs only where the decoder is between
        characters, so decoding them apart or together gives the same text."""
        raw, size, n = self._bytes, len(self._bytes), len(token_ids)
        end = len(data)  # where token k's bytes end, walking back from the last token
        for k in range(n - 1, max(0, n - _BACKTRACK), -1):  # a character is at most 4 bytes: a few tokens back
            t = token_ids[k]
            end -= len(raw[t]) if t < size else 0
            text = data[:end].decode("utf-8", "replace")
            if text and text[-1] != "\ufffd":
                self._pending, self._in_char = b"", False
                self._append_text(text)
                token_ids = token_ids[k:]
                break
        for t in token_ids:  # after the last whole character, or all of them (bytes that never make one)
            self.add(t)

    def _append_text(self, text: str) -> None:
        if text:
            self._parts.append(text)
            self._fixed_len += len(text)

    def _bytes_step(self, token_id: int) -> str | None:
        """A token that does not decode on its own, or any token while such a token's character is unfinished:
        its bytes join the pending run, whose text is emitted once it no longer ends in U+FFFD (a whole
        character, or bytes that can never become one: DecodeStream's rule). An id past the vocabulary adds no
        bytes (the tokenizer drops it)."""
        self._pending += self._bytes[token_id] if token_id < len(self._bytes) else b""
        piece = self._pending.decode("utf-8", "replace")
        if piece and piece[-1] != "\ufffd":
            self._pending, self._in_char = b"", False
            return piece
        self._in_char = True
        return None

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
