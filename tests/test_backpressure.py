"""Bounded queues: with one replica that takes one request at a time and queues one more, a burst of requests
gets 503 + Retry-After with an OpenAI error body for the overflow, the admitted ones complete, and the
server serves normally afterwards."""

from __future__ import annotations

import concurrent.futures

import httpx
import pytest

from serve_cluster import serve_cluster

BURST = 8


@pytest.fixture(scope="module")
def cluster():
    with serve_cluster({"num_replicas": 1, "max_ongoing_requests": 1, "max_queued_requests": 1}) as c:
        yield c


def _post(url: str, max_tokens: int) -> httpx.Response:
    body = {"model": "tandem-default", "prompt": "Return a new", "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True}
    return httpx.post(url, json=body, timeout=120)


def test_overflow_gets_503_with_retry_after_and_the_rest_complete(cluster):
    url = cluster.api_url + "/completions"
    with concurrent.futures.ThreadPoolExecutor(BURST) as pool:
        responses = list(pool.map(lambda _: _post(url, 200), range(BURST)))
    codes = sorted(r.status_code for r in responses)
    assert 200 in codes and 503 in codes and set(codes) <= {200, 503}, codes
    for r in responses:
        if r.status_code == 503:
            assert int(r.headers.get("Retry-After", 0)) > 0, (dict(r.headers), r.text)
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"} and err["code"] == "overloaded"
        else:
            assert r.json()["usage"]["completion_tokens"] == 200
    after = _post(url, 8)  # the burst is over: served normally
    assert after.status_code == 200 and after.json()["choices"][0]["finish_reason"] == "length"
