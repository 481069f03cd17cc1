"""The HTTP service under hostile or careless use: API keys, request limits, grammar compile time, clean
accounting of user errors and disconnects, health under saturation, and a schemathesis fuzz run against the
app's own OpenAPI schema. One real cluster (one engine replica taking two requests at a time) for the module.
"""

from __future__ import annotations

import concurrent.futures
import json
import time
from pathlib import Path

import httpx
import openai
import pytest
import schemathesis
from schemathesis.core import NotSet
from hypothesis import HealthCheck, given, settings

from serve_cluster import serve_cluster, wait_for

KEYS = ["key-alpha", "key-beta"]
AUTH = {"Authorization": f"Bearer {KEYS[0]}"}
MODEL = "tandem-default"
MAX_MODEL_LEN = 256  # bounds every generation the fuzzer triggers
ERROR_KEYS = {"message", "type", "param", "code"}
APP = {"num_replicas": 1, "api_key": KEYS, "max_ongoing_requests": 2, "max_queued_requests": 64,
       "limits": {"max_body_bytes": 2 * 1024**2, "max_schema_bytes": 256 * 1024},
       "max_model_len": MAX_MODEL_LEN, "grammar_compile_timeout_s": 0.05}


@pytest.fixture(scope="module")
def cluster():
    with serve_cluster(APP) as c:
        yield c


@pytest.fixture(scope="module")
def client(cluster):
    return openai.OpenAI(base_url=cluster.api_url, api_key=KEYS[1], max_retries=0, timeout=60)


def post(cluster, path: str, body, headers=AUTH, timeout=60, **kw) -> httpx.Response:
    return httpx.post(cluster.api_url + path, json=body, headers=headers, timeout=timeout, **kw)


def assert_error(r: httpx.Response, status: int, param: str | None = None, contains: str = "") -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == ERROR_KEYS and err["message"], err
    if param is not None:
        assert err["param"] == param, err
    assert contains in err["message"], err
    assert "Traceback" not in r.text
    return err


# ---- API keys ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("method,path", [("GET", "/v1/models"), ("POST", "/v1/completions"),
                                         ("POST", "/v1/chat/completions"), ("GET", "/v1/nothing")])
@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": "key-alpha"},
                                     {"Authorization": "Basic a2V5LWFscGhh"}], ids=["none", "wrong", "no-scheme",
                                                                                   "basic"])
def test_every_v1_route_needs_a_valid_key(cluster, method, path, headers):
    r = httpx.request(method, cluster.base_url + path, headers=headers, json={}, timeout=30)
    err = assert_error(r, 401)
    assert err["code"] == "invalid_api_key" and r.headers.get("www-authenticate") == "Bearer"


def test_health_stays_open_and_every_key_works(cluster, client):
    assert httpx.get(cluster.base_url + "/health", timeout=30).status_code == 200
    for key in KEYS:
        r = httpx.get(cluster.api_url + "/models", headers={"Authorization": f"Bearer {key}"}, timeout=30)
        assert r.status_code == 200 and r.json()["data"][0]["id"] == MODEL
    out = client.completions.create(model=MODEL, prompt="Return the", max_tokens=4)  # the openai client's way
    assert out.usage.completion_tokens == 4
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=cluster.api_url, api_key="nope", max_retries=0).models.list()


# ---- limits ------------------------------------------------------------------------------------------------
def nested(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth - 1):
        schema = {"type": "array", "items": schema}
    return schema


