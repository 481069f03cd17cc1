"""The async streaming API the Ray replica wraps: concurrency, streaming deltas, abort, failures."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time

import pytest

from engine import LLM, AsyncLLM, SamplingParams
from engine.async_engine import EngineDeadError
from test_correctness_hf import make_prompts

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory):
    return str(tiny_model_factory("llama")[0])


@pytest.fixture
def allm(model_dir):
    llm = AsyncLLM(model=model_dir, block_size=4)
    yield llm
    llm.shutdown()


async def collect(llm: AsyncLLM, prompt, params=GREEDY):
    outs = [o async for o in llm.generate(prompt, params)]
    return outs


async def wait_idle(llm: AsyncLLM, timeout: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = llm.stats()
        if stats["num_running"] == 0 and stats["num_waiting"] == 0 and \
                stats["kv_blocks_free"] == stats["kv_blocks_total"]:
            return stats
        await asyncio.sleep(0.02)
    raise AssertionError(f"engine did not go idle: {llm.stats()}")


def test_concurrent_streams_match_offline_outputs(allm, model_dir):
    prompts = make_prompts(seed=11, lengths=(4, 8, 15, 23, 31, 7, 12, 40))
    expected = LLM(model_dir, block_size=4).generate(prompts, GREEDY)

    async def main():
        return await asyncio.gather(*(collect(allm, p) for p in prompts))

    streams = asyncio.run(main())
    for outs, exp in zip(streams, expected):
        final = outs[-1]
        assert final.finished and final.token_ids == exp.token_ids and final.finish_reason == "length"
        assert sum((o.delta_token_ids for o in outs), []) == final.token_ids
        assert "".join(o.delta_text for o in outs) == final.text == exp.text
        assert all(not o.finished for o in outs[:-1])
        assert len(outs) > 1  # streamed as committed, not only at the end


@pytest.mark.parametrize("interval", [1, 3, 5])
def test_stream_interval_emits_the_first_token_then_every_n_then_the_rest(model_dir, interval):
    """stream_interval (vLLM's): a streamed request's first token goes out at once, then one output per
    `interval` new tokens, and the last output carries whatever is left; tokens and text are unchanged."""
    prompts = make_prompts(seed=12, lengths=(5, 9))
    params = SamplingParams(max_tokens=11, temperature=0, ignore_eos=True)
    expected = LLM(model_dir, block_size=4).generate(prompts, params)
    llm = LLM(model_dir, block_size=4, stream_interval=interval)
    try:
        ids = [llm.engine.add_request(p, params, stream=True) for p in prompts]
        outs = {i: [] for i in ids}
        while llm.engine.has_unfinished():
            for o in llm.engine.step():
                outs[o.request_id].append(o)
    finally:
        llm.shutdown()
    rest = (11 - 1) % interval
    for rid, exp in zip(ids, expected):
        assert [len(o.delta_token_ids) for o in outs[rid]] == [1] + [interval] * (10 // interval) + [rest] * bool(rest)
        assert sum((o.delta_token_ids for o in outs[rid]), []) == outs[rid][-1].token_ids == exp.token_ids
        assert "".join(o.delta_text for o in outs[rid]) == exp.text
        assert outs[rid][-1].finished and not any(o.finished for o in outs[rid][:-1])


def test_leaving_the_stream_aborts_and_frees_blocks(allm):
    long = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)

    async def main():
        async with contextlib.aclosing(allm.generate(make_prompts(12, (30,))[0], long)) as gen:
            seen = 0
            async for _ in gen:
                seen += 1
                if seen == 3:
                    break
        return await wait_idle(allm)

    stats = asyncio.run(main())
    assert stats["generation_tokens"] < 100  # it really stopped early


def test_cancelled_task_aborts_request(allm):
    """A task cancelled while its stream runs (cancelled once its first output is in, not after a fixed sleep:
    on a fast host the tiny model finished 400 tokens inside 0.2 s and there was nothing left to cancel)."""
    long = SamplingParams(max_tokens=1000, temperature=0, ignore_eos=True)

    async def main():
        started = asyncio.Event()

        async def consume():
            async for _ in allm.generate(make_prompts(13, (20,))[0], long):
                started.set()

        task = asyncio.create_task(consume())
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return await wait_idle(allm)

    stats = asyncio.run(main())
    assert stats["generation_tokens"] < 1000  # aborted mid-stream, not run to its end


def test_bad_request_is_rejected_and_others_continue(allm):
    async def main():
        good = asyncio.create_task(collect(allm, [5, 6, 7, 8]))
        with pytest.raises(ValueError, match="token ids must be in"):
            await collect(allm, [5, 99999])
        with pytest.raises(ValueError, match="temperature"):
            await collect(allm, [5, 6], SamplingParams(temperature=-1.0))
        outs = await good
        return outs[-1]

    final = asyncio.run(main())
    assert final.finished and len(final.token_ids) == GREEDY.max_tokens


def test_failed_step_fails_its_requests_and_engine_keeps_serving(allm):
    model = allm.engine.runner.model
    original = model.forward
    calls = {"n": 0}

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected forward failure")
        return original(*args, **kwargs)

    model.forward = flaky

    async def main():
        failed = await collect(allm, [5, 6, 7, 8])
        ok = await collect(allm, [9, 10, 11])
        return failed[-1], ok[-1]

    try:
        failed, ok = asyncio.run(main())
    finally:
        model.forward = original
    assert failed.finished and failed.finish_reason == "abort" and "RuntimeError" in failed.error
    assert ok.finished and ok.finish_reason == "length" and ok.error is None
    allm.engine.check_integrity()


def test_dead_loop_fails_inflight_and_new_requests(model_dir):
    llm = AsyncLLM(model=model_dir)

    def boom():
        raise RuntimeError("loop crashed")

    async def main():
        llm.engine.step = boom
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(collect(llm, [5, 6, 7]), timeout=10)
        with pytest.raises(EngineDeadError):
            await collect(llm, [5, 6, 7])

    try:
        asyncio.run(main())
    finally:
        llm.shutdown()
    with pytest.raises(EngineDeadError):
        llm.check_health()


def test_a_hung_step_makes_the_engine_unhealthy_until_it_moves_again(model_dir):
    """The watchdog: with work queued and no loop progress for stall_timeout_s, check_health raises (Serve
    then replaces the replica); an idle engine is never stalled, and one that moves again is healthy."""
    llm = AsyncLLM(model=model_dir, stall_timeout_s=0.3)
    release, entered = threading.Event(), threading.Event()
    real_step = llm.engine.step

    def hung_step():
        entered.set()
        release.wait(30)
        return real_step()

    async def main():
        time.sleep(0.5)
        llm.check_health()  # idle for longer than stall_timeout_s: healthy
        llm.engine.step = hung_step
        task = asyncio.ensure_future(collect(llm, [5, 6, 7]))
        await asyncio.to_thread(entered.wait, 10)
        llm.check_health()  # just stepped: healthy
        await asyncio.sleep(0.5)
        with pytest.raises(EngineDeadError, match=r"no progress for \d+ s while it had work"):
            llm.check_health()
        llm.engine.step = real_step
        release.set()
        outs = await asyncio.wait_for(task, 30)
        llm.check_health()
        return outs[-1]

    try:
        final = asyncio.run(main())
    finally:
        release.set()
        llm.shutdown()
    assert final.finished and len(final.token_ids) == GREEDY.max_tokens


def test_shutdown_fails_open_streams_instead_of_leaving_them_waiting(model_dir):
    llm = AsyncLLM(model=model_dir)
    real_step = llm.engine.step
    llm.engine.step = lambda: time.sleep(0.05) or real_step()  # 400 tokens take 20 s: still open at shutdown

    async def main():
        stream = llm.generate([5, 6, 7], SamplingParams(max_tokens=400, ignore_eos=True, temperature=0))
        await stream.__anext__()
        await asyncio.to_thread(llm.shutdown)
        with pytest.raises(EngineDeadError, match="shut down"):
            async for _ in stream:
                pass

    asyncio.run(asyncio.wait_for(main(), 60))


def test_a_consumer_behind_gets_every_merged_delta_and_merging_copies_nothing_already_merged():
    """The collector between the engine and a caller that has not taken its last output merges each new output
    into the pending one. The merged output carries every delta in order (token ids, text, logprobs, the prompt
    logprobs of the first), per sample; the pending token and logprob lists grow in place, so k merges cost O(k)
    (a slow client of a 16k-token stream used to cost its replica's event loop over a second: concatenating the
    lists and text so far at every merge)."""
    from engine.async_engine import _Collector
    from engine.outputs import RequestOutput, TokenLogprob

    def out(index: int, i: int) -> RequestOutput:
        token = 1000 * index + i
        return RequestOutput("r", None, [1, 2], [], "", delta_token_ids=[token], delta_text=f"<{index}:{i}>",
                             delta_logprobs=[TokenLogprob(token, -float(i), [])], index=index,
                             prompt_logprobs=[None, TokenLogprob(2, -0.5, [])] if i == 0 else None,
                             finished=i == 99)

    loop = asyncio.new_event_loop()
    try:
        c = _Collector(loop, n=2)
        first = [out(0, 0), out(1, 0)]
        for o in first:
            c.put(o)
        held = [first[0].delta_token_ids, first[0].delta_logprobs]
        for i in range(1, 100):
            for index in (1, 0):
                c.put(out(index, i))
        assert c.items[0].delta_token_ids is held[0] and c.items[0].delta_logprobs is held[1]
        got = loop.run_until_complete(c.get())
        assert [o.index for o in got] == [0, 1]
        for o in got:
            assert o.delta_token_ids == [1000 * o.index + i for i in range(100)]
            assert o.delta_text == "".join(f"<{o.index}:{i}>" for i in range(100))
            assert [lp.logprob for lp in o.delta_logprobs] == [-float(i) for i in range(100)]
            assert o.prompt_logprobs[1].logprob == -0.5 and o.finished
        # the next output after a hand-out starts afresh: nothing of the merged text is left over
        c.put(RequestOutput("r", None, [1, 2], [], "", delta_token_ids=[7], delta_text="next"))
        again = loop.run_until_complete(c.get())
        assert [(o.delta_token_ids, o.delta_text) for o in again] == [([7], "next")]
    finally:
        loop.close()
