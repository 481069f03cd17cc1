"""The recorders in cluster/metrics.py, with Ray's metric objects replaced by recording fakes.

Expected values are worked out by hand from the synthetic inputs (times, block counts); the end-to-end
export through a real Ray cluster is tests/test_metrics_e2e.py.
"""

from __future__ import annotations

import dataclasses
import time

import pytest

from cluster.metrics import BucketedHistogram, EngineMetrics, IngressMetrics, MetricsBuffer, RequestTiming
from cluster.protocol import GenerateChunk
from dashboards import metrics as m
from engine.outputs import RequestOutput, StepRecord
from engine.stats import EngineStats
from test_engine_stats import make_stats

IDLE_PERIOD = 3600.0  # the flush thread never fires on its own: tests call flush()


class Recorded:
    """Stands in for a ray.serve.metrics object; keeps every call."""

    def __init__(self, spec: m.MetricSpec):
        self.spec = spec
        self.calls: list[tuple[str, float, dict | None]] = []

    def inc(self, value, tags=None):
        self.calls.append(("inc", value, tags))

    def observe(self, value, tags=None, count=1):  # a histogram (BucketedHistogram's interface)
        self.calls += [("observe", value, tags)] * count

    def publish(self):
        self.calls.append(("publish", None, None))

    def set(self, value, tags=None):
        self.calls.append(("set", value, tags))

    def values(self, tags=None) -> list[float]:
        return [v for op, v, t in self.calls if op != "publish" and (tags is None or t == tags)]


class FakeLLM:
    def __init__(self, stats: EngineStats, records: list[StepRecord] = ()):
        self._stats, self.records = stats, list(records)

    def stats(self) -> EngineStats:
        return self._stats

    def drain_step_records(self) -> list[StepRecord]:
        out, self.records = self.records, []
        return out


STATS = make_stats(kv_blocks_total=200, kv_blocks_free=150, num_waiting=3, num_running=2, num_preemptions=4,
                   num_soft_resets=4, prompt_tokens=1000, generation_tokens=77, prefix_cache_hit_tokens=32,
                   prefix_cache_queried_tokens=64, steps=9)  # no CPU pool


@pytest.fixture
def engine_metrics():
    llm = FakeLLM(STATS)
    em = EngineMetrics(llm, period_s=IDLE_PERIOD, factory=Recorded)
    yield em, llm, em.buffer.metrics
    em.stop()


def test_engine_state_becomes_gauges(engine_metrics):
    em, llm, metrics = engine_metrics
    em.buffer.flush()
    assert metrics[m.KV_USAGE.name].values({m.POOL: "device"}) == [0.25]
    assert metrics[m.KV_USAGE.name].values({m.POOL: "cpu"}) == [0.0]  # empty pool: 0, not a division error
    assert metrics[m.KV_BLOCKS.name].values({m.POOL: "device"}) == [200.0]
    assert metrics[m.WAITING.name].values() == [3.0] and metrics[m.SWAPPED.name].values() == [0.0]
    assert metrics[m.PREEMPTIONS.name].values() == [4.0] and metrics[m.SWAP_INS.name].values() == [0.0]
    assert metrics[m.GENERATION_TOKENS.name].values() == [77.0]
    llm._stats = dataclasses.replace(STATS, kv_blocks_free=200, num_running=0, num_waiting=0)  # idle again
    em.buffer.flush()
    assert metrics[m.KV_USAGE.name].values({m.POOL: "device"})[-1] == 0.0
    assert metrics[m.RUNNING.name].values()[-1] == 0.0


def test_exporter_reads_every_stat_by_a_field_that_every_engine_reports():
    """The totals' stats keys are EngineStats fields outside the optional groups: never None, never absent."""
    fields = {f.name for f in dataclasses.fields(EngineStats) if f.default is not None}
    assert set(m.TOTAL_STATS_KEYS.values()) <= fields


def test_a_renamed_stat_fails_the_flush_instead_of_exporting_zero(engine_metrics, monkeypatch):
    """A snapshot cannot lack a field (EngineStats refuses to be built without one), so the exporter reads
    by attribute; a name that is no field (renamed on one side only) raises, where `.get(key, 0)` exported 0."""
    em, _, metrics = engine_metrics
    monkeypatch.setitem(m.TOTAL_STATS_KEYS, m.STEPS, "num_steps")  # renamed: the engine says "steps"
    with pytest.raises(AttributeError, match="num_steps"):
        em.buffer.flush()
    assert metrics[m.STEPS.name].values() == []