LIMIT_CASES = [
    ("stop_count", {"prompt": "x", "stop": [f"s{i}" for i in range(50_000)]}, "stop", "at most 64 stop strings"),
    ("stop_length", {"prompt": "x", "stop": ["y" * 2000]}, "stop", "at most 1024 characters"),
    ("logit_bias", {"prompt": "x", "logit_bias": {str(i): 1 for i in range(2000)}}, "logit_bias", "at most 1024"),
    ("allowed_ids", {"prompt": "x", "allowed_token_ids": list(range(70_000))}, "allowed_token_ids",
     "at most 65536"),
    ("choices", {"prompt": "x", "guided_choice": [f"c{i}" for i in range(1500)]}, "guided_choice",
     "at most 1024 choices"),
    ("schema_depth", {"prompt": "x", "guided_json": nested(500)}, "guided_json", "at most 32 levels"),
    ("schema_depth_text", {"prompt": "x", "guided_json": json.dumps(nested(40))}, "guided_json",
     "at most 32 levels"),
    ("response_format_depth", {"messages": [{"role": "user", "content": "x"}], "response_format": {
        "type": "json_schema", "json_schema": {"name": "n", "schema": nested(33)}}},
     "response_format.json_schema.schema", "at most 32 levels"),
    ("regex_size", {"prompt": "x", "guided_regex": "a" * 70_000}, "guided_regex", "at most 65536 bytes"),
    ("context", {"prompt": "x", "max_tokens": 10**9}, "max_tokens",
     f"maximum context length is {MAX_MODEL_LEN} tokens. However, you requested"),
    ("tools", {"messages": [{"role": "user", "content": "x"}],
               "tools": [{"type": "function", "function": {"name": "f"}}]}, "tools", "not supported"),
    ("tool_choice", {"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}, "tool_choice",
     "not supported"),
    ("functions", {"messages": [{"role": "user", "content": "x"}], "functions": [{"name": "f"}]}, "functions",
     "not supported"),
    ("suffix", {"prompt": "x", "suffix": "end"}, "suffix", "not supported"),
    ("chat_best_of", {"messages": [{"role": "user", "content": "x"}], "best_of": 3}, "best_of", "not supported"),
    ("n", {"prompt": "x", "n": 17}, "n", "at most 16 samples per request"),
    ("best_of", {"prompt": "x", "best_of": 17}, "best_of", "at most 16 samples per request"),
    ("best_of_below_n", {"prompt": "x", "n": 3, "best_of": 2}, "best_of", "best_of must be >= n"),
    ("best_of_stream", {"prompt": "x", "n": 1, "best_of": 2, "stream": True}, "best_of",
     "cannot be used with stream"),
]


@pytest.mark.parametrize("body,param,contains", [c[1:] for c in LIMIT_CASES], ids=[c[0] for c in LIMIT_CASES])
def test_each_limit_is_a_400_naming_the_field_and_the_limit(cluster, body, param, contains):
    path = "/chat/completions" if "messages" in body else "/completions"
    assert_error(post(cluster, path, {"model": MODEL, **body}), 400, param, contains)


def test_an_oversized_body_gets_413_before_parsing(cluster):
    r = post(cluster, "/completions", {"model": MODEL, "prompt": "p" * 3 * 1024**2})
    assert_error(r, 413, contains="max_body_bytes")


def test_a_streamed_body_without_length_is_cut_at_the_limit(cluster):
    def chunks():
        yield b'{"model": "tandem-default", "prompt": "'
        for _ in range(3 * 1024):
            yield b"a" * 1024
        yield b'"}'
    r = httpx.post(cluster.api_url + "/completions", content=chunks(), timeout=30,
                   headers={**AUTH, "content-type": "application/json"})
    assert_error(r, 413, contains="max_body_bytes")


def test_no_max_tokens_gets_the_remaining_context(cluster):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Write a long story."}],
            "temperature": 0, "ignore_eos": True}
    r = post(cluster, "/chat/completions", body)
    usage = r.json()["usage"]
    assert r.json()["choices"][0]["finish_reason"] == "length"
    assert usage["prompt_tokens"] + usage["completion_tokens"] == MAX_MODEL_LEN


