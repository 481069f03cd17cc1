"""Serve's direct ingress (RAY_SERVE_ENABLE_DIRECT_INGRESS=1), the opt-in path the README and docs/serving.md
recommend for the highest rate on one node: the ingress replica serves the API on a port of its own (30000 up)
next to Serve's proxy.

Oracle: the offline engine on the same embedded model (greedy, whole and streamed, exactly), on both ports. The
replica's own port must not bypass what the proxy's port enforces (API keys), and a client that leaves it must
still abort its request and free its KV blocks.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import httpx
import pytest

from engine import LLM, SamplingParams
from serve_cluster import serve_cluster
from test_colocated import _check_leaving_aborts
from test_serve_app import MODEL, PROMPTS

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from bench_serve import direct_ingress_port  # noqa: E402  (the port moves: it finds it)

KEY = "key-direct"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def cluster():
    # Read by every Serve process, so set before the module's cluster starts, and only for it. A replica that
    # stops holds its port 30 s by default for load balancers to notice: none here.
    with pytest.MonkeyPatch.context() as env:
        env.setenv("RAY_SERVE_ENABLE_DIRECT_INGRESS", "1")
        env.setenv("RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S", "0")
        with serve_cluster({"device": "cpu", "api_key": KEY}) as c:
            # Tandem's /health (open without a key), not another server's on the range
            port = direct_ingress_port("/health", lambda r: r.status_code == 200 and "engine_replicas" in r.json())
            c.direct_url = f"http://127.0.0.1:{port}"
            yield c


def test_both_ports_serve_the_offline_engines_greedy_text(cluster):
    assert cluster.direct_url != cluster.base_url
    llm = LLM()
    try:
        want = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=24))[0]
    finally:
        llm.shutdown()
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 24, "temperature": 0}
    for base in (cluster.base_url, cluster.direct_url):
        whole = httpx.post(base + "/v1/completions", json=body, headers=AUTH, timeout=60)
        assert whole.status_code == 200, (base, whole.text)
        assert whole.json()["choices"][0]["text"] == want.text, base
        with httpx.stream("POST", base + "/v1/completions", headers=AUTH, timeout=60,
                          json={**body, "stream": True, "stream_options": {"include_usage": True}}) as r:
            assert r.status_code == 200, base
            lines = [ln[len("data: "):] for ln in r.iter_lines() if ln.startswith("data: ")]
        assert lines[-1] == "[DONE]", base
        events = [json.loads(ln) for ln in lines[:-1]]
        assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == want.text, base
        assert events[-1]["usage"]["completion_tokens"] == len(want.token_ids), base


def test_the_replicas_own_port_needs_the_api_key_too(cluster):
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = httpx.post(cluster.direct_url + "/v1/completions", json=body, headers=headers, timeout=30)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", r.text
    assert httpx.get(cluster.direct_url + "/v1/models", timeout=30).status_code == 401
    assert httpx.get(cluster.direct_url + "/v1/models", headers=AUTH, timeout=30).json()["data"][0]["id"] == MODEL


def test_leaving_a_stream_on_the_replicas_port_aborts_it_and_frees_its_blocks(cluster):
    def leave(body):
        with httpx.stream("POST", cluster.direct_url + "/v1/completions", json={**body, "stream": True},
                          headers=AUTH, timeout=60) as r:
            assert r.status_code == 200
            got = [line for line, _ in zip((ln for ln in r.iter_lines() if ln), range(5))]
            assert len(got) == 5 and not any("[DONE]" in g for g in got)

    _check_leaving_aborts(cluster, leave)
