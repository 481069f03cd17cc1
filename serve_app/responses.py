"""OpenAI response bodies (completions and chat, whole and streamed) built from engine chunks."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

from cluster.protocol import GenerateChunk
from engine.outputs import TokenLogprob
from serve_app.tool_parsers import ToolParser, ToolStreamer
from serve_app.logprobs_format import CompletionLogprobs, prompt_logprobs_json


@dataclass
class Accumulated:
    """Everything a non-streaming response needs, gathered from the chunks."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    prompt_logprobs: list[TokenLogprob | None] | None = None

    def add(self, chunk: GenerateChunk) -> None:
        if chunk.prompt_logprobs is not None:
            self.prompt_logprobs = chunk.prompt_logprobs
        self.text += chunk.delta_text
        self.token_ids += chunk.delta_token_ids
        self.logprobs += chunk.delta_logprobs or []
        self.finish_reason = chunk.finish_reason
        self.num_prompt_tokens = chunk.num_prompt_tokens
        self.num_output_tokens = chunk.num_output_tokens


def usage(num_prompt: int, num_output: int) -> dict:
    return {"prompt_tokens": num_prompt, "completion_tokens": num_output, "total_tokens": num_prompt + num_output}


def sse(payload: dict | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


class ResponseBuilder:
    """Shapes one request's responses; `decode` turns a token id into its text for logprobs."""

    def __init__(self, request_id: str, model: str, chat: bool, decode):
        self.id = ("chatcmpl-" if chat else "cmpl-") + request_id
        self.model = model
        self.chat = chat
        self.created = int(time.time())
        self.decode = decode
        self.tool_parser: ToolParser | None = None  # set for a chat request whose output may hold tool calls
        self._tool_stream: ToolStreamer | None = None
        self.completion_logprobs = CompletionLogprobs(decode)  # text_offset runs on across chunks
        self.prompt_logprobs_k: int | None = None  # the request's prompt_logprobs: answer them in that format

    def _envelope(self, obj: str, choices: list[dict]) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}

    # ---- whole responses ---------------------------------------------------------------------------------
    def full(self, acc: Accumulated, want_logprobs: bool) -> dict:
        lp = self._logprobs(acc.logprobs, acc.prompt_logprobs) if want_logprobs else None
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": acc.text}, "logprobs": lp,
                      "finish_reason": acc.finish_reason}
            if self.tool_parser is not None:
                _with_tool_calls(choice, self.tool_parser, acc.text)
            body = self._envelope("chat.completion", [choice])
        else:
            choice = {"index": 0, "text": acc.text, "logprobs": lp, "finish_reason": acc.finish_reason}
            body = self._envelope("text_completion", [choice])
        body["usage"] = usage(acc.num_prompt_tokens, acc.num_output_tokens)
        self._add_prompt_logprobs(body, acc.prompt_logprobs)
        return body

    # ---- streamed chunks ---------------------------------------------------------------------------------
    def first_chat_chunk(self) -> dict:
        return self._envelope("chat.completion.chunk",
                              [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                "finish_reason": None}])

    def chunk(self, c: GenerateChunk, want_logprobs: bool) -> dict:
        lp = self._logprobs(c.delta_logprobs or [], c.prompt_logprobs) if want_logprobs else None
        if self.chat:
            delta = {"content": c.delta_text} if c.delta_text or not c.finished else {}
            choice = {"index": 0, "delta": delta, "logprobs": lp, "finish_reason": c.finish_reason}
            return self._add_prompt_logprobs(self._envelope("chat.completion.chunk", [choice]), c.prompt_logprobs)
        choice = {"index": 0, "text": c.delta_text, "logprobs": lp, "finish_reason": c.finish_reason}
        return self._add_prompt_logprobs(self._envelope("text_completion", [choice]), c.prompt_logprobs)

    def _add_prompt_logprobs(self, body: dict, entries: list[TokenLogprob | None] | None) -> dict:
        """vLLM's places: the choice for completions, the response for chat (first chunk when streaming)."""
        if self.prompt_logprobs_k is not None and entries is not None:
            lp = prompt_logprobs_json(entries, self.decode, self.prompt_logprobs_k)
            (body if self.chat else body["choices"][0])["prompt_logprobs"] = lp
        return body

    def chunks(self, c: GenerateChunk, want_logprobs: bool) -> list[dict]:
        """The SSE payloads for one engine chunk: one, or with tools one per content / tool_calls delta
        (a call's header and its argument pieces each in a chunk of their own, as OpenAI streams them)."""
        if self.tool_parser is None:
            return [self.chunk(c, want_logprobs)]
        if self._tool_stream is None:
            self._tool_stream = ToolStreamer(self.tool_parser)
        stream = self._tool_stream
        deltas = stream.feed(c.delta_text) + (stream.finish() if c.finished else [])
        lp = self._logprobs(c.delta_logprobs or []) if want_logprobs else None
        out = [self._envelope("chat.completion.chunk", [{"index": 0, "delta": d, "logprobs": lp if i == 0 else None,
                                                         "finish_reason": None}]) for i, d in enumerate(deltas)]
        if out:
            self._add_prompt_logprobs(out[0], c.prompt_logprobs)
        if c.finished:
            reason = "tool_calls" if stream.made_calls and c.finish_reason == "stop" else c.finish_reason
            out.append(self._envelope("chat.completion.chunk", [{"index": 0, "delta": {}, "logprobs": None,
                                                                 "finish_reason": reason}]))
        return out

    def usage_chunk(self, num_prompt: int, num_output: int) -> dict:
        body = self._envelope("chat.completion.chunk" if self.chat else "text_completion", [])
        body["usage"] = usage(num_prompt, num_output)
        return body

    # ---- logprobs ----------------------------------------------------------------------------------------
    def _logprobs(self, entries: list[TokenLogprob], prompt: list[TokenLogprob | None] | None = None) -> dict:
        if self.chat:
            return {"content": [{"token": self.decode(e.token_id), "logprob": e.logprob,
                                 "bytes": list(self.decode(e.token_id).encode()),
                                 "top_logprobs": [{"token": self.decode(t), "logprob": lp,
                                                   "bytes": list(self.decode(t).encode())} for t, lp in e.top]}
                                for e in entries]}
        return self.completion_logprobs.build(entries, prompt)


def _with_tool_calls(choice: dict, parser: ToolParser, text: str) -> None:
    """Move the calls found in a whole chat output into message.tool_calls (content keeps the rest)."""
    content, calls = parser.extract(text)
    if not calls:
        return
    choice["message"] = {"role": "assistant", "content": content,
                         "tool_calls": [call.to_openai() for call in calls]}
    if choice["finish_reason"] == "stop":
        choice["finish_reason"] = "tool_calls"
