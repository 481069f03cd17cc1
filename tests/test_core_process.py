"""The engine core in a process of its own (engine/core_proc.py) behind AsyncLLM's frontend.

Oracle: the same engine in process (LLMEngine, itself checked against transformers in
test_correctness_hf.py) on the same prompts; moving the core into another process must not change a token or a
character. Faults: a core that dies or hangs makes the frontend unhealthy and fails its streams, and no core
process outlives its frontend.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from engine import LLM, SamplingParams
from engine.block_manager import prompt_block_hashes
from engine.sampling_params import StructuredOutputsParams
from engine.async_engine import AsyncLLM, EngineDeadError
from engine.llm_engine import LLMEngine
from engine.config import EngineConfig

PROMPTS = ["Hello there", "The capital of France is", "def fibonacci(n):", "Once upon a time"]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie (exited, not yet reaped) is not alive
        return f.read().split()[2] != "Z"


def _wait_gone(pid: int, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.05)
    return False


@pytest.fixture(scope="module")
def proc_llm():
    llm = AsyncLLM(EngineConfig(max_model_len=512), core_process=True)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def offline():
    llm = LLM(max_model_len=512)
    yield llm
    llm.shutdown()


async def _collect(llm: AsyncLLM, prompt, params: SamplingParams):
    outs = []
    async for out in llm.generate(prompt, params):
        outs.append(out)
    return outs


async def _running_request(llm: AsyncLLM) -> asyncio.Task:
    """A long request's stream (450 tokens), returned once the core reports it running."""
    task = asyncio.create_task(_collect(llm, "Tell me", SamplingParams(max_tokens=450, ignore_eos=True)))
    while not llm.stats().num_running:
        await asyncio.sleep(0.02)
    return task


def _final(outs, n=1):
    return sorted((o for o in outs if o.finished), key=lambda o: o.index)[:n]


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=24, temperature=0),
    SamplingParams(max_tokens=40, temperature=0, stop=[" the", "\n\n"]),
    SamplingParams(max_tokens=16, temperature=0.8, seed=7, logprobs=2),
    SamplingParams(max_tokens=12, temperature=0.9, seed=3, n=3),
    SamplingParams(max_tokens=20, temperature=0, min_tokens=10, stop=["."]),
], ids=["greedy", "stop-strings", "seeded-logprobs", "n3", "min-tokens"])
def test_core_process_matches_the_in_process_engine(proc_llm, offline, params):
    async def run():
        return await asyncio.gather(*(_collect(proc_llm, p, params) for p in PROMPTS))

    streamed = asyncio.run(run())
    expected = offline.generate(PROMPTS, params)
    got = [o for outs in streamed for o in _final(outs, params.n)]
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        assert (g.token_ids, g.text, g.finish_reason) == (e.token_ids, e.text, e.finish_reason)
        if params.logprobs is not None:
            assert [(lp.token_id, round(lp.logprob, 4)) for lp in g.logprobs] == \
                [(lp.token_id, round(lp.logprob, 4)) for lp in e.logprobs]
    for outs in streamed:  # the deltas add up to the final output, sample by sample
        for final in _final(outs, params.n):
            mine = [o for o in outs if o.index == final.index]
            assert sum((o.delta_token_ids for o in mine), []) == final.token_ids
            assert "".join(o.delta_text for o in mine) == final.text
            assert [o.num_output_tokens for o in mine] == sorted(o.num_output_tokens for o in mine)


