"""`colocated: true`: the OpenAI ingress with its engine in one Serve replica (serve_app/colocated.py).

Oracle: the offline engine on the same embedded model; greedy output, whole and streamed, must match exactly.
A client that leaves must still abort its request and free its KV blocks, bad input must still get its 400,
and /health must count the replica's engine, since there is no engine deployment to ask Serve about.
"""

from __future__ import annotations

import json

import httpx
import pytest
from ray import serve

from engine import LLM, SamplingParams
from serve_app import build_app
from serve_app.builder import COLOCATED_DEPLOYMENT
from serve_cluster import serve_cluster
from test_serve_app import (MODEL, PROMPTS, check_disconnect_frees_blocks,
                            test_client_giving_up_on_non_streaming_request_frees_blocks as check_give_up_frees_blocks)


@pytest.fixture(scope="module")
def cluster():
    with serve_cluster({"device": "cpu", "colocated": True}) as c:
        yield c


def test_options_that_need_the_split_app_are_refused_by_name():
    for args, named in (({"max_replicas": 2}, "autoscaling"), ({"ingress_replicas": 2}, "ingress_replicas"),
                        ({"tensor_parallel_size": 2}, "tensor_parallel_size"),
                        ({"engine": {"pipeline_parallel_size": 2}}, "pipeline_parallel_size")):
        with pytest.raises(ValueError, match=named):
            build_app({"device": "cpu", "colocated": True, **args})


def test_one_deployment_serves_and_holds_the_engine(cluster):
    deployments = serve.status().applications[cluster.app_name].deployments
    assert set(deployments) == {COLOCATED_DEPLOYMENT}
    assert cluster.running_replicas(COLOCATED_DEPLOYMENT) == 1
    health = httpx.get(cluster.base_url + "/health", timeout=30)
    assert health.status_code == 200 and health.json()["engine_replicas"] == 1


def test_streamed_and_whole_outputs_match_the_offline_engine(cluster):
    llm = LLM()
    try:
        expected = llm.generate(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=24))
    finally:
        llm.shutdown()
    for prompt, want in zip(PROMPTS[:2], expected):
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 24, "temperature": 0}
        whole = httpx.post(cluster.api_url + "/completions", json=body, timeout=60)
        assert whole.status_code == 200, whole.text
        assert whole.json()["choices"][0]["text"] == want.text
        assert whole.json()["usage"]["completion_tokens"] == len(want.token_ids)
        with httpx.stream("POST", cluster.api_url + "/completions",
                          json={**body, "stream": True, "stream_options": {"include_usage": True}}, timeout=60) as r:
            assert r.status_code == 200
            lines = [ln[len("data: "):] for ln in r.iter_lines() if ln.startswith("data: ")]
        assert lines[-1] == "[DONE]"
        events = [json.loads(ln) for ln in lines[:-1]]
        assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == want.text
        assert events[-1]["usage"]["completion_tokens"] == len(want.token_ids)


def test_bad_input_gets_a_400_naming_the_field_and_the_replica_serves_on(cluster):
    r = httpx.post(cluster.api_url + "/completions", json={"model": MODEL, "prompt": [10**9], "max_tokens": 4},
                   timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    r = httpx.post(cluster.api_url + "/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 10**7},
                   timeout=30)
    assert r.status_code == 400 and "max_tokens" in r.text, r.text
    ok = httpx.post(cluster.api_url + "/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2},
                    timeout=60)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2


def test_a_disconnect_frees_the_requests_blocks(cluster):
    check_disconnect_frees_blocks(cluster)


def test_a_client_giving_up_on_a_whole_response_frees_its_blocks(cluster):
    check_give_up_frees_blocks(cluster)
