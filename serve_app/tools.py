"""OpenAI tool calling on the chat route: request models, what the chat template gets, and the constraint.

As vLLM does it: `tool_choice` "auto" lets the model answer freely and the deployment's `tool_parser`
(serve_app/tool_parsers.py) finds the calls in its text; a named function constrains the output to a JSON
object valid against that function's `parameters` (the output is the arguments); "required" constrains it to
a JSON array (at least one item, at most one without `parallel_tool_calls`) of `{"name": NAME, "parameters":
ARGS}` objects, anyOf over the tools, parsed straight into tool_calls. Constraints go through the engine's
structured output (xgrammar), so such a call is always valid JSON for the tool's parameters; compact JSON
(no free whitespace), so a call costs the tokens it needs and no model pads it into `length`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from engine.sampling_params import StructuredOutputsParams
from serve_app.errors import bad_request
from serve_app.tool_parsers import NamedParser, RequiredParser, ToolParser, get_tool_parser

_EMPTY_PARAMETERS = {"type": "object", "properties": {}}


class FunctionDefinition(BaseModel):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _object_schema(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        """OpenAI: the parameters are a JSON schema for the arguments object (the rest the grammar compiler
        checks when the schema is used as a constraint)."""
        if v is not None and v.get("type", "object") != "object":
            raise ValueError(f"tools: function.parameters must be a JSON schema of type object, got {v['type']!r}")
        return v


class ToolDefinition(BaseModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


def uses_tools(body) -> bool:
    """Whether this chat request renders tools and parses calls (tools given, tool_choice not "none")."""
    return bool(body.tools) and body.tool_choice != "none"


def check_tools(body, parser_name: str | None, chat_template: Any) -> None:
    """400s, each naming its field: tool_choice without tools, no parser on this deployment, a template
    that cannot render tools, a named function that is not among the tools, a clash with response_format."""
    choice = body.tool_choice
    if not body.tools:
        if choice not in (None, "none"):
            raise bad_request("tool_choice is not supported without tools", param="tool_choice")
        return
    if choice == "none":
        return
    if parser_name is None:
        raise bad_request("tools are not supported by this deployment: it has no tool_parser configured "
                          "(set tool_parser in the app config)", param="tools", code="unsupported_field")
    templates = chat_template.values() if isinstance(chat_template, dict) else [chat_template or ""]
    if not any("tools" in t for t in templates):
        raise bad_request("tools are not supported with this model: its chat template does not render tools",
                          param="tools")
    names = [t.function.name for t in body.tools]
    if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
        raise bad_request(f"tool_choice names function {choice.function.name!r}, which is not among the tools "
                          f"({', '.join(names)})", param="tool_choice")
    others = body._structured_sources()  # the structured-output fields the client set
    if choice not in (None, "auto") and others:
        raise bad_request(f"tool_choice {_label(choice)!r} cannot be combined with {others[0]}",
                          param="tool_choice")


def _label(choice) -> str:
    return choice if isinstance(choice, str) else f"function {choice.function.name}"


def template_tools(body) -> list[dict] | None:
    return [t.model_dump(exclude_none=True) for t in body.tools] if uses_tools(body) else None


def template_message(message) -> dict:
    """One chat message as HF templates expect it: assistant tool_calls with their arguments as dicts (the
    Qwen / Llama / Mistral templates iterate or `tojson` them), tool results with their tool_call_id."""
    out: dict[str, Any] = {"role": message.role, "content": message.text()}
    if message.tool_calls:
        out["tool_calls"] = [_template_call(c) for c in message.tool_calls]
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    if message.name is not None:
        out["name"] = message.name
    return out


def _template_call(call: dict) -> dict:
    function = dict(call.get("function") or {})
    args = function.get("arguments")
    if isinstance(args, str):
        try:
            function["arguments"] = json.loads(args)
        except ValueError:
            raise ValueError("messages: an assistant tool_calls entry has function.arguments that are not "
                             "valid JSON") from None
    return {**call, "function": function}


def constraint(body) -> StructuredOutputsParams | None:
    """The engine constraint "required" or a named tool_choice asks for (None: "auto" / "none")."""
    if not uses_tools(body) or body.tool_choice in (None, "auto"):
        return None
    tools = {t.function.name: t.function.parameters or _EMPTY_PARAMETERS for t in body.tools}
    if isinstance(body.tool_choice, NamedToolChoice):
        return StructuredOutputsParams(json=tools[body.tool_choice.function.name], disable_any_whitespace=True)
    items = {"type": "object", "anyOf": [
        {"properties": {"name": {"type": "string", "const": name}, "parameters": schema},
         "required": ["name", "parameters"]} for name, schema in tools.items()]}
    array: dict[str, Any] = {"type": "array", "minItems": 1, "items": items}
    if body.parallel_tool_calls is False:
        array["maxItems"] = 1
    return StructuredOutputsParams(json=array, disable_any_whitespace=True)


def output_parser(body, parser_name: str | None) -> ToolParser | None:
    """How this request's output becomes tool_calls (None: plain content)."""
    if not uses_tools(body):
        return None
    if isinstance(body.tool_choice, NamedToolChoice):
        return NamedParser(body.tool_choice.function.name)
    if body.tool_choice == "required":
        return RequiredParser()
    return get_tool_parser(parser_name)


def load_chat_template(value: str) -> str:
    """A chat template given as vLLM's --chat-template takes it: a file's path, or the template itself (text
    with Jinja markup). ValueError naming chat_template for anything else, or for a template whose Jinja does
    not parse (checked in the sandbox transformers renders chat templates in)."""
    from jinja2 import TemplateSyntaxError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    path = Path(value)
    if "{" not in value and "\n" not in value:
        if not path.is_file():
            raise ValueError(f"chat_template: {value!r} is neither a file nor a Jinja template")
        value = path.read_text()
    try:
        ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"]).parse(value)
    except TemplateSyntaxError as exc:
        raise ValueError(f"chat_template: not a valid Jinja template: {exc}") from None
    return value
