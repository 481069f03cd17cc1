"""Recording Tandem's metrics with Ray: the engine replica's exporter and the ingress's recorder.

Names, labels and buckets come from dashboards.metrics. Nothing is recorded on the engine thread: the
engine only appends step records and stamps its outputs; request handlers only append to a buffer. A
flush thread per replica process applies the buffer and the engine's state to Ray's metrics once per
FLUSH_PERIOD_S (Ray itself exports every few seconds). The metrics are ray.serve.metrics, so inside a
Serve replica they carry the deployment / replica / application labels.
"""

from __future__ import annotations

import bisect
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable

from dashboards import metrics as m
from engine.outputs import RequestOutput, StepRecord

logger = logging.getLogger(__name__)

FLUSH_PERIOD_S = 1.0
_ENGINE = {m.PART: "engine"}
_SERVE = {m.PART: "serve"}


def ray_metric(spec: m.MetricSpec):
    """The ray.serve.metrics object for `spec` ("total" is a gauge: see MetricSpec; a histogram is a
    BucketedHistogram over gauges)."""
    from ray.serve import metrics as serve_metrics

    tag_keys = spec.labels or None
    if spec.kind == "counter":
        return serve_metrics.Counter(spec.name, spec.description, tag_keys=tag_keys)
    if spec.kind == "histogram":
        return BucketedHistogram(spec, ray_metric)
    return serve_metrics.Gauge(spec.name, spec.description, tag_keys=tag_keys)


class BucketedHistogram:
    """A histogram counted in this process and published as its Prometheus series: `<name>_bucket` (label `le`,
    cumulative), `<name>_count` and `<name>_sum`, each a Ray gauge holding the running value, and the exact-sum
    companion `<name>_total` (MetricSpec.sum_spec, which the dashboards' PromQL reads) holding the same sum.

    Why not Ray's Histogram: it takes one call per observation (no count), each a few microseconds, and the
    ITL is one observation per token, so at GPU rates those calls took a large share of the replica's CPU,
    under the GIL the streams need (measured: bench/README.md, "Metrics exporter"). Here an observation is a
    bisect and two additions, and a flush sets (buckets + 3) gauges per label set. The series names, labels
    and `le` values are the ones Ray's Histogram exports, so every PromQL query reads them alike; the `_sum`
    is exact (Ray 2.60's is a bucket-midpoint estimate). The exposition types them as gauges."""

    def __init__(self, spec: m.MetricSpec, factory: Callable):
        self.buckets = tuple(float(b) for b in spec.buckets)
        self._le = [str(b) for b in self.buckets] + ["+Inf"]  # how Ray's Histogram writes `le`
        self._bucket = factory(m.MetricSpec(spec.name + "_bucket", "gauge", spec.description, spec.labels + ("le",)))
        self._count = factory(m.MetricSpec(spec.name + "_count", "gauge", spec.description, spec.labels))
        self._sum = factory(m.MetricSpec(spec.name + "_sum", "gauge", spec.description, spec.labels))
        self._total = factory(spec.sum_spec)
        self._state: dict[tuple, list] = {}  # sorted tags -> [per-bucket counts (not cumulative), count, sum]

    def observe(self, value: float, tags: dict | None = None, count: int = 1) -> None:
        key = tuple(sorted((tags or {}).items()))
        state = self._state.get(key)
        if state is None:
            state = self._state[key] = [[0] * (len(self.buckets) + 1), 0, 0.0]
        state[0][bisect.bisect_left(self.buckets, value)] += count  # `le`: a value on a bound counts in it
        state[1] += count
        state[2] += value * count

    def publish(self) -> None:
        """Set every label set's series to its running values (each flush: Ray drops a gauge not set again)."""
        for key, (counts, count, total) in self._state.items():
            tags = dict(key)
            cumulative = 0
            for le, n in zip(self._le, counts):
                cumulative += n
                self._bucket.set(float(cumulative), {**tags, "le": le})
            self._count.set(float(count), tags or None)
            self._sum.set(total, tags or None)
            self._total.set(total, tags or None)


