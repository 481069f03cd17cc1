"""Tool-call parsers on text in the formats real models write (their chat templates / model cards), whole and
streamed: streamed at every split point (and random multi-way splits), the content and each call's argument
pieces must reassemble into exactly what the non-streamed parse gives, and the arguments must be the JSON the
model wrote (json.loads oracle, not the parser)."""

from __future__ import annotations

import json
import random

import pytest

from serve_app.tool_parsers import (HermesParser, Llama3JsonParser, MistralParser, NamedParser, RequiredParser,
                                    ToolStreamer, get_tool_parser)

W = {"location": "San Francisco, CA", "unit": "celsius"}
T = {"timezone": "Europe/Oslo"}
# Qwen2.5's template: "<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>"
HERMES_ONE = '<tool_call>\n{"name": "get_weather", "arguments": ' + json.dumps(W) + '}\n</tool_call>'
HERMES_TWO = HERMES_ONE + '\n<tool_call>\n{"name": "get_time", "arguments": ' + json.dumps(T) + '}\n</tool_call>'
HERMES_CONTENT = "Let me check that for you.\n" + HERMES_ONE
# Llama 3.1 model card: {"name": function name, "parameters": dictionary of argument name and its value}
LLAMA_ONE = '{"name": "get_weather", "parameters": ' + json.dumps(W) + '}'
LLAMA_TAG = '<|python_tag|>' + LLAMA_ONE
LLAMA_TWO = LLAMA_ONE + '; {"name": "get_time", "parameters": ' + json.dumps(T) + '}'
# Mistral v3 tokenizer: [TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]
MISTRAL_TWO = ('[TOOL_CALLS] [{"name": "get_weather", "arguments": ' + json.dumps(W) +
               '}, {"name": "get_time", "arguments": ' + json.dumps(T) + '}]')
REQUIRED_TWO = ('[{"name":"get_weather","parameters":' + json.dumps(W, separators=(",", ":")) +
                '},{"name":"get_time","parameters":' + json.dumps(T, separators=(",", ":")) + '}]')

CASES = [  # (parser, text, expected content, expected [(name, args dict)])
    (HermesParser(), HERMES_ONE, None, [("get_weather", W)]),
    (HermesParser(), HERMES_TWO, None, [("get_weather", W), ("get_time", T)]),
    (HermesParser(), HERMES_CONTENT, "Let me check that for you.", [("get_weather", W)]),
    (HermesParser(), "The weather is fine.", "The weather is fine.", []),
    (HermesParser(), "a < b and <tool", "a < b and <tool", []),
    (Llama3JsonParser(), LLAMA_ONE, None, [("get_weather", W)]),
    (Llama3JsonParser(), LLAMA_TAG, None, [("get_weather", W)]),
    (Llama3JsonParser(), LLAMA_TWO, None, [("get_weather", W), ("get_time", T)]),
    (Llama3JsonParser(), "Sure: {not json", "Sure: {not json", []),
    (Llama3JsonParser(), '{"answer": 42}', '{"answer": 42}', []),
    (MistralParser(), MISTRAL_TWO, None, [("get_weather", W), ("get_time", T)]),
    (MistralParser(), "Checking." + MISTRAL_TWO, "Checking.", [("get_weather", W), ("get_time", T)]),
    (MistralParser(), "No tools needed [TOOL", "No tools needed [TOOL", []),
    (RequiredParser(), REQUIRED_TWO, None, [("get_weather", W), ("get_time", T)]),
    (NamedParser("get_weather"), json.dumps(W), None, [("get_weather", W)]),
]
MALFORMED = [
    (HermesParser(), '<tool_call>\n{"name": "get_weather", "arguments": {"location": }\n</tool_call>'),
    (HermesParser(), 'Text <tool_call>\n{"name": "f", "arguments": [1, 2]}\n</tool_call>'),
    (Llama3JsonParser(), '{"name": "get_weather", "parameters": {"a": 1}; {"name": '),
    (MistralParser(), '[TOOL_CALLS] [{"name": "f", "arguments": {"a": 1}'),
    (MistralParser(), '[TOOL_CALLS] [{"name": "f", "arguments": {"a": 1}}] trailing'),
]


def _ids(cases):
    return [f"{p.name or 'named'}-{i}" for i, (p, *_) in enumerate(cases)]


@pytest.mark.parametrize("parser,text,content,calls", CASES, ids=_ids(CASES))
def test_whole_output(parser, text, content, calls):
    got_content, got = parser.extract(text)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got] == calls
    for c in got:
        assert c.id.startswith("call_") and len(c.id) > 10 and c.to_openai()["type"] == "function"
    assert len({c.id for c in got}) == len(got)


@pytest.mark.parametrize("parser,text", MALFORMED, ids=_ids(MALFORMED))
def test_malformed_call_is_content(parser, text):
    assert parser.extract(text) == (text, [])


