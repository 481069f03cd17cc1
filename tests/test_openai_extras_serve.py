"""vLLM's extras over HTTP, on one colocated app with an API key: the model's sampling defaults
(engine/generation_config.py), POST /tokenize and /detokenize, and the chat fields chat_template_kwargs,
continue_final_message and add_special_tokens.

The model is a copy of the embedded one with a generation_config.json that says top_k 1 (so requests that leave
top_k unset decode greedily whatever their seed and temperature; the explicitly greedy request, temperature 0,
gives that independently of any default); the app's `chat_template` (a file) replaces its template with one
that reads a `shout` keyword. Oracle for every
prompt: transformers' own tokenizer on the same files (apply_chat_template, encode, decode)."""

from __future__ import annotations

import json
import shutil

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from engine.config import DEFAULT_MODEL_DIR

KEY = "sk-extras"
TEMPLATE = ("{% if messages|length == 1 and messages[0]['role'] == 'system' %}"
            "{{ raise_exception('a system message alone is not a conversation') }}{% endif %}"
            "{% if shout %}{{ '<|im_start|>system\\nSHOUT<|im_end|>\\n' }}{% endif %}"
            "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
            "'<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
            "{% endif %}")
MESSAGES = [{"role": "user", "content": "Return the sum"}, {"role": "assistant", "content": "def add(a, b):"}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("extras") / "m"
    shutil.copytree(DEFAULT_MODEL_DIR, out)
    (out / "generation_config.json").write_text(json.dumps({"top_k": 1, "temperature": 1.5, "max_new_tokens": 64}))
    return str(out)


@pytest.fixture(scope="module")
def template_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("template") / "shout.jinja"
    path.write_text(TEMPLATE)
    return str(path)


@pytest.fixture(scope="module")
def served(model_dir, template_file):
    from serve_cluster import serve_cluster

    # the override arrives as `serve run` passes it (a JSON string) and caps at 6 over the file's 64; the chat
    # template (read from its file) replaces the model's own
    with serve_cluster({"model": model_dir, "override_generation_config": '{"max_new_tokens": 6}',
                        "api_key": KEY, "chat_template": template_file}) as c:
        yield c


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served.api_url, api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def tok(model_dir):
    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    assert "SHOUT" not in tok.chat_template  # the model's own; the server was given TEMPLATE
    tok.chat_template = TEMPLATE
    return tok


def post(served, path: str, body: dict, key: str | None = KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{served.base_url}{path}", json=body, headers=headers, timeout=60)


def chat_ids(tok, messages, **kwargs) -> list[int]:
    return tok.encode(tok.apply_chat_template(messages, tokenize=False, **kwargs), add_special_tokens=False)


def test_requests_get_the_models_sampling_defaults(client):
    model = client.models.list().data[0].id
    extra = {"ignore_eos": True}
    greedy = client.completions.create(model=model, prompt="Return the", max_tokens=6, temperature=0,
                                       extra_body=extra).choices[0].text
    # top_k unset -> the model's 1: greedy whatever the seed (and temperature); max_tokens over the cap -> 6
    for seed in (1, 2, 3):
        r = client.completions.create(model=model, prompt="Return the", max_tokens=100, seed=seed, extra_body=extra)
        assert r.choices[0].text == greedy and r.usage.completion_tokens == 6
    chat = client.chat.completions.create(model=model, messages=MESSAGES[:1], seed=4, extra_body=extra)
    assert chat.usage.completion_tokens == 6  # no max_tokens: the cap, not the context left
    # an explicit top_k wins: sampled at temperature 1.5 with top-k off, the seeds no longer agree
    texts = {client.completions.create(model=model, prompt="Return the", seed=seed,
                                       extra_body={**extra, "top_k": -1}).choices[0].text for seed in range(4)}
    assert len(texts) > 1


def test_tokenize_and_detokenize_match_transformers(served, tok):
    prompt = "def read_config(path):"
    r = post(served, "/tokenize", {"prompt": prompt, "return_token_strs": True}).json()
    ids = tok.encode(prompt, add_special_tokens=True)
    assert r["tokens"] == ids and r["count"] == len(ids) and r["token_strs"] == tok.convert_ids_to_tokens(ids)
    assert r["max_model_len"] == json.loads((DEFAULT_MODEL_DIR / "config.json").read_text())["max_position_embeddings"]
    assert post(served, "/detokenize", {"tokens": ids}).json() == {"prompt": tok.decode(ids)}
    r = post(served, "/tokenize", {"messages": MESSAGES[:1]}).json()
    assert r["tokens"] == chat_ids(tok, MESSAGES[:1], add_generation_prompt=True) and r["token_strs"] is None


def test_chat_fields_render_as_transformers_renders_them(served, client, tok):
    model = client.models.list().data[0].id
    cases = [
        ({"chat_template_kwargs": {"shout": True}}, dict(add_generation_prompt=True, shout=True)),
        ({"add_generation_prompt": False, "continue_final_message": True},
         dict(add_generation_prompt=False, continue_final_message=True)),
    ]
    plain = chat_ids(tok, MESSAGES, add_generation_prompt=True)
    for fields, hf_kwargs in cases:
        want = chat_ids(tok, MESSAGES, **hf_kwargs)
        assert want != plain  # the field changes what is rendered
        assert post(served, "/tokenize", {"messages": MESSAGES, **fields}).json()["tokens"] == want
        r = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=2, extra_body=fields)
        assert r.usage.prompt_tokens == len(want)
    # add_special_tokens puts the tokenizer's own specials on top of the template's (none for this tokenizer,
    # whose encode adds nothing: the same ids, as transformers gives them)
    r = post(served, "/tokenize", {"messages": MESSAGES, "add_special_tokens": True}).json()
    assert r["tokens"] == tok.encode(tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True),
                                     add_special_tokens=True)


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", {"messages": MESSAGES, "continue_final_message": True}, "continue_final_message"),
    ("/tokenize", {"messages": MESSAGES, "continue_final_message": True}, "continue_final_message"),
    ("/v1/chat/completions", {"messages": MESSAGES, "chat_template_kwargs": {"tokenize": True}},
     "chat_template_kwargs"),
    ("/tokenize", {"prompt": "a", "messages": MESSAGES}, "prompt"),
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"messages": []}, "messages"),
    ("/detokenize", {"tokens": [0, 10**9]}, "tokens"),
    ("/tokenize", {"prompt": "a", "model": "no-such-model"}, "model"),
    # the template's raise_exception (a jinja2 TemplateError, not a ValueError: a 500 before)
    ("/v1/chat/completions", {"messages": [{"role": "system", "content": "x"}]}, "messages"),
])
def test_bad_extras_are_400s_naming_the_field(served, path, body, param):
    r = post(served, path, body)
    assert r.status_code == (404 if param == "model" else 400), r.text
    assert r.json()["error"]["param"] == param, r.text


