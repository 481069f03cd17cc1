"""`colocated: true`: the OpenAI ingress with its engine in one Serve replica (serve_app/colocated.py).

Oracle: the offline engine on the same embedded model; greedy output, whole and streamed, must match exactly.
A client that leaves must still abort its request and free its KV blocks, bad input must still get its 400,
/health must count the replica's engine, since there is no engine deployment to ask Serve about, and the
ingress's and the engine's metrics, which share names told apart by their `part` label, must both export
from the one process (counts from what the test sent).
"""

from __future__ import annotations

import asyncio
import gc
import json

import httpx
import pytest
from ray import serve

from engine import LLM, SamplingParams
from serve_app import build_app
from serve_app.builder import COLOCATED_DEPLOYMENT
from serve_app.colocated import LocalEngine
from serve_app.errors import from_engine_failure
from dashboards import metrics as m
from serve_cluster import give_up_once_running, serve_cluster, wait_for
from test_metrics_e2e import scrape, total
from test_serve_app import MODEL, PROMPTS, all_idle, replica_stats


@pytest.fixture(scope="module")
def cluster():
    with serve_cluster({"device": "cpu", "colocated": True}, metrics=True) as c:
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


def test_the_ingress_and_the_engine_both_export_their_metrics_from_one_process(cluster):
    """Runs before the module's other traffic (file order), so the totals are exactly what it sends."""
    sent, max_tokens = 3, 4
    for prompt in PROMPTS[:sent]:
        r = httpx.post(cluster.api_url + "/completions", timeout=60, json={
            "model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0})
        assert r.status_code == 200, r.text

    def counts():
        s = scrape(cluster)
        return (total(s, m.REQUESTS.exported, endpoint="/v1/completions", status_code="200"),
                total(s, m.TTFT.exported + "_count", part="serve"),
                total(s, m.TTFT.exported + "_count", part="engine"),
                total(s, m.GENERATION_TOKENS.exported))

    want = (sent, sent, sent, sent * max_tokens)
    wait_for(lambda: counts() == want, 60, 1.0, what=f"(requests, serve TTFTs, engine TTFTs, tokens) == {want}")


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


def _engine_stats(cluster):  # -> EngineStats
    return serve.get_deployment_handle(COLOCATED_DEPLOYMENT, cluster.app_name).stats.remote().result(timeout_s=30)


def _engine_steps(cluster) -> int:
    return _engine_stats(cluster).steps


def _check_leaving_aborts(cluster, leave) -> None:
    """`leave(body)` starts a 1000-token request and goes away early; the engine must free every block and
    must have stopped the request: alone, it makes one token a step, so it ran fewer than 1000 steps. (The
    split app's tests time the freeing instead; here the tiny model can finish 1000 tokens in ~2 s.)"""
    wait_for(lambda: all_idle(replica_stats(cluster)), 30, what="idle replicas before the test")
    steps = _engine_steps(cluster)
    leave({"model": MODEL, "prompt": PROMPTS[6], "max_tokens": 1000, "ignore_eos": True, "temperature": 0})
    wait_for(lambda: all_idle(replica_stats(cluster)), 30, 0.1, what="KV blocks freed after the client left")
    ran = _engine_steps(cluster) - steps
    assert 0 < ran < 1000, f"the engine ran {ran} steps for a 1000-token request whose client left"


def test_a_disconnect_aborts_the_stream_and_frees_its_blocks(cluster):
    def leave(body):
        with httpx.stream("POST", cluster.api_url + "/completions", json={**body, "stream": True}, timeout=60) as r:
            assert r.status_code == 200
            got = [line for line, _ in zip((ln for ln in r.iter_lines() if ln), range(5))]
            assert len(got) == 5 and not any("[DONE]" in g for g in got)

    _check_leaving_aborts(cluster, leave)


def test_a_client_giving_up_on_a_whole_response_aborts_it_and_frees_its_blocks(cluster):
    # The client leaves once the engine runs its request, not after a fixed read timeout: on a loaded host that
    # could leave while Serve's proxy still held the request, which the engine then never ran.
    _check_leaving_aborts(cluster, lambda body: asyncio.run(give_up_once_running(
        cluster, body, lambda: _engine_stats(cluster).num_running > 0)))


class _SlowReplica:
    """Stands in for EngineReplica: each request yields one chunk, then waits until released."""

    def __init__(self):
        self.release = asyncio.Event()
        self.closed = 0

    async def generate(self, request):
        try:
            yield request
            await self.release.wait()
        finally:
            self.closed += 1


def test_the_replica_keeps_requests_to_its_limit_and_answers_the_rest_503():
    async def run():
        replica = _SlowReplica()
        engine = LocalEngine(replica, max_in_flight=2)
        a, b = engine.generate.remote("a"), engine.generate.remote("b")
        assert [await a.__anext__(), await b.__anext__()] == ["a", "b"] and engine.in_flight == 2
        with pytest.raises(Exception) as refused:
            await engine.generate.remote("c").__anext__()
        error = from_engine_failure(refused.value)
        assert error.status == 503 and error.code == "overloaded"
        a.cancel()  # a client gone: its place frees at once and its generator is closed (engine abort)
        await asyncio.sleep(0)
        assert engine.in_flight == 1 and replica.closed == 1
        c = engine.generate.remote("c")
        assert await c.__anext__() == "c"
        replica.release.set()
        assert [x async for x in b] == [] and [x async for x in c] == []  # ran to their ends
        assert engine.in_flight == 0 and replica.closed == 3
        d = engine.generate.remote("d")  # a stream dropped without being read or cancelled frees its place
        assert engine.in_flight == 1
        del d
        gc.collect()
        assert engine.in_flight == 0

    asyncio.run(run())
