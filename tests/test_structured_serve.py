"""Structured output over HTTP: OpenAI response_format, vLLM guided_* / structured_outputs extras, logit_bias.

One real Ray cluster (one engine replica) for the module, driven with the official `openai` client and raw
HTTP. Oracles: the offline engine on the same embedded model and prompt ids (greedy is deterministic), and
jsonschema / re / equality on what comes back.
"""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import pytest

from engine import SamplingParams
from engine.sampling_params import StructuredOutputsParams as SO
from serve_cluster import serve_cluster
from test_serve_app import ERROR_KEYS, MODEL, chat_ids, client, oracle, tokenizer, user  # noqa: F401 (fixtures)

SCHEMA = {"type": "object", "required": ["name", "size", "tags"], "properties": {
    "name": {"type": "string", "maxLength": 12},
    "size": {"type": "integer", "minimum": 0, "maximum": 1000},
    "tags": {"type": "array", "items": {"enum": ["io", "net", "os"]}, "maxItems": 3}}}


@pytest.fixture(scope="module")
def cluster():
    with serve_cluster({"num_replicas": 1}) as c:
        yield c


def offline(oracle, prompt_ids: list[int], constraint: SO | None, max_tokens: int = 200, **kw):
    params = SamplingParams(max_tokens=max_tokens, temperature=0, structured_outputs=constraint, **kw)
    return oracle.generate([prompt_ids], params)[0]


# ---- the constraint reaches the engine, whichever field carries it ---------------------------------------------
def test_chat_response_format_json_schema_equals_offline_engine(client, oracle, tokenizer):
    q = "Describe the os module as JSON."
    r = client.chat.completions.create(
        model=MODEL, messages=user(q), temperature=0, max_tokens=200,
        response_format={"type": "json_schema", "json_schema": {"name": "mod", "schema": SCHEMA, "strict": True}})
    text = r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(text), SCHEMA)
    assert text == offline(oracle, chat_ids(tokenizer, user(q)), SO(json=SCHEMA)).text


def test_completion_response_format_json_object(client, oracle, tokenizer):
    r = client.completions.create(model=MODEL, prompt="config = ", temperature=0, max_tokens=200,
                                  extra_body={"response_format": {"type": "json_object"}})
    assert r.choices[0].finish_reason == "stop" and isinstance(json.loads(r.choices[0].text), dict)
    assert r.choices[0].text == offline(oracle, tokenizer.encode("config = "), SO(json_object=True)).text


@pytest.mark.parametrize("extra,check", [
    ({"guided_regex": r"[a-z_]{1,10}\(\d{0,2}\)"}, lambda t: re.fullmatch(r"[a-z_]{1,10}\(\d{0,2}\)", t)),
    ({"guided_choice": ["read", "write", "seek"]}, lambda t: t in ("read", "write", "seek")),
    ({"guided_grammar": 'root ::= "x=" [0-9] [0-9]?'}, lambda t: re.fullmatch(r"x=\d\d?", t)),
    ({"guided_json": SCHEMA}, lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
    ({"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}},
     lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None and "\n" not in t),
], ids=["guided_regex", "guided_choice", "guided_grammar", "guided_json", "structured_outputs"])
def test_vllm_extras_constrain_streamed_chat(client, extra, check):
    stream = client.chat.completions.create(model=MODEL, messages=user("Name one."),
                                            temperature=0.7, seed=3, max_tokens=200, stream=True,
                                            extra_body=extra)
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert check(text), text


def test_length_mid_structure_and_logit_bias(client, oracle, tokenizer):
    r = client.completions.create(model=MODEL, prompt="data = ", temperature=0, max_tokens=4,
                                  extra_body={"guided_json": SCHEMA})
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 4
    with pytest.raises(json.JSONDecodeError):
        json.loads(r.choices[0].text)
    bias = {"300": 100, "301": -100}
    r = client.completions.create(model=MODEL, prompt="def main(", temperature=0, max_tokens=8, logit_bias=bias)
    ref = offline(oracle, tokenizer.encode("def main("), None, max_tokens=8, logit_bias=bias)
    assert r.choices[0].text == ref.text


# ---- bad input is a 400 naming the field -----------------------------------------------------------------------
def chat(extra: dict) -> dict:
    return {"messages": user("x"), "max_tokens": 8, **extra}


BAD = [
    # id, body, param, text the message must contain
    ("schema_bad_type", chat({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "no-such-type"}}}}), "response_format",
     "response_format.json_schema.schema: cannot compile"),
    ("schema_missing", chat({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}),
     "response_format", "response_format.json_schema.schema is required"),
    ("format_type", chat({"response_format": {"type": "yaml"}}), "response_format.type", "response_format"),
    ("regex_unclosed", chat({"guided_regex": "(ab"}), "guided_regex", "guided_regex: cannot compile"),
    ("grammar_undefined", chat({"guided_grammar": "root ::= nope"}), "guided_grammar", "nope"),
    ("guided_json_not_json", chat({"guided_json": "{nope"}), "guided_json", "guided_json is not valid JSON"),
    ("choice_empty", chat({"guided_choice": []}), "guided_choice", "non-empty list"),
    ("two_constraints", chat({"guided_regex": "a", "guided_choice": ["a"]}), "guided_regex",
     "only one structured output constraint"),
    ("structured_outputs_unknown_key", chat({"structured_outputs": {"yaml": "x"}}), "structured_outputs.yaml",
     "structured_outputs"),
    ("logit_bias_range", chat({"logit_bias": {"5": 500}}), "logit_bias", "[-100.0, 100.0]"),
    ("logit_bias_key", chat({"logit_bias": {"five": 1}}), "logit_bias", "logit_bias token id"),
    ("logit_bias_vocab", chat({"logit_bias": {"99999": 1}}), "logit_bias", "[0, 4096)"),
    ("allowed_token_ids_vocab", chat({"allowed_token_ids": [1, 99999]}), "allowed_token_ids", "[0, 4096)"),
]


@pytest.mark.parametrize("body,param,text", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_structured_input_is_400_naming_the_field(cluster, body, param, text):
    for stream in (False, True):
        r = httpx.post(cluster.api_url + "/chat/completions", json={**body, "stream": stream}, timeout=60)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert set(err) == ERROR_KEYS and err["type"] == "invalid_request_error"
        assert err["param"] == param and text in err["message"], err
        assert "Traceback" not in r.text and ".cc:" not in err["message"]


def test_server_serves_after_bad_grammars(client):
    r = client.chat.completions.create(model=MODEL, messages=user("Pick."),
                                       max_tokens=8, extra_body={"guided_choice": ["a", "b"]})
    assert r.choices[0].message.content in ("a", "b")