class MetricsBuffer:
    """Pending metric updates plus the thread that applies them.

    add() only appends to a deque (safe from any thread, no lock); every `period_s` the flush thread calls
    `collect` (to read state such as engine stats), applies what is pending and publishes the histograms
    (BucketedHistogram, with their exact-sum `_total` companions)."""

    def __init__(self, specs: Iterable[m.MetricSpec], collect: Callable[[], None] | None = None,
                 period_s: float = FLUSH_PERIOD_S, factory: Callable = ray_metric):
        specs = list(specs)
        self.metrics = {spec.name: factory(spec) for spec in specs}
        self._histograms = [self.metrics[spec.name] for spec in specs if spec.kind == "histogram"]
        self._pending: deque[tuple[m.MetricSpec, float, dict | None, int]] = deque()
        self._collect = collect
        self._period_s = period_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tandem-metrics", daemon=True)
        self._thread.start()

    def add(self, spec: m.MetricSpec, value: float, tags: dict | None = None, count: int = 1) -> None:
        """Queue `count` observations (histogram), an increment (counter) or a value (gauge)."""
        self._pending.append((spec, value, tags, count))

    def apply(self, spec: m.MetricSpec, value: float, tags: dict | None = None, count: int = 1) -> None:
        """Record now (flush thread only)."""
        metric = self.metrics[spec.name]
        if spec.kind == "counter":
            metric.inc(value * count, tags)
        elif spec.kind == "histogram":
            metric.observe(value, tags, count)
        else:
            metric.set(value, tags)

    def flush(self) -> None:
        try:
            if self._collect is not None:
                self._collect()
        finally:  # a failing collect must not let the pending updates pile up
            while self._pending:
                self.apply(*self._pending.popleft())
            for metric in self._histograms:
                metric.publish()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.wait(self._period_s):
            try:
                self.flush()
            except Exception:  # noqa: BLE001 - a metrics bug must never take the replica down
                logger.exception("metrics flush failed")


class EngineMetrics:
    """Exporter inside an engine replica: engine state as gauges, step records and per-request engine
    timings as histograms, and the Serve-side queue time measured at arrival."""

    def __init__(self, llm, period_s: float = FLUSH_PERIOD_S, factory: Callable = ray_metric):
        self.llm = llm  # engine.AsyncLLM: stats() and drain_step_records() are safe from this thread
        specs = m.ENGINE_TOTALS + m.ENGINE_GAUGES + m.STEP_HISTOGRAMS + (m.QUEUE_TIME, m.TTFT, m.ITL, m.E2E)
        self.buffer = MetricsBuffer(specs, self.collect, period_s, factory)

    # ---- request path (replica event loop): append only -----------------------------------------------
    def request_arrived(self, ingress_time: float) -> None:
        """Serve's share of the queue time: ingress receipt -> here (wall clocks; see dashboards.metrics)."""
        self.buffer.add(m.QUEUE_TIME, max(0.0, time.time() - ingress_time), _SERVE)

    def output(self, out: RequestOutput, prev_output_time: float | None) -> float | None:
        """Note one engine output; returns the time of the last output that carried tokens.

        ITL counts one gap per token after the first. When the first output already carries k > 1 tokens
        (the consumer was slower than the engine, so several commits merged), its k - 1 later tokens are
        spread from the first token's time; before, they were dropped and the count came up short."""
        k = len(out.delta_token_ids)
        prev, gaps = (prev_output_time, k) if prev_output_time is not None else (out.first_token_time, k - 1)
        if gaps > 0 and prev is not None:
            self.buffer.add(m.ITL, (out.output_time - prev) / gaps, _ENGINE, count=gaps)
        if out.finished:
            self._finished(out)
        return out.output_time if k else prev_output_time

    def _finished(self, out: RequestOutput) -> None:
        if out.first_scheduled_time is not None:
            self.buffer.add(m.QUEUE_TIME, out.first_scheduled_time - out.arrival_time, _ENGINE)
        if out.first_token_time is not None:
            self.buffer.add(m.TTFT, out.first_token_time - out.arrival_time, _ENGINE)
        if out.finish_time is not None:
            self.buffer.add(m.E2E, out.finish_time - out.arrival_time, _ENGINE)

    # ---- flush thread ----------------------------------------------------------------------------------
    def collect(self) -> None:
        # Typed stats (engine/stats.py), read by attribute: a renamed field raises here (the flush logs it)
        # instead of exporting 0.
        stats = self.llm.stats()
        apply = self.buffer.apply
        for spec, key in m.TOTAL_STATS_KEYS.items():
            apply(spec, float(getattr(stats, key)))
        apply(m.WAITING, float(stats.num_waiting))
        apply(m.RUNNING, float(stats.num_running))
        apply(m.SWAPPED, float(stats.num_swapped))
        for pool, total, free in (("device", stats.kv_blocks_total, stats.kv_blocks_free),
                                  ("cpu", stats.cpu_blocks_total, stats.cpu_blocks_free)):
            apply(m.KV_BLOCKS, float(total), {m.POOL: pool})
            apply(m.KV_USAGE, (total - free) / total if total else 0.0, {m.POOL: pool})  # no CPU pool: 0
        apply(m.KV_CAPACITY, float(stats.kv_capacity_tokens), {m.KV_WINDOW: "in"})
        apply(m.KV_CAPACITY, float(stats.kv_capacity_tokens_past_window), {m.KV_WINDOW: "past"})
        apply(m.KV_BYTES_PER_TOKEN, float(stats.kv_bytes_per_token_full), {m.KV_GROUP: "full"})
        apply(m.KV_BYTES_PER_TOKEN, float(stats.kv_bytes_per_token_sliding), {m.KV_GROUP: "sliding"})
        for record in self.llm.drain_step_records():
            self._step(record)

    def _step(self, r: StepRecord) -> None:
        apply = self.buffer.apply
        apply(m.STEP_FORWARD, r.forward_s)
        apply(m.STEP_SAMPLE, r.sample_s)
        apply(m.BATCH_SIZE, r.num_seqs)
        apply(m.STEP_TOKENS, r.num_tokens)
        if r.period_s:
            busy = r.forward_s + r.sample_s
            apply(m.STEP_PERIOD, r.period_s)
            # On CPU the next forward can start before this commit is read, so a step's busy time may
            # exceed its commit-to-commit period: clamp, the bubble of such a step is zero.
            apply(m.STEP_BUBBLE, max(0.0, r.period_s - busy))
            apply(m.STEP_BUSY, min(1.0, busy / r.period_s))

    def stop(self) -> None:
        self.buffer.stop()


