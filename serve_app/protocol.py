"""OpenAI request schemas (pydantic v2) and their mapping onto engine SamplingParams.

Unknown fields are accepted and ignored, as the OpenAI API does, and named in a warning in the log (vLLM's
"The following fields were present in the request but ignored"), so a misspelt or unsupported field is not
ignored silently; known fields are type-checked here and range-checked by SamplingParams, whose ValueError names
the field.

Structured output comes from OpenAI's `response_format` or one of the vLLM extras (`guided_json`,
`guided_regex`, `guided_choice`, `guided_grammar`, or the `structured_outputs` object); at most one per
request. All map onto one engine StructuredOutputsParams; `structured_source` remembers which request
field it came from, so an error about it names that field.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from engine.generation_config import cap_max_tokens
from engine.sampling_params import SamplingParams, StructuredOutputsParams
from serve_app.tools import ToolChoice, ToolDefinition, constraint as tool_constraint

logger = logging.getLogger("ray.serve")
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


class StreamOptions(BaseModel):
    include_usage: bool = False
    # vLLM's extra: with include_usage, every chunk also carries the usage so far (its choice's tokens)
    continuous_usage_stats: bool = False


class JsonSchemaFormat(BaseModel):
    """OpenAI's response_format.json_schema: {"name", "schema", "strict", "description"}."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsField(BaseModel):
    """vLLM's `structured_outputs` request object (the same fields as the engine's params)."""

    model_config = ConfigDict(extra="forbid")

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False


# The request fields that take the model's default when unset (engine/generation_config.py KEYS, less max_tokens).
_MODEL_DEFAULTS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


