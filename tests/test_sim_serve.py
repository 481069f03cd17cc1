"""The Serve app on a simulated accelerator: `build_app(model=DIR, device="sim", sim_gpu=...)` end to end.

Oracle: the offline engine on the same simulated device (its tokens are a deterministic function of the
request), so what comes back over HTTP, streamed or not, must be exactly what `LLM(device="sim")` produces.
"""

from __future__ import annotations

import openai
import pytest

from engine import LLM, SamplingParams
from engine.sim import SIM_MODELS
from serve_cluster import serve_cluster

MODEL_DIR = str(SIM_MODELS / "qwen2.5-0.5b")
ENGINE = {"sim_gpu": "h100", "max_model_len": 2048, "max_num_seqs": 32}


@pytest.fixture(scope="module")
def cluster():
    with serve_cluster({"model": MODEL_DIR, "device": "sim", **ENGINE}) as c:
        yield c


@pytest.fixture(scope="module")
def client(cluster):
    return openai.OpenAI(base_url=cluster.api_url, api_key="unused", max_retries=0, timeout=60)


def test_http_outputs_equal_the_offline_sim_engine(client):
    prompts = ["Explain paged attention", "def read_config(path):", "The quick brown fox"]
    llm = LLM(MODEL_DIR, device="sim", **ENGINE)
    want = llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0))
    llm.shutdown()
    for prompt, w in zip(prompts, want):
        r = client.completions.create(model="qwen2.5-0.5b", prompt=prompt, max_tokens=24, temperature=0)
        assert r.choices[0].text == w.text and r.choices[0].finish_reason == "length"
        assert r.usage.completion_tokens == 24
        stream = client.completions.create(model="qwen2.5-0.5b", prompt=prompt, max_tokens=24, temperature=0,
                                           stream=True)
        assert "".join(c.choices[0].text for c in stream if c.choices) == w.text


def test_replica_reports_simulated_device_time(cluster, client):
    from ray import serve

    client.completions.create(model="qwen2.5-0.5b", prompt="warm up", max_tokens=16)
    handle = serve.get_deployment_handle(cluster.engine_deployment, app_name=cluster.app_name)
    stats = handle.stats.remote().result(timeout_s=30)
    assert stats["sim_gpu"] == "h100" and stats["device_busy_s"] > 0
    assert 0 < stats["device_busy_fraction"] <= 1


def test_coalesced_streams_reassemble_exactly(cluster):
    """32 streams at simulated-H100 speed: a stream's event carries whatever was committed since its last one
    (paced streams, and a consumer slower than the engine), so events carry several tokens. Reassembled, each stream
    is exactly the offline engine's output: text, every token's logprob and top logprobs in order, usage and
    finish_reason."""
    import asyncio
    import json

    import httpx

    prompts = [f"Stream {i}: tell me about request coalescing" for i in range(32)]
    params = SamplingParams(max_tokens=96, temperature=0, ignore_eos=True, logprobs=2)
    llm = LLM(MODEL_DIR, device="sim", **ENGINE)
    want = llm.generate(prompts, params)
    decode = llm.tokenizer.decode
    llm.shutdown()
    body = {"model": "qwen2.5-0.5b", "max_tokens": 96, "temperature": 0, "ignore_eos": True, "logprobs": 2,
            "stream": True, "stream_options": {"include_usage": True}}

    async def one(client: httpx.AsyncClient, prompt: str) -> list[dict]:
        async with client.stream("POST", "/completions", json={**body, "prompt": prompt}) as r:
            assert r.status_code == 200
            return [json.loads(line[6:]) async for line in r.aiter_lines()
                    if line.startswith("data: ") and line != "data: [DONE]"]

    async def run_all():
        async with httpx.AsyncClient(base_url=cluster.api_url, timeout=120) as client:
            return await asyncio.gather(*(one(client, p) for p in prompts))

    per_event = []
    for w, events in zip(want, asyncio.run(run_all())):
        content = [e["choices"][0] for e in events if e["choices"]]
        per_event += [len(c["logprobs"]["tokens"]) for c in content]
        assert "".join(c["text"] for c in content) == w.text
        assert [t for c in content for t in c["logprobs"]["tokens"]] == [decode([t]) for t in w.token_ids]
        assert [x for c in content for x in c["logprobs"]["token_logprobs"]] == [e.logprob for e in w.logprobs]
        assert [x for c in content for x in c["logprobs"]["top_logprobs"]] == [
            {decode([t]): lp for t, lp in e.top} for e in w.logprobs]
        assert [c["finish_reason"] for c in content] == [None] * (len(content) - 1) + ["length"]
        assert events[-1]["usage"]["completion_tokens"] == 96 and not events[-1]["choices"]
    assert max(per_event) > 1, "no event carried more than one token: nothing was coalesced"