class IngressMetrics:
    """Recorder inside the HTTP ingress: requests by status and finish reason, and the Serve share of
    TTFT, ITL and end-to-end latency (what the ingress measured minus the engine's figures)."""

    def __init__(self, period_s: float = FLUSH_PERIOD_S, factory: Callable = ray_metric):
        self.buffer = MetricsBuffer((m.REQUESTS, m.TTFT, m.ITL, m.E2E), None, period_s, factory)

    def count(self, endpoint: str, status_code: int | str, finish_reason: str) -> None:
        self.buffer.add(m.REQUESTS, 1, {m.ENDPOINT: endpoint, m.STATUS_CODE: str(status_code),
                                        m.FINISH_REASON: finish_reason})

    def finished(self, timing: "RequestTiming") -> None:
        """Record the Serve share of a request that ran to its last chunk."""
        first, last = timing.first, timing.last
        if first is not None and first.first_token_time is not None:
            engine_ttft = first.first_token_time - first.arrival_time
            self.buffer.add(m.TTFT, max(0.0, timing.first_at - timing.receipt - engine_ttft), _SERVE)
        if last is not None and last.finish_time is not None:
            engine_e2e = last.finish_time - last.arrival_time
            self.buffer.add(m.E2E, max(0.0, timing.last_at - timing.receipt - engine_e2e), _SERVE)
        if first is not None and last is not None and last.num_output_tokens > first.num_output_tokens:
            ingress_span = timing.last_at - timing.first_at
            engine_span = last.output_time - first.output_time
            tokens = last.num_output_tokens - first.num_output_tokens
            # Can dip below 0 when the first chunk was held up longer than the last one: no added delay.
            self.buffer.add(m.ITL, max(0.0, ingress_span - engine_span) / tokens, _SERVE)

    def stop(self) -> None:
        self.buffer.stop()


class RequestTiming:
    """What the ingress notes about one request's chunks: its own receipt and arrival times (monotonic)
    next to the first and last chunk that carried tokens, which hold the engine's timestamps."""

    __slots__ = ("receipt", "receipt_wall", "first", "first_at", "last", "last_at")

    def __init__(self) -> None:
        self.receipt = time.monotonic()
        self.receipt_wall = time.time()  # sent along to the engine replica (GenerateRequest.ingress_time)
        self.first = self.last = None
        self.first_at = self.last_at = 0.0

    def chunk(self, chunk) -> None:
        """Note a cluster.protocol.GenerateChunk on arrival at the ingress (of an n > 1 request, sample 0's
        chunks stand for the request: the spans below compare one sample's token counts)."""
        if chunk.index:
            return
        now = time.monotonic()
        if chunk.delta_token_ids or chunk.finished:
            if self.first is None and chunk.delta_token_ids:
                self.first, self.first_at = chunk, now
            self.last, self.last_at = chunk, now
