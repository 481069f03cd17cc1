"""Unit tests, no cluster: the prefix-aware request router, the autoscaling policy, and the app config.

The router is the real Serve RequestRouter subclass, built the way Serve builds it (constructor, then
initialize_state); replicas are small fakes with the two attributes the router reads (replica_id,
routing_stats). Prefix hashes come from engine.block_manager, the same functions the engine uses.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest
from ray.serve._private.common import DeploymentHandleSource, DeploymentID
from ray.serve.config import AutoscalingConfig, AutoscalingContext
from ray.serve.request_router import ReplicaID

from cluster.autoscaling import EngineAutoscalingPolicy, default_target_ongoing
from cluster.protocol import GenerateRequest
from cluster.replica import EngineReplica
from cluster.router import PrefixAwareRouter, router_class
from engine import LLM, EngineConfig, EngineStats, SamplingParams, cpu_alloc
from engine.block_manager import prefix_hashes
from engine.lora import LoRARequest
from serve_app import AppConfig, build_app
from serve_app.builder import COLOCATED_DEPLOYMENT, app_core_process, app_is_colocated
from test_engine_stats import make_stats

DEPLOYMENT = DeploymentID(name="EngineReplica", app_name="app")
BS = 16


@dataclass
class FakeReplica:
    """The part of RunningReplica the router reads."""

    replica_id: ReplicaID
    routing_stats: dict = field(default_factory=dict)


def replica(name: str, waiting: int = 0, kv_usage: float = 0.0, hashes: list[int] | None = None) -> FakeReplica:
    return FakeReplica(ReplicaID(unique_id=name, deployment_id=DEPLOYMENT), stats(waiting, kv_usage, hashes))


def stats(waiting: int = 0, kv_usage: float = 0.0, hashes: list[int] | None = None) -> dict:
    """A report as EngineReplica.record_routing_stats sends it (every key, every time)."""
    return {"num_waiting": waiting, "num_running": 0, "kv_usage": kv_usage, "kv_blocks_free": 100,
            "kv_blocks_total": 100, "block_size": BS, "prefix_cache_hit_tokens": 0,
            "prefix_cache_queried_tokens": 0, "prefix_hashes": list(hashes or []), "lora_adapters": []}


_counter = iter(range(10**9))


def pending(tokens: list[int]) -> SimpleNamespace:
    """A PendingRequest look-alike: the router finds the GenerateRequest among args/kwargs."""
    request = GenerateRequest(f"req-{next(_counter)}", list(tokens), SamplingParams())
    return SimpleNamespace(args=[request], kwargs={})


def prompt(seed: int, n_blocks: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 4000 + 1 for i in range(n_blocks * BS + 3)]


@pytest.fixture
def router() -> PrefixAwareRouter:
    r = PrefixAwareRouter(deployment_id=DEPLOYMENT, handle_source=DeploymentHandleSource.UNKNOWN)
    r.initialize_state()  # Serve calls it with the deployment's request_router_kwargs (none here)
    return r


def choose(router: PrefixAwareRouter, replicas: list[FakeReplica], request=None) -> list[str]:
    ranks = asyncio.run(router.choose_replicas(replicas, request))
    assert all(len(rank) == 1 for rank in ranks)
    return [rank[0].replica_id.unique_id for rank in ranks]


def route(router: PrefixAwareRouter, replicas: list[FakeReplica], request, to: FakeReplica) -> None:
    """What Serve does for one request: rank the candidates, then report where the request went."""
    choose(router, replicas, request)
    router.on_request_routed(request, to.replica_id, None)


# ---- load ranking ----------------------------------------------------------------------------------------

def test_no_candidates_gives_no_ranks(router):
    assert asyncio.run(router.choose_replicas([], pending(prompt(1, 2)))) == []


def test_ranks_by_load_without_prefix_knowledge(router):
    replicas = [replica("busy", waiting=5), replica("idle"), replica("hot_kv", kv_usage=0.5),
                replica("some", waiting=1)]
    assert choose(router, replicas, pending(prompt(1, 3))) == ["idle", "some", "hot_kv", "busy"]
    assert choose(router, replicas, None) == ["idle", "some", "hot_kv", "busy"]


def test_own_inflight_count_is_load_and_completion_releases_it(router):
    a, b = replica("a"), replica("b")
    for _ in range(2):
        router.on_request_routed(pending([1, 2, 3]), a.replica_id, None)
    assert router.load(a) == 2 and choose(router, [a, b]) == ["b", "a"]
    router.on_request_completed(a.replica_id, "internal-1")
    assert router.load(a) == 1
    router.on_request_completed(a.replica_id, "internal-2")
    assert router.load(a) == 0
    router.on_request_completed(a.replica_id, "spurious")  # never negative
    assert router.load(a) == 0


# ---- prefix affinity -------------------------------------------------------------------------------------

def test_replica_with_longest_reported_prefix_wins(router):
    tokens = prompt(2, 6)
    h = prefix_hashes(tokens, BS, 64)
    assert len(h) == 6
    replicas = [replica("none"), replica("short", hashes=h[:2] + [12345]), replica("long", waiting=1, hashes=h[:5]),
                replica("gap", hashes=[h[0]] + h[2:])]  # a chain with a hole only counts up to the hole
    assert choose(router, replicas, pending(tokens))[0] == "long"
    assert router.best_prefix_replica(replicas, h).replica_id.unique_id == "long"


def test_unrelated_prompt_ignores_reported_prefixes(router):
    replicas = [replica("cached", waiting=1, hashes=prefix_hashes(prompt(3, 4), BS, 64)), replica("idle")]
    assert choose(router, replicas, pending(prompt(4, 4))) == ["idle", "cached"]


def test_prefix_ties_go_to_the_less_loaded(router):
    tokens = prompt(5, 3)
    h = prefix_hashes(tokens, BS, 64)
    replicas = [replica("x", waiting=2, hashes=h), replica("y", waiting=1, hashes=h), replica("z")]
    assert choose(router, replicas, pending(tokens))[0] == "y"


def test_overload_past_imbalance_threshold_overrides_affinity(router):
    tokens = prompt(6, 4)
    h = prefix_hashes(tokens, BS, 64)
    threshold = router.imbalance_threshold
    at = [replica("cached", waiting=int(threshold), hashes=h), replica("idle")]
    assert choose(router, at, pending(tokens))[0] == "cached"  # exactly at the threshold: affinity holds
    past = [replica("cached", waiting=int(threshold) + 1, hashes=h), replica("idle")]
    assert choose(router, past, pending(tokens)) == ["idle", "cached"]
    kv_hot = [replica("cached", kv_usage=0.9, hashes=h), replica("idle")]  # 8 * 0.9 > 4
    assert choose(router, kv_hot, pending(tokens)) == ["idle", "cached"]


def test_imbalance_threshold_is_configurable(router):
    router.initialize_state(imbalance_threshold=100.0)
    tokens = prompt(7, 2)
    replicas = [replica("cached", waiting=50, hashes=prefix_hashes(tokens, BS, 64)), replica("idle")]
    assert choose(router, replicas, pending(tokens))[0] == "cached"


def test_router_memory_gives_affinity_before_any_report(router):
    tokens = prompt(8, 4)
    a, b = replica("a"), replica("b")
    first = pending(tokens)
    ranks = choose(router, [a, b], first)
    chosen = {"a": a, "b": b}[ranks[0]]
    router.on_request_routed(first, chosen.replica_id, None)
    # The chosen replica is now more loaded (1 in flight) and has reported nothing, yet a request that
    # shares the prefix (different tail) goes back to it.
    follow_up = pending(tokens[: 3 * BS] + [9, 9, 9, 9, 9])
    assert choose(router, [a, b], follow_up)[0] == chosen.replica_id.unique_id
    # ...while an unrelated prompt goes to the idle one.
    assert choose(router, [a, b], pending(prompt(9, 4)))[0] != chosen.replica_id.unique_id


def test_router_memory_deeper_than_report_wins(router):
    tokens = prompt(10, 6)
    h = prefix_hashes(tokens, BS, 64)
    a, b = replica("a", hashes=h[:2]), replica("b")
    route(router, [a, b], pending(tokens), to=b)
    assert choose(router, [a, b], pending(tokens))[0] == "b"


def test_replica_death_forgets_its_load_and_affinity(router):
    tokens = prompt(11, 4)
    a, b = replica("a"), replica("b")
    for _ in range(3):
        route(router, [a, b], pending(tokens), to=a)
    assert router.load(a) == 3
    assert router.best_prefix_replica([a, b], prefix_hashes(tokens, BS, 64)) is a
    router.on_replica_actor_died(a.replica_id)
    assert router.load(a) == 0
    assert router.best_prefix_replica([a, b], prefix_hashes(tokens, BS, 64)) is None
    assert choose(router, [b], pending(tokens)) == ["b"]


def test_block_size_comes_from_the_replicas_report(router):
    tokens = prompt(12, 4)
    h32 = prefix_hashes(tokens, 32, 64)
    cached = replica("cached", waiting=1, hashes=h32)
    cached.routing_stats["block_size"] = 32
    idle = replica("idle")
    idle.routing_stats["block_size"] = 32
    assert choose(router, [idle, cached], pending(tokens))[0] == "cached"


def test_new_report_replaces_old_prefix_knowledge(router):
    """Each routing-stats poll hands the router a new report; it must use the latest one, even when the
    new report has the same length as the old (the router caches reports as sets, so a cache keyed on
    anything weaker than the report itself would go stale)."""
    t1, t2 = prompt(13, 4), prompt(14, 4)
    h1, h2 = prefix_hashes(t1, BS, 64), prefix_hashes(t2, BS, 64)
    cached, idle = replica("cached", waiting=1, hashes=h1), replica("idle")
    assert choose(router, [cached, idle], pending(t1))[0] == "cached"
    for _ in range(3):  # several polls of same-length reports, old ones dropped each time
        cached.routing_stats = {**stats(waiting=1), "prefix_hashes": [*h2]}
        assert choose(router, [cached, idle], pending(t2))[0] == "cached"
        assert choose(router, [cached, idle], pending(t1))[0] == "idle"


def test_engine_report_and_router_hashes_agree():
    """The hashes an engine reports for a prompt it served are what the router computes for that prompt."""
    llm = LLM(num_kv_blocks=64, max_num_seqs=4)
    try:
        tokens = prompt(15, 3)
        llm.generate([tokens], SamplingParams(temperature=0, max_tokens=2))
        reported = set(llm.engine.block_manager.recent_hashes(4096))
        assert set(prefix_hashes(tokens, BS, 64)) <= reported
        assert not set(prefix_hashes(prompt(16, 3), BS, 64)) & reported
    finally:
        llm.shutdown()


def replica_reports(s: EngineStats, prefix_summary: list[int] = ()) -> tuple[dict, dict]:
    """(record_routing_stats(), record_autoscaling_stats()) of an EngineReplica whose engine reports `s`."""
    replica = EngineReplica.__new__(EngineReplica)  # the two methods read only the engine and its config
    replica.llm = SimpleNamespace(stats=lambda: s, prefix_summary=list(prefix_summary))
    replica.config = EngineConfig(block_size=BS)
    replica._shut_down = True  # no engine or metrics thread to stop when it is collected
    return replica.record_routing_stats(), replica.record_autoscaling_stats()


def test_the_router_reads_the_replicas_report_by_key(router):
    """The replica builds its report from the typed stats, and it carries every key the router reads."""
    tokens = prompt(17, 3)
    report, _ = replica_reports(make_stats(num_waiting=2, kv_blocks_total=100, kv_blocks_free=75),
                                prefix_hashes(tokens, BS, 64))
    assert set(report) == set(stats())
    cached = FakeReplica(ReplicaID(unique_id="cached", deployment_id=DEPLOYMENT), report)
    assert router.load(cached) == 2 + router.kv_weight * 0.25
    assert choose(router, [replica("idle"), cached], pending(tokens))[0] == "cached"
    lora, _ = replica_reports(make_stats(kv_blocks_total=100, kv_blocks_free=100, lora_resident=("sql",),
                                         lora_loads=1, lora_evictions=0, max_loras=2))
    assert report["lora_adapters"] == [] and lora["lora_adapters"] == ["sql"]


def test_a_report_missing_a_key_fails_instead_of_reading_as_zero(router):
    broken = replica("broken", waiting=5)
    del broken.routing_stats["num_waiting"]  # renamed on the replica side
    with pytest.raises(KeyError, match="num_waiting"):
        router.load(broken)


def test_a_replica_not_polled_yet_is_ranked_by_what_this_router_sent_it(router):
    """Serve gives a replica it has not polled yet an empty report: its load is this router's own in-flight
    count, it holds no prefixes or adapters, and the block size is the engine's default."""
    new, busy = FakeReplica(ReplicaID(unique_id="new", deployment_id=DEPLOYMENT)), replica("busy", waiting=3)
    assert router.load(new) == 0 and choose(router, [busy, new], pending(prompt(18, 2))) == ["new", "busy"]
    router.on_request_routed(pending([1, 2]), new.replica_id, None)
    assert router.load(new) == 1
    assert router.best_prefix_replica([new], prefix_hashes(prompt(18, 2), BS, 64)) is None
    assert router.best_adapter_replica([new], "sql") is None
    assert choose(router, [new], pending(prompt(19, 2))) == ["new"]  # hashes at DEFAULT_BLOCK_SIZE


