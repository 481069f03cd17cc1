"""Losing and removing replicas: a replica killed before it sent a request's first token costs the client
nothing (the ingress sends the request again); a replica removed by a scale-down stops taking requests and
lets its in-flight streams finish (graceful_shutdown_timeout_s), so no client sees a stream cut; /health
follows the replicas that run. Real cluster: a kill, a real redeploy (2 -> 1 replicas), then the last
replica killed."""

from __future__ import annotations

import json
import threading
import uuid

import httpx
import pytest
import ray
from ray import serve

from serve_app import build_app
from serve_cluster import serve_cluster, wait_for

# colocated: false: scaled down to one replica the app would otherwise turn colocated (another deployment)
APP = {"num_replicas": 2, "colocated": False, "graceful_shutdown_timeout_s": 120, "graceful_shutdown_wait_loop_s": 0.5,
       "router": "pow2", "grammar_compile_timeout_s": 120, "limits": {"max_schema_bytes": 4 * 1024**2}}
ENUM_VALUES = 40_000  # a schema whose grammar compiles for seconds: the request has no output meanwhile
TOKENS = 250
PROMPTS = [f"Story number {i} begins with" for i in range(8)]


@pytest.fixture(scope="module")
def cluster():
    with serve_cluster(APP) as c:
        yield c


def stream(cluster, prompt: str, result: dict) -> None:
    body = {"model": "tandem-default", "prompt": prompt, "max_tokens": TOKENS, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    events = []
    with httpx.stream("POST", cluster.api_url + "/completions", json=body, timeout=300) as r:
        result["status"] = r.status_code
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[len("data: "):]))
            result["events"] = len(events)
    result["errors"] = [e for e in events if "error" in e]
    result["finish"] = [c["finish_reason"] for e in events for c in e.get("choices", []) if c["finish_reason"]]
    result["usage"] = events[-1].get("usage") if events else None


def running_per_replica(cluster) -> list[int]:
    actors = cluster.engine_replica_actors()
    return [s["num_running"] for s in ray.get([a.record_routing_stats.remote() for a in actors], timeout=20)]


def test_a_replica_lost_before_the_first_token_is_invisible_to_the_client(cluster):
    """The request waits on its grammar compile (no output yet) when its replica is killed: the client still
    gets a complete answer, from the other replica, equal to the same request served undisturbed."""
    tag = uuid.uuid4().hex[:8]  # a schema no replica has compiled (the compile cache is per process)
    body = {"model": "tandem-default", "prompt": "Pick one:", "max_tokens": 48, "temperature": 0,
            "guided_json": {"type": "string", "enum": [f"value-{tag}-{i}" for i in range(ENUM_VALUES)]}}
    result = {}

    def send():
        r = httpx.post(cluster.api_url + "/completions", json=body, timeout=300)
        result["status"], result["body"] = r.status_code, r.json()

    sender = threading.Thread(target=send)
    sender.start()
    actors = cluster.engine_replica_actors()
    assert len(actors) == 2
    busy = wait_for(lambda: [a for a in actors if ray.get(a.get_num_ongoing_requests.remote(), timeout=10)],
                    60, 0.05, what="a replica to take the request")
    assert ray.get(busy[0].record_routing_stats.remote(), timeout=10)["num_running"] == 0  # still compiling
    ray.kill(busy[0], no_restart=True)
    sender.join(timeout=300)
    assert result["status"] == 200, result
    text = result["body"]["choices"][0]["text"]
    assert json.loads(text) in body["guided_json"]["enum"], text
    again = httpx.post(cluster.api_url + "/completions", json=body, timeout=300)
    assert again.status_code == 200 and again.json()["choices"][0]["text"] == text


def test_scale_down_lets_in_flight_streams_finish(cluster):
    wait_for(lambda: cluster.running_replicas() == 2 and len(cluster.engine_replica_actors()) == 2, 120, 1,
             what="Serve to replace the killed replica")
    results = [{} for _ in PROMPTS]
    threads = [threading.Thread(target=stream, args=(cluster, p, r)) for p, r in zip(PROMPTS, results)]
    for t in threads:
        t.start()
    wait_for(lambda: all(r.get("events", 0) >= 3 for r in results), 60, 0.1, what="every stream under way")
    busy = running_per_replica(cluster)
    assert len(busy) == 2 and min(busy) >= 1, busy  # both replicas serve streams: the one removed has some
    serve.run(build_app({**APP, "num_replicas": 1}), name=cluster.app_name, route_prefix="/")  # scale down
    for t in threads:
        t.join(timeout=300)
    for r in results:
        assert r["status"] == 200 and r["errors"] == [], r
        assert r["finish"] == ["length"] and r["usage"]["completion_tokens"] == TOKENS, r
    wait_for(lambda: cluster.running_replicas() == 1 and len(cluster.engine_replica_actors()) == 1, 60,
             what="the drained replica to stop")
    again = httpx.post(cluster.api_url + "/completions", timeout=60,
                       json={"model": "tandem-default", "prompt": "x", "max_tokens": 4})
    assert again.status_code == 200


def test_health_is_503_while_no_engine_replica_runs_and_200_again_after(cluster):
    """Runs after the scale-down: kill the one replica left. /health answers 503 no_healthy_replica until Serve
    has replaced it, then 200 with one replica."""
    [victim] = cluster.engine_replica_actors()
    ray.kill(victim, no_restart=True)
    down = wait_for(lambda: (r := httpx.get(cluster.base_url + "/health", timeout=10)).status_code == 503 and r,
                    30, 0.2, what="/health to report no replica")
    assert down.json()["error"]["code"] == "no_healthy_replica"
    up = wait_for(lambda: (r := httpx.get(cluster.base_url + "/health", timeout=10)).status_code == 200 and r,
                  120, 1, what="/health to recover once Serve replaced the replica")
    assert up.json() == {"status": "ok", "engine_replicas": 1}
