"""Every metric Tandem exports: name, kind, labels and buckets, in one place.

The engine replicas and the HTTP ingress register these with Ray (cluster/metrics.py, through
ray.serve.metrics, which adds the deployment / replica / application labels); the Grafana dashboard
(dashboards/grafana.py), its tests and docs/operations.md read them from here. Nothing here imports Ray.

Ray exports a metric registered as `name` under `ray_<name>`; counters get a `_total` suffix; histograms
are the usual `_bucket` / `_sum` / `_count` series, counted in the replica and set as Ray gauges
(cluster.metrics.BucketedHistogram: Ray's Histogram takes a call per observation). Their `_sum` is exact.
Every histogram also exports the same exact sum as `<name>_total` (a "total", see MetricSpec; from when
Ray 2.60's Histogram rebuilt `_sum` from bucket midpoints; BucketedHistogram sets both), and means are
rate(<name>_total) / rate(<name>_count).

Latencies are split into two parts (label `part`), so Serve time and engine time can be told apart:
  engine  measured inside the engine on its own clock: queue = arrival -> first scheduled step,
          TTFT = arrival -> first token committed, ITL = time between token commits (one observation per
          token), e2e = arrival -> finish.
  serve   everything outside the engine (HTTP handling, tokenization, routing, Serve queues, the actor
          hops both ways): queue = ingress receipt -> engine arrival (wall clocks of two processes: exact
          on one node, off by the clock skew across nodes); TTFT and e2e = what the ingress measured minus
          the engine's own figure for the same request; ITL = the delay the trip back through Serve adds
          per token, one observation per request ((ingress decode span - engine decode span) / tokens).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

RAY_PREFIX = "ray_"
_NAME_RE = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")  # Ray drops other names silently (and warns on ':')

# ---- label names and values --------------------------------------------------------------------------
PART = "part"  # serve | engine
PARTS = ("serve", "engine")
POOL = "pool"  # KV block pool: device (GPU, or the CPU pool the CPU engine computes on) | cpu (offload)
POOLS = ("device", "cpu")
STATUS_CODE = "status_code"
FINISH_REASON = "finish_reason"  # stop | length | abort | error (the request failed; see status_code)
ENDPOINT = "endpoint"  # the matched route, e.g. /v1/chat/completions; "other" for unknown paths
# A client that disconnects mid-stream: nginx's 499 "client closed request" (the headers said 200).
STATUS_CLIENT_CLOSED = "499"
# Labels Ray Serve adds itself (ray.serve.metrics); a metric must not declare them.
SERVE_LABELS = ("deployment", "replica", "application")

# ---- buckets (seconds unless named otherwise) --------------------------------------------------------
# Latencies from well under a millisecond (the Serve part of a token) to minutes (long generations).
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 0.75, 1.0,
                   2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0)
# One engine step: tens of microseconds (a CUDA-graph decode) to seconds (a long CPU prefill).
STEP_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                1.0, 2.5, 5.0)
FRACTION_BUCKETS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99, 1.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)

Kind = Literal["counter", "gauge", "total", "histogram"]


@dataclass(frozen=True, slots=True)
class MetricSpec:
    """One exported metric.

    kind "total" is a monotonic engine total published as a Ray gauge that holds the engine's own
    cumulative count (the name ends in _total; PromQL rate() works on it and treats a replica restart as a
    counter reset). Ray counters cannot be created at 0 (inc() rejects 0), so a counter for a rare event
    (preemptions, offloads) would be missing until it first happens and its panels would sit empty.
    """

    name: str
    kind: Kind
    description: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] = ()

    @property
    def sum_spec(self) -> "MetricSpec | None":
        """A histogram's exact running sum (Ray's own _sum is a bucket-midpoint estimate)."""
        if self.kind != "histogram":
            return None
        return MetricSpec(self.name + "_total", "total", f"Exact sum of {self.name} observations.", self.labels)

    @property
    def exported(self) -> str:
        """The name Prometheus sees (histograms: the base of their _bucket/_sum/_count series)."""
        return RAY_PREFIX + self.name + ("_total" if self.kind == "counter" else "")

    @property
    def series(self) -> tuple[str, ...]:
        if self.kind == "histogram":
            return tuple(self.exported + s for s in ("_bucket", "_sum", "_count")) + self.sum_spec.series
        return (self.exported,)


def _c(name, description, labels=()):
    return MetricSpec(name, "counter", description, labels)


def _g(name, description, labels=()):
    return MetricSpec(name, "gauge", description, labels)


def _t(name, description, labels=()):
    return MetricSpec(name, "total", description, labels)


def _h(name, description, buckets, labels=()):
    return MetricSpec(name, "histogram", description, labels, buckets)


# ---- the ingress (OpenAIIngress replicas) --------------------------------------------------------------
REQUESTS = _c("tandem_requests", "Generation requests (completions, chat) by endpoint, status code and "
              "finish reason, plus every error response of any route.",
              (ENDPOINT, STATUS_CODE, FINISH_REASON))
QUEUE_TIME = _h("tandem_request_queue_time_seconds",
                "Time before the first engine step, by part (serve: ingress -> engine; engine: waiting).",
                LATENCY_BUCKETS, (PART,))
TTFT = _h("tandem_time_to_first_token_seconds", "Time to first token, by part (serve / engine).",
          LATENCY_BUCKETS, (PART,))
ITL = _h("tandem_inter_token_latency_seconds", "Inter-token latency, by part (serve / engine).",
         LATENCY_BUCKETS, (PART,))
E2E = _h("tandem_e2e_request_latency_seconds", "End-to-end request latency, by part (serve / engine).",
         LATENCY_BUCKETS, (PART,))

# ---- the engine replicas: cumulative totals ---------------------------------------------------------------
PROMPT_TOKENS = _t("tandem_prompt_tokens_total", "Prompt tokens of requests the engine accepted.")
GENERATION_TOKENS = _t("tandem_generation_tokens_total", "Tokens the engine generated.")
PREFIX_QUERIED = _t("tandem_prefix_cache_queried_tokens_total", "Prompt tokens looked up in the prefix cache.")
PREFIX_HITS = _t("tandem_prefix_cache_hit_tokens_total", "Prompt tokens served from the prefix cache.")
PREEMPTIONS = _t("tandem_preemptions_total", "Running requests preempted for lack of KV blocks.")
OFFLOADS = _t("tandem_offloads_total", "Preemptions that offloaded KV blocks to the CPU pool.")
SWAP_INS = _t("tandem_swap_ins_total", "Offloaded requests swapped back onto the device.")
SOFT_RESETS = _t("tandem_soft_resets_total", "Preemptions that freed KV blocks (recomputed later).")
STEPS = _t("tandem_engine_steps_total", "Engine steps committed.")
SPEC_DRAFTS = _t("tandem_spec_decode_draft_tokens_total", "Speculative draft tokens verified.")
SPEC_ACCEPTED = _t("tandem_spec_decode_accepted_tokens_total", "Speculative draft tokens accepted.")
SPEC_VERIFIES = _t("tandem_spec_decode_verify_chunks_total",
                   "Decodes that verified drafts (each also yields one token of its own).")

# ---- the engine replicas: current state ---------------------------------------------------------------------
WAITING = _g("tandem_num_requests_waiting", "Requests queued in the engine, not yet started.")
RUNNING = _g("tandem_num_requests_running", "Requests the engine is running.")
SWAPPED = _g("tandem_num_requests_swapped", "Preempted requests whose KV blocks wait in the CPU pool.")
KV_USAGE = _g("tandem_kv_cache_usage", "Fraction of KV blocks in use, by pool (0 for an empty pool).", (POOL,))
KV_BLOCKS = _g("tandem_kv_cache_blocks", "KV blocks in the pool (capacity), by pool.", (POOL,))
KV_WINDOW = "window"  # KV capacity: "in" (every position still in its sliding window) | "past" (none is)
KV_CAPACITY = _g("tandem_kv_cache_capacity_tokens", "Positions the device KV cache holds, by whether they are still "
                 "in the sliding window (equal for models without sliding-window layers).", (KV_WINDOW,))
KV_GROUP = "group"  # full | sliding
KV_BYTES_PER_TOKEN = _g("tandem_kv_cache_bytes_per_token", "K and V bytes one position holds, by layer group "
                        "(sliding: while in the window).", (KV_GROUP,))

# ---- the engine replicas: per step (drained from the engine's step records, off the engine thread) -----------
STEP_PERIOD = _h("tandem_step_period_seconds",
                 "Time between consecutive step commits while the engine has work.", STEP_BUCKETS)
# Steps right after an idle gap have no period: the period, bubble and busy figures cover the others.
STEP_FORWARD = _h("tandem_step_forward_seconds",
                  "Forward time per step (CUDA events on GPU, wall time of the compute thread on CPU).",
                  STEP_BUCKETS)
STEP_SAMPLE = _h("tandem_step_sample_seconds", "Sampling time per step (as forward).", STEP_BUCKETS)
STEP_BUBBLE = _h("tandem_step_bubble_seconds",
                 "Device idle time per step: period minus forward and sampling (the GPU bubble).",
                 STEP_BUCKETS)
STEP_BUSY = _h("tandem_step_busy_fraction", "Per step: (forward + sampling) / period.", FRACTION_BUCKETS)
BATCH_SIZE = _h("tandem_step_batch_size", "Requests per step.", BATCH_BUCKETS)
STEP_TOKENS = _h("tandem_step_tokens", "Tokens computed per step (prefill chunks + decodes).", TOKEN_BUCKETS)

INGRESS_METRICS = (REQUESTS, QUEUE_TIME, TTFT, ITL, E2E)
ENGINE_TOTALS = (PROMPT_TOKENS, GENERATION_TOKENS, PREFIX_QUERIED, PREFIX_HITS, PREEMPTIONS, OFFLOADS,
                 SWAP_INS, SOFT_RESETS, STEPS, SPEC_DRAFTS, SPEC_ACCEPTED, SPEC_VERIFIES)
ENGINE_GAUGES = (WAITING, RUNNING, SWAPPED, KV_USAGE, KV_BLOCKS, KV_CAPACITY, KV_BYTES_PER_TOKEN)
STEP_HISTOGRAMS = (STEP_PERIOD, STEP_FORWARD, STEP_SAMPLE, STEP_BUBBLE, STEP_BUSY, BATCH_SIZE, STEP_TOKENS)
ALL_METRICS = INGRESS_METRICS + ENGINE_TOTALS + ENGINE_GAUGES + STEP_HISTOGRAMS

# The engine.stats.EngineStats field behind each total. Every engine reports all of them; a name that is no
# field fails the exporter's flush (and tests/test_engine_stats.py), never exports 0.
TOTAL_STATS_KEYS = {
    PROMPT_TOKENS: "prompt_tokens", GENERATION_TOKENS: "generation_tokens",
    PREFIX_QUERIED: "prefix_cache_queried_tokens", PREFIX_HITS: "prefix_cache_hit_tokens",
    PREEMPTIONS: "num_preemptions", OFFLOADS: "num_offloads", SWAP_INS: "num_swap_ins",
    SOFT_RESETS: "num_soft_resets", STEPS: "steps", SPEC_DRAFTS: "spec_draft_tokens",
    SPEC_ACCEPTED: "spec_accepted_tokens", SPEC_VERIFIES: "spec_verify_chunks",
}


def exported_series() -> frozenset[str]:
    """Every series name a Prometheus scrape of a running Tandem app can contain."""
    return frozenset(s for m in ALL_METRICS for s in m.series)


def check_catalog(metrics: tuple[MetricSpec, ...] = ALL_METRICS) -> None:
    """Raise ValueError on a spec Ray would drop or reject (bad name, Serve-owned label, bad buckets)."""
    seen: set[str] = set()
    for m in list(metrics) + [x.sum_spec for x in metrics if x.sum_spec is not None]:
        if not _NAME_RE.match(m.name) or m.name in seen:
            raise ValueError(f"metric name {m.name!r} is invalid or duplicated")
        seen.add(m.name)
        if m.kind == "total" and not m.name.endswith("_total"):
            raise ValueError(f"{m.name}: a cumulative total's name must end in _total")
        if set(m.labels) & set(SERVE_LABELS):
            raise ValueError(f"{m.name}: labels {SERVE_LABELS} are added by Ray Serve")
        if (m.kind == "histogram") != bool(m.buckets):
            raise ValueError(f"{m.name}: histograms, and only they, have buckets")
        if list(m.buckets) != sorted(set(m.buckets)) or any(b <= 0 for b in m.buckets):
            raise ValueError(f"{m.name}: buckets must be positive and strictly increasing")
