"""Autoscaling end to end: a real Ray cluster (its own, for this module) with 1..2 engine replicas.

Sustained concurrent load scales the engine deployment to 2 replicas; when the load stops it goes back to 1.
Short delays keep the module near a minute: upscale_delay_s=2, downscale_delay_s=5, target 2 ongoing requests.
Every step polls serve.status() with a deadline; nothing asserts on a fixed sleep.
"""

from __future__ import annotations

import asyncio
import time

import openai
import pytest
import ray

from serve_cluster import serve_cluster, wait_for

MODEL = "tandem-default"
PROMPTS = ["Return a new", "This module provides", "The file object", "Return the number of",
           "Create a new instance of the", "If the value is None,", "Open the file and", "Convert a string to"]
APP_ARGS = {"min_replicas": 1, "max_replicas": 2, "upscale_delay_s": 2, "downscale_delay_s": 5,
            "target_ongoing_requests": 2}


@pytest.fixture(scope="module")
def cluster():
    with serve_cluster(APP_ARGS) as c:
        yield c


async def _load_until(cluster, done, timeout_s: float, concurrency: int = 8) -> tuple[bool, int, list]:
    """Keep `concurrency` requests in flight until done() (polled in a thread) or the timeout.
    Returns (reached, number of successful requests, errors)."""
    stop = asyncio.Event()
    ok, errors = 0, []

    async def worker(client: openai.AsyncOpenAI, i: int) -> None:
        nonlocal ok
        while not stop.is_set():
            try:
                r = await client.completions.create(model=MODEL, prompt=f"{PROMPTS[i % len(PROMPTS)]} {ok}",
                                                    max_tokens=48, temperature=0, extra_body={"ignore_eos": True})
                assert r.usage.completion_tokens == 48
                ok += 1
            except Exception as exc:  # noqa: BLE001 - collected and asserted on by the test
                errors.append(repr(exc))
                await asyncio.sleep(0.2)

    async with openai.AsyncOpenAI(base_url=cluster.api_url, api_key="unused", max_retries=0,
                                  timeout=60) as client:
        tasks = [asyncio.create_task(worker(client, i)) for i in range(concurrency)]
        deadline = time.monotonic() + timeout_s
        reached = False
        try:
            while time.monotonic() < deadline and not reached:
                reached = bool(await asyncio.to_thread(done))
                if not reached:
                    await asyncio.sleep(0.5)
        finally:
            stop.set()
            await asyncio.wait_for(asyncio.gather(*tasks), timeout=90)
    return reached, ok, errors


def _both_replicas_busy(cluster) -> bool:
    actors = cluster.engine_replica_actors()
    stats = ray.get([a.record_routing_stats.remote() for a in actors], timeout=20)
    return len(stats) == 2 and all(s["num_running"] > 0 for s in stats)


def test_scales_up_under_load_and_back_down_when_idle(cluster):
    assert cluster.running_replicas() == 1

    t0 = time.monotonic()
    reached, ok, errors = asyncio.run(_load_until(cluster, lambda: cluster.running_replicas() == 2, 60))
    assert reached, f"still {cluster.running_replicas()} replica(s) after 60 s of load ({ok} requests served)"
    assert not errors, errors[:5]
    scale_up_s = time.monotonic() - t0

    # The new replica takes traffic: while the load goes on, both engines have requests running.
    reached, ok, errors = asyncio.run(_load_until(cluster, lambda: _both_replicas_busy(cluster), 20))
    assert reached, "the new replica never served a request"
    assert not errors, errors[:5]

    t1 = time.monotonic()
    wait_for(lambda: cluster.running_replicas() == 1 and len(cluster.engine_replica_actors()) == 1, 60, 1,
             what="scale-down to 1 replica after the load stopped")
    print(f"scale-up {scale_up_s:.1f} s, scale-down {time.monotonic() - t1:.1f} s")

    # Still serving after scaling down.
    with openai.OpenAI(base_url=cluster.api_url, api_key="unused", max_retries=0, timeout=60) as client:
        r = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=8, temperature=0)
        assert r.choices[0].finish_reason in ("stop", "length")
