"""Both ways a stream crosses Serve. The other Serve tests run the defaults: the proxy on gRPC
(tests/serve_cluster.py applies serve_app.builder.CLUSTER_ENV as scripts/serve.sh does), and where the app is
split, the ingress streams from the engine over gRPC on CPU (engine_transport auto) and over Ray actor calls on a
GPU or the simulated device. This module runs Serve's own default on both hops on CPU (`engine_transport: ray`,
RAY_SERVE_PROXY_USE_GRPC=0), so that combination keeps working too.

Oracle: the offline engine on the same embedded model; greedy output must match exactly. A disconnect must still
abort the request and free its KV blocks.
"""

from __future__ import annotations

import json

import httpx
import pytest

from engine import LLM, SamplingParams
from serve_app import build_app
from serve_cluster import serve_cluster
from test_serve_app import MODEL, PROMPTS, check_disconnect_frees_blocks


@pytest.fixture(scope="module")
def cluster():
    with pytest.MonkeyPatch.context() as env:
        env.setenv("RAY_SERVE_PROXY_USE_GRPC", "0")  # read by the proxy process this cluster starts
        with serve_cluster({"engine_transport": "ray"}) as c:
            yield c


def test_the_transport_is_an_app_option_grpc_on_cpu_and_ray_elsewhere_by_default():
    def transport(args: dict) -> str:
        return build_app(args)._bound_deployment.init_kwargs["engine_transport"]

    assert transport({"device": "cpu", "colocated": False}) == "grpc"
    assert transport({"device": "sim", "colocated": False}) == "ray"
    assert transport({"device": "cpu", "engine_transport": "ray"}) == "ray"
    assert transport({"device": "sim", "engine_transport": "grpc"}) == "grpc"
    with pytest.raises(ValueError, match="engine_transport"):
        build_app({"device": "cpu", "engine_transport": "zmq"})


def test_streamed_and_whole_outputs_match_the_offline_engine(cluster):
    llm = LLM()
    try:
        [expected] = llm.generate([PROMPTS[3]], SamplingParams(temperature=0, max_tokens=24))
    finally:
        llm.shutdown()
    body = {"model": MODEL, "prompt": PROMPTS[3], "max_tokens": 24, "temperature": 0}
    whole = httpx.post(cluster.api_url + "/completions", json=body, timeout=60)
    assert whole.status_code == 200, whole.text
    assert whole.json()["choices"][0]["text"] == expected.text
    with httpx.stream("POST", cluster.api_url + "/completions", json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        lines = [ln[len("data: "):] for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    assert "".join(json.loads(ln)["choices"][0]["text"] for ln in lines[:-1]) == expected.text


def test_a_disconnect_frees_the_requests_blocks(cluster):
    check_disconnect_frees_blocks(cluster)