def test_autoscaling_reads_the_signals_the_replica_sends():
    """Serve aggregates each replica's record_autoscaling_stats() per key: the policy reads those keys."""
    _, queueing = replica_reports(make_stats(num_waiting=9, kv_blocks_total=100, kv_blocks_free=100))
    _, hot = replica_reports(make_stats(kv_blocks_total=100, kv_blocks_free=4))
    _, calm = replica_reports(make_stats(num_waiting=1, kv_blocks_total=100, kv_blocks_free=50))
    assert decide(ctx(1, ongoing=1, reports=[queueing])) == 2  # 9 waiting > 2 per replica: one more
    assert decide(ctx(1, ongoing=1, reports=[hot])) == 2  # KV 96% used > 90%
    assert decide(ctx(1, ongoing=1, reports=[calm])) == pytest.approx(0.5)


def test_router_policy_registry_lists_valid_names():
    assert router_class("prefix_aware") == "cluster.router:PrefixAwareRouter"
    with pytest.raises(ValueError, match="prefix_aware") as exc:
        router_class("round_robin")
    assert "pow2" in str(exc.value)


# ---- autoscaling policy ----------------------------------------------------------------------------------

def ctx(n: int, ongoing: float, target: float = 2.0, waiting: list[float] | None = None,
        kv: list[float] | None = None, current_target: int | None = None,
        reports: list[dict] | None = None) -> AutoscalingContext:
    """`reports`: each replica's record_autoscaling_stats(), aggregated per key as Serve does."""
    ids = [ReplicaID(unique_id=f"r{i}", deployment_id=DEPLOYMENT) for i in range(n)]
    metrics = {}
    for rid, report in zip(ids, reports or ()):
        for name, value in report.items():
            metrics.setdefault(name, {})[rid] = value
    if waiting is not None:
        metrics["num_waiting"] = dict(zip(ids, waiting))
    if kv is not None:
        metrics["kv_usage"] = dict(zip(ids, kv))
    config = AutoscalingConfig(min_replicas=0, max_replicas=8, target_ongoing_requests=target)
    return AutoscalingContext(
        deployment_id=DEPLOYMENT, deployment_name=DEPLOYMENT.name, app_name=DEPLOYMENT.app_name,
        current_num_replicas=n, target_num_replicas=n if current_target is None else current_target,
        running_replicas=ids, total_num_requests=ongoing, total_queued_requests=0, aggregated_metrics=metrics,
        raw_metrics={}, capacity_adjusted_min_replicas=0, capacity_adjusted_max_replicas=8, policy_state={},
        last_scale_up_time=None, last_scale_down_time=None, current_time=0.0, config=config)


