"""Tensor parallelism through Serve, enabled by the app config key: each engine replica is rank 0 of a TP=2 group
whose worker rank is a Ray actor in the replica's placement group; greedy completions (plain and streamed)
equal the single engine's on the embedded default model (4 KV heads split over the 2 ranks, tied head).
Killing the worker ends the replica's streams with an error within seconds; Serve then replaces the replica
(its health check fails) and the new replica's group serves."""

from __future__ import annotations

import threading
import time

import openai
import pytest
import ray

from engine import LLM, SamplingParams
from serve_cluster import serve_cluster, wait_for
from test_serve_app import PROMPTS, _stream_outcome


@pytest.fixture(scope="module")
def cluster():
    with serve_cluster({"num_replicas": 1, "tensor_parallel_size": 2, "tp_worker_num_cpus": 1.0}) as c:
        yield c


def worker_actors() -> dict[str, object]:
    """Live TP worker actors by name (cluster/tensor_parallel.py names them <group>-rank<r>)."""
    return {e["name"]: ray.get_actor(e["name"], namespace=e["namespace"])
            for e in ray.util.list_named_actors(all_namespaces=True) if e["name"].startswith("tandem-tp-")}


def test_tp2_replica_equals_the_single_engine(cluster):
    assert len(worker_actors()) == 1
    oracle = LLM()
    try:
        ref = oracle.generate(PROMPTS[:4], SamplingParams(max_tokens=12, temperature=0))
    finally:
        oracle.shutdown()
    client = openai.OpenAI(base_url=cluster.api_url, api_key="unused", max_retries=0, timeout=60)
    for prompt, want in zip(PROMPTS[:4], ref):
        r = client.completions.create(model="tandem-default", prompt=prompt, max_tokens=12, temperature=0)
        assert r.choices[0].text == want.text
        assert r.usage.completion_tokens == len(want.token_ids)
    stream = client.completions.create(model="tandem-default", prompt=PROMPTS[0], max_tokens=12,
                                       temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in stream if c.choices) == ref[0].text


def test_killed_worker_fails_streams_and_the_replica_is_replaced(cluster):
    before = worker_actors()
    assert len(before) == 1
    n = 3
    results: list = [None] * n
    started = [threading.Event() for _ in range(n)]
    body = {"model": "tandem-default", "max_tokens": 400, "ignore_eos": True, "temperature": 0, "stream": True}
    threads = [threading.Thread(target=_stream_outcome, daemon=True,
                                args=(cluster.api_url + "/completions", {**body, "prompt": PROMPTS[i]},
                                      started[i], results, i)) for i in range(n)]
    for t in threads:
        t.start()
    for ev in started:
        assert ev.wait(60), "stream did not start"
    ray.kill(next(iter(before.values())), no_restart=True)
    killed = time.monotonic()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), f"streams hung: {results}"
    assert {r[0] for r in results} <= {"error", "http", "status"}, f"a stream outlived its dead worker: {results}"
    for r in results:
        assert r[-1] - killed < 10, f"failure reported {r[-1] - killed:.1f} s after the kill: {r}"
        if r[0] == "error":  # the replica can no longer serve: retryable, like a dead replica
            assert r[1]["type"] == "server_error" and "Traceback" not in r[1]["message"]
            assert r[1]["code"] == "replica_died", r

    def rebuilt():
        live = worker_actors()
        return len(live) == 1 and not set(live) & set(before) and cluster.running_replicas() == 1
    wait_for(rebuilt, 120, 1, what="Serve to replace the replica and its worker rank")
    client = openai.OpenAI(base_url=cluster.api_url, api_key="unused", max_retries=0, timeout=60)

    def serves() -> bool:
        r = client.completions.create(model="tandem-default", prompt=PROMPTS[1], max_tokens=8, temperature=0)
        return r.choices[0].finish_reason in ("stop", "length")
    wait_for(serves, 60, 1, what="the new group to serve requests")