def test_step_records_become_step_histograms(engine_metrics):
    em, llm, metrics = engine_metrics
    llm.records = [StepRecord(4, 4, 0.006, 0.002, None),   # first after idle: no period
                   StepRecord(4, 4, 0.006, 0.002, 0.010),  # 2 ms bubble
                   StepRecord(8, 300, 0.030, 0.002, 0.025)]  # overlapped: busy > period
    em.buffer.flush()
    assert metrics[m.STEP_FORWARD.name].values() == [0.006, 0.006, 0.030]
    assert metrics[m.BATCH_SIZE.name].values() == [4, 4, 8]
    assert metrics[m.STEP_TOKENS.name].values() == [4, 4, 300]
    assert metrics[m.STEP_PERIOD.name].values() == [0.010, 0.025]
    assert metrics[m.STEP_BUBBLE.name].values() == pytest.approx([0.002, 0.0])
    assert metrics[m.STEP_BUSY.name].values() == pytest.approx([0.8, 1.0])
    llm.records = [StepRecord(1, 1, 0.001, 0.0, 0.004)]
    em.buffer.flush()
    assert metrics[m.STEP_TOKENS.name].values() == [4, 4, 300, 1]  # only the new record observed


def output(arrival, scheduled, first, at, n_tokens, finished=False) -> RequestOutput:
    return RequestOutput("r", None, [1, 2, 3], [7] * n_tokens, "", finished=finished,
                         finish_reason="length" if finished else None, delta_token_ids=[7],
                         arrival_time=arrival, first_scheduled_time=scheduled, first_token_time=first,
                         finish_time=at if finished else None, output_time=at)


def test_engine_request_timings(engine_metrics):
    em, _, metrics = engine_metrics
    prev = None
    for i, at in enumerate([10.5, 10.6, 10.8]):  # arrival 10.0, scheduled 10.1, first token 10.5
        prev = em.output(output(10.0, 10.1, 10.5, at, i + 1, finished=i == 2), prev)
    em.request_arrived(time.time() - 0.25)
    em.buffer.flush()
    engine = {m.PART: "engine"}
    assert metrics[m.ITL.name].values(engine) == pytest.approx([0.1, 0.2])
    assert metrics[m.TTFT.name].values(engine) == pytest.approx([0.5])
    assert metrics[m.QUEUE_TIME.name].values(engine) == pytest.approx([0.1])
    assert metrics[m.E2E.name].values(engine) == pytest.approx([0.8])
    [serve_queue] = metrics[m.QUEUE_TIME.name].values({m.PART: "serve"})
    assert 0.25 <= serve_queue < 1.0


def test_engine_itl_counts_every_token_after_the_first_when_the_first_output_merges_commits(engine_metrics):
    """A slow consumer can receive its first 3 tokens in one output: 2 gaps from the first token's time."""
    em, _, metrics = engine_metrics
    first = RequestOutput("r", None, [1], [7, 8, 9], "", delta_token_ids=[7, 8, 9], arrival_time=10.0,
                          first_scheduled_time=10.1, first_token_time=10.5, output_time=10.7)
    second = RequestOutput("r", None, [1], [7, 8, 9, 6], "", finished=True, finish_reason="length",
                           delta_token_ids=[6], arrival_time=10.0, first_scheduled_time=10.1,
                           first_token_time=10.5, finish_time=11.0, output_time=11.0)
    em.output(second, em.output(first, None))
    em.buffer.flush()
    # 4 tokens, 3 gaps: (10.7 - 10.5) / 2 twice, then 11.0 - 10.7.
    assert metrics[m.ITL.name].values({m.PART: "engine"}) == pytest.approx([0.1, 0.1, 0.3])


def chunk(n_tokens: int, engine_at: float, finished: bool = False) -> GenerateChunk:
    return GenerateChunk("r", "x", [7], None, finished, "stop" if finished else None, 3, n_tokens, 0,
                         arrival_time=100.0, first_scheduled_time=100.05, first_token_time=100.2,
                         finish_time=engine_at if finished else None, output_time=engine_at)