def decide(c: AutoscalingContext, **kw) -> float:
    desired, state = EngineAutoscalingPolicy(**kw)(c)
    assert isinstance(state, dict)
    return desired


def test_scales_up_with_total_ongoing_over_target():
    assert decide(ctx(1, ongoing=10, target=2)) == pytest.approx(5)
    assert decide(ctx(2, ongoing=4, target=2)) == pytest.approx(2)  # at target: hold


def test_scales_down_when_idle():
    assert decide(ctx(3, ongoing=0, waiting=[0, 0, 0], kv=[0.0, 0.0, 0.0])) == 0
    assert decide(ctx(3, ongoing=2, target=2)) < 3


def test_one_more_replica_when_engines_queue():
    assert decide(ctx(2, ongoing=1, waiting=[3, 2])) == 3  # 5 waiting > 2 per replica * 2
    assert decide(ctx(2, ongoing=1, waiting=[2, 2])) == pytest.approx(0.5)  # 4 is not more than 4
    assert decide(ctx(2, ongoing=1, waiting=[3, 2]), waiting_per_replica=5) == pytest.approx(0.5)
    assert decide(ctx(1, ongoing=20, target=2, waiting=[9])) == pytest.approx(10)  # never lowers the target


def test_one_more_replica_when_kv_cache_runs_hot():
    assert decide(ctx(2, ongoing=1, kv=[0.95, 0.93])) == 3
    assert decide(ctx(2, ongoing=1, kv=[0.95, 0.5])) == pytest.approx(0.5)  # mean 0.725
    assert decide(ctx(2, ongoing=1, kv=[0.95, 0.93]), kv_usage_high=0.99) == pytest.approx(0.5)