def test_a_grammar_over_its_compile_time_is_a_400(cluster):
    """grammar_compile_timeout_s is 0.05 s here; an enum of 5,000 values (~150 KB, unique so no cache has it)
    takes ~0.8 s to compile on the 2-core CI VM."""
    schema = {"type": "string", "enum": [f"value-{i}-{time.time_ns()}" for i in range(5000)]}
    r = post(cluster, "/completions", {"model": MODEL, "prompt": "x", "guided_json": schema})
    assert_error(r, 400, "guided_json", "did not compile within 0.05 s")
    assert post(cluster, "/completions", {"model": MODEL, "prompt": "x", "max_tokens": 4}).status_code == 200


# ---- accounting: user errors and disconnects are not server faults ----------------------------------------------
def serve_logs(cluster) -> str:
    logs = Path(cluster.temp_dir).glob("session_*/logs/serve/*.log")
    return "\n".join(p.read_text(errors="replace") for p in logs)


def test_user_errors_and_disconnects_log_no_traceback(cluster):
    bad_grammar = {"model": MODEL, "prompt": "x", "guided_regex": "(unclosed"}
    assert_error(post(cluster, "/completions", bad_grammar), 400, "guided_regex", "cannot compile")
    body = {"model": MODEL, "prompt": "Return the", "max_tokens": 200, "ignore_eos": True, "temperature": 0}
    with httpx.stream("POST", cluster.api_url + "/completions", json={**body, "stream": True}, headers=AUTH,
                      timeout=30) as r:  # leave a stream after a few events
        for n, _ in enumerate(r.iter_lines()):
            if n == 4:
                break
    # give up on a whole response before it is ready: the longest the context allows, which the colocated app
    # (the default here: one CPU replica) finishes in ~0.4-0.5 s on the 2-core dev VM
    with pytest.raises(httpx.ReadTimeout):
        post(cluster, "/completions", {**body, "max_tokens": MAX_MODEL_LEN - 6}, timeout=httpx.Timeout(30, read=0.1))
    time.sleep(2)
    logs = serve_logs(cluster)
    assert "cannot compile" in logs  # the rejection was logged, as one line...
    assert "Traceback" not in logs and "engine failure" not in logs  # ...and no fault was


def test_a_lost_replica_is_replica_died_whether_its_actor_died_or_its_engine_shut_down():
    """An engine shut down under a stream (a drained replica past its grace period) is the same failure for
    the client as a dead actor: replica_died (retryable, and retried before the first token), not internal.
    Over Ray actor calls the replica's exception arrives wrapped in a RayTaskError, over Serve's gRPC transport
    (the default engine_transport) as itself: both map the same."""
    from ray.exceptions import ActorDiedError, ActorUnavailableError, RayTaskError

    from engine.async_engine import EngineDeadError
    from serve_app.errors import from_engine_failure, replica_lost

    shut_down = EngineDeadError("the engine shut down")
    for exc in (RayTaskError("generate", "traceback", shut_down), shut_down, ActorDiedError(),
                ActorUnavailableError("unreachable", None)):
        assert replica_lost(exc) and from_engine_failure(exc).code == "replica_died"
    for bug in (RuntimeError("bug"), RayTaskError("generate", "traceback", RuntimeError("bug"))):
        assert not replica_lost(bug) and from_engine_failure(bug).code == "internal_error"
    bad = ValueError("temperature must be >= 0")
    for exc in (RayTaskError("generate", "traceback", bad), bad):
        assert not replica_lost(exc) and from_engine_failure(exc).status == 400
        assert from_engine_failure(exc).body()["error"]["param"] == "temperature"