def test_ingress_serve_share_is_ingress_time_minus_engine_time():
    im = IngressMetrics(period_s=IDLE_PERIOD, factory=Recorded)
    timing = RequestTiming()
    timing.receipt = 50.0  # the ingress's clock; the engine's runs elsewhere (100.0 at arrival)
    timing.first, timing.first_at = chunk(1, 100.2), 50.35  # engine TTFT 0.2, ingress 0.35
    timing.last, timing.last_at = chunk(11, 101.2, True), 51.45  # engine e2e 1.2, ingress 1.45
    im.finished(timing)
    im.count("/v1/completions", 200, "stop")
    im.buffer.flush()
    serve = {m.PART: "serve"}
    metrics = im.buffer.metrics
    assert metrics[m.TTFT.name].values(serve) == pytest.approx([0.15])
    assert metrics[m.E2E.name].values(serve) == pytest.approx([0.25])
    assert metrics[m.ITL.name].values(serve) == pytest.approx([(1.1 - 1.0) / 10])
    assert metrics[m.REQUESTS.name].calls == [("inc", 1, {m.ENDPOINT: "/v1/completions",
                                                          m.STATUS_CODE: "200", m.FINISH_REASON: "stop"})]
    im.stop()


def test_request_timing_keeps_first_token_chunk_and_last_chunk():
    timing = RequestTiming()
    for c in (chunk(1, 1.0), chunk(2, 2.0), chunk(2, 3.0, True)):
        timing.chunk(c)
    assert timing.first.output_time == 1.0 and timing.last.output_time == 3.0
    assert timing.receipt <= timing.first_at <= timing.last_at


def test_flush_thread_applies_pending_updates_and_survives_a_failing_collect():
    calls = {"n": 0}

    def collect():
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("engine stats unavailable")

    buf = MetricsBuffer([m.REQUESTS], collect, period_s=0.05, factory=Recorded)
    buf.add(m.REQUESTS, 1, {m.ENDPOINT: "x", m.STATUS_CODE: "200", m.FINISH_REASON: "stop"})
    deadline = time.monotonic() + 5
    while calls["n"] < 3 and time.monotonic() < deadline:
        time.sleep(0.02)
    buf.stop()
    assert calls["n"] >= 3
    assert len(buf.metrics[m.REQUESTS.name].calls) == 1


def test_bucketed_histogram_publishes_the_series_rays_histogram_would():
    """Prometheus' histogram: cumulative `_bucket` counts by `le` (a value on a bound counts in that bucket),
    `+Inf` holding every observation, `_count`, and the exact `_sum`; label sets kept apart; running values."""
    spec = m.MetricSpec("tandem_x_seconds", "histogram", "x", (m.PART,), (0.5, 1, 2.0))
    h = BucketedHistogram(spec, Recorded)
    # the series Ray's Histogram would export under this name, and the exact-sum companion the dashboards read
    assert {m.RAY_PREFIX + g.spec.name for g in (h._bucket, h._count, h._sum, h._total)} == set(spec.series)
    assert h._bucket.spec.labels == (m.PART, "le") and h._bucket.spec.kind == "gauge"
    engine, serve = {m.PART: "engine"}, {m.PART: "serve"}
    h.observe(0.5, engine)
    h.observe(0.7, engine, count=3)
    h.observe(5.0, engine)
    h.observe(0.1, serve)
    h.publish()

    def buckets(tags):  # the last value set for each `le`
        return {t["le"]: v for _, v, t in h._bucket.calls if {k: x for k, x in t.items() if k != "le"} == tags}

    assert buckets(engine) == {"0.5": 1.0, "1.0": 4.0, "2.0": 4.0, "+Inf": 5.0}
    assert buckets(serve) == {"0.5": 1.0, "1.0": 1.0, "2.0": 1.0, "+Inf": 1.0}
    assert h._count.values(engine) == [5.0] and h._sum.values(engine) == pytest.approx([0.5 + 2.1 + 5.0])
    assert h._total.values(engine) == pytest.approx([7.6]) and h._total.values(serve) == pytest.approx([0.1])
    h.observe(1.5, engine)
    h.publish()
    assert buckets(engine) == {"0.5": 1.0, "1.0": 4.0, "2.0": 5.0, "+Inf": 6.0}
    assert h._count.values(engine)[-1] == 6.0 and h._sum.values(engine)[-1] == pytest.approx(9.1)
    assert h._total.values(engine)[-1] == pytest.approx(9.1)


def test_the_buffer_publishes_its_histograms_at_each_flush():
    buf = MetricsBuffer([m.ITL], None, period_s=IDLE_PERIOD, factory=Recorded)
    buf.add(m.ITL, 0.01, {m.PART: "engine"}, count=3)
    buf.flush()
    itl = buf.metrics[m.ITL.name]
    assert itl.values() == [0.01] * 3 and itl.calls[-1][0] == "publish"
    buf.flush()  # nothing new: published again all the same (Ray drops a gauge that is not set again)
    assert [op for op, _, _ in itl.calls].count("publish") == 2
    buf.stop()