def test_bad_requests_raise_value_errors_naming_the_problem(proc_llm):
    async def first(prompt, params, **kw):
        async for _ in proc_llm.generate(prompt, params, **kw):
            pass

    with pytest.raises(ValueError, match="stop_token_ids"):  # checked in the frontend against the core's limits
        asyncio.run(first("hi", SamplingParams(max_tokens=2, stop_token_ids=[10**7])))
    with pytest.raises(ValueError, match="max_model_len"):
        asyncio.run(first(list(range(1, 600)), SamplingParams(max_tokens=2)))
    with pytest.raises(ValueError, match="no LoRA adapters"):  # refused by the core, raised here
        asyncio.run(first("hi", SamplingParams(max_tokens=2), lora_request="nope"))
    bad = StructuredOutputsParams(regex="(unclosed")
    with pytest.raises(ValueError, match="regex"):  # a grammar that does not compile, refused by the core
        asyncio.run(first("hi", SamplingParams(max_tokens=2, structured_outputs=bad)))
    outs = asyncio.run(_collect(proc_llm, "still serving", SamplingParams(max_tokens=3, ignore_eos=True)))
    assert outs[-1].finished and outs[-1].num_output_tokens == 3
    proc_llm.check_health()


def test_a_caller_that_leaves_frees_its_blocks_in_the_core(proc_llm):
    async def leave_early():
        async for out in proc_llm.generate("Tell me a long story", SamplingParams(max_tokens=400, ignore_eos=True)):
            if out.num_output_tokens >= 5:
                break

    asyncio.run(leave_early())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        s = proc_llm.stats()
        if s.num_running == 0 and s.kv_blocks_free == s.kv_blocks_total:
            break
        time.sleep(0.05)
    s = proc_llm.stats()
    assert (s.num_running, s.num_waiting, s.kv_blocks_free) == (0, 0, s.kv_blocks_total)


def test_a_prompt_is_hashed_where_its_request_is_made_and_a_frontends_hashes_are_used():
    """make_sequence hashes the prompt's blocks (prefix caching), so the loop does not when it admits the request;
    hashes a frontend in another process sent with it are taken as they are, and a list whose length cannot be
    the prompt's is not (hashed again)."""
    engine = LLMEngine(EngineConfig(max_model_len=512))
    core, bs = engine.core, engine.core.config.block_size
    ids = list(range(100, 100 + 3 * bs + 2))  # 3 full blocks before the last token
    want = prompt_block_hashes(ids, bs)
    made = core.make_sequence(ids, SamplingParams(max_tokens=4), "a")
    assert made.prompt_hashes == (len(ids), want) and len(want) == 3
    sent = list(want)
    assert core.make_sequence(ids, SamplingParams(max_tokens=4), "b", prompt_hashes=sent).prompt_hashes[1] is sent
    short = core.make_sequence(ids, SamplingParams(max_tokens=4), "c", prompt_hashes=want[:1])
    assert short.prompt_hashes == (len(ids), want)
    engine.shutdown()


def test_a_core_process_serves_prefix_hits_from_the_hashes_its_frontend_sent(proc_llm, offline, monkeypatch):
    """The same prompt twice through a core process: the frontend sends the prompt's hashes with each request, and
    the second finds the first's blocks in the cache and gives the in-process engine's tokens."""
    prompt = list(range(300, 300 + 5 * 16 + 3))  # 5 full blocks of 16 before the last token
    params = SamplingParams(max_tokens=8, temperature=0)
    sent, send = [], proc_llm._send
    monkeypatch.setattr(proc_llm, "_send", lambda kind, arg: (sent.append((kind, arg)), send(kind, arg))[1])
    first = _final(asyncio.run(_collect(proc_llm, prompt, params)))[0]
    adds = [arg for kind, arg in sent if kind == "add"]
    assert len(adds) == 1 and adds[0][1] == prompt and adds[0][5] == prompt_block_hashes(prompt, 16)
    second = _final(asyncio.run(_collect(proc_llm, prompt, params)))[0]
    assert first.num_cached_tokens == 0 and second.num_cached_tokens == 5 * 16
    assert first.token_ids == second.token_ids == offline.generate([prompt], params)[0].token_ids