class _SamplingFields(BaseModel):
    """Fields shared by both endpoints: the OpenAI ones plus vLLM-style extras."""

    model_config = ConfigDict(extra="allow")

    @model_validator(mode="after")
    def _log_ignored_fields(self):
        if self.model_extra:
            logger.warning("The following fields were present in the request but ignored: %s",
                           sorted(self.model_extra))
        return self

    model: str | None = None
    # Unset (None): the model's default (its generation_config.json, engine/generation_config.py), else the API's
    # (SamplingParams'). So are top_k, min_p and repetition_penalty below.
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM-style extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # structured output and token constraints
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: StructuredOutputsField | None = None
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[int] | None = None
    prompt_logprobs: int | None = None  # vLLM's extra: each prompt token's logprob (+ top-k), first None

    def _sampling(self, max_tokens: int | None, logprobs: int | None, defaults: dict | None) -> SamplingParams:
        """Raises ValueError naming the offending field. `defaults`: the model's sampling defaults
        (EngineConfig.sampling_defaults()) for the fields this request leaves unset, and its cap on max_tokens."""
        defaults, fields = defaults or {}, {}
        for name in _MODEL_DEFAULTS:
            value = getattr(self, name)
            if value is None:
                value = defaults.get(name)
            if value is not None:  # else SamplingParams' own default
                fields[name] = value
        return SamplingParams(
            max_tokens=cap_max_tokens(max_tokens, defaults), min_tokens=self.min_tokens, **fields,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty, seed=self.seed,
            stop=self.stop, stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos, logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            structured_outputs=self._structured(), logit_bias=self.logit_bias,
            allowed_token_ids=self.allowed_token_ids, prompt_logprobs=self.prompt_logprobs, n=self.n)

    @property
    def structured_source(self) -> str | None:
        """The request field that asked for structured output (None: plain text)."""
        sources = self._structured_sources()
        return sources[0] if sources else None

    def _structured_sources(self) -> list[str]:
        sources = [name for name in (*_GUIDED, "structured_outputs") if getattr(self, name) is not None]
        if self.response_format is not None and self.response_format.type != "text":
            sources.insert(0, "response_format")
        return sources

    def _structured(self) -> StructuredOutputsParams | None:
        """Raises ValueError (naming `structured_outputs...`; the ingress renames it to the source)."""
        sources = self._structured_sources()
        if len(sources) > 1:
            raise ValueError(f"{sources[0]}: only one structured output constraint per request; got "
                             f"{', '.join(sources)}")
        if not sources:
            return None
        source = sources[0]
        if source == "response_format":
            return _from_response_format(self.response_format)
        if source == "structured_outputs":
            return StructuredOutputsParams(**self.structured_outputs.model_dump(by_alias=True))
        return StructuredOutputsParams(**{_GUIDED[source]: getattr(self, source)})

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Usage in every streamed chunk (vLLM's stream_options.continuous_usage_stats, with include_usage)."""
        return self.include_usage and self.stream_options.continuous_usage_stats


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    # The legacy completions field: generate best_of samples, return the n with the highest mean token
    # logprob (non-streamed only; usage counts every sample's tokens, as OpenAI bills them).
    best_of: int | None = None

    @field_validator("prompt")
    @classmethod
    def _nonempty_prompts(cls, v: Any) -> Any:
        """One prompt (a string or token ids), or a batch of them; a batch of one is that prompt."""
        if isinstance(v, list) and v and isinstance(v[0], (str, list)):
            if any(len(p) == 0 for p in v):
                raise ValueError("prompt must not be empty (nor any prompt of the batch)")
            return v[0] if len(v) == 1 else v
        if isinstance(v, (str, list)) and len(v) == 0:
            raise ValueError("prompt must not be empty")
        return v

    @property
    def prompts(self) -> list[str | list[int]]:
        """The request's prompts: [prompt], or the batch OpenAI's `prompt` array gives (strings or token-id
        lists), answered as prompt i's n choices at indices i*n .. i*n + n - 1."""
        v = self.prompt
        return v if isinstance(v, list) and v and isinstance(v[0], (str, list)) else [v]

    def sampling_params(self, defaults: dict | None = None) -> SamplingParams:
        params = self._sampling(self.max_tokens, self.logprobs, defaults)
        if self.echo and self.logprobs is not None:  # the echoed prompt's tokens need their logprobs too
            params = dataclasses.replace(params, prompt_logprobs=max(self.logprobs, self.prompt_logprobs or 0))
        if self.best_of is not None and self.best_of > self.n:  # ranking needs each token's logprob
            params = dataclasses.replace(params, n=self.best_of, logprobs=self.logprobs or 0)
        return params


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls (serve_app/tools.py)
    tool_call_id: str | None = None  # a role "tool" result: the call it answers
    name: str | None = None

    def text(self) -> str:
        """Plain-text content; list content keeps its text parts (this server has no image input)."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.get("type") != "text":
                raise ValueError(f"messages content part type {part.get('type')!r} is not supported; "
                                 f"only 'text' parts are")
            parts.append(str(part.get("text", "")))
        return "".join(parts)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    add_generation_prompt: bool = True
    # vLLM's chat extras: continue the final (assistant) message instead of opening a new one (a response
    # prefill; add_generation_prompt must then be false), special tokens such as BOS added on top of the
    # template's, and keyword arguments the chat template reads (e.g. Qwen3's enable_thinking).
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: ToolChoice | None = None  # None: "auto" with tools, "none" without (OpenAI's default)
    parallel_tool_calls: bool | None = None

    def sampling_params(self, defaults: dict | None = None) -> SamplingParams:
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._sampling(max_tokens, logprobs, defaults)

    def _structured(self) -> StructuredOutputsParams | None:
        """tool_choice "required" or a named function is a constraint of its own (checked not to clash)."""
        return tool_constraint(self) or super()._structured()

    @property
    def structured_source(self) -> str | None:
        """"tools" when tool_choice constrains the output: a schema the engine cannot compile names them."""
        return "tools" if tool_constraint(self) is not None else super().structured_source


def _from_response_format(fmt: ResponseFormat) -> StructuredOutputsParams:
    if fmt.type == "json_object":
        return StructuredOutputsParams(json_object=True)
    if fmt.json_schema is None or fmt.json_schema.schema_ is None:
        raise ValueError("response_format.json_schema.schema is required when type is json_schema")
    return StructuredOutputsParams(json=fmt.json_schema.schema_)


def structured_error(message: str, source: str | None) -> str:
    """Name the request field the user set in an engine message about `structured_outputs.<kind>`."""
    if source in (None, "structured_outputs"):
        return message
    field = "response_format.json_schema.schema" if source == "response_format" else source
    return re.sub(r"^structured_outputs(\.\w+)?", field, message)


# Arguments of transformers' apply_chat_template that the server sets itself: a request's chat_template_kwargs
# may not name them (they would change what is rendered or returned, not only what the template reads).
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs"})


def chat_template_args(body) -> dict[str, Any]:
    """apply_chat_template's keyword arguments for a chat or tokenize request (ValueError naming the field):
    add_generation_prompt, continue_final_message and the request's chat_template_kwargs."""
    if body.continue_final_message and body.add_generation_prompt:
        raise ValueError("continue_final_message: cannot set both continue_final_message and add_generation_prompt "
                         "to true (continuing the final message opens no new one)")
    extra = dict(body.chat_template_kwargs or {})
    reserved = sorted(RESERVED_TEMPLATE_KWARGS & set(extra))
    if reserved:
        raise ValueError(f"chat_template_kwargs: {', '.join(reserved)} set by the server, not by the request")
    return {**extra, "add_generation_prompt": body.add_generation_prompt,
            "continue_final_message": body.continue_final_message}


class TokenizeRequest(BaseModel):
    """vLLM's POST /tokenize: a completion prompt, or chat messages rendered through the chat template as
    /v1/chat/completions renders them."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    # None: true for a prompt (as /v1/completions encodes it), false for messages (the template adds them)
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: ToolChoice | None = None
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    """vLLM's POST /detokenize."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    tokens: list[int]