def test_tokenize_routes_need_the_api_key(served):
    for path, body in (("/tokenize", {"prompt": "a"}), ("/detokenize", {"tokens": [1]})):
        assert post(served, path, body, key=None).status_code == 401
        assert post(served, path, body, key="wrong").status_code == 401
        assert post(served, path, body).status_code == 200
    assert httpx.get(f"{served.base_url}/health", timeout=30).status_code == 200


def test_version_route_reports_the_installed_package_open_like_health(served):
    """vLLM's GET /version: the installed tandem package's version, without the API key (as /health)."""
    import importlib.metadata

    r = httpx.get(f"{served.base_url}/version", timeout=30)
    assert r.status_code == 200 and r.json() == {"version": importlib.metadata.version("tandem")}


def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(client):
    model = client.models.list().data[0].id
    opts = {"include_usage": True, "continuous_usage_stats": True}
    stream = client.chat.completions.create(model=model, messages=MESSAGES[:1], max_tokens=5, n=2, seed=1,
                                            temperature=1.0, stream=True, stream_options=opts,
                                            extra_body={"ignore_eos": True, "top_k": -1})
    chunks = list(stream)
    final = chunks[-1]
    assert not final.choices and final.usage.completion_tokens == 10  # both choices' tokens, once
    prompt = final.usage.prompt_tokens
    seen = {0: 0, 1: 0}  # each choice's tokens so far, from its content deltas' usage
    for c in chunks[:-1]:
        assert c.usage is not None and c.usage.prompt_tokens == prompt
        assert c.usage.total_tokens == prompt + c.usage.completion_tokens
        i = c.choices[0].index
        assert c.usage.completion_tokens >= seen[i]  # never goes back
        seen[i] = c.usage.completion_tokens
    assert seen == {0: 5, 1: 5}
    plain = list(client.completions.create(model=model, prompt="Return the", max_tokens=3, stream=True,
                                           stream_options={"include_usage": True}))
    assert all(c.usage is None for c in plain[:-1]) and plain[-1].usage.completion_tokens == 3