def test_the_core_reports_only_new_tokens_at_every_step():
    """Each of the core's outputs carries the tokens since the previous one, whatever the request's length:
    per step, a request costs the same at its 400th token as at its first."""
    engine = LLMEngine(EngineConfig(max_model_len=512))
    engine.add_request("Tell me", SamplingParams(max_tokens=400, ignore_eos=True), request_id="r", stream=True)
    sizes = []
    while engine.core.has_unfinished():
        for out in engine.core.step():
            sizes.append(len(out.new_token_ids))
            engine.processor.process([out])
    assert sum(sizes) == 400 and max(sizes) == 1
    engine.shutdown()


def test_outputs_with_logprobs_cross_the_process_boundary_unchanged():
    """What a core process sends (encode_outputs) decodes back into the same CoreOutputs: token ids, each
    token's logprob and its top alternatives, prompt logprobs with their ranks (and the first position's None),
    the first report's times, finishes, errors. The oracle is the in-process core's own outputs, before
    encoding; the frontend then builds the same RequestOutputs from either."""
    from engine.core_proc import decode_outputs, encode_outputs
    from engine.outputs import CoreOutput

    engine = LLMEngine(EngineConfig(max_model_len=512))
    engine.add_request("Tell me", SamplingParams(max_tokens=6, ignore_eos=True, logprobs=3, prompt_logprobs=2),
                       request_id="lp", stream=True)
    engine.add_request("Hello", SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.8, seed=1, logprobs=0),
                       request_id="chosen", stream=True)
    steps = []
    while engine.core.has_unfinished():
        outs = engine.core.step()
        if outs:
            steps.append(outs)
    steps.append([CoreOutput("bad", 0, [], "abort", error="grammar does not compile", rejected=True)])
    twin = _twin_processor(engine)
    seen = {"top": 0, "prompt": 0}
    for outs in steps:
        back = decode_outputs(encode_outputs(outs))
        assert [type(o) for o in back] == [CoreOutput] * len(outs)
        for a, b in zip(outs, back):
            assert b == a  # every field (TokenLogprob's top pairs decode as tuples, as the core builds them)
            seen["top"] += sum(len(lp.top) for lp in a.new_logprobs or [])
            seen["prompt"] += a.prompt_logprobs is not None
        mine, theirs = engine.processor.process(outs)[0], twin.process(back)[0]
        assert [(o.request_id, o.delta_token_ids, o.delta_text, o.delta_logprobs, o.prompt_logprobs, o.finished)
                for o in mine] == [(o.request_id, o.delta_token_ids, o.delta_text, o.delta_logprobs,
                                    o.prompt_logprobs, o.finished) for o in theirs]
    engine.shutdown()
    assert seen["top"] == 6 * 3 and seen["prompt"] == 1  # the test saw what it checks


def _twin_processor(engine: LLMEngine):
    """A second frontend holding the same requests as `engine`'s (a copy of its request states)."""
    import copy

    twin = copy.copy(engine.processor)
    twin.states = copy.deepcopy(engine.processor.states)
    return twin


def test_a_request_nothing_reads_before_its_end_is_reported_once():
    """A request that is not streamed and has no stop strings is final-only: the core reports it once, at its
    finish, with every token (no output built at every commit); with stop strings the frontend reads each
    commit's tokens, so the core reports every step. The tokens and text are those of the streamed request
    (test_core_process_matches_the_in_process_engine compares LLM.generate with streams the same way)."""
    engine = LLMEngine(EngineConfig(max_model_len=512))
    params = SamplingParams(max_tokens=40, ignore_eos=True, temperature=0)
    engine.add_request("Tell me", params, request_id="final")
    engine.add_request("Tell me", params, request_id="streamed", stream=True)
    engine.add_request("Tell me", SamplingParams(max_tokens=40, ignore_eos=True, temperature=0, stop=["never seen"]),
                       request_id="stops")
    reports, finals = {}, {}
    while engine.core.has_unfinished():
        outs = engine.core.step()
        for out in outs:
            reports.setdefault(out.request_id, []).append(len(out.new_token_ids))
        for out in engine.processor.process(outs)[0]:
            if out.finished:
                finals[out.request_id] = out
    engine.shutdown()
    assert reports["final"] == [40]
    assert len(reports["streamed"]) == len(reports["stops"]) == 40
    assert finals["final"].token_ids == finals["streamed"].token_ids == finals["stops"].token_ids
    assert finals["final"].text == finals["streamed"].text == finals["stops"].text != ""


