"""OpenAI response bodies (completions and chat, whole and streamed) built from engine chunks."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

from cluster.protocol import GenerateChunk
from engine.outputs import TokenLogprob
from serve_app.tool_parsers import ToolParser, ToolStreamer, joined
from serve_app.logprobs_format import CompletionLogprobs, prompt_logprobs_json


@dataclass
class Accumulated:
    """Everything a non-streaming response needs, gathered from the chunks."""

    pieces: list[str] = field(default_factory=list)  # the text's, joined when read (O(new text) per chunk)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    prompt_logprobs: list[TokenLogprob | None] | None = None

    def add(self, chunk: GenerateChunk) -> None:
        if chunk.prompt_logprobs is not None:
            self.prompt_logprobs = chunk.prompt_logprobs
        self.pieces.append(chunk.delta_text)
        self.token_ids += chunk.delta_token_ids
        self.logprobs += chunk.delta_logprobs or []
        self.finish_reason = chunk.finish_reason
        self.num_prompt_tokens = chunk.num_prompt_tokens
        self.num_output_tokens = chunk.num_output_tokens

    @property
    def text(self) -> str:
        return joined(self.pieces)


def usage(num_prompt: int, num_output: int) -> dict:
    return {"prompt_tokens": num_prompt, "completion_tokens": num_output, "total_tokens": num_prompt + num_output}


def sse(payload: dict | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


class _Choice:
    """The streaming state of one choice (one of the request's n samples)."""

    __slots__ = ("started", "tools", "logprobs", "num_output_tokens")

    def __init__(self, logprobs: CompletionLogprobs):
        self.started = False  # its first chunk went out (the echoed prompt goes before it)
        self.tools: ToolStreamer | None = None
        self.logprobs = logprobs  # text_offset runs on across its chunks
        self.num_output_tokens = 0


class ResponseBuilder:
    """Shapes one request's responses; `decode` turns a token id into its text for logprobs.

    Choices (n > 1) are indexed by the engine's sample index; streamed, each keeps its own state (echo, tool
    call parsing, text offsets) and chunks of different choices interleave as their tokens commit."""

    def __init__(self, request_id: str, model: str, chat: bool, decode, n: int = 1):
        self.id = ("chatcmpl-" if chat else "cmpl-") + request_id
        self.model = model
        self.chat = chat
        self.n = n
        self.created = int(time.time())
        self.decode = decode
        self.tool_parser: ToolParser | None = None  # set for a chat request whose output may hold tool calls
        self.echo = ""  # completions echo: the prompt's text, before each choice's own
        self.echo_prompt_ids: list[int] | None = None  # echo with logprobs: the prompt's tokens come first
        self.echo_k = 0
        self.prompt_logprobs_k: int | None = None  # the request's prompt_logprobs: answer them in that format
        self._prompt_logprobs: list[TokenLogprob | None] | None = None  # sample 0 carries them; all choices show
        self._choices: dict[int, _Choice] = {}

    def _envelope(self, obj: str, choices: list[dict]) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}

    def _choice(self, index: int) -> _Choice:
        state = self._choices.get(index)
        if state is None:
            state = self._choices[index] = _Choice(CompletionLogprobs(self.decode, self.echo_prompt_ids,
                                                                      self.echo_k))
        return state

    # ---- whole responses ---------------------------------------------------------------------------------
    def full(self, accs: list[Accumulated], want_logprobs: bool, num_output_tokens: int | None = None) -> dict:
        """The response for the choices `accs` (in their order); usage counts `num_output_tokens` when given
        (best_of: every sample generated, not only those returned), else the choices' tokens."""
        prompt = next((a.prompt_logprobs for a in accs if a.prompt_logprobs is not None), None)
        choices = []
        for index, acc in enumerate(accs):
            lp = self._logprobs(self._choice(index), acc.logprobs, prompt) if want_logprobs else None
            if self.chat:
                choice = {"index": index, "message": {"role": "assistant", "content": acc.text}, "logprobs": lp,
                          "finish_reason": acc.finish_reason}
                if self.tool_parser is not None:
                    _with_tool_calls(choice, self.tool_parser, acc.text)
            else:
                choice = {"index": index, "text": self.echo + acc.text, "logprobs": lp,
                          "finish_reason": acc.finish_reason}
            choices.append(choice)
        body = self._envelope("chat.completion" if self.chat else "text_completion", choices)
        if num_output_tokens is None:
            num_output_tokens = sum(a.num_output_tokens for a in accs)
        body["usage"] = usage(accs[0].num_prompt_tokens, num_output_tokens)
        if self.prompt_logprobs_k is not None and prompt is not None:
            lp = prompt_logprobs_json(prompt, self.decode, self.prompt_logprobs_k)
            for choice in [body] if self.chat else body["choices"]:
                choice["prompt_logprobs"] = lp
        return body

    # ---- streamed chunks ---------------------------------------------------------------------------------
    def first_chat_chunks(self) -> list[dict]:
        """The role delta that opens each choice of a streamed chat response."""
        return [self._envelope("chat.completion.chunk",
                               [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                 "finish_reason": None}]) for i in range(self.n)]

    def chunks(self, c: GenerateChunk, want_logprobs: bool) -> list[dict]:
        """The SSE payloads for one engine chunk: one, or with tools one per content / tool_calls delta
        (a call's header and its argument pieces each in a chunk of their own, as OpenAI streams them)."""
        state = self._choice(c.index)
        state.num_output_tokens = c.num_output_tokens
        if c.prompt_logprobs is not None:
            self._prompt_logprobs = c.prompt_logprobs
        # The prompt's logprobs go with each choice's first chunk (echo, and completions' prompt_logprobs);
        # chat shows prompt_logprobs once, on the response that first carries them.
        prompt = None if state.started else self._prompt_logprobs
        shown = c.prompt_logprobs if self.chat else prompt
        text = c.delta_text if state.started else self.echo + c.delta_text
        state.started = True
        if self.tool_parser is None:
            lp = self._logprobs(state, c.delta_logprobs or [], prompt) if want_logprobs else None
            if self.chat:
                delta = {"content": text} if text or not c.finished else {}
                choice = {"index": c.index, "delta": delta, "logprobs": lp, "finish_reason": c.finish_reason}
                return [self._add_prompt_logprobs(self._envelope("chat.completion.chunk", [choice]), shown)]
            choice = {"index": c.index, "text": text, "logprobs": lp, "finish_reason": c.finish_reason}
            return [self._add_prompt_logprobs(self._envelope("text_completion", [choice]), shown)]
        if state.tools is None:
            state.tools = ToolStreamer(self.tool_parser)
        stream = state.tools
        deltas = stream.feed(text) + (stream.finish() if c.finished else [])
        lp = self._logprobs(state, c.delta_logprobs or []) if want_logprobs else None
        out = [self._envelope("chat.completion.chunk", [{"index": c.index, "delta": d,
                                                         "logprobs": lp if i == 0 else None,
                                                         "finish_reason": None}]) for i, d in enumerate(deltas)]
        if out:
            self._add_prompt_logprobs(out[0], shown)
        if c.finished:
            reason = "tool_calls" if stream.made_calls and c.finish_reason == "stop" else c.finish_reason
            out.append(self._envelope("chat.completion.chunk", [{"index": c.index, "delta": {}, "logprobs": None,
                                                                 "finish_reason": reason}]))
        return out

    def _add_prompt_logprobs(self, body: dict, entries: list[TokenLogprob | None] | None) -> dict:
        """vLLM's places: the choice for completions, the response for chat (first chunk when streaming)."""
        if self.prompt_logprobs_k is not None and entries is not None:
            lp = prompt_logprobs_json(entries, self.decode, self.prompt_logprobs_k)
            (body if self.chat else body["choices"][0])["prompt_logprobs"] = lp
        return body

    def usage_chunk(self, num_prompt: int) -> dict:
        """The streamed usage: the prompt once, the tokens of every choice."""
        body = self._envelope("chat.completion.chunk" if self.chat else "text_completion", [])
        body["usage"] = usage(num_prompt, sum(c.num_output_tokens for c in self._choices.values()))
        return body

    # ---- logprobs ----------------------------------------------------------------------------------------
    def _logprobs(self, state: _Choice, entries: list[TokenLogprob],
                  prompt: list[TokenLogprob | None] | None = None) -> dict:
        if self.chat:
            return {"content": [{"token": self.decode(e.token_id), "logprob": e.logprob,
                                 "bytes": list(self.decode(e.token_id).encode()),
                                 "top_logprobs": [{"token": self.decode(t), "logprob": lp,
                                                   "bytes": list(self.decode(t).encode())} for t, lp in e.top]}
                                for e in entries]}
        return state.logprobs.build(entries, prompt)


def best_of(accs: list[Accumulated], n: int) -> list[Accumulated]:
    """The `n` samples with the highest mean token logprob (OpenAI's "highest log probability per token"),
    best first; a sample with no tokens ranks last."""
    def score(acc: Accumulated) -> float:
        return sum(e.logprob for e in acc.logprobs) / len(acc.logprobs) if acc.logprobs else float("-inf")
    return sorted(accs, key=score, reverse=True)[:n]


def _with_tool_calls(choice: dict, parser: ToolParser, text: str) -> None:
    """Move the calls found in a whole chat output into message.tool_calls (content keeps the rest)."""
    content, calls = parser.extract(text)
    if not calls:
        return
    choice["message"] = {"role": "assistant", "content": content,
                         "tool_calls": [call.to_openai() for call in calls]}
    if choice["finish_reason"] == "stop":
        choice["finish_reason"] = "tool_calls"