def test_a_prompt_array_answers_each_prompt_in_order(client, tok):
    """OpenAI's prompt array: prompt i's n choices at i*n .., each what that prompt alone gives; usage summed."""
    model = client.models.list().data[0].id
    prompts = ["Return the", "def add(a, b):", "import os"]
    kw = dict(model=model, max_tokens=4, temperature=0, extra_body={"ignore_eos": True})
    alone = [client.completions.create(prompt=p, echo=True, **kw) for p in prompts]
    r = client.completions.create(prompt=prompts, n=2, echo=True, **kw)
    assert [c.index for c in r.choices] == list(range(6))
    for i, single in enumerate(alone):
        assert [c.text for c in r.choices[2 * i:2 * i + 2]] == [single.choices[0].text] * 2
        assert single.choices[0].text.startswith(prompts[i])
    assert r.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in alone)
    assert r.usage.completion_tokens == 6 * 4
    # streamed: the same choices, interleaved, under one id, with the usage summed once at the end
    chunks = list(client.completions.create(prompt=prompts, n=2, echo=True, stream=True,
                                            stream_options={"include_usage": True}, **kw))
    texts = {}
    for c in chunks[:-1]:
        assert len(c.choices) == 1 and c.usage is None
        texts[c.choices[0].index] = texts.get(c.choices[0].index, "") + c.choices[0].text
    assert texts == {c.index: c.text for c in r.choices}
    assert len({c.id for c in chunks}) == 1
    assert not chunks[-1].choices and chunks[-1].usage == r.usage
    ids = [tok.encode(p) for p in prompts[:2]]  # token-id prompts: the same answers
    by_ids = client.completions.create(prompt=ids, **kw)
    assert [c.text for c in by_ids.choices] == [alone[0].choices[0].text[len(prompts[0]):],
                                               alone[1].choices[0].text[len(prompts[1]):]]


@pytest.mark.parametrize("body, code", [
    ({"prompt": ["a"] * 65}, "limit_exceeded"),
    ({"prompt": ["a", ""]}, None),
    ({"prompt": ["a", "b " * 5000], "max_tokens": 4}, "context_length_exceeded"),
])
def test_bad_prompt_arrays_are_400s_naming_prompt(served, body, code):
    """Refused before any prompt runs (each is checked first)."""
    r = post(served, "/v1/completions", {"max_tokens": 2, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "prompt" and err["code"] == code, err


def test_chat_template_argument_takes_a_file_or_the_template_and_checks_it(tmp_path, template_file):
    from serve_app.builder import AppConfig
    from serve_app.tools import load_chat_template

    assert load_chat_template(template_file) == TEMPLATE
    assert load_chat_template(TEMPLATE) == TEMPLATE
    with pytest.raises(ValueError, match="chat_template: .* is neither a file nor a Jinja template"):
        AppConfig(chat_template=str(tmp_path / "missing.jinja"))
    with pytest.raises(ValueError, match="chat_template: not a valid Jinja template"):
        AppConfig(chat_template="{% for m in messages %}{{ m['content'] }}")  # no endfor


def test_unknown_request_fields_are_named_in_a_warning():
    """Unknown fields are accepted (as OpenAI's API does) but named in the log, as vLLM does, so a misspelt
    field is not ignored silently; declared fields and a request without extras log nothing."""
    import logging

    from serve_app.protocol import ChatCompletionRequest, CompletionRequest

    records = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    log = logging.getLogger("ray.serve")  # (Ray's logger does not propagate to pytest's capture)
    log.addHandler(handler)
    try:
        CompletionRequest.model_validate({"prompt": "x", "max_tokns": 5, "temperature": 0.5, "metadata": {}})
        ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi", "extra": 1}],
                                              "top_k": 3})
    finally:
        log.removeHandler(handler)
    warned = [r.getMessage() for r in records if "ignored" in r.getMessage()]
    assert warned == ["The following fields were present in the request but ignored: ['max_tokns', 'metadata']"]