def test_a_killed_core_fails_its_streams_and_the_engine_reports_unhealthy():
    llm = AsyncLLM(EngineConfig(max_model_len=512), core_process=True)
    pid = llm._core.proc.pid

    async def run():
        task = await _running_request(llm)
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(EngineDeadError, match="exited with code -9"):
            await task

    try:
        asyncio.run(run())
        with pytest.raises(EngineDeadError):
            llm.check_health()
        with pytest.raises(EngineDeadError):  # no new request is taken
            asyncio.run(_collect(llm, "hi", SamplingParams(max_tokens=2)))
    finally:
        llm.shutdown()


def test_a_hung_core_makes_the_engine_unhealthy_after_stall_timeout():
    llm = AsyncLLM(EngineConfig(max_model_len=512, stall_timeout_s=1.0), core_process=True)
    pid = llm._core.proc.pid

    async def run():
        task = await _running_request(llm)
        os.kill(pid, signal.SIGSTOP)
        try:
            llm.check_health()  # not yet: a step may take a while
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                try:
                    llm.check_health()
                except EngineDeadError as exc:
                    return str(exc), task
                await asyncio.sleep(0.1)
            return None, task
        finally:
            os.kill(pid, signal.SIGCONT)

    try:
        error, task = asyncio.run(run())
        assert error is not None and "no progress" in error
    finally:
        llm.shutdown()
    assert _wait_gone(pid)


def test_shutdown_stops_the_core_process():
    llm = AsyncLLM(EngineConfig(max_model_len=512), core_process=True)
    pid = llm._core.proc.pid
    assert _alive(pid)
    llm.shutdown()
    assert _wait_gone(pid, 5)


def test_a_frontend_that_fails_to_start_stops_the_core_it_started(monkeypatch):
    """The core process is up and the frontend's own start-up then fails (its tokenizer does not load): the
    error reaches the caller and the core process is gone at once, not when the caller's process exits."""
    import engine.async_engine as async_engine
    import engine.core_client as core_client

    started = []

    class Recorded(core_client.CoreProcess):
        def __init__(self, config):
            super().__init__(config)
            started.append(self)

    def fail(*args, **kwargs):
        raise OSError("tokenizer files unreadable")

    monkeypatch.setattr(core_client, "CoreProcess", Recorded)
    monkeypatch.setattr(async_engine.AutoTokenizer, "from_pretrained", fail)
    with pytest.raises(OSError, match="tokenizer files unreadable"):
        AsyncLLM(EngineConfig(max_model_len=256), core_process=True)
    assert len(started) == 1, "the core process started before the failure"
    assert _wait_gone(started[0].proc.pid, 5), "the core process outlived its frontend's failed start"