def test_no_replicas_keeps_current_target():
    assert decide(ctx(0, ongoing=7, current_target=2)) == 2
    assert decide(ctx(0, ongoing=0, current_target=0)) == 0


def test_default_target_is_a_quarter_of_max_ongoing():
    assert default_target_ongoing(256) == 64 and default_target_ongoing(6) == 2 and default_target_ongoing(1) == 1


# ---- app config / builder --------------------------------------------------------------------------------

SPLIT = {"device": "cpu", "colocated": False}  # the ingress and engine deployments apart


def engine_deployment(app):
    """The deployment whose replicas hold the engines: the ingress's bound engine deployment, or the colocated
    one itself (both take the engine config, then whether it takes every core, as their first init args)."""
    dep = app._bound_deployment
    return dep if dep.name == COLOCATED_DEPLOYMENT else dep.init_args[0]._bound_deployment


def test_one_engine_replica_is_colocated_with_its_ingress_unless_the_config_needs_them_apart():
    """`colocated` unset: on for one engine replica behind one ingress on any device, off wherever the config
    asks for something only the split app has; an explicit value wins."""
    def deployments(args: dict) -> set[str]:
        app = build_app(args)
        dep = app._bound_deployment
        names = {dep.name} | ({dep.init_args[0]._bound_deployment.name} if dep.name != COLOCATED_DEPLOYMENT else set())
        assert app_is_colocated(args) == (names == {COLOCATED_DEPLOYMENT}), args
        return names

    assert deployments({"device": "cpu"}) == {COLOCATED_DEPLOYMENT}
    assert deployments({"device": "cpu", "num_replicas": 1, "cpu_threads": 1}) == {COLOCATED_DEPLOYMENT}
    assert deployments({"device": "sim"}) == {COLOCATED_DEPLOYMENT}
    for args in ({"num_replicas": 2}, {"min_replicas": 1, "max_replicas": 2}, {"ingress_replicas": 2},
                 {"ingress_replicas": 1, "ingress_max_replicas": 2}, {"ingress_resources": {"head": 0.01}},
                 {"engine_transport": "grpc"}, {"tensor_parallel_size": 2},
                 {"engine": {"pipeline_parallel_size": 2}}, {"colocated": False}):
        assert deployments({"device": "cpu", **args}) == {"OpenAIIngress", "EngineReplica"}, args
    assert deployments({"device": "sim", "colocated": False}) == {"OpenAIIngress", "EngineReplica"}
    assert deployments({"device": "sim", "num_replicas": 2}) == {"OpenAIIngress", "EngineReplica"}


