"""What the engine records for the metrics side: per-step timing records and per-request timestamps.

Oracles are independent of the engine's bookkeeping: token counts follow from the request sizes alone
(every position but the last generated one is computed exactly once when nothing is cached), and time
figures are bounded by wall clocks read in the test.
"""

from __future__ import annotations

import time

import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.executor import FWD_END, FWD_START, SAMPLE_END, SAMPLE_START, InlineExecutor, StreamExecutor

PROMPTS = [[5 + i, 17, 42 + i, 9, 300 + 7 * i] * (i + 1) for i in range(5)]
MAX_TOKENS = 12


def run(engine: LLMEngine, prompts) -> dict[str, list]:
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, temperature=0)
    ids = [engine.add_request(p, params, stream=True) for p in prompts]
    outputs: dict[str, list] = {rid: [] for rid in ids}
    while engine.has_unfinished():
        for out in engine.step():
            outputs[out.request_id].append(out)
    return outputs


@pytest.fixture(scope="module", params=[2, 1], ids=["pipelined", "blocking"])
def engine(request):
    eng = LLMEngine(EngineConfig(pipeline_depth=request.param, enable_prefix_caching=False))
    yield eng
    eng.shutdown()


def test_step_records_account_for_every_step_and_token(engine):
    engine.drain_step_records()
    steps_before = engine.stats()["steps"]
    t0 = time.perf_counter()
    run(engine, PROMPTS)
    wall = time.perf_counter() - t0
    records = engine.drain_step_records()
    assert len(records) == engine.stats()["steps"] - steps_before
    assert sum(r.num_tokens for r in records) == sum(len(p) + MAX_TOKENS - 1 for p in PROMPTS)
    assert max(r.num_seqs for r in records) == len(PROMPTS)  # all five decode together at some point
    assert all(r.forward_s > 0 and r.sample_s >= 0 for r in records)
    # One compute thread: its busy time and the commit periods both fit inside the wall time of the run.
    assert sum(r.forward_s + r.sample_s for r in records) <= wall
    periods = [r.period_s for r in records]
    assert periods[0] is None and all(p is not None and p > 0 for p in periods[1:])
    assert sum(periods[1:]) <= wall
    assert engine.drain_step_records() == []


def test_idle_time_is_not_a_period(engine):
    run(engine, PROMPTS[:1])
    engine.drain_step_records()
    time.sleep(0.3)
    t0 = time.perf_counter()
    run(engine, PROMPTS[:1])
    wall = time.perf_counter() - t0
    records = engine.drain_step_records()
    assert records[0].period_s is None  # the 0.3 s idle gap is not a bubble
    # Every later period lies inside the second run (a count of the idle gap would not fit): a bound on
    # wall time measured here, not on how fast a step is on a loaded machine.
    assert sum(r.period_s for r in records[1:]) <= wall


def test_request_timestamps_are_ordered(engine):
    before = time.monotonic()
    outputs = run(engine, PROMPTS)
    after = time.monotonic()
    for outs in outputs.values():
        final = outs[-1]
        assert final.finished and len(final.token_ids) == MAX_TOKENS
        assert before <= final.arrival_time <= final.first_scheduled_time <= final.first_token_time
        assert final.first_token_time <= final.finish_time == final.output_time <= after
        times = [o.output_time for o in outs]
        assert times == sorted(times) and outs[0].first_token_time <= times[0]
        assert sum(len(o.delta_token_ids) for o in outs) == MAX_TOKENS


def _phases(ex, step_id):
    return (ex.elapsed((step_id, FWD_START), (step_id, FWD_END)),
            ex.elapsed((step_id, SAMPLE_START), (step_id, SAMPLE_END)))


def test_cpu_executor_times_each_phase_on_the_worker_clock():
    ex = InlineExecutor()
    ex.mark(7, FWD_START)
    time.sleep(0.05)
    ex.mark(7, FWD_END)
    ex.mark(7, SAMPLE_START)
    time.sleep(0.02)
    ex.mark(7, SAMPLE_END)
    forward_s, sample_s = _phases(ex, 7)
    assert 0.05 <= forward_s < 0.5 and 0.02 <= sample_s < 0.5


@pytest.mark.gpu
def test_cuda_executor_times_device_time_not_launch_time():
    ex = StreamExecutor(torch.device("cuda"))
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    ex.mark(3, FWD_START)
    with torch.cuda.stream(ex.compute_stream):
        torch.cuda._sleep(200_000_000)  # ~0.1 s of device time; the host returns at once
    ex.mark(3, FWD_END)
    launched = time.perf_counter() - t0
    ex.mark(3, SAMPLE_START)
    ex.mark(3, SAMPLE_END)
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    forward_s, sample_s = _phases(ex, 3)
    assert launched < forward_s <= wall and 0 <= sample_s < forward_s
