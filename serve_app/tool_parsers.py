"""Tool-call parsers: a model's text output -> OpenAI `tool_calls`, whole or streamed.

One JSON scanner serves every format: it walks a call object key by key with the standard library's
`json.JSONDecoder.raw_decode` and reports the call's name and the exact text span of its arguments object.
A call's `function.arguments` is that raw span (valid JSON, as the model wrote it), so the streamed pieces of
a call — successive prefixes of the same span — concatenate to exactly what the non-streamed response holds,
whatever the token boundaries. Formats:

- `hermes` (Qwen2.5 / Qwen3 / Hermes templates): `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`,
  one block per call; the text before the first block is the content.
- `llama3_json` (Llama 3.1-3.3): `{"name": ..., "parameters": {...}}`, optionally after `<|python_tag|>`,
  several separated by `;`; an output that does not start with a call is plain content.
- `mistral`: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`; the text before the tag is the content.
  `[TOOL_CALLS]` is a special token, so requests with tools on this parser keep special tokens in the text.

Output that looks like a call but is not valid JSON is returned as content (never an error). While streaming,
text that could still turn out to start a call (a partial `<tool_call>`) is held back until it is decided.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field

_DECODER = json.JSONDecoder()
_WS = " \t\n\r"


def new_call_id() -> str:
    """OpenAI / vLLM style tool call id."""
    return "call_" + secrets.token_hex(12)


@dataclass
class ToolCall:
    name: str
    arguments: str  # the arguments object as JSON text
    id: str = field(default_factory=new_call_id)

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class PartialCall:
    """What is known of one call so far: its name once complete, its arguments text (a prefix while open)."""

    name: str | None = None
    arguments: str = ""
    complete: bool = False


# ---- the JSON scanner -----------------------------------------------------------------------------------------
def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


def scan_call(text: str, i: int, args_keys: tuple[str, ...]) -> tuple[PartialCall, int | None]:
    """Scan the call object starting at text[i] ("{"). Returns what is known and the index after the object
    (None while it is incomplete or invalid). Arguments must be an object; their text is the raw span."""
    call = PartialCall()
    if i >= len(text) or text[i] != "{":
        return call, None
    i = _skip_ws(text, i + 1)
    while i < len(text):
        if text[i] == "}":
            call.complete = call.name is not None and bool(call.arguments)
            return call, (i + 1 if call.complete else None)
        try:
            key, j = _DECODER.raw_decode(text, i)
        except ValueError:
            return call, None
        j = _skip_ws(text, j)
        if j >= len(text) or text[j] != ":" or not isinstance(key, str):
            return call, None
        j = _skip_ws(text, j + 1)
        if j >= len(text):
            return call, None
        try:
            value, end = _DECODER.raw_decode(text, j)
        except ValueError:  # incomplete (or invalid): an arguments object is streamed as its prefix so far
            if key in args_keys and text[j] == "{":
                call.arguments = text[j:]
            return call, None
        if key == "name" and isinstance(value, str):
            call.name = value
        elif key in args_keys:
            if not isinstance(value, dict):
                return call, None
            call.arguments = text[j:end]
        i = _skip_ws(text, end)
        if i < len(text) and text[i] == ",":
            i = _skip_ws(text, i + 1)
    return call, None


def _scan_sequence(text: str, i: int, args_keys: tuple[str, ...], sep: str,
                   close: str | None) -> tuple[list[PartialCall], bool]:
    """Calls `{...}<sep>{...}` from text[i], up to `close` (None: the end). Returns the calls seen and whether
    the whole sequence is valid and finished."""
    calls: list[PartialCall] = []
    i = _skip_ws(text, i)
    while i < len(text):
        call, end = scan_call(text, i, args_keys)
        calls.append(call)
        if end is None:
            return calls, False
        i = _skip_ws(text, end)
        if i < len(text) and text[i] == sep:
            i = _skip_ws(text, i + 1)
            continue
        if close is not None:
            return calls, i < len(text) and text[i] == close and not text[i + 1:].strip()
        return calls, i == len(text)
    return calls, False


def _held_prefix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag` (held back while streaming)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


# ---- parsers --------------------------------------------------------------------------------------------------
class ToolParser:
    """`extract` gives the final (content, calls) of a whole output; `partial` what is certain of a prefix
    (content safe to send, calls so far). `partial(text)` content and arguments are prefixes of `extract`'s
    for every prefix of a well-formed output."""

    name = ""
    keep_special_tokens = False  # the format's markers are special tokens (skip_special_tokens=False)
    # The marker that starts the calls after the content (None: the format has no content before its calls).
    # Until it appears, `partial` gives the text less a held prefix of the marker and trailing space, as content.
    content_marker: str | None = None

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        content, calls, valid = self._parse(text, final=True)
        if not valid or not calls:
            return text, []
        return content, [ToolCall(c.name, c.arguments) for c in calls]

    def partial(self, text: str) -> tuple[str, list[PartialCall]]:
        content, calls, _ = self._parse(text, final=False)
        return content or "", calls

    def plain(self, text: str) -> bool:
        """Whether `text`, a prefix of the output, already decides that the whole output is content (no call
        can follow, and `partial` of any longer output gives it whole as content)."""
        return False

    def _parse(self, text: str, final: bool) -> tuple[str | None, list[PartialCall], bool]:
        raise NotImplementedError


def _content(prefix: str) -> str | None:
    return prefix.rstrip() or None


class HermesParser(ToolParser):
    name = "hermes"
    START, END = "<tool_call>", "</tool_call>"
    content_marker = START

    def _parse(self, text, final):
        start = text.find(self.START)
        if start < 0:
            held = 0 if final else _held_prefix(text, self.START)
            return (text if final else _content(text[:len(text) - held])), [], False
        calls, valid, i = [], True, start
        while i >= 0:
            body = i + len(self.START)
            stop = text.find(self.END, body)
            segment = text[body:] if stop < 0 else text[body:stop]
            seq, ok = _scan_sequence(segment, 0, ("arguments",), sep="\0", close=None)
            calls += seq
            valid = valid and ok and len(seq) == 1
            i = -1 if stop < 0 else text.find(self.START, stop)
        return _content(text[:start]), calls, valid


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    TAG = "<|python_tag|>"

    def plain(self, text):
        i = _skip_ws(text, 0)  # decided by the first character that is not space: not "{" and no tag (prefix)
        return i < len(text) and text[i] != "{" and not text.startswith(self.TAG, i) and \
            not self.TAG.startswith(text[i:i + len(self.TAG)])

    def _parse(self, text, final):
        i = _skip_ws(text, 0)
        if text.startswith(self.TAG, i):
            i = _skip_ws(text, i + len(self.TAG))
        elif not final and self.TAG.startswith(text[i:]):
            return None, [], False  # undecided: nothing to send yet
        if i < len(text) and text[i] != "{":
            return text, [], False
        calls, valid = _scan_sequence(text, i, ("parameters", "arguments"), sep=";", close=None)
        return None, calls, valid


class MistralParser(ToolParser):
    name = "mistral"
    keep_special_tokens = True
    TAG = "[TOOL_CALLS]"
    content_marker = TAG

    def _parse(self, text, final):
        start = text.find(self.TAG)
        if start < 0:
            held = 0 if final else _held_prefix(text, self.TAG)
            return (text if final else _content(text[:len(text) - held])), [], False
        i = _skip_ws(text, start + len(self.TAG))
        if i >= len(text) or text[i] != "[":
            return _content(text[:start]), [], False
        calls, valid = _scan_sequence(text, i + 1, ("arguments",), sep=",", close="]")
        return _content(text[:start]), calls, valid


class RequiredParser(ToolParser):
    """tool_choice "required": the constrained output is a JSON array of {"name", "parameters"} objects."""

    name = "required"

    def _parse(self, text, final):
        i = _skip_ws(text, 0)
        if i >= len(text) or text[i] != "[":
            return None, [], False
        calls, valid = _scan_sequence(text, i + 1, ("parameters",), sep=",", close="]")
        return None, calls, valid


class NamedParser(ToolParser):
    """A named tool_choice: the constrained output is the arguments object of that one function."""

    def __init__(self, function: str):
        self.function = function

    def _parse(self, text, final):
        stripped = text.strip()
        try:
            valid = isinstance(json.loads(stripped), dict)
        except ValueError:
            valid = False
        return None, [PartialCall(self.function, stripped, valid)], valid


TOOL_PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (HermesParser, Llama3JsonParser, MistralParser)}


def get_tool_parser(name: str) -> ToolParser:
    """The parser registered under `name`; ValueError listing the valid names otherwise."""
    if name not in TOOL_PARSERS:
        raise ValueError(f"tool_parser {name!r} is not known; valid: {sorted(TOOL_PARSERS)}")
    return TOOL_PARSERS[name]()


# ---- streaming ------------------------------------------------------------------------------------------------
class ToolStreamer:
    """Turns successive output text deltas into OpenAI chat deltas: content until a call starts, then
    `tool_calls` deltas (a call's first one carries index, id, type, name and arguments ""; later ones
    argument pieces). `finish()` sends what the final parse adds (held-back text, a call's last piece).

    Each delta costs O(its length) while the output is content: a parser with a `content_marker` (hermes,
    mistral) is not asked to parse the whole text again until the marker appears, since only the text not sent
    yet can hold it (what was sent was never a prefix of the marker); once `plain()` says no call can follow
    (llama3_json), a delta is content as it is. Parsing the whole text at every delta made a long answer with
    tools on cost the ingress's event loop O(n^2) (bench/README.md measures both). Once a call has started,
    each delta parses the whole text (the calls are short)."""

    def __init__(self, parser: ToolParser):
        self.parser = parser
        self._pieces: list[str] = []  # the text so far, joined when a parse needs it whole
        self._sent_pieces: list[str] = []  # the content sent so far
        self._unsent = ""  # content phase: the text after the content sent (trailing space, a held marker prefix)
        self._content_phase = parser.content_marker is not None
        self._plain = False  # the whole output is content: every delta goes out as it is
        self.sent: list[tuple[str, str]] = []  # per announced call: (id, arguments sent)

    @property
    def made_calls(self) -> bool:
        return bool(self.sent)

    @property
    def text(self) -> str:
        return joined(self._pieces)

    def feed(self, delta: str) -> list[dict]:
        self._pieces.append(delta)
        if self._plain:
            if not delta:
                return []
            self._sent_pieces.append(delta)
            return [{"content": delta}]
        if self._content_phase:
            marker, unsent = self.parser.content_marker, self._unsent + delta
            if marker not in unsent:  # the content before a possible marker prefix, less trailing space
                content = unsent[:len(unsent) - _held_prefix(unsent, marker)].rstrip()
                self._unsent = unsent[len(content):]
                if not content:
                    return []
                self._sent_pieces.append(content)
                return [{"content": content}]
            self._content_phase = False  # a call starts: from here on the whole text is parsed
        text = self.text
        content, calls = self.parser.partial(text)
        deltas = self._diff(content, [(c.name, c.arguments) for c in calls])
        if not self.sent and self.parser.plain(text):
            self._plain = True  # (the diff just sent the whole text as content)
        return deltas

    def finish(self) -> list[dict]:
        content, calls = self.parser.extract(self.text)
        return self._diff(content or "", [(c.name, c.arguments) for c in calls], ids=[c.id for c in calls])

    def _diff(self, content: str, calls: list[tuple[str | None, str]], ids: list[str] | None = None) -> list[dict]:
        deltas: list[dict] = []
        sent_content = joined(self._sent_pieces)
        if not self.sent and content.startswith(sent_content) and len(content) > len(sent_content):
            deltas.append({"content": content[len(sent_content):]})
            self._sent_pieces[:] = [content]
        for index, (name, args) in enumerate(calls):
            if name is None:
                break
            if index == len(self.sent):
                call_id = ids[index] if ids else new_call_id()
                self.sent.append((call_id, ""))
                deltas.append({"tool_calls": [{"index": index, "id": call_id, "type": "function",
                                               "function": {"name": name, "arguments": ""}}]})
            call_id, sent_args = self.sent[index]
            if args.startswith(sent_args) and len(args) > len(sent_args):
                deltas.append({"tool_calls": [{"index": index, "function": {"arguments": args[len(sent_args):]}}]})
                self.sent[index] = (call_id, args)
        return deltas


def joined(pieces: list[str]) -> str:
    """The pieces' concatenation, kept as the list's one piece (later calls join only what was added since)."""
    if len(pieces) > 1:
        pieces[:] = ["".join(pieces)]
    return pieces[0] if pieces else ""
