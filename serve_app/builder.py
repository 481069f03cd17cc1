"""App config and builder: `serve run serve_app:app`, `serve run serve_app:build_app model=... num_replicas=2`,
or a Serve config YAML (configs/) pointing at `serve_app:build_app` with args."""

from __future__ import annotations

import dataclasses
import os
import typing
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, field_validator, model_validator
import ray
from ray import serve
from ray.serve.config import AutoscalingConfig, AutoscalingPolicy, RequestRouterConfig

from cluster.autoscaling import EngineAutoscalingPolicy, default_target_ongoing
from cluster.pipeline import stage_bundles
from cluster.tensor_parallel import worker_bundles
from cluster.replica import EngineReplica
from cluster.router import router_class
from engine.cpu import alloc as cpu_alloc
from engine.config import DEFAULT_MODEL_DIR, EngineConfig
from engine.models.tp import check_shardable
from engine.models import load_hf_config, model_spec
from serve_app.ingress import OpenAIIngress
from serve_app.limits import Limits
from serve_app.tool_parsers import get_tool_parser
from serve_app.tools import load_chat_template

INGRESS_MAX_ONGOING = 4096  # per ingress replica: the engines' limits apply behind it
COLOCATED_DEPLOYMENT = "TandemReplica"  # AppConfig.colocated: the one deployment, ingress and engine