def test_cli_strings_are_coerced_like_serve_run_args():
    """`serve run serve_app:build_app num_replicas=2 ...` passes every value as a string."""
    app = build_app({"num_replicas": "2", "max_ongoing_requests": "64", "device": "cpu"})  # split: 2
    dep = engine_deployment(app)
    assert dep.num_replicas == 2 and dep.max_ongoing_requests == 64
    cfg = AppConfig(num_replicas="3", upscale_delay_s="2.5", routing_stats_period_s="0.5")
    assert (cfg.num_replicas, cfg.upscale_delay_s, cfg.routing_stats_period_s) == (3, 2.5, 0.5)


def test_cli_strings_are_coerced_for_engine_fields():
    """Engine fields at the top level (`serve run serve_app:build_app block_size=32`) arrive as strings
    too and must be coerced like the app's own fields, not rejected by EngineConfig."""
    app = build_app({"block_size": "32", "max_num_seqs": "8", "device": "cpu"})
    engine_args = engine_deployment(app).init_args[0]
    assert engine_args["block_size"] == 32 and engine_args["max_num_seqs"] == 8


def test_engine_fields_at_top_level_or_nested():
    app = build_app({"block_size": 32, "engine": {"max_num_seqs": 8}, **SPLIT})
    engine_args = engine_deployment(app).init_args[0]
    assert engine_args["block_size"] == 32 and engine_args["max_num_seqs"] == 8
    assert engine_deployment(app).max_ongoing_requests == 8  # defaults to what one engine batches
    # colocated: the replica keeps generation requests to that plus the queue (max_queued_requests, 512)
    assert build_app({"block_size": 32, "engine": {"max_num_seqs": 8}, "device": "cpu"}
                     )._bound_deployment.init_args[2] == 8 + 512