def test_a_cancelled_proxy_receive_is_a_disconnect_not_an_error():
    """Serve's ASGI receive raises TaskCancelledError when the proxy cancels it (the client left); the middleware
    turns that into http.disconnect, so a streaming response ends quietly. Without it the error escaped the app
    (a traceback per disconnected stream: bench/soak.py logged 51 in 90 s)."""
    import asyncio

    from fastapi import FastAPI
    from fastapi.responses import StreamingResponse
    from ray.exceptions import TaskCancelledError

    from serve_app.middleware import Guard, GuardMiddleware

    app = FastAPI()
    app.add_middleware(GuardMiddleware)
    app.state.tandem_guard = Guard(api_keys=(), max_body_bytes=1 << 20)

    async def forever():
        while True:
            yield b"data: x\n\n"
            await asyncio.sleep(0.01)

    app.get("/stream")(lambda: StreamingResponse(forever(), media_type="text/event-stream"))
    sent, received = [], 0

    async def receive():
        nonlocal received
        received += 1
        if received == 1:
            return {"type": "http.request", "body": b"", "more_body": False}
        await asyncio.sleep(0.05)
        raise TaskCancelledError()

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.1"}, "http_version": "1.1",
             "method": "GET", "path": "/stream", "raw_path": b"/stream", "query_string": b"", "headers": [],
             "scheme": "http", "server": ("127.0.0.1", 8000), "client": ("127.0.0.1", 5000), "root_path": ""}
    asyncio.run(asyncio.wait_for(app(scope, receive, send), 10))  # returns: the stream ended at the disconnect
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 200
    assert any(m.get("body") == b"data: x\n\n" for m in sent[1:])


# ---- health ------------------------------------------------------------------------------------------------
def test_health_is_fast_and_ok_while_the_only_replica_is_saturated(cluster):
    long_body = {"model": MODEL, "prompt": "Return the", "max_tokens": 200, "ignore_eos": True}
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        pending = [pool.submit(post, cluster, "/completions", long_body) for _ in range(6)]
        time.sleep(1.0)  # two running, four queued behind max_ongoing_requests
        t0 = time.monotonic()
        r = httpx.get(cluster.base_url + "/health", timeout=30)
        took = time.monotonic() - t0
        assert r.status_code == 200 and r.json()["engine_replicas"] == 1
        assert took < 5.0, took  # it never waits behind the queued requests
        assert all(f.result().status_code == 200 for f in pending)


# ---- fuzzing the app's own OpenAPI schema ------------------------------------------------------------------
FUZZ_EXAMPLES = 40  # per operation: bounded so the suite stays quick (generations are capped at 256 tokens)


def test_fuzzed_requests_never_get_a_5xx_and_4xx_are_openai_errors(cluster):
    """schemathesis generates requests from the OpenAPI schema the server publishes (valid and not, derandomized
    so CI runs the same ones), hypothesis drives them; each must get < 500, and a 4xx must be an OpenAI error."""
    spec = httpx.get(cluster.base_url + "/openapi.json", timeout=30).json()
    operations = [r.ok() for r in schemathesis.openapi.from_dict(spec).get_all_operations()]
    assert {(o.method, o.path) for o in operations} >= {("post", "/v1/completions"),
                                                          ("post", "/v1/chat/completions"), ("get", "/v1/models")}
    seen: dict[int, int] = {}

    for operation in operations:
        @given(case=operation.as_strategy())
        @settings(max_examples=FUZZ_EXAMPLES, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        def check(case):
            # Sent with httpx (schemathesis's own requests transport does not run against this urllib3).
            body = {} if isinstance(case.body, NotSet) else {"json": case.body}
            response = httpx.request(case.method, cluster.base_url + case.formatted_path, params=case.query,
                                     headers={**(case.headers or {}), **AUTH}, timeout=60, **body)
            seen[response.status_code] = seen.get(response.status_code, 0) + 1
            assert response.status_code < 500, (case.path, case.body, response.text[:500])
            if 400 <= response.status_code < 500:
                assert set(response.json()["error"]) == ERROR_KEYS, response.text[:500]

        check()
    assert seen.get(400, 0) > 0 and seen.get(200, 0) > 0, seen  # both rejections and real answers were exercised


def test_the_server_is_healthy_after_the_fuzzing(cluster, client):
    wait_for(lambda: httpx.get(cluster.base_url + "/health", timeout=10).status_code == 200, 30, what="health")
    out = client.completions.create(model=MODEL, prompt="Return the", max_tokens=4, temperature=0)
    assert out.choices[0].finish_reason == "length"
