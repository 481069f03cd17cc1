"""Autoscaling on engine signals, for Serve's custom-policy hook.

Serve applies min/max, upscale/downscale delays and smoothing around it; this decides the raw target.
"""

from __future__ import annotations

import math

from ray.serve.config import AutoscalingContext


class EngineAutoscalingPolicy:
    """Target = ongoing requests / target_ongoing_requests (Serve's default rule), raised by one replica
    when the engines queue requests they cannot start or run their KV cache hot.

    Defaults scale up under load and back down when idle: with the app's default
    target_ongoing_requests (a quarter of what a replica batches), a replica that is full and queueing
    triggers a scale-up; an idle deployment's target falls to min_replicas after downscale_delay_s.
    """

    def __init__(self, waiting_per_replica: float = 2.0, kv_usage_high: float = 0.9):
        self.waiting_per_replica = waiting_per_replica
        self.kv_usage_high = kv_usage_high

    def __call__(self, ctx: AutoscalingContext) -> tuple[float, dict]:
        n = ctx.current_num_replicas
        if n == 0:
            return ctx.target_num_replicas, {}
        desired = ctx.total_num_requests / ctx.config.get_target_ongoing_requests()
        # Per replica, what its record_autoscaling_stats() reported (cluster/replica.py sends every key each
        # time). Serve leaves a signal out while no replica has reported it in its window (replicas just
        # started, or their stats call failed): then it adds nothing to the rule, explicitly.
        metrics = ctx.aggregated_metrics or {}
        waiting = sum(metrics["num_waiting"].values()) if "num_waiting" in metrics else 0.0
        kv = list(metrics["kv_usage"].values()) if "kv_usage" in metrics else []
        if waiting > self.waiting_per_replica * n or (kv and sum(kv) / len(kv) > self.kv_usage_high):
            desired = max(desired, n + 1)
        return desired, {"engine_waiting": waiting}


def default_target_ongoing(max_ongoing_requests: int) -> float:
    return float(max(1, math.ceil(max_ongoing_requests / 4)))