def test_the_only_cpu_engine_replica_takes_every_core_unless_told_otherwise():
    """A lone CPU replica's forward uses every core (Ray would give it OMP_NUM_THREADS=1 for its fractional
    reservation); several replicas, a CPU reservation or cpu_threads of the user's keep Ray's threads."""
    import os

    from cluster.replica import replica_engine_config

    assert engine_deployment(build_app({"device": "cpu"})).init_args[1] is True
    for args in ({"num_replicas": 2}, {"replica_num_cpus": 1}, {"cpu_threads": 1}, {"max_replicas": 2},
                 {"device": "sim"}):
        assert engine_deployment(build_app({"device": "cpu", **args})).init_args[1] is False, args
    cores = len(os.sched_getaffinity(0))
    assert replica_engine_config({"device": "cpu"}, True).cpu_threads == cores
    assert replica_engine_config({"device": "cpu", "cpu_threads": 1}, True).cpu_threads == 1
    assert replica_engine_config({"device": "cpu"}, False).cpu_threads is None


def test_unknown_engine_field_rejected_listing_valid_names():
    with pytest.raises(ValueError) as exc:
        AppConfig(engine={"blok_size": 32})
    assert "blok_size" in str(exc.value) and "block_size" in str(exc.value)


def test_unknown_top_level_field_rejected_listing_valid_names():
    with pytest.raises(ValueError) as exc:
        build_app({"num_replica": 2})
    message = str(exc.value)
    assert "num_replica" in message
    assert "num_replicas" in message and "max_replicas" in message, message


def test_num_replicas_with_max_replicas_rejected():
    with pytest.raises(ValueError, match="num_replicas"):
        AppConfig(num_replicas=2, max_replicas=3)
    with pytest.raises(ValueError, match="min_replicas"):
        AppConfig(min_replicas=3, max_replicas=2)


@pytest.mark.parametrize("args", [{"num_replicas": 0}, {"router": "random"}, {"device": "tpu"},
                                  {"target_ongoing_requests": 0}, {"block_size": 0}, {"pipeline_depth": 4},
                                  {"ingress_replicas": 2, "ingress_max_replicas": 1}])
def test_bad_values_rejected_at_build_time(args):
    with pytest.raises(ValueError):
        build_app({"device": "cpu", **args})