def stream(parser, pieces: list[str]) -> tuple[str, list[tuple[str, str]], list[dict]]:
    """Feed pieces; reassemble content and calls from the deltas as an OpenAI client would."""
    s = ToolStreamer(parser)
    deltas = [d for piece in pieces for d in s.feed(piece)] + s.finish()
    content, calls = "", {}
    for d in deltas:
        content += d.get("content", "")
        for tc in d.get("tool_calls", []):
            if "id" in tc:
                assert tc["index"] == len(calls) and tc["type"] == "function"
                assert tc["function"]["arguments"] == "" and tc["id"].startswith("call_")
                calls[tc["index"]] = [tc["function"]["name"], ""]
            else:
                calls[tc["index"]][1] += tc["function"]["arguments"]
    return content, [tuple(c) for c in calls.values()], deltas


def _expected(parser, text):
    content, calls = parser.extract(text)
    return content or "", [(c.name, c.arguments) for c in calls]


@pytest.mark.parametrize("parser,text,content,calls", CASES, ids=_ids(CASES))
def test_streamed_equals_whole_at_every_split(parser, text, content, calls):
    expected = _expected(parser, text)
    for i in range(len(text) + 1):
        assert stream(parser, [text[:i], text[i:]])[:2] == expected, i
    assert stream(parser, list(text))[:2] == expected  # one character at a time


@pytest.mark.parametrize("parser,text,content,calls", CASES, ids=_ids(CASES))
def test_streamed_equals_whole_random_splits(parser, text, content, calls):
    rng = random.Random(0)
    expected = _expected(parser, text)
    for _ in range(50):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 8))))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        assert stream(parser, pieces)[:2] == expected, pieces


def test_arguments_arrive_in_pieces_and_content_before_the_call():
    content, calls, deltas = stream(HermesParser(), list(HERMES_CONTENT))
    pieces = [d for d in deltas if "tool_calls" in d and "id" not in d["tool_calls"][0]]
    assert len(pieces) > 5  # streamed as they come, not in one piece at the end
    first_call = next(i for i, d in enumerate(deltas) if "tool_calls" in d)
    assert all("content" in d for d in deltas[:first_call]) and content == "Let me check that for you."
    assert not any("<tool" in d.get("content", "") for d in deltas)


def test_registry_names_the_valid_parsers():
    assert isinstance(get_tool_parser("hermes"), HermesParser)
    with pytest.raises(ValueError, match=r"nope.*hermes.*llama3_json.*mistral"):
        get_tool_parser("nope")


def _long_outputs():
    """Long answers with tools on: content with runs of space and near-markers, and the same followed by calls."""
    rng = random.Random(1)
    words = ["the", "weather", "<tool", "<tool_ca", "[TOOL", "[TOOL_CALLS", "{x}", "<|python", "a<b", "\n\n", "   "]
    body = "".join(rng.choice(words) + rng.choice([" ", "", "\n", "  "]) for _ in range(400))
    return [  # (parser, content only, with calls)
        (HermesParser(), body, body + "\n" + HERMES_ONE),
        (MistralParser(), body, body + " " + MISTRAL_TWO),
        (Llama3JsonParser(), "Sure. " + body, "  " + LLAMA_TWO),
    ]


@pytest.mark.parametrize("parser,content,with_calls", _long_outputs(), ids=["hermes", "mistral", "llama3_json"])
def test_streamed_content_is_the_parse_of_each_prefix_and_each_delta_costs_its_own_length(parser, content,
                                                                                           with_calls):
    """At every delta the content streamed so far is exactly what the parser's stateless parse of that prefix
    gives, and the output reassembles as the whole parse. While the output is content the streamer does not hand
    the parser the whole text again (it did at every delta: O(n^2) characters over a long answer)."""
    for text in (content, with_calls):
        scanned = [0]
        base = type(parser)

        class Counting(base):
            def _parse(self, t, final):
                scanned[0] += len(t)
                return base._parse(self, t, final)

        s = ToolStreamer(Counting())
        rng = random.Random(len(text))
        i, streamed, deltas = 0, "", []
        while i < len(text):
            j = min(len(text), i + rng.randint(1, 4))
            for d in s.feed(text[i:j]):
                streamed += d.get("content", "")
                deltas.append(d)
            i = j
            assert streamed == parser.partial(text[:i])[0], i
        deltas += s.finish()
        whole = _expected(parser, text)
        assert "".join(d.get("content", "") for d in deltas) == whole[0]
        assert [c[0] for c in stream(parser, [text])[1]] == [name for name, _ in whole[1]]
        if text is content:
            assert scanned[0] <= 2 * len(text), (scanned[0], len(text))  # the final parse, and little more
