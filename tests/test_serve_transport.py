"""Both ways a stream crosses Serve. The other Serve tests run the defaults: the proxy on gRPC
(tests/serve_cluster.py applies serve_app.builder.CLUSTER_ENV as scripts/serve.sh does), and the ingress streams
from the engine over gRPC on CPU (engine_transport auto), over Ray actor calls on the simulated device
(tests/test_sim_serve.py). This module runs Serve's own default on both hops on CPU (`engine_transport: ray`,
RAY_SERVE_PROXY_USE_GRPC=0), so that combination keeps working too.

Oracle: the offline engine on the same embedded model; greedy output must match exactly. A disconnect must still
abort the request and free its KV blocks.
"""

from __future__ import annotations

import json
import os
import time

import httpx
import pytest
import ray

from engine import LLM, SamplingParams
from serve_app import build_app
from serve_cluster import serve_cluster, wait_for

MODEL = "tandem-default"
PROMPT = "Return the number of"


@pytest.fixture(scope="module")
def cluster():
    before = os.environ.get("RAY_SERVE_PROXY_USE_GRPC")
    os.environ["RAY_SERVE_PROXY_USE_GRPC"] = "0"  # read by the proxy process this cluster starts
    try:
        with serve_cluster({"engine_transport": "ray"}) as c:
            yield c
    finally:
        if before is None:
            os.environ.pop("RAY_SERVE_PROXY_USE_GRPC", None)
        else:
            os.environ["RAY_SERVE_PROXY_USE_GRPC"] = before


def kv_state(cluster) -> dict:
    [actor] = cluster.engine_replica_actors()
    return ray.get(actor.record_routing_stats.remote(), timeout=20)


def test_the_transport_is_an_app_option_grpc_on_cpu_and_ray_elsewhere_by_default():
    def transport(args: dict) -> str:
        return build_app(args)._bound_deployment.init_kwargs["engine_transport"]

    assert transport({"device": "cpu"}) == "grpc" and transport({"device": "sim"}) == "ray"
    assert transport({"device": "cpu", "engine_transport": "ray"}) == "ray"
    assert transport({"device": "sim", "engine_transport": "grpc"}) == "grpc"
    with pytest.raises(ValueError, match="engine_transport"):
        build_app({"device": "cpu", "engine_transport": "zmq"})


def test_streamed_and_whole_outputs_match_the_offline_engine(cluster):
    llm = LLM()
    try:
        [expected] = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=24))
    finally:
        llm.shutdown()
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 24, "temperature": 0}
    whole = httpx.post(cluster.api_url + "/completions", json=body, timeout=60)
    assert whole.status_code == 200, whole.text
    assert whole.json()["choices"][0]["text"] == expected.text
    with httpx.stream("POST", cluster.api_url + "/completions", json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        lines = [ln[len("data: "):] for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    assert "".join(json.loads(ln)["choices"][0]["text"] for ln in lines[:-1]) == expected.text


def test_a_disconnect_frees_the_requests_blocks(cluster):
    wait_for(lambda: kv_state(cluster)["num_running"] == 0, 30, what="an idle replica before the test")
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 1000, "ignore_eos": True, "temperature": 0,
            "stream": True}
    with httpx.stream("POST", cluster.api_url + "/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        got = [ln for ln, _ in zip((ln for ln in r.iter_lines() if ln), range(5))]
        assert len(got) == 5
        busy = kv_state(cluster)
        assert busy["num_running"] == 1 and busy["kv_blocks_free"] < busy["kv_blocks_total"]
    closed = time.monotonic()
    # All 1000 tokens take >10 s here: freed within 4 s means the engine aborted the request.
    wait_for(lambda: (lambda s: s["num_running"] == 0 and s["kv_blocks_free"] == s["kv_blocks_total"])(
        kv_state(cluster)), 4, 0.1, what="KV blocks freed after the disconnect")
    assert time.monotonic() - closed < 4
