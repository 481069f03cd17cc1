"""Tools through the chat template and the request checks, without a cluster: the ingress's own steps
(template_message / template_tools / apply_chat_template) on a tokenizer with Qwen2.5's real template; the
expected text is the format the Qwen2.5 template defines, written out by hand."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError
from transformers import AutoTokenizer

from engine.config import DEFAULT_MODEL_DIR
from serve_app.errors import APIError
from serve_app.builder import AppConfig
from serve_app.protocol import ChatCompletionRequest, structured_error
from serve_app.tools import check_tools, constraint, template_message, template_tools
from tool_template import tool_model_dir

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object", "required": ["city"],
                                                           "properties": {"city": {"type": "string"}}}}}
TIME = {"type": "function", "function": {"name": "get_time"}}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return AutoTokenizer.from_pretrained(tool_model_dir(tmp_path_factory.mktemp("m")), local_files_only=True)


def render(tokenizer, body: ChatCompletionRequest) -> str:
    return tokenizer.apply_chat_template([template_message(m) for m in body.messages], tools=template_tools(body),
                                         add_generation_prompt=True, tokenize=False)


def request(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest(**{"messages": [{"role": "user", "content": "Weather in Paris?"}], **kw})


def test_tools_are_rendered(tokenizer):
    text = render(tokenizer, request(tools=[WEATHER, TIME]))
    assert "# Tools" in text and "<tools>\n" + json.dumps(WEATHER) + "\n" in text
    assert '{"type": "function", "function": {"name": "get_time"}}' in text
    assert text.endswith("<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n")
    assert "# Tools" not in render(tokenizer, request(tools=[WEATHER], tool_choice="none"))


def test_assistant_tool_calls_and_tool_results_are_rendered(tokenizer):
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "22 C"}]
    text = render(tokenizer, request(messages=messages, tools=[WEATHER]))
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
            '</tool_call><|im_end|>\n') in text  # arguments given as a JSON string rendered as the object
    assert "<|im_start|>user\n<tool_response>\n22 C\n</tool_response><|im_end|>\n<|im_start|>assistant\n" in text


def _status(fn, *args):
    with pytest.raises(APIError) as err:
        fn(*args)
    return err.value.status, err.value.param, err.value.message


def test_request_checks(tokenizer):
    plain = AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR, local_files_only=True).chat_template
    assert _status(check_tools, request(tools=[WEATHER]), None, tokenizer.chat_template)[:2] == (400, "tools")
    status, param, message = _status(check_tools, request(tools=[WEATHER]), "hermes", plain)
    assert (status, param) == (400, "tools") and "chat template" in message
    named = {"type": "function", "function": {"name": "nope"}}
    assert _status(check_tools, request(tools=[WEATHER], tool_choice=named), "hermes",
                   tokenizer.chat_template)[1] == "tool_choice"
    clash = request(tools=[WEATHER], tool_choice="required", response_format={"type": "json_object"})
    assert _status(check_tools, clash, "hermes", tokenizer.chat_template)[1] == "tool_choice"
    assert _status(check_tools, request(tool_choice="required"), "hermes", tokenizer.chat_template)[1] == \
        "tool_choice"
    check_tools(request(tools=[WEATHER], tool_choice="none"), None, None)  # tools not used: no parser needed
    check_tools(request(tools=[WEATHER]), "hermes", tokenizer.chat_template)
    for bad in ({"type": "function", "function": {"name": "has space"}}, {"type": "x", "function": {"name": "f"}},
                {"type": "function", "function": {"name": "f", "parameters": [1]}},
                {"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}):
        with pytest.raises(ValidationError):
            request(tools=[bad])


def schema(params) -> dict:
    return json.loads(params.json) if isinstance(params.json, str) else params.json


def test_constraints_follow_vllm():
    params = WEATHER["function"]["parameters"]
    named = request(tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert schema(constraint(named)) == params
    assert schema(named.sampling_params().structured_outputs) == params
    required = schema(constraint(request(tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False)))
    assert required["type"] == "array" and required["minItems"] == 1 and required["maxItems"] == 1
    branches = required["items"]["anyOf"]
    assert [b["properties"]["name"]["const"] for b in branches] == ["get_weather", "get_time"]
    assert branches[0]["properties"]["parameters"] == params
    assert "maxItems" not in schema(constraint(request(tools=[WEATHER], tool_choice="required")))
    assert named.structured_source == "tools" and request(tools=[WEATHER]).structured_source is None
    assert structured_error("structured_outputs.json: bad schema", named.structured_source) == "tools: bad schema"
    assert constraint(request(tools=[WEATHER])) is None and constraint(request(tools=[WEATHER],
                                                                               tool_choice="none")) is None


def test_app_config_tool_parser_is_checked():
    assert AppConfig(tool_parser="hermes").tool_parser == "hermes" and AppConfig().tool_parser is None
    with pytest.raises(ValidationError, match=r"hermes.*llama3_json.*mistral"):
        AppConfig(tool_parser="qwen")


def test_tool_schemas_are_held_to_the_schema_limits():
    from serve_app.limits import Limits, check_tool_schemas

    deep: dict = {"type": "object"}
    for _ in range(40):
        deep = {"type": "object", "properties": {"x": deep}}
    tool = {"type": "function", "function": {"name": "f", "parameters": deep}}
    assert _status(check_tool_schemas, request(tools=[tool]), Limits())[:2] == (400, "tools")
    check_tool_schemas(request(tools=[WEATHER]), Limits())