# Serve runs a replica's user code in a thread of its own by default. For a CPU engine it runs on Serve's own
# loop (SERVE_ENV): the engine replica's stream generator is then asked for its next chunk only once Ray has
# taken the last one, so whatever the engine committed in between leaves as one chunk, and no item crosses a
# thread twice. The handle's router stays on its own loop: running it on the ingress's loop too
# (RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP=0) added no throughput that survived the noise and raised TTFT under
# heavy load. Measured with bench/bench_serve.py --mode path: docs/serving.md#streams-coalesce-by-themselves.
# Set here, since replicas inherit the cluster's environment and CLUSTER_ENV puts the proxy's router on the
# proxy's loop.
SERVE_ENV = {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0", "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "1"}
# On a GPU (and the simulated one) the replicas keep Serve's own user-code thread: with the engine outrunning the
# serving path, each chunk then carried more tokens and more were streamed, with a lower TTFT, at every load
# measured (1-256 SIMULATED H100 streams, docs/serving.md#streams-coalesce-by-themselves). On CPU, where the
# engine is the bottleneck, the thread measured level or behind, and Serve's loop stays.
SERVE_ENV_ACCELERATOR = {**SERVE_ENV, "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "1"}


def serve_env(device: str) -> dict[str, str]:
    """Serve's switches for the replicas of an app whose engine runs on `device` (cpu, cuda, sim)."""
    return SERVE_ENV if device == "cpu" else SERVE_ENV_ACCELERATOR


# Environment for the whole Ray cluster (scripts/serve.sh exports it; with `ray start`, set it there): Serve's
# HTTP proxy hands requests and their SSE events to the ingress over gRPC instead of Ray actor calls with a
# streaming generator. Serve reads it in the proxy process, which no app option reaches. A gRPC chunk costs
# the proxy and the ingress less CPU than an actor call's, which on a CPU host comes out of the engine's
# cores and at GPU rates limits the streamed tok/s.
# Serve's controller runs its control loop every 0.5 s instead of 0.1 s: each pass asks the GCS for the
# cluster's nodes, at any load, and on a small CPU host what that costs the controller and the GCS comes out
# of the engine's cores. Serve then notices replica starts, deaths and scaling decisions up to 0.4 s later;
# health checks and autoscaling keep their own periods.
# The proxy's router runs on the proxy's own loop (RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP=0, as Serve's
# RAY_SERVE_THROUGHPUT_OPTIMIZED preset sets it) instead of a loop in a thread of its own, so an SSE event no
# longer crosses threads inside the proxy, which saves the proxy CPU per streamed token. Replicas keep the
# separate loop (SERVE_ENV), as measured above for the ingress's handle. What each of them measured:
# docs/serving.md#the-cluster-environment-cluster_env.
# Serve's controller gives a new proxy 5 s to answer its first ready check, counted from the actor's creation,
# then kills it; serve.start() then fails with ActorDiedError. A proxy whose worker process starts on a loaded
# 2-core host can need longer than that (it happened in CI), so the check waits 30 s.
CLUSTER_ENV = {"RAY_SERVE_PROXY_USE_GRPC": "1", "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5",
               "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0", "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "30"}


def apply_cluster_env() -> None:
    """CLUSTER_ENV into this process's environment (a value already set wins), for a process about to start a
    local Ray cluster with ray.init: the cluster's processes, Serve's proxy among them, inherit it."""
    for name, value in CLUSTER_ENV.items():
        os.environ.setdefault(name, value)


_ENGINE_FIELDS = {f.name for f in dataclasses.fields(EngineConfig)} - {"model", "device"}
_ENGINE_TYPES = typing.get_type_hints(EngineConfig)


class AppConfig(BaseModel):
    """Everything `build_app` accepts. Engine fields (block_size, pipeline_depth, ...) may be given at the
    top level or under `engine`; unknown names are rejected with the list of valid ones. LoRA adapters are
    engine fields too: `lora_modules` ({name: PEFT dir}), `lora_dir` (adapters by subdirectory name),
    `max_loras`, `max_lora_rank`; either source turns enable_lora on."""

    model_config = ConfigDict(extra="forbid")

    model: str = str(DEFAULT_MODEL_DIR)
    served_model_name: str | None = None
    # "sim": a simulated accelerator (engine/sim; pick it with the engine fields sim_gpu, sim_eos_rate):
    # the replicas run the real host side at modelled GPU speed, so the HTTP path can be measured at GPU rates.
    device: Literal["auto", "cpu", "cuda", "sim"] = "auto"
    num_replicas: int | None = Field(default=None, ge=1)
    min_replicas: int | None = Field(default=None, ge=0)
    max_replicas: int | None = Field(default=None, ge=1)
    target_ongoing_requests: float | None = Field(default=None, gt=0)
    upscale_delay_s: float = Field(default=10.0, ge=0)
    downscale_delay_s: float = Field(default=60.0, ge=0)
    router: Literal["prefix_aware", "pow2"] = "prefix_aware"
    routing_stats_period_s: float = Field(default=1.0, gt=0)
    max_ongoing_requests: int | None = Field(default=None, ge=1)
    max_queued_requests: int = Field(default=512, ge=-1)
    replica_num_cpus: float | None = Field(default=None, ge=0)
    # Serve's max_replicas_per_node for the engine deployment: 1 spreads the engine replicas one per node, so
    # losing a node costs one replica (docs/serving.md "Multi-node", tests/test_multinode.py). None: Serve's default.
    max_replicas_per_node: int | None = Field(default=None, ge=1)
    ingress_replicas: int = Field(default=1, ge=1)
    # Ray resources each ingress replica asks for (ray_actor_options.resources), e.g. {"head": 0.01} with a
    # custom resource only the head node offers: the ingress then lives beside the head's HTTP proxy and a
    # lost worker node costs only its engine replica (docs/serving.md "Multi-node"). Empty: any node.
    ingress_resources: dict[str, float] = Field(default_factory=dict)
    # Ingress autoscaling (Serve's default policy on ongoing requests): set ingress_max_replicas above
    # ingress_replicas and the ingress scales between the two, aiming at ingress_target_ongoing_requests
    # streams per ingress replica. Every proxy spreads its requests over the ingress replicas.
    ingress_max_replicas: int | None = Field(default=None, ge=1)
    ingress_target_ongoing_requests: float = Field(default=128.0, gt=0)
    # Environment of the ingress and engine replica processes, over serve_env(device) (Serve's own switches are
    # read when a replica starts; see SERVE_ENV for the defaults and why) and, for CPU engine replicas, tcmalloc
    # preloaded where it is installed (engine/cpu/alloc.py; {"LD_PRELOAD": ""} runs them on glibc's malloc).
    replica_env: dict[str, str] = Field(default_factory=dict)
    # How the ingress streams from the engine replicas. "grpc": Serve's gRPC transport between deployments,
    # less CPU per streamed chunk on both ends. "ray": Ray actor calls with a streaming
    # generator (Serve's default), under which the engine replica's generator is asked for its next chunk
    # only once Ray has taken the last one, so a stream the serving path cannot keep up with coalesces
    # (SERVE_ENV); over gRPC it does not. "auto": grpc on CPU, where the engine is the bottleneck and every
    # chunk's CPU comes out of its cores, ray on a GPU or the simulated one, where coalescing outweighs the
    # cheaper chunk, a lone stream's TTFT aside (docs/serving.md#the-engine-hop-engine_transport).
    engine_transport: Literal["auto", "grpc", "ray"] = "auto"
    # The ingress and its engine in one replica (serve_app/colocated.py): no engine hop, one Python process
    # fewer per streamed chunk, which on a CPU host comes out of the forward's cores
    # (docs/serving.md#colocated-the-engine-inside-the-ingress). Gives up the engine router's prefix affinity
    # across replicas, autoscaling, ingress replicas apart from engines, pipeline and tensor parallelism. None
    # (the default): on where the app is one engine replica behind one ingress, on any device, and none of
    # those is asked for (`colocated_by_default`); false keeps the two deployments apart.
    colocated: bool | None = None
    # Pipeline parallelism (engine field pipeline_parallel_size > 1): each replica's placement group holds
    # the replica plus one bundle per stage (a GPU each on cuda); STRICT_PACK keeps a stage group on one
    # node, PACK/SPREAD let it span nodes.
    pp_placement_strategy: Literal["STRICT_PACK", "PACK", "SPREAD"] = "STRICT_PACK"
    # Where each engine replica runs its engine core (scheduler, KV, runner, sampler): true, in a child process,
    # the replica keeping only the frontend (text, stop strings, streams), so the core's loop never waits on
    # Serve's code for the GIL (engine/core_proc.py); false, on a thread of the replica. None (auto,
    # `core_process_by_default`): a process on a GPU and in the simulated device's colocated app, a thread on
    # CPU (docs/serving.md#the-engine-core-process has the figures). Pipeline- and tensor-parallel engines drive
    # Ray actors from the core and always keep it on a replica thread.
    engine_core_process: bool | None = None
    # With the engine core in a process: the engine replica's own threads (Serve's, Ray's, the frontend's) keep
    # off one CPU, the highest-numbered it may use, which the core then has to itself among them; false lets
    # them share every CPU (docs/serving.md#the-engine-core-process).
    engine_core_own_cpu: bool = True
    # Streams are paced so that one engine replica's streams together get at most about this many chunks a
    # second (a stream's interval: open streams / this; its first chunk and its finish are never held). The
    # serving path (proxy, ingress, replica) costs per chunk, not per token: under load each chunk carries
    # more tokens instead of the path falling behind the engine. None: every commit is its own chunk whenever
    # the path keeps up (docs/serving.md#streams-coalesce-by-themselves says what each measured).
    stream_events_per_s: float | None = Field(default=1000.0, gt=0)
    # API keys (vLLM's --api-key): with any set, every /v1/* route needs `Authorization: Bearer <key>`.
    # None: the TANDEM_API_KEY environment variable of the process building the app (comma-separated).
    api_key: str | list[str] | None = None
    limits: Limits = Field(default_factory=Limits)  # per-request limits (serve_app/limits.py)
    # Draining: a replica being removed stops taking requests and lets in-flight ones finish for up to
    # graceful_shutdown_timeout_s (long enough for a full-length generation), after which Serve stops it
    # and its remaining streams end with a replica_died error. Health: Serve calls EngineReplica.check_health
    # every health_check_period_s (a dead or stalled engine loop, or a device fault, fails it).
    graceful_shutdown_timeout_s: float = Field(default=300.0, ge=0)
    graceful_shutdown_wait_loop_s: float = Field(default=1.0, gt=0)
    health_check_period_s: float = Field(default=5.0, gt=0)
    health_check_timeout_s: float = Field(default=30.0, gt=0)
    engine: dict[str, Any] = Field(default_factory=dict)
    # Tool calling (serve_app/tool_parsers.py): the format this model writes its calls in ("hermes" for
    # Qwen2.5/Qwen3, "llama3_json", "mistral"). None: requests with tools get a 400.
    tool_parser: str | None = None
    # vLLM's --chat-template: a Jinja chat template file, or the template itself, used instead of the tokenizer's
    # (for a model that has none, or to replace it). Checked for Jinja syntax when the app is built.
    chat_template: str | None = None

    @field_validator("chat_template")
    @classmethod
    def _loadable_template(cls, v: str | None) -> str | None:
        if v is not None:
            load_chat_template(v)  # ValueError naming the field
        return v

    @field_validator("tool_parser")
    @classmethod
    def _known_parser(cls, v: str | None) -> str | None:
        if v is not None:
            get_tool_parser(v)  # ValueError listing the valid names
        return v

    @field_validator("api_key")
    @classmethod
    def _keys_are_tokens(cls, v: str | list[str] | None) -> str | list[str] | None:
        for key in [v] if isinstance(v, str) else v or []:
            if not key or any(c.isspace() for c in key):
                raise ValueError("api_key: every key must be a non-empty string without whitespace")
        return v

    @property
    def api_keys(self) -> tuple[str, ...]:
        keys = self.api_key if self.api_key is not None else os.environ.get("TANDEM_API_KEY", "").split(",")
        return tuple(k.strip() for k in ([keys] if isinstance(keys, str) else keys) if k.strip())

    @model_validator(mode="before")
    @classmethod
    def _lift_engine_fields(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        data = dict(data)
        engine = dict(data.get("engine") or {})
        for name in [k for k in data if k in _ENGINE_FIELDS]:
            engine[name] = data.pop(name)
        unknown = set(engine) - _ENGINE_FIELDS
        if unknown:
            raise ValueError(f"unknown engine fields {sorted(unknown)}; valid: {sorted(_ENGINE_FIELDS)}")
        unknown = set(data) - set(cls.model_fields) - {"engine"}
        if unknown:
            raise ValueError(f"unknown fields {sorted(unknown)}; valid app fields: {sorted(cls.model_fields)}; "
                             f"valid engine fields: {sorted(_ENGINE_FIELDS)}")
        # `serve run ... block_size=32` passes strings: coerce engine fields to their declared types (a dict such as
        # speculative_config='{"method": "ngram", ...}' or lora_modules as JSON).
        data["engine"] = {k: _coerce(_ENGINE_TYPES[k], v) for k, v in engine.items()}
        return data

    @model_validator(mode="after")
    def _check_scaling(self) -> "AppConfig":
        if self.num_replicas is not None and self.max_replicas is not None:
            raise ValueError("give either num_replicas or min_replicas/max_replicas (autoscaling), not both")
        if self.max_replicas is not None and (self.min_replicas or 0) > self.max_replicas:
            raise ValueError("min_replicas must be <= max_replicas")
        if self.ingress_max_replicas is not None and self.ingress_max_replicas < self.ingress_replicas:
            raise ValueError("ingress_max_replicas must be >= ingress_replicas")
        if self.colocated and (split_only := self.split_only()):
            raise ValueError(f"colocated runs one engine inside each ingress replica; {', '.join(split_only)} "
                             "needs the ingress and engine deployments apart (colocated: false)")
        return self

    def split_only(self) -> list[str]:
        """What this config asks for that only the split app (ingress and engine deployments apart) has."""
        return [name for name, on in (
            ("min_replicas/max_replicas (autoscaling)", self.autoscaling),
            ("ingress_replicas > 1", self.ingress_replicas > 1),
            ("ingress_max_replicas", self.ingress_max_replicas is not None),
            ("pipeline_parallel_size > 1", int(self.engine.get("pipeline_parallel_size", 1)) > 1),
            ("tensor_parallel_size > 1", int(self.engine.get("tensor_parallel_size", 1)) > 1)) if on]

    @property
    def autoscaling(self) -> bool:
        return self.max_replicas is not None

    @property
    def is_colocated(self) -> bool:
        """Whether the app is built colocated (`colocated`, or its default)."""
        return self.colocated if self.colocated is not None else colocated_by_default(self)


def _coerce(declared, value):
    adapter = TypeAdapter(declared)
    if isinstance(value, str) and value.lstrip()[:1] == "{" and "dict" in str(declared):
        return adapter.validate_json(value)
    return adapter.validate_python(value)


def colocated_by_default(cfg: AppConfig) -> bool:
    """`colocated` left unset: on for one engine replica behind one ingress, on every device. The engine hop is
    a Python process and a Serve call per streamed chunk: on a CPU host its CPU comes out of the forward's
    cores, and at GPU rates it is what limits the streamed tokens and adds to TTFT (measured on both in
    docs/serving.md#colocated-the-engine-inside-the-ingress). With one replica the split app's retry of a
    request whose engine died before its first token has no other replica to go to. Off wherever the config
    asks for something only the split app has: several or autoscaled replicas, ingress scaling or placement,
    pipeline or tensor parallelism, or an engine_transport of its own choosing."""
    return (cfg.num_replicas or 1) == 1 and not cfg.split_only() and not cfg.ingress_resources and \
        cfg.engine_transport == "auto"


def core_process_by_default(device: str, colocated: bool) -> bool:
    """`engine_core_process` left unset: the core in a process of its own on a GPU, and on the simulated device
    when the app is colocated; on a replica thread on CPU (the forward takes every core there, and a process
    only adds a competitor) and in the simulated device's split app. Measured on 2-core VMs:
    docs/serving.md#the-engine-core-process."""
    return device == "cuda" or (device == "sim" and colocated)


def app_is_colocated(args: dict | None = None) -> bool:
    """Whether build_app(args) builds the colocated app (one deployment, COLOCATED_DEPLOYMENT)."""
    return AppConfig(**(args or {})).is_colocated


def app_core_process(args: dict | None = None) -> bool:
    """Whether build_app(args) runs its engine replica's core in a process of its own."""
    cfg = AppConfig(**(args or {}))
    device = _resolve_device(cfg.device)
    return _core_process(cfg, EngineConfig(model=cfg.model, device=device, **cfg.engine), device)


def _core_process(cfg: AppConfig, engine_cfg: EngineConfig, device: str) -> bool:
    """engine_core_process resolved: its default (core_process_by_default), or the value given; pipeline- and
    tensor-parallel engines (but tensor parallelism on the simulated device) keep the core on a replica thread."""
    chosen = core_process_by_default(device, cfg.is_colocated) if cfg.engine_core_process is None \
        else cfg.engine_core_process
    return chosen and engine_cfg.pipeline_parallel_size == 1 and \
        (engine_cfg.tensor_parallel_size == 1 or device == "sim")


def engine_transport(choice: str, device: str) -> str:
    """AppConfig.engine_transport resolved for a device: "auto" is grpc on CPU, ray elsewhere."""
    if choice != "auto":
        return choice
    return "grpc" if device == "cpu" else "ray"


def build_app(args: dict | None = None) -> serve.Application:
    """Build the OpenAI ingress bound to an engine-replica deployment."""
    cfg = AppConfig(**(args or {}))
    if not ray.is_initialized():  # `serve run serve_app:app` builds the app before it starts a local cluster
        apply_cluster_env()
    device = _resolve_device(cfg.device)
    engine_cfg = EngineConfig(model=cfg.model, device=device, **cfg.engine)  # validated now, not in a replica
    hf_config = load_hf_config(engine_cfg.model_dir)
    max_model_len = min(engine_cfg.max_model_len or model_spec(hf_config).max_position_embeddings,
                        model_spec(hf_config).max_position_embeddings)
    check_shardable(model_spec(hf_config), engine_cfg.tensor_parallel_size)  # a bad split fails here, not in Serve
    # The app's only engine replica on CPU takes the node's cores (cluster/replica.py); with several, or a CPU
    # reservation of the user's, each replica keeps the threads Ray gives it (its CPU reservation).
    all_cores = device == "cpu" and engine_cfg.cpu_threads is None and cfg.replica_num_cpus is None and \
        not cfg.autoscaling and (cfg.num_replicas or 1) == 1 and engine_cfg.pipeline_parallel_size == 1 and \
        engine_cfg.tensor_parallel_size == 1
    # What the ingress is built with, split or colocated: model, name, context, keys, limits, adapters, tools
    ingress_args = (engine_cfg.model_dir, cfg.served_model_name or _default_name(cfg.model), max_model_len,
                    cfg.api_keys, cfg.limits.model_dump())
    ingress_kwargs = dict(lora_modules=engine_cfg.lora_modules, lora_dir=engine_cfg.lora_dir,
                          tool_parser=cfg.tool_parser, sampling_defaults=engine_cfg.sampling_defaults(),
                          chat_template=cfg.chat_template and load_chat_template(cfg.chat_template))
    colocated = cfg.is_colocated
    core_process = _core_process(cfg, engine_cfg, device)
    if colocated:
        max_in_flight = None if cfg.max_queued_requests < 0 else \
            _engine_max_ongoing(cfg, engine_cfg) + cfg.max_queued_requests
        return _colocated_deployment(cfg, engine_cfg, device).bind(
            dataclasses.asdict(engine_cfg), all_cores, max_in_flight, *ingress_args, core_process=core_process,
            stream_events_per_s=cfg.stream_events_per_s, core_own_cpu=cfg.engine_core_own_cpu, **ingress_kwargs)
    engine = _engine_deployment(cfg, engine_cfg, device).bind(dataclasses.asdict(engine_cfg), all_cores,
                                                               core_process, cfg.stream_events_per_s,
                                                               cfg.engine_core_own_cpu)
    scaling: dict[str, Any] = {"num_replicas": cfg.ingress_replicas}
    if cfg.ingress_max_replicas is not None and cfg.ingress_max_replicas > cfg.ingress_replicas:
        scaling = {"autoscaling_config": AutoscalingConfig(
            min_replicas=cfg.ingress_replicas, initial_replicas=cfg.ingress_replicas,
            max_replicas=cfg.ingress_max_replicas, target_ongoing_requests=cfg.ingress_target_ongoing_requests,
            upscale_delay_s=cfg.upscale_delay_s, downscale_delay_s=cfg.downscale_delay_s)}
    ingress = serve.deployment(OpenAIIngress, name="OpenAIIngress", max_ongoing_requests=INGRESS_MAX_ONGOING,
                               ray_actor_options={"num_cpus": 0, **_user_code(cfg, device),
                                                  **({"resources": cfg.ingress_resources} if cfg.ingress_resources
                                                     else {})},
                               graceful_shutdown_timeout_s=cfg.graceful_shutdown_timeout_s,
                               graceful_shutdown_wait_loop_s=cfg.graceful_shutdown_wait_loop_s, **scaling)
    return ingress.bind(engine, *ingress_args, **ingress_kwargs,
                        engine_transport=engine_transport(cfg.engine_transport, device))


def _engine_max_ongoing(cfg: AppConfig, engine_cfg: EngineConfig) -> int:
    """Requests an engine replica takes at once (more wait in the handle's queue, max_queued_requests)."""
    return cfg.max_ongoing_requests or engine_cfg.max_num_seqs


def _engine_replica_options(cfg: AppConfig, engine_cfg: EngineConfig, device: str) -> dict[str, Any]:
    """Serve options of any replica that hosts an engine, split or colocated: its process (CPUs, a GPU,
    tcmalloc on CPU), its health checks, its draining and its spread over nodes."""
    actor_options: dict[str, Any] = {"num_cpus": cfg.replica_num_cpus if cfg.replica_num_cpus is not None
                                     else (1 if device == "cuda" else 0.5),
                                     **_user_code(cfg, device, cpu_alloc.preload_env() if device == "cpu" else {})}
    if device == "cuda" and engine_cfg.pipeline_parallel_size == 1:
        actor_options["num_gpus"] = 1
    options: dict[str, Any] = dict(
        ray_actor_options=actor_options, health_check_period_s=cfg.health_check_period_s,
        health_check_timeout_s=cfg.health_check_timeout_s,
        graceful_shutdown_timeout_s=cfg.graceful_shutdown_timeout_s,
        graceful_shutdown_wait_loop_s=cfg.graceful_shutdown_wait_loop_s)
    if cfg.max_replicas_per_node is not None:
        options["max_replicas_per_node"] = cfg.max_replicas_per_node
    return options


def _engine_deployment(cfg: AppConfig, engine_cfg: EngineConfig, device: str):
    max_ongoing = _engine_max_ongoing(cfg, engine_cfg)
    options = _engine_replica_options(cfg, engine_cfg, device)
    actor_options = options["ray_actor_options"]
    pp = engine_cfg.pipeline_parallel_size
    options.update(
        name="EngineReplica", max_ongoing_requests=max_ongoing, max_queued_requests=cfg.max_queued_requests,
        request_router_config=RequestRouterConfig(
            request_router_class=router_class(cfg.router),
            request_routing_stats_period_s=cfg.routing_stats_period_s,
            request_routing_stats_timeout_s=max(5.0, 4 * cfg.routing_stats_period_s)))
    tp = engine_cfg.tensor_parallel_size
    if pp > 1:  # the replica drives; its stage actors (cluster/pipeline.py) take bundles 1..pp, each bundle
        # sized for the stage's whole TP group (one node per stage group; stages may span nodes)
        options["placement_group_bundles"] = [{"CPU": actor_options["num_cpus"]}] + stage_bundles(
            pp, device, engine_cfg.pp_stage_num_cpus, tp)
        options["placement_group_strategy"] = cfg.pp_placement_strategy
    elif tp > 1 and engine_cfg.device != "sim":  # the replica is rank 0; its worker ranks
        # (cluster/tensor_parallel.py) take bundles 1..tp-1, packed on the replica's node (the group talks over
        # loopback); a simulated device only models its ranks
        options["placement_group_bundles"] = [{"CPU": actor_options["num_cpus"]}] + worker_bundles(
            tp - 1, device, engine_cfg.tp_worker_num_cpus)
        options["placement_group_strategy"] = "STRICT_PACK"
    if cfg.autoscaling:
        options["autoscaling_config"] = AutoscalingConfig(
            min_replicas=cfg.min_replicas if cfg.min_replicas is not None else 1,
            max_replicas=cfg.max_replicas,
            target_ongoing_requests=cfg.target_ongoing_requests or default_target_ongoing(max_ongoing),
            upscale_delay_s=cfg.upscale_delay_s, downscale_delay_s=cfg.downscale_delay_s,
            metrics_interval_s=2.0, look_back_period_s=10.0,
            policy=AutoscalingPolicy(policy_function=EngineAutoscalingPolicy))
    else:
        options["num_replicas"] = cfg.num_replicas or 1
    return serve.deployment(EngineReplica, **options)


def _colocated_deployment(cfg: AppConfig, engine_cfg: EngineConfig, device: str):
    """AppConfig.colocated: the ingress with its engine inside (serve_app/colocated.py), placed as an engine
    replica. Serve sends it everything, as it does an ingress; the replica itself keeps generation requests
    to the engine's max_ongoing_requests + max_queued_requests and answers the rest 503 (as the split app's
    ingress does), while /health and /v1/models always get through."""
    from serve_app.colocated import ColocatedIngress

    return serve.deployment(ColocatedIngress, name=COLOCATED_DEPLOYMENT, max_ongoing_requests=INGRESS_MAX_ONGOING,
                            num_replicas=cfg.num_replicas or 1, **_engine_replica_options(cfg, engine_cfg, device))


def _user_code(cfg: AppConfig, device: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Actor options giving a replica process its environment (Serve reads its switches when it starts): the
    device's serve_env(), then `env` (a CPU engine replica's: tcmalloc preloaded, engine/cpu/alloc.py), then the
    user's replica_env."""
    return {"runtime_env": {"env_vars": {**serve_env(device), **(env or {}), **cfg.replica_env}}}


def _resolve_device(device: str) -> str:
    if device != "auto":
        return device
    import ray

    if ray.is_initialized():
        return "cuda" if ray.cluster_resources().get("GPU", 0) > 0 else "cpu"
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _default_name(model: str) -> str:
    from pathlib import Path

    return "tandem-default" if Path(model) == DEFAULT_MODEL_DIR else Path(model).name