def test_no_core_process_outlives_a_killed_frontend(tmp_path):
    """The replica's process killed outright (SIGKILL: no shutdown, no atexit): its core goes too."""
    script = textwrap.dedent("""
        import sys, time
        from engine.async_engine import AsyncLLM
        from engine.config import EngineConfig
        llm = AsyncLLM(EngineConfig(max_model_len=256), core_process=True)
        print(llm._core.proc.pid, flush=True)
        time.sleep(600)
    """)
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                              cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        core_pid = int(parent.stdout.readline())
        assert _alive(core_pid)
        parent.kill()
        parent.wait(timeout=30)
        assert _wait_gone(core_pid), "the core process outlived its frontend"
    finally:
        if parent.poll() is None:
            parent.kill()


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="a CPU is left to the core only where there are two")
def test_core_own_cpu_keeps_the_frontends_threads_off_one_cpu_until_shutdown():
    """core_own_cpu: every thread of the frontend's process (one started before, and one started after) keeps
    off the highest CPU, the core process keeps every CPU, requests still run, and shutdown gives the CPU back.
    Without it nothing moves. In a child process, so this test process keeps its CPUs whatever happens."""
    script = textwrap.dedent("""
        import asyncio, json, os, threading
        from engine import SamplingParams
        from engine.async_engine import AsyncLLM
        from engine.config import EngineConfig

        def mine():
            return sorted({cpu for t in os.listdir("/proc/self/task") for cpu in os.sched_getaffinity(int(t))})

        async def text(llm):
            out = None
            async for out in llm.generate("Hello there", SamplingParams(max_tokens=4, temperature=0.0)):
                pass
            return out.text

        stop = threading.Event()
        threading.Thread(target=stop.wait, daemon=True).start()
        report = {"all": sorted(os.sched_getaffinity(0))}
        plain = AsyncLLM(EngineConfig(max_model_len=256), core_process=True)
        report["plain"] = mine()
        plain.shutdown()
        llm = AsyncLLM(EngineConfig(max_model_len=256), core_process=True, core_own_cpu=True)
        threading.Thread(target=stop.wait, daemon=True).start()
        report["frontend"] = mine()
        report["core"] = sorted(os.sched_getaffinity(llm._core.proc.pid))
        report["text"] = asyncio.run(text(llm))
        llm.shutdown()
        report["after"] = mine()
        print(json.dumps(report), flush=True)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.returncode == 0, out.stderr[-3000:]
    import json

    report = json.loads(out.stdout.strip().splitlines()[-1])
    cpus = report["all"]
    assert report["plain"] == cpus == report["core"] == report["after"]
    assert report["frontend"] == cpus[:-1]
    assert report["text"] != ""


def test_paced_streams_merge_commits_and_never_hold_the_first_output_or_the_finish():
    """stream_events_per_s=8 with one open stream: at most one output every 125 ms; the first output (TTFT) and
    the finish are handed out as soon as they are committed; the deltas add up to the same tokens and text."""
    interval = 1 / 8
    llm = AsyncLLM(EngineConfig(max_model_len=512), stream_events_per_s=8)
    oracle = LLM(max_model_len=512)

    async def run(params):
        got = []
        async for out in llm.generate("Tell me a story", params):
            got.append((time.monotonic(), out))
        return got

    held_finishes = []  # (how long a finish would have waited for its interval, how long it waited)
    try:
        # a few hundred ms each: several intervals. Where a finish falls in its interval depends on this machine's
        # token rate (a fixed step of 80 tokens was one interval's worth on a CI machine, so every finish fell at
        # the same late phase), so each run is longer than the last by half an interval's worth of tokens at the
        # rate just measured, until two finishes fell early enough to tell (or 12 runs)
        max_tokens = 170
        for _ in range(12):
            if sum(would > 0.04 for would, _ in held_finishes) >= 2:
                break
            params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0)
            got = asyncio.run(run(params))
            outs, times = [o for _, o in got], [t for t, _ in got]
            expected = oracle.generate(["Tell me a story"], params)[0]
            assert sum((o.delta_token_ids for o in outs), []) == expected.token_ids
            assert "".join(o.delta_text for o in outs) == expected.text
            # the first output was handed out when its token was made, not held for an interval (it may carry a
            # second token that a busy caller's loop let merge into it)
            assert times[0] - outs[0].first_token_time < interval / 2
            gaps = [b - a for a, b in zip(times, times[1:-1])]  # the finish may follow sooner
            assert all(g >= interval - 0.005 for g in gaps), gaps
            # at most one output per interval (plus the first and the finish), and commits merged into them: not a
            # fixed count, which would assume how fast this machine makes tokens
            assert len(outs) <= (times[-1] - times[0]) / interval + 2 and len(outs) < max_tokens
            assert max(len(o.delta_token_ids) for o in outs) > 1
            finish = outs[-1].finish_time
            held_finishes.append((times[-2] + interval - finish, times[-1] - finish))
            per_interval = max(14.0, max_tokens / (finish - outs[0].first_token_time) * interval)
            max_tokens += round(per_interval / 2)
            while max_tokens > 490:  # a whole interval's worth less keeps the phase, within max_model_len
                max_tokens -= round(per_interval)
            max_tokens = max(max_tokens, 100)
    finally:
        llm.shutdown()
        oracle.shutdown()
    telling = [(would, did) for would, did in held_finishes if would > 0.04]
    assert telling, f"no finish fell early in its interval: {held_finishes}"
    assert all(did < 0.03 for _, did in telling), held_finishes  # handed out when made, not held


def test_the_frontend_fills_every_output_field_from_the_core_reports():
    """OutputProcessor turns a sample's CoreOutputs into RequestOutputs field by field: the expected values are
    written from the reports and the request as added, not read back from the processor's own state."""
    from tokenizers import Tokenizer

    from engine.output_processor import OutputProcessor
    from engine.outputs import CoreOutput, TokenLogprob

    model = os.path.join(os.path.dirname(__file__), "..", "engine", "sim", "models", "qwen2.5-0.5b")
    tok = Tokenizer.from_file(os.path.join(model, "tokenizer.json"))
    proc = OutputProcessor(tok)
    params = SamplingParams(max_tokens=10, logprobs=1)
    proc.add("req", "a prompt", [5, 6, 7], params, 3.5, True, [params])
    ids = [tok.encode(w, add_special_tokens=False).ids[0] for w in ("Hello", " world")]
    lp = [TokenLogprob(ids[0], -0.5, [(ids[0], -0.5)]), TokenLogprob(ids[1], -1.5, [(ids[1], -1.5)])]
    prompt_lp = [None, TokenLogprob(6, -2.0, [], 1), TokenLogprob(7, -3.0, [], 2)]
    first = CoreOutput("req", 0, [ids[0]], new_logprobs=[lp[0]], num_cached_tokens=16, first_scheduled_time=4.0,
                       first_token_time=4.25, prompt_logprobs=prompt_lp)
    last = CoreOutput("req", 0, [ids[1]], "length", new_logprobs=[lp[1]], error=None)
    (a,), stopped = proc.process([first])
    (b,), _ = proc.process([last])
    assert stopped == []
    text0, text1 = tok.decode([ids[0]]), tok.decode(ids)[len(tok.decode([ids[0]])):]
    assert (a.request_id, a.index, a.prompt, a.prompt_token_ids) == ("req", 0, "a prompt", [5, 6, 7])
    assert (a.finished, a.finish_reason, a.finish_time, a.error, a.rejected) == (False, None, None, None, False)
    assert (a.delta_token_ids, a.delta_text, a.delta_logprobs) == ([ids[0]], text0, [lp[0]])
    assert (a.token_ids, a.text, a.logprobs, a.num_output_tokens) == ([ids[0]], text0, [lp[0]], 1)
    assert (a.num_cached_tokens, a.arrival_time, a.first_scheduled_time, a.first_token_time) == (16, 3.5, 4.0, 4.25)
    assert a.prompt_logprobs == prompt_lp and b.prompt_logprobs is None  # sent once
    assert (b.finished, b.finish_reason, b.error, b.rejected) == (True, "length", None, False)
    assert b.finish_time == b.output_time >= a.output_time > 0
    assert (b.delta_token_ids, b.delta_text, b.delta_logprobs) == ([ids[1]], text1, [lp[1]])
    assert (b.token_ids, b.text, b.logprobs, b.num_output_tokens) == (ids, tok.decode(ids), lp, 2)
    assert (b.num_cached_tokens, b.first_scheduled_time, b.first_token_time) == (16, 4.0, 4.25)
    rejected = CoreOutput("bad", 0, [], "abort", error="no such adapter", rejected=True)
    proc.add("bad", None, [1], params, 0.0, True, [params])
    (r,), _ = proc.process([rejected])
    assert (r.finished, r.finish_reason, r.error, r.rejected, r.prompt) == \
        (True, "abort", "no such adapter", True, None)
