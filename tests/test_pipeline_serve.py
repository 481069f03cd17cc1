"""Pipeline parallelism through Serve: each engine replica drives a group of 2 stage actors (in the replica's
placement group) and the HTTP API, streaming and error handling work unchanged. Killing a stage actor fails
the replica's in-flight streams within seconds; Serve then replaces the replica (its health check fails) and
the new replica builds a new stage group.
"""

from __future__ import annotations

import threading
import time

import openai
import pytest
import ray

from engine import LLM, SamplingParams
from serve_cluster import serve_cluster, wait_for
from test_serve_app import PROMPTS, _stream_outcome

STAGES = 2


@pytest.fixture(scope="module")
def cluster():
    with serve_cluster({"num_replicas": 1, "pipeline_parallel_size": STAGES, "pp_stage_num_cpus": 1.0}) as c:
        yield c


@pytest.fixture(scope="module")
def client(cluster):
    return openai.OpenAI(base_url=cluster.api_url, api_key="unused", max_retries=0, timeout=60)


def stage_actors() -> dict[str, object]:
    """Live stage actors by name (cluster/pipeline.py names them <group>-stage<i>)."""
    return {e["name"]: ray.get_actor(e["name"], namespace=e["namespace"])
            for e in ray.util.list_named_actors(all_namespaces=True) if e["name"].startswith("tandem-pp-")}


def test_completions_and_streams_equal_the_single_engine(cluster, client):
    assert len(stage_actors()) == STAGES
    oracle = LLM()
    try:
        ref = oracle.generate(PROMPTS[:4], SamplingParams(max_tokens=12, temperature=0))
    finally:
        oracle.shutdown()
    for prompt, want in zip(PROMPTS[:4], ref):
        r = client.completions.create(model="tandem-default", prompt=prompt, max_tokens=12, temperature=0)
        assert r.choices[0].text == want.text
        assert r.usage.completion_tokens == len(want.token_ids)
    stream = client.completions.create(model="tandem-default", prompt=PROMPTS[0], max_tokens=12,
                                       temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in stream if c.choices) == ref[0].text


def test_killed_stage_fails_streams_and_the_group_is_rebuilt(cluster, client):
    before = stage_actors()
    assert len(before) == STAGES
    n = 4
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
    victim = sorted(before)[-1]  # the last stage
    ray.kill(before[victim], no_restart=True)
    killed = time.monotonic()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), f"streams hung: {results}"
    kinds = [r[0] for r in results]
    assert set(kinds) <= {"error", "http", "status"}, f"a stream outlived its dead stage: {results}"
    for r in results:
        assert r[-1] - killed < 10, f"failure reported {r[-1] - killed:.1f} s after the kill: {r}"
        if r[0] == "error":  # the replica can no longer serve: retryable, like a dead replica
            assert r[1]["type"] == "server_error" and "Traceback" not in r[1]["message"]
            assert r[1]["code"] == "replica_died", r

    def rebuilt():
        live = stage_actors()
        return len(live) == STAGES and not set(live) & set(before) and cluster.running_replicas() == 1
    wait_for(rebuilt, 120, 1, what="Serve to replace the replica and its stage group")

    def serves() -> bool:
        r = client.completions.create(model="tandem-default", prompt=PROMPTS[1], max_tokens=8, temperature=0)
        return r.choices[0].finish_reason in ("stop", "length")
    wait_for(serves, 60, 1, what="the new stage group to serve requests")
