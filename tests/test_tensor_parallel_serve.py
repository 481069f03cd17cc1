"""Tensor parallelism through Serve, enabled by the app config key: each engine replica is rank 0 of a TP=2 group
whose worker rank is a Ray actor in the replica's placement group; greedy completions (plain and streamed)
equal the single engine's on the embedded default model (4 KV heads split over the 2 ranks, tied head)."""

from __future__ import annotations

import openai
import pytest
import ray

from engine import LLM, SamplingParams
from serve_cluster import serve_cluster
from test_serve_app import PROMPTS


@pytest.fixture(scope="module")
def cluster():
    with serve_cluster({"num_replicas": 1, "tensor_parallel_size": 2, "tp_worker_num_cpus": 1.0}) as c:
        yield c


def worker_actors() -> list[str]:
    """Live TP worker actors (cluster/tensor_parallel.py names them <group>-rank<r>)."""
    return [e["name"] for e in ray.util.list_named_actors(all_namespaces=True) if e["name"].startswith("tandem-tp-")]


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