def test_autoscaling_config_built_from_args():
    app = build_app({"min_replicas": "1", "max_replicas": "3", "target_ongoing_requests": "2",
                     "upscale_delay_s": "2", "downscale_delay_s": "5", "device": "cpu"})
    asc = engine_deployment(app)._deployment_config.autoscaling_config
    assert (asc.min_replicas, asc.max_replicas, asc.target_ongoing_requests) == (1, 3, 2)
    assert (asc.upscale_delay_s, asc.downscale_delay_s) == (2, 5)
    assert asc.policy.policy_function == "cluster.autoscaling.EngineAutoscalingPolicy"


def test_ingress_autoscales_between_ingress_replicas_and_ingress_max_replicas():
    fixed = build_app({"device": "cpu", "ingress_replicas": 2})._bound_deployment
    assert fixed.num_replicas == 2 and fixed._deployment_config.autoscaling_config is None
    ingress = build_app({"device": "cpu", "ingress_replicas": 2, "ingress_max_replicas": 4,
                         "ingress_target_ongoing_requests": 64})._bound_deployment
    asc = ingress._deployment_config.autoscaling_config
    assert (asc.min_replicas, asc.initial_replicas, asc.max_replicas, asc.target_ongoing_requests) == (2, 2, 4, 64)


def test_replica_env_reaches_both_deployments_over_the_defaults(monkeypatch):
    monkeypatch.setattr(cpu_alloc, "tcmalloc_path", lambda: None)  # the machine's tcmalloc: the next test
    app = build_app({**SPLIT, "replica_env": {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "1", "X": "y"}})
    for dep in (app._bound_deployment, engine_deployment(app)):
        assert dep.ray_actor_options["runtime_env"]["env_vars"] == {
            "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "1", "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "1", "X": "y"}
    default = build_app(SPLIT)
    for dep in (default._bound_deployment, engine_deployment(default)):
        # user code on Serve's loop; the handle's router on its own, whatever the cluster gives the proxy
        assert dep.ray_actor_options["runtime_env"]["env_vars"] == {
            "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0", "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "1"}


def test_cpu_engine_replicas_preload_tcmalloc_and_nothing_else_does(monkeypatch, tmp_path):
    lib = tmp_path / "libtcmalloc_minimal.so.4"
    monkeypatch.setattr(cpu_alloc, "tcmalloc_path", lambda: str(lib))
    monkeypatch.setenv("LD_PRELOAD", f"/opt/a.so {lib}:/opt/b.so")
    serve_env = {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0", "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "1"}
    app = build_app(SPLIT)
    env = engine_deployment(app).ray_actor_options["runtime_env"]["env_vars"]
    assert env == {**serve_env, "LD_PRELOAD": f"{lib}:/opt/a.so:/opt/b.so",
                   "TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD": str(1 << 50)}
    assert app._bound_deployment.ray_actor_options["runtime_env"]["env_vars"] == serve_env  # not the ingress
    colocated = build_app({"device": "cpu"})._bound_deployment  # the one replica runs the engine: preloaded
    assert colocated.name == COLOCATED_DEPLOYMENT and colocated.ray_actor_options["runtime_env"]["env_vars"] == env
    sim = build_app({"device": "sim"})  # not off CPU; and off CPU the replicas keep Serve's user-code thread
    assert engine_deployment(sim).ray_actor_options["runtime_env"]["env_vars"] == {
        **serve_env, "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "1"}
    split_sim = build_app({"device": "sim", "colocated": False})
    assert split_sim._bound_deployment.ray_actor_options["runtime_env"]["env_vars"] == {  # its ingress likewise
        **serve_env, "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "1"}
    off = build_app({"device": "cpu", "replica_env": {"LD_PRELOAD": ""}})  # the user's word wins
    assert engine_deployment(off).ray_actor_options["runtime_env"]["env_vars"]["LD_PRELOAD"] == ""


def test_fixed_replicas_by_default():
    dep = engine_deployment(build_app({"device": "cpu"}))
    assert dep.num_replicas == 1 and dep._deployment_config.autoscaling_config is None


# ---- LoRA adapter affinity -------------------------------------------------------------------------------

def lora_pending(tokens: list[int], adapter: str) -> SimpleNamespace:
    request = GenerateRequest(f"req-{next(_counter)}", list(tokens), SamplingParams(),
                              lora_request=LoRARequest(adapter, f"/adapters/{adapter}"))
    return SimpleNamespace(args=[request], kwargs={})


def with_adapters(r: FakeReplica, *names: str) -> FakeReplica:
    r.routing_stats["lora_adapters"] = list(names)
    return r


def test_adapter_affinity_prefers_a_replica_holding_the_adapter(router):
    replicas = [replica("idle"), with_adapters(replica("holder", waiting=2), "sql", "chat"),
                with_adapters(replica("other"), "chat")]
    assert choose(router, replicas, lora_pending(prompt(20, 2), "sql"))[0] == "holder"
    assert choose(router, replicas, lora_pending(prompt(20, 2), "chat"))[0] == "other"  # the less loaded holder
    assert choose(router, replicas, lora_pending(prompt(20, 2), "new"))[0] == "idle"  # nobody holds it: load
    assert choose(router, replicas, pending(prompt(20, 2)))[0] == "idle"  # base model: load


def test_adapter_affinity_yields_to_overload_and_remembers_where_it_sent(router):
    busy = with_adapters(replica("busy", waiting=50), "sql")
    idle = replica("idle")
    assert choose(router, [busy, idle], lora_pending(prompt(21, 2), "sql"))[0] == "idle"
    fresh = [replica("a"), replica("b", waiting=1)]
    route(router, fresh, lora_pending(prompt(22, 1), "sql"), to=fresh[1])  # before any report from b
    assert choose(router, fresh, lora_pending(prompt(23, 1), "sql"))[0] == "b"


def test_prefix_hashes_are_per_adapter(router):
    """A replica caching the prompt's blocks for the base model is no prefix match for an adapter request."""
    tokens = prompt(24, 4)
    base = replica("base_cached", waiting=1, hashes=prefix_hashes(tokens, BS, 64))
    assert choose(router, [base, replica("idle")], lora_pending(tokens, "sql"))[0] == "idle"
    lora = LoRARequest("sql", "/adapters/sql")
    cached = replica("lora_cached", waiting=1, hashes=prefix_hashes(tokens, BS, 64, lora.hash_root))
    assert choose(router, [cached, replica("idle")], lora_pending(tokens, "sql"))[0] == "lora_cached"


def test_engine_core_process_default_follows_device_and_topology():
    """`engine_core_process` unset: a process on a GPU and in the simulated device's colocated app, a thread on
    CPU and in the simulated device's split app; an explicit value wins."""
    def core_process(args: dict) -> bool:
        dep = build_app(args)._bound_deployment
        if dep.name == COLOCATED_DEPLOYMENT:
            built = dep.init_kwargs["core_process"]
        else:
            built = dep.init_args[0]._bound_deployment.init_args[2]  # EngineReplica(config, all_cores, core_process)
        assert app_core_process(args) is built  # what the benchmarks ask about the app, the same answer
        return built

    assert core_process({"device": "sim"}) is True
    assert core_process({"device": "sim", "colocated": False}) is False
    assert core_process({"device": "cpu"}) is False
    assert core_process({"device": "cpu", "engine_core_process": True}) is True
    assert core_process({"device": "sim", "engine_core_process": False}) is False


def test_engine_core_own_cpu_reaches_the_engine_replica_in_both_topologies():
    """`engine_core_own_cpu` (default true) is what the engine replica is built with, colocated or split."""
    def own_cpu(args: dict) -> bool:
        dep = build_app(args)._bound_deployment
        if dep.name == COLOCATED_DEPLOYMENT:
            return dep.init_kwargs["core_own_cpu"]
        return dep.init_args[0]._bound_deployment.init_args[4]  # EngineReplica(..., stream_events_per_s, own_cpu)

    assert own_cpu({"device": "sim"}) is True
    assert own_cpu({"device": "sim", "engine_core_own_cpu": False}) is False
    assert own_cpu({"device": "sim", "colocated": False, "engine_core_process": True}) is True
    assert own_cpu({"device": "sim", "colocated": False, "engine_core_own_cpu": False}) is False
