"""Tool calling over HTTP with the official `openai` client: one private cluster serving a copy of the embedded
model with Qwen2.5's real chat template and tool_parser="hermes", plus a second app on the same cluster (the
plain default model, no tool_parser) for the 400s. Oracles: jsonschema on the arguments against the tool's own
schema, the OpenAI wire format (the client's models), and the streamed deltas reassembled as a client does."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from serve_cluster import serve_cluster
from tool_template import tool_model_dir

CITY = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo", "Rome"]}},
        "required": ["city"], "additionalProperties": False}
HOUR = {"type": "object", "properties": {"hour": {"type": "integer", "minimum": 0, "maximum": 23}},
        "required": ["hour"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": CITY}},
         {"type": "function", "function": {"name": "set_alarm", "description": "Set an alarm", "parameters": HOUR}}]
SCHEMAS = {"get_weather": CITY, "set_alarm": HOUR}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    model = tool_model_dir(tmp_path_factory.mktemp("tools"))
    with serve_cluster({"model": str(model), "served_model_name": "qwen-tools", "num_replicas": 1,
                        "tool_parser": "hermes"}) as c:
        yield c


@pytest.fixture(scope="module")
def client(cluster):
    return openai.OpenAI(base_url=cluster.api_url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def plain_client(cluster):
    """The default model (template without tools) and no tool_parser, as a second app on the cluster."""
    from ray import serve

    from serve_app import build_app

    serve.run(build_app({"num_replicas": 1}), name=cluster.app_name + "plain", route_prefix="/plain")
    return openai.OpenAI(base_url=cluster.base_url + "/plain/v1", api_key="unused", max_retries=0, timeout=120)


def create(client, **kw):
    kw = {"messages": ASK, "tools": TOOLS, "temperature": 0, "max_tokens": 64, **kw}
    return client.chat.completions.create(model="qwen-tools", **kw)


def assert_valid(calls) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_named_tool_choice(client):
    r = create(client, tool_choice=NAMED)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    assert [c.function.name for c in choice.message.tool_calls] == ["get_weather"]
    assert_valid(choice.message.tool_calls)


def test_required_tool_choice(client):
    r = create(client, tool_choice="required", parallel_tool_calls=False)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    assert_valid(choice.message.tool_calls)


@pytest.mark.parametrize("tool_choice", [NAMED, "required"])
def test_streamed_tool_calls_reassemble(client, tool_choice):
    calls: dict[int, dict] = {}
    finish = []
    for chunk in create(client, tool_choice=tool_choice, parallel_tool_calls=False, stream=True):
        choice = chunk.choices[0]
        finish.append(choice.finish_reason)
        assert not choice.delta.content
        for tc in choice.delta.tool_calls or []:
            if tc.id is not None:  # a call's first delta: index, id, type, name, arguments ""
                assert tc.index == len(calls) and tc.type == "function" and tc.function.arguments == ""
                calls[tc.index] = {"id": tc.id, "name": tc.function.name, "args": ""}
            else:
                calls[tc.index]["args"] += tc.function.arguments
    assert [f for f in finish if f] == ["tool_calls"] and finish[-1] == "tool_calls"
    assert len(calls) == 1
    call = calls[0]
    assert call["id"].startswith("call_") and call["name"] in SCHEMAS
    jsonschema.validate(json.loads(call["args"]), SCHEMAS[call["name"]])


def test_round_trip_with_tool_result(client):
    first = create(client, tool_choice=NAMED).choices[0].message
    call = first.tool_calls[0]
    messages = ASK + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                      {"role": "tool", "tool_call_id": call.id, "content": "22 C and sunny"}]
    r = create(client, messages=messages, max_tokens=8)  # tool_choice "auto": tools, call and result rendered
    assert r.choices[0].finish_reason in ("stop", "length") and r.usage.prompt_tokens > 0
    assert r.choices[0].message.content is not None or r.choices[0].message.tool_calls


def test_tools_without_parser_or_template_are_400(client, plain_client):
    with pytest.raises(openai.BadRequestError) as err:
        plain_client.chat.completions.create(model="tandem-default", messages=ASK, tools=TOOLS, max_tokens=4)
    assert err.value.body["param"] == "tools" and "tool_parser" in err.value.body["message"]
    with pytest.raises(openai.BadRequestError) as err:
        create(client, tool_choice={"type": "function", "function": {"name": "unknown"}})
    assert err.value.body["param"] == "tool_choice"
    with pytest.raises(openai.BadRequestError) as err:
        create(client, tool_choice="required", response_format={"type": "json_object"})
    assert err.value.body["param"] == "tool_choice"


def test_auto_parses_hermes_calls_whole_and_streamed(client):
    """tool_choice "auto" with the model's output pinned (guided_choice) to a Hermes-format reply: the deployment's
    parser turns it into tool_calls, and the stream's pieces reassemble into the same call."""
    text = 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    pinned = {"guided_choice": [text]}
    r = create(client, extra_body=pinned, max_tokens=128).choices[0]
    assert r.finish_reason == "tool_calls" and r.message.content == "Checking."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in r.message.tool_calls] == \
        [("get_weather", {"city": "Oslo"})]
    content, name, args, reasons = "", None, "", []
    for chunk in create(client, extra_body=pinned, max_tokens=128, stream=True):
        delta = chunk.choices[0].delta
        reasons.append(chunk.choices[0].finish_reason)
        content += delta.content or ""
        for tc in delta.tool_calls or []:
            name = tc.function.name or name
            args += tc.function.arguments or ""
    assert (content, name, json.loads(args)) == ("Checking.", "get_weather", {"city": "Oslo"})
    assert args == r.message.tool_calls[0].function.arguments and reasons[-1] == "tool_calls"


def test_n2_streamed_tool_calls_parse_per_choice(client):
    """Each choice has its own tool-call parser: two sampled choices' deltas interleave yet reassemble into
    one valid call each."""
    calls: dict[int, dict] = {}
    finish: dict[int, str] = {}
    for chunk in create(client, tool_choice="required", parallel_tool_calls=False, stream=True, n=2,
                        temperature=1.0, seed=5):
        for choice in chunk.choices:
            if choice.finish_reason:
                finish[choice.index] = choice.finish_reason
            for tc in choice.delta.tool_calls or []:
                assert tc.index == 0
                if tc.id is not None:
                    calls[choice.index] = {"name": tc.function.name, "args": ""}
                else:
                    calls[choice.index]["args"] += tc.function.arguments
    assert finish == {0: "tool_calls", 1: "tool_calls"} and sorted(calls) == [0, 1]
    for call in calls.values():
        assert call["name"] in SCHEMAS
        jsonschema.validate(json.loads(call["args"]), SCHEMAS[call["name"]])
