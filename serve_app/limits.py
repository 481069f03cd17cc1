"""Request limits, checked at the HTTP edge before any work is done.

An oversized body is a 413 before it is parsed (serve_app/middleware.py); every other limit is a 400 whose
message and `param` name the field and the limit. All are configurable under `limits:` in the app config.
The defaults leave ordinary use untouched and stop what made a neighbour slower or tied up the engine in
probes: tens of thousands of stop strings (the detokenizer matches them with one automaton now, but building
it still takes time), an enum of a huge number of values (seconds of a compile worker), a schema hundreds of
levels deep (past Python's recursion limit in the grammar compiler). What the probes measured:
docs/operations.md#request-limits.
The grammar compile time limit is an engine setting (`grammar_compile_timeout_s`): compiling happens
there. Schema depth is measured iteratively, so a schema deep enough to break recursion is still answered.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from serve_app.errors import APIError, bad_request

# OpenAI fields this server does not implement yet: a request that sets one gets a 400 naming it, never a
# silent answer without it. name -> the values that mean "not used" (absent, empty, or the default)
UNSUPPORTED_FIELDS = {"tools": (None, []), "tool_choice": (None, "none"), "functions": (None, []),
                      "function_call": (None, "none"), "suffix": (None, ""), "best_of": (None, 1)}


class Limits(BaseModel):
    """Per-request limits (app config `limits:`); see the module docstring."""

    model_config = ConfigDict(extra="forbid")

    max_body_bytes: int = Field(default=8 * 1024**2, ge=1024)
    max_stop_strings: int = Field(default=64, ge=0)  # OpenAI allows 4, vLLM any number
    max_stop_string_chars: int = Field(default=1024, ge=1)
    max_logit_bias: int = Field(default=1024, ge=0)  # entries
    max_allowed_token_ids: int = Field(default=65536, ge=1)
    max_choices: int = Field(default=1024, ge=1)  # guided_choice / structured_outputs.choice
    max_schema_bytes: int = Field(default=64 * 1024, ge=64)  # a JSON schema, as compact JSON
    max_schema_depth: int = Field(default=32, ge=1)  # nesting of objects and arrays in a schema
    max_grammar_bytes: int = Field(default=64 * 1024, ge=16)  # a regex or an EBNF grammar
    # Samples per request (n, and best_of): each is a running sequence with its own KV past the shared prompt.
    # Engines also cap them at max_num_seqs.
    max_n: int = Field(default=16, ge=1)
    # Prompts in one /v1/completions request (OpenAI's prompt array); each runs as its own engine request.
    max_prompts: int = Field(default=64, ge=1)


def check_request(body, limits: Limits) -> None:
    """400 for the first field of `body` (a CompletionRequest or ChatCompletionRequest) past its limit."""
    extra = body.model_extra or {}
    for name, unused in UNSUPPORTED_FIELDS.items():
        if extra.get(name) not in unused:
            raise APIError(400, f"{name} is not supported by this server", param=name, code="unsupported_field")
    _check_samples(body, limits)
    stops = [body.stop] if isinstance(body.stop, str) else body.stop or []
    _at_most("stop", len(stops), limits.max_stop_strings, "stop strings")
    longest = max((len(s) for s in stops if isinstance(s, str)), default=0)
    _at_most("stop", longest, limits.max_stop_string_chars, "characters in a stop string")
    _at_most("logit_bias", len(body.logit_bias or {}), limits.max_logit_bias, "entries")
    _at_most("allowed_token_ids", len(body.allowed_token_ids or []), limits.max_allowed_token_ids, "token ids")
    so = body.structured_outputs
    for field, choices in (("guided_choice", body.guided_choice), ("structured_outputs.choice", so and so.choice)):
        _at_most(field, len(choices or []), limits.max_choices, "choices")
    for field, text in (("guided_regex", body.guided_regex), ("guided_grammar", body.guided_grammar),
                        ("structured_outputs.regex", so and so.regex),
                        ("structured_outputs.grammar", so and so.grammar)):
        _at_most(field, len((text or "").encode()), limits.max_grammar_bytes, "bytes")
    fmt = body.response_format
    schemas = (("response_format.json_schema.schema", fmt and fmt.json_schema and fmt.json_schema.schema_),
               ("guided_json", body.guided_json), ("structured_outputs.json", so and so.json_))
    for field, schema in schemas:
        if schema is not None:
            _check_schema(field, schema, limits)


def check_prompts(body, limits: Limits) -> None:
    """A batch of completion prompts (OpenAI's prompt array): at most max_prompts."""
    _at_most("prompt", len(body.prompts), limits.max_prompts, "prompts per request")


def _check_samples(body, limits: Limits) -> None:
    if body.n < 1:
        raise bad_request(f"n must be an integer >= 1, got {body.n}", param="n")
    _at_most("n", body.n, limits.max_n, "samples per request")
    best_of = getattr(body, "best_of", None)
    if best_of is None:
        return
    if best_of < body.n:
        raise bad_request(f"best_of must be >= n, got best_of={best_of} and n={body.n}", param="best_of")
    _at_most("best_of", best_of, limits.max_n, "samples per request")
    if body.stream and best_of > body.n:
        raise bad_request("best_of cannot be used with stream: the best samples are known only at the end",
                          param="best_of")


def check_context(prompt_tokens: int, max_tokens: int | None, max_model_len: int, chat: bool) -> None:
    """A prompt plus the tokens asked for must fit the context (vLLM's check and message); without
    max_tokens a request gets whatever context the prompt leaves."""
    if prompt_tokens >= max_model_len:
        raise bad_request(f"This model's maximum context length is {max_model_len} tokens; the prompt has "
                          f"{prompt_tokens} tokens", param="messages" if chat else "prompt",
                          code="context_length_exceeded")
    if max_tokens is not None and prompt_tokens + max_tokens > max_model_len:
        where = "messages" if chat else "prompt"
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the {where}, {max_tokens} in the "
            f"completion). Please reduce the length of the {where} or completion.",
            param="max_tokens", code="context_length_exceeded")


def _at_most(field: str, value: int, limit: int, what: str) -> None:
    if value > limit:
        raise bad_request(f"{field}: at most {limit} {what} are allowed, got {value}", param=field,
                          code="limit_exceeded")


def _check_schema(field: str, schema: Any, limits: Limits) -> None:
    if isinstance(schema, str):
        size = len(schema.encode())
        _at_most(field, size, limits.max_schema_bytes, "bytes of schema")
        try:
            schema = json.loads(schema)
        except (ValueError, RecursionError):
            return  # not JSON (or nested past the parser): the engine's own check names the problem
    depth = nesting_depth(schema)
    _at_most(field, depth, limits.max_schema_depth, "levels of nesting")
    try:
        size = len(json.dumps(schema, separators=(",", ":")).encode())
    except (TypeError, ValueError):
        return
    _at_most(field, size, limits.max_schema_bytes, "bytes of schema")


def nesting_depth(value: Any) -> int:
    """How deeply dicts and lists nest in `value` (a scalar is 0), without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        deepest = max(deepest, depth)
        stack.extend((child, depth + 1) for child in children)
    return deepest


def check_tool_schemas(body, limits: Limits) -> None:
    """Each tool's `parameters` schema is held to the schema limits (it may become a grammar), naming `tools`."""
    for tool in getattr(body, "tools", None) or []:
        if tool.function.parameters is not None:
            _check_schema("tools", tool.function.parameters, limits)
